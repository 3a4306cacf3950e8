/// \file maps/l2_normalize.hpp
/// \brief Row-wise L2 normalisation of another feature map's features:
/// \f$\varphi(x) = g(x) / \sqrt{\|g(x)\|_2^2 + \epsilon}\f$ (\f$\epsilon = 0\f$ by default;
/// flash-linear-attention's and transformers' l2norm with \f$\epsilon = 10^{-6}\f$): the query
/// and key normalisation of the delta rule (DeltaNet, Gated DeltaNet, Qwen3-Next).
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <type_traits>
#include <utility>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "feature_map.hpp"
#include "identity.hpp"

namespace linattn {
namespace detail {

// How acc + x·x is rounded in L2Normalize's squared norms: one way on every path (the single
// row of a decode step, the packets of a block, their scalar tails), so that a row's features
// do not depend on the path. Left to the compiler, the product and the sum are contracted
// into an FMA on some paths and not on others (GCC contracts Eigen's packets under
// -march=native but left the single-row loop alone; clang contracts only within one
// expression): the single-row and block features then differed by an ulp. So the operation is
// explicit: fused (std::fma, Eigen's pmadd) where the target has FMA, whose packets Eigen then
// fuses too; a product and a sum in two statements otherwise (no FMA instruction to contract
// them into). Where the target has FMA but Eigen's packet pmadd may not fuse, only the fused
// scalar is used.
#if defined(EIGEN_VECTORIZE_FMA) || (defined(__aarch64__) && defined(__ARM_FEATURE_FMA))
inline constexpr bool kFusedSquares = true, kFusedSquarePackets = true;
#elif defined(__FP_FAST_FMA) || defined(__FP_FAST_FMAF) || defined(__FMA__) || \
    defined(__ARM_FEATURE_FMA)
inline constexpr bool kFusedSquares = true, kFusedSquarePackets = false;
#else
inline constexpr bool kFusedSquares = false, kFusedSquarePackets = false;
#endif

// acc + x·x, rounded as above (the argument order of Eigen's binaryExpr: acc, then x).
template <class Scalar>
struct square_add_op {
  static constexpr bool fused = kFusedSquares && std::is_floating_point_v<Scalar>;

  Scalar operator()(const Scalar& acc, const Scalar& x) const {
    if constexpr (fused) {
      return std::fma(x, x, acc);
    } else {
      const Scalar square = x * x;
      return acc + square;
    }
  }

