// Key padding masks (true = the key takes part):
//  - masked_linear_attention == linear_attention on the kept keys only (the masked rows removed);
//  - masked_causal_linear_attention == the naive masked causal reference (query i attends to the
//    kept keys j <= i; a query that has seen no kept key gets a zero row), chunked and recurrent,
//    in one shot and in pieces with a carried state;
//  - all keys masked gives zeros; a mask of the wrong length throws.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "causal_reference.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace {

using cref::BoolVec;
using cref::Relu;
using linattn::CausalAlgorithm;
using linattn::CausalOptions;
using linattn::EluPlusOne;
using linattn::NormalizedCosine;
using linattn::SoftmaxSplit;
using test::Index;
using test::Mat;
using test::MatD;
using test::expect_invalid;

// Errors measured here, divided by the row's condition (see err_on_regular_rows), are below
// ~5e-7 (float) and ~1e-14 (double); the bounds keep ~10x.
template <class S>
double tight_tol(double scale = 1.0) {
  return test::bound<S>(5e-6, 1e-13, scale);
}

// Rows whose reference denominator is below this are in the guard regime (ε = 1e-6 in float,
// 1e-12 in double) where float and double may differ; there only finiteness is checked.
constexpr double kMinDen = 1e-2;
// The rows compared out of all rows checked (the others: all keys masked, or the guard regime).
constexpr double kMinComparedFraction = 0.75;

// max over the rows of |a - b| / max(1, κ_i), κ = cref::row_condition (the error of a row
// scales with its condition: NormalizedCosine with a single kept key pointing away from the
// query has κ ~ 100); rows with den < kMinDen are only checked for finiteness.
template <class DA>
double err_on_regular_rows(const Eigen::MatrixBase<DA>& a, const MatD& b, const ref::Vec& den,
                           const ref::Vec& kappa, test::RowComparison* count = nullptr) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return std::numeric_limits<double>::infinity();
  if (!test::all_finite(a)) return std::numeric_limits<double>::infinity();
  double e = 0;
  for (Index i = 0; i < a.rows(); ++i) {
    if (den(i) >= kMinDen) {
      e = std::max(e, test::max_abs_diff(a.row(i), b.row(i)) / std::max(1.0, kappa(i)));
      if (count) ++count->compared;
    } else if (count) {
      ++count->skipped;
    }
  }
  return e;
}

// Masks of a given length: none kept, all kept, random densities, a masked prefix (queries
// that see no kept key for a while), a single kept key, alternating.
std::vector<std::pair<std::string, BoolVec>> masks_for(Index n, std::uint32_t seed) {
  std::vector<std::pair<std::string, BoolVec>> m;
  m.emplace_back("none kept", BoolVec::Constant(n, false));
  m.emplace_back("all kept", BoolVec::Constant(n, true));
  m.emplace_back("random 0.2", cref::random_mask(n, seed, 0.2));
  m.emplace_back("random 0.8", cref::random_mask(n, seed + 1, 0.8));
  BoolVec prefix = cref::random_mask(n, seed + 2, 0.6);
  prefix.head(std::min<Index>(n, n / 2 + 1)).setConstant(false);
  m.emplace_back("masked prefix", prefix);
  BoolVec single = BoolVec::Constant(n, false);
  single(n / 3) = true;
  m.emplace_back("single kept", single);
  BoolVec alt(n);
  for (Index j = 0; j < n; ++j) alt(j) = (j % 2 == 1);
  m.emplace_back("alternating", alt);
  return m;
}

// Masked rows get garbage (large finite keys and values): it must not leak into the result.
// For SoftmaxSplit a masked key of 500 would also wipe out every kept key of its feature if it
// entered the running maximum.
template <class S>
void poison_masked_rows(Mat<S>& K, Mat<S>& V, const BoolVec& keep) {
  for (Index j = 0; j < K.rows(); ++j) {
    if (keep(j)) continue;
    K.row(j).setConstant(S(500));
    V.row(j).setConstant(S(1e6));
  }
}

// ---------------------------------------------------------------------------------------------
// Non-causal
// ---------------------------------------------------------------------------------------------

