// Inputs at the edges of the floating-point range, in the kernels users run:
//   - causal EluPlusOne and NormalizedCosine at magnitude 100 (finite, and equal to the double
//     reference on the well-conditioned rows);
//   - non-finite inputs (NaN or inf in one row of Q, K or V) in the causal kernels (chunked and
//     recurrent) and the multi-head kernels: the documented behaviour is "no crash, no UB,
//     outputs unspecified", so these tests run under ASan+UBSan in .ci/test, and check that the
//     rows that cannot see the non-finite row (causal: the rows before it; multi-head: the
//     other heads) are still exact;
//   - subnormal (denormal) inputs in every kernel, against the double reference.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <algorithm>
#include <limits>
#include <type_traits>
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
using cref::algorithm_name;
using cref::options;
using test::Index;
using test::Mat;
using test::MatD;

// max |out - expected| over the rows whose reference denominator is at least min_den (the
// others only have to be finite); the counts go to `rc`.
template <class S>
test::RowComparison compare_rows(const Mat<S>& out, const MatD& expected, const ref::Vec& den,
                                 double min_den) {
  return test::compare_well_conditioned_rows(out, expected, den, min_den,
                                             std::numeric_limits<double>::infinity());
}

// ---------------------------------------------------------------------------------------------
// Causal EluPlusOne and NormalizedCosine at magnitude 100
// ---------------------------------------------------------------------------------------------

// EluPlusOne's features reach 101 and underflow to 0 (e^{-100}); NormalizedCosine is scale
// invariant, so at 100 it must give what it gives at 1. Every algorithm and a few chunk sizes,
// in float (the type that overflows first).
template <class Map>
void causal_magnitude_100(double bound, double min_fraction) {
  const std::string tag = std::string(cref::map_name<Map>()) + " causal magnitude 100";
  test::RowComparison all;
  for (const test::Shape& sh : {test::Shape{300, 300, 8, 5}, test::Shape{129, 129, 3, 11},
                                test::Shape{65, 65, 16, 16}, test::Shape{100, 100, 1, 1}}) {
    Mat<float> Q = test::random_matrix<float>(sh.N, sh.D, test::seed_of({sh.N, sh.D, 1}), -100, 100);
    Mat<float> K = test::random_matrix<float>(sh.N, sh.D, test::seed_of({sh.N, sh.D, 2}), -100, 100);
    const Mat<float> V = test::random_matrix<float>(sh.N, sh.M, test::seed_of({sh.N, sh.M, 3}));
    Q.row(sh.N / 2).setConstant(100.0f);  // exact ±100 rows as well
    K.row(sh.N / 3).setConstant(-100.0f);
    ref::Vec den;
    const MatD expected =
        cref::causal(cref::to_double(Q), cref::to_double(K), cref::to_double(V), Map{}, &den);
    // The ε of the guard, relative to the size of the denominators at this scale.
    const double min_den = 1e-2;
    for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
      for (const Index chunk : {Index(0), Index(7), Index(64)}) {
        const Mat<float> out = linattn::causal_linear_attention(Q, K, V, Map{}, options(algo, chunk));
        EXPECT_TRUE(test::all_finite(out)) << tag << " " << algorithm_name(algo) << " " << sh;
        const test::RowComparison rc = compare_rows(out, expected, den, min_den);
        EXPECT_LE(rc.max_err, bound) << tag << " " << algorithm_name(algo) << " chunk=" << chunk
                                     << " " << sh;
        all += rc;
      }
    }
  }
  test::expect_enough_rows(all, min_fraction, tag);
  test::report_error(tag, all.max_err);
}

// Measured: 1.5e-7 (EluPlusOne; 90% of the rows compared: with D = 1 half of the queries are
// below -1, where e^q leaves denominators in the guard regime) and 1.8e-7 (NormalizedCosine,
// every row compared).
TEST(Robustness, CausalEluPlusOneMagnitude100) { causal_magnitude_100<EluPlusOne>(1e-6, 0.85); }
TEST(Robustness, CausalNormalizedCosineMagnitude100) {
  causal_magnitude_100<NormalizedCosine>(1e-6, 0.99);
}

