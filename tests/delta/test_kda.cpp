// KDA (Kimi Delta Attention): the delta rule with one log-decay per key channel, log_a of
// N x H·F, against a long-double per-token recurrence written here from the spec
// (S' = diag(e^{g_t}) S_{t-1}, S_t = S' + β_t k̂_t (v_t − S'ᵀ k̂_t)ᵀ, out_t = s S_tᵀ q̂_t): one
// head and several, shared key heads, packed batches with carried states, both storage orders,
// strong decays, resets and g = 0, the recurrent and the chunked forms (chunk sizes that do and
// do not divide N); equal channels against the scalar-decay kernel; the chunked form's
// causality; the shape and value errors; the gradients against central differences.
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <linattn/linattn.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "gated_reference.hpp"
#include "gradient_util.hpp"
#include "test_util.hpp"

namespace {

using linattn::DeltaOptions;
using L2 = linattn::L2Normalize<linattn::Identity>;
using test::Index;
using test::Mat;
using test::MatD;
using test::RowMat;
using LD = long double;
using LMat = Eigen::Matrix<long double, Eigen::Dynamic, Eigen::Dynamic>;
using LVec = Eigen::Matrix<long double, Eigen::Dynamic, 1>;
template <class S>
using State = linattn::LinearAttentionState<S>;
using Needles = std::vector<std::string>;

MatD frand(Index rows, Index cols, std::uint32_t seed, double lo = -1.0, double hi = 1.0) {
  return test::random_matrix<float>(rows, cols, seed, lo, hi).cast<double>();
}

// The per-token recurrence in long double on mapped rows (N x F), G: N x F log-decays; S: the
// initial state (empty: zero), receives the final one.
MatD kda_recurrence(const MatD& PQ, const MatD& PK, const MatD& V, const MatD& beta, const MatD& G,
                    double scale, MatD* S) {
  const Index N = PQ.rows(), F = PQ.cols(), M = V.cols();
  LMat St = (S && S->size()) ? LMat(S->cast<LD>()) : LMat(LMat::Zero(F, M));
  MatD out(N, M);
  for (Index t = 0; t < N; ++t) {
    for (Index r = 0; r < F; ++r) St.row(r) *= std::exp(static_cast<LD>(G(t, r)));
    const LVec k = PK.row(t).transpose().cast<LD>(), q = PQ.row(t).transpose().cast<LD>();
    const LVec v = V.row(t).transpose().cast<LD>();
    const LVec delta = static_cast<LD>(beta(t, 0)) * (v - St.transpose() * k);
    St += k * delta.transpose();
    const LVec o = static_cast<LD>(scale) * (St.transpose() * q);
    for (Index c = 0; c < M; ++c) out(t, c) = static_cast<double>(o(c));
  }
  if (S) *S = St.cast<double>();
  return out;
}

struct Shape {
  Index Hk, G, D, M;
  std::vector<int> offsets;
  Index H() const { return Hk * G; }
  Index N() const { return offsets.back(); }
  std::string name() const {
    std::string s = "Hk = " + std::to_string(Hk) + ", G = " + std::to_string(G) +
                    ", D = " + std::to_string(D) + ", M = " + std::to_string(M) + ", offsets =";
    for (int o : offsets) s += " " + std::to_string(o);
    return s;
  }
};

const Shape kShapes[] = {{1, 1, 4, 3, {0, 1}},          // one head, one token
                         {1, 1, 6, 5, {0, 70}},         // past a row block of the recurrence
                         {3, 1, 5, 4, {0, 37}},         // several heads, D != M
                         {2, 2, 4, 6, {0, 1, 23, 40}},  // shared key heads, varlen
                         {1, 1, 16, 9, {0, 100}}};      // wider keys: several sub-chunks

// Log-decays per channel (with zeros: g = 0 on every fifth channel). Strong: mild decays with a
// strong channel (-20) and a reset (-1e4) at a few tokens (the chunked form's direct pairs). Mixed:
// chunks too strong to factor whole, most sub-chunks mild. Mild: every chunk of up to 64 rows
// factored about its start.
enum class Decays { Strong, Mixed, Mild };
MatD channel_decays(Index N, Index cols, std::uint32_t seed, Decays kind = Decays::Strong,
                    bool zeros = false) {
  MatD g = frand(N, cols, seed,
                 kind == Decays::Strong  ? -0.7
                 : kind == Decays::Mixed ? -0.3
                                         : -0.1,
                 kind == Decays::Strong ? -0.001 : 0.0);
  if (kind == Decays::Strong) {
    for (Index t = 0; t < N; t += 7) g(t, (t / 7) % cols) = -20.0;
    for (Index t = 5; t < N; t += 11) g(t, (t * 3) % cols) = -1e4;
  } else if (kind == Decays::Mixed) {
    for (Index t = 9; t < N; t += 40) g(t, (t / 40) % cols) = -20.0;
    for (Index t = 30; t < N; t += 50) g(t, (t * 3) % cols) = -1e4;
  }
  if (zeros)
    for (Index c = 1; c < cols; c += 5) g.col(c).setZero();
  return g;
}

// max over rows of |a_i − b_i|∞ / |b_i|∞: the error relative to each row's magnitude.
double row_error(const MatD& a, const MatD& b) {
  double e = 0;
  for (Index i = 0; i < b.rows(); ++i) {
    const double m = b.row(i).cwiseAbs().maxCoeff();
    e = std::max(e, (a.row(i) - b.row(i)).cwiseAbs().maxCoeff() / std::max(m, 1e-300));
  }
  return e;
}

// Returns the largest row error of the outputs against the reference.
template <class S, class QL>
double check_kda(const Shape& sh, linattn::CausalAlgorithm algorithm, Index chunk, Decays decays) {
  SCOPED_TRACE(sh.name() + ", chunk " + std::to_string(chunk) + ", decays " +
               std::to_string(int(decays)) + ", algorithm " + std::to_string(int(algorithm)));
  const Index N = sh.N(), H = sh.H(), D = sh.D, M = sh.M, F = D;
  const std::uint32_t seed = 700 + std::uint32_t(N + 13 * H);
  const MatD Qd = frand(N, sh.Hk * D, seed), Kd = frand(N, sh.Hk * D, seed + 1),
             Vd = frand(N, H * M, seed + 2), Bd = frand(N, H, seed + 3, 0.05, 1.95),
             Gd = channel_decays(N, H * F, seed + 4, decays, true);
  const Index B = Index(sh.offsets.size()) - 1;
  std::vector<MatD> S0;
  for (Index i = 0; i < B * H; ++i) S0.push_back(frand(F, M, seed + 10 + std::uint32_t(i)));
  DeltaOptions o;
  o.scale = 0.7;
  o.algorithm = algorithm;
  o.key_heads = sh.Hk;
  o.chunk_size = chunk;
  const QL Q = Qd.cast<S>(), K = Kd.cast<S>();
  const Mat<S> V = Vd.cast<S>(), beta = Bd.cast<S>(), log_a = Gd.cast<S>();
  std::vector<State<S>> states(S0.size());
  for (std::size_t i = 0; i < S0.size(); ++i) {
    states[i].S = S0[i].cast<S>();
    states[i].z = linattn::Vector<S>::Zero(F);  // the delta rule leaves z as it is
  }
  linattn::MultiHeadWorkspace<S> ws;
  Mat<S> out(N, H * M);
  linattn::batched_delta_rule_attention(Q, K, V, beta, log_a, sh.offsets, H, L2{}, states, out, ws,
                                        o);
  MatD want(N, H * M);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      const Index r0 = sh.offsets[std::size_t(b)], n = sh.offsets[std::size_t(b) + 1] - r0;
      const Index c = (h / sh.G) * D;
      MatD Sref = S0[std::size_t(b * H + h)];
      want.block(r0, h * M, n, M) =
          kda_recurrence(gref::features(L2{}, Qd.block(r0, c, n, D)),
                         gref::features(L2{}, Kd.block(r0, c, n, D)), Vd.block(r0, h * M, n, M),
                         Bd.block(r0, h, n, 1), Gd.block(r0, h * F, n, F), o.scale, &Sref);
      EXPECT_LE(
          test::relative_error(states[std::size_t(b * H + h)].S.template cast<double>(), Sref),
          test::bound<S>(5e-6, 1e-13))
          << "state of sequence " << b << ", head " << h;
    }
  EXPECT_LE(test::relative_error(out.template cast<double>(), want), test::bound<S>(5e-6, 1e-13));
  double err = row_error(out.template cast<double>(), want);
  EXPECT_LE(err, test::bound<S>(1e-5, 1e-12));
  // One sequence and one head: the single-head form, and equal channels = the scalar decay.
  if (B == 1 && H == 1) {
    State<S> st;
    st.S = S0[0].cast<S>();
    st.z = linattn::Vector<S>::Zero(F);
    const Mat<S> single = linattn::delta_rule_attention(Q, K, V, beta, log_a, L2{}, st, o);
    err = std::max(err, row_error(single.template cast<double>(), want.middleCols(0, M)));
    EXPECT_LE(err, test::bound<S>(1e-5, 1e-12));
    const Mat<S> scalar = Gd.col(0).cast<S>();
    const Mat<S> equal = scalar.replicate(1, F);
    const Mat<S> by_scalar = linattn::delta_rule_attention(Q, K, V, beta, scalar, L2{}, o);
    const Mat<S> by_channels = linattn::delta_rule_attention(Q, K, V, beta, equal, L2{}, o);
    EXPECT_LE(test::relative_error(by_channels.template cast<double>(),
                                   by_scalar.template cast<double>()),
              test::bound<S>(2e-6, 1e-14));
  }
  return err;
}

