// KimiDeltaAttentionLayer (layers/kimi_delta_attention_layer.hpp): the forward against the layer
// written out plainly in long double from Kimi Linear's formulas (the q, k, v projections and
// their three convolutions, the low-rank decay and output gates, both forms of g, the L2 norms,
// the per-token, per-channel gated delta rule, the sigmoid-gated RMSNorm); prefills continued,
// packed sequences against separate ones, batched decode steps against the forward, an
// allocation-free step, checkpoints written and read, the errors.
#ifndef EIGEN_RUNTIME_NO_MALLOC
#define EIGEN_RUNTIME_NO_MALLOC
#endif
// clang-format off
#include "eigen_assert_hook.hpp"  // first: before any Eigen header
#include "allocation_count.hpp"  // counts Eigen allocations and global operator new
// clang-format on

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/layers.hpp>
#include <string>
#include <vector>

#include "layer_reference.hpp"
#include "test_util.hpp"

namespace {

using linattn::KimiDeltaAttentionConfig;
using test::Index;
using test::layer_ref::inputs;
using test::layer_ref::LD;
using test::layer_ref::MatL;
using test::layer_ref::row_error;
using test::layer_ref::sigmoid;
using test::layer_ref::silu;
using test::layer_ref::softplus;
using test::layer_ref::tolerance;
using VecL = Eigen::Matrix<LD, Eigen::Dynamic, 1>;

template <class S>
using Layer = linattn::KimiDeltaAttentionLayer<S>;

KimiDeltaAttentionConfig small_config(Index h, Index k, Index v, Index w, Index d = 12,
                                      bool lower_bound = false) {
  KimiDeltaAttentionConfig c;
  c.hidden_size = d;
  c.num_heads = h;
  c.head_dim = k;
  c.head_v_dim = v == k ? 0 : v;
  c.short_conv_kernel_size = w;
  c.rms_norm_eps = 1e-6;
  c.use_lower_bound = lower_bound;
  c.lower_bound = -5.0;
  return c;
}

// The parameters the initialisation leaves plain (dt_bias 0, the norm's weight 1) drawn at
// random, so that the reference checks their use too.
template <class S>
Layer<S> make_layer(const KimiDeltaAttentionConfig& cfg, std::uint32_t seed) {
  Layer<S> layer(cfg, seed);
  layer.dt_bias =
      test::random_matrix<double>(layer.dt_bias.size(), 1, seed + 100).template cast<S>();
  layer.o_norm_weight =
      (test::random_matrix<double>(layer.o_norm_weight.size(), 1, seed + 200).array() + 1.5)
          .matrix()
          .template cast<S>();
  return layer;
}

// The reference's carried state: each convolution's previous inputs (oldest first) and one
// K x V state per head.
struct RefState {
  MatL q, k, v;  // rows: previous inputs of the convolution's channels
  std::vector<MatL> heads;
};

// One token of a depthwise causal convolution with SiLU, moving its window on.
VecL conv_token(const MatL& w, const VecL& x, MatL& prev) {
  const Index C = x.size(), W = w.cols();
  if (prev.size() == 0) prev = MatL::Zero(W - 1, C);
  VecL u(C);
  for (Index ch = 0; ch < C; ++ch) {
    LD acc = w(ch, W - 1) * x(ch);
    for (Index i = 0; i < W - 1; ++i) acc += w(ch, i) * prev(i, ch);
    u(ch) = silu(acc);
  }
  if (W > 1) {
    MatL next(W - 1, C);
    next.topRows(W - 2) = prev.bottomRows(W - 2);
    next.row(W - 2) = x.transpose();
    prev = next;
  }
  return u;
}

// Kimi Linear's KimiDeltaAttention.forward for one sequence, token by token, in long double.
template <class S>
MatL reference(const Layer<S>& layer, const MatL& X, RefState& st) {
  const auto& c = layer.config();
  const Index d = c.hidden_size, H = c.num_heads, K = c.head_dim;
  const Index V = c.head_v_dim == 0 ? K : c.head_v_dim, N = X.rows();
  const auto L = [](const auto& m) { return MatL(m.template cast<LD>()); };
  const MatL Wq = L(layer.q_proj), Wk = L(layer.k_proj), Wv = L(layer.v_proj);
  const MatL Cq = L(layer.q_conv1d_weight), Ck = L(layer.k_conv1d_weight),
             Cv = L(layer.v_conv1d_weight);
  const MatL Wfa = L(layer.f_a_proj), Wfb = L(layer.f_b_proj), Wb = L(layer.b_proj);
  const MatL Wga = L(layer.g_a_proj), Wgb = L(layer.g_b_proj), Wo = L(layer.o_proj);
  if (st.heads.empty()) st.heads.assign(static_cast<std::size_t>(H), MatL::Zero(K, V));
  MatL Y(N, d);
  for (Index t = 0; t < N; ++t) {
    const VecL x = X.row(t).transpose();
    const VecL q = conv_token(Cq, Wq * x, st.q), k = conv_token(Ck, Wk * x, st.k),
               v = conv_token(Cv, Wv * x, st.v);
    const VecL a = Wfb * (Wfa * x), b = Wb * x, z = Wgb * (Wga * x);
    VecL o(H * V);
    for (Index h = 0; h < H; ++h) {
      VecL qh = q.segment(h * K, K), kh = k.segment(h * K, K);
      qh /= std::sqrt(qh.squaredNorm() + LD(1e-6));
      kh /= std::sqrt(kh.squaredNorm() + LD(1e-6));
      const VecL vh = v.segment(h * V, V);
      const LD beta = sigmoid(b(h)), rate = std::exp(LD(layer.A_log(h)));
      MatL& Sh = st.heads[static_cast<std::size_t>(h)];
      for (Index j = 0; j < K; ++j) {
        const LD u = a(h * K + j) + LD(layer.dt_bias(h * K + j));
        const LD g =
            c.use_lower_bound ? LD(c.lower_bound) * sigmoid(rate * u) : -rate * softplus(u);
        Sh.row(j) *= std::exp(g);
      }
      const VecL delta = (vh - Sh.transpose() * kh) * beta;
      Sh += kh * delta.transpose();
      o.segment(h * V, V) = Sh.transpose() * qh / std::sqrt(LD(K));
    }
    for (Index h = 0; h < H; ++h) {
      auto oh = o.segment(h * V, V);
      const LD r = 1 / std::sqrt(oh.squaredNorm() / LD(V) + LD(c.rms_norm_eps));
      for (Index j = 0; j < V; ++j)
        oh(j) = oh(j) * r * LD(layer.o_norm_weight(j)) * sigmoid(z(h * V + j));
    }
    Y.row(t) = (Wo * o).transpose();
  }
  return Y;
}

template <class S>
void check_forward(const KimiDeltaAttentionConfig& cfg, Index N, std::uint32_t seed) {
  const std::string what = std::string(std::is_same_v<S, double> ? "double" : "float") + " H " +
                           std::to_string(cfg.num_heads) + " K " + std::to_string(cfg.head_dim) +
                           " V " + std::to_string(cfg.head_v_dim ? cfg.head_v_dim : cfg.head_dim) +
                           " W " + std::to_string(cfg.short_conv_kernel_size) + " N " +
                           std::to_string(N) + (cfg.use_lower_bound ? " lower bound" : " softplus");
  SCOPED_TRACE(what);
  const Layer<S> layer = make_layer<S>(cfg, seed);
  const auto X = inputs<S>(N, cfg.hidden_size, seed + 1);
  RefState ref;
  const MatL want = reference(layer, X.template cast<LD>(), ref);
  const auto Y = layer.forward(X);
  ASSERT_EQ(Y.rows(), N);
  ASSERT_EQ(Y.cols(), cfg.hidden_size);
  const double e = row_error(Y, want);
  test::report_error("KimiDeltaAttentionLayer/forward/" + what, e);
  EXPECT_LE(e, tolerance<S>());
  // Split into a prefill and its continuation: the same rows and the reference's state.
  const Index a = N / 3;
  auto state = layer.make_state();
  const auto Y1 = layer.forward(X.topRows(a), state);
  const auto Y2 = layer.forward(X.bottomRows(N - a), state);
  EXPECT_LE(row_error(Y1, want.topRows(a)), tolerance<S>());
  EXPECT_LE(row_error(Y2, want.bottomRows(N - a)), tolerance<S>());
  EXPECT_EQ(state.position, N);
  ASSERT_EQ(static_cast<Index>(state.heads.size()), cfg.num_heads);
  for (Index h = 0; h < cfg.num_heads; ++h) {
    const MatL& Sref = ref.heads[static_cast<std::size_t>(h)];
    const LD scale = std::max<LD>(Sref.cwiseAbs().maxCoeff(), 1e-30L);
    EXPECT_LE(double((state.heads[static_cast<std::size_t>(h)].S.template cast<LD>() - Sref)
                         .cwiseAbs()
                         .maxCoeff() /
                     scale),
              tolerance<S>());
  }
  // The convolution state: the three reference windows side by side, q | k | v.
  const Index W = cfg.short_conv_kernel_size;
  ASSERT_EQ(state.conv.rows(), W - 1);
  if (W > 1) {
    const Index HK = ref.q.cols(), HV = ref.v.cols();
    ASSERT_EQ(state.conv.cols(), 2 * HK + HV);
    EXPECT_LE(row_error(state.conv.leftCols(HK), ref.q), tolerance<S>());
    EXPECT_LE(row_error(state.conv.middleCols(HK, HK), ref.k), tolerance<S>());
    EXPECT_LE(row_error(state.conv.rightCols(HV), ref.v), tolerance<S>());
  }
}

template <class S>
void forward_shapes(bool lower_bound) {
  check_forward<S>(small_config(2, 6, 5, 4, 12, lower_bound), 37, 11);  // K != V
  check_forward<S>(small_config(3, 4, 4, 3, 12, lower_bound), 20, 12);  // H = 3, W = 3
  check_forward<S>(small_config(1, 5, 7, 1, 9, lower_bound), 9, 13);    // H = 1, W = 1
  check_forward<S>(small_config(2, 6, 5, 4, 12, lower_bound), 1, 14);   // N = 1
  check_forward<S>(small_config(2, 8, 8, 4, 16, lower_bound), 71, 15);  // N prime
}

TEST(KimiDeltaAttentionLayer, ForwardAgainstKimiLinearFormulas) {
#ifdef LINATTN_TEST_DOUBLE
  forward_shapes<double>(false);
#endif
#ifdef LINATTN_TEST_FLOAT
  forward_shapes<float>(false);
#endif
}

TEST(KimiDeltaAttentionLayer, LowerBoundedGateAgainstTheFormulas) {
#ifdef LINATTN_TEST_DOUBLE
  forward_shapes<double>(true);
#endif
#ifdef LINATTN_TEST_FLOAT
  forward_shapes<float>(true);
#endif
}

TEST(KimiDeltaAttentionLayer, PackedSequencesEqualSeparateOnes) {
  const auto cfg = small_config(2, 6, 5, 4);
  const Layer<double> layer = make_layer<double>(cfg, 3);
  const std::vector<int> offsets = {0, 5, 5, 17, 18};
  const Eigen::MatrixXd X = inputs<double>(18, cfg.hidden_size, 4);
  std::vector<Layer<double>::State> states;
  const Eigen::MatrixXd Y = layer.forward(X, offsets, states);
  ASSERT_EQ(states.size(), 4u);
  for (std::size_t b = 0; b + 1 < offsets.size(); ++b) {
    const Index n = offsets[b + 1] - offsets[b];
    auto st = layer.make_state();
    const Eigen::MatrixXd Yb = layer.forward(X.middleRows(offsets[b], n), st);
    EXPECT_EQ(states[b].position, n);
    if (n == 0) continue;  // an empty sequence: nothing to compare
    EXPECT_LE((Y.middleRows(offsets[b], n) - Yb).cwiseAbs().maxCoeff(), 1e-13) << b;
    EXPECT_LE((states[b].conv - st.conv).cwiseAbs().maxCoeff(), 1e-13);
    ASSERT_EQ(states[b].heads.size(), st.heads.size());
    for (std::size_t h = 0; h < st.heads.size(); ++h)
      EXPECT_LE((states[b].heads[h].S - st.heads[h].S).cwiseAbs().maxCoeff(), 1e-13);
  }
  // A non-finite input is named, and nothing moves.
  Eigen::MatrixXd Xn = X;
  Xn(7, 2) = std::numeric_limits<double>::quiet_NaN();
  const auto kept = states;
  try {
    layer.forward(Xn, offsets, states);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("X(7, 2) = nan"), std::string::npos) << e.what();
  }
  EXPECT_EQ(states[3].position, kept[3].position);
  EXPECT_EQ(states[2].heads[0].S, kept[2].heads[0].S);
}

