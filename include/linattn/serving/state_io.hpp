/// \file serving/state_io.hpp
/// \brief Saving a state to a stream and loading it back, exactly: a LinearAttentionState, or
/// the whole decoding position of a RecurrentLinearAttention, a
/// MultiHeadRecurrentLinearAttention, a RecurrentGatedAttention, a RecurrentDeltaRule
/// (state_io_decoders.hpp), a BatchedRecurrentLinearAttention, a LinearAttentionLayer::State or
/// a SoftmaxAttentionLayer::State (its KV cache), in a little-endian binary format with a
/// checksum (docs/SPEC.md §8, "What linattn implements: saving a state"). The checksum is
/// linattn::checksum() (checksum.hpp), for an engine's own records beside these.
///
/// ### The format (version 2)
///
/// Every integer is little-endian whatever the host; every scalar is the IEEE 754 bit pattern
/// (binary32 for float, binary64 for double) written as a little-endian integer, so a file
/// moves between machines and a loaded state has the saved bits.
///
/// | offset | bytes | field |
/// |-------:|------:|-------|
/// | 0  | 8 | magic number `89 4C 41 53 0D 0A 1A 0A` (`\x89LAS\r\n\x1a\n`) |
/// | 8  | 4 | format version, u32 = 2 |
/// | 12 | 4 | scalar type, u32: 1 = float (binary32), 2 = double (binary64) |
/// | 16 | 4 | kind, u32: 1 = LinearAttentionState, 2 = RecurrentLinearAttention, 3 = MultiHeadRecurrentLinearAttention or LinearAttentionLayer::State, 4 = RecurrentGatedAttention (read, no longer written), 5 = BatchedRecurrentLinearAttention, 6 = SoftmaxAttentionLayer::State (KV cache), 7 = RecurrentDeltaRule, 8 = RecurrentGatedAttention, 9 = a delta-rule layer's BatchedState (4 to 9: version 2 only; 7 and 8 have compact records, state_io_decoders.hpp; 9: state_io_layers.hpp) |
/// | 20 | 4 | flags, u32: bit 0 = running maxima `m` present (SoftmaxSplit); bit 1 / bit 2 = a kind-7 or kind-8 record of a decoder that keeps S in bf16 / half (state_io_decoders.hpp); other bits 0 |
/// | 24 | 8 | heads H, u64 (1 for kinds 1, 2 and 4; for kind 5 the heads per sequence) |
/// | 32 | 8 | key dimension D, u64 (0 for kind 1: a state does not know it) |
/// | 40 | 8 | feature dimension F, u64 (0 for kind 6: no feature map) |
/// | 48 | 8 | value dimension M, u64 |
/// | 56 | 8 | log-decay entries per head L, u64: 0 (undecayed), 1 (scalar decay) or F (per-feature gates); 0 with running maxima; F for kind 4; 0 for kind 6 |
/// | 64 | 4 | CRC-32 of bytes 0–63 |
/// | 68 | … | H head records, one after the other (below); for kind 5 instead B and B·H records, for kind 6 T and the cached rows (below) |
/// | end − 4 | 4 | CRC-32 of every byte before it |
///
/// A head record (s = 4 or 8 bytes per scalar; matrices row-major):
///
/// | bytes | field |
/// |------:|-------|
/// | 8     | position, i64 (two's complement; 0 for kind 1; never negative) |
/// | 8     | tokens in the low parts since their last fold, u64 (below 128; 0 for kinds 1 and 4) |
/// | F·M·s | `S` |
/// | F·M·s | `S_lo` (zeros when the state's low part is empty; all bits 0 for kind 4) |
/// | F·s   | `z` |
/// | F·s   | `z_lo` (zeros when empty; all bits 0 for kind 4) |
/// | F·s   | `m`, only when flag bit 0 is set |
/// | L·s   | `log_decay` (LinearAttentionState::log_decay), only when L > 0; entries <= 0 or −∞ |
///
/// The file is 72 + H·(16 + s·(2·F·M + 2·F [+ F] + L)) bytes.
///
/// **Kind 5** (a BatchedRecurrentLinearAttention of B sequences of H heads): the payload at 68
/// starts with the number of sequences B, u64 (B = 0 is an empty decoder, and then L = 0),
/// followed by B·H head records as above, sequence-major: head h of sequence b is record
/// b·H + h. Each record holds that (sequence, head)'s state and unfolded token count, and the
/// position of its sequence, the same in all H records of a sequence. The trailing CRC covers
/// B too. The file is 72 + 8 + B·H·(16 + s·(2·F·M + 2·F [+ F] + L)) bytes.
///
/// **LinearAttentionLayer::State** is saved as kind 3: its H heads' records, each with the
/// State's position (all equal; the loader refuses heads at different positions), exactly the
/// bytes of save_state(os, state.heads()). Its position() comes back from the records.
///
/// **Kind 6** (a SoftmaxAttentionLayer::State, the KV cache of H heads of key size D and value
/// size M; flags 0, F = 0, L = 0): the payload at 68 is the number of cached tokens T, u64
/// (the State's position(); T = 0 is an empty cache), then the T key rows, T x H·D scalars
/// row-major (token t's keys of head h at columns h·D to h·D + D − 1), then the T value rows,
/// T x H·M scalars row-major; the trailing CRC covers all of it. Only the live rows are
/// written, not the reserved capacity. The file is 72 + 8 + s·T·H·(D + M) bytes.
///
/// The CRC-32 is the common one
/// (reflected polynomial 0xEDB88320, initial value and final XOR 0xFFFFFFFF; "123456789" gives
/// 0xCBF43926): it detects every error of one bit and every burst of up to 32.
///
/// **Version 1** (linattn before decayed states) is still read, exactly as before: its header
/// has no L field (bytes 0–55 as above with version 1, the CRC-32 of bytes 0–55 at 56, the
/// records from 60), its records no `log_decay`, and a loaded state has an empty `log_decay`.
/// The file is 64 + H·(16 + s·(2·F·M + 2·F [+ F])) bytes. Only version 2 is written.
#pragma once

