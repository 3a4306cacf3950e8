/// \file linear/multihead_workspace.hpp
/// \brief MultiHeadWorkspace: the per-thread scratch memory and states of the multi-head and
/// batched kernels.
#pragma once

#include <Eigen/Core>

#include <cstddef>
#include <vector>

#include "../core/common.hpp"
#include "../core/error.hpp"
#include "../core/parallel.hpp"
#include "../core/state.hpp"
#include "../core/workspace.hpp"

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
  /// \param t the thread's index, 0 <= t < the thread count of the call.
  /// \return the workspace, valid until the MultiHeadWorkspace is destroyed.
  Workspace<Scalar>& for_thread(int t) {
    if (static_cast<int>(per_thread_.size()) <= t) per_thread_.resize(static_cast<std::size_t>(t) + 1);
    return per_thread_[static_cast<std::size_t>(t)];
  }
  /// The `count` causal states that thread `t` carries through the heads it runs together
  /// (one per head), creating them as needed; the causal kernels size and reset them.
  /// \param t the thread's index, 0 <= t < the thread count of the call.
  /// \param count the number of states it needs (one per head it runs).
  /// \return the first of `count` consecutive states.
  LinearAttentionState<Scalar>* states_for_thread(int t, Index count) {
    if (static_cast<int>(states_.size()) <= t) states_.resize(static_cast<std::size_t>(t) + 1);
    auto& mine = states_[static_cast<std::size_t>(t)];
    if (static_cast<Index>(mine.size()) < count) mine.resize(static_cast<std::size_t>(count));
    return mine.data();
  }
  /// The first causal state of thread `t` (see states_for_thread()).
  /// \param t the thread's index, 0 <= t < the thread count of the call.
  /// \return the state.
  LinearAttentionState<Scalar>& state_for_thread(int t) { return *states_for_thread(t, 1); }
  /// Makes sure `threads` workspaces and lists of states exist (allocating only the vectors of
  /// them), so that threads never grow the outer vectors concurrently.
  /// \param threads the number of threads whose scratch is kept.
  void reserve_threads(int threads) {
    if (threads <= 0) return;
    for_thread(threads - 1);
    if (static_cast<int>(states_.size()) < threads) states_.resize(static_cast<std::size_t>(threads));
  }
  /// Internal: the float copies of bf16 / half operands (the calling thread's workspace's).
  /// \private
  detail::StorageCopies<Scalar>& storage_copies() { return for_thread(0).storage_copies(); }
  /// Bytes held by all threads' buffers and states.
  /// \return the bytes of every thread's workspace and states.
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

// Runs fn(task, thread) for task in [0, tasks) on min(threads, tasks) threads (a parallel
// region only when that is more than one and OpenMP is on); thread indexes the workspace and
// state of ws that the task may use. Every argument check happens before this point, but a task
// can still run out of memory (a workspace grows on a thread's first task): an exception
// escaping an OpenMP region calls std::terminate, so the first one is kept, the remaining tasks
// are skipped and it is rethrown after the region.
template <class Scalar, class Fn>
void run_tasks(Index tasks, int threads, MultiHeadWorkspace<Scalar>& ws, const Fn& fn,
               const Executor* executor) {
  threads = static_cast<int>(std::min<Index>(std::max(threads, 1), std::max<Index>(tasks, 1)));
  ws.reserve_threads(threads);
  if (threads <= 1) {
    for (Index t = 0; t < tasks; ++t) fn(t, 0);
    return;
  }
  if (executor) {
    // One executor task per thread of the OpenMP path, each taking (sequence, head) tasks in
    // turn as OpenMP's dynamic schedule does; task w uses the workspace of thread w. A task's
    // result does not depend on which thread runs it.
    std::atomic<Index> next{0};
    FirstError error;
    run_team(threads, executor, [&](int w, int) {
      for (Index t = next.fetch_add(1); t < tasks; t = next.fetch_add(1))
        if (!error.failed()) error.run([&] { fn(t, w); });
    });
    error.rethrow_if_failed();
    return;
  }
#ifdef _OPENMP
  FirstError error;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (Index t = 0; t < tasks; ++t) {
    if (error.failed()) continue;
    error.run([&] { fn(t, thread_id()); });
  }
  error.rethrow_if_failed();
#endif
}

// run_tasks() on the threads that `work` flops (the whole call's, estimated from its shapes)
// pay for: detail::threads_for(), ParallelOptions::min_work_per_thread.
template <class Scalar, class Fn>
void parallel_tasks(Index tasks, double work, const ParallelOptions& par,
                    MultiHeadWorkspace<Scalar>& ws, const Fn& fn) {
  run_tasks<Scalar>(tasks, threads_for(par, work), ws, fn, executor_of(par));
}

// run_tasks() on all the threads asked for, whatever the work: for callers that do not
// estimate theirs (yet). Prefer the overload above.
template <class Scalar, class Fn>
void parallel_tasks(Index tasks, const ParallelOptions& par, MultiHeadWorkspace<Scalar>& ws,
                    const Fn& fn) {
  run_tasks<Scalar>(tasks, resolve_threads(par), ws, fn, executor_of(par));
}

}  // namespace detail

}  // namespace linattn
