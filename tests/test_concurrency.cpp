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

#include <string>
#include <thread>
#include <vector>

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

}  // namespace
