/// \file delta/detail/delta_low_state.hpp
/// \brief The delta rule's decode step on a state kept in bf16 or half (internal):
/// RecurrentDeltaRule<Phi, float, Eigen::bfloat16> and the batched decoder built on it.
///
/// Why: at B sequences x H heads a decode step reads and writes every F x M state once; bf16 /
/// half halve those bytes and the memory the states take (docs/benchmarks.md measures what the
/// conversions cost in return). The rule (docs/SPEC.md §9.3): the state after a token is the
/// float step's state from the kept one, rounded once (round to nearest even). The sweep widens
/// each entry, applies the pending update of the previous token in float as delta_sweep does,
/// rounds the result into the state and reads the rounded value for this token's products: the
/// same bits as a float decoder whose state is rounded to the storage type after every token.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <type_traits>

#include "../../core/common.hpp"
#include "../../core/detail/low_precision.hpp"
#include "delta_forward.hpp"

namespace linattn::detail {

// delta_sweep_block on a low-precision state (see the file comment).
template <int NB, class Storage>
void delta_sweep_low_block(Storage* S, Index ld, Index F, Index c0, bool pending, float ap,
                           const float* ar, const float* kp, const float* dp, const float* w,
                           const float* k, float* yq, float* yk) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<float>::type;
  constexpr Index P = packet_traits<float>::size;
  Packet d[NB], aq[NB], ak[NB];
  for (int j = 0; j < NB; ++j) {
    aq[j] = pset1<Packet>(0.0f);
    ak[j] = aq[j];
  }
  if (pending) {
    const Packet pa1 = pset1<Packet>(ap);
    for (int j = 0; j < NB; ++j) d[j] = ploadu<Packet>(dp + c0 + j * P);
    for (Index r = 0; r < F; ++r) {
      Storage* row = S + r * ld + c0;
      const Packet kpr = pset1<Packet>(kp[r]), wr = pset1<Packet>(w[r]), kr = pset1<Packet>(k[r]);
      const Packet pa = ar ? pset1<Packet>(ar[r]) : pa1;
      for (int j = 0; j < NB; ++j) {
        const Packet x = store_low_packet(
            row + j * P, pmadd(kpr, d[j], pmul(pa, load_low_packet<Packet>(row + j * P))));
        aq[j] = pmadd(wr, x, aq[j]);
        ak[j] = pmadd(kr, x, ak[j]);
      }
    }
  } else {
    for (Index r = 0; r < F; ++r) {
      const Storage* row = S + r * ld + c0;
      const Packet wr = pset1<Packet>(w[r]), kr = pset1<Packet>(k[r]);
      for (int j = 0; j < NB; ++j) {
        const Packet x = load_low_packet<Packet>(row + j * P);
        aq[j] = pmadd(wr, x, aq[j]);
        ak[j] = pmadd(kr, x, ak[j]);
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    pstoreu(yq + c0 + j * P, aq[j]);
    pstoreu(yk + c0 + j * P, ak[j]);
  }
}

// delta_sweep on a low-precision state: the same column blocks, so that every column sees the
// float sweep's operations in the same order.
template <class Storage>
void delta_sweep_low(Storage* S, Index ld, Index F, Index M, bool pending, float ap,
                     const float* ar, const float* kp, const float* dp, const float* w,
                     const float* k, float* yq, float* yk) {
  constexpr Index P = Eigen::internal::packet_traits<float>::size;
  constexpr int NB = kDeltaSweepPackets;
  Index c0 = 0;
  if constexpr (P > 1) {
    for (; c0 + NB * P <= M; c0 += NB * P)
      delta_sweep_low_block<NB>(S, ld, F, c0, pending, ap, ar, kp, dp, w, k, yq, yk);
    for (; c0 + P <= M; c0 += P)
      delta_sweep_low_block<1>(S, ld, F, c0, pending, ap, ar, kp, dp, w, k, yq, yk);
  }
  for (; c0 < M; ++c0) {
    float aq = 0, ak = 0;
    for (Index r = 0; r < F; ++r) {
      Storage& s = S[r * ld + c0];
      float x = static_cast<float>(s);
      if (pending) {
        x = kp[r] * dp[c0] + (ar ? ar[r] : ap) * x;
        s = Storage(x);
        x = static_cast<float>(s);
      }
      aq += w[r] * x;
      ak += k[r] * x;
    }
    yq[c0] = aq;
    yk[c0] = ak;
  }
}

// delta_token and delta_token_channels on a low-precision state: the sweep above, then the
// float tokens' own arithmetic (the same expressions, so that the outputs are theirs).
template <class Storage, std::enable_if_t<is_low_precision_v<Storage>, int> = 0>
void delta_token(Storage* S, Index ld, Index F, Index M, DeltaPending<float>& p, float a,
                 float beta, const float* w, const float* k, const float* v, float* out, float* yq,
                 float* yk) {
  delta_sweep_low(S, ld, F, M, p.pending, p.a, p.row_decays(), p.k, p.d, w, k, yq, yk);
  const float wk = delta_dot(w, k, F);
  for (Index c = 0; c < M; ++c) {
    const float d = beta * (v[c] - a * yk[c]);
    p.d[c] = d;
    out[c] = a * yq[c] + wk * d;
  }
  std::copy(k, k + F, p.k);
  p.a = a;
  p.per_row = false;
  p.pending = true;
}

template <class Storage, std::enable_if_t<is_low_precision_v<Storage>, int> = 0>
void delta_token_channels(Storage* S, Index ld, Index F, Index M, DeltaPending<float>& p,
                          float beta, const float* w, const float* k, const float* v, float* out,
                          float* yq, float* yk, float* wa, float* ka) {
  const float* a = p.ar_next;
  for (Index r = 0; r < F; ++r) {
    wa[r] = a[r] * w[r];
    ka[r] = a[r] * k[r];
  }
  const float wk = delta_dot(w, k, F);
  delta_sweep_low(S, ld, F, M, p.pending, p.a, p.row_decays(), p.k, p.d, wa, ka, yq, yk);
  for (Index c = 0; c < M; ++c) {
    const float d = beta * (v[c] - yk[c]);
    p.d[c] = d;
    out[c] = yq[c] + wk * d;
  }
  std::copy(k, k + F, p.k);
  std::swap(p.ar, p.ar_next);
  p.per_row = true;
  p.pending = true;
}

// Row r of the state with the pending update applied and rounded, widened into `row` (M
// floats): delta_flush's arithmetic on the widened row, as the next sweep would do it.
template <class Storage>
void delta_settled_low_row(const Storage* S, Index M, bool pending, float ap, const float* ar,
                           const float* kp, const float* dp, float* row) {
  widen(S, row, M);
  if (!pending) return;
  delta_flush(row, M, 1, M, ap, ar, kp, dp);
  for (Index c = 0; c < M; ++c) row[c] = static_cast<float>(Storage(row[c]));
}

}  // namespace linattn::detail
