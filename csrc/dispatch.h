// Entry points called by the bindings: instruction-set choice and threaded drivers.
#pragma once
#include <string>
#include <vector>

#include "adam.h"

namespace hzo {

std::string best_level();
std::vector<std::string> available_levels();
void set_level(const std::string& level);  // throws std::invalid_argument if unknown or unsupported
std::string current_level();

// For StateKind::Q8 the arrays start at a block boundary (see AdamFn in adam.h).
void adam(const AdamArgs& a, size_t n, int nthreads);
double norm_sq(const void* grad, DType dt, size_t n, int nthreads);
void accumulate(float* acc, const void* grad, DType dt, float scale, bool overwrite, size_t n, int nthreads);

// Blockwise 8-bit codes of fp32 moments (quant.h), bit-identical to what the Q8 kernel stores.
// is_sq: exp_avg_sq's unsigned code (uint8), else exp_avg's signed one (int8).
// scales has ceil(n / kQBlock) entries.
// sr_step > 0: stochastic rounding as the kernel's step sr_step stores it, element i keyed by
// round_index + i (each moment with its own bits); otherwise to nearest (one-off conversions).
// given_scales: scales holds each block's scale (>= its absmax: the caller checks), else receives it.
void quantize(const float* x, void* codes, float* scales, bool is_sq, size_t n, int nthreads, long sr_step = 0,
              uint64_t round_index = 0, bool given_scales = false);
void dequantize(const void* codes, const float* scales, float* out, bool is_sq, size_t n, int nthreads);
size_t quant_block();
// The largest code magnitude a step writes (1.0, where every value clamps): exp_avg_sq's (is_sq) or exp_avg's.
unsigned quant_max_code(bool is_sq);

// Benchmark reference: the memory traffic of an fp32 Adam step (4 reads, 3 writes), no sqrt/div.
void stream_ref(float* p, const float* g, float* m, float* v, size_t n, int nthreads);

}  // namespace hzo
