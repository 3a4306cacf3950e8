/// \file delta/delta_rule_backward.hpp
/// \brief Gradients of the delta rule (delta_rule_attention() and its multi-head form),
/// including ∂L/∂β and ∂L/∂log a, from states checkpointed at chunk starts.
#pragma once

#include <Eigen/Core>
#include <string>
#include <type_traits>
#include <utility>

#include "../core/common.hpp"
#include "../core/detail/checks.hpp"
#include "../core/detail/views.hpp"
#include "../core/gradients.hpp"
#include "../core/parallel.hpp"
#include "../core/state.hpp"
#include "../core/workspace.hpp"
#include "../linear/heads.hpp"
#include "../linear/multihead_workspace.hpp"
#include "../maps/erased_map.hpp"
#include "../maps/feature_map.hpp"
#include "../maps/identity.hpp"
#include "../maps/map_backward.hpp"
#include "delta_rule.hpp"
#include "detail/delta_backward.hpp"
#include "options.hpp"

namespace linattn {
namespace detail {

// The writable twin of token_param(): N x H for H > 1, a column or row for one head.
template <class D>
typename D::Scalar& token_param_ref(D& x, Index i, Index h, Index heads) {
  return heads == 1 && x.rows() == 1 ? x.coeffRef(0, i) : x.coeffRef(i, h);
}

// The checks of a delta-rule backward call: the forward's shapes and values, dOut, the
// gradients' shapes and overlaps.
template <class DQ, class DK, class DV, class DB, class DA, class DO, class DdQ, class DdK,
          class DdV, class DdB, class DdA, class Phi>
void check_delta_backward(const char* fn, const Eigen::MatrixBase<DQ>& Q,
                          const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                          const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DA>& log_a,
                          const Eigen::MatrixBase<DO>& dOut, const Phi& phi,
                          const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
                          const Eigen::MatrixBase<DdV>& dV, const Eigen::MatrixBase<DdB>& dbeta,
                          const Eigen::MatrixBase<DdA>& dlog_a, Index heads,
                          const DeltaOptions& opts) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  static_check_backward<Phi, compute_scalar_t<Scalar>>();
  static_check_delta<Phi, Scalar>();
  static_assert(std::is_same_v<Storage, typename DB::Scalar> &&
                    std::is_same_v<Storage, typename DA::Scalar> &&
                    std::is_same_v<Storage, typename DdB::Scalar> &&
                    std::is_same_v<Storage, typename DdA::Scalar>,
                "linattn: beta, log_a and their gradients must have the scalar type of Q, K "
                "and V");
  check_backward(fn, Q, K, V, dOut, dQ, dK, dV, /*causal=*/true);
  const Index key_heads = resolve_key_heads(fn, heads, opts.key_heads);
  check_head_dims(fn, Q, V, heads, key_heads, opts.key_dim, opts.value_dim, "beta");
  check_feature_map(fn, phi, Q.cols() / key_heads);
  const Index F = phi.feature_dim(Q.cols() / key_heads);
  check_delta_params(fn, beta, log_a, Q.rows(), heads, F, qkv_shapes(Q, K, V));
  if (dbeta.rows() != beta.rows() || dbeta.cols() != beta.cols())
    throw_invalid(fn, "dbeta is " + shape_of(dbeta) + " but must be " + shape_of(beta) +
                          " (the shape of beta)");
  if (dlog_a.rows() != log_a.rows() || dlog_a.cols() != log_a.cols())
    throw_invalid(fn, "dlog_a is " + shape_of(dlog_a) + " but must be " + shape_of(log_a) +
                          " (the shape of log_a)");
  check_no_overlap(fn, dQ, "beta", beta, "log_a", log_a);
  check_no_overlap(fn, dK, "beta", beta, "log_a", log_a);
  check_no_overlap(fn, dV, "beta", beta, "log_a", log_a);
  check_no_overlap(fn, dbeta, "Q", Q, "K", K, "V", V, "dOut", dOut, "beta", beta, "log_a", log_a);
  check_no_overlap(fn, dlog_a, "Q", Q, "K", K, "V", V, "dOut", dOut, "beta", beta, "log_a", log_a);
  if (memory_overlaps(dbeta, dQ) || memory_overlaps(dbeta, dK) || memory_overlaps(dbeta, dV) ||
      memory_overlaps(dlog_a, dQ) || memory_overlaps(dlog_a, dK) || memory_overlaps(dlog_a, dV) ||
      memory_overlaps(dbeta, dlog_a))
    throw_invalid(fn,
                  "dbeta and dlog_a must not share memory with each other or with dQ, dK "
                  "or dV");
  check_delta_chunk_size(fn, opts);
}

template <class Scalar>
void check_delta_states(const char* fn, const LinearAttentionState<Scalar>& initial,
                        const StateGradient<Scalar>& d_final, Index F, Index M) {
  if (!initial.empty() &&
      !(initial.S.rows() == F && initial.S.cols() == M &&
        (initial.S_lo.size() == 0 || (initial.S_lo.rows() == F && initial.S_lo.cols() == M))))
    throw_invalid(fn, "the initial state (S is " + shape_of(initial.S) + ", S_lo is " +
                          shape_of(initial.S_lo) + ") does not fit F = " + std::to_string(F) +
                          ", M = " + std::to_string(M));
  if (d_final.dS.size() != 0 && !(d_final.dS.rows() == F && d_final.dS.cols() == M))
    throw_invalid(fn, "the final state's gradient (dS is " + shape_of(d_final.dS) +
                          ") does not fit F = " + std::to_string(F) + ", M = " + std::to_string(M));
}

// Head h (of `heads`) of rows [0, N): its parameters to the thread's workspace, the kernel,
// ∂L/∂β and ∂L/∂log a back into the caller's matrices.
template <class Phi, class DQ, class DK, class DV, class DO, class DB, class DA, class OQ, class OK,
          class OV, class OB, class OA, class Scalar>
void delta_backward_head(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DO& dOut,
                         const DB& beta, const DA& log_a, Index h, Index heads,
                         const LinearAttentionState<Scalar>* initial,
                         const StateGradient<Scalar>* d_final, OQ& dQ, OK& dK, OV& dV, OB& dbeta,
                         OA& dlog_a, StateGradient<Scalar>* d_initial, Workspace<Scalar>& ws,
                         const DeltaOptions& opts) {
  const Index N = Q.rows(), M = V.cols(), F = phi.feature_dim(Q.cols());
  const auto params = delta_head_params(beta, log_a, 0, N, h, heads, F, ws);
  Workspace<Scalar>& xs = ws.template extension<DeltaScratch<Scalar>>().more;
  Scalar* db = xs.vector(kDeltaDBeta, N).data();
  Scalar* dg = params.g ? xs.vector(kDeltaDG, N * params.gw).data() : nullptr;
  if (params.gw > 1)
    delta_backward_channels(phi, Q, K, V, dOut, params.beta, params.g, initial, d_final, dQ, dK, dV,
                            db, dg, d_initial, ws, opts, F, M);
  else
    delta_backward_run(phi, Q, K, V, dOut, params.beta, params.g, initial, d_final, dQ, dK, dV, db,
                       dg, d_initial, ws, opts, F, M);
  using GB = typename std::decay_t<OB>::Scalar;
  using GA = typename std::decay_t<OA>::Scalar;
  for (Index i = 0; i < N; ++i) token_param_ref(dbeta, i, h, heads) = static_cast<GB>(db[i]);
  if (dg && params.gw > 1) {
    // In blocks of 16 tokens, column by column: a column-major dlog_a is then written
    // contiguously (its token-major rows would lie a column apart).
    for (Index i0 = 0; i0 < N; i0 += 16)
      for (Index c = 0; c < F; ++c)
        for (Index i = i0; i < std::min(N, i0 + 16); ++i)
          dlog_a(i, h * F + c) = static_cast<GA>(dg[i * F + c]);
  } else if (dg) {
    for (Index i = 0; i < N; ++i) token_param_ref(dlog_a, i, h, heads) = static_cast<GA>(dg[i]);
  }
}

template <class Scalar, class DQ, class DK, class DV, class DB, class DA>
DeltaGradients<Scalar> delta_gradients_like(const DQ& Q, const DK& K, const DV& V, const DB& B,
                                            const DA& A) {
  AttentionGradients<Scalar> a = gradients_like<Scalar>(Q.rows(), K.rows(), Q.cols(), V.cols());
  return {std::move(a.dQ), std::move(a.dK), std::move(a.dV), Matrix<Scalar>(B.rows(), B.cols()),
          Matrix<Scalar>(A.rows(), A.cols())};
}

}  // namespace detail

