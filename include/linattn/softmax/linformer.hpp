/// \file softmax/linformer.hpp
/// \brief Linformer (Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity"):
/// softmax attention against k projected keys and values, in O(N·k) instead of O(N·L).
///
/// With projections \f$E, F \in \mathbb{R}^{k \times L}\f$ along the sequence,
/// \f[ \mathrm{out} = \mathrm{softmax}\!\left(\frac{Q\,(E K)^\top}{\sqrt{D}}\right)(F V), \f]
/// softmax over each row's k projected keys. The projected keys EK (k x D) and values FV (k x M)
/// are formed first (O(k·L·(D + M))), then the library's tiled softmax attention runs on them
/// (O(N·k·(D + M)), docs/SPEC.md §5). Non-causal only: see linformer_attention().
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <type_traits>
#include <utility>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../core/detail/blocking.hpp"
#include "../core/detail/microkernel.hpp"
#include "../core/detail/products.hpp"
#include "../core/detail/result.hpp"
#include "../core/detail/views.hpp"
#include "softmax_attention.hpp"
#include "../core/workspace.hpp"
#include "../core/tuning.hpp"

namespace linattn {

/// \brief Scratch of linformer_attention(): the projected keys EK (k x D) and values FV (k x M)
/// and the softmax kernel's tiles.
///
/// Pass the same LinformerWorkspace to repeated calls: the first call of a shape allocates,
/// later calls of the same or smaller shapes allocate nothing. Buffers only grow. Not shared
/// between threads; give each thread its own.
/// \code
/// linattn::LinformerWorkspace<float> ws;
/// Eigen::MatrixXf out(Q.rows(), V.cols());
/// for (int step = 0; step < 1000; ++step)
///   linattn::linformer_attention(Q, K, V, E, F, out, ws);  // no allocation after the first
/// \endcode
template <class Scalar>
class LinformerWorkspace {
 public:
  /// Bytes held by all buffers.
  /// \return the bytes of both parts' buffers.
  std::size_t bytes() const noexcept { return projections.bytes() + attention.bytes(); }

  /// Frees every buffer.
  void release() {
    projections.release();
    attention.release();
  }

