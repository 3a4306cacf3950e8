/// \file linear/multihead_recurrent.hpp
/// \brief MultiHeadRecurrentLinearAttention: H recurrent heads over the packed layout, one
/// token per step.
#pragma once

#include <Eigen/Core>

#include <stdexcept>
#include <string>
#include <vector>

#include "../core/detail/checks.hpp"
#include "../core/error.hpp"
#include "../core/common.hpp"
#include "../maps/elu_plus_one.hpp"
#include "options.hpp"
#include "recurrent_linear_attention.hpp"

namespace linattn {

/// \brief H independent recurrent heads over the packed layout: a token is q, k of H·D
/// entries and v of H·M entries; step() writes H·M outputs and allocates nothing. With
/// CausalOptions::key_heads = Hk < H (shared query/key heads, GVA), q and k hold Hk·D entries
/// and value head h reads query/key head h / (H / Hk), as multihead_causal_linear_attention()
/// with those options, whose states (one per value head) the heads continue.
///
/// step() runs its heads one after the other on the calling thread, never in an OpenMP region:
/// the H heads of one token are 4·H·F·(M + 1) flops (1.3·10^5 for 8 heads of 64), too few for
/// a second thread to pay (2·ParallelOptions::kDefaultMinWorkPerThread, parallel.hpp). Many
/// sequences stepped together go through BatchedRecurrentLinearAttention, whose step() spreads
/// its (sequence, head) pairs over threads when they pay.
/// \code
/// linattn::MultiHeadRecurrentLinearAttention<linattn::EluPlusOne, float> rnn(8, 64, 64);
/// Eigen::VectorXf out(8 * 64);
/// rnn.step(q, k, v, out);
/// linattn::CausalOptions shared;
/// shared.key_heads = 2;  // q, k: 2·64 entries; v, out: 8·64
/// linattn::MultiHeadRecurrentLinearAttention<linattn::EluPlusOne, float> gva(
///     8, 64, 64, linattn::EluPlusOne{}, shared);
/// \endcode
template <class FeatureMap = EluPlusOne, class Scalar = float>
class MultiHeadRecurrentLinearAttention {
 public:
  /// The recurrent form of one head.
  using Head = RecurrentLinearAttention<FeatureMap, Scalar>;

  /// \param heads H, the number of heads (each a RecurrentLinearAttention).
  /// \param key_dim D, the width of each head's query and key rows.
  /// \param value_dim M, the width of each head's value rows and outputs.
  /// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
  /// \param options its key_heads: Hk query/key heads shared by the H value heads (0: H);
  ///     the other fields are the parallel kernels' and not used here.
  /// \throws std::invalid_argument on heads <= 0, a key_heads that does not divide heads, or
  ///     sizes the map rejects.
  MultiHeadRecurrentLinearAttention(Index heads, Index key_dim, Index value_dim,
                                    const FeatureMap& phi = FeatureMap{},
                                    const CausalOptions& options = {}) {
    if (heads <= 0)
      detail::throw_invalid("MultiHeadRecurrentLinearAttention",
                            "heads must be positive, got " + std::to_string(heads));
    key_heads_ =
        detail::resolve_key_heads("MultiHeadRecurrentLinearAttention", heads, options.key_heads);
    heads_.reserve(static_cast<std::size_t>(heads));
    for (Index h = 0; h < heads; ++h) heads_.emplace_back(key_dim, value_dim, phi);
    aliased_out_.resize(heads * value_dim);
  }

