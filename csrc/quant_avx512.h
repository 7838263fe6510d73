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
  // x ^ (c & sign bit) in one ternary-logic operation (0x78 is a ^ (b & c) over the truth-table bytes F0, CC, AA)
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(x, c, _mm512_set1_epi32(INT32_MIN), 0x78));
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

// Four vectors of codes as 64 bytes in lane order. The packs work within 128-bit lanes, leaving vector k's lanes
// 4L..4L+3 at dword 4L + k; one permute puts them at 4k + L.
inline __m512i in_order(__m512i packed) {
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), packed);
}

// The x4 encoders (quant_avx2.h's q_m_x4 / q_v_x4, the same reasoning) clamp once per 64 codes, after packing:
// the unclamped magnitude is below 2^12 (n >= 0 or a NaN, so no wrap), the packs to 16 and then 8 bits saturate
// it at 255 (as unsigned), and one byte min gives q_mag_r's min(mag, kMaxMag). exp_avg adds r without taking
// bits(c) off first ((bits(n + c) + r) >> 20 is the magnitude plus bits(c) >> 20: bits(c) has 20 low zero bits)
// and takes bits(c) >> 20 off after the first pack, 32 codes per subtraction; |m| times the reciprocal is a
// positive NaN at worst, or inf * 0's default NaN (0xffc00000), both far under 2^32 - 2^20. exp_avg_sq (no |v|:
// see q_v_code) subtracts it before the shift, where a negative NaN's bits plus r could wrap. exp_avg's signs:
// x's fp32 bits packed with signed saturation keep their sign bit, so the byte mask of those signs picks exactly
// the lanes q_m negates (a -0 included, whose magnitude code is 0). Per 64 codes: 4 packs, a subtraction per 32,
// one min, a mask and a masked negation, one permute, where per-vector clamps and sign fixes took 8 more.
// weyl and seeds: as q8_encode's, the first of the 64 elements at weyl; weyl moves on by 64 (in q_v_x4).
inline void q_m_x4(const float* x, __m512 inv, __m512i weyl, __m512i seed_m, int8_t* dst) {
  const __m512i c = _mm512_set1_epi32(QM::kShiftBits);
  const __m512i step = _mm512_set1_epi32(static_cast<int>(16u * 0x9e3779b1u));
  __m512 xs[4];
  __m512i top[4];
  for (int k = 0; k < 4; ++k, weyl = _mm512_add_epi32(weyl, step)) {
    xs[k] = _mm512_load_ps(x + k * 16);
    const __m512i u = _mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(abs_ps(xs[k]), inv), _mm512_castsi512_ps(c)));
    top[k] = _mm512_srli_epi32(_mm512_add_epi32(u, round_at(weyl, seed_m)), 20);
  }
  const __m512i base = _mm512_set1_epi16(static_cast<short>(QM::kShiftBits >> 20));
  const __m512i lo = _mm512_sub_epi16(_mm512_packus_epi32(top[0], top[1]), base);
  const __m512i hi = _mm512_sub_epi16(_mm512_packus_epi32(top[2], top[3]), base);
  const __m512i mag = _mm512_min_epu8(_mm512_packus_epi16(lo, hi), _mm512_set1_epi8(static_cast<char>(QM::kMaxMag)));
  auto bits = [](__m512 v) { return _mm512_castps_si512(v); };
  const __m512i s = _mm512_packs_epi16(_mm512_packs_epi32(bits(xs[0]), bits(xs[1])),
                                       _mm512_packs_epi32(bits(xs[2]), bits(xs[3])));
  const __m512i codes = _mm512_mask_sub_epi8(mag, _mm512_movepi8_mask(s), _mm512_setzero_si512(), mag);
  _mm512_storeu_si512(dst, in_order(codes));
}
inline void q_v_x4(const float* x, __m512 inv, __m512i& weyl, __m512i seed, uint8_t* dst) {
  const __m512i c = _mm512_set1_epi32(QV::kShiftBits);
  __m512i mag[4];
  for (int k = 0; k < 4; ++k) {
    const __m512i u = _mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(x + k * 16), inv),
                                                        _mm512_castsi512_ps(c)));
    mag[k] = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_sub_epi32(round_hi20(weyl, seed), c)), 20);
  }
  const __m512i codes = _mm512_packus_epi16(_mm512_packus_epi32(mag[0], mag[1]), _mm512_packus_epi32(mag[2], mag[3]));
  _mm512_storeu_si512(dst, in_order(_mm512_min_epu8(codes, _mm512_set1_epi8(static_cast<char>(QV::kMaxMag)))));
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
