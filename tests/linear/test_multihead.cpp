// The multi-head and batched variable-length kernels of multihead.hpp: heads packed side by
// side (Q is N x (H·D), K is L x (H·D), V is L x (H·M), out is N x (H·M)), against per-head
// calls of the single-head kernels (exactly: each head runs the same code on the same column
// blocks) and against the naive double references of reference.hpp; ParallelOptions thread
// counts (bitwise identical results, with and without OpenMP); Maps, row-major storage,
// blocks of larger matrices as inputs and outputs; batched sequences given by offsets, empty
// ones included; MultiHeadRecurrentLinearAttention; zero allocation with a reused
// MultiHeadWorkspace; argument checks.
//
// The no-allocation checks need EIGEN_RUNTIME_NO_MALLOC before any Eigen header (defined here
// unless the build already does) and eigen_assert redirected to the hook of
// eigen_assert_hook.hpp, which makes Eigen's forbidden allocations visible in Release builds
// too (see test_causal.cpp). Global operator new is also counted (std::vector, std::string),
// as in test_workspace.cpp.
#ifndef EIGEN_RUNTIME_NO_MALLOC
#define EIGEN_RUNTIME_NO_MALLOC
#endif
#include "eigen_assert_hook.hpp"  // first: before any Eigen header

#include "allocation_count.hpp"  // counts Eigen allocations and global operator new

#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <algorithm>
#include <atomic>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "causal_reference.hpp"
#include "reference.hpp"
#include "team_recording_map.hpp"
#include "test_util.hpp"

namespace {

using linattn::CausalAlgorithm;
using linattn::CausalOptions;
using linattn::EluPlusOne;
using linattn::MultiHeadRecurrentLinearAttention;
using linattn::MultiHeadWorkspace;
using linattn::NormalizedCosine;
using linattn::ParallelOptions;
using linattn::SoftmaxAlgorithm;
using linattn::SoftmaxSplit;
using test::Index;
using test::Mat;
using test::MatD;
using test::RowMat;
template <class S>
using Vec = Eigen::Matrix<S, Eigen::Dynamic, 1>;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

// Sets Eigen's number of threads for a scope; restores Eigen's default on exit (see
// test_workspace.cpp: with Eigen::nbThreads() > 1 Eigen's parallel GEMM allocates).
struct EigenThreads {
  explicit EigenThreads(int n) { Eigen::setNbThreads(n); }
  ~EigenThreads() { Eigen::setNbThreads(0); }
  EigenThreads(const EigenThreads&) = delete;
  EigenThreads& operator=(const EigenThreads&) = delete;
};

ParallelOptions threads(int n) {
  ParallelOptions p;
  p.num_threads = n;
  // The shapes here are small: without this the work model would run them on one thread.
  p.min_work_per_thread = 0;
  return p;
}

CausalOptions causal_options(CausalAlgorithm algorithm, Index chunk) {
  CausalOptions o;
  o.algorithm = algorithm;
  o.chunk_size = chunk;
  return o;
}

std::string options_name(const CausalOptions& o) {
  const char* a = o.algorithm == CausalAlgorithm::Chunked     ? "chunked"
                  : o.algorithm == CausalAlgorithm::Recurrent ? "recurrent"
                                                              : "auto";
  return std::string(a) + "/chunk=" + std::to_string(o.chunk_size);
}

// The causal options every causal comparison runs: the default (Auto), chunked with the
// default and an odd chunk size, recurrent.
const std::vector<CausalOptions>& all_causal_options() {
  static const std::vector<CausalOptions> list = {
      CausalOptions{}, causal_options(CausalAlgorithm::Chunked, 0),
      causal_options(CausalAlgorithm::Chunked, 7), causal_options(CausalAlgorithm::Recurrent, 0)};
  return list;
}

// A multi-head shape: H heads of key dimension D and value dimension M, N queries, L keys.
struct MhShape {
  Index H, N, L, D, M;
};

std::ostream& operator<<(std::ostream& os, const MhShape& s) {
  return os << "H=" << s.H << " N=" << s.N << " L=" << s.L << " D=" << s.D << " M=" << s.M;
}

// Several H (1, 2, 3, 8), D != M, N and L straddling (and not multiples of) the 64/128/256-row
// blocks and tiles, N != L, single rows.
const std::vector<MhShape>& shapes() {
  static const std::vector<MhShape> list = {
      {1, 7, 5, 3, 2},    {2, 130, 65, 5, 3}, {3, 257, 300, 8, 5},
      {8, 65, 129, 4, 6}, {3, 1, 2, 3, 1},    {2, 300, 257, 16, 9},
  };
  return list;
}

// Causal shapes (N == L).
const std::vector<MhShape>& causal_shapes() {
  static const std::vector<MhShape> list = {
      {1, 7, 7, 3, 2},   {2, 130, 130, 5, 3}, {3, 257, 257, 8, 5},
      {8, 65, 65, 4, 6}, {3, 1, 1, 3, 1},     {2, 300, 300, 16, 9},
  };
  return list;
}

template <class S>
struct Inputs {
  Mat<S> Q, K, V;
};

// Q, K uniform in [-2, 2], V in [-3, 3], seeded per shape.
template <class S>
Inputs<S> make_inputs(const MhShape& sh, std::uint32_t salt) {
  return {
      test::random_matrix<S>(sh.N, sh.H * sh.D, test::seed_of({sh.H, sh.N, sh.L, sh.D, salt, 1}),
                             -2, 2),
      test::random_matrix<S>(sh.L, sh.H * sh.D, test::seed_of({sh.H, sh.N, sh.L, sh.D, salt, 2}),
                             -2, 2),
      test::random_matrix<S>(sh.L, sh.H * sh.M, test::seed_of({sh.H, sh.L, sh.M, salt, 3}), -3, 3)};
}

template <class Map>
std::string map_name() {
  return cref::map_name<Map>();
}

template <class S, class Map>
std::string tag_of(const char* what) {
  return std::string(what) + "/" + map_name<Map>() + "/" + test::scalar_name<S>();
}

// The smallest reference denominator at which a row is compared with the reference (as in
// test_linear_attention.cpp): EluPlusOne's features are positive (only the guard matters);
// NormalizedCosine's sums cancel, so rows are compared when the denominator is at least 5% of
// the number of keys the row sees; SoftmaxSplit has no denominator.
template <class Map>
double min_den(Index keys) {
  if constexpr (std::is_same_v<Map, NormalizedCosine>)
    return 0.05 * double(keys);
  else if constexpr (std::is_same_v<Map, SoftmaxSplit>)
    return 0.0;
  else
    return 1e-3;
}

// max |got - expected| over the well-conditioned rows (see min_den); the other rows must be
// finite and no larger than max |V|. +inf on a shape mismatch or a violation.
template <class Map, class DA>
double reference_error(const Eigen::MatrixBase<DA>& got, const MatD& expected, const ref::Vec& den,
                       bool causal, Index L, double v_bound) {
  const Mat<double> g = got.template cast<double>();
  if (g.rows() != expected.rows() || g.cols() != expected.cols() || den.size() != g.rows())
    return std::numeric_limits<double>::infinity();
  double e = 0;
  for (Index i = 0; i < g.rows(); ++i) {
    const Index keys = causal ? std::min(i + 1, L) : L;
    if (den(i) >= min_den<Map>(keys)) {
      e = std::max(e, test::max_abs_diff(g.row(i), expected.row(i)));
    } else if (!test::all_finite(g.row(i)) || test::max_abs(g.row(i)) > v_bound * (1 + 1e-3)) {
      return std::numeric_limits<double>::infinity();
    }
  }
  return e;
}

// Tolerance for results that agree up to rounding only (another code path): about 10x the
// rounding errors measured in test_causal.cpp.
template <class S>
double tight_tol(double scale = 1.0) {
  return (sizeof(S) == sizeof(float) ? 5e-6 : 1e-13) * std::max(1.0, scale);
}

// Column blocks of head h.
template <class Derived>
auto qk_head(const Eigen::MatrixBase<Derived>& X, Index h, Index D) {
  return X.middleCols(h * D, D);
}

template <class F>
void expect_invalid(F&& f, const std::vector<std::string>& needles, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": no exception";
  } catch (const std::invalid_argument& e) {
    for (const std::string& needle : needles)
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
          << what << ": message \"" << e.what() << "\" lacks \"" << needle << "\"";
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": not std::invalid_argument but " << e.what();
  } catch (...) {
    ADD_FAILURE() << what << ": not std::invalid_argument";
  }
}

// ---------------------------------------------------------------------------------------------
// 1. Every head equals the single-head kernel on its column blocks, and the reference
// ---------------------------------------------------------------------------------------------

template <class S, class Map>
void check_multihead_linear(const Map& phi) {
  const std::string tag = tag_of<S, Map>("multihead_linear_attention");
  double worst_ref = 0;
  for (const MhShape& sh : shapes()) {
    const Inputs<S> in = make_inputs<S>(sh, 10);
    const Index H = sh.H, D = sh.D, M = sh.M;
    MultiHeadWorkspace<S> ws;
    Mat<S> out(sh.N, H * M);
    linattn::multihead_linear_attention(in.Q, in.K, in.V, H, phi, out, ws);
    const Mat<S> returned = linattn::multihead_linear_attention(in.Q, in.K, in.V, H, phi);
    EXPECT_EQ(test::max_abs_diff(returned, out), 0.0) << tag << " returning overload " << sh;
    for (Index h = 0; h < H; ++h) {
      const auto Qh = qk_head(in.Q, h, D), Kh = qk_head(in.K, h, D);
      const auto Vh = in.V.middleCols(h * M, M);
      const Mat<S> single = linattn::linear_attention(Qh, Kh, Vh, phi);
      EXPECT_EQ(test::max_abs_diff(out.middleCols(h * M, M), single), 0.0)
          << tag << " head " << h << " vs linear_attention on its columns, " << sh;
      ref::Vec den;
      const MatD expected =
          ref::linear_attention(Qh.template cast<double>(), Kh.template cast<double>(),
                                Vh.template cast<double>(), phi, &den);
      const double e = reference_error<Map>(out.middleCols(h * M, M), expected, den, false, sh.L,
                                            test::max_abs(Vh));
      EXPECT_LE(e, test::tolerance<S>(test::max_abs(Vh)))
          << tag << " head " << h << " vs reference, " << sh;
      worst_ref = std::max(worst_ref, e);
    }
  }
  test::report_error(tag + " vs reference", worst_ref);
}

TEST(MultiHead, LinearEqualsPerHeadCallsAndReference) {
  IF_FLOAT(check_multihead_linear<float>(EluPlusOne{}));
  IF_DOUBLE(check_multihead_linear<double>(EluPlusOne{}));
  IF_FLOAT(check_multihead_linear<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_multihead_linear<double>(SoftmaxSplit{}));
  IF_FLOAT(check_multihead_linear<float>(NormalizedCosine{}));
  IF_DOUBLE(check_multihead_linear<double>(NormalizedCosine{}));
}

