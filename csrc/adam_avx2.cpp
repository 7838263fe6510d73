// AVX2 + FMA + F16C kernels: 8 fp32 lanes per vector. Compiled with -mavx2 -mfma -mf16c only,
// chosen after cpu_can_run_avx2() (cpu_features.cpp) has checked exactly those.
//
// Every vector operation below is the lane-wise image of one operation of adam_scalar_elem /
// norm_scalar_range / accumulate_scalar_elem in adam.h (same fused multiply-adds, true division,
// true square root), so results are bit-identical to the scalar path; tails use the scalar helpers.
// The grad dtype, the param_out dtype, the state kind and the L2 switch are template parameters: the inner loop
// has no per-element switch.
#include <immintrin.h>

#include <algorithm>

#include "prefetch.h"
#include "quant_avx2.h"

namespace hzo {
namespace {

template <DType G>
inline __m256 load_g(const void* g, size_t i) {
  if constexpr (G == DType::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  } else if constexpr (G == DType::BF16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {  // exact widening, subnormal halves included
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    return _mm256_cvtph_ps(h);
  }
}

// NaN lanes: the unordered compare is true exactly for f32_to_bf16's (u & 0x7fffffff) > 0x7f800000.
inline __m256i nan_lanes(__m256 x) { return _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
inline bool any_nan(__m256 x, __m256 y) { return _mm256_movemask_ps(_mm256_cmp_ps(x, y, _CMP_UNORD_Q)) != 0; }

// f32 -> bf16, round to nearest even with the integer trick, NaN -> quiet NaN (same as f32_to_bf16), each lane's
// bf16 in the low half of its 32 bits. The rounding alone gives f32_to_bf16's bits for every lane but a NaN, so the
// NaN fix-up (a blend: 3 uops on Intel cores) runs only for a vector with a NaN lane, behind a compare and a
// movemask: nearly no vector has one. adam_micro in cache, Emerald Rapids (session 23, alternated builds): bf16
// moments 1.255 -> 1.062 ns/param, int8 1.003 -> 0.957, fp32 0.692 -> 0.672 (AVX512: adam_avx512.cpp).
inline __m256i to_bf16_lanes(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  if (__builtin_expect(!any_nan(x, x), 1)) return r;
  return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan_lanes(x));
}
inline __m128i to_bf16(__m256 x) {
  const __m256i r = to_bf16_lanes(x);
  // values are <= 0xffff, so the unsigned saturation of packus never triggers
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
// Two vectors at once: one pack and one permute for 16 values instead of an extract and a pack per 8
// (the pack works within 128-bit lanes: quarters r0.lo, r1.lo, r0.hi, r1.hi, put back in order).
inline __m256i to_bf16_x2(__m256 x0, __m256 x1) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(to_bf16_lanes(x0), to_bf16_lanes(x1)), 0xd8);
}

// Out: -1 none, else the DType of param_out.
// NT: non-temporal store (the caller checked the alignment). param_out is written once and only
// read later by a copy to the device, so streaming it skips the read-for-ownership of its lines.
template <int Out, bool NT>
inline void store_o(void* out, size_t i, __m256 p) {
  if constexpr (Out == static_cast<int>(DType::F32)) {
    float* dst = static_cast<float*>(out) + i;
    if constexpr (NT) _mm256_stream_ps(dst, p);
    else _mm256_storeu_ps(dst, p);
  } else if constexpr (Out >= 0) {
    __m128i h;
    if constexpr (Out == static_cast<int>(DType::BF16)) h = to_bf16(p);
    else h = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
    if constexpr (NT) _mm_stream_si128(dst, h);
    else _mm_storeu_si128(dst, h);
  }
}

// Moments stored as fp32 or as bf16 bits.
template <StateKind S>
inline __m256 load_state(const void* base, size_t i) {
  if constexpr (S == StateKind::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// mix32 lane by lane (mullo keeps the low 32 bits of each product, as uint32_t's * does).
inline __m256i mix32_vec(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// f32_to_bf16_sr lane by lane: r (< 2^16 per lane) added, truncated; NaN -> quiet NaN.
// The NaN fix-up only for a vector with a NaN lane, as in to_bf16_lanes.
inline __m128i to_bf16_sr(__m256 x, __m256i r) {
  const __m256i u = _mm256_castps_si256(x);
  __m256i t = _mm256_srli_epi32(_mm256_add_epi32(u, r), 16);
  if (__builtin_expect(any_nan(x, x), 0))
    t = _mm256_blendv_epi8(t, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan_lanes(x));
  return _mm_packus_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

inline void store_bf16(void* base, size_t i, __m128i h) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i), h);
}

struct Consts {
  // bc2: sqrt(1 - beta2^t), or its reciprocal for the compact math (one register either way)
  __m256 scale, l2, decay, b2, lw, omb2, bc2, eps, neg_step, mb;
  bool lerp_from_grad;
  Consts(const AdamArgs& a, bool compact)
      : scale(_mm256_set1_ps(a.grad_scale)), l2(_mm256_set1_ps(a.l2)), decay(_mm256_set1_ps(a.decay)),
        b2(_mm256_set1_ps(a.beta2)), lw(_mm256_set1_ps(a.lerp_weight)),
        omb2(_mm256_set1_ps(a.one_minus_beta2)),
        bc2(_mm256_set1_ps(compact ? a.inv_bias_correction2_sqrt : a.bias_correction2_sqrt)),
        eps(_mm256_set1_ps(a.eps)), neg_step(_mm256_set1_ps(-a.step_size)), mb(_mm256_set1_ps(a.m_bound)),
        lerp_from_grad(a.lerp_from_grad) {}
};

// bound_m (adam.h), lane by lane: max_ps/min_ps return their second operand when either is NaN,
// bound_m's comparisons
inline __m256 bound_m_vec(const Consts& c, __m256 m, __m256 sqrt_v) {
  const __m256 lim = _mm256_mul_ps(c.mb, sqrt_v);
  const __m256 t = _mm256_max_ps(_mm256_xor_ps(lim, _mm256_set1_ps(-0.0f)), m);
  return _mm256_min_ps(lim, t);
}

// adam_math, lane by lane, in its two halves: the new moments (and sqrt(v), returned), then the param
// from them.
template <bool L2, bool Compact>
inline __m256 moments_vec(const Consts& c, __m256 g, __m256 p, __m256 m0, __m256 v0, __m256& m, __m256& v) {
  if constexpr (L2) g = _mm256_fmadd_ps(c.l2, p, g);
  m = _mm256_fmadd_ps(c.lw, _mm256_sub_ps(g, m0), c.lerp_from_grad ? g : m0);
  v = _mm256_fmadd_ps(_mm256_mul_ps(c.omb2, g), g, _mm256_mul_ps(v0, c.b2));
  const __m256 sqrt_v = _mm256_sqrt_ps(v);
  if constexpr (Compact) m = bound_m_vec(c, m, sqrt_v);
  return sqrt_v;
}

template <bool Compact>
inline __m256 param_vec(const Consts& c, __m256 p, __m256 m, __m256 sqrt_v) {
  p = _mm256_mul_ps(p, c.decay);
  const __m256 denom = Compact ? _mm256_fmadd_ps(sqrt_v, c.bc2, c.eps)
                               : _mm256_add_ps(_mm256_div_ps(sqrt_v, c.bc2), c.eps);
  if constexpr (Compact) return _mm256_fmadd_ps(c.neg_step, _mm256_div_ps(m, denom), p);
  return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(c.neg_step, m), denom));  // adam_math's torch form
}

template <bool L2, bool Compact>
inline __m256 adam_vec(const Consts& c, __m256 g, __m256 p, __m256 m0, __m256 v0, __m256& m, __m256& v) {
  const __m256 sqrt_v = moments_vec<L2, Compact>(c, g, p, m0, v0, m, v);
  return param_vec<Compact>(c, p, m, sqrt_v);
}

template <DType G, int Out, bool L2, bool NT, StateKind S>
void adam_range(const AdamArgs& a, size_t begin, size_t end) {
  const Consts c(a, S != StateKind::F32);
  float* __restrict param = a.param;
  size_t i = begin;
  // BF16: lane l's counter, round_index + i + l (uint32 arithmetic wraps as round_bits' cast does)
  __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(a.round_index + i))),
                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i seed = _mm256_set1_epi32(static_cast<int>(a.round_seed));
  for (; i + W <= end; i += W) {
    step_prefetch<W, G == DType::F32 ? 4 : 2, S == StateKind::F32 ? 4 : 2>(param, a.grad, a.exp_avg, a.exp_avg_sq, i);
    const __m256 g = _mm256_mul_ps(load_g<G>(a.grad, i), c.scale);
    __m256 m, v;
    const __m256 p = adam_vec<L2, S != StateKind::F32>(c, g, _mm256_loadu_ps(param + i), load_state<S>(a.exp_avg, i),
                                                        load_state<S>(a.exp_avg_sq, i), m, v);
    if constexpr (S == StateKind::F32) {
      _mm256_storeu_ps(static_cast<float*>(a.exp_avg) + i, m);
      _mm256_storeu_ps(static_cast<float*>(a.exp_avg_sq) + i, v);
    } else {  // low 16 random bits for exp_avg, high for exp_avg_sq (adam_scalar_elem)
      const __m256i r = mix32_vec(_mm256_xor_si256(idx, seed));
      idx = _mm256_add_epi32(idx, _mm256_set1_epi32(W));
      store_bf16(a.exp_avg, i, to_bf16_sr(m, _mm256_and_si256(r, _mm256_set1_epi32(0xffff))));
      store_bf16(a.exp_avg_sq, i, to_bf16_sr(v, _mm256_srli_epi32(r, 16)));
    }
    _mm256_storeu_ps(param + i, p);
    store_o<Out, NT>(a.param_out, i, p);
  }
  if constexpr (NT) _mm_sfence();  // order the streamed stores before the join
  for (; i < end; ++i) adam_scalar_elem<S>(a, i);
}

