// Softmax attention (the O(N²) baseline), forward and backward, float and double.
#include <linattn/multihead.hpp>
#include <linattn/softmax_attention_backward.hpp>

#include <optional>

#include "bindings.hpp"

namespace linattn_python {
namespace {

template <class Scalar>
Array<Scalar> softmax_forward(const Array<Scalar>& q, const Array<Scalar>& k,
                              const Array<Scalar>& v, Index heads, bool causal,
                              const std::optional<Offsets>& q_offsets,
                              const std::optional<Offsets>& k_offsets) {
  const Operands<Scalar> x(causal ? "causal_softmax_attention" : "softmax_attention", q, k, v,
                           q_offsets, k_offsets);
  Array<Scalar> out = new_rows<Scalar>(x.Q.rows(), x.V.cols());
  auto O = rows_of(out);
  {
    py::gil_scoped_release unlocked;
    linattn::MultiHeadWorkspace<Scalar> ws;
    x.each_sequence([&](Index q0, Index n, Index k0, Index l) {
      auto ob = O.middleRows(q0, n);
      const auto qb = x.Q.middleRows(q0, n);
      const auto kb = x.K.middleRows(k0, l);
      const auto vb = x.V.middleRows(k0, l);
      if (causal)
        linattn::multihead_causal_softmax_attention(qb, kb, vb, heads, ob, ws);
      else
        linattn::multihead_softmax_attention(qb, kb, vb, heads, ob, ws);
    });
  }
  return out;
}

template <class Scalar>
py::tuple softmax_backward(const Array<Scalar>& q, const Array<Scalar>& k,
                           const Array<Scalar>& v, const Array<Scalar>& dout, Index heads,
                           bool causal, const std::optional<Offsets>& q_offsets,
                           const std::optional<Offsets>& k_offsets) {
  const Operands<Scalar> x(
      causal ? "causal_softmax_attention_backward" : "softmax_attention_backward", q, k, v,
      q_offsets, k_offsets);
  const auto G = x.dout(dout);
  Gradients<Scalar> g(x);
  {
    py::gil_scoped_release unlocked;
    linattn::MultiHeadWorkspace<Scalar> ws;
    x.each_sequence([&](Index q0, Index n, Index k0, Index l) {
      auto dq = g.dQ.middleRows(q0, n);
      auto dk = g.dK.middleRows(k0, l);
      auto dv = g.dV.middleRows(k0, l);
      const auto qb = x.Q.middleRows(q0, n);
      const auto kb = x.K.middleRows(k0, l);
      const auto vb = x.V.middleRows(k0, l);
      const auto gb = G.middleRows(q0, n);
      if (causal)
        linattn::multihead_causal_softmax_attention_backward(qb, kb, vb, gb, heads, dq, dk, dv, ws);
      else
        linattn::multihead_softmax_attention_backward(qb, kb, vb, gb, heads, dq, dk, dv, ws);
    });
  }
  return g.tuple();
}

template <class Scalar>
void register_softmax_scalar(py::module_& m) {
  m.def("softmax_forward", &softmax_forward<Scalar>, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("heads"), py::arg("causal"), py::arg("q_offsets"), py::arg("k_offsets"));
  m.def("softmax_backward", &softmax_backward<Scalar>, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("dout"), py::arg("heads"), py::arg("causal"),
        py::arg("q_offsets"), py::arg("k_offsets"));
}

}  // namespace

void register_softmax(py::module_& m) {
  register_softmax_scalar<float>(m);
  register_softmax_scalar<double>(m);
}

}  // namespace linattn_python