// The default feature map of the returning overload is EluPlusOne.
TEST(MultiHead, LinearDefaultMapIsEluPlusOne) {
  const Inputs<float> in = make_inputs<float>({3, 70, 40, 4, 5}, 11);
  EXPECT_EQ(
      test::max_abs_diff(linattn::multihead_linear_attention(in.Q, in.K, in.V, 3),
                         linattn::multihead_linear_attention(in.Q, in.K, in.V, 3, EluPlusOne{})),
      0.0);
  EXPECT_EQ(test::max_abs_diff(
                linattn::multihead_causal_linear_attention(in.Q.topRows(40), in.K, in.V, 3),
                linattn::multihead_causal_linear_attention(in.Q.topRows(40), in.K, in.V, 3,
                                                           EluPlusOne{})),
            0.0);
}

template <class S, class Map>
void check_multihead_causal(const Map& phi) {
  const std::string tag = tag_of<S, Map>("multihead_causal_linear_attention");
  double worst_ref = 0;
  for (const MhShape& sh : causal_shapes()) {
    const Inputs<S> in = make_inputs<S>(sh, 20);
    const Index H = sh.H, D = sh.D, M = sh.M;
    std::vector<MatD> expected(static_cast<std::size_t>(H));
    std::vector<ref::Vec> den(static_cast<std::size_t>(H));
    for (Index h = 0; h < H; ++h)
      expected[static_cast<std::size_t>(h)] = ref::causal_linear_attention(
          qk_head(in.Q, h, D).template cast<double>(), qk_head(in.K, h, D).template cast<double>(),
          in.V.middleCols(h * M, M).template cast<double>(), phi,
          &den[static_cast<std::size_t>(h)]);
    MultiHeadWorkspace<S> ws;  // reused across the options: buffers only grow
    for (const CausalOptions& opts : all_causal_options()) {
      const std::string where = tag + " " + options_name(opts);
      Mat<S> out(sh.N, H * M);
      linattn::multihead_causal_linear_attention(in.Q, in.K, in.V, H, phi, out, ws, opts);
      const Mat<S> returned =
          linattn::multihead_causal_linear_attention(in.Q, in.K, in.V, H, phi, opts);
      EXPECT_EQ(test::max_abs_diff(returned, out), 0.0) << where << " returning overload " << sh;
      for (Index h = 0; h < H; ++h) {
        const auto Qh = qk_head(in.Q, h, D), Kh = qk_head(in.K, h, D);
        const auto Vh = in.V.middleCols(h * M, M);
        const Mat<S> single = linattn::causal_linear_attention(Qh, Kh, Vh, phi, opts);
        // A few ulps, not bit for bit: with -march=native Eigen's products take paths that
        // depend on the alignment of the output block (seen: 1 ulp under AVX-512).
        EXPECT_LE(test::max_abs_diff(out.middleCols(h * M, M), single), 4 * test::Tol<S>::ulps)
            << where << " head " << h << " vs causal_linear_attention on its columns, " << sh;
        const double e =
            reference_error<Map>(out.middleCols(h * M, M), expected[static_cast<std::size_t>(h)],
                                 den[static_cast<std::size_t>(h)], true, sh.L, test::max_abs(Vh));
        EXPECT_LE(e, test::tolerance<S>(test::max_abs(Vh)))
            << where << " head " << h << " vs reference, " << sh;
        worst_ref = std::max(worst_ref, e);
      }
    }
  }
  test::report_error(tag + " vs reference", worst_ref);
}

TEST(MultiHead, CausalLinearEqualsPerHeadCallsAndReference) {
  IF_FLOAT(check_multihead_causal<float>(EluPlusOne{}));
  IF_DOUBLE(check_multihead_causal<double>(EluPlusOne{}));
  IF_FLOAT(check_multihead_causal<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_multihead_causal<double>(SoftmaxSplit{}));
  IF_FLOAT(check_multihead_causal<float>(NormalizedCosine{}));
  IF_DOUBLE(check_multihead_causal<double>(NormalizedCosine{}));
}

template <class S>
void check_multihead_softmax(bool causal) {
  const std::string tag =
      std::string(causal ? "multihead_causal_softmax_attention/" : "multihead_softmax_attention/") +
      test::scalar_name<S>();
  double worst_ref = 0;
  for (const MhShape& sh : causal ? causal_shapes() : shapes()) {
    const Inputs<S> in = make_inputs<S>(sh, 30);
    const Index H = sh.H, D = sh.D, M = sh.M;
    MultiHeadWorkspace<S> ws;
    for (const SoftmaxAlgorithm algo : {SoftmaxAlgorithm::Tiled, SoftmaxAlgorithm::Naive}) {
      const std::string where = tag + (algo == SoftmaxAlgorithm::Tiled ? "/Tiled" : "/Naive");
      Mat<S> out(sh.N, H * M);
      Mat<S> returned;
      if (causal) {
        linattn::multihead_causal_softmax_attention(in.Q, in.K, in.V, H, out, ws, algo);
        returned = linattn::multihead_causal_softmax_attention(in.Q, in.K, in.V, H, algo);
      } else {
        linattn::multihead_softmax_attention(in.Q, in.K, in.V, H, out, ws, algo);
        returned = linattn::multihead_softmax_attention(in.Q, in.K, in.V, H, algo);
      }
      EXPECT_EQ(test::max_abs_diff(returned, out), 0.0) << where << " returning overload " << sh;
      for (Index h = 0; h < H; ++h) {
        const auto Qh = qk_head(in.Q, h, D), Kh = qk_head(in.K, h, D);
        const auto Vh = in.V.middleCols(h * M, M);
        const Mat<S> single = causal ? linattn::causal_softmax_attention(Qh, Kh, Vh, algo)
                                     : linattn::softmax_attention(Qh, Kh, Vh, algo);
        EXPECT_EQ(test::max_abs_diff(out.middleCols(h * M, M), single), 0.0)
            << where << " head " << h << " vs the single-head kernel on its columns, " << sh;
        const MatD Qd = Qh.template cast<double>(), Kd = Kh.template cast<double>();
        const MatD Vd = Vh.template cast<double>();
        const MatD expected =
            causal ? ref::causal_softmax_attention(Qd, Kd, Vd) : ref::softmax_attention(Qd, Kd, Vd);
        const double e = test::max_abs_diff(out.middleCols(h * M, M), expected);
        EXPECT_LE(e, test::tolerance<S>(test::max_abs(Vh)))
            << where << " head " << h << " vs reference, " << sh;
        worst_ref = std::max(worst_ref, e);
      }
    }
  }
  test::report_error(tag + " vs reference", worst_ref);
}

TEST(MultiHead, SoftmaxEqualsPerHeadCallsAndReference) {
  IF_FLOAT(check_multihead_softmax<float>(false));
  IF_DOUBLE(check_multihead_softmax<double>(false));
}

TEST(MultiHead, CausalSoftmaxEqualsPerHeadCallsAndReference) {
  IF_FLOAT(check_multihead_softmax<float>(true));
  IF_DOUBLE(check_multihead_softmax<double>(true));
}

// A head must see only its own columns: changing head 1's inputs leaves the other heads'
// outputs bit for bit, for every kernel.
TEST(MultiHead, HeadsAreIndependent) {
  const MhShape sh{3, 90, 90, 4, 6};
  const Inputs<float> a = make_inputs<float>(sh, 40);
  Inputs<float> b = a;
  b.Q.middleCols(sh.D, sh.D) = test::random_matrix<float>(sh.N, sh.D, 41);
  b.K.middleCols(sh.D, sh.D) = test::random_matrix<float>(sh.L, sh.D, 42);
  b.V.middleCols(sh.M, sh.M) = test::random_matrix<float>(sh.L, sh.M, 43);
  const auto run = [&](const Inputs<float>& x, int kernel) -> Mat<float> {
    switch (kernel) {
      case 0:
        return linattn::multihead_linear_attention(x.Q, x.K, x.V, sh.H, SoftmaxSplit{});
      case 1:
        return linattn::multihead_causal_linear_attention(x.Q, x.K, x.V, sh.H, SoftmaxSplit{});
      case 2:
        return linattn::multihead_softmax_attention(x.Q, x.K, x.V, sh.H);
      default:
        return linattn::multihead_causal_softmax_attention(x.Q, x.K, x.V, sh.H);
    }
  };
  for (int kernel = 0; kernel < 4; ++kernel) {
    const Mat<float> ra = run(a, kernel), rb = run(b, kernel);
    EXPECT_EQ(test::max_abs_diff(ra.leftCols(sh.M), rb.leftCols(sh.M)), 0.0) << "kernel " << kernel;
    EXPECT_EQ(test::max_abs_diff(ra.rightCols(sh.M), rb.rightCols(sh.M)), 0.0)
        << "kernel " << kernel;
    EXPECT_GT(test::max_abs_diff(ra.middleCols(sh.M, sh.M), rb.middleCols(sh.M, sh.M)), 1e-3)
        << "kernel " << kernel << ": head 1 ignored its new inputs";
  }
}

// No queries (N = 0) and, for the non-causal kernels, no keys (L = 0: zero rows).
TEST(MultiHead, EmptyInputs) {
  const Index H = 3, D = 2, M = 4;
  const Mat<float> Q0(0, H * D), K0(0, H * D), V0(0, H * M);
  const Mat<float> Q = test::random_matrix<float>(5, H * D, 50);
  MultiHeadWorkspace<float> ws;
  Mat<float> out = Mat<float>::Constant(5, H * M, 7.0f);
  linattn::multihead_linear_attention(Q, K0, V0, H, EluPlusOne{}, out, ws);
  EXPECT_EQ(test::max_abs(out), 0.0) << "linear attention with no keys gives zero rows";
  out.setConstant(7.0f);
  linattn::multihead_softmax_attention(Q, K0, V0, H, out, ws);
  EXPECT_EQ(test::max_abs(out), 0.0) << "softmax attention with no keys gives zero rows";
  EXPECT_EQ(linattn::multihead_linear_attention(Q0, K0, V0, H).rows(), 0);
  EXPECT_EQ(linattn::multihead_causal_linear_attention(Q0, K0, V0, H).cols(), H * M);
  EXPECT_EQ(linattn::multihead_softmax_attention(Q0, K0, V0, H).rows(), 0);
  EXPECT_EQ(linattn::multihead_causal_softmax_attention(Q0, K0, V0, H).cols(), H * M);
}

// ---------------------------------------------------------------------------------------------
// 2. Threads: identical results (bitwise) for every thread count
// ---------------------------------------------------------------------------------------------