// ---- Q8 (the lane codecs: quant_avx2.h)

// adam_q8_block_scalar, block by block: vectors over the block, a scalar tail only in a partial
// last block (blocks start at multiples of kQBlock, a multiple of W). Two passes per block, the same
// operations per element as the scalar block in another order: (1) decode, the new moments and
// sqrt(v) (for bound_m's clamp), kept in L1 with the moments' absmax; (2) the param from them (the
// division) together with the encode. Putting the divider's work in the loop of the integer/shuffle-
// heavy encode lets the two overlap. sqrt(v) is stored in pass 1 and loaded in pass 2, not taken
// again: llvm-mca 14 (znver3), bf16 grad and param out, pass 2 went 64.1 -> 49.6 cycles per 32
// params (pass 1 13.7 -> 14.0 per 8), and single-threaded in cache (adam_micro) 1.50 -> 1.34 ns/param.
// With the param in pass 1 instead (adam_avx512.cpp's order) it counted 26.7 + 19.2 / 4 and ran 1.57.
// Session 20: pass 1 runs over spans of 64 elements with their prefetches at once (no test per vector:
// 13.8 -> 12.8 cycles per 8), pass 2 packs a bf16 param out two vectors at a time and the encoders
// clamp once per 32 codes (quant_avx2.h): 53.1 -> 47.1 cycles per 32. (The figures above came from
// adam_micro with malloc's arrays, 16 bytes past a page: every other 32-byte load split two lines.)
template <DType G, int Out, bool L2, bool NT>
void adam_q8_range(const AdamArgs& a, size_t begin, size_t end) {
  const Consts c(a, true);
  int8_t* mc = static_cast<int8_t*>(a.exp_avg);
  uint8_t* vc = static_cast<uint8_t*>(a.exp_avg_sq);
  const __m256i seed = _mm256_set1_epi32(static_cast<int>(a.round_seed));
  const __m256i seed_m = _mm256_set1_epi32(static_cast<int>(q8_seed_m(a.round_seed)));
  alignas(32) float mb[kQBlock], vb[kQBlock], sb[kQBlock];  // sb: sqrt(v) of vb
  // Locals, not a's fields: the vector stores may alias anything, so a's fields would be reloaded each time.
  float* const params = a.param;
  const void* const grad = a.grad;
  void* const out = a.param_out;
  for (size_t b = begin; b < end; b += kQBlock) {
    const size_t e = std::min(end, b + kQBlock), k = b / kQBlock, nv = (e - b) / W * W;
    const __m256 ms = _mm256_set1_ps(a.exp_avg_scale[k]), vs = _mm256_set1_ps(a.exp_avg_sq_scale[k]);
    __m256 mmax = _mm256_setzero_ps(), vmax = _mm256_setzero_ps();
    auto moments = [&](size_t j) {
      const size_t i = b + j;
      const __m256 g = _mm256_mul_ps(load_g<G>(grad, i), c.scale);
      __m256 m, v;
      const __m256 sq = moments_vec<L2, true>(c, g, L2 ? _mm256_loadu_ps(params + i) : g,
                                               _mm256_mul_ps(dq_m_vec(mc + i), ms),
                                               _mm256_mul_ps(dq_v_vec(vc + i), vs), m, v);
      _mm256_store_ps(sb + j, sq);
      _mm256_store_ps(mb + j, m);
      _mm256_store_ps(vb + j, v);
      mmax = _mm256_max_ps(_mm256_and_ps(m, abs_mask()), mmax);
      vmax = _mm256_max_ps(v, vmax);  // v >= 0 or NaN here: |v| is v (see q_v_x4)
    };
    size_t j1 = 0;
    for (; j1 + kQSpan <= nv; j1 += kQSpan) {  // the span's prefetches at once, no per-vector tests
      q8_prefetch_span<G == DType::F32 ? 4 : 2>(params, grad, mc, vc, b + j1);
#pragma GCC unroll 8
      for (size_t q = 0; q < kQSpan; q += W) moments(j1 + q);
    }
    for (; j1 < nv; j1 += W) moments(j1);  // a partial block's last vectors
    float mx = hmax(mmax), vx = hmax(vmax);
    q_update_tail(a, b, b + nv, e, mb, vb, mx, vx);  // the partial block's tail: the whole scalar update
    const float minv = q_inverse(mx), vinv = q_inverse(vx);
    const __m256 mdv = _mm256_set1_ps(minv), vdv = _mm256_set1_ps(vinv);
    // the moments' random bits: lane l of the vector at j has index round_index + b + j + l
    __m256i weyl = weyl_of(a.round_index + b);
    auto new_param = [&](size_t j) {
      const size_t i = b + j;
      const __m256 p = param_vec<true>(c, _mm256_loadu_ps(params + i), _mm256_load_ps(mb + j),
                                       _mm256_load_ps(sb + j));
      _mm256_storeu_ps(params + i, p);
      return p;
    };
    auto param = [&](size_t j) { store_o<Out, NT>(out, b + j, new_param(j)); };
    // Two vectors: a bf16 param out as one 32-byte store (pick_nt checks 32-byte alignment for it).
    auto param_x2 = [&](size_t j) {
      if constexpr (Out == static_cast<int>(DType::BF16)) {
        const __m256 p0 = new_param(j), p1 = new_param(j + W);
        __m256i* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + b + j);
        if constexpr (NT) _mm256_stream_si256(dst, to_bf16_x2(p0, p1));
        else _mm256_storeu_si256(dst, to_bf16_x2(p0, p1));
      } else {
        param(j);
        param(j + W);
      }
    };
    size_t j = 0;
    for (; j + 4 * W <= nv; j += 4 * W) {
      param_x2(j);
      param_x2(j + 2 * W);
      q_m_x4(mb + j, mdv, weyl, seed_m, mc + b + j);  // before q_v_x4 moves weyl on
      q_v_x4(vb + j, vdv, weyl, seed, vc + b + j);
    }
    for (; j < nv; j += W) {
      param(j);
      q_m_vec(_mm256_load_ps(mb + j), mdv, round_at(weyl, seed_m), mc + b + j);
      q_v_vec(_mm256_load_ps(vb + j), vdv, round_hi20(weyl, seed), vc + b + j);
    }
    q_block_tail(a, b, mb, vb, j, e - b, minv, vinv);
    a.exp_avg_scale[k] = mx;
    a.exp_avg_sq_scale[k] = vx;
  }
  if constexpr (NT) _mm_sfence();  // order the streamed stores before the join
}

