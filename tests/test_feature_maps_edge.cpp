// Edge cases of the built-in feature maps (issue 10): NormalizedCosine on denormal rows, the
// feature_dim rule of maps with per-feature key normalisation, the supported scalar types,
// EluPlusOne's scalar and packet paths agreeing bit for bit, and every map giving the same
// features whatever the layout of its input (row-major, column-major, Maps with an outer
// stride, blocks). Built portable and with -march=native in CI: nothing here may depend on
// which one.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference.hpp"
#include "test_util.hpp"

namespace {

using test::Index;
using test::Mat;
using test::MatD;
using test::RowMat;

// ---------------------------------------------------------------------------------------------
// Supported scalar types: float and double only, as every static_assert message says.
// ---------------------------------------------------------------------------------------------

static_assert(linattn::detail::is_supported_scalar_v<float>);
static_assert(linattn::detail::is_supported_scalar_v<double>);
static_assert(!linattn::detail::is_supported_scalar_v<long double>);
static_assert(!linattn::detail::is_supported_scalar_v<int>);

// ---------------------------------------------------------------------------------------------
// NormalizedCosine on rows whose norm is a denormal: x̂ must be the true direction x / ‖x‖.
// ---------------------------------------------------------------------------------------------

template <class S>
Mat<S> cosine_features(const Mat<S>& x) {
  Mat<S> phi(x.rows(), x.cols() + 1);
  linattn::NormalizedCosine{}.map(x, phi);
  return phi;
}

// Rows of norm about `tiny` (a denormal of S) in several directions, between normal rows, plus
// a zero row. Entries are multiples of the smallest denormal, so they are stored exactly.
template <class S>
Mat<S> tiny_rows(Index D, S tiny, std::uint32_t seed) {
  const S dmin = std::numeric_limits<S>::denorm_min();
  const double units = double(tiny / dmin);  // tiny in multiples of denorm_min
  Mat<S> x = test::random_matrix<S>(9, D, seed, -2, 2);
  const MatD dirs = test::random_matrix<double>(4, D, seed + 1);
  for (Index r = 0; r < 4; ++r)
    for (Index c = 0; c < D; ++c)
      x(2 * r + 1, c) = S(std::round(dirs(r, c) / dirs.row(r).norm() * units)) * dmin;
  x.row(8).setZero();
  // At least one nonzero entry per tiny row, even when `tiny` is a few denorm_min.
  for (Index r = 1; r < 8; r += 2)
    if ((x.row(r).array() == S(0)).all()) x(r, r % D) = dmin;
  return x;
}

template <class S>
void check_tiny_rows(S tiny, double tol) {
  for (const Index D : {1, 2, 5, 64}) {
    const Mat<S> x = tiny_rows<S>(D, tiny, test::seed_of({D, 71}));
    const Mat<S> phi = cosine_features<S>(x);
    ASSERT_TRUE(test::all_finite(phi)) << "D=" << D << " tiny=" << tiny << "\nx̂ =\n"
                                       << phi.rightCols(D);
    EXPECT_EQ(phi.col(0), Mat<S>::Ones(x.rows(), 1));
    // The double reference of a denormal row is its direction (exact in double: 1e-40 and
    // 1e-45 are normal doubles; unit_rows scales 1e-310 by its largest entry first).
    const double err = test::max_abs_diff(phi.rightCols(D), ref::unit_rows(x.template cast<double>()));
    test::report_error(std::string("NormalizedCosine/") + test::scalar_name<S>() + "/tiny_rows", err);
    EXPECT_LE(err, tol) << "D=" << D << " tiny=" << tiny;
    EXPECT_TRUE((phi.row(8).tail(D).array() == S(0)).all()) << "a zero row maps to [1, 0…]";
    // The same rows in a row-major matrix.
    const RowMat<S> xr = x;
    Mat<S> phir(x.rows(), D + 1);
    linattn::NormalizedCosine{}.map(xr, phir);
    EXPECT_LE(test::max_abs_diff(phir, phi), tol) << "row-major, D=" << D;
  }
}

TEST(NormalizedCosineDenormal, RowsOfNorm1em40Float) { check_tiny_rows<float>(1e-40f, 4e-7); }
TEST(NormalizedCosineDenormal, RowsOfNorm1em45Float) {
  // 1e-45 is one denorm_min (1.4e-45): each tiny row has a single nonzero entry ±denorm_min.
  check_tiny_rows<float>(1e-45f, 4e-7);
}
TEST(NormalizedCosineDenormal, RowsOfNorm1em310Double) { check_tiny_rows<double>(1e-310, 1e-15); }

// The backward of a tiny row: (g - x̂ (x̂·g)) / ‖x‖, with g small enough that it is finite.
template <class S>
void check_tiny_backward(S tiny, double g_scale, double rel_tol) {
  const Index D = 6;
  const Mat<S> x = tiny_rows<S>(D, tiny, 81);
  const Mat<S> g = (test::random_matrix<double>(x.rows(), D + 1, 82) * g_scale).template cast<S>();
  Mat<S> grad(x.rows(), D);
  linattn::NormalizedCosine{}.backward(x, g, grad);
  ASSERT_TRUE(test::all_finite(grad)) << grad;
  // Double reference, row by row (the tiny rows are scaled by 2^k exactly first).
  double worst = 0;
  for (Index i = 0; i < x.rows(); ++i) {
    Eigen::RowVectorXd xi = x.row(i).template cast<double>();
    const Eigen::RowVectorXd gi = g.row(i).tail(D).template cast<double>();
    const double s = xi.cwiseAbs().maxCoeff();
    Eigen::RowVectorXd expected = Eigen::RowVectorXd::Zero(D);
    if (s > 0) {
      const Eigen::RowVectorXd u = (xi / s) / (xi / s).norm();
      const double norm = s * (xi / s).norm();
      expected = (gi - u.dot(gi) * u) / norm;
    }
    const double scale = std::max(expected.cwiseAbs().maxCoeff(), 1e-300);
    worst = std::max(worst, test::max_abs_diff(grad.row(i), expected) / scale);
  }
  test::report_error(std::string("NormalizedCosine/backward/") + test::scalar_name<S>() +
                         "/tiny_rows (relative)",
                     worst);
  EXPECT_LE(worst, rel_tol);
}

TEST(NormalizedCosineDenormal, BackwardOfTinyRows) {
  check_tiny_backward<float>(1e-40f, 1e-5, 1e-6);    // gradients up to ~1e35
  check_tiny_backward<double>(1e-310, 1e-12, 1e-13);  // gradients up to ~1e298
}

// One denormal key among normal ones: linear_attention and both causal algorithms must give
// finite outputs equal to the double reference (in which that key is its direction).
template <class S>
void check_attention_with_tiny_key(S tiny) {
  const Index N = 70, D = 8, M = 5;
  const Mat<S> Q = test::random_matrix<S>(N, D, 91);
  Mat<S> K = test::random_matrix<S>(N, D, 92);
  const Mat<S> V = test::random_matrix<S>(N, M, 93, -3, 3);
  K.row(3) = tiny_rows<S>(D, tiny, 94).row(1);  // key 3 has a denormal norm
  K.row(50) = tiny_rows<S>(D, tiny, 95).row(3);
  const MatD Qd = Q.template cast<double>(), Kd = K.template cast<double>(),
             Vd = V.template cast<double>();
  const linattn::NormalizedCosine phi;
  const double tol = test::tolerance<S>(test::max_abs(V));

  const auto check = [&](const Mat<S>& out, const MatD& expected, const Eigen::VectorXd& den,
                         const char* what) {
    ASSERT_TRUE(test::all_finite(out)) << what;
    const auto rc = test::compare_well_conditioned_rows(out, expected, den, 0.05 * N,
                                                        test::max_abs(V));
    test::report_error(std::string(what) + "/" + test::scalar_name<S>() + "/tiny_key", rc.max_err);
    EXPECT_LE(rc.max_err, tol) << what;
    EXPECT_GT(rc.compared, N / 2) << what;
  };

  Eigen::VectorXd den;
  const MatD expected = ref::linear_attention(Qd, Kd, Vd, phi, &den);
  check(linattn::linear_attention(Q, K, V, phi), expected, den, "linear_attention");

  Eigen::VectorXd cden;
  const MatD cexpected = ref::causal_linear_attention(Qd, Kd, Vd, phi, &cden);
  for (const auto algo : {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent}) {
    linattn::CausalOptions opts;
    opts.algorithm = algo;
    opts.chunk_size = 16;
    check(linattn::causal_linear_attention(Q, K, V, phi, opts), cexpected, cden,
          algo == linattn::CausalAlgorithm::Chunked ? "causal_linear_attention/Chunked"
                                                    : "causal_linear_attention/Recurrent");
  }
}

TEST(NormalizedCosineDenormal, AttentionWithOneTinyKeyFloat) {
  check_attention_with_tiny_key<float>(1e-40f);
  check_attention_with_tiny_key<float>(1e-45f);
}
TEST(NormalizedCosineDenormal, AttentionWithOneTinyKeyDouble) {
  check_attention_with_tiny_key<double>(1e-310);
}

// ---------------------------------------------------------------------------------------------
// A map with normalizes_keys_per_feature must have F == D (feature_map.hpp).
// ---------------------------------------------------------------------------------------------

/// Declares SoftmaxSplit semantics but has one feature more than its input: the per-feature
/// key softmax of the kernels reads K's D columns for F = D + 1 features, so every entry
/// must refuse it.
struct WidePerFeature {
  static constexpr bool normalizes_keys_per_feature = true;
  Index feature_dim(Index d) const { return d + 1; }
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x,
           linattn::MatrixRef<typename Derived::Scalar> phi) const {
    phi.leftCols(x.cols()) = x;
    phi.col(x.cols()).setOnes();
  }
};

