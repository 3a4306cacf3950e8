// The delta rule with in-kernel gates and β (delta/delta_rule_gates.hpp): forward, carried
// states and backward bit for bit the composition gate_activation() / beta_activation(), kernel,
// kernel backward, activations' backward, for every gate form and β activation, shared key
// heads and packed sequences with an empty one; the raw inputs' gradients against central
// differences in double; the errors, naming the function and the shapes.
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cmath>
#include <limits>
#include <linattn/linattn.hpp>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace delta_gates_test {

using linattn::BetaActivation;
using linattn::DeltaOptions;
using linattn::GateActivation;
using linattn::GateOptions;
using test::Index;
using L2 = linattn::L2Normalize<>;
template <class S>
using M = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic>;
template <class S>
using Vec = Eigen::Matrix<S, Eigen::Dynamic, 1>;
template <class S>
using States = std::vector<linattn::LinearAttentionState<S>>;

// One configuration: the gate's form, per head (C = 1) or per key channel (C = D), with or
// without dt_bias, the β activation, shared key heads.
struct Case {
  GateActivation form;
  bool per_channel;
  bool bias;
  BetaActivation beta;
  Index key_heads;  // 0: as many as the value heads
};

const Case kCases[] = {
    {GateActivation::Softplus, false, true, BetaActivation::Sigmoid, 2},
    {GateActivation::Softplus, true, true, BetaActivation::SigmoidTimesTwo, 0},
    {GateActivation::LowerBoundSigmoid, true, true, BetaActivation::Sigmoid, 2},
    {GateActivation::Softplus, false, false, BetaActivation::None, 0},
    {GateActivation::LowerBoundSigmoid, false, false, BetaActivation::SigmoidTimesTwo, 4},
};

template <class S>
struct Inputs {
  static constexpr Index N = 13, H = 4, D = 4, Mv = 3;
  Index Hk;
  M<S> Q, K, V, b, a, W;
  Vec<S> A_log, dt_bias;
  GateOptions gate;
  DeltaOptions opts;
  Inputs(const Case& c, std::uint32_t seed) {
    Hk = c.key_heads ? c.key_heads : H;
    Q = test::random_matrix<S>(N, Hk * D, seed);
    K = test::random_matrix<S>(N, Hk * D, seed + 1);
    V = test::random_matrix<S>(N, H * Mv, seed + 2);
    W = test::random_matrix<S>(N, H * Mv, seed + 3);
    // β given directly must lie in [0, 2].
    b = c.beta == BetaActivation::None ? test::random_matrix<S>(N, H, seed + 4, 0.1, 1.5)
                                       : test::random_matrix<S>(N, H, seed + 4, -3.0, 3.0);
    const Index C = c.per_channel ? D : 1;
    a = test::random_matrix<S>(N, H * C, seed + 5, -4.0, 4.0);
    A_log = test::random_matrix<S>(H, 1, seed + 6, -1.0, 1.0);
    if (c.bias) dt_bias = test::random_matrix<S>(H * C, 1, seed + 7, -1.0, 1.0);
    gate.activation = c.form;
    gate.lower_bound = -3.0;
    opts.key_heads = c.key_heads;
    opts.scale = 0.5;
    opts.beta_activation = c.beta;
  }
  // The two-step form's g and β.
  std::pair<M<S>, M<S>> activated() const {
    M<S> g(a.rows(), a.cols()), beta(b.rows(), b.cols());
    linattn::gate_activation(a, A_log, dt_bias, g, gate);
    if (opts.beta_activation == BetaActivation::None)
      beta = b;
    else
      linattn::beta_activation(b, beta, opts.beta_activation == BetaActivation::SigmoidTimesTwo);
    return {g, beta};
  }
  DeltaOptions plain() const {
    DeltaOptions p = opts;
    p.beta_activation = BetaActivation::None;
    return p;
  }
};

template <class S>
void expect_states_equal(const States<S>& got, const States<S>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i].S == want[i].S) << "state " << i;
}

