// RecurrentLinearAttention (the RNN form of causal linear attention, spec §3) and
// LinearCrossAttention: step by step against the naive causal reference, zero allocation per
// step, reset / state / set_state, forking by copy, handing the state between the parallel and
// the recurrent forms, argument checks.
//
// Compiled with EIGEN_RUNTIME_NO_MALLOC (tests/CMakeLists.txt); eigen_assert is redirected to a
// hook that fails the running test, so that forbidden allocations are caught in Release builds
// too (see test_causal.cpp for the details).
#include "eigen_assert_hook.hpp"  // first: before any Eigen header

#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <algorithm>
#include <atomic>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "causal_reference.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace {

using linattn::CausalAlgorithm;
using linattn::CausalOptions;
using linattn::EluPlusOne;
using linattn::LinearCrossAttention;
using linattn::NormalizedCosine;
using linattn::RecurrentLinearAttention;
using linattn::SoftmaxSplit;
using cref::Relu;
using test::Index;
using test::Mat;
using test::MatD;
using test::RowMat;
template <class S>
using Vec = Eigen::Matrix<S, Eigen::Dynamic, 1>;

// Float errors measured here are below ~4e-7 and double below ~1e-15 (N <= 513); see
// test_causal.cpp for the choice of these bounds (about 10x the rounding).
template <class S>
double tight_tol(double scale = 1.0) {
  return (sizeof(S) == sizeof(float) ? 5e-6 : 1e-13) * std::max(1.0, scale);
}

// Rows whose reference denominator is below this are in the regime of the ε guard (1e-6 in
// float, 1e-12 in double), where float and double may differ: only finiteness is checked.
constexpr double kMinDen = 1e-2;

template <class DA>
double row_err(const Eigen::MatrixBase<DA>& got, const MatD& expected, Index i, const ref::Vec& den) {
  if (!test::all_finite(got)) return std::numeric_limits<double>::infinity();
  if (den(i) < kMinDen) return 0;
  return test::max_abs_diff(got.transpose(), expected.row(i)) ;
}

template <class Map>
std::string tag_of() {
  return cref::map_name<Map>();
}

struct Inputs {
  Index N, D, M;
};

const std::vector<Inputs> kShapes = {{1, 1, 1}, {2, 4, 3}, {7, 3, 2}, {65, 16, 16},
                                     {130, 5, 9}, {300, 8, 5}, {257, 33, 17}};

// ---------------------------------------------------------------------------------------------
// step() == the causal reference, row by row
// ---------------------------------------------------------------------------------------------

template <class S, class Map>
void check_steps(const Map& phi) {
  const std::string tag = tag_of<Map>() + "/" + test::scalar_name<S>();
  double worst = 0, worst_parallel = 0;
  for (const Inputs& sh : kShapes) {
    const Mat<S> Q = cref::qk_input<S, Map>(sh.N, sh.D, test::seed_of({sh.N, sh.D, 1}));
    const Mat<S> K = cref::qk_input<S, Map>(sh.N, sh.D, test::seed_of({sh.N, sh.D, 2}));
    const Mat<S> V = test::random_matrix<S>(sh.N, sh.M, test::seed_of({sh.N, sh.D, 3}));
    ref::Vec den;
    const MatD expected = cref::causal(cref::to_double(Q), cref::to_double(K), cref::to_double(V), phi, &den);
    const Mat<S> parallel = linattn::causal_linear_attention(Q, K, V, phi);
    // Tokens handed over in three ways: rows of column-major matrices, columns (contiguous),
    // rows of row-major matrices.
    const Mat<S> Qt = Q.transpose(), Kt = K.transpose(), Vt = V.transpose();
    const RowMat<S> Qr = Q, Kr = K, Vr = V;
    RecurrentLinearAttention<Map, S> a(sh.D, sh.M, phi), b(sh.D, sh.M, phi), c(sh.D, sh.M, phi),
        d(sh.D, sh.M, phi);
    Vec<S> out_b(sh.M);
    Mat<S> out_c(sh.M, sh.N);  // c writes into the columns of a matrix
    Mat<S> out_d(sh.N, sh.M);  // d writes into the rows of a matrix (strided)
    for (Index i = 0; i < sh.N; ++i) {
      const Vec<S> out_a = a.step(Q.row(i), K.row(i), V.row(i));
      b.step(Qt.col(i), Kt.col(i), Vt.col(i), out_b);
      c.step(Qr.row(i), Kr.row(i), Vr.row(i), out_c.col(i));
      d.step(Q.row(i), K.row(i), V.row(i), out_d.row(i));
      EXPECT_EQ(test::max_abs_diff(out_a.transpose(), out_d.row(i)), 0.0) << tag << " row output";
      ASSERT_EQ(out_a.size(), sh.M);
      const double e = row_err(out_a, expected, i, den);
      EXPECT_LE(e, tight_tol<S>()) << tag << " step " << i << " of N=" << sh.N << " D=" << sh.D;
      EXPECT_EQ(test::max_abs_diff(out_a, out_b), 0.0) << tag << " step(q,k,v) vs step(q,k,v,out)";
      EXPECT_EQ(test::max_abs_diff(out_a, out_c.col(i)), 0.0) << tag << " column output";
      worst = std::max(worst, e);
      if (den(i) >= kMinDen)
        worst_parallel = std::max(worst_parallel, test::max_abs_diff(out_a.transpose(), parallel.row(i)));
    }
    EXPECT_EQ(a.position(), sh.N);
    EXPECT_LE(worst_parallel, tight_tol<S>()) << tag << " steps vs causal_linear_attention";
  }
  test::report_error(tag + " step vs reference", worst);
  test::report_error(tag + " step vs parallel (chunked)", worst_parallel);
}

TEST(recurrent, StepsMatchCausalReference) {
  IF_FLOAT(check_steps<float>(EluPlusOne{}));
  IF_DOUBLE(check_steps<double>(EluPlusOne{}));
  IF_FLOAT(check_steps<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_steps<double>(SoftmaxSplit{}));
  IF_FLOAT(check_steps<float>(NormalizedCosine{}));
  IF_DOUBLE(check_steps<double>(NormalizedCosine{}));
  IF_FLOAT(check_steps<float>(Relu{}));
  IF_DOUBLE(check_steps<double>(Relu{}));
}

