// Software prefetch for the vector Adam loops (adam_avx2.cpp, adam_avx512.cpp; SSE's prefetcht0,
// which every x86-64 has). always_inline, not a preference: a prefetch has no effect gcc can see, so gcc 12 judged a
// helper made only of prefetches a const function, and deleted its calls (in the 16-bit-gradient variants,
// where it did not inline the helper early) before inlining could keep them.
//
// kQPrefetch elements ahead: one line of each streamed array per 64 bytes it advances (params 4 B, grads GSize,
// moments 4 or 2 B, codes 1 B per element). The int8 step does ~4x the arithmetic per byte of the fp32 one, so the
// cores issue its loads late, and the hardware prefetchers restart at every 4 KiB page. Measured at 50M params, 2
// threads, on a Zen 5 (benchmarks/kernel/README.md, session 13), paired against the same build without: AVX512
// (with its pipelined blocks) 0.96-0.99x the time over four runs, 1024 or 4096 ahead no better; the AVX2 loop (held
// to AVX2 on that CPU) 0.90-1.03x, mean 0.98, over seven: within the noise there, harmless; on an Intel core
// (session 30) no prefetch was 1.21x slower. The one-pass fp32/bf16 loops: step_prefetch below (session 32, Intel;
// not measured on a Zen core). A prefetch never faults, so the addresses past a range's end (formed as integers,
// not pointers) are harmless.
#pragma once
#include <xmmintrin.h>

#include <cstddef>
#include <cstdint>

namespace hzo {
namespace {

constexpr size_t kQPrefetch = 2048;

__attribute__((always_inline)) inline void prefetch_line(const void* base, size_t byte_offset) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + byte_offset), _MM_HINT_T0);
}

// The one-pass steps (fp32 and bf16 moments) the same way, for a range that starts at any element: one line of an
// array of Size-byte elements per 64 bytes it advances, at the vector whose first byte lies in the first W * Size
// bytes of a 64-byte stretch counted from the array's base (exactly one such vector per stretch, so every line of
// the range ahead is asked for once, whatever the base's alignment). Their loads were issued late too. On the Intel
// core of session 32 (2 threads, 50M params, bf16 grads and param out, alternated with the build without, medians):
// bf16 moments 28.4 -> 20.9 ms (0.68 -> 0.95 of the streaming bound), fp32 moments 0.905-0.915x the time (fp32
// grads, no param out: 0.95-0.98x); the streaming bound's own loop (no arithmetic) gains nothing from it.
template <size_t W, size_t Size>
__attribute__((always_inline)) inline void prefetch_per_line(const void* base, size_t i) {
  if (W * Size >= 64 || i * Size % 64 < W * Size) prefetch_line(base, (i + kQPrefetch) * Size);
}

// GSize: bytes per gradient, SSize per moment (1: int8 codes, whose ranges start on a block, so the same lines as
// a test of i % 64 for them, and of i * 4 % 64 for the params).
template <size_t W, size_t GSize, size_t SSize>
__attribute__((always_inline)) inline void step_prefetch(const float* params, const void* grad, const void* m,
                                                         const void* v, size_t i) {
  prefetch_per_line<W, 4>(params, i);
  prefetch_per_line<W, GSize>(grad, i);
  prefetch_per_line<W, SSize>(m, i);
  prefetch_per_line<W, SSize>(v, i);
}

// The same lines for a span of kQSpan elements (one line of each code array) in one go: a loop over
// spans then needs no test per vector.
constexpr size_t kQSpan = 64;
template <size_t GSize>
__attribute__((always_inline)) inline void q8_prefetch_span(const float* params, const void* grad, const int8_t* mc,
                                                            const uint8_t* vc, size_t i) {
  const size_t ahead = i + kQPrefetch;
  for (size_t l = 0; l < kQSpan * 4; l += 64) prefetch_line(params, ahead * 4 + l);
  for (size_t l = 0; l < kQSpan * GSize; l += 64) prefetch_line(grad, ahead * GSize + l);
  prefetch_line(mc, ahead);
  prefetch_line(vc, ahead);
}

}  // namespace
}  // namespace hzo
