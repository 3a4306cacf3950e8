// Serving many sequences: BatchedRecurrentLinearAttention (one decode step
// for B sequences x H heads, bit for bit B·H separate RecurrentLinearAttention steps, any thread
// count, no allocation), states in and out of the multi-head and batched causal kernels (prefill
// then decode == one shot), offsets of any integer type, and key masks of the multi-head and
// batched forms (== per-head masked single-head calls), and the cost model that runs a call too
// small to gain from threads on the calling thread (ParallelOptions::min_work_per_thread).
//
// The no-allocation checks need EIGEN_RUNTIME_NO_MALLOC before any Eigen header (see
// test_multihead.cpp) and count global operator new too.
#ifndef EIGEN_RUNTIME_NO_MALLOC
#define EIGEN_RUNTIME_NO_MALLOC
#endif
#include "eigen_assert_hook.hpp"  // first: before any Eigen header

#include "allocation_count.hpp"  // counts Eigen allocations and global operator new

#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "team_recording_map.hpp"
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

// n threads however small the call (min_work_per_thread = 0): these tests check the parallel
// paths on small shapes, which the cost model would run on one thread (section (e) checks it).
ParallelOptions threads(int n) {
  ParallelOptions p;
  p.num_threads = n;
  p.min_work_per_thread = 0;
  return p;
}

template <class S, class Map>
std::string tag_of(const std::string& what) {
  return what + "/" +
         (std::is_same_v<Map, SoftmaxSplit> ? std::string("softmax_split") : std::string("elu")) +
         "/" + test::scalar_name<S>();
}

using test::same_bits;
using test::same_state;

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

using test::allocations_in;
using test::Allocations;

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
  IF_FLOAT(check_decode_bitwise<float, EluPlusOne>(5, 3, 5, 7, 300));
  IF_DOUBLE(check_decode_bitwise<double, EluPlusOne>(5, 3, 5, 7, 300));
  IF_FLOAT(check_decode_bitwise<float, SoftmaxSplit>(5, 3, 5, 7, 300));
  IF_DOUBLE(check_decode_bitwise<double, SoftmaxSplit>(5, 3, 5, 7, 300));
  IF_FLOAT(check_decode_bitwise<float, EluPlusOne>(1, 1, 3, 2, 130));  // one sequence of one head
  IF_FLOAT(check_decode_bitwise<float, EluPlusOne>(3, 8, 64, 64, 20));  // the packet paths of M = 64
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
  IF_FLOAT(check_decode_no_alloc<float, EluPlusOne>());
  IF_DOUBLE(check_decode_no_alloc<double, EluPlusOne>());
  IF_FLOAT(check_decode_no_alloc<float, SoftmaxSplit>());
  IF_DOUBLE(check_decode_no_alloc<double, SoftmaxSplit>());
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

// ---------------------------------------------------------------------------------------------
// (b) States in and out of the multi-head and batched causal kernels
// ---------------------------------------------------------------------------------------------

CausalOptions causal_options(CausalAlgorithm algorithm, Index chunk) {
  CausalOptions o;
  o.algorithm = algorithm;
  o.chunk_size = chunk;
  return o;
}

const std::vector<CausalOptions>& all_causal_options() {
  static const std::vector<CausalOptions> list = {
      CausalOptions{}, causal_options(CausalAlgorithm::Chunked, 0),
      causal_options(CausalAlgorithm::Chunked, 7), causal_options(CausalAlgorithm::Recurrent, 0)};
  return list;
}

// Packed inputs of `rows` rows: Q, K (rows x H·D), V (rows x H·M), row-major.
template <class S, class Map>
struct Packed {
  RowMat<S> Q, K, V;
  Packed(Index rows, Index H, Index D, Index M, std::uint32_t salt) {
    const Tokens<S, Map> x(rows, H, D, M, 1000, salt);
    Q = x.q;
    K = x.k;
    V = x.v;
  }
};

// States of some (sequence, head) pairs from an earlier single-head call (the rest empty).
template <class S, class Map>
States<S> initial_states(Index count, Index D, Index M, std::uint32_t salt) {
  States<S> st(static_cast<std::size_t>(count));
  for (Index i = 0; i < count; i += 2) {
    const Packed<S, Map> x(5 + i, 1, D, M, salt + std::uint32_t(i));
    (void)linattn::causal_linear_attention(x.Q, x.K, x.V, Map{}, st[static_cast<std::size_t>(i)]);
  }
  return st;
}

