// The AVX2 lane images of quant.h's 8-bit moment codes (q_mag/dq_mag/q_m/q_v/dq_m/dq_v) and of
// q8_round_bits, one operation for one, so the codes are bit-identical to the scalar reference.
// Included only by adam_avx2.cpp, so it is compiled only with that unit's -mavx2 -mfma -mf16c.
#pragma once
#include <immintrin.h>

#include "quant.h"

namespace hzo {
namespace {

constexpr size_t W = 8;  // fp32 lanes per vector

template <int EB>
inline __m256 dq_mag_vec(__m256i mag) {
  const __m256i c = _mm256_set1_epi32(QFormat<EB>::kShiftBits);
  return _mm256_sub_ps(_mm256_castsi256_ps(_mm256_add_epi32(c, _mm256_slli_epi32(mag, 20))), _mm256_castsi256_ps(c));
}

inline __m256 dq_m_vec(const int8_t* p) {
  const __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256 x = dq_mag_vec<16>(_mm256_abs_epi32(c));
  return _mm256_xor_ps(x, _mm256_castsi256_ps(_mm256_and_si256(c, _mm256_set1_epi32(INT32_MIN))));
}

inline __m256 dq_v_vec(const uint8_t* p) {
  return dq_mag_vec<32>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// q_mag_r lane by lane: n >= 0 (or a NaN), r < 2^20 per lane (the min compares unsigned).
template <int EB>
inline __m256i q_mag_r_vec(__m256 n, __m256i r) {
  using F = QFormat<EB>;
  const __m256i c = _mm256_set1_epi32(F::kShiftBits);
  const __m256i u = _mm256_castps_si256(_mm256_add_ps(n, _mm256_castsi256_ps(c)));
  const __m256i mag = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_sub_epi32(r, c)), 20);
  return _mm256_min_epu32(mag, _mm256_set1_epi32(F::kMaxMag));
}
template <int EB>
inline __m256i q_mag_vec(__m256 n) { return q_mag_r_vec<EB>(n, _mm256_set1_epi32(1 << 19)); }

// q8_round_bits for the 8 lanes whose index * 0x9e3779b1 is in weyl (round_at), and weyl moved on by 8
// indices (round_hi20).
inline __m256i round_at(__m256i weyl, __m256i seed) { return _mm256_srli_epi32(_mm256_xor_si256(weyl, seed), 12); }
inline __m256i round_hi20(__m256i& weyl, __m256i seed) {
  const __m256i r = round_at(weyl, seed);
  weyl = _mm256_add_epi32(weyl, _mm256_set1_epi32(static_cast<int>(8u * 0x9e3779b1u)));
  return r;
}

// weyl for round_hi20: lane l holds (first + l) * 0x9e3779b1 mod 2^32.
inline __m256i weyl_of(uint64_t first) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(first))), lanes);
  return _mm256_mullo_epi32(index, _mm256_set1_epi32(static_cast<int>(0x9e3779b1u)));
}

// A function, not a global: a global would run an AVX instruction at load time on any CPU.
inline __m256 abs_mask() { return _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)); }

inline void q_m_vec(__m256 x, __m256 inv, __m256i r20, int8_t* dst) {
  const __m256i mag = q_mag_r_vec<16>(_mm256_mul_ps(_mm256_and_ps(x, abs_mask()), inv), r20);
  const __m256i s = _mm256_srai_epi32(_mm256_castps_si256(x), 31);
  const __m256i c = _mm256_sub_epi32(_mm256_xor_si256(mag, s), s);  // -mag where the sign bit is set
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packs_epi16(w, w));
}

inline void q_v_vec(__m256 x, __m256 inv, __m256i r20, uint8_t* dst) {
  const __m256i c = q_mag_r_vec<32>(_mm256_mul_ps(_mm256_and_ps(x, abs_mask()), inv), r20);
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(w, w));
}

