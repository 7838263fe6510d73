// The threads the drivers run on, and the one static split of an element range over them.
#pragma once
#include <algorithm>
#include <cstddef>
#include <type_traits>

namespace hzo {

// Runs fn(ctx, tid) for tid in [0, nthreads): part 0 on the caller, the others on parked pool
// workers (or short-lived threads when the pool is busy or off), each with the caller's MXCSR.
void run_threads(int nthreads, void (*fn)(void*, int), void* ctx);
// Persistent worker pool (default) or fresh std::threads per call; results are the same either way.
void set_thread_pool(bool on);

template <typename F>
void run_threads(int nthreads, F&& body) {
  if (nthreads <= 1) {
    body(0);
    return;
  }
  using B = std::remove_reference_t<F>;
  run_threads(nthreads, [](void* ctx, int tid) { (*static_cast<B*>(ctx))(tid); }, static_cast<void*>(&body));
}

// Below this many elements per thread, waking another thread (~15 us) costs more than it saves
// (measured: 64K elements of mixed Adam take ~40 us on one thread, ~50 us on two).
constexpr size_t kMinPerThread = size_t(1) << 16;

// The element-wise split: [0, n) cut into at most nthreads contiguous parts whose starts are
// multiples of `align` (64 elements keeps every fp32 output 64-byte aligned, so threads never share
// a cache line; the quantized kernel passes its block size). The parts depend only on n, align and
// the thread count, and every kernel's result is independent of the split, so any nthreads gives
// the same bits. fn(begin, end) is called once per non-empty part.
template <typename F>
void parallel_ranges(size_t n, size_t align, int nthreads, F&& fn) {
  const size_t units = (n + align - 1) / align;
  size_t t = static_cast<size_t>(std::max(nthreads, 1));
  t = std::min(t, std::max<size_t>(1, n / kMinPerThread));
  t = std::min(t, std::max<size_t>(1, units));
  const size_t per = ((units + t - 1) / t) * align;
  run_threads(static_cast<int>(t), [&](int tid) {
    const size_t b = std::min(n, per * tid), e = std::min(n, per * (tid + 1));
    if (b < e) fn(b, e);
  });
}

}  // namespace hzo
