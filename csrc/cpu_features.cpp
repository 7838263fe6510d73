// CPUID/XGETBV checks. Each list below is exactly the -m flags that CMakeLists.txt gives the
// translation unit it guards: a flag added there must be added here, or the unit could run on a CPU
// that lacks the instructions the compiler was allowed to emit.
#include "cpu_features.h"

#if defined(HZO_X86)
#include <cpuid.h>

#include <cstdint>
#endif

namespace hzo {
namespace {

#if defined(HZO_X86)
struct Regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

Regs cpuid(unsigned leaf, unsigned sub) {
  Regs r;
  if (!__get_cpuid_count(leaf, sub, &r.a, &r.b, &r.c, &r.d)) r = Regs{};
  return r;
}

// XCR0 via the raw instruction: this file is compiled without -mxsave.
uint64_t xcr0() {
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

bool bit(unsigned reg, int b) { return (reg >> b) & 1u; }

// AVX state usable: the OS uses XSAVE (OSXSAVE) and saves XMM and YMM (XCR0 bits 1, 2).
bool os_saves_ymm() {
  Regs l1 = cpuid(1, 0);
  if (!bit(l1.c, 27)) return false;  // OSXSAVE
  return (xcr0() & 0x6u) == 0x6u;
}
#endif

}  // namespace

bool cpu_can_run_avx2() {
#if defined(HZO_X86)
  if (!os_saves_ymm()) return false;
  Regs l1 = cpuid(1, 0), l7 = cpuid(7, 0);
  const bool avx = bit(l1.c, 28), fma = bit(l1.c, 12), f16c = bit(l1.c, 29);
  const bool avx2 = bit(l7.b, 5);
  return avx && fma && f16c && avx2;
#else
  return false;
#endif
}

bool cpu_can_run_avx512() {
#if defined(HZO_AVX512_EMULATED)
  return cpu_can_run_avx2();  // a test build: the AVX512 unit was compiled for AVX2 (CMakeLists.txt)
#elif defined(HZO_X86)
  if (!cpu_can_run_avx2()) return false;  // FMA and F16C are in its list
  // Opmask (bit 5), upper halves of ZMM0-15 (bit 6) and ZMM16-31 (bit 7), on top of XMM/YMM.
  if ((xcr0() & 0xe6u) != 0xe6u) return false;
  Regs l7 = cpuid(7, 0);
  const bool f = bit(l7.b, 16), dq = bit(l7.b, 17), bw = bit(l7.b, 30), vl = bit(l7.b, 31);
  return f && dq && bw && vl;
#else
  return false;
#endif
}

bool cpu_can_run_avx512_bf16() {
#if defined(HZO_AVX512_BF16)
  // CPUID.(7,1):EAX[5], where leaf 7 has a subleaf 1 (CPUID.(7,0):EAX, its highest subleaf)
  return cpu_can_run_avx512() && cpuid(7, 0).a >= 1 && bit(cpuid(7, 1).a, 5);
#else
  return false;  // not built (the compiler lacked -mavx512bf16, or the AVX512 unit is emulated)
#endif
}

}  // namespace hzo