template <class S, class Map>
void check_masked(const Map& phi) {
  const std::string tag = std::string(cref::map_name<Map>()) + "/" + test::scalar_name<S>();
  double worst = 0;
  test::RowComparison rows;
  for (const test::Shape& sh : test::shapes()) {
    const Mat<S> Q = cref::qk_input<S, Map>(sh.N, sh.D, test::seed_of({sh.N, sh.L, sh.D, 1}));
    const Mat<S> K0 = cref::qk_input<S, Map>(sh.L, sh.D, test::seed_of({sh.N, sh.L, sh.D, 2}));
    const Mat<S> V0 = test::random_matrix<S>(sh.L, sh.M, test::seed_of({sh.N, sh.L, sh.D, 3}));
    auto masks = masks_for(sh.L, test::seed_of({sh.L, 4}));
    if (sh.N * sh.L > 40000) {  // the naive reference is O(N·L): fewer masks on large shapes
      masks.erase(std::remove_if(masks.begin(), masks.end(),
                                 [](const auto& m) { return m.first != "random 0.8" && m.first != "masked prefix"; }),
                  masks.end());
    }
    for (const auto& [name, keep] : masks) {
      Mat<S> K = K0, V = V0;
      poison_masked_rows(K, V, keep);
      const MatD Kk = cref::kept_rows(cref::to_double(K), keep), Vk = cref::kept_rows(cref::to_double(V), keep);
      ref::Vec den;
      const MatD expected = ref::linear_attention(cref::to_double(Q), Kk, Vk, phi, &den);
      const ref::Vec kappa = cref::row_condition(cref::to_double(Q), Kk, phi, false);
      const Mat<S> out = linattn::masked_linear_attention(Q, K, V, keep, phi);
      const double e = err_on_regular_rows(out, expected, den, kappa, &rows);
      EXPECT_LE(e, tight_tol<S>()) << tag << " " << name << " " << sh;
      worst = std::max(worst, e);
      // The same as the library's unmasked kernel on the kept rows.
      const Mat<S> removed = linattn::linear_attention(Q, cref::kept_rows(cref::to_double(K), keep).template cast<S>(),
                                                       cref::kept_rows(cref::to_double(V), keep).template cast<S>(), phi);
      EXPECT_LE(err_on_regular_rows(out, removed.template cast<double>(), den, kappa), tight_tol<S>())
          << tag << " " << name << " vs rows removed " << sh;
      if (keep.count() == 0) {
        EXPECT_EQ(test::max_abs(out), 0.0) << tag << " all masked " << sh;
      }
    }
  }
  // Measured: 67 % (NormalizedCosine) to 71 % (EluPlusOne) of the rows compared, 100 % for
  // SoftmaxSplit: the masks include all-masked and mostly-masked ones.
  test::expect_enough_rows(rows, 0.6, tag + " masked");
  test::report_error(tag + " masked vs reference", worst);
}

TEST(masks, MaskedLinearAttentionEqualsRemovingKeys) {
  test::for_each_map_scalar<EluPlusOne, SoftmaxSplit, NormalizedCosine, Relu>(
      [](auto phi, auto s) { check_masked<typename decltype(s)::type>(phi); });
}

// The mask may be any Eigen vector expression of bool; out + workspace overload.
TEST(masks, MaskExpressionsAndOutputOverload) {
  const Index N = 40, L = 90, D = 6, M = 5;
  const Mat<float> Q = test::random_matrix<float>(N, D, 11), K = test::random_matrix<float>(L, D, 12);
  const Mat<float> V = test::random_matrix<float>(L, M, 13);
  const Eigen::VectorXf score = Eigen::VectorXf::LinSpaced(L, -1, 1);
  const BoolVec keep = (score.array() > 0.1f).matrix();
  const Mat<float> expected = linattn::masked_linear_attention(Q, K, V, keep, EluPlusOne{});
  // A row vector of bool, and an unevaluated comparison expression.
  const Eigen::Matrix<bool, 1, Eigen::Dynamic> keep_row = keep.transpose();
  EXPECT_EQ(test::max_abs_diff(linattn::masked_linear_attention(Q, K, V, keep_row, EluPlusOne{}), expected), 0.0);
  EXPECT_EQ(test::max_abs_diff(
                linattn::masked_linear_attention(Q, K, V, (score.array() > 0.1f).matrix(), EluPlusOne{}), expected),
            0.0);
  // Out + workspace overload, into a block.
  linattn::Workspace<float> ws;
  Mat<float> canvas = Mat<float>::Zero(N + 2, M + 2);
  linattn::masked_linear_attention(Q, K, V, keep, EluPlusOne{}, canvas.block(1, 1, N, M), ws);
  EXPECT_EQ(test::max_abs_diff(canvas.block(1, 1, N, M), expected), 0.0);
  // Causal too.
  const Mat<float> Kc = K.topRows(N), Vc = V.topRows(N);
  const BoolVec keep_c = keep.head(N);
  const Mat<float> expected_c = linattn::masked_causal_linear_attention(Q, Kc, Vc, keep_c, EluPlusOne{});
  EXPECT_EQ(test::max_abs_diff(linattn::masked_causal_linear_attention(
                                   Q, Kc, Vc, (score.head(N).array() > 0.1f).matrix(), EluPlusOne{}),
                               expected_c),
            0.0);
}

// ---------------------------------------------------------------------------------------------
// Causal
// ---------------------------------------------------------------------------------------------

