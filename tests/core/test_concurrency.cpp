// Concurrency: the kernels called at the same time from several std::threads on shared,
// read-only inputs, each thread with its own outputs, workspaces and states, give the serial
// results bit for bit (spec: the library keeps no global mutable state; a Workspace, a state
// and an output belong to one caller at a time).
//
// .ci/test also builds this test alone with -fsanitize=thread and OpenMP off (build/tsan,
// LINATTN_TSAN=ON), where ThreadSanitizer reports any data race between the threads; in the
// other builds it checks the results only. libgomp is not TSan-instrumented, hence OpenMP off
// there; here the multi-head kernels ask for two OpenMP threads inside each std::thread.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <atomic>
#include <ios>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "causal_reference.hpp"
#include "test_util.hpp"

namespace {

using linattn::CausalAlgorithm;
using linattn::CausalOptions;
using test::Index;
using test::Mat;

constexpr int kThreads = 4;
constexpr int kRepeats = 2;  // the second round reuses sized workspaces and states
constexpr Index kHeads = 3;

template <class S>
struct Inputs {
  // One head: N x D queries and keys, N x M values (N crosses the 256-row blocks and, in the
  // softmax tiles, the 128-key tiles); H heads side by side for the multi-head kernels.
  Index N = 300, D = 16, M = 8;
  Mat<S> Q, K, V, QH, KH, VH;
  Eigen::Array<bool, Eigen::Dynamic, 1> keep;
  Inputs()
      : Q(test::random_matrix<S>(N, D, 1)),
        K(test::random_matrix<S>(N, D, 2)),
        V(test::random_matrix<S>(N, M, 3)),
        QH(test::random_matrix<S>(N, kHeads * D, 4)),
        KH(test::random_matrix<S>(N, kHeads * D, 5)),
        VH(test::random_matrix<S>(N, kHeads * M, 6)),
        keep(N) {
    for (Index j = 0; j < N; ++j) keep(j) = (j % 7) != 3;
  }
};

// What one caller owns: outputs and workspaces (the causal states are local to the calls).
template <class S>
struct Scratch {
  linattn::Workspace<S> ws;
  linattn::MultiHeadWorkspace<S> mws;
  std::vector<Mat<S>> out;
};

const std::vector<std::string>& kernel_names() {
  static const std::vector<std::string> names = {
      "linear EluPlusOne",         "linear NormalizedCosine",   "masked linear",
      "causal chunked EluPlusOne", "causal chunked SoftmaxSplit", "causal recurrent EluPlusOne",
      "causal recurrent NormalizedCosine", "masked causal chunked", "softmax tiled",
      "causal softmax tiled",      "multihead linear",          "multihead causal",
      "multihead softmax",         "multihead causal softmax",
  };
  return names;
}

// Every kernel once, through the out + workspace overloads.
template <class S>
void run_all(const Inputs<S>& in, Scratch<S>& s) {
  s.out.resize(kernel_names().size());
  const Index N = in.N, M = in.M;
  for (std::size_t i = 0; i < s.out.size(); ++i) s.out[i].resize(N, i < 10 ? M : kHeads * M);
  linattn::ParallelOptions par;
  par.num_threads = 2;  // OpenMP inside each std::thread (serial without OpenMP),
  par.min_work_per_thread = 0;  // however small the calls (ParallelOptions' cost model)
  std::size_t k = 0;
  linattn::linear_attention(in.Q, in.K, in.V, linattn::EluPlusOne{}, s.out[k++], s.ws);
  linattn::linear_attention(in.Q, in.K, in.V, linattn::NormalizedCosine{}, s.out[k++], s.ws);
  linattn::masked_linear_attention(in.Q, in.K, in.V, in.keep, linattn::EluPlusOne{}, s.out[k++],
                                   s.ws);
  const auto causal = [&](const auto& phi, const CausalOptions& opts) {
    linattn::LinearAttentionState<S> state;  // sized by the call for its map
    linattn::causal_linear_attention(in.Q, in.K, in.V, phi, state, s.out[k++], s.ws, opts);
  };
  causal(linattn::EluPlusOne{}, cref::options(CausalAlgorithm::Chunked, 64));
  causal(linattn::SoftmaxSplit{}, cref::options(CausalAlgorithm::Chunked, 64));
  causal(linattn::EluPlusOne{}, cref::options(CausalAlgorithm::Recurrent, 0));
  causal(linattn::NormalizedCosine{}, cref::options(CausalAlgorithm::Recurrent, 0));
  {
    linattn::LinearAttentionState<S> st;  // the masked kernel sizes its own
    linattn::masked_causal_linear_attention(in.Q, in.K, in.V, in.keep, linattn::EluPlusOne{}, st,
                                            s.out[k++], s.ws,
                                            cref::options(CausalAlgorithm::Chunked, 32));
  }
  linattn::softmax_attention(in.Q, in.K, in.V, s.out[k++], s.ws);
  linattn::causal_softmax_attention(in.Q, in.K, in.V, s.out[k++], s.ws);
  linattn::multihead_linear_attention(in.QH, in.KH, in.VH, kHeads, linattn::EluPlusOne{},
                                      s.out[k++], s.mws, par);
  linattn::multihead_causal_linear_attention(in.QH, in.KH, in.VH, kHeads, linattn::EluPlusOne{},
                                             s.out[k++], s.mws, CausalOptions{}, par);
  linattn::multihead_softmax_attention(in.QH, in.KH, in.VH, kHeads, s.out[k++], s.mws,
                                       linattn::SoftmaxAlgorithm::Tiled, par);
  linattn::multihead_causal_softmax_attention(in.QH, in.KH, in.VH, kHeads, s.out[k++], s.mws,
                                              linattn::SoftmaxAlgorithm::Tiled, par);
  ASSERT_EQ(k, kernel_names().size());
}

template <class S>
void check_concurrent_equals_serial() {
  const Inputs<S> in;
  Scratch<S> serial;
  run_all(in, serial);
  for (const Mat<S>& o : serial.out) ASSERT_TRUE(test::all_finite(o));

  std::vector<Scratch<S>> scratch(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&in, &scratch, t] {
      for (int r = 0; r < kRepeats; ++r) run_all(in, scratch[static_cast<std::size_t>(t)]);
    });
  for (std::thread& th : threads) th.join();

