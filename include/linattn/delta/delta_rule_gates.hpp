/// \file delta/delta_rule_gates.hpp
/// \brief The multi-head and batched delta rule with in-kernel gates and β: the raw
/// pre-activations a and b with the parameters A_log and dt_bias (in_kernel_gates()) in place of
/// g and β, forward and backward (flash-linear-attention's `use_gate_in_kernel`,
/// `use_beta_sigmoid_in_kernel`, `allow_neg_eigval` of chunk_kda and fused_recurrent_kda;
/// docs/SPEC.md §10.2).
///
/// Each call runs gate_activation() on a and beta_activation() on b (as
/// DeltaOptions::beta_activation says) into the workspace, then the kernel on them: the output,
/// the states and the gradients are bit for bit those of the activations and the kernel called in
/// turn. Operands are float or double (bf16 and half: the two-step form).
#pragma once

#include <Eigen/Core>
#include <vector>

#include "../core/common.hpp"
#include "../core/detail/result.hpp"
#include "../core/in_kernel_gates.hpp"
#include "../core/parallel.hpp"
#include "../core/state.hpp"
#include "../linear/multihead_workspace.hpp"
#include "../maps/identity.hpp"
#include "delta_rule.hpp"
#include "delta_rule_backward.hpp"
#include "detail/delta_gates.hpp"
#include "options.hpp"

namespace linattn {

/// \brief The multi-head delta rule with in-kernel gates, each head from a zero state, written
/// into a caller's output; allocation-free once `ws` has the shape.
///
/// Column j = h·C + c of `a` (head h, channel c) gives g(t, j) = −exp(A_log_h)·softplus(a(t, j)
/// + dt_bias_j), or KDA's lb·sigmoid(exp(A_log_h)·(a(t, j) + dt_bias_j)) (the gates' GateOptions);
/// C = 1 (Gated DeltaNet: a N x H) or F (KDA: a N x H·F, one decay per key channel), or a empty
/// (DeltaNet, no decay). β(t, h) is b(t, h), sigmoid(b(t, h)) or 2·sigmoid(b(t, h))
/// (DeltaOptions::beta_activation). Then as multihead_delta_rule_attention() with that β and g
/// (shared key heads, algorithms and scale as there). g and β are kept in `ws`.
/// \throws std::invalid_argument before anything is computed, naming the function and the
/// shapes: on a, b, A_log (H entries) or dt_bias (H·C, or empty) of the wrong shape, a
/// non-finite entry of a, A_log, dt_bias or (activated) b, a lower bound that is not finite and
/// < 0, and everything multihead_delta_rule_attention() rejects (a g that overflows to −inf from
/// a huge A_log included).
/// \code
/// // Qwen3-Next: 32 value heads over 16 query/key heads of 128; a = x W_a, b = x W_b (N x 32),
/// // A_log and dt_bias the layer's 32 parameters each.
/// linattn::DeltaOptions opts;
/// opts.key_heads = 16;
/// opts.scale = 1.0 / std::sqrt(128.0);
/// opts.beta_activation = linattn::BetaActivation::Sigmoid;
/// linattn::MultiHeadWorkspace<float> ws;
/// Eigen::MatrixXf out(N, 32 * 128);
/// linattn::multihead_delta_rule_attention(Q, K, V, b, a, linattn::in_kernel_gates(A_log, dt_bias),
///                                         32, linattn::L2Normalize<>(1e-6), out, ws, opts);
/// // KDA: a N x H·K (one per key channel), the lower-bounded gate, β ∈ (0, 2).
/// linattn::GateOptions kda;
/// kda.activation = linattn::GateActivation::LowerBoundSigmoid;
/// opts.beta_activation = linattn::BetaActivation::SigmoidTimesTwo;
/// linattn::multihead_delta_rule_attention(Q, K, V, b, a_kda,
///                                         linattn::in_kernel_gates(A_log, dt_bias_kda, kda), 32,
///                                         linattn::L2Normalize<>(1e-6), out, ws, opts);
/// \endcode
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V N x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param b N x H pre-activations of β (β itself with BetaActivation::None).
/// \param a N x H or N x H·F pre-activations of the gate, or empty for no decay.
/// \param gates A_log, dt_bias and the gate's form (in_kernel_gates()).
/// \param heads H, the number of value heads.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output; must not overlap the inputs.
/// \param ws scratch per thread reused across calls (g and β included).
/// \param options the query scale, algorithm, chunk size, key heads and β activation.
/// \param par the threads (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DBr, class DAr, class DL, class DT, class Phi,
          class DOut>
void multihead_delta_rule_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DBr>& b,
                                    const Eigen::MatrixBase<DAr>& a,
                                    const InKernelGates<DL, DT>& gates, Index heads, const Phi& phi,
                                    const Eigen::MatrixBase<DOut>& out,
                                    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                    const DeltaOptions& options = {},
                                    const ParallelOptions& par = {}) {
  const Index offsets[2] = {0, Q.rows()};
  detail::batched_delta_gates("multihead_delta_rule_attention", Q, K, V, b, a, gates,
                              detail::OffsetsRef(offsets, 2), heads, phi, nullptr, out, ws,
                              options, par);
}

