/// \file core/detail/views.hpp
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

#include <cstddef>
#include <type_traits>

#include "../common.hpp"
#include "low_precision.hpp"

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
                                   Eigen::OuterStride<>(x.outerStride()));
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
                                     Eigen::OuterStride<>(x.outerStride()));
  }
  copy.resize(x.rows(), x.cols());
  return MutableView<Scalar, RM>(copy.data(), copy.rows(), copy.cols(),
                                 Eigen::OuterStride<>(copy.outerStride()));
}

template <class X, class Copy>
void write_back(X& x, const Copy& copy) {
  if (copy.size() != 0 && !unit_stride_memory(x)) x = copy;
}

// The view type of an operand of type X, and the plain matrix its copy is made in: of the
// scalar the kernels compute in (float for bf16 and half operands, which are always copied).
template <class X>
using ViewOf = ConstView<compute_scalar_t<typename std::decay_t<X>::Scalar>, view_row_major_v<X>>;
template <class X>
using MutableViewOf =
    MutableView<compute_scalar_t<typename std::decay_t<X>::Scalar>, view_row_major_v<X>>;
template <class X>
using CopyOf = PlainOf<compute_scalar_t<typename std::decay_t<X>::Scalar>, view_row_major_v<X>>;

// Whether x is memory with unit inner stride in the storage order of Plain (then a slice-by-slice
// SIMD conversion applies).
template <class Plain, class X>
constexpr bool same_order_memory(const X& x) {
  if constexpr ((int(std::decay_t<X>::Flags) & Eigen::DirectAccessBit) != 0 &&
                bool(std::decay_t<X>::IsRowMajor) == bool(Plain::IsRowMajor))
    return unit_stride_memory(x);
  else
    return false;
}

// `outer` slices of `inner` values, ld_src and ld_dst apart, widened (low_precision.hpp).
template <class Storage>
void widen_slices(const Storage* src, Index ld_src, float* dst, Index ld_dst, Index outer,
                  Index inner) {
  if (outer <= 0 || inner <= 0) return;
  for (Index o = 0; o < outer; ++o) widen(src + o * ld_src, dst + o * ld_dst, inner);
}

// A bf16 or half operand widened into float (detail/low_precision.hpp): memory with unit inner
// stride slice by slice with the SIMD loops, anything else through Eigen's scalar cast.
template <class X, class Copy>
void widen_operand(const X& x, Copy& copy) {
  if constexpr ((int(std::decay_t<X>::Flags) & Eigen::DirectAccessBit) != 0) {
    if (same_order_memory<Copy>(x)) {
      copy.resize(x.rows(), x.cols());
      widen_slices(x.data(), x.outerStride(), copy.data(), copy.outerStride(), x.outerSize(),
                   x.innerSize());
      return;
    }
  }
  copy = x.template cast<float>();
}

// The float result in `src` narrowed into the bf16 or half destination `dst` of the same shape.
template <class X, class Src>
void narrow_result(X& dst, const Src& src) {
  if constexpr ((int(std::decay_t<X>::Flags) & Eigen::DirectAccessBit) != 0) {
    if (same_order_memory<Src>(dst)) {
      if (dst.size() != 0)
        for (Index o = 0; o < dst.outerSize(); ++o)
          narrow(src.data() + o * src.outerStride(), dst.data() + o * dst.outerStride(),
                 dst.innerSize());
      return;
    }
  }
  dst = src.template cast<typename std::decay_t<X>::Scalar>();
}

// Rows [r0, r0 + rows) and columns [c0, c0 + cols) of a bf16 / half view widened into `buffer`
// (rows·cols floats), as a float view of the same storage order.
template <class View>
ConstView<float, bool(View::IsRowMajor)> widen_block(const View& x, Index r0, Index c0, Index rows,
                                                     Index cols, float* buffer) {
  constexpr bool RM = bool(View::IsRowMajor);
  const Index ld = x.outerStride();
  if (rows > 0 && cols > 0) {
    if constexpr (RM)
      widen_slices(x.data() + r0 * ld + c0, ld, buffer, cols, rows, cols);
    else
      widen_slices(x.data() + c0 * ld + r0, ld, buffer, rows, cols, rows);
  }
  return ConstView<float, RM>(buffer, rows, cols, Eigen::OuterStride<>(RM ? cols : rows));
}

