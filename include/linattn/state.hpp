/// \file state.hpp
/// \brief The recurrent state of linear attention and the operations every algorithm shares
/// on it: absorbing keys and values, and reading it with a query.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "checks.hpp"
#include "common.hpp"
#include "detail/blocking.hpp"
#include "detail/fast_exp.hpp"
#include "detail/low_precision.hpp"
#include "detail/products.hpp"
#include "feature_map.hpp"
#include "workspace.hpp"

namespace linattn {

/// \brief The state of (causal) linear attention after some keys: \f$S = \sum_j
/// \varphi(k_j) v_j^\top\f$ (F x M) and \f$z = \sum_j \varphi(k_j)\f$ (F).
///
/// Each sum is kept as two parts, a high part (`S`, `z`) and a low part (`S_lo`, `z_lo`): the
/// state is \f$S + S_{lo}\f$ and \f$z + z_{lo}\f$ (compensated summation). The kernels add
/// the newest tokens to the low parts and regularly fold them into the high parts exactly
/// (Knuth's TwoSum), so that the sums keep their precision after any number of tokens: in float
/// a plain running sum stops changing once it is about 2^24 times a token's contribution, the
/// compensated one does not (docs/SPEC.md §3, "Accuracy of long sequences"). After every call
/// of a kernel (causal_linear_attention(), ...), and in the copy RecurrentLinearAttention::state()
/// returns, `S` and `z` are the correctly rounded sums and the low parts are below half an ulp
/// of them. A state whose low parts hold more (one you add to yourself) is folded with fold().
/// A state built by hand may leave `S_lo` and `z_lo` empty: the kernels read that as zero.
///
/// For maps with per-feature key softmax (SoftmaxSplit) the state is kept shifted for
/// stability: the true sums are \f$\mathrm{diag}(e^{m}) (S + S_{lo})\f$ and
/// \f$e^{m} \odot (z + z_{lo})\f$, where `m` holds the running maximum of each key feature
/// (−∞ before any key). For every other map `m` is empty.
///
/// A state made by one feature map must only be used with that map. States are plain values:
/// copy one to fork a sequence (beam search), pass it to causal_linear_attention() to
/// continue a sequence in pieces, or hand it to a RecurrentLinearAttention to decode.
///
/// \code
/// auto state = linattn::make_state<float>(linattn::EluPlusOne{}, D, M);
/// auto a = linattn::causal_linear_attention(Q.topRows(100), K.topRows(100), V.topRows(100),
///                                           linattn::EluPlusOne{}, state);
/// auto b = linattn::causal_linear_attention(Q.bottomRows(N - 100), K.bottomRows(N - 100),
///                                           V.bottomRows(N - 100), linattn::EluPlusOne{}, state);
/// // [a; b] equals the one-shot causal_linear_attention(Q, K, V)
/// \endcode
template <class Scalar>
struct LinearAttentionState {
  /// Row-major so that the recurrent kernel updates and reads it without horizontal sums.
  using StateMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  StateMatrix S;        ///< F x M, high part of the sum of φ(k) vᵀ (shifted by e^{-m} for SoftmaxSplit)
  Vector<Scalar> z;     ///< F, high part of the sum of φ(k) (shifted likewise)
  Vector<Scalar> m;     ///< F running key maxima for SoftmaxSplit; empty otherwise
  StateMatrix S_lo;     ///< F x M, low part of S (or empty: zero)
  Vector<Scalar> z_lo;  ///< F, low part of z (or empty: zero)
  /// The total log-decay of the keys the state holds, for states of the decayed and gated
  /// kernels (gated_linear_attention(); spec §9.4): one entry for a per-token scalar decay,
  /// F for per-feature gates, \f$\sum_t \log a_t\f$ over every token absorbed since the
  /// state was zero. combine() of two decayed segments needs it: the state of a then b is
  /// \f$e^{\Lambda_b} S_a + S_b\f$. Empty for undecayed states (no decay: 0).
  Vector<Scalar> log_decay;

  /// An empty state; kernels given one start from zero and size it.
  LinearAttentionState() = default;

  /// A zero state for F features and M values; `per_feature` adds the running maxima.
  LinearAttentionState(Index feature_dim, Index value_dim, bool per_feature = false)
      : S(StateMatrix::Zero(feature_dim, value_dim)),
        z(Vector<Scalar>::Zero(feature_dim)),
        S_lo(StateMatrix::Zero(feature_dim, value_dim)),
        z_lo(Vector<Scalar>::Zero(feature_dim)) {
    if (per_feature) m.setConstant(feature_dim, -std::numeric_limits<Scalar>::infinity());
  }

  /// True before the state has been sized.
  bool empty() const noexcept { return S.size() == 0 && z.size() == 0; }

