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

// Packed rows of B sequences (offsets: B + 1 entries; none: one sequence of all rows): q and k
// N x (Hk·D), v N x (H·M) for H value heads over Hk = key_heads query/key heads (0: H), value
// head h reading key head h / (H / Hk) as the library's key_heads option pairs them.
template <class Scalar>
Array<Scalar> linear_forward(const Array<Scalar>& q, const Array<Scalar>& k,
                             const Array<Scalar>& v, Index heads, const std::string& map,
                             bool causal, const std::optional<Offsets>& q_offsets,
                             const std::optional<Offsets>& k_offsets,
                             const std::optional<KeyMask>& mask, Index key_heads) {
  const Operands<Scalar> x(causal ? "causal_linear_attention" : "linear_attention", q, k, v,
                           q_offsets, k_offsets);
  Array<Scalar> out = new_rows<Scalar>(x.Q.rows(), x.V.cols());
  auto O = rows_of(out);
  linattn::HeadOptions layout;
  layout.key_heads = key_heads;
  linattn::CausalOptions options;
  options.key_heads = key_heads;
  {
    Unlocked unlocked;
    with_feature_map(x.fn, map, [&](const auto& phi) {
      linattn::MultiHeadWorkspace<Scalar> ws;
      if (!causal && mask) {
        linattn::masked_batched_linear_attention(x.Q, x.K, x.V, x.q_offsets, x.k_offsets,
                                                 mask_of(*mask), heads, phi, O, ws, layout);
      } else if (!causal) {
        linattn::batched_linear_attention(x.Q, x.K, x.V, x.q_offsets, x.k_offsets, heads, phi, O,
                                          ws, layout);
      } else if (x.q_offsets == x.k_offsets && mask) {
        linattn::masked_batched_causal_linear_attention(x.Q, x.K, x.V, x.q_offsets,
                                                        mask_of(*mask), heads, phi, O, ws,
                                                        options);
      } else if (x.q_offsets == x.k_offsets) {
        linattn::batched_causal_linear_attention(x.Q, x.K, x.V, x.q_offsets, heads, phi, O, ws,
                                                 options);
      } else {
        throw std::invalid_argument(std::string(x.fn) +
                                    ": causal attention needs the same sequences for q and k");
      }
    });
  }
  return out;
}

// Hk, the query/key heads of `heads` value heads (key_heads 0: as many), checked against the
// operands' columns: q and k Hk·D, v H·M.
template <class Scalar>
Index shared_key_heads(const Operands<Scalar>& x, Index heads, Index key_heads) {
  const Index Hk = key_heads == 0 ? heads : key_heads;
  const auto counts = [&] {
    return " (heads H = " + std::to_string(heads) + ", key_heads Hk = " + std::to_string(key_heads) +
           "; q has " + std::to_string(x.Q.cols()) + " columns, v " + std::to_string(x.V.cols()) +
           ")";
  };
  if (heads <= 0 || Hk <= 0 || heads % Hk != 0)
    throw std::invalid_argument(std::string(x.fn) +
                                ": heads H must be a positive multiple of key_heads Hk" + counts());
  if (x.Q.cols() % Hk != 0 || x.V.cols() % heads != 0)
    throw std::invalid_argument(std::string(x.fn) +
                                ": q and k must hold Hk heads and v H heads" + counts());
  return Hk;
}

