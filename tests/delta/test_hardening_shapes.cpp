// Shapes, messages and overlaps of the delta and gated families: per-token parameters of one
// token with several heads (1 x H is N x H, never one head's row of N), in every layout and in
// a varlen batch with a one-token sequence, against the long-double references; values in
// messages printed to round-trip; stated head sizes that reject a GVA-shaped call; operands
// that share memory with a carried state.
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <limits>
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
template <class S>
using RowMap = Eigen::Map<RowMat<S>>;
using Needles = std::vector<std::string>;

// Float-exact inputs (drawn in float), so that float and double calls see the same numbers.
MatD frand(Index rows, Index cols, std::uint32_t seed, double lo = -1.0, double hi = 1.0) {
  return test::random_matrix<float>(rows, cols, seed, lo, hi).cast<double>();
}

// Kernel against the long-double references, relative to the largest magnitude: measured worst
// float 3e-7, double 6e-16 (N <= 300, D = 4, M = 3).
template <class S>
double bound() {
  return test::bound<S>(5e-6, 1e-13);
}

struct Algorithm {
  linattn::CausalAlgorithm algorithm;
  const char* name;
};
const Algorithm kAlgorithms[] = {{linattn::CausalAlgorithm::Recurrent, "Recurrent"},
                                 {linattn::CausalAlgorithm::Chunked, "Chunked"},
                                 {linattn::CausalAlgorithm::Auto, "Auto"}};

double rel(const MatD& got, const MatD& want) {
  const double scale = std::max(want.cwiseAbs().maxCoeff(), 1e-300);
  return test::max_abs_diff(got, want) / scale;
}

// A per-token parameter (N x H) held row-major in a buffer of exactly N·H entries, as the
// Python bindings pass them: an entry read or written past it is a heap overflow for ASan.
template <class S>
struct Exact {
  std::vector<S> buf;
  RowMap<S> map;
  explicit Exact(const MatD& x)
      : buf(static_cast<std::size_t>(x.size())), map(buf.data(), x.rows(), x.cols()) {
    map = x.cast<S>();
  }
  Exact(const Exact&) = delete;
};

// ---------------------------------------------------------------------------------------------
// One token, several heads: the delta rule.
// ---------------------------------------------------------------------------------------------

struct DeltaCase {
  Index H, D = 4, M = 3, N = 1;
  MatD Q, K, V, beta, log_a, W;
  std::vector<MatD> S0;  // per head
  DeltaCase(Index heads, Index n, std::uint32_t seed) : H(heads), N(n) {
    Q = frand(N, H * D, seed);
    K = frand(N, H * D, seed + 1);
    V = frand(N, H * M, seed + 2);
    beta = frand(N, H, seed + 3, 0.1, 1.9);
    log_a = frand(N, H, seed + 4, -0.5, -0.01);
    W = frand(N, H * M, seed + 5);
    for (Index h = 0; h < H; ++h) S0.push_back(frand(D, M, seed + 10 + std::uint32_t(h)));
  }
  // Rows [r0, r0 + n) of head h by the reference, from S0[h] or zero.
  MatD reference(Index h, bool carried, double scale, Index r0 = 0, Index n = -1) const {
    if (n < 0) n = N;
    MatD S = carried ? S0[std::size_t(h)] : MatD();
    return dref::recurrence(SiluL2{}, Q.block(r0, h * D, n, D), K.block(r0, h * D, n, D),
                            V.block(r0, h * M, n, M), VecD(beta.block(r0, h, n, 1)),
                            VecD(log_a.block(r0, h, n, 1)), scale, &S);
  }
};

