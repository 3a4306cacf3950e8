/// \file layers/detail/short_convolution.hpp
/// \brief The kernels of the depthwise causal convolution (internal; docs/SPEC.md §10.5): one
/// sequence's forward with its carried inputs, its backward, and one decode token.
///
/// The weight is C x W in PyTorch's order (conv1d's [C, 1, W] without its middle axis): column
/// i multiplies x_{t−(W−1)+i}, so column W − 1 multiplies the current input. The carried state
/// holds the W − 1 inputs before the sequence, oldest first (row r is x_{r−(W−1)}).
/// Every output sums bias + column 0's term + … + column W − 1's, in that order, in the prefill,
/// the backward's recomputation and the decode step alike: a sequence run in pieces or token by
/// token gives the same bits as one call.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>

#include "../../core/common.hpp"
#include "../../core/detail/scalar_functions.hpp"

namespace linattn::detail {

template <class S>
using ConvRows = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// One output row, channels [0, C): y = bias + Σ_i w(·, i) ∘ window_i, each term fused
// (std::fma: one rounding, and no compiler's choice to contract or not, so that the prefill and
// the decode step agree bit for bit). window(i, c) is the input at window position i (i = W − 1:
// the current token).
template <class S, class DW, class DB, class Window>
void conv_row(const DW& w, const DB& bias, const Window& window, S* y) {
  const Index C = w.rows(), W = w.cols();
  for (Index c = 0; c < C; ++c) y[c] = bias.size() != 0 ? static_cast<S>(bias.coeff(c)) : S(0);
  for (Index i = 0; i < W; ++i)
    for (Index c = 0; c < C; ++c)
      y[c] = std::fma(window(i, c), static_cast<S>(w.coeff(c, i)), y[c]);
}

// u (the pre-activations, N x C row-major, compute scalar) of one sequence: X its N inputs, w
// the C x W weight, bias C entries or none, state the W − 1 carried inputs or empty (zeros).
template <class DX, class DW, class DB, class S>
void conv_preactivations(const DX& X, const DW& w, const DB& bias, const ConvRows<S>& state,
                         ConvRows<S>& u) {
  const Index N = X.rows(), L = w.cols() - 1;
  const bool carried = state.size() != 0;
  for (Index t = 0; t < N; ++t) {
    // Window position i holds x_{t−L+i}: an input, or carried row L + (t − L + i).
    const auto window = [&](Index i, Index c) -> S {
      const Index s = t - L + i;
      if (s >= 0) return static_cast<S>(X.coeff(s, c));
      return carried ? state(L + s, c) : S(0);
    };
    conv_row<S>(w, bias, window, u.data() + t * u.cols());
  }
}

// The state after a sequence: the last W − 1 rows of [state; X] (state empty: zeros).
template <class DX, class S>
void conv_next_state(const DX& X, ConvRows<S>& state, Index L) {
  const Index N = X.rows(), C = X.cols();
  if (state.size() == 0) state.setZero(L, C);
  if (N >= L) {
    state = X.bottomRows(L).template cast<S>();
    return;
  }
  // Fewer inputs than the window: the older carried rows move up, the inputs fill the end.
  for (Index r = 0; r + N < L; ++r) state.row(r) = state.row(r + N);
  state.bottomRows(N) = X.template cast<S>();
}

// ∂L/∂X (N x C), ∂L/∂w (C x W, accumulated), ∂L/∂bias (accumulated, when given) and ∂L/∂state
// (L x C, accumulated, when given) of one sequence from dY, recomputing u.
template <class DX, class DW, class DB, class S, class DdY, class DdX>
void conv_backward_sequence(const DX& X, const DW& w, const DB& bias, const ConvRows<S>& state,
                            bool silu, const DdY& dY, DdX& dX, Matrix<S>& dw, Vector<S>* dbias,
                            ConvRows<S>* dstate, ConvRows<S>& du) {
  const Index N = X.rows(), C = X.cols(), W = w.cols(), L = W - 1;
  du.resize(N, C);
  if (N == 0) return;
  if (silu) {
    conv_preactivations(X, w, bias, state, du);
    for (Index c = 0; c < C; ++c)
      for (Index t = 0; t < N; ++t) {
        const S x = du(t, c), s = sigmoid(x);
        du(t, c) = static_cast<S>(dY.coeff(t, c)) * s * (S(1) + x * (S(1) - s));
      }
  } else {
    du = dY.template cast<S>();
  }
  if (dbias) *dbias += du.colwise().sum().transpose();
  dX.setZero();
  for (Index i = 0; i < W; ++i) {
    const Index j = L - i, head = std::min(j, N);
    const auto wi = w.col(i).transpose().template cast<S>().array();
    if (N > j) {
      dX.topRows(N - j).array() += du.bottomRows(N - j).array().rowwise() * wi;
      dw.col(i) += (du.bottomRows(N - j).array() * X.topRows(N - j).template cast<S>().array())
                       .colwise()
                       .sum()
                       .transpose()
                       .matrix();
    }
    for (Index t = 0; t < head; ++t) {
      if (state.size() != 0)
        dw.col(i) += (du.row(t).array() * state.row(L - j + t).array()).transpose().matrix();
      if (dstate) dstate->row(L - j + t).array() += du.row(t).array() * wi;
    }
  }
}

// One decode token of one sequence: y = act(conv_row over the window [state; x]), then the
// state moves on by x. x, y: C entries (compute scalar).
template <class DW, class DB, class S>
void conv_token(const DW& w, const DB& bias, ConvRows<S>& state, const S* x, S* y, bool silu) {
  const Index C = w.rows(), L = w.cols() - 1;
  const auto window = [&](Index i, Index c) -> S { return i < L ? state(i, c) : x[c]; };
  conv_row<S>(w, bias, window, y);
  if (silu)
    for (Index c = 0; c < C; ++c) y[c] *= sigmoid(y[c]);
  if (L == 0) return;
  std::copy(state.data() + C, state.data() + L * C, state.data());
  std::copy(x, x + C, state.data() + (L - 1) * C);
}

}  // namespace linattn::detail
