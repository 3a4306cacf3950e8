// Causal linear attention (spec §2-3): the chunked and recurrent algorithms against the naive
// O(N²) double reference, against each other, in pieces with a carried state, through the
// out + workspace overload, on Maps / blocks / row-major storage, the stability of causal
// SoftmaxSplit, argument checks, and the zero-allocation guarantee.
//
// This target is compiled with EIGEN_RUNTIME_NO_MALLOC (see tests/CMakeLists.txt). Eigen reports
// a forbidden heap allocation through eigen_assert, which Release builds (NDEBUG) compile away,
// so eigen_assert is redirected here, before any Eigen header, to a hook that records the
// failure in the running test. As a side effect every Eigen assertion (index bounds, shape
// checks of products) is active in this test, in every build type.
#include "eigen_assert_hook.hpp"  // first: before any Eigen header

#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "causal_reference.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace {

using linattn::CausalAlgorithm;
using linattn::CausalOptions;
using linattn::EluPlusOne;
using linattn::NormalizedCosine;
using linattn::SoftmaxSplit;
using cref::Relu;
using cref::algorithm_name;
using cref::options;
using test::Index;
using test::Mat;
using test::MatD;
using test::RowMat;
using test::expect_invalid;

const std::vector<Index> kChunkSizes = {1, 2, 3, 7, 16, 63, 64, 65, 100, 0};

// Rows whose reference denominator is below this are in (or near) the regime of the ε guard,
// where float and double legitimately differ (the guard is 1e-6 in float, 1e-12 in double):
// there only finiteness is checked. Only ReLU (no positive feature) and NormalizedCosine
// (keys opposite to the query) produce such rows, and few of them.
constexpr double kMinDen = 1e-2;

// Tolerance of these tests, times max(1, max |V|). test::tolerance (1e-4 in float) would let a
// wrong chunk boundary through on small shapes. The errors measured here (report_error lines;
// all maps, chunk sizes, algorithms and the adversarial SoftmaxSplit inputs, N <= 513) are at
// most 5.9e-7 in float (most below 3.6e-7) and 5.8e-15 in double (most below 8e-16): the bounds
// keep about 5x over the worst, for the other instruction sets of the native build.
template <class S>
double tight_tol(double scale = 1.0) {
  return test::bound<S>(3e-6, 3e-14, scale);
}

// max |a - b| over the rows whose reference denominator is >= kMinDen; +inf if any row of `a`
// is not finite. `skipped` counts the rows left out.
template <class DA>
double err_on_regular_rows(const Eigen::MatrixBase<DA>& a, const MatD& b, const ref::Vec& den,
                           Index* skipped = nullptr) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return std::numeric_limits<double>::infinity();
  if (!test::all_finite(a)) return std::numeric_limits<double>::infinity();
  double e = 0;
  for (Index i = 0; i < a.rows(); ++i) {
    if (den(i) < kMinDen) {
      if (skipped) ++*skipped;
      continue;
    }
    e = std::max(e, test::max_abs_diff(a.row(i), b.row(i)));
  }
  return e;
}

// Shapes of the reference comparisons: the shared causal shapes plus a few with N not a
// multiple of any chunk size and D != M.
std::vector<test::Shape> causal_shapes() {
  std::vector<test::Shape> s = test::causal_shapes();
  s.push_back({129, 129, 3, 11});
  s.push_back({191, 191, 12, 2});
  return s;
}

// ---------------------------------------------------------------------------------------------
// Reference comparison, chunked vs recurrent
// ---------------------------------------------------------------------------------------------

