// Quick start: linear attention next to softmax attention on the same random input.
//
//   quickstart           N = 2048, D = M = 64
//   quickstart --smoke   N = 256 (what ctest runs)
//
// Linear attention (EluPlusOne feature map, "Transformers are RNNs") and softmax attention are
// *different* attention mechanisms: the first replaces exp(q·k/√D) by φ(q)·φ(k) so that the
// product can be re-associated and costs O(N·D·M) instead of O(N²·D). Their outputs are not
// expected to agree; the difference printed below is a property of the two models, not an
// error. What must hold for both is that each output row is a convex combination of value rows
// (all weights are positive and sum to one): that is what this program checks.
#include <linattn/linattn.hpp>

#include <Eigen/Core>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>

namespace {

Eigen::MatrixXf random_matrix(Eigen::Index rows, Eigen::Index cols, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Eigen::MatrixXf m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = dist(gen);
  return m;
}

// Runs f() `reps` times and returns the best time in milliseconds.
template <class F>
double best_ms(int reps, F&& f) {
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return best;
}

// Every output entry lies within the range of its value column (up to rounding).
bool rows_are_convex_combinations(const Eigen::MatrixXf& out, const Eigen::MatrixXf& V) {
  if (!out.allFinite()) return false;
  for (Eigen::Index c = 0; c < V.cols(); ++c) {
    const float lo = V.col(c).minCoeff(), hi = V.col(c).maxCoeff(), slack = 1e-4f * (hi - lo + 1.0f);
    if (out.col(c).minCoeff() < lo - slack || out.col(c).maxCoeff() > hi + slack) return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const bool smoke = argc > 1 && std::strcmp(argv[1], "--smoke") == 0;
  const Eigen::Index N = smoke ? 256 : 2048, D = 64, M = 64;
  const Eigen::MatrixXf Q = random_matrix(N, D, 1), K = random_matrix(N, D, 2), V = random_matrix(N, M, 3);

  // The two mechanisms, through the allocation-free overloads (output and workspace reused).
  Eigen::MatrixXf lin(N, M), soft(N, M);
  linattn::Workspace<float> ws_lin, ws_soft;
  const int reps = smoke ? 2 : 5;
  const double t_lin = best_ms(reps, [&] { linattn::linear_attention(Q, K, V, linattn::EluPlusOne{}, lin, ws_lin); });
  const double t_soft = best_ms(reps, [&] { linattn::softmax_attention(Q, K, V, soft, ws_soft); });

  // Causal variants too: query i only sees keys j <= i.
  Eigen::MatrixXf clin(N, M), csoft(N, M);
  linattn::Workspace<float> ws_clin;
  const double t_clin = best_ms(reps, [&] {
    linattn::LinearAttentionState<float> state;  // fresh state: start of the sequence
    linattn::causal_linear_attention(Q, K, V, linattn::EluPlusOne{}, state, clin, ws_clin);
  });
  const double t_csoft = best_ms(reps, [&] { linattn::causal_softmax_attention(Q, K, V, csoft, ws_soft); });

  std::printf("linattn quick start: N = %ld, D = %ld, M = %ld (float)\n", static_cast<long>(N),
              static_cast<long>(D), static_cast<long>(M));
  std::printf("  %-34s %10.3f ms\n", "linear attention (EluPlusOne)", t_lin);
  std::printf("  %-34s %10.3f ms\n", "softmax attention (tiled)", t_soft);
  std::printf("  %-34s %10.3f ms\n", "causal linear attention", t_clin);
  std::printf("  %-34s %10.3f ms\n", "causal softmax attention", t_csoft);
  std::printf("  max |linear - softmax|               = %.4f\n", (lin - soft).cwiseAbs().maxCoeff());
  std::printf("  max |causal linear - causal softmax| = %.4f\n", (clin - csoft).cwiseAbs().maxCoeff());
  std::printf("  (linear and softmax attention are different mechanisms: these differences are\n"
              "   expected and are not numerical errors; max |V| = %.2f for scale)\n",
              V.cwiseAbs().maxCoeff());

  bool ok = true;
  for (const auto* out : {&lin, &soft, &clin, &csoft}) ok = ok && rows_are_convex_combinations(*out, V);
  // The first causal row sees only key 0: both mechanisms return v_0 there.
  ok = ok && (clin.row(0) - V.row(0)).cwiseAbs().maxCoeff() < 1e-5f;
  ok = ok && (csoft.row(0) - V.row(0)).cwiseAbs().maxCoeff() < 1e-5f;
  // The recurrent form of causal linear attention gives the same rows as the chunked one.
  linattn::CausalOptions rec;
  rec.algorithm = linattn::CausalAlgorithm::Recurrent;
  const Eigen::MatrixXf clin_rec = linattn::causal_linear_attention(Q, K, V, linattn::EluPlusOne{}, rec);
  const float rec_diff = (clin_rec - clin).cwiseAbs().maxCoeff();
  std::printf("  causal linear: chunked vs recurrent  = %.2e (same mechanism: rounding only)\n", rec_diff);
  ok = ok && rec_diff < 1e-4f;

  std::printf(ok ? "checks passed\n" : "CHECK FAILED\n");
  return ok ? 0 : 1;
}
