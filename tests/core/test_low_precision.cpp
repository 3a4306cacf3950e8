// bf16 and half storage: the conversion loops against Eigen's scalar
// conversions, and every kernel family on bf16 / half operands against the float kernel on the
// rounded operands. The kernels compute in float on a widened copy and narrow the result once,
// so the expected result is exactly the float result rounded to the storage type: the checks
// compare bits, which is stronger than "a few ulps". One check per family also measures the
// error against the O(N^2) double reference on the rounded inputs (half an ulp of the storage
// type plus the float kernel's own error).
#include <gtest/gtest.h>

#include <linattn/linattn.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "reference.hpp"
#include "test_util.hpp"

namespace {

using linattn::EluPlusOne;
using linattn::SoftmaxSplit;
using test::Mat;
using test::random_matrix;
using test::RowMat;
using Index = Eigen::Index;
using bf16 = Eigen::bfloat16;
using half = Eigen::half;

template <class S>
std::uint16_t bits(S x) {
  return Eigen::numext::bit_cast<std::uint16_t>(x);
}
inline std::uint32_t bits(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

template <class S>
const char* name_of() {
  return std::is_same_v<S, bf16> ? "bf16" : "half";
}

// got and want (the float result rounded to S) agree bit for bit.
template <class A, class B>
void expect_same_bits(const Eigen::MatrixBase<A>& got, const Eigen::MatrixBase<B>& want,
                      const char* what) {
  ASSERT_EQ(got.rows(), want.rows()) << what;
  ASSERT_EQ(got.cols(), want.cols()) << what;
  Index bad = 0, first_r = -1, first_c = -1;
  for (Index c = 0; c < got.cols(); ++c)
    for (Index r = 0; r < got.rows(); ++r)
      if (bits(got(r, c)) != bits(want(r, c))) {
        if (bad++ == 0) first_r = r, first_c = c;
      }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size()
                    << " entries differ from the float kernel's rounded result, first at ("
                    << first_r << ", " << first_c << ")";
}

template <class S>
Mat<S> stored(Index rows, Index cols, std::uint32_t seed, double lo = -1.0, double hi = 1.0) {
  return random_matrix<float>(rows, cols, seed, lo, hi).template cast<S>();
}
template <class S>
Mat<float> wide(const Mat<S>& x) {
  return x.template cast<float>();
}

// ---------------------------------------------------------------------------------------------
// The conversion loops (detail/low_precision.hpp) against Eigen's scalar conversions: every
// 16-bit pattern widened, and floats around every rounding case narrowed (ties to even,
// subnormals, overflow to infinity, NaN), at lengths that leave SIMD tails.
// ---------------------------------------------------------------------------------------------

template <class S>
void check_widen_all_patterns() {
  std::vector<S> src(65536 + 7);
  for (std::size_t i = 0; i < src.size(); ++i) {
    src[i] = Eigen::numext::bit_cast<S>(static_cast<std::uint16_t>(i));
  }
  std::vector<float> dst(src.size());
  linattn::detail::widen(src.data(), dst.data(), static_cast<Index>(src.size()));
  Index bad = 0;
  for (std::size_t i = 0; i < src.size(); ++i) {
    const float want = static_cast<float>(src[i]);
    if (std::isnan(want) ? !std::isnan(dst[i]) : bits(dst[i]) != bits(want)) ++bad;
  }
  EXPECT_EQ(bad, 0) << name_of<S>() << ": widened patterns that differ from Eigen's";
}

template <class S>
void check_narrow_matches_eigen() {
  std::vector<float> src;
  const float specials[] = {0.0f,
                            -0.0f,
                            1.0f,
                            -1.0f,
                            65504.0f,
                            65520.0f,  // half: rounds to infinity
                            1e30f,
                            -1e38f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::denorm_min(),
                            1e-40f,
                            -3e-39f,
                            std::numeric_limits<float>::min(),
                            6e-8f,  // half subnormals
                            3e-5f,
                            1e-8f};
  for (float f : specials) src.push_back(f);
  // Every tie and its neighbours: bit patterns with the low bits at the rounding boundary of bf16
  // (bit 15) and of half (13 dropped mantissa bits), on even and odd kept mantissas.
  std::mt19937 gen(28);
  std::uniform_int_distribution<std::uint32_t> word;
  for (int i = 0; i < 4000; ++i) {
    std::uint32_t b = word(gen);
    if (i % 4 == 1) b = (b & 0xffff0000u) | 0x8000u;                        // bf16 tie
    if (i % 4 == 2) b = (b & 0xc7ffe000u) | 0x38001000u;                    // half tie, in range
    if (i % 4 == 3) b = (b & 0x807fffffu) | (std::uint32_t(100 + i % 60) << 23);  // |x| near 1
    float f;
    std::memcpy(&f, &b, sizeof f);
    src.push_back(f);
  }
  for (std::size_t n : {src.size(), std::size_t(1), std::size_t(15), std::size_t(17)}) {
    std::vector<S> dst(n);
    linattn::detail::narrow(src.data(), dst.data(), static_cast<Index>(n));
    Index bad = 0;
    std::uint32_t first = 0, got = 0, expected = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const S want(src[i]);
      // A NaN stays a NaN; its payload is the instruction set's (F16C keeps it, Eigen's
      // portable half conversion gives 0x7e00).
      const bool same = std::isnan(src[i]) ? Eigen::numext::isnan(dst[i]) : bits(dst[i]) == bits(want);
      if (!same && bad++ == 0)
        first = bits(src[i]), got = bits(dst[i]), expected = bits(want);
    }
    EXPECT_EQ(bad, 0) << name_of<S>() << ": " << bad << " of " << n
                      << " narrowed values differ from Eigen's rounding; the first: float bits "
                      << std::hex << first << " gave " << got << ", Eigen " << expected;
  }
}

TEST(LowPrecisionConversion, WidenEveryPattern) {
  check_widen_all_patterns<bf16>();
  check_widen_all_patterns<half>();
}

TEST(LowPrecisionConversion, NarrowRoundsAsEigen) {
  check_narrow_matches_eigen<bf16>();
  check_narrow_matches_eigen<half>();
}

// ---------------------------------------------------------------------------------------------
// The kernels. Shapes with D != M and N not a multiple of any block (chunk 64, row blocks).
// ---------------------------------------------------------------------------------------------

// The kernels compute in float, so this part compiles where the float checks do (LINATTN_TEST_SCALARS:
// .ci/test's native clang sanitizer stage; a default build has both). Every family runs on bf16;
// half, whose code differs only in the conversions, runs the causal kernels, the decode states and
// the magnitude-100 checks.
#if defined(LINATTN_TEST_FLOAT)

template <class S>
class LowPrecision : public ::testing::Test {};
using StorageTypes = ::testing::Types<bf16, half>;
TYPED_TEST_SUITE(LowPrecision, StorageTypes, );

constexpr Index kN = 203, kD = 24, kM = 40;

template <class S>
void check_non_causal_and_masked() {
  const Mat<S> Q = stored<S>(kN, kD, 1), K = stored<S>(kN + 11, kD, 2),
               V = stored<S>(kN + 11, kM, 3);
  const Mat<S> out = linattn::linear_attention(Q, K, V);
  expect_same_bits(out, Mat<S>(linattn::linear_attention(wide(Q), wide(K), wide(V)).template cast<S>()),
                   "linear_attention");
  Eigen::Array<bool, Eigen::Dynamic, 1> mask(K.rows());
  for (Index j = 0; j < K.rows(); ++j) mask(j) = j % 3 != 1;
  const Mat<S> masked = linattn::masked_linear_attention(Q, K, V, mask, SoftmaxSplit{});
  expect_same_bits(
      masked,
      Mat<S>(linattn::masked_linear_attention(wide(Q), wide(K), wide(V), mask, SoftmaxSplit{})
                 .template cast<S>()),
      "masked_linear_attention");

  // Against the double reference on the rounded inputs: half an ulp of S, plus float's error.
  const Eigen::MatrixXd exact = ref::linear_attention(
      wide(Q).template cast<double>(), wide(K).template cast<double>(), wide(V).template cast<double>(), EluPlusOne{});
  const double ulp = std::is_same_v<S, bf16> ? 0x1p-8 : 0x1p-11;  // relative, half an ulp
  const double err_rel =
      (out.template cast<double>() - exact).cwiseAbs().maxCoeff() / exact.cwiseAbs().maxCoeff();
  EXPECT_LE(err_rel, ulp * 1.01 + 1e-5) << name_of<S>();
}
TEST(LowPrecisionBf16, NonCausalAndMasked) { check_non_causal_and_masked<bf16>(); }

TYPED_TEST(LowPrecision, CausalChunkedRecurrentMaskedAndContinued) {
  using S = TypeParam;
  const Mat<S> Q = stored<S>(kN, kD, 4), K = stored<S>(kN, kD, 5), V = stored<S>(kN, kM, 6);
  for (auto algorithm : {linattn::CausalAlgorithm::Chunked, linattn::CausalAlgorithm::Recurrent}) {
    linattn::CausalOptions o;
    o.algorithm = algorithm;
    o.chunk_size = 32;
    const Mat<S> out = linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, o);
    expect_same_bits(
        out,
        Mat<S>(linattn::causal_linear_attention(wide(Q), wide(K), wide(V), EluPlusOne{}, o)
                   .template cast<S>()),
        "causal_linear_attention");
  }
  // In two pieces through a float state: the state of a bf16 call is a float state.
  linattn::LinearAttentionState<linattn::compute_scalar_t<S>> st, st_f;
  const Index cut = 77;
  const Mat<S> a = linattn::causal_linear_attention(Q.topRows(cut), K.topRows(cut),
                                                    V.topRows(cut), SoftmaxSplit{}, st);
  const Mat<S> b = linattn::causal_linear_attention(Q.bottomRows(kN - cut), K.bottomRows(kN - cut),
                                                    V.bottomRows(kN - cut), SoftmaxSplit{}, st);
  const Mat<float> af = linattn::causal_linear_attention(
      wide(Q).topRows(cut), wide(K).topRows(cut), wide(V).topRows(cut), SoftmaxSplit{}, st_f);
  const Mat<float> bf = linattn::causal_linear_attention(wide(Q).bottomRows(kN - cut),
                                                         wide(K).bottomRows(kN - cut),
                                                         wide(V).bottomRows(kN - cut),
                                                         SoftmaxSplit{}, st_f);
  expect_same_bits(a, Mat<S>(af.template cast<S>()), "causal piece 1");
  expect_same_bits(b, Mat<S>(bf.template cast<S>()), "causal piece 2");
  expect_same_bits(st.S, st_f.S, "the carried state");

