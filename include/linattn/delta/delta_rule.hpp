/// \file delta/delta_rule.hpp
/// \brief The delta rule: DeltaNet and Gated DeltaNet (Qwen3-Next, Kimi Linear's base), chunked
/// at GEMM speed, recurrent, multi-head and batched.
///
/// The state does not only accumulate, it overwrites: per token t, with \f$\hat k_t =
/// \varphi(k_t)\f$, \f[ S_t = a_t (I - \beta_t \hat k_t \hat k_t^\top) S_{t-1} + \beta_t \hat k_t
/// v_t^\top,
///     \qquad \mathrm{out}_t = s\,\varphi(q_t)^\top S_t, \f]
/// with \f$\beta_t \in [0, 2]\f$ and \f$a_t = e^{g_t}\f$, \f$g_t \le 0\f$ (Gated DeltaNet), or
/// \f$a_t = 1\f$ (DeltaNet, no decay). With \f$\beta_t = 1\f$ and a unit key the value stored
/// under \f$\hat k_t\f$ is replaced by \f$v_t\f$. The models apply a short convolution and a SiLU
/// to q, k and v, then map q and k (only) with `L2Normalize<>` (FLA: `L2Normalize<>(1e-6)`) and
/// scale by \f$1/\sqrt{D}\f$ (DeltaOptions::scale); `L2Normalize<Silu>` is that map and the SiLU
/// of q and k in one, for q and k taken before the SiLU. docs/SPEC.md §9.3 has the chunked form.
///
/// The update is a contraction (the state stays bounded) when \f$\beta_t \|\hat k_t\|^2 \le 2\f$,
/// as with unit keys. Beyond, the state grows geometrically and overflows in a few dozen tokens;
/// linattn does not reject such keys, and every algorithm then stays exactly as finite as the
/// recurrence: row i never reads a later row, so the rows before the overflow are finite.
#pragma once

#include <Eigen/Core>
#include <string>
#include <vector>

#include <algorithm>

#include "../core/common.hpp"
#include "../core/detail/checks.hpp"
#include "../core/detail/decay.hpp"
#include "../core/detail/result.hpp"
#include "../core/detail/views.hpp"
#include "../core/parallel.hpp"
#include "../core/state.hpp"
#include "../core/workspace.hpp"
#include "../linear/heads.hpp"
#include "../linear/multihead_workspace.hpp"
#include "../maps/erased_map.hpp"
#include "../maps/feature_map.hpp"
#include "../maps/identity.hpp"
#include "../maps/map_state.hpp"
#include "detail/delta_forward.hpp"
#include "detail/delta_params.hpp"
#include "options.hpp"
#include "recurrent_delta_rule.hpp"