// Auto (the recurrent form) and the chunked form at chunk sizes that do and do not divide N,
// and of more rows than N, on the three kinds of decays.
template <class S>
void check_all() {
  using linattn::CausalAlgorithm;
  const std::pair<CausalAlgorithm, Index> runs[] = {{CausalAlgorithm::Auto, 0},
                                                    {CausalAlgorithm::Chunked, 0},
                                                    {CausalAlgorithm::Chunked, 7},
                                                    {CausalAlgorithm::Chunked, 64}};
  double worst[2] = {0, 0};  // Auto, Chunked
  for (const Shape& sh : kShapes)
    for (const Decays decays : {Decays::Strong, Decays::Mixed, Decays::Mild})
      for (const auto& [algorithm, chunk] : runs) {
        double& w = worst[algorithm == CausalAlgorithm::Chunked];
        w = std::max(w, check_kda<S, Mat<S>>(sh, algorithm, chunk, decays));
        w = std::max(w, check_kda<S, RowMat<S>>(sh, algorithm, chunk, decays));
      }
  const std::string type = sizeof(S) == sizeof(float) ? "float" : "double";
  test::report_error("KDA recurrent vs long double, row-relative, " + type, worst[0]);
  test::report_error("KDA chunked vs long double, row-relative, " + type, worst[1]);
}