  /// Back to "no keys seen", keeping the shape.
  void reset() {
    S.setZero();
    z.setZero();
    S_lo.setZero();
    z_lo.setZero();
    m.setConstant(-std::numeric_limits<Scalar>::infinity());
    log_decay.setZero();
  }

  /// Folds the low parts into the high parts exactly: afterwards `S` and `z` are the correctly
  /// rounded sums and `S_lo`, `z_lo` the (tiny) rounding residuals. Sizes empty low parts.
  void fold();
};

/// A zero state sized for `phi` with key dimension D and value dimension M.
template <class Scalar, class Phi>
LinearAttentionState<Scalar> make_state(const Phi& phi, Index key_dim, Index value_dim) {
  return LinearAttentionState<Scalar>(phi.feature_dim(key_dim), value_dim,
                                      normalizes_keys_per_feature_v<Phi>);
}

namespace detail {

// Sizes an empty state, or checks that a given one fits (F x M).
template <class Scalar, class Phi>
void prepare_state(const char* function, LinearAttentionState<Scalar>& st, const Phi& phi,
                   Index key_dim, Index value_dim) {
  check_feature_map(function, phi, key_dim);
  const Index F = phi.feature_dim(key_dim);
  const bool per_feature = normalizes_keys_per_feature_v<Phi>;
  if (st.empty()) {
    st = LinearAttentionState<Scalar>(F, value_dim, per_feature);
    return;
  }
  const bool lo_fits = (st.S_lo.size() == 0 || (st.S_lo.rows() == F && st.S_lo.cols() == value_dim)) &&
                       (st.z_lo.size() == 0 || st.z_lo.size() == F);
  if (st.S.rows() != F || st.S.cols() != value_dim || st.z.size() != F ||
      st.m.size() != (per_feature ? F : 0) || !lo_fits)
    throw_invalid(function, "the state (S is " + shape_of(st.S) + ", z has " +
                                std::to_string(st.z.size()) + " entries, m has " +
                                std::to_string(st.m.size()) + ", S_lo is " + shape_of(st.S_lo) +
                                ", z_lo has " + std::to_string(st.z_lo.size()) +
                                " entries) does not fit F = " + std::to_string(F) + ", M = " +
                                std::to_string(value_dim) + " for this feature map");
  if (st.S_lo.size() == 0) st.S_lo.setZero(F, value_dim);
  if (st.z_lo.size() == 0) st.z_lo.setZero(F);
}

// What a state of a decoder cannot be, for set_state() (std::invalid_argument), save_state()
// (likewise) and load_state() (a file's "invalid record"): "" when every entry of log_decay
// can be a total of log gates, which are <= 0 (-inf included: a sum that overflowed), else
// the first entry that cannot (NaN, +inf or positive). S and z are not checked: a NaN or inf
// there is a poisoned but representable state (a NaN token reaches it), which saves, loads
// and propagates as it is.
template <class Scalar>
std::string impossible_log_decay(const Vector<Scalar>& log_decay) {
  for (Index i = 0; i < log_decay.size(); ++i)
    if (!(log_decay(i) <= Scalar(0)))
      return "log_decay(" + std::to_string(i) + ") = " + value_string(log_decay(i)) +
             ": a total log-decay is a sum of log gates <= 0 (NaN, +inf and positive values "
             "are impossible)";
  return std::string();
}

// A decoder's set_state(): a negative position (a count of tokens) or an impossible log_decay
// (above) is std::invalid_argument.
inline void check_position(const char* function, Index position) {
  if (position < 0)
    throw_invalid(function, "position = " + std::to_string(position) +
                                ": a decoding position counts tokens and is never negative");
}
template <class Scalar>
void check_state_values(const char* function, const LinearAttentionState<Scalar>& st,
                        Index position) {
  check_position(function, position);
  const std::string bad = impossible_log_decay(st.log_decay);
  if (!bad.empty()) throw_invalid(function, "the state's " + bad);
}

// hi + lo -> (hi, lo) with hi = fl(hi + lo) and lo the exact rounding error (Knuth's TwoSum:
// branch-free and exact whatever the magnitudes, unlike Fast2Sum), over n contiguous entries.
// Must not be compiled with -ffast-math (which would simplify the error term to 0).
template <class Scalar>
void two_sum_fold(Scalar* hi, Scalar* lo, Index n) {
  constexpr Index B = 64;
  using Buf = Eigen::Array<Scalar, Eigen::Dynamic, 1, 0, B, 1>;
  for (Index i0 = 0; i0 < n; i0 += B) {
    const Index nb = std::min(B, n - i0);
    Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>> h(hi + i0, nb), l(lo + i0, nb);
    const Buf s = h + l;
    const Buf bb = s - h;
    l = (h - (s - bb)) + (l - bb);
    h = s;
  }
}

// Folds the low parts of a state's sums into the high parts (see LinearAttentionState).
template <class SMat, class ZVec>
void fold_state(SMat& S, SMat& S_lo, ZVec& z, ZVec& z_lo) {
  eigen_assert(S.size() == S_lo.size() && z.size() == z_lo.size());
  two_sum_fold(S.data(), S_lo.data(), S.size());
  two_sum_fold(z.data(), z_lo.data(), z.size());
}

// Per-feature key softmax: raises the running maxima m to at least `new_max`, rescaling the
// shifted S and z so that diag(e^m) S is unchanged. m = -inf (no key yet) rescales by 0.
template <class SMat, class ZVec, class MVec, class NewMax>
void raise_maxima(SMat& S, SMat& S_lo, ZVec& z, ZVec& z_lo, MVec& m, const NewMax& new_max) {
  using Scalar = typename ZVec::Scalar;
  for (Index d = 0; d < m.size(); ++d) {
    if (new_max(d) > m(d)) {
      const Scalar c = std::exp(m(d) - new_max(d));
      if (S.cols() > 0) {  // M = 0: S may be a Map of no memory, whose rows must not be formed
        S.row(d) *= c;
        S_lo.row(d) *= c;
      }
      z(d) *= c;
      z_lo(d) *= c;
      m(d) = new_max(d);
    }
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // packet types as template arguments
#endif
// For every row d of the row-major state (F x M, leading dimension ld), high part `hi` and
// low part `lo`:
//   lo(d, :) += pk(d) v   and   o += w(d) (hi(d, :) + lo(d, :)),
// in one pass, 4 packets of columns at a time with the outputs in registers: no horizontal
// sums. This is the whole cost of a recurrent step (5·F·M flops), bound by the stores to lo,
// which stays in L1 for F·M up to several thousand; the loads and adds of hi come almost for
// free. The token goes into the low part so that it is not rounded away against a large sum
// (see LinearAttentionState). All pointers are contiguous.
template <class Scalar>
void fused_rank1_update_read(const Scalar* hi, Scalar* lo, Index ld, Index F, Index M,
                             const Scalar* pk, const Scalar* w, const Scalar* v, Scalar* o) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  constexpr Index P = packet_traits<Scalar>::size;
  Index c0 = 0;
  if constexpr (P > 1) {
    for (; c0 + 4 * P <= M; c0 += 4 * P) {
      const Packet v0 = ploadu<Packet>(v + c0), v1 = ploadu<Packet>(v + c0 + P),
                   v2 = ploadu<Packet>(v + c0 + 2 * P), v3 = ploadu<Packet>(v + c0 + 3 * P);
      Packet o0 = pset1<Packet>(Scalar(0)), o1 = o0, o2 = o0, o3 = o0;
      for (Index d = 0; d < F; ++d) {
        Scalar* row = lo + d * ld + c0;
        const Scalar* hrow = hi + d * ld + c0;
        const Packet kd = pset1<Packet>(pk[d]), wd = pset1<Packet>(w[d]);
        const Packet x0 = pmadd(kd, v0, ploadu<Packet>(row));
        const Packet x1 = pmadd(kd, v1, ploadu<Packet>(row + P));
        const Packet x2 = pmadd(kd, v2, ploadu<Packet>(row + 2 * P));
        const Packet x3 = pmadd(kd, v3, ploadu<Packet>(row + 3 * P));
        pstoreu(row, x0);
        pstoreu(row + P, x1);
        pstoreu(row + 2 * P, x2);
        pstoreu(row + 3 * P, x3);
        o0 = pmadd(wd, padd(x0, ploadu<Packet>(hrow)), o0);
        o1 = pmadd(wd, padd(x1, ploadu<Packet>(hrow + P)), o1);
        o2 = pmadd(wd, padd(x2, ploadu<Packet>(hrow + 2 * P)), o2);
        o3 = pmadd(wd, padd(x3, ploadu<Packet>(hrow + 3 * P)), o3);
      }
      pstoreu(o + c0, o0);
      pstoreu(o + c0 + P, o1);
      pstoreu(o + c0 + 2 * P, o2);
      pstoreu(o + c0 + 3 * P, o3);
    }
    for (; c0 + P <= M; c0 += P) {
      const Packet v0 = ploadu<Packet>(v + c0);
      Packet o0 = pset1<Packet>(Scalar(0));
      for (Index d = 0; d < F; ++d) {
        Scalar* row = lo + d * ld + c0;
        const Packet x0 = pmadd(pset1<Packet>(pk[d]), v0, ploadu<Packet>(row));
        pstoreu(row, x0);
        o0 = pmadd(pset1<Packet>(w[d]), padd(x0, ploadu<Packet>(hi + d * ld + c0)), o0);
      }
      pstoreu(o + c0, o0);
    }
  }
  for (; c0 < M; ++c0) {
    Scalar acc = 0;
    for (Index d = 0; d < F; ++d) {
      Scalar& x = lo[d * ld + c0];
      x += pk[d] * v[c0];
      acc += w[d] * (x + hi[d * ld + c0]);
    }
    o[c0] = acc;
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

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
// the 1-row matrices this replaced were copied one scalar at a time (measured: a third of a
// decode step at F = M = 64). RecurrentLinearAttention and BatchedRecurrentLinearAttention
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

// No key is masked.
struct NoMask {
  bool operator()(Index) const noexcept { return true; }
};

// A key padding mask read in place, whatever its Eigen type (bool or integer entries, a vector,
// Map or block): keep(j) is whether key j takes part. One type for every mask and entry point,
// so that each masked kernel is instantiated once per map and scalar, not once per mask type
// and per calling function (each instantiation is seconds of compile time in every program
// that uses it); the indirect call per key is nothing next to the key's F·M work.
class KeyMask {
 public:
  template <class D>
  explicit KeyMask(const D& mask) noexcept : object_(&mask), read_(&read<D>) {}
  bool operator()(Index j) const { return read_(object_, offset_ + j); }
  // The mask of keys [a, ...): still a KeyMask, so that a segment of a sequence (a head's rows,
  // a thread's share) runs the kernel instantiated for the whole.
  KeyMask shifted(Index a) const noexcept {
    KeyMask m = *this;
    m.offset_ += a;
    return m;
  }

 private:
  template <class D>
  static bool read(const void* mask, Index j) {
    return bool((*static_cast<const D*>(mask))(j));
  }
  const void* object_;
  bool (*read_)(const void*, Index);
  Index offset_ = 0;
};

// The values x of keys [r0, r0 + rows) as the products read them (strided_rows()), with the
// rows of masked keys (keep(r0 + t) false) 0 in a row-major copy in slot `slot`, made when the
// block has one. A masked key's weight is 0, but padding often holds NaN or inf and 0 · NaN is
// NaN: its value is selected away, never multiplied.
template <class X, class Keep, class Scalar = typename std::decay_t<X>::Scalar>
Strided<Scalar> kept_value_rows(const X& x, Index r0, const Keep& keep, Workspace<Scalar>& ws,
                                int slot) {
  if constexpr (!std::is_same_v<Keep, NoMask>) {
    const Index rows = x.rows(), cols = x.cols();
    Index t = 0;
    while (t < rows && keep(r0 + t)) ++t;
    if (t < rows) {
      ws.reserve(slot, rows * cols);
      Scalar* buf = ws.matrix(slot, rows, cols).data();
      copy_to_row_major(x, buf);
      for (; t < rows; ++t)
        if (!keep(r0 + t)) std::fill(buf + t * cols, buf + (t + 1) * cols, Scalar(0));
      return {buf, cols, 1};
    }
  }
  return strided_rows(x, ws, slot);
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

// A zero state of F x M (a log-decay record of gw zeros) for a kernel call that carries none: the
// thread's own, reused by the gated and delta-rule kernels.
template <class Scalar>
void zero_gated_state(LinearAttentionState<Scalar>& st, Index F, Index M, Index gw) {
  if (st.S.rows() == F && st.S.cols() == M && st.m.size() == 0 && st.S_lo.size() == F * M &&
      st.z_lo.size() == F) {
    st.reset();
  } else {
    st = LinearAttentionState<Scalar>(F, M);
  }
  st.log_decay.setZero(gw);
}

// Task t's state in a batched gated or delta-rule call: the caller's states[t], or the thread's
// own state of the multi-head workspace ws, zeroed (log-decay record of gw entries).
template <class Scalar, class MultiHeadWS>
LinearAttentionState<Scalar>& task_state(std::vector<LinearAttentionState<Scalar>>* states,
                                         Index t, MultiHeadWS& ws, int thread, Index F, Index M,
                                         Index gw) {
  if (states) return (*states)[static_cast<std::size_t>(t)];
  LinearAttentionState<Scalar>& st = ws.state_for_thread(thread);
  zero_gated_state(st, F, M, gw);
  return st;
}

}  // namespace detail

template <class Scalar>
void LinearAttentionState<Scalar>::fold() {
  if (S_lo.size() == 0) S_lo.setZero(S.rows(), S.cols());
  if (z_lo.size() == 0) z_lo.setZero(z.size());
  detail::fold_state(S, S_lo, z, z_lo);
}

}  // namespace linattn
