/// \file layers/detail/projections.hpp
/// \brief The projections every attention layer shares (internal): the weights, their
/// initialisation, the projected rows and their gradients.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../batched_layer.hpp"
#include "../../core/detail/checks.hpp"
#include "../../core/common.hpp"
#include "../../maps/elu_plus_one.hpp"
#include "../../linear/linear_attention_backward.hpp"
#include "../../linear/multihead.hpp"
#include "../../linear/multihead_backward.hpp"
#include "../../linear/recurrent_linear_attention.hpp"
#include "../../softmax/softmax_attention.hpp"
#include "../../softmax/softmax_attention_backward.hpp"
#include "../../maps/map_state.hpp"
#include "../../core/gradients.hpp"

namespace linattn {

namespace detail {

// The vectors a step works in: the token x, its q, k, v, the heads' outputs o and the row y.
template <class Scalar>
struct TokenBuffers {
  TokenBuffers(Index d_model, Index heads, Index key_dim, Index value_dim)
      : x(d_model),
        q(heads * key_dim),
        k(heads * key_dim),
        v(heads * value_dim),
        o(heads * value_dim),
        y(d_model) {}
  Vector<Scalar> x, q, k, v, o, y;
};

/// The weights, biases and shape checks that both layers share (spec §6): with H heads of key
/// size D and value size M,
///   Q = X Wqᵀ + bq,  K = X Wkᵀ + bk,  V = X Wvᵀ + bv,  Y = A Woᵀ + bo,
/// where A holds every head's attention output side by side (head h in columns [h·M, (h+1)·M)).
template <class Scalar>
class AttentionProjections {
  static_assert(is_supported_scalar_v<Scalar>, "linattn: the scalar type must be float or double");

 public:
  /// Weights in the layout of `torch.nn.Linear::weight` (out x in): Wq and Wk are (H·D) x
  /// d_model, Wv is (H·M) x d_model, Wo is d_model x (H·M).
  Matrix<Scalar> Wq, Wk, Wv, Wo;
  /// Biases (zero after construction): bq, bk of H·D entries, bv of H·M, bo of d_model.
  Vector<Scalar> bq, bk, bv, bo;

  Index d_model() const noexcept { return d_model_; }
  Index num_heads() const noexcept { return heads_; }
  Index key_dim() const noexcept { return key_dim_; }
  Index value_dim() const noexcept { return value_dim_; }

  /// Weights drawn uniformly from [-1/√in, 1/√in] (the default of `torch.nn.Linear`), from a
  /// std::mt19937 seeded with `seed`; biases zero.
  void reset_parameters(std::uint32_t seed = 0) {
    std::mt19937 gen(seed);
    const auto fill = [&gen](Matrix<Scalar>& W) {
      const double bound = 1.0 / std::sqrt(double(W.cols()));
      std::uniform_real_distribution<double> u(-bound, bound);
      for (Index j = 0; j < W.cols(); ++j)
        for (Index i = 0; i < W.rows(); ++i) W(i, j) = Scalar(u(gen));
    };
    fill(Wq);
    fill(Wk);
    fill(Wv);
    fill(Wo);
    bq.setZero();
    bk.setZero();
    bv.setZero();
    bo.setZero();
  }

 protected:
  AttentionProjections(const char* name, Index d_model, Index heads, Index key_dim,
                       Index value_dim)
      : d_model_(d_model), heads_(heads), key_dim_(key_dim), value_dim_(value_dim) {
    if (d_model <= 0 || heads <= 0 || key_dim <= 0 || value_dim <= 0)
      throw_invalid(name, "d_model, num_heads, key_dim and value_dim must be positive (got " +
                              std::to_string(d_model) + ", " + std::to_string(heads) + ", " +
                              std::to_string(key_dim) + ", " + std::to_string(value_dim) + ")");
    Wq.resize(heads * key_dim, d_model);
    Wk.resize(heads * key_dim, d_model);
    Wv.resize(heads * value_dim, d_model);
    Wo.resize(d_model, heads * value_dim);
    bq.resize(heads * key_dim);
    bk.resize(heads * key_dim);
    bv.resize(heads * value_dim);
    bo.resize(d_model);
    reset_parameters();
  }

  // Head sizes d_model / heads, which must divide.
  static Index head_size(const char* name, Index d_model, Index heads) {
    if (heads <= 0 || d_model <= 0 || d_model % heads != 0)
      throw_invalid(name, "d_model (" + std::to_string(d_model) +
                              ") must be a positive multiple of num_heads (" +
                              std::to_string(heads) + ")");
    return d_model / heads;
  }

  // The weights are public members: a caller may have given them other shapes.
  void check_parameters(const char* fn) const {
    const Index HD = heads_ * key_dim_, HM = heads_ * value_dim_;
    const auto check = [fn](const char* name, Index rows, Index cols, Index want_rows,
                            Index want_cols) {
      if (rows != want_rows || cols != want_cols)
        throw_invalid(fn, std::string(name) + " is " + std::to_string(rows) + "x" +
                              std::to_string(cols) + " but must be " + std::to_string(want_rows) +
                              "x" + std::to_string(want_cols));
    };
    check("Wq", Wq.rows(), Wq.cols(), HD, d_model_);
    check("Wk", Wk.rows(), Wk.cols(), HD, d_model_);
    check("Wv", Wv.rows(), Wv.cols(), HM, d_model_);
    check("Wo", Wo.rows(), Wo.cols(), d_model_, HM);
    check("bq", bq.size(), 1, HD, 1);
    check("bk", bk.size(), 1, HD, 1);
    check("bv", bv.size(), 1, HM, 1);
    check("bo", bo.size(), 1, d_model_, 1);
  }

