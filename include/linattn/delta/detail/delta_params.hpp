/// \file delta/detail/delta_params.hpp
/// \brief The per-token parameters of the delta-rule kernels (internal): beta and log_a checked
/// (shapes and values, before any work) and gathered per head into contiguous arrays, the
/// per-channel decays (KDA) as their factors e^{g} or, for the chunked form, as log-decays
/// (docs/SPEC.md §9.3, §10.1).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <string>

#include "../../core/common.hpp"
#include "../../core/detail/blocking.hpp"
#include "../../core/detail/checks.hpp"
#include "../../core/detail/fast_exp.hpp"
#include "../../core/workspace.hpp"
#include "delta_forward.hpp"

namespace linattn::detail {

// Entry (i, h) of a per-token parameter of `heads` heads: N x H, always, for H > 1 (so that a
// one-token call's 1 x H is never read as a row of N); one head's N entries may also be given
// as a row. The shape is checked before (check_delta_params).
template <class D>
typename D::Scalar token_param(const D& x, Index i, Index h, Index heads) {
  return heads == 1 && x.rows() == 1 ? x.coeff(0, i) : x.coeff(i, h);
}

// The name of entry (i, h) in a message: "beta(3)" for one head, "beta(3, 1)" for H.
inline std::string param_entry(const char* name, Index i, Index h, bool one_head) {
  return std::string(name) + "(" + std::to_string(i) +
         (one_head ? std::string() : ", " + std::to_string(h)) + ")";
}

// Whether log_a holds one log-decay per key channel (KDA): N x H·F with F > 1, against one per
// token and head (N x H; one head: a vector of N entries).
template <class DA>
bool per_channel_decays(const DA& log_a, Index N, Index heads, Index F) {
  return F > 1 && log_a.rows() == N && log_a.cols() == heads * F && log_a.size() != 0;
}

// beta: N x H (H = 1: a vector of N entries, column or row), every entry in [0, 2];
// log_a: of size 0 (no decay), shaped as beta, or N x H·F (per key channel, KDA), every entry
// finite and <= 0. `shapes` names the other operands for the message (called on failure only:
// no string is built otherwise).
template <class DB, class DA, class Shapes>
void check_delta_params(const char* fn, const Eigen::MatrixBase<DB>& beta,
                        const Eigen::MatrixBase<DA>& log_a, Index N, Index heads, Index F,
                        const Shapes& shapes) {
  const bool one = heads == 1;
  const auto fits = [&](Index r, Index c) {
    return (r == N && c == heads) || (one && r == 1 && c == N);
  };
  const auto want = [&] {
    return one ? "a vector of N = " + std::to_string(N) + " entries"
               : shape_string(N, heads) +
                     " (one entry per token and head, H = " + std::to_string(heads) + ")";
  };
  if (!fits(beta.rows(), beta.cols()))
    throw_invalid(fn, "beta is " + shape_of(beta) + " but must be " + want() + shapes());
  const bool channels = per_channel_decays(log_a, N, heads, F);
  if (log_a.size() != 0 && !channels && !fits(log_a.rows(), log_a.cols()))
    throw_invalid(fn, "log_a is " + shape_of(log_a) + " but must be empty (no decay), " + want() +
                          " or " + shape_string(N, heads * F) +
                          " (one per key channel, F = " + std::to_string(F) + ")" + shapes());
  using S = typename DB::Scalar;
  for (Index h = 0; h < heads; ++h)
    for (Index i = 0; i < N; ++i) {
      const S b = token_param(beta.derived(), i, h, heads);
      if (!(b >= S(0) && b <= S(2)))
        throw_invalid(fn, param_entry("beta", i, h, one) + " = " + value_string(b) +
                              ": beta must be in [0, 2]" + shapes());
    }
  if (log_a.size() == 0) return;
  const auto bad = [](S g) { return !(g <= S(0)) || !(g - g == S(0)); };
  if (channels) {
    // Two vectorised reductions in storage order clear every valid call: x − x is 0 for each
    // finite entry (NaN otherwise, which the sum keeps), and then the maximum is reliable.
    const auto& la = log_a.derived();
    if ((la.array() - la.array()).sum() == S(0) && la.maxCoeff() <= S(0)) return;
    for (Index c = 0; c < log_a.cols(); ++c)
      for (Index i = 0; i < N; ++i)
        if (bad(log_a.coeff(i, c)))
          throw_invalid(fn, "log_a(" + std::to_string(i) + ", " + std::to_string(c) +
                                ") = " + value_string(log_a.coeff(i, c)) +
                                ": log-decays must be finite and <= 0" + shapes());
    return;
  }
  for (Index h = 0; h < heads; ++h)
    for (Index i = 0; i < N; ++i) {
      const S g = token_param(log_a.derived(), i, h, heads);
      if (bad(g))
        throw_invalid(fn, param_entry("log_a", i, h, one) + " = " + value_string(g) +
                              ": log-decays must be finite and <= 0" + shapes());
    }
}

// One head's per-token parameters as contiguous arrays in the thread's workspace: beta's n
// entries, and the decays: g, n log-decays (gw = 1), or for per-channel decays (gw = F, KDA)
// n x F entries: the log-decays, column-major (logs: the chunked form sums them along its
// stretches), or their factors e^{g}, token-major (the recurrent form and the gradients use no
// log-decay of a channel but through its exponential); null without decay.
template <class Scalar>
struct DeltaHeadParams {
  const Scalar* beta;
  const Scalar* g;
  Index gw;
  bool logs;
};

// Head h (of `heads`)'s rows [r0, r0 + n) of beta and log_a (F: the head's key channels; logs:
// keep per-channel log-decays as they are, else take their factors).
template <class DB, class DA, class Scalar>
DeltaHeadParams<Scalar> delta_head_params(const DB& beta, const DA& log_a, Index r0, Index n,
                                          Index h, Index heads, Index F, Workspace<Scalar>& ws,
                                          bool logs = false) {
  auto b = ws.vector(kSlotBackwardA, n);
  for (Index i = 0; i < n; ++i) b(i) = token_param(beta, r0 + i, h, heads);
  if (log_a.size() == 0) return {b.data(), nullptr, 1, false};
  if (per_channel_decays(log_a, log_a.rows(), heads, F)) {
    auto g = ws.vector(kSlotBackwardB, n * F);
    const auto src = log_a.block(r0, h * F, n, F);
    if (logs) {
      // Column-major n x F, as the chunked form reads them (a chunk's rows of each channel are
      // contiguous): a plain copy column by column.
      Eigen::Map<Matrix<Scalar>>(g.data(), n, F) = src.template cast<Scalar>();
      return {b.data(), g.data(), F, true};
    }
    Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> a(g.data(),
                                                                                         n, F);
    const exp_nonpositive_op<Scalar> decay;
    if constexpr ((int(DA::Flags) & Eigen::RowMajorBit) != 0) {
      a = src.template cast<Scalar>().unaryExpr(decay);
    } else {
      // Column-major: a token's F entries lie a column apart (often a multiple of 4 KiB, which
      // maps them all to one cache set). Blocks of 16 tokens read each column's 16 entries
      // contiguously, take their exponentials in one packet and store them token-major.
      constexpr Index kBlock = 16;
      Eigen::Array<Scalar, kBlock, 1> e;
      for (Index i0 = 0; i0 < n; i0 += kBlock) {
        const Index m = std::min(kBlock, n - i0);
        for (Index c = 0; c < F; ++c) {
          if (m == kBlock)
            e = src.col(c).template segment<kBlock>(i0).template cast<Scalar>().array().unaryExpr(
                decay);
          else
            e.head(m) = src.col(c).segment(i0, m).template cast<Scalar>().array().unaryExpr(decay);
          for (Index i = 0; i < m; ++i) a(i0 + i, c) = e[i];
        }
      }
    }
    return {b.data(), g.data(), F, false};
  }
  auto g = ws.vector(kSlotBackwardB, n);
  for (Index i = 0; i < n; ++i) g(i) = token_param(log_a, r0 + i, h, heads);
  return {b.data(), g.data(), 1, false};
}

}  // namespace linattn::detail
