/// \file gated/gated_attention.hpp
/// \brief Decayed and gated causal linear attention (RetNet, Mamba-2's SSD, GLA, the forget
/// gates of RWKV-6 and Kimi Linear): chunked at GEMM speed, recurrent, multi-head and batched.
///
/// The state forgets old tokens: per token t, with \f$\hat k_t = \varphi(k_t)\f$,
/// \f[ S_t = a_t S_{t-1} + \hat k_t v_t^\top \quad\text{(scalar decay, } a_t = e^{g_t}),
///     \qquad S_t = \mathrm{diag}(\alpha_t) S_{t-1} + \hat k_t v_t^\top
///     \quad\text{(per-feature gates, } \alpha_t = e^{g_t} \in (0, 1]^F), \f]
/// and \f$\mathrm{out}_t = s\,\varphi(q_t)^\top S_t\f$ (or normalised by
/// \f$\varphi(q_t)^\top z_t\f$, z decaying like S; GatedOptions). The kernels take the log
/// gates \f$g_t \le 0\f$, as models produce them (log-sigmoid, \f$-\Delta_t A\f$, log γ).
/// docs/SPEC.md §9 has the chunked forms and why every factor they form is at most 1.
#pragma once

#include <Eigen/Core>

#include <string>
#include <vector>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../maps/erased_map.hpp"
#include "detail/gated_forward.hpp"
#include "../core/detail/views.hpp"
#include "../core/detail/result.hpp"
#include "../maps/feature_map.hpp"
#include "options.hpp"
#include "../maps/identity.hpp"
#include "../linear/heads.hpp"
#include "../linear/multihead_workspace.hpp"
#include "../core/parallel.hpp"
#include "recurrent_gated_attention.hpp"
#include "../core/state.hpp"
#include "../core/workspace.hpp"

