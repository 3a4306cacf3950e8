// Serving many sequences (issue 13, item 5): BatchedRecurrentLinearAttention (one decode step
// for B sequences x H heads, bit for bit B·H separate RecurrentLinearAttention steps, any thread
// count, no allocation), states in and out of the multi-head and batched causal kernels (prefill
// then decode == one shot), offsets of any integer type, and key masks of the multi-head and
// batched forms (== per-head masked single-head calls).
//
// The no-allocation checks need EIGEN_RUNTIME_NO_MALLOC before any Eigen header (see
// test_multihead.cpp) and count global operator new too.
#ifndef EIGEN_RUNTIME_NO_MALLOC
#define EIGEN_RUNTIME_NO_MALLOC
#endif
#include "eigen_assert_hook.hpp"  // first: before any Eigen header

#include "new_counter.hpp"  // counts global operator new

#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "test_util.hpp"

namespace {

using linattn::BatchedRecurrentLinearAttention;
using linattn::CausalAlgorithm;
using linattn::CausalOptions;
using linattn::EluPlusOne;
using linattn::LinearAttentionState;
using linattn::MultiHeadRecurrentLinearAttention;
using linattn::MultiHeadWorkspace;
using linattn::ParallelOptions;
using linattn::RecurrentLinearAttention;
using linattn::SoftmaxSplit;
using test::Index;
using test::Mat;
using test::RowMat;
template <class S>
using Vec = Eigen::Matrix<S, Eigen::Dynamic, 1>;
template <class S>
using States = std::vector<LinearAttentionState<S>>;

ParallelOptions threads(int n) {
  ParallelOptions p;
  p.num_threads = n;
  return p;
}

template <class S, class Map>
std::string tag_of(const std::string& what) {
  return what + "/" +
         (std::is_same_v<Map, SoftmaxSplit> ? std::string("softmax_split") : std::string("elu")) +
         "/" + test::scalar_name<S>();
}

template <class DA, class DB>
bool same_bits(const Eigen::DenseBase<DA>& a, const Eigen::DenseBase<DB>& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
  for (Index j = 0; j < a.cols(); ++j)
    for (Index i = 0; i < a.rows(); ++i) {
      const auto x = a.derived().coeff(i, j), y = b.derived().coeff(i, j);
      if (std::memcmp(&x, &y, sizeof(x)) != 0) return false;
    }
  return true;
}

template <class S>
bool same_state(const LinearAttentionState<S>& a, const LinearAttentionState<S>& b) {
  return same_bits(a.S, b.S) && same_bits(a.S_lo, b.S_lo) && same_bits(a.z, b.z) &&
         same_bits(a.z_lo, b.z_lo) && same_bits(a.m, b.m);
}

// Largest |a - b| relative to max(1, |b|) over S + S_lo and z + z_lo, with SoftmaxSplit's shifts
// undone (the maxima may differ between algorithms only if the keys do).
template <class S>
double state_error(const LinearAttentionState<S>& a, const LinearAttentionState<S>& b) {
  const auto full = [](const LinearAttentionState<S>& s) {
    Mat<double> Sd = (s.S.template cast<double>() + s.S_lo.template cast<double>());
    Vec<double> zd = (s.z.template cast<double>() + s.z_lo.template cast<double>());
    for (Index d = 0; d < s.m.size(); ++d) {
      Sd.row(d) *= std::exp(double(s.m(d)));
      zd(d) *= std::exp(double(s.m(d)));
    }
    return std::make_pair(Sd, zd);
  };
  const auto x = full(a), y = full(b);
  const double scale = std::max({1.0, y.first.cwiseAbs().maxCoeff(), y.second.cwiseAbs().maxCoeff()});
  return std::max((x.first - y.first).cwiseAbs().maxCoeff(),
                  (x.second - y.second).cwiseAbs().maxCoeff()) /
         scale;
}

struct Allocations {
  int eigen = 0, news = 0;
};

template <class F>
Allocations allocations_in(F&& call) {
  Allocations a;
  eigen_hook::g_expect = true;
  new_counter::calls = 0;
  {
    NoMallocScope scope;
    new_counter::counting = true;
    call();
    new_counter::counting = false;
    a.eigen = scope.failures();
  }
  eigen_hook::g_expect = false;
  a.news = new_counter::calls.load();
  return a;
}

// Tokens of step t: B x (H·D) queries and keys, B x (H·M) values, row-major. Keys reach ±50 for
// SoftmaxSplit so that the running maxima move.
template <class S, class Map>
struct Tokens {
  RowMat<S> q, k, v;
  Tokens(Index B, Index H, Index D, Index M, Index t, std::uint32_t salt) {
    const double kr = std::is_same_v<Map, SoftmaxSplit> ? 50.0 : 2.0;
    q = test::random_matrix<S>(B, H * D, test::seed_of({B, H, D, t, salt, 1}), -2, 2);
    k = test::random_matrix<S>(B, H * D, test::seed_of({B, H, D, t, salt, 2}), -kr, kr);
    v = test::random_matrix<S>(B, H * M, test::seed_of({B, H, M, t, salt, 3}), -3, 3);
  }
};

template <class F>
void expect_invalid(F&& f, const std::vector<std::string>& needles, const std::string& what) {
  test::expect_invalid(std::forward<F>(f), needles, what);
}

// ---------------------------------------------------------------------------------------------
// (a) The batched decode step
// ---------------------------------------------------------------------------------------------

// B·H separate RecurrentLinearAttention heads (and B MultiHeadRecurrentLinearAttention
// objects) against one BatchedRecurrentLinearAttention, over more steps than two fold periods,
// with row-major Maps as inputs and outputs, for several thread counts: outputs and states bit
// for bit.
template <class S, class Map>
void check_decode_bitwise(Index B, Index H, Index D, Index M, Index T) {
  const std::string tag = tag_of<S, Map>("BatchedRecurrentLinearAttention::step") + " B=" +
                          std::to_string(B) + " H=" + std::to_string(H);
  for (const int nt : {1, 2, 3}) {
    std::vector<RecurrentLinearAttention<Map, S>> single;
    for (Index i = 0; i < B * H; ++i) single.emplace_back(D, M);
    std::vector<MultiHeadRecurrentLinearAttention<Map, S>> multi;
    for (Index b = 0; b < B; ++b) multi.emplace_back(H, D, M);
    BatchedRecurrentLinearAttention<Map, S> batched(B, H, D, M);
    std::vector<S> out_buffer(static_cast<std::size_t>(B * H * M));
    Eigen::Map<RowMat<S>> out(out_buffer.data(), B, H * M);
    Vec<S> o(M), mo(H * M);
    bool outputs_equal = true, multi_equal = true;
    for (Index t = 0; t < T; ++t) {
      const Tokens<S, Map> x(B, H, D, M, t, 7);
      const Eigen::Map<const RowMat<S>> q(x.q.data(), B, H * D), k(x.k.data(), B, H * D),
          v(x.v.data(), B, H * M);
      batched.step(q, k, v, out, threads(nt));
      for (Index b = 0; b < B; ++b) {
        for (Index h = 0; h < H; ++h) {
          single[static_cast<std::size_t>(b * H + h)].step(
              x.q.row(b).segment(h * D, D), x.k.row(b).segment(h * D, D),
              x.v.row(b).segment(h * M, M), o);
          outputs_equal = outputs_equal && same_bits(out.row(b).segment(h * M, M), o.transpose());
        }
        multi[static_cast<std::size_t>(b)].step(x.q.row(b), x.k.row(b), x.v.row(b), mo);
        multi_equal = multi_equal && same_bits(out.row(b), mo.transpose());
      }
    }
    EXPECT_TRUE(outputs_equal) << tag << " threads=" << nt << ": outputs vs separate heads";
    EXPECT_TRUE(multi_equal) << tag << " threads=" << nt
                             << ": outputs vs MultiHeadRecurrentLinearAttention";
    for (Index b = 0; b < B; ++b) {
      EXPECT_EQ(batched.position(b), T) << tag;
      for (Index h = 0; h < H; ++h)
        EXPECT_TRUE(same_state(batched.state(b, h), single[static_cast<std::size_t>(b * H + h)].state()))
            << tag << " threads=" << nt << ": state of sequence " << b << " head " << h;
    }
  }
}

TEST(ServingDecode, StepEqualsSeparateRecurrentHeadsBitForBit) {
  // 300 steps: two folds of the compensated sums (every 128 steps) and a partial period.
  check_decode_bitwise<float, EluPlusOne>(5, 3, 5, 7, 300);
  check_decode_bitwise<double, EluPlusOne>(5, 3, 5, 7, 300);
  check_decode_bitwise<float, SoftmaxSplit>(5, 3, 5, 7, 300);
  check_decode_bitwise<double, SoftmaxSplit>(5, 3, 5, 7, 300);
  check_decode_bitwise<float, EluPlusOne>(1, 1, 3, 2, 130);  // one sequence of one head
  check_decode_bitwise<float, EluPlusOne>(3, 8, 64, 64, 20);  // the packet paths of M = 64
}

// Column-major inputs, blocks of larger matrices and a lazy product: the same results as
// row-major copies.
TEST(ServingDecode, AnyEigenInputs) {
  const Index B = 4, H = 2, D = 3, M = 5;
  const Tokens<float, EluPlusOne> x(B, H, D, M, 0, 11);
  BatchedRecurrentLinearAttention<EluPlusOne, float> a(B, H, D, M), b(B, H, D, M), c(B, H, D, M);
  Mat<float> big = Mat<float>::Zero(B + 3, 3 * H * M);
  RowMat<float> ra(B, H * M);
  a.step(x.q, x.k, x.v, ra, threads(2));
  const Mat<float> qc = x.q, kc = x.k, vc = x.v;
  b.step(qc, kc, vc, big.block(1, 2, B, H * M), threads(1));
  EXPECT_TRUE(same_bits(ra, big.block(1, 2, B, H * M)));
  const Mat<float> I = Mat<float>::Identity(H * D, H * D);
  RowMat<float> rc(B, H * M);
  c.step(qc * I, kc * I, vc, rc);  // products: evaluated once
  EXPECT_TRUE(same_bits(ra, rc));
}

// step(slots, ...) advances the listed sequences only, from rows in the listed order; slots of
// any integer type.
TEST(ServingDecode, SlotsStepOnlyTheListedSequences) {
  const Index B = 6, H = 2, D = 4, M = 3;
  BatchedRecurrentLinearAttention<SoftmaxSplit, double> batched(B, H, D, M);
  std::vector<RecurrentLinearAttention<SoftmaxSplit, double>> single;
  for (Index i = 0; i < B * H; ++i) single.emplace_back(D, M);
  const std::vector<std::vector<std::int32_t>> schedule = {
      {0, 1, 2, 3, 4, 5}, {4, 1}, {}, {5, 0, 3}, {2}, {3, 2, 1, 0, 5, 4}};
  Vec<double> o(M);
  bool equal = true;
  for (int round = 0; round < 50; ++round) {
    const auto& active = schedule[static_cast<std::size_t>(round) % schedule.size()];
    const Index n = static_cast<Index>(active.size());
    const Eigen::Map<const Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1>> slots(active.data(), n);
    const Tokens<double, SoftmaxSplit> x(n, H, D, M, round, 5);
    RowMat<double> out(n, H * M);
    batched.step(slots, x.q, x.k, x.v, out, threads(round % 3 + 1));
    for (Index r = 0; r < n; ++r)
      for (Index h = 0; h < H; ++h) {
        single[static_cast<std::size_t>(active[static_cast<std::size_t>(r)] * H + h)].step(
            x.q.row(r).segment(h * D, D), x.k.row(r).segment(h * D, D),
            x.v.row(r).segment(h * M, M), o);
        equal = equal && same_bits(out.row(r).segment(h * M, M), o.transpose());
      }
  }
  EXPECT_TRUE(equal);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h)
      EXPECT_TRUE(same_state(batched.state(b, h), single[static_cast<std::size_t>(b * H + h)].state()))
          << "sequence " << b << " head " << h;
  const Eigen::Matrix<std::int64_t, 1, Eigen::Dynamic> row_slots = (Eigen::Matrix<std::int64_t, 1, 2>() << 5, 2).finished();
  const Tokens<double, SoftmaxSplit> x(2, H, D, M, 99, 5);
  RowMat<double> out(2, H * M);
  const Index before = batched.position(5);
  batched.step(row_slots, x.q, x.k, x.v, out);
  EXPECT_EQ(batched.position(5), before + 1);
}

