// The batched decoders of the gated and delta-rule families (BatchedRecurrentGatedAttention,
// BatchedRecurrentDeltaRule): one step for B sequences x H heads equals B·H separate
// single-head steps bit for bit, serially and on threads, with shared key heads, scalar,
// per-channel and no decays; the slots overload; several tokens of several sequences in one
// call (extend) and rollback to the states after its last tokens; sequences added and removed;
// a prefill's states handed over; save and load; errors that change nothing; no allocation.
#ifndef EIGEN_RUNTIME_NO_MALLOC
#define EIGEN_RUNTIME_NO_MALLOC
#endif
#include "eigen_assert_hook.hpp"  // first: before any Eigen header

#include "allocation_count.hpp"  // counts Eigen allocations and global operator new

#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace {

using linattn::DeltaOptions;
using linattn::GatedOptions;
using linattn::ParallelOptions;
using test::Index;
using test::Mat;
using test::RowMat;
using L2 = linattn::L2Normalize<linattn::Identity>;
using Needles = std::vector<std::string>;

ParallelOptions on_threads(int n) {
  ParallelOptions p;
  p.num_threads = n;
  p.min_work_per_thread = 0;
  return p;
}

template <class S>
Mat<S> rnd(Index rows, Index cols, std::uint32_t seed, double lo = -1, double hi = 1) {
  return test::random_matrix<S>(rows, cols, seed, lo, hi);
}

// The decays of a step: none, one per head, or one per key channel.
enum class Decay { None, Scalar, Channel };

// T steps of B sequences x H value heads over Hk key heads, batched (on `threads`) against one
// RecurrentDeltaRule per (sequence, head): the same bits.
template <class S>
void check_delta_grid(Decay decay, int threads) {
  SCOPED_TRACE("decay " + std::to_string(int(decay)) + ", threads " + std::to_string(threads));
  const Index B = 3, H = 4, Hk = 2, D = 4, M = 3, F = D, T = 5;
  DeltaOptions o;
  o.scale = 0.6;
  o.key_heads = Hk;
  linattn::BatchedRecurrentDeltaRule<L2, S> dec(B, H, D, M, L2{}, o);
  std::vector<linattn::RecurrentDeltaRule<L2, S>> single(B * H, {D, M, L2{}, o});
  RowMat<S> out(B, H * M);
  for (Index t = 0; t < T; ++t) {
    const std::uint32_t seed = 100 + std::uint32_t(t) * 7;
    const Mat<S> q = rnd<S>(B, Hk * D, seed), k = rnd<S>(B, Hk * D, seed + 1),
                 v = rnd<S>(B, H * M, seed + 2), beta = rnd<S>(B, H, seed + 3, 0.1, 1.9);
    const Mat<S> g = decay == Decay::Channel ? rnd<S>(B, H * F, seed + 4, -2, 0)
                     : decay == Decay::Scalar ? rnd<S>(B, H, seed + 4, -2, 0)
                                              : Mat<S>();
    dec.step(q, k, v, beta, g, out, on_threads(threads));
    linattn::Vector<S> o1(M);
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h) {
        auto& r = single[std::size_t(b * H + h)];
        const Index c = (h / (H / Hk)) * D;
        if (decay == Decay::Channel)
          r.step(q.row(b).segment(c, D), k.row(b).segment(c, D), v.row(b).segment(h * M, M),
                 beta(b, h), g.row(b).segment(h * F, F), o1);
        else
          r.step(q.row(b).segment(c, D), k.row(b).segment(c, D), v.row(b).segment(h * M, M),
                 beta(b, h), decay == Decay::Scalar ? g(b, h) : S(0), o1);
        EXPECT_EQ(test::max_abs_diff(out.row(b).segment(h * M, M).transpose(), o1), 0.0)
            << "token " << t << ", sequence " << b << ", head " << h;
      }
  }
  for (Index b = 0; b < B; ++b) {
    EXPECT_EQ(dec.position(b), T);
    for (Index h = 0; h < H; ++h)
      EXPECT_EQ(test::max_abs_diff(dec.state(b, h).S, single[std::size_t(b * H + h)].state().S),
                0.0);
  }
}