// Causal SoftmaxSplit stepping through keys of magnitude 100 whose maxima jump.
TEST(recurrent, SoftmaxSplitStableAtMagnitude100) {
  const Index N = 200, D = 6, M = 4;
  const Mat<float> Q = test::random_matrix<float>(N, D, 11, -100, 100);
  Mat<float> K = test::random_matrix<float>(N, D, 12, -100, 100);
  K(50, 0) = 250;
  K(51, 0) = -250;
  for (Index j = 120; j < N; ++j) K(j, 3) = static_cast<float>(-100 + 4 * (j - 120));  // ramp to 220
  const Mat<float> V = test::random_matrix<float>(N, M, 13);
  const MatD expected = ref::causal_linear_attention(cref::to_double(Q), cref::to_double(K),
                                                     cref::to_double(V), SoftmaxSplit{});
  RecurrentLinearAttention<SoftmaxSplit, float> rnn(D, M);
  Vec<float> out(M);
  double worst = 0;
  for (Index i = 0; i < N; ++i) {
    rnn.step(Q.row(i), K.row(i), V.row(i), out);
    ASSERT_TRUE(test::all_finite(out)) << "step " << i;
    worst = std::max(worst, test::max_abs_diff(out.transpose(), expected.row(i)));
  }
  EXPECT_LE(worst, tight_tol<float>());
  test::report_error("SoftmaxSplit/float magnitude 100 steps", worst);
}

// step(q, k, v, out) with `out` a row vector or a row of a column-major matrix (strided): the
// documentation says "a vector of the caller's" and check_token accepts 1 x M. (Between commits
// 6d6e494 and 65d19b9 this did not compile: a GEMV into out.reshaped() needs dest.data().)
TEST(recurrent, StepIntoRowVectorAndMatrixRow) {
  const Index N = 150, D = 5, M = 4;
  const Mat<float> Q = test::random_matrix<float>(N, D, 5), K = test::random_matrix<float>(N, D, 6);
  const Mat<float> V = test::random_matrix<float>(N, M, 7);
  const Mat<float> expected = linattn::causal_linear_attention(Q, K, V);
  RecurrentLinearAttention<EluPlusOne, float> a(D, M), b(D, M);
  Mat<float> rows(N, M);                       // rows of a column-major matrix: strided
  Eigen::RowVectorXf row(M);                   // a row vector
  for (Index i = 0; i < N; ++i) {
    a.step(Q.row(i), K.row(i), V.row(i), rows.row(i));
    b.step(Q.row(i), K.row(i), V.row(i), row);
    EXPECT_LE(test::max_abs_diff(row, expected.row(i)), tight_tol<float>());
  }
  EXPECT_LE(test::max_abs_diff(rows, expected), tight_tol<float>());
}

// ---------------------------------------------------------------------------------------------
// Zero allocation per step
// ---------------------------------------------------------------------------------------------

TEST(recurrent, NoMallocDetectorWorks) {
  eigen_hook::g_expect = true;
  int seen = 0;
  {
    NoMallocScope scope;
    Eigen::VectorXd v(1000);
    v.setZero();
    seen = scope.failures();
  }
  eigen_hook::g_expect = false;
  EXPECT_GE(seen, 1) << "is EIGEN_RUNTIME_NO_MALLOC defined for this target?";
}

template <class S, class Map>
void check_step_no_malloc(const Map& phi) {
  const std::string tag = tag_of<Map>() + "/" + test::scalar_name<S>();
  const Index N = 1500, D = 16, M = 12;
  const Mat<S> Q = cref::qk_input<S, Map>(N, D, 21), K = cref::qk_input<S, Map>(N, D, 22);
  const Mat<S> V = test::random_matrix<S>(N, M, 23);
  const RowMat<S> Qr = Q, Kr = K, Vr = V;
  RecurrentLinearAttention<Map, S> rnn(D, M, phi);
  Vec<S> out(M);
  Mat<S> outs(N, M);
  int failures = 0;
  {
    NoMallocScope scope;
    for (Index i = 0; i < N; ++i) {
      // Alternate the kinds of token expressions: strided rows, contiguous row-major rows.
      if (i % 2 == 0) {
        rnn.step(Q.row(i), K.row(i), V.row(i), out);
      } else {
        rnn.step(Qr.row(i), Kr.row(i), Vr.row(i), out);
      }
      outs.row(i) = out.transpose();
    }
    failures = scope.failures();
  }
  EXPECT_EQ(failures, 0) << tag << ": step(q, k, v, out) allocated";
  EXPECT_LE(test::max_abs_diff(outs, linattn::causal_linear_attention(Q, K, V, phi)), tight_tol<S>())
      << tag;
}

TEST(recurrent, StepWithOutputAllocatesNothing) {
  IF_FLOAT(check_step_no_malloc<float>(EluPlusOne{}));
  IF_DOUBLE(check_step_no_malloc<double>(EluPlusOne{}));
  IF_FLOAT(check_step_no_malloc<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_step_no_malloc<double>(SoftmaxSplit{}));
  IF_FLOAT(check_step_no_malloc<float>(NormalizedCosine{}));
  IF_DOUBLE(check_step_no_malloc<double>(NormalizedCosine{}));
  IF_FLOAT(check_step_no_malloc<float>(Relu{}));
  IF_DOUBLE(check_step_no_malloc<double>(Relu{}));
}

// ---------------------------------------------------------------------------------------------
// reset(), state(), copies (fork), set_state()
// ---------------------------------------------------------------------------------------------