namespace linattn {
namespace detail {

template <class Phi, class Scalar>
constexpr void static_check_gated() {
  static_check_feature_map<Phi, compute_scalar_t<Scalar>>();
  static_assert(!normalizes_keys_per_feature_v<Phi>,
                "linattn: the gated kernels need a product feature map (sim = φ(q)·φ(k)); a map "
                "with a per-feature key softmax (SoftmaxSplit) has no decayed form");
}

inline void check_chunk_size(const char* function, const GatedOptions& opts) {
  if (opts.chunk_size < 0)
    throw_invalid(function, "chunk_size must be >= 0 (0 = default), got " +
                                std::to_string(opts.chunk_size));
}

template <class DQ, class DK, class DV, class DG, class Phi, class DOut>
void gated_single(const char* fn, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                  const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& log_gates,
                  const Phi& phi, LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>& st,
                  const Eigen::MatrixBase<DOut>& out,
                  Workspace<compute_scalar_t<typename DQ::Scalar>>& ws, const GatedOptions& opts) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  static_check_gated<Phi, Scalar>();
  static_assert(std::is_same_v<Storage, typename DG::Scalar>,
                "linattn: log_gates must have the scalar type of Q, K and V");
  check_qkv(fn, Q, K, V, /*causal=*/true);
  check_head_dims(fn, Q, V, 1, resolve_key_heads(fn, 1, opts.key_heads), opts.key_dim,
                  opts.value_dim, "the log gates");
  check_feature_map(fn, phi, Q.cols());
  const Index N = Q.rows(), D = Q.cols(), M = V.cols(), F = phi.feature_dim(D);
  check_log_gates(fn, log_gates, N, 1, F,
                  "one log-decay per token, or one per feature, F = " + std::to_string(F),
                  " (Q is " + shape_of(Q) + ", K is " + shape_of(K) + ", V is " + shape_of(V) +
                      ")");
  check_output(fn, out, N, M);
  check_no_overlap(fn, out, "Q", Q, "K", K, "V", V, "log_gates", log_gates);
  StateApart("out", out, "Q", Q, "K", K, "V", V, "log_gates", log_gates).check(fn, st, "state");
  check_chunk_size(fn, opts);
  gated_prepare_state(fn, st, phi, D, M, log_gates.cols());
  // As views (detail/views.hpp), one row segment each: the types of the multi-head form's
  // blocks, so that one instantiation of the kernels serves every caller.
  const Viewed<DQ> q(Q.derived());
  const Viewed<DK> k(K.derived());
  const Viewed<DV> v(V.derived());
  const Viewed<DG> g(log_gates.derived());
  const auto map = erase_map<compute_scalar_t<Scalar>>(phi);
  with_output_view(writable(out), [&](auto& dst) {
    auto os = row_segment(dst, 0, N);
    gated_run(map, row_segment(q.view, 0, N), row_segment(k.view, 0, N),
              row_segment(v.view, 0, N), row_segment(g.view, 0, N), st, os, ws, opts);
  });
}

// The multi-head and batched forms: (sequence, head) pairs in parallel, each the single-head
// kernel on its blocks (the same instantiation as the single-head call's rows).
template <class DQ, class DK, class DV, class DG, class Phi, class DOut>
void batched_gated(const char* fn, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                   const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& log_gates,
                   const OffsetsRef& offsets, Index heads, const Phi& phi,
                   std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>* states,
                   const Eigen::MatrixBase<DOut>& out,
                   MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                   const GatedOptions& opts, const ParallelOptions& par) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  static_check_gated<Phi, Scalar>();
  static_assert(std::is_same_v<Storage, typename DG::Scalar>,
                "linattn: log_gates must have the scalar type of Q, K and V");
  const HeadLayout hl = check_grouped_heads(fn, Q, K, V, heads, opts.key_heads, true);
  const Index D = hl.D, M = hl.M;
  check_head_dims(fn, Q, V, heads, hl.key_heads, opts.key_dim, opts.value_dim, "the log gates");
  check_feature_map(fn, phi, D);
  const Index F = phi.feature_dim(D);
  check_log_gates(fn, log_gates, Q.rows(), heads, heads * F,
                  "one log-decay per head and token, or one per feature of each head, H = " +
                      std::to_string(heads) + ", F = " + std::to_string(F),
                  " (Q is " + shape_of(Q) + ", K is " + shape_of(K) + ", V is " + shape_of(V) +
                      ")");
  check_output(fn, out, Q.rows(), V.cols());
  check_no_overlap(fn, out, "Q", Q, "K", K, "V", V, "log_gates", log_gates);
  check_offsets(fn, "offsets", offsets, Q.rows());
  check_chunk_size(fn, opts);
  const Index B = static_cast<Index>(offsets.size()) - 1;
  const Index gw = log_gates.cols() / heads;
  if (states) {
    const StateApart apart("out", out, "Q", Q, "K", K, "V", V, "log_gates", log_gates);
    for (std::size_t i = 0; i < states->size(); ++i)
      apart.check(fn, (*states)[i], "states", Index(i));
    check_states(fn, *states, B, heads, phi, D, M);
    for (std::size_t i = 0; i < states->size(); ++i) {
      const Index have = (*states)[i].log_decay.size();
      if (have > 1 && have != F)
        throw_invalid(fn, "states[" + std::to_string(i) + "].log_decay has " +
                              std::to_string(have) + " entries but must have 0, 1 or F = " +
                              std::to_string(F));
    }
    for (auto& st : *states) gated_prepare_state(fn, st, phi, D, M, gw);
  }
  const Viewed<DQ> q(Q.derived());
  const Viewed<DK> k(K.derived());
  const Viewed<DV> v(V.derived());
  const Viewed<DG> g(log_gates.derived());
  const auto map = erase_map<compute_scalar_t<Scalar>>(phi);
  with_output_view(writable(out), [&](auto& dst) {
    // Every row of every sequence once per head (threads_for(), parallel.hpp).
    const double work = double(heads) * causal_head_work(Q.rows(), F, M);
    parallel_tasks<Scalar>(B * heads, work, par, ws, [&](Index t, int thread) {
      const Index b = t / heads, h = t % heads;
      const Index r0 = offsets[static_cast<std::size_t>(b)];
      const Index n = offsets[static_cast<std::size_t>(b) + 1] - r0;
      LinearAttentionState<Scalar>* st = &task_state(states, t, ws, thread, F, M, gw);
      // sub_view, not block: an empty operand's memory may be null, where no offset applies.
      auto os = sub_view(dst, r0, h * M, n, M);
      const Index c = hl.key_head(h) * D;
      gated_run(map, sub_view(q.view, r0, c, n, D), sub_view(k.view, r0, c, n, D),
                sub_view(v.view, r0, h * M, n, M), sub_view(g.view, r0, h * gw, n, gw), *st, os,
                ws.for_thread(thread), opts);
    });
  });
}

}  // namespace detail