template <class S>
void check_gated_grid(bool per_feature, int threads) {
  SCOPED_TRACE(std::string(per_feature ? "per-feature" : "scalar") + " gates, threads " +
               std::to_string(threads));
  const Index B = 3, H = 4, Hk = 1, D = 3, M = 5, F = D, T = 4;
  GatedOptions o;
  o.scale = 0.4;
  o.key_heads = Hk;
  linattn::BatchedRecurrentGatedAttention<linattn::Identity, S> dec(B, H, D, M,
                                                                    linattn::Identity{}, o);
  std::vector<linattn::RecurrentGatedAttention<linattn::Identity, S>> single(
      B * H, {D, M, linattn::Identity{}, o});
  Mat<S> out(B, H * M);
  const Index gw = per_feature ? F : 1;
  for (Index t = 0; t < T; ++t) {
    const std::uint32_t seed = 200 + std::uint32_t(t) * 5;
    const Mat<S> q = rnd<S>(B, Hk * D, seed), k = rnd<S>(B, Hk * D, seed + 1),
                 v = rnd<S>(B, H * M, seed + 2), g = rnd<S>(B, H * gw, seed + 3, -2, 0);
    dec.step(q, k, v, g, out, on_threads(threads));
    linattn::Vector<S> o1(M);
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h) {
        single[std::size_t(b * H + h)].step(q.row(b).segment(0, D), k.row(b).segment(0, D),
                                            v.row(b).segment(h * M, M),
                                            g.row(b).segment(h * gw, gw), o1);
        EXPECT_EQ(test::max_abs_diff(out.row(b).segment(h * M, M).transpose(), o1), 0.0)
            << "token " << t << ", sequence " << b << ", head " << h;
      }
  }
}

TEST(batched_decoders, EqualSeparateDecodersBitForBit) {
  for (int threads : {1, 3}) {
    for (Decay d : {Decay::None, Decay::Scalar, Decay::Channel}) {
      IF_FLOAT(check_delta_grid<float>(d, threads));
      IF_DOUBLE(check_delta_grid<double>(d, threads));
    }
    for (bool per_feature : {false, true}) {
      IF_FLOAT(check_gated_grid<float>(per_feature, threads));
      IF_DOUBLE(check_gated_grid<double>(per_feature, threads));
    }
  }
}

