/// \file delta/recurrent_delta_rule.hpp
/// \brief The decode step of the delta rule (DeltaNet, Gated DeltaNet): one token at a time,
/// one pass over the F x M state, no allocation.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <string>
#include <utility>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "options.hpp"
#include "detail/delta_forward.hpp"
#include "detail/delta_low_state.hpp"
#include "../maps/feature_map.hpp"
#include "../maps/identity.hpp"
#include "../linear/recurrent_linear_attention.hpp"
#include "../core/state.hpp"
#include "../maps/map_state.hpp"

namespace linattn {

/// \brief The recurrent form of delta_rule_attention() (docs/SPEC.md §9.3): per step,
/// \f[ S_t = a_t (I - \beta_t \hat k_t \hat k_t^\top) S_{t-1} + \beta_t \hat k_t v_t^\top,
///     \qquad \mathrm{out}_t = s\,\varphi(q_t)^\top S_t, \f]
/// with \f$\hat k_t = \varphi(k_t)\f$, \f$a_t = e^{g_t}\f$ and s = DeltaOptions::scale.
///
/// Each step() is one pass over the F x M state and performs no allocation: it reads
/// \f$S_{t-1}^\top \varphi(q_t)\f$ and \f$S_{t-1}^\top \hat k_t\f$, from which the output follows
/// (\f$\mathrm{out}_t = s(a_t S_{t-1}^\top \varphi(q_t) + (\varphi(q_t)\cdot\hat k_t)\,\delta_t)\f$,
/// \f$\delta_t = \beta_t(v_t - a_t S_{t-1}^\top \hat k_t)\f$), and applies the previous token's
/// update in the same pass; the last token's update stays pending in the object until the next
/// step. state() returns a copy with it applied and changes nothing: any number of threads may
/// call it (and the other const members) on one object at once, and the copy is a snapshot,
/// which later steps leave as it was. The state is a LinearAttentionState (S only),
/// interchangeable with the parallel kernels': prefill with delta_rule_attention() and hand the
/// state over with set_state(), or take state() and continue in parallel; set_state(state())
/// continues bit for bit. step() checks the token's values as the parallel kernels do: β in
/// [0, 2], the log-decay finite and <= 0. save_state() / load_state() (state_io.hpp) park a
/// decode in a compact file (the F x M state and the position).
///
/// \tparam Phi a feature map without per-feature key softmax (Identity by default; models use
///         L2Normalize<> after their convolution and SiLU, or L2Normalize<Silu> before the SiLU)
/// \tparam Scalar float or double: the arithmetic (tokens may be bf16 / half for float)
/// \tparam StateScalar what S is kept in between tokens: Scalar (the default), or
///         `Eigen::bfloat16` / `Eigen::half` for a float decoder (half the bytes a step moves;
///         the state after each token rounded once, docs/SPEC.md §9.3). state() and set_state()
///         widen and round; save_state() records the storage type.
/// \code
/// linattn::RecurrentDeltaRule<linattn::L2Normalize<linattn::Silu>, float> rnn(128, 128);
/// Eigen::VectorXf out(128);
/// for (Eigen::Index t = 0; t < T; ++t)
///   rnn.step(Q.row(t), K.row(t), V.row(t), beta(t), log_a(t), out);  // log_a = 0: no decay
/// \endcode
template <class Phi = Identity, class Scalar = float, class StateScalar = Scalar>
class RecurrentDeltaRule {
  static_assert((detail::static_check_recurrent<Phi, Scalar>(), true));
  static constexpr bool kLowState = !std::is_same_v<StateScalar, Scalar>;
  static_assert(!kLowState ||
                    (std::is_same_v<Scalar, float> && detail::is_low_precision_v<StateScalar>),
                "linattn: RecurrentDeltaRule keeps its state in Scalar, or in Eigen::bfloat16 / "
                "Eigen::half for a float decoder");
  static_assert(!normalizes_keys_per_feature_v<Phi>,
                "linattn: the delta rule needs a product feature map (sim = φ(q)·φ(k)); a map "
                "with a per-feature key softmax (SoftmaxSplit) has no delta-rule form");

