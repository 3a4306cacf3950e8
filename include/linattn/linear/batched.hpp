/// \file linear/batched.hpp
/// \brief Linear attention over B packed sequences of different lengths and H heads (varlen, as
/// FLA's `cu_seqlens`), causal or not, masked or not, with carried states.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
#include "causal_linear_attention.hpp"
#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../maps/erased_map.hpp"
#include "detail/multihead_kernels.hpp"
#include "../core/detail/result.hpp"
#include "../core/detail/views.hpp"
#include "../maps/elu_plus_one.hpp"
#include "linear_attention.hpp"
#include "multihead_recurrent.hpp"
#include "multihead_workspace.hpp"
#include "../core/parallel.hpp"
#include "heads.hpp"
#include "../core/state.hpp"
#include "../core/workspace.hpp"
#include "../maps/map_state.hpp"

namespace linattn {

/// \brief Non-causal linear attention over B packed sequences and H heads, written into
/// `out`. Query rows [q_offsets[b], q_offsets[b+1]) attend to key rows [k_offsets[b],
/// k_offsets[b+1]); head h uses columns [h·D, (h+1)·D) of Q and K and [h·M, (h+1)·M) of V and
/// out. No matrix, Map or block input is copied; an expression that is costly to re-read (a
/// product such as X * Wq) is evaluated once into a temporary before the parallel region, as
/// in every multi-head kernel. (sequence, head) pairs run in parallel. Equal to per-head,
/// per-sequence linear_attention() calls; allocation-free with a reused MultiHeadWorkspace
/// (and inputs that need no temporary). An exception in a task (a throwing feature map,
/// std::bad_alloc) reaches the caller after the parallel region; `out` is then unspecified.
/// \param out must not overlap Q, K, V (checked once, before any head runs:
///            std::invalid_argument). A product operand is evaluated before any head runs and
///            may read `out`'s memory; any other expression operand must not.
/// \throws std::invalid_argument on inconsistent shapes or offsets, or an overlapping `out`.
/// \code
/// // Two sequences of 100 and 28 tokens, packed one after the other, 8 heads of D = M = 64.
/// linattn::MultiHeadWorkspace<float> ws;
/// Eigen::MatrixXf out(128, 8 * 64);
/// linattn::batched_linear_attention(Q, K, V, {0, 100, 128}, {0, 100, 128}, 8,
///                                   linattn::EluPlusOne{}, out, ws);
/// \endcode
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param q_offsets B + 1 query row offsets: sequence b's queries are rows [q_offsets[b],
///     q_offsets[b+1]).
/// \param k_offsets B + 1 key row offsets: sequence b's keys are rows [k_offsets[b],
///     k_offsets[b+1]).
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class Phi, class DOut>
void batched_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                              const Eigen::MatrixBase<DV>& V, const std::vector<Index>& q_offsets,
                              const std::vector<Index>& k_offsets, Index heads, const Phi& phi,
                              const Eigen::MatrixBase<DOut>& out,
                              MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                              const ParallelOptions& par = {}) {
  const char* fn = "batched_linear_attention";
  detail::batched_linear(fn, Q, K, V, detail::offsets_of(fn, "q_offsets", q_offsets),
                         detail::offsets_of(fn, "k_offsets", k_offsets), heads, phi,
                         detail::NoMask{}, out, ws, HeadOptions{}, par);
}