// A prefill's states handed over, then steps: equal to one prefill over the prompt and the
// tokens; slots stepping a subset; add and remove; save and load resuming bit for bit.
template <class S>
void check_serving() {
  const Index B = 3, H = 2, D = 4, M = 4, N = 6;
  DeltaOptions o;
  o.scale = 0.5;
  const Mat<S> Q = rnd<S>(B * N, H * D, 1), K = rnd<S>(B * N, H * D, 2), V = rnd<S>(B * N, H * M, 3),
               beta = rnd<S>(B * N, H, 4, 0.1, 1.9), g = rnd<S>(B * N, H * D, 5, -1, 0);
  // Sequence b is rows [b·N, (b+1)·N): the first N - 1 rows prefill, the last one decodes.
  std::vector<int> prompt_offsets, full_offsets;
  Mat<S> Qp(B * (N - 1), H * D), Kp(B * (N - 1), H * D), Vp(B * (N - 1), H * M),
      Bp(B * (N - 1), H), Gp(B * (N - 1), H * D);
  for (Index b = 0; b < B; ++b) {
    Qp.middleRows(b * (N - 1), N - 1) = Q.middleRows(b * N, N - 1);
    Kp.middleRows(b * (N - 1), N - 1) = K.middleRows(b * N, N - 1);
    Vp.middleRows(b * (N - 1), N - 1) = V.middleRows(b * N, N - 1);
    Bp.middleRows(b * (N - 1), N - 1) = beta.middleRows(b * N, N - 1);
    Gp.middleRows(b * (N - 1), N - 1) = g.middleRows(b * N, N - 1);
  }
  for (Index b = 0; b <= B; ++b) {
    prompt_offsets.push_back(int(b * (N - 1)));
    full_offsets.push_back(int(b * N));
  }
  std::vector<linattn::LinearAttentionState<S>> states;
  linattn::MultiHeadWorkspace<S> ws;
  Mat<S> prompt_out(B * (N - 1), H * M);
  linattn::batched_delta_rule_attention(Qp, Kp, Vp, Bp, Gp, prompt_offsets, H, L2{}, states,
                                        prompt_out, ws, o);
  const Mat<S> full = [&] {
    Mat<S> f(B * N, H * M);
    linattn::batched_delta_rule_attention(Q, K, V, beta, g, full_offsets, H, L2{}, f, ws, o);
    return f;
  }();
  linattn::BatchedRecurrentDeltaRule<L2, S> dec(B, H, D, M, L2{}, o);
  dec.set_states(states, N - 1);
  Mat<S> last_q(B, H * D), last_k(B, H * D), last_v(B, H * M), last_b(B, H), last_g(B, H * D),
      want(B, H * M);
  for (Index b = 0; b < B; ++b) {
    last_q.row(b) = Q.row(b * N + N - 1);
    last_k.row(b) = K.row(b * N + N - 1);
    last_v.row(b) = V.row(b * N + N - 1);
    last_b.row(b) = beta.row(b * N + N - 1);
    last_g.row(b) = g.row(b * N + N - 1);
    want.row(b) = full.row(b * N + N - 1);
  }
  // Parked before the step, resumed into another object: both continue alike.
  std::stringstream file;
  linattn::save_state(file, dec);
  linattn::BatchedRecurrentDeltaRule<L2, S> resumed(B, H, D, M, L2{}, o);
  linattn::load_state(file, resumed);
  Mat<S> out(B, H * M), out2(B, H * M);
  dec.step(last_q, last_k, last_v, last_b, last_g, out);
  resumed.step(last_q, last_k, last_v, last_b, last_g, out2);
  EXPECT_LE(test::max_abs_diff(out, want), test::bound<S>(2e-6, 1e-14));
  EXPECT_EQ(test::max_abs_diff(out, out2), 0.0);
  EXPECT_EQ(resumed.position(2), N);
  // Slots: sequences 2 and 0 only; sequence 1 keeps its state and position.
  const auto before = dec.state(1, 1);
  const Eigen::VectorXi slots = (Eigen::VectorXi(2) << 2, 0).finished();
  Mat<S> out_s(2, H * M);
  dec.step(slots, last_q.topRows(2), last_k.topRows(2), last_v.topRows(2), last_b.topRows(2),
           last_g.topRows(2), out_s);
  EXPECT_EQ(dec.position(1), N);
  EXPECT_EQ(dec.position(0), N + 1);
  EXPECT_EQ(dec.position(2), N + 1);
  EXPECT_EQ(test::max_abs_diff(dec.state(1, 1).S, before.S), 0.0);
  // Remove sequence 0: the last (2) takes its number; add one: empty.
  const auto s2 = dec.state(2, 0);
  dec.remove_sequence(0);
  EXPECT_EQ(dec.sequences(), 2);
  EXPECT_EQ(test::max_abs_diff(dec.state(0, 0).S, s2.S), 0.0);
  EXPECT_EQ(dec.add_sequence(), 2);
  EXPECT_EQ(dec.position(2), 0);
  EXPECT_EQ(dec.state(2, 1).S.cwiseAbs().maxCoeff(), S(0));
  // A record short of the object's heads: load fails and changes nothing.
  std::stringstream shortfile;
  linattn::save_state(shortfile, dec.decoder(0, 0));
  const auto kept = resumed.state(0, 0);
  EXPECT_THROW(linattn::load_state(shortfile, resumed), std::runtime_error);
  EXPECT_EQ(test::max_abs_diff(resumed.state(0, 0).S, kept.S), 0.0);
  EXPECT_EQ(resumed.position(0), N);
}

