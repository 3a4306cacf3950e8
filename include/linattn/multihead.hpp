/// \file multihead.hpp
/// \brief Multi-head and variable-length batched entry points over the packed layout that
/// inference engines use, parallel over heads and sequences with OpenMP when it is enabled.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cassert>
#include <cstddef>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "causal_linear_attention.hpp"
#include "checks.hpp"
#include "common.hpp"
#include "detail/result.hpp"
#include "detail/sequence_split.hpp"
#include "detail/views.hpp"
#include "elu_plus_one.hpp"
#include "linear_attention.hpp"
#include "parallel.hpp"
#include "recurrent_linear_attention.hpp"
#include "softmax_attention.hpp"
#include "state.hpp"
#include "workspace.hpp"

namespace linattn {

/// \brief One Workspace (and one causal state) per thread for the multi-head kernels; reuse it
/// across calls to make them allocation-free. With more than one thread, OpenMP's dynamic
/// schedule decides which thread runs which head, so a thread that ran no task in earlier
/// calls sizes its buffers on its first one: the guarantee holds from the call on which every
/// thread has run a task of the largest shape (always, with one thread).
template <class Scalar>
class MultiHeadWorkspace {
 public:
  /// The workspace of thread `t`, creating workspaces up to it.
  Workspace<Scalar>& for_thread(int t) {
    if (static_cast<int>(per_thread_.size()) <= t) per_thread_.resize(static_cast<std::size_t>(t) + 1);
    return per_thread_[static_cast<std::size_t>(t)];
  }
  /// The `count` causal states that thread `t` carries through the heads it runs together
  /// (one per head), creating them as needed; the causal kernels size and reset them.
  LinearAttentionState<Scalar>* states_for_thread(int t, Index count) {
    if (static_cast<int>(states_.size()) <= t) states_.resize(static_cast<std::size_t>(t) + 1);
    auto& mine = states_[static_cast<std::size_t>(t)];
    if (static_cast<Index>(mine.size()) < count) mine.resize(static_cast<std::size_t>(count));
    return mine.data();
  }
  /// The first causal state of thread `t` (see states_for_thread()).
  LinearAttentionState<Scalar>& state_for_thread(int t) { return *states_for_thread(t, 1); }
  /// Makes sure `threads` workspaces and lists of states exist (allocating only the vectors of
  /// them), so that threads never grow the outer vectors concurrently.
  void reserve_threads(int threads) {
    if (threads <= 0) return;
    for_thread(threads - 1);
    if (static_cast<int>(states_.size()) < threads) states_.resize(static_cast<std::size_t>(threads));
  }
  /// Bytes held by all threads' buffers and states.
  std::size_t bytes() const noexcept {
    std::size_t total = 0;
    for (const auto& w : per_thread_) total += w.bytes();
    for (const auto& mine : states_)
      for (const auto& st : mine)
        total += static_cast<std::size_t>(st.S.size() + st.z.size() + st.m.size() +
                                          st.S_lo.size() + st.z_lo.size()) *
                 sizeof(Scalar);
    return total;
  }

 private:
  std::vector<Workspace<Scalar>> per_thread_;
  std::vector<std::vector<LinearAttentionState<Scalar>>> states_;
};

namespace detail {

// Runs fn(task, thread) for task in [0, tasks), in parallel when OpenMP is on; thread indexes
// the workspace and state of ws that the task may use. Every argument check happens before
// this point, but a task can still run out of memory (a workspace grows on a thread's first
// task): an exception escaping an OpenMP region calls std::terminate, so the first one is
// kept, the remaining tasks are skipped and it is rethrown after the region.
template <class Scalar, class Fn>
void parallel_tasks(Index tasks, const ParallelOptions& par, MultiHeadWorkspace<Scalar>& ws,
                    const Fn& fn) {
  const int threads = static_cast<int>(std::min<Index>(resolve_threads(par), std::max<Index>(tasks, 1)));
  ws.reserve_threads(threads);
  if (threads <= 1) {
    for (Index t = 0; t < tasks; ++t) fn(t, 0);
    return;
  }
#ifdef _OPENMP
  std::exception_ptr error;
  bool failed = false;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (Index t = 0; t < tasks; ++t) {
    bool skip;
#pragma omp atomic read
    skip = failed;
    if (skip) continue;
    try {
      fn(t, thread_id());
    } catch (...) {
#pragma omp critical(linattn_parallel_tasks_error)
      if (!error) error = std::current_exception();
#pragma omp atomic write
      failed = true;
    }
  }
  if (error) std::rethrow_exception(error);
#endif
}

// Q is N x (H·D), K is L x (H·D), V is L x (H·M); returns D and M. Callers copy them into plain
// variables: their lambdas capture them, and C++17 does not allow capturing a structured
// binding (clang rejects it, GCC accepts it).
template <class DQ, class DK, class DV>
std::pair<Index, Index> check_heads(const char* function, const Eigen::MatrixBase<DQ>& Q,
                                    const Eigen::MatrixBase<DK>& K,
                                    const Eigen::MatrixBase<DV>& V, Index heads, bool causal) {
  static_check_scalars<DQ, DK, DV>();
  const auto shapes = [&] {
    return " (Q is " + shape_of(Q) + ", K is " + shape_of(K) + ", V is " + shape_of(V) +
           ", heads = " + std::to_string(heads) + ")";
  };
  if (heads <= 0) throw_invalid(function, "heads must be positive" + shapes());
  if (Q.cols() % heads != 0 || V.cols() % heads != 0)
    throw_invalid(function, "the columns of Q and V must be multiples of heads" + shapes());
  check_qkv(function, Q, K, V, causal);
  return {Q.cols() / heads, V.cols() / heads};
}

// Sequence offsets (cu_seqlens) read in place, whatever their integer type and layout: a
// contiguous array (std::vector, a pointer) or an Eigen vector (Matrix, Map, a block of either).
// One type for all of them, so that the kernels are instantiated once rather than once per
// offsets type (each instantiation is seconds of compile time in every program that uses it);
// an indirect call per offset read is nothing next to a sequence's work.
class OffsetsRef {
 public:
  template <class Int>
  OffsetsRef(const Int* data, std::size_t count) noexcept
      : object_(data), count_(count), read_(&read_array<Int>) {}
  template <class D>
  explicit OffsetsRef(const Eigen::DenseBase<D>& v) noexcept
      : object_(&v.derived()), count_(static_cast<std::size_t>(v.size())), read_(&read_eigen<D>) {}
  Index operator[](std::size_t i) const { return read_(object_, static_cast<Index>(i)); }
  std::size_t size() const noexcept { return count_; }