TEST(kda, AgainstTheLongDoubleRecurrence) {
  IF_FLOAT(check_all<float>());
  IF_DOUBLE(check_all<double>());
}

TEST(kda, ShapesAndValues) {
  const Index N = 4, H = 2, D = 3, M = 2;
  const Eigen::MatrixXf Q = frand(N, H * D, 1).cast<float>(), V = frand(N, H * M, 2).cast<float>();
  const Eigen::MatrixXf beta = Eigen::MatrixXf::Constant(N, H, 0.5f);
  Eigen::MatrixXf log_a = Eigen::MatrixXf::Constant(N, H * D, -0.1f);
  log_a(2, 4) = 0.5f;
  test::expect_invalid(
      [&] { linattn::multihead_delta_rule_attention(Q, Q, V, beta, log_a, H, L2{}); },
      Needles{"multihead_delta_rule_attention", "log_a(2, 4) = 0.5", "finite and <= 0"},
      "positive");
  log_a(2, 4) = std::numeric_limits<float>::quiet_NaN();
  test::expect_invalid(
      [&] { linattn::multihead_delta_rule_attention(Q, Q, V, beta, log_a, H, L2{}); },
      Needles{"log_a(2, 4) = nan"}, "NaN");
  const Eigen::MatrixXf wide = Eigen::MatrixXf::Constant(N, H * D + 1, -0.1f);
  test::expect_invalid(
      [&] { linattn::multihead_delta_rule_attention(Q, Q, V, beta, wide, H, L2{}); },
      Needles{"log_a is 4x7", "4x6 (one per key channel, F = 3)"}, "width");
}