void expect_feature_dim_error(const char* function, const std::function<void()>& call) {
  const std::string expected =
      std::string("linattn::") + function +
      ": a feature map with normalizes_keys_per_feature must have feature_dim(D) == D, got "
      "F = 9, D = 8";
  try {
    call();
    ADD_FAILURE() << function << ": no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), expected);
  }
}

TEST(FeatureMapRules, PerFeatureMapsMustHaveFEqualToD) {
  const Index N = 12, D = 8, M = 3, H = 2;
  const Eigen::MatrixXf Q = test::random_matrix<float>(N, D, 101);
  const Eigen::MatrixXf K = test::random_matrix<float>(N, D, 102);
  const Eigen::MatrixXf V = test::random_matrix<float>(N, M, 103);
  const Eigen::Matrix<bool, Eigen::Dynamic, 1> mask = Eigen::Matrix<bool, Eigen::Dynamic, 1>::Ones(N);
  const WidePerFeature phi;
  Eigen::MatrixXf out(N, M);
  linattn::Workspace<float> ws;

  expect_feature_dim_error("linear_attention", [&] { linattn::linear_attention(Q, K, V, phi); });
  expect_feature_dim_error("linear_attention",
                           [&] { linattn::linear_attention(Q, K, V, phi, out, ws); });
  expect_feature_dim_error("masked_linear_attention",
                           [&] { linattn::masked_linear_attention(Q, K, V, mask, phi); });
  for (const auto algo : {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent}) {
    linattn::CausalOptions opts;
    opts.algorithm = algo;
    expect_feature_dim_error("causal_linear_attention",
                             [&] { linattn::causal_linear_attention(Q, K, V, phi, opts); });
    expect_feature_dim_error("masked_causal_linear_attention", [&] {
      linattn::masked_causal_linear_attention(Q, K, V, mask, phi, opts);
    });
  }
  expect_feature_dim_error("causal_linear_attention", [&] {
    linattn::LinearAttentionState<float> state;
    linattn::causal_linear_attention(Q, K, V, phi, state, out, ws);
  });
  expect_feature_dim_error("RecurrentLinearAttention", [&] {
    linattn::RecurrentLinearAttention<WidePerFeature, float> rnn(D, M);
  });
  expect_feature_dim_error("LinearCrossAttention", [&] {
    linattn::LinearCrossAttention<WidePerFeature, float> cross(D, M);
  });
  expect_feature_dim_error("RecurrentLinearAttention", [&] {
    linattn::MultiHeadRecurrentLinearAttention<WidePerFeature, float> rnn(H, D, M);
  });

  // Multi-head and batched: H heads of D columns side by side.
  const Eigen::MatrixXf QH = test::random_matrix<float>(N, H * D, 104);
  const Eigen::MatrixXf KH = test::random_matrix<float>(N, H * D, 105);
  const Eigen::MatrixXf VH = test::random_matrix<float>(N, H * M, 106);
  Eigen::MatrixXf outH(N, H * M);
  linattn::MultiHeadWorkspace<float> mws;
  expect_feature_dim_error("multihead_linear_attention",
                           [&] { linattn::multihead_linear_attention(QH, KH, VH, H, phi); });
  expect_feature_dim_error("multihead_causal_linear_attention", [&] {
    linattn::multihead_causal_linear_attention(QH, KH, VH, H, phi);
  });
  expect_feature_dim_error("batched_linear_attention", [&] {
    linattn::batched_linear_attention(QH, KH, VH, {0, 5, N}, {0, 7, N}, H, phi, outH, mws);
  });
  expect_feature_dim_error("batched_causal_linear_attention", [&] {
    linattn::batched_causal_linear_attention(QH, KH, VH, {0, 5, N}, H, phi, outH, mws);
  });
}

