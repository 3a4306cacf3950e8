/// \file delta/batched_recurrent_delta_rule.hpp
/// \brief BatchedRecurrentDeltaRule: the decode step of a server for Gated DeltaNet and KDA
/// layers, one token for each of B sequences of H heads per call (shared key heads too).
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
#include "recurrent_delta_rule.hpp"

namespace linattn {

/// \brief B independent sequences of H delta-rule heads (DeltaNet, Gated DeltaNet, KDA),
/// advanced together: step() consumes one token of every sequence (row b of q, k, v, beta and
/// log_a) and writes one output row per sequence, the (sequence, head) pairs in parallel where
/// the work pays for threads.
///
/// Each head is a RecurrentDeltaRule: a step computes what B·H separate
/// RecurrentDeltaRule::step() calls compute, bit for bit, for any thread count, with one pass
/// over each F x M state and no allocation. Query/key heads may be shared
/// (DeltaOptions::key_heads = Hk < H, as Qwen3-Next's 16 for 32): q and k then hold Hk heads
/// per row and value head h reads key head h / (H / Hk). log_a is one log-decay per
/// (sequence, head) (Gated DeltaNet), F per head (KDA), or empty (DeltaNet). Every value is
/// checked before any state moves: a β outside [0, 2] or a log-decay that is not finite and
/// <= 0 is std::invalid_argument naming the row, the head and the value, and nothing changed.
///
/// A server adds a conversation with add_sequence(), hands over a prefill's states with
/// set_states() (batched_delta_rule_attention() carries them out in the same sequence-major
/// order), steps a subset with the `slots` overload, ends one with remove_sequence(), and parks
/// or resumes all of them with save_state() / load_state() (serving/state_io_decoders.hpp).
///
/// Thread safety: one step() (or any member that changes a sequence) at a time per object.
/// \tparam Phi a product feature map (Identity by default; models use L2Normalize<>)
/// \tparam Scalar float or double: the arithmetic; tokens (q, k, v, beta, log_a) may be bf16 /
///         half matrices for float, widened as they are read, and `out` may be bf16 / half (each
///         output rounded once).
/// \tparam StateScalar what every head's S is kept in between tokens: Scalar (the default), or
///         `Eigen::bfloat16` / `Eigen::half` for a float decoder: half the bytes a step moves,
///         each token computed in float from the kept state and its new state rounded once
///         (docs/SPEC.md §9.3; bf16 keeps 8 significant bits, half 11 and a range to 65504).
///         Snapshots are kept so too; state() / set_state() widen and round; save_state()
///         records the storage type, and load_state() refuses another one's file.
/// \code
/// // 8 conversations of Qwen3-Next's layer: 32 value heads over 16 key heads of 128.
/// linattn::DeltaOptions opts;
/// opts.scale = 1.0 / std::sqrt(128.0);
/// opts.key_heads = 16;
/// linattn::BatchedRecurrentDeltaRule<linattn::L2Normalize<>, float> dec(
///     8, 32, 128, 128, linattn::L2Normalize<>(1e-6), opts);
/// Eigen::MatrixXf out(8, 32 * 128);
/// dec.step(Q, K, V, beta, log_a, out);  // Q, K: 8 x 16·128; V: 8 x 32·128; beta, log_a: 8 x 32
/// \endcode
/// The same decoder with its states in bf16 (32 KiB a head instead of 64), stepped on bf16
/// tokens:
/// \code
/// linattn::BatchedRecurrentDeltaRule<linattn::L2Normalize<>, float, Eigen::bfloat16> low(
///     8, 32, 128, 128, linattn::L2Normalize<>(1e-6), opts);
/// using Bf16 = Eigen::Matrix<Eigen::bfloat16, Eigen::Dynamic, Eigen::Dynamic>;
/// const Bf16 Qb = Q.cast<Eigen::bfloat16>(), Kb = K.cast<Eigen::bfloat16>();
/// const Bf16 Vb = V.cast<Eigen::bfloat16>();
/// low.step(Qb, Kb, Vb, beta, log_a, out);  // out: float; each head's state rounded to bf16
/// \endcode
template <class Phi = Identity, class Scalar = float, class StateScalar = Scalar>
class BatchedRecurrentDeltaRule
    : public BatchedHeads<RecurrentDeltaRule<Phi, Scalar, StateScalar>> {
  using Base = BatchedHeads<RecurrentDeltaRule<Phi, Scalar, StateScalar>>;

 public:
  /// The decoder of one head of one sequence.
  using Decoder = RecurrentDeltaRule<Phi, Scalar, StateScalar>;

  /// `sequences` empty sequences of `heads` value heads (query/key heads: options.key_heads,
  /// or as many), keys of `key_dim` and values of `value_dim` entries.
  /// \throws std::invalid_argument on a negative count, heads <= 0, key_heads not dividing
  /// heads, or sizes the map rejects.
  /// \param sequences B, the number of sequences.
  /// \param heads H, the value heads of every sequence.
  /// \param key_dim D, one head's query and key width.
  /// \param value_dim M, one head's value width.
  /// \param phi the feature map of queries and keys.
  /// \param options the scale and key_heads every step uses.
  BatchedRecurrentDeltaRule(Index sequences, Index heads, Index key_dim, Index value_dim,
                            const Phi& phi = Phi{}, const DeltaOptions& options = {})
      : Base("BatchedRecurrentDeltaRule", sequences, checked_heads(heads, options),
             Decoder(key_dim, value_dim, phi, options)),
        key_heads_(detail::resolve_key_heads("BatchedRecurrentDeltaRule", heads,
                                             options.key_heads)),
        key_dim_(key_dim),
        value_dim_(value_dim) {}

  /// One token of every sequence: row b of each operand is sequence b's. q, k: B x Hk·D;
  /// v: B x H·M; beta: B x H in [0, 2]; log_a: B x H (one log-decay per head), B x H·F (per
  /// key channel, KDA) or empty (no decay); out: B x H·M. No allocation.
  /// \throws std::invalid_argument on a wrong shape or value (naming it; nothing changed).
  /// \param q the queries, one row per sequence.
  /// \param k the keys, one row per sequence.
  /// \param v the values, one row per sequence.
  /// \param beta the writing strengths, one per sequence and head.
  /// \param log_a the log-decays (see above).
  /// \param out receives the outputs, one row per sequence.
  /// \param par the threads to split the heads over (default: OpenMP's, where they pay).
  template <class DQ, class DK, class DV, class DB, class DA, class DOut>
  void step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
            const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DB>& beta,
            const Eigen::MatrixBase<DA>& log_a, const Eigen::MatrixBase<DOut>& out,
            const ParallelOptions& par = {}) {
    step_impl("BatchedRecurrentDeltaRule::step", this->sequences(), [](Index r) { return r; }, q,
              k, v, beta, log_a, out, par);
  }

