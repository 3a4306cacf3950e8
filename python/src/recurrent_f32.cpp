#include "recurrent_impl.hpp"

namespace linattn_python {
void register_recurrent_f32(py::module_& m) { register_recurrent<float>(m, "Decoder32"); }
}  // namespace linattn_python