  for (int t = 0; t < kThreads; ++t)
    for (std::size_t i = 0; i < serial.out.size(); ++i)
      EXPECT_EQ(test::max_abs_diff(scratch[static_cast<std::size_t>(t)].out[i], serial.out[i]),
                0.0)
          << test::scalar_name<S>() << " " << kernel_names()[i] << ", thread " << t;
}

// float only: the kernels' code (and so any shared state) is the same template for double,
// and this TU is the whole ThreadSanitizer stage of .ci/test, where every instantiation costs.
TEST(Concurrency, ThreadsOnSharedInputsEqualSerial) { check_concurrent_equals_serial<float>(); }

// Two threads stepping their own recurrent layers over the same token stream.
TEST(Concurrency, RecurrentLayersPerThreadEqualSerial) {
  const Index D = 8, M = 4, T = 50;
  const Mat<float> Q = test::random_matrix<float>(T, kHeads * D, 11);
  const Mat<float> K = test::random_matrix<float>(T, kHeads * D, 12);
  const Mat<float> V = test::random_matrix<float>(T, kHeads * M, 13);
  const auto run = [&](Mat<float>& out) {
    linattn::MultiHeadRecurrentLinearAttention<linattn::EluPlusOne, float> layer(kHeads, D, M);
    out.resize(T, kHeads * M);
    Eigen::VectorXf o(kHeads * M);
    for (Index t = 0; t < T; ++t) {
      layer.step(Q.row(t).transpose(), K.row(t).transpose(), V.row(t).transpose(), o);
      out.row(t) = o.transpose();
    }
  };
  Mat<float> serial;
  run(serial);
  std::vector<Mat<float>> outs(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&run, &outs, t] { run(outs[static_cast<std::size_t>(t)]); });
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t)
    EXPECT_EQ(test::max_abs_diff(outs[static_cast<std::size_t>(t)], serial), 0.0) << "thread " << t;
}

// The const members of the decoders only read: four threads calling state() and save_state()
// on one const object at once (the delta rule's last update still pending) get the serial
// results, and ThreadSanitizer sees no write.
TEST(Concurrency, DecoderStateFromFourThreadsOnOneObject) {
  const Index D = 8, M = 20, T = 30;
  const Mat<float> Q = test::random_matrix<float>(T, D, 14);
  const Mat<float> K = test::random_matrix<float>(T, D, 15);
  const Mat<float> V = test::random_matrix<float>(T, M, 16);
  linattn::RecurrentDeltaRule<linattn::L2Normalize<linattn::Identity>, float> delta(D, M);
  linattn::RecurrentGatedAttention<linattn::Identity, float> gated(D, M);
  Eigen::VectorXf o(M);
  for (Index t = 0; t < T; ++t) {
    delta.step(Q.row(t), K.row(t), V.row(t), 0.8f, -0.05f, o);
    gated.step(Q.row(t), K.row(t), V.row(t), -0.05f, o);
  }
  const auto& cdelta = delta;
  const auto& cgated = gated;
  const auto bytes = [](const auto& rnn) {
    std::ostringstream os(std::ios::binary);
    linattn::save_state(os, rnn);
    return os.str();
  };
  const Mat<float> delta_S = cdelta.state().S, gated_S = cgated.state().S;
  const std::string delta_file = bytes(cdelta), gated_file = bytes(cgated);
  std::vector<int> same(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      bool ok = true;
      for (int r = 0; r < 3; ++r) {
        ok = ok && test::max_abs_diff(Mat<float>(cdelta.state().S), delta_S) == 0.0;
        ok = ok && test::max_abs_diff(Mat<float>(cgated.state().S), gated_S) == 0.0;
        ok = ok && bytes(cdelta) == delta_file && bytes(cgated) == gated_file;
      }
      same[static_cast<std::size_t>(t)] = ok ? 1 : 0;
    });
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t)
    EXPECT_EQ(same[static_cast<std::size_t>(t)], 1) << "thread " << t;
  // The next step after all these reads continues as if none had happened.
  linattn::RecurrentDeltaRule<linattn::L2Normalize<linattn::Identity>, float> twin(D, M);
  Eigen::VectorXf o2(M);
  for (Index t = 0; t < T; ++t) twin.step(Q.row(t), K.row(t), V.row(t), 0.8f, -0.05f, o2);
  delta.step(Q.row(0), K.row(0), V.row(0), 0.8f, -0.05f, o);
  twin.step(Q.row(0), K.row(0), V.row(0), 0.8f, -0.05f, o2);
  EXPECT_EQ(test::max_abs_diff(o, o2), 0.0);
}

