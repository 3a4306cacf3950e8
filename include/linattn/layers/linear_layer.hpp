/// \file layers/linear_layer.hpp
/// \brief LinearAttentionLayer: multi-head linear attention with the projections of
/// `torch.nn.MultiheadAttention`-style models, and its recurrent state for generation.
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
#include "../softmax/softmax_attention.hpp"
#include "../softmax/softmax_attention_backward.hpp"
#include "../maps/map_state.hpp"
#include "../core/gradients.hpp"
#include "detail/projections.hpp"

namespace linattn {

template <class Phi, class Scalar>
class LinearAttentionLayer;

/// \brief The per-sequence state of generation of a LinearAttentionLayer<Phi, Scalar>, spelled
/// `LinearAttentionLayer<Phi, Scalar>::State` (make_state()): one linear attention state per
/// head, and the buffers a step works in. Copy it to fork a sequence (beam search).
///
/// save_state(os, state) and load_state(is, state) (state_io.hpp) write and restore it
/// exactly: a decode resumed from the file continues bit for bit (spec §8).
template <class Phi, class Scalar>
class LinearAttentionLayerState {
 public:
  /// Tokens consumed (prefill and steps): the heads' position (head 0's; step() and forward()
  /// move every head together).
  /// \return the tokens every head has consumed.
  Index position() const noexcept { return rnn_.head(0).position(); }

  /// The heads' recurrent forms (their states: heads().head(h).state()).
  /// \return the heads, one recurrent form each.
  const MultiHeadRecurrentLinearAttention<Phi, Scalar>& heads() const noexcept { return rnn_; }

  /// \brief The heads, to set them: `heads().head(h).set_state(st, position)` for every head h
  /// (states computed elsewhere), or load_state(is, heads()) of a multi-head file. position()
  /// is head 0's position, so set every head to the same one. Keep the heads' shapes: the
  /// layer's step() and forward() refuse a state whose H, D or M are not its own.
  /// \code
  /// auto state = layer.make_state();
  /// for (Index h = 0; h < layer.num_heads(); ++h)
  ///   state.heads().head(h).set_state(prefilled[h], prompt_length);
  /// layer.step(x, state, y);  // continues at position prompt_length
  /// \endcode
  /// \return the heads, one recurrent form each.
  MultiHeadRecurrentLinearAttention<Phi, Scalar>& heads() noexcept { return rnn_; }

 private:
  friend class LinearAttentionLayer<Phi, Scalar>;
  explicit LinearAttentionLayerState(const LinearAttentionLayer<Phi, Scalar>& layer)
      : rnn_(layer.num_heads(), layer.key_dim(), layer.value_dim(), layer.feature_map()),
        buf_(layer.d_model(), layer.num_heads(), layer.key_dim(), layer.value_dim()) {}

  MultiHeadRecurrentLinearAttention<Phi, Scalar> rnn_;
  detail::TokenBuffers<Scalar> buf_;
};

/// \brief A multi-head linear attention layer (spec §6): projections in the layout of
/// `torch.nn.Linear`, H heads of linear attention with the feature map `Phi`, an output
/// projection. Parallel over a whole sequence (forward()), recurrent for generation (step()),
/// and differentiable (backward()).
///
/// \f[ Q = X W_q^\top + b_q,\quad K = X W_k^\top + b_k,\quad V = X W_v^\top + b_v,\quad
///     Y = \mathrm{concat}_h\big(\mathrm{attn}(Q_h, K_h, V_h)\big) W_o^\top + b_o \f]
///
/// Weights are public members (Wq, Wk, Wv, Wo: out x in, as `torch.nn.Linear::weight`, so that a
/// PyTorch state dict loads as it is; biases bq, bk, bv, bo), drawn as `torch.nn.Linear` draws
/// them at construction (reset_parameters()), biases zero. Generation keeps one O(F·M) state
/// per head (make_state()); a step costs the same at any position and allocates nothing.
/// save_state() / load_state() (state_io.hpp) save a state and resume it bit for bit.
/// SoftmaxAttentionLayer has the same interface with a KV cache.
///
/// \code
/// linattn::LinearAttentionLayer<linattn::EluPlusOne, float> layer(256, 8);  // d_model, heads
/// Eigen::MatrixXf Y = layer.forward(X, true);     // N x 256, causal
/// auto state = layer.make_state();
/// Eigen::MatrixXf P = layer.forward(prompt, state);  // prefill (causal, in parallel)
/// Eigen::VectorXf y(256);
/// layer.step(x, state, y);                         // one more token, no allocation
/// \endcode
template <class Phi = EluPlusOne, class Scalar = float>
class LinearAttentionLayer : public detail::AttentionProjections<Scalar> {
  using Base = detail::AttentionProjections<Scalar>;

