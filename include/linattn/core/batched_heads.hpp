/// \file core/batched_heads.hpp
/// \brief BatchedHeads: B sequences x H heads of a single-head decoder, the sequence management
/// (add, remove, reset, states in and out) that the batched gated and delta-rule decoders
/// share.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"
#include "detail/checks.hpp"
#include "detail/decoder_grid.hpp"
#include "state.hpp"

namespace linattn {

namespace detail {
struct RecurrentStateAccess;  // serving/state_io: replaces every head at once on a load
}  // namespace detail

/// \brief B independent sequences of H heads, each head a single-head decoder (a
/// RecurrentGatedAttention or RecurrentDeltaRule), numbered sequence by sequence: what
/// BatchedRecurrentGatedAttention and BatchedRecurrentDeltaRule keep between decode steps,
/// and the members they share. Sequences are numbered 0 … B−1; a server adds one with
/// add_sequence(), ends one with remove_sequence() (the last sequence takes its number), and
/// hands states in and out with set_states() / states() in the sequence-major order in which
/// the batched kernels carry them (head h of sequence b at b·H + h).
/// \code
/// linattn::BatchedRecurrentDeltaRule<linattn::L2Normalize<>, float> dec(4, 8, 64, 64);
/// const Eigen::Index b = dec.add_sequence();  // a fifth conversation, empty
/// dec.set_state(b, 0, prefill_states[0]);     // head 0 continues a prefill
/// dec.remove_sequence(1);                     // sequence 4 is now number 1
/// \endcode
/// \tparam Decoder the single-head decoder type of every head
template <class Decoder>
class BatchedHeads {
 public:
  /// The state of one head, as set_state() takes and state() gives it.
  using State = typename Decoder::State;
  /// A rollback point of one head: its state as the head keeps it (in bf16 / half for a
  /// decoder with such states).
  using Snapshot = typename Decoder::Snapshot;

  /// Every sequence back to the empty one.
  void reset() {
    for (Index b = 0; b < sequences(); ++b) reset(b);
  }
  /// Sequence b back to the empty one.
  /// \param b the sequence, 0 <= b < sequences().
  void reset(Index b) {
    grid_.check_sequence(name_, "reset", b);
    for (Index h = 0; h < heads(); ++h) grid_.at(b, h).reset();
    forget_call(b);
  }
  /// A new empty sequence, numbered sequences() before the call.
  /// \return its number.
  Index add_sequence() {
    const Index b = grid_.add_sequence();
    if (keep_) {
      ensure_snapshots();
      forget_call(b);
    }
    return b;
  }
  /// Removes sequence b; the last sequence takes its number (b).
  /// \param b the sequence, 0 <= b < sequences().
  void remove_sequence(Index b) {
    grid_.check_sequence(name_, "remove_sequence", b);
    const Index last = sequences() - 1;
    if (keep_ && b != last) {
      for (Index h = 0; h < heads(); ++h)
        for (Index j = 0; j < keep_; ++j) std::swap(snapshot(b, h, j), snapshot(last, h, j));
      std::swap(calls_[static_cast<std::size_t>(b)], calls_[static_cast<std::size_t>(last)]);
    }
    forget_call(last);
    grid_.remove_sequence(b);
  }
  /// Checks the sequences of a call's rows before anything moves: slots must be a vector of
  /// distinct sequences in [0, sequences()), of any integer type. No allocation.
  /// \throws std::invalid_argument naming `fn`, the first bad slot and why.
  /// \param fn the calling function's name, for the message.
  /// \param slots the sequences of the rows.
  template <class DSlots>
  void check_slots(const char* fn, const Eigen::DenseBase<DSlots>& slots) {
    grid_.check_slots(fn, slots);
  }

  /// B sequences: those below min(B, sequences()) kept as they are, the others empty.
  /// \param B the number of sequences, >= 0.
  void resize(Index B) {
    const Index kept = std::min(B, sequences());
    grid_.resize(name("resize").c_str(), B);
    if (keep_) {
      ensure_snapshots();
      for (Index b = kept; b < B; ++b) forget_call(b);
    }
  }

