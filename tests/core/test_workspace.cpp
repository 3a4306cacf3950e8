// Workspace (workspace.hpp): a second call of an out+workspace overload with the same shape
// allocates nothing, and the working memory of linear attention does not grow with N.
//
// This target is compiled with EIGEN_RUNTIME_NO_MALLOC (tests/CMakeLists.txt). Eigen reports a
// heap allocation made while Eigen::internal::set_is_malloc_allowed(false) through eigen_assert,
// which NDEBUG (Release) compiles away; so eigen_assert is redirected, before any Eigen header,
// to a hook that counts failures instead of aborting. The hook works in every build type, and
// the test also counts global operator new calls (std::vector, std::string, ...).
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <new>

namespace alloc_hook {
inline int eigen_failures = 0;
inline const char* last_failure = "";
inline bool in_check = false;  // inside allocations_in(): count; elsewhere: a real assertion
inline void eigen_assert_failed(const char* expr, const char* file, int line) {
  if (!in_check) {
    std::fprintf(stderr, "%s:%d: eigen_assert failed: %s\n", file, line, expr);
    std::abort();
  }
  ++eigen_failures;
  last_failure = expr;
}
}  // namespace alloc_hook

#define eigen_assert(x) \
  ((x) ? static_cast<void>(0) : ::alloc_hook::eigen_assert_failed(#x, __FILE__, __LINE__))

#ifndef EIGEN_RUNTIME_NO_MALLOC
#error "test_workspace must be compiled with EIGEN_RUNTIME_NO_MALLOC (see tests/CMakeLists.txt)"
#endif

#include "new_counter.hpp"  // counts global operator new

#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_util.hpp"

namespace {

using linattn::SoftmaxAlgorithm;
using test::Index;
using test::Mat;

// Runs `call` with Eigen's heap allocation forbidden and operator new counted; returns a
// description of what allocated ("" if nothing did).
template <class F>
std::string allocations_in(F&& call) {
  const int eigen_before = alloc_hook::eigen_failures;
  new_counter::calls = 0;
  alloc_hook::in_check = true;
  new_counter::counting = true;
  Eigen::internal::set_is_malloc_allowed(false);
  call();
  Eigen::internal::set_is_malloc_allowed(true);
  new_counter::counting = false;
  alloc_hook::in_check = false;
  std::string what;
  if (alloc_hook::eigen_failures != eigen_before)
    what += std::to_string(alloc_hook::eigen_failures - eigen_before) +
            " Eigen heap allocation(s) or assertion(s): " + alloc_hook::last_failure + "; ";
  if (new_counter::calls != 0)
    what += std::to_string(new_counter::calls.load()) + " operator new call(s)";
  return what;
}

TEST(WorkspaceNoMalloc, TheDetectorWorks) {
  // Without this, a silent detector would make every test below pass vacuously.
  Index rows = 0;
  const std::string eigen = allocations_in([&] {
    Mat<float> m(100, 100);
    m.setZero();
    rows = m.rows();
  });
  EXPECT_EQ(rows, 100);
  EXPECT_NE(eigen.find("Eigen heap allocation"), std::string::npos) << "got: \"" << eigen << "\"";
  std::size_t size = 0;
  const std::string vec = allocations_in([&] {
    std::vector<int> v(1000, 1);
    size = v.size();
  });
  EXPECT_EQ(size, 1000u);
  EXPECT_NE(vec.find("operator new"), std::string::npos) << "got: \"" << vec << "\"";
  EXPECT_EQ(allocations_in([] {}), "");
}

// Sets Eigen's number of threads for a scope; restores Eigen's default (omp_get_max_threads()
// when built with OpenMP, as the library's interface target is by default) on exit.
struct EigenThreads {
  explicit EigenThreads(int n) { Eigen::setNbThreads(n); }
  ~EigenThreads() { Eigen::setNbThreads(0); }
};

template <class S>
struct Inputs {
  Mat<S> Q, K, V;
};

template <class S>
Inputs<S> make(Index N, Index L, Index D, Index M, std::uint32_t salt) {
  return {test::random_matrix<S>(N, D, test::seed_of({N, D, salt, 1})),
          test::random_matrix<S>(L, D, test::seed_of({L, D, salt, 2})),
          test::random_matrix<S>(L, M, test::seed_of({L, M, salt, 3}))};
}

// The shapes of the no-allocation checks: small, unaligned, and large enough for several
// 256-row blocks and several 256 x 128 softmax tiles with GEMMs of real size.
struct Shape {
  Index N, L, D, M;
};
const Shape kShapes[] = {{7, 5, 3, 2}, {300, 257, 16, 8}, {600, 520, 64, 64}};

template <class Map, class S>
void check_linear_no_alloc(const char* name, int threads) {
  const EigenThreads scope(threads);
  for (const Shape& sh : kShapes) {
    const Inputs<S> in = make<S>(sh.N, sh.L, sh.D, sh.M, 1);
    linattn::Workspace<S> ws;
    Mat<S> out(sh.N, sh.M);
    linattn::linear_attention(in.Q, in.K, in.V, Map{}, out, ws);  // sizes the workspace
    const Mat<S> first = out;
    const std::size_t bytes = ws.bytes();
    // Different inputs of the same shape.
    const Inputs<S> in2 = make<S>(sh.N, sh.L, sh.D, sh.M, 2);
    const std::string alloc = allocations_in(
        [&] { linattn::linear_attention(in2.Q, in2.K, in2.V, Map{}, out, ws); });
    EXPECT_EQ(alloc, "") << name << "/" << test::scalar_name<S>() << " N=" << sh.N << " L=" << sh.L
                         << " D=" << sh.D << " M=" << sh.M << ", Eigen::nbThreads() = "
                         << Eigen::nbThreads();
    EXPECT_EQ(ws.bytes(), bytes) << name;
    // And the result is right (the workspace holds no stale state).
    EXPECT_EQ(test::max_abs_diff(out, linattn::linear_attention(in2.Q, in2.K, in2.V, Map{})), 0.0) << name;
    // Into a block of a larger matrix and a row-major Map: no allocation either.
    Mat<S> big(sh.N + 3, sh.M + 2);
    std::vector<S> buf(static_cast<std::size_t>(sh.N * sh.M));
    Eigen::Map<test::RowMat<S>> out_r(buf.data(), sh.N, sh.M);
    EXPECT_EQ(allocations_in([&] {
                linattn::linear_attention(in.Q, in.K, in.V, Map{}, big.block(1, 2, sh.N, sh.M), ws);
                linattn::linear_attention(in.Q, in.K, in.V, Map{}, out_r, ws);
              }),
              "")
        << name << " into a block / row-major Map";
    // A few ulps, not bit for bit: with -march=native Eigen's products take paths that depend
    // on the alignment of the output block (seen: 1 ulp under AVX-512).
    EXPECT_LE(test::max_abs_diff(big.block(1, 2, sh.N, sh.M), first),
              4 * test::Tol<S>::ulps * std::max(1.0, test::max_abs(first)))
        << name;
  }
}

// The guarantee of workspace.hpp holds for Eigen running its products on one thread: with
// Eigen::nbThreads() > 1 (OpenMP, outside a parallel region) Eigen's parallel GEMM allocates
// its own blocking buffers, as workspace.hpp documents. ctest runs the unit tests with
// OMP_NUM_THREADS=1; the checks set one Eigen thread themselves so that running this binary
// directly on a multi-core machine checks the same thing.
void linear_no_alloc(int threads) {
  check_linear_no_alloc<linattn::EluPlusOne, float>("EluPlusOne", threads);
  check_linear_no_alloc<linattn::EluPlusOne, double>("EluPlusOne", threads);
  check_linear_no_alloc<linattn::SoftmaxSplit, float>("SoftmaxSplit", threads);
  check_linear_no_alloc<linattn::SoftmaxSplit, double>("SoftmaxSplit", threads);
  check_linear_no_alloc<linattn::NormalizedCosine, float>("NormalizedCosine", threads);
  check_linear_no_alloc<linattn::NormalizedCosine, double>("NormalizedCosine", threads);
}

TEST(WorkspaceNoMalloc, LinearAttentionSecondCallAllocatesNothing) { linear_no_alloc(1); }

template <class S>
void check_softmax_no_alloc(bool causal, int threads) {
  const EigenThreads scope(threads);
  for (const Shape& s : kShapes) {
    const Shape sh = causal ? Shape{s.N, s.N, s.D, s.M} : s;
    const Inputs<S> in = make<S>(sh.N, sh.L, sh.D, sh.M, 3);
    const Inputs<S> in2 = make<S>(sh.N, sh.L, sh.D, sh.M, 4);
    linattn::Workspace<S> ws;
    Mat<S> out(sh.N, sh.M);
    const auto call = [&](const Inputs<S>& x) {
      if (causal)
        linattn::causal_softmax_attention(x.Q, x.K, x.V, out, ws, SoftmaxAlgorithm::Tiled);
      else
        linattn::softmax_attention(x.Q, x.K, x.V, out, ws, SoftmaxAlgorithm::Tiled);
    };
    call(in);
    const std::size_t bytes = ws.bytes();
    EXPECT_EQ(allocations_in([&] { call(in2); }), "")
        << (causal ? "causal_" : "") << "softmax_attention (tiled)/" << test::scalar_name<S>()
        << " N=" << sh.N << " L=" << sh.L << " D=" << sh.D << " M=" << sh.M
        << ", Eigen::nbThreads() = " << Eigen::nbThreads();
    EXPECT_EQ(ws.bytes(), bytes);
    const Mat<S> expected = causal ? linattn::causal_softmax_attention(in2.Q, in2.K, in2.V)
                                   : linattn::softmax_attention(in2.Q, in2.K, in2.V);
    EXPECT_EQ(test::max_abs_diff(out, expected), 0.0);
  }
}

TEST(WorkspaceNoMalloc, TiledSoftmaxSecondCallAllocatesNothing) {
  IF_FLOAT(check_softmax_no_alloc<float>(false, 1));
  IF_DOUBLE(check_softmax_no_alloc<double>(false, 1));
}

TEST(WorkspaceNoMalloc, TiledCausalSoftmaxSecondCallAllocatesNothing) {
  IF_FLOAT(check_softmax_no_alloc<float>(true, 1));
  IF_DOUBLE(check_softmax_no_alloc<double>(true, 1));
}

// The layers' generation steps (attention_layer.hpp): LinearAttentionLayer::step for every map,
// and SoftmaxAttentionLayer::step while its KV cache has room; a token as a row of a matrix and
// the output as a column vector (the forms the step converts).
template <class Layer>
void check_layer_step_no_alloc(const Layer& layer, typename Layer::State& state,
                               const std::string& name) {
  using S = typename decltype(layer.Wq)::Scalar;
  const Mat<S> X = test::random_matrix<S>(40, layer.d_model(), 6);
  Eigen::Matrix<S, Eigen::Dynamic, 1> y(layer.d_model());
  layer.step(X.row(0), state, y);
  for (Index i = 1; i < X.rows(); ++i)
    EXPECT_EQ(allocations_in([&] { layer.step(X.row(i), state, y); }), "") << name << " step " << i;
  EXPECT_TRUE(test::all_finite(y)) << name;
}

TEST(WorkspaceNoMalloc, LayerStepsAllocateNothing) {
  const auto linear = [](auto phi, auto scalar, const char* name) {
    using S = typename decltype(scalar)::type;
    const linattn::LinearAttentionLayer<decltype(phi), S> layer(24, 3);
    auto state = layer.make_state();
    check_layer_step_no_alloc(layer, state, std::string("LinearAttentionLayer/") + name);
  };
  linear(linattn::EluPlusOne{}, test::ScalarTag<float>{}, "EluPlusOne/float");
  linear(linattn::EluPlusOne{}, test::ScalarTag<double>{}, "EluPlusOne/double");
  linear(linattn::SoftmaxSplit{}, test::ScalarTag<float>{}, "SoftmaxSplit/float");
  linear(linattn::NormalizedCosine{}, test::ScalarTag<float>{}, "NormalizedCosine/float");
  const linattn::SoftmaxAttentionLayer<float> softmax(24, 3);
  auto cache = softmax.make_state(40);
  check_layer_step_no_alloc(softmax, cache, "SoftmaxAttentionLayer/float");
}

// ---------------------------------------------------------------------------------------------
// Workspace::bytes(): stable across calls, independent of N (and of L) for linear attention.
// ---------------------------------------------------------------------------------------------

template <class Map>
void check_bytes_independent_of_length(const char* name) {
  const Index D = 32, M = 16;
  for (const bool grow_queries : {true, false}) {
    linattn::Workspace<float> ws;
    std::size_t bytes_at_start = 0;
    for (const Index n : {300, 600, 1200, 2400}) {
      const Index N = grow_queries ? n : 300, L = grow_queries ? 300 : n;
      const Inputs<float> in = make<float>(N, L, D, M, 5);
      Eigen::MatrixXf out(N, M);
      linattn::linear_attention(in.Q, in.K, in.V, Map{}, out, ws);
      if (n == 300) {
        bytes_at_start = ws.bytes();
        EXPECT_GT(bytes_at_start, 0u);
        linattn::linear_attention(in.Q, in.K, in.V, Map{}, out, ws);  // a second call: same
      }
      EXPECT_EQ(ws.bytes(), bytes_at_start)
          << name << ": working memory grew to " << ws.bytes() << " bytes at "
          << (grow_queries ? "N=" : "L=") << n << " (was " << bytes_at_start << ")";
    }
  }
}

TEST(WorkspaceBytes, LinearAttentionMemoryDoesNotGrowWithSequenceLength) {
  check_bytes_independent_of_length<linattn::EluPlusOne>("EluPlusOne");
  check_bytes_independent_of_length<linattn::SoftmaxSplit>("SoftmaxSplit");
  check_bytes_independent_of_length<linattn::NormalizedCosine>("NormalizedCosine");
}

TEST(WorkspaceBytes, StableForRepeatedCallsAndReleased) {
  const Inputs<double> in = make<double>(300, 300, 16, 8, 6);
  Eigen::MatrixXd out(300, 8);
  linattn::Workspace<double> ws;
  EXPECT_EQ(ws.bytes(), 0u);
  linattn::softmax_attention(in.Q, in.K, in.V, out, ws);
  const std::size_t b = ws.bytes();
  EXPECT_GT(b, 0u);
  for (int i = 0; i < 3; ++i) {
    linattn::softmax_attention(in.Q, in.K, in.V, out, ws);
    EXPECT_EQ(ws.bytes(), b);
  }
  // The tiled softmax needs O(tile) memory, not O(N·L): far less than the 300 x 300 scores.
  EXPECT_LT(b, 300u * 300u * sizeof(double));
  ws.release();
  EXPECT_EQ(ws.bytes(), 0u);
  linattn::softmax_attention(in.Q, in.K, in.V, out, ws);  // usable after release
  EXPECT_EQ(test::max_abs_diff(out, linattn::softmax_attention(in.Q, in.K, in.V)), 0.0);
}

}  // namespace
