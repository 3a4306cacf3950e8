/// \file serving/state_io_layers.hpp
/// \brief Saving and loading the B sequences of a delta-rule layer (the `BatchedState` of
/// GatedDeltaNetLayer and KimiDeltaAttentionLayer, a DeltaLayerBatchedState) exactly, in one
/// record of linattn's state format (state_io.hpp, docs/SPEC.md §8): every sequence's
/// convolution state, its heads' delta-rule states and its position. Included by
/// state_io.hpp.
///
/// ### Kind 9: a delta-rule layer's BatchedState (format version 2)
///
/// The header is state_io.hpp's (68 bytes with its CRC; H the value heads, D the key width, F
/// the heads' features, M the value width; flags 0, L = 0), then the payload, then the CRC-32
/// of every byte before it:
///
/// | bytes | field |
/// |------:|-------|
/// | 8     | B, the sequences, u64 |
/// | 8     | W, the short convolution's width, u64 (>= 1) |
/// | 8     | C, its channels (those of q, k and v), u64 |
/// | then for each sequence b = 0 … B − 1: | |
/// | 8     | position, i64 (never negative) |
/// | (W − 1)·C·s | the convolution state, row-major, oldest input first (zeros for a new sequence) |
/// | H·F·M·s | head h's `S` for h = 0 … H − 1, row-major (the last update applied) |
///
/// A file is \f$96 + B\,(8 + s\,((W-1)C + HFM))\f$ bytes for s-byte scalars. The rollback
/// points (BatchedState::keep_snapshots()) are not saved: they belong to the call before the
/// save, and a load drops them (the number kept stays the object's own).
#pragma once

#include <Eigen/Core>

#include <cstdint>
#include <istream>
#include <ostream>
#include <utility>
#include <vector>

#include "../core/common.hpp"
#include "detail/state_io_format.hpp"
#include "detail/state_io_layer_format.hpp"

namespace linattn {

/// \brief Writes every sequence of a delta-rule layer's BatchedState (kind 9): B, the
/// convolution's W and C, then per sequence its position, its convolution state and its heads'
/// states (layout in state_io_layers.hpp), so that load_state() into a state of a layer of the
/// same shape resumes every sequence bit for bit. The rollback points are not written.
/// `state` is not changed.
/// \throws std::runtime_error if the stream was not writable or a write failed.
/// \code
/// linattn::GatedDeltaNetLayer<float> layer(cfg);
/// auto batch = layer.make_batched_state(8);
/// // ... layer.step(Xb, batch, Yb), layer.extend(X, slots, cu_seqlens, batch, Y) ...
/// std::ofstream file("layer0.state", std::ios::binary);
/// linattn::save_state(file, batch);
/// \endcode
/// \param os the binary stream the record is appended to.
/// \param state the sequences to write.
template <class Scalar, class Buffers>
void save_state(std::ostream& os, const DeltaLayerBatchedState<Scalar, Buffers>& state) {
  const auto& dec = state.decoder();
  const Index B = state.sequences(), H = dec.heads(), F = dec.feature_dim(), M = dec.value_dim();
  const Index W = state.conv_kernel_size(), C = state.conv_channels();
  detail::io::Writer w(os, "save_state");
  detail::io::write_header<Scalar>(w, detail::io::kKindDeltaLayer, false, H, dec.key_dim(), F, M,
                                   0);
  w.integer(std::uint64_t(B));
  w.integer(std::uint64_t(W));
  w.integer(std::uint64_t(C));
  std::vector<Scalar> row(static_cast<std::size_t>(M));
  for (Index b = 0; b < B; ++b) {
    detail::io::write_position(w, dec.position(b));
    const auto& conv = state.conv_states()[static_cast<std::size_t>(b)];
    if (conv.size() != 0)
      w.scalars(conv.data(), (W - 1) * C);
    else
      w.zeros<Scalar>((W - 1) * C);  // a new sequence's empty state is zeros
    for (Index h = 0; h < H; ++h)
      for (Index r = 0; r < F; ++r) {
        detail::RecurrentStateAccess::settled_row(dec.decoder(b, h), r, row.data());
        w.scalars(row.data(), M);
      }
  }
  w.finish();
}

/// \brief Restores into `state` the sequences save_state(os, state) wrote: afterwards it holds
/// the file's B sequences (B replaced by the file's), each of which steps and extends exactly
/// as the saved one would have (the same convolution and head bits, the same position). The
/// file must come from a layer of the same shape: H, D, F, M of the heads and W, C of the
/// convolution (the layer's parameters are not recorded). No sequence has rollback points
/// afterwards. Strong guarantee: on any failure `state` is unchanged. Reads exactly one
/// record.
/// \throws std::runtime_error `"linattn::load_state: ..."` for every failure of
/// load_state(std::istream&) (truncated, naming the field and the sequence; corrupted;
/// wrong magic, version, scalar type or kind), "shape mismatch" naming the file's and the
/// state's H, D, F, M or W, C, "absurd shape" for a B beyond the loader's bounds, and
/// "invalid record" for a negative position.
/// \code
/// linattn::GatedDeltaNetLayer<float> layer(cfg);  // the shape that saved it
/// auto batch = layer.make_batched_state(0);
/// std::ifstream file("layer0.state", std::ios::binary);
/// linattn::load_state(file, batch);  // the saved B sequences
/// layer.step(Xb, batch, Yb);         // continues every one of them
/// \endcode
/// \param is the binary stream, positioned at the record.
/// \param state receives the sequences.
template <class Scalar, class Buffers>
void load_state(std::istream& is, DeltaLayerBatchedState<Scalar, Buffers>& state) {
  constexpr const char* fn = "load_state";
  constexpr const char* object = "delta-rule layer's BatchedState";
  std::uint32_t crc = 0;
  const auto hd = detail::io::read_header<Scalar>(is, fn, detail::io::kKindDeltaLayer, crc);
  const auto& dec = state.decoder();
  detail::io::check_object_shape(fn, hd, object, std::uint64_t(dec.heads()),
                                 std::uint64_t(dec.key_dim()), std::uint64_t(dec.feature_dim()),
                                 std::uint64_t(dec.value_dim()), false);
  auto seqs = detail::io::read_layer_payload<Scalar>(is, fn, hd, crc, object,
                                                     state.conv_kernel_size(),
                                                     state.conv_channels());
  using Access = detail::RecurrentStateAccess;
  auto next = state;  // the strong guarantee: every change on a copy
  const Index B = static_cast<Index>(seqs.size());
  while (next.sequences() < B) next.add_sequence();
  while (next.sequences() > B) next.remove_sequence(next.sequences() - 1);
  auto& grid = Access::grid(next.decoder());
  auto& conv = Access::conv_states(next);
  for (Index b = 0; b < B; ++b) {
    auto& r = seqs[static_cast<std::size_t>(b)];
    conv[static_cast<std::size_t>(b)] = std::move(r.conv);
    for (Index h = 0; h < next.decoder().heads(); ++h)
      Access::install(grid.at(b, h), std::move(r.heads[static_cast<std::size_t>(h)]), r.position);
  }
  Access::forget_rollback(next);
  state = std::move(next);
}

}  // namespace linattn