/// \brief Gradients of delta_rule_attention() continuing from `initial`, written into caller
/// buffers; allocation-free once `ws` has the shape.
///
/// The chunked form differentiated (docs/SPEC.md §9.3, "Gradients"), whatever
/// DeltaOptions::algorithm says (chunk_size applies): a forward sweep keeps the state entering
/// every chunk (⌈N/C⌉ states of F x M in `ws`: the working memory), then the chunks are
/// recomputed from their checkpoints in reverse order, each carrying \f$\partial L/\partial S\f$
/// back to its start. No state is recovered by running a step backwards:
/// \f$I - \beta \hat k \hat k^\top\f$ is singular at β = 1. With per-channel log-decays (KDA)
/// each chunk's C + 1 states are recomputed from its checkpoint and the chain rule runs back
/// token by token (C x F x M more working memory; dlog_a is then N x F).
///
/// \param dOut ∂L/∂out, N x M.
/// \param initial the state the forward started from (empty: zero; its low part counts).
/// \param d_final ∂L/∂S of the state the forward left (empty: zero; dz is ignored).
/// \param dbeta, dlog_a ∂L/∂β and ∂L/∂log a, the shapes of beta and log_a (dlog_a empty when
///        log_a is: no decay).
/// \param d_initial receives ∂L/∂S of `initial` (dz zero).
/// \throws std::invalid_argument as delta_rule_attention(), and on gradients of the wrong shape
/// or overlapping an input or each other.
/// \code
/// linattn::StateGradient<double> none, d_start;
/// linattn::Workspace<double> ws;
/// linattn::delta_rule_attention_backward(Q, K, V, beta, log_a, dOut, phi, initial, none,
///                                        dQ, dK, dV, dbeta, dlog_a, d_start, ws);
/// \endcode
template <class DQ, class DK, class DV, class DB, class DA, class DO, class Phi, class DdQ,
          class DdK, class DdV, class DdB, class DdA>
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param beta N writing strengths in [0, 2], one per token: how far each step moves the state's
///     value for its key.
/// \param log_a N log-decays g_t <= 0, one per token (Gated DeltaNet), N x F (one per key channel
///     and token: KDA), or an empty vector for none.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param dQ receives the N x D gradient with respect to Q.
/// \param dK receives the L x D gradient with respect to K.
/// \param dV receives the L x M gradient with respect to V.
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
/// \param options the query scale, algorithm and chunk size (the defaults suit most shapes).
void delta_rule_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DA>& log_a,
    const Eigen::MatrixBase<DO>& dOut, const Phi& phi,
    const LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>& initial,
    const StateGradient<compute_scalar_t<typename DQ::Scalar>>& d_final,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, const Eigen::MatrixBase<DdB>& dbeta,
    const Eigen::MatrixBase<DdA>& dlog_a,
    StateGradient<compute_scalar_t<typename DQ::Scalar>>& d_initial,
    Workspace<compute_scalar_t<typename DQ::Scalar>>& ws, const DeltaOptions& options = {}) {
  const char* fn = "delta_rule_attention_backward";
  detail::check_delta_backward(fn, Q, K, V, beta, log_a, dOut, phi, dQ, dK, dV, dbeta, dlog_a, 1,
                               options);
  detail::check_delta_states(fn, initial, d_final, phi.feature_dim(Q.cols()), V.cols());
  detail::StateApart("dQ", dQ, "dK", dK, "dV", dV, "dbeta", dbeta, "dlog_a", dlog_a)
      .check(fn, initial, "initial");
  auto& gb = detail::writable(dbeta);
  auto& ga = detail::writable(dlog_a);
  const auto map = detail::erase_map_with_backward<compute_scalar_t<typename DQ::Scalar>>(phi);
  detail::with_backward_views(Q.derived(), K.derived(), V.derived(), dOut.derived(),
                              detail::writable(dQ), detail::writable(dK), detail::writable(dV),
                              [&](const auto& q, const auto& k, const auto& v, const auto& go,
                                  auto& dq, auto& dk, auto& dv) {
                                detail::delta_backward_head(map, q, k, v, go, beta.derived(),
                                                            log_a.derived(), 0, 1, &initial,
                                                            &d_final, dq, dk, dv, gb, ga,
                                                            &d_initial, ws, options);
                              });
}

