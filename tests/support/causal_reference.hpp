// Naive references and helpers for the causal, recurrent and masked tests (test_causal.cpp,
// test_recurrent.cpp, test_masks.cpp), complementing reference.hpp.
//
// Like reference.hpp these are written straight from docs/SPEC.md, in double and O(N²), pair by
// pair; nothing here calls a kernel of the library.
#pragma once

#include "reference.hpp"
#include "test_util.hpp"

#include <linattn/causal_linear_attention.hpp>
#include <linattn/common.hpp>
#include <linattn/elu_plus_one.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/normalized_cosine.hpp>
#include <linattn/softmax_split.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace cref {

using Index = Eigen::Index;
using Mat = Eigen::MatrixXd;
using Vec = Eigen::VectorXd;
using RowVec = Eigen::RowVectorXd;
using BoolVec = Eigen::Matrix<bool, Eigen::Dynamic, 1>;

/// A user-defined feature map, as the feature_map.hpp documentation shows it: ReLU, F = D.
/// Not strictly positive: a query with no positive entry has a zero denominator (and a zero row).
struct Relu {
  // A user map on the kernels' token-major path for row-major inputs (feature_map.hpp), whose
  // features may be 0: denominators of 0 and the cancellation test go through it too.
  static constexpr bool elementwise = true;
  Eigen::Index feature_dim(Eigen::Index d) const { return d; }
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x,
           linattn::MatrixRef<typename Derived::Scalar> phi) const {
    phi = x.cwiseMax(typename Derived::Scalar(0));
  }
};

/// The naive causal reference of reference.hpp for any map (SoftmaxSplit: the per-feature
/// prefix softmax; Relu: the generic pair-by-pair reference).
template <class Map>
Mat causal(const Mat& Q, const Mat& K, const Mat& V, const Map& map, Vec* den = nullptr) {
  return ref::causal_linear_attention(Q, K, V, map, den);
}

/// sim(q, k) of a row-wise map, pair by pair (not for SoftmaxSplit).
template <class Map>
struct PairSim {
  Mat PQ, PK;
  PairSim(const Mat& Q, const Mat& K, const Map& map);
  double operator()(Index i, Index j) const { return PQ.row(i).dot(PK.row(j)); }
};

template <class Map>
PairSim<Map>::PairSim(const Mat& Q, const Mat& K, const Map& map) {
  if constexpr (std::is_same_v<Map, linattn::EluPlusOne>) {
    PQ = ref::elu_plus_one_features(Q);
    PK = ref::elu_plus_one_features(K);
  } else if constexpr (std::is_same_v<Map, linattn::NormalizedCosine>) {
    // φ(x) = [1, x̂] (spec §2), so φ(q)·φ(k) = 1 + q̂·k̂.
    PQ.resize(Q.rows(), Q.cols() + 1);
    PK.resize(K.rows(), K.cols() + 1);
    PQ.col(0).setOnes();
    PK.col(0).setOnes();
    PQ.rightCols(Q.cols()) = ref::unit_rows(Q);
    PK.rightCols(K.cols()) = ref::unit_rows(K);
  } else {
    PQ = ref::features_row_by_row(Q, map);
    PK = ref::features_row_by_row(K, map);
  }
}

/// The condition of every output row, κ_i = Σ_j |φ(q_i)|·|φ(k_j)| / Σ_j φ(q_i)·φ(k_j) over the
/// keys row i attends to (the kept ones, j <= i when causal); +inf when the denominator is 0.
/// The rounding errors of a row's numerator and denominator are relative to the sum of
/// absolute terms, so the output error scales with κ_i: 1 for positive maps (EluPlusOne, ReLU),
/// large for NormalizedCosine when keys point away from the query (1 + cos cancels). 1 for
/// SoftmaxSplit, whose weights are positive.
template <class Map>
Vec row_condition(const Mat& Q, const Mat& K, const Map& map, bool causal,
                  const BoolVec* keep = nullptr) {
  Vec kappa = Vec::Ones(Q.rows());
  if constexpr (!linattn::normalizes_keys_per_feature_v<Map>) {
    const PairSim<Map> sim(Q, K, map);
    const Mat AQ = sim.PQ.cwiseAbs(), AK = sim.PK.cwiseAbs();
    for (Index i = 0; i < Q.rows(); ++i) {
      double num = 0, den = 0;
      const Index end = causal ? std::min(i + 1, K.rows()) : K.rows();
      for (Index j = 0; j < end; ++j) {
        if (keep && !(*keep)(j)) continue;
        num += AQ.row(i).dot(AK.row(j));
        den += sim(i, j);
      }
      kappa(i) = num == 0 ? 1.0 : (den > 0 ? num / den : std::numeric_limits<double>::infinity());
    }
  }
  return kappa;
}