namespace linattn {
namespace detail {

inline void check_delta_chunk_size(const char* function, const DeltaOptions& opts) {
  if (opts.chunk_size < 0)
    throw_invalid(function,
                  "chunk_size must be >= 0 (0 = default), got " + std::to_string(opts.chunk_size));
  // The in-kernel overloads activate b and pass None on: here beta is β.
  if (opts.beta_activation != BetaActivation::None)
    throw_invalid(function,
                  "beta_activation applies to the overloads with in-kernel gates "
                  "(in_kernel_gates()); this one takes beta itself: leave it None");
}

// A carried state for the delta rule: sized or checked, its low parts added into S (the delta
// rule keeps none: the overwrite and the decay bound the state's memory). z is not used.
// A state the delta rule left has zero low parts: one read of them (no write, no pass over S)
// finds that, so that a small call does not pay for a fold it does not need.
template <class Scalar>
void delta_absorb_low(LinearAttentionState<Scalar>& st) {
  const Scalar* lo = st.S_lo.data();
  bool zero = true;
  for (Index i0 = 0, n = st.S_lo.size(); i0 < n && zero; i0 += 1024) {
    int nonzero = 0;  // branch-free within a stretch, so that it vectorises
    for (Index i = i0, e = std::min(n, i0 + 1024); i < e; ++i) nonzero |= int(lo[i] != Scalar(0));
    zero = nonzero == 0;
  }
  if (zero) return;
  st.S += st.S_lo;
  st.S_lo.setZero();
}

template <class Phi, class Scalar>
constexpr void static_check_delta() {
  static_check_feature_map<Phi, compute_scalar_t<Scalar>>();
  static_assert(!normalizes_keys_per_feature_v<Phi>,
                "linattn: the delta rule needs a product feature map (sim = φ(q)·φ(k)); a map "
                "with a per-feature key softmax (SoftmaxSplit) has no delta-rule form");
}

// " (Q is …, K is …, V is …)", built when a message needs it.
template <class DQ, class DK, class DV>
auto qkv_shapes(const DQ& Q, const DK& K, const DV& V) {
  return [&Q, &K, &V] {
    return " (Q is " + shape_of(Q) + ", K is " + shape_of(K) + ", V is " + shape_of(V) + ")";
  };
}

template <class DQ, class DK, class DV, class DB, class DA, class Phi, class DOut>
void delta_single(const char* fn, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                  const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DB>& beta,
                  const Eigen::MatrixBase<DA>& log_a, const Phi& phi,
                  LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>& st,
                  const Eigen::MatrixBase<DOut>& out,
                  Workspace<compute_scalar_t<typename DQ::Scalar>>& ws, const DeltaOptions& opts) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  static_check_delta<Phi, Scalar>();
  static_assert(
      std::is_same_v<Storage, typename DB::Scalar> && std::is_same_v<Storage, typename DA::Scalar>,
      "linattn: beta and log_a must have the scalar type of Q, K and V");
  check_qkv(fn, Q, K, V, /*causal=*/true);
  check_head_dims(fn, Q, V, 1, resolve_key_heads(fn, 1, opts.key_heads), opts.key_dim,
                  opts.value_dim, "beta");
  check_feature_map(fn, phi, Q.cols());
  const Index N = Q.rows(), D = Q.cols(), M = V.cols();
  check_delta_params(fn, beta, log_a, N, 1, phi.feature_dim(D), qkv_shapes(Q, K, V));
  check_output(fn, out, N, M);
  check_no_overlap(fn, out, "Q", Q, "K", K, "V", V, "beta", beta, "log_a", log_a);
  StateApart("out", out, "Q", Q, "K", K, "V", V, "beta", beta, "log_a", log_a)
      .check(fn, st, "state");
  check_delta_chunk_size(fn, opts);
  prepare_state(fn, st, phi, D, M);
  delta_absorb_low(st);
  const auto params = delta_head_params(beta.derived(), log_a.derived(), 0, N, 0, 1,
                                        phi.feature_dim(D), ws, kda_runs_chunked(opts));
  const auto map = erase_map<compute_scalar_t<Scalar>>(phi);
  with_views(
      Q.derived(), K.derived(), V.derived(), writable(out),
      [&](const auto& q, const auto& k, const auto& v, auto& o) {
        delta_run(map, q, k, v, params.beta, params.g, params.gw, params.logs, st, o, ws, opts);
      },
      &ws.storage_copies());
}

// The multi-head and batched forms: (sequence, head) pairs in parallel, each the single-head
// kernel on its blocks.
template <class DQ, class DK, class DV, class DB, class DA, class Phi, class DOut>
void batched_delta(const char* fn, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                   const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DB>& beta,
                   const Eigen::MatrixBase<DA>& log_a, const OffsetsRef& offsets, Index heads,
                   const Phi& phi,
                   std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>* states,
                   const Eigen::MatrixBase<DOut>& out,
                   MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                   const DeltaOptions& opts, const ParallelOptions& par) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  static_check_delta<Phi, Scalar>();
  static_assert(
      std::is_same_v<Storage, typename DB::Scalar> && std::is_same_v<Storage, typename DA::Scalar>,
      "linattn: beta and log_a must have the scalar type of Q, K and V");
  const HeadLayout hl = check_grouped_heads(fn, Q, K, V, heads, opts.key_heads, true);
  const Index D = hl.D, M = hl.M;
  check_head_dims(fn, Q, V, heads, hl.key_heads, opts.key_dim, opts.value_dim, "beta");
  check_feature_map(fn, phi, D);
  const Index F = phi.feature_dim(D);
  check_delta_params(fn, beta, log_a, Q.rows(), heads, F, qkv_shapes(Q, K, V));
  check_output(fn, out, Q.rows(), V.cols());
  check_no_overlap(fn, out, "Q", Q, "K", K, "V", V, "beta", beta, "log_a", log_a);
  check_offsets(fn, "offsets", offsets, Q.rows());
  check_delta_chunk_size(fn, opts);
  const Index B = static_cast<Index>(offsets.size()) - 1;
  if (states) {
    const StateApart apart("out", out, "Q", Q, "K", K, "V", V, "beta", beta, "log_a", log_a);
    for (std::size_t i = 0; i < states->size(); ++i)
      apart.check(fn, (*states)[i], "states", Index(i));
    check_states(fn, *states, B, heads, phi, D, M);
    for (auto& st : *states) delta_absorb_low(st);
  }
  const auto map = erase_map<compute_scalar_t<Scalar>>(phi);
  const auto run = [&](const auto& q, const auto& k, const auto& v, auto& o) {
    // The delta rule reads the state before each write: about twice a causal head's work.
    const double work = 2.0 * double(heads) * causal_head_work(Q.rows(), F, M);
    parallel_tasks<Scalar>(B * heads, work, par, ws, [&](Index t, int thread) {
      const Index b = t / heads, h = t % heads;
      const Index r0 = offsets[static_cast<std::size_t>(b)];
      const Index n = offsets[static_cast<std::size_t>(b) + 1] - r0;
      LinearAttentionState<Scalar>* st = &task_state(states, t, ws, thread, F, M, 0);
      Workspace<Scalar>& tws = ws.for_thread(thread);
      const auto params = delta_head_params(beta.derived(), log_a.derived(), r0, n, h, heads, F,
                                            tws, kda_runs_chunked(opts));
      auto os = sub_view(o, r0, h * M, n, M);
      const Index c = hl.key_head(h) * D;
      delta_run(map, sub_view(q, r0, c, n, D), sub_view(k, r0, c, n, D),
                sub_view(v, r0, h * M, n, M), params.beta, params.g, params.gw, params.logs, *st,
                os, tws, opts);
    });
  };
  with_views(Q.derived(), K.derived(), V.derived(), writable(out), run, &ws.storage_copies());
}

}  // namespace detail

