/// \file checks.hpp
/// \brief Argument checks shared by every entry point. A bad shape throws std::invalid_argument
/// whose message names the function and every operand's shape.
#pragma once

#include <Eigen/Core>

#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common.hpp"

namespace linattn::detail {

inline std::string shape_string(Index rows, Index cols) {
  return std::to_string(rows) + "x" + std::to_string(cols);
}

template <class Derived>
std::string shape_of(const Eigen::EigenBase<Derived>& m) {
  return shape_string(m.rows(), m.cols());
}

[[noreturn]] inline void throw_invalid(const char* function, const std::string& what) {
  throw std::invalid_argument(std::string("linattn::") + function + ": " + what);
}

// The scalar types of Q, K and V must agree: mixing float and double would hide a conversion.
template <class DQ, class DK, class DV>
constexpr void static_check_scalars() {
  using S = typename DQ::Scalar;
  static_assert(std::is_same_v<S, typename DK::Scalar> && std::is_same_v<S, typename DV::Scalar>,
                "linattn: Q, K and V must have the same scalar type (cast one with .cast<T>())");
  static_assert(is_supported_scalar_v<S>, "linattn: the scalar type must be float or double");
}

// Q is N x D, K is L x D, V is L x M; causal attention also needs N == L; D must be positive.
template <class DQ, class DK, class DV>
void check_qkv(const char* function, const Eigen::MatrixBase<DQ>& Q,
               const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V, bool causal) {
  static_check_scalars<DQ, DK, DV>();
  const auto shapes = [&] {
    return " (Q is " + shape_of(Q) + ", K is " + shape_of(K) + ", V is " + shape_of(V) + ")";
  };
  if (Q.cols() != K.cols())
    throw_invalid(function, "Q and K must have the same number of columns D" + shapes());
  if (K.rows() != V.rows())
    throw_invalid(function, "K and V must have the same number of rows L" + shapes());
  if (causal && Q.rows() != K.rows())
    throw_invalid(function,
                  "causal attention needs as many queries as keys (N == L)" + shapes());
  if (Q.cols() == 0) throw_invalid(function, "the key dimension D must be positive" + shapes());
}

template <class DOut>
void check_output(const char* function, const Eigen::MatrixBase<DOut>& out, Index rows,
                  Index cols) {
  if (out.rows() != rows || out.cols() != cols)
    throw_invalid(function, "the output is " + shape_of(out) + " but must be " +
                                shape_string(rows, cols));
}

// Eigen's documented idiom for writing through an expression passed by const reference
// (a Block or Map of the caller's storage).
template <class Derived>
Derived& writable(const Eigen::MatrixBase<Derived>& out) {
  return const_cast<Eigen::MatrixBase<Derived>&>(out).derived();
}

template <class DMask>
void check_key_mask(const char* function, const Eigen::DenseBase<DMask>& mask, Index L) {
  static_assert(std::is_same_v<typename DMask::Scalar, bool>,
                "linattn: a key mask is a vector of bool (true = the key takes part)");
  if (mask.size() != L || (mask.rows() != 1 && mask.cols() != 1))
    throw_invalid(function, "the key mask is " + shape_of(mask) + " but must be a vector of " +
                                std::to_string(L) + " entries, one per key");
}

}  // namespace linattn::detail
