// Throughput of the divider's instructions on this core, the bound of the fp32 step in cache (a square root and two
// divisions per element, torch's rounding) and a part of the compact kinds' (one of each): 8 independent chains of
// vdivps / vsqrtps (ymm, and zmm where the CPU has AVX512F), the minimum of 20 repeats, in ns and in cycles of a
// clock read from four dependent imul (3 cycles each; dependent adds are not a clock on cores that fold them).
//   g++ -O2 -mavx2 -mfma benchmarks/kernel/divider_probe.cpp -o /tmp/divider_probe && /tmp/divider_probe
//   (add -mavx512f -DPROBE_AVX512 for the zmm rows)
#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

template <class F>
double ns_per_iter(F f, long iters) {
  double best = 1e30;
  for (int r = 0; r < 20; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f(iters);
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    best = ns < best ? ns : best;
  }
  return best / iters;
}

volatile float sink;

template <class V, V (*Op)(V, V), V (*Set)(float)>
void chains8(long n) {
  V a0 = Set(1.1f), a1 = Set(1.2f), a2 = Set(1.3f), a3 = Set(1.4f), a4 = Set(1.5f), a5 = Set(1.6f), a6 = Set(1.7f),
    a7 = Set(1.8f);
  const V d = Set(1.0000001f);
  for (long i = 0; i < n; ++i) {
    a0 = Op(a0, d); a1 = Op(a1, d); a2 = Op(a2, d); a3 = Op(a3, d);
    a4 = Op(a4, d); a5 = Op(a5, d); a6 = Op(a6, d); a7 = Op(a7, d);
  }
  alignas(64) float out[8][sizeof(V) / sizeof(float)];  // every chain reaches the sink: none is dead code
  const V all[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
  float sum = 0;
  for (int k = 0; k < 8; ++k) {
    reinterpret_cast<V*>(out[k])[0] = all[k];
    sum += out[k][0];
  }
  sink = sum;
}

__m256 div256(__m256 a, __m256 b) { return _mm256_div_ps(a, b); }
__m256 sqrt256(__m256 a, __m256) { return _mm256_sqrt_ps(a); }
#ifdef PROBE_AVX512
__m512 div512(__m512 a, __m512 b) { return _mm512_div_ps(a, b); }
__m512 sqrt512(__m512 a, __m512) { return _mm512_sqrt_ps(a); }
#endif

}  // namespace

int main() {
  const double clock_ns = ns_per_iter([](long n) {
    long x = 1;
    const long y = 3;
    for (long i = 0; i < n; ++i) {
      asm volatile("imul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0" : "+r"(x) : "r"(y));
    }
  }, 20000000) / 12;
  std::printf("clock: %.3f ns per cycle (%.2f GHz, four dependent imul)\n", clock_ns, 1 / clock_ns);
  const long n = 1 << 20;
  auto row = [&](const char* name, double ns, int lanes) {
    std::printf("%-12s %.3f ns = %5.2f cycles per instruction, %.3f ns per element\n", name, ns, ns / clock_ns,
                ns / lanes);
  };
  row("vdivps ymm", ns_per_iter(chains8<__m256, div256, _mm256_set1_ps>, n) / 8, 8);
  row("vsqrtps ymm", ns_per_iter(chains8<__m256, sqrt256, _mm256_set1_ps>, n) / 8, 8);
#ifdef PROBE_AVX512
  if (__builtin_cpu_supports("avx512f")) {
    row("vdivps zmm", ns_per_iter(chains8<__m512, div512, _mm512_set1_ps>, n) / 8, 16);
    row("vsqrtps zmm", ns_per_iter(chains8<__m512, sqrt512, _mm512_set1_ps>, n) / 8, 16);
  }
#endif
}
