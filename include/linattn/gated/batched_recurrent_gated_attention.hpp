/// \file gated/batched_recurrent_gated_attention.hpp
/// \brief BatchedRecurrentGatedAttention: the decode step of a server for decayed and gated
/// layers (RetNet, Mamba-2, GLA), one token for each of B sequences of H heads per call.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/batched_heads.hpp"
#include "../core/common.hpp"
#include "../core/detail/checks.hpp"
#include "../core/detail/decoder_grid.hpp"
#include "../core/parallel.hpp"
#include "../core/state.hpp"
#include "../linear/heads.hpp"
#include "../maps/identity.hpp"
#include "options.hpp"
#include "recurrent_gated_attention.hpp"

namespace linattn {

/// \brief B independent sequences of H decayed or gated heads (RetNet, Mamba-2 / simple GLA,
/// GLA), advanced together: step() consumes one token of every sequence (row b of q, k, v and
/// the log gates) and writes one output row per sequence, the (sequence, head) pairs in
/// parallel where the work pays for threads.
///
/// Each head is a RecurrentGatedAttention: a step computes what B·H separate
/// RecurrentGatedAttention::step() calls compute, bit for bit, for any thread count, one fused
/// pass over each F x M state and no allocation. Query/key heads may be shared
/// (GatedOptions::key_heads = Hk < H): q and k then hold Hk heads per row and value head h
/// reads key head h / (H / Hk). The log gates are one per (sequence, head) or F per head
/// (per-feature gates), all finite and <= 0, checked before any state moves.
///
/// States go in and out as BatchedHeads describes (set_states() takes what
/// batched_gated_linear_attention() carries out of a prefill); save_state() / load_state()
/// (serving/state_io_decoders.hpp) park and resume all of them.
///
/// Thread safety: one step() (or any member that changes a sequence) at a time per object.
/// \tparam Phi a product feature map (Identity by default)
/// \tparam Scalar float or double: the arithmetic; tokens (q, k, v, log_gates) may be bf16 /
///         half matrices for float, widened as they are read, and `out` may be bf16 / half (each
///         output rounded once).
/// \tparam StateScalar what every head's S is kept in between tokens: Scalar (the default), or
///         `Eigen::bfloat16` / `Eigen::half` for a float decoder: half the bytes a step moves,
///         each token computed in float from the kept state and S rounded once after it
///         (docs/SPEC.md §9); z and the log-decay stay in float. Snapshots are kept so too;
///         state() / set_state() widen and round; save_state() records the storage type, and
///         load_state() refuses another one's file.
/// \code
/// // 16 conversations, 8 heads of D = M = 64 with per-head decays (Mamba-2 / simple GLA).
/// linattn::BatchedRecurrentGatedAttention<linattn::Identity, float> dec(16, 8, 64, 64);
/// Eigen::MatrixXf out(16, 8 * 64);
/// dec.step(Q, K, V, log_a, out);  // Q, K, V: 16 x 512; log_a: 16 x 8
/// // The same with bf16 states (8 KiB a head instead of 16):
/// linattn::BatchedRecurrentGatedAttention<linattn::Identity, float, Eigen::bfloat16> low(
///     16, 8, 64, 64);
/// low.step(Q, K, V, log_a, out);
/// \endcode
template <class Phi = Identity, class Scalar = float, class StateScalar = Scalar>
class BatchedRecurrentGatedAttention
    : public BatchedHeads<RecurrentGatedAttention<Phi, Scalar, StateScalar>> {
  using Base = BatchedHeads<RecurrentGatedAttention<Phi, Scalar, StateScalar>>;

 public:
  /// The decoder of one head of one sequence.
  using Decoder = RecurrentGatedAttention<Phi, Scalar, StateScalar>;

  /// `sequences` empty sequences of `heads` value heads (query/key heads: options.key_heads,
  /// or as many), keys of `key_dim` and values of `value_dim` entries.
  /// \throws std::invalid_argument on a negative count, heads <= 0, key_heads not dividing
  /// heads, or sizes the map rejects.
  /// \param sequences B, the number of sequences.
  /// \param heads H, the value heads of every sequence.
  /// \param key_dim D, one head's query and key width.
  /// \param value_dim M, one head's value width.
  /// \param phi the feature map of queries and keys.
  /// \param options the scale, normalisation and key_heads every step uses.
  BatchedRecurrentGatedAttention(Index sequences, Index heads, Index key_dim, Index value_dim,
                            const Phi& phi = Phi{}, const GatedOptions& options = {})
      : Base("BatchedRecurrentGatedAttention", sequences, checked_heads(heads, options),
             Decoder(key_dim, value_dim, phi, options)),
        key_heads_(detail::resolve_key_heads("BatchedRecurrentGatedAttention", heads,
                                             options.key_heads)),
        key_dim_(key_dim),
        value_dim_(value_dim) {}

  /// One token of every sequence: row b of each operand is sequence b's. q, k: B x Hk·D;
  /// v: B x H·M; log_gates: B x H (one log-decay per head) or B x H·F (per feature), all
  /// finite and <= 0; out: B x H·M. No allocation.
  /// \throws std::invalid_argument on a wrong shape or value (naming it; nothing changed).
  /// \param q the queries, one row per sequence.
  /// \param k the keys, one row per sequence.
  /// \param v the values, one row per sequence.
  /// \param log_gates the log gates (see above).
  /// \param out receives the outputs, one row per sequence.
  /// \param par the threads to split the heads over (default: OpenMP's, where they pay).
  template <class DQ, class DK, class DV, class DG, class DOut>
  void step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
            const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& log_gates,
            const Eigen::MatrixBase<DOut>& out, const ParallelOptions& par = {}) {
    step_impl("BatchedRecurrentGatedAttention::step", this->sequences(), [](Index r) { return r; },
              q, k, v, log_gates, out, par);
  }

