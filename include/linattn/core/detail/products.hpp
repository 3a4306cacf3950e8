/// \file core/detail/products.hpp
/// \brief The state products of the kernels on the micro-kernel (internal): S += φ(K)ᵀ V and
/// out = φ(Q) S over a block of rows, with the caller's operands read where they are.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <type_traits>

#include "../common.hpp"
#include "../workspace.hpp"
#include "blocking.hpp"
#include "microkernel.hpp"

namespace linattn::detail {

// A matrix operand as the micro-kernel reads it: x(r, c) at data[r·rs + c·cs].
template <class Scalar>
struct Strided {
  const Scalar* data;
  Index rs, cs;
};

// Memory (an Eigen object with data() and strides): what the products may read in place.
template <class X>
constexpr bool is_direct_v = (int(std::decay_t<X>::Flags) & Eigen::DirectAccessBit) != 0;

// The strides of memory x in either storage order.
template <class X, class Scalar = typename std::decay_t<X>::Scalar>
Strided<Scalar> strided_of(const X& x) {
  static_assert(is_direct_v<X>, "linattn: internal: strided_of needs direct access");
  if constexpr (bool(std::decay_t<X>::IsRowMajor))
    return {x.data(), x.outerStride(), x.innerStride()};
  else
    return {x.data(), x.innerStride(), x.outerStride()};
}

// x itself when it is column-major memory with unit inner stride, or row-major memory whose rows
// follow one another (outer stride = cols); otherwise a row-major copy in slot `slot`. A head's
// columns of a packed row-major N x (H·M) buffer are copied: read in place, their rows (2 KiB
// apart at H·M = 512 floats) fall into a few L1 sets, which costs more than the copy's b·M moves
// against 2·b·F·M flops (bench_multihead, recurrent form).
//
// The products size their buffers for the copy whether or not it is made, so that a workspace
// that served one storage order serves every other of the same shape without allocating.
template <class X, class Scalar = typename std::decay_t<X>::Scalar>
Strided<Scalar> strided_rows(const X& x, Workspace<Scalar>& ws, int slot) {
  using Plain = std::decay_t<X>;
  ws.reserve(slot, x.rows() * x.cols());
  if constexpr (is_direct_v<Plain>) {
    if (x.innerStride() == 1) {
      if constexpr (bool(Plain::IsRowMajor)) {
        if (x.outerStride() == x.cols() || x.rows() <= 1) return {x.data(), x.outerStride(), 1};
      } else {
        return {x.data(), 1, x.outerStride()};
      }
    }
  }
  Scalar* buf = ws.matrix(slot, x.rows(), x.cols()).data();
  copy_to_row_major(x, buf);
  return {buf, x.cols(), 1};
}

// An m x k operand as a column-major array (rows contiguous): x itself when its rows are, else a
// copy in slot `slot` (transposed with packets when x is row-contiguous).
template <class Scalar>
Strided<Scalar> column_contiguous(Strided<Scalar> x, Index m, Index k, Workspace<Scalar>& ws,
                                  int slot) {
  if (x.rs == 1) return x;
  Scalar* buf = ws.matrix(slot, m, k).data();
  if (x.cs == 1) {
    transpose_copy(x.data, x.rs, k, m, buf, m);
  } else {
    for (Index p = 0; p < k; ++p)
      for (Index i = 0; i < m; ++i) buf[i + p * m] = x.data[i * x.rs + p * x.cs];
  }
  return {buf, 1, m};
}

// C (m x n) = A B (accumulate = false) or C += A B, for operands of any strides and C with unit
// stride in one dimension (C(i, j) at c[i·crs + j·ccs]). The micro-kernel needs C and A
// contiguous along the same dimension: column-contiguous C takes A as it is; row-contiguous C
// (a row-major state, row-major outputs) is computed as Cᵀ = Bᵀ Aᵀ, with B the contiguous
// operand. An operand that is not contiguous where it must be is copied into slot `slot` (m·k
// or k·n entries).
template <class Scalar>
void product(Index m, Index n, Index k, Strided<Scalar> a, Strided<Scalar> b, Scalar* c,
             Index crs, Index ccs, bool accumulate, Workspace<Scalar>& ws, int slot) {
  if (m <= 0 || n <= 0) return;
  ws.reserve(slot, std::max(m, n) * k);
  if (crs == 1 && (ccs != 1 || m >= n)) {
    const Strided<Scalar> ac = column_contiguous(a, m, k, ws, slot);
    gemm_acc(m, n, k, ac.data, ac.cs, b.data, b.rs, b.cs, c, ccs, accumulate);
  } else {
    eigen_assert(ccs == 1);
    const Strided<Scalar> bt = column_contiguous(Strided<Scalar>{b.data, b.cs, b.rs}, n, k, ws, slot);
    gemm_acc(n, m, k, bt.data, bt.cs, a.data, a.cs, a.rs, c, crs, accumulate);
  }
}

// C (m x n) = L B (accumulate = false) or C += L B for a lower-triangular m x m L (column-major,
// leading dimension ldl: a chunk's scores), C with unit stride in one dimension as in
// product(). Row i of C sums L(i, p) B(p, :) over p <= i only: the entries above the diagonal
// are not read and the rows of B past i never enter row i (the causal kernels' intra-chunk
// product, where a later token's value may be NaN or inf). Same bits as product() on L with
// a zero upper triangle when B is finite.
template <class Scalar>
void lower_product(Index m, Index n, const Scalar* l, Index ldl, Strided<Scalar> b, Scalar* c,
                   Index crs, Index ccs, bool accumulate, Workspace<Scalar>& ws, int slot) {
  if (m <= 0 || n <= 0) return;
  ws.reserve(slot, std::max(m, n) * m);
  if (crs == 1 && (ccs != 1 || m >= n)) {
    gemm_acc_tri<kTriLowerA>(m, n, m, l, ldl, b.data, b.rs, b.cs, c, ccs, accumulate);
  } else {
    eigen_assert(ccs == 1);
    // Cᵀ = Bᵀ Lᵀ: column i of Cᵀ sums over p <= i.
    const Strided<Scalar> bt =
        column_contiguous(Strided<Scalar>{b.data, b.cs, b.rs}, n, m, ws, slot);
    gemm_acc_tri<kTriUpperB>(n, m, m, bt.data, bt.cs, l, ldl, 1, c, crs, accumulate);
  }
}

// S (F x M) += Φ B and z += Φ 1 for the b tokens of a token-major F x b block Φ (column t:
// token t's features, at pkt + t·ldk) and their values B (b x M). S is memory of either storage
// order (a workspace buffer, a LinearAttentionState's row-major sums).
template <class Scalar, class SMat, class ZVec>
void absorb_token_major(const Scalar* pkt, Index ldk, Index F, Index b, Strided<Scalar> v,
                        SMat& S, ZVec& z, Workspace<Scalar>& ws) {
  const Strided<Scalar> s = strided_of(S);
  product<Scalar>(F, S.cols(), b, {pkt, 1, ldk}, v, S.data(), s.rs, s.cs, /*accumulate=*/true,
                  ws, kSlotProductA);
  z.noalias() +=
      Eigen::Map<const Matrix<Scalar>, 0, Eigen::OuterStride<>>(pkt, F, b, Eigen::OuterStride<>(ldk))
          .rowwise()
          .sum();
}

// out (b x M) = PQ S for query features PQ (b x F) and a state S (F x M), both memory of either
// storage order; out any writable expression (memory with a unit stride is written in place,
// anything else through a buffer).
template <class Scalar, class SMat, class Out>
void read_product(Strided<Scalar> pq, Index b, Index F, const SMat& S, Out&& out,
                  Workspace<Scalar>& ws) {
  using Plain = std::decay_t<Out>;
  const Index M = S.cols();
  if (b == 0 || M == 0) return;
  const Strided<Scalar> s = strided_of(S);
  ws.reserve(kSlotProductB, b * M);
  if constexpr (is_direct_v<Plain>) {
    const Strided<Scalar> o = strided_of(out);
    if (o.rs == 1 || o.cs == 1) {
      product<Scalar>(b, M, F, pq, s, out.data(), o.rs, o.cs, false, ws, kSlotProductA);
      return;
    }
  }
  auto tmp = ws.matrix(kSlotProductB, b, M);
  product<Scalar>(b, M, F, pq, s, tmp.data(), 1, b, false, ws, kSlotProductA);
  out = tmp;
}

// Calls fill(o, rs, cs) to write the b x M block of rows dst (entry (t, j) at o[t·rs + j·cs],
// one of the strides 1) in place when dst is memory with a unit stride, else into a
// column-major buffer in slot `slot`, then copied.
template <class Dst, class Fill, class Scalar>
void write_rows(Dst&& dst, Workspace<Scalar>& ws, int slot, Fill&& fill) {
  using Plain = std::decay_t<Dst>;
  ws.reserve(slot, dst.rows() * dst.cols());
  if constexpr (is_direct_v<Plain>) {
    const Strided<Scalar> o = strided_of(dst);
    if (o.rs == 1 || o.cs == 1) {
      fill(dst.data(), o.rs, o.cs);
      return;
    }
  }
  auto tmp = ws.matrix(slot, dst.rows(), dst.cols());
  fill(tmp.data(), Index(1), dst.rows());
  dst = tmp;
}

// A chunk's output rows, out = φq S + A V, of the chunked forms: φq (b x F) and A (b x b, the
// scaled scores, lower triangular) column-major buffers, S the carried state, V the chunk's
// values; written in place or through slot `slot` (write_rows). Row i reads rows j <= i of V
// only (lower_product): causality holds for non-finite values too.
template <class PQ, class AMat, class SMat, class Scalar, class Out>
void write_chunk_rows(const PQ& pq, const AMat& A, const SMat& S, Strided<Scalar> vr, Out&& out,
                      Workspace<Scalar>& ws, int slot) {
  const Index b = pq.rows(), F = pq.cols(), M = S.cols();
  write_rows(std::forward<Out>(out), ws, slot, [&](Scalar* o, Index crs, Index ccs) {
    product<Scalar>(b, M, F, {pq.data(), 1, b}, strided_of(S), o, crs, ccs, false, ws,
                    kSlotProductA);
    lower_product<Scalar>(b, M, A.data(), b, vr, o, crs, ccs, true, ws, kSlotProductA);
  });
}

}  // namespace linattn::detail
