// One long sequence on several threads (ParallelOptions, spec §8): causal_linear_attention()
// and linear_attention() split the rows over threads, summarise, scan the states and compute
// each segment from the state before it. Checked against the one-thread call and the O(N^2)
// reference, for every map and scalar, with masks, carried states, thread counts 1-4 (beyond
// the machine's cores: correctness, not speed) and N from 1 to 2^20; determinism, no allocation
// on repeated calls, errors and exceptions raised on a worker thread.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "causal_reference.hpp"
#include "test_util.hpp"

namespace {

using linattn::CausalAlgorithm;
using linattn::CausalOptions;
using linattn::EluPlusOne;
using linattn::LinearAttentionState;
using linattn::NormalizedCosine;
using linattn::ParallelOptions;
using linattn::SoftmaxSplit;
using test::Index;
using test::Mat;
using test::MatD;

// Splits whatever the length (the default asks for >= 1024 rows a thread, which would keep
// most test sizes on one thread).
ParallelOptions threads(int n) {
  ParallelOptions par;
  par.num_threads = n;
  par.min_rows_per_thread = 1;
  return par;
}

ParallelOptions serial() {
  ParallelOptions par;
  par.num_threads = 1;
  return par;
}

bool threads_available() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

using test::same_bits;

template <class S>
MatD state_sum(const LinearAttentionState<S>& st) {
  MatD s = st.S.template cast<double>() + st.S_lo.template cast<double>();
  if (st.m.size() > 0)
    for (Index d = 0; d < s.rows(); ++d) s.row(d) *= std::exp(double(st.m(d)));
  return s;
}

// Threaded == one thread to rounding (outputs and the state carried out), for T = 1..4 and N
// around the block sizes; and == the double reference. Inputs of magnitude `scale`.
template <class S, class Phi>
void check_causal(const Phi& phi, Index N, Index D, Index M, double scale, std::uint32_t seed) {
  const Mat<S> Q = test::random_matrix<S>(N, D, seed, -scale, scale);
  const Mat<S> K = test::random_matrix<S>(N, D, seed + 1, -scale, scale);
  const Mat<S> V = test::random_matrix<S>(N, M, seed + 2);
  LinearAttentionState<S> st1;
  const Mat<S> one = linattn::causal_linear_attention(Q, K, V, phi, st1, {}, serial());
  const MatD ref = cref::causal(Q.template cast<double>(), K.template cast<double>(),
                                V.template cast<double>(), phi);
  const std::string what = std::string(cref::map_name<Phi>()) + " " + test::scalar_name<S>() +
                            " N=" + std::to_string(N) + " scale=" + std::to_string(scale);
  for (int T = 1; T <= 4; ++T) {
    LinearAttentionState<S> stT;
    const Mat<S> out = linattn::causal_linear_attention(Q, K, V, phi, stT, {}, threads(T));
    const double err = test::max_abs_diff(out, one);
    const double err_ref = test::max_abs_diff(out, ref);
    const double err_state = (state_sum(stT) - state_sum(st1)).cwiseAbs().maxCoeff() /
                             std::max(1e-300, state_sum(st1).cwiseAbs().maxCoeff());
    test::report_error(what + " T=" + std::to_string(T) + " vs one thread", err);
    test::report_error(what + " T=" + std::to_string(T) + " state vs one thread", err_state);
    // Measured: 9e-8 (float, keys of ±100) and 2.2e-16 (double, keys of ±100) against one thread; the
    // states 4.6e-7 and 6.3e-16 relative (SoftmaxSplit, rescaled to different maxima).
    EXPECT_LE(err, test::bound<S>(4e-7, 1e-15)) << what << " T=" << T;
    EXPECT_LE(err_ref, test::bound<S>(4e-6, 1e-13)) << what << " T=" << T << " vs reference";
    EXPECT_LE(err_state, test::bound<S>(1.5e-6, 2e-15)) << what << " T=" << T << " state";
    if (T == 1) {
      EXPECT_TRUE(same_bits(out, one)) << what << ": one thread is the serial kernel";
    }
  }
}

TEST(SequenceSplit, CausalMatchesOneThreadAndReference) {
  if (!threads_available()) GTEST_SKIP() << "built without OpenMP: every call runs serially";
  for (Index N : {Index(1), Index(2), Index(127), Index(300), Index(1001), Index(2500)}) {
    IF_DOUBLE(check_causal<double>(EluPlusOne{}, N, 7, 5, 1.0, 11));
    IF_FLOAT(check_causal<float>(EluPlusOne{}, N, 7, 5, 1.0, 12));
    IF_DOUBLE(check_causal<double>(SoftmaxSplit{}, N, 6, 9, 1.0, 13));
    IF_FLOAT(check_causal<float>(SoftmaxSplit{}, N, 6, 9, 1.0, 14));
    IF_DOUBLE(check_causal<double>(NormalizedCosine{}, N, 5, 3, 1.0, 15));
    IF_FLOAT(check_causal<float>(NormalizedCosine{}, N, 5, 3, 1.0, 16));
  }
}

TEST(SequenceSplit, CausalLargeMagnitudes) {
  if (!threads_available()) GTEST_SKIP() << "built without OpenMP";
  // Keys of ±100: SoftmaxSplit's segment maxima are e^±100 apart and merge by rescaling.
  IF_FLOAT(check_causal<float>(SoftmaxSplit{}, 1500, 4, 6, 100.0, 21));
  IF_DOUBLE(check_causal<double>(SoftmaxSplit{}, 1500, 4, 6, 100.0, 22));
  IF_FLOAT(check_causal<float>(EluPlusOne{}, 1500, 4, 6, 100.0, 23));
}

TEST(SequenceSplit, CausalChunkedAlgorithm) {
  if (!threads_available()) GTEST_SKIP() << "built without OpenMP";
  // The chunked algorithm's segments start at multiples of its chunk (here 40).
  const Mat<double> Q = test::random_matrix<double>(1234, 8, 31);
  const Mat<double> K = test::random_matrix<double>(1234, 8, 32);
  const Mat<double> V = test::random_matrix<double>(1234, 6, 33);
  CausalOptions opts;
  opts.algorithm = CausalAlgorithm::Chunked;
  opts.chunk_size = 40;
  for (int T = 2; T <= 4; ++T) {
    const Mat<double> a = linattn::causal_linear_attention(Q, K, V, SoftmaxSplit{}, opts, serial());
    const Mat<double> b = linattn::causal_linear_attention(Q, K, V, SoftmaxSplit{}, opts, threads(T));
    EXPECT_LE(test::max_abs_diff(a, b), 4e-15) << "T=" << T;
  }
}

TEST(SequenceSplit, CarriedStateInAndOut) {
  if (!threads_available()) GTEST_SKIP() << "built without OpenMP";
  // Continue from a state (a prompt's), split the rest: outputs and the final state agree with
  // the one-thread call from the same state.
  for (int T = 2; T <= 4; ++T) {
    const Mat<float> Q = test::random_matrix<float>(3000, 16, 41);
    const Mat<float> K = test::random_matrix<float>(3000, 16, 42);
    const Mat<float> V = test::random_matrix<float>(3000, 12, 43);
    LinearAttentionState<float> prompt;
    (void)linattn::causal_linear_attention(Q.topRows(700), K.topRows(700), V.topRows(700),
                                           SoftmaxSplit{}, prompt, {}, serial());
    LinearAttentionState<float> a = prompt, b = prompt;
    const auto rest = [](const Mat<float>& X) { return X.bottomRows(2300); };
    const Mat<float> oa = linattn::causal_linear_attention(rest(Q), rest(K), rest(V),
                                                           SoftmaxSplit{}, a, {}, serial());
    const Mat<float> ob = linattn::causal_linear_attention(rest(Q), rest(K), rest(V),
                                                           SoftmaxSplit{}, b, {}, threads(T));
    EXPECT_LE(test::max_abs_diff(oa, ob), 2e-6) << "T=" << T;
    EXPECT_LE((state_sum(a) - state_sum(b)).cwiseAbs().maxCoeff() /
                  state_sum(a).cwiseAbs().maxCoeff(),
              2e-6)
        << "T=" << T;
    // A RecurrentLinearAttention continues from the split call's state.
    linattn::RecurrentLinearAttention<SoftmaxSplit, float> rnn(16, 12);
    rnn.set_state(b);
    const Eigen::VectorXf q = Eigen::VectorXf::Constant(16, 0.5f);
    const Eigen::VectorXf y = rnn.step(q, q, Eigen::VectorXf::Constant(12, 1.0f));
    EXPECT_TRUE(y.allFinite());
  }
}

TEST(SequenceSplit, DeterministicForAThreadCount) {
  if (!threads_available()) GTEST_SKIP() << "built without OpenMP";
  const Mat<float> Q = test::random_matrix<float>(5000, 32, 51);
  const Mat<float> K = test::random_matrix<float>(5000, 32, 52);
  const Mat<float> V = test::random_matrix<float>(5000, 32, 53);
  for (int T = 2; T <= 4; ++T) {
    LinearAttentionState<float> s1, s2;
    const Mat<float> a = linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, s1, {}, threads(T));
    const Mat<float> b = linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, s2, {}, threads(T));
    EXPECT_TRUE(same_bits(a, b)) << "T=" << T;
    EXPECT_TRUE(same_bits(s1.S, s2.S) && same_bits(s1.S_lo, s2.S_lo)) << "T=" << T;
    const Mat<float> c = linattn::linear_attention(Q, K, V, EluPlusOne{}, threads(T));
    const Mat<float> d = linattn::linear_attention(Q, K, V, EluPlusOne{}, threads(T));
    EXPECT_TRUE(same_bits(c, d)) << "T=" << T;
  }
}