// ---------------------------------------------------------------------------------------------
// Non-finite inputs
// ---------------------------------------------------------------------------------------------

enum class Where { Q, K, V };
const char* where_name(Where w) { return w == Where::Q ? "Q" : w == Where::K ? "K" : "V"; }

struct Poison {
  Where where;
  float value;
  const char* name;
};

std::vector<Poison> poisons() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<Poison> list;
  for (const Where w : {Where::Q, Where::K, Where::V}) {
    list.push_back({w, nan, "NaN"});
    list.push_back({w, inf, "+inf"});
    list.push_back({w, -inf, "-inf"});
  }
  return list;
}

// One entry of row p of Q, K or V made non-finite. The rows before p cannot see it (causal):
// they must equal the clean run, and the double reference. Rows from p on are unspecified.
//
// Known library bugs (reported; `strict` = false works around them, checking only the rows of
// the earlier chunks): (1) the chunked kernel's tril(A)·V_R product (Eigen's triangular
// product) multiplies the zeros above the diagonal with v_p, and 0·NaN = 0·inf = NaN, so a
// non-finite value row reaches the rows of its chunk before it, for every map; (2) causal
// SoftmaxSplit, chunked, with a +inf key: the rows of its chunk before it are not finite.
// Robustness.DISABLED_CausalChunkedNonFiniteStaysInItsRow checks the strict rule.
template <class Map>
void causal_non_finite(bool strict = false) {
  const Index N = 200, D = 6, M = 4;
  const Mat<float> Q0 = test::random_matrix<float>(N, D, 31), K0 = test::random_matrix<float>(N, D, 32);
  const Mat<float> V0 = test::random_matrix<float>(N, M, 33);
  const MatD expected = cref::causal(cref::to_double(Q0), cref::to_double(K0), cref::to_double(V0), Map{});
  for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
    for (const Index chunk : {Index(0), Index(16), Index(64)}) {
      const CausalOptions opts = options(algo, chunk);
      const Mat<float> clean = linattn::causal_linear_attention(Q0, K0, V0, Map{}, opts);
      for (const Poison& poison : poisons()) {
        // p = 130: inside a chunk for every chunk size above (not its first row).
        for (const Index p : {Index(0), Index(130), N - 1}) {
          Mat<float> Q = Q0, K = K0, V = V0;
          (poison.where == Where::Q ? Q : poison.where == Where::K ? K : V)(p, 1) = poison.value;
          const Mat<float> out = linattn::causal_linear_attention(Q, K, V, Map{}, opts);
          const std::string what = std::string(cref::map_name<Map>()) + " " + algorithm_name(algo) +
                                   " chunk=" + std::to_string(chunk) + " " + poison.name + " in " +
                                   where_name(poison.where) + " row " + std::to_string(p);
          ASSERT_EQ(out.rows(), N) << what;
          Index exact = p;  // rows [0, exact) must be exact
          const bool known_bug =
              algo == CausalAlgorithm::Chunked &&
              (poison.where == Where::V ||
               (std::is_same_v<Map, SoftmaxSplit> && poison.where == Where::K));
          if (!strict && known_bug) {
            const Index C = chunk > 0 ? chunk : 48;  // 48: the documented default chunk size
            exact = p / C * C;
          }
          EXPECT_EQ(test::max_abs_diff(out.topRows(exact), clean.topRows(exact)), 0.0) << what;
          EXPECT_LE(test::max_abs_diff(out.topRows(exact), expected.topRows(exact)), 3e-6) << what;
          // The row's own inputs are finite after p for Q: those rows see only finite keys.
          if (poison.where == Where::Q && p + 1 < N) {
            EXPECT_EQ(test::max_abs_diff(out.bottomRows(N - p - 1), clean.bottomRows(N - p - 1)), 0.0)
                << what << " (rows after a non-finite query)";
          }
        }
      }
    }
  }
}