  Eigen::Array<bool, Eigen::Dynamic, 1> mask(kN);
  for (Index j = 0; j < kN; ++j) mask(j) = j % 5 != 2;
  expect_same_bits(
      Mat<S>(linattn::masked_causal_linear_attention(Q, K, V, mask)),
      Mat<S>(linattn::masked_causal_linear_attention(wide(Q), wide(K), wide(V), mask).template cast<S>()),
      "masked_causal_linear_attention");

  const Eigen::MatrixXd exact = ref::causal_linear_attention(
      wide(Q).template cast<double>(), wide(K).template cast<double>(), wide(V).template cast<double>(), EluPlusOne{});
  const double ulp = std::is_same_v<S, bf16> ? 0x1p-8 : 0x1p-11;
  const Mat<S> out = linattn::causal_linear_attention(Q, K, V);
  for (Index i = 0; i < kN; ++i)
    for (Index c = 0; c < kM; ++c)
      ASSERT_LE(std::abs(double(out(i, c)) - exact(i, c)), ulp * std::abs(exact(i, c)) * 1.01 + 1e-6)
          << name_of<S>() << " at (" << i << ", " << c << ")";
}

// Packed row-major buffers (the SIMD widening in place of rows) and column blocks of one N x 3HD
// buffer, multi-head and batched; a Map with an inner stride (Eigen's scalar cast).
template <class S>
void check_multi_head_batched_and_layouts() {
  constexpr Index H = 3, Dh = 16, Mh = 8;
  const RowMat<S> QKV = random_matrix<float>(kN, H * (2 * Dh + Mh), 7).template cast<S>();
  const auto Q = QKV.leftCols(H * Dh);
  const auto K = QKV.middleCols(H * Dh, H * Dh);
  const auto V = QKV.rightCols(H * Mh);
  const RowMat<float> QKVf = QKV.template cast<float>();
  const auto Qf = QKVf.leftCols(H * Dh);
  const auto Kf = QKVf.middleCols(H * Dh, H * Dh);
  const auto Vf = QKVf.rightCols(H * Mh);

  RowMat<S> out(kN, H * Mh);
  linattn::MultiHeadWorkspace<float> ws, wsf;
  linattn::multihead_causal_linear_attention(Q, K, V, H, EluPlusOne{}, out, ws);
  RowMat<float> outf(kN, H * Mh);
  linattn::multihead_causal_linear_attention(Qf, Kf, Vf, H, EluPlusOne{}, outf, wsf);
  expect_same_bits(out, RowMat<S>(outf.template cast<S>()), "multihead_causal_linear_attention");

  linattn::multihead_linear_attention(Q, K, V, H, SoftmaxSplit{}, out, ws);
  linattn::multihead_linear_attention(Qf, Kf, Vf, H, SoftmaxSplit{}, outf, wsf);
  expect_same_bits(out, RowMat<S>(outf.template cast<S>()), "multihead_linear_attention");

  const std::vector<Index> offsets = {0, 50, 51, 140, kN};
  linattn::batched_causal_linear_attention(Q, K, V, offsets, H, EluPlusOne{}, out, ws);
  linattn::batched_causal_linear_attention(Qf, Kf, Vf, offsets, H, EluPlusOne{}, outf, wsf);
  expect_same_bits(out, RowMat<S>(outf.template cast<S>()), "batched_causal_linear_attention");

  // Shared query/key heads: the first head's columns serve all H value heads, in place.
  linattn::CausalOptions shared;
  shared.key_heads = 1;
  const auto Q1 = QKV.leftCols(Dh);
  const auto K1 = QKV.middleCols(H * Dh, Dh);
  const auto Qf1 = QKVf.leftCols(Dh);
  const auto Kf1 = QKVf.middleCols(H * Dh, Dh);
  linattn::batched_causal_linear_attention(Q1, K1, V, offsets, H, EluPlusOne{}, out, ws, shared);
  linattn::batched_causal_linear_attention(Qf1, Kf1, Vf, offsets, H, EluPlusOne{}, outf, wsf,
                                           shared);
  expect_same_bits(out, RowMat<S>(outf.template cast<S>()), "shared key heads");

  // Every other row through an inner stride: the generic widening.
  const Eigen::Map<const Mat<S>, 0, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>> Qs(
      QKV.data(), kN / 2, H * Dh, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>(1, 2 * QKV.cols()));
  const Mat<S> Qeven = Qs;
  const Mat<S> Keven = Mat<S>(K).topRows(kN / 2), Veven = Mat<S>(V).topRows(kN / 2);
  expect_same_bits(Mat<S>(linattn::causal_linear_attention(Qs, Keven, Veven)),
                   Mat<S>(linattn::causal_linear_attention(Qeven, Keven, Veven)),
                   "strided Map");
  // A lazy expression of bf16 (Eigen's cast path) gives the same as its evaluated copy.
  expect_same_bits(Mat<S>(linattn::linear_attention(Qeven * S(2), Keven, Veven)),
                   Mat<S>(linattn::linear_attention(Mat<S>(Qeven * S(2)), Keven, Veven)),
                   "expression operand");
}
TEST(LowPrecisionBf16, MultiHeadBatchedAndLayouts) { check_multi_head_batched_and_layouts<bf16>(); }

