#include "recurrent_impl.hpp"

namespace linattn_python {
void register_recurrent_f64(py::module_& m) { register_recurrent<double>(m, "Decoder64"); }
}  // namespace linattn_python
