// Gated linear attention with in-kernel gates (gated_attention_gates.hpp): every check of the
// raw inputs, the activation into the workspace's gate buffer, then the kernel and its backward
// on it.
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
#include "../gated_attention.hpp"
#include "../gated_attention_backward.hpp"
#include "../options.hpp"

namespace linattn {
namespace detail {

// The checks shared by the forward and the backward, before any work: the layout and the gate's
// parameters and inputs (a N x H or N x H·F).
template <class DQ, class DK, class DV, class DAr, class DL, class DT, class Phi>
void check_gated_gates(const char* fn, const Eigen::MatrixBase<DQ>& Q,
                       const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                       const Eigen::MatrixBase<DAr>& a, const InKernelGates<DL, DT>& gates,
                       Index heads, const Phi& phi, const GatedOptions& opts) {
  static_assert(std::is_same_v<typename DQ::Scalar, compute_scalar_t<typename DQ::Scalar>>,
                "linattn: the in-kernel gates take float or double operands; for bf16 or half "
                "ones call gate_activation() before the kernel");
  static_check_gated<Phi, typename DQ::Scalar>();
  const HeadLayout hl = check_grouped_heads(fn, Q, K, V, heads, opts.key_heads, true);
  check_head_dims(fn, Q, V, heads, hl.key_heads, opts.key_dim, opts.value_dim, "a");
  check_feature_map(fn, phi, hl.D);
  const auto shapes = [&] {
    return " (Q is " + shape_of(Q) + ", K is " + shape_of(K) + ", V is " + shape_of(V) + ")";
  };
  check_in_kernel_gate(fn, a, gates, Q.rows(), heads, phi.feature_dim(hl.D),
                       /*may_be_empty=*/false, shapes);
  check_chunk_size(fn, opts);
}

// g into slot 0 of the gate buffers of `ws`: gate_activation()'s own code.
template <class DAr, class DL, class DT, class Scalar>
Eigen::Map<Matrix<Scalar>> activate_gated_gates(const Eigen::MatrixBase<DAr>& a,
                                                const InKernelGates<DL, DT>& gates,
                                                MultiHeadWorkspace<Scalar>& ws,
                                                const ParallelOptions& par) {
  // Thread 0's workspace holds it; growing the list of workspaces moves it, and a move keeps an
  // Eigen vector's memory where it is.
  auto g = gate_buffer(ws.for_thread(0).gate_buffers(), 0, a.rows(), a.cols());
  apply_gate_activation(a, gates.A_log, gates.dt_bias, g, gates.options, par);
  return g;
}

template <class DQ, class DK, class DV, class DAr, class DL, class DT, class Phi, class DOut>
void batched_gated_gates(const char* fn, const Eigen::MatrixBase<DQ>& Q,
                         const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                         const Eigen::MatrixBase<DAr>& a, const InKernelGates<DL, DT>& gates,
                         const OffsetsRef& offsets, Index heads, const Phi& phi,
                         std::vector<LinearAttentionState<typename DQ::Scalar>>* states,
                         const Eigen::MatrixBase<DOut>& out,
                         MultiHeadWorkspace<typename DQ::Scalar>& ws, const GatedOptions& opts,
                         const ParallelOptions& par) {
  check_gated_gates(fn, Q, K, V, a, gates, heads, phi, opts);
  check_output(fn, out, Q.rows(), V.cols());
  check_no_overlap(fn, out, "a", a);
  check_offsets(fn, "offsets", offsets, Q.rows());
  if (states) {
    const StateApart apart("out", out, "a", a);
    for (std::size_t i = 0; i < states->size(); ++i)
      apart.check(fn, (*states)[i], "states", Index(i));
  }
  const auto g = activate_gated_gates(a, gates, ws, par);
  batched_gated(fn, Q, K, V, g, offsets, heads, phi, states, out, ws, opts, par);
}

}  // namespace detail
}  // namespace linattn
