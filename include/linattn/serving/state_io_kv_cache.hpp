/// \file serving/state_io_kv_cache.hpp
/// \brief Saving and loading the KV cache of a SoftmaxAttentionLayer's generation state
/// (kind 6 of linattn's state format: state_io.hpp, docs/SPEC.md §8) exactly. Included by
/// state_io.hpp.
#pragma once

#include <cstdint>
#include <istream>
#include <ostream>
#include <utility>

#include "../core/common.hpp"
#include "detail/state_io_format.hpp"

namespace linattn {

/// \brief Writes the KV cache of a SoftmaxAttentionLayer's generation state
/// (`SoftmaxAttentionLayer<Scalar>::State`, kind 6): the number of cached tokens T, which is
/// position(), then the T cached key rows (T x H·D) and value rows (T x H·M) with their bits.
/// Only the live rows are written, not the capacity reserved past them.
///
/// A decode saved after any token, loaded into a State of a layer of the same shapes with
/// load_state(is, state) and continued with step() or forward(X, state) gives the
/// uninterrupted decode's outputs bit for bit. The file records H, D and M (F = 0: no feature
/// map), not the layer's weights or d_model: load it for the layer that made it. It is
/// \f$72 + 8 + T\,H\,(D + M)\,s\f$ bytes for s-byte scalars.
/// \throws std::runtime_error if the stream was not writable or a write failed.
/// \code
/// linattn::SoftmaxAttentionLayer<float> layer(256, 8);
/// auto state = layer.make_state(1024);
/// Eigen::MatrixXf P = layer.forward(prompt, state);  // prefill, then layer.step(...)
/// std::ofstream file("conversation.cache", std::ios::binary);
/// linattn::save_state(file, state);
/// \endcode
/// \param os the binary stream the record is appended to.
/// \param state the state written, unchanged.
template <class Scalar>
void save_state(std::ostream& os, const SoftmaxAttentionLayerState<Scalar>& state) {
  const Index H = detail::RecurrentStateAccess::heads(state), T = state.position();
  const auto K = state.keys();
  const auto V = state.values();
  detail::io::Writer w(os, "save_state");
  detail::io::write_header<Scalar>(w, detail::io::kKindKVCache, false, H, K.cols() / H, 0,
                                   V.cols() / H, 0);
  w.integer(std::uint64_t(T));
  if (T > 0) {  // row-major: the T live rows are the first T·H·D (T·H·M) scalars
    w.scalars(K.data(), T * K.cols());
    w.scalars(V.data(), T * V.cols());
  }
  w.finish();
}

/// \brief Restores into `state` (a `SoftmaxAttentionLayer<Scalar>::State`) the KV cache that
/// save_state(os, state) wrote: its T key and value rows with their bits, and position() = T.
/// The layer then continues it exactly as it would have continued the saved State.
///
/// The file must have the State's H, D and M. The cached rows go into the State's own
/// memory when its capacity() holds them (a make_state(capacity) reservation is kept), else
/// the cache is reallocated to T rows (it grows by doubling from there). Strong guarantee: on
/// any failure `state` is unchanged. Reads exactly one record; T is checked against the
/// sanity bounds (at most 64 GiB of rows) and, when the stream can tell its length, against
/// it before anything is allocated.
/// \throws std::runtime_error `"linattn::load_state: ..."` for every failure of
/// load_state(std::istream&) (truncated, e.g. "truncated file: expected 640 bytes of keys, got
/// 100"; corrupted; wrong magic, version, scalar type or kind; absurd shapes, including a T
/// of more than 64 GiB of rows; a feature dimension, maxima or log-decay in the header), and
/// "shape mismatch" naming the file's and the State's H, D and M.
/// \code
/// linattn::SoftmaxAttentionLayer<float> layer(256, 8);  // the same weights
/// auto state = layer.make_state(4096);
/// std::ifstream file("conversation.cache", std::ios::binary);
/// linattn::load_state(file, state);  // state.position() is the saved one
/// layer.step(x, state, y);           // continues the saved decode
/// \endcode
/// \param is the binary stream, positioned at the record.
/// \param state replaced by the loaded state.
template <class Scalar>
void load_state(std::istream& is, SoftmaxAttentionLayerState<Scalar>& state) {
  constexpr const char* fn = "load_state";
  std::uint32_t crc = 0;
  const auto hd = detail::io::read_header<Scalar>(is, fn, detail::io::kKindKVCache, crc);
  const Index H = detail::RecurrentStateAccess::heads(state);
  detail::io::check_cache_shape(fn, hd, "SoftmaxAttentionLayer::State", std::uint64_t(H),
                                std::uint64_t(state.keys().cols() / H),
                                std::uint64_t(state.values().cols() / H));
  auto r = detail::io::read_kv_payload<Scalar>(is, fn, hd, crc);
  detail::RecurrentStateAccess::install(state, std::move(r.keys), std::move(r.values));
}

}  // namespace linattn