/// \brief Decayed or gated causal linear attention continuing from `state`, written into a
/// caller's output; allocation-free once `ws` and `state` have the shape.
///
/// With \f$\hat q = \varphi(q)\f$, \f$\hat k = \varphi(k)\f$ and \f$G_t = \sum_{l \le t} g_l\f$
/// (per feature for per-feature gates):
/// \f[ \mathrm{out}_i = s \sum_{j \le i} \Big(\sum_d \hat q_{id} \hat k_{jd}\,
///     e^{G_{id} - G_{jd}}\Big) v_j + s \sum_d \hat q_{id} e^{G_{id}} S_0[d,:] \f]
/// (GatedOptions::normalize divides by the same sums with \f$v_j\f$ replaced by 1 and
/// \f$S_0\f$ by \f$z_0\f$).
///
/// \param log_gates N x 1 (a log-decay \f$g_t\f$ per token: RetNet's constant log γ, Mamba-2's
///        \f$-\Delta_t A\f$) or N x F (per-feature log gates, GLA), F = phi.feature_dim(D). Every
///        entry finite and <= 0; a reset is a very negative gate (exp underflows to exactly 0).
///        Checked in O(N·F): std::invalid_argument names the first bad entry.
/// \param state the state to continue from (empty: zero); on return the state after the last
///        row: S (and z when normalising; otherwise z is left as it was), and
///        `state.log_decay` (1 or F entries) increased by the column sums of `log_gates`
///        (what combine() of decayed segments needs; spec §9.4).
/// \param out N x M; must not overlap Q, K, V, log_gates or the state's arrays (nor may the
///        inputs overlap the state: the call writes it).
///
/// Algorithms (GatedOptions::algorithm): Chunked runs GEMMs per chunk of C rows (64 by
/// default), with every decay factor formed as the exponential of a sum of log gates <= 0 (no
/// factor above 1, no product of many small numbers): scalar decays through the intra-chunk
/// matrix \f$e^{\sum_{j<l\le i} g_l}\f$; per-feature gates factor the chunk about its start
/// (as GLA) when its decay range is within e^8, else in sub-chunks of 16 rows, each key
/// sub-chunk factored about its last row, and pairs inside a sub-chunk from their own sums
/// (spec §9.2), so that log gates of -20 per token stay exact in float. Recurrent runs one
/// token at a time in one fused pass over the state (the decode step's kernel); Auto picks it
/// for states up to 128 x 128. Both agree to rounding. The recurrent form runs blocks of mild
/// (or zero) gates as the undecayed compensated recurrence on rescaled keys and queries, the
/// block's decay applied once, so that weak gates (RetNet's slowest heads, |g| down to 1e-7)
/// and gates of 0 stay exact to float rounding (spec §9.1).
///
/// \throws std::invalid_argument on mismatched shapes (naming the function and every shape),
/// log gates that are not N x 1 or N x F or have an entry > 0, NaN or ±inf, a state of the
/// wrong shape, an output that overlaps an input, or a negative chunk size; before anything
/// is written.
/// \code
/// // Mamba-2 / simple GLA: one decay per token.
/// linattn::LinearAttentionState<float> state;
/// linattn::Workspace<float> ws;
/// linattn::GatedOptions opts;
/// opts.scale = 1.0 / std::sqrt(double(D));
/// Eigen::MatrixXf out(N, M);
/// linattn::gated_linear_attention(Q, K, V, log_a, linattn::Identity{}, state, out, ws, opts);
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
/// \param options the query scale, normalisation, algorithm and chunk size (the defaults suit most
///     shapes).
template <class DQ, class DK, class DV, class DG, class Phi, class DOut>
void gated_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                            const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& log_gates,
                            const Phi& phi,
                            LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>& state,
                            const Eigen::MatrixBase<DOut>& out,
                            Workspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                            const GatedOptions& options = {}) {
  detail::gated_single("gated_linear_attention", Q, K, V, log_gates, phi, state, out, ws,
                       options);
}

