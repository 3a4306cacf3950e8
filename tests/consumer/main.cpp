// Minimal downstream program used by the consumer tests (tests/consumer/*):
// it only needs linattn's public interface target to build and run.
#include <linattn/linattn.hpp>
#include <linattn/version.hpp>

#include <Eigen/Dense>

#include <cstdio>

int main() {
  const Eigen::MatrixXf Q = Eigen::MatrixXf::Random(5, 4);
  const Eigen::MatrixXf K = Eigen::MatrixXf::Random(7, 4);
  const Eigen::MatrixXf V = Eigen::MatrixXf::Random(7, 3);

  const Eigen::MatrixXf out = linattn::linear_attention(Q, K, V);

  if (out.rows() != 5 || out.cols() != 3) {
    std::printf("FAIL: expected a 5x3 output, got %dx%d\n", static_cast<int>(out.rows()),
                static_cast<int>(out.cols()));
    return 1;
  }
  if (!out.allFinite()) {
    std::printf("FAIL: output has non-finite values\n");
    return 1;
  }
  std::printf("linattn %s consumer OK\n", LINATTN_VERSION_STRING);
  return 0;
}
