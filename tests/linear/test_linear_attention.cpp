// Non-causal linear_attention (spec §1–2) for every built-in feature map, in float and double,
// against the naive double reference of reference.hpp: the shape list, every input layout,
// the allocation-free overload, empty inputs, large inputs, zero vectors and NaN.
//
// Compiled twice (tests/CMakeLists.txt) so that each translation unit compiles quickly:
// test_linear_attention_layouts (LINATTN_TEST_LAYOUT_PART) has the layout and output-overload
// tests, which instantiate the kernel for many expression types; test_linear_attention has
// the rest.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
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

template <class Map>
const char* map_name() {
  if constexpr (std::is_same_v<Map, linattn::EluPlusOne>)
    return "EluPlusOne";
  else if constexpr (std::is_same_v<Map, linattn::SoftmaxSplit>)
    return "SoftmaxSplit";
  else
    return "NormalizedCosine";
}

// The smallest reference denominator at which a row is compared with the reference. EluPlusOne
// features are positive, so its sums do not cancel and only the guard matters (1e-3 is far
// above both ε). NormalizedCosine's features can be negative: φ(q)ᵀz carries a rounding error
// of about ε·L, so rows are compared when the denominator is at least 5% of L (it is L on
// average). SoftmaxSplit has no denominator (the reference reports 1).
template <class Map>
double min_den(Index L) {
  if constexpr (std::is_same_v<Map, linattn::NormalizedCosine>)
    return 0.05 * double(L);
  else if constexpr (std::is_same_v<Map, linattn::SoftmaxSplit>)
    return 0.0;
  else
    return 1e-3;
}

struct Inputs {
  MatD Q, K, V;  // in double; the kernels get them rounded to their scalar type
};

inline Inputs make_inputs(const test::Shape& sh, std::uint32_t salt, double qk = 2.0,
                          double v = 3.0) {
  return {test::random_matrix<double>(sh.N, sh.D, test::seed_of({sh.N, sh.L, sh.D, salt, 1}), -qk,
                                      qk),
          test::random_matrix<double>(sh.L, sh.D, test::seed_of({sh.N, sh.L, sh.D, salt, 2}), -qk,
                                      qk),
          test::random_matrix<double>(sh.L, sh.M, test::seed_of({sh.L, sh.M, salt, 3}), -v, v)};
}

// Runs the kernel on the shape list and compares with the reference. Returns the max error.
#ifndef LINATTN_TEST_LAYOUT_PART
// Bounds of the shape-list comparison per unit of max |V| (it was 1e-4 in float): a few times
// the largest error measured, reported as .../shape_list (Release, portable: at most 3.8e-6 in
// float and 8.9e-15 in double in absolute terms, with max |V| between 3 and 30).
constexpr double kShapeListFloat = 5e-6, kShapeListDouble = 3e-14;
// The rows compared (reference denominator above min_den) out of all rows of the shape list:
// all of them for EluPlusOne and SoftmaxSplit; NormalizedCosine skips the rows whose keys
// point away from the query.
constexpr double kMinComparedFraction = 0.8;

template <class Map, class S>
double check_shape_list(double qk, double v) {
  double worst = 0;
  test::RowComparison all;
  for (const test::Shape& sh : test::shapes()) {
    const Inputs in = make_inputs(sh, 100, qk, v);
    const Mat<S> Q = in.Q.cast<S>(), K = in.K.cast<S>(), V = in.V.cast<S>();
    const Mat<S> out = linattn::linear_attention(Q, K, V, Map{});
    Eigen::VectorXd den;
    const MatD expected = ref::linear_attention(Q.template cast<double>(), K.template cast<double>(),
                                                V.template cast<double>(), Map{}, &den);
    const auto rc = test::compare_well_conditioned_rows(out, expected, den, min_den<Map>(sh.L),
                                                        test::max_abs(V));
    EXPECT_LE(rc.max_err, test::bound<S>(kShapeListFloat, kShapeListDouble, test::max_abs(V)))
        << map_name<Map>() << " " << sh;
    if (!std::is_same_v<Map, linattn::NormalizedCosine>) {  // positive features: none skipped
      EXPECT_EQ(rc.skipped, 0) << map_name<Map>() << " " << sh;
    }
    worst = std::max(worst, rc.max_err / std::max(1.0, test::max_abs(V)));
    all += rc;
  }
  test::expect_enough_rows(all, kMinComparedFraction, std::string(map_name<Map>()) + "/" +
                                                          test::scalar_name<S>() + " shape list");
  return worst;
}

