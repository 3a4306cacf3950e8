/// \file linear/batched_recurrent.hpp
/// \brief BatchedRecurrentLinearAttention: the decode step of an inference server, one token
/// for each of B independent sequences of H heads per call, parallel over (sequence, head).
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cstddef>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "detail/low_precision_state.hpp"
#include "../maps/elu_plus_one.hpp"
#include "../core/error.hpp"
#include "../maps/feature_map.hpp"
#include "../core/parallel.hpp"
#include "options.hpp"
#include "recurrent_linear_attention.hpp"
#include "../core/state.hpp"
#include "../maps/map_state.hpp"

namespace linattn {

/// \brief B independent sequences of H recurrent heads, advanced together: step() consumes one
/// token of every sequence (row b of q, k, v) and writes one output row per sequence, the
/// (sequence, head) pairs running in parallel with OpenMP.
///
/// The object is what an inference server keeps between decode steps: one
/// LinearAttentionState per (sequence, head), O(H·F·M) per sequence whatever its length, plus
/// one set of scratch vectors per thread. Sequences are numbered 0 … B−1 and own row b of
/// every step's inputs and outputs; a server adds a conversation with add_sequence(), parks or
/// hands one over with state() / set_state() (for instance the states that
/// batched_causal_linear_attention() carried out of a prefill), ends one with
/// remove_sequence(), and steps a subset of them with the `slots` overload of step().
///
/// Why a class over B·H states rather than a free function over a std::vector of states: the
/// fold cadence of the compensated sums (every RecurrentLinearAttention::kFoldTokens steps of
/// a head, see LinearAttentionState) and the per-thread scratch that makes a step
/// allocation-free are part of the decode state; a free function would make every caller keep
/// them. The states stay plain values (state() / set_state()), so nothing is hidden either.
///
/// Each head computes exactly what a RecurrentLinearAttention with the same history computes:
/// the same copies, the same map of a 1-row matrix, the same fused update and read, and a fold
/// after the same steps. The outputs of B·H separate RecurrentLinearAttention::step calls (or B
/// MultiHeadRecurrentLinearAttention::step calls) are therefore reproduced bit for bit, for any
/// thread count.
///
/// Shared query/key heads (GVA; CausalOptions::key_heads = Hk < H at construction): q and k
/// rows hold Hk·D entries and value head h reads query/key head h / (H / Hk), as
/// batched_causal_linear_attention() with those options; the states stay one per (sequence,
/// value head), so set_states() takes the B·H states such a prefill carries out, and
/// save_state() / load_state() are unchanged (the file records H, D and M, not Hk).
///
/// Thread safety: one step() (or any member that changes a sequence) at a time per object;
/// different objects are independent.
///
/// \tparam FeatureMap a feature map (see feature_map.hpp)
/// \tparam Scalar float or double: the arithmetic, and the tokens' type (or bf16 / half tokens
///         for float)
/// \tparam StateScalar what S is kept in between steps: Scalar (with its compensated low part,
///         the default), or `Eigen::bfloat16` / `Eigen::half` for a float decoder (a quarter of
///         the bytes a step moves; S rounded after every token, z kept in float; product maps
///         only). state() / set_state() widen and round, and so do save_state() / load_state()
///         (the float decoder's file).
/// \code
/// // 32 conversations, 8 heads of D = M = 64; Q, K: 32 x 512, V: 32 x 512, one row each.
/// linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float> decoder(32, 8, 64, 64);
/// Eigen::MatrixXf out(32, 8 * 64);
/// decoder.step(Q, K, V, out);  // no allocation; (sequence, head) pairs on all threads
/// linattn::CausalOptions shared;
/// shared.key_heads = 2;  // Q, K: 32 x 2·64 for the same 8 value heads
/// linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float> gva(
///     32, 8, 64, 64, linattn::EluPlusOne{}, shared);
/// \endcode
template <class FeatureMap = EluPlusOne, class Scalar = float, class StateScalar = Scalar>
class BatchedRecurrentLinearAttention {
  static_assert((detail::static_check_recurrent<FeatureMap, Scalar>(), true));
  static constexpr bool kLowState = detail::is_low_precision_v<StateScalar>;
  static_assert(std::is_same_v<StateScalar, Scalar> ||
                    (kLowState && std::is_same_v<Scalar, float> &&
                     !normalizes_keys_per_feature_v<FeatureMap>),
                "linattn: BatchedRecurrentLinearAttention keeps its states in Scalar, or in "
                "Eigen::bfloat16 / Eigen::half for a float decoder of a product feature map");