  template <class Packet>
  EIGEN_STRONG_INLINE Packet packetOp(const Packet& acc, const Packet& x) const {
    if constexpr (fused)
      return Eigen::internal::pmadd(x, x, acc);
    else
      return Eigen::internal::padd(acc, Eigen::internal::pmul(x, x));
  }
};

// Σ_k row_k² in the order k = 0, 1, ..., each step rounded as square_add_op: the squared norm
// of one row, whatever its stride.
template <class Row>
typename Row::Scalar squared_norm_in_order(const Row& row) {
  using S = typename Row::Scalar;
  const square_add_op<S> op;
  S acc(0);
  for (Index k = 0; k < row.size(); ++k) acc = op(acc, row(k));
  return acc;
}

}  // namespace detail

/// \brief \f$\varphi(x) = g / \sqrt{\|g\|_2^2 + \epsilon}\f$ with \f$g = \texttt{inner}(x)\f$, row
/// by row; F = inner.feature_dim(D); \f$\epsilon \ge 0\f$ (`eps()`, 0 by default).
///
/// With \f$\epsilon = 0\f$ (the default) the rows are divided by their norm:
/// \f$\varphi(x) = g / \|g\|_2\f$. With \f$\epsilon > 0\f$ the \f$\epsilon\f$ is added to the
/// squared norm before the square root, as flash-linear-attention's `l2norm` (its
/// `use_qk_l2norm_in_kernel`) and transformers' Qwen3-Next compute it with
/// \f$\epsilon = 10^{-6}\f$: \f$\varphi(x) = g \cdot (\sum_f g_f^2 + \epsilon)^{-1/2}\f$, in the
/// scalar type of the call (`L2Normalize<>(1e-6)`). (ggml's `l2_norm` divides by \f$\max(\|g\|,
/// \epsilon)\f$ instead, another function: the same as \f$\epsilon = 0\f$ here for every row of
/// norm at least its \f$\epsilon\f$.)
///
/// `L2Normalize<>` (Inner = Identity) is the query and key map of the delta rule in DeltaNet,
/// Gated DeltaNet and Qwen3-Next, whose kernels L2-normalise q and k only: the SiLU of those
/// models belongs to the short convolution over q, k and v before the kernel, part of the
/// model, not of the feature map. Run after that convolution and its SiLU, a model needs
/// `L2Normalize<>` (with \f$\epsilon = 10^{-6}\f$ to match the reference implementations);
/// `L2Normalize<Silu>` is \f$\mathrm{silu}(x) / \|\mathrm{silu}(x)\|\f$, the normalised SiLU of
/// inputs taken before any SiLU (on q and k only: v gets none). With \f$\epsilon = 0\f$ every
/// nonzero feature row is a unit vector, so
/// \f$\varphi(q)^\top\varphi(k) = \cos(g(q), g(k)) \in [-1, 1]\f$:
/// with the normalised kernels (linear_attention(), causal_linear_attention()) a denominator
/// can cancel, and the kernels then treat one that is rounding noise as 0 (docs/SPEC.md §2).
/// The flag nonnegative_features is that of Inner (dividing by a norm keeps signs).
///
/// Not elementwise (each feature depends on its whole row), so the kernels map it a block of
/// rows at a time. Each block is mapped by `inner` straight into the output, then normalised
/// in place: no allocation, and rows in a block are independent: the squared norm of every
/// row is summed over its features in the order f = 0, 1, ..., F − 1 with each step
/// \f$a \leftarrow a + g_f^2\f$ rounded the same way (fused where the target has FMA), so a
/// feature depends on its row only, bit for bit: not on the input's layout, the position of its
/// row in a block, or whether the row is mapped alone (a decode step) or in a block (a
/// prefill).
///
/// Edge cases, as NormalizedCosine: a zero row maps to the zero row (its gradient is 0 for
/// \f$\epsilon = 0\f$, \f$\nabla_\varphi / \sqrt\epsilon\f$ for \f$\epsilon > 0\f$); every finite
/// nonzero row maps to its true value whatever its magnitude: a row whose
/// \f$\|g\|^2 + \epsilon\f$ under- or overflows (entries beyond about 1e19 or below 1e-19 in float,
/// denormals included, with a tiny \f$\epsilon\f$) is divided by its largest magnitude first. A
/// row of g with a NaN or infinite entry maps to a row of NaN (so does its gradient).
///
/// \code
/// // The delta rule's q and k map of FLA / transformers (after the model's convolution + SiLU):
/// const linattn::L2Normalize<> fla(1e-6);
/// const linattn::L2Normalize<> unit;  // L2Normalize<Identity>, eps = 0: g / ‖g‖
/// const linattn::L2Normalize<linattn::Silu> normalised_silu;  // silu(x) / ‖silu(x)‖
/// Eigen::MatrixXf out = linattn::causal_linear_attention(Q, K, V, unit);
/// // An inner map with parameters is passed in:
/// linattn::L2Normalize<MyProjection> normed{MyProjection(W)};
/// \endcode
template <class Inner = Identity>
struct L2Normalize {
  static_assert(!normalizes_keys_per_feature_v<Inner>,
                "linattn::L2Normalize: the inner map must not normalise keys per feature (its "
                "key side is not `map`)");

  /// Non-negative features stay non-negative when divided by a norm.
  static constexpr bool nonnegative_features = detail::declares_nonnegative<Inner>::value;

  /// The map whose rows are normalised.
  Inner inner;

  /// Normalises the inner map's default, with ε = 0: each row divided by its norm.
  L2Normalize() = default;
  /// Normalises `inner_map`'s features, with ε = 0.
  /// \param inner_map the map whose rows are normalised.
  explicit L2Normalize(const Inner& inner_map) : inner(inner_map) {}
  /// \f$\epsilon\f$ added to every squared norm: finite and >= 0, else std::invalid_argument
  /// naming L2Normalize and the value.
  /// \param epsilon added to every squared norm before the root (finite, >= 0), so that a zero row
  ///     maps to zero.
  explicit L2Normalize(double epsilon) : eps_(checked_eps(epsilon)) {}
  /// Normalises `inner_map`'s features with ε = `epsilon`; the checks of L2Normalize(double).
  /// \param inner_map the map whose rows are normalised.
  /// \param epsilon added to every squared norm before the root (finite, >= 0).
  L2Normalize(const Inner& inner_map, double epsilon)
      : inner(inner_map), eps_(checked_eps(epsilon)) {}

