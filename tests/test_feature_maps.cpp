// Conformance of feature maps to the FeatureMap concept (feature_map.hpp) and to spec §2: a
// typed suite that every map (the built-in ones, L2Normalize over two inner maps, and two
// user-defined ones) must pass, in float and double, plus exact per-map checks.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "reference.hpp"
#include "test_util.hpp"

namespace {

using test::Index;
using test::Mat;
using test::MatD;
using test::RowMat;

// ---------------------------------------------------------------------------------------------
// Two user-defined maps, written against the documented concept only.
// ---------------------------------------------------------------------------------------------

/// φ(x) = max(x, 0): no parameters, F = D, no backward (the example of feature_map.hpp).
struct Relu {
  static constexpr bool elementwise = true;
  Index feature_dim(Index d) const { return d; }
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x,
           linattn::MatrixRef<typename Derived::Scalar> phi) const {
    phi = x.cwiseMax(typename Derived::Scalar(0));
  }
};

/// Positive random features (Performer-style), a map with parameters and F = 2·D:
///   φ_f(x) = exp(w_f·x' − ‖x'‖²/2) / √F,  x' = x / D^{1/4},
/// with W a fixed D x F Gaussian matrix drawn from a seed. Strictly positive (until exp
/// underflows for huge inputs). Provides backward:
///   ∇x = s·W(g ⊙ φ) − s²(g·φ) x,  s = D^{-1/4}.
class ExpRandomFeatures {
 public:
  explicit ExpRandomFeatures(Index input_dim, std::uint32_t seed = 1234)
      : wd_(test::gaussian_matrix<double>(input_dim, 2 * input_dim, seed)),
        wf_(wd_.cast<float>()) {}

  Index feature_dim(Index d) const { return 2 * d; }

  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x,
           linattn::MatrixRef<typename Derived::Scalar> phi) const {
    using S = typename Derived::Scalar;
    const auto& W = weights<S>();
    const S s = S(1) / std::sqrt(std::sqrt(S(x.cols())));
    const S inv_sqrt_f = S(1) / std::sqrt(S(W.cols()));
    // Copied into a plain matrix first: a user map may allocate, and one GEMM per scalar type
    // (instead of one per input expression type) keeps this test quick to compile.
    const Mat<S> xe = x;
    phi.noalias() = xe * W;
    for (Index i = 0; i < xe.rows(); ++i) {
      const S half = S(0.5) * s * s * xe.row(i).squaredNorm();
      phi.row(i) = ((phi.row(i).array() * s - half).exp() * inv_sqrt_f).matrix();
    }
  }

  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                linattn::MatrixRef<typename DX::Scalar> grad_x) const {
    using S = typename DX::Scalar;
    const auto& W = weights<S>();
    const S s = S(1) / std::sqrt(std::sqrt(S(x.cols())));
    const Mat<S> xe = x;
    Mat<S> phi(xe.rows(), W.cols());
    map(xe, phi);
    const Mat<S> gphi = grad_phi.cwiseProduct(phi);
    grad_x.noalias() = s * (gphi * W.transpose());
    for (Index i = 0; i < xe.rows(); ++i) grad_x.row(i) -= (s * s * gphi.row(i).sum()) * xe.row(i);
  }

 private:
  template <class S>
  const Mat<S>& weights() const {
    if constexpr (sizeof(S) == sizeof(float))
      return wf_;
    else
      return wd_;
  }
  Mat<double> wd_;
  Mat<float> wf_;
};

// Compile-time conformance (feature_map.hpp): the detection traits.
struct NoMap {
  Index feature_dim(Index d) const { return d; }
};
struct NoFeatureDim {
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>&, linattn::MatrixRef<typename Derived::Scalar>) const {}
};
static_assert(linattn::is_feature_map_v<Relu, float>);
static_assert(linattn::is_feature_map_v<Relu, double>);
static_assert(linattn::is_feature_map_v<ExpRandomFeatures, float>);
static_assert(linattn::is_feature_map_v<linattn::EluPlusOne, float>);
static_assert(linattn::is_feature_map_v<linattn::SoftmaxSplit, double>);
static_assert(linattn::is_feature_map_v<linattn::NormalizedCosine, float>);
static_assert(!linattn::is_feature_map_v<int, float>);
static_assert(!linattn::is_feature_map_v<NoMap, float>);
static_assert(!linattn::is_feature_map_v<NoFeatureDim, float>);
static_assert(!linattn::has_backward_v<Relu, float>);
static_assert(linattn::has_backward_v<ExpRandomFeatures, double>);
static_assert(linattn::has_backward_v<linattn::EluPlusOne, float>);
static_assert(linattn::normalizes_keys_per_feature_v<linattn::SoftmaxSplit>);
static_assert(!linattn::normalizes_keys_per_feature_v<linattn::EluPlusOne>);
static_assert(!linattn::normalizes_keys_per_feature_v<Relu>);
static_assert(linattn::is_feature_map_v<linattn::Identity, float>);
static_assert(linattn::is_feature_map_v<linattn::Silu, double>);
static_assert(linattn::is_feature_map_v<linattn::L2Normalize<>, float>);
static_assert(linattn::is_feature_map_v<linattn::L2Normalize<linattn::Silu>, double>);
static_assert(linattn::has_backward_v<linattn::Identity, float>);
static_assert(linattn::has_backward_v<linattn::Silu, float>);
static_assert(linattn::has_backward_v<linattn::L2Normalize<>, double>);
static_assert(linattn::has_backward_v<linattn::L2Normalize<linattn::Silu>, float>);
static_assert(std::is_same_v<linattn::L2Normalize<>, linattn::L2Normalize<linattn::Identity>>);
// Silu and Identity are elementwise (mapped token-major by the kernels), L2Normalize is not;
// none of them has non-negative features, except L2Normalize over a map that has.
static_assert(linattn::detail::declares_elementwise<linattn::Silu>::value);
static_assert(linattn::detail::declares_elementwise<linattn::Identity>::value);
static_assert(!linattn::detail::declares_elementwise<linattn::L2Normalize<linattn::Silu>>::value);
static_assert(linattn::detail::may_cancel_v<linattn::Silu>);
static_assert(linattn::detail::may_cancel_v<linattn::L2Normalize<linattn::Silu>>);
static_assert(!linattn::detail::may_cancel_v<linattn::L2Normalize<linattn::EluPlusOne>>);

