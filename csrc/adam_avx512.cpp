// AVX512 (F/BW/VL/DQ) kernels: 16 fp32 lanes per vector. Compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mfma -mf16c only, chosen after cpu_can_run_avx512() has checked those.
// Built again with -mavx512bf16 too (level "avx512_bf16", after cpu_can_run_avx512_bf16()): the only
// difference is AVX512_BF16's conversion for a bf16 param out (__AVX512BF16__ below).
//
// Every vector operation below is the lane-wise image of one operation of adam_scalar_elem /
// norm_scalar_range / accumulate_scalar_elem in adam.h (same fused multiply-adds, true division,
// true square root), so results are bit-identical to the scalar path; tails use the scalar helpers.
// The grad dtype, the param_out dtype, the state kind and the L2 switch are template parameters: the inner loop
// has no per-element switch.
#include <immintrin.h>

#include <algorithm>

#include "prefetch.h"
#include "quant_avx512.h"

namespace hzo {
namespace {

constexpr size_t W = 16;  // fp32 lanes per vector

template <DType G>
inline __m512 load_g(const void* g, size_t i) {
  if constexpr (G == DType::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(g) + i);
  } else if constexpr (G == DType::BF16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {  // exact widening, subnormal halves included
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
    return _mm512_cvtph_ps(h);
  }
}

// f32 -> bf16, round to nearest even with the integer trick, NaN -> quiet NaN (same as f32_to_bf16).
// The avx512_bf16 build takes vcvtneps2bf16 for a vector without a denormal lane: it rounds to nearest
// even and quiets a NaN as f32_to_bf16 does (checked on every non-denormal fp32 bit pattern), but it
// flushes a denormal input to zero whatever MXCSR says, which torch's conversion does not; such a vector
// takes the integer path. Three vector operations for two bf16 vectors where the integer path takes 16.
// The NaN fix-up runs only for a vector with a NaN lane (adam_avx2.cpp's to_bf16_lanes says why): in cache on an
// Emerald Rapids core (session 23) bf16 moments 0.792 -> 0.755-0.762 ns/param, int8 0.879-0.882 -> 0.866-0.869.
#ifdef __AVX512BF16__
// The fp32 denormal lanes, tested on the bits: vfpclassps sees a denormal as zero under MXCSR.DAZ.
inline __mmask16 denormal_lanes(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __mmask16 zero_exp = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_test_epi32_mask(zero_exp, u, _mm512_set1_epi32(0x007fffff));
}
#endif
// Each lane's bf16 in the low half of its 32 bits.
inline __m512i to_bf16_lanes(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  // The unordered self-compare is true exactly for NaNs, f32_to_bf16's (u & 0x7fffffff) > 0x7f800000.
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  if (__builtin_expect(nan != 0, 0)) r = _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  return r;
}
inline __m256i to_bf16(__m512 x) {
#ifdef __AVX512BF16__
  if (__builtin_expect(denormal_lanes(x) == 0, 1)) return (__m256i)_mm512_cvtneps_pbh(x);
#endif
  return _mm512_cvtepi32_epi16(to_bf16_lanes(x));  // values are <= 0xffff: truncation is exact
}
// Two vectors at once: one pack and one permute for 32 values where two vpmovdw take four port-5 uops on Intel
// cores. The pack works within 128-bit lanes (quadwords r0.q0, r1.q0, r0.q1, r1.q1, ...), the permute puts them
// back in order; values are <= 0xffff, so the unsigned saturation never triggers.
inline __m512i to_bf16_x2(__m512 x0, __m512 x1) {
#ifdef __AVX512BF16__
  // x0's 16 values in the low half, in order
  if (__builtin_expect((denormal_lanes(x0) | denormal_lanes(x1)) == 0, 1)) return (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
#endif
  return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                  _mm512_packus_epi32(to_bf16_lanes(x0), to_bf16_lanes(x1)));
}

// Out: -1 none, else the DType of param_out.
// NT: non-temporal store (the caller checked the alignment). param_out is written once and only
// read later by a copy to the device, so streaming it skips the read-for-ownership of its lines:
// 2 B/param of the 30 a bf16 pass would otherwise move (measured 3-10% faster at 4M-50M elements,
// neutral at 1M). Streaming param/exp_avg/exp_avg_sq (read, then written) measured slower.
template <int Out, bool NT>
inline void store_o(void* out, size_t i, __m512 p) {
  if constexpr (Out == static_cast<int>(DType::F32)) {
    float* dst = static_cast<float*>(out) + i;
    if constexpr (NT) _mm512_stream_ps(dst, p);
    else _mm512_storeu_ps(dst, p);
  } else if constexpr (Out >= 0) {
    __m256i h;
    if constexpr (Out == static_cast<int>(DType::BF16)) h = to_bf16(p);
    else h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256i* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i);
    if constexpr (NT) _mm256_stream_si256(dst, h);
    else _mm256_storeu_si256(dst, h);
  }
}

// Moments stored as fp32 or as bf16 bits.
template <StateKind S>
inline __m512 load_state(const void* base, size_t i) {
  if constexpr (S == StateKind::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// mix32 lane by lane (mullo keeps the low 32 bits of each product, as uint32_t's * does).
inline __m512i mix32_vec(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// f32_to_bf16_sr lane by lane: r (< 2^16 per lane) added, truncated; NaN -> quiet NaN.
inline __m256i to_bf16_sr(__m512 x, __m512i r) {
  const __m512i u = _mm512_castps_si512(x);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  __m512i t = _mm512_srli_epi32(_mm512_add_epi32(u, r), 16);
  if (__builtin_expect(nan != 0, 0))
    t = _mm512_mask_blend_epi32(nan, t, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(t);  // values are <= 0xffff: truncation is exact
}

inline void store_bf16(void* base, size_t i, __m256i h) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i), h);
}

struct Consts {
  // bc2: sqrt(1 - beta2^t), or its reciprocal for the compact math (one register either way)
  __m512 scale, l2, decay, b2, lw, omb2, bc2, eps, neg_step, mb;
  bool lerp_from_grad;
  Consts(const AdamArgs& a, bool compact)
      : scale(_mm512_set1_ps(a.grad_scale)), l2(_mm512_set1_ps(a.l2)), decay(_mm512_set1_ps(a.decay)),
        b2(_mm512_set1_ps(a.beta2)), lw(_mm512_set1_ps(a.lerp_weight)),
        omb2(_mm512_set1_ps(a.one_minus_beta2)),
        bc2(_mm512_set1_ps(compact ? a.inv_bias_correction2_sqrt : a.bias_correction2_sqrt)),
        eps(_mm512_set1_ps(a.eps)), neg_step(_mm512_set1_ps(-a.step_size)), mb(_mm512_set1_ps(a.m_bound)),
        lerp_from_grad(a.lerp_from_grad) {}
};

// bound_m (adam.h), lane by lane: max_ps/min_ps return their second operand when either is NaN,
// bound_m's comparisons
inline __m512 bound_m_vec(const Consts& c, __m512 m, __m512 sqrt_v) {
  const __m512 lim = _mm512_mul_ps(c.mb, sqrt_v);
  const __m512 neg = _mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(lim), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  return _mm512_min_ps(lim, _mm512_max_ps(neg, m));
}

// adam_math, lane by lane.
template <bool L2, bool Compact>
inline __m512 adam_vec(const Consts& c, __m512 g, __m512 p, __m512 m0, __m512 v0, __m512& m, __m512& v) {
  if constexpr (L2) g = _mm512_fmadd_ps(c.l2, p, g);
  p = _mm512_mul_ps(p, c.decay);
  m = _mm512_fmadd_ps(c.lw, _mm512_sub_ps(g, m0), c.lerp_from_grad ? g : m0);
  v = _mm512_fmadd_ps(_mm512_mul_ps(c.omb2, g), g, _mm512_mul_ps(v0, c.b2));
  const __m512 sqrt_v = _mm512_sqrt_ps(v);
  if constexpr (Compact) m = bound_m_vec(c, m, sqrt_v);
  const __m512 denom = Compact ? _mm512_fmadd_ps(sqrt_v, c.bc2, c.eps)
                               : _mm512_add_ps(_mm512_div_ps(sqrt_v, c.bc2), c.eps);
  if constexpr (Compact) return _mm512_fmadd_ps(c.neg_step, _mm512_div_ps(m, denom), p);
  return _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c.neg_step, m), denom));  // adam_math's torch form
}