 public:
  /// \brief The per-sequence state of generation (LinearAttentionLayerState): one linear
  /// attention state per head. Saved and restored exactly by save_state() / load_state().
  using State = LinearAttentionLayerState<Phi, Scalar>;
  /// \brief The state of B sequences generated together (LinearAttentionLayerBatchedState):
  /// their heads in a BatchedRecurrentLinearAttention and the buffers of a batched step.
  using BatchedState = LinearAttentionLayerBatchedState<Phi, Scalar>;

  /// H = num_heads heads of key and value size d_model / num_heads.
  /// \throws std::invalid_argument unless d_model is a positive multiple of num_heads.
  /// \param d_model the width of the layer's input and output rows.
  /// \param num_heads H, the number of heads (each D = M = d_model / H unless given).
  /// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
  LinearAttentionLayer(Index d_model, Index num_heads, const Phi& phi = Phi{})
      : LinearAttentionLayer(d_model, num_heads,
                             Base::head_size("LinearAttentionLayer", d_model, num_heads),
                             Base::head_size("LinearAttentionLayer", d_model, num_heads), phi) {}

  /// Heads of key size key_dim (queries and keys) and value size value_dim.
  /// \throws std::invalid_argument if a size is not positive or the map rejects key_dim.
  /// \param d_model the width of the layer's input and output rows.
  /// \param num_heads H, the number of heads (each D = M = d_model / H unless given).
  /// \param key_dim D, the width of each head's queries and keys.
  /// \param value_dim M, the width of each head's values.
  /// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
  LinearAttentionLayer(Index d_model, Index num_heads, Index key_dim, Index value_dim,
                       const Phi& phi = Phi{})
      : Base("LinearAttentionLayer", d_model, num_heads, key_dim, value_dim), phi_(phi) {
    detail::static_check_feature_map<Phi, compute_scalar_t<Scalar>>();
    detail::check_feature_map("LinearAttentionLayer", phi_, key_dim);
  }

  /// The feature map of the queries and keys of every head.
  /// \return the map, as given to the constructor.
  const Phi& feature_map() const noexcept { return phi_; }

  /// Y (N x d_model) for the rows of X (N x d_model), causal (row i sees rows j <= i) or not.
  /// \throws std::invalid_argument if X has not d_model columns or a weight has another shape.
  /// \param X N x d_model input rows, one per token.
  /// \param causal true when row i attends to rows j <= i only (a decoder), false for all rows.
  /// \return Y, N x d_model.
  template <class DX>
  Matrix<Scalar> forward(const Eigen::MatrixBase<DX>& X, bool causal) const {
    return this->forward_with("LinearAttentionLayer::forward", X, attention(causal));
  }

  /// Causal forward that continues `state` (a prefill: the prompt's rows in parallel, each head
  /// through causal_linear_attention() from its state) and leaves it after the last row, so
  /// that step() goes on from there. Equal to stepping through the rows one by one (to
  /// rounding). On an exception `state` is unchanged.
  /// \param X N x d_model input rows, one per token.
  /// \param state the state to continue from, moved past the N rows.
  /// \return Y, N x d_model.
  template <class DX>
  Matrix<Scalar> forward(const Eigen::MatrixBase<DX>& X, State& state) const {
    constexpr const char* fn = "LinearAttentionLayer::forward";
    check_state(fn, state);
    Matrix<Scalar> Q, K, V;
    this->prefill_in(fn, X, Q, K, V);
    const Index H = this->num_heads(), D = this->key_dim(), M = this->value_dim();
    Matrix<Scalar> A(X.rows(), H * M);
    std::vector<LinearAttentionState<Scalar>> next;
    next.reserve(static_cast<std::size_t>(H));
    Workspace<compute_scalar_t<Scalar>> ws;
    for (Index h = 0; h < H; ++h) {
      next.push_back(state.rnn_.head(h).state());
      causal_linear_attention(Q.middleCols(h * D, D), K.middleCols(h * D, D),
                              V.middleCols(h * M, M), phi_, next.back(),
                              A.middleCols(h * M, M), ws);
    }
    Matrix<Scalar> Y = this->output(A);
    // Nothing below throws: the state moves only once every head is done.
    const Index position = state.position() + X.rows();
    for (Index h = 0; h < H; ++h)
      state.rnn_.head(h).set_state(next[static_cast<std::size_t>(h)], position);
    return Y;
  }

