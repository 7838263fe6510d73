// Run-time CPU feature checks, one per kernel translation unit.
#pragma once

namespace hzo {

// True when the CPU reports (CPUID) and the OS enables (XGETBV) everything adam_avx2.cpp is
// compiled with: -mavx2 -mfma -mf16c (AVX2, FMA, F16C, AVX, YMM state saved by the OS).
bool cpu_can_run_avx2();
// Same for adam_avx512.cpp: -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c
// (plus the opmask and ZMM register state saved by the OS).
bool cpu_can_run_avx512();
// The same unit built with -mavx512bf16 as well: all of the above and AVX512_BF16.
bool cpu_can_run_avx512_bf16();

}  // namespace hzo