/// \brief The delta rule continuing from `state`, written into a caller's output;
/// allocation-free once `ws` and `state` have the shape.
///
/// \f[ S_t = a_t (I - \beta_t \hat k_t \hat k_t^\top) S_{t-1} + \beta_t \hat k_t v_t^\top,
///     \qquad \mathrm{out}_t = s\,\varphi(q_t)^\top S_t \f]
/// (\f$\hat k_t = \varphi(k_t)\f$, \f$a_t = e^{g_t}\f$, s = DeltaOptions::scale).
///
/// \param beta N entries in [0, 2] (a column or row vector): the writing strength. β = 0
///        leaves the state only decayed; β = 1 with a unit key replaces the value stored under
///        it; β = 2 reflects.
/// \param log_a N log-decays \f$g_t \le 0\f$, finite (Gated DeltaNet), N x F of them, one per
///        key channel (KDA, Kimi Linear: \f$S'_t = \mathrm{diag}(e^{g_t}) S_{t-1}\f$ replaces
///        \f$a_t S_{t-1}\f$), or a vector of size 0 (DeltaNet: no decay). Checked in O(N·F):
///        std::invalid_argument names the first bad entry.
/// \param state the state to continue from (empty: zero); on return the state after the last
///        row. Only S is used: its low part is added into it (the delta rule keeps no
///        compensated sum: the overwrite and the decay bound its memory); z, m and log_decay are
///        left as they were. combine() does not apply to delta-rule states (a segment maps S to
///        P S + H with an F x F matrix P, which the state does not carry).
/// \param out N x M; must not overlap Q, K, V, beta, log_a or the state's arrays (nor may the
///        inputs overlap the state: the call writes it).
///
/// Algorithms (DeltaOptions::algorithm): Chunked forms, per chunk of C rows (32 by default),
/// the pseudo-values U = (I + strict_tril(diag(β)(K̂K̂ᵀ ∘ E)))⁻¹ diag(β)(V − diag(e) K̂ S) by one
/// blocked triangular solve and the outputs and next state by GEMMs (docs/SPEC.md §9.3; every
/// decay factor is the exponential of a sum of log decays <= 0). Recurrent runs one token at a
/// time, each token one pass over the state (the decode step's kernel). Auto runs Recurrent
/// for states up to 512 x 512 (measured faster on a CPU at every size up to that: the chunked
/// form does more flops per token at a similar rate), Chunked beyond. Both agree to rounding.
/// Per-channel log-decays (KDA): Recurrent and Auto read
/// \f$S_{t-1}^\top (a_t \circ w)\f$ and \f$S_{t-1}^\top (a_t \circ \hat k_t)\f$ in the one
/// pass and apply \f$\mathrm{diag}(a_t)\f$ with the token's update; Chunked folds the
/// per-channel decays into both intra-chunk matrices (docs/SPEC.md §10.1: factored about the
/// chunk's start for mild decays, sub-chunks for strong ones, every exponent a sum of log-decays
/// <= 0 along its own stretch). Auto keeps the recurrent form at every size (measured faster on a
/// CPU: docs/benchmarks.md, KDA).
///
/// Unnormalised keys: with \f$\beta_t \|\hat k_t\|^2 \le 2\f$ (unit keys, β <= 2) every
/// factor has norm <= 1. Beyond, the state grows by up to \f$|1 - \beta_t \|\hat k_t\|^2|\f$ a
/// token and overflows to ±inf, then NaN (float, keys of norm 10, β = 1: within 50 tokens). Such
/// keys are not rejected; both algorithms then go non-finite at the recurrence's own row (the
/// chunked form's row i reads rows <= i only), and every row before it is finite. Causality holds
/// for non-finite inputs too: a NaN or inf at row j leaves rows i < j exact.
///
/// \throws std::invalid_argument on mismatched shapes (naming the function and every shape), a
/// beta outside [0, 2] or NaN, a log_a > 0, NaN or ±inf, a state of the wrong shape, an output
/// that overlaps an input, or a negative chunk size; before anything is written.
/// \code
/// // Gated DeltaNet, one head: q, k before their SiLU (after it: L2Normalize<>(1e-6)).
/// linattn::LinearAttentionState<float> state;
/// linattn::Workspace<float> ws;
/// linattn::DeltaOptions opts;
/// opts.scale = 1.0 / std::sqrt(double(D));
/// Eigen::MatrixXf out(N, M);
/// linattn::delta_rule_attention(Q, K, V, beta, log_a, linattn::L2Normalize<linattn::Silu>{},
///                               state, out, ws, opts);
/// // KDA's chunked form: log-decays g of N x F (one per key channel), chunks of 64 rows.
/// opts.algorithm = linattn::CausalAlgorithm::Chunked;
/// opts.chunk_size = 64;
/// linattn::delta_rule_attention(Q, K, V, beta, g, linattn::L2Normalize<>(1e-6), state, out, ws,
///                               opts);
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
/// \param options the query scale, algorithm and chunk size (the defaults suit most shapes).
template <class DQ, class DK, class DV, class DB, class DA, class Phi, class DOut>
void delta_rule_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                          const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DB>& beta,
                          const Eigen::MatrixBase<DA>& log_a, const Phi& phi,
                          LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>& state,
                          const Eigen::MatrixBase<DOut>& out,
                          Workspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                          const DeltaOptions& options = {}) {
  detail::delta_single("delta_rule_attention", Q, K, V, beta, log_a, phi, state, out, ws, options);
}

