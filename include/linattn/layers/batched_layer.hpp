/// \file layers/batched_layer.hpp
/// \brief The batched generation state of a LinearAttentionLayer (LinearAttentionLayerBatchedState,
/// spelled `LinearAttentionLayer<Phi, Scalar>::BatchedState`): B sequences served together, a
/// packed prefill of all of them and one decode step for one token of each, with the projections
/// as one matrix product over the batch (spec §6). Included by attention_layer.hpp.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <string>
#include <type_traits>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "../linear/batched_recurrent.hpp"
#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../core/detail/microkernel.hpp"
#include "../linear/multihead_workspace.hpp"
#include "../core/parallel.hpp"
#include "../core/tuning.hpp"

namespace linattn {

template <class Phi, class Scalar>
class LinearAttentionLayer;

namespace detail {

// out.topRows(n) = in.topRows(n) Wᵀ on the micro-kernel, as outᵀ (m x n) = W (m x k,
// column-major) inᵀ, for row-major `in` and `out`: no allocation, no packing. The m rows of W
// are split over `threads` threads in whole micro-tiles, so that every entry takes the same path
// (hence the same bits) for any thread count. Fewer than kMicroCols rows take one matrix-vector
// product each, on the calling thread. `path_rows` (default n) is the row count that picks
// between the two: a multi-token call passes its batch's B, so that its rows get the bits the
// batch's step() gives them (the two paths round differently once k exceeds one depth block).
template <class Scalar, class RowMat>
void layer_rows_times_transpose(const Matrix<Scalar>& W, const RowMat& in, Index n, RowMat& out,
                                int threads, const Executor* executor, Index path_rows = -1) {
  constexpr Index kTile = Index(kMicroRowPackets) * Index(Eigen::internal::packet_traits<Scalar>::size);
  const Index m = W.rows(), k = W.cols();
  if (m == 0 || n == 0) return;
  if ((path_rows < 0 ? n : path_rows) < kMicroCols) {
    // Fewer rows than the micro-tile's columns: it would compute kMicroCols columns for each,
    // so one matrix-vector product per row (Eigen's, as the single-sequence step; no allocation).
    for (Index r = 0; r < n; ++r) out.row(r).transpose().noalias() = W * in.row(r).transpose();
    return;
  }
  const auto rows = [&](Index i0, Index i1) {
    if (i1 <= i0) return;
    // k in blocks of kLayerDepthBlock, the same for any thread count (so the same bits).
    for (Index p0 = 0; p0 < k; p0 += kLayerDepthBlock)
      gemm_acc<Scalar>(i1 - i0, n, std::min(kLayerDepthBlock, k - p0),
                       W.data() + i0 + p0 * W.outerStride(), W.outerStride(), in.data() + p0, 1,
                       in.outerStride(), out.data() + i0, out.outerStride(), p0 > 0);
  };
  const Index tiles = (m + kTile - 1) / kTile;
  const int T = static_cast<int>(std::min<Index>(std::max(threads, 1), tiles));
  if (T <= 1) {
    rows(0, m);
    return;
  }
  run_team(T, executor, [&](int t, int nt) {
    const Index me = t;
    rows(std::min(m, me * tiles / nt * kTile), std::min(m, (me + 1) * tiles / nt * kTile));
  });
}

}  // namespace detail

/// \brief The generation state of B sequences of a LinearAttentionLayer<Phi, Scalar>, spelled
/// `LinearAttentionLayer<Phi, Scalar>::BatchedState` (make_batched_state()): a
/// BatchedRecurrentLinearAttention of B sequences x H heads (decoder()) and the buffers of a
/// batched step (the tokens' Q, K, V and attention outputs, one row per sequence), reused: once
/// their capacity holds B rows, LinearAttentionLayer::step(Xb, state, Yb) allocates nothing.
///
/// Sequences are numbered 0 … B−1 and own row b of every step's Xb and Yb. A server adds a
/// conversation with add_sequence() (then prefills it with the layer's batched forward(), or
/// steps it from an empty state), ends one with remove_sequence() (the last sequence takes its
/// number), and parks or resumes every sequence with save_state() / load_state() of decoder()
/// (state_io.hpp, kind 5): a resumed decode continues bit for bit.
///
/// Softmax layers have no batched state: their KV caches grow with each sequence's length; serve
/// them with one SoftmaxAttentionLayer::State per sequence.
/// \code
/// linattn::LinearAttentionLayer<linattn::EluPlusOne, float> layer(512, 8);
/// auto batch = layer.make_batched_state(4);       // 4 empty sequences
/// Eigen::MatrixXf P = layer.forward(prompts, cu_seqlens, batch);  // packed prefill
/// Eigen::MatrixXf Xb(4, 512), Yb(4, 512);
/// layer.step(Xb, batch, Yb);                      // one token of each: no allocation
/// std::ofstream file("batch.state", std::ios::binary);
/// linattn::save_state(file, batch);               // park every conversation
/// \endcode
template <class Phi, class Scalar>
class LinearAttentionLayerBatchedState {
 public:
  /// The decoder of the B sequences' heads.
  using Decoder = BatchedRecurrentLinearAttention<Phi, Scalar>;

  /// Sequences B (rows of a step's Xb and Yb).
  /// \return B, the number of sequences.
  Index sequences() const noexcept { return dec_.sequences(); }
  /// Tokens of sequence b (prefill and steps) since it was added or reset.
  /// \throws std::invalid_argument if b is outside [0, B).
  /// \param b the sequence (slot), 0 <= b < sequences().
  /// \return the tokens sequence b has consumed.
  Index position(Index b) const { return dec_.position(b); }
  /// Rows of the step buffers: steps of up to capacity() sequences allocate nothing.
  /// \return the sequences a step takes without growing.
  Index capacity() const noexcept { return q_.rows(); }