 private:
  template <class Int>
  static Index read_array(const void* data, Index i) {
    return static_cast<Index>(static_cast<const Int*>(data)[i]);
  }
  template <class D>
  static Index read_eigen(const void* object, Index i) {
    const D& v = *static_cast<const D*>(object);
    return static_cast<Index>(v.rows() == 1 ? v.coeff(0, i) : v.coeff(i, 0));
  }
  const void* object_;
  std::size_t count_;
  Index (*read_)(const void*, Index);
};

template <class Int>
constexpr void static_check_offsets() {
  static_assert(std::is_integral_v<Int> && !std::is_same_v<Int, bool>,
                "linattn: offsets must be integers (std::vector, an Eigen vector or Map of any "
                "integer type)");
}
template <class Int, class Alloc>
OffsetsRef offsets_of(const char*, const char*, const std::vector<Int, Alloc>& v) {
  static_check_offsets<Int>();
  return OffsetsRef(v.data(), v.size());
}
template <class D>
OffsetsRef offsets_of(const char* function, const char* name, const Eigen::DenseBase<D>& v) {
  static_check_offsets<typename D::Scalar>();
  if (v.rows() != 1 && v.cols() != 1 && v.size() != 0)
    throw_invalid(function, std::string(name) + " is " + shape_of(v) + " but must be a vector");
  return OffsetsRef(v);
}

// Sequence b occupies rows [offsets[b], offsets[b+1]); the `count` offsets start at 0, never
// decrease and end at `rows`.
template <class Off>
void check_offsets(const char* function, const char* name, const Off& offsets, Index rows) {
  const std::size_t count = offsets.size();
  if (count == 0 || offsets[0] != 0 || offsets[count - 1] != rows)
    throw_invalid(function, std::string(name) + " must start at 0 and end at " +
                                std::to_string(rows) + " (the number of rows)" +
                                (count == 0 ? std::string(", got no entries")
                                            : ", got " + std::to_string(offsets[0]) + " ... " +
                                                  std::to_string(offsets[count - 1])));
  for (std::size_t b = 1; b < count; ++b)
    if (offsets[b] < offsets[b - 1])
      throw_invalid(function, std::string(name) + " must not decrease (entry " + std::to_string(b) +
                                  " is " + std::to_string(offsets[b]) + " after " +
                                  std::to_string(offsets[b - 1]) + ")");
}

// Rows of a sequence that every head of a group takes before the group moves on: measured
// best of 128 ... 2048 on row-major memory, and neutral on column-major.
inline constexpr Index kHeadInterleaveRows = 1024;

// The multi-head kernels walk a sequence once per group of heads, every head of the group on
// rows [r, r + 1024) before any moves on, rather than one head over the whole sequence after
// another. On the packed row-major N x (H·D) layout (PyTorch's contiguous [N, H, D]) one head's
// columns are a short run in every row, 256 bytes of each 2 KiB for 8 heads of 64 floats: a
// head alone reads memory with a stride that the hardware prefetchers do not follow, while the
// heads of a group read the same rows one after another. Measured (8 heads, D = M = 64,
// N = 16384, one thread, median): causal 77 -> 48 ms, non-causal 73 -> 51 ms, within about
// 10 % of column-major memory, which the grouping leaves as fast as it was. Each head's own
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

// The caller's states of a causal call: B·H (sequence-major), or none (then B·H empty ones are
// made: the one allocation of such a call). Every state must be empty (zero) or fit the map and
// shapes; empty ones are sized here, before any thread starts, so that no task throws.
template <class Scalar, class Phi>
void check_states(const char* fn, std::vector<LinearAttentionState<Scalar>>& states, Index B,
                  Index heads, const Phi& phi, Index D, Index M) {
  const std::size_t count = static_cast<std::size_t>(B * heads);
  if (states.empty()) states.resize(count);
  if (states.size() != count)
    throw_invalid(fn, "got " + std::to_string(states.size()) + " states but need " +
                          std::to_string(count) + " (" + std::to_string(B) + " sequence(s) x " +
                          std::to_string(heads) + " heads, sequence-major), or none");
  const Index F = phi.feature_dim(D);
  const Index per_feature = normalizes_keys_per_feature_v<Phi> ? F : 0;
  for (std::size_t i = 0; i < count; ++i) {
    const LinearAttentionState<Scalar>& st = states[i];
    if (st.empty()) continue;
    const bool lo_fits = (st.S_lo.size() == 0 || (st.S_lo.rows() == F && st.S_lo.cols() == M)) &&
                         (st.z_lo.size() == 0 || st.z_lo.size() == F);
    if (st.S.rows() != F || st.S.cols() != M || st.z.size() != F || st.m.size() != per_feature ||
        !lo_fits)
      throw_invalid(fn, "states[" + std::to_string(i) + "] (sequence " +
                            std::to_string(Index(i) / heads) + ", head " +
                            std::to_string(Index(i) % heads) + ": S is " + shape_of(st.S) +
                            ", z has " + std::to_string(st.z.size()) + " entries, m has " +
                            std::to_string(st.m.size()) + ") does not fit F = " +
                            std::to_string(F) + ", M = " + std::to_string(M) +
                            " for this feature map");
  }
  for (LinearAttentionState<Scalar>& st : states) prepare_state(fn, st, phi, D, M);
}

// The batched kernels behind batched_*() and multihead_*(): `fn` names the public function in
// error messages; q_offsets and k_offsets (OffsetsRef) hold one more entry than
// the number of sequences, which must agree. keep(j) says whether packed key row j takes part.
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

// The kernels of batched_linear() and batched_causal_linear() on checked operands as views.
template <class VQ, class VK, class VV, class QOff, class KOff, class Phi, class Keep, class VOut>
void batched_linear_views(const char* fn, const VQ& q, const VK& k, const VV& v,
                          const QOff& q_offsets, const KOff& k_offsets, Index heads,
                          const Phi& phi, const Keep& keep, VOut& dst,
                          MultiHeadWorkspace<typename VQ::Scalar>& ws, const ParallelOptions& par,
                          Index D, Index M);
template <class VQ, class VK, class VV, class Off, class Phi, class Keep, class VOut>
void batched_causal_views(const char* fn, const VQ& q, const VK& k, const VV& v,
                          const Off& offsets, Index heads, const Phi& phi, const Keep& keep,
                          std::vector<LinearAttentionState<typename VQ::Scalar>>* states,
                          VOut& dst, MultiHeadWorkspace<typename VQ::Scalar>& ws,
                          const CausalOptions& options, const ParallelOptions& par, Index D,
                          Index M);

template <class DQ, class DK, class DV, class QOff, class KOff, class Phi, class Keep, class DOut>
void batched_linear(const char* fn, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                    const Eigen::MatrixBase<DV>& V, const QOff& q_offsets, const KOff& k_offsets,
                    Index heads, const Phi& phi, const Keep& keep,
                    const Eigen::MatrixBase<DOut>& out, MultiHeadWorkspace<typename DQ::Scalar>& ws,
                    const ParallelOptions& par) {
  static_check_feature_map<Phi, typename DQ::Scalar>();
  const std::pair<Index, Index> dims = check_heads(fn, Q, K, V, heads, false);
  const Index D = dims.first, M = dims.second;
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
  const Viewed<DQ> qv(Q.derived());
  const Viewed<DK> kv(K.derived());
  const Viewed<DV> vv(V.derived());
  with_output_view(writable(out), [&](auto& dst) {
    batched_linear_views(fn, qv.view, kv.view, vv.view, q_offsets, k_offsets, heads, phi, keep,
                         dst, ws, par, D, M);
  });
}

template <class VQ, class VK, class VV, class QOff, class KOff, class Phi, class Keep, class VOut>
void batched_linear_views(const char* fn, const VQ& q, const VK& k, const VV& v,
                          const QOff& q_offsets, const KOff& k_offsets, Index heads,
                          const Phi& phi, const Keep& keep, VOut& dst,
                          MultiHeadWorkspace<typename VQ::Scalar>& ws, const ParallelOptions& par,
                          Index D, Index M) {
  using Scalar = typename VQ::Scalar;
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
        linear_attention_split(fn, q.block(q0, h * D, n, D), k.block(k0, h * D, l, D),
                               v.block(k0, h * M, l, M), phi, shifted_keep(keep, k0),
                               dst.block(q0, h * M, n, M), w, par);
    }
    return;
  }
  const Index G = head_groups(B, heads, resolve_threads(par));
  parallel_tasks<Scalar>(B * G, par, ws, [&](Index t, int thread) {
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
    if constexpr (maps_token_major_v<Phi, KRows> && maps_token_major_v<Phi, QRows>) {
      assert(F == D);  // an elementwise map
      for (Index j0 = 0; j0 < l; j0 += kLinearRowBlock) {
        const Index r = std::min(kLinearRowBlock, l - j0);
        auto pt = w.matrix(kSlotPhiK, hr.count * D, r);  // column j: token j's features, by head
        phi.map(k.block(k0 + j0, hr.first * D, r, hr.count * D).transpose(), pt);
        if constexpr (!std::is_same_v<Keep, NoMask>)  // as absorb_keys() zeroes a masked row
          for (Index j = 0; j < r; ++j)
            if (!keep(k0 + j0 + j)) pt.col(j).setZero();
        for (Index i = 0; i < hr.count; ++i) {
          const Index h = hr.first + i;
          MatMap Si = S(i), S_lo(S_lo_all.data() + i * sS, F, M);
          VecMap zi = z(i), z_lo(z_lo_all.data() + i * sz, F);
          absorb_token_major(pt.data() + i * D, pt.outerStride(), D, r,
                             strided_rows(v.block(k0 + j0, h * M, r, M), w, kSlotProductB), S_lo,
                             z_lo, w);
          fold_state(Si, S_lo, zi, z_lo);
        }
      }
      for (Index i0 = 0; i0 < n; i0 += kLinearRowBlock) {
        const Index r = std::min(kLinearRowBlock, n - i0);
        auto pt = w.matrix(kSlotPhiQ, hr.count * D, r);
        phi.map(q.block(q0 + i0, hr.first * D, r, hr.count * D).transpose(), pt);
        auto den = w.vector(kSlotRowA, r);
        for (Index i = 0; i < hr.count; ++i) {
          auto pq = pt.middleRows(i * D, D).transpose();
          read_state<Phi>(S(i), z(i), pq, den, dst.block(q0 + i0, (hr.first + i) * M, r, M), w);
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
        absorb_keys(phi, k.block(k0 + j0, h * D, r, D), v.block(k0 + j0, h * M, r, M), Si, S_lo,
                    zi, z_lo, m, shifted_keep(keep, k0 + j0), w);
      }
    }
    for (Index i0 = 0; i0 < n; i0 += kHeadInterleaveRows) {
      const Index r = std::min(kHeadInterleaveRows, n - i0);
      for (Index i = 0; i < hr.count; ++i) {
        const Index h = hr.first + i;
        read_queries(phi, q.block(q0 + i0, h * D, r, D), S(i), z(i),
                     dst.block(q0 + i0, h * M, r, M), w);
      }
    }
  });
}

// `states` (nullptr: every sequence starts from an empty state of the workspace's) holds the
// B·H states of the caller, sequence-major, carried in and out.
template <class DQ, class DK, class DV, class Off, class Phi, class Keep, class DOut>
void batched_causal_linear(const char* fn, const Eigen::MatrixBase<DQ>& Q,
                           const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                           const Off& offsets, Index heads, const Phi& phi, const Keep& keep,
                           std::vector<LinearAttentionState<typename DQ::Scalar>>* states,
                           const Eigen::MatrixBase<DOut>& out,
                           MultiHeadWorkspace<typename DQ::Scalar>& ws,
                           const CausalOptions& options, const ParallelOptions& par) {
  using Scalar = typename DQ::Scalar;
  static_check_feature_map<Phi, Scalar>();
  const std::pair<Index, Index> dims = check_heads(fn, Q, K, V, heads, true);
  const Index D = dims.first, M = dims.second;
  check_feature_map(fn, phi, D);  // before the parallel region, where nothing may throw
  check_output(fn, out, Q.rows(), V.cols());
  check_no_overlap(fn, out, "Q", Q, "K", K, "V", V);  // exact: every head's blocks pass too
  check_offsets(fn, "offsets", offsets, Q.rows());
  if (options.chunk_size < 0)
    throw_invalid(fn, "chunk_size must be >= 0 (0 = default), got " +
                          std::to_string(options.chunk_size));
  const Index B = static_cast<Index>(offsets.size()) - 1;
  if (states) check_states(fn, *states, B, heads, phi, D, M);
  const Viewed<DQ> qv(Q.derived());  // once, not per (sequence, head): see batched_linear
  const Viewed<DK> kv(K.derived());
  const Viewed<DV> vv(V.derived());
  with_output_view(writable(out), [&](auto& dst) {
    batched_causal_views(fn, qv.view, kv.view, vv.view, offsets, heads, phi, keep, states, dst,
                         ws, options, par, D, M);
  });
}

template <class VQ, class VK, class VV, class Off, class Phi, class Keep, class VOut>
void batched_causal_views(const char* fn, const VQ& q, const VK& k, const VV& v,
                          const Off& offsets, Index heads, const Phi& phi, const Keep& keep,
                          std::vector<LinearAttentionState<typename VQ::Scalar>>* states,
                          VOut& dst, MultiHeadWorkspace<typename VQ::Scalar>& ws,
                          const CausalOptions& options, const ParallelOptions& par, Index D,
                          Index M) {
  using Scalar = typename VQ::Scalar;
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
        causal_linear_attention_split(fn, q.block(r0, h * D, n, D), k.block(r0, h * D, n, D),
                                      v.block(r0, h * M, n, M), phi, shifted_keep(keep, r0), st,
                                      dst.block(r0, h * M, n, M), w, options, par);
      }
    }
    return;
  }
  const Index G = head_groups(B, heads, resolve_threads(par));
  parallel_tasks<Scalar>(B * G, par, ws, [&](Index t, int thread) {
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
        const Index h = hr.first + i;
        causal_linear_attention_impl(fn, q.block(r0 + i0, h * D, r, D),
                                     k.block(r0 + i0, h * D, r, D), v.block(r0 + i0, h * M, r, M),
                                     phi, shifted_keep(keep, r0 + i0), st[i],
                                     dst.block(r0 + i0, h * M, r, M), w, options);
      }
    }
  });
}

}  // namespace detail

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
template <class DQ, class DK, class DV, class Phi, class DOut>
void batched_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                              const Eigen::MatrixBase<DV>& V, const std::vector<Index>& q_offsets,
                              const std::vector<Index>& k_offsets, Index heads, const Phi& phi,
                              const Eigen::MatrixBase<DOut>& out,
                              MultiHeadWorkspace<typename DQ::Scalar>& ws,
                              const ParallelOptions& par = {}) {
  const char* fn = "batched_linear_attention";
  detail::batched_linear(fn, Q, K, V, detail::offsets_of(fn, "q_offsets", q_offsets),
                         detail::offsets_of(fn, "k_offsets", k_offsets), heads, phi,
                         detail::NoMask{}, out, ws, par);
}

