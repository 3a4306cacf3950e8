/// \file core/detail/decay.hpp
/// \brief Decay factors from log gates (internal): exponentials of non-positive sums, the running
/// sums along a chunk, a scalar-decay chunk's columns; shared by the gated and delta-rule kernels.
#pragma once

#include <Eigen/Core>

#include <type_traits>

#include "../common.hpp"
#include "fast_exp.hpp"

namespace linattn::detail {

// exp of every entry (all <= 0; below exp_arg_floor the result is exactly 0, never a denormal
// that would slow every later product).
template <class X>
void exp_nonpositive_inplace(X&& x) {
  using S = typename std::decay_t<X>::Scalar;
  x = x.unaryExpr(exp_nonpositive_op<S>());
}

// The decay factors of the recurrent kernels, e^g = h + l for every log gate g (all <= 0): l
// replaces g, h (1 or 0, same shape) is written to `h`. l = expm1(g) with h = 1 for mild gates
// (e^g >= 0.71), l = e^g with h = 0 for stronger ones, so that l keeps its digits whatever g:
// a factor applied as h S + l S is exact to rounding, where e^g itself would round 1 - e^g to
// a relative u / |g| (see expm1_nonpositive_op).
template <class X, class H>
void split_decay_inplace(X&& g, H&& h) {
  using S = typename std::decay_t<X>::Scalar;
  h = (g.array() >= decay_split_point<S>()).template cast<S>().matrix();
  g = g.unaryExpr(expm1_nonpositive_op<S, true>());
}

// The running sums every decay factor is the exponential of, each column added along its own
// stretch of rows (never a difference of two prefix sums, which would cancel; docs/SPEC.md §9):
//   forward_sums:  out(i - first, d) = Σ_{first<=l<=i} g(l, d),   i in [first, first + n);
//   backward_sums: out(j - first, d) = Σ_{j<l<=last} g(l, d),     j in [first, last].
template <class GB, class Out>
void forward_sums(const GB& g, Index first, Index n, Out&& out) {
  using S = typename std::decay_t<Out>::Scalar;
  for (Index d = 0; d < g.cols(); ++d) {
    S run = 0;
    for (Index i = 0; i < n; ++i) out(i, d) = run += g(first + i, d);
  }
}
template <class GB, class Out>
void backward_sums(const GB& g, Index first, Index last, Out&& out) {
  using S = typename std::decay_t<Out>::Scalar;
  for (Index d = 0; d < g.cols(); ++d) {
    S run = 0;
    for (Index j = last; j >= first; --j) {
      out(j - first, d) = run;
      run += g(j, d);
    }
  }
}

// Column j of a scalar-decay chunk's decay matrix: t(i - j) = exp(Σ_{j<l<=i} g_l) for i in
// [j, b), summed from j + 1 (t(0) = 1).
template <class GV, class T>
void scalar_decay_column(const GV& g, Index j, Index b, T&& t) {
  using S = typename std::decay_t<T>::Scalar;
  t(0) = S(0);
  forward_sums(g, j + 1, b - 1 - j, t.segment(1, b - 1 - j));
  auto head = t.head(b - j).array();
  exp_nonpositive_inplace(head);
}

}  // namespace linattn::detail