  /// Head h of sequence b continues from `state`, as the head decoder's set_state() does.
  /// \throws std::invalid_argument on a sequence or head out of range, or a state that does
  /// not fit; then nothing changed.
  /// \param b the sequence.
  /// \param h the head.
  /// \param state the state to continue from (copied).
  /// \param position the tokens it has consumed (position(b) then reports it).
  void set_state(Index b, Index h, const State& state, Index position = 0) {
    grid_.check_sequence(name_, "set_state", b);
    grid_.check_head(name_, "set_state", h);
    grid_.at(b, h).set_state(state, position);
    forget_call(b);
  }
  /// Every sequence continues from `states`: B·H of them, sequence-major (head h of sequence b
  /// at b·H + h). All are checked first: on an exception nothing changed.
  /// \param states the B·H states (copied).
  /// \param position the tokens each has consumed.
  void set_states(const std::vector<State>& states, Index position = 0) {
    const Index H = heads();
    if (static_cast<Index>(states.size()) != sequences() * H)
      detail::throw_invalid(name("set_states").c_str(),
                            "got " + std::to_string(states.size()) + " states but need B·H = " +
                                std::to_string(sequences()) + "·" + std::to_string(H));
    std::vector<Decoder> next;
    next.reserve(states.size());
    for (std::size_t i = 0; i < states.size(); ++i) {
      next.push_back(grid_.at(Index(i) / H, Index(i) % H));
      next.back().set_state(states[i], position);
    }
    for (std::size_t i = 0; i < states.size(); ++i)
      grid_.at(Index(i) / H, Index(i) % H) = std::move(next[i]);
    for (Index b = 0; b < sequences(); ++b) forget_call(b);
  }
  /// The state of head h of sequence b, as its decoder's state() gives it.
  /// \param b the sequence.
  /// \param h the head.
  /// \return a copy of the state.
  State state(Index b, Index h) const { return decoder(b, h).state(); }
  /// All B·H states, sequence-major, as set_states() takes them.
  /// \return the states.
  std::vector<State> states() const {
    std::vector<State> all;
    all.reserve(static_cast<std::size_t>(sequences() * heads()));
    for (Index b = 0; b < sequences(); ++b)
      for (Index h = 0; h < heads(); ++h) all.push_back(grid_.at(b, h).state());
    return all;
  }
  /// The decoder of head h of sequence b: its state, position and options, and save_state()
  /// of one head.
  /// \param b the sequence.
  /// \param h the head.
  /// \return the head's decoder.
  const Decoder& decoder(Index b, Index h) const {
    grid_.check_sequence(name_, "decoder", b);
    grid_.check_head(name_, "decoder", h);
    return grid_.at(b, h);
  }
  /// Keeps, from now on, the states after each of the last `count` tokens of every sequence in
  /// each extend() call (the rollback points of speculative decoding: a verify call over T
  /// draft tokens keeps the states after its last K of them), O(count·H·F·M) per sequence,
  /// allocated here and when sequences are added; 0 keeps none.
  /// \throws std::invalid_argument if count < 0.
  /// \param count K, the states kept per sequence and call.
  void keep_snapshots(Index count) {
    if (count < 0)
      detail::throw_invalid(name("keep_snapshots").c_str(),
                            "count must be >= 0, got " + std::to_string(count));
    keep_ = count;
    snapshots_.assign(static_cast<std::size_t>(sequences() * heads() * keep_), Snapshot{});
    calls_.assign(static_cast<std::size_t>(sequences()), Call{});
  }
  /// The number of rollback points the last extend() of sequence b kept (0 after a step(),
  /// reset() or rollback to the end).
  /// \param b the sequence.
  /// \return min(K, the tokens of that call), less what a rollback() dropped.
  Index snapshots(Index b) const {
    grid_.check_sequence(name_, "snapshots", b);
    return keep_ ? calls_[static_cast<std::size_t>(b)].kept : 0;
  }
  /// Sets sequence b back to its state after the first `tokens` tokens of its last extend()
  /// call (the accepted prefix of a verified draft): every head's state and position(b), in
  /// O(H) and without allocating. `tokens` must be one the call kept: from
  /// T − snapshots(b) + 1 to T, T that call's tokens (T: nothing to undo).
  /// \throws std::invalid_argument for another `tokens` (naming the range); nothing changes.
  /// \code
  /// dec.keep_snapshots(8);
  /// dec.extend(slots, cu_seqlens, Q, K, V, beta, log_a, out);  // 1 + 7 draft tokens a sequence
  /// dec.rollback(b, accepted + 1);  // the state after the tokens the target model accepted
  /// \endcode
  /// \param b the sequence.
  /// \param tokens the tokens of the last call to keep.
  void rollback(Index b, Index tokens) {
    grid_.check_sequence(name_, "rollback", b);
    Call& c = keep_ ? calls_[static_cast<std::size_t>(b)] : none_;
    const Index first = c.tokens - c.kept + 1;
    if (c.kept == 0 || tokens < first || tokens > c.tokens)
      detail::throw_invalid(name("rollback").c_str(),
                            "sequence " + std::to_string(b) + " can be set back to " +
                                (c.kept == 0 ? std::string("no token (no snapshot kept)")
                                             : std::to_string(first) + " ... " +
                                                   std::to_string(c.tokens) +
                                                   " tokens of its last call") +
                                ", got " + std::to_string(tokens));
    if (tokens == c.tokens) return;
    const Index j = tokens - first;
    for (Index h = 0; h < heads(); ++h)
      grid_.at(b, h).restore_from(snapshot(b, h, j), c.start + tokens);
    // The snapshots past the new end are gone (one now holds the undone state).
    c.kept = j + 1;
    c.tokens = tokens;
  }