/// \brief A zero-copy view of `count` offsets at `data`, of any integer type, for the batched
/// kernels (framework `cu_seqlens` are int32 buffers).
/// \code
/// const std::int32_t* cu_seqlens = ...;  // B + 1 entries
/// linattn::batched_causal_linear_attention(Q, K, V, linattn::offsets_view(cu_seqlens, B + 1),
///                                          8, linattn::EluPlusOne{}, out, ws);
/// \endcode
template <class Int>
Eigen::Map<const Eigen::Matrix<Int, Eigen::Dynamic, 1>> offsets_view(const Int* data,
                                                                     std::size_t count) {
  detail::static_check_offsets<Int>();
  return Eigen::Map<const Eigen::Matrix<Int, Eigen::Dynamic, 1>>(data, static_cast<Index>(count));
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
template <class DQ, class DK, class DV, class QOff, class KOff, class Phi, class DOut>
void batched_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                              const Eigen::MatrixBase<DV>& V, const QOff& q_offsets,
                              const KOff& k_offsets, Index heads, const Phi& phi,
                              const Eigen::MatrixBase<DOut>& out,
                              MultiHeadWorkspace<typename DQ::Scalar>& ws,
                              const ParallelOptions& par = {}) {
  const char* fn = "batched_linear_attention";
  detail::batched_linear(fn, Q, K, V, detail::offsets_of(fn, "q_offsets", q_offsets),
                         detail::offsets_of(fn, "k_offsets", k_offsets), heads, phi,
                         detail::NoMask{}, out, ws, par);
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
template <class DQ, class DK, class DV, class QOff, class KOff, class DMask, class Phi,
          class DOut>
void masked_batched_linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                     const Eigen::MatrixBase<DK>& K,
                                     const Eigen::MatrixBase<DV>& V, const QOff& q_offsets,
                                     const KOff& k_offsets,
                                     const Eigen::DenseBase<DMask>& key_mask, Index heads,
                                     const Phi& phi, const Eigen::MatrixBase<DOut>& out,
                                     MultiHeadWorkspace<typename DQ::Scalar>& ws,
                                     const ParallelOptions& par = {}) {
  const char* fn = "masked_batched_linear_attention";
  detail::check_key_mask(fn, key_mask, K.rows());
  detail::check_no_overlap(fn, out, "the key mask", key_mask);
  const detail::Nested<DMask> mask(key_mask.derived());
  const detail::KeyMask keep(mask);
  detail::batched_linear(fn, Q, K, V, detail::offsets_of(fn, "q_offsets", q_offsets),
                         detail::offsets_of(fn, "k_offsets", k_offsets), heads, phi, keep, out,
                         ws, par);
}

