// L2Normalize: one row mapped alone (a decode step) has the bits of the same row mapped inside
// a block (a prefill), so the delta and gated decoders equal their recurrent prefill bit for
// bit; the eps convention φ = g / sqrt(‖g‖² + eps) of flash-linear-attention and transformers,
// forward and backward, against a long-double reference; eps = 0 unchanged. Built portable and
// with -march=native in CI: the single-row and block paths must round alike on both.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace {

using test::Index;
using test::Mat;
using test::MatD;
using test::RowMat;
using LD = long double;
using LMat = Eigen::Matrix<long double, Eigen::Dynamic, Eigen::Dynamic>;

template <class S>
bool same_bits(const Mat<S>& a, const Mat<S>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(S) * static_cast<std::size_t>(a.size())) == 0;
}

// Rows of every kind: random ones of several magnitudes, a zero row, rows whose squared norm
// under- or overflows (the normalize-by-max path), one dominant entry.
template <class S>
Mat<S> assorted_rows(Index n, Index D, std::uint32_t seed) {
  using L = std::numeric_limits<S>;
  Mat<S> x = test::random_matrix<S>(n, D, seed, -3, 3);
  for (Index i = 0; i < n; i += 7) x.row(i) *= S(1e-3);
  x.row(3).setZero();
  x.row(5) = test::random_matrix<S>(1, D, seed + 1) * S(sizeof(S) == 4 ? 1e-30 : 1e-300);
  x.row(6) = test::random_matrix<S>(1, D, seed + 2) * S(sizeof(S) == 4 ? 1e30 : 1e300);
  x.row(9).setConstant(L::denorm_min());
  x(10, 0) = S(1e4);
  return x;
}

template <class S, class Phi>
void check_row_equals_block(const Phi& phi, const std::string& what) {
  for (const Index D : {1, 3, 8, 17, 64, 128, 256}) {
    const Index n = 300;  // more than one block of kMapRowBlock rows
    const Mat<S> x = assorted_rows<S>(n, D, test::seed_of({D, 471}));
    Mat<S> block(n, D);
    phi.map(x, block);
    const RowMat<S> xr = x;
    Mat<S> block_r(n, D);
    phi.map(xr, block_r);
    EXPECT_TRUE(same_bits(block, block_r)) << what << " D=" << D << ": row-major block";
    int differing = 0;
    for (Index i = 0; i < n; ++i) {
      // The row alone, as the decoders map a token: a 1 x D matrix, a row of a row-major
      // matrix and a row of a column-major one (strided).
      const Mat<S> xi = x.row(i);
      Mat<S> one(1, D), one_r(1, D), one_c(1, D);
      phi.map(xi, one);
      phi.map(xr.row(i), one_r);
      phi.map(x.row(i), one_c);
      const Mat<S> want = block.row(i);
      differing += !same_bits(one, want) + !same_bits(one_r, want) + !same_bits(one_c, want);
    }
    EXPECT_EQ(differing, 0) << what << " " << test::scalar_name<S>() << " D=" << D
                            << ": rows mapped alone that differ from their row in the block";
  }
}

TEST(L2NormalizeRounding, OneRowEqualsItsRowInABlockBitForBit) {
  for (const double eps : {0.0, 1e-6}) {
    const std::string e = " eps=" + std::to_string(eps);
    IF_FLOAT(check_row_equals_block<float>(linattn::L2Normalize<>(eps), "L2Normalize<>" + e));
    IF_DOUBLE(check_row_equals_block<double>(linattn::L2Normalize<>(eps), "L2Normalize<>" + e));
    IF_FLOAT(check_row_equals_block<float>(
        linattn::L2Normalize<linattn::Silu>(linattn::Silu{}, eps), "L2Normalize<Silu>" + e));
    IF_DOUBLE(check_row_equals_block<double>(
        linattn::L2Normalize<linattn::Silu>(linattn::Silu{}, eps), "L2Normalize<Silu>" + e));
  }
}

