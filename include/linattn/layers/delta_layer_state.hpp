/// \file layers/delta_layer_state.hpp
/// \brief The states of the delta-rule layers (GatedDeltaNetLayer, KimiDeltaAttentionLayer):
/// one sequence's convolution and head states (DeltaLayerState), and B sequences decoded
/// together with the buffers of a batched step (DeltaLayerBatchedState).
#pragma once

#include <Eigen/Core>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/common.hpp"
#include "../core/detail/checks.hpp"
#include "../core/gates.hpp"
#include "../core/state.hpp"
#include "../core/workspace.hpp"
#include "../delta/batched_recurrent_delta_rule.hpp"
#include "../linear/heads.hpp"
#include "../maps/l2_normalize.hpp"
#include "delta_layer_gradients.hpp"
#include "detail/delta_layer_serving.hpp"
#include "short_convolution.hpp"

namespace linattn {

/// \brief The state of one sequence of a delta-rule layer (GatedDeltaNetLayer,
/// KimiDeltaAttentionLayer): the short convolution's last W − 1 inputs over the layer's
/// convolved channels q | k | v side by side, and the heads' K x V delta-rule states. Empty
/// parts are zeros (a new sequence); copy it to fork a sequence.
template <class Scalar>
struct DeltaLayerState {
  ShortConvState<Scalar> conv;                      ///< (W − 1) x C (C: q | k | v), or empty
  std::vector<LinearAttentionState<Scalar>> heads;  ///< one state per (value) head, or empty
  Index position = 0;                               ///< tokens consumed
};

/// \brief The forward forms of a delta-rule layer (GatedDeltaNetLayer,
/// KimiDeltaAttentionLayer): one new sequence, one sequence continuing its state (a prefill or
/// its continuation), and B packed sequences continuing theirs. The layer derives from it and
/// computes the packed form (its forward_impl).
/// \tparam Derived the layer
/// \tparam Scalar float or double
template <class Derived, class Scalar>
class DeltaLayerForward {
 public:
  /// A new sequence's state (zeros, position 0).
  /// \return the state.
  DeltaLayerState<Scalar> make_state() const { return DeltaLayerState<Scalar>{}; }

  /// Y (N x d) for the rows of one new sequence X (N x d).
  /// \param X N x d input rows.
  /// \return Y, N x d.
  template <class DX>
  Matrix<Scalar> forward(const Eigen::MatrixBase<DX>& X) const {
    DeltaLayerState<Scalar> state;
    return forward(X, state);
  }

  /// The forward of one sequence continuing `state` (a prefill or its continuation), leaving
  /// it after the last row; equal to the layer's step() through the rows to rounding. On an
  /// exception `state` is unchanged.
  /// \throws std::invalid_argument on a wrong shape (of X, a parameter or the state) or a
  /// non-finite entry of X (naming it: the gates must be finite).
  /// \param X N x d input rows.
  /// \param state the sequence's state, moved past the N rows.
  /// \return Y, N x d.
  template <class DX>
  Matrix<Scalar> forward(const Eigen::MatrixBase<DX>& X, DeltaLayerState<Scalar>& state) const {
    std::vector<DeltaLayerState<Scalar>> states(1);
    states[0] = state;
    const Index offsets[2] = {0, X.rows()};
    Matrix<Scalar> Y =
        self().forward_impl(Derived::kForwardName, X, detail::OffsetsRef(offsets, 2), states);
    state = std::move(states[0]);
    return Y;
  }

  /// The forward of B sequences packed one after another (rows [offsets[b], offsets[b+1]) are
  /// sequence b, FLA's cu_seqlens), each continuing states[b] (an empty vector: B new
  /// sequences), which move past their rows. A sequence never reads another's rows.
  /// \throws std::invalid_argument as forward(X, state), or on offsets that are not
  /// non-decreasing from 0 to N.
  /// \param X the packed N x d input rows.
  /// \param offsets B + 1 offsets (std::vector or Eigen vector of any integer type).
  /// \param states B states, or an empty vector.
  /// \return Y, N x d.
  template <class DX, class Off>
  Matrix<Scalar> forward(const Eigen::MatrixBase<DX>& X, const Off& offsets,
                         std::vector<DeltaLayerState<Scalar>>& states) const {
    const char* fn = Derived::kForwardName;
    const auto off = detail::offsets_of(fn, "offsets", offsets);
    detail::check_offsets(fn, "offsets", off, X.rows());
    if (states.empty()) states.resize(off.size() - 1);
    std::vector<DeltaLayerState<Scalar>> next = states;
    Matrix<Scalar> Y = self().forward_impl(fn, X, off, next);
    states = std::move(next);
    return Y;
  }

