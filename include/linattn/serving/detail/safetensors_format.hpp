/// \file serving/detail/safetensors_format.hpp
/// \brief The safetensors format (internal): the dtype table, the JSON header parser with every
/// check of the layout, the little-endian element conversions and the header writer that
/// serving/safetensors.hpp builds on. The rules are listed in docs/SPEC.md §8, "Weights files
/// (safetensors)".
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <ios>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/common.hpp"
#include "../../core/detail/checks.hpp"
#include "../../core/error.hpp"

namespace linattn::detail::st {

// The dtype codes, in the order of TensorDtype's values (safetensors.hpp asserts it).
enum DtypeCode : int {
  kF64,
  kF32,
  kF16,
  kBF16,
  kI64,
  kI32,
  kI16,
  kI8,
  kU64,
  kU32,
  kU16,
  kU8,
  kBool,
  kF8E4M3,
  kF8E5M2,
  kF8E8M0,
  kDtypeCount
};

struct DtypeRow {
  const char* name;
  std::uint64_t bytes;
  bool floating;  // converted to float / double by the typed reads
};

inline const DtypeRow& dtype_row(int code) {
  static constexpr DtypeRow rows[kDtypeCount] = {
      {"F64", 8, true},   {"F32", 4, true},      {"F16", 2, true},      {"BF16", 2, true},
      {"I64", 8, false},  {"I32", 4, false},     {"I16", 2, false},     {"I8", 1, false},
      {"U64", 8, false},  {"U32", 4, false},     {"U16", 2, false},     {"U8", 1, false},
      {"BOOL", 1, false}, {"F8_E4M3", 1, false}, {"F8_E5M2", 1, false}, {"F8_E8M0", 1, false}};
  return rows[code];
}

inline int dtype_code(std::string_view name) {
  for (int c = 0; c < kDtypeCount; ++c)
    if (name == dtype_row(c).name) return c;
  return -1;
}

// The reference implementation's bound: a larger header is refused before it is allocated.
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
// Nesting allowed inside a tensor entry's unknown fields (skipped): bounds the recursion.
inline constexpr int kMaxDepth = 64;

[[noreturn]] inline void fail_file(const std::string& source, const std::string& what) {
  raise<std::runtime_error>("linattn::SafetensorsFile: " + source + ": " + what);
}

inline std::string in_quotes(std::string_view s) { return "'" + std::string(s) + "'"; }

template <class Dims>
std::string shape_text(const Dims& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Position of the first byte that is not well-formed UTF-8 (overlong forms, surrogates and code
// points above U+10FFFF are not), or npos.
inline std::size_t invalid_utf8_at(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  for (std::size_t i = 0; i < n;) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len;
    std::uint32_t cp, min;
    if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return i;
    }
    if (n - i < len) return i;
    for (std::size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string_view::npos;
}

inline void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// One tensor of the header, its layout checked.
struct Entry {
  std::string name;
  int dtype = 0;
  std::vector<Index> shape;
  std::uint64_t begin = 0, end = 0;
};

struct Header {
  std::vector<Entry> tensors;  // in the order of the header
  std::map<std::string, std::string> metadata;
};

// A parser of exactly the header's schema: an object of tensor entries and "__metadata__".
// Unknown fields of an entry are skipped (as the reference ignores them) but must be valid JSON.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& source) : s_(text), source_(source) {}

  Header parse() {
    if (const std::size_t bad = invalid_utf8_at(s_); bad != std::string_view::npos)
      fail("the header is not valid UTF-8 (byte " + std::to_string(bad) + ")");
    Header h;
    std::set<std::string> keys;
    ws();
    expect('{', "'{': the header is one JSON object");
    ws();
    if (!take('}')) {
      for (;;) {
        ws();
        std::string key = string_value();
        if (!keys.insert(key).second) fail("the key " + in_quotes(key) + " appears twice");
        ws();
        expect(':', "':' after a key");
        ws();
        if (key == "__metadata__")
          metadata(h.metadata);
        else
          h.tensors.push_back(tensor(std::move(key)));
        ws();
        if (take(',')) continue;
        expect('}', "',' or '}' in the header object");
        break;
      }
    }
    ws();
    if (pos_ != s_.size()) fail("unexpected text after the header's JSON object");
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    fail_file(source_, "bad header (at byte " + std::to_string(pos_) + " of the JSON): " + what);
  }
  bool at_end() const { return pos_ >= s_.size(); }
  char peek() const { return at_end() ? '\0' : s_[pos_]; }
  bool take(char c) {
    if (at_end() || s_[pos_] != c) return false;
    ++pos_;
    return true;
  }
  void expect(char c, const char* what) {
    if (!take(c)) fail(std::string("expected ") + what);
  }
  void ws() {
    while (!at_end() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }

  unsigned hex4() {
    if (s_.size() - pos_ < 4) fail("a \\u escape needs 4 hex digits");
    unsigned v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= unsigned(c - '0');
      else if (c >= 'a' && c <= 'f')
        v |= unsigned(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        v |= unsigned(c - 'A' + 10);
      else
        fail("a \\u escape needs 4 hex digits");
    }
    return v;
  }

  std::string string_value() {
    expect('"', "a string");
    std::string out;
    for (;;) {
      if (at_end()) fail("unterminated string");
      const char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character inside a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_end()) fail("unterminated string");
      switch (s_[pos_++]) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          std::uint32_t cp = hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) fail("a lone low surrogate in a \\u escape");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (!take('\\') || !take('u')) fail("a lone high surrogate in a \\u escape");
            const std::uint32_t lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("a lone high surrogate in a \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default:
          --pos_;
          fail("an invalid escape in a string");
      }
    }
  }

  // A non-negative JSON integer (no sign, fraction or exponent) that fits in 64 bits.
  std::uint64_t integer(const std::string& what) {
    if (peek() == '-') fail(what + " must be a non-negative integer");
    if (peek() < '0' || peek() > '9') fail(what + " must be an integer");
    if (peek() == '0' && pos_ + 1 < s_.size() && s_[pos_ + 1] >= '0' && s_[pos_ + 1] <= '9')
      fail(what + ": a JSON number has no leading zeros");
    std::uint64_t v = 0;
    while (peek() >= '0' && peek() <= '9') {
      const unsigned d = unsigned(s_[pos_++] - '0');
      if (v > (std::numeric_limits<std::uint64_t>::max() - d) / 10) fail(what + " is too large");
      v = v * 10 + d;
    }
    if (peek() == '.' || peek() == 'e' || peek() == 'E') fail(what + " must be an integer");
    return v;
  }

  // A JSON number of any form, only checked.
  void skip_number() {
    take('-');
    if (take('0')) {
    } else if (peek() >= '1' && peek() <= '9') {
      while (peek() >= '0' && peek() <= '9') ++pos_;
    } else {
      fail("expected a JSON value");
    }
    if (take('.')) {
      if (peek() < '0' || peek() > '9') fail("expected digits after '.'");
      while (peek() >= '0' && peek() <= '9') ++pos_;
    }
    if (take('e') || take('E')) {
      if (!take('+')) take('-');
      if (peek() < '0' || peek() > '9') fail("expected digits in an exponent");
      while (peek() >= '0' && peek() <= '9') ++pos_;
    }
  }

  void skip_value(int depth) {
    if (depth > kMaxDepth) fail("values nested too deeply");
    const char c = peek();
    if (c == '"') {
      string_value();
    } else if (c == '{' || c == '[') {
      const char close = c == '{' ? '}' : ']';
      ++pos_;
      ws();
      if (take(close)) return;
      for (;;) {
        ws();
        if (c == '{') {
          string_value();
          ws();
          expect(':', "':' after a key");
          ws();
        }
        skip_value(depth + 1);
        ws();
        if (take(',')) continue;
        if (!take(close)) fail(c == '{' ? "',' or '}' in an object" : "',' or ']' in an array");
        return;
      }
    } else if (s_.compare(pos_, 4, "true") == 0 || s_.compare(pos_, 4, "null") == 0) {
      pos_ += 4;
    } else if (s_.compare(pos_, 5, "false") == 0) {
      pos_ += 5;
    } else {
      skip_number();
    }
  }

  void metadata(std::map<std::string, std::string>& out) {
    if (s_.compare(pos_, 4, "null") == 0) {  // the reference's Option: null is no metadata
      pos_ += 4;
      return;
    }
    expect('{', "an object of strings for \"__metadata__\"");
    ws();
    if (take('}')) return;
    for (;;) {
      ws();
      std::string key = string_value();
      ws();
      expect(':', "':' after a key");
      ws();
      if (peek() != '"') fail("the __metadata__ value of " + in_quotes(key) + " must be a string");
      std::string value = string_value();
      if (!out.emplace(key, std::move(value)).second)
        fail("the __metadata__ key " + in_quotes(key) + " appears twice");
      ws();
      if (take(',')) continue;
      expect('}', "',' or '}' in \"__metadata__\"");
      return;
    }
  }

  void integers(std::vector<std::uint64_t>& out, const std::string& what) {
    expect('[', ("an array for " + what).c_str());
    ws();
    if (take(']')) return;
    for (;;) {
      ws();
      out.push_back(integer(what));
      ws();
      if (take(',')) continue;
      expect(']', ("',' or ']' in " + what).c_str());
      return;
    }
  }

  Entry tensor(std::string name) {
    Entry e;
    e.name = std::move(name);
    const std::string of = " of tensor " + in_quotes(e.name);
    if (peek() != '{') fail("the value" + of + " must be an object");
    ++pos_;
    bool seen[3] = {false, false, false};
    std::vector<std::uint64_t> shape, offsets;
    std::set<std::string> fields;
    ws();
    if (!take('}')) {
      for (;;) {
        ws();
        const std::string key = string_value();
        if (!fields.insert(key).second) fail("the key " + in_quotes(key) + of + " appears twice");
        ws();
        expect(':', "':' after a key");
        ws();
        if (key == "dtype") {
          if (peek() != '"') fail("the dtype" + of + " must be a string");
          const std::string d = string_value();
          e.dtype = dtype_code(d);
          if (e.dtype < 0)
            fail("unknown dtype \"" + d + "\"" + of +
                 " (known: F64, F32, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8, BOOL, "
                 "F8_E4M3, F8_E5M2, F8_E8M0)");
          seen[0] = true;
        } else if (key == "shape") {
          integers(shape, "the shape" + of);
          seen[1] = true;
        } else if (key == "data_offsets") {
          integers(offsets, "the data_offsets" + of);
          if (offsets.size() != 2)
            fail("the data_offsets" + of + " must be [begin, end], not " + shape_text(offsets));
          seen[2] = true;
        } else {
          skip_value(1);
        }
        ws();
        if (take(',')) continue;
        expect('}', ("',' or '}' in tensor " + in_quotes(e.name)).c_str());
        break;
      }
    }
    const char* names[3] = {"dtype", "shape", "data_offsets"};
    for (int k = 0; k < 3; ++k)
      if (!seen[k]) fail("tensor " + in_quotes(e.name) + " has no \"" + names[k] + "\"");
    for (const std::uint64_t d : shape) {
      if (d > static_cast<std::uint64_t>(std::numeric_limits<Index>::max()))
        fail("a dimension" + of + " is too large (" + std::to_string(d) + ")");
      e.shape.push_back(static_cast<Index>(d));
    }
    e.begin = offsets[0];
    e.end = offsets[1];
    return e;
  }

  std::string_view s_;
  const std::string& source_;
  std::size_t pos_ = 0;
};

// The elements of a shape ([] is a scalar: 1), or false when the count overflows 64 bits.
inline bool element_count(const std::vector<Index>& shape, std::uint64_t& count) {
  count = 1;
  for (const Index d : shape) {
    const auto u = static_cast<std::uint64_t>(d);
    if (u != 0 && count > std::numeric_limits<std::uint64_t>::max() / u) return false;
    count *= u;
  }
  return true;
}

// Every entry's size matches its dtype and shape, lies inside the data buffer of `data_bytes`,
// and the entries tile the buffer: sorted by offset each begins where the one before ends (no
// overlap, no hole) and the last ends at the buffer's end, as the reference requires.
inline void check_layout(const std::vector<Entry>& tensors, std::uint64_t data_bytes,
                         const std::string& source) {
  const auto where = [](const Entry& e) {
    return "tensor " + in_quotes(e.name) + " (data_offsets [" + std::to_string(e.begin) + ", " +
           std::to_string(e.end) + "])";
  };
  for (const Entry& e : tensors) {
    if (e.end < e.begin) fail_file(source, where(e) + " ends before it begins");
    std::uint64_t count = 0;
    const std::uint64_t width = dtype_row(e.dtype).bytes;
    if (!element_count(e.shape, count) || count > std::numeric_limits<std::uint64_t>::max() / width)
      fail_file(source, where(e) + ": shape " + shape_text(e.shape) + " is too large");
    if (e.end - e.begin != count * width)
      fail_file(source, where(e) + " holds " + std::to_string(e.end - e.begin) +
                            " bytes but its shape " + shape_text(e.shape) + " of " +
                            dtype_row(e.dtype).name + " needs " + std::to_string(count * width));
    if (e.end > data_bytes)
      fail_file(source, where(e) + " ends past the data buffer of " + std::to_string(data_bytes) +
                            " bytes (the file is truncated or the offsets are wrong)");
  }
  std::vector<std::size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const Entry &x = tensors[a], &y = tensors[b];
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  std::uint64_t cursor = 0;
  const Entry* previous = nullptr;
  for (const std::size_t i : order) {
    const Entry& e = tensors[i];
    if (e.begin < cursor) fail_file(source, where(e) + " overlaps " + where(*previous));
    if (e.begin > cursor)
      fail_file(source, "the data buffer has a hole: bytes [" + std::to_string(cursor) + ", " +
                            std::to_string(e.begin) + ") belong to no tensor (before " + where(e) +
                            ")");
    cursor = e.end;
    previous = &e;
  }
  if (cursor != data_bytes)
    fail_file(source, "the data buffer has a hole: its last " +
                          std::to_string(data_bytes - cursor) + " bytes (from offset " +
                          std::to_string(cursor) + ") belong to no tensor");
}

// Little-endian loads and stores, the same on every host.
inline std::uint64_t load_le(const unsigned char* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= std::uint64_t(p[i]) << (8 * i);
  return v;
}
inline void store_le(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((v >> (8 * i)) & 0xFF);
}

template <class To, class From>
To bits_as(const From& from) {
  static_assert(sizeof(To) == sizeof(From) && std::is_trivially_copyable_v<From> &&
                    std::is_trivially_copyable_v<To>,
                "linattn: bits_as reinterprets objects of one size");
  To to;
  std::memcpy(static_cast<void*>(&to), static_cast<const void*>(&from), sizeof to);
  return to;
}

// The scalar types a tensor is read into or written from.
template <class Scalar>
constexpr bool is_io_scalar_v =
    std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double> ||
    std::is_same_v<Scalar, Eigen::bfloat16> || std::is_same_v<Scalar, Eigen::half>;

// The dtype code written for a scalar type.
template <class Scalar>
constexpr int dtype_of() {
  static_assert(is_io_scalar_v<Scalar>,
                "linattn: safetensors tensors are float, double, Eigen::bfloat16 or Eigen::half");
  if constexpr (std::is_same_v<Scalar, double>) return kF64;
  if constexpr (std::is_same_v<Scalar, float>) return kF32;
  if constexpr (std::is_same_v<Scalar, Eigen::half>) return kF16;
  return kBF16;
}

// Converts a value of one floating type to Scalar; the same type gives the same bits, a wider
// source rounds to nearest even (double to bf16 or half through float, as Eigen converts).
template <class Scalar, class From>
Scalar convert(From x) {
  if constexpr (std::is_same_v<Scalar, From>)
    return x;
  else if constexpr (is_low_precision_v<From>)
    return static_cast<Scalar>(static_cast<float>(x));
  else
    return static_cast<Scalar>(x);
}

// Decodes the n little-endian elements of a floating dtype at src, calling sink(i, value).
template <class Scalar, class Sink>
void decode(int dtype, const unsigned char* src, Index n, Sink&& sink) {
  static_assert(is_io_scalar_v<Scalar>,
                "linattn: safetensors tensors are read into float, double, Eigen::bfloat16 or "
                "Eigen::half");
  const auto run = [&](int width, auto from_bits) {
    for (Index i = 0; i < n; ++i)
      sink(i, convert<Scalar>(from_bits(load_le(src + i * width, width))));
  };
  switch (dtype) {
    case kF64:
      run(8, [](std::uint64_t b) { return bits_as<double>(b); });
      break;
    case kF32:
      run(4, [](std::uint64_t b) { return bits_as<float>(static_cast<std::uint32_t>(b)); });
      break;
    case kF16:
      run(2, [](std::uint64_t b) { return bits_as<Eigen::half>(static_cast<std::uint16_t>(b)); });
      break;
    default:  // kBF16: the checks of the callers leave no other
      run(2,
          [](std::uint64_t b) { return bits_as<Eigen::bfloat16>(static_cast<std::uint16_t>(b)); });
  }
}

// Appends the n elements of data, little-endian in the dtype of Scalar.
template <class Scalar>
void encode(const Scalar* data, Index n, std::string& out) {
  out.reserve(out.size() + static_cast<std::size_t>(n) * sizeof(Scalar));
  for (Index i = 0; i < n; ++i) {
    if constexpr (sizeof(Scalar) == 8)
      store_le(out, bits_as<std::uint64_t>(data[i]), 8);
    else if constexpr (sizeof(Scalar) == 4)
      store_le(out, bits_as<std::uint32_t>(data[i]), 4);
    else
      store_le(out, bits_as<std::uint16_t>(data[i]), 2);
  }
}

// A JSON string literal of s (valid UTF-8): quotes, backslashes and control characters escaped.
inline void append_json_string(std::string& out, std::string_view s) {
  static constexpr char hex[] = "0123456789abcdef";
  out += '"';
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20) {
      out += "\\u00";
      out += hex[u >> 4];
      out += hex[u & 0xF];
    } else {
      out += c;
    }
  }
  out += '"';
}