template <class S, class Map>
void check_reset_and_state(const Map& phi) {
  const std::string tag = tag_of<Map>() + "/" + test::scalar_name<S>();
  const Index N = 90, D = 5, M = 3;
  const Index F = phi.feature_dim(D);
  const Mat<S> Q = cref::qk_input<S, Map>(N, D, 31), K = cref::qk_input<S, Map>(N, D, 32);
  const Mat<S> V = test::random_matrix<S>(N, M, 33);
  RecurrentLinearAttention<Map, S> rnn(D, M, phi);
  EXPECT_EQ(rnn.key_dim(), D);
  EXPECT_EQ(rnn.value_dim(), M);
  EXPECT_EQ(rnn.feature_dim(), F);
  // A fresh state: zero, sized, with -inf maxima for SoftmaxSplit.
  EXPECT_EQ(rnn.state().S.rows(), F);
  EXPECT_EQ(rnn.state().S.cols(), M);
  EXPECT_EQ(rnn.state().z.size(), F);
  EXPECT_EQ(rnn.state().m.size(), linattn::normalizes_keys_per_feature_v<Map> ? F : 0) << tag;
  EXPECT_EQ(test::max_abs(rnn.state().S), 0.0);

  Mat<S> first(N, M);
  for (Index i = 0; i < N; ++i) first.row(i) = rnn.step(Q.row(i), K.row(i), V.row(i)).transpose();
  // state() equals the state the parallel form carries out of the same tokens.
  linattn::LinearAttentionState<S> st;
  linattn::causal_linear_attention(Q, K, V, phi, st);
  EXPECT_LE(test::max_abs_diff(rnn.state().S, st.S), tight_tol<S>(test::max_abs(st.S))) << tag;
  EXPECT_LE(test::max_abs_diff(rnn.state().z, st.z), tight_tol<S>(test::max_abs(st.z))) << tag;
  EXPECT_EQ(test::max_abs_diff(rnn.state().m, st.m), 0.0) << tag;
  EXPECT_EQ(rnn.position(), N);

  rnn.reset();
  EXPECT_EQ(rnn.position(), 0);
  EXPECT_EQ(test::max_abs(rnn.state().S), 0.0);
  EXPECT_EQ(test::max_abs(rnn.state().z), 0.0);
  EXPECT_EQ(rnn.state().S.rows(), F);
  for (Index d = 0; d < rnn.state().m.size(); ++d)
    EXPECT_EQ(rnn.state().m(d), -std::numeric_limits<S>::infinity());
  Mat<S> second(N, M);
  for (Index i = 0; i < N; ++i) second.row(i) = rnn.step(Q.row(i), K.row(i), V.row(i)).transpose();
  EXPECT_EQ(test::max_abs_diff(first, second), 0.0) << tag << ": reset() does not start over";
}

TEST(recurrent, ResetAndStateAccess) {
  IF_FLOAT(check_reset_and_state<float>(EluPlusOne{}));
  IF_DOUBLE(check_reset_and_state<double>(EluPlusOne{}));
  IF_FLOAT(check_reset_and_state<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_reset_and_state<double>(SoftmaxSplit{}));
  IF_FLOAT(check_reset_and_state<float>(NormalizedCosine{}));
  IF_FLOAT(check_reset_and_state<float>(Relu{}));
}

// Copy mid-sequence (beam search): both copies continue with their own tokens and each equals
// the reference of its own sequence (shared prefix + own suffix).
template <class S, class Map>
void check_fork(const Map& phi) {
  const std::string tag = tag_of<Map>() + "/" + test::scalar_name<S>();
  const Index P = 70, T = 60, D = 6, M = 4;
  const Mat<S> Qa = cref::qk_input<S, Map>(P + T, D, 41), Ka = cref::qk_input<S, Map>(P + T, D, 42);
  const Mat<S> Va = test::random_matrix<S>(P + T, M, 43);
  Mat<S> Qb = Qa, Kb = Ka, Vb = Va;  // same prefix, different suffix
  Qb.bottomRows(T) = cref::qk_input<S, Map>(T, D, 44);
  Kb.bottomRows(T) = cref::qk_input<S, Map>(T, D, 45);
  Vb.bottomRows(T) = test::random_matrix<S>(T, M, 46);
  ref::Vec den_a, den_b;
  const MatD ra = cref::causal(cref::to_double(Qa), cref::to_double(Ka), cref::to_double(Va), phi, &den_a);
  const MatD rb = cref::causal(cref::to_double(Qb), cref::to_double(Kb), cref::to_double(Vb), phi, &den_b);

  RecurrentLinearAttention<Map, S> a(D, M, phi);
  Vec<S> out(M);
  for (Index i = 0; i < P; ++i) a.step(Qa.row(i), Ka.row(i), Va.row(i), out);
  RecurrentLinearAttention<Map, S> b = a;  // fork
  RecurrentLinearAttention<Map, S> c(D, M, phi);
  c = a;  // copy assignment forks too
  double worst = 0;
  for (Index i = P; i < P + T; ++i) {
    a.step(Qa.row(i), Ka.row(i), Va.row(i), out);
    worst = std::max(worst, row_err(out, ra, i, den_a));
    b.step(Qb.row(i), Kb.row(i), Vb.row(i), out);
    worst = std::max(worst, row_err(out, rb, i, den_b));
    c.step(Qb.row(i), Kb.row(i), Vb.row(i), out);
    worst = std::max(worst, row_err(out, rb, i, den_b));
  }
  EXPECT_LE(worst, tight_tol<S>()) << tag;
  EXPECT_EQ(a.position(), P + T);
  EXPECT_EQ(b.position(), P + T);
}

TEST(recurrent, CopyForksTheSequence) {
  IF_FLOAT(check_fork<float>(EluPlusOne{}));
  IF_DOUBLE(check_fork<double>(EluPlusOne{}));
  IF_FLOAT(check_fork<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_fork<double>(SoftmaxSplit{}));
  IF_FLOAT(check_fork<float>(NormalizedCosine{}));
  IF_FLOAT(check_fork<float>(Relu{}));
}