// Each (sequence, head) of the batched states form against causal_linear_attention() on its
// columns and rows with the same initial state, on one thread: outputs and final states bit for
// bit; with 1, 2 and 3 threads over heads and sequences; multihead_ (one sequence) too.
template <class S, class Map>
void check_states_bitwise(const std::vector<Index>& lengths, Index H, Index D, Index M) {
  std::vector<Index> off = {0};
  for (Index n : lengths) off.push_back(off.back() + n);
  const Index B = static_cast<Index>(lengths.size()), N = off.back();
  const Packed<S, Map> x(N, H, D, M, 21);
  for (const CausalOptions& opts : all_causal_options()) {
    const std::string tag = tag_of<S, Map>("batched_causal_linear_attention(states)") + " N=" +
                            std::to_string(N) + " chunk=" + std::to_string(opts.chunk_size) +
                            " alg=" + std::to_string(int(opts.algorithm));
    // The reference: per (sequence, head) single-head calls.
    States<S> expected = initial_states<S, Map>(B * H, D, M, 5);
    // Row-major like `out` below: Eigen's products into row-major and column-major blocks
    // round differently.
    RowMat<S> ref(N, H * M);
    linattn::Workspace<S> w;
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h) {
        const Index r0 = off[static_cast<std::size_t>(b)], n = lengths[static_cast<std::size_t>(b)];
        linattn::causal_linear_attention(
            x.Q.block(r0, h * D, n, D), x.K.block(r0, h * D, n, D), x.V.block(r0, h * M, n, M),
            Map{}, expected[static_cast<std::size_t>(b * H + h)], ref.block(r0, h * M, n, M), w,
            opts, threads(1));
      }
    for (const int nt : {1, 2, 3}) {
      States<S> got = initial_states<S, Map>(B * H, D, M, 5);
      MultiHeadWorkspace<S> ws;
      RowMat<S> out(N, H * M);
      linattn::batched_causal_linear_attention(x.Q, x.K, x.V, off, H, Map{}, got, out, ws, opts,
                                               threads(nt));
      EXPECT_TRUE(same_bits(out, ref)) << tag << " threads=" << nt << ": outputs";
      for (Index i = 0; i < B * H; ++i)
        EXPECT_TRUE(same_state(got[static_cast<std::size_t>(i)], expected[static_cast<std::size_t>(i)]))
            << tag << " threads=" << nt << ": state " << i;
    }
    if (B == 1) {  // multihead_causal_linear_attention's states form, out and returning
      States<S> got = initial_states<S, Map>(H, D, M, 5);
      MultiHeadWorkspace<S> ws;
      RowMat<S> out(N, H * M);
      linattn::multihead_causal_linear_attention(x.Q, x.K, x.V, H, Map{}, got, out, ws, opts);
      EXPECT_TRUE(same_bits(out, ref)) << tag << " multihead";
      States<S> got2 = initial_states<S, Map>(H, D, M, 5);
      const Mat<S> ret = linattn::multihead_causal_linear_attention(x.Q, x.K, x.V, H, Map{}, got2,
                                                                    opts, threads(2));
      // A column-major result: equal to rounding (the states are bit for bit).
      EXPECT_LE(test::max_abs_diff(ret, ref), test::bound<S>(1e-6, 1e-15, 3.0))
          << tag << " multihead returning";
      for (Index h = 0; h < H; ++h) {
        EXPECT_TRUE(same_state(got[static_cast<std::size_t>(h)], expected[static_cast<std::size_t>(h)]))
            << tag << " multihead state " << h;
        EXPECT_TRUE(same_state(got2[static_cast<std::size_t>(h)], expected[static_cast<std::size_t>(h)]))
            << tag << " multihead returning state " << h;
      }
    }
  }
}

TEST(ServingPrefill, StatesEqualSingleHeadStatesBitForBit) {
  // Lengths: an empty sequence, N = 1, not multiples of 7, 48 or 128, longer than a 1024-row
  // piece of the multi-head kernel.
  const std::vector<Index> lengths = {130, 0, 1, 257, 1100};
  IF_FLOAT(check_states_bitwise<float, EluPlusOne>(lengths, 3, 5, 7));
  IF_DOUBLE(check_states_bitwise<double, EluPlusOne>(lengths, 3, 5, 7));
  IF_FLOAT(check_states_bitwise<float, SoftmaxSplit>(lengths, 2, 6, 4));
  IF_DOUBLE(check_states_bitwise<double, SoftmaxSplit>(lengths, 2, 6, 4));
  IF_FLOAT(check_states_bitwise<float, EluPlusOne>({1}, 2, 3, 2));    // N = 1, one sequence
  IF_DOUBLE(check_states_bitwise<double, SoftmaxSplit>({300}, 3, 4, 9));  // one sequence
}