 public:
  /// The state of one head of one sequence, as set_state() and state() take and give it.
  using State = LinearAttentionState<Scalar>;
  /// Steps of a head between two folds: RecurrentLinearAttention's, so that both agree.
  static constexpr Index kFoldTokens = RecurrentLinearAttention<FeatureMap, Scalar>::kFoldTokens;

  /// `sequences` empty sequences (zero states) of `heads` heads with keys and queries of
  /// `key_dim` and values of `value_dim` entries. Sizes the scratch of OpenMP's default number
  /// of threads, so that the first step() allocates nothing either.
  /// \throws std::invalid_argument if sequences < 0, heads <= 0, key_dim <= 0 or value_dim < 0.
  /// \param sequences B, the number of sequences.
  /// \param heads H, the number of heads of every sequence.
  /// \param key_dim D, the width of each head's query and key rows.
  /// \param value_dim M, the width of each head's value rows and outputs.
  /// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
  /// \param options its key_heads: Hk query/key heads shared by the H value heads (0: H; a
  ///     key_heads that does not divide heads throws); the other fields are not used here.
  BatchedRecurrentLinearAttention(Index sequences, Index heads, Index key_dim, Index value_dim,
                                  FeatureMap phi = FeatureMap{}, const CausalOptions& options = {})
      : phi_(std::move(phi)), heads_(heads), key_dim_(key_dim), value_dim_(value_dim) {
    const char* fn = "BatchedRecurrentLinearAttention";
    if (sequences < 0 || heads <= 0)
      detail::throw_invalid(fn, "sequences must be non-negative and heads positive, got sequences = " +
                                    std::to_string(sequences) + ", heads = " +
                                    std::to_string(heads));
    key_heads_ = detail::resolve_key_heads(fn, heads, options.key_heads);
    detail::check_dims(fn, key_dim, value_dim);
    detail::check_feature_map(fn, phi_, key_dim);
    resize(sequences);
    reserve_threads(detail::resolve_threads(ParallelOptions{}));
  }

  /// Consumes one token of every sequence: row b of q, k (B x H·D) and v (B x H·M) is sequence
  /// b's token, heads side by side as in the multi-head kernels; row b of `out` (B x H·M)
  /// receives its outputs. Any Eigen matrices (Map, blocks, row-major). Allocates nothing once
  /// the scratch of `par`'s thread count exists (the constructor makes OpenMP's default), for
  /// inputs that need no temporary (a product such as X * Wqᵀ is evaluated once, first).
  /// \param par threads over the B·H (sequence, head) pairs; 1 runs them on the calling thread.
  /// \throws std::invalid_argument on wrong shapes or an `out` that overlaps q, k or v, with no
  /// sequence moved. Only a throwing feature map can stop a step part-way.
  /// \param q B x Hk·D (Hk = key_heads()): row b is sequence b's query, heads side by side.
  /// \param k B x Hk·D keys, as q.
  /// \param v B x H·M values: row b is sequence b's value.
  /// \param out receives the B x H·M outputs, row b for sequence b.
  template <class DQ, class DK, class DV, class DOut>
  void step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
            const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DOut>& out,
            const ParallelOptions& par = {}) {
    step_impl("BatchedRecurrentLinearAttention::step", AllSlots{}, q, k, v, out, par);
  }