TEST(Robustness, CausalNonFiniteEluPlusOne) { causal_non_finite<EluPlusOne>(); }
TEST(Robustness, CausalNonFiniteNormalizedCosine) { causal_non_finite<NormalizedCosine>(); }
TEST(Robustness, CausalNonFiniteSoftmaxSplit) { causal_non_finite<SoftmaxSplit>(); }
// Fails today (the library bug above); enable once the chunked kernel keeps v_p out of the
// rows before p.
TEST(Robustness, DISABLED_CausalChunkedNonFiniteStaysInItsRow) {
  causal_non_finite<EluPlusOne>(true);
  causal_non_finite<SoftmaxSplit>(true);
}

// Multi-head: a non-finite entry in one head's columns leaves the other heads exact; causal,
// also that head's rows before it. Known library bug (reported; skipped unless `strict`): the
// tiled causal softmax multiplies the masked (zero) weights with v_p, so a non-finite value
// row reaches the rows of its tile before it.
void multihead_non_finite(bool strict) {
  const Index N = 150, H = 3, D = 5, M = 4, bad_head = 1, p = 70;
  const Mat<float> Q0 = test::random_matrix<float>(N, H * D, 41);
  const Mat<float> K0 = test::random_matrix<float>(N, H * D, 42);
  const Mat<float> V0 = test::random_matrix<float>(N, H * M, 43);
  linattn::MultiHeadWorkspace<float> ws;
  linattn::ParallelOptions par;
  par.num_threads = 2;
  for (const bool causal : {false, true}) {
    for (const bool softmax : {false, true}) {
      const auto run = [&](const Mat<float>& Q, const Mat<float>& K, const Mat<float>& V) {
        Mat<float> out(N, H * M);
        if (softmax && causal)
          linattn::multihead_causal_softmax_attention(Q, K, V, H, out, ws,
                                                      linattn::SoftmaxAlgorithm::Tiled, par);
        else if (softmax)
          linattn::multihead_softmax_attention(Q, K, V, H, out, ws, linattn::SoftmaxAlgorithm::Tiled,
                                               par);
        else if (causal)
          linattn::multihead_causal_linear_attention(Q, K, V, H, EluPlusOne{}, out, ws,
                                                     CausalOptions{}, par);
        else
          linattn::multihead_linear_attention(Q, K, V, H, EluPlusOne{}, out, ws, par);
        return out;
      };
      const Mat<float> clean = run(Q0, K0, V0);
      for (const Poison& poison : poisons()) {
        Mat<float> Q = Q0, K = K0, V = V0;
        if (poison.where == Where::V)
          V(p, bad_head * M + 1) = poison.value;
        else
          (poison.where == Where::Q ? Q : K)(p, bad_head * D + 2) = poison.value;
        const Mat<float> out = run(Q, K, V);
        const std::string what = std::string(causal ? "causal " : "") +
                                 (softmax ? "softmax " : "linear ") + poison.name + " in " +
                                 where_name(poison.where);
        for (Index h = 0; h < H; ++h) {
          if (h == bad_head) continue;
          EXPECT_EQ(test::max_abs_diff(out.middleCols(h * M, M), clean.middleCols(h * M, M)), 0.0)
              << what << ", head " << h;
        }
        const auto bad = out.middleCols(bad_head * M, M);
        const auto good = clean.middleCols(bad_head * M, M);
        const bool known_bug = causal && softmax && poison.where == Where::V;
        if (causal && (strict || !known_bug)) {
          EXPECT_EQ(test::max_abs_diff(bad.topRows(p), good.topRows(p)), 0.0)
              << what << ", rows before it";
        }
        if (poison.where == Where::Q) {  // only row p's query: every other row is exact
          EXPECT_EQ(test::max_abs_diff(bad.bottomRows(N - p - 1), good.bottomRows(N - p - 1)), 0.0)
              << what << ", rows after a non-finite query";
        }
      }
    }
  }
}