template <DType G, int Out, bool L2, bool NT, StateKind S>
void adam_range(const AdamArgs& a, size_t begin, size_t end) {
  const Consts c(a, S != StateKind::F32);
  float* __restrict param = a.param;
  size_t i = begin;
  // BF16: lane l's counter, round_index + i + l (uint32 arithmetic wraps as round_bits' cast does)
  __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(a.round_index + i))),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i seed = _mm512_set1_epi32(static_cast<int>(a.round_seed));
  for (; i + W <= end; i += W) {
    step_prefetch<W, G == DType::F32 ? 4 : 2, S == StateKind::F32 ? 4 : 2>(param, a.grad, a.exp_avg, a.exp_avg_sq, i);
    const __m512 g = _mm512_mul_ps(load_g<G>(a.grad, i), c.scale);
    __m512 m, v;
    const __m512 p = adam_vec<L2, S != StateKind::F32>(c, g, _mm512_loadu_ps(param + i), load_state<S>(a.exp_avg, i),
                                                        load_state<S>(a.exp_avg_sq, i), m, v);
    if constexpr (S == StateKind::F32) {
      _mm512_storeu_ps(static_cast<float*>(a.exp_avg) + i, m);
      _mm512_storeu_ps(static_cast<float*>(a.exp_avg_sq) + i, v);
    } else {  // low 16 random bits for exp_avg, high for exp_avg_sq (adam_scalar_elem)
      const __m512i r = mix32_vec(_mm512_xor_si512(idx, seed));
      idx = _mm512_add_epi32(idx, _mm512_set1_epi32(W));
      store_bf16(a.exp_avg, i, to_bf16_sr(m, _mm512_and_si512(r, _mm512_set1_epi32(0xffff))));
      store_bf16(a.exp_avg_sq, i, to_bf16_sr(v, _mm512_srli_epi32(r, 16)));
    }
    _mm512_storeu_ps(param + i, p);
    store_o<Out, NT>(a.param_out, i, p);
  }
  if constexpr (NT) _mm_sfence();  // order the streamed stores before the join
  for (; i < end; ++i) adam_scalar_elem<S>(a, i);
}

