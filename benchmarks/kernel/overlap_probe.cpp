// Can this core overlap the int8 step's memory traffic with arithmetic? The int8 step's access pattern (two
// passes per 256-element block: bf16 grads and both code arrays read, then fp32 params read and written, a bf16
// param out streamed, the codes written; the step's software prefetch 2048 elements ahead), with R fused
// multiply-adds per 8 elements added, half in each pass, a sixth of them a chain on the loaded values (as the step's
// arithmetic depends on its loads), the rest independent. Each row also runs "in L1" (one block over and over) for
// the arithmetic alone. If "traffic + R" at 50M takes about max(traffic, arithmetic), the core overlaps the two.
// No Adam, no torch: a probe of the machine, not of the kernel (benchmarks/kernel/README.md, session 21).
//   g++ -O3 -mavx2 -mfma benchmarks/kernel/overlap_probe.cpp -o /tmp/overlap_probe -lpthread
//   /tmp/overlap_probe [threads=1] [rounds=9]
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

struct Arrays {
  float* p;
  const uint16_t* g;
  int8_t* m;
  uint8_t* v;
  uint16_t* out;
};

// R FMAs on the value d (a chain of R/6) and on eight independent accumulators (the rest, 8 at a time).
template <int R>
inline __m256 work(__m256 d, __m256* acc) {
  const __m256 k = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-3f);
#pragma GCC unroll 64
  for (int r = 0; r < R / 6; ++r) d = _mm256_fmadd_ps(d, k, c);
#pragma GCC unroll 64
  for (int r = 0; r < R - R / 6; r += 8)
    for (int a = 0; a < 8; ++a) acc[a] = _mm256_fmadd_ps(acc[a], k, c);
  return d;
}

template <int R, bool Mem>
void run(const Arrays& x, size_t b0, size_t e0, float* sink) {
  alignas(32) float buf[256];
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_set1_ps(1.0f);
  for (size_t b = b0; b < e0; b += 256) {
    const size_t bb = Mem ? b : b0;  // in L1: the same block again
    __m256 any = _mm256_setzero_ps();
    for (size_t j = 0; j < 256; j += 64) {  // pass 1: grads and codes in, the block's scratch out
      for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(x.p + bb + j + 2048) + 64 * l, _MM_HINT_T0);
      for (int l = 0; l < 2; ++l) _mm_prefetch(reinterpret_cast<const char*>(x.g + bb + j + 2048) + 64 * l, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(x.m + bb + j + 2048), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(x.v + bb + j + 2048), _MM_HINT_T0);
      for (size_t q = 0; q < 64; q += 8) {
        const size_t i = bb + j + q;
        const __m256 gv = _mm256_castsi256_ps(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x.g + i))));
        const __m256 mv = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x.m + i))));
        const __m256 vv = _mm256_castsi256_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x.v + i))));
        any = _mm256_or_ps(any, vv);
        _mm256_store_ps(buf + j + q, work<R / 2>(_mm256_or_ps(gv, mv), acc));
      }
    }
    for (size_t j = 0; j < 256; j += 32) {  // pass 2: params in and out, param out streamed, codes out
      for (size_t q = 0; q < 32; q += 16) {
        const size_t i = bb + j + q;
        const __m256 a = work<R / 2>(_mm256_add_ps(_mm256_loadu_ps(x.p + i), _mm256_load_ps(buf + j + q)), acc);
        const __m256 c = work<R / 2>(_mm256_add_ps(_mm256_loadu_ps(x.p + i + 8), any), acc);
        _mm256_storeu_ps(x.p + i, a);
        _mm256_storeu_ps(x.p + i + 8, c);
        _mm256_stream_si256(reinterpret_cast<__m256i*>(x.out + i), _mm256_castps_si256(a));
      }
      const __m256i k = _mm256_castps_si256(_mm256_load_ps(buf + j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x.m + bb + j), k);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x.v + bb + j), k);
    }
  }
  _mm_sfence();
  __m256 s = acc[0];
  for (int a = 1; a < 8; ++a) s = _mm256_add_ps(s, acc[a]);
  _mm256_storeu_ps(sink, s);
}

template <class T>
T* alloc(size_t n) {
  return static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 65536) / 64 * 64));
}

using Fn = void (*)(const Arrays&, size_t, size_t, float*);

}  // namespace

int main(int argc, char** argv) {
  const size_t n = 50000000;
  const int nth = argc > 1 ? std::atoi(argv[1]) : 1, rounds = argc > 2 ? std::atoi(argv[2]) : 9;
  Arrays x{alloc<float>(n), alloc<uint16_t>(n), alloc<int8_t>(n), alloc<uint8_t>(n), alloc<uint16_t>(n)};
  std::fill(x.p, x.p + n, 1.0f);
  std::fill(const_cast<uint16_t*>(x.g), const_cast<uint16_t*>(x.g) + n, 0);
  std::fill(x.m, x.m + n, 0);
  std::fill(x.v, x.v + n, 0);
  std::fill(x.out, x.out + n, 0);
  struct Row { const char* name; Fn f; };
  const std::vector<Row> rows = {{"traffic alone", run<0, true>},
                                 {"traffic + 32 FMA/8", run<32, true>}, {"32 FMA/8 in L1", run<32, false>},
                                 {"traffic + 48 FMA/8", run<48, true>}, {"48 FMA/8 in L1", run<48, false>}};
  std::vector<std::vector<double>> t(rows.size());
  std::vector<float> sink(8 * nth);
  for (int rd = 0; rd < rounds; ++rd) {
    for (size_t w = 0; w < rows.size(); ++w) {  // interleaved, so the machine's drift hits every row alike
      const size_t chunk = (n / nth + 255) / 256 * 256;
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<std::thread> th;
      for (int i = 0; i < nth; ++i) {
        const size_t b = i * chunk, e = std::min(n, b + chunk);
        th.emplace_back([&, b, e, i] { rows[w].f(x, b, e, sink.data() + 8 * i); });
      }
      for (auto& h : th) h.join();
      t[w].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  for (size_t w = 0; w < rows.size(); ++w) {
    std::sort(t[w].begin(), t[w].end());
    const double med = t[w][t[w].size() / 2];
    std::printf("%-20s %8.2f ms  %.3f ns/param per thread (median of %d, %d thread(s), 50M params)\n", rows[w].name,
                med * 1e3, med * 1e9 / n * nth, rounds, nth);
  }
}