TEST(batched_decoders, PrefillSlotsSequencesAndFiles) {
  IF_FLOAT(check_serving<float>());
  IF_DOUBLE(check_serving<double>());
}

TEST(batched_decoders, ErrorsChangeNothing) {
  const Index B = 2, H = 2, D = 3, M = 2;
  linattn::BatchedRecurrentDeltaRule<L2, float> dec(B, H, D, M);
  const Eigen::MatrixXf q = rnd<float>(B, H * D, 1), v = rnd<float>(B, H * M, 2);
  Eigen::MatrixXf beta = Eigen::MatrixXf::Constant(B, H, 0.5f), g = Eigen::MatrixXf::Zero(B, H);
  Eigen::MatrixXf out(B, H * M);
  dec.step(q, q, v, beta, g, out);
  const auto before = dec.states();
  beta(1, 0) = 2.5f;
  test::expect_invalid([&] { dec.step(q, q, v, beta, g, out); },
                       Needles{"BatchedRecurrentDeltaRule::step", "beta(1, 0) = 2.5"}, "beta");
  beta(1, 0) = 0.5f;
  g(0, 1) = 0.1f;
  test::expect_invalid([&] { dec.step(q, q, v, beta, g, out); },
                       Needles{"log_a(0, 1) = 0.1", "finite and <= 0"}, "log_a");
  g(0, 1) = 0;
  test::expect_invalid([&] { dec.step(q, q, v, beta, Eigen::MatrixXf::Zero(B, 5), out); },
                       Needles{"log_a is 2x5", "2x2 (one per head)", "2x6 (one per key channel"},
                       "log_a shape");
  test::expect_invalid([&] { dec.step(q.leftCols(3), q.leftCols(3), v, beta, g, out); },
                       Needles{"q is 2x3", "must be 2x6", "H = 2 value heads over 2 key heads"},
                       "shape");
  const Eigen::VectorXi twice = (Eigen::VectorXi(2) << 1, 1).finished();
  test::expect_invalid([&] { dec.step(twice, q, q, v, beta, g, out); },
                       Needles{"slots(1) = 1 repeats an earlier slot"}, "slots");
  for (std::size_t i = 0; i < before.size(); ++i)
    EXPECT_EQ(test::max_abs_diff(dec.states()[i].S, before[i].S), 0.0);
  EXPECT_EQ(dec.position(0), 1);
  test::expect_invalid([&] { dec.reset(2); }, Needles{"BatchedRecurrentDeltaRule::reset",
                                                      "sequence 2 is outside [0, 2)"},
                       "reset");
  DeltaOptions bad;
  bad.key_heads = 3;
  test::expect_invalid([&] { linattn::BatchedRecurrentDeltaRule<L2, float> d(1, 4, 3, 2, L2{}, bad); },
                       Needles{"key_heads = 3", "divisor of heads = 4"}, "key heads");
  linattn::BatchedRecurrentGatedAttention<linattn::Identity, float> gated(B, H, D, M);
  test::expect_invalid(
      [&] { gated.step(q, q, v, Eigen::MatrixXf::Constant(B, H, 1e-3f), out); },
      Needles{"BatchedRecurrentGatedAttention::step", "log_gates(0, 0) = 0.001"}, "gated");
}

