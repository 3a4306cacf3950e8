/// \file linear/recurrent_linear_attention.hpp
/// \brief Causal linear attention as an RNN: one token per step at O(F·M), whatever the
/// position.
#pragma once

#include <Eigen/Core>

#include <string>
#include <type_traits>
#include <utility>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../core/detail/views.hpp"
#include "../maps/elu_plus_one.hpp"
#include "../maps/feature_map.hpp"
#include "../core/state.hpp"
#include "../maps/map_state.hpp"

namespace linattn {
namespace detail {

struct RecurrentStateAccess;  // state_io.hpp: saves and restores the exact decoding position

template <class D>
void check_token(const char* function, const char* name, const Eigen::MatrixBase<D>& x,
                 Index expected) {
  if ((x.rows() != 1 && x.cols() != 1) || x.size() != expected)
    throw_invalid_parts(function, {name, " is ", x.rows(), "x", x.cols(),
                                   " but must be a vector of ", expected, " entries"});
}

// The value checks of a decode step's gates and betas, as the parallel kernels check theirs
// (one comparison per entry, beside the step's F·M update). `entry` names it ("log_gate(3)",
// "beta"); `token` is the decoder's position(), the index of the token being consumed.
template <class Scalar>
bool finite_nonpositive(Scalar g) noexcept {
  return g <= Scalar(0) && g - g == Scalar(0);  // g - g is NaN for +-inf and NaN
}
template <class Scalar>
[[noreturn]] void throw_step_value(const char* function, const std::string& entry, Scalar value,
                                   Index token, const char* rule) {
  throw_invalid(function, entry + " = " + value_string(value) + " (token " +
                              std::to_string(token) + "): " + rule);
}

template <class FeatureMap, class Scalar>
constexpr void static_check_recurrent() {
  static_assert(is_supported_scalar_v<Scalar>, "linattn: the scalar type must be float or double");
  static_assert(is_feature_map_v<FeatureMap, Scalar>,
                "linattn: FeatureMap does not model linattn::FeatureMap (see "
                "linattn/feature_map.hpp)");
}

inline void check_dims(const char* function, Index key_dim, Index value_dim) {
  if (key_dim <= 0 || value_dim < 0)
    throw_invalid_parts(function, {"key_dim must be positive and value_dim non-negative, got "
                                   "key_dim = ", key_dim, ", value_dim = ", value_dim});
}

}  // namespace detail

/// \brief The recurrent ("RNN") form of causal linear attention (spec §3):
/// \f[ S_i = S_{i-1} + \varphi(k_i) v_i^\top,\quad z_i = z_{i-1} + \varphi(k_i),\quad
///     \mathrm{out}_i = \frac{\varphi(q_i)^\top S_i}{\max(\varphi(q_i)^\top z_i, \varepsilon)} \f]
///
/// Holds S (F x M) and z (F); each step() costs O(F·M) time and no allocation, so decoding
/// token 100 000 costs the same as token 10. Copy the object to fork a sequence (beam search).
/// The state is interchangeable with the parallel causal_linear_attention(): prefill a
/// prompt in parallel, hand its state over with set_state(), then decode token by token; or
/// take state() and continue in parallel. SoftmaxSplit keeps running maxima (see
/// LinearAttentionState).
///
/// \tparam FeatureMap a feature map (see feature_map.hpp)
/// \tparam Scalar float or double
/// \code
/// linattn::RecurrentLinearAttention<linattn::EluPlusOne, float> rnn(64, 64);
/// Eigen::VectorXf out(64);
/// for (Eigen::Index t = 0; t < T; ++t)
///   rnn.step(Q.row(t), K.row(t), V.row(t), out);  // no allocation
/// \endcode
template <class FeatureMap = EluPlusOne, class Scalar = float>
class RecurrentLinearAttention {
  static_assert((detail::static_check_recurrent<FeatureMap, Scalar>(), true));

 public:
  /// The state the step adds to: the sums S and z (and SoftmaxSplit's running maxima).
  using State = LinearAttentionState<Scalar>;

  /// A zero state for keys/queries of dimension `key_dim` and values of dimension `value_dim`.
  /// \throws std::invalid_argument if key_dim <= 0 or value_dim < 0.
  /// \param key_dim D, the width of the query and key rows.
  /// \param value_dim M, the width of the value rows and of each output.
  /// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
  RecurrentLinearAttention(Index key_dim, Index value_dim, FeatureMap phi = FeatureMap{})
      : phi_(std::move(phi)), key_dim_(key_dim), value_dim_(value_dim) {
    detail::check_dims("RecurrentLinearAttention", key_dim, value_dim);
    detail::check_feature_map("RecurrentLinearAttention", phi_, key_dim);
    const Index F = phi_.feature_dim(key_dim);
    state_ = State(F, value_dim, normalizes_keys_per_feature_v<FeatureMap>);
    scratch_.resize(key_dim, F, value_dim);
  }

