/// \file serving/safetensors.hpp
/// \brief Weights files in the safetensors format (the checkpoints of Hugging Face
/// transformers): SafetensorsFile reads one and hands out its tensors by name, converted to
/// float or double; SafetensorsWriter writes one. The format's rules as linattn implements
/// them are in docs/SPEC.md §8, "Weights files (safetensors)".
///
/// A file is an 8-byte little-endian header size N, N bytes of JSON (an object mapping each
/// tensor's name to its dtype, shape and byte range, plus optional string metadata under
/// `"__metadata__"`), then the data buffer: every tensor row-major (C order) and little-endian.
///
/// Errors: a file that cannot be read or breaks a rule of the format throws
/// std::runtime_error (as a state file that does not load, state_io.hpp), naming the file and
/// the problem; a request the file cannot satisfy (a missing tensor, another shape, an integer
/// dtype read as floating point) and a bad argument of the writer throw std::invalid_argument.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../core/common.hpp"
#include "../core/detail/checks.hpp"
#include "../core/error.hpp"
#include "detail/safetensors_format.hpp"

namespace linattn {

/// The element types of a safetensors tensor. F64, F32, F16 and BF16 convert to float and
/// double (SafetensorsFile::read()); the others are known, so that a file holding them loads,
/// but are read only as bytes (SafetensorsFile::raw()).
enum class TensorDtype : int {
  F64 = detail::st::kF64,         ///< IEEE binary64.
  F32 = detail::st::kF32,         ///< IEEE binary32.
  F16 = detail::st::kF16,         ///< IEEE binary16 (Eigen::half).
  BF16 = detail::st::kBF16,       ///< bfloat16 (Eigen::bfloat16).
  I64 = detail::st::kI64,         ///< signed 64-bit integer.
  I32 = detail::st::kI32,         ///< signed 32-bit integer.
  I16 = detail::st::kI16,         ///< signed 16-bit integer.
  I8 = detail::st::kI8,           ///< signed 8-bit integer.
  U64 = detail::st::kU64,         ///< unsigned 64-bit integer.
  U32 = detail::st::kU32,         ///< unsigned 32-bit integer.
  U16 = detail::st::kU16,         ///< unsigned 16-bit integer.
  U8 = detail::st::kU8,           ///< unsigned 8-bit integer.
  BOOL = detail::st::kBool,       ///< one byte, 0 or 1.
  F8_E4M3 = detail::st::kF8E4M3,  ///< 8-bit float, 4 exponent bits (not converted).
  F8_E5M2 = detail::st::kF8E5M2,  ///< 8-bit float, 5 exponent bits (not converted).
  F8_E8M0 = detail::st::kF8E8M0   ///< 8-bit power-of-two scale (not converted).
};

/// The dtype's name as the header spells it.
/// \code
/// std::puts(linattn::dtype_name(file.info("lm_head.weight").dtype));  // "BF16"
/// \endcode
/// \param dtype the element type.
/// \return "F64", "F32", "BF16", ..., a static string.
inline const char* dtype_name(TensorDtype dtype) noexcept {
  return detail::st::dtype_row(static_cast<int>(dtype)).name;
}

/// The bytes of one element of the dtype.
/// \param dtype the element type.
/// \return 8, 4, 2 or 1.
inline std::size_t dtype_size(TensorDtype dtype) noexcept {
  return static_cast<std::size_t>(detail::st::dtype_row(static_cast<int>(dtype)).bytes);
}

/// One tensor of a safetensors file, as its header describes it.
struct TensorInfo {
  std::string name;          ///< the tensor's name ("model.layers.0.attn.q_proj.weight").
  TensorDtype dtype{};       ///< its element type.
  std::vector<Index> shape;  ///< its dimensions, outermost first ({} for a scalar).
  std::uint64_t begin = 0;   ///< first byte in the data buffer (after the header).
  std::uint64_t end = 0;     ///< one past its last byte in the data buffer.
  /// The number of elements: the product of the shape (1 for shape {}, 0 if a dimension is 0).
  /// \return the element count.
  Index size() const noexcept {
    Index n = 1;
    for (const Index d : shape) n *= d;
    return n;
  }
};

/// \brief A safetensors file read into memory, every rule of the format checked on opening:
/// the header size (at most 100 MB and within the file), well-formed UTF-8 JSON without
/// duplicate keys, known dtypes, each tensor's byte range of exactly its shape's size, inside
/// the data buffer, and the tensors tiling the buffer with no overlap and no hole.
///
/// Tensors are read by name into float or double (also Eigen::bfloat16 / Eigen::half) from
/// any floating dtype: F32 and F64 into their own type and F16 / BF16 into anything keep
/// every bit; a narrower target rounds to nearest even (F64 into bf16 or half through float).
/// NaN and infinities are values like any other. The object is immutable after construction,
/// so concurrent reads are safe.
/// \code
/// linattn::SafetensorsFile file("model.safetensors");
/// Eigen::MatrixXf Wq = file.matrix<float>("model.layers.0.attn.q_proj.weight", 512, 512);
/// Eigen::VectorXf g = file.vector<float>("model.layers.0.attn.g_norm.weight", 64);
/// Eigen::MatrixXf conv(1024, 4);  // torch Conv1d weight [C, 1, W] read as C x W
/// file.read("model.layers.0.attn.q_conv1d.weight", {1024, 1, 4}, conv);
/// \endcode
class SafetensorsFile {
  static_assert(static_cast<int>(TensorDtype::F8_E8M0) == detail::st::kDtypeCount - 1,
                "linattn: TensorDtype must list the dtype table");

