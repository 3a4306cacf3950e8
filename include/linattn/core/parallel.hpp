/// \file core/parallel.hpp
/// \brief ParallelOptions: how many threads a kernel uses, and when one long sequence is split
/// over them.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "common.hpp"
#include "error.hpp"

namespace linattn {

/// \brief A non-owning reference to a callable with the signature `R(Args...)` (the
/// std::function_ref of C++26): two pointers, no allocation, valid as long as the callable it
/// was made from.
///
/// The library hands its parallel tasks to an executor (ParallelOptions::executor) as a
/// `FunctionRef<void(Index)>`: the executor calls it, from any thread, while its own call lasts.
///
/// \code
/// auto body = [&](linattn::Index t) { out[t] = work(t); };
/// linattn::FunctionRef<void(linattn::Index)> task(body);
/// task(3);  // calls body(3)
/// \endcode
template <class Signature>
class FunctionRef;

/// The reference for a call signature `R(Args...)`: see FunctionRef.
/// \tparam R the result type of a call.
/// \tparam Args the argument types of a call.
template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  /// Refers to `f` (which must outlive every call through this reference).
  /// \param f the callable; only its address is kept.
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, FunctionRef> &&
                                              std::is_invocable_r_v<R, F&, Args...>>>
  FunctionRef(F&& f) noexcept  // NOLINT: implicit, as std::function_ref
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* object, Args... args) -> R {
          return (*static_cast<std::add_pointer_t<std::remove_reference_t<F>>>(object))(
              std::forward<Args>(args)...);
        }) {}

  /// Calls the callable it refers to.
  /// \param args passed on to the callable.
  /// \return what the callable returns.
  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  void* object_;
  R (*call_)(void*, Args...);
};

/// The type of ParallelOptions::executor: runs task(0) ... task(n_tasks - 1) and returns when
/// all have returned.
using Executor = std::function<void(Index n_tasks, FunctionRef<void(Index task)> task)>;

/// \brief How the kernels run in parallel: OpenMP, or the caller's thread pool (`executor`).
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
/// Threads that pay: starting and joining a team of threads costs time (1 to 60 microseconds on
/// an idle machine, milliseconds when the other cores are busy), so every parallel path
/// estimates the work of a call from its shapes (in flops: 4·F·(M + 1) per (sequence, head)
/// pair of a decode step, 4·N·F·(M + 1) per causal head, ...) and uses min(num_threads, work /
/// min_work_per_thread) threads, at least one: a call too small to gain from threads runs on
/// the calling thread, with no parallel region at all. The split of one sequence has its own,
/// larger grain (`min_rows_per_thread`). docs/SPEC.md §8 lists the paths and the measurement.
///
/// \code
/// linattn::ParallelOptions par;
/// par.num_threads = 4;  // split long sequences over 4 threads
/// auto out = linattn::causal_linear_attention(Q, K, V, linattn::EluPlusOne{}, {}, par);
/// par.num_threads = 1;  // never split: bit for bit the serial algorithm
/// par.num_threads = 2;
/// par.min_work_per_thread = 0;  // always 2 threads, however small the call
/// \endcode
struct ParallelOptions {
  /// The default of `min_work_per_thread`, in flops: about what starting a second thread costs
  /// (an OpenMP fork and join, 1 to 60 us on an idle machine: omp_fork_join in
  /// benchmarks/bench_serving.cpp) at the rate one core runs the kernels, so that a second
  /// thread pays even when it has to be woken. See docs/SPEC.md §8.
  static constexpr double kDefaultMinWorkPerThread = 1e6;

