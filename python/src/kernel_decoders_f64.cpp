#include "kernel_decoders_impl.hpp"

namespace linattn_python {
void register_kernel_decoders_f64(py::module_& m) {
  register_kernel_decoders<double>(m, "KernelDecoder64");
}
}  // namespace linattn_python
