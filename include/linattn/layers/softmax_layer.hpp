/// \file layers/softmax_layer.hpp
/// \brief SoftmaxAttentionLayer: the softmax counterpart of LinearAttentionLayer, with a KV
/// cache as its state of generation.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "batched_layer.hpp"
#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../maps/elu_plus_one.hpp"
#include "../linear/linear_attention_backward.hpp"
#include "../linear/multihead.hpp"
#include "../linear/multihead_backward.hpp"
#include "../linear/recurrent_linear_attention.hpp"
#include "../softmax/multihead_softmax.hpp"
#include "../softmax/softmax_attention.hpp"
#include "../softmax/softmax_attention_backward.hpp"
#include "../maps/map_state.hpp"
#include "../core/gradients.hpp"
#include "detail/projections.hpp"

namespace linattn {

template <class Scalar>
class SoftmaxAttentionLayer;

/// \brief The KV cache of one sequence of a SoftmaxAttentionLayer<Scalar>, spelled
/// `SoftmaxAttentionLayer<Scalar>::State` (make_state()): every head's keys and values so far
/// (one row per token), and the buffers a step works in. Copy it to fork a sequence.
///
/// save_state(os, state) and load_state(is, state) (state_io.hpp) write the cached rows and
/// restore them exactly: a decode resumed from the file continues bit for bit (spec §8).
template <class Scalar>
class SoftmaxAttentionLayerState {
 public:
  /// Tokens consumed (prefill and steps).
  /// \return the tokens the cache holds.
  Index position() const noexcept { return length_; }
  /// Tokens the cache holds without growing.
  /// \return the tokens it holds before it grows.
  Index capacity() const noexcept { return keys_.rows(); }
  /// The cached keys (position() x H·D) and values (position() x H·M).
  /// \return a position() x H·D view of the cache, valid until the next step.
  auto keys() const { return keys_.topRows(length_); }
  /// The cached values, as keys() holds the keys.
  /// \return a position() x H·M view of the cache, valid until the next step.
  auto values() const { return values_.topRows(length_); }

 private:
  friend class SoftmaxAttentionLayer<Scalar>;
  friend struct detail::RecurrentStateAccess;  // state_io.hpp: restores the cache
  using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  SoftmaxAttentionLayerState(const SoftmaxAttentionLayer<Scalar>& layer, Index capacity)
      : keys_(capacity, layer.num_heads() * layer.key_dim()),
        values_(capacity, layer.num_heads() * layer.value_dim()),
        scores_(capacity),
        buf_(layer.d_model(), layer.num_heads(), layer.key_dim(), layer.value_dim()),
        heads_(layer.num_heads()) {}

  // Room for n more tokens (doubling). Everything is allocated before anything moves: a
  // failed allocation leaves the cache as it was.
  void reserve_more(Index n) {
    const Index need = length_ + n;
    if (need <= keys_.rows()) return;
    const Index cap = std::max(need, 2 * keys_.rows());
    RowMatrix keys(cap, keys_.cols()), values(cap, values_.cols());
    Vector<Scalar> scores(cap);
    keys.topRows(length_) = keys_.topRows(length_);
    values.topRows(length_) = values_.topRows(length_);
    keys_.swap(keys);
    values_.swap(values);
    scores_.swap(scores);
  }

  RowMatrix keys_, values_;  // token-major: appending a token writes one contiguous row
  Vector<Scalar> scores_;
  detail::TokenBuffers<Scalar> buf_;
  Index heads_;
  Index length_ = 0;
};

/// \brief The softmax counterpart of LinearAttentionLayer, with the same interface: the same
/// parameters and projections, softmax attention (scores scaled by 1/√D) in every head, and a
/// KV cache as the state of generation. Switching a model between the two is a change of type.
///
/// A step at position t attends over the t + 1 cached keys: its cost grows with t, against the
/// constant cost of LinearAttentionLayer::step(). The cache grows by doubling (amortised
/// O(1) allocations); make_state(capacity) reserves it, and steps within the capacity allocate
/// nothing. save_state() / load_state() (state_io.hpp) save the cache and resume it bit for bit.
///
/// \code
/// linattn::SoftmaxAttentionLayer<float> layer(256, 8);
/// auto state = layer.make_state(1024);   // room for 1024 tokens
/// Eigen::MatrixXf P = layer.forward(prompt, state);
/// Eigen::VectorXf y(256);
/// layer.step(x, state, y);
/// \endcode
template <class Scalar = float>
class SoftmaxAttentionLayer : public detail::AttentionProjections<Scalar> {
  using Base = detail::AttentionProjections<Scalar>;

