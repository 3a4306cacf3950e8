#include "linear_impl.hpp"

namespace linattn_python {
void register_linear_f64(py::module_& m) { register_linear<double>(m); }
}  // namespace linattn_python
