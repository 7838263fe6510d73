// Shared declarations for the CPU Adam kernels. Torch-free: raw pointers and sizes only.
//
// The algorithm: Adam (Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015,
// Algorithm 1) and AdamW's decoupled weight decay (Loshchilov & Hutter, "Decoupled Weight Decay
// Regularization", ICLR 2019, Algorithm 2), in the form torch.optim.Adam/AdamW implement them
// (torch/optim/adamw.py, _single_tensor_adamw):
//   AdamW: p *= 1 - lr*wd                 Adam: g += wd*p
//   m = lerp(m, g, 1-beta1)   v = beta2*v + (1-beta2)*g*g
//   p -= lr/(1-beta1^t) * m / (sqrt(v)/sqrt(1-beta2^t) + eps)
// adam_math below is the canonical per-element form; make_adam_args (adam_scalar.cpp) turns the
// hyper-parameters into the per-step constants. With fp32 moments it performs the operations of
// torch's CPU kernels as the x86 wheels compile them (ATen's vectorized loops, whose a + b * c the
// compiler fuses): add(alpha) is fma(wd, p, g); lerp is fma(w, g - m, m) for w < 0.5, else
// fma(w - 1, g - m, g); addcmul is fma((1-beta2) * g, g, beta2 * v); addcdiv is p + (-step * m) / d,
// each operation rounded to fp32. So fp32 moments equal torch.optim.AdamW(foreach=False) bit for bit
// there (tests/test_ops.py checks that torch's own kernels fuse that way before it asks for it).
//
// Every instruction set implements exactly these operations lane by lane (the same fused
// multiply-adds, true division and square root), so the scalar, AVX2 and AVX512 paths give
// bit-identical results; the vector paths use the scalar helpers for their tails.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace hzo {

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };

// How exp_avg/exp_avg_sq are stored. F32: float arrays. BF16: bf16 bits (uint16), stochastically
// rounded when written (f32_to_bf16_sr). Q8: blockwise 8-bit codes with one fp32 absmax per kQBlock block
// (quant.h): int8 for exp_avg, uint8 for exp_avg_sq. In every kind the update itself runs in fp32
// on the decoded moments, and the param update uses the new fp32 moments before they are rounded
// for storage.
enum class StateKind : int { F32 = 0, BF16 = 1, Q8 = 2 };

struct AdamArgs {
  float* param;            // fp32 master, updated in place
  const void* grad;        // grad_dtype
  void* exp_avg;           // see StateKind
  void* exp_avg_sq;
  float* exp_avg_scale;    // Q8: absmax of block k of this range at [k]; nullptr otherwise
  float* exp_avg_sq_scale;
  void* param_out;         // optional copy of the updated param in out_dtype (nullptr: none)
  DType grad_dtype;
  DType out_dtype;
  StateKind state;
  float grad_scale;        // multiplies the gradient in-register (loss-scale unscale * clip coef)
  float beta1, beta2, one_minus_beta2;
  // exp_avg's lerp as torch computes it: m = fma(lerp_weight, g - m0, lerp_from_grad ? g : m0), with
  // lerp_weight = 1 - beta1 when that is < 0.5 (any usual beta1), else (1 - beta1) - 1 in fp32, from g.
  float lerp_weight;
  bool lerp_from_grad;
  float eps;
  float decay;             // AdamW: 1 - lr * wd (applied to the param before the update); 1 otherwise
  float l2;                // Adam (not W): weight decay added to the gradient; 0 otherwise
  float step_size;         // lr / (1 - beta1^step), computed in double
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step), computed in double
  float inv_bias_correction2_sqrt;  // 1 / sqrt(1 - beta2^step), in double: the compact kinds' form
  // The compact kinds' bound on the new exp_avg: |m| <= m_bound * sqrt(v), which exact Adam moments
  // always meet (make_adam_args derives it). +inf: none.
  float m_bound;
  // BF16 moments and Q8's exp_avg_sq are stored with stochastic rounding (f32_to_bf16_sr, q_v_sr
  // in quant.h). BF16's 32 random bits of element i are mix32(uint32(round_index + i) ^ round_seed)
  // (round_bits), Q8's 20 are q8_round_bits(round_index + i, round_seed): pure functions of (step,
  // index), so the result does not depend on the thread split, the tiling or the instruction set.
  uint32_t round_seed;     // mix32 of the step (make_adam_args)
  uint64_t round_index;    // index of element 0 of these arrays in the caller's flat state
  // F32 moments updated with the compact kinds' math (adam_math<true>): an int8 block decoded to
  // fp32 because two runs of params share it, updated like the rest of its run. Scalar kernel only.
  bool compact_math;
};

