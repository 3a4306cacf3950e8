// Batched linear attention layers (spec §6): LinearAttentionLayer::BatchedState,
// the packed prefill forward(X, cu_seqlens, states) and the batched step(Xb, states, Yb) against
// B single-sequence layers (forward(prompt, state) then step), through 150 steps (past the fold
// cadence of 128), with sequences added, removed, stepped in subsets and prefilled again
// mid-stream; a decoder saved and loaded continues bit for bit; errors; no allocation per step.
//
// The no-allocation checks need EIGEN_RUNTIME_NO_MALLOC before any Eigen header (see
// test_serving.cpp) and count global operator new too.
#ifndef EIGEN_RUNTIME_NO_MALLOC
#define EIGEN_RUNTIME_NO_MALLOC
#endif
#include "eigen_assert_hook.hpp"  // first: before any Eigen header

#include "allocation_count.hpp"

#include <linattn/linattn.hpp>
#include <linattn/state_io.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace {

using linattn::EluPlusOne;
using linattn::LinearAttentionLayer;
using test::Index;
using test::Mat;

struct LayerShape {
  Index d_model, heads, key_dim, value_dim;
};

template <class S>
LinearAttentionLayer<EluPlusOne, S> make_layer(const LayerShape& sh, std::uint32_t seed) {
  LinearAttentionLayer<EluPlusOne, S> layer(sh.d_model, sh.heads, sh.key_dim, sh.value_dim);
  layer.reset_parameters(seed);
  // Biases that are not zero, so that the batched step adds them too.
  layer.bq = test::random_matrix<S>(layer.bq.size(), 1, seed + 1, -0.5, 0.5);
  layer.bk = test::random_matrix<S>(layer.bk.size(), 1, seed + 2, -0.5, 0.5);
  layer.bv = test::random_matrix<S>(layer.bv.size(), 1, seed + 3, -0.5, 0.5);
  layer.bo = test::random_matrix<S>(layer.bo.size(), 1, seed + 4, -0.5, 0.5);
  return layer;
}

// B single-sequence states beside the batched one: the reference of every check.
template <class S>
struct Reference {
  using Layer = LinearAttentionLayer<EluPlusOne, S>;
  const Layer& layer;
  std::vector<typename Layer::State> states;
  double max_err = 0, max_out = 0;

  // Rows of the batched output against the single-sequence ones.
  void compare(const Mat<S>& batched, const Mat<S>& single) {
    max_err = std::max(max_err, test::max_abs_diff(batched, single));
    max_out = std::max(max_out, test::max_abs(single));
  }
  // Prefill: each sequence's rows through forward(rows, state) (none: untouched).
  template <class Off>
  void prefill(const Mat<S>& X, const Off& cu, const Mat<S>& Y) {
    for (std::size_t b = 0; b + 1 < cu.size(); ++b) {
      const Index r0 = cu[b], n = cu[b + 1] - cu[b];
      if (n == 0) continue;
      compare(Y.middleRows(r0, n), layer.forward(X.middleRows(r0, n), states[b]));
    }
  }
  void step(const Mat<S>& Xb, const Mat<S>& Yb, const std::vector<Index>& rows_to_seq) {
    Eigen::Matrix<S, Eigen::Dynamic, 1> y(layer.d_model());
    for (std::size_t r = 0; r < rows_to_seq.size(); ++r) {
      layer.step(Xb.row(Index(r)).transpose(), states[std::size_t(rows_to_seq[r])], y);
      compare(Yb.row(Index(r)), y.transpose());
    }
  }
};

std::vector<Index> iota(Index n) {
  std::vector<Index> v(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) v[std::size_t(i)] = i;
  return v;
}

