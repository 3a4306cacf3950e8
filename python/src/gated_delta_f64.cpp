#include "gated_delta_impl.hpp"

namespace linattn_python {
void register_gated_delta_f64(py::module_& m) { register_gated_delta<double>(m); }
}  // namespace linattn_python
