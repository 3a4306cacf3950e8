/// \file linear/detail/causal_forward.hpp
/// \brief The kernels of causal linear attention (internal): the chunked form, the fused
/// recurrence, the per-feature key softmax, bf16/half widening and the split over threads.
#pragma once

#include <Eigen/Core>
#include <cassert>
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include "../../core/detail/checks.hpp"
#include "../../core/common.hpp"
#include "../../core/detail/blocking.hpp"
#include "../../maps/erased_map.hpp"
#include "../../core/detail/result.hpp"
#include "../../core/detail/fast_exp.hpp"
#include "../../core/detail/products.hpp"
#include "../../core/detail/recurrent_block.hpp"
#include "sequence_split.hpp"
#include "../../core/detail/views.hpp"
#include "../../maps/elu_plus_one.hpp"
#include "../../maps/feature_map.hpp"
#include "../../core/parallel.hpp"
#include "../../core/state.hpp"
#include "../../core/workspace.hpp"
#include "../../maps/map_state.hpp"
#include "../options.hpp"

namespace linattn {

namespace detail {

// Below e^{-T} a prefix sum of the per-feature key softmax is too small to divide by safely in
// the chunked form; such a chunk is redone token by token (exact, only slower).
template <class Scalar>
constexpr Scalar per_feature_log_range() noexcept {
  return sizeof(Scalar) <= sizeof(float) ? Scalar(40) : Scalar(300);
}

// Rows [r0, r0 + b) of the RNN form for maps with per-feature key softmax (SoftmaxSplit),
// whose running maxima may rescale the state at any token: one token at a time. Queries are
// mapped a block at a time (vectorised); the block's queries, keys, values and outputs go
// through per-token buffers so that each token reads and writes contiguous memory.
template <class Phi, class DQ, class DK, class DV, class Scalar, class Keep, class Out>
void causal_rows_per_token(const Phi& phi, const DQ& Q, const DK& K, const DV& V, Index r0,
                           Index b, LinearAttentionState<Scalar>& st, const Keep& keep,
                           Out& dst, Workspace<Scalar>& ws) {
  using RowMajor = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Index F = st.S.rows(), M = st.S.cols();
  auto pq = ws.matrix(kSlotPhiQ, b, F);
  auto pqt = ws.matrix(kSlotExtra, F, b);  // token i's features as column i
  auto kt = ws.matrix(kSlotKeys, F, b);    // the raw keys, likewise
  auto pkv = ws.vector(kSlotNormalizer, F);
  auto w = ws.vector(kSlotRowA, F);
  auto den = ws.vector(kSlotRowB, 1);
  Eigen::Map<RowMajor> vb(ws.matrix(kSlotScores, b, M).data(), b, M);
  Eigen::Map<RowMajor> ob(ws.matrix(kSlotPrefix, b, M).data(), b, M);
  map_queries(phi, Q.middleRows(r0, b), pq, true);
  copy_to_row_major(pq, pqt.data());  // pqt (F x b, column-major) is pq's row-major copy
  copy_to_row_major(K.middleRows(r0, b), kt.data());
  copy_to_row_major(V.middleRows(r0, b), vb.data());
  for (Index i = 0; i < b; ++i) {
    if (!keep(r0 + i)) {  // a masked key adds nothing; the query still reads the state
      fold_state(st.S, st.S_lo, st.z, st.z_lo);  // read_state reads the high parts
      auto pqi = pq.middleRows(i, 1);
      read_state(phi, st.S, st.z, pqi, den, ob.row(i));
      continue;
    }
    recurrent_update_and_read(phi, st, pqt.col(i), pkv, w, kt.col(i), vb.row(i), ob.row(i));
  }
  fold_state(st.S, st.S_lo, st.z, st.z_lo);
  copy_from_row_major(ob.data(), b, M, dst.middleRows(r0, b));
}

// Row-major memory with unit inner stride: what recurrent_block reads values from and writes
// outputs to without a copy.
template <class X>
constexpr bool is_row_major_direct_v =
    (int(std::decay_t<X>::Flags) & Eigen::DirectAccessBit) && std::decay_t<X>::IsRowMajor;

// Rows [r0, r0 + b) of the RNN form for every other map: map the block's queries and keys
// token-major (map_token_major: an elementwise map of row-major inputs directly, else in the
// maps' column-major layout and then one packet transpose each), compute every token's denominator in one sweep (so that scaled queries give the
// outputs directly), then feed the tokens through S a few at a time (recurrent_block). Values
// and outputs are used in place when the caller's are row-major, else go through row-major
// buffers. Masked keys become zero φ(k) and zero copied values: they add nothing.
template <class Phi, class DQ, class DK, class DV, class Scalar, class Keep, class Out>
void causal_rows_recurrent(const Phi& phi, const DQ& Q, const DK& K, const DV& V, Index r0,
                           Index b, LinearAttentionState<Scalar>& st, const Keep& keep,
                           Out& dst, Workspace<Scalar>& ws) {
  if constexpr (normalizes_keys_per_feature_v<Phi>) {
    causal_rows_per_token(phi, Q, K, V, r0, b, st, keep, dst, ws);
  } else {
    const Index F = st.S.rows(), M = st.S.cols();
    auto pqt = ws.matrix(kSlotExtra, F, b);  // column i: token i's features
    auto pkt = ws.matrix(kSlotKeys, F, b);
    map_token_major(phi, Q.middleRows(r0, b), pqt, ws.matrix(kSlotPhiQ, b, F), QuerySide{true});
    map_token_major(phi, K.middleRows(r0, b), pkt, ws.matrix(kSlotPhiK, b, F), KeySide{true});
    bool masked = false;
    if constexpr (!std::is_same_v<Keep, NoMask>) {
      for (Index i = 0; i < b; ++i) {
        if (!keep(r0 + i)) {
          pkt.col(i).setZero();
          masked = true;
        }
      }
    }
    if (may_cancel(phi))
      prefix_normalize_tokens<true>(st.z.data(), st.z_lo.data(), F, pqt.data(), pkt.data(), F, b);
    else
      prefix_normalize_tokens<false>(st.z.data(), st.z_lo.data(), F, pqt.data(), pkt.data(), F, b);

    const auto vr = V.middleRows(r0, b);
    const Scalar* v = nullptr;
    Index ldv = M;
    // In place only when the rows are contiguous: a head's columns of a packed row-major
    // N x (H·M) buffer (rows 2 KiB apart for H·M = 512 floats) made the kernel 1.5x slower
    // than a contiguous copy (the rows share a few L1 sets), and the copy costs little.
    if constexpr (is_row_major_direct_v<decltype(vr)>) {
      if (vr.innerStride() == 1 && vr.outerStride() == M && !masked) {
        v = vr.data();
        ldv = vr.outerStride();
      }
    }
    if (v == nullptr) {
      Scalar* vb = ws.matrix(kSlotScores, b, M).data();
      copy_to_row_major(vr, vb);
      if (masked)  // selected to 0: 0 * inf in a masked row would poison the state
        for (Index i = 0; i < b; ++i)
          if (!keep(r0 + i)) std::fill(vb + i * M, vb + (i + 1) * M, Scalar(0));
      v = vb;
    }
    // The block's tokens go into the low parts of the state, folded into the high parts once
    // per block (one exact TwoSum per state entry every 128 tokens).
    auto orows = dst.middleRows(r0, b);
    bool direct = false;
    if constexpr (is_row_major_direct_v<decltype(orows)>) {
      if (orows.innerStride() == 1 && orows.outerStride() == M) {  // as for the values
        recurrent_block(st.S.data(), st.S_lo.data(), st.S.outerStride(), F, M, pqt.data(),
                        pkt.data(), F, 1, b, v, ldv, orows.data(), orows.outerStride());
        direct = true;
      }
    }
    if (!direct) {
      Scalar* ob = ws.matrix(kSlotPrefix, b, M).data();
      recurrent_block(st.S.data(), st.S_lo.data(), st.S.outerStride(), F, M, pqt.data(),
                      pkt.data(), F, 1, b, v, ldv, ob, M);
      copy_from_row_major(ob, b, M, orows);
    }
    fold_state(st.S, st.S_lo, st.z, st.z_lo);
  }
}

// One chunk of the generic chunked form (spec §3):
//   out_R = [φq S + tril(φq φkᵀ) V_R] / max(φq z + tril(φq φkᵀ) 1, ε),  S += φkᵀ V_R, z += φkᵀ 1.
// Every product runs on the micro-kernel (products.hpp) with φq column-major and φk token-major,
// the layouts it reads, and the values where they are (strided_rows).
template <class Phi, class DQ, class DK, class DV, class Scalar, class Keep, class Out>
void causal_chunk(const Phi& phi, const DQ& Q, const DK& K, const DV& V, Index r0, Index b,
                  LinearAttentionState<Scalar>& st, const Keep& keep, Out& dst,
                  Workspace<Scalar>& ws) {
  const Index F = st.S.rows();
  auto A = ws.matrix(kSlotScores, b, b);
  auto den = ws.vector(kSlotRowA, b);
  auto pq = ws.matrix(kSlotPhiQ, b, F);
  auto pkt = ws.matrix(kSlotKeys, F, b);  // column j: key j's features
  map_column_major(phi, Q.middleRows(r0, b), pq, ws.matrix(kSlotExtra, F, b), QuerySide{true});
  map_token_major(phi, K.middleRows(r0, b), pkt, ws.matrix(kSlotPhiK, b, F), KeySide{true});
  if constexpr (!std::is_same_v<Keep, NoMask>)
    for (Index j = 0; j < b; ++j)
      if (!keep(r0 + j)) pkt.col(j).setZero();
  // A = φq φkᵀ, whole; its strict upper triangle is set to 0 below.
  product<Scalar>(b, b, F, {pq.data(), 1, b}, {pkt.data(), 1, F}, A.data(), 1, b, false, ws,
                  kSlotProductA);
  // The chunk's own terms first, the carried z last: added one by one to a large z, each
  // term would be rounded against it (in float, lost entirely once z is 2^24 times larger).
  den.setZero();
  for (Index j = 0; j < b; ++j) den.tail(b - j) += A.col(j).tail(b - j);
  den.noalias() += pq * st.z;
  if (may_cancel(phi)) {
    // Is den_i rounding noise against |φq_i|·|z_i| (z_i: the prefix sum of φk up to row i),
    // the same test as the recurrent form's? z_i from prefix sums down the chunk: O(b·F).
    auto zi = ws.matrix(kSlotPrefix, b, F);
    auto scale = ws.vector(kSlotRowB, b);
    for (Index d = 0; d < F; ++d) {
      Scalar running = st.z(d);
      for (Index i = 0; i < b; ++i) zi(i, d) = std::abs(running += pkt(d, i));
    }
    scale = pq.cwiseAbs().cwiseProduct(zi).rowwise().sum();
    const Scalar t = cancellation_threshold<Scalar>(F);
    den = (den.array() > t * scale.array()).select(den, Scalar(0));
  }
  invert_guarded(den);
  // Scaling the rows of φq and A divides the output rows without touching the output
  // twice; A's strict upper triangle is never read (lower_product).
  pq.array().colwise() *= den.array();
  for (Index j = 0; j < b; ++j) A.col(j).tail(b - j).array() *= den.tail(b - j).array();
  const Strided<Scalar> vr = kept_value_rows(V.middleRows(r0, b), r0, keep, ws, kSlotProductB);
  write_chunk_rows(pq, A, st.S, vr, dst.middleRows(r0, b), ws, kSlotPrefix);
  // The chunk's sums go into the low parts, then one exact fold: the state keeps its
  // precision however long the sequence (see LinearAttentionState).
  absorb_token_major(pkt.data(), F, F, b, vr, st.S_lo, st.z_lo, ws);
  fold_state(st.S, st.S_lo, st.z, st.z_lo);
}

// One chunk of causal SoftmaxSplit. With c_d the running key maximum after the chunk,
// E = exp(K_R − c) and Z the prefix sums of E down the chunk (plus the carried z rescaled to
// c), the spec's out_i = Σ_d p_id (Σ_{j≤i} e^{k_jd} v_j) / (Σ_{j≤i} e^{k_jd}) becomes
//   out_R = (P ./ Z) S + tril((P ./ Z) Eᵀ) V_R,
// GEMMs again, with no denominator (it is exactly 1). Returns false, touching nothing, when
// some Z is below e^{-T} (a key maximum jumped by more than T inside the chunk): the caller
// then redoes the chunk token by token.
template <class Phi, class DQ, class DK, class DV, class Scalar, class Keep, class Out>
bool causal_chunk_per_feature(const Phi& phi, const DQ& Q, const DK& K, const DV& V, Index r0,
                              Index b, LinearAttentionState<Scalar>& st, const Keep& keep,
                              Out& dst, Workspace<Scalar>& ws) {
  const Index F = st.S.rows(), M = st.S.cols();
  auto E = ws.matrix(kSlotPhiK, b, F);
  auto Z = ws.matrix(kSlotPrefix, b, F);
  auto c = ws.vector(kSlotRowB, F);
  auto scale = ws.vector(kSlotRowA, F);
  auto chunk_sum = ws.vector(kSlotNormalizer, F);
  E = K.middleRows(r0, b);
  if constexpr (!std::is_same_v<Keep, NoMask>)
    for (Index j = 0; j < b; ++j)
      if (!keep(r0 + j)) E.row(j).setConstant(-std::numeric_limits<Scalar>::infinity());
  c = E.colwise().maxCoeff().transpose().cwiseMax(st.m);
  for (Index d = 0; d < F; ++d) {
    scale(d) = c(d) > st.m(d) ? std::exp(st.m(d) - c(d)) : Scalar(1);
    // A feature with no unmasked key yet has c = -inf; shift by 0 so that exp(-inf) = 0.
    if (c(d) == -std::numeric_limits<Scalar>::infinity()) c(d) = Scalar(0);
  }
  exp_shifted_cols(E, c);
  // Local prefix sums first, the carried z added once: z then gathers one rounding per chunk
  // instead of one per token, which matters for float at N = 2^20.
  for (Index d = 0; d < F; ++d) {
    const Scalar carried = st.z(d) * scale(d);
    Scalar running = 0;
    for (Index i = 0; i < b; ++i) {
      running += E(i, d);
      Z(i, d) = carried + running;
    }
    chunk_sum(d) = running;
  }
  // A non-finite key (NaN, or +inf, whose maximum makes every other exponent -inf) fails the
  // test too (NaN compares false): the token path keeps it from the chunk's earlier rows.
  if (!(Z.array() >= std::exp(-per_feature_log_range<Scalar>())).all()) return false;

  for (Index d = 0; d < F; ++d) {
    if (scale(d) != Scalar(1)) {
      st.S.row(d) *= scale(d);
      st.S_lo.row(d) *= scale(d);
    }
    // The chunk's sum goes into the low part of z (folded below with S), not the rounded
    // prefix sum Z: the sum of a long sequence then keeps its precision.
    st.z(d) *= scale(d);
    st.z_lo(d) = st.z_lo(d) * scale(d) + chunk_sum(d);
  }
  for (Index d = 0; d < F; ++d)
    if (Z(b - 1, d) > Scalar(0)) st.m(d) = c(d);  // features with no key keep m = -inf
  auto pq = ws.matrix(kSlotPhiQ, b, F);
  auto A = ws.matrix(kSlotScores, b, b);
  map_queries(phi, Q.middleRows(r0, b), pq, true);
  pq.array() /= Z.array();
  // As causal_chunk, on the micro-kernel; E (b x F) is column-major, read as φkᵀ by broadcast.
  product<Scalar>(b, b, F, {pq.data(), 1, b}, {E.data(), b, 1}, A.data(), 1, b, false, ws,
                  kSlotProductA);
  const Strided<Scalar> vr = kept_value_rows(V.middleRows(r0, b), r0, keep, ws, kSlotProductB);
  write_chunk_rows(pq, A, st.S, vr, dst.middleRows(r0, b), ws, kSlotExtra);
  const Strided<Scalar> s_lo = strided_of(st.S_lo);
  product<Scalar>(F, M, b, {E.data(), b, 1}, vr, st.S_lo.data(), s_lo.rs, s_lo.cs, true, ws,
                  kSlotProductA);
  fold_state(st.S, st.S_lo, st.z, st.z_lo);
  return true;
}

inline void check_chunk_size(const char* function, const CausalOptions& opts) {
  if (opts.chunk_size < 0)
    throw_invalid_parts(function, {"chunk_size must be >= 0 (0 = default), got ", opts.chunk_size});
}

// Whether the recurrent algorithm runs for these options and a state of F·M entries.
inline bool causal_runs_recurrent(const CausalOptions& opts, Index state_size) {
  return opts.algorithm == CausalAlgorithm::Recurrent ||
         (opts.algorithm == CausalAlgorithm::Auto && state_size <= kAutoRecurrentMaxState);
}

// The rows the causal kernel handles as one unit (and folds the state after): 128 tokens for
// the recurrent algorithm, one chunk for the chunked one. A sequence cut into calls at
// multiples of it gives the one-shot call's outputs and state bit for bit.
inline Index causal_block_rows(const CausalOptions& opts, Index state_size) {
  if (causal_runs_recurrent(opts, state_size)) return kLinearRowBlock;
  return opts.chunk_size > 0 ? opts.chunk_size : kDefaultChunk;
}

template <class DQ, class DK, class DV, class Phi, class Keep, class DOut>
void causal_linear_attention_impl(const char* function, const Eigen::MatrixBase<DQ>& Q,
                                  const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                                  const Phi& phi, const Keep& keep,
                                  LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>& st,
                                  const Eigen::MatrixBase<DOut>& out,
                                  Workspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                  const CausalOptions& opts) {
  // The callers checked the operands on their own types (causal_linear_attention_split(),
  // the multi-head entry points): checking them again here would only instantiate the checks
  // once more for the views.
  assert(Q.rows() == K.rows() && K.rows() == V.rows() && Q.cols() == K.cols() &&
         out.rows() == Q.rows() && out.cols() == V.cols());
  check_chunk_size(function, opts);
  prepare_state(function, st, phi, Q.cols(), V.cols());
  const bool recurrent = causal_runs_recurrent(opts, st.S.size());
  // A state from RecurrentLinearAttention may hold its latest tokens in the low parts; the
  // chunked form (and the per-token form's masked rows) reads the high parts only. The product
  // maps' recurrent blocks read both parts, so a small call pays no pass over the state here.
  if (!recurrent || normalizes_keys_per_feature_v<Phi>) fold_state(st.S, st.S_lo, st.z, st.z_lo);
  auto& dst = writable(out);
  const Nested<DQ> q(Q.derived());
  const Nested<DK> k(K.derived());
  const Nested<DV> v(V.derived());
  const Index N = q.rows();
  const Index F = st.S.rows(), M = st.S.cols();
  const Index C = causal_block_rows(opts, st.S.size());
  if (normalizes_keys_per_feature_v<Phi> && !recurrent) {
    // A chunk may fall back to the token path, whose buffers have other shapes: size every
    // slot for both now, so that repeated calls stay allocation-free whichever path runs.
    const Index c = std::min(C, N);
    for (int slot : {kSlotPhiQ, kSlotPhiK, kSlotExtra, kSlotKeys, kSlotPrefix, kSlotProductB})
      ws.reserve(slot, c * std::max(F, M));
    ws.reserve(kSlotProductA, c * std::max({c, F, M}));  // the products' copies (products.hpp)
    ws.reserve(kSlotScores, c * std::max(c, M));
    for (int slot : {kSlotNormalizer, kSlotRowA, kSlotRowB}) ws.reserve(slot, std::max(F, c));
  }
  for (Index r0 = 0; r0 < N; r0 += C) {
    const Index b = std::min(C, N - r0);
    if (recurrent) {
      causal_rows_recurrent(phi, q, k, v, r0, b, st, keep, dst, ws);
    } else if constexpr (normalizes_keys_per_feature_v<Phi>) {
      if (!causal_chunk_per_feature(phi, q, k, v, r0, b, st, keep, dst, ws))
        causal_rows_recurrent(phi, q, k, v, r0, b, st, keep, dst, ws);
    } else {
      causal_chunk(phi, q, k, v, r0, b, st, keep, dst, ws);
    }
  }
}

// Rows of a bf16 / half operand widened at a time: 256 rows of D = M = 64 are 64 KiB a float
// operand, the four of a piece a quarter of a 1 MiB L2.
inline constexpr Index kLowPrecisionPieceRows = 256;

// causal_linear_attention_impl() on rows [r0, r0 + n) of bf16 / half views, a head's columns
// (Q, K at column qc, V and the output at vc): the rows widened a piece at a time into the
// workspace's float buffers (cache-resident), the kernel on them, the output narrowed back.
// The pieces are whole multiples of the kernel's unit, which continue one another bit for bit,
// so the result is the kernel's on a float copy of the whole operands, rounded.
template <class VQ, class VK, class VV, class Phi, class Keep, class VOut, class Scalar>
void causal_impl_widened(const char* function, const VQ& q, const VK& k, const VV& v, Index r0,
                         Index n, Index qc, Index vc, Index D, Index M, const Phi& phi,
                         const Keep& keep, LinearAttentionState<Scalar>& st, VOut& dst,
                         Workspace<Scalar>& ws, const CausalOptions& opts) {
  const Index unit = causal_block_rows(opts, phi.feature_dim(D) * M);
  const Index sub = unit * std::max<Index>(1, kLowPrecisionPieceRows / unit);
  auto& copies = ws.storage_copies();
  for (Index j0 = 0; j0 < n; j0 += sub) {
    const Index p = std::min(sub, n - j0), row = r0 + j0;
    const auto qp = widen_block(q, row, qc, p, D, copies.reserve(0, p * D));
    const auto kp = widen_block(k, row, qc, p, D, copies.reserve(1, p * D));
    const auto vp = widen_block(v, row, vc, p, M, copies.reserve(2, p * M));
    MutableView<Scalar, bool(VOut::IsRowMajor)> op(copies.reserve(3, p * M), p, M,
                                                   Eigen::OuterStride<>(VOut::IsRowMajor ? M : p));
    causal_linear_attention_impl(function, qp.block(0, 0, p, D), kp.block(0, 0, p, D),
                                 vp.block(0, 0, p, M), phi, shifted_keep(keep, row), st,
                                 op.block(0, 0, p, M), ws, opts);
    auto to = dst.block(row, vc, p, M);
    narrow_result(to, op);
  }
}

// causal_linear_attention_impl() on T threads when the sequence is long enough (spec §8):
// the rows are cut into T segments (at multiples of the kernel's block, so that each segment
// runs the blocks a one-thread call from the same state would); each thread summarises its
// T-th of every segment but the last (parallel over all threads: no thread waits for the
// first segment to be summarised alone); after a barrier, thread t merges the initial state
// and the summaries before its segment in a fixed order and computes its segment from that
// state. Work: the one-thread call's plus a summary (2·F·M flops a row, GEMMs) of the first
// T - 1 segments. The state carried out is the last segment's.
template <class VQ, class VK, class VV, class Phi, class Keep, class VOut>
void causal_linear_attention_views(const char* function, const VQ& q, const VK& k, const VV& v,
                                   const Phi& phi, const Keep& keep,
                                   LinearAttentionState<typename VQ::Scalar>& st, VOut& dst,
                                   Workspace<typename VQ::Scalar>& ws, const CausalOptions& opts,
                                   int threads, const Executor* executor) {
  using Scalar = typename VQ::Scalar;
  const Index F = phi.feature_dim(q.cols()), M = v.cols(), N = q.rows();
  if (threads <= 1) {
    // The kernel on the whole as one row segment: the same instantiation as the segments below
    // and the multi-head kernels' heads (row_segment()).
    causal_linear_attention_impl(function, row_segment(q, 0, N), row_segment(k, 0, N),
                                 row_segment(v, 0, N), phi, shifted_keep(keep, 0), st,
                                 row_segment(dst, 0, N), ws, opts);
    return;
  }
  check_chunk_size(function, opts);
  prepare_state(function, st, phi, q.cols(), M);
  fold_state(st.S, st.S_lo, st.z, st.z_lo);
  const Index C = causal_block_rows(opts, F * M);
  auto& x = ws.template extension<SplitScratch<Scalar>>();
  x.prepare(threads, Index(threads - 1) * threads, F, M, normalizes_keys_per_feature_v<Phi>);
  const int team = run_two_phases(
      threads, executor,
      [&](int t, int T) {
        for (int j = 0; j + 1 < T; ++j) {
          const RowRange seg = split_rows(N, T, j, C);
          RowRange piece = split_rows(seg.size, T, t, kLinearRowBlock);
          piece.begin += seg.begin;
          summarize_rows(phi, k, v, keep, piece, x.parts[static_cast<std::size_t>(j * T + t)],
                         x.ws[static_cast<std::size_t>(t)]);
        }
      },
      [&](int t, int T) {
        auto& carried = x.carried[static_cast<std::size_t>(t)];
        scan_parts(&st, x, Index(t) * T, t, carried);
        const RowRange seg = split_rows(N, T, t, C);
        causal_linear_attention_impl(
            function, row_segment(q, seg.begin, seg.size), row_segment(k, seg.begin, seg.size),
            row_segment(v, seg.begin, seg.size), phi, shifted_keep(keep, seg.begin), carried,
            row_segment(dst, seg.begin, seg.size), x.ws[static_cast<std::size_t>(t)], opts);
      });
  std::swap(st, x.carried[static_cast<std::size_t>(team - 1)]);
}

// A single-head call's CausalOptions: key_heads 0 or 1, and the head sizes it states.
template <class DQ, class DV>
void check_single_head(const char* function, const Eigen::MatrixBase<DQ>& Q,
                       const Eigen::MatrixBase<DV>& V, const CausalOptions& opts) {
  check_head_dims(function, Q, V, 1, resolve_key_heads(function, 1, opts.key_heads), opts.key_dim,
                  opts.value_dim, "V");
}

// The options of one head of a multi-head call, whose head layout its caller checked.
inline CausalOptions one_head(CausalOptions opts) noexcept {
  opts.key_heads = opts.key_dim = opts.value_dim = 0;
  return opts;
}

// Checks the arguments, then runs causal_linear_attention_views() on the operands as views
// (detail/views.hpp): one instantiation of the kernels per map, mask, scalar type and storage
// orders, whatever Eigen types the caller passes.
template <class DQ, class DK, class DV, class Phi, class Keep, class DOut>
void causal_linear_attention_split(const char* function, const Eigen::MatrixBase<DQ>& Q,
                                   const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                                   const Phi& phi, const Keep& keep,
                                   LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>& st,
                                   const Eigen::MatrixBase<DOut>& out,
                                   Workspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                   const CausalOptions& opts, const ParallelOptions& par) {
  static_check_feature_map<Phi, compute_scalar_t<typename DQ::Scalar>>();
  check_qkv(function, Q, K, V, /*causal=*/true);
  check_single_head(function, Q, V, opts);
  check_feature_map(function, phi, Q.cols());
  const Index F = phi.feature_dim(Q.cols()), M = V.cols(), N = Q.rows();
  const int threads = sequence_split_threads(par, N, F * M);
  check_output(function, out, N, M);
  check_no_overlap(function, out, "Q", Q, "K", K, "V", V);
  StateApart("out", out, "Q", Q, "K", K, "V", V).check(function, st, "state");
  const auto map = erase_map<compute_scalar_t<typename DQ::Scalar>>(phi);
  if constexpr (is_low_precision_v<typename DQ::Scalar>) {
    if (threads <= 1) {
      // One thread: the operands stay in bf16 / half and are widened a piece at a time.
      with_storage_views(Q.derived(), K.derived(), V.derived(), writable(out),
                         [&](const auto& q, const auto& k, const auto& v, auto& dst) {
                           check_chunk_size(function, opts);
                           prepare_state(function, st, map, Q.cols(), M);
                           causal_impl_widened(function, q, k, v, 0, N, 0, 0, Q.cols(), M, map,
                                               keep, st, dst, ws, opts);
                         });
      return;
    }
  }
  with_views(
      Q.derived(), K.derived(), V.derived(), writable(out),
      [&](const auto& q, const auto& k, const auto& v, auto& dst) {
        causal_linear_attention_views(function, q, k, v, map, keep, st, dst, ws, opts, threads,
                                      executor_of(par));
      },
      &ws.storage_copies());
}

}  // namespace detail

}  // namespace linattn
