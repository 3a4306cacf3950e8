// The pieces of the 2026 layers (layers/short_convolution.hpp, layers/gated_rms_norm.hpp), forward
// and backward, for float and double: linattn.torch's ShortConvolution and FusedRMSNormGated run
// on these. Rows are packed row-major N x C (the convolution) and N x H·M (the norm); the Python
// layer (linattn/nn.py) checks shapes and dtypes and names its own function in every error.
#include <linattn/layers/gated_rms_norm.hpp>
#include <linattn/layers/short_convolution.hpp>

#include <optional>
#include <string>
#include <vector>

#include "bindings.hpp"

namespace linattn_python {
namespace {

template <class Scalar>
using ConvState = linattn::ShortConvState<Scalar>;

linattn::ShortConvOptions conv_options(bool silu) {
  linattn::ShortConvOptions o;
  o.activation = silu ? linattn::ConvActivation::Silu : linattn::ConvActivation::None;
  return o;
}

// An absent bias as the empty vector the library reads as none.
template <class Scalar>
Eigen::Map<const linattn::Vector<Scalar>> bias_of(const std::optional<Array<Scalar>>& b) {
  if (!b) return Eigen::Map<const linattn::Vector<Scalar>>(nullptr, 0);
  return Eigen::Map<const linattn::Vector<Scalar>>(b->data(), b->size());
}

// [B, W - 1, C] as B states (none given: B zero states, an empty vector).
template <class Scalar>
std::vector<ConvState<Scalar>> conv_states_of(const char* fn, const std::optional<Array<Scalar>>& a,
                                              Index B, Index L, Index C) {
  std::vector<ConvState<Scalar>> states;
  if (!a) return states;
  if (a->ndim() != 3 || a->shape(0) != B || a->shape(1) != L || a->shape(2) != C)
    throw std::invalid_argument(std::string(fn) + ": initial_state must be [" + std::to_string(B) +
                                ", " + std::to_string(L) + ", " + std::to_string(C) +
                                "] (sequences, W - 1, C)");
  states.resize(static_cast<std::size_t>(B));
  for (Index b = 0; b < B; ++b)
    states[static_cast<std::size_t>(b)] = ConstRows<Scalar>(a->data() + b * L * C, L, C);
  return states;
}

template <class Scalar>
py::tuple conv_forward(const Array<Scalar>& x, const Array<Scalar>& weight,
                       const std::optional<Array<Scalar>>& bias, const Offsets& offsets,
                       const std::optional<Array<Scalar>>& initial, bool silu) {
  const char* fn = "short_convolution";
  const auto X = rows_of(fn, "x", x);
  const auto Wt = rows_of(fn, "weight", weight);
  const auto off = offsets_of(fn, offsets, X.rows());
  const Index B = Index(off.size()) - 1, C = X.cols(), L = Wt.cols() - 1;
  auto states = conv_states_of(fn, initial, B, L, C);
  const auto bvec = bias_of(bias);
  Array<Scalar> y = new_rows<Scalar>(X.rows(), C);
  auto Y = rows_of(y);
  {
    Unlocked unlocked;
    linattn::Workspace<Scalar> ws;
    linattn::batched_short_convolution(X, Wt, bvec, off, states, Y, ws, conv_options(silu));
  }
  Array<Scalar> final_states({py::ssize_t(B), py::ssize_t(L), py::ssize_t(C)});
  for (Index b = 0; b < B; ++b)
    Rows<Scalar>(final_states.mutable_data() + b * L * C, L, C) =
        states[static_cast<std::size_t>(b)];
  return py::make_tuple(y, final_states);
}

template <class Scalar>
py::tuple conv_backward(const Array<Scalar>& x, const Array<Scalar>& weight,
                        const std::optional<Array<Scalar>>& bias, const Offsets& offsets,
                        const std::optional<Array<Scalar>>& initial, const Array<Scalar>& dy,
                        bool silu) {
  const char* fn = "short_convolution_backward";
  const auto X = rows_of(fn, "x", x);
  const auto Wt = rows_of(fn, "weight", weight);
  const auto dY = rows_of(fn, "dy", dy);
  const auto off = offsets_of(fn, offsets, X.rows());
  const Index B = Index(off.size()) - 1, C = X.cols(), L = Wt.cols() - 1;
  const auto states = conv_states_of(fn, initial, B, L, C);
  const auto bvec = bias_of(bias);
  linattn::ShortConvGradients<Scalar> g;
  {
    Unlocked unlocked;
    g = linattn::batched_short_convolution_backward(X, Wt, bvec, off, states, dY,
                                                    conv_options(silu));
  }
  Array<Scalar> dx = new_rows<Scalar>(X.rows(), C), dw = new_rows<Scalar>(C, Wt.cols());
  rows_of(dx) = g.dX;
  rows_of(dw) = g.dweight;
  py::object db = py::none(), dinit = py::none();
  if (bias) {
    Array<Scalar> a(std::vector<py::ssize_t>{py::ssize_t(C)});
    Eigen::Map<linattn::Vector<Scalar>>(a.mutable_data(), C) = g.dbias;
    db = std::move(a);
  }
  if (initial) {
    Array<Scalar> a({py::ssize_t(B), py::ssize_t(L), py::ssize_t(C)});
    for (Index b = 0; b < B; ++b)
      Rows<Scalar>(a.mutable_data() + b * L * C, L, C) = g.dinitial[static_cast<std::size_t>(b)];
    dinit = std::move(a);
  }
  return py::make_tuple(dx, dw, db, dinit);
}

linattn::GatedRMSNormOptions norm_options(double eps, bool silu) {
  linattn::GatedRMSNormOptions o;
  o.eps = eps;
  o.gate = silu ? linattn::NormGate::Silu : linattn::NormGate::Sigmoid;
  return o;
}

template <class Scalar>
Array<Scalar> norm_forward(const Array<Scalar>& o, const Array<Scalar>& z,
                           const Array<Scalar>& weight, double eps, bool silu) {
  const char* fn = "gated_rms_norm";
  const auto O = rows_of(fn, "o", o);
  const auto Z = rows_of(fn, "z", z);
  const Eigen::Map<const linattn::Vector<Scalar>> w(weight.data(), weight.size());
  Array<Scalar> y = new_rows<Scalar>(O.rows(), O.cols());
  auto Y = rows_of(y);
  {
    Unlocked unlocked;
    linattn::gated_rms_norm(O, Z, w, Y, norm_options(eps, silu));
  }
  return y;
}

template <class Scalar>
py::tuple norm_backward(const Array<Scalar>& o, const Array<Scalar>& z, const Array<Scalar>& weight,
                        const Array<Scalar>& dy, double eps, bool silu) {
  const char* fn = "gated_rms_norm_backward";
  const auto O = rows_of(fn, "o", o);
  const auto Z = rows_of(fn, "z", z);
  const auto dY = rows_of(fn, "dy", dy);
  const Eigen::Map<const linattn::Vector<Scalar>> w(weight.data(), weight.size());
  linattn::GatedRMSNormGradients<Scalar> g;
  {
    Unlocked unlocked;
    g = linattn::gated_rms_norm_backward(O, Z, w, dY, norm_options(eps, silu));
  }
  Array<Scalar> d_o = new_rows<Scalar>(O.rows(), O.cols()),
                dz = new_rows<Scalar>(O.rows(), O.cols());
  rows_of(d_o) = g.dO;
  rows_of(dz) = g.dZ;
  Array<Scalar> dw(std::vector<py::ssize_t>{py::ssize_t(w.size())});
  Eigen::Map<linattn::Vector<Scalar>>(dw.mutable_data(), w.size()) = g.dweight;
  return py::make_tuple(d_o, dz, dw);
}

template <class Scalar>
void register_layers(py::module_& m) {
  m.def("conv_forward", &conv_forward<Scalar>, py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("offsets"), py::arg("initial_state"), py::arg("silu"));
  m.def("conv_backward", &conv_backward<Scalar>, py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("offsets"), py::arg("initial_state"), py::arg("dy"), py::arg("silu"));
  m.def("norm_forward", &norm_forward<Scalar>, py::arg("o"), py::arg("z"), py::arg("weight"),
        py::arg("eps"), py::arg("silu"));
  m.def("norm_backward", &norm_backward<Scalar>, py::arg("o"), py::arg("z"), py::arg("weight"),
        py::arg("dy"), py::arg("eps"), py::arg("silu"));
}

}  // namespace

void register_layers(py::module_& m) {
  register_layers<float>(m);
  register_layers<double>(m);
}

}  // namespace linattn_python
