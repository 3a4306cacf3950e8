// The reference of the delta rule (delta_rule_attention() and friends; spec §9.3): the per-token
// recurrence in long double, written from the spec, independent of the kernels (the only
// library code used is the feature map, through gref::features):
//   S_t = a_t (I − β_t k̂_t k̂_tᵀ) S_{t−1} + β_t k̂_t v_tᵀ,   out_t = s q̂_tᵀ S_t,
// with the product by (I − β k̂ k̂ᵀ) formed as a matrix (not the kernels' rank-1 form).
#pragma once

#include <Eigen/Core>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "gated_reference.hpp"

namespace dref {

using Index = Eigen::Index;
using Mat = Eigen::MatrixXd;
using Vec = Eigen::VectorXd;
using LD = long double;
using LMat = Eigen::Matrix<long double, Eigen::Dynamic, Eigen::Dynamic>;
using LVec = Eigen::Matrix<long double, Eigen::Dynamic, 1>;

/// The recurrence from features (N x F each). log_a of size 0: no decay. `S`, if given, is the
/// initial state (empty: zero) and receives the final one.
inline Mat recurrence_from_features(const Mat& PQ, const Mat& PK, const Mat& V, const Vec& beta,
                                    const Vec& log_a, double scale, Mat* S = nullptr) {
  const Index N = PQ.rows(), F = PQ.cols(), M = V.cols();
  if (PK.rows() != N || PK.cols() != F || V.rows() != N || beta.size() != N ||
      (log_a.size() != 0 && log_a.size() != N))
    throw std::logic_error("dref: inconsistent reference inputs");
  LMat St = (S != nullptr && S->size() != 0) ? LMat(S->cast<LD>()) : LMat(LMat::Zero(F, M));
  const LMat I = LMat::Identity(F, F);
  Mat out(N, M);
  for (Index t = 0; t < N; ++t) {
    const LD a = log_a.size() ? std::exp(static_cast<LD>(log_a(t))) : LD(1);
    const LD b = beta(t);
    const LVec k = PK.row(t).transpose().cast<LD>();
    const LVec q = PQ.row(t).transpose().cast<LD>();
    const LVec v = V.row(t).transpose().cast<LD>();
    const LMat P = a * (I - b * k * k.transpose());
    St = (P * St + b * k * v.transpose()).eval();
    const LVec o = static_cast<LD>(scale) * (St.transpose() * q);
    for (Index c = 0; c < M; ++c) out(t, c) = static_cast<double>(o(c));
  }
  if (S != nullptr) *S = St.cast<double>();
  return out;
}

/// The recurrence from inputs, the map applied in double.
template <class Phi>
Mat recurrence(const Phi& phi, const Mat& Q, const Mat& K, const Mat& V, const Vec& beta,
               const Vec& log_a, double scale, Mat* S = nullptr) {
  return recurrence_from_features(gref::features(phi, Q), gref::features(phi, K), V, beta, log_a,
                                  scale, S);
}

/// Gradients of L = Σ out ∘ W (W = ∂L/∂out) and of ⟨dS_final, S_N⟩ through the recurrence, by
/// the token-level chain rule in long double (every state kept; a test-size reference):
///   S_t = a S_{t−1} + k̂ δᵀ, δ = β (v − a u), u = S_{t−1}ᵀ k̂, out_t = s q̂ᵀ S_t.
struct Gradients {
  Mat dQ, dK, dV;  // dQ, dK with respect to φ's inputs
  Vec dbeta, dlog_a;
  Mat dS0;
};

template <class Phi>
Gradients backward(const Phi& phi, const Mat& Q, const Mat& K, const Mat& V, const Vec& beta,
                   const Vec& log_a, double scale, const Mat& W, const Mat& S0 = Mat(),
                   const Mat& dS_final = Mat()) {
  const Mat PQ = gref::features(phi, Q), PK = gref::features(phi, K);
  const Index N = Q.rows(), F = PQ.cols(), M = V.cols();
  std::vector<LMat> S(static_cast<std::size_t>(N + 1));
  S[0] = S0.size() ? LMat(S0.cast<LD>()) : LMat(LMat::Zero(F, M));
  const auto decay = [&](Index t) {
    return log_a.size() ? std::exp(static_cast<LD>(log_a(t))) : LD(1);
  };
  for (Index t = 0; t < N; ++t) {
    const LVec k = PK.row(t).transpose().cast<LD>();
    const LVec v = V.row(t).transpose().cast<LD>();
    const LD a = decay(t), b = beta(t);
    const LVec u = S[t].transpose() * k;
    const LVec delta = b * (v - a * u);
    S[t + 1] = a * S[t] + k * delta.transpose();
  }
  LMat dS = dS_final.size() ? LMat(dS_final.cast<LD>()) : LMat(LMat::Zero(F, M));
  Mat dPQ(N, F), dPK(N, F);
  Gradients g;
  g.dV.resize(N, M);
  g.dbeta.resize(N);
  g.dlog_a.resize(log_a.size());
  const LD s = scale;
  for (Index t = N - 1; t >= 0; --t) {
    const LVec q = PQ.row(t).transpose().cast<LD>();
    const LVec k = PK.row(t).transpose().cast<LD>();
    const LVec v = V.row(t).transpose().cast<LD>();
    const LVec w = W.row(t).transpose().cast<LD>();
    const LD a = decay(t), b = beta(t);
    const LMat& Sp = S[static_cast<std::size_t>(t)];
    const LMat& St = S[static_cast<std::size_t>(t + 1)];
    const LVec dq = s * (St * w);
    dS += s * q * w.transpose();
    const LVec u = Sp.transpose() * k;
    const LVec delta = b * (v - a * u);
    const LVec ddelta = dS.transpose() * k;
    LVec dk = dS * delta;
    const LVec dv = b * ddelta;
    const LD db = ddelta.dot(v - a * u);
    const LVec du = -b * a * ddelta;
    dk += Sp * du;
    const LD da = (dS.cwiseProduct(Sp)).sum() - b * ddelta.dot(u);
    dS = (a * dS + k * du.transpose()).eval();
    for (Index d = 0; d < F; ++d) {
      dPQ(t, d) = static_cast<double>(dq(d));
      dPK(t, d) = static_cast<double>(dk(d));
    }
    for (Index c = 0; c < M; ++c) g.dV(t, c) = static_cast<double>(dv(c));
    g.dbeta(t) = static_cast<double>(db);
    if (log_a.size()) g.dlog_a(t) = static_cast<double>(a * da);
  }
  g.dQ.resize(N, Q.cols());
  g.dK.resize(N, K.cols());
  if (N > 0) {
    phi.backward(Q, dPQ, g.dQ);
    phi.backward(K, dPK, g.dK);
  }
  g.dS0 = dS.cast<double>();
  return g;
}

}  // namespace dref