template <class S>
void decode_against_forward(bool lower_bound) {
  const auto cfg = small_config(2, 6, 5, 3, 12, lower_bound);
  const Layer<S> layer = make_layer<S>(cfg, 21);
  const Index T = 6;
  const std::vector<Index> prompt = {4, 0, 9};  // sequence 1 starts from a zero state
  auto batch = layer.make_batched_state(3);
  std::vector<Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic>> X;
  for (std::size_t b = 0; b < prompt.size(); ++b) {
    X.push_back(inputs<S>(prompt[b] + T, cfg.hidden_size, 30 + std::uint32_t(b)));
    auto st = layer.make_state();
    layer.forward(X[b].topRows(prompt[b]), st);
    batch.set_state(Index(b), st);
  }
  Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic> xb(3, cfg.hidden_size), yb(3, cfg.hidden_size);
  std::vector<Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic>> got(3);
  for (auto& g : got) g.resize(T, cfg.hidden_size);
  for (Index t = 0; t < T; ++t) {
    for (Index b = 0; b < 3; ++b) xb.row(b) = X[std::size_t(b)].row(prompt[std::size_t(b)] + t);
    layer.step(xb, batch, yb);
    for (Index b = 0; b < 3; ++b) got[std::size_t(b)].row(t) = yb.row(b);
  }
  for (std::size_t b = 0; b < 3; ++b) {
    RefState ref;
    const MatL want = reference(layer, X[b].template cast<LD>(), ref);
    const double e = row_error(got[b], want.bottomRows(T));
    test::report_error(std::string("KimiDeltaAttentionLayer/step/") +
                           (std::is_same_v<S, double> ? "double" : "float"),
                       e);
    EXPECT_LE(e, tolerance<S>()) << "sequence " << b;
    EXPECT_EQ(batch.state(Index(b)).position, prompt[b] + T);
  }
}

