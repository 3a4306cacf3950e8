/// \file state_io.hpp
/// \brief Saving a state to a stream and loading it back, exactly: a LinearAttentionState, or
/// the whole decoding position of a RecurrentLinearAttention, a
/// MultiHeadRecurrentLinearAttention or a RecurrentGatedAttention, in a little-endian binary
/// format with a checksum (docs/SPEC.md §8, "What linattn implements: saving a state").
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
/// | 16 | 4 | kind, u32: 1 = LinearAttentionState, 2 = RecurrentLinearAttention, 3 = MultiHeadRecurrentLinearAttention, 4 = RecurrentGatedAttention (version 2 only) |
/// | 20 | 4 | flags, u32: bit 0 = running maxima `m` present (SoftmaxSplit); other bits 0 |
/// | 24 | 8 | heads H, u64 (1 unless kind 3) |
/// | 32 | 8 | key dimension D, u64 (0 for kind 1: a state does not know it) |
/// | 40 | 8 | feature dimension F, u64 |
/// | 48 | 8 | value dimension M, u64 |
/// | 56 | 8 | log-decay entries per head L, u64: 0 (undecayed), 1 (scalar decay) or F (per-feature gates); 0 with running maxima; F for kind 4 |
/// | 64 | 4 | CRC-32 of bytes 0–63 |
/// | 68 | … | H head records, one after the other (below) |
/// | end − 4 | 4 | CRC-32 of every byte before it |
///
/// A head record (s = 4 or 8 bytes per scalar; matrices row-major):
///
/// | bytes | field |
/// |------:|-------|
/// | 8     | position, i64 (two's complement; 0 for kind 1) |
/// | 8     | tokens in the low parts since their last fold, u64 (below 128; 0 for kinds 1 and 4) |
/// | F·M·s | `S` |
/// | F·M·s | `S_lo` (zeros when the state's low part is empty; all bits 0 for kind 4) |
/// | F·s   | `z` |
/// | F·s   | `z_lo` (zeros when empty; all bits 0 for kind 4) |
/// | F·s   | `m`, only when flag bit 0 is set |
/// | L·s   | `log_decay` (LinearAttentionState::log_decay), only when L > 0 |
///
/// The file is 72 + H·(16 + s·(2·F·M + 2·F [+ F] + L)) bytes. The CRC-32 is the common one
/// (reflected polynomial 0xEDB88320, initial value and final XOR 0xFFFFFFFF; "123456789" gives
/// 0xCBF43926): it detects every error of one bit and every burst of up to 32.
///
/// **Version 1** (linattn before decayed states) is still read, exactly as before: its header
/// has no L field (bytes 0–55 as above with version 1, the CRC-32 of bytes 0–55 at 56, the
/// records from 60), its records no `log_decay`, and a loaded state has an empty `log_decay`.
/// The file is 64 + H·(16 + s·(2·F·M + 2·F [+ F])) bytes. Only version 2 is written.
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

#include "checks.hpp"
#include "common.hpp"
#include "feature_map.hpp"
#include "multihead.hpp"
#include "recurrent_gated_attention.hpp"
#include "recurrent_linear_attention.hpp"
#include "state.hpp"

namespace linattn {
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
  template <class Phi, class Scalar>
  static void install(RecurrentGatedAttention<Phi, Scalar>& r, LinearAttentionState<Scalar>&& st,
                      Index position) noexcept {
    r.state_ = std::move(st);
    r.position_ = position;
  }
};

namespace io {

constexpr std::array<unsigned char, 8> kMagic = {0x89, 'L', 'A', 'S', '\r', '\n', 0x1A, '\n'};
constexpr std::uint32_t kVersion = 2;   // written; version 1 (no log-decay) is still read
constexpr std::uint32_t kVersion1 = 1;
constexpr std::uint32_t kFloat = 1, kDouble = 2;
constexpr std::uint32_t kKindState = 1, kKindRecurrent = 2, kKindMultiHead = 3;
constexpr std::uint32_t kKindGated = 4;  // version 2 only
constexpr std::uint32_t kFlagMaxima = 1;
constexpr std::size_t kHeaderBytes = 68;    // with its CRC (version 2)
constexpr std::size_t kHeaderBytesV1 = 60;  // version 1: no log-decay field
constexpr std::size_t kHeadPrefixBytes = 16;  // position, unfolded tokens
// Sanity bounds on a file's declared shapes, checked before anything is allocated: far above
// any real state (a 4096 x 4096 double state is 256 MiB), far below what would overflow the
// size arithmetic.
constexpr std::uint64_t kMaxHeads = std::uint64_t(1) << 16;
constexpr std::uint64_t kMaxDim = std::uint64_t(1) << 24;
constexpr std::uint64_t kMaxPayloadBytes = std::uint64_t(1) << 36;  // 64 GiB
// Bytes read from the stream at a time: a file that declares more than it holds costs at most
// this much beyond its actual length before the truncation is found.
constexpr std::size_t kReadChunk = std::size_t(1) << 20;

constexpr std::array<std::uint32_t, 256> make_crc32_table() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[i] = c;
  }
  return t;
}
inline constexpr std::array<std::uint32_t, 256> kCrc32Table = make_crc32_table();

