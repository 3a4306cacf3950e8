// Linear attention (non-causal and causal), forward and backward, for one scalar type: included
// by linear_f32.cpp and linear_f64.cpp, so that the two scalar types compile in parallel.
#pragma once

#include <linattn/dpfp.hpp>
#include <linattn/elu_plus_one.hpp>
#include <linattn/identity.hpp>
#include <linattn/linear_attention_backward.hpp>
#include <linattn/multihead.hpp>
#include <linattn/multihead_backward.hpp>
#include <linattn/normalized_cosine.hpp>
#include <linattn/relu.hpp>
#include <linattn/silu.hpp>
#include <linattn/softmax_split.hpp>
#include <linattn/taylor2.hpp>

#include <optional>

#include "bindings.hpp"

namespace linattn_python {

// fn(phi) with the feature map named `name` (the names of linattn.FEATURE_MAPS). Each map costs
// the module little compile time: the kernels see every map through the library's erased map
// (linattn/detail/erased_map.hpp) and are compiled once for all product maps.
template <class Fn>
void with_feature_map(const char* fn, const std::string& name, Fn&& f) {
  if (name == "elu") return f(linattn::EluPlusOne{});
  if (name == "softmax_split") return f(linattn::SoftmaxSplit{});
  if (name == "cosine") return f(linattn::NormalizedCosine{});
  if (name == "silu") return f(linattn::Silu{});
  if (name == "identity") return f(linattn::Identity{});
  if (name == "relu") return f(linattn::Relu{});
  if (name == "dpfp") return f(linattn::Dpfp(1));
  if (name == "dpfp2") return f(linattn::Dpfp(2));
  if (name == "dpfp3") return f(linattn::Dpfp(3));
  if (name == "taylor2") return f(linattn::Taylor2{});
  throw std::invalid_argument(std::string(fn) + ": unknown feature_map '" + name +
                              "' (one of: elu, softmax_split, cosine, silu, identity, relu, dpfp, "
                              "dpfp2, dpfp3, taylor2)");
}

// Packed rows N x (H·D) of B sequences (offsets: B + 1 entries; none: one sequence of all rows).
template <class Scalar>
Array<Scalar> linear_forward(const Array<Scalar>& q, const Array<Scalar>& k,
                             const Array<Scalar>& v, Index heads, const std::string& map,
                             bool causal, const std::optional<Offsets>& q_offsets,
                             const std::optional<Offsets>& k_offsets,
                             const std::optional<KeyMask>& mask) {
  const Operands<Scalar> x(causal ? "causal_linear_attention" : "linear_attention", q, k, v,
                           q_offsets, k_offsets);
  Array<Scalar> out = new_rows<Scalar>(x.Q.rows(), x.V.cols());
  auto O = rows_of(out);
  {
    Unlocked unlocked;
    with_feature_map(x.fn, map, [&](const auto& phi) {
      linattn::MultiHeadWorkspace<Scalar> ws;
      if (!causal && mask) {
        linattn::masked_batched_linear_attention(x.Q, x.K, x.V, x.q_offsets, x.k_offsets,
                                                 mask_of(*mask), heads, phi, O, ws);
      } else if (!causal) {
        linattn::batched_linear_attention(x.Q, x.K, x.V, x.q_offsets, x.k_offsets, heads, phi, O,
                                          ws);
      } else if (x.q_offsets == x.k_offsets && mask) {
        linattn::masked_batched_causal_linear_attention(x.Q, x.K, x.V, x.q_offsets,
                                                        mask_of(*mask), heads, phi, O, ws);
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

// The masked backward, head by head of each sequence (the library's masked gradients are
// single-head): the heads run one after the other on the calling thread.
template <class Scalar, class Phi>
void masked_linear_backward(const Operands<Scalar>& x, const ConstRows<Scalar>& G,
                            const MaskMap& keep, Index heads, const Phi& phi, bool causal,
                            Gradients<Scalar>& g) {
  const Index D = x.Q.cols() / heads, M = x.V.cols() / heads;
  if (keep.size() != x.K.rows())
    throw std::invalid_argument(std::string(x.fn) + ": the key mask has " +
                                std::to_string(keep.size()) + " entries but k has " +
                                std::to_string(x.K.rows()) + " rows");
  linattn::Workspace<Scalar> ws;
  x.each_sequence([&](Index q0, Index n, Index k0, Index l) {
    for (Index h = 0; h < heads; ++h) {
      const auto Qh = x.Q.block(q0, h * D, n, D);
      const auto Kh = x.K.block(k0, h * D, l, D);
      const auto Vh = x.V.block(k0, h * M, l, M);
      const auto Gh = G.block(q0, h * M, n, M);
      auto dQ = g.dQ.block(q0, h * D, n, D);
      auto dK = g.dK.block(k0, h * D, l, D);
      auto dV = g.dV.block(k0, h * M, l, M);
      if (causal)
        linattn::masked_causal_linear_attention_backward(Qh, Kh, Vh, Gh, keep.segment(k0, l), phi,
                                                         dQ, dK, dV, ws);
      else
        linattn::masked_linear_attention_backward(Qh, Kh, Vh, Gh, keep.segment(k0, l), phi, dQ,
                                                  dK, dV, ws);
    }
  });
}

// (dq, dk, dv) of linear_forward() for ∂L/∂out = dout, sequence by sequence.
template <class Scalar>
py::tuple linear_backward(const Array<Scalar>& q, const Array<Scalar>& k, const Array<Scalar>& v,
                          const Array<Scalar>& dout, Index heads, const std::string& map,
                          bool causal, const std::optional<Offsets>& q_offsets,
                          const std::optional<Offsets>& k_offsets,
                          const std::optional<KeyMask>& mask) {
  const Operands<Scalar> x(
      causal ? "causal_linear_attention_backward" : "linear_attention_backward", q, k, v,
      q_offsets, k_offsets);
  const auto G = x.dout(dout);
  Gradients<Scalar> g(x);
  {
    Unlocked unlocked;
    with_feature_map(x.fn, map, [&](const auto& phi) {
      if (mask) return masked_linear_backward(x, G, mask_of(*mask), heads, phi, causal, g);
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
        py::arg("k_offsets"), py::arg("mask"));
  m.def("linear_backward", &linear_backward<Scalar>, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("dout"), py::arg("heads"), py::arg("feature_map"), py::arg("causal"),
        py::arg("q_offsets"), py::arg("k_offsets"), py::arg("mask"));
}

}  // namespace linattn_python
