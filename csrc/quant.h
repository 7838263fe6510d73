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
//   a search of a 256-entry table per element; here the exponent is a power of two and the code is
//   read straight off fp32 bits: a small float format with 3 fraction bits, shifted by a constant c
//   so that zero is a code without a subnormal branch. With c = 2^(1-EB) (EB the exponent bias):
//     encode n in [0, 1]:  s = fp32(n + c) (one add, >= c, so always a normal float);
//                          mag = (bits(s) - bits(c) + R) >> 20, clamped to bits(1.0)'s mag;
//                          R = 2^19 rounds to nearest (ties up), R = 20 random bits stochastically;
//     decode mag:          fp32(bits_f32(bits(c) + (mag << 20)) - c).
//   The codes are the floats s >= c whose low 20 bits are 0, counted from c: so the integer
//   (bits(s) - bits(c)) >> 20 is the code at or below s, its low 20 bits are s's distance above it
//   in 2^-20 of the code step, and R decides the rounding. Below c the steps are c/8 (the shift
//   makes the first binade's codes 0, c/8, ..., 7c/8, like IEEE subnormals); far above c the map is
//   plain 3-fraction-bit floating point (the shift changes a value by c, under its own ulp).
//   Per element and moment: one multiply by the block's reciprocal, 4 vector ops to encode (add,
//   integer add, shift, min) and 3 to decode (shift, integer add, subtract). An earlier map (no
//   shift, a blend between a subnormal and a normal form, ties to even) took 9-12 ops to encode
//   and 4 to decode; with this one the AVX2 int8 step went 1.54 -> 1.36 ns/param in cache
//   (benchmarks/kernel/adam_micro.cpp, alternated builds). States written with that map (map 1:
//   saved without ops.INT8_CODES) are decoded with it and converted on load (ops.state_to_fp32).
//     exp_avg    int8: sign and magnitude 0..120, EB = 16: 2^-18 (3.8e-6) to 1 - 2^-15 (mag 120:
//                c = 2^-15 is exact under 1.0, so the block's absmax decodes 3e-5 low), 241
//                values, at most ~6.25% relative error well above c.
//     exp_avg_sq uint8: magnitude 0..248, EB = 32: 2^-34 (5.8e-11) to 1.0 (mag 248), i.e. the
//                square of exp_avg's range, because v ~ g^2 and the update divides by sqrt(v).
// - Both moments are written with stochastic rounding (q_m_sr, q_v_sr), each with its own random
//   bits. exp_avg was to nearest until session 17: beta1 = 0.9 moves m by 10% of (g - m) per step,
//   under half a code step once g is near m, as in full-batch training, and its codes froze too (a
//   small MLP, full batch, 100 steps: 16-24% above fp32 AdamW's loss over 3 seeds; with stochastic m
//   0.1-0.4% below it; tests/test_ops_quant.py has the frozen m). With beta2 =
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
//   and more time per element (with the earlier map: AVX2 in cache 1.34 -> 1.38-1.52 ns, 1.62 with
//   bf16's mix32 hash, hence q8_round_bits in adam.h). The 20 random bits are a function of the
//   element's flat index and the step, so codes do not depend on threads, tiles, instruction set or
//   world size.
//   A stored value is code_value * scale (one fp32 multiply). Zero is a code (exact zeros stay zero:
//   unused embedding rows, masked params); a v flushed to zero in a block with a 1e10x larger
//   outlier gets an update bounded by its own m, whose code range flushes at the same scale.
// - Non-finite moments: an inf makes the scale inf and the whole block decodes to inf/NaN at the next
//   step, so a bad step stays visible (the fp32 param was already updated with the unrounded values in
//   the same pass). A NaN is not: the block max skips it and it stores as the top code (q_mag_r clamps
//   NaN), finite, while its own param is NaN already (torch keeps the NaN moment; nothing else differs).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "adam.h"

