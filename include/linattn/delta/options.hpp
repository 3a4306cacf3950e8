/// \file delta/options.hpp
/// \brief Options and gradients of the delta-rule kernels (delta_rule.hpp).
#pragma once

#include "../linear/options.hpp"
#include "../core/common.hpp"
#include "../core/in_kernel_gates.hpp"

namespace linattn {

/// \brief Options of delta_rule_attention() and its multi-head, batched, recurrent and backward
/// forms (DeltaNet, Gated DeltaNet; docs/SPEC.md §9.3).
///
/// \f[ S_t = a_t (I - \beta_t \hat k_t \hat k_t^\top) S_{t-1} + \beta_t \hat k_t v_t^\top,
///     \qquad \mathrm{out}_t = s\,\varphi(q_t)^\top S_t. \f]
/// \code
/// linattn::DeltaOptions opts;
/// opts.scale = 1.0 / std::sqrt(128.0);  // Qwen3-Next scales the queries by 1/√D
/// Eigen::MatrixXf out = linattn::delta_rule_attention(
///     Q, K, V, beta, log_a, linattn::L2Normalize<linattn::Silu>{}, opts);
/// \endcode
struct DeltaOptions {
  /// The output scale s: \f$\mathrm{out}_t = s\,\varphi(q_t)^\top S_t\f$ (models use \f$1/\sqrt{D}\f$).
  double scale = 1.0;
  /// Rows per chunk of the chunked algorithm; 0 picks the measured default.
  Index chunk_size = 0;
  /// Chunked (a triangular solve and GEMMs per chunk), Recurrent (one token at a time, the
  /// decode step's kernel), or Auto (measured; docs/benchmarks.md).
  CausalAlgorithm algorithm = CausalAlgorithm::Auto;
  /// The number of query/key heads Hk when fewer than the H value heads share them (GVA,
  /// grouped value attention: Qwen3-Next's 16 key heads for 32 value heads); 0 (the default):
  /// as many as the value heads. Hk must divide H; Q and K then hold Hk heads (N x Hk·D),
  /// V, the output and the per-head parameters H, and value head h reads query/key head
  /// h / (H / Hk), as FLA and transformers (`repeat_interleave`) pair them, without copying.
  /// The gradients of a shared head are the sums over its value heads.
  Index key_heads = 0;
  /// The size of one head's keys, D, and of its values, M, as the model defines them (0: not
  /// stated; the kernels take D = Q.cols() / Hk and M = V.cols() / H). The packed layout alone
  /// cannot tell H heads of D = Q.cols() / H from fewer key heads shared by H value heads,
  /// which without key_heads would run silently as H heads of a fraction of each key. State
  /// them and a call whose Q and K do not hold Hk heads of key_dim (V: H heads of value_dim)
  /// is rejected (std::invalid_argument).
  Index key_dim = 0;
  /// M, one head's value size (0: not stated), checked against V as key_dim is against Q and K.
  Index value_dim = 0;
  /// How the overloads with in-kernel gates (in_kernel_gates(), delta/delta_rule_gates.hpp)
  /// make β from their `b` argument: None (b is β), Sigmoid or SigmoidTimesTwo. The overloads
  /// that take log_a and beta reject anything but None (they have no b to activate).
  BetaActivation beta_activation = BetaActivation::None;
};

/// \brief The gradients of a scalar loss with respect to the inputs of a delta-rule call.
/// `dbeta` and `dlog_a` have the shapes of beta and log_a (`dlog_a` has 0 entries when the call
/// had no decay).
/// \code
/// auto g = linattn::delta_rule_attention_backward(Q, K, V, beta, log_a, dOut);
/// // g.dQ = ∂L/∂Q, g.dK = ∂L/∂K, g.dV = ∂L/∂V, g.dbeta = ∂L/∂β, g.dlog_a = ∂L/∂log a
/// \endcode
template <class Scalar>
struct DeltaGradients {
  Matrix<Scalar> dQ;      ///< N x D (N x H·D for the multi-head form)
  Matrix<Scalar> dK;      ///< N x D
  Matrix<Scalar> dV;      ///< N x M
  Matrix<Scalar> dbeta;   ///< as beta: N x 1 (N x H)
  Matrix<Scalar> dlog_a;  ///< as log_a: N x 1 (N x H; per channel N x F, N x H·F), or empty
};

/// \brief The gradients of a delta-rule call with in-kernel gates (delta/delta_rule_gates.hpp):
/// those of the kernel's inputs (`dbeta` and `dlog_a` with respect to the activated β and g,
/// as the kernel's backward gives them) and of the raw inputs: `db` (∂L/∂b; ∂L/∂β when β is
/// given, BetaActivation::None), `da`, `dA_log`, `ddt_bias` (GateGradients).
/// \code
/// auto g = linattn::multihead_delta_rule_attention_backward(
///     Q, K, V, b, a, linattn::in_kernel_gates(A_log, dt_bias), dOut, 32, phi, opts);
/// // g.dQ, g.dK, g.dV, g.db, g.da, g.dA_log, g.ddt_bias
/// \endcode
template <class Scalar>
struct DeltaGateGradients : DeltaGradients<Scalar>, GateGradients<Scalar> {
  Matrix<Scalar> db;  ///< as b: N x H
};

}  // namespace linattn
