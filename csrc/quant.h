// Blockwise 8-bit Adam moments (StateKind::Q8): the code maps, and the scalar reference of the
// fused block update that the vector kernels reproduce bit for bit.
//
// The choice, after Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022,
// arXiv 2110.02861), bitsandbytes and torchao's AdamW8bit:
// - Blockwise absmax scaling, as all three do: each block of kQBlock elements stores one fp32 scale
//   (its largest |value|) and one byte per element for the value divided by it. The paper uses
//   2048-element blocks; bitsandbytes' blockwise optimizers and torchao use 256. We take 256: an
//   outlier then flattens 8x fewer neighbours, the block's decoded values stay in L1 between the
//   update and the requantization (2 x 1 KiB), the scales cost 8 B per 256 params (0.03 B/param),
//   and shards only need to start at multiples of 256 elements.
// - A dynamic-exponent code, the property that makes the paper's "dynamic tree" map work: relative
//   (not absolute) precision over many orders of magnitude, so small moments in a block with an
//   outlier are not flushed to zero. The paper's tree spends its bits on powers of ten and needs
//   a search of a 256-entry table per element; here the exponent is a power of two, so the code is
//   a small floating-point format with 3 fraction bits and round-to-nearest-even is one float add
//   of a power of two picked from the exponent bits (q_mag): a handful of vector ops per element,
//   exact (it is the nearest code; tests check that against the full table), no table, no gather.
//   Cost per element and moment: one multiply by the block's reciprocal and 9 vector ops to encode
//   the magnitude, 4 to decode it (with the 256-bit packs, ~1 more per element to store the bytes).
//     exp_avg    int8: sign and magnitude 0..120; magnitude value = 2^(e-15) * (1 + f/8) with
//                e = mag>>3 >= 1, f = mag&7, and mag*2^-17 below 8 (evenly spaced, like IEEE
//                subnormals); 1.0 is mag 120. 241 values, 2^-17 (7.6e-6) to 1, <= 6.25% error.
//     exp_avg_sq uint8: the same with exponent bias 31: 2^-33 (1.2e-10) to 1 (mag 248), i.e. the
//                square of exp_avg's range, because v ~ g^2 and the update divides by sqrt(v).
// - exp_avg_sq is written with stochastic rounding (q_mag_sr), exp_avg to nearest. With beta2 =
//   0.999 an element's v moves by 0.1% of (g^2 - v) per step, far under half a code step (3-6%), so
//   to nearest its code relative to the block's (exact) absmax froze and v stopped following its
//   own gradient (tests/test_ops_quant.py: a gradient falling from 0.3 to 0.1 left the stored v
//   3.8x the exact one after 800 steps; stochastic: the mean within 1%). Open loop (fp32's
//   gradients drive each optimizer's copy: benchmarks/engine/compact_quality.py --open-loop),
//   t5-small, 300 steps:
//   eval loss 1.5% under fp32's at step 250 with nearest codes (frozen v, larger steps), 0.1% over
//   with these. A plain-torch emulation on t5-demo: 2.4% off with nearest codes for both moments,
//   0.2% with stochastic ones for both, 0.04% with stochastic exp_avg_sq alone (beta1 = 0.9 moves m
//   by 10% per step, which nearest codes follow). The price: each stored v is noisy (the rounding
//   errors of ~1000 steps add up under beta2; std 29% of v per element in that test, unbiased),
//   and more time per element in cache (AVX2, 1.34 -> 1.38-1.52 ns, noisy host; 1.62 with bf16's mix32
//   hash, hence q8_round_bits in adam.h). The 16 random bits are a function of the element's flat
//   index and the step, so codes do not depend on threads, tiles, instruction set or world size.
//   A stored value is code_value * scale (one fp32 multiply). Zero is a code (exact zeros stay zero:
//   unused embedding rows, masked params); a v flushed to zero in a block with a 1e10x larger
//   outlier gets an update bounded by its own m, whose code range flushes at the same scale.
// - Non-finite moments: the scale becomes inf/nan and the block decodes to inf/nan, so a bad step
//   stays visible (the fp32 param was already updated with the unrounded values in the same pass).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "adam.h"