// B = 4 steps through one matrix-vector product per row, B = 8 through the micro-kernel (B >= 6).
template <class S>
void check_against_single(const LayerShape& sh, Index B) {
  const auto layer = make_layer<S>(sh, 7);
  const std::string tag = "d_model=" + std::to_string(sh.d_model) + " H=" +
                          std::to_string(sh.heads) + " B=" + std::to_string(B) + " " +
                          test::scalar_name<S>();
  Reference<S> ref{layer, {}};
  for (Index b = 0; b < B; ++b) ref.states.push_back(layer.make_state());
  auto batch = layer.make_batched_state(B);
  ASSERT_EQ(batch.sequences(), B);

  // Prompts of 5, 0, 9, 1 (, 0, 3, 4, 1) tokens, int32 offsets.
  std::vector<std::int32_t> cu = {0, 5, 5, 14, 15, 15, 18, 22, 23};
  cu.resize(std::size_t(B + 1));
  const Mat<S> P = test::random_matrix<S>(cu.back(), sh.d_model, 11);
  const Mat<S> Y = layer.forward(P, cu, batch);
  ref.prefill(P, cu, Y);
  for (Index b = 0; b < B; ++b) EXPECT_EQ(batch.position(b), cu[std::size_t(b + 1)] - cu[std::size_t(b)]);

  Mat<S> Yb(B, sh.d_model);
  std::uint32_t seed = 100;
  const auto steps = [&](Index count) {
    for (Index t = 0; t < count; ++t) {
      const Mat<S> Xb = test::random_matrix<S>(batch.sequences(), sh.d_model, seed++);
      Yb.resize(batch.sequences(), sh.d_model);
      layer.step(Xb, batch, Yb);
      ref.step(Xb, Yb, iota(batch.sequences()));
    }
  };
  steps(150);
  for (Index b = 0; b < B; ++b) EXPECT_EQ(batch.position(b), ref.states[std::size_t(b)].position());

  // Sequence 1 ends (the last takes its number), a new one comes and is prefilled alone while
  // sequence 0 continues with a prefill of 3 rows after its 150 steps.
  batch.remove_sequence(1);
  ref.states[1] = ref.states.back();
  ref.states.pop_back();
  EXPECT_EQ(batch.add_sequence(), B - 1);
  ref.states.push_back(layer.make_state());
  std::vector<Index> cu2(std::size_t(B + 1), 3);  // 3 rows for sequence 0, 7 for the new one
  cu2[0] = 0;
  cu2[std::size_t(B)] = 10;
  const Mat<S> P2 = test::random_matrix<S>(10, sh.d_model, 12);
  Mat<S> Y2(10, sh.d_model);
  layer.forward(P2, cu2, batch, Y2);
  ref.prefill(P2, cu2, Y2);
  steps(20);

  // A subset: sequences 2 and 0 only.
  Eigen::VectorXi active(2);
  active << 2, 0;
  for (int t = 0; t < 5; ++t) {
    const Mat<S> X2 = test::random_matrix<S>(2, sh.d_model, seed++);
    Mat<S> Y2s(2, sh.d_model);
    layer.step(active, X2, batch, Y2s);
    ref.step(X2, Y2s, {2, 0});
  }
  steps(10);
  for (Index b = 0; b < batch.sequences(); ++b)
    EXPECT_EQ(batch.position(b), ref.states[std::size_t(b)].position()) << tag;

  // Measured (x86-64 GCC 12, -O1 SSE2 and -O3 -march=native AVX2): at most 1.6e-7 in float and
  // 2.1e-16 in double, relative to max(1, max |y|): the projections sum in another order (the
  // micro-kernel over the batch against Eigen's matrix-vector product); the heads are the same.
  const double err = ref.max_err / std::max(1.0, ref.max_out);
  test::report_error("batched layer vs single layers " + tag, err);
  EXPECT_LE(err, test::bound<S>(8e-7, 1e-15)) << tag;
}

TEST(BatchedLayer, PrefillAndStepsEqualSingleSequenceLayers) {
  for (const LayerShape& sh : {LayerShape{12, 3, 4, 4}, LayerShape{10, 2, 3, 6}}) {
    for (const Index B : {Index(4), Index(8)}) {
      IF_FLOAT(check_against_single<float>(sh, B));
      IF_DOUBLE(check_against_single<double>(sh, B));
    }
  }
}