  /// Buffers for steps of `rows` sequences (never shrinks). add_sequence() grows them by
  /// doubling; reserve() ahead of time makes the first steps after add_sequence() as cheap.
  /// \throws std::invalid_argument if rows < 0.
  /// \param rows the sequences a step should take without growing.
  void reserve(Index rows) {
    if (rows < 0)
      detail::throw_invalid("LinearAttentionLayer::BatchedState::reserve",
                            "rows must be >= 0, got " + std::to_string(rows));
    if (rows <= capacity()) return;
    const Index cap = std::max(rows, 2 * capacity());
    RowMatrix x(cap, d_model_), q(cap, q_.cols()), k(cap, k_.cols()), v(cap, v_.cols()),
        a(cap, a_.cols()), y(cap, d_model_);
    x_.swap(x);
    q_.swap(q);
    k_.swap(k);
    v_.swap(v);
    a_.swap(a);
    y_.swap(y);
  }

  /// Appends an empty sequence (position 0) and returns its number (B before the call).
  /// Allocates its H states (or reuses those of a removed sequence) and, past capacity(),
  /// doubles the step buffers.
  /// \return the new sequence's number, the B before the call.
  Index add_sequence() {
    reserve(sequences() + 1);
    return dec_.add_sequence();
  }

  /// Removes sequence b: the last sequence takes number b, B decreases by one (see
  /// BatchedRecurrentLinearAttention::remove_sequence()). Allocates nothing; the buffers keep
  /// their capacity.
  /// \throws std::invalid_argument if b is outside [0, B).
  /// \param b the sequence (slot), 0 <= b < sequences().
  void remove_sequence(Index b) { dec_.remove_sequence(b); }

  /// Sequence b back to no tokens (its number is kept).
  /// \param b the sequence (slot), 0 <= b < sequences().
  void reset(Index b) { dec_.reset(b); }

  /// \brief The heads of the B sequences: `decoder().state(b, h)` of head h of sequence b, and
  /// save_state(os, decoder()) / load_state(is, decoder()) (state_io.hpp) to park and resume
  /// every sequence bit for bit. load_state() replaces B with the file's count; the next step
  /// grows the buffers if they hold fewer rows. Keep the decoder's shapes (H, D, M): the layer
  /// refuses a state whose decoder has others.
  /// \code
  /// auto resumed = layer.make_batched_state();
  /// std::ifstream file("batch.state", std::ios::binary);
  /// linattn::load_state(file, resumed.decoder());  // the saved B sequences
  /// layer.step(Xb, resumed, Yb);                   // continues each bit for bit
  /// \endcode
  /// \return the decoder, to save or load its states (state_io.hpp).
  Decoder& decoder() noexcept { return dec_; }
  /// The heads of the B sequences (read only).
  /// \return the decoder holding every head's state.
  const Decoder& decoder() const noexcept { return dec_; }

 private:
  friend class LinearAttentionLayer<Phi, Scalar>;
  using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  LinearAttentionLayerBatchedState(Index d_model, Index heads, Index key_dim, Index value_dim,
                                   const Phi& phi, Index sequences, Index capacity)
      : d_model_(d_model),
        dec_(sequences, heads, key_dim, value_dim, phi),
        x_(0, d_model),
        q_(0, heads * key_dim),
        k_(0, heads * key_dim),
        v_(0, heads * value_dim),
        a_(0, heads * value_dim),
        y_(0, d_model) {
    reserve(std::max(sequences, capacity));
  }

  // One batched step of n rows: Xb copied (Yb may be its memory), Q, K, V of its rows by the
  // micro-kernel, attend(Q, K, V, A) (the decoder's step, all or some sequences), Yb = A Woᵀ + bo.
  // Allocates nothing once capacity() >= n.
  template <class Layer, class DX, class DY, class Attend>
  void run_step(const Layer& layer, Index n, const Eigen::MatrixBase<DX>& Xb,
                const Eigen::MatrixBase<DY>& Yb, const ParallelOptions& par, const Attend& attend) {
    reserve(n);
    x_.topRows(n) = Xb;
    const Index HD = q_.cols(), HM = v_.cols();
    const double work = 2.0 * double(n) * double(d_model_) * double(2 * HD + 2 * HM);
    int threads = 1;
    if (work >= 2 * detail::kLayerProjectionWorkPerThread)
      threads = static_cast<int>(std::min<double>(detail::resolve_threads(par),
                                                  work / detail::kLayerProjectionWorkPerThread));
    if (detail::in_parallel_region()) threads = 1;
    detail::layer_rows_times_transpose(layer.Wq, x_, n, q_, threads,
                                      detail::executor_of(par));
    q_.topRows(n).rowwise() += layer.bq.transpose();
    detail::layer_rows_times_transpose(layer.Wk, x_, n, k_, threads,
                                      detail::executor_of(par));
    k_.topRows(n).rowwise() += layer.bk.transpose();
    detail::layer_rows_times_transpose(layer.Wv, x_, n, v_, threads,
                                      detail::executor_of(par));
    v_.topRows(n).rowwise() += layer.bv.transpose();
    attend(q_.topRows(n), k_.topRows(n), v_.topRows(n), a_.topRows(n));
    detail::layer_rows_times_transpose(layer.Wo, a_, n, y_, threads,
                                      detail::executor_of(par));
    y_.topRows(n).rowwise() += layer.bo.transpose();
    detail::writable(Yb) = y_.topRows(n);
  }

  Index d_model_;
  Decoder dec_;
  RowMatrix x_, q_, k_, v_, a_, y_;  // one row per sequence of a step; capacity() rows
  MultiHeadWorkspace<Scalar> ws_;    // the prefill's
};

}  // namespace linattn
