// Helpers of the delta-rule layers' tests (Gated DeltaNet, KDA), whose references are written
// out token by token in long double: the activations, the inputs, and the row-relative error
// the accuracy targets are stated in.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "test_util.hpp"

namespace test::layer_ref {

using LD = long double;
using MatL = Eigen::Matrix<LD, Eigen::Dynamic, Eigen::Dynamic>;

inline LD silu(LD x) { return x / (1 + std::exp(-x)); }
inline LD sigmoid(LD x) { return 1 / (1 + std::exp(-x)); }
inline LD softplus(LD x) { return x > 20 ? x : std::log1p(std::exp(x)); }

// N x d inputs in [−1, 1], drawn in double and rounded once to S.
template <class S>
Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic> inputs(Index N, Index d, std::uint32_t seed) {
  return test::random_matrix<double>(N, d, seed).template cast<S>();
}

// The largest error of a row relative to the row's magnitude.
template <class D>
double row_error(const Eigen::MatrixBase<D>& got, const MatL& want) {
  double worst = 0;
  for (Index t = 0; t < want.rows(); ++t) {
    const LD scale = std::max<LD>(want.row(t).cwiseAbs().maxCoeff(), LD(1e-30));
    const LD e = (got.row(t).template cast<LD>() - want.row(t)).cwiseAbs().maxCoeff() / scale;
    worst = std::max(worst, double(e));
  }
  return worst;
}

// The targets: 1e-12 of a row's magnitude in double, 1e-5 in float.
template <class S>
double tolerance() {
  return std::is_same_v<S, double> ? 1e-12 : 1e-5;
}

}  // namespace test::layer_ref
