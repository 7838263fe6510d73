// The scalar reference: kept forever, compiled without any -m flag, runs on any CPU.
#include "adam.h"

namespace hzo {
namespace {

void adam_scalar(const AdamArgs& a, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) adam_scalar_elem(a, i);
}

void norm_scalar(const void* g, DType dt, size_t begin, size_t end, double lanes[16]) {
  norm_scalar_range(g, dt, begin, end, lanes);
}

void accumulate_scalar(float* acc, const void* g, DType dt, float scale, bool overwrite, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) accumulate_scalar_elem(acc, g, dt, scale, overwrite, i);
}

}  // namespace

KernelTable scalar_kernels() { return {"scalar", adam_scalar, norm_scalar, accumulate_scalar}; }

}  // namespace hzo