template <class S>
void check_softmax_baselines() {
  const Mat<S> Q = stored<S>(kN, kD, 8), K = stored<S>(kN, kD, 9), V = stored<S>(kN, kM, 10);
  const auto EF = linattn::make_linformer_projections<float>(kN, 16, 36);
  const Mat<S> E = EF.first.template cast<S>(), Fp = EF.second.template cast<S>();
  expect_same_bits(Mat<S>(linattn::linformer_attention(Q, K, V, E, Fp)),
                   Mat<S>(linattn::linformer_attention(wide(Q), wide(K), wide(V), wide(E), wide(Fp))
                              .template cast<S>()),
                   "linformer_attention");
  expect_same_bits(Mat<S>(linattn::softmax_attention(Q, K, V)),
                   Mat<S>(linattn::softmax_attention(wide(Q), wide(K), wide(V)).template cast<S>()),
                   "softmax_attention");
  expect_same_bits(Mat<S>(linattn::causal_softmax_attention(Q, K, V)),
                   Mat<S>(linattn::causal_softmax_attention(wide(Q), wide(K), wide(V)).template cast<S>()),
                   "causal_softmax_attention");
}
TEST(LowPrecisionBf16, SoftmaxBaselines) { check_softmax_baselines<bf16>(); }

template <class S>
void check_gradients() {
  const Mat<S> Q = stored<S>(kN, kD, 11), K = stored<S>(kN, kD, 12), V = stored<S>(kN, kM, 13),
               W = stored<S>(kN, kM, 14);
  const auto expect_grads = [](const auto& g, const auto& gf, const char* what) {
    expect_same_bits(g.dQ, Mat<S>(gf.dQ.template cast<S>()), what);
    expect_same_bits(g.dK, Mat<S>(gf.dK.template cast<S>()), what);
    expect_same_bits(g.dV, Mat<S>(gf.dV.template cast<S>()), what);
  };
  expect_grads(linattn::linear_attention_backward(Q, K, V, W, EluPlusOne{}),
               linattn::linear_attention_backward(wide(Q), wide(K), wide(V), wide(W), EluPlusOne{}),
               "linear_attention_backward");
  expect_grads(linattn::causal_linear_attention_backward(Q, K, V, W, SoftmaxSplit{}),
               linattn::causal_linear_attention_backward(wide(Q), wide(K), wide(V), wide(W),
                                                         SoftmaxSplit{}),
               "causal_linear_attention_backward");
  expect_grads(linattn::causal_softmax_attention_backward(Q, K, V, W),
               linattn::causal_softmax_attention_backward(wide(Q), wide(K), wide(V), wide(W)),
               "causal_softmax_attention_backward");
}
TEST(LowPrecisionBf16, Gradients) { check_gradients<bf16>(); }