// The batched step is the single step's attention on the same q, k, v: a slots step of one
// sequence equals a batched step with B = 1 bit for bit, and a state of B = 0 steps nothing.
TEST(BatchedLayer, EmptyBatchAndDefaultCapacity) {
  const auto layer = make_layer<float>({12, 3, 4, 4}, 3);
  auto batch = layer.make_batched_state();
  EXPECT_EQ(batch.sequences(), 0);
  Mat<float> X0(0, 12), Y0(0, 12);
  layer.step(X0, batch, Y0);
  const std::vector<int> cu = {0};
  layer.forward(X0, cu, batch, Y0);
  EXPECT_EQ(batch.add_sequence(), 0);
  EXPECT_GE(batch.capacity(), 1);
  Mat<float> X = test::random_matrix<float>(1, 12, 5), Y(1, 12);
  layer.step(X, batch, Y);
  EXPECT_EQ(batch.position(0), 1);
  // Yb may be Xb's memory.
  Mat<float> XY = X;
  auto copy = batch;
  layer.step(X, batch, Y);
  layer.step(XY, copy, XY);
  EXPECT_TRUE(test::same_bits(XY, Y));
}

template <class S>
void check_save_load() {
  const auto layer = make_layer<S>({12, 3, 4, 4}, 9);
  auto batch = layer.make_batched_state(4);
  const std::vector<Index> cu = {0, 2, 9, 9, 10};
  const Mat<S> P = test::random_matrix<S>(10, 12, 21);
  layer.forward(P, cu, batch);
  Mat<S> Yb(4, 12), Yr(4, 12);
  std::uint32_t seed = 300;
  for (int t = 0; t < 70; ++t) layer.step(test::random_matrix<S>(4, 12, seed++), batch, Yb);
  std::stringstream file, through_decoder;
  linattn::save_state(file, batch);
  linattn::save_state(through_decoder, batch.decoder());
  EXPECT_EQ(file.str(), through_decoder.str());  // the BatchedState's file is its decoder's
  auto resumed = layer.make_batched_state();
  linattn::load_state(file, resumed);
  ASSERT_EQ(resumed.sequences(), 4);
  for (Index b = 0; b < 4; ++b) EXPECT_EQ(resumed.position(b), batch.position(b));
  // 140 more steps: past the next fold of every head; then a prefill and more steps.
  bool same = true;
  for (int t = 0; t < 140; ++t) {
    const Mat<S> Xb = test::random_matrix<S>(4, 12, seed++);
    layer.step(Xb, batch, Yb);
    layer.step(Xb, resumed, Yr);
    same = same && test::same_bits(Yb, Yr);
  }
  EXPECT_TRUE(same) << test::scalar_name<S>();
  const Mat<S> P2 = test::random_matrix<S>(6, 12, 22);
  const std::vector<Index> cu2 = {0, 1, 1, 5, 6};
  EXPECT_TRUE(test::same_bits(layer.forward(P2, cu2, batch), layer.forward(P2, cu2, resumed)));
  for (int t = 0; t < 10; ++t) {
    const Mat<S> Xb = test::random_matrix<S>(4, 12, seed++);
    layer.step(Xb, batch, Yb);
    layer.step(Xb, resumed, Yr);
    EXPECT_TRUE(test::same_bits(Yb, Yr)) << test::scalar_name<S>() << " step " << t;
  }
}

TEST(BatchedLayer, SavedDecoderResumesBitForBit) {
  IF_FLOAT(check_save_load<float>());
  IF_DOUBLE(check_save_load<double>());
}

template <class S>
void check_no_allocation(const LayerShape& sh, Index B) {
  const auto layer = make_layer<S>(sh, 5);
  auto batch = layer.make_batched_state(B);
  Mat<S> Xb = test::random_matrix<S>(B, sh.d_model, 1), Yb(B, sh.d_model);
  Eigen::VectorXi active(2);
  active << 3, 1;
  Mat<S> X2 = Xb.topRows(2), Y2(2, sh.d_model);
  layer.step(Xb, batch, Yb);  // warm-up
  layer.step(active, X2, batch, Y2);
  const test::Allocations a = test::allocations_in([&] {
    for (int t = 0; t < 200; ++t) layer.step(Xb, batch, Yb);  // folds included
    layer.step(active, X2, batch, Y2);
    layer.step(Xb.block(0, 0, B, sh.d_model), batch, Yb.block(0, 0, B, sh.d_model));
  });
  EXPECT_EQ(a.eigen, 0) << test::scalar_name<S>() << " d_model=" << sh.d_model;
  EXPECT_EQ(a.news, 0) << test::scalar_name<S>() << " d_model=" << sh.d_model;
  // After add_sequence (within capacity) still nothing: capacity doubled ahead.
  batch.remove_sequence(0);
  batch.add_sequence();
  const test::Allocations b = test::allocations_in([&] { layer.step(Xb, batch, Yb); });
  EXPECT_EQ(b.eigen + b.news, 0) << test::scalar_name<S>();
}

