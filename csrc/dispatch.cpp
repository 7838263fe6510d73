// Run-time choice of the instruction set, and the drivers that split each call over threads.
#include "dispatch.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "quant.h"
#include "thread_pool.h"

namespace hzo {
namespace {

KernelTable table_for(const std::string& level) {
#if defined(HZO_AVX512_BF16)
  if (level == "avx512_bf16") return avx512_bf16_kernels();
#endif
#if defined(HZO_X86)
  if (level == "avx512") return avx512_kernels();
  if (level == "avx2") return avx2_kernels();
#endif
  return scalar_kernels();
}

KernelTable g_table = table_for(best_level());

// Elements per norm block. The block partition (not the thread partition) fixes the summation
// order, so the result is the same for any thread count.
constexpr size_t kNormBlock = size_t(1) << 16;
// Element-wise splits start on multiples of this: 64-byte boundaries for fp32 arrays.
constexpr size_t kAlign = 64;

}  // namespace

std::string best_level() {
  if (cpu_can_run_avx512_bf16()) return "avx512_bf16";
  if (cpu_can_run_avx512()) return "avx512";
  if (cpu_can_run_avx2()) return "avx2";
  return "scalar";
}

std::vector<std::string> available_levels() {
  std::vector<std::string> out{"scalar"};
  if (cpu_can_run_avx2()) out.push_back("avx2");
  if (cpu_can_run_avx512()) out.push_back("avx512");
  if (cpu_can_run_avx512_bf16()) out.push_back("avx512_bf16");
  return out;
}

void set_level(const std::string& level) {
  if (level != "scalar" && level != "avx2" && level != "avx512" && level != "avx512_bf16")
    throw std::invalid_argument("unknown SIMD level '" + level + "' (expected scalar, avx2, avx512 or avx512_bf16)");
  if (level == "avx512_bf16" && !cpu_can_run_avx512_bf16())
    throw std::invalid_argument(cpu_can_run_avx512()
        ? "SIMD level 'avx512_bf16' requested but this CPU (or this build) lacks AVX512_BF16; 'avx512' runs here"
        : "SIMD level 'avx512_bf16' requested but this CPU (or OS) lacks AVX512F/BW/VL/DQ");
  if (level == "avx512" && !cpu_can_run_avx512())
    throw std::invalid_argument("SIMD level 'avx512' requested but this CPU (or OS) lacks AVX512F/BW/VL/DQ");
  if (level == "avx2" && !cpu_can_run_avx2())
    throw std::invalid_argument("SIMD level 'avx2' requested but this CPU (or OS) lacks AVX2/FMA/F16C");
  g_table = table_for(level);
}

std::string current_level() { return g_table.name; }

// An int8 scale is its block's absmax: >= 0, or inf after a non-finite step, never NaN (the block max skips a
// NaN). A negative or NaN one was not written by this kernel (a NaN spread to its whole block at the next
// step), and the vector kernels rely on it (they skip |v| for exp_avg_sq), so it is refused before anything
// is written. Here rather than in Python: a torch reduction over the scales
// (parallel from 32K of them) would leave torch's OpenMP workers spinning on the cores this step's
// threads then need (a 50M-param step measured 28.8 ms with that check before it, 20.5 ms without).
static void check_q8_scales(const AdamArgs& a, size_t n) {
  const size_t nb = (n + kQBlock - 1) / kQBlock;
  for (const auto& [name, s] : {std::pair<const char*, const float*>{"exp_avg_scale", a.exp_avg_scale},
                                {"exp_avg_sq_scale", a.exp_avg_sq_scale}}) {
    bool bad = false;
    for (size_t k = 0; k < nb; ++k) bad |= !(s[k] >= 0.0f);  // negative or NaN
    if (bad)
      throw std::invalid_argument(std::string(name) + " has negative or NaN entries: a scale is its block's absmax "
                                  "(>= 0, never NaN), so this int8 state was not written by hf_zero_offload (or is "
                                  "damaged)");
  }
}

void adam(const AdamArgs& a, size_t n, int nthreads) {
  if (a.state == StateKind::Q8) check_q8_scales(a, n);
  // compact_math only comes with a block or two (shared int8 blocks): the scalar kernel, which every
  // instruction set equals bit for bit, on the calling thread
  const KernelTable table = a.compact_math ? scalar_kernels() : g_table;
  if (a.compact_math) nthreads = 1;
  // Q8 parts must hold whole blocks (one scale each); kQBlock is itself a multiple of kAlign.
  const size_t align = a.state == StateKind::Q8 ? kQBlock : kAlign;
  parallel_ranges(n, align, nthreads, [&](size_t b, size_t e) { table.adam(a, b, e); });
}

double norm_sq(const void* grad, DType dt, size_t n, int nthreads) {
  const KernelTable table = g_table;
  const size_t nblocks = (n + kNormBlock - 1) / kNormBlock;
  std::vector<double> partial(nblocks, 0.0);
  // A "range" here is a range of blocks; each block's sum is fixed by the lanes, not by the split.
  const int t = static_cast<int>(std::min<size_t>(std::max(nthreads, 1), std::max<size_t>(nblocks, 1)));
  const size_t per = (nblocks + t - 1) / t;
  run_threads(t, [&](int tid) {
    for (size_t blk = per * tid; blk < std::min(nblocks, per * (tid + 1)); ++blk) {
      double lanes[16] = {0};
      const size_t b = blk * kNormBlock, e = std::min(n, b + kNormBlock);
      table.norm(grad, dt, b, e, lanes);
      // Fixed pairwise tree over the lanes, the same for every instruction set.
      for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
      partial[blk] = lanes[0];
    }
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

void accumulate(float* acc, const void* grad, DType dt, float scale, bool overwrite, size_t n, int nthreads) {
  const KernelTable table = g_table;
  parallel_ranges(n, kAlign, nthreads,
                  [&](size_t b, size_t e) { table.accumulate(acc, grad, dt, scale, overwrite, b, e); });
}

// Conversions run the scalar helpers of quant.h: the same functions the kernels' results are
// defined by, so a checkpoint converted here equals what a step would have stored.
void quantize(const float* x, void* codes, float* scales, bool is_sq, size_t n, int nthreads, long sr_step,
              uint64_t round_index, bool given_scales) {
  const uint32_t seed = round_seed_of(sr_step);
  parallel_ranges(n, kQBlock, nthreads, [&](size_t b, size_t e) {
    for (size_t s = b; s < e; s += kQBlock) {
      const size_t len = std::min(e, s + kQBlock) - s;
      if (is_sq) q_block_v(x + s, len, static_cast<uint8_t*>(codes) + s, scales + s / kQBlock,
                           sr_step > 0 ? &seed : nullptr, round_index + s, given_scales);
      else q_block_m(x + s, len, static_cast<int8_t*>(codes) + s, scales + s / kQBlock, sr_step > 0 ? &seed : nullptr,
                     round_index + s, given_scales);
    }
  });
}

void dequantize(const void* codes, const float* scales, float* out, bool is_sq, size_t n, int nthreads) {
  parallel_ranges(n, kQBlock, nthreads, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      const float c = is_sq ? dq_v(static_cast<const uint8_t*>(codes)[i]) : dq_m(static_cast<const int8_t*>(codes)[i]);
      out[i] = c * scales[i / kQBlock];
    }
  });
}

size_t quant_block() { return kQBlock; }

unsigned quant_max_code(bool is_sq) { return is_sq ? QV::kMaxMag : QM::kMaxMag; }

// The streaming bound: Adam's memory traffic (read param, grad, m, v; write param, m, v; fp32) with
// a trivial computation and the same split, compiled for the best vector width this CPU has.
#if defined(HZO_X86)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void stream_range(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                  size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const float x = g[i];
    p[i] = p[i] - x;
    m[i] = m[i] * 0.5f + x;
    v[i] = v[i] * 0.25f + x;
  }
}

void stream_ref(float* p, const float* g, float* m, float* v, size_t n, int nthreads) {
  parallel_ranges(n, kAlign, nthreads, [&](size_t b, size_t e) { stream_range(p, g, m, v, b, e); });
}

}  // namespace hzo