// The masked backward, head by head of each sequence (the library's masked gradients are
// single-head): the heads run one after the other on the calling thread. A shared query/key
// head's first value head writes its dq and dk, the others add theirs in order from scratch
// of the same block type (no further kernel instantiations), as the library's unmasked
// multi-head backward sums them.
template <class Scalar, class Phi>
void masked_linear_backward(const Operands<Scalar>& x, const ConstRows<Scalar>& G,
                            const MaskMap& keep, Index heads, Index key_heads, const Phi& phi,
                            bool causal, Gradients<Scalar>& g) {
  const Index Hk = shared_key_heads(x, heads, key_heads), group = heads / Hk;
  const Index D = x.Q.cols() / Hk, M = x.V.cols() / heads;
  if (keep.size() != x.K.rows())
    throw std::invalid_argument(std::string(x.fn) + ": the key mask has " +
                                std::to_string(keep.size()) + " entries but k has " +
                                std::to_string(x.K.rows()) + " rows");
  linattn::Workspace<Scalar> ws;
  RowMatrix<Scalar> sq, sk;
  if (group > 1) {
    sq.resize(x.Q.rows(), D);
    sk.resize(x.K.rows(), D);
  }
  x.each_sequence([&](Index q0, Index n, Index k0, Index l) {
    for (Index kh = 0; kh < Hk; ++kh) {
      const auto Qh = x.Q.block(q0, kh * D, n, D);
      const auto Kh = x.K.block(k0, kh * D, l, D);
      auto dQ = g.dQ.block(q0, kh * D, n, D);
      auto dK = g.dK.block(k0, kh * D, l, D);
      for (Index j = 0; j < group; ++j) {
        const Index h = kh * group + j;
        const auto Vh = x.V.block(k0, h * M, l, M);
        const auto Gh = G.block(q0, h * M, n, M);
        auto dV = g.dV.block(k0, h * M, l, M);
        const auto head = [&](auto& dq, auto& dk) {
          if (causal)
            linattn::masked_causal_linear_attention_backward(Qh, Kh, Vh, Gh, keep.segment(k0, l),
                                                             phi, dq, dk, dV, ws);
          else
            linattn::masked_linear_attention_backward(Qh, Kh, Vh, Gh, keep.segment(k0, l), phi,
                                                      dq, dk, dV, ws);
        };
        if (j == 0) {
          head(dQ, dK);
          continue;
        }
        Rows<Scalar> tq(sq.data(), n, D), tk(sk.data(), l, D);
        auto tqb = tq.block(0, 0, n, D);
        auto tkb = tk.block(0, 0, l, D);
        head(tqb, tkb);
        dQ += tqb;
        dK += tkb;
      }
    }
  });
}

// (dq, dk, dv) of linear_forward() for ∂L/∂out = dout, sequence by sequence; a shared
// query/key head's dq and dk are the sums over its value heads.
template <class Scalar>
py::tuple linear_backward(const Array<Scalar>& q, const Array<Scalar>& k, const Array<Scalar>& v,
                          const Array<Scalar>& dout, Index heads, const std::string& map,
                          bool causal, const std::optional<Offsets>& q_offsets,
                          const std::optional<Offsets>& k_offsets,
                          const std::optional<KeyMask>& mask, Index key_heads) {
  const Operands<Scalar> x(
      causal ? "causal_linear_attention_backward" : "linear_attention_backward", q, k, v,
      q_offsets, k_offsets);
  const auto G = x.dout(dout);
  Gradients<Scalar> g(x);
  linattn::HeadOptions layout;
  layout.key_heads = key_heads;
  linattn::CausalOptions options;
  options.key_heads = key_heads;
  {
    Unlocked unlocked;
    with_feature_map(x.fn, map, [&](const auto& phi) {
      if (mask)
        return masked_linear_backward(x, G, mask_of(*mask), heads, key_heads, phi, causal, g);
      linattn::MultiHeadWorkspace<Scalar> ws;
      x.each_sequence([&](Index q0, Index n, Index k0, Index l) {
        auto dq = g.dQ.middleRows(q0, n);
        auto dk = g.dK.middleRows(k0, l);
        auto dv = g.dV.middleRows(k0, l);
        if (causal)
          linattn::multihead_causal_linear_attention_backward(
              x.Q.middleRows(q0, n), x.K.middleRows(k0, l), x.V.middleRows(k0, l),
              G.middleRows(q0, n), heads, phi, dq, dk, dv, ws, options);
        else
          linattn::multihead_linear_attention_backward(
              x.Q.middleRows(q0, n), x.K.middleRows(k0, l), x.V.middleRows(k0, l),
              G.middleRows(q0, n), heads, phi, dq, dk, dv, ws, layout);
      });
    });
  }
  return g.tuple();
}

template <class Scalar>
void register_linear(py::module_& m) {
  // key_heads last, with a default: callers of the extension that predate shared heads still
  // pass the other arguments by position.
  m.def("linear_forward", &linear_forward<Scalar>, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("heads"), py::arg("feature_map"), py::arg("causal"), py::arg("q_offsets"),
        py::arg("k_offsets"), py::arg("mask"), py::arg("key_heads") = 0);
  m.def("linear_backward", &linear_backward<Scalar>, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("dout"), py::arg("heads"), py::arg("feature_map"), py::arg("causal"),
        py::arg("q_offsets"), py::arg("k_offsets"), py::arg("mask"), py::arg("key_heads") = 0);
}

}  // namespace linattn_python
