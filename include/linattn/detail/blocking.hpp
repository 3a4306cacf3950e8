/// \file detail/blocking.hpp
/// \brief Block sizes and small helpers shared by the kernels (internal).
#pragma once

#include <Eigen/Core>

#include <algorithm>

#include "../common.hpp"

namespace linattn::detail {

// Rows of Q or K mapped through the feature map at once in the non-causal kernel: large
// enough that the GEMMs run at full speed, small enough that the n x F block stays in L2.
inline constexpr Index kLinearRowBlock = 128;

// Workspace slots, so that kernels sharing a Workspace do not fight over a buffer.
enum Slot : int {
  kSlotPhiQ = 0,
  kSlotPhiK = 1,
  kSlotState = 2,
  kSlotNormalizer = 3,
  kSlotScores = 4,
  kSlotRowA = 5,
  kSlotRowB = 6,
  kSlotExtra = 7,
  kSlotPrefix = 8,
  kSlotKeys = 9,
};

// Chunk length of the causal kernels when the caller does not choose one (see
// docs/benchmarks.md for the measurements behind it).
inline constexpr Index kDefaultChunk = 64;

// den_i <- 1 / max(den_i, eps): the one guard every algorithm shares. Kernels scale the rows
// of φ(Q) (small and contiguous) by it before the GEMM instead of dividing output rows, which
// are strided in the caller's column-major output.
template <class Den>
void invert_guarded(Den&& den) {
  using S = typename std::decay_t<Den>::Scalar;
  den = den.cwiseMax(denominator_epsilon<S>()).cwiseInverse();
}

}  // namespace linattn::detail
