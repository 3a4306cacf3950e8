/// \file serving/state_io_decoders.hpp
/// \brief Saving and loading the decoders of the gated and delta-rule families exactly, in
/// compact records of linattn's state format (state_io.hpp, docs/SPEC.md §8): a
/// RecurrentGatedAttention (kind 8: S, z, the log-decay and the position) and a
/// RecurrentDeltaRule (kind 7: S and the position), nothing the decoder does not use.
/// Included by state_io.hpp.
///
/// ### Compact records (format version 2)
///
/// The header is state_io.hpp's (68 bytes with its CRC; H = 1, flags 0; L = F for kind 8, 0
/// for kind 7), then one record, then the CRC-32 of every byte before it:
///
/// | bytes | field |
/// |------:|-------|
/// | 8     | position, i64 (never negative) |
/// | F·M·s | `S`, row-major |
/// | F·s   | `z`, kind 8 only |
/// | F·s   | `log_decay` (L = F entries, each <= 0 or −∞), kind 8 only |
///
/// A file is \f$80 + s\,FM\f$ bytes (kind 7) or \f$80 + s\,(FM + 2F)\f$ (kind 8) for s-byte
/// scalars: 65 616 bytes for one float delta-rule head of F = M = 128, its 64 KiB of state and
/// 80 bytes. The gated decoder's older kind-4 files (with zero low parts and an unfolded
/// count) still load; only kind 8 is written. A BatchedRecurrentGatedAttention or
/// BatchedRecurrentDeltaRule is B·H such records, sequence-major (head h of sequence b is
/// record b·H + h).
///
/// A decoder that keeps S in bf16 / half (`StateScalar`) writes the float record, S widened
/// (exact), with flag bit 1 (bf16) or bit 2 (half) set; load_state() takes a record only into
/// a decoder of the storage type its flags name, and otherwise throws std::runtime_error
/// "storage type mismatch" naming both, so that a load neither rounds a float state silently
/// nor presents a rounded one as float.
#pragma once

#include <Eigen/Core>

#include <cstdint>
#include <istream>
#include <ostream>
#include <utility>
#include <vector>

#include "../core/common.hpp"
#include "detail/state_io_format.hpp"
#include "../core/batched_heads.hpp"
#include "../delta/batched_recurrent_delta_rule.hpp"
#include "../delta/recurrent_delta_rule.hpp"
#include "../gated/batched_recurrent_gated_attention.hpp"
#include "../gated/recurrent_gated_attention.hpp"

