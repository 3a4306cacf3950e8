// Decay and gates (RetNet, Mamba-2, GLA) and the delta rule (DeltaNet, Gated DeltaNet), forward
// and backward, for one scalar type: included by gated_delta_f32.cpp and gated_delta_f64.cpp (one
// translation unit of both took 84 s at -O1, the module's longest). q, k, v packed N x (H·D) as
// elsewhere; per-token parameters packed N x H (one per head) or, for per-feature gates,
// N x (H·F).
#pragma once

#include <linattn/delta_rule.hpp>
#include <linattn/delta_rule_backward.hpp>
#include <linattn/elu_plus_one.hpp>
#include <linattn/gated_attention.hpp>
#include <linattn/gated_attention_backward.hpp>
#include <linattn/identity.hpp>
#include <linattn/l2_normalize.hpp>
#include <linattn/silu.hpp>

#include <optional>

#include "bindings.hpp"

namespace linattn_python {

template <class Fn>
void with_gated_map(const char* fn, const std::string& name, Fn&& f) {
  if (name == "identity") return f(linattn::Identity{});
  if (name == "elu") return f(linattn::EluPlusOne{});
  throw std::invalid_argument(std::string(fn) + ": unknown feature_map '" + name +
                              "' for the gated kernels (one of: identity, elu)");
}

// The delta rule's maps of q and k; eps: L2Normalize's (x / sqrt(|x|² + eps); FLA's 1e-6).
template <class Fn>
void with_delta_map(const char* fn, const std::string& name, double eps, Fn&& f) {
  if (name == "identity") {
    if (eps != 0)
      throw std::invalid_argument(std::string(fn) +
                                  ": l2norm_eps needs feature_map 'l2norm' or "
                                  "'l2norm_silu', got 'identity'");
    return f(linattn::Identity{});
  }
  if (name == "l2norm") return f(linattn::L2Normalize<linattn::Identity>(eps));
  if (name == "l2norm_silu") return f(linattn::L2Normalize<linattn::Silu>(linattn::Silu{}, eps));
  throw std::invalid_argument(std::string(fn) + ": unknown feature_map '" + name +
                              "' for the delta rule (one of: identity, l2norm, l2norm_silu)");
}

// A per-token parameter as a map: N x c, or N x 0 (an absent decay) when `a` is None.
template <class Scalar>
ConstRows<Scalar> params_of(const char* fn, const char* name, const std::optional<Array<Scalar>>& a,
                            Index rows) {
  if (!a) return ConstRows<Scalar>(nullptr, rows, 0);
  return rows_of(fn, name, *a);
}

template <class Scalar>
Array<Scalar> gated_forward(const Array<Scalar>& q, const Array<Scalar>& k,
                            const Array<Scalar>& v, const Array<Scalar>& log_gates, Index heads,
                            const std::string& map, double scale, bool normalize,
                            const std::optional<Offsets>& offsets) {
  const Operands<Scalar> x("gated_linear_attention", q, k, v, offsets, offsets);
  const auto G = rows_of(x.fn, "g", log_gates);
  linattn::GatedOptions opts;
  opts.scale = scale;
  opts.normalize = normalize;
  Array<Scalar> out = new_rows<Scalar>(x.Q.rows(), x.V.cols());
  auto O = rows_of(out);
  {
    Unlocked unlocked;
    with_gated_map(x.fn, map, [&](const auto& phi) {
      linattn::MultiHeadWorkspace<Scalar> ws;
      linattn::batched_gated_linear_attention(x.Q, x.K, x.V, G, x.q_offsets, heads, phi, O, ws,
                                              opts);
    });
  }
  return out;
}

template <class Scalar>
py::tuple gated_backward(const Array<Scalar>& q, const Array<Scalar>& k, const Array<Scalar>& v,
                         const Array<Scalar>& log_gates, const Array<Scalar>& dout, Index heads,
                         const std::string& map, double scale, bool normalize,
                         const std::optional<Offsets>& offsets) {
  const Operands<Scalar> x("gated_linear_attention_backward", q, k, v, offsets, offsets);
  const auto G = rows_of(x.fn, "g", log_gates);
  const auto dO = x.dout(dout);
  if (G.rows() != x.Q.rows())
    throw std::invalid_argument(std::string(x.fn) + ": g has " + std::to_string(G.rows()) +
                                " rows but q has " + std::to_string(x.Q.rows()));
  linattn::GatedOptions opts;
  opts.scale = scale;
  opts.normalize = normalize;
  Gradients<Scalar> g(x);
  Array<Scalar> dg = new_rows<Scalar>(G.rows(), G.cols());
  auto dG = rows_of(dg);
  {
    Unlocked unlocked;
    with_gated_map(x.fn, map, [&](const auto& phi) {
      linattn::MultiHeadWorkspace<Scalar> ws;
      x.each_sequence([&](Index q0, Index n, Index k0, Index l) {
        auto dq = g.dQ.middleRows(q0, n);
        auto dk = g.dK.middleRows(k0, l);
        auto dv = g.dV.middleRows(k0, l);
        auto dgs = dG.middleRows(q0, n);
        linattn::multihead_gated_linear_attention_backward(
            x.Q.middleRows(q0, n), x.K.middleRows(k0, l), x.V.middleRows(k0, l),
            G.middleRows(q0, n), dO.middleRows(q0, n), heads, phi, dq, dk, dv, dgs, ws, opts);
      });
    });
  }
  return py::make_tuple(g.dq, g.dk, g.dv, dg);
}

template <class Scalar>
Array<Scalar> delta_forward(const Array<Scalar>& q, const Array<Scalar>& k, const Array<Scalar>& v,
                            const Array<Scalar>& beta, const std::optional<Array<Scalar>>& log_a,
                            Index heads, const std::string& map, double scale,
                            const std::optional<Offsets>& offsets, double eps) {
  const Operands<Scalar> x("delta_rule_attention", q, k, v, offsets, offsets);
  const auto B = rows_of(x.fn, "beta", beta);
  const auto A = params_of(x.fn, "g", log_a, x.Q.rows());
  linattn::DeltaOptions opts;
  opts.scale = scale;
  Array<Scalar> out = new_rows<Scalar>(x.Q.rows(), x.V.cols());
  auto O = rows_of(out);
  {
    Unlocked unlocked;
    with_delta_map(x.fn, map, eps, [&](const auto& phi) {
      linattn::MultiHeadWorkspace<Scalar> ws;
      linattn::batched_delta_rule_attention(x.Q, x.K, x.V, B, A, x.q_offsets, heads, phi, O, ws,
                                            opts);
    });
  }
  return out;
}

template <class Scalar>
py::tuple delta_backward(const Array<Scalar>& q, const Array<Scalar>& k, const Array<Scalar>& v,
                         const Array<Scalar>& beta, const std::optional<Array<Scalar>>& log_a,
                         const Array<Scalar>& dout, Index heads, const std::string& map,
                         double scale, const std::optional<Offsets>& offsets, double eps) {
  const Operands<Scalar> x("delta_rule_attention_backward", q, k, v, offsets, offsets);
  const auto B = rows_of(x.fn, "beta", beta);
  const auto A = params_of(x.fn, "g", log_a, x.Q.rows());
  const auto dO = x.dout(dout);
  if (B.rows() != x.Q.rows() || A.rows() != x.Q.rows())
    throw std::invalid_argument(std::string(x.fn) + ": beta has " + std::to_string(B.rows()) +
                                " rows and g " + std::to_string(A.rows()) + " but q has " +
                                std::to_string(x.Q.rows()));
  linattn::DeltaOptions opts;
  opts.scale = scale;
  Gradients<Scalar> g(x);
  Array<Scalar> db = new_rows<Scalar>(B.rows(), B.cols());
  Array<Scalar> da = new_rows<Scalar>(A.rows(), A.cols());
  auto dB = rows_of(db);
  auto dA = rows_of(da);
  {
    Unlocked unlocked;
    with_delta_map(x.fn, map, eps, [&](const auto& phi) {
      linattn::MultiHeadWorkspace<Scalar> ws;
      x.each_sequence([&](Index q0, Index n, Index k0, Index l) {
        auto dq = g.dQ.middleRows(q0, n);
        auto dk = g.dK.middleRows(k0, l);
        auto dv = g.dV.middleRows(k0, l);
        auto dbs = dB.middleRows(q0, n);
        auto das = dA.middleRows(q0, n);
        linattn::multihead_delta_rule_attention_backward(
            x.Q.middleRows(q0, n), x.K.middleRows(k0, l), x.V.middleRows(k0, l),
            B.middleRows(q0, n), A.middleRows(q0, n), dO.middleRows(q0, n), heads, phi, dq, dk,
            dv, dbs, das, ws, opts);
      });
    });
  }
  py::object dg = log_a ? py::object(da) : py::none();
  return py::make_tuple(g.dq, g.dk, g.dv, db, dg);
}

template <class Scalar>
void register_gated_delta(py::module_& m) {
  m.def("gated_forward", &gated_forward<Scalar>, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("g"), py::arg("heads"), py::arg("feature_map"), py::arg("scale"),
        py::arg("normalize"), py::arg("offsets"));
  m.def("gated_backward", &gated_backward<Scalar>, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("g"), py::arg("dout"), py::arg("heads"), py::arg("feature_map"),
        py::arg("scale"), py::arg("normalize"), py::arg("offsets"));
  m.def("delta_forward", &delta_forward<Scalar>, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("beta"), py::arg("g"), py::arg("heads"), py::arg("feature_map"), py::arg("scale"),
        py::arg("offsets"), py::arg("eps") = 0.0);
  m.def("delta_backward", &delta_backward<Scalar>, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("beta"), py::arg("g"), py::arg("dout"), py::arg("heads"), py::arg("feature_map"),
        py::arg("scale"), py::arg("offsets"), py::arg("eps") = 0.0);
}

}  // namespace linattn_python
