// Linformer (linformer.hpp, docs/SPEC.md §5): linformer_attention() against a naive
// reference written here (E·K, F·V, scores, softmax and the product in long double), float and
// double, on shapes with D != M and N, L, k straddling the kernels' blocks (the softmax's 128-key
// and 256-query tiles, the projections' 256-position panels); blocks, Maps, row-major and
// expression operands; E = F = identity against softmax_attention(); inputs of magnitude 100;
// N = 0, k = 0 and L = 0; argument errors and their messages; make_linformer_projections()
// (shape, determinism, N(0, 1/k) moments within bounds from the sample size); no allocation on
// the out-parameter path with a reused LinformerWorkspace.
//
// Inputs are drawn in double and rounded to the scalar type under test; the reference runs on
// those rounded values, so it is exact for what the kernel sees.
//
// Compiled with EIGEN_RUNTIME_NO_MALLOC (tests/CMakeLists.txt) for the no-allocation checks.
#include <gtest/gtest.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <linattn/linattn.hpp>
#include <string>
#include <utility>
#include <vector>

#include "allocation_count.hpp"
#include "eigen_assert_hook.hpp"  // first: before any Eigen header
#include "test_util.hpp"

namespace {

using test::Index;
using test::Mat;
using test::MatD;
using test::RowMat;

// ---------------------------------------------------------------------------------------------
// The reference: every sum in long double, the softmax shifted by the row maximum.
// ---------------------------------------------------------------------------------------------

using MatLD = Eigen::Matrix<long double, Eigen::Dynamic, Eigen::Dynamic>;

// P (k x L) X (L x C), in long double.
MatLD project_ld(const MatD& P, const MatD& X) {
  MatLD out = MatLD::Zero(P.rows(), X.cols());
  for (Index c = 0; c < X.cols(); ++c)
    for (Index p = 0; p < X.rows(); ++p) {
      const long double x = X(p, c);
      for (Index r = 0; r < P.rows(); ++r) out(r, c) += static_cast<long double>(P(r, p)) * x;
    }
  return out;
}

MatD reference(const MatD& Q, const MatD& K, const MatD& V, const MatD& E, const MatD& F) {
  const Index N = Q.rows(), D = Q.cols(), M = V.cols(), k = E.rows();
  MatD out = MatD::Zero(N, M);
  if (k == 0) return out;  // no keys: zeros, as softmax attention with L = 0
  const MatLD EK = project_ld(E, K), FV = project_ld(F, V);
  const long double scale = 1.0L / std::sqrt(static_cast<long double>(D));
  std::vector<long double> s(static_cast<std::size_t>(k));
  for (Index i = 0; i < N; ++i) {
    long double m = -std::numeric_limits<long double>::infinity();
    for (Index r = 0; r < k; ++r) {
      long double dot = 0;
      for (Index c = 0; c < D; ++c) dot += static_cast<long double>(Q(i, c)) * EK(r, c);
      s[std::size_t(r)] = dot * scale;
      m = std::max(m, s[std::size_t(r)]);
    }
    long double sum = 0;
    for (Index r = 0; r < k; ++r) sum += (s[std::size_t(r)] = std::exp(s[std::size_t(r)] - m));
    for (Index c = 0; c < M; ++c) {
      long double acc = 0;
      for (Index r = 0; r < k; ++r) acc += s[std::size_t(r)] * FV(r, c);
      out(i, c) = static_cast<double>(acc / sum);
    }
  }
  return out;
}

// max |F V| (the reference's, in double): outputs are convex combinations of the rows of F V,
// so errors are measured in units of it.
double projected_value_scale(const MatD& F, const MatD& V) {
  return std::max(1e-300, static_cast<double>(project_ld(F, V).cwiseAbs().maxCoeff()));
}

// The condition number of the scores: max over (i, r) of Σ_c |q_ic| (|E| |K|)_rc / √D, which
// bounds |s_ir| and, times the unit roundoff and a small factor, the rounding error of s_ir
// (the projection's sum over L included).
double score_condition(const MatD& Q, const MatD& K, const MatD& E) {
  if (E.rows() == 0 || Q.rows() == 0) return 0;
  const MatD absEK = E.cwiseAbs() * K.cwiseAbs();
  return (Q.cwiseAbs() * absEK.transpose()).maxCoeff() / std::sqrt(double(Q.cols()));
}

// ---------------------------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------------------------

struct LShape {
  Index N, L, k, D, M;
};

std::string name_of(const LShape& s) {
  return "N=" + std::to_string(s.N) + " L=" + std::to_string(s.L) + " k=" + std::to_string(s.k) +
         " D=" + std::to_string(s.D) + " M=" + std::to_string(s.M);
}

// Q, K, V uniform in [-a, a]; E, F from make_linformer_projections<S> (so the float generator
// runs too); all rounded to S, and the same values in double for the reference.
template <class S>
struct Case {
  Mat<S> Q, K, V, E, F;
  MatD Qd, Kd, Vd, Ed, Fd;
};

template <class S>
Case<S> make_case(const LShape& sh, std::uint32_t salt, double a = 1.0) {
  Case<S> c;
  c.Q = test::random_matrix<S>(sh.N, sh.D, test::seed_of({sh.N, sh.D, salt, 1}), -a, a);
  c.K = test::random_matrix<S>(sh.L, sh.D, test::seed_of({sh.L, sh.D, salt, 2}), -a, a);
  c.V = test::random_matrix<S>(sh.L, sh.M, test::seed_of({sh.L, sh.M, salt, 3}), -a, a);
  auto ef = linattn::make_linformer_projections<S>(sh.L, sh.k, salt);
  c.E = std::move(ef.first);
  c.F = std::move(ef.second);
  c.Qd = c.Q.template cast<double>();
  c.Kd = c.K.template cast<double>();
  c.Vd = c.V.template cast<double>();
  c.Ed = c.E.template cast<double>();
  c.Fd = c.F.template cast<double>();
  return c;
}

// N and L not multiples of any block; k below, at and above the 128-key tile, above L too.
const std::vector<LShape>& shapes() {
  static const std::vector<LShape> list = {
      {37, 130, 17, 8, 5},   {1, 1, 1, 1, 1},         {1, 7, 3, 2, 4},
      {5, 3, 7, 4, 6},       {2, 65, 1, 3, 1},        {300, 513, 64, 33, 17},
      {129, 257, 300, 5, 3}, {513, 300, 131, 16, 24}, {257, 600, 256, 64, 48},
  };
  return list;
}

// Bounds, a few times the errors measured (the report_error lines; Release -O1, portable):
// against the reference, per unit of max |F V|: measured 2.0e-7 (float) and 3.9e-16 (double) at
// -O1, 2.8e-7 and 4.6e-16 with -O2 -march=native (FMA).
constexpr double kRefFloat = 1e-6, kRefDouble = 2e-15;

template <class S>
void check_shapes(double& worst) {
  linattn::LinformerWorkspace<S> ws;
  for (const LShape& sh : shapes()) {
    const Case<S> c = make_case<S>(sh, 11);
    const MatD ref = reference(c.Qd, c.Kd, c.Vd, c.Ed, c.Fd);
    const double scale = projected_value_scale(c.Fd, c.Vd);
    const Mat<S> got = linattn::linformer_attention(c.Q, c.K, c.V, c.E, c.F);
    Mat<S> out = Mat<S>::Constant(sh.N, sh.M, S(7));
    linattn::linformer_attention(c.Q, c.K, c.V, c.E, c.F, out, ws);  // reused across shapes
    const double err = test::max_abs_diff(got, ref) / scale;
    worst = std::max(worst, err);
    EXPECT_LE(err, test::bound<S>(kRefFloat, kRefDouble))
        << test::scalar_name<S>() << " " << name_of(sh);
    EXPECT_TRUE(test::same_bits(got, out)) << test::scalar_name<S>() << " " << name_of(sh)
                                           << ": returning and out-parameter forms differ";
  }
}

TEST(Linformer, MatchesReferenceOnShapes) {
  [[maybe_unused]] double wf = 0, wd = 0;
  IF_FLOAT(check_shapes<float>(wf));
  IF_DOUBLE(check_shapes<double>(wd));
  IF_FLOAT(test::report_error("linformer/float/relative to max|FV|", wf));
  IF_DOUBLE(test::report_error("linformer/double/relative to max|FV|", wd));
}

// ---------------------------------------------------------------------------------------------
// Layouts: blocks, Maps, row-major storage, expressions, outputs in any of them. Each must
// give the column-major result (the kernels read every layout in the same order).
// ---------------------------------------------------------------------------------------------

template <class S>
void check_layouts(double& worst) {
  const LShape sh{37, 300, 17, 8, 5};  // L over one projection panel
  const Case<S> c = make_case<S>(sh, 23);
  const Mat<S> base = linattn::linformer_attention(c.Q, c.K, c.V, c.E, c.F);
  const double scale = projected_value_scale(c.Fd, c.Vd);
  const double tol = test::Tol<S>::ulps * scale;
  linattn::LinformerWorkspace<S> ws;
  const auto check = [&](const Mat<S>& got, const std::string& what) {
    const double err = test::max_abs_diff(got, base);
    worst = std::max(worst, err / scale);
    EXPECT_LE(err, tol) << test::scalar_name<S>() << " " << what;
  };
  // Row-major copies of everything, into a row-major output.
  const RowMat<S> Qr = c.Q, Kr = c.K, Vr = c.V, Er = c.E, Fr = c.F;
  RowMat<S> outr(sh.N, sh.M);
  linattn::linformer_attention(Qr, Kr, Vr, Er, Fr, outr, ws);
  check(outr, "row-major operands and output");
  check(linattn::linformer_attention(Qr, Kr, Vr, Er, Fr), "row-major operands, returning form");
  // Mixed: row-major E and F with column-major K and V, and the reverse.
  check(linattn::linformer_attention(c.Q, c.K, c.V, Er, Fr), "row-major E, F");
  check(linattn::linformer_attention(Qr, Kr, Vr, c.E, c.F), "row-major Q, K, V");
  // Blocks of larger matrices (outer strides != rows), output a block too.
  Mat<S> bigQ = Mat<S>::Constant(sh.N + 5, sh.D + 3, S(9)),
         bigK = Mat<S>::Constant(sh.L + 4, sh.D + 2, S(9)),
         bigV = Mat<S>::Constant(sh.L + 3, sh.M + 1, S(9)),
         bigE = Mat<S>::Constant(sh.k + 2, sh.L + 7, S(9)),
         bigF = Mat<S>::Constant(sh.k + 3, sh.L + 1, S(9)),
         bigO = Mat<S>::Constant(sh.N + 2, sh.M + 4, S(9));
  bigQ.block(2, 1, sh.N, sh.D) = c.Q;
  bigK.block(3, 2, sh.L, sh.D) = c.K;
  bigV.block(1, 0, sh.L, sh.M) = c.V;
  bigE.block(1, 5, sh.k, sh.L) = c.E;
  bigF.block(2, 1, sh.k, sh.L) = c.F;
  linattn::linformer_attention(bigQ.block(2, 1, sh.N, sh.D), bigK.block(3, 2, sh.L, sh.D),
                               bigV.block(1, 0, sh.L, sh.M), bigE.block(1, 5, sh.k, sh.L),
                               bigF.block(2, 1, sh.k, sh.L), bigO.block(1, 3, sh.N, sh.M), ws);
  check(bigO.block(1, 3, sh.N, sh.M), "blocks");
  EXPECT_TRUE((bigO.leftCols(3).array() == S(9)).all() && (bigO.row(0).array() == S(9)).all())
      << "writes outside the output block";
  // Blocks of row-major matrices: a head's columns of a packed buffer.
  RowMat<S> packedK(sh.L, 3 * sh.D);
  packedK.setConstant(S(9));
  packedK.middleCols(sh.D, sh.D) = c.K;
  check(linattn::linformer_attention(c.Q, packedK.middleCols(sh.D, sh.D), c.V, Er, c.F),
        "row-major block of K, row-major E");
  // Maps: row-major memory of the column-major values' transposes, an output Map.
  const Mat<S> Et = c.E.transpose(), Vt = c.V.transpose();
  Eigen::Map<const RowMat<S>> Em(Et.data(), sh.k, sh.L), Vm(Vt.data(), sh.L, sh.M);
  Mat<S> obuf(sh.M, sh.N);
  Eigen::Map<RowMat<S>> Om(obuf.data(), sh.N, sh.M);
  linattn::linformer_attention(c.Q, c.K, Vm, Em, c.F, Om, ws);
  check(Om, "row-major Maps of V and E, output Map");
  // Transposed storage (E given as the transpose of an L x k matrix) and an expression (no
  // memory of its own: evaluated once).
  check(linattn::linformer_attention(c.Q, c.K, c.V, Et.transpose(), c.F), "E as a transpose");
  check(linattn::linformer_attention(c.Q, (c.K.array() * S(1)).matrix(), c.V, c.E, c.F),
        "K as an expression");
  // A Map with an inner stride (evaluated into a temporary): Q's rows at the even rows of Qwide.
  Mat<S> Qwide = Mat<S>::Constant(2 * sh.N, sh.D, S(9));
  for (Index i = 0; i < sh.N; ++i) Qwide.row(2 * i) = c.Q.row(i);
  Eigen::Map<const Mat<S>, 0, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>> Qs(
      Qwide.data(), sh.N, sh.D, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>(2 * sh.N, 2));
  check(linattn::linformer_attention(Qs, c.K, c.V, c.E, c.F), "Q as a Map with an inner stride");
}

TEST(Linformer, LayoutsGiveTheColumnMajorResult) {
  [[maybe_unused]] double wf = 0, wd = 0;
  IF_FLOAT(check_layouts<float>(wf));
  IF_DOUBLE(check_layouts<double>(wd));
  IF_FLOAT(test::report_error("linformer layouts/float/relative to max|FV|", wf));
  IF_DOUBLE(test::report_error("linformer layouts/double/relative to max|FV|", wd));
}

// ---------------------------------------------------------------------------------------------
// E = F = identity (k = L): softmax attention itself.
// ---------------------------------------------------------------------------------------------

template <class S>
void check_identity(double& worst, bool& same) {
  for (const LShape& sh : {LShape{37, 130, 130, 8, 5}, LShape{300, 300, 300, 16, 24}}) {
    const Case<S> c = make_case<S>(sh, 31, 2.0);
    const Mat<S> I = Mat<S>::Identity(sh.L, sh.L);
    const Mat<S> lin = linattn::linformer_attention(c.Q, c.K, c.V, I, I);
    const Mat<S> soft = linattn::softmax_attention(c.Q, c.K, c.V);
    const double scale = std::max(1.0, test::max_abs(c.V));
    const double err = test::max_abs_diff(lin, soft) / scale;
    worst = std::max(worst, err);
    same = same && test::same_bits(lin, soft);
    EXPECT_LE(err, test::Tol<S>::ulps) << test::scalar_name<S>() << " " << name_of(sh);
  }
}

TEST(Linformer, IdentityProjectionsGiveSoftmaxAttention) {
  [[maybe_unused]] double wf = 0, wd = 0;
  bool same = true;
  IF_FLOAT(check_identity<float>(wf, same));
  IF_DOUBLE(check_identity<double>(wd, same));
  IF_FLOAT(test::report_error("linformer identity vs softmax_attention/float", wf));
  IF_DOUBLE(test::report_error("linformer identity vs softmax_attention/double", wd));
  // The projection of an identity adds exact zeros, so E K = K bit for bit and the same softmax
  // kernel runs on the same operands.
  EXPECT_TRUE(same) << "E = F = I differs from softmax_attention in some bit";
}

// ---------------------------------------------------------------------------------------------
// Magnitude 100: the scores reach 1e4–1e5; the online softmax keeps every result finite and the
// error is bounded by the score rounding, u·κ (κ = score_condition) times max |F V|.
// ---------------------------------------------------------------------------------------------

// Measured (Release -O1; -march=native gives less): error / (u·κ·max|FV|) at most 4.2e-3 (float)
// and 4.9e-3 (double),
// 2.7e-4 and 5.9e-13 of max |F V|: κ counts the projection's sum over L of |E||K| (about 1e6
// here), most of which cancels in E K.
constexpr double kMagnitudeRatio = 2e-2;

template <class S>
void check_magnitude(double& worst_ratio, double& worst_rel) {
  for (const LShape& sh : {LShape{37, 130, 17, 8, 5}, LShape{300, 513, 64, 33, 17}}) {
    const Case<S> c = make_case<S>(sh, 41, 100.0);
    const Mat<S> got = linattn::linformer_attention(c.Q, c.K, c.V, c.E, c.F);
    EXPECT_TRUE(test::all_finite(got)) << test::scalar_name<S>() << " " << name_of(sh);
    const MatD ref = reference(c.Qd, c.Kd, c.Vd, c.Ed, c.Fd);
    const double scale = projected_value_scale(c.Fd, c.Vd);
    const double u = std::numeric_limits<S>::epsilon() / 2;
    const double kappa = score_condition(c.Qd, c.Kd, c.Ed);
    const double err = test::max_abs_diff(got, ref) / scale;
    const double ratio = err / (u * kappa);
    worst_ratio = std::max(worst_ratio, ratio);
    worst_rel = std::max(worst_rel, err);
    EXPECT_LE(ratio, kMagnitudeRatio)
        << test::scalar_name<S>() << " " << name_of(sh) << " kappa " << kappa;
    // Convex combinations of the rows of F V.
    EXPECT_LE(test::max_abs(got), scale * (1 + 1e-5))
        << test::scalar_name<S>() << " " << name_of(sh);
  }
}

TEST(Linformer, MagnitudeHundredStaysFiniteAndAccurate) {
  [[maybe_unused]] double rf = 0, rd = 0, ef = 0, ed = 0;
  IF_FLOAT(check_magnitude<float>(rf, ef));
  IF_DOUBLE(check_magnitude<double>(rd, ed));
  IF_FLOAT(test::report_error("linformer magnitude 100/float/error over u*kappa", rf));
  IF_DOUBLE(test::report_error("linformer magnitude 100/double/error over u*kappa", rd));
  IF_FLOAT(test::report_error("linformer magnitude 100/float/relative to max|FV|", ef));
  IF_DOUBLE(test::report_error("linformer magnitude 100/double/relative to max|FV|", ed));
}

// ---------------------------------------------------------------------------------------------
// Empty dimensions
// ---------------------------------------------------------------------------------------------

template <class S>
void check_empty() {
  linattn::LinformerWorkspace<S> ws;
  // N = 0: an empty result.
  {
    const Case<S> c = make_case<S>({0, 20, 5, 4, 3}, 51);
    const Mat<S> got = linattn::linformer_attention(c.Q, c.K, c.V, c.E, c.F);
    EXPECT_EQ(got.rows(), 0);
    EXPECT_EQ(got.cols(), 3);
    Mat<S> out(0, 3);
    linattn::linformer_attention(c.Q, c.K, c.V, c.E, c.F, out, ws);
  }
  // k = 0: zeros, what softmax attention gives with no keys.
  {
    const Case<S> c = make_case<S>({9, 20, 0, 4, 3}, 52);
    ASSERT_EQ(c.E.rows(), 0);
    ASSERT_EQ(c.E.cols(), 20);
    const Mat<S> got = linattn::linformer_attention(c.Q, c.K, c.V, c.E, c.F);
    const Mat<S> none = linattn::softmax_attention(c.Q, c.K.topRows(0), c.V.topRows(0));
    EXPECT_TRUE(test::same_bits(got, none)) << test::scalar_name<S>() << " k = 0";
    EXPECT_TRUE((got.array() == S(0)).all()) << test::scalar_name<S>() << " k = 0";
    Mat<S> out = Mat<S>::Constant(9, 3, S(7));
    linattn::linformer_attention(c.Q, c.K, c.V, c.E, c.F, out, ws);
    EXPECT_TRUE((out.array() == S(0)).all()) << test::scalar_name<S>() << " k = 0, out form";
  }
  // L = 0 with k > 0: zero projected keys and values, hence zeros (and the reference agrees).
  {
    const Case<S> c = make_case<S>({9, 0, 4, 4, 3}, 53);
    Mat<S> out = Mat<S>::Constant(9, 3, S(7));
    linattn::linformer_attention(c.Q, c.K, c.V, c.E, c.F, out, ws);
    EXPECT_TRUE((out.array() == S(0)).all()) << test::scalar_name<S>() << " L = 0";
    EXPECT_EQ(test::max_abs_diff(out, reference(c.Qd, c.Kd, c.Vd, c.Ed, c.Fd)), 0.0);
  }
  // Both: N = 0 and k = 0.
  {
    const Case<S> c = make_case<S>({0, 0, 0, 2, 2}, 54);
    EXPECT_EQ(linattn::linformer_attention(c.Q, c.K, c.V, c.E, c.F).size(), 0);
  }
}

TEST(Linformer, EmptyDimensions) {
  IF_FLOAT(check_empty<float>());
  IF_DOUBLE(check_empty<double>());
}

// ---------------------------------------------------------------------------------------------
// Errors: std::invalid_argument naming the function and every shape; nothing written.
// ---------------------------------------------------------------------------------------------

using MatF = Eigen::MatrixXf;
using Needles = std::vector<std::string>;

MatF rnd(Index r, Index c) { return test::random_matrix<float>(r, c, test::seed_of({r, c, 61})); }

std::string shapes_text(const MatF& Q, const MatF& K, const MatF& V, const MatF& E, const MatF& F) {
  const auto s = [](const MatF& m) {
    return std::to_string(m.rows()) + "x" + std::to_string(m.cols());
  };
  return "(Q is " + s(Q) + ", K is " + s(K) + ", V is " + s(V) + ", E is " + s(E) + ", F is " +
         s(F) + ")";
}

// Both forms must throw with the function's name, `what` and every shape; `out` (N x M, filled
// with 7) must be left as it was.
void expect_linformer_invalid(const MatF& Q, const MatF& K, const MatF& V, const MatF& E,
                              const MatF& F, const std::string& what) {
  const std::vector<std::string> needles = {"linattn::linformer_attention", what,
                                            shapes_text(Q, K, V, E, F)};
  test::expect_invalid([&] { (void)linattn::linformer_attention(Q, K, V, E, F); }, needles,
                       "returning form: " + what);
  linattn::LinformerWorkspace<float> ws;
  MatF out = MatF::Constant(Q.rows(), V.cols(), 7.0f);
  test::expect_invalid([&] { linattn::linformer_attention(Q, K, V, E, F, out, ws); }, needles,
                       "out form: " + what);
  EXPECT_TRUE((out.array() == 7.0f).all()) << what << ": the output was written before the check";
}

TEST(Linformer, ShapeErrorsNameTheFunctionAndEveryShape) {
  // Q and K differ in D.
  expect_linformer_invalid(rnd(10, 4), rnd(12, 3), rnd(12, 3), rnd(5, 12), rnd(5, 12),
                           "Q and K must have the same number of columns D");
  // K and V differ in L.
  expect_linformer_invalid(rnd(10, 4), rnd(12, 4), rnd(11, 3), rnd(5, 12), rnd(5, 12),
                           "K and V must have the same number of rows L");
  // E has the wrong number of columns.
  expect_linformer_invalid(rnd(10, 4), rnd(12, 4), rnd(12, 3), rnd(5, 11), rnd(5, 11),
                           "E must be k x L");
  // F has another k, or another L, than E.
  expect_linformer_invalid(rnd(10, 4), rnd(12, 4), rnd(12, 3), rnd(5, 12), rnd(6, 12),
                           "F must be k x L with the k and L of E");
  expect_linformer_invalid(rnd(10, 4), rnd(12, 4), rnd(12, 3), rnd(5, 12), rnd(5, 13),
                           "F must be k x L with the k and L of E");
  // D = 0.
  expect_linformer_invalid(rnd(10, 0), rnd(12, 0), rnd(12, 3), rnd(5, 12), rnd(5, 12),
                           "the key dimension D must be positive");
}

TEST(Linformer, OutputErrors) {
  const MatF Q = rnd(10, 3), K = rnd(12, 3), V = rnd(12, 3), E = rnd(5, 12), F = rnd(5, 12);
  linattn::LinformerWorkspace<float> ws;
  MatF wrong = MatF::Constant(9, 3, 7.0f);
  test::expect_invalid(
      [&] { linattn::linformer_attention(Q, K, V, E, F, wrong, ws); },
      Needles{"linattn::linformer_attention", "the output is 9x3 but must be 10x3"},
      "wrong output shape");
  EXPECT_TRUE((wrong.array() == 7.0f).all());
  // The output may not share memory with an input.
  MatF Qc = Q;
  const MatF Qsaved = Qc;
  Eigen::Map<MatF> alias(Qc.data(), 10, 3);
  test::expect_invalid(
      [&] { linattn::linformer_attention(Qc, K, V, E, F, alias, ws); },
      Needles{"linattn::linformer_attention", "the output overlaps the memory of Q"},
      "output overlapping Q");
  MatF Ebig = MatF::Zero(12, 12);
  Ebig.topRows(5) = E;
  test::expect_invalid(
      [&] {
        linattn::linformer_attention(Q, K, V, Ebig.topRows(5), F, Ebig.bottomRows(10).leftCols(3),
                                     ws);
      },
      Needles{"linattn::linformer_attention", "the output overlaps the memory of E"},
      "output overlapping E");
  EXPECT_TRUE(test::same_bits(Qc, Qsaved));
  // The workspace still works after the errors.
  MatF out(10, 3);
  linattn::linformer_attention(Q, K, V, E, F, out, ws);
  EXPECT_TRUE(test::same_bits(out, linattn::linformer_attention(Q, K, V, E, F)));
}

TEST(Linformer, ProjectionErrors) {
  test::expect_invalid([] { (void)linattn::make_linformer_projections<float>(-1, 3, 0); },
                       Needles{"linattn::make_linformer_projections", "L is -1", "k is 3"},
                       "negative L");
  test::expect_invalid([] { (void)linattn::make_linformer_projections<double>(4, -2, 0); },
                       Needles{"linattn::make_linformer_projections", "L is 4", "k is -2"},
                       "negative k");
}

// ---------------------------------------------------------------------------------------------
// make_linformer_projections
// ---------------------------------------------------------------------------------------------

TEST(LinformerProjections, ShapeDeterminismAndSeeds) {
  const auto a = linattn::make_linformer_projections<double>(130, 17, 42);
  EXPECT_EQ(a.first.rows(), 17);
  EXPECT_EQ(a.first.cols(), 130);
  EXPECT_EQ(a.second.rows(), 17);
  EXPECT_EQ(a.second.cols(), 130);
  const auto b = linattn::make_linformer_projections<double>(130, 17, 42);
  EXPECT_TRUE(test::same_bits(a.first, b.first) && test::same_bits(a.second, b.second))
      << "one seed must give the same projections";
  const auto c = linattn::make_linformer_projections<double>(130, 17, 43);
  // Independent draws: no entry in common (equal doubles from two streams would be a bug).
  EXPECT_EQ((a.first.array() == c.first.array()).count(), 0);
  EXPECT_EQ((a.second.array() == c.second.array()).count(), 0);
  EXPECT_EQ((a.first.array() == a.second.array()).count(), 0) << "E and F must differ";
  // float is the double draw rounded (the transform runs in double).
  const auto f = linattn::make_linformer_projections<float>(130, 17, 42);
  EXPECT_TRUE(test::same_bits(f.first, a.first.cast<float>()));
  EXPECT_TRUE(test::same_bits(f.second, a.second.cast<float>()));
  // Empty shapes.
  const auto e0 = linattn::make_linformer_projections<float>(0, 5, 1);
  EXPECT_EQ(e0.first.rows(), 5);
  EXPECT_EQ(e0.first.cols(), 0);
  const auto k0 = linattn::make_linformer_projections<float>(7, 0, 1);
  EXPECT_EQ(k0.second.rows(), 0);
  EXPECT_EQ(k0.second.cols(), 7);
  // Pinned values (seed 42, k = 17, L = 130): the generator is part of the contract
  // (docs/SPEC.md §5), so a change must be deliberate. The tolerance allows for the last bit of
  // a platform's std::log.
  const double pinned[4] = {a.first(0, 0), a.first(1, 0), a.first(0, 1), a.second(16, 129)};
  const double expected[4] = {0.31379754504327451, 0.17098476983966404, -0.21646403356131921,
                              0.4491991845598608};
  for (int i = 0; i < 4; ++i)
    EXPECT_NEAR(pinned[i], expected[i], 1e-14 * std::abs(expected[i])) << "pinned value " << i;
}

// Sample moments of the 2·k·L entries of (E, F): entries N(0, σ²), σ² = 1/k. With n samples the
// mean has standard deviation σ/√n, the sample variance σ²·√(2/(n − 1)), the fraction within
// ±σ √(p(1 − p)/n) (p = erf(1/√2)), the mean of E∘F (independent) σ²/√(n/2). Each is checked at
// 5 standard deviations (a false alarm once in 1.7 million seeds).
template <class S>
void check_moments(Index L, Index k, std::uint64_t seed) {
  const auto [E, F] = linattn::make_linformer_projections<S>(L, k, seed);
  const double n = 2.0 * double(k) * double(L), var = 1.0 / double(k), sigma = std::sqrt(var);
  double sum = 0, within = 0, cross = 0;
  for (const auto* m : {&E, &F})
    for (Index i = 0; i < m->size(); ++i) {
      const double x = double(m->data()[i]);
      sum += x;
      within += std::abs(x) <= sigma ? 1 : 0;
    }
  const double mean = sum / n;
  double ss = 0;
  for (const auto* m : {&E, &F})
    for (Index i = 0; i < m->size(); ++i)
      ss += (double(m->data()[i]) - mean) * (double(m->data()[i]) - mean);
  const double sample_var = ss / (n - 1);
  for (Index i = 0; i < E.size(); ++i) cross += double(E.data()[i]) * double(F.data()[i]);
  cross /= n / 2;
  const double p = std::erf(1.0 / std::sqrt(2.0));
  const std::string where = std::string(test::scalar_name<S>()) + " L=" + std::to_string(L) +
                            " k=" + std::to_string(k) + " seed=" + std::to_string(seed);
  EXPECT_LE(std::abs(mean), 5 * sigma / std::sqrt(n)) << where;
  EXPECT_LE(std::abs(sample_var - var), 5 * var * std::sqrt(2 / (n - 1)))
      << where << " var " << sample_var;
  EXPECT_LE(std::abs(within / n - p), 5 * std::sqrt(p * (1 - p) / n)) << where;
  EXPECT_LE(std::abs(cross), 5 * var / std::sqrt(n / 2)) << where;
  std::cout << "[ moments  ] " << where << ": mean " << mean << " (sd " << sigma / std::sqrt(n)
            << "), variance " << sample_var << " (1/k = " << var << ", sd "
            << var * std::sqrt(2 / (n - 1)) << "), within 1 sd " << within / n << std::endl;
}

TEST(LinformerProjections, MomentsOfNormalZeroOneOverK) {
  for (const std::uint64_t seed : {0ull, 1ull, 12345ull}) {
    IF_DOUBLE(check_moments<double>(1000, 64, seed));
    IF_FLOAT(check_moments<float>(1000, 64, seed));
  }
  IF_DOUBLE(check_moments<double>(4096, 7, 99));
  IF_DOUBLE(check_moments<double>(50, 256, 7));
}

// ---------------------------------------------------------------------------------------------
// No allocation on the out-parameter path with a reused workspace.
// ---------------------------------------------------------------------------------------------

TEST(Linformer, NoMallocDetectorWorks) { eigen_hook::expect_detector_works(); }

template <class S>
void check_no_allocation() {
  const LShape sh{300, 513, 64, 33, 17};  // several softmax tiles (float) and projection panels
  const Case<S> c = make_case<S>(sh, 71);
  const RowMat<S> Er = c.E, Fr = c.F, Kr = c.K;
  Mat<S> out(sh.N, sh.M);
  RowMat<S> outr(sh.N, sh.M);
  linattn::LinformerWorkspace<S> ws;
  linattn::linformer_attention(c.Q, c.K, c.V, c.E, c.F, out, ws);  // sizes the workspace
  linattn::linformer_attention(c.Q, Kr, c.V, Er, Fr, outr, ws);    // and the row-major panel
  const Mat<S> first = out;
  const test::Allocations a =
      test::allocations_in([&] { linattn::linformer_attention(c.Q, c.K, c.V, c.E, c.F, out, ws); });
  EXPECT_EQ(a.eigen, 0) << test::scalar_name<S>() << " column-major";
  EXPECT_EQ(a.news, 0) << test::scalar_name<S>() << " column-major";
  EXPECT_TRUE(test::same_bits(out, first)) << "a reused workspace must not change the result";
  const test::Allocations b =
      test::allocations_in([&] { linattn::linformer_attention(c.Q, Kr, c.V, Er, Fr, outr, ws); });
  EXPECT_EQ(b.eigen, 0) << test::scalar_name<S>() << " row-major";
  EXPECT_EQ(b.news, 0) << test::scalar_name<S>() << " row-major";
  // A smaller shape on the same workspace: blocks of the same operands.
  const Index n = 37, l = 130, k = 17;
  Mat<S> small(n, sh.M);
  const test::Allocations s = test::allocations_in([&] {
    linattn::linformer_attention(c.Q.topRows(n), c.K.topRows(l), c.V.topRows(l),
                                 c.E.topLeftCorner(k, l), c.F.topLeftCorner(k, l), small, ws);
  });
  EXPECT_EQ(s.eigen, 0) << test::scalar_name<S>() << " smaller shape";
  EXPECT_EQ(s.news, 0) << test::scalar_name<S>() << " smaller shape";
  EXPECT_GT(ws.bytes(), std::size_t(0));
}

TEST(Linformer, OutParameterFormAllocatesNothingWithAReusedWorkspace) {
  IF_FLOAT(check_no_allocation<float>());
  IF_DOUBLE(check_no_allocation<double>());
}

}  // namespace
