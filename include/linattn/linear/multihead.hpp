/// \file linear/multihead.hpp
/// \brief Multi-head linear attention over the packed layout that inference engines use
/// (N x H·D), heads in parallel with OpenMP when it is enabled: the argument checks here, the
/// kernels in detail/multihead_kernels.hpp. Also includes the batched (varlen) forms
/// (batched.hpp), MultiHeadWorkspace and MultiHeadRecurrentLinearAttention.
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
#include "batched.hpp"
#include "heads.hpp"
#include "../core/state.hpp"
#include "../core/workspace.hpp"
#include "../maps/map_state.hpp"

namespace linattn {
/// \brief Multi-head non-causal linear attention: Q N x (H·D), K L x (H·D), V L x (H·M),
/// out N x (H·M), heads side by side; allocation-free with a reused MultiHeadWorkspace.
/// \param out must not overlap Q, K, V (checked once, before any head runs:
///            std::invalid_argument). A product operand is evaluated before any head runs
///            and may read `out`'s memory; any other expression operand must not.
/// \code
/// linattn::MultiHeadWorkspace<float> ws;
/// Eigen::MatrixXf out(N, 8 * 64);
/// linattn::multihead_linear_attention(Q, K, V, 8, linattn::EluPlusOne{}, out, ws);
/// \endcode
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class Phi, class DOut>
void multihead_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                const Eigen::MatrixBase<DV>& V, Index heads, const Phi& phi,
                                const Eigen::MatrixBase<DOut>& out,
                                MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                const ParallelOptions& par = {}) {
  const Index q_offsets[2] = {0, Q.rows()}, k_offsets[2] = {0, K.rows()};
  detail::batched_linear("multihead_linear_attention", Q, K, V,
                         detail::OffsetsRef(q_offsets, 2),
                         detail::OffsetsRef(k_offsets, 2), heads, phi, detail::NoMask{},
                         out, ws, HeadOptions{}, par);
}

/// \brief multihead_linear_attention() with H value heads sharing Hk = layout.key_heads
/// query/key heads (GVA): Q is N x Hk·D, K L x Hk·D, and value head h reads query/key head
/// h / (H / Hk) in place (no copy per value head); each elementwise map's features of a
/// shared head are computed once per group of heads. Equal to the call on Q and K with each
/// head repeated over its value heads (`repeat_interleave`), bit for bit.
/// \throws std::invalid_argument as the other form, or when key_heads does not divide heads,
/// Q's columns are not a multiple of key_heads, or a stated key_dim / value_dim does not fit
/// (the message names both head counts).
/// \code
/// linattn::HeadOptions layout;
/// layout.key_heads = 2;  // Q, K: N x 2·64; V, out: N x 8·64
/// linattn::multihead_linear_attention(Q, K, V, 8, linattn::EluPlusOne{}, out, ws, layout);
/// \endcode
/// \param Q N x Hk·D queries: query/key head g reads columns [g·D, (g+1)·D).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param layout key_heads (0: as many as heads) and the optional key_dim / value_dim checks.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class Phi, class DOut>
void multihead_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                const Eigen::MatrixBase<DV>& V, Index heads, const Phi& phi,
                                const Eigen::MatrixBase<DOut>& out,
                                MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                const HeadOptions& layout, const ParallelOptions& par = {}) {
  const Index q_offsets[2] = {0, Q.rows()}, k_offsets[2] = {0, K.rows()};
  detail::batched_linear("multihead_linear_attention", Q, K, V,
                         detail::OffsetsRef(q_offsets, 2), detail::OffsetsRef(k_offsets, 2), heads,
                         phi, detail::NoMask{}, out, ws, layout, par);
}

/// \brief Multi-head non-causal linear attention, returning N x (H·M).
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x H·M output, head h in columns [h·M, (h+1)·M).
template <class DQ, class DK, class DV, class Phi = EluPlusOne>
Matrix<typename DQ::Scalar> multihead_linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                                       const Eigen::MatrixBase<DK>& K,
                                                       const Eigen::MatrixBase<DV>& V,
                                                       Index heads, const Phi& phi = Phi{},
                                                       const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  multihead_linear_attention(Q, K, V, heads, phi, out, ws, par);
  return out;
}

