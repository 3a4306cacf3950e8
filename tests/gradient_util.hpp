// Finite differences for the gradient tests (test_backward.cpp, test_softmax_backward.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>

#include "test_util.hpp"

namespace test {

// The loss is Σ out ∘ W, so ∂L/∂out = W. Central differences of it for every entry of X
// (one of Q, K, V) through the forward `f`; step h relative to the entry.
inline MatD finite_difference(
    const std::function<MatD(const MatD&, const MatD&, const MatD&)>& f, const MatD& Q,
    const MatD& K, const MatD& V, const MatD& W, int which) {
  MatD q = Q, k = K, v = V;
  MatD& x = which == 0 ? q : which == 1 ? k : v;
  MatD grad(x.rows(), x.cols());
  for (Index c = 0; c < x.cols(); ++c)
    for (Index r = 0; r < x.rows(); ++r) {
      const double x0 = x(r, c), h = 1e-5 * std::max(1.0, std::abs(x0));
      x(r, c) = x0 + h;
      const double up = f(q, k, v).cwiseProduct(W).sum();
      x(r, c) = x0 - h;
      const double down = f(q, k, v).cwiseProduct(W).sum();
      x(r, c) = x0;
      grad(r, c) = (up - down) / (2 * h);
    }
  return grad;
}

// max |a - b| relative to max |b| (the gradient's scale).
inline double relative_error(const MatD& a, const MatD& b) {
  return test::max_abs_diff(a, b) / std::max(test::max_abs(b), 1e-300);
}

}  // namespace test