  /// Internal: slot 0 holds EK, slot 1 FV, slot 2 a column-major panel of a row-major E or F.
  Workspace<Scalar> projections;
  /// Internal: the tiles of the softmax kernel (softmax_attention.hpp).
  Workspace<Scalar> attention;
};

namespace detail {

inline constexpr int kLinformerSlotKeys = 0;
inline constexpr int kLinformerSlotValues = 1;
inline constexpr int kLinformerSlotPanel = 2;

// out (k x C, column-major, leading dimension k) = P X, with P (k x L) and X (L x C) views
// (detail/views.hpp), on the micro-kernel in panels of kLinformerPanel positions. A row-major P
// is copied a panel at a time into slot kLinformerSlotPanel (the micro-kernel reads its left
// operand column-major); X is read in place in either order. Allocates nothing beyond that slot.
template <class VP, class VX, class Scalar = typename VP::Scalar>
void linformer_project(const VP& P, const VX& X, Scalar* out, Workspace<Scalar>& ws) {
  const Index k = P.rows(), L = P.cols(), C = X.cols();
  if (k == 0 || C == 0) return;
  if (L == 0) {  // an empty sum
    Eigen::Map<Matrix<Scalar>>(out, k, C).setZero();
    return;
  }
  const Strided<Scalar> x = strided_of(X);
  const Index ld = P.outerStride();
  for (Index p0 = 0; p0 < L; p0 += kLinformerPanel) {
    const Index bl = std::min(kLinformerPanel, L - p0);
    const Scalar* a = nullptr;
    Index lda = k;
    if constexpr (bool(VP::IsRowMajor)) {
      // P(i, p) at P.data()[i·ld + p]: the panel is a column-major bl x k array at
      // P.data() + p0; transposed into the buffer, P(i, p0 + q) at buf[i + q·k].
      Scalar* buf = ws.matrix(kLinformerSlotPanel, k, bl).data();
      transpose_copy(P.data() + p0, ld, bl, k, buf, k);
      a = buf;
    } else {
      a = P.data() + p0 * ld;
      lda = ld;
    }
    gemm_acc<Scalar>(k, C, bl, a, lda, x.data + p0 * x.rs, x.rs, x.cs, out, k, p0 > 0);
  }
}

template <class DQ, class DK, class DV, class DE, class DF>
void check_linformer(const char* function, const Eigen::MatrixBase<DQ>& Q,
                     const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                     const Eigen::MatrixBase<DE>& E, const Eigen::MatrixBase<DF>& F) {
  static_check_scalars<DQ, DK, DV>();
  static_assert(std::is_same_v<typename DQ::Scalar, typename DE::Scalar> &&
                    std::is_same_v<typename DQ::Scalar, typename DF::Scalar>,
                "linattn: E and F must have the scalar type of Q, K and V");
  const auto shapes = [&] {
    return " (Q is " + shape_of(Q) + ", K is " + shape_of(K) + ", V is " + shape_of(V) +
           ", E is " + shape_of(E) + ", F is " + shape_of(F) + ")";
  };
  if (Q.cols() != K.cols())
    throw_invalid(function, "Q and K must have the same number of columns D" + shapes());
  if (K.rows() != V.rows())
    throw_invalid(function, "K and V must have the same number of rows L" + shapes());
  if (E.cols() != K.rows())
    throw_invalid(function,
                  "E must be k x L, one column per row of K (L = K.rows())" + shapes());
  if (F.rows() != E.rows() || F.cols() != E.cols())
    throw_invalid(function, "F must be k x L with the k and L of E" + shapes());
  if (Q.cols() == 0) throw_invalid(function, "the key dimension D must be positive" + shapes());
}

}  // namespace detail

/// \brief Linformer attention into a caller's output, reusing `ws`:
/// \f$\mathrm{out} = \mathrm{softmax}\!\left(Q\,(E K)^\top / \sqrt{D}\right)(F V)\f$.
///
/// Q is N x D, K is L x D, V is L x M, the projections E and F are k x L; out is N x M. Each
/// query attends, with an exact softmax, to the k projected keys \f$\tilde K = E K\f$ (k x D)
/// through the k projected values \f$\tilde V = F V\f$ (k x M):
/// \f[ \mathrm{out}_i = \sum_{j=1}^{k} \frac{\exp(q_i^\top \tilde k_j/\sqrt{D})}
///     {\sum_{j'=1}^{k} \exp(q_i^\top \tilde k_{j'}/\sqrt{D})}\,\tilde v_j . \f]
/// Cost O(k·L·(D + M)) for the projections plus O(N·k·(D + M)) for the attention, working
/// memory k·(D + M) scalars plus the softmax tiles, never N x L or N x k. The projections run
/// on linattn's micro-kernel; the attention is softmax_attention() (tiled, online softmax) on
/// \f$(Q, \tilde K, \tilde V)\f$, so inputs of magnitude 100 give finite results and E = F =
/// identity (k = L) gives softmax_attention(Q, K, V) exactly.
///
/// E and F are the model's parameters (learned in the paper; make_linformer_projections()
/// gives the random JL-style ones the paper's analysis uses). They are tied to a length L: for
/// a shorter sequence pass their first columns, `E.leftCols(L)`. Edge cases: N = 0 gives an
/// empty result; k = 0 gives zeros, as softmax_attention() does with no keys (L = 0); L = 0 with
/// k > 0 projects to zero keys and values, hence zeros too.
///
/// **No causal form.** A causal mask says that query i sees keys j <= i only. Each projected
/// key \f$\tilde k_r = \sum_{j=1}^{L} E_{rj} k_j\f$ mixes all L keys, future ones included,
/// so after the projection no entry of the score matrix belongs to a single position and there
/// is nothing a mask could remove; masking before projecting would need a different
/// \f$\tilde K\f$ for every query, O(N·k·L). The paper leaves causal attention out for that
/// reason. Use causal_linear_attention() or causal_softmax_attention() for autoregressive models.
///
/// No multi-head form (call it per head on column blocks: `Q.middleCols(h * D, D)`) and no
/// backward are provided.
///
/// Any Eigen operands (matrices, blocks, Maps, row-major storage; expressions are evaluated
/// once), float or double, all of one scalar type. After the first call of a shape, calls with
/// the same `ws` allocate nothing, unless an operand is an expression or a Map with an inner
/// stride (evaluated into a temporary first).
///
/// \param out N x M; must not overlap Q, K, V, E or F.
/// \throws std::invalid_argument naming the function and every operand's shape if Q and K
/// differ in D, K and V in L, E is not k x L with L = K.rows(), F is not the shape of E, D == 0,
/// `out` is not N x M, or `out` overlaps an input; nothing is written then.
/// \code
/// const Eigen::Index L = K.rows(), k = 256;
/// const auto [E, F] = linattn::make_linformer_projections<float>(L, k, /*seed=*/42);
/// linattn::LinformerWorkspace<float> ws;
/// Eigen::MatrixXf out(Q.rows(), V.cols());
/// linattn::linformer_attention(Q, K, V, E, F, out, ws);
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param E the k x L projection of the keys along the sequence.
/// \param F the k x L projection of the values, the shape of E.
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
template <class DQ, class DK, class DV, class DE, class DF, class DOut>
void linformer_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                         const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DE>& E,
                         const Eigen::MatrixBase<DF>& F, const Eigen::MatrixBase<DOut>& out,
                         LinformerWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  constexpr const char* function = "linformer_attention";
  detail::check_linformer(function, Q, K, V, E, F);
  detail::check_output(function, out, Q.rows(), V.cols());
  detail::check_no_overlap(function, out, "Q", Q, "K", K, "V", V, "E", E, "F", F);
  const Index N = Q.rows(), D = Q.cols(), M = V.cols(), k = E.rows();
  if (N == 0 || M == 0) return;  // nothing to write
  auto& dst = detail::writable(out);
  // The projected keys and values, column-major k x D and k x M in the workspace.
  Scalar* keys = ws.projections.matrix(detail::kLinformerSlotKeys, k, D).data();
  Scalar* values = ws.projections.matrix(detail::kLinformerSlotValues, k, M).data();
  {
    const detail::Viewed<DK> kv(K.derived());
    const detail::Viewed<DE> ev(E.derived());
    detail::linformer_project(ev.view, kv.view, keys, ws.projections);
  }
  {
    const detail::Viewed<DV> vv(V.derived());
    const detail::Viewed<DF> fv(F.derived());
    detail::linformer_project(fv.view, vv.view, values, ws.projections);
  }
  using View = detail::ConstView<Scalar, false>;
  const View pk(keys, k, D, Eigen::OuterStride<>(std::max<Index>(k, 1)));
  const View pv(values, k, M, Eigen::OuterStride<>(std::max<Index>(k, 1)));
  const detail::Viewed<DQ> qv(Q.derived());
  detail::with_output_view(dst, [&](auto& o) {
    detail::softmax_views(qv.view, pk, pv, o, SoftmaxAlgorithm::Tiled, false, ws.attention);
  });
}