  /// Consumes one token of the sequences listed in `slots` only (the others keep their state):
  /// row r of q, k, v and out belongs to sequence slots(r). `slots` is a vector of any integer
  /// type (Eigen::VectorXi, a Map over an int32 buffer, ...) of distinct sequence numbers.
  /// \code
  /// Eigen::VectorXi active(2);
  /// active << 3, 7;                          // sequences 3 and 7 have a new token
  /// decoder.step(active, Q2, K2, V2, out2);  // Q2, K2: 2 x H·D, V2, out2: 2 x H·M
  /// \endcode
  /// \throws std::invalid_argument on wrong shapes, a slot outside [0, B) or a repeated slot,
  /// with no sequence moved.
  /// \param slots the sequences, one per row of the batch, each 0 <= slots[i] < sequences().
  /// \param q one Hk·D query row per entry of slots (Hk = key_heads()).
  /// \param k one Hk·D key row per entry of slots.
  /// \param v one H·M value row per entry of slots.
  /// \param out receives one H·M output row per entry of slots.
  /// \param par threads over the (sequence, head) pairs; 1 runs them on the calling thread.
  template <class DSlots, class DQ, class DK, class DV, class DOut>
  void step(const Eigen::DenseBase<DSlots>& slots, const Eigen::MatrixBase<DQ>& q,
            const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
            const Eigen::MatrixBase<DOut>& out, const ParallelOptions& par = {}) {
    static_assert(std::is_integral_v<typename DSlots::Scalar> &&
                      !std::is_same_v<typename DSlots::Scalar, bool>,
                  "linattn: slots must be a vector of integers");
    const char* fn = "BatchedRecurrentLinearAttention::step";
    if (slots.rows() != 1 && slots.cols() != 1 && slots.size() != 0)
      detail::throw_invalid(fn, "slots is " + detail::shape_of(slots) + " but must be a vector");
    const Index n = slots.size(), B = sequences();
    const auto slot = [&slots](Index r) {
      return static_cast<long long>(slots.rows() == 1 ? slots.derived().coeff(0, r)
                                                      : slots.derived().coeff(r, 0));
    };
    // marks_ (B flags, all false between calls) finds repeats without allocating.
    Index bad = -1;
    std::string why;
    for (Index r = 0; r < n && bad < 0; ++r) {
      const long long s = slot(r);
      if (s < 0 || s >= static_cast<long long>(B)) {
        bad = r;
        why = "is outside [0, " + std::to_string(B) + ")";
      } else if (marks_[static_cast<std::size_t>(s)]) {
        bad = r;
        why = "repeats an earlier slot";
      } else {
        marks_[static_cast<std::size_t>(s)] = 1;
      }
    }
    for (Index r = 0; r < n; ++r) {
      const long long s = slot(r);
      if (s >= 0 && s < static_cast<long long>(B)) marks_[static_cast<std::size_t>(s)] = 0;
    }
    if (bad >= 0)
      detail::throw_invalid(fn, "slots(" + std::to_string(bad) + ") = " +
                                    std::to_string(slot(bad)) + " " + why);
    step_impl(fn, [&slot](Index r) { return static_cast<Index>(slot(r)); }, q, k, v, out, par,
              n);
  }

  /// Back to B empty sequences.
  void reset() {
    for (Index b = 0; b < sequences(); ++b) reset(b);
  }
  /// Sequence b back to no tokens (its slot is kept).
  /// \param b the sequence (slot), 0 <= b < sequences().
  void reset(Index b) {
    check_sequence("BatchedRecurrentLinearAttention::reset", b);
    for (Index h = 0; h < heads_; ++h) {
      states_[index(b, h)].reset();
      unfolded_[index(b, h)] = 0;
    }
    positions_[static_cast<std::size_t>(b)] = 0;
  }

  /// Appends an empty sequence and returns its number (B before the call). Allocates its H
  /// states.
  /// \return the new sequence's number, the B before the call.
  Index add_sequence() {
    const Index b = sequences();
    resize(b + 1);
    return b;
  }

  /// Removes sequence b: the last sequence takes number b (its states move, nothing is copied)
  /// and B decreases by one, so that the rows of the next step stay packed. Allocates nothing.
  /// \param b the sequence (slot), 0 <= b < sequences().
  void remove_sequence(Index b) {
    check_sequence("BatchedRecurrentLinearAttention::remove_sequence", b);
    const Index last = sequences() - 1;
    if (b != last) {
      for (Index h = 0; h < heads_; ++h) {
        std::swap(states_[index(b, h)], states_[index(last, h)]);
        std::swap(unfolded_[index(b, h)], unfolded_[index(last, h)]);
      }
      std::swap(positions_[static_cast<std::size_t>(b)], positions_[static_cast<std::size_t>(last)]);
    }
    // The removed sequence's states stay allocated past the end: add_sequence() reuses them.
    --sequences_;
  }

