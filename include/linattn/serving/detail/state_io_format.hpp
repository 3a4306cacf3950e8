/// \file serving/detail/state_io_format.hpp
/// \brief linattn's binary state format, byte for byte (internal): the little-endian encoding
/// of integers and scalars, the CRC-32, the header and head-record writers and readers with
/// their checks and error messages, and the access to a recurrent object's own members that
/// save_state()/load_state() (state_io.hpp) need. The layout is documented in state_io.hpp and
/// docs/SPEC.md §8.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ios>
#include <istream>
#include <limits>
#include <ostream>
#include <stdexcept>
#include <streambuf>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../linear/batched_recurrent.hpp"
#include "../../core/detail/checks.hpp"
#include "../../core/batched_heads.hpp"
#include "../../core/checksum.hpp"
#include "../../core/common.hpp"
#include "../../core/error.hpp"
#include "../../delta/recurrent_delta_rule.hpp"
#include "../../gated/recurrent_gated_attention.hpp"
#include "../../linear/recurrent_linear_attention.hpp"
#include "../../core/state.hpp"
#include "../../maps/map_state.hpp"

namespace linattn {

// attention_layer.hpp: the states of the attention layers (kind 3 and kind 6 files).
template <class Phi, class Scalar>
class LinearAttentionLayerState;
template <class Scalar>
class SoftmaxAttentionLayerState;
// batched_layer.hpp: the B sequences a LinearAttentionLayer serves (kind 5 files).
template <class Phi, class Scalar>
class LinearAttentionLayerBatchedState;
// layers/delta_layer_state.hpp: the B sequences a delta-rule layer serves (kind 9 files).
template <class Scalar, class Buffers>
class DeltaLayerBatchedState;

namespace detail {

// The objects' own members, so that a resumed decode continues from the very bits an
// uninterrupted one holds: state() folds the low parts and set_state() restarts the fold
// schedule, either of which changes the rounding of every later token.
struct RecurrentStateAccess {
  template <class Phi, class Scalar>
  static const LinearAttentionState<Scalar>& state(const RecurrentLinearAttention<Phi, Scalar>& r) {
    return r.state_;
  }
  template <class Phi, class Scalar>
  static Index unfolded(const RecurrentLinearAttention<Phi, Scalar>& r) noexcept {
    return r.unfolded_;
  }
  // noexcept: the loaders install every head only once all of them have been read.
  template <class Phi, class Scalar>
  static void install(RecurrentLinearAttention<Phi, Scalar>& r, LinearAttentionState<Scalar>&& st,
                      Index position, Index unfolded) noexcept {
    r.state_ = std::move(st);
    r.position_ = position;
    r.unfolded_ = unfolded;
  }
  // The gated decoder keeps no low part: its state and position are all there is.
  template <class Phi, class Scalar, class StateScalar>
  static void install(RecurrentGatedAttention<Phi, Scalar, StateScalar>& r,
                      LinearAttentionState<Scalar>&& st, Index position) noexcept {
    r.adopt(std::move(st), position);
  }
  // The delta-rule decoder: row r of its state() (M entries into `row`), and the install of a
  // loaded state (S, with zero low part and z) with no update pending.
  template <class Phi, class Scalar, class StateScalar>
  static void settled_row(const RecurrentDeltaRule<Phi, Scalar, StateScalar>& r, Index row,
                          Scalar* out) {
    r.settled_row(row, out);
  }
  template <class Phi, class Scalar, class StateScalar>
  static void install(RecurrentDeltaRule<Phi, Scalar, StateScalar>& r,
                      LinearAttentionState<Scalar>&& st, Index position) noexcept {
    r.adopt(std::move(st), position);
  }
  // The batched gated and delta-rule decoders (BatchedHeads): their heads' decoders, which a
  // load replaces all at once.
  template <class Decoder>
  static detail::DecoderGrid<Decoder>& grid(BatchedHeads<Decoder>& d) noexcept {
    return d.grid_;
  }
  // The batched decoder: head h of sequence b (a LinearAttentionState, or a LowPrecisionState
  // for states kept in bf16 / half), its unfolded count, and the install of B sequences
  // (sequence-major states and counts, one position per sequence). Only the first B·H entries
  // of the decoder's vectors are live (remove_sequence() keeps spares past them).
  template <class Phi, class Scalar, class StateScalar>
  static const auto& state(const BatchedRecurrentLinearAttention<Phi, Scalar, StateScalar>& r,
                           Index b, Index h) {
    return r.states_[r.index(b, h)];
  }
  template <class Phi, class Scalar, class StateScalar>
  static Index unfolded(const BatchedRecurrentLinearAttention<Phi, Scalar, StateScalar>& r, Index b,
                        Index h) noexcept {
    return r.unfolded_[r.index(b, h)];
  }
  // Strong guarantee: the one allocation (the repeat marks of step(slots, ...)) comes first,
  // then only moves. Replaces the spare states too: the decoder holds exactly B·H afterwards.
  template <class Phi, class Scalar, class StateScalar, class Stored>
  static void install(BatchedRecurrentLinearAttention<Phi, Scalar, StateScalar>& r, Index sequences,
                      std::vector<Stored>&& states, std::vector<Index>&& unfolded,
                      std::vector<Index>&& positions) {
    std::vector<unsigned char> marks(static_cast<std::size_t>(sequences), 0);
    r.states_ = std::move(states);
    r.unfolded_ = std::move(unfolded);
    r.positions_ = std::move(positions);
    r.marks_ = std::move(marks);
    r.sequences_ = sequences;
  }
  // A delta-rule layer's batched state (state_io_layers.hpp): its convolution states, and the
  // rollback points a load drops (they belong to the calls before it).
  template <class Scalar, class Buffers>
  static auto& conv_states(DeltaLayerBatchedState<Scalar, Buffers>& s) noexcept {
    return s.conv_;
  }
  template <class Scalar, class Buffers>
  static void forget_rollback(DeltaLayerBatchedState<Scalar, Buffers>& s) {
    s.forget_calls();
  }
  // The KV cache of a SoftmaxAttentionLayer::State: its head count (the cache's columns are
  // H·D and H·M), and the install of T cached tokens (keys T x H·D, values T x H·M). Strong
  // guarantee: the rows go into the cache's own memory when it has room (no allocation, and
  // the reservation of make_state(capacity) is kept), else the one allocation (the scores)
  // comes before the swaps.
  template <class Scalar>
  static Index heads(const SoftmaxAttentionLayerState<Scalar>& s) noexcept {
    return s.heads_;
  }
  template <class Scalar>
  using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  template <class Scalar>
  static void install(SoftmaxAttentionLayerState<Scalar>& s, RowMatrix<Scalar>&& keys,
                      RowMatrix<Scalar>&& values) {
    const Index T = keys.rows();
    if (T <= s.keys_.rows()) {
      s.keys_.topRows(T) = keys;
      s.values_.topRows(T) = values;
    } else {
      Vector<Scalar> scores(T);
      s.keys_.swap(keys);
      s.values_.swap(values);
      s.scores_.swap(scores);
    }
    s.length_ = T;
  }
};

namespace io {

constexpr std::array<unsigned char, 8> kMagic = {0x89, 'L', 'A', 'S', '\r', '\n', 0x1A, '\n'};
constexpr std::uint32_t kVersion = 2;   // written; version 1 (no log-decay) is still read
constexpr std::uint32_t kVersion1 = 1;
constexpr std::uint32_t kFloat = 1, kDouble = 2;
constexpr std::uint32_t kKindState = 1, kKindRecurrent = 2, kKindMultiHead = 3;
constexpr std::uint32_t kKindGated = 4;    // version 2 only
constexpr std::uint32_t kKindBatched = 5;  // version 2 only; the payload starts with B
constexpr std::uint32_t kKindKVCache = 6;  // version 2 only; T, then the cached K and V rows
// Compact records (version 2 only): the position, then only the arrays the decoder uses.
constexpr std::uint32_t kKindDelta = 7;         // RecurrentDeltaRule: S
constexpr std::uint32_t kKindGatedCompact = 8;  // RecurrentGatedAttention: S, z, log_decay (L = F)
// A delta-rule layer's BatchedState (version 2 only, state_io_layers.hpp): B, W and C, then per
// sequence its position, its convolution state and its H heads' S.
constexpr std::uint32_t kKindDeltaLayer = 9;
constexpr std::uint32_t kKindLast = kKindDeltaLayer;
constexpr std::uint32_t kFlagMaxima = 1;
// Compact records (kinds 7 and 8) of a decoder that keeps S in bf16 / half: S is written
// widened (exact), and only a decoder of the same storage loads it.
constexpr std::uint32_t kFlagStateBf16 = 2, kFlagStateHalf = 4;
constexpr std::uint32_t kFlagsStorage = kFlagStateBf16 | kFlagStateHalf;
template <class StateScalar>
constexpr std::uint32_t storage_flag() {
  if constexpr (std::is_same_v<StateScalar, Eigen::bfloat16>)
    return kFlagStateBf16;
  else if constexpr (std::is_same_v<StateScalar, Eigen::half>)
    return kFlagStateHalf;
  else
    return 0;
}
inline const char* storage_name(std::uint32_t flags, const char* scalar) {
  return (flags & kFlagStateBf16) ? "bf16" : (flags & kFlagStateHalf) ? "half" : scalar;
}
constexpr std::size_t kHeaderBytes = 68;    // with its CRC (version 2)
constexpr std::size_t kHeaderBytesV1 = 60;  // version 1: no log-decay field
constexpr std::size_t kHeadPrefixBytes = 16;  // position, unfolded tokens
constexpr std::size_t kPositionBytes = 8;     // a compact record's prefix: the position
constexpr std::size_t kSequencesBytes = 8;    // kind 5: the sequence count B before the records
constexpr std::size_t kTokensBytes = 8;       // kind 6: the cached token count T before the rows
// Sanity bounds on a file's declared shapes, checked before anything is allocated: far above
// any real state (a 4096 x 4096 double state is 256 MiB), far below what would overflow the
// size arithmetic.
constexpr std::uint64_t kMaxHeads = std::uint64_t(1) << 16;
constexpr std::uint64_t kMaxStates = std::uint64_t(1) << 24;  // kind 5: B·H
constexpr std::uint64_t kMaxDim = std::uint64_t(1) << 24;
constexpr std::uint64_t kMaxPayloadBytes = std::uint64_t(1) << 36;  // 64 GiB
// Bytes read from the stream at a time: a file that declares more than it holds costs at most
// this much beyond its actual length before the truncation is found.
constexpr std::size_t kReadChunk = std::size_t(1) << 20;

// The CRC-32 (make_crc32_table, crc32_update, crc32) is in checksum.hpp, with the public
// linattn::checksum.

// Byte-wise shifts, not memcpy of the integer: the file is little-endian on any host.
template <class U>
void put_le(unsigned char* p, U v) noexcept {
  for (std::size_t i = 0; i < sizeof(U); ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
template <class U>
U get_le(const unsigned char* p) noexcept {
  U v = 0;
  for (std::size_t i = 0; i < sizeof(U); ++i) v |= static_cast<U>(p[i]) << (8 * i);
  return v;
}

template <class Scalar>
using Bits = std::conditional_t<sizeof(Scalar) == 4, std::uint32_t, std::uint64_t>;

template <class Scalar>
constexpr std::uint32_t scalar_code() {
  static_assert(is_supported_scalar_v<Scalar>, "linattn: the scalar type must be float or double");
  static_assert(std::numeric_limits<Scalar>::is_iec559,
                "linattn: the state format stores IEEE 754 scalars");
  static_assert(sizeof(Scalar) == sizeof(Bits<Scalar>), "linattn: unexpected scalar size");
  return std::is_same_v<Scalar, float> ? kFloat : kDouble;
}

inline const char* scalar_name(std::uint32_t code) { return code == kFloat ? "float" : "double"; }

inline const char* kind_name(std::uint32_t kind) {
  switch (kind) {
    case kKindState: return "a LinearAttentionState";
    case kKindRecurrent: return "the state of a RecurrentLinearAttention";
    case kKindGated:
    case kKindGatedCompact: return "the state of a RecurrentGatedAttention";
    case kKindDelta: return "the state of a RecurrentDeltaRule";
    case kKindBatched: return "the states of a BatchedRecurrentLinearAttention";
    case kKindKVCache: return "the KV cache of a SoftmaxAttentionLayer::State";
    case kKindDeltaLayer: return "the states of a delta-rule layer's BatchedState";
    default: return "the states of a MultiHeadRecurrentLinearAttention";
  }
}

[[noreturn]] inline void fail(const char* function, const std::string& what) {
  raise<std::runtime_error>(std::string("linattn::") + function + ": " + what);
}

// Integers that may be any two's complement value go through u64 explicitly: converting an
// out-of-range unsigned to a signed type is implementation-defined before C++20.
inline std::uint64_t from_signed(std::int64_t v) noexcept { return static_cast<std::uint64_t>(v); }
inline std::int64_t to_signed(std::uint64_t v) noexcept {
  return v <= std::uint64_t(std::numeric_limits<std::int64_t>::max())
             ? static_cast<std::int64_t>(v)
             : -static_cast<std::int64_t>(~v) - 1;
}

// What a header declares.
struct Header {
  std::uint32_t version = 0, scalar = 0, kind = 0, flags = 0;
  std::uint64_t heads = 0, key_dim = 0, F = 0, M = 0;
  std::uint64_t decay = 0;  // log-decay entries per head: 0, 1 or F (0 in version 1)
  std::uint64_t sequences = 0;  // kind 5: B, the payload's first field (not in the header)
  bool maxima() const noexcept { return (flags & kFlagMaxima) != 0; }
};

// A compact record (kinds 7 and 8): no unfolded count and no low parts.
inline bool compact_kind(std::uint32_t kind) noexcept {
  return kind == kKindDelta || kind == kKindGatedCompact;
}

// Bytes of one head record for scalars of s bytes (the bounds keep this from overflowing).
inline std::uint64_t head_bytes(const Header& h, std::uint64_t s) {
  if (h.kind == kKindDeltaLayer) return s * h.F * h.M;  // a sequence's S of one head
  if (h.kind == kKindDelta) return kPositionBytes + s * h.F * h.M;
  if (h.kind == kKindGatedCompact) return kPositionBytes + s * (h.F * h.M + h.F + h.decay);
  return kHeadPrefixBytes + s * (2 * h.F * h.M + (h.maxima() ? 3 : 2) * h.F + h.decay);
}

// Head records in the payload: H, or for kind 5 B·H (h.sequences must be B).
inline std::uint64_t record_count(const Header& h) noexcept {
  return h.kind == kKindBatched ? h.sequences * h.heads : h.heads;
}

// Which record a message is about: "" for a single head, "head 2", or for kind 5 "sequence
// 1, head 0".
inline std::string record_name(const Header& h, std::uint64_t record) {
  if (h.kind == kKindBatched)
    return "sequence " + std::to_string(record / h.heads) + ", head " +
           std::to_string(record % h.heads);
  return h.heads > 1 ? "head " + std::to_string(record) : std::string();
}

// Which field byte `got` of the payload (after the header; for kind 5 from the sequence count
// B on) falls in, and how many of its bytes came before: for the message of a truncated file.
// For kind 5 past the first 8 bytes, h.sequences must be B.
inline std::string truncation_message(const Header& h, std::uint64_t s, std::uint64_t got) {
  const std::uint64_t FM = h.F * h.M;
  const bool compact = compact_kind(h.kind);  // fields of 0 bytes are not in the record
  const std::pair<const char*, std::uint64_t> fields[] = {
      {"position", 8},
      {"unfolded token count", compact ? 0 : 8},
      {"S", FM * s},
      {"S_lo", compact ? 0 : FM * s},
      {"z", h.kind == kKindDelta ? 0 : h.F * s},
      {"z_lo", compact ? 0 : h.F * s},
      {"m", h.maxima() ? h.F * s : 0},
      {"log_decay", h.decay * s}};
  std::uint64_t at = 0;
  if (h.kind == kKindBatched) {
    if (got < kSequencesBytes)
      return "truncated file: expected 8 bytes of sequence count B, got " + std::to_string(got);
    at = kSequencesBytes;
  }
  const std::uint64_t records = record_count(h);
  for (std::uint64_t record = 0; record < records; ++record)
    for (const auto& f : fields) {
      if (f.second > 0 && got < at + f.second) {
        const std::string which = record_name(h, record);
        return "truncated file: expected " + std::to_string(f.second) + " bytes of " + f.first +
               (which.empty() ? std::string() : " (" + which + ")") + ", got " +
               std::to_string(got - at);
      }
      at += f.second;
    }
  return "truncated file: expected 4 bytes of checksum, got " + std::to_string(got - at);
}

// Buffered writer keeping the running CRC; checks the stream after every write rather than
// relying on its exception mask.
class Writer {
 public:
  Writer(std::ostream& os, const char* function) : os_(os), fn_(function) {
    if (!os_) fail(fn_, "the stream is not writable (its failbit or badbit is set)");
  }
  void bytes(const unsigned char* p, std::size_t n) {
    while (n > 0) {
      const std::size_t k = std::min(n, buf_.size() - used_);
      std::memcpy(buf_.data() + used_, p, k);
      used_ += k;
      p += k;
      n -= k;
      if (used_ == buf_.size()) flush();
    }
  }
  template <class U>
  void integer(U v) {
    unsigned char b[sizeof(U)];
    put_le(b, v);
    bytes(b, sizeof(U));
  }
  template <class Scalar>
  void scalars(const Scalar* x, Index n) {
    for (Index i = 0; i < n; ++i) {
      Bits<Scalar> b;
      std::memcpy(&b, x + i, sizeof b);
      integer(b);
    }
  }
  template <class Scalar>
  void zeros(Index n) {
    for (Index i = 0; i < n; ++i) integer(Bits<Scalar>(0));
  }
  // A header's own CRC covers what was written so far: the header.
  void header_crc() { integer(crc_so_far()); }
  // The trailing CRC, then the bytes out of our buffer and the stream's.
  void finish() {
    integer(crc_so_far());
    flush();
    bool failed = false;
#if LINATTN_HAS_EXCEPTIONS
    try {
      os_.flush();
    } catch (const std::ios_base::failure&) {  // an exception mask: report it our way
      failed = true;
    }
#else
    os_.flush();
#endif
    if (failed || !os_) fail(fn_, "writing failed: the stream's flush reported an error after " +
                            std::to_string(written_) + " bytes");
  }

 private:
  std::uint32_t crc_so_far() const noexcept {
    return crc32_update(crc_, buf_.data(), used_) ^ 0xFFFFFFFFu;
  }
  void flush() {
    crc_ = crc32_update(crc_, buf_.data(), used_);
    bool failed = false;
#if LINATTN_HAS_EXCEPTIONS
    try {
      os_.write(reinterpret_cast<const char*>(buf_.data()), static_cast<std::streamsize>(used_));
    } catch (const std::ios_base::failure&) {  // an exception mask: report it our way
      failed = true;
    }
#else
    os_.write(reinterpret_cast<const char*>(buf_.data()), static_cast<std::streamsize>(used_));
#endif
    if (failed || !os_)
      fail(fn_, "writing failed after " + std::to_string(written_) + " bytes (disk full, or "
                "the stream was closed?)");
    written_ += used_;
    used_ = 0;
  }

  std::ostream& os_;
  const char* fn_;
  std::array<unsigned char, 16384> buf_{};
  std::size_t used_ = 0;
  std::uint64_t written_ = 0;
  std::uint32_t crc_ = 0xFFFFFFFFu;
};

// Reads up to n bytes; returns how many arrived (a short count at the end of the stream or
// on an error, whatever the stream's exception mask).
inline std::size_t read_some(std::istream& is, unsigned char* p, std::size_t n) {
  std::size_t got = 0;
#if LINATTN_HAS_EXCEPTIONS
  try {
    is.read(reinterpret_cast<char*>(p), static_cast<std::streamsize>(n));
    got = static_cast<std::size_t>(is.gcount());
  } catch (const std::ios_base::failure&) {
    got = static_cast<std::size_t>(is.gcount());
  }
#else
  is.read(reinterpret_cast<char*>(p), static_cast<std::streamsize>(n));
  got = static_cast<std::size_t>(is.gcount());
#endif
  return got;
}

inline void read_exact(std::istream& is, const char* fn, unsigned char* p, std::size_t n,
                       const char* what) {
  const std::size_t got = read_some(is, p, n);
  if (got != n)
    fail(fn, "truncated file: expected " + std::to_string(n) + " bytes of " + what + ", got " +
                 std::to_string(got));
}

// Bytes left in the stream when it can tell (a file, a string stream), or -1 (a pipe). Asks
// the buffer directly: istream::seekg would set failbit on a stream that cannot seek.
inline std::int64_t bytes_left(std::istream& is) {
  std::streambuf* sb = is.rdbuf();
  if (sb == nullptr) return -1;
  const auto cur = sb->pubseekoff(0, std::ios_base::cur, std::ios_base::in);
  if (cur == std::streampos(-1)) return -1;
  const auto end = sb->pubseekoff(0, std::ios_base::end, std::ios_base::in);
  const auto back = sb->pubseekpos(cur, std::ios_base::in);
  if (end == std::streampos(-1) || back != cur || end < cur) return -1;
  return static_cast<std::int64_t>(end - cur);
}

// Reads and checks the header: magic, version, its CRC, then the declared scalar type, kind
// and shapes against what the caller asks for and the sanity bounds. Returns it and the CRC
// register after it. `wanted` names what the caller loads in a wrong-kind message (default:
// kind_name(kind)); `also` is a second kind the caller reads (0: none), for an object whose
// files had another layout before.
template <class Scalar>
Header read_header(std::istream& is, const char* fn, std::uint32_t kind, std::uint32_t& crc,
                   const char* wanted = nullptr, std::uint32_t also = 0) {
  if (!is) fail(fn, "the stream is not readable (its failbit or badbit is set)");
  unsigned char h[kHeaderBytes];
  read_exact(is, fn, h, 8, "magic number");
  if (std::memcmp(h, kMagic.data(), 8) != 0)
    fail(fn, "wrong magic number: not a linattn state file (or one that went through a "
             "text-mode stream)");
  read_exact(is, fn, h + 8, 4, "format version");
  const std::uint32_t version = get_le<std::uint32_t>(h + 8);
  if (version != kVersion && version != kVersion1)
    fail(fn, "unsupported format version " + std::to_string(version) +
                 " (this linattn reads versions " + std::to_string(kVersion1) + " and " +
                 std::to_string(kVersion) + ")");
  const std::size_t header_bytes = version == kVersion1 ? kHeaderBytesV1 : kHeaderBytes;
  read_exact(is, fn, h + 12, header_bytes - 12, "header");
  const std::uint32_t stored = get_le<std::uint32_t>(h + header_bytes - 4);
  if (crc32(h, header_bytes - 4) != stored) fail(fn, "corrupted header: checksum mismatch");
  crc = crc32_update(0xFFFFFFFFu, h, header_bytes);

  Header hd;
  hd.version = version;
  hd.decay = version == kVersion1 ? 0 : get_le<std::uint64_t>(h + 56);
  hd.scalar = get_le<std::uint32_t>(h + 12);
  hd.kind = get_le<std::uint32_t>(h + 16);
  hd.flags = get_le<std::uint32_t>(h + 20);
  hd.heads = get_le<std::uint64_t>(h + 24);
  hd.key_dim = get_le<std::uint64_t>(h + 32);
  hd.F = get_le<std::uint64_t>(h + 40);
  hd.M = get_le<std::uint64_t>(h + 48);
  if (hd.scalar != kFloat && hd.scalar != kDouble)
    fail(fn, "unknown scalar type code " + std::to_string(hd.scalar));
  if (hd.scalar != scalar_code<Scalar>())
    fail(fn, std::string("wrong scalar type: the file holds ") + scalar_name(hd.scalar) +
                 ", not " + scalar_name(scalar_code<Scalar>()));
  if (hd.kind < kKindState || hd.kind > (version == kVersion1 ? kKindMultiHead : kKindLast))
    fail(fn, "unknown kind code " + std::to_string(hd.kind));
  if (hd.kind != kind && (also == 0 || hd.kind != also))
    fail(fn, std::string("wrong kind: the file holds ") + kind_name(hd.kind) + ", not " +
                 (wanted != nullptr ? wanted : kind_name(kind)));
  kind = hd.kind;
  if ((hd.flags & ~(kFlagMaxima | kFlagsStorage)) != 0)
    fail(fn, "unknown flags " + std::to_string(hd.flags));
  if ((hd.flags & kFlagsStorage) != 0 &&
      (!compact_kind(kind) || hd.scalar != kFloat || (hd.flags & kFlagsStorage) == kFlagsStorage))
    fail(fn, "invalid flags " + std::to_string(hd.flags) +
                 ": a bf16 / half state is one storage type, of a float gated or delta-rule "
                 "decoder's compact record");
  if (hd.heads == 0 || hd.heads > kMaxHeads ||
      (kind != kKindMultiHead && kind != kKindBatched && kind != kKindKVCache &&
       kind != kKindDeltaLayer && hd.heads != 1))
    fail(fn, "invalid head count " + std::to_string(hd.heads));
  if ((kind == kKindState) != (hd.key_dim == 0) || hd.key_dim > kMaxDim)
    fail(fn, "invalid key dimension " + std::to_string(hd.key_dim));
  // A KV cache: keys and values as projected, no feature map, maxima or decay.
  if (kind == kKindKVCache && hd.F != 0)
    fail(fn, "invalid feature dimension " + std::to_string(hd.F) +
                 ": a KV cache has no feature map (F must be 0)");
  if (kind == kKindKVCache && hd.maxima())
    fail(fn, "invalid flags " + std::to_string(hd.flags) + ": a KV cache has no running maxima");
  // Maxima of no feature would not save back (an empty m is saved without the flag).
  if (hd.maxima() && hd.F == 0)
    fail(fn, "invalid flags " + std::to_string(hd.flags) + ": running maxima with F = 0");
  // Compact records have no field for maxima (the gated and delta-rule maps have none).
  if ((compact_kind(kind) || kind == kKindDeltaLayer) && hd.maxima())
    fail(fn, "invalid flags " + std::to_string(hd.flags) + ": " + kind_name(kind) +
                 " has no running maxima");
  if (kind == kKindKVCache && hd.decay != 0)
    fail(fn, "invalid log-decay size " + std::to_string(hd.decay) +
                 ": a KV cache has no log-decay (L must be 0)");
  if (hd.decay != 0 && hd.decay != 1 && hd.decay != hd.F)
    fail(fn, "invalid log-decay size " + std::to_string(hd.decay) + " (must be 0, 1 or F = " +
                 std::to_string(hd.F) + ")");
  if (hd.decay != 0 && hd.maxima())
    fail(fn, "invalid log-decay size " + std::to_string(hd.decay) +
                 ": a state with running maxima (SoftmaxSplit) has no log-decay");
  if ((kind == kKindGated || kind == kKindGatedCompact) && hd.decay != hd.F)
    fail(fn, "invalid log-decay size " + std::to_string(hd.decay) +
                 ": a RecurrentGatedAttention keeps F = " + std::to_string(hd.F) + " entries");
  if ((kind == kKindDelta || kind == kKindDeltaLayer) && hd.decay != 0)
    fail(fn, "invalid log-decay size " + std::to_string(hd.decay) +
                 ": a RecurrentDeltaRule keeps no log-decay (L must be 0)");
  if (hd.F > kMaxDim || hd.M > kMaxDim ||
      head_bytes(hd, sizeof(Scalar)) > kMaxPayloadBytes / hd.heads)
    fail(fn, "absurd shape: F = " + std::to_string(hd.F) + ", M = " + std::to_string(hd.M) +
                 ", " + std::to_string(hd.heads) + " head(s) (more than the " +
                 std::to_string(kMaxPayloadBytes >> 30) + " GiB this loader accepts)");
  if (kind == kKindKVCache &&
      sizeof(Scalar) * hd.heads * (hd.key_dim + hd.M) > kMaxPayloadBytes)
    fail(fn, "absurd shape: one cached token of " + std::to_string(hd.heads) +
                 " head(s) of D = " + std::to_string(hd.key_dim) + ", M = " +
                 std::to_string(hd.M) + " is more than the " +
                 std::to_string(kMaxPayloadBytes >> 30) + " GiB this loader accepts");
  return hd;
}

// Reads the rest of a record, `total` bytes ending with the trailing CRC, and checks that CRC
// (`crc` is the register after everything before them). Allocates nothing beyond the bytes
// that actually arrive (plus one chunk): when the stream can tell its length, a short one is
// refused before anything is read. truncated(got) is the message for a record cut after `got`
// of these bytes.
template <class Truncated>
std::vector<unsigned char> read_body(std::istream& is, const char* fn, std::uint64_t total,
                                     std::uint32_t crc, const Truncated& truncated) {
  if (total > std::uint64_t(std::numeric_limits<std::size_t>::max()))
    fail(fn, "the state (" + std::to_string(total) + " bytes) is too large for this machine");
  const std::int64_t left = bytes_left(is);
  if (left >= 0 && std::uint64_t(left) < total) fail(fn, truncated(std::uint64_t(left)));
  std::vector<unsigned char> buf;
  if (left >= 0) buf.reserve(static_cast<std::size_t>(total));
  std::uint64_t got = 0;
  while (got < total) {
    const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(kReadChunk, total - got));
    buf.resize(static_cast<std::size_t>(got) + want);
    const std::size_t n = read_some(is, buf.data() + got, want);
    got += n;
    if (n < want) fail(fn, truncated(got));
  }
  const std::size_t body = static_cast<std::size_t>(total - 4);
  const std::uint32_t stored = get_le<std::uint32_t>(buf.data() + body);
  const std::uint32_t computed = crc32_update(crc, buf.data(), body) ^ 0xFFFFFFFFu;
  if (stored != computed)
    fail(fn, "corrupted data: checksum mismatch (stored " + std::to_string(stored) +
                 ", computed " + std::to_string(computed) + ")");
  return buf;
}

// One head's state and decoding position.
template <class Scalar>
struct HeadRecord {
  LinearAttentionState<Scalar> state;
  Index position = 0, unfolded = 0;
};

// Reads the payload and the trailing CRC after a checked header, verifies the CRC, and only
// then decodes: nothing is allocated beyond the bytes that actually arrived (plus one chunk),
// and nothing reaches the caller unless every byte checked out. For kind 5 the payload starts
// with the sequence count B, checked against the sanity bounds before the records are read;
// the records are then B·H, sequence-major (B = records / H).
template <class Scalar>
std::vector<HeadRecord<Scalar>> read_payload(std::istream& is, const char* fn,
                                             const Header& header, std::uint32_t crc) {
  constexpr std::uint64_t s = sizeof(Scalar);
  Header hd = header;
  std::uint64_t prefix = 0;  // bytes of the payload before the records (kind 5: B)
  if (hd.kind == kKindBatched) {
    unsigned char b[kSequencesBytes];
    const std::size_t n = read_some(is, b, kSequencesBytes);
    if (n < kSequencesBytes) fail(fn, truncation_message(hd, s, n));
    crc = crc32_update(crc, b, kSequencesBytes);
    hd.sequences = get_le<std::uint64_t>(b);
    prefix = kSequencesBytes;
    if (hd.sequences > kMaxStates / hd.heads)
      fail(fn, "absurd shape: B = " + std::to_string(hd.sequences) + " sequences of " +
                   std::to_string(hd.heads) + " head(s) (more than the " +
                   std::to_string(kMaxStates) + " (sequence, head) states this loader accepts)");
    if (hd.sequences * hd.heads * head_bytes(hd, s) > kMaxPayloadBytes)
      fail(fn, "absurd shape: F = " + std::to_string(hd.F) + ", M = " + std::to_string(hd.M) +
                   ", B = " + std::to_string(hd.sequences) + " sequences of " +
                   std::to_string(hd.heads) + " head(s) (more than the " +
                   std::to_string(kMaxPayloadBytes >> 30) + " GiB this loader accepts)");
  }
  const std::uint64_t records = record_count(hd);
  const std::vector<unsigned char> buf =
      read_body(is, fn, records * head_bytes(hd, s) + 4, crc,
                [&](std::uint64_t got) { return truncation_message(hd, s, prefix + got); });

  const Index F = static_cast<Index>(hd.F), M = static_cast<Index>(hd.M);
  const unsigned char* p = buf.data();
  const auto get_scalars = [&p](Scalar* x, Index n) {
    for (Index i = 0; i < n; ++i, p += s) {
      const Bits<Scalar> b = get_le<Bits<Scalar>>(p);
      std::memcpy(x + i, &b, sizeof b);
    }
  };
  // An empty batched decoder has no state to decay: a log-decay size would not save back.
  if (hd.kind == kKindBatched && records == 0 && hd.decay != 0)
    fail(fn, "invalid log-decay size " + std::to_string(hd.decay) +
                 ": a file of B = 0 sequences has no state to decay (L must be 0)");
  std::vector<HeadRecord<Scalar>> heads(static_cast<std::size_t>(records));
  for (std::size_t h = 0; h < heads.size(); ++h) {
    HeadRecord<Scalar>& r = heads[h];
    const bool compact = compact_kind(hd.kind);
    const std::int64_t position = to_signed(get_le<std::uint64_t>(p));
    const std::uint64_t unfolded = compact ? 0 : get_le<std::uint64_t>(p + 8);
    p += compact ? kPositionBytes : kHeadPrefixBytes;
    const std::string name = record_name(hd, h);
    const std::string which = name.empty() ? name : name + ": ";
    // A position counts tokens: a negative one is no decoder's, whatever the checksums say.
    if (position < 0)
      fail(fn, "invalid record: " + which + "position " + std::to_string(position) +
                   " (a decoding position counts tokens and is never negative)");
    // The H heads of a sequence share its position (BatchedRecurrentLinearAttention::position).
    if (hd.kind == kKindBatched && h % hd.heads != 0 &&
        static_cast<Index>(position) != heads[h - h % hd.heads].position)
      fail(fn, "invalid record: " + which + "position " + std::to_string(position) +
                   ", but head 0 of the sequence has " +
                   std::to_string(heads[h - h % hd.heads].position) +
                   " (the heads of a sequence share one position)");
    if (hd.kind == kKindState && (position != 0 || unfolded != 0))
      fail(fn, "invalid record: a LinearAttentionState has position 0 and 0 unfolded tokens, "
               "the file says " + std::to_string(position) + " and " + std::to_string(unfolded));
    if (hd.kind == kKindGated && unfolded != 0)
      fail(fn, "invalid record: a RecurrentGatedAttention keeps no low part, so 0 unfolded "
               "tokens, the file says " + std::to_string(unfolded));
    if (unfolded >= std::uint64_t(RecurrentLinearAttention<>::kFoldTokens))
      fail(fn, "invalid record: " + which + std::to_string(unfolded) +
                   " unfolded tokens (at most " +
                   std::to_string(RecurrentLinearAttention<>::kFoldTokens - 1) + ")");
    r.position = static_cast<Index>(position);
    r.unfolded = static_cast<Index>(unfolded);
    auto& st = r.state;
    st.S.resize(F, M);
    get_scalars(st.S.data(), F * M);
    if (compact) {  // the decoders keep zero low parts (and the delta rule a zero z)
      st.S_lo.setZero(F, M);
      st.z_lo.setZero(F);
      if (hd.kind == kKindDelta)
        st.z.setZero(F);
      else {
        st.z.resize(F);
        get_scalars(st.z.data(), F);
      }
    } else {
      st.S_lo.resize(F, M);
      st.z.resize(F);
      st.z_lo.resize(F);
      get_scalars(st.S_lo.data(), F * M);
      get_scalars(st.z.data(), F);
      get_scalars(st.z_lo.data(), F);
    }
    if (hd.kind == kKindGated) {
      const auto zero_bits = [](const Scalar* x, Index n) {
        const Scalar zero(0);
        for (Index i = 0; i < n; ++i)
          if (std::memcmp(x + i, &zero, sizeof zero) != 0) return false;
        return true;
      };
      if (!zero_bits(st.S_lo.data(), F * M) || !zero_bits(st.z_lo.data(), F))
        fail(fn, "invalid record: a RecurrentGatedAttention keeps no low part, the file's "
                 "S_lo or z_lo is not all zero bits");
    }
    if (hd.maxima()) {
      st.m.resize(F);
      get_scalars(st.m.data(), F);
    }
    if (hd.decay != 0) {
      st.log_decay.resize(static_cast<Index>(hd.decay));
      get_scalars(st.log_decay.data(), st.log_decay.size());
      const std::string bad = impossible_log_decay(st.log_decay);
      if (!bad.empty()) fail(fn, "invalid record: " + which + bad);
    }
  }
  return heads;
}

// Which field byte `got` of a kind-6 payload (from the token count T on) falls in, and how
// many of its bytes came before: for the message of a truncated file. Past the first 8 bytes,
// T must be the file's.
inline std::string kv_truncation_message(const Header& h, std::uint64_t s, std::uint64_t T,
                                         std::uint64_t got) {
  const std::pair<const char*, std::uint64_t> fields[] = {
      {"cached token count T", kTokensBytes},
      {"keys", T * h.heads * h.key_dim * s},
      {"values", T * h.heads * h.M * s}};
  std::uint64_t at = 0;
  for (const auto& f : fields) {
    if (f.second > 0 && got < at + f.second)
      return "truncated file: expected " + std::to_string(f.second) + " bytes of " + f.first +
             ", got " + std::to_string(got - at);
    at += f.second;
  }
  return "truncated file: expected 4 bytes of checksum, got " + std::to_string(got - at);
}

// The cached rows of a kind-6 file: keys T x H·D and values T x H·M (T = rows).
template <class Scalar>
struct KVRecord {
  RecurrentStateAccess::RowMatrix<Scalar> keys, values;
};

// Reads a kind-6 payload after a checked header: the token count T, checked against the
// sanity bounds before anything is allocated, then (read_body) the T key rows, the T value
// rows and the trailing CRC; decoded only once the CRC checks out.
template <class Scalar>
KVRecord<Scalar> read_kv_payload(std::istream& is, const char* fn, const Header& hd,
                                 std::uint32_t crc) {
  constexpr std::uint64_t s = sizeof(Scalar);
  unsigned char b[kTokensBytes];
  const std::size_t n = read_some(is, b, kTokensBytes);
  if (n < kTokensBytes) fail(fn, kv_truncation_message(hd, s, 0, n));
  crc = crc32_update(crc, b, kTokensBytes);
  const std::uint64_t T = get_le<std::uint64_t>(b);
  const std::uint64_t row = s * hd.heads * (hd.key_dim + hd.M);  // > 0, <= 64 GiB (header)
  if (T > kMaxPayloadBytes / row)
    fail(fn, "absurd shape: T = " + std::to_string(T) + " cached tokens of " +
                 std::to_string(hd.heads) + " head(s) of D = " + std::to_string(hd.key_dim) +
                 ", M = " + std::to_string(hd.M) + " (more than the " +
                 std::to_string(kMaxPayloadBytes >> 30) + " GiB this loader accepts)");
  const std::vector<unsigned char> buf =
      read_body(is, fn, T * row + 4, crc, [&](std::uint64_t got) {
        return kv_truncation_message(hd, s, T, kTokensBytes + got);
      });
  const Index rows = static_cast<Index>(T);
  const Index HD = static_cast<Index>(hd.heads * hd.key_dim);
  const Index HM = static_cast<Index>(hd.heads * hd.M);
  KVRecord<Scalar> r;
  r.keys.resize(rows, HD);
  r.values.resize(rows, HM);
  const unsigned char* p = buf.data();
  const auto get_scalars = [&p](Scalar* x, Index count) {
    for (Index i = 0; i < count; ++i, p += s) {
      const Bits<Scalar> bits = get_le<Bits<Scalar>>(p);
      std::memcpy(x + i, &bits, sizeof bits);
    }
  };
  get_scalars(r.keys.data(), rows * HD);  // row-major: the file's order
  get_scalars(r.values.data(), rows * HM);
  return r;
}

// Writes a header (with its CRC) for the given shapes and log-decay entries per head.
template <class Scalar>
void write_header(Writer& w, std::uint32_t kind, bool maxima, Index heads, Index key_dim, Index F,
                  Index M, Index decay, std::uint32_t storage = 0) {
  w.bytes(kMagic.data(), kMagic.size());
  w.integer(kVersion);
  w.integer(scalar_code<Scalar>());
  w.integer(kind);
  w.integer(std::uint32_t((maxima ? kFlagMaxima : 0) | storage));
  w.integer(std::uint64_t(heads));
  w.integer(std::uint64_t(key_dim));
  w.integer(std::uint64_t(F));
  w.integer(std::uint64_t(M));
  w.integer(std::uint64_t(decay));
  w.header_crc();
}

// One head record; empty low parts are written as zeros.
template <class Scalar>
void write_head(Writer& w, const LinearAttentionState<Scalar>& st, Index position, Index unfolded) {
  const Index F = st.S.rows(), M = st.S.cols();
  w.integer(from_signed(std::int64_t(position)));
  w.integer(std::uint64_t(unfolded));
  w.scalars(st.S.data(), F * M);
  if (st.S_lo.size() != 0) w.scalars(st.S_lo.data(), F * M); else w.zeros<Scalar>(F * M);
  w.scalars(st.z.data(), F);
  if (st.z_lo.size() != 0) w.scalars(st.z_lo.data(), F); else w.zeros<Scalar>(F);
  if (st.m.size() != 0) w.scalars(st.m.data(), F);
  if (st.log_decay.size() != 0) w.scalars(st.log_decay.data(), st.log_decay.size());
}

// A compact record's position (kinds 7 and 8; the arrays follow, written by the caller).
inline void write_position(Writer& w, Index position) {
  w.integer(from_signed(std::int64_t(position)));
}

// The log-decay entries of a state to save (0, 1 or F; 0 with running maxima), or
// std::invalid_argument; so is an entry that no load would accept (impossible_log_decay).
template <class Scalar>
Index decay_entries(const char* fn, const LinearAttentionState<Scalar>& st) {
  const Index L = st.log_decay.size(), F = st.S.rows();
  if (L != 0 && L != 1 && L != F)
    throw_invalid(fn, "the state's log-decay has " + std::to_string(L) +
                          " entries, not 0, 1 or F = " + std::to_string(F));
  if (L != 0 && st.m.size() != 0)
    throw_invalid(fn, "a state with running maxima (SoftmaxSplit) has no log-decay, this one "
                      "has " + std::to_string(L) + " entries");
  const std::string bad = impossible_log_decay(st.log_decay);
  if (!bad.empty()) throw_invalid(fn, "the state's " + bad);
  return L;
}

// A compact record's storage type (flags) against the decoder's: a bf16 / half state's file
// loads only into a decoder of the same storage, so that a load neither rounds a float state
// nor claims precision a rounded one never had.
template <class Scalar, class StateScalar>
void check_storage(const char* fn, const Header& hd, const char* object) {
  const std::uint32_t want = storage_flag<StateScalar>(), got = hd.flags & kFlagsStorage;
  if (got != want)
    fail(fn, std::string("storage type mismatch: the file holds the state of a decoder that "
                         "keeps S in ") +
                 storage_name(got, scalar_name(hd.scalar)) + ", the " + object + " keeps it in " +
                 storage_name(want, scalar_name(scalar_code<Scalar>())));
}

// A recurrent object's shapes against a header's, as runtime_error naming both.
inline void check_object_shape(const char* fn, const Header& hd, const char* object,
                               std::uint64_t heads, std::uint64_t key_dim, std::uint64_t F,
                               std::uint64_t M, bool maxima) {
  if (hd.heads == heads && hd.key_dim == key_dim && hd.F == F && hd.M == M && hd.maxima() == maxima)
    return;
  const auto describe = [](std::uint64_t h, std::uint64_t d, std::uint64_t f, std::uint64_t m,
                           bool mx) {
    return std::to_string(h) + " head(s) of D = " + std::to_string(d) + ", F = " +
           std::to_string(f) + ", M = " + std::to_string(m) + (mx ? " with" : " without") +
           " running maxima";
  };
  fail(fn, std::string("shape mismatch: the file holds ") +
               describe(hd.heads, hd.key_dim, hd.F, hd.M, hd.maxima()) + ", this " + object +
               " has " + describe(heads, key_dim, F, M, maxima));
}

// A KV cache's shapes against a kind-6 header's, as runtime_error naming both.
inline void check_cache_shape(const char* fn, const Header& hd, const char* object,
                              std::uint64_t heads, std::uint64_t key_dim, std::uint64_t M) {
  if (hd.heads == heads && hd.key_dim == key_dim && hd.M == M) return;
  const auto describe = [](std::uint64_t h, std::uint64_t d, std::uint64_t m) {
    return std::to_string(h) + " head(s) of D = " + std::to_string(d) + ", M = " +
           std::to_string(m);
  };
  fail(fn, std::string("shape mismatch: the file holds a KV cache of ") +
               describe(hd.heads, hd.key_dim, hd.M) + ", this " + object + " has " +
               describe(heads, key_dim, M));
}

}  // namespace io
}  // namespace detail
}  // namespace linattn