// Gradients of L = Σ out ∘ W + ⟨dS_final, S_N⟩ through one head from a carried state, chunks
// of 4 rows over N = 9 (a partial chunk), a strong channel and a reset among the decays:
// every input and the initial state against central differences; float against double.
TEST(kda, GradientsAgainstCentralDifferences) {
  const Index N = 9, D = 3, M = 2, F = D;
  MatD Q = frand(N, D, 41), K = frand(N, D, 42), V = frand(N, M, 43), W = frand(N, M, 44);
  MatD beta = frand(N, 1, 45, 0.1, 1.9), log_a = channel_decays(N, F, 46);
  MatD S0 = frand(F, M, 47);
  const MatD dSN = frand(F, M, 48);
  DeltaOptions o;
  o.scale = 0.8;
  o.chunk_size = 4;
  const auto loss = [&] {
    State<double> st;
    st.S = S0;
    st.z = Eigen::VectorXd::Zero(F);
    const MatD out = linattn::delta_rule_attention(Q, K, V, beta, log_a, L2{}, st, o);
    return out.cwiseProduct(W).sum() + st.S.cwiseProduct(dSN).sum();
  };
  State<double> initial;
  initial.S = S0;
  initial.z = Eigen::VectorXd::Zero(F);
  linattn::StateGradient<double> d_final, d_initial;
  d_final.dS = dSN;
  MatD dQ(N, D), dK(N, D), dV(N, M), dbeta(N, 1), dlog_a(N, F);
  linattn::Workspace<double> ws;
  linattn::delta_rule_attention_backward(Q, K, V, beta, log_a, W, L2{}, initial, d_final, dQ, dK,
                                         dV, dbeta, dlog_a, d_initial, ws, o);
  const double tol = 1e-7;
  EXPECT_LE(test::relative_error(dQ, test::central_differences(loss, Q)), tol) << "dQ";
  EXPECT_LE(test::relative_error(dK, test::central_differences(loss, K)), tol) << "dK";
  EXPECT_LE(test::relative_error(dV, test::central_differences(loss, V)), tol) << "dV";
  EXPECT_LE(test::relative_error(dbeta, test::central_differences(loss, beta)), tol) << "dbeta";
  EXPECT_LE(test::relative_error(dlog_a, test::central_differences(loss, log_a)), tol) << "dlog_a";
  EXPECT_LE(test::relative_error(d_initial.dS, test::central_differences(loss, S0)), tol)
      << "d initial state";
  // Float: the same gradients to float rounding.
  State<float> initial_f;
  initial_f.S = S0.cast<float>();
  initial_f.z = Eigen::VectorXf::Zero(F);
  linattn::StateGradient<float> d_final_f, d_initial_f;
  d_final_f.dS = dSN.cast<float>();
  Eigen::MatrixXf fQ(N, D), fK(N, D), fV(N, M), fb(N, 1), fa(N, F);
  linattn::Workspace<float> wsf;
  linattn::delta_rule_attention_backward(
      Eigen::MatrixXf(Q.cast<float>()), Eigen::MatrixXf(K.cast<float>()),
      Eigen::MatrixXf(V.cast<float>()), Eigen::MatrixXf(beta.cast<float>()),
      Eigen::MatrixXf(log_a.cast<float>()), Eigen::MatrixXf(W.cast<float>()), L2{}, initial_f,
      d_final_f, fQ, fK, fV, fb, fa, d_initial_f, wsf, o);
  EXPECT_LE(test::relative_error(fQ.cast<double>(), dQ), 2e-5);
  EXPECT_LE(test::relative_error(fK.cast<double>(), dK), 2e-5);
  EXPECT_LE(test::relative_error(fa.cast<double>(), dlog_a), 2e-5);
  EXPECT_LE(test::relative_error(d_initial_f.dS.cast<double>(), d_initial.dS), 2e-5);
}

// The multi-head backward with shared key heads (2 value heads on one key head) and
// per-channel decays, against central differences of the multi-head forward; Chunked requested
// (the forward of the loss runs the chunked form, the backward its checkpointed recurrence).
TEST(kda, MultiHeadSharedKeyGradients) {
  const Index N = 7, Hk = 1, G = 2, H = Hk * G, D = 3, M = 2, F = D;
  MatD Q = frand(N, Hk * D, 51), K = frand(N, Hk * D, 52), V = frand(N, H * M, 53);
  MatD beta = frand(N, H, 54, 0.1, 1.9), log_a = channel_decays(N, H * F, 55);
  const MatD W = frand(N, H * M, 56);
  DeltaOptions o;
  o.scale = 0.6;
  o.key_heads = Hk;
  o.algorithm = linattn::CausalAlgorithm::Chunked;
  const auto loss = [&] {
    return linattn::multihead_delta_rule_attention(Q, K, V, beta, log_a, H, L2{}, o)
        .cwiseProduct(W)
        .sum();
  };
  const auto g =
      linattn::multihead_delta_rule_attention_backward(Q, K, V, beta, log_a, W, H, L2{}, o);
  const double tol = 1e-7;
  EXPECT_LE(test::relative_error(g.dQ, test::central_differences(loss, Q)), tol) << "dQ";
  EXPECT_LE(test::relative_error(g.dK, test::central_differences(loss, K)), tol) << "dK";
  EXPECT_LE(test::relative_error(g.dV, test::central_differences(loss, V)), tol) << "dV";
  EXPECT_LE(test::relative_error(g.dbeta, test::central_differences(loss, beta)), tol) << "dbeta";
  EXPECT_LE(test::relative_error(g.dlog_a, test::central_differences(loss, log_a)), tol)
      << "dlog_a";
}