/// \brief The delta rule continuing from `state` (updated in place), returning the N x M
/// output (see the out-parameter form).
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param beta N writing strengths in [0, 2], one per token: how far each step moves the state's
///     value for its key.
/// \param log_a N log-decays g_t <= 0, one per token (Gated DeltaNet), N x F (one per key channel
///     and token: KDA), or an empty vector for none.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param state the state to continue from (empty: zero); holds the state after the last row on
///     return.
/// \param options the query scale, algorithm and chunk size (the defaults suit most shapes).
/// \return the N x M output, in the operands' scalar type.
template <class DQ, class DK, class DV, class DB, class DA, class Phi>
Matrix<typename DQ::Scalar> delta_rule_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DA>& log_a, const Phi& phi,
    LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>& state,
    const DeltaOptions& options = {}) {
  detail::check_qkv("delta_rule_attention", Q, K, V, /*causal=*/true);
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  Workspace<compute_scalar_t<typename DQ::Scalar>> ws;
  delta_rule_attention(Q, K, V, beta, log_a, phi, state, out, ws, options);
  return out;
}

/// \brief The delta rule from a zero state, returning the N x M output.
/// \code
/// // KDA (Kimi Linear): one log-decay per key channel, N x D; q, k after their SiLU.
/// Eigen::MatrixXf g = ...;  // N x D, entries <= 0
/// Eigen::MatrixXf o = linattn::delta_rule_attention(Q, K, V, beta, g,
///                                                   linattn::L2Normalize<>(1e-6));
/// // DeltaNet (no decay) on unit keys.
/// Eigen::VectorXf beta = Eigen::VectorXf::Constant(N, 0.5f), no_decay;
/// Eigen::MatrixXf out = linattn::delta_rule_attention(Q, K, V, beta, no_decay,
///                                                     linattn::L2Normalize<linattn::Identity>{});
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param beta N writing strengths in [0, 2], one per token: how far each step moves the state's
///     value for its key.
/// \param log_a N log-decays g_t <= 0, one per token (Gated DeltaNet), N x F (one per key channel
///     and token: KDA), or an empty vector for none.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the query scale, algorithm and chunk size (the defaults suit most shapes).
/// \return the N x M output, in the operands' scalar type.
template <class DQ, class DK, class DV, class DB, class DA, class Phi = Identity>
Matrix<typename DQ::Scalar> delta_rule_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DA>& log_a, const Phi& phi = Phi{},
    const DeltaOptions& options = {}) {
  LinearAttentionState<compute_scalar_t<typename DQ::Scalar>> state;
  return delta_rule_attention(Q, K, V, beta, log_a, phi, state, options);
}

