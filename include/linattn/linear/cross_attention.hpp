/// \file linear/cross_attention.hpp
/// \brief Linear cross-attention with a fixed memory: the encoder's keys and values summarised
/// once into a state, read by any number of decoder queries.
#pragma once

#include <Eigen/Core>

#include <string>
#include <type_traits>
#include <utility>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../core/state.hpp"
#include "../core/detail/views.hpp"
#include "../maps/elu_plus_one.hpp"
#include "../maps/feature_map.hpp"
#include "../maps/map_state.hpp"
#include "recurrent_linear_attention.hpp"

namespace linattn {

/// \brief Linear cross-attention with a fixed memory (encoder keys and values), summarised
/// once into a state; then each query costs O(F·M) regardless of the memory's length.
///
/// query(q) equals row-wise linear_attention(q, K, V, phi) over the memory absorbed so far.
/// The memory can be extended (add_memory) as more encoder output arrives. set_memory() and
/// add_memory() give the strong guarantee: when they throw (bad shapes, std::bad_alloc, a
/// throwing feature map) the memory is what it was. query() is const and keeps no scratch in
/// the object, so any number of threads may query one object at once (while none changes its
/// memory).
/// \code
/// linattn::LinearCrossAttention<linattn::EluPlusOne, float> cross(64, 64);
/// cross.set_memory(encoder_K, encoder_V);    // O(L·F·M), once
/// Eigen::VectorXf out(64);
/// cross.query(decoder_q, out);               // O(F·M) per query, no allocation
/// Eigen::MatrixXf outs = cross.query(decoder_Q);  // n queries (n x 64) through one GEMM
/// \endcode
template <class FeatureMap = EluPlusOne, class Scalar = float>
class LinearCrossAttention {
  static_assert((detail::static_check_recurrent<FeatureMap, Scalar>(), true));

 public:
  /// The memory's summary: the sums of φ(k) vᵀ and φ(k) over its keys.
  using State = LinearAttentionState<Scalar>;

  /// A single query with key_dim and feature_dim up to this bound runs on stack buffers and
  /// allocates nothing; beyond it, query(q, out) allocates its two 1-row buffers (pass a
  /// Workspace to avoid that).
  static constexpr Index kMaxStackQueryDim = detail::kMapRowBlock;

  /// An empty memory for keys/queries of dimension key_dim and values of value_dim.
  /// \throws std::invalid_argument if key_dim <= 0 or value_dim < 0.
  /// \param key_dim D, the width of the query and key rows.
  /// \param value_dim M, the width of the value rows and of each output.
  /// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
  LinearCrossAttention(Index key_dim, Index value_dim, FeatureMap phi = FeatureMap{})
      : phi_(std::move(phi)), key_dim_(key_dim), value_dim_(value_dim) {
    detail::check_dims("LinearCrossAttention", key_dim, value_dim);
    detail::check_feature_map("LinearCrossAttention", phi_, key_dim);
    state_ = empty_state();
  }

  /// Replaces the memory by K (L x key_dim) and V (L x value_dim).
  /// \throws std::invalid_argument on mismatched shapes; the memory is then unchanged.
  /// \param K L x D keys.
  /// \param V L x M values, one per key.
  template <class DK, class DV>
  void set_memory(const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V) {
    check_memory("LinearCrossAttention::set_memory", K, V);
    // Built aside and moved in (noexcept): a failure part-way leaves the old memory.
    State next = empty_state();
    absorb(K, V, next);
    state_ = std::move(next);
  }

  /// Appends K (L x key_dim) and V (L x value_dim) to the memory. Works on a copy of the
  /// state (F x M), so that a failure part-way leaves the memory unchanged.
  /// \throws std::invalid_argument on mismatched shapes; the memory is then unchanged.
  /// \param K L x D keys.
  /// \param V L x M values, one per key.
  template <class DK, class DV>
  void add_memory(const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V) {
    check_memory("LinearCrossAttention::add_memory", K, V);
    State next = state_;
    absorb(K, V, next);
    state_ = std::move(next);
  }

  /// Attends over the memory with one query or with a matrix of queries, into `out`.
  ///
  /// - One query: q is a vector of key_dim entries (row or column) and `out` a vector of
  ///   value_dim entries. No allocation while key_dim and feature_dim are at most
  ///   kMaxStackQueryDim.
  /// - n queries: Q is n x key_dim and `out` n x value_dim; row i of `out` equals the query
  ///   of row i (to rounding), computed for all rows through one GEMM. Allocates n x
  ///   feature_dim scratch (see the Workspace overload).
  ///
  /// A compile-time vector is always one query. An empty memory gives zeros. `out` may
  /// alias q. Const and thread-safe.
  /// \throws std::invalid_argument on wrong shapes.
  /// \param q the query row (D entries).
  /// \param out receives M entries for one query, n x M for n rows.
  template <class DQ, class DOut>
  void query(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DOut>& out) const {
    query_impl(q, out, nullptr);
  }

