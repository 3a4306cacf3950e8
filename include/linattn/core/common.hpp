/// \file core/common.hpp
/// \brief Types and constants shared by every kernel: matrix aliases and the denominator guard.
#pragma once

#include <Eigen/Core>

#include <limits>
#include <type_traits>

namespace linattn {

/// Index type of every size and position (Eigen's signed index).
using Index = Eigen::Index;

/// A dynamic-size, column-major matrix; the type every kernel returns.
template <class Scalar>
using Matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;

/// A dynamic-size column vector.
template <class Scalar>
using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

/// The writable view a feature map receives for its output: a column-major block with unit
/// inner stride (a whole matrix, a block of rows or columns of one, or a Map over a buffer).
template <class Scalar>
using MatrixRef = Eigen::Ref<Matrix<Scalar>>;

/// \brief The threshold of the denominator guard: a row whose denominator
/// \f$\mathrm{den} = \varphi(q_i)^\top z_i\f$ is below it is degenerate and its output is 0.
///
/// The smallest positive normal number of the scalar type (about 1.2e-38 for float, 2.2e-308
/// for double). Every other row is divided by its denominator as computed, with no bias: a
/// tiny but normal denominator (every feature small, as for EluPlusOne at inputs of -10) gives
/// the same weighted mean as a large one. A denominator below the threshold (0, subnormal,
/// negative or NaN) means that the similarities underflowed (EluPlusOne at inputs around -45
/// in float), that no key takes part, or, for maps with features of both signs
/// (NormalizedCosine), that every key points exactly away from the query; the row is then 0,
/// never NaN or Inf. Dividing by a normal denominator cannot overflow for maps whose features
/// are non-negative, since each output is a convex combination of value rows. Every algorithm
/// (non-causal, chunked, recurrent, the recurrent step) applies the same guard, so they agree
/// to rounding. See docs/SPEC.md §2, "Denominators".
/// \return the smallest normal Scalar.
template <class Scalar>
constexpr Scalar denominator_epsilon() noexcept {
  return std::numeric_limits<Scalar>::min();
}

/// The guarded reciprocal every kernel divides by: 1 / den, or 0 when den is degenerate (below
/// denominator_epsilon(), or NaN).
/// \param den a row's denominator φ(q)ᵀz.
/// \return 1 / den, or 0 for a degenerate den.
template <class Scalar>
inline Scalar guarded_inverse(Scalar den) noexcept {
  return den >= denominator_epsilon<Scalar>() ? Scalar(1) / den : Scalar(0);
}

/// \brief The scalar a kernel computes in for operands stored as `Storage`: float for
/// `Eigen::bfloat16` and `Eigen::half` (storage only: the feature maps, the states and every
/// accumulation run in float, as ggml and flash-linear-attention do), `Storage` itself for
/// float and double. States, workspaces and feature-map scalars of a call on bf16 or half
/// operands are float: `LinearAttentionState<linattn::compute_scalar_t<Eigen::bfloat16>>`.
/// \tparam Storage the operands' scalar type.
template <class Storage>
struct compute_scalar {
  /// The compute scalar: `Storage` itself.
  using type = Storage;
};
/// bf16 operands compute in float: bf16 has too few mantissa bits to accumulate in.
template <>
struct compute_scalar<Eigen::bfloat16> {
  /// float.
  using type = float;
};
/// half operands compute in float: half has too few bits and too little range to accumulate in.
template <>
struct compute_scalar<Eigen::half> {
  /// float.
  using type = float;
};
/// The scalar a kernel computes in for operands stored as `Storage` (compute_scalar).
template <class Storage>
using compute_scalar_t = typename compute_scalar<Storage>::type;

namespace detail {

// bf16 and half: storage types of operands, never computed in (detail/low_precision.hpp).
template <class Scalar>
constexpr bool is_low_precision_v =
    std::is_same_v<Scalar, Eigen::bfloat16> || std::is_same_v<Scalar, Eigen::half>;

// float and double only, as the static_assert messages say: long double has no packet
// math in Eigen, and the tolerances, ε and the fast exp paths are tuned for the two.
template <class Scalar>
constexpr bool is_supported_scalar_v =
    std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>;

// What an operand may hold: a compute scalar, or bf16 / half computed in float.
template <class Scalar>
constexpr bool is_storage_scalar_v = is_supported_scalar_v<Scalar> || is_low_precision_v<Scalar>;

// Evaluates an operand once when re-reading it would cost more than a copy (a product, an
// expensive coefficient-wise expression); plain matrices, Maps and Blocks are used in place.
template <class Derived>
using Nested = typename Eigen::internal::nested_eval<Derived, 2>::type;

template <class T>
struct DynamicBlockOf : std::false_type {};
template <class Xpr, bool InnerPanel>
struct DynamicBlockOf<Eigen::Block<Xpr, Eigen::Dynamic, Eigen::Dynamic, InnerPanel>>
    : std::true_type {
  using Expression = Xpr;
};

// Rows [begin, begin + size) of `x` (an operand as held by Nested, or a writable output) as
// Block<X, Dynamic, Dynamic, false> of the expression X that holds the data: a dynamic block of
// a block is re-based on the block's own expression. The kernels are templates on their
// operands' types, and this gives one type to a call's rows, to its threads' segments (spec §8)
// and to the heads of the multi-head kernels (`Q.block(...)`): a kernel is compiled once for
// all of them rather than once for each, which halves the code (and the compile time) of
// every program that calls both the single-head and the multi-head forms.
template <class X>
auto row_segment(X& x, Index begin, Index size) {
  using Plain = std::remove_const_t<X>;
  if constexpr (DynamicBlockOf<Plain>::value) {
    using Xpr = typename DynamicBlockOf<Plain>::Expression;
    using Base = std::conditional_t<std::is_const_v<X>, const Xpr, Xpr>;
    return Eigen::Block<Base, Eigen::Dynamic, Eigen::Dynamic, false>(
        x.nestedExpression(), x.startRow() + begin, x.startCol(), size, x.cols());
  } else {
    return Eigen::Block<X, Eigen::Dynamic, Eigen::Dynamic, false>(x, begin, 0, size, x.cols());
  }
}

}  // namespace detail
}  // namespace linattn