  /// The gradients of a loss L through forward(X) of one new sequence, given dY = ∂L/∂Y
  /// (N x d): every parameter's (members named as the layer's parameters) and the input's
  /// (dX), for training. The forward pass is computed again inside: nothing is kept between
  /// the calls.
  /// \throws std::invalid_argument as forward(X), or on a dY that is not N x d.
  /// \code
  /// Eigen::MatrixXd Y = layer.forward(X);
  /// auto g = layer.backward(X, dY);  // g.dX and one member per parameter
  /// layer.out_proj -= lr * g.out_proj;
  /// \endcode
  /// \param X N x d input rows.
  /// \param dY N x d gradient of the loss with respect to the output.
  /// \return the layer's Gradients.
  template <class DX, class DdY>
  auto backward(const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DdY>& dY) const {
    static_assert(
        std::is_same_v<typename DX::Scalar, Scalar> && std::is_same_v<typename DdY::Scalar, Scalar>,
        "linattn: the input's and dY's scalar type must be the layer's");
    const Index offsets[2] = {0, X.rows()};
    return self().backward_impl(Derived::kBackwardName, X, detail::OffsetsRef(offsets, 2), dY,
                                nullptr, nullptr);
  }

  /// The gradients through forward(X, offsets, states) of B new packed sequences (rows
  /// [offsets[b], offsets[b+1]) are sequence b, each from a zero state): a training batch,
  /// the parameters' gradients summed over the sequences.
  /// \throws std::invalid_argument as backward(X, dY), or on offsets that are not
  /// non-decreasing from 0 to N.
  /// \param X the packed N x d input rows.
  /// \param offsets B + 1 offsets (std::vector or Eigen vector of any integer type).
  /// \param dY N x d gradient of the loss with respect to the output.
  /// \return the layer's Gradients.
  template <class DX, class Off, class DdY>
  auto backward(const Eigen::MatrixBase<DX>& X, const Off& offsets,
                const Eigen::MatrixBase<DdY>& dY) const {
    static_assert(
        std::is_same_v<typename DX::Scalar, Scalar> && std::is_same_v<typename DdY::Scalar, Scalar>,
        "linattn: the input's and dY's scalar type must be the layer's");
    const char* fn = Derived::kBackwardName;
    const auto off = detail::offsets_of(fn, "offsets", offsets);
    detail::check_offsets(fn, "offsets", off, X.rows());
    return self().backward_impl(fn, X, off, dY, nullptr, nullptr);
  }

