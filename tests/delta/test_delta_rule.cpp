// The delta rule, forward (spec §9.3): delta_rule_attention() against the long-double
// recurrence of delta_reference.hpp for Identity (raw keys), L2Normalize<Silu> and
// L2Normalize<Identity> (unit keys), with and without decay, every algorithm and several chunk
// sizes, float and double; chunked against recurrent; β = 0 (the decayed past only); β = 1 with
// orthonormal keys (exact replacement: associative recall); carried state (pieces == one shot);
// RecurrentDeltaRule step by step (no allocation per step); the multi-head and batched forms
// against per-head single calls; layouts (row-major, Maps, blocks); argument errors; the empty
// sequence; large inputs.
//
// Every kernel call goes through a few helpers over Eigen::MatrixXf / MatrixXd (test::Mat<S>) so
// that each kernel is instantiated once per map and scalar type. Inputs are drawn in double and
// rounded to float, so float and double runs and the reference see exactly the same numbers.
//
// Compiled with EIGEN_RUNTIME_NO_MALLOC (tests/CMakeLists.txt): the decode step is checked not to
// allocate.
#include "eigen_assert_hook.hpp"  // first: before any Eigen header
#include "allocation_count.hpp"

#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "delta_reference.hpp"
#include "test_util.hpp"