#include <Eigen/Core>

#include <cstddef>
#include <cstdint>
#include <istream>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "../linear/batched_recurrent.hpp"
#include "../core/detail/checks.hpp"
#include "../core/checksum.hpp"
#include "../core/common.hpp"
#include "detail/state_io_format.hpp"
#include "../maps/feature_map.hpp"
#include "../linear/multihead.hpp"
#include "../gated/recurrent_gated_attention.hpp"
#include "../linear/recurrent_linear_attention.hpp"
#include "../core/state.hpp"
#include "state_io_decoders.hpp"
#include "state_io_kv_cache.hpp"
#include "state_io_layers.hpp"
#include "../maps/map_state.hpp"

namespace linattn {

/// \brief Writes `state` to `os` in linattn's binary state format (kind 1; layout in
/// state_io.hpp and docs/SPEC.md §8), bit for bit: the high parts \f$S, z\f$, the compensated
/// low parts \f$S_{lo}, z_{lo}\f$ (zeros when empty), for SoftmaxSplit the running maxima
/// \f$m\f$ (including \f$-\infty\f$ for features before any key), and for a decayed state its
/// total log-decay LinearAttentionState::log_decay (L = 0, 1 or F entries). load_state() gives
/// back a state equal to it in every bit.
///
/// The file (format version 2) is \f$72 + 16 + s\,(2FM + 2F\,[+F] + L)\f$ bytes for s-byte
/// scalars; it records F, M, L and the presence of maxima, not the feature map: load it only
/// for the map that made it.
/// Open files in binary mode (`std::ios::binary`). The stream is flushed; its state is
/// checked after every write, whatever its exception mask.
/// \throws std::invalid_argument if the state's parts disagree in shape (z not F entries, a
/// low part neither empty nor of its high part's shape, m neither empty nor F entries), or
/// its log_decay has neither 0, 1 nor F entries or an entry that is NaN or > 0 (which no load
/// accepts: a total of log gates is <= 0), or it has both maxima and a log-decay.
/// \throws std::runtime_error naming the cause if the stream was not writable or a write
/// failed (the stream then holds part of a record).
/// \code
/// auto state = linattn::summarize(K, V, linattn::EluPlusOne{});
/// std::ofstream file("prompt.state", std::ios::binary);
/// linattn::save_state(file, state);
/// \endcode
/// \param os the binary stream the record is appended to.
/// \param state the state written, unchanged.
template <class Scalar>
void save_state(std::ostream& os, const LinearAttentionState<Scalar>& state) {
  constexpr const char* fn = "save_state";
  const Index F = state.S.rows(), M = state.S.cols();
  const bool consistent =
      state.z.size() == F && (state.m.size() == 0 || state.m.size() == F) &&
      (state.S_lo.size() == 0 || (state.S_lo.rows() == F && state.S_lo.cols() == M)) &&
      (state.z_lo.size() == 0 || state.z_lo.size() == F);
  if (!consistent)
    detail::throw_invalid(fn, "the state's parts disagree in shape: S is " +
                                  detail::shape_of(state.S) + ", z has " +
                                  std::to_string(state.z.size()) + " entries, m " +
                                  std::to_string(state.m.size()) + ", S_lo is " +
                                  detail::shape_of(state.S_lo) + ", z_lo has " +
                                  std::to_string(state.z_lo.size()));
  const Index decay = detail::io::decay_entries(fn, state);
  detail::io::Writer w(os, fn);
  detail::io::write_header<Scalar>(w, detail::io::kKindState, state.m.size() != 0, 1, 0, F, M,
                                   decay);
  detail::io::write_head(w, state, 0, 0);
  w.finish();
}

/// \brief Reads a state that save_state() wrote: \f$S, S_{lo}, z, z_{lo}\f$ (and \f$m\f$,
/// `log_decay`) with the saved bits; the low parts are always sized (zeros if the saved
/// state's were empty). Files of format version 1 (written before decayed states existed)
/// load exactly as before, with an empty `log_decay`.
///
/// Reads exactly one record, leaving the stream just after it (records may follow each
/// other in one stream). Allocates nothing beyond what the stream actually delivers (plus 1
/// MiB): a header that declares a huge state is refused by the sanity bounds (64 GiB, 2²⁴ per
/// dimension), or, when the stream can tell its length, before any payload is read.
/// \tparam Scalar float or double: must be the saved type (no conversion).
/// \throws std::runtime_error `"linattn::load_state: ..."` naming the problem: the stream not
/// readable; a truncated file ("truncated file: expected 16384 bytes of S, got 100"); a wrong
/// magic number; an unsupported version; a corrupted header or payload (checksum mismatch); a
/// wrong scalar type; a wrong kind (a recurrent object's file); invalid or absurd shapes
/// (including a log-decay size other than 0, 1 or F, or one with running maxima); an
/// impossible value, though the checksums are right ("invalid record": a position other than
/// 0, or a log-decay entry that is NaN or > 0). The stream's position is then unspecified.
/// \code
/// std::ifstream file("prompt.state", std::ios::binary);
/// auto state = linattn::load_state<float>(file);
/// linattn::causal_linear_attention(Q, K, V, linattn::EluPlusOne{}, state);  // continue
/// \endcode
/// \param is the binary stream, positioned at the record.
/// \return the state the record holds.
template <class Scalar>
LinearAttentionState<Scalar> load_state(std::istream& is) {
  constexpr const char* fn = "load_state";
  std::uint32_t crc = 0;
  const auto hd = detail::io::read_header<Scalar>(is, fn, detail::io::kKindState, crc);
  auto heads = detail::io::read_payload<Scalar>(is, fn, hd, crc);
  return std::move(heads.front().state);
}

/// \brief Writes the exact decoding position of `rnn` (kind 2): its state as the object holds
/// it, low parts not folded, the number of tokens in them since their last fold, and
/// position(). Loading it into an object of the same shapes with load_state(is, rnn) and
/// stepping on gives outputs bit-identical to `rnn`'s own: a decode can stop, move to another
/// process or machine, and resume as if it had never stopped.
///
/// Between folds (every \f$128\f$ tokens) \f$S = S_{hi} + S_{lo}\f$ holds the latest tokens in
/// \f$S_{lo}\f$; saving state() instead would fold them, and the resumed decode would round
/// differently from then on (equal only to rounding).
/// \throws std::runtime_error if the stream was not writable or a write failed;
/// std::invalid_argument if a state's log_decay (normally empty here: set_state() copies
/// it) has neither 0, 1 nor F entries.
/// \code
/// linattn::RecurrentLinearAttention<linattn::EluPlusOne, float> rnn(64, 64);
/// // ... rnn.step(q, k, v, out) for the prompt and some tokens ...
/// std::ofstream file("conversation.state", std::ios::binary);
/// linattn::save_state(file, rnn);
/// \endcode
/// \param os the binary stream the record is appended to.
/// \param rnn the recurrent form whose state and position are written.
template <class FeatureMap, class Scalar>
void save_state(std::ostream& os, const RecurrentLinearAttention<FeatureMap, Scalar>& rnn) {
  using Access = detail::RecurrentStateAccess;
  const Index decay = detail::io::decay_entries("save_state", Access::state(rnn));
  detail::io::Writer w(os, "save_state");
  detail::io::write_header<Scalar>(w, detail::io::kKindRecurrent,
                                   normalizes_keys_per_feature_v<FeatureMap>, 1, rnn.key_dim(),
                                   rnn.feature_dim(), rnn.value_dim(), decay);
  detail::io::write_head(w, Access::state(rnn), rnn.position(), Access::unfolded(rnn));
  w.finish();
}

/// \brief Restores into `rnn` a decoding position that save_state(os, rnn) wrote: afterwards
/// `rnn` steps exactly as the saved object would have (same state bits, fold schedule and
/// position()).
///
/// The file must come from an object of the same key dimension D, feature dimension F,
/// value dimension M and map (running maxima or not); the map itself is not recorded. Strong
/// guarantee: on any failure `rnn` is unchanged (everything is read and checked before it
/// is touched). Reads exactly one record.
/// \throws std::runtime_error `"linattn::load_state: ..."` for every failure of
/// load_state(std::istream&) (truncated, corrupted, wrong magic, version, scalar type or
/// kind, absurd shapes), and "shape mismatch" naming the file's and the object's D, F, M and
/// maxima.
/// \code
/// linattn::RecurrentLinearAttention<linattn::EluPlusOne, float> rnn(64, 64);
/// std::ifstream file("conversation.state", std::ios::binary);
/// linattn::load_state(file, rnn);
/// rnn.step(q, k, v, out);  // continues the saved decode
/// \endcode
/// \param is the binary stream, positioned at the record.
/// \param rnn continues from the loaded state and position.
template <class FeatureMap, class Scalar>
void load_state(std::istream& is, RecurrentLinearAttention<FeatureMap, Scalar>& rnn) {
  constexpr const char* fn = "load_state";
  std::uint32_t crc = 0;
  const auto hd = detail::io::read_header<Scalar>(is, fn, detail::io::kKindRecurrent, crc);
  detail::io::check_object_shape(fn, hd, "RecurrentLinearAttention", 1,
                                 std::uint64_t(rnn.key_dim()), std::uint64_t(rnn.feature_dim()),
                                 std::uint64_t(rnn.value_dim()),
                                 normalizes_keys_per_feature_v<FeatureMap>);
  auto heads = detail::io::read_payload<Scalar>(is, fn, hd, crc);
  auto& r = heads.front();
  detail::RecurrentStateAccess::install(rnn, std::move(r.state), r.position, r.unfolded);
}

/// \brief Writes the exact decoding position of every head of `rnn` (kind 3): one record per
/// head as for save_state(os, RecurrentLinearAttention), so that load_state(is, rnn) resumes
/// all heads bit-identically.
/// \throws std::runtime_error if the stream was not writable or a write failed;
/// std::invalid_argument if a state's log_decay (normally empty here: set_state() copies
/// it) has neither 0, 1 nor F entries, or the heads' differ in size.
/// \code
/// linattn::MultiHeadRecurrentLinearAttention<linattn::SoftmaxSplit, double> rnn(8, 64, 64);
/// // ... rnn.step(q, k, v, out) ...
/// std::ostringstream saved(std::ios::binary);
/// linattn::save_state(saved, rnn);
/// \endcode
/// \param os the binary stream the record is appended to.
/// \param rnn the recurrent form whose state and position are written.
template <class FeatureMap, class Scalar>
void save_state(std::ostream& os, const MultiHeadRecurrentLinearAttention<FeatureMap, Scalar>& rnn) {
  using Access = detail::RecurrentStateAccess;
  const auto& first = rnn.head(0);
  const Index decay = detail::io::decay_entries("save_state", Access::state(first));
  for (Index h = 1; h < rnn.heads(); ++h)
    if (detail::io::decay_entries("save_state", Access::state(rnn.head(h))) != decay)
      detail::throw_invalid("save_state", "the heads' log-decays differ in size: head 0 has " +
                                              std::to_string(decay) + " entries, head " +
                                              std::to_string(h) + " has " +
                                              std::to_string(Access::state(rnn.head(h)).log_decay.size()));
  detail::io::Writer w(os, "save_state");
  detail::io::write_header<Scalar>(w, detail::io::kKindMultiHead,
                                   normalizes_keys_per_feature_v<FeatureMap>, rnn.heads(),
                                   first.key_dim(), first.feature_dim(), first.value_dim(), decay);
  for (Index h = 0; h < rnn.heads(); ++h)
    detail::io::write_head(w, Access::state(rnn.head(h)), rnn.head(h).position(),
                           Access::unfolded(rnn.head(h)));
  w.finish();
}

/// \brief Restores every head of `rnn` from a file that save_state(os, rnn) wrote; the heads
/// then step exactly as the saved object's would have.
///
/// The file must have as many heads as `rnn`, each of the same D, F, M and maxima. Strong
/// guarantee: on any failure no head has changed.
/// \throws std::runtime_error as load_state(is, RecurrentLinearAttention&), the shape
/// mismatch naming the head counts too.
/// \code
/// linattn::MultiHeadRecurrentLinearAttention<linattn::SoftmaxSplit, double> rnn(8, 64, 64);
/// std::istringstream saved(bytes, std::ios::binary);
/// linattn::load_state(saved, rnn);
/// \endcode
/// \param is the binary stream, positioned at the record.
/// \param rnn continues from the loaded state and position.
template <class FeatureMap, class Scalar>
void load_state(std::istream& is, MultiHeadRecurrentLinearAttention<FeatureMap, Scalar>& rnn) {
  constexpr const char* fn = "load_state";
  std::uint32_t crc = 0;
  const auto hd = detail::io::read_header<Scalar>(is, fn, detail::io::kKindMultiHead, crc);
  const auto& first = rnn.head(0);
  detail::io::check_object_shape(fn, hd, "MultiHeadRecurrentLinearAttention",
                                 std::uint64_t(rnn.heads()), std::uint64_t(first.key_dim()),
                                 std::uint64_t(first.feature_dim()),
                                 std::uint64_t(first.value_dim()),
                                 normalizes_keys_per_feature_v<FeatureMap>);
  auto heads = detail::io::read_payload<Scalar>(is, fn, hd, crc);
  for (Index h = 0; h < rnn.heads(); ++h) {
    auto& r = heads[static_cast<std::size_t>(h)];
    detail::RecurrentStateAccess::install(rnn.head(h), std::move(r.state), r.position, r.unfolded);
  }
}

/// \brief Writes the exact decoding position of a LinearAttentionLayer's generation state
/// (`LinearAttentionLayer<Phi, Scalar>::State`) as a multi-head file (kind 3): one record per
/// head with its state as the head holds it (low parts not folded), the tokens in its low parts
/// since their last fold, and the position, which is the State's position(). The bytes are
/// those of save_state(os, state.heads()), so either loads into a State (load_state(is,
/// state)) or into a MultiHeadRecurrentLinearAttention of the same shapes.
///
/// A decode saved after any token (prefill or step), loaded into a State of a layer of the
/// same shapes and continued with step() or forward(X, state) gives the uninterrupted decode's
/// outputs bit for bit. The file records H, D, F, M and the presence of maxima, not the
/// layer's weights, d_model or feature map: load it for the layer that made it. It is
/// \f$72 + H\,(16 + s\,(2FM + 2F\,[+F] + L))\f$ bytes for s-byte scalars.
/// \throws std::invalid_argument if the heads are at different positions (only possible
/// through the non-const State::heads()), or as save_state(os, MultiHeadRecurrentLinearAttention)
/// for log-decays; std::runtime_error if the stream was not writable or a write failed.
/// \code
/// linattn::LinearAttentionLayer<linattn::EluPlusOne, float> layer(256, 8);
/// auto state = layer.make_state();
/// Eigen::MatrixXf P = layer.forward(prompt, state);  // prefill, then layer.step(...)
/// std::ofstream file("conversation.state", std::ios::binary);
/// linattn::save_state(file, state);
/// \endcode
/// \param os the binary stream the record is appended to.
/// \param state the state written, unchanged.
template <class Phi, class Scalar>
void save_state(std::ostream& os, const LinearAttentionLayerState<Phi, Scalar>& state) {
  const auto& rnn = state.heads();
  for (Index h = 1; h < rnn.heads(); ++h)
    if (rnn.head(h).position() != rnn.head(0).position())
      detail::throw_invalid("save_state", "the heads' positions differ: head 0 is at " +
                                              std::to_string(rnn.head(0).position()) +
                                              ", head " + std::to_string(h) + " at " +
                                              std::to_string(rnn.head(h).position()) +
                                              " (the heads of a LinearAttentionLayer::State "
                                              "share one position)");
  linattn::save_state(os, rnn);
}

/// \brief Restores into `state` (a `LinearAttentionLayer<Phi, Scalar>::State`) the decoding
/// position that save_state(os, state) wrote: every head's state bits, fold schedule and
/// position, and so the State's position(). The layer then continues it exactly as it would
/// have continued the saved State.
///
/// Reads a multi-head file (kind 3, format version 2 or 1): one that save_state(os, state)
/// or save_state(os, state.heads()) wrote, or a MultiHeadRecurrentLinearAttention's whose
/// heads are all at one position. It must have the State's H, D, F, M and maxima. Strong
/// guarantee: on any failure `state` is unchanged. Reads exactly one record.
/// \throws std::runtime_error `"linattn::load_state: ..."` for every failure of
/// load_state(std::istream&) (truncated, corrupted, wrong magic, version, scalar type or
/// kind, absurd shapes), "shape mismatch" naming the file's and the State's H, D, F, M and
/// maxima, and "invalid record" for heads at different positions.
/// \code
/// linattn::LinearAttentionLayer<linattn::EluPlusOne, float> layer(256, 8);  // the same weights
/// auto state = layer.make_state();
/// std::ifstream file("conversation.state", std::ios::binary);
/// linattn::load_state(file, state);  // state.position() is the saved one
/// layer.step(x, state, y);           // continues the saved decode
/// \endcode
/// \param is the binary stream, positioned at the record.
/// \param state replaced by the loaded state.
template <class Phi, class Scalar>
void load_state(std::istream& is, LinearAttentionLayerState<Phi, Scalar>& state) {
  constexpr const char* fn = "load_state";
  std::uint32_t crc = 0;
  const auto hd = detail::io::read_header<Scalar>(
      is, fn, detail::io::kKindMultiHead, crc,
      "the states of a MultiHeadRecurrentLinearAttention (as a LinearAttentionLayer::State is "
      "saved)");
  auto& rnn = state.heads();
  const auto& first = rnn.head(0);
  detail::io::check_object_shape(fn, hd, "LinearAttentionLayer::State",
                                 std::uint64_t(rnn.heads()), std::uint64_t(first.key_dim()),
                                 std::uint64_t(first.feature_dim()),
                                 std::uint64_t(first.value_dim()),
                                 normalizes_keys_per_feature_v<Phi>);
  auto heads = detail::io::read_payload<Scalar>(is, fn, hd, crc);
  for (std::size_t h = 1; h < heads.size(); ++h)
    if (heads[h].position != heads.front().position)
      detail::io::fail(fn, "invalid record: head " + std::to_string(h) + ": position " +
                               std::to_string(heads[h].position) + ", but head 0 has " +
                               std::to_string(heads.front().position) +
                               " (the heads of a LinearAttentionLayer::State share one "
                               "position)");
  for (Index h = 0; h < rnn.heads(); ++h) {
    auto& r = heads[static_cast<std::size_t>(h)];
    detail::RecurrentStateAccess::install(rnn.head(h), std::move(r.state), r.position, r.unfolded);
  }
}

/// \brief Writes the exact decoding position of every sequence of a batched decoder (kind 5):
/// the number of sequences B, then for each sequence b and head h the state as the decoder
/// holds it (low parts not folded), the tokens in its low parts since their last fold, and
/// position(b), so that load_state(is, dec) resumes every sequence bit-identically.
///
/// Only the B·H live states are written (not the spares that remove_sequence() keeps for
/// add_sequence()); B = 0 is valid. The file (format version 2) is
/// \f$72 + 8 + B\,H\,(16 + s\,(2FM + 2F\,[+F] + L))\f$ bytes for s-byte scalars. It records
/// H, D, F, M and the presence of maxima, not the feature map: load it only for the map that
/// made it.
///
/// A decoder that keeps its states in bf16 / half (`StateScalar`) writes the file of the
/// float decoder, its states widened (exactly: S as stored, S_lo and the log-decay empty), so
/// either decoder loads the other's files.
/// \throws std::runtime_error if the stream was not writable or a write failed;
/// std::invalid_argument if a state's log_decay (normally empty here: set_state() copies
/// it) has neither 0, 1 nor F entries, or the B·H states' differ in size.
/// \code
/// linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float> decoder(32, 8, 64, 64);
/// // ... decoder.step(Q, K, V, out), decoder.step(slots, ...), add/remove_sequence ...
/// std::ofstream file("server.state", std::ios::binary);
/// linattn::save_state(file, decoder);
/// \endcode
/// \param os the binary stream the record is appended to.
/// \param dec the decoder whose B sequences (states and positions) are written.
template <class FeatureMap, class Scalar, class StateScalar>
void save_state(std::ostream& os,
                const BatchedRecurrentLinearAttention<FeatureMap, Scalar, StateScalar>& dec) {
  constexpr const char* fn = "save_state";
  constexpr bool kLowState = !std::is_same_v<StateScalar, Scalar>;
  using Access = detail::RecurrentStateAccess;
  const Index B = dec.sequences(), H = dec.heads();
  Index decay = 0;
  if constexpr (!kLowState) {  // a state kept in bf16 / half has no log-decay
    decay = B == 0 ? 0 : detail::io::decay_entries(fn, Access::state(dec, 0, 0));
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < H; ++h) {
        const auto& st = Access::state(dec, b, h);
        if (detail::io::decay_entries(fn, st) != decay)
          detail::throw_invalid(fn,
                                "the states' log-decays differ in size: sequence 0, head 0 "
                                "has " +
                                    std::to_string(decay) + " entries, sequence " +
                                    std::to_string(b) + ", head " + std::to_string(h) + " has " +
                                    std::to_string(st.log_decay.size()));
      }
  }
  detail::io::Writer w(os, fn);
  detail::io::write_header<Scalar>(w, detail::io::kKindBatched,
                                   normalizes_keys_per_feature_v<FeatureMap>, H, dec.key_dim(),
                                   dec.feature_dim(), dec.value_dim(), decay);
  w.integer(std::uint64_t(B));
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) {
      if constexpr (kLowState)  // widened: exact, S_lo = 0
        detail::io::write_head(w, Access::state(dec, b, h).widened(), dec.position(b),
                               Access::unfolded(dec, b, h));
      else
        detail::io::write_head(w, Access::state(dec, b, h), dec.position(b),
                               Access::unfolded(dec, b, h));
    }
  w.finish();
}