  /// A state at position 0 for generation with this layer.
  /// \return a state at position 0.
  State make_state() const { return State(*this); }

  /// One token: x (d_model entries, any vector expression) at position state.position(); writes
  /// its output row into y (d_model entries), the row forward(X, true) gives at that position.
  /// Performs no heap allocation. `y` may share memory with `x`.
  /// \throws std::invalid_argument on a wrong size or a state of another layer's shape.
  /// \param x the token's d_model input row.
  /// \param state the state to continue from, moved on by the token.
  /// \param y receives the token's d_model output row.
  template <class DXv, class DYv>
  void step(const Eigen::MatrixBase<DXv>& x, State& state, const Eigen::MatrixBase<DYv>& y) const {
    constexpr const char* fn = "LinearAttentionLayer::step";
    check_state(fn, state);
    auto& b = state.buf_;
    this->step_in(fn, x, y, b);
    state.rnn_.step(b.q, b.k, b.v, b.o);
    this->step_out(b, y);
  }

  /// \brief `sequences` empty sequences served together, with step buffers for
  /// max(sequences, capacity) of them (see LinearAttentionLayerBatchedState).
  /// \throws std::invalid_argument if sequences or capacity is negative.
  /// \code
  /// auto batch = layer.make_batched_state(4, 64);  // 4 sequences now, room for 64
  /// \endcode
  /// \param sequences B, the number of sequences it starts with (more can be added).
  /// \param capacity the sequences a step takes without growing its buffers.
  /// \return B sequences at position 0.
  BatchedState make_batched_state(Index sequences = 0, Index capacity = 0) const {
    if (sequences < 0 || capacity < 0)
      detail::throw_invalid("LinearAttentionLayer::make_batched_state",
                            "sequences and capacity must be >= 0, got " +
                                std::to_string(sequences) + " and " + std::to_string(capacity));
    return BatchedState(this->d_model(), this->num_heads(), this->key_dim(), this->value_dim(),
                        phi_, sequences, capacity);
  }

  /// \brief Packed prefill of the B sequences of `states`: X (N x d_model) holds their new rows
  /// one sequence after the other, sequence b in rows [cu_seqlens[b], cu_seqlens[b+1]) (B + 1
  /// offsets of any integer type, as batched_causal_linear_attention() takes them; a sequence
  /// may get no rows). Each sequence continues from its state (after earlier prefills or
  /// steps) and its position advances by its rows; writes Y (N x d_model, may be X's memory),
  /// row for row what forward(X_b, state_b) gives for each sequence alone (to rounding). The
  /// projections are one matrix product each over the N rows. Allocates (states, N-row
  /// temporaries). On an exception `states` is unchanged.
  /// \throws std::invalid_argument if X or Y is not N x d_model, cu_seqlens has not B + 1
  /// entries from 0 to N, non-decreasing, or `states` is of another layer's shape.
  /// \code
  /// Eigen::VectorXi cu(5);
  /// cu << 0, 7, 7, 19, 20;                      // prompts of 7, 0, 12 and 1 tokens
  /// layer.forward(prompts, cu, batch, Y);       // prompts, Y: 20 x d_model
  /// \endcode
  /// \param X N x d_model input rows, one per token.
  /// \param cu_seqlens B + 1 row offsets of the packed sequences, of any integer type (as a
  ///     framework's).
  /// \param states the B sequences' states, continued from and updated in place.
  /// \param Y receives the N x d_model output rows.
  /// \param par the threads to split the work over (default: the OpenMP threads, or one).
  template <class DX, class Off, class DY>
  void forward(const Eigen::MatrixBase<DX>& X, const Off& cu_seqlens, BatchedState& states,
               const Eigen::MatrixBase<DY>& Y, const ParallelOptions& par = {}) const {
    constexpr const char* fn = "LinearAttentionLayer::forward";
    check_batched_state(fn, states);
    this->check_rows(fn, "Y", Y);
    if (Y.rows() != X.rows())
      detail::throw_invalid(fn, "Y is " + detail::shape_of(Y) + " but X is " +
                                    detail::shape_of(X) + ": they must have the same rows");
    Matrix<Scalar> Q, K, V;
    this->prefill_in(fn, X, Q, K, V);
    const detail::OffsetsRef off = detail::offsets_of(fn, "cu_seqlens", cu_seqlens);
    const Index B = states.sequences(), H = this->num_heads();
    if (static_cast<Index>(off.size()) != B + 1)
      detail::throw_invalid(fn, "cu_seqlens has " + std::to_string(off.size()) +
                                    " entries but must have B + 1 = " + std::to_string(B + 1) +
                                    " (the state holds B = " + std::to_string(B) + " sequences)");
    detail::check_offsets(fn, "cu_seqlens", off, X.rows());
    auto& dec = states.dec_;
    std::vector<LinearAttentionState<Scalar>> next = dec.states();
    Matrix<Scalar> A(X.rows(), H * this->value_dim());
    batched_causal_linear_attention(Q, K, V, cu_seqlens, H, phi_, next, A, states.ws_, {}, par);
    detail::writable(Y) = this->output(A);
    // Nothing below throws: the sequences move only once every head is done. A sequence with no
    // rows is left as it was (its fold schedule too).
    for (Index b = 0; b < B; ++b) {
      const Index rows = off[static_cast<std::size_t>(b + 1)] - off[static_cast<std::size_t>(b)];
      if (rows == 0) continue;
      const Index position = dec.position(b) + rows;
      for (Index h = 0; h < H; ++h)
        dec.set_state(b, h, next[static_cast<std::size_t>(b * H + h)], position);
    }
  }

