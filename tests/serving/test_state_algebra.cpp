// The state as an algebra (state_algebra.hpp, spec §8): summarize() gives the state the causal
// kernel carries out of a segment; combine() of the segments' states, in any bracketing, gives
// the whole sequence's state; continuing from a combined state gives the one-shot outputs.
// Decayed states (log_decay, spec §8 and §9.4) combine as diag(e^{Λ_b}) S_a + S_b, associatively.
#include <linattn/linattn.hpp>
#include <linattn/gated_attention.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "test_util.hpp"

namespace {

using linattn::EluPlusOne;
using linattn::LinearAttentionState;
using linattn::NormalizedCosine;
using linattn::SoftmaxSplit;
using test::Index;
using test::Mat;
using test::MatD;

// The sums a state stands for, in double: diag(e^m) (S + S_lo) and diag(e^m) (z + z_lo).
template <class S>
std::pair<MatD, Eigen::VectorXd> effective(const LinearAttentionState<S>& st) {
  MatD Sd = st.S.template cast<double>();
  Eigen::VectorXd zd = st.z.template cast<double>();
  if (st.S_lo.size()) Sd += st.S_lo.template cast<double>();
  if (st.z_lo.size()) zd += st.z_lo.template cast<double>();
  for (Index d = 0; d < st.m.size(); ++d) {
    const double c = std::isinf(double(st.m(d))) ? 0.0 : std::exp(double(st.m(d)));
    Sd.row(d) *= c;
    zd(d) *= c;
  }
  return {Sd, zd};
}

// Relative difference of two states' sums (0 when both are zero).
template <class S>
double state_diff(const LinearAttentionState<S>& a, const LinearAttentionState<S>& b) {
  const auto [Sa, za] = effective(a);
  const auto [Sb, zb] = effective(b);
  const double scale = std::max({1e-300, Sa.cwiseAbs().maxCoeff(), za.cwiseAbs().maxCoeff()});
  return std::max((Sa - Sb).cwiseAbs().maxCoeff(), (za - zb).cwiseAbs().maxCoeff()) / scale;
}

std::string map_name(const EluPlusOne&) { return "EluPlusOne"; }
std::string map_name(const SoftmaxSplit&) { return "SoftmaxSplit"; }
std::string map_name(const NormalizedCosine&) { return "NormalizedCosine"; }

template <class S, class Map>
std::string tag(const Map& phi) {
  return std::string(test::scalar_name<S>()) + " " + map_name(phi);
}

// Measured: ≤ 5.3e-16 (double) and ≤ 1.1e-7 (float) across the state checks below.
template <class S>
double tol() {
  return test::bound<S>(1e-6, 2e-15);
}

// summarize() == the state causal_linear_attention carries out, for both algorithms.
template <class S, class Map>
void check_summary_is_the_causal_state(const Map& phi) {
  const Index L = 301, D = 7, M = 5;
  const Mat<S> Q = test::random_matrix<S>(L, D, 11), K = test::random_matrix<S>(L, D, 12),
               V = test::random_matrix<S>(L, M, 13);
  const auto sum = linattn::summarize(K, V, phi);
  for (const auto alg : {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent}) {
    LinearAttentionState<S> st;
    linattn::CausalOptions opts;
    opts.algorithm = alg;
    linattn::causal_linear_attention(Q, K, V, phi, st, opts);
    const double err = state_diff(sum, st);
    test::report_error(tag<S>(phi) + " summarize vs causal state", err);
    EXPECT_LE(err, tol<S>()) << tag<S>(phi);
  }
}

// k segments (one empty, lengths not multiples of any block): left fold, right fold and a
// balanced tree of combine() all give the one-shot state; and the causal outputs of the last
// segment, continued from the combined state of the others, are the one-shot rows.
template <class S, class Map>
void check_associativity(const Map& phi) {
  const Index L = 700, D = 6, M = 9;
  const Mat<S> Q = test::random_matrix<S>(L, D, 21), K = test::random_matrix<S>(L, D, 22),
               V = test::random_matrix<S>(L, M, 23);
  const std::vector<Index> cuts = {0, 129, 129, 300, 511, 640, L};  // segment 2 is empty
  std::vector<LinearAttentionState<S>> parts;
  for (std::size_t i = 0; i + 1 < cuts.size(); ++i)
    parts.push_back(linattn::summarize(K.middleRows(cuts[i], cuts[i + 1] - cuts[i]),
                                       V.middleRows(cuts[i], cuts[i + 1] - cuts[i]), phi));
  const auto whole = linattn::summarize(K, V, phi);

  LinearAttentionState<S> left;  // empty: the identity
  for (const auto& p : parts) linattn::combine_into(left, p);
  LinearAttentionState<S> right;
  for (std::size_t i = parts.size(); i-- > 0;) right = linattn::combine(parts[i], right);
  std::vector<LinearAttentionState<S>> level = parts;
  while (level.size() > 1) {
    std::vector<LinearAttentionState<S>> next;
    for (std::size_t i = 0; i < level.size(); i += 2)
      next.push_back(i + 1 < level.size() ? linattn::combine(level[i], level[i + 1]) : level[i]);
    level = next;
  }
  for (const auto& [name, st] : {std::pair<const char*, const LinearAttentionState<S>*>{"left", &left},
                                 {"right", &right},
                                 {"tree", &level[0]}}) {
    const double err = state_diff(*st, whole);
    test::report_error(tag<S>(phi) + " " + name + " fold vs one-shot", err);
    EXPECT_LE(err, tol<S>()) << tag<S>(phi) << " " << name;
  }

  // The last segment from the combined state of everything before it.
  const Index start = cuts[cuts.size() - 2], n = L - start;
  LinearAttentionState<S> before;
  for (std::size_t i = 0; i + 2 < cuts.size(); ++i) linattn::combine_into(before, parts[i]);
  const Mat<S> tail = linattn::causal_linear_attention(Q.bottomRows(n), K.bottomRows(n),
                                                       V.bottomRows(n), phi, before);
  const Mat<S> full = linattn::causal_linear_attention(Q, K, V, phi);
  const double err = test::max_abs_diff(tail, full.bottomRows(n));
  test::report_error(tag<S>(phi) + " segment from combined state vs one-shot", err);
  EXPECT_LE(err, test::bound<S>(1e-7, 2e-16)) << tag<S>(phi);  // measured 1.5e-8, 3.5e-17
}

TEST(StateAlgebra, SummarizeIsTheCausalState) {
  test::for_each_map_scalar<EluPlusOne, SoftmaxSplit, NormalizedCosine>([](auto phi, auto s) {
    check_summary_is_the_causal_state<typename decltype(s)::type>(phi);
  });
}

TEST(StateAlgebra, CombineIsAssociativeAndContinuesTheSequence) {
  test::for_each_map_scalar<EluPlusOne, SoftmaxSplit, NormalizedCosine>([](auto phi, auto s) {
    check_associativity<typename decltype(s)::type>(phi);
  });
}

// SoftmaxSplit segments whose keys differ by e^±100 (the maxima of one side dominate): the
// rescaling to the larger maximum keeps the sums finite and exact.
TEST(StateAlgebra, SoftmaxSplitMaximaFarApart) {
  const Index L = 200, D = 4, M = 3;
  Mat<float> K = test::random_matrix<float>(L, D, 31), V = test::random_matrix<float>(L, M, 32);
  K.topRows(100).array() += 100.0f;
  K.bottomRows(100).array() -= 100.0f;
  const SoftmaxSplit phi;
  const auto whole = linattn::summarize(K, V, phi);
  for (const bool swap : {false, true}) {
    auto a = linattn::summarize(K.topRows(100), V.topRows(100), phi);
    auto b = linattn::summarize(K.bottomRows(100), V.bottomRows(100), phi);
    const auto c = swap ? linattn::combine(b, a) : linattn::combine(a, b);
    EXPECT_TRUE(c.S.allFinite() && c.z.allFinite() && c.m.allFinite());
    EXPECT_LE(state_diff(c, whole), 1e-6) << (swap ? "b then a" : "a then b");
  }
}

TEST(StateAlgebra, EmptyStatesAreTheIdentity) {
  const Mat<double> K = test::random_matrix<double>(50, 4, 41), V = test::random_matrix<double>(50, 3, 42);
  const auto s = linattn::summarize(K, V, EluPlusOne{});
  EXPECT_EQ(state_diff(linattn::combine(LinearAttentionState<double>{}, s), s), 0.0);
  EXPECT_EQ(state_diff(linattn::combine(s, LinearAttentionState<double>{}), s), 0.0);
  // A segment of no keys: a zero state of the right shape.
  const auto none = linattn::summarize(K.topRows(0), V.topRows(0), EluPlusOne{});
  EXPECT_EQ(none.S.rows(), 4);
  EXPECT_EQ(none.S.cols(), 3);
  EXPECT_EQ(state_diff(linattn::combine(none, s), s), 0.0);
}

TEST(StateAlgebra, ErrorsNameTheFunctionAndTheShapes) {
  const Mat<double> K = test::random_matrix<double>(20, 4, 51), V = test::random_matrix<double>(20, 3, 52);
  test::expect_invalid([&] { linattn::summarize(K, V.topRows(19), EluPlusOne{}); },
                       {"linattn::summarize", "20x4", "19x3"}, "summarize rows");
  auto a = linattn::summarize(K, V, EluPlusOne{});
  const auto before = a;
  const auto b = linattn::summarize(K.leftCols(3), V, EluPlusOne{});
  test::expect_invalid([&] { linattn::combine_into(a, b); },
                       {"linattn::combine_into", "S 4x3", "S 3x3"}, "combine F");
  EXPECT_EQ(state_diff(a, before), 0.0) << "a failed combine_into left a changed";
  const auto c = linattn::summarize(K, V, SoftmaxSplit{});
  test::expect_invalid([&] { linattn::combine(a, c); },
                       std::vector<std::string>{"linattn::combine_into", "4 maxima"},
                       "combine maxima");
}

// ------------------------------------------------------------------------------------------
// Decayed states (spec §8, §9.4): the state of a then b is diag(e^{Λ_b}) S_a + S_b.
// ------------------------------------------------------------------------------------------

// A decayed state built by hand: random S, z and (small) low parts, and `decay` entries of
// total log-decay in [-3, 0] (empty for decay = 0).
LinearAttentionState<double> decayed(Index F, Index M, Index decay, std::uint32_t seed) {
  LinearAttentionState<double> st(F, M);
  st.S = test::random_matrix<double>(F, M, seed, -2, 2);
  st.S_lo = test::random_matrix<double>(F, M, seed + 1, -1e-17, 1e-17);
  st.z = test::random_matrix<double>(F, 1, seed + 2, 0, 2);
  st.z_lo = test::random_matrix<double>(F, 1, seed + 3, -1e-17, 1e-17);
  if (decay > 0) st.log_decay = test::random_matrix<double>(decay, 1, seed + 4, -3, 0);
  return st;
}

// Λ as F entries (an empty one as zeros, one entry broadcast).
Eigen::VectorXd full_decay(const LinearAttentionState<double>& st, Index F) {
  if (st.log_decay.size() == 0) return Eigen::VectorXd::Zero(F);
  if (st.log_decay.size() == 1) return Eigen::VectorXd::Constant(F, st.log_decay(0));
  return st.log_decay;
}

// The combine computed directly, in double from the represented sums: diag(e^{Λ_b}) (S_a +
// S_a,lo) + (S_b + S_b,lo), likewise z, and Λ_a + Λ_b.
LinearAttentionState<double> direct_combine(const LinearAttentionState<double>& a,
                                            const LinearAttentionState<double>& b) {
  const Index F = a.S.rows();
  const Eigen::VectorXd c = full_decay(b, F).array().exp().matrix();
  LinearAttentionState<double> out;
  out.S = c.asDiagonal() * (a.S + a.S_lo) + (b.S + b.S_lo);
  out.z = c.asDiagonal() * (a.z + a.z_lo) + (b.z + b.z_lo);
  if (a.log_decay.size() == 0)
    out.log_decay = b.log_decay;
  else if (b.log_decay.size() == 0)
    out.log_decay = a.log_decay;
  else if (a.log_decay.size() == b.log_decay.size())
    out.log_decay = a.log_decay + b.log_decay;
  else  // one entry and F: broadcast
    out.log_decay = full_decay(a, F) + full_decay(b, F);
  return out;
}

TEST(StateAlgebraDecay, CombineMatchesTheDirectComputation) {
  const Index F = 6, M = 5;
  // (entries of Λ_a, entries of Λ_b): scalar, per-feature, mixed (broadcast) and undecayed.
  const std::vector<std::pair<Index, Index>> kinds = {{0, 1}, {1, 1}, {F, F}, {1, F},
                                                      {F, 1}, {0, F}, {F, 0}, {1, 0}};
  std::uint32_t seed = 100;
  for (const auto& [La, Lb] : kinds) {
    SCOPED_TRACE("log-decays of " + std::to_string(La) + " and " + std::to_string(Lb) +
                 " entries");
    const auto a = decayed(F, M, La, seed), b = decayed(F, M, Lb, seed + 10);
    seed += 20;
    const auto expected = direct_combine(a, b);
    const auto got = linattn::combine(a, b);
    const double err = state_diff(got, expected);
    test::report_error("decayed combine (" + std::to_string(La) + ", " + std::to_string(Lb) +
                           ") vs direct",
                       err);
    EXPECT_LE(err, 1e-15);  // measured 1.1e-16
    // Λ = Λ_a + Λ_b: one addition per entry, the same bits.
    ASSERT_EQ(got.log_decay.size(), expected.log_decay.size());
    EXPECT_TRUE(test::same_bits(got.log_decay, expected.log_decay));
    // combine_into is the same operation in place.
    auto into = a;
    linattn::combine_into(into, b);
    EXPECT_TRUE(test::same_state(into, got));
    EXPECT_TRUE(test::same_bits(into.log_decay, got.log_decay));
    // From the empty state (the identity): b itself, with its log-decay.
    const auto from_empty = linattn::combine(LinearAttentionState<double>{}, b);
    EXPECT_TRUE(test::same_bits(from_empty.S, b.S));
    EXPECT_TRUE(test::same_bits(from_empty.log_decay, b.log_decay));
  }
}

// With b undecayed (or a decay of exactly 0) a is not changed before the sum: the combine is
// the undecayed one bit for bit, and its low parts keep the rounding error of the sum.
TEST(StateAlgebraDecay, NoDecayOverBIsTheUndecayedCombineBitForBit) {
  const Index F = 5, M = 7;
  const auto b = decayed(F, M, 0, 200);
  for (const Index La : {Index(0), Index(1), F}) {
    const auto a = decayed(F, M, La, 210);
    auto plain_a = a;
    plain_a.log_decay.resize(0);
    auto operand = b;
    linattn::detail::merge_into(plain_a, operand);  // the undecayed combine
    const auto got = linattn::combine(a, b);
    EXPECT_TRUE(test::same_state(got, plain_a)) << La;
    EXPECT_TRUE(test::same_bits(got.log_decay, a.log_decay)) << La;
    // Log-decays of exactly 0 scale by 1: the same bits too.
    for (const Index Lb : {Index(1), F}) {
      auto zero_b = b;
      zero_b.log_decay.setZero(Lb);
      EXPECT_TRUE(test::same_state(linattn::combine(a, zero_b), plain_a)) << La << " " << Lb;
    }
  }
}

// A reset in b (Λ_b = -inf) drops a: the result is b's sums, Λ = -inf.
TEST(StateAlgebraDecay, MinusInfinityDropsTheEarlierState) {
  const Index F = 4, M = 3;
  const auto a = decayed(F, M, F, 300);
  auto b = decayed(F, M, 1, 310);
  b.log_decay(0) = -std::numeric_limits<double>::infinity();
  const auto got = linattn::combine(a, b);
  EXPECT_EQ(state_diff(got, direct_combine(LinearAttentionState<double>(F, M), b)), 0.0);
  EXPECT_TRUE(got.S.allFinite());
  for (Index d = 0; d < F; ++d) EXPECT_EQ(got.log_decay(d), -std::numeric_limits<double>::infinity());
}

// (a ⊕ b) ⊕ c == a ⊕ (b ⊕ c) to rounding, for every mix of decays; and a fold of many decayed
// segments equals the direct sum diag(e^{Λ after j}) S_j.
TEST(StateAlgebraDecay, CombineIsAssociative) {
  const Index F = 5, M = 4;
  std::uint32_t seed = 400;
  for (const Index La : {Index(0), Index(1), F})
    for (const Index Lb : {Index(0), Index(1), F})
      for (const Index Lc : {Index(0), Index(1), F}) {
        const auto a = decayed(F, M, La, seed), b = decayed(F, M, Lb, seed + 10),
                   c = decayed(F, M, Lc, seed + 20);
        seed += 30;
        const auto left = linattn::combine(linattn::combine(a, b), c);
        const auto right = linattn::combine(a, linattn::combine(b, c));
        const std::string what = std::to_string(La) + ", " + std::to_string(Lb) + ", " +
                                 std::to_string(Lc);
        const double err = state_diff(left, right);
        test::report_error("decayed combine associativity (" + what + ")", err);
        EXPECT_LE(err, 1e-15) << what;  // measured 2.1e-16
        ASSERT_EQ(left.log_decay.size(), right.log_decay.size()) << what;
        if (left.log_decay.size() > 0) {
          EXPECT_LE((left.log_decay - right.log_decay).cwiseAbs().maxCoeff(), 1e-14) << what;
        }
        // Both against the direct sum.
        const Eigen::VectorXd lb = full_decay(b, F), lc = full_decay(c, F);
        const MatD Sd = (lb + lc).array().exp().matrix().asDiagonal() * (a.S + a.S_lo) +
                        lc.array().exp().matrix().asDiagonal() * (b.S + b.S_lo) + (c.S + c.S_lo);
        const auto [Sl, zl] = effective(left);
        EXPECT_LE((Sl - Sd).cwiseAbs().maxCoeff(), 1e-15 * Sd.cwiseAbs().maxCoeff()) << what;
      }

  // Twelve per-feature segments, folded left, right and as a tree.
  std::vector<LinearAttentionState<double>> parts;
  for (int i = 0; i < 12; ++i) parts.push_back(decayed(F, M, i % 3 == 0 ? 1 : F, 500 + 10 * i));
  LinearAttentionState<double> left_fold;
  for (const auto& p : parts) linattn::combine_into(left_fold, p);
  LinearAttentionState<double> right_fold;
  for (std::size_t i = parts.size(); i-- > 0;) right_fold = linattn::combine(parts[i], right_fold);
  std::vector<LinearAttentionState<double>> level = parts;
  while (level.size() > 1) {
    std::vector<LinearAttentionState<double>> next;
    for (std::size_t i = 0; i < level.size(); i += 2)
      next.push_back(i + 1 < level.size() ? linattn::combine(level[i], level[i + 1]) : level[i]);
    level = next;
  }
  MatD Sd = MatD::Zero(F, M);
  Eigen::VectorXd after = Eigen::VectorXd::Zero(F);  // Λ of the segments after j
  for (std::size_t j = parts.size(); j-- > 0;) {
    Sd += after.array().exp().matrix().asDiagonal() * (parts[j].S + parts[j].S_lo);
    after += full_decay(parts[j], F);
  }
  for (const auto* st : {&left_fold, &right_fold, &level[0]}) {
    const auto [S_eff, z_eff] = effective(*st);
    const double err = (S_eff - Sd).cwiseAbs().maxCoeff() / Sd.cwiseAbs().maxCoeff();
    test::report_error("decayed fold of 12 segments vs direct", err);
    EXPECT_LE(err, 1e-15);  // measured 1.7e-16
    EXPECT_LE((st->log_decay - after).cwiseAbs().maxCoeff(), 1e-13);
  }
}

TEST(StateAlgebraDecay, ErrorsNameTheFunctionAndBothSizes) {
  const Index F = 4, M = 3;
  auto a = decayed(F, M, 3, 600);  // neither 0, 1 nor F entries
  const auto before = a;
  const auto b = decayed(F, M, 1, 610);
  test::expect_invalid([&] { linattn::combine_into(a, b); },
                       {"linattn::combine_into", "a has 3 entries", "b has 1", "F = 4"},
                       "combine log-decay size");
  EXPECT_TRUE(test::same_state(a, before));
  EXPECT_TRUE(test::same_bits(a.log_decay, before.log_decay));
  auto c = decayed(F, M, F, 620);
  const auto c_before = c;
  auto bad_b = decayed(F, M, 2, 630);
  test::expect_invalid([&] { linattn::combine_into(c, bad_b); },
                       {"linattn::combine_into", "a has 4 entries", "b has 2", "F = 4"},
                       "combine log-decay size of b");
  EXPECT_TRUE(test::same_state(c, c_before));
  test::expect_invalid([&] { linattn::combine(decayed(F, M, 0, 640), bad_b); },
                       {"linattn::combine_into", "a has 0 entries", "b has 2"},
                       "combine, undecayed a");
  // Running maxima (SoftmaxSplit) and a log-decay do not go together.
  LinearAttentionState<double> mx(F, M, /*per_feature=*/true), my(F, M, /*per_feature=*/true);
  my.log_decay.setZero(1);
  test::expect_invalid([&] { linattn::combine(mx, my); },
                       {"linattn::combine_into", "running maxima", "b's 1"}, "combine maxima");
}

// The state gated_linear_attention carries out of [seg1; seg2] from zero is the combine of the
// states it carries out of seg1 and of seg2, each from zero: decayed states are a sum too.
TEST(StateAlgebraDecay, GatedStatesOfTwoSegmentsCombine) {
  const Index N = 150, n1 = 70, D = 5, M = 4;
  const MatD Q = test::random_matrix<double>(N, D, 701), K = test::random_matrix<double>(N, D, 702),
             V = test::random_matrix<double>(N, M, 703);
  linattn::GatedOptions opts;
  opts.normalize = true;  // so that z is carried too
  for (const Index width : {Index(1), D}) {  // a scalar decay per token; per-feature gates
    const MatD G = test::random_matrix<double>(N, width, 704 + std::uint32_t(width), -0.5, 0);
    for (const auto alg : {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent}) {
      opts.algorithm = alg;
      const std::string what = std::to_string(width) + " gate(s) per token, " +
                               (alg == linattn::CausalAlgorithm::Chunked ? "chunked" : "recurrent");
      LinearAttentionState<double> whole, first, second;
      linattn::gated_linear_attention(Q, K, V, G, EluPlusOne{}, whole, opts);
      linattn::gated_linear_attention(Q.topRows(n1), K.topRows(n1), V.topRows(n1), G.topRows(n1),
                                      EluPlusOne{}, first, opts);
      linattn::gated_linear_attention(Q.bottomRows(N - n1), K.bottomRows(N - n1),
                                      V.bottomRows(N - n1), G.bottomRows(N - n1), EluPlusOne{},
                                      second, opts);
      ASSERT_EQ(second.log_decay.size(), width) << what;
      const auto combined = linattn::combine(first, second);
      const double err = state_diff(combined, whole);
      test::report_error("gated state of two segments, combined vs one shot (" + what + ")", err);
      EXPECT_LE(err, 1e-14) << what;
      ASSERT_EQ(combined.log_decay.size(), whole.log_decay.size()) << what;
      EXPECT_LE((combined.log_decay - whole.log_decay).cwiseAbs().maxCoeff(),
                1e-14 * whole.log_decay.cwiseAbs().maxCoeff())
          << what;
    }
  }
}

}  // namespace
