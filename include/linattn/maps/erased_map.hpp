/// \file maps/erased_map.hpp
/// \brief A feature map behind a table of function pointers (internal): the kernels are
/// compiled once per kind of map, not once per map.
///
/// Every entry point hands its kernels `erase_map<Scalar>(phi)` instead of `phi`. The map's own
/// code is compiled once per input storage order (its query side, key side and plain map of
/// column- or row-major rows; the same for its vector–Jacobian product) and reached by one
/// indirect call per block of rows; the kernels, where a translation unit spends its compile
/// time, are compiled for the two kinds of map whose algorithms differ at compile time
/// (ErasedKind: a product map, or a per-feature key softmax) instead of once for every map a
/// program uses. Eight maps through the causal kernel, both storage orders, float, g++ -O1:
/// 19.1 s to compile before, 14.0 s with erased maps (Eigen and the headers alone: 2–3 s).
///
/// What the kernels read off a map's declarations at compile time and only selects a path,
/// not an algorithm, is a run-time property of the erased map: whether a denominator may
/// cancel (may_cancel(), an O(F) test per row), whether row-major inputs map token-major
/// without transposes (token_major(), `elementwise` maps), and whether the gradients take φ'
/// from the features (is_elu_plus_one()). The results are those of the map itself, bit for bit.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cassert>
#include <type_traits>

#include "../core/common.hpp"
#include "elu_plus_one.hpp"
#include "feature_map.hpp"
#include "../core/detail/views.hpp"