  /// Packed prefill returning Y (N x d_model); see the form with Y.
  /// \param X N x d_model input rows, one per token.
  /// \param cu_seqlens B + 1 row offsets of the packed sequences, of any integer type (as a
  ///     framework's).
  /// \param states the B sequences' states, continued from and updated in place.
  /// \param par the threads to split the work over (default: the OpenMP threads, or one).
  /// \return Y, N x d_model, the rows of every sequence.
  template <class DX, class Off>
  Matrix<Scalar> forward(const Eigen::MatrixBase<DX>& X, const Off& cu_seqlens,
                         BatchedState& states, const ParallelOptions& par = {}) const {
    Matrix<Scalar> Y(X.rows(), this->d_model());
    forward(X, cu_seqlens, states, Y, par);
    return Y;
  }

  /// \brief One token of each of the B sequences of `states`: row b of Xb (B x d_model) is
  /// sequence b's token; writes its output row into row b of Yb (B x d_model, may be Xb's
  /// memory). The projections are one matrix product each over the B rows, the heads one
  /// BatchedRecurrentLinearAttention::step (their (sequence, head) pairs on up to
  /// `par.num_threads` threads). Equal to B separate step(x, state, y) calls to rounding (the
  /// attention bit for bit given the same projections). Performs no heap allocation once
  /// states.capacity() >= B (make_batched_state(), add_sequence() and reserve() see to it).
  /// \throws std::invalid_argument if Xb or Yb is not B x d_model or `states` is of another
  /// layer's shape, with no sequence moved.
  /// \code
  /// Eigen::MatrixXf Xb(batch.sequences(), 512), Yb(batch.sequences(), 512);
  /// layer.step(Xb, batch, Yb);
  /// \endcode
  /// \param Xb B x d_model: row b is sequence b's next token.
  /// \param states the B sequences' states, each moved on by one token.
  /// \param Yb receives the B x d_model outputs, row b for sequence b.
  /// \param par the threads to split the work over (default: the OpenMP threads, or one).
  template <class DX, class DY>
  void step(const Eigen::MatrixBase<DX>& Xb, BatchedState& states,
            const Eigen::MatrixBase<DY>& Yb, const ParallelOptions& par = {}) const {
    constexpr const char* fn = "LinearAttentionLayer::step";
    const Index B = states.sequences();
    check_batched_step(fn, Xb, Yb, states, B, false);
    auto& dec = states.dec_;
    states.run_step(*this, B, Xb, Yb, par, [&](auto&& q, auto&& k, auto&& v, auto&& a) {
      dec.step(q, k, v, a, par);
    });
  }

