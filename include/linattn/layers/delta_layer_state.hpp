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
    static_assert(std::is_same_v<typename DX::Scalar, Scalar> &&
                      std::is_same_v<typename DdY::Scalar, Scalar>,
                  "linattn: the input's and dY's scalar type must be the layer's");
    const Index offsets[2] = {0, X.rows()};
    return self().backward_impl(Derived::kBackwardName, X, detail::OffsetsRef(offsets, 2), dY);
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
    static_assert(std::is_same_v<typename DX::Scalar, Scalar> &&
                      std::is_same_v<typename DdY::Scalar, Scalar>,
                  "linattn: the input's and dY's scalar type must be the layer's");
    const char* fn = Derived::kBackwardName;
    const auto off = detail::offsets_of(fn, "offsets", offsets);
    detail::check_offsets(fn, "offsets", off, X.rows());
    return self().backward_impl(fn, X, off, dY);
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
/// and output.
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
    conv_.emplace_back();
    return dec_.add_sequence();
  }

  /// Removes sequence b; the last sequence takes its number (as the decoder's).
  /// \throws std::invalid_argument if b is out of range.
  /// \param b the sequence to remove.
  void remove_sequence(Index b) {
    dec_.remove_sequence(b);  // checks b first
    conv_[static_cast<std::size_t>(b)] = std::move(conv_.back());
    conv_.pop_back();
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
  }

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
  }

  using Rows = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  std::vector<ShortConvState<Scalar>> conv_;
  Decoder dec_;
  const char* layer_;
  Index d_, w_, conv_dim_;
  Buffers buf_;
  Rows x_, y_;
  Workspace<Scalar> ws_;
};

}  // namespace linattn