/// \brief batched_linear_attention() with H value heads sharing Hk = layout.key_heads
/// query/key heads (GVA): Q is N x Hk·D, K L x Hk·D, and value head h reads query/key head
/// h / (H / Hk) in place, as multihead_linear_attention() with HeadOptions; equal to the call
/// on Q and K with each head repeated over its value heads, bit for bit.
/// \throws std::invalid_argument as the other form, or on a key_heads that does not divide
/// heads or does not fit Q (naming both head counts).
/// \code
/// linattn::HeadOptions layout;
/// layout.key_heads = 2;  // 8 value heads over 2 query/key heads
/// linattn::batched_linear_attention(Q, K, V, {0, 100, 128}, {0, 100, 128}, 8,
///                                   linattn::EluPlusOne{}, out, ws, layout);
/// \endcode
/// \param Q N x Hk·D queries: query/key head g reads columns [g·D, (g+1)·D).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param q_offsets B + 1 query row offsets: sequence b's queries are rows [q_offsets[b],
///     q_offsets[b+1]).
/// \param k_offsets B + 1 key row offsets: sequence b's keys are rows [k_offsets[b],
///     k_offsets[b+1]).
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param layout key_heads (0: as many as heads) and the optional key_dim / value_dim checks.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class Phi, class DOut>
void batched_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                              const Eigen::MatrixBase<DV>& V, const std::vector<Index>& q_offsets,
                              const std::vector<Index>& k_offsets, Index heads, const Phi& phi,
                              const Eigen::MatrixBase<DOut>& out,
                              MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                              const HeadOptions& layout, const ParallelOptions& par = {}) {
  const char* fn = "batched_linear_attention";
  detail::batched_linear(fn, Q, K, V, detail::offsets_of(fn, "q_offsets", q_offsets),
                         detail::offsets_of(fn, "k_offsets", k_offsets), heads, phi,
                         detail::NoMask{}, out, ws, layout, par);
}

/// \brief batched_linear_attention() with offsets of any integer type, read in place: an
/// Eigen vector (Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1>, a Map over a buffer,
/// offsets_view()) or a std::vector of any integer type. Allocation-free as the other form.
/// \throws std::invalid_argument as batched_linear_attention(), or if an offsets argument is
/// not a vector.
/// \code
/// Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1> cu(3);
/// cu << 0, 100, 128;
/// linattn::batched_linear_attention(Q, K, V, cu, cu, 8, linattn::EluPlusOne{}, out, ws);
/// \endcode
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param q_offsets B + 1 query row offsets: sequence b's queries are rows [q_offsets[b],
///     q_offsets[b+1]).
/// \param k_offsets B + 1 key row offsets: sequence b's keys are rows [k_offsets[b],
///     k_offsets[b+1]).
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class QOff, class KOff, class Phi, class DOut>
void batched_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                              const Eigen::MatrixBase<DV>& V, const QOff& q_offsets,
                              const KOff& k_offsets, Index heads, const Phi& phi,
                              const Eigen::MatrixBase<DOut>& out,
                              MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                              const ParallelOptions& par = {}) {
  const char* fn = "batched_linear_attention";
  detail::batched_linear(fn, Q, K, V, detail::offsets_of(fn, "q_offsets", q_offsets),
                         detail::offsets_of(fn, "k_offsets", k_offsets), heads, phi,
                         detail::NoMask{}, out, ws, HeadOptions{}, par);
}

/// \brief batched_linear_attention() with offsets of any integer type (read in place) and H
/// value heads sharing Hk = layout.key_heads query/key heads (see the form above).
/// \code
/// linattn::HeadOptions layout;
/// layout.key_heads = 2;
/// linattn::batched_linear_attention(Q, K, V, cu, cu, 8, linattn::EluPlusOne{}, out, ws, layout);
/// \endcode
/// \param Q N x Hk·D queries: query/key head g reads columns [g·D, (g+1)·D).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param q_offsets B + 1 query row offsets: sequence b's queries are rows [q_offsets[b],
///     q_offsets[b+1]).
/// \param k_offsets B + 1 key row offsets: sequence b's keys are rows [k_offsets[b],
///     k_offsets[b+1]).
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param layout key_heads (0: as many as heads) and the optional key_dim / value_dim checks.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class QOff, class KOff, class Phi, class DOut>
void batched_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                              const Eigen::MatrixBase<DV>& V, const QOff& q_offsets,
                              const KOff& k_offsets, Index heads, const Phi& phi,
                              const Eigen::MatrixBase<DOut>& out,
                              MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                              const HeadOptions& layout, const ParallelOptions& par = {}) {
  const char* fn = "batched_linear_attention";
  detail::batched_linear(fn, Q, K, V, detail::offsets_of(fn, "q_offsets", q_offsets),
                         detail::offsets_of(fn, "k_offsets", k_offsets), heads, phi,
                         detail::NoMask{}, out, ws, layout, par);
}