  /// \brief One token of the sequences listed in `slots` only (a vector of distinct sequence
  /// numbers of any integer type): row r of Xb and Yb belongs to sequence slots(r); the others
  /// keep their state. See step(Xb, states, Yb).
  /// \throws std::invalid_argument on wrong shapes, a slot outside [0, B) or a repeated one,
  /// with no sequence moved.
  /// \code
  /// Eigen::VectorXi active(2);
  /// active << 0, 3;                          // sequences 0 and 3 have a new token
  /// layer.step(active, X2, batch, Y2);       // X2, Y2: 2 x d_model
  /// \endcode
  /// \param slots the sequences, one per row of the batch, each 0 <= slots[i] < sequences().
  /// \param Xb one d_model row per entry of slots: that sequence's next token.
  /// \param states the sequences' states; those not in slots keep theirs.
  /// \param Yb receives one output row per row of Xb.
  /// \param par the threads to split the work over (default: the OpenMP threads, or one).
  template <class DSlots, class DX, class DY>
  void step(const Eigen::DenseBase<DSlots>& slots, const Eigen::MatrixBase<DX>& Xb,
            BatchedState& states, const Eigen::MatrixBase<DY>& Yb,
            const ParallelOptions& par = {}) const {
    constexpr const char* fn = "LinearAttentionLayer::step";
    if (slots.rows() != 1 && slots.cols() != 1 && slots.size() != 0)
      detail::throw_invalid(fn, "slots is " + detail::shape_of(slots) + " but must be a vector");
    const Index n = slots.size();
    check_batched_step(fn, Xb, Yb, states, n, true);
    if (n > states.sequences())
      detail::throw_invalid(fn, std::to_string(n) + " slots but the state holds B = " +
                                    std::to_string(states.sequences()) + " sequences");
    auto& dec = states.dec_;
    states.run_step(*this, n, Xb, Yb, par, [&](auto&& q, auto&& k, auto&& v, auto&& a) {
      dec.step(slots, q, k, v, a, par);
    });
  }

  /// The gradients of a loss L with respect to X and every parameter, given dY = ∂L/∂Y for
  /// Y = forward(X, causal) (the forward is recomputed; the attention's gradients are the
  /// multi-head backward kernels', O(F·M) working memory per head).
  /// \throws std::invalid_argument if X or dY is not N x d_model.
  /// \param X N x d_model input rows, one per token.
  /// \param dY the N x d_model gradient of the loss with respect to the output.
  /// \param causal true when row i attends to rows j <= i only (a decoder), false for all rows.
  /// \return the gradients with respect to X and to every weight and bias.
  template <class DX, class DY>
  LayerGradients<Scalar> backward(const Eigen::MatrixBase<DX>& X, const Eigen::MatrixBase<DY>& dY,
                                  bool causal) const {
    const Index H = this->num_heads();
    return this->backward_with(
        "LinearAttentionLayer::backward", X, dY, attention(causal),
        [&](const Matrix<Scalar>& Q, const Matrix<Scalar>& K, const Matrix<Scalar>& V,
            const Matrix<Scalar>& dA) {
          return causal ? multihead_causal_linear_attention_backward(Q, K, V, dA, H, phi_)
                        : multihead_linear_attention_backward(Q, K, V, dA, H, phi_);
        });
  }


 private:
  // The heads' attention, (Q, K, V) -> N x H·M.
  auto attention(bool causal) const {
    return [this, causal](const Matrix<Scalar>& Q, const Matrix<Scalar>& K,
                          const Matrix<Scalar>& V) -> Matrix<Scalar> {
      return causal ? multihead_causal_linear_attention(Q, K, V, this->num_heads(), phi_)
                    : multihead_linear_attention(Q, K, V, this->num_heads(), phi_);
    };
  }

  void check_batched_state(const char* fn, const BatchedState& states) const {
    const auto& dec = states.dec_;
    if (dec.heads() != this->num_heads() || dec.key_dim() != this->key_dim() ||
        dec.value_dim() != this->value_dim() || states.d_model_ != this->d_model())
      detail::throw_invalid(fn, "the batched state was made by a layer of another shape");
  }

  template <class DX, class DY>
  void check_batched_step(const char* fn, const Eigen::MatrixBase<DX>& Xb,
                          const Eigen::MatrixBase<DY>& Yb, const BatchedState& states, Index rows,
                          bool slots) const {
    static_assert(std::is_same_v<typename DX::Scalar, Scalar> &&
                      std::is_same_v<typename DY::Scalar, Scalar>,
                  "linattn: the tokens' scalar type must be the layer's");
    check_batched_state(fn, states);
    this->check_parameters(fn);
    const Index d = this->d_model();
    if (Xb.rows() != rows || Xb.cols() != d || Yb.rows() != rows || Yb.cols() != d)
      detail::throw_invalid(fn, "Xb is " + detail::shape_of(Xb) + " and Yb is " +
                                    detail::shape_of(Yb) + " but both must be " +
                                    detail::shape_string(rows, d) +
                                    (slots ? " (one row per slot, " + std::to_string(rows) + " slots)"
                                           : " (one row per sequence, B = " +
                                                 std::to_string(rows) + ")"));
  }

  void check_state(const char* fn, const State& state) const {
    if (state.rnn_.heads() != this->num_heads() || state.rnn_.key_dim() != this->key_dim() ||
        state.rnn_.value_dim() != this->value_dim() || state.buf_.x.size() != this->d_model())
      detail::throw_invalid(fn, "the state was made by a layer of another shape");
  }

  Phi phi_;
};

}  // namespace linattn
