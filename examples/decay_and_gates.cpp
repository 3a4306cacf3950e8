// Decay and gates: the linear attention of RetNet, Mamba-2 and GLA with linattn.
//
//   decay_and_gates           larger sizes
//   decay_and_gates --smoke   small sizes (what ctest runs)
//
// The state forgets: per token t, S_t = a_t·S_{t-1} + φ(k_t)v_tᵀ (a scalar decay a_t) or
// S_t = diag(α_t)·S_{t-1} + φ(k_t)v_tᵀ (a gate per feature), and out_t = scale·φ(q_t)ᵀS_t.
// The kernels take the log-decays g_t = log a_t <= 0, as models compute them.
//
//  (a) RetNet: a fixed decay γ_h per head (log gates: a constant column log γ_h per head),
//      multihead_gated_linear_attention with N x H log gates, scale 1/√D, the Identity map.
//  (b) Mamba-2 / simple GLA: a decay per token computed from the input, log a_t = -Δ_t·A with
//      Δ_t = softplus(x_t·w_Δ + b_Δ); a prompt prefilled with gated_linear_attention carrying a
//      LinearAttentionState, handed to a RecurrentGatedAttention that decodes token by token.
//  (c) GLA: a gate per token and feature, log α_t = log-sigmoid(x_t W_g) / 16 (N x F), with
//      Gated DeltaNet's L2Normalize<Silu> features; the gradients of a loss with respect to Q,
//      K, V and the log gates from gated_linear_attention_backward, chained into the gate
//      projection W_g, checked against central differences.
//
// Every output is checked against the recurrence above evaluated token by token in double
// (reference() below), and the gradients against central differences; the program returns
// non-zero if an error exceeds its bound, printed next to it. The bounds are about 4-7 times the
// worst errors measured (g++ 12, x86-64, both sizes): float outputs 4.0e-7 of the output's
// scale, double 4.6e-16 (Chunked vs Auto gradients 9.3e-16), central differences 7.2e-9
// (h = 1e-5). A wrong term in a kernel or a gradient gives errors near 1.
#include <linattn/linattn.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

