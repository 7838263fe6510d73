// AVX512 on a CPU without it, for tests only: force-included (-include) into csrc/adam_avx512.cpp
// when CMake is configured with -DHZO_EMULATE_AVX512=ON. SIMDe (github.com/simd-everywhere/simde,
// pip package cmeel-simde) implements the _mm512_* intrinsics lane by lane in portable C on top of
// AVX2; its native aliases map our unchanged source onto them. So the AVX512 kernels' logic (the
// lane layout, masks, tails, packs, the thread-independent random bits) runs, and the test suite
// checks it against the same references as the native instruction sets. What it cannot check is
// the hardware itself: an instruction whose real semantics differ from SIMDe's model would pass here.
//
// SIMDe 0.8.2 lacks the few intrinsics below; each is written from its definition in Intel's
// Intrinsics Guide, lane by lane.
#pragma once
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace hzo_emu {

template <class To, class From>
inline To bits_as(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "size");
  To t;
  std::memcpy(&t, &x, sizeof(To));
  return t;
}

struct I32x16 { int32_t l[16]; };
struct I8x16 { int8_t l[16]; };
struct U8x16 { uint8_t l[16]; };
struct I16x16 { int16_t l[16]; };

// vpmovsxbd: 16 signed bytes -> 16 int32
inline simde__m512i cvtepi8_epi32(simde__m128i a) {
  const I8x16 in = bits_as<I8x16>(a);
  I32x16 out;
  for (int i = 0; i < 16; ++i) out.l[i] = in.l[i];
  return bits_as<simde__m512i>(out);
}
// vpmovzxbd: 16 unsigned bytes -> 16 int32
inline simde__m512i cvtepu8_epi32(simde__m128i a) {
  const U8x16 in = bits_as<U8x16>(a);
  I32x16 out;
  for (int i = 0; i < 16; ++i) out.l[i] = in.l[i];
  return bits_as<simde__m512i>(out);
}
// vpmovdb: truncate each int32 to its low byte
inline simde__m128i cvtepi32_epi8(simde__m512i a) {
  const I32x16 in = bits_as<I32x16>(a);
  I8x16 out;
  for (int i = 0; i < 16; ++i) out.l[i] = static_cast<int8_t>(static_cast<uint32_t>(in.l[i]) & 0xffu);
  return bits_as<simde__m128i>(out);
}
// vpmovdw: truncate each int32 to its low 16 bits
inline simde__m256i cvtepi32_epi16(simde__m512i a) {
  const I32x16 in = bits_as<I32x16>(a);
  I16x16 out;
  for (int i = 0; i < 16; ++i) out.l[i] = static_cast<int16_t>(static_cast<uint32_t>(in.l[i]) & 0xffffu);
  return bits_as<simde__m256i>(out);
}
// vcvtps2pd: 8 floats -> 8 doubles (exact)
inline simde__m512d cvtps_pd(simde__m256 a) {
  float in[8];
  double out[8];
  std::memcpy(in, &a, sizeof(in));
  for (int i = 0; i < 8; ++i) out[i] = in[i];
  return bits_as<simde__m512d>(out);
}
// vcvtps2ph: the two 256-bit halves through F16C's vcvtps2ph (this TU is built with -mf16c), the
// same conversion and rounding immediate as the 512-bit form
inline simde__m256i cvtps_ph(simde__m512 a, int rounding) {
  simde__m256 h[2];
  std::memcpy(h, &a, sizeof(h));
  __m128i out[2];
  // the immediate must be a constant: the kernels pass only round-to-nearest (no exceptions)
  if (rounding != (SIMDE_MM_FROUND_TO_NEAREST_INT | SIMDE_MM_FROUND_NO_EXC)) std::abort();
  for (int i = 0; i < 2; ++i)
    out[i] = ::_mm256_cvtps_ph(bits_as<__m256>(h[i]), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return bits_as<simde__m256i>(out);
}
// vmovntps: a plain store, but with the hardware's rule that the address is 64-byte aligned
inline void stream_ps(float* p, simde__m512 a) {
  if (reinterpret_cast<uintptr_t>(p) % 64 != 0) std::abort();  // real hardware faults (#GP)
  std::memcpy(p, &a, sizeof(a));
}
// vmovntdq: the same rule (the int8 loop streams a bf16 param out 64 bytes at a time)
inline void stream_si512(void* p, simde__m512i a) {
  if (reinterpret_cast<uintptr_t>(p) % 64 != 0) std::abort();  // real hardware faults (#GP)
  std::memcpy(p, &a, sizeof(a));
}

}  // namespace hzo_emu

#define _mm512_cvtepi8_epi32(a) hzo_emu::cvtepi8_epi32(a)
#define _mm512_cvtepu8_epi32(a) hzo_emu::cvtepu8_epi32(a)
#define _mm512_cvtepi32_epi8(a) hzo_emu::cvtepi32_epi8(a)
#define _mm512_cvtepi32_epi16(a) hzo_emu::cvtepi32_epi16(a)
#define _mm512_cvtps_pd(a) hzo_emu::cvtps_pd(a)
#define _mm512_cvtps_ph(a, r) hzo_emu::cvtps_ph(a, r)
#define _mm512_stream_ps(p, a) hzo_emu::stream_ps(p, a)
#define _mm512_stream_si512(p, a) hzo_emu::stream_si512(p, a)