template <class S, class Map>
void check_against_reference(const Map& phi) {
  const std::string tag = std::string(cref::map_name<Map>()) + "/" + test::scalar_name<S>();
  double err_chunked = 0, err_recurrent = 0, err_between = 0;
  Index skipped = 0, rows = 0;
  for (const test::Shape& sh : causal_shapes()) {
    const Mat<S> Q = cref::qk_input<S, Map>(sh.N, sh.D, test::seed_of({sh.N, sh.D, sh.M, 1}));
    const Mat<S> K = cref::qk_input<S, Map>(sh.N, sh.D, test::seed_of({sh.N, sh.D, sh.M, 2}));
    const Mat<S> V = test::random_matrix<S>(sh.N, sh.M, test::seed_of({sh.N, sh.D, sh.M, 3}));
    ref::Vec den;
    const MatD expected = cref::causal(cref::to_double(Q), cref::to_double(K), cref::to_double(V), phi, &den);
    const double tol = tight_tol<S>(test::max_abs(V));
    rows += sh.N;
    Index shape_skipped = 0;

    const Mat<S> recurrent = linattn::causal_linear_attention(
        Q, K, V, phi, options(CausalAlgorithm::Recurrent, 0));
    const double er = err_on_regular_rows(recurrent, expected, den, &shape_skipped);
    EXPECT_LE(er, tol) << tag << " recurrent " << sh;
    err_recurrent = std::max(err_recurrent, er);
    skipped += shape_skipped;

    for (const Index chunk : kChunkSizes) {
      for (const CausalAlgorithm algo :
           {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent, CausalAlgorithm::Auto}) {
        const Mat<S> out = linattn::causal_linear_attention(Q, K, V, phi, options(algo, chunk));
        const double e = err_on_regular_rows(out, expected, den);
        EXPECT_LE(e, tol) << tag << " " << algorithm_name(algo) << " chunk_size=" << chunk << " "
                          << sh;
        if (algo == CausalAlgorithm::Recurrent) {
          // The recurrent form ignores the chunk size: identical results.
          EXPECT_EQ(test::max_abs_diff(out, recurrent), 0.0) << tag << " chunk_size=" << chunk;
          continue;
        }
        err_chunked = std::max(err_chunked, e);
        // Parallel == recurrent to rounding (both in S; the guard is the same).
        const double eb = err_on_regular_rows(out, recurrent.template cast<double>(), den);
        EXPECT_LE(eb, tol) << tag << " chunked vs recurrent, chunk_size=" << chunk << " "
                                 << sh;
        err_between = std::max(err_between, eb);
      }
    }
  }
  // The skipped rows (guard regime) must stay an exception, or the comparison means little.
  EXPECT_LE(skipped, rows / 50) << tag;
  test::report_error(tag + " chunked vs reference", err_chunked);
  test::report_error(tag + " recurrent vs reference", err_recurrent);
  test::report_error(tag + " chunked vs recurrent", err_between);
}

TEST(causal, EluPlusOneMatchesReference) {
  IF_FLOAT(check_against_reference<float>(EluPlusOne{}));
  IF_DOUBLE(check_against_reference<double>(EluPlusOne{}));
}
TEST(causal, SoftmaxSplitMatchesReference) {
  IF_FLOAT(check_against_reference<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_against_reference<double>(SoftmaxSplit{}));
}
TEST(causal, NormalizedCosineMatchesReference) {
  IF_FLOAT(check_against_reference<float>(NormalizedCosine{}));
  IF_DOUBLE(check_against_reference<double>(NormalizedCosine{}));
}
TEST(causal, UserReluMapMatchesReference) {
  IF_FLOAT(check_against_reference<float>(Relu{}));
  IF_DOUBLE(check_against_reference<double>(Relu{}));
}

// The defaults: EluPlusOne, CausalOptions{} (Auto; the library picks the algorithm), which
// agrees with the explicit chunked and recurrent forms to rounding.
TEST(causal, DefaultsAreEluPlusOneAuto) {
  const Mat<float> Q = test::random_matrix<float>(77, 6, 11), K = test::random_matrix<float>(77, 6, 12);
  const Mat<float> V = test::random_matrix<float>(77, 4, 13);
  const Mat<float> a = linattn::causal_linear_attention(Q, K, V);
  const Mat<float> b = linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, CausalOptions{});
  EXPECT_EQ(test::max_abs_diff(a, b), 0.0);
  for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent})
    EXPECT_LE(test::max_abs_diff(a, linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, options(algo, 0))),
              tight_tol<float>())
        << algorithm_name(algo);
}

// ---------------------------------------------------------------------------------------------
// N = 1, N = 0
// ---------------------------------------------------------------------------------------------