// The saved-forward softmax backward (out and lse of the forward), summarize and
// LinearCrossAttention: bf16 / half operands as the other kernels (an independent check found
// these three rejecting them).
template <class S>
void check_saved_softmax_summarize_and_cross() {
  const Mat<S> Q = stored<S>(kN, kD, 44), K = stored<S>(kN, kD, 45), V = stored<S>(kN, kM, 46),
               W = stored<S>(kN, kM, 47);
  for (const bool causal : {false, true}) {
    linattn::Workspace<float> ws;
    Mat<S> out(kN, kM), dQ(kN, kD), dK(kN, kD), dV(kN, kM);
    Mat<float> out_f(kN, kM), dQf(kN, kD), dKf(kN, kD), dVf(kN, kM);
    Eigen::VectorXf lse(kN), lse_f(kN);
    if (causal) {
      linattn::causal_softmax_attention(Q, K, V, out, lse, ws);
      linattn::causal_softmax_attention_backward(Q, K, V, out, lse, W, dQ, dK, dV, ws);
      linattn::causal_softmax_attention(wide(Q), wide(K), wide(V), out_f, lse_f, ws);
    } else {
      linattn::softmax_attention(Q, K, V, out, lse, ws);
      linattn::softmax_attention_backward(Q, K, V, out, lse, W, dQ, dK, dV, ws);
      linattn::softmax_attention(wide(Q), wide(K), wide(V), out_f, lse_f, ws);
    }
    expect_same_bits(lse, lse_f, "softmax_attention's lse");
    // The float reference reads the same saved output: the bf16 / half one, widened.
    const Mat<float> saved = wide(out);
    if (causal)
      linattn::causal_softmax_attention_backward(wide(Q), wide(K), wide(V), saved, lse_f, wide(W),
                                                 dQf, dKf, dVf, ws);
    else
      linattn::softmax_attention_backward(wide(Q), wide(K), wide(V), saved, lse_f, wide(W), dQf,
                                          dKf, dVf, ws);
    expect_same_bits(dQ, Mat<S>(dQf.template cast<S>()), "softmax backward from the saved out");
    expect_same_bits(dK, Mat<S>(dKf.template cast<S>()), "softmax backward from the saved out");
    expect_same_bits(dV, Mat<S>(dVf.template cast<S>()), "softmax backward from the saved out");
  }
  const auto st = linattn::summarize(K, V, SoftmaxSplit{});
  const auto st_f = linattn::summarize(wide(K), wide(V), SoftmaxSplit{});
  expect_same_bits(st.S, st_f.S, "summarize");
  expect_same_bits(st.z, st_f.z, "summarize");
  linattn::LinearCrossAttention<EluPlusOne, float> cross(kD, kM), cross_f(kD, kM);
  cross.set_memory(K, V);
  cross_f.set_memory(wide(K), wide(V));
  expect_same_bits(cross.state().S, cross_f.state().S, "LinearCrossAttention::set_memory");
  const Mat<S> rows = cross.query(Q);
  expect_same_bits(rows, Mat<S>(cross_f.query(wide(Q)).template cast<S>()),
                   "LinearCrossAttention::query (rows)");
  const Eigen::Matrix<S, Eigen::Dynamic, 1> one = cross.query(Q.row(3).transpose());
  const Eigen::VectorXf one_f = cross_f.query(wide(Q).row(3).transpose());
  expect_same_bits(one, Eigen::Matrix<S, Eigen::Dynamic, 1>(one_f.template cast<S>()),
                   "LinearCrossAttention::query (one)");
}
TEST(LowPrecisionBf16, SavedSoftmaxSummarizeAndCross) {
  check_saved_softmax_summarize_and_cross<bf16>();
}
TEST(LowPrecisionHalf, SavedSoftmaxSummarizeAndCross) {
  check_saved_softmax_summarize_and_cross<half>();
}

// Decay, gates and the delta rule (spec §9): gates, β and log-decays are stored as Q, K, V are.
template <class S>
void check_gated_and_delta_rule() {
  const Mat<S> Q = stored<S>(kN, kD, 15), K = stored<S>(kN, kD, 16), V = stored<S>(kN, kM, 17),
               W = stored<S>(kN, kM, 18);
  const Mat<S> G = stored<S>(kN, kD, 19, -0.3, -0.01);  // per-feature log gates (Identity: F = D)
  const Mat<S> beta = stored<S>(kN, 1, 20, 0.1, 0.9), log_a = stored<S>(kN, 1, 21, -0.2, 0.0);
  linattn::GatedOptions go;
  go.chunk_size = 32;
  expect_same_bits(
      Mat<S>(linattn::gated_linear_attention(Q, K, V, G, linattn::Identity{}, go)),
      Mat<S>(linattn::gated_linear_attention(wide(Q), wide(K), wide(V), wide(G),
                                             linattn::Identity{}, go)
                 .template cast<S>()),
      "gated_linear_attention");
  // (The gated backward writes its gradients through the views every backward uses, checked
  // above; the delta rule's writes dβ and d log a itself, checked here.)

  const linattn::L2Normalize<linattn::Identity> unit;
  expect_same_bits(
      Mat<S>(linattn::delta_rule_attention(Q, K, V, beta, log_a, unit)),
      Mat<S>(linattn::delta_rule_attention(wide(Q), wide(K), wide(V), wide(beta), wide(log_a),
                                           unit)
                 .template cast<S>()),
      "delta_rule_attention");
  const auto dg = linattn::delta_rule_attention_backward(Q, K, V, beta, log_a, W, unit);
  const auto df = linattn::delta_rule_attention_backward(wide(Q), wide(K), wide(V), wide(beta),
                                                         wide(log_a), wide(W), unit);
  expect_same_bits(dg.dK, Mat<S>(df.dK.template cast<S>()), "delta backward dK");
  expect_same_bits(dg.dbeta, Mat<S>(df.dbeta.template cast<S>()), "delta backward dbeta");
  expect_same_bits(dg.dlog_a, Mat<S>(df.dlog_a.template cast<S>()), "delta backward dlog_a");
}
TEST(LowPrecisionBf16, GatedAndDeltaRule) { check_gated_and_delta_rule<bf16>(); }

// The decode classes keep float states and take bf16 / half tokens: the same outputs as the
// float class on the rounded tokens.
template <class S>
void check_decode_classes_take_stored_tokens() {
  constexpr Index H = 2, T = 37;
  const Mat<S> Q = stored<S>(T, H * kD, 22), K = stored<S>(T, H * kD, 23),
               V = stored<S>(T, H * kM, 24);
  linattn::RecurrentLinearAttention<EluPlusOne, float> one(kD, kM), one_f(kD, kM);
  linattn::BatchedRecurrentLinearAttention<EluPlusOne, float> batch(1, H, kD, kM),
      batch_f(1, H, kD, kM);
  linattn::MultiHeadRecurrentLinearAttention<EluPlusOne, float> multi(H, kD, kM),
      multi_f(H, kD, kM);
  linattn::RecurrentGatedAttention<linattn::Identity, float> gated(kD, kM), gated_f(kD, kM);
  linattn::RecurrentDeltaRule<linattn::L2Normalize<linattn::Identity>, float> delta(kD, kM),
      delta_f(kD, kM);
  const Mat<S> G = stored<S>(T, kD, 25, -0.3, -0.01);
  Eigen::Matrix<S, Eigen::Dynamic, 1> o1(kM);
  Eigen::VectorXf o1_f(kM);
  Eigen::Matrix<S, 1, Eigen::Dynamic> row(H * kM);
  Eigen::Matrix<float, 1, Eigen::Dynamic> row_f(H * kM);
  for (Index t = 0; t < T; ++t) {
    const Eigen::Matrix<S, Eigen::Dynamic, 1> o =
        one.step(Q.row(t).head(kD), K.row(t).head(kD), V.row(t).head(kM));
    const Eigen::VectorXf of = one_f.step(wide(Q).row(t).head(kD), wide(K).row(t).head(kD),
                                          wide(V).row(t).head(kM));
    expect_same_bits(o, Eigen::Matrix<S, Eigen::Dynamic, 1>(of.template cast<S>()),
                     "RecurrentLinearAttention::step");
    multi.step(Q.row(t), K.row(t), V.row(t), row);
    multi_f.step(wide(Q).row(t), wide(K).row(t), wide(V).row(t), row_f);
    expect_same_bits(row, Eigen::Matrix<S, 1, Eigen::Dynamic>(row_f.template cast<S>()),
                     "MultiHeadRecurrentLinearAttention::step");
    const Eigen::Matrix<S, Eigen::Dynamic, 1> gate = G.row(t).transpose();
    gated.step(Q.row(t).head(kD), K.row(t).head(kD), V.row(t).head(kM), gate, o1);
    gated_f.step(wide(Q).row(t).head(kD), wide(K).row(t).head(kD), wide(V).row(t).head(kM),
                 gate.template cast<float>(), o1_f);
    expect_same_bits(o1, Eigen::Matrix<S, Eigen::Dynamic, 1>(o1_f.template cast<S>()),
                     "RecurrentGatedAttention::step");
    delta.step(Q.row(t).head(kD), K.row(t).head(kD), V.row(t).head(kM), 0.5f, -0.01f, o1);
    delta_f.step(wide(Q).row(t).head(kD), wide(K).row(t).head(kD), wide(V).row(t).head(kM), 0.5f,
                 -0.01f, o1_f);
    expect_same_bits(o1, Eigen::Matrix<S, Eigen::Dynamic, 1>(o1_f.template cast<S>()),
                     "RecurrentDeltaRule::step");
    batch.step(Q.row(t), K.row(t), V.row(t), row);
    batch_f.step(wide(Q).row(t), wide(K).row(t), wide(V).row(t), row_f);
    expect_same_bits(row, Eigen::Matrix<S, 1, Eigen::Dynamic>(row_f.template cast<S>()),
                     "BatchedRecurrentLinearAttention::step");
  }
}
TEST(LowPrecisionBf16, DecodeClassesTakeStoredTokens) { check_decode_classes_take_stored_tokens<bf16>(); }