  /// The \f$\epsilon\f$ added to the squared norms (0: rows divided by their norm).
  /// \return ε, as given to the constructor (default 0).
  double eps() const noexcept { return eps_; }

  /// The width of the features for inputs of width D.
  /// \param input_dim D, the width of a query or key row.
  /// \return the inner map's F: normalising changes no width.
  Index feature_dim(Index input_dim) const { return inner.feature_dim(input_dim); }

  /// Maps each row of x to its features.
  /// \param x n x D query or key rows, any Eigen expression.
  /// \param phi receives the n x F features, one row per row of x.
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x,
           MatrixRef<typename Derived::Scalar> phi) const {
    using S = typename Derived::Scalar;
    if constexpr (detail::declares_elementwise<Inner>::value) {
      // One token (the decode steps) in a contiguous buffer: the inner map and the scaling run
      // on packets, where a 1-row block of `phi` is strided (bench_decode). The squared norm is summed and rounded as in inverse_norms.
      if (detail::map_single_row(x, phi, [this](auto& row) {
            using Col = Eigen::Map<Matrix<S>, Eigen::Aligned>;
            const Col c(row.data(), row.size(), 1);
            inner.map(c, MatrixRef<S>(Col(row.data(), row.size(), 1)));
            const S t = detail::squared_norm_in_order(row) + S(eps_);
            if (safe_squared_norm(t))
              row *= S(1) / std::sqrt(t);
            else
              normalize_by_max(row.matrix(), S(eps_));
          }))
        return;
    }
    detail::RowScratch<S> scale;
    for (Index r0 = 0; r0 < x.rows(); r0 += detail::kMapRowBlock) {
      const Index n = std::min(detail::kMapRowBlock, x.rows() - r0);
      auto g = phi.middleRows(r0, n);
      inner.map(x.middleRows(r0, n), g);  // normalised in place while it is in cache
      Index bad[detail::kMapRowBlock];
      const Index n_bad = inverse_norms(g, scale, bad);
      // One row (the decode steps): a plain scaling; a broadcast over F one-entry columns costs
      // an expression per column.
      if (n == 1)
        g.row(0) *= scale(0);
      else
        g.array().colwise() *= scale.array();
      for (Index k = 0; k < n_bad; ++k) normalize_by_max(g.row(bad[k]), S(eps_));
    }
  }

