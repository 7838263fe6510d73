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

}  // namespace hzo