/// \brief Gated causal linear attention continuing from `state` (updated in place), returning
/// the N x M output (see the out-parameter form).
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param log_gates the log-decays: N x 1 (one per token) or N x F (one per feature and token), all
///     <= 0.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param state the state to continue from (empty: zero); holds the state after the last row on
///     return.
/// \param options the query scale, normalisation, algorithm and chunk size (the defaults suit most
///     shapes).
/// \return the N x M output, in the operands' scalar type.
template <class DQ, class DK, class DV, class DG, class Phi>
Matrix<typename DQ::Scalar> gated_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& log_gates, const Phi& phi,
    LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>& state,
    const GatedOptions& options = {}) {
  detail::check_qkv("gated_linear_attention", Q, K, V, /*causal=*/true);
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  Workspace<compute_scalar_t<typename DQ::Scalar>> ws;
  gated_linear_attention(Q, K, V, log_gates, phi, state, out, ws, options);
  return out;
}

/// \brief Gated causal linear attention from a zero state, returning the N x M output.
/// \code
/// // RetNet: a fixed decay γ per head.
/// Eigen::VectorXf log_gamma = Eigen::VectorXf::Constant(N, std::log(1.0f - 1.0f / 32));
/// Eigen::MatrixXf out = linattn::gated_linear_attention(Q, K, V, log_gamma);  // Identity map
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param log_gates the log-decays: N x 1 (one per token) or N x F (one per feature and token), all
///     <= 0.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the query scale, normalisation, algorithm and chunk size (the defaults suit most
///     shapes).
/// \return the N x M output, in the operands' scalar type.
template <class DQ, class DK, class DV, class DG, class Phi = Identity>
Matrix<typename DQ::Scalar> gated_linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                                   const Eigen::MatrixBase<DK>& K,
                                                   const Eigen::MatrixBase<DV>& V,
                                                   const Eigen::MatrixBase<DG>& log_gates,
                                                   const Phi& phi = Phi{},
                                                   const GatedOptions& options = {}) {
  LinearAttentionState<compute_scalar_t<typename DQ::Scalar>> state;
  return gated_linear_attention(Q, K, V, log_gates, phi, state, options);
}

/// \brief Multi-head gated linear attention, heads packed side by side (Q, K: N x H·D; V, out:
/// N x H·M), each head from a zero state, in parallel over heads.
/// \param log_gates N x H (a log-decay per head and token) or N x H·F (head h's per-feature
///        gates in columns [h·F, (h+1)·F)), for every N (one token: 1 x H).
///
/// Shared query/key heads (GVA): with GatedOptions::key_heads = Hk < H, Q and K hold Hk heads
/// (N x Hk·D) and value head h reads query/key head h / (H / Hk), without copying; the log
/// gates, V and the output stay per value head. Without key_heads the layout gives
/// D = Q.cols() / H; state GatedOptions::key_dim to have a call of another layout rejected.
/// \code
/// linattn::MultiHeadWorkspace<float> ws;
/// Eigen::MatrixXf out(N, 8 * 64);
/// linattn::multihead_gated_linear_attention(Q, K, V, log_gates, 8, linattn::Identity{}, out, ws);
/// // 4 query/key heads shared by the 8 value heads: Q, K are N x 4·64.
/// linattn::GatedOptions shared;
/// shared.key_heads = 4;
/// linattn::multihead_gated_linear_attention(Q4, K4, V, log_gates, 8, linattn::Identity{}, out,
///                                           ws, shared);
/// \endcode
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H): value head h reads the
///     columns [c·D, (c+1)·D) of query/key head c = h / (H / Hk).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the query scale, normalisation, algorithm and chunk size (the defaults suit most
///     shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DG, class Phi, class DOut>
void multihead_gated_linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                      const Eigen::MatrixBase<DK>& K,
                                      const Eigen::MatrixBase<DV>& V,
                                      const Eigen::MatrixBase<DG>& log_gates, Index heads,
                                      const Phi& phi, const Eigen::MatrixBase<DOut>& out,
                                      MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                      const GatedOptions& options = {},
                                      const ParallelOptions& par = {}) {
  const Index offsets[2] = {0, Q.rows()};
  detail::batched_gated("multihead_gated_linear_attention", Q, K, V, log_gates,
                        detail::OffsetsRef(offsets, 2), heads, phi, nullptr, out, ws, options,
                        par);
}