template <class S, class Phi>
void check_noncausal(const Phi& phi, Index N, Index L, Index D, Index M, std::uint32_t seed) {
  const Mat<S> Q = test::random_matrix<S>(N, D, seed);
  const Mat<S> K = test::random_matrix<S>(L, D, seed + 1);
  const Mat<S> V = test::random_matrix<S>(L, M, seed + 2);
  const Mat<S> one = linattn::linear_attention(Q, K, V, phi, serial());
  for (int T = 1; T <= 4; ++T) {
    const Mat<S> out = linattn::linear_attention(Q, K, V, phi, threads(T));
    const double err = test::max_abs_diff(out, one);
    test::report_error(std::string("non-causal ") + cref::map_name<Phi>() + " " +
                           test::scalar_name<S>() + " N=" + std::to_string(N) +
                           " L=" + std::to_string(L) + " T=" + std::to_string(T),
                       err);
    // Measured: 1.9e-8 (float) and 2.1e-17 (double).
    EXPECT_LE(err, test::bound<S>(1e-7, 2e-16)) << "N=" << N << " L=" << L << " T=" << T;
  }
}

TEST(SequenceSplit, NonCausalMatchesOneThread) {
  if (!threads_available()) GTEST_SKIP() << "built without OpenMP";
  for (auto [N, L] : std::vector<std::pair<Index, Index>>{{1, 1}, {1, 900}, {900, 1}, {0, 500},
                                                          {500, 0}, {1003, 2049}, {2500, 300}}) {
    IF_FLOAT(check_noncausal<float>(EluPlusOne{}, N, L, 9, 4, 61));
    IF_DOUBLE(check_noncausal<double>(SoftmaxSplit{}, N, L, 9, 4, 62));
    IF_FLOAT(check_noncausal<float>(SoftmaxSplit{}, N, L, 9, 4, 63));
    IF_DOUBLE(check_noncausal<double>(NormalizedCosine{}, N, L, 9, 4, 64));
  }
}

