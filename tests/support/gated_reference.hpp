// References for the decayed and gated kernels (gated_linear_attention() and friends; spec §9.1,
// §9.2, §9.4) and a finite-difference helper for their gradients (test_gated.cpp,
// test_gated_backward.cpp).
//
// Written from the spec, independent of the kernels: the only library code used is the feature
// maps (φ computed by phi.map on a double matrix). Both references run in long double:
//  - recurrence(): the per-token recurrence S_t = diag(exp(g_t)) S_{t-1} + φk_t v_tᵀ (a scalar
//    gate is the same for every feature), z likewise, out_t = s φq_tᵀ S_t, or with normalize
//    out_t = φq_tᵀ S_t / φq_tᵀ z_t, 0 where that denominator is below the smallest positive
//    normal double (spec §2, "Denominators");
//  - quadratic(): the O(N²) form out_i = s Σ_{j≤i} (Σ_d φq_id φk_jd exp(G_id − G_jd)) v_j with the
//    exponent built as the sum of the gates of the tokens j < l ≤ i (never exp of a whole
//    sequence's sum), plus s Σ_d φq_id exp(G_id) S0[d,:] for an initial state (S0, z0).
// The two are checked against each other (test gated_reference.*). For gradients:
//  - dlog_gates(): ∂L/∂log_gates of L = Σ out ∘ W analytically, every term formed directly
//    (exact where the gradient is tiny, as under strong gates, where finite differences are not);
//  - gradient() / finite_difference(): central differences in double of L through a reference.
#pragma once

#include <linattn/linattn.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "test_util.hpp"