// The running register of a CRC-32 (start with 0xFFFFFFFF, XOR the end result with it).
inline std::uint32_t crc32_update(std::uint32_t crc, const unsigned char* p, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) crc = kCrc32Table[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return crc;
}

/// CRC-32 of n bytes (exposed for the tests' check value).
inline std::uint32_t crc32(const void* data, std::size_t n) noexcept {
  return crc32_update(0xFFFFFFFFu, static_cast<const unsigned char*>(data), n) ^ 0xFFFFFFFFu;
}

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
    case kKindGated: return "the state of a RecurrentGatedAttention";
    default: return "the states of a MultiHeadRecurrentLinearAttention";
  }
}

[[noreturn]] inline void fail(const char* function, const std::string& what) {
  throw std::runtime_error(std::string("linattn::") + function + ": " + what);
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
  bool maxima() const noexcept { return (flags & kFlagMaxima) != 0; }
};

// Bytes of one head record for scalars of s bytes (the bounds keep this from overflowing).
inline std::uint64_t head_bytes(const Header& h, std::uint64_t s) {
  return kHeadPrefixBytes + s * (2 * h.F * h.M + (h.maxima() ? 3 : 2) * h.F + h.decay);
}

// Which field byte `offset` of the payload falls in, and how many of its bytes came before:
// for the message of a truncated file.
inline std::string truncation_message(const Header& h, std::uint64_t s, std::uint64_t got) {
  const std::uint64_t FM = h.F * h.M;
  const std::pair<const char*, std::uint64_t> fields[] = {
      {"position", 8}, {"unfolded token count", 8}, {"S", FM * s}, {"S_lo", FM * s},
      {"z", h.F * s},  {"z_lo", h.F * s},           {"m", h.maxima() ? h.F * s : 0},
      {"log_decay", h.decay * s}};
  std::uint64_t at = 0;
  for (std::uint64_t head = 0; head < h.heads; ++head)
    for (const auto& f : fields) {
      if (f.second > 0 && got < at + f.second)
        return "truncated file: expected " + std::to_string(f.second) + " bytes of " + f.first +
               (h.heads > 1 ? " (head " + std::to_string(head) + ")" : std::string()) +
               ", got " + std::to_string(got - at);
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
    try {
      os_.flush();
    } catch (const std::ios_base::failure&) {  // an exception mask: report it our way
      failed = true;
    }
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
    try {
      os_.write(reinterpret_cast<const char*>(buf_.data()), static_cast<std::streamsize>(used_));
    } catch (const std::ios_base::failure&) {  // an exception mask: report it our way
      failed = true;
    }
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
  try {
    is.read(reinterpret_cast<char*>(p), static_cast<std::streamsize>(n));
    got = static_cast<std::size_t>(is.gcount());
  } catch (const std::ios_base::failure&) {
    got = static_cast<std::size_t>(is.gcount());
  }
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
// register after it.
template <class Scalar>
Header read_header(std::istream& is, const char* fn, std::uint32_t kind, std::uint32_t& crc) {
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
  if (hd.kind < kKindState || hd.kind > (version == kVersion1 ? kKindMultiHead : kKindGated))
    fail(fn, "unknown kind code " + std::to_string(hd.kind));
  if (hd.kind != kind)
    fail(fn, std::string("wrong kind: the file holds ") + kind_name(hd.kind) + ", not " +
                 kind_name(kind));
  if ((hd.flags & ~kFlagMaxima) != 0) fail(fn, "unknown flags " + std::to_string(hd.flags));
  if (hd.heads == 0 || hd.heads > kMaxHeads || (kind != kKindMultiHead && hd.heads != 1))
    fail(fn, "invalid head count " + std::to_string(hd.heads));
  if ((kind == kKindState) != (hd.key_dim == 0) || hd.key_dim > kMaxDim)
    fail(fn, "invalid key dimension " + std::to_string(hd.key_dim));
  if (hd.decay != 0 && hd.decay != 1 && hd.decay != hd.F)
    fail(fn, "invalid log-decay size " + std::to_string(hd.decay) + " (must be 0, 1 or F = " +
                 std::to_string(hd.F) + ")");
  if (hd.decay != 0 && hd.maxima())
    fail(fn, "invalid log-decay size " + std::to_string(hd.decay) +
                 ": a state with running maxima (SoftmaxSplit) has no log-decay");
  if (kind == kKindGated && hd.decay != hd.F)
    fail(fn, "invalid log-decay size " + std::to_string(hd.decay) +
                 ": a RecurrentGatedAttention keeps F = " + std::to_string(hd.F) + " entries");
  if (hd.F > kMaxDim || hd.M > kMaxDim ||
      head_bytes(hd, sizeof(Scalar)) > kMaxPayloadBytes / hd.heads)
    fail(fn, "absurd shape: F = " + std::to_string(hd.F) + ", M = " + std::to_string(hd.M) +
                 ", " + std::to_string(hd.heads) + " head(s) (more than the " +
                 std::to_string(kMaxPayloadBytes >> 30) + " GiB this loader accepts)");
  return hd;
}

// One head's state and decoding position.
template <class Scalar>
struct HeadRecord {
  LinearAttentionState<Scalar> state;
  Index position = 0, unfolded = 0;
};

// Reads the payload and the trailing CRC after a checked header, verifies the CRC, and only
// then decodes: nothing is allocated beyond the bytes that actually arrived (plus one chunk),
// and nothing reaches the caller unless every byte checked out.
template <class Scalar>
std::vector<HeadRecord<Scalar>> read_payload(std::istream& is, const char* fn, const Header& hd,
                                             std::uint32_t crc) {
  constexpr std::uint64_t s = sizeof(Scalar);
  const std::uint64_t total = hd.heads * head_bytes(hd, s) + 4;
  if (total > std::uint64_t(std::numeric_limits<std::size_t>::max()))
    fail(fn, "the state (" + std::to_string(total) + " bytes) is too large for this machine");
  const std::int64_t left = bytes_left(is);
  if (left >= 0 && std::uint64_t(left) < total)
    fail(fn, truncation_message(hd, s, std::uint64_t(left)));
  std::vector<unsigned char> buf;
  if (left >= 0) buf.reserve(static_cast<std::size_t>(total));
  std::uint64_t got = 0;
  while (got < total) {
    const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(kReadChunk, total - got));
    buf.resize(static_cast<std::size_t>(got) + want);
    const std::size_t n = read_some(is, buf.data() + got, want);
    got += n;
    if (n < want) fail(fn, truncation_message(hd, s, got));
  }
  const std::size_t body = static_cast<std::size_t>(total - 4);
  const std::uint32_t stored = get_le<std::uint32_t>(buf.data() + body);
  const std::uint32_t computed = crc32_update(crc, buf.data(), body) ^ 0xFFFFFFFFu;
  if (stored != computed)
    fail(fn, "corrupted data: checksum mismatch (stored " + std::to_string(stored) +
                 ", computed " + std::to_string(computed) + ")");

  const Index F = static_cast<Index>(hd.F), M = static_cast<Index>(hd.M);
  const unsigned char* p = buf.data();
  const auto get_scalars = [&p](Scalar* x, Index n) {
    for (Index i = 0; i < n; ++i, p += s) {
      const Bits<Scalar> b = get_le<Bits<Scalar>>(p);
      std::memcpy(x + i, &b, sizeof b);
    }
  };
  std::vector<HeadRecord<Scalar>> heads(static_cast<std::size_t>(hd.heads));
  for (std::size_t h = 0; h < heads.size(); ++h) {
    HeadRecord<Scalar>& r = heads[h];
    const std::int64_t position = to_signed(get_le<std::uint64_t>(p));
    const std::uint64_t unfolded = get_le<std::uint64_t>(p + 8);
    p += kHeadPrefixBytes;
    const std::string which = hd.heads > 1 ? "head " + std::to_string(h) + ": " : std::string();
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
    st.S_lo.resize(F, M);
    st.z.resize(F);
    st.z_lo.resize(F);
    get_scalars(st.S.data(), F * M);
    get_scalars(st.S_lo.data(), F * M);
    get_scalars(st.z.data(), F);
    get_scalars(st.z_lo.data(), F);
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
    }
  }
  return heads;
}

