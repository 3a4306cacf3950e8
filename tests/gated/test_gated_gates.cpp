// Gated linear attention with in-kernel gates (gated/gated_attention_gates.hpp): forward,
// carried states and backward bit for bit the composition gate_activation(), kernel, kernel
// backward, gate_activation_backward(), for every gate form, per head and per feature, shared
// key heads and packed sequences with an empty one; the raw inputs' gradients against central
// differences in double; the errors, naming the function and the shapes.
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cmath>
#include <limits>
#include <linattn/linattn.hpp>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace gated_gates_test {

using linattn::GateActivation;
using linattn::GatedOptions;
using linattn::GateOptions;
using linattn::Identity;
using test::Index;
template <class S>
using M = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic>;
template <class S>
using Vec = Eigen::Matrix<S, Eigen::Dynamic, 1>;
template <class S>
using States = std::vector<linattn::LinearAttentionState<S>>;

struct Case {
  GateActivation form;
  bool per_feature;  // a N x H·F (GLA-like) rather than N x H
  bool bias;
  Index key_heads;  // 0: as many as the value heads
  bool normalize;
};

const Case kCases[] = {
    {GateActivation::Softplus, false, true, 2, false},
    {GateActivation::Softplus, true, true, 0, false},
    {GateActivation::LowerBoundSigmoid, true, false, 2, false},
    {GateActivation::LowerBoundSigmoid, false, true, 0, true},
};

template <class S>
struct Inputs {
  static constexpr Index N = 13, H = 4, D = 3, Mv = 2;
  Index Hk;
  M<S> Q, K, V, a, W;
  Vec<S> A_log, dt_bias;
  GateOptions gate;
  GatedOptions opts;
  Inputs(const Case& c, std::uint32_t seed) {
    Hk = c.key_heads ? c.key_heads : H;
    // Positive features (normalize = true divides by φ(q)·z).
    const double lo = c.normalize ? 0.1 : -1.0;
    Q = test::random_matrix<S>(N, Hk * D, seed, lo, 1.0);
    K = test::random_matrix<S>(N, Hk * D, seed + 1, lo, 1.0);
    V = test::random_matrix<S>(N, H * Mv, seed + 2);
    W = test::random_matrix<S>(N, H * Mv, seed + 3);
    const Index C = c.per_feature ? D : 1;
    a = test::random_matrix<S>(N, H * C, seed + 5, -4.0, 4.0);
    A_log = test::random_matrix<S>(H, 1, seed + 6, -1.0, 1.0);
    if (c.bias) dt_bias = test::random_matrix<S>(H * C, 1, seed + 7, -1.0, 1.0);
    gate.activation = c.form;
    gate.lower_bound = -2.0;
    opts.key_heads = c.key_heads;
    opts.scale = 0.5;
    opts.normalize = c.normalize;
  }
  M<S> activated() const {
    M<S> g(a.rows(), a.cols());
    linattn::gate_activation(a, A_log, dt_bias, g, gate);
    return g;
  }
};

template <class S>
void expect_states_equal(const States<S>& got, const States<S>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(got[i].S == want[i].S && got[i].z == want[i].z &&
                got[i].log_decay == want[i].log_decay)
        << "state " << i;
}

template <class S>
void check_forward(const Case& c, std::uint32_t seed) {
  const Inputs<S> in(c, seed);
  const M<S> g = in.activated();
  const auto gates = linattn::in_kernel_gates(in.A_log, in.dt_bias, in.gate);
  const Index N = in.N, H = in.H;
  linattn::MultiHeadWorkspace<S> ws, ws2;
  M<S> out(N, H * in.Mv), ref(N, H * in.Mv);
  linattn::multihead_gated_linear_attention(in.Q, in.K, in.V, in.a, gates, H, Identity{}, out, ws,
                                            in.opts);
  linattn::multihead_gated_linear_attention(in.Q, in.K, in.V, g, H, Identity{}, ref, ws2, in.opts);
  EXPECT_TRUE(out == ref) << "multi-head: " << test::max_abs_diff(out, ref);
  States<S> st, st_ref;
  for (int pass = 0; pass < 2; ++pass) {  // the second continues the first's states
    linattn::multihead_gated_linear_attention(in.Q, in.K, in.V, in.a, gates, H, Identity{}, st,
                                              out, ws, in.opts);
    linattn::multihead_gated_linear_attention(in.Q, in.K, in.V, g, H, Identity{}, st_ref, ref,
                                              ws2, in.opts);
    EXPECT_TRUE(out == ref) << "carried states, pass " << pass;
    expect_states_equal(st, st_ref);
  }
  const Eigen::VectorXi offsets = (Eigen::VectorXi(4) << 0, 6, 6, int(N)).finished();
  linattn::batched_gated_linear_attention(in.Q, in.K, in.V, in.a, gates, offsets, H, Identity{},
                                          out, ws, in.opts);
  linattn::batched_gated_linear_attention(in.Q, in.K, in.V, g, offsets, H, Identity{}, ref, ws2,
                                          in.opts);
  EXPECT_TRUE(out == ref) << "batched";
  States<S> bs, bs_ref;
  linattn::batched_gated_linear_attention(in.Q, in.K, in.V, in.a, gates, offsets, H, Identity{},
                                          bs, out, ws, in.opts);
  linattn::batched_gated_linear_attention(in.Q, in.K, in.V, g, offsets, H, Identity{}, bs_ref, ref,
                                          ws2, in.opts);
  EXPECT_TRUE(out == ref) << "batched, states";
  expect_states_equal(bs, bs_ref);
}

