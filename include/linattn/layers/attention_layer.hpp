/// \file layers/attention_layer.hpp
/// \brief Multi-head attention layers with the projections of `torch.nn.MultiheadAttention`-style
/// models: LinearAttentionLayer (linear attention, a recurrent state for generation) and
/// SoftmaxAttentionLayer (softmax attention, a KV cache), with one interface.
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

namespace linattn {

/// \brief The gradients of a scalar loss with respect to an attention layer's input and
/// parameters (LinearAttentionLayer::backward(), SoftmaxAttentionLayer::backward()); each member
/// has the shape of what it is the gradient of.
template <class Scalar>
struct LayerGradients {
  Matrix<Scalar> dX;                  ///< N x d_model
  Matrix<Scalar> dWq, dWk, dWv, dWo;  ///< the weights' shapes (out x in)
  Vector<Scalar> dbq, dbk, dbv, dbo;  ///< the biases' sizes
};

namespace detail {

// The vectors a step works in: the token x, its q, k, v, the heads' outputs o and the row y.
template <class Scalar>
struct TokenBuffers {
  TokenBuffers(Index d_model, Index heads, Index key_dim, Index value_dim)
      : x(d_model),
        q(heads * key_dim),
        k(heads * key_dim),
        v(heads * value_dim),
        o(heads * value_dim),
        y(d_model) {}
  Vector<Scalar> x, q, k, v, o, y;
};

/// The weights, biases and shape checks that both layers share (spec §6): with H heads of key
/// size D and value size M,
///   Q = X Wqᵀ + bq,  K = X Wkᵀ + bk,  V = X Wvᵀ + bv,  Y = A Woᵀ + bo,
/// where A holds every head's attention output side by side (head h in columns [h·M, (h+1)·M)).
template <class Scalar>
class AttentionProjections {
  static_assert(is_supported_scalar_v<Scalar>, "linattn: the scalar type must be float or double");

 public:
  /// Weights in the layout of `torch.nn.Linear::weight` (out x in): Wq and Wk are (H·D) x
  /// d_model, Wv is (H·M) x d_model, Wo is d_model x (H·M).
  Matrix<Scalar> Wq, Wk, Wv, Wo;
  /// Biases (zero after construction): bq, bk of H·D entries, bv of H·M, bo of d_model.
  Vector<Scalar> bq, bk, bv, bo;

  Index d_model() const noexcept { return d_model_; }
  Index num_heads() const noexcept { return heads_; }
  Index key_dim() const noexcept { return key_dim_; }
  Index value_dim() const noexcept { return value_dim_; }

  /// Weights drawn uniformly from [-1/√in, 1/√in] (the default of `torch.nn.Linear`), from a
  /// std::mt19937 seeded with `seed`; biases zero.
  void reset_parameters(std::uint32_t seed = 0) {
    std::mt19937 gen(seed);
    const auto fill = [&gen](Matrix<Scalar>& W) {
      const double bound = 1.0 / std::sqrt(double(W.cols()));
      std::uniform_real_distribution<double> u(-bound, bound);
      for (Index j = 0; j < W.cols(); ++j)
        for (Index i = 0; i < W.rows(); ++i) W(i, j) = Scalar(u(gen));
    };
    fill(Wq);
    fill(Wk);
    fill(Wv);
    fill(Wo);
    bq.setZero();
    bk.setZero();
    bv.setZero();
    bo.setZero();
  }

 protected:
  AttentionProjections(const char* name, Index d_model, Index heads, Index key_dim,
                       Index value_dim)
      : d_model_(d_model), heads_(heads), key_dim_(key_dim), value_dim_(value_dim) {
    if (d_model <= 0 || heads <= 0 || key_dim <= 0 || value_dim <= 0)
      throw_invalid(name, "d_model, num_heads, key_dim and value_dim must be positive (got " +
                              std::to_string(d_model) + ", " + std::to_string(heads) + ", " +
                              std::to_string(key_dim) + ", " + std::to_string(value_dim) + ")");
    Wq.resize(heads * key_dim, d_model);
    Wk.resize(heads * key_dim, d_model);
    Wv.resize(heads * value_dim, d_model);
    Wo.resize(d_model, heads * value_dim);
    bq.resize(heads * key_dim);
    bk.resize(heads * key_dim);
    bv.resize(heads * value_dim);
    bo.resize(d_model);
    reset_parameters();
  }