namespace hzo {

constexpr size_t kQBlock = 256;  // elements per scale; ops.QUANT_BLOCK

namespace {

// The code format with exponent bias EB (15: exp_avg, 31: exp_avg_sq).
template <int EB>
struct QFormat {
  static constexpr uint32_t kNormBias = (127u - EB) << 3;      // mag = (fp32 bits rounded at bit 20) - this
  static constexpr uint32_t kMinNormalBits = (128u - EB) << 23;  // 2^(1-EB): the smallest value with mag 8
  static constexpr uint32_t kMagicBits = (148u - EB) << 23;      // 2^(21-EB): its ulp is the step 2^(-2-EB)
  static constexpr uint32_t kMaxMag = EB << 3;                   // 1.0
  static constexpr uint32_t kSubScaleBits = (145u + EB) << 23;   // 2^(18+EB): q_mag_sr's fixed point
};
using QM = QFormat<15>;  // exp_avg
using QV = QFormat<31>;  // exp_avg_sq

// Nearest magnitude code of n >= 0 (ties to even), clamped to 1.0's (n <= 1 by construction; a NaN
// clamps too, deterministically). One float add rounds n to the code's step: C is 2^20 times n's
// binade (2^E), or 2^(21-EB) below the smallest normal code, so n + C lands in C's binade, whose ulp
// is 2^(E-3) (3 fraction bits) or 2^(-2-EB) (the subnormal step), and the hardware's
// round-to-nearest-even does the rounding. The bits of n + C minus C's count steps of that ulp
// from C: 8 + f in a normal binade, to which (C - 2^(21-EB)) >> 20 = 8 (E + EB - 1) adds the
// exponent; 0 below. A carry into the next binade gives the next exponent's f = 0. Huge n, inf and
// NaN wrap the exponent add negative (signed max takes 2^(21-EB)) and clamp. Checked against the
// textbook form (integer round-to-nearest-even of the fp32 bits at bit 20, subnormals by a magic
// add) for all 2^32 inputs in its domain (n >= 0 and NaNs): benchmarks/kernel/check_codes.cpp.
template <int EB>
inline uint32_t q_mag(float n) {
  using F = QFormat<EB>;
  const int32_t e20 = static_cast<int32_t>((f32_bits(n) & 0x7f800000u) + (20u << 23));
  const uint32_t c = static_cast<uint32_t>(std::max(e20, static_cast<int32_t>(F::kMagicBits)));
  const uint32_t mag = (f32_bits(n + bits_f32(c)) - c) + ((c - F::kMagicBits) >> 20);
  return mag < F::kMaxMag ? mag : F::kMaxMag;
}

// Magnitude code of n >= 0 (or a NaN), rounded up with probability (its distance above the code
// below) / (the code step), in 2^-16 steps: r16 (16 random bits) added below the kept bits, then
// truncation. Normal codes keep fp32's bits down to bit 20, so r16 << 4 goes under them; below the
// smallest normal code the step is 2^(-2-EB), and n * 2^(18+EB) (exact: a power of two, < 2^19)
// truncated to an integer holds n in steps with 16 bits under them. The code above 1.0's clamps; so
// do huge n, inf and NaN of either sign (the unsigned compare sends them to the first form, whose
// 32-bit sum may wrap, and a wrapped or large result is above the clamp).
template <int EB>
inline uint32_t q_mag_sr(float n, uint32_t r16) {
  using F = QFormat<EB>;
  const uint32_t u = f32_bits(n);
  const uint32_t mag =
      u >= F::kMinNormalBits
          ? ((u + (r16 << 4)) >> 20) - F::kNormBias
          : (static_cast<uint32_t>(static_cast<int32_t>(n * bits_f32(F::kSubScaleBits))) + r16) >> 16;
  return mag < F::kMaxMag ? mag : F::kMaxMag;
}

// The normal form (mag + bias) << 20 is right for mag >= 8; below, it is 2^-EB (1 + mag/8) and the
// value is 2 (that - 2^-EB) = mag 2^(-2-EB), computed exactly by one fma. At mag >= 8 the fma is
// >= the normal form (equal at 8), so the min picks the right one without a compare (all finite).
template <int EB>
inline float dq_mag(uint32_t mag) {
  using F = QFormat<EB>;
  const float normal = bits_f32((mag + F::kNormBias) << 20);
  const float sub = std::fma(normal, 2.0f, -bits_f32(F::kMinNormalBits));
  return sub < normal ? sub : normal;  // _mm256_min_ps(sub, normal)
}

// Value of a code, before the block scale.
inline float dq_m(int8_t c) {
  const float x = dq_mag<15>(static_cast<uint32_t>(c < 0 ? -c : c));
  return c < 0 ? -x : x;
}
inline float dq_v(uint8_t c) { return dq_mag<31>(c); }

// |x| * (1 / absmax): a multiply by the block's reciprocal, not a division per element (the
// divider is what the update already loads: a sqrt and a division per element). The
// product is within 1.5 ulp of |x| / absmax, so |x| == absmax still codes 1.0 (3 fraction bits) and
// the clamp in q_mag catches the rest. A block whose max is below FLT_MIN (or 0) codes all zeros:
// its reciprocal would overflow, and such moments are zero for Adam anyway.
inline float q_inverse(float absmax) { return absmax >= 1.17549435e-38f ? 1.0f / absmax : 0.0f; }
inline int8_t q_m(float x, float inv) {
  const uint32_t mag = q_mag<15>(std::fabs(x) * inv);
  return static_cast<int8_t>(std::signbit(x) ? -static_cast<int32_t>(mag) : static_cast<int32_t>(mag));
}
// exp_avg_sq is >= 0; |x| makes a -0 (or a foreign negative value) code like its magnitude. q_v:
// to nearest (one-off conversions); q_v_sr: what a step stores (r16: q8_round_bits in adam.h).
inline uint8_t q_v(float x, float inv) { return static_cast<uint8_t>(q_mag<31>(std::fabs(x) * inv)); }
inline uint8_t q_v_sr(float x, float inv, uint32_t r16) {
  return static_cast<uint8_t>(q_mag_sr<31>(std::fabs(x) * inv, r16));
}

// Running max that never takes a NaN (the comparison is false), so any order gives the same value.
inline float max_step(float acc, float x) { return x > acc ? x : acc; }

// Quantize one block of fp32 moments (len <= kQBlock): its scale, then its codes.
inline void q_block_m(const float* x, size_t len, int8_t* codes, float* scale) {
  float mx = 0.0f;
  for (size_t i = 0; i < len; ++i) mx = max_step(mx, std::fabs(x[i]));
  const float inv = q_inverse(mx);
  for (size_t i = 0; i < len; ++i) codes[i] = q_m(x[i], inv);
  *scale = mx;
}
// exp_avg_sq: to nearest without a seed; with one (a step's round_seed), stochastically, element i
// taking q8_round_bits(index + i, seed).
inline void q_block_v(const float* x, size_t len, uint8_t* codes, float* scale, const uint32_t* seed = nullptr,
                      uint64_t index = 0) {
  float mx = 0.0f;
  for (size_t i = 0; i < len; ++i) mx = max_step(mx, std::fabs(x[i]));
  const float inv = q_inverse(mx);
  for (size_t i = 0; i < len; ++i) {
    codes[i] = seed ? q_v_sr(x[i], inv, q8_round_bits(index + i, *seed)) : q_v(x[i], inv);
  }
  *scale = mx;
}

// The reference Q8 update of the block holding [b, e) (b a multiple of kQBlock, e <= b + kQBlock):
// decode, the same AdamW as adam_math, the param written from the unrounded moments, requantize.
inline void adam_q8_block_scalar(const AdamArgs& a, size_t b, size_t e) {
  const size_t k = b / kQBlock;
  float mb[kQBlock], vb[kQBlock];
  const float ms = a.exp_avg_scale[k], vs = a.exp_avg_sq_scale[k];
  int8_t* mc = static_cast<int8_t*>(a.exp_avg);
  uint8_t* vc = static_cast<uint8_t*>(a.exp_avg_sq);
  for (size_t i = b; i < e; ++i) {
    const float g = load_grad(a.grad, a.grad_dtype, i) * a.grad_scale;
    const float p = adam_math<true>(a, g, a.param[i], dq_m(mc[i]) * ms, dq_v(vc[i]) * vs, mb[i - b], vb[i - b]);
    a.param[i] = p;
    if (a.param_out) store_out(a.param_out, a.out_dtype, i, p);
  }
  q_block_m(mb, e - b, mc + b, a.exp_avg_scale + k);
  q_block_v(vb, e - b, vc + b, a.exp_avg_sq_scale + k, &a.round_seed, a.round_index + b);
}

}  // namespace
}  // namespace hzo
