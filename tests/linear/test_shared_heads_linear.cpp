// Shared query/key heads (GVA: H value heads over Hk = H / G query/key heads, key_heads) in
// the plain linear-attention kernels: every multi-head, batched and masked forward, causal or
// not, with carried states, row-major and column-major, against the same call with each key
// head repeated over its value heads (transformers' repeat_interleave), bit for bit, and the
// double references; the gradients of a shared head against the repeated-heads backward
// summed over each group (bit for bit) and central differences; thread counts; the decoders'
// steps against the forward and their save / load; errors that name both head counts.
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <linattn/linattn.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "reference.hpp"
#include "test_util.hpp"

namespace {

using linattn::CausalAlgorithm;
using linattn::CausalOptions;
using linattn::EluPlusOne;
using linattn::HeadOptions;
using linattn::MultiHeadWorkspace;
using linattn::ParallelOptions;
using linattn::SoftmaxSplit;
using test::Index;
using test::MatD;
using test::same_bits;
using RowD = test::RowMat<double>;
using StateD = linattn::LinearAttentionState<double>;
using Mask = Eigen::Array<bool, Eigen::Dynamic, 1>;

// X (N x Hk·D) with each head repeated G times in place: N x Hk·G·D (repeat_interleave).
MatD repeat_heads(const MatD& X, Index Hk, Index G) {
  const Index D = X.cols() / Hk;
  MatD out(X.rows(), Hk * G * D);
  for (Index kh = 0; kh < Hk; ++kh)
    for (Index j = 0; j < G; ++j) out.middleCols((kh * G + j) * D, D) = X.middleCols(kh * D, D);
  return out;
}

// The gradient of a repeated input summed back over the G copies of each head, in order.
MatD sum_heads(const MatD& X, Index Hk, Index G) {
  const Index D = X.cols() / (Hk * G);
  MatD out = MatD::Zero(X.rows(), Hk * D);
  for (Index kh = 0; kh < Hk; ++kh)
    for (Index j = 0; j < G; ++j) out.middleCols(kh * D, D) += X.middleCols((kh * G + j) * D, D);
  return out;
}

double rel(const MatD& got, const MatD& want) {
  return test::max_abs_diff(got, want) / std::max(want.cwiseAbs().maxCoeff(), 1e-300);
}

struct Shape {
  Index Hk, G, D, M;
  std::vector<Index> offsets;  // cu_seqlens; {0, N} for one sequence
  Index H() const { return Hk * G; }
  Index N() const { return offsets.back(); }
  Index B() const { return Index(offsets.size()) - 1; }
  std::string name() const {
    std::string s = "Hk = " + std::to_string(Hk) + ", H = " + std::to_string(H()) +
                    ", D = " + std::to_string(D) + ", M = " + std::to_string(M) + ", offsets =";
    for (Index o : offsets) s += " " + std::to_string(o);
    return s;
  }
};

// Hk = 1, 2 with H = 4, 6; D != M; one token; N not a multiple of the chunk (48); several
// sequences with an empty one.
const Shape kShapes[] = {{1, 4, 5, 3, {0, 1}},
                         {2, 2, 4, 6, {0, 97}},
                         {2, 3, 6, 4, {0, 50, 50, 147}},
                         {1, 6, 3, 5, {0, 20, 49, 50}}};

struct Inputs {
  MatD Q, K, V, Qr, Kr;  // Qr, Kr: the query/key heads repeated to H
  Mask keep;
  Inputs(const Shape& s, std::uint32_t seed) {
    const Index N = s.N();
    Q = test::random_matrix(N, s.Hk * s.D, seed);
    K = test::random_matrix(N, s.Hk * s.D, seed + 1);
    V = test::random_matrix(N, s.H() * s.M, seed + 2);
    Qr = repeat_heads(Q, s.Hk, s.G);
    Kr = repeat_heads(K, s.Hk, s.G);
    keep = Mask::Ones(N);
    for (Index i = 0; i < N; i += 3) keep(i) = false;
  }
};

// Every non-causal form against the repeated-heads call, in the storage order of Storage.
template <class Storage, class Map>
void check_non_causal(const Shape& s, const Map& phi) {
  SCOPED_TRACE(s.name());
  const Inputs in(s, test::seed_of({s.Hk, s.G, s.D, s.M, s.N(), 1}));
  const Storage Q = in.Q, K = in.K, V = in.V, Qr = in.Qr, Kr = in.Kr;
  const Index N = s.N(), H = s.H();
  HeadOptions layout;
  layout.key_heads = s.Hk;
  MultiHeadWorkspace<double> ws;
  Storage out(N, H * s.M), want(N, H * s.M);
  for (int threads : {1, 2}) {
    ParallelOptions par;
    par.num_threads = threads;
    linattn::batched_linear_attention(Q, K, V, s.offsets, s.offsets, H, phi, out, ws, layout, par);
    linattn::batched_linear_attention(Qr, Kr, V, s.offsets, s.offsets, H, phi, want, ws, par);
    EXPECT_TRUE(same_bits(out, want)) << "batched, threads = " << threads;
    linattn::masked_batched_linear_attention(Q, K, V, s.offsets, s.offsets, in.keep, H, phi, out,
                                             ws, layout, par);
    linattn::masked_batched_linear_attention(Qr, Kr, V, s.offsets, s.offsets, in.keep, H, phi,
                                             want, ws, par);
    EXPECT_TRUE(same_bits(out, want)) << "masked batched, threads = " << threads;
  }
  if (s.B() != 1) return;
  linattn::multihead_linear_attention(Q, K, V, H, phi, out, ws, layout);
  linattn::multihead_linear_attention(Qr, Kr, V, H, phi, want, ws);
  EXPECT_TRUE(same_bits(out, want)) << "multihead";
  EXPECT_TRUE(same_bits(Storage(linattn::multihead_linear_attention(Q, K, V, H, phi, layout)), want));
  linattn::masked_multihead_linear_attention(Q, K, V, in.keep, H, phi, out, ws, layout);
  linattn::masked_multihead_linear_attention(Qr, Kr, V, in.keep, H, phi, want, ws);
  EXPECT_TRUE(same_bits(out, want)) << "masked multihead";
  EXPECT_TRUE(same_bits(
      Storage(linattn::masked_multihead_linear_attention(Q, K, V, in.keep, H, phi, layout)), want));
  // The reference on each value head's shared key head.
  const MatD got = linattn::multihead_linear_attention(in.Q, in.K, in.V, H, phi, layout);
  for (Index h = 0; h < H; ++h) {
    const Index c = h / s.G * s.D;
    EXPECT_LE(rel(got.middleCols(h * s.M, s.M),
                  ref::linear_attention(in.Q.middleCols(c, s.D), in.K.middleCols(c, s.D),
                                        in.V.middleCols(h * s.M, s.M), phi)),
              1e-12)
        << "head " << h;
  }
}

TEST(SharedHeadsLinear, NonCausalEqualsRepeatedHeads) {
  for (const Shape& s : kShapes) {
    check_non_causal<MatD>(s, EluPlusOne{});
    check_non_causal<RowD>(s, EluPlusOne{});
    check_non_causal<MatD>(s, SoftmaxSplit{});
  }
}

// Every causal form, with and without carried states, against the repeated-heads call.
template <class Storage>
void check_causal(const Shape& s, CausalAlgorithm algorithm) {
  SCOPED_TRACE(s.name());
  const Inputs in(s, test::seed_of({s.Hk, s.G, s.D, s.M, s.N(), 2}));
  const Storage Q = in.Q, K = in.K, V = in.V, Qr = in.Qr, Kr = in.Kr;
  const Index N = s.N(), H = s.H(), B = s.B();
  CausalOptions plain;
  plain.algorithm = algorithm;
  CausalOptions shared = plain;
  shared.key_heads = s.Hk;
  shared.key_dim = s.D;
  shared.value_dim = s.M;
  const EluPlusOne phi;
  MultiHeadWorkspace<double> ws;
  Storage out(N, H * s.M), want(N, H * s.M);
  for (int threads : {1, 2}) {
    ParallelOptions par;
    par.num_threads = threads;
    linattn::batched_causal_linear_attention(Q, K, V, s.offsets, H, phi, out, ws, shared, par);
    linattn::batched_causal_linear_attention(Qr, Kr, V, s.offsets, H, phi, want, ws, plain, par);
    EXPECT_TRUE(same_bits(out, want)) << "batched causal, threads = " << threads;
    // Carried states, one per (sequence, value head), continued from non-zero ones.
    std::vector<StateD> st, st_want;
    for (Index i = 0; i < B * H; ++i) {
      StateD x = linattn::make_state<double>(phi, s.D, s.M);
      x.S = test::random_matrix(s.D, s.M, 40 + std::uint32_t(i), 0.0, 1.0);
      x.z = test::random_matrix(s.D, 1, 80 + std::uint32_t(i), 0.5, 1.0);
      st.push_back(x);
    }
    st_want = st;
    linattn::masked_batched_causal_linear_attention(Q, K, V, s.offsets, in.keep, H, phi, st, out,
                                                    ws, shared, par);
    linattn::masked_batched_causal_linear_attention(Qr, Kr, V, s.offsets, in.keep, H, phi,
                                                    st_want, want, ws, plain, par);
    EXPECT_TRUE(same_bits(out, want)) << "masked batched causal with states";
    ASSERT_EQ(st.size(), std::size_t(B * H));
    for (std::size_t i = 0; i < st.size(); ++i)
      EXPECT_TRUE(test::same_state(st[i], st_want[i])) << "state " << i;
  }
  if (B != 1) return;
  linattn::multihead_causal_linear_attention(Q, K, V, H, phi, out, ws, shared);
  linattn::multihead_causal_linear_attention(Qr, Kr, V, H, phi, want, ws, plain);
  EXPECT_TRUE(same_bits(out, want)) << "multihead causal";
  linattn::masked_multihead_causal_linear_attention(Q, K, V, in.keep, H, phi, out, ws, shared);
  linattn::masked_multihead_causal_linear_attention(Qr, Kr, V, in.keep, H, phi, want, ws, plain);
  EXPECT_TRUE(same_bits(out, want)) << "masked multihead causal";
  std::vector<StateD> st, st_want;
  const MatD got = linattn::multihead_causal_linear_attention(in.Q, in.K, in.V, H, phi, st, shared);
  linattn::multihead_causal_linear_attention(Qr, Kr, V, H, phi, st_want, want, ws, plain);
  EXPECT_TRUE(same_bits(Storage(got), want)) << "multihead causal with states";
  for (std::size_t i = 0; i < st.size(); ++i) EXPECT_TRUE(test::same_state(st[i], st_want[i]));
  for (Index h = 0; h < H; ++h) {
    const Index c = h / s.G * s.D;
    EXPECT_LE(rel(got.middleCols(h * s.M, s.M),
                  ref::causal_linear_attention(in.Q.middleCols(c, s.D), in.K.middleCols(c, s.D),
                                               in.V.middleCols(h * s.M, s.M), phi)),
              1e-12)
        << "head " << h;
  }
}

TEST(SharedHeadsLinear, CausalEqualsRepeatedHeads) {
  for (const Shape& s : kShapes) {
    check_causal<MatD>(s, CausalAlgorithm::Chunked);
    check_causal<MatD>(s, CausalAlgorithm::Recurrent);
    check_causal<RowD>(s, CausalAlgorithm::Auto);
  }
}

// Gradients of a shared head: the repeated-heads backward summed over each group.
template <bool Causal>
void check_backward(const Shape& s) {
  SCOPED_TRACE(s.name());
  const Inputs in(s, test::seed_of({s.Hk, s.G, s.D, s.M, s.N(), 3}));
  const Index H = s.H();
  const MatD dOut = test::random_matrix(s.N(), H * s.M, 99);
  const EluPlusOne phi;
  for (int threads : {1, 2}) {
    ParallelOptions par;
    par.num_threads = threads;
    linattn::AttentionGradients<double> got, rep;
    if constexpr (Causal) {
      CausalOptions shared;
      shared.key_heads = s.Hk;
      got = linattn::multihead_causal_linear_attention_backward(in.Q, in.K, in.V, dOut, H, phi,
                                                                shared, par);
      rep = linattn::multihead_causal_linear_attention_backward(in.Qr, in.Kr, in.V, dOut, H, phi,
                                                                CausalOptions{}, par);
    } else {
      HeadOptions layout;
      layout.key_heads = s.Hk;
      got = linattn::multihead_linear_attention_backward(in.Q, in.K, in.V, dOut, H, phi, layout,
                                                         par);
      rep = linattn::multihead_linear_attention_backward(in.Qr, in.Kr, in.V, dOut, H, phi, par);
    }
    EXPECT_TRUE(same_bits(got.dQ, sum_heads(rep.dQ, s.Hk, s.G))) << "dQ, threads " << threads;
    EXPECT_TRUE(same_bits(got.dK, sum_heads(rep.dK, s.Hk, s.G))) << "dK, threads " << threads;
    EXPECT_TRUE(same_bits(got.dV, rep.dV)) << "dV, threads " << threads;
  }
}

TEST(SharedHeadsLinear, BackwardSumsOverValueHeads) {
  for (const Shape& s : kShapes) {
    if (s.B() != 1) continue;
    check_backward<false>(s);
    check_backward<true>(s);
  }
  check_backward<true>({2, 3, 6, 4, {0, 61}});
}

// dQ, dK of a shared head against central differences of the loss <dOut, out>.
TEST(SharedHeadsLinear, BackwardMatchesCentralDifferences) {
  const Shape s{1, 4, 3, 2, {0, 7}};
  const Inputs in(s, 5);
  const Index H = s.H();
  const MatD dOut = test::random_matrix(s.N(), H * s.M, 6);
  CausalOptions shared;
  shared.key_heads = s.Hk;
  HeadOptions layout;
  layout.key_heads = s.Hk;
  const EluPlusOne phi;
  for (bool causal : {false, true}) {
    const auto loss = [&](const MatD& Q, const MatD& K) {
      const MatD out = causal ? linattn::multihead_causal_linear_attention(Q, K, in.V, H, phi, shared)
                              : linattn::multihead_linear_attention(Q, K, in.V, H, phi, layout);
      return (out.array() * dOut.array()).sum();
    };
    const auto g = causal ? linattn::multihead_causal_linear_attention_backward(
                                in.Q, in.K, in.V, dOut, H, phi, shared)
                          : linattn::multihead_linear_attention_backward(in.Q, in.K, in.V, dOut,
                                                                         H, phi, layout);
    const double e = 1e-6;
    MatD nq(in.Q.rows(), in.Q.cols()), nk(in.K.rows(), in.K.cols());
    for (Index i = 0; i < in.Q.size(); ++i) {
      MatD a = in.Q, b = in.Q;
      a(i) += e;
      b(i) -= e;
      nq(i) = (loss(a, in.K) - loss(b, in.K)) / (2 * e);
      MatD c = in.K, d = in.K;
      c(i) += e;
      d(i) -= e;
      nk(i) = (loss(in.Q, c) - loss(in.Q, d)) / (2 * e);
    }
    EXPECT_LE(rel(g.dQ, nq), 1e-7) << "causal " << causal;
    EXPECT_LE(rel(g.dK, nk), 1e-7) << "causal " << causal;
  }
}

// The decoders with shared heads: every step against the forward (and the prefill's states).
TEST(SharedHeadsLinear, DecodersStepAsTheForward) {
  const Index Hk = 2, G = 3, H = Hk * G, D = 4, M = 5, P = 30, T = 20, N = P + T;
  const Shape s{Hk, G, D, M, {0, N}};
  const Inputs in(s, 11);
  CausalOptions shared;
  shared.key_heads = Hk;
  const EluPlusOne phi;
  const MatD whole = linattn::multihead_causal_linear_attention(in.Q, in.K, in.V, H, phi, shared);

  linattn::MultiHeadRecurrentLinearAttention<EluPlusOne, double> rnn(H, D, M, phi, shared);
  linattn::MultiHeadRecurrentLinearAttention<EluPlusOne, double> rep(H, D, M, phi);
  EXPECT_EQ(rnn.key_heads(), Hk);
  EXPECT_EQ(rep.key_heads(), H);
  MatD steps(N, H * M);
  for (Index t = 0; t < N; ++t) {
    const Eigen::VectorXd q = in.Q.row(t).transpose(), k = in.K.row(t).transpose();
    const Eigen::VectorXd v = in.V.row(t).transpose();
    const Eigen::VectorXd o = rnn.step(q, k, v);
    steps.row(t) = o.transpose();
    EXPECT_TRUE(same_bits(o, rep.step(Eigen::VectorXd(in.Qr.row(t).transpose()),
                                      Eigen::VectorXd(in.Kr.row(t).transpose()), v)))
        << "token " << t;
  }
  EXPECT_LE(rel(steps, whole), 1e-12);

  // Two sequences: a prefill of P rows carrying the states, then T steps of both.
  const std::vector<Index> offsets = {0, P, 2 * P};
  MatD Q2(2 * P, Hk * D), K2(2 * P, Hk * D), V2(2 * P, H * M);
  Q2 << in.Q.topRows(P), in.Q.topRows(P).reverse();
  K2 << in.K.topRows(P), in.K.topRows(P).reverse();
  V2 << in.V.topRows(P), in.V.topRows(P).reverse();
  std::vector<StateD> states;
  MultiHeadWorkspace<double> ws;
  MatD pre(2 * P, H * M);
  linattn::batched_causal_linear_attention(Q2, K2, V2, offsets, H, phi, states, pre, ws, shared);
  ASSERT_EQ(states.size(), std::size_t(2 * H));
  linattn::BatchedRecurrentLinearAttention<EluPlusOne, double> dec(2, H, D, M, phi, shared);
  EXPECT_EQ(dec.key_heads(), Hk);
  dec.set_states(states, P);
  MatD out(2, H * M);
  for (Index t = P; t < N; ++t) {
    MatD q(2, Hk * D), k(2, Hk * D), v(2, H * M);
    q << in.Q.row(t), in.Q.row(t);
    k << in.K.row(t), in.K.row(t);
    v << in.V.row(t), in.V.row(t);
    dec.step(q, k, v, out);
    EXPECT_LE(rel(out.row(0), whole.row(t)), 1e-12) << "token " << t;
    if (t == P + 5) {
      // Save and load round-trip: the restored decoder steps as the original, bit for bit.
      std::stringstream io;
      linattn::save_state(io, dec);
      linattn::BatchedRecurrentLinearAttention<EluPlusOne, double> back(0, H, D, M, phi, shared);
      linattn::load_state(io, back);
      ASSERT_EQ(back.sequences(), 2);
      MatD o1(2, H * M), o2(2, H * M);
      auto copy = dec;
      copy.step(q, k, v, o1);
      back.step(q, k, v, o2);
      EXPECT_TRUE(same_bits(o1, o2));
      for (Index h = 0; h < H; ++h) EXPECT_TRUE(test::same_state(copy.state(1, h), back.state(1, h)));
    }
  }
}

TEST(SharedHeadsLinear, ErrorsNameBothHeadCounts) {
  const MatD Q = test::random_matrix(10, 2 * 4, 1), K = test::random_matrix(10, 2 * 4, 2);
  const MatD V = test::random_matrix(10, 6 * 3, 3);
  const EluPlusOne phi;
  CausalOptions bad;
  bad.key_heads = 4;  // does not divide 6
  test::expect_invalid([&] { linattn::multihead_causal_linear_attention(Q, K, V, 6, phi, bad); },
                       {"multihead_causal_linear_attention", "key_heads = 4", "heads = 6"},
                       "key_heads not dividing heads");
  HeadOptions layout;
  layout.key_heads = 3;  // 8 columns are not 3 heads
  test::expect_invalid([&] { linattn::multihead_linear_attention(Q, K, V, 6, phi, layout); },
                       {"multihead_linear_attention", "key_heads = 3", "heads = 6", "8"},
                       "Q columns not a multiple of key_heads");
  CausalOptions dims;
  dims.key_dim = 4;  // Q holds 2 heads of 4 but key_heads says 6
  MatD out(10, 18);
  MultiHeadWorkspace<double> ws;
  test::expect_invalid([&] { linattn::batched_causal_linear_attention(
                                 Q, K, V, std::vector<Index>{0, 10}, 6, phi, out, ws, dims); },
                       {"batched_causal_linear_attention", "key_dim = 4", "H = 6",
                        "key_heads = 6", "set key_heads"},
                       "key_dim mismatch");
  dims.key_heads = 2;
  dims.value_dim = 4;  // V holds 6 heads of 3
  test::expect_invalid([&] { linattn::multihead_causal_linear_attention(Q, K, V, 6, phi, dims); },
                       {"value_dim = 4", "key_heads = 2", "heads = 6"}, "value_dim mismatch");
  HeadOptions back;
  back.key_heads = 4;
  test::expect_invalid([&] { linattn::multihead_linear_attention_backward(Q, K, V, V, 6, phi,
                                                                          back); },
                       {"multihead_linear_attention_backward", "key_heads = 4", "heads = 6"},
                       "backward");
  CausalOptions one;
  one.key_heads = 2;  // a single-head call takes 0 or 1
  test::expect_invalid([&] { linattn::causal_linear_attention(Q, K, V.leftCols(3), phi, one); },
                       {"causal_linear_attention", "key_heads = 2", "heads = 1"}, "single head");
  test::expect_invalid(
      [&] { linattn::MultiHeadRecurrentLinearAttention<EluPlusOne, double>(6, 4, 3, phi, bad); },
      {"MultiHeadRecurrentLinearAttention", "key_heads = 4", "heads = 6"}, "decoder");
  test::expect_invalid(
      [&] { linattn::BatchedRecurrentLinearAttention<EluPlusOne, double>(2, 6, 4, 3, phi, bad); },
      {"BatchedRecurrentLinearAttention", "key_heads = 4", "heads = 6"}, "batched decoder");
  CausalOptions two;
  two.key_heads = 2;
  linattn::MultiHeadRecurrentLinearAttention<EluPlusOne, double> rnn(6, 4, 3, phi, two);
  Eigen::VectorXd o(18);
  test::expect_invalid([&] { rnn.step(Eigen::VectorXd::Zero(24), Eigen::VectorXd::Zero(24),
                                      Eigen::VectorXd::Zero(18), o); },
                       {"step", "key_heads = 2", "heads = 6", "24"}, "decoder step");
  linattn::BatchedRecurrentLinearAttention<EluPlusOne, double> dec(1, 6, 4, 3, phi, two);
  MatD ob(1, 18);
  test::expect_invalid([&] { dec.step(MatD::Zero(1, 24), MatD::Zero(1, 24), MatD::Zero(1, 18),
                                      ob); },
                       {"step", "key_heads = 2", "1x8"}, "batched decoder step");
}

}  // namespace