// RecurrentDeltaRule and RecurrentGatedAttention stepped token by token against the recurrent
// prefill of the same tokens (the same kernel over one token at a time): bit for bit, as for
// the elementwise maps.
template <class S, class Phi>
void check_decoders(const Phi& phi, const std::string& what) {
  const Index N = 70, D = 16, M = 8;
  const Mat<S> Q = test::gaussian_matrix<S>(N, D, 481), K = test::gaussian_matrix<S>(N, D, 482),
               V = test::gaussian_matrix<S>(N, M, 483);
  const Mat<S> beta = test::random_matrix<S>(N, 1, 484, 0, 1);
  const Mat<S> log_a = test::random_matrix<S>(N, 1, 485, -0.1, 0);
  Eigen::Matrix<S, Eigen::Dynamic, 1> out(M);

  linattn::DeltaOptions o;
  o.scale = 0.25;
  o.algorithm = linattn::CausalAlgorithm::Recurrent;
  const Mat<S> par = linattn::delta_rule_attention(Q, K, V, beta, log_a, phi, o);
  linattn::RecurrentDeltaRule<Phi, S> rnn(D, M, phi, o);
  Mat<S> steps(N, M);
  for (Index t = 0; t < N; ++t) {
    rnn.step(Q.row(t), K.row(t), V.row(t), beta(t), log_a(t), out);
    steps.row(t) = out.transpose();
  }
  EXPECT_TRUE(same_bits(steps, par))
      << what << " " << test::scalar_name<S>() << ": RecurrentDeltaRule steps differ from the "
      << "recurrent prefill by " << test::max_abs_diff(steps, par);

  linattn::GatedOptions go;
  go.scale = 0.25;
  go.algorithm = linattn::CausalAlgorithm::Recurrent;
  // Gates strong enough for the prefill to run token by token, the decoder's kernel (a block
  // of mild gates is the compensated block form instead, which no decoder reproduces bit for
  // bit): scalar and per-feature.
  for (const Index gw : {Index(1), D}) {
    const Mat<S> log_g = test::random_matrix<S>(N, gw, 486, -1, -0.1);
    const Mat<S> gpar = linattn::gated_linear_attention(Q, K, V, log_g, phi, go);
    linattn::RecurrentGatedAttention<Phi, S> g(D, M, phi, go);
    for (Index t = 0; t < N; ++t) {
      g.step(Q.row(t), K.row(t), V.row(t), log_g.row(t), out);
      steps.row(t) = out.transpose();
    }
    EXPECT_TRUE(same_bits(steps, gpar))
        << what << " " << test::scalar_name<S>() << " gates " << gw
        << ": RecurrentGatedAttention steps differ from the recurrent prefill by "
        << test::max_abs_diff(steps, gpar);
  }
}

TEST(L2NormalizeRounding, DecodersEqualTheRecurrentPrefillBitForBit) {
  for (const double eps : {0.0, 1e-6}) {
    const std::string e = " eps=" + std::to_string(eps);
    IF_FLOAT(check_decoders<float>(linattn::L2Normalize<>(eps), "L2Normalize<>" + e));
    IF_DOUBLE(check_decoders<double>(linattn::L2Normalize<>(eps), "L2Normalize<>" + e));
    IF_FLOAT(check_decoders<float>(linattn::L2Normalize<linattn::Silu>(linattn::Silu{}, eps),
                                   "L2Normalize<Silu>" + e));
    IF_DOUBLE(check_decoders<double>(linattn::L2Normalize<linattn::Silu>(linattn::Silu{}, eps),
                                     "L2Normalize<Silu>" + e));
  }
}

// ---------------------------------------------------------------------------------------------
// eps: φ = g / sqrt(Σ g² + eps), its Jacobian r (I − φφᵀ) with r = (Σ g² + eps)^{-1/2}.
// ---------------------------------------------------------------------------------------------

LMat reference_map(const LMat& g, LD eps) {
  LMat out(g.rows(), g.cols());
  for (Index i = 0; i < g.rows(); ++i) {
    const LD t = g.row(i).squaredNorm() + eps;
    out.row(i) = t > 0 ? LMat(g.row(i) / std::sqrt(t)) : LMat(g.row(i) * LD(0));
  }
  return out;
}