template <class S>
void check_delta_one_token(Index H) {
  SCOPED_TRACE("H = " + std::to_string(H));
  const DeltaCase c(H, 1, 100 + std::uint32_t(H));
  const Mat<S> Q = c.Q.cast<S>(), K = c.K.cast<S>(), V = c.V.cast<S>();
  DeltaOptions o;
  o.scale = 0.5;
  MatD want(1, H * c.M), want_carried(1, H * c.M);
  for (Index h = 0; h < H; ++h) {
    want.middleCols(h * c.M, c.M) = c.reference(h, false, o.scale);
    want_carried.middleCols(h * c.M, c.M) = c.reference(h, true, o.scale);
  }
  // A taller row-major matrix whose row 5 holds the parameters: a one-row block of it (a
  // sequence of one token in a packed batch) has an outer stride of H.
  RowMat<S> tall_beta = (frand(9, H, 7, 0.1, 1.9)).cast<S>(),
            tall_a = (frand(9, H, 8, -1, 0)).cast<S>();
  tall_beta.row(5) = c.beta.cast<S>();
  tall_a.row(5) = c.log_a.cast<S>();
  const Exact<S> beta(c.beta), log_a(c.log_a);
  const Mat<S> beta_c = c.beta.cast<S>(), log_a_c = c.log_a.cast<S>();
  for (const Algorithm& alg : kAlgorithms) {
    o.algorithm = alg.algorithm;
    SCOPED_TRACE(alg.name);
    linattn::MultiHeadWorkspace<S> ws;
    Mat<S> out(1, H * c.M);
    // Column-major, exact-size row-major, and a row of a taller row-major matrix.
    linattn::multihead_delta_rule_attention(Q, K, V, beta_c, log_a_c, H, SiluL2{}, out, ws, o);
    EXPECT_LE(rel(out.template cast<double>(), want), bound<S>()) << "column-major";
    linattn::multihead_delta_rule_attention(Q, K, V, beta.map, log_a.map, H, SiluL2{}, out, ws, o);
    EXPECT_LE(rel(out.template cast<double>(), want), bound<S>()) << "row-major";
    linattn::multihead_delta_rule_attention(Q, K, V, tall_beta.middleRows(5, 1),
                                            tall_a.middleRows(5, 1), H, SiluL2{}, out, ws, o);
    EXPECT_LE(rel(out.template cast<double>(), want), bound<S>()) << "block of a taller matrix";
    // Carried states, multi-head and batched (one sequence of one token).
    std::vector<State<S>> states(static_cast<std::size_t>(H));
    for (Index h = 0; h < H; ++h) {
      states[std::size_t(h)] = State<S>(c.D, c.M);
      states[std::size_t(h)].S = c.S0[std::size_t(h)].cast<S>();
    }
    std::vector<State<S>> copy = states;
    linattn::multihead_delta_rule_attention(Q, K, V, beta.map, log_a.map, H, SiluL2{}, states, out,
                                            ws, o);
    EXPECT_LE(rel(out.template cast<double>(), want_carried), bound<S>()) << "states";
    const std::vector<int> offsets = {0, 1};
    linattn::batched_delta_rule_attention(Q, K, V, tall_beta.middleRows(5, 1),
                                          tall_a.middleRows(5, 1), offsets, H, SiluL2{}, copy, out,
                                          ws, o);
    EXPECT_LE(rel(out.template cast<double>(), want_carried), bound<S>()) << "batched, states";
    for (Index h = 0; h < H; ++h)
      EXPECT_EQ(test::max_abs_diff(states[std::size_t(h)].S, copy[std::size_t(h)].S), 0.0) << h;
    // No decay: an empty log_a of 1 x 0.
    const Mat<S> none(1, 0);
    MatD want_free(1, H * c.M);
    for (Index h = 0; h < H; ++h)
      want_free.middleCols(h * c.M, c.M) =
          dref::recurrence(SiluL2{}, c.Q.middleCols(h * c.D, c.D), c.K.middleCols(h * c.D, c.D),
                           c.V.middleCols(h * c.M, c.M), VecD(c.beta.col(h)), VecD(), o.scale);
    linattn::multihead_delta_rule_attention(Q, K, V, beta.map, none, H, SiluL2{}, out, ws, o);
    EXPECT_LE(rel(out.template cast<double>(), want_free), bound<S>()) << "no decay";
  }
  if (H == 1) {
    // The single-head forms: a 1 x 1 parameter, as a row and as a column.
    State<S> st(c.D, c.M);
    st.S = c.S0[0].cast<S>();
    linattn::Workspace<S> ws;
    Mat<S> out(1, c.M);
    linattn::delta_rule_attention(Q, K, V, beta.map, log_a.map, SiluL2{}, st, out, ws, o);
    EXPECT_LE(rel(out.template cast<double>(), want_carried), bound<S>()) << "single head";
  }
}

