/// \file gated/gated_attention_backward.hpp
/// \brief Gradients of decayed and gated linear attention (gated_attention.hpp), including the
/// log gates', with O(F·M) working memory per head.
#pragma once

#include <Eigen/Core>

#include <string>
#include <type_traits>
#include <utility>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../maps/erased_map.hpp"
#include "detail/gated_backward.hpp"
#include "detail/gated_forward.hpp"
#include "../core/detail/views.hpp"
#include "gated_attention.hpp"
#include "options.hpp"
#include "../maps/identity.hpp"
#include "../core/gradients.hpp"
#include "../maps/map_backward.hpp"
#include "../linear/heads.hpp"
#include "../linear/multihead_workspace.hpp"
#include "../core/state.hpp"
#include "../core/workspace.hpp"

namespace linattn {
namespace detail {

// The checks of a gated backward call: the forward's shapes, dOut, the gradients' shapes and
// overlaps, the carried state and its gradient.
template <class DQ, class DK, class DV, class DG, class DO, class DdQ, class DdK, class DdV,
          class DdG, class Phi>
void check_gated_backward(const char* fn, const Eigen::MatrixBase<DQ>& Q,
                          const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                          const Eigen::MatrixBase<DG>& log_gates,
                          const Eigen::MatrixBase<DO>& dOut, const Phi& phi,
                          const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
                          const Eigen::MatrixBase<DdV>& dV, const Eigen::MatrixBase<DdG>& dG,
                          Index heads, const GatedOptions& opts) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  static_check_backward<Phi, compute_scalar_t<Scalar>>();
  static_check_gated<Phi, Scalar>();
  static_assert(std::is_same_v<Storage, typename DG::Scalar>,
                "linattn: log_gates must have the scalar type of Q, K and V");
  check_backward(fn, Q, K, V, dOut, dQ, dK, dV, /*causal=*/true);
  const Index key_heads = resolve_key_heads(fn, heads, opts.key_heads);
  check_head_dims(fn, Q, V, heads, key_heads, opts.key_dim, opts.value_dim, "the log gates");
  const Index D = Q.cols() / key_heads;
  check_feature_map(fn, phi, D);
  const Index F = phi.feature_dim(D);
  check_log_gates(fn, log_gates, Q.rows(), heads, heads * F,
                  heads == 1 ? "one log-decay per token, or one per feature, F = " +
                                   std::to_string(F)
                             : "one log-decay per head and token, or one per feature of each "
                               "head, H = " + std::to_string(heads) + ", F = " +
                                   std::to_string(F),
                  " (Q is " + shape_of(Q) + ", K is " + shape_of(K) + ", V is " + shape_of(V) +
                      ")");
  if (dG.rows() != log_gates.rows() || dG.cols() != log_gates.cols())
    throw_invalid(fn, "dlog_gates is " + shape_of(dG) + " but must be " + shape_of(log_gates) +
                          " (the shape of log_gates)");
  check_no_overlap(fn, dQ, "log_gates", log_gates);
  check_no_overlap(fn, dK, "log_gates", log_gates);
  check_no_overlap(fn, dV, "log_gates", log_gates);
  check_no_overlap(fn, dG, "Q", Q, "K", K, "V", V, "dOut", dOut, "log_gates", log_gates);
  if (memory_overlaps(dG, dQ) || memory_overlaps(dG, dK) || memory_overlaps(dG, dV))
    throw_invalid(fn, "dlog_gates must not share memory with dQ, dK or dV");
  check_chunk_size(fn, opts);
}

template <class Scalar>
void check_gated_states(const char* fn, const LinearAttentionState<Scalar>& initial,
                        const StateGradient<Scalar>& d_final, Index F, Index M) {
  if (!initial.empty() &&
      !(initial.S.rows() == F && initial.S.cols() == M && initial.z.size() == F &&
        initial.m.size() == 0 &&
        (initial.S_lo.size() == 0 || (initial.S_lo.rows() == F && initial.S_lo.cols() == M)) &&
        (initial.z_lo.size() == 0 || initial.z_lo.size() == F)))
    throw_invalid(fn, "the initial state (S is " + shape_of(initial.S) + ", z has " +
                          std::to_string(initial.z.size()) + " entries) does not fit F = " +
                          std::to_string(F) + ", M = " + std::to_string(M));
  if (!d_final.empty() &&
      !((d_final.dS.size() == 0 || (d_final.dS.rows() == F && d_final.dS.cols() == M)) &&
        (d_final.dz.size() == 0 || d_final.dz.size() == F)))
    throw_invalid(fn, "the final state's gradient (dS is " + shape_of(d_final.dS) + ", dz has " +
                          std::to_string(d_final.dz.size()) + " entries) does not fit F = " +
                          std::to_string(F) + ", M = " + std::to_string(M));
}

// Uninitialised gradients of the shapes of Q, K, V and the log gates (the returning forms).
template <class Scalar, class DQ, class DK, class DV, class DG>
GatedGradients<Scalar> gated_gradients_like(const DQ& Q, const DK& K, const DV& V, const DG& G) {
  AttentionGradients<Scalar> a = gradients_like<Scalar>(Q.rows(), K.rows(), Q.cols(), V.cols());
  return {std::move(a.dQ), std::move(a.dK), std::move(a.dV), Matrix<Scalar>(G.rows(), G.cols())};
}

// One head's backward on blocks of the caller's operands (the multi-head form's type too).
template <class Phi, class DQ, class DK, class DV, class DG, class DO, class Scalar, class OQ,
          class OK, class OV, class OG>
void gated_backward_run(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DG& G,
                        const DO& dOut, const LinearAttentionState<Scalar>& initial,
                        const StateGradient<Scalar>& d_final, OQ& dQ, OK& dK, OV& dV, OG& dG,
                        StateGradient<Scalar>* d_initial, Workspace<Scalar>& ws,
                        const GatedOptions& opts) {
  const GatedConfig<Scalar> cfg = gated_config<Scalar>(opts, G.cols());
  const Index F = phi.feature_dim(Q.cols());
  if (gated_runs_recurrent(opts, F * V.cols()))
    gated_backward_recurrent(phi, Q, K, V, G, dOut, initial, d_final, dQ, dK, dV, dG, d_initial,
                             ws, cfg);
  else
    gated_backward_chunked(phi, Q, K, V, G, dOut, initial, d_final, dQ, dK, dV, dG, d_initial,
                           ws, cfg, gated_block_rows(opts, F * V.cols()));
}

}  // namespace detail

