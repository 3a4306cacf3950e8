/// \file detail/blocking.hpp
/// \brief Block sizes and small helpers shared by the kernels (internal).
#pragma once

#include <Eigen/Core>

#include <algorithm>

#include "../common.hpp"

namespace linattn::detail {

// Rows of Q or K mapped through the feature map at once in the non-causal kernel: large
// enough that the GEMMs run at full speed, small enough that the n x F block stays in L2.
inline constexpr Index kLinearRowBlock = 256;

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

// out_i /= max(den_i, eps) for every row: the one guard every algorithm shares.
template <class Out, class Den>
void divide_rows_guarded(Out&& out, const Den& den) {
  using S = typename std::decay_t<Out>::Scalar;
  for (Index i = 0; i < out.rows(); ++i)
    out.row(i) *= S(1) / std::max(den(i), denominator_epsilon<S>());
}

}  // namespace linattn::detail
