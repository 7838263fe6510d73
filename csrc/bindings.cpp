// pybind11 bindings. Tensors cross as integer addresses plus sizes: the C++ side never sees torch,
// and the typed checks (dtype, device, contiguity, sizes, block alignment) live in
// hf_zero_offload/ops/. Every long call releases the GIL so a worker thread (the delayed
// parameter update) can run the step while Python keeps driving the device.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "dispatch.h"
#include "thread_pool.h"

namespace py = pybind11;
using hzo::DType;
using hzo::StateKind;

namespace {

DType to_dtype(int code, const char* what) {
  if (code < 0 || code > 2) throw py::value_error(std::string(what) + ": unknown dtype code");
  return static_cast<DType>(code);
}

template <typename T>
T* ptr(uintptr_t addr) {
  return reinterpret_cast<T*>(addr);
}

// state: 0 fp32 moments, 1 bf16 moments, 2 blockwise 8-bit codes with their scale arrays.
void adam_step(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq,
               int state, uintptr_t exp_avg_scale, uintptr_t exp_avg_sq_scale, uintptr_t param_out, int out_dtype,
               size_t n, long step, double lr, double beta1, double beta2, double eps, double weight_decay,
               bool adamw, double grad_scale, uint64_t round_index, bool compact_math, int nthreads) {
  if (state < 0 || state > 2) throw py::value_error("state: unknown state kind code");
  hzo::AdamArgs a = hzo::make_adam_args(step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale);
  a.param = ptr<float>(param);
  a.grad = ptr<const void>(grad);
  a.exp_avg = ptr<void>(exp_avg);
  a.exp_avg_sq = ptr<void>(exp_avg_sq);
  a.state = static_cast<StateKind>(state);
  a.exp_avg_scale = ptr<float>(exp_avg_scale);
  a.exp_avg_sq_scale = ptr<float>(exp_avg_sq_scale);
  a.param_out = ptr<void>(param_out);
  a.grad_dtype = to_dtype(grad_dtype, "grad");
  a.out_dtype = to_dtype(out_dtype, "param_out");
  a.round_index = round_index;
  a.compact_math = compact_math;
  py::gil_scoped_release release;
  hzo::adam(a, n, nthreads);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hf_zero_offload private kernels (use hf_zero_offload.ops)";
  m.def("adam_step", &adam_step);
  m.def("norm_sq", [](uintptr_t grad, int dt, size_t n, int nthreads) {
    DType d = to_dtype(dt, "grad");
    py::gil_scoped_release release;
    return hzo::norm_sq(ptr<const void>(grad), d, n, nthreads);
  });
  m.def("accumulate", [](uintptr_t acc, uintptr_t grad, int dt, double scale, bool overwrite, size_t n, int nthreads) {
    DType d = to_dtype(dt, "grad");
    py::gil_scoped_release release;
    hzo::accumulate(ptr<float>(acc), ptr<const void>(grad), d, static_cast<float>(scale), overwrite, n, nthreads);
  });
  m.def("quantize", [](uintptr_t x, uintptr_t codes, uintptr_t scales, bool is_sq, size_t n, int nthreads,
                       long sr_step, uint64_t round_index, bool given_scales) {
    py::gil_scoped_release release;
    hzo::quantize(ptr<const float>(x), ptr<void>(codes), ptr<float>(scales), is_sq, n, nthreads, sr_step, round_index,
                  given_scales);
  });
  m.def("dequantize", [](uintptr_t codes, uintptr_t scales, uintptr_t out, bool is_sq, size_t n, int nthreads) {
    py::gil_scoped_release release;
    hzo::dequantize(ptr<const void>(codes), ptr<const float>(scales), ptr<float>(out), is_sq, n, nthreads);
  });
  m.def("quant_block", &hzo::quant_block);
  m.def("quant_max_code", &hzo::quant_max_code);
  m.def(
      "stream_ref",
      [](uintptr_t p, uintptr_t g, uintptr_t m_, uintptr_t v, size_t n, int nthreads) {
        py::gil_scoped_release release;
        hzo::stream_ref(ptr<float>(p), ptr<const float>(g), ptr<float>(m_), ptr<float>(v), n, nthreads);
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
