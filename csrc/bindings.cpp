// pybind11 bindings. Tensors cross as integer addresses plus sizes: the C++ side never sees torch,
// and the typed checks (dtype, device, contiguity, sizes) live in hf_zero_offload/ops.py.
// Every long call releases the GIL so a worker thread (the delayed parameter update) can run the
// step while Python keeps driving the device.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>

#include "dispatch.h"

namespace py = pybind11;
using hzo::DType;

namespace {

DType to_dtype(int code, const char* what) {
  if (code < 0 || code > 2) throw py::value_error(std::string(what) + ": unknown dtype code");
  return static_cast<DType>(code);
}

void adam_step(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq,
               uintptr_t param_out, int out_dtype, size_t n, long step, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool adamw, double grad_scale, int nthreads) {
  hzo::AdamArgs a{};
  a.param = reinterpret_cast<float*>(param);
  a.grad = reinterpret_cast<const void*>(grad);
  a.exp_avg = reinterpret_cast<float*>(exp_avg);
  a.exp_avg_sq = reinterpret_cast<float*>(exp_avg_sq);
  a.param_out = reinterpret_cast<void*>(param_out);
  a.grad_dtype = to_dtype(grad_dtype, "grad");
  a.out_dtype = to_dtype(out_dtype, "param_out");
  a.grad_scale = static_cast<float>(grad_scale);
  a.beta1 = static_cast<float>(beta1);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.eps = static_cast<float>(eps);
  a.decay = adamw ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  a.l2 = adamw ? 0.0f : static_cast<float>(weight_decay);
  // Bias corrections in double, as torch.optim.Adam(W) computes them on Python floats.
  double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  a.step_size = static_cast<float>(lr / bc1);
  a.bias_correction2_sqrt = static_cast<float>(std::sqrt(bc2));
  py::gil_scoped_release release;
  hzo::adam(a, n, nthreads);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hf_zero_offload private kernels (use hf_zero_offload.ops)";
  m.def("adam_step", &adam_step);
  m.def(
      "norm_sq",
      [](uintptr_t grad, int dt, size_t n, int nthreads) {
        DType d = to_dtype(dt, "grad");
        py::gil_scoped_release release;
        return hzo::norm_sq(reinterpret_cast<const void*>(grad), d, n, nthreads);
      });
  m.def(
      "accumulate",
      [](uintptr_t acc, uintptr_t grad, int dt, double scale, bool overwrite, size_t n, int nthreads) {
        DType d = to_dtype(dt, "grad");
        py::gil_scoped_release release;
        hzo::accumulate(reinterpret_cast<float*>(acc), reinterpret_cast<const void*>(grad), d,
                        static_cast<float>(scale), overwrite, n, nthreads);
      });
  m.def(
      "stream_ref",
      [](uintptr_t p, uintptr_t g, uintptr_t m_, uintptr_t v, size_t n, int nthreads) {
        py::gil_scoped_release release;
        hzo::stream_ref(reinterpret_cast<float*>(p), reinterpret_cast<const float*>(g), reinterpret_cast<float*>(m_),
                        reinterpret_cast<float*>(v), n, nthreads);
      },
      "benchmark reference: fp32 Adam's memory traffic (4 reads, 3 writes) without its arithmetic");
  m.def("set_thread_pool", &hzo::set_thread_pool,
        "True: persistent worker threads (default); False: fresh threads per call (benchmarks)");
  m.def("best_level", &hzo::best_level);
  m.def("available_levels", &hzo::available_levels);
  m.def("current_level", &hzo::current_level);
  m.def("set_level", [](const std::string& level) {
    try {
      hzo::set_level(level);
    } catch (const std::invalid_argument& e) {
      throw py::value_error(e.what());
    }
  });
}