template <DType G, int Out, bool NT, bool L2>
AdamFn pick_state(StateKind s) {
  switch (s) {
    case StateKind::F32: return &adam_range<G, Out, L2, NT, StateKind::F32>;
    case StateKind::BF16: return &adam_range<G, Out, L2, NT, StateKind::BF16>;
    default: return &adam_q8_range<G, Out, L2, NT>;
  }
}

template <DType G, int Out, bool NT>
AdamFn pick_l2(const AdamArgs& a) {
  // the same test as adam_math
  return a.l2 != 0.0f ? pick_state<G, Out, NT, true>(a.state) : pick_state<G, Out, NT, false>(a.state);
}

template <DType G, int Out>
AdamFn pick_nt(const AdamArgs& a, size_t begin) {
  // Every vector store lands on a multiple of its own width when the first one does. The int8 loop
  // stores a bf16 param out two vectors at a time (32 bytes, from block starts: multiples of 512 bytes).
  const size_t elem = Out == static_cast<int>(DType::F32) ? 4 : 2;
  const size_t bytes = a.state == StateKind::Q8 && Out == static_cast<int>(DType::BF16) ? 32 : elem * W;
  const bool aligned = (reinterpret_cast<uintptr_t>(a.param_out) + begin * elem) % bytes == 0;
  return aligned ? pick_l2<G, Out, true>(a) : pick_l2<G, Out, false>(a);
}

