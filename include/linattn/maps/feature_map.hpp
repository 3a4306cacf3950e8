/// \file maps/feature_map.hpp
/// \brief The FeatureMap concept: what a type must provide to plug into every kernel.
///
/// A feature map \f$\varphi : \mathbb{R}^D \to \mathbb{R}^F\f$ turns the similarity of
/// linear attention into a dot product, \f$\mathrm{sim}(q, k) = \varphi(q)^\top \varphi(k)\f$.
/// It is a small value type (it may hold parameters, such as a projection matrix) with:
///
/// - **required** `Eigen::Index feature_dim(Eigen::Index D) const` — F for inputs of dimension D.
/// - **required** a row-wise map, applied to queries and keys alike:
///   \code
///   template <class Derived>
///   void map(const Eigen::MatrixBase<Derived>& x,                  // n x D, any layout
///            linattn::MatrixRef<typename Derived::Scalar> phi) const;  // n x F, to fill
///   \endcode
///   Row i of `phi` must depend on row i of `x` only. Kernels call it on blocks of rows, so
///   it must not allocate if the caller wants allocation-free kernels.
/// - *optional* `backward(x, grad_phi, grad_x)`: the vector–Jacobian product
///   \f$\nabla_x = J_\varphi(x)^\top \nabla_\varphi\f$ row by row (same shapes as `map`;
///   `grad_x` is a MatrixRef), used by the gradients. Detected with has_backward_v.
/// - *optional* `static constexpr bool normalizes_keys_per_feature = true`: declares the
///   SoftmaxSplit semantics, where the key side is a softmax of each feature over the attended
///   keys (§2 of the spec). The kernels then use the per-feature normalised algorithms; `map`
///   is the query side. The key features are then the D columns of K themselves, so such a
///   map must have `feature_dim(D) == D`: every entry point that takes a map checks it and
///   throws std::invalid_argument otherwise.
/// - *optional* `static constexpr bool nonnegative_features = true`: promises that every
///   feature is >= 0 (as for EluPlusOne), so that denominators are sums of non-negative terms
///   and cannot cancel. Without it the kernels also treat a denominator that is only rounding
///   noise against the magnitude of its terms as 0 (the row is then 0; docs/SPEC.md §2), an
///   O(F) test per row.
/// - *optional* `static constexpr bool elementwise = true`: promises that `map` applies one
///   scalar function to every entry (F = D; no entry depends on another, its row or its
///   position), so that `map` works on a matrix of any shape. The kernels then map row-major
///   inputs (token-major memory, as frameworks hold activations) straight into the token-major
///   buffers they compute with, `phi.map(x.transpose(), buffer)`, instead of transposing the
///   input in and the features back out.
///
/// - *optional* side-aware overloads, for maps whose features are best formed with a shift that
///   cancels only in the product of a query side and a key side (Favor):
///   \code
///   void map(x, phi, linattn::QuerySide side) const;
///   void map(x, phi, linattn::KeySide side) const;
///   void backward(x, grad_phi, grad_x, linattn::QuerySide side) const;  // and KeySide
///   \endcode
///   Every kernel maps queries with the query side and keys with the key side, and tells the
///   map whether it divides each output row by its denominator \f$\varphi(q)^\top z\f$
///   (`side.normalized`: the linear, causal, multi-head, masked and batched kernels, the decode
///   classes, the gated kernels with `GatedOptions::normalize`) or not (the unnormalised gated
///   kernels, the delta rule). The contract, with \f$\varphi\f$ the plain `map`: for
///   normalised sides \f$\varphi_Q(q)^\top \varphi_K(k) = c(q)\, \varphi(q)^\top\varphi(k)\f$
///   with \f$c(q) > 0\f$ depending on the query row only (it cancels in the division); for
///   unnormalised sides the product must equal \f$\varphi(q)^\top\varphi(k)\f$ exactly. A
///   key side must not depend on anything but its own row (states built by one call are
///   continued by another, saved, combined). `backward` of a side is that side's
///   vector–Jacobian product. Without the overloads the plain `map` / `backward` serve both
///   sides. Detected with has_sided_map_v; an elementwise map with sides loses the token-major
///   fast path (its sides need not be elementwise).
///
/// The key side of a map is chosen by one rule (detail::map_keys, the only place that applies
/// it): the per-feature softmax over the attended keys if `normalizes_keys_per_feature` is set
/// (computed by the kernels' own per-feature algorithms: map_keys rejects such a map at compile
/// time), else `map(x, phi, KeySide)` if provided, else `map(x, phi)`. The query side:
/// `map(x, phi, QuerySide)` if provided, else `map(x, phi)`.
///
/// A user map is checked at compile time by every kernel with a readable message:
/// \code
/// struct Squared {  // φ(x) = x², entry by entry
///   Eigen::Index feature_dim(Eigen::Index d) const { return d; }
///   template <class Derived>
///   void map(const Eigen::MatrixBase<Derived>& x,
///            linattn::MatrixRef<typename Derived::Scalar> phi) const {
///     phi = x.cwiseAbs2();
///   }
/// };
/// auto out = linattn::linear_attention(Q, K, V, Squared{});
/// \endcode
///
/// How the kernels call a map: every entry point hands its kernels the map behind a table of
/// function pointers (detail::ErasedMap, detail/erased_map.hpp), one indirect call per block of
/// rows. The kernels are then compiled once per kind of map (a product map, or one with
/// `normalizes_keys_per_feature`), not once per map a program uses, and a map's `map` and
/// `backward` are compiled for two input types: column- and row-major memory with an outer
/// stride (`Eigen::Map<const Eigen::Matrix<...>, 0, Eigen::OuterStride<>>`). A map must
/// therefore accept any `MatrixBase` input, as the concept says, and not rely on one type.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../core/detail/blocking.hpp"
#include "../core/detail/low_precision.hpp"
#include "../core/tuning.hpp"

