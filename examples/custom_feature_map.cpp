// User-defined feature maps. Any type with
//
//   Eigen::Index feature_dim(Eigen::Index D) const;
//   template <class Derived>
//   void map(const Eigen::MatrixBase<Derived>& x, linattn::MatrixRef<typename Derived::Scalar> phi) const;
//
// plugs into every kernel (see linattn/feature_map.hpp). Two examples:
//
//  - Relu: φ(x) = max(x, 0), F = D. Not strictly positive: a query with no positive entry has a
//    zero denominator; the library's ε guard turns that row into zeros instead of NaN. (The
//    library ships it as linattn::Relu, with a packet path and a backward; written out here as
//    the smallest example of the concept.)
//  - PositiveRandomFeatures: φ(x) = exp(-|x̃|²/2) [exp(W x̃), exp(-W x̃)] / √(2m), x̃ = x / D^{1/4},
//    with a random Gaussian projection W (m x D, m = D, so F = 2D) held as a parameter. Strictly
//    positive, and E[φ(q)·φ(k)] = exp(q·k / √D): the softmax kernel, approximated with random
//    features (the "positive random features" of Performer / FAVOR+).
//
// Each map is used with linear_attention, causal_linear_attention and RecurrentLinearAttention
// and checked against a small naive O(N²) computation in double. Returns non-zero on failure.
//
//   custom_feature_map [--smoke]
#include <linattn/linattn.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

// ---------------------------------------------------------------------------------------------
// The maps
// ---------------------------------------------------------------------------------------------

struct Relu {
  Eigen::Index feature_dim(Eigen::Index d) const { return d; }

  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x, linattn::MatrixRef<typename Derived::Scalar> phi) const {
    phi = x.cwiseMax(typename Derived::Scalar(0));
  }
};

class PositiveRandomFeatures {
 public:
  /// m = D random directions drawn from N(0, I), fixed by `seed`.
  PositiveRandomFeatures(Eigen::Index input_dim, unsigned seed) : d_(input_dim) {
    std::mt19937 gen(seed);
    std::normal_distribution<double> n01(0.0, 1.0);
    Wt_d_.resize(input_dim, input_dim);  // stored transposed: D x m, so that x * Wt is n x m
    for (Eigen::Index i = 0; i < Wt_d_.size(); ++i) Wt_d_.data()[i] = n01(gen);
    Wt_f_ = Wt_d_.cast<float>();
  }

  Eigen::Index feature_dim(Eigen::Index input_dim) const { return 2 * input_dim; }

  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x, linattn::MatrixRef<typename Derived::Scalar> phi) const {
    using S = typename Derived::Scalar;
    const Eigen::Index m = d_;
    const S scale = S(1) / std::sqrt(std::sqrt(static_cast<S>(d_)));  // x̃ = x / D^{1/4}
    const S norm = S(1) / std::sqrt(static_cast<S>(2 * m));
    // Left half: W x̃ (one GEMM into the caller's buffer, no temporary); right half: -W x̃.
    phi.leftCols(m).noalias() = scale * (x * projection<S>());
    phi.rightCols(m) = -phi.leftCols(m);
    for (Eigen::Index r = 0; r < x.rows(); ++r) {
      const S half_sq = S(0.5) * scale * scale * x.row(r).squaredNorm();
      phi.row(r) = norm * (phi.row(r).array() - half_sq).exp().matrix();
    }
  }

 private:
  template <class S>
  const Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic>& projection() const {
    if constexpr (sizeof(S) == sizeof(float)) return Wt_f_;
    else return Wt_d_;
  }

  Eigen::Index d_;
  Eigen::MatrixXd Wt_d_;
  Eigen::MatrixXf Wt_f_;
};

// ---------------------------------------------------------------------------------------------
// Naive check: sim(q, k) = φ(q)·φ(k) pair by pair, in double, φ evaluated one row at a time.
// ---------------------------------------------------------------------------------------------

template <class Map>
Eigen::MatrixXd naive(const Eigen::MatrixXd& Q, const Eigen::MatrixXd& K, const Eigen::MatrixXd& V,
                      const Map& phi, bool causal) {
  const Eigen::Index F = phi.feature_dim(Q.cols());
  auto features = [&](const Eigen::MatrixXd& X) {
    Eigen::MatrixXd P(X.rows(), F), row(1, F);
    for (Eigen::Index r = 0; r < X.rows(); ++r) {
      phi.map(X.row(r), row);
      P.row(r) = row;
    }
    return P;
  };
  const Eigen::MatrixXd PQ = features(Q), PK = features(K);
  Eigen::MatrixXd out = Eigen::MatrixXd::Zero(Q.rows(), V.cols());
  for (Eigen::Index i = 0; i < Q.rows(); ++i) {
    Eigen::RowVectorXd num = Eigen::RowVectorXd::Zero(V.cols());
    double den = 0;
    for (Eigen::Index j = 0; j < (causal ? i + 1 : K.rows()); ++j) {
      const double w = PQ.row(i).dot(PK.row(j));
      num += w * V.row(j);
      den += w;
    }
    out.row(i) = num * linattn::guarded_inverse(den);  // the library's guard (SPEC §2)
  }
  return out;
}