template <DType G>
AdamFn pick_out(const AdamArgs& a, size_t begin) {
  if (!a.param_out) return pick_l2<G, -1, false>(a);
  switch (a.out_dtype) {
    case DType::F32: return pick_nt<G, 0>(a, begin);
    case DType::BF16: return pick_nt<G, 1>(a, begin);
    default: return pick_nt<G, 2>(a, begin);
  }
}

void adam_k(const AdamArgs& a, size_t begin, size_t end) {
  AdamFn f;
  switch (a.grad_dtype) {
    case DType::F32: f = pick_out<DType::F32>(a, begin); break;
    case DType::BF16: f = pick_out<DType::BF16>(a, begin); break;
    default: f = pick_out<DType::F16>(a, begin); break;
  }
  f(a, begin, end);
}

// Lane l of the 16 fp64 accumulators (four vectors of 4) holds the elements i with i % 16 == l,
// each added with one fma in index order: the same sequence as norm_scalar_range.
template <DType G>
void norm_range(const void* g, size_t begin, size_t end, double lanes[16]) {
  size_t i = std::min(end, (begin + 15) / 16 * 16);
  norm_scalar_range(g, G, begin, i, lanes);
  __m256d acc0 = _mm256_loadu_pd(lanes), acc1 = _mm256_loadu_pd(lanes + 4);
  __m256d acc2 = _mm256_loadu_pd(lanes + 8), acc3 = _mm256_loadu_pd(lanes + 12);
  for (; i + 16 <= end; i += 16) {
    const __m256 x0 = load_g<G>(g, i), x1 = load_g<G>(g, i + 8);
    const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(x0));
    const __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(x0, 1));
    const __m256d d2 = _mm256_cvtps_pd(_mm256_castps256_ps128(x1));
    const __m256d d3 = _mm256_cvtps_pd(_mm256_extractf128_ps(x1, 1));
    acc0 = _mm256_fmadd_pd(d0, d0, acc0);
    acc1 = _mm256_fmadd_pd(d1, d1, acc1);
    acc2 = _mm256_fmadd_pd(d2, d2, acc2);
    acc3 = _mm256_fmadd_pd(d3, d3, acc3);
  }
  _mm256_storeu_pd(lanes, acc0);
  _mm256_storeu_pd(lanes + 4, acc1);
  _mm256_storeu_pd(lanes + 8, acc2);
  _mm256_storeu_pd(lanes + 12, acc3);
  norm_scalar_range(g, G, i, end, lanes);
}

