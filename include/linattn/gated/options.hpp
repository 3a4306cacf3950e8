/// \file gated/options.hpp
/// \brief Options and gradients of the decayed and gated kernels (gated_attention.hpp).
#pragma once

#include "../linear/options.hpp"
#include "../core/common.hpp"
#include "../core/in_kernel_gates.hpp"

namespace linattn {

/// \brief Options of gated_linear_attention() and its multi-head, batched, recurrent and
/// backward forms.
///
/// \f[ \mathrm{out}_i = s\,\varphi(q_i)^\top S_i \quad(\texttt{normalize = false}), \qquad
///     \mathrm{out}_i = \frac{\varphi(q_i)^\top S_i}{\varphi(q_i)^\top z_i}
///     \quad(\texttt{normalize = true}), \f]
/// with \f$S_i\f$ (and \f$z_i\f$) decayed by the gates (docs/SPEC.md §9).
/// \code
/// linattn::GatedOptions opts;
/// opts.scale = 1.0 / std::sqrt(64.0);  // RetNet, GLA and Mamba-2 scale the queries by 1/√D
/// Eigen::MatrixXf out = linattn::gated_linear_attention(Q, K, V, log_gates, linattn::Identity{}, opts);
/// \endcode
struct GatedOptions {
  /// false: the unnormalised output \f$s\,\varphi(q_i)^\top S_i\f$ of RetNet, Mamba-2 and GLA;
  /// true: divide by \f$\varphi(q_i)^\top z_i\f$, where z decays like S (the denominator guard
  /// of docs/SPEC.md §2 applies; `scale` is then ignored). With log gates of 0 and
  /// `normalize = true` the kernels compute causal_linear_attention().
  bool normalize = false;
  /// The output scale s of the unnormalised form (models use \f$1/\sqrt{D}\f$).
  double scale = 1.0;
  /// Rows per chunk of the chunked algorithm; 0 picks the measured default.
  Index chunk_size = 0;
  /// Chunked (GEMMs per chunk), Recurrent (one token at a time), or Auto (by the state's size).
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
};

/// \brief The gradients of a scalar loss with respect to the inputs of a gated call: `dQ`,
/// `dK`, `dV` and `dlog_gates` have the shapes of Q, K, V and the log gates.
/// \code
/// auto g = linattn::gated_linear_attention_backward(Q, K, V, log_gates, dOut);
/// // g.dQ = ∂L/∂Q, g.dK = ∂L/∂K, g.dV = ∂L/∂V, g.dlog_gates = ∂L/∂log_gates
/// \endcode
template <class Scalar>
struct GatedGradients {
  Matrix<Scalar> dQ;          ///< N x D
  Matrix<Scalar> dK;          ///< N x D
  Matrix<Scalar> dV;          ///< N x M
  Matrix<Scalar> dlog_gates;  ///< N x 1 or N x F, as the log gates
};

/// \brief The gradients of a gated call with in-kernel gates (gated/gated_attention_gates.hpp):
/// those of Q, K, V, `dlog_gates` with respect to the activated g (as the kernel's backward
/// gives it), and of the gate's raw inputs: `da`, `dA_log`, `ddt_bias` (GateGradients).
/// \code
/// auto g = linattn::multihead_gated_linear_attention_backward(
///     Q, K, V, a, linattn::in_kernel_gates(A_log, dt_bias), dOut, 8);
/// // g.dQ, g.dK, g.dV, g.da, g.dA_log, g.ddt_bias
/// \endcode
template <class Scalar>
struct GatedGateGradients : GatedGradients<Scalar>, GateGradients<Scalar> {};

}  // namespace linattn