// The per-step constants of AdamArgs from the hyper-parameters (step is 1-based, after this update).
// Bias corrections in double, as torch.optim.Adam(W) computes them on Python floats. Pointers and
// dtypes are left for the caller.
AdamArgs make_adam_args(long step, double lr, double beta1, double beta2, double eps, double weight_decay,
                        bool adamw, double grad_scale);

// One function table per instruction set; [begin, end) is an element range. For StateKind::Q8,
// begin is a multiple of kQBlock (counted from the arrays' start, where block 0's scale is) and end
// is a multiple of it or the end of the arrays.
using AdamFn = void (*)(const AdamArgs&, size_t begin, size_t end);
// Adds the sum of squares of grad[begin, end) into 16 fp64 lanes: element i goes to lane i % 16.
// The fixed lane assignment makes the result independent of the instruction set.
using NormFn = void (*)(const void* grad, DType dt, size_t begin, size_t end, double lanes[16]);
// acc[i] = (overwrite ? 0 : acc[i]) + grad[i] * scale  (the add is not fused, like torch's add_)
using AccumFn = void (*)(float* acc, const void* grad, DType dt, float scale, bool overwrite, size_t begin,
                         size_t end);

struct KernelTable {
  const char* name;
  AdamFn adam;
  NormFn norm;
  AccumFn accumulate;
};

KernelTable scalar_kernels();
KernelTable avx2_kernels();
KernelTable avx512_kernels();
KernelTable avx512_bf16_kernels();  // the AVX512 unit built with -mavx512bf16 too

// Internal linkage on purpose: each translation unit is compiled with its own -m flags, and an
// inline function with external linkage could be merged by the linker into the AVX512 copy and then
// executed on a CPU without AVX512.
namespace {

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, NaN kept quiet; same rule as c10::BFloat16.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);
  } else if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: value = man * 2^-24, exact in fp32
      float v = static_cast<float>(man) * 5.9604644775390625e-08f;
      u = sign | f32_bits(v);
    }
  } else {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  }
  return bits_f32(u);
}

// Round to nearest even, IEEE overflow to inf, subnormals kept; same results as F16C's vcvtps2ph.
inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {  // below the smallest normal half: round to a multiple of 2^-24
    float v = bits_f32(a) * 16777216.0f;  // exact scaling by 2^24
    float r = std::nearbyint(v);           // current rounding mode: nearest even
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r));
  }
  uint32_t mant_round = a + 0xfffu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((mant_round - 0x38000000u) >> 13));
}

inline float load_grad(const void* g, DType dt, size_t i) {
  switch (dt) {
    case DType::F32: return static_cast<const float*>(g)[i];
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
    default: return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
  }
}

inline void store_out(void* out, DType dt, size_t i, float v) {
  switch (dt) {
    case DType::F32: static_cast<float*>(out)[i] = v; break;
    case DType::BF16: static_cast<uint16_t*>(out)[i] = f32_to_bf16(v); break;
    default: static_cast<uint16_t*>(out)[i] = f32_to_f16(v); break;
  }
}

