/// \file layers/short_convolution.hpp
/// \brief The short convolution of the 2026 layers (Gated DeltaNet, KDA, Mamba-2): a depthwise
/// causal conv1d over the channels of q, k and v, optional bias and SiLU, with the carried state
/// (the last W − 1 inputs of a sequence) that continues a prefill and drives decoding; packed
/// sequences (cu_seqlens), a batched decode step, and the backward (docs/SPEC.md §10.5).
///
/// \code
/// // Qwen3-Next: C = 2·16·128 + 32·128 channels of concat(q, k, v), W = 4, SiLU, no bias.
/// // weight: conv1d.weight of shape [C, 1, 4], read as a C x 4 row-major matrix.
/// linattn::ShortConvState<float> state;                        // empty: zeros before token 0
/// Eigen::MatrixXf y = linattn::short_convolution(X, weight, Eigen::VectorXf(), state);
/// linattn::short_convolution_step(x_next, weight, Eigen::VectorXf(), state, y_next);
/// \endcode
#pragma once

#include <Eigen/Core>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/common.hpp"
#include "../core/detail/checks.hpp"
#include "../core/parallel.hpp"
#include "../core/workspace.hpp"
#include "../linear/heads.hpp"
#include "detail/short_convolution.hpp"

namespace linattn {

/// \brief The activation after the convolution.
enum class ConvActivation {
  None,  ///< y = conv(x) + bias
  Silu,  ///< y = SiLU(conv(x) + bias): FLA's ShortConvolution default, Qwen3-Next, Kimi Linear
};

/// \brief Options of the short convolution.
struct ShortConvOptions {
  ConvActivation activation = ConvActivation::Silu;  ///< applied after the bias
};

/// \brief A sequence's carried convolution state: the W − 1 inputs before its next token,
/// oldest first, as a (W − 1) x C row-major matrix (row r holds x_{t−(W−1)+r} when the next
/// token is t). Empty means zeros (a new sequence); FLA's and transformers' conv cache of shape
/// [C, W] holds the last W inputs, whose last W − 1 columns transposed are this state.
template <class Scalar>
using ShortConvState = detail::ConvRows<Scalar>;

/// \brief The gradients of a short convolution: ∂L/∂X, ∂L/∂weight (C x W), ∂L/∂bias (C; empty
/// without bias) and ∂L/∂ of each initial state ((W − 1) x C each; empty when the call started
/// from zeros).
template <class Scalar>
struct ShortConvGradients {
  Matrix<Scalar> dX;                             ///< N x C
  Matrix<Scalar> dweight;                        ///< C x W
  Vector<Scalar> dbias;                          ///< C entries, or empty
  std::vector<ShortConvState<Scalar>> dinitial;  ///< one per sequence given an initial state
};

namespace detail {

// The shapes of a convolution call; returns W. weight: C x W, W >= 1; bias: empty or C entries.
template <class DX, class DW, class DB>
Index check_conv(const char* fn, const Eigen::MatrixBase<DX>& X,
                 const Eigen::MatrixBase<DW>& weight, const Eigen::MatrixBase<DB>& bias) {
  static_assert(std::is_same_v<compute_scalar_t<typename DX::Scalar>,
                               compute_scalar_t<typename DW::Scalar>> &&
                    std::is_same_v<compute_scalar_t<typename DX::Scalar>,
                                   compute_scalar_t<typename DB::Scalar>>,
                "linattn: X, weight and bias must share one scalar type (bf16 / half storage "
                "computes in float)");
  const auto shapes = [&] {
    return " (X is " + shape_of(X) + ", weight is " + shape_of(weight) + ", bias is " +
           shape_of(bias) + ")";
  };
  if (weight.rows() != X.cols() || weight.cols() < 1)
    throw_invalid(fn, "weight must be C x W with C = X.cols() = " + std::to_string(X.cols()) +
                          " channels and a kernel size W >= 1" + shapes());
  if (bias.size() != 0 && ((bias.rows() != 1 && bias.cols() != 1) || bias.size() != X.cols()))
    throw_invalid(fn, "bias must be empty (none) or a vector of C = " + std::to_string(X.cols()) +
                          " entries" + shapes());
  return weight.cols();
}

// A carried state: empty (sized to zeros here) or (W − 1) x C.
template <class S>
void prepare_conv_state(const char* fn, const std::string& name, ShortConvState<S>& st, Index W,
                        Index C) {
  if (st.size() == 0) {
    st.setZero(W - 1, C);
    return;
  }
  if (st.rows() != W - 1 || st.cols() != C)
    throw_invalid(fn, name + " is " + shape_of(st) + " but must be empty or " +
                          shape_string(W - 1, C) + " (the last W - 1 = " + std::to_string(W - 1) +
                          " inputs of C channels)");
}

}  // namespace detail

/// \brief The short convolution of one sequence continuing `state`: out_t = act(bias +
/// Σ_{i<W} weight(·, i) ∘ x_{t−(W−1)+i}), inputs before token 0 from `state`, which is then
/// the last W − 1 inputs. Allocation-free with a reused workspace and a sized state.
/// \code
/// linattn::ShortConvState<float> st;  // zeros
/// linattn::short_convolution(X.topRows(100), w, b, st, Y.topRows(100), ws);
/// linattn::short_convolution(X.bottomRows(28), w, b, st, Y.bottomRows(28), ws);  // continues
/// \endcode
/// \param X N x C inputs (any Eigen expression; float, double, bf16 or half).
/// \param weight C x W (PyTorch's conv1d weight [C, 1, W]): column W − 1 multiplies x_t.
/// \param bias C entries, or empty for none.
/// \param state the W − 1 carried inputs (empty: zeros), updated in place.
/// \param out receives the N x C outputs; must not overlap X, weight, bias or the state.
/// \param ws scratch reused across calls.
/// \param options the activation (SiLU by default).
/// \param par the threads (default: OpenMP's, where the call's work pays for them): the
///     channels are split over them, with the same bits for any count.
/// \throws std::invalid_argument on shapes that do not fit or overlapping memory.
template <class DX, class DW, class DB, class DOut>
void short_convolution(const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DW>& weight,
                       const Eigen::MatrixBase<DB>& bias,
                       ShortConvState<compute_scalar_t<typename DX::Scalar>>& state,
                       const Eigen::MatrixBase<DOut>& out,
                       Workspace<compute_scalar_t<typename DX::Scalar>>& ws,
                       const ShortConvOptions& options = {}, const ParallelOptions& par = {}) {
  using S = compute_scalar_t<typename DX::Scalar>;
  const char* fn = "short_convolution";
  const Index W = detail::check_conv(fn, X, weight, bias), C = X.cols();
  detail::check_output(fn, out, X.rows(), C);
  detail::check_no_overlap(fn, out, "X", X, "weight", weight, "bias", bias, "state", state);
  detail::prepare_conv_state<S>(fn, "state", state, W, C);
  const detail::ConvTaps<S> k = detail::conv_taps<S>(
      weight.derived(), bias.derived(), options.activation == ConvActivation::Silu, ws, 0);
  S* ring = ws.vector(2, W * C).data();
  S* yrow = ws.vector(3, C).data();
  auto& dst = detail::writable(out);
  detail::conv_channel_split(
      C, detail::conv_work(X.rows(), C, W, k.silu), par, [&](Index c0, Index c1) {
        detail::conv_sequence_span(k, X.derived(), state, dst, c0, c1, ring, yrow);
      });
  detail::conv_next_state(X.derived(), state, W - 1);
}

/// \brief short_convolution() continuing `state`, returning the N x C outputs.
/// \param X N x C inputs.
/// \param weight C x W.
/// \param bias C entries, or empty.
/// \param state the carried inputs (empty: zeros), updated.
/// \param options the activation.
/// \return the outputs, of X's scalar type.
template <class DX, class DW, class DB>
Matrix<typename DX::Scalar> short_convolution(
    const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DW>& weight,
    const Eigen::MatrixBase<DB>& bias, ShortConvState<compute_scalar_t<typename DX::Scalar>>& state,
    const ShortConvOptions& options = {}) {
  Matrix<typename DX::Scalar> out(X.rows(), X.cols());
  Workspace<compute_scalar_t<typename DX::Scalar>> ws;
  short_convolution(X, weight, bias, state, out, ws, options);
  return out;
}

/// \brief The short convolution of one new sequence (zeros before token 0).
/// \code
/// Eigen::MatrixXf y = linattn::short_convolution(X, w, Eigen::VectorXf());  // SiLU, no bias
/// \endcode
/// \param X N x C inputs.
/// \param weight C x W.
/// \param bias C entries, or empty.
/// \param options the activation.
/// \return the outputs, of X's scalar type.
template <class DX, class DW, class DB>
Matrix<typename DX::Scalar> short_convolution(const Eigen::MatrixBase<DX>& X,
                                              const Eigen::MatrixBase<DW>& weight,
                                              const Eigen::MatrixBase<DB>& bias,
                                              const ShortConvOptions& options = {}) {
  ShortConvState<compute_scalar_t<typename DX::Scalar>> state;
  return short_convolution(X, weight, bias, state, options);
}

/// \brief The short convolution of B sequences packed one after another (rows [offsets[b],
/// offsets[b+1]) are sequence b, FLA's cu_seqlens), each continuing states[b] (an empty vector:
/// B zero states), which are updated. A sequence never reads another's inputs.
/// \code
/// std::vector<linattn::ShortConvState<float>> states;  // B zero states
/// linattn::batched_short_convolution(X, w, b, cu_seqlens, states, Y, ws);
/// \endcode
/// \param X the packed N x C inputs.
/// \param weight C x W.
/// \param bias C entries, or empty.
/// \param offsets B + 1 sequence offsets (std::vector or Eigen vector of any integer type).
/// \param states B carried states (each empty or (W − 1) x C), or an empty vector.
/// \param out receives the N x C outputs.
/// \param ws scratch reused across calls.
/// \param options the activation.
/// \param par the threads (default: OpenMP's, where the call's work pays for them): the
///     channels are split over them, with the same bits for any count.
template <class DX, class DW, class DB, class Off, class DOut>
void batched_short_convolution(
    const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DW>& weight,
    const Eigen::MatrixBase<DB>& bias, const Off& offsets,
    std::vector<ShortConvState<compute_scalar_t<typename DX::Scalar>>>& states,
    const Eigen::MatrixBase<DOut>& out, Workspace<compute_scalar_t<typename DX::Scalar>>& ws,
    const ShortConvOptions& options = {}, const ParallelOptions& par = {}) {
  using S = compute_scalar_t<typename DX::Scalar>;
  const char* fn = "batched_short_convolution";
  const Index W = detail::check_conv(fn, X, weight, bias), C = X.cols();
  const auto off = detail::offsets_of(fn, "offsets", offsets);
  detail::check_offsets(fn, "offsets", off, X.rows());
  const Index B = static_cast<Index>(off.size()) - 1;
  detail::check_output(fn, out, X.rows(), C);
  detail::check_no_overlap(fn, out, "X", X, "weight", weight, "bias", bias);
  if (states.empty()) states.resize(static_cast<std::size_t>(B));
  if (static_cast<Index>(states.size()) != B)
    detail::throw_invalid(fn, "states holds " + std::to_string(states.size()) +
                                  " states but the offsets give B = " + std::to_string(B) +
                                  " sequences");
  for (Index b = 0; b < B; ++b) {
    auto& st = states[static_cast<std::size_t>(b)];
    detail::prepare_conv_state<S>(fn, "states[" + std::to_string(b) + "]", st, W, C);
    detail::check_no_overlap(fn, out, ("states[" + std::to_string(b) + "]").c_str(), st);
  }
  const detail::ConvTaps<S> k = detail::conv_taps<S>(
      weight.derived(), bias.derived(), options.activation == ConvActivation::Silu, ws, 0);
  S* ring = ws.vector(2, W * C).data();
  S* yrow = ws.vector(3, C).data();
  auto& dst = detail::writable(out);
  const auto rows = [&](Index b, Index& r0) {
    r0 = off[static_cast<std::size_t>(b)];
    return off[static_cast<std::size_t>(b + 1)] - r0;
  };
  // Every sequence on every thread, each thread over its channels.
  detail::conv_channel_split(
      C, detail::conv_work(X.rows(), C, W, k.silu), par, [&](Index c0, Index c1) {
        for (Index b = 0; b < B; ++b) {
          Index r0 = 0;
          const Index n = rows(b, r0);
          auto ys = dst.middleRows(r0, n);
          detail::conv_sequence_span(k, X.middleRows(r0, n), states[static_cast<std::size_t>(b)],
                                     ys, c0, c1, ring, yrow);
        }
      });
  for (Index b = 0; b < B; ++b) {
    Index r0 = 0;
    const Index n = rows(b, r0);
    detail::conv_next_state(X.middleRows(r0, n), states[static_cast<std::size_t>(b)], W - 1);
  }
}

/// \brief One decode token for each of B sequences: row b of x is sequence b's next input, its
/// output goes to row b of out and states[b] moves on by it. Bit for bit the rows a prefill of
/// the same tokens gives; allocation-free once the states are sized.
/// \code
/// linattn::short_convolution_step(x, w, b, states, y, ws);  // x, y: B x C
/// \endcode
/// \param x B x C inputs, one row per sequence.
/// \param weight C x W.
/// \param bias C entries, or empty.
/// \param states B carried states (each empty: zeros, or (W − 1) x C).
/// \param out receives the B x C outputs.
/// \param ws scratch reused across calls.
/// \param options the activation.
/// \param par the threads (default: OpenMP's, where the call's work pays for them).
template <class DX, class DW, class DB, class DOut>
void short_convolution_step(
    const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DW>& weight,
    const Eigen::MatrixBase<DB>& bias,
    std::vector<ShortConvState<compute_scalar_t<typename DX::Scalar>>>& states,
    const Eigen::MatrixBase<DOut>& out, Workspace<compute_scalar_t<typename DX::Scalar>>& ws,
    const ShortConvOptions& options = {}, const ParallelOptions& par = {}) {
  using S = compute_scalar_t<typename DX::Scalar>;
  const char* fn = "short_convolution_step";
  const Index W = detail::check_conv(fn, x, weight, bias), C = x.cols(), B = x.rows();
  detail::check_output(fn, out, B, C);
  detail::check_no_overlap(fn, out, "x", x, "weight", weight, "bias", bias);
  if (static_cast<Index>(states.size()) != B)
    detail::throw_invalid(fn, "states holds " + std::to_string(states.size()) +
                                  " states but x has B = " + std::to_string(B) + " rows");
  for (Index b = 0; b < B; ++b)
    detail::prepare_conv_state<S>(fn, "states[" + std::to_string(b) + "]",
                                  states[static_cast<std::size_t>(b)], W, C);
  const detail::ConvTaps<S> k = detail::conv_taps<S>(
      weight.derived(), bias.derived(), options.activation == ConvActivation::Silu, ws, 0);
  S* xin = ws.vector(2, C).data();
  S* yrow = ws.vector(3, C).data();
  auto& dst = detail::writable(out);
  Index xs = 0, ys = 0;
  const S* xb = detail::row_base<S>(x.derived(), xs);
  S* yb = detail::row_base<S>(dst, ys);
  detail::conv_channel_split(C, detail::conv_work(B, C, W, k.silu), par, [&](Index c0, Index c1) {
    for (Index b = 0; b < B; ++b) {
      if (!xb)
        for (Index c = c0; c < c1; ++c) xin[c] = static_cast<S>(x.coeff(b, c));
      S* y = yb ? yb + b * ys : yrow;
      detail::conv_token_span(k, states[static_cast<std::size_t>(b)], xb ? xb + b * xs : xin, y, c0,
                              c1);
      if (!yb)
        for (Index c = c0; c < c1; ++c)
          dst.coeffRef(b, c) = static_cast<typename DOut::Scalar>(y[c]);
    }
  });
}

/// \brief One decode token of one sequence (x: C entries, a row or a column), on the calling
/// thread. It allocates its buffers per call; the B-sequence overload with a workspace allocates
/// nothing.
/// \param x the C inputs of the token.
/// \param weight C x W.
/// \param bias C entries, or empty.
/// \param state the carried inputs, moved on by x.
/// \param out receives the C outputs.
/// \param options the activation.
template <class DX, class DW, class DB, class DOut>
void short_convolution_step(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DW>& weight,
                            const Eigen::MatrixBase<DB>& bias,
                            ShortConvState<compute_scalar_t<typename DX::Scalar>>& state,
                            const Eigen::MatrixBase<DOut>& out,
                            const ShortConvOptions& options = {}) {
  using S = compute_scalar_t<typename DX::Scalar>;
  const char* fn = "short_convolution_step";
  if ((x.rows() != 1 && x.cols() != 1) || (out.rows() != 1 && out.cols() != 1) ||
      out.size() != x.size())
    detail::throw_invalid(fn, "x and out must be vectors of C entries (x is " +
                                  detail::shape_of(x) + ", out is " + detail::shape_of(out) + ")");
  const auto xr = x.reshaped().transpose();
  const Index W = detail::check_conv(fn, xr, weight, bias), C = x.size();
  detail::check_no_overlap(fn, out, "x", x, "weight", weight, "bias", bias, "state", state);
  detail::prepare_conv_state<S>(fn, "state", state, W, C);
  Vector<S> xin = xr.transpose().template cast<S>(), y(C);
  Workspace<S> ws;
  const detail::ConvTaps<S> k = detail::conv_taps<S>(
      weight.derived(), bias.derived(), options.activation == ConvActivation::Silu, ws, 0);
  detail::conv_token_span(k, state, xin.data(), y.data(), Index(0), C);
  detail::writable(out).reshaped() = y.template cast<typename DOut::Scalar>();
}

namespace detail {

template <class DX, class DW, class DB, class DdY, class S>
ShortConvGradients<S> conv_backward(const char* fn, const DX& X, const DW& weight, const DB& bias,
                                    OffsetsRef off, const std::vector<ShortConvState<S>>* initial,
                                    const DdY& dY, const ShortConvOptions& options) {
  const Index W = check_conv(fn, X, weight, bias), C = X.cols();
  bool zero_initial = false;  // an empty vector of initial states: B zero states
  check_offsets(fn, "offsets", off, X.rows());
  const Index B = static_cast<Index>(off.size()) - 1;
  if (dY.rows() != X.rows() || dY.cols() != C)
    throw_invalid(fn, "dY is " + shape_of(dY) + " but must be " + shape_of(X) + " (X's shape)");
  if (initial && initial->empty()) {
    initial = nullptr;
    zero_initial = true;
  }
  if (initial && static_cast<Index>(initial->size()) != B)
    throw_invalid(fn, "initial holds " + std::to_string(initial->size()) +
                          " states but there are B = " + std::to_string(B) + " sequences");
  ShortConvGradients<S> g;
  g.dX.resize(X.rows(), C);
  g.dweight.setZero(C, W);
  if (bias.size() != 0) g.dbias.setZero(C);
  const bool want_initial = initial || zero_initial;
  if (want_initial) g.dinitial.resize(static_cast<std::size_t>(B));
  ShortConvState<S> zeros, du;
  for (Index b = 0; b < B; ++b) {
    const Index r0 = off[static_cast<std::size_t>(b)];
    const Index n = off[static_cast<std::size_t>(b + 1)] - r0;
    const ShortConvState<S>* st = &zeros;
    if (initial && (*initial)[static_cast<std::size_t>(b)].size() != 0) {
      st = &(*initial)[static_cast<std::size_t>(b)];
      if (st->rows() != W - 1 || st->cols() != C)
        throw_invalid(fn, "initial[" + std::to_string(b) + "] is " + shape_of(*st) +
                              " but must be empty or " + shape_string(W - 1, C));
    } else if (zeros.size() == 0) {
      zeros.setZero(W - 1, C);
    }
    ShortConvState<S>* ds = nullptr;
    if (want_initial) {
      g.dinitial[static_cast<std::size_t>(b)].setZero(W - 1, C);
      ds = &g.dinitial[static_cast<std::size_t>(b)];
    }
    auto dx = g.dX.middleRows(r0, n);
    conv_backward_sequence(X.middleRows(r0, n), weight, bias, *st,
                           options.activation == ConvActivation::Silu, dY.middleRows(r0, n), dx,
                           g.dweight, bias.size() != 0 ? &g.dbias : nullptr, ds, du);
  }
  return g;
}

}  // namespace detail

/// \brief The gradients of short_convolution() for ∂L/∂out = dY, from a zero state.
/// \code
/// auto g = linattn::short_convolution_backward(X, w, b, dY);  // g.dX, g.dweight, g.dbias
/// \endcode
/// \param X N x C inputs of the forward call.
/// \param weight C x W.
/// \param bias C entries, or empty.
/// \param dY N x C gradient of the outputs.
/// \param options the forward call's activation.
/// \return dX, dweight, dbias (dinitial empty).
template <class DX, class DW, class DB, class DdY>
ShortConvGradients<compute_scalar_t<typename DX::Scalar>> short_convolution_backward(
    const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DW>& weight,
    const Eigen::MatrixBase<DB>& bias, const Eigen::MatrixBase<DdY>& dY,
    const ShortConvOptions& options = {}) {
  const Index offsets[2] = {0, X.rows()};
  return detail::conv_backward<DX, DW, DB, DdY, compute_scalar_t<typename DX::Scalar>>(
      "short_convolution_backward", X.derived(), weight.derived(), bias.derived(),
      detail::OffsetsRef(offsets, 2), nullptr, dY.derived(), options);
}

/// \brief The gradients of batched_short_convolution() (or of short_convolution() from a carried
/// state, B = 1), with those of the B initial states in `dinitial`.
/// \param X the packed N x C inputs of the forward call.
/// \param weight C x W.
/// \param bias C entries, or empty.
/// \param offsets B + 1 sequence offsets.
/// \param initial the B states the forward call started from (each empty: zeros), as they were
///     before it; an empty vector: B zero states.
/// \param dY N x C gradient of the outputs.
/// \param options the forward call's activation.
/// \return dX, dweight, dbias and dinitial (B states).
template <class DX, class DW, class DB, class Off, class DdY>
ShortConvGradients<compute_scalar_t<typename DX::Scalar>> batched_short_convolution_backward(
    const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DW>& weight,
    const Eigen::MatrixBase<DB>& bias, const Off& offsets,
    const std::vector<ShortConvState<compute_scalar_t<typename DX::Scalar>>>& initial,
    const Eigen::MatrixBase<DdY>& dY, const ShortConvOptions& options = {}) {
  const char* fn = "batched_short_convolution_backward";
  return detail::conv_backward<DX, DW, DB, DdY, compute_scalar_t<typename DX::Scalar>>(
      fn, X.derived(), weight.derived(), bias.derived(), detail::offsets_of(fn, "offsets", offsets),
      &initial, dY.derived(), options);
}

}  // namespace linattn