// Runs every multi-head and batched kernel with `par` and returns the outputs side by side.
template <class S, class Map>
std::vector<Mat<S>> run_every_kernel(const Map& phi, const Inputs<S>& in, Index H,
                                     const std::vector<Index>& q_off,
                                     const std::vector<Index>& k_off, const ParallelOptions& par) {
  const Index N = in.Q.rows(), HM = in.V.cols();
  MultiHeadWorkspace<S> ws;
  std::vector<Mat<S>> outs;
  Mat<S> out(N, HM);
  linattn::multihead_linear_attention(in.Q, in.K, in.V, H, phi, out, ws, par);
  outs.push_back(out);
  outs.push_back(linattn::multihead_linear_attention(in.Q, in.K, in.V, H, phi, par));
  const Mat<S> Kc = in.K.topRows(N), Vc = in.V.topRows(N);  // plain matrices: fewer instantiations
  for (const CausalOptions& opts : all_causal_options()) {
    linattn::multihead_causal_linear_attention(in.Q, Kc, Vc, H, phi, out, ws, opts, par);
    outs.push_back(out);
    outs.push_back(linattn::multihead_causal_linear_attention(in.Q, Kc, Vc, H, phi, opts, par));
    linattn::batched_causal_linear_attention(in.Q, Kc, Vc, q_off, H, phi, out, ws, opts, par);
    outs.push_back(out);
  }
  linattn::batched_linear_attention(in.Q, in.K, in.V, q_off, k_off, H, phi, out, ws, par);
  outs.push_back(out);
  linattn::multihead_softmax_attention(in.Q, in.K, in.V, H, out, ws, SoftmaxAlgorithm::Tiled, par);
  outs.push_back(out);
  outs.push_back(
      linattn::multihead_softmax_attention(in.Q, in.K, in.V, H, SoftmaxAlgorithm::Tiled, par));
  linattn::multihead_causal_softmax_attention(in.Q, Kc, Vc, H, out, ws, SoftmaxAlgorithm::Tiled,
                                              par);
  outs.push_back(out);
  outs.push_back(
      linattn::multihead_causal_softmax_attention(in.Q, Kc, Vc, H, SoftmaxAlgorithm::Tiled, par));
  return outs;
}

// Eigen's own products run on one thread here (outside the kernels' parallel regions Eigen
// could otherwise split a GEMM over threads, with blocking sizes of its own): the comparison is
// about ParallelOptions only, whatever OMP_NUM_THREADS says.
template <class S, class Map>
void check_thread_counts(const Map& phi) {
  const EigenThreads one(1);
  const std::string tag = tag_of<S, Map>("threads");
  // 5 heads, 4 sequences (one empty): 20 tasks, not a multiple of 2 or 3 threads.
  const MhShape sh{5, 150, 170, 8, 6};
  const Inputs<S> in = make_inputs<S>(sh, 60);
  const std::vector<Index> q_off = {0, 70, 70, 131, 150}, k_off = {0, 100, 101, 101, 170};
  const std::vector<Mat<S>> serial = run_every_kernel(phi, in, sh.H, q_off, k_off, threads(1));
  for (const int t : {2, 3, 0}) {
    const std::vector<Mat<S>> parallel = run_every_kernel(phi, in, sh.H, q_off, k_off, threads(t));
    ASSERT_EQ(parallel.size(), serial.size());
    for (std::size_t i = 0; i < serial.size(); ++i)
      EXPECT_EQ(test::max_abs_diff(parallel[i], serial[i]), 0.0)
          << tag << " call " << i << ": num_threads = " << t << " differs from num_threads = 1";
  }
}

TEST(MultiHeadThreads, ThreadCountsGiveBitwiseIdenticalResults) {
#ifdef _OPENMP
  std::cout << "[ info     ] OpenMP on, omp_get_max_threads() = " << omp_get_max_threads()
            << std::endl;
#else
  std::cout << "[ info     ] OpenMP off: every thread count runs serially" << std::endl;
#endif
  IF_FLOAT(check_thread_counts<float>(EluPlusOne{}));
  IF_DOUBLE(check_thread_counts<double>(SoftmaxSplit{}));
}

using linattn_test::TeamRecordingMap;

// num_threads is honoured: 1 runs outside any parallel region, 2 in a team of 2 (OpenMP only).
TEST(MultiHeadThreads, NumThreadsIsHonoured) {
#ifdef _OPENMP
  if (omp_get_dynamic() || omp_get_thread_limit() < 2)
    GTEST_SKIP() << "OMP_DYNAMIC or OMP_THREAD_LIMIT may shrink a team of 2 threads";
#endif
  const MhShape sh{4, 50, 50, 3, 2};
  const Inputs<float> in = make_inputs<float>(sh, 61);
  linattn_test::largest_team() = 0;
  const Mat<float> one =
      linattn::multihead_linear_attention(in.Q, in.K, in.V, sh.H, TeamRecordingMap{}, threads(1));
  EXPECT_EQ(linattn_test::largest_team().load(), 1) << "num_threads = 1 ran in a parallel team";
  linattn_test::largest_team() = 0;
  const Mat<float> two =
      linattn::multihead_linear_attention(in.Q, in.K, in.V, sh.H, TeamRecordingMap{}, threads(2));
#ifdef _OPENMP
  EXPECT_EQ(linattn_test::largest_team().load(), 2)
      << "num_threads = 2 did not run in a team of 2 threads";
#else
  EXPECT_EQ(linattn_test::largest_team().load(), 1);
#endif
  EXPECT_EQ(test::max_abs_diff(one, two), 0.0);
  // A user map through the reference too (generic, pair by pair).
  for (Index h = 0; h < sh.H; ++h) {
    const MatD expected = ref::linear_attention(
        qk_head(in.Q, h, sh.D).cast<double>(), qk_head(in.K, h, sh.D).cast<double>(),
        in.V.middleCols(h * sh.M, sh.M).cast<double>(), TeamRecordingMap{});
    EXPECT_LE(test::max_abs_diff(one.middleCols(h * sh.M, sh.M), expected),
              test::tolerance<float>(3.0))
        << h;
  }
}

// ---------------------------------------------------------------------------------------------
// 3. Layouts: Maps over user buffers, row-major storage, blocks of larger matrices
// ---------------------------------------------------------------------------------------------

// Runs kernel `kernel` (0 linear, 1 causal linear, 2 softmax, 3 causal softmax) into `out`.
template <class Map, class DQ, class DK, class DV, class DOut>
void run_into(int kernel, const Map& phi, const Eigen::MatrixBase<DQ>& Q,
              const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V, Index H,
              const Eigen::MatrixBase<DOut>& out, MultiHeadWorkspace<typename DQ::Scalar>& ws,
              const CausalOptions& opts) {
  switch (kernel) {
    case 0:
      linattn::multihead_linear_attention(Q, K, V, H, phi, out, ws);
      break;
    case 1:
      linattn::multihead_causal_linear_attention(Q, K, V, H, phi, out, ws, opts);
      break;
    case 2:
      linattn::multihead_softmax_attention(Q, K, V, H, out, ws);
      break;
    default:
      linattn::multihead_causal_softmax_attention(Q, K, V, H, out, ws);
      break;
  }
}

// The same kernel, head by head through the single-head kernels, on the same expressions'
// column blocks.
template <class Map, class DQ, class DK, class DV>
Mat<typename DQ::Scalar> run_per_head(int kernel, const Map& phi, const Eigen::MatrixBase<DQ>& Q,
                                      const Eigen::MatrixBase<DK>& K,
                                      const Eigen::MatrixBase<DV>& V, Index H,
                                      const CausalOptions& opts) {
  const Index D = Q.cols() / H, M = V.cols() / H;
  Mat<typename DQ::Scalar> out(Q.rows(), V.cols());
  for (Index h = 0; h < H; ++h) {
    const auto Qh = Q.middleCols(h * D, D);
    const auto Kh = K.middleCols(h * D, D);
    const auto Vh = V.middleCols(h * M, M);
    switch (kernel) {
      case 0:
        out.middleCols(h * M, M) = linattn::linear_attention(Qh, Kh, Vh, phi);
        break;
      case 1:
        out.middleCols(h * M, M) = linattn::causal_linear_attention(Qh, Kh, Vh, phi, opts);
        break;
      case 2:
        out.middleCols(h * M, M) = linattn::softmax_attention(Qh, Kh, Vh);
        break;
      default:
        out.middleCols(h * M, M) = linattn::causal_softmax_attention(Qh, Kh, Vh);
        break;
    }
  }
  return out;
}