TEST(Robustness, MultiHeadNonFinite) { multihead_non_finite(false); }
// Fails today (the library bug above).
TEST(Robustness, DISABLED_MultiHeadCausalSoftmaxNonFiniteValueStaysInItsRow) {
  multihead_non_finite(true);
}

// ---------------------------------------------------------------------------------------------
// Subnormal inputs
// ---------------------------------------------------------------------------------------------

// Inputs whose entries are scattered subnormals (a quarter of them, at 2^-10 of the smallest
// normal value, with both signs) among ordinary values in [-1, 1]; in V also whole rows of
// subnormals. Every kernel must give finite results equal to the double reference of the same
// inputs (which are exactly representable in double).
template <class S>
Mat<S> with_subnormals(Index rows, Index cols, std::uint32_t seed) {
  Mat<S> X = test::random_matrix<S>(rows, cols, seed);
  const Mat<S> pick = test::random_matrix<S>(rows, cols, seed + 1000, 0, 1);
  const S tiny = std::numeric_limits<S>::min() / S(1024);
  for (Index c = 0; c < cols; ++c)
    for (Index r = 0; r < rows; ++r)
      if (pick(r, c) < S(0.25)) X(r, c) = X(r, c) < 0 ? -tiny * S(3) : tiny;
  if (rows > 5) X.row(5).setConstant(tiny);  // a whole row of subnormals
  return X;
}