  /// The gradients through forward(X, state) of one sequence continuing `state` (a segment of
  /// a long document in truncated backpropagation through time, or a continued prefix): those
  /// of backward(X, dY), and in `dstates[0]` the gradient with respect to `state` (its
  /// convolution state's and every head's). `dfinal` is the gradient with respect to the state
  /// the forward left, from the backward of the segment that continued it (empty parts, or
  /// none: zeros, the last segment), so that segments run last to first chain into the
  /// gradients of one call over all of them. The forward pass is computed again inside from
  /// `state`, which is not changed.
  /// \throws std::invalid_argument as forward(X, state) and backward(X, dY), naming the
  /// function and both shapes on a state or dfinal part of another shape.
  /// \code
  /// auto s1 = layer.make_state();                   // truncated BPTT over X = [X1; X2]
  /// const auto s0 = s1;
  /// layer.forward(X1, s1);                          // s1: the state after segment 1
  /// auto g2 = layer.backward(X2, s1, dY2);          // segment 2 from s1
  /// auto g1 = layer.backward(X1, s0, dY1, g2.dstates[0]);  // its gradient flows into 1
  /// layer.out_proj -= lr * (g1.out_proj + g2.out_proj);
  /// \endcode
  /// \param X N x d input rows.
  /// \param state the state the forward started from.
  /// \param dY N x d gradient of the loss with respect to the output.
  /// \param dfinal the gradient of the loss with respect to the state the forward left.
  /// \return the layer's Gradients, dstates holding one DeltaLayerStateGradient.
  template <class DX, class DdY>
  auto backward(const Eigen::MatrixBase<DX>& X, const DeltaLayerState<Scalar>& state,
                const Eigen::MatrixBase<DdY>& dY,
                const DeltaLayerStateGradient<Scalar>& dfinal = {}) const {
    static_assert(
        std::is_same_v<typename DX::Scalar, Scalar> && std::is_same_v<typename DdY::Scalar, Scalar>,
        "linattn: the input's and dY's scalar type must be the layer's");
    const Index offsets[2] = {0, X.rows()};
    const std::vector<DeltaLayerState<Scalar>> states(1, state);
    const std::vector<DeltaLayerStateGradient<Scalar>> dfinals(1, dfinal);
    return self().backward_impl(Derived::kBackwardName, X, detail::OffsetsRef(offsets, 2), dY,
                                &states, &dfinals);
  }

  /// The gradients through forward(X, offsets, states) of B packed sequences, each continuing
  /// states[b] (an empty vector: B new sequences): those of backward(X, offsets, dY), and in
  /// `dstates[b]` the gradient with respect to states[b]. dfinal holds the gradients with
  /// respect to the states the forward left (an empty vector, or empty parts: zeros).
  /// \throws std::invalid_argument as backward(X, state, dY), or on offsets that are not
  /// non-decreasing from 0 to N, or states or dfinal not holding B entries.
  /// \param X the packed N x d input rows.
  /// \param offsets B + 1 offsets (std::vector or Eigen vector of any integer type).
  /// \param states the B states the forward started from, or an empty vector.
  /// \param dY N x d gradient of the loss with respect to the output.
  /// \param dfinal B gradients with respect to the states the forward left, or an empty vector.
  /// \return the layer's Gradients, dstates holding B DeltaLayerStateGradients.
  template <class DX, class Off, class DdY>
  auto backward(const Eigen::MatrixBase<DX>& X, const Off& offsets,
                const std::vector<DeltaLayerState<Scalar>>& states,
                const Eigen::MatrixBase<DdY>& dY,
                const std::vector<DeltaLayerStateGradient<Scalar>>& dfinal = {}) const {
    static_assert(
        std::is_same_v<typename DX::Scalar, Scalar> && std::is_same_v<typename DdY::Scalar, Scalar>,
        "linattn: the input's and dY's scalar type must be the layer's");
    const char* fn = Derived::kBackwardName;
    const auto off = detail::offsets_of(fn, "offsets", offsets);
    detail::check_offsets(fn, "offsets", off, X.rows());
    if (!states.empty()) return self().backward_impl(fn, X, off, dY, &states, &dfinal);
    const std::vector<DeltaLayerState<Scalar>> zeros(off.size() - 1);
    return self().backward_impl(fn, X, off, dY, &zeros, &dfinal);
  }

 protected:
  ~DeltaLayerForward() = default;

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }
};

template <class Scalar>
class GatedDeltaNetLayer;
template <class Scalar>
class KimiDeltaAttentionLayer;