// ---------------------------------------------------------------------------------------------
// What the typed suite knows about each map.
// ---------------------------------------------------------------------------------------------

// What a map promises about signs, checked by FeatureAndSimilarityBounds and used by
// LinearAttentionMatchesTheDoubleReference to tell which denominators may cancel:
//  - NonNegative: every similarity φ(x)·φ(y) >= 0 (and every feature > 0 if strictly_positive);
//  - UnitRows:    every nonzero feature row is a unit vector, so sim = cos ∈ [-1, 1];
//  - Signed:      features of both signs, each >= lowest_feature (no bound on sim).
// Denominators of UnitRows and Signed maps cancel: they are compared with the reference on the
// rows where they are well conditioned only (see LinearAttentionMatchesTheDoubleReference).
enum class Similarity { NonNegative, UnitRows, Signed };

template <class Map>
struct MapInfo;

template <>
struct MapInfo<linattn::EluPlusOne> {
  static constexpr const char* name = "EluPlusOne";
  static linattn::EluPlusOne make(Index) { return {}; }
  static Index expected_F(Index D) { return D; }
  static constexpr bool strictly_positive = true;
  static constexpr bool has_backward = true;
  static constexpr Similarity similarity = Similarity::NonNegative;
};
template <>
struct MapInfo<linattn::SoftmaxSplit> {
  static constexpr const char* name = "SoftmaxSplit";
  static linattn::SoftmaxSplit make(Index) { return {}; }
  static Index expected_F(Index D) { return D; }
  static constexpr bool strictly_positive = true;
  static constexpr bool has_backward = true;
  static constexpr Similarity similarity = Similarity::NonNegative;
};
template <>
struct MapInfo<linattn::NormalizedCosine> {
  static constexpr const char* name = "NormalizedCosine";
  static linattn::NormalizedCosine make(Index) { return {}; }
  static Index expected_F(Index D) { return D + 1; }
  static constexpr bool strictly_positive = false;
  static constexpr bool has_backward = true;
  static constexpr Similarity similarity = Similarity::NonNegative;
};
template <>
struct MapInfo<Relu> {
  static constexpr const char* name = "Relu";
  static Relu make(Index) { return {}; }
  static Index expected_F(Index D) { return D; }
  static constexpr bool strictly_positive = false;
  static constexpr bool has_backward = false;
  static constexpr Similarity similarity = Similarity::NonNegative;
};
template <>
struct MapInfo<ExpRandomFeatures> {
  static constexpr const char* name = "ExpRandomFeatures";
  static ExpRandomFeatures make(Index D) { return ExpRandomFeatures(D); }
  static Index expected_F(Index D) { return 2 * D; }
  static constexpr bool strictly_positive = true;
  static constexpr bool has_backward = true;
  static constexpr Similarity similarity = Similarity::NonNegative;
};

