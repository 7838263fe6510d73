// Run-time choice of the instruction set and the deterministic static split over threads.
#include "dispatch.h"

#include <pthread.h>
#if defined(HZO_X86)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
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
// Below this many elements per thread, waking another thread (~15 us) costs more than it saves
// (measured: 64K elements of mixed Adam take ~40 us on one thread, ~50 us on two).
constexpr size_t kMinPerThread = size_t(1) << 16;

// Persistent workers: the engine calls the kernels on tiles of a few M elements many times per
// step, and waking a parked thread costs less than creating one. Worker w runs part w (the caller
// runs part 0), so the split, and with it every result, does not depend on which thread is free.
// One job at a time: a call that finds the pool busy (another Python thread with the GIL released)
// falls back to short-lived threads rather than waiting.
class Pool {
 public:
  using Fn = void (*)(void*, int);

  bool try_run(int nthreads, Fn fn, void* ctx) {
    std::unique_lock<std::mutex> call(call_mu_, std::try_to_lock);
    if (!call.owns_lock()) return false;
    try {
      while (static_cast<int>(workers_.size()) < nthreads - 1) {
        int idx = static_cast<int>(workers_.size()) + 1;
        workers_.emplace_back([this, idx] { loop(idx); });
        workers_.back().detach();  // parked forever; never joined (exit and fork must not wait on them)
      }
    } catch (const std::system_error&) {
      return false;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = fn;
      ctx_ = ctx;
      nthreads_ = nthreads;
      remaining_ = nthreads - 1;
      ++generation_;
    }
    wake_.notify_all();
    fn(ctx, 0);
    std::unique_lock<std::mutex> lk(mu_);
    done_.wait(lk, [this] { return remaining_ == 0; });
    return true;
  }

 private:
  void loop(int idx) {
    unsigned long long seen = 0;
    for (;;) {
      Fn fn;
      void* ctx;
      {
        std::unique_lock<std::mutex> lk(mu_);
        wake_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        if (idx >= nthreads_) continue;
        fn = fn_;
        ctx = ctx_;
      }
      fn(ctx, idx);
      std::lock_guard<std::mutex> lk(mu_);
      if (--remaining_ == 0) done_.notify_one();
    }
  }

  std::mutex call_mu_;  // held for a whole job
  std::mutex mu_;       // guards the fields below
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  int nthreads_ = 0;
  int remaining_ = 0;
  unsigned long long generation_ = 0;
};

// Leaked on purpose (threads are detached and parked). After fork() the child has no workers:
// it starts a fresh pool and abandons the parent's (whose mutexes may be held).
Pool* g_pool = nullptr;
std::once_flag g_pool_once;

Pool& pool() {
  std::call_once(g_pool_once, [] {
    g_pool = new Pool();
    pthread_atfork(nullptr, nullptr, [] { g_pool = new Pool(); });
  });
  return *g_pool;
}

std::atomic<bool> g_use_pool{true};

template <typename F>
void run_threads(int nthreads, F&& inner) {
  if (nthreads <= 1) {
    inner(0);
    return;
  }
#if defined(HZO_X86)
  // Helpers run with the caller's floating-point control word (flush-to-zero, denormals-are-zero,
  // rounding), so torch.set_flush_denormal or a changed rounding mode cannot make the result
  // depend on the thread count.
  const unsigned csr = _mm_getcsr();
  auto body = [&inner, csr](int tid) {
    if (tid != 0 && _mm_getcsr() != csr) _mm_setcsr(csr);
    inner(tid);
  };
#else
  auto& body = inner;
#endif
  using B = std::remove_reference_t<decltype(body)>;
  if (g_use_pool &&
      pool().try_run(nthreads, [](void* ctx, int tid) { (*static_cast<B*>(ctx))(tid); }, static_cast<void*>(&body)))
    return;
  std::vector<std::thread> spawned;
  spawned.reserve(nthreads - 1);
  for (int t = 1; t < nthreads; ++t) spawned.emplace_back(body, t);
  body(0);
  for (auto& th : spawned) th.join();
}

// Threads for an element-wise pass over n elements: at most one per kMinPerThread elements.
int elementwise_threads(int nthreads, size_t n) {
  size_t cap = std::max<size_t>(1, n / kMinPerThread);
  return static_cast<int>(std::min<size_t>(static_cast<size_t>(std::max(nthreads, 1)), cap));
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
  int t = clamp_threads(elementwise_threads(nthreads, n), units);
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

void set_thread_pool(bool on) { g_use_pool = on; }

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
  size_t units = (n + kAlign - 1) / kAlign;
  int t = clamp_threads(elementwise_threads(nthreads, n), units);
  size_t per = ((units + t - 1) / t) * kAlign;
  run_threads(t, [&](int tid) {
    size_t b = std::min(n, per * tid), e = std::min(n, per * (tid + 1));
    if (b < e) stream_range(p, g, m, v, b, e);
  });
}

void accumulate(float* acc, const void* grad, DType dt, float scale, bool overwrite, size_t n, int nthreads) {
  const KernelTable table = g_table;
  size_t units = (n + kAlign - 1) / kAlign;
  int t = clamp_threads(elementwise_threads(nthreads, n), units);
  size_t per = ((units + t - 1) / t) * kAlign;
  run_threads(t, [&](int tid) {
    size_t b = std::min(n, per * tid), e = std::min(n, per * (tid + 1));
    if (b < e) table.accumulate(acc, grad, dt, scale, overwrite, b, e);
  });
}

}  // namespace hzo
