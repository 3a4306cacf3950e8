// LinearAttentionLayer and SoftmaxAttentionLayer (attention_layer.hpp, spec §6): the parallel
// forward against a reference written out here from PyTorch's conventions (W is out x in,
// y = W x + b), stepping against the parallel causal forward, prefill + steps against one
// shot, a linear State set through its heads, the gradients of X and of every parameter against
// central differences, and the error messages. (That a step allocates nothing is checked in test_workspace.)
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "reference.hpp"
#include "test_util.hpp"

namespace {

using linattn::EluPlusOne;
using linattn::LinearAttentionLayer;
using linattn::NormalizedCosine;
using linattn::SoftmaxAttentionLayer;
using linattn::SoftmaxSplit;
using test::Index;
using test::Mat;
using test::MatD;
using VecD = Eigen::VectorXd;
using Needles = std::vector<std::string>;

// Layer shapes: (d_model, heads) with head sizes d_model / heads, and (d_model, heads, D, M)
// with other head sizes (D != M, neither dividing d_model).
struct Shape {
  Index d_model, heads, D, M;
};
const Shape kShapes[] = {{12, 3, 4, 4}, {7, 2, 5, 3}};

std::string map_name(const EluPlusOne&) { return "EluPlusOne"; }
std::string map_name(const SoftmaxSplit&) { return "SoftmaxSplit"; }
std::string map_name(const NormalizedCosine&) { return "NormalizedCosine"; }

template <class Layer>
Layer make_layer(const Shape& sh, std::uint32_t seed) {
  Layer layer = sh.D * sh.heads == sh.d_model && sh.D == sh.M
                    ? Layer(sh.d_model, sh.heads)
                    : Layer(sh.d_model, sh.heads, sh.D, sh.M);
  layer.reset_parameters(seed);
  using S = typename decltype(layer.bq)::Scalar;
  // Non-zero biases, so that a bias applied in the wrong place shows.
  layer.bq = test::random_matrix<S>(layer.bq.size(), 1, seed + 1, -0.5, 0.5);
  layer.bk = test::random_matrix<S>(layer.bk.size(), 1, seed + 2, -0.5, 0.5);
  layer.bv = test::random_matrix<S>(layer.bv.size(), 1, seed + 3, -0.5, 0.5);
  layer.bo = test::random_matrix<S>(layer.bo.size(), 1, seed + 4, -0.5, 0.5);
  return layer;
}

// y = W x + b for every row x of X, entry by entry (W out x in, as torch.nn.Linear::weight).
MatD linear_rows(const MatD& X, const MatD& W, const VecD& b) {
  MatD Y(X.rows(), W.rows());
  for (Index i = 0; i < X.rows(); ++i)
    for (Index o = 0; o < W.rows(); ++o) {
      double acc = b(o);
      for (Index c = 0; c < W.cols(); ++c) acc += W(o, c) * X(i, c);
      Y(i, o) = acc;
    }
  return Y;
}

// The layer's output by the O(N²) references of linear and softmax attention, in double.
template <class Layer, class Attn>
MatD reference_forward(const Layer& layer, const MatD& X, const Attn& attn) {
  const Index H = layer.num_heads(), D = layer.key_dim(), M = layer.value_dim();
  const MatD Q = linear_rows(X, layer.Wq.template cast<double>(), layer.bq.template cast<double>());
  const MatD K = linear_rows(X, layer.Wk.template cast<double>(), layer.bk.template cast<double>());
  const MatD V = linear_rows(X, layer.Wv.template cast<double>(), layer.bv.template cast<double>());
  MatD A(X.rows(), H * M);
  for (Index h = 0; h < H; ++h)
    A.middleCols(h * M, M) = attn(MatD(Q.middleCols(h * D, D)), MatD(K.middleCols(h * D, D)),
                                  MatD(V.middleCols(h * M, M)));
  return linear_rows(A, layer.Wo.template cast<double>(), layer.bo.template cast<double>());
}

template <class Phi>
auto linear_reference(const Phi& phi, bool causal) {
  return [phi, causal](const MatD& Q, const MatD& K, const MatD& V) -> MatD {
    return causal ? ref::causal_linear_attention(Q, K, V, phi) : ref::linear_attention(Q, K, V, phi);
  };
}
auto softmax_reference(bool causal) {
  return [causal](const MatD& Q, const MatD& K, const MatD& V) -> MatD {
    return causal ? ref::causal_softmax_attention(Q, K, V) : ref::softmax_attention(Q, K, V);
  };
}

template <class S>
double rel_diff(const Mat<S>& a, const MatD& b) {
  return test::max_abs_diff(a.template cast<double>(), b) / std::max(1.0, test::max_abs(b));
}

// Measured (max over the cases below, relative to max(1, max |Y|)): forward vs reference
// 1.8e-7 (float) / 5.6e-16 (double); steps and prefill vs the parallel forward 1.3e-7 / 2.2e-16.
template <class S>
double tol() {
  return test::bound<S>(1e-6, 4e-15);
}

// ---------------------------------------------------------------------------------------------
// Forward against the reference
// ---------------------------------------------------------------------------------------------

template <class S, class Layer, class Ref>
void check_forward(const Layer& layer, const Ref& make_ref, const std::string& what) {
  double worst = 0;
  for (const Index N : {1, 9, 40}) {
    const Mat<S> X = test::random_matrix<S>(N, layer.d_model(), test::seed_of({N, 7}), -2, 2);
    for (const bool causal : {false, true}) {
      const Mat<S> Y = layer.forward(X, causal);
      ASSERT_EQ(Y.rows(), N);
      ASSERT_EQ(Y.cols(), layer.d_model());
      const double err = rel_diff(Y, reference_forward(layer, X.template cast<double>(), make_ref(causal)));
      worst = std::max(worst, err);
      EXPECT_LE(err, tol<S>()) << what << " N=" << N << " causal=" << causal;
    }
  }
  test::report_error(what + " forward vs reference (N = 1, 9, 40, causal and not)", worst);
}

template <class Phi, class S>
void check_linear_forward(const Phi& phi) {
  for (const Shape& sh : kShapes) {
    const auto layer = make_layer<LinearAttentionLayer<Phi, S>>(sh, 11);
    check_forward<S>(layer, [&](bool causal) { return linear_reference(phi, causal); },
                     std::string(test::scalar_name<S>()) + " linear " + map_name(phi) + " d_model=" +
                         std::to_string(sh.d_model));
  }
}

// Every map in double; float with EluPlusOne only. The layer's own code does not depend on the
// map, and the kernels' float paths of every map are tested in their own suites: each more
// (map, scalar) pair here would compile every multi-head kernel once more (CI time).
TEST(AttentionLayer, LinearForwardMatchesReference) {
  check_linear_forward<EluPlusOne, float>(EluPlusOne{});
  check_linear_forward<EluPlusOne, double>(EluPlusOne{});
  check_linear_forward<SoftmaxSplit, double>(SoftmaxSplit{});
  check_linear_forward<NormalizedCosine, double>(NormalizedCosine{});
}

template <class S>
void check_softmax_forward() {
  for (const Shape& sh : kShapes) {
    const auto layer = make_layer<SoftmaxAttentionLayer<S>>(sh, 12);
    check_forward<S>(layer, [](bool causal) { return softmax_reference(causal); },
                     std::string(test::scalar_name<S>()) + " softmax d_model=" + std::to_string(sh.d_model));
  }
}

TEST(AttentionLayer, SoftmaxForwardMatchesReference) {
  IF_FLOAT(check_softmax_forward<float>());
  IF_DOUBLE(check_softmax_forward<double>());
}

// ---------------------------------------------------------------------------------------------
// Generation: steps, prefill
// ---------------------------------------------------------------------------------------------

// Stepping every row equals the causal parallel forward; prefill (in one or two pieces, the
// second over a non-empty state) followed by steps equals it too.
template <class S, class Layer>
void check_generation(const Layer& layer, const std::string& what) {
  const Index N = 37, d = layer.d_model();
  const Mat<S> X = test::random_matrix<S>(N, d, 21, -2, 2);
  const Mat<S> Y = layer.forward(X, true);

  auto state = layer.make_state();
  Mat<S> stepped(N, d);
  Eigen::Matrix<S, Eigen::Dynamic, 1> y(d);
  for (Index i = 0; i < N; ++i) {
    layer.step(X.row(i), state, y);  // a row of X in, a column vector out
    stepped.row(i) = y.transpose();
  }
  EXPECT_EQ(state.position(), N);
  double err = rel_diff(stepped, Y.template cast<double>());
  double worst = err;
  EXPECT_LE(err, tol<S>()) << what;

  for (const Index cut : {Index(0), Index(1), Index(16)}) {
    auto st = layer.make_state();
    Mat<S> out(N, d);
    out.topRows(cut) = layer.forward(X.topRows(cut), st);
    const Index second = (N - cut) / 2;
    out.middleRows(cut, second) = layer.forward(X.middleRows(cut, second), st);
    EXPECT_EQ(st.position(), cut + second);
    for (Index i = cut + second; i < N; ++i) layer.step(X.row(i), st, out.row(i));  // a row out
    err = rel_diff(out, Y.template cast<double>());
    worst = std::max(worst, err);
    EXPECT_LE(err, tol<S>()) << what << " cut " << cut;
  }
  test::report_error(what + " steps, prefill + steps vs forward", worst);

  // A copied state forks the sequence: both copies continue alike.
  auto a = layer.make_state();
  layer.forward(X.topRows(5), a);
  auto b = a;
  Eigen::Matrix<S, Eigen::Dynamic, 1> ya(d), yb(d);
  layer.step(X.row(5), a, ya);
  layer.step(X.row(5), b, yb);
  EXPECT_EQ(test::max_abs_diff(ya, yb), 0.0) << what;

  // y may be x's own memory.
  auto c = layer.make_state();
  Eigen::Matrix<S, Eigen::Dynamic, 1> xy = X.row(0).transpose();
  layer.step(xy, c, xy);
  EXPECT_LE(test::max_abs_diff(xy.transpose(), Y.row(0)), tol<S>()) << what;
}

template <class Phi, class S>
void check_linear_generation(const Phi& phi) {
  for (const Shape& sh : kShapes)
    check_generation<S>(make_layer<LinearAttentionLayer<Phi, S>>(sh, 31),
                        std::string(test::scalar_name<S>()) + " linear " + map_name(phi));
}

// The pairs of LinearForwardMatchesReference.
TEST(AttentionLayer, LinearStepsAndPrefillEqualTheParallelForward) {
  check_linear_generation<EluPlusOne, float>(EluPlusOne{});
  check_linear_generation<EluPlusOne, double>(EluPlusOne{});
  check_linear_generation<SoftmaxSplit, double>(SoftmaxSplit{});
  check_linear_generation<NormalizedCosine, double>(NormalizedCosine{});
}

TEST(AttentionLayer, SoftmaxStepsAndPrefillEqualTheParallelForward) {
  for (const Shape& sh : kShapes) {
    IF_FLOAT(check_generation<float>(make_layer<SoftmaxAttentionLayer<float>>(sh, 32), "float softmax"));
    IF_DOUBLE(check_generation<double>(make_layer<SoftmaxAttentionLayer<double>>(sh, 32), "double softmax"));
  }
}

TEST(AttentionLayer, SoftmaxCacheGrowsAndReserves) {
  const SoftmaxAttentionLayer<double> layer(8, 2);
  auto st = layer.make_state(4);
  EXPECT_EQ(st.capacity(), 4);
  const MatD X = test::random_matrix(10, 8, 3);
  Eigen::VectorXd y(8);
  for (Index i = 0; i < 10; ++i) layer.step(X.row(i), st, y);
  EXPECT_GE(st.capacity(), 10);
  EXPECT_EQ(st.keys().rows(), 10);
  // The cache holds the keys and values of the rows, as the layer projects them.
  EXPECT_LE(test::max_abs_diff(st.keys(), linear_rows(X, layer.Wk, layer.bk)), 1e-14);
  EXPECT_LE(test::max_abs_diff(st.values(), linear_rows(X, layer.Wv, layer.bv)), 1e-14);
}

// The linear layer's State can be set through heads() (no const_cast): position() is the heads'
// position, so a State whose heads are set (set_state, or load_state of a multi-head file)
// continues at the heads' position, as the State they came from.
TEST(AttentionLayer, LinearStateIsSetThroughItsHeads) {
  const auto layer = make_layer<LinearAttentionLayer<EluPlusOne, double>>(Shape{7, 2, 5, 3}, 61);
  const MatD X = test::random_matrix(40, 7, 62, -2, 2);
  Eigen::VectorXd ya(7), yb(7);
  auto a = layer.make_state();
  (void)layer.forward(X.topRows(20), a);
  auto b = layer.make_state();
  for (Index h = 0; h < layer.num_heads(); ++h)
    b.heads().head(h).set_state(a.heads().head(h).state(), a.position());
  EXPECT_EQ(b.position(), 20);
  for (Index i = 20; i < 30; ++i) {
    layer.step(X.row(i), a, ya);
    layer.step(X.row(i), b, yb);
    EXPECT_EQ(test::max_abs_diff(ya, yb), 0.0) << "row " << i;
  }
  EXPECT_EQ(b.position(), 30);
  // The heads saved as a multi-head file and loaded into another State's heads.
  std::stringstream file(std::ios::in | std::ios::out | std::ios::binary);
  linattn::save_state(file, a.heads());
  auto c = layer.make_state();
  linattn::load_state(file, c.heads());
  EXPECT_EQ(c.position(), 30);
  const MatD rest_a = layer.forward(X.bottomRows(10), a), rest_c = layer.forward(X.bottomRows(10), c);
  EXPECT_EQ(test::max_abs_diff(rest_a, rest_c), 0.0);
  EXPECT_EQ(c.position(), 40);
  // Heads of another shape are refused by the layer.
  auto d = layer.make_state();
  d.heads() = linattn::MultiHeadRecurrentLinearAttention<EluPlusOne, double>(2, 5, 4);
  test::expect_invalid([&] { layer.step(X.row(0), d, ya); },
                       Needles{"LinearAttentionLayer::step", "state"}, "heads of another shape");
}

// ---------------------------------------------------------------------------------------------
// Gradients
// ---------------------------------------------------------------------------------------------

// Central differences of L = Σ Y ∘ G with respect to every entry of `x` (X or a parameter).
template <class Layer, class X>
MatD numeric_gradient(Layer& layer, const MatD& input, X& x, bool causal, const MatD& G,
                      bool x_is_input) {
  MatD grad(x.rows(), x.cols());
  MatD in = input;
  for (Index c = 0; c < x.cols(); ++c)
    for (Index r = 0; r < x.rows(); ++r) {
      auto& e = x_is_input ? in(r, c) : x(r, c);
      const double x0 = e, h = 1e-5 * std::max(1.0, std::abs(x0));
      e = x0 + h;
      const double up = layer.forward(in, causal).cwiseProduct(G).sum();
      e = x0 - h;
      const double down = layer.forward(in, causal).cwiseProduct(G).sum();
      e = x0;
      grad(r, c) = (up - down) / (2 * h);
    }
  return grad;
}

template <class Layer>
void check_gradients(Layer layer, const std::string& what) {
  const Index N = 6, d = layer.d_model();
  const MatD X = test::random_matrix(N, d, 41, -1.5, 1.5);
  const MatD G = test::random_matrix(N, d, 42);
  for (const bool causal : {false, true}) {
    const std::string where = what + (causal ? " causal" : " non-causal");
    const linattn::LayerGradients<double> g = layer.backward(X, G, causal);
    MatD dummy = X;
    double worst = 0;
    const auto expect = [&](const MatD& analytic, const MatD& numeric, const char* name) {
      const double err = test::max_abs_diff(analytic, numeric) / std::max(1.0, test::max_abs(numeric));
      worst = std::max(worst, err);
      EXPECT_LE(err, 1e-9) << where << " " << name;  // measured: at most 9.4e-11
    };
    expect(g.dX, numeric_gradient(layer, X, dummy, causal, G, true), "dX");
    expect(g.dWq, numeric_gradient(layer, X, layer.Wq, causal, G, false), "dWq");
    expect(g.dWk, numeric_gradient(layer, X, layer.Wk, causal, G, false), "dWk");
    expect(g.dWv, numeric_gradient(layer, X, layer.Wv, causal, G, false), "dWv");
    expect(g.dWo, numeric_gradient(layer, X, layer.Wo, causal, G, false), "dWo");
    expect(g.dbq, numeric_gradient(layer, X, layer.bq, causal, G, false), "dbq");
    expect(g.dbk, numeric_gradient(layer, X, layer.bk, causal, G, false), "dbk");
    expect(g.dbv, numeric_gradient(layer, X, layer.bv, causal, G, false), "dbv");
    expect(g.dbo, numeric_gradient(layer, X, layer.bo, causal, G, false), "dbo");
    test::report_error(where + " gradients vs finite differences", worst);
  }
}

TEST(AttentionLayer, GradientsMatchFiniteDifferences) {
  const Shape sh{6, 2, 4, 3};
  check_gradients(make_layer<LinearAttentionLayer<EluPlusOne, double>>(sh, 51), "linear EluPlusOne");
  check_gradients(make_layer<LinearAttentionLayer<SoftmaxSplit, double>>(sh, 52),
                  "linear SoftmaxSplit");
  check_gradients(make_layer<LinearAttentionLayer<NormalizedCosine, double>>(sh, 53),
                  "linear NormalizedCosine");
  check_gradients(make_layer<SoftmaxAttentionLayer<double>>(sh, 54), "softmax");
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

TEST(AttentionLayer, ErrorsNameTheFunctionAndTheShapes) {
  using L = LinearAttentionLayer<EluPlusOne, float>;
  test::expect_invalid([] { L(10, 3); }, Needles{"LinearAttentionLayer", "10", "3"}, "d_model % heads");
  test::expect_invalid([] { SoftmaxAttentionLayer<float>(8, 0); }, Needles{"SoftmaxAttentionLayer"},
                       "zero heads");
  test::expect_invalid([] { L(8, 2, 0, 4); }, Needles{"LinearAttentionLayer", "key_dim"}, "zero key_dim");

  L layer(8, 2);
  const Mat<float> X = Mat<float>::Ones(5, 7);
  test::expect_invalid([&] { (void)layer.forward(X, true); },
                       Needles{"LinearAttentionLayer::forward", "5x7", "8"}, "X columns");
  auto st = layer.make_state();
  Eigen::VectorXf y(8), x7(7);
  test::expect_invalid([&] { layer.step(x7, st, y); }, Needles{"LinearAttentionLayer::step", "x", "7x1", "8"},
                       "x size");
  EXPECT_EQ(st.position(), 0);
  test::expect_invalid([&] { (void)layer.backward(Mat<float>::Ones(5, 8), Mat<float>::Ones(4, 8), false); },
                       Needles{"LinearAttentionLayer::backward", "4x8", "5x8"}, "dY rows");
  L other(8, 4);
  auto other_state = other.make_state();
  test::expect_invalid([&] { layer.step(Eigen::VectorXf::Ones(8), other_state, y); },
                       Needles{"LinearAttentionLayer::step", "state"}, "foreign state");
  layer.Wq.resize(3, 8);
  test::expect_invalid([&] { (void)layer.forward(Mat<float>::Ones(5, 8), false); },
                       Needles{"LinearAttentionLayer::forward", "Wq", "3x8", "8x8"}, "resized weight");

  SoftmaxAttentionLayer<float> soft(8, 2);
  test::expect_invalid([&] { (void)soft.make_state(-1); }, Needles{"SoftmaxAttentionLayer::make_state", "-1"},
                       "negative capacity");
  auto sst = soft.make_state();
  Eigen::VectorXf y5(5);
  test::expect_invalid([&] { soft.step(Eigen::VectorXf::Ones(8), sst, y5); },
                       Needles{"SoftmaxAttentionLayer::step", "y", "5x1"}, "y size");
  EXPECT_EQ(sst.position(), 0);
}

}  // namespace