TEST(BatchedLayer, StepAllocatesNothing) {
  // With Eigen on one thread (its parallel GEMM would allocate; the batched step uses none, but
  // the single-sequence paths of the warm-up might).
  Eigen::setNbThreads(1);
  for (const Index B : {Index(4), Index(8)}) {
    IF_FLOAT(check_no_allocation<float>({12, 3, 4, 4}, B));
    IF_DOUBLE(check_no_allocation<double>({12, 3, 4, 4}, B));
    IF_FLOAT(check_no_allocation<float>({256, 4, 64, 64}, B));
  }
}

template <class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no exception)";
}

TEST(BatchedLayer, ErrorsNameTheFunctionAndTheShapes) {
  const auto layer = make_layer<float>({12, 3, 4, 4}, 1);
  auto batch = layer.make_batched_state(4);
  Mat<float> Xb(3, 12), Yb(4, 12);
  Xb.setZero();
  std::string m = message_of([&] { layer.step(Xb, batch, Yb); });
  EXPECT_NE(m.find("LinearAttentionLayer::step"), std::string::npos) << m;
  EXPECT_NE(m.find("3x12"), std::string::npos) << m;
  EXPECT_NE(m.find("4x12"), std::string::npos) << m;
  EXPECT_EQ(batch.position(0), 0);
  Mat<float> Yc(4, 11), X4 = Mat<float>::Zero(4, 12);
  m = message_of([&] { layer.step(X4, batch, Yc); });
  EXPECT_NE(m.find("4x11"), std::string::npos) << m;

  Eigen::VectorXi bad(2);
  bad << 1, 1;
  Mat<float> X2 = Mat<float>::Zero(2, 12), Y2(2, 12);
  m = message_of([&] { layer.step(bad, X2, batch, Y2); });
  EXPECT_NE(m.find("repeats"), std::string::npos) << m;
  bad << 0, 4;
  m = message_of([&] { layer.step(bad, X2, batch, Y2); });
  EXPECT_NE(m.find("outside"), std::string::npos) << m;
  for (Index b = 0; b < 4; ++b) EXPECT_EQ(batch.position(b), 0);

  const Mat<float> P = Mat<float>::Zero(6, 12);
  m = message_of([&] { layer.forward(P, std::vector<int>{0, 6}, batch); });
  EXPECT_NE(m.find("LinearAttentionLayer::forward"), std::string::npos) << m;
  EXPECT_NE(m.find("B + 1 = 5"), std::string::npos) << m;
  m = message_of([&] { layer.forward(P, std::vector<int>{0, 1, 2, 3, 5}, batch); });
  EXPECT_NE(m.find("cu_seqlens must start at 0 and end at 6"), std::string::npos) << m;
  m = message_of([&] { layer.forward(P, std::vector<int>{0, 3, 2, 4, 6}, batch); });
  EXPECT_NE(m.find("must not decrease"), std::string::npos) << m;
  const Mat<float> P11 = Mat<float>::Zero(6, 11);
  m = message_of([&] { layer.forward(P11, std::vector<int>{0, 1, 2, 3, 6}, batch); });
  EXPECT_NE(m.find("6x11"), std::string::npos) << m;
  Mat<float> Ybad(5, 12);
  m = message_of([&] { layer.forward(P, std::vector<int>{0, 1, 2, 3, 6}, batch, Ybad); });
  EXPECT_NE(m.find("5x12"), std::string::npos) << m;
  for (Index b = 0; b < 4; ++b) EXPECT_EQ(batch.position(b), 0);

  const auto other = make_layer<float>({12, 2, 6, 6}, 1);
  auto foreign = other.make_batched_state(4);
  m = message_of([&] { layer.step(X4, foreign, Yb); });
  EXPECT_NE(m.find("another shape"), std::string::npos) << m;
  m = message_of([&] { layer.make_batched_state(-1); });
  EXPECT_NE(m.find("make_batched_state"), std::string::npos) << m;
}

}  // namespace