/// \brief Causal linear attention over B packed sequences (rows [offsets[b], offsets[b+1]))
/// and H heads, each sequence starting from an empty state. See batched_linear_attention().
/// \param out must not overlap Q, K, V (checked once, before any head runs:
///            std::invalid_argument). A product operand is evaluated before any head runs
///            and may read `out`'s memory; any other expression operand must not.
template <class DQ, class DK, class DV, class Phi, class DOut>
void batched_causal_linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                     const Eigen::MatrixBase<DK>& K,
                                     const Eigen::MatrixBase<DV>& V,
                                     const std::vector<Index>& offsets, Index heads,
                                     const Phi& phi, const Eigen::MatrixBase<DOut>& out,
                                     MultiHeadWorkspace<typename DQ::Scalar>& ws,
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
template <class DQ, class DK, class DV, class Off, class Phi, class DOut>
void batched_causal_linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                     const Eigen::MatrixBase<DK>& K,
                                     const Eigen::MatrixBase<DV>& V, const Off& offsets,
                                     Index heads, const Phi& phi,
                                     const Eigen::MatrixBase<DOut>& out,
                                     MultiHeadWorkspace<typename DQ::Scalar>& ws,
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
template <class DQ, class DK, class DV, class Off, class Phi, class DOut>
void batched_causal_linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                     const Eigen::MatrixBase<DK>& K,
                                     const Eigen::MatrixBase<DV>& V, const Off& offsets,
                                     Index heads, const Phi& phi,
                                     std::vector<LinearAttentionState<typename DQ::Scalar>>& states,
                                     const Eigen::MatrixBase<DOut>& out,
                                     MultiHeadWorkspace<typename DQ::Scalar>& ws,
                                     const CausalOptions& options = {},
                                     const ParallelOptions& par = {}) {
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
template <class DQ, class DK, class DV, class Off, class DMask, class Phi, class DOut>
void masked_batched_causal_linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                            const Eigen::MatrixBase<DK>& K,
                                            const Eigen::MatrixBase<DV>& V, const Off& offsets,
                                            const Eigen::DenseBase<DMask>& key_mask, Index heads,
                                            const Phi& phi, const Eigen::MatrixBase<DOut>& out,
                                            MultiHeadWorkspace<typename DQ::Scalar>& ws,
                                            const CausalOptions& options = {},
                                            const ParallelOptions& par = {}) {
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
template <class DQ, class DK, class DV, class Off, class DMask, class Phi, class DOut>
void masked_batched_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Off& offsets, const Eigen::DenseBase<DMask>& key_mask,
    Index heads, const Phi& phi, std::vector<LinearAttentionState<typename DQ::Scalar>>& states,
    const Eigen::MatrixBase<DOut>& out, MultiHeadWorkspace<typename DQ::Scalar>& ws,
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  const char* fn = "masked_batched_causal_linear_attention";
  detail::check_key_mask(fn, key_mask, K.rows());
  detail::check_no_overlap(fn, out, "the key mask", key_mask);
  const detail::Nested<DMask> mask(key_mask.derived());
  const detail::KeyMask keep(mask);
  detail::batched_causal_linear(fn, Q, K, V, detail::offsets_of(fn, "offsets", offsets), heads,
                                phi, keep, &states, out, ws, options, par);
}

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
template <class DQ, class DK, class DV, class Phi, class DOut>
void multihead_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                const Eigen::MatrixBase<DV>& V, Index heads, const Phi& phi,
                                const Eigen::MatrixBase<DOut>& out,
                                MultiHeadWorkspace<typename DQ::Scalar>& ws,
                                const ParallelOptions& par = {}) {
  const Index q_offsets[2] = {0, Q.rows()}, k_offsets[2] = {0, K.rows()};
  detail::batched_linear("multihead_linear_attention", Q, K, V,
                         detail::OffsetsRef(q_offsets, 2),
                         detail::OffsetsRef(k_offsets, 2), heads, phi, detail::NoMask{},
                         out, ws, par);
}

