// The float gated and delta-rule decoders that keep their states in bf16 or half
// (linattn.GatedDecoder / DeltaRuleDecoder with state_dtype=): their own unit, so that their
// instantiations compile beside the float and double decoders'.
#include "kernel_decoders_impl.hpp"

namespace linattn_python {
namespace {

// f(bf16 or half) by the storage's numpy / torch name.
template <class F>
auto with_storage(const char* fn, const std::string& storage, F&& f) {
  if (storage == "bfloat16") return f(Eigen::bfloat16{});
  if (storage == "float16") return f(Eigen::half{});
  throw std::invalid_argument(std::string(fn) + ": state_dtype must be bfloat16 or float16 for a "
                              "low-precision state, got '" + storage + "'");
}

}  // namespace

void register_kernel_decoders_low(py::module_& m) {
  m.def(
      "new_gated_decoder_low",
      [](Index B, Index H, Index D, Index M, Index key_heads, const std::string& map, double scale,
         bool normalize, const std::string& storage) {
        return with_storage("GatedDecoder", storage, [&](auto s) {
          return new_gated_decoder<float, decltype(s)>(B, H, D, M, key_heads, map, scale,
                                                       normalize);
        });
      },
      py::arg("B"), py::arg("H"), py::arg("D"), py::arg("M"), py::arg("key_heads"),
      py::arg("feature_map"), py::arg("scale"), py::arg("normalize"), py::arg("state_dtype"));
  m.def(
      "new_delta_decoder_low",
      [](Index B, Index H, Index D, Index M, Index key_heads, const std::string& map, double scale,
         double eps, const std::string& storage) {
        return with_storage("DeltaRuleDecoder", storage, [&](auto s) {
          return new_delta_decoder<float, decltype(s)>(B, H, D, M, key_heads, map, scale, eps);
        });
      },
      py::arg("B"), py::arg("H"), py::arg("D"), py::arg("M"), py::arg("key_heads"),
      py::arg("feature_map"), py::arg("scale"), py::arg("eps"), py::arg("state_dtype"));
}

}  // namespace linattn_python