template <class Map, class S>
void run_shape_list() {
  const double e1 = check_shape_list<Map, S>(2.0, 3.0);
  const double e2 = check_shape_list<Map, S>(0.5, 30.0);  // other scales of Q, K and V
  test::report_error(std::string("linear_attention/") + map_name<Map>() + "/" +
                         test::scalar_name<S>() + "/shape_list",
                     std::max(e1, e2));
}

TEST(LinearAttention, EluPlusOneFloatMatchesReference) { run_shape_list<linattn::EluPlusOne, float>(); }
TEST(LinearAttention, EluPlusOneDoubleMatchesReference) {
  run_shape_list<linattn::EluPlusOne, double>();
}
TEST(LinearAttention, SoftmaxSplitFloatMatchesReference) {
  run_shape_list<linattn::SoftmaxSplit, float>();
}
TEST(LinearAttention, SoftmaxSplitDoubleMatchesReference) {
  run_shape_list<linattn::SoftmaxSplit, double>();
}
TEST(LinearAttention, NormalizedCosineFloatMatchesReference) {
  run_shape_list<linattn::NormalizedCosine, float>();
}
TEST(LinearAttention, NormalizedCosineDoubleMatchesReference) {
  run_shape_list<linattn::NormalizedCosine, double>();
}

// The references themselves: the causal forms (used by the causal suite) agree with the
// non-causal ones on the last row and on N = L = 1, and the generic reference fed with the
// library's maps agrees with the spec formulas, causal or not.
TEST(References, CausalAndNonCausalAgreeWhereTheyMust) {
  const MatD Q = test::random_matrix<double>(90, 5, 701, -2, 2);
  const MatD K = test::random_matrix<double>(90, 5, 702, -2, 2);
  const MatD V = test::random_matrix<double>(90, 3, 703);
  const auto last_rows_agree = [&](const MatD& causal, const MatD& full) {
    return test::max_abs_diff(causal.bottomRows(1), full.bottomRows(1));
  };
  EXPECT_LE(last_rows_agree(ref::causal_linear_attention(Q, K, V, linattn::EluPlusOne{}),
                            ref::linear_attention(Q, K, V, linattn::EluPlusOne{})), 1e-13);
  EXPECT_LE(last_rows_agree(ref::causal_linear_attention(Q, K, V, linattn::NormalizedCosine{}),
                            ref::linear_attention(Q, K, V, linattn::NormalizedCosine{})), 1e-13);
  EXPECT_LE(last_rows_agree(ref::causal_linear_attention(Q, K, V, linattn::SoftmaxSplit{}),
                            ref::linear_attention(Q, K, V, linattn::SoftmaxSplit{})), 1e-13);
  EXPECT_LE(last_rows_agree(ref::causal_softmax_attention(Q, K, V), ref::softmax_attention(Q, K, V)),
            1e-13);
  // Row 0 of every causal form sees only key 0: its output is v_0.
  const MatD v0 = V.topRows(1);
  EXPECT_LE(test::max_abs_diff(ref::causal_linear_attention(Q, K, V, linattn::EluPlusOne{}).topRows(1), v0), 1e-14);
  EXPECT_LE(test::max_abs_diff(ref::causal_linear_attention(Q, K, V, linattn::SoftmaxSplit{}).topRows(1), v0), 1e-14);
  EXPECT_LE(test::max_abs_diff(ref::causal_softmax_attention(Q, K, V).topRows(1), v0), 1e-14);
  // Generic (row-by-row map) vs spec formulas, causal.
  EXPECT_LE(test::max_abs_diff(ref::generic_linear_attention(Q, K, V, linattn::EluPlusOne{}, true),
                               ref::causal_linear_attention(Q, K, V, linattn::EluPlusOne{})),
            1e-13);
  EXPECT_LE(test::max_abs_diff(ref::generic_linear_attention(Q, K, V, linattn::NormalizedCosine{}, true),
                               ref::causal_linear_attention(Q, K, V, linattn::NormalizedCosine{})),
            1e-13);
  // Causal SoftmaxSplit: the weights of query i over keys j <= i sum to one, so V = 1 gives 1.
  EXPECT_LE(test::max_abs_diff(ref::causal_linear_attention(Q, K, MatD::Ones(90, 2), linattn::SoftmaxSplit{}),
                               MatD::Ones(90, 2)),
            1e-13);
  // Causal references reject N != L.
  EXPECT_THROW(ref::causal_softmax_attention(Q.topRows(3), K, V), std::invalid_argument);
}