template <>
struct MapInfo<linattn::Identity> {
  static constexpr const char* name = "Identity";
  static linattn::Identity make(Index) { return {}; }
  static Index expected_F(Index D) { return D; }
  static constexpr bool strictly_positive = false;
  static constexpr bool has_backward = true;
  static constexpr Similarity similarity = Similarity::Signed;
  static constexpr double lowest_feature = -std::numeric_limits<double>::infinity();
};
template <>
struct MapInfo<linattn::Silu> {
  static constexpr const char* name = "Silu";
  static linattn::Silu make(Index) { return {}; }
  static Index expected_F(Index D) { return D; }
  static constexpr bool strictly_positive = false;
  static constexpr bool has_backward = true;
  static constexpr Similarity similarity = Similarity::Signed;
  // min_x x·σ(x), at x = -1.27846 (the root of 1 + x(1 − σ(x))), rounded down.
  static constexpr double lowest_feature = -0.2784645428;
};
template <>
struct MapInfo<linattn::L2Normalize<linattn::Identity>> {
  static constexpr const char* name = "L2NormalizeIdentity";
  static linattn::L2Normalize<linattn::Identity> make(Index) { return {}; }
  static Index expected_F(Index D) { return D; }
  static constexpr bool strictly_positive = false;
  static constexpr bool has_backward = true;
  static constexpr Similarity similarity = Similarity::UnitRows;
};
template <>
struct MapInfo<linattn::L2Normalize<linattn::Silu>> {
  static constexpr const char* name = "L2NormalizeSilu";
  static linattn::L2Normalize<linattn::Silu> make(Index) { return {}; }
  static Index expected_F(Index D) { return D; }
  static constexpr bool strictly_positive = false;
  static constexpr bool has_backward = true;
  static constexpr Similarity similarity = Similarity::UnitRows;
};

template <class MapT, class ScalarT>
struct MapCase {
  using Map = MapT;
  using Scalar = ScalarT;
};

// The suite is compiled twice from this file (see tests/CMakeLists.txt), once per scalar type,
// so that neither translation unit takes long to compile: test_feature_maps runs the float
// cases and the per-map tests below, test_feature_maps_double (LINATTN_TEST_DOUBLE_CASES) the
// double cases.
#ifndef LINATTN_TEST_DOUBLE_CASES
using CaseScalar = float;
#else
using CaseScalar = double;
#endif
using MapCases = ::testing::Types<MapCase<linattn::EluPlusOne, CaseScalar>,
                                  MapCase<linattn::SoftmaxSplit, CaseScalar>,
                                  MapCase<linattn::NormalizedCosine, CaseScalar>,
                                  MapCase<Relu, CaseScalar>, MapCase<ExpRandomFeatures, CaseScalar>,
                                  MapCase<linattn::Identity, CaseScalar>,
                                  MapCase<linattn::Silu, CaseScalar>,
                                  MapCase<linattn::L2Normalize<linattn::Identity>, CaseScalar>,
                                  MapCase<linattn::L2Normalize<linattn::Silu>, CaseScalar>>;

struct MapCaseNames {
  template <class C>
  static std::string GetName(int) {
    return std::string(MapInfo<typename C::Map>::name) + "_" +
           test::scalar_name<typename C::Scalar>();
  }
};

template <class C>
class FeatureMapConformance : public ::testing::Test {
 protected:
  using Map = typename C::Map;
  using S = typename C::Scalar;
  using Info = MapInfo<Map>;

  // φ(x) through the map, into a fresh n x F matrix.
  template <class Derived>
  static Mat<S> apply(const Map& map, const Eigen::MatrixBase<Derived>& x) {
    Mat<S> phi(x.rows(), map.feature_dim(x.cols()));
    map.map(x, phi);
    return phi;
  }

  // Agreement up to vectorisation / summation-order rounding.
  static double near_tol(const Mat<S>& phi) {
    return 16 * test::Tol<S>::ulps * std::max(1.0, test::max_abs(phi));
  }
};

TYPED_TEST_SUITE(FeatureMapConformance, MapCases, MapCaseNames);

TYPED_TEST(FeatureMapConformance, FeatureDimMatchesTheOutputWidth) {
  using S = typename TestFixture::S;
  using Info = typename TestFixture::Info;
  for (const Index D : {1, 2, 7, 16, 65}) {
    const auto map = Info::make(D);
    const Index F = map.feature_dim(D);
    EXPECT_EQ(F, Info::expected_F(D)) << "D=" << D;
    // The map must fill exactly the n x F block it is given: every entry of a NaN-filled
    // output is overwritten, and the entries around it (a larger matrix) are untouched.
    const Mat<S> x = test::random_matrix<S>(5, D, test::seed_of({D, 1}));
    Mat<S> big = Mat<S>::Constant(9, F + 3, std::numeric_limits<S>::quiet_NaN());
    big.block(2, 1, 5, F).setConstant(std::numeric_limits<S>::quiet_NaN());
    map.map(x, big.block(2, 1, 5, F));
    EXPECT_TRUE(test::all_finite(big.block(2, 1, 5, F))) << "D=" << D;
    for (Index c = 0; c < big.cols(); ++c)
      for (Index r = 0; r < big.rows(); ++r)
        if (r < 2 || r >= 7 || c < 1 || c >= F + 1) {
          EXPECT_TRUE(std::isnan(big(r, c))) << "wrote outside its block at " << r << "," << c;
        }
  }
}