  /// One token of the sequences `slots` (row r of every operand is sequence slots(r)'s; the
  /// others do not move). \throws std::invalid_argument on a slot out of range or repeated.
  /// \param slots the sequences of the rows, distinct, any integer vector.
  /// \param q the queries, one row per slot.
  /// \param k the keys, one row per slot.
  /// \param v the values, one row per slot.
  /// \param beta the writing strengths, one per slot and head.
  /// \param log_a the log-decays, one per slot and head (or per key channel), or empty.
  /// \param out receives the outputs, one row per slot.
  /// \param par the threads to split the heads over.
  template <class DSlots, class DQ, class DK, class DV, class DB, class DA, class DOut>
  void step(const Eigen::DenseBase<DSlots>& slots, const Eigen::MatrixBase<DQ>& q,
            const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
            const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DA>& log_a,
            const Eigen::MatrixBase<DOut>& out, const ParallelOptions& par = {}) {
    const char* fn = "BatchedRecurrentDeltaRule::step";
    this->grid_.check_slots(fn, slots);
    step_impl(
        fn, slots.size(),
        [&slots](Index r) {
          return static_cast<Index>(detail::DecoderGrid<Decoder>::slot_of(slots, r));
        },
        q, k, v, beta, log_a, out, par);
  }

  /// Several tokens of several sequences in one call (a chunked prefill's next piece, or the
  /// 1 + T draft tokens of a speculative verification): sequence slots(i) consumes rows
  /// [offsets[i], offsets[i+1]) in order, each head token by token through its decoder,
  /// exactly as that many step() calls, with the fixed cost of one; the states after its last
  /// K tokens are kept when keep_snapshots(K) was called (rollback()). Operands as step()'s,
  /// one row per token; offsets of any integer type (cu_seqlens). No allocation.
  /// \throws std::invalid_argument on a slot out of range or repeated, offsets that do not
  /// cover the rows, or a wrong shape or value; nothing changed.
  /// \code
  /// dec.keep_snapshots(5);
  /// const Eigen::VectorXi slots = (Eigen::VectorXi(2) << 3, 0).finished();
  /// const std::vector<int> cu = {0, 5, 9};  // 5 tokens of sequence 3, 4 of sequence 0
  /// dec.extend(slots, cu, Q, K, V, beta, log_a, out);
  /// dec.rollback(3, 2);  // sequence 3 accepts 2 of its 5
  /// \endcode
  /// \param slots the sequences, distinct, any integer vector.
  /// \param offsets slots.size() + 1 row offsets, from 0 to q.rows().
  /// \param q the queries, one row per token.
  /// \param k the keys, one row per token.
  /// \param v the values, one row per token.
  /// \param beta the writing strengths, one per token and head.
  /// \param log_a the log-decays (one per token and head, per key channel, or empty).
  /// \param out receives the outputs, one row per token.
  /// \param par the threads to split the (sequence, head) pairs over.
  template <class DSlots, class Off, class DQ, class DK, class DV, class DB, class DA,
            class DOut>
  void extend(const Eigen::DenseBase<DSlots>& slots, const Off& offsets,
              const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
              const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DB>& beta,
              const Eigen::MatrixBase<DA>& log_a, const Eigen::MatrixBase<DOut>& out,
              const ParallelOptions& par = {}) {
    const char* fn = "BatchedRecurrentDeltaRule::extend";
    this->grid_.check_slots(fn, slots);
    const detail::OffsetsRef off = detail::offsets_of(fn, "offsets", offsets);
    if (static_cast<Index>(off.size()) != slots.size() + 1)
      detail::throw_invalid(fn, "offsets has " + std::to_string(off.size()) +
                                    " entries but slots has " + std::to_string(slots.size()) +
                                    ": one more offset than slots is needed");
    detail::check_offsets(fn, "offsets", off, q.rows());
    const bool channels = check_tokens(fn, q.rows(), q, k, v, beta, log_a, out);
    const Index S = slots.size();
    const auto slot = [&slots](Index i) {
      return static_cast<Index>(detail::DecoderGrid<Decoder>::slot_of(slots, i));
    };
    for (Index i = 0; i < S; ++i)
      this->begin_call(slot(i), off[std::size_t(i) + 1] - off[std::size_t(i)]);
    const detail::Nested<DQ> qe(q.derived());
    const detail::Nested<DK> ke(k.derived());
    const detail::Nested<DV> ve(v.derived());
    auto& dst = detail::writable(out);
    const double pair_work = 2.0 * detail::decode_pair_work(prototype_features(), value_dim_) *
                             double(q.rows()) / double(std::max<Index>(S, 1));
    this->grid_.run(S, slot, pair_work, par, [&](Index i, Index h, Decoder& dec) {
      const Index r0 = off[std::size_t(i)], n = off[std::size_t(i) + 1] - r0, b = slot(i);
      for (Index t = 0; t < n; ++t) {
        token(dec, r0 + t, h, channels, qe, ke, ve, beta.derived(), log_a.derived(), dst);
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
  static Index checked_heads(Index heads, const DeltaOptions& options) {
    if (heads <= 0)
      detail::throw_invalid("BatchedRecurrentDeltaRule",
                            "heads must be positive, got " + std::to_string(heads));
    detail::resolve_key_heads("BatchedRecurrentDeltaRule", heads, options.key_heads);
    return heads;
  }

  // Shapes (n token rows) and every value, before any state moves (the heads' own checks then
  // cannot fail midway); returns whether log_a holds one log-decay per key channel.
  template <class DQ, class DK, class DV, class DB, class DA, class DOut>
  bool check_tokens(const char* fn, Index n, const Eigen::MatrixBase<DQ>& q,
                    const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                    const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DA>& log_a,
                    const Eigen::MatrixBase<DOut>& out) const {
    const Index H = this->heads(), Hk = key_heads_, D = key_dim_, M = value_dim_;
    const Index F = prototype_features();
    if (q.rows() != n || k.rows() != n || v.rows() != n || out.rows() != n ||
        q.cols() != Hk * D || k.cols() != Hk * D || v.cols() != H * M || out.cols() != H * M ||
        beta.rows() != n || beta.cols() != H)
      detail::throw_invalid(
          fn, "q is " + detail::shape_of(q) + ", k is " + detail::shape_of(k) + ", v is " +
                  detail::shape_of(v) + ", beta is " + detail::shape_of(beta) + ", out is " +
                  detail::shape_of(out) + " but must be " + detail::shape_string(n, Hk * D) +
                  ", " + detail::shape_string(n, Hk * D) + ", " + detail::shape_string(n, H * M) +
                  ", " + detail::shape_string(n, H) + ", " + detail::shape_string(n, H * M) +
                  " (one row per token; H = " + std::to_string(H) + " value heads over " +
                  std::to_string(Hk) + " key heads, D = " + std::to_string(D) + ", M = " +
                  std::to_string(M) + ")");
    const bool decays = log_a.size() != 0;
    const bool channels = decays && F > 1 && log_a.cols() == H * F;
    if (decays && (log_a.rows() != n || (log_a.cols() != H && !channels)))
      detail::throw_invalid(fn, "log_a is " + detail::shape_of(log_a) + " but must be empty, " +
                                    detail::shape_string(n, H) + " (one per head) or " +
                                    detail::shape_string(n, H * F) + " (one per key channel, F = " +
                                    std::to_string(F) + ")");
    detail::check_no_overlap(fn, out, "q", q, "k", k, "v", v, "beta", beta, "log_a", log_a);
    for (Index r = 0; r < n; ++r) {
      for (Index h = 0; h < H; ++h) {
        const Scalar b = static_cast<Scalar>(beta.coeff(r, h));
        if (!(b >= Scalar(0) && b <= Scalar(2)))
          detail::throw_invalid(fn, "beta(" + std::to_string(r) + ", " + std::to_string(h) +
                                        ") = " + detail::value_string(b) +
                                        ": beta must be in [0, 2]");
      }
      for (Index c = 0; decays && c < log_a.cols(); ++c) {
        const Scalar g = static_cast<Scalar>(log_a.coeff(r, c));
        if (!detail::finite_nonpositive(g))
          detail::throw_invalid(fn, "log_a(" + std::to_string(r) + ", " + std::to_string(c) +
                                        ") = " + detail::value_string(g) +
                                        ": log-decays must be finite and <= 0");
      }
    }
    return channels;
  }

  // Row r of the operands through head h's decoder.
  template <class Q, class K, class V, class DB, class DA, class Out>
  void token(Decoder& dec, Index r, Index h, bool channels, const Q& qe, const K& ke, const V& ve,
             const DB& beta, const DA& log_a, Out& dst) const {
    const Index D = key_dim_, M = value_dim_, F = prototype_features();
    const Index c = (h / (this->heads() / key_heads_)) * D;
    const Scalar b = static_cast<Scalar>(beta.coeff(r, h));
    auto o = dst.row(r).segment(h * M, M);
    if (channels)
      dec.step(qe.row(r).segment(c, D), ke.row(r).segment(c, D), ve.row(r).segment(h * M, M), b,
               log_a.row(r).segment(h * F, F), o);
    else
      dec.step(qe.row(r).segment(c, D), ke.row(r).segment(c, D), ve.row(r).segment(h * M, M), b,
               log_a.size() ? static_cast<Scalar>(log_a.coeff(r, h)) : Scalar(0), o);
  }

  template <class Slot, class DQ, class DK, class DV, class DB, class DA, class DOut>
  void step_impl(const char* fn, Index n, const Slot& slot, const Eigen::MatrixBase<DQ>& q,
                 const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                 const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DA>& log_a,
                 const Eigen::MatrixBase<DOut>& out, const ParallelOptions& par) {
    const bool channels = check_tokens(fn, n, q, k, v, beta, log_a, out);
    for (Index r = 0; r < n; ++r) this->forget_call(slot(r));
    const detail::Nested<DQ> qe(q.derived());
    const detail::Nested<DK> ke(k.derived());
    const detail::Nested<DV> ve(v.derived());
    auto& dst = detail::writable(out);
    // The sweep reads the state twice per entry (the query's and the key's products).
    const double pair_work = 2.0 * detail::decode_pair_work(prototype_features(), value_dim_);
    this->grid_.run(n, slot, pair_work, par, [&](Index r, Index h, Decoder& dec) {
      token(dec, r, h, channels, qe, ke, ve, beta.derived(), log_a.derived(), dst);
    });
  }

  // F without a sequence to ask (B may be 0): the map's features of D.
  Index prototype_features() const { return this->grid_.prototype().feature_dim(); }

  Index key_heads_, key_dim_, value_dim_;
};

}  // namespace linattn