template <class S>
void check_delta_backward_one_token(Index H) {
  SCOPED_TRACE("H = " + std::to_string(H));
  const DeltaCase c(H, 1, 200 + std::uint32_t(H));
  const Mat<S> Q = c.Q.cast<S>(), K = c.K.cast<S>(), V = c.V.cast<S>(), W = c.W.cast<S>();
  DeltaOptions o;
  o.scale = 0.5;
  MatD dQ(1, H * c.D), dK(1, H * c.D), dV(1, H * c.M), dbeta(1, H), dlog_a(1, H);
  for (Index h = 0; h < H; ++h) {
    const auto g =
        dref::backward(SiluL2{}, c.Q.middleCols(h * c.D, c.D), c.K.middleCols(h * c.D, c.D),
                       c.V.middleCols(h * c.M, c.M), VecD(c.beta.col(h)), VecD(c.log_a.col(h)),
                       o.scale, c.W.middleCols(h * c.M, c.M));
    dQ.middleCols(h * c.D, c.D) = g.dQ;
    dK.middleCols(h * c.D, c.D) = g.dK;
    dV.middleCols(h * c.M, c.M) = g.dV;
    dbeta(0, h) = g.dbeta(0);
    dlog_a(0, h) = g.dlog_a(0);
  }
  ASSERT_GT(dbeta.cwiseAbs().minCoeff(), 0.0);
  const Exact<S> beta(c.beta), log_a(c.log_a);
  Exact<S> gb(MatD::Zero(1, H)), ga(MatD::Constant(1, H, 7.0));
  Mat<S> gq(1, H * c.D), gk(1, H * c.D), gv(1, H * c.M);
  linattn::MultiHeadWorkspace<S> ws;
  linattn::multihead_delta_rule_attention_backward(Q, K, V, beta.map, log_a.map, W, H, SiluL2{}, gq,
                                                   gk, gv, gb.map, ga.map, ws, o);
  EXPECT_LE(rel(gq.template cast<double>(), dQ), bound<S>());
  EXPECT_LE(rel(gk.template cast<double>(), dK), bound<S>());
  EXPECT_LE(rel(gv.template cast<double>(), dV), bound<S>());
  EXPECT_LE(rel(gb.map.template cast<double>(), dbeta), bound<S>());
  // From a zero state the first token's decay has no gradient: every entry written, as 0.
  EXPECT_LE(test::max_abs_diff(ga.map.template cast<double>(), dlog_a), 0.0);
  // The returning form (column-major gradients of the parameters' shapes).
  const auto g = linattn::multihead_delta_rule_attention_backward(Q, K, V, beta.map, log_a.map, W,
                                                                  H, SiluL2{}, o);
  ASSERT_EQ(g.dbeta.rows(), 1);
  ASSERT_EQ(g.dbeta.cols(), H);
  EXPECT_LE(rel(g.dbeta.template cast<double>(), dbeta), bound<S>());
  if (H == 1) {
    // The single-head form from a carried state, where the decay has a gradient.
    State<S> st(c.D, c.M);
    st.S = c.S0[0].cast<S>();
    const auto r = dref::backward(SiluL2{}, c.Q, c.K, c.V, VecD(c.beta.col(0)),
                                  VecD(c.log_a.col(0)), o.scale, c.W, c.S0[0]);
    const auto s =
        linattn::delta_rule_attention_backward(Q, K, V, beta.map, log_a.map, W, SiluL2{}, st, o);
    EXPECT_LE(rel(s.dbeta.template cast<double>(), r.dbeta), bound<S>());
    EXPECT_LE(rel(s.dlog_a.template cast<double>(), r.dlog_a), bound<S>());
  }
}

TEST(hardening_shapes_one_token, DeltaForwardSeveralHeads) {
  for (Index H : {1, 2, 8}) {
    IF_FLOAT(check_delta_one_token<float>(H));
    IF_DOUBLE(check_delta_one_token<double>(H));
  }
}

TEST(hardening_shapes_one_token, DeltaBackwardSeveralHeads) {
  for (Index H : {1, 2, 8}) {
    IF_FLOAT(check_delta_backward_one_token<float>(H));
    IF_DOUBLE(check_delta_backward_one_token<double>(H));
  }
}

// ---------------------------------------------------------------------------------------------
// One token, several heads: gated attention (its log gates are N x H or N x H·F, read as blocks).
// ---------------------------------------------------------------------------------------------

