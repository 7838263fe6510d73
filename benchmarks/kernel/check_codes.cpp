// Exhaustive check of the 8-bit moment codes of csrc/quant.h against their textbook form.
// q_mag (one float add does the rounding) is compared with integer round-to-nearest-even of the
// fp32 bits at bit 20 (normal codes) and a magic-number add (subnormal codes) for every one of the
// 2^32 inputs in its domain: n >= 0 (including +inf and NaNs) and the negative NaNs that
// |x| * (1/absmax) can produce (inf * 0). dq_mag (an fma and a min) is compared with the two-branch
// decode for every code. Scalar code; the vector kernels repeat q_mag's operations lane by lane.
//   g++ -O2 -std=c++17 -ffp-contract=off -fno-math-errno -Icsrc benchmarks/kernel/check_codes.cpp -o /tmp/check_codes
//   /tmp/check_codes      (~30 s on one core; prints "ok" or the first mismatches, exit status 1)
#include <cstdio>

#include "quant.h"

using namespace hzo;

template <int EB>
uint32_t q_mag_textbook(float n) {
  using F = QFormat<EB>;
  const uint32_t u = f32_bits(n);
  const uint32_t norm = ((u + 0x7ffffu + ((u >> 20) & 1u)) >> 20) - F::kNormBias;
  const uint32_t sub = f32_bits(n + bits_f32(F::kMagicBits)) - F::kMagicBits;
  const uint32_t mag = u < F::kMinNormalBits ? sub : norm;
  return mag < F::kMaxMag ? mag : F::kMaxMag;
}

template <int EB>
float dq_mag_textbook(uint32_t mag) {
  using F = QFormat<EB>;
  return mag >= 8 ? bits_f32((mag + F::kNormBias) << 20) : bits_f32(F::kMagicBits + mag) - bits_f32(F::kMagicBits);
}

template <int EB>
long check() {
  long bad = 0;
  for (uint64_t w = 0; w <= 0xffffffffull; ++w) {
    if (w >= 0x80000000ull && w <= 0xff800000ull) continue;  // negative numbers: outside the domain
    const float n = bits_f32(static_cast<uint32_t>(w));
    if (q_mag<EB>(n) != q_mag_textbook<EB>(n) && bad++ < 5)
      std::printf("EB=%d q_mag(%08x) = %u, textbook %u\n", EB, static_cast<unsigned>(w), q_mag<EB>(n),
                  q_mag_textbook<EB>(n));
  }
  for (uint32_t mag = 0; mag < 256; ++mag)
    if (f32_bits(dq_mag<EB>(mag)) != f32_bits(dq_mag_textbook<EB>(mag)) && bad++ < 5)
      std::printf("EB=%d dq_mag(%u) = %g, textbook %g\n", EB, mag, dq_mag<EB>(mag), dq_mag_textbook<EB>(mag));
  return bad;
}

int main() {
  const long bad = check<15>() + check<31>();
  std::printf(bad ? "%ld mismatches\n" : "ok\n", bad);
  return bad ? 1 : 0;
}
