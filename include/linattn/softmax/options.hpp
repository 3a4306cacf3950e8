/// \file softmax/options.hpp
/// \brief The options of softmax attention (SoftmaxAlgorithm), without the kernels.
#pragma once

namespace linattn {

/// Which implementation of softmax attention to run. Both are exact.
enum class SoftmaxAlgorithm {
  /// GEMM tiles with a running maximum and sum per row (online softmax): O(tile) memory.
  Tiled,
  /// The textbook form: materialises the N x L score matrix.
  Naive,
};

}  // namespace linattn