  /// Tokens sequence b has consumed.
  /// \param b the sequence.
  /// \return its position.
  Index position(Index b) const { return decoder(b, 0).position(); }
  /// The number B of sequences.
  /// \return B.
  Index sequences() const noexcept { return grid_.sequences(); }
  /// The number H of heads of every sequence (value heads when key heads are shared).
  /// \return H.
  Index heads() const noexcept { return grid_.heads(); }

 protected:
  /// `sequences` empty sequences of `heads` heads, each a copy of `prototype`.
  /// \param name the derived class's name, for messages.
  /// \param sequences B, the number of sequences.
  /// \param heads H, the heads of every sequence.
  /// \param prototype the empty decoder every head starts as.
  BatchedHeads(const char* name, Index sequences, Index heads, Decoder prototype)
      : name_(name), grid_(heads, std::move(prototype)) {
    grid_.resize(name, sequences);
  }
  /// \cond INTERNAL
  std::string name(const char* member) const { return std::string(name_) + "::" + member; }

  // A call's record for rollback(): position before it, its tokens, the snapshots kept.
  struct Call {
    Index start = 0, tokens = 0, kept = 0;
  };
  Snapshot& snapshot(Index b, Index h, Index j) {
    return snapshots_[static_cast<std::size_t>((b * heads() + h) * keep_ + j)];
  }
  // Before a call over sequence b's n tokens (single-threaded): where its snapshots go.
  void begin_call(Index b, Index n) {
    if (!keep_) return;
    ensure_snapshots();
    Call& c = calls_[static_cast<std::size_t>(b)];
    c.start = grid_.at(b, 0).position();
    c.tokens = n;
    c.kept = std::min(keep_, n);
  }
  // After token t (0-based) of the call's n for head h of sequence b: its state, if kept.
  void after_token(Index b, Index h, Index t) {
    if (!keep_) return;
    const Call& c = calls_[static_cast<std::size_t>(b)];
    const Index j = t - (c.tokens - c.kept);
    if (j >= 0) grid_.at(b, h).snapshot_into(snapshot(b, h, j));
  }
  // A step() or reset of sequence b: no rollback point remains.
  void forget_call(Index b) {
    if (keep_ && b < static_cast<Index>(calls_.size())) calls_[static_cast<std::size_t>(b)] = Call{};
  }
  // Room for the snapshots of sequences added since keep_snapshots().
  void ensure_snapshots() {
    const std::size_t want = static_cast<std::size_t>(sequences() * heads() * keep_);
    if (snapshots_.size() < want) snapshots_.resize(want);
    if (calls_.size() < static_cast<std::size_t>(sequences()))
      calls_.resize(static_cast<std::size_t>(sequences()));
  }

  const char* name_;
  detail::DecoderGrid<Decoder> grid_;
  Index keep_ = 0;
  std::vector<Snapshot> snapshots_;  // K per (sequence, head), sequence-major
  std::vector<Call> calls_;       // per sequence
  Call none_;
  /// \endcond

 private:
  friend struct detail::RecurrentStateAccess;
};

}  // namespace linattn