// extend(): tokens of several sequences in one call equal those steps of separate decoders, bit
// for bit; rollback() to the state after any of the last K tokens equals the decoder that
// stopped there, and both continue alike.
template <class S>
void check_extend_rollback(int threads) {
  SCOPED_TRACE("threads " + std::to_string(threads));
  const Index B = 3, H = 2, Hk = 1, D = 4, M = 3, F = D, K = 3;
  DeltaOptions o;
  o.scale = 0.7;
  o.key_heads = Hk;
  linattn::BatchedRecurrentDeltaRule<L2, S> dec(B, H, D, M, L2{}, o);
  dec.keep_snapshots(K);
  // Sequence 2 gets 5 tokens, sequence 0 gets 2 (fewer than K), sequence 1 none.
  const Eigen::VectorXi slots = (Eigen::VectorXi(2) << 2, 0).finished();
  const std::vector<long> cu = {0, 5, 7};
  const Index N = 7;
  const Mat<S> q = rnd<S>(N, Hk * D, 11), k = rnd<S>(N, Hk * D, 12), v = rnd<S>(N, H * M, 13),
               beta = rnd<S>(N, H, 14, 0.1, 1.9), g = rnd<S>(N, H * F, 15, -1, 0);
  RowMat<S> out(N, H * M);
  dec.extend(slots, cu, q, k, v, beta, g, out, on_threads(threads));
  // The reference: per (sequence, head) decoders, and their states after each token.
  std::vector<std::vector<linattn::LinearAttentionState<S>>> after(2 * H);
  std::vector<linattn::RecurrentDeltaRule<L2, S>> ref(2 * H, {D, M, L2{}, o});
  linattn::Vector<S> o1(M);
  for (Index i = 0; i < 2; ++i)
    for (Index h = 0; h < H; ++h)
      for (Index r = cu[std::size_t(i)]; r < cu[std::size_t(i) + 1]; ++r) {
        auto& rnn = ref[std::size_t(i * H + h)];
        rnn.step(q.row(r).segment(0, D), k.row(r).segment(0, D), v.row(r).segment(h * M, M),
                 beta(r, h), g.row(r).segment(h * F, F), o1);
        EXPECT_EQ(test::max_abs_diff(out.row(r).segment(h * M, M).transpose(), o1), 0.0)
            << "row " << r << ", head " << h;
        after[std::size_t(i * H + h)].push_back(rnn.state());
      }
  EXPECT_EQ(dec.position(2), 5);
  EXPECT_EQ(dec.position(0), 2);
  EXPECT_EQ(dec.position(1), 0);
  EXPECT_EQ(dec.snapshots(2), K);
  EXPECT_EQ(dec.snapshots(0), 2);
  EXPECT_EQ(dec.snapshots(1), 0);
  // Sequence 2 keeps 3 of its 5 tokens: its state after token 3, and it continues as a decoder
  // that stopped there.
  dec.rollback(2, 3);
  EXPECT_EQ(dec.position(2), 3);
  for (Index h = 0; h < H; ++h)
    EXPECT_EQ(test::max_abs_diff(dec.state(2, h).S, after[std::size_t(h)][2].S), 0.0);
  linattn::RecurrentDeltaRule<L2, S> stopped(D, M, L2{}, o);
  stopped.set_state(after[0][2], 3);
  const Mat<S> qn = rnd<S>(1, D, 16), vn = rnd<S>(1, H * M, 17), gn = rnd<S>(1, H * F, 18, -1, 0);
  const Mat<S> bn = Mat<S>::Constant(1, H, S(0.5));
  RowMat<S> on(1, H * M);
  dec.step(Eigen::VectorXi::Constant(1, 2), qn, qn, vn, bn, gn, on);
  stopped.step(qn.row(0), qn.row(0), vn.row(0).segment(0, M), S(0.5), gn.row(0).segment(0, F), o1);
  EXPECT_EQ(test::max_abs_diff(on.row(0).segment(0, M).transpose(), o1), 0.0);
  // A step drops the rollback points; out-of-range requests name the range.
  EXPECT_EQ(dec.snapshots(2), 0);
  test::expect_invalid([&] { dec.rollback(2, 1); }, Needles{"BatchedRecurrentDeltaRule::rollback",
                                                            "no snapshot kept"}, "after a step");
  test::expect_invalid([&] { dec.rollback(0, 0); }, Needles{"can be set back to 1 ... 2 tokens",
                                                            "got 0"}, "range");
  dec.rollback(0, 2);  // the whole call: nothing to undo
  EXPECT_EQ(dec.position(0), 2);
  dec.rollback(0, 1);
  EXPECT_EQ(test::max_abs_diff(dec.state(0, 1).S, after[std::size_t(H + 1)][0].S), 0.0);
  // The gated decoder: the same for per-feature gates.
  linattn::BatchedRecurrentGatedAttention<linattn::Identity, S> gated(B, H, D, M);
  gated.keep_snapshots(2);
  const Mat<S> qg = rnd<S>(N, H * D, 21), kg = rnd<S>(N, H * D, 22);
  gated.extend(slots, cu, qg, kg, v, g, out, on_threads(threads));
  linattn::RecurrentGatedAttention<linattn::Identity, S> one(D, M);
  for (Index r = 0; r < 4; ++r)
    one.step(qg.row(r).segment(D, D), kg.row(r).segment(D, D), v.row(r).segment(M, M),
             g.row(r).segment(F, F), o1);
  gated.rollback(2, 4);
  EXPECT_EQ(test::max_abs_diff(gated.state(2, 1).S, one.state().S), 0.0);
  EXPECT_EQ(test::max_abs_diff(gated.state(2, 1).log_decay, one.state().log_decay), 0.0);
  EXPECT_EQ(gated.position(2), 4);
}