  template <class DX>
  void check_rows(const char* fn, const char* name, const Eigen::MatrixBase<DX>& X) const {
    static_assert(std::is_same_v<typename DX::Scalar, Scalar>,
                  "linattn: the input's scalar type must be the layer's");
    if (X.cols() != d_model_)
      throw_invalid(fn, std::string(name) + " is " + shape_of(X) + " but must have d_model = " +
                            std::to_string(d_model_) + " columns");
  }

  // Q, K, V of the rows of X (resized).
  template <class DX>
  void project(const Eigen::MatrixBase<DX>& X, Matrix<Scalar>& Q, Matrix<Scalar>& K,
               Matrix<Scalar>& V) const {
    Q.noalias() = X * Wq.transpose();
    Q.rowwise() += bq.transpose();
    K.noalias() = X * Wk.transpose();
    K.rowwise() += bk.transpose();
    V.noalias() = X * Wv.transpose();
    V.rowwise() += bv.transpose();
  }

  // Y = A Woᵀ + bo.
  Matrix<Scalar> output(const Matrix<Scalar>& A) const {
    Matrix<Scalar> Y = A * Wo.transpose();
    Y.rowwise() += bo.transpose();
    return Y;
  }

  // The first half of a step: checks, then x (copied first: y may be its memory) projected into
  // b.q, b.k, b.v. Allocates nothing.
  template <class DXv, class DYv>
  void step_in(const char* fn, const Eigen::MatrixBase<DXv>& x, const Eigen::MatrixBase<DYv>& y,
               TokenBuffers<Scalar>& b) const {
    static_assert(std::is_same_v<typename DXv::Scalar, Scalar>,
                  "linattn: the token's scalar type must be the layer's");
    check_parameters(fn);
    check_token(fn, "x", x, d_model_);
    check_token(fn, "y", y, d_model_);
    b.x = x.reshaped();
    b.q.noalias() = Wq * b.x;
    b.q += bq;
    b.k.noalias() = Wk * b.x;
    b.k += bk;
    b.v.noalias() = Wv * b.x;
    b.v += bv;
  }

  // The second half: y = Wo b.o + bo.
  template <class DYv>
  void step_out(TokenBuffers<Scalar>& b, const Eigen::MatrixBase<DYv>& y) const {
    b.y.noalias() = Wo * b.o;
    b.y += bo;
    writable(y).reshaped() = b.y;
  }

  // The start of a prefill: checks, then Q, K, V of the rows of X.
  template <class DX>
  void prefill_in(const char* fn, const Eigen::MatrixBase<DX>& X, Matrix<Scalar>& Q,
                  Matrix<Scalar>& K, Matrix<Scalar>& V) const {
    check_parameters(fn);
    check_rows(fn, "X", X);
    project(X, Q, K, V);
  }

  // Y = forward(X) with the heads' attention attend(Q, K, V) (N x H·M).
  template <class DX, class Attend>
  Matrix<Scalar> forward_with(const char* fn, const Eigen::MatrixBase<DX>& X,
                              const Attend& attend) const {
    check_parameters(fn);
    check_rows(fn, "X", X);
    Matrix<Scalar> Q, K, V;
    project(X, Q, K, V);
    return output(attend(Q, K, V));
  }

  // The gradients of the layer for ∂L/∂Y = dY, given the heads' attention and its backward
  // attend_backward(Q, K, V, dA) -> AttentionGradients (of Q, K, V).
  template <class DX, class DY, class Attend, class AttendBackward>
  LayerGradients<Scalar> backward_with(const char* fn, const Eigen::MatrixBase<DX>& X,
                                       const Eigen::MatrixBase<DY>& dY, const Attend& attend,
                                       const AttendBackward& attend_backward) const {
    check_parameters(fn);
    check_rows(fn, "X", X);
    check_rows(fn, "dY", dY);
    if (dY.rows() != X.rows())
      throw_invalid(fn, "dY is " + shape_of(dY) + " but X is " + shape_of(X) +
                            ": they must have the same rows");
    Matrix<Scalar> Q, K, V;
    project(X, Q, K, V);
    const Matrix<Scalar> A = attend(Q, K, V);
    const Matrix<Scalar> dA = dY * Wo;
    const AttentionGradients<Scalar> g = attend_backward(Q, K, V, dA);
    LayerGradients<Scalar> out;
    out.dWo.noalias() = dY.transpose() * A;
    out.dbo = dY.colwise().sum().transpose();
    out.dWq.noalias() = g.dQ.transpose() * X;
    out.dWk.noalias() = g.dK.transpose() * X;
    out.dWv.noalias() = g.dV.transpose() * X;
    out.dbq = g.dQ.colwise().sum().transpose();
    out.dbk = g.dK.colwise().sum().transpose();
    out.dbv = g.dV.colwise().sum().transpose();
    out.dX.noalias() = g.dQ * Wq;
    out.dX.noalias() += g.dK * Wk;
    out.dX.noalias() += g.dV * Wv;
    return out;
  }

  Index d_model_, heads_, key_dim_, value_dim_;
};

}  // namespace detail

}  // namespace linattn
