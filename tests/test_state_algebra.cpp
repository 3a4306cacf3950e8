// The state as an algebra (state_algebra.hpp, spec §8): summarize() gives the state the causal
// kernel carries out of a segment; combine() of the segments' states, in any bracketing, gives
// the whole sequence's state; continuing from a combined state gives the one-shot outputs.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cmath>
#include <string>
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

}  // namespace