// The server's path: a batched prefill of B prompts carries out B·H states, a
// BatchedRecurrentLinearAttention decodes T more tokens from them; every output row equals the
// one-shot causal multi-head call over prompt + decoded tokens, to rounding; and the decode
// equals B·H RecurrentLinearAttention heads continuing from the same states bit for bit.
template <class S, class Map>
void check_prefill_then_decode() {
  const Index H = 3, D = 6, M = 5, T = 140;
  const std::vector<Index> prompt = {37, 1, 200, 129};
  const Index B = static_cast<Index>(prompt.size());
  Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1> cu(B + 1);
  cu(0) = 0;
  for (Index b = 0; b < B; ++b) cu(b + 1) = cu(b) + std::int32_t(prompt[static_cast<std::size_t>(b)]);
  std::vector<Packed<S, Map>> seq;  // sequence b: prompt + T tokens
  for (Index b = 0; b < B; ++b) seq.emplace_back(prompt[static_cast<std::size_t>(b)] + T, H, D, M, 40 + std::uint32_t(b));
  RowMat<S> Q(cu(B), H * D), K(cu(B), H * D), V(cu(B), H * M);
  for (Index b = 0; b < B; ++b) {
    const Index n = prompt[static_cast<std::size_t>(b)];
    Q.middleRows(cu(b), n) = seq[static_cast<std::size_t>(b)].Q.topRows(n);
    K.middleRows(cu(b), n) = seq[static_cast<std::size_t>(b)].K.topRows(n);
    V.middleRows(cu(b), n) = seq[static_cast<std::size_t>(b)].V.topRows(n);
  }
  States<S> states;  // empty: resized to B·H
  MultiHeadWorkspace<S> ws;
  RowMat<S> prefill_out(cu(B), H * M);
  linattn::batched_causal_linear_attention(Q, K, V, cu, H, Map{}, states, prefill_out, ws);
  ASSERT_EQ(states.size(), static_cast<std::size_t>(B * H));
  BatchedRecurrentLinearAttention<Map, S> decoder(B, H, D, M);
  decoder.set_states(states);
  std::vector<RecurrentLinearAttention<Map, S>> heads;
  for (Index i = 0; i < B * H; ++i) {
    heads.emplace_back(D, M);
    heads.back().set_state(states[static_cast<std::size_t>(i)]);
  }
  std::vector<Mat<S>> decoded(static_cast<std::size_t>(B), Mat<S>(T, H * M));
  Vec<S> o(M);
  bool equal = true;
  for (Index t = 0; t < T; ++t) {
    RowMat<S> q(B, H * D), k(B, H * D), v(B, H * M), out(B, H * M);
    for (Index b = 0; b < B; ++b) {
      const Index r = prompt[static_cast<std::size_t>(b)] + t;
      q.row(b) = seq[static_cast<std::size_t>(b)].Q.row(r);
      k.row(b) = seq[static_cast<std::size_t>(b)].K.row(r);
      v.row(b) = seq[static_cast<std::size_t>(b)].V.row(r);
    }
    decoder.step(q, k, v, out, threads(2));
    for (Index b = 0; b < B; ++b) {
      decoded[static_cast<std::size_t>(b)].row(t) = out.row(b);
      for (Index h = 0; h < H; ++h) {
        heads[static_cast<std::size_t>(b * H + h)].step(q.row(b).segment(h * D, D),
                                                        k.row(b).segment(h * D, D),
                                                        v.row(b).segment(h * M, M), o);
        equal = equal && same_bits(out.row(b).segment(h * M, M), o.transpose());
      }
    }
  }
  const std::string tag = tag_of<S, Map>("prefill + decode");
  EXPECT_TRUE(equal) << tag << ": decode vs RecurrentLinearAttention heads from the same states";
  double worst = 0;
  for (Index b = 0; b < B; ++b) {
    const auto& x = seq[static_cast<std::size_t>(b)];
    const Mat<S> one_shot = linattn::multihead_causal_linear_attention(x.Q, x.K, x.V, H, Map{});
    const Index n = prompt[static_cast<std::size_t>(b)];
    worst = std::max(worst, test::max_abs_diff(prefill_out.middleRows(cu(b), n), one_shot.topRows(n)));
    worst = std::max(worst, test::max_abs_diff(decoded[static_cast<std::size_t>(b)], one_shot.bottomRows(T)));
  }
  test::report_error(tag + " vs one-shot", worst);
  EXPECT_LE(worst, test::bound<S>(2e-6, 5e-15, 3.0)) << tag;
}

TEST(ServingPrefill, PrefillThenDecodeEqualsOneShot) {
  IF_FLOAT(check_prefill_then_decode<float, EluPlusOne>());
  IF_DOUBLE(check_prefill_then_decode<double, EluPlusOne>());
  IF_FLOAT(check_prefill_then_decode<float, SoftmaxSplit>());
  IF_DOUBLE(check_prefill_then_decode<double, SoftmaxSplit>());
}

// Prefill in two calls (cut anywhere) == one call, to rounding; the second call reuses the
// workspace and states and allocates nothing.
TEST(ServingPrefill, PiecesEqualOneShotAndAllocateNothing) {
  const Index H = 4, D = 8, M = 6, N = 301;
  const Packed<float, SoftmaxSplit> x(N, H, D, M, 77);
  const std::vector<Index> whole = {0, N};
  States<float> one, two;
  MultiHeadWorkspace<float> ws;
  Mat<float> a(N, H * M), b(N, H * M);
  linattn::batched_causal_linear_attention(x.Q, x.K, x.V, whole, H, SoftmaxSplit{}, one, a, ws,
                                           CausalOptions{}, threads(1));
  const Index cut = 100;
  linattn::multihead_causal_linear_attention(x.Q.topRows(cut), x.K.topRows(cut), x.V.topRows(cut),
                                             H, SoftmaxSplit{}, two, b.topRows(cut), ws,
                                             CausalOptions{}, threads(1));
  const Index rest = N - cut;
  Allocations alloc = allocations_in([&] {
    linattn::multihead_causal_linear_attention(x.Q.bottomRows(rest), x.K.bottomRows(rest),
                                               x.V.bottomRows(rest), H, SoftmaxSplit{}, two,
                                               b.bottomRows(rest), ws, CausalOptions{}, threads(1));
  });
  EXPECT_LE(test::max_abs_diff(a, b), 1e-6);
  for (Index h = 0; h < H; ++h)
    EXPECT_LE(state_error(two[static_cast<std::size_t>(h)], one[static_cast<std::size_t>(h)]), 1e-6)
        << "head " << h;
  EXPECT_EQ(alloc.eigen, 0);
  EXPECT_EQ(alloc.news, 0);
  // A batched call with reused states and workspace, int32 offsets in a Map: no allocation.
  const std::int32_t cu[] = {0, 150, 150, N};
  const Eigen::Map<const Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1>> offsets(cu, 4);
  States<float> batch;
  linattn::batched_causal_linear_attention(x.Q, x.K, x.V, offsets, H, SoftmaxSplit{}, batch, a, ws,
                                           CausalOptions{}, threads(1));
  alloc = allocations_in([&] {
    linattn::batched_causal_linear_attention(x.Q, x.K, x.V, offsets, H, SoftmaxSplit{}, batch, a,
                                             ws, CausalOptions{}, threads(1));
  });
  EXPECT_EQ(alloc.eigen, 0);
  EXPECT_EQ(alloc.news, 0);
}