/// \brief Restores into `dec` the sequences that save_state(os, dec) wrote: `dec` then holds
/// the file's B sequences, whatever its own count was, and steps exactly as the saved decoder
/// would have (same state bits, fold schedule of every (sequence, head) and position(b)).
///
/// The file must come from a decoder of the same heads per sequence H, key dimension D,
/// feature dimension F, value dimension M and map (running maxima or not); B comes from the
/// file (0 gives an empty decoder). The spare states that remove_sequence() keeps are dropped.
/// Strong guarantee: on any failure `dec` is unchanged (everything is read and checked before
/// it is touched). Reads exactly one record. A decoder with bf16 / half states takes S + S_lo
/// of each record rounded once, as set_state(): the file of such a decoder comes back bit for
/// bit, a float decoder's loses what rounding S costs; a record's log-decay is not kept.
/// \throws std::runtime_error `"linattn::load_state: ..."` for every failure of
/// load_state(std::istream&) (truncated, corrupted, wrong magic, version, scalar type or
/// kind, absurd shapes, including a B of more than 2²⁴ (sequence, head) states), "shape
/// mismatch" naming the file's and the decoder's H, D, F, M and maxima, and "invalid record"
/// for a sequence whose H records disagree on its position.
/// \code
/// linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float> decoder(0, 8, 64, 64);
/// std::ifstream file("server.state", std::ios::binary);
/// linattn::load_state(file, decoder);  // decoder.sequences() is the saved B
/// decoder.step(Q, K, V, out);          // continues every saved decode
/// \endcode
/// \param is the binary stream, positioned at the record.
/// \param dec takes the loaded B sequences.
template <class FeatureMap, class Scalar, class StateScalar>
void load_state(std::istream& is,
                BatchedRecurrentLinearAttention<FeatureMap, Scalar, StateScalar>& dec) {
  constexpr const char* fn = "load_state";
  std::uint32_t crc = 0;
  const auto hd = detail::io::read_header<Scalar>(is, fn, detail::io::kKindBatched, crc);
  detail::io::check_object_shape(fn, hd, "BatchedRecurrentLinearAttention",
                                 std::uint64_t(dec.heads()), std::uint64_t(dec.key_dim()),
                                 std::uint64_t(dec.feature_dim()), std::uint64_t(dec.value_dim()),
                                 normalizes_keys_per_feature_v<FeatureMap>);
  auto records = detail::io::read_payload<Scalar>(is, fn, hd, crc);
  const Index H = dec.heads(), B = static_cast<Index>(records.size()) / H;
  using Stored = std::decay_t<decltype(detail::RecurrentStateAccess::state(dec, 0, 0))>;
  std::vector<Stored> states;
  std::vector<Index> unfolded, positions;
  states.reserve(records.size());
  unfolded.reserve(records.size());
  positions.reserve(static_cast<std::size_t>(B));
  for (std::size_t i = 0; i < records.size(); ++i) {
    if constexpr (std::is_same_v<StateScalar, Scalar>) {
      states.push_back(std::move(records[i].state));
    } else {  // S + S_lo rounded once, as set_state(): exact for a file this decoder wrote
      states.emplace_back();
      states.back().assign(records[i].state);
    }
    unfolded.push_back(records[i].unfolded);
    if (i % static_cast<std::size_t>(H) == 0) positions.push_back(records[i].position);
  }
  detail::RecurrentStateAccess::install(dec, B, std::move(states), std::move(unfolded),
                                        std::move(positions));
}

