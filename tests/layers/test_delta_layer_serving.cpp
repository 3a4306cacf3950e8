// The serving side of the delta-rule layers (GatedDeltaNetLayer, KimiDeltaAttentionLayer):
// extend() against as many step() calls, bit for bit; rollback() against a batch fed only the
// accepted tokens; save_state() / load_state() of the batched state, round trip and every error
// path; the allocation-free calls. One layer type per scalar type of the build keeps the
// group's compile short.
#ifndef EIGEN_RUNTIME_NO_MALLOC
#define EIGEN_RUNTIME_NO_MALLOC
#endif
// clang-format off
#include "eigen_assert_hook.hpp"  // first: before any Eigen header
#include "allocation_count.hpp"  // counts Eigen allocations and global operator new
// clang-format on

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cstdint>
#include <cstring>
#include <limits>
#include <linattn/layers.hpp>
#include <linattn/serving.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "layer_reference.hpp"
#include "test_util.hpp"

namespace {

using test::Index;
using test::layer_ref::inputs;

// Both layers in every build, one scalar type each when the build has both.
#if defined(LINATTN_TEST_FLOAT) && defined(LINATTN_TEST_DOUBLE)
using ServedLayers = ::testing::Types<linattn::GatedDeltaNetLayer<double>,
                                      linattn::KimiDeltaAttentionLayer<float>>;
#elif defined(LINATTN_TEST_FLOAT)
using ServedLayers = ::testing::Types<linattn::GatedDeltaNetLayer<float>,
                                      linattn::KimiDeltaAttentionLayer<float>>;
#else
using ServedLayers = ::testing::Types<linattn::GatedDeltaNetLayer<double>,
                                      linattn::KimiDeltaAttentionLayer<double>>;
#endif

template <class L>
struct Served;
template <class S>
struct Served<linattn::GatedDeltaNetLayer<S>> {
  using Scalar = S;
  // 1 key head shared by 2 value heads, Dk = 6 != Dv = 5.
  static linattn::GatedDeltaNetLayer<S> make(Index w, Index d = 28) {
    linattn::GatedDeltaNetConfig c;
    c.hidden_size = d;
    c.linear_num_key_heads = 1;
    c.linear_num_value_heads = 2;
    c.linear_key_head_dim = 6;
    c.linear_value_head_dim = 5;
    c.linear_conv_kernel_dim = w;
    return linattn::GatedDeltaNetLayer<S>(c, 11);
  }
};
template <class S>
struct Served<linattn::KimiDeltaAttentionLayer<S>> {
  using Scalar = S;
  // 2 heads, K = 6 != V = 5.
  static linattn::KimiDeltaAttentionLayer<S> make(Index w, Index d = 28) {
    linattn::KimiDeltaAttentionConfig c;
    c.hidden_size = d;
    c.num_heads = 2;
    c.head_dim = 6;
    c.head_v_dim = 5;
    c.short_conv_kernel_size = w;
    return linattn::KimiDeltaAttentionLayer<S>(c, 11);
  }
};

template <class S>
using Mat = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic>;

template <class D1, class D2>
bool same_bits(const Eigen::DenseBase<D1>& a, const Eigen::DenseBase<D2>& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
  for (Index i = 0; i < a.rows(); ++i)
    for (Index j = 0; j < a.cols(); ++j) {
      const auto x = a.derived().coeff(i, j), y = b.derived().coeff(i, j);
      if (std::memcmp(&x, &y, sizeof x) != 0) return false;
    }
  return true;
}

// Two sequences' layer states, bit for bit; an empty convolution state is zeros.
template <class Batch>
void expect_same_state(const Batch& got_batch, Index got_b, const Batch& want_batch, Index want_b,
                       const std::string& what) {
  const auto got = got_batch.state(got_b), want = want_batch.state(want_b);
  EXPECT_EQ(got.position, want.position) << what;
  const Index L = got_batch.conv_kernel_size() - 1, C = got_batch.conv_channels();
  using Conv = std::decay_t<decltype(got.conv)>;
  const Conv zeros = Conv::Zero(L, C);
  EXPECT_TRUE(same_bits(got.conv.size() ? got.conv : zeros, want.conv.size() ? want.conv : zeros))
      << what << ": convolution state";
  ASSERT_EQ(got.heads.size(), want.heads.size()) << what;
  for (std::size_t h = 0; h < got.heads.size(); ++h)
    EXPECT_TRUE(same_bits(got.heads[h].S, want.heads[h].S)) << what << ": head " << h;
}

// `message` contains every needle.
template <class Call>
void throws_naming(const Call& call, const std::vector<std::string>& needles,
                   const std::string& what) {
  try {
    call();
    ADD_FAILURE() << what << ": no exception";
  } catch (const std::exception& e) {
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << what << ": \"" << e.what() << "\" does not name \"" << n << "\"";
  }
}

template <class L>
class DeltaLayerServing : public ::testing::Test {
 protected:
  using S = typename Served<L>::Scalar;
  using Batch = typename L::BatchedState;