void norm_k(const void* g, DType dt, size_t begin, size_t end, double lanes[16]) {
  switch (dt) {
    case DType::F32: norm_range<DType::F32>(g, begin, end, lanes); break;
    case DType::BF16: norm_range<DType::BF16>(g, begin, end, lanes); break;
    default: norm_range<DType::F16>(g, begin, end, lanes); break;
  }
}

template <DType G, bool Overwrite>
void acc_range(float* acc, const void* g, float scale, size_t begin, size_t end) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = begin;
  for (; i + W <= end; i += W) {
    const __m256 x = _mm256_mul_ps(load_g<G>(g, i), s);
    if constexpr (Overwrite) {
      _mm256_storeu_ps(acc + i, x);
    } else {
      _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), x));
    }
  }
  for (; i < end; ++i) accumulate_scalar_elem(acc, g, G, scale, Overwrite, i);
}

template <DType G>
void acc_dt(float* acc, const void* g, float scale, bool overwrite, size_t begin, size_t end) {
  if (overwrite) acc_range<G, true>(acc, g, scale, begin, end);
  else acc_range<G, false>(acc, g, scale, begin, end);
}

void acc_k(float* acc, const void* g, DType dt, float scale, bool overwrite, size_t begin, size_t end) {
  switch (dt) {
    case DType::F32: acc_dt<DType::F32>(acc, g, scale, overwrite, begin, end); break;
    case DType::BF16: acc_dt<DType::BF16>(acc, g, scale, overwrite, begin, end); break;
    default: acc_dt<DType::F16>(acc, g, scale, overwrite, begin, end); break;
  }
}

}  // namespace

KernelTable avx2_kernels() { return {"avx2", adam_k, norm_k, acc_k}; }

}  // namespace hzo