/// \brief Multi-head non-causal linear attention, returning N x (H·M).
template <class DQ, class DK, class DV, class Phi = EluPlusOne>
Matrix<typename DQ::Scalar> multihead_linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                                       const Eigen::MatrixBase<DK>& K,
                                                       const Eigen::MatrixBase<DV>& V,
                                                       Index heads, const Phi& phi = Phi{},
                                                       const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<typename DQ::Scalar> ws;
  multihead_linear_attention(Q, K, V, heads, phi, out, ws, par);
  return out;
}

/// \brief Multi-head non-causal linear attention with a key padding mask (L bools, true = the
/// key takes part, shared by every head): masked_linear_attention() per head.
/// \code
/// linattn::masked_multihead_linear_attention(Q, K, V, keep, 8, linattn::EluPlusOne{}, out, ws);
/// \endcode
template <class DQ, class DK, class DV, class DMask, class Phi, class DOut>
void masked_multihead_linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                       const Eigen::MatrixBase<DK>& K,
                                       const Eigen::MatrixBase<DV>& V,
                                       const Eigen::DenseBase<DMask>& key_mask, Index heads,
                                       const Phi& phi, const Eigen::MatrixBase<DOut>& out,
                                       MultiHeadWorkspace<typename DQ::Scalar>& ws,
                                       const ParallelOptions& par = {}) {
  const char* fn = "masked_multihead_linear_attention";
  detail::check_key_mask(fn, key_mask, K.rows());
  detail::check_no_overlap(fn, out, "the key mask", key_mask);
  const detail::Nested<DMask> mask(key_mask.derived());
  const detail::KeyMask keep(mask);
  const Index q_offsets[2] = {0, Q.rows()}, k_offsets[2] = {0, K.rows()};
  detail::batched_linear(fn, Q, K, V, detail::OffsetsRef(q_offsets, 2),
                         detail::OffsetsRef(k_offsets, 2), heads, phi, keep, out, ws,
                         par);
}