  /// B sequences: the first min(B, sequences()) keep their states, new ones are empty.
  /// \throws std::invalid_argument if B < 0.
  /// \param B the new number of sequences, >= 0.
  void resize(Index B) {
    if (B < 0)
      detail::throw_invalid("BatchedRecurrentLinearAttention::resize",
                            "the number of sequences must be non-negative, got " + std::to_string(B));
    const Index kept = std::min(B, sequences_);
    const std::size_t total = static_cast<std::size_t>(B * heads_);
    if (states_.size() < total) states_.resize(total);
    for (std::size_t i = static_cast<std::size_t>(kept * heads_); i < total; ++i) {
      if (!states_[i].empty())
        states_[i].reset();
      else if constexpr (kLowState)
        states_[i] = Stored(phi_.feature_dim(key_dim_), value_dim_);
      else
        states_[i] = make_state<Scalar>(phi_, key_dim_, value_dim_);
    }
    if (unfolded_.size() < total) unfolded_.resize(total);
    if (positions_.size() < static_cast<std::size_t>(B)) positions_.resize(static_cast<std::size_t>(B));
    if (marks_.size() < static_cast<std::size_t>(B)) marks_.resize(static_cast<std::size_t>(B));
    for (std::size_t i = static_cast<std::size_t>(kept * heads_); i < total; ++i) unfolded_[i] = 0;
    for (Index b = kept; b < B; ++b) positions_[static_cast<std::size_t>(b)] = 0;
    sequences_ = B;
  }

  /// Head h of sequence b continues from `state` (for example one that a prefill carried out,
  /// or one parked by state()). `position` is only informative (see position()).
  /// \throws std::invalid_argument on a sequence or head out of range, a state that does not
  /// fit, a negative `position` or a log_decay entry that is NaN or > 0; the sequence is then
  /// unchanged.
  /// \param b the sequence (slot), 0 <= b < sequences().
  /// \param h the head, 0 <= h < heads().
  /// \param state the state head h of sequence b continues from (copied).
  /// \param position the tokens the state has consumed, which position(b) then reports.
  void set_state(Index b, Index h, const State& state, Index position = 0) {
    const char* fn = "BatchedRecurrentLinearAttention::set_state";
    check_sequence(fn, b);
    check_head(fn, h);
    detail::check_state_values(fn, state, position);
    State copy = state;
    detail::prepare_state(fn, copy, phi_, key_dim_, value_dim_);
    copy.fold();
    store(states_[index(b, h)], std::move(copy));
    unfolded_[index(b, h)] = 0;
    positions_[static_cast<std::size_t>(b)] = position;
  }

  /// Every sequence continues from `states`: B·H states, sequence-major (head h of sequence b
  /// at b·H + h), the layout in which batched_causal_linear_attention() carries them out.
  /// \throws std::invalid_argument on a wrong count, a state that does not fit, a negative
  /// `position` or a log_decay entry that is NaN or > 0; then nothing changed.
  /// \param states B·H states, sequence-major (head h of sequence b at b·H + h), copied.
  /// \param position the tokens every state has consumed, which position(b) then reports.
  void set_states(const std::vector<State>& states, Index position = 0) {
    const char* fn = "BatchedRecurrentLinearAttention::set_states";
    if (static_cast<Index>(states.size()) != sequences() * heads_)
      detail::throw_invalid(fn, "got " + std::to_string(states.size()) + " states but need B·H = " +
                                    std::to_string(sequences()) + "·" + std::to_string(heads_));
    for (const State& s : states) detail::check_state_values(fn, s, position);
    std::vector<State> copies(states);
    for (State& s : copies) {
      detail::prepare_state(fn, s, phi_, key_dim_, value_dim_);
      s.fold();
    }
    for (std::size_t i = 0; i < copies.size(); ++i) {
      store(states_[i], std::move(copies[i]));
      unfolded_[i] = 0;
    }
    for (Index b = 0; b < sequences(); ++b) positions_[static_cast<std::size_t>(b)] = position;
  }

  /// A copy of the state of head h of sequence b with its latest tokens folded in (see
  /// RecurrentLinearAttention::state()); O(F·M).
  /// \param b the sequence (slot), 0 <= b < sequences().
  /// \param h the head, 0 <= h < heads().
  /// \return the folded state of head h of sequence b.
  State state(Index b, Index h) const {
    const char* fn = "BatchedRecurrentLinearAttention::state";
    check_sequence(fn, b);
    check_head(fn, h);
    State copy = [&] {
      if constexpr (kLowState)
        return states_[index(b, h)].widened();
      else
        return states_[index(b, h)];
    }();
    copy.fold();  // a bf16 / half state's z_lo too: its S has no low part
    return copy;
  }

