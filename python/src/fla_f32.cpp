#include "fla_impl.hpp"

namespace linattn_python {
void register_fla_f32(py::module_& m) { register_fla<float>(m); }
}  // namespace linattn_python
