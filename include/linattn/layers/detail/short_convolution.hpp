/// \file layers/detail/short_convolution.hpp
/// \brief The kernels of the depthwise causal convolution (internal; docs/SPEC.md §10.5): the
/// rows of one sequence over a range of channels with its carried inputs, one decode token, the
/// split of the channels over threads, and the backward.
///
/// The weight is C x W in PyTorch's order (conv1d's [C, 1, W] without its middle axis): column
/// i multiplies x_{t−(W−1)+i}, so column W − 1 multiplies the current input. The kernels read it
/// as W taps of C contiguous entries (its columns in place when it is column-major, else a copy).
/// The carried state holds the W − 1 inputs before the sequence, oldest first (row r is
/// x_{r−(W−1)}). Every output sums bias + column 0's term + … + column W − 1's, in that order,
/// each term one fused multiply-add (the sums vectorised), then SiLU by std::exp (conv_silu),
/// in the prefill, the backward's recomputation and the decode step alike, channel by channel:
/// a sequence run in pieces or token by token, or on any number of threads, gives the same bits
/// as one call.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "../../core/common.hpp"
#include "../../core/detail/views.hpp"
#include "../../core/parallel.hpp"
#include "../../core/workspace.hpp"
#include "../../maps/silu.hpp"

namespace linattn::detail {

template <class S>
using ConvRows = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// The operands of a call as the kernels read them: tap i of channel c at w[i·ldw + c], the bias
// (null: none).
template <class S>
struct ConvTaps {
  const S* w = nullptr;
  Index ldw = 0;
  const S* bias = nullptr;
  Index C = 0, W = 0;
  bool silu = false;
};

// The taps of a C x W weight: its columns in place when they are contiguous arrays of S, else a
// copy in workspace slot `slot`; a bias copied to slot + 1.
template <class S, class DW, class DB>
ConvTaps<S> conv_taps(const DW& w, const DB& bias, bool silu, Workspace<S>& ws, int slot) {
  ConvTaps<S> k;
  k.C = w.rows();
  k.W = w.cols();
  k.silu = silu;
  Index rs = 0, cs = 0;
  const S* p = strided_base<S>(w, rs, cs);
  if (p && (rs == 1 || k.C <= 1)) {
    k.w = p;
    k.ldw = cs;
  } else {
    auto m = ws.matrix(slot, k.C, k.W);  // column-major: tap i at m.data() + i·C
    m = w.template cast<S>();
    k.w = m.data();
    k.ldw = k.C;
  }
  if (bias.size() != 0) {
    auto b = ws.vector(slot + 1, k.C);
    for (Index c = 0; c < k.C; ++c)
      b[c] = static_cast<S>(bias.rows() == 1 ? bias.coeff(0, c) : bias.coeff(c, 0));
    k.bias = b.data();
  }
  return k;
}

constexpr Index kConvBlock = 512;  // channels whose sums stay in L1 over the W passes

// y <- SiLU(y) = y·sigmoid(y) over n values, by the scalar sigmoid()'s formula and std::exp:
// the layers' L2-normalised q and k amplify the rounding of their SiLU, and the packet exp (good
// to about 1 ulp) is not accurate enough there in float. e^{-|y|} is the exp sigmoid() takes on
// either side, so the bits are sigmoid()'s, without its branch.
template <class S>
void conv_silu(S* __restrict y, Index n) {
  S e[kConvBlock];  // the exps first, alone: the arithmetic after them vectorises
  for (Index c = 0; c < n; ++c) e[c] = std::exp(-std::abs(y[c]));
  for (Index c = 0; c < n; ++c) {
    const S v = y[c];
    y[c] = v * ((v >= S(0) ? S(1) : e[c]) / (S(1) + e[c]));
  }
}

// One output row over channels [c0, c1): y = act(bias + Σ_i w_i ∘ x(i)), x(i) the inputs at
// window position i (i = W − 1: the current token), each term std::fma (one rounding, and no
// compiler's choice to contract or not). In blocks of channels whose sums stay in L1 over the
// W passes.
template <class S, class Row>
void conv_span(const ConvTaps<S>& k, const Row& x, Index c0, Index c1, S* y) {
  for (Index b0 = c0; b0 < c1; b0 += kConvBlock) {
    const Index b1 = std::min(c1, b0 + kConvBlock);
    S* __restrict acc = y;
    if (k.bias) {
      const S* __restrict bias = k.bias;
      for (Index c = b0; c < b1; ++c) acc[c] = bias[c];
    } else {
      for (Index c = b0; c < b1; ++c) acc[c] = S(0);
    }
    for (Index i = 0; i < k.W; ++i) {
      const S* __restrict xi = x(i);
      const S* __restrict wi = k.w + i * k.ldw;
      for (Index c = b0; c < b1; ++c) acc[c] = std::fma(xi[c], wi[c], acc[c]);
    }
    if (k.silu) conv_silu(y + b0, b1 - b0);
  }
}

// Channels [c0, c1) of one sequence's rows: X its N inputs after the L = W − 1 carried in
// `state` (sized), out its N output rows. ring (W·C entries) holds X's rows converted when they
// cannot be read in place, yrow (C) a row when out's cannot be written in place; each range of
// channels uses its own part of both, so that threads on other ranges can share them.
template <class S, class DX, class DOut>
void conv_sequence_span(const ConvTaps<S>& k, const DX& X, const ConvRows<S>& state, DOut& out,
                        Index c0, Index c1, S* ring, S* yrow) {
  using T = typename DOut::Scalar;
  const Index N = X.rows(), C = k.C, W = k.W, L = W - 1;
  Index xs = 0, ys = 0;
  const S* xb = row_base<S>(X, xs);
  S* yb = row_base<S>(out, ys);
  for (Index t = 0; t < N; ++t) {
    if (!xb) {
      S* r = ring + (t % W) * C;
      for (Index c = c0; c < c1; ++c) r[c] = static_cast<S>(X.coeff(t, c));
    }
    const auto row = [&](Index i) -> const S* {
      const Index s = t - L + i;
      if (s < 0) return state.data() + (L + s) * C;
      return xb ? xb + s * xs : ring + (s % W) * C;
    };
    S* y = yb ? yb + t * ys : yrow;
    conv_span(k, row, c0, c1, y);
    if (!yb)
      for (Index c = c0; c < c1; ++c) out.coeffRef(t, c) = static_cast<T>(y[c]);
  }
}

// One decode token of one sequence over channels [c0, c1): y = act(conv over [state; x]), then
// those channels of the state move on by x. x, y: C entries.
template <class S>
void conv_token_span(const ConvTaps<S>& k, ConvRows<S>& state, const S* x, S* y, Index c0,
                     Index c1) {
  const Index C = k.C, L = k.W - 1;
  S* st = state.data();
  conv_span(
      k, [&](Index i) -> const S* { return i < L ? st + i * C : x; }, c0, c1, y);
  for (Index r = 0; r + 1 < L; ++r)
    std::copy(st + (r + 1) * C + c0, st + (r + 1) * C + c1, st + r * C + c0);
  if (L > 0) std::copy(x + c0, x + c1, st + (L - 1) * C + c0);
}

// The flops of `rows` output rows (the SiLU counted as about 20).
inline double conv_work(Index rows, Index C, Index W, bool silu) {
  return double(rows) * double(C) * double(2 * W + (silu ? 20 : 0));
}

// body(c0, c1) over ranges of the C channels, one per thread that `work` pays for
// (threads_for()), in whole blocks of kConvGrain channels; serially inside a parallel region.
// The channels are independent, so the bits do not depend on the split.
template <class Body>
void conv_channel_split(Index C, double work, const ParallelOptions& par, const Body& body) {
  constexpr Index kConvGrain = 64;
  const Index blocks = (C + kConvGrain - 1) / kConvGrain;
  const int threads =
      in_parallel_region() ? 1 : static_cast<int>(std::min<Index>(threads_for(par, work), blocks));
  if (threads <= 1) {
    body(Index(0), C);
    return;
  }
  run_team(threads, executor_of(par), [&](int t, int nt) {
    const Index c0 = std::min(C, t * blocks / nt * kConvGrain);
    const Index c1 = std::min(C, (t + 1) * blocks / nt * kConvGrain);
    if (c0 < c1) body(c0, c1);
  });
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

// u (the pre-activations, N x C row-major, compute scalar) of one sequence: X its N inputs, w
// the C x W weight, bias C entries or none, state the W − 1 carried inputs (sized).
template <class DX, class DW, class DB, class S>
void conv_preactivations(const DX& X, const DW& w, const DB& bias, const ConvRows<S>& state,
                         ConvRows<S>& u) {
  Workspace<S> ws;
  const ConvTaps<S> k = conv_taps<S>(w, bias, false, ws, 0);
  S* ring = ws.vector(2, k.W * k.C).data();
  conv_sequence_span(k, X, state, u, Index(0), k.C, ring, static_cast<S*>(nullptr));
}

// ∂L/∂X (N x C), ∂L/∂w (C x W, accumulated), ∂L/∂bias (accumulated, when given) and ∂L/∂state
// (L x C, accumulated, when given) of one sequence from dY, recomputing u.
template <class DX, class DW, class DB, class S, class DdY, class DdX>
void conv_backward_sequence(const DX& X, const DW& w, const DB& bias, const ConvRows<S>& state,
                            bool silu, const DdY& dY, DdX& dX, Matrix<S>& dw, Vector<S>* dbias,
                            ConvRows<S>* dstate, ConvRows<S>& du) {
  const Index N = X.rows(), W = w.cols(), L = W - 1;
  du.resize(N, X.cols());
  if (N == 0) return;
  if (silu) {
    conv_preactivations(X, w, bias, state, du);
    du.array() = du.array().unaryExpr(silu_grad_op<S>()) * dY.template cast<S>().array();
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

}  // namespace linattn::detail
