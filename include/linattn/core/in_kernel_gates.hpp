/// \file core/in_kernel_gates.hpp
/// \brief The gate and β activations as inputs of the gated and delta-rule kernels: the
/// parameters A_log and dt_bias with the gate's form (in_kernel_gates()), the β activation
/// (BetaActivation) and the gradients of the parameters (GateGradients); flash-linear-attention's
/// `use_gate_in_kernel`, `A_log`, `dt_bias`, `lower_bound`, `use_beta_sigmoid_in_kernel` and
/// `allow_neg_eigval` (docs/SPEC.md §10.2).
///
/// The kernels' overloads that take an InKernelGates (delta/delta_rule_gates.hpp,
/// gated/gated_attention_gates.hpp) run gate_activation() and beta_activation() into their
/// workspace and then the kernel on the result: the same bits as the two calls in turn.
#pragma once

#include <Eigen/Core>
#include <string>

#include "common.hpp"
#include "detail/checks.hpp"
#include "gates.hpp"
#include "workspace.hpp"

namespace linattn {

/// \brief How the delta rule's in-kernel overloads make β from their `b` argument
/// (DeltaOptions::beta_activation).
enum class BetaActivation {
  None,             ///< b is β itself, in [0, 2] (the default)
  Sigmoid,          ///< β = sigmoid(b) (FLA's `use_beta_sigmoid_in_kernel`)
  SigmoidTimesTwo,  ///< β = 2·sigmoid(b) ∈ (0, 2) (with FLA's `allow_neg_eigval`)
};

/// \brief The parameters of the gate activation for a kernel's in-kernel form: per-head log
/// rates A_log (H entries), biases dt_bias (H·C entries, or empty) and the form
/// (GateOptions); made by in_kernel_gates(). Plain matrices are held by reference, other
/// expressions (blocks, maps) by value, as Eigen nests them: a plain A_log or dt_bias must
/// outlive the call.
/// \tparam DL the type of A_log.
/// \tparam DB the type of dt_bias.
template <class DL, class DB>
struct InKernelGates {
  typename Eigen::internal::ref_selector<DL>::type A_log;    ///< H per-head log-rates
  typename Eigen::internal::ref_selector<DB>::type dt_bias;  ///< H·C biases, or empty
  GateOptions options;                                       ///< the form and lower bound
};

/// \brief The gate parameters of a kernel's in-kernel overload (FLA's `use_gate_in_kernel`):
/// the kernel takes the raw pre-activations a (N x H·C) and forms
/// g = gate_activation(a, A_log, dt_bias, options) itself.
/// \code
/// // Qwen3-Next: a = x W_a, b = x W_b (N x 32); A_log, dt_bias the layer's 32 parameters.
/// linattn::DeltaOptions opts;
/// opts.key_heads = 16;
/// opts.scale = 1.0 / std::sqrt(128.0);
/// opts.beta_activation = linattn::BetaActivation::Sigmoid;
/// linattn::multihead_delta_rule_attention(Q, K, V, b, a, linattn::in_kernel_gates(A_log, dt_bias),
///                                         32, linattn::L2Normalize<>(1e-6), out, ws, opts);
/// \endcode
/// \param A_log H per-head log-rates (a row or column vector; finite).
/// \param dt_bias H·C biases added to a (finite), or an empty vector for none.
/// \param options the form (Softplus, or KDA's LowerBoundSigmoid with its bound).
/// \return the parameters, to pass to the kernel.
template <class DL, class DB>
InKernelGates<DL, DB> in_kernel_gates(const Eigen::MatrixBase<DL>& A_log,
                                      const Eigen::MatrixBase<DB>& dt_bias,
                                      const GateOptions& options = {}) {
  return {A_log.derived(), dt_bias.derived(), options};
}

/// \brief The gradients of the gate's inputs: ∂L/∂a, ∂L/∂A_log and ∂L/∂dt_bias (empty when
/// the call had no dt_bias), as gate_activation_backward() gives them.
/// \tparam Scalar the operands' scalar.
template <class Scalar>
struct GateGradients {
  Matrix<Scalar> da;        ///< N x H·C, as a
  Vector<Scalar> dA_log;    ///< H, summed over the tokens and the head's channels
  Vector<Scalar> ddt_bias;  ///< H·C, summed over the tokens; empty without dt_bias
};

namespace detail {

// The checks of an in-kernel gate before any work: the parameters (check_gate_parameters()),
// A_log of H entries, a N x H or N x H·F (or empty where the kernel allows no decay), every
// entry of a, A_log and dt_bias finite. `shapes` names the kernel's operands.
template <class DA, class DL, class DT, class Shapes>
void check_in_kernel_gate(const char* fn, const Eigen::MatrixBase<DA>& a,
                          const InKernelGates<DL, DT>& gates, Index N, Index heads, Index F,
                          bool may_be_empty, const Shapes& shapes) {
  const auto all = [&] {
    return " (a is " + shape_of(a) + ", A_log is " + shape_of(gates.A_log) + ", dt_bias is " +
           shape_of(gates.dt_bias) + ")" + shapes();
  };
  if (gates.A_log.size() != heads)
    throw_invalid(fn, "A_log has " + std::to_string(gates.A_log.size()) +
                          " entries but must have one per head, H = " + std::to_string(heads) +
                          all());
  const bool empty = may_be_empty && a.size() == 0;
  if (!empty && !(a.rows() == N && (a.cols() == heads || a.cols() == heads * F)))
    throw_invalid(fn, "a is " + shape_of(a) + " but must be " + shape_string(N, heads) +
                          " (one gate per head and token) or " + shape_string(N, heads * F) +
                          " (one per key channel, F = " + std::to_string(F) + ")" +
                          (may_be_empty ? std::string(", or empty (no decay)") : std::string()) +
                          all());
  if (gates.dt_bias.size() != 0 && gates.dt_bias.size() != a.cols())
    throw_invalid(fn, "dt_bias has " + std::to_string(gates.dt_bias.size()) +
                          " entries but must be empty or have one per column of a, " +
                          std::to_string(a.cols()) + all());
  check_gate_parameters(fn, a, gates.A_log, gates.dt_bias, gates.options);
  check_finite_entries(fn, "a", a);
  check_finite_entries(fn, "A_log", gates.A_log);
  check_finite_entries(fn, "dt_bias", gates.dt_bias);
}

// The gradients' shapes of an in-kernel gate: da as a, dA_log of H entries, ddt_bias as dt_bias
// (any shape when dt_bias is empty: left untouched).
template <class DA, class DL, class DT, class DdA, class DdL, class DdT>
void check_gate_gradients(const char* fn, const Eigen::MatrixBase<DA>& a,
                          const InKernelGates<DL, DT>& gates, const Eigen::MatrixBase<DdA>& da,
                          const Eigen::MatrixBase<DdL>& dA_log,
                          const Eigen::MatrixBase<DdT>& ddt_bias) {
  if (da.rows() != a.rows() || da.cols() != a.cols() || dA_log.size() != gates.A_log.size() ||
      (dA_log.rows() != 1 && dA_log.cols() != 1) ||
      (gates.dt_bias.size() != 0 &&
       (ddt_bias.size() != gates.dt_bias.size() || (ddt_bias.rows() != 1 && ddt_bias.cols() != 1))))
    throw_invalid(fn, "da is " + shape_of(da) + ", dA_log " + shape_of(dA_log) + ", ddt_bias " +
                          shape_of(ddt_bias) + " but must have the shapes of a (" + shape_of(a) +
                          "), A_log (" + shape_of(gates.A_log) + ") and dt_bias (" +
                          shape_of(gates.dt_bias) + ")");
}

// The gate and β buffers of an in-kernel call in the workspace `ws` (its gate_buffers()):
// slot 0 g, 1 β, 2 ∂L/∂g, 3 ∂L/∂β.
template <class Scalar>
Eigen::Map<Matrix<Scalar>> gate_buffer(StorageCopies<Scalar>& buffers, int slot, Index rows,
                                       Index cols) {
  return Eigen::Map<Matrix<Scalar>>(buffers.reserve(slot, rows * cols), rows, cols);
}

}  // namespace detail
}  // namespace linattn