// ---------------------------------------------------------------------------------------------
// ParallelOptions::executor: the library's parallel loops on the caller's threads.
// Here an executor that starts a std::thread per task but the first (run on the calling
// thread), and counts its calls and tasks. Without OpenMP (the ThreadSanitizer stage) this is
// the only way the kernels run on several threads, and TSan checks the tasks for races.
// ---------------------------------------------------------------------------------------------

struct CountingExecutor {
  std::atomic<int> calls{0};
  std::atomic<Index> tasks{0};
  std::atomic<int> calls_from_tasks{0};  // calls made from inside a task (must stay 0)

  linattn::Executor executor() {
    return [this](Index n, linattn::FunctionRef<void(Index)> task) {
      if (linattn::detail::in_executor_task()) ++calls_from_tasks;
      ++calls;
      tasks += n;
      std::vector<std::thread> spawned;
      for (Index t = 1; t < n; ++t) spawned.emplace_back([&task, t] { task(t); });
      if (n > 0) task(0);
      for (std::thread& th : spawned) th.join();
    };
  }
};

linattn::ParallelOptions serial_options() {
  linattn::ParallelOptions par;
  par.num_threads = 1;
  return par;
}

// One long sequence split over 3 executor tasks (spec §8): two calls of the executor (the
// summaries, then the reads), the same bits as OpenMP with 3 threads, and the one-thread
// result to rounding. Non-causal and causal.
TEST(Concurrency, ExecutorRunsTheSequenceSplitAsOpenMpDoes) {
  const Index N = 3001, D = 16, M = 8;
  const Mat<float> Q = test::random_matrix<float>(N, D, 21);
  const Mat<float> K = test::random_matrix<float>(N, D, 22);
  const Mat<float> V = test::random_matrix<float>(N, M, 23);
  CountingExecutor counter;
  linattn::ParallelOptions par;
  par.num_threads = 3;
  par.min_rows_per_thread = 256;
  par.executor = counter.executor();
  linattn::ParallelOptions omp = par;
  omp.executor = nullptr;

  const Mat<float> causal_one =
      linattn::causal_linear_attention(Q, K, V, linattn::EluPlusOne{}, {}, serial_options());
  const Mat<float> causal_pool =
      linattn::causal_linear_attention(Q, K, V, linattn::EluPlusOne{}, {}, par);
  EXPECT_EQ(counter.calls.load(), 2);
  EXPECT_EQ(counter.tasks.load(), 6);
  // Measured 7.5e-9 against one thread (the summaries' sums in another order); non-causal 3.7e-9.
  EXPECT_LE(test::max_abs_diff(causal_pool, causal_one), 4e-8);
  EXPECT_GT(test::max_abs_diff(causal_pool, causal_one), 0.0) << "the split did not run";

  const Mat<float> linear_one =
      linattn::linear_attention(Q, K, V, linattn::EluPlusOne{}, serial_options());
  const Mat<float> linear_pool = linattn::linear_attention(Q, K, V, linattn::EluPlusOne{}, par);
  EXPECT_EQ(counter.calls.load(), 4);
  EXPECT_LE(test::max_abs_diff(linear_pool, linear_one), 2e-8);
  EXPECT_EQ(counter.calls_from_tasks.load(), 0);
#ifdef _OPENMP
  const Mat<float> causal_omp = linattn::causal_linear_attention(Q, K, V, linattn::EluPlusOne{},
                                                                 {}, omp);
  const Mat<float> linear_omp = linattn::linear_attention(Q, K, V, linattn::EluPlusOne{}, omp);
  if (omp_get_dynamic() == 0) {  // a dynamic runtime may give fewer threads than asked for
    EXPECT_EQ(test::max_abs_diff(causal_pool, causal_omp), 0.0) << "not OpenMP's partition";
    EXPECT_EQ(test::max_abs_diff(linear_pool, linear_omp), 0.0) << "not OpenMP's partition";
  }
#endif
}