TEST(LinearAttention, DefaultMapIsEluPlusOne) {
  const Inputs in = make_inputs({65, 70, 6, 5}, 7);
  EXPECT_EQ(test::max_abs_diff(linattn::linear_attention(in.Q, in.K, in.V),
                               linattn::linear_attention(in.Q, in.K, in.V, linattn::EluPlusOne{})),
            0.0);
}

#endif  // !LINATTN_TEST_LAYOUT_PART

#ifdef LINATTN_TEST_LAYOUT_PART

// ---------------------------------------------------------------------------------------------
// Layouts: Maps over std::vector, blocks of larger matrices, row-major storage, mixtures and
// expressions all give the result of plain matrices (and of the reference). Sizes cross the
// 256-row blocks of the kernel. (float for every map, double for one: each layout instantiates
// the kernel again, and the code paths do not depend on the scalar type.)
// ---------------------------------------------------------------------------------------------

template <class Map, class S>
void check_layouts() {
  const test::Shape sh{300, 270, 7, 5};
  const Inputs in = make_inputs(sh, 200);
  const Mat<S> Q = in.Q.cast<S>(), K = in.K.cast<S>(), V = in.V.cast<S>();
  const Mat<S> plain = linattn::linear_attention(Q, K, V, Map{});
  const MatD expected = ref::linear_attention(Q.template cast<double>(), K.template cast<double>(),
                                              V.template cast<double>(), Map{});
  const double tol = test::bound<S>(5e-6, 3e-14, test::max_abs(V));  // as the shape list
  ASSERT_LE(test::max_abs_diff(plain, expected), tol) << map_name<Map>();
  const std::string what = std::string(map_name<Map>()) + "/" + test::scalar_name<S>();

  // Eigen::Map over std::vector storage (column-major).
  std::vector<S> q(Q.data(), Q.data() + Q.size()), k(K.data(), K.data() + K.size()),
      v(V.data(), V.data() + V.size());
  const Eigen::Map<const Mat<S>> Qm(q.data(), sh.N, sh.D), Km(k.data(), sh.L, sh.D),
      Vm(v.data(), sh.L, sh.M);
  EXPECT_LE(test::max_abs_diff(linattn::linear_attention(Qm, Km, Vm, Map{}), plain), tol) << what;

  // Blocks of larger matrices, not starting at row or column 0.
  Mat<S> bigQ = Mat<S>::Constant(sh.N + 9, sh.D + 4, S(77)), bigK = Mat<S>::Constant(sh.L + 3, sh.D + 2, S(-55));
  Mat<S> bigV = Mat<S>::Constant(sh.L + 5, sh.M + 6, S(99));
  bigQ.block(4, 1, sh.N, sh.D) = Q;
  bigK.block(2, 2, sh.L, sh.D) = K;
  bigV.block(5, 3, sh.L, sh.M) = V;
  const Mat<S>&cQ = bigQ, &cK = bigK, &cV = bigV;
  EXPECT_LE(test::max_abs_diff(linattn::linear_attention(cQ.block(4, 1, sh.N, sh.D),
                                                         cK.block(2, 2, sh.L, sh.D),
                                                         cV.block(5, 3, sh.L, sh.M), Map{}),
                               plain),
            tol)
      << what;

  // Row-major matrices.
  const RowMat<S> Qr = Q, Kr = K, Vr = V;
  EXPECT_LE(test::max_abs_diff(linattn::linear_attention(Qr, Kr, Vr, Map{}), plain), tol) << what;

  // Mixed: a row-major Map, a block, a plain matrix.
  std::vector<S> qr(Qr.data(), Qr.data() + Qr.size());
  const Eigen::Map<const RowMat<S>> Qrm(qr.data(), sh.N, sh.D);
  EXPECT_LE(test::max_abs_diff(
                linattn::linear_attention(Qrm, cK.block(2, 2, sh.L, sh.D), V, Map{}), plain),
            tol)
      << what;

  // Expressions: Q * 2 (the kernel must see 2Q) and a sum for V.
  const Mat<S> Q2 = Q * S(2), V2 = V + V;
  const Mat<S> from_expr = linattn::linear_attention(Q * S(2), K, V + V, Map{});
  EXPECT_LE(test::max_abs_diff(from_expr, linattn::linear_attention(Q2, K, V2, Map{})), 2 * tol)
      << what;
  EXPECT_LE(test::max_abs_diff(from_expr,
                               ref::linear_attention(Q2.template cast<double>(),
                                                     K.template cast<double>(),
                                                     V2.template cast<double>(), Map{})),
            2 * tol)
      << what;
}