/// Masked causal linear attention, naive (spec §1 with j ≤ i and only kept keys):
///   out_i = Σ_{j ≤ i, keep_j} sim(q_i, k_j) v_j / max(Σ_{j ≤ i, keep_j} sim(q_i, k_j), ε).
/// A query that has seen no kept key gets a zero row. For SoftmaxSplit, the per-feature
/// prefix softmax runs over the kept keys j ≤ i only.
template <class Map>
Mat masked_causal(const Mat& Q, const Mat& K, const Mat& V, const BoolVec& keep, const Map& map) {
  ref::check_causal(Q, K);
  const Index N = Q.rows(), M = V.cols();
  Mat out = Mat::Zero(N, M);
  if constexpr (linattn::normalizes_keys_per_feature_v<Map>) {
    const Mat PQ = ref::softmax_rows(Q);
    const Index D = Q.cols();
    for (Index i = 0; i < N; ++i) {
      for (Index d = 0; d < D; ++d) {
        double m = -std::numeric_limits<double>::infinity();
        for (Index j = 0; j <= i; ++j)
          if (keep(j)) m = std::max(m, K(j, d));
        if (m == -std::numeric_limits<double>::infinity()) continue;  // no kept key yet
        RowVec num = RowVec::Zero(M);
        double sum = 0;
        for (Index j = 0; j <= i; ++j) {
          if (!keep(j)) continue;
          const double e = std::exp(K(j, d) - m);
          num += e * V.row(j);
          sum += e;
        }
        out.row(i) += PQ(i, d) * num / sum;
      }
    }
  } else {
    const PairSim<Map> sim(Q, K, map);
    for (Index i = 0; i < N; ++i) {
      RowVec num = RowVec::Zero(M);
      double den = 0;
      for (Index j = 0; j <= i; ++j) {
        if (!keep(j)) continue;
        const double w = sim(i, j);
        num += w * V.row(j);
        den += w;
      }
      out.row(i) = num * linattn::guarded_inverse(den);  // SPEC §2: degenerate rows are 0
    }
  }
  return out;
}

/// The rows of X whose keep flag is set, in order.
inline Mat kept_rows(const Mat& X, const BoolVec& keep) {
  Mat out(keep.count(), X.cols());
  Index r = 0;
  for (Index j = 0; j < X.rows(); ++j)
    if (keep(j)) out.row(r++) = X.row(j);
  return out;
}

/// A random mask (each key kept with probability p), seeded.
inline BoolVec random_mask(Index n, std::uint32_t seed, double p) {
  std::mt19937 gen(seed);
  std::bernoulli_distribution keep(p);
  BoolVec m(n);
  for (Index j = 0; j < n; ++j) m(j) = keep(gen);
  return m;
}

/// CausalOptions with an algorithm and a chunk size.
inline linattn::CausalOptions options(linattn::CausalAlgorithm algorithm, Index chunk) {
  linattn::CausalOptions o;
  o.algorithm = algorithm;
  o.chunk_size = chunk;
  return o;
}

inline const char* algorithm_name(linattn::CausalAlgorithm a) {
  return a == linattn::CausalAlgorithm::Chunked     ? "chunked"
         : a == linattn::CausalAlgorithm::Recurrent ? "recurrent"
                                                    : "auto";
}

/// Double copy of any Eigen matrix.
template <class Derived>
Mat to_double(const Eigen::MatrixBase<Derived>& x) {
  return x.template cast<double>();
}

template <class Map>
constexpr const char* map_name() {
  if constexpr (std::is_same_v<Map, linattn::EluPlusOne>) return "EluPlusOne";
  else if constexpr (std::is_same_v<Map, linattn::SoftmaxSplit>) return "SoftmaxSplit";
  else if constexpr (std::is_same_v<Map, linattn::NormalizedCosine>) return "NormalizedCosine";
  else return "Relu";
}

/// Inputs for a map: uniform in [-1, 1], except for Relu, whose queries and keys are shifted to
/// [-0.25, 1] so that denominators stay well above the guard ε (a query with no positive entry
/// still occurs for D = 1 and then gives a zero row in both the kernel and the reference).
template <class S, class Map>
test::Mat<S> qk_input(Index rows, Index cols, std::uint32_t seed) {
  if constexpr (std::is_same_v<Map, Relu>) return test::random_matrix<S>(rows, cols, seed, -0.25, 1.0);
  else return test::random_matrix<S>(rows, cols, seed);
}

}  // namespace cref