  // Head sizes d_model / heads, which must divide.
  static Index head_size(const char* name, Index d_model, Index heads) {
    if (heads <= 0 || d_model <= 0 || d_model % heads != 0)
      throw_invalid(name, "d_model (" + std::to_string(d_model) +
                              ") must be a positive multiple of num_heads (" +
                              std::to_string(heads) + ")");
    return d_model / heads;
  }

  // The weights are public members: a caller may have given them other shapes.
  void check_parameters(const char* fn) const {
    const Index HD = heads_ * key_dim_, HM = heads_ * value_dim_;
    const auto check = [fn](const char* name, Index rows, Index cols, Index want_rows,
                            Index want_cols) {
      if (rows != want_rows || cols != want_cols)
        throw_invalid(fn, std::string(name) + " is " + std::to_string(rows) + "x" +
                              std::to_string(cols) + " but must be " + std::to_string(want_rows) +
                              "x" + std::to_string(want_cols));
    };
    check("Wq", Wq.rows(), Wq.cols(), HD, d_model_);
    check("Wk", Wk.rows(), Wk.cols(), HD, d_model_);
    check("Wv", Wv.rows(), Wv.cols(), HM, d_model_);
    check("Wo", Wo.rows(), Wo.cols(), d_model_, HM);
    check("bq", bq.size(), 1, HD, 1);
    check("bk", bk.size(), 1, HD, 1);
    check("bv", bv.size(), 1, HM, 1);
    check("bo", bo.size(), 1, d_model_, 1);
  }

  template <class DX>
  void check_rows(const char* fn, const char* name, const Eigen::MatrixBase<DX>& X) const {
    static_assert(std::is_same_v<typename DX::Scalar, Scalar>,
                  "linattn: the input's scalar type must be the layer's");
    if (X.cols() != d_model_)
      throw_invalid(fn, std::string(name) + " is " + shape_of(X) + " but must have d_model = " +
                            std::to_string(d_model_) + " columns");
  }

  // Q, K, V of the rows of X (resized).
  template <class DX>
  void project(const Eigen::MatrixBase<DX>& X, Matrix<Scalar>& Q, Matrix<Scalar>& K,
               Matrix<Scalar>& V) const {
    Q.noalias() = X * Wq.transpose();
    Q.rowwise() += bq.transpose();
    K.noalias() = X * Wk.transpose();
    K.rowwise() += bk.transpose();
    V.noalias() = X * Wv.transpose();
    V.rowwise() += bv.transpose();
  }

  // Y = A Woᵀ + bo.
  Matrix<Scalar> output(const Matrix<Scalar>& A) const {
    Matrix<Scalar> Y = A * Wo.transpose();
    Y.rowwise() += bo.transpose();
    return Y;
  }

  // The first half of a step: checks, then x (copied first: y may be its memory) projected into
  // b.q, b.k, b.v. Allocates nothing.
  template <class DXv, class DYv>
  void step_in(const char* fn, const Eigen::MatrixBase<DXv>& x, const Eigen::MatrixBase<DYv>& y,
               TokenBuffers<Scalar>& b) const {
    static_assert(std::is_same_v<typename DXv::Scalar, Scalar>,
                  "linattn: the token's scalar type must be the layer's");
    check_parameters(fn);
    check_token(fn, "x", x, d_model_);
    check_token(fn, "y", y, d_model_);
    b.x = x.reshaped();
    b.q.noalias() = Wq * b.x;
    b.q += bq;
    b.k.noalias() = Wk * b.x;
    b.k += bk;
    b.v.noalias() = Wv * b.x;
    b.v += bv;
  }

