// Gradients of softmax attention (softmax_attention_backward.hpp): against central finite
// differences of the naive forward in double, float against double at magnitude 100, the
// saved-forward form (log-sum-exp) against the self-contained one, multi-head against per-head,
// the working-memory bound, no allocation on reuse, and the error messages.
#include <gtest/gtest.h>

#include <linattn/linattn.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gradient_util.hpp"
#include "new_counter.hpp"
#include "test_util.hpp"

namespace {

using test::finite_difference;
using test::Index;
using test::Mat;
using test::MatD;
using test::relative_error;

struct Shape {
  Index N, L, D, M;
};

std::string shape_name(const Shape& s) {
  return "N=" + std::to_string(s.N) + " L=" + std::to_string(s.L) + " D=" + std::to_string(s.D) +
         " M=" + std::to_string(s.M);
}

template <class S>
linattn::AttentionGradients<S> backward(const Mat<S>& Q, const Mat<S>& K, const Mat<S>& V,
                                        const Mat<S>& W, bool causal) {
  return causal ? linattn::causal_softmax_attention_backward(Q, K, V, W)
                : linattn::softmax_attention_backward(Q, K, V, W);
}

// Relative to the largest finite-difference gradient (central differences, h = 1e-5). Measured
// at most 7.0e-11 over the shapes below; the issue asks for 1e-6.
constexpr double kFiniteDifferenceTol = 1e-9;

void check_against_finite_differences(bool causal, const Shape& sh) {
  const MatD Q = test::random_matrix(sh.N, sh.D, test::seed_of({sh.N, sh.D, 61}), -2, 2);
  const MatD K = test::random_matrix(sh.L, sh.D, test::seed_of({sh.L, sh.D, 62}), -2, 2);
  const MatD V = test::random_matrix(sh.L, sh.M, test::seed_of({sh.L, sh.M, 63}));
  const MatD W = test::random_matrix(sh.N, sh.M, test::seed_of({sh.N, sh.M, 64}));
  // The naive forward: the textbook N x L form, independent of the tiles under test.
  const auto forward = [&](const MatD& q, const MatD& k, const MatD& v) -> MatD {
    return causal ? linattn::causal_softmax_attention(q, k, v, linattn::SoftmaxAlgorithm::Naive)
                  : linattn::softmax_attention(q, k, v, linattn::SoftmaxAlgorithm::Naive);
  };
  const auto g = backward<double>(Q, K, V, W, causal);
  const MatD* grads[] = {&g.dQ, &g.dK, &g.dV};
  const char* names[] = {"dQ", "dK", "dV"};
  MatD fd[3];
  double scale = 0;
  for (int w = 0; w < 3; ++w) {
    fd[w] = finite_difference(forward, Q, K, V, W, w);
    scale = std::max(scale, test::max_abs(fd[w]));
  }
  ASSERT_GT(scale, 0.0) << shape_name(sh) << ": a vacuous comparison";
  double worst = 0;
  const std::string what = std::string(causal ? "causal " : "") + shape_name(sh);
  for (int w = 0; w < 3; ++w) {
    const double err = test::max_abs_diff(*grads[w], fd[w]) / scale;
    EXPECT_LE(err, kFiniteDifferenceTol) << what << " " << names[w];
    worst = std::max(worst, err);
  }
  test::report_error(what + " vs finite differences (relative)", worst);
}

TEST(SoftmaxAttentionBackward, MatchesFiniteDifferences) {
  // N = 1; N != L; key tiles of 128 and query tiles of 64 (double) crossed, not multiples;
  // D != M.
  for (const Shape& sh : std::vector<Shape>{{1, 1, 3, 2}, {1, 7, 4, 5}, {9, 4, 3, 6},
                                            {70, 133, 3, 2}})
    check_against_finite_differences(false, sh);
}

TEST(CausalSoftmaxAttentionBackward, MatchesFiniteDifferences) {
  for (const Shape& sh : std::vector<Shape>{{1, 1, 3, 2}, {20, 20, 4, 3}, {140, 140, 2, 3}})
    check_against_finite_differences(true, sh);
}

// Magnitude 100: scores up to 10^4·D/√D. Finite; float within its rounding of double (on the
// same, float-representable inputs). A score s is rounded by about u·|s| in float, which moves
// P by that factor: the error scales with κ = max|q_i|·max|k_j|/√D, the largest possible
// score, as it does for the forward (and for any float implementation).
TEST(SoftmaxAttentionBackward, FloatMatchesDoubleAtLargeMagnitudes) {
  for (const bool causal : {false, true})
    for (const double magnitude : {2.0, 100.0}) {
      const Index N = 300, D = 16, M = 8;
      const Mat<float> Qf = test::random_matrix<float>(N, D, 71, -magnitude, magnitude);
      const Mat<float> Kf = test::random_matrix<float>(N, D, 72, -magnitude, magnitude);
      const Mat<float> Vf = test::random_matrix<float>(N, M, 73);
      const Mat<float> Wf = test::random_matrix<float>(N, M, 74);
      const MatD Q = Qf.cast<double>(), K = Kf.cast<double>(), V = Vf.cast<double>(),
                 W = Wf.cast<double>();
      const auto gd = backward<double>(Q, K, V, W, causal);
      const auto gf = backward<float>(Qf, Kf, Vf, Wf, causal);
      const std::string tag = std::string(causal ? "causal" : "non-causal") + " magnitude " +
                              std::to_string(int(magnitude));
      ASSERT_TRUE(test::all_finite(gf.dQ) && test::all_finite(gf.dK) && test::all_finite(gf.dV))
          << tag;
      const double kappa = Q.rowwise().norm().maxCoeff() * K.rowwise().norm().maxCoeff() /
                           std::sqrt(double(D));
      const double e = std::max({relative_error(gf.dQ.cast<double>(), gd.dQ),
                                 relative_error(gf.dK.cast<double>(), gd.dK),
                                 relative_error(gf.dV.cast<double>(), gd.dV)});
      const double u = std::numeric_limits<float>::epsilon() / 2;
      test::report_error(tag + " float vs double (relative), in units of u·κ", e / (u * kappa));
      // Measured at most 1.9 u·κ (κ = 5.5 at magnitude 2, 1.4e4 at 100).
      EXPECT_LE(e, 8 * u * std::max(1.0, kappa)) << tag << ", κ = " << kappa;
    }
}

// The saved-forward form (the forward's output and log-sum-exp) gives the self-contained
// form's gradients, and lse is log Σ_j exp(s_ij) of the naive scores.
TEST(SoftmaxAttentionBackward, SavedForwardEqualsRecomputed) {
  for (const bool causal : {false, true}) {
    const Index N = 150, L = causal ? 150 : 170, D = 5, M = 7;
    const MatD Q = test::random_matrix(N, D, 81, -3, 3), K = test::random_matrix(L, D, 82, -3, 3);
    const MatD V = test::random_matrix(L, M, 83), W = test::random_matrix(N, M, 84);
    MatD out(N, M), dQ(N, D), dK(L, D), dV(L, M);
    Eigen::VectorXd lse(N);
    linattn::Workspace<double> ws;
    if (causal) {
      linattn::causal_softmax_attention(Q, K, V, out, lse, ws);
      linattn::causal_softmax_attention_backward(Q, K, V, out, lse, W, dQ, dK, dV, ws);
    } else {
      linattn::softmax_attention(Q, K, V, out, lse, ws);
      linattn::softmax_attention_backward(Q, K, V, out, lse, W, dQ, dK, dV, ws);
    }
    const MatD expected_out = causal ? linattn::causal_softmax_attention(Q, K, V)
                                     : linattn::softmax_attention(Q, K, V);
    EXPECT_LE(test::max_abs_diff(out, expected_out), 1e-15) << "the lse forward's output";
    double lse_err = 0;
    for (Index i = 0; i < N; ++i) {
      const Index keys = causal ? i + 1 : L;
      const Eigen::VectorXd s = K.topRows(keys) * Q.row(i).transpose() / std::sqrt(double(D));
      const double m = s.maxCoeff();
      lse_err = std::max(lse_err, std::abs(lse(i) - (m + std::log((s.array() - m).exp().sum()))));
    }
    EXPECT_LE(lse_err, 1e-14) << "lse";
    const auto g = backward<double>(Q, K, V, W, causal);
    EXPECT_LE(relative_error(dQ, g.dQ), 1e-14);
    EXPECT_LE(relative_error(dK, g.dK), 1e-14);
    EXPECT_LE(relative_error(dV, g.dV), 1e-14);
  }
}

// No keys: the output is the constant 0, so dQ is 0; dK and dV are empty.
TEST(SoftmaxAttentionBackward, NoKeysGivesZeroGradient) {
  const MatD Q = MatD::Ones(3, 2), K(0, 2), V(0, 4), W = MatD::Ones(3, 4);
  const auto g = linattn::softmax_attention_backward(Q, K, V, W);
  EXPECT_EQ(g.dQ.rows(), 3);
  EXPECT_EQ(g.dQ.cwiseAbs().maxCoeff(), 0.0);
  EXPECT_EQ(g.dK.rows(), 0);
  Eigen::VectorXd lse(3);
  MatD out(3, 4);
  linattn::Workspace<double> ws;
  linattn::softmax_attention(Q, K, V, out, lse, ws);
  EXPECT_TRUE((lse.array() == -std::numeric_limits<double>::infinity()).all());
}

// Multi-head equals per-head on each head's columns (a few ulps: see test_backward.cpp), for
// 1 and 3 threads, column- and row-major packed memory.
template <class S>
void check_multihead(bool causal) {
  const Index N = 140, H = 3, D = 4, M = 5;
  const Mat<S> Q = test::random_matrix<S>(N, H * D, 91, -2, 2);
  const Mat<S> K = test::random_matrix<S>(N, H * D, 92, -2, 2);
  const Mat<S> V = test::random_matrix<S>(N, H * M, 93), W = test::random_matrix<S>(N, H * M, 94);
  Mat<S> eQ(N, H * D), eK(N, H * D), eV(N, H * M);
  for (Index h = 0; h < H; ++h) {
    const Mat<S> q = Q.middleCols(h * D, D), k = K.middleCols(h * D, D);
    const Mat<S> v = V.middleCols(h * M, M), w = W.middleCols(h * M, M);
    const auto g = backward<S>(q, k, v, w, causal);
    eQ.middleCols(h * D, D) = g.dQ;
    eK.middleCols(h * D, D) = g.dK;
    eV.middleCols(h * M, M) = g.dV;
  }
  const test::RowMat<S> Qr = Q, Kr = K, Vr = V, Wr = W;
  const double scale = std::max({test::max_abs(eQ), test::max_abs(eK), test::max_abs(eV)});
  for (const int threads : {1, 3}) {
    linattn::ParallelOptions par;
    par.num_threads = threads;
    const auto g = causal ? linattn::multihead_causal_softmax_attention_backward(Q, K, V, W, H, par)
                          : linattn::multihead_softmax_attention_backward(Q, K, V, W, H, par);
    const auto gr =
        causal ? linattn::multihead_causal_softmax_attention_backward(Qr, Kr, Vr, Wr, H, par)
               : linattn::multihead_softmax_attention_backward(Qr, Kr, Vr, Wr, H, par);
    const std::string tag = std::string(causal ? "causal" : "non-causal") + ", " +
                            std::to_string(threads) + " thread(s)";
    const double tol = 64 * std::numeric_limits<S>::epsilon() * scale;
    for (const auto* gg : {&g, &gr}) {
      EXPECT_LE(test::max_abs_diff(gg->dQ, eQ), tol) << tag;
      EXPECT_LE(test::max_abs_diff(gg->dK, eK), tol) << tag;
      EXPECT_LE(test::max_abs_diff(gg->dV, eV), tol) << tag;
    }
  }
}

TEST(MultiHeadSoftmaxBackward, EqualsPerHeadBackward) {
  IF_FLOAT(check_multihead<float>(false));
  IF_FLOAT(check_multihead<float>(true));
  IF_DOUBLE(check_multihead<double>(true));
}

// Working memory: two vectors of N (ℓ and D) plus tiles independent of N; never N x L. A second
// call of the same shape allocates nothing.
TEST(SoftmaxAttentionBackward, WorkingMemoryIsLinearInNAndReuseAllocatesNothing) {
  const Index D = 8, M = 8;
  const auto bytes = [&](Index N, bool causal) {
    const Mat<float> Q = test::random_matrix<float>(N, D, 41), K = test::random_matrix<float>(N, D, 42);
    const Mat<float> V = test::random_matrix<float>(N, M, 43), W = test::random_matrix<float>(N, M, 44);
    Mat<float> dQ(N, D), dK(N, D), dV(N, M);
    linattn::Workspace<float> ws;
    const auto call = [&] {
      if (causal)
        linattn::causal_softmax_attention_backward(Q, K, V, W, dQ, dK, dV, ws);
      else
        linattn::softmax_attention_backward(Q, K, V, W, dQ, dK, dV, ws);
    };
    call();
    new_counter::calls = 0;
    new_counter::counting = true;
    call();
    new_counter::counting = false;
    EXPECT_EQ(new_counter::calls.load(), 0) << "second call allocated, N = " << N;
    return ws.bytes();
  };
  // Beyond ℓ and D, the tiles: score tiles of at most 128 KiB (a few of them), key and value
  // tiles of 128 rows. The same bound for both N; the tiles' exact sizes follow N's remainder.
  for (const bool causal : {false, true})
    for (const Index N : {300, 2000}) {
      const std::size_t total = bytes(N, causal), per_row = 2 * std::size_t(N) * sizeof(float);
      ASSERT_GE(total, per_row);
      EXPECT_LE(total - per_row, std::size_t(512) * 1024) << (causal ? "causal " : "") << N;
      if (N >= 2000) {  // where one N x L score matrix would be 16 MB
        EXPECT_LT(total, std::size_t(N) * N * sizeof(float) / 32) << (causal ? "causal " : "") << N;
      }
    }
}

TEST(SoftmaxAttentionBackward, ErrorMessagesNameTheFunctionAndShapes) {
  const MatD Q = MatD::Ones(5, 3), K = MatD::Ones(6, 3), V = MatD::Ones(6, 2);
  test::expect_invalid([&] { linattn::softmax_attention_backward(Q, K, V, MatD::Ones(4, 2)); },
                       {"softmax_attention_backward", "dOut is 4x2", "5x2"}, "bad dOut");
  test::expect_invalid(
      [&] { linattn::causal_softmax_attention_backward(Q, K, V, MatD::Ones(5, 2)); },
      {"causal_softmax_attention_backward", "N == L", "K is 6x3"}, "causal N != L");
  MatD out(5, 2), dQ(5, 3), dK(6, 3), dV(6, 2);
  Eigen::VectorXd lse(4);
  linattn::Workspace<double> ws;
  test::expect_invalid([&] { linattn::softmax_attention(Q, K, V, out, lse, ws); },
                       {"softmax_attention", "lse has 4 entries", "5"}, "short lse");
  test::expect_invalid(
      [&] { linattn::softmax_attention_backward(Q, K, V, out, lse, MatD::Ones(5, 2), dQ, dK, dV, ws); },
      std::vector<std::string>{"softmax_attention_backward", "lse has 4 entries"}, "short lse, backward");
  test::expect_invalid(
      [&] {
        linattn::softmax_attention_backward(Q, K, V, MatD::Ones(5, 3), Eigen::VectorXd::Zero(5),
                                            MatD::Ones(5, 2), dQ, dK, dV, ws);
      },
      {"softmax_attention_backward", "out is 5x3", "5x2"}, "bad out");
  MatD g = MatD::Ones(5, 2);
  test::expect_invalid(
      [&] { linattn::softmax_attention_backward(Q, K, V, g, dQ, dK, g, ws); },
      {"softmax_attention_backward", "dV is 5x2", "6x2"}, "bad dV");
  test::expect_invalid(
      [&] {
        linattn::multihead_softmax_attention_backward(MatD::Ones(5, 6), MatD::Ones(5, 6),
                                                      MatD::Ones(5, 4), MatD::Ones(5, 4), 4);
      },
      std::vector<std::string>{"multihead_softmax_attention_backward", "heads = 4"}, "bad heads");
}

}  // namespace