// Forward: zero states, carried states (continuing a first call), packed sequences with an
// empty one, with and without states; every output and state bit for bit the composition's.
template <class S>
void check_forward(const Case& c, std::uint32_t seed) {
  const Inputs<S> in(c, seed);
  const auto [g, beta] = in.activated();
  const auto gates = linattn::in_kernel_gates(in.A_log, in.dt_bias, in.gate);
  const Index N = in.N, H = in.H;
  linattn::MultiHeadWorkspace<S> ws, ws2;
  M<S> out(N, H * in.Mv), ref(N, H * in.Mv);
  linattn::multihead_delta_rule_attention(in.Q, in.K, in.V, in.b, in.a, gates, H, L2{}, out, ws,
                                          in.opts);
  linattn::multihead_delta_rule_attention(in.Q, in.K, in.V, beta, g, H, L2{}, ref, ws2,
                                          in.plain());
  EXPECT_TRUE(out == ref) << "multi-head: " << test::max_abs_diff(out, ref);

  States<S> st, st_ref;
  for (int pass = 0; pass < 2; ++pass) {  // the second continues the first's states
    linattn::multihead_delta_rule_attention(in.Q, in.K, in.V, in.b, in.a, gates, H, L2{}, st, out,
                                            ws, in.opts);
    linattn::multihead_delta_rule_attention(in.Q, in.K, in.V, beta, g, H, L2{}, st_ref, ref, ws2,
                                            in.plain());
    EXPECT_TRUE(out == ref) << "carried states, pass " << pass;
    expect_states_equal(st, st_ref);
  }

  const Eigen::VectorXi offsets = (Eigen::VectorXi(4) << 0, 5, 5, int(N)).finished();
  linattn::batched_delta_rule_attention(in.Q, in.K, in.V, in.b, in.a, gates, offsets, H, L2{}, out,
                                        ws, in.opts);
  linattn::batched_delta_rule_attention(in.Q, in.K, in.V, beta, g, offsets, H, L2{}, ref, ws2,
                                        in.plain());
  EXPECT_TRUE(out == ref) << "batched";
  States<S> bs, bs_ref;
  linattn::batched_delta_rule_attention(in.Q, in.K, in.V, in.b, in.a, gates, offsets, H, L2{}, bs,
                                        out, ws, in.opts);
  linattn::batched_delta_rule_attention(in.Q, in.K, in.V, beta, g, offsets, H, L2{}, bs_ref, ref,
                                        ws2, in.plain());
  EXPECT_TRUE(out == ref) << "batched, states";
  expect_states_equal(bs, bs_ref);
}

TEST(delta_gates, ForwardEqualsTheComposition) {
  std::uint32_t seed = 100;
  for (const Case& c : kCases) {
    IF_FLOAT(check_forward<float>(c, seed));
    IF_DOUBLE(check_forward<double>(c, seed));
    seed += 10;
  }
}