TYPED_TEST(FeatureMapConformance, IsRowWise) {
  using S = typename TestFixture::S;
  using Info = typename TestFixture::Info;
  for (const Index D : {1, 7, 33}) {
    const auto map = Info::make(D);
    // 513 rows: more than two of the 256-row blocks the built-in maps work in.
    const Mat<S> x = test::random_matrix<S>(513, D, test::seed_of({D, 2}), -3, 3);
    const Mat<S> phi = TestFixture::apply(map, x);
    const double tol = TestFixture::near_tol(phi);
    // Each row alone.
    double err_rows = 0;
    for (Index i = 0; i < x.rows(); ++i)
      err_rows = std::max(err_rows, test::max_abs_diff(TestFixture::apply(map, x.middleRows(i, 1)),
                                                       phi.row(i)));
    EXPECT_LE(err_rows, tol) << "D=" << D << ": a row alone differs from the same row in a block";
    // Any block of rows, wherever it starts.
    for (const Index start : {0, 1, 100, 255, 256, 400}) {
      const Index n = x.rows() - start;
      EXPECT_LE(test::max_abs_diff(TestFixture::apply(map, x.middleRows(start, n)),
                                   phi.middleRows(start, n)),
                tol)
          << "D=" << D << " start=" << start;
    }
    // The rows in reverse order: row i of φ must not depend on its neighbours.
    const Mat<S> reversed = x.colwise().reverse();
    EXPECT_LE(test::max_abs_diff(TestFixture::apply(map, reversed), phi.colwise().reverse()), tol)
        << "D=" << D;
  }
}

TYPED_TEST(FeatureMapConformance, AcceptsMapsBlocksAndRowMajorInputs) {
  // (Three input types only: every extra expression type instantiates every map again, in
  // both scalar types, and this file must stay quick to compile. test_linear_attention.cpp
  // covers more layouts through the kernels.)
  using S = typename TestFixture::S;
  using Info = typename TestFixture::Info;
  const Index n = 300, D = 9;
  const auto map = Info::make(D);
  const Index F = map.feature_dim(D);
  const Mat<S> x = test::random_matrix<S>(n, D, test::seed_of({3}), -2, 2);
  const Mat<S> phi = TestFixture::apply(map, x);
  const double tol = TestFixture::near_tol(phi);

  // Eigen::Map over a std::vector, column-major.
  std::vector<S> buf(static_cast<std::size_t>(n * D));
  Eigen::Map<Mat<S>>(buf.data(), n, D) = x;
  EXPECT_LE(test::max_abs_diff(TestFixture::apply(map, Eigen::Map<const Mat<S>>(buf.data(), n, D)),
                               phi),
            tol);
  // Eigen::Map over a std::vector, row-major.
  std::vector<S> rbuf(static_cast<std::size_t>(n * D));
  Eigen::Map<RowMat<S>>(rbuf.data(), n, D) = x;
  EXPECT_LE(test::max_abs_diff(
                TestFixture::apply(map, Eigen::Map<const RowMat<S>>(rbuf.data(), n, D)), phi),
            tol);
  // A block of a larger matrix (neither first row nor first column).
  Mat<S> big = test::random_matrix<S>(n + 10, D + 5, 99);
  big.block(4, 3, n, D) = x;
  const Mat<S>& cbig = big;
  EXPECT_LE(test::max_abs_diff(TestFixture::apply(map, cbig.block(4, 3, n, D)), phi), tol);
  // Output into a Map over a buffer and into a block of a larger matrix.
  std::vector<S> obuf(static_cast<std::size_t>(n * F));
  Eigen::Map<Mat<S>> out_map(obuf.data(), n, F);
  map.map(x, out_map);
  EXPECT_LE(test::max_abs_diff(out_map, phi), tol);
  Mat<S> out_big = Mat<S>::Zero(n + 2, F + 4);
  map.map(x, out_big.block(1, 2, n, F));
  EXPECT_LE(test::max_abs_diff(out_big.block(1, 2, n, F), phi), tol);
}

TYPED_TEST(FeatureMapConformance, ElementwiseMapsAreEntrywise) {
  // A map declaring `elementwise` is applied by the kernels to the transpose of row-major
  // inputs (token-major buffers): φ(xᵀ) must be φ(x)ᵀ bit for bit, for any shape, including
  // the transpose of a strided row-major block (one head of a packed buffer).
  using S = typename TestFixture::S;
  using Info = typename TestFixture::Info;
  using Map = typename TestFixture::Map;
  if constexpr (linattn::detail::declares_elementwise<Map>::value) {
    for (const Index D : {1, 7, 64}) {
      const auto map = Info::make(D);
      ASSERT_EQ(map.feature_dim(D), D);
      const Mat<S> x = test::random_matrix<S>(300, D, test::seed_of({D, 9}), -100, 100);
      const Mat<S> phi = TestFixture::apply(map, x);
      Mat<S> phi_t(D, x.rows());
      map.map(x.transpose(), phi_t);
      EXPECT_EQ(test::max_abs_diff(phi_t.transpose(), phi), 0.0) << "D=" << D;
      RowMat<S> packed = RowMat<S>::Zero(x.rows(), 3 * D);
      packed.middleCols(D, D) = x;
      const RowMat<S>& cpacked = packed;
      Mat<S> phi_b(D, x.rows());
      map.map(cpacked.middleCols(D, D).transpose(), phi_b);
      EXPECT_EQ(test::max_abs_diff(phi_b.transpose(), phi), 0.0) << "D=" << D << " (strided)";
    }
  } else {
    GTEST_SKIP() << "not elementwise";
  }
}

