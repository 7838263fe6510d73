// The AVX512 lane images of quant.h's 8-bit moment codes (q_mag/dq_mag/q_m/q_v/dq_m/dq_v) and of
// q8_round_bits, one operation for one, so the codes are bit-identical to the scalar reference.
// Included only by adam_avx512.cpp, so it is compiled only with that unit's AVX512 flags.
#pragma once
#include <immintrin.h>

#include "quant.h"

namespace hzo {
namespace {

template <int EB>
inline __m512 dq_mag_vec(__m512i mag) {
  const __m512i c = _mm512_set1_epi32(QFormat<EB>::kShiftBits);
  return _mm512_sub_ps(_mm512_castsi512_ps(_mm512_add_epi32(c, _mm512_slli_epi32(mag, 20))), _mm512_castsi512_ps(c));
}

inline __m512 dq_m_vec(const int8_t* p) {
  const __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i x = _mm512_castps_si512(dq_mag_vec<16>(_mm512_abs_epi32(c)));
  return _mm512_castsi512_ps(_mm512_xor_si512(x, _mm512_and_si512(c, _mm512_set1_epi32(INT32_MIN))));
}

inline __m512 dq_v_vec(const uint8_t* p) {
  return dq_mag_vec<32>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// q_mag_r lane by lane: n >= 0 (or a NaN), r < 2^20 per lane (the min compares unsigned).
template <int EB>
inline __m512i q_mag_r_vec(__m512 n, __m512i r) {
  using F = QFormat<EB>;
  const __m512i c = _mm512_set1_epi32(F::kShiftBits);
  const __m512i u = _mm512_castps_si512(_mm512_add_ps(n, _mm512_castsi512_ps(c)));
  const __m512i mag = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_sub_epi32(r, c)), 20);
  return _mm512_min_epu32(mag, _mm512_set1_epi32(F::kMaxMag));
}
template <int EB>
inline __m512i q_mag_vec(__m512 n) { return q_mag_r_vec<EB>(n, _mm512_set1_epi32(1 << 19)); }

// q8_round_bits for the 16 lanes whose index * 0x9e3779b1 is in weyl (round_at), and weyl moved on by
// 16 indices (round_hi20).
inline __m512i round_at(__m512i weyl, __m512i seed) { return _mm512_srli_epi32(_mm512_xor_si512(weyl, seed), 12); }
inline __m512i round_hi20(__m512i& weyl, __m512i seed) {
  const __m512i r = round_at(weyl, seed);
  weyl = _mm512_add_epi32(weyl, _mm512_set1_epi32(static_cast<int>(16u * 0x9e3779b1u)));
  return r;
}

// weyl for round_hi20: lane l holds (first + l) * 0x9e3779b1 mod 2^32.
inline __m512i weyl_of(uint64_t first) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(first))), lanes);
  return _mm512_mullo_epi32(index, _mm512_set1_epi32(static_cast<int>(0x9e3779b1u)));
}

// A function, not a global: a global would run an AVX512 instruction at load time on any CPU.
inline __m512 abs_mask() { return _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff)); }
inline __m512 abs_ps(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_castps_si512(abs_mask())));
}

inline __m512i q_m_code(__m512 x, __m512 inv, __m512i r20) {
  const __m512i mag = q_mag_r_vec<16>(_mm512_mul_ps(abs_ps(x), inv), r20);
  const __m512i s = _mm512_srai_epi32(_mm512_castps_si512(x), 31);
  return _mm512_sub_epi32(_mm512_xor_si512(mag, s), s);  // -mag where the sign bit is set
}
inline void q_m_vec(__m512 x, __m512 inv, __m512i r20, int8_t* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(q_m_code(x, inv, r20)));  // |c| <= 120
}

// x is the step's exp_avg_sq: +0, positive, +inf or NaN, never negative (quant_avx2.h, before q_v_x4, says why),
// so q_v's |x| is x, and a NaN of either sign clamps to the top code in q_mag_r_vec, as the scalar q_v's |NaN| does.
inline __m512i q_v_code(__m512 x, __m512 inv, __m512i r20) { return q_mag_r_vec<32>(_mm512_mul_ps(x, inv), r20); }
inline void q_v_vec(__m512 x, __m512 inv, __m512i r20, uint8_t* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(q_v_code(x, inv, r20)));  // c <= 248
}

// Four vectors of codes (|c| <= 120 signed, c <= 248 unsigned: no pack saturates) as 64 bytes in lane order. The
// packs work within 128-bit lanes, leaving vector k's lanes 4L..4L+3 at dword 4L + k; one permute puts them at
// 4k + L. Four operations for 64 codes where four vpmovdb take eight on Intel cores (two each, on port 5).
inline __m512i in_order(__m512i packed) {
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), packed);
}
inline void store_m_codes(const __m512i c[4], int8_t* dst) {
  const __m512i b = _mm512_packs_epi16(_mm512_packs_epi32(c[0], c[1]), _mm512_packs_epi32(c[2], c[3]));
  _mm512_storeu_si512(dst, in_order(b));
}
inline void store_v_codes(const __m512i c[4], uint8_t* dst) {
  const __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(c[0], c[1]), _mm512_packus_epi32(c[2], c[3]));
  _mm512_storeu_si512(dst, in_order(b));
}

// The block's absmax from the lanes' maxima: the lanes are >= 0 and never NaN (max_ps(x, acc) keeps
// acc when x is NaN), so max is associative here and a shuffle tree gives the value max_step gives in
// lane order. (A loop over the 16 lanes, as gcc compiles it, cost about 80 scalar instructions per block.)
inline float hmax(__m512 x) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
  const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(x), hi);
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

}  // namespace
}  // namespace hzo
