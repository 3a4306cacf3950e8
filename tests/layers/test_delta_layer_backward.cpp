// The delta-rule layers' backward (GatedDeltaNetLayer and KimiDeltaAttentionLayer::backward):
// every parameter's and the input's gradient against central differences of the layer's
// forward in double, with shared key heads and without, several convolution widths, packed
// sequences (one empty) against separate calls, float against double, and the errors; from
// carried states: the initial states' gradients (and the final states' taken in) against
// central differences, the zero state against the stateless call bit for bit, two segments
// chained through the state gradients against one call, and the states' errors.
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <linattn/layers.hpp>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "layer_reference.hpp"
#include "test_util.hpp"

namespace {

using linattn::GatedDeltaNetConfig;
using test::Index;
using test::layer_ref::inputs;

using linattn::KimiDeltaAttentionConfig;

template <class S>
using Gdn = linattn::GatedDeltaNetLayer<S>;
template <class S>
using Kda = linattn::KimiDeltaAttentionLayer<S>;

GatedDeltaNetConfig gdn_config(Index hk, Index hv, Index dk, Index dv, Index w, Index d) {
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

// A layer whose every parameter matters to the check: the norm weights and biases drawn away
// from torch's constant initial values.
Gdn<double> gdn_layer(const GatedDeltaNetConfig& c, std::uint32_t seed) {
  Gdn<double> layer(c, seed);
  layer.norm_weight = Eigen::VectorXd::Ones(c.linear_value_head_dim) +
                      0.5 * test::random_matrix<double>(c.linear_value_head_dim, 1, seed + 1);
  layer.dt_bias = test::random_matrix<double>(c.linear_num_value_heads, 1, seed + 2);
  // Larger projections than torch's ±1/√d, so that the gates and β leave their linear range.
  layer.in_proj_qkvz *= 3.0;
  layer.in_proj_ba *= 3.0;
  return layer;
}

// The loss whose gradient is checked: Σ R ∘ Y over the packed forward from zero states.
template <class Layer>
double loss(const Layer& layer, const Eigen::MatrixXd& X, const std::vector<int>& offsets,
            const Eigen::MatrixXd& R) {
  std::vector<linattn::DeltaLayerState<double>> states;
  return (layer.forward(X, offsets, states).array() * R.array()).sum();
}

// Central differences of `f` in every entry of `p` (Richardson-extrapolated from steps h and
// h/2, so that the truncation error, O(h⁴), stays below the target where the L2 norms of
// short heads curve strongly) against `analytic`: the largest difference relative to the
// largest analytic entry (or 1).
template <class P>
double fd_error(P& p, const Eigen::MatrixXd& analytic, const std::function<double()>& f) {
  EXPECT_EQ(p.rows(), analytic.rows());
  EXPECT_EQ(p.cols(), analytic.cols());
  const double h = 1e-4;
  double worst = 0;
  for (Index j = 0; j < p.cols(); ++j)
    for (Index i = 0; i < p.rows(); ++i) {
      const double keep = p(i, j);
      const auto central = [&](double step) {
        p(i, j) = keep + step;
        const double up = f();
        p(i, j) = keep - step;
        const double down = f();
        p(i, j) = keep;
        return (up - down) / (2 * step);
      };
      const double fd = (4 * central(h / 2) - central(h)) / 3;
      worst = std::max(worst, std::abs(fd - analytic(i, j)));
    }
  return worst / std::max(1.0, analytic.cwiseAbs().maxCoeff());
}

void check_gdn_gradients(Index hk, Index hv, Index dk, Index dv, Index w,
                         const std::vector<int>& offsets) {
  SCOPED_TRACE("Hk = " + std::to_string(hk) + ", Hv = " + std::to_string(hv) + ", Dk = " +
               std::to_string(dk) + ", Dv = " + std::to_string(dv) + ", W = " + std::to_string(w));
  const Index d = 5, N = offsets.back();
  Gdn<double> layer = gdn_layer(gdn_config(hk, hv, dk, dv, w, d), 11);
  Eigen::MatrixXd X = inputs<double>(N, d, 12);
  const Eigen::MatrixXd R = inputs<double>(N, d, 13);
  const auto g = layer.backward(X, offsets, R);
  const auto f = [&] { return loss(layer, X, offsets, R); };
  const double target = 1e-7;
  EXPECT_LE(fd_error(X, g.dX, f), target) << "dX";
  EXPECT_LE(fd_error(layer.in_proj_qkvz, g.in_proj_qkvz, f), target) << "in_proj_qkvz";
  EXPECT_LE(fd_error(layer.in_proj_ba, g.in_proj_ba, f), target) << "in_proj_ba";
  EXPECT_LE(fd_error(layer.conv1d_weight, g.conv1d_weight, f), target) << "conv1d_weight";
  EXPECT_LE(fd_error(layer.dt_bias, g.dt_bias, f), target) << "dt_bias";
  EXPECT_LE(fd_error(layer.A_log, g.A_log, f), target) << "A_log";
  EXPECT_LE(fd_error(layer.norm_weight, g.norm_weight, f), target) << "norm_weight";
  EXPECT_LE(fd_error(layer.out_proj, g.out_proj, f), target) << "out_proj";
}

TEST(GdnLayerBackward, EveryGradientMatchesCentralDifferences) {
  check_gdn_gradients(1, 2, 3, 2, 3, {0, 6});        // shared key heads, Dk != Dv
  check_gdn_gradients(2, 2, 2, 3, 4, {0, 3, 3, 7});  // packed, one empty sequence
  check_gdn_gradients(1, 3, 2, 2, 1, {0, 1, 5});     // W = 1, a one-token sequence
}

TEST(GdnLayerBackward, PackedSequencesSumTheirSeparateGradients) {
  const Index d = 6;
  const Gdn<double> layer = gdn_layer(gdn_config(1, 2, 3, 4, 4, d), 21);
  const std::vector<int> offsets = {0, 5, 5, 13};
  const Eigen::MatrixXd X = inputs<double>(13, d, 22), dY = inputs<double>(13, d, 23);
  const auto g = layer.backward(X, offsets, dY);
  Gdn<double>::Gradients sum;
  Eigen::MatrixXd dX(13, d);
  for (std::size_t b = 0; b + 1 < offsets.size(); ++b) {
    const Index r0 = offsets[b], n = offsets[b + 1] - r0;
    const auto one = layer.backward(X.middleRows(r0, n), dY.middleRows(r0, n));
    dX.middleRows(r0, n) = one.dX;
    if (b == 0) {
      sum = one;
      continue;
    }
    sum.in_proj_qkvz += one.in_proj_qkvz;
    sum.in_proj_ba += one.in_proj_ba;
    sum.conv1d_weight += one.conv1d_weight;
    sum.dt_bias += one.dt_bias;
    sum.A_log += one.A_log;
    sum.norm_weight += one.norm_weight;
    sum.out_proj += one.out_proj;
  }
  const auto close = [](const Eigen::MatrixXd& a, const Eigen::MatrixXd& b) {
    return (a - b).cwiseAbs().maxCoeff() / std::max(1.0, b.cwiseAbs().maxCoeff());
  };
  EXPECT_LE(close(g.dX, dX), 1e-13);
  EXPECT_LE(close(g.in_proj_qkvz, sum.in_proj_qkvz), 1e-13);
  EXPECT_LE(close(g.in_proj_ba, sum.in_proj_ba), 1e-13);
  EXPECT_LE(close(g.conv1d_weight, sum.conv1d_weight), 1e-13);
  EXPECT_LE(close(g.dt_bias, sum.dt_bias), 1e-13);
  EXPECT_LE(close(g.A_log, sum.A_log), 1e-13);
  EXPECT_LE(close(g.norm_weight, sum.norm_weight), 1e-13);
  EXPECT_LE(close(g.out_proj, sum.out_proj), 1e-13);
}

#ifdef LINATTN_TEST_FLOAT
TEST(GdnLayerBackward, FloatAgreesWithDouble) {
  const Index d = 16;
  const Gdn<double> ld = gdn_layer(gdn_config(2, 4, 8, 6, 4, d), 31);
  Gdn<float> lf(ld.config());
  lf.in_proj_qkvz = ld.in_proj_qkvz.cast<float>();
  lf.in_proj_ba = ld.in_proj_ba.cast<float>();
  lf.conv1d_weight = ld.conv1d_weight.cast<float>();
  lf.dt_bias = ld.dt_bias.cast<float>();
  lf.A_log = ld.A_log.cast<float>();
  lf.norm_weight = ld.norm_weight.cast<float>();
  lf.out_proj = ld.out_proj.cast<float>();
  const Eigen::MatrixXd X = inputs<double>(37, d, 32), dY = inputs<double>(37, d, 33);
  const auto gd = ld.backward(X, dY);
  const auto gf = lf.backward(X.cast<float>().eval(), dY.cast<float>().eval());
  const auto rel = [](const auto& f, const Eigen::MatrixXd& want) {
    return (f.template cast<double>() - want).cwiseAbs().maxCoeff() /
           std::max(1e-30, want.cwiseAbs().maxCoeff());
  };
  EXPECT_LE(rel(gf.dX, gd.dX), 1e-4);
  EXPECT_LE(rel(gf.in_proj_qkvz, gd.in_proj_qkvz), 1e-4);
  EXPECT_LE(rel(gf.in_proj_ba, gd.in_proj_ba), 1e-4);
  EXPECT_LE(rel(gf.conv1d_weight, gd.conv1d_weight), 1e-4);
  EXPECT_LE(rel(gf.A_log, gd.A_log), 1e-4);
  EXPECT_LE(rel(gf.dt_bias, gd.dt_bias), 1e-4);
  EXPECT_LE(rel(gf.norm_weight, gd.norm_weight), 1e-4);
  EXPECT_LE(rel(gf.out_proj, gd.out_proj), 1e-4);
}
#endif

TEST(GdnLayerBackward, BadArgumentsNameTheFunctionAndShapes) {
  const Gdn<double> layer(gdn_config(1, 2, 3, 2, 3, 5));
  const Eigen::MatrixXd X = inputs<double>(4, 5, 41);
  const std::string fn = "GatedDeltaNetLayer::backward";
  test::expect_invalid([&] { layer.backward(X, Eigen::MatrixXd(3, 5)); }, {fn, "dY is 3x5", "4x5"},
                       "dY rows");
  test::expect_invalid([&] { layer.backward(X.leftCols(4), Eigen::MatrixXd(4, 4)); },
                       {fn, "hidden_size = 5"}, "X columns");
  test::expect_invalid(
      [&] {
        layer.backward(X, std::vector<int>{0, 5}, X);
      },
      {fn, "offsets"}, "offsets past N");
  Eigen::MatrixXd bad = X;
  bad(2, 1) = std::nan("");
  test::expect_invalid([&] { layer.backward(bad, X); }, {fn, "X(2, 1)"}, "NaN in X");
}

KimiDeltaAttentionConfig kda_config(Index h, Index k, Index v, Index w, Index d, bool lb) {
  KimiDeltaAttentionConfig c;
  c.hidden_size = d;
  c.num_heads = h;
  c.head_dim = k;
  c.head_v_dim = v;
  c.short_conv_kernel_size = w;
  c.use_lower_bound = lb;
  return c;
}

Kda<double> kda_layer(const KimiDeltaAttentionConfig& c, std::uint32_t seed) {
  Kda<double> layer(c, seed);
  const Index V = c.head_v_dim > 0 ? c.head_v_dim : c.head_dim;
  layer.o_norm_weight =
      Eigen::VectorXd::Ones(V) + 0.5 * test::random_matrix<double>(V, 1, seed + 1);
  layer.dt_bias = test::random_matrix<double>(c.num_heads * c.head_dim, 1, seed + 2);
  layer.b_proj *= 3.0;
  layer.f_a_proj *= 2.0;
  layer.g_a_proj *= 2.0;
  return layer;
}

void check_kda_gradients(Index h, Index k, Index v, Index w, bool lb,
                         const std::vector<int>& offsets) {
  SCOPED_TRACE("H = " + std::to_string(h) + ", K = " + std::to_string(k) +
               ", V = " + std::to_string(v) + ", W = " + std::to_string(w) +
               (lb ? ", lower-bounded gate" : ""));
  const Index d = 5, N = offsets.back();
  Kda<double> layer = kda_layer(kda_config(h, k, v, w, d, lb), 51);
  Eigen::MatrixXd X = inputs<double>(N, d, 52);
  const Eigen::MatrixXd R = inputs<double>(N, d, 53);
  const auto g = layer.backward(X, offsets, R);
  const auto f = [&] { return loss(layer, X, offsets, R); };
  const double target = 1e-7;
  EXPECT_LE(fd_error(X, g.dX, f), target) << "dX";
  EXPECT_LE(fd_error(layer.q_proj, g.q_proj, f), target) << "q_proj";
  EXPECT_LE(fd_error(layer.k_proj, g.k_proj, f), target) << "k_proj";
  EXPECT_LE(fd_error(layer.v_proj, g.v_proj, f), target) << "v_proj";
  EXPECT_LE(fd_error(layer.q_conv1d_weight, g.q_conv1d_weight, f), target) << "q_conv1d_weight";
  EXPECT_LE(fd_error(layer.k_conv1d_weight, g.k_conv1d_weight, f), target) << "k_conv1d_weight";
  EXPECT_LE(fd_error(layer.v_conv1d_weight, g.v_conv1d_weight, f), target) << "v_conv1d_weight";
  EXPECT_LE(fd_error(layer.f_a_proj, g.f_a_proj, f), target) << "f_a_proj";
  EXPECT_LE(fd_error(layer.f_b_proj, g.f_b_proj, f), target) << "f_b_proj";
  EXPECT_LE(fd_error(layer.b_proj, g.b_proj, f), target) << "b_proj";
  EXPECT_LE(fd_error(layer.g_a_proj, g.g_a_proj, f), target) << "g_a_proj";
  EXPECT_LE(fd_error(layer.g_b_proj, g.g_b_proj, f), target) << "g_b_proj";
  EXPECT_LE(fd_error(layer.A_log, g.A_log, f), target) << "A_log";
  EXPECT_LE(fd_error(layer.dt_bias, g.dt_bias, f), target) << "dt_bias";
  EXPECT_LE(fd_error(layer.o_norm_weight, g.o_norm_weight, f), target) << "o_norm_weight";
  EXPECT_LE(fd_error(layer.o_proj, g.o_proj, f), target) << "o_proj";
}

TEST(KdaLayerBackward, EveryGradientMatchesCentralDifferences) {
  check_kda_gradients(2, 3, 2, 3, false, {0, 6});       // V != K
  check_kda_gradients(1, 2, 0, 4, true, {0, 3, 3, 7});  // lower-bounded gate, packed
  check_kda_gradients(3, 2, 3, 1, false, {0, 1, 5});    // W = 1, a one-token sequence
}

TEST(KdaLayerBackward, BadArgumentsNameTheFunctionAndShapes) {
  const Kda<double> layer(kda_config(1, 2, 2, 3, 5, false));
  const Eigen::MatrixXd X = inputs<double>(4, 5, 61);
  test::expect_invalid([&] { layer.backward(X, Eigen::MatrixXd(4, 6)); },
                       {"KimiDeltaAttentionLayer::backward", "dY is 4x6", "4x5"}, "dY columns");
}

// ---- From carried states ----------------------------------------------------------------------

using State = linattn::DeltaLayerState<double>;
using StateGrad = linattn::DeltaLayerStateGradient<double>;

// B nonzero states of a layer of H heads of K x V and C convolved channels (W − 1 rows);
// `partial` leaves the last state's heads empty (zeros) to mix the two.
std::vector<State> some_states(Index B, Index H, Index K, Index V, Index W, Index C,
                               std::uint32_t seed, bool partial = false) {
  std::vector<State> states(static_cast<std::size_t>(B));
  for (Index b = 0; b < B; ++b) {
    auto& st = states[static_cast<std::size_t>(b)];
    st.conv = test::random_matrix<double>(W - 1, C, seed + 10 * b);
    if (partial && b == B - 1) continue;
    for (Index h = 0; h < H; ++h) {
      linattn::LinearAttentionState<double> one(K, V);
      one.S = 0.7 * test::random_matrix<double>(K, V, seed + 10 * b + h + 1);
      st.heads.push_back(one);
    }
  }
  return states;
}

// Gradients with respect to the states the forward leaves (the loss's weights on them).
std::vector<StateGrad> some_dfinal(Index B, Index H, Index K, Index V, Index W, Index C,
                                   std::uint32_t seed) {
  std::vector<StateGrad> d(static_cast<std::size_t>(B));
  for (Index b = 0; b < B; ++b) {
    auto& one = d[static_cast<std::size_t>(b)];
    one.conv = test::random_matrix<double>(W - 1, C, seed + 10 * b);
    for (Index h = 0; h < H; ++h) {
      linattn::StateGradient<double> g;
      g.dS = test::random_matrix<double>(K, V, seed + 10 * b + h + 1);
      one.heads.push_back(g);
    }
  }
  return d;
}

// Σ R ∘ Y + Σ_b (Σ Rc_b ∘ conv_b + Σ_h Rh_bh ∘ S_bh) over the forward from `states`, the states
// it leaves weighted by dfinal.
template <class Layer>
double loss_from(const Layer& layer, const Eigen::MatrixXd& X, const std::vector<int>& offsets,
                 const std::vector<State>& states, const Eigen::MatrixXd& R,
                 const std::vector<StateGrad>& dfinal) {
  std::vector<State> next = states;
  double l = (layer.forward(X, offsets, next).array() * R.array()).sum();
  for (std::size_t b = 0; b < next.size(); ++b) {
    l += (next[b].conv.array() * dfinal[b].conv.array()).sum();
    for (std::size_t h = 0; h < next[b].heads.size(); ++h) {
      Eigen::MatrixXd S = next[b].heads[h].S;
      if (next[b].heads[h].S_lo.size() != 0) S += next[b].heads[h].S_lo;
      l += (S.array() * dfinal[b].heads[h].dS.array()).sum();
    }
  }
  return l;
}

// The initial states' gradients against central differences in every entry of `states`.
void check_state_gradients(std::vector<State>& states, const std::vector<StateGrad>& dstates,
                           Index H, const std::function<double()>& f) {
  ASSERT_EQ(dstates.size(), states.size());
  for (std::size_t b = 0; b < states.size(); ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    ASSERT_EQ(static_cast<Index>(dstates[b].heads.size()), H);
    EXPECT_LE(fd_error(states[b].conv, dstates[b].conv, f), 1e-7) << "conv";
    if (states[b].heads.empty()) continue;  // zeros: the entries to vary do not exist
    for (Index h = 0; h < H; ++h)
      EXPECT_LE(fd_error(states[b].heads[std::size_t(h)].S, dstates[b].heads[std::size_t(h)].dS, f),
                1e-7)
          << "head " << h;
  }
}

TEST(GdnLayerBackward, FromStatesEveryGradientMatchesCentralDifferences) {
  // W = 4: sequence 0 (one token) is shorter than the convolution state, sequence 1 is empty.
  const Index hk = 1, hv = 2, dk = 4, dv = 3, w = 4, d = 8, C = 2 * hk * dk + hv * dv;
  const std::vector<int> offsets = {0, 1, 1, 7};
  Gdn<double> layer = gdn_layer(gdn_config(hk, hv, dk, dv, w, d), 71);
  Eigen::MatrixXd X = inputs<double>(7, d, 72);
  const Eigen::MatrixXd R = inputs<double>(7, d, 73);
  auto states = some_states(3, hv, dk, dv, w, C, 74, true);
  const auto dfinal = some_dfinal(3, hv, dk, dv, w, C, 75);
  const auto g = layer.backward(X, offsets, states, R, dfinal);
  const auto f = [&] { return loss_from(layer, X, offsets, states, R, dfinal); };
  const double target = 1e-7;
  EXPECT_LE(fd_error(X, g.dX, f), target) << "dX";
  EXPECT_LE(fd_error(layer.in_proj_qkvz, g.in_proj_qkvz, f), target) << "in_proj_qkvz";
  EXPECT_LE(fd_error(layer.in_proj_ba, g.in_proj_ba, f), target) << "in_proj_ba";
  EXPECT_LE(fd_error(layer.conv1d_weight, g.conv1d_weight, f), target) << "conv1d_weight";
  EXPECT_LE(fd_error(layer.dt_bias, g.dt_bias, f), target) << "dt_bias";
  EXPECT_LE(fd_error(layer.A_log, g.A_log, f), target) << "A_log";
  EXPECT_LE(fd_error(layer.norm_weight, g.norm_weight, f), target) << "norm_weight";
  EXPECT_LE(fd_error(layer.out_proj, g.out_proj, f), target) << "out_proj";
  check_state_gradients(states, g.dstates, hv, f);
  // The empty sequence passes its final state's gradient through unchanged.
  EXPECT_EQ(g.dstates[1].conv, dfinal[1].conv);
  EXPECT_EQ(g.dstates[1].heads[1].dS, dfinal[1].heads[1].dS);
}

TEST(KdaLayerBackward, FromStatesEveryGradientMatchesCentralDifferences) {
  const Index h = 2, k = 4, v = 3, w = 3, d = 8, C = 2 * h * k + h * v;
  const std::vector<int> offsets = {0, 6, 7};  // sequence 1: one token, W − 1 = 2
  Kda<double> layer = kda_layer(kda_config(h, k, v, w, d, false), 81);
  Eigen::MatrixXd X = inputs<double>(7, d, 82);
  const Eigen::MatrixXd R = inputs<double>(7, d, 83);
  auto states = some_states(2, h, k, v, w, C, 84);
  const auto dfinal = some_dfinal(2, h, k, v, w, C, 85);
  const auto g = layer.backward(X, offsets, states, R, dfinal);
  const auto f = [&] { return loss_from(layer, X, offsets, states, R, dfinal); };
  const double target = 1e-7;
  EXPECT_LE(fd_error(X, g.dX, f), target) << "dX";
  EXPECT_LE(fd_error(layer.q_proj, g.q_proj, f), target) << "q_proj";
  EXPECT_LE(fd_error(layer.k_proj, g.k_proj, f), target) << "k_proj";
  EXPECT_LE(fd_error(layer.v_proj, g.v_proj, f), target) << "v_proj";
  EXPECT_LE(fd_error(layer.q_conv1d_weight, g.q_conv1d_weight, f), target) << "q_conv1d_weight";
  EXPECT_LE(fd_error(layer.k_conv1d_weight, g.k_conv1d_weight, f), target) << "k_conv1d_weight";
  EXPECT_LE(fd_error(layer.v_conv1d_weight, g.v_conv1d_weight, f), target) << "v_conv1d_weight";
  EXPECT_LE(fd_error(layer.f_a_proj, g.f_a_proj, f), target) << "f_a_proj";
  EXPECT_LE(fd_error(layer.f_b_proj, g.f_b_proj, f), target) << "f_b_proj";
  EXPECT_LE(fd_error(layer.b_proj, g.b_proj, f), target) << "b_proj";
  EXPECT_LE(fd_error(layer.g_a_proj, g.g_a_proj, f), target) << "g_a_proj";
  EXPECT_LE(fd_error(layer.g_b_proj, g.g_b_proj, f), target) << "g_b_proj";
  EXPECT_LE(fd_error(layer.A_log, g.A_log, f), target) << "A_log";
  EXPECT_LE(fd_error(layer.dt_bias, g.dt_bias, f), target) << "dt_bias";
  EXPECT_LE(fd_error(layer.o_norm_weight, g.o_norm_weight, f), target) << "o_norm_weight";
  EXPECT_LE(fd_error(layer.o_proj, g.o_proj, f), target) << "o_proj";
  check_state_gradients(states, g.dstates, h, f);
}

// fn(name, a.m, b.m) for the input's and every parameter's gradient m of two Gradients.
template <class A, class B, class Fn>
void each_member(A& a, B& b, Fn&& fn) {
  if constexpr (std::is_same_v<std::decay_t<A>, Gdn<double>::Gradients>) {
    fn("dX", a.dX, b.dX), fn("in_proj_qkvz", a.in_proj_qkvz, b.in_proj_qkvz);
    fn("in_proj_ba", a.in_proj_ba, b.in_proj_ba);
    fn("conv1d_weight", a.conv1d_weight, b.conv1d_weight), fn("dt_bias", a.dt_bias, b.dt_bias);
    fn("A_log", a.A_log, b.A_log), fn("norm_weight", a.norm_weight, b.norm_weight);
    fn("out_proj", a.out_proj, b.out_proj);
  } else {
    fn("dX", a.dX, b.dX), fn("q_proj", a.q_proj, b.q_proj), fn("k_proj", a.k_proj, b.k_proj);
    fn("v_proj", a.v_proj, b.v_proj), fn("q_conv1d_weight", a.q_conv1d_weight, b.q_conv1d_weight);
    fn("k_conv1d_weight", a.k_conv1d_weight, b.k_conv1d_weight);
    fn("v_conv1d_weight", a.v_conv1d_weight, b.v_conv1d_weight);
    fn("f_a_proj", a.f_a_proj, b.f_a_proj), fn("f_b_proj", a.f_b_proj, b.f_b_proj);
    fn("b_proj", a.b_proj, b.b_proj), fn("g_a_proj", a.g_a_proj, b.g_a_proj);
    fn("g_b_proj", a.g_b_proj, b.g_b_proj), fn("A_log", a.A_log, b.A_log);
    fn("dt_bias", a.dt_bias, b.dt_bias), fn("o_norm_weight", a.o_norm_weight, b.o_norm_weight);
    fn("o_proj", a.o_proj, b.o_proj);
  }
}

// From zero states (the layer's make_state(), or an empty vector of packed states) the
// parameters' and the input's gradients are the stateless call's, bit for bit.
template <class Layer>
void check_zero_state(const Layer& layer, Index d, Index H) {
  const std::vector<int> offsets = {0, 4, 4, 9};
  const Eigen::MatrixXd X = inputs<double>(9, d, 91), dY = inputs<double>(9, d, 92);
  const auto same = [](const char* name, const auto& a, const auto& b) {
    EXPECT_TRUE(a.rows() == b.rows() && a.cols() == b.cols() && a == b) << name;
  };
  const auto one = layer.backward(X, layer.make_state(), dY);
  const auto stateless = layer.backward(X, dY);
  each_member(one, stateless, same);
  ASSERT_EQ(one.dstates.size(), 1u);
  EXPECT_EQ(static_cast<Index>(one.dstates[0].heads.size()), H);
  EXPECT_GT(one.dstates[0].conv.cwiseAbs().maxCoeff(), 0.0);  // a zero state still has one
  const auto packed = layer.backward(X, offsets, std::vector<State>(), dY);
  const auto packed_stateless = layer.backward(X, offsets, dY);
  each_member(packed, packed_stateless, same);
  EXPECT_EQ(packed.dstates.size(), 3u);
  EXPECT_TRUE(stateless.dstates.empty());
}

TEST(GdnLayerBackward, ZeroStateEqualsTheStatelessCall) {
  check_zero_state(gdn_layer(gdn_config(2, 4, 4, 4, 4, 16), 93), 16, 4);
}

TEST(KdaLayerBackward, ZeroStateEqualsTheStatelessCall) {
  check_zero_state(kda_layer(kda_config(2, 4, 6, 4, 16, false), 94), 16, 2);
}

// Truncated BPTT: segment 2's backward from the state segment 1 left, then segment 1's taking
// segment 2's initial-state gradient as its final state's, sum to one call over both segments
// (from a nonzero state, the whole call's final state weighted as well).
template <class Layer>
void check_two_segments(const Layer& layer, Index d, Index H, Index K, Index V, Index W, Index C,
                        Index split) {
  SCOPED_TRACE("split at " + std::to_string(split));
  const Index N = 11;
  const Eigen::MatrixXd X = inputs<double>(N, d, 101), dY = inputs<double>(N, d, 102);
  const State s0 = some_states(1, H, K, V, W, C, 103)[0];
  const StateGrad dlast = some_dfinal(1, H, K, V, W, C, 104)[0];
  const auto whole = layer.backward(X, s0, dY, dlast);
  State s1 = s0;
  layer.forward(X.topRows(split), s1);
  const auto g2 = layer.backward(X.bottomRows(N - split), s1, dY.bottomRows(N - split), dlast);
  const auto g1 = layer.backward(X.topRows(split), s0, dY.topRows(split), g2.dstates[0]);
  const auto close = [](const Eigen::MatrixXd& a, const Eigen::MatrixXd& b) {
    return (a - b).cwiseAbs().maxCoeff() / std::max(1.0, b.cwiseAbs().maxCoeff());
  };
  auto sum = g1;  // the parameters' gradients summed, dX stacked
  each_member(sum, g2, [](const char* name, auto& a, const auto& b) {
    if (std::string(name) != "dX") {
      a += b;
      return;
    }
    Eigen::MatrixXd both(a.rows() + b.rows(), a.cols());
    both << a, b;
    a = both;
  });
  each_member(sum, whole, [&](const char* name, const auto& a, const auto& b) {
    EXPECT_LE(close(a, b), 1e-12) << name;
  });
  EXPECT_LE(close(g1.dstates[0].conv, whole.dstates[0].conv), 1e-12) << "conv state";
  for (Index h = 0; h < H; ++h)
    EXPECT_LE(
        close(g1.dstates[0].heads[std::size_t(h)].dS, whole.dstates[0].heads[std::size_t(h)].dS),
        1e-12)
        << "head " << h;
}

TEST(GdnLayerBackward, TwoSegmentsChainIntoOneCall) {
  const Index hk = 2, hv = 4, dk = 4, dv = 4, w = 4, d = 16;
  const auto layer = gdn_layer(gdn_config(hk, hv, dk, dv, w, d), 105);
  for (const Index split : {6, 2})  // 2: segment 1 shorter than the convolution state
    check_two_segments(layer, d, hv, dk, dv, w, 2 * hk * dk + hv * dv, split);
}

TEST(KdaLayerBackward, TwoSegmentsChainIntoOneCall) {
  const Index h = 2, k = 4, v = 6, w = 4, d = 16;
  const auto layer = kda_layer(kda_config(h, k, v, w, d, true), 106);
  for (const Index split : {7, 1})
    check_two_segments(layer, d, h, k, v, w, 2 * h * k + h * v, split);
}

TEST(KdaLayerBackward, PackedFromStatesSumsTheSeparateCalls) {
  const Index h = 2, k = 4, v = 4, w = 4, d = 16, C = 2 * h * k + h * v;
  const auto layer = kda_layer(kda_config(h, k, v, w, d, false), 107);
  const std::vector<int> offsets = {0, 5, 5, 13};
  const Eigen::MatrixXd X = inputs<double>(13, d, 108), dY = inputs<double>(13, d, 109);
  const auto states = some_states(3, h, k, v, w, C, 110, true);
  const auto dfinal = some_dfinal(3, h, k, v, w, C, 111);
  const auto g = layer.backward(X, offsets, states, dY, dfinal);
  ASSERT_EQ(g.dstates.size(), 3u);
  const auto close = [](const Eigen::MatrixXd& a, const Eigen::MatrixXd& b) {
    return (a - b).cwiseAbs().maxCoeff() / std::max(1.0, b.cwiseAbs().maxCoeff());
  };
  Eigen::MatrixXd dq = Eigen::MatrixXd::Zero(layer.q_proj.rows(), d), dX(13, d);
  for (std::size_t b = 0; b + 1 < offsets.size(); ++b) {
    const Index r0 = offsets[b], n = offsets[b + 1] - r0;
    const auto one =
        layer.backward(X.middleRows(r0, n), states[b], dY.middleRows(r0, n), dfinal[b]);
    dX.middleRows(r0, n) = one.dX;
    dq += one.q_proj;
    EXPECT_LE(close(g.dstates[b].conv, one.dstates[0].conv), 1e-13) << b;
    for (Index j = 0; j < h; ++j)
      EXPECT_LE(
          close(g.dstates[b].heads[std::size_t(j)].dS, one.dstates[0].heads[std::size_t(j)].dS),
          1e-13)
          << b << ", head " << j;
  }
  EXPECT_LE(close(g.dX, dX), 1e-13);
  EXPECT_LE(close(g.q_proj, dq), 1e-13);
}

TEST(GdnLayerBackward, BadStatesNameTheFunctionAndShapes) {
  const Index hk = 1, hv = 2, dk = 3, dv = 2, w = 3, d = 5, C = 2 * hk * dk + hv * dv;
  const Gdn<double> layer(gdn_config(hk, hv, dk, dv, w, d));
  const Eigen::MatrixXd X = inputs<double>(4, d, 121);
  const std::string fn = "GatedDeltaNetLayer::backward";
  const State good = some_states(1, hv, dk, dv, w, C, 122)[0];
  State bad = good;
  bad.conv.resize(3, C);
  test::expect_invalid([&] { layer.backward(X, bad, X); }, {fn, "states[0].conv is 3x10", "2x10"},
                       "conv state rows");
  bad = good;
  bad.heads[1].S.resize(2, 2);
  test::expect_invalid([&] { layer.backward(X, bad, X); },
                       {fn, "states[0].heads[1].S is 2x2", "3x2"}, "head state shape");
  bad = good;
  bad.heads.pop_back();
  test::expect_invalid([&] { layer.backward(X, bad, X); }, {fn, "1 head states", "2"},
                       "head count");
  const std::vector<int> offsets = {0, 1, 4};
  test::expect_invalid([&] { layer.backward(X, offsets, std::vector<State>(1, good), X); },
                       {fn, "states holds 1", "B = 2"}, "states count");
  StateGrad dbad = some_dfinal(1, hv, dk, dv, w, C, 123)[0];
  dbad.conv.resize(2, 9);
  test::expect_invalid([&] { layer.backward(X, good, X, dbad); },
                       {fn, "dfinal[0].conv is 2x9", "2x10"}, "dfinal conv");
  dbad = some_dfinal(1, hv, dk, dv, w, C, 123)[0];
  dbad.heads[0].dS.resize(3, 3);
  test::expect_invalid([&] { layer.backward(X, good, X, dbad); },
                       {fn, "dfinal[0].heads[0].dS is 3x3", "3x2"}, "dfinal head shape");
  dbad.heads.resize(3);
  test::expect_invalid([&] { layer.backward(X, good, X, dbad); }, {fn, "3 head gradients", "2"},
                       "dfinal head count");
  test::expect_invalid(
      [&] {
        layer.backward(X, offsets, std::vector<State>(2, good), X, std::vector<StateGrad>(1));
      },
      {fn, "dfinal holds 1", "B = 2"}, "dfinal count");
}

TEST(KdaLayerBackward, BadStatesNameTheFunctionAndShapes) {
  const Index h = 2, k = 2, v = 3, w = 2, d = 5, C = 2 * h * k + h * v;
  const Kda<double> layer(kda_config(h, k, v, w, d, false));
  const Eigen::MatrixXd X = inputs<double>(4, d, 131);
  const std::string fn = "KimiDeltaAttentionLayer::backward";
  State bad = some_states(1, h, k, v, w, C, 132)[0];
  bad.conv.resize(1, C + 1);
  test::expect_invalid([&] { layer.backward(X, bad, X); }, {fn, "states[0].conv is 1x15", "1x14"},
                       "conv state columns");
}

}  // namespace