/// \brief The multi-head delta rule, heads packed side by side (Q, K: N x H·D; V, out: N x H·M;
/// beta: N x H; log_a: N x H, or empty for no decay), each head from a zero state, in parallel
/// over heads.
///
/// For H > 1 beta and log_a are N x H always: a 1 x H operand is one token of H heads (only a
/// single head's N entries may also come as a row).
///
/// Shared query/key heads (GVA, Qwen3-Next's 16 key heads for 32 value heads): with
/// DeltaOptions::key_heads = Hk < H, Q and K hold Hk heads (N x Hk·D) and value head h reads
/// query/key head h / (H / Hk), without copying; beta, log_a, V and the output stay per value
/// head. Without key_heads the layout gives D = Q.cols() / H; state DeltaOptions::key_dim to
/// have a call of another layout rejected.
/// \code
/// linattn::MultiHeadWorkspace<float> ws;
/// Eigen::MatrixXf out(N, 8 * 128);
/// linattn::multihead_delta_rule_attention(Q, K, V, beta, log_a, 8,
///                                         linattn::L2Normalize<linattn::Silu>{}, out, ws, opts);
/// // Qwen3-Next: 32 value heads over 16 query/key heads (Q, K: N x 16·128).
/// opts.key_heads = 16;
/// linattn::multihead_delta_rule_attention(Q16, K16, V32, beta32, log_a32, 32,
///                                         linattn::L2Normalize<linattn::Silu>{}, out32, ws, opts);
/// \endcode
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H): value head h reads the
///     columns [c·D, (c+1)·D) of query/key head c = h / (H / Hk).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param beta N x H writing strengths in [0, 2], per token and head.
/// \param log_a N x H log-decays <= 0 (a token's decay per head), N x H·F (per key channel,
///     KDA: head h's in columns [h·F, (h+1)·F)), or empty for none.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the query scale, algorithm and chunk size (the defaults suit most shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DB, class DA, class Phi, class DOut>
void multihead_delta_rule_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                    const Eigen::MatrixBase<DV>& V,
                                    const Eigen::MatrixBase<DB>& beta,
                                    const Eigen::MatrixBase<DA>& log_a, Index heads, const Phi& phi,
                                    const Eigen::MatrixBase<DOut>& out,
                                    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                    const DeltaOptions& options = {},
                                    const ParallelOptions& par = {}) {
  const Index offsets[2] = {0, Q.rows()};
  detail::batched_delta("multihead_delta_rule_attention", Q, K, V, beta, log_a,
                        detail::OffsetsRef(offsets, 2), heads, phi, nullptr, out, ws, options, par);
}

/// \brief The multi-head delta rule carrying the H heads' states in and out (an empty vector
/// is resized to H zero states; head h continues from states[h]).
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H): value head h reads the
///     columns [c·D, (c+1)·D) of query/key head c = h / (H / Hk).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param beta N x H writing strengths in [0, 2], per token and head.
/// \param log_a N x H log-decays <= 0 (a token's decay per head), N x H·F (per key channel,
///     KDA: head h's in columns [h·F, (h+1)·F)), or empty for none.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param states one state per head (per sequence and head when batched), continued from and
///     updated in place.
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the query scale, algorithm and chunk size (the defaults suit most shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DB, class DA, class Phi, class DOut>
void multihead_delta_rule_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DA>& log_a, Index heads,
    const Phi& phi,
    std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>& states,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws, const DeltaOptions& options = {},
    const ParallelOptions& par = {}) {
  const Index offsets[2] = {0, Q.rows()};
  detail::batched_delta("multihead_delta_rule_attention", Q, K, V, beta, log_a,
                        detail::OffsetsRef(offsets, 2), heads, phi, &states, out, ws, options, par);
}