// A server's life cycle: sequences added, removed (the last takes the slot), reset, parked with
// state() and resumed with set_state() in another object: bit for bit the uninterrupted heads.
TEST(ServingDecode, AddRemoveResetAndHandOver) {
  const Index H = 2, D = 3, M = 4;
  using Batched = BatchedRecurrentLinearAttention<EluPlusOne, float>;
  Batched server(2, H, D, M);
  // Reference: one MultiHeadRecurrentLinearAttention per conversation id.
  std::vector<MultiHeadRecurrentLinearAttention<EluPlusOne, float>> conv;
  std::vector<int> id = {0, 1};  // conversation in each slot
  conv.emplace_back(H, D, M);
  conv.emplace_back(H, D, M);
  Vec<float> mo(H * M);
  bool equal = true;
  const auto step_all = [&](Index t) {
    const Index B = server.sequences();
    const Tokens<float, EluPlusOne> x(B, H, D, M, t, 3);
    RowMat<float> out(B, H * M);
    server.step(x.q, x.k, x.v, out, threads(2));
    for (Index b = 0; b < B; ++b) {
      conv[static_cast<std::size_t>(id[static_cast<std::size_t>(b)])].step(x.q.row(b), x.k.row(b),
                                                                          x.v.row(b), mo);
      equal = equal && same_bits(out.row(b), mo.transpose());
    }
  };
  for (Index t = 0; t < 140; ++t) step_all(t);
  EXPECT_EQ(server.add_sequence(), 2);
  conv.emplace_back(H, D, M);
  id.push_back(2);
  for (Index t = 140; t < 200; ++t) step_all(t);
  server.remove_sequence(0);  // conversation 2 moves to slot 0
  id = {2, 1};
  EXPECT_EQ(server.sequences(), 2);
  EXPECT_EQ(server.position(0), 60);
  for (Index t = 200; t < 230; ++t) step_all(t);
  server.reset(1);
  conv[1].reset();
  for (Index t = 230; t < 300; ++t) step_all(t);
  EXPECT_TRUE(equal) << "outputs through add, remove and reset";
  // Park every state, resume in a new object: the next steps are bit for bit the same.
  Batched resumed(2, H, D, M);
  resumed.set_states(server.states(), 7);
  EXPECT_EQ(resumed.position(1), 7);
  Batched one_by_one(2, H, D, M);
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < H; ++h) one_by_one.set_state(b, h, server.state(b, h));
  for (Index t = 300; t < 450; ++t) {
    const Tokens<float, EluPlusOne> x(2, H, D, M, t, 3);
    RowMat<float> a(2, H * M), b(2, H * M), c(2, H * M);
    server.step(x.q, x.k, x.v, a);
    resumed.step(x.q, x.k, x.v, b, threads(1));
    one_by_one.step(x.q, x.k, x.v, c, threads(t % 16 == 0 ? 3 : 2));
    // The server's heads fold on their own cadence, the resumed ones from set_state(): the
    // outputs agree to rounding, not necessarily bit for bit.
    EXPECT_LE(test::max_abs_diff(a, b), 1e-5) << "step " << t;
    EXPECT_TRUE(same_bits(b, c)) << "step " << t;
  }
  // Back to zero sequences and up again: the spare states are reused and start empty.
  server.resize(0);
  server.resize(1);
  RecurrentLinearAttention<EluPlusOne, float> fresh(D, M);
  EXPECT_TRUE(same_state(server.state(0, 1), fresh.state()));
}