/// \brief The multi-head delta rule with in-kernel gates carrying the H heads' states in and out
/// (an empty vector is resized to H zero states; see the zero-state form).
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V N x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param b N x H pre-activations of β (β itself with BetaActivation::None).
/// \param a N x H or N x H·F pre-activations of the gate, or empty for no decay.
/// \param gates A_log, dt_bias and the gate's form (in_kernel_gates()).
/// \param heads H, the number of value heads.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param states one state per head, continued from and updated in place.
/// \param out receives the N x H·M output; must not overlap the inputs.
/// \param ws scratch per thread reused across calls (g and β included).
/// \param options the query scale, algorithm, chunk size, key heads and β activation.
/// \param par the threads (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DBr, class DAr, class DL, class DT, class Phi,
          class DOut>
void multihead_delta_rule_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DBr>& b, const Eigen::MatrixBase<DAr>& a,
    const InKernelGates<DL, DT>& gates, Index heads, const Phi& phi,
    std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>& states,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws, const DeltaOptions& options = {},
    const ParallelOptions& par = {}) {
  const Index offsets[2] = {0, Q.rows()};
  detail::batched_delta_gates("multihead_delta_rule_attention", Q, K, V, b, a, gates,
                              detail::OffsetsRef(offsets, 2), heads, phi, &states, out, ws,
                              options, par);
}

/// \brief The delta rule with in-kernel gates over B packed sequences (rows [offsets[b],
/// offsets[b+1]), as cu_seqlens), each from a zero state (see the multi-head form).
/// \code
/// Eigen::VectorXi cu_seqlens(3);
/// cu_seqlens << 0, 100, 128;
/// linattn::batched_delta_rule_attention(Q, K, V, b, a, linattn::in_kernel_gates(A_log, dt_bias),
///                                       cu_seqlens, 32, linattn::L2Normalize<>(1e-6), out, ws,
///                                       opts);
/// \endcode
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V N x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param b N x H pre-activations of β (β itself with BetaActivation::None).
/// \param a N x H or N x H·F pre-activations of the gate, or empty for no decay.
/// \param gates A_log, dt_bias and the gate's form (in_kernel_gates()).
/// \param offsets B + 1 row offsets of the packed sequences (any integer type).
/// \param heads H, the number of value heads.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output; must not overlap the inputs.
/// \param ws scratch per thread reused across calls (g and β included).
/// \param options the query scale, algorithm, chunk size, key heads and β activation.
/// \param par the threads (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DBr, class DAr, class DL, class DT, class Off,
          class Phi, class DOut>
void batched_delta_rule_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                  const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DBr>& b,
                                  const Eigen::MatrixBase<DAr>& a,
                                  const InKernelGates<DL, DT>& gates, const Off& offsets,
                                  Index heads, const Phi& phi, const Eigen::MatrixBase<DOut>& out,
                                  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                  const DeltaOptions& options = {},
                                  const ParallelOptions& par = {}) {
  const char* fn = "batched_delta_rule_attention";
  detail::batched_delta_gates(fn, Q, K, V, b, a, gates, detail::offsets_of(fn, "offsets", offsets),
                              heads, phi, nullptr, out, ws, options, par);
}

/// \brief batched_delta_rule_attention() with in-kernel gates carrying the B·H states in and
/// out (sequence-major, head h of sequence b at b·H + h; an empty vector is resized to B·H zero
/// states).
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V N x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param b N x H pre-activations of β (β itself with BetaActivation::None).
/// \param a N x H or N x H·F pre-activations of the gate, or empty for no decay.
/// \param gates A_log, dt_bias and the gate's form (in_kernel_gates()).
/// \param offsets B + 1 row offsets of the packed sequences (any integer type).
/// \param heads H, the number of value heads.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param states B·H states, continued from and updated in place.
/// \param out receives the N x H·M output; must not overlap the inputs.
/// \param ws scratch per thread reused across calls (g and β included).
/// \param options the query scale, algorithm, chunk size, key heads and β activation.
/// \param par the threads (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DBr, class DAr, class DL, class DT, class Off,
          class Phi, class DOut>