template <class S, class Map>
void check_tiny(const Map& phi) {
  const std::string tag = std::string(cref::map_name<Map>()) + "/" + test::scalar_name<S>();
  for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
    // N = 1: the only key is the query's own, so the output is v_0 (for any map whose
    // similarity is > 0 there).
    const Mat<S> Q = cref::qk_input<S, Map>(1, 5, 21) + Mat<S>::Constant(1, 5, S(1));
    const Mat<S> K = Q;
    const Mat<S> V = test::random_matrix<S>(1, 3, 23);
    const Mat<S> out = linattn::causal_linear_attention(Q, K, V, phi, options(algo, 0));
    ASSERT_EQ(out.rows(), 1);
    ASSERT_EQ(out.cols(), 3);
    EXPECT_LE(test::max_abs_diff(out, V), tight_tol<S>()) << tag;

    // N = 0: an empty result, and the carried state is unchanged (sized, zero).
    const Mat<S> Q0(0, 5), K0(0, 5), V0(0, 3);
    const Mat<S> out0 = linattn::causal_linear_attention(Q0, K0, V0, phi, options(algo, 7));
    EXPECT_EQ(out0.rows(), 0) << tag;
    EXPECT_EQ(out0.cols(), 3) << tag;
    linattn::LinearAttentionState<S> st;
    const Mat<S> out1 = linattn::causal_linear_attention(Q0, K0, V0, phi, st, options(algo, 7));
    EXPECT_EQ(out1.size(), 0);
    EXPECT_EQ(st.S.rows(), phi.feature_dim(5));
    EXPECT_EQ(st.S.cols(), 3);
    EXPECT_EQ(test::max_abs(st.S), 0.0);
    EXPECT_EQ(test::max_abs(st.z), 0.0);
  }
}

TEST(causal, SingleTokenAndEmptySequence) {
  test::for_each_map_scalar<EluPlusOne, SoftmaxSplit, NormalizedCosine, Relu>(
      [](auto phi, auto s) { check_tiny<typename decltype(s)::type>(phi); });
}

// ---------------------------------------------------------------------------------------------
// Pieces with a carried state == one shot
// ---------------------------------------------------------------------------------------------

template <class S, class Map>
void check_pieces(const Map& phi) {
  const std::string tag = std::string(cref::map_name<Map>()) + "/" + test::scalar_name<S>();
  const Index N = 300, D = 7, M = 5;
  const Mat<S> Q = cref::qk_input<S, Map>(N, D, 31), K = cref::qk_input<S, Map>(N, D, 32);
  const Mat<S> V = test::random_matrix<S>(N, M, 33);
  ref::Vec den;
  const MatD expected = cref::causal(cref::to_double(Q), cref::to_double(K), cref::to_double(V), phi, &den);
  // The comparisons below skip the rows in the guard regime: they must stay an exception.
  EXPECT_LE((den.array() < kMinDen).count(), N / 50) << tag << ": rows in the guard regime";
  // Cut points: empty pieces, single tokens, chunk boundaries and off-boundary cuts.
  const std::vector<std::vector<Index>> cuts = {
      {0, 0, 1, 2, 5, 64, 64, 100, 163, 299, 300},
      {0, 150, 300},
      {0, 63, 127, 191, 255, 300},
      {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 300},
  };
  double worst = 0;
  for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
    for (const Index chunk : {Index(0), Index(7), Index(64)}) {
      const CausalOptions opts = options(algo, chunk);
      const Mat<S> one_shot = linattn::causal_linear_attention(Q, K, V, phi, opts);
      for (const auto& cut : cuts) {
        linattn::LinearAttentionState<S> state;  // empty: sized by the first call
        Mat<S> joined(N, M);
        for (std::size_t p = 0; p + 1 < cut.size(); ++p) {
          const Index r0 = cut[p], n = cut[p + 1] - cut[p];
          joined.middleRows(r0, n) = linattn::causal_linear_attention(
              Q.middleRows(r0, n), K.middleRows(r0, n), V.middleRows(r0, n), phi, state, opts);
        }
        const double e = err_on_regular_rows(joined, one_shot.template cast<double>(), den);
        EXPECT_LE(e, tight_tol<S>()) << tag << " " << algorithm_name(algo)
                                                  << " chunk=" << chunk << " pieces=" << cut.size() - 1;
        EXPECT_LE(err_on_regular_rows(joined, expected, den), tight_tol<S>()) << tag;
        worst = std::max(worst, e);
      }
    }
  }
  test::report_error(tag + " pieces vs one shot", worst);
}

