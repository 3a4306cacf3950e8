// Conformance of feature maps to the FeatureMap concept (feature_map.hpp) and to spec §2: a
// typed suite that every map (the built-in ones, L2Normalize over two inner maps, and two
// user-defined ones) must pass, in float and double, plus exact per-map checks. Relu,
// Dpfp (ν = 1 and 3) and Taylor2 in the suite, against naive references of their formulas, and
// (in the double translation unit) through every kernel against the O(N²) references.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "causal_reference.hpp"
#include "delta_reference.hpp"
#include "gated_reference.hpp"
#include "gradient_util.hpp"
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
// Relu is elementwise with non-negative features, Dpfp has non-negative features
// (products of ReLUs) but pairs entries, Taylor2 has features of both signs (its similarity
// 1 + s + s²/2 is positive, but the flag promises every feature). All three have a backward.
static_assert(linattn::is_feature_map_v<linattn::Relu, float>);
static_assert(linattn::is_feature_map_v<linattn::Dpfp, double>);
static_assert(linattn::is_feature_map_v<linattn::Taylor2, float>);
static_assert(linattn::has_backward_v<linattn::Relu, double>);
static_assert(linattn::has_backward_v<linattn::Dpfp, float>);
static_assert(linattn::has_backward_v<linattn::Taylor2, double>);
static_assert(linattn::detail::declares_elementwise<linattn::Relu>::value);
static_assert(!linattn::detail::declares_elementwise<linattn::Dpfp>::value);
static_assert(!linattn::detail::declares_elementwise<linattn::Taylor2>::value);
static_assert(!linattn::detail::may_cancel_v<linattn::Relu>);
static_assert(!linattn::detail::may_cancel_v<linattn::Dpfp>);
static_assert(linattn::detail::may_cancel_v<linattn::Taylor2>);
static_assert(!std::is_convertible_v<int, linattn::Dpfp>);  // explicit Dpfp(int nu)
// FAVOR+: strictly positive features (exp), not elementwise, a backward, and the
// side-aware overloads of the concept's extension (which no other built-in map has).
static_assert(linattn::is_feature_map_v<linattn::Favor<float>, float>);
static_assert(linattn::is_feature_map_v<linattn::Favor<double>, double>);
static_assert(linattn::has_backward_v<linattn::Favor<float>, float>);
static_assert(linattn::has_sided_map_v<linattn::Favor<float>, float>);
static_assert(linattn::has_sided_map_v<linattn::Favor<double>, double>);
static_assert(linattn::detail::has_side_backward<linattn::Favor<float>, float,
                                                 linattn::KeySide>::value);
static_assert(linattn::detail::has_side_backward<linattn::Favor<double>, double,
                                                 linattn::QuerySide>::value);
static_assert(!linattn::detail::declares_elementwise<linattn::Favor<float>>::value);
static_assert(!linattn::detail::may_cancel_v<linattn::Favor<float>>);
static_assert(!linattn::has_sided_map_v<linattn::EluPlusOne, float>);
static_assert(!linattn::has_sided_map_v<linattn::Taylor2, double>);
static_assert(!linattn::has_sided_map_v<linattn::L2Normalize<linattn::Silu>, float>);

// The typed suite in this file's scalar type, unless the build leaves that type out.
#if defined(LINATTN_TEST_DOUBLE_CASES) ? defined(LINATTN_TEST_DOUBLE) \
                                       : defined(LINATTN_TEST_FLOAT)
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
  static constexpr const char* name = "UserRelu";  // "Relu" is linattn::Relu
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

// Relu and Dpfp can have all-zero features (a query with no positive entry; for Dpfp
// also D = 1 with ν = 1, whose every feature is r_0·r_1 = 0), hence zero rows: not strictly
// positive. Taylor2's features have both signs, but its similarity 1 + s + s²/2 is >= 1/2: it
// is in the NonNegative class (every denominator >= L/2).
template <>
struct MapInfo<linattn::Relu> {
  static constexpr const char* name = "Relu";
  static linattn::Relu make(Index) { return {}; }
  static Index expected_F(Index D) { return D; }
  static constexpr bool strictly_positive = false;
  static constexpr bool has_backward = true;
  static constexpr Similarity similarity = Similarity::NonNegative;
};
template <>
struct MapInfo<linattn::Dpfp> {
  static constexpr const char* name = "Dpfp1";
  static linattn::Dpfp make(Index) { return linattn::Dpfp(1); }
  static Index expected_F(Index D) { return 2 * D; }
  static constexpr bool strictly_positive = false;
  static constexpr bool has_backward = true;
  static constexpr Similarity similarity = Similarity::NonNegative;
};
// Dpfp with ν = 3: the same type (so no kernel is instantiated twice), another MapInfo.
struct DpfpNu3Info : MapInfo<linattn::Dpfp> {
  static constexpr const char* name = "Dpfp3";
  static linattn::Dpfp make(Index) { return linattn::Dpfp(3); }
  static Index expected_F(Index D) { return 6 * D; }
};
template <>
struct MapInfo<linattn::Taylor2> {
  static constexpr const char* name = "Taylor2";
  static linattn::Taylor2 make(Index) { return {}; }
  static Index expected_F(Index D) { return 1 + D + D * D; }
  static constexpr bool strictly_positive = false;
  static constexpr bool has_backward = true;
  static constexpr Similarity similarity = Similarity::NonNegative;
};

// FAVOR+ with m = 2D + 3 features (F ≠ D; the last orthogonal block truncated), one seed per
// D. Strictly positive: every feature is an exponential (e^-59 at worst for these inputs).
template <class S>
struct MapInfo<linattn::Favor<S>> {
  static constexpr const char* name = "Favor";
  static linattn::Favor<S> make(Index D) { return linattn::Favor<S>(D, 2 * D + 3, 2600 + D); }
  static Index expected_F(Index D) { return 2 * D + 3; }
  static constexpr bool strictly_positive = true;
  static constexpr bool has_backward = true;
  static constexpr Similarity similarity = Similarity::NonNegative;
};

template <class MapT, class ScalarT, class InfoT = MapInfo<MapT>>
struct MapCase {
  using Map = MapT;
  using Scalar = ScalarT;
  using Info = InfoT;
};

// The suite is compiled twice from this file (see tests/CMakeLists.txt), once per scalar type,
// so that neither translation unit takes long to compile: test_feature_maps runs the float
// cases and the per-map tests below, test_feature_maps_double (LINATTN_TEST_DOUBLE_CASES) the
// double cases and the new maps through every kernel. A build may leave either scalar type out
// of the suite (LINATTN_TEST_SCALARS, test_util.hpp: .ci/test builds each type in one of
// its stages only).
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
                                  MapCase<linattn::L2Normalize<linattn::Silu>, CaseScalar>,
                                  // (Dpfp with ν = 1 and ν = 3: one type, two cases).
                                  MapCase<linattn::Relu, CaseScalar>,
                                  MapCase<linattn::Dpfp, CaseScalar>,
                                  MapCase<linattn::Dpfp, CaseScalar, DpfpNu3Info>,
                                  MapCase<linattn::Taylor2, CaseScalar>,
                                  MapCase<linattn::Favor<CaseScalar>, CaseScalar>>;

struct MapCaseNames {
  template <class C>
  static std::string GetName(int) {
    return std::string(C::Info::name) + "_" + test::scalar_name<typename C::Scalar>();
  }
};

