/// \file gated/recurrent_gated_attention.hpp
/// \brief The decode step of decayed and gated linear attention: one token at a time, O(F·M),
/// no allocation.
#pragma once

#include <Eigen/Core>

#include <string>
#include <type_traits>
#include <utility>

#include "../core/detail/checks.hpp"
#include "../core/detail/low_precision.hpp"
#include "../core/common.hpp"
#include "detail/gated_forward.hpp"
#include "../maps/feature_map.hpp"
#include "options.hpp"
#include "../maps/identity.hpp"
#include "../linear/recurrent_linear_attention.hpp"
#include "../core/state.hpp"
#include "../maps/map_state.hpp"

namespace linattn {

/// \brief The recurrent form of gated_linear_attention() (spec §9): per step,
/// \f[ S_t = \mathrm{diag}(\alpha_t) S_{t-1} + \varphi(k_t) v_t^\top, \qquad
///     \mathrm{out}_t = s\,\varphi(q_t)^\top S_t \f]
/// (\f$\alpha_t = e^{g_t}\f$ with one log gate for every feature, or one for all; with
/// GatedOptions::normalize the output is divided by \f$\varphi(q_t)^\top z_t\f$).
///
/// Each step() is one fused pass over the F x M state (every entry loaded and stored once) and
/// performs no allocation. The state is a LinearAttentionState, interchangeable with the
/// parallel kernels': prefill with gated_linear_attention() and hand the state over with
/// set_state(), or take state() and continue in parallel. The step keeps no low part (the
/// decay bounds the state's memory): state() returns S and z with zero low parts, and
/// set_state(state()) resumes bit for bit. step() checks the log gates' values as the parallel
/// kernels do (finite and <= 0). state() is a reference to the object's own state, which later
/// steps update; it changes nothing, so any number of threads may read it at once (while none
/// steps). save_state() / load_state() (state_io.hpp) park a decode in a compact file (S, z,
/// the log-decay and the position).
///
/// \tparam Phi a feature map without per-feature key softmax (Identity by default)
/// \tparam Scalar float or double: the arithmetic (tokens may be bf16 / half for float)
/// \tparam StateScalar what S is kept in between tokens: Scalar (the default), or
///         `Eigen::bfloat16` / `Eigen::half` for a float decoder (half the bytes a step moves;
///         S rounded once after every token, z and the log-decay kept in float; docs/SPEC.md
///         §9). state() is then a widened copy and set_state() rounds; save_state() records
///         the storage type.
/// \code
/// linattn::RecurrentGatedAttention<linattn::Identity, float> rnn(64, 64);
/// Eigen::VectorXf out(64);
/// for (Eigen::Index t = 0; t < T; ++t)
///   rnn.step(Q.row(t), K.row(t), V.row(t), log_a.row(t), out);  // a 1- or F-entry log gate
/// \endcode
template <class Phi = Identity, class Scalar = float, class StateScalar = Scalar>
class RecurrentGatedAttention {
  static_assert((detail::static_check_recurrent<Phi, Scalar>(), true));
  static constexpr bool kLowState = !std::is_same_v<StateScalar, Scalar>;
  static_assert(!kLowState ||
                    (std::is_same_v<Scalar, float> && detail::is_low_precision_v<StateScalar>),
                "linattn: RecurrentGatedAttention keeps its state in Scalar, or in "
                "Eigen::bfloat16 / Eigen::half for a float decoder");
  static_assert(!normalizes_keys_per_feature_v<Phi>,
                "linattn: the gated kernels need a product feature map (sim = φ(q)·φ(k)); a map "
                "with a per-feature key softmax (SoftmaxSplit) has no decayed form");

 public:
  /// The state the step decays and updates: S and z, and the total log-decay for combine().
  using State = LinearAttentionState<Scalar>;
  /// What S is kept in between tokens.
  using StateStorage = StateScalar;
  /// A rollback point of the batched decoders: the state as kept (S, z, the log-decay).
  using Snapshot = std::conditional_t<kLowState, detail::LowDecodeState<StateScalar>, State>;

  /// A zero state for keys and queries of dimension D and values of dimension M.
  /// \throws std::invalid_argument if D <= 0 or M < 0.
  /// \param key_dim D, the width of the query and key rows.
  /// \param value_dim M, the width of the value rows and of each output.
  /// \param options the query scale and normalisation every step applies (a step has no chunks).
  RecurrentGatedAttention(Index key_dim, Index value_dim, const GatedOptions& options = {})
      : RecurrentGatedAttention(key_dim, value_dim, Phi{}, options) {}