/// \brief Gradients of delta_rule_attention() continuing from `initial`, returned (see the
/// out-parameter form).
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param beta N writing strengths in [0, 2], one per token: how far each step moves the state's
///     value for its key.
/// \param log_a N log-decays g_t <= 0, one per token (Gated DeltaNet), N x F (one per key channel
///     and token: KDA), or an empty vector for none.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param initial the state the forward started from (empty: zero).
/// \param options the query scale, algorithm and chunk size (the defaults suit most shapes).
/// \return the gradients with respect to Q, K, V, beta and log_a.
template <class DQ, class DK, class DV, class DB, class DA, class DO, class Phi>
DeltaGradients<typename DQ::Scalar> delta_rule_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DA>& log_a,
    const Eigen::MatrixBase<DO>& dOut, const Phi& phi,
    const LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>& initial,
    const DeltaOptions& options = {}) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  detail::check_qkv("delta_rule_attention_backward", Q, K, V, /*causal=*/true);
  auto g = detail::delta_gradients_like<Storage>(Q, K, V, beta, log_a);
  StateGradient<Scalar> none, d_initial;
  Workspace<compute_scalar_t<Scalar>> ws;
  delta_rule_attention_backward(Q, K, V, beta, log_a, dOut, phi, initial, none, g.dQ, g.dK, g.dV,
                                g.dbeta, g.dlog_a, d_initial, ws, options);
  return g;
}

