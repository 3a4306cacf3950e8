// The short convolution (layers/short_convolution.hpp): the forward against its formula in long
// double (W = 1 … 5, with and without bias and SiLU, carried states, row-major and column-major
// inputs, N shorter than the window), pieces and decode steps against one call bit for bit,
// packed sequences against separate calls (a NaN in one sequence stays in it), bf16 storage,
// the gradients against central differences, the errors, and an allocation-free decode step.
#ifndef EIGEN_RUNTIME_NO_MALLOC
#define EIGEN_RUNTIME_NO_MALLOC
#endif
// clang-format off
#include "eigen_assert_hook.hpp"  // first: before any Eigen header
#include "allocation_count.hpp"  // counts Eigen allocations and global operator new
// clang-format on

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/layers.hpp>
#include <string>
#include <vector>

#include "gradient_util.hpp"
#include "test_util.hpp"

namespace {

using linattn::ConvActivation;
using linattn::ShortConvOptions;
using test::Index;
using MatD = Eigen::MatrixXd;
using VecD = Eigen::VectorXd;
using RowD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using LD = long double;
using StateD = linattn::ShortConvState<double>;
using Needles = std::vector<std::string>;

MatD frand(Index rows, Index cols, std::uint32_t seed) {
  return test::random_matrix<double>(rows, cols, seed);
}

// y_t = act(b + Σ_i w(·, i) x_{t−(W−1)+i}) over [state; X], in long double.
MatD reference(const MatD& X, const MatD& w, const VecD& b, const StateD& st, bool silu) {
  const Index N = X.rows(), C = X.cols(), W = w.cols(), L = W - 1;
  MatD y(N, C);
  for (Index t = 0; t < N; ++t)
    for (Index c = 0; c < C; ++c) {
      LD u = b.size() ? LD(b(c)) : 0;
      for (Index i = 0; i < W; ++i) {
        const Index s = t - L + i;
        const LD x = s >= 0 ? LD(X(s, c)) : (st.size() ? LD(st(L + s, c)) : 0);
        u += LD(w(c, i)) * x;
      }
      y(t, c) = double(silu ? u / (1 + std::exp(-u)) : u);
    }
  return y;
}

TEST(short_convolution, AgainstItsFormula) {
  for (const Index W : {Index(1), Index(2), Index(4), Index(5)})
    for (const Index N : {Index(1), Index(3), Index(17)})
      for (const bool silu : {false, true})
        for (const bool bias : {false, true})
          for (const bool carried : {false, true}) {
            SCOPED_TRACE("W = " + std::to_string(W) + ", N = " + std::to_string(N) +
                         (silu ? ", SiLU" : "") + (bias ? ", bias" : "") +
                         (carried ? ", carried" : ""));
            const Index C = 7;
            const MatD X = frand(N, C, 1), w = frand(C, W, 2);
            const VecD b = bias ? VecD(frand(C, 1, 3)) : VecD();
            StateD st;
            if (carried && W > 1) st = frand(W - 1, C, 4);
            const StateD st0 = st;
            ShortConvOptions o;
            o.activation = silu ? ConvActivation::Silu : ConvActivation::None;
            const MatD want = reference(X, w, b, st0, silu);
            const MatD got = linattn::short_convolution(X, w, b, st, o);
            EXPECT_LE(test::relative_error(got, want), 1e-15);
            // The state is the last W − 1 rows of [state; X].
            MatD all(W - 1 + N, C);
            all.topRows(W - 1) = st0.size() ? MatD(st0) : MatD::Zero(W - 1, C);
            all.bottomRows(N) = X;
            EXPECT_EQ(MatD(st), all.bottomRows(W - 1));
            // Row-major inputs and a weight read as PyTorch's [C, 1, W] buffer give the same bits.
            const RowD Xr = X;
            const RowD wr = w;
            StateD st2 = st0;
            RowD out(N, C);
            linattn::Workspace<double> ws;
            linattn::short_convolution(Xr, wr, b, st2, out, ws, o);
            EXPECT_EQ(MatD(out), got);
            // float: within float's rounding.
            linattn::ShortConvState<float> sf = st0.cast<float>();
            const Eigen::MatrixXf gf = linattn::short_convolution(
                X.cast<float>(), w.cast<float>(), Eigen::VectorXf(b.cast<float>()), sf, o);
            EXPECT_LE(test::relative_error(gf.cast<double>(), want), 2e-6);
          }
}

TEST(short_convolution, PiecesAndStepsGiveTheSameBits) {
  const Index N = 23, C = 9, W = 4;
  const MatD X = frand(N, C, 5), w = frand(C, W, 6);
  const VecD b = frand(C, 1, 7);
  StateD st;
  const MatD whole = linattn::short_convolution(X, w, b, st);
  linattn::Workspace<double> ws;
  for (const Index cut : {Index(1), Index(2), Index(3), Index(10)}) {
    StateD s;
    MatD out(N, C);
    linattn::short_convolution(X.topRows(cut), w, b, s, out.topRows(cut), ws);
    linattn::short_convolution(X.bottomRows(N - cut), w, b, s, out.bottomRows(N - cut), ws);
    EXPECT_EQ(out, whole) << "cut " << cut;
    EXPECT_EQ(s, st);
  }
  // Token by token, through the batched step (B = 1) and the one-sequence step.
  std::vector<StateD> states(1);
  StateD one;
  MatD y(1, C);
  VecD y1(C);
  for (Index t = 0; t < N; ++t) {
    linattn::short_convolution_step(X.row(t), w, b, states, y, ws);
    linattn::short_convolution_step(X.row(t), w, b, one, y1);
    EXPECT_EQ(y.row(0), whole.row(t)) << "token " << t;
    EXPECT_EQ(y1.transpose(), whole.row(t)) << "token " << t;
  }
  EXPECT_EQ(states[0], st);
}

TEST(short_convolution, PackedSequencesStayApart) {
  const Index C = 6, W = 4;
  const std::vector<int> cu = {0, 5, 5, 7, 19};
  const Index N = cu.back(), B = Index(cu.size()) - 1;
  MatD X = frand(N, C, 8);
  X(3, 2) = std::numeric_limits<double>::quiet_NaN();  // sequence 0 only
  const MatD w = frand(C, W, 9);
  const VecD b = frand(C, 1, 10);
  std::vector<StateD> states(static_cast<std::size_t>(B));
  states[3] = frand(W - 1, C, 11);
  const std::vector<StateD> initial = states;
  MatD out(N, C);
  linattn::Workspace<double> ws;
  linattn::batched_short_convolution(X, w, b, cu, states, out, ws);
  for (Index s = 0; s < B; ++s) {
    StateD st = initial[std::size_t(s)];
    const MatD want = linattn::short_convolution(X.middleRows(cu[s], cu[s + 1] - cu[s]), w, b, st);
    EXPECT_TRUE(out.middleRows(cu[s], cu[s + 1] - cu[s]).cwiseEqual(want).count() +
                    want.array().isNaN().count() ==
                want.size())
        << "sequence " << s;
    if (s > 0) {
      EXPECT_TRUE(out.middleRows(cu[s], cu[s + 1] - cu[s]).allFinite()) << "sequence " << s;
      EXPECT_EQ(states[std::size_t(s)], st);
    }
  }
  // A decode step for the four sequences continues each of them.
  const MatD x = frand(B, C, 12);
  MatD y(B, C);
  linattn::short_convolution_step(x, w, b, states, y, ws);
  for (Index s = 1; s < B; ++s) {
    MatD Xs(cu[s + 1] - cu[s] + 1, C);
    Xs << X.middleRows(cu[s], cu[s + 1] - cu[s]), x.row(s);
    StateD st = initial[std::size_t(s)];
    EXPECT_EQ(y.row(s), linattn::short_convolution(Xs, w, b, st).bottomRows(1)) << "sequence " << s;
  }
}

TEST(short_convolution, Bf16StorageComputesInFloat) {
  const Index N = 12, C = 5, W = 4;
  using B16 = Eigen::bfloat16;
  const Eigen::Matrix<B16, -1, -1> X = frand(N, C, 13).cast<B16>(), w = frand(C, W, 14).cast<B16>();
  const Eigen::Matrix<B16, -1, 1> b = frand(C, 1, 15).cast<B16>();
  linattn::ShortConvState<float> st;
  const Eigen::Matrix<B16, -1, -1> y = linattn::short_convolution(X, w, b, st);
  linattn::ShortConvState<float> sf;
  const Eigen::MatrixXf want = linattn::short_convolution(X.cast<float>(), w.cast<float>(),
                                                          Eigen::VectorXf(b.cast<float>()), sf);
  EXPECT_EQ(y, want.cast<B16>());
  EXPECT_EQ(st, sf);
}

TEST(short_convolution, GradientsAgainstCentralDifferences) {
  const Index C = 4;
  const std::vector<int> cu = {0, 2, 9, 10};
  const Index N = cu.back();
  for (const Index W : {Index(1), Index(3), Index(4)})
    for (const bool silu : {false, true}) {
      SCOPED_TRACE("W = " + std::to_string(W) + (silu ? ", SiLU" : ""));
      ShortConvOptions o;
      o.activation = silu ? ConvActivation::Silu : ConvActivation::None;
      MatD X = frand(N, C, 16), w = frand(C, W, 17), b = frand(C, 1, 18);
      std::vector<MatD> init = {frand(W - 1, C, 19), frand(W - 1, C, 20), frand(W - 1, C, 21)};
      const MatD G = frand(N, C, 22);
      const auto loss = [&] {
        std::vector<StateD> st(init.begin(), init.end());
        MatD out(N, C);
        linattn::Workspace<double> ws;
        linattn::batched_short_convolution(X, w, VecD(b), cu, st, out, ws, o);
        return out.cwiseProduct(G).sum();
      };
      const std::vector<StateD> st0(init.begin(), init.end());
      const auto g = linattn::batched_short_convolution_backward(X, w, VecD(b), cu, st0, G, o);
      EXPECT_LE(test::relative_error(g.dX, test::central_differences(loss, X)), 1e-8);
      EXPECT_LE(test::relative_error(g.dweight, test::central_differences(loss, w)), 1e-8);
      EXPECT_LE(test::relative_error(g.dbias, test::central_differences(loss, b)), 1e-8);
      ASSERT_EQ(g.dinitial.size(), init.size());
      for (std::size_t s = 0; s < init.size(); ++s)
        if (W > 1) {
          EXPECT_LE(test::relative_error(MatD(g.dinitial[s]), test::central_differences(loss, init[s])), 1e-8) << s;
        }
      // From zeros, without bias: the one-sequence form.
      const auto loss0 = [&] {
        return linattn::short_convolution(X, w, VecD(), o).cwiseProduct(G).sum();
      };
      const auto g0 = linattn::short_convolution_backward(X, w, VecD(), G, o);
      EXPECT_LE(test::relative_error(g0.dX, test::central_differences(loss0, X)), 1e-8);
      EXPECT_LE(test::relative_error(g0.dweight, test::central_differences(loss0, w)), 1e-8);
      EXPECT_EQ(g0.dbias.size(), 0);
      EXPECT_TRUE(g0.dinitial.empty());
    }
}

TEST(short_convolution, Errors) {
  const MatD X = frand(5, 4, 23), w = frand(4, 3, 24);
  const VecD b = frand(4, 1, 25);
  StateD st;
  test::expect_invalid(
      [&] { linattn::short_convolution(X, MatD(frand(3, 3, 1)), b, st); },
      Needles{"short_convolution", "weight must be C x W", "X is 5x4", "weight is 3x3"},
      "weight rows");
  test::expect_invalid([&] { linattn::short_convolution(X, MatD(4, 0), b, st); },
                       Needles{"kernel size W >= 1"}, "W = 0");
  test::expect_invalid([&] { linattn::short_convolution(X, w, VecD(VecD::Zero(3)), st); },
                       Needles{"bias must be empty (none) or a vector of C = 4"}, "bias");
  StateD bad = frand(3, 4, 26);
  test::expect_invalid([&] { linattn::short_convolution(X, w, b, bad); },
                       Needles{"state is 3x4 but must be empty or 2x4"}, "state");
  std::vector<StateD> states(2);
  MatD out(5, 4);
  linattn::Workspace<double> ws;
  test::expect_invalid(
      [&] {
        linattn::batched_short_convolution(X, w, b, std::vector<int>{0, 5}, states, out, ws);
      },
      Needles{"batched_short_convolution", "states holds 2 states but the offsets give B = 1"},
      "states count");
  test::expect_invalid(
      [&] {
        linattn::batched_short_convolution(X, w, b, std::vector<int>{0, 4}, states, out, ws);
      },
      Needles{"offsets must start at 0 and end at 5"}, "offsets");
  MatD Xm = X;
  test::expect_invalid([&] { linattn::short_convolution(Xm, w, b, st, Xm, ws); },
                       Needles{"the output overlaps the memory of X"}, "overlap");
  MatD y(1, 4);
  test::expect_invalid(
      [&] { linattn::short_convolution_step(X.topRows(1), w, b, states, y, ws); },
      Needles{"short_convolution_step", "states holds 2 states but x has B = 1 rows"}, "step");
  test::expect_invalid([&] { linattn::short_convolution_backward(X, w, b, MatD(frand(4, 4, 2))); },
                       Needles{"short_convolution_backward", "dY is 4x4 but must be 5x4"}, "dY");
}

TEST(short_convolution, DecodeStepAllocatesNothing) {
  const Index B = 3, C = 8, W = 4;
  const Eigen::MatrixXf w = Eigen::MatrixXf::Random(C, W), x = Eigen::MatrixXf::Random(B, C);
  const Eigen::VectorXf b = Eigen::VectorXf::Random(C);
  std::vector<linattn::ShortConvState<float>> states(B);
  Eigen::MatrixXf y(B, C);
  linattn::Workspace<float> ws;
  linattn::short_convolution_step(x, w, b, states, y, ws);  // sizes the states and the workspace
  const test::Allocations a = test::allocations_in([&] {
    for (int t = 0; t < 5; ++t) linattn::short_convolution_step(x, w, b, states, y, ws);
  });
  EXPECT_EQ(a.eigen, 0);
  EXPECT_EQ(a.news, 0);
}

}  // namespace