// ∇_g = r (∇φ − φ (φ·∇φ)) by the chain rule of φ = g·r, r = t^{-1/2}, t = ‖g‖² + eps:
// ∂φ_a/∂g_b = r δ_ab − r³ g_a g_b.
LMat reference_backward(const LMat& g, const LMat& dphi, LD eps) {
  LMat out(g.rows(), g.cols());
  for (Index i = 0; i < g.rows(); ++i) {
    const LD t = g.row(i).squaredNorm() + eps;
    if (!(t > 0)) {
      out.row(i).setZero();
      continue;
    }
    const LD r = 1 / std::sqrt(t);
    for (Index b = 0; b < g.cols(); ++b) {
      LD acc = 0;
      for (Index a = 0; a < g.cols(); ++a)
        acc += dphi(i, a) * ((a == b ? r : LD(0)) - r * r * r * g(i, a) * g(i, b));
      out(i, b) = acc;
    }
  }
  return out;
}

// Relative to the largest entry of each row of `expected` (rows of every magnitude).
double row_relative_error(const LMat& got, const LMat& expected) {
  double worst = 0;
  for (Index i = 0; i < got.rows(); ++i) {
    const LD scale = expected.row(i).cwiseAbs().maxCoeff();
    const LD diff = (got.row(i) - expected.row(i)).cwiseAbs().maxCoeff();
    worst = std::max(worst, static_cast<double>(scale > 0 ? diff / scale : diff));
  }
  return worst;
}

template <class S>
void check_eps(double eps, const std::string& tag) {
  const linattn::L2Normalize<> phi(eps);
  EXPECT_EQ(phi.eps(), eps);
  const S u = std::numeric_limits<S>::epsilon();
  for (const Index D : {1, 4, 64}) {
    // Norms from 1e-5 to 10: eps = 1e-6 dominates the small ones, is a rounding of the large.
    Mat<S> x = test::random_matrix<S>(40, D, test::seed_of({D, 491}), -1, 1);
    for (Index i = 0; i < x.rows(); ++i) x.row(i) *= S(std::pow(10.0, -5.0 + 6.0 * i / 39.0));
    x.row(7).setZero();
    Mat<S> got(x.rows(), D);
    phi.map(x, got);
    const LMat xl = x.template cast<LD>();
    const LMat want = reference_map(xl, static_cast<LD>(static_cast<S>(eps)));
    const double e = row_relative_error(got.template cast<LD>(), want);
    test::report_error("L2Normalize(" + tag + ")/" + test::scalar_name<S>() + "/map", e);
    EXPECT_LE(e, 4 * (D + 2) * u) << tag << " D=" << D;
    EXPECT_TRUE((got.row(7).array() == S(0)).all()) << tag << ": a zero row maps to 0";

    const Mat<S> dphi = test::random_matrix<S>(x.rows(), D, test::seed_of({D, 492}));
    Mat<S> dx(x.rows(), D);
    phi.backward(x, dphi, dx);
    const LD el = static_cast<LD>(static_cast<S>(eps));
    const LMat dwant = reference_backward(xl, dphi.template cast<LD>(), el);
    // Relative to the Jacobian's scale r·max|∇φ| of each row (a row's gradient can be far
    // smaller: 0 for D = 1 and eps = 0, where only rounding noise remains).
    double eb = 0;
    for (Index i = 0; i < x.rows(); ++i) {
      const LD t = xl.row(i).squaredNorm() + el;
      if (!(t > 0)) continue;  // the zero row with eps = 0, checked below
      const LD scale = dphi.row(i).template cast<LD>().cwiseAbs().maxCoeff() / std::sqrt(t);
      const LD diff = (dx.row(i).template cast<LD>() - dwant.row(i)).cwiseAbs().maxCoeff();
      eb = std::max(eb, static_cast<double>(diff / scale));
    }
    test::report_error("L2Normalize(" + tag + ")/" + test::scalar_name<S>() + "/backward", eb);
    EXPECT_LE(eb, 8 * (D + 2) * u) << tag << " D=" << D;
    if (eps > 0) {
      // Smooth at 0: the gradient of a zero row is ∇φ / sqrt(eps).
      const LMat z =
          dphi.row(7).template cast<LD>() / std::sqrt(static_cast<LD>(static_cast<S>(eps)));
      EXPECT_LE(row_relative_error(dx.row(7).template cast<LD>(), z), 4 * u) << tag;
    } else {
      EXPECT_TRUE((dx.row(7).array() == S(0)).all()) << tag << ": zero row, gradient 0";
    }
  }
}