/// \brief Gradients of delta_rule_attention() from a zero state, returned.
/// \code
/// auto g = linattn::delta_rule_attention_backward(Q, K, V, beta, log_a, dOut,
///                                                 linattn::L2Normalize<linattn::Silu>{});
/// // g.dQ, g.dK, g.dV, g.dbeta (as beta), g.dlog_a (as log_a; empty without decay)
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param beta N writing strengths in [0, 2], one per token: how far each step moves the state's
///     value for its key.
/// \param log_a N log-decays g_t <= 0, one per token (Gated DeltaNet), N x F (one per key channel
///     and token: KDA), or an empty vector for none.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the query scale, algorithm and chunk size (the defaults suit most shapes).
/// \return the gradients with respect to Q, K, V, beta and log_a.
template <class DQ, class DK, class DV, class DB, class DA, class DO, class Phi = Identity>
DeltaGradients<typename DQ::Scalar> delta_rule_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DA>& log_a,
    const Eigen::MatrixBase<DO>& dOut, const Phi& phi = Phi{}, const DeltaOptions& options = {}) {
  const LinearAttentionState<compute_scalar_t<typename DQ::Scalar>> zero;
  return delta_rule_attention_backward(Q, K, V, beta, log_a, dOut, phi, zero, options);
}

namespace detail {

// multihead_delta_rule_attention_backward() with carried states: head h continues initial[h]
// and receives d_final[h] (each array H long, or nullptr: zeros), d_initial[h] its initial
// state's gradient (nullptr: not wanted). The layers' backward from carried states calls it
// per sequence; with null pointers it is the public form.
template <class DQ, class DK, class DV, class DB, class DA, class DO, class Phi, class DdQ,
          class DdK, class DdV, class DdB, class DdA,
          class Scalar = compute_scalar_t<typename DQ::Scalar>>
void multihead_delta_backward(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                              const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DB>& beta,
                              const Eigen::MatrixBase<DA>& log_a, const Eigen::MatrixBase<DO>& dOut,
                              Index heads, const Phi& phi,
                              const LinearAttentionState<Scalar>* initial,
                              const StateGradient<Scalar>* d_final,
                              const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
                              const Eigen::MatrixBase<DdV>& dV, const Eigen::MatrixBase<DdB>& dbeta,
                              const Eigen::MatrixBase<DdA>& dlog_a,
                              StateGradient<Scalar>* d_initial, MultiHeadWorkspace<Scalar>& ws,
                              const DeltaOptions& options, const ParallelOptions& par) {
  static_assert(std::is_same_v<Scalar, compute_scalar_t<typename DQ::Scalar>>,
                "linattn: the states' scalar type must be the compute scalar of Q");
  const LinearAttentionState<Scalar> zero;
  const StateGradient<Scalar> none;
  const char* fn = "multihead_delta_rule_attention_backward";
  const HeadLayout hl = check_grouped_heads(fn, Q, K, V, heads, options.key_heads, true);
  const Index D = hl.D, M = hl.M, G = hl.group();
  check_delta_backward(fn, Q, K, V, beta, log_a, dOut, phi, dQ, dK, dV, dbeta, dlog_a, heads,
                       options);
  const Index N = Q.rows();
  if (initial || d_final)
    for (Index h = 0; h < heads; ++h)
      check_delta_states(fn, initial ? initial[h] : zero, d_final ? d_final[h] : none,
                         phi.feature_dim(D), M);
  auto& gb = writable(dbeta);
  auto& ga = writable(dlog_a);
  const auto map = erase_map_with_backward<compute_scalar_t<typename DQ::Scalar>>(phi);
  const auto run = [&](const auto& q, const auto& k, const auto& v, const auto& go, auto& dq,
                       auto& dk, auto& dv) {
    const double work = 4.0 * double(heads) * causal_head_work(N, phi.feature_dim(D), M);
    using GQ = std::decay_t<decltype(dq)>;
    using GK = std::decay_t<decltype(dk)>;
    // One task per query/key head, its G value heads in turn: the first writes the shared
    // head's dQ and dK, the others add theirs (no two threads write one block).
    parallel_tasks<Scalar>(hl.key_heads, work, par, ws, [&](Index kh, int thread) {
      Workspace<Scalar>& tws = ws.for_thread(thread);
      auto dqs = sub_view(dq, 0, kh * D, N, D);
      auto dks = sub_view(dk, 0, kh * D, N, D);
      for (Index j = 0; j < G; ++j) {
        const Index h = kh * G + j;
        auto dvs = sub_view(dv, 0, h * M, N, M);
        const auto head = [&](GQ& oq, GK& ok) {
          delta_backward_head(map, sub_view(q, 0, kh * D, N, D), sub_view(k, 0, kh * D, N, D),
                              sub_view(v, 0, h * M, N, M), sub_view(go, 0, h * M, N, M),
                              beta.derived(), log_a.derived(), h, heads,
                              initial ? initial + h : nullptr, d_final ? d_final + h : nullptr, oq,
                              ok, dvs, gb, ga, d_initial ? d_initial + h : nullptr, tws, options);
        };
        if (j == 0) {
          head(dqs, dks);
          continue;
        }
        GQ tq = scratch_view<GQ>(tws, kSlotSharedQ, N, D);
        GK tk = scratch_view<GK>(tws, kSlotSharedK, N, D);
        head(tq, tk);
        dqs += tq;
        dks += tk;
      }
    });
  };
  with_backward_views(Q.derived(), K.derived(), V.derived(), dOut.derived(), writable(dQ),
                      writable(dK), writable(dV), run);
}

}  // namespace detail

