// Persistent worker pool behind run_threads.
#include "thread_pool.h"

#include <pthread.h>
#if defined(HZO_X86)
#include <xmmintrin.h>
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace hzo {
namespace {

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
    spin_while([this] { return remaining_.load(std::memory_order_acquire) != 0; });
    std::unique_lock<std::mutex> lk(mu_);
    done_.wait(lk, [this] { return remaining_.load(std::memory_order_relaxed) == 0; });
    return true;
  }

 private:
  // Spin up to kSpin before parking on a condition variable: the engine calls the kernels tile after
  // tile, and waking a parked thread (a futex, and on a VM an inter-processor interrupt through the
  // hypervisor) can take longer than a tile's share of the work. Only a wait that outlasts the spin
  // parks; the flags are read without the mutex here and re-checked under it before parking.
  template <typename Busy>
  static void spin_while(Busy busy) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while (busy()) {
      for (int i = 0; i < 64 && busy(); ++i) {
#if defined(HZO_X86)
        _mm_pause();
#endif
      }
      if (std::chrono::steady_clock::now() > until) return;
    }
  }

  void loop(int idx) {
    unsigned long long seen = 0;
    for (;;) {
      Fn fn;
      void* ctx;
      spin_while([&] { return generation_.load(std::memory_order_acquire) == seen; });
      {
        std::unique_lock<std::mutex> lk(mu_);
        wake_.wait(lk, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
        seen = generation_.load(std::memory_order_relaxed);
        if (idx >= nthreads_) continue;
        fn = fn_;
        ctx = ctx_;
      }
      fn(ctx, idx);
      std::lock_guard<std::mutex> lk(mu_);
      if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) done_.notify_one();
    }
  }

  std::mutex call_mu_;  // held for a whole job
  std::mutex mu_;       // guards the fields below
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  int nthreads_ = 0;
  // atomics so that spin_while may read them without the mutex; written under it
  std::atomic<int> remaining_{0};
  std::atomic<unsigned long long> generation_{0};
  static constexpr std::chrono::microseconds kSpin{50};
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

struct WithCsr {
  void (*fn)(void*, int);
  void* ctx;
  unsigned csr;
};

void with_csr(void* p, int tid) {
  auto* w = static_cast<WithCsr*>(p);
#if defined(HZO_X86)
  if (tid != 0 && _mm_getcsr() != w->csr) _mm_setcsr(w->csr);
#endif
  w->fn(w->ctx, tid);
}

}  // namespace

void run_threads(int nthreads, void (*fn)(void*, int), void* ctx) {
  if (nthreads <= 1) {
    fn(ctx, 0);
    return;
  }
  // Helpers run with the caller's floating-point control word (flush-to-zero, denormals-are-zero,
  // rounding), so torch.set_flush_denormal or a changed rounding mode cannot make the result
  // depend on the thread count.
  WithCsr w{fn, ctx, 0};
#if defined(HZO_X86)
  w.csr = _mm_getcsr();
#endif
  if (g_use_pool && pool().try_run(nthreads, with_csr, &w)) return;
  std::vector<std::thread> spawned;
  spawned.reserve(nthreads - 1);
  int t = 1;
  try {
    for (; t < nthreads; ++t) spawned.emplace_back(with_csr, &w, t);
  } catch (const std::system_error&) {
    // No more threads to be had (a process thread limit, address space): the parts left run here, in order.
    // A part's result does not depend on the thread that runs it, and the threads made must be joined (a
    // joinable std::thread destroyed by the unwinding called std::terminate).
  }
  with_csr(&w, 0);
  for (int u = t; u < nthreads; ++u) with_csr(&w, u);
  for (auto& th : spawned) th.join();
}

void set_thread_pool(bool on) { g_use_pool = on; }

}  // namespace hzo
