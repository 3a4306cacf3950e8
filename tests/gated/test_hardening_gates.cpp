// Accuracy of the decayed and gated kernels at the edges of the gates' range (spec §9.1, §9.2):
//  - weak gates (RetNet's slowest head, γ = 1 - 2^-12, and g = -1e-6, -1e-7): the recurrent
//    form (Auto's pick for these states) and the decode step against the long-double
//    recurrence of gated_reference.hpp. A decay factor e^g rounded per token carries a relative
//    error u / |g| into 1 - e^g, which the state compounds over its 1 / |g| tokens of memory;
//  - gates of exactly 0 with normalize = true: causal linear attention, whose sums the decay
//    does not bound, so the recurrent form must keep them compensated (a history of 2^24 tokens
//    is injected through the state, after which a plain float running sum absorbs nothing);
//  - strong scalar decays in the chunked form: a factor below exp_arg_floor is exactly 0,
//    never a denormal.
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cmath>
#include <limits>
#include <linattn/linattn.hpp>
#include <string>

#include "gated_reference.hpp"
#include "test_util.hpp"

namespace {

using linattn::CausalAlgorithm;
using linattn::GatedOptions;
using linattn::Identity;
using test::Index;
using test::Mat;
using test::MatD;

const char* algo_name(CausalAlgorithm a) {
  return a == CausalAlgorithm::Chunked     ? "Chunked"
         : a == CausalAlgorithm::Recurrent ? "Recurrent"
                                           : "Auto";
}

// Relative to the largest output of the reference.
double rel_err(const MatD& got, const MatD& ref) {
  return test::max_abs_diff(got, ref) / test::max_abs(ref);
}

struct WeakCase {
  const char* name;
  double log_gate;  // rounded to S, then the same for the reference
  bool per_feature;
  Index N;
};

// Measured (GCC, x86-64, D = M = 8, float; in brackets before the blocked recurrence and the
// expm1 factors):
//   RetNet γ = 1 - 2^-12, N = 16384: recurrent 2.9e-7 (1.6e-4), step 1.5e-6 (1.6e-4);
//   g = -1e-6, N = 16384:            recurrent 2.5e-7 (1.5e-4), step 1.3e-5 (1.5e-4);
//   g = -1e-7, N = 16384:            recurrent 3.2e-7 (1.5e-4), step 5.1e-5 (1.5e-4);
//   Chunked 4.4e-7 … 3.2e-6 throughout. Double: recurrent 1.6e-15 (4.4e-13).
// The decode step keeps no low part: its state rounds once a token (a bias of up to u a token,
// no longer u / |g|), which is what its bound allows.
template <class S>
void check_weak(const WeakCase& c) {
  const Index D = 8, M = 8;
  const MatD Q = test::random_matrix<S>(c.N, D, 11).template cast<double>();
  const MatD K = test::random_matrix<S>(c.N, D, 12).template cast<double>();
  const MatD V = test::random_matrix<S>(c.N, M, 13).template cast<double>();
  const MatD G = MatD::Constant(c.N, c.per_feature ? D : 1, double(static_cast<S>(c.log_gate)));
  gref::Options ro;
  ro.scale = 1.0 / std::sqrt(double(D));
  const MatD ref = gref::recurrence(Q, K, V, G, Identity{}, ro);
  const bool is_float = std::is_same_v<S, float>;
  const double prefill_bound = is_float ? 1e-6 : 1e-14;
  const double step_bound = is_float ? (c.log_gate > -1e-5 ? 1e-4 : 1e-5) : 1e-12;
  const Mat<S> Qs = Q.cast<S>(), Ks = K.cast<S>(), Vs = V.cast<S>(), Gs = G.cast<S>();
  const std::string tag = std::string(c.name) + " " + test::scalar_name<S>();
  for (const CausalAlgorithm a :
       {CausalAlgorithm::Auto, CausalAlgorithm::Recurrent, CausalAlgorithm::Chunked}) {
    GatedOptions o;
    o.algorithm = a;
    o.scale = ro.scale;
    const Mat<S> out = linattn::gated_linear_attention(Qs, Ks, Vs, Gs, Identity{}, o);
    const double e = rel_err(out.template cast<double>(), ref);
    // Chunked's factors span one chunk: rounded once a chunk, not once a token.
    const double bound = a == CausalAlgorithm::Chunked ? 20 * prefill_bound : prefill_bound;
    EXPECT_LE(e, bound) << tag << " " << algo_name(a);
    test::report_error(tag + " " + algo_name(a), e);
  }
  GatedOptions o;
  o.scale = ro.scale;
  linattn::RecurrentGatedAttention<Identity, S> rnn(D, M, o);
  Mat<S> steps(c.N, M);
  Eigen::Matrix<S, Eigen::Dynamic, 1> y(M);
  for (Index t = 0; t < c.N; ++t) {
    rnn.step(Qs.row(t), Ks.row(t), Vs.row(t), Gs.row(t), y);
    steps.row(t) = y.transpose();
  }
  const double e = rel_err(steps.template cast<double>(), ref);
  EXPECT_LE(e, step_bound) << tag << " RecurrentGatedAttention::step";
  test::report_error(tag + " step", e);
}

const WeakCase kWeakCases[] = {
    {"RetNet gamma = 1 - 2^-12", std::log1p(-std::ldexp(1.0, -12)), false, 16384},
    {"g = -1e-6", -1e-6, false, 16384},
    {"g = -1e-6 per feature", -1e-6, true, 16384},
    {"g = -1e-7", -1e-7, false, 16384},
};

TEST(hardening_gates, WeakGatesExactInTheRecurrenceAndTheDecodeStep) {
  for (const WeakCase& c : kWeakCases) {
    IF_FLOAT(check_weak<float>(c));
    IF_DOUBLE(check_weak<double>(c));
  }
}

// Gates of exactly 0, normalised, EluPlusOne (φ(0) = 1): from a state that has seen 2^24 tokens
// with φk = 1 and v = 0 (z = 2^24, S = 0), n more with q = k = 0 and v = 1 give
// out_t = t / (2^24 + t) exactly (t = 1..n). A plain float sum keeps z at 2^24 (each + 1 is
// rounded away): out_t = t / 2^24, a relative error of t / 2^24 (2.4e-4 at t = 4096).
template <class S>
void check_zero_gates_compensated(CausalAlgorithm a) {
  const Index n = 4096, D = 1, M = 1;
  const Mat<S> Q = Mat<S>::Zero(n, D), K = Mat<S>::Zero(n, D), V = Mat<S>::Ones(n, M);
  const Mat<S> G = Mat<S>::Zero(n, 1);
  auto st = linattn::make_state<S>(linattn::EluPlusOne{}, D, M);
  st.z(0) = S(16777216);
  GatedOptions o;
  o.algorithm = a;
  o.normalize = true;
  const Mat<S> out = linattn::gated_linear_attention(Q, K, V, G, linattn::EluPlusOne{}, st, o);
  double worst = 0;
  for (Index t = 1; t <= n; ++t) {
    const double exact = double(t) / (16777216.0 + double(t));
    worst = std::max(worst, std::abs(double(out(t - 1, 0)) - exact) / exact);
  }
  const std::string tag =
      std::string("g = 0 after 2^24 tokens ") + algo_name(a) + " " + test::scalar_name<S>();
  EXPECT_LE(worst, 16 * std::numeric_limits<S>::epsilon()) << tag;  // Chunked: 6.9e-7 (float)
  test::report_error(tag, worst);
  EXPECT_DOUBLE_EQ(double(st.z(0)) + double(st.z_lo(0)), 16777216.0 + double(n)) << tag << ": z";
}

TEST(hardening_gates, ZeroGatesNormalizedKeepCompensatedSums) {
  for (const CausalAlgorithm a :
       {CausalAlgorithm::Auto, CausalAlgorithm::Recurrent, CausalAlgorithm::Chunked}) {
    IF_FLOAT(check_zero_gates_compensated<float>(a));
    IF_DOUBLE(check_zero_gates_compensated<double>(a));
  }
}

// A strong scalar decay in the chunked form: 64 rows of g = -1.5 take the carried state through
// exp(-96) ≈ 2.0e-42, below float's exp_arg_floor (-87): spec §9.1 says that factor is exactly 0.
// With v = 0 the new rows add nothing, so the final state is that factor times the old one.
template <class S>
void check_strong_decay_flushed(bool per_feature, Index chunk) {
  const Index N = 64, D = 4, M = 3;
  const double g =
      std::is_same_v<S, float> ? -1.5 : -11.5;  // 64·g below -87 (float), -708 (double)
  const Mat<S> Q = test::random_matrix<S>(N, D, 21), K = test::random_matrix<S>(N, D, 22);
  const Mat<S> V = Mat<S>::Zero(N, M);
  const Mat<S> G = Mat<S>::Constant(N, per_feature ? D : 1, S(g));
  auto st = linattn::make_state<S>(Identity{}, D, M);
  st.S.setOnes();
  GatedOptions o;
  o.algorithm = CausalAlgorithm::Chunked;
  o.chunk_size = chunk;
  const Mat<S> out = linattn::gated_linear_attention(Q, K, V, G, Identity{}, st, o);
  const std::string tag = std::string(per_feature ? "per-feature" : "scalar") + " chunk " +
                          std::to_string(chunk) + " " + test::scalar_name<S>();
  for (Index d = 0; d < D; ++d)
    for (Index m = 0; m < M; ++m) {
      EXPECT_EQ(st.S(d, m), S(0)) << tag << ": S(" << d << ", " << m << ")";
      EXPECT_EQ(st.S_lo(d, m), S(0)) << tag << ": S_lo(" << d << ", " << m << ")";
    }
  // Row i reads the old state through exp((i + 1) g): exactly 0 once that is below the floor.
  for (Index i = 0; i < N; ++i) {
    if ((i + 1) * g < double(linattn::detail::exp_arg_floor<S>())) {
      for (Index m = 0; m < M; ++m)
        EXPECT_EQ(out(i, m), S(0)) << tag << ": out(" << i << ", " << m << ")";
    }
  }
}

TEST(hardening_gates, StrongChunkedDecayIsExactlyZero) {
  for (const bool pf : {false, true})
    for (const Index chunk : {Index(0), Index(64)}) {
      IF_FLOAT(check_strong_decay_flushed<float>(pf, chunk));
      IF_DOUBLE(check_strong_decay_flushed<double>(pf, chunk));
    }
}

}  // namespace