// ---- SafetensorsFile ------------------------------------------------------------------------

// The whole file at `path`.
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) fail_file(path, "cannot be opened for reading");
  const std::streamoff size = in.tellg();
  if (size < 0) fail_file(path, "cannot tell the file's size");
  std::string bytes(static_cast<std::size_t>(size), '\0');
  in.seekg(0);
  if (size > 0 && !in.read(bytes.data(), size))
    fail_file(path, "read failed after " + std::to_string(in.gcount()) + " of " +
                        std::to_string(size) + " bytes");
  return bytes;
}

// The header of a whole file, every rule checked; `data_start` is where the data buffer begins.
inline Header parse_file(const std::string& bytes, const std::string& source,
                         std::size_t& data_start) {
  if (bytes.size() < 8)
    fail_file(source, "truncated: " + std::to_string(bytes.size()) +
                          " bytes, fewer than the 8 of the header size");
  const std::uint64_t n = load_le(reinterpret_cast<const unsigned char*>(bytes.data()), 8);
  if (n > kMaxHeaderBytes)
    fail_file(source, "header size " + std::to_string(n) + " is above the limit of " +
                          std::to_string(kMaxHeaderBytes) + " bytes");
  if (n > bytes.size() - 8)
    fail_file(source, "header size " + std::to_string(n) + " is larger than the " +
                          std::to_string(bytes.size() - 8) + " bytes after it");
  data_start = 8 + static_cast<std::size_t>(n);
  Header h = HeaderParser(std::string_view(bytes).substr(8, n), source).parse();
  check_layout(h.tensors, bytes.size() - data_start, source);
  return h;
}

