/// \file core/detail/state_ops.hpp
/// \brief The map-free kernels of a state (internal): the fused rank-1 step, key masks, the
/// thread's zero state of a batched call.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "../common.hpp"
#include "../workspace.hpp"
#include "blocking.hpp"
#include "fast_exp.hpp"
#include "low_precision.hpp"
#include "products.hpp"

namespace linattn {

template <class Scalar>
struct LinearAttentionState;

namespace detail {

// hi + lo -> (hi, lo) with hi = fl(hi + lo) and lo the exact rounding error (Knuth's TwoSum:
// branch-free and exact whatever the magnitudes, unlike Fast2Sum), over n contiguous entries.
// Must not be compiled with -ffast-math (which would simplify the error term to 0).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // packet types as template arguments
#endif
template <class Scalar>
void two_sum_fold(Scalar* hi, Scalar* lo, Index n) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  constexpr Index P = packet_traits<Scalar>::size;
  Index i = 0;
  // In packets, two at a time (the six dependent adds of one entry hide each other's latency);
  // the same operations on every entry as the scalar tail, so the result is the same bit for bit.
  if constexpr (P > 1) {
    const auto fold = [&](Index j) {
      const Packet h = ploadu<Packet>(hi + j), l = ploadu<Packet>(lo + j);
      const Packet s = padd(h, l), bb = psub(s, h);
      pstoreu(lo + j, padd(psub(h, psub(s, bb)), psub(l, bb)));
      pstoreu(hi + j, s);
    };
    for (; i + 2 * P <= n; i += 2 * P) {
      fold(i);
      fold(i + P);
    }
    for (; i + P <= n; i += P) fold(i);
  }
  for (; i < n; ++i) {
    const Scalar h = hi[i], l = lo[i];
    const Scalar s = h + l, bb = s - h;
    lo[i] = (h - (s - bb)) + (l - bb);
    hi[i] = s;
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// Folds the low parts of a state's sums into the high parts (see LinearAttentionState).
template <class SMat, class ZVec>
void fold_state(SMat& S, SMat& S_lo, ZVec& z, ZVec& z_lo) {
  eigen_assert(S.size() == S_lo.size() && z.size() == z_lo.size());
  two_sum_fold(S.data(), S_lo.data(), S.size());
  two_sum_fold(z.data(), z_lo.data(), z.size());
}

// Per-feature key softmax: raises the running maxima m to at least `new_max`, rescaling the
// shifted S and z so that diag(e^m) S is unchanged. m = -inf (no key yet) rescales by 0.
template <class SMat, class ZVec, class MVec, class NewMax>
void raise_maxima(SMat& S, SMat& S_lo, ZVec& z, ZVec& z_lo, MVec& m, const NewMax& new_max) {
  using Scalar = typename ZVec::Scalar;
  for (Index d = 0; d < m.size(); ++d) {
    if (new_max(d) > m(d)) {
      const Scalar c = std::exp(m(d) - new_max(d));
      if (S.cols() > 0) {  // M = 0: S may be a Map of no memory, whose rows must not be formed
        S.row(d) *= c;
        S_lo.row(d) *= c;
      }
      z(d) *= c;
      z_lo(d) *= c;
      m(d) = new_max(d);
    }
  }
}


#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // packet types as template arguments
#endif
// For every row d of the row-major state (F x M, leading dimension ld), high part `hi` and
// low part `lo`:
//   lo(d, :) += pk(d) v   and   o += w(d) (hi(d, :) + lo(d, :)),
// in one pass, 4 packets of columns at a time with the outputs in registers: no horizontal
// sums. This is the whole cost of a recurrent step (5·F·M flops), bound by the stores to lo,
// which stays in L1 for F·M up to several thousand; the loads and adds of hi come almost for
// free. The token goes into the low part so that it is not rounded away against a large sum
// (see LinearAttentionState). All pointers are contiguous.
template <class Scalar>
void fused_rank1_update_read(const Scalar* hi, Scalar* lo, Index ld, Index F, Index M,
                             const Scalar* pk, const Scalar* w, const Scalar* v, Scalar* o) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  constexpr Index P = packet_traits<Scalar>::size;
  Index c0 = 0;
  if constexpr (P > 1) {
    for (; c0 + 4 * P <= M; c0 += 4 * P) {
      const Packet v0 = ploadu<Packet>(v + c0), v1 = ploadu<Packet>(v + c0 + P),
                   v2 = ploadu<Packet>(v + c0 + 2 * P), v3 = ploadu<Packet>(v + c0 + 3 * P);
      Packet o0 = pset1<Packet>(Scalar(0)), o1 = o0, o2 = o0, o3 = o0;
      for (Index d = 0; d < F; ++d) {
        Scalar* row = lo + d * ld + c0;
        const Scalar* hrow = hi + d * ld + c0;
        const Packet kd = pset1<Packet>(pk[d]), wd = pset1<Packet>(w[d]);
        const Packet x0 = pmadd(kd, v0, ploadu<Packet>(row));
        const Packet x1 = pmadd(kd, v1, ploadu<Packet>(row + P));
        const Packet x2 = pmadd(kd, v2, ploadu<Packet>(row + 2 * P));
        const Packet x3 = pmadd(kd, v3, ploadu<Packet>(row + 3 * P));
        pstoreu(row, x0);
        pstoreu(row + P, x1);
        pstoreu(row + 2 * P, x2);
        pstoreu(row + 3 * P, x3);
        o0 = pmadd(wd, padd(x0, ploadu<Packet>(hrow)), o0);
        o1 = pmadd(wd, padd(x1, ploadu<Packet>(hrow + P)), o1);
        o2 = pmadd(wd, padd(x2, ploadu<Packet>(hrow + 2 * P)), o2);
        o3 = pmadd(wd, padd(x3, ploadu<Packet>(hrow + 3 * P)), o3);
      }
      pstoreu(o + c0, o0);
      pstoreu(o + c0 + P, o1);
      pstoreu(o + c0 + 2 * P, o2);
      pstoreu(o + c0 + 3 * P, o3);
    }
    for (; c0 + P <= M; c0 += P) {
      const Packet v0 = ploadu<Packet>(v + c0);
      Packet o0 = pset1<Packet>(Scalar(0));
      for (Index d = 0; d < F; ++d) {
        Scalar* row = lo + d * ld + c0;
        const Packet x0 = pmadd(pset1<Packet>(pk[d]), v0, ploadu<Packet>(row));
        pstoreu(row, x0);
        o0 = pmadd(pset1<Packet>(w[d]), padd(x0, ploadu<Packet>(hi + d * ld + c0)), o0);
      }
      pstoreu(o + c0, o0);
    }
  }
  for (; c0 < M; ++c0) {
    Scalar acc = 0;
    for (Index d = 0; d < F; ++d) {
      Scalar& x = lo[d * ld + c0];
      x += pk[d] * v[c0];
      acc += w[d] * (x + hi[d * ld + c0]);
    }
    o[c0] = acc;
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// No key is masked.
struct NoMask {
  bool operator()(Index) const noexcept { return true; }
};

// A key padding mask read in place, whatever its Eigen type (bool or integer entries, a vector,
// Map or block): keep(j) is whether key j takes part. One type for every mask and entry point,
// so that each masked kernel is instantiated once per map and scalar, not once per mask type
// and per calling function (each instantiation is seconds of compile time in every program
// that uses it); the indirect call per key is nothing next to the key's F·M work.
class KeyMask {
 public:
  template <class D>
  explicit KeyMask(const D& mask) noexcept : object_(&mask), read_(&read<D>) {}
  bool operator()(Index j) const { return read_(object_, offset_ + j); }
  // The mask of keys [a, ...): still a KeyMask, so that a segment of a sequence (a head's rows,
  // a thread's share) runs the kernel instantiated for the whole.
  KeyMask shifted(Index a) const noexcept {
    KeyMask m = *this;
    m.offset_ += a;
    return m;
  }

 private:
  template <class D>
  static bool read(const void* mask, Index j) {
    return bool((*static_cast<const D*>(mask))(j));
  }
  const void* object_;
  bool (*read_)(const void*, Index);
  Index offset_ = 0;
};

// The values x of keys [r0, r0 + rows) as the products read them (strided_rows()), with the
// rows of masked keys (keep(r0 + t) false) 0 in a row-major copy in slot `slot`, made when the
// block has one. A masked key's weight is 0, but padding often holds NaN or inf and 0 · NaN is
// NaN: its value is selected away, never multiplied.
template <class X, class Keep, class Scalar = typename std::decay_t<X>::Scalar>
Strided<Scalar> kept_value_rows(const X& x, Index r0, const Keep& keep, Workspace<Scalar>& ws,
                                int slot) {
  if constexpr (!std::is_same_v<Keep, NoMask>) {
    const Index rows = x.rows(), cols = x.cols();
    Index t = 0;
    while (t < rows && keep(r0 + t)) ++t;
    if (t < rows) {
      ws.reserve(slot, rows * cols);
      Scalar* buf = ws.matrix(slot, rows, cols).data();
      copy_to_row_major(x, buf);
      for (; t < rows; ++t)
        if (!keep(r0 + t)) std::fill(buf + t * cols, buf + (t + 1) * cols, Scalar(0));
      return {buf, cols, 1};
    }
  }
  return strided_rows(x, ws, slot);
}

// A zero state of F x M (a log-decay record of gw zeros) for a kernel call that carries none: the
// thread's own, reused by the gated and delta-rule kernels.
template <class Scalar>
void zero_gated_state(LinearAttentionState<Scalar>& st, Index F, Index M, Index gw) {
  if (st.S.rows() == F && st.S.cols() == M && st.m.size() == 0 && st.S_lo.size() == F * M &&
      st.z_lo.size() == F) {
    st.reset();
  } else {
    st = LinearAttentionState<Scalar>(F, M);
  }
  st.log_decay.setZero(gw);
}

// Task t's state in a batched gated or delta-rule call: the caller's states[t], or the thread's
// own state of the multi-head workspace ws, zeroed (log-decay record of gw entries).
template <class Scalar, class MultiHeadWS>
LinearAttentionState<Scalar>& task_state(std::vector<LinearAttentionState<Scalar>>* states,
                                         Index t, MultiHeadWS& ws, int thread, Index F, Index M,
                                         Index gw) {
  if (states) return (*states)[static_cast<std::size_t>(t)];
  LinearAttentionState<Scalar>& st = ws.state_for_thread(thread);
  zero_gated_state(st, F, M, gw);
  return st;
}

// a becomes the state of a's keys followed by b's, for states of one shape with sized low
// parts; b serves as scratch (rescaled to the common maxima, then holding the rounding errors
// of the high parts' sum). Allocates nothing: the kernels that split a sequence over threads
// merge copies of their segments' states with it.
template <class Scalar>
void merge_into(LinearAttentionState<Scalar>& a, LinearAttentionState<Scalar>& b) {
  if (a.m.size() > 0) {  // per-feature maxima: both sides to the larger one
    raise_maxima(a.S, a.S_lo, a.z, a.z_lo, a.m, b.m);  // a.m becomes max(a.m, b.m)
    raise_maxima(b.S, b.S_lo, b.z, b.z_lo, b.m, a.m);
  }
  a.S_lo += b.S_lo;
  a.z_lo += b.z_lo;
  // a.S = fl(a.S + b.S), and b.S = its rounding error, which joins the low part.
  two_sum_fold(a.S.data(), b.S.data(), a.S.size());
  two_sum_fold(a.z.data(), b.z.data(), a.z.size());
  a.S_lo += b.S;
  a.z_lo += b.z;
}

}  // namespace detail
}  // namespace linattn