// Four vectors of codes at once: two pack steps and one permute instead of three steps per vector.
// The packs work within 128-bit lanes, so dword d of the packed result holds 4 codes of vector
// d % 4 (its low half for d < 4, its high half after); the permute puts them back in order. The
// magnitudes fit the packs without saturating (<= 120, <= 248). exp_avg's signs: the fp32 bits
// packed with signed saturation keep their sign and stay nonzero (only +0 and -0 give 0, whose
// magnitude code is 0 anyway, as is a -0's in q_m), so psignb negates exactly the codes of the
// lanes with the sign bit set, and the bytes are q_m_vec's / q_v_vec's.
inline __m256i unshuffle_x4(__m256i w) {
  return _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The x4 encoders clamp after packing, once per 32 codes rather than once per 8: the unclamped
// magnitude (bits(n + c) + r - bits(c)) >> 20 is below 2^12 (n >= 0 or NaN, so no wrap), the packs to
// 16 and then 8 bits saturate it at 255 (as unsigned), and one byte min then gives q_mag_r's
// min(mag, kMaxMag). exp_avg takes bits(c) off after the first pack (16 codes per subtraction): bits(c)
// has 20 low zero bits, so (bits(n + c) + r) >> 20 is the magnitude plus bits(c) >> 20, which cannot wrap: |m|
// times the reciprocal is a positive NaN at worst, or inf * 0's default NaN (0xffc00000, an inf in a
// block whose scale is then inf), both far enough under 2^32 - 2^20. exp_avg_sq (no |v|, see q_v_x4)
// subtracts it before the shift, where any negative NaN's bits plus r could wrap.
template <int EB>
inline __m256i q_min_bytes(__m256i codes) {
  return _mm256_min_epu8(codes, _mm256_set1_epi8(static_cast<char>(QFormat<EB>::kMaxMag)));
}

// weyl: as round_hi20's, for the first of the 32 elements (a copy: q_v_x4 moves the caller's on).
inline void q_m_x4(const float* x, __m256 inv, __m256i weyl, __m256i seed_m, int8_t* dst) {
  const __m256 x0 = _mm256_load_ps(x), x1 = _mm256_load_ps(x + W), x2 = _mm256_load_ps(x + 2 * W),
               x3 = _mm256_load_ps(x + 3 * W);
  const __m256i r0 = round_hi20(weyl, seed_m), r1 = round_hi20(weyl, seed_m), r2 = round_hi20(weyl, seed_m),
                r3 = round_hi20(weyl, seed_m);  // in order: one declaration's initializers run in sequence
  const __m256 c = _mm256_castsi256_ps(_mm256_set1_epi32(QM::kShiftBits));
  auto top = [&](__m256 v, __m256i r) {  // the magnitude plus bits(c) >> 20, unclamped
    const __m256i u = _mm256_castps_si256(_mm256_add_ps(_mm256_mul_ps(_mm256_and_ps(v, abs_mask()), inv), c));
    return _mm256_srli_epi32(_mm256_add_epi32(u, r), 20);
  };
  const __m256i base = _mm256_set1_epi16(static_cast<short>(QM::kShiftBits >> 20));
  auto mag16 = [&](__m256i a, __m256i b) { return _mm256_sub_epi16(_mm256_packus_epi32(a, b), base); };
  const __m256i m = q_min_bytes<16>(_mm256_packus_epi16(mag16(top(x0, r0), top(x1, r1)),
                                                        mag16(top(x2, r2), top(x3, r3))));
  auto bits = [](__m256 v) { return _mm256_castps_si256(v); };
  const __m256i s =
      _mm256_packs_epi16(_mm256_packs_epi32(bits(x0), bits(x1)), _mm256_packs_epi32(bits(x2), bits(x3)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), unshuffle_x4(_mm256_sign_epi8(m, s)));
}

// The update's exp_avg_sq: fma(1 - beta2, g*g, v0 * beta2) with v0 a code (>= 0) times a scale that
// the driver's scale check (dispatch.cpp) keeps >= 0, so it is +0, positive, +inf or NaN, never
// negative: q_v's |x| is x, and a NaN of either sign clamps to the top code in q_mag_r_vec. One op
// fewer per vector, here and in the block max (measured 1.51 -> 1.37-1.40 ns/param single-threaded).
// weyl: as round_hi20's.
inline void q_v_x4(const float* x, __m256 inv, __m256i& weyl, __m256i seed, uint8_t* dst) {
  // one declaration: its initializers run in order, so vector q takes the indices of elements 8q..8q+7
  const __m256i r0 = round_hi20(weyl, seed), r1 = round_hi20(weyl, seed), r2 = round_hi20(weyl, seed),
                r3 = round_hi20(weyl, seed);
  const __m256i c = _mm256_set1_epi32(QV::kShiftBits);
  auto mag = [&](const float* p, __m256i r) {  // unclamped
    const __m256i u = _mm256_castps_si256(_mm256_add_ps(_mm256_mul_ps(_mm256_load_ps(p), inv), _mm256_castsi256_ps(c)));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_sub_epi32(r, c)), 20);
  };
  const __m256i codes = _mm256_packus_epi16(_mm256_packus_epi32(mag(x, r0), mag(x + W, r1)),
                                            _mm256_packus_epi32(mag(x + 2 * W, r2), mag(x + 3 * W, r3)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), unshuffle_x4(q_min_bytes<32>(codes)));
}

// The block's absmax from the lanes' maxima: the lanes are +0 or positive and never NaN (max_ps(x, acc)
// keeps acc when x is NaN), so max is associative here and a shuffle tree gives the value max_step gives
// in lane order.
inline float hmax(__m256 x) {
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

}  // namespace
}  // namespace hzo
