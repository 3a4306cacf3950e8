/// \file serving/detail/state_io_layer_format.hpp
/// \brief The kind-9 record of a delta-rule layer's BatchedState (internal; layout in
/// state_io_layers.hpp): its shape prefix, the message of a truncated file, and the decoding
/// of its checked bytes.
#pragma once

#include <cstdint>
#include <cstring>
#include <istream>
#include <string>
#include <utility>
#include <vector>

#include "../../core/common.hpp"
#include "../../core/state.hpp"
#include "state_io_format.hpp"

namespace linattn::detail::io {

constexpr std::size_t kLayerPrefixBytes = 24;  // kind 9: B, W, C before the sequences

// What the prefix of a kind-9 payload declares.
struct LayerPrefix {
  std::uint64_t sequences = 0, width = 0, channels = 0;  // B, W, C
};

// Bytes of one sequence's record: its position, its (W − 1) x C convolution state, H states S.
inline std::uint64_t layer_sequence_bytes(const Header& h, const LayerPrefix& p,
                                          std::uint64_t s) {
  return kPositionBytes + s * ((p.width - 1) * p.channels + h.heads * h.F * h.M);
}

// Which field byte `got` of the payload (from B on) falls in, and how many of its bytes came
// before: for the message of a truncated file. Past the prefix, p must be the file's.
inline std::string layer_truncation_message(const Header& h, const LayerPrefix& p,
                                            std::uint64_t s, std::uint64_t got) {
  const std::pair<const char*, std::uint64_t> prefix[] = {
      {"sequence count B", 8}, {"convolution width W", 8}, {"convolution channels C", 8}};
  std::uint64_t at = 0;
  for (const auto& f : prefix) {
    if (got < at + f.second)
      return "truncated file: expected 8 bytes of " + std::string(f.first) + ", got " +
             std::to_string(got - at);
    at += f.second;
  }
  const std::uint64_t conv = s * (p.width - 1) * p.channels, head = s * h.F * h.M;
  for (std::uint64_t b = 0; b < p.sequences; ++b) {
    const std::string seq = "sequence " + std::to_string(b);
    const auto field = [&](const std::string& name, std::uint64_t bytes) -> std::string {
      if (bytes == 0 || got >= at + bytes) {
        at += bytes;
        return std::string();
      }
      return "truncated file: expected " + std::to_string(bytes) + " bytes of " + name + ", got " +
             std::to_string(got - at);
    };
    std::string m = field("position (" + seq + ")", kPositionBytes);
    if (m.empty()) m = field("convolution state (" + seq + ")", conv);
    for (std::uint64_t hh = 0; m.empty() && hh < h.heads; ++hh)
      m = field("S (" + seq + ", head " + std::to_string(hh) + ")", head);
    if (!m.empty()) return m;
  }
  return "truncated file: expected 4 bytes of checksum, got " + std::to_string(got - at);
}

// One sequence of a kind-9 file.
template <class Scalar>
struct LayerSequenceRecord {
  Index position = 0;
  Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> conv;  // (W − 1) x C
  std::vector<LinearAttentionState<Scalar>> heads;  // S, zero low part and z (no update pending)
};

// Reads the prefix and the sequences of a kind-9 payload after a checked header whose H, D, F
// and M are the object's: W and C must be `width` and `channels` (else a shape mismatch naming
// both, `object` the loader's), B within the sanity bounds, then every byte and the CRC checked
// before anything is decoded.
template <class Scalar>
std::vector<LayerSequenceRecord<Scalar>> read_layer_payload(std::istream& is, const char* fn,
                                                            const Header& hd, std::uint32_t crc,
                                                            const char* object, Index width,
                                                            Index channels) {
  constexpr std::uint64_t s = sizeof(Scalar);
  unsigned char b[kLayerPrefixBytes];
  LayerPrefix p;
  const std::size_t n = read_some(is, b, kLayerPrefixBytes);
  if (n < kLayerPrefixBytes) fail(fn, layer_truncation_message(hd, p, s, n));
  crc = crc32_update(crc, b, kLayerPrefixBytes);
  p.sequences = get_le<std::uint64_t>(b);
  p.width = get_le<std::uint64_t>(b + 8);
  p.channels = get_le<std::uint64_t>(b + 16);
  if (p.width != std::uint64_t(width) || p.channels != std::uint64_t(channels))
    fail(fn, "shape mismatch: the file holds convolution states of W = " +
                 std::to_string(p.width) + ", C = " + std::to_string(p.channels) + ", this " +
                 object + " has W = " + std::to_string(width) + ", C = " +
                 std::to_string(channels));
  const std::uint64_t per = layer_sequence_bytes(hd, p, s);  // W, C, H, F, M: the object's
  if (p.sequences > kMaxStates / hd.heads || p.sequences * per > kMaxPayloadBytes)
    fail(fn, "absurd shape: B = " + std::to_string(p.sequences) + " sequences of " +
                 std::to_string(per) + " bytes (more than the " + std::to_string(kMaxStates) +
                 " (sequence, head) states or " + std::to_string(kMaxPayloadBytes >> 30) +
                 " GiB this loader accepts)");
  const std::vector<unsigned char> buf =
      read_body(is, fn, p.sequences * per + 4, crc, [&](std::uint64_t got) {
        return layer_truncation_message(hd, p, s, kLayerPrefixBytes + got);
      });
  const Index B = static_cast<Index>(p.sequences), H = static_cast<Index>(hd.heads);
  const Index F = static_cast<Index>(hd.F), M = static_cast<Index>(hd.M);
  const unsigned char* at = buf.data();
  const auto get_scalars = [&at](Scalar* x, Index count) {
    for (Index i = 0; i < count; ++i, at += s) {
      const Bits<Scalar> bits = get_le<Bits<Scalar>>(at);
      std::memcpy(x + i, &bits, sizeof bits);
    }
  };
  std::vector<LayerSequenceRecord<Scalar>> seqs(static_cast<std::size_t>(B));
  for (Index q = 0; q < B; ++q) {
    auto& r = seqs[static_cast<std::size_t>(q)];
    const std::int64_t position = to_signed(get_le<std::uint64_t>(at));
    at += kPositionBytes;
    // A position counts tokens: a negative one is no decoder's, whatever the checksums say.
    if (position < 0)
      fail(fn, "invalid record: sequence " + std::to_string(q) + ": position " +
                   std::to_string(position) +
                   " (a decoding position counts tokens and is never negative)");
    r.position = static_cast<Index>(position);
    r.conv.resize(width - 1, channels);
    get_scalars(r.conv.data(), (width - 1) * channels);  // row-major: the file's order
    r.heads.resize(static_cast<std::size_t>(H));
    for (auto& st : r.heads) {
      st.S.resize(F, M);
      get_scalars(st.S.data(), F * M);
      st.S_lo.setZero(F, M);
      st.z.setZero(F);
      st.z_lo.setZero(F);
    }
  }
  return seqs;
}

}  // namespace linattn::detail::io
