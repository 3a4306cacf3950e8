/// \file core/gates.hpp
/// \brief The gate and writing-strength activations of the 2026 models, from their parameters,
/// with their gradients: Gated DeltaNet's and KDA's g = −exp(A_log)·softplus(a + dt_bias),
/// KDA's lower-bounded g = lb·sigmoid(exp(A_log)·(a + dt_bias)), and β = sigmoid(b) (× 2 for
/// β ∈ (0, 2)), as flash-linear-attention and transformers compute them (docs/SPEC.md §10.2).
///
/// The kernels take the log-decays g and β these produce (gated_linear_attention(),
/// delta_rule_attention()); the activations are O(N·H·C) against the kernels' O(N·H·D·M), a
/// separate pass vectorised (packet exp, log1p and division) and split over threads where that
/// pays, and their backward turns the kernels' dg and dβ into the gradients of A_log, dt_bias, a
/// and b.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <string>

#include "common.hpp"
#include "detail/checks.hpp"
#include "detail/packet_activations.hpp"
#include "detail/scalar_functions.hpp"
#include "parallel.hpp"

namespace linattn {

/// \brief How log-decays are made from a model's parameters (gate_activation()).
enum class GateActivation {
  /// g = −exp(A_log)·softplus(a + dt_bias): Gated DeltaNet (Qwen3-Next), Mamba-2, KDA.
  Softplus,
  /// g = lb·sigmoid(exp(A_log)·(a + dt_bias)), lb < 0: KDA's lower-bounded gate.
  LowerBoundSigmoid,
};

/// \brief The parameters of gate_activation(): its form and, for LowerBoundSigmoid, the lower
/// bound lb < 0 (g ∈ (lb, 0)).
struct GateOptions {
  GateActivation activation = GateActivation::Softplus;  ///< the form of g
  double lower_bound = -5.0;  ///< lb of LowerBoundSigmoid (FLA's default), < 0
};

namespace detail {

// a: N x H·C; A_log: H entries; dt_bias: H·C entries or none. Returns C.
template <class DA, class DL, class DB>
Index check_gate_parameters(const char* fn, const Eigen::MatrixBase<DA>& a,
                            const Eigen::MatrixBase<DL>& A_log,
                            const Eigen::MatrixBase<DB>& dt_bias, const GateOptions& opts) {
  const Index H = A_log.size();
  const auto shapes = [&] {
    return " (a is " + shape_of(a) + ", A_log is " + shape_of(A_log) + ", dt_bias is " +
           shape_of(dt_bias) + ")";
  };
  if ((A_log.rows() != 1 && A_log.cols() != 1) || H == 0 || a.cols() % H != 0)
    throw_invalid(fn, "A_log must be a vector of H > 0 entries, one per head, and a's columns "
                      "a multiple of H" + shapes());
  if (dt_bias.size() != 0 &&
      ((dt_bias.rows() != 1 && dt_bias.cols() != 1) || dt_bias.size() != a.cols()))
    throw_invalid(fn, "dt_bias must be empty or a vector of a.cols() = " +
                          std::to_string(a.cols()) + " entries" + shapes());
  if (opts.activation == GateActivation::LowerBoundSigmoid &&
      !(opts.lower_bound < 0 && std::isfinite(opts.lower_bound)))
    throw_invalid(fn, "lower_bound = " + value_string(opts.lower_bound) +
                          " must be finite and < 0");
  return a.cols() / H;
}

template <class DA>
void check_finite_entries(const char* fn, const char* name, const Eigen::MatrixBase<DA>& x) {
  // x − x is 0 where x is finite and NaN elsewhere; Eigen sums it in storage order, vectorised
  // (allFinite() walks a row-major x column by column). The search below names the entry.
  const auto v = x.derived().array();
  if (static_cast<double>((v - v).sum()) == 0.0) return;
  for (Index c = 0; c < x.cols(); ++c)
    for (Index r = 0; r < x.rows(); ++r) {
      const double v = static_cast<double>(x.coeff(r, c));
      if (!std::isfinite(v))
        throw_invalid(fn, std::string(name) + "(" + std::to_string(r) + ", " + std::to_string(c) +
                              ") = " + value_string(v) + ": must be finite");
    }
}

template <class D>
typename D::Scalar vector_entry(const D& v, Index i) {
  return v.rows() == 1 ? v.coeff(0, i) : v.coeff(i, 0);
}

// rows(t0, t1) over [0, N) split into one range per thread that N rows of `row_work` flops each
// pay for (threads_for()); serially inside a parallel region. Every entry is computed alone, so
// the bits do not depend on the split.
template <class Rows>
void activation_rows(Index N, double row_work, const ParallelOptions& par, const Rows& rows) {
  const int threads =
      in_parallel_region()
          ? 1
          : static_cast<int>(std::min<Index>(threads_for(par, double(N) * row_work), N));
  if (threads <= 1) {
    rows(Index(0), N);
    return;
  }
  run_team(threads, executor_of(par),
           [&](int t, int nt) { rows(Index(t) * N / nt, Index(t + 1) * N / nt); });
}

}  // namespace detail

namespace detail {

// gate_activation() after its checks: the in-kernel gates run this same code (bit for bit).
template <class DA, class DL, class DB, class DG>
void apply_gate_activation(const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DL>& A_log,
                           const Eigen::MatrixBase<DB>& dt_bias, const Eigen::MatrixBase<DG>& g,
                           const GateOptions& options, const ParallelOptions& par) {
  using S = compute_scalar_t<typename DG::Scalar>;  // float for bf16 / half outputs
  using T = typename DG::Scalar;
  const Index C = A_log.size() ? a.cols() / A_log.size() : 0;
  auto& out = writable(g);
  const S lb = static_cast<S>(options.lower_bound);
  const bool softplus = options.activation == GateActivation::Softplus;
  const Index J = a.cols();
  // g(t, j) = (−rate_j)·softplus(x) or lb·sigmoid(rate_j·x), x = a(t, j) + bias_j, entry by
  // entry (the functors' scalar paths are their packet paths): along rows or columns, as the
  // output is laid out, with the same bits. -rate·softplus can overflow to -inf for huge rates:
  // a reset, exp(-inf) = 0.
  const auto rate_of = [&](Index j) {
    const S r = std::exp(static_cast<S>(vector_entry(A_log.derived(), j / C)));
    return softplus ? -r : r;
  };
  const auto bias_of = [&](Index j) {
    return dt_bias.size() ? static_cast<S>(vector_entry(dt_bias.derived(), j)) : S(0);
  };
  const auto rows = [&](Index t0, Index t1) {
    if constexpr (bool(DG::IsRowMajor)) {
      constexpr Index kChunk = 256;  // columns whose rates and biases sit on the stack
      Eigen::Array<S, 1, Eigen::Dynamic, Eigen::RowMajor, 1, kChunk> rate, bias;
      for (Index j0 = 0; j0 < J; j0 += kChunk) {
        const Index n = std::min(kChunk, J - j0);
        rate.resize(n);
        bias.resize(n);
        for (Index j = 0; j < n; ++j) rate(j) = rate_of(j0 + j), bias(j) = bias_of(j0 + j);
        for (Index t = t0; t < t1; ++t) {
          const auto x = a.row(t).segment(j0, n).template cast<S>().array() + bias;
          auto dst = out.row(t).segment(j0, n);
          if (softplus)
            dst = (rate * x.unaryExpr(softplus_op<S>())).template cast<T>().matrix();
          else
            dst = (lb * (rate * x).unaryExpr(sigmoid_op<S>())).template cast<T>().matrix();
        }
      }
    } else {
      for (Index j = 0; j < J; ++j) {
        const S rate = rate_of(j), bias = bias_of(j);
        const auto x = a.col(j).segment(t0, t1 - t0).template cast<S>().array() + bias;
        auto dst = out.col(j).segment(t0, t1 - t0);
        if (softplus)
          dst = (rate * x.unaryExpr(softplus_op<S>())).template cast<T>().matrix();
        else
          dst = (lb * (rate * x).unaryExpr(sigmoid_op<S>())).template cast<T>().matrix();
      }
    }
  };
  activation_rows(a.rows(), 40.0 * double(J), par, rows);
}

}  // namespace detail

/// \brief Log-decays from a model's parameters: column j = h·C + c of `a` (head h, channel c)
/// gives g(t, j) = −exp(A_log_h)·softplus(a(t, j) + dt_bias_j) (GateActivation::Softplus), or
/// lb·sigmoid(exp(A_log_h)·(a(t, j) + dt_bias_j)) (LowerBoundSigmoid), every entry <= 0 and
/// finite for finite inputs. C = 1 (a N x H: Gated DeltaNet's one decay per head) or the key
/// size (a N x H·K: KDA's per-channel decays, the kernels' N x H·F log_a).
/// \throws std::invalid_argument on shapes that do not fit (naming them), a non-finite
/// parameter (naming the entry), or a lower bound that is not finite and < 0.
/// \code
/// // Qwen3-Next: a = x W_a (N x 32), A_log and dt_bias of 32 entries, the layer's parameters.
/// Eigen::MatrixXf g(N, 32);
/// linattn::gate_activation(a, A_log, dt_bias, g);
/// linattn::multihead_delta_rule_attention(Q, K, V, beta, g, 32, phi, out, ws, opts);
/// \endcode
/// \param a N x H·C pre-activations, any Eigen expression.
/// \param A_log H per-head log-rates (exp(A_log) > 0 scales the decay).
/// \param dt_bias H·C biases added to a, or an empty vector for none.
/// \param g receives the N x H·C log-decays.
/// \param options the form (and KDA's lower bound).
/// \param par the threads (default: OpenMP's, where the call's work pays for them): the rows
///     are split over them, with the same bits for any count.
template <class DA, class DL, class DB, class DG>
void gate_activation(const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DL>& A_log,
                     const Eigen::MatrixBase<DB>& dt_bias, const Eigen::MatrixBase<DG>& g,
                     const GateOptions& options = {}, const ParallelOptions& par = {}) {
  const char* fn = "gate_activation";
  detail::check_gate_parameters(fn, a, A_log, dt_bias, options);
  if (g.rows() != a.rows() || g.cols() != a.cols())
    detail::throw_invalid(fn, "g is " + detail::shape_of(g) + " but must be " +
                                  detail::shape_of(a) + " (the shape of a)");
  detail::check_finite_entries(fn, "a", a);
  detail::check_finite_entries(fn, "A_log", A_log);
  detail::check_finite_entries(fn, "dt_bias", dt_bias);
  detail::apply_gate_activation(a, A_log, dt_bias, g, options, par);
}

namespace detail {

// gate_activation_backward() after its checks (shared with the in-kernel gates' backward).
template <class DA, class DL, class DB, class DdG, class DdA, class DdL, class DdB>
void apply_gate_activation_backward(const Eigen::MatrixBase<DA>& a,
                                    const Eigen::MatrixBase<DL>& A_log,
                                    const Eigen::MatrixBase<DB>& dt_bias,
                                    const Eigen::MatrixBase<DdG>& dg,
                                    const Eigen::MatrixBase<DdA>& da,
                                    const Eigen::MatrixBase<DdL>& dA_log,
                                    const Eigen::MatrixBase<DdB>& ddt_bias,
                                    const GateOptions& options) {
  using S = typename DdA::Scalar;
  const Index H = A_log.size(), C = a.cols() / H;
  auto& gda = writable(da);
  auto& gl = writable(dA_log);
  auto& gb = writable(ddt_bias);
  const S lb = static_cast<S>(options.lower_bound);
  for (Index h = 0; h < H; ++h) gl.coeffRef(h) = S(0);
  for (Index j = 0; j < a.cols(); ++j) {
    const S rate = std::exp(static_cast<S>(vector_entry(A_log.derived(), j / C)));
    const S bias = dt_bias.size() ? static_cast<S>(vector_entry(dt_bias.derived(), j)) : S(0);
    S sum_da = 0, sum_dl = 0;
    for (Index t = 0; t < a.rows(); ++t) {
      const S x = static_cast<S>(a.coeff(t, j)) + bias, d = static_cast<S>(dg.coeff(t, j));
      S dx, dl;
      if (options.activation == GateActivation::Softplus) {
        dx = -rate * sigmoid(x) * d;  // softplus' = sigmoid
        dl = -rate * softplus(x) * d;  // ∂g/∂A_log = g
      } else {
        const S s = sigmoid(rate * x), ds = lb * s * (S(1) - s) * d;
        dx = ds * rate;
        dl = ds * rate * x;
      }
      gda(t, j) = dx;
      sum_da += dx;
      sum_dl += dl;
    }
    gl.coeffRef(j / C) += sum_dl;
    if (dt_bias.size()) gb.coeffRef(j) = sum_da;
  }
}

}  // namespace detail

/// \brief The gradients of gate_activation(): from dg = ∂L/∂g (the kernels' dlog_a or
/// dlog_gates), ∂L/∂a (N x H·C), ∂L/∂A_log (H) and ∂L/∂dt_bias (H·C; left untouched when
/// dt_bias is empty).
/// \code
/// auto k = linattn::multihead_delta_rule_attention_backward(Q, K, V, beta, g, dOut, 32, phi, opts);
/// linattn::gate_activation_backward(a, A_log, dt_bias, k.dlog_a, da, dA_log, ddt_bias);
/// \endcode
/// \param a the pre-activations of the forward call.
/// \param A_log its per-head log-rates.
/// \param dt_bias its biases (or empty).
/// \param dg the N x H·C gradient with respect to g.
/// \param da receives ∂L/∂a, N x H·C.
/// \param dA_log receives ∂L/∂A_log, H entries.
/// \param ddt_bias receives ∂L/∂dt_bias, H·C entries (ignored when dt_bias is empty).
/// \param options the form of the forward call.
template <class DA, class DL, class DB, class DdG, class DdA, class DdL, class DdB>
void gate_activation_backward(const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DL>& A_log,
                              const Eigen::MatrixBase<DB>& dt_bias,
                              const Eigen::MatrixBase<DdG>& dg, const Eigen::MatrixBase<DdA>& da,
                              const Eigen::MatrixBase<DdL>& dA_log,
                              const Eigen::MatrixBase<DdB>& ddt_bias,
                              const GateOptions& options = {}) {
  const char* fn = "gate_activation_backward";
  detail::check_gate_parameters(fn, a, A_log, dt_bias, options);
  const Index H = A_log.size();
  if (dg.rows() != a.rows() || dg.cols() != a.cols() || da.rows() != a.rows() ||
      da.cols() != a.cols() || dA_log.size() != H ||
      (dt_bias.size() != 0 && ddt_bias.size() != a.cols()))
    detail::throw_invalid(fn, "dg is " + detail::shape_of(dg) + ", da " + detail::shape_of(da) +
                                  ", dA_log " + detail::shape_of(dA_log) + ", ddt_bias " +
                                  detail::shape_of(ddt_bias) + " but must be the shapes of a (" +
                                  detail::shape_of(a) + "), A_log (" + std::to_string(H) +
                                  " entries) and dt_bias");
  detail::apply_gate_activation_backward(a, A_log, dt_bias, dg, da, dA_log, ddt_bias, options);
}

namespace detail {

// beta_activation() after its checks (shared with the in-kernel β of the delta rule).
template <class DB, class DOut>
void apply_beta_activation(const Eigen::MatrixBase<DB>& b, const Eigen::MatrixBase<DOut>& beta,
                           bool times_two, const ParallelOptions& par) {
  using S = compute_scalar_t<typename DOut::Scalar>;  // float for bf16 / half outputs
  auto& out = writable(beta);
  const S m = times_two ? S(2) : S(1);
  activation_rows(b.rows(), 20.0 * double(b.cols()), par, [&](Index t0, Index t1) {
    out.middleRows(t0, t1 - t0) =
        (m * b.middleRows(t0, t1 - t0).template cast<S>().array().unaryExpr(sigmoid_op<S>()))
            .template cast<typename DOut::Scalar>()
            .matrix();
  });
}

}  // namespace detail

/// \brief Writing strengths from a model's pre-activations: β = sigmoid(b), or 2·sigmoid(b)
/// with `times_two` (β ∈ (0, 2), negative eigenvalues of the delta rule's transition), as the
/// kernels' beta (N x H).
/// \code
/// Eigen::MatrixXf beta(N, 32);
/// linattn::beta_activation(b, beta);  // Qwen3-Next: b = x W_b
/// \endcode
/// \param b N x H pre-activations (finite).
/// \param beta receives the N x H writing strengths.
/// \param times_two whether β = 2·sigmoid(b).
/// \param par the threads (default: OpenMP's, where the call's work pays for them).
template <class DB, class DOut>
void beta_activation(const Eigen::MatrixBase<DB>& b, const Eigen::MatrixBase<DOut>& beta,
                     bool times_two = false, const ParallelOptions& par = {}) {
  const char* fn = "beta_activation";
  if (beta.rows() != b.rows() || beta.cols() != b.cols())
    detail::throw_invalid(fn, "beta is " + detail::shape_of(beta) + " but must be " +
                                  detail::shape_of(b) + " (the shape of b)");
  detail::check_finite_entries(fn, "b", b);
  detail::apply_beta_activation(b, beta, times_two, par);
}

/// \brief The gradient of beta_activation(): ∂L/∂b = ∂L/∂β · m·σ(b)(1 − σ(b)).
/// \code
/// linattn::beta_activation_backward(b, k.dbeta, db);
/// \endcode
/// \param b the pre-activations of the forward call.
/// \param dbeta the gradient with respect to β (the kernels' dbeta).
/// \param db receives ∂L/∂b.
/// \param times_two as in the forward call.
template <class DB, class DdBeta, class DdB>
void beta_activation_backward(const Eigen::MatrixBase<DB>& b, const Eigen::MatrixBase<DdBeta>& dbeta,
                              const Eigen::MatrixBase<DdB>& db, bool times_two = false) {
  using S = typename DdB::Scalar;
  const char* fn = "beta_activation_backward";
  if (dbeta.rows() != b.rows() || dbeta.cols() != b.cols() || db.rows() != b.rows() ||
      db.cols() != b.cols())
    detail::throw_invalid(fn, "dbeta is " + detail::shape_of(dbeta) + ", db " +
                                  detail::shape_of(db) + " but both must be " +
                                  detail::shape_of(b) + " (the shape of b)");
  auto& out = detail::writable(db);
  const S m = times_two ? S(2) : S(1);
  for (Index j = 0; j < b.cols(); ++j)
    for (Index t = 0; t < b.rows(); ++t) {
      const S s = detail::sigmoid(static_cast<S>(b.coeff(t, j)));
      out(t, j) = static_cast<S>(dbeta.coeff(t, j)) * m * s * (S(1) - s);
    }
}

}  // namespace linattn
