// The layers' vectorised activations split over threads: the short convolution (its channels),
// the gated RMSNorm and the gates (their rows) give the same bits on 3 tasks of an executor
// (run in reverse order, so with or without OpenMP) as on one thread, and the same bits on
// row-major inputs (the kernels read them in place, on packets) as on column-major ones (read
// entry by entry).
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cstdint>
#include <linattn/core/gates.hpp>
#include <linattn/layers/gated_rms_norm.hpp>
#include <linattn/layers/short_convolution.hpp>
#include <vector>

#include "test_util.hpp"

namespace {

using test::Index;
template <class S>
using Rows = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class S>
using Cols = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic>;

// Three tasks, the last first: a split of the work that OpenMP would not give in order.
linattn::ParallelOptions three_tasks() {
  linattn::ParallelOptions par;
  par.num_threads = 3;
  par.min_work_per_thread = 0;
  par.executor = [](Index n, linattn::FunctionRef<void(Index)> task) {
    for (Index i = n; i-- > 0;) task(i);
  };
  return par;
}

linattn::ParallelOptions one_thread() {
  linattn::ParallelOptions par;
  par.num_threads = 1;
  return par;
}

template <class S>
Rows<S> rand_rows(Index rows, Index cols, std::uint32_t seed, double lo = -3, double hi = 3) {
  return test::random_matrix<double>(rows, cols, seed, lo, hi).cast<S>();
}

template <class S>
void conv_splits() {
  // 200 channels: blocks of 64 give the three tasks ranges of different lengths and a tail.
  const Index C = 200, W = 4;
  const std::vector<int> cu = {0, 4, 4, 11};
  const Rows<S> X = rand_rows<S>(cu.back(), C, 1);
  const Cols<S> w = rand_rows<S>(C, W, 2, -1, 1);
  const Eigen::Matrix<S, Eigen::Dynamic, 1> b = rand_rows<S>(C, 1, 3, -1, 1);
  linattn::Workspace<S> ws;
  const linattn::ShortConvOptions opts;  // SiLU
  std::vector<linattn::ShortConvState<S>> s1, s3, sc;
  Rows<S> y1(X.rows(), C), y3(X.rows(), C);
  Cols<S> yc(X.rows(), C);
  linattn::batched_short_convolution(X, w, b, cu, s1, y1, ws, opts, one_thread());
  linattn::batched_short_convolution(X, w, b, cu, s3, y3, ws, opts, three_tasks());
  linattn::batched_short_convolution(Cols<S>(X), Rows<S>(w), b, cu, sc, yc, ws, opts,
                                     three_tasks());
  EXPECT_EQ(y3, y1);
  EXPECT_EQ(Rows<S>(yc), y1);
  for (std::size_t i = 0; i < s1.size(); ++i) {
    EXPECT_EQ(s3[i], s1[i]) << i;
    EXPECT_EQ(sc[i], s1[i]) << i;
  }
  // A decode step of the three sequences, split or not, from row-major or column-major tokens.
  const Rows<S> x = rand_rows<S>(3, C, 4);
  Rows<S> t1(3, C), t3(3, C);
  Cols<S> tc(3, C);
  linattn::short_convolution_step(x, w, b, s1, t1, ws, opts, one_thread());
  linattn::short_convolution_step(x, w, b, s3, t3, ws, opts, three_tasks());
  linattn::short_convolution_step(Cols<S>(x), w, b, sc, tc, ws, opts, three_tasks());
  EXPECT_EQ(t3, t1);
  EXPECT_EQ(Rows<S>(tc), t1);
  for (std::size_t i = 0; i < s1.size(); ++i) EXPECT_EQ(s3[i], s1[i]) << i;
}

template <class S>
void norm_splits() {
  const Index N = 7, M = 13, H = 3;
  const Rows<S> o = rand_rows<S>(N, H * M, 5), z = rand_rows<S>(N, H * M, 6);
  const Eigen::Matrix<S, Eigen::Dynamic, 1> w = rand_rows<S>(M, 1, 7, -1, 1);
  for (const auto gate : {linattn::NormGate::Silu, linattn::NormGate::Sigmoid}) {
    linattn::GatedRMSNormOptions opts;
    opts.gate = gate;
    Rows<S> y1(N, H * M), y3(N, H * M);
    Cols<S> yc(N, H * M);
    linattn::gated_rms_norm(o, z, w, y1, opts, one_thread());
    linattn::gated_rms_norm(o, z, w, y3, opts, three_tasks());
    linattn::gated_rms_norm(Cols<S>(o), Cols<S>(z), w * S(1), yc, opts, three_tasks());
    EXPECT_EQ(y3, y1);
    EXPECT_EQ(Rows<S>(yc), y1);
  }
}

template <class S>
void gate_splits() {
  const Index N = 9, H = 3, C = 5;
  const Rows<S> a = rand_rows<S>(N, H * C, 8, -25, 25), b = rand_rows<S>(N, H, 9, -10, 10);
  const Eigen::Matrix<S, Eigen::Dynamic, 1> A_log = rand_rows<S>(H, 1, 10, -1, 1),
                                            dt = rand_rows<S>(H * C, 1, 11, -1, 1);
  for (const auto act :
       {linattn::GateActivation::Softplus, linattn::GateActivation::LowerBoundSigmoid}) {
    linattn::GateOptions opts;
    opts.activation = act;
    Rows<S> g1(N, H * C), g3(N, H * C);
    Cols<S> gc(N, H * C);
    linattn::gate_activation(a, A_log, dt, g1, opts, one_thread());
    linattn::gate_activation(a, A_log, dt, g3, opts, three_tasks());
    linattn::gate_activation(Cols<S>(a), A_log, dt, gc, opts, three_tasks());
    EXPECT_EQ(g3, g1);
    EXPECT_EQ(Rows<S>(gc), g1);
  }
  Rows<S> beta1(N, H), beta3(N, H);
  Cols<S> betac(N, H);
  linattn::beta_activation(b, beta1, true, one_thread());
  linattn::beta_activation(b, beta3, true, three_tasks());
  linattn::beta_activation(Cols<S>(b), betac, true, three_tasks());
  EXPECT_EQ(beta3, beta1);
  EXPECT_EQ(Rows<S>(betac), beta1);
}

TEST(layer_kernel_threads, ConvolutionChannelsSplit) {
  conv_splits<float>();
  conv_splits<double>();
}

TEST(layer_kernel_threads, NormRowsSplit) {
  norm_splits<float>();
  norm_splits<double>();
}

TEST(layer_kernel_threads, GateRowsSplit) {
  gate_splits<float>();
  gate_splits<double>();
}

}  // namespace