TEST(KimiDeltaAttentionLayer, BatchedStepsEqualTheForward) {
#ifdef LINATTN_TEST_DOUBLE
  decode_against_forward<double>(false);
  decode_against_forward<double>(true);
#endif
#ifdef LINATTN_TEST_FLOAT
  decode_against_forward<float>(false);
  decode_against_forward<float>(true);
#endif
}

TEST(KimiDeltaAttentionLayer, SequencesAddedAndRemoved) {
  const auto cfg = small_config(2, 4, 3, 4);
  const Layer<double> layer(cfg, 5);
  auto batch = layer.make_batched_state(2);
  const Eigen::MatrixXd X = inputs<double>(2, cfg.hidden_size, 6);
  Eigen::MatrixXd Y(2, cfg.hidden_size);
  layer.step(X, batch, Y);
  const auto s1 = batch.state(1);
  EXPECT_EQ(batch.add_sequence(), 2);
  batch.remove_sequence(0);  // sequence 2 (empty) takes number 0
  ASSERT_EQ(batch.sequences(), 2);
  EXPECT_EQ(batch.state(0).position, 0);
  EXPECT_EQ(batch.state(1).position, 1);
  EXPECT_EQ(batch.state(1).conv, s1.conv);
  EXPECT_EQ(batch.state(1).heads[1].S, s1.heads[1].S);
  EXPECT_THROW(batch.remove_sequence(2), std::invalid_argument);
  // The grown batch steps on: three rows now.
  EXPECT_EQ(batch.add_sequence(), 2);
  const Eigen::MatrixXd X3 = inputs<double>(3, cfg.hidden_size, 7);
  Eigen::MatrixXd Y3(3, cfg.hidden_size);
  layer.step(X3, batch, Y3);
  EXPECT_EQ(batch.state(2).position, 1);
}

