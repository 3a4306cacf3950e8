/// \file linear/detail/multihead_kernels.hpp
/// \brief The multi-head and batched kernels (internal): (sequence, head) tasks on threads,
/// heads in groups over blocks of rows, on operands checked by multihead.hpp and viewed as
/// memory (detail/views.hpp).
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstddef>
#include <exception>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "causal_forward.hpp"
#include "../options.hpp"
#include "../../core/common.hpp"
#include "../../core/error.hpp"
#include "linear_forward.hpp"
#include "../heads.hpp"
#include "../multihead_workspace.hpp"
#include "../../core/parallel.hpp"
#include "../../core/state.hpp"
#include "../../core/workspace.hpp"
#include "../../core/detail/products.hpp"
#include "sequence_split.hpp"
#include "../../core/detail/views.hpp"
#include "../../maps/map_state.hpp"
#include "../../core/tuning.hpp"

namespace linattn::detail {

// The multi-head kernels walk a sequence once per group of heads, every head of the group on
// rows [r, r + kHeadInterleaveRows) before any moves on, rather than one head over the whole sequence after
// another. On the packed row-major N x (H·D) layout (PyTorch's contiguous [N, H, D]) one head's
// columns are a short run in every row, 256 bytes of each 2 KiB for 8 heads of 64 floats: a
// head alone reads memory with a stride that the hardware prefetchers do not follow, while the
// heads of a group read the same rows one after another (bench_multihead, row-major against
// column-major). Each head's own
// computation is unchanged (the same blocks of rows, the same products), so the outputs do
// not depend on the grouping or on the thread count.
// Groups per sequence: one thread runs all heads as one group; one sequence on several threads
// is split into one group per thread (every head costs the same); several sequences on several
// threads keep one task per (sequence, head), whose dynamic schedule balances sequences of
// different lengths (two sequences of 1000 and 100 rows on two threads would otherwise run
// 1000 rows on one thread and 100 on the other).
inline Index head_groups(Index sequences, Index heads, int threads) {
  if (threads <= 1) return 1;
  return sequences <= 1 ? std::min<Index>(heads, threads) : heads;
}

// Heads [first, first + count) of group g of `groups`.
struct HeadRange {
  Index first, count;
};
inline HeadRange head_range(Index g, Index groups, Index heads) {
  const Index first = g * heads / groups;
  return {first, (g + 1) * heads / groups - first};
}

// Whether the batched kernels run their (sequence, head) pairs one after the other, each split
// over all the threads (detail/sequence_split.hpp): when the pairs are fewer than the threads
// and the longest sequence is long enough to split (sequence_split_threads()).
template <class QOff, class KOff>
bool split_pairs(const QOff& q_offsets, const KOff& k_offsets, Index B, Index heads,
                 Index state_size, const ParallelOptions& par, bool causal) {
  if (B * heads >= resolve_threads(par)) return false;
  Index rows = 0;
  for (Index b = 0; b < B; ++b) {
    const std::size_t bs = static_cast<std::size_t>(b);
    const Index n = q_offsets[bs + 1] - q_offsets[bs], l = k_offsets[bs + 1] - k_offsets[bs];
    rows = std::max(rows, causal ? n : (n + l) / 2);
  }
  return sequence_split_threads(par, rows, state_size) > 1;
}

// The kernels of batched_linear() and batched_causal_linear() (multihead.hpp) on checked
// operands as views.
template <class VQ, class VK, class VV, class QOff, class KOff, class Phi, class Keep, class VOut>
void batched_linear_views(const char* fn, const VQ& q, const VK& k, const VV& v,
                          const QOff& q_offsets, const KOff& k_offsets, const HeadLayout& hl,
                          const Phi& phi, const Keep& keep, VOut& dst,
                          MultiHeadWorkspace<typename VQ::Scalar>& ws, const ParallelOptions& par) {
  using Scalar = typename VQ::Scalar;
  const Index heads = hl.heads, D = hl.D, M = hl.M;
  const Index B = static_cast<Index>(q_offsets.size()) - 1;
  const Index F = phi.feature_dim(D);
  if (split_pairs(q_offsets, k_offsets, B, heads, F * M, par, /*causal=*/false)) {
    // Fewer (sequence, head) pairs than threads: each pair in turn on all of them, its rows
    // split (spec §8), rather than threads left idle.
    ws.reserve_threads(1);
    Workspace<Scalar>& w = ws.for_thread(0);
    for (Index b = 0; b < B; ++b) {
      const std::size_t bs = static_cast<std::size_t>(b);
      const Index q0 = q_offsets[bs], n = q_offsets[bs + 1] - q0;
      const Index k0 = k_offsets[bs], l = k_offsets[bs + 1] - k0;
      for (Index h = 0; h < heads; ++h)
        linear_attention_split(fn, q.block(q0, hl.key_head(h) * D, n, D),
                               k.block(k0, hl.key_head(h) * D, l, D),
                               v.block(k0, h * M, l, M), phi, shifted_keep(keep, k0),
                               dst.block(q0, h * M, n, M), w, par);
    }
    return;
  }
  double work = 0;  // flops, for the threads that pay (threads_for())
  for (std::size_t bs = 0; bs < static_cast<std::size_t>(B); ++bs)
    work += double(heads) * linear_head_work(q_offsets[bs + 1] - q_offsets[bs],
                                             k_offsets[bs + 1] - k_offsets[bs], F, M);
  const int threads = threads_for(par, work);
  const Index G = head_groups(B, heads, threads);
  run_tasks<Scalar>(B * G, threads, ws, [&](Index t, int thread) {
    const Index b = t / G;
    const HeadRange hr = head_range(t % G, G, heads);
    const std::size_t bs = static_cast<std::size_t>(b);
    const Index q0 = q_offsets[bs], n = q_offsets[bs + 1] - q0;
    const Index k0 = k_offsets[bs], l = k_offsets[bs + 1] - k0;
    Workspace<Scalar>& w = ws.for_thread(thread);
    // The group's sums side by side in the slots a single-head call uses, head i's F x M S
    // column-major as linear_attention() lays out its own, and each head's arrays starting on
    // Eigen's alignment like that call's buffers (products may round by alignment): every head
    // runs the same products as a single-head call, bit for bit.
    constexpr Index A = std::max<Index>(1, EIGEN_MAX_ALIGN_BYTES / Index(sizeof(Scalar)));
    const auto padded = [](Index size) { return (size + A - 1) / A * A; };
    const Index per_feature = normalizes_keys_per_feature_v<Phi> ? F : 0;
    const Index sS = padded(F * M), sz = padded(F), sm = padded(per_feature);
    auto S_all = w.vector(kSlotState, hr.count * sS);
    auto S_lo_all = w.vector(kSlotStateLow, hr.count * sS);
    auto z_all = w.vector(kSlotNormalizer, hr.count * sz);
    auto z_lo_all = w.vector(kSlotNormalizerLow, hr.count * sz);
    auto m_all = w.vector(kSlotExtra, hr.count * sm);
    S_all.setZero();
    S_lo_all.setZero();
    z_all.setZero();
    z_lo_all.setZero();
    m_all.setConstant(-std::numeric_limits<Scalar>::infinity());
    using MatMap = Eigen::Map<Matrix<Scalar>>;
    using VecMap = Eigen::Map<Vector<Scalar>>;
    const auto S = [&](Index i) { return MatMap(S_all.data() + i * sS, F, M); };
    const auto z = [&](Index i) { return VecMap(z_all.data() + i * sz, F); };
    // An elementwise map of row-major memory maps a block of rows for every head of the group
    // in one pass: the group's columns of a row are contiguous, one head's alone are a run of
    // D entries every H·D, which the hardware prefetchers follow poorly (one head at a time,
    // 1024 rows per head, was 16% slower than column-major input at N = 16384, H = 8, D = 64).
    // Each head then runs the products of absorb_keys() and read_queries() on its rows of the
    // buffer: the same products on the same values, bit for bit.
    using KRows = decltype(k.block(0, 0, 1, 1));
    using QRows = decltype(q.block(0, 0, 1, 1));
    constexpr bool by_type = maps_token_major_v<Phi, KRows> && maps_token_major_v<Phi, QRows>;
    if (by_type || (erased_token_major<Phi, KRows>(phi) && erased_token_major<Phi, QRows>(phi))) {
      assert(F == D);  // an elementwise map
      // The group's query/key heads [kf, kf + kc), each mapped once however many of the
      // group's value heads share it.
      const Index kf = hl.key_head(hr.first);
      const Index kc = hr.count == 0 ? 0 : hl.key_head(hr.first + hr.count - 1) - kf + 1;
      for (Index j0 = 0; j0 < l; j0 += kLinearRowBlock) {
        const Index r = std::min(kLinearRowBlock, l - j0);
        auto pt = w.matrix(kSlotPhiK, kc * D, r);  // column j: token j's features, by key head
        phi.map(k.block(k0 + j0, kf * D, r, kc * D).transpose(), pt);
        if constexpr (!std::is_same_v<Keep, NoMask>)  // as absorb_keys() zeroes a masked row
          for (Index j = 0; j < r; ++j)
            if (!keep(k0 + j0 + j)) pt.col(j).setZero();
        for (Index i = 0; i < hr.count; ++i) {
          const Index h = hr.first + i;
          MatMap Si = S(i), S_lo(S_lo_all.data() + i * sS, F, M);
          VecMap zi = z(i), z_lo(z_lo_all.data() + i * sz, F);
          absorb_token_major(
              pt.data() + (hl.key_head(h) - kf) * D, pt.outerStride(), D, r,
              kept_value_rows(v.block(k0 + j0, h * M, r, M), k0 + j0, keep, w, kSlotProductB), S_lo,
              z_lo, w);
          fold_state(Si, S_lo, zi, z_lo);
        }
      }
      for (Index i0 = 0; i0 < n; i0 += kLinearRowBlock) {
        const Index r = std::min(kLinearRowBlock, n - i0);
        auto pt = w.matrix(kSlotPhiQ, hr.count * D, r);
        if (hl.group() == 1) {
          phi.map(q.block(q0 + i0, hr.first * D, r, hr.count * D).transpose(), pt);
        } else {
          // read_state() overwrites its query features: each value head gets its own copy of
          // its shared head's, mapped once into the keys' buffer (free by now).
          auto pk = w.matrix(kSlotPhiK, kc * D, r);
          phi.map(q.block(q0 + i0, kf * D, r, kc * D).transpose(), pk);
          for (Index i = 0; i < hr.count; ++i)
            pt.middleRows(i * D, D) = pk.middleRows((hl.key_head(hr.first + i) - kf) * D, D);
        }
        auto den = w.vector(kSlotRowA, r);
        for (Index i = 0; i < hr.count; ++i) {
          auto pq = pt.middleRows(i * D, D).transpose();
          read_state(phi, S(i), z(i), pq, den, dst.block(q0 + i0, (hr.first + i) * M, r, M), w);
        }
      }
      return;
    }
    for (Index j0 = 0; j0 < l; j0 += kHeadInterleaveRows) {
      const Index r = std::min(kHeadInterleaveRows, l - j0);
      for (Index i = 0; i < hr.count; ++i) {
        const Index h = hr.first + i;
        MatMap Si = S(i), S_lo(S_lo_all.data() + i * sS, F, M);
        VecMap zi = z(i), z_lo(z_lo_all.data() + i * sz, F), m(m_all.data() + i * sm, per_feature);
        absorb_keys(phi, k.block(k0 + j0, hl.key_head(h) * D, r, D), v.block(k0 + j0, h * M, r, M),
                    Si, S_lo,
                    zi, z_lo, m, shifted_keep(keep, k0 + j0), w);
      }
    }
    for (Index i0 = 0; i0 < n; i0 += kHeadInterleaveRows) {
      const Index r = std::min(kHeadInterleaveRows, n - i0);
      for (Index i = 0; i < hr.count; ++i) {
        const Index h = hr.first + i;
        read_queries(phi, q.block(q0 + i0, hl.key_head(h) * D, r, D), S(i), z(i),
                     dst.block(q0 + i0, h * M, r, M), w);
      }
    }
  }, executor_of(par));
}

template <class VQ, class VK, class VV, class Off, class Phi, class Keep, class VOut>
void batched_causal_views(
    const char* fn, const VQ& q, const VK& k, const VV& v, const Off& offsets,
    const HeadLayout& hl, const Phi& phi, const Keep& keep,
    std::vector<LinearAttentionState<compute_scalar_t<typename VQ::Scalar>>>* states, VOut& dst,
    MultiHeadWorkspace<compute_scalar_t<typename VQ::Scalar>>& ws, const CausalOptions& options,
    const ParallelOptions& par) {
  using Scalar = compute_scalar_t<typename VQ::Scalar>;
  const Index heads = hl.heads, D = hl.D, M = hl.M;
  const Index B = static_cast<Index>(offsets.size()) - 1;
  const Index F = phi.feature_dim(D);
  // Each head's rows go to the kernel in pieces that are whole multiples of its unit (128
  // tokens or one chunk): the pieces then continue one another bit for bit.
  const Index unit = causal_block_rows(options, F * M);
  const Index rows = unit * std::max<Index>(1, kHeadInterleaveRows / unit);
  if (split_pairs(offsets, offsets, B, heads, F * M, par, /*causal=*/true)) {
    // Fewer (sequence, head) pairs than threads: each pair in turn on all of them, its rows
    // split (spec §8), rather than threads left idle.
    ws.reserve_threads(1);
    Workspace<Scalar>& w = ws.for_thread(0);
    LinearAttentionState<Scalar>* own = states ? nullptr : ws.states_for_thread(0, 1);
    for (Index b = 0; b < B; ++b) {
      const Index r0 = offsets[static_cast<std::size_t>(b)];
      const Index n = offsets[static_cast<std::size_t>(b) + 1] - r0;
      for (Index h = 0; h < heads; ++h) {
        LinearAttentionState<Scalar>& st = states ? (*states)[static_cast<std::size_t>(b * heads + h)] : *own;
        if (!states) {
          if (st.S.rows() == F && st.S.cols() == M &&
              st.m.size() == (normalizes_keys_per_feature_v<Phi> ? F : 0))
            st.reset();
          else
            st = make_state<Scalar>(phi, D, M);
        }
        const Index c = hl.key_head(h) * D;
        causal_linear_attention_split(fn, q.block(r0, c, n, D), k.block(r0, c, n, D),
                                      v.block(r0, h * M, n, M), phi, shifted_keep(keep, r0), st,
                                      dst.block(r0, h * M, n, M), w, one_head(options), par);
      }
    }
    return;
  }
  double work = 0;  // flops, for the threads that pay (threads_for())
  for (std::size_t bs = 0; bs < static_cast<std::size_t>(B); ++bs)
    work += double(heads) * causal_head_work(offsets[bs + 1] - offsets[bs], F, M);
  const int threads = threads_for(par, work);
  const Index G = head_groups(B, heads, threads);
  run_tasks<Scalar>(B * G, threads, ws, [&](Index t, int thread) {
    const Index b = t / G;
    const HeadRange hr = head_range(t % G, G, heads);
    const Index r0 = offsets[static_cast<std::size_t>(b)];
    const Index n = offsets[static_cast<std::size_t>(b) + 1] - r0;
    Workspace<Scalar>& w = ws.for_thread(thread);
    // The caller's states, or an empty state per (sequence, head): the thread's own, sized on
    // its first task and reset after that, so that a reused workspace makes the call
    // allocation-free.
    LinearAttentionState<Scalar>* st = nullptr;
    if (states) {
      st = states->data() + b * heads + hr.first;
    } else {
      st = ws.states_for_thread(thread, hr.count);
      for (Index i = 0; i < hr.count; ++i) {
        LinearAttentionState<Scalar>& state = st[i];
        if (state.S.rows() == F && state.S.cols() == M &&
            state.m.size() == (normalizes_keys_per_feature_v<Phi> ? F : 0))
          state.reset();
        else
          state = make_state<Scalar>(phi, D, M);
      }
    }
    for (Index i0 = 0; i0 < n; i0 += rows) {
      const Index r = std::min(rows, n - i0);
      for (Index i = 0; i < hr.count; ++i) {
        const Index h = hr.first + i, c = hl.key_head(h) * D;
        if constexpr (is_low_precision_v<typename VQ::Scalar>) {
          // bf16 / half: the head's rows widened a piece at a time (causal_impl_widened).
          causal_impl_widened(fn, q, k, v, r0 + i0, r, c, h * M, D, M, phi, keep, st[i], dst, w,
                              options);
        } else {
          causal_linear_attention_impl(fn, q.block(r0 + i0, c, r, D),
                                       k.block(r0 + i0, c, r, D), v.block(r0 + i0, h * M, r, M),
                                       phi, shifted_keep(keep, r0 + i0), st[i],
                                       dst.block(r0 + i0, h * M, r, M), w, options);
        }
      }
    }
  }, executor_of(par));
}

// The batched kernels behind batched_*() and multihead_*(): `fn` names the public function in
// error messages; q_offsets and k_offsets (OffsetsRef) hold one more entry than
// the number of sequences, which must agree. keep(j) says whether packed key row j takes part.
template <class DQ, class DK, class DV, class QOff, class KOff, class Phi, class Keep, class DOut>
void batched_linear(const char* fn, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                    const Eigen::MatrixBase<DV>& V, const QOff& q_offsets, const KOff& k_offsets,
                    Index heads, const Phi& phi, const Keep& keep,
                    const Eigen::MatrixBase<DOut>& out,
                    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                    const HeadOptions& layout, const ParallelOptions& par) {
  static_check_feature_map<Phi, compute_scalar_t<typename DQ::Scalar>>();
  const HeadLayout hl = check_head_layout(fn, Q, K, V, heads, layout.key_heads, layout.key_dim,
                                          layout.value_dim, false);
  const Index D = hl.D;
  check_feature_map(fn, phi, D);  // before the parallel region, where nothing may throw
  check_output(fn, out, Q.rows(), V.cols());
  check_no_overlap(fn, out, "Q", Q, "K", K, "V", V);  // exact: every head's blocks pass too
  check_offsets(fn, "q_offsets", q_offsets, Q.rows());
  check_offsets(fn, "k_offsets", k_offsets, K.rows());
  if (q_offsets.size() != k_offsets.size())
    throw_invalid(fn, "q_offsets and k_offsets must describe the same number of sequences (" +
                          std::to_string(q_offsets.size()) + " and " +
                          std::to_string(k_offsets.size()) + " entries)");
  // Once, here: every task takes a block of each input, and a block of a lazy expression
  // (X * Wq) would evaluate the whole expression again for each (sequence, head). As views
  // (detail/views.hpp), the kernels below are compiled once per storage order.
  const auto map = erase_map<compute_scalar_t<typename DQ::Scalar>>(phi);
  with_views(
      Q.derived(), K.derived(), V.derived(), writable(out),
      [&](const auto& q, const auto& k, const auto& v, auto& dst) {
        batched_linear_views(fn, q, k, v, q_offsets, k_offsets, hl, map, keep, dst, ws, par);
      },
      &ws.storage_copies());
}

// `states` (nullptr: every sequence starts from an empty state of the workspace's) holds the
// B·H states of the caller, sequence-major, carried in and out.
template <class DQ, class DK, class DV, class Off, class Phi, class Keep, class DOut>
void batched_causal_linear(
    const char* fn, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Off& offsets, Index heads, const Phi& phi,
    const Keep& keep,
    std::vector<LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>>* states,
    const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws, const CausalOptions& options,
    const ParallelOptions& par) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  static_check_feature_map<Phi, compute_scalar_t<Scalar>>();
  const HeadLayout hl = check_head_layout(fn, Q, K, V, heads, options.key_heads, options.key_dim,
                                          options.value_dim, true);
  const Index D = hl.D, M = hl.M;
  check_feature_map(fn, phi, D);  // before the parallel region, where nothing may throw
  check_output(fn, out, Q.rows(), V.cols());
  check_no_overlap(fn, out, "Q", Q, "K", K, "V", V);  // exact: every head's blocks pass too
  check_offsets(fn, "offsets", offsets, Q.rows());
  if (options.chunk_size < 0)
    throw_invalid(fn, "chunk_size must be >= 0 (0 = default), got " +
                          std::to_string(options.chunk_size));
  const Index B = static_cast<Index>(offsets.size()) - 1;
  if (states) {
    const StateApart apart("out", out, "Q", Q, "K", K, "V", V);
    for (std::size_t i = 0; i < states->size(); ++i)
      apart.check(fn, (*states)[i], "states", Index(i));
    check_states(fn, *states, B, heads, phi, D, M);
  }
  // Viewed once, not per (sequence, head): see batched_linear.
  const auto map = erase_map<compute_scalar_t<Scalar>>(phi);
  if constexpr (is_low_precision_v<Storage>) {
    // The operands stay in bf16 / half here (in place, or a copy of an expression): the kernel
    // widens each head's rows a piece at a time (batched_causal_views).
    with_storage_views(Q.derived(), K.derived(), V.derived(), writable(out),
                       [&](const auto& q, const auto& k, const auto& v, auto& dst) {
                         batched_causal_views(fn, q, k, v, offsets, hl, map, keep, states, dst,
                                              ws, options, par);
                       });
  } else {
    with_views(Q.derived(), K.derived(), V.derived(), writable(out),
               [&](const auto& q, const auto& k, const auto& v, auto& dst) {
                 batched_causal_views(fn, q, k, v, offsets, hl, map, keep, states, dst, ws,
                                      options, par);
               });
  }
}

}  // namespace linattn::detail