template <class S, class Map>
void check_layouts(const Map& phi) {
  const std::string tag = tag_of<S, Map>("layouts");
  const MhShape sh{3, 140, 140, 5, 4};  // N == L so that the causal kernels run too
  const Index H = sh.H, N = sh.N, L = sh.L, HD = H * sh.D, HM = H * sh.M;
  const Inputs<S> in = make_inputs<S>(sh, 70);
  // Row-major copies.
  const RowMat<S> Qr = in.Q, Kr = in.K, Vr = in.V;
  // Maps over user buffers (column-major and row-major).
  std::vector<S> qbuf(in.Q.data(), in.Q.data() + in.Q.size());
  std::vector<S> kbuf(Kr.data(), Kr.data() + Kr.size());
  std::vector<S> vbuf(in.V.data(), in.V.data() + in.V.size());
  const Eigen::Map<const Mat<S>> Qm(qbuf.data(), N, HD);
  const Eigen::Map<const RowMat<S>> Km(kbuf.data(), L, HD);
  const Eigen::Map<const Mat<S>> Vm(vbuf.data(), L, HM);
  // Blocks of larger matrices (rows and columns around them).
  Mat<S> bigQ = Mat<S>::Constant(N + 3, HD + 4, S(9)), bigK = Mat<S>::Constant(L + 1, HD + 2, S(9));
  RowMat<S> bigV = RowMat<S>::Constant(L + 2, HM + 3, S(9));
  bigQ.block(2, 3, N, HD) = in.Q;
  bigK.block(1, 0, L, HD) = in.K;
  bigV.block(0, 1, L, HM) = in.V;
  const auto Qb = bigQ.block(2, 3, N, HD);
  const auto Kb = bigK.block(1, 0, L, HD);
  const auto Vb = bigV.block(0, 1, L, HM);

  const CausalOptions opts = causal_options(CausalAlgorithm::Recurrent, 0);
  for (int kernel = 0; kernel < 4; ++kernel) {
    const std::string where = tag + " kernel " + std::to_string(kernel);
    MultiHeadWorkspace<S> ws;
    Mat<S> base(N, HM);
    run_into(kernel, phi, in.Q, in.K, in.V, H, base, ws, opts);

    // Inputs: row-major storage, Maps over user buffers (column- and row-major), blocks of
    // larger matrices (column- and row-major), each operand in each layout once. Each equals
    // the per-head single-head calls on the same expressions exactly, and the column-major
    // result to rounding.
    const auto check_inputs = [&](const auto& Qx, const auto& Kx, const auto& Vx,
                                  const char* layouts) {
      Mat<S> out(N, HM);
      run_into(kernel, phi, Qx, Kx, Vx, H, out, ws, opts);
      EXPECT_EQ(test::max_abs_diff(out, run_per_head(kernel, phi, Qx, Kx, Vx, H, opts)), 0.0)
          << where << " " << layouts;
      EXPECT_LE(test::max_abs_diff(out, base), tight_tol<S>(3.0)) << where << " " << layouts;
    };
    check_inputs(Qr, Km, Vb, "Q row-major, K row-major Map, V block of a row-major matrix");
    check_inputs(Qm, Kb, Vr, "Q Map, K block, V row-major");
    check_inputs(Qb, Kr, Vm, "Q block, K row-major, V Map");
    // Outputs: a block of a larger column-major matrix, whose surroundings stay untouched, and
    // a row-major Map over a user buffer.
    {
      Mat<S> big = Mat<S>::Constant(N + 4, HM + 3, S(7));
      run_into(kernel, phi, in.Q, in.K, in.V, H, big.block(2, 1, N, HM), ws, opts);
      EXPECT_LE(test::max_abs_diff(big.block(2, 1, N, HM), base), tight_tol<S>(3.0))
          << where << " into a block";
      Mat<S> around = big;
      around.block(2, 1, N, HM).setConstant(S(7));
      EXPECT_EQ(test::max_abs_diff(around, Mat<S>::Constant(N + 4, HM + 3, S(7))), 0.0)
          << where << ": entries around the output block were written";
    }
    {
      std::vector<S> obuf(static_cast<std::size_t>(N * HM + 5), S(7));
      Eigen::Map<RowMat<S>> out(obuf.data() + 2, N, HM);
      run_into(kernel, phi, in.Q, in.K, in.V, H, out, ws, opts);
      EXPECT_LE(test::max_abs_diff(out, base), tight_tol<S>(3.0))
          << where << " into a row-major Map";
      EXPECT_EQ(obuf[0], S(7));
      EXPECT_EQ(obuf[1], S(7));
      EXPECT_EQ(obuf[obuf.size() - 3], S(7));
      EXPECT_EQ(obuf.back(), S(7));
    }
  }
}

TEST(MultiHeadLayouts, MapsRowMajorAndBlocks) {
  IF_FLOAT(check_layouts<float>(EluPlusOne{}));
  IF_DOUBLE(check_layouts<double>(SoftmaxSplit{}));
}

// ---------------------------------------------------------------------------------------------
// 4. Batched variable-length sequences
// ---------------------------------------------------------------------------------------------

template <class S, class Map>
void check_batched_linear(const Map& phi) {
  const std::string tag = tag_of<S, Map>("batched_linear_attention");
  const Index H = 3, D = 5, M = 4;
  // Sequence lengths (queries, keys): an ordinary one, no queries, no keys, single rows, and
  // one across the 128-row block.
  const std::vector<Index> n = {5, 0, 130, 1, 64, 9}, l = {7, 3, 0, 1, 65, 200};
  std::vector<Index> q_off = {0}, k_off = {0};
  for (std::size_t b = 0; b < n.size(); ++b) {
    q_off.push_back(q_off.back() + n[b]);
    k_off.push_back(k_off.back() + l[b]);
  }
  const Index N = q_off.back(), L = k_off.back();
  const Mat<S> Q = test::random_matrix<S>(N, H * D, 80, -2, 2),
               K = test::random_matrix<S>(L, H * D, 81, -2, 2);
  const Mat<S> V = test::random_matrix<S>(L, H * M, 82, -3, 3);
  MultiHeadWorkspace<S> ws;
  Mat<S> out = Mat<S>::Constant(N, H * M, S(7));
  linattn::batched_linear_attention(Q, K, V, q_off, k_off, H, phi, out, ws);
  double worst = 0;
  for (std::size_t b = 0; b < n.size(); ++b) {
    const Index q0 = q_off[b], k0 = k_off[b];
    for (Index h = 0; h < H; ++h) {
      const auto Qs = Q.block(q0, h * D, n[b], D);
      const auto Ks = K.block(k0, h * D, l[b], D);
      const auto Vs = V.block(k0, h * M, l[b], M);
      const auto got = out.block(q0, h * M, n[b], M);
      EXPECT_EQ(test::max_abs_diff(got, linattn::linear_attention(Qs, Ks, Vs, phi)), 0.0)
          << tag << " sequence " << b << " head " << h;
      if (l[b] == 0) {
        EXPECT_EQ(test::max_abs(got), 0.0) << tag << " sequence " << b << " has no keys: zero rows";
        continue;
      }
      ref::Vec den;
      const MatD expected =
          ref::linear_attention(Qs.template cast<double>(), Ks.template cast<double>(),
                                Vs.template cast<double>(), phi, &den);
      const double e = reference_error<Map>(got, expected, den, false, l[b], test::max_abs(Vs));
      EXPECT_LE(e, test::tolerance<S>(3.0)) << tag << " sequence " << b << " head " << h;
      worst = std::max(worst, e);
    }
  }
  test::report_error(tag + " vs reference", worst);
}

TEST(MultiHeadBatched, LinearEqualsPerSequencePerHeadCalls) {
  IF_FLOAT(check_batched_linear<float>(EluPlusOne{}));
  IF_DOUBLE(check_batched_linear<double>(EluPlusOne{}));
  IF_FLOAT(check_batched_linear<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_batched_linear<double>(SoftmaxSplit{}));
  IF_FLOAT(check_batched_linear<float>(NormalizedCosine{}));
  IF_DOUBLE(check_batched_linear<double>(NormalizedCosine{}));
}

template <class S, class Map>
void check_batched_causal(const Map& phi) {
  const std::string tag = tag_of<S, Map>("batched_causal_linear_attention");
  const Index H = 3, D = 5, M = 4;
  const std::vector<Index> n = {5, 0, 130, 1, 64, 0};  // empty sequences, also the last one
  std::vector<Index> off = {0};
  for (const Index len : n) off.push_back(off.back() + len);
  const Index N = off.back();
  const Mat<S> Q = test::random_matrix<S>(N, H * D, 90, -2, 2),
               K = test::random_matrix<S>(N, H * D, 91, -2, 2);
  const Mat<S> V = test::random_matrix<S>(N, H * M, 92, -3, 3);
  MultiHeadWorkspace<S> ws;
  double worst = 0;
  for (const CausalOptions& opts : all_causal_options()) {
    const std::string where = tag + " " + options_name(opts);
    Mat<S> out(N, H * M);
    linattn::batched_causal_linear_attention(Q, K, V, off, H, phi, out, ws, opts);
    for (std::size_t b = 0; b < n.size(); ++b) {
      const Index r0 = off[b];
      for (Index h = 0; h < H; ++h) {
        const auto Qs = Q.block(r0, h * D, n[b], D);
        const auto Ks = K.block(r0, h * D, n[b], D);
        const auto Vs = V.block(r0, h * M, n[b], M);
        const auto got = out.block(r0, h * M, n[b], M);
        // Each sequence starts from an empty state (nothing carried over from the previous one).
        // A few ulps: see CausalLinearEqualsPerHeadCallsAndReference.
        EXPECT_LE(test::max_abs_diff(got, linattn::causal_linear_attention(Qs, Ks, Vs, phi, opts)),
                  4 * test::Tol<S>::ulps)
            << where << " sequence " << b << " head " << h;
        if (n[b] == 0) continue;
        ref::Vec den;
        const MatD expected =
            ref::causal_linear_attention(Qs.template cast<double>(), Ks.template cast<double>(),
                                         Vs.template cast<double>(), phi, &den);
        const double e = reference_error<Map>(got, expected, den, true, n[b], test::max_abs(Vs));
        EXPECT_LE(e, test::tolerance<S>(3.0)) << where << " sequence " << b << " head " << h;
        worst = std::max(worst, e);
      }
    }
  }
  test::report_error(tag + " vs reference", worst);
}

TEST(MultiHeadBatched, CausalEqualsPerSequencePerHeadCalls) {
  IF_FLOAT(check_batched_causal<float>(EluPlusOne{}));
  IF_DOUBLE(check_batched_causal<double>(EluPlusOne{}));
  IF_FLOAT(check_batched_causal<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_batched_causal<double>(SoftmaxSplit{}));
  IF_FLOAT(check_batched_causal<float>(NormalizedCosine{}));
  IF_DOUBLE(check_batched_causal<double>(NormalizedCosine{}));
}

// One sequence spanning every row is the multi-head kernel; no sequence at all (offsets {0},
// no rows) and only empty sequences are valid.
TEST(MultiHeadBatched, OneSequenceAndEmptyBatches) {
  const MhShape sh{2, 77, 77, 6, 3};
  const Inputs<float> in = make_inputs<float>(sh, 93);
  MultiHeadWorkspace<float> ws;
  Mat<float> out(sh.N, sh.H * sh.M);
  linattn::batched_linear_attention(in.Q, in.K, in.V, {0, sh.N}, {0, sh.L}, sh.H, EluPlusOne{}, out,
                                    ws);
  EXPECT_EQ(test::max_abs_diff(out, linattn::multihead_linear_attention(in.Q, in.K, in.V, sh.H)),
            0.0);
  linattn::batched_causal_linear_attention(in.Q, in.K, in.V, {0, sh.N}, sh.H, EluPlusOne{}, out,
                                           ws);
  EXPECT_EQ(
      test::max_abs_diff(out, linattn::multihead_causal_linear_attention(in.Q, in.K, in.V, sh.H)),
      0.0);

  const Mat<float> Q0(0, 12), K0(0, 12), V0(0, 6);
  Mat<float> out0(0, 6);
  EXPECT_NO_THROW(
      linattn::batched_linear_attention(Q0, K0, V0, {0}, {0}, 2, EluPlusOne{}, out0, ws));
  EXPECT_NO_THROW(
      linattn::batched_causal_linear_attention(Q0, K0, V0, {0}, 2, EluPlusOne{}, out0, ws));
  EXPECT_NO_THROW(linattn::batched_causal_linear_attention(Q0, K0, V0, {0, 0, 0}, 2, EluPlusOne{},
                                                           out0, ws, CausalOptions{}, threads(2)));
  // Queries but no keys in every sequence: zero rows.
  const Mat<float> Q = test::random_matrix<float>(4, 12, 94);
  Mat<float> out4 = Mat<float>::Constant(4, 6, 7.0f);
  linattn::batched_linear_attention(Q, K0, V0, {0, 1, 4}, {0, 0, 0}, 2, SoftmaxSplit{}, out4, ws,
                                    threads(2));
  EXPECT_EQ(test::max_abs(out4), 0.0);
}