TEST(KimiDeltaAttentionLayer, DecodeStepAllocatesNothing) {
  const auto cfg = small_config(2, 8, 8, 4, 16);
  const Layer<float> layer(cfg, 8);
  auto batch = layer.make_batched_state(3);
  const Eigen::MatrixXf X = inputs<float>(3, cfg.hidden_size, 9);
  Eigen::MatrixXf Y(3, cfg.hidden_size);
  layer.step(X, batch, Y);  // sizes the states
  const test::Allocations a = test::allocations_in([&] { layer.step(X, batch, Y); });
  EXPECT_EQ(a.eigen, 0);
  EXPECT_EQ(a.news, 0);
}

TEST(KimiDeltaAttentionLayer, Errors) {
  const auto cfg = small_config(2, 6, 5, 4);
  const auto throws_naming = [](auto&& call, const std::vector<std::string>& needles) {
    try {
      call();
      ADD_FAILURE() << "no exception";
    } catch (const std::invalid_argument& e) {
      for (const auto& n : needles)
        EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what() << " / " << n;
    }
  };
  auto bad = cfg;
  bad.num_heads = 0;
  throws_naming([&] { Layer<double> l(bad); }, {"KimiDeltaAttentionLayer", "num_heads", "0"});
  bad = cfg;
  bad.head_v_dim = -2;
  throws_naming([&] { Layer<double> l(bad); }, {"head_v_dim", "-2"});
  bad = cfg;
  bad.rms_norm_eps = -1;
  throws_naming([&] { Layer<double> l(bad); }, {"rms_norm_eps"});
  bad = cfg;
  bad.use_lower_bound = true;
  bad.lower_bound = 0.5;
  throws_naming([&] { Layer<double> l(bad); }, {"lower_bound", "0.5"});

  Layer<double> layer(cfg, 1);
  throws_naming([&] { layer.forward(Eigen::MatrixXd::Zero(3, 5)); },
                {"KimiDeltaAttentionLayer::forward", "3x5", "12"});
  Layer<double> broken = layer;
  broken.f_b_proj.resize(3, 3);
  throws_naming([&] { broken.forward(Eigen::MatrixXd::Zero(3, 12)); },
                {"f_b_proj", "3 x 3", "12 x 6"});
  Eigen::MatrixXd X = Eigen::MatrixXd::Ones(3, 12);
  layer.A_log(1) = std::numeric_limits<double>::infinity();
  throws_naming([&] { layer.forward(X); }, {"A_log", "inf"});
  layer.A_log(1) = 0;
  std::vector<Layer<double>::State> two(2);
  const std::vector<int> offsets = {0, 1, 2, 3};
  throws_naming([&] { layer.forward(X, offsets, two); }, {"states", "2", "B = 3"});
  const std::vector<int> backwards = {0, 2, 1, 3};
  throws_naming([&] { layer.forward(X, backwards, two); }, {"offsets"});
  auto batch = layer.make_batched_state(2);
  Eigen::MatrixXd Y(2, 12);
  throws_naming([&] { layer.step(X, batch, Y); },
                {"KimiDeltaAttentionLayer::step", "3x12", "2 x 12"});
  Eigen::MatrixXd x2 = Eigen::MatrixXd::Ones(2, 12);
  x2(1, 0) = std::numeric_limits<double>::quiet_NaN();
  const auto before = batch.state(0);
  throws_naming([&] { layer.step(x2, batch, Y); }, {"Xb(1, 0) = nan"});
  EXPECT_EQ(batch.state(0).position, before.position);
  const Layer<double> other(small_config(2, 6, 6, 4), 1);
  x2(1, 0) = 0;
  throws_naming([&] { other.step(x2, batch, Y); }, {"another shape"});
  auto st = layer.make_state();
  st.conv.resize(2, 2);
  throws_naming([&] { batch.set_state(0, st); }, {"set_state", "conv", "3 x 34"});
  throws_naming([&] { layer.make_batched_state(-1); }, {"make_batched_state", "-1"});
}