TEST(LinearAttentionLayouts, EluPlusOneFloat) { check_layouts<linattn::EluPlusOne, float>(); }
TEST(LinearAttentionLayouts, SoftmaxSplitFloat) { check_layouts<linattn::SoftmaxSplit, float>(); }
TEST(LinearAttentionLayouts, NormalizedCosineFloat) {
  check_layouts<linattn::NormalizedCosine, float>();
}
TEST(LinearAttentionLayouts, NormalizedCosineDouble) {
  check_layouts<linattn::NormalizedCosine, double>();
}

// ---------------------------------------------------------------------------------------------
// The overload with a caller's output and a Workspace.
// ---------------------------------------------------------------------------------------------

template <class Map, class S>
void check_out_overload() {
  const std::string what = std::string(map_name<Map>()) + "/" + test::scalar_name<S>();
  linattn::Workspace<S> ws;  // shared by every call below, across shapes (larger then smaller)
  for (const test::Shape& sh : {test::Shape{513, 300, 33, 17}, test::Shape{65, 63, 5, 8},
                                test::Shape{300, 513, 8, 40}, test::Shape{1, 1, 1, 1}}) {
    const Inputs in = make_inputs(sh, 300);
    const Mat<S> Q = in.Q.cast<S>(), K = in.K.cast<S>(), V = in.V.cast<S>();
    const Mat<S> returned = linattn::linear_attention(Q, K, V, Map{});

    Mat<S> out = Mat<S>::Constant(sh.N, sh.M, std::numeric_limits<S>::quiet_NaN());
    linattn::linear_attention(Q, K, V, Map{}, out, ws);
    EXPECT_EQ(test::max_abs_diff(out, returned), 0.0) << what << " " << sh;

    // Into a block of a larger matrix: the block gets the result, the rest is untouched.
    const S sentinel = S(12345);
    Mat<S> big = Mat<S>::Constant(sh.N + 7, sh.M + 5, sentinel);
    linattn::linear_attention(Q, K, V, Map{}, big.block(3, 2, sh.N, sh.M), ws);
    EXPECT_EQ(test::max_abs_diff(big.block(3, 2, sh.N, sh.M), returned), 0.0) << what << " " << sh;
    Mat<S> outside = big;
    outside.block(3, 2, sh.N, sh.M).setConstant(sentinel);
    EXPECT_TRUE((outside.array() == sentinel).all()) << what << ": wrote outside the block";

    // Into a row-major Map over a std::vector.
    std::vector<S> buf(static_cast<std::size_t>(sh.N * sh.M), S(-1));
    Eigen::Map<RowMat<S>> out_r(buf.data(), sh.N, sh.M);
    linattn::linear_attention(Q, K, V, Map{}, out_r, ws);
    EXPECT_LE(test::max_abs_diff(out_r, returned), test::Tol<S>::ulps * 10 * test::max_abs(V))
        << what << " " << sh;
  }
}

TEST(LinearAttentionOutOverload, EluPlusOne) {
  check_out_overload<linattn::EluPlusOne, float>();
  check_out_overload<linattn::EluPlusOne, double>();
}
TEST(LinearAttentionOutOverload, SoftmaxSplit) {
  check_out_overload<linattn::SoftmaxSplit, float>();
  check_out_overload<linattn::SoftmaxSplit, double>();
}
TEST(LinearAttentionOutOverload, NormalizedCosine) {
  check_out_overload<linattn::NormalizedCosine, float>();
  check_out_overload<linattn::NormalizedCosine, double>();
}