// Writes a header (with its CRC) for the given shapes and log-decay entries per head.
template <class Scalar>
void write_header(Writer& w, std::uint32_t kind, bool maxima, Index heads, Index key_dim, Index F,
                  Index M, Index decay) {
  w.bytes(kMagic.data(), kMagic.size());
  w.integer(kVersion);
  w.integer(scalar_code<Scalar>());
  w.integer(kind);
  w.integer(std::uint32_t(maxima ? kFlagMaxima : 0));
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

// The log-decay entries of a state to save (0, 1 or F; 0 with running maxima), or
// std::invalid_argument.
template <class Scalar>
Index decay_entries(const char* fn, const LinearAttentionState<Scalar>& st) {
  const Index L = st.log_decay.size(), F = st.S.rows();
  if (L != 0 && L != 1 && L != F)
    throw_invalid(fn, "the state's log-decay has " + std::to_string(L) +
                          " entries, not 0, 1 or F = " + std::to_string(F));
  if (L != 0 && st.m.size() != 0)
    throw_invalid(fn, "a state with running maxima (SoftmaxSplit) has no log-decay, this one "
                      "has " + std::to_string(L) + " entries");
  return L;
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

}  // namespace io
}  // namespace detail

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
/// its log_decay has neither 0, 1 nor F entries, or it has both maxima and a log-decay.
/// \throws std::runtime_error naming the cause if the stream was not writable or a write
/// failed (the stream then holds part of a record).
/// \code
/// auto state = linattn::summarize(K, V, linattn::EluPlusOne{});
/// std::ofstream file("prompt.state", std::ios::binary);
/// linattn::save_state(file, state);
/// \endcode
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
/// (including a log-decay size other than 0, 1 or F, or one with running maxima). The
/// stream's position is then unspecified.
/// \code
/// std::ifstream file("prompt.state", std::ios::binary);
/// auto state = linattn::load_state<float>(file);
/// linattn::causal_linear_attention(Q, K, V, linattn::EluPlusOne{}, state);  // continue
/// \endcode
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

