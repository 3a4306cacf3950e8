// Downstream program of the consumer tests (tests/consumer/*) built WITHOUT OpenMP: through
// linattn::linattn_serial, or through linattn::linattn after set(LINATTN_OPENMP OFF) before
// find_package / add_subdirectory (tests/consumer/openmp_off). Its build checks that no -fopenmp
// reached it; running it checks that every parallel path then runs serially, with the results
// of num_threads = 1 bit for bit, even when more threads are asked for.
#ifdef _OPENMP
#error "linattn's serial consumer was compiled with OpenMP: the opt-out added -fopenmp"
#endif

#include <linattn/linattn.hpp>

#include <Eigen/Core>

#include <cstdio>

namespace {

int failures = 0;

void expect_same(const char* what, const Eigen::MatrixXf& a, const Eigen::MatrixXf& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols() || !a.allFinite() || !(a.array() == b.array()).all()) {
    std::printf("FAIL: %s: two threads asked for differ from one thread\n", what);
    ++failures;
  }
}

}  // namespace

int main() {
  linattn::ParallelOptions one, two;
  one.num_threads = 1;
  two.num_threads = 2;
  two.min_work_per_thread = 0;  // ask for the parallel paths however small the call
  two.min_rows_per_thread = 1;  // and for the split of one sequence

  const Eigen::Index N = 300, H = 3, D = 8, M = 4;
  const Eigen::MatrixXf Q = Eigen::MatrixXf::Random(N, H * D), K = Eigen::MatrixXf::Random(N, H * D);
  const Eigen::MatrixXf V = Eigen::MatrixXf::Random(N, H * M);
  expect_same("multihead_causal_linear_attention",
              linattn::multihead_causal_linear_attention(Q, K, V, H, linattn::EluPlusOne{}, {}, one),
              linattn::multihead_causal_linear_attention(Q, K, V, H, linattn::EluPlusOne{}, {}, two));
  const Eigen::MatrixXf q = Q.leftCols(D), k = K.leftCols(D), v = V.leftCols(M);
  expect_same("causal_linear_attention",
              linattn::causal_linear_attention(q, k, v, linattn::EluPlusOne{}, {}, one),
              linattn::causal_linear_attention(q, k, v, linattn::EluPlusOne{}, {}, two));

  // The decode step of 5 sequences of H heads.
  linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float> a(5, H, D, M), b(5, H, D, M);
  Eigen::MatrixXf out_a(5, H * M), out_b(5, H * M);
  for (Eigen::Index t = 0; t < 20; ++t) {
    const Eigen::MatrixXf qt = Q.middleRows(5 * t, 5), kt = K.middleRows(5 * t, 5);
    const Eigen::MatrixXf vt = V.middleRows(5 * t, 5);
    a.step(qt, kt, vt, out_a, one);
    b.step(qt, kt, vt, out_b, two);
    expect_same("BatchedRecurrentLinearAttention::step", out_a, out_b);
  }
  if (failures) return 1;
  std::printf("linattn serial consumer OK (no OpenMP)\n");
  return 0;
}