TYPED_TEST(FeatureMapConformance, FiniteForInputsOfMagnitude100) {
  using S = typename TestFixture::S;
  using Info = typename TestFixture::Info;
  for (const Index D : {1, 4, 64}) {
    const auto map = Info::make(D);
    Mat<S> x = test::random_matrix<S>(40, D, test::seed_of({D, 4}), -100, 100);
    x.row(0).setConstant(S(100));
    x.row(1).setConstant(S(-100));
    x.row(2).setZero();
    for (Index c = 0; c < D; ++c) x(3, c) = (c % 2) ? S(100) : S(-100);
    const Mat<S> phi = TestFixture::apply(map, x);
    EXPECT_TRUE(test::all_finite(phi)) << "D=" << D;
  }
}

TYPED_TEST(FeatureMapConformance, FeatureAndSimilarityBounds) {
  // EluPlusOne, SoftmaxSplit and the exp map promise strictly positive features; Relu and
  // NormalizedCosine only non-negative similarities φ(x)·φ(y) (NormalizedCosine's features
  // can be negative, sim = 1 + cos ≥ 0). L2Normalize promises unit rows (sim = cos ∈ [-1, 1]);
  // Identity and Silu features of both signs, bounded below (Silu by min x·σ(x)).
  using S = typename TestFixture::S;
  using Info = typename TestFixture::Info;
  for (const Index D : {1, 5, 64}) {
    const auto map = Info::make(D);
    const Mat<S> x = test::random_matrix<S>(300, D, test::seed_of({D, 5}), -5, 5);
    const Mat<S> phi = TestFixture::apply(map, x);
    const Mat<S> sim = phi * phi.transpose();
    if constexpr (Info::similarity == Similarity::NonNegative) {
      if (Info::strictly_positive) {
        EXPECT_GT(phi.minCoeff(), S(0)) << "D=" << D;
      }
      EXPECT_GE(sim.minCoeff(), -S(4) * std::numeric_limits<S>::epsilon()) << "D=" << D;
    } else if constexpr (Info::similarity == Similarity::UnitRows) {
      // No zero row among these inputs: every row has norm 1 to a few ulps, and so
      // sim(x, x) = 1 and |sim| <= 1.
      const double tol = 4 * std::sqrt(double(D)) * std::numeric_limits<S>::epsilon();
      EXPECT_LE(test::max_abs_diff(phi.rowwise().norm(), Mat<S>::Ones(x.rows(), 1)), tol)
          << "D=" << D;
      EXPECT_LE(test::max_abs(sim), 1 + tol) << "D=" << D;
    } else {
      EXPECT_GE(double(phi.minCoeff()), Info::lowest_feature) << "D=" << D;
      EXPECT_LT(phi.minCoeff(), S(0)) << "D=" << D << ": features of both signs expected";
    }
  }
}

