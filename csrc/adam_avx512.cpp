// AVX512 (F/BW/VL/DQ) kernels: 16 fp32 lanes per vector.
//
// Every vector operation below is the lane-wise image of one operation of adam_scalar_elem /
// norm_scalar_range / accumulate_scalar_elem in adam.h (same fused multiply-adds, true division,
// true square root), so results are bit-identical to the scalar path; tails use the scalar helpers.
// The grad dtype, the param_out dtype and the L2 switch are template parameters: the inner loop
// has no per-element switch.
#include <immintrin.h>

#include <algorithm>

#include "adam.h"

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
// Not vcvtneps2bf16: it flushes denormal inputs to zero, which torch's conversion does not.
inline __m256i to_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);  // values are <= 0xffff: truncation is exact
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

template <DType G, int Out, bool L2, bool NT>
void adam_range(const AdamArgs& a, size_t begin, size_t end) {
  const __m512 scale = _mm512_set1_ps(a.grad_scale);
  const __m512 l2 = _mm512_set1_ps(a.l2);
  const __m512 decay = _mm512_set1_ps(a.decay);
  const __m512 b2 = _mm512_set1_ps(a.beta2);
  const __m512 omb1 = _mm512_set1_ps(a.one_minus_beta1);
  const __m512 omb2 = _mm512_set1_ps(a.one_minus_beta2);
  const __m512 bc2 = _mm512_set1_ps(a.bias_correction2_sqrt);
  const __m512 eps = _mm512_set1_ps(a.eps);
  const __m512 neg_step = _mm512_set1_ps(-a.step_size);
  float* __restrict param = a.param;
  float* __restrict m_ptr = a.exp_avg;
  float* __restrict v_ptr = a.exp_avg_sq;
  size_t i = begin;
  for (; i + W <= end; i += W) {
    __m512 g = _mm512_mul_ps(load_g<G>(a.grad, i), scale);
    __m512 p = _mm512_loadu_ps(param + i);
    if constexpr (L2) g = _mm512_fmadd_ps(l2, p, g);
    p = _mm512_mul_ps(p, decay);
    const __m512 m0 = _mm512_loadu_ps(m_ptr + i);
    const __m512 m = _mm512_fmadd_ps(omb1, _mm512_sub_ps(g, m0), m0);
    const __m512 v = _mm512_fmadd_ps(omb2, _mm512_mul_ps(g, g), _mm512_mul_ps(_mm512_loadu_ps(v_ptr + i), b2));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
    p = _mm512_fmadd_ps(neg_step, _mm512_div_ps(m, denom), p);
    _mm512_storeu_ps(m_ptr + i, m);
    _mm512_storeu_ps(v_ptr + i, v);
    _mm512_storeu_ps(param + i, p);
    store_o<Out, NT>(a.param_out, i, p);
  }
  if constexpr (NT) _mm_sfence();  // order the streamed stores before the join
  for (; i < end; ++i) adam_scalar_elem(a, i);
}

template <DType G, int Out, bool NT>
AdamFn pick_l2(bool l2) {
  return l2 ? &adam_range<G, Out, true, NT> : &adam_range<G, Out, false, NT>;
}

template <DType G, int Out>
AdamFn pick_nt(const AdamArgs& a, size_t begin, bool l2) {
  // Every vector store lands on a multiple of its own width when the first one does.
  const size_t bytes = (Out == static_cast<int>(DType::F32) ? 4 : 2) * W;
  const bool aligned = (reinterpret_cast<uintptr_t>(a.param_out) + begin * (bytes / W)) % bytes == 0;
  return aligned ? pick_l2<G, Out, true>(l2) : pick_l2<G, Out, false>(l2);
}

template <DType G>
AdamFn pick_out(const AdamArgs& a, size_t begin) {
  const bool l2 = a.l2 != 0.0f;  // the same test as adam_scalar_elem
  if (!a.param_out) return pick_l2<G, -1, false>(l2);
  switch (a.out_dtype) {
    case DType::F32: return pick_nt<G, 0>(a, begin, l2);
    case DType::BF16: return pick_nt<G, 1>(a, begin, l2);
    default: return pick_nt<G, 2>(a, begin, l2);
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

KernelTable avx512_kernels() { return {"avx512", adam_k, norm_k, acc_k}; }

}  // namespace hzo