// One recurrent step for every (sequence, head) allocates nothing, serially and on threads,
// strided (column-major) and contiguous (row-major) inputs, slots included.
template <class S, class Map>
void check_decode_no_alloc() {
  const Index B = 7, H = 3, D = 16, M = 12;
  BatchedRecurrentLinearAttention<Map, S> batched(B, H, D, M);
  batched.reserve_threads(3);
  const Tokens<S, Map> x(B, H, D, M, 1, 9);
  const Mat<S> qc = x.q, kc = x.k, vc = x.v;
  RowMat<S> out(B, H * M);
  Mat<S> outc(B, H * M);
  const Eigen::VectorXi slots = (Eigen::VectorXi(3) << 6, 0, 2).finished();
  RowMat<S> out3(3, H * M);
  const Allocations a = allocations_in([&] {
    for (int t = 0; t < 130; ++t) {  // past a fold
      batched.step(x.q, x.k, x.v, out, threads(t % 3 == 2 ? 3 : 1));
      batched.step(qc, kc, vc, outc, threads(1));
      batched.step(slots, x.q.topRows(3), x.k.topRows(3), x.v.topRows(3), out3, threads(2));
    }
  });
  const std::string tag = tag_of<S, Map>("BatchedRecurrentLinearAttention::step");
  EXPECT_EQ(a.eigen, 0) << tag << ": Eigen heap allocations";
  EXPECT_EQ(a.news, 0) << tag << ": operator new calls";
  EXPECT_TRUE(out.allFinite()) << tag;
}

