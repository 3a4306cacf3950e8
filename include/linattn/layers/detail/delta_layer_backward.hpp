/// \file layers/detail/delta_layer_backward.hpp
/// \brief Internals of the delta-rule layers' backward: the delta rule's gradients over packed
/// sequences, and the projections' gradients.
#pragma once

#include <Eigen/Core>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "../../core/common.hpp"
#include "../../core/detail/checks.hpp"
#include "../../core/gates.hpp"
#include "../../core/gradients.hpp"
#include "../../core/state.hpp"
#include "../../delta/delta_rule_backward.hpp"
#include "../../delta/options.hpp"
#include "../../linear/heads.hpp"
#include "../../linear/multihead_workspace.hpp"
#include "../delta_layer_gradients.hpp"
#include "../delta_layer_state.hpp"
#include "../gated_rms_norm.hpp"
#include "../short_convolution.hpp"
#include "delta_layer.hpp"

namespace linattn {
namespace detail {

// The carried states of a backward, per sequence (B) and head (B·H, sequence-major): the
// initial convolution and head states the forward continued, and the gradients of the states
// it left (from the backward of the calls that continued them). Empty entries are zeros.
template <class S>
struct DeltaCoreStates {
  std::vector<ShortConvState<S>> conv, dconv_final;
  std::vector<LinearAttentionState<S>> heads;
  std::vector<StateGradient<S>> dheads_final;
};

// The delta rule's gradients over B packed sequences, each continuing its heads' initial
// states (B·H, or nullptr: zeros) with its final states' gradients (B·H, or nullptr: zeros):
// the multi-head backward of each sequence's rows into the same rows of dq, dk, dv, dbeta,
// dlog_a, and when d_initial is given (B·H) the initial states' gradients (an empty sequence
// passes its final states' gradients through).
template <class Phi, class DQ, class DK, class DV, class DB, class DA, class DO, class GQ, class GK,
          class GV, class GB, class GA, class S>
void packed_delta_backward(OffsetsRef off, Index heads, const Phi& phi, const DeltaOptions& o,
                           const DQ& q, const DK& k, const DV& v, const DB& beta, const DA& log_a,
                           const DO& dO, const LinearAttentionState<S>* initial,
                           const StateGradient<S>* d_final, GQ& dq, GK& dk, GV& dv, GB& dbeta,
                           GA& dlog_a, StateGradient<S>* d_initial, MultiHeadWorkspace<S>& ws) {
  for (std::size_t b = 0; b + 1 < off.size(); ++b) {
    const Index r0 = off[b], n = off[b + 1] - r0, first = static_cast<Index>(b) * heads;
    if (n == 0) {  // no rows to write; the state passes through unchanged
      for (Index h = 0; d_initial && h < heads; ++h) {
        auto& dst = d_initial[first + h].dS;
        if (d_final && d_final[first + h].dS.size() != 0)
          dst = d_final[first + h].dS;
        else
          dst.setZero(o.key_dim, o.value_dim);
        d_initial[first + h].dz.setZero(o.key_dim);
      }
      continue;
    }
    multihead_delta_backward(q.middleRows(r0, n), k.middleRows(r0, n), v.middleRows(r0, n),
                             beta.middleRows(r0, n), log_a.middleRows(r0, n), dO.middleRows(r0, n),
                             heads, phi, initial ? initial + first : nullptr,
                             d_final ? d_final + first : nullptr, dq.middleRows(r0, n),
                             dk.middleRows(r0, n), dv.middleRows(r0, n), dbeta.middleRows(r0, n),
                             dlog_a.middleRows(r0, n), d_initial ? d_initial + first : nullptr, ws,
                             o, ParallelOptions{});
  }
}

// The inputs of a layer's backward: X of d columns, finite (the gates reject what is not), and
// dY of X's shape.
template <class DX, class DdY>
void check_backward_inputs(const char* fn, const Eigen::MatrixBase<DX>& X,
                           const Eigen::MatrixBase<DdY>& dY, Index d) {
  if (X.cols() != d)
    throw_invalid(fn, "X is " + shape_of(X) + " but must have hidden_size = " + std::to_string(d) +
                          " columns");
  if (dY.rows() != X.rows() || dY.cols() != d)
    throw_invalid(fn, "dY is " + shape_of(dY) + " but must be " + shape_of(X) + " (X's shape)");
  check_finite_entries(fn, "X", X);
}

// A projection Y = X Wᵀ's gradients: dW = dYᵀ X, and dX += dY W (dX = dY W with `first`).
template <class DdY, class DX, class DW, class GW, class GX>
void projection_backward(const DdY& dY, const DX& X, const DW& W, GW& dW, GX& dX, bool first) {
  dW.noalias() = dY.transpose() * X;
  if (first)
    dX.noalias() = dY * W;
  else
    dX.noalias() += dY * W;
}

// What the middle of a delta-rule layer's backward gives: the gradients of the convolution's
// input, the norm's gate, β, the log-decays, the convolution's and the norm's weights.
template <class S>
struct DeltaCoreGradients {
  RowMatrix<S> dmixed, dz, dbeta, dlog_a;
  Matrix<S> dconv_weight;
  Vector<S> dnorm_weight;
  std::vector<ShortConvState<S>> dconv_initial;  // B, with states
  std::vector<StateGradient<S>> dheads_initial;  // B·H, with states
};

// The forward between a layer's projections and its output projection, kept for the
// backward: the convolution's input and output (q | k | v), β, the log-decays, the attention
// outputs before the norm, the norm's gate.
template <class S>
struct DeltaCoreForward {
  const RowMatrix<S>& mixed;
  const Matrix<S>& conv_weight;
  const RowMatrix<S>& c;
  const RowMatrix<S>& beta;
  const RowMatrix<S>& log_a;
  const RowMatrix<S>& o;
  const RowMatrix<S>& z;
};

// From dn = ∂L/∂(the gated norm's output) back through the norm, the delta rule and the
// convolution (with SiLU, no bias), each packed sequence from its states in `st` (nullptr:
// zeros, and no gradients of the states).
template <class S, class Phi>
DeltaCoreGradients<S> delta_core_backward(OffsetsRef off, Index heads, Index key_dim,
                                          Index value_dim, const Phi& phi,
                                          const DeltaOptions& options, const DeltaCoreForward<S>& f,
                                          const Vector<S>& norm_weight,
                                          const GatedRMSNormOptions& norm_options,
                                          const Matrix<S>& dn, const DeltaCoreStates<S>* st) {
  const Index N = f.mixed.rows(), B = static_cast<Index>(off.size()) - 1;
  DeltaCoreGradients<S> g;
  auto gn = gated_rms_norm_backward(f.o, f.z, norm_weight, dn, norm_options);
  g.dnorm_weight = std::move(gn.dweight);
  g.dz = gn.dZ;
  RowMatrix<S> dc(N, f.c.cols());
  g.dbeta.resize(N, f.beta.cols());
  g.dlog_a.resize(N, f.log_a.cols());
  auto dq = dc.leftCols(key_dim);
  auto dk = dc.middleCols(key_dim, key_dim);
  auto dv = dc.rightCols(value_dim);
  MultiHeadWorkspace<S> ws;
  if (st) g.dheads_initial.resize(static_cast<std::size_t>(B * heads));
  packed_delta_backward(off, heads, phi, options, f.c.leftCols(key_dim),
                        f.c.middleCols(key_dim, key_dim), f.c.rightCols(value_dim), f.beta, f.log_a,
                        gn.dO, st ? st->heads.data() : nullptr,
                        st ? st->dheads_final.data() : nullptr, dq, dk, dv, g.dbeta, g.dlog_a,
                        st ? g.dheads_initial.data() : nullptr, ws);
  auto gc =
      batched_short_convolution_backward(f.mixed, f.conv_weight, Vector<S>(), off,
                                         st ? st->conv : std::vector<ShortConvState<S>>(), dc);
  g.dmixed = gc.dX;
  g.dconv_weight = std::move(gc.dweight);
  if (!st) return g;
  g.dconv_initial = std::move(gc.dinitial);
  // The final convolution state is the last W − 1 rows of [initial; mixed]: its gradient goes
  // to those rows.
  const Index L = f.conv_weight.cols() - 1;
  for (Index b = 0; b < B; ++b) {
    const auto& dfin = st->dconv_final[static_cast<std::size_t>(b)];
    if (dfin.size() == 0) continue;
    const Index r0 = off[static_cast<std::size_t>(b)];
    const Index n = off[static_cast<std::size_t>(b) + 1] - r0;
    for (Index r = 0; r < L; ++r) {
      if (n + r >= L)
        g.dmixed.row(r0 + n + r - L) += dfin.row(r);
      else
        g.dconv_initial[static_cast<std::size_t>(b)].row(n + r) += dfin.row(r);
    }
  }
  return g;
}

// The carried states of a backward from B layer states (nullptr: zeros) and their final
// states' gradients (nullptr or an empty vector: zeros), checked against the layer's shapes:
// (W − 1) x C convolution states, H heads of K x V.
template <class S>
DeltaCoreStates<S> core_states(const char* fn, const std::vector<DeltaLayerState<S>>* states,
                               const std::vector<DeltaLayerStateGradient<S>>* dfinals, Index B,
                               Index H, Index W, Index C, Index K, Index V) {
  DeltaCoreStates<S> st;
  if (!states) {
    st.conv.resize(static_cast<std::size_t>(B));
    st.heads.resize(static_cast<std::size_t>(B * H));
    return st;
  }
  const std::vector<DeltaLayerStateGradient<S>> none;
  const auto& dfinal = dfinals ? *dfinals : none;
  unpack_layer_states(fn, *states, B, H, st.conv, st.heads);
  const std::string conv_shape = shape_string(W - 1, C), head_shape = shape_string(K, V);
  for (Index b = 0; b < B; ++b) {
    const std::string at = "states[" + std::to_string(b) + "]";
    const auto& c = st.conv[static_cast<std::size_t>(b)];
    if (c.size() != 0 && (c.rows() != W - 1 || c.cols() != C))
      throw_invalid(fn, at + ".conv is " + shape_of(c) + " but must be empty or " + conv_shape);
    for (Index h = 0; h < H; ++h) {
      const auto& s = st.heads[static_cast<std::size_t>(b * H + h)];
      const bool lo_ok = s.S_lo.size() == 0 || (s.S_lo.rows() == K && s.S_lo.cols() == V);
      if (!s.empty() && (s.S.rows() != K || s.S.cols() != V || !lo_ok))
        throw_invalid(fn, at + ".heads[" + std::to_string(h) + "].S is " + shape_of(s.S) +
                              (lo_ok ? "" : " (S_lo " + shape_of(s.S_lo) + ")") + " but must be " +
                              head_shape);
    }
  }
  if (!dfinal.empty() && static_cast<Index>(dfinal.size()) != B)
    throw_invalid(fn, "dfinal holds " + std::to_string(dfinal.size()) +
                          " gradients but offsets give B = " + std::to_string(B));
  st.dconv_final.resize(static_cast<std::size_t>(B));
  st.dheads_final.resize(static_cast<std::size_t>(B * H));
  for (Index b = 0; b < static_cast<Index>(dfinal.size()); ++b) {
    const std::string at = "dfinal[" + std::to_string(b) + "]";
    const auto& d = dfinal[static_cast<std::size_t>(b)];
    if (d.conv.size() != 0 && (d.conv.rows() != W - 1 || d.conv.cols() != C))
      throw_invalid(fn,
                    at + ".conv is " + shape_of(d.conv) + " but must be empty or " + conv_shape);
    if (!d.heads.empty() && static_cast<Index>(d.heads.size()) != H)
      throw_invalid(fn, at + " holds " + std::to_string(d.heads.size()) +
                            " head gradients but the layer has " + std::to_string(H));
    st.dconv_final[static_cast<std::size_t>(b)] = d.conv;
    for (Index h = 0; h < static_cast<Index>(d.heads.size()); ++h) {
      const auto& dS = d.heads[static_cast<std::size_t>(h)].dS;
      if (dS.size() != 0 && (dS.rows() != K || dS.cols() != V))
        throw_invalid(fn, at + ".heads[" + std::to_string(h) + "].dS is " + shape_of(dS) +
                              " but must be empty or " + head_shape);
      st.dheads_final[static_cast<std::size_t>(b * H + h)].dS = dS;
    }
  }
  return st;
}

// The gradients of the initial states into the layer's form, one per sequence.
template <class S>
std::vector<DeltaLayerStateGradient<S>> layer_state_gradients(DeltaCoreGradients<S>& g, Index B,
                                                              Index H) {
  std::vector<DeltaLayerStateGradient<S>> d(static_cast<std::size_t>(B));
  for (Index b = 0; b < B; ++b) {
    auto& one = d[static_cast<std::size_t>(b)];
    one.conv = std::move(g.dconv_initial[static_cast<std::size_t>(b)]);
    const auto first = g.dheads_initial.begin() + static_cast<std::ptrdiff_t>(b * H);
    one.heads.assign(std::make_move_iterator(first), std::make_move_iterator(first + H));
  }
  return d;
}

// The initial states' gradients of a call of no rows: the final states' (each state passes
// through unchanged), zeros of the states' shapes where none was given.
template <class S>
std::vector<DeltaLayerStateGradient<S>> passed_state_gradients(const DeltaCoreStates<S>& st,
                                                               Index B, Index H, Index W, Index C,
                                                               Index K, Index V) {
  std::vector<DeltaLayerStateGradient<S>> d(static_cast<std::size_t>(B));
  for (Index b = 0; b < B; ++b) {
    auto& one = d[static_cast<std::size_t>(b)];
    one.conv = st.dconv_final[static_cast<std::size_t>(b)];
    if (one.conv.size() == 0) one.conv.setZero(W - 1, C);
    one.heads.resize(static_cast<std::size_t>(H));
    for (Index h = 0; h < H; ++h) {
      auto& dh = one.heads[static_cast<std::size_t>(h)];
      dh.dS = st.dheads_final[static_cast<std::size_t>(b * H + h)].dS;
      if (dh.dS.size() == 0) dh.dS.setZero(K, V);
      dh.dz.setZero(K);
    }
  }
  return d;
}

}  // namespace detail
}  // namespace linattn