// A former library bug (fixed; SubnormalRowNormalizedCosineFloat checks it): NormalizedCosine
// mapped a row whose norm is below 1 / max (every entry subnormal) to inf·x, as 1 / ‖x‖
// overflowed. Unless `whole_row_for_cosine`, the NormalizedCosine kernels get inputs whose row 5
// (the all-subnormal one) is replaced by row 6.
template <class S>
void subnormal_inputs(bool whole_row_for_cosine = false) {
  const std::string tag = std::string("subnormal/") + test::scalar_name<S>();
  const Index N = 150, D = 6, M = 4, H = 2;
  const Mat<S> Q = with_subnormals<S>(N, D, 51), K = with_subnormals<S>(N, D, 52);
  const Mat<S> V = with_subnormals<S>(N, M, 53);
  const MatD Qd = cref::to_double(Q), Kd = cref::to_double(K), Vd = cref::to_double(V);
  Mat<S> Qc = Q, Kc = K;
  if (!whole_row_for_cosine) {
    Qc.row(5) = Q.row(6);
    Kc.row(5) = K.row(6);
  }
  const MatD Qcd = cref::to_double(Qc), Kcd = cref::to_double(Kc);
  const double tol = test::bound<S>(3e-6, 1e-14);
  double worst = 0;
  const auto check = [&](const auto& out, const MatD& expected, const std::string& what) {
    EXPECT_TRUE(test::all_finite(out)) << tag << " " << what;
    const double e = test::max_abs_diff(out, expected);
    EXPECT_LE(e, tol) << tag << " " << what;
    worst = std::max(worst, e);
  };

  // Non-causal linear attention, every map; masked.
  check(linattn::linear_attention(Q, K, V, EluPlusOne{}), ref::linear_attention(Qd, Kd, Vd, EluPlusOne{}),
        "linear EluPlusOne");
  check(linattn::linear_attention(Q, K, V, SoftmaxSplit{}),
        ref::linear_attention(Qd, Kd, Vd, SoftmaxSplit{}), "linear SoftmaxSplit");
  check(linattn::linear_attention(Qc, Kc, V, NormalizedCosine{}),
        ref::linear_attention(Qcd, Kcd, Vd, NormalizedCosine{}), "linear NormalizedCosine");
  const cref::BoolVec keep = cref::random_mask(N, 54, 0.7);
  check(linattn::masked_linear_attention(Q, K, V, keep, EluPlusOne{}),
        ref::linear_attention(Qd, cref::kept_rows(Kd, keep), cref::kept_rows(Vd, keep), EluPlusOne{}),
        "masked linear");

  // Causal: every map, chunked and recurrent; masked causal.
  const auto causal = [&](const auto& phi, const Mat<S>& q, const Mat<S>& k) {
    const MatD expected = cref::causal(cref::to_double(q), cref::to_double(k), Vd, phi);
    for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent})
      check(linattn::causal_linear_attention(q, k, V, phi, options(algo, 32)), expected,
            std::string("causal ") + cref::map_name<std::decay_t<decltype(phi)>>() + " " +
                algorithm_name(algo));
  };
  causal(EluPlusOne{}, Q, K);
  causal(SoftmaxSplit{}, Q, K);
  causal(NormalizedCosine{}, Qc, Kc);
  check(linattn::masked_causal_linear_attention(Q, K, V, keep, EluPlusOne{}),
        cref::masked_causal(Qd, Kd, Vd, keep, EluPlusOne{}), "masked causal");

  // Recurrent steps.
  {
    linattn::RecurrentLinearAttention<EluPlusOne, S> layer(D, M);
    Mat<S> out(N, M);
    for (Index t = 0; t < N; ++t) out.row(t) = layer.step(Q.row(t).transpose(), K.row(t).transpose(),
                                                          V.row(t).transpose()).transpose();
    check(out, cref::causal(Qd, Kd, Vd, EluPlusOne{}), "recurrent steps");
  }

  // Softmax attention, naive and tiled, causal or not.
  for (const auto algo : {linattn::SoftmaxAlgorithm::Naive, linattn::SoftmaxAlgorithm::Tiled}) {
    const std::string name = algo == linattn::SoftmaxAlgorithm::Naive ? "naive" : "tiled";
    check(linattn::softmax_attention(Q, K, V, algo), ref::softmax_attention(Qd, Kd, Vd), "softmax " + name);
    check(linattn::causal_softmax_attention(Q, K, V, algo), ref::causal_softmax_attention(Qd, Kd, Vd),
          "causal softmax " + name);
  }

  // Multi-head: H heads side by side, each equal to its reference.
  {
    const Mat<S> QH = with_subnormals<S>(N, H * D, 55), KH = with_subnormals<S>(N, H * D, 56);
    const Mat<S> VH = with_subnormals<S>(N, H * M, 57);
    const Mat<S> lin = linattn::multihead_linear_attention(QH, KH, VH, H);
    const Mat<S> cau = linattn::multihead_causal_linear_attention(QH, KH, VH, H);
    const Mat<S> soft = linattn::multihead_softmax_attention(QH, KH, VH, H);
    for (Index h = 0; h < H; ++h) {
      const MatD q = cref::to_double(QH.middleCols(h * D, D)), k = cref::to_double(KH.middleCols(h * D, D));
      const MatD v = cref::to_double(VH.middleCols(h * M, M));
      check(lin.middleCols(h * M, M), ref::linear_attention(q, k, v, EluPlusOne{}), "multihead linear");
      check(cau.middleCols(h * M, M), cref::causal(q, k, v, EluPlusOne{}), "multihead causal");
      check(soft.middleCols(h * M, M), ref::softmax_attention(q, k, v), "multihead softmax");
    }
  }
  test::report_error(tag, worst);
}

// float only: subnormals are reached far sooner in float, the kernels are the same templates in
// double, and every instantiation here costs compile time in each CI stage.
TEST(Robustness, SubnormalInputsFloat) { subnormal_inputs<float>(); }
// The NormalizedCosine bug above is fixed (feature maps normalise rows of any magnitude): the
// all-subnormal row is checked strictly.
TEST(Robustness, SubnormalRowNormalizedCosineFloat) { subnormal_inputs<float>(true); }

}  // namespace
