/// \file core/checksum.hpp
/// \brief The CRC-32 that linattn's state files carry (state_io.hpp), for an engine's own
/// records kept beside them: over bytes, or over the scalars of an Eigen matrix or vector.
#pragma once

#include <Eigen/Core>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace linattn {
namespace detail::io {

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
inline std::uint32_t crc32_update(std::uint32_t crc, const unsigned char* p,
                                  std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) crc = kCrc32Table[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return crc;
}

/// CRC-32 of n bytes (exposed for the tests' check value).
inline std::uint32_t crc32(const void* data, std::size_t n) noexcept {
  return crc32_update(0xFFFFFFFFu, static_cast<const unsigned char*>(data), n) ^ 0xFFFFFFFFu;
}

}  // namespace detail::io

/// \brief The CRC-32 of `bytes` bytes at `data`, continuing `previous` (the checksum of the
/// bytes before them; 0 to start): the checksum that linattn's state files carry (reflected
/// polynomial 0xEDB88320, initial value and final XOR 0xFFFFFFFF, as zlib's `crc32()`;
/// "123456789" gives 0xCBF43926). It detects every error of one bit and every burst of up to
/// 32 bits. Chaining is exact: `checksum(b, nb, checksum(a, na))` is the checksum of a's bytes
/// followed by b's.
/// \code
/// // An engine's record beside a state file: its own header, then a checksum of it.
/// const std::uint32_t crc = linattn::checksum(&meta, sizeof meta);
/// // ... or of several pieces, one after the other:
/// std::uint32_t c = linattn::checksum(tokens.data(), tokens.size() * sizeof(int));
/// c = linattn::checksum(name.data(), name.size(), c);
/// \endcode
/// \param data the first byte.
/// \param bytes how many bytes to read.
/// \param previous the checksum of the bytes before them (0 to start).
/// \return the CRC-32 of the bytes before them and these.
inline std::uint32_t checksum(const void* data, std::size_t bytes,
                              std::uint32_t previous = 0) noexcept {
  return detail::io::crc32_update(previous ^ 0xFFFFFFFFu, static_cast<const unsigned char*>(data),
                                  bytes) ^
         0xFFFFFFFFu;
}

/// \brief The CRC-32 (as checksum(const void*, std::size_t, std::uint32_t)) of the scalars of
/// `x` in its storage order, each as its IEEE 754 bits in little-endian byte order, the
/// encoding of linattn's state files: the same value on every host, so a checksum recorded on
/// one machine checks the matrix loaded on another. float or double scalars; a plain Matrix or
/// Array is read in place, any other expression (a block, a Map) evaluated into a copy first.
/// \code
/// const Eigen::MatrixXf W = ...;  // weights an engine stores beside a state file
/// const std::uint32_t crc = linattn::checksum(W);
/// // later, after loading W back: if (linattn::checksum(W) != crc) ... (corrupted)
/// \endcode
/// \param x the float or double matrix or array to check.
/// \param previous the checksum of the data before it (0 to start).
/// \return the CRC-32 of the data before it and the scalars of x.
template <class Derived>
std::uint32_t checksum(const Eigen::DenseBase<Derived>& x, std::uint32_t previous = 0) {
  using Scalar = typename Derived::Scalar;
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                "linattn::checksum: the scalars must be float or double");
  using Bits = std::conditional_t<sizeof(Scalar) == 4, std::uint32_t, std::uint64_t>;
  const auto& plain = x.derived().eval();  // a reference for a plain object, else a temporary
  const Scalar* p = plain.data();
  std::uint32_t crc = previous ^ 0xFFFFFFFFu;
  unsigned char buf[256 * sizeof(Scalar)];
  const Eigen::Index n = plain.size();
  for (Eigen::Index i0 = 0; i0 < n; i0 += 256) {
    const Eigen::Index nb = n - i0 < 256 ? n - i0 : 256;
    for (Eigen::Index i = 0; i < nb; ++i) {
      Bits b;
      std::memcpy(&b, p + i0 + i, sizeof b);
      for (std::size_t k = 0; k < sizeof b; ++k)
        buf[std::size_t(i) * sizeof b + k] = static_cast<unsigned char>(b >> (8 * k));
    }
    crc = detail::io::crc32_update(crc, buf, std::size_t(nb) * sizeof(Scalar));
  }
  return crc ^ 0xFFFFFFFFu;
}

}  // namespace linattn