  /// Folded copies of all B·H states, sequence-major (see set_states()).
  /// \return the B·H states, as set_states() takes them.
  std::vector<State> states() const {
    std::vector<State> all;
    all.reserve(static_cast<std::size_t>(sequences() * heads_));
    for (Index b = 0; b < sequences(); ++b)
      for (Index h = 0; h < heads_; ++h) all.push_back(state(b, h));
    return all;
  }

  /// Makes the scratch of `threads` threads now (step() makes what a larger thread count
  /// needs on its first call with it).
  /// \param threads the number of threads whose scratch is kept.
  void reserve_threads(int threads) {
    const Index F = phi_.feature_dim(key_dim_);
    while (static_cast<int>(scratch_.size()) < std::max(threads, 1)) {
      Scratch s;
      s.resize(key_dim_, F, value_dim_, kLowState);
      scratch_.push_back(std::move(s));
    }
  }

  /// Tokens of sequence b since it was added, reset() or set_state() (plus that call's
  /// `position`).
  /// \param b the sequence (slot), 0 <= b < sequences().
  /// \return the tokens sequence b has consumed.
  Index position(Index b) const {
    check_sequence("BatchedRecurrentLinearAttention::position", b);
    return positions_[static_cast<std::size_t>(b)];
  }
  /// The number B of sequences (slots) it holds.
  /// \return B.
  Index sequences() const noexcept { return sequences_; }
  /// The number H of heads of every sequence.
  /// \return H.
  Index heads() const noexcept { return heads_; }
  /// The number Hk of query/key heads the value heads share (heads() unless the constructor's
  /// CausalOptions::key_heads said fewer).
  /// \return Hk.
  Index key_heads() const noexcept { return key_heads_; }
  /// The width D of each head's query and key rows.
  /// \return D.
  Index key_dim() const noexcept { return key_dim_; }
  /// The width M of each head's value rows and outputs.
  /// \return M.
  Index value_dim() const noexcept { return value_dim_; }
  /// The number F of features of the map, the rows of each state.
  /// \return F.
  Index feature_dim() const { return phi_.feature_dim(key_dim_); }
  /// The feature map the queries and keys go through.
  /// \return the map, as given to the constructor.
  const FeatureMap& feature_map() const noexcept { return phi_; }

 private:
  // save_state() / load_state() (state_io.hpp) keep every head's unfolded low parts and fold
  // schedule, so that a resumed decode is bit-identical; state() and set_state() fold them.
  friend struct detail::RecurrentStateAccess;

  // RecurrentLinearAttention's scratch, one set per thread.
  using Scratch = detail::DecodeScratch<Scalar>;
  // What a (sequence, head) keeps between steps.
  using Stored = std::conditional_t<kLowState, detail::LowPrecisionState<StateScalar>, State>;
  static void store(Stored& to, State&& from) {
    if constexpr (kLowState)
      to.assign(from);
    else
      to = std::move(from);
  }
  struct AllSlots {
    Index operator()(Index r) const noexcept { return r; }
  };

  std::size_t index(Index b, Index h) const noexcept {
    return static_cast<std::size_t>(b * heads_ + h);
  }
  void check_sequence(const char* fn, Index b) const {
    if (b < 0 || b >= sequences())
      detail::throw_invalid(fn, "sequence " + std::to_string(b) + " is outside [0, " +
                                    std::to_string(sequences()) + ")");
  }
  void check_head(const char* fn, Index h) const {
    if (h < 0 || h >= heads_)
      detail::throw_invalid(fn, "head " + std::to_string(h) + " is outside [0, " +
                                    std::to_string(heads_) + ")");
  }