  /// Threads to use: 0 means OpenMP's default (omp_get_max_threads()), 1 runs serially.
  /// Without OpenMP every kernel runs serially, with identical results. An upper bound: a call
  /// whose work does not pay for that many threads uses fewer (`min_work_per_thread`).
  int num_threads = 0;
  /// A single sequence is split only if each thread gets at least this many rows (for
  /// non-causal attention, half the rows of Q and K together: its rows cost half a causal
  /// row). 0 picks the default, `max(1024, 2^22 / (F·M))`: about a third of a millisecond of
  /// work per thread, against a few microseconds to start the threads.
  Index min_rows_per_thread = 0;
  /// The work (in flops, as estimated from the shapes of a call) that each thread must get: a
  /// call of work W runs on min(num_threads, floor(W / min_work_per_thread)) threads, at least
  /// 1 (the batched decode step, the multi-head and batched linear attention kernels; the split
  /// of one sequence when this asks for more rows than min_rows_per_thread's default). Raise it
  /// when the cores are shared with busy processes (where a parallel region can cost
  /// milliseconds: 10^8 is about 5 ms of work); 0 (or less) always uses the threads asked for.
  /// On the multi-head and batched paths results are bit for bit the same for any thread
  /// count, so this changes speed only.
  double min_work_per_thread = kDefaultMinWorkPerThread;

  /// The caller's thread pool, in place of OpenMP: `executor(n, task)` must call `task(i)`
  /// exactly once for every i in [0, n), on any threads (the calling one included) and
  /// possibly at the same time, and return when every call has returned. The library hands it
  /// as many tasks as the threads a call would use (`num_threads`, 0 = the machine's
  /// std::thread::hardware_concurrency(), reduced by `min_work_per_thread` as for OpenMP), never
  /// more than one call at a time from one kernel call, and never from inside one of its own
  /// tasks (a kernel called from a task runs serially there, so a pool whose threads wait for
  /// nothing cannot deadlock). Tasks never throw: an exception of a task (std::bad_alloc) is
  /// kept and rethrown to the kernel's caller after the executor returns. Each task is one
  /// thread's share of the OpenMP path (the same partition), so results are bit for bit those
  /// of OpenMP with the same number of threads. Works without OpenMP too (the
  /// linattn::linattn_serial target, LINATTN_OPENMP=OFF). Empty (the default): OpenMP.
  ///
  /// \code
  /// linattn::ParallelOptions par;
  /// par.num_threads = pool.size();
  /// par.executor = [&pool](linattn::Index n, linattn::FunctionRef<void(linattn::Index)> task) {
  ///   pool.run_and_wait(n, task);  // task(0) ... task(n - 1) on the pool's threads
  /// };
  /// auto out = linattn::causal_linear_attention(Q, K, V, linattn::EluPlusOne{}, {}, par);
  /// \endcode
  /// examples/thread_pool_executor.cpp has a complete std::thread pool.
  Executor executor;
};

