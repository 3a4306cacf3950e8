/// \file detail/recurrent_block.hpp
/// \brief The recurrent causal kernel over a block of tokens (internal): several tokens per
/// pass over the state, so that each row of S is loaded and stored once per group of tokens
/// instead of once per token.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <type_traits>

#include "../common.hpp"

namespace linattn::detail {

// Tokens per pass over S. Four tokens times two packets of columns keep eight accumulators,
// two state packets and two broadcasts in registers (16 on AVX2) with the values read as
// memory operands of the FMAs.
inline constexpr int kRecurrentTokens = 4;

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // packet types as template arguments
#endif

// T tokens through the C packets of columns starting at c0 of the row-major S (F rows,
// leading dimension lds), in one pass over its rows. For each row d and token t in order:
//   S(d, :) += pk(t, d) v_t   and   o_t += pq(t, d) S(d, :),
// so o_t reads S after token t, as the recurrence requires. pq and pk are column-major
// (token t, feature d at t + d·ldp: the feature maps' own layout, read by broadcast); v and o
// are row-major (token t at t·ldv, t·ldo). Packet may be Scalar itself for the last columns.
template <class Packet, int T, int C, class Scalar>
EIGEN_ALWAYS_INLINE void recurrent_tile(Scalar* S, Index lds, Index F, Index c0,
                                        const Scalar* pq, const Scalar* pk, Index ldp,
                                        const Scalar* v, Index ldv, Scalar* o, Index ldo) {
  using namespace Eigen::internal;
  constexpr Index P = unpacket_traits<Packet>::size;
  Packet acc[T][C];
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) acc[t][c] = pset1<Packet>(Scalar(0));
  for (Index d = 0; d < F; ++d) {
    Scalar* row = S + d * lds + c0;
    const Scalar* qd = pq + d * ldp;
    const Scalar* kd = pk + d * ldp;
    Packet x[C];
    for (int c = 0; c < C; ++c) x[c] = ploadu<Packet>(row + c * P);
    for (int t = 0; t < T; ++t) {
      const Packet k = pset1<Packet>(kd[t]);
      const Packet q = pset1<Packet>(qd[t]);
      for (int c = 0; c < C; ++c) {
        x[c] = pmadd(k, ploadu<Packet>(v + t * ldv + c0 + c * P), x[c]);
        acc[t][c] = pmadd(q, x[c], acc[t][c]);
      }
    }
    for (int c = 0; c < C; ++c) pstoreu(row + c * P, x[c]);
  }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) pstoreu(o + t * ldo + c0 + c * P, acc[t][c]);
}

// T tokens through all M columns of S: two packets at a time, then one, then scalars.
template <int T, class Scalar>
void recurrent_tokens(Scalar* S, Index lds, Index F, Index M, const Scalar* pq,
                      const Scalar* pk, Index ldp, const Scalar* v, Index ldv, Scalar* o,
                      Index ldo) {
  using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
  constexpr Index P = Eigen::internal::unpacket_traits<Packet>::size;
  Index c0 = 0;
  if constexpr (P > 1) {
    for (; c0 + 2 * P <= M; c0 += 2 * P)
      recurrent_tile<Packet, T, 2>(S, lds, F, c0, pq, pk, ldp, v, ldv, o, ldo);
    for (; c0 + P <= M; c0 += P)
      recurrent_tile<Packet, T, 1>(S, lds, F, c0, pq, pk, ldp, v, ldv, o, ldo);
  }
  for (; c0 < M; ++c0) recurrent_tile<Scalar, T, 1>(S, lds, F, c0, pq, pk, ldp, v, ldv, o, ldo);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// Feeds tokens [0, b) through the state: o_t = pq_t S_t with S_t = S + Σ_{s≤t} pk_s v_sᵀ,
// S updated in place. Exactly 4·b·F·M flops. Layouts as in recurrent_tile.
template <class Scalar>
void recurrent_block(Scalar* S, Index lds, Index F, Index M, const Scalar* pq,
                     const Scalar* pk, Index ldp, Index b, const Scalar* v, Index ldv, Scalar* o,
                     Index ldo) {
  constexpr int T = kRecurrentTokens;
  Index t = 0;
  for (; t + T <= b; t += T)
    recurrent_tokens<T>(S, lds, F, M, pq + t, pk + t, ldp, v + t * ldv, ldv, o + t * ldo, ldo);
  const auto tail = [&](auto n) {
    recurrent_tokens<decltype(n)::value>(S, lds, F, M, pq + t, pk + t, ldp, v + t * ldv, ldv,
                                         o + t * ldo, ldo);
  };
  switch (b - t) {
    case 3: tail(std::integral_constant<int, 3>{}); break;
    case 2: tail(std::integral_constant<int, 2>{}); break;
    case 1: tail(std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// The denominators of tokens [0, b): den_t = pq_t · z_t with z_t = z + Σ_{s≤t} pk_s, z updated
// in place; then pq_t /= max(den_t, ε), so that recurrent_block's pq_t S_t is the output.
// Column-major pq, pk (leading dimension ldp); den is b entries of scratch. A running sum is a
// chain of dependent additions, so each sweep down the tokens carries W features at once (8
// measured best: 27% faster than 4, and more no longer pays).
template <int W, class Scalar>
void prefix_features(Scalar* z, const Scalar* q, const Scalar* k, Index ldp, Index b,
                     Scalar* den) {
  Scalar zz[W];
  for (int j = 0; j < W; ++j) zz[j] = z[j];
  for (Index t = 0; t < b; ++t) {
    Scalar part[W];
    for (int j = 0; j < W; ++j) {
      zz[j] += k[t + j * ldp];
      part[j] = q[t + j * ldp] * zz[j];
    }
    for (int w = W / 2; w > 0; w /= 2)  // a tree, not a chain of W dependent additions
      for (int j = 0; j < w; ++j) part[j] += part[j + w];
    den[t] += part[0];
  }
  for (int j = 0; j < W; ++j) z[j] = zz[j];
}

template <class Scalar>
void prefix_normalize_queries(Scalar* z, Index F, Scalar* pq, const Scalar* pk, Index ldp,
                              Index b, Scalar* den) {
  constexpr int W = 8;
  std::fill(den, den + b, Scalar(0));
  const Index full = F / W * W;
  for (Index d = 0; d < full; d += W)
    prefix_features<W>(z + d, pq + d * ldp, pk + d * ldp, ldp, b, den);
  for (Index d = full; d < F; ++d) prefix_features<1>(z + d, pq + d * ldp, pk + d * ldp, ldp, b, den);
  Eigen::Map<Vector<Scalar>> inv(den, b);
  inv = inv.cwiseMax(denominator_epsilon<Scalar>()).cwiseInverse();
  for (Index d = 0; d < F; ++d)
    Eigen::Map<Vector<Scalar>>(pq + d * ldp, b).array() *= inv.array();
}

}  // namespace linattn::detail