template <class S>
void check_gated_one_token(Index H, bool per_feature) {
  SCOPED_TRACE("H = " + std::to_string(H) + (per_feature ? ", per-feature" : ", scalar"));
  const Index D = 4, M = 3, F = D, gw = per_feature ? F : 1;
  const std::uint32_t seed = 300 + std::uint32_t(H) + (per_feature ? 50 : 0);
  const MatD Qd = frand(1, H * D, seed), Kd = frand(1, H * D, seed + 1),
             Vd = frand(1, H * M, seed + 2), Gd = frand(1, H * gw, seed + 3, -0.5, -0.01),
             Wd = frand(1, H * M, seed + 4);
  const Mat<S> Q = Qd.cast<S>(), K = Kd.cast<S>(), V = Vd.cast<S>(), W = Wd.cast<S>();
  const Exact<S> G(Gd);
  GatedOptions o;
  o.scale = 0.5;
  gref::Options go;
  go.scale = o.scale;
  MatD want(1, H * M), dG(1, H * gw);
  for (Index h = 0; h < H; ++h) {
    const MatD Qh = Qd.middleCols(h * D, D), Kh = Kd.middleCols(h * D, D),
               Vh = Vd.middleCols(h * M, M), Gh = Gd.middleCols(h * gw, gw),
               Wh = Wd.middleCols(h * M, M);
    want.middleCols(h * M, M) = gref::recurrence(Qh, Kh, Vh, Gh, Identity{}, go);
    dG.middleCols(h * gw, gw) = gref::dlog_gates(Qh, Kh, Vh, Gh, Wh, Identity{}, go);
  }
  for (const Algorithm& alg : kAlgorithms) {
    o.algorithm = alg.algorithm;
    SCOPED_TRACE(alg.name);
    linattn::MultiHeadWorkspace<S> ws;
    Mat<S> out(1, H * M);
    linattn::multihead_gated_linear_attention(Q, K, V, G.map, H, Identity{}, out, ws, o);
    EXPECT_LE(rel(out.template cast<double>(), want), bound<S>());
    std::vector<State<S>> states;
    const std::vector<long> offsets = {0, 1};
    linattn::batched_gated_linear_attention(Q, K, V, G.map, offsets, H, Identity{}, states, out, ws,
                                            o);
    EXPECT_LE(rel(out.template cast<double>(), want), bound<S>()) << "batched";
    Mat<S> gq(1, H * D), gk(1, H * D), gv(1, H * M);
    Exact<S> gg(MatD::Zero(1, H * gw));
    linattn::multihead_gated_linear_attention_backward(Q, K, V, G.map, W, H, Identity{}, gq, gk, gv,
                                                       gg.map, ws, o);
    // dlog_gates against the analytic reference; dQ, dK, dV against each head's own call.
    EXPECT_LE(test::max_abs_diff(gg.map.template cast<double>(), dG),
              bound<S>() * std::max(1.0, dG.cwiseAbs().maxCoeff()));
    for (Index h = 0; h < H; ++h) {
      const Mat<S> Gh = Gd.middleCols(h * gw, gw).cast<S>();
      const auto one = linattn::gated_linear_attention_backward(
          Mat<S>(Q.middleCols(h * D, D)), Mat<S>(K.middleCols(h * D, D)),
          Mat<S>(V.middleCols(h * M, M)), Gh, Mat<S>(W.middleCols(h * M, M)), Identity{}, o);
      EXPECT_LE(test::max_abs_diff(Mat<S>(gq.middleCols(h * D, D)), one.dQ), 0.0) << h;
      EXPECT_LE(test::max_abs_diff(Mat<S>(gk.middleCols(h * D, D)), one.dK), 0.0) << h;
      EXPECT_LE(test::max_abs_diff(Mat<S>(gv.middleCols(h * M, M)), one.dV), 0.0) << h;
    }
  }
}

TEST(hardening_shapes_one_token, GatedSeveralHeads) {
  for (Index H : {1, 2, 8})
    for (bool per_feature : {false, true}) {
      IF_FLOAT(check_gated_one_token<float>(H, per_feature));
      IF_DOUBLE(check_gated_one_token<double>(H, per_feature));
    }
}

// ---------------------------------------------------------------------------------------------
// A varlen batch with a one-token sequence (cu_seqlens = [0, 1, 64, 150, 300]), the parameters
// row-major as the Python bindings pass them; the backward per sequence on row blocks, as they
// call it.
// ---------------------------------------------------------------------------------------------

