/// \file gated/gated_attention_gates.hpp
/// \brief Multi-head and batched gated linear attention with in-kernel gates: the raw
/// pre-activations a with the parameters A_log and dt_bias (in_kernel_gates()) in place of the
/// log gates, forward and backward (flash-linear-attention's `use_gate_in_kernel`, `A_log`,
/// `dt_bias`, `lower_bound`; docs/SPEC.md §10.2).
///
/// Each call runs gate_activation() on a into the workspace, then the kernel on the result: the
/// output, the states and the gradients are bit for bit those of the activation and the kernel
/// called in turn. Operands are float or double (bf16 and half: the two-step form).
#pragma once

#include <Eigen/Core>
#include <vector>

#include "../core/common.hpp"
#include "../core/in_kernel_gates.hpp"
#include "../core/parallel.hpp"
#include "../core/state.hpp"
#include "../linear/multihead_workspace.hpp"
#include "../maps/identity.hpp"
#include "detail/gated_gates.hpp"
#include "gated_attention.hpp"
#include "gated_attention_backward.hpp"
#include "options.hpp"

namespace linattn {

/// \brief Multi-head gated linear attention with in-kernel gates, each head from a zero state,
/// written into a caller's output; allocation-free once `ws` has the shape.
///
/// Column j = h·C + c of `a` (head h, channel c) gives the log gate g(t, j) =
/// −exp(A_log_h)·softplus(a(t, j) + dt_bias_j) (Mamba-2's −Δ_t·A with Δ_t = softplus(a + dt_bias)),
/// or lb·sigmoid(exp(A_log_h)·(a(t, j) + dt_bias_j)) (the gates' GateOptions); C = 1 (a N x H,
/// one decay per head) or F (a N x H·F, per-feature gates). Then as
/// multihead_gated_linear_attention() with those log gates; g is kept in `ws`.
/// \throws std::invalid_argument before anything is computed, naming the function and the
/// shapes: on a, A_log (H entries) or dt_bias (H·C, or empty) of the wrong shape, a non-finite
/// entry of a, A_log or dt_bias, a lower bound that is not finite and < 0, and everything
/// multihead_gated_linear_attention() rejects (a g that overflows to −inf included).
/// \code
/// // Mamba-2-style decays: a = x W_dt (N x 8), A_log and dt_bias of 8 entries.
/// linattn::GatedOptions opts;
/// opts.scale = 1.0 / std::sqrt(64.0);
/// linattn::MultiHeadWorkspace<float> ws;
/// Eigen::MatrixXf out(N, 8 * 64);
/// linattn::multihead_gated_linear_attention(Q, K, V, a, linattn::in_kernel_gates(A_log, dt_bias),
///                                           8, linattn::Identity{}, out, ws, opts);
/// \endcode
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V N x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param a N x H or N x H·F pre-activations of the gate.
/// \param gates A_log, dt_bias and the gate's form (in_kernel_gates()).
/// \param heads H, the number of value heads.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output; must not overlap the inputs.
/// \param ws scratch per thread reused across calls (g included).
/// \param options the query scale, normalisation, algorithm, chunk size and key heads.
/// \param par the threads (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DAr, class DL, class DT, class Phi, class DOut>
void multihead_gated_linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                      const Eigen::MatrixBase<DK>& K,
                                      const Eigen::MatrixBase<DV>& V,
                                      const Eigen::MatrixBase<DAr>& a,
                                      const InKernelGates<DL, DT>& gates, Index heads,
                                      const Phi& phi, const Eigen::MatrixBase<DOut>& out,
                                      MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                      const GatedOptions& options = {},
                                      const ParallelOptions& par = {}) {
  const Index offsets[2] = {0, Q.rows()};
  detail::batched_gated_gates("multihead_gated_linear_attention", Q, K, V, a, gates,
                              detail::OffsetsRef(offsets, 2), heads, phi, nullptr, out, ws,
                              options, par);
}

/// \brief Multi-head gated linear attention with in-kernel gates carrying the H heads' states
/// in and out (an empty vector is resized to H zero states; see the zero-state form).
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V N x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param a N x H or N x H·F pre-activations of the gate.
/// \param gates A_log, dt_bias and the gate's form (in_kernel_gates()).
/// \param heads H, the number of value heads.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param states one state per head, continued from and updated in place.
/// \param out receives the N x H·M output; must not overlap the inputs.
/// \param ws scratch per thread reused across calls (g included).
/// \param options the query scale, normalisation, algorithm, chunk size and key heads.
/// \param par the threads (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DAr, class DL, class DT, class Phi, class DOut>
void multihead_gated_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DAr>& a, const InKernelGates<DL, DT>& gates, Index heads,
    const Phi& phi, std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>& states,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws, const GatedOptions& options = {},
    const ParallelOptions& par = {}) {
  const Index offsets[2] = {0, Q.rows()};
  detail::batched_gated_gates("multihead_gated_linear_attention", Q, K, V, a, gates,
                              detail::OffsetsRef(offsets, 2), heads, phi, &states, out, ws,
                              options, par);
}