// The compact kinds' exp_avg bound (AdamArgs::m_bound). By Cauchy-Schwarz, exact moments after t
// steps with constant betas meet |m| <= (1-beta1) sqrt(sum_{j<t} (beta1^2/beta2)^j / (1-beta2)) sqrt(v),
// whatever the gradients. 8-bit moments can break it by far: in a block whose absmax is an outlier
// (a gradient 1e6 times its neighbours'), a small exp_avg rounds to the smallest nonzero code (and
// stays there: 0.9 of it rounds back to it) while its exp_avg_sq rounds to 0, so m / sqrt(v) went
// to ~26 and those params moved up to 8 in 50 steps of lr 1e-3 (torch: 0.05). Clamping m to the
// bound (plus 1/64, make_adam_args) changes nothing where the moments are exact, nor bf16's, and
// caps such a step at exact Adam's worst. The fp32 moments (torch's math) are never bounded.
// m is clamped to [-lim, lim], lim = m_bound * sqrt(v), with the comparisons of x86's max/min (the
// second operand when either is NaN), so the vector kernels are one max and one min, no branch. A
// first form tested m*m > m_bound^2 * v and took the square root only in a branch; the branch was
// taken in most vectors of the early steps, where int8's rounding puts the moments near the bound.
// The int8 kernels clamp in the pass that decodes, before the block's absmax, and keep sqrt(v) for
// the denominator (AVX2: in L1 beside the moments): clamping in the pass of the denominator would
// leave the scale at the absmax before the clamp, which an int8 block shared by two runs of params
// (decoded to fp32, updated, re-encoded whole: engine/moments.py) cannot reproduce.
// A NaN m stays NaN; a NaN lim (v NaN, or an infinite bound times v = 0) leaves m as it is.
// sqrt_v: sqrt(v), the one the denominator takes too.
inline float bound_m(const AdamArgs& a, float m, float sqrt_v) {
  const float lim = a.m_bound * sqrt_v;
  const float t = -lim > m ? -lim : m;  // max_ps(-lim, m)
  return lim < t ? lim : t;             // min_ps(lim, t)
}

// The canonical update of one element: g already widened and scaled; returns the new param and
// the new moments in m, v. The vector kernels perform exactly these operations.
// Compact (bf16 and 8-bit moments): sqrt(v) times the reciprocal of the bias correction, one fma,
// instead of a division: <= 1 ulp from torch's denominator, far below the moments' own storage
// rounding, and one of the three divider operations per element (the divider is what bounds
// the compact kernels, which move fewer bytes); and the param's update as one fma. fp32 moments
// keep torch's form bit for bit.
template <bool Compact>
inline float adam_math(const AdamArgs& a, float g, float p, float m0, float v0, float& m, float& v) {
  if (a.l2 != 0.0f) g = std::fma(a.l2, p, g);
  p = p * a.decay;
  m = std::fma(a.lerp_weight, g - m0, a.lerp_from_grad ? g : m0);
  v = std::fma(a.one_minus_beta2 * g, g, v0 * a.beta2);
  const float sqrt_v = std::sqrt(v);
  if constexpr (Compact) m = bound_m(a, m, sqrt_v);
  const float denom = Compact ? std::fma(sqrt_v, a.inv_bias_correction2_sqrt, a.eps)
                              : sqrt_v / a.bias_correction2_sqrt + a.eps;
  if constexpr (Compact) return std::fma(-a.step_size, m / denom, p);
  return p + -a.step_size * m / denom;  // torch's addcdiv: (value * m) / denom, then the add
}

// A 32-bit integer hash with full avalanche (C. Wellons' "lowbias32": two multiplies, three
// xor-shifts), the source of the stochastic rounding's random bits. Only integer operations, so
// every instruction set computes the same bits.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// f32 -> bf16 with stochastic rounding: r (< 2^16) added below the kept bits, then truncation,
// so x rounds up with probability (its distance from the lower bf16) / ulp and the stored moment
// is unbiased. Round-to-nearest would freeze exp_avg_sq once its per-step change (1 - beta2 of
// it, 0.1%) falls under half a bf16 ulp (0.2-0.4%), while the bias correction keeps moving.
// Infinities stay (their low bits are 0 and the sum stays below the next exponent); NaN -> quiet.
inline uint16_t f32_to_bf16_sr(float f, uint32_t r) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + r) >> 16);
}