namespace linattn::detail {

// The call of a map: its plain `map` / `backward`, or the query or key side (feature_map.hpp).
enum class MapCall : unsigned char { plain, query, key };

// Rows as one of the two view types, in place when they are memory with a unit stride along
// one dimension (a block, a Map, the transpose of row-major memory, one row of a column-major
// matrix), else evaluated into a copy. What the kernels pass (blocks of views, token buffers
// and their transposes) has a unit inner stride at compile time: fn is then compiled for the
// one view type of X's storage order, and no copy is compiled.
template <class X, class Fn>
void with_rows_view(const Eigen::MatrixBase<X>& x, Fn&& fn) {
  using S = typename X::Scalar;
  constexpr bool direct = (int(X::Flags) & Eigen::DirectAccessBit) != 0;
  if constexpr (direct && X::InnerStrideAtCompileTime == 1) {
    fn(ConstView<S, bool(X::IsRowMajor)>(x.derived().data(), x.rows(), x.cols(),
                                         Eigen::OuterStride<>(x.outerStride())));
  } else {
    if constexpr (direct) {
      const Index r = x.rows(), c = x.cols();
      if (r <= 1 || x.rowStride() == 1) {
        const Index ld = c <= 1 ? std::max<Index>(r, 1) : x.colStride();
        fn(ConstView<S, false>(x.derived().data(), r, c, Eigen::OuterStride<>(ld)));
        return;
      }
      if (c <= 1 || x.colStride() == 1) {
        fn(ConstView<S, true>(x.derived().data(), r, c, Eigen::OuterStride<>(x.rowStride())));
        return;
      }
    }
    // An expression, or memory strided both ways.
    const PlainOf<S, false> copy = x;
    fn(ConstView<S, false>(copy.data(), copy.rows(), copy.cols(),
                           Eigen::OuterStride<>(std::max<Index>(copy.rows(), 1))));
  }
}

template <class Scalar>
struct ErasedBackwardOps {
  using Col = ConstView<Scalar, false>;
  using Row = ConstView<Scalar, true>;
  // x and the incoming gradient g column- (c) or row-major (r).
  void (*cc)(const void*, const Col&, const Col&, MatrixRef<Scalar>, MapCall, bool);
  void (*cr)(const void*, const Col&, const Row&, MatrixRef<Scalar>, MapCall, bool);
  void (*rc)(const void*, const Row&, const Col&, MatrixRef<Scalar>, MapCall, bool);
  void (*rr)(const void*, const Row&, const Row&, MatrixRef<Scalar>, MapCall, bool);
};

template <class Scalar>
struct ErasedMapOps {
  using Col = ConstView<Scalar, false>;
  using Row = ConstView<Scalar, true>;
  Index (*feature_dim)(const void*, Index);
  void (*map_col)(const void*, const Col&, MatrixRef<Scalar>, MapCall, bool);
  void (*map_row)(const void*, const Row&, MatrixRef<Scalar>, MapCall, bool);
  bool token_major;  // elementwise, without sides: map(x.transpose(), buffer) is φ(x)ᵀ
  bool elu;          // EluPlusOne: the gradients take φ' from the features (map_backward.hpp)
  bool may_cancel;   // may_cancel_v
};

template <class Phi, class Scalar>
Index erased_feature_dim(const void* p, Index d) {
  return static_cast<const Phi*>(p)->feature_dim(d);
}

template <class Phi, class X>
void erased_map_call(const void* p, const X& x, MatrixRef<typename X::Scalar> out, MapCall call,
                     bool normalized) {
  const Phi& phi = *static_cast<const Phi*>(p);
  if (call == MapCall::plain) {
    phi.map(x, out);
  } else if (call == MapCall::query) {
    map_side(phi, x, out, QuerySide{normalized});
  } else if constexpr (!normalizes_keys_per_feature_v<Phi>) {
    map_side(phi, x, out, KeySide{normalized});
  } else {
    assert(false && "the key side of a per-feature map is no row map");
  }
}

template <class Phi, class X, class G>
void erased_backward_call(const void* p, const X& x, const G& g,
                          MatrixRef<typename X::Scalar> grad_x, MapCall call, bool normalized) {
  const Phi& phi = *static_cast<const Phi*>(p);
  if (call == MapCall::plain) {
    phi.backward(x, g, grad_x);
  } else if (call == MapCall::query) {
    backward_side(phi, x, g, grad_x, QuerySide{normalized});
  } else {
    backward_side(phi, x, g, grad_x, KeySide{normalized});
  }
}

template <class Phi, class Scalar>
struct ErasedOpsOf {
  using Col = ConstView<Scalar, false>;
  using Row = ConstView<Scalar, true>;
  static constexpr ErasedMapOps<Scalar> ops = {
      &erased_feature_dim<Phi, Scalar>, &erased_map_call<Phi, Col>, &erased_map_call<Phi, Row>,
      declares_elementwise<Phi>::value && !normalizes_keys_per_feature_v<Phi> &&
          !has_any_side_map_v<Phi, Scalar>,
      declares_derivative_from_features<Phi>::value, may_cancel_v<Phi>};
};

// Instantiated only by the entry points of the gradients: a forward call compiles no backward.
template <class Phi, class Scalar>
struct ErasedBackwardOpsOf {
  using Col = ConstView<Scalar, false>;
  using Row = ConstView<Scalar, true>;
  static constexpr ErasedBackwardOps<Scalar> ops = {
      &erased_backward_call<Phi, Col, Col>, &erased_backward_call<Phi, Col, Row>,
      &erased_backward_call<Phi, Row, Col>, &erased_backward_call<Phi, Row, Row>};
};

template <class Phi>
inline constexpr ErasedKind erased_kind_v =
    normalizes_keys_per_feature_v<Phi> ? ErasedKind::per_feature : ErasedKind::product;

// A reference to a map (which must outlive it) as a FeatureMap with side overloads. It declares
// what the kernels select algorithms by (nonnegative_features, normalizes_keys_per_feature) and
// has a backward when the map has one (calling it otherwise is a bug the entry points exclude).
template <class Scalar, ErasedKind Kind>
class ErasedMap {
 public:
  static constexpr bool normalizes_keys_per_feature = Kind == ErasedKind::per_feature;

  template <class Phi>
  ErasedMap(const Phi& phi, const ErasedBackwardOps<Scalar>* backward)
      : map_(&phi), ops_(&ErasedOpsOf<Phi, Scalar>::ops), backward_(backward) {
    static_assert(erased_kind_v<Phi> == Kind, "linattn: internal: wrong ErasedKind");
  }