// Pass 1 of adam_q8_block_scalar over the block [b, e): the update, the param and param out written,
// the new moments kept in mb/vb and their block maxima returned in mx/vx. A scalar tail only in a
// partial last block (blocks start at multiples of kQBlock, a multiple of W).
template <DType G, int Out, bool L2, bool NT>
inline void q8_update(const AdamArgs& a, const Consts& c, size_t b, size_t e, float* mb, float* vb, float& mx,
                      float& vx) {
  const int8_t* mc = static_cast<const int8_t*>(a.exp_avg);
  const uint8_t* vc = static_cast<const uint8_t*>(a.exp_avg_sq);
  // Locals: the intrinsic stores may alias the argument struct, so gcc would reload a.param, a.grad and
  // a.param_out from it for every vector.
  float* const params = a.param;
  const void* const grad = a.grad;
  void* const out = a.param_out;
  constexpr size_t gsize = G == DType::F32 ? 4 : 2;
  const size_t k = b / kQBlock;
  const __m512 ms = _mm512_set1_ps(a.exp_avg_scale[k]), vs = _mm512_set1_ps(a.exp_avg_sq_scale[k]);
  __m512 mmax = _mm512_setzero_ps(), vmax = _mm512_setzero_ps();
  auto update = [&](size_t i) {  // the param (returned, for param out), the moments and their maxima
    step_prefetch<W, gsize, 1>(params, grad, mc, vc, i);
    const __m512 g = _mm512_mul_ps(load_g<G>(grad, i), c.scale);
    __m512 m, v;
    const __m512 p = adam_vec<L2, true>(c, g, _mm512_loadu_ps(params + i), _mm512_mul_ps(dq_m_vec(mc + i), ms),
                                        _mm512_mul_ps(dq_v_vec(vc + i), vs), m, v);
    _mm512_storeu_ps(params + i, p);
    _mm512_store_ps(mb + (i - b), m);
    _mm512_store_ps(vb + (i - b), v);
    mmax = _mm512_max_ps(abs_ps(m), mmax);
    vmax = _mm512_max_ps(v, vmax);  // v >= 0 or NaN here: |v| is v (see q_v_vec)
    return p;
  };
  size_t i = b;
  if constexpr (Out == static_cast<int>(DType::BF16)) {  // a bf16 param out 64 bytes at a time (pick_nt)
    for (; i + 2 * W <= e; i += 2 * W) {
      const __m512 p0 = update(i), p1 = update(i + W);
      __m512i* dst = reinterpret_cast<__m512i*>(static_cast<uint16_t*>(out) + i);
      if constexpr (NT) _mm512_stream_si512(dst, to_bf16_x2(p0, p1));
      else _mm512_storeu_si512(dst, to_bf16_x2(p0, p1));
    }
  }
  for (; i + W <= e; i += W) store_o<Out, NT>(out, i, update(i));
  mx = hmax(mmax), vx = hmax(vmax);
  q_update_tail(a, b, i, e, mb, vb, mx, vx);
}