TEST(causal, PiecesWithCarriedStateEqualOneShot) {
  test::for_each_map_scalar<EluPlusOne, SoftmaxSplit, NormalizedCosine, Relu>(
      [](auto phi, auto s) { check_pieces<typename decltype(s)::type>(phi); });
}

// The state after a call holds the sums of spec §1: S = Σ φ(k_j) v_jᵀ and z = Σ φ(k_j)
// (for SoftmaxSplit shifted by the running maxima: diag(e^m) S = Σ e^{k_j} v_jᵀ, m = max_j k_j).
TEST(causal, FinalStateHoldsTheSums) {
  const Index N = 150, D = 6, M = 4;
  const MatD Q = test::random_matrix(N, D, 41), K = test::random_matrix(N, D, 42);
  const MatD V = test::random_matrix(N, M, 43);
  for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
    {
      linattn::LinearAttentionState<double> st;
      linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, st, options(algo, 16));
      const MatD PK = ref::elu_plus_one_features(K);
      EXPECT_LE(test::max_abs_diff(st.S, PK.transpose() * V), 1e-11);
      EXPECT_LE(test::max_abs_diff(st.z, PK.colwise().sum().transpose()), 1e-11);
      EXPECT_EQ(st.m.size(), 0);
    }
    {
      linattn::LinearAttentionState<double> st;
      linattn::causal_linear_attention(Q, K, V, SoftmaxSplit{}, st, options(algo, 16));
      const Eigen::VectorXd m = K.colwise().maxCoeff().transpose();
      EXPECT_LE(test::max_abs_diff(st.m, m), 0.0);
      const MatD E = (K.rowwise() - m.transpose()).array().exp().matrix();
      EXPECT_LE(test::max_abs_diff(st.S, E.transpose() * V), 1e-11);
      EXPECT_LE(test::max_abs_diff(st.z, E.colwise().sum().transpose()), 1e-11);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Out + workspace overload, layouts
// ---------------------------------------------------------------------------------------------

template <class S, class Map>
void check_layouts(const Map& phi) {
  const std::string tag = std::string(cref::map_name<Map>()) + "/" + test::scalar_name<S>();
  const Index N = 203, D = 9, M = 6;
  const Mat<S> Q = cref::qk_input<S, Map>(N, D, 51), K = cref::qk_input<S, Map>(N, D, 52);
  const Mat<S> V = test::random_matrix<S>(N, M, 53);
  for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
    const CausalOptions opts = options(algo, 16);
    const Mat<S> expected = linattn::causal_linear_attention(Q, K, V, phi, opts);
    const double tol = tight_tol<S>();

    // Row-major inputs, a block of a larger matrix, a Map over a buffer.
    const RowMat<S> Qr = Q;
    Mat<S> big = test::random_matrix<S>(N + 5, D + 4, 54);
    big.block(3, 2, N, D) = K;
    std::vector<S> vbuf(static_cast<std::size_t>(N * M));
    Eigen::Map<Mat<S>> Vm(vbuf.data(), N, M);
    Vm = V;
    {
      const Mat<S> out = linattn::causal_linear_attention(Qr, big.block(3, 2, N, D), Vm, phi, opts);
      EXPECT_LE(test::max_abs_diff(out, expected), tol) << tag << " row-major/block/Map inputs";
    }
    // Inputs that are expressions (evaluated by the kernel).
    {
      const Mat<S> out = linattn::causal_linear_attention(Q * S(1), (K.array() + S(0)).matrix(),
                                                          V.transpose().transpose(), phi, opts);
      EXPECT_LE(test::max_abs_diff(out, expected), tol) << tag << " expression inputs";
    }

    // Output into a block of a larger matrix: the rest is untouched.
    {
      linattn::LinearAttentionState<S> st;
      linattn::Workspace<S> ws;
      Mat<S> canvas = Mat<S>::Constant(N + 4, M + 3, S(-7));
      linattn::causal_linear_attention(Q, K, V, phi, st, canvas.block(1, 2, N, M), ws, opts);
      EXPECT_LE(test::max_abs_diff(canvas.block(1, 2, N, M), expected), tol) << tag << " block out";
      Mat<S> rest = canvas;
      rest.block(1, 2, N, M).setConstant(S(-7));
      EXPECT_EQ(test::max_abs_diff(rest, Mat<S>::Constant(N + 4, M + 3, S(-7))), 0.0)
          << tag << " writes outside the output block";
    }
    // Output into a row-major Map over a buffer, inputs row-major too, in two pieces.
    {
      linattn::LinearAttentionState<S> st;
      linattn::Workspace<S> ws;
      std::vector<S> obuf(static_cast<std::size_t>(N * M), S(0));
      Eigen::Map<RowMat<S>> out(obuf.data(), N, M);
      const RowMat<S> Kr = K, Vr = V;
      const Index cut = 77;
      linattn::causal_linear_attention(Qr.topRows(cut), Kr.topRows(cut), Vr.topRows(cut), phi, st,
                                       out.topRows(cut), ws, opts);
      linattn::causal_linear_attention(Qr.bottomRows(N - cut), Kr.bottomRows(N - cut),
                                       Vr.bottomRows(N - cut), phi, st, out.bottomRows(N - cut),
                                       ws, opts);
      EXPECT_LE(test::max_abs_diff(out, expected), tol) << tag << " row-major Map out, pieces";
    }
    // Row-major values and output that are column blocks of wider matrices (one head of a
    // packed row-major multi-head layout): rows a whole packed row apart, read and written in
    // place by the recurrent kernel. Columns outside the output block stay untouched.
    {
      linattn::LinearAttentionState<S> st;
      linattn::Workspace<S> ws;
      RowMat<S> Vwide = test::random_matrix<S>(N, 3 * M + 1, 55);
      Vwide.middleCols(M + 1, M) = V;
      RowMat<S> canvas = RowMat<S>::Constant(N, 2 * M + 3, S(-7));
      linattn::causal_linear_attention(Q, K, Vwide.middleCols(M + 1, M), phi, st,
                                       canvas.middleCols(M, M), ws, opts);
      EXPECT_LE(test::max_abs_diff(canvas.middleCols(M, M), expected), tol)
          << tag << " row-major column blocks";
      canvas.middleCols(M, M).setConstant(S(-7));
      EXPECT_EQ(test::max_abs_diff(canvas, RowMat<S>::Constant(N, 2 * M + 3, S(-7))), 0.0)
          << tag << " writes outside the row-major output block";
    }
  }
}