// The (sequence, head) tasks of the multi-head kernels and of the batched decode step on the
// executor: the one-thread bits (every head is computed alone, whatever thread runs it), and
// calls too small to pay for threads never reach the executor.
TEST(Concurrency, ExecutorRunsMultiHeadAndDecodeTasks) {
  const Inputs<float> in;
  CountingExecutor counter;
  linattn::ParallelOptions par;
  par.num_threads = 3;
  par.min_work_per_thread = 0;
  par.executor = counter.executor();
  linattn::MultiHeadWorkspace<float> ws;
  Mat<float> pool(in.N, kHeads * in.M), one(in.N, kHeads * in.M);
  linattn::multihead_causal_linear_attention(in.QH, in.KH, in.VH, kHeads, linattn::EluPlusOne{},
                                             pool, ws, CausalOptions{}, par);
  linattn::multihead_causal_linear_attention(in.QH, in.KH, in.VH, kHeads, linattn::EluPlusOne{},
                                             one, ws, CausalOptions{}, serial_options());
  EXPECT_EQ(counter.calls.load(), 1);
  EXPECT_EQ(test::max_abs_diff(pool, one), 0.0);

  const Index B = 5, D = 8, M = 4, steps = 12;
  linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float> dec(B, kHeads, D, M),
      dec1(B, kHeads, D, M);
  Mat<float> y(B, kHeads * M), y1(B, kHeads * M);
  for (Index s = 0; s < steps; ++s) {
    const Mat<float> q = test::random_matrix<float>(B, kHeads * D, test::seed_of({s, 31}));
    const Mat<float> k = test::random_matrix<float>(B, kHeads * D, test::seed_of({s, 32}));
    const Mat<float> v = test::random_matrix<float>(B, kHeads * M, test::seed_of({s, 33}));
    dec.step(q, k, v, y, par);
    dec1.step(q, k, v, y1, serial_options());
    ASSERT_EQ(test::max_abs_diff(y, y1), 0.0) << "step " << s;
  }
  EXPECT_EQ(counter.calls.load(), 1 + int(steps));

  // The default grain: one small step is below it and runs on the calling thread.
  linattn::ParallelOptions grain = par;
  grain.min_work_per_thread = linattn::ParallelOptions::kDefaultMinWorkPerThread;
  dec.step(test::random_matrix<float>(B, kHeads * D, 41),
           test::random_matrix<float>(B, kHeads * D, 42),
           test::random_matrix<float>(B, kHeads * M, 43), y, grain);
  EXPECT_EQ(counter.calls.load(), 1 + int(steps)) << "a call below the grain used the executor";
  EXPECT_EQ(counter.calls_from_tasks.load(), 0);
}

// run_team (parallel.hpp), the one place that hands tasks to an executor: a call from inside a
// task runs its tasks on that thread (never the executor again: a pool whose threads all wait
// would deadlock), every task runs once, and an exception of a task reaches the caller after
// the executor has returned.
TEST(Concurrency, ExecutorTasksNeverCallTheExecutorAndExceptionsReachTheCaller) {
  CountingExecutor counter;
  const linattn::Executor ex = counter.executor();
  std::atomic<int> ran{0}, nested_ran{0};
  const int team = linattn::detail::run_team(4, &ex, [&](int t, int T) {
    EXPECT_TRUE(linattn::detail::in_executor_task());
    EXPECT_EQ(T, 4);
    ran += 1 << (4 * t);
    linattn::detail::run_team(3, &ex, [&](int, int) { ++nested_ran; });
  });
  EXPECT_EQ(team, 4);
  EXPECT_EQ(ran.load(), 0x1111);
  EXPECT_EQ(nested_ran.load(), 12);
  EXPECT_EQ(counter.calls.load(), 1);
  EXPECT_FALSE(linattn::detail::in_executor_task());
  linattn::ParallelOptions par;
  par.executor = ex;
  EXPECT_EQ(linattn::detail::resolve_threads(par),
            std::max(1, static_cast<int>(std::thread::hardware_concurrency())));
#if LINATTN_HAS_EXCEPTIONS
  std::atomic<int> after{0};
  EXPECT_THROW(linattn::detail::run_team(3, &ex,
                                         [&](int t, int) {
                                           if (t == 1) throw std::runtime_error("task 1");
                                           ++after;
                                         }),
               std::runtime_error);
  EXPECT_EQ(after.load(), 2);
#endif
}

}  // namespace
