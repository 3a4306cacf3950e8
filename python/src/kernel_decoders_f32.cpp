#include "kernel_decoders_impl.hpp"

namespace linattn_python {
void register_kernel_decoders_f32(py::module_& m) {
  register_kernel_decoders<float>(m, "KernelDecoder32");
}
}  // namespace linattn_python