namespace linattn {
namespace detail {

template <class Phi, class Scalar, class = void>
struct has_feature_dim : std::false_type {};
template <class Phi, class Scalar>
struct has_feature_dim<
    Phi, Scalar,
    std::enable_if_t<std::is_convertible_v<
        decltype(std::declval<const Phi&>().feature_dim(std::declval<Index>())), Index>>>
    : std::true_type {};

template <class Phi, class Scalar, class = void>
struct has_map : std::false_type {};
template <class Phi, class Scalar>
struct has_map<Phi, Scalar,
               std::void_t<decltype(std::declval<const Phi&>().map(
                   std::declval<const Matrix<Scalar>&>(), std::declval<MatrixRef<Scalar>>()))>>
    : std::true_type {};

template <class Phi, class Scalar, class = void>
struct has_backward : std::false_type {};
template <class Phi, class Scalar>
struct has_backward<Phi, Scalar,
                    std::void_t<decltype(std::declval<const Phi&>().backward(
                        std::declval<const Matrix<Scalar>&>(), std::declval<const Matrix<Scalar>&>(),
                        std::declval<MatrixRef<Scalar>>()))>> : std::true_type {};

// map(x, phi, side) / backward(x, grad_phi, grad_x, side) for Side = QuerySide or KeySide.
template <class Phi, class Scalar, class Side, class = void>
struct has_side_map : std::false_type {};
template <class Phi, class Scalar, class Side>
struct has_side_map<Phi, Scalar, Side,
                    std::void_t<decltype(std::declval<const Phi&>().map(
                        std::declval<const Matrix<Scalar>&>(), std::declval<MatrixRef<Scalar>>(),
                        std::declval<Side>()))>> : std::true_type {};

template <class Phi, class Scalar, class Side, class = void>
struct has_side_backward : std::false_type {};
template <class Phi, class Scalar, class Side>
struct has_side_backward<
    Phi, Scalar, Side,
    std::void_t<decltype(std::declval<const Phi&>().backward(
        std::declval<const Matrix<Scalar>&>(), std::declval<const Matrix<Scalar>&>(),
        std::declval<MatrixRef<Scalar>>(), std::declval<Side>()))>> : std::true_type {};

template <class Phi, class = void>
struct per_feature_flag : std::false_type {};
template <class Phi>
struct per_feature_flag<Phi, std::void_t<decltype(Phi::normalizes_keys_per_feature)>>
    : std::bool_constant<Phi::normalizes_keys_per_feature> {};

}  // namespace detail

/// True when Phi models the FeatureMap concept for the given scalar type.
template <class Phi, class Scalar>
inline constexpr bool is_feature_map_v =
    detail::has_feature_dim<Phi, Scalar>::value && detail::has_map<Phi, Scalar>::value;

/// True when Phi provides the optional `backward` (vector–Jacobian product).
template <class Phi, class Scalar>
inline constexpr bool has_backward_v = detail::has_backward<Phi, Scalar>::value;

/// The query side of a kernel's call to a side-aware map (feature_map.hpp): `normalized` is
/// true when the kernel divides each output row by its denominator φ(q)ᵀz.
struct QuerySide {
  /// True when the kernel divides each output row by its denominator.
  bool normalized;
};

/// The key side of a kernel's call to a side-aware map; `normalized` as for QuerySide.
struct KeySide {
  /// True when the kernel divides each output row by its denominator.
  bool normalized;
};

/// True when Phi provides the optional side-aware `map(x, phi, QuerySide)` and
/// `map(x, phi, KeySide)` (feature_map.hpp).
template <class Phi, class Scalar>
inline constexpr bool has_sided_map_v = detail::has_side_map<Phi, Scalar, QuerySide>::value &&
                                        detail::has_side_map<Phi, Scalar, KeySide>::value;

/// True for maps with SoftmaxSplit semantics (a per-feature softmax over the keys).
template <class Phi>
inline constexpr bool normalizes_keys_per_feature_v = detail::per_feature_flag<Phi>::value;

namespace detail {

// Maps that declare `static constexpr bool nonnegative_features = true` (EluPlusOne) and the
// per-feature key softmax (SoftmaxSplit) have denominators that are sums of non-negative terms,
// computed to a few ulps: they never cancel. Every other map (NormalizedCosine, user maps) may
// have features of both signs, and a denominator that cancels to rounding noise.
template <class Phi, class = void>
struct declares_nonnegative : std::false_type {};
template <class Phi>
struct declares_nonnegative<Phi, std::void_t<decltype(Phi::nonnegative_features)>>
    : std::bool_constant<Phi::nonnegative_features> {};
template <class Phi>
inline constexpr bool may_cancel_v =
    !declares_nonnegative<Phi>::value && !normalizes_keys_per_feature_v<Phi>;

template <class Phi, class = void>
struct declares_elementwise : std::false_type {};
template <class Phi>
struct declares_elementwise<Phi, std::void_t<decltype(Phi::elementwise)>>
    : std::bool_constant<Phi::elementwise> {};

// A map that declares `static constexpr bool derivative_from_features = true` has
// φ'(x) = min(φ(x), 1) (EluPlusOne): its gradients are formed on the features the kernels hold.
template <class Phi, class = void>
struct declares_derivative_from_features : std::false_type {};
template <class Phi>
struct declares_derivative_from_features<Phi, std::void_t<decltype(Phi::derivative_from_features)>>
    : std::bool_constant<Phi::derivative_from_features> {};

template <class Phi, class Scalar>
inline constexpr bool has_any_side_map_v = has_side_map<Phi, Scalar, QuerySide>::value ||
                                           has_side_map<Phi, Scalar, KeySide>::value;

template <class T>
inline constexpr bool dependent_false_v = false;

// The kernels' view of a map (detail/erased_map.hpp): one of two kinds, whose kernels differ
// at compile time: a product map (sim = φ(q)·φ(k)) or a per-feature key softmax.
enum class ErasedKind { product, per_feature };
template <class Scalar, ErasedKind Kind>
class ErasedMap;
template <class Phi>
struct is_erased_map : std::false_type {};
template <class Scalar, ErasedKind Kind>
struct is_erased_map<ErasedMap<Scalar, Kind>> : std::true_type {};

// may_cancel_v of a map, which an erased map knows at run time: whether the kernels test a
// denominator for cancellation (an O(F) test per row, skipped for nonnegative features).
template <class Phi>
bool may_cancel(const Phi& phi) {
  if constexpr (is_erased_map<Phi>::value)
    return phi.may_cancel();
  else
    return (void)phi, may_cancel_v<Phi>;
}

// The side dispatch: every kernel's call of a map on query or key rows goes through map_side
// (or map_queries / map_keys), every call of its backward through backward_side. `out` is
// anything a MatrixRef binds to, as for a plain `map`.
template <class Phi, class X, class Out, class Side>
void map_side(const Phi& phi, const Eigen::MatrixBase<X>& x, Out&& out, Side side) {
  using Scalar = typename X::Scalar;
  if constexpr (std::is_same_v<Side, KeySide>) {
    // The key-side rule of feature_map.hpp: a per-feature key softmax is no row map; the
    // kernels that accept such maps compute it themselves and never map keys through here.
    static_assert(!normalizes_keys_per_feature_v<Phi> || dependent_false_v<Phi>,
                  "linattn: the key side of a map with normalizes_keys_per_feature is the "
                  "per-feature softmax over positions, not a row map");
  }
  if constexpr (has_side_map<Phi, Scalar, Side>::value)
    phi.map(x, out, side);
  else
    phi.map(x, out);
}

template <class Phi, class X, class Out>
void map_queries(const Phi& phi, const Eigen::MatrixBase<X>& x, Out&& out, bool normalized) {
  map_side(phi, x, out, QuerySide{normalized});
}

template <class Phi, class X, class Out>
void map_keys(const Phi& phi, const Eigen::MatrixBase<X>& x, Out&& out, bool normalized) {
  map_side(phi, x, out, KeySide{normalized});
}

template <class Phi, class X, class G, class Out, class Side>
void backward_side(const Phi& phi, const Eigen::MatrixBase<X>& x, const Eigen::MatrixBase<G>& g,
                   Out&& grad_x, Side side) {
  using Scalar = typename X::Scalar;
  if constexpr (has_side_backward<Phi, Scalar, Side>::value)
    phi.backward(x, g, grad_x, side);
  else
    phi.backward(x, g, grad_x);
}

template <class Phi, class X, class G, class Out>
void backward_queries(const Phi& phi, const Eigen::MatrixBase<X>& x,
                      const Eigen::MatrixBase<G>& g, Out&& grad_x, bool normalized) {
  backward_side(phi, x, g, grad_x, QuerySide{normalized});
}

template <class Phi, class X, class G, class Out>
void backward_keys(const Phi& phi, const Eigen::MatrixBase<X>& x, const Eigen::MatrixBase<G>& g,
                   Out&& grad_x, bool normalized) {
  backward_side(phi, x, g, grad_x, KeySide{normalized});
}

template <class Phi, class Scalar>
constexpr void static_check_feature_map() {
  static_assert(detail::has_feature_dim<Phi, Scalar>::value,
                "linattn: this feature map does not model linattn::FeatureMap: it needs "
                "`Eigen::Index feature_dim(Eigen::Index input_dim) const` (see "
                "linattn/feature_map.hpp)");
  static_assert(detail::has_map<Phi, Scalar>::value,
                "linattn: this feature map does not model linattn::FeatureMap: it needs "
                "`template <class Derived> void map(const Eigen::MatrixBase<Derived>& x, "
                "linattn::MatrixRef<typename Derived::Scalar> phi) const` (see "
                "linattn/feature_map.hpp)");
}

// The run-time half of the concept: a map with per-feature key normalisation has its key
// features in K's own D columns, and the kernels size the state with F, so F must be D (a
// larger F would read past K). Called by every entry point before any work (and before any
// parallel region, where nothing may throw).
template <class Phi>
void check_feature_map(const char* function, const Phi& phi, Index D) {
  if constexpr (normalizes_keys_per_feature_v<Phi>) {
    const Index F = phi.feature_dim(D);
    if (F != D)
      throw_invalid_parts(function, {"a feature map with normalizes_keys_per_feature must have "
                                     "feature_dim(D) == D, got F = ", F, ", D = ", D});
  } else {
    // A map with a fixed input dimension (Favor's projection) rejects another D here, at
    // entry, rather than inside a parallel region.
    (void)function, (void)phi.feature_dim(D);
  }
}

// dst = x, for instance the n x D input of a map into a column-major block of the same shape
// (the map then transforms dst in place), or a gradient computed column-major into the caller's
// row-major output. When one side is row-major memory (a whole matrix, a block, or a Map with an
// outer stride, such as the columns of one head) and the other column-major, the copy is done
// with packet transposes: Eigen evaluates an expression whose storage order differs from its
// destination's with scalar code, several times slower than the maps themselves.
template <class Derived, class Dst>
void copy_rows(const Eigen::MatrixBase<Derived>& x, Dst&& dst) {
  using X = std::decay_t<Derived>;
  using Out = std::decay_t<Dst>;
  constexpr bool direct =
      (int(X::Flags) & Eigen::DirectAccessBit) && (int(Out::Flags) & Eigen::DirectAccessBit);
  if constexpr (direct && bool(X::IsRowMajor) != bool(Out::IsRowMajor)) {
    if (x.innerStride() == 1 && dst.innerStride() == 1) {
      // The row-major side, read column-major, is the transpose of the other.
      if constexpr (bool(X::IsRowMajor))
        transpose_copy(x.derived().data(), x.outerStride(), x.cols(), x.rows(), dst.data(),
                       dst.outerStride());
      else
        transpose_copy(x.derived().data(), x.outerStride(), x.rows(), x.cols(), dst.data(),
                       dst.outerStride());
      return;
    }
  }
  dst = x;
}

// Whether copy_rows transposes: maps that evaluate f(x) in one pass for other inputs take
// the copy-then-transform path for these.
template <class Derived>
inline constexpr bool is_row_major_memory_v =
    bool(std::decay_t<Derived>::IsRowMajor) &&
    (int(std::decay_t<Derived>::Flags) & Eigen::DirectAccessBit) != 0;

// Whether map_token_major maps x (n x D) without a transpose: an elementwise map of row-major
// memory, whose transpose is the column-major D x n matrix the token-major buffer wants.
// A map with side overloads never takes it: its sides need not be elementwise.
template <class Phi, class Derived>
inline constexpr bool maps_token_major_v =
    declares_elementwise<Phi>::value && !normalizes_keys_per_feature_v<Phi> &&
    !has_any_side_map_v<Phi, typename std::decay_t<Derived>::Scalar> &&
    is_row_major_memory_v<Derived>;

// An erased map that maps row-major x (n x D) by mapping x^T into a token-major buffer:
// maps_token_major_v for an erased map, decided at run time.
template <class Phi, class Derived>
bool erased_token_major(const Phi& phi) {
  if constexpr (is_erased_map<Phi>::value && is_row_major_memory_v<Derived>)
    return phi.token_major();
  else
    return (void)phi, false;
}

// φ of the rows of x (n x D) into pt (F x n, column-major: column i holds token i's features),
// the token-major layout of the recurrent kernel and of the row-major paths. An elementwise map
// of row-major x maps x^T straight into pt; otherwise the rows are mapped into `scratch` (any
// n x F column-major buffer) and transposed into pt with packets.
template <class Phi, class Derived, class Pt, class Scratch, class Side>
void map_token_major(const Phi& phi, const Eigen::MatrixBase<Derived>& x, Pt& pt,
                     Scratch&& scratch, Side side) {
  if constexpr (maps_token_major_v<Phi, Derived>) {
    (void)scratch, (void)side;
    phi.map(x.transpose(), pt);
  } else {
    if constexpr (is_erased_map<Phi>::value && is_row_major_memory_v<Derived>) {
      if (phi.token_major()) {
        phi.map(x.transpose(), pt);
        return;
      }
    }
    map_side(phi, x, scratch, side);
    copy_to_row_major(scratch, pt.data());
  }
}

// φ(x) into the column-major n x F buffer p: phi.map(x, p) itself, except for an elementwise
// map of row-major x, which maps token-major into `scratch` (F x n) without a transpose of x
// (Eigen would evaluate the mixed storage orders one scalar at a time) and transposes the
// features with packets.
template <class Phi, class Derived, class P, class Scratch, class Side>
void map_column_major(const Phi& phi, const Eigen::MatrixBase<Derived>& x, P& p,
                      Scratch&& scratch, Side side) {
  const auto token_major = [&] {
    phi.map(x.transpose(), scratch);
    transpose_copy(scratch.data(), scratch.outerStride(), scratch.rows(), scratch.cols(),
                   p.data(), p.outerStride());
  };
  if constexpr (maps_token_major_v<Phi, Derived>) {
    (void)side;
    token_major();
  } else if constexpr (is_erased_map<Phi>::value && is_row_major_memory_v<Derived>) {
    if (phi.token_major())
      token_major();
    else
      map_side(phi, x, p, side);
  } else {
    map_side(phi, x, p, side);
  }
}

template <class Scalar>
using RowScratch = Eigen::Matrix<Scalar, Eigen::Dynamic, 1, 0, kMapRowBlock, 1>;

// One row (the recurrent step) through a contiguous, aligned stack buffer: g(row) transforms
// the buffer in place. Written directly, a 1-row block of a column-major matrix has a run-time
// stride and Eigen evaluates it with scalar code (scalar exp, for instance). Returns false,
// doing nothing, when x is not a single row of at most kMapRowBlock entries.
template <class Derived, class G>
bool map_single_row(const Eigen::MatrixBase<Derived>& x, MatrixRef<typename Derived::Scalar> phi,
                    const G& g) {
  using S = typename Derived::Scalar;
  if (x.rows() != 1 || x.cols() > kMapRowBlock) return false;
  // Zeroed: GCC cannot see the copy fill it. At least 16-byte aligned, as Eigen::Aligned asks,
  // also in builds without vectorisation (where EIGEN_MAX_ALIGN_BYTES is 0).
  alignas(EIGEN_MAX_ALIGN_BYTES > 16 ? EIGEN_MAX_ALIGN_BYTES : 16) S buffer[kMapRowBlock] = {};
  Eigen::Map<Eigen::Array<S, Eigen::Dynamic, 1>, Eigen::Aligned> row(buffer, x.cols());
  row = x.row(0).transpose();
  g(row);
  phi.row(0) = row.transpose().matrix();
  return true;
}

// The map of an elementwise functor op (operator() and packetOp, as Eigen's functors) over the
// rows of x into phi: the recurrent step's single row through map_single_row; row-major memory
// transposed into phi with packets (blocks that stay in cache) and mapped in place, since mixed
// storage orders would be evaluated one scalar at a time; anything else in one pass.
template <class Derived, class Op>
void map_elementwise(const Eigen::MatrixBase<Derived>& x, MatrixRef<typename Derived::Scalar> phi,
                     const Op& op) {
  if (map_single_row(x, phi, [&op](auto& row) { row = row.unaryExpr(op); })) return;
  if constexpr (is_row_major_memory_v<Derived>) {
    for (Index r0 = 0; r0 < x.rows(); r0 += kMapRowBlock) {
      const Index n = std::min(kMapRowBlock, x.rows() - r0);
      auto p = phi.middleRows(r0, n);
      copy_rows(x.middleRows(r0, n), p);
      p.array() = p.array().unaryExpr(op);
    }
  } else {
    phi.array() = x.array().unaryExpr(op);
  }
}

// One token's features for the decode steps: φ(x) of a vector x (D entries, row or column,
// any expression) into a vector of F entries, without allocation once sized. An elementwise map
// takes the token as a contiguous column (no 1-row matrix, whose run-time strides Eigen copies
// one scalar at a time); any other map gets it as a 1 x D row.
template <class Scalar>
struct TokenFeatures {
  Matrix<Scalar> row, features;  // 1 x D, 1 x F
  Vector<Scalar> column;         // D

  void resize(Index D, Index F) {
    row.resize(1, D);
    features.resize(1, F);
    column.resize(D);
  }

  template <class Phi, class X, class Side>
  void map(const Phi& phi, const Eigen::MatrixBase<X>& x, Vector<Scalar>& out, Side side) {
    bool column_major = declares_elementwise<Phi>::value && !has_any_side_map_v<Phi, Scalar>;
    if constexpr (is_erased_map<Phi>::value) column_major = phi.token_major();
    if (column_major) {
      assign_widened(column, x);  // bf16 / half tokens widened here
      using ColMap = Eigen::Map<Matrix<Scalar>>;
      phi.map(ColMap(column.data(), column.size(), 1), ColMap(out.data(), out.size(), 1));
    } else {
      row.row(0) = x.reshaped().transpose().template cast<Scalar>();
      map_side(phi, row, features, side);
      out = features.reshaped();
    }
  }
};

}  // namespace detail
}  // namespace linattn
