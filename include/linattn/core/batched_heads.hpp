/// \file core/batched_heads.hpp
/// \brief BatchedHeads: B sequences x H heads of a single-head decoder, the sequence management
/// (add, remove, reset, states in and out) that the batched gated and delta-rule decoders
/// share.
#pragma once

#include <Eigen/Core>

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

  /// Every sequence back to the empty one.
  void reset() {
    for (Index b = 0; b < sequences(); ++b) reset(b);
  }
  /// Sequence b back to the empty one.
  /// \param b the sequence, 0 <= b < sequences().
  void reset(Index b) {
    grid_.check_sequence(name_, "reset", b);
    for (Index h = 0; h < heads(); ++h) grid_.at(b, h).reset();
  }
  /// A new empty sequence, numbered sequences() before the call.
  /// \return its number.
  Index add_sequence() { return grid_.add_sequence(); }
  /// Removes sequence b; the last sequence takes its number (b).
  /// \param b the sequence, 0 <= b < sequences().
  void remove_sequence(Index b) {
    grid_.check_sequence(name_, "remove_sequence", b);
    grid_.remove_sequence(b);
  }
  /// B sequences: those below min(B, sequences()) kept as they are, the others empty.
  /// \param B the number of sequences, >= 0.
  void resize(Index B) { grid_.resize(name("resize").c_str(), B); }

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

  const char* name_;
  detail::DecoderGrid<Decoder> grid_;
  /// \endcond

 private:
  friend struct detail::RecurrentStateAccess;
};

}  // namespace linattn
