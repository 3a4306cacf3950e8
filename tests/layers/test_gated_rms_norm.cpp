// The gated RMSNorm (layers/gated_rms_norm.hpp): against its formula in long double for both
// gates, several heads and eps, in place, bf16 storage rounded once from float, the gradients
// against central differences, and the errors.
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <linattn/layers/gated_rms_norm.hpp>
#include <string>
#include <vector>

#include "gradient_util.hpp"
#include "test_util.hpp"

namespace {

using linattn::GatedRMSNormOptions;
using linattn::NormGate;
using test::Index;
using MatD = Eigen::MatrixXd;
using VecD = Eigen::VectorXd;
using LD = long double;
using Needles = std::vector<std::string>;

MatD frand(Index rows, Index cols, std::uint32_t seed, double lo = -1.0, double hi = 1.0) {
  return test::random_matrix<double>(rows, cols, seed, lo, hi);
}

MatD reference(const MatD& o, const MatD& z, const VecD& w, const GatedRMSNormOptions& opt) {
  const Index M = w.size();
  MatD y(o.rows(), o.cols());
  for (Index t = 0; t < o.rows(); ++t)
    for (Index c0 = 0; c0 < o.cols(); c0 += M) {
      LD ss = 0;
      for (Index c = 0; c < M; ++c) ss += LD(o(t, c0 + c)) * LD(o(t, c0 + c));
      const LD r = 1 / std::sqrt(ss / M + LD(opt.eps));
      for (Index c = 0; c < M; ++c) {
        const LD zc = z(t, c0 + c), s = 1 / (1 + std::exp(-zc));
        const LD g = opt.gate == NormGate::Silu ? zc * s : s;
        y(t, c0 + c) = double(LD(o(t, c0 + c)) * r * LD(w(c)) * g);
      }
    }
  return y;
}

TEST(gated_rms_norm, AgainstItsFormula) {
  for (const auto gate : {NormGate::Silu, NormGate::Sigmoid})
    for (const double eps : {0.0, 1e-6, 0.5})
      for (const Index H : {Index(1), Index(3)})
        for (const Index M : {Index(1), Index(5), Index(16)}) {
          SCOPED_TRACE("H = " + std::to_string(H) + ", M = " + std::to_string(M));
          GatedRMSNormOptions opt;
          opt.gate = gate;
          opt.eps = eps;
          const MatD o = frand(4, H * M, 1, -3, 3), z = frand(4, H * M, 2, -8, 8);
          const VecD w = frand(M, 1, 3);
          const MatD want = reference(o, z, w, opt);
          EXPECT_LE(test::relative_error(linattn::gated_rms_norm(o, z, w, opt), want), 1e-15);
          MatD inplace = o;
          linattn::gated_rms_norm(inplace, z, w, inplace, opt);
          EXPECT_LE(test::relative_error(inplace, want), 1e-15);
          const Eigen::MatrixXf f = linattn::gated_rms_norm(o.cast<float>(), z.cast<float>(),
                                                            Eigen::VectorXf(w.cast<float>()), opt);
          EXPECT_LE(test::relative_error(f.cast<double>(), want), 1e-6);
          // bf16 storage: the float computation on the rounded inputs, rounded once.
          using B16 = Eigen::bfloat16;
          const Eigen::Matrix<B16, -1, -1> ob = o.cast<B16>(), zb = z.cast<B16>();
          const Eigen::Matrix<B16, -1, 1> wb = w.cast<B16>();
          const Eigen::MatrixXf fb = linattn::gated_rms_norm(
              ob.cast<float>(), zb.cast<float>(), Eigen::VectorXf(wb.cast<float>()), opt);
          EXPECT_EQ(linattn::gated_rms_norm(ob, zb, wb, opt), fb.cast<B16>());
        }
}

TEST(gated_rms_norm, GradientsAgainstCentralDifferences) {
  for (const auto gate : {NormGate::Silu, NormGate::Sigmoid}) {
    GatedRMSNormOptions opt;
    opt.gate = gate;
    const Index H = 2, M = 4;
    MatD o = frand(3, H * M, 4, -2, 2), z = frand(3, H * M, 5, -3, 3), w = frand(M, 1, 6);
    const MatD G = frand(3, H * M, 7);
    const auto loss = [&] {
      return linattn::gated_rms_norm(o, z, VecD(w), opt).cwiseProduct(G).sum();
    };
    const auto g = linattn::gated_rms_norm_backward(o, z, VecD(w), G, opt);
    EXPECT_LE(test::relative_error(g.dO, test::central_differences(loss, o)), 1e-8);
    EXPECT_LE(test::relative_error(g.dZ, test::central_differences(loss, z)), 1e-8);
    EXPECT_LE(test::relative_error(g.dweight, test::central_differences(loss, w)), 1e-8);
  }
}

TEST(gated_rms_norm, Errors) {
  const MatD o = frand(2, 6, 8), z = frand(2, 6, 9);
  const VecD w = frand(4, 1, 10);
  test::expect_invalid(
      [&] { linattn::gated_rms_norm(o, z, w); },
      Needles{"gated_rms_norm", "o's columns a multiple of M", "o is 2x6", "weight is 4x1"},
      "weight");
  test::expect_invalid([&] { linattn::gated_rms_norm(o, MatD(frand(2, 3, 1)), VecD(w.head(3))); },
                       Needles{"z must have o's shape"}, "z");
  GatedRMSNormOptions opt;
  opt.eps = -1;
  test::expect_invalid([&] { linattn::gated_rms_norm(o, z, VecD(w.head(3)), opt); },
                       Needles{"eps = -1 must be finite and >= 0"}, "eps");
  test::expect_invalid(
      [&] { linattn::gated_rms_norm_backward(o, z, VecD(w.head(3)), MatD(frand(1, 6, 2))); },
      Needles{"gated_rms_norm_backward", "dY is 1x6 but must be 2x6"}, "dY");
}

}  // namespace
