// The register-blocked micro-kernel (detail/microkernel.hpp) and the products built on it
// (detail/products.hpp), against double products: every tile path (full MR-packet tiles, the
// 2- and 1-packet tiles, half packets, scalar rows; partial column tiles), every storage order
// of A, B and C, accumulate and overwrite, k = 0; and the property the multi-head kernels rely
// on: the same shape gives the same bits whatever the strides.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace {

using linattn::detail::gemm_acc;
using linattn::detail::product;
using linattn::detail::Strided;
using test::Index;
using test::Mat;

// A matrix in a buffer of its own with strides (rs, cs): row-major, column-major, or with
// padding between rows / columns (a block of a larger matrix).
template <class S>
struct Buf {
  std::vector<S> data;
  Index rows, cols, rs, cs;
  Buf(const Mat<S>& x, bool row_major, Index pad) : rows(x.rows()), cols(x.cols()) {
    rs = row_major ? x.cols() + pad : 1;
    cs = row_major ? 1 : x.rows() + pad;
    data.assign(static_cast<std::size_t>(std::max<Index>(1, (rows + pad) * (cols + pad))), S(-7));
    for (Index i = 0; i < rows; ++i)
      for (Index j = 0; j < cols; ++j) at(i, j) = x(i, j);
  }
  S& at(Index i, Index j) { return data[static_cast<std::size_t>(i * rs + j * cs)]; }
  Mat<S> read() {
    Mat<S> x(rows, cols);
    for (Index i = 0; i < rows; ++i)
      for (Index j = 0; j < cols; ++j) x(i, j) = at(i, j);
    return x;
  }
  Strided<S> view() const { return {data.data(), rs, cs}; }
};

// Measured: at most 2.9 u (float and double, k = 128, SSE2 and AVX-512 builds) against the worst
// case (k + 1) u of a sum of k products; the bound is a few times the measured error.
constexpr double kTol = 8;

// |error| of C against the double product, relative to Σ_p |a_ip||b_pj| + |c_ij| (the
// magnitude of the terms: a product's rounding error is below k·u of it).
template <class S>
double worst_error(const Mat<S>& C, const Mat<S>& A, const Mat<S>& B, const Mat<S>& C0,
                   bool accumulate) {
  test::MatD exact = A.template cast<double>() * B.template cast<double>();
  if (accumulate) exact += C0.template cast<double>();
  test::MatD scale = A.template cast<double>().cwiseAbs() * B.template cast<double>().cwiseAbs();
  if (accumulate) scale += C0.template cast<double>().cwiseAbs();
  double worst = 0;
  for (Index i = 0; i < C.rows(); ++i)
    for (Index j = 0; j < C.cols(); ++j)
      worst = std::max(worst, std::abs(double(C(i, j)) - exact(i, j)) / (scale(i, j) + 1e-300));
  return worst;
}

template <class S>
void check_gemm_shapes() {
  const double u = std::numeric_limits<S>::epsilon() / 2;
  double worst = 0;
  // m covers 1…4 packets of AVX-512 floats and the edges between them; n covers partial
  // column tiles; k = 0 (nothing to add), 1 and a block of tokens.
  for (Index m : {1, 3, 4, 7, 8, 15, 16, 17, 31, 33, 48, 64, 65, 70, 129})
    for (Index n : {1, 5, 6, 7, 13})
      for (Index k : {0, 1, 9, 128}) {
        const std::uint32_t seed = test::seed_of({m, n, k});
        const Mat<S> A = test::random_matrix<S>(m, k, seed);
        const Mat<S> B = test::random_matrix<S>(k, n, seed + 1);
        const Mat<S> C0 = test::random_matrix<S>(m, n, seed + 2);
        for (bool accumulate : {false, true}) {
          // The raw kernel: A column-major (padded rows), B either way, C column-major.
          for (bool b_row : {false, true}) {
            Buf<S> a(A, false, 3), b(B, b_row, 2), c(C0, false, 1);
            gemm_acc(m, n, k, a.data.data(), a.cs, b.data.data(), b.rs, b.cs, c.data.data(),
                     c.cs, accumulate);
            const double e = worst_error<S>(c.read(), A, B, C0, accumulate);
            worst = std::max(worst, e);
            ASSERT_LE(e, kTol * u) << "m=" << m << " n=" << n << " k=" << k;
            // Padding around C is untouched.
            for (Index j = 0; j < n; ++j) ASSERT_EQ(c.at(m, j), S(-7)) << "wrote below C";
          }
        }
      }
  std::cout << "[ max err  ] gemm_acc/" << test::scalar_name<S>() << " = " << worst
            << " (relative to the terms' magnitude)\n";
}

TEST(MicroKernel, GemmMatchesDoubleProductFloat) { check_gemm_shapes<float>(); }
TEST(MicroKernel, GemmMatchesDoubleProductDouble) { check_gemm_shapes<double>(); }