template <class S>
void check_varlen_batch() {
  const Index H = 8;
  const DeltaCase c(H, 300, 400);
  const std::vector<int> offsets = {0, 1, 64, 150, 300};
  const Mat<S> Q = c.Q.cast<S>(), K = c.K.cast<S>(), V = c.V.cast<S>(), W = c.W.cast<S>();
  const RowMat<S> beta = c.beta.cast<S>(), log_a = c.log_a.cast<S>();
  DeltaOptions o;
  o.scale = 0.5;
  linattn::MultiHeadWorkspace<S> ws;
  Mat<S> out(c.N, H * c.M);
  linattn::batched_delta_rule_attention(Q, K, V, beta, log_a, offsets, H, SiluL2{}, out, ws, o);
  RowMat<S> gb = RowMat<S>::Constant(c.N, H, S(7)), ga = RowMat<S>::Constant(c.N, H, S(7));
  Mat<S> gq(c.N, H * c.D), gk(c.N, H * c.D), gv(c.N, H * c.M);
  for (std::size_t b = 0; b + 1 < offsets.size(); ++b) {
    const Index r0 = offsets[b], n = offsets[b + 1] - r0;
    auto dq = gq.middleRows(r0, n);
    auto dk = gk.middleRows(r0, n);
    auto dv = gv.middleRows(r0, n);
    auto db = gb.middleRows(r0, n);
    auto da = ga.middleRows(r0, n);
    linattn::multihead_delta_rule_attention_backward(
        Q.middleRows(r0, n), K.middleRows(r0, n), V.middleRows(r0, n), beta.middleRows(r0, n),
        log_a.middleRows(r0, n), W.middleRows(r0, n), H, SiluL2{}, dq, dk, dv, db, da, ws, o);
  }
  for (std::size_t b = 0; b + 1 < offsets.size(); ++b) {
    const Index r0 = offsets[b], n = offsets[b + 1] - r0;
    for (Index h = 0; h < H; ++h) {
      SCOPED_TRACE("sequence " + std::to_string(b) + ", head " + std::to_string(h));
      const MatD want = c.reference(h, false, o.scale, r0, n);
      EXPECT_LE(rel(out.block(r0, h * c.M, n, c.M).template cast<double>(), want), bound<S>());
      const auto g =
          dref::backward(SiluL2{}, c.Q.block(r0, h * c.D, n, c.D), c.K.block(r0, h * c.D, n, c.D),
                         c.V.block(r0, h * c.M, n, c.M), VecD(c.beta.block(r0, h, n, 1)),
                         VecD(c.log_a.block(r0, h, n, 1)), o.scale, c.W.block(r0, h * c.M, n, c.M));
      EXPECT_LE(rel(gq.block(r0, h * c.D, n, c.D).template cast<double>(), g.dQ), bound<S>());
      EXPECT_LE(rel(gv.block(r0, h * c.M, n, c.M).template cast<double>(), g.dV), bound<S>());
      EXPECT_LE(rel(gb.block(r0, h, n, 1).template cast<double>(), g.dbeta), bound<S>());
      EXPECT_LE(test::max_abs_diff(ga.block(r0, h, n, 1).template cast<double>(), g.dlog_a),
                bound<S>() * std::max(1.0, g.dlog_a.cwiseAbs().maxCoeff()));
    }
  }
  // The gated kernels on the same batch (scalar gates N x H, row-major).
  GatedOptions go;
  go.scale = 0.5;
  gref::Options ro;
  ro.scale = go.scale;
  linattn::batched_gated_linear_attention(Q, K, V, log_a, offsets, H, Identity{}, out, ws, go);
  for (std::size_t b = 0; b + 1 < offsets.size(); ++b) {
    const Index r0 = offsets[b], n = offsets[b + 1] - r0;
    for (Index h = 0; h < H; ++h) {
      const MatD want = gref::recurrence(
          c.Q.block(r0, h * c.D, n, c.D), c.K.block(r0, h * c.D, n, c.D),
          c.V.block(r0, h * c.M, n, c.M), c.log_a.block(r0, h, n, 1), Identity{}, ro);
      EXPECT_LE(rel(out.block(r0, h * c.M, n, c.M).template cast<double>(), want), bound<S>())
          << "gated, sequence " << b << ", head " << h;
    }
  }
}

TEST(hardening_shapes_one_token, VarlenBatchWithOneTokenSequence) {
  IF_FLOAT(check_varlen_batch<float>());
  IF_DOUBLE(check_varlen_batch<double>());
}

// ---------------------------------------------------------------------------------------------
// Values in messages: the shortest decimal that reads back as the value.
// ---------------------------------------------------------------------------------------------

