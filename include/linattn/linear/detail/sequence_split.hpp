/// \file linear/detail/sequence_split.hpp
/// \brief One long sequence on several threads (spec §8): the scratch each thread keeps, and
/// the shared pieces of the causal and non-causal split algorithms.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cstddef>
#include <exception>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "../../core/common.hpp"
#include "../../core/error.hpp"
#include "../../core/parallel.hpp"
#include "../../core/state.hpp"
#include "../../core/workspace.hpp"
#include "../../maps/map_state.hpp"

namespace linattn {
namespace detail {

// A state of F x M with sized low parts (and maxima when per_feature), reallocated only when
// its shape differs: repeated calls of one shape allocate nothing.
template <class Scalar>
void shape_state(LinearAttentionState<Scalar>& st, Index F, Index M, bool per_feature) {
  if (st.S.rows() != F || st.S.cols() != M || st.S_lo.rows() != F || st.S_lo.cols() != M ||
      st.z.size() != F || st.z_lo.size() != F || st.m.size() != (per_feature ? F : 0))
    st = LinearAttentionState<Scalar>(F, M, per_feature);
}

// What a split call keeps in the caller's Workspace: per thread a Workspace, the state it
// carries into its segment and a merge operand; and the partial states of the key pieces.
template <class Scalar>
struct SplitScratch final : WorkspaceExtension<Scalar> {
  std::vector<Workspace<Scalar>> ws;
  std::vector<LinearAttentionState<Scalar>> carried, operand, parts;

  void prepare(int threads, Index part_count, Index F, Index M, bool per_feature) {
    const auto t = static_cast<std::size_t>(threads);
    if (ws.size() < t) ws.resize(t);
    if (carried.size() < t) carried.resize(t);
    if (operand.size() < t) operand.resize(t);
    if (parts.size() < static_cast<std::size_t>(part_count))
      parts.resize(static_cast<std::size_t>(part_count));
    for (auto* v : {&carried, &operand, &parts})
      for (auto& st : *v) shape_state(st, F, M, per_feature);
  }

  std::size_t bytes() const noexcept override {
    std::size_t total = 0;
    for (const auto& w : ws) total += w.bytes();
    for (const auto* v : {&carried, &operand, &parts})
      for (const auto& st : *v)
        total += static_cast<std::size_t>(st.S.size() + st.S_lo.size() + st.z.size() +
                                          st.z_lo.size() + st.m.size()) *
                 sizeof(Scalar);
    return total;
  }
};

// Row range [begin, begin + size) of part `i` of `count` near-equal parts of [0, n), with
// every boundary but the last a multiple of `align` (so that the causal kernel's blocks of a
// segment are those of a one-thread call from the same state).
struct RowRange {
  Index begin, size;
};
inline RowRange split_rows(Index n, int count, int i, Index align) {
  const Index per = (n + count - 1) / count;
  const Index step = std::max<Index>(align, (per + align - 1) / align * align);
  const Index b = std::min<Index>(n, step * i), e = std::min<Index>(n, step * (i + 1));
  return {b, e - b};
}

// The key-keep predicate of rows [a, ...) of a sequence, of the same type as `keep` for the
// library's two (NoMask, which the kernels skip the mask code for, and KeyMask), so that a
// segment runs the kernel instantiated for the whole sequence.
template <class Keep>
auto shifted_keep(const Keep& keep, Index a) {
  if constexpr (std::is_same_v<Keep, NoMask>) {
    (void)a;
    return NoMask{};
  } else if constexpr (std::is_same_v<Keep, KeyMask>) {
    return keep.shifted(a);
  } else {
    return [&keep, a](Index j) { return keep(a + j); };
  }
}

// The state of keys and values rows [r.begin, r.begin + r.size) into `st` (zeroed first).
template <class Phi, class K, class V, class Keep, class Scalar>
void summarize_rows(const Phi& phi, const K& k, const V& v, const Keep& keep, RowRange r,
                    LinearAttentionState<Scalar>& st, Workspace<Scalar>& ws) {
  st.reset();
  absorb_keys(phi, row_segment(k, r.begin, r.size), row_segment(v, r.begin, r.size), st.S,
              st.S_lo, st.z, st.z_lo, st.m, shifted_keep(keep, r.begin), ws);
}

// into = init followed by parts[0, count), merged left to right (the same order on every
// thread: the result does not depend on which thread computes it). No allocation.
template <class Scalar>
void scan_parts(const LinearAttentionState<Scalar>* init, SplitScratch<Scalar>& x, Index count,
                int thread, LinearAttentionState<Scalar>& into) {
  auto& operand = x.operand[static_cast<std::size_t>(thread)];
  Index first = 0;
  if (init) {
    into = *init;
  } else if (count > 0) {
    into = x.parts[0];
    first = 1;
  } else {
    into.reset();
  }
  for (Index p = first; p < count; ++p) {
    operand = x.parts[static_cast<std::size_t>(p)];
    merge_into(into, operand);
  }
}

// Runs phase1(t, T), a barrier, then phase2(t, T) on a team of `threads` threads, T being the
// team's actual size (an OpenMP runtime may give fewer threads than asked for: the phases
// lay out the work by T, so each thread's share stays one unit and nothing waits on a thread
// that does not exist). With an executor (ParallelOptions::executor) the barrier is the return
// of its first call: each phase is one call of T = threads tasks. Exceptions cannot leave a
// parallel region: the first one is kept, the second phase skipped and the exception rethrown
// after the region. Returns T.
template <class Phase1, class Phase2>
int run_two_phases(int threads, const Executor* executor, const Phase1& phase1,
                   const Phase2& phase2) {
  if (executor) {
    const int team = run_team(threads, executor, phase1);
    run_team(team, executor, phase2);
    return team;
  }
#ifdef _OPENMP
  FirstError error;
  int team = 1;
#pragma omp parallel num_threads(threads)
  {
    const int T = omp_get_num_threads(), t = omp_get_thread_num();
    if (t == 0) team = T;
    error.run([&] { phase1(t, T); });
#pragma omp barrier
    if (!error.failed()) error.run([&] { phase2(t, T); });
  }
  error.rethrow_if_failed();
  return team;
#else
  (void)threads;
  phase1(0, 1);
  phase2(0, 1);
  return 1;
#endif
}

}  // namespace detail
}  // namespace linattn