// A decoder that keeps S in bf16 / half: after one token its state is the float state rounded,
// bit for bit; over many tokens its outputs follow a reference that rounds S after every token
// (within float rounding and the odd tie decided the other way: 1e-3 of the largest output),
// and its drift from the float decoder is what rounding S costs (reported, bounded by the
// worst case of T roundings of half an ulp each).
TYPED_TEST(LowPrecision, DecodeWithLowPrecisionStates) {
  using S = TypeParam;
  // M = 72: a block of the fused AVX-512 step (64 columns) or two of the AVX2 one (32), and a
  // tail through the row-by-row path.
  constexpr Index H = 2, B = 3, T = 150, kMv = 72;
  const Mat<float> Q = random_matrix<float>(T * B, H * kD, 26),
                   K = random_matrix<float>(T * B, H * kD, 27),
                   V = random_matrix<float>(T * B, H * kMv, 28);
  linattn::BatchedRecurrentLinearAttention<EluPlusOne, float, S> low(B, H, kD, kMv);
  linattn::BatchedRecurrentLinearAttention<EluPlusOne, float> full(B, H, kD, kMv);
  Mat<float> out(B, H * kMv), out_f(B, H * kMv);
  const ref::Mat PQ = ref::elu_plus_one_features(Q.template cast<double>()),
                 PK = ref::elu_plus_one_features(K.template cast<double>());
  // The reference's states: S rounded to the storage type after every token, z in double.
  std::vector<Mat<S>> Sr(B * H, Mat<S>::Zero(kD, kMv));
  std::vector<Eigen::VectorXd> zr(B * H, Eigen::VectorXd::Zero(kD));
  double worst = 0, drift = 0, scale = 0;
  for (Index t = 0; t < T; ++t) {
    low.step(Q.middleRows(t * B, B), K.middleRows(t * B, B), V.middleRows(t * B, B), out);
    full.step(Q.middleRows(t * B, B), K.middleRows(t * B, B), V.middleRows(t * B, B), out_f);
    if (t == 0) {
      for (Index b = 0; b < B; ++b)
        for (Index h = 0; h < H; ++h) {
          const auto a = low.state(b, h), f = full.state(b, h);
          expect_same_bits(Mat<float>(a.S), Mat<float>((f.S + f.S_lo).template cast<S>().template cast<float>()),
                           "the state after one token");
        }
    }
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h) {
        const Index r = t * B + b;
        auto& St = Sr[b * H + h];
        auto& z = zr[b * H + h];
        const Eigen::VectorXd pk = PK.row(r).segment(h * kD, kD).transpose();
        const Eigen::VectorXd pq = PQ.row(r).segment(h * kD, kD).transpose();
        const Eigen::VectorXd v =
            V.row(r).segment(h * kMv, kMv).transpose().template cast<double>();
        const Eigen::MatrixXd next = St.template cast<double>() + pk * v.transpose();
        z += pk;
        const Eigen::VectorXd o = next.transpose() * pq / pq.dot(z);
        St = next.template cast<float>().template cast<S>();
        const Eigen::VectorXd got =
            out.row(b).segment(h * kMv, kMv).transpose().template cast<double>();
        const Eigen::VectorXd f =
            out_f.row(b).segment(h * kMv, kMv).transpose().template cast<double>();
        worst = std::max(worst, (got - o).cwiseAbs().maxCoeff());
        drift = std::max(drift, (got - f).cwiseAbs().maxCoeff());
        scale = std::max(scale, f.cwiseAbs().maxCoeff());
      }
  }
  EXPECT_LE(worst, 1e-3 * scale) << name_of<S>() << ": against the rounding reference";
  const double half_ulp = std::is_same_v<S, bf16> ? 0x1p-9 : 0x1p-12;
  EXPECT_LE(drift, T * half_ulp * scale) << name_of<S>();
  std::printf("[ %s state ] %lld tokens: largest output %.3g, off the rounding reference by %.2e, "
              "off the float decoder by %.2e\n",
              name_of<S>(), static_cast<long long>(T), scale, worst, drift);
}