// Prefill in parallel, hand the state over, then step == one shot; and the other way round.
template <class S, class Map>
void check_handover(const Map& phi) {
  const std::string tag = tag_of<Map>() + "/" + test::scalar_name<S>();
  const Index N = 230, D = 7, M = 5;
  const Mat<S> Q = cref::qk_input<S, Map>(N, D, 51), K = cref::qk_input<S, Map>(N, D, 52);
  const Mat<S> V = test::random_matrix<S>(N, M, 53);
  ref::Vec den;
  const MatD expected = cref::causal(cref::to_double(Q), cref::to_double(K), cref::to_double(V), phi, &den);
  const Mat<S> one_shot = linattn::causal_linear_attention(Q, K, V, phi);
  for (const Index P : {Index(0), Index(1), Index(64), Index(100), Index(229), Index(230)}) {
    for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
      CausalOptions opts;
      opts.algorithm = algo;
      opts.chunk_size = 16;
      // Parallel prefill, then steps.
      {
        linattn::LinearAttentionState<S> st;
        Mat<S> out(N, M);
        out.topRows(P) = linattn::causal_linear_attention(Q.topRows(P), K.topRows(P), V.topRows(P), phi, st, opts);
        RecurrentLinearAttention<Map, S> rnn(D, M, phi);
        rnn.set_state(st, P);
        EXPECT_EQ(rnn.position(), P);
        Vec<S> o(M);
        for (Index i = P; i < N; ++i) {
          rnn.step(Q.row(i), K.row(i), V.row(i), o);
          out.row(i) = o.transpose();
        }
        double e = 0;
        for (Index i = 0; i < N; ++i) e = std::max(e, row_err(out.row(i).transpose(), expected, i, den));
        EXPECT_LE(e, tight_tol<S>()) << tag << " prefill " << P << " then steps";
        EXPECT_LE(test::max_abs_diff(out, one_shot), tight_tol<S>()) << tag << " prefill " << P;
      }
      // Steps, then continue in parallel from rnn.state().
      {
        RecurrentLinearAttention<Map, S> rnn(D, M, phi);
        Mat<S> out(N, M);
        for (Index i = 0; i < P; ++i) out.row(i) = rnn.step(Q.row(i), K.row(i), V.row(i)).transpose();
        linattn::LinearAttentionState<S> st = rnn.state();
        out.bottomRows(N - P) = linattn::causal_linear_attention(
            Q.bottomRows(N - P), K.bottomRows(N - P), V.bottomRows(N - P), phi, st, opts);
        double e = 0;
        for (Index i = 0; i < N; ++i) e = std::max(e, row_err(out.row(i).transpose(), expected, i, den));
        EXPECT_LE(e, tight_tol<S>()) << tag << " " << P << " steps then parallel";
      }
    }
  }
}

TEST(recurrent, PrefillThenStepAndBack) {
  IF_FLOAT(check_handover<float>(EluPlusOne{}));
  IF_DOUBLE(check_handover<double>(EluPlusOne{}));
  IF_FLOAT(check_handover<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_handover<double>(SoftmaxSplit{}));
  IF_FLOAT(check_handover<float>(NormalizedCosine{}));
  IF_DOUBLE(check_handover<double>(NormalizedCosine{}));
  IF_FLOAT(check_handover<float>(Relu{}));
  IF_DOUBLE(check_handover<double>(Relu{}));
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

template <class F>
void expect_invalid(F&& f, const std::string& needle, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << what << ": message \"" << e.what() << "\" lacks \"" << needle << "\"";
  } catch (...) {
    ADD_FAILURE() << what << ": not std::invalid_argument";
  }
}

TEST(recurrent, WrongSizesThrow) {
  const std::string fn = "RecurrentLinearAttention::step";
  RecurrentLinearAttention<EluPlusOne, float> rnn(4, 3);
  const Eigen::VectorXf q4 = Eigen::VectorXf::Ones(4), q5 = Eigen::VectorXf::Ones(5);
  const Eigen::VectorXf v3 = Eigen::VectorXf::Ones(3), v2 = Eigen::VectorXf::Ones(2);
  Eigen::VectorXf out3(3), out4(4);
  expect_invalid([&] { rnn.step(q5, q4, v3); }, fn, "q size");
  expect_invalid([&] { rnn.step(q4, q5, v3); }, fn, "k size");
  expect_invalid([&] { rnn.step(q4, q4, v2); }, fn, "v size");
  expect_invalid([&] { rnn.step(q4, q4, v3, out4); }, fn, "out size");
  const Eigen::MatrixXf q22 = Eigen::MatrixXf::Ones(2, 2);  // 4 entries, but not a vector
  expect_invalid([&] { rnn.step(q22, q4, v3, out3); }, fn, "q not a vector");
  EXPECT_EQ(rnn.position(), 0) << "a rejected step must not advance the sequence";
  EXPECT_EQ(test::max_abs(rnn.state().S), 0.0) << "a rejected step must not touch the state";
  EXPECT_NO_THROW(rnn.step(q4, q4, v3, out3));
  EXPECT_NO_THROW(rnn.step(q4.transpose(), q4.transpose(), v3.transpose(), out3.transpose()));

  // set_state with a state of another shape or another map's kind.
  expect_invalid([&] { rnn.set_state(linattn::make_state<float>(EluPlusOne{}, 5, 3)); },
                 "RecurrentLinearAttention::set_state", "set_state F");
  expect_invalid([&] { rnn.set_state(linattn::make_state<float>(EluPlusOne{}, 4, 2)); },
                 "RecurrentLinearAttention::set_state", "set_state M");
  expect_invalid([&] { rnn.set_state(linattn::make_state<float>(SoftmaxSplit{}, 4, 3)); },
                 "RecurrentLinearAttention::set_state", "set_state with maxima");
  RecurrentLinearAttention<SoftmaxSplit, float> ss(4, 3);
  expect_invalid([&] { ss.set_state(linattn::make_state<float>(EluPlusOne{}, 4, 3)); },
                 "RecurrentLinearAttention::set_state", "set_state without maxima");

  // Constructor.
  expect_invalid([] { RecurrentLinearAttention<EluPlusOne, float> bad(0, 3); }, "RecurrentLinearAttention",
                 "key_dim 0");
  expect_invalid([] { RecurrentLinearAttention<EluPlusOne, float> bad(3, -1); }, "RecurrentLinearAttention",
                 "value_dim -1");
}