/// \brief Masked multi-head non-causal linear attention, returning N x (H·M).
template <class DQ, class DK, class DV, class DMask, class Phi = EluPlusOne>
Matrix<typename DQ::Scalar> masked_multihead_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::DenseBase<DMask>& key_mask, Index heads,
    const Phi& phi = Phi{}, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<typename DQ::Scalar> ws;
  masked_multihead_linear_attention(Q, K, V, key_mask, heads, phi, out, ws, par);
  return out;
}

/// \brief Multi-head causal linear attention (each head from an empty state).
/// \param out must not overlap Q, K, V (checked once, before any head runs:
///            std::invalid_argument). A product operand is evaluated before any head runs
///            and may read `out`'s memory; any other expression operand must not.
template <class DQ, class DK, class DV, class Phi, class DOut>
void multihead_causal_linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                       const Eigen::MatrixBase<DK>& K,
                                       const Eigen::MatrixBase<DV>& V, Index heads,
                                       const Phi& phi, const Eigen::MatrixBase<DOut>& out,
                                       MultiHeadWorkspace<typename DQ::Scalar>& ws,
                                       const CausalOptions& options = {},
                                       const ParallelOptions& par = {}) {
  const Index offsets[2] = {0, Q.rows()};
  detail::batched_causal_linear("multihead_causal_linear_attention", Q, K, V,
                                detail::OffsetsRef(offsets, 2), heads, phi,
                                detail::NoMask{}, nullptr, out, ws, options, par);
}

/// \brief Multi-head causal linear attention carrying the H heads' states in and out: `states`
/// holds H states (an empty entry starts from zero; an empty vector is resized to H), and on
/// return head h's final state, as causal_linear_attention() on head h's columns with
/// states[h] leaves it (bit for bit on one thread with the same CausalOptions). A prompt
/// prefilled in pieces equals the one-shot call; the states continue in a
/// MultiHeadRecurrentLinearAttention (head(h).set_state()) or a BatchedRecurrentLinearAttention.
/// \throws std::invalid_argument as the other form, or on a count other than H (or 0) or a
/// state that does not fit, before any state changes.
/// \code
/// std::vector<linattn::LinearAttentionState<float>> states;  // H, filled by the call
/// linattn::multihead_causal_linear_attention(Q, K, V, 8, linattn::EluPlusOne{}, states, out, ws);
/// \endcode
template <class DQ, class DK, class DV, class Phi, class DOut>
void multihead_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, Index heads, const Phi& phi,
    std::vector<LinearAttentionState<typename DQ::Scalar>>& states,
    const Eigen::MatrixBase<DOut>& out, MultiHeadWorkspace<typename DQ::Scalar>& ws,
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  const Index offsets[2] = {0, Q.rows()};
  detail::batched_causal_linear("multihead_causal_linear_attention", Q, K, V,
                                detail::OffsetsRef(offsets, 2), heads, phi,
                                detail::NoMask{}, &states, out, ws, options, par);
}