/// \brief Gradients of gated_linear_attention() continuing from `initial`, written into caller
/// buffers; allocation-free once `ws` has the shape.
///
/// Memory-efficient (docs/SPEC.md §9, "Gradients"): a forward sweep recomputes the decayed
/// states for dQ, a backward sweep accumulates the decayed adjoint
/// \f$R_j = \sum_{i \ge j} \mathrm{diag}(e^{G_i - G_j})\,\varphi(q_i)\, g_i'^\top\f$ for dK
/// and dV, and the log gates' gradient comes from
/// \f[ \frac{\partial L}{\partial G_i} = \varphi(q_i) \odot \nabla\varphi(q_i) -
///     \varphi(k_i) \odot \nabla\varphi(k_i), \qquad
///     \frac{\partial L}{\partial g_t} = \sum_{i \ge t} \frac{\partial L}{\partial G_i} \f]
/// (G the cumulative log gates; summed over features for a scalar decay), plus the final
/// state's term \f$\sum_m \partial L/\partial S_N \odot S_N\f$ at i = N. The pair j = i, which
/// both products contain and which cancels exactly, is left out of both, so that the gates'
/// gradient keeps its relative accuracy with strong gates. No per-token state is stored.
///
/// `options.algorithm` picks the sweeps' form as for the forward: Recurrent (token by token
/// with fused one-pass kernels, what Auto picks for states up to 128 x 128; working memory
/// O(F·M + 128·(F + M))) or Chunked (GEMMs per chunk of C rows, the decayed products of spec
/// §9 with the forward's sub-chunks for strong gates; O(C·(C + F + M) + F·M)). Both are
/// independent of N and agree to rounding.
///
/// \param initial the state the forward started from (empty: zero), unchanged.
/// \param d_final the gradient with respect to the state the forward left (empty: zero).
/// \param d_initial receives the gradient with respect to `initial` (pass it as `d_final` of
///        the previous piece of the sequence).
/// \param dQ, dK, dV, dlog_gates outputs of the shapes of Q, K, V, log_gates; must not
///        overlap each other or any input.
/// \throws std::invalid_argument on mismatched shapes (naming the function and every shape), bad
/// log gates, a state or gradient that does not fit F x M, or overlapping outputs.
/// \code
/// linattn::LinearAttentionState<double> s0, s_mid;   // s0: empty (zero)
/// auto a = linattn::gated_linear_attention(Qa, Ka, Va, Ga, phi, s_mid = s0);
/// linattn::StateGradient<double> none, d_mid, d_start;
/// linattn::Workspace<double> ws;
/// // Backward of the second piece first, then the first with its d_final.
/// linattn::gated_linear_attention_backward(Qb, Kb, Vb, Gb, dOut_b, phi, s_mid, none,
///                                          dQb, dKb, dVb, dGb, d_mid, ws);
/// linattn::gated_linear_attention_backward(Qa, Ka, Va, Ga, dOut_a, phi, s0, d_mid,
///                                          dQa, dKa, dVa, dGa, d_start, ws);
/// \endcode
template <class DQ, class DK, class DV, class DG, class DO, class Phi, class DdQ, class DdK,
          class DdV, class DdG>
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param log_gates the log-decays: N x 1 (one per token) or N x F (one per feature and token), all
///     <= 0.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
/// \param options the query scale, normalisation, algorithm and chunk size (the defaults suit most
///     shapes).
void gated_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& log_gates, const Eigen::MatrixBase<DO>& dOut, const Phi& phi,
    const LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>& initial,
    const StateGradient<compute_scalar_t<typename DQ::Scalar>>& d_final,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, const Eigen::MatrixBase<DdG>& dlog_gates,
    StateGradient<compute_scalar_t<typename DQ::Scalar>>& d_initial,
    Workspace<compute_scalar_t<typename DQ::Scalar>>& ws, const GatedOptions& options = {}) {
  const char* fn = "gated_linear_attention_backward";
  detail::check_gated_backward(fn, Q, K, V, log_gates, dOut, phi, dQ, dK, dV, dlog_gates, 1,
                               options);
  const Index N = Q.rows(), M = V.cols();
  detail::check_gated_states(fn, initial, d_final, phi.feature_dim(Q.cols()), M);
  detail::StateApart("dQ", dQ, "dK", dK, "dV", dV, "dlog_gates", dlog_gates)
      .check(fn, initial, "initial");
  // As views (detail/views.hpp), one row segment each: the multi-head form's types.
  const detail::Viewed<DQ> q(Q.derived());
  const detail::Viewed<DK> k(K.derived());
  const detail::Viewed<DV> v(V.derived());
  const detail::Viewed<DG> g(log_gates.derived());
  const detail::Viewed<DO> go(dOut.derived());
  const auto map = detail::erase_map_with_backward<compute_scalar_t<typename DQ::Scalar>>(phi);
  detail::with_output_view(detail::writable(dlog_gates), [&](auto& gg) {
    detail::with_output_views(
        detail::writable(dQ), detail::writable(dK), detail::writable(dV),
        [&](auto& gq, auto& gk, auto& gv) {
          auto dqs = detail::row_segment(gq, 0, N);
          auto dks = detail::row_segment(gk, 0, N);
          auto dvs = detail::row_segment(gv, 0, N);
          auto dgs = detail::row_segment(gg, 0, N);
          detail::gated_backward_run(
              map, detail::row_segment(q.view, 0, N), detail::row_segment(k.view, 0, N),
              detail::row_segment(v.view, 0, N), detail::row_segment(g.view, 0, N),
              detail::row_segment(go.view, 0, N), initial, d_final, dqs, dks, dvs, dgs,
              &d_initial, ws, options);
        });
  });
}