  // B sequences with some history (two steps of all, and a third for sequence 0), sequence
  // B − 1 left new when `fresh_last`.
  static Batch primed(const L& layer, Index B, bool fresh_last = false) {
    Batch batch = layer.make_batched_state(B);
    const Index d = batch.hidden_size();
    Mat<S> Y(B, d);
    for (std::uint32_t t = 0; t < 2; ++t) layer.step(inputs<S>(B, d, 40 + t), batch, Y);
    const Eigen::VectorXi zero = Eigen::VectorXi::Zero(1);
    layer.extend(inputs<S>(1, d, 43), zero, std::vector<int>{0, 1}, batch, Mat<S>(1, d));
    if (fresh_last) batch.set_state(B - 1, layer.make_state());
    return batch;
  }

  // Sequence slots(i) of `before` fed rows [cu[i], cu[i+1]) of X by step() calls, the other
  // rows of each step arbitrary: the rows' outputs go to Y, the batches after to `after`.
  static void by_steps(const L& layer, const Batch& before, const Eigen::VectorXi& slots,
                       const std::vector<int>& cu, const Mat<S>& X, Mat<S>& Y,
                       std::vector<Batch>& after) {
    const Index B = before.sequences(), d = before.hidden_size();
    Y.resize(X.rows(), d);
    after.assign(static_cast<std::size_t>(slots.size()), before);
    for (Index i = 0; i < slots.size(); ++i) {
      Mat<S> xb = inputs<S>(B, d, 90), yb(B, d);
      for (int r = cu[std::size_t(i)]; r < cu[std::size_t(i) + 1]; ++r) {
        xb.row(slots(i)) = X.row(r);
        layer.step(xb, after[std::size_t(i)], yb);
        Y.row(r) = yb.row(slots(i));
      }
    }
  }
};

TYPED_TEST_SUITE(DeltaLayerServing, ServedLayers, );

TYPED_TEST(DeltaLayerServing, ExtendEqualsAsManySteps) {
  using S = typename TestFixture::S;
  for (const Index W : {1, 3, 4}) {
    const TypeParam layer = Served<TypeParam>::make(W);
    const Index d = 28;
    auto batch = TestFixture::primed(layer, 3, true);
    const auto before = batch;
    const Eigen::VectorXi slots = (Eigen::VectorXi(2) << 2, 0).finished();
    const std::vector<int> cu = {0, 4, 7};  // 4 tokens of the new sequence 2, 3 of sequence 0
    const Mat<S> X = inputs<S>(7, d, 50);
    Mat<S> Y(7, d), want;
    layer.extend(X, slots, cu, batch, Y);
    std::vector<typename TestFixture::Batch> stepped;
    TestFixture::by_steps(layer, before, slots, cu, X, want, stepped);
    const std::string what = "W = " + std::to_string(W);
    EXPECT_TRUE(same_bits(Y, want)) << what << ": outputs";
    expect_same_state(batch, 2, stepped[0], 2, what + ", sequence 2");
    expect_same_state(batch, 0, stepped[1], 0, what + ", sequence 0");
    expect_same_state(batch, 1, before, 1, what + ", sequence 1 (not in the call)");
    EXPECT_EQ(batch.state(2).position, 4);

    // A slot of no tokens does not move; Y may be X's memory.
    const auto mid = batch;
    Mat<S> XY = inputs<S>(2, d, 51);
    const Mat<S> X2 = XY;
    const Eigen::VectorXi slots2 = (Eigen::VectorXi(2) << 1, 2).finished();
    const std::vector<int> cu2 = {0, 0, 2};
    layer.extend(XY, slots2, cu2, batch, XY);
    TestFixture::by_steps(layer, mid, slots2, cu2, X2, want, stepped);
    EXPECT_TRUE(same_bits(XY, want)) << what << ": outputs in place";
    expect_same_state(batch, 1, mid, 1, what + ", sequence 1 (no tokens)");
    expect_same_state(batch, 2, stepped[1], 2, what + ", sequence 2 again");
  }
}

TYPED_TEST(DeltaLayerServing, ExtendProjectsAsTheBatchsStep) {
  // hidden_size 300: the projections' depth takes two blocks, where the matrix-vector product
  // of a step of fewer than 6 sequences and the micro-kernel of 7 token rows round apart.
  using S = typename TestFixture::S;
  const TypeParam layer = Served<TypeParam>::make(4, 300);
  auto batch = TestFixture::primed(layer, 2);
  const auto before = batch;
  const Eigen::VectorXi slots = (Eigen::VectorXi(2) << 1, 0).finished();
  const std::vector<int> cu = {0, 3, 7};
  const Mat<S> X = inputs<S>(7, 300, 52);
  Mat<S> Y(7, 300), want;
  layer.extend(X, slots, cu, batch, Y);
  std::vector<typename TestFixture::Batch> stepped;
  TestFixture::by_steps(layer, before, slots, cu, X, want, stepped);
  EXPECT_TRUE(same_bits(Y, want));
  expect_same_state(batch, 1, stepped[0], 1, "sequence 1");
  expect_same_state(batch, 0, stepped[1], 0, "sequence 0");
}

TYPED_TEST(DeltaLayerServing, ExtendAndRollbackAllocateNothing) {
  using S = typename TestFixture::S;
  const TypeParam layer = Served<TypeParam>::make(4);
  auto batch = TestFixture::primed(layer, 3);
  batch.keep_snapshots(3);
  const Eigen::VectorXi slots = (Eigen::VectorXi(2) << 2, 0).finished();
  const std::vector<int> cu = {0, 4, 7};
  const Mat<S> X = inputs<S>(7, 28, 53);
  Mat<S> Y(7, 28);
  layer.extend(X, slots, cu, batch, Y);  // sizes the buffers and the snapshots
  const test::Allocations a = test::allocations_in([&] {
    layer.extend(X, slots, cu, batch, Y);
    batch.rollback(2, 3);
    batch.rollback(0, 1);
  });
  EXPECT_EQ(a.eigen, 0);
  EXPECT_EQ(a.news, 0);
  EXPECT_EQ(batch.state(2).position, 2 + 4 + 3);
  EXPECT_EQ(batch.state(0).position, 3 + 3 + 1);
}

TYPED_TEST(DeltaLayerServing, ExtendErrorsMoveNothing) {
  using S = typename TestFixture::S;
  const TypeParam layer = Served<TypeParam>::make(3);
  auto batch = TestFixture::primed(layer, 3);
  batch.keep_snapshots(2);
  const auto before = batch;
  const std::string fn = std::is_same_v<TypeParam, linattn::GatedDeltaNetLayer<S>>
                             ? "GatedDeltaNetLayer::extend"
                             : "KimiDeltaAttentionLayer::extend";
  const Mat<S> X = inputs<S>(5, 28, 54);
  Mat<S> Y(5, 28);
  const Eigen::VectorXi slots = (Eigen::VectorXi(2) << 0, 2).finished();
  const std::vector<int> cu = {0, 2, 5};
  const auto call = [&](Mat<S> x, Eigen::VectorXi s, std::vector<int> o, Mat<S>* y) {
    return [&layer, &batch, x, s, o, y] { layer.extend(x, s, o, batch, *y); };
  };
  Mat<S> Ybad(4, 28);
  throws_naming(call(X.leftCols(27), slots, cu, &Y), {fn, "X is 5x27", "28"}, "X's columns");
  throws_naming(call(X, slots, cu, &Ybad), {fn, "4x28", "5x28"}, "Y's shape");
  throws_naming(call(X, (Eigen::VectorXi(2) << 0, 3).finished(), cu, &Y),
                {fn, "slots(1) = 3", "outside [0, B)", "B = 3"}, "a slot out of range");
  throws_naming(call(X, (Eigen::VectorXi(2) << 2, 2).finished(), cu, &Y),
                {fn, "slots(1) = 2", "repeats"}, "a repeated slot");
  throws_naming(call(X, slots, {0, 5}, &Y), {fn, "offsets has 2 entries", "slots has 2"},
                "offsets of another count");
  throws_naming(call(X, slots, {0, 2, 4}, &Y), {fn, "offsets", "end at 5", "0 ... 4"},
                "offsets short of the rows");
  throws_naming(call(X, slots, {0, 6, 5}, &Y), {fn, "offsets", "entry 2 is 5 after 6"},
                "decreasing offsets");
  Mat<S> Xn = X;
  Xn(3, 7) = std::numeric_limits<S>::quiet_NaN();
  throws_naming(call(Xn, slots, cu, &Y), {fn, "X(3, 7) = nan"}, "a non-finite input");
  for (Index b = 0; b < 3; ++b) {
    expect_same_state(batch, b, before, b, "sequence " + std::to_string(b));
    EXPECT_EQ(batch.snapshots(b), 0);
  }
}

TYPED_TEST(DeltaLayerServing, RollbackEqualsFeedingOnlyTheAccepted) {
  using S = typename TestFixture::S;
  for (const Index W : {1, 3, 4}) {
    const TypeParam layer = Served<TypeParam>::make(W);
    auto start = TestFixture::primed(layer, 3, true);
    start.keep_snapshots(4);
    // 5 tokens of sequence 0 (the last 4 kept: 2 ... 5 accepted), 3 of the new sequence 2.
    const Eigen::VectorXi slots = (Eigen::VectorXi(2) << 0, 2).finished();
    const std::vector<int> cu = {0, 5, 8};
    const Mat<S> X = inputs<S>(8, 28, 55);
    Mat<S> Y(8, 28);
    auto verified = start;
    layer.extend(X, slots, cu, verified, Y);
    EXPECT_EQ(verified.snapshots(0), 4);
    EXPECT_EQ(verified.snapshots(2), 3);
    EXPECT_EQ(verified.snapshots(1), 0);
    const auto accept = [&](Index b, Index row0, Index accepted) {
      auto rolled = verified;
      rolled.rollback(b, accepted);
      auto fed = start;
      Mat<S> Yf(accepted, 28);
      const Eigen::VectorXi one = Eigen::VectorXi::Constant(1, int(b));
      layer.extend(X.middleRows(row0, accepted), one, std::vector<int>{0, int(accepted)}, fed, Yf);
      const std::string what = "W = " + std::to_string(W) + ", sequence " + std::to_string(b) +
                               ", accepted " + std::to_string(accepted);
      expect_same_state(rolled, b, fed, b, what);
      EXPECT_EQ(rolled.snapshots(b), accepted - (b == 0 ? 1 : 0));
      // Both go on alike.
      Mat<S> y1(3, 28), y2(3, 28);
      const Mat<S> x = inputs<S>(3, 28, 56);
      layer.step(x, rolled, y1);
      layer.step(x, fed, y2);
      EXPECT_TRUE(same_bits(y1.row(b), y2.row(b))) << what << ": the next step";
      expect_same_state(rolled, b, fed, b, what + ", after a step");
    };
    for (const Index accepted : {2, 3, 5}) accept(0, 0, accepted);
    for (const Index accepted : {1, 2, 3}) accept(2, 5, accepted);

    // Set back twice in one call's range, then the range has shrunk.
    auto twice = verified;
    twice.rollback(0, 4);
    twice.rollback(0, 2);
    EXPECT_EQ(twice.snapshots(0), 1);
    EXPECT_EQ(twice.state(0).position, start.state(0).position + 2);
    throws_naming([&] { twice.rollback(0, 3); }, {"rollback", "2 ... 2", "accepted = 3"},
                  "past the new end");
  }
}

TYPED_TEST(DeltaLayerServing, RollbackErrors) {
  using S = typename TestFixture::S;
  const TypeParam layer = Served<TypeParam>::make(3);
  const std::string fn = std::string(std::is_same_v<TypeParam, linattn::GatedDeltaNetLayer<S>>
                                         ? "GatedDeltaNetLayer"
                                         : "KimiDeltaAttentionLayer") +
                         "::BatchedState::rollback";
  auto batch = TestFixture::primed(layer, 2);
  const Mat<S> X = inputs<S>(6, 28, 57);
  Mat<S> Y(6, 28);
  const Eigen::VectorXi slots = (Eigen::VectorXi(2) << 1, 0).finished();
  const std::vector<int> cu = {0, 5, 6};
  layer.extend(X, slots, cu, batch, Y);
  throws_naming([&] { batch.rollback(1, 3); }, {fn, "sequence 1", "no snapshot kept", "3"},
                "no snapshots kept");
  batch.keep_snapshots(3);
  layer.extend(X, slots, cu, batch, Y);
  const auto before = batch;
  throws_naming([&] { batch.rollback(1, 0); }, {fn, "3 ... 5", "accepted = 0"}, "accepted 0");
  throws_naming([&] { batch.rollback(1, 2); }, {fn, "3 ... 5", "accepted = 2"}, "below the kept");
  throws_naming([&] { batch.rollback(1, 6); }, {fn, "3 ... 5", "accepted = 6"}, "past the call");
  throws_naming([&] { batch.rollback(2, 1); }, {fn, "sequence 2", "[0, 2)"}, "a sequence");
  throws_naming([&] { batch.rollback(-1, 1); }, {fn, "sequence -1"}, "a negative sequence");
  throws_naming([&] { batch.keep_snapshots(-2); }, {"keep_snapshots", "-2"}, "a count");
  for (Index b = 0; b < 2; ++b) expect_same_state(batch, b, before, b, "unchanged");
  batch.rollback(1, 5);  // all: nothing to undo
  expect_same_state(batch, 1, before, 1, "accepted all");
  layer.step(X.topRows(2), batch, Y.topRows(2));
  EXPECT_EQ(batch.snapshots(0), 0);
  throws_naming([&] { batch.rollback(0, 1); }, {fn, "no snapshot kept"}, "after a step");
}

TYPED_TEST(DeltaLayerServing, SavedAndLoadedBitForBit) {
  using S = typename TestFixture::S;
  for (const Index W : {1, 4}) {
    const TypeParam layer = Served<TypeParam>::make(W);
    auto batch = TestFixture::primed(layer, 3, true);  // sequence 2 new: an empty conv state
    batch.keep_snapshots(2);
    std::stringstream file;
    linattn::save_state(file, batch);
    const std::string bytes = file.str();
    const Index L = W - 1, C = batch.conv_channels(), H = batch.decoder().heads();
    const Index FM = batch.decoder().feature_dim() * batch.decoder().value_dim();
    EXPECT_EQ(Index(bytes.size()), 96 + 3 * (8 + Index(sizeof(S)) * (L * C + H * FM)));
    auto loaded = layer.make_batched_state(1);  // B comes from the file
    loaded.keep_snapshots(2);
    linattn::load_state(file, loaded);
    ASSERT_EQ(loaded.sequences(), 3);
    const std::string what = "W = " + std::to_string(W);
    for (Index b = 0; b < 3; ++b) {
      expect_same_state(loaded, b, batch, b, what + ", sequence " + std::to_string(b));
      EXPECT_EQ(loaded.snapshots(b), 0);
    }
    // Both go on alike, by steps and by an extend (whose rollback points the load kept on).
    const Mat<S> x = inputs<S>(3, 28, 60), X = inputs<S>(5, 28, 61);
    Mat<S> y1(3, 28), y2(3, 28), Y1(5, 28), Y2(5, 28);
    const Eigen::VectorXi slots = (Eigen::VectorXi(2) << 2, 0).finished();
    const std::vector<int> cu = {0, 3, 5};
    for (auto* b : {&batch, &loaded}) {
      layer.step(x, *b, b == &batch ? y1 : y2);
      layer.extend(X, slots, cu, *b, b == &batch ? Y1 : Y2);
      b->rollback(2, 2);
    }
    EXPECT_TRUE(same_bits(y1, y2)) << what;
    EXPECT_TRUE(same_bits(Y1, Y2)) << what;
    for (Index b = 0; b < 3; ++b) expect_same_state(loaded, b, batch, b, what + ", after");
    // Into a larger state: B shrinks to the file's.
    std::stringstream again(bytes);
    auto larger = layer.make_batched_state(5);
    linattn::load_state(again, larger);
    EXPECT_EQ(larger.sequences(), 3);
  }
}

TYPED_TEST(DeltaLayerServing, LoadErrorsChangeNothing) {
  using S = typename TestFixture::S;
  const TypeParam layer = Served<TypeParam>::make(3);
  const auto batch = TestFixture::primed(layer, 2);
  std::stringstream file;
  linattn::save_state(file, batch);
  const std::string bytes = file.str();
  auto target = TestFixture::primed(Served<TypeParam>::make(3), 1);
  const auto before = target;
  const auto load = [&](const std::string& data) {
    return [&target, data] {
      std::stringstream in(data);
      linattn::load_state(in, target);
    };
  };
  const auto crc_fixed = [](std::string data) {  // a valid trailing CRC for edited bytes
    const std::uint32_t crc = linattn::checksum(data.data(), data.size() - 4);
    for (int i = 0; i < 4; ++i) data[data.size() - 4 + i] = char((crc >> (8 * i)) & 0xFF);
    return data;
  };
  const auto header_fixed = [](std::string data) {  // a valid header CRC for edited bytes
    const std::uint32_t crc = linattn::checksum(data.data(), 64);
    for (int i = 0; i < 4; ++i) data[64 + i] = char((crc >> (8 * i)) & 0xFF);
    return data;
  };
  const std::string fn = "linattn::load_state";
  const Index C = batch.conv_channels(), s = Index(sizeof(S));
  throws_naming(load(bytes.substr(0, 5)), {fn, "truncated", "magic"}, "cut in the magic");
  throws_naming(load(bytes.substr(0, 70)), {fn, "truncated", "sequence count B"}, "cut in B");
  throws_naming(load(bytes.substr(0, 92 + 8 + 3)),
                {fn, "truncated", "convolution state (sequence 0)"}, "cut in a conv state");
  throws_naming(load(bytes.substr(0, 92 + 8 + 2 * C * s + 1)),
                {fn, "truncated", "S (sequence 0, head 0)"}, "cut in a head");
  throws_naming(load(bytes.substr(0, bytes.size() - 2)), {fn, "truncated", "checksum"},
                "cut in the CRC");
  std::string bad = bytes;
  bad[200] = char(bad[200] ^ 0x10);
  throws_naming(load(bad), {fn, "corrupted data", "checksum mismatch"}, "a flipped bit");
  bad = bytes;
  bad[30] = char(bad[30] ^ 0x01);
  throws_naming(load(bad), {fn, "corrupted header"}, "a flipped header bit");
  bad = bytes;
  bad[12] = char(std::is_same_v<S, float> ? 2 : 1);
  throws_naming(load(header_fixed(bad)),
                {fn, "wrong scalar type", std::is_same_v<S, float> ? "double" : "float"},
                "another scalar type");
  bad = bytes;
  bad[92] = char(0xFF);  // sequence 0's position: −1 in two's complement
  for (int i = 93; i < 100; ++i) bad[std::size_t(i)] = char(0xFF);
  throws_naming(load(crc_fixed(bad)), {fn, "invalid record", "sequence 0", "position -1"},
                "a negative position");
  std::stringstream other;
  linattn::save_state(other, Served<TypeParam>::make(4).make_batched_state(1));
  throws_naming(load(other.str()), {fn, "shape mismatch", "W = 4", "W = 3"},
                "another convolution width");
  std::stringstream wider;
  linattn::save_state(wider, Served<TypeParam>::make(3, 28).make_batched_state(1).decoder());
  throws_naming(load(wider.str()), {fn, "wrong kind", "RecurrentDeltaRule"}, "a decoder file");
  bad = bytes;
  bad[24] = char(bad[24] + 1);  // H + 1 heads
  throws_naming(load(header_fixed(bad)), {fn, "shape mismatch", "3 head(s)", "2 head(s)"},
                "another head count");
  ASSERT_EQ(target.sequences(), 1);
  expect_same_state(target, 0, before, 0, "after the failed loads");
}

}  // namespace