  template <class Slots, class DQ, class DK, class DV, class DOut>
  void step_impl(const char* fn, const Slots& slot, const Eigen::MatrixBase<DQ>& q,
                 const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                 const Eigen::MatrixBase<DOut>& out, const ParallelOptions& par, Index rows = -1) {
    detail::static_check_scalars<DQ, DK, DV>();
    static_assert(std::is_same_v<compute_scalar_t<typename DQ::Scalar>, Scalar> &&
                      std::is_same_v<typename DOut::Scalar, typename DQ::Scalar>,
                  "linattn: the tokens' scalar type must be the BatchedRecurrentLinearAttention's "
                  "(or bf16 / half for a float one), and out's the tokens'");
    const Index n = rows < 0 ? sequences() : rows, H = heads_, D = key_dim_, M = value_dim_;
    const Index Hk = key_heads_, G = H / Hk;
    if (q.rows() != n || k.rows() != n || v.rows() != n || out.rows() != n ||
        q.cols() != Hk * D || k.cols() != Hk * D || v.cols() != H * M || out.cols() != H * M)
      detail::throw_invalid(
          fn, "q is " + detail::shape_of(q) + ", k is " + detail::shape_of(k) + ", v is " +
                  detail::shape_of(v) + ", out is " + detail::shape_of(out) + " but must be " +
                  detail::shape_string(n, Hk * D) + ", " + detail::shape_string(n, Hk * D) +
                  ", " + detail::shape_string(n, H * M) + ", " + detail::shape_string(n, H * M) +
                  " (one row per sequence, H = " + std::to_string(H) + " heads of D = " +
                  std::to_string(D) + ", M = " + std::to_string(M) +
                  (Hk == H ? std::string()
                           : ", over key_heads = " + std::to_string(Hk) + " query/key heads") +
                  ")");
    detail::check_no_overlap(fn, out, "q", q, "k", k, "v", v);
    const Index tasks = n * H;
    if (tasks == 0) return;
    // Evaluated once, before any head moves: a block of a lazy expression would evaluate all of
    // it again for every (sequence, head).
    const detail::Nested<DQ> qe(q.derived());
    const detail::Nested<DK> ke(k.derived());
    const detail::Nested<DV> ve(v.derived());
    auto& dst = detail::writable(out);
    // Threads that pay (ParallelOptions::min_work_per_thread): a pair is 4·F·(M + 1) flops,
    // about a microsecond at F = M = 64, so a step of a few small pairs runs on this thread.
    const int threads = static_cast<int>(std::min<Index>(
        detail::threads_for(par, double(tasks) * detail::decode_pair_work(phi_.feature_dim(D), M)),
        tasks));
    reserve_threads(threads);
    const auto run = [&](Index t, Scratch& s) {
      const Index r = t / H, h = t % H, b = slot(r);
      const std::size_t i = index(b, h);
      // RecurrentLinearAttention::step's operands and update, so that the heads agree bit
      // for bit.
      s.load(phi_, qe.row(r).segment(h / G * D, D), ke.row(r).segment(h / G * D, D),
             ve.row(r).segment(h * M, M));
      if constexpr (kLowState) {
        auto& st = states_[i];
        detail::recurrent_weights(phi_, st.z, st.z_lo, s.pq, s.pk, s.w);
        detail::low_state_update_read(st.S.data(), st.S.rows(), value_dim_, s.pk.data(), s.w.data(),
                                      s.v.data(), s.o.data(), s.row.data());
      } else {
        s.update_and_read(phi_, states_[i]);
      }
      detail::assign_narrowed(dst.row(r).segment(h * M, M), s.o);
      if (++unfolded_[i] == kFoldTokens) {
        states_[i].fold();
        unfolded_[i] = 0;
      }
    };
    if (threads <= 1) {
      for (Index t = 0; t < tasks; ++t) run(t, scratch_[0]);
    } else {
      // Contiguous ranges of (sequence, head) pairs, all of the same cost: a static split, no
      // scheduling per pair (a pair is about a microsecond at F = M = 64). On OpenMP's threads
      // or as the tasks of the caller's executor (ParallelOptions::executor).
      detail::run_team(threads, detail::executor_of(par), [&](int me, int T) {
        for (Index t = Index(me) * tasks / T; t < Index(me + 1) * tasks / T; ++t)
          run(t, scratch_[static_cast<std::size_t>(me)]);
      });
    }
    for (Index r = 0; r < n; ++r) ++positions_[static_cast<std::size_t>(slot(r))];
  }

  FeatureMap phi_;
  Index heads_, key_dim_, value_dim_;
  Index key_heads_ = 0;
  Index sequences_ = 0;
  std::vector<Stored> states_;       // head h of sequence b at b·H + h; may hold spares past B·H
  std::vector<Index> unfolded_;      // steps since the last fold, per (sequence, head)
  std::vector<Index> positions_;     // per sequence
  std::vector<unsigned char> marks_;  // per sequence: the repeat check of step(slots, ...)
  std::vector<Scratch> scratch_;     // per thread
};

}  // namespace linattn