TEST(L2NormalizeEps, MapAndBackwardMatchTheReference) {
  for (const double eps : {0.0, 1e-6, 1e-2}) {
    const std::string tag = "eps=" + std::to_string(eps);
    IF_FLOAT(check_eps<float>(eps, tag));
    IF_DOUBLE(check_eps<double>(eps, tag));
  }
}

TEST(L2NormalizeEps, BackwardMatchesCentralDifferencesInDouble) {
  const linattn::L2Normalize<linattn::Silu> phi(linattn::Silu{}, 1e-6);
  const Index D = 5;
  MatD x = test::random_matrix<double>(6, D, 493, -2, 2);
  x.row(2) *= 1e-3;  // ‖silu(x)‖² ~ 1e-6: as large as eps
  x.row(4).setZero();
  const MatD w = test::random_matrix<double>(6, D, 494);  // L = Σ w ∘ φ(x)
  MatD grad(6, D), fx(6, D), fm(6, D);
  phi.backward(x, w, grad);
  double worst = 0;
  for (Index i = 0; i < x.rows(); ++i)
    for (Index c = 0; c < D; ++c) {
      const double h = 1e-6 * std::max(1e-3, std::abs(x(i, c)));
      MatD xp = x, xm = x;
      xp(i, c) += h;
      xm(i, c) -= h;
      phi.map(xp, fx);
      phi.map(xm, fm);
      const double fd = (w.row(i).dot(fx.row(i)) - w.row(i).dot(fm.row(i))) / (2 * h);
      worst = std::max(worst, std::abs(fd - grad(i, c)) / std::max(1.0, std::abs(fd)));
    }
  test::report_error("L2Normalize<Silu>(1e-6)/backward_vs_fd", worst);
  EXPECT_LE(worst, 1e-6);
}

TEST(L2NormalizeEps, ZeroIsTheDefaultBitForBit) {
  const Mat<float> x = assorted_rows<float>(40, 12, 495);
  const Mat<float> g = test::random_matrix<float>(40, 12, 496);
  Mat<float> a(40, 12), b(40, 12);
  linattn::L2Normalize<>{}.map(x, a);
  linattn::L2Normalize<>(0.0).map(x, b);
  EXPECT_TRUE(same_bits(a, b));
  linattn::L2Normalize<>{}.backward(x, g, a);
  linattn::L2Normalize<>(0.0).backward(x, g, b);
  EXPECT_TRUE(same_bits(a, b));
  EXPECT_EQ(linattn::L2Normalize<>{}.eps(), 0.0);
}

TEST(L2NormalizeEps, TinyRowsWithATinyEps) {
  // ‖g‖² + eps under- or overflows: the scaled path keeps φ = g / sqrt(‖g‖² + eps) exact.
  for (const double eps : {1e-40, 1e-35}) {
    const linattn::L2Normalize<> phi(eps);
    Mat<float> x(3, 4);
    x.row(0).setConstant(1e-22f);
    x.row(1).setConstant(std::numeric_limits<float>::denorm_min());
    x.row(2) << 3e-20f, -4e-20f, 0, 1e-21f;
    Mat<float> got(3, 4);
    phi.map(x, got);
    const LMat want = reference_map(x.cast<LD>(), static_cast<LD>(static_cast<float>(eps)));
    EXPECT_LE(row_relative_error(got.cast<LD>(), want), 1e-6) << eps << "\n" << got;
    ASSERT_TRUE(test::all_finite(got));
  }
}

TEST(L2NormalizeEps, RejectsNegativeAndNonFiniteEps) {
  for (const double bad : {-1e-6, -1.0, std::numeric_limits<double>::quiet_NaN(),
                           std::numeric_limits<double>::infinity()})
    test::expect_invalid(
        [&] {
          linattn::L2Normalize<> phi(bad);
          (void)phi;
        },
        std::vector<std::string>{"L2Normalize", "eps"}, "eps = " + std::to_string(bad));
  test::expect_invalid(
      [] {
        linattn::L2Normalize<linattn::Silu> phi(linattn::Silu{}, -1);
        (void)phi;
      },
      std::vector<std::string>{"L2Normalize", "eps = -1", "finite and >= 0"}, "eps = -1");
}

}  // namespace