TEST(ServingErrors, StatesMessages) {
  const Index H = 2, D = 3, M = 4, N = 10;
  const Packed<double, EluPlusOne> x(N, H, D, M, 3);
  MultiHeadWorkspace<double> ws;
  Mat<double> out(N, H * M);
  States<double> three(3);
  expect_invalid([&] { linattn::multihead_causal_linear_attention(x.Q, x.K, x.V, H, EluPlusOne{}, three, out, ws); },
                 {"linattn::multihead_causal_linear_attention", "got 3 states but need 2"},
                 "wrong count (multi-head)");
  const std::vector<Index> off = {0, 4, N};
  expect_invalid([&] { linattn::batched_causal_linear_attention(x.Q, x.K, x.V, off, H, EluPlusOne{}, three, out, ws); },
                 {"linattn::batched_causal_linear_attention", "got 3 states but need 4",
                  "2 sequence(s) x 2 heads"},
                 "wrong count (batched)");
  States<double> wrong(4);
  wrong[3] = LinearAttentionState<double>(3, 5);
  expect_invalid([&] { linattn::batched_causal_linear_attention(x.Q, x.K, x.V, off, H, EluPlusOne{}, wrong, out, ws); },
                 {"linattn::batched_causal_linear_attention", "states[3] (sequence 1, head 1",
                  "S is 3x5", "does not fit F = 3, M = 4"},
                 "a state of the wrong shape");
  EXPECT_TRUE(wrong[0].empty()) << "a failed call changed no state";
  States<double> split(2);
  split[1] = LinearAttentionState<double>(3, 4);  // EluPlusOne's state given to SoftmaxSplit
  expect_invalid([&] { linattn::multihead_causal_linear_attention(x.Q, x.K, x.V, H, SoftmaxSplit{}, split, out, ws); },
                 {"states[1]", "m has 0"}, "a state without maxima for SoftmaxSplit");
}

// ---------------------------------------------------------------------------------------------
// (c) Offsets of any integer type
// ---------------------------------------------------------------------------------------------

TEST(ServingOffsets, AnyIntegerTypeGivesTheSameResults) {
  const Index H = 3, D = 4, M = 5, N = 200;
  const Packed<float, EluPlusOne> x(N, H, D, M, 8);
  const std::vector<Index> ref_off = {0, 13, 13, 150, N};
  MultiHeadWorkspace<float> ws;
  Mat<float> causal_ref(N, H * M), linear_ref(N, H * M), out(N, H * M);
  linattn::batched_causal_linear_attention(x.Q, x.K, x.V, ref_off, H, EluPlusOne{}, causal_ref, ws);
  linattn::batched_linear_attention(x.Q, x.K, x.V, ref_off, ref_off, H, EluPlusOne{}, linear_ref, ws);
  const std::vector<std::int32_t> v32 = {0, 13, 13, 150, std::int32_t(N)};
  const std::vector<std::uint16_t> v16 = {0, 13, 13, 150, std::uint16_t(N)};
  const Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1> e32 = Eigen::Map<const Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1>>(v32.data(), 5);
  const Eigen::Matrix<std::int64_t, 1, Eigen::Dynamic> e64 = e32.cast<std::int64_t>().transpose();
  const std::int32_t strided[] = {0, -1, 13, -1, 13, -1, 150, -1, std::int32_t(N), -1};
  const Eigen::Map<const Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1>, 0, Eigen::InnerStride<2>> s32(strided, 5);
  const auto check = [&](const auto& offsets, const char* what) {
    out.setConstant(-7);
    linattn::batched_causal_linear_attention(x.Q, x.K, x.V, offsets, H, EluPlusOne{}, out, ws);
    EXPECT_TRUE(same_bits(out, causal_ref)) << what << " (causal)";
    out.setConstant(-7);
    linattn::batched_linear_attention(x.Q, x.K, x.V, offsets, offsets, H, EluPlusOne{}, out, ws);
    EXPECT_TRUE(same_bits(out, linear_ref)) << what << " (non-causal)";
  };
  check(v32, "std::vector<int32_t>");
  check(v16, "std::vector<uint16_t>");
  check(e32, "Eigen::Matrix<int32_t>");
  check(e64, "row vector of int64_t");
  check(s32, "strided Map of int32_t");
  check(linattn::offsets_view(v32.data(), v32.size()), "offsets_view(pointer, size)");
  // Mixed kinds for queries and keys.
  out.setConstant(-7);
  linattn::batched_linear_attention(x.Q, x.K, x.V, e32, ref_off, H, EluPlusOne{}, out, ws);
  EXPECT_TRUE(same_bits(out, linear_ref)) << "int32 queries, Index keys";
  // No allocation with int32 offsets and a reused workspace (sized by a one-thread call: one
  // thread runs all heads as one group, whose buffers are larger).
  const auto view = linattn::offsets_view(v32.data(), v32.size());
  linattn::batched_causal_linear_attention(x.Q, x.K, x.V, view, H, EluPlusOne{}, out, ws,
                                           CausalOptions{}, threads(1));
  linattn::batched_linear_attention(x.Q, x.K, x.V, view, e32, H, EluPlusOne{}, out, ws, threads(1));
  const Allocations a = allocations_in([&] {
    linattn::batched_causal_linear_attention(x.Q, x.K, x.V, view, H, EluPlusOne{}, out, ws,
                                             CausalOptions{}, threads(1));
    linattn::batched_linear_attention(x.Q, x.K, x.V, view, e32, H, EluPlusOne{}, out, ws,
                                      threads(1));
  });
  EXPECT_EQ(a.eigen, 0);
  EXPECT_EQ(a.news, 0);
}