/// \brief B sequences of a delta-rule layer decoded together (spelled `Layer::BatchedState`,
/// from the layer's make_batched_state()): their convolution states, their H·B delta-rule heads
/// in a BatchedRecurrentDeltaRule (decoder()), and the buffers of a step, reused: once they hold
/// B rows, the layer's step() allocates nothing. Sequence b owns row b of every step's input
/// and output; the layer's extend() feeds several tokens of some of the sequences.
///
/// A server verifying draft tokens calls keep_snapshots(K) once, then after each extend()
/// rollback(b, accepted) for every sequence: its whole layer state (convolution, heads,
/// position) becomes the one after its first `accepted` tokens of that call. Change the
/// sequences through the layer and this object, not through decoder(), whose own rollback
/// points this object mirrors. save_state() / load_state() (serving/state_io_layers.hpp) park
/// and resume every sequence bit for bit.
/// \tparam Scalar float or double
/// \tparam Buffers the layer's per-step intermediate rows (internal)
template <class Scalar, class Buffers>
class DeltaLayerBatchedState {
 public:
  /// The delta-rule decoder of the sequences' heads (its keep_snapshots(), rollback() and
  /// save_state() act on the recurrent part alone).
  using Decoder = BatchedRecurrentDeltaRule<L2Normalize<>, Scalar>;
  /// One sequence's state, as the layer's forward() carries it.
  using State = DeltaLayerState<Scalar>;

  /// B, the number of sequences.
  /// \return the sequences.
  Index sequences() const noexcept { return dec_.sequences(); }

  /// A new sequence at the end (zero state), numbered sequences() − 1.
  /// \return its number.
  Index add_sequence() {
    const Index b = dec_.add_sequence();
    conv_.emplace_back();
    if (keep_ > 0) {
      windows_.emplace_back(window_rows(), conv_dim_);
      calls_.emplace_back();
    }
    return b;
  }

  /// Removes sequence b; the last sequence takes its number (as the decoder's).
  /// \throws std::invalid_argument if b is out of range.
  /// \param b the sequence to remove.
  void remove_sequence(Index b) {
    dec_.remove_sequence(b);  // checks b first
    const auto i = static_cast<std::size_t>(b);
    conv_[i] = std::move(conv_.back());
    conv_.pop_back();
    if (keep_ > 0) {
      windows_[i].swap(windows_.back());
      calls_[i] = calls_.back();
      windows_.pop_back();
      calls_.pop_back();
    }
  }

  /// Sequence b's state (a copy), as the layer's forward() carries it.
  /// \param b the sequence.
  /// \return its convolution and head states.
  State state(Index b) const {
    State st;
    st.conv = conv_.at(static_cast<std::size_t>(b));
    for (Index h = 0; h < dec_.heads(); ++h) st.heads.push_back(dec_.state(b, h));
    st.position = dec_.position(b);
    return st;
  }

  /// Makes `state` (a prefill's, from the layer's forward()) sequence b's.
  /// \throws std::invalid_argument if b is out of range or a part has another shape; nothing
  /// changes then.
  /// \param b the sequence.
  /// \param state its convolution and head states (empty parts: zeros).
  void set_state(Index b, const State& state) {
    const std::string where = std::string(layer_) + "::BatchedState::set_state";
    const char* fn = where.c_str();
    if (b < 0 || b >= sequences())
      detail::throw_invalid(fn, "sequence " + std::to_string(b) + " is out of range [0, " +
                                    std::to_string(sequences()) + ")");
    if (state.conv.size() != 0 && (state.conv.rows() != w_ - 1 || state.conv.cols() != conv_dim_))
      detail::throw_invalid(fn, "conv is " + detail::shape_of(state.conv) + " but must be " +
                                    std::to_string(w_ - 1) + " x " + std::to_string(conv_dim_));
    if (!state.heads.empty() && static_cast<Index>(state.heads.size()) != dec_.heads())
      detail::throw_invalid(fn, "heads holds " + std::to_string(state.heads.size()) +
                                    " states but the layer has " + std::to_string(dec_.heads()));
    if (!state.heads.empty())  // a dry run on copies of single heads: nothing moves on a throw
      for (Index h = 0; h < dec_.heads(); ++h) {
        typename Decoder::Decoder one = dec_.decoder(b, h);
        one.set_state(state.heads[static_cast<std::size_t>(h)], state.position);
      }
    if (state.heads.empty())
      dec_.reset(b);
    else
      for (Index h = 0; h < dec_.heads(); ++h)
        dec_.set_state(b, h, state.heads[static_cast<std::size_t>(h)], state.position);
    conv_[static_cast<std::size_t>(b)] = state.conv;
    forget_call(b);
  }