namespace {

using linattn::CausalAlgorithm;
using linattn::DeltaOptions;
using linattn::Identity;
using linattn::Silu;
using SiluL2 = linattn::L2Normalize<linattn::Silu>;
using UnitL2 = linattn::L2Normalize<linattn::Identity>;
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
// Measured errors and the bounds set from them (GCC, x86-64, -O1; relative to the largest
// magnitude of the reference output). The test log prints every measured figure ([ max err ]).
// ---------------------------------------------------------------------------------------------
// Kernel against the long-double recurrence, unit keys. Measured worst (N <= 300, D, M <= 24):
// float 4.4e-7, double 1.2e-15.
constexpr double kRefFloat = 2e-6;
constexpr double kRefDouble = 4e-15;
// Raw keys (Identity, entries in [-0.3, 0.3] so that β‖k‖² stays below 2: bounded factors).
// Measured worst: float 4.0e-7, double 6.0e-16.
constexpr double kRawFloat = 3e-6;
constexpr double kRawDouble = 6e-15;
// Chunked against Recurrent, pieces against one shot, the decode step against the parallel call.
// Measured worst: float 3.3e-7, double 7.3e-16.
constexpr double kAgreeFloat = 2e-6;
constexpr double kAgreeDouble = 4e-15;
// Multi-head / batched against per-head single calls (same bits), layouts against column-major.
constexpr double kSameFloat = 4e-7;
constexpr double kSameDouble = 1e-15;

template <class S>
double ref_bound(bool raw) {
  return raw ? test::bound<S>(kRawFloat, kRawDouble) : test::bound<S>(kRefFloat, kRefDouble);
}
template <class S>
double agree_bound() {
  return test::bound<S>(kAgreeFloat, kAgreeDouble);
}
template <class S>
double same_bound() {
  return test::bound<S>(kSameFloat, kSameDouble);
}

struct Algo {
  CausalAlgorithm algorithm;
  Index chunk;
  const char* name;
};

const std::vector<Algo>& algos() {
  static const std::vector<Algo> list = {
      {CausalAlgorithm::Chunked, 1, "Chunked C=1"},   {CausalAlgorithm::Chunked, 7, "Chunked C=7"},
      {CausalAlgorithm::Chunked, 64, "Chunked C=64"}, {CausalAlgorithm::Chunked, 0, "Chunked default"},
      {CausalAlgorithm::Recurrent, 0, "Recurrent"},   {CausalAlgorithm::Auto, 0, "Auto"},
  };
  return list;
}

DeltaOptions options(const Algo& a, double scale = 1.0) {
  DeltaOptions o;
  o.algorithm = a.algorithm;
  o.chunk_size = a.chunk;
  o.scale = scale;
  return o;
}

// Uniform in [lo, hi], rounded to float (exact in both scalar types).
MatD frand(Index rows, Index cols, std::uint32_t seed, double lo = -1.0, double hi = 1.0) {
  return test::random_matrix<float>(rows, cols, seed, lo, hi).cast<double>();
}

// One problem: inputs in double (float-exact), beta in [0, 2] (or [lo, hi]), log_a in
// [-0.5, 0] (or empty: no decay).
struct Case {
  MatD Q, K, V;
  VecD beta, log_a;
  Case rows(Index r0, Index n) const {
    Case c{Q.middleRows(r0, n), K.middleRows(r0, n), V.middleRows(r0, n), beta.segment(r0, n),
           VecD()};
    if (log_a.size()) c.log_a = log_a.segment(r0, n);
    return c;
  }
};

Case make_case(Index N, Index D, Index M, std::uint32_t seed, bool decay, double key_range = 1.0,
               double beta_lo = 0.0, double beta_hi = 2.0) {
  Case c;
  c.Q = frand(N, D, seed);
  c.K = frand(N, D, seed + 1, -key_range, key_range);
  c.V = frand(N, M, seed + 2);
  c.beta = frand(N, 1, seed + 3, beta_lo, beta_hi);
  if (decay) c.log_a = frand(N, 1, seed + 4, -0.5, 0.0);
  return c;
}

// The kernel calls, one instantiation per (map, scalar).
template <class S, class Phi>
Mat<S> run(const Phi& phi, const Case& c, const DeltaOptions& o, State<S>& st) {
  return linattn::delta_rule_attention(c.Q.cast<S>().eval(), c.K.cast<S>().eval(),
                                       c.V.cast<S>().eval(), Vec<S>(c.beta.cast<S>()),
                                       Vec<S>(c.log_a.cast<S>()), phi, st, o);
}

template <class S, class Phi>
Mat<S> run(const Phi& phi, const Case& c, const DeltaOptions& o) {
  State<S> st;
  return run<S>(phi, c, o, st);
}

double relative(double err, const MatD& ref) { return err / std::max(1.0, test::max_abs(ref)); }

// ---------------------------------------------------------------------------------------------
// Against the reference
// ---------------------------------------------------------------------------------------------

struct Shape {
  Index N, D, M;
};

template <class S, class Phi>
void check_reference(const Phi& phi, const char* map, bool raw, double& worst) {
  const std::vector<Shape> shapes = {{1, 3, 2}, {37, 5, 7}, {150, 8, 6}, {300, 24, 17}};
  std::uint32_t seed = 100;
  for (const Shape& sh : shapes)
    for (const bool decay : {false, true}) {
      const Case c = make_case(sh.N, sh.D, sh.M, seed += 10, decay, raw ? 0.3 : 1.0);
      const double scale = 1.0 / std::sqrt(double(sh.D));
      const MatD ref = dref::recurrence(phi, c.Q, c.K, c.V, c.beta, c.log_a, scale);
      for (const Algo& a : algos()) {
        const Mat<S> out = run<S>(phi, c, options(a, scale));
        const double e = relative(test::max_abs_diff(out.template cast<double>(), ref), ref);
        EXPECT_LE(e, ref_bound<S>(raw))
            << map << ", " << a.name << (decay ? ", decay" : ", no decay") << ", N=" << sh.N
            << " D=" << sh.D << " M=" << sh.M;
        worst = std::max(worst, e);
      }
    }
}

TEST(delta_forward, MatchesRecurrenceUnitKeys) {
  [[maybe_unused]] double wf = 0, wd = 0;
  IF_FLOAT(check_reference<float>(SiluL2{}, "L2Normalize<Silu>", false, wf));
  IF_DOUBLE(check_reference<double>(SiluL2{}, "L2Normalize<Silu>", false, wd));
  IF_FLOAT(check_reference<float>(UnitL2{}, "L2Normalize<Identity>", false, wf));
  IF_DOUBLE(check_reference<double>(UnitL2{}, "L2Normalize<Identity>", false, wd));
  IF_FLOAT(test::report_error("delta rule vs recurrence, unit keys, float", wf));
  IF_DOUBLE(test::report_error("delta rule vs recurrence, unit keys, double", wd));
}

TEST(delta_forward, MatchesRecurrenceRawKeys) {
  [[maybe_unused]] double wf = 0, wd = 0;
  IF_FLOAT(check_reference<float>(Identity{}, "Identity", true, wf));
  IF_DOUBLE(check_reference<double>(Identity{}, "Identity", true, wd));
  IF_FLOAT(test::report_error("delta rule vs recurrence, raw keys, float", wf));
  IF_DOUBLE(test::report_error("delta rule vs recurrence, raw keys, double", wd));
}

template <class S>
void check_chunked_recurrent(double& worst) {
  const Case c = make_case(333, 12, 20, 7, true);
  DeltaOptions rec;
  rec.algorithm = CausalAlgorithm::Recurrent;
  const Mat<S> r = run<S>(SiluL2{}, c, rec);
  for (const Index C : {1, 2, 16, 33, 64, 128}) {
    DeltaOptions ch;
    ch.algorithm = CausalAlgorithm::Chunked;
    ch.chunk_size = C;
    const double e = test::max_abs_diff(run<S>(SiluL2{}, c, ch), r) /
                     std::max<double>(1, test::max_abs(r));
    EXPECT_LE(e, agree_bound<S>()) << "C=" << C;
    worst = std::max(worst, e);
  }
}

// Widths that reach every packet path of the fused step (blocks of 4 packets, single packets,
// the scalar tail) for SSE (4 floats), AVX2 (8) and AVX-512 (16): M = 70 and 64, D = 33.
TEST(delta_forward, WidePacketTilesMatchRecurrence) {
  double wf = 0;
  for (const Shape sh : {Shape{50, 33, 70}, Shape{40, 64, 64}})
    for (const bool decay : {false, true}) {
      const Case c = make_case(sh.N, sh.D, sh.M, 131 + static_cast<std::uint32_t>(sh.M), decay);
      const MatD ref = dref::recurrence(SiluL2{}, c.Q, c.K, c.V, c.beta, c.log_a, 1.0);
      for (const Algo& a : algos()) {
        const double e =
            relative(test::max_abs_diff(run<float>(SiluL2{}, c, options(a)).cast<double>(), ref),
                     ref);
        EXPECT_LE(e, ref_bound<float>(false)) << a.name << ", M=" << sh.M;
        wf = std::max(wf, e);
      }
      const double ed = relative(
          test::max_abs_diff(run<double>(SiluL2{}, c, options(algos()[4])), ref), ref);
      EXPECT_LE(ed, ref_bound<double>(false)) << "Recurrent, M=" << sh.M;
    }
  IF_FLOAT(test::report_error("wide tiles vs recurrence, float", wf));
}

TEST(delta_forward, ChunkedEqualsRecurrent) {
  [[maybe_unused]] double wf = 0, wd = 0;
  IF_FLOAT(check_chunked_recurrent<float>(wf));
  IF_DOUBLE(check_chunked_recurrent<double>(wd));
  IF_FLOAT(test::report_error("chunked vs recurrent, float", wf));
  IF_DOUBLE(test::report_error("chunked vs recurrent, double", wd));
}

// ---------------------------------------------------------------------------------------------
// The properties the delta rule is built for
// ---------------------------------------------------------------------------------------------

// β = 0 writes nothing: out_t = s exp(Σ_{l<=t} g_l) q̂_tᵀ S0, the carried state decayed.
template <class S>
void check_beta_zero() {
  const Index N = 70, D = 6, M = 5;
  Case c = make_case(N, D, M, 31, true);
  c.beta.setZero();
  const MatD S0 = frand(D, M, 40);
  for (const Algo& a : algos()) {
    State<S> st(D, M);
    st.S = S0.cast<S>();
    const Mat<S> out = run<S>(Identity{}, c, options(a), st);
    MatD want(N, M);
    double G = 0;
    for (Index t = 0; t < N; ++t) {
      G += c.log_a(t);
      want.row(t) = std::exp(G) * (c.Q.row(t) * S0);
    }
    EXPECT_LE(test::max_abs_diff(out.template cast<double>(), want), agree_bound<S>()) << a.name;
    EXPECT_LE(test::max_abs_diff(MatD(st.S.template cast<double>()), MatD(std::exp(G) * S0)),
              agree_bound<S>())
        << a.name << ": final state";
  }
}

TEST(delta_properties, BetaZeroLeavesTheDecayedPast) {
  IF_FLOAT(check_beta_zero<float>());
  IF_DOUBLE(check_beta_zero<double>());
}

// β = 1 with orthonormal keys: each write replaces the value stored under its key, so a query
// equal to a key reads the last value written under it, exactly (to rounding), whatever was
// written under it before or under the other keys.
template <class S>
void check_recall(const Algo& a) {
  const Index D = 8, M = 5, writes = 40;
  MatD basis = frand(D, D, 50);  // orthonormal columns by Gram-Schmidt (twice, for double's accuracy)
  for (int pass = 0; pass < 2; ++pass)
    for (Index j = 0; j < D; ++j) {
      for (Index i = 0; i < j; ++i) basis.col(j) -= basis.col(i).dot(basis.col(j)) * basis.col(i);
      basis.col(j).normalize();
    }
  std::vector<Index> key(writes);
  for (Index t = 0; t < writes; ++t) key[t] = (t * 5 + t / 3) % D;
  Case c;
  c.K.resize(writes + D, D);
  c.Q = MatD::Zero(writes + D, D);
  c.V = frand(writes + D, M, 51);
  c.beta = VecD::Ones(writes + D);
  for (Index t = 0; t < writes; ++t) c.K.row(t) = basis.col(key[t]).transpose();
  // Then D reads: q = key j, with β = 0 so that reading writes nothing.
  for (Index j = 0; j < D; ++j) {
    c.Q.row(writes + j) = basis.col(j).transpose();
    c.K.row(writes + j) = basis.col(j).transpose();
    c.beta(writes + j) = 0;
  }
  const Mat<S> out = run<S>(Identity{}, c, options(a));
  for (Index j = 0; j < D; ++j) {
    Index last = -1;
    for (Index t = 0; t < writes; ++t)
      if (key[t] == j) last = t;
    const VecD want = last < 0 ? VecD(VecD::Zero(M)) : VecD(c.V.row(last).transpose());
    const VecD got = out.row(writes + j).transpose().template cast<double>();
    EXPECT_LE(test::max_abs_diff(got, want), 8 * agree_bound<S>())
        << a.name << ": key " << j << " last written at " << last;
  }
}

TEST(delta_properties, UnitBetaOrthonormalKeysRecallTheLastValue) {
  for (const Algo& a : algos()) {
    IF_FLOAT(check_recall<float>(a));
    IF_DOUBLE(check_recall<double>(a));
  }
}

// ---------------------------------------------------------------------------------------------
// Carried state, returning forms, the decode step
// ---------------------------------------------------------------------------------------------

template <class S>
void check_pieces(double& worst) {
  const Case c = make_case(260, 9, 11, 61, true);
  for (const Algo& a : algos()) {
    const DeltaOptions o = options(a, 0.5);
    State<S> whole;
    const Mat<S> one = run<S>(SiluL2{}, c, o, whole);
    State<S> st;
    Mat<S> pieces(c.Q.rows(), c.V.cols());
    const Index cuts[] = {0, 1, 70, 71, 200, 260};
    for (int p = 0; p + 1 < 6; ++p)
      pieces.middleRows(cuts[p], cuts[p + 1] - cuts[p]) =
          run<S>(SiluL2{}, c.rows(cuts[p], cuts[p + 1] - cuts[p]), o, st);
    const double e = test::max_abs_diff(pieces, one);
    EXPECT_LE(e, agree_bound<S>()) << a.name;
    EXPECT_LE(test::max_abs_diff(Mat<S>(st.S), Mat<S>(whole.S)), agree_bound<S>())
        << a.name << ": final state";
    worst = std::max(worst, e);
  }
}

TEST(delta_forward, PiecesEqualOneShot) {
  [[maybe_unused]] double wf = 0, wd = 0;
  IF_FLOAT(check_pieces<float>(wf));
  IF_DOUBLE(check_pieces<double>(wd));
  IF_FLOAT(test::report_error("pieces vs one shot, float", wf));
  IF_DOUBLE(test::report_error("pieces vs one shot, double", wd));
}

TEST(delta_forward, ReturningOverloadsAndOutParameter) {
  const Case c = make_case(90, 6, 4, 71, true);
  const Eigen::MatrixXf Q = c.Q.cast<float>(), K = c.K.cast<float>(), V = c.V.cast<float>();
  const Eigen::VectorXf beta = c.beta.cast<float>(), log_a = c.log_a.cast<float>();
  const Eigen::MatrixXf a = linattn::delta_rule_attention(Q, K, V, beta, log_a);
  linattn::LinearAttentionState<float> st;
  linattn::Workspace<float> ws;
  Eigen::MatrixXf b(90, 4);
  linattn::delta_rule_attention(Q, K, V, beta, log_a, Identity{}, st, b, ws);
  EXPECT_EQ(test::max_abs_diff(a, b), 0.0);
  const MatD ref = dref::recurrence(Identity{}, c.Q, c.K, c.V, c.beta, c.log_a, 1.0);
  EXPECT_LE(relative(test::max_abs_diff(a.cast<double>(), ref), ref), ref_bound<float>(true));
  // The out-parameter form on reused buffers allocates nothing.
  st = linattn::LinearAttentionState<float>();
  linattn::delta_rule_attention(Q, K, V, beta, log_a, Identity{}, st, b, ws);
  const test::Allocations al = test::allocations_in(
      [&] { linattn::delta_rule_attention(Q, K, V, beta, log_a, Identity{}, st, b, ws); });
  EXPECT_EQ(al.eigen, 0);
  EXPECT_EQ(al.news, 0);
}

// The final state of a whole-sequence call.
template <class S, class Phi>
Mat<S> pre_final(const Phi& phi, const Case& c, const DeltaOptions& o) {
  State<S> st;
  run<S>(phi, c, o, st);
  return st.S;
}

template <class S, class Phi>
void check_decoder(const Phi& phi, bool decay, double& worst) {
  const Index N = 150, D = 10, M = 12;
  const Case c = make_case(N, D, M, decay ? 81 : 82, decay);
  DeltaOptions o;
  o.scale = 0.3;
  const Mat<S> par = run<S>(phi, c, o);
  const Mat<S> Q = c.Q.cast<S>(), K = c.K.cast<S>(), V = c.V.cast<S>();
  linattn::RecurrentDeltaRule<Phi, S> rnn(D, M, phi, o);
  Vec<S> out(M);
  Mat<S> steps(N, M);
  for (Index t = 0; t < N; ++t) {
    rnn.step(Q.row(t), K.row(t), V.row(t), S(c.beta(t)), decay ? S(c.log_a(t)) : S(0), out);
    steps.row(t) = out.transpose();
  }
  double e = test::max_abs_diff(steps, par);
  EXPECT_LE(e, agree_bound<S>()) << "decode steps";
  worst = std::max(worst, e);
  EXPECT_EQ(rnn.position(), N);

  // set_state() from a parallel prefill of the first 40 tokens, then decode the rest.
  const Index P = 40;
  State<S> pre;
  run<S>(phi, c.rows(0, P), o, pre);
  rnn.set_state(pre);
  for (Index t = P; t < N; ++t) {
    rnn.step(Q.row(t), K.row(t), V.row(t), S(c.beta(t)), decay ? S(c.log_a(t)) : S(0), out);
    steps.row(t) = out.transpose();
  }
  e = test::max_abs_diff(steps.bottomRows(N - P), par.bottomRows(N - P));
  EXPECT_LE(e, agree_bound<S>()) << "decode after set_state()";
  worst = std::max(worst, e);
  // The last step's update is applied lazily: state() between steps, a copy and a move of the
  // decoder mid-sequence all continue as the uninterrupted decode.
  EXPECT_LE(test::max_abs_diff(Mat<S>(rnn.state().S), pre_final<S>(phi, c, o)),
            agree_bound<S>())
      << "state() after the last step";
  rnn.set_state(pre);
  for (Index t = P; t < P + 10; ++t) rnn.step(Q.row(t), K.row(t), V.row(t), S(c.beta(t)),
                                              decay ? S(c.log_a(t)) : S(0), out);
  linattn::RecurrentDeltaRule<Phi, S> copy = rnn;
  (void)rnn.state();
  linattn::RecurrentDeltaRule<Phi, S> moved = std::move(copy);
  Vec<S> out2(M);
  for (Index t = P + 10; t < N; ++t) {
    rnn.step(Q.row(t), K.row(t), V.row(t), S(c.beta(t)), decay ? S(c.log_a(t)) : S(0), out);
    moved.step(Q.row(t), K.row(t), V.row(t), S(c.beta(t)), decay ? S(c.log_a(t)) : S(0), out2);
    EXPECT_LE(test::max_abs_diff(out, par.row(t).transpose().eval()), agree_bound<S>()) << t;
    EXPECT_LE(test::max_abs_diff(out2, par.row(t).transpose().eval()), agree_bound<S>()) << t;
  }

  // No allocation per step.
  rnn.reset();
  Vec<S> q = Q.row(0).transpose(), k = K.row(0).transpose(), v = V.row(0).transpose();
  const test::Allocations al = test::allocations_in([&] {
    for (Index t = 0; t < N; ++t) {
      q = Q.row(t).transpose();
      k = K.row(t).transpose();
      v = V.row(t).transpose();
      rnn.step(q, k, v, S(c.beta(t)), S(0), out);
    }
  });
  EXPECT_EQ(al.eigen, 0);
  EXPECT_EQ(al.news, 0);
}

TEST(delta_recurrent, StepsEqualParallelCall) {
  [[maybe_unused]] double wf = 0, wd = 0;
  for (const bool decay : {false, true}) {
    IF_FLOAT(check_decoder<float>(SiluL2{}, decay, wf));
    IF_DOUBLE(check_decoder<double>(SiluL2{}, decay, wd));
    IF_FLOAT(check_decoder<float>(Identity{}, decay, wf));
    IF_DOUBLE(check_decoder<double>(Identity{}, decay, wd));
  }
  IF_FLOAT(test::report_error("RecurrentDeltaRule steps vs parallel, float", wf));
  IF_DOUBLE(test::report_error("RecurrentDeltaRule steps vs parallel, double", wd));
}

TEST(delta_recurrent, NoMallocDetectorWorks) { eigen_hook::expect_detector_works(); }

TEST(delta_recurrent, StepChecksSizes) {
  linattn::RecurrentDeltaRule<Identity, float> rnn(4, 3);
  const Eigen::VectorXf q4 = Eigen::VectorXf::Ones(4), q5 = Eigen::VectorXf::Ones(5),
                        v3 = Eigen::VectorXf::Ones(3);
  Eigen::VectorXf out3(3), out2(2);
  const char* fn = "RecurrentDeltaRule::step";
  test::expect_invalid([&] { rnn.step(q5, q4, v3, 1.0f, 0.0f, out3); }, fn, "q size");
  test::expect_invalid([&] { rnn.step(q4, q5, v3, 1.0f, 0.0f, out3); }, fn, "k size");
  test::expect_invalid([&] { rnn.step(q4, q4, q4, 1.0f, 0.0f, out3); }, fn, "v size");
  test::expect_invalid([&] { rnn.step(q4, q4, v3, 1.0f, 0.0f, out2); }, fn, "out size");
  test::expect_invalid([] { linattn::RecurrentDeltaRule<Identity, float> bad(0, 3); },
                       "RecurrentDeltaRule", "D = 0");
  State<float> wrong(5, 3);
  test::expect_invalid([&] { rnn.set_state(wrong); }, "RecurrentDeltaRule::set_state",
                       "state shape");
  EXPECT_EQ(rnn.position(), 0);
}

// state() is read-only: what it returns is a snapshot of the state after position() tokens
// (the long-double recurrence's, to rounding), which later steps leave as it was, even when
// bound to a reference; calling it between steps changes no output bit. (It used to be a
// reference to the object's own state, settled in place, which the next steps then changed.)
template <class S>
void check_state_snapshot() {
  const Index N = 60, D = 6, M = 5, P = 25;
  const Case c = make_case(N, D, M, 87, true);
  MatD S_ref;
  dref::recurrence(SiluL2{}, c.Q.topRows(P), c.K.topRows(P), c.V.topRows(P), c.beta.head(P),
                   c.log_a.head(P), 1.0, &S_ref);
  const Mat<S> Q = c.Q.cast<S>(), K = c.K.cast<S>(), V = c.V.cast<S>();
  const auto step = [&](linattn::RecurrentDeltaRule<SiluL2, S>& r, Index t, Vec<S>& o) {
    r.step(Q.row(t), K.row(t), V.row(t), S(c.beta(t)), S(c.log_a(t)), o);
  };
  linattn::RecurrentDeltaRule<SiluL2, S> rnn(D, M), plain(D, M);
  Vec<S> out(M), out_plain(M);
  for (Index t = 0; t < P; ++t) {
    step(rnn, t, out);
    step(plain, t, out_plain);
    (void)rnn.state();  // between steps: no effect on any output
    ASSERT_TRUE(test::same_bits(out, out_plain)) << t;
  }
  const auto& before = rnn.state();
  const Mat<S> at_P = before.S;
  const double scale_P = std::max(1.0, test::max_abs(S_ref));
  EXPECT_LE(test::max_abs_diff(Mat<S>(before.S), S_ref.cast<S>().eval()) / scale_P,
            ref_bound<S>(false));
  for (Index t = P; t < N; ++t) {
    step(rnn, t, out);
    step(plain, t, out_plain);
    ASSERT_TRUE(test::same_bits(out, out_plain)) << t;
  }
  EXPECT_TRUE(test::same_bits(Mat<S>(before.S), at_P)) << "later steps changed the snapshot";
  EXPECT_TRUE(test::same_bits(Mat<S>(rnn.state().S), Mat<S>(plain.state().S)));
  MatD S_all;
  dref::recurrence(SiluL2{}, c.Q, c.K, c.V, c.beta, c.log_a, 1.0, &S_all);
  EXPECT_LE(test::max_abs_diff(Mat<S>(rnn.state().S), S_all.cast<S>().eval()) /
                std::max(1.0, test::max_abs(S_all)),
            ref_bound<S>(false));
  // set_state(state()) continues bit for bit.
  linattn::RecurrentDeltaRule<SiluL2, S> resumed(D, M);
  resumed.set_state(rnn.state(), rnn.position());
  for (Index t = 0; t < 5; ++t) {
    step(rnn, t, out);
    step(resumed, t, out_plain);
    ASSERT_TRUE(test::same_bits(out, out_plain)) << t;
  }
  EXPECT_EQ(resumed.position(), N + 5);
}

TEST(delta_recurrent, StateIsAReadOnlySnapshot) {
  IF_FLOAT(check_state_snapshot<float>());
  IF_DOUBLE(check_state_snapshot<double>());
}

// The decode step checks beta and log_a as the parallel kernels do (beta in [0, 2], log_a
// finite and <= 0), naming the value and the token, and changes nothing when it throws; the
// edges of the ranges are accepted. set_state() refuses a negative position.
TEST(delta_recurrent, StepAndSetStateCheckValues) {
  linattn::RecurrentDeltaRule<UnitL2, float> rnn(4, 3);
  const Eigen::VectorXf q = Eigen::VectorXf::LinSpaced(4, -1, 1), v = Eigen::VectorXf::Ones(3);
  Eigen::VectorXf out(3);
  rnn.step(q, q, v, 0.5f, -0.25f, out);
  const State<float> before = rnn.state();
  const std::string fn = "linattn::RecurrentDeltaRule::step: ";
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const float b : {-1e-30f, std::nextafter(2.0f, 3.0f), 3.0f, inf, nan})
    test::expect_invalid([&] { rnn.step(q, q, v, b, 0.0f, out); },
                         Needles{fn + "beta = ", " (token 1): beta must be in [0, 2]"},
                         "beta " + std::to_string(b));
  for (const float g : {1e-30f, 0.5f, inf, -inf, nan})
    test::expect_invalid([&] { rnn.step(q, q, v, 1.0f, g, out); },
                         Needles{fn + "log_a = ", " (token 1): log-decays must be finite and <= 0"},
                         "log_a " + std::to_string(g));
  test::expect_invalid([&] { rnn.step(q, q, v, 2.5f, 0.0f, out); }, "beta = 2.5", "the value");
  EXPECT_EQ(rnn.position(), 1);
  EXPECT_TRUE(test::same_bits(Mat<float>(rnn.state().S), Mat<float>(before.S)));
  for (const float b : {0.0f, 2.0f})
    for (const float g : {0.0f, -0.0f, -1e30f}) EXPECT_NO_THROW(rnn.step(q, q, v, b, g, out));
  test::expect_invalid([&] { rnn.set_state(before, -3); },
                       Needles{"RecurrentDeltaRule::set_state",
                               "position = -3: a decoding position counts tokens"},
                       "position");
  EXPECT_EQ(rnn.position(), 7);
}