/// \brief Multi-head non-causal linear attention with shared query/key heads (see the
/// writing form taking HeadOptions), returning N x (H·M).
/// \param Q N x Hk·D queries: query/key head g reads columns [g·D, (g+1)·D).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param layout key_heads (0: as many as heads) and the optional key_dim / value_dim checks.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x H·M output, head h in columns [h·M, (h+1)·M).
template <class DQ, class DK, class DV, class Phi>
Matrix<typename DQ::Scalar> multihead_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    Index heads, const Phi& phi, const HeadOptions& layout, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  multihead_linear_attention(Q, K, V, heads, phi, out, ws, layout, par);
  return out;
}

/// \brief Multi-head non-causal linear attention with a key padding mask (L bools, true = the
/// key takes part, shared by every head): masked_linear_attention() per head.
/// \code
/// linattn::masked_multihead_linear_attention(Q, K, V, keep, 8, linattn::EluPlusOne{}, out, ws);
/// \endcode
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DMask, class Phi, class DOut>
void masked_multihead_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::DenseBase<DMask>& key_mask, Index heads, const Phi& phi,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const ParallelOptions& par = {}) {
  masked_multihead_linear_attention(Q, K, V, key_mask, heads, phi, out, ws, HeadOptions{}, par);
}

/// \brief masked_multihead_linear_attention() with H value heads sharing Hk =
/// layout.key_heads query/key heads (see multihead_linear_attention() with HeadOptions).
/// \code
/// linattn::HeadOptions layout;
/// layout.key_heads = 2;
/// linattn::masked_multihead_linear_attention(Q, K, V, keep, 8, linattn::EluPlusOne{}, out, ws,
///                                            layout);
/// \endcode
/// \param Q N x Hk·D queries: query/key head g reads columns [g·D, (g+1)·D).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param layout key_heads (0: as many as heads) and the optional key_dim / value_dim checks.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DMask, class Phi, class DOut>
void masked_multihead_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::DenseBase<DMask>& key_mask, Index heads, const Phi& phi,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws, const HeadOptions& layout,
    const ParallelOptions& par = {}) {
  const char* fn = "masked_multihead_linear_attention";
  detail::check_key_mask(fn, key_mask, K.rows());
  detail::check_no_overlap(fn, out, "the key mask", key_mask);
  const detail::Nested<DMask> mask(key_mask.derived());
  const detail::KeyMask keep(mask);
  const Index q_offsets[2] = {0, Q.rows()}, k_offsets[2] = {0, K.rows()};
  detail::batched_linear(fn, Q, K, V, detail::OffsetsRef(q_offsets, 2),
                         detail::OffsetsRef(k_offsets, 2), heads, phi, keep, out, ws, layout,
                         par);
}

/// \brief Masked multi-head non-causal linear attention, returning N x (H·M).
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x H·M output, head h in columns [h·M, (h+1)·M).
template <class DQ, class DK, class DV, class DMask, class Phi = EluPlusOne>
Matrix<typename DQ::Scalar> masked_multihead_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::DenseBase<DMask>& key_mask, Index heads,
    const Phi& phi = Phi{}, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  masked_multihead_linear_attention(Q, K, V, key_mask, heads, phi, out, ws, par);
  return out;
}

/// \brief Masked multi-head non-causal linear attention with shared query/key heads (see
/// multihead_linear_attention() with HeadOptions), returning N x (H·M).
/// \param Q N x Hk·D queries: query/key head g reads columns [g·D, (g+1)·D).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param layout key_heads (0: as many as heads) and the optional key_dim / value_dim checks.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x H·M output, head h in columns [h·M, (h+1)·M).
template <class DQ, class DK, class DV, class DMask, class Phi>
Matrix<typename DQ::Scalar> masked_multihead_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::DenseBase<DMask>& key_mask, Index heads,
    const Phi& phi, const HeadOptions& layout, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  masked_multihead_linear_attention(Q, K, V, key_mask, heads, phi, out, ws, layout, par);
  return out;
}