TEST(LinearAttentionOutOverload, OneWorkspaceForEveryMap) {
  // One Workspace serving the three maps in turn (different F and code paths) must not leak
  // state from one call into the next.
  const Inputs in = make_inputs({300, 280, 9, 6}, 301);
  const Eigen::MatrixXf Q = in.Q.cast<float>(), K = in.K.cast<float>(), V = in.V.cast<float>();
  linattn::Workspace<float> ws;
  Eigen::MatrixXf out(300, 6);
  for (int round = 0; round < 2; ++round) {
    linattn::linear_attention(Q, K, V, linattn::NormalizedCosine{}, out, ws);
    EXPECT_EQ(test::max_abs_diff(out, linattn::linear_attention(Q, K, V, linattn::NormalizedCosine{})), 0.0);
    linattn::linear_attention(Q, K, V, linattn::SoftmaxSplit{}, out, ws);
    EXPECT_EQ(test::max_abs_diff(out, linattn::linear_attention(Q, K, V, linattn::SoftmaxSplit{})), 0.0);
    linattn::linear_attention(Q, K, V, linattn::EluPlusOne{}, out, ws);
    EXPECT_EQ(test::max_abs_diff(out, linattn::linear_attention(Q, K, V, linattn::EluPlusOne{})), 0.0);
  }
}

#else  // !LINATTN_TEST_LAYOUT_PART

// ---------------------------------------------------------------------------------------------
// Empty inputs (documented in linear_attention.hpp): N = 0 gives an empty N x M result; L = 0
// (no keys) gives all zeros; M = 0 gives N x 0.
// ---------------------------------------------------------------------------------------------

template <class Map>
void check_empty() {
  const std::string what = map_name<Map>();
  const Eigen::MatrixXf K = test::random_matrix<float>(20, 4, 1), V = test::random_matrix<float>(20, 3, 2);
  const Eigen::MatrixXf Q = test::random_matrix<float>(10, 4, 3);

  const Eigen::MatrixXf none = linattn::linear_attention(Eigen::MatrixXf(0, 4), K, V, Map{});
  EXPECT_EQ(none.rows(), 0) << what;
  EXPECT_EQ(none.cols(), 3) << what;

  const Eigen::MatrixXf nokeys =
      linattn::linear_attention(Q, Eigen::MatrixXf(0, 4), Eigen::MatrixXf(0, 3), Map{});
  ASSERT_EQ(nokeys.rows(), 10) << what;
  ASSERT_EQ(nokeys.cols(), 3) << what;
  EXPECT_TRUE((nokeys.array() == 0.0f).all()) << what << "\n" << nokeys;
  // ... also over a NaN-filled output, and the reference agrees.
  linattn::Workspace<float> ws;
  Eigen::MatrixXf out = Eigen::MatrixXf::Constant(10, 3, std::numeric_limits<float>::quiet_NaN());
  linattn::linear_attention(Q, Eigen::MatrixXf(0, 4), Eigen::MatrixXf(0, 3), Map{}, out, ws);
  EXPECT_TRUE((out.array() == 0.0f).all()) << what;
  EXPECT_EQ(test::max_abs_diff(ref::linear_attention(Q.cast<double>(), MatD(0, 4), MatD(0, 3), Map{}),
                               MatD::Zero(10, 3)),
            0.0);

  const Eigen::MatrixXf novalues = linattn::linear_attention(Q, K, Eigen::MatrixXf(20, 0), Map{});
  EXPECT_EQ(novalues.rows(), 10) << what;
  EXPECT_EQ(novalues.cols(), 0) << what;

  const Eigen::MatrixXf nothing =
      linattn::linear_attention(Eigen::MatrixXf(0, 4), Eigen::MatrixXf(0, 4), Eigen::MatrixXf(0, 3), Map{});
  EXPECT_EQ(nothing.rows(), 0) << what;
  EXPECT_EQ(nothing.cols(), 3) << what;
}

TEST(LinearAttentionEmpty, EveryMap) {
  check_empty<linattn::EluPlusOne>();
  check_empty<linattn::SoftmaxSplit>();
  check_empty<linattn::NormalizedCosine>();
}

// ---------------------------------------------------------------------------------------------
// Large inputs: magnitude 100 in float.
// ---------------------------------------------------------------------------------------------

// Measured (|V| <= 1): 3.6e-7 (SoftmaxSplit), 1.2e-7 (EluPlusOne); 89% of the EluPlusOne rows
// and 92% of the NormalizedCosine rows are compared (the others have a tiny denominator).
constexpr double kMagnitude100Float = 2e-6;

