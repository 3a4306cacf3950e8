// The reference of the delta rule (delta_rule_attention() and friends; spec §9.3): the per-token
// recurrence in long double, written from the spec, independent of the kernels (the only
// library code used is the feature map, through gref::features):
//   S_t = a_t (I − β_t k̂_t k̂_tᵀ) S_{t−1} + β_t k̂_t v_tᵀ,   out_t = s q̂_tᵀ S_t,
// with the product by (I − β k̂ k̂ᵀ) formed as a matrix (not the kernels' rank-1 form).
#pragma once

#include <Eigen/Core>

#include <cmath>
#include <stdexcept>

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

}  // namespace dref