  /// Keeps, from now on, the rollback points of every sequence in each of the layer's extend()
  /// calls: the layer state after each of its last `count` tokens (the heads' through the
  /// decoder's keep_snapshots(); the convolution's as the last count + W − 2 convolution
  /// inputs, from which its W − 1 rows after any of those tokens are read). O(count·(H·F·M +
  /// C)) per sequence, allocated here and when sequences are added; 0 keeps none. A step()
  /// keeps none: one token has nothing to undo.
  /// \throws std::invalid_argument if count < 0.
  /// \code
  /// auto batch = layer.make_batched_state(8);
  /// batch.keep_snapshots(5);  // verify 1 + 4 draft tokens a sequence
  /// \endcode
  /// \param count K, the rollback points kept per sequence and call.
  void keep_snapshots(Index count) {
    if (count < 0)
      detail::throw_invalid(name("keep_snapshots").c_str(),
                            "count must be >= 0, got " + std::to_string(count));
    dec_.keep_snapshots(count);
    keep_ = count;
    windows_.assign(count > 0 ? conv_.size() : 0, ShortConvState<Scalar>(window_rows(), conv_dim_));
    calls_.assign(count > 0 ? conv_.size() : 0, Call{});
  }

  /// The rollback points the last extend() of sequence b kept (0 after a step(), set_state(),
  /// a load, or a rollback to the end of the call).
  /// \throws std::invalid_argument if b is out of range.
  /// \param b the sequence.
  /// \return min(K, the call's tokens for b), less what a rollback() dropped.
  Index snapshots(Index b) const {
    check_sequence("snapshots", b);
    return keep_ > 0 ? calls_[static_cast<std::size_t>(b)].kept : 0;
  }

  /// Sets sequence b back to its layer state after the first `accepted` tokens of its last
  /// extend() call (the accepted prefix of a verified draft): the convolution state, every
  /// head and position(), exactly (bit for bit) as if only those tokens had been fed. In O(H +
  /// W·C), allocation-free. `accepted` must be one the call kept: from T − snapshots(b) + 1 to
  /// T, T the call's tokens for b (T: nothing to undo); 0 is never one (as in the decoder: the
  /// first token of a verification is the target model's own).
  /// \throws std::invalid_argument naming b, the range and `accepted` for a sequence out of
  /// range or another `accepted` (no snapshots kept, a step() since, out of range); nothing
  /// changes then.
  /// \code
  /// batch.keep_snapshots(5);
  /// layer.extend(X, slots, cu_seqlens, batch, Y);  // 1 + 4 draft tokens a sequence
  /// batch.rollback(slots(0), accepted + 1);          // keep the accepted drafts and the first
  /// \endcode
  /// \param b the sequence.
  /// \param accepted the tokens of its last call to keep.
  void rollback(Index b, Index accepted) {
    check_sequence("rollback", b);
    const Call c = keep_ > 0 ? calls_[static_cast<std::size_t>(b)] : Call{};
    const Index first = c.tokens - c.kept + 1;
    if (c.kept == 0 || accepted < first || accepted > c.tokens)
      detail::throw_invalid(
          name("rollback").c_str(),
          "sequence " + std::to_string(b) + " can be set back to " +
              (c.kept == 0 ? std::string("no token (no snapshot kept)")
                           : std::to_string(first) + " ... " + std::to_string(c.tokens) +
                                 " tokens of its last extend()") +
              ", got accepted = " + std::to_string(accepted));
    if (accepted == c.tokens) return;
    dec_.rollback(b, accepted);  // the same range: it moves the heads or throws, first
    const auto i = static_cast<std::size_t>(b);
    if (w_ > 1) conv_[i] = windows_[i].middleRows(accepted - first, w_ - 1);
    calls_[i].kept = accepted - first + 1;  // the snapshots past the new end are gone
    calls_[i].tokens = accepted;
  }

  /// d, the width of the layer's input and output rows.
  /// \return d.
  Index hidden_size() const noexcept { return d_; }
  /// W, the short convolution's width (a convolution state holds W − 1 rows).
  /// \return W.
  Index conv_kernel_size() const noexcept { return w_; }
  /// C, the convolved channels (q | k | v) of a convolution state.
  /// \return C.
  Index conv_channels() const noexcept { return conv_dim_; }

