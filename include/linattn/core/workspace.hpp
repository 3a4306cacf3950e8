/// \file core/workspace.hpp
/// \brief Reusable scratch memory for the allocation-free overloads of the kernels.
#pragma once

#include <Eigen/Core>

#include <array>
#include <cstddef>
#include <memory>

#include "common.hpp"

namespace linattn {

namespace detail {
// Scratch a kernel keeps in a Workspace besides its buffers: the per-thread workspaces and
// states of a sequence split over threads (detail/sequence_split.hpp). Type-erased because
// those types are built on this header.
template <class Scalar>
struct WorkspaceExtension {
  virtual ~WorkspaceExtension() = default;
  virtual std::size_t bytes() const noexcept = 0;
};
}  // namespace detail

namespace detail {

// The float copies of bf16 / half operands and outputs (views.hpp), kept between calls so that
// a reused workspace converts into warm memory rather than into fresh pages every call.
template <class Scalar>
struct StorageCopies {
  std::array<Vector<Scalar>, 4> buffers;
  Scalar* reserve(int i, Index n) {
    auto& b = buffers[static_cast<std::size_t>(i)];
    if (b.size() < n) b.resize(n);
    return b.data();
  }
  std::size_t bytes() const noexcept {
    std::size_t total = 0;
    for (const auto& b : buffers) total += static_cast<std::size_t>(b.size()) * sizeof(Scalar);
    return total;
  }
  void release() {
    for (auto& b : buffers) b.resize(0);
  }
};

}  // namespace detail

/// \brief Scratch buffers that the kernels borrow instead of allocating.
///
/// Pass the same Workspace to repeated calls: the first call of a given shape allocates, later
/// calls of the same or smaller shapes allocate nothing. Buffers only grow. A Workspace is not
/// shared between threads; give each thread its own. A single-sequence kernel that splits a
/// long sequence over threads (ParallelOptions) keeps a Workspace and a few states per thread
/// in it, so that the guarantee holds for a given thread count as well. Copying a Workspace
/// copies its buffers (not that per-thread scratch); a copy is never needed for correctness.
///
/// The state products of the non-causal and causal forward kernels (S += φ(K)ᵀ V, φ(Q) S, the
/// chunk's scores) run on linattn's own register-blocked micro-kernel and never allocate. The
/// softmax kernels and the gradients still use Eigen's matrix products: when Eigen itself runs
/// products on several threads (OpenMP with Eigen::nbThreads() > 1, outside a parallel region),
/// Eigen's parallel GEMM allocates its own blocking buffers, and the guarantee is then void for
/// those. The recurrent step and the recurrent causal algorithm (the default) use no matrix
/// product and never allocate. Inside a parallel region, as in the multi-head kernels, Eigen's
/// products run serially.
///
/// \code
/// linattn::Workspace<float> ws;
/// Eigen::MatrixXf out(N, M);
/// for (int step = 0; step < 1000; ++step)
///   linattn::linear_attention(Q, K, V, linattn::EluPlusOne{}, out, ws);  // no allocation
/// \endcode
/// \tparam Scalar the scalar the kernels compute in (float or double: compute_scalar_t of
///                the operands' scalar).
template <class Scalar>
class Workspace {
 public:
  /// The number of buffers: each kernel uses fixed slots below this.
  static constexpr int kSlots = 20;

  /// An empty workspace: nothing is allocated until a kernel asks.
  Workspace() = default;
  /// Copies the buffers (not the per-thread scratch, which the next call rebuilds).
  /// \param other the workspace whose buffers are copied.
  Workspace(const Workspace& other) : buffers_(other.buffers_) {}
  /// Takes over every buffer of the other workspace, which is left empty.
  Workspace(Workspace&&) noexcept = default;
  /// Copies the buffers, as the copy constructor does, and drops this one's per-thread scratch.
  /// \param other the workspace whose buffers are copied.
  /// \return this workspace.
  Workspace& operator=(const Workspace& other) {
    if (this != &other) {
      buffers_ = other.buffers_;
      extension_.reset();
    }
    return *this;
  }
  /// Takes over every buffer of the other workspace.
  /// \return this workspace.
  Workspace& operator=(Workspace&&) noexcept = default;
  /// Frees every buffer.
  ~Workspace() = default;

  /// A rows x cols column-major view of buffer `slot`, grown if it is too small. Its contents
  /// are unspecified.
  /// \param slot which buffer, 0 <= slot < kSlots.
  /// \param rows, cols the view's shape.
  /// \return a view valid until the slot is next grown or the workspace released.
  Eigen::Map<Matrix<Scalar>> matrix(int slot, Index rows, Index cols) {
    return Eigen::Map<Matrix<Scalar>>(reserve_slot(slot, rows * cols), rows, cols);
  }

  /// A vector view of buffer `slot` with n entries, grown if it is too small.
  /// \param slot which buffer, 0 <= slot < kSlots.
  /// \param n the number of entries.
  /// \return a view valid until the slot is next grown or the workspace released.
  Eigen::Map<Vector<Scalar>> vector(int slot, Index n) {
    return Eigen::Map<Vector<Scalar>>(reserve_slot(slot, n), n);
  }

  /// Grows buffer `slot` to at least n entries now, so that later views of up to n entries
  /// allocate nothing (for kernels whose paths use a slot with different shapes).
  /// \param slot which buffer, 0 <= slot < kSlots.
  /// \param n the entries it must hold.
  void reserve(int slot, Index n) { (void)reserve_slot(slot, n); }

  /// Bytes held by all buffers (what a kernel allocated as working memory).
  /// \return the bytes, per-thread scratch and low-precision copies included.
  std::size_t bytes() const noexcept {
    std::size_t total = 0;
    for (const auto& b : buffers_) total += static_cast<std::size_t>(b.size()) * sizeof(Scalar);
    if (extension_) total += extension_->bytes();
    return total + copies_.bytes() + gates_.bytes();
  }

  /// Frees every buffer.
  void release() {
    for (auto& b : buffers_) b.resize(0);
    extension_.reset();
    copies_.release();
    gates_.release();
  }

  /// Internal: the float copies of bf16 / half operands (Q, K, V and the output of a call on
  /// them), grown to the largest call and kept.
  /// \private
  detail::StorageCopies<Scalar>& storage_copies() noexcept { return copies_; }

  /// Internal: the activated gates and β of the kernels' in-kernel overloads and their
  /// gradients (core/in_kernel_gates.hpp), apart from every kernel's slots.
  /// \private
  detail::StorageCopies<Scalar>& gate_buffers() noexcept { return gates_; }

  /// Internal: the kernel scratch of type T (a detail::WorkspaceExtension), created on first use.
  /// \private
  template <class T>
  T& extension() {
    if (auto* have = dynamic_cast<T*>(extension_.get())) return *have;
    extension_ = std::make_unique<T>();
    return static_cast<T&>(*extension_);
  }

 private:
  Scalar* reserve_slot(int slot, Index n) {
    auto& b = buffers_[static_cast<std::size_t>(slot)];
    if (b.size() < n) b.resize(n);
    return b.data();
  }

  std::array<Vector<Scalar>, kSlots> buffers_;
  std::unique_ptr<detail::WorkspaceExtension<Scalar>> extension_;
  detail::StorageCopies<Scalar> copies_;
  detail::StorageCopies<Scalar> gates_;
};

}  // namespace linattn
