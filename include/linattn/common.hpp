/// \file common.hpp
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

/// \brief The ε of the denominator guard: every normalised kernel divides by
/// \f$\max(\mathrm{den}, \varepsilon)\f$.
///
/// 1e-6 for float and 1e-12 for double. With strictly positive feature maps the denominator
/// only comes near ε when every feature underflows (inputs around −100 for EluPlusOne), or,
/// for NormalizedCosine, when every key points exactly away from the query; the row is then a
/// finite, near-zero vector instead of NaN or Inf. Every algorithm (non-causal, chunked,
/// recurrent) applies the same guard, so they agree to rounding.
template <class Scalar>
constexpr Scalar denominator_epsilon() noexcept {
  return sizeof(Scalar) <= sizeof(float) ? Scalar(1e-6) : Scalar(1e-12);
}

namespace detail {

// float and double only, as the static_assert messages say: long double has no packet
// math in Eigen, and the tolerances, ε and the fast exp paths are tuned for the two.
template <class Scalar>
constexpr bool is_supported_scalar_v =
    std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>;

// Evaluates an operand once when re-reading it would cost more than a copy (a product, an
// expensive coefficient-wise expression); plain matrices, Maps and Blocks are used in place.
template <class Derived>
using Nested = typename Eigen::internal::nested_eval<Derived, 2>::type;

}  // namespace detail
}  // namespace linattn