TEST(ServingDecode, StepAllocatesNothing) {
  eigen_hook::expect_detector_works();
  check_decode_no_alloc<float, EluPlusOne>();
  check_decode_no_alloc<double, EluPlusOne>();
  check_decode_no_alloc<float, SoftmaxSplit>();
  check_decode_no_alloc<double, SoftmaxSplit>();
}

TEST(ServingErrors, DecodeMessages) {
  const Index B = 3, H = 2, D = 4, M = 5;
  BatchedRecurrentLinearAttention<EluPlusOne, float> batched(B, H, D, M);
  const Tokens<float, EluPlusOne> x(B, H, D, M, 0, 1);
  RowMat<float> out(B, H * M);
  const std::string fn = "linattn::BatchedRecurrentLinearAttention::step";
  expect_invalid([&] { batched.step(x.q.topRows(2), x.k, x.v, out); },
                 {fn, "q is 2x8", "k is 3x8", "v is 3x10", "out is 3x10", "must be 3x8"},
                 "too few query rows");
  expect_invalid([&] { batched.step(x.q, x.k.leftCols(7), x.v, out); }, {fn, "k is 3x7"},
                 "k columns");
  expect_invalid([&] { batched.step(x.q, x.k, x.v, out.leftCols(9)); }, {fn, "out is 3x9"},
                 "out columns");
  RowMat<float> shared(B, H * M);
  shared.leftCols(H * D) = x.q;
  expect_invalid([&] { batched.step(shared.leftCols(H * D), x.k, x.v, shared.leftCols(H * M)); },
                 {fn, "overlaps", "q"}, "out overlapping q");
  const Eigen::VectorXi bad = (Eigen::VectorXi(2) << 1, 3).finished();
  expect_invalid([&] { batched.step(bad, x.q.topRows(2), x.k.topRows(2), x.v.topRows(2), out.topRows(2)); },
                 {fn, "slots(1) = 3", "outside [0, 3)"}, "slot out of range");
  const Eigen::VectorXi twice = (Eigen::VectorXi(2) << 2, 2).finished();
  expect_invalid([&] { batched.step(twice, x.q.topRows(2), x.k.topRows(2), x.v.topRows(2), out.topRows(2)); },
                 {fn, "slots(1) = 2", "repeats"}, "repeated slot");
  // The failed calls moved nothing: the marks of the repeat check were cleared too.
  const Eigen::VectorXi fine = (Eigen::VectorXi(2) << 2, 1).finished();
  EXPECT_NO_THROW(batched.step(fine, x.q.topRows(2), x.k.topRows(2), x.v.topRows(2), out.topRows(2)));
  EXPECT_EQ(batched.position(0), 0);
  EXPECT_EQ(batched.position(2), 1);
  expect_invalid([&] { batched.set_state(0, 0, LinearAttentionState<float>(3, 5)); },
                 {"linattn::BatchedRecurrentLinearAttention::set_state", "does not fit F = 4, M = 5"},
                 "state of the wrong shape");
  expect_invalid([&] { batched.set_state(3, 0, LinearAttentionState<float>(4, 5)); },
                 {"set_state", "sequence 3 is outside [0, 3)"}, "sequence out of range");
  expect_invalid([&] { (void)batched.state(0, 2); }, {"state", "head 2 is outside [0, 2)"},
                 "head out of range");
  expect_invalid([&] { batched.set_states(States<float>(5)); },
                 {"set_states", "got 5 states but need B·H = 3·2"}, "wrong count of states");
  expect_invalid([&] { batched.remove_sequence(-1); }, {"remove_sequence", "sequence -1"},
                 "remove out of range");
  expect_invalid([] { BatchedRecurrentLinearAttention<EluPlusOne, float> bad_heads(2, 0, 4, 4); },
                 {"linattn::BatchedRecurrentLinearAttention", "heads = 0"}, "no heads");
}

}  // namespace
