/// \file core/detail/recurrent_block.hpp
/// \brief The recurrent causal kernel over a block of tokens (internal): several tokens per
/// pass over the state, so that each row of S is loaded and stored once per group of tokens
/// instead of once per token.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <type_traits>

#include "../common.hpp"
#include "blocking.hpp"

namespace linattn::detail {

// Tokens per pass over the state. The kernel is bound by its loads (each row of the state is
// loaded once per pass, the tokens' values once per row), so more tokens per pass is faster as
// long as the accumulators fit in registers: with AVX-512 (32 registers) eight tokens times two
// packets of columns keep 16 accumulators, two packets of each part of the state and two
// broadcasts in registers; with 16 registers four tokens do.
#if defined(EIGEN_VECTORIZE_AVX512)
inline constexpr int kRecurrentTokens = 8;
#else
inline constexpr int kRecurrentTokens = 4;
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // packet types as template arguments
#endif

// T tokens through the C packets of columns starting at c0 of the row-major state (F rows,
// leading dimension lds; high part `hi`, read only, and low part `lo`, updated), in one pass
// over its rows. For each row d and token t in order:
//   lo(d, :) += pk(t, d) v_t   and   o_t += pq(t, d) (hi(d, :) + lo(d, :)),
// so o_t reads the state after token t, as the recurrence requires, and the tokens are summed
// into the low part, where they are not rounded away against a large sum. pq(t, d) is at
// t·qts + d·qfs and pk(t, d) at t·kts + d·kfs, both read by broadcast (the two strides differ
// when the causal backward reads the caller's V and G in their own storage orders); v and o
// are row-major (token t at t·ldv, t·ldo). Packet may be Scalar itself for the last columns.
template <class Packet, int T, int C, class Scalar>
EIGEN_ALWAYS_INLINE void recurrent_tile(const Scalar* hi, Scalar* lo, Index lds, Index F,
                                        Index c0, const Scalar* pq, Index qts, Index qfs,
                                        const Scalar* pk, Index kts, Index kfs, const Scalar* v,
                                        Index ldv, Scalar* o, Index ldo) {
  using namespace Eigen::internal;
  constexpr Index P = unpacket_traits<Packet>::size;
  Packet acc[T][C];
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) acc[t][c] = pset1<Packet>(Scalar(0));
  for (Index d = 0; d < F; ++d) {
    Scalar* row = lo + d * lds + c0;
    const Scalar* hrow = hi + d * lds + c0;
    const Scalar* qd = pq + d * qfs;
    const Scalar* kd = pk + d * kfs;
    Packet x[C], h[C];
    for (int c = 0; c < C; ++c) {
      x[c] = ploadu<Packet>(row + c * P);
      h[c] = ploadu<Packet>(hrow + c * P);
    }
    for (int t = 0; t < T; ++t) {
      const Packet k = pset1<Packet>(kd[t * kts]);
      const Packet q = pset1<Packet>(qd[t * qts]);
      for (int c = 0; c < C; ++c) {
        x[c] = pmadd(k, ploadu<Packet>(v + t * ldv + c0 + c * P), x[c]);
        acc[t][c] = pmadd(q, padd(x[c], h[c]), acc[t][c]);
      }
    }
    for (int c = 0; c < C; ++c) pstoreu(row + c * P, x[c]);
  }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) pstoreu(o + t * ldo + c0 + c * P, acc[t][c]);
}

// T tokens through all M columns of the state: two packets at a time, then one, then scalars.
template <int T, class Scalar>
void recurrent_tokens(const Scalar* hi, Scalar* lo, Index lds, Index F, Index M,
                      const Scalar* pq, Index qts, Index qfs, const Scalar* pk, Index kts,
                      Index kfs, const Scalar* v, Index ldv, Scalar* o, Index ldo) {
  using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
  constexpr Index P = Eigen::internal::unpacket_traits<Packet>::size;
  Index c0 = 0;
  if constexpr (P > 1) {
    for (; c0 + 2 * P <= M; c0 += 2 * P)
      recurrent_tile<Packet, T, 2>(hi, lo, lds, F, c0, pq, qts, qfs, pk, kts, kfs, v, ldv, o,
                                   ldo);
    for (; c0 + P <= M; c0 += P)
      recurrent_tile<Packet, T, 1>(hi, lo, lds, F, c0, pq, qts, qfs, pk, kts, kfs, v, ldv, o,
                                   ldo);
  }
  for (; c0 < M; ++c0)
    recurrent_tile<Scalar, T, 1>(hi, lo, lds, F, c0, pq, qts, qfs, pk, kts, kfs, v, ldv, o, ldo);
}