  // The second half: y = Wo b.o + bo.
  template <class DYv>
  void step_out(TokenBuffers<Scalar>& b, const Eigen::MatrixBase<DYv>& y) const {
    b.y.noalias() = Wo * b.o;
    b.y += bo;
    writable(y).reshaped() = b.y;
  }

  // The start of a prefill: checks, then Q, K, V of the rows of X.
  template <class DX>
  void prefill_in(const char* fn, const Eigen::MatrixBase<DX>& X, Matrix<Scalar>& Q,
                  Matrix<Scalar>& K, Matrix<Scalar>& V) const {
    check_parameters(fn);
    check_rows(fn, "X", X);
    project(X, Q, K, V);
  }

  // Y = forward(X) with the heads' attention attend(Q, K, V) (N x H·M).
  template <class DX, class Attend>
  Matrix<Scalar> forward_with(const char* fn, const Eigen::MatrixBase<DX>& X,
                              const Attend& attend) const {
    check_parameters(fn);
    check_rows(fn, "X", X);
    Matrix<Scalar> Q, K, V;
    project(X, Q, K, V);
    return output(attend(Q, K, V));
  }

  // The gradients of the layer for ∂L/∂Y = dY, given the heads' attention and its backward
  // attend_backward(Q, K, V, dA) -> AttentionGradients (of Q, K, V).
  template <class DX, class DY, class Attend, class AttendBackward>
  LayerGradients<Scalar> backward_with(const char* fn, const Eigen::MatrixBase<DX>& X,
                                       const Eigen::MatrixBase<DY>& dY, const Attend& attend,
                                       const AttendBackward& attend_backward) const {
    check_parameters(fn);
    check_rows(fn, "X", X);
    check_rows(fn, "dY", dY);
    if (dY.rows() != X.rows())
      throw_invalid(fn, "dY is " + shape_of(dY) + " but X is " + shape_of(X) +
                            ": they must have the same rows");
    Matrix<Scalar> Q, K, V;
    project(X, Q, K, V);
    const Matrix<Scalar> A = attend(Q, K, V);
    const Matrix<Scalar> dA = dY * Wo;
    const AttentionGradients<Scalar> g = attend_backward(Q, K, V, dA);
    LayerGradients<Scalar> out;
    out.dWo.noalias() = dY.transpose() * A;
    out.dbo = dY.colwise().sum().transpose();
    out.dWq.noalias() = g.dQ.transpose() * X;
    out.dWk.noalias() = g.dK.transpose() * X;
    out.dWv.noalias() = g.dV.transpose() * X;
    out.dbq = g.dQ.colwise().sum().transpose();
    out.dbk = g.dK.colwise().sum().transpose();
    out.dbv = g.dV.colwise().sum().transpose();
    out.dX.noalias() = g.dQ * Wq;
    out.dX.noalias() += g.dK * Wk;
    out.dX.noalias() += g.dV * Wv;
    return out;
  }

  Index d_model_, heads_, key_dim_, value_dim_;
};

}  // namespace detail

template <class Phi, class Scalar>
class LinearAttentionLayer;
template <class Scalar>
class SoftmaxAttentionLayer;

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
  Index position() const noexcept { return rnn_.head(0).position(); }

  /// The heads' recurrent forms (their states: heads().head(h).state()).
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
  MultiHeadRecurrentLinearAttention<Phi, Scalar>& heads() noexcept { return rnn_; }

 private:
  friend class LinearAttentionLayer<Phi, Scalar>;
  explicit LinearAttentionLayerState(const LinearAttentionLayer<Phi, Scalar>& layer)
      : rnn_(layer.num_heads(), layer.key_dim(), layer.value_dim(), layer.feature_map()),
        buf_(layer.d_model(), layer.num_heads(), layer.key_dim(), layer.value_dim()) {}

