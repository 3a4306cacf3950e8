// The denominator guard (docs/SPEC.md §2, "Denominators"): a row is divided by its denominator
// as computed unless that denominator is degenerate (below the smallest normal number: 0,
// subnormal, negative or NaN), and then the row is 0. The same rule in every algorithm.
//
// Regression: the old guard max(den, 1e-6) biased tiny but normal denominators in float: q = k =
// -9.5 in all 64 dimensions with V = 1 gave rows of 0.36 … 0.72 instead of 1.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "causal_reference.hpp"
#include "test_util.hpp"

namespace {

using linattn::CausalAlgorithm;
using linattn::CausalOptions;
using test::Index;

template <class S>
using MatX = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic>;

// cref::options(algorithm, chunk) with the default chunk size.
CausalOptions options(CausalAlgorithm algo) { return cref::options(algo, 0); }

/// max(x, 0): a query whose positive features meet no key's has den = 0 exactly.
using Relu = cref::Relu;

// Every kernel and algorithm on (Q, K, V): name -> output. Causal forms need N == L.
template <class S, class Map>
std::vector<std::pair<std::string, MatX<S>>> every_kernel(const MatX<S>& Q, const MatX<S>& K,
                                                          const MatX<S>& V, const Map& phi) {
  std::vector<std::pair<std::string, MatX<S>>> r;
  const Index N = Q.rows(), D = Q.cols(), M = V.cols();
  const Eigen::Array<bool, Eigen::Dynamic, 1> keep = Eigen::Array<bool, Eigen::Dynamic, 1>::Constant(K.rows(), true);
  r.emplace_back("linear_attention", linattn::linear_attention(Q, K, V, phi));
  r.emplace_back("masked_linear_attention", linattn::masked_linear_attention(Q, K, V, keep, phi));
  {
    linattn::LinearCrossAttention<Map, S> cross(D, M, phi);
    cross.add_memory(K, V);
    MatX<S> out(N, M);
    for (Index i = 0; i < N; ++i) out.row(i) = cross.query(Q.row(i)).transpose();
    r.emplace_back("LinearCrossAttention::query", out);
  }
  if (N != K.rows()) return r;
  for (const auto algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
    const std::string a = algo == CausalAlgorithm::Chunked ? " Chunked" : " Recurrent";
    r.emplace_back("causal_linear_attention" + a,
                   linattn::causal_linear_attention(Q, K, V, phi, options(algo)));
    r.emplace_back("masked_causal_linear_attention" + a,
                   linattn::masked_causal_linear_attention(Q, K, V, keep, phi, options(algo)));
    const MatX<S> Q2 = Q.replicate(1, 2), K2 = K.replicate(1, 2), V2 = V.replicate(1, 2);
    r.emplace_back("multihead_causal_linear_attention" + a,
                   linattn::multihead_causal_linear_attention(Q2, K2, V2, 2, phi, options(algo))
                       .leftCols(M));
  }
  {
    linattn::RecurrentLinearAttention<Map, S> rnn(D, M, phi);
    MatX<S> out(N, M);
    for (Index i = 0; i < N; ++i) out.row(i) = rnn.step(Q.row(i), K.row(i), V.row(i)).transpose();
    r.emplace_back("RecurrentLinearAttention::step", out);
  }
  return r;
}

template <class S>
void check_rows_of_ones(double bound) {
  // q = k = -9.5 everywhere: every φ entry is e^-9.5 ≈ 7.5e-5, a key's similarity 64 e^-19 ≈
  // 3.6e-7, so the first rows' denominators are far below the old ε = 1e-6 of float.
  const Index N = 150, D = 64, M = 8;
  const MatX<S> Q = MatX<S>::Constant(N, D, S(-9.5)), V = MatX<S>::Ones(N, M);
  for (const auto& [name, out] : every_kernel<S>(Q, Q, V, linattn::EluPlusOne{})) {
    const double err = test::max_abs_diff(out, MatX<S>::Ones(N, M));
    test::report_error(std::string(test::scalar_name<S>()) + " " + name + ", q = k = -9.5, V = 1, |out - 1|", err);
    EXPECT_LE(err, bound) << name;
  }
}

// Measured: float 1.1e-6 (chunked: a chunk's 48 terms), 2.4e-7 otherwise; double 3.0e-15.
// The old guard gave rows from 0.36 in float.
TEST(guard, TinyNormalDenominatorsAreNotBiasedFloat) { check_rows_of_ones<float>(4e-6); }
TEST(guard, TinyNormalDenominatorsAreNotBiasedDouble) { check_rows_of_ones<double>(1.2e-14); }

// Float against the double kernels across input scales: Q and K centred on s in [-20, 20]
// (±0.5), V in [0, 1]. Every kernel and algorithm; N = 150 crosses chunk and block boundaries.
template <class Map>
void check_float_against_double(const Map& phi, const char* map_name, double bound) {
  const Index N = 150, D = 16, M = 8;
  double worst = 0;
  for (int s = -20; s <= 20; ++s) {
    const Eigen::MatrixXd Qd = (test::random_matrix<double>(N, D, 10 + s, -0.5, 0.5).array() + s).matrix();
    const Eigen::MatrixXd Kd = (test::random_matrix<double>(N, D, 70 + s, -0.5, 0.5).array() + s).matrix();
    const Eigen::MatrixXd Vd = test::random_matrix<double>(N, M, 130 + s, 0.0, 1.0);
    const Eigen::MatrixXf Qf = Qd.cast<float>(), Kf = Kd.cast<float>(), Vf = Vd.cast<float>();
    // The reference runs on the float inputs, in double.
    const auto ref = every_kernel<double>(Qf.cast<double>(), Kf.cast<double>(), Vf.cast<double>(), phi);
    const auto got = every_kernel<float>(Qf, Kf, Vf, phi);
    ASSERT_EQ(ref.size(), got.size());
    for (std::size_t k = 0; k < ref.size(); ++k) {
      const double err = test::max_abs_diff(got[k].second, ref[k].second);
      worst = std::max(worst, err);
      EXPECT_LE(err, bound) << map_name << " " << got[k].first << " at scale " << s;
    }
  }
  test::report_error(std::string(map_name) + ", float vs double, input scales -20 … 20, every kernel", worst);
}

// Measured max abs error (outputs in [0, 1]): EluPlusOne 2.4e-7, NormalizedCosine 3.6e-7,
// SoftmaxSplit 2.5e-7 (the old guard: 0.3 for EluPlusOne below about -8).
TEST(guard, FloatMatchesDoubleAcrossScalesEluPlusOne) {
  check_float_against_double(linattn::EluPlusOne{}, "EluPlusOne", 1.5e-6);
}
TEST(guard, FloatMatchesDoubleAcrossScalesNormalizedCosine) {
  check_float_against_double(linattn::NormalizedCosine{}, "NormalizedCosine", 1.5e-6);
}
TEST(guard, FloatMatchesDoubleAcrossScalesSoftmaxSplit) {
  check_float_against_double(linattn::SoftmaxSplit{}, "SoftmaxSplit", 1.5e-6);
}

// A zero denominator (no feature of the query meets a key's) gives a zero row, in every
// algorithm; so does one that underflows to a subnormal.
template <class S>
void check_degenerate_rows() {
  const Index N = 70, D = 3, M = 4;
  // Queries alternate between all-negative (ReLU features 0: den = 0) and all-positive rows.
  MatX<S> Q(N, D), K = MatX<S>::Ones(N, D), V = MatX<S>::Constant(N, M, S(2));
  for (Index i = 0; i < N; ++i) Q.row(i).setConstant(i % 2 ? S(1) : S(-1));
  for (const auto& [name, out] : every_kernel<S>(Q, K, V, Relu{})) {
    for (Index i = 0; i < N; ++i) {
      if (i % 2) {
        // Measured up to 1.2e-6 (chunked, -march=native): 5 ulps of 2.
        EXPECT_LE(test::max_abs_diff(out.row(i), MatX<S>::Constant(1, M, S(2))), 5e-6) << name << " row " << i;
      } else {
        EXPECT_TRUE((out.row(i).array() == S(0)).all()) << name << " row " << i << ": " << out.row(i);
      }
    }
  }
}

TEST(guard, ZeroDenominatorGivesZeroRowFloat) { check_degenerate_rows<float>(); }
TEST(guard, ZeroDenominatorGivesZeroRowDouble) { check_degenerate_rows<double>(); }

TEST(guard, UnderflowingDenominatorGivesZeroRowInFloat) {
  // EluPlusOne at -60: φ = e^-60 ≈ 8.8e-27, similarities e^-120 · D underflow to 0 in float
  // (and would be subnormal at best); double represents them and returns the mean, 1.
  const Index N = 20, D = 4, M = 3;
  const Eigen::MatrixXf Q = Eigen::MatrixXf::Constant(N, D, -60.f), V = Eigen::MatrixXf::Ones(N, M);
  for (const auto& [name, out] : every_kernel<float>(Q, Q, V, linattn::EluPlusOne{}))
    EXPECT_TRUE((out.array() == 0.f).all()) << name << ":\n" << out;
  const Eigen::MatrixXd Qd = Q.cast<double>(), Vd = V.cast<double>();
  for (const auto& [name, out] : every_kernel<double>(Qd, Qd, Vd, linattn::EluPlusOne{}))
    EXPECT_LE(test::max_abs_diff(out, Eigen::MatrixXd::Ones(N, M)), 1e-14) << name;
}

// NormalizedCosine with every key exactly opposite the query: the exact denominator is 0, the
// computed one rounding noise of either sign; it must count as 0 (a zero row), not divide noise
// by noise (rows of 4 |V| were seen, in double too). Keys at other angles are unaffected.
template <class S>
void check_opposite_keys() {
  for (const Index D : {1, 2, 5, 64}) {
    const Index N = 70, M = 3;
    const MatX<S> q = test::random_matrix<S>(1, D, 500 + D, 0.5, 2.0);
    MatX<S> Q = q.replicate(N, 1), K(N, D);
    const MatX<S> V = test::random_matrix<S>(N, M, 600 + D, -3.0, 3.0);
    for (Index j = 0; j < N; ++j) K.row(j) = -S(0.25 + 0.5 * double(j % 7)) * q;  // all opposite
    for (const auto& [name, out] : every_kernel<S>(Q, K, V, linattn::NormalizedCosine{}))
      EXPECT_TRUE((out.array() == S(0)).all()) << name << " D=" << D << ":\n" << out.topRows(3);
    // One aligned key among the opposite ones: every row that sees it returns its value.
    K.row(5) = q;
    for (const auto& [name, out] : every_kernel<S>(Q, K, V, linattn::NormalizedCosine{})) {
      const bool causal = name.find("ausal") != std::string::npos || name.find("Recurrent") != std::string::npos;
      for (Index i = causal ? 5 : 0; i < N; ++i)
        EXPECT_LE(test::max_abs_diff(out.row(i), V.row(5)), 4.0 * N * 3.0 * std::numeric_limits<S>::epsilon())
            << name << " D=" << D << " row " << i;
    }
  }
}

TEST(guard, OppositeKeysGiveZeroRowsNormalizedCosineFloat) { check_opposite_keys<float>(); }
TEST(guard, OppositeKeysGiveZeroRowsNormalizedCosineDouble) { check_opposite_keys<double>(); }

TEST(guard, GuardedInverse) {
  using linattn::guarded_inverse;
  EXPECT_EQ(guarded_inverse(0.f), 0.f);
  EXPECT_EQ(guarded_inverse(-1.f), 0.f);
  EXPECT_EQ(guarded_inverse(std::numeric_limits<float>::denorm_min()), 0.f);
  EXPECT_EQ(guarded_inverse(std::numeric_limits<float>::quiet_NaN()), 0.f);
  EXPECT_EQ(guarded_inverse(std::numeric_limits<float>::min()), 1.f / std::numeric_limits<float>::min());
  EXPECT_EQ(guarded_inverse(4.0), 0.25);
  EXPECT_EQ(guarded_inverse(std::numeric_limits<double>::min() / 2), 0.0);
  EXPECT_TRUE(std::isfinite(guarded_inverse(std::numeric_limits<float>::min())));
}

}  // namespace