void batched_delta_rule_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DBr>& b, const Eigen::MatrixBase<DAr>& a,
    const InKernelGates<DL, DT>& gates, const Off& offsets, Index heads, const Phi& phi,
    std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>& states,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws, const DeltaOptions& options = {},
    const ParallelOptions& par = {}) {
  const char* fn = "batched_delta_rule_attention";
  detail::batched_delta_gates(fn, Q, K, V, b, a, gates, detail::offsets_of(fn, "offsets", offsets),
                              heads, phi, &states, out, ws, options, par);
}

/// \brief Gradients of multihead_delta_rule_attention() with in-kernel gates (each head from a
/// zero state), written into caller buffers: the kernel's backward
/// (multihead_delta_rule_attention_backward()) on the activated g and β, chained with
/// gate_activation_backward() and beta_activation_backward(), bit for bit that composition.
/// ∂L/∂g and ∂L/∂β are kept in `ws`.
/// \code
/// linattn::multihead_delta_rule_attention_backward(
///     Q, K, V, b, a, linattn::in_kernel_gates(A_log, dt_bias), dOut, 32, phi, dQ, dK, dV, db, da,
///     dA_log, ddt_bias, ws, opts);
/// \endcode
/// \throws std::invalid_argument as the forward, and on gradients of the wrong shape or
/// overlapping an input.
/// \param Q N x Hk·D queries.
/// \param K N x Hk·D keys.
/// \param V N x H·M values.
/// \param b N x H pre-activations of β (β itself with BetaActivation::None).
/// \param a N x H or N x H·F pre-activations of the gate, or empty.
/// \param gates A_log, dt_bias and the gate's form.
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of value heads.
/// \param phi the feature map of queries and keys.
/// \param dQ receives ∂L/∂Q (a shared head's: the sum over its value heads).
/// \param dK receives ∂L/∂K.
/// \param dV receives ∂L/∂V.
/// \param db receives ∂L/∂b, N x H (∂L/∂β with BetaActivation::None).
/// \param da receives ∂L/∂a, the shape of a.
/// \param dA_log receives ∂L/∂A_log, H entries.
/// \param ddt_bias receives ∂L/∂dt_bias, H·C entries (untouched when dt_bias is empty).
/// \param ws scratch per thread reused across calls.
/// \param options as in the forward call.
/// \param par the threads (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DBr, class DAr, class DL, class DT, class DO,
          class Phi, class DdQ, class DdK, class DdV, class DdB, class DdA, class DdL, class DdT>
void multihead_delta_rule_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DBr>& b, const Eigen::MatrixBase<DAr>& a,
    const InKernelGates<DL, DT>& gates, const Eigen::MatrixBase<DO>& dOut, Index heads,
    const Phi& phi, const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, const Eigen::MatrixBase<DdB>& db,
    const Eigen::MatrixBase<DdA>& da, const Eigen::MatrixBase<DdL>& dA_log,
    const Eigen::MatrixBase<DdT>& ddt_bias,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws, const DeltaOptions& options = {},
    const ParallelOptions& par = {}) {
  using Scalar = compute_scalar_t<typename DQ::Scalar>;
  detail::multihead_delta_gates_backward(
      "multihead_delta_rule_attention_backward", Q, K, V, b, a, gates, dOut, heads, phi,
      static_cast<const LinearAttentionState<Scalar>*>(nullptr),
      static_cast<const StateGradient<Scalar>*>(nullptr), dQ, dK, dV, db, da, dA_log, ddt_bias,
      static_cast<StateGradient<Scalar>*>(nullptr), ws, options, par);
}

/// \brief Gradients of the multi-head delta rule with in-kernel gates continuing from carried
/// states: head h started from initial[h] and ∂L/∂S of its final state is d_final[h] (each
/// vector H long, or empty: zeros); d_initial receives ∂L/∂S of the H initial states.
/// \param Q N x Hk·D queries.
/// \param K N x Hk·D keys.
/// \param V N x H·M values.
/// \param b N x H pre-activations of β (β itself with BetaActivation::None).
/// \param a N x H or N x H·F pre-activations of the gate, or empty.
/// \param gates A_log, dt_bias and the gate's form.
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of value heads.
/// \param phi the feature map of queries and keys.
/// \param initial the H states the forward started from (or empty: zero).
/// \param d_final ∂L/∂S of the H states it left (or empty: zero).
/// \param dQ receives ∂L/∂Q.
/// \param dK receives ∂L/∂K.
/// \param dV receives ∂L/∂V.
/// \param db receives ∂L/∂b, N x H (∂L/∂β with BetaActivation::None).
/// \param da receives ∂L/∂a, the shape of a.
/// \param dA_log receives ∂L/∂A_log, H entries.
/// \param ddt_bias receives ∂L/∂dt_bias, H·C entries (untouched when dt_bias is empty).
/// \param d_initial resized to H, receives ∂L/∂S of each initial state.
/// \param ws scratch per thread reused across calls.
/// \param options as in the forward call.
/// \param par the threads (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DBr, class DAr, class DL, class DT, class DO,
          class Phi, class DdQ, class DdK, class DdV, class DdB, class DdA, class DdL, class DdT>