namespace linattn {

/// \brief Writes the exact decoding position of a gated decoder (kind 8): its state S, z, its
/// total log-decay `log_decay` (the decoder keeps F entries, so L = F) and position(), nothing
/// else (the decoder keeps no low part). Loading it into an object of the same shapes with
/// load_state(is, rnn) and stepping on gives outputs bit-identical to `rnn`'s own.
///
/// The file is \f$80 + s\,(FM + 2F)\f$ bytes for s-byte scalars (layout in
/// state_io_decoders.hpp). It records the state, not the feature map or the GatedOptions
/// (normalize, scale): load it into an object built with the same map and options.
/// \throws std::runtime_error if the stream was not writable or a write failed.
/// \code
/// linattn::RecurrentGatedAttention<linattn::Identity, float> rnn(64, 64);
/// // ... rnn.step(q, k, v, log_gate, out) for the prompt and some tokens ...
/// std::ofstream file("conversation.state", std::ios::binary);
/// linattn::save_state(file, rnn);  // 80 + 4·(64·64 + 2·64) bytes
/// \endcode
/// \param os the binary stream the record is appended to.
/// \param rnn the recurrent form whose state and position are written.
template <class Phi, class Scalar, class StateScalar>
void save_state(std::ostream& os, const RecurrentGatedAttention<Phi, Scalar, StateScalar>& rnn) {
  const auto& st = rnn.state();  // a decoder with bf16 / half states: a widened copy, exact
  const Index F = rnn.feature_dim(), M = rnn.value_dim();
  const Index decay = detail::io::decay_entries("save_state", st);
  detail::io::Writer w(os, "save_state");
  detail::io::write_header<Scalar>(w, detail::io::kKindGatedCompact, false, 1, rnn.key_dim(), F, M,
                                   decay, detail::io::storage_flag<StateScalar>());
  detail::io::write_position(w, rnn.position());
  w.scalars(st.S.data(), F * M);
  w.scalars(st.z.data(), F);
  w.scalars(st.log_decay.data(), decay);
  w.finish();
}

/// \brief Restores into `rnn` a decoding position that save_state(os, rnn) wrote: afterwards
/// `rnn` steps exactly as the saved object would have (same state bits, log_decay and
/// position()). Reads kind 8, and the kind-4 files of earlier linattn versions.
///
/// The file must come from an object of the same key dimension D, feature dimension F and
/// value dimension M; the map and the options are not recorded (use the ones that wrote it).
/// Strong guarantee: on any failure `rnn` is unchanged. Reads exactly one record.
/// \throws std::runtime_error `"linattn::load_state: ..."` for every failure of
/// load_state(std::istream&) (truncated, corrupted, wrong magic, version, scalar type or
/// kind, absurd shapes), "shape mismatch" naming the file's and the object's D, F and M,
/// "invalid log-decay size" for L other than F, and "invalid record" for a negative position,
/// a log-decay entry that is NaN or > 0, or (kind 4) low parts or unfolded tokens.
/// \code
/// linattn::RecurrentGatedAttention<linattn::Identity, float> rnn(64, 64);
/// std::ifstream file("conversation.state", std::ios::binary);
/// linattn::load_state(file, rnn);
/// rnn.step(q, k, v, log_gate, out);  // continues the saved decode
/// \endcode
/// \param is the binary stream, positioned at the record.
/// \param rnn continues from the loaded state and position.
template <class Phi, class Scalar, class StateScalar>
void load_state(std::istream& is, RecurrentGatedAttention<Phi, Scalar, StateScalar>& rnn) {
  constexpr const char* fn = "load_state";
  std::uint32_t crc = 0;
  const auto hd = detail::io::read_header<Scalar>(is, fn, detail::io::kKindGatedCompact, crc,
                                                  nullptr, detail::io::kKindGated);
  detail::io::check_storage<Scalar, StateScalar>(fn, hd, "RecurrentGatedAttention");
  detail::io::check_object_shape(fn, hd, "RecurrentGatedAttention", 1,
                                 std::uint64_t(rnn.key_dim()), std::uint64_t(rnn.feature_dim()),
                                 std::uint64_t(rnn.value_dim()), false);
  auto heads = detail::io::read_payload<Scalar>(is, fn, hd, crc);
  auto& r = heads.front();
  detail::RecurrentStateAccess::install(rnn, std::move(r.state), r.position);
}

/// \brief Writes the exact decoding position of a delta-rule decoder (kind 7): its F x M
/// state S as state() gives it (the last step's update applied) and position(), nothing else
/// (the delta rule uses no z, low part or log-decay). Loading it into an object of the same
/// shapes with load_state(is, rnn) and stepping on gives outputs bit-identical to `rnn`'s own.
/// `rnn` is not changed (const: the pending update is applied to the bytes written).
///
/// The file is \f$80 + s\,FM\f$ bytes for s-byte scalars (layout in state_io_decoders.hpp):
/// the state and 80 bytes. It records the state, not the feature map or the DeltaOptions
/// (scale): load it into an object built with the same map and options. H heads of a layer
/// are H records, one after the other in one stream.
/// \throws std::runtime_error if the stream was not writable or a write failed.
/// \code
/// linattn::RecurrentDeltaRule<linattn::L2Normalize<linattn::Silu>, float> rnn(128, 128);
/// // ... rnn.step(q, k, v, beta, log_a, out) for the prompt and some tokens ...
/// std::ofstream file("conversation.state", std::ios::binary);
/// linattn::save_state(file, rnn);  // 80 + 4·128·128 bytes
/// \endcode
/// \param os the binary stream the record is appended to.
/// \param rnn the recurrent form whose state and position are written.
template <class Phi, class Scalar, class StateScalar>
void save_state(std::ostream& os, const RecurrentDeltaRule<Phi, Scalar, StateScalar>& rnn) {
  const Index F = rnn.feature_dim(), M = rnn.value_dim();
  detail::io::Writer w(os, "save_state");
  detail::io::write_header<Scalar>(w, detail::io::kKindDelta, false, 1, rnn.key_dim(), F, M, 0,
                                   detail::io::storage_flag<StateScalar>());
  detail::io::write_position(w, rnn.position());
  std::vector<Scalar> row(static_cast<std::size_t>(M));
  for (Index r = 0; r < F; ++r) {
    detail::RecurrentStateAccess::settled_row(rnn, r, row.data());
    w.scalars(row.data(), M);
  }
  w.finish();
}

/// \brief Restores into `rnn` a decoding position that save_state(os, rnn) wrote: afterwards
/// `rnn` steps exactly as the saved object would have (same state bits and position()).
///
/// The file must come from an object of the same key dimension D, feature dimension F and
/// value dimension M; the map and the options are not recorded (use the ones that wrote it).
/// Strong guarantee: on any failure `rnn` is unchanged. Reads exactly one record.
/// \throws std::runtime_error `"linattn::load_state: ..."` for every failure of
/// load_state(std::istream&) (truncated, corrupted, wrong magic, version, scalar type or
/// kind, absurd shapes), "shape mismatch" naming the file's and the object's D, F and M,
/// "invalid log-decay size" for L other than 0, and "invalid record" for a negative position.
/// \code
/// linattn::RecurrentDeltaRule<linattn::L2Normalize<linattn::Silu>, float> rnn(128, 128);
/// std::ifstream file("conversation.state", std::ios::binary);
/// linattn::load_state(file, rnn);
/// rnn.step(q, k, v, beta, log_a, out);  // continues the saved decode
/// \endcode
/// \param is the binary stream, positioned at the record.
/// \param rnn continues from the loaded state and position.
template <class Phi, class Scalar, class StateScalar>
void load_state(std::istream& is, RecurrentDeltaRule<Phi, Scalar, StateScalar>& rnn) {
  constexpr const char* fn = "load_state";
  std::uint32_t crc = 0;
  const auto hd = detail::io::read_header<Scalar>(is, fn, detail::io::kKindDelta, crc);
  detail::io::check_storage<Scalar, StateScalar>(fn, hd, "RecurrentDeltaRule");
  detail::io::check_object_shape(fn, hd, "RecurrentDeltaRule", 1, std::uint64_t(rnn.key_dim()),
                                 std::uint64_t(rnn.feature_dim()),
                                 std::uint64_t(rnn.value_dim()), false);
  auto heads = detail::io::read_payload<Scalar>(is, fn, hd, crc);
  auto& r = heads.front();
  detail::RecurrentStateAccess::install(rnn, std::move(r.state), r.position);
}

/// \brief Writes every head of a batched gated or delta-rule decoder: B·H records of its head
/// decoders (kind 8 or 7), sequence-major, one after the other, so that load_state() into a
/// decoder of the same B, H and sizes resumes every sequence bit for bit.
/// \throws std::runtime_error if the stream was not writable or a write failed.
/// \code
/// linattn::BatchedRecurrentDeltaRule<linattn::L2Normalize<>, float> dec(8, 32, 128, 128);
/// // ... dec.step(Q, K, V, beta, log_a, out) ...
/// std::ofstream file("server.state", std::ios::binary);
/// linattn::save_state(file, dec);  // 8·32 records of 80 + 4·128·128 bytes
/// \endcode
/// \param os the binary stream the records are appended to.
/// \param dec the batched decoder whose heads are written.
template <class Decoder>
void save_state(std::ostream& os, const BatchedHeads<Decoder>& dec) {
  for (Index b = 0; b < dec.sequences(); ++b)
    for (Index h = 0; h < dec.heads(); ++h) save_state(os, dec.decoder(b, h));
}

/// \brief Restores into `dec` the B·H records save_state(os, dec) wrote (the same B, H and
/// sizes): afterwards every sequence steps exactly as the saved object's would have. Strong
/// guarantee: every record is read and checked before any head changes.
/// \throws std::runtime_error as load_state() of one head decoder (truncated, corrupted, wrong
/// kind or shapes), for the first bad record.
/// \code
/// linattn::BatchedRecurrentDeltaRule<linattn::L2Normalize<>, float> dec(8, 32, 128, 128);
/// std::ifstream file("server.state", std::ios::binary);
/// linattn::load_state(file, dec);
/// \endcode
/// \param is the binary stream, positioned at the first record.
/// \param dec receives every head's state and position.
template <class Decoder>
void load_state(std::istream& is, BatchedHeads<Decoder>& dec) {
  std::vector<Decoder> heads;
  heads.reserve(static_cast<std::size_t>(dec.sequences() * dec.heads()));
  for (Index b = 0; b < dec.sequences(); ++b)
    for (Index h = 0; h < dec.heads(); ++h) {
      heads.push_back(dec.decoder(b, h));
      load_state(is, heads.back());
    }
  auto& grid = detail::RecurrentStateAccess::grid(dec);
  for (std::size_t i = 0; i < heads.size(); ++i)
    grid.at(Index(i) / dec.heads(), Index(i) % dec.heads()) = std::move(heads[i]);
}

}  // namespace linattn
