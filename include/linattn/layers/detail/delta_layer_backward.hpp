/// \file layers/detail/delta_layer_backward.hpp
/// \brief Internals of the delta-rule layers' backward: the delta rule's gradients over packed
/// sequences, and the projections' gradients.
#pragma once

#include <Eigen/Core>
#include <string>
#include <utility>
#include <vector>

#include "../../core/common.hpp"
#include "../../core/detail/checks.hpp"
#include "../../core/gates.hpp"
#include "../../delta/delta_rule_backward.hpp"
#include "../../delta/options.hpp"
#include "../../linear/heads.hpp"
#include "../../linear/multihead_workspace.hpp"
#include "../gated_rms_norm.hpp"
#include "../short_convolution.hpp"
#include "delta_layer.hpp"

namespace linattn {
namespace detail {

// The delta rule's gradients over B packed sequences, each from a zero state: the multi-head
// backward of each sequence's rows into the same rows of dq, dk, dv, dbeta, dlog_a (an empty
// sequence has no rows to write).
template <class Phi, class DQ, class DK, class DV, class DB, class DA, class DO, class GQ,
          class GK, class GV, class GB, class GA, class S>
void packed_delta_backward(OffsetsRef off, Index heads, const Phi& phi, const DeltaOptions& o,
                           const DQ& q, const DK& k, const DV& v, const DB& beta, const DA& log_a,
                           const DO& dO, GQ& dq, GK& dk, GV& dv, GB& dbeta, GA& dlog_a,
                           MultiHeadWorkspace<S>& ws) {
  for (std::size_t b = 0; b + 1 < off.size(); ++b) {
    const Index r0 = off[b], n = off[b + 1] - r0;
    if (n == 0) continue;
    multihead_delta_rule_attention_backward(
        q.middleRows(r0, n), k.middleRows(r0, n), v.middleRows(r0, n), beta.middleRows(r0, n),
        log_a.middleRows(r0, n), dO.middleRows(r0, n), heads, phi, dq.middleRows(r0, n),
        dk.middleRows(r0, n), dv.middleRows(r0, n), dbeta.middleRows(r0, n),
        dlog_a.middleRows(r0, n), ws, o);
  }
}

// The inputs of a layer's backward: X of d columns, finite (the gates reject what is not), and
// dY of X's shape.
template <class DX, class DdY>
void check_backward_inputs(const char* fn, const Eigen::MatrixBase<DX>& X,
                           const Eigen::MatrixBase<DdY>& dY, Index d) {
  if (X.cols() != d)
    throw_invalid(fn, "X is " + shape_of(X) + " but must have hidden_size = " +
                          std::to_string(d) + " columns");
  if (dY.rows() != X.rows() || dY.cols() != d)
    throw_invalid(fn, "dY is " + shape_of(dY) + " but must be " + shape_of(X) + " (X's shape)");
  check_finite_entries(fn, "X", X);
}

// A projection Y = X Wᵀ's gradients: dW = dYᵀ X, and dX += dY W (dX = dY W with `first`).
template <class DdY, class DX, class DW, class GW, class GX>
void projection_backward(const DdY& dY, const DX& X, const DW& W, GW& dW, GX& dX, bool first) {
  dW.noalias() = dY.transpose() * X;
  if (first)
    dX.noalias() = dY * W;
  else
    dX.noalias() += dY * W;
}

// What the middle of a delta-rule layer's backward gives: the gradients of the convolution's
// input, the norm's gate, β, the log-decays, the convolution's and the norm's weights.
template <class S>
struct DeltaCoreGradients {
  RowMatrix<S> dmixed, dz, dbeta, dlog_a;
  Matrix<S> dconv_weight;
  Vector<S> dnorm_weight;
};

// The forward between a layer's projections and its output projection, kept for the
// backward: the convolution's input and output (q | k | v), β, the log-decays, the attention
// outputs before the norm, the norm's gate.
template <class S>
struct DeltaCoreForward {
  const RowMatrix<S>& mixed;
  const Matrix<S>& conv_weight;
  const RowMatrix<S>& c;
  const RowMatrix<S>& beta;
  const RowMatrix<S>& log_a;
  const RowMatrix<S>& o;
  const RowMatrix<S>& z;
};

// From dn = ∂L/∂(the gated norm's output) back through the norm, the delta rule (each packed
// sequence from a zero state) and the convolution (with SiLU, no bias).
template <class S, class Phi>
DeltaCoreGradients<S> delta_core_backward(OffsetsRef off, Index heads, Index key_dim,
                                          Index value_dim, const Phi& phi,
                                          const DeltaOptions& options,
                                          const DeltaCoreForward<S>& f,
                                          const Vector<S>& norm_weight,
                                          const GatedRMSNormOptions& norm_options,
                                          const Matrix<S>& dn) {
  const Index N = f.mixed.rows();
  DeltaCoreGradients<S> g;
  auto gn = gated_rms_norm_backward(f.o, f.z, norm_weight, dn, norm_options);
  g.dnorm_weight = std::move(gn.dweight);
  g.dz = gn.dZ;
  RowMatrix<S> dc(N, f.c.cols());
  g.dbeta.resize(N, f.beta.cols());
  g.dlog_a.resize(N, f.log_a.cols());
  auto dq = dc.leftCols(key_dim);
  auto dk = dc.middleCols(key_dim, key_dim);
  auto dv = dc.rightCols(value_dim);
  MultiHeadWorkspace<S> ws;
  packed_delta_backward(off, heads, phi, options, f.c.leftCols(key_dim),
                        f.c.middleCols(key_dim, key_dim), f.c.rightCols(value_dim), f.beta,
                        f.log_a, gn.dO, dq, dk, dv, g.dbeta, g.dlog_a, ws);
  auto gc = batched_short_convolution_backward(f.mixed, f.conv_weight, Vector<S>(), off,
                                               std::vector<ShortConvState<S>>(), dc);
  g.dmixed = gc.dX;
  g.dconv_weight = std::move(gc.dweight);
  return g;
}

}  // namespace detail
}  // namespace linattn