TEST(ServingErrors, OffsetsMessages) {
  const Index H = 2, D = 3, M = 4, N = 10;
  const Packed<float, EluPlusOne> x(N, H, D, M, 3);
  MultiHeadWorkspace<float> ws;
  Mat<float> out(N, H * M);
  const std::string causal = "linattn::batched_causal_linear_attention";
  const Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1> down = (Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1>(4) << 0, 7, 5, 10).finished();
  expect_invalid([&] { linattn::batched_causal_linear_attention(x.Q, x.K, x.V, down, H, EluPlusOne{}, out, ws); },
                 {causal, "offsets must not decrease (entry 2 is 5 after 7)"}, "decreasing");
  const std::vector<std::int32_t> start = {1, 10};
  expect_invalid([&] { linattn::batched_causal_linear_attention(x.Q, x.K, x.V, start, H, EluPlusOne{}, out, ws); },
                 {causal, "offsets must start at 0 and end at 10", "got 1 ... 10"}, "not from 0");
  const std::vector<std::uint8_t> end = {0, 9};
  expect_invalid([&] { linattn::batched_causal_linear_attention(x.Q, x.K, x.V, end, H, EluPlusOne{}, out, ws); },
                 {causal, "end at 10", "got 0 ... 9"}, "not to N");
  const Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1> none(0);
  expect_invalid([&] { linattn::batched_causal_linear_attention(x.Q, x.K, x.V, none, H, EluPlusOne{}, out, ws); },
                 {causal, "got no entries"}, "no offsets");
  const Eigen::Matrix<std::int32_t, 2, 2> square = Eigen::Matrix<std::int32_t, 2, 2>::Zero();
  expect_invalid([&] { linattn::batched_causal_linear_attention(x.Q, x.K, x.V, square, H, EluPlusOne{}, out, ws); },
                 {causal, "offsets is 2x2 but must be a vector"}, "a matrix of offsets");
  const std::vector<std::int32_t> q3 = {0, 5, 10}, k2 = {0, 10};
  expect_invalid([&] { linattn::batched_linear_attention(x.Q, x.K, x.V, q3, k2, H, EluPlusOne{}, out, ws); },
                 {"linattn::batched_linear_attention", "same number of sequences (3 and 2 entries)"},
                 "different counts");
  const std::vector<std::int64_t> kbad = {0, 11};
  expect_invalid([&] { linattn::batched_linear_attention(x.Q, x.K, x.V, k2, kbad, H, EluPlusOne{}, out, ws); },
                 {"k_offsets must start at 0 and end at 10"}, "key offsets past L");
}

// ---------------------------------------------------------------------------------------------
// (d) Key masks of the multi-head and batched forms
// ---------------------------------------------------------------------------------------------

using Mask = Eigen::Array<bool, Eigen::Dynamic, 1>;

Mask random_mask(Index n, std::uint32_t seed) {
  const Mat<double> u = test::random_matrix<double>(n, 1, seed, 0, 1);
  Mask m(n);
  for (Index i = 0; i < n; ++i) m(i) = u(i, 0) > 0.3;
  for (Index i = 0; i < std::min<Index>(n, 3); ++i) m(i) = false;  // a masked start
  return m;
}