// Backward: the out-parameter form, the returned one and the carried-state one, bit for bit the
// kernel's backward chained with the activations' backward.
template <class S>
void check_backward(const Case& c, std::uint32_t seed) {
  const Inputs<S> in(c, seed);
  const auto [g, beta] = in.activated();
  const auto gates = linattn::in_kernel_gates(in.A_log, in.dt_bias, in.gate);
  const Index H = in.H;
  const bool times_two = c.beta == BetaActivation::SigmoidTimesTwo;
  // The composition.
  auto k = linattn::multihead_delta_rule_attention_backward(in.Q, in.K, in.V, beta, g, in.W, H,
                                                            L2{}, in.plain());
  M<S> da(in.a.rows(), in.a.cols()), db(in.b.rows(), in.b.cols());
  Vec<S> dA_log(H), ddt_bias(in.dt_bias.size());
  linattn::gate_activation_backward(in.a, in.A_log, in.dt_bias, k.dlog_a, da, dA_log, ddt_bias,
                                    in.gate);
  if (c.beta == BetaActivation::None)
    db = k.dbeta;
  else
    linattn::beta_activation_backward(in.b, k.dbeta, db, times_two);

  auto r = linattn::multihead_delta_rule_attention_backward(in.Q, in.K, in.V, in.b, in.a, gates,
                                                            in.W, H, L2{}, in.opts);
  EXPECT_TRUE(r.dQ == k.dQ && r.dK == k.dK && r.dV == k.dV) << "dQ, dK, dV";
  EXPECT_TRUE(r.dbeta == k.dbeta && r.dlog_a == k.dlog_a) << "the kernel's dβ, dg";
  EXPECT_TRUE(r.db == db) << "db: " << test::max_abs_diff(r.db, db);
  EXPECT_TRUE(r.da == da) << "da: " << test::max_abs_diff(r.da, da);
  EXPECT_TRUE(r.dA_log == dA_log) << "dA_log";
  EXPECT_TRUE(r.ddt_bias == ddt_bias) << "ddt_bias";

  // Carried states: from states a first call left, with a final state's gradient.
  linattn::MultiHeadWorkspace<S> ws;
  States<S> initial;
  M<S> out(in.N, H * in.Mv);
  linattn::multihead_delta_rule_attention(in.Q, in.K, in.V, beta, g, H, L2{}, initial, out, ws,
                                          in.plain());
  std::vector<linattn::StateGradient<S>> d_final(static_cast<std::size_t>(H)), d_init, d_init_ref(
                                                                                    d_final.size());
  for (std::size_t h = 0; h < d_final.size(); ++h)
    d_final[h].dS = test::random_matrix<S>(in.D, in.Mv, seed + 50 + std::uint32_t(h));
  M<S> dQ(in.Q.rows(), in.Q.cols()), dK = dQ, dV(in.V.rows(), in.V.cols()), dQr = dQ, dKr = dQ,
                                     dVr = dV;
  M<S> dbeta_r(in.b.rows(), in.b.cols()), dg_r(in.a.rows(), in.a.cols());
  linattn::detail::multihead_delta_backward(in.Q, in.K, in.V, beta, g, in.W, H, L2{},
                                            initial.data(), d_final.data(), dQr, dKr, dVr, dbeta_r,
                                            dg_r, d_init_ref.data(), ws, in.plain(), {});
  linattn::gate_activation_backward(in.a, in.A_log, in.dt_bias, dg_r, da, dA_log, ddt_bias,
                                    in.gate);
  if (c.beta == BetaActivation::None)
    db = dbeta_r;
  else
    linattn::beta_activation_backward(in.b, dbeta_r, db, times_two);
  M<S> db2(db.rows(), db.cols()), da2(da.rows(), da.cols());
  Vec<S> dA_log2(H), ddt_bias2(ddt_bias.size());
  linattn::multihead_delta_rule_attention_backward(in.Q, in.K, in.V, in.b, in.a, gates, in.W, H,
                                                   L2{}, initial, d_final, dQ, dK, dV, db2, da2,
                                                   dA_log2, ddt_bias2, d_init, ws, in.opts);
  EXPECT_TRUE(dQ == dQr && dK == dKr && dV == dVr) << "carried: dQ, dK, dV";
  EXPECT_TRUE(db2 == db && da2 == da && dA_log2 == dA_log && ddt_bias2 == ddt_bias)
      << "carried: db, da, dA_log, ddt_bias";
  ASSERT_EQ(d_init.size(), d_init_ref.size());
  for (std::size_t h = 0; h < d_init.size(); ++h)
    EXPECT_TRUE(d_init[h].dS == d_init_ref[h].dS) << "d_initial " << h;
}

TEST(delta_gates, BackwardEqualsTheComposition) {
  std::uint32_t seed = 300;
  for (const Case& c : kCases) {
    IF_FLOAT(check_backward<float>(c, seed));
    IF_DOUBLE(check_backward<double>(c, seed));
    seed += 10;
  }
}

// dA_log, ddt_bias, da and db against central differences of L = Σ W ∘ out in double.
void check_differences(const Case& c, std::uint32_t seed) {
  Inputs<double> in(c, seed);
  const Index H = in.H;
  const auto loss = [&] {
    linattn::MultiHeadWorkspace<double> ws;
    Eigen::MatrixXd out(in.N, H * in.Mv);
    linattn::multihead_delta_rule_attention(in.Q, in.K, in.V, in.b, in.a,
                                            linattn::in_kernel_gates(in.A_log, in.dt_bias, in.gate),
                                            H, L2{}, out, ws, in.opts);
    return (in.W.array() * out.array()).sum();
  };
  const auto r = linattn::multihead_delta_rule_attention_backward(
      in.Q, in.K, in.V, in.b, in.a, linattn::in_kernel_gates(in.A_log, in.dt_bias, in.gate), in.W,
      H, L2{}, in.opts);
  const auto check = [&](const char* name, auto& x, const auto& dx) {
    double worst = 0, scale = 1e-300;
    for (Index i = 0; i < x.size(); ++i) {
      const double keep = x(i), h = 1e-6 * std::max(1.0, std::abs(keep));
      x(i) = keep + h;
      const double up = loss();
      x(i) = keep - h;
      const double down = loss();
      x(i) = keep;
      const double fd = (up - down) / (2 * h);
      worst = std::max(worst, std::abs(fd - dx(i)));
      scale = std::max(scale, std::abs(fd));
    }
    EXPECT_LE(worst / scale, 1e-7) << name << " (max |∂| " << scale << ")";
  };
  check("dA_log", in.A_log, r.dA_log);
  check("ddt_bias", in.dt_bias, r.ddt_bias);
  check("da", in.a, r.da);
  check("db", in.b, r.db);
}