// Feeds tokens [0, b) through the state: o_t = pq_t (hi + lo_t) with lo_t = lo + Σ_{s≤t} pk_s
// v_sᵀ, lo updated in place. Exactly 5·b·F·M flops. Layouts as in recurrent_tile.
template <class Scalar>
void recurrent_block(const Scalar* hi, Scalar* lo, Index lds, Index F, Index M,
                     const Scalar* pq, Index qts, Index qfs, const Scalar* pk, Index kts,
                     Index kfs, Index b, const Scalar* v, Index ldv, Scalar* o, Index ldo) {
  constexpr int T = kRecurrentTokens;
  Index t = 0;
  for (; t + T <= b; t += T)
    recurrent_tokens<T>(hi, lo, lds, F, M, pq + t * qts, qts, qfs, pk + t * kts, kts, kfs,
                        v + t * ldv, ldv, o + t * ldo, ldo);
  // The last b mod T tokens: 4 (when T = 8), then 2, then 1 at a time.
  const auto tail = [&](auto n) {
    constexpr int n_tokens = decltype(n)::value;
    if (n_tokens < T && b - t >= n_tokens) {
      recurrent_tokens<n_tokens>(hi, lo, lds, F, M, pq + t * qts, qts, qfs, pk + t * kts, kts,
                                 kfs, v + t * ldv, ldv, o + t * ldo, ldo);
      t += n_tokens;
    }
  };
  tail(std::integral_constant<int, 4>{});
  tail(std::integral_constant<int, 2>{});
  tail(std::integral_constant<int, 1>{});
}

// recurrent_block() with pq and pk in one layout (token stride ts, feature stride fs).
template <class Scalar>
void recurrent_block(const Scalar* hi, Scalar* lo, Index lds, Index F, Index M,
                     const Scalar* pq, const Scalar* pk, Index ts, Index fs, Index b,
                     const Scalar* v, Index ldv, Scalar* o, Index ldo) {
  recurrent_block(hi, lo, lds, F, M, pq, ts, fs, pk, ts, fs, b, v, ldv, o, ldo);
}

// The denominators of tokens [0, b): den_t = pq_t · (z + z_lo_t) with z_lo_t = z_lo +
// Σ_{s≤t} pk_s, z_lo updated in place (z, the high part, is read only); then pq_t *=
// guarded_inverse(den_t), so that recurrent_block's pq_t S_t is the output. With MayCancel
// (features of both signs) a den_t within rounding noise of its terms' magnitude counts as 0
// (see cancellation_threshold). Token-major pq, pk (token t's F features contiguous at t·ld),
// so that the running sum is a few packets and each token costs F/P packet operations and one
// horizontal sum.
template <bool MayCancel, class Scalar>
void prefix_normalize_tokens(const Scalar* z, Scalar* z_lo, Index F, Scalar* pq,
                             const Scalar* pk, Index ld, Index b) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  constexpr Index P = unpacket_traits<Packet>::size;
  const Index Fv = P > 1 ? F / P * P : 0;
  const Scalar threshold = cancellation_threshold<Scalar>(F);
  for (Index t = 0; t < b; ++t) {
    Scalar* q = pq + t * ld;
    const Scalar* k = pk + t * ld;
    Scalar den = 0, scale = 0;
    if constexpr (P > 1) {
      Packet acc = pset1<Packet>(Scalar(0)), acc_abs = acc;
      for (Index d = 0; d < Fv; d += P) {
        const Packet zz = padd(ploadu<Packet>(z_lo + d), ploadu<Packet>(k + d));
        pstoreu(z_lo + d, zz);
        const Packet qd = ploadu<Packet>(q + d), zt = padd(zz, ploadu<Packet>(z + d));
        acc = pmadd(qd, zt, acc);
        if constexpr (MayCancel) acc_abs = pmadd(pabs(qd), pabs(zt), acc_abs);
      }
      den = predux(acc);
      if constexpr (MayCancel) scale = predux(acc_abs);
    }
    for (Index d = Fv; d < F; ++d) {
      z_lo[d] += k[d];
      den += q[d] * (z[d] + z_lo[d]);
      if constexpr (MayCancel) scale += std::abs(q[d]) * std::abs(z[d] + z_lo[d]);
    }
    if constexpr (MayCancel)
      if (!(den > threshold * scale)) den = 0;
    Eigen::Map<Vector<Scalar>>(q, F) *= guarded_inverse(den);
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace linattn::detail