// An input operand as a view: in place, or a copy made once (an expression, a Map with an inner
// stride). The entry points convert their operands with it after the argument checks, so that
// the kernels below them are compiled once per map, scalar type and storage orders rather than
// once per operand type; the view may point into `copy`, hence no copy or move.
//
// A bf16 or half operand is widened into float: into `buffer` (x.size() floats, from a
// Workspace's storage_copies(), reused across calls) when given, else into `copy`.
template <class X>
struct Viewed {
  using Compute = compute_scalar_t<typename std::decay_t<X>::Scalar>;
  CopyOf<X> copy;
  ViewOf<X> view;
  explicit Viewed(const X& x, Compute* buffer = nullptr) : copy(), view(make(x, copy, buffer)) {}
  Viewed(const Viewed&) = delete;
  Viewed& operator=(const Viewed&) = delete;

 private:
  static ViewOf<X> make(const X& x, CopyOf<X>& copy, Compute* buffer) {
    if constexpr (is_low_precision_v<typename std::decay_t<X>::Scalar>) {
      if constexpr ((int(std::decay_t<X>::Flags) & Eigen::DirectAccessBit) != 0) {
        if (buffer != nullptr && same_order_memory<CopyOf<X>>(x)) {
          const Index inner = x.innerSize();
          widen_slices(x.data(), x.outerStride(), buffer, inner, x.outerSize(), inner);
          return ViewOf<X>(buffer, x.rows(), x.cols(), Eigen::OuterStride<>(inner));
        }
      }
      widen_operand(x, copy);
      return ViewOf<X>(copy.data(), copy.rows(), copy.cols(),
                       Eigen::OuterStride<>(copy.outerStride()));
    } else {
      return const_view(x, copy);
    }
  }
};

// Calls fn(view) with a writable destination as a MutableView: in place when it is unit-stride
// memory, else a buffer copied into it after fn returns.
template <class X, class Fn>
void with_output_view(X& dst, Fn&& fn,
                      compute_scalar_t<typename std::decay_t<X>::Scalar>* buffer = nullptr) {
  CopyOf<X> copy;
  if constexpr (is_low_precision_v<typename std::decay_t<X>::Scalar>) {
    // Computed into float (`buffer` of dst.size() floats, or a copy), narrowed once at the end:
    // a kernel that accumulates into its output (across chunks, heads or threads) accumulates
    // in float.
    const bool row_major = bool(MutableViewOf<X>::IsRowMajor);
    float* data = buffer;
    if (data == nullptr) {
      copy.resize(dst.rows(), dst.cols());
      data = copy.data();
    }
    MutableViewOf<X> view(data, dst.rows(), dst.cols(),
                          Eigen::OuterStride<>(row_major ? dst.cols() : dst.rows()));
    fn(view);
    narrow_result(dst, view);
  } else {
    MutableViewOf<X> view = mutable_view(dst, copy);
    fn(view);
    write_back(dst, copy);
  }
}

// The usual entry point's operands: Q, K and V as Viewed inputs and `out` through
// with_output_view(), then fn(q, k, v, out) on the views.
// With `copies` (a Workspace's storage_copies()), bf16 / half operands are widened into its
// buffers, which a reused workspace keeps warm.
template <class DQ, class DK, class DV, class DOut, class Fn, class Copies = std::nullptr_t>
void with_views(const DQ& Q, const DK& K, const DV& V, DOut& out, Fn&& fn,
                Copies* copies = nullptr) {
  using Compute = compute_scalar_t<typename std::decay_t<DQ>::Scalar>;
  Compute* b[4] = {nullptr, nullptr, nullptr, nullptr};
  if constexpr (!std::is_same_v<Copies, std::nullptr_t> &&
                is_low_precision_v<typename std::decay_t<DQ>::Scalar>) {
    if (copies != nullptr) {
      b[0] = copies->reserve(0, Q.size());
      b[1] = copies->reserve(1, K.size());
      b[2] = copies->reserve(2, V.size());
      b[3] = copies->reserve(3, out.size());
    }
  } else {
    (void)copies;
  }
  const Viewed<DQ> q(Q, b[0]);
  const Viewed<DK> k(K, b[1]);
  const Viewed<DV> v(V, b[2]);
  with_output_view(
      out, [&](auto& dst) { fn(q.view, k.view, v.view, dst); }, b[3]);
}