namespace hzo {

constexpr size_t kQBlock = 256;  // elements per scale; ops.QUANT_BLOCK

namespace {

// The code format with exponent bias EB (16: exp_avg, 32: exp_avg_sq).
template <int EB>
struct QFormat {
  static constexpr uint32_t kShiftBits = (128u - EB) << 23;  // c = 2^(1-EB), the shift
  static constexpr uint32_t kMaxMag = (EB - 1u) << 3;         // 1.0's code: (bits(1.0) - bits(c)) >> 20
};
using QM = QFormat<16>;  // exp_avg
using QV = QFormat<32>;  // exp_avg_sq

// The magnitude code of n >= 0 (or a NaN): r (< 2^20) added below the kept bits of fp32(n + c)
// counted from c, then truncation. r = 2^19: nearest, ties up; r random: up with probability (the
// distance above the code below) / (the code step), in 2^-20 steps. Huge n, inf and NaN of either
// sign land above 1.0's code (the sum stays below 2^32: bits(c) >= 2^28 > r) and clamp to it.
template <int EB>
inline uint32_t q_mag_r(float n, uint32_t r) {
  using F = QFormat<EB>;
  const uint32_t mag = (f32_bits(n + bits_f32(F::kShiftBits)) + (r - F::kShiftBits)) >> 20;
  return mag < F::kMaxMag ? mag : F::kMaxMag;
}
template <int EB>
inline uint32_t q_mag(float n) { return q_mag_r<EB>(n, 1u << 19); }

// Exact for the codes' floats; the subtraction rounds where c is under the value's ulp (1.0 stays 1.0).
template <int EB>
inline float dq_mag(uint32_t mag) {
  using F = QFormat<EB>;
  return bits_f32(F::kShiftBits + (mag << 20)) - bits_f32(F::kShiftBits);
}

// Value of a code, before the block scale.
inline float dq_m(int8_t c) {
  const float x = dq_mag<16>(static_cast<uint32_t>(c < 0 ? -c : c));
  return c < 0 ? -x : x;
}
inline float dq_v(uint8_t c) { return dq_mag<32>(c); }

// |x| * (1 / absmax): a multiply by the block's reciprocal, not a division per element (the
// divider is what the update already loads: a sqrt and a division per element). The
// product is within 1.5 ulp of |x| / absmax, so |x| == absmax still codes 1.0 (3 fraction bits) and
// the clamp in q_mag catches the rest. A block whose max is below FLT_MIN (or 0) codes all zeros:
// its reciprocal would overflow, and such moments are zero for Adam anyway.
inline float q_inverse(float absmax) { return absmax >= 1.17549435e-38f ? 1.0f / absmax : 0.0f; }
// exp_avg: q_m to nearest (one-off conversions), q_m_sr what a step stores (its magnitude rounded
// stochastically, so the signed value is unbiased too; r20: q8_round_bits with q8_seed_m's seed).
inline int8_t q_m_sr(float x, float inv, uint32_t r20) {
  const uint32_t mag = q_mag_r<16>(std::fabs(x) * inv, r20);
  return static_cast<int8_t>(std::signbit(x) ? -static_cast<int32_t>(mag) : static_cast<int32_t>(mag));
}
inline int8_t q_m(float x, float inv) { return q_m_sr(x, inv, 1u << 19); }
// exp_avg_sq is >= 0; |x| makes a -0 (or a foreign negative value) code like its magnitude. q_v:
// to nearest (one-off conversions); q_v_sr: what a step stores (r20: q8_round_bits in adam.h).
inline uint8_t q_v(float x, float inv) { return static_cast<uint8_t>(q_mag<32>(std::fabs(x) * inv)); }
inline uint8_t q_v_sr(float x, float inv, uint32_t r20) {
  return static_cast<uint8_t>(q_mag_r<32>(std::fabs(x) * inv, r20));
}

// Running max that never takes a NaN (the comparison is false), so any order gives the same value.
inline float max_step(float acc, float x) { return x > acc ? x : acc; }

// The block's scale: its absmax, or with ``given`` the scale already in *scale (the caller's, >= the
// absmax: the engine keeps a block's scale, times a power of two, while part of it gets no gradient).
inline float q_scale(const float* x, size_t len, const float* scale, bool given) {
  if (given) return *scale;
  float mx = 0.0f;
  for (size_t i = 0; i < len; ++i) mx = max_step(mx, std::fabs(x[i]));
  return mx;
}

// Quantize one block of fp32 moments (len <= kQBlock): its scale, then its codes. Without a seed to
// nearest; with one (a step's round_seed), stochastically, element i taking q8_round_bits(index + i,
// q8_seed_m(seed)).
inline void q_block_m(const float* x, size_t len, int8_t* codes, float* scale, const uint32_t* seed = nullptr,
                      uint64_t index = 0, bool given = false) {
  const float mx = q_scale(x, len, scale, given);
  const float inv = q_inverse(mx);
  const uint32_t seed_m = seed ? q8_seed_m(*seed) : 0;
  for (size_t i = 0; i < len; ++i) codes[i] = seed ? q_m_sr(x[i], inv, q8_round_bits(index + i, seed_m)) : q_m(x[i], inv);
  *scale = mx;
}
// exp_avg_sq: to nearest without a seed; with one (a step's round_seed), stochastically, element i
// taking q8_round_bits(index + i, seed).
inline void q_block_v(const float* x, size_t len, uint8_t* codes, float* scale, const uint32_t* seed = nullptr,
                      uint64_t index = 0, bool given = false) {
  const float mx = q_scale(x, len, scale, given);
  const float inv = q_inverse(mx);
  for (size_t i = 0; i < len; ++i) {
    codes[i] = seed ? q_v_sr(x[i], inv, q8_round_bits(index + i, *seed)) : q_v(x[i], inv);
  }
  *scale = mx;
}

// The codes of elements [from, len) of the block at b, its reciprocals known: the vector kernels'
// scalar tail of a partial last block, both moments as the step stores them.
// The vector kernels call q_block_tail after every block, and only a partial last block has a tail:
// the test is inlined there and the loop stays out of line, since a call in the block loop (gcc did not
// inline the loop) saved and restored a dozen vector registers, and a vzeroupper, on every block.
__attribute__((noinline)) inline void q_tail_codes(const AdamArgs& a, size_t b, const float* mb, const float* vb,
                                                   size_t from, size_t len, float minv, float vinv) {
  int8_t* mc = static_cast<int8_t*>(a.exp_avg) + b;
  uint8_t* vc = static_cast<uint8_t*>(a.exp_avg_sq) + b;
  const uint32_t seed_m = q8_seed_m(a.round_seed);
  for (size_t j = from; j < len; ++j) {
    mc[j] = q_m_sr(mb[j], minv, q8_round_bits(a.round_index + b + j, seed_m));
    vc[j] = q_v_sr(vb[j], vinv, q8_round_bits(a.round_index + b + j, a.round_seed));
  }
}
__attribute__((always_inline)) inline void q_block_tail(const AdamArgs& a, size_t b, const float* mb,
                                                        const float* vb, size_t from, size_t len, float minv,
                                                        float vinv) {
  if (from < len) q_tail_codes(a, b, mb, vb, from, len, minv, vinv);
}

// The scalar update of elements [i, e) of the block at b, the vector kernels' tail of a partial last
// block: the param and param out written, the new moments kept in mb/vb and their magnitudes folded
// into the running block maxima mx/vx in index order (max_step). Out of line behind an inlined test,
// for the reason q_block_tail gives.
__attribute__((noinline)) inline void q_update_elems(const AdamArgs& a, size_t b, size_t i, size_t e, float* mb,
                                                     float* vb, float& mx, float& vx) {
  const size_t k = b / kQBlock;
  const int8_t* mc = static_cast<const int8_t*>(a.exp_avg);
  const uint8_t* vc = static_cast<const uint8_t*>(a.exp_avg_sq);
  for (; i < e; ++i) {
    const float g = load_grad(a.grad, a.grad_dtype, i) * a.grad_scale;
    const float p = adam_math<true>(a, g, a.param[i], dq_m(mc[i]) * a.exp_avg_scale[k],
                                    dq_v(vc[i]) * a.exp_avg_sq_scale[k], mb[i - b], vb[i - b]);
    a.param[i] = p;
    if (a.param_out) store_out(a.param_out, a.out_dtype, i, p);
    mx = max_step(mx, std::fabs(mb[i - b]));
    vx = max_step(vx, std::fabs(vb[i - b]));
  }
}
__attribute__((always_inline)) inline void q_update_tail(const AdamArgs& a, size_t b, size_t i, size_t e, float* mb,
                                                         float* vb, float& mx, float& vx) {
  if (i < e) q_update_elems(a, b, i, e, mb, vb, mx, vx);
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
  q_block_m(mb, e - b, mc + b, a.exp_avg_scale + k, &a.round_seed, a.round_index + b);
  q_block_v(vb, e - b, vc + b, a.exp_avg_sq_scale + k, &a.round_seed, a.round_index + b);
}

}  // namespace
}  // namespace hzo
