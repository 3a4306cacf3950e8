// Shared query/key heads (GVA: H value heads over Hk = H / G query/key heads, the options'
// key_heads) in the gated and delta-rule kernels: multi-head and batched forwards with carried
// states against the long-double references on the shared head's columns and against the same
// call with each key head repeated over its value heads (transformers' repeat_interleave);
// gradients of a shared head against the sums over its value heads (delta: the long-double
// chain rule); errors that name both head counts.
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <linattn/linattn.hpp>
#include <string>
#include <vector>

#include "delta_reference.hpp"
#include "gated_reference.hpp"
#include "test_util.hpp"

namespace {

using linattn::DeltaOptions;
using linattn::GatedOptions;
using linattn::Identity;
using SiluL2 = linattn::L2Normalize<linattn::Silu>;
using test::Index;
using test::Mat;
using test::MatD;
using test::RowMat;
using VecD = Eigen::VectorXd;
template <class S>
using State = linattn::LinearAttentionState<S>;
using Needles = std::vector<std::string>;

MatD frand(Index rows, Index cols, std::uint32_t seed, double lo = -1.0, double hi = 1.0) {
  return test::random_matrix<float>(rows, cols, seed, lo, hi).cast<double>();
}

double rel(const MatD& got, const MatD& want) {
  const double scale = std::max(want.cwiseAbs().maxCoeff(), 1e-300);
  return test::max_abs_diff(got, want) / scale;
}

// Kernel against the long-double references, relative to the largest magnitude.
template <class S>
double bound() {
  return test::bound<S>(5e-6, 1e-13);
}

// X (N x Hk·D) with each head repeated G times in place: N x Hk·G·D (repeat_interleave).
MatD repeat_heads(const MatD& X, Index Hk, Index G) {
  const Index D = X.cols() / Hk;
  MatD out(X.rows(), Hk * G * D);
  for (Index kh = 0; kh < Hk; ++kh)
    for (Index j = 0; j < G; ++j) out.middleCols((kh * G + j) * D, D) = X.middleCols(kh * D, D);
  return out;
}

// The gradient of a repeated input summed back over the G copies of each head.
MatD sum_heads(const MatD& X, Index Hk, Index G) {
  const Index D = X.cols() / (Hk * G);
  MatD out = MatD::Zero(X.rows(), Hk * D);
  for (Index kh = 0; kh < Hk; ++kh)
    for (Index j = 0; j < G; ++j) out.middleCols(kh * D, D) += X.middleCols((kh * G + j) * D, D);
  return out;
}

struct Shape {
  Index Hk, G, D, M;
  std::vector<int> offsets;  // cu_seqlens; {0, N} for one sequence
  Index H() const { return Hk * G; }
  Index N() const { return offsets.back(); }
  std::string name() const {
    std::string s = "Hk = " + std::to_string(Hk) + ", G = " + std::to_string(G) +
                    ", D = " + std::to_string(D) + ", M = " + std::to_string(M) + ", offsets =";
    for (int o : offsets) s += " " + std::to_string(o);
    return s;
  }
};

const Shape kShapes[] = {{2, 2, 4, 3, {0, 1}},        // one token
                         {2, 3, 5, 4, {0, 37}},       // N not a multiple of a chunk
                         {1, 4, 4, 6, {0, 70}},       // one key head for all, past a chunk
                         {3, 2, 3, 5, {0, 1, 18, 41}}};  // varlen, a one-token sequence

struct Case {
  Shape sh;
  MatD Q, K, V, W, beta, log_a, gates;  // gates: per feature (N x H·D) when per_feature
  std::vector<MatD> S0;                 // per sequence and value head
  Case(const Shape& s, bool per_feature, std::uint32_t seed) : sh(s) {
    const Index N = s.N(), H = s.H();
    Q = frand(N, s.Hk * s.D, seed);
    K = frand(N, s.Hk * s.D, seed + 1);
    V = frand(N, H * s.M, seed + 2);
    W = frand(N, H * s.M, seed + 3);
    beta = frand(N, H, seed + 4, 0.1, 1.9);
    log_a = frand(N, H, seed + 5, -0.6, -0.01);
    gates = frand(N, per_feature ? H * s.D : H, seed + 6, -0.6, -0.01);
    const Index B = Index(s.offsets.size()) - 1;
    for (Index i = 0; i < B * H; ++i) S0.push_back(frand(s.D, s.M, seed + 20 + std::uint32_t(i)));
  }
  Index rows(Index b) const { return sh.offsets[std::size_t(b) + 1] - sh.offsets[std::size_t(b)]; }
  // Sequence b, value head h by the references from S0, on its key head's columns.
  MatD delta_reference(Index b, Index h, double scale) const {
    const Index r0 = sh.offsets[std::size_t(b)], n = rows(b), c = (h / sh.G) * sh.D;
    MatD S = S0[std::size_t(b * sh.H() + h)];
    return dref::recurrence(SiluL2{}, Q.block(r0, c, n, sh.D), K.block(r0, c, n, sh.D),
                            V.block(r0, h * sh.M, n, sh.M), VecD(beta.block(r0, h, n, 1)),
                            VecD(log_a.block(r0, h, n, 1)), scale, &S);
  }
  MatD gated_reference(Index b, Index h, double scale) const {
    const Index r0 = sh.offsets[std::size_t(b)], n = rows(b), c = (h / sh.G) * sh.D;
    const Index gw = gates.cols() / sh.H();
    gref::State st;
    st.S = S0[std::size_t(b * sh.H() + h)];
    st.z = VecD::Zero(sh.D);
    st.log_decay = VecD::Zero(gw);
    gref::Options o;
    o.scale = scale;
    return gref::recurrence(Q.block(r0, c, n, sh.D), K.block(r0, c, n, sh.D),
                            V.block(r0, h * sh.M, n, sh.M), gates.block(r0, h * gw, n, gw),
                            Identity{}, o, &st);
  }
};

template <class S>
std::vector<State<S>> initial_states(const Case& c) {
  std::vector<State<S>> states(c.S0.size());
  for (std::size_t i = 0; i < states.size(); ++i) {
    states[i].S = c.S0[i].cast<S>();
    states[i].z = linattn::Vector<S>::Zero(c.sh.D);
  }
  return states;
}

// The batched delta rule with shared key heads (Q, K of layout QL), against the references and
// against the call on repeated keys; the carried states against the repeated call's.
template <class S, class QL>
void check_delta_forward(const Shape& sh, linattn::CausalAlgorithm algorithm) {
  SCOPED_TRACE(sh.name());
  const Case c(sh, false, 300 + std::uint32_t(sh.N()));
  const QL Q = c.Q.cast<S>(), K = c.K.cast<S>();
  const Mat<S> V = c.V.cast<S>(), beta = c.beta.cast<S>(), log_a = c.log_a.cast<S>();
  DeltaOptions o;
  o.scale = 0.5;
  o.algorithm = algorithm;
  o.chunk_size = 16;
  o.key_heads = sh.Hk;
  o.key_dim = sh.D;
  o.value_dim = sh.M;
  linattn::MultiHeadWorkspace<S> ws;
  Mat<S> out(sh.N(), sh.H() * sh.M);
  std::vector<State<S>> states = initial_states<S>(c);
  linattn::batched_delta_rule_attention(Q, K, V, beta, log_a, sh.offsets, sh.H(), SiluL2{},
                                        states, out, ws, o);
  MatD want(sh.N(), sh.H() * sh.M);
  for (Index b = 0; b + 1 < Index(sh.offsets.size()); ++b)
    for (Index h = 0; h < sh.H(); ++h)
      want.block(sh.offsets[std::size_t(b)], h * sh.M, c.rows(b), sh.M) =
          c.delta_reference(b, h, o.scale);
  EXPECT_LE(rel(out.template cast<double>(), want), bound<S>());
  // Repeated keys, key_heads unstated: the same kernel on the same numbers.
  DeltaOptions plain = o;
  plain.key_heads = 0;
  plain.key_dim = 0;
  const Mat<S> Qr = repeat_heads(c.Q, sh.Hk, sh.G).cast<S>(),
               Kr = repeat_heads(c.K, sh.Hk, sh.G).cast<S>();
  Mat<S> out_r(sh.N(), sh.H() * sh.M);
  std::vector<State<S>> states_r = initial_states<S>(c);
  linattn::batched_delta_rule_attention(Qr, Kr, V, beta, log_a, sh.offsets, sh.H(), SiluL2{},
                                        states_r, out_r, ws, plain);
  EXPECT_LE(test::max_abs_diff(out, out_r), 10 * std::numeric_limits<S>::epsilon());
  for (std::size_t i = 0; i < states.size(); ++i)
    EXPECT_LE(test::max_abs_diff(states[i].S, states_r[i].S),
              10 * std::numeric_limits<S>::epsilon())
        << "state " << i;
  // One sequence: the multi-head form from zero states equals the batched one.
  if (sh.offsets.size() == 2) {
    Mat<S> zero_out(sh.N(), sh.H() * sh.M);
    linattn::multihead_delta_rule_attention(Q, K, V, beta, log_a, sh.H(), SiluL2{}, zero_out, ws,
                                            o);
    const Mat<S> zero_r =
        linattn::multihead_delta_rule_attention(Qr, Kr, V, beta, log_a, sh.H(), SiluL2{}, plain);
    EXPECT_LE(test::max_abs_diff(zero_out, zero_r), 10 * std::numeric_limits<S>::epsilon());
  }
}

template <class S, class QL>
void check_gated_forward(const Shape& sh, bool per_feature, linattn::CausalAlgorithm algorithm) {
  SCOPED_TRACE(sh.name() + (per_feature ? ", per-feature gates" : ", scalar gates"));
  const Case c(sh, per_feature, 400 + std::uint32_t(sh.N()));
  const QL Q = c.Q.cast<S>(), K = c.K.cast<S>();
  const Mat<S> V = c.V.cast<S>(), gates = c.gates.cast<S>();
  GatedOptions o;
  o.scale = 0.5;
  o.algorithm = algorithm;
  o.chunk_size = 16;
  o.key_heads = sh.Hk;
  linattn::MultiHeadWorkspace<S> ws;
  Mat<S> out(sh.N(), sh.H() * sh.M);
  std::vector<State<S>> states = initial_states<S>(c);
  linattn::batched_gated_linear_attention(Q, K, V, gates, sh.offsets, sh.H(), Identity{}, states,
                                          out, ws, o);
  MatD want(sh.N(), sh.H() * sh.M);
  for (Index b = 0; b + 1 < Index(sh.offsets.size()); ++b)
    for (Index h = 0; h < sh.H(); ++h)
      want.block(sh.offsets[std::size_t(b)], h * sh.M, c.rows(b), sh.M) =
          c.gated_reference(b, h, o.scale);
  EXPECT_LE(rel(out.template cast<double>(), want), bound<S>());
  GatedOptions plain = o;
  plain.key_heads = 0;
  const Mat<S> Qr = repeat_heads(c.Q, sh.Hk, sh.G).cast<S>(),
               Kr = repeat_heads(c.K, sh.Hk, sh.G).cast<S>();
  Mat<S> out_r(sh.N(), sh.H() * sh.M);
  std::vector<State<S>> states_r = initial_states<S>(c);
  linattn::batched_gated_linear_attention(Qr, Kr, V, gates, sh.offsets, sh.H(), Identity{},
                                          states_r, out_r, ws, plain);
  EXPECT_LE(test::max_abs_diff(out, out_r), 10 * std::numeric_limits<S>::epsilon());
  for (std::size_t i = 0; i < states.size(); ++i)
    EXPECT_LE(test::max_abs_diff(states[i].S, states_r[i].S),
              10 * std::numeric_limits<S>::epsilon())
        << "state " << i;
  if (sh.offsets.size() == 2) {
    const Mat<S> zero_out =
        linattn::multihead_gated_linear_attention(Q, K, V, gates, sh.H(), Identity{}, o);
    const Mat<S> zero_r =
        linattn::multihead_gated_linear_attention(Qr, Kr, V, gates, sh.H(), Identity{}, plain);
    EXPECT_LE(test::max_abs_diff(zero_out, zero_r), 10 * std::numeric_limits<S>::epsilon());
  }
}

template <class S>
void check_forwards() {
  for (const Shape& sh : kShapes)
    for (const auto algorithm :
         {linattn::CausalAlgorithm::Recurrent, linattn::CausalAlgorithm::Chunked}) {
      SCOPED_TRACE(algorithm == linattn::CausalAlgorithm::Recurrent ? "Recurrent" : "Chunked");
      check_delta_forward<S, Mat<S>>(sh, algorithm);
      check_delta_forward<S, RowMat<S>>(sh, algorithm);
      check_gated_forward<S, Mat<S>>(sh, false, algorithm);
      check_gated_forward<S, RowMat<S>>(sh, true, algorithm);
    }
}

TEST(shared_heads, ForwardsAgainstReferencesAndRepeatedKeys) {
  IF_FLOAT(check_forwards<float>());
  IF_DOUBLE(check_forwards<double>());
}

// Gradients: the delta rule's against the long-double chain rule per value head, summed over a
// shared head's value heads; the gated kernels' against the repeated call's, summed back.
template <class S>
void check_backwards() {
  const double tol = test::bound<S>(2e-5, 1e-11);
  for (const Shape& sh : kShapes) {
    if (sh.offsets.size() != 2) continue;  // the backward forms take one sequence
    SCOPED_TRACE(sh.name());
    const Index N = sh.N(), H = sh.H(), D = sh.D, M = sh.M;
    const Case c(sh, true, 500 + std::uint32_t(N));
    const Mat<S> Q = c.Q.cast<S>(), K = c.K.cast<S>(), V = c.V.cast<S>(), W = c.W.cast<S>();
    const Mat<S> beta = c.beta.cast<S>(), log_a = c.log_a.cast<S>();
    for (const auto algorithm :
         {linattn::CausalAlgorithm::Recurrent, linattn::CausalAlgorithm::Chunked}) {
      DeltaOptions o;
      o.scale = 0.5;
      o.algorithm = algorithm;
      o.chunk_size = 16;
      o.key_heads = sh.Hk;
      const auto g =
          linattn::multihead_delta_rule_attention_backward(Q, K, V, beta, log_a, W, H, SiluL2{}, o);
      MatD dQ = MatD::Zero(N, sh.Hk * D), dK = MatD::Zero(N, sh.Hk * D), dV(N, H * M),
           dbeta(N, H), dlog_a(N, H);
      for (Index h = 0; h < H; ++h) {
        const Index col = (h / sh.G) * D;
        const dref::Gradients r = dref::backward(
            SiluL2{}, c.Q.middleCols(col, D), c.K.middleCols(col, D), c.V.middleCols(h * M, M),
            VecD(c.beta.col(h)), VecD(c.log_a.col(h)), o.scale, c.W.middleCols(h * M, M));
        dQ.middleCols(col, D) += r.dQ;
        dK.middleCols(col, D) += r.dK;
        dV.middleCols(h * M, M) = r.dV;
        dbeta.col(h) = r.dbeta;
        dlog_a.col(h) = r.dlog_a;
      }
      EXPECT_LE(rel(g.dQ.template cast<double>(), dQ), tol) << "delta dQ";
      EXPECT_LE(rel(g.dK.template cast<double>(), dK), tol) << "delta dK";
      EXPECT_LE(rel(g.dV.template cast<double>(), dV), tol) << "delta dV";
      EXPECT_LE(rel(g.dbeta.template cast<double>(), dbeta), tol) << "delta dbeta";
      EXPECT_LE(rel(g.dlog_a.template cast<double>(), dlog_a), tol) << "delta dlog_a";

      // Gated, per-feature gates, row-major gradients written into caller buffers.
      GatedOptions go;
      go.scale = 0.5;
      go.algorithm = algorithm;
      go.chunk_size = 16;
      go.key_heads = sh.Hk;
      const Mat<S> gates = c.gates.cast<S>();
      RowMat<S> gq(N, sh.Hk * D), gk(N, sh.Hk * D), gv(N, H * M), gg(N, gates.cols());
      linattn::MultiHeadWorkspace<S> ws;
      linattn::multihead_gated_linear_attention_backward(Q, K, V, gates, W, H, Identity{}, gq, gk,
                                                         gv, gg, ws, go);
      GatedOptions plain = go;
      plain.key_heads = 0;
      const Mat<S> Qr = repeat_heads(c.Q, sh.Hk, sh.G).cast<S>(),
                   Kr = repeat_heads(c.K, sh.Hk, sh.G).cast<S>();
      const auto r = linattn::multihead_gated_linear_attention_backward(Qr, Kr, V, gates, W, H,
                                                                        Identity{}, plain);
      const MatD rq = sum_heads(r.dQ.template cast<double>(), sh.Hk, sh.G),
                 rk = sum_heads(r.dK.template cast<double>(), sh.Hk, sh.G);
      EXPECT_LE(rel(gq.template cast<double>(), rq), 10 * std::numeric_limits<S>::epsilon())
          << "gated dQ";
      EXPECT_LE(rel(gk.template cast<double>(), rk), 10 * std::numeric_limits<S>::epsilon())
          << "gated dK";
      EXPECT_EQ(test::max_abs_diff(gv, r.dV), 0.0) << "gated dV";
      EXPECT_EQ(test::max_abs_diff(gg, r.dlog_gates), 0.0) << "gated dlog_gates";
      // Reused buffers: a second call gives the same bits (the shared head's scratch reused).
      RowMat<S> gq2(N, sh.Hk * D), gk2(N, sh.Hk * D);
      linattn::multihead_gated_linear_attention_backward(Q, K, V, gates, W, H, Identity{}, gq2,
                                                         gk2, gv, gg, ws, go);
      EXPECT_EQ(test::max_abs_diff(gq2, gq), 0.0);
      EXPECT_EQ(test::max_abs_diff(gk2, gk), 0.0);
    }
  }
}

TEST(shared_heads, GradientsSumOverValueHeads) {
  IF_FLOAT(check_backwards<float>());
  IF_DOUBLE(check_backwards<double>());
}

// Errors: key_heads that do not divide heads, Q of columns that are no multiple of key_heads,
// key_heads on a single-head call; each names both counts, before anything is written.
TEST(shared_heads, ErrorsNameBothHeadCounts) {
  const Index N = 3;
  const Eigen::MatrixXf Q = frand(N, 12, 1).cast<float>(), V = frand(N, 6 * 2, 2).cast<float>();
  const Eigen::MatrixXf beta = Eigen::MatrixXf::Constant(N, 6, 0.5f),
                        log_a = Eigen::MatrixXf::Constant(N, 6, -0.1f), W = V;
  DeltaOptions o;
  GatedOptions go;
  o.key_heads = go.key_heads = 4;  // does not divide 6
  const Needles divisor = {"key_heads = 4", "divisor of heads = 6"};
  test::expect_invalid(
      [&] { linattn::multihead_delta_rule_attention(Q, Q, V, beta, log_a, 6, SiluL2{}, o); },
      divisor, "delta");
  test::expect_invalid(
      [&] { linattn::multihead_gated_linear_attention(Q, Q, V, log_a, 6, Identity{}, go); },
      divisor, "gated");
  test::expect_invalid(
      [&] {
        linattn::multihead_delta_rule_attention_backward(Q, Q, V, beta, log_a, W, 6, SiluL2{}, o);
      },
      divisor, "delta backward");
  test::expect_invalid(
      [&] { linattn::multihead_gated_linear_attention_backward(Q, Q, V, log_a, W, 6, Identity{}, go); },
      divisor, "gated backward");
  const Eigen::MatrixXf Q10 = frand(N, 10, 3).cast<float>();
  o.key_heads = go.key_heads = 3;  // divides 6, not Q's 10 columns
  const Needles columns = {"multiples of key_heads", "heads = 6", "key_heads = 3", "Q is 3x10"};
  test::expect_invalid(
      [&] { linattn::multihead_delta_rule_attention(Q10, Q10, V, beta, log_a, 6, SiluL2{}, o); },
      columns, "delta columns");
  test::expect_invalid(
      [&] { linattn::multihead_gated_linear_attention(Q10, Q10, V, log_a, 6, Identity{}, go); },
      columns, "gated columns");
  o.key_heads = go.key_heads = -1;
  test::expect_invalid(
      [&] { linattn::multihead_delta_rule_attention(Q, Q, V, beta, log_a, 6, SiluL2{}, o); },
      Needles{"key_heads = -1"}, "negative");
  // A single head has no key heads to share.
  o.key_heads = go.key_heads = 2;
  const Eigen::VectorXf b1 = Eigen::VectorXf::Constant(N, 0.5f), none;
  test::expect_invalid([&] { linattn::delta_rule_attention(Q, Q, V, b1, none, SiluL2{}, o); },
                       Needles{"delta_rule_attention", "key_heads = 2", "heads = 1"}, "single");
  test::expect_invalid(
      [&] { linattn::gated_linear_attention(Q, Q, V, Eigen::MatrixXf(log_a.col(0)), Identity{}, go); },
      Needles{"gated_linear_attention", "key_heads = 2", "heads = 1"}, "single gated");
  // key_heads = heads is the unshared layout: the same bits as unstated.
  o.key_heads = go.key_heads = 6;
  EXPECT_EQ(test::max_abs_diff(
                linattn::multihead_delta_rule_attention(Q, Q, V, beta, log_a, 6, SiluL2{}, o),
                linattn::multihead_delta_rule_attention(Q, Q, V, beta, log_a, 6, SiluL2{})),
            0.0);
}

}  // namespace