// ---------------------------------------------------------------------------------------------
// 5. MultiHeadRecurrentLinearAttention
// ---------------------------------------------------------------------------------------------

template <class S, class Map>
void check_recurrent(const Map& phi) {
  const std::string tag = tag_of<S, Map>("MultiHeadRecurrentLinearAttention");
  const Index H = 3, N = 150, D = 5, M = 4;
  const MhShape sh{H, N, N, D, M};
  const Inputs<S> in = make_inputs<S>(sh, 100);
  const Mat<S> parallel = linattn::multihead_causal_linear_attention(in.Q, in.K, in.V, H, phi);

  MultiHeadRecurrentLinearAttention<Map, S> rnn(H, D, M, phi);
  EXPECT_EQ(rnn.heads(), H);
  EXPECT_EQ(rnn.key_dim(), D);
  EXPECT_EQ(rnn.value_dim(), M);
  // Independent single-head RNNs fed with each head's segment: step() must equal them exactly.
  std::vector<linattn::RecurrentLinearAttention<Map, S>> single;
  for (Index h = 0; h < H; ++h) single.emplace_back(D, M, phi);

  Mat<S> steps(N, H * M);
  Vec<S> out(H * M);
  double worst = 0;
  for (Index i = 0; i < N; ++i) {
    if (i % 2 == 0) {
      rnn.step(in.Q.row(i), in.K.row(i), in.V.row(i), out);  // strided rows into a vector
      steps.row(i) = out.transpose();
    } else {
      steps.row(i) = rnn.step(in.Q.row(i), in.K.row(i), in.V.row(i)).transpose();  // returning
    }
    for (Index h = 0; h < H; ++h) {
      const Vec<S> o = single[static_cast<std::size_t>(h)].step(in.Q.row(i).segment(h * D, D),
                                                                in.K.row(i).segment(h * D, D),
                                                                in.V.row(i).segment(h * M, M));
      EXPECT_EQ(test::max_abs_diff(steps.row(i).segment(h * M, M), o.transpose()), 0.0)
          << tag << " step " << i << " head " << h << " vs RecurrentLinearAttention";
    }
    worst = std::max(worst, test::max_abs_diff(steps.row(i), parallel.row(i)));
  }
  EXPECT_LE(worst, tight_tol<S>(3.0)) << tag << " steps vs multihead_causal_linear_attention";
  test::report_error(tag + " steps vs multihead_causal_linear_attention", worst);

  // head(h): each head's position and state equal the parallel form's.
  for (Index h = 0; h < H; ++h) {
    EXPECT_EQ(rnn.head(h).position(), N);
    linattn::LinearAttentionState<S> st;
    linattn::causal_linear_attention(qk_head(in.Q, h, D), qk_head(in.K, h, D),
                                     in.V.middleCols(h * M, M), phi, st);
    const auto& hs =
        static_cast<const MultiHeadRecurrentLinearAttention<Map, S>&>(rnn).head(h).state();
    EXPECT_LE(test::max_abs_diff(hs.S, st.S), tight_tol<S>(test::max_abs(st.S)))
        << tag << " head " << h;
    EXPECT_LE(test::max_abs_diff(hs.z, st.z), tight_tol<S>(test::max_abs(st.z)))
        << tag << " head " << h;
    EXPECT_EQ(test::max_abs_diff(hs.m, st.m), 0.0) << tag << " head " << h;
  }
  EXPECT_THROW(rnn.head(H), std::out_of_range);
  EXPECT_THROW(rnn.head(-1), std::out_of_range);

  // reset(): the same tokens again give the same outputs, bit for bit (tokens as contiguous
  // columns this time, outputs into the strided rows of a matrix).
  rnn.reset();
  for (Index h = 0; h < H; ++h) EXPECT_EQ(rnn.head(h).position(), 0);
  const Mat<S> Qt = in.Q.transpose(), Kt = in.K.transpose(), Vt = in.V.transpose();
  Mat<S> again(N, H * M);
  for (Index i = 0; i < N; ++i) rnn.step(Qt.col(i), Kt.col(i), Vt.col(i), again.row(i));
  EXPECT_EQ(test::max_abs_diff(again, steps), 0.0) << tag << ": reset() does not start over";

  // Prefill every head in parallel, hand the states over with head(h).set_state(), step on.
  const Index P = 100;
  rnn.reset();
  for (Index h = 0; h < H; ++h) {
    linattn::LinearAttentionState<S> st;
    linattn::causal_linear_attention(in.Q.block(0, h * D, P, D), in.K.block(0, h * D, P, D),
                                     in.V.block(0, h * M, P, M), phi, st);
    rnn.head(h).set_state(st, P);
  }
  double worst_handover = 0;
  for (Index i = P; i < N; ++i) {
    rnn.step(in.Q.row(i), in.K.row(i), in.V.row(i), out);
    worst_handover = std::max(worst_handover, test::max_abs_diff(out.transpose(), parallel.row(i)));
  }
  EXPECT_LE(worst_handover, tight_tol<S>(3.0)) << tag << " prefill then steps";
}

TEST(MultiHeadRecurrent, StepsEqualParallelAndSingleHeads) {
  IF_FLOAT(check_recurrent<float>(EluPlusOne{}));
  IF_DOUBLE(check_recurrent<double>(EluPlusOne{}));
  IF_FLOAT(check_recurrent<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_recurrent<double>(SoftmaxSplit{}));
  IF_FLOAT(check_recurrent<float>(NormalizedCosine{}));
  IF_DOUBLE(check_recurrent<double>(NormalizedCosine{}));
}

using test::allocations_in;
using test::Allocations;

TEST(MultiHeadNoAlloc, TheDetectorsWork) {
  const Allocations eigen = allocations_in([] {
    Eigen::MatrixXf m(100, 100);
    m.setZero();
  });
  EXPECT_GE(eigen.eigen, 1) << "is EIGEN_RUNTIME_NO_MALLOC defined before every Eigen header?";
  const Allocations vec = allocations_in([] {
    std::vector<int> v(1000, 1);
    EXPECT_EQ(v.size(), 1000u);
  });
  EXPECT_GE(vec.news, 1) << "operator new is not counted";
  const Allocations none = allocations_in([] {});
  EXPECT_EQ(none.eigen, 0);
  EXPECT_EQ(none.news, 0);
}

template <class S, class Map>
void check_step_no_alloc(const Map& phi) {
  const std::string tag = tag_of<S, Map>("MultiHeadRecurrentLinearAttention::step");
  const Index H = 4, N = 300, D = 16, M = 12;
  const Inputs<S> in = make_inputs<S>({H, N, N, D, M}, 110);
  const RowMat<S> Qr = in.Q, Kr = in.K, Vr = in.V;
  MultiHeadRecurrentLinearAttention<Map, S> rnn(H, D, M, phi);
  Vec<S> out(H * M);
  Mat<S> outs(N, H * M);
  const Allocations a = allocations_in([&] {
    for (Index i = 0; i < N; ++i) {
      if (i % 2 == 0)
        rnn.step(in.Q.row(i), in.K.row(i), in.V.row(i), out);  // strided rows
      else
        rnn.step(Qr.row(i), Kr.row(i), Vr.row(i), out);  // contiguous rows
      outs.row(i) = out.transpose();
    }
  });
  EXPECT_EQ(a.eigen, 0) << tag << ": Eigen heap allocations";
  EXPECT_EQ(a.news, 0) << tag << ": operator new calls";
  EXPECT_LE(test::max_abs_diff(
                outs, linattn::multihead_causal_linear_attention(in.Q, in.K, in.V, H, phi)),
            tight_tol<S>(3.0))
      << tag;
}

TEST(MultiHeadRecurrent, StepAllocatesNothing) {
  IF_FLOAT(check_step_no_alloc<float>(EluPlusOne{}));
  IF_DOUBLE(check_step_no_alloc<double>(EluPlusOne{}));
  IF_FLOAT(check_step_no_alloc<float>(SoftmaxSplit{}));
  IF_FLOAT(check_step_no_alloc<float>(NormalizedCosine{}));
}

// ---------------------------------------------------------------------------------------------
// 6. Zero allocation of the out + MultiHeadWorkspace overloads on a second call
// ---------------------------------------------------------------------------------------------

const MhShape kNoAllocShapes[] = {{2, 7, 5, 3, 2}, {3, 300, 257, 16, 8}};

// Calls `call(inputs)` once to size the workspace, then with other inputs of the same shape
// under the allocation detectors; returns the allocations of the second call. The results of
// the second call must equal a fresh call's (`fresh`).
template <class S, class Call, class Fresh>
Allocations second_call(const MhShape& sh, bool causal, MultiHeadWorkspace<S>& ws, Mat<S>& out,
                        const Call& call, const Fresh& fresh, const std::string& where) {
  const MhShape s = causal ? MhShape{sh.H, sh.N, sh.N, sh.D, sh.M} : sh;
  const Inputs<S> a = make_inputs<S>(s, 120), b = make_inputs<S>(s, 121);
  out.resize(s.N, s.H * s.M);
  call(a);
  const std::size_t bytes = ws.bytes();
  const Allocations alloc = allocations_in([&] { call(b); });
  EXPECT_EQ(ws.bytes(), bytes) << where << " " << s << ": the workspace grew on the second call";
  EXPECT_EQ(test::max_abs_diff(out, fresh(b)), 0.0)
      << where << " " << s << ": stale workspace state";
  return alloc;
}

template <class S>
void check_softmax_no_alloc() {
  const EigenThreads one(1);
  for (const MhShape& sh : kNoAllocShapes) {
    for (const bool causal : {false, true}) {
      const std::string where = std::string(causal ? "multihead_causal_softmax_attention/"
                                                   : "multihead_softmax_attention/") +
                                test::scalar_name<S>();
      MultiHeadWorkspace<S> ws;
      Mat<S> out;
      const Allocations a = second_call<S>(
          sh, causal, ws, out,
          [&](const Inputs<S>& x) {
            if (causal)
              linattn::multihead_causal_softmax_attention(x.Q, x.K, x.V, sh.H, out, ws,
                                                          SoftmaxAlgorithm::Tiled, threads(1));
            else
              linattn::multihead_softmax_attention(x.Q, x.K, x.V, sh.H, out, ws,
                                                   SoftmaxAlgorithm::Tiled, threads(1));
          },
          [&](const Inputs<S>& x) -> Mat<S> {
            return causal ? linattn::multihead_causal_softmax_attention(x.Q, x.K, x.V, sh.H)
                          : linattn::multihead_softmax_attention(x.Q, x.K, x.V, sh.H);
          },
          where);
      EXPECT_EQ(a.eigen, 0) << where << " " << sh << ": Eigen heap allocations on the second call";
      EXPECT_EQ(a.news, 0) << where << " " << sh << ": operator new calls on the second call";
    }
  }
}

