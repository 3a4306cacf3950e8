// The gate and β activations of the 2026 models (core/gates.hpp): g from A_log, dt_bias and a
// (softplus and KDA's lower-bounded sigmoid, per head and per channel) and β = sigmoid(b) (× 2)
// against their formulas in long double, their gradients against central differences, the
// whole chain a, A_log, dt_bias, b → g, β → KDA kernel → loss against central differences, and
// the errors.
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/linattn.hpp>
#include <string>
#include <vector>

#include "gradient_util.hpp"
#include "test_util.hpp"

namespace {

using linattn::GateActivation;
using linattn::GateOptions;
using test::Index;
using MatD = Eigen::MatrixXd;
using VecD = Eigen::VectorXd;
using LD = long double;
using Needles = std::vector<std::string>;

MatD frand(Index rows, Index cols, std::uint32_t seed, double lo = -1.0, double hi = 1.0) {
  return test::random_matrix<double>(rows, cols, seed, lo, hi);
}

LD softplus_ld(LD x) { return x > 20 ? x : std::log1p(std::exp(x)); }
LD sigmoid_ld(LD x) { return 1 / (1 + std::exp(-x)); }

MatD reference_gates(const MatD& a, const VecD& A_log, const VecD& dt, const GateOptions& o) {
  const Index C = a.cols() / A_log.size();
  MatD g(a.rows(), a.cols());
  for (Index j = 0; j < a.cols(); ++j)
    for (Index t = 0; t < a.rows(); ++t) {
      const LD x = LD(a(t, j)) + (dt.size() ? LD(dt(j)) : 0), r = std::exp(LD(A_log(j / C)));
      g(t, j) = double(o.activation == GateActivation::Softplus
                           ? -r * softplus_ld(x)
                           : LD(o.lower_bound) * sigmoid_ld(r * x));
    }
  return g;
}

TEST(gates, ActivationsAgainstTheirFormulas) {
  const Index N = 7, H = 3;
  for (const Index C : {Index(1), Index(4)}) {
    for (const auto act : {GateActivation::Softplus, GateActivation::LowerBoundSigmoid}) {
      SCOPED_TRACE("C = " + std::to_string(C) + ", form " + std::to_string(int(act)));
      GateOptions o;
      o.activation = act;
      o.lower_bound = -3.5;
      MatD a = frand(N, H * C, 1, -4, 4);
      a(0, 0) = 30;    // softplus' linear branch
      a(1, 0) = -60;   // e^x underflows: g -> 0
      const VecD A_log = frand(H, 1, 2, -1, 1), dt = frand(H * C, 1, 3);
      for (const bool bias : {false, true}) {
        const VecD d = bias ? dt : VecD();
        MatD g(N, H * C);
        linattn::gate_activation(a, A_log, d, g, o);
        EXPECT_LE(test::relative_error(g, reference_gates(a, A_log, d, o)), 1e-15);
        EXPECT_LE(g.maxCoeff(), 0.0);
        if (act == GateActivation::LowerBoundSigmoid) {
          EXPECT_GE(g.minCoeff(), o.lower_bound);
        }
        Eigen::MatrixXf gf(N, H * C);
        linattn::gate_activation(a.cast<float>(), A_log.cast<float>(), d.cast<float>(), gf, o);
        EXPECT_LE(test::relative_error(gf.cast<double>(), g), 1e-6);
      }
    }
  }
  const MatD b = frand(5, 2, 4, -30, 30);
  MatD beta(5, 2), beta2(5, 2);
  linattn::beta_activation(b, beta);
  linattn::beta_activation(b, beta2, true);
  for (Index j = 0; j < 2; ++j)
    for (Index t = 0; t < 5; ++t) {
      EXPECT_NEAR(beta(t, j), double(sigmoid_ld(LD(b(t, j)))), 3e-16);
      EXPECT_EQ(beta2(t, j), 2 * beta(t, j));
    }
  EXPECT_GE(beta.minCoeff(), 0.0);
  EXPECT_LE(beta2.maxCoeff(), 2.0);
}

TEST(gates, GradientsAgainstCentralDifferences) {
  const Index N = 5, H = 2;
  for (const Index C : {Index(1), Index(3)})
    for (const auto act : {GateActivation::Softplus, GateActivation::LowerBoundSigmoid}) {
      SCOPED_TRACE("C = " + std::to_string(C) + ", form " + std::to_string(int(act)));
      GateOptions o;
      o.activation = act;
      MatD a = frand(N, H * C, 11, -3, 3), A_log = frand(H, 1, 12), dt = frand(H * C, 1, 13);
      const MatD W = frand(N, H * C, 14);
      const auto loss = [&] {
        MatD g(N, H * C);
        linattn::gate_activation(a, VecD(A_log), VecD(dt), g, o);
        return g.cwiseProduct(W).sum();
      };
      MatD da(N, H * C);
      VecD dA(H), ddt(H * C);
      linattn::gate_activation_backward(a, VecD(A_log), VecD(dt), W, da, dA, ddt, o);
      EXPECT_LE(test::relative_error(da, test::central_differences(loss, a)), 1e-8);
      EXPECT_LE(test::relative_error(dA, test::central_differences(loss, A_log)), 1e-8);
      EXPECT_LE(test::relative_error(ddt, test::central_differences(loss, dt)), 1e-8);
    }
  MatD b = frand(4, 3, 15, -4, 4);
  const MatD W = frand(4, 3, 16);
  for (const bool two : {false, true}) {
    const auto loss = [&] {
      MatD beta(4, 3);
      linattn::beta_activation(b, beta, two);
      return beta.cwiseProduct(W).sum();
    };
    MatD db(4, 3);
    linattn::beta_activation_backward(b, W, db, two);
    EXPECT_LE(test::relative_error(db, test::central_differences(loss, b)), 1e-8);
  }
}

// The chain a, A_log, dt_bias, b → per-channel g and β → the KDA kernel → L = Σ out ∘ W: the
// kernel's dlog_a and dbeta through the activations' backward against central differences of
// the whole forward.
TEST(gates, KdaChainReachesEveryParameter) {
  const Index N = 6, H = 2, D = 3, M = 2;
  const MatD Q = frand(N, H * D, 21), K = frand(N, H * D, 22), V = frand(N, H * M, 23),
             W = frand(N, H * M, 24);
  MatD a = frand(N, H * D, 25, -2, 2), A_log = frand(H, 1, 26, -1, 0.5),
       dt = frand(H * D, 1, 27), b = frand(N, H, 28, -2, 2);
  GateOptions o;
  o.activation = GateActivation::LowerBoundSigmoid;
  const linattn::L2Normalize<linattn::Identity> phi;
  linattn::DeltaOptions opts;
  opts.scale = 0.5;
  const auto forward = [&](MatD& g, MatD& beta) {
    g.resize(N, H * D);
    beta.resize(N, H);
    linattn::gate_activation(a, VecD(A_log), VecD(dt), g, o);
    linattn::beta_activation(b, beta, true);
  };
  const auto loss = [&] {
    MatD g, beta;
    forward(g, beta);
    return linattn::multihead_delta_rule_attention(Q, K, V, beta, g, H, phi, opts)
        .cwiseProduct(W)
        .sum();
  };
  MatD g, beta;
  forward(g, beta);
  const auto k = linattn::multihead_delta_rule_attention_backward(Q, K, V, beta, g, W, H, phi, opts);
  MatD da(N, H * D), db(N, H);
  VecD dA(H), ddt(H * D);
  linattn::gate_activation_backward(a, VecD(A_log), VecD(dt), k.dlog_a, da, dA, ddt, o);
  linattn::beta_activation_backward(b, k.dbeta, db, true);
  EXPECT_LE(test::relative_error(da, test::central_differences(loss, a)), 1e-7) << "da";
  EXPECT_LE(test::relative_error(dA, test::central_differences(loss, A_log)), 1e-7) << "dA_log";
  EXPECT_LE(test::relative_error(ddt, test::central_differences(loss, dt)), 1e-7) << "ddt_bias";
  EXPECT_LE(test::relative_error(db, test::central_differences(loss, b)), 1e-7) << "db";
}

TEST(gates, Errors) {
  const MatD a = frand(3, 4, 31);
  const VecD A_log = frand(2, 1, 32), dt = frand(4, 1, 33);
  MatD g(3, 4);
  test::expect_invalid([&] { linattn::gate_activation(a, VecD(VecD::Zero(3)), dt, g); },
                       Needles{"gate_activation", "A_log", "a is 3x4", "A_log is 3x1"}, "heads");
  test::expect_invalid([&] { linattn::gate_activation(a, A_log, VecD(VecD::Zero(3)), g); },
                       Needles{"dt_bias must be empty or a vector of a.cols() = 4"}, "dt_bias");
  MatD bad = a;
  bad(2, 1) = std::numeric_limits<double>::quiet_NaN();
  test::expect_invalid([&] { linattn::gate_activation(bad, A_log, dt, g); },
                       Needles{"a(2, 1) = nan", "must be finite"}, "NaN");
  GateOptions o;
  o.activation = GateActivation::LowerBoundSigmoid;
  o.lower_bound = 0.5;
  test::expect_invalid([&] { linattn::gate_activation(a, A_log, dt, g, o); },
                       Needles{"lower_bound = 0.5 must be finite and < 0"}, "bound");
  MatD small(2, 4);
  test::expect_invalid([&] { linattn::gate_activation(a, A_log, dt, small); },
                       Needles{"g is 2x4 but must be 3x4"}, "g shape");
  MatD beta(3, 3);
  test::expect_invalid([&] { linattn::beta_activation(a, beta); },
                       Needles{"beta_activation", "beta is 3x3 but must be 3x4"}, "beta");
}

}  // namespace
