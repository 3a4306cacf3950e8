// softmax_attention and causal_softmax_attention (spec §5), both algorithms (Naive and the
// 64 x 256 tiled online softmax), float and double, against the naive double reference.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "reference.hpp"
#include "test_util.hpp"

namespace {

using linattn::SoftmaxAlgorithm;
using test::Index;
using test::Mat;
using test::MatD;
using test::RowMat;

const char* algo_name(SoftmaxAlgorithm a) { return a == SoftmaxAlgorithm::Naive ? "Naive" : "Tiled"; }

template <class S>
struct Case {
  Mat<S> Q, K, V;
};

template <class S>
Case<S> make_case(const test::Shape& sh, std::uint32_t salt, double qk = 2.0, double v = 3.0) {
  return {test::random_matrix<S>(sh.N, sh.D, test::seed_of({sh.N, sh.L, sh.D, salt, 1}), -qk, qk),
          test::random_matrix<S>(sh.L, sh.D, test::seed_of({sh.N, sh.L, sh.D, salt, 2}), -qk, qk),
          test::random_matrix<S>(sh.L, sh.M, test::seed_of({sh.L, sh.M, salt, 3}), -v, v)};
}

template <class S>
Mat<S> run(bool causal, const Mat<S>& Q, const Mat<S>& K, const Mat<S>& V, SoftmaxAlgorithm algo) {
  return causal ? linattn::causal_softmax_attention(Q, K, V, algo)
                : linattn::softmax_attention(Q, K, V, algo);
}

MatD reference(bool causal, const MatD& Q, const MatD& K, const MatD& V) {
  return causal ? ref::causal_softmax_attention(Q, K, V) : ref::softmax_attention(Q, K, V);
}

// ---------------------------------------------------------------------------------------------
// The shape lists (sizes straddling the 128- and 256-row tiles), for every combination.
// ---------------------------------------------------------------------------------------------

// Bounds a few times the errors measured (the report_error lines, Release, portable; they were
// 1e-4 and 1e-10): shape lists per unit of max |V| (measured at most 1.7e-6 in float and 2.7e-15
// in double, absolute, with max |V| near 3), magnitude 100 absolute with |V| <= 1 (measured
// 2.4e-7 and 2.2e-16).
constexpr double kShapeListFloat = 5e-6, kShapeListDouble = 1e-14;
constexpr double kMagnitude100Float = 1e-6, kMagnitude100Double = 2e-15;

template <class S>
void check_shape_lists(SoftmaxAlgorithm algo) {
  for (const bool causal : {false, true}) {
    double worst = 0;
    for (const test::Shape& sh : causal ? test::causal_shapes() : test::shapes()) {
      const Case<S> c = make_case<S>(sh, 10);
      const Mat<S> out = run<S>(causal, c.Q, c.K, c.V, algo);
      const MatD expected = reference(causal, c.Q.template cast<double>(),
                                      c.K.template cast<double>(), c.V.template cast<double>());
      const double err = test::max_abs_diff(out, expected);
      EXPECT_LE(err, test::bound<S>(kShapeListFloat, kShapeListDouble, test::max_abs(c.V)))
          << (causal ? "causal " : "") << algo_name(algo) << " " << sh;
      worst = std::max(worst, err / std::max(1.0, test::max_abs(c.V)));
    }
    test::report_error(std::string(causal ? "causal_softmax_attention/" : "softmax_attention/") +
                           algo_name(algo) + "/" + test::scalar_name<S>() + "/shape_list",
                       worst);
  }
}

TEST(SoftmaxAttention, NaiveFloatMatchesReference) { check_shape_lists<float>(SoftmaxAlgorithm::Naive); }
TEST(SoftmaxAttention, TiledFloatMatchesReference) { check_shape_lists<float>(SoftmaxAlgorithm::Tiled); }
TEST(SoftmaxAttention, NaiveDoubleMatchesReference) { check_shape_lists<double>(SoftmaxAlgorithm::Naive); }
TEST(SoftmaxAttention, TiledDoubleMatchesReference) { check_shape_lists<double>(SoftmaxAlgorithm::Tiled); }

TEST(SoftmaxAttention, TiledIsTheDefaultAndAgreesWithNaive) {
  for (const bool causal : {false, true}) {
    const test::Shape sh{300, 300, 16, 8};
    const Case<float> c = make_case<float>(sh, 11);
    const Eigen::MatrixXf def = causal ? linattn::causal_softmax_attention(c.Q, c.K, c.V)
                                       : linattn::softmax_attention(c.Q, c.K, c.V);
    const Eigen::MatrixXf tiled = run<float>(causal, c.Q, c.K, c.V, SoftmaxAlgorithm::Tiled);
    const Eigen::MatrixXf naive = run<float>(causal, c.Q, c.K, c.V, SoftmaxAlgorithm::Naive);
    EXPECT_EQ(test::max_abs_diff(def, tiled), 0.0);
    EXPECT_LE(test::max_abs_diff(tiled, naive), 1e-5);
  }
}

TEST(SoftmaxAttention, CausalRowsSeeOnlyThePast) {
  // Changing key/value j must leave rows i < j unchanged.
  const test::Shape sh{300, 300, 8, 4};
  for (const SoftmaxAlgorithm algo : {SoftmaxAlgorithm::Naive, SoftmaxAlgorithm::Tiled}) {
    Case<double> c = make_case<double>(sh, 12);
    const MatD before = run<double>(true, c.Q, c.K, c.V, algo);
    c.K.row(200).setConstant(50.0);
    c.V.row(200).setConstant(-7.0);
    const MatD after = run<double>(true, c.Q, c.K, c.V, algo);
    EXPECT_EQ(test::max_abs_diff(before.topRows(200), after.topRows(200)), 0.0) << algo_name(algo);
    EXPECT_GT(test::max_abs_diff(before.row(200), after.row(200)), 1e-3) << algo_name(algo);
  }
}

// ---------------------------------------------------------------------------------------------
// Inputs of magnitude 100. Integer entries with D ∈ {1, 4, 16} make every score q·k/√D exact
// in float as well (√D is a power of two), so the float kernels must be exact to rounding of
// the exp and the sums, even though the scores reach ±10⁴·√D.
// ---------------------------------------------------------------------------------------------

template <class S>
void check_magnitude_100(SoftmaxAlgorithm algo) {
  const Index dims[] = {1, 4, 16};
  for (const bool causal : {false, true}) {
    double worst = 0;
    Index k = 0;
    for (test::Shape sh : causal ? test::causal_shapes() : test::shapes()) {
      sh.D = dims[k++ % 3];
      const auto seed = test::seed_of({sh.N, sh.L, sh.D, 20});
      const Mat<S> Q = test::random_integer_matrix<S>(sh.N, sh.D, seed, -100, 100);
      const Mat<S> K = test::random_integer_matrix<S>(sh.L, sh.D, seed + 1, -100, 100);
      const Mat<S> V = test::random_matrix<S>(sh.L, sh.M, seed + 2, -1, 1);
      const Mat<S> out = run<S>(causal, Q, K, V, algo);
      EXPECT_TRUE(test::all_finite(out)) << algo_name(algo) << " " << sh;
      const double err = test::max_abs_diff(
          out, reference(causal, Q.template cast<double>(), K.template cast<double>(),
                         V.template cast<double>()));
      EXPECT_LE(err, test::bound<S>(kMagnitude100Float, kMagnitude100Double))
          << (causal ? "causal " : "") << algo_name(algo) << " " << sh;
      worst = std::max(worst, err);
    }
    test::report_error(std::string(causal ? "causal_softmax_attention/" : "softmax_attention/") +
                           algo_name(algo) + "/" + test::scalar_name<S>() + "/magnitude_100",
                       worst);
  }
}

TEST(SoftmaxAttentionLargeInputs, NaiveFloatMagnitude100) { check_magnitude_100<float>(SoftmaxAlgorithm::Naive); }
TEST(SoftmaxAttentionLargeInputs, TiledFloatMagnitude100) { check_magnitude_100<float>(SoftmaxAlgorithm::Tiled); }
TEST(SoftmaxAttentionLargeInputs, NaiveDoubleMagnitude100) { check_magnitude_100<double>(SoftmaxAlgorithm::Naive); }
TEST(SoftmaxAttentionLargeInputs, TiledDoubleMagnitude100) { check_magnitude_100<double>(SoftmaxAlgorithm::Tiled); }

TEST(SoftmaxAttentionLargeInputs, RealValuedMagnitude100IsFiniteAndConvex) {
  // Real-valued scores of 10⁴·√D are rounded in float (absolute error ~1e-3), so only the
  // structure is checked: finite rows inside the range of V; double matches the reference.
  const test::Shape sh{300, 513, 64, 8};
  for (const bool causal : {false, true}) {
    const test::Shape s = causal ? test::Shape{513, 513, 64, 8} : sh;
    const Case<double> c = make_case<double>(s, 21, 100.0, 1.0);
    const Eigen::MatrixXf Qf = c.Q.cast<float>(), Kf = c.K.cast<float>(), Vf = c.V.cast<float>();
    for (const SoftmaxAlgorithm algo : {SoftmaxAlgorithm::Naive, SoftmaxAlgorithm::Tiled}) {
      const Eigen::MatrixXf out = run<float>(causal, Qf, Kf, Vf, algo);
      EXPECT_TRUE(test::all_finite(out)) << algo_name(algo);
      EXPECT_LE(test::max_abs(out), test::max_abs(Vf) * (1 + 1e-5)) << algo_name(algo);
      EXPECT_LE(test::max_abs_diff(run<double>(causal, c.Q, c.K, c.V, algo),
                                   reference(causal, c.Q, c.K, c.V)),
                1e-10)
          << algo_name(algo);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Empty inputs and single rows.
// ---------------------------------------------------------------------------------------------

TEST(SoftmaxAttentionEdges, NoKeysGivesZeros) {
  const Eigen::MatrixXf Q = test::random_matrix<float>(70, 4, 30);
  linattn::Workspace<float> ws;
  for (const SoftmaxAlgorithm algo : {SoftmaxAlgorithm::Naive, SoftmaxAlgorithm::Tiled}) {
    const Eigen::MatrixXf out =
        linattn::softmax_attention(Q, Eigen::MatrixXf(0, 4), Eigen::MatrixXf(0, 3), algo);
    ASSERT_EQ(out.rows(), 70);
    ASSERT_EQ(out.cols(), 3);
    EXPECT_TRUE((out.array() == 0.0f).all()) << algo_name(algo);
    Eigen::MatrixXf into = Eigen::MatrixXf::Constant(70, 3, std::numeric_limits<float>::quiet_NaN());
    linattn::softmax_attention(Q, Eigen::MatrixXf(0, 4), Eigen::MatrixXf(0, 3), into, ws, algo);
    EXPECT_TRUE((into.array() == 0.0f).all()) << algo_name(algo);
    // Causal with N = L = 0.
    const Eigen::MatrixXf none = linattn::causal_softmax_attention(
        Eigen::MatrixXf(0, 4), Eigen::MatrixXf(0, 4), Eigen::MatrixXf(0, 3), algo);
    EXPECT_EQ(none.rows(), 0);
    EXPECT_EQ(none.cols(), 3);
  }
  EXPECT_EQ(test::max_abs_diff(ref::softmax_attention(Q.cast<double>(), MatD(0, 4), MatD(0, 3)),
                               MatD::Zero(70, 3)),
            0.0);
}

TEST(SoftmaxAttentionEdges, NoQueriesGivesAnEmptyResult) {
  const Eigen::MatrixXf K = test::random_matrix<float>(20, 4, 31), V = test::random_matrix<float>(20, 3, 32);
  for (const SoftmaxAlgorithm algo : {SoftmaxAlgorithm::Naive, SoftmaxAlgorithm::Tiled}) {
    const Eigen::MatrixXf out = linattn::softmax_attention(Eigen::MatrixXf(0, 4), K, V, algo);
    EXPECT_EQ(out.rows(), 0);
    EXPECT_EQ(out.cols(), 3);
  }
}

TEST(SoftmaxAttentionEdges, SingleQueryAndSingleKey) {
  for (const SoftmaxAlgorithm algo : {SoftmaxAlgorithm::Naive, SoftmaxAlgorithm::Tiled}) {
    // N = 1 over 513 keys.
    const Case<double> c = make_case<double>({1, 513, 9, 5}, 33);
    EXPECT_LE(test::max_abs_diff(linattn::softmax_attention(c.Q, c.K, c.V, algo),
                                 ref::softmax_attention(c.Q, c.K, c.V)),
              1e-12)
        << algo_name(algo);
    // L = 1: every query gets v_0 exactly (weight e^0 / e^0).
    const Case<float> one = make_case<float>({300, 1, 4, 6}, 34);
    const Eigen::MatrixXf out = linattn::softmax_attention(one.Q, one.K, one.V, algo);
    EXPECT_EQ(test::max_abs_diff(out, one.V.replicate(300, 1)), 0.0) << algo_name(algo);
    // Causal, first row: only key 0.
    const Case<float> cc = make_case<float>({65, 65, 4, 3}, 35);
    const Eigen::MatrixXf co = linattn::causal_softmax_attention(cc.Q, cc.K, cc.V, algo);
    EXPECT_EQ(test::max_abs_diff(co.row(0), cc.V.row(0)), 0.0) << algo_name(algo);
  }
}

// ---------------------------------------------------------------------------------------------
// The overloads with a caller's output and a Workspace; Map and row-major inputs.
// ---------------------------------------------------------------------------------------------

TEST(SoftmaxAttentionOutOverload, MatchesTheReturningOverload) {
  linattn::Workspace<float> ws;  // shared across shapes, algorithms and causal / not
  for (const test::Shape& sh : {test::Shape{300, 300, 16, 8}, test::Shape{65, 65, 5, 3},
                                test::Shape{513, 513, 8, 17}, test::Shape{1, 1, 1, 1}}) {
    const Case<float> c = make_case<float>(sh, 40);
    for (const bool causal : {false, true}) {
      for (const SoftmaxAlgorithm algo : {SoftmaxAlgorithm::Naive, SoftmaxAlgorithm::Tiled}) {
        const Eigen::MatrixXf returned = run<float>(causal, c.Q, c.K, c.V, algo);
        Eigen::MatrixXf out = Eigen::MatrixXf::Constant(sh.N, sh.M, std::numeric_limits<float>::quiet_NaN());
        if (causal)
          linattn::causal_softmax_attention(c.Q, c.K, c.V, out, ws, algo);
        else
          linattn::softmax_attention(c.Q, c.K, c.V, out, ws, algo);
        EXPECT_EQ(test::max_abs_diff(out, returned), 0.0) << algo_name(algo) << " " << sh;

        // Into a block of a larger matrix; the rest stays untouched.
        const float sentinel = 4321.0f;
        Eigen::MatrixXf big = Eigen::MatrixXf::Constant(sh.N + 6, sh.M + 3, sentinel);
        if (causal)
          linattn::causal_softmax_attention(c.Q, c.K, c.V, big.block(2, 1, sh.N, sh.M), ws, algo);
        else
          linattn::softmax_attention(c.Q, c.K, c.V, big.block(2, 1, sh.N, sh.M), ws, algo);
        EXPECT_EQ(test::max_abs_diff(big.block(2, 1, sh.N, sh.M), returned), 0.0) << algo_name(algo);
        big.block(2, 1, sh.N, sh.M).setConstant(sentinel);
        EXPECT_TRUE((big.array() == sentinel).all()) << algo_name(algo) << ": wrote outside the block";

        // Into a row-major Map over a std::vector.
        std::vector<float> buf(static_cast<std::size_t>(sh.N * sh.M), -1.0f);
        Eigen::Map<RowMat<float>> out_r(buf.data(), sh.N, sh.M);
        if (causal)
          linattn::causal_softmax_attention(c.Q, c.K, c.V, out_r, ws, algo);
        else
          linattn::softmax_attention(c.Q, c.K, c.V, out_r, ws, algo);
        EXPECT_LE(test::max_abs_diff(out_r, returned), 1e-6 * test::max_abs(c.V)) << algo_name(algo);
      }
    }
  }
}

TEST(SoftmaxAttentionLayouts, MapsBlocksRowMajorAndExpressions) {
  const test::Shape sh{300, 270, 7, 5};
  const Case<float> c = make_case<float>(sh, 50);
  const Eigen::MatrixXf plain = linattn::softmax_attention(c.Q, c.K, c.V);
  const MatD expected = ref::softmax_attention(c.Q.cast<double>(), c.K.cast<double>(), c.V.cast<double>());
  const double tol = test::bound<float>(kShapeListFloat, 0, test::max_abs(c.V));
  ASSERT_LE(test::max_abs_diff(plain, expected), tol);

  // Maps over std::vector (column-major).
  std::vector<float> q(c.Q.data(), c.Q.data() + c.Q.size()), k(c.K.data(), c.K.data() + c.K.size()),
      v(c.V.data(), c.V.data() + c.V.size());
  const Eigen::Map<const Eigen::MatrixXf> Qm(q.data(), sh.N, sh.D), Km(k.data(), sh.L, sh.D),
      Vm(v.data(), sh.L, sh.M);
  EXPECT_LE(test::max_abs_diff(linattn::softmax_attention(Qm, Km, Vm), plain), tol);

  // Row-major matrices, and a mix of a row-major Map, a block and a plain matrix.
  const RowMat<float> Qr = c.Q, Kr = c.K, Vr = c.V;
  EXPECT_LE(test::max_abs_diff(linattn::softmax_attention(Qr, Kr, Vr, SoftmaxAlgorithm::Naive), plain), tol);
  EXPECT_LE(test::max_abs_diff(linattn::softmax_attention(Qr, Kr, Vr, SoftmaxAlgorithm::Tiled), plain), tol);
  Eigen::MatrixXf bigK = Eigen::MatrixXf::Constant(sh.L + 4, sh.D + 3, 1e3f);
  bigK.block(3, 2, sh.L, sh.D) = c.K;
  const Eigen::MatrixXf& cbigK = bigK;
  const Eigen::Map<const RowMat<float>> Qrm(Qr.data(), sh.N, sh.D);
  EXPECT_LE(test::max_abs_diff(linattn::softmax_attention(Qrm, cbigK.block(3, 2, sh.L, sh.D), c.V), plain), tol);

  // Causal with row-major Map inputs.
  const test::Shape cs{300, 300, 7, 5};
  const Case<float> cc = make_case<float>(cs, 51);
  const RowMat<float> cQ = cc.Q, cK = cc.K, cV = cc.V;
  const Eigen::Map<const RowMat<float>> cQm(cQ.data(), cs.N, cs.D), cKm(cK.data(), cs.L, cs.D),
      cVm(cV.data(), cs.L, cs.M);
  const MatD cexp = ref::causal_softmax_attention(cc.Q.cast<double>(), cc.K.cast<double>(), cc.V.cast<double>());
  for (const SoftmaxAlgorithm algo : {SoftmaxAlgorithm::Naive, SoftmaxAlgorithm::Tiled})
    EXPECT_LE(test::max_abs_diff(linattn::causal_softmax_attention(cQm, cKm, cVm, algo), cexp), tol)
        << algo_name(algo);

  // An expression: Q * 2 is attention with doubled scores.
  const Eigen::MatrixXf Q2 = c.Q * 2.0f;
  EXPECT_LE(test::max_abs_diff(linattn::softmax_attention(c.Q * 2.0f, c.K, c.V),
                               ref::softmax_attention(Q2.cast<double>(), c.K.cast<double>(), c.V.cast<double>())),
            tol);
}

}  // namespace