namespace {

using Eigen::Index;

Eigen::MatrixXf randn(Index rows, Index cols, float scale, std::mt19937& gen) {
  std::normal_distribution<float> dist(0.0f, scale);
  Eigen::MatrixXf m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = dist(gen);
  return m;
}

// softplus(x) = log(1 + e^x) and log σ(x) = -softplus(-x), for any x without overflow.
float softplus(float x) { return std::max(x, 0.0f) + std::log1p(std::exp(-std::abs(x))); }
double log_sigmoid(double x) { return std::min(x, 0.0) - std::log1p(std::exp(-std::abs(x))); }

// The definition, one token at a time in double: S_t = diag(exp(g_t))·S_{t-1} + φ(k_t)v_tᵀ and
// out_t = scale·φ(q_t)ᵀS_t, where the row g_t of G has 1 entry (a scalar decay) or F (gates).
template <class Phi>
Eigen::MatrixXd reference(const Eigen::MatrixXd& Q, const Eigen::MatrixXd& K,
                          const Eigen::MatrixXd& V, const Eigen::MatrixXd& G, const Phi& phi,
                          double scale) {
  const Index N = Q.rows(), F = phi.feature_dim(Q.cols()), M = V.cols();
  Eigen::MatrixXd pq(N, F), pk(N, F), out(N, M);
  phi.map(Q, pq);
  phi.map(K, pk);
  Eigen::MatrixXd S = Eigen::MatrixXd::Zero(F, M);
  for (Index t = 0; t < N; ++t) {
    const Eigen::VectorXd a = G.row(t).transpose().array().exp();
    if (a.size() == 1)
      S *= a(0);
    else
      S = a.asDiagonal() * S;
    S += pk.row(t).transpose() * V.row(t);
    out.row(t) = scale * pq.row(t) * S;
  }
  return out;
}

// max |a - b| / max |b|: the error relative to the output's scale.
double rel_error(const Eigen::MatrixXd& a, const Eigen::MatrixXd& b) {
  return (a - b).cwiseAbs().maxCoeff() / b.cwiseAbs().maxCoeff();
}
double rel_error(const Eigen::MatrixXf& a, const Eigen::MatrixXd& b) {
  return rel_error(Eigen::MatrixXd(a.cast<double>()), b);
}

bool report(const char* what, double error, double bound) {
  const bool ok = error <= bound && std::isfinite(error);
  std::printf("  %-58s %.1e  (bound %.1e)%s\n", what, error, bound, ok ? "" : "  <-- FAILED");
  return ok;
}

// ---------------------------------------------------------------------------------------------
// (a) RetNet: a fixed decay per head.
// ---------------------------------------------------------------------------------------------
bool retnet(bool smoke) {
  const Index N = smoke ? 300 : 3000, H = 4, D = 64, M = 64;
  std::mt19937 gen(1);
  const Eigen::MatrixXf Q = randn(N, H * D, 1.0f, gen);  // heads side by side: head h in
  const Eigen::MatrixXf K = randn(N, H * D, 1.0f, gen);  // columns [h·D, (h+1)·D)
  const Eigen::MatrixXf V = randn(N, H * M, 1.0f, gen);

  // RetNet's decays, γ_h = 1 - 2^(-5-h): head h remembers about 1 / (1 - γ_h) = 2^(5+h) tokens.
  // One log-decay per head and token: N x H, column h constant.
  Eigen::MatrixXf log_gamma(N, H);
  for (Index h = 0; h < H; ++h)
    log_gamma.col(h).setConstant(static_cast<float>(std::log1p(-std::exp2(-5.0 - h))));

  linattn::GatedOptions opts;
  opts.scale = 1.0 / std::sqrt(static_cast<double>(D));  // RetNet scales q·k by 1/√D
  const Eigen::MatrixXf out =
      linattn::multihead_gated_linear_attention(Q, K, V, log_gamma, H, linattn::Identity{}, opts);

  // The same with the chunked GEMM form forced (Auto runs this 64 x 64 state recurrently).
  linattn::GatedOptions chunked = opts;
  chunked.algorithm = linattn::CausalAlgorithm::Chunked;
  const Eigen::MatrixXf out_chunked = linattn::multihead_gated_linear_attention(
      Q, K, V, log_gamma, H, linattn::Identity{}, chunked);

  std::printf("(a) RetNet: fixed decay per head, H = %ld, D = M = %ld, N = %ld, float\n",
              static_cast<long>(H), static_cast<long>(D), static_cast<long>(N));
  double err = 0, err_chunked = 0;
  for (Index h = 0; h < H; ++h) {
    const Eigen::MatrixXd ref = reference(
        Q.middleCols(h * D, D).cast<double>(), K.middleCols(h * D, D).cast<double>(),
        V.middleCols(h * M, M).cast<double>(), log_gamma.col(h).cast<double>(),
        linattn::Identity{}, opts.scale);
    const double e = rel_error(Eigen::MatrixXf(out.middleCols(h * M, M)), ref);
    const double ec = rel_error(Eigen::MatrixXf(out_chunked.middleCols(h * M, M)), ref);
    std::printf("  head %ld: gamma = 1 - 2^-%ld = %.6f (memory ~%4.0f tokens), error vs double "
                "%.1e (chunked %.1e)\n",
                static_cast<long>(h), static_cast<long>(5 + h), std::exp(log_gamma(0, h)),
                1.0 / -std::expm1(static_cast<double>(log_gamma(0, h))), e, ec);
    err = std::max(err, e);
    err_chunked = std::max(err_chunked, ec);
  }
  bool ok = report("Auto vs the recurrence in double, worst head", err, 1.5e-6);
  ok &= report("Chunked vs the recurrence in double, worst head", err_chunked, 1.5e-6);
  return ok;
}

// ---------------------------------------------------------------------------------------------
// (b) Mamba-2 / simple GLA: a decay per token from the input; prefill, then decode.
// ---------------------------------------------------------------------------------------------
bool mamba2(bool smoke) {
  const Index d_model = 32, D = 64, M = 64;  // D: the state size of B and C; M: the head size
  const Index prompt = smoke ? 200 : 2000, decode = 24, N = prompt + decode;
  std::mt19937 gen(2);
  const float w = 1.0f / std::sqrt(static_cast<float>(d_model));
  const Eigen::MatrixXf X = randn(N, d_model, 1.0f, gen);  // the layer's input, one row a token
  const Eigen::MatrixXf W_C = randn(d_model, D, w, gen), W_B = randn(d_model, D, w, gen),
                        W_x = randn(d_model, M, w, gen);
  const Eigen::VectorXf w_dt = randn(d_model, 1, w, gen);
  const float dt_bias = -3.0f;        // softplus(-3) ≈ 0.05: Δ mostly between 0.01 and 0.3
  const float A = std::exp(1.0f);     // Mamba-2 keeps A_log; the decay rate is A = exp(A_log)

  // The log-decays: log a_t = -Δ_t·A, with the step Δ_t = softplus(x_t·w_Δ + b_Δ) > 0.
  Eigen::VectorXf delta(N);
  for (Index t = 0; t < N; ++t) delta(t) = softplus(X.row(t).dot(w_dt) + dt_bias);
  const Eigen::VectorXf log_a = -A * delta;

  // In SSD terms: queries C_t, keys B_t, values Δ_t·x_t (Mamba-2 scales its input by Δ).
  const Eigen::MatrixXf Q = X * W_C, K = X * W_B;
  Eigen::MatrixXf V = X * W_x;
  V.array().colwise() *= delta.array();

  linattn::GatedOptions opts;  // Mamba-2: no output scale (scale = 1), no normalisation

  // 1. Prefill the prompt in parallel, carrying the state out. (Chunked forced, to hand over
  // from the GEMM form to the decode step; Auto would pick the recurrent form for 64 x 64.)
  linattn::GatedOptions prefill_opts = opts;
  prefill_opts.algorithm = linattn::CausalAlgorithm::Chunked;
  linattn::LinearAttentionState<float> state;
  const Eigen::MatrixXf prompt_out = linattn::gated_linear_attention(
      Q.topRows(prompt), K.topRows(prompt), V.topRows(prompt), log_a.head(prompt),
      linattn::Identity{}, state, prefill_opts);

  // 2. Hand the state to the decoder, 3. decode token by token (a model would compute token
  // t + 1's inputs from output t; here they are the rows of X).
  linattn::RecurrentGatedAttention<linattn::Identity, float> rnn(D, M, opts);
  rnn.set_state(state, prompt);
  Eigen::MatrixXf generated(N, M);
  generated.topRows(prompt) = prompt_out;
  Eigen::VectorXf y(M);
  for (Index t = prompt; t < N; ++t) {
    rnn.step(Q.row(t), K.row(t), V.row(t), log_a(t), y);  // a scalar log gate
    generated.row(t) = y.transpose();
  }

  // Checks: prefill + decode == one call over the whole sequence == the recurrence in double.
  const Eigen::MatrixXf one_shot =
      linattn::gated_linear_attention(Q, K, V, log_a, linattn::Identity{}, opts);
  const Eigen::MatrixXd ref = reference(Q.cast<double>(), K.cast<double>(), V.cast<double>(),
                                        log_a.cast<double>(), linattn::Identity{}, opts.scale);
  std::printf("(b) Mamba-2 / simple GLA: decay per token, D = M = %ld, prompt %ld + %ld decoded "
              "tokens, float\n",
              static_cast<long>(D), static_cast<long>(prompt), static_cast<long>(decode));
  std::printf("  a_t = exp(-A*dt_t) in [%.4f, %.4f]; the prompt's total log-decay "
              "state.log_decay = %.2f (sum of log a_t: %.2f)\n",
              std::exp(log_a.minCoeff()), std::exp(log_a.maxCoeff()), state.log_decay(0),
              log_a.head(prompt).sum());
  const Eigen::MatrixXf dec = generated.bottomRows(decode), one = one_shot.bottomRows(decode);
  bool ok = report("decoded tokens vs the one-shot call", rel_error(dec, one.cast<double>()),
                   1.5e-6);
  ok &= report("prefill + decode vs the recurrence in double", rel_error(generated, ref), 1.5e-6);
  ok &= report("one-shot call vs the recurrence in double", rel_error(one_shot, ref), 1.5e-6);
  ok &= report("state.log_decay vs the sum of the prompt's log gates",
               std::abs(state.log_decay(0) - log_a.head(prompt).sum()) /
                   std::abs(log_a.head(prompt).sum()),
               1e-6);
  return ok;
}

// ---------------------------------------------------------------------------------------------
// (c) GLA: a gate per token and feature, and the gradients (double).
// ---------------------------------------------------------------------------------------------
using Mat = Eigen::MatrixXd;

struct Gla {
  Mat X, Y, W_q, W_k, W_v, W_g;  // input, target, projections (d_model x D, ..., d_model x F)
  linattn::L2Normalize<linattn::Silu> phi;  // Gated DeltaNet's features: silu(x) / ‖silu(x)‖
  linattn::GatedOptions opts;