/// \brief batched_linear_attention() with a key padding mask: `key_mask` has one bool per
/// packed key row (K.rows() entries, true = the key takes part), shared by every head. Equal
/// to masked_linear_attention() per sequence and head.
/// \param out must not overlap Q, K, V or key_mask (std::invalid_argument).
/// \code
/// Eigen::Array<bool, Eigen::Dynamic, 1> keep = Eigen::Array<bool, Eigen::Dynamic, 1>::Ones(128);
/// keep.segment(90, 10).setConstant(false);  // padding at the end of the first sequence
/// linattn::masked_batched_linear_attention(Q, K, V, offsets, offsets, keep, 8,
///                                          linattn::EluPlusOne{}, out, ws);
/// \endcode
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param q_offsets B + 1 query row offsets: sequence b's queries are rows [q_offsets[b],
///     q_offsets[b+1]).
/// \param k_offsets B + 1 key row offsets: sequence b's keys are rows [k_offsets[b],
///     k_offsets[b+1]).
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class QOff, class KOff, class DMask, class Phi, class DOut>
void masked_batched_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                     const Eigen::MatrixBase<DV>& V, const QOff& q_offsets,
                                     const KOff& k_offsets, const Eigen::DenseBase<DMask>& key_mask,
                                     Index heads, const Phi& phi,
                                     const Eigen::MatrixBase<DOut>& out,
                                     MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                     const ParallelOptions& par = {}) {
  masked_batched_linear_attention(Q, K, V, q_offsets, k_offsets, key_mask, heads, phi, out, ws,
                                  HeadOptions{}, par);
}

/// \brief masked_batched_linear_attention() with H value heads sharing Hk = layout.key_heads
/// query/key heads (see batched_linear_attention() with HeadOptions).
/// \code
/// linattn::HeadOptions layout;
/// layout.key_heads = 2;
/// linattn::masked_batched_linear_attention(Q, K, V, offsets, offsets, keep, 8,
///                                          linattn::EluPlusOne{}, out, ws, layout);
/// \endcode
/// \param Q N x Hk·D queries: query/key head g reads columns [g·D, (g+1)·D).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param q_offsets B + 1 query row offsets: sequence b's queries are rows [q_offsets[b],
///     q_offsets[b+1]).
/// \param k_offsets B + 1 key row offsets: sequence b's keys are rows [k_offsets[b],
///     k_offsets[b+1]).
/// \param key_mask L entries (one per packed key row), true for a key that takes part.
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param layout key_heads (0: as many as heads) and the optional key_dim / value_dim checks.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class QOff, class KOff, class DMask, class Phi, class DOut>
void masked_batched_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                     const Eigen::MatrixBase<DV>& V, const QOff& q_offsets,
                                     const KOff& k_offsets, const Eigen::DenseBase<DMask>& key_mask,
                                     Index heads, const Phi& phi,
                                     const Eigen::MatrixBase<DOut>& out,
                                     MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                     const HeadOptions& layout, const ParallelOptions& par = {}) {
  const char* fn = "masked_batched_linear_attention";
  detail::check_key_mask(fn, key_mask, K.rows());
  detail::check_no_overlap(fn, out, "the key mask", key_mask);
  const detail::Nested<DMask> mask(key_mask.derived());
  const detail::KeyMask keep(mask);
  detail::batched_linear(fn, Q, K, V, detail::offsets_of(fn, "q_offsets", q_offsets),
                         detail::offsets_of(fn, "k_offsets", k_offsets), heads, phi, keep, out,
                         ws, layout, par);
}