template <class Map>
void check_magnitude_100(bool match_all_rows, double min_fraction) {
  double worst = 0;
  Index compared = 0, total = 0;
  for (const test::Shape& sh : test::shapes()) {
    const Inputs in = make_inputs(sh, 400, 100.0, 1.0);
    Mat<float> Q = in.Q.cast<float>(), K = in.K.cast<float>();
    const Mat<float> V = in.V.cast<float>();
    if (sh.N > 2) {  // exact ±100 rows as well
      Q.row(0).setConstant(100.0f);
      Q.row(1).setConstant(-100.0f);
    }
    if (sh.L > 2) {
      K.row(0).setConstant(100.0f);
      K.row(1).setConstant(-100.0f);
    }
    const Mat<float> out = linattn::linear_attention(Q, K, V, Map{});
    EXPECT_TRUE(test::all_finite(out)) << map_name<Map>() << " " << sh;
    Eigen::VectorXd den;
    const MatD expected = ref::linear_attention(Q.cast<double>(), K.cast<double>(),
                                                V.cast<double>(), Map{}, &den);
    const auto rc = test::compare_well_conditioned_rows(out, expected, den, min_den<Map>(sh.L),
                                                        test::max_abs(V));
    EXPECT_LE(rc.max_err, test::bound<float>(kMagnitude100Float, 0, test::max_abs(V)))
        << map_name<Map>() << " " << sh;
    if (match_all_rows) {
      EXPECT_EQ(rc.skipped, 0) << map_name<Map>() << " " << sh;
    }
    worst = std::max(worst, rc.max_err);
    compared += rc.compared;
    total += sh.N;
  }
  test::RowComparison counted;
  counted.compared = compared;
  counted.skipped = total - compared;
  test::expect_enough_rows(counted, min_fraction,
                           std::string(map_name<Map>()) + " at magnitude 100 (the others have a "
                                                          "tiny denominator)");
  test::report_error(std::string("linear_attention/") + map_name<Map>() + "/float/magnitude_100",
                     worst);
}

TEST(LinearAttentionLargeInputs, SoftmaxSplitFloatMagnitude100) {
  check_magnitude_100<linattn::SoftmaxSplit>(true, 1.0);
}
TEST(LinearAttentionLargeInputs, NormalizedCosineFloatMagnitude100) {
  // (Near-)opposite keys give tiny denominators at any scale; those rows are not compared.
  check_magnitude_100<linattn::NormalizedCosine>(false, 0.85);
}
TEST(LinearAttentionLargeInputs, EluPlusOneFloatMagnitude100) {
  // e^{-100} underflows towards 0: rows whose every feature product underflows have a
  // denominator near ε and are only checked to be finite; the others must match.
  check_magnitude_100<linattn::EluPlusOne>(false, 0.8);
}

TEST(LinearAttentionLargeInputs, EluPlusOneUnderflowingDenominatorStaysFinite) {
  // Every query and key entry at -100 (φ = e^{-100}, ~3.7e-44 in float, a denormal or 0): the
  // denominators are far below ε. The guard must give finite values no larger than max |V|.
  const Eigen::MatrixXf Q = Eigen::MatrixXf::Constant(70, 3, -100.0f);
  const Eigen::MatrixXf K = Eigen::MatrixXf::Constant(300, 3, -100.0f);
  const Eigen::MatrixXf V = test::random_matrix<float>(300, 4, 5);
  const Eigen::MatrixXf out = linattn::linear_attention(Q, K, V, linattn::EluPlusOne{});
  EXPECT_TRUE(test::all_finite(out));
  EXPECT_LE(test::max_abs(out), test::max_abs(V));
  const Eigen::MatrixXd outd = linattn::linear_attention(Q.cast<double>(), K.cast<double>(),
                                                         V.cast<double>(), linattn::EluPlusOne{});
  EXPECT_TRUE(test::all_finite(outd));
}

// ---------------------------------------------------------------------------------------------
// NormalizedCosine with zero vectors (spec §2): x̂ = 0, so a zero query has similarity 1 with
// every key and gets the plain average of V; a zero key has similarity 1 with every query.
// ---------------------------------------------------------------------------------------------