// save_state / load_state of a decoder with bf16 / half states: the float decoder's file, the
// states widened. Resumed from its own file it continues bit for bit; a float decoder loads
// the same file into the widened states; a float decoder's file loads rounded once, as
// set_state.
TYPED_TEST(LowPrecision, SaveAndLoadLowPrecisionStates) {
  using S = TypeParam;
  using Low = linattn::BatchedRecurrentLinearAttention<EluPlusOne, float, S>;
  using Full = linattn::BatchedRecurrentLinearAttention<EluPlusOne, float>;
  constexpr Index H = 2, B = 3, T = 40, Mv = 72;
  const Mat<float> Q = random_matrix<float>(2 * T * B, H * kD, 41),
                   K = random_matrix<float>(2 * T * B, H * kD, 42),
                   V = random_matrix<float>(2 * T * B, H * Mv, 43);
  Low dec(B, H, kD, Mv);
  Full full(B, H, kD, Mv);
  Mat<float> out(B, H * Mv), out2(B, H * Mv);
  // T is not a multiple of the fold cadence: the file carries the unfolded low parts of z.
  for (Index t = 0; t < T; ++t) {
    dec.step(Q.middleRows(t * B, B), K.middleRows(t * B, B), V.middleRows(t * B, B), out);
    full.step(Q.middleRows(t * B, B), K.middleRows(t * B, B), V.middleRows(t * B, B), out);
  }
  std::stringstream low_file, full_file;
  linattn::save_state(low_file, dec);
  linattn::save_state(full_file, full);
  const std::string low_bytes = low_file.str();
  Low resumed(0, H, kD, Mv);
  linattn::load_state(low_file, resumed);
  ASSERT_EQ(resumed.sequences(), B);
  Full widened(0, H, kD, Mv);
  std::stringstream again(low_bytes);
  linattn::load_state(again, widened);
  Low rounded(0, H, kD, Mv);
  linattn::load_state(full_file, rounded);
  for (Index b = 0; b < B; ++b) {
    EXPECT_EQ(resumed.position(b), T);
    for (Index h = 0; h < H; ++h) {
      const auto st = dec.state(b, h), f = full.state(b, h);
      // state() folds z's low part, as the float decoder's does.
      EXPECT_TRUE(st.z_lo.isZero(0)) << name_of<S>() << ": state() folded";
      expect_same_bits(st.z, f.z, "state().z");
      expect_same_bits(Mat<float>(widened.state(b, h).S), Mat<float>(st.S),
                       "a float decoder's load");
      expect_same_bits(Mat<float>(rounded.state(b, h).S),
                       Mat<float>((f.S + f.S_lo).template cast<S>().template cast<float>()),
                       "a float decoder's file rounded");
    }
  }
  for (Index t = T; t < 2 * T; ++t) {
    dec.step(Q.middleRows(t * B, B), K.middleRows(t * B, B), V.middleRows(t * B, B), out);
    resumed.step(Q.middleRows(t * B, B), K.middleRows(t * B, B), V.middleRows(t * B, B), out2);
    expect_same_bits(out2, out, "the resumed decoder's step");
  }
  std::stringstream after_low, after_resumed;
  linattn::save_state(after_low, dec);
  linattn::save_state(after_resumed, resumed);
  EXPECT_EQ(after_low.str(), after_resumed.str()) << name_of<S>();
}

// Sequences of several widening pieces (256 rows, or whole chunks), with a tail: the pieces
// continue one another bit for bit, single-head and multi-head, both algorithms.
TYPED_TEST(LowPrecision, CausalPiecesContinueExactly) {
  using S = TypeParam;
  constexpr Index N = 701, H = 2;
  const RowMat<S> Q = random_matrix<float>(N, H * kD, 29).template cast<S>(),
                  K = random_matrix<float>(N, H * kD, 30).template cast<S>(),
                  V = random_matrix<float>(N, H * kM, 31).template cast<S>();
  const RowMat<float> Qf = Q.template cast<float>(), Kf = K.template cast<float>(),
                      Vf = V.template cast<float>();
  linattn::ParallelOptions one;
  one.num_threads = 1;
  for (Index chunk : {Index(0), Index(48)}) {
    linattn::CausalOptions o;
    o.chunk_size = chunk;
    o.algorithm = chunk ? linattn::CausalAlgorithm::Chunked : linattn::CausalAlgorithm::Auto;
    linattn::LinearAttentionState<float> st, st_f;
    linattn::Workspace<float> ws, ws_f;
    RowMat<S> out(N, kM);
    RowMat<float> out_f(N, kM);
    linattn::causal_linear_attention(Q.leftCols(kD), K.leftCols(kD), V.leftCols(kM), EluPlusOne{},
                                     st, out, ws, o, one);
    linattn::causal_linear_attention(Qf.leftCols(kD), Kf.leftCols(kD), Vf.leftCols(kM),
                                     EluPlusOne{}, st_f, out_f, ws_f, o, one);
    expect_same_bits(out, RowMat<S>(out_f.template cast<S>()), "causal, several pieces");
    expect_same_bits(st.S, st_f.S, "causal, the state after several pieces");
    RowMat<S> mh(N, H * kM);
    RowMat<float> mh_f(N, H * kM);
    linattn::MultiHeadWorkspace<float> mws, mws_f;
    linattn::multihead_causal_linear_attention(Q, K, V, H, EluPlusOne{}, mh, mws, o, one);
    linattn::multihead_causal_linear_attention(Qf, Kf, Vf, H, EluPlusOne{}, mh_f, mws_f, o, one);
    expect_same_bits(mh, RowMat<S>(mh_f.template cast<S>()), "multi-head, several pieces");
  }
}


// Inputs of magnitude 100 (spec: defined, finite results): the exp paths run in float, so
// neither storage type overflows in the forward kernels.
TYPED_TEST(LowPrecision, MagnitudeHundredStaysFinite) {
  using S = TypeParam;
  const Mat<S> Q = stored<S>(kN, kD, 37, -100, 100), K = stored<S>(kN, kD, 38, -100, 100),
               V = stored<S>(kN, kM, 39, -100, 100);
  const Mat<S> a = linattn::causal_linear_attention(Q, K, V, SoftmaxSplit{});
  const Mat<S> b = linattn::softmax_attention(Q, K, V);
  const Mat<S> c = linattn::linear_attention(Q, K, V, EluPlusOne{});
  for (const Mat<S>* m : {&a, &b, &c}) {
    bool finite = true;
    for (Index i = 0; i < m->size(); ++i) finite = finite && Eigen::numext::isfinite((*m)(i));
    EXPECT_TRUE(finite) << name_of<S>();
  }
  expect_same_bits(a, Mat<S>(linattn::causal_linear_attention(wide(Q), wide(K), wide(V),
                                                              SoftmaxSplit{})
                                 .template cast<S>()),
                   "causal SoftmaxSplit at magnitude 100");
}

// ---------------------------------------------------------------------------------------------
// The batched gated and delta-rule decoders with S kept in bf16 / half. The rule: each token is
// the float step from the kept state, and the state after it is rounded once. The reference is
// that, written plainly: a float decoder whose states are rounded to the storage type (through
// state() and set_state()) after every token. Outputs and states agree bit for bit, with bf16 /
// half tokens into the low-state decoder and the same values as float tokens into the
// reference; M = 37 leaves a packet tail and a scalar tail.
// ---------------------------------------------------------------------------------------------