// The chunked form's causality: a NaN or ±inf in a query, key or value at row r leaves every
// row before it bit for bit as on clean inputs (first, last and an inner row of a chunk, both
// kinds of intra-chunk products; log-decays in either storage order). Raw keys (β‖k̂‖² = 100)
// overflow at the recurrence's own row.
TEST(kda, ChunkedCausality) {
  using S = float;
  const Index N = 3 * 16 + 5, D = 8, M = 6, C = 16;
  const Mat<S> Q = frand(N, D, 71).cast<S>(), K = frand(N, D, 72).cast<S>(),
               V = frand(N, M, 73).cast<S>(), beta = frand(N, 1, 74, 0.1, 1.0).cast<S>();
  DeltaOptions o;
  o.algorithm = linattn::CausalAlgorithm::Chunked;
  o.chunk_size = C;
  const S nan = std::numeric_limits<S>::quiet_NaN(), inf = std::numeric_limits<S>::infinity();
  for (const Decays decays : {Decays::Strong, Decays::Mild}) {
    const Mat<S> g = channel_decays(N, D, 75, decays, true).cast<S>();
    const Mat<S> clean = linattn::delta_rule_attention(Q, K, V, beta, g, L2{}, o);
    ASSERT_TRUE(test::all_finite(clean));
    // Row-major log-decays: the same bits.
    const RowMat<S> g_rows = g;
    EXPECT_TRUE(test::same_bits(
        clean, Mat<S>(linattn::delta_rule_attention(Q, K, V, beta, g_rows, L2{}, o))));
    // chunk_size is honoured: chunks of 7 rows round differently from chunks of 16.
    DeltaOptions o7 = o;
    o7.chunk_size = 7;
    const Mat<S> by7 = linattn::delta_rule_attention(Q, K, V, beta, g, L2{}, o7);
    EXPECT_FALSE(test::same_bits(clean, by7));
    EXPECT_LE(test::max_abs_diff(clean, by7), 1e-5);
    for (const Index r : {C, C + C / 2 + 1, 2 * C - 1, Index(40)})
      for (const S bad : {nan, inf, -inf})
        for (const char which : {'q', 'k', 'v'}) {
          Mat<S> q = Q, k = K, v = V;
          (which == 'q' ? q : which == 'k' ? k : v)(r, 3) = bad;
          const Mat<S> out = linattn::delta_rule_attention(q, k, v, beta, g, L2{}, o);
          EXPECT_TRUE(test::same_bits(clean.topRows(r), out.topRows(r)))
              << which << "(" << r << ", 3) = " << bad << ", decays " << int(decays);
        }
  }
  const Index n = 128;
  Mat<S> Kr = frand(n, D, 76).cast<S>();
  Kr.rowwise().normalize();
  Kr *= S(10);
  const Mat<S> Qr = frand(n, D, 77).cast<S>(), Vr = frand(n, M, 78).cast<S>();
  const Mat<S> br = Mat<S>::Ones(n, 1), gr = channel_decays(n, D, 79, Decays::Mild).cast<S>();
  DeltaOptions rec = o;
  rec.algorithm = linattn::CausalAlgorithm::Recurrent;
  const auto first_bad = [](const Mat<S>& x) {
    Index i = 0;
    while (i < x.rows() && x.row(i).allFinite()) ++i;
    return i;
  };
  const Mat<S> r = linattn::delta_rule_attention(Qr, Kr, Vr, br, gr, linattn::Identity{}, rec);
  const Mat<S> c = linattn::delta_rule_attention(Qr, Kr, Vr, br, gr, linattn::Identity{}, o);
  const Index fr = first_bad(r), fc = first_bad(c);
  ASSERT_LT(fr, n) << "the recurrence was expected to overflow";
  EXPECT_GE(fc, fr - 1);
  EXPECT_LE(fc, fr + 1);
}

