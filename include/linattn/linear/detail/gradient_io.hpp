/// \file linear/detail/gradient_io.hpp
/// \brief How the backward kernels move blocks of rows between the caller's memory and their
/// contiguous buffers: prefetched gathers, streamed or prefetched scatters, token-major maps.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#if defined(__SSE2__)
#include <immintrin.h>  // streaming stores (stream_runs)
#endif

#include "../../core/common.hpp"
#include "../../maps/feature_map.hpp"
#include "../../core/state.hpp"  // NoMask
#include "../../core/detail/blocking.hpp"

namespace linattn {
namespace detail {

// Whether x is column-major memory with unit inner stride (a block of the caller's matrix, or
// the columns of one head of a packed column-major N x (H·D) buffer).
template <class X>
inline constexpr bool is_col_major_memory_v =
    !bool(std::decay_t<X>::IsRowMajor) && (int(std::decay_t<X>::Flags) & Eigen::DirectAccessBit);

// Rows [r0, r0 + b) of x (n columns) into the contiguous column-major b x n buffer `buf`. For
// column-major memory, one column at a time, each a few columns ahead asked into L1: a block is
// n runs of b values one leading dimension apart, and with a power-of-two leading dimension
// (N = 16384 floats) all of them fall into the same few sets of L1 and L2, so that neither the
// hardware prefetchers nor a prefetch of the whole next block can keep them. Any other x is
// copied by Eigen.
template <class X>
void gather_rows(const X& x, Index r0, Index b, typename X::Scalar* buf) {
  using Scalar = typename X::Scalar;
  const Index n = x.cols();
  if constexpr (is_col_major_memory_v<X>) {
    if (x.innerStride() == 1 && b > 0) {
      const Scalar* src = x.data() + r0;
      const Index ld = x.outerStride();
#if defined(__GNUC__) || defined(__clang__)
      constexpr Index line = 64 / Index(sizeof(Scalar));
      constexpr Index ahead = 4, far = 16;  // columns, into L1 and into L2
      const auto ask = [&](Index c, auto level) {
        const Scalar* p = src + c * ld;
        for (Index r = 0; r < b; r += line) __builtin_prefetch(p + r, 0, decltype(level)::value);
        __builtin_prefetch(p + b - 1, 0, decltype(level)::value);
      };
      using L1 = std::integral_constant<int, 3>;
      using L2 = std::integral_constant<int, 2>;
      for (Index c = ahead; c < std::min(far, n); ++c) ask(c, L2{});
      for (Index c = 0; c < std::min(ahead, n); ++c) ask(c, L1{});
#endif
      for (Index c = 0; c < n; ++c) {
#if defined(__GNUC__) || defined(__clang__)
        if (c + far < n) ask(c + far, L2{});
        if (c + ahead < n) ask(c + ahead, L1{});
#endif
        Eigen::Map<Vector<Scalar>>(buf + c * b, b) =
            Eigen::Map<const Vector<Scalar>>(src + c * ld, b);
      }
      return;
    }
  }
  Eigen::Map<Matrix<Scalar>>(buf, b, n) = x.middleRows(r0, b);
}

// Rows [r0, r0 + b) of x, row-major memory with unit inner stride, into the contiguous
// row-major b x n buffer `buf` (token-major), one row at a time with the rows a few ahead
// asked into L1: a head's columns of a packed row-major N x (H·D) buffer are runs of D values
// H·D apart, which the hardware prefetchers do not follow.
template <class X>
void gather_rows_row_major(const X& x, Index r0, Index b, typename X::Scalar* buf) {
  using Scalar = typename X::Scalar;
  const Index n = x.cols();
  const Scalar* src = x.data() + r0 * x.outerStride();
  const Index ld = x.outerStride();
#if defined(__GNUC__) || defined(__clang__)
  constexpr Index line = 64 / Index(sizeof(Scalar));
  constexpr Index ahead = 8, far = 32;  // rows, into L1 and into L2
  const auto ask = [&](Index r, auto level) {
    const Scalar* p = src + r * ld;
    for (Index c = 0; c < n; c += line) __builtin_prefetch(p + c, 0, decltype(level)::value);
    __builtin_prefetch(p + n - 1, 0, decltype(level)::value);
  };
  using L1 = std::integral_constant<int, 3>;
  using L2 = std::integral_constant<int, 2>;
  for (Index r = ahead; r < std::min(far, b); ++r) ask(r, L2{});
  for (Index r = 0; r < std::min(ahead, b); ++r) ask(r, L1{});
#endif
  for (Index r = 0; r < b; ++r) {
#if defined(__GNUC__) || defined(__clang__)
    if (r + far < b) ask(r + far, L2{});
    if (r + ahead < b) ask(r + ahead, L1{});
#endif
    Eigen::Map<Vector<Scalar>>(buf + r * n, n) = Eigen::Map<const Vector<Scalar>>(src + r * ld, n);
  }
}

// The gradients a backward kernel scatters into the caller's memory are written with
// non-temporal (streaming) stores when they span at least this many bytes: they are final, or
// (Ĝ in dV) read back only by the other sweep, so caching them only evicts the inputs, and every
// cached write first reads its line from memory (bench_backward).
inline constexpr Index kStreamMinBytes = Index(2) << 20;

#if defined(__SSE2__)
// One 64-byte line from s to the 64-byte aligned d, bypassing the caches.
#if defined(__AVX512F__)
inline void stream_line(float* d, const float* s) { _mm512_stream_ps(d, _mm512_loadu_ps(s)); }
inline void stream_line(double* d, const double* s) { _mm512_stream_pd(d, _mm512_loadu_pd(s)); }
#elif defined(__AVX__)
inline void stream_line(float* d, const float* s) {
  for (int i = 0; i < 16; i += 8) _mm256_stream_ps(d + i, _mm256_loadu_ps(s + i));
}
inline void stream_line(double* d, const double* s) {
  for (int i = 0; i < 8; i += 4) _mm256_stream_pd(d + i, _mm256_loadu_pd(s + i));
}
#else
inline void stream_line(float* d, const float* s) {
  for (int i = 0; i < 16; i += 4) _mm_stream_ps(d + i, _mm_loadu_ps(s + i));
}
inline void stream_line(double* d, const double* s) {
  for (int i = 0; i < 8; i += 2) _mm_stream_pd(d + i, _mm_loadu_pd(s + i));
}
#endif
#endif

// scatter_runs() with streaming stores, when every run is whole aligned cache lines (false:
// nothing written, the caller copies). The fence orders the streamed lines before any later
// store (another thread reads them after the parallel region's barrier).
template <class Scalar>
bool stream_runs(const Scalar* buf, Index runs, Index len, Scalar* dst, Index ld) {
#if defined(__SSE2__)
  if constexpr (std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>) {
    constexpr Index line = 64 / Index(sizeof(Scalar));
    if (len % line != 0 || ld % line != 0 || reinterpret_cast<std::uintptr_t>(dst) % 64 != 0)
      return false;
    for (Index i = 0; i < runs; ++i)
      for (Index c = 0; c < len; c += line) stream_line(dst + i * ld + c, buf + i * len + c);
    _mm_sfence();
    return true;
  }
#endif
  (void)buf, (void)runs, (void)len, (void)dst, (void)ld;
  return false;
}

// `runs` runs of `len` contiguous values, packed in `buf`, into dst (run i at dst + i·ld):
// streamed when `stream` allows (see kStreamMinBytes), else with the runs `ahead` further on
// asked for writing: the caller's rows or columns are far apart, and with a power-of-two
// leading dimension they share a few cache sets, which the hardware prefetchers do not follow.
template <class Scalar>
void scatter_runs(const Scalar* buf, Index runs, Index len, Scalar* dst, Index ld,
                  Index ahead, bool stream) {
  if (stream && stream_runs(buf, runs, len, dst, ld)) return;
#if defined(__GNUC__) || defined(__clang__)
  constexpr Index line = 64 / Index(sizeof(Scalar));
  const auto ask = [&](Index i) {
    Scalar* p = dst + i * ld;
    for (Index c = 0; c < len; c += line) __builtin_prefetch(p + c, 1, 3);
    __builtin_prefetch(p + len - 1, 1, 3);
  };
  for (Index i = 0; i < std::min(ahead, runs); ++i) ask(i);
#endif
  for (Index i = 0; i < runs; ++i) {
#if defined(__GNUC__) || defined(__clang__)
    if (i + ahead < runs) ask(i + ahead);
#endif
    Eigen::Map<Vector<Scalar>>(dst + i * ld, len) =
        Eigen::Map<const Vector<Scalar>>(buf + i * len, len);
  }
}

// Whether the gradient x (all its rows) is large enough to be streamed (kStreamMinBytes).
template <class X>
bool streams_gradient(const X& x) {
  return x.rows() * x.cols() * Index(sizeof(typename X::Scalar)) >= kStreamMinBytes;
}

// The row-major b x n buffer `buf` into rows [r0, r0 + b) of x, row-major memory with unit
// inner stride (the mirror of gather_rows_row_major), eight rows ahead.
template <class X, class Scalar>
void scatter_rows(const Scalar* buf, Index r0, Index b, X& x) {
  scatter_runs(buf, b, x.cols(), x.data() + r0 * x.outerStride(), x.outerStride(), 8,
               streams_gradient(x));
}

// The contiguous column-major b x n buffer `buf` into rows [r0, r0 + b) of x, column-major
// memory with unit inner stride: one column at a time, four columns ahead (the mirror of
// gather_rows).
template <class X, class Scalar>
void scatter_columns(const Scalar* buf, Index r0, Index b, X& x) {
  scatter_runs(buf, x.cols(), b, x.data() + r0, x.outerStride(), 4, streams_gradient(x));
}

// The token-major src (F x b, column t = token t, i.e. a row-major b x n buffer) into rows
// [r0, r0 + b) of the writable x (n columns). Column-major memory: transposed with packets into
// the contiguous `tmp` (b x n), then written by scatter_columns (a packet transpose straight
// into the caller's columns writes n runs that share a few cache sets). Anything else:
// copy_from_row_major.
template <class X, class Scalar>
void scatter_token_major(const Scalar* src, Index r0, Index b, X& x, Scalar* tmp) {
  const Index n = x.cols();
  if constexpr (is_col_major_memory_v<X>) {
    if (x.innerStride() == 1 && b > 0) {
      transpose_copy(src, n, n, b, tmp, b);
      scatter_columns(tmp, r0, b, x);
      return;
    }
  } else if constexpr (is_row_major_memory_v<X>) {
    if (x.innerStride() == 1 && b > 0) {
      scatter_rows(src, r0, b, x);
      return;
    }
  }
  copy_from_row_major(src, b, n, x.middleRows(r0, b));
}

// φ of rows [r0, r0 + b) of x into the token-major pt (F x b): column-major memory is gathered
// first (gather_rows, into `copy`, b x D), then mapped and transposed in cache.
template <class Phi, class X, class Pt, class Scalar, class Side>
void map_rows_token_major(const Phi& phi, const X& x, Index r0, Index b, Pt& pt,
                          Eigen::Map<Matrix<Scalar>> copy, Eigen::Map<Matrix<Scalar>> scratch,
                          Side side) {
  if constexpr (is_col_major_memory_v<X>) {
    if (x.innerStride() == 1) {
      gather_rows(x, r0, b, copy.data());
      map_token_major(phi, copy, pt, scratch, side);
      return;
    }
  } else if constexpr (is_row_major_memory_v<X>) {
    using RowMajor = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    if (x.innerStride() == 1) {
      gather_rows_row_major(x, r0, b, copy.data());
      map_token_major(phi, Eigen::Map<const RowMajor>(copy.data(), b, x.cols()), pt, scratch,
                      side);
      return;
    }
  }
  map_token_major(phi, x.middleRows(r0, b), pt, scratch, side);
}

// Rows [r0, r0 + b) of x (b x n), each scaled by scale[t] when scale is not null, into the
// contiguous buffer `buf` in x's own storage order (a plain copy, no transpose), for a
// recurrent pass that reads them by broadcast. Returns buf's token and feature strides (1 and b
// column-major, n and 1 row-major). Rows with keep(r0 + t) == false are zeroed (not skipped:
// 0 * inf in a masked row would poison a state).
template <class X, class Keep>
std::pair<Index, Index> copy_broadcast_rows(const X& x, Index r0, Index b, const Keep& keep,
                                            const typename X::Scalar* scale,
                                            typename X::Scalar* buf) {
  using Scalar = typename X::Scalar;
  constexpr bool row_major = bool(std::decay_t<X>::IsRowMajor);
  using Buf = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic,
                            row_major ? Eigen::RowMajor : Eigen::ColMajor>;
  const Index n = x.cols();
  Eigen::Map<Buf> dst(buf, b, n);
  if constexpr (!row_major) {
    gather_rows(x, r0, b, buf);
    if (scale != nullptr) dst = Eigen::Map<const Vector<Scalar>>(scale, b).asDiagonal() * dst;
  } else {
    bool gathered = false;
    if constexpr (is_row_major_memory_v<X>) {
      if (x.innerStride() == 1) {
        gather_rows_row_major(x, r0, b, buf);
        if (scale != nullptr) dst = Eigen::Map<const Vector<Scalar>>(scale, b).asDiagonal() * dst;
        gathered = true;
      }
    }
    if (gathered) {
    } else if (scale != nullptr) {
      dst.noalias() = Eigen::Map<const Vector<Scalar>>(scale, b).asDiagonal() * x.middleRows(r0, b);
    } else {
      dst = x.middleRows(r0, b);
    }
  }
  if constexpr (!std::is_same_v<Keep, NoMask>)
    for (Index t = 0; t < b; ++t)
      if (!keep(r0 + t)) dst.row(t).setZero();
  return row_major ? std::pair<Index, Index>(n, 1) : std::pair<Index, Index>(1, b);
}

}  // namespace detail
}  // namespace linattn