// ---------------------------------------------------------------------------------------------
// EluPlusOne: the packet and the scalar paths agree bit for bit, also below -87 where the
// packet exp clamps its argument, so a feature does not depend on its position in the row.
// ---------------------------------------------------------------------------------------------

template <class S>
bool same_bits(S a, S b) {
  return std::memcmp(&a, &b, sizeof(S)) == 0;
}

template <class S>
void check_elu_positions() {
  const linattn::EluPlusOne phi;
  std::vector<S> special = {S(0), S(-0.0), S(-87), S(-87.5), S(-88.5), S(-100), S(-103.9),
                            S(-104), S(-120), S(-1e-30), S(-86.99)};
  for (Index len = 1; len <= 40; ++len) {
    Mat<S> x = test::random_matrix<S>(1, len, test::seed_of({len, 111}), -120, 0);
    for (Index c = 0; c < len && c < Index(special.size()); ++c)
      x(0, (c * 7) % len) = special[std::size_t(c)];
    // One by one: 1 x 1 inputs, which only the scalar path can map.
    Mat<S> one_by_one(1, len);
    for (Index c = 0; c < len; ++c) phi.map(x.block(0, c, 1, 1), one_by_one.block(0, c, 1, 1));
    // A single row (detail::map_single_row, the recurrent step): packets and a scalar tail.
    Mat<S> row(1, len);
    phi.map(x, row);
    // The same values as a column (a plain column-major block: packet body and scalar tail),
    // as a row of a 3-row matrix, and from an unaligned Map (a scalar head first).
    Mat<S> col(len, 1);
    phi.map(x.transpose(), col);
    Mat<S> x3(3, len), three(3, len);
    x3 << x, x.reverse(), x;
    phi.map(x3, three);
    std::vector<S> buf(std::size_t(len) + 1);
    Eigen::Map<Mat<S>>(buf.data() + 1, len, 1) = x.transpose();
    Mat<S> unaligned(len, 1);
    phi.map(Eigen::Map<const Mat<S>>(buf.data() + 1, len, 1), unaligned);
    for (Index c = 0; c < len; ++c) {
      const S expected = one_by_one(0, c);
      ASSERT_TRUE(same_bits(row(0, c), expected))
          << test::scalar_name<S>() << " len=" << len << " x=" << x(0, c) << ": single row "
          << row(0, c) << " vs one by one " << expected;
      ASSERT_TRUE(same_bits(col(c, 0), expected))
          << test::scalar_name<S>() << " len=" << len << " x=" << x(0, c) << ": column "
          << col(c, 0) << " vs one by one " << expected;
      ASSERT_TRUE(same_bits(three(0, c), expected) && same_bits(three(2, c), expected) &&
                  same_bits(three(1, len - 1 - c), expected))
          << test::scalar_name<S>() << " len=" << len << " x=" << x(0, c);
      ASSERT_TRUE(same_bits(unaligned(c, 0), expected))
          << test::scalar_name<S>() << " len=" << len << " x=" << x(0, c) << ": unaligned "
          << unaligned(c, 0) << " vs one by one " << expected;
    }
    // And still the spec's value: e^x to about an ulp where it is a normal number, and a
    // tiny positive number below.
    for (Index c = 0; c < len; ++c) {
      const double e = std::exp(double(x(0, c)));
      if (e >= double(std::numeric_limits<S>::min())) {
        EXPECT_NEAR(double(row(0, c)) / e, 1.0, 4 * std::numeric_limits<S>::epsilon())
            << "x=" << x(0, c);
      } else {
        EXPECT_GT(row(0, c), S(0));
        EXPECT_LE(row(0, c), S(2e-38));
      }
    }
  }
}