TEST(KimiDeltaAttentionLayer, ParameterShapesUseTheCheckpointNames) {
  const Layer<float> layer(small_config(2, 6, 5, 4));
  const auto shapes = layer.parameter_shapes();
  ASSERT_EQ(shapes.size(), 15u);
  EXPECT_EQ(shapes[0].first, "q_proj.weight");
  EXPECT_EQ(shapes[0].second, (std::vector<Index>{12, 12}));
  EXPECT_EQ(shapes[5].first, "v_conv1d.weight");
  EXPECT_EQ(shapes[5].second, (std::vector<Index>{10, 1, 4}));
  EXPECT_EQ(shapes[7].first, "f_b_proj.weight");
  EXPECT_EQ(shapes[7].second, (std::vector<Index>{12, 6}));
  EXPECT_EQ(shapes[11].first, "A_log");
  EXPECT_EQ(shapes[11].second, (std::vector<Index>{1, 1, 2, 1}));
  EXPECT_EQ(shapes[13].first, "o_norm.weight");
  EXPECT_EQ(shapes[13].second, (std::vector<Index>{5}));
  EXPECT_EQ(layer.g_b_proj.rows(), 10);
  EXPECT_TRUE((layer.dt_bias.array() == 0).all());
  EXPECT_TRUE((layer.o_norm_weight.array() == 1).all());
  EXPECT_TRUE((layer.A_log.array() >= 0).all() && (layer.A_log.array() < std::log(16.0f)).all());
  const KimiDeltaAttentionConfig kimi;  // Kimi-Linear-48B's
  EXPECT_EQ(kimi.hidden_size, 2304);
  EXPECT_EQ(kimi.num_heads, 32);
  EXPECT_EQ(kimi.head_dim, 128);
  EXPECT_EQ(kimi.short_conv_kernel_size, 4);
}

