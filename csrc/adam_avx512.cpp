// PLACEHOLDER: scalar loops compiled with this ISA's flags; replaced by the real intrinsics kernel.
#include "adam.h"

namespace hzo {
namespace {
void adam_k(const AdamArgs& a, size_t b, size_t e) { for (size_t i = b; i < e; ++i) adam_scalar_elem(a, i); }
void norm_k(const void* g, DType dt, size_t b, size_t e, double lanes[16]) { norm_scalar_range(g, dt, b, e, lanes); }
void acc_k(float* acc, const void* g, DType dt, float s, bool o, size_t b, size_t e) {
  for (size_t i = b; i < e; ++i) accumulate_scalar_elem(acc, g, dt, s, o, i);
}
}  // namespace
KernelTable avx512_kernels() { return {"avx512", adam_k, norm_k, acc_k}; }
}  // namespace hzo
