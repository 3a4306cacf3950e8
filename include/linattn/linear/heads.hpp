/// \file linear/heads.hpp
/// \brief The packed multi-head layout: offsets_view() over framework `cu_seqlens`, and the
/// shape, offset and state checks every multi-head and batched entry point shares.
#pragma once

#include <Eigen/Core>

#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../core/state.hpp"
#include "../core/workspace.hpp"
#include "../maps/map_state.hpp"

namespace linattn {

namespace detail {

// Q is N x (H·D), K is L x (H·D), V is L x (H·M); returns D and M. Callers copy them into plain
// variables: their lambdas capture them, and C++17 does not allow capturing a structured
// binding (clang rejects it, GCC accepts it).
template <class DQ, class DK, class DV>
std::pair<Index, Index> check_heads(const char* function, const Eigen::MatrixBase<DQ>& Q,
                                    const Eigen::MatrixBase<DK>& K,
                                    const Eigen::MatrixBase<DV>& V, Index heads, bool causal) {
  static_check_scalars<DQ, DK, DV>();
  const auto shapes = [&] {
    return " (Q is " + shape_of(Q) + ", K is " + shape_of(K) + ", V is " + shape_of(V) +
           ", heads = " + std::to_string(heads) + ")";
  };
  if (heads <= 0) throw_invalid(function, "heads must be positive" + shapes());
  if (Q.cols() % heads != 0 || V.cols() % heads != 0)
    throw_invalid(function, "the columns of Q and V must be multiples of heads" + shapes());
  check_qkv(function, Q, K, V, causal);
  return {Q.cols() / heads, V.cols() / heads};
}

// The packed layout of H value heads over Hk query/key heads (Hk = H unless heads are
// shared, GVA): Q and K are N x Hk·D, V is L x H·M, and value head h reads key head
// h / (H / Hk) (FLA's and transformers' order: each key head serves consecutive value heads).
struct HeadLayout {
  Index heads, key_heads, D, M;
  Index group() const noexcept { return heads / key_heads; }
  Index key_head(Index h) const noexcept { return h / group(); }
};

// check_heads() for `heads` value heads sharing `key_heads` query/key heads (the options'
// value; 0: as many as heads). Messages name both counts.
template <class DQ, class DK, class DV>
HeadLayout check_grouped_heads(const char* function, const Eigen::MatrixBase<DQ>& Q,
                               const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                               Index heads, Index key_heads, bool causal) {
  if (key_heads == 0 || key_heads == heads) {
    const std::pair<Index, Index> dims = check_heads(function, Q, K, V, heads, causal);
    return {heads, heads, dims.first, dims.second};
  }
  static_check_scalars<DQ, DK, DV>();
  const auto shapes = [&] {
    return " (Q is " + shape_of(Q) + ", K is " + shape_of(K) + ", V is " + shape_of(V) +
           ", heads = " + std::to_string(heads) + ", key_heads = " + std::to_string(key_heads) +
           ")";
  };
  if (heads <= 0) throw_invalid(function, "heads must be positive" + shapes());
  const Index kh = resolve_key_heads(function, heads, key_heads);
  if (Q.cols() % kh != 0)
    throw_invalid(function, "the columns of Q and K must be multiples of key_heads" + shapes());
  if (V.cols() % heads != 0)
    throw_invalid(function, "the columns of V must be multiples of heads" + shapes());
  check_qkv(function, Q, K, V, causal);
  return {heads, kh, Q.cols() / kh, V.cols() / heads};
}

// check_grouped_heads() and the head sizes the caller stated (key_dim, value_dim; 0: not
// stated) of a plain linear-attention call (CausalOptions, HeadOptions).
template <class DQ, class DK, class DV>
HeadLayout check_head_layout(const char* function, const Eigen::MatrixBase<DQ>& Q,
                             const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                             Index heads, Index key_heads, Index key_dim, Index value_dim,
                             bool causal) {
  // The stated sizes first: for Q and K of fewer heads than H without key_heads, their
  // message (set key_heads) says more than one about columns not divisible by heads.
  if (heads > 0)
    check_head_dims(function, Q, V, heads, resolve_key_heads(function, heads, key_heads), key_dim,
                    value_dim, "V");
  return check_grouped_heads(function, Q, K, V, heads, key_heads, causal);
}

// A rows x cols scratch of the view type View (a Map with an outer stride, detail/views.hpp)
// in the workspace's buffer `slot`: a kernel writing into it is the instantiation that writes
// the caller's gradients.
template <class View, class Scalar>
View scratch_view(Workspace<Scalar>& ws, int slot, Index rows, Index cols) {
  return View(ws.vector(slot, rows * cols).data(), rows, cols,
              Eigen::OuterStride<>(View::IsRowMajor ? cols : rows));
}

// Sequence offsets (cu_seqlens) read in place, whatever their integer type and layout: a
// contiguous array (std::vector, a pointer) or an Eigen vector (Matrix, Map, a block of either).
// One type for all of them, so that the kernels are instantiated once rather than once per
// offsets type (each instantiation is seconds of compile time in every program that uses it);
// an indirect call per offset read is nothing next to a sequence's work.
class OffsetsRef {
 public:
  template <class Int>
  OffsetsRef(const Int* data, std::size_t count) noexcept
      : object_(data), count_(count), read_(&read_array<Int>) {}
  template <class D>
  explicit OffsetsRef(const Eigen::DenseBase<D>& v) noexcept
      : object_(&v.derived()), count_(static_cast<std::size_t>(v.size())), read_(&read_eigen<D>) {}
  Index operator[](std::size_t i) const { return read_(object_, static_cast<Index>(i)); }
  std::size_t size() const noexcept { return count_; }