 public:
  /// The state the step updates: S, the F x M key-value memory.
  using State = LinearAttentionState<Scalar>;
  /// What S is kept in between tokens.
  using StateStorage = StateScalar;
  /// A rollback point of the batched decoders: the state as kept (S only).
  using Snapshot = std::conditional_t<kLowState, detail::LowDecodeState<StateScalar>, State>;

  /// A zero state for keys and queries of dimension D and values of dimension M.
  /// \throws std::invalid_argument if D <= 0 or M < 0.
  /// \param key_dim D, the width of the query and key rows.
  /// \param value_dim M, the width of the value rows and of each output.
  /// \param options the query scale every step applies (a step has no chunks).
  RecurrentDeltaRule(Index key_dim, Index value_dim, const DeltaOptions& options = {})
      : RecurrentDeltaRule(key_dim, value_dim, Phi{}, options) {}

  /// As above, with a map that has parameters.
  /// \param key_dim D, the width of the query and key rows.
  /// \param value_dim M, the width of the value rows and of each output.
  /// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
  /// \param options the query scale every step applies (a step has no chunks).
  RecurrentDeltaRule(Index key_dim, Index value_dim, const Phi& phi,
                     const DeltaOptions& options = {})
      : phi_(phi), options_(options), key_dim_(key_dim), value_dim_(value_dim) {
    detail::check_dims("RecurrentDeltaRule", key_dim, value_dim);
    detail::check_feature_map("RecurrentDeltaRule", phi_, key_dim);
    const Index F = phi_.feature_dim(key_dim);
    state_ = Snapshot(F, value_dim);
    token_.resize(key_dim, F);
    pqv_.resize(F);
    pkv_.resize(F);
    v_.resize(value_dim);
    o_.resize(value_dim);
    yq_.resize(value_dim);
    yk_.resize(value_dim);
    kp_.resize(F);
    dp_.resize(value_dim);
    ar_.resize(2 * F);
    wa_.resize(2 * F);
  }

  /// Consumes one token and writes its output (M entries) into `out`. q, k: D entries; v: M
  /// entries (row or column vectors, any expression); beta: the writing strength; log_a: the
  /// log-decay (0: no decay). `out` may share memory with the inputs (all are copied first).
  /// No allocation. \throws std::invalid_argument on a wrong size, a beta outside [0, 2] or a
  /// log_a that is not finite and <= 0 (naming the value and the token, position()); the
  /// decoder is then unchanged.
  /// \param q the query row (D entries).
  /// \param k the key row (D entries).
  /// \param v the value row (M entries).
  /// \param beta N writing strengths in [0, 2], one per token: how far each step moves the state's
  ///     value for its key.
  /// \param log_a N log-decays g_t <= 0, one per token (Gated DeltaNet), or an empty vector for
  ///     none.
  /// \param out receives the token's M output entries.
  template <class DQ, class DK, class DV, class DOut>
  void step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
            const Eigen::MatrixBase<DV>& v, Scalar beta, Scalar log_a,
            const Eigen::MatrixBase<DOut>& out) {
    detail::static_check_scalars<DQ, DK, DV>();
    static_assert(std::is_same_v<compute_scalar_t<typename DQ::Scalar>, Scalar> &&
                      std::is_same_v<compute_scalar_t<typename DOut::Scalar>, Scalar>,
                  "linattn: the token's scalar type must be the RecurrentDeltaRule's (or bf16 / "
                  "half for a float one)");
    const char* fn = "RecurrentDeltaRule::step";
    const Index F = state_.S.rows();
    detail::check_token(fn, "q", q, key_dim_);
    detail::check_token(fn, "k", k, key_dim_);
    detail::check_token(fn, "v", v, value_dim_);
    detail::check_token(fn, "out", out, value_dim_);
    if (!(beta >= Scalar(0) && beta <= Scalar(2)))
      detail::throw_step_value(fn, "beta", beta, position_, "beta must be in [0, 2]");
    if (!detail::finite_nonpositive(log_a))
      detail::throw_step_value(fn, "log_a", log_a, position_,
                               "log-decays must be finite and <= 0");
    token_.map(phi_, q, pqv_, QuerySide{false});
    token_.map(phi_, k, pkv_, KeySide{false});
    pqv_ *= static_cast<Scalar>(options_.scale);
    v_ = v.reshaped().template cast<Scalar>();
    const Scalar a = detail::exp_nonpositive_op<Scalar>()(log_a);
    bind_pending();
    detail::delta_token(state_.S.data(), state_.S.outerStride(), F, value_dim_, pending_, a, beta,
                        pqv_.data(), pkv_.data(), v_.data(), o_.data(), yq_.data(), yk_.data());
    detail::writable(out).reshaped() = o_.template cast<typename DOut::Scalar>();
    ++position_;
  }