TEST(SequenceSplit, MasksBothKernels) {
  if (!threads_available()) GTEST_SKIP() << "built without OpenMP";
  const Index N = 1700;
  const MatD Q = test::random_matrix<double>(N, 6, 71), K = test::random_matrix<double>(N, 6, 72);
  const MatD V = test::random_matrix<double>(N, 5, 73);
  const cref::BoolVec keep = cref::random_mask(N, 74, 0.3);
  const MatD ref = cref::masked_causal(Q, K, V, keep, SoftmaxSplit{});
  for (int T = 1; T <= 4; ++T) {
    const MatD out = linattn::masked_causal_linear_attention(Q, K, V, keep, SoftmaxSplit{}, {}, threads(T));
    EXPECT_LE(test::max_abs_diff(out, ref), 1e-13) << "causal T=" << T;
    const MatD a = linattn::masked_linear_attention(Q, K, V, keep, EluPlusOne{}, serial());
    const MatD b = linattn::masked_linear_attention(Q, K, V, keep, EluPlusOne{}, threads(T));
    EXPECT_LE(test::max_abs_diff(a, b), 4e-15) << "non-causal T=" << T;
  }
}

TEST(SequenceSplit, LongFloatSequence) {
  if (!threads_available()) GTEST_SKIP() << "built without OpenMP";
  // N = 2^20 in float: the split (whose segments start from summed states) is as accurate as
  // one thread; both against the double one-thread result.
  const Index N = Index(1) << 20;
  const Mat<float> Q = test::random_matrix<float>(N, 4, 81), K = test::random_matrix<float>(N, 4, 82);
  const Mat<float> V = test::random_matrix<float>(N, 4, 83);
  const MatD exact = linattn::causal_linear_attention(Q.cast<double>(), K.cast<double>(),
                                                      V.cast<double>(), EluPlusOne{}, {}, serial());
  const double err1 = test::max_abs_diff(
      linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, {}, serial()), exact);
  for (int T = 2; T <= 4; ++T) {
    const double errT = test::max_abs_diff(
        linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, {}, threads(T)), exact);
    test::report_error("N=2^20 float T=" + std::to_string(T), errT);
    EXPECT_LE(errT, std::max(2 * err1, 1e-6)) << "T=" << T << " (one thread: " << err1 << ")";
  }
}