TEST(causal, LayoutsAndOutputOverload) {
  IF_FLOAT(check_layouts<float>(EluPlusOne{}));
  IF_DOUBLE(check_layouts<double>(EluPlusOne{}));
  IF_FLOAT(check_layouts<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_layouts<double>(SoftmaxSplit{}));
  IF_FLOAT(check_layouts<float>(NormalizedCosine{}));
  IF_FLOAT(check_layouts<float>(Relu{}));
}

// ---------------------------------------------------------------------------------------------
// Causal SoftmaxSplit at magnitude 100
// ---------------------------------------------------------------------------------------------

// Runs every algorithm and chunk size on (Q, K, V) against the double reference of the same
// (rounded) inputs; returns the worst error.
template <class S>
double check_softmax_split_stable(const Mat<S>& Q, const Mat<S>& K, const Mat<S>& V,
                                  const std::string& what) {
  const MatD expected = ref::causal_linear_attention(cref::to_double(Q), cref::to_double(K),
                                                     cref::to_double(V), SoftmaxSplit{});
  const double tol = tight_tol<S>(test::max_abs(V));
  double worst = 0;
  for (const Index chunk : kChunkSizes) {
    for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
      const Mat<S> out = linattn::causal_linear_attention(Q, K, V, SoftmaxSplit{}, options(algo, chunk));
      EXPECT_TRUE(test::all_finite(out)) << what << " " << algorithm_name(algo) << " chunk=" << chunk;
      const double e = test::max_abs_diff(out, expected);
      EXPECT_LE(e, tol) << what << " " << algorithm_name(algo) << " chunk=" << chunk;
      worst = std::max(worst, e);
    }
    // And in two pieces with a carried state (the cut lands inside chunks).
    linattn::LinearAttentionState<S> st;
    const Index cut = Q.rows() / 3;
    Mat<S> out(Q.rows(), V.cols());
    out.topRows(cut) = linattn::causal_linear_attention(Q.topRows(cut), K.topRows(cut), V.topRows(cut),
                                                        SoftmaxSplit{}, st, options(CausalAlgorithm::Chunked, chunk));
    const Index rest = Q.rows() - cut;
    out.bottomRows(rest) = linattn::causal_linear_attention(
        Q.bottomRows(rest), K.bottomRows(rest), V.bottomRows(rest), SoftmaxSplit{}, st,
        options(CausalAlgorithm::Chunked, chunk));
    const double e = test::max_abs_diff(out, expected);
    EXPECT_LE(e, tol) << what << " pieces chunk=" << chunk;
    worst = std::max(worst, e);
  }
  test::report_error(what + " (" + test::scalar_name<S>() + ")", worst);
  return worst;
}

