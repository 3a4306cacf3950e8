/// \file multihead_workspace.hpp
/// \brief MultiHeadWorkspace: the per-thread scratch memory and states of the multi-head and
/// batched kernels.
#pragma once

#include <Eigen/Core>

#include <cstddef>
#include <vector>

#include "common.hpp"
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
  /// Internal: the float copies of bf16 / half operands (the calling thread's workspace's).
  detail::StorageCopies<Scalar>& storage_copies() { return for_thread(0).storage_copies(); }
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

}  // namespace linattn