TEST(MultiHeadNoAlloc, SoftmaxSecondCallAllocatesNothing) {
  IF_FLOAT(check_softmax_no_alloc<float>());
  IF_DOUBLE(check_softmax_no_alloc<double>());
}

template <class S, class Map>
void check_linear_no_alloc(const Map& phi) {
  const EigenThreads one(1);
  for (const MhShape& sh : kNoAllocShapes) {
    const std::string where = tag_of<S, Map>("multihead_linear_attention");
    MultiHeadWorkspace<S> ws;
    Mat<S> out;
    const Allocations a = second_call<S>(
        sh, false, ws, out,
        [&](const Inputs<S>& x) {
          linattn::multihead_linear_attention(x.Q, x.K, x.V, sh.H, phi, out, ws, threads(1));
        },
        [&](const Inputs<S>& x) -> Mat<S> {
          return linattn::multihead_linear_attention(x.Q, x.K, x.V, sh.H, phi);
        },
        where);
    EXPECT_EQ(a.eigen, 0) << where << " " << sh << ": Eigen heap allocations on the second call";
    EXPECT_EQ(a.news, 0) << where << " " << sh << ": operator new calls on the second call";

    // batched_linear_attention with the caller's offsets (two sequences).
    const std::string bwhere = tag_of<S, Map>("batched_linear_attention");
    const std::vector<Index> q_off = {0, sh.N / 2, sh.N}, k_off = {0, sh.L / 3, sh.L};
    const Allocations b = second_call<S>(
        sh, false, ws, out,
        [&](const Inputs<S>& x) {
          linattn::batched_linear_attention(x.Q, x.K, x.V, q_off, k_off, sh.H, phi, out, ws,
                                            threads(1));
        },
        [&](const Inputs<S>& x) -> Mat<S> {
          MultiHeadWorkspace<S> w;
          Mat<S> o(x.Q.rows(), x.V.cols());
          linattn::batched_linear_attention(x.Q, x.K, x.V, q_off, k_off, sh.H, phi, o, w);
          return o;
        },
        bwhere);
    EXPECT_EQ(b.eigen, 0) << bwhere << " " << sh << ": Eigen heap allocations on the second call";
    EXPECT_EQ(b.news, 0) << bwhere << " " << sh << ": operator new calls on the second call";
  }
}

// Regression test: before 37edeed multihead_linear_attention forwarded to
// batched_linear_attention with two temporary std::vector<Index> offsets, {0, Q.rows()} and
// {0, K.rows()}: 2 operator new calls on every call, reused workspace or not.
TEST(MultiHeadNoAlloc, LinearSecondCallAllocatesNothing) {
  IF_FLOAT(check_linear_no_alloc<float>(EluPlusOne{}));
  IF_DOUBLE(check_linear_no_alloc<double>(EluPlusOne{}));
  IF_FLOAT(check_linear_no_alloc<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_linear_no_alloc<double>(SoftmaxSplit{}));
  IF_FLOAT(check_linear_no_alloc<float>(NormalizedCosine{}));
  IF_DOUBLE(check_linear_no_alloc<double>(NormalizedCosine{}));
}

template <class S, class Map>
void check_causal_no_alloc(const Map& phi) {
  const EigenThreads one(1);
  for (const MhShape& sh : kNoAllocShapes) {
    for (const CausalOptions& opts : all_causal_options()) {
      const std::string where =
          tag_of<S, Map>("multihead_causal_linear_attention") + " " + options_name(opts);
      MultiHeadWorkspace<S> ws;
      Mat<S> out;
      const Allocations a = second_call<S>(
          sh, true, ws, out,
          [&](const Inputs<S>& x) {
            linattn::multihead_causal_linear_attention(x.Q, x.K, x.V, sh.H, phi, out, ws, opts,
                                                       threads(1));
          },
          [&](const Inputs<S>& x) -> Mat<S> {
            return linattn::multihead_causal_linear_attention(x.Q, x.K, x.V, sh.H, phi, opts);
          },
          where);
      EXPECT_EQ(a.eigen, 0) << where << " " << sh << ": Eigen heap allocations on the second call";
      EXPECT_EQ(a.news, 0) << where << " " << sh << ": operator new calls on the second call";

      const std::string bwhere =
          tag_of<S, Map>("batched_causal_linear_attention") + " " + options_name(opts);
      const std::vector<Index> off = {0, sh.N / 2, sh.N};
      const Allocations b = second_call<S>(
          sh, true, ws, out,
          [&](const Inputs<S>& x) {
            linattn::batched_causal_linear_attention(x.Q, x.K, x.V, off, sh.H, phi, out, ws, opts,
                                                     threads(1));
          },
          [&](const Inputs<S>& x) -> Mat<S> {
            MultiHeadWorkspace<S> w;
            Mat<S> o(x.Q.rows(), x.V.cols());
            linattn::batched_causal_linear_attention(x.Q, x.K, x.V, off, sh.H, phi, o, w, opts);
            return o;
          },
          bwhere);
      EXPECT_EQ(b.eigen, 0) << bwhere << " " << sh << ": Eigen heap allocations on the second call";
      EXPECT_EQ(b.news, 0) << bwhere << " " << sh << ": operator new calls on the second call";
    }
  }
}

// Regression test: before 37edeed batched_causal_linear_attention (and so
// multihead_causal_linear_attention) built a fresh LinearAttentionState with make_state() inside
// every (sequence, head) task: 2 Eigen heap allocations per task (S and z; 3 with SoftmaxSplit's
// maxima m) on every call, e.g. 6 for H = 3; multihead_causal_linear_attention also made 1
// operator new call (a temporary std::vector {0, Q.rows()} of offsets).
TEST(MultiHeadNoAlloc, CausalLinearSecondCallAllocatesNothing) {
  IF_FLOAT(check_causal_no_alloc<float>(EluPlusOne{}));
  IF_DOUBLE(check_causal_no_alloc<double>(EluPlusOne{}));
  IF_FLOAT(check_causal_no_alloc<float>(SoftmaxSplit{}));
  IF_DOUBLE(check_causal_no_alloc<double>(SoftmaxSplit{}));
  IF_FLOAT(check_causal_no_alloc<float>(NormalizedCosine{}));
}

TEST(MultiHeadNoAlloc, WorkspaceBytesAndThreads) {
  MultiHeadWorkspace<float> ws;
  EXPECT_EQ(ws.bytes(), 0u);
  ws.reserve_threads(3);
  EXPECT_EQ(ws.bytes(), 0u) << "reserve_threads allocates only the vector of workspaces";
  const Inputs<float> in = make_inputs<float>({2, 50, 40, 4, 3}, 130);
  Mat<float> out(50, 6);
  linattn::multihead_linear_attention(in.Q, in.K, in.V, 2, EluPlusOne{}, out, ws, threads(1));
  EXPECT_GT(ws.for_thread(0).bytes(), 0u);
  EXPECT_EQ(ws.for_thread(1).bytes(), 0u) << "num_threads = 1 uses thread 0's workspace only";
  EXPECT_EQ(ws.bytes(), ws.for_thread(0).bytes());
  ws.for_thread(5).matrix(0, 10, 10);  // creates workspaces up to 5
  EXPECT_EQ(ws.bytes(), ws.for_thread(0).bytes() + 100 * sizeof(float));
}

// ---------------------------------------------------------------------------------------------
// 7. Argument checks
// ---------------------------------------------------------------------------------------------

using MatF = Eigen::MatrixXf;

// One multi-head entry point: the name its messages must contain, whether it is causal, and a
// call on (Q, K, V, heads) writing into `out` (for the out + workspace forms).
struct Entry {
  std::string name;
  bool causal;
  bool writes_out;
  std::function<void(const MatF&, const MatF&, const MatF&, Index, MatF&)> call;
};

std::vector<Entry> entries() {
  static MultiHeadWorkspace<float> ws;
  std::vector<Entry> list;
  list.push_back({"linattn::multihead_linear_attention", false, true,
                  [](const MatF& Q, const MatF& K, const MatF& V, Index H, MatF& out) {
                    linattn::multihead_linear_attention(Q, K, V, H, EluPlusOne{}, out, ws);
                  }});
  list.push_back({"linattn::multihead_linear_attention", false, false,
                  [](const MatF& Q, const MatF& K, const MatF& V, Index H, MatF& out) {
                    out = linattn::multihead_linear_attention(Q, K, V, H, SoftmaxSplit{});
                  }});
  list.push_back({"linattn::multihead_causal_linear_attention", true, true,
                  [](const MatF& Q, const MatF& K, const MatF& V, Index H, MatF& out) {
                    linattn::multihead_causal_linear_attention(Q, K, V, H, EluPlusOne{}, out, ws);
                  }});
  list.push_back({"linattn::multihead_causal_linear_attention", true, false,
                  [](const MatF& Q, const MatF& K, const MatF& V, Index H, MatF& out) {
                    out =
                        linattn::multihead_causal_linear_attention(Q, K, V, H, NormalizedCosine{});
                  }});
  list.push_back({"linattn::multihead_softmax_attention", false, true,
                  [](const MatF& Q, const MatF& K, const MatF& V, Index H, MatF& out) {
                    linattn::multihead_softmax_attention(Q, K, V, H, out, ws);
                  }});
  list.push_back({"linattn::multihead_softmax_attention", false, false,
                  [](const MatF& Q, const MatF& K, const MatF& V, Index H, MatF& out) {
                    out = linattn::multihead_softmax_attention(Q, K, V, H, SoftmaxAlgorithm::Naive);
                  }});
  list.push_back({"linattn::multihead_causal_softmax_attention", true, true,
                  [](const MatF& Q, const MatF& K, const MatF& V, Index H, MatF& out) {
                    linattn::multihead_causal_softmax_attention(Q, K, V, H, out, ws);
                  }});
  list.push_back({"linattn::multihead_causal_softmax_attention", true, false,
                  [](const MatF& Q, const MatF& K, const MatF& V, Index H, MatF& out) {
                    out = linattn::multihead_causal_softmax_attention(Q, K, V, H);
                  }});
  list.push_back({"linattn::batched_linear_attention", false, true,
                  [](const MatF& Q, const MatF& K, const MatF& V, Index H, MatF& out) {
                    linattn::batched_linear_attention(Q, K, V, {0, Q.rows()}, {0, K.rows()}, H,
                                                      EluPlusOne{}, out, ws);
                  }});
  list.push_back(
      {"linattn::batched_causal_linear_attention", true, true,
       [](const MatF& Q, const MatF& K, const MatF& V, Index H, MatF& out) {
         linattn::batched_causal_linear_attention(Q, K, V, {0, Q.rows()}, H, EluPlusOne{}, out, ws);
       }});
  return list;
}