[[noreturn]] inline void fail_request(const char* fn, const std::string& source,
                                      const std::string& name, const std::string& what) {
  throw_invalid(fn, source + ": tensor " + in_quotes(name) + " " + what);
}

inline const std::vector<Index>& nonnegative(const char* fn, const std::string& source,
                                             const std::vector<Index>& shape) {
  for (const Index d : shape)
    if (d < 0)
      throw_invalid(
          fn, source + ": the expected shape " + shape_text(shape) + " has a negative dimension");
  return shape;
}

// A typed read of a tensor of `actual` shape and `dtype` as `expected`.
inline void check_request(const char* fn, const std::string& source, const std::string& name,
                          const std::vector<Index>& actual, int dtype,
                          const std::vector<Index>& expected) {
  if (actual != nonnegative(fn, source, expected))
    fail_request(fn, source, name,
                 "has shape " + shape_text(actual) + ", expected " + shape_text(expected));
  if (!dtype_row(dtype).floating)
    fail_request(fn, source, name,
                 std::string("is ") + dtype_row(dtype).name +
                     ", not a floating dtype that converts (F64, F32, F16, BF16)");
}

// ---- SafetensorsWriter ----------------------------------------------------------------------

struct Pending {
  std::string name;
  int dtype;
  std::vector<Index> shape;
  std::string data;  // little-endian, row-major
};