// Every (sequence, head) of the masked multi-head and batched forms against
// masked_causal_linear_attention() / masked_linear_attention() on its blocks (one thread), bit
// for bit, for row-major and column-major inputs, states carried in and out.
template <class S, class Map, class Layout>
void check_masked(Index H, Index D, Index M) {
  const std::vector<Index> off = {0, 1, 131, 131, 400};
  const Index N = off.back(), B = static_cast<Index>(off.size()) - 1;
  const Packed<S, Map> p(N, H, D, M, 60);
  const Layout Q = p.Q, K = p.K, V = p.V;
  const Mask keep = random_mask(N, 61);
  const std::string tag = tag_of<S, Map>("masked_batched") +
                          (Layout::IsRowMajor ? "/row-major" : "/col-major");
  for (const CausalOptions& opts : {CausalOptions{}, causal_options(CausalAlgorithm::Chunked, 7)}) {
    Mat<S> causal_ref(N, H * M), linear_ref(N, H * M);
    States<S> expected(static_cast<std::size_t>(B * H));
    linattn::Workspace<S> w;
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h) {
        const Index r0 = off[static_cast<std::size_t>(b)], n = off[static_cast<std::size_t>(b) + 1] - r0;
        const auto kb = keep.segment(r0, n);
        linattn::masked_causal_linear_attention(
            Q.block(r0, h * D, n, D), K.block(r0, h * D, n, D), V.block(r0, h * M, n, M), kb,
            Map{}, expected[static_cast<std::size_t>(b * H + h)], causal_ref.block(r0, h * M, n, M),
            w, opts, threads(1));
        linattn::masked_linear_attention(Q.block(r0, h * D, n, D), K.block(r0, h * D, n, D),
                                         V.block(r0, h * M, n, M), kb, Map{},
                                         linear_ref.block(r0, h * M, n, M), w, threads(1));
      }
    for (const int nt : {1, 2}) {
      MultiHeadWorkspace<S> ws;
      Mat<S> out(N, H * M);
      linattn::masked_batched_causal_linear_attention(Q, K, V, off, keep, H, Map{}, out, ws, opts,
                                                      threads(nt));
      EXPECT_TRUE(same_bits(out, causal_ref)) << tag << " causal threads=" << nt;
      States<S> got;
      out.setZero();
      linattn::masked_batched_causal_linear_attention(Q, K, V, off, keep, H, Map{}, got, out, ws,
                                                      opts, threads(nt));
      EXPECT_TRUE(same_bits(out, causal_ref)) << tag << " causal with states, threads=" << nt;
      for (Index i = 0; i < B * H; ++i)
        EXPECT_TRUE(same_state(got[static_cast<std::size_t>(i)], expected[static_cast<std::size_t>(i)]))
            << tag << " state " << i;
      out.setZero();
      linattn::masked_batched_linear_attention(Q, K, V, off, off, keep, H, Map{}, out, ws,
                                               threads(nt));
      EXPECT_TRUE(same_bits(out, linear_ref)) << tag << " non-causal threads=" << nt;
    }
    // The multi-head forms: one sequence, the last one's rows.
    const Index r0 = off[3], n = N - r0;
    const auto q = Q.middleRows(r0, n), k = K.middleRows(r0, n), v = V.middleRows(r0, n);
    const auto kb = keep.segment(r0, n);
    MultiHeadWorkspace<S> ws;
    Mat<S> out(n, H * M);
    // The per-head reference written into a matrix of out's shape: a product's last bits may
    // depend on where its destination starts (Eigen's packet paths with AVX-512's 64-byte
    // alignment), and causal_ref's rows of this sequence start at row 131.
    Mat<S> causal_last(n, H * M);
    {
      linattn::Workspace<S> w1;
      for (Index h = 0; h < H; ++h) {
        LinearAttentionState<S> st;
        linattn::masked_causal_linear_attention(q.middleCols(h * D, D), k.middleCols(h * D, D),
                                                v.middleCols(h * M, M), kb, Map{}, st,
                                                causal_last.middleCols(h * M, M), w1, opts,
                                                threads(1));
      }
    }
    EXPECT_LE(test::max_abs_diff(causal_last, causal_ref.middleRows(r0, n)),
              test::bound<S>(1e-6, 1e-15))
        << tag;
    linattn::masked_multihead_causal_linear_attention(q, k, v, kb, H, Map{}, out, ws, opts);
    EXPECT_TRUE(same_bits(out, causal_last)) << tag << " multihead causal";
    States<S> got;
    const Mat<S> ret = linattn::masked_multihead_causal_linear_attention(q, k, v, kb, H, Map{}, opts);
    EXPECT_TRUE(same_bits(ret, causal_last)) << tag << " multihead causal returning";
    linattn::masked_multihead_causal_linear_attention(q, k, v, kb, H, Map{}, got, out, ws, opts);
    for (Index h = 0; h < H; ++h)
      EXPECT_TRUE(same_state(got[static_cast<std::size_t>(h)], expected[static_cast<std::size_t>(3 * H + h)]))
          << tag << " multihead state " << h;
    linattn::masked_multihead_linear_attention(q, k, v, kb, H, Map{}, out, ws);
    EXPECT_TRUE(same_bits(out, linear_ref.middleRows(r0, n))) << tag << " multihead non-causal";
    EXPECT_TRUE(same_bits(linattn::masked_multihead_linear_attention(q, k, v, kb, H, Map{}),
                          linear_ref.middleRows(r0, n)))
        << tag << " multihead non-causal returning";
  }
}

TEST(ServingMasks, EqualPerHeadMaskedSingleHeadCalls) {
  IF_FLOAT(check_masked<float, EluPlusOne, RowMat<float>>(3, 5, 7));
  IF_DOUBLE(check_masked<double, EluPlusOne, RowMat<double>>(3, 5, 7));
  IF_FLOAT(check_masked<float, EluPlusOne, Mat<float>>(2, 4, 4));
  IF_FLOAT(check_masked<float, SoftmaxSplit, RowMat<float>>(2, 6, 3));
  IF_DOUBLE(check_masked<double, SoftmaxSplit, Mat<double>>(2, 6, 3));
}

// A mask of all true is the unmasked call; masked calls reuse a workspace without allocating.
TEST(ServingMasks, AllTrueIsUnmaskedAndNoAllocation) {
  const Index H = 4, D = 8, M = 8, N = 300;
  const Packed<float, EluPlusOne> x(N, H, D, M, 90);
  const Mask all = Mask::Constant(N, true);
  const std::vector<Index> off = {0, 100, N};
  MultiHeadWorkspace<float> ws;
  Mat<float> a(N, H * M), b(N, H * M);
  linattn::batched_causal_linear_attention(x.Q, x.K, x.V, off, H, EluPlusOne{}, a, ws);
  linattn::masked_batched_causal_linear_attention(x.Q, x.K, x.V, off, all, H, EluPlusOne{}, b, ws);
  EXPECT_TRUE(same_bits(a, b));
  linattn::batched_linear_attention(x.Q, x.K, x.V, off, off, H, EluPlusOne{}, a, ws);
  linattn::masked_batched_linear_attention(x.Q, x.K, x.V, off, off, all, H, EluPlusOne{}, b, ws);
  EXPECT_TRUE(same_bits(a, b));
  const Mask keep = random_mask(N, 5);
  linattn::masked_batched_causal_linear_attention(x.Q, x.K, x.V, off, keep, H, EluPlusOne{}, b, ws,
                                                  CausalOptions{}, threads(1));
  linattn::masked_batched_linear_attention(x.Q, x.K, x.V, off, off, keep, H, EluPlusOne{}, b, ws,
                                           threads(1));
  const Allocations alloc = allocations_in([&] {
    linattn::masked_batched_causal_linear_attention(x.Q, x.K, x.V, off, keep, H, EluPlusOne{}, b,
                                                    ws, CausalOptions{}, threads(1));
    linattn::masked_batched_linear_attention(x.Q, x.K, x.V, off, off, keep, H, EluPlusOne{}, b, ws,
                                             threads(1));
    linattn::masked_multihead_causal_linear_attention(x.Q, x.K, x.V, keep, H, EluPlusOne{}, b, ws,
                                                      CausalOptions{}, threads(1));
  });
  EXPECT_EQ(alloc.eigen, 0);
  EXPECT_EQ(alloc.news, 0);
}

