// Exhaustive check of the 8-bit moment codes of csrc/quant.h against their textbook form.
// q_mag_r (the integer form on the bits of fp32(n + c)) is compared with a search of the code
// table in fp64 for every one of the 2^32 inputs in its domain: n >= 0 (including +inf and NaNs)
// and the negative NaNs that |x| * (1/absmax) can produce (inf * 0). Three roundings: r = 2^19
// must give the code nearest to s = fp32(n + c) (ties up), r = 0 the largest code <= s, r = 2^20 - 1
// the smallest code >= s (all clamped to 1.0's code; NaN -> 1.0's code). dq_mag is compared with
// fp32(code float - c) for every code. Scalar code; the vector kernels repeat its operations lane
// by lane.
//   g++ -O2 -std=c++17 -ffp-contract=off -fno-math-errno -Icsrc benchmarks/kernel/check_codes.cpp -o /tmp/check_codes
//   /tmp/check_codes      (~1 min on one core; prints "ok" or the first mismatches, exit status 1)
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "quant.h"

using namespace hzo;

template <int EB>
struct Textbook {
  double code[256];  // the codes' floats, c * 2^(mag >> 3) * (1 + (mag & 7) / 8), exact in fp64
  uint32_t top = QFormat<EB>::kMaxMag;
  Textbook() {
    for (uint32_t mag = 0; mag <= top; ++mag) code[mag] = std::ldexp(1.0 + (mag & 7) / 8.0, static_cast<int>(mag >> 3) + 1 - EB);
  }
  float c() const { return static_cast<float>(code[0]); }
  // r: 0 floor, 1 nearest (ties up), 2 ceiling
  uint32_t mag(float n, int r) const {
    const double s = static_cast<double>(n + c());
    if (!(s < code[top])) return top;  // 1.0 and above, NaN
    const uint32_t lo = static_cast<uint32_t>(std::upper_bound(code, code + top + 1, s) - code) - 1;
    if (s == code[lo] || r == 0) return lo;
    if (r == 2) return lo + 1;
    return s - code[lo] >= code[lo + 1] - s ? lo + 1 : lo;
  }
};

template <int EB>
long check() {
  const Textbook<EB> t;
  long bad = 0;
  const uint32_t rs[3] = {0, 1u << 19, (1u << 20) - 1};
  for (uint64_t w = 0; w <= 0xffffffffull; ++w) {
    if (w >= 0x80000000ull && w <= 0xff800000ull) continue;  // negative numbers: outside the domain
    const float n = bits_f32(static_cast<uint32_t>(w));
    for (int r = 0; r < 3; ++r) {
      const uint32_t got = q_mag_r<EB>(n, rs[r]), want = t.mag(n, r);
      if (got != want && bad++ < 5)
        std::printf("EB=%d q_mag_r(%08x, %u) = %u, textbook %u\n", EB, static_cast<unsigned>(w), rs[r], got, want);
    }
  }
  for (uint32_t mag = 0; mag <= t.top; ++mag) {
    const float want = static_cast<float>(t.code[mag]) - t.c();
    if (f32_bits(dq_mag<EB>(mag)) != f32_bits(want) && bad++ < 5)
      std::printf("EB=%d dq_mag(%u) = %g, textbook %g\n", EB, mag, dq_mag<EB>(mag), want);
  }
  return bad;
}

int main() {
  const long bad = check<16>() + check<32>();
  std::printf(bad ? "%ld mismatches\n" : "ok\n", bad);
  return bad ? 1 : 0;
}