template <class C>
class FeatureMapConformance : public ::testing::Test {
 protected:
  using Map = typename C::Map;
  using S = typename C::Scalar;
  using Info = typename C::Info;

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
      // Rows whose denominator is (near) 0 are degenerate: Relu (and Dpfp) have φ(q) = 0 when
      // q ≤ 0 (Dpfp with D = 1 and ν = 1 always), and
      // NormalizedCosine has sim = 0 for every key exactly opposite to q (with D = 1: every key
      // of the other sign). NormalizedCosine's features can be negative, so φ(q)ᵀz cancels and
      // carries a rounding error of about ε·L: its rows are compared when den ≥ 5% of L.
      const double min_den =
          std::is_same_v<typename TestFixture::Map, linattn::NormalizedCosine> ? 0.05 * double(sh.L)
                                                                              : 1e-3;
      const auto rc =
          test::compare_well_conditioned_rows(out, expected, den, min_den, test::max_abs(V));
      EXPECT_LE(rc.max_err, test::tolerance<S>(test::max_abs(V))) << sh;
      // Taylor2: sim >= 1/2 for every pair, so every denominator is >= L/2.
      if (Info::strictly_positive || std::is_same_v<typename TestFixture::Map, linattn::Taylor2>) {
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
#endif  // the typed suite

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
  IF_FLOAT(check_softmax_rows<float>(1.0f, 1e-6));
  IF_DOUBLE(check_softmax_rows<double>(1.0, 1e-14));
  IF_FLOAT(check_softmax_rows<float>(30.0f, 1e-5));
}

TEST(SoftmaxSplit, LargeInputsAreStable) {
  IF_FLOAT(check_softmax_rows<float>(1000.0f, 1e-4));
  IF_DOUBLE(check_softmax_rows<double>(1000.0, 1e-12));
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

// ---------------------------------------------------------------------------------------------
// Relu, Dpfp and Taylor2 against naive references written straight from their
// formulas (docs/SPEC.md §7), loop by loop in double, every index 0-based.
// ---------------------------------------------------------------------------------------------

// φ(x)_d = max(x_d, 0).
MatD naive_relu(const MatD& x) {
  MatD phi(x.rows(), x.cols());
  for (Index r = 0; r < x.rows(); ++r)
    for (Index d = 0; d < x.cols(); ++d) phi(r, d) = x(r, d) > 0 ? x(r, d) : 0.0;
  return phi;
}

// r = [max(x, 0), max(−x, 0)] (2D entries), φ_{i + (j−1)·2D} = r_i · r_{(i+j) mod 2D},
// i = 0 … 2D−1, j = 1 … ν.
MatD naive_dpfp(const MatD& x, int nu) {
  const Index D = x.cols(), R = 2 * D;
  MatD phi(x.rows(), R * nu);
  std::vector<double> r(static_cast<std::size_t>(R));
  for (Index row = 0; row < x.rows(); ++row) {
    for (Index i = 0; i < D; ++i) {
      r[std::size_t(i)] = std::max(x(row, i), 0.0);
      r[std::size_t(D + i)] = std::max(-x(row, i), 0.0);
    }
    for (int j = 1; j <= nu; ++j)
      for (Index i = 0; i < R; ++i)
        phi(row, i + (j - 1) * R) = r[std::size_t(i)] * r[std::size_t((i + j) % R)];
  }
  return phi;
}

// φ_0 = 1, φ_{1+a} = x_a / D^{1/4}, φ_{1+D+a·D+b} = x_a x_b / (√2·√D), a, b = 0 … D−1.
MatD naive_taylor2(const MatD& x) {
  const Index D = x.cols();
  MatD phi(x.rows(), 1 + D + D * D);
  for (Index row = 0; row < x.rows(); ++row) {
    phi(row, 0) = 1;
    for (Index a = 0; a < D; ++a) phi(row, 1 + a) = x(row, a) / std::pow(double(D), 0.25);
    for (Index a = 0; a < D; ++a)
      for (Index b = 0; b < D; ++b)
        phi(row, 1 + D + a * D + b) =
            x(row, a) * x(row, b) / (std::sqrt(2.0) * std::sqrt(double(D)));
  }
  return phi;
}

// max |φ − naive| / max(1, max |naive|) over D ∈ {1, 2, 5, 16, 33} (odd and even, below and
// above a packet) and 300 rows (more than a 256-row block), inputs in [−3, 3] and a zero row.
template <class S, class Map, class Naive>
double map_vs_naive(const Map& phi, const Naive& naive) {
  double worst = 0;
  for (const Index D : {1, 2, 5, 16, 33}) {
    Mat<S> x = test::random_matrix<S>(300, D, test::seed_of({D, 261}), -3, 3);
    x.row(7).setZero();
    Mat<S> got(x.rows(), phi.feature_dim(D));
    phi.map(x, got);
    const MatD expected = naive(x.template cast<double>());
    worst =
        std::max(worst, test::max_abs_diff(got, expected) / std::max(1.0, test::max_abs(expected)));
  }
  return worst;
}

TEST(ReluDpfpTaylor2, MatchNaiveReferencesOfTheirFormulas) {
  // Relu is exact; a Dpfp feature is one rounded product (≤ ε/2 relative: measured 5.4e-8 in
  // float, 0 in double, where the products of the float inputs are exact), a Taylor2 feature
  // x'_a/√2 · x'_b three roundings plus those of the constants and of the naive formula's
  // (measured 1.9e-7 in float, 5.9e-16 in double).
  const auto relu = [](const MatD& x) { return naive_relu(x); };
  const auto taylor = [](const MatD& x) { return naive_taylor2(x); };
  const double e_relu_f = map_vs_naive<float>(linattn::Relu{}, relu);
  const double e_relu_d = map_vs_naive<double>(linattn::Relu{}, relu);
  const double e_t2_f = map_vs_naive<float>(linattn::Taylor2{}, taylor);
  const double e_t2_d = map_vs_naive<double>(linattn::Taylor2{}, taylor);
  test::report_error("Relu/vs_naive/float", e_relu_f);
  test::report_error("Relu/vs_naive/double", e_relu_d);
  test::report_error("Taylor2/vs_naive/float", e_t2_f);
  test::report_error("Taylor2/vs_naive/double", e_t2_d);
  EXPECT_EQ(e_relu_f, 0.0);
  EXPECT_EQ(e_relu_d, 0.0);
  EXPECT_LE(e_t2_f, 8 * std::numeric_limits<float>::epsilon());
  EXPECT_LE(e_t2_d, 8 * std::numeric_limits<double>::epsilon());
  for (const int nu : {1, 2, 3, 4, 7}) {  // ν = 4, 7 >= 2D for D = 1, 2: the offsets wrap
    const auto dpfp = [nu](const MatD& x) { return naive_dpfp(x, nu); };
    const double e_f = map_vs_naive<float>(linattn::Dpfp(nu), dpfp);
    const double e_d = map_vs_naive<double>(linattn::Dpfp(nu), dpfp);
    test::report_error("Dpfp" + std::to_string(nu) + "/vs_naive/float", e_f);
    test::report_error("Dpfp" + std::to_string(nu) + "/vs_naive/double", e_d);
    EXPECT_LE(e_f, std::numeric_limits<float>::epsilon()) << nu;
    EXPECT_LE(e_d, std::numeric_limits<double>::epsilon()) << nu;
  }
}

TEST(ReluDpfpTaylor2, DpfpParameterAndFeatureDim) {
  EXPECT_EQ(linattn::Dpfp{}.nu(), 1);
  EXPECT_EQ(linattn::Dpfp(3).nu(), 3);
  EXPECT_EQ(linattn::Dpfp{}.feature_dim(64), 128);
  EXPECT_EQ(linattn::Dpfp(3).feature_dim(7), 42);
  EXPECT_EQ(linattn::Taylor2{}.feature_dim(16), 1 + 16 + 256);
  EXPECT_EQ(linattn::Relu{}.feature_dim(9), 9);
  for (const int nu : {0, -2}) {
    test::expect_invalid(
        [nu] {
          linattn::Dpfp bad(nu);
          (void)bad;
        },
        {"Dpfp", "nu = " + std::to_string(nu)}, "Dpfp(" + std::to_string(nu) + ")");
  }
}

TEST(ReluDpfpTaylor2, ReluExactValuesAndSubgradient) {
  const float inf = std::numeric_limits<float>::infinity(),
              nan = std::numeric_limits<float>::quiet_NaN();
  Mat<float> x(1, 7), phi(1, 7), g = Mat<float>::Constant(1, 7, 2.5f), grad(1, 7);
  x << 1.5f, -2.0f, 0.0f, -0.0f, inf, -inf, nan;
  linattn::Relu{}.map(x, phi);
  EXPECT_EQ(phi(0, 0), 1.5f);
  EXPECT_EQ(phi(0, 1), 0.0f);
  EXPECT_FALSE(std::signbit(phi(0, 3))) << "max(-0, 0) is +0";
  EXPECT_EQ(phi(0, 4), inf);
  EXPECT_EQ(phi(0, 5), 0.0f);
  EXPECT_TRUE(std::isnan(phi(0, 6)));
  // ∇ = g where x > 0, 0 where x <= 0 (the subgradient 0 at the kink), NaN for NaN.
  linattn::Relu{}.backward(x, g, grad);
  EXPECT_EQ(grad(0, 0), 2.5f);
  EXPECT_EQ(grad(0, 1), 0.0f);
  EXPECT_EQ(grad(0, 2), 0.0f);
  EXPECT_EQ(grad(0, 3), 0.0f);
  EXPECT_EQ(grad(0, 4), 2.5f);
  EXPECT_EQ(grad(0, 5), 0.0f);
  EXPECT_TRUE(std::isnan(grad(0, 6)));
  // Dpfp's gradient at x = 0 is 0 too (both of its ReLUs have derivative 0 there).
  Mat<double> z = Mat<double>::Zero(2, 3), gd = Mat<double>::Ones(2, 6), gz(2, 3);
  z(1, 0) = 0.5;
  linattn::Dpfp{}.backward(z, gd, gz);
  EXPECT_EQ(gz(0, 0), 0.0);
  EXPECT_EQ(gz(1, 1), 0.0);
  EXPECT_EQ(gz(1, 2), 0.0);
}

TEST(ReluDpfpTaylor2, ZeroDenominatorsGiveZeroRows) {
  // Spec §2, Denominators: a row whose denominator is below the smallest normal number is 0.
  // Relu: the query's positive entries meet no key's (features orthogonal), or the query has
  // none. Dpfp with D = 1, ν = 1: every feature is max(x, 0)·max(−x, 0) = 0.
  Mat<float> K = test::random_matrix<float>(20, 4, 262, -1, 1),
             V = test::random_matrix<float>(20, 3, 263);
  K.col(0).setConstant(-0.5f);  // no key has a positive first entry
  Mat<float> Q = test::random_matrix<float>(3, 4, 264, 0.1, 1);
  Q.row(0) << 0.7f, -1.0f, -1.0f, -1.0f;  // positive only where no key is
  Q.row(1).setConstant(-0.25f);           // φ(q) = 0
  const Mat<float> out = linattn::linear_attention(Q, K, V, linattn::Relu{});
  EXPECT_EQ(test::max_abs(out.topRows(2)), 0.0);
  EXPECT_GT(test::max_abs(out.row(2)), 0.0);
  const Mat<float> q1 = test::random_matrix<float>(9, 1, 265),
                   k1 = test::random_matrix<float>(9, 1, 266);
  EXPECT_EQ(test::max_abs(linattn::linear_attention(q1, k1, V.topRows(9), linattn::Dpfp(1))), 0.0);
}

TEST(ReluDpfpTaylor2, Taylor2SimilarityIsTheSecondOrderTaylorPolynomial) {
  // φ(q)·φ(k) = 1 + s + s²/2, s = q·k/√D, to rounding relative to the magnitude of its terms
  // 1 + s' + s'²/2 (s' = Σ|q_a k_a|/√D), for D up to 64 (F = 4161): measured 5.8e-7 (float)
  // and 1.2e-15 (double).
  double worst_f = 0, worst_d = 0;
  for (const Index D : {1, 4, 16, 64}) {
    const MatD q = test::random_matrix<double>(40, D, test::seed_of({D, 267}), -2, 2);
    const MatD k = test::random_matrix<double>(50, D, test::seed_of({D, 268}), -2, 2);
    const auto check = [&](auto tag, double& worst) {
      using S = decltype(tag);
      const Mat<S> qs = q.cast<S>(), ks = k.cast<S>();
      Mat<S> pq(qs.rows(), 1 + D + D * D), pk(ks.rows(), 1 + D + D * D);
      linattn::Taylor2{}.map(qs, pq);
      linattn::Taylor2{}.map(ks, pk);
      const Mat<S> sim = pq * pk.transpose();
      for (Index i = 0; i < qs.rows(); ++i)
        for (Index j = 0; j < ks.rows(); ++j) {
          long double s = 0, sa = 0;
          for (Index a = 0; a < D; ++a) {
            s += static_cast<long double>(qs(i, a)) * ks(j, a);
            sa += std::fabs(static_cast<long double>(qs(i, a)) * ks(j, a));
          }
          s /= std::sqrt(static_cast<long double>(D));
          sa /= std::sqrt(static_cast<long double>(D));
          const long double exact = 1 + s + s * s / 2, scale = 1 + sa + sa * sa / 2;
          worst = std::max(worst, double(std::fabs(sim(i, j) - exact) / scale));
          EXPECT_GE(double(sim(i, j)), 0.5 - double(scale) * 1e-5);
        }
    };
    check(float(), worst_f);
    check(double(), worst_d);
  }
  test::report_error("Taylor2/similarity_vs_1+s+s^2/2/float", worst_f);
  test::report_error("Taylor2/similarity_vs_1+s+s^2/2/double", worst_d);
  EXPECT_LE(worst_f, 2.5e-6);
  EXPECT_LE(worst_d, 5e-15);
}

TEST(ReluDpfpTaylor2, Taylor2DenominatorNeverCancelsToZero) {
  // Every key at s = q·k/√D = −1, the minimum of 1 + s + s²/2 = 1/2: the weights are all equal
  // and the output is the mean of the value rows, not a guarded zero row.
  const Index D = 8, L = 30;
  Mat<float> q = test::random_matrix<float>(1, D, 269, -1, 1);
  Mat<float> K(L, D);
  for (Index j = 0; j < L; ++j) K.row(j) = -std::sqrt(float(D)) / q.squaredNorm() * q;  // q·k = −√D
  const Mat<float> V = test::random_matrix<float>(L, 3, 270, -3, 3);
  const Mat<float> out = linattn::linear_attention(q, K, V, linattn::Taylor2{});
  const Mat<float> mean = V.colwise().mean();
  const double err = test::max_abs_diff(out, mean);
  test::report_error("Taylor2/all_keys_at_s=-1_vs_mean_of_V/float", err);
  EXPECT_LE(err, 2.5e-7) << out << "\nmean " << mean;  // measured 6.0e-8 (|V| <= 3)
}

// ---------------------------------------------------------------------------------------------
// FAVOR+ (linattn::Favor) against naive references of its formulas (docs/SPEC.md §7),
// its orthogonal draw, the unbiasedness of its estimate, and its stabilised sides.
// ---------------------------------------------------------------------------------------------

// Naive features of the rows of x for the projection W (m x D), in double, loop by loop:
// x' = x / D^{1/4}, e_j = w_j·x' − |x'|²/2, c_j = |w_j|²/2, and
//   plain φ_j = exp(e_j)/√m,  key side exp(e_j − c_j)/√m,  query side exp(ê_j − max ê)/√m with
//   ê_j = e_j + c_j.
enum class NaiveSide { Plain, Key, Query };
MatD naive_favor(const MatD& x, const MatD& W, NaiveSide side) {
  const Index D = x.cols(), m = W.rows();
  const double s = 1.0 / std::pow(double(D), 0.25);
  MatD phi(x.rows(), m);
  std::vector<double> e(static_cast<std::size_t>(m));
  for (Index r = 0; r < x.rows(); ++r) {
    double sq = 0;
    for (Index d = 0; d < D; ++d) sq += (x(r, d) * s) * (x(r, d) * s);
    double mx = -std::numeric_limits<double>::infinity();
    for (Index j = 0; j < m; ++j) {
      double dot = 0, c = 0;
      for (Index d = 0; d < D; ++d) {
        dot += W(j, d) * x(r, d) * s;
        c += W(j, d) * W(j, d) / 2;
      }
      double ej = dot - sq / 2;
      if (side == NaiveSide::Key) ej -= c;
      if (side == NaiveSide::Query) ej += c;
      e[std::size_t(j)] = ej;
      mx = std::max(mx, ej);
    }
    for (Index j = 0; j < m; ++j)
      phi(r, j) = std::exp(e[std::size_t(j)] - (side == NaiveSide::Query ? mx : 0.0)) /
                  std::sqrt(double(m));
  }
  return phi;
}

template <class S, class Side>
Mat<S> favor_side(const linattn::Favor<S>& phi, const Mat<S>& x, Side side) {
  Mat<S> out(x.rows(), phi.num_features());
  phi.map(x, out, side);
  return out;
}

TEST(Favor, MatchesTheNaiveFormulaOnEverySide) {
  // D below and above a packet, m below, equal to and above D (last block truncated), 300 rows
  // (more than a 256-row block), inputs in [−2, 2] and a zero row. Errors relative to each
  // feature (they are positive): exp amplifies the exponent's rounding, |e| ≲ 10 here.
  double worst_f = 0, worst_d = 0;
  for (const Index D : {1, 5, 16, 33})
    for (const Index m : {Index(3), D, 2 * D + 5}) {
      const linattn::Favor<double> fd(D, m, test::seed_of({D, m, 2651}));
      const linattn::Favor<float> ff(D, m, test::seed_of({D, m, 2651}));
      Mat<double> x = test::random_matrix<double>(300, D, test::seed_of({D, 2652}), -2, 2);
      x.row(7).setZero();
      const Mat<float> xf = x.cast<float>();
      const MatD W = fd.projection();
      ASSERT_EQ(W.rows(), m);
      ASSERT_EQ(W.cols(), D);
      const auto rel = [](const auto& got, const MatD& want) {
        return (got.template cast<double>() - want).cwiseQuotient(want).cwiseAbs().maxCoeff();
      };
      const MatD Wf = ff.projection().cast<double>();
      const MatD xfd = xf.cast<double>();
      for (const NaiveSide side : {NaiveSide::Plain, NaiveSide::Key, NaiveSide::Query}) {
        Mat<double> got_d(300, m);
        Mat<float> got_f(300, m);
        if (side == NaiveSide::Plain) {
          fd.map(x, got_d);
          ff.map(xf, got_f);
        } else if (side == NaiveSide::Key) {
          got_d = favor_side(fd, x, linattn::KeySide{true});
          got_f = favor_side(ff, xf, linattn::KeySide{true});
        } else {
          got_d = favor_side(fd, x, linattn::QuerySide{true});
          got_f = favor_side(ff, xf, linattn::QuerySide{true});
        }
        worst_d = std::max(worst_d, rel(got_d, naive_favor(x, W, side)));
        worst_f = std::max(worst_f, rel(got_f, naive_favor(xfd, Wf, side)));
      }
    }
  test::report_error("Favor/vs_naive (relative per feature)/float", worst_f);
  test::report_error("Favor/vs_naive (relative per feature)/double", worst_d);
  // Measured 9.0e-6 (float) and 3.9e-14 (double): about |exponent|·ε, the exponents reaching
  // a few tens here.
  EXPECT_LE(worst_f, 3e-5);
  EXPECT_LE(worst_d, 1.5e-13);
}

TEST(Favor, BlocksOfTheProjectionAreOrthogonal) {
  // Rows within each block of D are orthogonal; their norms are independent chi(D) draws.
  for (const Index D : {1, 4, 16})
    for (const Index m : {D, 3 * D + 1}) {
      const linattn::Favor<double> phi(D, m, test::seed_of({D, m, 2653}));
      const MatD& W = phi.projection();
      double worst = 0;
      for (Index r0 = 0; r0 < m; r0 += D) {
        const Index n = std::min(D, m - r0);
        MatD U = W.middleRows(r0, n);
        for (Index i = 0; i < n; ++i) U.row(i) /= U.row(i).norm();
        worst = std::max(worst, test::max_abs_diff(U * U.transpose(), MatD::Identity(n, n)));
      }
      EXPECT_LE(worst, 1e-12) << "D=" << D << " m=" << m;
      if (D > 1 || m > 1) {
        const Eigen::VectorXd norms = W.rowwise().norm();
        EXPECT_GT(norms.maxCoeff() - norms.minCoeff(), 1e-3) << "row norms should differ";
      }
    }
}

TEST(Favor, DrawsAreDeterministicPerSeed) {
  const linattn::Favor<double> a(8, 20, 7), b(8, 20, 7), c(8, 20, 8);
  EXPECT_EQ(a.projection(), b.projection());
  EXPECT_GT(test::max_abs_diff(a.projection(), c.projection()), 0.1);
  // The draw is made in double: the float map holds the same W rounded once.
  const linattn::Favor<float> f(8, 20, 7);
  EXPECT_EQ(f.projection(), a.projection().cast<float>());
  // redraw(seed) is the constructor's draw.
  linattn::Favor<double> r(8, 20, 99);
  r.redraw(7);
  EXPECT_EQ(r.projection(), a.projection());
  r.redraw(8);
  EXPECT_EQ(r.projection(), c.projection());
  // set_projection: any m' >= 1 rows of the same D; the features follow it.
  const MatD W2 = test::random_matrix<double>(5, 8, 2654, -1, 1);
  r.set_projection(W2);
  EXPECT_EQ(r.projection(), W2);
  EXPECT_EQ(r.num_features(), 5);
  EXPECT_EQ(r.input_dim(), 8);
  EXPECT_EQ(r.feature_dim(8), 5);
  const MatD x = test::random_matrix<double>(3, 8, 2655);
  MatD phi(3, 5);
  r.map(x, phi);
  EXPECT_LE(test::max_abs_diff(phi, naive_favor(x, W2, NaiveSide::Plain)), 1e-14);
  r.set_projection(a.projection());
  MatD p1(3, 20), p2(3, 20);
  r.map(x, p1);
  a.map(x, p2);
  EXPECT_EQ(p1, p2);
}

TEST(Favor, BadArgumentsThrowWithTheShapes) {
  using N = std::vector<std::string>;  // the needles of each message
  test::expect_invalid([] { (void)linattn::Favor<float>(0, 4, 1); }, N{"Favor", "D is 0", "m is 4"},
                       "D = 0");
  test::expect_invalid([] { (void)linattn::Favor<double>(3, 0, 1); },
                       N{"Favor", "D is 3", "m is 0"}, "m = 0");
  test::expect_invalid([] { (void)linattn::Favor<float>(-2, -1, 1); }, N{"Favor", "-2", "-1"},
                       "negative");
  linattn::Favor<float> phi(4, 6, 1);
  test::expect_invalid([&] { (void)phi.feature_dim(5); },
                       N{"Favor::feature_dim", "D = 5", "6x4", "D = 4"}, "feature_dim");
  test::expect_invalid([&] { phi.set_projection(Mat<float>::Ones(6, 3)); },
                       N{"Favor::set_projection", "6x3", "6x4"}, "set_projection D");
  test::expect_invalid([&] { phi.set_projection(Mat<float>(0, 4)); },
                       N{"Favor::set_projection", "0x4"}, "set_projection m = 0");
  EXPECT_EQ(phi.num_features(), 6);  // unchanged by the rejected calls
  // Every kernel asks the map for F at entry: the map's D mismatch surfaces there.
  const Mat<float> Q = Mat<float>::Ones(3, 5), V = Mat<float>::Ones(3, 2);
  test::expect_invalid([&] { (void)linattn::linear_attention(Q, Q, V, phi); },
                       N{"Favor::feature_dim", "D = 5"}, "linear_attention");
  test::expect_invalid([&] { (void)linattn::causal_linear_attention(Q, Q, V, phi); },
                       N{"Favor::feature_dim", "D = 5"}, "causal_linear_attention");
  test::expect_invalid(
      [&] { linattn::RecurrentLinearAttention<linattn::Favor<float>, float> r(5, 2, phi); },
      N{"Favor::feature_dim", "D = 5"}, "RecurrentLinearAttention");
}

TEST(Favor, EstimatesTheSoftmaxKernelWithoutBias) {
  // E[φ(q)·φ(k)] = exp(q·k/√D) over the draw of W. S = 2000 seeds, D = m = 16 (one orthogonal
  // block); the sample mean must lie within 5 standard errors (from the sample variance).
  const Index D = 16, m = 16, S = 2000;
  const MatD q = test::random_matrix<double>(1, D, 2656, -0.6, 0.6);
  const MatD k = test::random_matrix<double>(1, D, 2657, -0.6, 0.6) + 0.3 * q;
  const double expected = std::exp(q.row(0).dot(k.row(0)) / std::sqrt(double(D)));
  double sum = 0, sum_sq = 0;
  MatD pq(1, m), pk(1, m);
  for (Index s = 0; s < S; ++s) {
    const linattn::Favor<double> phi(D, m, std::uint64_t(1000 + s));
    phi.map(q, pq);
    phi.map(k, pk);
    const double est = pq.row(0).dot(pk.row(0));
    sum += est;
    sum_sq += est * est;
  }
  const double mean = sum / double(S);
  const double sd = std::sqrt((sum_sq - double(S) * mean * mean) / double(S - 1));
  const double se = sd / std::sqrt(double(S));
  std::cout << "[ info     ] Favor estimate " << mean << " ± " << se << " (sd " << sd
            << "), exp(q·k/√D) = " << expected << "\n";
  EXPECT_LE(std::abs(mean - expected), 5 * se);
  EXPECT_GT(sd, 0.0);
}

TEST(Favor, StabilisedSidesScaleTheSimilarityByAQueryFactorOnly) {
  // φ̂_Q(q)·φ̂_K(k) = c(q)·φ(q)·φ(k): the ratio is the same for every key of a query (double,
  // to 1e-12 relative). Unnormalised sides are the plain features, bit for bit.
  const Index D = 7, m = 23;
  const linattn::Favor<double> phi(D, m, 2658);
  const MatD Q = test::random_matrix<double>(20, D, 2659, -2, 2);
  const MatD K = test::random_matrix<double>(50, D, 2660, -2, 2);
  MatD pq(20, m), pk(50, m);
  phi.map(Q, pq);
  phi.map(K, pk);
  const MatD plain = pq * pk.transpose();
  const MatD sided = favor_side(phi, Q, linattn::QuerySide{true}) *
                     favor_side(phi, K, linattn::KeySide{true}).transpose();
  double worst = 0;
  for (Index i = 0; i < Q.rows(); ++i) {
    const double c0 = sided(i, 0) / plain(i, 0);
    EXPECT_GT(c0, 0.0);
    for (Index j = 0; j < K.rows(); ++j)
      worst = std::max(worst, std::abs(sided(i, j) / plain(i, j) / c0 - 1));
  }
  test::report_error("Favor/sided_over_plain_ratio_spread/double", worst);
  EXPECT_LE(worst, 1e-14);  // measured 1.8e-15
  EXPECT_EQ(favor_side(phi, Q, linattn::QuerySide{false}), pq);
  EXPECT_EQ(favor_side(phi, K, linattn::KeySide{false}), pk);
  const linattn::Favor<float> phif(D, m, 2658);
  const Mat<float> Qf = Q.cast<float>();
  Mat<float> pqf(20, m);
  phif.map(Qf, pqf);
  EXPECT_EQ(favor_side(phif, Qf, linattn::QuerySide{false}), pqf);
  EXPECT_EQ(favor_side(phif, Qf, linattn::KeySide{false}), pqf);
  // The stabilised features are at most 1/√m (the largest query feature exactly that).
  const MatD sq = favor_side(phi, Q, linattn::QuerySide{true});
  EXPECT_LE(sq.maxCoeff(), 1 / std::sqrt(double(m)) * (1 + 1e-15));
  EXPECT_LE(favor_side(phi, K, linattn::KeySide{true}).maxCoeff(), 1 / std::sqrt(double(m)));
}

TEST(Favor, SidedBackwardMatchesFiniteDifferences) {
  // The key side's shift is a constant: its backward is the gradient of x ↦ Σ G ∘ φ̂_K(x). The
  // query side's row shift is treated as a constant, exact when G·φ̂_Q(x) = 0 row by row (what a
  // normalised kernel's gradient satisfies): G is projected so here.
  const Index D = 5, m = 11, n = 4;
  const linattn::Favor<double> phi(D, m, 2661);
  const MatD x = test::random_matrix<double>(n, D, 2662, -1.5, 1.5);
  const MatD G0 = test::random_matrix<double>(n, m, 2663);
  const MatD pq = favor_side(phi, x, linattn::QuerySide{true});
  MatD Gq = G0;
  for (Index i = 0; i < n; ++i)
    Gq.row(i) -= (G0.row(i).dot(pq.row(i)) / pq.row(i).squaredNorm()) * pq.row(i);
  const auto check = [&](auto side, const MatD& G, const char* what) {
    MatD grad(n, D);
    phi.backward(x, G, grad, side);
    MatD fd(n, D);
    const double h = 1e-6;
    for (Index r = 0; r < n; ++r)
      for (Index c = 0; c < D; ++c) {
        MatD xp = x, xm = x;
        xp(r, c) += h;
        xm(r, c) -= h;
        fd(r, c) = (G.cwiseProduct(favor_side(phi, xp, side)).sum() -
                    G.cwiseProduct(favor_side(phi, xm, side)).sum()) /
                   (2 * h);
      }
    EXPECT_LE(test::max_abs_diff(grad, fd), 1e-8 * std::max(1.0, test::max_abs(fd)))
        << what << "\nbackward:\n"
        << grad << "\nfinite differences:\n"
        << fd;
    // float against double
    const linattn::Favor<float> phif(D, m, 2661);
    Mat<float> gf(n, D);
    phif.backward(x.cast<float>().eval(), G.cast<float>().eval(), gf, side);
    EXPECT_LE(test::max_abs_diff(gf, grad), 1e-5 * std::max(1.0, test::max_abs(grad))) << what;
  };
  check(linattn::KeySide{true}, G0, "key side");
  check(linattn::QuerySide{true}, Gq, "query side (G·φ̂ = 0)");
  check(linattn::KeySide{false}, G0, "key side, unnormalised");
  check(linattn::QuerySide{false}, G0, "query side, unnormalised");
}

TEST(Favor, InputsOfMagnitude100StayFiniteThroughTheCausalKernel) {
  // Entries ±100, D = 16: |x'| = 200 and the plain features' exponents w·x' − |x'|²/2 range
  // over about ±800 − 20000, so the unshifted formula would give exp(w·x') = inf for aligned
  // features times exp(−|x'|²/2) = 0, and NaN outputs. The query side's shift keeps every
  // query feature ≤ 1/√m with the largest exactly 1/√m; the key side's exponents
  // −|k' − w_j|²/2 are ≤ 0, so nothing overflows. (Here every key's features underflow to 0,
  // as exp(q·k/√D) of these inputs does relative to one attended key's, and the guard of
  // spec §2 gives zero rows: finite, never NaN.)
  const Index N = 70, D = 16, M = 3, m = 40;
  const auto run = [&](auto tag) {
    using S = decltype(tag);
    const linattn::Favor<S> phi(D, m, 2664);
    Mat<S> Q = test::random_matrix<S>(N, D, 2665, -100, 100);
    Mat<S> K = test::random_matrix<S>(N, D, 2666, -100, 100);
    Q.row(0).setConstant(S(100));
    K.row(1).setConstant(S(-100));
    const Mat<S> V = test::random_matrix<S>(N, M, 2667);
    for (const auto a : {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent}) {
      linattn::CausalOptions o;
      o.algorithm = a;
      const Mat<S> out = linattn::causal_linear_attention(Q, K, V, phi, o);
      EXPECT_TRUE(test::all_finite(out)) << test::scalar_name<S>();
    }
    const Mat<S> pq = favor_side(phi, Q, linattn::QuerySide{true});
    EXPECT_TRUE(test::all_finite(pq));
    EXPECT_EQ(pq.rowwise().maxCoeff().minCoeff(), S(1.0 / std::sqrt(double(m))));
  };
  run(float{});
  run(double{});
}

#endif  // LINATTN_TEST_DOUBLE_CASES

#if defined(LINATTN_TEST_DOUBLE_CASES) && defined(LINATTN_TEST_DOUBLE)
// ---------------------------------------------------------------------------------------------
// Relu, Dpfp (ν = 1, 3) and Taylor2 through every kernel family, in double only (one
// instantiation per map and kernel), against the naive O(N²) references: causal chunked (chunk
// sizes 16 and the default) and recurrent, the decode step, masks, multi-head, the gradients
// and the gated kernel (normalised and not). N = 37, 130 and 300 are multiples of no block
// size; D ≠ M and odd D. Inputs uniform in [−1, 1]: with D = 3 a query has no positive entry
// with probability 1/8, so Relu and Dpfp zero rows (guarded denominators of 0) occur and must
// match the reference's zero rows. Compiled only in builds of the double checks (.ci/test's
// portable stage): on its own, under clang ASan+UBSan, this section took 132 s of compile CPU.
// ---------------------------------------------------------------------------------------------

struct KernelShape {
  Index N, D, M;
};
const KernelShape kKernelShapes[] = {{1, 3, 2}, {37, 5, 3}, {130, 3, 4}, {130, 7, 2}, {300, 16, 5}};

// Calls f(map, name) for every new map; each map type is instantiated once.
template <class F>
void for_new_maps(F&& f) {
  f(linattn::Relu{}, "Relu");
  f(linattn::Dpfp(1), "Dpfp1");
  f(linattn::Dpfp(3), "Dpfp3");
  f(linattn::Taylor2{}, "Taylor2");
}

// Outputs of the normalised kernels are convex combinations of value rows for these maps (all
// similarities >= 0): errors are absolute, relative to max |V| = 1.
double err_of(const MatD& out, const MatD& expected) {
  return test::all_finite(out) ? test::max_abs_diff(out, expected)
                               : std::numeric_limits<double>::infinity();
}

linattn::CausalOptions causal_options(linattn::CausalAlgorithm a, Index chunk) {
  linattn::CausalOptions o;
  o.algorithm = a;
  o.chunk_size = chunk;
  return o;
}

TEST(ReluDpfpTaylor2Kernels, CausalChunkedRecurrentAndDecodeMatchTheReference) {
  double worst = 0;
  Index zero_rows = 0;
  for_new_maps([&](const auto& phi, const char* name) {
    using Map = std::decay_t<decltype(phi)>;
    double w = 0;
    for (const KernelShape& sh : kKernelShapes) {
      const MatD Q = test::random_matrix<double>(sh.N, sh.D, test::seed_of({sh.N, sh.D, 2601}));
      const MatD K = test::random_matrix<double>(sh.N, sh.D, test::seed_of({sh.N, sh.D, 2602}));
      const MatD V = test::random_matrix<double>(sh.N, sh.M, test::seed_of({sh.N, sh.M, 2603}));
      const MatD expected = ref::causal_linear_attention(Q, K, V, phi);
      for (Index i = 0; i < sh.N; ++i) zero_rows += expected.row(i).isZero(0) ? 1 : 0;
      for (const auto& o : {causal_options(linattn::CausalAlgorithm::Chunked, 16),
                            causal_options(linattn::CausalAlgorithm::Chunked, 0),
                            causal_options(linattn::CausalAlgorithm::Recurrent, 0)})
        w = std::max(w, err_of(linattn::causal_linear_attention(Q, K, V, phi, o), expected));
      // The decode step, token by token.
      linattn::RecurrentLinearAttention<Map, double> rec(sh.D, sh.M, phi);
      MatD steps(sh.N, sh.M);
      for (Index t = 0; t < sh.N; ++t)
        steps.row(t) = rec.step(Q.row(t), K.row(t), V.row(t)).transpose();
      w = std::max(w, err_of(steps, expected));
    }
    test::report_error(std::string(name) + "/causal_kernels_vs_naive/double", w);
    worst = std::max(worst, w);
  });
  std::cout << "[ info     ] " << zero_rows << " reference rows are 0 (guarded denominators)\n";
  EXPECT_GT(zero_rows, 0) << "the guard is not exercised";
  // Measured 2.2e-16 (Relu), 3.3e-16 (Dpfp), 2.1e-15 (Taylor2, whose features cancel).
  EXPECT_LE(worst, 8e-15);
}

TEST(ReluDpfpTaylor2Kernels, MaskedKernelsMatchTheReference) {
  // Keys 0 … 5 masked: the first queries see no key (zero rows) in the causal form.
  double worst = 0;
  for_new_maps([&](const auto& phi, const char* name) {
    double w = 0;
    for (const KernelShape& sh : kKernelShapes) {
      const Index L = sh.N + 11;  // non-causal: N ≠ L
      const MatD Q = test::random_matrix<double>(sh.N, sh.D, test::seed_of({sh.N, sh.D, 2611}));
      const MatD K = test::random_matrix<double>(L, sh.D, test::seed_of({L, sh.D, 2612}));
      const MatD V = test::random_matrix<double>(L, sh.M, test::seed_of({L, sh.M, 2613}));
      cref::BoolVec keep = cref::random_mask(L, test::seed_of({L, 2614}), 0.7);
      keep.head(6).setConstant(false);
      const MatD expected =
          ref::generic_linear_attention(Q, cref::kept_rows(K, keep), cref::kept_rows(V, keep), phi);
      w = std::max(w, err_of(linattn::masked_linear_attention(Q, K, V, keep, phi), expected));
      const MatD Kc = K.topRows(sh.N), Vc = V.topRows(sh.N);
      const cref::BoolVec keep_c = keep.head(sh.N);
      const MatD cexpected = cref::masked_causal(Q, Kc, Vc, keep_c, phi);
      for (const auto a : {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent})
        w = std::max(w, err_of(linattn::masked_causal_linear_attention(Q, Kc, Vc, keep_c, phi,
                                                                       causal_options(a, 16)),
                               cexpected));
    }
    test::report_error(std::string(name) + "/masked_kernels_vs_naive/double", w);
    worst = std::max(worst, w);
  });
  EXPECT_LE(worst, 7e-15);  // measured 4.4e-16 (Dpfp1), 1.8e-15 (Taylor2)
}

TEST(ReluDpfpTaylor2Kernels, MultiHeadCausalMatchesTheReferencePerHead) {
  // H = 3 heads packed side by side (the batched machinery; the non-causal multi-head form
  // runs the same per-head kernel as linear_attention, left out to keep compile time down).
  const Index H = 3;
  double worst = 0;
  for_new_maps([&](const auto& phi, const char* name) {
    double w = 0;
    for (const KernelShape& sh : kKernelShapes) {
      const MatD Q = test::random_matrix<double>(sh.N, H * sh.D, test::seed_of({sh.N, sh.D, 2621}));
      const MatD K = test::random_matrix<double>(sh.N, H * sh.D, test::seed_of({sh.N, sh.D, 2622}));
      const MatD V = test::random_matrix<double>(sh.N, H * sh.M, test::seed_of({sh.N, sh.M, 2623}));
      for (const auto a :
           {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent}) {
        const MatD out =
            linattn::multihead_causal_linear_attention(Q, K, V, H, phi, causal_options(a, 16));
        for (Index h = 0; h < H; ++h)
          w = std::max(w, err_of(out.middleCols(h * sh.M, sh.M),
                                 ref::causal_linear_attention(Q.middleCols(h * sh.D, sh.D),
                                                              K.middleCols(h * sh.D, sh.D),
                                                              V.middleCols(h * sh.M, sh.M), phi)));
      }
    }
    test::report_error(std::string(name) + "/multihead_causal_vs_naive/double", w);
    worst = std::max(worst, w);
  });
  EXPECT_LE(worst, 5e-15);  // measured 1.3e-15 (Taylor2), 4.4e-16 (Dpfp3)
}

TEST(ReluDpfpTaylor2Kernels, GradientsMatchFiniteDifferencesOfTheReference) {
  // dQ, dK, dV of L = Σ out ∘ W from the backward kernels (chained through the maps' backward),
  // against central differences of the naive reference (not of the kernels). N = 37 (three
  // chunks of 16), L = 29 non-causal, D = 5, M = 3. No input lies within a step of a ReLU kink.
  const Index N = 37, L = 29, D = 5, M = 3;
  const MatD Q = test::random_matrix<double>(N, D, 2631),
             K = test::random_matrix<double>(N, D, 2632);
  const MatD V = test::random_matrix<double>(N, M, 2633),
             W = test::random_matrix<double>(N, M, 2634);
  const MatD Kn = K.topRows(L), Vn = V.topRows(L);
  double worst = 0;
  for_new_maps([&](const auto& phi, const char* name) {
    const auto f = [&](const MatD& q, const MatD& k, const MatD& v) -> MatD {
      return ref::generic_linear_attention(q, k, v, phi, false);
    };
    const auto fc = [&](const MatD& q, const MatD& k, const MatD& v) -> MatD {
      return ref::generic_linear_attention(q, k, v, phi, true);
    };
    const auto g = linattn::linear_attention_backward(Q, Kn, Vn, W, phi);
    double e = std::max({test::relative_error(g.dQ, test::finite_difference(f, Q, Kn, Vn, W, 0)),
                         test::relative_error(g.dK, test::finite_difference(f, Q, Kn, Vn, W, 1)),
                         test::relative_error(g.dV, test::finite_difference(f, Q, Kn, Vn, W, 2))});
    const MatD fq = test::finite_difference(fc, Q, K, V, W, 0),
               fk = test::finite_difference(fc, Q, K, V, W, 1),
               fv = test::finite_difference(fc, Q, K, V, W, 2);
    for (const auto a : {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent}) {
      const auto gc =
          linattn::causal_linear_attention_backward(Q, K, V, W, phi, causal_options(a, 16));
      e = std::max({e, test::relative_error(gc.dQ, fq), test::relative_error(gc.dK, fk),
                    test::relative_error(gc.dV, fv)});
    }
    test::report_error(std::string(name) + "/backward_vs_fd_of_naive (relative)", e);
    worst = std::max(worst, e);
  });
  // Measured 3.8e-8 (Dpfp1), 3.0e-8 (Relu), 2.8e-9 (Dpfp3), 5.3e-10 (Taylor2): the O(h²)
  // truncation of the differences (steps of 1e-5) on rows with small denominators, 100 times
  // smaller with steps of 1e-6. A wrong backward is off by O(1).
  EXPECT_LE(worst, 1.5e-7);
}

// The gated kernel (spec §9) from a zero state against gref::quadratic (long double, O(N²)):
// scalar log-decays (N x 1) and per-feature gates (N x F), unnormalised (scale 0.7) and
// normalised, chunked (chunk 16) and recurrent.
TEST(ReluDpfpTaylor2Kernels, GatedKernelMatchesTheQuadraticReference) {
  double worst = 0;
  for_new_maps([&](const auto& phi, const char* name) {
    double w = 0;
    for (const KernelShape& sh : kKernelShapes) {
      if (sh.N > 130) continue;  // the long double reference is O(N²·F) exponentials
      const Index F = phi.feature_dim(sh.D);
      const MatD Q = test::random_matrix<double>(sh.N, sh.D, test::seed_of({sh.N, sh.D, 2641}));
      const MatD K = test::random_matrix<double>(sh.N, sh.D, test::seed_of({sh.N, sh.D, 2642}));
      const MatD V = test::random_matrix<double>(sh.N, sh.M, test::seed_of({sh.N, sh.M, 2643}));
      for (const Index gates : {Index(1), F}) {
        const MatD G =
            test::random_matrix<double>(sh.N, gates, test::seed_of({sh.N, gates, 2644}), -0.5, 0);
        for (const bool normalize : {false, true}) {
          gref::Options ro;
          ro.normalize = normalize;
          ro.scale = normalize ? 1.0 : 0.7;
          const MatD expected = gref::quadratic(Q, K, V, G, phi, ro);
          for (const auto a :
               {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent}) {
            linattn::GatedOptions o;
            o.normalize = normalize;
            o.scale = ro.scale;
            o.algorithm = a;
            o.chunk_size = 16;
            const MatD out = linattn::gated_linear_attention(Q, K, V, G, phi, o);
            // Unnormalised outputs are sums, not means: relative to their largest magnitude.
            w = std::max(w,
                         normalize ? err_of(out, expected) : gref::relative_error(out, expected));
          }
        }
      }
    }
    test::report_error(std::string(name) + "/gated_vs_quadratic/double", w);
    worst = std::max(worst, w);
  });
  EXPECT_LE(worst, 3.5e-15);  // measured 8.9e-16 (Taylor2), 4.4e-16 (Dpfp)
}

// ---------------------------------------------------------------------------------------------
// FAVOR+ through every kernel family in double, against the naive references, which
// use the plain features φ(x) = exp(W x' − |x'|²/2)/√m: the kernels use the stabilised sides
// (the normalised ones) or the plain features (the unnormalised ones), so agreement also shows
// that the shifts cancel. m = 2D + 3 features (F ≠ D, F ≠ M), one Favor per D and seed; the
// shapes of kKernelShapes (N a multiple of no block size).
// ---------------------------------------------------------------------------------------------

linattn::Favor<double> favor_for(Index D, Index salt = 0) {
  return linattn::Favor<double>(D, 2 * D + 3, std::uint64_t(2670 + D + 100 * salt));
}

TEST(FavorKernels, LinearCausalMaskedAndDecodeMatchTheReference) {
  double worst = 0;
  for (const KernelShape& sh : kKernelShapes) {
    const auto phi = favor_for(sh.D);
    const Index L = sh.N + 11;
    const MatD Q = test::random_matrix<double>(sh.N, sh.D, test::seed_of({sh.N, sh.D, 2671}));
    const MatD K = test::random_matrix<double>(L, sh.D, test::seed_of({L, sh.D, 2672}));
    const MatD V = test::random_matrix<double>(L, sh.M, test::seed_of({L, sh.M, 2673}));
    // Non-causal, N ≠ L.
    worst = std::max(worst, err_of(linattn::linear_attention(Q, K, V, phi),
                                   ref::generic_linear_attention(Q, K, V, phi)));
    // Causal: chunked (16, default), recurrent, and the decode step.
    const MatD Kc = K.topRows(sh.N), Vc = V.topRows(sh.N);
    const MatD expected = ref::causal_linear_attention(Q, Kc, Vc, phi);
    for (const auto& o : {causal_options(linattn::CausalAlgorithm::Chunked, 16),
                          causal_options(linattn::CausalAlgorithm::Chunked, 0),
                          causal_options(linattn::CausalAlgorithm::Recurrent, 0)})
      worst =
          std::max(worst, err_of(linattn::causal_linear_attention(Q, Kc, Vc, phi, o), expected));
    linattn::RecurrentLinearAttention<linattn::Favor<double>, double> rec(sh.D, sh.M, phi);
    MatD steps(sh.N, sh.M);
    for (Index t = 0; t < sh.N; ++t)
      steps.row(t) = rec.step(Q.row(t), Kc.row(t), Vc.row(t)).transpose();
    worst = std::max(worst, err_of(steps, expected));
    // The causal form continued from a state summarised in another call (the fixed key shift
    // makes the two calls' features the same).
    if (sh.N > 20) {
      auto st = linattn::summarize(Kc.topRows(20), Vc.topRows(20), phi);
      const MatD rest = linattn::causal_linear_attention(
          Q.bottomRows(sh.N - 20), Kc.bottomRows(sh.N - 20), Vc.bottomRows(sh.N - 20), phi, st);
      worst = std::max(worst, err_of(rest, expected.bottomRows(sh.N - 20)));
    }
    // Masked keys, non-causal and causal.
    cref::BoolVec keep = cref::random_mask(L, test::seed_of({L, 2674}), 0.7);
    keep.head(6).setConstant(false);
    worst = std::max(worst, err_of(linattn::masked_linear_attention(Q, K, V, keep, phi),
                                   ref::generic_linear_attention(Q, cref::kept_rows(K, keep),
                                                                 cref::kept_rows(V, keep), phi)));
    const cref::BoolVec keep_c = keep.head(sh.N);
    const MatD cexpected = cref::masked_causal(Q, Kc, Vc, keep_c, phi);
    for (const auto a : {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent})
      worst = std::max(worst, err_of(linattn::masked_causal_linear_attention(Q, Kc, Vc, keep_c, phi,
                                                                             causal_options(a, 16)),
                                     cexpected));
  }
  test::report_error("Favor/linear_causal_masked_decode_vs_naive/double", worst);
  EXPECT_LE(worst, 2e-15);  // measured 3.3e-16
}

TEST(FavorKernels, MultiHeadBatchedAndBatchedDecodeMatchTheReferencePerHead) {
  const Index H = 3;
  double worst = 0;
  for (const KernelShape& sh : kKernelShapes) {
    const auto phi = favor_for(sh.D, 1);
    const MatD Q = test::random_matrix<double>(sh.N, H * sh.D, test::seed_of({sh.N, sh.D, 2681}));
    const MatD K = test::random_matrix<double>(sh.N, H * sh.D, test::seed_of({sh.N, sh.D, 2682}));
    const MatD V = test::random_matrix<double>(sh.N, H * sh.M, test::seed_of({sh.N, sh.M, 2683}));
    const auto head = [&](const MatD& X, Index h, Index w) { return MatD(X.middleCols(h * w, w)); };
    std::vector<MatD> causal_ref, full_ref;
    for (Index h = 0; h < H; ++h) {
      causal_ref.push_back(
          ref::causal_linear_attention(head(Q, h, sh.D), head(K, h, sh.D), head(V, h, sh.M), phi));
      full_ref.push_back(
          ref::generic_linear_attention(head(Q, h, sh.D), head(K, h, sh.D), head(V, h, sh.M), phi));
    }
    const auto per_head = [&](const MatD& out, const std::vector<MatD>& expected, Index r0,
                              Index n) {
      double w = 0;
      for (Index h = 0; h < H; ++h)
        w = std::max(w, err_of(out.block(r0, h * sh.M, n, sh.M), expected[std::size_t(h)]));
      return w;
    };
    worst = std::max(
        worst, per_head(linattn::multihead_linear_attention(Q, K, V, H, phi), full_ref, 0, sh.N));
    for (const auto a : {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent})
      worst = std::max(worst, per_head(linattn::multihead_causal_linear_attention(
                                           Q, K, V, H, phi, causal_options(a, 16)),
                                       causal_ref, 0, sh.N));
    // Batched: the whole sequence as one of two sequences (the other empty), causal and not.
    const std::vector<Index> off = {0, sh.N, sh.N};
    linattn::MultiHeadWorkspace<double> ws;
    MatD out(sh.N, H * sh.M);
    linattn::batched_causal_linear_attention(Q, K, V, off, H, phi, out, ws,
                                             causal_options(linattn::CausalAlgorithm::Auto, 16));
    worst = std::max(worst, per_head(out, causal_ref, 0, sh.N));
    linattn::batched_linear_attention(Q, K, V, off, off, H, phi, out, ws);
    worst = std::max(worst, per_head(out, full_ref, 0, sh.N));
    // Batched decode: B = 2 sequences (the same tokens), H heads, token by token.
    linattn::BatchedRecurrentLinearAttention<linattn::Favor<double>, double> dec(2, H, sh.D, sh.M,
                                                                                 phi);
    MatD steps(sh.N, H * sh.M), qb(2, H * sh.D), kb(2, H * sh.D), vb(2, H * sh.M), ob(2, H * sh.M);
    for (Index t = 0; t < sh.N; ++t) {
      qb.row(0) = qb.row(1) = Q.row(t);
      kb.row(0) = kb.row(1) = K.row(t);
      vb.row(0) = vb.row(1) = V.row(t);
      dec.step(qb, kb, vb, ob);
      EXPECT_EQ(ob.row(0), ob.row(1));
      steps.row(t) = ob.row(1);
    }
    worst = std::max(worst, per_head(steps, causal_ref, 0, sh.N));
  }
  test::report_error("Favor/multihead_batched_decode_vs_naive/double", worst);
  EXPECT_LE(worst, 2e-15);  // measured 3.3e-16
}

TEST(FavorKernels, GatedAndDeltaRuleMatchTheirReferences) {
  // Gated: normalised (stabilised sides) and not (plain features), scalar and per-feature
  // gates, chunked, recurrent and the decode step. The delta rule (unnormalised: plain
  // features), against its long-double recurrence, and its decode step.
  double worst_g = 0, worst_d = 0;
  for (const KernelShape& sh : kKernelShapes) {
    if (sh.N > 130) continue;  // the long double references are O(N²·F) and O(N·F²·M)
    const auto phi = favor_for(sh.D, 2);
    const Index F = phi.feature_dim(sh.D);
    const MatD Q = test::random_matrix<double>(sh.N, sh.D, test::seed_of({sh.N, sh.D, 2691}));
    const MatD K = test::random_matrix<double>(sh.N, sh.D, test::seed_of({sh.N, sh.D, 2692}));
    const MatD V = test::random_matrix<double>(sh.N, sh.M, test::seed_of({sh.N, sh.M, 2693}));
    for (const Index gates : {Index(1), F}) {
      const MatD G =
          test::random_matrix<double>(sh.N, gates, test::seed_of({sh.N, gates, 2694}), -0.5, 0);
      for (const bool normalize : {false, true}) {
        gref::Options ro;
        ro.normalize = normalize;
        ro.scale = normalize ? 1.0 : 0.7;
        const MatD expected = gref::quadratic(Q, K, V, G, phi, ro);
        const auto err = [&](const MatD& out) {
          return normalize ? err_of(out, expected) : gref::relative_error(out, expected);
        };
        linattn::GatedOptions o;
        o.normalize = normalize;
        o.scale = ro.scale;
        o.chunk_size = 16;
        for (const auto a :
             {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent}) {
          o.algorithm = a;
          worst_g = std::max(worst_g, err(linattn::gated_linear_attention(Q, K, V, G, phi, o)));
        }
        linattn::RecurrentGatedAttention<linattn::Favor<double>, double> rnn(sh.D, sh.M, phi, o);
        MatD steps(sh.N, sh.M);
        Eigen::VectorXd y(sh.M);
        for (Index t = 0; t < sh.N; ++t) {
          rnn.step(Q.row(t), K.row(t), V.row(t), G.row(t), y);
          steps.row(t) = y.transpose();
        }
        worst_g = std::max(worst_g, err(steps));
      }
    }
    // The delta rule: β in [0, 0.5] (plain features have norms of about 1), with decay.
    const Eigen::VectorXd beta =
        test::random_matrix<double>(sh.N, 1, test::seed_of({sh.N, 2695}), 0, 0.5);
    const Eigen::VectorXd log_a =
        test::random_matrix<double>(sh.N, 1, test::seed_of({sh.N, 2696}), -0.3, 0);
    linattn::DeltaOptions dopts;
    dopts.scale = 0.6;
    const MatD dexpected = dref::recurrence(phi, Q, K, V, beta, log_a, dopts.scale);
    for (const auto a : {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent}) {
      dopts.algorithm = a;
      dopts.chunk_size = 16;
      worst_d = std::max(
          worst_d, gref::relative_error(
                       linattn::delta_rule_attention(Q, K, V, beta, log_a, phi, dopts), dexpected));
    }
    linattn::RecurrentDeltaRule<linattn::Favor<double>, double> drnn(sh.D, sh.M, phi, dopts);
    MatD dsteps(sh.N, sh.M);
    Eigen::VectorXd y(sh.M);
    for (Index t = 0; t < sh.N; ++t) {
      drnn.step(Q.row(t), K.row(t), V.row(t), beta(t), log_a(t), y);
      dsteps.row(t) = y.transpose();
    }
    worst_d = std::max(worst_d, gref::relative_error(dsteps, dexpected));
  }
  test::report_error("Favor/gated_vs_quadratic/double", worst_g);
  test::report_error("Favor/delta_rule_vs_recurrence (relative)/double", worst_d);
  EXPECT_LE(worst_g, 1.5e-15);  // measured 2.2e-16
  EXPECT_LE(worst_d, 2e-15);    // measured 3.9e-16
}

TEST(FavorKernels, GradientsMatchFiniteDifferencesOfTheReference) {
  // dQ, dK, dV of L = Σ out ∘ W from the backward kernels, chained through the sides' backward
  // (the query side's row shift taken as a constant: exact for the normalised kernels), against
  // central differences of the plain-feature references: non-causal, causal chunked and
  // recurrent, gated (normalised and not, per-feature gates), the delta rule.
  const Index N = 37, L = 29, D = 5, M = 3;
  const auto phi = favor_for(D, 3);
  const Index F = phi.feature_dim(D);
  const MatD Q = test::random_matrix<double>(N, D, 2701),
             K = test::random_matrix<double>(N, D, 2702);
  const MatD V = test::random_matrix<double>(N, M, 2703),
             W = test::random_matrix<double>(N, M, 2704);
  const MatD Kn = K.topRows(L), Vn = V.topRows(L);
  const auto f = [&](const MatD& q, const MatD& k, const MatD& v) -> MatD {
    return ref::generic_linear_attention(q, k, v, phi, false);
  };
  const auto fc = [&](const MatD& q, const MatD& k, const MatD& v) -> MatD {
    return ref::generic_linear_attention(q, k, v, phi, true);
  };
  const auto g = linattn::linear_attention_backward(Q, Kn, Vn, W, phi);
  double e = std::max({test::relative_error(g.dQ, test::finite_difference(f, Q, Kn, Vn, W, 0)),
                       test::relative_error(g.dK, test::finite_difference(f, Q, Kn, Vn, W, 1)),
                       test::relative_error(g.dV, test::finite_difference(f, Q, Kn, Vn, W, 2))});
  const MatD fq = test::finite_difference(fc, Q, K, V, W, 0),
             fk = test::finite_difference(fc, Q, K, V, W, 1),
             fv = test::finite_difference(fc, Q, K, V, W, 2);
  for (const auto a : {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent}) {
    const auto gc =
        linattn::causal_linear_attention_backward(Q, K, V, W, phi, causal_options(a, 16));
    e = std::max({e, test::relative_error(gc.dQ, fq), test::relative_error(gc.dK, fk),
                  test::relative_error(gc.dV, fv)});
  }
  test::report_error("Favor/backward_vs_fd_of_naive (relative)", e);
  // Measured 3.0e-10: the O(h²) truncation of the differences; a wrong backward (a missing
  // shift term, the wrong side) is off by O(1).
  EXPECT_LE(e, 1.5e-9);

  const MatD G = test::random_matrix<double>(N, F, 2705, -0.5, 0);
  double eg = 0;
  for (const bool normalize : {true, false}) {
    gref::Options ro;
    ro.normalize = normalize;
    ro.scale = normalize ? 1.0 : 0.7;
    const auto fg = [&](const MatD& q, const MatD& k, const MatD& v) -> MatD {
      return gref::quadratic(q, k, v, G, phi, ro);
    };
    linattn::GatedOptions o;
    o.normalize = normalize;
    o.scale = ro.scale;
    o.chunk_size = 16;
    const MatD gq = test::finite_difference(fg, Q, K, V, W, 0),
               gk = test::finite_difference(fg, Q, K, V, W, 1),
               gv = test::finite_difference(fg, Q, K, V, W, 2);
    for (const auto a : {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent}) {
      o.algorithm = a;
      const auto gg = linattn::gated_linear_attention_backward(Q, K, V, G, W, phi, o);
      eg = std::max({eg, test::relative_error(gg.dQ, gq), test::relative_error(gg.dK, gk),
                     test::relative_error(gg.dV, gv)});
    }
  }
  test::report_error("Favor/gated_backward_vs_fd_of_quadratic (relative)", eg);
  EXPECT_LE(eg, 1.5e-9);  // measured 3.1e-10

  const Eigen::VectorXd beta = test::random_matrix<double>(N, 1, 2706, 0, 0.5);
  const Eigen::VectorXd log_a = test::random_matrix<double>(N, 1, 2707, -0.3, 0);
  linattn::DeltaOptions dopts;
  dopts.scale = 0.6;
  const auto gd = linattn::delta_rule_attention_backward(Q, K, V, beta, log_a, W, phi, dopts);
  const dref::Gradients rd = dref::backward(phi, Q, K, V, beta, log_a, dopts.scale, W);
  const double ed =
      std::max({test::relative_error(gd.dQ, rd.dQ), test::relative_error(gd.dK, rd.dK),
                test::relative_error(gd.dV, rd.dV)});
  test::report_error("Favor/delta_backward_vs_chain_rule (relative)", ed);
  EXPECT_LE(ed, 4e-15);  // measured 6.6e-16
}
#endif  // LINATTN_TEST_DOUBLE_CASES && LINATTN_TEST_DOUBLE

}  // namespace