template <class S>
void softmax_split_magnitude_100() {
  const Index N = 300, D = 8, M = 5;
  const Mat<S> V = test::random_matrix<S>(N, M, 63);
  // Uniform in [-100, 100].
  check_softmax_split_stable<S>(test::random_matrix<S>(N, D, 61, -100, 100),
                                test::random_matrix<S>(N, D, 62, -100, 100), V, "uniform +-100");
  // Large positive offsets: naive exp overflows in float at 88.
  check_softmax_split_stable<S>(test::random_matrix<S>(N, D, 64, 90, 110),
                                test::random_matrix<S>(N, D, 65, 90, 110), V, "uniform 90..110");
  check_softmax_split_stable<S>(test::random_matrix<S>(N, D, 66, -110, -90),
                                test::random_matrix<S>(N, D, 67, -110, -90), V, "uniform -110..-90");
}

TEST(causal, SoftmaxSplitStableAtMagnitude100) {
  IF_FLOAT(softmax_split_magnitude_100<float>());
  IF_DOUBLE(softmax_split_magnitude_100<double>());
}

// Keys whose running maximum jumps by 100+ inside a chunk (the chunked kernel redoes such a
// chunk token by token), ramps up and down of several slopes (a slope s over a chunk of C rows
// moves the maximum by s·C: 0.3·64 stays on the chunk path, 3·64 and 6·64 do not), and keys
// that decrease strongly (the first key of each feature dominates for a long time).
template <class S>
void softmax_split_adversarial() {
  const Index N = 260, D = 6, M = 4;
  const Mat<S> V = test::random_matrix<S>(N, M, 73);
  const Mat<S> Q = test::random_matrix<S>(N, D, 71, -100, 100);
  {
    Mat<S> K = test::random_matrix<S>(N, D, 72);
    // Jumps at rows that are not chunk boundaries, different features, and back down.
    K(10, 0) = S(120);
    K(40, 1) = S(130);
    K(41, 1) = S(-100);
    K(100, 0) = S(260);   // +140 over the previous maximum of feature 0
    K(101, 0) = S(-260);  // then a huge drop
    K(150, 2) = S(105);
    for (Index j = 151; j < N; ++j) K(j, 2) = S(-100);
    K(200, 3) = S(300);
    K(201, 3) = S(-300);
    check_softmax_split_stable<S>(Q, K, V, "max jumps by 100+ inside a chunk");
  }
  for (const double slope : {0.3, 0.6, 1.0, 3.0, 6.0, -0.6, -3.0}) {
    Mat<S> K(N, D);
    const Mat<S> noise = test::random_matrix<S>(N, D, 74);
    for (Index j = 0; j < N; ++j)
      for (Index d = 0; d < D; ++d)
        K(j, d) = static_cast<S>(slope * static_cast<double>(j) * (1.0 + 0.1 * static_cast<double>(d)) -
                                 (slope > 0 ? 100.0 : -100.0) + static_cast<double>(noise(j, d)));
    check_softmax_split_stable<S>(Q, K, V, "ramp slope " + std::to_string(slope));
  }
  {
    // Strongly decreasing with bursts: each feature starts at +100 and falls by 7 per row, with
    // a late key back at the start value (it must be weighted like the first again).
    Mat<S> K(N, D);
    for (Index j = 0; j < N; ++j)
      for (Index d = 0; d < D; ++d) K(j, d) = static_cast<S>(100.0 - 7.0 * static_cast<double>((j + 13 * d) % 80));
    check_softmax_split_stable<S>(Q, K, V, "decreasing saw-tooth");
  }
}