/// \brief The multi-head delta rule, returning N x (H·M).
/// \code
/// Eigen::MatrixXf out = linattn::multihead_delta_rule_attention(Q, K, V, beta, log_a, 8);
/// \endcode
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H): value head h reads the
///     columns [c·D, (c+1)·D) of query/key head c = h / (H / Hk).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param beta N x H writing strengths in [0, 2], per token and head.
/// \param log_a N x H log-decays <= 0 (a token's decay per head), N x H·F (per key channel,
///     KDA: head h's in columns [h·F, (h+1)·F)), or empty for none.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the query scale, algorithm and chunk size (the defaults suit most shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x H·M output, head h in columns [h·M, (h+1)·M).
template <class DQ, class DK, class DV, class DB, class DA, class Phi = Identity>
Matrix<typename DQ::Scalar> multihead_delta_rule_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DA>& log_a, Index heads,
    const Phi& phi = Phi{}, const DeltaOptions& options = {}, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  multihead_delta_rule_attention(Q, K, V, beta, log_a, heads, phi, out, ws, options, par);
  return out;
}

/// \brief The delta rule over B packed sequences (rows [offsets[b], offsets[b+1]), offsets of
/// any integer type, as cu_seqlens) and H heads, each sequence from a zero state;
/// (sequence, head) pairs in parallel.
/// \code
/// Eigen::VectorXi cu_seqlens(3);
/// cu_seqlens << 0, 100, 128;
/// linattn::batched_delta_rule_attention(Q, K, V, beta, log_a, cu_seqlens, 8,
///                                       linattn::L2Normalize<linattn::Silu>{}, out, ws);
/// \endcode
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H): value head h reads the
///     columns [c·D, (c+1)·D) of query/key head c = h / (H / Hk).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param beta N x H writing strengths in [0, 2], per token and head.
/// \param log_a N x H log-decays <= 0 (a token's decay per head), N x H·F (per key channel,
///     KDA: head h's in columns [h·F, (h+1)·F)), or empty for none.
/// \param offsets B + 1 row offsets of the packed sequences: sequence b is rows offsets[b] to
///     offsets[b+1] - 1.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the query scale, algorithm and chunk size (the defaults suit most shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DB, class DA, class Off, class Phi, class DOut>
void batched_delta_rule_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                  const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DB>& beta,
                                  const Eigen::MatrixBase<DA>& log_a, const Off& offsets,
                                  Index heads, const Phi& phi, const Eigen::MatrixBase<DOut>& out,
                                  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                  const DeltaOptions& options = {},
                                  const ParallelOptions& par = {}) {
  const char* fn = "batched_delta_rule_attention";
  detail::batched_delta(fn, Q, K, V, beta, log_a, detail::offsets_of(fn, "offsets", offsets), heads,
                        phi, nullptr, out, ws, options, par);
}

/// \brief batched_delta_rule_attention() carrying the B·H states in and out (sequence-major,
/// head h of sequence b at b·H + h; an empty vector is resized to B·H zero states): a server's
/// prefill, whose states then continue in RecurrentDeltaRule decoders.
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H): value head h reads the
///     columns [c·D, (c+1)·D) of query/key head c = h / (H / Hk).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param beta N x H writing strengths in [0, 2], per token and head.
/// \param log_a N x H log-decays <= 0 (a token's decay per head), N x H·F (per key channel,
///     KDA: head h's in columns [h·F, (h+1)·F)), or empty for none.
/// \param offsets B + 1 row offsets of the packed sequences: sequence b is rows offsets[b] to
///     offsets[b+1] - 1.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param states one state per head (per sequence and head when batched), continued from and
///     updated in place.
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the query scale, algorithm and chunk size (the defaults suit most shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DB, class DA, class Off, class Phi, class DOut>
void batched_delta_rule_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DA>& log_a, const Off& offsets,
    Index heads, const Phi& phi,
    std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>& states,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws, const DeltaOptions& options = {},
    const ParallelOptions& par = {}) {
  const char* fn = "batched_delta_rule_attention";
  detail::batched_delta(fn, Q, K, V, beta, log_a, detail::offsets_of(fn, "offsets", offsets), heads,
                        phi, &states, out, ws, options, par);
}

}  // namespace linattn