// Every head's state of `dec` rounded to S, kept in float: the reference's rule.
template <class S, class Dec>
void round_states(Dec& dec) {
  for (Index b = 0; b < dec.sequences(); ++b)
    for (Index h = 0; h < dec.heads(); ++h) {
      auto st = dec.state(b, h);
      st.S = st.S.template cast<S>().template cast<float>();
      dec.set_state(b, h, st, dec.position(b));
    }
}

template <class A, class B>
void expect_same_states(const A& got, const B& want, const char* what) {
  for (Index b = 0; b < want.sequences(); ++b)
    for (Index h = 0; h < want.heads(); ++h) {
      expect_same_bits(Mat<float>(got.state(b, h).S), Mat<float>(want.state(b, h).S), what);
      expect_same_bits(got.state(b, h).z, want.state(b, h).z, what);
    }
}

// The sequence b's token t is row t·B + b of the token matrices, or row t·B + (B − 1 − b) on
// the tokens stepped through step(slots) with the slots listed backwards (t % 3 == 1).
constexpr Index kLowB = 3, kLowT = 12;
inline Index low_row(Index t, Index b) { return t * kLowB + (t % 3 == 1 ? kLowB - 1 - b : b); }
inline bool low_slots(Index t) { return t % 3 == 1; }

// A low-state decoder against the rounding reference over kLowT tokens (step, and step(slots)
// on every third), then extend() of all the tokens of every sequence in one call against the
// steps, and rollback() to the state after kLowT − 1 tokens. feed(dec, t, out, stored) steps
// token t (bf16 / half tokens when `stored`, else the same values in float); gather(dec, out)
// extends all of them with 3 snapshots kept.
template <class S, class Low, class Ref, class Feed, class Gather>
void check_low_state_decoder(Low low, Ref ref, Index width, const Feed& feed, const Gather& gather,
                             const char* what) {
  constexpr Index B = kLowB, T = kLowT;
  Low by_extend = low, before_last = low;
  Mat<float> out(B, width), out_ref(B, width);
  std::vector<Mat<float>> outs;
  for (Index t = 0; t < T; ++t) {
    if (t == T - 1) before_last = low;
    feed(low, t, out, true);
    feed(ref, t, out_ref, false);
    round_states<S>(ref);
    expect_same_bits(out, out_ref, what);
    expect_same_states(low, ref, what);
    outs.push_back(out);
  }
  Mat<float> ext(B * T, width);
  by_extend.keep_snapshots(3);
  gather(by_extend, ext);
  for (Index t = 0; t < T; ++t)
    for (Index b = 0; b < B; ++b)
      expect_same_bits(Mat<float>(ext.row(b * T + t)),
                       Mat<float>(outs[std::size_t(t)].row(low_row(t, b) - t * B)), what);
  expect_same_states(by_extend, low, what);
  for (Index b = 0; b < B; ++b) by_extend.rollback(b, T - 1);
  expect_same_states(by_extend, before_last, what);
}

// Rows of x for the tokens of every sequence in order (sequence-major), for extend().
template <class S>
Mat<S> low_gathered(const Mat<S>& x) {
  Mat<S> g(kLowB * kLowT, x.cols());
  for (Index b = 0; b < kLowB; ++b)
    for (Index t = 0; t < kLowT; ++t) g.row(b * kLowT + t) = x.row(low_row(t, b));
  return g;
}

// Token t's rows of x: as stored, or widened.
template <class S>
Mat<S> low_rows(const Mat<S>& x, Index t) {
  return x.middleRows(t * kLowB, kLowB);
}

TYPED_TEST(LowPrecision, BatchedDeltaRuleLowPrecisionStates) {
  using S = TypeParam;
  using L2 = linattn::L2Normalize<linattn::Identity>;
  constexpr Index B = kLowB, T = kLowT, H = 4, Hk = 2, D = 16, M = 37;
  linattn::DeltaOptions opts;
  opts.key_heads = Hk;  // shared key heads (GVA): value head h reads key head h / 2
  opts.scale = 0.25;
  const Mat<S> Q = stored<S>(B * T, Hk * D, 61), K = stored<S>(B * T, Hk * D, 62),
               V = stored<S>(B * T, H * M, 63), beta = stored<S>(B * T, H, 64, 0.1, 1.9),
               g1 = stored<S>(B * T, H, 65, -0.4, -0.01),
               gc = stored<S>(B * T, H * D, 66, -0.4, -0.01);
  const Eigen::VectorXi back = (Eigen::VectorXi(3) << 2, 1, 0).finished();
  for (const bool channels : {false, true}) {
    const Mat<S>& G = channels ? gc : g1;
    const auto feed = [&](auto& dec, Index t, Mat<float>& out, bool as_stored) {
      const Mat<S> q = low_rows(Q, t), k = low_rows(K, t), v = low_rows(V, t),
                   bt = low_rows(beta, t), g = low_rows(G, t);
      if (as_stored && low_slots(t))
        dec.step(back, q, k, v, bt, g, out);
      else if (as_stored)
        dec.step(q, k, v, bt, g, out);
      else if (low_slots(t))
        dec.step(back, wide(q), wide(k), wide(v), wide(bt), wide(g), out);
      else
        dec.step(wide(q), wide(k), wide(v), wide(bt), wide(g), out);
    };
    const auto gather = [&](auto& dec, Mat<float>& out) {
      const std::vector<int> cu = {0, int(T), int(2 * T), int(3 * T)};
      dec.extend(Eigen::VectorXi::LinSpaced(B, 0, B - 1), cu, low_gathered(Q), low_gathered(K),
                 low_gathered(V), low_gathered(beta), low_gathered(G), out);
    };
    check_low_state_decoder<S>(
        linattn::BatchedRecurrentDeltaRule<L2, float, S>(B, H, D, M, L2{}, opts),
        linattn::BatchedRecurrentDeltaRule<L2, float>(B, H, D, M, L2{}, opts), H * M, feed, gather,
        channels ? "delta rule, per-channel decays" : "delta rule, scalar decays");
  }
}