TEST(ServingErrors, MaskMessages) {
  const Index H = 2, D = 3, M = 4, N = 10;
  const Packed<float, EluPlusOne> x(N, H, D, M, 3);
  MultiHeadWorkspace<float> ws;
  Mat<float> out(N, H * M);
  const Mask short_mask = Mask::Constant(N - 1, true);
  const std::vector<Index> off = {0, N};
  expect_invalid([&] { linattn::masked_multihead_causal_linear_attention(x.Q, x.K, x.V, short_mask, H, EluPlusOne{}, out, ws); },
                 {"linattn::masked_multihead_causal_linear_attention", "the key mask is 9x1",
                  "vector of 10 entries"},
                 "short mask (multi-head causal)");
  expect_invalid([&] { linattn::masked_batched_causal_linear_attention(x.Q, x.K, x.V, off, short_mask, H, EluPlusOne{}, out, ws); },
                 {"linattn::masked_batched_causal_linear_attention", "the key mask is 9x1"},
                 "short mask (batched causal)");
  expect_invalid([&] { linattn::masked_batched_linear_attention(x.Q, x.K, x.V, off, off, short_mask, H, EluPlusOne{}, out, ws); },
                 {"linattn::masked_batched_linear_attention", "the key mask is 9x1"},
                 "short mask (batched)");
  expect_invalid([&] { linattn::masked_multihead_linear_attention(x.Q, x.K, x.V, short_mask, H, EluPlusOne{}, out, ws); },
                 {"linattn::masked_multihead_linear_attention", "the key mask is 9x1"},
                 "short mask (multi-head)");
  const Mask mask = Mask::Constant(N, true);
  expect_invalid([&] { linattn::masked_multihead_causal_linear_attention(x.Q, x.K.leftCols(5), x.V, mask, 2, EluPlusOne{}, out, ws); },
                 {"linattn::masked_multihead_causal_linear_attention", "K is 10x5"},
                 "bad shapes");
}

// ---------------------------------------------------------------------------------------------
// (e) Threads that pay: a call runs on min(num_threads, work / min_work_per_thread) threads
// ---------------------------------------------------------------------------------------------

TEST(ServingThreads, CostModelPicksTheThreadsThatPay) {
  using linattn::detail::threads_for;
  const double g = ParallelOptions::kDefaultMinWorkPerThread;
  ASSERT_GT(g, 0.0);
  ParallelOptions two, four, one, dflt;
  two.num_threads = 2;
  four.num_threads = 4;
  one.num_threads = 1;
  EXPECT_EQ(two.min_work_per_thread, g) << "the default grain";
  // The work models: a decode pair, a causal head, a non-causal head (flops).
  EXPECT_EQ(linattn::detail::decode_pair_work(64, 64), 4.0 * 64 * 65);
  EXPECT_EQ(linattn::detail::causal_head_work(100, 64, 64), 100 * 4.0 * 64 * 65);
  EXPECT_EQ(linattn::detail::linear_head_work(100, 50, 64, 64), 150 * 2.0 * 64 * 65);
  // The decode step (4 sequences x 2 heads of D = M = 6) and a server's (64 x 8
  // heads of 64).
  const double tiny = 4 * 2 * linattn::detail::decode_pair_work(6, 6);
  const double large = 64 * 8 * linattn::detail::decode_pair_work(64, 64);
  EXPECT_EQ(threads_for(one, large), 1);
#ifdef _OPENMP
  EXPECT_EQ(threads_for(two, tiny), 1);
  EXPECT_EQ(threads_for(two, large), 2);
  EXPECT_EQ(threads_for(two, 0.0), 1);
  EXPECT_EQ(threads_for(two, 1.99 * g), 1);  // two threads need twice the grain
  EXPECT_EQ(threads_for(two, 2.0 * g), 2);
  EXPECT_EQ(threads_for(two, 1e15), 2);  // never more than asked for
  EXPECT_EQ(threads_for(four, 3.5 * g), 3);
  EXPECT_EQ(threads_for(four, 1e15), 4);
  EXPECT_EQ(threads_for(four, std::numeric_limits<double>::quiet_NaN()), 1);
  EXPECT_EQ(threads_for(dflt, 1e15), omp_get_max_threads()) << "num_threads = 0: OpenMP's default";
  ParallelOptions always = four;
  always.min_work_per_thread = 0;  // always the threads asked for
  EXPECT_EQ(threads_for(always, 0.0), 4);
  always.min_work_per_thread = -1;
  EXPECT_EQ(threads_for(always, 0.0), 4);
  ParallelOptions coarse = two;
  coarse.min_work_per_thread = 1e9;  // cores shared with busy processes
  EXPECT_EQ(threads_for(coarse, large), 1);
  EXPECT_EQ(threads_for(coarse, 2e9), 2);
#else
  EXPECT_EQ(threads_for(two, large), 1) << "without OpenMP every call is serial";
  EXPECT_EQ(threads_for(four, 1e15), 1);
  EXPECT_EQ(threads_for(dflt, 1e15), 1);
#endif
}