/// \brief Linformer attention \f$\mathrm{softmax}(Q (E K)^\top / \sqrt{D})\,(F V)\f$, returning
/// the N x M result. Same contract as the out-parameter form.
/// \throws std::invalid_argument as the out-parameter form.
/// \code
/// const auto [E, F] = linattn::make_linformer_projections<float>(K.rows(), 256, 42);
/// Eigen::MatrixXf out = linattn::linformer_attention(Q, K, V, E, F);
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param E the k x L projection of the keys along the sequence.
/// \param F the k x L projection of the values, the shape of E.
/// \return the N x M output, in the operands' scalar type.
template <class DQ, class DK, class DV, class DE, class DF>
Matrix<typename DQ::Scalar> linformer_attention(const Eigen::MatrixBase<DQ>& Q,
                                                const Eigen::MatrixBase<DK>& K,
                                                const Eigen::MatrixBase<DV>& V,
                                                const Eigen::MatrixBase<DE>& E,
                                                const Eigen::MatrixBase<DF>& F) {
  detail::check_linformer("linformer_attention", Q, K, V, E, F);
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  LinformerWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  linformer_attention(Q, K, V, E, F, out, ws);
  return out;
}

namespace detail {

// A uniform double in (-1, 1) from the top 53 bits of one draw: (2m + 1 - 2^53) / 2^53 for
// m in [0, 2^53), exact in double and never 0 at both ends.
inline double linformer_uniform_pm1(std::mt19937_64& gen) {
  const auto m = static_cast<std::int64_t>(gen() >> 11);
  return static_cast<double>(2 * m + 1 - (std::int64_t(1) << 53)) * 0x1p-53;
}

}  // namespace detail