// The header is read back as UTF-8: names and metadata must be.
inline void check_text(const char* fn, const char* what, const std::string& s) {
  if (invalid_utf8_at(s) != std::string_view::npos)
    throw_invalid(fn, std::string(what) + " " + in_quotes(s) + " is not valid UTF-8");
}

// The element count of a tensor that may join `tensors`.
inline std::uint64_t check_new(const char* fn, const std::vector<Pending>& tensors,
                               const std::string& name, const std::vector<Index>& shape,
                               bool null_data) {
  check_text(fn, "tensor name", name);
  if (name == "__metadata__")
    throw_invalid(fn, "\"__metadata__\" is the header's metadata key, not a tensor name");
  for (const Pending& p : tensors)
    if (p.name == name) throw_invalid(fn, "tensor " + in_quotes(name) + " was already added");
  std::uint64_t count = 0;
  const bool negative = std::any_of(shape.begin(), shape.end(), [](Index d) { return d < 0; });
  if (negative || !element_count(shape, count) ||
      count > static_cast<std::uint64_t>(std::numeric_limits<Index>::max() / 8))
    throw_invalid(fn, "tensor " + in_quotes(name) + ": invalid shape " + shape_text(shape));
  if (count > 0 && null_data) throw_invalid(fn, "tensor " + in_quotes(name) + ": data is null");
  return count;
}