void multihead_delta_rule_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DBr>& b, const Eigen::MatrixBase<DAr>& a,
    const InKernelGates<DL, DT>& gates, const Eigen::MatrixBase<DO>& dOut, Index heads,
    const Phi& phi,
    const std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>& initial,
    const std::vector<StateGradient<compute_scalar_t<typename DQ::Scalar>>>& d_final,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, const Eigen::MatrixBase<DdB>& db,
    const Eigen::MatrixBase<DdA>& da, const Eigen::MatrixBase<DdL>& dA_log,
    const Eigen::MatrixBase<DdT>& ddt_bias,
    std::vector<StateGradient<compute_scalar_t<typename DQ::Scalar>>>& d_initial,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws, const DeltaOptions& options = {},
    const ParallelOptions& par = {}) {
  const char* fn = "multihead_delta_rule_attention_backward";
  const auto count = [&](const char* name, std::size_t n) {
    if (n != 0 && n != static_cast<std::size_t>(heads))
      detail::throw_invalid(fn, std::string(name) + " holds " + std::to_string(n) +
                                    " states but must hold 0 or H = " + std::to_string(heads));
  };
  count("initial", initial.size());
  count("d_final", d_final.size());
  if (heads > 0) d_initial.resize(static_cast<std::size_t>(heads));
  detail::multihead_delta_gates_backward(fn, Q, K, V, b, a, gates, dOut, heads, phi,
                                         initial.empty() ? nullptr : initial.data(),
                                         d_final.empty() ? nullptr : d_final.data(), dQ, dK, dV,
                                         db, da, dA_log, ddt_bias, d_initial.data(), ws, options,
                                         par);
}

/// \brief Gradients of multihead_delta_rule_attention() with in-kernel gates (each head from a
/// zero state), returned: DeltaGateGradients holds those of the raw inputs (db, da, dA_log,
/// ddt_bias) and the kernel's dbeta and dlog_a of the activated β and g.
/// \code
/// auto g = linattn::multihead_delta_rule_attention_backward(
///     Q, K, V, b, a, linattn::in_kernel_gates(A_log, dt_bias), dOut, 32,
///     linattn::L2Normalize<>(1e-6), opts);
/// \endcode
/// \param Q N x Hk·D queries.
/// \param K N x Hk·D keys.
/// \param V N x H·M values.
/// \param b N x H pre-activations of β (β itself with BetaActivation::None).
/// \param a N x H or N x H·F pre-activations of the gate, or empty.
/// \param gates A_log, dt_bias and the gate's form.
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of value heads.
/// \param phi the feature map of queries and keys.
/// \param options as in the forward call.
/// \param par the threads (default: the OpenMP threads, or one).
/// \return the gradients.
template <class DQ, class DK, class DV, class DBr, class DAr, class DL, class DT, class DO,
          class Phi = Identity>
DeltaGateGradients<typename DQ::Scalar> multihead_delta_rule_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DBr>& b, const Eigen::MatrixBase<DAr>& a,
    const InKernelGates<DL, DT>& gates, const Eigen::MatrixBase<DO>& dOut, Index heads,
    const Phi& phi = Phi{}, const DeltaOptions& options = {}, const ParallelOptions& par = {}) {
  using Scalar = typename DQ::Scalar;
  DeltaGateGradients<Scalar> g;
  g.dQ.resize(Q.rows(), Q.cols());
  g.dK.resize(K.rows(), K.cols());
  g.dV.resize(V.rows(), V.cols());
  g.db.resize(b.rows(), b.cols());
  g.da.resize(a.rows(), a.cols());
  g.dA_log.resize(gates.A_log.size());
  g.ddt_bias.resize(gates.dt_bias.size());
  MultiHeadWorkspace<compute_scalar_t<Scalar>> ws;
  multihead_delta_rule_attention_backward(Q, K, V, b, a, gates, dOut, heads, phi, g.dQ, g.dK, g.dV,
                                          g.db, g.da, g.dA_log, g.ddt_bias, ws, options, par);
  // The kernel's gradients of the activated β and g, as the two-step form's kernel gives them.
  auto& buf = ws.for_thread(0).gate_buffers();
  g.dbeta = detail::gate_buffer(buf, 3, b.rows(), b.cols());
  g.dlog_a = detail::gate_buffer(buf, 2, a.rows(), a.cols());
  return g;
}

}  // namespace linattn