TEST(EluPlusOne, ScalarAndPacketPathsAgreeBitForBitFloat) { check_elu_positions<float>(); }
TEST(EluPlusOne, ScalarAndPacketPathsAgreeBitForBitDouble) { check_elu_positions<double>(); }

// ---------------------------------------------------------------------------------------------
// Every built-in map gives the same features on every layout of the same numbers.
// ---------------------------------------------------------------------------------------------

template <class S, class Map>
void check_layouts(const Map& phi, bool bitwise) {
  const Index H = 3;
  for (const Index D : {1, 7, 16, 64}) {
    for (const Index n : {1, 5, 128, 300}) {
      const Mat<S> x = test::random_matrix<S>(n, D, test::seed_of({n, D, 121}), -4, 4);
      const Index F = phi.feature_dim(D);
      Mat<S> expected(n, F);
      phi.map(x, expected);
      const double tol = bitwise ? 0.0 : 4 * std::numeric_limits<S>::epsilon();
      const auto compare = [&](const auto& input, const char* what) {
        Mat<S> got(n, F);
        phi.map(input, got);
        EXPECT_LE(test::max_abs_diff(got, expected), tol)
            << what << " n=" << n << " D=" << D << " " << test::scalar_name<S>();
        // Into a block of a larger column-major matrix (an outer stride on the output).
        Mat<S> big = Mat<S>::Zero(n + 3, F + 2);
        phi.map(input, big.block(2, 1, n, F));
        EXPECT_LE(test::max_abs_diff(big.block(2, 1, n, F), expected), tol)
            << what << " into a block, n=" << n << " D=" << D << " " << test::scalar_name<S>();
      };
      const RowMat<S> xr = x;
      compare(xr, "row-major");
      // Columns h·D .. h·D + D of a row-major N x (H·D) matrix: a block and a strided Map.
      RowMat<S> wide = test::random_matrix<S>(n, H * D, 7);
      wide.middleCols(D, D) = x;
      const RowMat<S>& cwide = wide;
      compare(cwide.middleCols(D, D), "row-major block");
      compare(Eigen::Map<const RowMat<S>, 0, Eigen::OuterStride<>>(wide.data() + D, n, D,
                                                                     Eigen::OuterStride<>(H * D)),
              "row-major Map with outer stride");
      // Column-major: a block of a larger matrix and a Map with an outer stride.
      Mat<S> tall = test::random_matrix<S>(n + 5, D + 2, 8);
      tall.block(3, 1, n, D) = x;
      const Mat<S>& ctall = tall;
      compare(ctall.block(3, 1, n, D), "column-major block");
      compare(Eigen::Map<const Mat<S>, 0, Eigen::OuterStride<>>(tall.data() + 3 + tall.rows(), n,
                                                                  D, Eigen::OuterStride<>(n + 5)),
              "column-major Map with outer stride");
    }
  }
}

TEST(FeatureMapLayouts, EluPlusOneIsBitwiseIdentical) {
  check_layouts<float>(linattn::EluPlusOne{}, true);
  check_layouts<double>(linattn::EluPlusOne{}, true);
}
TEST(FeatureMapLayouts, SoftmaxSplitAgreesToAFewUlps) {
  check_layouts<float>(linattn::SoftmaxSplit{}, false);
  check_layouts<double>(linattn::SoftmaxSplit{}, false);
}
TEST(FeatureMapLayouts, NormalizedCosineAgreesToAFewUlps) {
  check_layouts<float>(linattn::NormalizedCosine{}, false);
  check_layouts<double>(linattn::NormalizedCosine{}, false);
}

}  // namespace
