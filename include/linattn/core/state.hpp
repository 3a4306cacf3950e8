/// \file core/state.hpp
/// \brief The recurrent state of linear attention and the operations every algorithm shares
/// on it: absorbing keys and values, and reading it with a query.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "detail/checks.hpp"
#include "common.hpp"
#include "detail/state_ops.hpp"
#include "workspace.hpp"

namespace linattn {

/// \brief The state of (causal) linear attention after some keys: \f$S = \sum_j
/// \varphi(k_j) v_j^\top\f$ (F x M) and \f$z = \sum_j \varphi(k_j)\f$ (F).
///
/// Each sum is kept as two parts, a high part (`S`, `z`) and a low part (`S_lo`, `z_lo`): the
/// state is \f$S + S_{lo}\f$ and \f$z + z_{lo}\f$ (compensated summation). The kernels add
/// the newest tokens to the low parts and regularly fold them into the high parts exactly
/// (Knuth's TwoSum), so that the sums keep their precision after any number of tokens: in float
/// a plain running sum stops changing once it is about 2^24 times a token's contribution, the
/// compensated one does not (docs/SPEC.md §3, "Accuracy of long sequences"). After every call
/// of a kernel (causal_linear_attention(), ...), and in the copy RecurrentLinearAttention::state()
/// returns, `S` and `z` are the correctly rounded sums and the low parts are below half an ulp
/// of them. A state whose low parts hold more (one you add to yourself) is folded with fold().
/// A state built by hand may leave `S_lo` and `z_lo` empty: the kernels read that as zero.
///
/// For maps with per-feature key softmax (SoftmaxSplit) the state is kept shifted for
/// stability: the true sums are \f$\mathrm{diag}(e^{m}) (S + S_{lo})\f$ and
/// \f$e^{m} \odot (z + z_{lo})\f$, where `m` holds the running maximum of each key feature
/// (−∞ before any key). For every other map `m` is empty.
///
/// A state made by one feature map must only be used with that map. States are plain values:
/// copy one to fork a sequence (beam search), pass it to causal_linear_attention() to
/// continue a sequence in pieces, or hand it to a RecurrentLinearAttention to decode.
///
/// \code
/// auto state = linattn::make_state<float>(linattn::EluPlusOne{}, D, M);
/// auto a = linattn::causal_linear_attention(Q.topRows(100), K.topRows(100), V.topRows(100),
///                                           linattn::EluPlusOne{}, state);
/// auto b = linattn::causal_linear_attention(Q.bottomRows(N - 100), K.bottomRows(N - 100),
///                                           V.bottomRows(N - 100), linattn::EluPlusOne{}, state);
/// // [a; b] equals the one-shot causal_linear_attention(Q, K, V)
/// \endcode
template <class Scalar>
struct LinearAttentionState {
  /// Row-major so that the recurrent kernel updates and reads it without horizontal sums.
  using StateMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  StateMatrix S;        ///< F x M, high part of the sum of φ(k) vᵀ (shifted by e^{-m} for SoftmaxSplit)
  Vector<Scalar> z;     ///< F, high part of the sum of φ(k) (shifted likewise)
  Vector<Scalar> m;     ///< F running key maxima for SoftmaxSplit; empty otherwise
  StateMatrix S_lo;     ///< F x M, low part of S (or empty: zero)
  Vector<Scalar> z_lo;  ///< F, low part of z (or empty: zero)
  /// The total log-decay of the keys the state holds, for states of the decayed and gated
  /// kernels (gated_linear_attention(); spec §9.4): one entry for a per-token scalar decay,
  /// F for per-feature gates, \f$\sum_t \log a_t\f$ over every token absorbed since the
  /// state was zero. combine() of two decayed segments needs it: the state of a then b is
  /// \f$e^{\Lambda_b} S_a + S_b\f$. Empty for undecayed states (no decay: 0).
  Vector<Scalar> log_decay;

  /// An empty state; kernels given one start from zero and size it.
  LinearAttentionState() = default;

  /// A zero state for F features and M values; `per_feature` adds the running maxima.
  /// \param feature_dim F, the feature map's width (Phi::feature_dim of the key width).
  /// \param value_dim M, the width of the values.
  /// \param per_feature true for a map that normalises keys per feature (SoftmaxSplit).
  LinearAttentionState(Index feature_dim, Index value_dim, bool per_feature = false)
      : S(StateMatrix::Zero(feature_dim, value_dim)),
        z(Vector<Scalar>::Zero(feature_dim)),
        S_lo(StateMatrix::Zero(feature_dim, value_dim)),
        z_lo(Vector<Scalar>::Zero(feature_dim)) {
    if (per_feature) m.setConstant(feature_dim, -std::numeric_limits<Scalar>::infinity());
  }

  /// \return true when S and z are both empty.
  /// True before the state has been sized.
  bool empty() const noexcept { return S.size() == 0 && z.size() == 0; }

  /// Back to "no keys seen", keeping the shape.
  void reset() {
    S.setZero();
    z.setZero();
    S_lo.setZero();
    z_lo.setZero();
    m.setConstant(-std::numeric_limits<Scalar>::infinity());
    log_decay.setZero();
  }

  /// Folds the low parts into the high parts exactly: afterwards `S` and `z` are the correctly
  /// rounded sums and `S_lo`, `z_lo` the (tiny) rounding residuals. Sizes empty low parts.
  void fold();
};

namespace detail {

// What a state of a decoder cannot be, for set_state() (std::invalid_argument), save_state()
// (likewise) and load_state() (a file's "invalid record"): "" when every entry of log_decay
// can be a total of log gates, which are <= 0 (-inf included: a sum that overflowed), else
// the first entry that cannot (NaN, +inf or positive). S and z are not checked: a NaN or inf
// there is a poisoned but representable state (a NaN token reaches it), which saves, loads
// and propagates as it is.
template <class Scalar>
std::string impossible_log_decay(const Vector<Scalar>& log_decay) {
  for (Index i = 0; i < log_decay.size(); ++i)
    if (!(log_decay(i) <= Scalar(0)))
      return "log_decay(" + std::to_string(i) + ") = " + value_string(log_decay(i)) +
             ": a total log-decay is a sum of log gates <= 0 (NaN, +inf and positive values "
             "are impossible)";
  return std::string();
}

// A decoder's set_state(): a negative position (a count of tokens) or an impossible log_decay
// (above) is std::invalid_argument.
inline void check_position(const char* function, Index position) {
  if (position < 0)
    throw_invalid(function, "position = " + std::to_string(position) +
                                ": a decoding position counts tokens and is never negative");
}
template <class Scalar>
void check_state_values(const char* function, const LinearAttentionState<Scalar>& st,
                        Index position) {
  check_position(function, position);
  const std::string bad = impossible_log_decay(st.log_decay);
  if (!bad.empty()) throw_invalid(function, "the state's " + bad);
}


}  // namespace detail


template <class Scalar>
void LinearAttentionState<Scalar>::fold() {
  if (S_lo.size() == 0) S_lo.setZero(S.rows(), S.cols());
  if (z_lo.size() == 0) z_lo.setZero(z.size());
  detail::fold_state(S, S_lo, z, z_lo);
}

}  // namespace linattn
