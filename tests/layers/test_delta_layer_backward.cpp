// The delta-rule layers' backward (GatedDeltaNetLayer and KimiDeltaAttentionLayer::backward):
// every parameter's and the
// input's gradient against central differences of the layer's forward in double, with shared
// key heads and without, several convolution widths, packed sequences (one empty) against
// separate calls, float against double, and the errors.
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <linattn/layers.hpp>
#include <stdexcept>
#include <string>
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
double fd_error(Eigen::Ref<Eigen::MatrixXd> p, const Eigen::MatrixXd& analytic,
                const std::function<double()>& f) {
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
               std::to_string(dk) + ", Dv = " + std::to_string(dv) + ", W = " +
               std::to_string(w));
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
  test::expect_invalid([&] { layer.backward(X, Eigen::MatrixXd(3, 5)); },
                       {fn, "dY is 3x5", "4x5"}, "dY rows");
  test::expect_invalid([&] { layer.backward(X.leftCols(4), Eigen::MatrixXd(4, 4)); },
                       {fn, "hidden_size = 5"}, "X columns");
  test::expect_invalid([&] { layer.backward(X, std::vector<int>{0, 5}, X); }, {fn, "offsets"},
                       "offsets past N");
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
  layer.o_norm_weight = Eigen::VectorXd::Ones(V) + 0.5 * test::random_matrix<double>(V, 1, seed + 1);
  layer.dt_bias = test::random_matrix<double>(c.num_heads * c.head_dim, 1, seed + 2);
  layer.b_proj *= 3.0;
  layer.f_a_proj *= 2.0;
  layer.g_a_proj *= 2.0;
  return layer;
}

void check_kda_gradients(Index h, Index k, Index v, Index w, bool lb,
                         const std::vector<int>& offsets) {
  SCOPED_TRACE("H = " + std::to_string(h) + ", K = " + std::to_string(k) + ", V = " +
               std::to_string(v) + ", W = " + std::to_string(w) +
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
  check_kda_gradients(2, 3, 2, 3, false, {0, 6});        // V != K
  check_kda_gradients(1, 2, 0, 4, true, {0, 3, 3, 7});   // lower-bounded gate, packed
  check_kda_gradients(3, 2, 3, 1, false, {0, 1, 5});     // W = 1, a one-token sequence
}

TEST(KdaLayerBackward, BadArgumentsNameTheFunctionAndShapes) {
  const Kda<double> layer(kda_config(1, 2, 2, 3, 5, false));
  const Eigen::MatrixXd X = inputs<double>(4, 5, 61);
  test::expect_invalid([&] { layer.backward(X, Eigen::MatrixXd(4, 6)); },
                       {"KimiDeltaAttentionLayer::backward", "dY is 4x6", "4x5"}, "dY columns");
}

}  // namespace