// product(): every storage order of A, B and C (C row-major runs as Cᵀ = Bᵀ Aᵀ; an operand
// that is not contiguous where the kernel needs it is copied into the workspace).
template <class S>
void check_product_layouts() {
  const double u = std::numeric_limits<S>::epsilon() / 2;
  linattn::Workspace<S> ws;
  for (Index m : {1, 5, 17, 64, 67})
    for (Index n : {1, 6, 19, 64})
      for (Index k : {0, 3, 48}) {
        const std::uint32_t seed = test::seed_of({m, n, k, 5});
        const Mat<S> A = test::random_matrix<S>(m, k, seed);
        const Mat<S> B = test::random_matrix<S>(k, n, seed + 1);
        const Mat<S> C0 = test::random_matrix<S>(m, n, seed + 2);
        for (int layout = 0; layout < 8; ++layout)
          for (bool accumulate : {false, true}) {
            Buf<S> a(A, layout & 1, 1), b(B, layout & 2, 2), c(C0, layout & 4, 0);
            product<S>(m, n, k, a.view(), b.view(), c.data.data(), c.rs, c.cs, accumulate, ws,
                       linattn::detail::kSlotProductA);
            ASSERT_LE(worst_error<S>(c.read(), A, B, C0, accumulate), kTol * u)
                << "m=" << m << " n=" << n << " k=" << k << " layout=" << layout;
          }
      }
}

TEST(MicroKernel, ProductAnyLayoutFloat) { check_product_layouts<float>(); }
TEST(MicroKernel, ProductAnyLayoutDouble) { check_product_layouts<double>(); }

// The same shape gives the same bits whatever the leading dimensions: what makes a head of a
// packed multi-head buffer equal a single-head call exactly.
TEST(MicroKernel, SameShapeSameBitsWhateverTheStrides) {
  for (Index m : {16, 33, 64, 70})
    for (Index k : {1, 128}) {
      const Index n = 11;
      const Mat<float> A = test::random_matrix<float>(m, k, 71), B = test::random_matrix<float>(k, n, 72);
      Buf<float> a1(A, false, 0), a2(A, false, 5), b1(B, true, 0), b2(B, false, 3);
      Buf<float> c1(Mat<float>::Zero(m, n), false, 0), c2(Mat<float>::Zero(m, n), false, 9);
      gemm_acc(m, n, k, a1.data.data(), a1.cs, b1.data.data(), b1.rs, b1.cs, c1.data.data(), c1.cs, false);
      gemm_acc(m, n, k, a2.data.data(), a2.cs, b2.data.data(), b2.rs, b2.cs, c2.data.data(), c2.cs, false);
      const Mat<float> r1 = c1.read(), r2 = c2.read();
      EXPECT_EQ(std::memcmp(r1.data(), r2.data(), sizeof(float) * std::size_t(m * n)), 0)
          << "m=" << m << " k=" << k;
    }
}

// lower_product(): C (+)= L B with L lower triangular reads neither L's upper triangle nor, for
// row i, the rows of B past i: with NaN there, C is product() on L with a zero upper triangle
// and the clean B, bit for bit, in both storage orders of B and C (the causal kernels' in-chunk
// product: a later token's NaN value must not reach an earlier row).
template <class S>
void check_lower_product() {
  const S nan = std::numeric_limits<S>::quiet_NaN();
  linattn::Workspace<S> ws;
  for (Index m : {1, 5, 16, 17, 33, 48, 64, 70})
    for (Index n : {1, 6, 19, 64}) {
      const std::uint32_t seed = test::seed_of({m, n, 7});
      const Mat<S> L0 = test::random_matrix<S>(m, m, seed);
      const Mat<S> B = test::random_matrix<S>(m, n, seed + 1);
      const Mat<S> C0 = test::random_matrix<S>(m, n, seed + 2);
      const Mat<S> Lz = L0.template triangularView<Eigen::Lower>();
      Mat<S> Ln = Lz;  // NaN above the diagonal
      for (Index j = 1; j < m; ++j) Ln.col(j).head(j).setConstant(nan);
      for (int layout = 0; layout < 4; ++layout)
        for (bool accumulate : {false, true})
          for (Index r : {Index(0), m / 2, m - 1}) {
            Mat<S> Bn = B;
            Bn.row(r).setConstant(nan);
            Buf<S> lz(Lz, false, 0), ln(Ln, false, 0), b(B, layout & 1, 1), bn(Bn, layout & 1, 1);
            Buf<S> c1(C0, layout & 2, 0), c2(C0, layout & 2, 0);
            product<S>(m, n, m, lz.view(), b.view(), c1.data.data(), c1.rs, c1.cs, accumulate, ws,
                       linattn::detail::kSlotProductA);
            linattn::detail::lower_product<S>(m, n, ln.data.data(), m, bn.view(), c2.data.data(),
                                              c2.rs, c2.cs, accumulate, ws,
                                              linattn::detail::kSlotProductA);
            const Mat<S> x1 = c1.read(), x2 = c2.read();
            ASSERT_TRUE(test::same_bits(x1.topRows(r), x2.topRows(r)))
                << "m=" << m << " n=" << n << " NaN row " << r << " layout=" << layout;
            ASSERT_FALSE(x2.row(r).allFinite()) << "m=" << m << " n=" << n << " row " << r;
          }
    }
}

TEST(MicroKernel, LowerProductReadsOnlyTheTriangleFloat) { check_lower_product<float>(); }
TEST(MicroKernel, LowerProductReadsOnlyTheTriangleDouble) { check_lower_product<double>(); }

}  // namespace