  /// One token of the sequences `slots` (row r of every operand is sequence slots(r)'s; the
  /// others do not move). \throws std::invalid_argument on a slot out of range or repeated.
  /// \param slots the sequences of the rows, distinct, any integer vector.
  /// \param q the queries, one row per slot.
  /// \param k the keys, one row per slot.
  /// \param v the values, one row per slot.
  /// \param log_gates the log gates, one per slot and head (or per feature).
  /// \param out receives the outputs, one row per slot.
  /// \param par the threads to split the heads over.
  template <class DSlots, class DQ, class DK, class DV, class DG, class DOut>
  void step(const Eigen::DenseBase<DSlots>& slots, const Eigen::MatrixBase<DQ>& q,
            const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
            const Eigen::MatrixBase<DG>& log_gates, const Eigen::MatrixBase<DOut>& out,
            const ParallelOptions& par = {}) {
    const char* fn = "BatchedRecurrentGatedAttention::step";
    this->grid_.check_slots(fn, slots);
    step_impl(
        fn, slots.size(),
        [&slots](Index r) {
          return static_cast<Index>(detail::DecoderGrid<Decoder>::slot_of(slots, r));
        },
        q, k, v, log_gates, out, par);
  }

  /// Several tokens of several sequences in one call (a chunked prefill's next piece, or a
  /// speculative verification's tokens): sequence slots(i) consumes rows
  /// [offsets[i], offsets[i+1]) in order, each head token by token through its decoder,
  /// exactly as that many step() calls; the states after its last K tokens are kept when
  /// keep_snapshots(K) was called (rollback()). Operands as step()'s, one row per token;
  /// offsets of any integer type (cu_seqlens). No allocation.
  /// \throws std::invalid_argument on a slot out of range or repeated, offsets that do not
  /// cover the rows, or a wrong shape or value; nothing changed.
  /// \code
  /// const std::vector<int> cu = {0, 4};
  /// dec.extend(Eigen::VectorXi::Constant(1, 2), cu, Q, K, V, log_gates, out);  // 4 tokens of 2
  /// \endcode
  /// \param slots the sequences, distinct, any integer vector.
  /// \param offsets slots.size() + 1 row offsets, from 0 to q.rows().
  /// \param q the queries, one row per token.
  /// \param k the keys, one row per token.
  /// \param v the values, one row per token.
  /// \param log_gates the log gates, one per token and head (or per feature).
  /// \param out receives the outputs, one row per token.
  /// \param par the threads to split the (sequence, head) pairs over.
  template <class DSlots, class Off, class DQ, class DK, class DV, class DG, class DOut>
  void extend(const Eigen::DenseBase<DSlots>& slots, const Off& offsets,
              const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
              const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& log_gates,
              const Eigen::MatrixBase<DOut>& out, const ParallelOptions& par = {}) {
    const char* fn = "BatchedRecurrentGatedAttention::extend";
    this->grid_.check_slots(fn, slots);
    const detail::OffsetsRef off = detail::offsets_of(fn, "offsets", offsets);
    if (static_cast<Index>(off.size()) != slots.size() + 1)
      detail::throw_invalid(fn, "offsets has " + std::to_string(off.size()) +
                                    " entries but slots has " + std::to_string(slots.size()) +
                                    ": one more offset than slots is needed");
    detail::check_offsets(fn, "offsets", off, q.rows());
    const Index gw = check_tokens(fn, q.rows(), q, k, v, log_gates, out);
    const Index S = slots.size();
    const auto slot = [&slots](Index i) {
      return static_cast<Index>(detail::DecoderGrid<Decoder>::slot_of(slots, i));
    };
    for (Index i = 0; i < S; ++i)
      this->begin_call(slot(i), off[std::size_t(i) + 1] - off[std::size_t(i)]);
    const detail::Nested<DQ> qe(q.derived());
    const detail::Nested<DK> ke(k.derived());
    const detail::Nested<DV> ve(v.derived());
    const detail::Nested<DG> ge(log_gates.derived());
    auto& dst = detail::writable(out);
    const double pair_work = detail::decode_pair_work(prototype_features(), value_dim_) *
                             double(q.rows()) / double(std::max<Index>(S, 1));
    this->grid_.run(S, slot, pair_work, par, [&](Index i, Index h, Decoder& dec) {
      const Index r0 = off[std::size_t(i)], n = off[std::size_t(i) + 1] - r0, b = slot(i);
      for (Index t = 0; t < n; ++t) {
        token(dec, r0 + t, h, gw, qe, ke, ve, ge, dst);
        this->after_token(b, h, t);
      }
    });
  }

