// Float causal linear attention over a long sequence (N = 2^20, D = M = 16), against the same
// computation in double: the library's double path is validated against the naive O(N²)
// reference in test_causal.cpp, and a naive reference is out of reach at this length.
//
// The state S = Σ_j φ(k_j) v_jᵀ and z = Σ_j φ(k_j) are sums of up to N terms accumulated in
// float, so their rounding error grows with N (like the float accumulation of a sum of N terms:
// O(N·u) in the worst case, closer to O(√N·u) for the random-signed rounding of these inputs,
// u = 2^-24). The outputs divide S by z, which cancels part of it. The bounds below are ~10x
// what was measured (see the comment above the tests); the measured errors are printed.
//
// Labelled "slow" (tests/CMakeLists.txt): the sanitizer stage skips it. About 2-3 s in Release.
#include <linattn/linattn.hpp>

#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cstdio>
#include <string>

#include "test_util.hpp"

namespace {

using linattn::CausalAlgorithm;
using linattn::CausalOptions;
using test::Index;

constexpr Index kN = Index(1) << 20;
constexpr Index kD = 16, kM = 16;

struct Inputs {
  Eigen::MatrixXf Q, K, V;
};

// Queries and keys uniform in [-1, 1]; values uniform in [0, 1], so that S grows linearly with
// the position (all terms of the sums are positive: the accumulation does not average out).
const Inputs& inputs() {
  static const Inputs in = [] {
    Inputs x;
    x.Q = test::random_matrix<float>(kN, kD, 1001);
    x.K = test::random_matrix<float>(kN, kD, 1002);
    x.V = test::random_matrix<float>(kN, kM, 1003, 0.0, 1.0);
    return x;
  }();
  return in;
}

template <class Map>
void check_long(const Map& phi, const char* name, double bound_chunked, double bound_recurrent) {
  const Inputs& in = inputs();
  // The reference: the library in double on exactly the same (float) numbers, chunked.
  Eigen::MatrixXd ref;
  {
    const Eigen::MatrixXd Qd = in.Q.cast<double>(), Kd = in.K.cast<double>(), Vd = in.V.cast<double>();
    CausalOptions chunked;
    chunked.algorithm = CausalAlgorithm::Chunked;
    ref = linattn::causal_linear_attention(Qd, Kd, Vd, phi, chunked);
  }
  for (const CausalAlgorithm algo : {CausalAlgorithm::Chunked, CausalAlgorithm::Recurrent}) {
    CausalOptions opts;
    opts.algorithm = algo;
    const Eigen::MatrixXf out = linattn::causal_linear_attention(in.Q, in.K, in.V, phi, opts);
    ASSERT_TRUE(test::all_finite(out)) << name;
    const double err = test::max_abs_diff(out, ref);
    const bool chunked = algo == CausalAlgorithm::Chunked;
    const std::string what = std::string(name) + (chunked ? " chunked" : " recurrent") +
                             " float vs double, N=2^20 D=M=16";
    test::report_error(what, err);
    // How the error grows along the sequence: max over positions [2^(p-2), 2^p).
    for (int p = 10; p <= 20; p += 2) {
      const Index lo = (Index(1) << p) / 4, n = (Index(1) << p) - lo;
      std::printf("  %s, positions [2^%d, 2^%d): max abs err %.3e\n", what.c_str(), p - 2, p,
                  test::max_abs_diff(out.middleRows(lo, n), ref.middleRows(lo, n)));
    }
    const double bound = chunked ? bound_chunked : bound_recurrent;
    EXPECT_LE(err, bound) << what;
  }
}

// Measured (Release, g++ 12, x86-64; outputs are about 0.5), max abs error over all rows:
//   EluPlusOne    chunked 1.3e-6 (chunk 64) to 1.7e-6 (chunk 48), recurrent 1.5e-5
//   SoftmaxSplit  chunked 4.0e-5, recurrent 8.1e-5
// growing along the sequence (the test prints the error per range of positions). The chunked
// EluPlusOne form sums the state blockwise (one rounding of S and z per chunk), hence its small
// error; the recurrent form, and the normaliser z of SoftmaxSplit (a running prefix sum token by
// token, also in the chunked kernel), round once per token, like a sequential float sum of N
// terms. Bounds: ~10x the measurements.
TEST(long_sequence, EluPlusOneFloatAtTwoToThe20) {
  check_long(linattn::EluPlusOne{}, "EluPlusOne", 1.5e-5, 1.5e-4);
}

TEST(long_sequence, SoftmaxSplitFloatAtTwoToThe20) {
  check_long(linattn::SoftmaxSplit{}, "SoftmaxSplit", 4e-4, 8e-4);
}

}  // namespace