// A bad-shape case: inputs, heads, the output's shape, and what the message must contain.
struct BadCase {
  std::string what;
  MatF Q, K, V;
  Index H;
  Index out_rows, out_cols;
  std::vector<std::string> needles;
  bool causal_only = false;
};

std::vector<BadCase> bad_cases() {
  const auto m = [](Index r, Index c) { return MatF::Ones(r, c).eval(); };
  std::vector<BadCase> list = {
      {"heads == 0",
       m(6, 6),
       m(6, 6),
       m(6, 4),
       0,
       6,
       4,
       {"heads must be positive", "heads = 0", "Q is 6x6"}},
      {"heads < 0", m(6, 6), m(6, 6), m(6, 4), -2, 6, 4, {"heads must be positive", "heads = -2"}},
      {"Q columns not divisible by heads",
       m(6, 7),
       m(6, 7),
       m(6, 4),
       2,
       6,
       4,
       {"multiples of heads", "Q is 6x7", "heads = 2"}},
      {"V columns not divisible by heads",
       m(6, 6),
       m(6, 6),
       m(6, 5),
       2,
       6,
       5,
       {"multiples of heads", "V is 6x5"}},
      {"more heads than Q columns", m(6, 2), m(6, 2), m(6, 4), 4, 6, 4, {"multiples of heads"}},
      {"Q and K widths differ",
       m(6, 6),
       m(6, 4),
       m(6, 4),
       2,
       6,
       4,
       {"same number of columns", "Q is 6x6", "K is 6x4"}},
      {"K and V rows differ",
       m(6, 6),
       m(6, 6),
       m(5, 4),
       2,
       6,
       4,
       {"same number of rows", "V is 5x4"}},
      {"D == 0", m(6, 0), m(6, 0), m(6, 4), 2, 6, 4, {"D must be positive"}},
      {"N != L (causal)",
       m(5, 6),
       m(6, 6),
       m(6, 4),
       2,
       5,
       4,
       {"N == L", "Q is 5x6", "K is 6x6"},
       true},
  };
  return list;
}

void check_bad_shapes(const Entry& e) {
  for (const BadCase& c : bad_cases()) {
    if (c.causal_only && !e.causal) continue;
    std::vector<std::string> needles = c.needles;
    needles.push_back(e.name);
    MatF out = MatF::Constant(c.out_rows, c.out_cols, 7.0f);
    expect_invalid([&] { e.call(c.Q, c.K, c.V, c.H, out); }, needles,
                   e.name + (e.writes_out ? " (out)" : " (returning)") + ": " + c.what);
    if (e.writes_out) {
      EXPECT_EQ(test::max_abs_diff(out, MatF::Constant(c.out_rows, c.out_cols, 7.0f)), 0.0)
          << e.name << ": " << c.what << ": the output was written before the check";
    }
  }
  if (e.writes_out) {
    // A wrong output shape (Q is 6 x 6, V 6 x 4, heads 2: out must be 6 x 4).
    for (const auto& [r, c] : {std::pair<Index, Index>{6, 5}, {5, 4}, {6, 2}}) {
      MatF out = MatF::Constant(r, c, 7.0f);
      expect_invalid(
          [&] { e.call(MatF::Ones(6, 6), MatF::Ones(6, 6), MatF::Ones(6, 4), 2, out); },
          {"output is " + std::to_string(r) + "x" + std::to_string(c), "must be 6x4", e.name},
          e.name + ": out " + std::to_string(r) + "x" + std::to_string(c));
      EXPECT_EQ(test::max_abs_diff(out, MatF::Constant(r, c, 7.0f)), 0.0) << e.name;
    }
  }
}

// Every entry point throws std::invalid_argument naming itself, with the shapes in the message,
// and leaves its output untouched. Regression test: before 37edeed multihead_linear_attention
// and multihead_causal_linear_attention forwarded to the batched functions without checks of
// their own, so their messages named a function the caller never called
// ("linattn::batched_linear_attention: the columns of Q and V must be multiples of heads ...").
TEST(MultiHeadErrors, BadShapesThrowInvalidArgument) {
  for (const Entry& e : entries()) check_bad_shapes(e);
}

TEST(MultiHeadErrors, BadOffsetsThrowInvalidArgument) {
  const std::string fn = "linattn::batched_linear_attention",
                    cfn = "linattn::batched_causal_linear_attention";
  const MatF Q = MatF::Ones(6, 4), K = MatF::Ones(5, 4), V = MatF::Ones(5, 2);
  MultiHeadWorkspace<float> ws;
  MatF out = MatF::Constant(6, 2, 7.0f);
  using Off = std::vector<Index>;
  const auto batched = [&](const Off& q, const Off& k) {
    return
        [&, q, k] { linattn::batched_linear_attention(Q, K, V, q, k, 2, EluPlusOne{}, out, ws); };
  };
  // One thing wrong per call (so that the order of the checks does not matter).
  expect_invalid(batched({}, {}), {fn, "_offsets", "start at 0"}, "empty offsets");
  expect_invalid(batched({1, 6}, {0, 5}), {fn, "q_offsets", "start at 0"},
                 "q_offsets not starting at 0");
  expect_invalid(batched({0, 5}, {0, 5}), {fn, "q_offsets", "end at 6"},
                 "q_offsets not ending at N");
  expect_invalid(batched({0, 7}, {0, 5}), {fn, "q_offsets", "end at 6"}, "q_offsets beyond N");
  expect_invalid(batched({0, 4, 3, 6}, {0, 1, 2, 5}), {fn, "q_offsets", "must not decrease"},
                 "decreasing q_offsets");
  expect_invalid(batched({0, 6}, {0, 4}), {fn, "k_offsets", "end at 5"},
                 "k_offsets not ending at L");
  expect_invalid(batched({0, 2, 4, 6}, {0, 3, 2, 5}),
                 {fn, "k_offsets", "must not decrease", "entry 2"}, "decreasing k_offsets");
  expect_invalid(batched({0, 2, 4, 6}, {-1, 0, 2, 5}), {fn, "k_offsets", "start at 0"},
                 "negative k_offsets");
  expect_invalid(batched({0, 3, 6}, {0, 5}), {fn, "same number of sequences"}, "B differs");
  EXPECT_EQ(test::max_abs_diff(out, MatF::Constant(6, 2, 7.0f)), 0.0) << "the output was written";

  const MatF Kc = MatF::Ones(6, 4), Vc = MatF::Ones(6, 2);
  const auto causal = [&](const Off& o, const CausalOptions& opts = {}) {
    return [&, o, opts] {
      linattn::batched_causal_linear_attention(Q, Kc, Vc, o, 2, EluPlusOne{}, out, ws, opts);
    };
  };
  expect_invalid(causal({}), {cfn, "offsets", "start at 0"}, "empty offsets");
  expect_invalid(causal({2, 6}), {cfn, "offsets", "start at 0"}, "offsets not starting at 0");
  expect_invalid(causal({0, 2, 5}), {cfn, "offsets", "end at 6"}, "offsets not ending at N");
  expect_invalid(causal({0, 4, 2, 6}), {cfn, "offsets", "must not decrease", "entry 2"},
                 "decreasing offsets");
  expect_invalid(causal({0, 6}, causal_options(CausalAlgorithm::Chunked, -1)),
                 {cfn, "chunk_size", "-1"}, "negative chunk_size");
  EXPECT_EQ(test::max_abs_diff(out, MatF::Constant(6, 2, 7.0f)), 0.0) << "the output was written";
}

TEST(MultiHeadErrors, RecurrentWrongSizesThrow) {
  const std::string fn = "linattn::MultiHeadRecurrentLinearAttention::step";
  expect_invalid([] { MultiHeadRecurrentLinearAttention<EluPlusOne, float> bad(0, 4, 3); },
                 {"linattn::MultiHeadRecurrentLinearAttention", "heads must be positive"},
                 "heads 0");
  expect_invalid([] { MultiHeadRecurrentLinearAttention<EluPlusOne, float> bad(-1, 4, 3); },
                 {"linattn::MultiHeadRecurrentLinearAttention", "heads must be positive"},
                 "heads -1");
  expect_invalid([] { MultiHeadRecurrentLinearAttention<EluPlusOne, float> bad(2, 0, 3); },
                 {"RecurrentLinearAttention", "key_dim"}, "key_dim 0");
  expect_invalid([] { MultiHeadRecurrentLinearAttention<EluPlusOne, float> bad(2, 4, -1); },
                 {"RecurrentLinearAttention", "value_dim"}, "value_dim -1");

  MultiHeadRecurrentLinearAttention<EluPlusOne, float> rnn(2, 4, 3);  // q, k: 8 entries; v, out: 6
  const Eigen::VectorXf q8 = Eigen::VectorXf::Ones(8), q4 = Eigen::VectorXf::Ones(4);
  const Eigen::VectorXf v6 = Eigen::VectorXf::Ones(6), v3 = Eigen::VectorXf::Ones(3);
  Eigen::VectorXf out6 = Eigen::VectorXf::Constant(6, 7.0f), out3(3);
  expect_invalid([&] { rnn.step(q4, q8, v6, out6); }, {fn, "q is 4x1", "8 entries"},
                 "q of one head");
  expect_invalid([&] { rnn.step(q8, q4, v6, out6); }, {fn, "k is 4x1"}, "k size");
  expect_invalid([&] { rnn.step(q8, q8, v3, out6); }, {fn, "v is 3x1", "6 entries"}, "v size");
  expect_invalid([&] { rnn.step(q8, q8, v6, out3); }, {fn, "out is 3x1"}, "out size");
  expect_invalid([&] { rnn.step(q8, q8, v3); }, {fn, "v is 3x1"}, "v size, returning");
  const MatF q24 = MatF::Ones(2, 4);  // 8 entries, not a vector
  expect_invalid([&] { rnn.step(q24, q8, v6, out6); }, {fn, "q is 2x4"}, "q not a vector");
  EXPECT_EQ(test::max_abs_diff(out6, Eigen::VectorXf::Constant(6, 7.0f)), 0.0)
      << "out written by a rejected step";
  for (Index h = 0; h < 2; ++h) {
    EXPECT_EQ(rnn.head(h).position(), 0) << "a rejected step advanced head " << h;
    EXPECT_EQ(test::max_abs(rnn.head(h).state().S), 0.0) << "a rejected step touched head " << h;
  }
  EXPECT_NO_THROW(rnn.step(q8, q8, v6, out6));
  EXPECT_NO_THROW(rnn.step(q8.transpose(), q8.transpose(), v6.transpose(), out6.transpose()));
  EXPECT_EQ(rnn.head(1).position(), 2);
}