namespace gref {

using Index = Eigen::Index;
using Mat = Eigen::MatrixXd;
using Vec = Eigen::VectorXd;
using LD = long double;
using LMat = Eigen::Matrix<long double, Eigen::Dynamic, Eigen::Dynamic>;
using LVec = Eigen::Matrix<long double, Eigen::Dynamic, 1>;

/// The options of the references (those of linattn::GatedOptions that change the result).
struct Options {
  bool normalize = false;
  double scale = 1.0;
};

/// A state of the references, in double. S (F x M) and z (F) empty mean zero; log_decay is the
/// column sum of every gate absorbed (1 entry for scalar gates, F for per-feature gates).
struct State {
  Mat S;
  Vec z;
  Vec log_decay;
  bool empty() const { return S.size() == 0 && z.size() == 0; }
};

/// φ(X) in double through the library's map (N x F).
template <class Phi>
Mat features(const Phi& phi, const Mat& X) {
  Mat P(X.rows(), phi.feature_dim(X.cols()));
  if (X.rows() > 0 && P.cols() > 0) phi.map(X, P);
  return P;
}

namespace detail {

// The gate of feature d at token t: a scalar gate (one column) is the same for every feature.
inline double gate(const Mat& G, Index t, Index d) { return G.cols() == 1 ? G(t, 0) : G(t, d); }

inline void check_shapes(const Mat& PQ, const Mat& PK, const Mat& V, const Mat& G) {
  const Index N = PQ.rows(), F = PQ.cols();
  if (PK.rows() != N || PK.cols() != F || V.rows() != N || G.rows() != N ||
      (G.cols() != 1 && G.cols() != F))
    throw std::logic_error("gref: inconsistent reference inputs");
}

// The guarded quotient of the normalised form: a denominator below the smallest positive normal
// double (zero, subnormal, negative) gives 0.
inline LD guarded_ratio(LD num, LD den) {
  return den < static_cast<LD>(std::numeric_limits<double>::min()) ? LD(0) : num / den;
}

}  // namespace detail

/// The per-token recurrence from features (N x F each), long double. `state`, if given, is the
/// initial state (empty = zero) and receives the final one (S, z and log_decay += column sums).
inline Mat recurrence_from_features(const Mat& PQ, const Mat& PK, const Mat& V, const Mat& G,
                                    const Options& o, State* state = nullptr) {
  detail::check_shapes(PQ, PK, V, G);
  const Index N = PQ.rows(), F = PQ.cols(), M = V.cols();
  LMat S = LMat::Zero(F, M);
  LVec z = LVec::Zero(F);
  if (state != nullptr && !state->empty()) {
    S = state->S.cast<LD>();
    z = state->z.size() == F ? LVec(state->z.cast<LD>()) : LVec(LVec::Zero(F));
  }
  Mat out(N, M);
  LVec a(F);
  for (Index t = 0; t < N; ++t) {
    for (Index d = 0; d < F; ++d) a(d) = std::exp(static_cast<LD>(detail::gate(G, t, d)));
    const LVec pk = PK.row(t).transpose().cast<LD>();
    const LVec pq = PQ.row(t).transpose().cast<LD>();
    const Eigen::Matrix<LD, 1, Eigen::Dynamic> v = V.row(t).cast<LD>();
    for (Index d = 0; d < F; ++d) {
      S.row(d) = a(d) * S.row(d) + pk(d) * v;
      z(d) = a(d) * z(d) + pk(d);
    }
    const Eigen::Matrix<LD, 1, Eigen::Dynamic> num = pq.transpose() * S;
    if (o.normalize) {
      const LD den = pq.dot(z);
      for (Index c = 0; c < M; ++c) out(t, c) = static_cast<double>(detail::guarded_ratio(num(c), den));
    } else {
      for (Index c = 0; c < M; ++c) out(t, c) = static_cast<double>(static_cast<LD>(o.scale) * num(c));
    }
  }
  if (state != nullptr) {
    state->S = S.cast<double>();
    state->z = z.cast<double>();
    Vec sums = G.colwise().sum().transpose();
    if (state->log_decay.size() == sums.size()) sums += state->log_decay;
    state->log_decay = sums;
  }
  return out;
}

/// The O(N²) form from features, long double. `initial` (empty = zero) is the state the sequence
/// starts from; `den`, if given, receives φq_iᵀ z_i of every row (the denominator of the
/// normalised form, whether or not `o.normalize`).
inline Mat quadratic_from_features(const Mat& PQ, const Mat& PK, const Mat& V, const Mat& G,
                                   const Options& o, const State* initial = nullptr,
                                   Vec* den = nullptr) {
  detail::check_shapes(PQ, PK, V, G);
  const Index N = PQ.rows(), F = PQ.cols(), M = V.cols();
  const bool has_initial = initial != nullptr && !initial->empty();
  const LMat S0 = has_initial ? LMat(initial->S.cast<LD>()) : LMat::Zero(F, M);
  const LVec z0 = has_initial && initial->z.size() == F ? LVec(initial->z.cast<LD>())
                                                         : LVec(LVec::Zero(F));
  Mat out(N, M);
  if (den != nullptr) den->resize(N);
  LVec c(F), w(F);
  Eigen::Matrix<LD, 1, Eigen::Dynamic> num(M);
  for (Index i = 0; i < N; ++i) {
    c.setZero();  // Σ_{j<l≤i} g_l, per feature
    num.setZero();
    LD dsum = 0;
    for (Index j = i; j >= 0; --j) {
      if (j < i)
        for (Index d = 0; d < F; ++d) c(d) += detail::gate(G, j + 1, d);
      LD sim = 0;
      for (Index d = 0; d < F; ++d)
        sim += static_cast<LD>(PQ(i, d)) * static_cast<LD>(PK(j, d)) * std::exp(c(d));
      num += sim * V.row(j).cast<LD>();
      dsum += sim;
    }
    if (has_initial) {  // exp(G_i) = exp(Σ_{0≤l≤i} g_l)
      for (Index d = 0; d < F; ++d)
        w(d) = static_cast<LD>(PQ(i, d)) * std::exp(c(d) + detail::gate(G, 0, d));
      num += w.transpose() * S0;
      dsum += w.dot(z0);
    }
    if (den != nullptr) (*den)(i) = static_cast<double>(dsum);
    for (Index m = 0; m < M; ++m)
      out(i, m) = static_cast<double>(o.normalize ? detail::guarded_ratio(num(m), dsum)
                                                  : static_cast<LD>(o.scale) * num(m));
  }
  return out;
}

/// The recurrence with the map applied in double.
template <class Phi>
Mat recurrence(const Mat& Q, const Mat& K, const Mat& V, const Mat& G, const Phi& phi,
               const Options& o, State* state = nullptr) {
  return recurrence_from_features(features(phi, Q), features(phi, K), V, G, o, state);
}

/// The O(N²) form with the map applied in double.
template <class Phi>
Mat quadratic(const Mat& Q, const Mat& K, const Mat& V, const Mat& G, const Phi& phi,
              const Options& o, const State* initial = nullptr, Vec* den = nullptr) {
  return quadratic_from_features(features(phi, Q), features(phi, K), V, G, o, initial, den);
}

/// The final state of a sequence (from `initial`, empty = zero), by the recurrence.
template <class Phi>
State final_state(const Mat& Q, const Mat& K, const Mat& V, const Mat& G, const Phi& phi,
                  const Options& o, const State& initial = State{}) {
  State s = initial;
  recurrence(Q, K, V, G, phi, o, &s);
  return s;
}

/// ∂L/∂log_gates of L = Σ out ∘ W for the O(N²) form, analytically, in long double (N x 1 or
/// N x F, as G). Gate g_l enters every pair j < l ≤ i through exp(C_ijd), C_ijd = Σ_{j<l'≤i} g_l'd,
/// and the initial state's term of every row i ≥ l through exp(G_id), so
///   ∂L/∂g_ld = Σ_{i≥l} [ Σ_{j<l} ω_ij φq_id φk_jd exp(C_ijd) + φq_id exp(G_id) (γ_i·S0[d,:] + δ_i z0_d) ],
/// with ω_ij = γ_i·v_j + δ_i, γ_i = s W_i, δ_i = 0 (unnormalised) or γ_i = W_i / den_i,
/// δ_i = −(W_i·num_i) / den_i² (normalised; 0 on a guarded row). Summed over d for a scalar
/// gate. Every term is formed directly (O(N³·F)): no difference of large sums, so the result is
/// exact to long double rounding even where it is tiny (strong gates), unlike finite
/// differences. For tests with N up to about 100.
inline Mat dlog_gates_from_features(const Mat& PQ, const Mat& PK, const Mat& V, const Mat& G,
                                    const Mat& W, const Options& o,
                                    const State* initial = nullptr) {
  detail::check_shapes(PQ, PK, V, G);
  const Index N = PQ.rows(), F = PQ.cols(), M = V.cols();
  const bool has_initial = initial != nullptr && !initial->empty();
  const LMat S0 = has_initial ? LMat(initial->S.cast<LD>()) : LMat::Zero(F, M);
  const LVec z0 = has_initial && initial->z.size() == F ? LVec(initial->z.cast<LD>())
                                                         : LVec(LVec::Zero(F));
  // decay(i, j, d) = exp(C_ijd) for j < i; Gi(i, d) = Σ_{l≤i} g_ld.
  std::vector<LMat> decay(static_cast<std::size_t>(N), LMat::Zero(N, F));
  LMat Gi(N, F);
  for (Index i = 0; i < N; ++i) {
    LVec c = LVec::Zero(F);
    for (Index j = i - 1; j >= 0; --j) {
      for (Index d = 0; d < F; ++d) c(d) += detail::gate(G, j + 1, d);
      for (Index d = 0; d < F; ++d) decay[static_cast<std::size_t>(i)](j, d) = std::exp(c(d));
    }
    for (Index d = 0; d < F; ++d) Gi(i, d) = c(d) + detail::gate(G, 0, d);
  }
  // γ_i (M) and δ_i per row.
  LMat gamma(N, M);
  LVec delta = LVec::Zero(N);
  for (Index i = 0; i < N; ++i) {
    const Eigen::Matrix<LD, 1, Eigen::Dynamic> w = W.row(i).cast<LD>();
    if (!o.normalize) {
      gamma.row(i) = static_cast<LD>(o.scale) * w;
      continue;
    }
    Eigen::Matrix<LD, 1, Eigen::Dynamic> num = Eigen::Matrix<LD, 1, Eigen::Dynamic>::Zero(M);
    LD den = 0;
    for (Index j = 0; j <= i; ++j) {
      LD sim = 0;
      for (Index d = 0; d < F; ++d)
        sim += static_cast<LD>(PQ(i, d)) * static_cast<LD>(PK(j, d)) *
               (j == i ? LD(1) : decay[static_cast<std::size_t>(i)](j, d));
      num += sim * V.row(j).cast<LD>();
      den += sim;
    }
    for (Index d = 0; d < F; ++d) {
      const LD e = static_cast<LD>(PQ(i, d)) * std::exp(Gi(i, d));
      num += e * S0.row(d);
      den += e * z0(d);
    }
    if (den < static_cast<LD>(std::numeric_limits<double>::min())) {
      gamma.row(i).setZero();
      continue;
    }
    gamma.row(i) = w / den;
    delta(i) = -w.dot(num) / (den * den);
  }
  LMat dG = LMat::Zero(N, F);
  for (Index i = 0; i < N; ++i) {
    const LMat& dec = decay[static_cast<std::size_t>(i)];
    for (Index j = 0; j < i; ++j) {
      const LD omega = gamma.row(i).dot(V.row(j).cast<LD>()) + delta(i);
      for (Index d = 0; d < F; ++d) {
        const LD t = omega * static_cast<LD>(PQ(i, d)) * static_cast<LD>(PK(j, d)) * dec(j, d);
        for (Index l = j + 1; l <= i; ++l) dG(l, d) += t;
      }
    }
    if (has_initial)
      for (Index d = 0; d < F; ++d) {
        const LD t = static_cast<LD>(PQ(i, d)) * std::exp(Gi(i, d)) *
                     (gamma.row(i).dot(S0.row(d)) + delta(i) * z0(d));
        for (Index l = 0; l <= i; ++l) dG(l, d) += t;
      }
  }
  if (G.cols() == 1) return dG.rowwise().sum().cast<double>();
  return dG.cast<double>();
}

/// The analytic ∂L/∂log_gates with the map applied in double.
template <class Phi>
Mat dlog_gates(const Mat& Q, const Mat& K, const Mat& V, const Mat& G, const Mat& W,
               const Phi& phi, const Options& o, const State* initial = nullptr) {
  return dlog_gates_from_features(features(phi, Q), features(phi, K), V, G, W, o, initial);
}

// -------------------------------------------------------------------------------------------
// Finite differences
// -------------------------------------------------------------------------------------------

/// Central differences in double of a scalar function of a matrix, entry by entry, step
/// h = rel_step · max(1, |x|).
inline Mat gradient(const std::function<double(const Mat&)>& loss, const Mat& X,
                    double rel_step = 1e-5) {
  Mat x = X;
  Mat grad(x.rows(), x.cols());
  for (Index c = 0; c < x.cols(); ++c)
    for (Index r = 0; r < x.rows(); ++r) {
      const double x0 = x(r, c), h = rel_step * std::max(1.0, std::abs(x0));
      x(r, c) = x0 + h;
      const double up = loss(x);
      x(r, c) = x0 - h;
      const double down = loss(x);
      x(r, c) = x0;
      grad(r, c) = (up - down) / (2 * h);
    }
  return grad;
}

/// A forward out = f(Q, K, V, log_gates).
using Forward = std::function<Mat(const Mat&, const Mat&, const Mat&, const Mat&)>;

/// ∂L/∂X by central differences of L = Σ f(Q, K, V, G) ∘ W, for X = Q (which = 0), K (1),
/// V (2) or the log gates G (3). The gates may leave (−∞, 0] by a step: the references accept
/// any finite gate.
inline Mat finite_difference(const Forward& f, const Mat& Q, const Mat& K, const Mat& V,
                             const Mat& G, const Mat& W, int which, double rel_step = 1e-5) {
  const auto loss = [&](const Mat& x) {
    const Mat out = f(which == 0 ? x : Q, which == 1 ? x : K, which == 2 ? x : V,
                      which == 3 ? x : G);
    return out.cwiseProduct(W).sum();
  };
  const Mat* inputs[] = {&Q, &K, &V, &G};
  return gradient(loss, *inputs[which], rel_step);
}

/// max |a − b| / max |b|, or +inf on a shape mismatch or a non-finite entry.
inline double relative_error(const test::CRefD& a, const test::CRefD& b) {
  return test::max_abs_diff(a, b) / std::max(test::max_abs(b), 1e-300);
}

/// The maps the gated tests run, by name; EluPlusOne is tested in the normalised form (its use
/// with gates), the others unnormalised.
inline const char* map_name(const linattn::Identity&) { return "Identity"; }
inline const char* map_name(const linattn::Silu&) { return "Silu"; }
inline const char* map_name(const linattn::L2Normalize<linattn::Silu>&) { return "L2Normalize<Silu>"; }
inline const char* map_name(const linattn::EluPlusOne&) { return "EluPlusOne"; }
template <class Phi>
bool normalizes(const Phi&) {
  return std::is_same_v<Phi, linattn::EluPlusOne>;
}

}  // namespace gref
