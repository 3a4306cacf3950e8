/// \file parallel.hpp
/// \brief ParallelOptions: how many threads a kernel uses, and when one long sequence is split
/// over them.
#pragma once

#include <algorithm>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "common.hpp"

namespace linattn {

/// \brief How the kernels run in parallel (OpenMP).
///
/// The multi-head and batched kernels run heads and sequences on different threads. The
/// single-sequence kernels (linear_attention(), causal_linear_attention() and their masked
/// forms) split one long sequence into as many segments as threads (docs/SPEC.md §8): each
/// thread summarises part of the keys, the states are combined in a fixed order, and each
/// thread computes the outputs of its segment from the state of everything before it. The
/// split runs when OpenMP is enabled, the call is not already inside a parallel region, and
/// every thread gets at least `min_rows_per_thread` rows; otherwise the call runs on the
/// calling thread. Results agree with the one-thread call to rounding, and are bit for bit
/// the same from run to run for a given thread count.
///
/// \code
/// linattn::ParallelOptions par;
/// par.num_threads = 4;  // split long sequences over 4 threads
/// auto out = linattn::causal_linear_attention(Q, K, V, linattn::EluPlusOne{}, {}, par);
/// par.num_threads = 1;  // never split: bit for bit the serial algorithm
/// \endcode
struct ParallelOptions {
  /// Threads to use: 0 means OpenMP's default (omp_get_max_threads()), 1 runs serially.
  /// Without OpenMP every kernel runs serially, with identical results.
  int num_threads = 0;
  /// A single sequence is split only if each thread gets at least this many rows (for
  /// non-causal attention, half the rows of Q and K together: its rows cost half a causal
  /// row). 0 picks the default, `max(1024, 2^22 / (F·M))`: about a third of a millisecond of
  /// work per thread, against a few microseconds to start the threads.
  Index min_rows_per_thread = 0;
};

namespace detail {

inline int resolve_threads(const ParallelOptions& par) {
#ifdef _OPENMP
  return par.num_threads > 0 ? par.num_threads : omp_get_max_threads();
#else
  (void)par;
  return 1;
#endif
}

inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// Segments one sequence is split into: 1 (run serially) unless OpenMP is on, the call is not
// nested in a parallel region (whose threads are busy already: the multi-head kernels call the
// single-head ones from theirs) and each of the threads gets min_rows_per_thread rows.
// `rows` is the work in causal rows (see ParallelOptions::min_rows_per_thread).
inline int sequence_split_threads(const ParallelOptions& par, Index rows, Index state_size) {
#ifdef _OPENMP
  if (omp_in_parallel()) return 1;
  const Index min_rows =
      par.min_rows_per_thread > 0
          ? par.min_rows_per_thread
          : std::max<Index>(1024, (Index(1) << 22) / std::max<Index>(state_size, 1));
  const Index by_rows = rows / min_rows;
  return static_cast<int>(std::max<Index>(1, std::min<Index>(resolve_threads(par), by_rows)));
#else
  (void)par;
  (void)rows;
  (void)state_size;
  return 1;
#endif
}

}  // namespace detail
}  // namespace linattn
