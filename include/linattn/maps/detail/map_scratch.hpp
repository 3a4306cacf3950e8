/// \file maps/detail/map_scratch.hpp
/// \brief Blocks of rows with a scratch buffer on the stack, for the backward of the maps whose
/// gradient needs more than the output (Dpfp, Taylor2) (internal).
#pragma once

#include <Eigen/Core>
#include <algorithm>

#include "../../core/common.hpp"
#include "../feature_map.hpp"

namespace linattn::detail {

// The scalars of the stack buffer of for_row_blocks_with_scratch (32 KiB in double).
inline constexpr Index kMapScratch = 4096;

// Calls f(r0, n, buffer) for consecutive blocks [r0, r0 + n) of `rows` rows, where `buffer`
// points to n·width scalars (uninitialised, at least 16-byte aligned). The blocks have at most
// kMapRowBlock rows (the capacity of RowScratch) and n·width <= kMapScratch, so that the buffer
// is on the stack; only a width above kMapScratch allocates (one block of rows at a time).
template <class S, class F>
void for_row_blocks_with_scratch(Index rows, Index width, F&& f) {
  if (rows <= 0) return;
  if (width <= kMapScratch) {
    alignas(EIGEN_MAX_ALIGN_BYTES > 16 ? EIGEN_MAX_ALIGN_BYTES : 16) S buffer[kMapScratch];
    const Index block = std::min(kMapRowBlock, kMapScratch / std::max<Index>(width, 1));
    for (Index r0 = 0; r0 < rows; r0 += block) f(r0, std::min(block, rows - r0), buffer);
  } else {
    Matrix<S> heap(width, 1);
    for (Index r0 = 0; r0 < rows; ++r0) f(r0, Index(1), heap.data());
  }
}

}  // namespace linattn::detail