TEST(LinearAttentionZeroVectors, NormalizedCosineZeroQueryAveragesV) {
  for (const bool dbl : {false, true}) {
    MatD Q = test::random_matrix<double>(40, 6, 501), K = test::random_matrix<double>(300, 6, 502);
    const MatD V = test::random_matrix<double>(300, 5, 503, -2, 2);
    Q.row(0).setZero();
    Q.row(17).setZero();
    K.row(3).setZero();
    K.row(299).setZero();
    const MatD out = dbl ? linattn::linear_attention(Q, K, V, linattn::NormalizedCosine{})
                         : MatD(linattn::linear_attention(Q.cast<float>().eval(), K.cast<float>().eval(),
                                                          V.cast<float>().eval(),
                                                          linattn::NormalizedCosine{})
                                    .cast<double>());
    const double tol = dbl ? 1e-12 : 1e-5;
    const Eigen::RowVectorXd mean = V.colwise().mean();
    EXPECT_LE(test::max_abs_diff(out.row(0), mean), tol);
    EXPECT_LE(test::max_abs_diff(out.row(17), mean), tol);
    const MatD expected = ref::linear_attention(Q, K, V, linattn::NormalizedCosine{});
    EXPECT_LE(test::max_abs_diff(expected.row(0), mean), 1e-13);
    EXPECT_LE(test::max_abs_diff(out, expected), dbl ? 1e-12 : 1e-4);
  }
}

TEST(LinearAttentionZeroVectors, NormalizedCosineIsScaleInvariant) {
  // sim(q, k) = 1 + cos(q, k) does not depend on the scale of q or k, down to tiny (the
  // squared norm underflows) and up to huge (it overflows) vectors.
  const Eigen::MatrixXf Q = test::random_matrix<float>(70, 5, 511), K = test::random_matrix<float>(90, 5, 512);
  const Eigen::MatrixXf V = test::random_matrix<float>(90, 3, 513);
  const Eigen::MatrixXf base = linattn::linear_attention(Q, K, V, linattn::NormalizedCosine{});
  for (const float scale : {1e-30f, 1e-20f, 1e-10f, 1e10f, 1e30f}) {
    const Eigen::MatrixXf Qs = Q * scale, Ks = K * scale;
    EXPECT_LE(test::max_abs_diff(linattn::linear_attention(Qs, K, V, linattn::NormalizedCosine{}), base), 1e-5)
        << "queries scaled by " << scale;
    EXPECT_LE(test::max_abs_diff(linattn::linear_attention(Q, Ks, V, linattn::NormalizedCosine{}), base), 1e-5)
        << "keys scaled by " << scale;
  }
}

// ---------------------------------------------------------------------------------------------
// NaN input: unspecified values, but no crash and no UB (linear_attention.hpp; ASan and UBSan
// watch this in .ci/test). What is specified still holds: the rows whose query is finite do not
// see a non-finite query of another row, and the Workspace carries nothing from a poisoned
// call into the next one.
// ---------------------------------------------------------------------------------------------

template <class Map>
void check_nan() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Eigen::MatrixXf Q0 = test::random_matrix<float>(300, 4, 601), K0 = test::random_matrix<float>(270, 4, 602);
  const Eigen::MatrixXf V0 = test::random_matrix<float>(270, 3, 603);
  const Eigen::MatrixXf clean = linattn::linear_attention(Q0, K0, V0, Map{});
  linattn::Workspace<float> ws;
  for (int which = 0; which < 4; ++which) {
    Eigen::MatrixXf Q = Q0, K = K0, V = V0;
    if (which == 0) Q(5, 2) = nan;
    if (which == 1) K(260, 1) = nan;
    if (which == 2) V(7, 0) = nan;
    if (which == 3) {
      Q.setConstant(nan);
      K.setConstant(std::numeric_limits<float>::infinity());
    }
    const std::string what = std::string(map_name<Map>()) + " case " + std::to_string(which);
    Eigen::MatrixXf out(300, 3);
    linattn::linear_attention(Q, K, V, Map{}, out, ws);
    if (which == 0) {  // only row 5's query is NaN: every other row is exact
      EXPECT_EQ(test::max_abs_diff(out.topRows(5), clean.topRows(5)), 0.0) << what;
      EXPECT_EQ(test::max_abs_diff(out.bottomRows(294), clean.bottomRows(294)), 0.0) << what;
    }
    linattn::linear_attention(Q0, K0, V0, Map{}, out, ws);
    EXPECT_EQ(test::max_abs_diff(out, clean), 0.0) << what << ": the next call with the same workspace";
  }
}

TEST(LinearAttentionNaN, OtherRowsAndLaterCallsAreExact) {
  check_nan<linattn::EluPlusOne>();
  check_nan<linattn::SoftmaxSplit>();
  check_nan<linattn::NormalizedCosine>();
}

#endif  // LINATTN_TEST_LAYOUT_PART

}  // namespace