TEST(hardening_shapes_messages, ValuesRoundTrip) {
  const Eigen::MatrixXf Q = Eigen::MatrixXf::Ones(4, 2), V = Eigen::MatrixXf::Ones(4, 3);
  Eigen::VectorXf beta = Eigen::VectorXf::Constant(4, 0.5f), log_a = Eigen::VectorXf::Zero(4);
  beta(2) = 2.0000002f;  // the float next above 2
  test::expect_invalid([&] { linattn::delta_rule_attention(Q, Q, V, beta, log_a); },
                       Needles{"beta(2) = 2.0000002: beta must be in [0, 2]"}, "beta");
  beta(2) = 1.0f;
  log_a(1) = 1e-30f;
  test::expect_invalid([&] { linattn::delta_rule_attention(Q, Q, V, beta, log_a); },
                       Needles{"log_a(1) = 1e-30:"}, "log_a");
  Eigen::MatrixXf log_gates = Eigen::MatrixXf::Zero(4, 1);
  log_gates(3, 0) = 1e-30f;
  test::expect_invalid([&] { linattn::gated_linear_attention(Q, Q, V, log_gates); },
                       Needles{"log_gates(3, 0) = 1e-30:"}, "log_gates");
  // Several heads; double; values that need every digit; non-finite ones.
  const Eigen::MatrixXd Qd = Eigen::MatrixXd::Ones(3, 4), Vd = Eigen::MatrixXd::Ones(3, 6);
  Eigen::MatrixXd bd = Eigen::MatrixXd::Constant(3, 2, 0.5), ad = Eigen::MatrixXd::Zero(3, 2);
  bd(1, 1) = 2.0000000000000004;
  test::expect_invalid([&] { linattn::multihead_delta_rule_attention(Qd, Qd, Vd, bd, ad, 2); },
                       Needles{"multihead_delta_rule_attention", "beta(1, 1) = 2.0000000000000004"},
                       "double");
  bd(1, 1) = -0.1;
  test::expect_invalid([&] { linattn::multihead_delta_rule_attention(Qd, Qd, Vd, bd, ad, 2); },
                       Needles{"beta(1, 1) = -0.1:"}, "-0.1");
  bd(1, 1) = 0.5;
  ad(2, 0) = std::numeric_limits<double>::quiet_NaN();
  test::expect_invalid([&] { linattn::multihead_delta_rule_attention(Qd, Qd, Vd, bd, ad, 2); },
                       Needles{"log_a(2, 0) = nan"}, "nan");
  ad(2, 0) = -std::numeric_limits<double>::infinity();
  test::expect_invalid([&] { linattn::multihead_delta_rule_attention(Qd, Qd, Vd, bd, ad, 2); },
                       Needles{"log_a(2, 0) = -inf"}, "-inf");
  ad(2, 0) = 0.0;
  ad(0, 1) = 4.9406564584124654e-324;  // the smallest subnormal
  test::expect_invalid([&] { linattn::multihead_delta_rule_attention(Qd, Qd, Vd, bd, ad, 2); },
                       Needles{"log_a(0, 1) = 5e-324:"}, "subnormal");
}

// ---------------------------------------------------------------------------------------------
// Stated head sizes: a GVA-shaped call (Q, K of 2 heads; V, beta, g of 4) is rejected.
// ---------------------------------------------------------------------------------------------

