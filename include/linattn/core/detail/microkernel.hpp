/// \file core/detail/microkernel.hpp
/// \brief A register-blocked matrix-product kernel for the skinny shapes of linear attention
/// (internal): C += A·B with m, n of a head's F, M (16 … 256) and k a block of tokens or F.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <utility>

#include "../common.hpp"

namespace linattn::detail {

// Why not Eigen's GEMM for these products: at m, n ≤ 256 and k = 128 Eigen packs both operands
// on every call and its AVX-512 float kernel keeps 12 accumulators of a 48 x 4 tile, well below
// the FMA peak at these sizes, where this kernel comes close to it (bench_roofline,
// docs/benchmarks.md). The kernel below reads its operands
// where they are, in the layouts the attention kernels have anyway, and keeps an MR-packet x NR
// tile of C in registers for the whole k loop:
//   A: m x k, column-major (A(i, p) at a[i + p·lda]): the rows of the tile are contiguous.
//   B: k x n, any strides (B(p, j) at b[p·bk + j·bn]): read one scalar at a time, broadcast.
//   C: m x n, column-major (C(i, j) at c[i + j·ldc]).
// With A a token-major buffer of features and B the caller's values, in either storage order,
// no operand is copied or transposed. Instantiated once per scalar type: the kernels pass
// pointers and strides, not Eigen expressions, so that each caller's layout does not
// instantiate a GEMM of its own (compile time of every program that includes the library).
//
// Tile: NR columns and MR packets of rows, all NR·MR accumulators plus MR packets of A and one
// broadcast in registers: 32 vector registers (AVX-512) hold 4 x 6 (24 accumulators, 4 + 6
// loads per 24 FMAs), 16 registers (AVX, SSE, NEON without SVE) 2 x 6 (12 accumulators).
#if defined(__AVX512F__) || defined(__aarch64__)
inline constexpr int kMicroRegisters = 32;
#else
inline constexpr int kMicroRegisters = 16;
#endif
inline constexpr int kMicroRowPackets = kMicroRegisters >= 32 ? 4 : 2;
inline constexpr int kMicroCols = 6;

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // packet types as template arguments
#endif

// Calls f(I) for I = 0 … N-1, unrolled at every optimisation level: the tile's accumulators
// stay in registers only if every index into them is a constant. f is a lambda of an int marked
// LINATTN_DETAIL_UNROLLED, inlined at each call where I is a constant: one lambda per loop
// instead of one per index (a generic lambda of integral_constant), which would instantiate
// hundreds of functions over the tiles and cost every program compile time.
#if defined(__GNUC__)
#define LINATTN_DETAIL_UNROLLED __attribute__((always_inline))
#else
#define LINATTN_DETAIL_UNROLLED
#endif
template <class F, int... I>
EIGEN_ALWAYS_INLINE void unrolled(F&& f, std::integer_sequence<int, I...>) {
  (f(I), ...);
}
template <int N, class F>
EIGEN_ALWAYS_INLINE void unrolled(F&& f) {
  unrolled(std::forward<F>(f), std::make_integer_sequence<int, N>{});
}

// Which entries a product sums (the Tri argument of the kernels below): all of them, or only
// those of a lower-triangular factor, for the intra-chunk products of the causal kernels:
//   kTriNone:   C(i, j) = Σ_p A(i, p) B(p, j);
//   kTriLowerA: C(i, j) = Σ_{p<=i} A(i, p) B(p, j)   (A lower triangular, square);
//   kTriUpperB: C(i, j) = Σ_{p<=j} A(i, p) B(p, j)   (B upper triangular, square: Cᵀ = Bᵀ Aᵀ of
//               the lower-triangular product).
// The entries past the triangle are never read into a sum, not multiplied by zero: row p of the
// other operand (a later token's value, maybe NaN or inf) then cannot reach an earlier row,
// where 0 · NaN would be NaN. t0 is the index of the tile's first row (kTriLowerA) or column
// (kTriUpperB) in the triangle.
inline constexpr int kTriNone = 0;
inline constexpr int kTriLowerA = 1;
inline constexpr int kTriUpperB = 2;

// One MR-packet x NR tile: C(i0 … i0 + MR·P, j0 … j0 + nr) (+)= A(i0 …, 0 … k) B(0 … k, j0 …),
// nr ≤ NR. Columns past nr repeat column j0 + nr - 1 (valid memory; their sums are dropped),
// so that every tile runs the same unrolled code. Packet may be Scalar itself (rows one by one).
// With Tri, the steps p >= t0 (the tile's diagonal block; the caller stops k at its end) select
// the lanes inside the triangle: the same fused multiply-adds as without, on fewer entries.
template <class Packet, int MR, int NR, int Tri = kTriNone, class Scalar>
EIGEN_ALWAYS_INLINE void micro_tile(Index k, const Scalar* a, Index lda, const Scalar* b, Index bk,
                                    Index bn, Index nr, Scalar* c, Index ldc, bool accumulate,
                                    Index t0 = 0) {
  using namespace Eigen::internal;
  constexpr Index P = unpacket_traits<Packet>::size;
  const Scalar* bcol[NR];
  unrolled<NR>(
      [&](int j) LINATTN_DETAIL_UNROLLED { bcol[j] = b + std::min<Index>(j, nr - 1) * bn; });
  Packet acc[MR][NR];
  unrolled<MR>([&](int r) LINATTN_DETAIL_UNROLLED {
    unrolled<NR>([&](int j) LINATTN_DETAIL_UNROLLED { acc[r][j] = pset1<Packet>(Scalar(0)); });
  });
  const Index k_full = Tri == kTriNone ? k : std::min(k, t0);
  for (Index p = 0; p < k_full; ++p) {
    Packet av[MR];
    unrolled<MR>(
        [&](int r) LINATTN_DETAIL_UNROLLED { av[r] = ploadu<Packet>(a + p * lda + r * P); });
    const Index off = p * bk;
    unrolled<NR>([&](int j) LINATTN_DETAIL_UNROLLED {
      const Packet bv = pset1<Packet>(bcol[j][off]);
      unrolled<MR>(
          [&](int r) LINATTN_DETAIL_UNROLLED { acc[r][j] = pmadd(av[r], bv, acc[r][j]); });
    });
  }
  if constexpr (Tri == kTriLowerA) {
    // Lane l of row packet r is row t0 + r·P + l: it takes step p when p <= that row. A packet
    // takes a step whole or not at all but for the P - 1 steps inside its own diagonal, which
    // select per lane.
    [[maybe_unused]] const Packet lanes = plset<Packet>(Scalar(0));
    for (Index p = k_full; p < k; ++p) {
      Packet av[MR];
      int mode[MR];  // 0: no lane takes step p, 1: some, 2: all
      [[maybe_unused]] Packet mask[MR];
      unrolled<MR>([&](int r) LINATTN_DETAIL_UNROLLED {
        av[r] = ploadu<Packet>(a + p * lda + r * P);
        const Index first = p - t0 - Index(r) * P;  // the first lane that takes step p
        mode[r] = first <= 0 ? 2 : (first < P ? 1 : 0);
        if constexpr (P > 1)
          if (mode[r] == 1) mask[r] = pcmp_le(pset1<Packet>(Scalar(first)), lanes);
      });
      const Index off = p * bk;
      unrolled<NR>([&](int j) LINATTN_DETAIL_UNROLLED {
        const Packet bv = pset1<Packet>(bcol[j][off]);
        unrolled<MR>([&](int r) LINATTN_DETAIL_UNROLLED {
          if (mode[r] == 2) {
            acc[r][j] = pmadd(av[r], bv, acc[r][j]);
          } else if constexpr (P > 1) {
            if (mode[r] == 1) acc[r][j] = pselect(mask[r], pmadd(av[r], bv, acc[r][j]), acc[r][j]);
          }
        });
      });
    }
  } else if constexpr (Tri == kTriUpperB) {
    // Column j of the tile is column t0 + j: it takes step p when p <= t0 + j.
    for (Index p = k_full; p < k; ++p) {
      Packet av[MR];
      unrolled<MR>(
        [&](int r) LINATTN_DETAIL_UNROLLED { av[r] = ploadu<Packet>(a + p * lda + r * P); });
      const Index off = p * bk;
      unrolled<NR>([&](int j) LINATTN_DETAIL_UNROLLED {
        if (p - t0 > Index(j)) return;
        const Packet bv = pset1<Packet>(bcol[j][off]);
        unrolled<MR>(
          [&](int r) LINATTN_DETAIL_UNROLLED { acc[r][j] = pmadd(av[r], bv, acc[r][j]); });
      });
    }
  }
  unrolled<NR>([&](int j) LINATTN_DETAIL_UNROLLED {
    if (j < nr) {
      Scalar* cj = c + j * ldc;
      unrolled<MR>([&](int r) LINATTN_DETAIL_UNROLLED {
        Packet x = acc[r][j];
        if (accumulate) x = padd(x, ploadu<Packet>(cj + r * P));
        pstoreu(cj + r * P, x);
      });
    }
  });
}

// Rows [i0, i0 + MR·P) of C, every column; t0: row i0's index in the triangle (kTriLowerA).
template <class Packet, int MR, int Tri, class Scalar>
void micro_rows(Index n, Index k, const Scalar* a, Index lda, const Scalar* b, Index bk, Index bn,
                Scalar* c, Index ldc, bool accumulate, Index t0) {
  constexpr Index rows = MR * Eigen::internal::unpacket_traits<Packet>::size;
  for (Index j0 = 0; j0 < n; j0 += kMicroCols) {
    const Index nr = std::min<Index>(kMicroCols, n - j0);
    if constexpr (Tri == kTriLowerA)
      micro_tile<Packet, MR, kMicroCols, Tri>(std::min(k, t0 + rows), a, lda, b + j0 * bn, bk, bn,
                                              nr, c + j0 * ldc, ldc, accumulate, t0);
    else if constexpr (Tri == kTriUpperB)
      micro_tile<Packet, MR, kMicroCols, Tri>(std::min(k, j0 + nr), a, lda, b + j0 * bn, bk, bn, nr,
                                              c + j0 * ldc, ldc, accumulate, j0);
    else
      micro_tile<Packet, MR, kMicroCols>(k, a, lda, b + j0 * bn, bk, bn, nr, c + j0 * ldc, ldc,
                                         accumulate);
  }
}

// Rows [0, m) of C with packets of type Packet, then the rest with half packets, down to
// scalars: an odd F (65 for NormalizedCosine at D = 64) or a small one costs a few narrow tiles.
template <class Packet, int Tri, class Scalar>
void micro_edge_rows(Index m, Index n, Index k, const Scalar* a, Index lda, const Scalar* b,
                     Index bk, Index bn, Scalar* c, Index ldc, bool accumulate, Index t0) {
  using namespace Eigen::internal;
  constexpr Index P = unpacket_traits<Packet>::size;
  Index i = 0;
  if constexpr (P > 1) {
    for (; i + P <= m; i += P)
      micro_rows<Packet, 1, Tri>(n, k, a + i, lda, b, bk, bn, c + i, ldc, accumulate, t0 + i);
    using Half = typename unpacket_traits<Packet>::half;
    if constexpr (unpacket_traits<Half>::size < P) {
      micro_edge_rows<Half, Tri>(m - i, n, k, a + i, lda, b, bk, bn, c + i, ldc, accumulate,
                                 t0 + i);
      return;
    }
  }
  for (; i < m; ++i)
    micro_rows<Scalar, 1, Tri>(n, k, a + i, lda, b, bk, bn, c + i, ldc, accumulate, t0 + i);
}

/// C = A·B (accumulate = false) or C += A·B (true), in the layouts described above. m, n or k
/// may be 0 (with k = 0, C = 0 or unchanged). Each entry is the sum over p = 0 … k-1 in order,
/// from 0, then added to C: the same shape gives the same bits whatever the strides (a head of a
/// packed buffer and a single-head call agree exactly). Rows past the last full packet go
/// through narrower packets or scalars, where the compiler decides whether a·b + c is fused.
/// gemm_acc_tri<Tri> (kTriLowerA: m = k, kTriUpperB: n = k) sums only the triangle's terms, in the
/// same order: the full product's bits when the entries outside it are 0 and the other operand is
/// finite.
template <int Tri, class Scalar>
void gemm_acc_tri(Index m, Index n, Index k, const Scalar* a, Index lda, const Scalar* b, Index bk,
                  Index bn, Scalar* c, Index ldc, bool accumulate) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  constexpr Index P = unpacket_traits<Packet>::size;
  if (m <= 0 || n <= 0) return;
  Index i = 0;
  if constexpr (P > 1) {
    constexpr Index MRP = kMicroRowPackets * P;
    for (; i + MRP <= m; i += MRP)
      micro_rows<Packet, kMicroRowPackets, Tri>(n, k, a + i, lda, b, bk, bn, c + i, ldc, accumulate,
                                                i);
    if constexpr (kMicroRowPackets > 2) {
      for (; i + 2 * P <= m; i += 2 * P)
        micro_rows<Packet, 2, Tri>(n, k, a + i, lda, b, bk, bn, c + i, ldc, accumulate, i);
    }
  }
  micro_edge_rows<Packet, Tri>(m - i, n, k, a + i, lda, b, bk, bn, c + i, ldc, accumulate, i);
}

template <class Scalar>
void gemm_acc(Index m, Index n, Index k, const Scalar* a, Index lda, const Scalar* b, Index bk,
              Index bn, Scalar* c, Index ldc, bool accumulate) {
  gemm_acc_tri<kTriNone>(m, n, k, a, lda, b, bk, bn, c, ldc, accumulate);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace linattn::detail
