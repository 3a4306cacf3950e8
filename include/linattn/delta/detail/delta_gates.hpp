// The delta rule with in-kernel gates (delta_rule_gates.hpp): every check of the raw inputs,
// the activations into the workspace's gate buffers, then the kernel and its backward on them.
#pragma once

#include <Eigen/Core>
#include <string>
#include <type_traits>
#include <vector>

#include "../../core/common.hpp"
#include "../../core/detail/checks.hpp"
#include "../../core/gates.hpp"
#include "../../core/in_kernel_gates.hpp"
#include "../../core/parallel.hpp"
#include "../../core/state.hpp"
#include "../../linear/heads.hpp"
#include "../../linear/multihead_workspace.hpp"
#include "../delta_rule.hpp"
#include "../delta_rule_backward.hpp"
#include "../options.hpp"

namespace linattn {
namespace detail {

template <class Storage>
constexpr void static_check_in_kernel_gates() {
  static_assert(std::is_same_v<Storage, compute_scalar_t<Storage>>,
                "linattn: the in-kernel gates take float or double operands; for bf16 or half "
                "ones call gate_activation() and beta_activation() before the kernel");
}

// b: N x H, finite when it is activated (BetaActivation::None: β itself, the kernel checks its
// range).
template <class DBr, class Shapes>
void check_in_kernel_beta(const char* fn, const Eigen::MatrixBase<DBr>& b, Index N, Index heads,
                          const DeltaOptions& opts, const Shapes& shapes) {
  if (b.rows() != N || b.cols() != heads)
    throw_invalid(fn, "b is " + shape_of(b) + " but must be " + shape_string(N, heads) +
                          " (one entry per token and head, H = " + std::to_string(heads) + ")" +
                          shapes());
  if (opts.beta_activation != BetaActivation::None) check_finite_entries(fn, "b", b);
}

// The checks shared by the forward and the backward, before any work: the layout, the gate's
// parameters and inputs, b. Returns F.
template <class DQ, class DK, class DV, class DBr, class DAr, class DL, class DT, class Phi>
Index check_delta_gates(const char* fn, const Eigen::MatrixBase<DQ>& Q,
                        const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                        const Eigen::MatrixBase<DBr>& b, const Eigen::MatrixBase<DAr>& a,
                        const InKernelGates<DL, DT>& gates, Index heads, const Phi& phi,
                        const DeltaOptions& opts) {
  static_check_in_kernel_gates<typename DQ::Scalar>();
  static_check_delta<Phi, typename DQ::Scalar>();
  const HeadLayout hl = check_grouped_heads(fn, Q, K, V, heads, opts.key_heads, true);
  check_head_dims(fn, Q, V, heads, hl.key_heads, opts.key_dim, opts.value_dim, "b");
  check_feature_map(fn, phi, hl.D);
  const Index F = phi.feature_dim(hl.D);
  const auto shapes = qkv_shapes(Q, K, V);
  check_in_kernel_gate(fn, a, gates, Q.rows(), heads, F, /*may_be_empty=*/true, shapes);
  check_in_kernel_beta(fn, b, Q.rows(), heads, opts, shapes);
  DeltaOptions plain = opts;
  plain.beta_activation = BetaActivation::None;
  check_delta_chunk_size(fn, plain);
  return F;
}

// g and β of an in-kernel call into the gate buffers of `ws` (slots 0 and 1): the activations'
// own code, so the kernel reads the bits the two-step composition hands it. β given
// (BetaActivation::None) is copied, so that one instantiation of the kernel serves both.
template <class DBr, class DAr, class DL, class DT, class Scalar>
std::pair<Eigen::Map<Matrix<Scalar>>, Eigen::Map<Matrix<Scalar>>> activate_delta_gates(
    const Eigen::MatrixBase<DBr>& b, const Eigen::MatrixBase<DAr>& a,
    const InKernelGates<DL, DT>& gates, MultiHeadWorkspace<Scalar>& ws, const DeltaOptions& opts,
    const ParallelOptions& par) {
  // Thread 0's workspace holds them; growing the list of workspaces moves it, and a move keeps
  // an Eigen vector's memory where it is.
  StorageCopies<Scalar>& buf = ws.for_thread(0).gate_buffers();
  auto g = gate_buffer(buf, 0, a.rows(), a.cols());
  auto beta = gate_buffer(buf, 1, b.rows(), b.cols());
  if (a.size()) apply_gate_activation(a, gates.A_log, gates.dt_bias, g, gates.options, par);
  if (opts.beta_activation == BetaActivation::None)
    beta = b.template cast<Scalar>();
  else
    apply_beta_activation(b, beta, opts.beta_activation == BetaActivation::SigmoidTimesTwo, par);
  return {g, beta};
}

template <class DQ, class DK, class DV, class DBr, class DAr, class DL, class DT, class Phi,
          class DOut>
void batched_delta_gates(const char* fn, const Eigen::MatrixBase<DQ>& Q,
                         const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                         const Eigen::MatrixBase<DBr>& b, const Eigen::MatrixBase<DAr>& a,
                         const InKernelGates<DL, DT>& gates, const OffsetsRef& offsets,
                         Index heads, const Phi& phi,
                         std::vector<LinearAttentionState<typename DQ::Scalar>>* states,
                         const Eigen::MatrixBase<DOut>& out,
                         MultiHeadWorkspace<typename DQ::Scalar>& ws, const DeltaOptions& opts,
                         const ParallelOptions& par) {
  check_delta_gates(fn, Q, K, V, b, a, gates, heads, phi, opts);
  check_output(fn, out, Q.rows(), V.cols());
  check_no_overlap(fn, out, "a", a, "b", b);
  check_offsets(fn, "offsets", offsets, Q.rows());
  if (states) {
    const StateApart apart("out", out, "a", a, "b", b);
    for (std::size_t i = 0; i < states->size(); ++i)
      apart.check(fn, (*states)[i], "states", Index(i));
  }
  const auto gb = activate_delta_gates(b, a, gates, ws, opts, par);
  DeltaOptions plain = opts;
  plain.beta_activation = BetaActivation::None;
  batched_delta(fn, Q, K, V, gb.second, gb.first, offsets, heads, phi, states, out, ws, plain,
                par);
}

// The backward of the multi-head form: the activations again (into the gate buffers), the
// kernel's backward into ∂L/∂g and ∂L/∂β (slots 2 and 3), then the activations' backward into
// the caller's da, dA_log, ddt_bias and db. `initial`, `d_final` and `d_initial` as in
// multihead_delta_backward() (H each, or nullptr).
template <class DQ, class DK, class DV, class DBr, class DAr, class DL, class DT, class DO,
          class Phi, class DdQ, class DdK, class DdV, class DdB, class DdA, class DdL, class DdT,
          class Scalar = typename DQ::Scalar>
void multihead_delta_gates_backward(
    const char* fn, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DBr>& b,
    const Eigen::MatrixBase<DAr>& a, const InKernelGates<DL, DT>& gates,
    const Eigen::MatrixBase<DO>& dOut, Index heads, const Phi& phi,
    const LinearAttentionState<Scalar>* initial, const StateGradient<Scalar>* d_final,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, const Eigen::MatrixBase<DdB>& db,
    const Eigen::MatrixBase<DdA>& da, const Eigen::MatrixBase<DdL>& dA_log,
    const Eigen::MatrixBase<DdT>& ddt_bias, StateGradient<Scalar>* d_initial,
    MultiHeadWorkspace<Scalar>& ws, const DeltaOptions& opts, const ParallelOptions& par) {
  check_delta_gates(fn, Q, K, V, b, a, gates, heads, phi, opts);
  if (db.rows() != b.rows() || db.cols() != b.cols())
    throw_invalid(fn, "db is " + shape_of(db) + " but must be " + shape_of(b) +
                          " (the shape of b)");
  check_gate_gradients(fn, a, gates, da, dA_log, ddt_bias);
  const auto inputs = [&](const auto& x) {
    check_no_overlap(fn, x, "Q", Q, "K", K, "V", V, "dOut", dOut, "a", a, "b", b, "A_log",
                     gates.A_log, "dt_bias", gates.dt_bias);
  };
  inputs(db), inputs(da), inputs(dA_log), inputs(ddt_bias);
  check_no_overlap(fn, dQ, "a", a, "b", b);
  check_no_overlap(fn, dK, "a", a, "b", b);
  check_no_overlap(fn, dV, "a", a, "b", b);
  const auto gb = activate_delta_gates(b, a, gates, ws, opts, par);
  StorageCopies<Scalar>& buf = ws.for_thread(0).gate_buffers();
  auto dg = gate_buffer(buf, 2, a.rows(), a.cols());
  auto dbeta = gate_buffer(buf, 3, b.rows(), b.cols());
  DeltaOptions plain = opts;
  plain.beta_activation = BetaActivation::None;
  multihead_delta_backward(Q, K, V, gb.second, gb.first, dOut, heads, phi, initial, d_final, dQ,
                           dK, dV, dbeta, dg, d_initial, ws, plain, par);
  if (a.size())
    apply_gate_activation_backward(a, gates.A_log, gates.dt_bias, dg, da, dA_log, ddt_bias,
                                   gates.options);
  else
    writable(dA_log).setZero();
  if (opts.beta_activation == BetaActivation::None)
    writable(db) = dbeta.template cast<typename DdB::Scalar>();
  else
    beta_activation_backward(b, dbeta, db,
                             opts.beta_activation == BetaActivation::SigmoidTimesTwo);
}

}  // namespace detail
}  // namespace linattn