/// \brief Causal linear attention over B packed sequences (rows [offsets[b], offsets[b+1]))
/// and H heads, each sequence starting from an empty state. See batched_linear_attention().
/// \param out must not overlap Q, K, V (checked once, before any head runs:
///            std::invalid_argument). A product operand is evaluated before any head runs
///            and may read `out`'s memory; any other expression operand must not.
/// \param Q N x Hk·D queries (Hk = options.key_heads, or H): value head h reads query/key
///     head h / (H / Hk), columns [g·D, (g+1)·D) for g = h / (H / Hk).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param offsets B + 1 row offsets of the packed sequences: sequence b is rows offsets[b] to
///     offsets[b+1] - 1.
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm, its chunk size (the defaults suit most shapes) and key_heads.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class Phi, class DOut>
void batched_causal_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                     const Eigen::MatrixBase<DV>& V,
                                     const std::vector<Index>& offsets, Index heads, const Phi& phi,
                                     const Eigen::MatrixBase<DOut>& out,
                                     MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                     const CausalOptions& options = {},
                                     const ParallelOptions& par = {}) {
  const char* fn = "batched_causal_linear_attention";
  detail::batched_causal_linear(fn, Q, K, V, detail::offsets_of(fn, "offsets", offsets), heads,
                                phi, detail::NoMask{}, nullptr, out, ws, options, par);
}

/// \brief batched_causal_linear_attention() with offsets of any integer type, read in place (an
/// Eigen vector or Map, offsets_view(), a std::vector of any integer type).
/// \code
/// Eigen::VectorXi cu_seqlens(3);
/// cu_seqlens << 0, 100, 128;
/// linattn::batched_causal_linear_attention(Q, K, V, cu_seqlens, 8, linattn::EluPlusOne{}, out, ws);
/// \endcode
/// \param Q N x Hk·D queries (Hk = options.key_heads, or H): value head h reads query/key
///     head h / (H / Hk), columns [g·D, (g+1)·D) for g = h / (H / Hk).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param offsets B + 1 row offsets of the packed sequences: sequence b is rows offsets[b] to
///     offsets[b+1] - 1.
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm, its chunk size (the defaults suit most shapes) and key_heads.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class Off, class Phi, class DOut>
void batched_causal_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                     const Eigen::MatrixBase<DV>& V, const Off& offsets,
                                     Index heads, const Phi& phi,
                                     const Eigen::MatrixBase<DOut>& out,
                                     MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                     const CausalOptions& options = {},
                                     const ParallelOptions& par = {}) {
  const char* fn = "batched_causal_linear_attention";
  detail::batched_causal_linear(fn, Q, K, V, detail::offsets_of(fn, "offsets", offsets), heads,
                                phi, detail::NoMask{}, nullptr, out, ws, options, par);
}

/// \brief Batched causal linear attention that carries every (sequence, head) state in and out:
/// the prefill of a server, whose states then go to BatchedRecurrentLinearAttention::set_states().
///
/// `states` holds B·H states, sequence-major (head h of sequence b at b·H + h); an empty entry
/// starts from zero, and an empty vector is first resized to B·H empty states (the only
/// allocation of a call that reuses its workspace and states). On return every entry is the
/// state after the sequence's last row, folded, exactly as causal_linear_attention() with that
/// state leaves it: bit for bit for the same CausalOptions and ParallelOptions (with fewer
/// (sequence, head) pairs than threads, each pair's rows are split over the threads as
/// causal_linear_attention() splits them; spec §8). Calling again continues every sequence.
/// \throws std::invalid_argument as the other form, or on a count other than B·H (or 0) or a
/// state that does not fit the map and shapes (naming the entry), before any state changes.
/// An exception in a task (a throwing feature map, std::bad_alloc) leaves the states partly
/// advanced.
/// \code
/// std::vector<linattn::LinearAttentionState<float>> states;  // B·H, filled by the call
/// linattn::batched_causal_linear_attention(Q, K, V, cu_seqlens, 8, linattn::EluPlusOne{},
///                                          states, out, ws);
/// linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float> decoder(B, 8, 64, 64);
/// decoder.set_states(states);  // decode from the end of every prompt
/// \endcode
/// \param Q N x Hk·D queries (Hk = options.key_heads, or H): value head h reads query/key
///     head h / (H / Hk), columns [g·D, (g+1)·D) for g = h / (H / Hk).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param offsets B + 1 row offsets of the packed sequences: sequence b is rows offsets[b] to
///     offsets[b+1] - 1.
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param states one state per head (per sequence and head when batched), continued from and
///     updated in place.
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm, its chunk size (the defaults suit most shapes) and key_heads.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class Off, class Phi, class DOut>
void batched_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Off& offsets, Index heads, const Phi& phi,
    std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>& states,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  const char* fn = "batched_causal_linear_attention";
  detail::batched_causal_linear(fn, Q, K, V, detail::offsets_of(fn, "offsets", offsets), heads,
                                phi, detail::NoMask{}, &states, out, ws, options, par);
}

