// The decayed and gated kernels, forward (spec §9.1, §9.2, §9.4): gated_linear_attention()
// with scalar (N x 1) and per-feature (N x F) log-gates against the double references of
// gated_reference.hpp (per-token recurrence and O(N²) form, both in long double), for the maps
// Identity, Silu, L2Normalize<Silu> (unnormalised) and EluPlusOne (normalize = true), every
// algorithm and several chunk sizes, float and double; chunked against recurrent; carried state
// (pieces == one shot, final state and log_decay); log_gates = 0 against causal_linear_attention;
// the scale option; RecurrentGatedAttention step by step (no allocation per step); the multi-head
// and batched forms against per-head single calls; layouts (row-major, Maps, blocks); strong
// gates in float; argument errors; the empty sequence; large inputs.
//
// Every kernel call goes through a few helpers over Eigen::MatrixXf / MatrixXd (test::Mat<S>) so
// that each kernel is instantiated once per map and scalar type (compile time: this group builds
// under -O1 and ASan in CI). Inputs are drawn in double and rounded to float, so float and double
// runs and the references see exactly the same numbers.
//
// Compiled with EIGEN_RUNTIME_NO_MALLOC (tests/CMakeLists.txt): the decode step is checked not to
// allocate (Eigen's runtime check through eigen_assert_hook.hpp, and the global operator new).
#include "eigen_assert_hook.hpp"  // first: before any Eigen header
#include "allocation_count.hpp"

#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "gated_reference.hpp"
#include "test_util.hpp"

