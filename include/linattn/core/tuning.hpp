/// \file core/tuning.hpp
/// \brief The tuning constants of every kernel in one place (internal): default chunk sizes,
/// the thresholds of the Auto algorithms, row blocks and tiles.
///
/// Each constant says in a clause why it has its value and which benchmark measured it; the
/// figures are in docs/benchmarks.md ("Tuning") and in the commit that set the value. The
/// results do not depend on them beyond rounding: every choice is checked by the tests.
#pragma once

#include <cstddef>

#include "common.hpp"

namespace linattn::detail {

// Rows of Q or K mapped at once by the non-causal kernel: full-speed GEMMs, the n x F block
// in L2 (bench_linear).
inline constexpr Index kLinearRowBlock = 128;

// Chunk of the chunked causal algorithm when CausalOptions::chunk_size is 0: a multiple of the
// micro-kernel's row tile, level with 64 and faster than 32 and 128 (bench_linear's chunk sweep).
inline constexpr Index kDefaultChunk = 48;

// CausalAlgorithm::Auto runs the fused recurrence up to this state size (F·M), where it beat
// every chunk size for D = M = 16 ... 128 (bench_linear, causal forms).
inline constexpr Index kAutoRecurrentMaxState = 128 * 128;

// Chunk of the chunked gated kernels when GatedOptions::chunk_size is 0 (bench_gated).
inline constexpr Index kGatedDefaultChunk = 64;
// Sub-chunk of the per-feature gated kernel when a chunk's gates are too strong to factor:
// keeps e^{±Σg} inside the floating-point range (docs/SPEC.md §9).
inline constexpr Index kGatedSubChunk = 16;

// Chunk of the chunked delta rule and its gradients when DeltaOptions::chunk_size is 0: within
// 2 % of the fastest at D = M = 64 and 128, where 64 is up to 1.5x slower (bench_delta's sweep).
inline constexpr Index kDeltaDefaultChunk = 32;

// The largest state (F·M) for which Auto runs the delta rule's recurrence: it was the faster at
// every size measured, up to 512 x 512, since the chunked form adds 2·C·(F + M) flops per token
// (bench_delta); Chunked beyond the sizes measured.
inline constexpr Index kDeltaAutoRecurrentMaxState = 512 * 512;

// Rows of a sequence every head of a group takes before the group moves on: on packed row-major
// memory a head alone reads with a stride the prefetchers miss; best of 128 ... 2048
// (bench_multihead).
inline constexpr Index kHeadInterleaveRows = 1024;

// The largest block of rows a built-in map processes at once: its per-row scratch then fits on
// the stack, so the maps never allocate.
inline constexpr Index kMapRowBlock = 256;

// Softmax attention's score tile: at most 128 KiB, so it stays in L2 between the exponentials
// and the product with V and Eigen packs it on the stack (bench_softmax).
inline constexpr std::size_t kSoftmaxScoreTileBytes = 128 * 1024;
// Keys per tile of the tiled softmax; fewer queries (a decode step) get longer key tiles.
inline constexpr Index kSoftmaxKeyTile = 128;
// Query tiles of at least this many rows copy the key tile transposed before the score product,
// which then reads it contiguously (bench_softmax).
inline constexpr Index kSoftmaxCopyKeysMinRows = 16;

// Linformer's projection panel: a micro-kernel row tile of P stays in L1 across X's column tiles,
// the panel of X in L2 across P's row tiles (bench_softmax, Linformer).
inline constexpr Index kLinformerPanel = 256;

// Flops a thread of the batched layer's projections must get before a second one starts: about
// 10 µs of one core, against a few µs to start and join a team (bench_layer_serving).
inline constexpr double kLayerProjectionWorkPerThread = double(1 << 21);

// Columns of a projection weight per pass of the batched layer's micro-kernel: a tile's pass
// reads one cache line from each column, and the columns of a large weight are pages apart;
// shorter passes let the next tiles find the same pages still mapped and their lines cached
// (the Gated DeltaNet layer's decode in docs/benchmarks.md).
inline constexpr Index kLayerDepthBlock = 256;

}  // namespace linattn::detail
