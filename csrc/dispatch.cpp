// Run-time choice of the instruction set and the deterministic static split over threads.
#include "dispatch.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace hzo {
namespace {

bool cpu_has_avx2() {
#if defined(HZO_X86)
  __builtin_cpu_init();
  // libgcc's checks include the OS's XSAVE support for the YMM/ZMM state, not only the CPUID bits.
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(HZO_X86)
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

KernelTable table_for(const std::string& level) {
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
// Adam splits are multiples of this, so every thread starts on a 64-byte boundary for fp32 arrays
// (threads never share a cache line of the outputs).
constexpr size_t kAlign = 64;

template <typename F>
void run_threads(int nthreads, F&& body) {
  if (nthreads <= 1) {
    body(0);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(nthreads - 1);
  for (int t = 1; t < nthreads; ++t) pool.emplace_back(body, t);
  body(0);
  for (auto& th : pool) th.join();
}

int clamp_threads(int nthreads, size_t work_units) {
  if (nthreads < 1) nthreads = 1;
  if (static_cast<size_t>(nthreads) > work_units) nthreads = static_cast<int>(std::max<size_t>(work_units, 1));
  return nthreads;
}

}  // namespace

std::string best_level() {
  if (cpu_has_avx512()) return "avx512";
  if (cpu_has_avx2()) return "avx2";
  return "scalar";
}

std::vector<std::string> available_levels() {
  std::vector<std::string> out{"scalar"};
  if (cpu_has_avx2()) out.push_back("avx2");
  if (cpu_has_avx512()) out.push_back("avx512");
  return out;
}

void set_level(const std::string& level) {
  if (level != "scalar" && level != "avx2" && level != "avx512")
    throw std::invalid_argument("unknown SIMD level '" + level + "' (expected scalar, avx2 or avx512)");
  if (level == "avx512" && !cpu_has_avx512())
    throw std::invalid_argument("SIMD level 'avx512' requested but this CPU (or OS) lacks AVX512F/BW/VL/DQ");
  if (level == "avx2" && !cpu_has_avx2())
    throw std::invalid_argument("SIMD level 'avx2' requested but this CPU (or OS) lacks AVX2/FMA/F16C");
  g_table = table_for(level);
}

std::string current_level() { return g_table.name; }

void adam(const AdamArgs& a, size_t n, int nthreads) {
  const KernelTable table = g_table;
  size_t units = (n + kAlign - 1) / kAlign;
  int t = clamp_threads(nthreads, units);
  size_t per = ((units + t - 1) / t) * kAlign;
  run_threads(t, [&](int tid) {
    size_t b = std::min(n, per * tid), e = std::min(n, per * (tid + 1));
    if (b < e) table.adam(a, b, e);
  });
}

double norm_sq(const void* grad, DType dt, size_t n, int nthreads) {
  const KernelTable table = g_table;
  size_t nblocks = (n + kNormBlock - 1) / kNormBlock;
  std::vector<double> partial(nblocks, 0.0);
  int t = clamp_threads(nthreads, nblocks);
  size_t per = (nblocks + t - 1) / t;
  run_threads(t, [&](int tid) {
    for (size_t blk = per * tid; blk < std::min(nblocks, per * (tid + 1)); ++blk) {
      double lanes[16] = {0};
      size_t b = blk * kNormBlock, e = std::min(n, b + kNormBlock);
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
  size_t units = (n + kAlign - 1) / kAlign;
  int t = clamp_threads(nthreads, units);
  size_t per = ((units + t - 1) / t) * kAlign;
  run_threads(t, [&](int tid) {
    size_t b = std::min(n, per * tid), e = std::min(n, per * (tid + 1));
    if (b < e) table.accumulate(acc, grad, dt, scale, overwrite, b, e);
  });
}

}  // namespace hzo