template <class S, class Map>
void check_masked_causal(const Map& phi) {
  const std::string tag = std::string(cref::map_name<Map>()) + "/" + test::scalar_name<S>();
  double worst = 0;
  test::RowComparison rows;
  std::vector<test::Shape> shapes = test::causal_shapes();
  shapes.push_back({150, 150, 5, 7});
  for (const test::Shape& sh : shapes) {
    if (sh.N > 300) continue;  // the masked reference is O(N² D M) for SoftmaxSplit
    const Mat<S> Q = cref::qk_input<S, Map>(sh.N, sh.D, test::seed_of({sh.N, sh.D, 21}));
    const Mat<S> K0 = cref::qk_input<S, Map>(sh.N, sh.D, test::seed_of({sh.N, sh.D, 22}));
    const Mat<S> V0 = test::random_matrix<S>(sh.N, sh.M, test::seed_of({sh.N, sh.D, 23}));
    for (const auto& [name, keep] : masks_for(sh.N, test::seed_of({sh.N, 24}))) {
      Mat<S> K = K0, V = V0;
      poison_masked_rows(K, V, keep);
      const MatD expected = cref::masked_causal(cref::to_double(Q), cref::to_double(K), cref::to_double(V), keep, phi);
      // Denominators of the reference, to skip guard-regime rows (ReLU, NormalizedCosine).
      ref::Vec den = ref::Vec::Ones(sh.N);
      if constexpr (!linattn::normalizes_keys_per_feature_v<Map>) {
        const cref::PairSim<Map> sim(cref::to_double(Q), cref::to_double(K), phi);
        for (Index i = 0; i < sh.N; ++i) {
          double d = 0;
          bool any = false;
          for (Index j = 0; j <= i; ++j)
            if (keep(j)) {
              d += sim(i, j);
              any = true;
            }
          den(i) = any ? d : 1.0;  // rows with no kept key are checked (they must be zero)
        }
      }
      const ref::Vec kappa = cref::row_condition(cref::to_double(Q), cref::to_double(K), phi, true, &keep);
      for (const Index chunk : {Index(1), Index(3), Index(16), Index(64), Index(65), Index(0)}) {
        for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
          CausalOptions opts;
          opts.algorithm = algo;
          opts.chunk_size = chunk;
          const Mat<S> out = linattn::masked_causal_linear_attention(Q, K, V, keep, phi, opts);
          const double e = err_on_regular_rows(out, expected, den, kappa, &rows);
          EXPECT_LE(e, tight_tol<S>()) << tag << " " << name << " chunk=" << chunk
                                       << (algo == CausalAlgorithm::Chunked ? " chunked " : " recurrent ") << sh;
          worst = std::max(worst, e);
          // Queries that have seen no kept key: exactly zero.
          for (Index i = 0; i < sh.N && !keep.head(i + 1).any(); ++i)
            EXPECT_EQ(test::max_abs(out.row(i)), 0.0) << tag << " " << name << " row " << i;
        }
      }
      // In pieces with a carried state, through the out + workspace overload.
      {
        linattn::LinearAttentionState<S> st;
        linattn::Workspace<S> ws;
        Mat<S> out(sh.N, sh.M);
        const Index c1 = sh.N / 3, c2 = (2 * sh.N) / 3 + 1 > sh.N ? sh.N : (2 * sh.N) / 3 + 1;
        const std::vector<Index> cuts = {0, c1, c1, c2, sh.N};
        for (std::size_t p = 0; p + 1 < cuts.size(); ++p) {
          const Index r0 = cuts[p], n = cuts[p + 1] - cuts[p];
          linattn::masked_causal_linear_attention(Q.middleRows(r0, n), K.middleRows(r0, n), V.middleRows(r0, n),
                                                  keep.segment(r0, n), phi, st, out.middleRows(r0, n), ws);
        }
        const double e = err_on_regular_rows(out, expected, den, kappa);
        EXPECT_LE(e, tight_tol<S>()) << tag << " " << name << " pieces " << sh;
        worst = std::max(worst, e);
      }
    }
  }
  test::expect_enough_rows(rows, kMinComparedFraction, tag + " masked causal");
  test::report_error(tag + " masked causal vs reference", worst);
}

TEST(masks, MaskedCausalEqualsReference) {
  test::for_each_map_scalar<EluPlusOne, SoftmaxSplit, NormalizedCosine, Relu>(
      [](auto phi, auto s) { check_masked_causal<typename decltype(s)::type>(phi); });
}

