// Single-thread cost of the Adam kernels per parameter, torch-free: the "mixed" pipeline (bf16
// grad, bf16 param out) with fp32, bf16 and 8-bit moments, the best instruction set this CPU runs
// among scalar/AVX2 (AVX512 when built with HZO_MICRO_AVX512 and run on such a CPU). The minimum over
// many repeats, so neighbours on a shared machine only lengthen the run, not the figure. The state
// is restored before every repeat (outside the timed call). Also checks, before timing, that the
// vector kernel equals the scalar reference bit for bit (params, codes, scales, param out) over
// six steps with odd sizes and a split range (the last step after a few inf and NaN grads).
//   F="-O3 -std=c++17 -fno-math-errno -ffp-contract=off -Icsrc"
//   g++ $F -c csrc/adam_scalar.cpp -o /tmp/s.o && g++ $F -mavx2 -mfma -mf16c -c csrc/adam_avx2.cpp -o /tmp/a2.o
//   g++ $F -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -c csrc/adam_avx512.cpp -o /tmp/a5.o
//   g++ $F benchmarks/kernel/adam_micro.cpp /tmp/s.o /tmp/a2.o /tmp/a5.o -o /tmp/adam_micro
//   /tmp/adam_micro [N=200000] [repeats=2000]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "adam.h"

using namespace hzo;

namespace {

// 64-byte aligned arrays, as the engine's (torch's CPU allocator, pinned buffers): the kernels stream
// param_out with non-temporal stores only where it is aligned, so malloc's alignment (16 bytes, or 16
// past a page for large arrays) timed another store path than the engine takes.
template <class T>
struct Aligned {
  using value_type = T;
  Aligned() = default;
  template <class U>
  Aligned(const Aligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64)); }
  void deallocate(T* p, size_t) { std::free(p); }
  template <class U>
  bool operator==(const Aligned<U>&) const { return true; }
  template <class U>
  bool operator!=(const Aligned<U>&) const { return false; }
};
template <class T>
using Vec = std::vector<T, Aligned<T>>;

struct State {
  Vec<float> p, ms, vs;
  Vec<uint16_t> g, out;
  Vec<uint8_t> m, v;
};

uint16_t bf16_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

// Gradients over 12 orders of magnitude, 2% exact zeros, both signs; with nonfinite, one in 2000
// is inf or NaN (for the bit-for-bit check of the NaN paths).
void fill_grad(State& t, unsigned seed, bool nonfinite = false) {
  std::mt19937 r(seed);
  std::normal_distribution<float> d(0, 1);
  for (auto& x : t.g) {
    x = r() % 50 == 0 ? 0 : bf16_of(d(r) * std::pow(10.f, static_cast<float>(r() % 12) - 8.f));
    if (nonfinite && r() % 2000 == 0) x = r() % 2 ? 0x7f80 : 0xffc1;
  }
}

State make_state(size_t n, StateKind s, unsigned seed) {
  State t;
  const size_t bytes = s == StateKind::F32 ? 4 : s == StateKind::BF16 ? 2 : 1;
  t.p.resize(n);
  t.g.resize(n);
  t.out.resize(n);
  t.m.assign(n * bytes, 0);
  t.v.assign(n * bytes, 0);
  t.ms.assign((n + 255) / 256, 0.f);
  t.vs.assign((n + 255) / 256, 0.f);
  std::mt19937 r(seed);
  std::normal_distribution<float> d(0, 1);
  for (auto& x : t.p) x = d(r);
  fill_grad(t, seed + 1);
  return t;
}

AdamArgs args_for(State& t, StateKind s, long step) {
  AdamArgs a = make_adam_args(step, 1e-3, 0.9, 0.999, 1e-8, 0.01, true, 0.5);
  a.param = t.p.data();
  a.grad = t.g.data();
  a.exp_avg = t.m.data();
  a.exp_avg_sq = t.v.data();
  a.exp_avg_scale = s == StateKind::Q8 ? t.ms.data() : nullptr;
  a.exp_avg_sq_scale = s == StateKind::Q8 ? t.vs.data() : nullptr;
  a.param_out = t.out.data();
  a.grad_dtype = DType::BF16;
  a.out_dtype = DType::BF16;
  a.state = s;
  return a;
}

// Bit patterns, not values (NaN != NaN).
template <class T>
bool same_bits(const Vec<T>& x, const Vec<T>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0;
}
bool same(const State& x, const State& y) {
  return same_bits(x.p, y.p) && same_bits(x.m, y.m) && same_bits(x.v, y.v) && same_bits(x.ms, y.ms) &&
         same_bits(x.vs, y.vs) && same_bits(x.out, y.out);
}

}  // namespace

int main(int argc, char** argv) {
  const size_t n = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 200000;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 2000;
#ifdef HZO_MICRO_AVX512
  const KernelTable vec = avx512_kernels();
#else
  const KernelTable vec = avx2_kernels();
#endif
  const KernelTable ref = scalar_kernels();
  const StateKind kinds[3] = {StateKind::F32, StateKind::BF16, StateKind::Q8};
  const char* names[3] = {"fp32", "bf16", "int8"};
  int bad = 0;
  for (int k = 0; k < 3; ++k) {
    for (size_t nn : {size_t(513), size_t(1000), size_t(4096 + 77)}) {
      State x = make_state(nn, kinds[k], static_cast<unsigned>(nn)), y = x;
      const size_t mid = std::min(nn, size_t(512));  // a split at a block boundary, like the thread split
      for (long step = 1; step <= 6; ++step) {
        ref.adam(args_for(x, kinds[k], step), 0, nn);
        vec.adam(args_for(y, kinds[k], step), 0, mid);
        vec.adam(args_for(y, kinds[k], step), mid, nn);
        fill_grad(x, static_cast<unsigned>(step * 7 + nn), step == 5);
        fill_grad(y, static_cast<unsigned>(step * 7 + nn), step == 5);
      }
      if (!same(x, y)) {
        std::printf("MISMATCH %s: %s vs scalar, n=%zu\n", names[k], vec.name, nn);
        ++bad;
      }
    }
  }
  std::printf("%s == scalar bit for bit: %s\n", vec.name, bad ? "NO" : "yes");
  for (int k = 0; k < 3; ++k) {
    State t = make_state(n, kinds[k], 1);
    ref.adam(args_for(t, kinds[k], 1), 0, n);  // a nonzero state to start from
    const State start = t;
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      t.p = start.p, t.m = start.m, t.v = start.v, t.ms = start.ms, t.vs = start.vs;
      const AdamArgs a = args_for(t, kinds[k], 2);
      const auto t0 = std::chrono::steady_clock::now();
      vec.adam(a, 0, n);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::printf("%-5s moments, %s, 1 thread: %.3f ns/param (min of %d, n=%zu)\n", names[k], vec.name,
                best * 1e9 / n, reps, n);
  }
  return bad ? 1 : 0;
}
