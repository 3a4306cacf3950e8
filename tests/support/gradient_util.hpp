// Finite differences for the gradient tests (test_backward.cpp, test_softmax_backward.cpp, and
// the central differences of any scalar loss for the gradients of the 2026 kernels and layers).
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "test_util.hpp"

namespace test {

// ∂loss/∂X by central differences over every entry of X, step h; X is restored after each.
template <class Loss>
MatD central_differences(const Loss& loss, MatD& X, double h = 1e-6) {
  MatD d(X.rows(), X.cols());
  for (Index c = 0; c < X.cols(); ++c)
    for (Index r = 0; r < X.rows(); ++r) {
      const double x = X(r, c);
      X(r, c) = x + h;
      const double up = loss();
      X(r, c) = x - h;
      const double down = loss();
      X(r, c) = x;
      d(r, c) = (up - down) / (2 * h);
    }
  return d;
}

// The rows of an input of n rows at which a gradient test takes finite differences: every row of
// a short input (n <= 24); of a longer one, the first and last four and the two rows either side
// of every multiple of 16, so every chunk and block boundary the kernels use by default (chunks of
// 48 tokens, blocks of 128) and rows at every offset in chunks of 7. A 200-token input costs 33
// rows' differences instead of 200: the causal gradient tests took 36 s under ASan+UBSan.
inline std::vector<Index> difference_rows(Index n) {
  std::vector<Index> rows;
  for (Index r = 0; r < n; ++r)
    if (n <= 24 || r < 4 || r >= n - 4 || r % 16 == 0 || r % 16 == 15) rows.push_back(r);
  return rows;
}

// The loss is Σ out ∘ W, so ∂L/∂out = W. Central differences of it at the given rows of X (one
// of Q, K, V) through the forward `f`, step h relative to the entry: a rows.size() × X.cols()
// matrix.
inline MatD finite_difference_rows(
    const std::function<MatD(const MatD&, const MatD&, const MatD&)>& f, const MatD& Q,
    const MatD& K, const MatD& V, const MatD& W, int which, const std::vector<Index>& rows) {
  MatD q = Q, k = K, v = V;
  MatD& x = which == 0 ? q : which == 1 ? k : v;
  MatD grad(static_cast<Index>(rows.size()), x.cols());
  for (Index c = 0; c < x.cols(); ++c)
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Index r = rows[i];
      const double x0 = x(r, c), h = 1e-5 * std::max(1.0, std::abs(x0));
      x(r, c) = x0 + h;
      const double up = f(q, k, v).cwiseProduct(W).sum();
      x(r, c) = x0 - h;
      const double down = f(q, k, v).cwiseProduct(W).sum();
      x(r, c) = x0;
      grad(static_cast<Index>(i), c) = (up - down) / (2 * h);
    }
  return grad;
}

// finite_difference_rows at every row of X.
inline MatD finite_difference(
    const std::function<MatD(const MatD&, const MatD&, const MatD&)>& f, const MatD& Q,
    const MatD& K, const MatD& V, const MatD& W, int which) {
  const MatD& x = which == 0 ? Q : which == 1 ? K : V;
  std::vector<Index> all(static_cast<std::size_t>(x.rows()));
  for (Index r = 0; r < x.rows(); ++r) all[static_cast<std::size_t>(r)] = r;
  return finite_difference_rows(f, Q, K, V, W, which, all);
}

// The given rows of G, in that order.
inline MatD select_rows(const MatD& G, const std::vector<Index>& rows) {
  MatD out(static_cast<Index>(rows.size()), G.cols());
  for (std::size_t i = 0; i < rows.size(); ++i) out.row(static_cast<Index>(i)) = G.row(rows[i]);
  return out;
}

// max |a - b| relative to max |b| (the gradient's scale).
inline double relative_error(const MatD& a, const MatD& b) {
  return test::max_abs_diff(a, b) / std::max(test::max_abs(b), 1e-300);
}

}  // namespace test
