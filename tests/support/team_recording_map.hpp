// A user feature map, φ(x) = max(x, 0) + 1/4 (positive: no zero denominators), that records
// the largest OpenMP team it has run in: the tests of the thread counts (ParallelOptions, the
// threads that pay) read it to see whether a call opened a parallel region, and how wide.
#pragma once

#include <Eigen/Core>
#include <linattn/common.hpp>

#include <atomic>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linattn_test {

inline std::atomic<int>& largest_team() {
  static std::atomic<int> team{0};
  return team;
}

struct TeamRecordingMap {
  Eigen::Index feature_dim(Eigen::Index d) const { return d; }
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x,
           linattn::MatrixRef<typename Derived::Scalar> phi) const {
#ifdef _OPENMP
    const int team = omp_get_num_threads();
#else
    const int team = 1;
#endif
    int seen = largest_team().load();
    while (team > seen && !largest_team().compare_exchange_weak(seen, team)) {
    }
    using S = typename Derived::Scalar;
    phi = (x.array().max(S(0)) + S(0.25)).matrix();
  }
};

}  // namespace linattn_test