TEST(SequenceSplit, MultiHeadWithFewerHeadsThanThreads) {
  // One head (or one sequence of one head) and more threads: the multi-head and batched forms
  // split the head's rows like the single-head call with the same options, bit for bit; and
  // agree with one thread to rounding. Carried states and masks too.
  const Index N = 2000;
  const Mat<double> Q = test::random_matrix<double>(N, 6, 131), K = test::random_matrix<double>(N, 6, 132);
  const Mat<double> V = test::random_matrix<double>(N, 5, 133);
  const cref::BoolVec keep = cref::random_mask(N, 134, 0.25);
  for (int T = 2; T <= 4; ++T) {
    LinearAttentionState<double> single;
    const Mat<double> want = linattn::causal_linear_attention(Q, K, V, SoftmaxSplit{}, single, {}, threads(T));
    Mat<double> out(N, 5);
    linattn::MultiHeadWorkspace<double> ws;
    std::vector<LinearAttentionState<double>> states(1);
    linattn::multihead_causal_linear_attention(Q, K, V, 1, SoftmaxSplit{}, states, out, ws, {},
                                               threads(T));
    EXPECT_TRUE(same_bits(out, want)) << "T=" << T;
    EXPECT_TRUE(same_bits(states[0].S, single.S)) << "T=" << T;
    const Mat<double> serial_out = linattn::causal_linear_attention(Q, K, V, SoftmaxSplit{}, {}, serial());
    EXPECT_LE(test::max_abs_diff(out, serial_out), 2e-16) << "T=" << T;
    const Mat<double> nc = linattn::multihead_linear_attention(Q, K, V, 1, EluPlusOne{}, threads(T));
    EXPECT_TRUE(same_bits(nc, linattn::linear_attention(Q, K, V, EluPlusOne{}, threads(T))))
        << "T=" << T;
    const Mat<double> masked = linattn::masked_multihead_causal_linear_attention(
        Q, K, V, keep, 1, EluPlusOne{}, {}, threads(T));
    EXPECT_LE(test::max_abs_diff(masked, cref::masked_causal(Q, K, V, keep, EluPlusOne{})), 1e-13)
        << "T=" << T;
  }
}

TEST(SequenceSplit, AutomaticSelection) {
  // Default options: short sequences stay on the calling thread (bit for bit the serial
  // kernel), and so do calls from inside a parallel region.
  const Mat<float> Q = test::random_matrix<float>(1500, 64, 91), K = test::random_matrix<float>(1500, 64, 92);
  const Mat<float> V = test::random_matrix<float>(1500, 64, 93);
  ParallelOptions two;
  two.num_threads = 2;  // default min_rows_per_thread: 1024 rows a thread for F·M = 4096
  const Mat<float> one = linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, {}, serial());
  EXPECT_TRUE(same_bits(one, linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, {}, two)));
  EXPECT_EQ(linattn::detail::sequence_split_threads(two, 1500, 64 * 64), 1);
  EXPECT_EQ(linattn::detail::sequence_split_threads(two, 2048, 64 * 64), threads_available() ? 2 : 1);
  EXPECT_EQ(linattn::detail::sequence_split_threads(two, 2048, 8 * 8), 1);  // 65536 rows a thread
#ifdef _OPENMP
  int inside = -1;
#pragma omp parallel num_threads(2)
  {
#pragma omp single
    inside = linattn::detail::sequence_split_threads(threads(4), 1 << 20, 4096);
  }
  EXPECT_EQ(inside, 1);
#endif
}

