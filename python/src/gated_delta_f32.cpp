#include "gated_delta_impl.hpp"

namespace linattn_python {
void register_gated_delta_f32(py::module_& m) { register_gated_delta<float>(m); }
}  // namespace linattn_python
