// Edge cases of the built-in feature maps: NormalizedCosine on denormal rows, the
// feature_dim rule of maps with per-feature key normalisation, the supported scalar types,
// EluPlusOne's scalar and packet paths agreeing bit for bit, and every map giving the same
// features whatever the layout of its input (row-major, column-major, Maps with an outer
// stride, blocks). Silu at extreme and non-finite inputs, L2Normalize on zero, tiny,
// huge and non-finite rows, both backwards against finite differences, and the new maps
// through the kernels. Relu, Dpfp and Taylor2 on every layout. Built portable and
// with -march=native in CI: nothing here may depend on which one.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "gradient_util.hpp"
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
  IF_FLOAT(check_tiny_rows<float>(1e-45f, 4e-7));
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
  IF_FLOAT(check_tiny_backward<float>(1e-40f, 1e-5, 1e-6));    // gradients up to ~1e35
  IF_DOUBLE(check_tiny_backward<double>(1e-310, 1e-12, 1e-13));  // gradients up to ~1e298
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
  IF_FLOAT(check_attention_with_tiny_key<float>(1e-40f));
  IF_FLOAT(check_attention_with_tiny_key<float>(1e-45f));
}
TEST(NormalizedCosineDenormal, AttentionWithOneTinyKeyDouble) {
  IF_DOUBLE(check_attention_with_tiny_key<double>(1e-310));
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

// make(D): the map for inputs of D columns (a map with parameters of that size, as Favor).
template <class S, class Make>
void check_layouts_made(const Make& make, bool bitwise) {
  const Index H = 3;
  for (const Index D : {1, 7, 16, 64}) {
    const auto phi = make(D);
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

template <class S, class Map>
void check_layouts(const Map& phi, bool bitwise) {
  check_layouts_made<S>([&](Index) { return phi; }, bitwise);
}

TEST(FeatureMapLayouts, EluPlusOneIsBitwiseIdentical) {
  IF_FLOAT(check_layouts<float>(linattn::EluPlusOne{}, true));
  IF_DOUBLE(check_layouts<double>(linattn::EluPlusOne{}, true));
}
TEST(FeatureMapLayouts, SoftmaxSplitAgreesToAFewUlps) {
  IF_FLOAT(check_layouts<float>(linattn::SoftmaxSplit{}, false));
  IF_DOUBLE(check_layouts<double>(linattn::SoftmaxSplit{}, false));
}
TEST(FeatureMapLayouts, NormalizedCosineAgreesToAFewUlps) {
  IF_FLOAT(check_layouts<float>(linattn::NormalizedCosine{}, false));
  IF_DOUBLE(check_layouts<double>(linattn::NormalizedCosine{}, false));
}
TEST(FeatureMapLayouts, IdentityAndSiluAreBitwiseIdentical) {
  IF_FLOAT(check_layouts<float>(linattn::Identity{}, true));
  IF_DOUBLE(check_layouts<double>(linattn::Identity{}, true));
  IF_FLOAT(check_layouts<float>(linattn::Silu{}, true));
  IF_DOUBLE(check_layouts<double>(linattn::Silu{}, true));
}
TEST(FeatureMapLayouts, ReluDpfpAndTaylor2AreBitwiseIdentical) {
  // Each feature is one exact or correctly rounded operation on its inputs (Relu a
  // select, Dpfp one product, Taylor2 (x'_a/√2)·x'_b), the same whatever the input's layout.
  IF_FLOAT(check_layouts<float>(linattn::Relu{}, true));
  IF_DOUBLE(check_layouts<double>(linattn::Relu{}, true));
  IF_FLOAT(check_layouts<float>(linattn::Dpfp(3), true));
  IF_DOUBLE(check_layouts<double>(linattn::Dpfp(3), true));
  IF_FLOAT(check_layouts<float>(linattn::Taylor2{}, true));
  IF_DOUBLE(check_layouts<double>(linattn::Taylor2{}, true));
}
TEST(FeatureMapLayouts, FavorIsBitwiseIdentical) {
  // Each row is copied into a contiguous buffer and mapped with the same operations,
  // whatever the input's layout (m = 2D + 3 features).
  IF_FLOAT(check_layouts_made<float>([](Index D) { return linattn::Favor<float>(D, 2 * D + 3, 7); }, true));
  IF_DOUBLE(check_layouts_made<double>([](Index D) { return linattn::Favor<double>(D, 2 * D + 3, 7); },
                             true));
}
TEST(FeatureMapLayouts, L2NormalizeIsBitwiseIdentical) {
  // Each block of rows is mapped by the inner map into the output, then normalised in place
  // column by column: the same operations on the same numbers whatever the input's layout.
  IF_FLOAT(check_layouts<float>(linattn::L2Normalize<>{}, true));
  IF_DOUBLE(check_layouts<double>(linattn::L2Normalize<>{}, true));
  IF_FLOAT(check_layouts<float>(linattn::L2Normalize<linattn::Silu>{}, true));
  IF_DOUBLE(check_layouts<double>(linattn::L2Normalize<linattn::Silu>{}, true));
}

// ---------------------------------------------------------------------------------------------
// Silu: φ(x) = x·σ(x) at extreme inputs, against a long double evaluation (the double
// reference of the float map, and an extended-precision one for the double map).
// ---------------------------------------------------------------------------------------------

long double silu_ref(long double x) { return x / (1.0L + std::exp(-x)); }
long double silu_grad_ref(long double x) {
  const long double s = 1.0L / (1.0L + std::exp(-x));
  return s * (1.0L + x * (1.0L - s));
}
// The magnitude of the terms of φ'(x) = σ + xσ(1 − σ): the scale of its rounding error (φ' has
// a root at x ≈ -2.3994, where its relative error is unbounded).
long double silu_grad_scale(long double x) {
  const long double s = 1.0L / (1.0L + std::exp(-x));
  return s + std::fabs(x) * s * (1.0L - s);
}

template <class S>
Mat<S> silu_of(const Mat<S>& x) {
  Mat<S> phi(x.rows(), x.cols());
  linattn::Silu{}.map(x, phi);
  return phi;
}

// Inputs of every regime: ±100 and the other magnitudes of the issue, the cutoffs of exp's
// argument (±87 / ±708 halved: ±174 / ±1416), where x·σ(x) becomes a denormal in float
// (about -88 to -104), denormal and huge inputs, then a dense random sweep of [-200, 200].
template <class S>
Mat<S> silu_inputs() {
  using L = std::numeric_limits<S>;
  std::vector<S> v = {S(100),   S(-100),  S(0),     S(-0.0),  S(1),       S(-1),
                      S(-1.2784645), S(-2.3994), S(20),  S(-20),     S(30),  S(-30),
                      S(87),    S(-87),   S(88.5),  S(-88.5), S(-90),     S(-95),
                      S(-103),  S(-104),  S(-110),  S(150),   S(-150),    S(173.9),
                      S(-173.9), S(174),  S(-174),  S(174.1), S(-174.1),  S(500),
                      S(-500),  S(700),   S(-700),  S(1415),  S(-1415),   S(1417),
                      S(-1417), S(1e30),  S(-1e30), L::max(), L::lowest(), L::min(),
                      -L::min(), L::denorm_min(), -L::denorm_min(), S(1e-40), S(-1e-40),
                      S(1e-30), S(-1e-30), S(1e-300), S(-1e-300)};
  const Mat<S> sweep = test::random_matrix<S>(4000, 1, 131, -200, 200);
  Mat<S> x(Index(v.size()) + sweep.rows(), 1);
  for (std::size_t i = 0; i < v.size(); ++i) x(Index(i), 0) = v[i];
  x.bottomRows(sweep.rows()) = sweep;
  return x;
}

template <class S>
void check_silu_values() {
  const Mat<S> x = silu_inputs<S>();
  const Mat<S> phi = silu_of<S>(x);
  ASSERT_TRUE(test::all_finite(phi));
  Mat<S> grad(x.rows(), 1);
  linattn::Silu{}.backward(x, Mat<S>::Ones(x.rows(), 1), grad);
  ASSERT_TRUE(test::all_finite(grad));
  const long double eps = std::numeric_limits<S>::epsilon();
  const long double dmin = std::numeric_limits<S>::denorm_min();
  double worst_ulps = 0, worst_denormal = 0, worst_grad = 0;
  for (Index i = 0; i < x.rows(); ++i) {
    const long double r = silu_ref(x(i, 0));
    const long double err = std::fabs((long double)phi(i, 0) - r);
    // Relative error where the result is a normal number, absolute (in units of the smallest
    // denormal) below: a few ulps, or one denormal step.
    if (std::fabs(r) >= (long double)std::numeric_limits<S>::min())
      worst_ulps = std::max(worst_ulps, double(err / (std::fabs(r) * eps)));
    else
      worst_denormal = std::max(worst_denormal, double(err / dmin));
    EXPECT_LE(err, 4 * eps * std::fabs(r) + dmin) << "x=" << x(i, 0) << " φ=" << phi(i, 0);
    // Below 0 the result is negative or -0, above it positive: the sign is never lost.
    if (x(i, 0) != S(0)) {
      EXPECT_EQ(std::signbit(phi(i, 0)), std::signbit(x(i, 0))) << "x=" << x(i, 0);
    }
    const long double rg = silu_grad_ref(x(i, 0));
    const long double eg = std::fabs((long double)grad(i, 0) - rg);
    const long double sg = silu_grad_scale(x(i, 0));
    if (sg >= (long double)std::numeric_limits<S>::min()) {
      worst_grad = std::max(worst_grad, double(eg / (sg * eps)));
      EXPECT_LE(eg, 8 * eps * sg) << "x=" << x(i, 0) << " φ'=" << grad(i, 0) << " ref " << double(rg);
    } else {
      EXPECT_LE(eg, (long double)std::numeric_limits<S>::min()) << "x=" << x(i, 0);
    }
  }
  const std::string name = std::string("Silu/") + test::scalar_name<S>();
  test::report_error(name + "/map (ulps of the long double reference)", worst_ulps);
  test::report_error(name + "/map (denormal results, in denorm_min)", worst_denormal);
  test::report_error(name + "/backward (ulps of σ + |x|σ(1-σ))", worst_grad);
}

TEST(Silu, ExtremeInputsAreFiniteAndExactFloat) { check_silu_values<float>(); }
TEST(Silu, ExtremeInputsAreFiniteAndExactDouble) { check_silu_values<double>(); }

template <class S>
void check_silu_special() {
  using L = std::numeric_limits<S>;
  Mat<S> x(1, 7);
  x << L::infinity(), -L::infinity(), L::quiet_NaN(), S(0), S(-0.0), S(100), S(-100);
  const Mat<S> phi = silu_of<S>(x);
  EXPECT_EQ(phi(0, 0), L::infinity());
  EXPECT_EQ(phi(0, 1), S(0));  // the limit, -0
  EXPECT_TRUE(std::signbit(phi(0, 1)));
  EXPECT_TRUE(std::isnan(phi(0, 2)));
  EXPECT_EQ(phi(0, 3), S(0));
  EXPECT_FALSE(std::signbit(phi(0, 3)));
  EXPECT_TRUE(std::signbit(phi(0, 4)));  // silu(-0) = -0
  EXPECT_EQ(phi(0, 5), S(100));          // 100·(1 − 3.7e-44) rounds to 100
  EXPECT_EQ(phi(0, 6), S(silu_ref(-100.0L)));
  // The derivative's limits: 1 at +inf, -0 at -inf; NaN stays NaN.
  Mat<S> grad(1, 7);
  linattn::Silu{}.backward(x, Mat<S>::Ones(1, 7), grad);
  EXPECT_EQ(grad(0, 0), S(1));
  EXPECT_EQ(grad(0, 1), S(0));
  EXPECT_TRUE(std::isnan(grad(0, 2)));
  EXPECT_EQ(grad(0, 3), S(0.5));
  EXPECT_EQ(grad(0, 4), S(0.5));
  EXPECT_EQ(grad(0, 5), S(1));
  // The same values through every path of Eigen's evaluation (packets, the scalar head and tail
  // of a column, the single-row buffer): bit for bit.
  for (Index len = 1; len <= 40; ++len) {
    Mat<S> row = test::random_matrix<S>(1, len, test::seed_of({len, 141}), -200, 200);
    for (Index c = 0; c < len && c < x.cols(); ++c) row(0, (c * 5) % len) = x(0, c);
    Mat<S> one_by_one(1, len), single(1, len), col(len, 1), unaligned(len, 1);
    for (Index c = 0; c < len; ++c)
      linattn::Silu{}.map(row.block(0, c, 1, 1), one_by_one.block(0, c, 1, 1));
    linattn::Silu{}.map(row, single);
    linattn::Silu{}.map(row.transpose(), col);
    std::vector<S> buf(std::size_t(len) + 1);
    Eigen::Map<Mat<S>>(buf.data() + 1, len, 1) = row.transpose();
    linattn::Silu{}.map(Eigen::Map<const Mat<S>>(buf.data() + 1, len, 1), unaligned);
    EXPECT_TRUE(test::same_bits(single, one_by_one)) << "len=" << len;
    EXPECT_TRUE(test::same_bits(col.transpose(), one_by_one)) << "len=" << len;
    EXPECT_TRUE(test::same_bits(unaligned.transpose(), one_by_one)) << "len=" << len;
    Mat<S> g_one(1, len), g_col(len, 1);
    for (Index c = 0; c < len; ++c)
      linattn::Silu{}.backward(row.block(0, c, 1, 1), Mat<S>::Ones(1, 1), g_one.block(0, c, 1, 1));
    linattn::Silu{}.backward(row.transpose(), Mat<S>::Ones(len, 1), g_col);
    EXPECT_TRUE(test::same_bits(g_col.transpose(), g_one)) << "backward, len=" << len;
  }
}

TEST(Silu, NonFiniteInputsAndPositionsFloat) { check_silu_special<float>(); }
TEST(Silu, NonFiniteInputsAndPositionsDouble) { check_silu_special<double>(); }

// ---------------------------------------------------------------------------------------------
// L2Normalize on zero, tiny, huge and non-finite rows.
// ---------------------------------------------------------------------------------------------

template <class S, class Map>
Mat<S> features(const Map& phi, const Mat<S>& x) {
  Mat<S> out(x.rows(), phi.feature_dim(x.cols()));
  phi.map(x, out);
  return out;
}

template <class S>
void check_l2_rows() {
  using L = std::numeric_limits<S>;
  const linattn::L2Normalize<> unit;
  const linattn::L2Normalize<linattn::Silu> gdn;
  for (const Index D : {1, 2, 5, 64}) {
    // Tiny rows (denormal norms) among normal ones, and a zero row (row 8): directions, 0.
    for (const S tiny : {S(1e-40), L::denorm_min(), S(sizeof(S) == 4 ? 1e-30 : 1e-310)}) {
      const Mat<S> x = tiny_rows<S>(D, tiny, test::seed_of({D, 151}));
      const Mat<S> phi = features<S>(unit, x);
      ASSERT_TRUE(test::all_finite(phi));
      const double err = test::max_abs_diff(phi, ref::unit_rows(x.template cast<double>()));
      test::report_error(std::string("L2Normalize<Identity>/") + test::scalar_name<S>() +
                             "/tiny_rows",
                         err);
      EXPECT_LE(err, 4 * L::epsilon()) << "D=" << D << " tiny=" << tiny;
      EXPECT_TRUE((phi.row(8).array() == S(0)).all());
      // Through Silu: silu(tiny) = tiny/2 rounded to a denormal, then normalised; compared with
      // the normalisation of those features.
      const Mat<S> g = silu_of<S>(x);
      const Mat<S> phig = features<S>(gdn, x);
      EXPECT_LE(test::max_abs_diff(phig, ref::unit_rows(g.template cast<double>())),
                4 * L::epsilon())
          << "D=" << D << " tiny=" << tiny;
    }
    // Huge rows: squared norms (and for row 0 the norm itself) overflow.
    Mat<S> x = test::random_matrix<S>(6, D, test::seed_of({D, 152})) * S(sizeof(S) == 4 ? 1e30 : 1e200);
    x.row(0).setConstant(L::max());
    x.row(1).setConstant(-L::max() / 2);
    const Mat<S> phi = features<S>(unit, x);
    ASSERT_TRUE(test::all_finite(phi));
    EXPECT_LE(test::max_abs_diff(phi, ref::unit_rows(x.template cast<double>())), 4 * L::epsilon())
        << "D=" << D;
    EXPECT_LE(test::max_abs_diff(features<S>(gdn, x), ref::unit_rows(silu_of<S>(x).template cast<double>())),
              4 * L::epsilon())
        << "D=" << D;
    // Zero rows: φ = 0 and gradient 0. Silu maps rows of inputs below -174 to -0 as well.
    Mat<S> z = Mat<S>::Zero(3, D);
    z.row(1).setConstant(S(-1000));
    z.row(2).setConstant(-L::infinity());
    const Mat<S> gz = test::random_matrix<S>(3, D, 153);
    Mat<S> dz(3, D);
    EXPECT_TRUE((features<S>(gdn, z).array() == S(0)).all()) << "D=" << D;
    gdn.backward(z, gz, dz);
    EXPECT_TRUE((dz.array() == S(0)).all()) << "D=" << D << "\n" << dz;
    EXPECT_TRUE((features<S>(unit, z.topRows(1)).array() == S(0)).all()) << "D=" << D;
    unit.backward(z.topRows(1), gz.topRows(1), dz.topRows(1));
    EXPECT_TRUE((dz.topRows(1).array() == S(0)).all()) << "D=" << D;
    // A non-finite entry gives a NaN row (and NaN gradient); the other rows are unaffected.
    Mat<S> nf = test::random_matrix<S>(3, D, test::seed_of({D, 154}));
    nf(0, 0) = L::infinity();
    nf(2, D - 1) = L::quiet_NaN();
    const Mat<S> pnf = features<S>(unit, nf);
    EXPECT_TRUE(pnf.row(0).array().isNaN().all()) << pnf;
    EXPECT_TRUE(pnf.row(2).array().isNaN().all()) << pnf;
    EXPECT_LE(test::max_abs_diff(pnf.row(1), ref::unit_rows(nf.row(1).template cast<double>())),
              4 * L::epsilon());
    Mat<S> dnf(3, D);
    unit.backward(nf, Mat<S>::Ones(3, D), dnf);
    EXPECT_TRUE(dnf.row(0).array().isNaN().all());
    EXPECT_TRUE(test::all_finite(dnf.row(1)));
  }
}

TEST(L2Normalize, ZeroTinyHugeAndNonFiniteRowsFloat) { check_l2_rows<float>(); }
TEST(L2Normalize, ZeroTinyHugeAndNonFiniteRowsDouble) { check_l2_rows<double>(); }

TEST(L2Normalize, BackwardOfTinyAndHugeRows) {
  // (I − ĝĝᵀ) g_φ / ‖g‖ for rows whose squared norm under- or overflows, against a double
  // reference computed on the row scaled by its largest entry (exact).
  const auto check = [](auto tag, double scale, double g_scale, double rel_tol, const char* what) {
    using S = decltype(tag);
    const Index D = 6;
    const Mat<S> x = (test::random_matrix<double>(9, D, 161) * scale).template cast<S>();
    const Mat<S> g = (test::random_matrix<double>(9, D, 162) * g_scale).template cast<S>();
    Mat<S> grad(9, D);
    linattn::L2Normalize<>{}.backward(x, g, grad);
    ASSERT_TRUE(test::all_finite(grad)) << grad;
    double worst = 0;
    for (Index i = 0; i < x.rows(); ++i) {
      const Eigen::RowVectorXd xi = x.row(i).template cast<double>();
      const Eigen::RowVectorXd gi = g.row(i).template cast<double>();
      const double s = xi.cwiseAbs().maxCoeff();
      const Eigen::RowVectorXd u = (xi / s) / (xi / s).norm();
      const Eigen::RowVectorXd expected = ((gi - u.dot(gi) * u) / (xi / s).norm()) / s;
      worst = std::max(worst, test::max_abs_diff(grad.row(i), expected) /
                                  std::max(expected.cwiseAbs().maxCoeff(), 1e-300));
    }
    test::report_error(std::string("L2Normalize/backward/") + test::scalar_name<S>() + "/" + what +
                           " (relative)",
                       worst);
    EXPECT_LE(worst, rel_tol) << scale;
  };
  // Measured 1.6e-7 and 2.4e-7 (float), 5.2e-16 and 4.5e-16 (double).
  check(float(), 1e-40, 1e-5, 1e-6, "denormal_rows");  // gradients up to ~1e35
  check(float(), 1e30, 1.0, 1e-6, "huge_rows");        // ‖x‖² overflows
  check(double(), 1e-310, 1e-12, 2e-15, "denormal_rows");
  check(double(), 1e200, 1.0, 2e-15, "huge_rows");
}

// ---------------------------------------------------------------------------------------------
// Backward of the new maps against central differences in double, over inputs of several
// magnitudes (rows of L2Normalize scaled by 1e-3 ... 1e3, Silu over [-30, 30]).
// ---------------------------------------------------------------------------------------------

// The scale of a row's gradient is max|G_r| times that of the map's Jacobian: about 1 for
// Identity and Silu (max φ' ≈ 1.1), that of the inner map over ‖g(x)‖ for L2Normalize. Errors
// are measured against it: a row's own gradient can be far smaller (L2Normalize with D = 1
// has gradient 0, and one entry that dominates its row has tiny gradients for the others),
// where central differences give only their rounding noise.
double jacobian_scale(const linattn::Identity&, const MatD&) { return 1.0; }
double jacobian_scale(const linattn::Silu&, const MatD&) { return 1.1; }
template <class Inner>
double jacobian_scale(const linattn::L2Normalize<Inner>& phi, const MatD& row) {
  MatD g(1, row.cols());
  phi.inner.map(row, g);
  return jacobian_scale(phi.inner, row) / std::max(1e-300, g.norm());
}

// max over rows of |backward − central differences| / the gradient's scale, for
// f_r(x_r) = G_r · φ(x_r) (φ is row-wise), with steps of 1e-6 times the row's largest magnitude.
template <class Map>
double backward_fd_error(const Map& phi, const MatD& x, std::uint32_t seed) {
  const Index n = x.rows(), D = x.cols(), F = phi.feature_dim(D);
  const MatD G = test::random_matrix<double>(n, F, seed);
  MatD grad(n, D);
  phi.backward(x, G, grad);
  double worst = 0;
  MatD row(1, F);
  for (Index r = 0; r < n; ++r) {
    const double h = 1e-6 * std::max(1e-300, x.row(r).cwiseAbs().maxCoeff());
    MatD fd(1, D);
    for (Index c = 0; c < D; ++c) {
      MatD xp = x.row(r), xm = x.row(r);
      xp(0, c) += h;
      xm(0, c) -= h;
      phi.map(xp, row);
      const double up = G.row(r).dot(row.row(0));
      phi.map(xm, row);
      fd(0, c) = (up - G.row(r).dot(row.row(0))) / (2 * h);
    }
    const double scale = test::max_abs(G.row(r)) * jacobian_scale(phi, x.row(r));
    worst = std::max(worst, test::max_abs_diff(grad.row(r), fd) / std::max(1e-300, scale));
  }
  return worst;
}

TEST(FeatureMapBackward, NewMapsMatchCentralDifferences) {
  for (const Index D : {1, 3, 16}) {
    MatD x = test::random_matrix<double>(12, D, test::seed_of({D, 171}), -1, 1);
    for (Index r = 0; r < x.rows(); ++r) x.row(r) *= std::pow(10.0, double(r % 7) - 3);  // 1e-3..1e3
    const MatD xs = test::random_matrix<double>(40, D, test::seed_of({D, 172}), -30, 30);
    const double e_silu = backward_fd_error(linattn::Silu{}, xs, 173);
    const double e_id = backward_fd_error(linattn::Identity{}, x, 174);
    const double e_l2 = backward_fd_error(linattn::L2Normalize<>{}, x, 175);
    const double e_gdn = backward_fd_error(linattn::L2Normalize<linattn::Silu>{}, x, 176);
    const double e_gdn_s = backward_fd_error(linattn::L2Normalize<linattn::Silu>{}, xs, 177);
    const std::string d = "/D=" + std::to_string(D) + " (relative)";
    test::report_error("Silu/backward_vs_fd" + d, e_silu);
    test::report_error("Identity/backward_vs_fd" + d, e_id);
    test::report_error("L2Normalize<Identity>/backward_vs_fd" + d, e_l2);
    test::report_error("L2Normalize<Silu>/backward_vs_fd" + d, e_gdn);
    test::report_error("L2Normalize<Silu>/backward_vs_fd/[-30,30]" + d, e_gdn_s);
    // Measured at most 4e-10 (rounding noise of the differences, ~ε·|f|/h), except
    // L2Normalize<Silu> on rows of magnitude 1e3: 1.6e-8 (there ‖g‖ ~ 1e3 makes the gradient
    // small against f, while Silu's curvature near 0 limits the step).
    EXPECT_LE(e_silu, 2e-9) << D;
    EXPECT_LE(e_id, 2e-9) << D;
    EXPECT_LE(e_l2, 2e-9) << D;
    EXPECT_LE(e_gdn, 6e-8) << D;
    EXPECT_LE(e_gdn_s, 3e-9) << D;
  }
}

// ---------------------------------------------------------------------------------------------
// The new maps through the normalised kernels: equal to the naive O(N²) double reference.
// Identity, Silu and L2Normalize have features of both signs in general; the queries and keys
// here are offset to [0.25, 1.25], so that every feature (and every denominator) is clearly
// positive and the comparison is not about cancelling denominators.
// ---------------------------------------------------------------------------------------------

template <class S, class Map>
double kernels_vs_reference(const Map& phi, const char* name) {
  double worst = 0;
  for (const auto& sh : test::causal_shapes()) {
    const Mat<S> Q = test::random_matrix<S>(sh.N, sh.D, test::seed_of({sh.N, sh.D, 181}), 0.25, 1.25);
    const Mat<S> K = test::random_matrix<S>(sh.L, sh.D, test::seed_of({sh.L, sh.D, 182}), 0.25, 1.25);
    const Mat<S> V = test::random_matrix<S>(sh.L, sh.M, test::seed_of({sh.L, sh.M, 183}), -3, 3);
    const MatD Qd = Q.template cast<double>(), Kd = K.template cast<double>(),
               Vd = V.template cast<double>();
    const MatD expected = ref::generic_linear_attention(Qd, Kd, Vd, phi, false);
    const MatD cexpected = ref::generic_linear_attention(Qd, Kd, Vd, phi, true);
    const auto err = [&](const Mat<S>& out, const MatD& e) {
      EXPECT_TRUE(test::all_finite(out)) << name << " " << sh;
      return test::max_abs_diff(out, e);
    };
    worst = std::max(worst, err(linattn::linear_attention(Q, K, V, phi), expected));
    const RowMat<S> Qr = Q, Kr = K, Vr = V;  // token-major memory (the elementwise maps' path)
    worst = std::max(worst, err(linattn::linear_attention(Qr, Kr, Vr, phi), expected));
    for (const auto algo : {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent}) {
      linattn::CausalOptions opts;
      opts.algorithm = algo;
      opts.chunk_size = 16;
      worst = std::max(worst, err(linattn::causal_linear_attention(Q, K, V, phi, opts), cexpected));
      worst = std::max(worst, err(linattn::causal_linear_attention(Qr, Kr, Vr, phi, opts), cexpected));
    }
  }
  test::report_error(std::string(name) + "/kernels_vs_naive/" + test::scalar_name<S>(), worst);
  return worst;
}

TEST(NewMapsInKernels, EqualTheNaiveDoubleReference) {
  // Outputs are convex combinations of V (|V| <= 3). Measured at most 6.4e-7 (float) and
  // 1.3e-15 (double); the bounds are about 4.5 times that.
  const auto bound = [](auto tag) { return test::bound<decltype(tag)>(1e-6, 2e-15, 3.0); };
  IF_FLOAT(EXPECT_LE(kernels_vs_reference<float>(linattn::Identity{}, "Identity"), bound(float())));
  IF_DOUBLE(EXPECT_LE(kernels_vs_reference<double>(linattn::Identity{}, "Identity"), bound(double())));
  IF_FLOAT(EXPECT_LE(kernels_vs_reference<float>(linattn::Silu{}, "Silu"), bound(float())));
  IF_DOUBLE(EXPECT_LE(kernels_vs_reference<double>(linattn::Silu{}, "Silu"), bound(double())));
  IF_FLOAT(EXPECT_LE(kernels_vs_reference<float>(linattn::L2Normalize<>{}, "L2Normalize<Identity>"),
            bound(float())));
  IF_DOUBLE(EXPECT_LE(kernels_vs_reference<double>(linattn::L2Normalize<>{}, "L2Normalize<Identity>"),
            bound(double())));
  IF_FLOAT(EXPECT_LE(kernels_vs_reference<float>(linattn::L2Normalize<linattn::Silu>{}, "L2Normalize<Silu>"),
            bound(float())));
  IF_DOUBLE(EXPECT_LE(kernels_vs_reference<double>(linattn::L2Normalize<linattn::Silu>{}, "L2Normalize<Silu>"),
            bound(double())));
}

TEST(NewMapsInKernels, GradientsOfL2NormalizeSiluMatchFiniteDifferences) {
  // The kernels' backward chains through the map's backward (linear_attention_backward.hpp):
  // the gradients of Σ out ∘ W with respect to Q and K, against central differences.
  const Index N = 9, D = 4, M = 3;
  const linattn::L2Normalize<linattn::Silu> phi;
  const MatD Q = test::random_matrix<double>(N, D, 191, 0.25, 1.25);
  const MatD K = test::random_matrix<double>(N, D, 192, 0.25, 1.25);
  const MatD V = test::random_matrix<double>(N, M, 193);
  const MatD W = test::random_matrix<double>(N, M, 194);
  for (const bool causal : {false, true}) {
    const auto f = [&](const MatD& q, const MatD& k, const MatD& v) -> MatD {
      return causal ? MatD(linattn::causal_linear_attention(q, k, v, phi))
                    : MatD(linattn::linear_attention(q, k, v, phi));
    };
    const auto g = causal ? linattn::causal_linear_attention_backward(Q, K, V, W, phi)
                          : linattn::linear_attention_backward(Q, K, V, W, phi);
    const double eq = test::relative_error(g.dQ, test::finite_difference(f, Q, K, V, W, 0));
    const double ek = test::relative_error(g.dK, test::finite_difference(f, Q, K, V, W, 1));
    test::report_error(std::string("L2Normalize<Silu>/") + (causal ? "causal" : "noncausal") +
                           "_backward_vs_fd",
                       std::max(eq, ek));
    EXPECT_LE(eq, 1e-9) << causal;  // measured at most 1.3e-10
    EXPECT_LE(ek, 1e-9) << causal;
  }
}

}  // namespace
