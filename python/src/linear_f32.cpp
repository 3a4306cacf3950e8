#include "linear_impl.hpp"

namespace linattn_python {
void register_linear_f32(py::module_& m) { register_linear<float>(m); }
}  // namespace linattn_python