 public:
  /// \brief The KV cache of one sequence (SoftmaxAttentionLayerState): every head's keys and
  /// values so far. Saved and restored exactly by save_state() / load_state().
  using State = SoftmaxAttentionLayerState<Scalar>;

  /// H = num_heads heads of key and value size d_model / num_heads.
  /// \throws std::invalid_argument unless d_model is a positive multiple of num_heads.
  /// \param d_model the width of the layer's input and output rows.
  /// \param num_heads H, the number of heads (each D = M = d_model / H unless given).
  SoftmaxAttentionLayer(Index d_model, Index num_heads)
      : SoftmaxAttentionLayer(d_model, num_heads,
                              Base::head_size("SoftmaxAttentionLayer", d_model, num_heads),
                              Base::head_size("SoftmaxAttentionLayer", d_model, num_heads)) {}

  /// Heads of key size key_dim and value size value_dim.
  /// \param d_model the width of the layer's input and output rows.
  /// \param num_heads H, the number of heads (each D = M = d_model / H unless given).
  /// \param key_dim D, the width of each head's queries and keys.
  /// \param value_dim M, the width of each head's values.
  SoftmaxAttentionLayer(Index d_model, Index num_heads, Index key_dim, Index value_dim)
      : Base("SoftmaxAttentionLayer", d_model, num_heads, key_dim, value_dim) {}

  /// Y (N x d_model) for the rows of X, causal or not (see LinearAttentionLayer::forward()).
  /// \param X N x d_model input rows, one per token.
  /// \param causal true when row i attends to rows j <= i only (a decoder), false for all rows.
  /// \return Y, N x d_model.
  template <class DX>
  Matrix<Scalar> forward(const Eigen::MatrixBase<DX>& X, bool causal) const {
    return this->forward_with("SoftmaxAttentionLayer::forward", X, attention(causal));
  }

  /// Causal forward that appends the rows of X to the cache (a prefill) and returns their
  /// outputs; step() goes on from there. From an empty cache the rows run through the tiled
  /// multi-head causal kernel; after earlier tokens, each row attends over the cache as a
  /// step would. On an exception `state` is unchanged.
  /// \param X N x d_model input rows, one per token.
  /// \param state the state to continue from, moved past the N rows.
  /// \return Y, N x d_model.
  template <class DX>
  Matrix<Scalar> forward(const Eigen::MatrixBase<DX>& X, State& state) const {
    constexpr const char* fn = "SoftmaxAttentionLayer::forward";
    check_state(fn, state);
    Matrix<Scalar> Q, K, V;
    this->prefill_in(fn, X, Q, K, V);
    const Index N = X.rows(), t0 = state.length_;
    // The new rows go past the cached ones and count only once every output is computed: on an
    // exception the cache holds what it held (perhaps with more capacity).
    state.reserve_more(N);
    state.keys_.middleRows(t0, N) = K;
    state.values_.middleRows(t0, N) = V;
    Matrix<Scalar> A(N, this->num_heads() * this->value_dim());
    if (t0 == 0) {
      A = multihead_causal_softmax_attention(Q, K, V, this->num_heads());
    } else {
      auto& b = state.buf_;
      for (Index i = 0; i < N; ++i) {
        b.q = Q.row(i).transpose();
        attend_cache(state, t0 + i + 1);
        A.row(i) = b.o.transpose();
      }
    }
    Matrix<Scalar> Y = this->output(A);
    state.length_ = t0 + N;
    return Y;
  }