Eigen::MatrixXf random_matrix(Eigen::Index rows, Eigen::Index cols, unsigned seed, float lo, float hi) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  Eigen::MatrixXf m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = dist(gen);
  return m;
}

template <class Map>
bool run(const char* name, const Map& phi, Eigen::Index N, Eigen::Index D, Eigen::Index M, float lo) {
  const Eigen::MatrixXf Q = random_matrix(N, D, 11, lo, 1.0f), K = random_matrix(N, D, 12, lo, 1.0f);
  const Eigen::MatrixXf V = random_matrix(N, M, 13, -1.0f, 1.0f);
  const Eigen::MatrixXd Qd = Q.cast<double>(), Kd = K.cast<double>(), Vd = V.cast<double>();
  const double tol = 1e-4;

  // Non-causal.
  const Eigen::MatrixXf out = linattn::linear_attention(Q, K, V, phi);
  const double e_full = (out.cast<double>() - naive(Qd, Kd, Vd, phi, false)).cwiseAbs().maxCoeff();

  // Causal, chunked (the parallel form) ...
  const Eigen::MatrixXd ref_causal = naive(Qd, Kd, Vd, phi, true);
  const Eigen::MatrixXf causal = linattn::causal_linear_attention(Q, K, V, phi);
  const double e_causal = (causal.cast<double>() - ref_causal).cwiseAbs().maxCoeff();

  // ... and the recurrent form, token by token, holding the map (and its parameters) by value.
  linattn::RecurrentLinearAttention<Map, float> rnn(D, M, phi);
  Eigen::VectorXf o(M);
  double e_rnn = 0;
  for (Eigen::Index t = 0; t < N; ++t) {
    rnn.step(Q.row(t), K.row(t), V.row(t), o);
    e_rnn = std::max(e_rnn, (o.cast<double>().transpose() - ref_causal.row(t)).cwiseAbs().maxCoeff());
  }

  std::printf("%-24s F = %3ld  max abs err vs naive: linear %.1e  causal %.1e  recurrent %.1e\n", name,
              static_cast<long>(phi.feature_dim(D)), e_full, e_causal, e_rnn);
  return out.allFinite() && causal.allFinite() && e_full < tol && e_causal < tol && e_rnn < tol;
}

int main(int argc, char** argv) {
  const bool smoke = argc > 1 && std::strcmp(argv[1], "--smoke") == 0;
  const Eigen::Index N = smoke ? 200 : 1000, D = 16, M = 8;
  bool ok = true;
  // ReLU with inputs mostly positive, so that denominators are not tiny.
  ok = run("Relu", Relu{}, N, D, M, -0.25f) && ok;
  const PositiveRandomFeatures prf(D, 2024);
  ok = run("PositiveRandomFeatures", prf, N, D, M, -1.0f) && ok;

  // How well do positive random features approximate softmax attention? More features (m)
  // would do better; m = D here. Informative only: an approximation, not an identity.
  {
    const Eigen::MatrixXf Q = random_matrix(N, D, 21, -1.0f, 1.0f), K = random_matrix(N, D, 22, -1.0f, 1.0f);
    const Eigen::MatrixXf V = random_matrix(N, M, 23, -1.0f, 1.0f);
    const Eigen::MatrixXf soft = linattn::softmax_attention(Q, K, V);
    const Eigen::MatrixXf approx = linattn::linear_attention(Q, K, V, prf);
    const Eigen::MatrixXf elu = linattn::linear_attention(Q, K, V, linattn::EluPlusOne{});
    std::printf("vs softmax attention (mean abs difference): positive random features %.4f, "
                "EluPlusOne %.4f (mean |softmax output| %.4f)\n",
                (approx - soft).cwiseAbs().mean(), (elu - soft).cwiseAbs().mean(), soft.cwiseAbs().mean());
  }
  std::printf(ok ? "checks passed\n" : "CHECK FAILED\n");
  return ok ? 0 : 1;
}