  /// Consumes one token with one log-decay per key channel (KDA, Kimi Linear):
  /// \f$S'_t = \mathrm{diag}(e^{g_t}) S_{t-1}\f$, then the delta rule's overwrite, in one pass
  /// over the state as the scalar step; the parallel kernels' per-channel form token by token.
  /// No allocation. \throws std::invalid_argument on a wrong size, a beta outside [0, 2] or a
  /// log-decay that is not finite and <= 0 (naming the entry and the token); the decoder is then
  /// unchanged.
  /// \code
  /// linattn::RecurrentDeltaRule<linattn::L2Normalize<>, float> rnn(128, 128);
  /// rnn.step(q, k, v, beta, g, out);  // g: 128 log-decays <= 0, one per key channel
  /// \endcode
  /// \param q the query row (D entries).
  /// \param k the key row (D entries).
  /// \param v the value row (M entries).
  /// \param beta the writing strength, in [0, 2].
  /// \param log_a the token's F log-decays (F = feature_dim(), D for the L2 maps), row or column.
  /// \param out receives the token's M output entries.
  template <class DQ, class DK, class DV, class DG, class DOut>
  void step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
            const Eigen::MatrixBase<DV>& v, Scalar beta, const Eigen::MatrixBase<DG>& log_a,
            const Eigen::MatrixBase<DOut>& out) {
    detail::static_check_scalars<DQ, DK, DV>();
    static_assert(std::is_same_v<compute_scalar_t<typename DQ::Scalar>, Scalar> &&
                      std::is_same_v<compute_scalar_t<typename DOut::Scalar>, Scalar> &&
                      std::is_same_v<compute_scalar_t<typename DG::Scalar>, Scalar>,
                  "linattn: the token's scalar type must be the RecurrentDeltaRule's (or bf16 / "
                  "half for a float one)");
    const char* fn = "RecurrentDeltaRule::step";
    const Index F = state_.S.rows();
    detail::check_token(fn, "q", q, key_dim_);
    detail::check_token(fn, "k", k, key_dim_);
    detail::check_token(fn, "v", v, value_dim_);
    detail::check_token(fn, "log_a", log_a, F);
    detail::check_token(fn, "out", out, value_dim_);
    if (!(beta >= Scalar(0) && beta <= Scalar(2)))
      detail::throw_step_value(fn, "beta", beta, position_, "beta must be in [0, 2]");
    // The log-decays into the free half of the decay buffer (the pending update's are in the
    // other), indexed as a row or a column: reshaped() of a strided row would divide per entry.
    bind_pending();
    Scalar* a = pending_.ar_next;
    const bool row = log_a.rows() == 1;
    for (Index r = 0; r < F; ++r) {
      a[r] = static_cast<Scalar>(row ? log_a.coeff(0, r) : log_a.coeff(r, 0));
      if (!detail::finite_nonpositive(a[r]))
        detail::throw_step_value(fn, "log_a(" + std::to_string(r) + ")", a[r], position_,
                                 "log-decays must be finite and <= 0");
    }
    token_.map(phi_, q, pqv_, QuerySide{false});
    token_.map(phi_, k, pkv_, KeySide{false});
    pqv_ *= static_cast<Scalar>(options_.scale);
    v_ = v.reshaped().template cast<Scalar>();
    Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> av(a, F);
    av = av.unaryExpr(detail::exp_nonpositive_op<Scalar>());
    detail::delta_token_channels(state_.S.data(), state_.S.outerStride(), F, value_dim_,
                                 pending_, beta, pqv_.data(), pkv_.data(), v_.data(), o_.data(),
                                 yq_.data(), yk_.data(), wa_.data(), wa_.data() + F);
    ar_half_ = 1 - ar_half_;
    detail::writable(out).reshaped() = o_.template cast<typename DOut::Scalar>();
    ++position_;
  }

  /// Back to the empty sequence.
  void reset() {
    state_.reset();
    pending_.pending = false;
    position_ = 0;
  }

  /// A copy of the current state (S, the last step's update applied; its low part and z zero,
  /// log_decay empty: the delta rule uses S only); O(F·M). Read-only: a snapshot of the state
  /// after position() tokens, which later steps do not change (take state() again for theirs).
  /// \code
  /// const auto before = rnn.state();  // after t tokens
  /// rnn.step(q, k, v, beta, log_a, out);
  /// // `before` is still the state after t tokens; rnn.state() is the one after t + 1
  /// \endcode
  /// \return the state after position() tokens.
  State state() const {
    if constexpr (kLowState) {
      State copy(state_.S.rows(), state_.S.cols());
      for (Index r = 0; r < copy.S.rows(); ++r)
        settled_row(r, copy.S.data() + r * copy.S.outerStride());
      return copy;
    } else {
      State copy = state_;
      if (pending_.pending)
        detail::delta_flush(copy.S.data(), copy.S.outerStride(), copy.S.rows(), copy.S.cols(),
                            pending_.a, pending_decays(), kp_.data(), dp_.data());
      return copy;
    }
  }

  /// Continues from `state` (for example the one a delta_rule_attention() prefill left): its
  /// low part is added into S; its z, m and log_decay, which the delta rule does not use, are
  /// not kept (state() has z zero). \throws std::invalid_argument if it does not fit or
  /// `position` is negative.
  /// \param state the state to continue from (copied).
  /// \param position the number of tokens the state has consumed, so that steps continue counting
  ///     from it.
  void set_state(const State& state, Index position = 0) {
    const char* fn = "RecurrentDeltaRule::set_state";
    detail::check_position(fn, position);
    State copy = state;
    detail::prepare_state(fn, copy, phi_, key_dim_, value_dim_);
    copy.S += copy.S_lo;
    copy.S_lo.setZero();
    copy.z.setZero();
    copy.z_lo.setZero();
    copy.log_decay.resize(0);
    adopt(std::move(copy), position);
  }

  /// Tokens consumed since construction, reset() or set_state().
  /// \return the position, the index the next step's token will have.
  Index position() const noexcept { return position_; }
  /// The width D of the query and key rows a step takes.
  /// \return D.
  Index key_dim() const noexcept { return key_dim_; }
  /// The width M of the value rows and of each output.
  /// \return M.
  Index value_dim() const noexcept { return value_dim_; }
  /// The number F of features of the map, the rows of the state.
  /// \return F.
  Index feature_dim() const noexcept { return state_.S.rows(); }
  /// The feature map the queries and keys go through.
  /// \return the map, as given to the constructor.
  const Phi& feature_map() const noexcept { return phi_; }
  /// The options every step uses.
  /// \return the options, as given to the constructor.
  const DeltaOptions& options() const noexcept { return options_; }

 private:
  // save_state() / load_state() (state_io.hpp) write the state with the pending update applied
  // (row by row, as state() would) and install a loaded one with none pending.
  friend struct detail::RecurrentStateAccess;
  // The batched decoders' rollback snapshots: the state copied out without allocating, and a
  // snapshot swapped in.
  template <class>
  friend class BatchedHeads;
  void snapshot_into(Snapshot& out) {
    const Index F = state_.S.rows(), M = state_.S.cols();
    if (out.S.rows() != F || out.S.cols() != M) out = Snapshot(F, M);
    for (Index r = 0; r < F; ++r) {
      if constexpr (kLowState) {  // rounded already: narrowing the widened row is exact
        settled_row(r, yq_.data());
        detail::narrow(yq_.data(), out.S.data() + r * out.S.outerStride(), M);
      } else {
        settled_row(r, out.S.data() + r * out.S.outerStride());
      }
    }
  }
  void restore_from(Snapshot& snapshot, Index position) noexcept {
    std::swap(state_.S, snapshot.S);
    pending_.pending = false;
    position_ = position;
  }

  // The pending update lives in this object's kp_ and dp_ (bound before each step, so that the
  // implicit copies and moves stay correct); const members read kp_ and dp_ directly.
  void bind_pending() noexcept {
    pending_.k = kp_.data();
    pending_.d = dp_.data();
    const Index F = state_.S.rows();
    pending_.ar = ar_.data() + ar_half_ * F;
    pending_.ar_next = ar_.data() + (1 - ar_half_) * F;
  }
  // The pending update's per-channel decays (null when it has one decay).
  const Scalar* pending_decays() const noexcept {
    return pending_.per_row ? ar_.data() + ar_half_ * state_.S.rows() : nullptr;
  }

  // A state of this object's shape (checked, low part folded) as the one to continue from, with
  // no update pending; a low-precision state is rounded into the storage it has (no allocation
  // when the shapes agree).
  void adopt(State&& st, Index position) noexcept {
    if constexpr (kLowState) {
      state_.S.resize(st.S.rows(), st.S.cols());
      detail::narrow(st.S.data(), state_.S.data(), st.S.size());
    } else {
      state_ = std::move(st);
    }
    pending_.pending = false;
    position_ = position;
  }

  // Row r of state() (M entries) into `row`, through the same delta_flush as state(): the
  // same bits, without a copy of the whole state.
  void settled_row(Index r, Scalar* row) const {
    const Index M = state_.S.cols();
    if constexpr (kLowState) {
      detail::delta_settled_low_row(
          state_.S.data() + r * state_.S.outerStride(), M, pending_.pending, pending_.a,
          pending_.per_row ? pending_decays() + r : nullptr, kp_.data() + r, dp_.data(), row);
    } else {
      std::copy(state_.S.data() + r * state_.S.outerStride(),
                state_.S.data() + r * state_.S.outerStride() + M, row);
      if (pending_.pending)
        detail::delta_flush(row, M, 1, M, pending_.a,
                            pending_.per_row ? pending_decays() + r : nullptr, kp_.data() + r,
                            dp_.data());
    }
  }

  Phi phi_;
  DeltaOptions options_;
  Index key_dim_ = 0, value_dim_ = 0;
  Index position_ = 0;
  // S_{t-1} while the last token's update is pending (pending_): state() applies it to a copy.
  Snapshot state_;
  detail::TokenFeatures<Scalar> token_;
  Vector<Scalar> pqv_, pkv_, v_, o_, yq_, yk_;
  Vector<Scalar> kp_, dp_;
  // Per-channel decays: two halves of F, the pending update's (ar_half_) and the next token's.
  Vector<Scalar> ar_, wa_;
  Index ar_half_ = 0;
  detail::DeltaPending<Scalar> pending_;
};

}  // namespace linattn