TEST(delta_gates, GradientsMatchCentralDifferences) {
  std::uint32_t seed = 500;
  for (const Case& c : kCases) check_differences(c, seed += 10);
}

// The errors name the function, the offending value and the shapes, before anything is written.
TEST(delta_gates, ErrorsNameTheFunctionAndShapes) {
  const Case c = kCases[0];
  Inputs<float> in(c, 7);
  const Index H = in.H;
  linattn::MultiHeadWorkspace<float> ws;
  Eigen::MatrixXf out = Eigen::MatrixXf::Constant(in.N, H * in.Mv, 7.0f);
  const auto fwd = [&](const Eigen::VectorXf& A_log, const Eigen::VectorXf& dt_bias,
                       const GateOptions& gate) {
    return [&, A_log, dt_bias, gate] {
      linattn::multihead_delta_rule_attention(in.Q, in.K, in.V, in.b, in.a,
                                              linattn::in_kernel_gates(A_log, dt_bias, gate), H,
                                              L2{}, out, ws, in.opts);
    };
  };
  const std::string f = "multihead_delta_rule_attention";
  test::expect_invalid(fwd(Eigen::VectorXf::Zero(3), in.dt_bias, in.gate),
                       {f, "A_log has 3 entries", "H = 4", "a is 13x4", "Q is 13x8"},
                       "A_log size");
  test::expect_invalid(fwd(in.A_log, Eigen::VectorXf::Zero(5), in.gate),
                       {f, "dt_bias has 5 entries", "a is 13x4", "Q is 13x8"}, "dt_bias size");
  Eigen::VectorXf bad = in.A_log;
  bad(2) = std::numeric_limits<float>::quiet_NaN();
  test::expect_invalid(fwd(bad, in.dt_bias, in.gate), {f, "A_log(2, 0) = nan", "finite"},
                       "NaN A_log");
  GateOptions lb;
  lb.activation = GateActivation::LowerBoundSigmoid;
  lb.lower_bound = 0.0;
  test::expect_invalid(fwd(in.A_log, in.dt_bias, lb), {f, "lower_bound = 0", "< 0"},
                       "lower bound");
  EXPECT_TRUE((out.array() == 7.0f).all()) << "an error wrote the output";
  Eigen::MatrixXf b_nan = in.b;
  b_nan(4, 1) = std::numeric_limits<float>::infinity();
  test::expect_invalid(
      [&] {
        linattn::batched_delta_rule_attention(in.Q, in.K, in.V, b_nan, in.a,
                                              linattn::in_kernel_gates(in.A_log, in.dt_bias),
                                              Eigen::VectorXi::LinSpaced(2, 0, int(in.N)), H, L2{},
                                              out, ws, in.opts);
      },
      std::vector<std::string>{"batched_delta_rule_attention", "b(4, 1) = inf"}, "non-finite b");
  // The backward's gradients of the wrong shape.
  Eigen::MatrixXf dQ(in.Q.rows(), in.Q.cols()), dK = dQ, dV(in.V.rows(), in.V.cols()),
      db(in.b.rows(), in.b.cols()), da(in.a.rows(), in.a.cols());
  Eigen::VectorXf dA_log(3), ddt_bias(H);
  test::expect_invalid(
      [&] {
        linattn::multihead_delta_rule_attention_backward(
            in.Q, in.K, in.V, in.b, in.a, linattn::in_kernel_gates(in.A_log, in.dt_bias), in.W, H,
            L2{}, dQ, dK, dV, db, da, dA_log, ddt_bias, ws, in.opts);
      },
      {"multihead_delta_rule_attention_backward", "dA_log 3x1", "A_log (4x1)"}, "dA_log");
  // The overloads that take β reject an activation they cannot apply.
  const Eigen::MatrixXf beta = Eigen::MatrixXf::Constant(in.N, H, 0.5f), g = -beta;
  test::expect_invalid(
      [&] {
        linattn::multihead_delta_rule_attention(in.Q, in.K, in.V, beta, g, H, L2{}, out, ws,
                                                in.opts);
      },
      {f, "beta_activation", "in_kernel_gates"}, "β activation without in-kernel gates");
}

}  // namespace delta_gates_test