/// \brief Gradients of gated_linear_attention() from a zero state, returned (see the
/// out-parameter form).
/// \code
/// auto g = linattn::gated_linear_attention_backward(Q, K, V, log_gates, dOut);
/// // g.dQ, g.dK, g.dV, g.dlog_gates (N x 1 or N x F, as log_gates)
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param log_gates the log-decays: N x 1 (one per token) or N x F (one per feature and token), all
///     <= 0.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the query scale, normalisation, algorithm and chunk size (the defaults suit most
///     shapes).
/// \return the gradients with respect to Q, K, V and the log gates.
template <class DQ, class DK, class DV, class DG, class DO, class Phi = Identity>
GatedGradients<typename DQ::Scalar> gated_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& log_gates,
    const Eigen::MatrixBase<DO>& dOut, const Phi& phi = Phi{}, const GatedOptions& options = {}) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  detail::check_qkv("gated_linear_attention_backward", Q, K, V, /*causal=*/true);
  auto g = detail::gated_gradients_like<Storage>(Q, K, V, log_gates);
  LinearAttentionState<Scalar> initial;
  StateGradient<Scalar> none, d_initial;
  Workspace<compute_scalar_t<Scalar>> ws;
  gated_linear_attention_backward(Q, K, V, log_gates, dOut, phi, initial, none, g.dQ, g.dK, g.dV,
                                  g.dlog_gates, d_initial, ws, options);
  return g;
}