/// \brief Multi-head causal linear attention carrying the heads' states in and out (see above),
/// returning N x (H·M).
template <class DQ, class DK, class DV, class Phi>
Matrix<typename DQ::Scalar> multihead_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, Index heads, const Phi& phi,
    std::vector<LinearAttentionState<typename DQ::Scalar>>& states,
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<typename DQ::Scalar> ws;
  multihead_causal_linear_attention(Q, K, V, heads, phi, states, out, ws, options, par);
  return out;
}

/// \brief Multi-head causal linear attention, returning N x (H·M).
/// \code
/// Eigen::MatrixXf out = linattn::multihead_causal_linear_attention(Q, K, V, 8);
/// \endcode
template <class DQ, class DK, class DV, class Phi = EluPlusOne>
Matrix<typename DQ::Scalar> multihead_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, Index heads, const Phi& phi = Phi{},
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<typename DQ::Scalar> ws;
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
template <class DQ, class DK, class DV, class DMask, class Phi, class DOut>
void masked_multihead_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::DenseBase<DMask>& key_mask, Index heads,
    const Phi& phi, const Eigen::MatrixBase<DOut>& out, MultiHeadWorkspace<typename DQ::Scalar>& ws,
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
template <class DQ, class DK, class DV, class DMask, class Phi, class DOut>
void masked_multihead_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::DenseBase<DMask>& key_mask, Index heads,
    const Phi& phi, std::vector<LinearAttentionState<typename DQ::Scalar>>& states,
    const Eigen::MatrixBase<DOut>& out, MultiHeadWorkspace<typename DQ::Scalar>& ws,
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
template <class DQ, class DK, class DV, class DMask, class Phi = EluPlusOne>
Matrix<typename DQ::Scalar> masked_multihead_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::DenseBase<DMask>& key_mask, Index heads,
    const Phi& phi = Phi{}, const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<typename DQ::Scalar> ws;
  masked_multihead_causal_linear_attention(Q, K, V, key_mask, heads, phi, out, ws, options, par);
  return out;
}

namespace detail {

template <class DQ, class DK, class DV, class DOut>
void multihead_softmax(const char* fn, const Eigen::MatrixBase<DQ>& Q,
                       const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                       Index heads, const Eigen::MatrixBase<DOut>& out,
                       MultiHeadWorkspace<typename DQ::Scalar>& ws, SoftmaxAlgorithm algorithm,
                       bool causal, const ParallelOptions& par) {
  const std::pair<Index, Index> dims = check_heads(fn, Q, K, V, heads, causal);
  const Index D = dims.first, M = dims.second;
  check_output(fn, out, Q.rows(), V.cols());
  check_no_overlap(fn, out, "Q", Q, "K", K, "V", V);  // exact: every head's blocks pass too
  const Viewed<DQ> q(Q.derived());  // once, not per head: see batched_linear
  const Viewed<DK> k(K.derived());
  const Viewed<DV> v(V.derived());
  const Index N = Q.rows(), L = K.rows();
  with_output_view(writable(out), [&](auto& dst) {
    parallel_tasks<typename DQ::Scalar>(heads, par, ws, [&](Index h, int thread) {
      auto dh = sub_view(dst, 0, h * M, N, M);
      softmax_views(sub_view(q.view, 0, h * D, N, D), sub_view(k.view, 0, h * D, L, D),
                    sub_view(v.view, 0, h * M, L, M), dh, algorithm, causal,
                    ws.for_thread(thread));
    });
  });
}

}  // namespace detail

/// \brief Multi-head softmax attention over the packed layout (heads in parallel).
/// \param out must not overlap Q, K, V (checked once, before any head runs:
///            std::invalid_argument). A product operand is evaluated before any head runs
///            and may read `out`'s memory; any other expression operand must not.
template <class DQ, class DK, class DV, class DOut>
void multihead_softmax_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                 const Eigen::MatrixBase<DV>& V, Index heads,
                                 const Eigen::MatrixBase<DOut>& out,
                                 MultiHeadWorkspace<typename DQ::Scalar>& ws,
                                 SoftmaxAlgorithm algorithm = SoftmaxAlgorithm::Tiled,
                                 const ParallelOptions& par = {}) {
  detail::multihead_softmax("multihead_softmax_attention", Q, K, V, heads, out, ws, algorithm,
                            false, par);
}

/// \brief Multi-head softmax attention, returning N x (H·M).
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> multihead_softmax_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, Index heads,
    SoftmaxAlgorithm algorithm = SoftmaxAlgorithm::Tiled, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<typename DQ::Scalar> ws;
  multihead_softmax_attention(Q, K, V, heads, out, ws, algorithm, par);
  return out;
}