TYPED_TEST(FeatureMapConformance, LinearAttentionMatchesTheDoubleReference) {
  using S = typename TestFixture::S;
  using Info = typename TestFixture::Info;
  double worst = 0;
  Index skipped = 0, compared = 0;
  for (const test::Shape& sh : test::shapes()) {
    const auto map = Info::make(sh.D);
    const Mat<S> Q = test::random_matrix<S>(sh.N, sh.D, test::seed_of({sh.N, sh.L, sh.D, 11}));
    const Mat<S> K = test::random_matrix<S>(sh.L, sh.D, test::seed_of({sh.N, sh.L, sh.D, 12}));
    const Mat<S> V =
        test::random_matrix<S>(sh.L, sh.M, test::seed_of({sh.L, sh.M, 13}), -3, 3);
    const Mat<S> out = linattn::linear_attention(Q, K, V, map);
    Eigen::VectorXd den;
    const MatD expected =
        ref::linear_attention(Q.template cast<double>(), K.template cast<double>(),
                              V.template cast<double>(), map, &den);
    if constexpr (Info::similarity == Similarity::NonNegative) {
      // Rows whose denominator is (near) 0 are degenerate: Relu has φ(q) = 0 when q ≤ 0, and
      // NormalizedCosine has sim = 0 for every key exactly opposite to q (with D = 1: every key
      // of the other sign). NormalizedCosine's features can be negative, so φ(q)ᵀz cancels and
      // carries a rounding error of about ε·L: its rows are compared when den ≥ 5% of L.
      const double min_den =
          std::is_same_v<typename TestFixture::Map, linattn::NormalizedCosine> ? 0.05 * double(sh.L)
                                                                              : 1e-3;
      const auto rc =
          test::compare_well_conditioned_rows(out, expected, den, min_den, test::max_abs(V));
      EXPECT_LE(rc.max_err, test::tolerance<S>(test::max_abs(V))) << sh;
      if (Info::strictly_positive) {
        EXPECT_EQ(rc.skipped, 0) << sh << ": unexpected degenerate rows";
      }
      worst = std::max(worst, rc.max_err);
      skipped += rc.skipped;
      compared += rc.compared;
    } else {
      // Similarities of both signs: den = Σ_j sim_ij cancels, and the output, no longer a
      // convex combination of value rows, carries a rounding error of about ε·Σ_j |sim_ij| / den
      // relative to its magnitude. A row is compared when that condition number is at most 20
      // (den ≥ 5% of Σ_j |sim_ij|), against a tolerance relative to max(|V|, |out_i|); the
      // others (which the kernels may also zero as rounding noise) must be finite.
      const MatD PQ = ref::features_row_by_row(Q.template cast<double>(), map);
      const MatD PK = ref::features_row_by_row(K.template cast<double>(), map);
      const Eigen::VectorXd abs_den = (PQ * PK.transpose()).cwiseAbs().rowwise().sum();
      for (Index i = 0; i < sh.N; ++i) {
        if (den(i) > 0 && den(i) >= 0.05 * abs_den(i)) {
          ++compared;
          const double err = test::max_abs_diff(out.row(i), expected.row(i));
          const double scale = std::max(test::max_abs(V), test::max_abs(expected.row(i)));
          EXPECT_LE(err, test::tolerance<S>(scale)) << sh << " row " << i;
          worst = std::max(worst, err / std::max(1.0, scale));
        } else {
          ++skipped;
          EXPECT_TRUE(test::all_finite(out.row(i))) << sh << " row " << i;
        }
      }
    }
  }
  std::cout << "[ info     ] " << Info::name << ": " << compared << " rows compared, " << skipped
            << " degenerate rows (tiny or cancelling denominator) checked for finiteness only\n";
  if constexpr (Info::similarity != Similarity::NonNegative) {
    // With inputs symmetric about 0, |den| ~ √L·|sim| against Σ_j |sim_ij| ~ L·|sim|: about a
    // third of the rows are compared for Identity and L2Normalize<Identity> (float: 1161 and
    // 1096 of 3286), two thirds for the Silu maps.
    EXPECT_GE(4 * compared, compared + skipped) << Info::name;
  }
  test::report_error(std::string("linear_attention/") + Info::name + "/" +
                         test::scalar_name<S>() + "/shape_list",
                     worst);
}

TYPED_TEST(FeatureMapConformance, BackwardMatchesFiniteDifferences) {
  using Map = typename TestFixture::Map;
  using S = typename TestFixture::S;
  using Info = typename TestFixture::Info;
  EXPECT_EQ((linattn::has_backward_v<Map, S>), Info::has_backward);
  if constexpr (linattn::has_backward_v<Map, S>) {
    // f(x) = Σ G ⊙ φ(x) for a random G; backward(x, G) must be ∇f, checked against central
    // differences in double, and the Scalar version against the double one.
    for (const Index D : {1, 3, 8}) {
      const auto map = Info::make(D);
      const Index F = map.feature_dim(D), n = 6;
      const MatD x = test::random_matrix<double>(n, D, test::seed_of({D, 21}), -1.5, 1.5);
      const MatD G = test::random_matrix<double>(n, F, test::seed_of({D, 22}));
      const auto f = [&](const MatD& at) {
        MatD phi(n, F);
        map.map(at, phi);
        return G.cwiseProduct(phi).sum();
      };
      MatD grad(n, D);
      map.backward(x, G, grad);
      MatD fd(n, D);
      const double h = 1e-6;
      for (Index r = 0; r < n; ++r)
        for (Index c = 0; c < D; ++c) {
          MatD xp = x, xm = x;
          xp(r, c) += h;
          xm(r, c) -= h;
          fd(r, c) = (f(xp) - f(xm)) / (2 * h);
        }
      EXPECT_LE(test::max_abs_diff(grad, fd), 1e-6 * std::max(1.0, test::max_abs(fd)))
          << "D=" << D << "\nbackward:\n" << grad << "\nfinite differences:\n" << fd;

      const Mat<S> xs = x.cast<S>(), Gs = G.cast<S>();
      Mat<S> grad_s(n, D);
      map.backward(xs, Gs, grad_s);
      EXPECT_LE(test::max_abs_diff(grad_s, grad), 1e3 * test::Tol<S>::ulps * (1 + test::max_abs(grad)))
          << "D=" << D;
    }
  }
}

#ifndef LINATTN_TEST_DOUBLE_CASES
// ---------------------------------------------------------------------------------------------
// EluPlusOne: exact values (spec §2).
// ---------------------------------------------------------------------------------------------

template <class S>
S elu1(S x) {
  Mat<S> in(1, 1), out(1, 1);
  in(0, 0) = x;
  linattn::EluPlusOne{}.map(in, out);
  return out(0, 0);
}