 private:
  template <class Int>
  static Index read_array(const void* data, Index i) {
    return static_cast<Index>(static_cast<const Int*>(data)[i]);
  }
  template <class D>
  static Index read_eigen(const void* object, Index i) {
    const D& v = *static_cast<const D*>(object);
    return static_cast<Index>(v.rows() == 1 ? v.coeff(0, i) : v.coeff(i, 0));
  }
  const void* object_;
  std::size_t count_;
  Index (*read_)(const void*, Index);
};

template <class Int>
constexpr void static_check_offsets() {
  static_assert(std::is_integral_v<Int> && !std::is_same_v<Int, bool>,
                "linattn: offsets must be integers (std::vector, an Eigen vector or Map of any "
                "integer type)");
}
// Offsets already read in place (a layer passing its checked offsets on to the kernels).
inline OffsetsRef offsets_of(const char*, const char*, const OffsetsRef& v) noexcept {
  return v;
}
template <class Int, class Alloc>
OffsetsRef offsets_of(const char*, const char*, const std::vector<Int, Alloc>& v) {
  static_check_offsets<Int>();
  return OffsetsRef(v.data(), v.size());
}
template <class D>
OffsetsRef offsets_of(const char* function, const char* name, const Eigen::DenseBase<D>& v) {
  static_check_offsets<typename D::Scalar>();
  if (v.rows() != 1 && v.cols() != 1 && v.size() != 0)
    throw_invalid(function, std::string(name) + " is " + shape_of(v) + " but must be a vector");
  return OffsetsRef(v);
}

// Sequence b occupies rows [offsets[b], offsets[b+1]); the `count` offsets start at 0, never
// decrease and end at `rows`.
template <class Off>
void check_offsets(const char* function, const char* name, const Off& offsets, Index rows) {
  const std::size_t count = offsets.size();
  if (count == 0 || offsets[0] != 0 || offsets[count - 1] != rows)
    throw_invalid(function, std::string(name) + " must start at 0 and end at " +
                                std::to_string(rows) + " (the number of rows)" +
                                (count == 0 ? std::string(", got no entries")
                                            : ", got " + std::to_string(offsets[0]) + " ... " +
                                                  std::to_string(offsets[count - 1])));
  for (std::size_t b = 1; b < count; ++b)
    if (offsets[b] < offsets[b - 1])
      throw_invalid(function, std::string(name) + " must not decrease (entry " + std::to_string(b) +
                                  " is " + std::to_string(offsets[b]) + " after " +
                                  std::to_string(offsets[b - 1]) + ")");
}

// The caller's states of a causal call: B·H (sequence-major), or none (then B·H empty ones are
// made: the one allocation of such a call). Every state must be empty (zero) or fit the map and
// shapes; empty ones are sized here, before any thread starts, so that no task throws.
template <class Scalar, class Phi>
void check_states(const char* fn, std::vector<LinearAttentionState<Scalar>>& states, Index B,
                  Index heads, const Phi& phi, Index D, Index M) {
  const std::size_t count = static_cast<std::size_t>(B * heads);
  if (states.empty()) states.resize(count);
  if (states.size() != count)
    throw_invalid(fn, "got " + std::to_string(states.size()) + " states but need " +
                          std::to_string(count) + " (" + std::to_string(B) + " sequence(s) x " +
                          std::to_string(heads) + " heads, sequence-major), or none");
  const Index F = phi.feature_dim(D);
  const Index per_feature = normalizes_keys_per_feature_v<Phi> ? F : 0;
  for (std::size_t i = 0; i < count; ++i) {
    const LinearAttentionState<Scalar>& st = states[i];
    if (st.empty()) continue;
    const bool lo_fits = (st.S_lo.size() == 0 || (st.S_lo.rows() == F && st.S_lo.cols() == M)) &&
                         (st.z_lo.size() == 0 || st.z_lo.size() == F);
    if (st.S.rows() != F || st.S.cols() != M || st.z.size() != F || st.m.size() != per_feature ||
        !lo_fits)
      throw_invalid(fn, "states[" + std::to_string(i) + "] (sequence " +
                            std::to_string(Index(i) / heads) + ", head " +
                            std::to_string(Index(i) % heads) + ": S is " + shape_of(st.S) +
                            ", z has " + std::to_string(st.z.size()) + " entries, m has " +
                            std::to_string(st.m.size()) + ") does not fit F = " +
                            std::to_string(F) + ", M = " + std::to_string(M) +
                            " for this feature map");
  }
  for (LinearAttentionState<Scalar>& st : states) prepare_state(fn, st, phi, D, M);
}

}  // namespace detail

/// \brief A zero-copy view of `count` offsets at `data`, of any integer type, for the batched
/// kernels (framework `cu_seqlens` are int32 buffers).
/// \code
/// const std::int32_t* cu_seqlens = ...;  // B + 1 entries
/// linattn::batched_causal_linear_attention(Q, K, V, linattn::offsets_view(cu_seqlens, B + 1),
///                                          8, linattn::EluPlusOne{}, out, ws);
/// \endcode
/// \param data the first offset.
/// \param count the number of offsets, B + 1 for B sequences.
/// \return a view of the offsets, valid as long as the buffer.
template <class Int>
Eigen::Map<const Eigen::Matrix<Int, Eigen::Dynamic, 1>> offsets_view(const Int* data,
                                                                     std::size_t count) {
  detail::static_check_offsets<Int>();
  return Eigen::Map<const Eigen::Matrix<Int, Eigen::Dynamic, 1>>(data, static_cast<Index>(count));
}

}  // namespace linattn