// ---------------------------------------------------------------------------------------------
// Multi-head and batched
// ---------------------------------------------------------------------------------------------

template <class S>
void check_multihead(bool decay) {
  const Index N = 130, H = 3, D = 5, M = 7;
  const MatD Q = frand(N, H * D, 91), K = frand(N, H * D, 92), V = frand(N, H * M, 93);
  const MatD beta = frand(N, H, 94, 0.0, 2.0);
  const MatD log_a = decay ? frand(N, H, 95, -0.5, 0.0) : MatD(N, 0);
  for (const Algo& a : algos()) {
    const DeltaOptions o = options(a, 0.7);
    const Mat<S> out = linattn::multihead_delta_rule_attention(
        Q.cast<S>().eval(), K.cast<S>().eval(), V.cast<S>().eval(), beta.cast<S>().eval(),
        log_a.cast<S>().eval(), H, SiluL2{}, o);
    std::vector<State<S>> states;
    Mat<S> carried(N, H * M);
    linattn::MultiHeadWorkspace<S> mws;
    linattn::multihead_delta_rule_attention(Q.cast<S>().eval(), K.cast<S>().eval(),
                                            V.cast<S>().eval(), beta.cast<S>().eval(),
                                            log_a.cast<S>().eval(), H, SiluL2{}, states, carried,
                                            mws, o);
    ASSERT_EQ(states.size(), std::size_t(H));
    for (Index h = 0; h < H; ++h) {
      Case c{Q.middleCols(h * D, D), K.middleCols(h * D, D), V.middleCols(h * M, M), beta.col(h),
             decay ? VecD(log_a.col(h)) : VecD()};
      State<S> st;
      const Mat<S> one = run<S>(SiluL2{}, c, o, st);
      EXPECT_LE(test::max_abs_diff(Mat<S>(out.middleCols(h * M, M)), one), same_bound<S>())
          << a.name << ", head " << h;
      EXPECT_LE(test::max_abs_diff(Mat<S>(carried.middleCols(h * M, M)), one), same_bound<S>());
      EXPECT_LE(test::max_abs_diff(Mat<S>(states[h].S), Mat<S>(st.S)), same_bound<S>());
    }
  }
}