  /// The delta-rule heads of every sequence.
  /// \return the decoder.
  Decoder& decoder() noexcept { return dec_; }
  /// \copydoc decoder()
  const Decoder& decoder() const noexcept { return dec_; }

  /// The sequences' convolution states (empty: zeros).
  /// \return one per sequence.
  const std::vector<ShortConvState<Scalar>>& conv_states() const noexcept { return conv_; }

 private:
  friend class GatedDeltaNetLayer<Scalar>;
  friend class KimiDeltaAttentionLayer<Scalar>;
  friend struct detail::RecurrentStateAccess;  // serving/state_io_layers.hpp: load_state()

  template <class Sizes>
  DeltaLayerBatchedState(const char* layer, const Sizes& s, Index sequences, Decoder dec)
      : conv_(static_cast<std::size_t>(sequences)),
        dec_(std::move(dec)),
        layer_(layer),
        d_(s.d),
        w_(s.w),
        conv_dim_(s.conv_dim()),
        x_(sequences, s.d),
        y_(sequences, s.d) {
    buf_.reserve(s, sequences);
  }

  // The checks of a step before anything moves (Xb's shape and entries, Yb's shape, a state of
  // this layer's shape), then Xb into x_: Yb may be Xb's memory.
  template <class Sizes, class DX, class DY>
  void begin_step(const char* fn, const Sizes& s, const Eigen::MatrixBase<DX>& Xb,
                  const Eigen::MatrixBase<DY>& Yb) {
    const Index B = sequences();
    if (Xb.rows() != B || Xb.cols() != s.d)
      detail::throw_invalid(fn, "Xb is " + detail::shape_of(Xb) + " but must be " +
                                    std::to_string(B) + " x " + std::to_string(s.d) +
                                    " (B sequences x hidden_size)");
    detail::check_output(fn, Yb, B, s.d);
    if (d_ != s.d || w_ != s.w || conv_dim_ != s.conv_dim() || dec_.heads() != s.heads() ||
        dec_.key_dim() != s.dk || dec_.value_dim() != s.dv)
      detail::throw_invalid(fn, "the batched state was made by a layer of another shape");
    detail::check_finite_entries(fn, "Xb", Xb);
    buf_.reserve(s, B);
    if (x_.rows() < B) x_.resize(B, s.d), y_.resize(B, s.d);
    x_.topRows(B) = Xb;
  }

  template <class DY>
  void end_step(const Eigen::MatrixBase<DY>& Yb) {
    detail::writable(Yb) = y_.topRows(sequences());
    for (auto& c : calls_) c = Call{};  // the decoder's step() forgets its rollback points too
  }

  // The checks of an extend() before anything moves (X's and Y's shapes, X's entries, the
  // slots, the offsets, a state of this layer's shape), then X into x_: Y may be X's memory.
  template <class Sizes, class DX, class DSlots, class DY>
  void begin_extend(const char* fn, const Sizes& s, const Eigen::MatrixBase<DX>& X,
                    const Eigen::DenseBase<DSlots>& slots, detail::OffsetsRef off,
                    const Eigen::MatrixBase<DY>& Y) {
    const Index N = X.rows();
    if (X.cols() != s.d)
      detail::throw_invalid(fn, "X is " + detail::shape_of(X) + " but must have hidden_size = " +
                                    std::to_string(s.d) + " columns (one row per token)");
    detail::check_output(fn, Y, N, s.d);
    if (d_ != s.d || w_ != s.w || conv_dim_ != s.conv_dim() || dec_.heads() != s.heads() ||
        dec_.key_dim() != s.dk || dec_.value_dim() != s.dv)
      detail::throw_invalid(fn, "the batched state was made by a layer of another shape");
    dec_.check_slots(fn, slots);
    if (static_cast<Index>(off.size()) != slots.size() + 1)
      detail::throw_invalid(fn, "offsets has " + std::to_string(off.size()) +
                                    " entries but slots has " + std::to_string(slots.size()) +
                                    ": one more offset than slots is needed");
    detail::check_offsets(fn, "offsets", off, N);
    detail::check_finite_entries(fn, "X", X);
    buf_.reserve(s, N);
    if (x_.rows() < N) x_.resize(N, s.d), y_.resize(N, s.d);
    x_.topRows(N) = X;
  }