/// \brief Multi-head gated linear attention carrying the H heads' states in and out (an empty
/// vector is resized to H zero states; head h continues from states[h] and leaves its final
/// state there, as gated_linear_attention() on its columns does).
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H): value head h reads the
///     columns [c·D, (c+1)·D) of query/key head c = h / (H / Hk).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param log_gates N x H (one log-decay per head and token) or N x H·F (per feature), all <= 0.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param states one state per head (per sequence and head when batched), continued from and
///     updated in place.
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the query scale, normalisation, algorithm and chunk size (the defaults suit most
///     shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DG, class Phi, class DOut>
void multihead_gated_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& log_gates, Index heads, const Phi& phi,
    std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>& states,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws, const GatedOptions& options = {},
    const ParallelOptions& par = {}) {
  const Index offsets[2] = {0, Q.rows()};
  detail::batched_gated("multihead_gated_linear_attention", Q, K, V, log_gates,
                        detail::OffsetsRef(offsets, 2), heads, phi, &states, out, ws, options,
                        par);
}

/// \brief Multi-head gated linear attention, returning N x (H·M).
/// \code
/// Eigen::MatrixXf out = linattn::multihead_gated_linear_attention(Q, K, V, log_gates, 8);
/// \endcode
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H): value head h reads the
///     columns [c·D, (c+1)·D) of query/key head c = h / (H / Hk).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param log_gates N x H (one log-decay per head and token) or N x H·F (per feature), all <= 0.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the query scale, normalisation, algorithm and chunk size (the defaults suit most
///     shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x H·M output, head h in columns [h·M, (h+1)·M).
template <class DQ, class DK, class DV, class DG, class Phi = Identity>
Matrix<typename DQ::Scalar> multihead_gated_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& log_gates, Index heads,
    const Phi& phi = Phi{}, const GatedOptions& options = {}, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  multihead_gated_linear_attention(Q, K, V, log_gates, heads, phi, out, ws, options, par);
  return out;
}

/// \brief Gated linear attention over B packed sequences (rows [offsets[b], offsets[b+1]),
/// offsets of any integer type as for batched_causal_linear_attention()) and H heads, each
/// sequence from a zero state; (sequence, head) pairs in parallel.
/// \code
/// Eigen::VectorXi cu_seqlens(3);
/// cu_seqlens << 0, 100, 128;
/// linattn::batched_gated_linear_attention(Q, K, V, log_gates, cu_seqlens, 8,
///                                         linattn::Identity{}, out, ws);
/// \endcode
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H): value head h reads the
///     columns [c·D, (c+1)·D) of query/key head c = h / (H / Hk).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param log_gates N x H (one log-decay per head and token) or N x H·F (per feature), all <= 0.
/// \param offsets B + 1 row offsets of the packed sequences: sequence b is rows offsets[b] to
///     offsets[b+1] - 1.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the query scale, normalisation, algorithm and chunk size (the defaults suit most
///     shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DG, class Off, class Phi, class DOut>
void batched_gated_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                    const Eigen::MatrixBase<DV>& V,
                                    const Eigen::MatrixBase<DG>& log_gates, const Off& offsets,
                                    Index heads, const Phi& phi, const Eigen::MatrixBase<DOut>& out,
                                    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                    const GatedOptions& options = {},
                                    const ParallelOptions& par = {}) {
  const char* fn = "batched_gated_linear_attention";
  detail::batched_gated(fn, Q, K, V, log_gates, detail::offsets_of(fn, "offsets", offsets),
                        heads, phi, nullptr, out, ws, options, par);
}

/// \brief batched_gated_linear_attention() carrying the B·H states in and out (sequence-major,
/// head h of sequence b at b·H + h; an empty vector is resized to B·H zero states): a server's
/// prefill, whose states then continue in RecurrentGatedAttention decoders.
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H): value head h reads the
///     columns [c·D, (c+1)·D) of query/key head c = h / (H / Hk).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param log_gates N x H (one log-decay per head and token) or N x H·F (per feature), all <= 0.
/// \param offsets B + 1 row offsets of the packed sequences: sequence b is rows offsets[b] to
///     offsets[b+1] - 1.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param states one state per head (per sequence and head when batched), continued from and
///     updated in place.
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the query scale, normalisation, algorithm and chunk size (the defaults suit most
///     shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DG, class Off, class Phi, class DOut>
void batched_gated_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& log_gates, const Off& offsets, Index heads, const Phi& phi,
    std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>& states,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws, const GatedOptions& options = {},
    const ParallelOptions& par = {}) {
  const char* fn = "batched_gated_linear_attention";
  detail::batched_gated(fn, Q, K, V, log_gates, detail::offsets_of(fn, "offsets", offsets),
                        heads, phi, &states, out, ws, options, par);
}

}  // namespace linattn
