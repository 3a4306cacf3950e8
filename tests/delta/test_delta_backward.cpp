// The delta rule's gradients (spec §9.3, "Gradients"): delta_rule_attention_backward()
// against the token-level chain rule of delta_reference.hpp (long double, every state kept),
// which is itself checked against central finite differences of the reference forward; with and
// without decay, unit (L2Normalize<Silu>) and raw (Identity) keys, several chunk sizes, a carried
// initial state and a final state's gradient, β = 1 on unit keys (the singular factor), float
// and double; the multi-head form against per-head calls; the out-parameter form allocation-free
// on reuse; argument errors.
#include "eigen_assert_hook.hpp"  // first: before any Eigen header
#include "allocation_count.hpp"

#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "delta_reference.hpp"
#include "gradient_util.hpp"
#include "test_util.hpp"

namespace {

using linattn::CausalAlgorithm;
using linattn::DeltaOptions;
using linattn::Identity;
using SiluL2 = linattn::L2Normalize<linattn::Silu>;
using test::Index;
using test::Mat;
using test::MatD;
using test::RowMat;
template <class S>
using Vec = Eigen::Matrix<S, Eigen::Dynamic, 1>;
using VecD = Vec<double>;
template <class S>
using State = linattn::LinearAttentionState<S>;
using Needles = std::vector<std::string>;

// ---------------------------------------------------------------------------------------------
// Measured errors and the bounds set from them (GCC, x86-64, -O1): the largest error of any of
// dQ, dK, dV, dβ, dlog a, ∂L/∂S0 relative to that gradient's largest magnitude.
// ---------------------------------------------------------------------------------------------
// Kernel against the long-double chain rule. Measured worst (N <= 150, D, M <= 8): float
// 1.3e-6, double 3.4e-15.
constexpr double kGradFloat = 5e-6;
constexpr double kGradDouble = 1e-14;
// The reference against central differences (step 1e-5): measured 1.1e-9 (L2Normalize<Silu>),
// 4e-11 (Identity).
constexpr double kFiniteDiff = 1e-7;

template <class S>
double grad_bound() {
  return test::bound<S>(kGradFloat, kGradDouble);
}

MatD frand(Index rows, Index cols, std::uint32_t seed, double lo = -1.0, double hi = 1.0) {
  return test::random_matrix<float>(rows, cols, seed, lo, hi).cast<double>();
}

struct Problem {
  MatD Q, K, V, W, S0, dS1;
  VecD beta, log_a;
};

Problem make_problem(Index N, Index D, Index F, Index M, std::uint32_t seed, bool decay,
                     bool carried, double key_range = 1.0, double beta_lo = 0.0) {
  Problem p;
  p.Q = frand(N, D, seed);
  p.K = frand(N, D, seed + 1, -key_range, key_range);
  p.V = frand(N, M, seed + 2);
  p.W = frand(N, M, seed + 3);
  p.beta = frand(N, 1, seed + 4, beta_lo, 2.0);
  if (decay) p.log_a = frand(N, 1, seed + 5, -0.5, 0.0);
  if (carried) {
    p.S0 = frand(F, M, seed + 6, -0.5, 0.5);
    p.dS1 = frand(F, M, seed + 7);
  }
  return p;
}

// Every gradient of one call, in double, for comparison.
struct Grads {
  MatD dQ, dK, dV, dS0;
  VecD dbeta, dlog_a;
};

template <class S, class Phi>
Grads kernel_grads(const Phi& phi, const Problem& p, const DeltaOptions& o) {
  const Mat<S> Q = p.Q.cast<S>(), K = p.K.cast<S>(), V = p.V.cast<S>(), W = p.W.cast<S>();
  const Vec<S> beta = p.beta.cast<S>(), log_a = p.log_a.cast<S>();
  State<S> initial;
  linattn::StateGradient<S> d_final, d_initial;
  if (p.S0.size()) {
    initial = State<S>(p.S0.rows(), p.S0.cols());
    initial.S = p.S0.cast<S>();
    d_final.dS = p.dS1.cast<S>();
  }
  Mat<S> dQ(Q.rows(), Q.cols()), dK(K.rows(), K.cols()), dV(V.rows(), V.cols());
  Vec<S> dbeta(beta.size()), dlog_a(log_a.size());
  linattn::Workspace<S> ws;
  linattn::delta_rule_attention_backward(Q, K, V, beta, log_a, W, phi, initial, d_final, dQ, dK,
                                         dV, dbeta, dlog_a, d_initial, ws, o);
  return {dQ.template cast<double>(), dK.template cast<double>(), dV.template cast<double>(),
          d_initial.dS.template cast<double>(), dbeta.template cast<double>(),
          dlog_a.template cast<double>()};
}

template <class Phi>
dref::Gradients reference_grads(const Phi& phi, const Problem& p, double scale) {
  return dref::backward(phi, p.Q, p.K, p.V, p.beta, p.log_a, scale, p.W, p.S0, p.dS1);
}

double rel(const MatD& a, const MatD& b) {
  if (a.size() == 0 && b.size() == 0) return 0;
  return test::max_abs_diff(a, b) / std::max(1e-300, test::max_abs(b));
}

// The largest relative error over the gradients (∂L/∂S0 only for a carried state).
double compare(const Grads& k, const dref::Gradients& r, bool carried, const std::string& tag) {
  double e = 0;
  const auto one = [&](const char* name, const MatD& a, const MatD& b) {
    const double x = rel(a, b);
    if (!(x <= 1)) ADD_FAILURE() << tag << ": " << name << " relative error " << x;
    e = std::max(e, x);
  };
  one("dQ", k.dQ, r.dQ);
  one("dK", k.dK, r.dK);
  one("dV", k.dV, r.dV);
  one("dbeta", k.dbeta, r.dbeta);
  one("dlog_a", k.dlog_a, r.dlog_a);
  if (carried) one("dS0", k.dS0, r.dS0);
  return e;
}

// ---------------------------------------------------------------------------------------------
// The reference against finite differences
// ---------------------------------------------------------------------------------------------

template <class Phi>
void check_reference_fd(const Phi& phi, bool decay) {
  const Index N = 9, D = 3, M = 2;
  const Index F = phi.feature_dim(D);
  const Problem p = make_problem(N, D, F, M, decay ? 500 : 510, decay, true);
  const double s = 0.7;
  const dref::Gradients r = reference_grads(phi, p, s);
  // L(Q, K, V, β, log a, S0) = Σ out ∘ W + ⟨dS1, S_N⟩.
  const auto loss = [&](const MatD& Q, const MatD& K, const MatD& V, const VecD& beta,
                        const VecD& log_a, const MatD& S0) {
    MatD S = S0;
    const MatD out = dref::recurrence(phi, Q, K, V, beta, log_a, s, &S);
    return out.cwiseProduct(p.W).sum() + S.cwiseProduct(p.dS1).sum();
  };
  const auto fd = [&](auto&& perturb, Index rows, Index cols) {
    MatD g(rows, cols);
    for (Index c = 0; c < cols; ++c)
      for (Index i = 0; i < rows; ++i) {
        const double h = 1e-5;
        g(i, c) = (perturb(i, c, h) - perturb(i, c, -h)) / (2 * h);
      }
    return g;
  };
  const MatD gQ = fd(
      [&](Index i, Index c, double h) {
        MatD Q = p.Q;
        Q(i, c) += h;
        return loss(Q, p.K, p.V, p.beta, p.log_a, p.S0);
      },
      N, D);
  const MatD gK = fd(
      [&](Index i, Index c, double h) {
        MatD K = p.K;
        K(i, c) += h;
        return loss(p.Q, K, p.V, p.beta, p.log_a, p.S0);
      },
      N, D);
  const MatD gV = fd(
      [&](Index i, Index c, double h) {
        MatD V = p.V;
        V(i, c) += h;
        return loss(p.Q, p.K, V, p.beta, p.log_a, p.S0);
      },
      N, M);
  const MatD gB = fd(
      [&](Index i, Index, double h) {
        VecD b = p.beta;
        b(i) += h;
        return loss(p.Q, p.K, p.V, b, p.log_a, p.S0);
      },
      N, 1);
  const MatD gS = fd(
      [&](Index i, Index c, double h) {
        MatD S0 = p.S0;
        S0(i, c) += h;
        return loss(p.Q, p.K, p.V, p.beta, p.log_a, S0);
      },
      F, M);
  double e = std::max({rel(r.dQ, gQ), rel(r.dK, gK), rel(r.dV, gV), rel(r.dbeta, gB),
                       rel(r.dS0, gS)});
  if (decay) {
    const MatD gA = fd(
        [&](Index i, Index, double h) {
          VecD a = p.log_a;
          a(i) = std::min(0.0, a(i) + h);
          return loss(p.Q, p.K, p.V, p.beta, a, p.S0);
        },
        N, 1);
    e = std::max(e, rel(r.dlog_a, gA));
  }
  EXPECT_LE(e, kFiniteDiff) << (decay ? "decay" : "no decay");
  test::report_error(std::string("reference gradients vs finite differences") +
                         (decay ? ", decay" : ""),
                     e);
}

TEST(delta_backward_reference, MatchesFiniteDifferences) {
  check_reference_fd(Identity{}, false);
  check_reference_fd(Identity{}, true);
  check_reference_fd(SiluL2{}, true);
}

// ---------------------------------------------------------------------------------------------
// The kernel against the reference
// ---------------------------------------------------------------------------------------------

struct Shape {
  Index N, D, M;
};

template <class S, class Phi>
void check_kernel(const Phi& phi, const char* map, bool raw, double& worst) {
  const std::vector<Shape> shapes = {{1, 3, 2}, {37, 5, 7}, {150, 8, 6}};
  std::uint32_t seed = 600;
  for (const Shape& sh : shapes)
    for (const bool decay : {false, true})
      for (const bool carried : {false, true}) {
        const Index F = phi.feature_dim(sh.D);
        const Problem p = make_problem(sh.N, sh.D, F, sh.M, seed += 10, decay, carried,
                                       raw ? 0.3 : 1.0);
        const double scale = 1.0 / std::sqrt(double(sh.D));
        const dref::Gradients r = reference_grads(phi, p, scale);
        for (const Index C : {1, 5, 16, 0}) {
          DeltaOptions o;
          o.scale = scale;
          o.chunk_size = C;
          const std::string tag = std::string(map) + ", C=" + std::to_string(C) +
                                  (decay ? ", decay" : "") + (carried ? ", carried" : "") +
                                  ", N=" + std::to_string(sh.N);
          const double e = compare(kernel_grads<S>(phi, p, o), r, carried, tag);
          EXPECT_LE(e, grad_bound<S>()) << tag;
          worst = std::max(worst, e);
        }
      }
}

TEST(delta_backward, MatchesChainRuleUnitKeys) {
  [[maybe_unused]] double wf = 0, wd = 0;
  IF_FLOAT(check_kernel<float>(SiluL2{}, "L2Normalize<Silu>", false, wf));
  IF_DOUBLE(check_kernel<double>(SiluL2{}, "L2Normalize<Silu>", false, wd));
  IF_FLOAT(test::report_error("delta backward vs chain rule, unit keys, float", wf));
  IF_DOUBLE(test::report_error("delta backward vs chain rule, unit keys, double", wd));
}

TEST(delta_backward, MatchesChainRuleRawKeys) {
  [[maybe_unused]] double wf = 0, wd = 0;
  IF_FLOAT(check_kernel<float>(Identity{}, "Identity", true, wf));
  IF_DOUBLE(check_kernel<double>(Identity{}, "Identity", true, wd));
  IF_FLOAT(test::report_error("delta backward vs chain rule, raw keys, float", wf));
  IF_DOUBLE(test::report_error("delta backward vs chain rule, raw keys, double", wd));
}

// β = 1 on unit keys: every factor (I − k̂k̂ᵀ) is singular; the gradients stay exact (no state
// is recovered by inverting one).
TEST(delta_backward, UnitBetaSingularFactors) {
  const Index N = 80, D = 6, M = 5;
  Problem p = make_problem(N, D, D, M, 700, true, true);
  p.beta.setOnes();
  for (const Index C : {1, 16, 0}) {
    DeltaOptions o;
    o.chunk_size = C;
    const dref::Gradients r = reference_grads(SiluL2{}, p, 1.0);
    const double ed = compare(kernel_grads<double>(SiluL2{}, p, o), r, true, "double");
    const double ef = compare(kernel_grads<float>(SiluL2{}, p, o), r, true, "float");
    EXPECT_LE(ed, grad_bound<double>()) << "C=" << C;
    EXPECT_LE(ef, grad_bound<float>()) << "C=" << C;
  }
}

TEST(delta_backward, ReturningFormsAndMultiHead) {
  const Index N = 70, H = 3, D = 4, M = 5;
  const MatD Q = frand(N, H * D, 801), K = frand(N, H * D, 802), V = frand(N, H * M, 803),
             W = frand(N, H * M, 804), beta = frand(N, H, 805, 0.0, 2.0),
             log_a = frand(N, H, 806, -0.5, 0.0);
  DeltaOptions o;
  o.scale = 0.5;
  o.chunk_size = 16;
  const auto g = linattn::multihead_delta_rule_attention_backward(Q, K, V, beta, log_a, W, H,
                                                                  SiluL2{}, o);
  ASSERT_EQ(g.dbeta.rows(), N);
  ASSERT_EQ(g.dbeta.cols(), H);
  ASSERT_EQ(g.dlog_a.cols(), H);
  for (Index h = 0; h < H; ++h) {
    const MatD Qh = Q.middleCols(h * D, D), Kh = K.middleCols(h * D, D),
               Vh = V.middleCols(h * M, M), Wh = W.middleCols(h * M, M);
    const VecD bh = beta.col(h), ah = log_a.col(h);
    const auto one =
        linattn::delta_rule_attention_backward(Qh, Kh, Vh, bh, ah, Wh, SiluL2{}, o);
    EXPECT_EQ(test::max_abs_diff(MatD(g.dQ.middleCols(h * D, D)), one.dQ), 0.0) << h;
    EXPECT_EQ(test::max_abs_diff(MatD(g.dK.middleCols(h * D, D)), one.dK), 0.0) << h;
    EXPECT_EQ(test::max_abs_diff(MatD(g.dV.middleCols(h * M, M)), one.dV), 0.0) << h;
    EXPECT_EQ(test::max_abs_diff(MatD(g.dbeta.col(h)), one.dbeta), 0.0) << h;
    EXPECT_EQ(test::max_abs_diff(MatD(g.dlog_a.col(h)), one.dlog_a), 0.0) << h;
  }
  // No decay: dlog_a is empty.
  const MatD none(N, 0);
  const auto gn = linattn::multihead_delta_rule_attention_backward(Q, K, V, beta, none, W, H);
  EXPECT_EQ(gn.dlog_a.size(), 0);
  // Row-major inputs and gradients give the column-major results.
  const RowMat<double> Qr = Q.leftCols(D), Kr = K.leftCols(D), Vr = V.leftCols(M),
                       Wr = W.leftCols(M);
  const Eigen::RowVectorXd br = beta.col(0).transpose();
  RowMat<double> dQr(N, D), dKr(N, D), dVr(N, M);
  Eigen::RowVectorXd dbr(N);
  Eigen::VectorXd da(0);
  State<double> zero;
  linattn::StateGradient<double> no_grad, d_init;
  linattn::Workspace<double> ws;
  linattn::delta_rule_attention_backward(Qr, Kr, Vr, br, Eigen::VectorXd(), Wr, SiluL2{}, zero,
                                         no_grad, dQr, dKr, dVr, dbr, da, d_init, ws, o);
  const auto col = linattn::delta_rule_attention_backward(MatD(Q.leftCols(D)), MatD(K.leftCols(D)),
                                                          MatD(V.leftCols(M)), VecD(beta.col(0)),
                                                          VecD(), MatD(W.leftCols(M)), SiluL2{}, o);
  EXPECT_LE(test::max_abs_diff(MatD(dQr), col.dQ), 1e-14);
  EXPECT_LE(test::max_abs_diff(MatD(dKr), col.dK), 1e-14);
  EXPECT_LE(test::max_abs_diff(MatD(dVr), col.dV), 1e-14);
  EXPECT_LE(test::max_abs_diff(MatD(dbr.transpose()), col.dbeta), 1e-14);
  // Allocation-free on reuse.
  const test::Allocations al = test::allocations_in([&] {
    linattn::delta_rule_attention_backward(Qr, Kr, Vr, br, Eigen::VectorXd(), Wr, SiluL2{}, zero,
                                           no_grad, dQr, dKr, dVr, dbr, da, d_init, ws, o);
  });
  EXPECT_EQ(al.eigen, 0);
}

TEST(delta_backward_errors, GradientShapesAndOverlaps) {
  const Eigen::MatrixXf Q = Eigen::MatrixXf::Ones(5, 4), V = Eigen::MatrixXf::Ones(5, 3);
  const Eigen::VectorXf beta = Eigen::VectorXf::Ones(5), g = Eigen::VectorXf::Zero(5);
  Eigen::MatrixXf dQ(5, 4), dK(5, 4), dV(5, 3);
  Eigen::VectorXf db(5), dg(5), db4(4), dg0(0);
  State<float> zero;
  linattn::StateGradient<float> none, d_init;
  linattn::Workspace<float> ws;
  const char* fn = "delta_rule_attention_backward";
  test::expect_invalid(
      [&] {
        linattn::delta_rule_attention_backward(Q, Q, V, beta, g, V, Identity{}, zero, none, dQ,
                                               dK, dV, db4, dg, d_init, ws);
      },
      Needles{fn, "dbeta is 4x1", "5x1"}, "dbeta shape");
  test::expect_invalid(
      [&] {
        linattn::delta_rule_attention_backward(Q, Q, V, beta, g, V, Identity{}, zero, none, dQ,
                                               dK, dV, db, dg0, d_init, ws);
      },
      Needles{fn, "dlog_a is 0x1"}, "dlog_a shape");
  test::expect_invalid(
      [&] {
        linattn::delta_rule_attention_backward(Q, Q, V, beta, g, V, Identity{}, zero, none, dQ,
                                               dK, dV, db, db, d_init, ws);
      },
      Needles{fn, "must not share memory"}, "dbeta == dlog_a");
  Eigen::VectorXf bad = beta;
  bad(1) = -1;
  test::expect_invalid([&] { linattn::delta_rule_attention_backward(Q, Q, V, bad, g, V); },
                       Needles{fn, "beta(1)"}, "beta value");
  State<float> wrong(3, 3);
  test::expect_invalid(
      [&] {
        linattn::delta_rule_attention_backward(Q, Q, V, beta, g, V, Identity{}, wrong, none, dQ,
                                               dK, dV, db, dg, d_init, ws);
      },
      Needles{fn, "the initial state"}, "initial state");
  test::expect_invalid(
      [&] { linattn::delta_rule_attention_backward(Q, Q, V, beta, g, Eigen::MatrixXf(4, 3)); },
      Needles{fn, "dOut is 4x3"}, "dOut shape");
}

}  // namespace