TEST(causal, SoftmaxSplitAdversarialKeys) {
  IF_FLOAT(softmax_split_adversarial<float>());
  IF_DOUBLE(softmax_split_adversarial<double>());
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

TEST(causal, ErrorsThrowInvalidArgument) {
  const Mat<float> Q = test::random_matrix<float>(10, 4, 81), K = test::random_matrix<float>(10, 4, 82);
  const Mat<float> V = test::random_matrix<float>(10, 3, 83);
  const std::string fn = "linattn::causal_linear_attention";
  expect_invalid([&] { linattn::causal_linear_attention(Q, K.topRows(9), V.topRows(9)); }, fn, "N != L");
  expect_invalid([&] { linattn::causal_linear_attention(Q, K, V.topRows(9)); }, fn, "K and V rows");
  expect_invalid([&] { linattn::causal_linear_attention(Q, K.leftCols(3), V); }, fn, "D mismatch");
  expect_invalid([&] { linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, options(CausalAlgorithm::Chunked, -1)); },
                 fn, "negative chunk_size");
  expect_invalid([&] { linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, options(CausalAlgorithm::Recurrent, -5)); },
                 fn, "negative chunk_size (recurrent)");
  expect_invalid([&] { linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, options(CausalAlgorithm::Chunked, -1)); },
                 "chunk_size", "negative chunk_size message");
  {
    auto st = linattn::make_state<float>(EluPlusOne{}, 5, 3);  // F = 5, the input has D = 4
    expect_invalid([&] { linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, st); }, fn, "state F");
  }
  {
    auto st = linattn::make_state<float>(EluPlusOne{}, 4, 2);  // M = 2, V has 3 columns
    expect_invalid([&] { linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, st); }, fn, "state M");
  }
  {
    auto st = linattn::make_state<float>(SoftmaxSplit{}, 4, 3);  // has running maxima
    expect_invalid([&] { linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, st); }, fn,
                   "SoftmaxSplit state for EluPlusOne");
    auto st2 = linattn::make_state<float>(EluPlusOne{}, 4, 3);  // lacks them
    expect_invalid([&] { linattn::causal_linear_attention(Q, K, V, SoftmaxSplit{}, st2); }, fn,
                   "EluPlusOne state for SoftmaxSplit");
  }
  {
    auto st = linattn::make_state<float>(NormalizedCosine{}, 4, 3);  // F = D + 1
    Mat<float> out(10, 3);
    linattn::Workspace<float> ws;
    EXPECT_NO_THROW(linattn::causal_linear_attention(Q, K, V, NormalizedCosine{}, st, out, ws));
    auto wrong = linattn::make_state<float>(EluPlusOne{}, 4, 3);  // F = D
    expect_invalid([&] { linattn::causal_linear_attention(Q, K, V, NormalizedCosine{}, wrong, out, ws); },
                   fn, "state F for NormalizedCosine");
    Mat<float> bad_out(10, 4);
    expect_invalid([&] { linattn::causal_linear_attention(Q, K, V, NormalizedCosine{}, st, bad_out, ws); },
                   fn, "output shape");
  }
  // D = 0
  expect_invalid([&] { linattn::causal_linear_attention(Mat<float>(3, 0), Mat<float>(3, 0), Mat<float>(3, 2)); },
                 fn, "D = 0");
}

// ---------------------------------------------------------------------------------------------
// Zero allocation
// ---------------------------------------------------------------------------------------------

// The detector itself works in this build (EIGEN_RUNTIME_NO_MALLOC + the eigen_assert hook).
TEST(causal, NoMallocDetectorWorks) { eigen_hook::expect_detector_works(); }

