// Linear attention (non-causal and causal), forward and backward, for one scalar type: included
// by linear_f32.cpp and linear_f64.cpp, so that the two scalar types compile in parallel.
#pragma once

#include <linattn/elu_plus_one.hpp>
#include <linattn/identity.hpp>
#include <linattn/multihead.hpp>
#include <linattn/multihead_backward.hpp>
#include <linattn/normalized_cosine.hpp>
#include <linattn/silu.hpp>
#include <linattn/softmax_split.hpp>

#include <optional>

#include "bindings.hpp"

namespace linattn_python {

// fn(phi) with the feature map named `name` (the names of linattn.FEATURE_MAPS).
template <class Fn>
void with_feature_map(const char* fn, const std::string& name, Fn&& f) {
  if (name == "elu") return f(linattn::EluPlusOne{});
  if (name == "softmax_split") return f(linattn::SoftmaxSplit{});
  if (name == "cosine") return f(linattn::NormalizedCosine{});
  if (name == "silu") return f(linattn::Silu{});
  if (name == "identity") return f(linattn::Identity{});
  throw std::invalid_argument(std::string(fn) + ": unknown feature_map '" + name +
                              "' (one of: elu, softmax_split, cosine, silu, identity)");
}

// Packed rows N x (H·D) of B sequences (offsets: B + 1 entries; none: one sequence of all rows).
template <class Scalar>
Array<Scalar> linear_forward(const Array<Scalar>& q, const Array<Scalar>& k,
                             const Array<Scalar>& v, Index heads, const std::string& map,
                             bool causal, const std::optional<Offsets>& q_offsets,
                             const std::optional<Offsets>& k_offsets) {
  const char* fn = causal ? "causal_linear_attention" : "linear_attention";
  const auto Q = rows_of(fn, "q", q);
  const auto K = rows_of(fn, "k", k);
  const auto V = rows_of(fn, "v", v);
  const std::vector<Index> qo = q_offsets ? offsets_of(fn, *q_offsets, Q.rows())
                                          : std::vector<Index>{0, Q.rows()};
  const std::vector<Index> ko = k_offsets ? offsets_of(fn, *k_offsets, K.rows())
                                          : std::vector<Index>{0, K.rows()};
  Array<Scalar> out = new_rows<Scalar>(Q.rows(), V.cols());
  auto O = rows_of(out);
  {
    py::gil_scoped_release unlocked;
    with_feature_map(fn, map, [&](const auto& phi) {
      linattn::MultiHeadWorkspace<Scalar> ws;
      if (causal) {
        if (qo != ko)
          throw std::invalid_argument(std::string(fn) +
                                      ": causal attention needs the same sequences for q and k");
        linattn::batched_causal_linear_attention(Q, K, V, qo, heads, phi, O, ws);
      } else {
        linattn::batched_linear_attention(Q, K, V, qo, ko, heads, phi, O, ws);
      }
    });
  }
  return out;
}

// (dq, dk, dv) of linear_forward() for ∂L/∂out = dout, sequence by sequence.
template <class Scalar>
py::tuple linear_backward(const Array<Scalar>& q, const Array<Scalar>& k, const Array<Scalar>& v,
                          const Array<Scalar>& dout, Index heads, const std::string& map,
                          bool causal, const std::optional<Offsets>& q_offsets,
                          const std::optional<Offsets>& k_offsets) {
  const char* fn =
      causal ? "causal_linear_attention_backward" : "linear_attention_backward";
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
  if (G.rows() != Q.rows() || G.cols() != V.cols())
    throw std::invalid_argument(std::string(fn) + ": dout is " + std::to_string(G.rows()) +
                                " x " + std::to_string(G.cols()) + " but must be " +
                                std::to_string(Q.rows()) + " x " + std::to_string(V.cols()) +
                                " (the output's shape)");
  Array<Scalar> dq = new_rows<Scalar>(Q.rows(), Q.cols());
  Array<Scalar> dk = new_rows<Scalar>(K.rows(), K.cols());
  Array<Scalar> dv = new_rows<Scalar>(V.rows(), V.cols());
  auto dQ = rows_of(dq);
  auto dK = rows_of(dk);
  auto dV = rows_of(dv);
  {
    py::gil_scoped_release unlocked;
    with_feature_map(fn, map, [&](const auto& phi) {
      linattn::MultiHeadWorkspace<Scalar> ws;
      for (std::size_t b = 0; b + 1 < qo.size(); ++b) {
        const Index q0 = qo[b], n = qo[b + 1] - q0, k0 = ko[b], l = ko[b + 1] - k0;
        auto dqb = dQ.middleRows(q0, n);
        auto dkb = dK.middleRows(k0, l);
        auto dvb = dV.middleRows(k0, l);
        if (causal)
          linattn::multihead_causal_linear_attention_backward(
              Q.middleRows(q0, n), K.middleRows(k0, l), V.middleRows(k0, l),
              G.middleRows(q0, n), heads, phi, dqb, dkb, dvb, ws);
        else
          linattn::multihead_linear_attention_backward(
              Q.middleRows(q0, n), K.middleRows(k0, l), V.middleRows(k0, l),
              G.middleRows(q0, n), heads, phi, dqb, dkb, dvb, ws);
      }
    });
  }
  return py::make_tuple(dq, dk, dv);
}

template <class Scalar>
void register_linear(py::module_& m) {
  m.def("linear_forward", &linear_forward<Scalar>, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("heads"), py::arg("feature_map"), py::arg("causal"), py::arg("q_offsets"),
        py::arg("k_offsets"));
  m.def("linear_backward", &linear_backward<Scalar>, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("dout"), py::arg("heads"), py::arg("feature_map"), py::arg("causal"),
        py::arg("q_offsets"), py::arg("k_offsets"));
}

}  // namespace linattn_python