/// \brief batched_causal_linear_attention() with a key padding mask: one bool per packed row
/// (Q.rows() entries, true = the key takes part), shared by every head. A masked row adds
/// nothing to its sequence's state but its query still reads the state, as in
/// masked_causal_linear_attention(), which each (sequence, head) equals.
/// \param out must not overlap Q, K, V or key_mask (std::invalid_argument).
/// \code
/// linattn::masked_batched_causal_linear_attention(Q, K, V, cu_seqlens, keep, 8,
///                                                 linattn::EluPlusOne{}, out, ws);
/// \endcode
/// \param Q N x Hk·D queries (Hk = options.key_heads, or H): value head h reads query/key
///     head h / (H / Hk), columns [g·D, (g+1)·D) for g = h / (H / Hk).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param offsets B + 1 row offsets of the packed sequences: sequence b is rows offsets[b] to
///     offsets[b+1] - 1.
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm, its chunk size (the defaults suit most shapes) and key_heads.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class Off, class DMask, class Phi, class DOut>
void masked_batched_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Off& offsets, const Eigen::DenseBase<DMask>& key_mask, Index heads, const Phi& phi,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  const char* fn = "masked_batched_causal_linear_attention";
  detail::check_key_mask(fn, key_mask, K.rows());
  detail::check_no_overlap(fn, out, "the key mask", key_mask);
  const detail::Nested<DMask> mask(key_mask.derived());
  const detail::KeyMask keep(mask);
  detail::batched_causal_linear(fn, Q, K, V, detail::offsets_of(fn, "offsets", offsets), heads,
                                phi, keep, nullptr, out, ws, options, par);
}

/// \brief masked_batched_causal_linear_attention() carrying the B·H states in and out (see the
/// states form of batched_causal_linear_attention()).
/// \code
/// std::vector<linattn::LinearAttentionState<float>> states;
/// linattn::masked_batched_causal_linear_attention(Q, K, V, cu_seqlens, keep, 8,
///                                                 linattn::EluPlusOne{}, states, out, ws);
/// \endcode
/// \param Q N x Hk·D queries (Hk = options.key_heads, or H): value head h reads query/key
///     head h / (H / Hk), columns [g·D, (g+1)·D) for g = h / (H / Hk).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param offsets B + 1 row offsets of the packed sequences: sequence b is rows offsets[b] to
///     offsets[b+1] - 1.
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param states one state per head (per sequence and head when batched), continued from and
///     updated in place.
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm, its chunk size (the defaults suit most shapes) and key_heads.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class Off, class DMask, class Phi, class DOut>
void masked_batched_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Off& offsets, const Eigen::DenseBase<DMask>& key_mask, Index heads, const Phi& phi,
    std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>& states,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  const char* fn = "masked_batched_causal_linear_attention";
  detail::check_key_mask(fn, key_mask, K.rows());
  detail::check_no_overlap(fn, out, "the key mask", key_mask);
  const detail::Nested<DMask> mask(key_mask.derived());
  const detail::KeyMask keep(mask);
  detail::batched_causal_linear(fn, Q, K, V, detail::offsets_of(fn, "offsets", offsets), heads,
                                phi, keep, &states, out, ws, options, par);
}

}  // namespace linattn