// ---------------------------------------------------------------------------------------------
// LinearCrossAttention
// ---------------------------------------------------------------------------------------------

template <class S, class Map>
void check_cross(const Map& phi) {
  const std::string tag = tag_of<Map>() + "/" + test::scalar_name<S>();
  double worst = 0;
  for (const Inputs& sh : kShapes) {
    const Index L = sh.N, N = sh.N / 2 + 3, D = sh.D, M = sh.M;
    const Mat<S> Q = cref::qk_input<S, Map>(N, D, test::seed_of({L, D, 61}));
    const Mat<S> K = cref::qk_input<S, Map>(L, D, test::seed_of({L, D, 62}));
    const Mat<S> V = test::random_matrix<S>(L, M, test::seed_of({L, D, 63}));
    ref::Vec den;
    const MatD expected = ref::linear_attention(cref::to_double(Q), cref::to_double(K), cref::to_double(V), phi, &den);
    const Mat<S> library = linattn::linear_attention(Q, K, V, phi);

    LinearCrossAttention<Map, S> all(D, M, phi), pieces(D, M, phi);
    all.set_memory(K, V);
    // In pieces: an empty one, a single row, then the rest in two.
    const Index c1 = std::min<Index>(1, L), c2 = std::max(c1, L / 2);
    pieces.add_memory(K.topRows(0), V.topRows(0));
    pieces.add_memory(K.topRows(c1), V.topRows(c1));
    pieces.add_memory(K.middleRows(c1, c2 - c1), V.middleRows(c1, c2 - c1));
    pieces.add_memory(K.bottomRows(L - c2), V.bottomRows(L - c2));
    Vec<S> out(M);
    for (Index i = 0; i < N; ++i) {
      const Vec<S> a = all.query(Q.row(i));
      pieces.query(Q.row(i), out);
      const double e = row_err(a, expected, i, den);
      EXPECT_LE(e, tight_tol<S>()) << tag << " query " << i << " L=" << L;
      worst = std::max(worst, e);
      if (den(i) >= kMinDen) {
        EXPECT_LE(test::max_abs_diff(a.transpose(), library.row(i)), tight_tol<S>()) << tag;
        EXPECT_LE(test::max_abs_diff(out, a), tight_tol<S>()) << tag << " add_memory in pieces";
      }
    }
    // set_memory replaces the memory.
    all.set_memory(K.topRows(c1), V.topRows(c1));
    const Mat<S> short_memory = linattn::linear_attention(Q, K.topRows(c1), V.topRows(c1), phi);
    EXPECT_LE(test::max_abs_diff(all.query(Q.row(0)).transpose(), short_memory.row(0)),
              tight_tol<S>(1e3))  // loose: only checks that the old memory is gone
        << tag;
  }
  test::report_error(tag + " cross query vs reference", worst);
}

TEST(recurrent_cross_attention, QueryEqualsLinearAttention) {
  IF_FLOAT(check_cross<float>(EluPlusOne{}));
  IF_DOUBLE(check_cross<double>(EluPlusOne{}));
  IF_FLOAT(check_cross<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_cross<double>(SoftmaxSplit{}));
  IF_FLOAT(check_cross<float>(NormalizedCosine{}));
  IF_DOUBLE(check_cross<double>(NormalizedCosine{}));
  IF_FLOAT(check_cross<float>(Relu{}));
  IF_DOUBLE(check_cross<double>(Relu{}));
}

template <class S, class Map>
void check_cross_empty_and_no_malloc(const Map& phi) {
  const std::string tag = tag_of<Map>() + "/" + test::scalar_name<S>();
  const Index L = 500, N = 400, D = 16, M = 8;
  LinearCrossAttention<Map, S> cross(D, M, phi);
  const Mat<S> Q = cref::qk_input<S, Map>(N, D, 71);
  Vec<S> out = Vec<S>::Constant(M, S(3));
  cross.query(Q.row(0), out);
  EXPECT_EQ(test::max_abs(out), 0.0) << tag << ": an empty memory must give zeros";
  EXPECT_TRUE(test::all_finite(out));

  const Mat<S> K = cref::qk_input<S, Map>(L, D, 72), V = test::random_matrix<S>(L, M, 73);
  cross.set_memory(K, V);
  const Mat<S> expected = linattn::linear_attention(Q, K, V, phi);
  Mat<S> got(N, M);
  int failures = 0;
  {
    NoMallocScope scope;
    for (Index i = 0; i < N; ++i) {
      cross.query(Q.row(i), out);
      got.row(i) = out.transpose();
    }
    failures = scope.failures();
  }
  EXPECT_EQ(failures, 0) << tag << ": query(q, out) allocated";
  EXPECT_LE(test::max_abs_diff(got, expected), tight_tol<S>()) << tag;

  // After set_memory of an empty memory: zeros again.
  cross.set_memory(K.topRows(0), V.topRows(0));
  cross.query(Q.row(1), out);
  EXPECT_EQ(test::max_abs(out), 0.0) << tag;
}

TEST(recurrent_cross_attention, EmptyMemoryGivesZerosAndQueryAllocatesNothing) {
  IF_FLOAT(check_cross_empty_and_no_malloc<float>(EluPlusOne{}));
  IF_DOUBLE(check_cross_empty_and_no_malloc<double>(EluPlusOne{}));
  IF_FLOAT(check_cross_empty_and_no_malloc<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_cross_empty_and_no_malloc<double>(SoftmaxSplit{}));
  IF_FLOAT(check_cross_empty_and_no_malloc<float>(NormalizedCosine{}));
  IF_FLOAT(check_cross_empty_and_no_malloc<float>(Relu{}));
}

