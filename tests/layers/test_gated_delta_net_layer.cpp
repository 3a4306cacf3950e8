// GatedDeltaNetLayer (layers/gated_delta_net_layer.hpp): the forward against the layer written
// out plainly in long double from transformers' formulas (its interleaved projections, the
// convolution, the gates, the L2 norms, the per-token gated delta rule with shared key heads,
// the gated RMSNorm); prefills continued, packed sequences against separate ones, batched decode
// steps against the forward, sequences added and removed, an allocation-free step, the errors.
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

using linattn::GatedDeltaNetConfig;
using test::Index;
using test::layer_ref::inputs;
using test::layer_ref::LD;
using test::layer_ref::MatL;
using test::layer_ref::row_error;
using test::layer_ref::silu;
using test::layer_ref::softplus;
using test::layer_ref::tolerance;

template <class S>
using Layer = linattn::GatedDeltaNetLayer<S>;

GatedDeltaNetConfig small_config(Index hk, Index hv, Index dk, Index dv, Index w, Index d = 12) {
  GatedDeltaNetConfig c;
  c.hidden_size = d;
  c.linear_num_key_heads = hk;
  c.linear_num_value_heads = hv;
  c.linear_key_head_dim = dk;
  c.linear_value_head_dim = dv;
  c.linear_conv_kernel_dim = w;
  c.rms_norm_eps = 1e-6;
  return c;
}

// The reference's carried state: the convolution's previous inputs (oldest first) and one
// Dk x Dv state per value head.
struct RefState {
  MatL conv;  // rows: previous inputs of the conv_dim channels
  std::vector<MatL> heads;
};

// transformers' Qwen3NextGatedDeltaNet.forward for one sequence, token by token, in long double.
template <class S>
MatL reference(const Layer<S>& layer, const MatL& X, RefState& st) {
  const auto& c = layer.config();
  const Index d = c.hidden_size, hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const Index dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const Index W = c.linear_conv_kernel_dim, G = hv / hk, kd = hk * dk, vd = hv * dv;
  const Index C = 2 * kd + vd, N = X.rows();
  const MatL Wqkvz = layer.in_proj_qkvz.template cast<LD>(),
             Wba = layer.in_proj_ba.template cast<LD>();
  const MatL conv_w = layer.conv1d_weight.template cast<LD>(),
             Wo = layer.out_proj.template cast<LD>();
  if (st.conv.size() == 0) st.conv = MatL::Zero(W - 1, C);
  if (st.heads.empty()) st.heads.assign(static_cast<std::size_t>(hv), MatL::Zero(dk, dv));
  MatL Y(N, d);
  for (Index t = 0; t < N; ++t) {
    const Eigen::Matrix<LD, Eigen::Dynamic, 1> x = X.row(t).transpose();
    const Eigen::Matrix<LD, Eigen::Dynamic, 1> p = Wqkvz * x, r = Wba * x;
    // fix_query_key_value_ordering: view as [hk, 2·dk + 2·G·dv] and [hk, 2·G], then split.
    Eigen::Matrix<LD, Eigen::Dynamic, 1> mixed(C), z(vd), b(hv), a(hv);
    const Index blk = 2 * dk + 2 * G * dv;
    for (Index i = 0; i < hk; ++i) {
      for (Index j = 0; j < dk; ++j) {
        mixed(i * dk + j) = p(i * blk + j);
        mixed(kd + i * dk + j) = p(i * blk + dk + j);
      }
      for (Index j = 0; j < G * dv; ++j) {
        mixed(2 * kd + i * G * dv + j) = p(i * blk + 2 * dk + j);
        z(i * G * dv + j) = p(i * blk + 2 * dk + G * dv + j);
      }
      for (Index j = 0; j < G; ++j) {
        b(i * G + j) = r(i * 2 * G + j);
        a(i * G + j) = r(i * 2 * G + G + j);
      }
    }
    // The depthwise causal convolution and SiLU.
    Eigen::Matrix<LD, Eigen::Dynamic, 1> u(C);
    for (Index ch = 0; ch < C; ++ch) {
      LD acc = conv_w(ch, W - 1) * mixed(ch);
      for (Index i = 0; i < W - 1; ++i) acc += conv_w(ch, i) * st.conv(i, ch);
      u(ch) = silu(acc);
    }
    if (W > 1) {
      MatL next(W - 1, C);
      next.topRows(W - 2) = st.conv.bottomRows(W - 2);
      next.row(W - 2) = mixed.transpose();
      st.conv = next;
    }
    Eigen::Matrix<LD, Eigen::Dynamic, 1> o(vd);
    for (Index h = 0; h < hv; ++h) {
      const Index kh = h / G;
      Eigen::Matrix<LD, Eigen::Dynamic, 1> q = u.segment(kh * dk, dk),
                                           k = u.segment(kd + kh * dk, dk);
      q /= std::sqrt(q.squaredNorm() + LD(1e-6));
      k /= std::sqrt(k.squaredNorm() + LD(1e-6));
      const Eigen::Matrix<LD, Eigen::Dynamic, 1> v = u.segment(2 * kd + h * dv, dv);
      const LD beta = 1 / (1 + std::exp(-b(h)));
      const LD g = -std::exp(LD(layer.A_log(h))) * softplus(a(h) + LD(layer.dt_bias(h)));
      MatL& St = st.heads[static_cast<std::size_t>(h)];
      St *= std::exp(g);
      const Eigen::Matrix<LD, Eigen::Dynamic, 1> delta = (v - St.transpose() * k) * beta;
      St += k * delta.transpose();
      o.segment(h * dv, dv) = St.transpose() * q / std::sqrt(LD(dk));
    }
    // The gated RMSNorm per value head, then the output projection.
    for (Index h = 0; h < hv; ++h) {
      auto oh = o.segment(h * dv, dv);
      const LD rms = 1 / std::sqrt(oh.squaredNorm() / LD(dv) + LD(c.rms_norm_eps));
      for (Index j = 0; j < dv; ++j)
        oh(j) = oh(j) * rms * LD(layer.norm_weight(j)) * silu(z(h * dv + j));
    }
    Y.row(t) = (Wo * o).transpose();
  }
  return Y;
}

