// linattn._linattn: the kernels on C-contiguous numpy arrays in the packed row-major layout
// (N x H·D). The Python package (linattn/__init__.py) is the interface: it checks dtypes,
// reshapes [B, T, H, D] and [N, D] arrays into that layout and names the arguments.
#include <pybind11/stl.h>

#include <linattn/version.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "bindings.hpp"

namespace linattn_python {
// Declared here, not in bindings.hpp, which every translation unit includes.
void register_fla_f32(py::module_& m);
void register_fla_f64(py::module_& m);
void register_layers(py::module_& m);
void register_kernel_decoders_f32(py::module_& m);
void register_kernel_decoders_f64(py::module_& m);
void register_kernel_decoders_low(py::module_& m);

namespace {

void set_num_threads(int n) {
  if (n < 1)
    throw std::invalid_argument("set_num_threads: the thread count must be >= 1, got " +
                                std::to_string(n));
  // For every Python thread, applied where a kernel runs (bindings.hpp, Unlocked).
  thread_count().store(n, std::memory_order_relaxed);
}

int get_num_threads() {
#ifdef _OPENMP
  return thread_count().load(std::memory_order_relaxed);
#else
  return 1;
#endif
}

// The team size a kernel started now on this thread would get (tests: the thread count holds
// in every Python thread).
int threads_in_kernel() {
  Unlocked unlocked;
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace
}  // namespace linattn_python

PYBIND11_MODULE(_linattn, m) {
  namespace lp = linattn_python;
  m.doc() = "linattn's kernels on packed row-major numpy arrays (use the linattn package)";
  // Overloads by dtype: pybind11 tries float32 first, then float64 (no conversion between them:
  // the arrays are taken as they are, see bindings.hpp).
  lp::register_linear_f32(m);
  lp::register_linear_f64(m);
  lp::register_softmax(m);
  lp::register_gated_delta_f32(m);
  lp::register_gated_delta_f64(m);
  lp::register_fla_f32(m);
  lp::register_fla_f64(m);
  lp::register_recurrent_f32(m);
  lp::register_recurrent_f64(m);
  lp::register_kernel_decoders_f32(m);
  lp::register_kernel_decoders_f64(m);
  lp::register_kernel_decoders_low(m);
  lp::register_layers(m);
  lp::thread_count().store(lp::default_thread_count(), std::memory_order_relaxed);
  m.def("set_num_threads", &lp::set_num_threads, pybind11::arg("n"));
  m.def("get_num_threads", &lp::get_num_threads);
  m.def("_threads_in_kernel", &lp::threads_in_kernel);
  m.attr("__version__") = LINATTN_VERSION_STRING;
  m.attr("openmp") =
#ifdef _OPENMP
      true;
#else
      false;
#endif
}