TEST(recurrent_cross_attention, WrongSizesThrow) {
  LinearCrossAttention<EluPlusOne, float> cross(4, 3);
  const Eigen::MatrixXf K = Eigen::MatrixXf::Ones(5, 4), V = Eigen::MatrixXf::Ones(5, 3);
  expect_invalid([&] { cross.add_memory(K.leftCols(3), V); }, "LinearCrossAttention::add_memory", "K cols");
  expect_invalid([&] { cross.add_memory(K, V.leftCols(2)); }, "LinearCrossAttention::add_memory", "V cols");
  expect_invalid([&] { cross.add_memory(K, V.topRows(4)); }, "LinearCrossAttention::add_memory", "L");
  expect_invalid([&] { cross.set_memory(K, V.topRows(4)); }, "LinearCrossAttention", "set_memory L");
  Eigen::VectorXf out3(3), out2(2);
  const Eigen::VectorXf q4 = Eigen::VectorXf::Ones(4), q3 = Eigen::VectorXf::Ones(3);
  expect_invalid([&] { cross.query(q3, out3); }, "LinearCrossAttention::query", "q size");
  expect_invalid([&] { cross.query(q4, out2); }, "LinearCrossAttention::query", "out size");
  expect_invalid([] { LinearCrossAttention<EluPlusOne, float> bad(0, 3); }, "LinearCrossAttention", "key_dim 0");
}


// ---------------------------------------------------------------------------------------------
// LinearCrossAttention: strong exception guarantee, const and concurrent queries, matrix queries
// ---------------------------------------------------------------------------------------------

// EluPlusOne that throws std::bad_alloc from its (fail_at + 1)-th call on: an allocation
// failing part-way through absorbing a memory (absorb_keys maps 128 keys per call).
struct FailingMap {
  // Shared by the copies (the object keeps its own copy of the map).
  std::shared_ptr<int> calls = std::make_shared<int>(0);
  std::shared_ptr<int> fail_at = std::make_shared<int>(-1);  // -1: never
  Index feature_dim(Index d) const { return d; }
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x, linattn::MatrixRef<typename Derived::Scalar> phi) const {
    if (*fail_at >= 0 && (*calls)++ >= *fail_at) throw std::bad_alloc();
    EluPlusOne{}.map(x, phi);
  }
};

template <class S, class Map>
Mat<S> query_all(const LinearCrossAttention<Map, S>& cross, const Mat<S>& Q) {
  Mat<S> out(Q.rows(), cross.value_dim());
  Vec<S> o(cross.value_dim());
  for (Index i = 0; i < Q.rows(); ++i) {
    cross.query(Q.row(i), o);
    out.row(i) = o.transpose();
  }
  return out;
}

template <class S>
void expect_same_state(const linattn::LinearAttentionState<S>& a,
                       const linattn::LinearAttentionState<S>& b, const std::string& what) {
  ASSERT_EQ(a.S.rows(), b.S.rows()) << what;
  ASSERT_EQ(a.S.cols(), b.S.cols()) << what;
  ASSERT_EQ(a.m.size(), b.m.size()) << what;
  EXPECT_EQ(test::max_abs_diff(a.S, b.S), 0.0) << what << ": S changed";
  EXPECT_EQ(test::max_abs_diff(a.z, b.z), 0.0) << what << ": z changed";
  if (a.m.size() > 0) {
    EXPECT_TRUE((a.m.array() == b.m.array()).all()) << what << ": m changed";
  }
}

// Regression test: set_memory() used to zero the memory before checking the shapes, so a
// rejected call left an empty memory (queries then returned zeros).
template <class S, class Map>
void check_failed_memory_calls_change_nothing(const Map& phi) {
  const std::string tag = tag_of<Map>() + "/" + test::scalar_name<S>();
  const Index L = 300, N = 20, D = 6, M = 5;
  const Mat<S> Q = cref::qk_input<S, Map>(N, D, 81), K = cref::qk_input<S, Map>(L, D, 82);
  const Mat<S> V = test::random_matrix<S>(L, M, 83);
  LinearCrossAttention<Map, S> cross(D, M, phi);
  cross.set_memory(K, V);
  const auto before = cross.state();
  const Mat<S> answers = query_all(cross, Q);
  ASSERT_GT(test::max_abs(answers), 0.0) << tag;
  const auto unchanged = [&](const std::string& what) {
    expect_same_state(cross.state(), before, tag + ": " + what);
    EXPECT_EQ(test::max_abs_diff(query_all(cross, Q), answers), 0.0)
        << tag << ": " << what << " changed the query results";
  };
  for (const char* fn : {"set_memory", "add_memory"}) {
    const std::string name = std::string("LinearCrossAttention::") + fn;
    const auto call = [&](const auto& k, const auto& v) {
      if (std::string(fn) == "set_memory") {
        cross.set_memory(k, v);
      } else {
        cross.add_memory(k, v);
      }
    };
    expect_invalid([&] { call(K.leftCols(D - 1), V); }, name, std::string(fn) + " K cols");
    unchanged(std::string(fn) + " with K of D - 1 columns");
    expect_invalid([&] { call(K, V.leftCols(M - 1)); }, name, std::string(fn) + " V cols");
    unchanged(std::string(fn) + " with V of M - 1 columns");
    expect_invalid([&] { call(K, V.topRows(L - 1)); }, name, std::string(fn) + " rows");
    unchanged(std::string(fn) + " with K and V of different lengths");
  }
}

TEST(recurrent_cross_attention, RejectedMemoryCallsLeaveTheMemory) {
  IF_FLOAT(check_failed_memory_calls_change_nothing<float>(EluPlusOne{}));
  IF_DOUBLE(check_failed_memory_calls_change_nothing<double>(EluPlusOne{}));
  IF_FLOAT(check_failed_memory_calls_change_nothing<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_failed_memory_calls_change_nothing<double>(NormalizedCosine{}));
}