TEST(delta_multihead, EqualsPerHeadSingleCalls) {
  for (const bool decay : {false, true}) {
    IF_FLOAT(check_multihead<float>(decay));
    IF_DOUBLE(check_multihead<double>(decay));
  }
}

TEST(delta_batched, EqualsPerSequenceSingleCalls) {
  const Index H = 2, D = 4, M = 6;
  const std::vector<int> cu = {0, 1, 50, 50, 170};
  const Index N = cu.back();
  const MatD Q = frand(N, H * D, 101), K = frand(N, H * D, 102), V = frand(N, H * M, 103);
  const MatD beta = frand(N, H, 104, 0.0, 2.0), log_a = frand(N, H, 105, -0.5, 0.0);
  const Eigen::MatrixXf Qf = Q.cast<float>(), Kf = K.cast<float>(), Vf = V.cast<float>(),
                        bf = beta.cast<float>(), gf = log_a.cast<float>();
  Eigen::MatrixXf out(N, H * M);
  linattn::MultiHeadWorkspace<float> ws;
  std::vector<State<float>> states;
  linattn::batched_delta_rule_attention(Qf, Kf, Vf, bf, gf, cu, H, SiluL2{}, states, out, ws);
  ASSERT_EQ(states.size(), std::size_t(4 * H));
  for (std::size_t b = 0; b + 1 < cu.size(); ++b)
    for (Index h = 0; h < H; ++h) {
      const Index r0 = cu[b], n = cu[b + 1] - cu[b];
      Case c{Q.block(r0, h * D, n, D), K.block(r0, h * D, n, D), V.block(r0, h * M, n, M),
             beta.col(h).segment(r0, n), log_a.col(h).segment(r0, n)};
      State<float> st;
      const Eigen::MatrixXf one = run<float>(SiluL2{}, c, DeltaOptions{}, st);
      EXPECT_LE(test::max_abs_diff(Eigen::MatrixXf(out.block(r0, h * M, n, M)), one),
                same_bound<float>())
          << "sequence " << b << ", head " << h;
      if (n > 0) {
        EXPECT_LE(test::max_abs_diff(Eigen::MatrixXf(states[b * H + h].S), Eigen::MatrixXf(st.S)),
                  same_bound<float>());
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Layouts, edge cases, errors
// ---------------------------------------------------------------------------------------------

TEST(delta_layout, RowMajorMapsAndBlocksEqualColumnMajor) {
  const Index N = 100, D = 6, M = 9;
  const Case c = make_case(N, D, M, 111, true);
  for (const Algo& a : algos()) {
    const DeltaOptions o = options(a);
    const Eigen::MatrixXf base = run<float>(SiluL2{}, c, o);
    const RowMat<float> Qr = c.Q.cast<float>(), Kr = c.K.cast<float>(), Vr = c.V.cast<float>();
    const Eigen::RowVectorXf br = c.beta.cast<float>().transpose();
    const Eigen::VectorXf gc = c.log_a.cast<float>();
    RowMat<float> out_r(N, M);
    State<float> st;
    linattn::Workspace<float> ws;
    linattn::delta_rule_attention(Qr, Kr, Vr, br, gc, SiluL2{}, st, out_r, ws, o);
    EXPECT_LE(test::max_abs_diff(Eigen::MatrixXf(out_r), base), same_bound<float>())
        << a.name << ": row-major, beta a row vector";
    // Blocks of a wider packed matrix, written into a block of a larger output.
    Eigen::MatrixXf wide(N, D + M + 3);
    wide.leftCols(D) = c.Q.cast<float>();
    wide.middleCols(D, M) = c.V.cast<float>();
    Eigen::MatrixXf big = Eigen::MatrixXf::Zero(N + 2, M + 1);
    const Eigen::Map<const Eigen::MatrixXf> Km(Kr.eval().data(), N, D);  // column-major copy
    Eigen::MatrixXf Kc = c.K.cast<float>();
    const Eigen::Map<const Eigen::MatrixXf> Kmap(Kc.data(), N, D);
    st = State<float>();
    linattn::delta_rule_attention(wide.leftCols(D), Kmap, wide.middleCols(D, M), br, gc,
                                  SiluL2{}, st, big.block(1, 1, N, M), ws, o);
    EXPECT_LE(test::max_abs_diff(Eigen::MatrixXf(big.block(1, 1, N, M)), base),
              same_bound<float>())
        << a.name << ": blocks and Maps";
    (void)Km;
  }
}

TEST(delta_forward, EmptySequenceLeavesStateUnchanged) {
  const Eigen::MatrixXf Q(0, 4), K(0, 4), V(0, 3);
  const Eigen::VectorXf beta(0), log_a(0);
  State<float> st(4, 3);
  st.S.setConstant(0.25f);
  const Eigen::MatrixXf out = linattn::delta_rule_attention(Q, K, V, beta, log_a, Identity{}, st);
  EXPECT_EQ(out.rows(), 0);
  EXPECT_EQ(out.cols(), 3);
  EXPECT_TRUE((st.S.array() == 0.25f).all());
}

TEST(delta_stability, LargeInputsStayFinite) {
  // Magnitude-100 inputs: unit keys keep every factor bounded; the outputs are finite and match
  // the reference in double.
  const Case c = make_case(200, 8, 8, 121, true);
  Case big = c;
  big.Q *= 100;
  big.K *= 100;
  big.V *= 100;
  for (const Algo& a : algos()) {
    const Eigen::MatrixXf out = run<float>(SiluL2{}, big, options(a));
    EXPECT_TRUE(test::all_finite(out)) << a.name;
    const MatD ref = dref::recurrence(SiluL2{}, big.Q, big.K, big.V, big.beta, big.log_a, 1.0);
    EXPECT_LE(relative(test::max_abs_diff(out.cast<double>(), ref), ref), 4 * ref_bound<float>(false))
        << a.name;
  }
  // Raw keys with β‖k‖² well above 2: the state grows (no bound is promised), the kernel forms
  // no NaN from finite inputs while the values stay finite.
  const Case raw = make_case(40, 8, 8, 122, false, 2.0, 1.0, 2.0);
  for (const Algo& a : algos()) {
    const MatD out = run<double>(Identity{}, raw, options(a));
    EXPECT_FALSE(out.array().isNaN().any()) << a.name;
  }
}

TEST(delta_errors, ShapeMismatchesNameFunctionAndShapes) {
  const Eigen::MatrixXf Q = Eigen::MatrixXf::Ones(5, 4), K = Eigen::MatrixXf::Ones(5, 4),
                        V = Eigen::MatrixXf::Ones(5, 3), K6 = Eigen::MatrixXf::Ones(6, 4);
  const Eigen::VectorXf beta = Eigen::VectorXf::Ones(5), beta4 = Eigen::VectorXf::Ones(4),
                        g = Eigen::VectorXf::Zero(5), g4 = Eigen::VectorXf::Zero(4), none;
  const char* fn = "delta_rule_attention";
  test::expect_invalid([&] { linattn::delta_rule_attention(Q, K6, V, beta, g); },
                       Needles{fn, "5x4", "6x4", "5x3"}, "K rows");
  test::expect_invalid([&] { linattn::delta_rule_attention(Q, K, V, beta4, g); },
                       Needles{fn, "beta is 4x1", "vector of N = 5 entries", "Q is 5x4"},
                       "beta size");
  test::expect_invalid([&] { linattn::delta_rule_attention(Q, K, V, beta, g4); },
                       Needles{fn, "log_a is 4x1", "empty (no decay)"}, "log_a size");
  const Eigen::MatrixXf beta2 = Eigen::MatrixXf::Ones(5, 2);
  test::expect_invalid([&] { linattn::delta_rule_attention(Q, K, V, beta2, none); },
                       Needles{fn, "beta is 5x2"}, "beta matrix");
  DeltaOptions bad;
  bad.chunk_size = -1;
  test::expect_invalid([&] { linattn::delta_rule_attention(Q, K, V, beta, g, Identity{}, bad); },
                       Needles{fn, "chunk_size must be >= 0"}, "chunk size");
  State<float> wrong(3, 3);
  test::expect_invalid([&] { linattn::delta_rule_attention(Q, K, V, beta, g, Identity{}, wrong); },
                       Needles{fn, "the state"}, "state shape");
  Eigen::MatrixXf out(5, 3);
  linattn::Workspace<float> ws;
  State<float> st;
  Eigen::MatrixXf out_bad(4, 3);
  test::expect_invalid(
      [&] { linattn::delta_rule_attention(Q, K, V, beta, g, Identity{}, st, out_bad, ws); },
      Needles{fn, "4x3"}, "output shape");
  Eigen::MatrixXf QV = Eigen::MatrixXf::Ones(5, 4);
  test::expect_invalid(
      [&] {
        linattn::delta_rule_attention(QV, K, V, beta, g, Identity{}, st, QV.leftCols(3), ws);
      },
      Needles{fn, "Q"}, "output overlaps Q");
  // Multi-head: beta N x H, log_a N x H or empty.
  const Eigen::MatrixXf Qh = Eigen::MatrixXf::Ones(5, 8), Vh = Eigen::MatrixXf::Ones(5, 6);
  const Eigen::MatrixXf bh = Eigen::MatrixXf::Ones(5, 2), bh3 = Eigen::MatrixXf::Ones(5, 3),
                        gh = Eigen::MatrixXf::Zero(5, 2), gh0(5, 0);
  const char* mfn = "multihead_delta_rule_attention";
  test::expect_invalid([&] { linattn::multihead_delta_rule_attention(Qh, Qh, Vh, bh3, gh, 2); },
                       Needles{mfn, "beta is 5x3", "5x2"}, "multi-head beta");
  test::expect_invalid([&] { linattn::multihead_delta_rule_attention(Qh, Qh, Vh, bh, bh3, 2); },
                       Needles{mfn, "log_a is 5x3"}, "multi-head log_a");
  EXPECT_NO_THROW(linattn::multihead_delta_rule_attention(Qh, Qh, Vh, bh, gh0, 2));
}

TEST(delta_errors, InvalidParameterValues) {
  const Eigen::MatrixXf Q = Eigen::MatrixXf::Ones(5, 4), V = Eigen::MatrixXf::Ones(5, 3);
  const Eigen::VectorXf ok_beta = Eigen::VectorXf::Ones(5), ok_g = Eigen::VectorXf::Zero(5);
  const char* fn = "delta_rule_attention";
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (const float b : {-0.1f, 2.5f, nan, inf}) {
    Eigen::VectorXf beta = ok_beta;
    beta(3) = b;
    test::expect_invalid([&] { linattn::delta_rule_attention(Q, Q, V, beta, ok_g); },
                         Needles{fn, "beta(3)", "must be in [0, 2]"}, "beta value");
  }
  for (const float g : {0.5f, nan, -inf, inf}) {
    Eigen::VectorXf log_a = ok_g;
    log_a(2) = g;
    test::expect_invalid([&] { linattn::delta_rule_attention(Q, Q, V, ok_beta, log_a); },
                         Needles{fn, "log_a(2)", "finite and <= 0"}, "log_a value");
  }
  const Eigen::MatrixXf Qh = Eigen::MatrixXf::Ones(5, 8), Vh = Eigen::MatrixXf::Ones(5, 6);
  Eigen::MatrixXf bh = Eigen::MatrixXf::Ones(5, 2);
  bh(4, 1) = 3;
  test::expect_invalid(
      [&] {
        linattn::multihead_delta_rule_attention(Qh, Qh, Vh, bh, Eigen::MatrixXf(5, 0), 2);
      },
      Needles{"multihead_delta_rule_attention", "beta(4, 1) = 3"}, "multi-head beta value");
  // β = 0 and β = 2 are valid.
  Eigen::VectorXf edges = ok_beta;
  edges(0) = 0;
  edges(1) = 2;
  EXPECT_NO_THROW(linattn::delta_rule_attention(Q, Q, V, edges, ok_g));
}

}  // namespace