// The file: the header sorted by name (metadata first), padded with spaces to a multiple of 8;
// the data by element size, largest first, then by name, so each tensor is aligned to its own.
inline std::string assemble(const std::vector<Pending>& tensors,
                            const std::map<std::string, std::string>& metadata) {
  std::vector<const Pending*> by_name, by_layout;
  for (const Pending& p : tensors) by_name.push_back(&p);
  std::sort(by_name.begin(), by_name.end(),
            [](const Pending* a, const Pending* b) { return a->name < b->name; });
  by_layout = by_name;
  std::stable_sort(by_layout.begin(), by_layout.end(), [](const Pending* a, const Pending* b) {
    return dtype_row(a->dtype).bytes > dtype_row(b->dtype).bytes;
  });
  std::map<const Pending*, std::uint64_t> offset;
  std::uint64_t at = 0;
  for (const Pending* p : by_layout) {
    offset[p] = at;
    at += p->data.size();
  }
  std::string json = "{";
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    for (const auto& [k, v] : metadata) {
      if (json.back() != '{') json += ',';
      append_json_string(json, k);
      json += ':';
      append_json_string(json, v);
    }
    json += '}';
  }
  for (const Pending* p : by_name) {
    if (json.size() > 1) json += ',';
    append_json_string(json, p->name);
    json += ":{\"dtype\":\"" + std::string(dtype_row(p->dtype).name) +
            "\",\"shape\":" + shape_text(p->shape) + ",\"data_offsets\":[" +
            std::to_string(offset[p]) + "," + std::to_string(offset[p] + p->data.size()) + "]}";
  }
  json += '}';
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out;
  out.reserve(8 + json.size() + static_cast<std::size_t>(at));
  store_le(out, json.size(), 8);
  out += json;
  for (const Pending* p : by_layout) out += p->data;
  return out;
}

inline void write_file(const std::string& path, const std::string& bytes) {
  const std::string fn = "linattn::SafetensorsWriter::write: " + path;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) raise<std::runtime_error>(fn + ": cannot be opened for writing");
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.flush();
  if (!out) raise<std::runtime_error>(fn + ": writing failed");
}

}  // namespace linattn::detail::st