/// \brief Writes the exact decoding position of a gated decoder (kind 4): its state S, z and
/// total log-decay `log_decay` (the decoder keeps F entries, so L = F), and position().
/// Loading it into an object of the same shapes with load_state(is, rnn) and stepping on
/// gives outputs bit-identical to `rnn`'s own.
///
/// The decoder keeps no low part, so the record's low parts and unfolded token count are zero.
/// The file records the state, not the feature map or the GatedOptions (normalize, scale):
/// load it into an object built with the same map and options.
/// \throws std::runtime_error if the stream was not writable or a write failed.
/// \code
/// linattn::RecurrentGatedAttention<linattn::Identity, float> rnn(64, 64);
/// // ... rnn.step(q, k, v, log_gate, out) for the prompt and some tokens ...
/// std::ofstream file("conversation.state", std::ios::binary);
/// linattn::save_state(file, rnn);
/// \endcode
template <class Phi, class Scalar>
void save_state(std::ostream& os, const RecurrentGatedAttention<Phi, Scalar>& rnn) {
  const auto& st = rnn.state();
  const Index decay = detail::io::decay_entries("save_state", st);
  detail::io::Writer w(os, "save_state");
  detail::io::write_header<Scalar>(w, detail::io::kKindGated, false, 1, rnn.key_dim(),
                                   rnn.feature_dim(), rnn.value_dim(), decay);
  detail::io::write_head(w, st, rnn.position(), 0);
  w.finish();
}

/// \brief Restores into `rnn` a decoding position that save_state(os, rnn) wrote: afterwards
/// `rnn` steps exactly as the saved object would have (same state bits, log_decay and
/// position()).
///
/// The file must come from an object of the same key dimension D, feature dimension F and
/// value dimension M; the map and the options are not recorded (use the ones that wrote it).
/// Strong guarantee: on any failure `rnn` is unchanged. Reads exactly one record.
/// \throws std::runtime_error `"linattn::load_state: ..."` for every failure of
/// load_state(std::istream&) (truncated, corrupted, wrong magic, version, scalar type or
/// kind, absurd shapes), "shape mismatch" naming the file's and the object's D, F and M,
/// "invalid log-decay size" for L other than F, and "invalid record" for a record with low
/// parts or unfolded tokens (neither is ever written).
/// \code
/// linattn::RecurrentGatedAttention<linattn::Identity, float> rnn(64, 64);
/// std::ifstream file("conversation.state", std::ios::binary);
/// linattn::load_state(file, rnn);
/// rnn.step(q, k, v, log_gate, out);  // continues the saved decode
/// \endcode
template <class Phi, class Scalar>
void load_state(std::istream& is, RecurrentGatedAttention<Phi, Scalar>& rnn) {
  constexpr const char* fn = "load_state";
  std::uint32_t crc = 0;
  const auto hd = detail::io::read_header<Scalar>(is, fn, detail::io::kKindGated, crc);
  detail::io::check_object_shape(fn, hd, "RecurrentGatedAttention", 1,
                                 std::uint64_t(rnn.key_dim()), std::uint64_t(rnn.feature_dim()),
                                 std::uint64_t(rnn.value_dim()), false);
  auto heads = detail::io::read_payload<Scalar>(is, fn, hd, crc);
  auto& r = heads.front();
  detail::RecurrentStateAccess::install(rnn, std::move(r.state), r.position);
}

}  // namespace linattn
