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

void adam(const AdamArgs& a, size_t n, int nthreads);
double norm_sq(const void* grad, DType dt, size_t n, int nthreads);
void accumulate(float* acc, const void* grad, DType dt, float scale, bool overwrite, size_t n, int nthreads);

// Benchmark reference: the memory traffic of an fp32 Adam step (4 reads, 3 writes), no sqrt/div.
void stream_ref(float* p, const float* g, float* m, float* v, size_t n, int nthreads);
// Persistent worker pool (default) or fresh std::threads per call; results are the same either way.
void set_thread_pool(bool on);

}  // namespace hzo