template <class S>
void check_forward(const GatedDeltaNetConfig& cfg, Index N, std::uint32_t seed) {
  SCOPED_TRACE("Hk " + std::to_string(cfg.linear_num_key_heads) + " Hv " +
               std::to_string(cfg.linear_num_value_heads) + " Dk " +
               std::to_string(cfg.linear_key_head_dim) + " Dv " +
               std::to_string(cfg.linear_value_head_dim) + " W " +
               std::to_string(cfg.linear_conv_kernel_dim) + " N " + std::to_string(N));
  Layer<S> layer(cfg, seed);
  const auto X = inputs<S>(N, cfg.hidden_size, seed + 1);
  RefState ref;
  const MatL want = reference(layer, X.template cast<LD>(), ref);
  const auto Y = layer.forward(X);
  ASSERT_EQ(Y.rows(), N);
  ASSERT_EQ(Y.cols(), cfg.hidden_size);
  EXPECT_LE(row_error(Y, want), tolerance<S>());
  // Split into a prefill and its continuation: the same rows and the reference's state.
  const Index a = N / 3;
  auto state = layer.make_state();
  const auto Y1 = layer.forward(X.topRows(a), state);
  const auto Y2 = layer.forward(X.bottomRows(N - a), state);
  EXPECT_LE(row_error(Y1, want.topRows(a)), tolerance<S>());
  EXPECT_LE(row_error(Y2, want.bottomRows(N - a)), tolerance<S>());
  EXPECT_EQ(state.position, N);
  ASSERT_EQ(static_cast<Index>(state.heads.size()), cfg.linear_num_value_heads);
  for (Index h = 0; h < cfg.linear_num_value_heads; ++h) {
    const MatL& Sref = ref.heads[static_cast<std::size_t>(h)];
    const LD scale = std::max<LD>(Sref.cwiseAbs().maxCoeff(), 1e-30L);
    EXPECT_LE(double((state.heads[static_cast<std::size_t>(h)].S.template cast<LD>() - Sref)
                         .cwiseAbs()
                         .maxCoeff() /
                     scale),
              tolerance<S>());
  }
}

template <class S>
void forward_shapes() {
  check_forward<S>(small_config(2, 4, 6, 5, 4), 37, 11);  // shared key heads, Dk != Dv
  check_forward<S>(small_config(3, 3, 4, 7, 3), 20, 12);  // one value head per key head
  check_forward<S>(small_config(1, 3, 5, 4, 1), 9, 13);   // W = 1: no carried inputs
  check_forward<S>(small_config(2, 4, 6, 5, 4), 1, 14);   // N = 1
  check_forward<S>(small_config(2, 2, 8, 8, 4, 16), 70, 15);
}

