/// \file maps/map_state.hpp
/// \brief A state sized for a feature map (make_state()), and the reads and writes of a state
/// through a map that every attention kernel shares (internal).
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../core/state.hpp"
#include "../core/workspace.hpp"
#include "../core/detail/blocking.hpp"
#include "../core/detail/products.hpp"
#include "feature_map.hpp"

namespace linattn {

/// A zero state sized for `phi` with key dimension D and value dimension M.
/// \param phi the feature map the state will be used with (it fixes F).
/// \param key_dim D, the width of the query and key rows.
/// \param value_dim M, the width of the values.
/// \return the zero F x M state, with running maxima when phi needs them.
template <class Scalar, class Phi>
LinearAttentionState<Scalar> make_state(const Phi& phi, Index key_dim, Index value_dim) {
  return LinearAttentionState<Scalar>(phi.feature_dim(key_dim), value_dim,
                                      normalizes_keys_per_feature_v<Phi>);
}

namespace detail {


[[noreturn]] LINATTN_DETAIL_COLD inline void throw_state_misfit(const char* function, Index s_rows,
                                                                Index s_cols, Index z, Index m,
                                                                Index lo_rows, Index lo_cols,
                                                                Index z_lo, Index F, Index M) {
  throw_invalid_parts(function, {"the state (S is ", s_rows, "x", s_cols, ", z has ", z,
                                 " entries, m has ", m, ", S_lo is ", lo_rows, "x", lo_cols,
                                 ", z_lo has ", z_lo, " entries) does not fit F = ", F, ", M = ",
                                 M, " for this feature map"});
}

// prepare_state() once F is known: once per scalar type, not per map.
template <class Scalar>
void prepare_state_sized(const char* function, LinearAttentionState<Scalar>& st, Index F,
                         Index value_dim, bool per_feature) {
  if (st.empty()) {
    st = LinearAttentionState<Scalar>(F, value_dim, per_feature);
    return;
  }
  const bool lo_fits = (st.S_lo.size() == 0 || (st.S_lo.rows() == F && st.S_lo.cols() == value_dim)) &&
                       (st.z_lo.size() == 0 || st.z_lo.size() == F);
  if (st.S.rows() != F || st.S.cols() != value_dim || st.z.size() != F ||
      st.m.size() != (per_feature ? F : 0) || !lo_fits)
    throw_state_misfit(function, st.S.rows(), st.S.cols(), st.z.size(), st.m.size(),
                       st.S_lo.rows(), st.S_lo.cols(), st.z_lo.size(), F, value_dim);
  if (st.S_lo.size() == 0) st.S_lo.setZero(F, value_dim);
  if (st.z_lo.size() == 0) st.z_lo.setZero(F);
}

// Sizes an empty state, or checks that a given one fits (F x M).
template <class Scalar, class Phi>
void prepare_state(const char* function, LinearAttentionState<Scalar>& st, const Phi& phi,
                   Index key_dim, Index value_dim) {
  check_feature_map(function, phi, key_dim);
  prepare_state_sized(function, st, phi.feature_dim(key_dim), value_dim,
                      normalizes_keys_per_feature_v<Phi>);
}


// A product map's step weights: z_lo += φ(k), then w = φ(q) / (φ(q)·(z + z_lo)), guarded (the
// output is wᵀ S after the update). Shared by the float states and the bf16 / half ones
// (low_state_update_read), so that both divide by the same denominators.
template <class Phi, class ZVec, class PQ, class PK, class W>
void recurrent_weights(const Phi& phi, const ZVec& z, ZVec& z_lo, const PQ& pq, const PK& pk,
                       W& w) {
  using Scalar = typename ZVec::Scalar;
  z_lo.noalias() += pk;
  Scalar den = pq.dot(z) + pq.dot(z_lo);
  if (may_cancel(phi)) {
    const Scalar scale = pq.cwiseAbs().dot((z + z_lo).cwiseAbs());
    if (!(den > cancellation_threshold<Scalar>(z.size()) * scale)) den = 0;
  }
  w = pq * guarded_inverse(den);
}

// Consumes one token into the state and writes its output: the recurrent step, O(F·M).
// pq is φ(q) (any F-vector expression); pk (contiguous F-vector) holds φ(k) for generic maps
// and is scratch for per-feature key softmax; w is contiguous F-vector scratch; v and o are
// contiguous M-vectors. The token goes into the low parts S_lo, z_lo (the caller folds them).
template <class Phi, class Scalar, class PQ, class PK, class W, class KVec, class VVec,
          class OVec>
void recurrent_update_and_read(const Phi& phi, LinearAttentionState<Scalar>& st, const PQ& pq,
                               PK& pk, W& w, const KVec& k, const VVec& v, OVec&& o) {
  if constexpr (normalizes_keys_per_feature_v<Phi>) {
    (void)phi;
    raise_maxima(st.S, st.S_lo, st.z, st.z_lo, st.m, k);
    pk = (k.array() - st.m.array()).exp().matrix();
    st.z_lo.noalias() += pk;
    // z(d) + z_lo(d) >= 1 now: the maximal key of each feature contributes e^0.
    w = pq.cwiseQuotient(st.z + st.z_lo);
  } else {
    recurrent_weights(phi, st.z, st.z_lo, pq, pk, w);
  }
  fused_rank1_update_read(st.S.data(), st.S_lo.data(), st.S.outerStride(), st.S.rows(),
                          st.S.cols(), pk.data(), w.data(), v.data(), o.data());
}

// One decode token's operands, as every decode class of a product map (or a per-feature key
// softmax) prepares them: φ(q), φ(k) (or k itself), v, widened from bf16 / half, and the step's
// scratch, sized once. An elementwise map takes the token as a contiguous column, on packets:
// 1-row matrices would be copied one scalar at a time (bench_decode). RecurrentLinearAttention and BatchedRecurrentLinearAttention
// both step through it, which keeps their heads equal bit for bit.
template <class Scalar>
struct DecodeScratch {
  TokenFeatures<Scalar> token;
  Vector<Scalar> pq, pk, k, w, v, o, row;  // row: M, for states kept in bf16 / half only