TEST(hardening_shapes_heads, StatedHeadSizesRejectSharedKeyHeads) {
  const Index N = 5, Hk = 2, Hv = 4, D = 8, M = 8;
  const Eigen::MatrixXf Q = frand(N, Hk * D, 500).cast<float>(),
                        K = frand(N, Hk * D, 501).cast<float>(),
                        V = frand(N, Hv * M, 502).cast<float>(),
                        W = frand(N, Hv * M, 503).cast<float>();
  const Eigen::MatrixXf beta = Eigen::MatrixXf::Constant(N, Hv, 0.5f),
                        log_a = Eigen::MatrixXf::Constant(N, Hv, -0.1f);
  DeltaOptions o;
  o.key_dim = D;
  o.value_dim = M;
  GatedOptions go;
  go.key_dim = D;
  go.value_dim = M;
  const Needles gva = {"Q and K hold 2 head(s) of key_dim = 8",
                       "give H = 4",
                       "GVA",
                       "Q is 5x16",
                       "V is 5x32",
                       "heads = 4"};
  linattn::MultiHeadWorkspace<float> ws;
  Eigen::MatrixXf out(N, Hv * M);
  test::expect_invalid(
      [&] {
        linattn::multihead_delta_rule_attention(Q, K, V, beta, log_a, Hv, SiluL2{}, out, ws, o);
      },
      [&] {
        Needles n = gva;
        n.push_back("multihead_delta_rule_attention");
        return n;
      }(),
      "multihead delta");
  const std::vector<int> offsets = {0, 2, N};
  test::expect_invalid(
      [&] {
        linattn::batched_delta_rule_attention(Q, K, V, beta, log_a, offsets, Hv, SiluL2{}, out, ws,
                                              o);
      },
      gva, "batched delta");
  test::expect_invalid(
      [&] {
        linattn::multihead_delta_rule_attention_backward(Q, K, V, beta, log_a, W, Hv, SiluL2{}, o);
      },
      gva, "delta backward");
  test::expect_invalid(
      [&] {
        linattn::multihead_gated_linear_attention(Q, K, V, log_a, Hv, Identity{}, out, ws, go);
      },
      gva, "multihead gated");
  test::expect_invalid(
      [&] {
        linattn::batched_gated_linear_attention(Q, K, V, log_a, offsets, Hv, Identity{}, out, ws,
                                                go);
      },
      gva, "batched gated");
  test::expect_invalid(
      [&] {
        linattn::multihead_gated_linear_attention_backward(Q, K, V, log_a, W, Hv, Identity{}, go);
      },
      gva, "gated backward");
  // A value size that does not divide: named as such.
  o.value_dim = 5;
  o.key_dim = 4;
  test::expect_invalid(
      [&] {
        linattn::multihead_delta_rule_attention(Q, K, V, beta, log_a, Hv, SiluL2{}, out, ws, o);
      },
      Needles{"V holds 32 columns, not heads x value_dim = 20"}, "value_dim");
  // Stated sizes that fit: the same bits as unstated (four heads of D = 4, M = 8; and D != M).
  o.key_dim = 4;
  o.value_dim = 8;
  Eigen::MatrixXf stated(N, Hv * M);
  linattn::multihead_delta_rule_attention(Q, K, V, beta, log_a, Hv, SiluL2{}, stated, ws, o);
  const Eigen::MatrixXf plain =
      linattn::multihead_delta_rule_attention(Q, K, V, beta, log_a, Hv, SiluL2{});
  EXPECT_EQ(test::max_abs_diff(stated, plain), 0.0);
  go.key_dim = 4;
  go.value_dim = 8;
  linattn::multihead_gated_linear_attention(Q, K, V, log_a, Hv, Identity{}, stated, ws, go);
  EXPECT_EQ(
      test::max_abs_diff(stated, linattn::multihead_gated_linear_attention(Q, K, V, log_a, Hv)),
      0.0);
  // One head: the sizes are Q's and V's columns.
  DeltaOptions one;
  one.key_dim = 8;
  const Eigen::VectorXf b1 = Eigen::VectorXf::Constant(N, 0.5f), none;
  test::expect_invalid(
      [&] { linattn::delta_rule_attention(Q, K, V, b1, none, Identity{}, one); },
      Needles{"delta_rule_attention", "Q and K hold 2 head(s) of key_dim = 8", "give H = 1"},
      "single head");
  one.key_dim = -1;
  test::expect_invalid([&] { linattn::delta_rule_attention(Q, K, V, b1, none, Identity{}, one); },
                       Needles{"key_dim and value_dim must be >= 0"}, "negative");
}

// ---------------------------------------------------------------------------------------------
// Operands that share memory with a carried state: rejected before anything is written.
// ---------------------------------------------------------------------------------------------