TEST(gated_gates, ForwardEqualsTheComposition) {
  std::uint32_t seed = 100;
  for (const Case& c : kCases) {
    IF_FLOAT(check_forward<float>(c, seed));
    IF_DOUBLE(check_forward<double>(c, seed));
    seed += 10;
  }
}

template <class S>
void check_backward(const Case& c, std::uint32_t seed) {
  const Inputs<S> in(c, seed);
  const M<S> g = in.activated();
  const Index H = in.H;
  auto k = linattn::multihead_gated_linear_attention_backward(in.Q, in.K, in.V, g, in.W, H,
                                                              Identity{}, in.opts);
  M<S> da(in.a.rows(), in.a.cols());
  Vec<S> dA_log(H), ddt_bias(in.dt_bias.size());
  linattn::gate_activation_backward(in.a, in.A_log, in.dt_bias, k.dlog_gates, da, dA_log, ddt_bias,
                                    in.gate);
  auto r = linattn::multihead_gated_linear_attention_backward(
      in.Q, in.K, in.V, in.a, linattn::in_kernel_gates(in.A_log, in.dt_bias, in.gate), in.W, H,
      Identity{}, in.opts);
  EXPECT_TRUE(r.dQ == k.dQ && r.dK == k.dK && r.dV == k.dV) << "dQ, dK, dV";
  EXPECT_TRUE(r.dlog_gates == k.dlog_gates) << "the kernel's dg";
  EXPECT_TRUE(r.da == da) << "da: " << test::max_abs_diff(r.da, da);
  EXPECT_TRUE(r.dA_log == dA_log) << "dA_log";
  EXPECT_TRUE(r.ddt_bias == ddt_bias) << "ddt_bias";
}

TEST(gated_gates, BackwardEqualsTheComposition) {
  std::uint32_t seed = 300;
  for (const Case& c : kCases) {
    IF_FLOAT(check_backward<float>(c, seed));
    IF_DOUBLE(check_backward<double>(c, seed));
    seed += 10;
  }
}

void check_differences(const Case& c, std::uint32_t seed) {
  Inputs<double> in(c, seed);
  const Index H = in.H;
  const auto loss = [&] {
    linattn::MultiHeadWorkspace<double> ws;
    Eigen::MatrixXd out(in.N, H * in.Mv);
    linattn::multihead_gated_linear_attention(
        in.Q, in.K, in.V, in.a, linattn::in_kernel_gates(in.A_log, in.dt_bias, in.gate), H,
        Identity{}, out, ws, in.opts);
    return (in.W.array() * out.array()).sum();
  };
  const auto r = linattn::multihead_gated_linear_attention_backward(
      in.Q, in.K, in.V, in.a, linattn::in_kernel_gates(in.A_log, in.dt_bias, in.gate), in.W, H,
      Identity{}, in.opts);
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
}

TEST(gated_gates, GradientsMatchCentralDifferences) {
  std::uint32_t seed = 500;
  for (const Case& c : kCases) check_differences(c, seed += 10);
}

TEST(gated_gates, ErrorsNameTheFunctionAndShapes) {
  Inputs<float> in(kCases[0], 7);
  const Index H = in.H;
  linattn::MultiHeadWorkspace<float> ws;
  Eigen::MatrixXf out = Eigen::MatrixXf::Constant(in.N, H * in.Mv, 7.0f);
  const auto fwd = [&](const Eigen::VectorXf& A_log, const Eigen::VectorXf& dt_bias,
                       const GateOptions& gate) {
    return [&, A_log, dt_bias, gate] {
      linattn::multihead_gated_linear_attention(in.Q, in.K, in.V, in.a,
                                                linattn::in_kernel_gates(A_log, dt_bias, gate), H,
                                                Identity{}, out, ws, in.opts);
    };
  };
  const std::string f = "multihead_gated_linear_attention";
  test::expect_invalid(fwd(Eigen::VectorXf::Zero(5), in.dt_bias, in.gate),
                       {f, "A_log has 5 entries", "H = 4", "a is 13x4", "Q is 13x6"},
                       "A_log size");
  test::expect_invalid(fwd(in.A_log, Eigen::VectorXf::Zero(3), in.gate),
                       {f, "dt_bias has 3 entries", "a is 13x4", "Q is 13x6"}, "dt_bias size");
  Eigen::VectorXf bad = in.A_log;
  bad(1) = std::numeric_limits<float>::infinity();
  test::expect_invalid(fwd(bad, in.dt_bias, in.gate), {f, "A_log(1, 0) = inf", "finite"},
                       "inf A_log");
  GateOptions lb;
  lb.activation = GateActivation::LowerBoundSigmoid;
  lb.lower_bound = 0.5;
  test::expect_invalid(fwd(in.A_log, in.dt_bias, lb), {f, "lower_bound = 0.5", "< 0"},
                       "lower bound");
  const Eigen::MatrixXf a_wide = Eigen::MatrixXf::Zero(in.N, 5);
  test::expect_invalid(
      [&] {
        linattn::batched_gated_linear_attention(in.Q, in.K, in.V, a_wide,
                                                linattn::in_kernel_gates(in.A_log, in.dt_bias),
                                                Eigen::VectorXi::LinSpaced(2, 0, int(in.N)), H,
                                                Identity{}, out, ws, in.opts);
      },
      {"batched_gated_linear_attention", "a is 13x5", "13x12", "Q is 13x6"}, "a's shape");
  EXPECT_TRUE((out.array() == 7.0f).all()) << "an error wrote the output";
}

}  // namespace gated_gates_test
