#include "fla_impl.hpp"

namespace linattn_python {
void register_fla_f64(py::module_& m) { register_fla<double>(m); }
}  // namespace linattn_python