  /// As query(q, out), with scratch from `ws`: allocation-free for any shape once `ws` has
  /// served one of the same or a larger size. A Workspace is one thread's.
  /// \param q the query row (D entries).
  /// \param out receives M entries for one query, n x M for n rows.
  /// \param ws scratch reused across calls, so that repeated calls allocate nothing.
  template <class DQ, class DOut>
  void query(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DOut>& out,
             Workspace<Scalar>& ws) const {
    query_impl(q, out, &ws);
  }

  /// Attends with one query (a compile-time vector: returns value_dim entries) or with the n
  /// rows of a matrix (returns n x value_dim).
  template <class DQ>
  std::conditional_t<bool(DQ::IsVectorAtCompileTime), Vector<typename DQ::Scalar>,
                     Matrix<typename DQ::Scalar>>
  /// \param q one query (D entries) or n query rows (n x D).
  /// \return value_dim() entries for one query, n x value_dim() for n rows.
  query(const Eigen::MatrixBase<DQ>& q) const {
    using T = typename DQ::Scalar;  // Scalar, or bf16 / half queries of a float memory
    if constexpr (DQ::IsVectorAtCompileTime) {
      Vector<T> out(value_dim_);
      query(q, out);
      return out;
    } else {
      check_query_rows(q);
      Matrix<T> out(q.rows(), value_dim_);
      query(q, out);
      return out;
    }
  }

  /// The memory's summary state.
  /// \return the state, valid until the next call that changes the memory.
  const State& state() const noexcept { return state_; }
  /// The width D of the query and key rows.
  /// \return D.
  Index key_dim() const noexcept { return key_dim_; }
  /// The width M of the value rows and of each output.
  /// \return M.
  Index value_dim() const noexcept { return value_dim_; }
  /// The number F of features of the map, the rows of the state.
  /// \return F.
  Index feature_dim() const noexcept { return state_.S.rows(); }
  /// The feature map the queries and keys go through.
  /// \return the map, as given to the constructor.
  const FeatureMap& feature_map() const noexcept { return phi_; }

 private:
  State empty_state() const {
    return State(phi_.feature_dim(key_dim_), value_dim_, normalizes_keys_per_feature_v<FeatureMap>);
  }

  template <class DK, class DV>
  void check_memory(const char* fn, const Eigen::MatrixBase<DK>& K,
                    const Eigen::MatrixBase<DV>& V) const {
    detail::static_check_scalars<DK, DK, DV>();
    static_assert(std::is_same_v<compute_scalar_t<typename DK::Scalar>, Scalar>,
                  "linattn: the memory's scalar type must be the LinearCrossAttention's (or "
                  "bf16 / half for a float one)");
    if (K.cols() != key_dim_ || V.cols() != value_dim_ || K.rows() != V.rows())
      detail::throw_invalid(fn, "K is " + detail::shape_of(K) + " and V is " +
                                    detail::shape_of(V) + " but must be L x " +
                                    std::to_string(key_dim_) + " and L x " +
                                    std::to_string(value_dim_));
  }

  template <class DK, class DV>
  void absorb(const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V, State& into) {
    const detail::Viewed<DK> k(K.derived());  // bf16 / half widened into float
    const detail::Viewed<DV> v(V.derived());
    detail::absorb_keys(phi_, k.view, v.view, into.S, into.S_lo, into.z, into.z_lo, into.m,
                        detail::NoMask{}, ws_);
  }

  template <class DQ>
  void check_query_rows(const Eigen::MatrixBase<DQ>& Q) const {
    if (Q.cols() != key_dim_)
      detail::throw_invalid("LinearCrossAttention::query",
                            "Q is " + detail::shape_of(Q) + " but must be n x " +
                                std::to_string(key_dim_) + " (n queries)");
  }