TYPED_TEST(LowPrecision, BatchedGatedLowPrecisionStates) {
  using S = TypeParam;
  constexpr Index B = kLowB, T = kLowT, H = 2, D = 16, M = 37;
  linattn::GatedOptions opts;
  opts.scale = 0.25;
  const Mat<S> Q = stored<S>(B * T, H * D, 71), K = stored<S>(B * T, H * D, 72),
               V = stored<S>(B * T, H * M, 73),
               // -0.4 ... -0.2: the e^g form; -0.05 ... -0.01: the expm1 form of mild gates
      g1 = stored<S>(B * T, H, 74, -0.4, -0.2), gf = stored<S>(B * T, H * D, 75, -0.05, -0.01);
  const Eigen::VectorXi back = (Eigen::VectorXi(3) << 2, 1, 0).finished();
  for (const bool per_feature : {false, true}) {
    const Mat<S>& G = per_feature ? gf : g1;
    const auto feed = [&](auto& dec, Index t, Mat<float>& out, bool as_stored) {
      const Mat<S> q = low_rows(Q, t), k = low_rows(K, t), v = low_rows(V, t), g = low_rows(G, t);
      if (as_stored && low_slots(t))
        dec.step(back, q, k, v, g, out);
      else if (as_stored)
        dec.step(q, k, v, g, out);
      else if (low_slots(t))
        dec.step(back, wide(q), wide(k), wide(v), wide(g), out);
      else
        dec.step(wide(q), wide(k), wide(v), wide(g), out);
    };
    const auto gather = [&](auto& dec, Mat<float>& out) {
      const std::vector<int> cu = {0, int(T), int(2 * T), int(3 * T)};
      dec.extend(Eigen::VectorXi::LinSpaced(B, 0, B - 1), cu, low_gathered(Q), low_gathered(K),
                 low_gathered(V), low_gathered(G), out);
    };
    check_low_state_decoder<S>(linattn::BatchedRecurrentGatedAttention<linattn::Identity, float, S>(
                                   B, H, D, M, linattn::Identity{}, opts),
                               linattn::BatchedRecurrentGatedAttention<linattn::Identity, float>(
                                   B, H, D, M, linattn::Identity{}, opts),
                               H * M, feed, gather,
                               per_feature ? "gated, per-feature gates" : "gated, scalar decays");
  }
}

// The float-state decoders on bf16 tokens: the float tokens' outputs, rounded once when `out`
// is bf16 too.
TEST(LowPrecisionBf16, BatchedDecodersTakeStoredTokens) {
  using L2 = linattn::L2Normalize<linattn::Identity>;
  constexpr Index B = 3, H = 2, D = 16, M = 37;
  const Mat<bf16> Q = stored<bf16>(B, H * D, 81), K = stored<bf16>(B, H * D, 82),
                  V = stored<bf16>(B, H * M, 83), beta = stored<bf16>(B, H, 84, 0.1, 1.9),
                  G = stored<bf16>(B, H, 85, -0.4, -0.01);
  for (int pass = 0; pass < 2; ++pass) {
    linattn::BatchedRecurrentDeltaRule<L2, float> delta(B, H, D, M), delta_f(B, H, D, M);
    linattn::BatchedRecurrentGatedAttention<linattn::Identity, float> gated(B, H, D, M),
        gated_f(B, H, D, M);
    Mat<float> out(B, H * M), out_f(B, H * M);
    Mat<bf16> out_b(B, H * M);
    delta_f.step(wide(Q), wide(K), wide(V), wide(beta), wide(G), out_f);
    if (pass == 0) {
      delta.step(Q, K, V, beta, G, out);
      expect_same_bits(out, out_f, "delta rule on bf16 tokens");
    } else {
      delta.step(Q, K, V, beta, G, out_b);
      expect_same_bits(out_b, Mat<bf16>(out_f.cast<bf16>()), "delta rule, bf16 out");
    }
    gated_f.step(wide(Q), wide(K), wide(V), wide(G), out_f);
    gated.step(Q, K, V, G, out);
    expect_same_bits(out, out_f, "gated on bf16 tokens");
  }
}

// save_state / load_state of bf16-state decoders: the file records the storage type and
// resumes bit for bit; a decoder of another storage type refuses it, naming both.
template <class Low, class Full, class Other, class Step>
void check_low_state_file(Low dec, Full full, Other other, const Step& step) {
  for (Index t = 0; t < 5; ++t) step(dec, t);
  std::stringstream file;
  linattn::save_state(file, dec);
  const std::string bytes = file.str();
  Low resumed = dec;
  resumed.reset();
  linattn::load_state(file, resumed);
  for (Index b = 0; b < dec.sequences(); ++b) EXPECT_EQ(resumed.position(b), 5);
  expect_same_states(resumed, dec, "loaded");
  for (Index t = 5; t < 8; ++t) {
    step(dec, t);
    step(resumed, t);
  }
  expect_same_states(resumed, dec, "resumed");
  std::stringstream a, b;
  linattn::save_state(a, dec);
  linattn::save_state(b, resumed);
  EXPECT_EQ(a.str(), b.str());
  const auto refused = [&](auto& target, const std::string& file_bytes, const char* need) {
    std::stringstream in(file_bytes);
    try {
      linattn::load_state(in, target);
      ADD_FAILURE() << "loaded a file of another storage type";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("storage type mismatch"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(need), std::string::npos) << e.what();
    }
  };
  refused(full, bytes, "keeps S in bf16, the");
  refused(other, bytes, "keeps it in half");
  std::stringstream full_file;
  linattn::save_state(full_file, full);
  const Low kept = dec;
  refused(dec, full_file.str(), "keeps S in float");
  expect_same_states(dec, kept, "after a refused load (strong guarantee)");
}

TEST(LowPrecisionBf16, BatchedDecoderFilesRecordTheStorage) {
  using L2 = linattn::L2Normalize<linattn::Identity>;
  constexpr Index B = 2, H = 2, D = 16, M = 37;
  const Mat<float> Q = random_matrix<float>(8 * B, H * D, 91),
                   K = random_matrix<float>(8 * B, H * D, 92),
                   V = random_matrix<float>(8 * B, H * M, 93),
                   G = random_matrix<float>(8 * B, H * D, 94, -0.3, -0.01);
  const Mat<float> beta = Mat<float>::Constant(8 * B, H, 0.7f);
  Mat<float> out(B, H * M);
  check_low_state_file(
      linattn::BatchedRecurrentDeltaRule<L2, float, bf16>(B, H, D, M),
      linattn::BatchedRecurrentDeltaRule<L2, float>(B, H, D, M),
      linattn::BatchedRecurrentDeltaRule<L2, float, half>(B, H, D, M), [&](auto& dec, Index t) {
        dec.step(Q.middleRows(t * B, B), K.middleRows(t * B, B), V.middleRows(t * B, B),
                 beta.middleRows(t * B, B), G.middleRows(t * B, B), out);
      });
  check_low_state_file(
      linattn::BatchedRecurrentGatedAttention<linattn::Identity, float, bf16>(B, H, D, M),
      linattn::BatchedRecurrentGatedAttention<linattn::Identity, float>(B, H, D, M),
      linattn::BatchedRecurrentGatedAttention<linattn::Identity, float, half>(B, H, D, M),
      [&](auto& dec, Index t) {
        dec.step(Q.middleRows(t * B, B), K.middleRows(t * B, B), V.middleRows(t * B, B),
                 G.middleRows(t * B, B), out);
      });
}

#endif  // LINATTN_TEST_FLOAT

}  // namespace
