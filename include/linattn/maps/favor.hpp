/// \file maps/favor.hpp
/// \brief FAVOR+, the positive orthogonal random features of the Performer (Choromanski et al.,
/// ICLR 2021, "Rethinking attention with Performers"): an unbiased estimate of the softmax
/// kernel \f$\exp(q \cdot k / \sqrt{D})\f$, F = m.
#pragma once

#include <Eigen/Core>
#include <Eigen/QR>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../core/detail/fast_exp.hpp"
#include "detail/map_scratch.hpp"
#include "feature_map.hpp"

namespace linattn {
namespace detail {

// Standard normal draws from a std::mt19937_64 (whose sequence the C++ standard fixes) through
// Marsaglia's polar Box–Muller, written here: std::normal_distribution's algorithm is
// implementation-defined (libstdc++, libc++ and MSVC give different values for one seed).
class FavorNormal {
 public:
  explicit FavorNormal(std::uint64_t seed) : gen_(seed) {}

  double operator()() {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    double u, v, s;
    do {
      u = uniform_pm1();
      v = uniform_pm1();
      s = u * u + v * v;
    } while (s >= 1.0 || s == 0.0);
    const double f = std::sqrt(-2.0 * std::log(s) / s);
    spare_ = v * f;
    have_spare_ = true;
    return u * f;
  }

 private:
  // (2m + 1 - 2^53) / 2^53 from the top 53 bits of one draw: exact, in (-1, 1).
  double uniform_pm1() {
    const auto m = static_cast<std::int64_t>(gen_() >> 11);
    return static_cast<double>(2 * m + 1 - (std::int64_t(1) << 53)) * 0x1p-53;
  }

  std::mt19937_64 gen_;
  double spare_ = 0.0;
  bool have_spare_ = false;
};

}  // namespace detail

/// \brief FAVOR+ positive random features,
/// \f$\varphi(x) = \exp(W x' - \|x'\|^2/2) / \sqrt{m}\f$ with \f$x' = x / D^{1/4}\f$, F = m.
///
/// W (m × D) holds m random features \f$w_j\f$. For w ~ N(0, I),
/// \f$\mathbb{E}[e^{w^\top u}] = e^{\|u\|^2/2}\f$, hence
/// \f[ \mathbb{E}\big[\varphi(q)^\top\varphi(k)\big] = \exp(q'^\top k') = \exp(q \cdot k /
/// \sqrt{D}), \f] the similarity of softmax attention: linear attention with this map is an
/// unbiased estimate of softmax attention's numerator and denominator, in O(N·m·(D + M)). Every
/// feature is an exponential, so > 0 (`nonnegative_features`): denominators cannot cancel.
///
/// **The draw** (`Favor(D, m, seed)`, `redraw(seed)`): ⌈m/D⌉ blocks, each a D × D matrix of
/// i.i.d. N(0, 1) entries orthogonalised by Householder QR (Q's columns, signs fixed by R's
/// diagonal so that Q is Haar-distributed), its D orthonormal vectors taken as D rows of W (the
/// last block only its first m − (⌈m/D⌉ − 1)·D), each row rescaled to the norm of an
/// independent Gaussian D-vector (a chi(D) draw). Each row is then marginally N(0, I), which
/// keeps the estimate unbiased, and rows within a block are exactly orthogonal, which lowers
/// its variance (the paper's Theorem 2). Deterministic per seed on every platform: one
/// std::mt19937_64 and a Box–Muller written here (not std::normal_distribution), in double;
/// per block the D² entries column by column, then D normals per kept row for its norm.
///
/// **Stabilised sides.** With \f$d_j = \|x' - w_j\|^2\f$ and the fixed per-feature constants
/// \f$c_j = \|w_j\|^2/2\f$, the plain features are \f$\exp(c_j - d_j/2)/\sqrt{m}\f$ (the same
/// exponent as \f$w_j^\top x' - \|x'\|^2/2\f$, formed without cancelling two large terms). The
/// kernels that normalise each output row (QuerySide / KeySide with `normalized`, see
/// feature_map.hpp) get instead
/// \f[ \hat\varphi_K(k)_j = e^{-d_j/2}/\sqrt{m} \le 1/\sqrt{m}, \qquad
///     \hat\varphi_Q(q)_j = e^{e_j - \max_l e_l}/\sqrt{m} \le 1/\sqrt{m},\quad
///     e_j = 2c_j - d_j/2, \f]
/// so that \f$\hat\varphi_Q(q)^\top\hat\varphi_K(k) = e^{-\max_l e_l(q)}\,\varphi(q)^\top
/// \varphi(k)\f$: the ±c_j cancel in every product, and the query row's factor cancels in the
/// division by its denominator. The key shift is fixed per feature, independent of the data, so
/// a state built by one call (chunked, recurrent, carried, saved, summarised and combined) is
/// continued exactly by another; a shift taken from the keys themselves would not be. The
/// unnormalised kernels (gated with `normalize = false`, the delta rule) get the plain features
/// on both sides: there no per-row factor could cancel.
///
/// **Gradient** of each side: \f$\nabla_x = D^{-1/4} \sum_j g_j\, \hat\varphi_j\, (w_j - x')\f$
/// with \f$\hat\varphi\f$ that side's features and the shifts taken as constants. The key
/// shift is a constant. The query shift \f$\max_l e_l\f$ depends on q, but a normalised output
/// is invariant to scaling \f$\hat\varphi_Q(q)\f$, so \f$\nabla_{\hat\varphi}^\top
/// \hat\varphi_Q = 0\f$ and the shift's term, \f$-(\nabla_{\hat\varphi}^\top\hat\varphi_Q)\,
/// \partial_q \max_l e_l\f$, is exactly 0.
///
/// Cost per row: m distances of D entries (about 3·m·D flops) and m exponentials; the
/// features of a row are computed the same way whatever the block, layout or position of the
/// row, so they depend on the row only, bit for bit. `map` and `backward` need D + 2m scalars
/// of stack scratch and allocate only when that exceeds 4096 (detail/map_scratch.hpp). A
/// row containing NaN maps to NaN.
///
/// \tparam Scalar float or double: the type W is stored in. Inputs may be float or double
/// (the other type uses W converted exactly, as the tests' double references do).
/// \code
/// // 256 features estimating softmax attention over 64-dimensional heads.
/// const linattn::Favor<float> phi(/*D=*/64, /*m=*/256, /*seed=*/42);
/// Eigen::MatrixXf out = linattn::causal_linear_attention(Q, K, V, phi);  // ≈ softmax attention
/// \endcode
template <class Scalar = float>
class Favor {
  static_assert(detail::is_supported_scalar_v<Scalar>,
                "linattn: Favor's scalar type must be float or double");