TEST(KimiDeltaAttentionLayer, WeightsFromASafetensorsCheckpoint) {
  const auto cfg = small_config(2, 6, 5, 4);
  const Layer<double> trained = make_layer<double>(cfg, 41);
  linattn::SafetensorsWriter w;
  trained.save(w, "model.layers.0.self_attn.");
  const auto file = linattn::SafetensorsFile::from_bytes(w.bytes(), "ckpt");
  EXPECT_EQ(file.info("model.layers.0.self_attn.k_conv1d.weight").shape,
            (std::vector<Index>{12, 1, 4}));
  EXPECT_EQ(file.info("model.layers.0.self_attn.A_log").shape, (std::vector<Index>{1, 1, 2, 1}));
  Layer<double> layer(cfg, 1);
  layer.load(file, "model.layers.0.self_attn.");
  EXPECT_EQ(layer.q_proj, trained.q_proj);
  EXPECT_EQ(layer.v_conv1d_weight, trained.v_conv1d_weight);
  EXPECT_EQ(layer.g_b_proj, trained.g_b_proj);
  EXPECT_EQ(layer.A_log, trained.A_log);
  EXPECT_EQ(layer.dt_bias, trained.dt_bias);
  EXPECT_EQ(layer.o_norm_weight, trained.o_norm_weight);
  const Eigen::MatrixXd X = inputs<double>(9, cfg.hidden_size, 42);
  EXPECT_EQ(layer.forward(X), trained.forward(X));
  // float from the same checkpoint: converted once per entry.
  Layer<float> lf(cfg, 1);
  lf.load(file, "model.layers.0.self_attn.");
  EXPECT_EQ(lf.o_proj, trained.o_proj.cast<float>());

  // A_log stored flat, [H], as some checkpoints do, reads the same.
  linattn::SafetensorsWriter flat;
  for (const auto& t : file.tensors()) {
    std::vector<double> data(static_cast<std::size_t>(t.size()));
    file.read(t.name, t.shape, data.data());
    const bool alog = t.name == "model.layers.0.self_attn.A_log";
    flat.add(t.name, alog ? std::vector<Index>{2} : t.shape, data.data());
  }
  const auto flat_file = linattn::SafetensorsFile::from_bytes(flat.bytes(), "flat");
  Layer<double> from_flat(cfg, 2);
  from_flat.load(flat_file, "model.layers.0.self_attn.");
  EXPECT_EQ(from_flat.A_log, trained.A_log);

  // A missing tensor or a wrong shape is named, and the layer keeps its parameters.
  const Layer<double> before = layer;
  try {
    layer.load(file, "model.layers.1.self_attn.");
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("KimiDeltaAttentionLayer::load"), std::string::npos) << m;
    EXPECT_NE(m.find("model.layers.1.self_attn.q_proj.weight"), std::string::npos) << m;
  }
  Layer<double> wider(small_config(2, 6, 6, 4), 1);  // V = 6: every value shape differs
  try {
    wider.load(file, "model.layers.0.self_attn.");
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("v_proj.weight"), std::string::npos) << e.what();
  }
  EXPECT_EQ(wider.v_proj.rows(), 12);
  EXPECT_EQ(layer.q_proj, before.q_proj);
}

}  // namespace