// The messages name the function called and give both shapes (set_memory's used to name
// add_memory, which the caller never called).
TEST(recurrent_cross_attention, MemoryErrorMessages) {
  LinearCrossAttention<EluPlusOne, float> cross(4, 3);
  const Eigen::MatrixXf K = Eigen::MatrixXf::Ones(5, 4), V = Eigen::MatrixXf::Ones(5, 3);
  const std::string set = "linattn::LinearCrossAttention::set_memory: ",
                    add = "linattn::LinearCrossAttention::add_memory: ";
  const std::string tail = " but must be L x 4 and L x 3";
  expect_invalid([&] { cross.set_memory(K.leftCols(3), V); }, set + "K is 5x3 and V is 5x3" + tail,
                 "set_memory K cols");
  expect_invalid([&] { cross.set_memory(K, V.topRows(4)); }, set + "K is 5x4 and V is 4x3" + tail,
                 "set_memory rows");
  expect_invalid([&] { cross.add_memory(K, V.leftCols(2)); }, add + "K is 5x4 and V is 5x2" + tail,
                 "add_memory V cols");
}

// A failure part-way through absorbing the memory (here std::bad_alloc from the feature map
// on its second block of 128 keys) leaves the previous memory: the strong guarantee.
// Regression test: set_memory() zeroed the state first and both calls updated it in place,
// so the first block was absorbed when the second failed.
TEST(recurrent_cross_attention, FailureWhileAbsorbingLeavesTheMemory) {
  const Index L = 300, N = 16, D = 5, M = 4;
  const Mat<double> Q = test::random_matrix<double>(N, D, 91);
  const Mat<double> K = test::random_matrix<double>(L, D, 92), V = test::random_matrix<double>(L, M, 93);
  FailingMap phi;
  LinearCrossAttention<FailingMap, double> cross(D, M, phi);
  cross.set_memory(K.topRows(40), V.topRows(40));
  const auto before = cross.state();
  const Mat<double> answers = query_all(cross, Q);
  for (const bool set : {true, false}) {
    const std::string what = set ? "set_memory" : "add_memory";
    *phi.calls = 0;
    *phi.fail_at = 1;  // the second block of keys fails
    EXPECT_THROW(set ? cross.set_memory(K, V) : cross.add_memory(K, V), std::bad_alloc) << what;
    EXPECT_EQ(*phi.calls, 2) << what << ": the map was not called as planned";
    *phi.fail_at = -1;
    expect_same_state(cross.state(), before, what + " failing part-way");
    EXPECT_EQ(test::max_abs_diff(query_all(cross, Q), answers), 0.0)
        << what << " failing part-way changed the query results";
  }
  // And the calls work once the map does.
  cross.add_memory(K.bottomRows(L - 40), V.bottomRows(L - 40));
  LinearCrossAttention<EluPlusOne, double> whole(D, M);
  whole.set_memory(K, V);
  const double e = test::max_abs_diff(query_all(cross, Q), query_all(whole, Q));
  EXPECT_LE(e, tight_tol<double>()) << "add_memory after the failures";
}