  /// \f$\nabla_g = (\nabla_\varphi - \varphi\,(\varphi^\top\nabla_\varphi)) / \sqrt{\|g\|^2 +
  /// \epsilon}\f$ row by row (the Jacobian \f$(I - \varphi\varphi^\top)/\sqrt{\|g\|^2+\epsilon}\f$,
  /// symmetric; with \f$\epsilon = 0\f$, \f$(I - \hat g \hat g^\top)/\|g\|\f$), then \f$\nabla_x =
  /// \texttt{inner.backward}(x, \nabla_g)\f$. g is recomputed from x, a block of rows at a time, in
  /// buffers on the stack: no allocation when F <= 2048 (beyond, each call allocates two blocks of
  /// 256 x F). Rows of any magnitude are handled as in `map`; a zero row has gradient 0 for
  /// \f$\epsilon = 0\f$ and \f$\nabla_\varphi/\sqrt\epsilon\f$ otherwise. For a row with a tiny
  /// \f$\|g\|^2 + \epsilon\f$ (a denormal) the gradient, about \f$|\nabla_\varphi| /
  /// \sqrt{\|g\|^2+\epsilon}\f$, overflows to ±inf when it exceeds the largest finite value.
  /// \param x the n x D rows the features were computed from.
  /// \param grad_phi the n x F gradient with respect to φ(x).
  /// \param grad_x receives the n x D gradient with respect to x.
  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                MatrixRef<typename DX::Scalar> grad_x) const {
    using S = typename DX::Scalar;
    const Index F = inner.feature_dim(x.cols());
    if (x.rows() == 0) return;
    if (F <= kBackwardBuffer) {
      // Uninitialised: every entry read is written by inner.map first.
      alignas(EIGEN_MAX_ALIGN_BYTES > 16 ? EIGEN_MAX_ALIGN_BYTES : 16) S g_buf[kBackwardBuffer];
      alignas(EIGEN_MAX_ALIGN_BYTES > 16 ? EIGEN_MAX_ALIGN_BYTES : 16) S gg_buf[kBackwardBuffer];
      const Index rows = std::max<Index>(1, std::min(detail::kMapRowBlock, kBackwardBuffer / std::max<Index>(F, 1)));
      for (Index r0 = 0; r0 < x.rows(); r0 += rows) {
        const Index n = std::min(rows, x.rows() - r0);
        Eigen::Map<Matrix<S>> g(g_buf, n, F), gg(gg_buf, n, F);
        backward_block(x.middleRows(r0, n), grad_phi.middleRows(r0, n), g, gg,
                       grad_x.middleRows(r0, n));
      }
    } else {
      const Index rows = std::min(detail::kMapRowBlock, x.rows());
      Matrix<S> g_mat(rows, F), gg_mat(rows, F);
      for (Index r0 = 0; r0 < x.rows(); r0 += rows) {
        const Index n = std::min(rows, x.rows() - r0);
        Eigen::Map<Matrix<S>> g(g_mat.data(), n, F), gg(gg_mat.data(), n, F);
        backward_block(x.middleRows(r0, n), grad_phi.middleRows(r0, n), g, gg,
                       grad_x.middleRows(r0, n));
      }
    }
  }

 private:
  // The largest F whose backward block lives on the stack (2 x 16 KiB in double).
  static constexpr Index kBackwardBuffer = 2048;

  double eps_ = 0;

  static double checked_eps(double e) {
    if (!(e >= 0 && e <= std::numeric_limits<double>::max())) {
      std::ostringstream os;
      os.precision(std::numeric_limits<double>::max_digits10);
      os << "eps = " << e << ": eps must be finite and >= 0";
      detail::throw_invalid("L2Normalize", os.str());
    }
    return e;
  }

  // Whether 1/sqrt(n2) is the inverse norm to full precision: n2 is finite and far enough
  // above the smallest normal number that the denormal squares of tiny entries do not matter.
  // Otherwise (a zero, tiny, huge or non-finite row) normalize_by_max takes over.
  template <class S>
  static bool safe_squared_norm(S n2) {
    return n2 >= std::numeric_limits<S>::min() / std::numeric_limits<S>::epsilon() &&
           n2 <= std::numeric_limits<S>::max();
  }

  // scale(i) <- 1/sqrt(‖g_i‖² + eps) for the rows where that sum is safe; 1 for the others,
  // whose indices go to `bad` (returns how many). The squared norms are summed column by
  // column, vectorised across rows, in the same order and with the same rounding for every row
  // (detail::square_add_op; Eigen's rowwise().squaredNorm() sums packet rows and scalar rows in
  // different orders).
  template <class G, class Scale>
  Index inverse_norms(const G& g, Scale& scale, Index* bad) const {
    using S = typename G::Scalar;
    const Index n = g.rows();
    scale.resize(n);
    if (n == 1) {  // the recurrent step: the same sum, without a loop of 1-entry expressions
      scale(0) = detail::squared_norm_in_order(g.row(0));
    } else {
      scale.setZero();
      const detail::square_add_op<S> op;
      for (Index c = 0; c < g.cols(); ++c)
        scale.array() = scale.array().binaryExpr(g.col(c).array(), op);
    }
    const S e(eps_);
    Index n_bad = 0;
    for (Index i = 0; i < n; ++i) {
      scale(i) += e;
      if (safe_squared_norm(scale(i))) {
        scale(i) = S(1) / std::sqrt(scale(i));
      } else {
        scale(i) = S(1);  // left as is, normalised by normalize_by_max
        bad[n_bad++] = i;
      }
    }
    return n_bad;
  }

  // How normalize_by_max scaled a row: φ = g / (s·w), so the inverse norm is 1 / (s·w), applied
  // as a division by w, then by s (1/s alone may overflow). w = 0 for a zero row with eps = 0
  // (gradient 0), NaN for a non-finite row.
  template <class S>
  struct RowScaling {
    S s, w;
  };

  // row <- row / sqrt(‖row‖² + eps) through u = row / s, s = max|row_k|, whose squared norm is
  // in [1, F]: φ = u / sqrt(‖u‖² + eps/s²). Where eps/s² overflows, ‖row‖² (at most F·s²) is
  // negligible against eps and φ = row / sqrt(eps). A zero row stays 0; a row with a
  // non-finite entry becomes NaN.
  template <class Row, class S>
  static RowScaling<S> normalize_by_max(Row&& row, S eps) {
    if (!row.allFinite()) {
      row.setConstant(std::numeric_limits<S>::quiet_NaN());
      return {S(1), std::numeric_limits<S>::quiet_NaN()};
    }
    const S s = row.cwiseAbs().maxCoeff();
    if (s == S(0)) return {S(1), std::sqrt(eps)};  // φ = 0; gradient ∇φ / sqrt(eps) (0 if eps = 0)
    const S e = eps / s / s;
    if (!(e <= std::numeric_limits<S>::max())) {
      const S w = std::sqrt(eps);
      row *= S(1) / w;
      return {S(1), w};
    }
    row /= s;
    const S w = std::sqrt(detail::squared_norm_in_order(row) + e);
    row *= S(1) / w;
    return {s, w};
  }

  // One block of rows: g = inner(x), gg = ∇_g, grad_x = inner.backward(x, gg).
  template <class XB, class GB, class GX>
  void backward_block(const XB& x, const GB& grad_phi, Eigen::Map<Matrix<typename XB::Scalar>>& g,
                      Eigen::Map<Matrix<typename XB::Scalar>>& gg, GX&& grad_x) const {
    using S = typename XB::Scalar;
    const Index n = x.rows(), F = g.cols();
    inner.map(x, g);
    detail::RowScratch<S> inv, dot;
    Index bad[detail::kMapRowBlock];
    const Index n_bad = inverse_norms(g, inv, bad);
    g.array().colwise() *= inv.array();  // φ (the bad rows are fixed below)
    // ∇_g = (∇_φ − φ (φ·∇_φ)) / sqrt(‖g‖² + eps): the projection uses φ, not g, so that nothing
    // under- or overflows for rows of any safe magnitude.
    dot.setZero(n);
    for (Index c = 0; c < F; ++c) dot.array() += g.col(c).array() * grad_phi.col(c).array();
    for (Index c = 0; c < F; ++c)
      gg.col(c).array() = (grad_phi.col(c).array() - dot.array() * g.col(c).array()) * inv.array();
    for (Index k = 0; k < n_bad; ++k) {
      const Index i = bad[k];
      auto u = g.row(i);  // still g_i (scaled by 1): becomes φ_i
      const RowScaling<S> r = normalize_by_max(u, S(eps_));
      auto gi = gg.row(i);
      if (!(r.w == r.w)) {  // a non-finite row
        gi.setConstant(std::numeric_limits<S>::quiet_NaN());
      } else if (r.w == S(0)) {  // a zero row with eps = 0: gradient 0
        gi.setZero();
      } else {  // sqrt(‖g‖² + eps) = s·w; divided by each in turn (1/s alone may overflow)
        const S d = u.dot(grad_phi.row(i));
        gi = ((grad_phi.row(i) - d * u) / r.w) / r.s;
      }
    }
    inner.backward(x, gg, std::forward<GX>(grad_x));
  }
};

}  // namespace linattn

namespace Eigen::internal {
template <class Scalar>
struct functor_traits<linattn::detail::square_add_op<Scalar>> {
  enum {
    Cost = NumTraits<Scalar>::AddCost + NumTraits<Scalar>::MulCost,
    // Packets only where they round as the scalar operator does.
    PacketAccess = packet_traits<Scalar>::Vectorizable &&
                   (linattn::detail::kFusedSquarePackets || !linattn::detail::kFusedSquares),
  };
};
}  // namespace Eigen::internal