template <class S, class Map>
void check_no_malloc(const Map& phi, const Mat<S>& Q, const Mat<S>& K, const Mat<S>& V,
                     const Mat<S>& Q2, const Mat<S>& K2, const Mat<S>& V2, const std::string& what) {
  const std::string tag = std::string(cref::map_name<Map>()) + "/" + test::scalar_name<S>() + " " + what;
  const Index N = Q.rows(), D = Q.cols(), M = V.cols();
  for (const Index chunk : {Index(0), Index(7), Index(100)}) {
    for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
      auto state = linattn::make_state<S>(phi, D, M);
      Mat<S> out(N, M);
      linattn::Workspace<S> ws;
      const CausalOptions opts = options(algo, chunk);
      linattn::causal_linear_attention(Q, K, V, phi, state, out, ws, opts);  // sizes ws
      const Mat<S> first = out;
      int failures = 0;
      {
        NoMallocScope scope;
        linattn::causal_linear_attention(Q2, K2, V2, phi, state, out, ws, opts);  // continues
        state.reset();
        linattn::causal_linear_attention(Q, K, V, phi, state, out, ws, opts);  // from zero again
        failures = scope.failures();
      }
      EXPECT_EQ(failures, 0) << tag << " " << algorithm_name(algo) << " chunk=" << chunk
                             << ": the out + workspace overload allocated";
      EXPECT_EQ(test::max_abs_diff(out, first), 0.0) << tag << " repeat after reset()";
    }
  }
}

template <class S, class Map>
void check_no_malloc_random(const Map& phi) {
  const Index N = 300, D = 16, M = 8;
  const Mat<S> Q = cref::qk_input<S, Map>(N, D, 91), K = cref::qk_input<S, Map>(N, D, 92);
  const Mat<S> V = test::random_matrix<S>(N, M, 93);
  const Mat<S> Q2 = cref::qk_input<S, Map>(N, D, 94), K2 = cref::qk_input<S, Map>(N, D, 95);
  const Mat<S> V2 = test::random_matrix<S>(N, M, 96);
  check_no_malloc<S>(phi, Q, K, V, Q2, K2, V2, "random");
}

TEST(causal_no_malloc, SecondCallOfOutWorkspaceOverloadAllocatesNothing) {
  IF_FLOAT(check_no_malloc_random<float>(EluPlusOne{}));
  IF_DOUBLE(check_no_malloc_random<double>(EluPlusOne{}));
  IF_FLOAT(check_no_malloc_random<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_no_malloc_random<double>(SoftmaxSplit{}));
  IF_FLOAT(check_no_malloc_random<float>(NormalizedCosine{}));
  IF_DOUBLE(check_no_malloc_random<double>(NormalizedCosine{}));
  IF_FLOAT(check_no_malloc_random<float>(Relu{}));
}

// Keys ramping up by 3 per row: every chunk of causal SoftmaxSplit falls back to the token path.
template <class S>
Mat<S> ramp_keys(Index N, Index D) {
  Mat<S> K(N, D);
  for (Index j = 0; j < N; ++j)
    for (Index d = 0; d < D; ++d) K(j, d) = static_cast<S>(-100.0 + 3.0 * static_cast<double>(j) + 0.1 * d);
  return K;
}

// SoftmaxSplit's chunked kernel takes a data-dependent path (a chunk where a key maximum jumps
// is redone token by token). Same shapes, different data: the second call must still not
// allocate, whichever path the first call took (Workspace: "later calls of the same or smaller
// shapes allocate nothing").
TEST(causal_no_malloc, SoftmaxSplitFallbackPathAllocatesNothing) {
  const Index N = 300, D = 16, M = 8;
  const Mat<float> Q = test::random_matrix<float>(N, D, 97);
  const Mat<float> V = test::random_matrix<float>(N, M, 98);
  const Mat<float> benign = test::random_matrix<float>(N, D, 99);
  const Mat<float> ramp = ramp_keys<float>(N, D);
  // Warm up on the benign path, then take the fallback path; and the other way round.
  IF_FLOAT(check_no_malloc<float>(SoftmaxSplit{}, Q, benign, V, Q, ramp, V, "benign then ramp"));
  IF_FLOAT(check_no_malloc<float>(SoftmaxSplit{}, Q, ramp, V, Q, benign, V, "ramp then benign"));
}

}  // namespace