// An all-true mask is the unmasked kernel (bit for bit on the same algorithm).
TEST(masks, AllKeptEqualsUnmasked) {
  const Index N = 131, D = 8, M = 6;
  const Mat<float> Q = test::random_matrix<float>(N, D, 31), K = test::random_matrix<float>(N, D, 32);
  const Mat<float> V = test::random_matrix<float>(N, M, 33);
  const BoolVec all = BoolVec::Constant(N, true);
  for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
    CausalOptions opts;
    opts.algorithm = algo;
    opts.chunk_size = 16;
    EXPECT_LE(test::max_abs_diff(linattn::masked_causal_linear_attention(Q, K, V, all, SoftmaxSplit{}, opts),
                                 linattn::causal_linear_attention(Q, K, V, SoftmaxSplit{}, opts)),
              tight_tol<float>());
    EXPECT_LE(test::max_abs_diff(linattn::masked_causal_linear_attention(Q, K, V, all, EluPlusOne{}, opts),
                                 linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, opts)),
              tight_tol<float>());
  }
  EXPECT_LE(test::max_abs_diff(linattn::masked_linear_attention(Q, K, V, all, NormalizedCosine{}),
                               linattn::linear_attention(Q, K, V, NormalizedCosine{})),
            tight_tol<float>());
}

// Causal SoftmaxSplit with masks and keys of magnitude 100 in float.
TEST(masks, MaskedCausalSoftmaxSplitStable) {
  const Index N = 200, D = 6, M = 4;
  const Mat<float> Q = test::random_matrix<float>(N, D, 41, -100, 100);
  Mat<float> K = test::random_matrix<float>(N, D, 42, -100, 100);
  Mat<float> V = test::random_matrix<float>(N, M, 43);
  const BoolVec keep = cref::random_mask(N, 44, 0.5);
  poison_masked_rows(K, V, keep);
  const MatD expected = cref::masked_causal(cref::to_double(Q), cref::to_double(K), cref::to_double(V), keep,
                                            SoftmaxSplit{});
  double worst = 0;
  for (const Index chunk : {Index(1), Index(7), Index(64), Index(100)}) {
    for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
      CausalOptions opts;
      opts.algorithm = algo;
      opts.chunk_size = chunk;
      const Mat<float> out = linattn::masked_causal_linear_attention(Q, K, V, keep, SoftmaxSplit{}, opts);
      EXPECT_TRUE(test::all_finite(out));
      worst = std::max(worst, test::max_abs_diff(out, expected));
    }
  }
  EXPECT_LE(worst, tight_tol<float>());
  test::report_error("SoftmaxSplit/float masked causal magnitude 100", worst);
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

TEST(masks, WrongMaskLengthThrows) {
  const Mat<float> Q = test::random_matrix<float>(10, 4, 51), K = test::random_matrix<float>(10, 4, 52);
  const Mat<float> V = test::random_matrix<float>(10, 3, 53);
  const BoolVec short_mask = BoolVec::Constant(9, true), long_mask = BoolVec::Constant(11, true);
  const Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic> square = Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic>::Constant(10, 10, true);
  const std::string nc = "linattn::masked_linear_attention", c = "linattn::masked_causal_linear_attention";
  expect_invalid([&] { linattn::masked_linear_attention(Q, K, V, short_mask, EluPlusOne{}); }, nc, "short");
  expect_invalid([&] { linattn::masked_linear_attention(Q, K, V, long_mask, SoftmaxSplit{}); }, nc, "long");
  expect_invalid([&] { linattn::masked_linear_attention(Q, K, V, square, EluPlusOne{}); }, nc, "N x L mask");
  expect_invalid([&] { linattn::masked_causal_linear_attention(Q, K, V, short_mask, EluPlusOne{}); }, c, "short");
  expect_invalid([&] { linattn::masked_causal_linear_attention(Q, K, V, long_mask, SoftmaxSplit{}); }, c, "long");
  expect_invalid([&] { linattn::masked_causal_linear_attention(Q, K, V, square, EluPlusOne{}); }, c, "N x L mask");
  {
    linattn::LinearAttentionState<float> st;
    linattn::Workspace<float> ws;
    Mat<float> out(10, 3);
    expect_invalid([&] { linattn::masked_causal_linear_attention(Q, K, V, short_mask, EluPlusOne{}, st, out, ws); },
                   c, "short, out overload");
  }
  // Mask length checked against L (the keys), not N: non-causal N != L with a mask of L.
  const Mat<float> K7 = K.topRows(7), V7 = V.topRows(7);
  EXPECT_NO_THROW(linattn::masked_linear_attention(Q, K7, V7, BoolVec::Constant(7, true), EluPlusOne{}));
  expect_invalid([&] { linattn::masked_linear_attention(Q, K7, V7, BoolVec::Constant(10, true), EluPlusOne{}); },
                 nc, "mask of N instead of L");
  // N != L is still an error for the causal form.
  expect_invalid([&] { linattn::masked_causal_linear_attention(Q, K7, V7, BoolVec::Constant(7, true), EluPlusOne{}); },
                 c, "causal N != L");
}

}  // namespace