  template <class DQ, class DOut>
  void query_impl(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DOut>& out,
                  Workspace<Scalar>* ws) const {
    static_assert(std::is_same_v<compute_scalar_t<typename DQ::Scalar>, Scalar> &&
                      std::is_same_v<typename DOut::Scalar, typename DQ::Scalar>,
                  "linattn: the query's scalar type must be the LinearCrossAttention's (or "
                  "bf16 / half for a float one), and out's the query's");
    if constexpr (detail::is_low_precision_v<typename DQ::Scalar>) {
      // Widened into float copies and computed there (these allocate), the result rounded
      // once into out.
      const Matrix<Scalar> wide = q.template cast<Scalar>();
      Matrix<Scalar> result(out.rows(), out.cols());
      query_impl(wide, result, ws);
      detail::writable(out) = result.template cast<typename DOut::Scalar>();
    } else {
      const auto is_vector = [](const auto& x) { return x.rows() == 1 || x.cols() == 1; };
      if (bool(DQ::IsVectorAtCompileTime) ||
          (is_vector(q) && is_vector(out) && q.size() == key_dim_ && out.size() == value_dim_))
        query_one(q, out, ws);
      else
        query_rows(q, out, ws);
    }
  }

  // φ(x) into pq, then one read of the state for all rows.
  template <class X, class PQ, class Den, class Out>
  void read(const X& x, PQ& pq, Den& den, Out&& out) const {
    detail::map_queries(phi_, x, pq, true);
    detail::read_state(phi_, state_.S, state_.z, pq, den, std::forward<Out>(out));
  }

  template <class DQ, class DOut>
  void query_one(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DOut>& out,
                 Workspace<Scalar>* ws) const {
    const char* fn = "LinearCrossAttention::query";
    detail::check_token(fn, "q", q, key_dim_);
    detail::check_token(fn, "out", out, value_dim_);
    auto& dst = detail::writable(out);
    if constexpr (bool(DOut::IsVectorAtCompileTime))
      query_one_into(q, dst.reshaped().transpose(), ws);
    else if (dst.rows() == 1)  // a vector only at run time
      query_one_into(q, dst.row(0), ws);
    else
      query_one_into(q, dst.col(0).transpose(), ws);
  }

  // o: a 1 x value_dim view of the output.
  template <class DQ, class O>
  void query_one_into(const Eigen::MatrixBase<DQ>& q, O&& o, Workspace<Scalar>* ws) const {
    const Index D = key_dim_, F = feature_dim();
    Eigen::Matrix<Scalar, 1, 1> den;
    // q is copied before anything is written, so that out may alias it.
    if (D <= kMaxStackQueryDim && F <= kMaxStackQueryDim) {
      Scalar q_buffer[kMaxStackQueryDim];
      Scalar pq_buffer[kMaxStackQueryDim];
      Eigen::Map<Matrix<Scalar>> x(q_buffer, 1, D), pq(pq_buffer, 1, F);
      x = q.reshaped().transpose();
      read(x, pq, den, std::forward<O>(o));
    } else if (ws != nullptr) {
      auto x = ws->matrix(detail::kSlotKeys, 1, D);
      auto pq = ws->matrix(detail::kSlotPhiQ, 1, F);
      x = q.reshaped().transpose();
      read(x, pq, den, std::forward<O>(o));
    } else {
      const Matrix<Scalar> x = q.reshaped().transpose();
      Matrix<Scalar> pq(1, F);
      read(x, pq, den, std::forward<O>(o));
    }
  }

  template <class DQ, class DOut>
  void query_rows(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DOut>& out,
                  Workspace<Scalar>* ws) const {
    if (Q.cols() != key_dim_ || out.rows() != Q.rows() || out.cols() != value_dim_)
      detail::throw_invalid(
          "LinearCrossAttention::query",
          "Q is " + detail::shape_of(Q) + " and out is " + detail::shape_of(out) +
              " but must be n x " + std::to_string(key_dim_) + " and n x " +
              std::to_string(value_dim_) + " (n queries), or vectors of " +
              std::to_string(key_dim_) + " and " + std::to_string(value_dim_) +
              " entries (one query)");
    const Index n = Q.rows(), F = feature_dim();
    if (n == 0) return;
    // Mapped before out is written, so that out may alias Q.
    const detail::Nested<DQ> x(Q.derived());
    if (ws != nullptr) {
      auto pq = ws->matrix(detail::kSlotPhiQ, n, F);
      auto den = ws->vector(detail::kSlotRowA, n);
      read(x, pq, den, detail::writable(out));
    } else {
      Matrix<Scalar> pq(n, F);
      Vector<Scalar> den(n);
      read(x, pq, den, detail::writable(out));
    }
  }

  FeatureMap phi_;
  Index key_dim_, value_dim_;
  State state_;
  Workspace<Scalar> ws_;  // set_memory() and add_memory() only: query() is const
};

}  // namespace linattn