/// \brief Gated linear attention with in-kernel gates over B packed sequences (rows
/// [offsets[b], offsets[b+1]), as cu_seqlens), each from a zero state (see the multi-head form).
/// \code
/// linattn::batched_gated_linear_attention(Q, K, V, a, linattn::in_kernel_gates(A_log, dt_bias),
///                                         cu_seqlens, 8, linattn::Identity{}, out, ws, opts);
/// \endcode
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V N x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param a N x H or N x H·F pre-activations of the gate.
/// \param gates A_log, dt_bias and the gate's form (in_kernel_gates()).
/// \param offsets B + 1 row offsets of the packed sequences (any integer type).
/// \param heads H, the number of value heads.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output; must not overlap the inputs.
/// \param ws scratch per thread reused across calls (g included).
/// \param options the query scale, normalisation, algorithm, chunk size and key heads.
/// \param par the threads (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DAr, class DL, class DT, class Off, class Phi,
          class DOut>
void batched_gated_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DAr>& a,
                                    const InKernelGates<DL, DT>& gates, const Off& offsets,
                                    Index heads, const Phi& phi, const Eigen::MatrixBase<DOut>& out,
                                    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                    const GatedOptions& options = {},
                                    const ParallelOptions& par = {}) {
  const char* fn = "batched_gated_linear_attention";
  detail::batched_gated_gates(fn, Q, K, V, a, gates, detail::offsets_of(fn, "offsets", offsets),
                              heads, phi, nullptr, out, ws, options, par);
}

/// \brief batched_gated_linear_attention() with in-kernel gates carrying the B·H states in and
/// out (sequence-major, head h of sequence b at b·H + h; an empty vector is resized to B·H zero
/// states).
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V N x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param a N x H or N x H·F pre-activations of the gate.
/// \param gates A_log, dt_bias and the gate's form (in_kernel_gates()).
/// \param offsets B + 1 row offsets of the packed sequences (any integer type).
/// \param heads H, the number of value heads.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param states B·H states, continued from and updated in place.
/// \param out receives the N x H·M output; must not overlap the inputs.
/// \param ws scratch per thread reused across calls (g included).
/// \param options the query scale, normalisation, algorithm, chunk size and key heads.
/// \param par the threads (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DAr, class DL, class DT, class Off, class Phi,
          class DOut>
void batched_gated_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DAr>& a, const InKernelGates<DL, DT>& gates, const Off& offsets,
    Index heads, const Phi& phi,
    std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>& states,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws, const GatedOptions& options = {},
    const ParallelOptions& par = {}) {
  const char* fn = "batched_gated_linear_attention";
  detail::batched_gated_gates(fn, Q, K, V, a, gates, detail::offsets_of(fn, "offsets", offsets),
                              heads, phi, &states, out, ws, options, par);
}

/// \brief Gradients of multihead_gated_linear_attention() with in-kernel gates (each head from
/// a zero state), written into caller buffers: the kernel's backward
/// (multihead_gated_linear_attention_backward()) on the activated g, chained with
/// gate_activation_backward(), bit for bit that composition. ∂L/∂g is kept in `ws`.
/// \code
/// linattn::multihead_gated_linear_attention_backward(
///     Q, K, V, a, linattn::in_kernel_gates(A_log, dt_bias), dOut, 8, linattn::Identity{}, dQ, dK,
///     dV, da, dA_log, ddt_bias, ws, opts);
/// \endcode
/// \throws std::invalid_argument as the forward, and on gradients of the wrong shape or
/// overlapping an input.
/// \param Q N x Hk·D queries.
/// \param K N x Hk·D keys.
/// \param V N x H·M values.
/// \param a N x H or N x H·F pre-activations of the gate.
/// \param gates A_log, dt_bias and the gate's form.
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of value heads.
/// \param phi the feature map of queries and keys.
/// \param dQ receives ∂L/∂Q (a shared head's: the sum over its value heads).
/// \param dK receives ∂L/∂K.
/// \param dV receives ∂L/∂V.
/// \param da receives ∂L/∂a, the shape of a.
/// \param dA_log receives ∂L/∂A_log, H entries.
/// \param ddt_bias receives ∂L/∂dt_bias, H·C entries (untouched when dt_bias is empty).
/// \param ws scratch per thread reused across calls.
/// \param options as in the forward call.
/// \param par the threads (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DAr, class DL, class DT, class DO, class Phi,
          class DdQ, class DdK, class DdV, class DdA, class DdL, class DdT>