/// \brief Gradients of multihead_delta_rule_attention() (each head from a zero state), written
/// into caller buffers; heads in parallel, each as delta_rule_attention_backward() on its
/// columns (beta, log_a and their gradients N x H; log_a and dlog_a may be empty).
template <class DQ, class DK, class DV, class DB, class DA, class DO, class Phi, class DdQ,
          class DdK, class DdV, class DdB, class DdA>
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H): value head h reads the
///     columns [c·D, (c+1)·D) of query/key head c = h / (H / Hk).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param beta N x H writing strengths in [0, 2], per token and head.
/// \param log_a N x H log-decays <= 0 (a token's decay per head), N x H·F (per key channel,
///     KDA: head h's in columns [h·F, (h+1)·F)), or empty for none.
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param dQ receives the N x Hk·D gradient with respect to Q (a shared head's: the sum over
///     its value heads).
/// \param dK receives the L x Hk·D gradient with respect to K.
/// \param dV receives the L x H·M gradient with respect to V.
/// \param dbeta receives the gradient with respect to beta.
/// \param dlog_a receives the gradient with respect to log_a.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the query scale, algorithm and chunk size (the defaults suit most shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
void multihead_delta_rule_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DA>& log_a,
    const Eigen::MatrixBase<DO>& dOut, Index heads, const Phi& phi,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, const Eigen::MatrixBase<DdB>& dbeta,
    const Eigen::MatrixBase<DdA>& dlog_a,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws, const DeltaOptions& options = {},
    const ParallelOptions& par = {}) {
  using Scalar = compute_scalar_t<typename DQ::Scalar>;
  detail::multihead_delta_backward(Q, K, V, beta, log_a, dOut, heads, phi,
                                   static_cast<const LinearAttentionState<Scalar>*>(nullptr),
                                   static_cast<const StateGradient<Scalar>*>(nullptr), dQ, dK, dV,
                                   dbeta, dlog_a, static_cast<StateGradient<Scalar>*>(nullptr), ws,
                                   options, par);
}