// ---------------------------------------------------------------------------------------------
// 8. Lazy inputs are evaluated once, not once per (sequence, head); exceptions in tasks
// ---------------------------------------------------------------------------------------------

// Copies a coefficient and counts it: X.unaryExpr(CountingCopy<S>{}) * W is a product whose
// evaluations can be counted (each one reads every coefficient of X once, into the GEMM's
// packed copy).
std::atomic<long> g_coeff_reads{0};
template <class S>
struct CountingCopy {
  S operator()(const S& x) const {
    g_coeff_reads.fetch_add(1, std::memory_order_relaxed);
    return x;
  }
};

// The coefficient reads of `f`.
template <class F>
long reads_in(F&& f) {
  g_coeff_reads = 0;
  f();
  return g_coeff_reads.load();
}

template <class S, class Map>
void check_lazy_inputs_evaluated_once(const Map& phi) {
  const std::string tag = tag_of<S, Map>("lazy inputs");
  // Two sequences; P-dimensional token rows projected by W (large enough for Eigen's GEMM).
  const Index H = 3, D = 8, M = 5, P = 16, N = 70, L = 70;
  const Mat<S> X = test::random_matrix<S>(N, P, 141, -1, 1);
  const Mat<S> Y = test::random_matrix<S>(L, P, 142, -1, 1);
  const Mat<S> Wq = test::random_matrix<S>(P, H * D, 143, -0.5, 0.5);
  const Mat<S> Wk = test::random_matrix<S>(P, H * D, 144, -0.5, 0.5);
  const Mat<S> Wv = test::random_matrix<S>(P, H * M, 145, -1, 1);
  const auto Qx = X.unaryExpr(CountingCopy<S>{}) * Wq;
  const auto Kx = Y.unaryExpr(CountingCopy<S>{}) * Wk;
  const auto Vx = Y.unaryExpr(CountingCopy<S>{}) * Wv;
  Mat<S> Q, K, V;
  const long once = reads_in([&] { Q = Qx; }) + reads_in([&] { K = Kx; }) + reads_in([&] { V = Vx; });
  ASSERT_EQ(once, (N + 2 * L) * P) << "the counting expression does not count as expected";
  const std::vector<Index> offsets = {0, 30, N};

  // Each entry point, with the product expressions and with their values.
  using Call = std::function<void(const ParallelOptions&, bool lazy, Mat<S>& out)>;
  MultiHeadWorkspace<S> ws;
  const std::vector<std::pair<std::string, Call>> calls = {
      {"multihead_linear_attention",
       [&](const ParallelOptions& par, bool lazy, Mat<S>& out) {
         if (lazy)
           linattn::multihead_linear_attention(Qx, Kx, Vx, H, phi, out, ws, par);
         else
           linattn::multihead_linear_attention(Q, K, V, H, phi, out, ws, par);
       }},
      {"multihead_linear_attention (returning)",
       [&](const ParallelOptions& par, bool lazy, Mat<S>& out) {
         out = lazy ? linattn::multihead_linear_attention(Qx, Kx, Vx, H, phi, par)
                    : linattn::multihead_linear_attention(Q, K, V, H, phi, par);
       }},
      {"multihead_causal_linear_attention",
       [&](const ParallelOptions& par, bool lazy, Mat<S>& out) {
         if (lazy)
           linattn::multihead_causal_linear_attention(Qx, Kx, Vx, H, phi, out, ws, {}, par);
         else
           linattn::multihead_causal_linear_attention(Q, K, V, H, phi, out, ws, {}, par);
       }},
      {"multihead_causal_linear_attention (returning)",
       [&](const ParallelOptions& par, bool lazy, Mat<S>& out) {
         out = lazy ? linattn::multihead_causal_linear_attention(Qx, Kx, Vx, H, phi, {}, par)
                    : linattn::multihead_causal_linear_attention(Q, K, V, H, phi, {}, par);
       }},
      {"batched_linear_attention",
       [&](const ParallelOptions& par, bool lazy, Mat<S>& out) {
         if (lazy)
           linattn::batched_linear_attention(Qx, Kx, Vx, offsets, offsets, H, phi, out, ws, par);
         else
           linattn::batched_linear_attention(Q, K, V, offsets, offsets, H, phi, out, ws, par);
       }},
      {"batched_causal_linear_attention",
       [&](const ParallelOptions& par, bool lazy, Mat<S>& out) {
         if (lazy)
           linattn::batched_causal_linear_attention(Qx, Kx, Vx, offsets, H, phi, out, ws, {}, par);
         else
           linattn::batched_causal_linear_attention(Q, K, V, offsets, H, phi, out, ws, {}, par);
       }},
      {"multihead_softmax_attention",
       [&](const ParallelOptions& par, bool lazy, Mat<S>& out) {
         if (lazy)
           linattn::multihead_softmax_attention(Qx, Kx, Vx, H, out, ws, SoftmaxAlgorithm::Tiled, par);
         else
           linattn::multihead_softmax_attention(Q, K, V, H, out, ws, SoftmaxAlgorithm::Tiled, par);
       }},
      {"multihead_softmax_attention (returning, naive)",
       [&](const ParallelOptions& par, bool lazy, Mat<S>& out) {
         out = lazy ? linattn::multihead_softmax_attention(Qx, Kx, Vx, H, SoftmaxAlgorithm::Naive, par)
                    : linattn::multihead_softmax_attention(Q, K, V, H, SoftmaxAlgorithm::Naive, par);
       }},
      {"multihead_causal_softmax_attention",
       [&](const ParallelOptions& par, bool lazy, Mat<S>& out) {
         if (lazy)
           linattn::multihead_causal_softmax_attention(Qx, Kx, Vx, H, out, ws, SoftmaxAlgorithm::Tiled, par);
         else
           linattn::multihead_causal_softmax_attention(Q, K, V, H, out, ws, SoftmaxAlgorithm::Tiled, par);
       }},
      {"multihead_causal_softmax_attention (returning)",
       [&](const ParallelOptions& par, bool lazy, Mat<S>& out) {
         out = lazy ? linattn::multihead_causal_softmax_attention(Qx, Kx, Vx, H, SoftmaxAlgorithm::Tiled, par)
                    : linattn::multihead_causal_softmax_attention(Q, K, V, H, SoftmaxAlgorithm::Tiled, par);
       }},
  };
  for (const int t : {1, 2, 3}) {
    for (const auto& entry : calls) {
      const auto& name = entry.first;
      const auto& call = entry.second;  // captured below: not a structured binding (C++17)
      Mat<S> expected = Mat<S>::Zero(N, H * M), got = Mat<S>::Zero(N, H * M);
      call(threads(t), false, expected);
      const long reads = reads_in([&] { call(threads(t), true, got); });
      EXPECT_EQ(reads, once) << tag << " " << name << ", " << t
                             << " thread(s): each input must be evaluated once, not "
                             << double(reads) / double(once) << " times";
      EXPECT_EQ(test::max_abs_diff(got, expected), 0.0)
          << tag << " " << name << ", " << t << " thread(s): lazy inputs give other results";
    }
  }
}

TEST(MultiHeadLazyInputs, EachInputIsEvaluatedOnce) {
  IF_FLOAT(check_lazy_inputs_evaluated_once<float>(EluPlusOne{}));
  IF_DOUBLE(check_lazy_inputs_evaluated_once<double>(SoftmaxSplit{}));
}

TEST(MultiHeadLazyInputs, RecurrentStepEvaluatesEachTokenOnce) {
  const Index H = 4, D = 6, M = 5, P = 32, T = 20;
  const Mat<float> X = test::random_matrix<float>(P, T, 151, -1, 1);  // token t: column t
  const Mat<float> Wq = test::random_matrix<float>(H * D, P, 152, -0.3, 0.3);
  const Mat<float> Wk = test::random_matrix<float>(H * D, P, 153, -0.3, 0.3);
  const Mat<float> Wv = test::random_matrix<float>(H * M, P, 154, -1, 1);
  MultiHeadRecurrentLinearAttention<EluPlusOne, float> lazy(H, D, M), plain(H, D, M);
  Vec<float> a(H * M), b(H * M);
  for (Index t = 0; t < T; ++t) {
    const auto x = X.col(t).unaryExpr(CountingCopy<float>{});
    const Vec<float> q = Wq * x, k = Wk * x, v = Wv * x;
    const long reads = reads_in([&] { lazy.step(Wq * x, Wk * x, Wv * x, a); });
    EXPECT_EQ(reads, 3 * P) << "token " << t << ": each input must be evaluated once, not "
                            << double(reads) / double(3 * P) << " times";
    plain.step(q, k, v, b);
    EXPECT_EQ(test::max_abs_diff(a, b), 0.0) << "token " << t;
  }
}

// A feature map that fails: the exception reaches the caller whatever the thread count.
// Regression test: inside the OpenMP region an escaping exception called std::terminate.
struct ThrowingMap {
  Eigen::Index feature_dim(Eigen::Index d) const { return d; }
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>&, linattn::MatrixRef<typename Derived::Scalar>) const {
    throw std::runtime_error("ThrowingMap");
  }
};

TEST(MultiHeadThreads, ExceptionsInTasksReachTheCaller) {
  const MhShape sh{4, 40, 40, 3, 2};
  const Inputs<float> in = make_inputs<float>(sh, 161);
  const std::vector<Index> offsets = {0, 10, 40};
  for (const int t : {1, 2, 3}) {
    MultiHeadWorkspace<float> ws;
    Mat<float> out(sh.N, sh.H * sh.M);
    EXPECT_THROW(linattn::multihead_linear_attention(in.Q, in.K, in.V, sh.H, ThrowingMap{}, out, ws,
                                                     threads(t)),
                 std::runtime_error)
        << t << " thread(s)";
    EXPECT_THROW(linattn::multihead_causal_linear_attention(in.Q, in.K, in.V, sh.H, ThrowingMap{},
                                                            out, ws, {}, threads(t)),
                 std::runtime_error)
        << t << " thread(s)";
    EXPECT_THROW(linattn::batched_causal_linear_attention(in.Q, in.K, in.V, offsets, sh.H,
                                                          ThrowingMap{}, out, ws, {}, threads(t)),
                 std::runtime_error)
        << t << " thread(s)";
    // The workspace still works afterwards.
    linattn::multihead_linear_attention(in.Q, in.K, in.V, sh.H, EluPlusOne{}, out, ws, threads(t));
    EXPECT_EQ(test::max_abs_diff(out, linattn::multihead_linear_attention(in.Q, in.K, in.V, sh.H)),
              0.0)
        << t << " thread(s)";
  }
}

}  // namespace