  /// As above, with a map that has parameters.
  /// \param key_dim D, the width of the query and key rows.
  /// \param value_dim M, the width of the value rows and of each output.
  /// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
  /// \param options the query scale and normalisation every step applies (a step has no chunks).
  RecurrentGatedAttention(Index key_dim, Index value_dim, const Phi& phi,
                          const GatedOptions& options = {})
      : phi_(phi), options_(options), key_dim_(key_dim), value_dim_(value_dim) {
    detail::check_dims("RecurrentGatedAttention", key_dim, value_dim);
    detail::check_feature_map("RecurrentGatedAttention", phi_, key_dim);
    const Index F = phi_.feature_dim(key_dim);
    state_ = Snapshot(F, value_dim);
    state_.log_decay.setZero(F);
    token_.resize(key_dim, F);
    pqv_.resize(F);
    pkv_.resize(F);
    w_.resize(F);
    alpha_.resize(F);
    v_.resize(value_dim);
    o_.resize(value_dim);
  }

  /// Consumes one token and writes its output (M entries) into `out`. q, k: D entries; v: M
  /// entries; log_gate: 1 entry (a scalar decay) or F (per-feature gates); row or column
  /// vectors, any expression. `out` may share memory with the inputs (all are copied first).
  /// No allocation. \throws std::invalid_argument on a wrong size or a log gate that is not
  /// finite and <= 0 (naming the entry, the value and the token, position()); the decoder is
  /// then unchanged.
  /// \param q the query row (D entries).
  /// \param k the key row (D entries).
  /// \param v the value row (M entries).
  /// \param log_gate the token's log-decay (1 or F entries, all <= 0).
  /// \param out receives the token's M output entries.
  template <class DQ, class DK, class DV, class DG, class DOut>
  void step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
            const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& log_gate,
            const Eigen::MatrixBase<DOut>& out) {
    detail::static_check_scalars<DQ, DK, DV>();
    static_assert(std::is_same_v<compute_scalar_t<typename DQ::Scalar>, Scalar> &&
                      std::is_same_v<typename DG::Scalar, typename DQ::Scalar> &&
                      std::is_same_v<compute_scalar_t<typename DOut::Scalar>, Scalar>,
                  "linattn: the token's scalar type must be the RecurrentGatedAttention's (or "
                  "bf16 / half for a float one)");
    const char* fn = "RecurrentGatedAttention::step";
    const Index F = state_.S.rows();
    detail::check_token(fn, "q", q, key_dim_);
    detail::check_token(fn, "k", k, key_dim_);
    detail::check_token(fn, "v", v, value_dim_);
    if ((log_gate.rows() != 1 && log_gate.cols() != 1) ||
        (log_gate.size() != 1 && log_gate.size() != F))
      detail::throw_invalid(fn, "log_gate is " + detail::shape_of(log_gate) +
                                    " but must be a vector of 1 or F = " + std::to_string(F) +
                                    " entries");
    detail::check_token(fn, "out", out, value_dim_);
    const bool per_feature = log_gate.size() > 1;
    token_.map(phi_, q, pqv_, QuerySide{options_.normalize});
    token_.map(phi_, k, pkv_, KeySide{options_.normalize});
    v_ = v.reshaped().template cast<Scalar>();
    const Index gw = log_gate.size();
    alpha_.head(gw) = log_gate.reshaped().template cast<Scalar>();
    check_log_gates(fn, gw);
    // The factors by the token's gates, as a prefill's strong block takes them (equal bits).
    const bool expm1 = detail::token_factors_inplace(alpha_.head(gw));
    const detail::GatedConfig<Scalar> cfg = detail::gated_config<Scalar>(options_, gw);
    const auto run = [&](auto form) {
      constexpr bool Expm1 = decltype(form)::value;
      detail::gated_token_weights<Expm1>(pqv_.data(), pkv_.data(), alpha_.data(), per_feature, F,
                                         cfg, state_.z.data(), w_.data());
      detail::gated_update_read<Expm1>(state_.S.data(), state_.S.outerStride(), F, value_dim_,
                                       alpha_.data(), per_feature, pkv_.data(), w_.data(),
                                       v_.data(), o_.data());
    };
    if (expm1)
      run(std::true_type{});
    else
      run(std::false_type{});
    detail::writable(out).reshaped() = o_.template cast<typename DOut::Scalar>();
    // log_decay keeps F entries (a scalar decay adds to each): sized once, so that no step
    // allocates; combine() reads F equal entries as the scalar decay they are.
    if (gw == F)
      state_.log_decay += log_gate.reshaped().template cast<Scalar>();
    else
      state_.log_decay.array() += static_cast<Scalar>(log_gate.reshaped()(0));
    ++position_;
  }