void multihead_gated_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DAr>& a, const InKernelGates<DL, DT>& gates,
    const Eigen::MatrixBase<DO>& dOut, Index heads, const Phi& phi,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, const Eigen::MatrixBase<DdA>& da,
    const Eigen::MatrixBase<DdL>& dA_log, const Eigen::MatrixBase<DdT>& ddt_bias,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws, const GatedOptions& options = {},
    const ParallelOptions& par = {}) {
  const char* fn = "multihead_gated_linear_attention_backward";
  detail::check_gated_gates(fn, Q, K, V, a, gates, heads, phi, options);
  detail::check_gate_gradients(fn, a, gates, da, dA_log, ddt_bias);
  const auto inputs = [&](const auto& x) {
    detail::check_no_overlap(fn, x, "Q", Q, "K", K, "V", V, "dOut", dOut, "a", a, "A_log",
                             gates.A_log, "dt_bias", gates.dt_bias);
  };
  inputs(da), inputs(dA_log), inputs(ddt_bias);
  detail::check_no_overlap(fn, dQ, "a", a);
  detail::check_no_overlap(fn, dK, "a", a);
  detail::check_no_overlap(fn, dV, "a", a);
  const auto g = detail::activate_gated_gates(a, gates, ws, par);
  auto dg = detail::gate_buffer(ws.for_thread(0).gate_buffers(), 2, a.rows(), a.cols());
  multihead_gated_linear_attention_backward(Q, K, V, g, dOut, heads, phi, dQ, dK, dV, dg, ws,
                                            options, par);
  detail::apply_gate_activation_backward(a, gates.A_log, gates.dt_bias, dg, da, dA_log, ddt_bias,
                                         gates.options);
}

/// \brief Gradients of multihead_gated_linear_attention() with in-kernel gates (each head from
/// a zero state), returned: GatedGateGradients holds those of Q, K, V, of the raw inputs (da,
/// dA_log, ddt_bias) and the kernel's dlog_gates of the activated g.
/// \code
/// auto g = linattn::multihead_gated_linear_attention_backward(
///     Q, K, V, a, linattn::in_kernel_gates(A_log, dt_bias), dOut, 8);
/// \endcode
/// \param Q N x Hk·D queries.
/// \param K N x Hk·D keys.
/// \param V N x H·M values.
/// \param a N x H or N x H·F pre-activations of the gate.
/// \param gates A_log, dt_bias and the gate's form.
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of value heads.
/// \param phi the feature map of queries and keys.
/// \param options as in the forward call.
/// \param par the threads (default: the OpenMP threads, or one).
/// \return the gradients.
template <class DQ, class DK, class DV, class DAr, class DL, class DT, class DO,
          class Phi = Identity>
GatedGateGradients<typename DQ::Scalar> multihead_gated_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DAr>& a, const InKernelGates<DL, DT>& gates,
    const Eigen::MatrixBase<DO>& dOut, Index heads, const Phi& phi = Phi{},
    const GatedOptions& options = {}, const ParallelOptions& par = {}) {
  using Scalar = typename DQ::Scalar;
  GatedGateGradients<Scalar> g;
  g.dQ.resize(Q.rows(), Q.cols());
  g.dK.resize(K.rows(), K.cols());
  g.dV.resize(V.rows(), V.cols());
  g.da.resize(a.rows(), a.cols());
  g.dA_log.resize(gates.A_log.size());
  g.ddt_bias.resize(gates.dt_bias.size());
  MultiHeadWorkspace<compute_scalar_t<Scalar>> ws;
  multihead_gated_linear_attention_backward(Q, K, V, a, gates, dOut, heads, phi, g.dQ, g.dK, g.dV,
                                            g.da, g.dA_log, g.ddt_bias, ws, options, par);
  // The kernel's gradient of the activated g, as the two-step form's kernel gives it.
  g.dlog_gates = detail::gate_buffer(ws.for_thread(0).gate_buffers(), 2, a.rows(), a.cols());
  return g;
}

}  // namespace linattn