 public:
  /// Reads the file at `path` (the whole of it) and checks its header and layout.
  /// \throws std::runtime_error `"linattn::SafetensorsFile: <path>: ..."` if the file cannot
  /// be opened or read, or breaks a rule of the format (named in the message).
  /// \param path the file's path.
  explicit SafetensorsFile(const std::string& path)
      : source_(path), bytes_(detail::st::read_file(path)) {
    parse();
  }

  /// A file held in memory (a download, a test): the same checks as the path constructor.
  /// \code
  /// auto file = linattn::SafetensorsFile::from_bytes(writer.bytes());
  /// \endcode
  /// \throws std::runtime_error `"linattn::SafetensorsFile: <source>: ..."` as the path
  /// constructor.
  /// \param bytes the whole file.
  /// \param source the name messages give the file.
  /// \return the file.
  static SafetensorsFile from_bytes(std::string bytes, std::string source = "<memory>") {
    SafetensorsFile f;
    f.source_ = std::move(source);
    f.bytes_ = std::move(bytes);
    f.parse();
    return f;
  }

  /// \return the path, or the source name given to from_bytes().
  const std::string& source() const noexcept { return source_; }

  /// \return every tensor's name, sorted (byte-wise), whatever the header's order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    out.reserve(tensors_.size());
    for (const TensorInfo& t : tensors_) out.push_back(t.name);
    return out;
  }