// After the BatchedRecurrentLinearAttention overloads: a qualified call in a template finds
// only the overloads declared before it.

/// \brief Writes every sequence of a `LinearAttentionLayer<Phi, Scalar>::BatchedState`: the
/// file of save_state(os, state.decoder()) (kind 5: B sequences x H heads, their positions and
/// fold schedules), so that load_state(is, state) resumes every conversation bit for bit.
/// \throws as save_state(os, BatchedRecurrentLinearAttention).
/// \code
/// auto batch = layer.make_batched_state(4);
/// // ... layer.forward(prompts, cu_seqlens, batch); layer.step(Xb, batch, Yb); ...
/// std::ofstream file("batch.state", std::ios::binary);
/// linattn::save_state(file, batch);  // park every conversation
/// \endcode
/// \param os the binary stream the record is appended to.
/// \param state the state written, unchanged.
template <class Phi, class Scalar>
void save_state(std::ostream& os, const LinearAttentionLayerBatchedState<Phi, Scalar>& state) {
  linattn::save_state(os, state.decoder());
}

/// \brief Restores a `BatchedState` that save_state(os, state) wrote (or any kind-5 file of
/// the same H, D, F, M): B becomes the file's, every sequence continues bit for bit. The step
/// buffers grow on the next step if B outgrew their capacity (one allocation).
/// \throws as load_state(is, BatchedRecurrentLinearAttention&); `state` is unchanged then.
/// \code
/// auto resumed = layer.make_batched_state();
/// std::ifstream file("batch.state", std::ios::binary);
/// linattn::load_state(file, resumed);  // resumed.sequences() is the saved B
/// \endcode
/// \param is the binary stream, positioned at the record.
/// \param state replaced by the loaded state.
template <class Phi, class Scalar>
void load_state(std::istream& is, LinearAttentionLayerBatchedState<Phi, Scalar>& state) {
  linattn::load_state(is, state.decoder());
}

}  // namespace linattn