using linattn_test::TeamRecordingMap;

// The largest team `call` ran the map in (1: the calling thread only).
template <class Call>
int team_of(const Call& call) {
  linattn_test::largest_team() = 0;
  call();
  return linattn_test::largest_team().load();
}

// Through the paths themselves: with num_threads = 2 and the default grain, a tiny call runs on
// the calling thread and a large one on two threads, and min_work_per_thread = 0 forces two
// threads on the tiny one; every result is bit for bit the one-thread result.
TEST(ServingThreads, TinyCallsRunOnTheCallingThreadLargeOnesOnTwo) {
#ifdef _OPENMP
  if (omp_get_dynamic() || omp_get_thread_limit() < 2)
    GTEST_SKIP() << "OMP_DYNAMIC or OMP_THREAD_LIMIT may shrink a team of 2 threads";
  const int two_threads = 2;
#else
  const int two_threads = 1;
#endif
  ParallelOptions modeled;
  modeled.num_threads = 2;  // the default min_work_per_thread
  const ParallelOptions forced = threads(2), one = threads(1);
  using Decoder = BatchedRecurrentLinearAttention<TeamRecordingMap, float>;

  // The decode step: 4 sequences x 2 heads of D = M = 5, over a fold (128 steps).
  {
    const Index B = 4, H = 2, D = 5, M = 5;
    Decoder a(B, H, D, M), b(B, H, D, M), c(B, H, D, M);
    RowMat<float> oa(B, H * M), ob(B, H * M), oc(B, H * M);
    int team_a = 0, team_b = 0, team_c = 0;
    bool same = true;
    for (Index t = 0; t < 130; ++t) {
      const Tokens<float, EluPlusOne> x(B, H, D, M, t, 29);
      team_a = std::max(team_a, team_of([&] { a.step(x.q, x.k, x.v, oa, modeled); }));
      team_b = std::max(team_b, team_of([&] { b.step(x.q, x.k, x.v, ob, forced); }));
      team_c = std::max(team_c, team_of([&] { c.step(x.q, x.k, x.v, oc, one); }));
      same = same && same_bits(oa, oc) && same_bits(ob, oc);
    }
    EXPECT_EQ(team_a, 1) << "a tiny decode step ran in a team";
    EXPECT_EQ(team_b, two_threads) << "min_work_per_thread = 0 did not use the threads asked for";
    EXPECT_EQ(team_c, 1);
    EXPECT_TRUE(same) << "tiny decode step: outputs differ between thread counts";
    for (Index s = 0; s < B; ++s)
      for (Index h = 0; h < H; ++h) {
        EXPECT_TRUE(same_state(a.state(s, h), c.state(s, h))) << s << " " << h;
        EXPECT_TRUE(same_state(b.state(s, h), c.state(s, h))) << s << " " << h;
      }
  }
  // A server's step: 64 sequences x 8 heads of 64.
  {
    const Index B = 64, H = 8, D = 64, M = 64;
    Decoder a(B, H, D, M), c(B, H, D, M);
    RowMat<float> oa(B, H * M), oc(B, H * M);
    const Tokens<float, EluPlusOne> x(B, H, D, M, 0, 30);
    EXPECT_EQ(team_of([&] { a.step(x.q, x.k, x.v, oa, modeled); }), two_threads)
        << "a large decode step did not use the threads asked for";
    EXPECT_EQ(team_of([&] { c.step(x.q, x.k, x.v, oc, one); }), 1);
    EXPECT_TRUE(same_bits(oa, oc)) << "large decode step";
  }
  // The batched causal and non-causal kernels: 2 sequences x 2 heads of 4 (tiny), and of 32
  // with 1500 rows each (large).
  for (const bool large : {false, true}) {
    const Index H = 2, D = large ? 32 : 4, M = D, n = large ? 1500 : 10;
    const std::vector<Index> offsets = {0, n, 2 * n};
    const Mat<float> Q = test::random_matrix<float>(2 * n, H * D, 31);
    const Mat<float> K = test::random_matrix<float>(2 * n, H * D, 32);
    const Mat<float> V = test::random_matrix<float>(2 * n, H * M, 33);
    MultiHeadWorkspace<float> ws;
    Mat<float> out(2 * n, H * M), ref(2 * n, H * M);
    const std::string tag = large ? "large" : "tiny";
    const int expected = large ? two_threads : 1;
    EXPECT_EQ(team_of([&] {
                linattn::batched_causal_linear_attention(Q, K, V, offsets, H, TeamRecordingMap{},
                                                         out, ws, CausalOptions{}, modeled);
              }),
              expected)
        << tag << " batched causal";
    linattn::batched_causal_linear_attention(Q, K, V, offsets, H, TeamRecordingMap{}, ref, ws,
                                             CausalOptions{}, one);
    EXPECT_TRUE(same_bits(out, ref)) << tag << " batched causal";
    EXPECT_EQ(team_of([&] {
                linattn::batched_linear_attention(Q, K, V, offsets, offsets, H,
                                                  TeamRecordingMap{}, out, ws, modeled);
              }),
              expected)
        << tag << " batched non-causal";
    linattn::batched_linear_attention(Q, K, V, offsets, offsets, H, TeamRecordingMap{}, ref, ws,
                                      one);
    EXPECT_TRUE(same_bits(out, ref)) << tag << " batched non-causal";
  }
}

}  // namespace
