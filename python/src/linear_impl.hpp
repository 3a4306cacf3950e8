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
  const Operands<Scalar> x(causal ? "causal_linear_attention" : "linear_attention", q, k, v,
                           q_offsets, k_offsets);
  Array<Scalar> out = new_rows<Scalar>(x.Q.rows(), x.V.cols());
  auto O = rows_of(out);
  {
    py::gil_scoped_release unlocked;
    with_feature_map(x.fn, map, [&](const auto& phi) {
      linattn::MultiHeadWorkspace<Scalar> ws;
      if (!causal) {
        linattn::batched_linear_attention(x.Q, x.K, x.V, x.q_offsets, x.k_offsets, heads, phi, O,
                                          ws);
      } else if (x.q_offsets == x.k_offsets) {
        linattn::batched_causal_linear_attention(x.Q, x.K, x.V, x.q_offsets, heads, phi, O, ws);
      } else {
        throw std::invalid_argument(std::string(x.fn) +
                                    ": causal attention needs the same sequences for q and k");
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
  const Operands<Scalar> x(
      causal ? "causal_linear_attention_backward" : "linear_attention_backward", q, k, v,
      q_offsets, k_offsets);
  const auto G = x.dout(dout);
  Gradients<Scalar> g(x);
  {
    py::gil_scoped_release unlocked;
    with_feature_map(x.fn, map, [&](const auto& phi) {
      linattn::MultiHeadWorkspace<Scalar> ws;
      x.each_sequence([&](Index q0, Index n, Index k0, Index l) {
        auto dq = g.dQ.middleRows(q0, n);
        auto dk = g.dK.middleRows(k0, l);
        auto dv = g.dV.middleRows(k0, l);
        if (causal)
          linattn::multihead_causal_linear_attention_backward(
              x.Q.middleRows(q0, n), x.K.middleRows(k0, l), x.V.middleRows(k0, l),
              G.middleRows(q0, n), heads, phi, dq, dk, dv, ws);
        else
          linattn::multihead_linear_attention_backward(
              x.Q.middleRows(q0, n), x.K.middleRows(k0, l), x.V.middleRows(k0, l),
              G.middleRows(q0, n), heads, phi, dq, dk, dv, ws);
      });
    });
  }
  return g.tuple();
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