TEST(EluPlusOne, ExactValues) {
  EXPECT_EQ(elu1(2.0f), 3.0f);
  EXPECT_EQ(elu1(0.0f), 1.0f);
  EXPECT_EQ(elu1(2.0), 3.0);
  EXPECT_EQ(elu1(0.0), 1.0);
  EXPECT_EQ(elu1(1e-3f), 1.0f + 1e-3f);
  // exp(x) below 0, with full relative precision (naive elu(x) + 1 would give 0 in float).
  EXPECT_NEAR(elu1(-20.0f) / std::exp(-20.0), 1.0, 1e-6);
  EXPECT_NEAR(elu1(-20.0) / std::exp(-20.0), 1.0, 1e-14);
  EXPECT_NEAR(elu1(-1.0f) / std::exp(-1.0), 1.0, 1e-6);
  EXPECT_NEAR(elu1(-80.0f) / std::exp(-80.0), 1.0, 1e-5);
  EXPECT_GT(elu1(-100.0f), 0.0f);  // exp(-100) ~ 3.7e-44 is a float denormal, still > 0
}

TEST(EluPlusOne, MatchesTheSpecFormulaElementwise) {
  const MatD x = test::random_matrix<double>(257, 6, 31, -30, 30);
  MatD phi(257, 6);
  linattn::EluPlusOne{}.map(x, phi);
  EXPECT_LE(test::max_abs_diff(phi, ref::elu_plus_one_features(x)), 1e-13 * 31);
}

// ---------------------------------------------------------------------------------------------
// SoftmaxSplit (query side): a stable row softmax.
// ---------------------------------------------------------------------------------------------

template <class S>
void check_softmax_rows(S scale, double tol) {
  const Mat<S> x = test::random_matrix<S>(300, 17, 41, -1, 1) * scale;
  Mat<S> phi(300, 17);
  linattn::SoftmaxSplit{}.map(x, phi);
  ASSERT_TRUE(test::all_finite(phi));
  EXPECT_GE(phi.minCoeff(), S(0));
  EXPECT_LE(test::max_abs_diff(phi.rowwise().sum(), Mat<S>::Ones(300, 1)), tol);
  EXPECT_LE(test::max_abs_diff(phi, ref::softmax_rows(x.template cast<double>())), tol);
}

TEST(SoftmaxSplit, RowsSumToOne) {
  check_softmax_rows<float>(1.0f, 1e-6);
  check_softmax_rows<double>(1.0, 1e-14);
  check_softmax_rows<float>(30.0f, 1e-5);
}

TEST(SoftmaxSplit, LargeInputsAreStable) {
  check_softmax_rows<float>(1000.0f, 1e-4);
  check_softmax_rows<double>(1000.0, 1e-12);
  // [1000, 999, 0] -> [1/(1+e^-1), e^-1/(1+e^-1), ~0]
  for (const double big : {1000.0, -1000.0 + 1}) {
    Eigen::MatrixXf x(1, 3), phi(1, 3);
    x << float(big), float(big - 1), float(big - 1000);
    linattn::SoftmaxSplit{}.map(x, phi);
    const double e = std::exp(-1.0);
    EXPECT_NEAR(phi(0, 0), 1 / (1 + e), 1e-6) << big;
    EXPECT_NEAR(phi(0, 1), e / (1 + e), 1e-6) << big;
    EXPECT_NEAR(phi(0, 2), 0.0, 1e-30) << big;
  }
}

// ---------------------------------------------------------------------------------------------
// NormalizedCosine: φ(x) = [1, x̂].
// ---------------------------------------------------------------------------------------------

template <class S>
Mat<S> cosine_features(const Mat<S>& x) {
  Mat<S> phi(x.rows(), x.cols() + 1);
  linattn::NormalizedCosine{}.map(x, phi);
  return phi;
}

TEST(NormalizedCosine, ZeroVectorMapsToOneThenZeros) {
  const Eigen::MatrixXf phi = cosine_features<float>(Eigen::MatrixXf::Zero(3, 5));
  Eigen::MatrixXf expected = Eigen::MatrixXf::Zero(3, 6);
  expected.col(0).setOnes();
  EXPECT_EQ(phi, expected);
  const Eigen::MatrixXd phid = cosine_features<double>(Eigen::MatrixXd::Zero(1, 1));
  EXPECT_EQ(phid(0, 0), 1.0);
  EXPECT_EQ(phid(0, 1), 0.0);
}

TEST(NormalizedCosine, FeaturesAreOneAndTheUnitVector) {
  const MatD x = test::random_matrix<double>(300, 7, 51, -4, 4);
  const MatD phi = cosine_features<double>(x);
  EXPECT_EQ(phi.col(0).minCoeff(), 1.0);
  EXPECT_EQ(phi.col(0).maxCoeff(), 1.0);
  EXPECT_LE(test::max_abs_diff(phi.rightCols(7), ref::unit_rows(x)), 1e-14);
}