/// \brief Multi-head causal softmax attention over the packed layout.
/// \param out must not overlap Q, K, V (checked once, before any head runs:
///            std::invalid_argument). A product operand is evaluated before any head runs
///            and may read `out`'s memory; any other expression operand must not.
template <class DQ, class DK, class DV, class DOut>
void multihead_causal_softmax_attention(const Eigen::MatrixBase<DQ>& Q,
                                        const Eigen::MatrixBase<DK>& K,
                                        const Eigen::MatrixBase<DV>& V, Index heads,
                                        const Eigen::MatrixBase<DOut>& out,
                                        MultiHeadWorkspace<typename DQ::Scalar>& ws,
                                        SoftmaxAlgorithm algorithm = SoftmaxAlgorithm::Tiled,
                                        const ParallelOptions& par = {}) {
  detail::multihead_softmax("multihead_causal_softmax_attention", Q, K, V, heads, out, ws,
                            algorithm, true, par);
}

/// \brief Multi-head causal softmax attention, returning N x (H·M).
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> multihead_causal_softmax_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, Index heads,
    SoftmaxAlgorithm algorithm = SoftmaxAlgorithm::Tiled, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<typename DQ::Scalar> ws;
  multihead_causal_softmax_attention(Q, K, V, heads, out, ws, algorithm, par);
  return out;
}

/// \brief H independent recurrent heads over the packed layout: a token is q, k of H·D
/// entries and v of H·M entries; step() writes H·M outputs and allocates nothing.
/// \code
/// linattn::MultiHeadRecurrentLinearAttention<linattn::EluPlusOne, float> rnn(8, 64, 64);
/// Eigen::VectorXf out(8 * 64);
/// rnn.step(q, k, v, out);
/// \endcode
template <class FeatureMap = EluPlusOne, class Scalar = float>
class MultiHeadRecurrentLinearAttention {
 public:
  using Head = RecurrentLinearAttention<FeatureMap, Scalar>;

  MultiHeadRecurrentLinearAttention(Index heads, Index key_dim, Index value_dim,
                                    const FeatureMap& phi = FeatureMap{}) {
    if (heads <= 0)
      detail::throw_invalid("MultiHeadRecurrentLinearAttention",
                            "heads must be positive, got " + std::to_string(heads));
    heads_.reserve(static_cast<std::size_t>(heads));
    for (Index h = 0; h < heads; ++h) heads_.emplace_back(key_dim, value_dim, phi);
    aliased_out_.resize(heads * value_dim);
  }

  /// Consumes one token of every head; no allocation (for inputs that need no temporary: a
  /// costly expression such as W * x is evaluated once, before any head moves).
  /// \param out H·M entries; it may share memory with q, k or v (the inputs are read as they
  ///        were on entry), but an input that is an expression reading `out`'s memory
  ///        (`2 * out`) must be evaluated first.
  /// \throws std::invalid_argument on wrong sizes, with no head moved. Only a feature map
  /// that throws can stop the step part-way (the heads before it have then moved).
  template <class DQ, class DK, class DV, class DOut>
  void step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
            const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DOut>& out) {
    const char* fn = "MultiHeadRecurrentLinearAttention::step";
    const Index H = heads(), D = key_dim(), M = value_dim();
    detail::check_token(fn, "q", q, H * D);
    detail::check_token(fn, "k", k, H * D);
    detail::check_token(fn, "v", v, H * M);
    detail::check_token(fn, "out", out, H * M);
    // Evaluated once before any head moves: a segment of a lazy expression (W * x) would
    // evaluate all of it again for every head, and an allocation failing there would leave
    // the first heads one token ahead of the others.
    const detail::Nested<DQ> qe(q.derived());
    const detail::Nested<DK> ke(k.derived());
    const detail::Nested<DV> ve(v.derived());
    // Head h's output may cover inputs of later heads (when M > D): then go through a buffer.
    if (detail::memory_overlaps(out, q) || detail::memory_overlaps(out, k) ||
        detail::memory_overlaps(out, v)) {
      step_heads(qe, ke, ve, aliased_out_);
      detail::writable(out).reshaped() = aliased_out_;
    } else {
      step_heads(qe, ke, ve, detail::writable(out).reshaped());
    }
  }

  /// Consumes one token of every head and returns the H·M outputs.
  template <class DQ, class DK, class DV>
  Vector<Scalar> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                      const Eigen::MatrixBase<DV>& v) {
    Vector<Scalar> out(heads() * value_dim());
    step(q, k, v, out);
    return out;
  }

  void reset() {
    for (auto& h : heads_) h.reset();
  }
  Index heads() const noexcept { return static_cast<Index>(heads_.size()); }
  Index key_dim() const noexcept { return heads_.front().key_dim(); }
  Index value_dim() const noexcept { return heads_.front().value_dim(); }
  /// Head h (its state, set_state() to continue from a parallel prefill).
  Head& head(Index h) { return heads_.at(static_cast<std::size_t>(h)); }
  const Head& head(Index h) const { return heads_.at(static_cast<std::size_t>(h)); }

 private:
  template <class DQ, class DK, class DV, class O>
  void step_heads(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                  const Eigen::MatrixBase<DV>& v, O&& o) {
    const Index D = key_dim(), M = value_dim();
    for (Index h = 0; h < heads(); ++h)
      heads_[static_cast<std::size_t>(h)].step(q.reshaped().segment(h * D, D),
                                               k.reshaped().segment(h * D, D),
                                               v.reshaped().segment(h * M, M),
                                               o.segment(h * M, M));
  }

  std::vector<Head> heads_;
  Vector<Scalar> aliased_out_;  // H·M: the outputs when `out` shares memory with an input
};

}  // namespace linattn