namespace {

using linattn::CausalAlgorithm;
using linattn::EluPlusOne;
using linattn::GatedOptions;
using linattn::Identity;
using linattn::Silu;
using SiluL2 = linattn::L2Normalize<linattn::Silu>;
using test::Index;
using test::Mat;
using test::MatD;
using test::RowMat;
template <class S>
using Vec = Eigen::Matrix<S, Eigen::Dynamic, 1>;
template <class S>
using State = linattn::LinearAttentionState<S>;

// ---------------------------------------------------------------------------------------------
// Measured errors and the bounds set from them (GCC, x86-64, -O1; relative to the largest
// magnitude of the reference output). The test log prints every measured figure ([ max err ]).
// ---------------------------------------------------------------------------------------------

// Kernel (any algorithm, chunk size, map, gate kind) against the long-double reference.
// Measured worst (N <= 333, D, M <= 24): float 6.8e-7 (Identity, scalar gates; 1.6e-7 to 3.0e-7
// for the other maps and gate kinds), double 1.3e-15.
constexpr double kRefFloat = 3e-6;
constexpr double kRefDouble = 5e-15;
// Chunked (any chunk size) against Recurrent, a sequence in pieces against one shot, the decode
// step against the parallel call. Measured worst: float 7.4e-7, double 1.3e-15.
constexpr double kAgreeFloat = 3e-6;
constexpr double kAgreeDouble = 5e-15;
// Multi-head / batched against per-head single calls (measured 0: same bits), row-major,
// blocks and Maps against column-major (measured float 1.2e-7, one ulp).
constexpr double kSameFloat = 6e-7;
constexpr double kSameDouble = 1e-15;

template <class S>
double ref_bound() {
  return test::bound<S>(kRefFloat, kRefDouble);
}
template <class S>
double agree_bound() {
  return test::bound<S>(kAgreeFloat, kAgreeDouble);
}
template <class S>
double same_bound() {
  return test::bound<S>(kSameFloat, kSameDouble);
}

// ---------------------------------------------------------------------------------------------
// Maps, options, inputs
// ---------------------------------------------------------------------------------------------

using gref::map_name;
using gref::normalizes;

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

GatedOptions options(const Algo& a, bool normalize, double scale = 1.0) {
  GatedOptions o;
  o.algorithm = a.algorithm;
  o.chunk_size = a.chunk;
  o.normalize = normalize;
  o.scale = scale;
  return o;
}

gref::Options ref_options(bool normalize, double scale = 1.0) {
  gref::Options o;
  o.normalize = normalize;
  o.scale = scale;
  return o;
}

const char* gate_name(bool per_feature) { return per_feature ? "per-feature" : "scalar"; }

// Uniform in [lo, hi], rounded to float (exact in both scalar types).
MatD frand(Index rows, Index cols, std::uint32_t seed, double lo = -1.0, double hi = 1.0) {
  return test::random_matrix<float>(rows, cols, seed, lo, hi).cast<double>();
}

struct Case {
  MatD Q, K, V, G;
  Index N() const { return Q.rows(); }
  Index D() const { return Q.cols(); }
  Index M() const { return V.cols(); }
  Case rows(Index a, Index n) const {
    return {Q.middleRows(a, n), K.middleRows(a, n), V.middleRows(a, n), G.middleRows(a, n)};
  }
};

// Mild gates by default: log a uniform in [-0.5, 0].
Case make_case(Index N, Index D, Index M, Index gate_cols, std::uint32_t salt,
               double g_lo = -0.5, double g_hi = 0.0) {
  return {frand(N, D, test::seed_of({N, D, M, gate_cols, salt, 1})),
          frand(N, D, test::seed_of({N, D, M, gate_cols, salt, 2})),
          frand(N, M, test::seed_of({N, D, M, gate_cols, salt, 3})),
          frand(N, gate_cols, test::seed_of({N, D, M, gate_cols, salt, 4}), g_lo, g_hi)};
}

template <class Phi>
Index gate_cols(const Phi& phi, Index D, bool per_feature) {
  return per_feature ? phi.feature_dim(D) : 1;
}

// ---------------------------------------------------------------------------------------------
// Kernel calls (one instantiation per map and scalar type)
// ---------------------------------------------------------------------------------------------

// The out + workspace + state overload on column-major matrices.
template <class S, class Phi>
Mat<S> run(const Phi& phi, const Mat<S>& Q, const Mat<S>& K, const Mat<S>& V, const Mat<S>& G,
           const GatedOptions& o, State<S>& st) {
  Mat<S> out(Q.rows(), V.cols());
  linattn::Workspace<S> ws;
  linattn::gated_linear_attention(Q, K, V, G, phi, st, out, ws, o);
  return out;
}

template <class S, class Phi>
Mat<S> run(const Phi& phi, const Case& c, const GatedOptions& o, State<S>& st) {
  return run<S>(phi, Mat<S>(c.Q.cast<S>()), Mat<S>(c.K.cast<S>()), Mat<S>(c.V.cast<S>()),
                Mat<S>(c.G.cast<S>()), o, st);
}

template <class S, class Phi>
Mat<S> run(const Phi& phi, const Case& c, const GatedOptions& o) {
  State<S> st;
  return run<S>(phi, c, o, st);
}

// A kernel state as a reference state (high + low parts, in double).
template <class S>
gref::State to_ref(const State<S>& s) {
  gref::State r;
  r.S = s.S.template cast<double>();
  if (s.S_lo.rows() == s.S.rows() && s.S_lo.cols() == s.S.cols()) r.S += s.S_lo.template cast<double>();
  r.z = s.z.template cast<double>();
  if (s.z_lo.size() == s.z.size()) r.z += s.z_lo.template cast<double>();
  r.log_decay = s.log_decay.template cast<double>();
  return r;
}

double rel(const test::CRefD& a, const test::CRefD& b) { return gref::relative_error(a, b); }
template <class S>
MatD dbl(const Mat<S>& m) {
  return m.template cast<double>();
}

// ---------------------------------------------------------------------------------------------
// The references agree with each other and with a case worked by hand
// ---------------------------------------------------------------------------------------------

TEST(gated_reference, RecurrenceEqualsQuadraticForm) {
  double worst = 0;
  for (const bool per_feature : {false, true})
    for (const bool normalize : {false, true}) {
      const Index N = 40, D = 4, M = 3;
      const Case c = make_case(N, D, M, per_feature ? D : 1, 7, -0.8, 0.0);
      const Case prefix = make_case(9, D, M, per_feature ? D : 1, 8, -0.8, 0.0);
      const gref::Options o = ref_options(normalize, 0.7);
      const auto check = [&](const auto& phi) {
        gref::State st;
        gref::recurrence(prefix.Q, prefix.K, prefix.V, prefix.G, phi, o, &st);
        const gref::State initial = st;
        const MatD a = gref::recurrence(c.Q, c.K, c.V, c.G, phi, o, &st);
        const MatD b = gref::quadratic(c.Q, c.K, c.V, c.G, phi, o, &initial);
        const double e = rel(a, b);
        EXPECT_LE(e, 1e-14) << map_name(phi) << " " << gate_name(per_feature) << " normalize=" << normalize;
        worst = std::max(worst, e);
        // log_decay: column sums over both calls.
        const Eigen::VectorXd sums = prefix.G.colwise().sum().transpose() + c.G.colwise().sum().transpose();
        EXPECT_LE(test::max_abs_diff(st.log_decay, sums), 1e-12);
      };
      check(EluPlusOne{});
      check(SiluL2{});
    }
  test::report_error("reference recurrence vs O(N^2) form (double)", worst);
}

TEST(gated_reference, WorkedByHand) {
  // N = 2, D = M = 1, Identity: out_1 = s q1 k1 v1, out_2 = s q2 (a2 k1 v1 + k2 v2).
  MatD Q(2, 1), K(2, 1), V(2, 1), G(2, 1);
  Q << 2, 3;
  K << 0.5, -1;
  V << 4, 5;
  G << -0.3, std::log(0.25);
  const MatD out = gref::quadratic(Q, K, V, G, Identity{}, ref_options(false, 0.5));
  EXPECT_NEAR(out(0, 0), 0.5 * 2 * 0.5 * 4, 1e-15);
  EXPECT_NEAR(out(1, 0), 0.5 * 3 * (0.25 * 0.5 * 4 + (-1) * 5), 1e-14);
  const MatD rec = gref::recurrence(Q, K, V, G, Identity{}, ref_options(false, 0.5));
  EXPECT_LE(test::max_abs_diff(rec, out), 1e-15);
  // Per-feature, D = 2: the gate acts inside the dot product.
  MatD Q2(2, 2), K2(2, 2), V2(2, 1), G2(2, 2);
  Q2 << 1, 2, 3, 4;
  K2 << 5, 6, 7, 8;
  V2 << 1, 10;
  G2 << 0, 0, std::log(0.5), std::log(0.25);
  const MatD o2 = gref::quadratic(Q2, K2, V2, G2, Identity{}, ref_options(false));
  EXPECT_NEAR(o2(1, 0), (3 * 5 * 0.5 + 4 * 6 * 0.25) * 1 + (3 * 7 + 4 * 8) * 10, 1e-12);
  // Normalised, initial state (S0, z0) decays like S.
  gref::State init;
  init.S = MatD::Constant(1, 1, 2.0);
  init.z = Eigen::VectorXd::Constant(1, 4.0);
  MatD G1(1, 1);
  G1 << std::log(0.5);
  const MatD o3 = gref::quadratic(MatD::Constant(1, 1, 1.0), MatD::Constant(1, 1, 1.0),
                                  MatD::Constant(1, 1, 3.0), G1, Identity{}, ref_options(true), &init);
  EXPECT_NEAR(o3(0, 0), (0.5 * 2 + 3) / (0.5 * 4 + 1), 1e-15);
}

// ---------------------------------------------------------------------------------------------
// Against the references: every map, gate kind, algorithm, shape, scalar type
// ---------------------------------------------------------------------------------------------

struct Shape3 {
  Index N, D, M;
};
const std::vector<Shape3>& forward_shapes() {
  static const std::vector<Shape3> list = {{1, 5, 3}, {1, 16, 24}, {3, 1, 2},   {7, 5, 3},
                                           {50, 16, 24}, {130, 5, 3}, {333, 16, 24}};
  return list;
}

struct Worst {
  double ref = 0, agree = 0, state = 0;
};

template <class S, class Phi>
void check_forward(const Phi& phi, const Case& c, const MatD& ref, const gref::State& ref_state,
                   const std::string& tag, Worst& worst) {
  const bool norm = normalizes(phi);
  const double scale = std::max(test::max_abs(ref), 1e-300);
  const double s_scale = std::max(test::max_abs(ref_state.S), 1e-300);
  const Eigen::VectorXd sums = c.G.colwise().sum().transpose();
  Mat<S> recurrent;
  {
    State<S> st;
    recurrent = run<S>(phi, c, options({CausalAlgorithm::Recurrent, 0, ""}, norm), st);
  }
  for (const Algo& a : algos()) {
    State<S> st;
    const Mat<S> out = run<S>(phi, c, options(a, norm), st);
    const std::string what = tag + " " + a.name + " " + test::scalar_name<S>();
    ASSERT_EQ(out.rows(), c.N()) << what;
    ASSERT_EQ(out.cols(), c.M()) << what;
    const double e = rel(dbl(out), ref);
    EXPECT_LE(e, ref_bound<S>()) << what << ": against the reference";
    worst.ref = std::max(worst.ref, e);
    const double ea = test::max_abs_diff(out, recurrent) / scale;
    EXPECT_LE(ea, agree_bound<S>()) << what << ": against Recurrent";
    worst.agree = std::max(worst.agree, ea);
    // The final state and the total log-decay.
    ASSERT_EQ(st.S.rows(), phi.feature_dim(c.D())) << what;
    ASSERT_EQ(st.S.cols(), c.M()) << what;
    const gref::State got = to_ref(st);
    const double es = test::max_abs_diff(got.S, ref_state.S) / s_scale;
    EXPECT_LE(es, ref_bound<S>()) << what << ": final state S";
    worst.state = std::max(worst.state, es);
    if (norm) {
      const double ez = test::max_abs_diff(got.z, ref_state.z) / std::max(test::max_abs(ref_state.z), 1e-300);
      EXPECT_LE(ez, ref_bound<S>()) << what << ": final state z";
      worst.state = std::max(worst.state, ez);
    }
    ASSERT_EQ(st.log_decay.size(), c.G.cols()) << what << ": log_decay size";
    EXPECT_LE(test::max_abs_diff(got.log_decay, sums),
              4 * std::numeric_limits<S>::epsilon() * (1 + sums.cwiseAbs().maxCoeff()) * c.N())
        << what << ": log_decay";
  }
}

template <class Phi>
void check_forward_all(const Phi& phi, bool per_feature) {
  [[maybe_unused]] Worst wf, wd;
  const bool norm = normalizes(phi);
  for (const Shape3& sh : forward_shapes()) {
    const Case c = make_case(sh.N, sh.D, sh.M, gate_cols(phi, sh.D, per_feature), 11);
    const gref::Options o = ref_options(norm);
    const MatD ref = gref::quadratic(c.Q, c.K, c.V, c.G, phi, o);
    const gref::State ref_state = gref::final_state(c.Q, c.K, c.V, c.G, phi, o);
    const std::string tag = std::string(map_name(phi)) + " " + gate_name(per_feature) +
                            " N=" + std::to_string(sh.N) + " D=" + std::to_string(sh.D) +
                            " M=" + std::to_string(sh.M);
    IF_FLOAT(check_forward<float>(phi, c, ref, ref_state, tag, wf));
    IF_DOUBLE(check_forward<double>(phi, c, ref, ref_state, tag, wd));
  }
  const std::string what = std::string(map_name(phi)) + " " + gate_name(per_feature);
  IF_FLOAT(test::report_error(what + " float vs reference", wf.ref));
  IF_DOUBLE(test::report_error(what + " double vs reference", wd.ref));
  IF_FLOAT(test::report_error(what + " float chunked vs recurrent", wf.agree));
  IF_DOUBLE(test::report_error(what + " double chunked vs recurrent", wd.agree));
  IF_FLOAT(test::report_error(what + " float final state", wf.state));
  IF_DOUBLE(test::report_error(what + " double final state", wd.state));
}

TEST(gated_forward, ScalarGatesMatchReference) {
  check_forward_all(Identity{}, false);
  check_forward_all(Silu{}, false);
  check_forward_all(SiluL2{}, false);
  check_forward_all(EluPlusOne{}, false);
}

TEST(gated_forward, PerFeatureGatesMatchReference) {
  check_forward_all(Identity{}, true);
  check_forward_all(Silu{}, true);
  check_forward_all(SiluL2{}, true);
  check_forward_all(EluPlusOne{}, true);
}

// Scalar gates are per-feature gates with equal columns.
TEST(gated_forward, ScalarGateEqualsRepeatedPerFeatureGate) {
  const Case c = make_case(90, 6, 5, 1, 12);
  Case p = c;
  p.G = c.G.replicate(1, 6);
  for (const Algo& a : algos()) {
    const Mat<double> s = run<double>(Identity{}, c, options(a, false));
    const Mat<double> f = run<double>(Identity{}, p, options(a, false));
    EXPECT_LE(test::max_abs_diff(s, f) / test::max_abs(s), kAgreeDouble) << a.name;
  }
}

// ---------------------------------------------------------------------------------------------
// Carried state
// ---------------------------------------------------------------------------------------------

template <class S, class Phi>
void check_pieces(const Phi& phi, bool per_feature, double& worst_pieces, double& worst_ref) {
  const Index N = 150, D = 5, M = 7;
  const bool norm = normalizes(phi);
  const Case c = make_case(N, D, M, gate_cols(phi, D, per_feature), 13);
  for (const Algo& a : {Algo{CausalAlgorithm::Chunked, 7, "Chunked C=7"},
                        Algo{CausalAlgorithm::Chunked, 0, "Chunked default"},
                        Algo{CausalAlgorithm::Recurrent, 0, "Recurrent"},
                        Algo{CausalAlgorithm::Auto, 0, "Auto"}}) {
    const GatedOptions o = options(a, norm);
    State<S> one;
    const Mat<S> whole = run<S>(phi, c, o, one);
    const double scale = test::max_abs(whole);
    for (const Index split : {Index(0), Index(1), Index(20), Index(64), Index(149), N}) {
      const std::string what = std::string(map_name(phi)) + " " + gate_name(per_feature) + " " +
                               a.name + " " + test::scalar_name<S>() + " split at " + std::to_string(split);
      State<S> st;
      const Mat<S> first = run<S>(phi, c.rows(0, split), o, st);
      const gref::State mid = to_ref(st);
      const Mat<S> second = run<S>(phi, c.rows(split, N - split), o, st);
      Mat<S> both(N, M);
      both << first, second;
      const double e = test::max_abs_diff(both, whole) / scale;
      EXPECT_LE(e, agree_bound<S>()) << what;
      worst_pieces = std::max(worst_pieces, e);
      EXPECT_LE(test::max_abs_diff(st.S, one.S) / std::max(test::max_abs(one.S), 1e-300), agree_bound<S>())
          << what << ": final S";
      ASSERT_EQ(st.log_decay.size(), c.G.cols()) << what;
      EXPECT_LE(test::max_abs_diff(st.log_decay, one.log_decay),
                8 * std::numeric_limits<S>::epsilon() * (1 + test::max_abs(one.log_decay)))
          << what << ": log_decay";
      // The second piece against the reference started from the first piece's state (the state
      // as the kernel left it, so only the second call's rounding counts).
      if (split > 0 && split < N) {
        const Case b = c.rows(split, N - split);
        const MatD ref = gref::quadratic(b.Q, b.K, b.V, b.G, phi, ref_options(norm), &mid);
        const double er = rel(dbl(second), ref);
        EXPECT_LE(er, ref_bound<S>()) << what << ": second piece against the reference";
        worst_ref = std::max(worst_ref, er);
        if (::testing::Test::HasFailure() && er > ref_bound<S>()) return;
      }
    }
  }
}

TEST(gated_forward, TwoPiecesEqualOneShot) {
  [[maybe_unused]] double pf = 0, pd = 0, rf = 0, rd = 0;
  for (const bool pfg : {false, true}) {
    IF_FLOAT(check_pieces<float>(Identity{}, pfg, pf, rf));
    IF_DOUBLE(check_pieces<double>(Identity{}, pfg, pd, rd));
    IF_FLOAT(check_pieces<float>(Silu{}, pfg, pf, rf));
    IF_DOUBLE(check_pieces<double>(Silu{}, pfg, pd, rd));
    IF_FLOAT(check_pieces<float>(SiluL2{}, pfg, pf, rf));
    IF_DOUBLE(check_pieces<double>(SiluL2{}, pfg, pd, rd));
    IF_FLOAT(check_pieces<float>(EluPlusOne{}, pfg, pf, rf));
    IF_DOUBLE(check_pieces<double>(EluPlusOne{}, pfg, pd, rd));
  }
  IF_FLOAT(test::report_error("pieces vs one shot, float", pf));
  IF_DOUBLE(test::report_error("pieces vs one shot, double", pd));
  IF_FLOAT(test::report_error("continued from a state vs reference, float", rf));
  IF_DOUBLE(test::report_error("continued from a state vs reference, double", rd));
}

// The returning overloads (without and with a state) equal the out + workspace overload.
TEST(gated_forward, ReturningOverloads) {
  const Case c = make_case(70, 5, 3, 5, 14);
  const Mat<float> Q = c.Q.cast<float>(), K = c.K.cast<float>(), V = c.V.cast<float>(),
                   G = c.G.cast<float>();
  State<float> st0;
  const Mat<float> base = run<float>(Identity{}, Q, K, V, G, GatedOptions{}, st0);
  const Mat<float> a = linattn::gated_linear_attention(Q, K, V, G);  // Identity, default options
  EXPECT_LE(test::max_abs_diff(a, base), 0.0);
  const Mat<float> b = linattn::gated_linear_attention(Q, K, V, G, Identity{}, GatedOptions{});
  EXPECT_LE(test::max_abs_diff(b, base), 0.0);
  State<float> st;
  const Mat<float> d = linattn::gated_linear_attention(Q, K, V, G, Identity{}, st, GatedOptions{});
  EXPECT_LE(test::max_abs_diff(d, base), 0.0);
  EXPECT_TRUE(test::same_bits(st.S, st0.S));
  EXPECT_TRUE(test::same_bits(st.log_decay, st0.log_decay));
}

// ---------------------------------------------------------------------------------------------
// Special cases: no decay, the scale
// ---------------------------------------------------------------------------------------------

// log_gates = 0 with normalize = true is causal linear attention (spec §9.1).
template <class S>
void check_zero_gates(bool per_feature, double& worst) {
  for (const Shape3& sh : {Shape3{1, 4, 3}, Shape3{97, 8, 5}, Shape3{300, 16, 16}}) {
    Case c = make_case(sh.N, sh.D, sh.M, per_feature ? sh.D : 1, 15);
    c.G.setZero();
    const Mat<S> Q = c.Q.cast<S>(), K = c.K.cast<S>(), V = c.V.cast<S>();
    const Mat<S> causal = linattn::causal_linear_attention(Q, K, V, EluPlusOne{});
    for (const Algo& a : algos()) {
      const Mat<S> out = run<S>(EluPlusOne{}, c, options(a, true));
      const double e = test::max_abs_diff(out, causal) / test::max_abs(causal);
      EXPECT_LE(e, agree_bound<S>()) << a.name << " " << gate_name(per_feature) << " "
                                     << test::scalar_name<S>() << " N=" << sh.N;
      worst = std::max(worst, e);
    }
  }
}

TEST(gated_forward, ZeroGatesNormalizedEqualCausalLinearAttention) {
  [[maybe_unused]] double wf = 0, wd = 0;
  for (const bool pf : {false, true}) {
    IF_FLOAT(check_zero_gates<float>(pf, wf));
    IF_DOUBLE(check_zero_gates<double>(pf, wd));
  }
  IF_FLOAT(test::report_error("log_gates = 0, normalize vs causal_linear_attention, float", wf));
  IF_DOUBLE(test::report_error("log_gates = 0, normalize vs causal_linear_attention, double", wd));
}

TEST(gated_forward, ScaleOption) {
  const Index N = 100, D = 16, M = 8;
  const double s = 1.0 / std::sqrt(double(D));
  for (const bool pf : {false, true}) {
    const Case c = make_case(N, D, M, pf ? D : 1, 16);
    const MatD ref = gref::quadratic(c.Q, c.K, c.V, c.G, Silu{}, ref_options(false, s));
    for (const Algo& a : algos()) {
      const Mat<double> out = run<double>(Silu{}, c, options(a, false, s));
      EXPECT_LE(rel(out, ref), kRefDouble) << a.name << " " << gate_name(pf);
      const Mat<float> outf = run<float>(Silu{}, c, options(a, false, s));
      EXPECT_LE(rel(dbl(outf), ref), kRefFloat) << a.name << " " << gate_name(pf);
      // normalize = true ignores the scale.
      const Mat<double> n1 = run<double>(EluPlusOne{}, c, options(a, true, 1.0));
      const Mat<double> n2 = run<double>(EluPlusOne{}, c, options(a, true, 0.3));
      EXPECT_LE(test::max_abs_diff(n1, n2) / test::max_abs(n1), 4 * std::numeric_limits<double>::epsilon())
          << a.name << " " << gate_name(pf) << ": normalize = true must ignore the scale";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// RecurrentGatedAttention
// ---------------------------------------------------------------------------------------------

template <class Phi, class S>
linattn::RecurrentGatedAttention<Phi, S> make_decoder(const Phi& phi, Index D, Index M,
                                                      const GatedOptions& o) {
  if constexpr (std::is_same_v<Phi, Identity>) {
    (void)phi;
    return linattn::RecurrentGatedAttention<Phi, S>(D, M, o);
  } else {
    return linattn::RecurrentGatedAttention<Phi, S>(D, M, phi, o);
  }
}

template <class S, class Phi>
void check_decoder(const Phi& phi, bool per_feature, double& worst) {
  const Index N = 90, D = 6, M = 4;
  const bool norm = normalizes(phi);
  const Case c = make_case(N, D, M, gate_cols(phi, D, per_feature), 17);
  const GatedOptions o = options({CausalAlgorithm::Auto, 0, ""}, norm, norm ? 1.0 : 0.5);
  State<S> par_state;
  const Mat<S> par = run<S>(phi, c, o, par_state);
  const double scale = test::max_abs(par);
  const Mat<S> Q = c.Q.cast<S>(), K = c.K.cast<S>(), V = c.V.cast<S>(), G = c.G.cast<S>();
  const std::string tag = std::string(map_name(phi)) + " " + gate_name(per_feature) + " " +
                          test::scalar_name<S>();

  auto rnn = make_decoder<Phi, S>(phi, D, M, o);
  EXPECT_EQ(rnn.key_dim(), D);
  EXPECT_EQ(rnn.value_dim(), M);
  EXPECT_EQ(rnn.feature_dim(), phi.feature_dim(D));
  // Row-vector inputs (rows of the column-major inputs: strided), a column-vector output.
  Vec<S> out(M);
  Mat<S> steps(N, M);
  for (Index t = 0; t < N; ++t) {
    rnn.step(Q.row(t), K.row(t), V.row(t), G.row(t), out);
    steps.row(t) = out.transpose();
  }
  double e = test::max_abs_diff(steps, par) / scale;
  EXPECT_LE(e, agree_bound<S>()) << tag << ": steps (row vectors) against the parallel call";
  worst = std::max(worst, e);
  const State<S>& st = rnn.state();
  EXPECT_LE(test::max_abs_diff(to_ref(st).S, to_ref(par_state).S) / test::max_abs(par_state.S), agree_bound<S>())
      << tag << ": state()";
  // The decoder keeps F entries (a scalar decay's total in each); the parallel call keeps the
  // gates' width (1 or F).
  const auto decay_as_features = [&](const State<S>& p) {
    Vec<S> f(st.log_decay.size());
    if (p.log_decay.size() == 1) f.setConstant(p.log_decay(0)); else f = p.log_decay;
    return f;
  };
  ASSERT_EQ(st.log_decay.size(), rnn.feature_dim()) << tag;
  EXPECT_LE(test::max_abs_diff(st.log_decay, decay_as_features(par_state)),
            8 * std::numeric_limits<S>::epsilon() * (1 + test::max_abs(par_state.log_decay)))
      << tag << ": state().log_decay";

  // Column-vector inputs (contiguous copies); reset() starts over.
  rnn.reset();
  Vec<S> q(D), k(D), v(M), g(G.cols());
  for (Index t = 0; t < N; ++t) {
    q = Q.row(t).transpose();
    k = K.row(t).transpose();
    v = V.row(t).transpose();
    g = G.row(t).transpose();
    rnn.step(q, k, v, g, out);
    steps.row(t) = out.transpose();
  }
  e = test::max_abs_diff(steps, par) / scale;
  EXPECT_LE(e, agree_bound<S>()) << tag << ": steps (column vectors) after reset()";
  worst = std::max(worst, e);

  // set_state() from a parallel prefill of the first 40 tokens, then decode the rest.
  const Index P = 40;
  State<S> pre;
  run<S>(phi, c.rows(0, P), o, pre);
  rnn.set_state(pre);
  for (Index t = P; t < N; ++t) {
    rnn.step(Q.row(t), K.row(t), V.row(t), G.row(t), out);
    steps.row(t) = out.transpose();
  }
  e = test::max_abs_diff(steps.bottomRows(N - P), par.bottomRows(N - P)) / scale;
  EXPECT_LE(e, agree_bound<S>()) << tag << ": decode after set_state()";
  worst = std::max(worst, e);
  EXPECT_LE(test::max_abs_diff(rnn.state().log_decay, decay_as_features(par_state)),
            8 * std::numeric_limits<S>::epsilon() * (1 + test::max_abs(par_state.log_decay)))
      << tag << ": log_decay after set_state() and steps";

  // No allocation per step (Eigen's and operator new): the first step after reset() (the
  // object then holds no token, as after construction), and the steps after it.
  rnn.reset();
  const auto load = [&](Index t) {
    q = Q.row(t).transpose();
    k = K.row(t).transpose();
    v = V.row(t).transpose();
    g = G.row(t).transpose();
  };
  load(0);
  const test::Allocations first = test::allocations_in([&] { rnn.step(q, k, v, g, out); });
  EXPECT_EQ(first.eigen, 0) << tag << ": Eigen allocations in the first step after reset()";
  EXPECT_EQ(first.news, 0) << tag << ": operator new calls in the first step after reset()";
  const test::Allocations later = test::allocations_in([&] {
    for (Index t = 1; t < N; ++t) {
      load(t);
      rnn.step(q, k, v, g, out);
    }
  });
  EXPECT_EQ(later.eigen, 0) << tag << ": Eigen allocations in steps 2.." << N;
  EXPECT_EQ(later.news, 0) << tag << ": operator new calls in steps 2.." << N;
}

TEST(gated_recurrent, StepsEqualParallelCall) {
  [[maybe_unused]] double wf = 0, wd = 0;
  for (const bool pf : {false, true}) {
    IF_FLOAT(check_decoder<float>(Identity{}, pf, wf));
    IF_DOUBLE(check_decoder<double>(Identity{}, pf, wd));
    IF_FLOAT(check_decoder<float>(Silu{}, pf, wf));
    IF_DOUBLE(check_decoder<double>(Silu{}, pf, wd));
    IF_FLOAT(check_decoder<float>(SiluL2{}, pf, wf));
    IF_DOUBLE(check_decoder<double>(SiluL2{}, pf, wd));
    IF_FLOAT(check_decoder<float>(EluPlusOne{}, pf, wf));
    IF_DOUBLE(check_decoder<double>(EluPlusOne{}, pf, wd));
  }
  IF_FLOAT(test::report_error("RecurrentGatedAttention steps vs parallel, float", wf));
  IF_DOUBLE(test::report_error("RecurrentGatedAttention steps vs parallel, double", wd));
}

TEST(gated_recurrent, NoMallocDetectorWorks) { eigen_hook::expect_detector_works(); }

TEST(gated_recurrent, StepChecksSizes) {
  linattn::RecurrentGatedAttention<Identity, float> rnn(4, 3);
  Vec<float> q4 = Vec<float>::Ones(4), q5 = Vec<float>::Ones(5), v3 = Vec<float>::Ones(3),
             v2 = Vec<float>::Ones(2), g1 = Vec<float>::Constant(1, -0.1f),
             g4 = Vec<float>::Constant(4, -0.1f), g3 = Vec<float>::Constant(3, -0.1f), out3(3), out4(4);
  const std::string fn = "RecurrentGatedAttention";
  test::expect_invalid([&] { rnn.step(q5, q4, v3, g1, out3); }, fn, "q size");
  test::expect_invalid([&] { rnn.step(q4, q5, v3, g1, out3); }, fn, "k size");
  test::expect_invalid([&] { rnn.step(q4, q4, v2, g1, out3); }, fn, "v size");
  test::expect_invalid([&] { rnn.step(q4, q4, v3, g3, out3); }, fn, "gate size");
  test::expect_invalid([&] { rnn.step(q4, q4, v3, g1, out4); }, fn, "out size");
  // Both gate sizes are accepted.
  EXPECT_NO_THROW(rnn.step(q4, q4, v3, g1, out3));
  EXPECT_NO_THROW(rnn.step(q4, q4, v3, g4, out3));
}

// The decode step checks its log gates' values as the parallel kernels do (finite and <= 0),
// naming the entry, the value and the token, and leaves the decoder as it was; set_state()
// refuses a negative position and a log_decay no sum of such gates gives (NaN, +inf, > 0).
TEST(gated_recurrent, StepAndSetStateCheckValues) {
  linattn::RecurrentGatedAttention<Identity, float> rnn(4, 3);
  const Vec<float> q = Vec<float>::LinSpaced(4, -1, 1), v = Vec<float>::Ones(3);
  Vec<float> out(3);
  rnn.step(q, q, v, -0.25f, out);
  const State<float> before = rnn.state();
  const std::string fn = "linattn::RecurrentGatedAttention::step: ";
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const float g : {1e-30f, 0.5f, inf, -inf, nan}) {
    test::expect_invalid([&] { rnn.step(q, q, v, g, out); },
                         {fn + "log_gate = ", " (token 1): log gates must be finite and <= 0"},
                         "scalar gate " + std::to_string(g));
    Vec<float> gates = Vec<float>::Constant(4, -0.1f);
    gates(2) = g;
    test::expect_invalid([&] { rnn.step(q, q, v, gates, out); },
                         {fn + "log_gate(2) = ", " (token 1): log gates must be finite and <= 0"},
                         "per-feature gate " + std::to_string(g));
  }
  test::expect_invalid([&] { rnn.step(q, q, v, 0.5f, out); }, "log_gate = 0.5", "the value");
  EXPECT_EQ(rnn.position(), 1);
  EXPECT_TRUE(test::same_state(rnn.state(), before));
  EXPECT_TRUE(test::same_bits(rnn.state().log_decay, before.log_decay));
  // The edges are gates: 0, -0 and a very negative (finite) one.
  for (const float g : {0.0f, -0.0f, -1e30f}) EXPECT_NO_THROW(rnn.step(q, q, v, g, out));
  // state() is the decoder's own state, as documented: a reference follows the steps.
  const State<float>& live = rnn.state();
  linattn::RecurrentGatedAttention<Identity, float> twin = rnn;
  rnn.step(q, q, v, -0.5f, out);
  twin.step(q, q, v, -0.5f, out);
  EXPECT_TRUE(test::same_state(live, twin.state()));
  EXPECT_FALSE(test::same_bits(live.S, before.S));

  const std::string set = "RecurrentGatedAttention::set_state";
  test::expect_invalid([&] { rnn.set_state(before, -3); },
                       {set, "position = -3: a decoding position counts tokens"}, "position");
  for (const float ld : {1e-30f, 0.5f, inf, nan}) {
    State<float> bad = before;
    bad.log_decay(1) = ld;
    test::expect_invalid([&] { rnn.set_state(bad, 4); },
                         {set, "the state's log_decay(1) = ", ": a total log-decay is a sum of "
                                                              "log gates <= 0"},
                         "log_decay " + std::to_string(ld));
  }
  EXPECT_EQ(rnn.position(), 5);
  State<float> reset = before;  // -inf: a sum of finite gates that overflowed
  reset.log_decay(1) = -inf;
  rnn.set_state(reset, 7);
  EXPECT_EQ(rnn.position(), 7);
  EXPECT_EQ(rnn.state().log_decay(1), -inf);
}

// ---------------------------------------------------------------------------------------------
// Multi-head and batched
// ---------------------------------------------------------------------------------------------

// Head h of packed matrices (columns [h·w, (h+1)·w)).
MatD head_cols(const MatD& x, Index h, Index w) { return x.middleCols(h * w, w); }

template <class S, class Phi>
void check_multihead(const Phi& phi, bool per_feature, double& worst_same, double& worst_ref) {
  const Index H = 3, N = 70, D = 5, M = 4;
  const Index F = phi.feature_dim(D), GC = per_feature ? F : 1;
  const bool norm = normalizes(phi);
  const Case c = make_case(N, H * D, H * M, H * GC, 18);
  // make_case draws V as N x H·M: reuse its seeds by shape.
  const std::string tag = std::string(map_name(phi)) + " " + gate_name(per_feature) + " " +
                          test::scalar_name<S>();
  for (const Algo& a : {Algo{CausalAlgorithm::Chunked, 16, "Chunked C=16"},
                        Algo{CausalAlgorithm::Recurrent, 0, "Recurrent"}}) {
    const GatedOptions o = options(a, norm, norm ? 1.0 : 0.4);
    linattn::ParallelOptions par;
    par.num_threads = 2;
    const Mat<S> Q = c.Q.cast<S>(), K = c.K.cast<S>(), V = c.V.cast<S>(), G = c.G.cast<S>();
    const Mat<S> out = linattn::multihead_gated_linear_attention(Q, K, V, G, H, phi, o, par);
    ASSERT_EQ(out.rows(), N);
    ASSERT_EQ(out.cols(), H * M);
    std::vector<State<S>> single_states(H);
    for (Index h = 0; h < H; ++h) {
      const Case ch{head_cols(c.Q, h, D), head_cols(c.K, h, D), head_cols(c.V, h, M),
                    head_cols(c.G, h, GC)};
      const Mat<S> single = run<S>(phi, ch, o, single_states[h]);
      const double e = test::max_abs_diff(out.middleCols(h * M, M), single) / test::max_abs(single);
      EXPECT_LE(e, same_bound<S>()) << tag << " " << a.name << " head " << h;
      worst_same = std::max(worst_same, e);
      const MatD ref = gref::quadratic(ch.Q, ch.K, ch.V, ch.G, phi, ref_options(norm, o.scale));
      const double er = rel(dbl(Mat<S>(out.middleCols(h * M, M))), ref);
      EXPECT_LE(er, ref_bound<S>()) << tag << " " << a.name << " head " << h << " vs reference";
      worst_ref = std::max(worst_ref, er);
    }
    // States in and out: two pieces through the out + workspace overload equal the one shot,
    // and each head's final state equals the single call's.
    const Index split = 29;
    std::vector<State<S>> states;  // empty: zeros
    linattn::MultiHeadWorkspace<S> ws;
    Mat<S> first(split, H * M), second(N - split, H * M);
    linattn::multihead_gated_linear_attention(Mat<S>(Q.topRows(split)), Mat<S>(K.topRows(split)),
                                              Mat<S>(V.topRows(split)), Mat<S>(G.topRows(split)), H,
                                              phi, states, first, ws, o, par);
    ASSERT_EQ(states.size(), std::size_t(H));
    linattn::multihead_gated_linear_attention(
        Mat<S>(Q.bottomRows(N - split)), Mat<S>(K.bottomRows(N - split)), Mat<S>(V.bottomRows(N - split)),
        Mat<S>(G.bottomRows(N - split)), H, phi, states, second, ws, o, par);
    Mat<S> both(N, H * M);
    both << first, second;
    const double ep = test::max_abs_diff(both, out) / test::max_abs(out);
    EXPECT_LE(ep, agree_bound<S>()) << tag << " " << a.name << ": pieces with states";
    for (Index h = 0; h < H; ++h) {
      EXPECT_LE(test::max_abs_diff(to_ref(states[h]).S, to_ref(single_states[h]).S) /
                    test::max_abs(single_states[h].S),
                agree_bound<S>())
          << tag << " " << a.name << ": state of head " << h;
      EXPECT_LE(test::max_abs_diff(states[h].log_decay, single_states[h].log_decay),
                8 * std::numeric_limits<S>::epsilon() * (1 + test::max_abs(single_states[h].log_decay)))
          << tag << " " << a.name << ": log_decay of head " << h;
    }
    // The out + workspace overload without states equals the returning one.
    Mat<S> out2(N, H * M);
    linattn::multihead_gated_linear_attention(Q, K, V, G, H, phi, out2, ws, o, par);
    EXPECT_LE(test::max_abs_diff(out2, out), 0.0) << tag << " " << a.name << ": out + workspace overload";
  }
}

TEST(gated_multihead, EqualsPerHeadSingleCalls) {
  [[maybe_unused]] double sf = 0, sd = 0, rf = 0, rd = 0;
  for (const bool pf : {false, true}) {
    IF_FLOAT(check_multihead<float>(Identity{}, pf, sf, rf));
    IF_DOUBLE(check_multihead<double>(Identity{}, pf, sd, rd));
    IF_FLOAT(check_multihead<float>(EluPlusOne{}, pf, sf, rf));
    IF_DOUBLE(check_multihead<double>(EluPlusOne{}, pf, sd, rd));
  }
  IF_FLOAT(test::report_error("multihead vs per-head single calls, float", sf));
  IF_DOUBLE(test::report_error("multihead vs per-head single calls, double", sd));
  IF_FLOAT(test::report_error("multihead vs reference, float", rf));
  IF_DOUBLE(test::report_error("multihead vs reference, double", rd));
}

template <class S, class Phi>
void check_batched(const Phi& phi, bool per_feature, double& worst) {
  const Index H = 2, D = 5, M = 3;
  const std::vector<Index> offsets = {0, 5, 5, 40, 97};
  const std::vector<std::int32_t> offsets32(offsets.begin(), offsets.end());
  const Index B = Index(offsets.size()) - 1, N = offsets.back();
  const Index F = phi.feature_dim(D), GC = per_feature ? F : 1;
  const bool norm = normalizes(phi);
  const Case c1 = make_case(N, H * D, H * M, H * GC, 19);
  const Case c2 = make_case(N, H * D, H * M, H * GC, 20);  // the continuation of every sequence
  const std::string tag = std::string(map_name(phi)) + " " + gate_name(per_feature) + " " +
                          test::scalar_name<S>();
  for (const Algo& a : {Algo{CausalAlgorithm::Chunked, 8, "Chunked C=8"},
                        Algo{CausalAlgorithm::Recurrent, 0, "Recurrent"},
                        Algo{CausalAlgorithm::Auto, 0, "Auto"}}) {
    const GatedOptions o = options(a, norm);
    linattn::ParallelOptions par;
    par.num_threads = 2;
    linattn::MultiHeadWorkspace<S> ws;
    // Without states.
    Mat<S> out(N, H * M);
    linattn::batched_gated_linear_attention(Mat<S>(c1.Q.cast<S>()), Mat<S>(c1.K.cast<S>()),
                                            Mat<S>(c1.V.cast<S>()), Mat<S>(c1.G.cast<S>()), offsets, H,
                                            phi, out, ws, o, par);
    // With states, two calls (the second continues every sequence).
    std::vector<State<S>> states;
    Mat<S> out1(N, H * M), out2(N, H * M);
    linattn::batched_gated_linear_attention(Mat<S>(c1.Q.cast<S>()), Mat<S>(c1.K.cast<S>()),
                                            Mat<S>(c1.V.cast<S>()), Mat<S>(c1.G.cast<S>()), offsets32,
                                            H, phi, states, out1, ws, o, par);
    ASSERT_EQ(states.size(), std::size_t(B * H)) << tag;
    linattn::batched_gated_linear_attention(Mat<S>(c2.Q.cast<S>()), Mat<S>(c2.K.cast<S>()),
                                            Mat<S>(c2.V.cast<S>()), Mat<S>(c2.G.cast<S>()), offsets32,
                                            H, phi, states, out2, ws, o, par);
    for (Index b = 0; b < B; ++b) {
      const Index r = offsets[b], n = offsets[b + 1] - offsets[b];
      for (Index h = 0; h < H; ++h) {
        const std::string what = tag + " " + a.name + " sequence " + std::to_string(b) + " head " +
                                 std::to_string(h);
        const auto slice = [&](const Case& c) {
          return Case{c.Q.block(r, h * D, n, D), c.K.block(r, h * D, n, D), c.V.block(r, h * M, n, M),
                      c.G.block(r, h * GC, n, GC)};
        };
        State<S> st;
        const Mat<S> s1 = run<S>(phi, slice(c1), o, st);
        const Mat<S> s2 = run<S>(phi, slice(c2), o, st);
        const double sc = std::max({test::max_abs(s1), test::max_abs(s2), 1e-30});
        const double e = std::max({test::max_abs_diff(out.block(r, h * M, n, M), s1),
                                   test::max_abs_diff(out1.block(r, h * M, n, M), s1),
                                   test::max_abs_diff(out2.block(r, h * M, n, M), s2)}) /
                         sc;
        EXPECT_LE(e, same_bound<S>()) << what;
        worst = std::max(worst, e);
        const State<S>& got = states[std::size_t(b * H + h)];
        if (n == 0) {  // an empty sequence: zero state (empty or sized)
          EXPECT_TRUE(got.S.size() == 0 || test::max_abs(got.S) == 0.0) << what;
          continue;
        }
        EXPECT_LE(test::max_abs_diff(to_ref(got).S, to_ref(st).S) / std::max(test::max_abs(st.S), 1e-30),
                  same_bound<S>())
            << what << ": state";
        EXPECT_LE(test::max_abs_diff(got.log_decay, st.log_decay),
                  8 * std::numeric_limits<S>::epsilon() * (1 + test::max_abs(st.log_decay)))
            << what << ": log_decay";
      }
    }
  }
}

TEST(gated_batched, EqualsPerSequenceSingleCalls) {
  [[maybe_unused]] double wf = 0, wd = 0;
  for (const bool pf : {false, true}) {
    IF_FLOAT(check_batched<float>(Identity{}, pf, wf));
    IF_DOUBLE(check_batched<double>(Identity{}, pf, wd));
    IF_FLOAT(check_batched<float>(EluPlusOne{}, pf, wf));
    IF_DOUBLE(check_batched<double>(EluPlusOne{}, pf, wd));
  }
  IF_FLOAT(test::report_error("batched vs per-sequence single calls, float", wf));
  IF_DOUBLE(test::report_error("batched vs per-sequence single calls, double", wd));
}

// ---------------------------------------------------------------------------------------------
// Layouts
// ---------------------------------------------------------------------------------------------

TEST(gated_layout, RowMajorMapsAndBlocksEqualColumnMajor) {
  const Index N = 150, D = 8, M = 6;
  double worst = 0;
  for (const bool pf : {false, true}) {
    const Case c = make_case(N, D, M, pf ? D : 1, 21);
    const Mat<float> Q = c.Q.cast<float>(), K = c.K.cast<float>(), V = c.V.cast<float>(),
                     G = c.G.cast<float>();
    for (const Algo& a : {Algo{CausalAlgorithm::Chunked, 0, "Chunked"},
                          Algo{CausalAlgorithm::Recurrent, 0, "Recurrent"}}) {
      const GatedOptions o = options(a, false, 0.5);
      const std::string what = std::string(gate_name(pf)) + " " + a.name;
      State<float> st0;
      const Mat<float> base = run<float>(Identity{}, Q, K, V, G, o, st0);
      const double sc = test::max_abs(base);
      // Row-major inputs and output.
      const RowMat<float> Qr = Q, Kr = K, Vr = V, Gr = G;
      RowMat<float> outr(N, M);
      State<float> st1;
      linattn::Workspace<float> ws;
      linattn::gated_linear_attention(Qr, Kr, Vr, Gr, Identity{}, st1, outr, ws, o);
      double e = test::max_abs_diff(Mat<float>(outr), base) / sc;
      EXPECT_LE(e, kSameFloat) << what << ": row-major";
      worst = std::max(worst, e);
      EXPECT_LE(test::max_abs_diff(st1.S, st0.S) / test::max_abs(st0.S), kSameFloat) << what << ": row-major state";
      // Blocks of larger matrices (inputs and output) and Maps.
      Mat<float> big = Mat<float>::Zero(N + 3, 2 * D + M + G.cols() + 4);
      big.block(2, 1, N, D) = Q;
      big.block(2, 1 + D, N, D) = K;
      big.block(2, 1 + 2 * D, N, M) = V;
      big.block(2, 1 + 2 * D + M, N, G.cols()) = G;
      Mat<float> bigout = Mat<float>::Zero(N + 2, M + 3);
      State<float> st2;
      linattn::gated_linear_attention(big.block(2, 1, N, D), big.block(2, 1 + D, N, D),
                                      big.block(2, 1 + 2 * D, N, M), big.block(2, 1 + 2 * D + M, N, G.cols()),
                                      Identity{}, st2, bigout.block(1, 2, N, M), ws, o);
      e = test::max_abs_diff(bigout.block(1, 2, N, M), base) / sc;
      EXPECT_LE(e, kSameFloat) << what << ": blocks";
      worst = std::max(worst, e);
      EXPECT_EQ(test::max_abs(bigout.leftCols(2)), 0.0) << what << ": wrote outside its block";
      EXPECT_EQ(test::max_abs(bigout.topRows(1)), 0.0) << what << ": wrote outside its block";
      const Eigen::Map<const Mat<float>> Qm(Q.data(), N, D), Km(K.data(), N, D), Vm(V.data(), N, M),
          Gm(G.data(), N, G.cols());
      const Mat<float> outm = linattn::gated_linear_attention(Qm, Km, Vm, Gm, Identity{}, o);
      e = test::max_abs_diff(outm, base) / sc;
      EXPECT_LE(e, kSameFloat) << what << ": Maps";
      worst = std::max(worst, e);
    }
  }
  test::report_error("row-major / blocks / Maps vs column-major, float", worst);
}

// ---------------------------------------------------------------------------------------------
// Strong gates: log a = −20 per token, mixed, resets, in float
// ---------------------------------------------------------------------------------------------

struct GateKind {
  const char* name;
  bool per_feature;
};

// The log-gates of the stability test: "mild" uniform in [−0.5, 0]; "strong" −20 everywhere;
// "mixed" −20 on even features and mild on odd ones (per-feature) or on even tokens (scalar);
// "reset" mild with one gate of −1e4 at the middle token.
MatD stability_gates(const std::string& kind, Index N, Index cols, std::uint32_t seed) {
  MatD G = frand(N, cols, seed, -0.5, 0.0);
  if (kind == "strong") G.setConstant(-20.0);
  if (kind == "strong-mild") {
    for (Index t = 0; t < N; ++t)
      for (Index d = 0; d < cols; ++d)
        if ((cols == 1 ? t : d) % 2 == 0) G(t, d) = -20.0;
  }
  if (kind == "reset") G.row(N / 2).setConstant(-1e4);
  return G;
}

template <class Phi>
void check_stability(const Phi& phi, bool per_feature) {
  const Index N = 200, D = 16, M = 8;
  const bool norm = normalizes(phi);
  const Index GC = gate_cols(phi, D, per_feature);
  Case c = make_case(N, D, M, GC, 22);
  double mild_f = 0;
  for (const std::string kind : {"mild", "strong", "strong-mild", "reset"}) {
    c.G = stability_gates(kind, N, GC, test::seed_of({N, GC, 23}));
    const MatD ref = gref::quadratic(c.Q, c.K, c.V, c.G, phi, ref_options(norm));
    double wf = 0, wd = 0;
    for (const Algo& a : {Algo{CausalAlgorithm::Chunked, 0, "Chunked default"},
                          Algo{CausalAlgorithm::Chunked, 64, "Chunked C=64"},
                          Algo{CausalAlgorithm::Chunked, 7, "Chunked C=7"},
                          Algo{CausalAlgorithm::Recurrent, 0, "Recurrent"}}) {
      const std::string what = std::string(map_name(phi)) + " " + gate_name(per_feature) + " " + kind + " " + a.name;
      State<float> st;
      const Mat<float> out = run<float>(phi, c, options(a, norm), st);
      EXPECT_TRUE(test::all_finite(out)) << what << ": float output not finite";
      EXPECT_TRUE(test::all_finite(st.S)) << what << ": float state not finite";
      const double ef = rel(dbl(out), ref);
      wf = std::max(wf, ef);
      const Mat<double> outd = run<double>(phi, c, options(a, norm));
      wd = std::max(wd, rel(outd, ref));
    }
    if (kind == std::string("mild")) mild_f = wf;
    const std::string what = std::string(map_name(phi)) + " " + gate_name(per_feature) + " " + kind;
    // "About the same relative error as mild gates": within 4x of the mild gates' error.
    // Measured (float, N = 200, D = 16, M = 8, four algorithms): mild 1.4e-7 to 2.7e-7, strong
    // (-20 per token) 1.2e-7 to 3.1e-7, strong/mild mixed 1.3e-7 to 3.2e-7 (at most 1.8x the
    // mild error of the same map), reset (-1e4) equal to mild; double at most 4.5e-16 in all.
    EXPECT_LE(wf, 4 * mild_f) << what << ": float relative error (mild gates: " << mild_f << ")";
    EXPECT_LE(wd, kRefDouble) << what << ": double relative error";
    test::report_error(what + " float", wf);
    test::report_error(what + " double", wd);
  }
}

TEST(gated_stability, StrongGatesInFloat) {
  for (const bool pf : {false, true}) {
    check_stability(Identity{}, pf);
    check_stability(Silu{}, pf);
    check_stability(SiluL2{}, pf);
    check_stability(EluPlusOne{}, pf);
  }
}

// Inputs of magnitude 100: L2Normalize bounds the features, EluPlusOne is normalised.
TEST(gated_stability, LargeInputsStayFinite) {
  const Index N = 120, D = 8, M = 5;
  for (const bool pf : {false, true}) {
    Case c = make_case(N, D, M, pf ? D : 1, 24);
    c.Q = frand(N, D, 25, -100, 100);
    c.K = frand(N, D, 26, -100, 100);
    const MatD ref_l2 = gref::quadratic(c.Q, c.K, c.V, c.G, SiluL2{}, ref_options(false));
    const MatD ref_elu = gref::quadratic(c.Q, c.K, c.V, c.G, EluPlusOne{}, ref_options(true));
    double w = 0;
    for (const Algo& a : algos()) {
      const std::string what = std::string(gate_name(pf)) + " " + a.name;
      const Mat<float> l2 = run<float>(SiluL2{}, c, options(a, false));
      const Mat<float> elu = run<float>(EluPlusOne{}, c, options(a, true));
      EXPECT_TRUE(test::all_finite(l2)) << what << ": L2Normalize<Silu>";
      EXPECT_TRUE(test::all_finite(elu)) << what << ": EluPlusOne normalize";
      const double e1 = rel(dbl(l2), ref_l2), e2 = rel(dbl(elu), ref_elu);
      EXPECT_LE(e1, kRefFloat) << what << ": L2Normalize<Silu>";
      EXPECT_LE(e2, kRefFloat) << what << ": EluPlusOne normalize";
      w = std::max({w, e1, e2});
    }
    test::report_error(std::string("inputs of magnitude 100, float, ") + gate_name(pf), w);
  }
}

// ---------------------------------------------------------------------------------------------
// Empty sequence
// ---------------------------------------------------------------------------------------------

TEST(gated_forward, EmptySequenceLeavesStateUnchanged) {
  const Index D = 5, M = 3;
  for (const bool pf : {false, true}) {
    const Case c = make_case(10, D, M, pf ? D : 1, 27);
    for (const Algo& a : algos()) {
      const std::string what = std::string(gate_name(pf)) + " " + a.name;
      const GatedOptions o = options(a, true);
      State<float> st;
      run<float>(EluPlusOne{}, c, o, st);
      const State<float> before = st;
      const Mat<float> out = run<float>(EluPlusOne{}, c.rows(0, 0), o, st);
      EXPECT_EQ(out.rows(), 0) << what;
      EXPECT_EQ(out.cols(), M) << what;
      EXPECT_TRUE(test::same_state(st, before)) << what << ": the state changed";
      EXPECT_TRUE(test::same_bits(st.log_decay, before.log_decay)) << what << ": log_decay changed";
      // From an empty state: the state stays zero (empty, or sized and zero).
      State<float> fresh;
      const Mat<float> out2 = run<float>(EluPlusOne{}, c.rows(0, 0), o, fresh);
      EXPECT_EQ(out2.rows(), 0) << what;
      EXPECT_TRUE(fresh.S.size() == 0 || test::max_abs(fresh.S) == 0.0) << what;
      EXPECT_TRUE(fresh.log_decay.size() == 0 || test::max_abs(fresh.log_decay) == 0.0) << what;
    }
  }
  // The returning overload and the multi-head form.
  const Mat<double> e = linattn::gated_linear_attention(Mat<double>(0, 4), Mat<double>(0, 4),
                                                        Mat<double>(0, 2), Mat<double>(0, 1));
  EXPECT_EQ(e.rows(), 0);
  EXPECT_EQ(e.cols(), 2);
  const Mat<double> mh = linattn::multihead_gated_linear_attention(
      Mat<double>(0, 6), Mat<double>(0, 6), Mat<double>(0, 4), Mat<double>(0, 2), 2, Identity{});
  EXPECT_EQ(mh.rows(), 0);
  EXPECT_EQ(mh.cols(), 4);
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

std::string shape(Index r, Index c) { return std::to_string(r) + "x" + std::to_string(c); }

TEST(gated_errors, ShapeMismatchesNameFunctionAndShapes) {
  const std::string fn = "gated_linear_attention";
  const Index N = 8, D = 5, M = 3;
  const Mat<float> Q = Mat<float>::Ones(N, D), K = Mat<float>::Ones(N, D), V = Mat<float>::Ones(N, M);
  const Mat<float> G1 = Mat<float>::Constant(N, 1, -0.1f);
  const auto call = [&](const Mat<float>& q, const Mat<float>& k, const Mat<float>& v, const Mat<float>& g) {
    return [=] {
      State<float> st;
      run<float>(Identity{}, q, k, v, g, GatedOptions{}, st);
    };
  };
  test::expect_invalid(call(Q, K, V, Mat<float>::Constant(N + 1, 1, -0.1f)), {fn, shape(N + 1, 1)},
                       "log_gates rows");
  test::expect_invalid(call(Q, K, V, Mat<float>::Constant(N, 2, -0.1f)), {fn, shape(N, 2)}, "log_gates cols");
  test::expect_invalid(call(Q, K, V, Mat<float>::Constant(N, D + 1, -0.1f)), {fn, shape(N, D + 1)},
                       "log_gates cols F+1");
  test::expect_invalid(call(Mat<float>::Ones(N, D + 1), K, V, G1), {fn, shape(N, D + 1)}, "Q cols");
  test::expect_invalid(call(Mat<float>::Ones(N - 1, D), Mat<float>::Ones(N - 1, D), V,
                            Mat<float>::Constant(N - 1, 1, -0.1f)),
                       {fn, shape(N - 1, D)}, "Q/K rows vs V");
  test::expect_invalid(call(Q, Mat<float>::Ones(N + 2, D), V, G1), {fn, shape(N + 2, D)}, "K rows");
  // A state of the wrong shape.
  {
    State<float> st(D + 1, M);
    Mat<float> out(N, M);
    linattn::Workspace<float> ws;
    test::expect_invalid([&] { linattn::gated_linear_attention(Q, K, V, G1, Identity{}, st, out, ws); },
                         {fn, shape(D + 1, M)}, "state shape");
  }
  // An output of the wrong shape.
  {
    State<float> st;
    Mat<float> out(N, M + 1);
    linattn::Workspace<float> ws;
    test::expect_invalid([&] { linattn::gated_linear_attention(Q, K, V, G1, Identity{}, st, out, ws); },
                         {fn, shape(N, M + 1)}, "out shape");
  }
  // Multi-head and batched.
  const std::string mfn = "multihead_gated_linear_attention";
  const Index H = 2;
  const Mat<float> QH = Mat<float>::Ones(N, H * D), VH = Mat<float>::Ones(N, H * M);
  test::expect_invalid(
      [&] { linattn::multihead_gated_linear_attention(QH, QH, VH, Mat<float>::Constant(N, H + 1, -0.1f), H); },
      {mfn, shape(N, H + 1)}, "multihead log_gates cols");
  test::expect_invalid(
      [&] { linattn::multihead_gated_linear_attention(QH, QH, VH, Mat<float>::Constant(N - 1, H, -0.1f), H); },
      {mfn, shape(N - 1, H)}, "multihead log_gates rows");
  test::expect_invalid(
      [&] { linattn::multihead_gated_linear_attention(QH, Mat<float>::Ones(N, H * D + 1), VH,
                                                      Mat<float>::Constant(N, H, -0.1f), H); },
      {mfn, shape(N, H * D + 1)}, "multihead K cols");
  const std::string bfn = "batched_gated_linear_attention";
  {
    linattn::MultiHeadWorkspace<float> ws;
    Mat<float> out(N, H * M);
    const std::vector<Index> offsets = {0, 3, N};
    test::expect_invalid(
        [&] {
          linattn::batched_gated_linear_attention(QH, QH, VH, Mat<float>::Constant(N + 1, H, -0.1f), offsets, H,
                                                  Identity{}, out, ws);
        },
        {bfn, shape(N + 1, H)}, "batched log_gates rows");
    Mat<float> bad_out(N, H * M + 1);
    test::expect_invalid(
        [&] {
          linattn::batched_gated_linear_attention(QH, QH, VH, Mat<float>::Constant(N, H, -0.1f), offsets, H,
                                                  Identity{}, bad_out, ws);
        },
        {bfn, shape(N, H * M + 1)}, "batched out shape");
  }
}

TEST(gated_errors, InvalidGateValues) {
  const Index N = 8, D = 5, M = 3, H = 2;
  const Mat<float> Q = Mat<float>::Ones(N, D), V = Mat<float>::Ones(N, M);
  const Mat<float> QH = Mat<float>::Ones(N, H * D), VH = Mat<float>::Ones(N, H * M);
  const float bad_values[] = {0.5f, std::numeric_limits<float>::quiet_NaN(),
                              -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::min()};
  const char* names[] = {"0.5", "NaN", "-inf", "+inf", "smallest positive normal"};
  for (const bool pf : {false, true})
    for (int b = 0; b < 5; ++b) {
      const std::string what = std::string(gate_name(pf)) + " log gate " + names[b];
      Mat<float> G = Mat<float>::Constant(N, pf ? D : 1, -0.1f);
      G(N - 2, G.cols() - 1) = bad_values[b];
      test::expect_invalid(
          [&] {
            State<float> st;
            run<float>(Identity{}, Q, Q, V, G, GatedOptions{}, st);
          },
          "gated_linear_attention", what);
      // The state is left as it was.
      State<float> st;
      run<float>(Identity{}, Q, Q, V, Mat<float>::Constant(N, pf ? D : 1, -0.1f), GatedOptions{}, st);
      const State<float> before = st;
      try {
        run<float>(Identity{}, Q, Q, V, G, GatedOptions{}, st);
      } catch (const std::invalid_argument&) {
      }
      EXPECT_TRUE(test::same_state(st, before) && test::same_bits(st.log_decay, before.log_decay))
          << what << ": a rejected call changed the state";
      Mat<float> GH = Mat<float>::Constant(N, H * (pf ? D : 1), -0.1f);
      GH(1, GH.cols() - 1) = bad_values[b];
      test::expect_invalid([&] { linattn::multihead_gated_linear_attention(QH, QH, VH, GH, H); },
                           "multihead_gated_linear_attention", "multihead " + what);
      linattn::MultiHeadWorkspace<float> ws;
      Mat<float> out(N, H * M);
      const std::vector<Index> offsets = {0, 3, N};
      test::expect_invalid(
          [&] { linattn::batched_gated_linear_attention(QH, QH, VH, GH, offsets, H, Identity{}, out, ws); },
          "batched_gated_linear_attention", "batched " + what);
    }
  // Zero and the most negative finite value are valid.
  Mat<float> G = Mat<float>::Zero(N, 1);
  G(3, 0) = -std::numeric_limits<float>::max();
  State<float> st;
  Mat<float> out;
  EXPECT_NO_THROW(out = run<float>(Identity{}, Q, Q, V, G, GatedOptions{}, st));
  EXPECT_TRUE(test::all_finite(out));
}

// The register-blocked paths: the fused recurrent kernels work on four packets of columns at a
// time (64 floats with AVX-512) and the shapes above stay below that. M = 70 takes the packet
// tile and a scalar tail in every build; the forward of every algorithm against the reference,
// the backward's two forms (fused token kernels and chunked GEMMs) against each other.
TEST(gated_wide, PacketTilesMatchReference) {
  const Index N = 150, D = 24, M = 70;
  for (int pf = 0; pf < 2; ++pf) {
    const MatD Qd = MatD::Random(N, D), Kd = MatD::Random(N, D), Vd = MatD::Random(N, M);
    const MatD Gd = -0.3 * (0.05 + MatD::Random(N, pf ? D : 1).cwiseAbs().array()).matrix();
    const MatD W = MatD::Random(N, M);
    gref::Options ro;
    ro.scale = 0.2;
    const MatD ref = gref::quadratic(Qd, Kd, Vd, Gd, Identity{}, ro);
    const double scale = ref.cwiseAbs().maxCoeff();
    const auto check = [&](auto zero) {
      using S = decltype(zero);
      const Mat<S> Q = Qd.cast<S>(), K = Kd.cast<S>(), V = Vd.cast<S>(), G = Gd.cast<S>();
      GatedOptions o;
      o.scale = 0.2;
      for (const Algo& a : algos()) {
        o.algorithm = a.algorithm;
        o.chunk_size = a.chunk;
        const Mat<S> out = linattn::gated_linear_attention(Q, K, V, G, Identity{}, o);
        const double e = test::max_abs_diff(out, ref) / scale;
        std::cout << "[ max err  ] M = 70 " << (pf ? "per-feature " : "scalar ") << a.name
                  << (sizeof(S) == 4 ? " float" : " double") << " = " << e << "\n";
        EXPECT_LE(e, ref_bound<S>()) << a.name;
      }
      o.chunk_size = 0;
      o.algorithm = CausalAlgorithm::Recurrent;
      const auto gr = linattn::gated_linear_attention_backward(Q, K, V, G, W.cast<S>().eval(),
                                                              Identity{}, o);
      o.algorithm = CausalAlgorithm::Chunked;
      const auto gc = linattn::gated_linear_attention_backward(Q, K, V, G, W.cast<S>().eval(),
                                                              Identity{}, o);
      const auto rel = [](const Mat<S>& x, const Mat<S>& y) {
        return test::max_abs_diff(x, y) / std::max(1e-300, double(y.cwiseAbs().maxCoeff()));
      };
      const double e = std::max({rel(gr.dQ, gc.dQ), rel(gr.dK, gc.dK), rel(gr.dV, gc.dV),
                                 rel(gr.dlog_gates, gc.dlog_gates)});
      std::cout << "[ max err  ] M = 70 backward recurrent vs chunked "
                << (pf ? "per-feature" : "scalar") << (sizeof(S) == 4 ? " float" : " double")
                << " = " << e << "\n";
      EXPECT_LE(e, agree_bound<S>());
    };
    check(float{});
    check(double{});
  }
}

// The decode step's scalar overload is the 1-vector form.
TEST(gated_recurrent, ScalarGateOverload) {
  const Index D = 5, M = 70;
  linattn::RecurrentGatedAttention<Identity, float> a(D, M), b(D, M);
  const Mat<float> X = Mat<float>::Random(20, D), V = Mat<float>::Random(20, M);
  Vec<float> oa(M), ob(M), g(1);
  for (Index t = 0; t < X.rows(); ++t) {
    g(0) = -0.05f * float(t % 7);
    a.step(X.row(t), X.row(t), V.row(t), g, oa);
    b.step(X.row(t), X.row(t), V.row(t), g(0), ob);
    ASSERT_TRUE(test::same_bits(oa, ob));
  }
  EXPECT_TRUE(test::same_bits(a.state().S, b.state().S));
}

}  // namespace