  /// Consumes one token and writes its output (M entries) into `out`, a vector of the
  /// caller's; performs no heap allocation. q, k: key_dim entries; v: value_dim entries
  /// (row or column vectors, any expression). `out` may share memory with q, k or v: all
  /// three are copied before `out` is written.
  /// \throws std::invalid_argument on a wrong size.
  /// \param q the query row (D entries).
  /// \param k the key row (D entries).
  /// \param v the value row (M entries).
  /// \param out receives the token's M output entries.
  template <class DQ, class DK, class DV, class DOut>
  void step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
            const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DOut>& out) {
    detail::static_check_scalars<DQ, DK, DV>();
    static_assert(std::is_same_v<compute_scalar_t<typename DQ::Scalar>, Scalar> &&
                      std::is_same_v<compute_scalar_t<typename DOut::Scalar>, Scalar>,
                  "linattn: the token's scalar type must be the RecurrentLinearAttention's (or "
                  "bf16 / half for a float one)");
    check_step(q, k, v);
    detail::check_token("RecurrentLinearAttention::step", "out", out, value_dim_);
    // bf16 / half tokens are widened here; the state stays in Scalar.
    scratch_.load(phi_, q, k, v);
    scratch_.update_and_read(phi_, state_);
    detail::assign_narrowed(detail::writable(out), scratch_.o);
    ++position_;
    // The step adds the token to the low parts of the state; folding them into the high parts
    // every kFoldTokens steps keeps the sums exact to rounding over any number of tokens, for
    // a fraction of a step's cost.
    if (++unfolded_ == kFoldTokens) {
      state_.fold();
      unfolded_ = 0;
    }
  }

  /// Consumes one token and returns its output (allocates the returned vector), of the
  /// token's scalar type.
  /// \param q the query row (D entries).
  /// \param k the key row (D entries).
  /// \param v the value row (M entries).
  /// \return the token's M output entries.
  template <class DQ, class DK, class DV>
  Vector<typename DQ::Scalar> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                   const Eigen::MatrixBase<DV>& v) {
    Vector<typename DQ::Scalar> out(value_dim_);
    step(q, k, v, out);
    return out;
  }

  /// Back to the empty sequence.
  void reset() {
    state_.reset();
    position_ = 0;
    unfolded_ = 0;
  }

  /// A copy of the current state (S, z and, for SoftmaxSplit, the running maxima) with the
  /// latest tokens folded in, so that S and z are the correctly rounded sums (see
  /// LinearAttentionState); O(F·M). Between folds the object keeps up to kFoldTokens - 1 of
  /// the latest tokens in the low parts of its own state.
  /// \return the folded state after position() tokens.
  State state() const {
    State copy = state_;
    copy.fold();
    return copy;
  }

  /// Steps between two folds of the state's low parts into its high parts.
  static constexpr Index kFoldTokens = 128;

  /// Continues from `state` (for example the one a parallel prefill returned); `position`
  /// is only informative.
  /// \throws std::invalid_argument if the state does not fit this object's shapes, `position`
  /// is negative, or an entry of its log_decay is NaN or > 0 (a total of log gates <= 0).
  /// \param state the state to continue from (copied).
  /// \param position the number of tokens the state has consumed, so that steps continue counting
  ///     from it.
  void set_state(const State& state, Index position = 0) {
    detail::check_state_values("RecurrentLinearAttention::set_state", state, position);
    State copy = state;
    detail::prepare_state("RecurrentLinearAttention::set_state", copy, phi_, key_dim_, value_dim_);
    copy.fold();
    state_ = std::move(copy);
    position_ = position;
    unfolded_ = 0;
  }

  /// Tokens consumed since construction, reset() or set_state().
  /// \return the position, the index the next step's token will have.
  Index position() const noexcept { return position_; }
  /// The width D of the query and key rows.
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
  const FeatureMap& feature_map() const noexcept { return phi_; }

 private:
  // save_state() / load_state() keep the unfolded low parts and the fold schedule, so that a
  // resumed decode is bit-identical; state() and set_state() fold and restart the schedule.
  friend struct detail::RecurrentStateAccess;

  template <class DQ, class DK, class DV>
  void check_step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                  const Eigen::MatrixBase<DV>& v) const {
    const char* fn = "RecurrentLinearAttention::step";
    detail::check_token(fn, "q", q, key_dim_);
    detail::check_token(fn, "k", k, key_dim_);
    detail::check_token(fn, "v", v, value_dim_);
  }

  FeatureMap phi_;
  Index key_dim_, value_dim_;
  Index position_ = 0;
  Index unfolded_ = 0;  // steps since the last fold of the state
  State state_;
  detail::DecodeScratch<Scalar> scratch_;  // so that step() never allocates
};


}  // namespace linattn