/// \brief Multi-head causal linear attention (each head from an empty state). With
/// CausalOptions::key_heads = Hk < H, Q and K hold Hk query/key heads (N x Hk·D), each shared
/// in place by H / Hk consecutive value heads (FLA's and transformers' order): equal to the
/// call on Q and K with every head repeated over its value heads, bit for bit.
/// \code
/// linattn::CausalOptions opts;
/// opts.key_heads = 2;  // 8 value heads over 2 query/key heads
/// linattn::multihead_causal_linear_attention(Q, K, V, 8, linattn::EluPlusOne{}, out, ws, opts);
/// \endcode
/// \param out must not overlap Q, K, V (checked once, before any head runs:
///            std::invalid_argument). A product operand is evaluated before any head runs
///            and may read `out`'s memory; any other expression operand must not.
/// \param Q N x Hk·D queries (Hk = options.key_heads, or H): value head h reads query/key
///     head h / (H / Hk), columns [g·D, (g+1)·D) for g = h / (H / Hk).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm, its chunk size (the defaults suit most shapes) and key_heads.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class Phi, class DOut>
void multihead_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    Index heads, const Phi& phi, const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  const Index offsets[2] = {0, Q.rows()};
  detail::batched_causal_linear("multihead_causal_linear_attention", Q, K, V,
                                detail::OffsetsRef(offsets, 2), heads, phi,
                                detail::NoMask{}, nullptr, out, ws, options, par);
}

/// \brief Multi-head causal linear attention carrying the H heads' states in and out: `states`
/// holds H states, one per value head also when key heads are shared (an empty entry starts
/// from zero; an empty vector is resized to H), and on return head h's final state, as causal_linear_attention() on head h's columns with
/// states[h] leaves it (bit for bit on one thread with the same CausalOptions). A prompt
/// prefilled in pieces equals the one-shot call; the states continue in a
/// MultiHeadRecurrentLinearAttention (head(h).set_state()) or a BatchedRecurrentLinearAttention.
/// \throws std::invalid_argument as the other form, or on a count other than H (or 0) or a
/// state that does not fit, before any state changes.
/// \code
/// std::vector<linattn::LinearAttentionState<float>> states;  // H, filled by the call
/// linattn::multihead_causal_linear_attention(Q, K, V, 8, linattn::EluPlusOne{}, states, out, ws);
/// \endcode
/// \param Q N x Hk·D queries (Hk = options.key_heads, or H): value head h reads query/key
///     head h / (H / Hk), columns [g·D, (g+1)·D) for g = h / (H / Hk).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param states one state per head (per sequence and head when batched), continued from and
///     updated in place.
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm, its chunk size (the defaults suit most shapes) and key_heads.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class Phi, class DOut>
void multihead_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    Index heads, const Phi& phi,
    std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>& states,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  const Index offsets[2] = {0, Q.rows()};
  detail::batched_causal_linear("multihead_causal_linear_attention", Q, K, V,
                                detail::OffsetsRef(offsets, 2), heads, phi,
                                detail::NoMask{}, &states, out, ws, options, par);
}

/// \brief Multi-head causal linear attention carrying the heads' states in and out (see above),
/// returning N x (H·M).
/// \param Q N x Hk·D queries (Hk = options.key_heads, or H): value head h reads query/key
///     head h / (H / Hk), columns [g·D, (g+1)·D) for g = h / (H / Hk).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param states one state per head (per sequence and head when batched), continued from and
///     updated in place.
/// \param options the algorithm, its chunk size (the defaults suit most shapes) and key_heads.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x H·M output, head h in columns [h·M, (h+1)·M).
template <class DQ, class DK, class DV, class Phi>
Matrix<typename DQ::Scalar> multihead_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    Index heads, const Phi& phi,
    std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>& states,
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  multihead_causal_linear_attention(Q, K, V, heads, phi, states, out, ws, options, par);
  return out;
}

