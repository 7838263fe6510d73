// The scalar reference: kept forever, compiled without any -m flag, runs on any CPU. Also the home
// of make_adam_args, the hyper-parameter math every instruction set shares.
#include <algorithm>

#include "quant.h"

namespace hzo {

AdamArgs make_adam_args(long step, double lr, double beta1, double beta2, double eps, double weight_decay,
                        bool adamw, double grad_scale) {
  AdamArgs a{};
  a.grad_scale = static_cast<float>(grad_scale);
  a.beta1 = static_cast<float>(beta1);
  a.beta2 = static_cast<float>(beta2);
  // torch's lerp: weight w = fp32(1 - beta1); |w| < 0.5: m + w (g - m), else g + (w - 1) (g - m), w - 1 in fp32
  const float w = static_cast<float>(1.0 - beta1);
  a.lerp_from_grad = !(std::fabs(w) < 0.5f);
  a.lerp_weight = a.lerp_from_grad ? w - 1.0f : w;
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.eps = static_cast<float>(eps);
  a.decay = adamw ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;  // Loshchilov & Hutter, Alg. 2 line 12
  a.l2 = adamw ? 0.0f : static_cast<float>(weight_decay);                // Kingma & Ba + L2, as torch.optim.Adam
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  a.step_size = static_cast<float>(lr / bc1);
  a.bias_correction2_sqrt = static_cast<float>(std::sqrt(bc2));
  a.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  // bound_m's constant: (1-beta1) sqrt(S / (1-beta2)), S = sum_{j<step} r^j, r = beta1^2/beta2 (inf
  // when beta2 = 0 or S overflows: then no bound), with 1/64 to spare: exact moments meet it with
  // equality at step 1, and bf16's rounding (< 2^-8 of each moment) must never reach it.
  const double r = beta2 > 0.0 ? beta1 * beta1 / beta2 : INFINITY;
  const double sum = r == 1.0 ? static_cast<double>(step)
                     : r == 0.0 ? 1.0 : (std::pow(r, static_cast<double>(step)) - 1.0) / (r - 1.0);
  const double bound = (1.0 - beta1) * std::sqrt(sum / (1.0 - beta2)) * (1.0 + 1.0 / 64);
  a.m_bound = std::isfinite(bound) ? static_cast<float>(bound) : INFINITY;
  a.round_seed = round_seed_of(step);
  return a;
}

namespace {

void adam_scalar(const AdamArgs& a, size_t begin, size_t end) {
  switch (a.state) {
    case StateKind::F32:
      if (a.compact_math) {
        for (size_t i = begin; i < end; ++i) adam_scalar_elem<StateKind::F32, true>(a, i);
      } else {
        for (size_t i = begin; i < end; ++i) adam_scalar_elem<StateKind::F32>(a, i);
      }
      break;
    case StateKind::BF16:
      for (size_t i = begin; i < end; ++i) adam_scalar_elem<StateKind::BF16>(a, i);
      break;
    case StateKind::Q8:
      for (size_t b = begin; b < end; b += kQBlock) adam_q8_block_scalar(a, b, std::min(end, b + kQBlock));
      break;
  }
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