  void resize(Index D, Index F, Index M, bool low_precision_state = false) {
    token.resize(D, F);
    pq.resize(F);
    pk.resize(F);
    k.resize(D);
    w.resize(F);
    v.resize(M);
    o.resize(M);
    row.resize(low_precision_state ? M : 0);
  }
  template <class Phi, class Q, class K, class V>
  void load(const Phi& phi, const Q& q, const K& k_in, const V& v_in) {
    token.map(phi, q, pq, QuerySide{true});
    if constexpr (normalizes_keys_per_feature_v<Phi>)
      assign_widened(k, k_in);
    else
      token.map(phi, k_in, pk, KeySide{true});
    assign_widened(v, v_in);
  }
  // The step on a float / double state: the token into the state, its output into o.
  template <class Phi>
  void update_and_read(const Phi& phi, LinearAttentionState<Scalar>& st) {
    recurrent_update_and_read(phi, st, pq, pk, w, k, v, o);
  }
};

// Calls fn(p) with p = φ(x), the n x F features of the rows of x, in workspace slot `slot`:
// a column-major buffer, or for an elementwise map of row-major x (maps_token_major_v) the
// transposed view of a token-major F x n buffer that the map filled without a transpose. The
// kernels' products and row operations read either alike.
template <class Phi, class X, class Scalar, class Fn, class Side>
void with_mapped_rows(const Phi& phi, const X& x, Index F, int slot, Workspace<Scalar>& ws,
                      Fn&& fn, Side side) {
  if constexpr (maps_token_major_v<Phi, X> ||
                (is_erased_map<Phi>::value && is_row_major_memory_v<X>)) {
    if (maps_token_major_v<Phi, X> || erased_token_major<Phi, X>(phi)) {
      auto pt = ws.matrix(slot, F, x.rows());
      phi.map(x.transpose(), pt);
      fn(pt.transpose());
      return;
    }
  }
  {
    auto p = ws.matrix(slot, x.rows(), F);
    map_side(phi, x, p, side);
    fn(p);
  }
}

// Divides already-mapped query rows pq (n x F) by their denominators pq z (den: n scratch
// entries), guarded, or for per-feature key softmax each feature by its z: then pq S is the
// output.
template <class Phi, class ZVec, class PQ, class Den>
void normalize_queries(const Phi& phi, const ZVec& z, PQ& pq, Den& den) {
  if constexpr (normalizes_keys_per_feature_v<Phi>) {
    (void)phi;
    // z(d) == 0 only before any key: that feature then contributes nothing.
    for (Index d = 0; d < z.size(); ++d) pq.col(d) *= guarded_inverse(z(d));
  } else {
    den.noalias() = pq * z;
    if (may_cancel(phi)) {
      using Scalar = typename ZVec::Scalar;
      const Scalar t = cancellation_threshold<Scalar>(z.size());
      for (Index i = 0; i < den.size(); ++i)
        if (!(den(i) > t * pq.row(i).cwiseAbs().dot(z.cwiseAbs()))) den(i) = 0;
    }
    invert_guarded(den);
    pq.array().colwise() *= den.array();
  }
}

// Reads a folded state (low parts below an ulp of the high parts, which this read ignores) with
// already-mapped query rows pq (n x F, overwritten): out = pq S · guarded_inverse(pq z), or for
// per-feature key softmax out = (pq ./ z) S. One row at a time (the recurrent step's read).
template <class Phi, class SMat, class ZVec, class PQ, class Den, class Out>
void read_state(const Phi& phi, const SMat& S, const ZVec& z, PQ& pq, Den& den, Out&& out) {
  normalize_queries(phi, z, pq, den);
  out.noalias() = pq * S;
}

// read_state() for a block of rows, with the product on the micro-kernel: pq is memory (a
// column-major buffer or the transposed view of a token-major one), S memory of either storage
// order (a workspace buffer, a LinearAttentionState's row-major sums).
template <class Phi, class SMat, class ZVec, class PQ, class Den, class Out, class Scalar>
void read_state(const Phi& phi, const SMat& S, const ZVec& z, PQ& pq, Den& den, Out&& out,
                Workspace<Scalar>& ws) {
  normalize_queries(phi, z, pq, den);
  read_product(strided_of(pq), pq.rows(), pq.cols(), S, std::forward<Out>(out), ws);
}

// Non-causal absorption of keys: S += φ(K)ᵀ V and z += φ(K)ᵀ 1 blockwise, so that no L x F
// matrix exists; for per-feature key softmax with running maxima. Each block's sums go into the
// low parts, which are then folded into the high parts (one exact fold per block of keys, a few
// percent of the block's product). Keys with keep(j) == false contribute nothing.
template <class Phi, class DK, class DV, class SMat, class ZVec, class MVec, class Keep>
void absorb_keys(const Phi& phi, const DK& K, const DV& V, SMat& S, SMat& S_lo, ZVec& z, ZVec& z_lo,
                 MVec& m, const Keep& keep, Workspace<compute_scalar_t<typename DK::Scalar>>& ws) {
  using Scalar = typename DK::Scalar;
  constexpr bool masked = !std::is_same_v<Keep, NoMask>;
  const Index L = K.rows(), F = S.rows();
  for (Index j0 = 0; j0 < L; j0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, L - j0);
    const auto kb = K.middleRows(j0, b);
    const Index next = std::min(kLinearRowBlock, L - j0 - b);  // rows of the next block
    prefetch_rows(K, j0 + b, next);
    prefetch_rows(V, j0 + b, next);
    // pk: the block's b x F key features, a column-major buffer or the transposed view of a
    // token-major one.
    const auto add = [&](auto&& pk) {
      if constexpr (masked)  // after exp: a fully masked feature has m = -inf and NaN here
        for (Index j = 0; j < b; ++j)
          if (!keep(j0 + j)) pk.row(j).setZero();
      // The micro-kernel reads φ(K) token-major (each token's features contiguous).
      const Scalar* pkt = pk.data();
      ws.reserve(kSlotKeys, F * b);  // for either storage order of K (see strided_rows)
      if (!(bool(std::decay_t<decltype(pk)>::IsRowMajor) && pk.outerStride() == F)) {
        Scalar* buf = ws.matrix(kSlotKeys, F, b).data();  // (the products use kSlotProduct*)
        transpose_copy(pk.data(), pk.outerStride(), b, F, buf, F);
        pkt = buf;
      }
      absorb_token_major(pkt, F, F, b,
                         kept_value_rows(V.middleRows(j0, b), j0, keep, ws, kSlotProductB), S_lo,
                         z_lo, ws);
      fold_state(S, S_lo, z, z_lo);
    };
    if constexpr (normalizes_keys_per_feature_v<Phi>) {
      auto pk = ws.matrix(kSlotPhiK, b, F);
      pk = kb;
      if constexpr (masked)
        for (Index j = 0; j < b; ++j)
          if (!keep(j0 + j)) pk.row(j).setConstant(-std::numeric_limits<Scalar>::infinity());
      auto block_max = ws.vector(kSlotRowB, F);
      block_max = pk.colwise().maxCoeff().transpose();
      raise_maxima(S, S_lo, z, z_lo, m, block_max);
      exp_shifted_cols(pk, m);
      add(pk);
    } else {
      // Keys of a state that normalised kernels read (non-causal attention, summaries, memories).
      with_mapped_rows(phi, kb, F, kSlotPhiK, ws, add, KeySide{true});
    }
  }
}

}  // namespace detail
}  // namespace linattn
