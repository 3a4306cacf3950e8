/// \file linear/options.hpp
/// \brief The options of linear attention (CausalAlgorithm, CausalOptions, HeadOptions), without
/// the kernels: the gated and delta-rule options build on them.
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

/// Options of causal_linear_attention() and its multi-head, batched and recurrent forms.
struct CausalOptions {
  /// Rows per chunk of the chunked algorithm; 0 picks the measured default (48).
  Index chunk_size = 0;
  /// The algorithm; Auto picks the fastest for the shape.
  CausalAlgorithm algorithm = CausalAlgorithm::Auto;
  /// The number of query/key heads Hk when fewer than the H value heads share them (GVA,
  /// grouped value attention); 0 (the default): as many as the value heads. Hk must divide H;
  /// Q and K then hold Hk heads (N x Hk·D), V, the output and the states H, and value head h
  /// reads query/key head h / (H / Hk), as FLA and transformers (`repeat_interleave`) pair
  /// them, without copying. The gradients of a shared head are the sums over its value heads.
  /// A single-head call takes 0 or 1.
  Index key_heads = 0;
  /// The size of one head's keys, D, as the model defines it (0: not stated; the kernels take
  /// D = Q.cols() / Hk). The packed layout alone cannot tell H heads of D = Q.cols() / H from
  /// fewer key heads shared by H value heads; state it and a call whose Q and K do not hold Hk
  /// heads of key_dim is rejected (std::invalid_argument, naming both head counts).
  Index key_dim = 0;
  /// M, one head's value size (0: not stated), checked against V as key_dim is against Q and K.
  Index value_dim = 0;
};

/// \brief The head layout of the non-causal multi-head and batched calls
/// (multihead_linear_attention(), masked_multihead_linear_attention(),
/// batched_linear_attention(), masked_batched_linear_attention() and
/// multihead_linear_attention_backward()), passed before their ParallelOptions: query/key
/// heads shared by several value heads (GVA), as CausalOptions::key_heads for the causal forms.
/// \code
/// linattn::HeadOptions layout;
/// layout.key_heads = 2;  // 8 value heads over 2 query/key heads: Q, K are N x 2·D
/// linattn::multihead_linear_attention(Q, K, V, 8, linattn::EluPlusOne{}, out, ws, layout);
/// \endcode
struct HeadOptions {
  /// Hk, the query/key heads (0: as many as the H value heads); value head h reads query/key
  /// head h / (H / Hk). See CausalOptions::key_heads.
  Index key_heads = 0;
  /// D, one head's key size (0: not stated), checked against Q and K.
  Index key_dim = 0;
  /// M, one head's value size (0: not stated), checked against V.
  Index value_dim = 0;
};

}  // namespace linattn
