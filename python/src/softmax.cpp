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
  const char* fn = causal ? "causal_softmax_attention" : "softmax_attention";
  const auto Q = rows_of(fn, "q", q);
  const auto K = rows_of(fn, "k", k);
  const auto V = rows_of(fn, "v", v);
  const std::vector<Index> qo = q_offsets ? offsets_of(fn, *q_offsets, Q.rows())
                                          : std::vector<Index>{0, Q.rows()};
  const std::vector<Index> ko = k_offsets ? offsets_of(fn, *k_offsets, K.rows())
                                          : std::vector<Index>{0, K.rows()};
  if (qo.size() != ko.size())
    throw std::invalid_argument(std::string(fn) + ": q has " + std::to_string(qo.size() - 1) +
                                " sequences but k has " + std::to_string(ko.size() - 1));
  if (V.rows() != K.rows())
    throw std::invalid_argument(std::string(fn) + ": k has " + std::to_string(K.rows()) +
                                " rows but v has " + std::to_string(V.rows()));
  Array<Scalar> out = new_rows<Scalar>(Q.rows(), V.cols());
  auto O = rows_of(out);
  {
    py::gil_scoped_release unlocked;
    linattn::MultiHeadWorkspace<Scalar> ws;
    for (std::size_t b = 0; b + 1 < qo.size(); ++b) {
      const Index q0 = qo[b], n = qo[b + 1] - q0, k0 = ko[b], l = ko[b + 1] - k0;
      auto ob = O.middleRows(q0, n);
      if (causal)
        linattn::multihead_causal_softmax_attention(Q.middleRows(q0, n), K.middleRows(k0, l),
                                                    V.middleRows(k0, l), heads, ob, ws);
      else
        linattn::multihead_softmax_attention(Q.middleRows(q0, n), K.middleRows(k0, l),
                                             V.middleRows(k0, l), heads, ob, ws);
    }
  }
  return out;
}

template <class Scalar>
py::tuple softmax_backward(const Array<Scalar>& q, const Array<Scalar>& k,
                           const Array<Scalar>& v, const Array<Scalar>& dout, Index heads,
                           bool causal, const std::optional<Offsets>& q_offsets,
                           const std::optional<Offsets>& k_offsets) {
  const char* fn = causal ? "causal_softmax_attention_backward" : "softmax_attention_backward";
  const auto Q = rows_of(fn, "q", q);
  const auto K = rows_of(fn, "k", k);
  const auto V = rows_of(fn, "v", v);
  const auto G = rows_of(fn, "dout", dout);
  const std::vector<Index> qo = q_offsets ? offsets_of(fn, *q_offsets, Q.rows())
                                          : std::vector<Index>{0, Q.rows()};
  const std::vector<Index> ko = k_offsets ? offsets_of(fn, *k_offsets, K.rows())
                                          : std::vector<Index>{0, K.rows()};
  if (qo.size() != ko.size())
    throw std::invalid_argument(std::string(fn) + ": q has " + std::to_string(qo.size() - 1) +
                                " sequences but k has " + std::to_string(ko.size() - 1));
  if (V.rows() != K.rows() || G.rows() != Q.rows())
    throw std::invalid_argument(std::string(fn) + ": k has " + std::to_string(K.rows()) +
                                " rows, v " + std::to_string(V.rows()) + ", q " +
                                std::to_string(Q.rows()) + " and dout " +
                                std::to_string(G.rows()) + " (v must match k, dout q)");
  Array<Scalar> dq = new_rows<Scalar>(Q.rows(), Q.cols());
  Array<Scalar> dk = new_rows<Scalar>(K.rows(), K.cols());
  Array<Scalar> dv = new_rows<Scalar>(V.rows(), V.cols());
  auto dQ = rows_of(dq);
  auto dK = rows_of(dk);
  auto dV = rows_of(dv);
  {
    py::gil_scoped_release unlocked;
    linattn::MultiHeadWorkspace<Scalar> ws;
    for (std::size_t b = 0; b + 1 < qo.size(); ++b) {
      const Index q0 = qo[b], n = qo[b + 1] - q0, k0 = ko[b], l = ko[b + 1] - k0;
      auto dqb = dQ.middleRows(q0, n);
      auto dkb = dK.middleRows(k0, l);
      auto dvb = dV.middleRows(k0, l);
      if (causal)
        linattn::multihead_causal_softmax_attention_backward(
            Q.middleRows(q0, n), K.middleRows(k0, l), V.middleRows(k0, l), G.middleRows(q0, n),
            heads, dqb, dkb, dvb, ws);
      else
        linattn::multihead_softmax_attention_backward(
            Q.middleRows(q0, n), K.middleRows(k0, l), V.middleRows(k0, l), G.middleRows(q0, n),
            heads, dqb, dkb, dvb, ws);
    }
  }
  return py::make_tuple(dq, dk, dv);
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