// query() is const and keeps no scratch in the object: several threads querying one object at
// once get exactly the serial answers. Regression test: query() used to write the query and
// its features into members (q_, pq_), so concurrent queries overwrote each other's.
template <class S, class Map>
void check_concurrent_queries(const Map& phi, Index D, Index M) {
  const std::string tag = tag_of<Map>() + "/" + test::scalar_name<S>();
  const Index L = 200, N = 257;
  const Mat<S> Q = cref::qk_input<S, Map>(N, D, 101), K = cref::qk_input<S, Map>(L, D, 102);
  const Mat<S> V = test::random_matrix<S>(L, M, 103);
  LinearCrossAttention<Map, S> cross(D, M, phi);
  cross.set_memory(K, V);
  const LinearCrossAttention<Map, S>& shared = cross;
  const Mat<S> serial = query_all(shared, Q);
  constexpr int kThreads = 4, kRounds = 40;
  std::vector<Mat<S>> got(kThreads, Mat<S>::Zero(N, M));
  std::atomic<int> mismatches{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([&, t] {
      Vec<S> o(M);
      for (int r = 0; r < kRounds; ++r) {
        for (Index j = 0; j < N; ++j) {
          const Index i = (j * (t + 1) + r) % N;  // threads walk the queries in different orders
          shared.query(Q.row(i), o);
          if (!(o.transpose().array() == serial.row(i).array()).all()) ++mismatches;
          got[static_cast<std::size_t>(t)].row(i) = o.transpose();
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  EXPECT_EQ(mismatches.load(), 0) << tag << ": concurrent queries differ from serial ones";
  for (int t = 0; t < kThreads; ++t)
    EXPECT_EQ(test::max_abs_diff(got[static_cast<std::size_t>(t)], serial), 0.0) << tag << " thread " << t;
}

TEST(recurrent_cross_attention, ConcurrentQueriesEqualSerialOnes) {
  IF_FLOAT(check_concurrent_queries<float>(EluPlusOne{}, 64, 64));
  IF_DOUBLE(check_concurrent_queries<double>(SoftmaxSplit{}, 16, 8));
  IF_FLOAT(check_concurrent_queries<float>(NormalizedCosine{}, 33, 17));
  IF_FLOAT(check_concurrent_queries<float>(EluPlusOne{}, 300, 7));  // beyond the stack bound: heap path
}

// n queries at once (one GEMM) equal n single queries to rounding, in every form: out
// parameter, with a Workspace, returning; against the double reference too.
template <class S, class Map>
void check_matrix_queries(const Map& phi) {
  const std::string tag = tag_of<Map>() + "/" + test::scalar_name<S>();
  double worst = 0, worst_ref = 0;
  for (const Inputs& sh : kShapes) {
    const Index L = sh.N, N = sh.N + 2, D = sh.D, M = sh.M;
    const Mat<S> Q = cref::qk_input<S, Map>(N, D, test::seed_of({L, D, 111}));
    const Mat<S> K = cref::qk_input<S, Map>(L, D, test::seed_of({L, D, 112}));
    const Mat<S> V = test::random_matrix<S>(L, M, test::seed_of({L, D, 113}));
    ref::Vec den;
    const MatD expected = ref::linear_attention(cref::to_double(Q), cref::to_double(K), cref::to_double(V), phi, &den);
    LinearCrossAttention<Map, S> cross(D, M, phi);
    cross.set_memory(K, V);
    const Mat<S> single = query_all(cross, Q);
    Mat<S> out(N, M), out_ws(N, M);
    cross.query(Q, out);
    linattn::Workspace<S> ws;
    cross.query(Q, out_ws, ws);
    const Mat<S> returned = cross.query(Q);
    const RowMat<S> Qr = Q;
    const Mat<S> from_row_major = cross.query(Qr);
    EXPECT_EQ(test::max_abs_diff(returned, out), 0.0) << tag << " returning vs out";
    EXPECT_EQ(test::max_abs_diff(out_ws, out), 0.0) << tag << " workspace vs out";
    // The map may take another (vectorised or not) path over row-major rows: rounding only.
    EXPECT_LE(test::max_abs_diff(from_row_major, out), tight_tol<S>()) << tag << " row-major Q";
    for (Index i = 0; i < N; ++i) {
      if (den(i) < kMinDen) {
        EXPECT_TRUE(test::all_finite(out.row(i))) << tag;
        continue;
      }
      worst = std::max(worst, test::max_abs_diff(out.row(i), single.row(i)));
      worst_ref = std::max(worst_ref, row_err(out.row(i).transpose(), expected, i, den));
    }
    EXPECT_LE(worst, tight_tol<S>()) << tag << " n queries vs single queries, L = " << L;
    EXPECT_LE(worst_ref, tight_tol<S>()) << tag << " n queries vs reference, L = " << L;
    // The rows of a larger matrix, a block as output (another n: the GEMM may round
    // differently), one row, no row.
    Mat<S> big = Mat<S>::Constant(N + 3, M + 2, S(7));
    cross.query(Q.middleRows(1, N - 1), big.block(2, 1, N - 1, M));
    EXPECT_LE(test::max_abs_diff(big.block(2, 1, N - 1, M), out.bottomRows(N - 1)), tight_tol<S>())
        << tag;
    EXPECT_EQ(big(0, 0), S(7)) << tag << " wrote outside the block";
    EXPECT_EQ(big(N + 2, M + 1), S(7)) << tag << " wrote outside the block";
    const Mat<S> one = cross.query(Q.topRows(1));
    EXPECT_EQ(test::max_abs_diff(one, single.topRows(1)), 0.0) << tag << " a 1-row matrix";
    EXPECT_EQ(cross.query(Q.topRows(0)).rows(), 0) << tag;
  }
  test::report_error(tag + " n queries vs single queries", worst);
  test::report_error(tag + " n queries vs reference", worst_ref);
}

TEST(recurrent_cross_attention, MatrixQueriesEqualSingleQueries) {
  IF_FLOAT(check_matrix_queries<float>(EluPlusOne{}));
  IF_DOUBLE(check_matrix_queries<double>(EluPlusOne{}));
  IF_FLOAT(check_matrix_queries<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_matrix_queries<double>(SoftmaxSplit{}));
  IF_FLOAT(check_matrix_queries<float>(NormalizedCosine{}));
  IF_DOUBLE(check_matrix_queries<double>(Relu{}));
}

TEST(recurrent_cross_attention, MatrixQueriesWithWorkspaceAllocateNothing) {
  const Index L = 100, N = 300, D = 16, M = 8;
  const Mat<float> Q = test::random_matrix<float>(N, D, 121), K = test::random_matrix<float>(L, D, 122);
  const Mat<float> V = test::random_matrix<float>(L, M, 123);
  LinearCrossAttention<EluPlusOne, float> cross(D, M);
  cross.set_memory(K, V);
  linattn::Workspace<float> ws;
  Mat<float> out(N, M), again(N, M), fewer(10, M);
  cross.query(Q, out, ws);
  int failures = 0;
  {
    NoMallocScope scope;
    cross.query(Q, again, ws);
    cross.query(Q.topRows(10), fewer, ws);
    failures = scope.failures();
  }
  EXPECT_EQ(failures, 0) << "query(Q, out, ws) allocated with a reused workspace";
  EXPECT_EQ(test::max_abs_diff(again, out), 0.0);
  EXPECT_LE(test::max_abs_diff(fewer, out.topRows(10)), tight_tol<float>());
}

// A single query with key_dim or feature_dim beyond the stack bound still equals the reference.
TEST(recurrent_cross_attention, LargeKeyDimQuery) {
  const Index L = 50, N = 4, D = 300, M = 3;
  const Mat<double> Q = test::random_matrix<double>(N, D, 131), K = test::random_matrix<double>(L, D, 132);
  const Mat<double> V = test::random_matrix<double>(L, M, 133);
  LinearCrossAttention<EluPlusOne, double> cross(D, M);
  cross.set_memory(K, V);
  const Mat<double> expected = linattn::linear_attention(Q, K, V);
  linattn::Workspace<double> ws;
  Vec<double> a(M), b(M);
  for (Index i = 0; i < N; ++i) {
    cross.query(Q.row(i), a);
    cross.query(Q.row(i), b, ws);
    EXPECT_LE(test::max_abs_diff(a.transpose(), expected.row(i)), tight_tol<double>()) << i;
    EXPECT_EQ(test::max_abs_diff(a, b), 0.0) << i;
  }
}

TEST(recurrent_cross_attention, MatrixQueryErrors) {
  LinearCrossAttention<EluPlusOne, float> cross(4, 3);
  const std::string fn = "linattn::LinearCrossAttention::query: ";
  Eigen::MatrixXf out53(5, 3), out52(5, 2), out43(4, 3);
  const Eigen::MatrixXf Q54 = Eigen::MatrixXf::Ones(5, 4), Q53 = Eigen::MatrixXf::Ones(5, 3);
  expect_invalid([&] { cross.query(Q53, out53); }, fn + "Q is 5x3 and out is 5x3 but must be n x 4 and n x 3",
                 "Q cols");
  expect_invalid([&] { cross.query(Q54, out52); }, "out is 5x2", "out cols");
  expect_invalid([&] { cross.query(Q54, out43); }, "out is 4x3", "out rows");
  expect_invalid([&] { (void)cross.query(Q53); }, fn + "Q is 5x3 but must be n x 4", "returning");
  EXPECT_NO_THROW(cross.query(Q54, out53));
}

}  // namespace