  MultiHeadRecurrentLinearAttention<Phi, Scalar> rnn_;
  detail::TokenBuffers<Scalar> buf_;
};

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
  Index position() const noexcept { return length_; }
  /// Tokens the cache holds without growing.
  Index capacity() const noexcept { return keys_.rows(); }
  /// The cached keys (position() x H·D) and values (position() x H·M).
  auto keys() const { return keys_.topRows(length_); }
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
  LinearAttentionLayer(Index d_model, Index num_heads, const Phi& phi = Phi{})
      : LinearAttentionLayer(d_model, num_heads,
                             Base::head_size("LinearAttentionLayer", d_model, num_heads),
                             Base::head_size("LinearAttentionLayer", d_model, num_heads), phi) {}

  /// Heads of key size key_dim (queries and keys) and value size value_dim.
  /// \throws std::invalid_argument if a size is not positive or the map rejects key_dim.
  LinearAttentionLayer(Index d_model, Index num_heads, Index key_dim, Index value_dim,
                       const Phi& phi = Phi{})
      : Base("LinearAttentionLayer", d_model, num_heads, key_dim, value_dim), phi_(phi) {
    detail::static_check_feature_map<Phi, compute_scalar_t<Scalar>>();
    detail::check_feature_map("LinearAttentionLayer", phi_, key_dim);
  }

  const Phi& feature_map() const noexcept { return phi_; }

  /// Y (N x d_model) for the rows of X (N x d_model), causal (row i sees rows j <= i) or not.
  /// \throws std::invalid_argument if X has not d_model columns or a weight has another shape.
  template <class DX>
  Matrix<Scalar> forward(const Eigen::MatrixBase<DX>& X, bool causal) const {
    return this->forward_with("LinearAttentionLayer::forward", X, attention(causal));
  }

  /// Causal forward that continues `state` (a prefill: the prompt's rows in parallel, each head
  /// through causal_linear_attention() from its state) and leaves it after the last row, so
  /// that step() goes on from there. Equal to stepping through the rows one by one (to
  /// rounding). On an exception `state` is unchanged.
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
  State make_state() const { return State(*this); }

  /// One token: x (d_model entries, any vector expression) at position state.position(); writes
  /// its output row into y (d_model entries), the row forward(X, true) gives at that position.
  /// Performs no heap allocation. `y` may share memory with `x`.
  /// \throws std::invalid_argument on a wrong size or a state of another layer's shape.
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
  SoftmaxAttentionLayer(Index d_model, Index num_heads)
      : SoftmaxAttentionLayer(d_model, num_heads,
                              Base::head_size("SoftmaxAttentionLayer", d_model, num_heads),
                              Base::head_size("SoftmaxAttentionLayer", d_model, num_heads)) {}

  /// Heads of key size key_dim and value size value_dim.
  SoftmaxAttentionLayer(Index d_model, Index num_heads, Index key_dim, Index value_dim)
      : Base("SoftmaxAttentionLayer", d_model, num_heads, key_dim, value_dim) {}

  /// Y (N x d_model) for the rows of X, causal or not (see LinearAttentionLayer::forward()).
  template <class DX>
  Matrix<Scalar> forward(const Eigen::MatrixBase<DX>& X, bool causal) const {
    return this->forward_with("SoftmaxAttentionLayer::forward", X, attention(causal));
  }

  /// Causal forward that appends the rows of X to the cache (a prefill) and returns their
  /// outputs; step() goes on from there. From an empty cache the rows run through the tiled
  /// multi-head causal kernel; after earlier tokens, each row attends over the cache as a
  /// step would. On an exception `state` is unchanged.
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
  State make_state(Index capacity = 0) const {
    if (capacity < 0)
      detail::throw_invalid("SoftmaxAttentionLayer::make_state",
                            "capacity must be >= 0, got " + std::to_string(capacity));
    return State(*this, capacity);
  }

  /// One token (see LinearAttentionLayer::step()); allocates nothing while the cache has room
  /// (make_state(capacity)), else grows it.
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