  // log α = log-sigmoid(X W_g) / 16: GLA's gates, all in (-∞, 0); α close to 1.
  Mat log_gates(const Mat& W_gate) const {
    return (X * W_gate).unaryExpr([](double z) { return log_sigmoid(z) / 16.0; });
  }
  // The loss L = ½‖out − Y‖² / N.
  double loss(const Mat& Q, const Mat& K, const Mat& V, const Mat& G) const {
    const Mat out = linattn::gated_linear_attention(Q, K, V, G, phi, opts);
    return 0.5 * (out - Y).squaredNorm() / static_cast<double>(Y.rows());
  }
  double loss() const { return loss(X * W_q, X * W_k, X * W_v, log_gates(W_g)); }
};

// max |analytic − central difference| over 4 random entries of A (which loss() reads), divided
// by the largest entry of the analytic gradient (as in gradient_check.cpp).
template <class Loss>
double max_scaled_error(Mat& A, const Mat& analytic, Loss&& loss, std::mt19937& gen) {
  const double h = 1e-5;
  std::uniform_int_distribution<Index> row(0, A.rows() - 1), col(0, A.cols() - 1);
  double worst = 0;
  for (int n = 0; n < 4; ++n) {
    const Index i = row(gen), j = col(gen);
    const double a = A(i, j);
    A(i, j) = a + h;
    const double up = loss();
    A(i, j) = a - h;
    const double down = loss();
    A(i, j) = a;
    worst = std::max(worst, std::abs(analytic(i, j) - (up - down) / (2 * h)));
  }
  return worst / analytic.cwiseAbs().maxCoeff();
}

bool gla(bool smoke) {
  const Index N = smoke ? 100 : 700, d_model = 16, D = 16, M = 16, F = D;  // F: L2Normalize keeps D
  std::mt19937 gen(3);
  const auto randd = [&](Index r, Index c, double s) {
    return Mat(randn(r, c, static_cast<float>(s), gen).cast<double>());
  };
  const double w = 1.0 / std::sqrt(static_cast<double>(d_model));
  Gla m;
  m.X = randd(N, d_model, 1.0);
  m.Y = randd(N, M, 0.1);
  m.W_q = randd(d_model, D, w);
  m.W_k = randd(d_model, D, w);
  m.W_v = randd(d_model, M, w);
  m.W_g = randd(d_model, F, w);
  m.opts.scale = 1.0 / std::sqrt(static_cast<double>(D));

  // Forward: N x F log gates, one per token and feature.
  Mat Q = m.X * m.W_q, K = m.X * m.W_k, V = m.X * m.W_v;
  const Mat Z = m.X * m.W_g;  // the gate logits
  Mat G = m.log_gates(m.W_g);
  const Mat out = linattn::gated_linear_attention(Q, K, V, G, m.phi, m.opts);

  // Backward: dOut = ∂L/∂out, then dQ, dK, dV and dlog_gates (N x F, the shape of G).
  const Mat dOut = (out - m.Y) / static_cast<double>(N);
  const linattn::GatedGradients<double> g =
      linattn::gated_linear_attention_backward(Q, K, V, G, dOut, m.phi, m.opts);
  // Chained into the gate projection: d log-sigmoid(z)/dz = σ(-z), and the 1/16.
  const Mat dZ = g.dlog_gates.cwiseProduct(
      Z.unaryExpr([](double z) { return 1.0 / (1.0 + std::exp(z)) / 16.0; }));
  Mat dW_g = m.X.transpose() * dZ;

  std::printf("(c) GLA: gates per token and feature, L2Normalize<Silu>, D = M = F = %ld, "
              "N = %ld, double\n",
              static_cast<long>(D), static_cast<long>(N));
  std::printf("  alpha = exp(log-sigmoid(x W_g) / 16) in [%.4f, %.4f]; dlog_gates is %ldx%ld, "
              "max |dlog_gates| = %.2e\n",
              std::exp(G.minCoeff()), std::exp(G.maxCoeff()),
              static_cast<long>(g.dlog_gates.rows()), static_cast<long>(g.dlog_gates.cols()),
              g.dlog_gates.cwiseAbs().maxCoeff());
  const Mat ref = reference(Q, K, V, G, m.phi, m.opts.scale);
  bool ok = report("forward vs the recurrence in double", rel_error(out, ref), 3e-15);

  // The chunked GEMM forms, forward and backward (Auto runs this 16 x 16 state recurrently):
  // the same to rounding.
  linattn::GatedOptions chunked = m.opts;
  chunked.algorithm = linattn::CausalAlgorithm::Chunked;
  chunked.chunk_size = 32;
  const Mat out_chunked = linattn::gated_linear_attention(Q, K, V, G, m.phi, chunked);
  const linattn::GatedGradients<double> g_chunked =
      linattn::gated_linear_attention_backward(Q, K, V, G, dOut, m.phi, chunked);
  ok &= report("forward, Chunked, vs the recurrence in double", rel_error(out_chunked, ref),
               3e-15);
  ok &= report("dlog_gates, Chunked vs Auto",
               rel_error(g_chunked.dlog_gates, g.dlog_gates), 5e-15);
  const auto loss_qkvg = [&] { return m.loss(Q, K, V, G); };
  const auto loss_w = [&] { return m.loss(); };
  ok &= report("dlog_gates vs central differences (4 entries)",
               max_scaled_error(G, g.dlog_gates, loss_qkvg, gen), 5e-8);
  ok &= report("dQ, dK, dV vs central differences (4 entries each)",
               std::max({max_scaled_error(Q, g.dQ, loss_qkvg, gen),
                         max_scaled_error(K, g.dK, loss_qkvg, gen),
                         max_scaled_error(V, g.dV, loss_qkvg, gen)}),
               5e-8);
  ok &= report("dW_g (chained through the gates) vs central differences",
               max_scaled_error(m.W_g, dW_g, loss_w, gen), 5e-8);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const bool smoke = argc > 1 && std::strcmp(argv[1], "--smoke") == 0;
  bool ok = retnet(smoke);
  ok &= mamba2(smoke);
  ok &= gla(smoke);
  std::printf(ok ? "checks passed\n" : "CHECK FAILED\n");
  return ok ? 0 : 1;
}