  /// A state with an empty cache that holds `capacity` tokens before it grows.
  /// \param capacity the tokens the cache holds before it grows (growth allocates).
  /// \return a state at position 0.
  State make_state(Index capacity = 0) const {
    if (capacity < 0)
      detail::throw_invalid("SoftmaxAttentionLayer::make_state",
                            "capacity must be >= 0, got " + std::to_string(capacity));
    return State(*this, capacity);
  }

  /// One token (see LinearAttentionLayer::step()); allocates nothing while the cache has room
  /// (make_state(capacity)), else grows it.
  /// \param x the token's d_model input row.
  /// \param state the state to continue from, moved on by the token.
  /// \param y receives the token's d_model output row.
  template <class DXv, class DYv>
  void step(const Eigen::MatrixBase<DXv>& x, State& state, const Eigen::MatrixBase<DYv>& y) const {
    constexpr const char* fn = "SoftmaxAttentionLayer::step";
    check_state(fn, state);
    auto& b = state.buf_;
    this->step_in(fn, x, y, b);
    state.reserve_more(1);
    state.keys_.row(state.length_) = b.k.transpose();
    state.values_.row(state.length_) = b.v.transpose();
    ++state.length_;
    attend_cache(state, state.length_);
    this->step_out(b, y);
  }

  /// The gradients of a loss with respect to X and every parameter (see
  /// LinearAttentionLayer::backward()); the attention's are the tiled softmax backward's.
  /// \param X N x d_model input rows, one per token.
  /// \param dY the N x d_model gradient of the loss with respect to the output.
  /// \param causal true when row i attends to rows j <= i only (a decoder), false for all rows.
  /// \return the gradients with respect to X and to every weight and bias.
  template <class DX, class DY>
  LayerGradients<Scalar> backward(const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DY>& dY,
                                  bool causal) const {
    const Index H = this->num_heads();
    return this->backward_with(
        "SoftmaxAttentionLayer::backward", X, dY, attention(causal),
        [&](const Matrix<Scalar>& Q, const Matrix<Scalar>& K, const Matrix<Scalar>& V,
            const Matrix<Scalar>& dA) {
          return causal ? multihead_causal_softmax_attention_backward(Q, K, V, dA, H)
                        : multihead_softmax_attention_backward(Q, K, V, dA, H);
        });
  }


 private:
  // The heads' attention, (Q, K, V) -> N x H·M.
  auto attention(bool causal) const {
    return [this, causal](const Matrix<Scalar>& Q, const Matrix<Scalar>& K,
                          const Matrix<Scalar>& V) -> Matrix<Scalar> {
      return causal ? multihead_causal_softmax_attention(Q, K, V, this->num_heads())
                    : multihead_softmax_attention(Q, K, V, this->num_heads());
    };
  }

  // buf_.o = every head's softmax attention of buf_.q over the first `length` cached tokens.
  void attend_cache(State& state, Index length) const {
    const Vector<Scalar>& q = state.buf_.q;
    Vector<Scalar>& o = state.buf_.o;
    const Index D = this->key_dim(), M = this->value_dim();
    const Scalar scale = Scalar(1) / std::sqrt(Scalar(D));
    auto s = state.scores_.head(length);
    for (Index h = 0; h < this->num_heads(); ++h) {
      s.noalias() = state.keys_.block(0, h * D, length, D) * q.segment(h * D, D);
      s *= scale;
      const Scalar m = s.maxCoeff();
      s = (s.array() - m).exp().matrix();
      const Scalar total = s.sum();  // >= 1: the largest score contributes e^0
      o.segment(h * M, M).noalias() = state.values_.block(0, h * M, length, M).transpose() * s;
      o.segment(h * M, M) /= total;
    }
  }

  void check_state(const char* fn, const State& state) const {
    if (state.heads_ != this->num_heads() ||
        state.keys_.cols() != this->num_heads() * this->key_dim() ||
        state.values_.cols() != this->num_heads() * this->value_dim() ||
        state.buf_.x.size() != this->d_model())
      detail::throw_invalid(fn, "the state was made by a layer of another shape");
  }
};

}  // namespace linattn