  /// Consumes one token of every head; no allocation (for inputs that need no temporary: a
  /// costly expression such as W * x is evaluated once, before any head moves).
  /// \param out H·M entries; it may share memory with q, k or v (the inputs are read as they
  ///        were on entry), but an input that is an expression reading `out`'s memory
  ///        (`2 * out`) must be evaluated first.
  /// \throws std::invalid_argument on wrong sizes, with no head moved. Only a feature map
  /// that throws can stop the step part-way (the heads before it have then moved).
  /// \param q the token's Hk·D query entries (Hk = key_heads()), query/key head g in
  ///     [g·D, (g+1)·D), read by value heads [g·H / Hk, (g+1)·H / Hk).
  /// \param k the token's Hk·D key entries, split as q.
  /// \param v the token's H·M value entries, head h in [h·M, (h+1)·M).
  template <class DQ, class DK, class DV, class DOut>
  void step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
            const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DOut>& out) {
    const char* fn = "MultiHeadRecurrentLinearAttention::step";
    const Index H = heads(), D = key_dim(), M = value_dim();
    if (key_heads_ != H && (q.size() != key_heads_ * D || k.size() != key_heads_ * D))
      detail::throw_invalid(fn, "q has " + std::to_string(q.size()) + " and k " +
                                    std::to_string(k.size()) + " entries but each must have " +
                                    "key_heads x key_dim = " + std::to_string(key_heads_) + " x " +
                                    std::to_string(D) + " (heads = " + std::to_string(H) +
                                    " value heads over key_heads = " + std::to_string(key_heads_) +
                                    " query/key heads)");
    detail::check_token(fn, "q", q, key_heads_ * D);
    detail::check_token(fn, "k", k, key_heads_ * D);
    detail::check_token(fn, "v", v, H * M);
    detail::check_token(fn, "out", out, H * M);
    // Evaluated once before any head moves: a segment of a lazy expression (W * x) would
    // evaluate all of it again for every head, and an allocation failing there would leave
    // the first heads one token ahead of the others.
    const detail::Nested<DQ> qe(q.derived());
    const detail::Nested<DK> ke(k.derived());
    const detail::Nested<DV> ve(v.derived());
    // Head h's output may cover inputs of later heads (when M > D): then go through a buffer.
    if (detail::memory_overlaps(out, q) || detail::memory_overlaps(out, k) ||
        detail::memory_overlaps(out, v)) {
      step_heads(qe, ke, ve, aliased_out_);
      detail::writable(out).reshaped() = aliased_out_.template cast<typename DOut::Scalar>();
    } else {
      step_heads(qe, ke, ve, detail::writable(out).reshaped());
    }
  }

  /// Consumes one token of every head and returns the H·M outputs.
  /// \param q the token's Hk·D query entries (Hk = key_heads()), query/key head g in
  ///     [g·D, (g+1)·D), read by value heads [g·H / Hk, (g+1)·H / Hk).
  /// \param k the token's Hk·D key entries, split as q.
  /// \param v the token's H·M value entries, head h in [h·M, (h+1)·M).
  /// \return the H·M output entries, split as v.
  template <class DQ, class DK, class DV>
  Vector<Scalar> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                      const Eigen::MatrixBase<DV>& v) {
    Vector<Scalar> out(heads() * value_dim());
    step(q, k, v, out);
    return out;
  }

  /// Back to the start of a sequence in every head, keeping the shapes.
  void reset() {
    for (auto& h : heads_) h.reset();
  }
  /// The number H of heads.
  /// \return H.
  Index heads() const noexcept { return static_cast<Index>(heads_.size()); }
  /// The number Hk of query/key heads the value heads share (heads() unless the constructor's
  /// CausalOptions::key_heads said fewer).
  /// \return Hk.
  Index key_heads() const noexcept { return key_heads_; }
  /// The width D of each head's query and key rows.
  /// \return D.
  Index key_dim() const noexcept { return heads_.front().key_dim(); }
  /// The width M of each head's value rows and outputs.
  /// \return M.
  Index value_dim() const noexcept { return heads_.front().value_dim(); }
  /// Head h (its state, set_state() to continue from a parallel prefill).
  /// \throws std::out_of_range naming h and the head count unless 0 <= h < heads().
  /// \param h the head, 0 <= h < heads().
  /// \return the head's recurrent form.
  Head& head(Index h) { return heads_[checked_head(h)]; }
  /// Head h, to read its state.
  /// \param h the head, 0 <= h < heads().
  /// \return the head's recurrent form.
  const Head& head(Index h) const { return heads_[checked_head(h)]; }

 private:
  std::size_t checked_head(Index h) const {
    if (h < 0 || h >= heads())
      detail::raise<std::out_of_range>("linattn::MultiHeadRecurrentLinearAttention::head: head " +
                                       std::to_string(h) + " of " + std::to_string(heads()));
    return static_cast<std::size_t>(h);
  }

  template <class DQ, class DK, class DV, class O>
  void step_heads(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                  const Eigen::MatrixBase<DV>& v, O&& o) {
    const Index D = key_dim(), M = value_dim(), G = heads() / key_heads_;
    for (Index h = 0; h < heads(); ++h)
      heads_[static_cast<std::size_t>(h)].step(q.reshaped().segment(h / G * D, D),
                                               k.reshaped().segment(h / G * D, D),
                                               v.reshaped().segment(h * M, M),
                                               o.segment(h * M, M));
  }

  std::vector<Head> heads_;
  Index key_heads_ = 0;
  Vector<Scalar> aliased_out_;  // H·M: the outputs when `out` shares memory with an input
};

}  // namespace linattn