TEST(hardening_shapes_aliasing, OperandsOverTheCarriedState) {
  // N = F = 4 rows (Identity: F = D), M = 3: an N x M output fits over S (F x M, row-major).
  const Index N = 4, D = 4, M = 3;
  const Eigen::MatrixXf Q = frand(N, D, 600).cast<float>(), K = frand(N, D, 601).cast<float>(),
                        V = frand(N, M, 602).cast<float>();
  const Eigen::VectorXf beta = Eigen::VectorXf::Constant(N, 0.5f),
                        log_a = Eigen::VectorXf::Constant(N, -0.1f);
  const auto fresh = [&] {
    State<float> st(D, M);
    st.S = frand(D, M, 603).cast<float>();
    return st;
  };
  const auto unchanged = [](const State<float>& st, const State<float>& before) {
    return test::max_abs_diff(st.S, before.S) == 0.0 && st.S_lo.size() == before.S_lo.size() &&
           test::max_abs_diff(st.S_lo, before.S_lo) == 0.0;
  };
  const Needles over_s = {"out overlaps the memory of state.S", "out is 4x3", "S is 4x3"};
  {
    State<float> st = fresh();
    const State<float> before = st;
    RowMap<float> out(st.S.data(), N, M);
    linattn::Workspace<float> ws;
    test::expect_invalid(
        [&] { linattn::delta_rule_attention(Q, K, V, beta, log_a, Identity{}, st, out, ws); },
        [&] {
          Needles n = over_s;
          n.push_back("delta_rule_attention");
          return n;
        }(),
        "delta");
    EXPECT_TRUE(unchanged(st, before));
    test::expect_invalid(
        [&] { linattn::gated_linear_attention(Q, K, V, log_a, Identity{}, st, out, ws); }, over_s,
        "gated");
    EXPECT_TRUE(unchanged(st, before));
    test::expect_invalid(
        [&] { linattn::causal_linear_attention(Q, K, V, linattn::EluPlusOne{}, st, out, ws); },
        over_s, "causal");
    EXPECT_TRUE(unchanged(st, before));
    // An input over the state (the state is written while Q is read).
    Eigen::Map<Eigen::MatrixXf> q_over(st.S_lo.data(), N, M);
    Eigen::MatrixXf out2(N, M);
    const Eigen::MatrixXf K3 = frand(N, M, 604).cast<float>();
    test::expect_invalid(
        [&] {
          linattn::delta_rule_attention(q_over, K3, V, beta, log_a, Identity{}, st, out2, ws);
        },
        Needles{"Q overlaps the memory of state.S_lo"}, "Q over S_lo");
    EXPECT_TRUE(unchanged(st, before));
  }
  {
    // The vector-of-states forms (multi-head, batched; one head here, so that out fits).
    std::vector<State<float>> states = {fresh()};
    const State<float> before = states[0];
    RowMap<float> out(states[0].S.data(), N, M);
    linattn::MultiHeadWorkspace<float> ws;
    const Needles over = {"out overlaps the memory of states[0].S"};
    test::expect_invalid(
        [&] {
          linattn::multihead_delta_rule_attention(Q, K, V, beta, log_a, 1, Identity{}, states, out,
                                                  ws);
        },
        over, "multihead delta");
    test::expect_invalid(
        [&] {
          linattn::multihead_gated_linear_attention(Q, K, V, log_a, 1, Identity{}, states, out, ws);
        },
        over, "multihead gated");
    const std::vector<int> offsets = {0, N};
    test::expect_invalid(
        [&] {
          linattn::batched_causal_linear_attention(Q, K, V, offsets, 1, linattn::EluPlusOne{},
                                                   states, out, ws);
        },
        over, "batched causal");
    EXPECT_TRUE(unchanged(states[0], before));
  }
  {
    // Gradients over the initial state the backward reads.
    const State<float> initial = fresh();
    RowMap<float> dV(const_cast<float*>(initial.S.data()), N, M);
    Eigen::MatrixXf dQ(N, D), dK(N, D);
    Eigen::VectorXf dbeta(N), dlog_a(N);
    const Eigen::MatrixXf dOut = frand(N, M, 605).cast<float>();
    linattn::StateGradient<float> none, d_initial;
    linattn::Workspace<float> ws;
    const Needles over = {"dV overlaps the memory of initial.S"};
    test::expect_invalid(
        [&] {
          linattn::delta_rule_attention_backward(Q, K, V, beta, log_a, dOut, Identity{}, initial,
                                                 none, dQ, dK, dV, dbeta, dlog_a, d_initial, ws);
        },
        over, "delta backward");
    test::expect_invalid(
        [&] {
          linattn::gated_linear_attention_backward(Q, K, V, log_a, dOut, Identity{}, initial, none,
                                                   dQ, dK, dV, dlog_a, d_initial, ws);
        },
        over, "gated backward");
    test::expect_invalid(
        [&] {
          linattn::causal_linear_attention_backward(Q, K, V, dOut, linattn::EluPlusOne{}, initial,
                                                    none, dQ, dK, dV, d_initial, ws);
        },
        over, "causal backward");
  }
  {
    // Separate buffers still pass, and a state whose arrays lie between the operands' buffers
    // is not taken for an overlap.
    State<float> st = fresh();
    Eigen::MatrixXf out(N, M);
    linattn::Workspace<float> ws;
    linattn::delta_rule_attention(Q, K, V, beta, log_a, Identity{}, st, out, ws);
    EXPECT_TRUE(out.allFinite());
  }
}

}  // namespace