// Pass 2 over the block [b, e): mb/vb requantized with the block maxima mx/vx; codes and scales written.
inline void q8_encode(const AdamArgs& a, size_t b, size_t e, const float* mb, const float* vb, float mx, float vx) {
  int8_t* mc = static_cast<int8_t*>(a.exp_avg);
  uint8_t* vc = static_cast<uint8_t*>(a.exp_avg_sq);
  const __m512i seed = _mm512_set1_epi32(static_cast<int>(a.round_seed));
  const __m512i seed_m = _mm512_set1_epi32(static_cast<int>(q8_seed_m(a.round_seed)));
  const float minv = q_inverse(mx), vinv = q_inverse(vx);
  const __m512 mdv = _mm512_set1_ps(minv), vdv = _mm512_set1_ps(vinv);
  // the moments' random bits: lane l of the vector at j has index round_index + b + j + l
  __m512i weyl = weyl_of(a.round_index + b);
  size_t j = 0;
  for (; j + 4 * W <= e - b; j += 4 * W) {  // 64 codes per store
    q_m_x4(mb + j, mdv, weyl, seed_m, mc + b + j);  // exp_avg's bits at weyl's 64 indices,
    q_v_x4(vb + j, vdv, weyl, seed, vc + b + j);    // then exp_avg_sq's, which moves weyl on
  }
  for (; j + W <= e - b; j += W) {
    q_m_vec(_mm512_load_ps(mb + j), mdv, round_at(weyl, seed_m), mc + b + j);
    q_v_vec(_mm512_load_ps(vb + j), vdv, round_hi20(weyl, seed), vc + b + j);
  }
  q_block_tail(a, b, mb, vb, j, e - b, minv, vinv);
  a.exp_avg_scale[b / kQBlock] = mx;
  a.exp_avg_sq_scale[b / kQBlock] = vx;
}

// adam_q8_block_scalar, block by block, with block n's update run before block n-1's requantization:
// the latency of n-1's max reduction and reciprocal then hides behind independent work instead of
// stalling the encode (in cache 0.415 -> 0.404 ns/param). The blocks are disjoint, so the order changes
// no result. The param update (sqrt, division) stays in the update pass, unlike adam_avx2.cpp, which
// moved it into the encode pass. llvm-mca 14 (sapphirerapids and icelake-server models) put this order
// at 24.4 + 5.3 cycles per 16 params (bf16 grad and param out) and the AVX2 order at 11.3 + 23.7. Timed
// on a Zen 5 (session 12, 50M params, 2 threads, 41 alternated rounds, twice), the AVX2 order took
// 18.0 and 18.2 ms against 17.9 and 18.9: no difference, so the simpler single-pass update stays.
template <DType G, int Out, bool L2, bool NT>
void adam_q8_range(const AdamArgs& a, size_t begin, size_t end) {
  const Consts c(a, true);
  alignas(64) float mb[2][kQBlock], vb[2][kQBlock];
  float mx[2], vx[2];
  int cur = 0;
  for (size_t b = begin; b < end; b += kQBlock, cur ^= 1) {
    q8_update<G, Out, L2, NT>(a, c, b, std::min(end, b + kQBlock), mb[cur], vb[cur], mx[cur], vx[cur]);
    if (b != begin) q8_encode(a, b - kQBlock, b, mb[cur ^ 1], vb[cur ^ 1], mx[cur ^ 1], vx[cur ^ 1]);
  }
  if (begin < end) {
    const size_t last = begin + (end - begin - 1) / kQBlock * kQBlock;
    q8_encode(a, last, end, mb[cur ^ 1], vb[cur ^ 1], mx[cur ^ 1], vx[cur ^ 1]);
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
  // Every vector store lands on a multiple of its own width when the first one does. The int8 loop stores a bf16
  // param out two vectors at a time (64 bytes, from block starts: multiples of 512 bytes).
  const size_t elem = Out == static_cast<int>(DType::F32) ? 4 : 2;
  const size_t bytes = a.state == StateKind::Q8 && Out == static_cast<int>(DType::BF16) ? 64 : elem * W;
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

// Lane l of the 16 fp64 accumulators holds the elements i with i % 16 == l, each added with one
// fma in index order: the same sequence as norm_scalar_range.
template <DType G>
void norm_range(const void* g, size_t begin, size_t end, double lanes[16]) {
  size_t i = std::min(end, (begin + W - 1) / W * W);
  norm_scalar_range(g, G, begin, i, lanes);
  __m512d acc0 = _mm512_loadu_pd(lanes), acc1 = _mm512_loadu_pd(lanes + 8);
  for (; i + W <= end; i += W) {
    const __m512 x = load_g<G>(g, i);
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc0 = _mm512_fmadd_pd(lo, lo, acc0);
    acc1 = _mm512_fmadd_pd(hi, hi, acc1);
  }
  _mm512_storeu_pd(lanes, acc0);
  _mm512_storeu_pd(lanes + 8, acc1);
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
  const __m512 s = _mm512_set1_ps(scale);
  size_t i = begin;
  for (; i + W <= end; i += W) {
    const __m512 x = _mm512_mul_ps(load_g<G>(g, i), s);
    if constexpr (Overwrite) {
      _mm512_storeu_ps(acc + i, x);
    } else {
      _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), x));
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

#ifdef __AVX512BF16__
KernelTable avx512_bf16_kernels() { return {"avx512_bf16", adam_k, norm_k, acc_k}; }
#else
KernelTable avx512_kernels() { return {"avx512", adam_k, norm_k, acc_k}; }
#endif

}  // namespace hzo