  // The convolution of an extend() (its inputs in buf_.mixed, its outputs to buf_.c): sequence
  // slots(i) over rows [off[i], off[i+1]), first keeping what its rollback points need.
  template <class DW, class DSlots>
  void extend_conv(const Eigen::MatrixBase<DW>& weight, const Eigen::DenseBase<DSlots>& slots,
                   detail::OffsetsRef off, const ParallelOptions& par) {
    const Index L = w_ - 1;
    const auto seq = [&](Index i) {
      return static_cast<std::size_t>(detail::layer_slot(slots, i));
    };
    for (Index i = 0; i < slots.size(); ++i) {
      const std::size_t b = seq(i);
      const Index r0 = off[std::size_t(i)], n = off[std::size_t(i) + 1] - r0;
      auto& st = conv_[b];
      if (st.size() == 0 && L > 0) st.setZero(L, conv_dim_);
      if (keep_ > 0) {
        Call& c = calls_[b];
        c.tokens = n;
        c.kept = std::min(keep_, n);
        detail::keep_conv_window(st, L, buf_.mixed, r0, n, c.kept > 0 ? c.kept + L - 1 : 0,
                                 windows_[b]);
      }
    }
    const detail::ConvTaps<Scalar> k =
        detail::conv_taps<Scalar>(weight.derived(), Vector<Scalar>(), true, ws_, 0);
    const Index N = off[std::size_t(slots.size())];
    detail::conv_channel_split(
        conv_dim_, detail::conv_work(N, conv_dim_, w_, true), par, [&](Index c0, Index c1) {
          for (Index i = 0; i < slots.size(); ++i) {
            const Index r0 = off[std::size_t(i)], n = off[std::size_t(i) + 1] - r0;
            detail::conv_extend_rows(k, buf_.mixed, r0, n, conv_[seq(i)], buf_.c, c0, c1);
          }
        });
    for (Index i = 0; i < slots.size(); ++i) {
      const Index r0 = off[std::size_t(i)], n = off[std::size_t(i) + 1] - r0;
      detail::conv_next_state(buf_.mixed.middleRows(r0, n), conv_[seq(i)], L);
    }
  }

  template <class DY>
  void end_extend(const Eigen::MatrixBase<DY>& Y) {
    detail::writable(Y) = y_.topRows(Y.rows());
  }

  // A call's record for rollback(): its tokens and the rollback points kept.
  struct Call {
    Index tokens = 0, kept = 0;
  };

  std::string name(const char* member) const {
    return std::string(layer_) + "::BatchedState::" + member;
  }
  void check_sequence(const char* member, Index b) const {
    if (b < 0 || b >= sequences())
      detail::throw_invalid(name(member).c_str(), "sequence " + std::to_string(b) +
                                                      " is out of range [0, " +
                                                      std::to_string(sequences()) + ")");
  }
  // The convolution inputs a sequence keeps: the state after the first of K kept tokens reads
  // W − 2 inputs before it.
  Index window_rows() const noexcept { return keep_ > 0 ? keep_ + w_ - 2 : 0; }
  void forget_call(Index b) {
    if (keep_ > 0) calls_[static_cast<std::size_t>(b)] = Call{};
  }
  // After a load: no sequence has a rollback point (the decoder's are dropped as well).
  void forget_calls() {
    dec_.keep_snapshots(keep_);
    for (auto& c : calls_) c = Call{};
  }

  using Rows = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  std::vector<ShortConvState<Scalar>> conv_;
  Decoder dec_;
  const char* layer_;
  Index d_, w_, conv_dim_;
  Buffers buf_;
  Rows x_, y_;
  Workspace<Scalar> ws_;
  Index keep_ = 0;
  std::vector<ShortConvState<Scalar>> windows_;  // per sequence when keep_ > 0
  std::vector<Call> calls_;                      // per sequence when keep_ > 0
};

}  // namespace linattn