// with_views() for kernels that convert bf16 / half operands themselves, a piece at a time:
// the operands as views of their own scalar type (in place, or a copy of an expression).
template <class DQ, class DK, class DV, class DOut, class Fn>
void with_storage_views(const DQ& Q, const DK& K, const DV& V, DOut& out, Fn&& fn) {
  PlainOf<typename DQ::Scalar, view_row_major_v<DQ>> cq;
  PlainOf<typename DK::Scalar, view_row_major_v<DK>> ck;
  PlainOf<typename DV::Scalar, view_row_major_v<DV>> cv;
  PlainOf<typename DOut::Scalar, view_row_major_v<DOut>> co;
  const auto q = const_view(Q, cq);
  const auto k = const_view(K, ck);
  const auto v = const_view(V, cv);
  auto dst = mutable_view(out, co);
  fn(q, k, v, dst);
  write_back(out, co);
}

// with_output_view() for the three gradients of a backward kernel: fn(dq, dk, dv).
template <class X1, class X2, class X3, class Fn>
void with_output_views(X1& a, X2& b, X3& c, Fn&& fn) {
  with_output_view(a, [&](auto& va) {
    with_output_view(b, [&](auto& vb) { with_output_view(c, [&](auto& vc) { fn(va, vb, vc); }); });
  });
}

// A backward call's operands: Q, K, V and dOut as Viewed inputs, the three gradients through
// with_output_views(), then fn(q, k, v, dout, dq, dk, dv) on the views.
template <class DQ, class DK, class DV, class DO, class X1, class X2, class X3, class Fn>
void with_backward_views(const DQ& Q, const DK& K, const DV& V, const DO& dOut, X1& dQ, X2& dK,
                         X3& dV, Fn&& fn) {
  const Viewed<DQ> q(Q);
  const Viewed<DK> k(K);
  const Viewed<DV> v(V);
  const Viewed<DO> go(dOut);
  with_output_views(dQ, dK, dV, [&](auto& dq, auto& dk, auto& dv) {
    fn(q.view, k.view, v.view, go.view, dq, dk, dv);
  });
}

// The block (r0, c0, rows, cols) of a view, as a view of the same type.
// An empty block keeps the view's pointer: the memory of an empty operand may be null, where
// no offset may be applied.
template <class View>
View sub_view(View v, Index r0, Index c0, Index rows, Index cols) {
  const Index ld = v.outerStride();
  if (rows == 0 || cols == 0) return View(v.data(), rows, cols, Eigen::OuterStride<>(ld));
  return View(v.data() + (View::IsRowMajor ? r0 * ld + c0 : c0 * ld + r0), rows, cols,
              Eigen::OuterStride<>(ld));
}

// Where entry (r, c) of x lives when x is an array of S in memory: base + r·rs + c·cs (null when
// it is an expression or of another scalar type, which the kernels convert first).
template <class S, class D>
auto strided_base(D& x, Index& rs, Index& cs) {
  using P = std::conditional_t<std::is_const_v<D>, const S*, S*>;
  using X = std::remove_const_t<D>;
  if constexpr (std::is_same_v<typename X::Scalar, S> &&
                bool(int(Eigen::internal::traits<X>::Flags) & Eigen::DirectAccessBit)) {
    rs = X::IsRowMajor ? x.outerStride() : x.innerStride();
    cs = X::IsRowMajor ? x.innerStride() : x.outerStride();
    return static_cast<P>(x.data());
  } else {
    (void)x;
    rs = cs = 0;
    return static_cast<P>(nullptr);
  }
}

// x's rows as contiguous arrays (row r at base + r·stride), or null.
template <class S, class D>
auto row_base(D& x, Index& stride) {
  Index rs = 0, cs = 0;
  auto* p = strided_base<S>(x, rs, cs);
  stride = rs;
  return p && (cs == 1 || x.cols() <= 1) ? p : decltype(p)(nullptr);
}

}  // namespace linattn::detail