 public:
  /// Every feature is an exponential, so positive: denominators never cancel (feature_map.hpp).
  static constexpr bool nonnegative_features = true;

  /// Draws m orthogonal random features of dimension D from `seed` (see the class).
  /// \throws std::invalid_argument naming Favor and the values if D < 1 or m < 1.
  /// \param D the width of the query and key rows it will map.
  /// \param m the number of random features F.
  /// \param seed the draw: equal seeds give equal projections on every platform.
  Favor(Index D, Index m, std::uint64_t seed) {
    if (D < 1 || m < 1)
      detail::throw_invalid("Favor", "D and m must be at least 1 (D is " + std::to_string(D) +
                                         ", m is " + std::to_string(m) + ")");
    draw(D, m, seed);
  }

  /// A new draw of the same shape from `seed`.
  /// \param seed the new draw, as for the constructor.
  void redraw(std::uint64_t seed) { draw(input_dim(), num_features(), seed); }

  /// W, m × D: row j is the random feature \f$w_j\f$.
  /// \return W, valid until the next redraw() or set_projection().
  const Matrix<Scalar>& projection() const noexcept { return W_; }

  /// Replaces W by any m' × D matrix (m' ≥ 1; the number of features follows m').
  /// \throws std::invalid_argument naming Favor and both shapes if W has another D or no row.
  /// \param W the new m' x D projection, one random feature per row.
  template <class Derived>
  void set_projection(const Eigen::MatrixBase<Derived>& W) {
    static_assert(std::is_same_v<typename Derived::Scalar, Scalar>,
                  "linattn: Favor::set_projection takes a matrix of the Favor's scalar type");
    if (W.cols() != input_dim() || W.rows() < 1)
      detail::throw_invalid("Favor::set_projection",
                            "W must be m x D with m >= 1 and D = " + std::to_string(input_dim()) +
                                " (W is " + detail::shape_of(W) + ", the projection is " +
                                detail::shape_of(W_) + ")");
    W_ = W;
    derive();
  }

  /// The width D of the rows this map accepts.
  /// \return D, the projection's columns.
  Index input_dim() const noexcept { return W_.cols(); }
  /// The number of random features.
  /// \return m, the projection's rows (F of feature_dim()).
  Index num_features() const noexcept { return W_.rows(); }

