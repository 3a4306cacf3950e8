/// \file linear/detail/linear_forward.hpp
/// \brief The kernels of non-causal linear attention (internal): keys absorbed blockwise, queries read, the split over threads.
#pragma once

#include <Eigen/Core>
#include <cassert>
#include <algorithm>
#include <limits>
#include <string>
#include "../../core/detail/checks.hpp"
#include "../../core/common.hpp"
#include "../../core/detail/blocking.hpp"
#include "../../maps/erased_map.hpp"
#include "../../core/detail/result.hpp"
#include "sequence_split.hpp"
#include "../../core/detail/views.hpp"
#include "../../maps/elu_plus_one.hpp"
#include "../../maps/feature_map.hpp"
#include "../../core/parallel.hpp"
#include "../../core/state.hpp"
#include "../../core/workspace.hpp"
#include "../../maps/map_state.hpp"

namespace linattn {

namespace detail {

// out = the rows of q read through a folded state (S, z), 128 rows at a time (the second half
// of non-causal attention, after absorb_keys).
template <class Phi, class DQ, class SMat, class ZVec, class Out>
void read_queries(const Phi& phi, const DQ& q, const SMat& S, const ZVec& z, Out&& dst,
                  Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  const Index N = q.rows(), F = S.rows();
  for (Index i0 = 0; i0 < N; i0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, N - i0);
    auto den = ws.vector(kSlotRowA, b);
    prefetch_rows(q, i0 + b, std::min(kLinearRowBlock, N - i0 - b));  // the next block
    with_mapped_rows(phi, q.middleRows(i0, b), F, kSlotPhiQ, ws,
                     [&](auto&& pq) { read_state(phi, S, z, pq, den, dst.middleRows(i0, b), ws); },
                     QuerySide{true});
  }
}

template <class DQ, class DK, class DV, class Phi, class Keep, class DOut>
void linear_attention_impl(const char* function, const Eigen::MatrixBase<DQ>& Q,
                           const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                           const Phi& phi, const Keep& keep, const Eigen::MatrixBase<DOut>& out,
                           Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  // The caller checked the operands (linear_attention_split()) on its own types: checking
  // them again here would only instantiate the checks once more for the views.
  (void)function;
  assert(K.rows() == V.rows() && Q.cols() == K.cols() && out.rows() == Q.rows() &&
         out.cols() == V.cols());
  auto& dst = writable(out);
  const Nested<DQ> q(Q.derived());
  const Nested<DK> k(K.derived());
  const Nested<DV> v(V.derived());
  const Index M = v.cols();
  const Index F = phi.feature_dim(q.cols());
  auto S = ws.matrix(kSlotState, F, M);
  auto S_lo = ws.matrix(kSlotStateLow, F, M);
  auto z = ws.vector(kSlotNormalizer, F);
  auto z_lo = ws.vector(kSlotNormalizerLow, F);
  auto m = ws.vector(kSlotExtra, normalizes_keys_per_feature_v<Phi> ? F : 0);
  S.setZero();
  S_lo.setZero();
  z.setZero();
  z_lo.setZero();
  m.setConstant(-std::numeric_limits<Scalar>::infinity());
  absorb_keys(phi, k, v, S, S_lo, z, z_lo, m, keep, ws);
  read_queries(phi, q, S, z, dst, ws);
}

// linear_attention_impl() on T threads when the sequences are long enough (spec §8): thread t
// absorbs the t-th of the keys into a state of its own; after a barrier, each thread merges
// the T states in a fixed order and reads the t-th of the queries. Same work as one thread,
// plus T merges of F·M per thread. The operands are checked views (linear_attention_split()).
template <class VQ, class VK, class VV, class Phi, class Keep, class VOut>
void linear_attention_views(const char* function, const VQ& q, const VK& k, const VV& v,
                            const Phi& phi, const Keep& keep, VOut& dst,
                            Workspace<typename VQ::Scalar>& ws, int threads,
                            const Executor* executor) {
  using Scalar = typename VQ::Scalar;
  const Index F = phi.feature_dim(q.cols()), M = v.cols(), N = q.rows(), L = k.rows();
  if (threads <= 1) {
    // As one row segment: the instantiation of the segments below (row_segment()).
    linear_attention_impl(function, row_segment(q, 0, N), row_segment(k, 0, L),
                          row_segment(v, 0, L), phi, shifted_keep(keep, 0),
                          row_segment(dst, 0, N), ws);
    return;
  }
  auto& x = ws.template extension<SplitScratch<Scalar>>();
  x.prepare(threads, threads, F, M, normalizes_keys_per_feature_v<Phi>);
  run_two_phases(
      threads, executor,
      [&](int t, int T) {
        summarize_rows(phi, k, v, keep, split_rows(L, T, t, kLinearRowBlock),
                       x.parts[static_cast<std::size_t>(t)], x.ws[static_cast<std::size_t>(t)]);
      },
      [&](int t, int T) {
        auto& all = x.carried[static_cast<std::size_t>(t)];
        scan_parts<Scalar>(nullptr, x, T, t, all);
        all.fold();  // read_state() reads the high parts
        const RowRange r = split_rows(N, T, t, kLinearRowBlock);
        read_queries(phi, row_segment(q, r.begin, r.size), all.S, all.z,
                     row_segment(dst, r.begin, r.size), x.ws[static_cast<std::size_t>(t)]);
      });
}

// Checks the arguments, then runs linear_attention_views() on the operands as views
// (detail/views.hpp): one instantiation of the kernels per map, mask, scalar type and storage
// orders, whatever Eigen types the caller passes.
template <class DQ, class DK, class DV, class Phi, class Keep, class DOut>
void linear_attention_split(const char* function, const Eigen::MatrixBase<DQ>& Q,
                            const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                            const Phi& phi, const Keep& keep, const Eigen::MatrixBase<DOut>& out,
                            Workspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                            const ParallelOptions& par) {
  static_check_feature_map<Phi, compute_scalar_t<typename DQ::Scalar>>();
  check_qkv(function, Q, K, V, /*causal=*/false);
  check_feature_map(function, phi, Q.cols());
  const Index F = phi.feature_dim(Q.cols()), M = V.cols(), N = Q.rows(), L = K.rows();
  // A non-causal row (a key absorbed or a query read) costs half a causal row.
  const int threads = sequence_split_threads(par, (N + L) / 2, F * M);
  check_output(function, out, N, M);
  check_no_overlap(function, out, "Q", Q, "K", K, "V", V);
  const auto map = erase_map<compute_scalar_t<typename DQ::Scalar>>(phi);
  with_views(
      Q.derived(), K.derived(), V.derived(), writable(out),
      [&](const auto& q, const auto& k, const auto& v, auto& dst) {
        linear_attention_views(function, q, k, v, map, keep, dst, ws, threads, executor_of(par));
      },
      &ws.storage_copies());
}

}  // namespace detail

}  // namespace linattn
