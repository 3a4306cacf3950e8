/// \file gated/detail/gated_low_state.hpp
/// \brief The gated decode step on a state kept in bf16 or half (internal):
/// RecurrentGatedAttention<Phi, float, Eigen::bfloat16> and the batched decoder built on it.
///
/// Why: a batched decode step moves every F x M state once; bf16 / half halve those bytes and
/// the memory the states take. The rule (docs/SPEC.md §9): each entry is widened, decayed
/// and updated in float as gated_update_read does, read into the output unrounded (the float
/// step's output from the kept state), and stored rounded once: the same bits as a float decoder
/// whose state is rounded to the storage type after every token. z stays in float.
#pragma once

#include <Eigen/Core>
#include <type_traits>

#include "../../core/common.hpp"
#include "../../core/detail/low_precision.hpp"
#include "gated_forward.hpp"

namespace linattn::detail {

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // packet types as template arguments
#endif
// gated_update_read on a low-precision state: the same column blocks and entry arithmetic.
template <bool Expm1, class Storage, std::enable_if_t<is_low_precision_v<Storage>, int> = 0>
void gated_update_read(Storage* S, Index ld, Index F, Index M, const float* f, bool per_feature,
                       const float* pk, const float* w, const float* v, float* o) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<float>::type;
  constexpr Index P = packet_traits<float>::size;
  const Index as = per_feature ? 1 : 0;
  const auto entry = [](const Packet& e, const Packet& s, const Packet& kd, const Packet& vc) {
    if constexpr (Expm1)
      return pmadd(kd, vc, pmadd(e, s, s));
    else
      return pmadd(e, s, pmul(kd, vc));
  };
  // Four packets of columns, then one (as the float kernel, whose outputs these are).
  const auto block = [&](auto nb, Index c0) {
    constexpr int NB = decltype(nb)::value;
    Packet vv[NB], oo[NB];
    for (int j = 0; j < NB; ++j) {
      vv[j] = ploadu<Packet>(v + c0 + j * P);
      oo[j] = pset1<Packet>(0.0f);
    }
    for (Index d = 0; d < F; ++d) {
      Storage* row = S + d * ld + c0;
      const Packet e = pset1<Packet>(f[d * as]), kd = pset1<Packet>(pk[d]),
                   wd = pset1<Packet>(w[d]);
      for (int j = 0; j < NB; ++j) {
        const Packet x = entry(e, load_low_packet<Packet>(row + j * P), kd, vv[j]);
        store_low_packet(row + j * P, x);
        oo[j] = pmadd(wd, x, oo[j]);
      }
    }
    for (int j = 0; j < NB; ++j) pstoreu(o + c0 + j * P, oo[j]);
  };
  Index c0 = 0;
  if constexpr (P > 1) {
    for (; c0 + 4 * P <= M; c0 += 4 * P) block(std::integral_constant<int, 4>{}, c0);
    for (; c0 + P <= M; c0 += P) block(std::integral_constant<int, 1>{}, c0);
  }
  for (; c0 < M; ++c0) {
    float acc = 0;
    for (Index d = 0; d < F; ++d) {
      Storage& s = S[d * ld + c0];
      float x = static_cast<float>(s);
      if constexpr (Expm1) {
        const float decayed = f[d * as] * x + x;
        x = pk[d] * v[c0] + decayed;
      } else {
        x = f[d * as] * x + pk[d] * v[c0];
      }
      s = Storage(x);
      acc += w[d] * x;
    }
    o[c0] = acc;
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace linattn::detail
