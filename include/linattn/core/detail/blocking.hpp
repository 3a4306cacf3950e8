/// \file core/detail/blocking.hpp
/// \brief Block sizes and small helpers shared by the kernels (internal).
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "../common.hpp"
#include "../tuning.hpp"

namespace linattn::detail {

// Workspace slots, so that kernels sharing a Workspace do not fight over a buffer.
enum Slot : int {
  kSlotPhiQ = 0,
  kSlotPhiK = 1,
  kSlotState = 2,
  kSlotNormalizer = 3,
  kSlotScores = 4,
  kSlotRowA = 5,
  kSlotRowB = 6,
  kSlotExtra = 7,
  kSlotPrefix = 8,
  kSlotKeys = 9,
  kSlotStateLow = 10,
  kSlotNormalizerLow = 11,
  kSlotBackwardX = 12,  // a column-major copy of row-major inputs for a map's backward
  kSlotBackwardA = 13,  // the recurrent causal backward's token-major buffers and state
  kSlotBackwardB = 14,
  kSlotBackwardC = 15,
  kSlotProductA = 16,  // the state products' (products.hpp) copies: token-major features,
  kSlotProductB = 17,  // a transposed state, values not readable in place
  kSlotSharedQ = 18,   // a value head's dQ and dK when it shares its query/key head (GVA),
  kSlotSharedK = 19,   // added into the shared head's gradients after the head's backward
};

// dst(c, r) = src(r, c) for a rows x cols column-major src (leading dimension src_ld) into a
// column-major dst (leading dimension dst_ld), through P x P register transposes. Eigen's own
// transposed copy is scalar and walks one side with a stride; with a power-of-two leading
// dimension (a 4096-row sequence) every such access falls into the same L1 set.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // packet types as template arguments
#endif
template <class Scalar>
void transpose_copy(const Scalar* src, Index src_ld, Index rows, Index cols, Scalar* dst,
                    Index dst_ld) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  constexpr int P = packet_traits<Scalar>::size;
  Index r_end = 0, c_end = 0;
  if constexpr (P > 1) {
    r_end = rows / P * P;
    c_end = cols / P * P;
    const auto block = [&](Index r0, Index c0) {
      PacketBlock<Packet, P> b;
      for (int k = 0; k < P; ++k) b.packet[k] = ploadu<Packet>(src + r0 + (c0 + k) * src_ld);
      ptranspose(b);
      for (int k = 0; k < P; ++k) pstoreu(dst + c0 + (r0 + k) * dst_ld, b.packet[k]);
    };
    // Walk down the columns of the side with the larger leading dimension (the caller's
    // matrix, against a small buffer), so that it touches P cache lines at a time and uses
    // each line whole before moving on. The other order touches one line per column at once,
    // and with a power-of-two leading dimension all of them share one L1 set.
    if (src_ld >= dst_ld) {
      for (Index c0 = 0; c0 < c_end; c0 += P)
        for (Index r0 = 0; r0 < r_end; r0 += P) block(r0, c0);
    } else {
      for (Index r0 = 0; r0 < r_end; r0 += P)
        for (Index c0 = 0; c0 < c_end; c0 += P) block(r0, c0);
    }
  }
  for (Index c = 0; c < cols; ++c)  // the right-hand and bottom edges
    for (Index r = (c < c_end ? r_end : 0); r < rows; ++r) dst[c + r * dst_ld] = src[r + c * src_ld];
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// Asks for rows [start, start + n) of x to be brought into the cache ahead of use, when x is
// row-major memory with unit inner stride and rows further apart than their length. A head's
// columns of a packed row-major N x (H·D) buffer are short runs (D values) far apart, often
// one or two per 4 KiB page, which the hardware prefetchers do not follow; the non-causal
// kernel calls this for its next block of rows while it works on the current one
// (bench_multihead). Anything else is left to the hardware. No block of
// x is formed unless there is memory to point into (x may be a Map of no memory when a
// dimension is 0).
template <class X>
void prefetch_rows(const X& x, Index start, Index n) {
  using Plain = std::decay_t<X>;
  if constexpr ((int(Plain::Flags) & Eigen::DirectAccessBit) && bool(Plain::IsRowMajor)) {
#if defined(__GNUC__) || defined(__clang__)
    using Scalar = typename Plain::Scalar;
    if (n <= 0 || x.cols() == 0 || x.innerStride() != 1 || x.outerStride() == x.cols()) return;
    constexpr Index line = 64 / Index(sizeof(Scalar));
    const Scalar* p = x.data() + start * x.outerStride();
    for (Index r = 0; r < n; ++r, p += x.outerStride())
      for (Index c = 0; c < x.cols(); c += line) __builtin_prefetch(p + c, 0, 2);
#endif
  } else {
    (void)x, (void)start, (void)n;
  }
}

// Copies an expression into a row-major buffer (b x n, leading dimension n), transposing
// with packets when the source is column-major memory with unit inner stride.
template <class Src, class Scalar>
void copy_to_row_major(const Src& src, Scalar* dst) {
  using Plain = std::decay_t<Src>;
  if constexpr ((int(Plain::Flags) & Eigen::DirectAccessBit) && !Plain::IsRowMajor) {
    if (src.innerStride() == 1) {
      transpose_copy(src.data(), src.outerStride(), src.rows(), src.cols(), dst, src.cols());
      return;
    }
  }
  using RowMajor = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::Map<RowMajor>(dst, src.rows(), src.cols()) = src;
}

// The reverse: a row-major buffer (b x n) into any writable expression.
template <class Scalar, class Dst>
void copy_from_row_major(const Scalar* src, Index rows, Index cols, Dst&& dst) {
  using Plain = std::decay_t<Dst>;
  if constexpr ((int(Plain::Flags) & Eigen::DirectAccessBit) && !Plain::IsRowMajor) {
    if (dst.innerStride() == 1) {
      transpose_copy(src, cols, cols, rows, dst.data(), dst.outerStride());
      return;
    }
  }
  using RowMajor = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  dst = Eigen::Map<const RowMajor>(src, rows, cols);
}

// A denominator den = φ(q)·z whose terms have total magnitude scale = |φ(q)|·|z| is rounding
// noise when den <= 4·F·u·scale (u the unit roundoff): that happens only when the similarities
// cancel, as for NormalizedCosine when every key is (numerically) opposite the query, where the
// exact value is 0. Such a denominator is treated as 0 (the row is then 0), like a zero one.
template <class Scalar>
Scalar cancellation_threshold(Index F) {
  return Scalar(4) * Scalar(F) * std::numeric_limits<Scalar>::epsilon() / 2;
}

// den_i <- guarded_inverse(den_i): the one guard every algorithm shares (common.hpp). Kernels
// scale the rows of φ(Q) (small and contiguous) by it before the GEMM instead of dividing output
// rows, which are strided in the caller's column-major output.
template <class Den>
void invert_guarded(Den&& den) {
  using S = typename std::decay_t<Den>::Scalar;
  auto a = den.array();
  a = (a >= denominator_epsilon<S>()).select(a.inverse(), S(0));
}

}  // namespace linattn::detail