/// \brief Random Linformer projections (E, F), each k x L with entries i.i.d.
/// \f$\mathcal{N}(0, 1/k)\f$, from a generator seeded with `seed`.
///
/// \f$\mathcal{N}(0, 1/k)\f$ is the Johnson–Lindenstrauss projection of the paper's analysis
/// (the proof of Wang et al. 2020, Theorem 2, builds E and F from a k x L matrix R with i.i.d.
/// \f$\mathcal{N}(0, 1/k)\f$ entries): for vectors x, y of length L (columns of K or V),
/// \f$\mathbb{E}[(E x)^\top (E y)] = x^\top y\f$. Here E and F are drawn independently, each
/// like R. In the paper's models E and F are learned; these serve as their initialisation or as
/// fixed random projections.
///
/// Deterministic: one std::mt19937_64 seeded with `seed` (its sequence is fixed by the C++
/// standard) feeds Marsaglia's polar form of the Box–Muller transform, written here, not
/// std::normal_distribution (whose algorithm is implementation-defined: libstdc++, libc++ and
/// MSVC give different values for one seed). E's entries are drawn column by column, then F's.
/// The transform uses only arithmetic, std::sqrt and std::log in double, so the values are the
/// same on every platform up to the last bit of the platform's std::log (and of a fused
/// multiply-add, where the compiler contracts one), then rounded to Scalar.
///
/// \tparam Scalar float or double.
/// \param L the sequence length (columns), \param k the projected length (rows).
/// \returns the pair (E, F), k x L each.
/// \throws std::invalid_argument if L or k is negative.
/// \code
/// auto [E, F] = linattn::make_linformer_projections<float>(/*L=*/4096, /*k=*/256, /*seed=*/7);
/// Eigen::MatrixXf out = linattn::linformer_attention(Q, K, V, E, F);
/// \endcode
/// \param seed the draw: one seed gives the same projections on every platform (to the last bit of
///     std::log).
template <class Scalar>
std::pair<Matrix<Scalar>, Matrix<Scalar>> make_linformer_projections(Index L, Index k,
                                                                      std::uint64_t seed) {
  static_assert(detail::is_supported_scalar_v<Scalar>,
                "linattn: the scalar type must be float or double");
  if (L < 0 || k < 0)
    detail::throw_invalid("make_linformer_projections",
                          "L and k must not be negative (L is " + std::to_string(L) + ", k is " +
                              std::to_string(k) + ")");
  std::mt19937_64 gen(seed);
  const double sigma = k > 0 ? 1.0 / std::sqrt(static_cast<double>(k)) : 0.0;
  std::pair<Matrix<Scalar>, Matrix<Scalar>> ef{Matrix<Scalar>(k, L), Matrix<Scalar>(k, L)};
  bool have_spare = false;
  double spare = 0.0;
  const auto normal = [&]() -> double {
    if (have_spare) {
      have_spare = false;
      return spare;
    }
    double u, v, s;
    do {
      u = detail::linformer_uniform_pm1(gen);
      v = detail::linformer_uniform_pm1(gen);
      s = u * u + v * v;
    } while (s >= 1.0 || s == 0.0);
    const double f = std::sqrt(-2.0 * std::log(s) / s);
    spare = v * f;
    have_spare = true;
    return u * f;
  };
  for (Matrix<Scalar>* m : {&ef.first, &ef.second}) {
    Scalar* p = m->data();
    for (Index i = 0, n = m->size(); i < n; ++i) p[i] = static_cast<Scalar>(sigma * normal());
  }
  return ef;
}

}  // namespace linattn
