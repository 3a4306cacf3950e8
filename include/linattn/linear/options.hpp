/// \file linear/options.hpp
/// \brief The options of causal linear attention (CausalAlgorithm, CausalOptions), without the
/// kernels: the gated and delta-rule options build on them.
#pragma once

#include "../core/common.hpp"

namespace linattn {

/// Which algorithm computes causal linear attention. All agree to rounding.
enum class CausalAlgorithm {
  /// Let the library choose: Recurrent while the F x M state fits in L2 (F·M <= 128·128),
  /// where its fused one-pass kernel was measured fastest, else Chunked.
  ///
  /// Accuracy: Recurrent adds every token to the state one by one, Chunked adds a chunk's
  /// sum at once, so in float over very long calls Chunked rounds less (at N = 2^20, D = M = 16:
  /// 1.7e-6 against 1.5e-5 for EluPlusOne, 1.4e-6 against 8.1e-5 for SoftmaxSplit; see
  /// tests/linear/test_long_sequence.cpp). Choose Chunked for float sequences of 10^5+ tokens per call
  /// when that matters more than speed.
  Auto,
  /// Chunks of C rows: GEMMs inside a chunk, the state carried between chunks (spec §3).
  Chunked,
  /// One token at a time: a rank-1 update of the state and a read per token (the RNN form).
  Recurrent,
};

/// Options of causal_linear_attention().
struct CausalOptions {
  /// Rows per chunk of the chunked algorithm; 0 picks the measured default (48).
  Index chunk_size = 0;
  /// The algorithm; Auto picks the fastest for the shape.
  CausalAlgorithm algorithm = CausalAlgorithm::Auto;
};

}  // namespace linattn