  /// The number Hk of query/key heads (heads() without sharing).
  /// \return Hk.
  Index key_heads() const noexcept { return key_heads_; }
  /// One head's query and key width D.
  /// \return D.
  Index key_dim() const noexcept { return key_dim_; }
  /// One head's value width M.
  /// \return M.
  Index value_dim() const noexcept { return value_dim_; }
  /// One head's features F (the rows of its state).
  /// \return F.
  Index feature_dim() const { return prototype_features(); }

 private:
  static Index checked_heads(Index heads, const GatedOptions& options) {
    if (heads <= 0)
      detail::throw_invalid("BatchedRecurrentGatedAttention",
                            "heads must be positive, got " + std::to_string(heads));
    detail::resolve_key_heads("BatchedRecurrentGatedAttention", heads, options.key_heads);
    return heads;
  }

  // Shapes (n token rows) and every value, before any state moves; returns the log gates per
  // head (1 or F).
  template <class DQ, class DK, class DV, class DG, class DOut>
  Index check_tokens(const char* fn, Index n, const Eigen::MatrixBase<DQ>& q,
                     const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                     const Eigen::MatrixBase<DG>& log_gates,
                     const Eigen::MatrixBase<DOut>& out) const {
    const Index H = this->heads(), Hk = key_heads_, D = key_dim_, M = value_dim_;
    const Index F = prototype_features();
    if (q.rows() != n || k.rows() != n || v.rows() != n || out.rows() != n ||
        q.cols() != Hk * D || k.cols() != Hk * D || v.cols() != H * M || out.cols() != H * M)
      detail::throw_invalid(
          fn, "q is " + detail::shape_of(q) + ", k is " + detail::shape_of(k) + ", v is " +
                  detail::shape_of(v) + ", out is " + detail::shape_of(out) + " but must be " +
                  detail::shape_string(n, Hk * D) + ", " + detail::shape_string(n, Hk * D) + ", " +
                  detail::shape_string(n, H * M) + ", " + detail::shape_string(n, H * M) +
                  " (one row per token; H = " + std::to_string(H) + " value heads over " +
                  std::to_string(Hk) + " key heads, D = " + std::to_string(D) + ", M = " +
                  std::to_string(M) + ")");
    if (log_gates.rows() != n || (log_gates.cols() != H && log_gates.cols() != H * F))
      detail::throw_invalid(fn, "log_gates is " + detail::shape_of(log_gates) + " but must be " +
                                    detail::shape_string(n, H) + " (one per head) or " +
                                    detail::shape_string(n, H * F) + " (one per feature, F = " +
                                    std::to_string(F) + ")");
    detail::check_no_overlap(fn, out, "q", q, "k", k, "v", v, "log_gates", log_gates);
    for (Index r = 0; r < n; ++r)
      for (Index c = 0; c < log_gates.cols(); ++c) {
        const Scalar g = static_cast<Scalar>(log_gates.coeff(r, c));
        if (!detail::finite_nonpositive(g))
          detail::throw_invalid(fn, "log_gates(" + std::to_string(r) + ", " + std::to_string(c) +
                                        ") = " + detail::value_string(g) +
                                        ": log gates must be finite and <= 0");
      }
    return log_gates.cols() == H ? 1 : F;
  }

