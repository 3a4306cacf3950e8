/// \file layers/gated_rms_norm.hpp
/// \brief The gated RMSNorm of the 2026 layers: per head, the attention output normalised by its
/// root mean square, scaled by a weight and gated by SiLU(z) (Gated DeltaNet, Qwen3-Next) or
/// sigmoid(z) (KDA, Kimi Linear), norm before gate, in float for bf16 / half storage; and its
/// backward (docs/SPEC.md §10.5).
///
/// \code
/// // Qwen3-Next: o and z N x 32·128, the norm's weight 128 entries shared by the heads.
/// linattn::GatedRMSNormOptions opts;  // eps 1e-6, SiLU
/// Eigen::MatrixXf y = linattn::gated_rms_norm(o, z, weight, opts);
/// \endcode
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "../core/common.hpp"
#include "../core/detail/checks.hpp"
#include "../core/parallel.hpp"
#include "detail/gated_rms_norm.hpp"

namespace linattn {

/// \brief The gate of gated_rms_norm().
enum class NormGate {
  Silu,     ///< y = norm(o) ∘ w ∘ SiLU(z): Gated DeltaNet (Qwen3-Next's RMSNormGated)
  Sigmoid,  ///< y = norm(o) ∘ w ∘ sigmoid(z): KDA (Kimi Linear's FusedRMSNormGated)
};

/// \brief Options of gated_rms_norm().
struct GatedRMSNormOptions {
  double eps = 1e-6;  ///< added to the mean square (transformers' and FLA's 1e-6), >= 0
  NormGate gate = NormGate::Silu;  ///< the gate's activation
};

/// \brief The gradients of gated_rms_norm(): ∂L/∂o and ∂L/∂z (N x H·M) and ∂L/∂weight (M).
template <class Scalar>
struct GatedRMSNormGradients {
  Matrix<Scalar> dO;       ///< N x H·M
  Matrix<Scalar> dZ;       ///< N x H·M
  Vector<Scalar> dweight;  ///< M entries
};

namespace detail {

template <class DO, class DZ, class DW>
Index check_gated_norm(const char* fn, const Eigen::MatrixBase<DO>& o,
                       const Eigen::MatrixBase<DZ>& z, const Eigen::MatrixBase<DW>& weight,
                       const GatedRMSNormOptions& opts) {
  static_assert(std::is_same_v<compute_scalar_t<typename DO::Scalar>,
                               compute_scalar_t<typename DZ::Scalar>> &&
                    std::is_same_v<compute_scalar_t<typename DO::Scalar>,
                                   compute_scalar_t<typename DW::Scalar>>,
                "linattn: o, z and weight must share one scalar type (bf16 / half storage "
                "computes in float)");
  const auto shapes = [&] {
    return " (o is " + shape_of(o) + ", z is " + shape_of(z) + ", weight is " + shape_of(weight) +
           ")";
  };
  const Index M = weight.size();
  if ((weight.rows() != 1 && weight.cols() != 1) || M == 0 || o.cols() % M != 0)
    throw_invalid(fn,
                  "weight must be a vector of M > 0 entries (one head's size) and o's "
                  "columns a multiple of M" +
                      shapes());
  if (z.rows() != o.rows() || z.cols() != o.cols())
    throw_invalid(fn, "z must have o's shape" + shapes());
  if (!(opts.eps >= 0) || !std::isfinite(opts.eps))
    throw_invalid(fn, "eps = " + value_string(opts.eps) + " must be finite and >= 0");
  return M;
}

}  // namespace detail

/// \brief y = (o / sqrt(mean(o²) + eps)) ∘ weight ∘ act(z) over each head's M columns of each
/// row (M = weight.size(); head h in columns [h·M, (h+1)·M)), computed in float or double and
/// rounded once to out's scalar. Allocation-free; vectorised when o, z and out are row-major.
/// \param o N x H·M attention outputs (any Eigen expression; float, double, bf16, half).
/// \param z N x H·M gate pre-activations.
/// \param weight M entries, shared by the heads.
/// \param out receives N x H·M; may be o or z itself (each row group is read before written).
/// \param options eps and the gate.
/// \param par the threads (default: OpenMP's, where the call's work pays for them): the rows
///     are split over them, with the same bits for any count.
/// \throws std::invalid_argument on shapes that do not fit or a negative or non-finite eps.
template <class DO, class DZ, class DW, class DOut>
void gated_rms_norm(const Eigen::MatrixBase<DO>& o, const Eigen::MatrixBase<DZ>& z,
                    const Eigen::MatrixBase<DW>& weight, const Eigen::MatrixBase<DOut>& out,
                    const GatedRMSNormOptions& options = {}, const ParallelOptions& par = {}) {
  using S = compute_scalar_t<typename DO::Scalar>;
  const char* fn = "gated_rms_norm";
  const Index M = detail::check_gated_norm(fn, o, z, weight, options);
  detail::check_output(fn, out, o.rows(), o.cols());
  auto& dst = detail::writable(out);
  const S eps = static_cast<S>(options.eps);
  const bool silu = options.gate == NormGate::Silu;
  const Index N = o.rows();
  const auto run = [&](const auto& w) {
    const int threads =
        detail::in_parallel_region()
            ? 1
            : static_cast<int>(std::min<Index>(
                  detail::threads_for(par, detail::norm_work(N, o.cols())), std::max<Index>(N, 1)));
    const auto rows = [&](Index t0, Index t1) {
      detail::gated_norm_rows<S>(o.derived(), z.derived(), w, t0, t1, M, eps, silu, dst);
    };
    if (threads <= 1) return rows(0, N);
    detail::run_team(threads, detail::executor_of(par),
                     [&](int t, int nt) { rows(t * N / nt, (t + 1) * N / nt); });
  };
  // The weight in place when it is a contiguous vector of the compute scalar (the kernel then
  // runs on packets throughout), else read entry by entry: the same arithmetic either way.
  Index rs = 0, cs = 0;
  const S* wp = detail::strided_base<S>(weight.derived(), rs, cs);
  if (wp && (weight.cols() == 1 ? rs : cs) == 1)
    run(Eigen::Map<const Vector<S>>(wp, M));
  else
    run(weight.reshaped());
}

/// \brief gated_rms_norm() returning the N x H·M result in o's scalar type.
/// \param o N x H·M attention outputs.
/// \param z N x H·M gate pre-activations.
/// \param weight M entries.
/// \param options eps and the gate.
/// \return the normalised, gated outputs.
template <class DO, class DZ, class DW>
Matrix<typename DO::Scalar> gated_rms_norm(const Eigen::MatrixBase<DO>& o,
                                           const Eigen::MatrixBase<DZ>& z,
                                           const Eigen::MatrixBase<DW>& weight,
                                           const GatedRMSNormOptions& options = {}) {
  Matrix<typename DO::Scalar> out(o.rows(), o.cols());
  gated_rms_norm(o, z, weight, out, options);
  return out;
}

/// \brief The gradients of gated_rms_norm() for ∂L/∂y = dY: with r = (mean(o²) + eps)^{-1/2},
/// n = r·o, g = act(z) and a = dY ∘ g ∘ w per head, ∂L/∂o = r (a − n · mean(a ∘ n)),
/// ∂L/∂z = dY ∘ n ∘ w ∘ act'(z), ∂L/∂w = Σ dY ∘ n ∘ g over rows and heads.
/// \code
/// auto g = linattn::gated_rms_norm_backward(o, z, weight, dY);  // g.dO, g.dZ, g.dweight
/// \endcode
/// \param o the forward call's N x H·M outputs.
/// \param z its gate pre-activations.
/// \param weight its M weights.
/// \param dY N x H·M gradient of the result.
/// \param options the forward call's eps and gate.
/// \return dO, dZ, dweight.
template <class DO, class DZ, class DW, class DdY>
GatedRMSNormGradients<compute_scalar_t<typename DO::Scalar>> gated_rms_norm_backward(
    const Eigen::MatrixBase<DO>& o, const Eigen::MatrixBase<DZ>& z,
    const Eigen::MatrixBase<DW>& weight, const Eigen::MatrixBase<DdY>& dY,
    const GatedRMSNormOptions& options = {}) {
  using S = compute_scalar_t<typename DO::Scalar>;
  const char* fn = "gated_rms_norm_backward";
  const Index M = detail::check_gated_norm(fn, o, z, weight, options);
  if (dY.rows() != o.rows() || dY.cols() != o.cols())
    detail::throw_invalid(fn, "dY is " + detail::shape_of(dY) + " but must be " +
                                  detail::shape_of(o) + " (o's shape)");
  GatedRMSNormGradients<S> g;
  g.dweight.setZero(M);
  const auto w = weight.reshaped();
  const S eps = static_cast<S>(options.eps);
  const bool silu = options.gate == NormGate::Silu;
  // Row by row into row-major buffers (the kernel walks each row's groups), then column-major.
  using Rows = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Rows dO(o.rows(), o.cols()), dZ(o.rows(), o.cols());
  for (Index t = 0; t < o.rows(); ++t)
    for (Index c0 = 0; c0 < o.cols(); c0 += M)
      detail::gated_norm_group_backward<S>(o.derived(), z.derived(), w, dY.derived(), t, c0, M, eps,
                                           silu, dO, dZ, g.dweight);
  g.dO = dO;
  g.dZ = dZ;
  return g;
}

}  // namespace linattn