// The decode step with per-channel decays: token by token equal to the parallel kernel and to
// the reference; scalar and per-channel steps mixed (a scalar step is the per-channel one with
// equal channels); state() between steps; the step's errors leave the decoder unchanged.
template <class S>
void check_decode() {
  const Index N = 23, D = 4, M = 3, F = D;
  const MatD Qd = frand(N, D, 61), Kd = frand(N, D, 62), Vd = frand(N, M, 63),
             Bd = frand(N, 1, 64, 0.1, 1.9);
  MatD Gd = channel_decays(N, F, 65);
  for (Index t = 3; t < N; t += 4) Gd.row(t).setConstant(Gd(t, 0));  // scalar steps below
  DeltaOptions o;
  o.scale = 0.9;
  linattn::RecurrentDeltaRule<L2, S> rnn(D, M, o);
  linattn::Vector<S> out(M);
  Mat<S> steps(N, M);
  for (Index t = 0; t < N; ++t) {
    const linattn::Vector<S> g = Gd.row(t).transpose().cast<S>();
    if (t % 4 == 3)
      rnn.step(Qd.row(t).cast<S>(), Kd.row(t).cast<S>(), Vd.row(t).cast<S>(), S(Bd(t, 0)), g(0),
               out);
    else
      rnn.step(Qd.row(t).cast<S>(), Kd.row(t).cast<S>(), Vd.row(t).cast<S>(), S(Bd(t, 0)), g, out);
    steps.row(t) = out.transpose();
  }
  MatD Sref;
  const MatD want = kda_recurrence(gref::features(L2{}, Qd), gref::features(L2{}, Kd), Vd, Bd, Gd,
                                   o.scale, &Sref);
  EXPECT_LE(test::relative_error(steps.template cast<double>(), want), test::bound<S>(5e-6, 1e-13));
  EXPECT_LE(test::relative_error(rnn.state().S.template cast<double>(), Sref),
            test::bound<S>(5e-6, 1e-13));
  const Mat<S> parallel = linattn::delta_rule_attention(Mat<S>(Qd.cast<S>()), Mat<S>(Kd.cast<S>()),
                                                        Mat<S>(Vd.cast<S>()), Mat<S>(Bd.cast<S>()),
                                                        Mat<S>(Gd.cast<S>()), L2{}, o);
  EXPECT_LE(test::relative_error(steps.template cast<double>(), parallel.template cast<double>()),
            test::bound<S>(2e-6, 1e-14));
  // Errors: a wrong size, a positive entry; the decoder is unchanged.
  const auto before = rnn.state();
  const linattn::Vector<S> q = Qd.row(0).transpose().cast<S>(), v = Vd.row(0).transpose().cast<S>();
  linattn::Vector<S> g = linattn::Vector<S>::Constant(F, S(-0.1));
  g(2) = S(0.25);
  test::expect_invalid([&] { rnn.step(q, q, v, S(0.5), g, out); },
                       Needles{"RecurrentDeltaRule::step", "log_a(2) = 0.25", "token 23"}, "value");
  test::expect_invalid(
      [&] { rnn.step(q, q, v, S(0.5), linattn::Vector<S>::Constant(F + 1, S(-0.1)), out); },
      Needles{"log_a is 5x1", "4 entries"}, "size");
  EXPECT_EQ(rnn.position(), N);
  EXPECT_EQ(test::max_abs_diff(rnn.state().S, before.S), 0.0);
  // Parked with a per-channel update pending and resumed: the same bits as continuing.
  std::stringstream file;
  linattn::save_state(file, rnn);
  linattn::RecurrentDeltaRule<L2, S> resumed(D, M, o);
  linattn::load_state(file, resumed);
  EXPECT_EQ(resumed.position(), N);
  g(2) = S(-3);
  linattn::Vector<S> out2(M);
  rnn.step(q, q, v, S(0.5), g, out);
  resumed.step(q, q, v, S(0.5), g, out2);
  EXPECT_EQ(test::max_abs_diff(out, out2), 0.0);
  EXPECT_EQ(test::max_abs_diff(rnn.state().S, resumed.state().S), 0.0);
}

TEST(kda, DecodeStep) {
  IF_FLOAT(check_decode<float>());
  IF_DOUBLE(check_decode<double>());
}

}  // namespace