/// \brief Gradients of multihead_delta_rule_attention(), returned.
/// \code
/// auto g = linattn::multihead_delta_rule_attention_backward(Q, K, V, beta, log_a, dOut, 8);
/// \endcode
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H): value head h reads the
///     columns [c·D, (c+1)·D) of query/key head c = h / (H / Hk).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param beta N x H writing strengths in [0, 2], per token and head.
/// \param log_a N x H log-decays <= 0 (a token's decay per head), N x H·F (per key channel,
///     KDA: head h's in columns [h·F, (h+1)·F)), or empty for none.
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the query scale, algorithm and chunk size (the defaults suit most shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the gradients with respect to Q, K, V, beta and log_a.
template <class DQ, class DK, class DV, class DB, class DA, class DO, class Phi = Identity>
DeltaGradients<typename DQ::Scalar> multihead_delta_rule_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DA>& log_a,
    const Eigen::MatrixBase<DO>& dOut, Index heads, const Phi& phi = Phi{},
    const DeltaOptions& options = {}, const ParallelOptions& par = {}) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  auto g = detail::delta_gradients_like<Storage>(Q, K, V, beta, log_a);
  MultiHeadWorkspace<compute_scalar_t<Scalar>> ws;
  multihead_delta_rule_attention_backward(Q, K, V, beta, log_a, dOut, heads, phi, g.dQ, g.dK, g.dV,
                                          g.dbeta, g.dlog_a, ws, options, par);
  return g;
}

}  // namespace linattn