TEST(batched_decoders, ExtendAndRollback) {
  for (int threads : {1, 2}) {
    IF_FLOAT(check_extend_rollback<float>(threads));
    IF_DOUBLE(check_extend_rollback<double>(threads));
  }
}

// A step of every sequence (all decays), on one thread and on three, and a slots step, allocate
// nothing once the decoder is built.
TEST(batched_decoders, StepAllocatesNothing) {
  eigen_hook::expect_detector_works();
  const Index B = 5, H = 4, Hk = 2, D = 8, M = 6;
  DeltaOptions o;
  o.key_heads = Hk;
  linattn::BatchedRecurrentDeltaRule<L2, float> dec(B, H, D, M, L2{}, o);
  linattn::BatchedRecurrentGatedAttention<linattn::Identity, float> gated(B, H, D, M);
  const Eigen::MatrixXf q = rnd<float>(B, Hk * D, 1), v = rnd<float>(B, H * M, 2),
                        qg = rnd<float>(B, H * D, 3);
  const Eigen::MatrixXf beta = Eigen::MatrixXf::Constant(B, H, 0.5f),
                        g = Eigen::MatrixXf::Constant(B, H, -0.1f),
                        gc = Eigen::MatrixXf::Constant(B, H * D, -0.1f), none;
  Eigen::MatrixXf out(B, H * M);
  RowMat<float> out2(2, H * M);
  const Eigen::VectorXi slots = (Eigen::VectorXi(2) << 4, 1).finished();
  const std::vector<int> cu = {0, 3, 5};  // 3 tokens of sequence 4, 2 of sequence 1
  dec.keep_snapshots(2);
  dec.extend(slots, cu, q, q, v, beta, gc, out);  // sizes the snapshots
  const test::Allocations a = test::allocations_in([&] {
    for (int t = 0; t < 6; ++t) {
      dec.step(q, q, v, beta, g, out, on_threads(t % 2 ? 3 : 1));
      dec.step(q, q, v, beta, gc, out, on_threads(1));
      dec.step(q, q, v, beta, none, out, on_threads(1));
      dec.step(slots, q.topRows(2), q.topRows(2), v.topRows(2), beta.topRows(2), g.topRows(2),
               out2, on_threads(2));
      gated.step(qg, qg, v, g, out, on_threads(t % 2 ? 3 : 1));
      gated.step(qg, qg, v, gc, out, on_threads(1));
      dec.extend(slots, cu, q, q, v, beta, gc, out, on_threads(t % 2 ? 2 : 1));
      dec.rollback(4, 2);
    }
  });
  EXPECT_EQ(a.eigen, 0) << "Eigen heap allocations";
  EXPECT_EQ(a.news, 0) << "operator new calls";
  EXPECT_TRUE(out.allFinite());
}

}  // namespace