  /// step() with a scalar decay given as a number: \f$S_t = e^{g} S_{t-1} + \varphi(k_t) v_t^\top\f$.
  /// \code
  /// rnn.step(q, k, v, log_a(t), out);
  /// \endcode
  /// \param q the query row (D entries).
  /// \param k the key row (D entries).
  /// \param v the value row (M entries).
  /// \param log_gate the token's log-decay (1 or F entries, all <= 0).
  /// \param out receives the token's M output entries.
  template <class DQ, class DK, class DV, class DOut>
  void step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
            const Eigen::MatrixBase<DV>& v, Scalar log_gate, const Eigen::MatrixBase<DOut>& out) {
    const Eigen::Map<const Vector<Scalar>> g(&log_gate, 1);
    step(q, k, v, g, out);
  }

  /// Back to the empty sequence.
  void reset() {
    state_.reset();
    position_ = 0;
  }

  /// The current state (S, z; low parts zero; log_decay the F per-feature sums of the log gates
  /// seen, a scalar decay counting for every feature).
  /// With bf16 / half states, a copy (widened, exact).
  /// \return the state after position() tokens, valid until the next step or reset.
  std::conditional_t<kLowState, State, const State&> state() const noexcept(!kLowState) {
    if constexpr (kLowState) {
      State st(state_.S.rows(), state_.S.cols());
      detail::widen(state_.S.data(), st.S.data(), st.S.size());
      st.z = state_.z;
      st.log_decay = state_.log_decay;
      return st;
    } else {
      return state_;
    }
  }

  /// Continues from `state` (for example the one a gated_linear_attention() prefill left): its
  /// low parts are added into S and z. \throws std::invalid_argument if it does not fit,
  /// `position` is negative or an entry of its log_decay is NaN or > 0 (a total of log gates
  /// <= 0).
  /// \param state the state to continue from (copied).
  /// \param position the number of tokens the state has consumed, so that steps continue counting
  ///     from it.
  void set_state(const State& state, Index position = 0) {
    const char* fn = "RecurrentGatedAttention::set_state";
    detail::check_state_values(fn, state, position);
    State copy = state;
    detail::prepare_state(fn, copy, phi_, key_dim_, value_dim_);
    const Index F = copy.S.rows();
    if (copy.log_decay.size() > 1 && copy.log_decay.size() != F)
      detail::throw_invalid(fn, "the state's log_decay has " +
                                    std::to_string(copy.log_decay.size()) +
                                    " entries but must have 0, 1 or F = " + std::to_string(F));
    if (copy.log_decay.size() != F) {  // none (0) or a scalar decay's total: F entries
      const Scalar total = copy.log_decay.size() == 1 ? copy.log_decay(0) : Scalar(0);
      copy.log_decay.setConstant(F, total);
    }
    copy.S += copy.S_lo;
    copy.z += copy.z_lo;
    copy.S_lo.setZero();
    copy.z_lo.setZero();
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
  const GatedOptions& options() const noexcept { return options_; }

 private:
  // save_state() / load_state() (state_io.hpp) restore the state's bits and position() as
  // saved; set_state() would add the (zero) low parts, turning a -0 of S into +0.
  friend struct detail::RecurrentStateAccess;
  // The batched decoders' rollback snapshots: the state copied out without allocating (once
  // sized), and a snapshot swapped in.
  template <class>
  friend class BatchedHeads;
  void snapshot_into(Snapshot& out) const {
    if (out.S.rows() != state_.S.rows() || out.S.cols() != state_.S.cols() ||
        out.log_decay.size() != state_.log_decay.size())
      out = state_;
    else {
      out.S = state_.S;
      out.z = state_.z;
      out.log_decay = state_.log_decay;
    }
  }
  void restore_from(Snapshot& snapshot, Index position) noexcept {
    std::swap(state_.S, snapshot.S);
    std::swap(state_.z, snapshot.z);
    std::swap(state_.log_decay, snapshot.log_decay);
    position_ = position;
  }

  // A checked state of this object's shape (low parts folded, F log-decay entries) as the one
  // to continue from; a low-precision S is rounded into the storage it has.
  void adopt(State&& st, Index position) noexcept {
    if constexpr (kLowState) {
      state_.S.resize(st.S.rows(), st.S.cols());
      detail::narrow(st.S.data(), state_.S.data(), st.S.size());
      state_.z.swap(st.z);
      state_.log_decay.swap(st.log_decay);
    } else {
      state_ = std::move(st);
    }
    position_ = position;
  }

  // The gw log gates of the token (in alpha_, before their exponentials), as the parallel
  // kernels check theirs; nothing has changed yet when this throws.
  void check_log_gates(const char* fn, Index gw) const {
    // Two vectorized reductions, as a loop of comparisons does not vectorize: g·0 is NaN for a
    // NaN or ±inf gate, and the maximum catches the positive ones.
    const auto a = alpha_.head(gw).array();
    if (a.maxCoeff() <= Scalar(0) && (a * Scalar(0)).sum() == Scalar(0)) return;
    for (Index i = 0; i < gw; ++i)
      if (!detail::finite_nonpositive(alpha_(i)))
        detail::throw_step_value(fn, gw == 1 ? std::string("log_gate")
                                             : "log_gate(" + std::to_string(i) + ")",
                                 alpha_(i), position_, "log gates must be finite and <= 0");
  }

  Phi phi_;
  GatedOptions options_;
  Index key_dim_, value_dim_;
  Index position_ = 0;
  Snapshot state_;
  detail::TokenFeatures<Scalar> token_;
  Vector<Scalar> pqv_, pkv_, w_, alpha_, v_, o_;
};

}  // namespace linattn