  /// F = m. \throws std::invalid_argument naming Favor and both D's if D is not the
  /// projection's (every kernel calls it at entry).
  /// \param D the width of the rows to map.
  /// \return m, the number of features.
  Index feature_dim(Index D) const {
    if (D != input_dim())
      detail::throw_invalid("Favor::feature_dim", "the inputs have D = " + std::to_string(D) +
                                                      " columns, the projection W (" +
                                                      detail::shape_of(W_) +
                                                      ") has D = " + std::to_string(input_dim()));
    return num_features();
  }

  /// The plain features \f$\exp(W x' - \|x'\|^2/2)/\sqrt{m}\f$ of the rows of x.
  /// \param x n x D query or key rows.
  /// \param phi receives the n x m features.
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x, MatrixRef<typename Derived::Scalar> phi) const {
    run_map(x, phi, Shift::None);
  }
  /// The query side: per-row shifted when `side.normalized`, else the plain features.
  /// \param x n x D query rows.
  /// \param phi receives the n x m features.
  /// \param side whether the kernel normalises (the shift then cancels in the ratio).
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x, MatrixRef<typename Derived::Scalar> phi,
           QuerySide side) const {
    run_map(x, phi, side.normalized ? Shift::Query : Shift::None);
  }
  /// The key side: \f$e^{-\|x' - w_j\|^2/2}/\sqrt{m}\f$ when `side.normalized`, else plain.
  /// \param x n x D key rows.
  /// \param phi receives the n x m features.
  /// \param side whether the kernel normalises (the shift then cancels in the ratio).
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x, MatrixRef<typename Derived::Scalar> phi,
           KeySide side) const {
    run_map(x, phi, side.normalized ? Shift::Key : Shift::None);
  }

  /// \f$\nabla_x = D^{-1/4} \sum_j g_j \varphi_j (w_j - x')\f$ of the plain features.
  /// \param x the n x D rows the features were computed from.
  /// \param grad_phi the n x m gradient with respect to φ(x).
  /// \param grad_x receives the n x D gradient with respect to x.
  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                MatrixRef<typename DX::Scalar> grad_x) const {
    run_backward(x, grad_phi, grad_x, Shift::None);
  }
  /// The same for the query side's features (the row shift is a constant; see the class).
  /// \param x the n x D query rows the features were computed from.
  /// \param grad_phi the n x m gradient with respect to φ(x).
  /// \param grad_x receives the n x D gradient with respect to x.
  /// \param side the side the features were mapped with.
  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                MatrixRef<typename DX::Scalar> grad_x, QuerySide side) const {
    run_backward(x, grad_phi, grad_x, side.normalized ? Shift::Query : Shift::None);
  }
  /// The same for the key side's features.
  /// \param x the n x D key rows the features were computed from.
  /// \param grad_phi the n x m gradient with respect to φ(x).
  /// \param grad_x receives the n x D gradient with respect to x.
  /// \param side the side the features were mapped with.
  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                MatrixRef<typename DX::Scalar> grad_x, KeySide side) const {
    run_backward(x, grad_phi, grad_x, side.normalized ? Shift::Key : Shift::None);
  }

 private:
  enum class Shift { None, Query, Key };

  void draw(Index D, Index m, std::uint64_t seed) {
    detail::FavorNormal normal(seed);
    Eigen::MatrixXd W(m, D), G(D, D);
    for (Index r0 = 0; r0 < m; r0 += D) {
      for (Index i = 0; i < G.size(); ++i) G.data()[i] = normal();
      const Eigen::HouseholderQR<Eigen::MatrixXd> qr(G);
      Eigen::MatrixXd Q = qr.householderQ();
      // Q diag(sign(R_ii)) is Haar-distributed; Householder's own signs are not uniform.
      const auto& R = qr.matrixQR();
      for (Index c = 0; c < D; ++c)
        if (R(c, c) < 0) Q.col(c) = -Q.col(c);
      const Index rows = std::min(D, m - r0);
      for (Index i = 0; i < rows; ++i) {
        double sq = 0;
        for (Index d = 0; d < D; ++d) {
          const double g = normal();
          sq += g * g;
        }
        W.row(r0 + i) = std::sqrt(sq) * Q.col(i).transpose();
      }
    }
    W_ = W.cast<Scalar>();
    derive();
  }

  // What the maps use, per scalar type, from W as stored (a Favor<float> applied to double
  // inputs, as the tests' double references do, uses the same W exactly).
  template <class S>
  struct Params {
    Matrix<S> Wt;  // D x m: w_j contiguous
    Vector<S> c;   // c_j = |w_j|^2 / 2
    S inv_sqrt_m = 1, scale = 1;
  };

  void derive() {
    const Index m = W_.rows();
    const Eigen::MatrixXd W = W_.template cast<double>();
    const Eigen::VectorXd c = 0.5 * W.rowwise().squaredNorm();
    const double inv_sqrt_m = 1.0 / std::sqrt(double(m));
    const double scale = 1.0 / std::sqrt(std::sqrt(double(W_.cols())));  // D^{-1/4}
    const auto fill = [&](auto& p) {
      using S = typename std::decay_t<decltype(p.c)>::Scalar;
      p.Wt = W.transpose().cast<S>();
      p.c = c.cast<S>();
      p.inv_sqrt_m = S(inv_sqrt_m);
      p.scale = S(scale);
    };
    fill(pf_);
    fill(pd_);
  }

  template <class S>
  const Params<S>& params() const noexcept {
    if constexpr (std::is_same_v<S, float>)
      return pf_;
    else
      return pd_;
  }

  // a = the exponents of one row (x' in xp): plain c_j − d_j/2, key −d_j/2, query
  // 2c_j − d_j/2 − max; then a <- exp(a)/√m. The stabilised exponents are ≤ 0 and go through
  // the library's exp for (−∞, 0] (0 below its floor, where a feature is under 1e-38 of the
  // row's largest); the plain ones, which may be positive, through Eigen's exp.
  template <class S, class XP, class A>
  static void row_features(const Params<S>& p, const XP& xp, A& a, Shift shift) {
    const Index m = p.Wt.cols();
    for (Index j = 0; j < m; ++j) a(j) = S(-0.5) * (p.Wt.col(j) - xp).squaredNorm();
    if (shift == Shift::None) {
      a.array() = (a.array() + p.c.array()).exp() * p.inv_sqrt_m;
      return;
    }
    if (shift == Shift::Query) {
      a += S(2) * p.c;
      S mx = a(0);  // NaN in a row's input makes every a_j, the max and the row NaN
      for (Index j = 1; j < m; ++j)
        if (a(j) > mx) mx = a(j);
      a.array() -= mx;
    }
    a.array() = a.array().unaryExpr(detail::exp_nonpositive_op<S>()) * p.inv_sqrt_m;
  }

  template <class Derived>
  void run_map(const Eigen::MatrixBase<Derived>& x, MatrixRef<typename Derived::Scalar> phi,
               Shift shift) const {
    using S = typename Derived::Scalar;
    static_assert(detail::is_supported_scalar_v<S>, "linattn: Favor maps float or double inputs");
    const Params<S>& p = params<S>();
    const Index D = input_dim(), m = num_features();
    eigen_assert(x.cols() == D && phi.cols() == m && phi.rows() == x.rows());
    const Index a_off = padded(D), width = a_off + padded(m);
    detail::for_row_blocks_with_scratch<S>(x.rows(), width, [&](Index r0, Index n, S* buf) {
      Eigen::Map<Vector<S>> xp(buf, D), a(buf + a_off, m);
      for (Index i = 0; i < n; ++i) {
        xp = x.row(r0 + i).transpose() * p.scale;
        row_features<S>(p, xp, a, shift);
        phi.row(r0 + i) = a.transpose();
      }
    });
  }

  template <class DX, class DG>
  void run_backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                    MatrixRef<typename DX::Scalar> grad_x, Shift shift) const {
    using S = typename DX::Scalar;
    static_assert(detail::is_supported_scalar_v<S>, "linattn: Favor maps float or double inputs");
    const Params<S>& p = params<S>();
    const Index D = input_dim(), m = num_features();
    eigen_assert(x.cols() == D && grad_phi.cols() == m && grad_x.rows() == x.rows());
    const Index a_off = padded(D), g_off = a_off + padded(m), width = g_off + padded(D);
    detail::for_row_blocks_with_scratch<S>(x.rows(), width, [&](Index r0, Index n, S* buf) {
      Eigen::Map<Vector<S>> xp(buf, D), a(buf + a_off, m), gx(buf + g_off, D);
      for (Index i = 0; i < n; ++i) {
        xp = x.row(r0 + i).transpose() * p.scale;
        row_features<S>(p, xp, a, shift);
        a.array() *= grad_phi.row(r0 + i).transpose().array();  // s_j = g_j φ̂_j
        // Σ_j s_j (w_j − x') = W^T s − (Σ_j s_j) x'
        gx.noalias() = p.Wt * a;
        gx -= a.sum() * xp;
        grad_x.row(r0 + i) = (gx * p.scale).transpose();
      }
    });
  }

  // Offsets in the scratch rounded up to 16 scalars, so that each vector starts as aligned as
  // the buffer and every row's exp sees the same packet split.
  static Index padded(Index n) { return (n + 15) / 16 * 16; }

  Matrix<Scalar> W_;  // m x D, as drawn or set
  Params<float> pf_;
  Params<double> pd_;
};

}  // namespace linattn