namespace detail {

// Whether the calling thread runs a task that the library handed to an executor: a kernel called
// from there runs serially (the executor's threads are busy with the call that handed it out,
// as OpenMP's are in a nested region).
inline bool& in_executor_task() noexcept {
  static thread_local bool inside = false;
  return inside;
}

// Inside a parallel region of the library: an OpenMP team's or an executor task.
inline bool in_parallel_region() noexcept {
#ifdef _OPENMP
  if (omp_in_parallel()) return true;
#endif
  return in_executor_task();
}

inline int resolve_threads(const ParallelOptions& par) {
  if (par.executor) {
    if (par.num_threads > 0) return par.num_threads;
    const unsigned n = std::thread::hardware_concurrency();
    return n > 0 ? static_cast<int>(std::min<unsigned>(n, 1u << 16)) : 1;
  }
#ifdef _OPENMP
  return par.num_threads > 0 ? par.num_threads : omp_get_max_threads();
#else
  (void)par;
  return 1;
#endif
}

// Threads for a call of `work` flops (estimated from its shapes): the threads asked for,
// reduced to floor(work / min_work_per_thread) when that is fewer (at least 1). 1 without
// OpenMP. The one cost model of every parallel path but the split of one sequence (below).
inline int threads_for(const ParallelOptions& par, double work) {
  if (par.executor && in_executor_task()) return 1;
  const int requested = std::max(resolve_threads(par), 1);
  if (requested == 1 || !(par.min_work_per_thread > 0)) return requested;
  const double pays = work / par.min_work_per_thread;  // threads the work pays for
  if (!(pays >= 2)) return 1;                          // also NaN
  return pays >= requested ? requested : static_cast<int>(pays);
}

// The work models of the paths (flops), as the benchmarks count them: a decode step of one
// (sequence, head) pair (the update S += phi(k) v^T, z += phi(k), and the read phi(q)^T S,
// phi(q)^T z), one head of a causal or non-causal linear attention call, and one head of
// softmax attention (scores and their products with V; half of them when causal). A gradient
// costs about twice its forward.
inline double decode_pair_work(Index F, Index M) { return 4.0 * double(F) * double(M + 1); }
inline double causal_head_work(Index rows, Index F, Index M) {
  return 4.0 * double(rows) * double(F) * double(M + 1);
}
inline double linear_head_work(Index query_rows, Index key_rows, Index F, Index M) {
  return 2.0 * double(query_rows + key_rows) * double(F) * double(M + 1);
}
inline double softmax_head_work(Index query_rows, Index key_rows, Index D, Index M, bool causal) {
  return (causal ? 1.0 : 2.0) * double(query_rows) * double(key_rows) * double(D + M);
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
// The split's cost model: its default grain, max(1024, 2^22 / (F·M)) rows, is at least
// 1.6·10^7 flops a thread (4·F·M a causal row), far above min_work_per_thread's default, because
// the split adds work (the summaries of spec §8) besides the fork and join. A
// min_work_per_thread raised above it (cores shared with busy processes) raises it; an explicit
// min_rows_per_thread is used as it is.
inline int sequence_split_threads(const ParallelOptions& par, Index rows, Index state_size) {
  if (in_parallel_region()) return 1;
#ifndef _OPENMP
  if (!par.executor) return 1;
#endif
  Index min_rows = par.min_rows_per_thread;
  if (min_rows <= 0) {
    min_rows = std::max<Index>(1024, (Index(1) << 22) / std::max<Index>(state_size, 1));
    const double work_rows =
        par.min_work_per_thread / (4.0 * double(std::max<Index>(state_size, 1)));
    if (work_rows > double(min_rows))
      min_rows = work_rows >= double(rows) ? rows + 1 : static_cast<Index>(std::ceil(work_rows));
  }
  const Index by_rows = rows / min_rows;
  return static_cast<int>(std::max<Index>(1, std::min<Index>(resolve_threads(par), by_rows)));
}

// The executor of `par`, or null for OpenMP.
inline const Executor* executor_of(const ParallelOptions& par) noexcept {
  return par.executor ? &par.executor : nullptr;
}

// Runs body(t, T) for every t in [0, T) and returns T, the threads that ran: on `executor`
// (one task per t, T = threads) when there is one, else on an OpenMP team of `threads` (T may
// come out smaller: a runtime can give fewer threads than asked for), else, and inside an
// executor's task, one after the other on the calling thread (T = threads, the same partition).
// The first exception of a body is rethrown after every body has returned (none may leave an
// OpenMP region or reach the caller's pool); the bodies after it are still called, and may test
// error.failed() through their own FirstError to skip their work.
template <class Body>
int run_team(int threads, const Executor* executor, const Body& body) {
  threads = std::max(threads, 1);
  FirstError error;
  int team = threads;
  if (threads == 1) {
    body(0, 1);
    return 1;
  }
  if (executor && !in_executor_task()) {
    const auto task = [&](Index t) {
      bool& inside = in_executor_task();  // this task's thread's flag
      const bool was = inside;
      inside = true;
      error.run([&] { body(static_cast<int>(t), threads); });
      inside = was;
    };
    (*executor)(Index(threads), FunctionRef<void(Index)>(task));
  } else if (executor) {
    for (int t = 0; t < threads; ++t) error.run([&] { body(t, threads); });
  } else {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    {
      const int T = omp_get_num_threads(), t = omp_get_thread_num();
      if (t == 0) team = T;
      error.run([&] { body(t, T); });
    }
#else
    for (int t = 0; t < threads; ++t) error.run([&] { body(t, threads); });
#endif
  }
  error.rethrow_if_failed();
  return team;
}

}  // namespace detail
}  // namespace linattn