TEST(SequenceSplit, RepeatedCallsAllocateNothing) {
  const Mat<float> Q = test::random_matrix<float>(3000, 16, 101), K = test::random_matrix<float>(3000, 16, 102);
  const Mat<float> V = test::random_matrix<float>(3000, 8, 103);
  const Eigen::Matrix<bool, Eigen::Dynamic, 1> keep = cref::random_mask(3000, 104, 0.2);
  Mat<float> out(3000, 8);
  linattn::Workspace<float> ws;
  LinearAttentionState<float> st;
  const auto run = [&] {
    st.reset();
    linattn::causal_linear_attention(Q, K, V, SoftmaxSplit{}, st, out, ws, {}, threads(3));
    st.reset();
    linattn::masked_causal_linear_attention(Q, K, V, keep, SoftmaxSplit{}, st, out, ws, {},
                                            threads(3));
    linattn::linear_attention(Q, K, V, SoftmaxSplit{}, out, ws, threads(3));
    linattn::masked_linear_attention(Q, K, V, keep, SoftmaxSplit{}, out, ws, threads(3));
  };
  run();  // sizes the per-thread workspaces and states
  const std::size_t bytes = ws.bytes();
#ifdef EIGEN_RUNTIME_NO_MALLOC
  Eigen::internal::set_is_malloc_allowed(false);
#endif
  run();
  run();
#ifdef EIGEN_RUNTIME_NO_MALLOC
  Eigen::internal::set_is_malloc_allowed(true);
#endif
  EXPECT_GE(ws.bytes(), bytes);
  if (threads_available()) {
    EXPECT_GT(bytes, 3 * sizeof(float) * 16 * 8u);  // per-thread states
  }
}

// A user map that throws on a marked row: the exception of a worker thread reaches the caller.
struct ThrowsOnMarker {
  Eigen::Index feature_dim(Eigen::Index d) const { return d; }
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x,
           linattn::MatrixRef<typename Derived::Scalar> phi) const {
    if ((x.array() == typename Derived::Scalar(999)).any())
      throw std::runtime_error("marker row");
    phi = x.array().exp().matrix();
  }
};

TEST(SequenceSplit, WorkerExceptionsReachTheCaller) {
  Mat<double> Q = test::random_matrix<double>(2000, 4, 111), K = test::random_matrix<double>(2000, 4, 112);
  const Mat<double> V = test::random_matrix<double>(2000, 3, 113);
  K(1900, 2) = 999;  // in the last segment (its thread's causal phase) for every T
  for (int T = 1; T <= 4; ++T) {
    EXPECT_THROW((void)linattn::causal_linear_attention(Q, K, V, ThrowsOnMarker{}, {}, threads(T)),
                 std::runtime_error)
        << "T=" << T;
    EXPECT_THROW((void)linattn::linear_attention(Q, K, V, ThrowsOnMarker{}, threads(T)),
                 std::runtime_error)
        << "T=" << T;
  }
  K(1900, 2) = 0;
  K(10, 0) = 999;  // in the first segment's summary
  for (int T = 1; T <= 4; ++T)
    EXPECT_THROW((void)linattn::causal_linear_attention(Q, K, V, ThrowsOnMarker{}, {}, threads(T)),
                 std::runtime_error)
        << "T=" << T;
}

TEST(SequenceSplit, ErrorsBeforeAnyThreadStarts) {
  const Mat<float> Q = test::random_matrix<float>(3000, 8, 121), K = test::random_matrix<float>(2999, 8, 122);
  const Mat<float> V = test::random_matrix<float>(3000, 4, 123);
  test::expect_invalid(
      [&] { (void)linattn::causal_linear_attention(Q, K, V, EluPlusOne{}, {}, threads(4)); },
      {"causal_linear_attention", "3000x8", "2999x8"}, "causal N != L");
  Mat<float> out(3000, 5);
  linattn::Workspace<float> ws;
  LinearAttentionState<float> st;
  test::expect_invalid(
      [&] {
        linattn::causal_linear_attention(Q, Q, V, EluPlusOne{}, st, out, ws, {}, threads(4));
      },
      std::vector<std::string>{"causal_linear_attention", "3000x5"}, "causal output shape");
  test::expect_invalid(
      [&] { linattn::linear_attention(Q, K, V.topRows(10), EluPlusOne{}, out, ws, threads(4)); },
      {"linear_attention", "2999x8", "10x4"}, "non-causal K/V rows");
}

}  // namespace
