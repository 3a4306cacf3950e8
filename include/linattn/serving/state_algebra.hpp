/// \file serving/state_algebra.hpp
/// \brief The causal state as a sum: combine() two segments' states, summarize() a segment.
#pragma once

#include <Eigen/Core>

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../core/detail/views.hpp"
#include "../maps/elu_plus_one.hpp"
#include "../maps/feature_map.hpp"
#include "../core/state.hpp"
#include "../core/workspace.hpp"
#include "../maps/map_state.hpp"

namespace linattn {

namespace detail {

inline std::string state_shape(Index F, Index M, Index maxima) {
  return "S " + shape_string(F, M) + (maxima > 0 ? ", " + std::to_string(maxima) + " maxima" : "");
}

}  // namespace detail

/// \brief `a` becomes the state of a's keys followed by b's: \f$S_a + S_b\f$ and
/// \f$z_a + z_b\f$, exactly up to one rounding of each entry (spec §8); for decayed states
/// \f$e^{\Lambda_b} S_a + S_b\f$ (below).
///
/// A state is a sum over keys, \f$S = \sum_j \varphi(k_j) v_j^\top\f$ and
/// \f$z = \sum_j \varphi(k_j)\f$, so the states of consecutive segments of a sequence add up to
/// the state of the whole: summarise segments on different threads or processes, combine the
/// states (in any order and bracketing: the sum is associative up to rounding), and continue
/// from the combined state. For SoftmaxSplit, whose states hold sums shifted by per-feature
/// running maxima \f$m\f$ (\f$S = \sum_j e^{k_j - m} v_j^\top\f$ per feature), both sides are
/// first rescaled to the larger maximum, as online softmax merges partial sums. The
/// compensated low parts (LinearAttentionState::S_lo, z_lo) of both sides are kept: the sum of
/// the high parts is added with TwoSum, its rounding error going into the low part.
///
/// **Decayed states** (gated_linear_attention(); spec §8 and §9.4) carry the total log-decay
/// \f$\Lambda\f$ of their segment in LinearAttentionState::log_decay: empty (\f$\Lambda = 0\f$,
/// an undecayed state), one entry (a per-token scalar decay) or F entries (per-feature gates).
/// The keys of a decay over b's whole segment, so the state of a then b is
/// \f[
///   S = \mathrm{diag}\big(e^{\Lambda_b}\big)\, S_a + S_b, \qquad
///   z = e^{\Lambda_b} \odot z_a + z_b, \qquad
///   \Lambda = \Lambda_a + \Lambda_b,
/// \f]
/// where a scalar \f$\Lambda_b\f$ scales every row alike, and a one-entry \f$\Lambda\f$
/// combined with an F-entry one broadcasts (the result has F entries). The low parts of a are
/// scaled with its high parts. When \f$\Lambda_b\f$ is empty (b undecayed, whatever a is), a
/// is not scaled and the sums are those of the undecayed combine bit for bit; otherwise each
/// entry of the scaled a, \f$e^{\Lambda_b}(S_a + S_{a,lo})\f$, is rounded once (a relative
/// error of at most one unit roundoff per part, besides that of the exponential), and the sum
/// with b then keeps its rounding error in the low part as above. Combine is associative for
/// decayed states too (to rounding): both bracketings of a, b, c give
/// \f$e^{\Lambda_b + \Lambda_c} S_a + e^{\Lambda_c} S_b + S_c\f$ and
/// \f$\Lambda_a + \Lambda_b + \Lambda_c\f$. The entries of \f$\Lambda\f$ are not checked
/// (the kernels check the gates): \f$-\infty\f$ (a reset) makes a vanish. SoftmaxSplit states
/// (running maxima) never have a log-decay.
///
/// An empty state (default-constructed) is the identity: combining with it copies or leaves
/// the other. Allocates only a copy of b's sums (and the combined log-decay).
/// \throws std::invalid_argument (naming both shapes) if the states have different F, M or
/// one has running maxima and the other not; (naming both sizes) if a log-decay has neither
/// 0, 1 nor F entries; or if a state has both running maxima and a log-decay. `a` is then
/// unchanged.
/// \code
/// auto left = linattn::summarize(K.topRows(n), V.topRows(n), phi);
/// auto right = linattn::summarize(K.bottomRows(N - n), V.bottomRows(N - n), phi);
/// linattn::combine_into(left, right);  // == linattn::summarize(K, V, phi), to rounding
/// \endcode
/// \param a the state of the earlier keys; becomes the state of both segments.
/// \param b the state of the keys that follow a's.
template <class Scalar>
void combine_into(LinearAttentionState<Scalar>& a, const LinearAttentionState<Scalar>& b) {
  constexpr const char* fn = "combine_into";
  if (b.empty()) return;
  if (a.empty()) {
    a = b;
    if (a.S_lo.size() == 0) a.S_lo.setZero(a.S.rows(), a.S.cols());
    if (a.z_lo.size() == 0) a.z_lo.setZero(a.z.size());
    return;
  }
  const auto bad_lo = [](const LinearAttentionState<Scalar>& s) {
    return (s.S_lo.size() != 0 && (s.S_lo.rows() != s.S.rows() || s.S_lo.cols() != s.S.cols())) ||
           (s.z_lo.size() != 0 && s.z_lo.size() != s.z.size()) || s.z.size() != s.S.rows() ||
           (s.m.size() != 0 && s.m.size() != s.z.size());
  };
  if (bad_lo(a) || bad_lo(b))
    detail::throw_invalid(fn, "a state's parts disagree in shape (S, z, low parts, maxima)");
  if (a.S.rows() != b.S.rows() || a.S.cols() != b.S.cols() || a.m.size() != b.m.size())
    detail::throw_invalid(fn, "the states differ in shape: a has " +
                                  detail::state_shape(a.S.rows(), a.S.cols(), a.m.size()) +
                                  ", b has " +
                                  detail::state_shape(b.S.rows(), b.S.cols(), b.m.size()));
  const Index F = a.S.rows(), La = a.log_decay.size(), Lb = b.log_decay.size();
  const auto decay_fits = [F](Index n) { return n == 0 || n == 1 || n == F; };
  if (!decay_fits(La) || !decay_fits(Lb))
    detail::throw_invalid(fn, "the log-decays do not fit: a has " + std::to_string(La) +
                                  " entries, b has " + std::to_string(Lb) +
                                  " (each must have 0, 1 or F = " + std::to_string(F) + ")");
  if ((La != 0 || Lb != 0) && a.m.size() != 0)
    detail::throw_invalid(fn, "a state with running maxima (SoftmaxSplit) has no log-decay, "
                              "but a's has " + std::to_string(La) + " entries and b's " +
                              std::to_string(Lb));
  // Everything that may allocate, before `a` changes.
  LinearAttentionState<Scalar> rest = b;
  if (rest.S_lo.size() == 0) rest.S_lo.setZero(b.S.rows(), b.S.cols());
  if (rest.z_lo.size() == 0) rest.z_lo.setZero(b.z.size());
  // Lambda = Lambda_a + Lambda_b, an empty one counting as 0 and one entry broadcasting.
  Vector<Scalar> log_decay;
  if (Lb != 0) {
    if (La == 0)
      log_decay = b.log_decay;
    else if (La == Lb)
      log_decay = a.log_decay + b.log_decay;
    else if (La == 1)
      log_decay = b.log_decay.array() + a.log_decay(0);
    else
      log_decay = a.log_decay.array() + b.log_decay(0);
  }
  if (a.S_lo.size() == 0) a.S_lo.setZero(a.S.rows(), a.S.cols());
  if (a.z_lo.size() == 0) a.z_lo.setZero(a.z.size());
  if (Lb != 0) {  // a decays over b's segment: each entry of the scaled a is rounded once
    if (Lb == 1) {
      const Scalar c = std::exp(b.log_decay(0));
      a.S *= c;
      a.S_lo *= c;
      a.z *= c;
      a.z_lo *= c;
    } else {
      for (Index d = 0; d < F; ++d) {
        const Scalar c = std::exp(b.log_decay(d));
        a.S.row(d) *= c;
        a.S_lo.row(d) *= c;
        a.z(d) *= c;
        a.z_lo(d) *= c;
      }
    }
    a.log_decay.swap(log_decay);
  }
  detail::merge_into(a, rest);
}

/// \brief The state of a's keys followed by b's (see combine_into()).
/// \param a the state of the earlier keys.
/// \param b the state of the keys that follow a's.
/// \return the state of a's keys then b's, as combine_into() leaves a.
template <class Scalar>
LinearAttentionState<Scalar> combine(const LinearAttentionState<Scalar>& a,
                                     const LinearAttentionState<Scalar>& b) {
  LinearAttentionState<Scalar> out = a;
  combine_into(out, b);
  return out;
}

/// \brief The state of a segment of keys and values with no queries: what
/// causal_linear_attention() carries out of the segment, computed as the non-causal kernel's
/// key pass (\f$S = \varphi(K)^\top V\f$, \f$z = \varphi(K)^\top 1\f$, blockwise with
/// compensated sums; running maxima for SoftmaxSplit). Equal to the causal kernels' state to
/// rounding. O(L·F·M) time, no L x F matrix.
/// \throws std::invalid_argument (naming the shapes) if K and V have different row counts or
/// the map does not accept K's width.
/// \code
/// // Thread t of T: the state of everything before its segment, then its outputs.
/// auto before = linattn::summarize(K.topRows(start), V.topRows(start), phi);
/// linattn::causal_linear_attention(Qt, Kt, Vt, phi, before, out_t, ws);
/// \endcode
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \return the state of the L keys, as the causal kernels would leave it after them.
template <class DK, class DV, class Phi = EluPlusOne>
LinearAttentionState<compute_scalar_t<typename DK::Scalar>> summarize(
    const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V, const Phi& phi = Phi{}) {
  using Scalar = compute_scalar_t<typename DK::Scalar>;
  constexpr const char* fn = "summarize";
  static_assert(std::is_same_v<typename DK::Scalar, typename DV::Scalar>,
                "linattn: K and V must have the same scalar type (cast one with .cast<T>())");
  static_assert(detail::is_storage_scalar_v<typename DK::Scalar>,
                "linattn: the scalar type must be float or double (or bf16 / half storage)");
  detail::static_check_feature_map<Phi, Scalar>();
  if (K.rows() != V.rows())
    detail::throw_invalid(fn, "K and V must have the same number of rows, got K " +
                                  detail::shape_of(K) + " and V " + detail::shape_of(V));
  detail::check_feature_map(fn, phi, K.cols());
  auto st = make_state<Scalar>(phi, K.cols(), V.cols());
  const detail::Viewed<DK> k(K.derived());  // bf16 / half widened into float
  const detail::Viewed<DV> v(V.derived());
  Workspace<Scalar> ws;
  detail::absorb_keys(phi, k.view, v.view, st.S, st.S_lo, st.z, st.z_lo, st.m, detail::NoMask{},
                      ws);
  return st;
}

}  // namespace linattn