/// \brief Multi-head causal linear attention, returning N x (H·M).
/// \code
/// Eigen::MatrixXf out = linattn::multihead_causal_linear_attention(Q, K, V, 8);
/// \endcode
/// \param Q N x Hk·D queries (Hk = options.key_heads, or H): value head h reads query/key
///     head h / (H / Hk), columns [g·D, (g+1)·D) for g = h / (H / Hk).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the algorithm, its chunk size (the defaults suit most shapes) and key_heads.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x H·M output, head h in columns [h·M, (h+1)·M).
template <class DQ, class DK, class DV, class Phi = EluPlusOne>
Matrix<typename DQ::Scalar> multihead_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, Index heads, const Phi& phi = Phi{},
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  multihead_causal_linear_attention(Q, K, V, heads, phi, out, ws, options, par);
  return out;
}

/// \brief Multi-head causal linear attention with a key padding mask (N bools, true = the key
/// takes part, shared by every head): masked_causal_linear_attention() per head.
/// \param out must not overlap Q, K, V or key_mask (std::invalid_argument).
/// \code
/// linattn::masked_multihead_causal_linear_attention(Q, K, V, keep, 8, linattn::EluPlusOne{},
///                                                   out, ws);
/// \endcode
/// \param Q N x Hk·D queries (Hk = options.key_heads, or H): value head h reads query/key
///     head h / (H / Hk), columns [g·D, (g+1)·D) for g = h / (H / Hk).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm, its chunk size (the defaults suit most shapes) and key_heads.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DMask, class Phi, class DOut>
void masked_multihead_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::DenseBase<DMask>& key_mask, Index heads, const Phi& phi,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  const char* fn = "masked_multihead_causal_linear_attention";
  detail::check_key_mask(fn, key_mask, K.rows());
  detail::check_no_overlap(fn, out, "the key mask", key_mask);
  const detail::Nested<DMask> mask(key_mask.derived());
  const detail::KeyMask keep(mask);
  const Index offsets[2] = {0, Q.rows()};
  detail::batched_causal_linear(fn, Q, K, V, detail::OffsetsRef(offsets, 2), heads, phi,
                                keep, nullptr, out, ws, options, par);
}

/// \brief masked_multihead_causal_linear_attention() carrying the H states in and out (see the
/// states form of multihead_causal_linear_attention()).
/// \code
/// std::vector<linattn::LinearAttentionState<float>> states;
/// linattn::masked_multihead_causal_linear_attention(Q, K, V, keep, 8, linattn::EluPlusOne{},
///                                                   states, out, ws);
/// \endcode
/// \param Q N x Hk·D queries (Hk = options.key_heads, or H): value head h reads query/key
///     head h / (H / Hk), columns [g·D, (g+1)·D) for g = h / (H / Hk).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param states one state per head (per sequence and head when batched), continued from and
///     updated in place.
/// \param out receives the N x H·M output, split into heads as V; must not overlap the inputs.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm, its chunk size (the defaults suit most shapes) and key_heads.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DMask, class Phi, class DOut>
void masked_multihead_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::DenseBase<DMask>& key_mask, Index heads, const Phi& phi,
    std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>& states,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  const char* fn = "masked_multihead_causal_linear_attention";
  detail::check_key_mask(fn, key_mask, K.rows());
  detail::check_no_overlap(fn, out, "the key mask", key_mask);
  const detail::Nested<DMask> mask(key_mask.derived());
  const detail::KeyMask keep(mask);
  const Index offsets[2] = {0, Q.rows()};
  detail::batched_causal_linear(fn, Q, K, V, detail::OffsetsRef(offsets, 2), heads, phi,
                                keep, &states, out, ws, options, par);
}

/// \brief Masked multi-head causal linear attention, returning N x (H·M).
/// \param Q N x Hk·D queries (Hk = options.key_heads, or H): value head h reads query/key
///     head h / (H / Hk), columns [g·D, (g+1)·D) for g = h / (H / Hk).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the algorithm, its chunk size (the defaults suit most shapes) and key_heads.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x H·M output, head h in columns [h·M, (h+1)·M).
template <class DQ, class DK, class DV, class DMask, class Phi = EluPlusOne>
Matrix<typename DQ::Scalar> masked_multihead_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::DenseBase<DMask>& key_mask, Index heads,
    const Phi& phi = Phi{}, const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  masked_multihead_causal_linear_attention(Q, K, V, key_mask, heads, phi, out, ws, options, par);
  return out;
}

}  // namespace linattn
