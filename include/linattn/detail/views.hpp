/// \file detail/views.hpp
/// \brief Operands as maps of two types (internal): column- or row-major memory with an outer
/// stride.
///
/// A kernel called on the view is instantiated once per map, scalar type and storage orders, not
/// once per expression type a caller passes (a matrix, a block of one, a Map, a head's columns of
/// a packed matrix): the instantiations, not Eigen, are what a test or user translation unit
/// spends its compile time on. Unit-stride memory is viewed in place; anything else (an
/// expression, a Map with an inner stride) is evaluated into a plain matrix of the same storage
/// order first.
#pragma once

#include <Eigen/Core>

#include <type_traits>

#include "../common.hpp"

namespace linattn::detail {

template <class Scalar, bool RowMajor>
using PlainOf = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic,
                              RowMajor ? Eigen::RowMajor : Eigen::ColMajor>;
template <class Scalar, bool RowMajor>
using ConstView = Eigen::Map<const PlainOf<Scalar, RowMajor>, 0, Eigen::OuterStride<>>;
template <class Scalar, bool RowMajor>
using MutableView = Eigen::Map<PlainOf<Scalar, RowMajor>, 0, Eigen::OuterStride<>>;

template <class X>
inline constexpr bool view_row_major_v =
    bool(std::decay_t<X>::IsRowMajor) && std::decay_t<X>::ColsAtCompileTime != 1;

template <class X>
constexpr bool unit_stride_memory(const X& x) {
  if constexpr ((int(std::decay_t<X>::Flags) & Eigen::DirectAccessBit) != 0)
    return x.innerStride() == 1 || x.size() == 0;
  else
    return false;
}

// x in place, or its copy in `copy` (left empty when not needed: no allocation).
template <class X, class Scalar = typename std::decay_t<X>::Scalar,
          bool RM = view_row_major_v<X>>
ConstView<Scalar, RM> const_view(const X& x, PlainOf<Scalar, RM>& copy) {
  if (unit_stride_memory(x)) {
    if constexpr ((int(std::decay_t<X>::Flags) & Eigen::DirectAccessBit) != 0)
      return ConstView<Scalar, RM>(x.data(), x.rows(), x.cols(),
                                   Eigen::OuterStride<>(x.size() == 0 ? 1 : x.outerStride()));
  }
  copy = x;
  return ConstView<Scalar, RM>(copy.data(), copy.rows(), copy.cols(),
                               Eigen::OuterStride<>(copy.outerStride()));
}

// x in place, or `copy` (to be written back with write_back) when x is not unit-stride memory.
template <class X, class Scalar = typename std::decay_t<X>::Scalar,
          bool RM = view_row_major_v<X>>
MutableView<Scalar, RM> mutable_view(X& x, PlainOf<Scalar, RM>& copy) {
  if (unit_stride_memory(x)) {
    if constexpr ((int(std::decay_t<X>::Flags) & Eigen::DirectAccessBit) != 0)
      return MutableView<Scalar, RM>(x.data(), x.rows(), x.cols(),
                                     Eigen::OuterStride<>(x.size() == 0 ? 1 : x.outerStride()));
  }
  copy.resize(x.rows(), x.cols());
  return MutableView<Scalar, RM>(copy.data(), copy.rows(), copy.cols(),
                                 Eigen::OuterStride<>(copy.outerStride()));
}

template <class X, class Copy>
void write_back(X& x, const Copy& copy) {
  if (copy.size() != 0 && !unit_stride_memory(x)) x = copy;
}

// The block (r0, c0, rows, cols) of a view, as a view of the same type.
template <class View>
View sub_view(View v, Index r0, Index c0, Index rows, Index cols) {
  using Ptr = decltype(v.data());
  const Index ld = v.outerStride();
  const Ptr p = v.data() + (View::IsRowMajor ? r0 * ld + c0 : c0 * ld + r0);
  return View(rows * cols == 0 ? v.data() : p, rows, cols, Eigen::OuterStride<>(ld));
}

}  // namespace linattn::detail
