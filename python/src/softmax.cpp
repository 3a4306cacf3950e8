// Softmax attention (the O(N²) baseline), forward and backward, float and double.
#include <linattn/multihead.hpp>
#include <linattn/softmax_attention_backward.hpp>

#include <optional>

#include "bindings.hpp"

namespace linattn_python {
namespace {

// The kept key rows [k0, k0 + l) of a sequence, gathered: softmax attention over the keys a
// padding mask keeps is softmax attention over those rows alone (non-causal).
std::vector<Index> kept_rows(const MaskMap& keep, Index k0, Index l) {
  std::vector<Index> rows;
  for (Index j = k0; j < k0 + l; ++j)
    if (keep(j)) rows.push_back(j);
  return rows;
}

template <class Scalar>
RowMatrix<Scalar> gather(const ConstRows<Scalar>& X, const std::vector<Index>& rows) {
  RowMatrix<Scalar> out(static_cast<Index>(rows.size()), X.cols());
  for (std::size_t i = 0; i < rows.size(); ++i) out.row(static_cast<Index>(i)) = X.row(rows[i]);
  return out;
}

template <class Scalar>
void check_mask(const Operands<Scalar>& x, const std::optional<KeyMask>& mask, bool causal) {
  if (!mask) return;
  if (causal)
    throw std::invalid_argument(std::string(x.fn) +
                                ": a key padding mask is supported for non-causal softmax "
                                "attention only (causal: pass the sequences' lengths as "
                                "cu_seqlens instead)");
  if (mask->size() != x.K.rows())
    throw std::invalid_argument(std::string(x.fn) + ": the key mask has " +
                                std::to_string(mask->size()) + " entries but k has " +
                                std::to_string(x.K.rows()) + " rows");
}

template <class Scalar>
Array<Scalar> softmax_forward(const Array<Scalar>& q, const Array<Scalar>& k,
                              const Array<Scalar>& v, Index heads, bool causal,
                              const std::optional<Offsets>& q_offsets,
                              const std::optional<Offsets>& k_offsets,
                              const std::optional<KeyMask>& mask) {
  const Operands<Scalar> x(causal ? "causal_softmax_attention" : "softmax_attention", q, k, v,
                           q_offsets, k_offsets);
  check_mask(x, mask, causal);
  Array<Scalar> out = new_rows<Scalar>(x.Q.rows(), x.V.cols());
  auto O = rows_of(out);
  {
    Unlocked unlocked;
    linattn::MultiHeadWorkspace<Scalar> ws;
    x.each_sequence([&](Index q0, Index n, Index k0, Index l) {
      auto ob = O.middleRows(q0, n);
      const auto qb = x.Q.middleRows(q0, n);
      const auto kb = x.K.middleRows(k0, l);
      const auto vb = x.V.middleRows(k0, l);
      if (mask) {
        const auto rows = kept_rows(mask_of(*mask), k0, l);
        if (rows.empty())
          ob.setZero();  // no key left: the empty sum, as linear attention's guard gives
        else
          linattn::multihead_softmax_attention(qb, gather(x.K, rows), gather(x.V, rows), heads,
                                               ob, ws);
      } else if (causal)
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
                           const std::optional<Offsets>& k_offsets,
                           const std::optional<KeyMask>& mask) {
  const Operands<Scalar> x(
      causal ? "causal_softmax_attention_backward" : "softmax_attention_backward", q, k, v,
      q_offsets, k_offsets);
  check_mask(x, mask, causal);
  const auto G = x.dout(dout);
  Gradients<Scalar> g(x);
  {
    Unlocked unlocked;
    linattn::MultiHeadWorkspace<Scalar> ws;
    x.each_sequence([&](Index q0, Index n, Index k0, Index l) {
      auto dq = g.dQ.middleRows(q0, n);
      auto dk = g.dK.middleRows(k0, l);
      auto dv = g.dV.middleRows(k0, l);
      const auto qb = x.Q.middleRows(q0, n);
      const auto kb = x.K.middleRows(k0, l);
      const auto vb = x.V.middleRows(k0, l);
      const auto gb = G.middleRows(q0, n);
      if (mask) {
        const auto rows = kept_rows(mask_of(*mask), k0, l);
        dk.setZero();
        dv.setZero();
        if (rows.empty()) {
          dq.setZero();
          return;
        }
        RowMatrix<Scalar> dkg(static_cast<Index>(rows.size()), x.K.cols());
        RowMatrix<Scalar> dvg(static_cast<Index>(rows.size()), x.V.cols());
        linattn::multihead_softmax_attention_backward(qb, gather(x.K, rows), gather(x.V, rows),
                                                      gb, heads, dq, dkg, dvg, ws);
        for (std::size_t i = 0; i < rows.size(); ++i) {
          g.dK.row(rows[i]) = dkg.row(static_cast<Index>(i));
          g.dV.row(rows[i]) = dvg.row(static_cast<Index>(i));
        }
      } else if (causal)
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
        py::arg("heads"), py::arg("causal"), py::arg("q_offsets"), py::arg("k_offsets"),
        py::arg("mask"));
  m.def("softmax_backward", &softmax_backward<Scalar>, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("dout"), py::arg("heads"), py::arg("causal"),
        py::arg("q_offsets"), py::arg("k_offsets"), py::arg("mask"));
}

}  // namespace

void register_softmax(py::module_& m) {
  register_softmax_scalar<float>(m);
  register_softmax_scalar<double>(m);
}

}  // namespace linattn_python