  // Row r of the operands through head h's decoder.
  template <class Q, class K, class V, class G, class Out>
  void token(Decoder& dec, Index r, Index h, Index gw, const Q& qe, const K& ke, const V& ve,
             const G& ge, Out& dst) const {
    const Index D = key_dim_, M = value_dim_;
    const Index c = (h / (this->heads() / key_heads_)) * D;
    auto o = dst.row(r).segment(h * M, M);
    dec.step(qe.row(r).segment(c, D), ke.row(r).segment(c, D), ve.row(r).segment(h * M, M),
             ge.row(r).segment(h * gw, gw), o);
  }

  template <class Slot, class DQ, class DK, class DV, class DG, class DOut>
  void step_impl(const char* fn, Index n, const Slot& slot, const Eigen::MatrixBase<DQ>& q,
                 const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                 const Eigen::MatrixBase<DG>& log_gates, const Eigen::MatrixBase<DOut>& out,
                 const ParallelOptions& par) {
    const Index gw = check_tokens(fn, n, q, k, v, log_gates, out);
    for (Index r = 0; r < n; ++r) this->forget_call(slot(r));
    const detail::Nested<DQ> qe(q.derived());
    const detail::Nested<DK> ke(k.derived());
    const detail::Nested<DV> ve(v.derived());
    const detail::Nested<DG> ge(log_gates.derived());
    auto& dst = detail::writable(out);
    this->grid_.run(n, slot, detail::decode_pair_work(prototype_features(), value_dim_), par,
                    [&](Index r, Index h, Decoder& dec) {
                      token(dec, r, h, gw, qe, ke, ve, ge, dst);
                    });
  }

  // F without a sequence to ask (B may be 0): the map's features of D.
  Index prototype_features() const { return this->grid_.prototype().feature_dim(); }

  Index key_heads_, key_dim_, value_dim_;
};

}  // namespace linattn