// int8 exp_avg_sq's 20 random bits for the element with flat index ``index``: the high 20 bits of
// (index * 0x9e3779b1) ^ seed. The seed (mix32 of the step) makes an element's bits uniform and
// independent from step to step; within a step, the elements see a Weyl sequence (index times an
// odd constant near 2^32 / golden ratio: well spread) with the seed's bits flipped. Only each
// element's own bits matter to its rounding. Cheaper than round_bits' mix32 (two multiplies, three
// xor-shifts; it was 0.24 of the 0.28 ns/param that the stochastic codes first added, AVX2, in
// cache) and than one multiply per element: index * C moves on by a constant per vector (an add).
inline uint32_t q8_round_bits(uint64_t index, uint32_t seed) {
  return ((static_cast<uint32_t>(index) * 0x9e3779b1u) ^ seed) >> 12;
}

// int8 exp_avg's seed for a step's seed: its own stream of bits (the same Weyl sequence, another
// seed), so an element's two moments do not round up together; mix32 makes it independent of seed.
inline uint32_t q8_seed_m(uint32_t seed) { return mix32(seed ^ 0x7f4a7c15u); }

// AdamArgs::round_seed of a step (make_adam_args, and quantize for exp_avg_sq at a step).
inline uint32_t round_seed_of(long step) { return mix32(static_cast<uint32_t>(step) ^ 0x9e3779b9u); }

inline uint32_t round_bits(const AdamArgs& a, size_t i) {
  return mix32(static_cast<uint32_t>(a.round_index + i) ^ a.round_seed);
}

// One element with fp32 (S = F32) or bf16 (S = BF16) moments.
template <StateKind S, bool Compact = S != StateKind::F32>
inline void adam_scalar_elem(const AdamArgs& a, size_t i) {
  const float g = load_grad(a.grad, a.grad_dtype, i) * a.grad_scale;
  float m0, v0, m, v;
  if constexpr (S == StateKind::F32) {
    m0 = static_cast<const float*>(a.exp_avg)[i];
    v0 = static_cast<const float*>(a.exp_avg_sq)[i];
  } else {
    m0 = bf16_to_f32(static_cast<const uint16_t*>(a.exp_avg)[i]);
    v0 = bf16_to_f32(static_cast<const uint16_t*>(a.exp_avg_sq)[i]);
  }
  const float p = adam_math<Compact>(a, g, a.param[i], m0, v0, m, v);
  if constexpr (S == StateKind::F32) {
    static_cast<float*>(a.exp_avg)[i] = m;
    static_cast<float*>(a.exp_avg_sq)[i] = v;
  } else {  // exp_avg takes the low 16 random bits, exp_avg_sq the high ones
    const uint32_t r = round_bits(a, i);
    static_cast<uint16_t*>(a.exp_avg)[i] = f32_to_bf16_sr(m, r & 0xffffu);
    static_cast<uint16_t*>(a.exp_avg_sq)[i] = f32_to_bf16_sr(v, r >> 16);
  }
  a.param[i] = p;
  if (a.param_out) store_out(a.param_out, a.out_dtype, i, p);
}

inline void norm_scalar_range(const void* g, DType dt, size_t begin, size_t end, double lanes[16]) {
  for (size_t i = begin; i < end; ++i) {
    double x = static_cast<double>(load_grad(g, dt, i));
    lanes[i & 15] = std::fma(x, x, lanes[i & 15]);
  }
}

inline void accumulate_scalar_elem(float* acc, const void* g, DType dt, float scale, bool overwrite, size_t i) {
  float x = load_grad(g, dt, i) * scale;
  acc[i] = overwrite ? x : acc[i] + x;
}

}  // namespace
}  // namespace hzo