/// \brief Gradients of multihead_gated_linear_attention() (each head from a zero state),
/// written into caller buffers; heads in parallel, each as gated_linear_attention_backward()
/// on its columns.
template <class DQ, class DK, class DV, class DG, class DO, class Phi, class DdQ, class DdK,
          class DdV, class DdG>
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H): value head h reads the
///     columns [c·D, (c+1)·D) of query/key head c = h / (H / Hk).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param log_gates N x H (one log-decay per head and token) or N x H·F (per feature), all <= 0.
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param dQ receives the N x Hk·D gradient with respect to Q (a shared head's: the sum over
///     its value heads).
/// \param dK receives the L x Hk·D gradient with respect to K.
/// \param dV receives the L x H·M gradient with respect to V.
/// \param dlog_gates receives the gradient with respect to log_gates.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the query scale, normalisation, algorithm and chunk size (the defaults suit most
///     shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
void multihead_gated_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& log_gates, const Eigen::MatrixBase<DO>& dOut, Index heads,
    const Phi& phi, const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, const Eigen::MatrixBase<DdG>& dlog_gates,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws, const GatedOptions& options = {},
    const ParallelOptions& par = {}) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  const char* fn = "multihead_gated_linear_attention_backward";
  const detail::HeadLayout hl =
      detail::check_grouped_heads(fn, Q, K, V, heads, options.key_heads, true);
  const Index D = hl.D, M = hl.M, G = hl.group();
  detail::check_gated_backward(fn, Q, K, V, log_gates, dOut, phi, dQ, dK, dV, dlog_gates, heads,
                               options);
  const Index N = Q.rows(), gw = log_gates.cols() / heads;
  const detail::Viewed<DQ> q(Q.derived());
  const detail::Viewed<DK> k(K.derived());
  const detail::Viewed<DV> v(V.derived());
  const detail::Viewed<DG> g(log_gates.derived());
  const detail::Viewed<DO> go(dOut.derived());
  const LinearAttentionState<Scalar> zero;
  const StateGradient<Scalar> none;
  const auto map = detail::erase_map_with_backward<compute_scalar_t<typename DQ::Scalar>>(phi);
  detail::with_output_view(detail::writable(dlog_gates), [&](auto& gg) {
    detail::with_output_views(
        detail::writable(dQ), detail::writable(dK), detail::writable(dV),
        [&](auto& gq, auto& gk, auto& gv) {
          using GQ = std::decay_t<decltype(gq)>;
          using GK = std::decay_t<decltype(gk)>;
          const double work =
              2.0 * double(heads) * detail::causal_head_work(N, phi.feature_dim(D), M);
          // One task per query/key head, its G value heads in turn: the first writes the
          // shared head's dQ and dK, the others add theirs (no two threads write one block).
          detail::parallel_tasks<Scalar>(hl.key_heads, work, par, ws, [&](Index kh, int thread) {
            Workspace<Scalar>& tws = ws.for_thread(thread);
            auto dqs = gq.block(0, kh * D, N, D);
            auto dks = gk.block(0, kh * D, N, D);
            for (Index j = 0; j < G; ++j) {
              const Index h = kh * G + j;
              auto dvs = gv.block(0, h * M, N, M);
              auto dgs = gg.block(0, h * gw, N, gw);
              const auto head = [&](auto& oq, auto& ok) {
                detail::gated_backward_run(
                    map, q.view.block(0, kh * D, N, D), k.view.block(0, kh * D, N, D),
                    v.view.block(0, h * M, N, M), g.view.block(0, h * gw, N, gw),
                    go.view.block(0, h * M, N, M), zero, none, oq, ok, dvs, dgs,
                    static_cast<StateGradient<Scalar>*>(nullptr), tws, options);
              };
              if (j == 0) {
                head(dqs, dks);
                continue;
              }
              GQ sq = detail::scratch_view<GQ>(tws, detail::kSlotSharedQ, N, D);
              GK sk = detail::scratch_view<GK>(tws, detail::kSlotSharedK, N, D);
              auto tq = sq.block(0, 0, N, D);
              auto tk = sk.block(0, 0, N, D);
              head(tq, tk);
              dqs += tq;
              dks += tk;
            }
          });
        });
  });
}

/// \brief Gradients of multihead_gated_linear_attention(), returned.
/// \code
/// auto g = linattn::multihead_gated_linear_attention_backward(Q, K, V, log_gates, dOut, 8);
/// \endcode
/// \param Q N x Hk·D queries (Hk = the options' key_heads, or H): value head h reads the
///     columns [c·D, (c+1)·D) of query/key head c = h / (H / Hk).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param log_gates N x H (one log-decay per head and token) or N x H·F (per feature), all <= 0.
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the query scale, normalisation, algorithm and chunk size (the defaults suit most
///     shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the gradients with respect to Q, K, V and the log gates.
template <class DQ, class DK, class DV, class DG, class DO, class Phi = Identity>
GatedGradients<typename DQ::Scalar> multihead_gated_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& log_gates,
    const Eigen::MatrixBase<DO>& dOut, Index heads, const Phi& phi = Phi{},
    const GatedOptions& options = {}, const ParallelOptions& par = {}) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  auto g = detail::gated_gradients_like<Storage>(Q, K, V, log_gates);
  MultiHeadWorkspace<compute_scalar_t<Scalar>> ws;
  multihead_gated_linear_attention_backward(Q, K, V, log_gates, dOut, heads, phi, g.dQ, g.dK,
                                            g.dV, g.dlog_gates, ws, options, par);
  return g;
}

}  // namespace linattn