TEST(NormalizedCosine, SimilarityIsInZeroTwo) {
  const Eigen::MatrixXf q = test::random_matrix<float>(200, 6, 52);
  const Eigen::MatrixXf k = test::random_matrix<float>(200, 6, 53);
  Eigen::MatrixXf x(600, 6);
  x << q, k, -q;  // -q: the opposite of every query, where sim = 0
  const Eigen::MatrixXf phi = cosine_features<float>(x);
  const Eigen::MatrixXf sim = phi.topRows(200) * phi.bottomRows(400).transpose();
  EXPECT_GE(sim.minCoeff(), -1e-6f);
  EXPECT_LE(sim.maxCoeff(), 2.0f + 1e-6f);
  for (Index i = 0; i < 200; ++i) {
    EXPECT_NEAR(phi.row(i).dot(phi.row(i)), 2.0f, 1e-6f);       // sim(q, q) = 2
    EXPECT_NEAR(phi.row(i).dot(phi.row(400 + i)), 0.0f, 1e-6f);  // sim(q, -q) = 0
  }
}

TEST(NormalizedCosine, HugeInputsAreStillNormalised) {
  // ‖x‖² overflows float for entries of 1e30 (and double for 1e200); x̂ must still be a unit
  // vector in the direction of x.
  Eigen::MatrixXf x = test::random_matrix<float>(20, 5, 54) * 1e30f;
  x.row(0).setConstant(1e38f);  // ‖x‖ = 2.2e38, close to FLT_MAX = 3.4e38
  const Eigen::MatrixXf phi = cosine_features<float>(x);
  ASSERT_TRUE(test::all_finite(phi));
  for (Index i = 0; i < x.rows(); ++i)
    EXPECT_NEAR(phi.row(i).tail(5).norm(), 1.0f, 1e-6f) << "row " << i;
  EXPECT_LE(test::max_abs_diff(phi.rightCols(5), ref::unit_rows(x.cast<double>())), 1e-6);

  const MatD xd = test::random_matrix<double>(20, 5, 55) * 1e200;
  const MatD phid = cosine_features<double>(xd);
  EXPECT_LE(test::max_abs_diff(phid.rightCols(5), ref::unit_rows(xd)), 1e-14);
}

TEST(NormalizedCosine, InputsWhoseNormOverflowsAreStillNormalised) {
  // Entries near FLT_MAX: ‖x‖ itself (not only ‖x‖²) exceeds FLT_MAX, yet x̂ = x / ‖x‖ is an
  // ordinary unit vector (here every entry 1/√5). normalized_cosine.hpp: "huge inputs still
  // normalise correctly".
  Eigen::MatrixXf x(3, 5);
  x.row(0).setConstant(3e38f);
  x.row(1) << 3e38f, -3e38f, 3e38f, 1.0f, -2e38f;
  x.row(2).setConstant(-std::numeric_limits<float>::max());
  const Eigen::MatrixXf phi = cosine_features<float>(x);
  ASSERT_TRUE(test::all_finite(phi));
  EXPECT_LE(test::max_abs_diff(phi.rightCols(5), ref::unit_rows(x.cast<double>())), 1e-6)
      << "x̂ =\n" << phi.rightCols(5);
}

TEST(NormalizedCosine, TinyInputsAreStillNormalised) {
  // Spec §2: x̂ = x / ‖x‖, and x̂ = 0 only when ‖x‖ = 0. A vector of entries 1e-30 has a norm
  // of about 1e-30 (a normal float); only its square underflows. Its x̂ must be a unit vector.
  Eigen::MatrixXf x = test::random_matrix<float>(20, 5, 56) * 1e-30f;
  x.row(0).setConstant(1e-30f);
  x.row(1).setConstant(1e-20f);  // ‖x‖² is a float denormal
  const Eigen::MatrixXf phi = cosine_features<float>(x);
  for (Index i = 0; i < x.rows(); ++i)
    EXPECT_NEAR(phi.row(i).tail(5).norm(), 1.0f, 1e-6f) << "row " << i << ": x = " << x.row(i);
  EXPECT_LE(test::max_abs_diff(phi.rightCols(5), ref::unit_rows(x.cast<double>())), 1e-6);

  const MatD xd = test::random_matrix<double>(20, 5, 57) * 1e-200;
  const MatD phid = cosine_features<double>(xd);
  EXPECT_LE(test::max_abs_diff(phid.rightCols(5), ref::unit_rows(xd)), 1e-14);
}

// The generic reference fed with the library's own maps agrees with the spec formulas: the
// maps are what the spec says, in double.
TEST(FeatureMapsInDouble, GenericReferenceAgreesWithTheSpecReference) {
  const MatD Q = test::random_matrix<double>(70, 6, 61, -3, 3);
  const MatD K = test::random_matrix<double>(90, 6, 62, -3, 3);
  const MatD V = test::random_matrix<double>(90, 4, 63);
  EXPECT_LE(test::max_abs_diff(ref::generic_linear_attention(Q, K, V, linattn::EluPlusOne{}),
                               ref::linear_attention(Q, K, V, linattn::EluPlusOne{})),
            1e-13);
  EXPECT_LE(test::max_abs_diff(ref::generic_linear_attention(Q, K, V, linattn::NormalizedCosine{}),
                               ref::linear_attention(Q, K, V, linattn::NormalizedCosine{})),
            1e-13);
}

#endif  // LINATTN_TEST_DOUBLE_CASES

}  // namespace