  /// \return every tensor's description, sorted by name.
  const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }

  /// \param name a tensor's name.
  /// \return true if the file holds a tensor of that name.
  bool contains(const std::string& name) const { return find(name) != nullptr; }

  /// The description of one tensor.
  /// \throws std::invalid_argument naming the file and the tensor if it is not in the file.
  /// \param name the tensor's name.
  /// \return its dtype, shape and byte range.
  const TensorInfo& info(const std::string& name) const {
    return get("SafetensorsFile::info", name);
  }

  /// \return the header's `"__metadata__"` (string to string; empty if absent), e.g.
  /// {"format": "pt"}.
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }

  /// The stored bytes of a tensor of any dtype (little-endian, row-major), for the dtypes
  /// read() does not convert.
  /// \throws std::invalid_argument if the tensor is not in the file.
  /// \param name the tensor's name.
  /// \return a view of `end - begin` bytes, valid while the file object lives.
  std::string_view raw(const std::string& name) const {
    const TensorInfo& t = get("SafetensorsFile::raw", name);
    return std::string_view(bytes_).substr(data_start_ + t.begin, t.end - t.begin);
  }

  /// \brief Reads a floating-point tensor of exactly `shape` into `out`, its elements in
  /// row-major (C) order.
  /// \tparam Scalar float, double, Eigen::bfloat16 or Eigen::half.
  /// \throws std::invalid_argument naming the function, the file and the tensor if it is not
  /// in the file, has another shape (both shapes named) or a dtype that is not F64, F32, F16
  /// or BF16 (named); `out` is then unchanged.
  /// \code
  /// std::vector<float> w(3 * 64);
  /// file.read("embed.weight", {3, 64}, w.data());
  /// \endcode
  /// \param name the tensor's name.
  /// \param shape the shape the caller expects, outermost first.
  /// \param out room for the product of `shape` elements.
  template <class Scalar>
  void read(const std::string& name, const std::vector<Index>& shape, Scalar* out) const {
    const TensorInfo& t = checked("SafetensorsFile::read", name, shape);
    detail::st::decode<Scalar>(static_cast<int>(t.dtype), data(t), t.size(),
                               [out](Index i, Scalar v) { out[i] = v; });
  }

  /// \brief Reads a floating-point tensor of exactly `shape` into a matrix (or a Map, Block or
  /// Ref) of as many elements, filling it row by row: shape {C, 1, W} into a C x W matrix.
  /// \tparam Derived a writable Eigen expression of float, double, bf16 or half.
  /// \throws std::invalid_argument as read(name, shape, out), and if `out` does not have the
  /// product of `shape` elements.
  /// \param name the tensor's name.
  /// \param shape the shape the caller expects, outermost first.
  /// \param out the destination; element k of the tensor goes to row k / cols, column k % cols.
  template <class Derived>
  void read(const std::string& name, const std::vector<Index>& shape,
            const Eigen::MatrixBase<Derived>& out) const {
    constexpr const char* fn = "SafetensorsFile::read";
    using Scalar = typename Derived::Scalar;
    const TensorInfo& t = checked(fn, name, shape);
    std::uint64_t count = 0;
    if (!detail::st::element_count(shape, count) ||
        count != static_cast<std::uint64_t>(out.rows() * out.cols()))
      detail::throw_invalid(fn, source_ + ": tensor " + detail::st::in_quotes(name) + ": shape " +
                                    detail::st::shape_text(shape) + " does not fill the " +
                                    detail::shape_of(out) + " output");
    Derived& o = detail::writable(out);
    const Index cols = o.cols();
    detail::st::decode<Scalar>(static_cast<int>(t.dtype), data(t), t.size(),
                               [&o, cols](Index k, Scalar v) { o(k / cols, k % cols) = v; });
  }

  /// Reads a tensor of shape {rows, cols} into `out` (rows x cols); an Eigen vector type
  /// takes a 1-d tensor of its size as well.
  /// \throws std::invalid_argument as read(name, shape, out).
  /// \param name the tensor's name.
  /// \param out the destination, of the tensor's shape.
  template <class Derived>
  void read(const std::string& name, const Eigen::MatrixBase<Derived>& out) const {
    if (Derived::IsVectorAtCompileTime && find(name) && find(name)->shape.size() == 1)
      read(name, {out.size()}, out);
    else
      read(name, {out.rows(), out.cols()}, out);
  }

  /// A 1-d tensor of `n` elements as a vector.
  /// \tparam Scalar float, double, Eigen::bfloat16 or Eigen::half.
  /// \throws std::invalid_argument as read(name, shape, out), the expected shape being {n}.
  /// \param name the tensor's name.
  /// \param n its length.
  /// \return the values.
  template <class Scalar>
  Vector<Scalar> vector(const std::string& name, Index n) const {
    const TensorInfo& t = checked("SafetensorsFile::vector", name, {n});
    Vector<Scalar> v(n);
    read(t.name, {n}, v.data());
    return v;
  }

  /// A 2-d tensor of shape {rows, cols} (a torch Linear weight is [out_features,
  /// in_features]) as a (column-major) matrix with the same (i, j) entries.
  /// \tparam Scalar float, double, Eigen::bfloat16 or Eigen::half.
  /// \throws std::invalid_argument as read(name, shape, out), the expected shape being
  /// {rows, cols}.
  /// \param name the tensor's name.
  /// \param rows its first dimension.
  /// \param cols its second dimension.
  /// \return the values.
  template <class Scalar>
  Matrix<Scalar> matrix(const std::string& name, Index rows, Index cols) const {
    checked("SafetensorsFile::matrix", name, {rows, cols});
    Matrix<Scalar> m(rows, cols);
    read(name, {rows, cols}, m);
    return m;
  }

 private:
  SafetensorsFile() = default;

  void parse() {
    detail::st::Header h = detail::st::parse_file(bytes_, source_, data_start_);
    metadata_ = std::move(h.metadata);
    for (detail::st::Entry& e : h.tensors)
      tensors_.push_back({std::move(e.name), static_cast<TensorDtype>(e.dtype), std::move(e.shape),
                          e.begin, e.end});
    std::sort(tensors_.begin(), tensors_.end(),
              [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  }

  const TensorInfo* find(const std::string& name) const {
    const auto it =
        std::lower_bound(tensors_.begin(), tensors_.end(), name,
                         [](const TensorInfo& t, const std::string& key) { return t.name < key; });
    return it != tensors_.end() && it->name == name ? &*it : nullptr;
  }

  const TensorInfo& get(const char* fn, const std::string& name) const {
    const TensorInfo* t = find(name);
    if (!t) detail::st::fail_request(fn, source_, name, "is not in the file");
    return *t;
  }

  // The tensor, checked to have `shape` and a dtype the reads convert.
  const TensorInfo& checked(const char* fn, const std::string& name,
                            const std::vector<Index>& shape) const {
    const TensorInfo& t = get(fn, name);
    detail::st::check_request(fn, source_, name, t.shape, static_cast<int>(t.dtype), shape);
    return t;
  }

  const unsigned char* data(const TensorInfo& t) const {
    return reinterpret_cast<const unsigned char*>(bytes_.data()) + data_start_ + t.begin;
  }

  std::string source_, bytes_;
  std::size_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

/// \brief Builds a safetensors file: tensors added by name (float as F32, double as F64,
/// Eigen::half as F16, Eigen::bfloat16 as BF16) and string metadata, written by write() or
/// returned by bytes().
///
/// The header lists the tensors sorted by name, after `"__metadata__"` (written only if
/// there is metadata), and is padded with spaces so that the data buffer starts at a multiple
/// of 8 bytes; the data holds the tensors by element size (8, 4, then 2 bytes) and then by
/// name, so that every tensor is aligned to its element size. Adding copies the data.
/// \code
/// linattn::SafetensorsWriter w;
/// w.add("q_proj.weight", Wq)  // a 512 x 512 matrix: shape [512, 512], row-major
///     .add("norm.weight", g)  // a vector: shape [64]
///     .set_metadata("format", "pt");
/// w.write("layer.safetensors");
/// \endcode
class SafetensorsWriter {
 public:
  /// Adds a matrix as a tensor of shape {rows, cols} (an Eigen vector type: {size}), its
  /// elements in row-major order whatever the expression's storage order.
  /// \throws std::invalid_argument if the name is taken, is `"__metadata__"` or not UTF-8.
  /// \param name the tensor's name.
  /// \param m a matrix, vector or expression of float, double, bf16 or half.
  /// \return this writer.
  template <class Derived>
  SafetensorsWriter& add(const std::string& name, const Eigen::MatrixBase<Derived>& m) {
    using Scalar = typename Derived::Scalar;
    const Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> rm = m;
    if (Derived::IsVectorAtCompileTime) return add(name, {rm.size()}, rm.data());
    return add(name, {rm.rows(), rm.cols()}, rm.data());
  }

  /// Adds `shape`'s product of elements of `data`, in row-major order.
  /// \tparam Scalar float, double, Eigen::bfloat16 or Eigen::half.
  /// \throws std::invalid_argument if the name is taken, is `"__metadata__"` or not UTF-8, or
  /// a dimension is negative, or data is null for a non-empty tensor.
  /// \param name the tensor's name.
  /// \param shape its dimensions, outermost first ({} for a scalar).
  /// \param data its elements.
  /// \return this writer.
  template <class Scalar>
  SafetensorsWriter& add(const std::string& name, const std::vector<Index>& shape,
                         const Scalar* data) {
    const std::uint64_t count =
        detail::st::check_new("SafetensorsWriter::add", tensors_, name, shape, data == nullptr);
    detail::st::Pending p{name, detail::st::dtype_of<Scalar>(), shape, {}};
    detail::st::encode(data, static_cast<Index>(count), p.data);
    tensors_.push_back(std::move(p));
    return *this;
  }

  /// Sets a `"__metadata__"` entry (replacing one of the same key).
  /// \throws std::invalid_argument if key or value is not UTF-8.
  /// \param key the entry's key ("format").
  /// \param value its value ("pt").
  /// \return this writer.
  SafetensorsWriter& set_metadata(const std::string& key, const std::string& value) {
    detail::st::check_text("SafetensorsWriter::set_metadata", "metadata key", key);
    detail::st::check_text("SafetensorsWriter::set_metadata", "metadata value", value);
    metadata_[key] = value;
    return *this;
  }

  /// \return the number of tensors added.
  std::size_t size() const noexcept { return tensors_.size(); }

  /// \return the whole file.
  std::string bytes() const { return detail::st::assemble(tensors_, metadata_); }

  /// Writes the file (bytes()) to `path`, replacing it.
  /// \throws std::runtime_error `"linattn::SafetensorsWriter::write: <path>: ..."` if the
  /// file cannot be opened or a write fails.
  /// \param path the file's path.
  void write(const std::string& path) const { detail::st::write_file(path, bytes()); }

 private:
  std::vector<detail::st::Pending> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace linattn