TEST(GatedDeltaNetLayer, ForwardAgainstTransformersFormulas) {
#ifdef LINATTN_TEST_DOUBLE
  forward_shapes<double>();
#endif
#ifdef LINATTN_TEST_FLOAT
  forward_shapes<float>();
#endif
}

TEST(GatedDeltaNetLayer, PackedSequencesEqualSeparateOnes) {
  const auto cfg = small_config(2, 4, 6, 5, 4);
  Layer<double> layer(cfg, 3);
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
void decode_against_forward(const GatedDeltaNetConfig& cfg, Index B) {
  Layer<S> layer(cfg, 21);
  const Index T = 6;
  std::vector<Index> prompt = {4, 0, 9};  // sequence 1 starts from a zero state
  while (Index(prompt.size()) < B) prompt.push_back(Index(prompt.size()) % 5);
  auto batch = layer.make_batched_state(B);
  std::vector<Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic>> X;
  for (std::size_t b = 0; b < prompt.size(); ++b) {
    X.push_back(inputs<S>(prompt[b] + T, cfg.hidden_size, 30 + std::uint32_t(b)));
    auto st = layer.make_state();
    layer.forward(X[b].topRows(prompt[b]), st);
    batch.set_state(Index(b), st);
  }
  Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic> xb(B, cfg.hidden_size), yb(B, cfg.hidden_size);
  std::vector<Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic>> got(static_cast<std::size_t>(B));
  for (auto& g : got) g.resize(T, cfg.hidden_size);
  for (Index t = 0; t < T; ++t) {
    for (Index b = 0; b < B; ++b) xb.row(b) = X[std::size_t(b)].row(prompt[std::size_t(b)] + t);
    layer.step(xb, batch, yb);
    for (Index b = 0; b < B; ++b) got[std::size_t(b)].row(t) = yb.row(b);
  }
  for (std::size_t b = 0; b < prompt.size(); ++b) {
    RefState ref;
    const MatL want = reference(layer, X[b].template cast<LD>(), ref);
    EXPECT_LE(row_error(got[b], want.bottomRows(T)), tolerance<S>()) << "sequence " << b;
    EXPECT_EQ(batch.state(Index(b)).position, prompt[b] + T);
  }
}

TEST(GatedDeltaNetLayer, BatchedStepsEqualTheForward) {
  // B = 7 and hidden_size 300: the projections on the micro-kernel, their depth in blocks.
#ifdef LINATTN_TEST_DOUBLE
  decode_against_forward<double>(small_config(2, 4, 6, 5, 3), 3);
  decode_against_forward<double>(small_config(1, 2, 8, 8, 4, 300), 7);
#endif
#ifdef LINATTN_TEST_FLOAT
  decode_against_forward<float>(small_config(2, 4, 6, 5, 3), 3);
  decode_against_forward<float>(small_config(1, 2, 8, 8, 4, 300), 7);
#endif
}

TEST(GatedDeltaNetLayer, SequencesAddedAndRemoved) {
  const auto cfg = small_config(1, 2, 4, 3, 4);
  Layer<double> layer(cfg, 5);
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
}

TEST(GatedDeltaNetLayer, DecodeStepAllocatesNothing) {
  const auto cfg = small_config(2, 4, 8, 8, 4, 16);
  Layer<float> layer(cfg, 8);
  auto batch = layer.make_batched_state(3);
  const Eigen::MatrixXf X = inputs<float>(3, cfg.hidden_size, 9);
  Eigen::MatrixXf Y(3, cfg.hidden_size);
  layer.step(X, batch, Y);  // sizes the states
  const test::Allocations a = test::allocations_in([&] { layer.step(X, batch, Y); });
  EXPECT_EQ(a.eigen, 0);
  EXPECT_EQ(a.news, 0);
}

TEST(GatedDeltaNetLayer, Errors) {
  const auto cfg = small_config(2, 4, 6, 5, 4);
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
  bad.linear_num_value_heads = 5;
  throws_naming([&] { Layer<double> l(bad); }, {"GatedDeltaNetLayer", "5", "multiple"});
  bad = cfg;
  bad.linear_key_head_dim = 0;
  throws_naming([&] { Layer<double> l(bad); }, {"linear_key_head_dim", "0"});
  bad = cfg;
  bad.rms_norm_eps = -1;
  throws_naming([&] { Layer<double> l(bad); }, {"rms_norm_eps"});

  Layer<double> layer(cfg, 1);
  throws_naming([&] { layer.forward(Eigen::MatrixXd::Zero(3, 5)); },
                {"GatedDeltaNetLayer::forward", "3x5", "12"});
  Layer<double> broken = layer;
  broken.out_proj.resize(3, 3);
  throws_naming([&] { broken.forward(Eigen::MatrixXd::Zero(3, 12)); },
                {"out_proj", "3 x 3", "12 x 20"});
  Eigen::MatrixXd X = Eigen::MatrixXd::Ones(3, 12);
  layer.A_log(1) = std::numeric_limits<double>::infinity();
  throws_naming([&] { layer.forward(X); }, {"A_log", "inf"});
  layer.A_log(1) = 0;
  std::vector<Layer<double>::State> two(2);
  const std::vector<int> offsets = {0, 1, 2, 3};
  throws_naming([&] { layer.forward(X, offsets, two); }, {"states", "2", "B = 3"});
  auto batch = layer.make_batched_state(2);
  Eigen::MatrixXd Y(2, 12);
  throws_naming([&] { layer.step(X, batch, Y); }, {"GatedDeltaNetLayer::step", "3x12", "2 x 12"});
  Eigen::MatrixXd x2 = Eigen::MatrixXd::Ones(2, 12);
  x2(1, 0) = std::numeric_limits<double>::quiet_NaN();
  const auto before = batch.state(0);
  throws_naming([&] { layer.step(x2, batch, Y); }, {"Xb(1, 0) = nan"});
  EXPECT_EQ(batch.state(0).position, before.position);
  auto st = layer.make_state();
  st.conv.resize(2, 2);
  throws_naming([&] { batch.set_state(0, st); }, {"set_state", "conv", "3 x 44"});
}

TEST(GatedDeltaNetLayer, ParameterShapesUseTransformersNames) {
  const Layer<float> layer(small_config(2, 4, 6, 5, 4));
  const auto shapes = layer.parameter_shapes();
  ASSERT_EQ(shapes.size(), 7u);
  EXPECT_EQ(shapes[0].first, "in_proj_qkvz.weight");
  EXPECT_EQ(shapes[0].second, (std::vector<Index>{2 * 12 + 2 * 20, 12}));
  EXPECT_EQ(shapes[2].first, "conv1d.weight");
  EXPECT_EQ(shapes[2].second, (std::vector<Index>{2 * 12 + 20, 1, 4}));
  EXPECT_EQ(layer.in_proj_qkvz.rows(), 64);
  EXPECT_EQ(layer.norm_weight.size(), 5);
  EXPECT_TRUE((layer.dt_bias.array() == 1).all());
  EXPECT_TRUE((layer.A_log.array() < std::log(16.0f)).all());
}

TEST(GatedDeltaNetLayer, WeightsFromASafetensorsCheckpoint) {
  const auto cfg = small_config(2, 4, 6, 5, 4);
  const Layer<double> trained(cfg, 41);
  linattn::SafetensorsWriter w;
  trained.save(w, "model.layers.0.linear_attn.");
  const auto file = linattn::SafetensorsFile::from_bytes(w.bytes(), "ckpt");
  EXPECT_EQ(file.info("model.layers.0.linear_attn.conv1d.weight").shape,
            (std::vector<Index>{44, 1, 4}));
  Layer<double> layer(cfg, 1);
  layer.load(file, "model.layers.0.linear_attn.");
  EXPECT_EQ(layer.in_proj_qkvz, trained.in_proj_qkvz);
  EXPECT_EQ(layer.conv1d_weight, trained.conv1d_weight);
  EXPECT_EQ(layer.A_log, trained.A_log);
  const Eigen::MatrixXd X = inputs<double>(9, cfg.hidden_size, 42);
  EXPECT_EQ(layer.forward(X), trained.forward(X));
  // float from the same checkpoint: converted once per entry.
  Layer<float> lf(cfg, 1);
  lf.load(file, "model.layers.0.linear_attn.");
  EXPECT_EQ(lf.out_proj, trained.out_proj.cast<float>());

  // A missing tensor or a wrong shape is named, and the layer keeps its parameters.
  const Layer<double> before = layer;
  try {
    layer.load(file, "model.layers.1.linear_attn.");
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("GatedDeltaNetLayer::load"), std::string::npos) << m;
    EXPECT_NE(m.find("model.layers.1.linear_attn.in_proj_qkvz.weight"), std::string::npos) << m;
  }
  Layer<double> other(small_config(2, 4, 6, 6, 4), 1);  // Dv = 6: every value shape differs
  EXPECT_THROW(other.load(file, "model.layers.0.linear_attn."), std::invalid_argument);
  EXPECT_EQ(layer.in_proj_qkvz, before.in_proj_qkvz);
}

}  // namespace