  Index feature_dim(Index d) const { return ops_->feature_dim(map_, d); }
  bool token_major() const { return ops_->token_major; }
  bool is_elu_plus_one() const { return ops_->elu; }
  bool may_cancel() const { return ops_->may_cancel; }

  template <class X>
  void map(const Eigen::MatrixBase<X>& x, MatrixRef<Scalar> out) const {
    call(x, out, MapCall::plain, false);
  }
  template <class X>
  void map(const Eigen::MatrixBase<X>& x, MatrixRef<Scalar> out, QuerySide side) const {
    call(x, out, MapCall::query, side.normalized);
  }
  template <class X>
  void map(const Eigen::MatrixBase<X>& x, MatrixRef<Scalar> out, KeySide side) const {
    call(x, out, MapCall::key, side.normalized);
  }

  template <class X, class G>
  void backward(const Eigen::MatrixBase<X>& x, const Eigen::MatrixBase<G>& g,
                MatrixRef<Scalar> grad_x) const {
    call_backward(x, g, grad_x, MapCall::plain, false);
  }
  template <class X, class G>
  void backward(const Eigen::MatrixBase<X>& x, const Eigen::MatrixBase<G>& g,
                MatrixRef<Scalar> grad_x, QuerySide side) const {
    call_backward(x, g, grad_x, MapCall::query, side.normalized);
  }
  template <class X, class G>
  void backward(const Eigen::MatrixBase<X>& x, const Eigen::MatrixBase<G>& g,
                MatrixRef<Scalar> grad_x, KeySide side) const {
    call_backward(x, g, grad_x, MapCall::key, side.normalized);
  }

 private:
  template <class X>
  void call(const Eigen::MatrixBase<X>& x, MatrixRef<Scalar>& out, MapCall c, bool n) const {
    with_rows_view(x, [&](const auto& xv) {
      if constexpr (std::decay_t<decltype(xv)>::IsRowMajor)
        ops_->map_row(map_, xv, out, c, n);
      else
        ops_->map_col(map_, xv, out, c, n);
    });
  }

  template <class X, class G>
  void call_backward(const Eigen::MatrixBase<X>& x, const Eigen::MatrixBase<G>& g,
                     MatrixRef<Scalar>& grad_x, MapCall c, bool n) const {
    assert(backward_ != nullptr);
    with_rows_view(x, [&](const auto& xv) {
      with_rows_view(g, [&](const auto& gv) {
        constexpr bool xr = std::decay_t<decltype(xv)>::IsRowMajor;
        constexpr bool gr = std::decay_t<decltype(gv)>::IsRowMajor;
        if constexpr (!xr && !gr)
          backward_->cc(map_, xv, gv, grad_x, c, n);
        else if constexpr (!xr && gr)
          backward_->cr(map_, xv, gv, grad_x, c, n);
        else if constexpr (xr && !gr)
          backward_->rc(map_, xv, gv, grad_x, c, n);
        else
          backward_->rr(map_, xv, gv, grad_x, c, n);
      });
    });
  }

  const void* map_;
  const ErasedMapOps<Scalar>* ops_;
  const ErasedBackwardOps<Scalar>* backward_;
};

// The map the kernels see: phi itself when it is already erased. erase_map_with_backward()
// also erases its backward, if it has one.
template <class Scalar, class Phi>
auto erase_map(const Phi& phi) {
  if constexpr (is_erased_map<Phi>::value)
    return phi;
  else
    return ErasedMap<Scalar, erased_kind_v<Phi>>(phi, nullptr);
}

template <class Scalar, class Phi>
auto erase_map_with_backward(const Phi& phi) {
  if constexpr (is_erased_map<Phi>::value)
    return phi;
  else if constexpr (has_backward_v<Phi, Scalar>)
    return ErasedMap<Scalar, erased_kind_v<Phi>>(phi, &ErasedBackwardOpsOf<Phi, Scalar>::ops);
  else
    return ErasedMap<Scalar, erased_kind_v<Phi>>(phi, nullptr);
}

}  // namespace linattn::detail
