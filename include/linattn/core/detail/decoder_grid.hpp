/// \file core/detail/decoder_grid.hpp
/// \brief B sequences x H heads of single-head decoders stepped together (internal): the
/// sequences, slots and threads of the batched gated and delta-rule decoders.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common.hpp"
#include "../parallel.hpp"
#include "checks.hpp"

namespace linattn::detail {

// One decoder per (sequence, head), sequence-major (head h of sequence b at b·H + h). Each
// head is a whole single-head decoder, so that a batched step computes what H·B separate
// steps compute, bit for bit, whatever the thread count, and its save/load is theirs. Sequences
// past B are kept as spares (reset), so that add_sequence() after remove_sequence() allocates
// nothing.
template <class Decoder>
class DecoderGrid {
 public:
  DecoderGrid(Index heads, Decoder prototype) : heads_(heads), prototype_(std::move(prototype)) {}

  Index sequences() const noexcept { return sequences_; }
  Index heads() const noexcept { return heads_; }
  const Decoder& prototype() const noexcept { return prototype_; }
  Decoder& at(Index b, Index h) { return decoders_[index(b, h)]; }
  const Decoder& at(Index b, Index h) const { return decoders_[index(b, h)]; }

  void resize(const char* fn, Index B) {
    if (B < 0) throw_invalid(fn, "the number of sequences must be >= 0, got " + std::to_string(B));
    const std::size_t total = static_cast<std::size_t>(B * heads_);
    while (decoders_.size() < total) decoders_.push_back(prototype_);
    for (std::size_t i = static_cast<std::size_t>(std::min(B, sequences_) * heads_); i < total;
         ++i)
      decoders_[i].reset();
    if (marks_.size() < static_cast<std::size_t>(B)) marks_.resize(static_cast<std::size_t>(B));
    sequences_ = B;
  }
  Index add_sequence() {
    resize("add_sequence", sequences_ + 1);
    return sequences_ - 1;
  }
  // Sequence b leaves; the last one takes its slot (b's number now names it).
  void remove_sequence(Index b) {
    const Index last = sequences_ - 1;
    if (b != last)
      for (Index h = 0; h < heads_; ++h) std::swap(decoders_[index(b, h)], decoders_[index(last, h)]);
    for (Index h = 0; h < heads_; ++h) decoders_[index(last, h)].reset();
    --sequences_;
  }

  // `cls`::`member` in the message, built only on failure.
  void check_sequence(const char* cls, const char* member, Index b) const {
    if (b < 0 || b >= sequences_)
      throw_invalid((std::string(cls) + "::" + member).c_str(),
                    "sequence " + std::to_string(b) + " is outside [0, " +
                        std::to_string(sequences_) + ")");
  }
  void check_head(const char* cls, const char* member, Index h) const {
    if (h < 0 || h >= heads_)
      throw_invalid((std::string(cls) + "::" + member).c_str(),
                    "head " + std::to_string(h) + " is outside [0, " + std::to_string(heads_) +
                        ")");
  }

  // The sequences of a step's rows: slots (a vector of n distinct sequence numbers, any
  // integer type), checked before anything moves.
  template <class DSlots>
  void check_slots(const char* fn, const Eigen::DenseBase<DSlots>& slots) {
    static_assert(std::is_integral_v<typename DSlots::Scalar> &&
                      !std::is_same_v<typename DSlots::Scalar, bool>,
                  "linattn: slots must be integers");
    if (slots.rows() != 1 && slots.cols() != 1 && slots.size() != 0)
      throw_invalid(fn, "slots is " + shape_of(slots) + " but must be a vector");
    const Index n = slots.size();
    Index bad = -1;
    const char* why = "";
    for (Index r = 0; r < n && bad < 0; ++r) {
      const long long s = slot_of(slots, r);
      if (s < 0 || s >= static_cast<long long>(sequences_)) {
        bad = r;
        why = "is outside [0, B)";
      } else if (marks_[static_cast<std::size_t>(s)]) {
        bad = r;
        why = "repeats an earlier slot";
      } else {
        marks_[static_cast<std::size_t>(s)] = 1;
      }
    }
    for (Index r = 0; r < n; ++r) {
      const long long s = slot_of(slots, r);
      if (s >= 0 && s < static_cast<long long>(sequences_)) marks_[static_cast<std::size_t>(s)] = 0;
    }
    if (bad >= 0)
      throw_invalid(fn, "slots(" + std::to_string(bad) + ") = " +
                            std::to_string(slot_of(slots, bad)) + " " + why + " (B = " +
                            std::to_string(sequences_) + ")");
  }
  template <class DSlots>
  static long long slot_of(const Eigen::DenseBase<DSlots>& slots, Index r) {
    return static_cast<long long>(slots.rows() == 1 ? slots.derived().coeff(0, r)
                                                    : slots.derived().coeff(r, 0));
  }

  // fn(r, h, decoder) for every row r < n (sequence slot(r)) and head h, on the threads that
  // `pair_work` flops a pair pay for: contiguous ranges of pairs of equal cost, a static split.
  template <class Slot, class Fn>
  void run(Index n, const Slot& slot, double pair_work, const ParallelOptions& par,
           const Fn& fn) {
    const Index tasks = n * heads_;
    if (tasks == 0) return;
    const int threads = static_cast<int>(
        std::min<Index>(threads_for(par, double(tasks) * pair_work), tasks));
    const auto one = [&](Index t) {
      const Index r = t / heads_, h = t % heads_;
      fn(r, h, decoders_[index(slot(r), h)]);
    };
    if (threads <= 1) {
      for (Index t = 0; t < tasks; ++t) one(t);
      return;
    }
    run_team(threads, executor_of(par), [&](int me, int T) {
      for (Index t = Index(me) * tasks / T; t < Index(me + 1) * tasks / T; ++t) one(t);
    });
  }

 private:
  std::size_t index(Index b, Index h) const noexcept {
    return static_cast<std::size_t>(b * heads_ + h);
  }

  Index heads_;
  Decoder prototype_;
  Index sequences_ = 0;
  std::vector<Decoder> decoders_;     // may hold spares past B·H
  std::vector<unsigned char> marks_;  // per sequence: the repeat check of the slots
};

}  // namespace linattn::detail
