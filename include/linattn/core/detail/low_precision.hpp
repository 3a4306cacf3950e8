/// \file core/detail/low_precision.hpp
/// \brief bf16 and half storage (internal): runs of values widened to float and narrowed back,
/// with AVX-512 / AVX2 (+F16C) code where the build has it and Eigen's scalar conversions
/// otherwise.
///
/// Every kernel computes in float on a low-precision operand: the views (views.hpp) widen an
/// operand into a float copy and narrow a float result into the caller's storage with these
/// loops. Both directions give exactly Eigen's scalar conversions (`float(Eigen::bfloat16)`,
/// `Eigen::bfloat16(float)`: round to nearest even, subnormals kept, overflow to infinity), so
/// that a result does not depend on the instruction set it was built for; a NaN stays a NaN (a
/// half NaN's payload is the instruction set's).
/// AVX-512-BF16's VCVTNEPS2BF16 is not used for that reason: it flushes subnormal inputs to zero.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "../common.hpp"

namespace linattn::detail {

#if defined(__F16C__)
inline constexpr bool kHasF16C = true;
#else
inline constexpr bool kHasF16C = false;
#endif

// Packets of 16 (AVX-512) or 8 (AVX2) values: load widened, store narrowed, with the rounding of
// the loops below (which use them). The fused decode step of low_precision_state.hpp uses them
// too.
#if defined(__AVX512F__)
inline __m512 load_widened16(const Eigen::bfloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load_widened16(const Eigen::half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// Round to nearest even on the upper 16 bits (Eigen's float_to_bfloat16_rtne): add 0x7fff plus
// the lowest kept bit, keep the upper half, in 32-bit lanes. A NaN is not special-cased here
// (it may round to an infinity); store_narrowed16 makes it 0x7fc0 with its sign.
inline __m512i bf16_rounded_lanes(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                           16);
}
inline void store_narrowed16(Eigen::bfloat16* p, __m512 x) {
  const __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(x), 16);
  const __m512i nan =
      _mm512_or_si512(_mm512_and_si512(hi, _mm512_set1_epi32(0x8000)), _mm512_set1_epi32(0x7fc0));
  const __m512i r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                            bf16_rounded_lanes(x), nan);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline void store_narrowed16(Eigen::half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// store_narrowed16, returning the stored values widened without loading them back.
inline __m512 store_narrowed_widened16(Eigen::bfloat16* p, __m512 x) {
  const __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(x), 16);
  const __m512i nan =
      _mm512_or_si512(_mm512_and_si512(hi, _mm512_set1_epi32(0x8000)), _mm512_set1_epi32(0x7fc0));
  const __m512i r =
      _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), bf16_rounded_lanes(x), nan);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  return _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
}
inline __m512 store_narrowed_widened16(Eigen::half* p, __m512 x) {
  const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  return _mm512_cvtph_ps(h);
}
#elif defined(__AVX2__)
inline __m256 load_widened8(const Eigen::bfloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
// The rounded upper halves of 8 floats, as 8 32-bit lanes: bf16_rounded_lanes with no NaN case,
// rounded_bf16_lanes with Eigen's (see the AVX-512 versions).
// x's bits with the round-to-nearest-even increment added: the rounded value is in the upper
// halves (no NaN case).
inline __m256i bf16_rounding_added(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
}
inline __m256i bf16_rounded_lanes(__m256 x) {
  return _mm256_srli_epi32(bf16_rounding_added(x), 16);
}
inline __m256i rounded_bf16_lanes(__m256 x) {
  const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
  const __m256i nan =
      _mm256_or_si256(_mm256_and_si256(hi, _mm256_set1_epi32(0x8000)), _mm256_set1_epi32(0x7fc0));
  return _mm256_blendv_epi8(bf16_rounded_lanes(x), nan,
                            _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
inline void store_narrowed8(Eigen::bfloat16* p, __m256 x) {
  // packus works within 128-bit lanes: [a0..3 a0..3 a4..7 a4..7]; the permute puts a0..7 low.
  const __m256i r = rounded_bf16_lanes(x);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
// store_narrowed8, returning the stored values widened without loading them back.
inline __m256 store_narrowed_widened8(Eigen::bfloat16* p, __m256 x) {
  const __m256i r = rounded_bf16_lanes(x);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  return _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
}
#if defined(__F16C__)
inline __m256 load_widened8(const Eigen::half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store_narrowed8(Eigen::half* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline __m256 store_narrowed_widened8(Eigen::half* p, __m256 x) {
  const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  return _mm256_cvtph_ps(h);
}
#endif
#endif

// bf16: a float's upper 16 bits. Widening is a shift, exact.
inline void widen(const Eigen::bfloat16* src, float* dst, Index n) {
  Index i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load_widened16(src + i));
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_widened8(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Round to nearest even (see store_narrowed16).
inline void narrow(const float* src, Eigen::bfloat16* dst, Index n) {
  Index i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) store_narrowed16(dst + i, _mm512_loadu_ps(src + i));
#elif defined(__AVX2__)
  for (; i + 16 <= n; i += 16) {
    // Two packets at once: one packus and one permute for 16 values.
    const __m256i packed = _mm256_packus_epi32(rounded_bf16_lanes(_mm256_loadu_ps(src + i)),
                                               rounded_bf16_lanes(_mm256_loadu_ps(src + i + 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_permute4x64_epi64(packed, 0xd8));
  }
#endif
  for (; i < n; ++i) dst[i] = Eigen::bfloat16(src[i]);
}

// half: the F16C conversions are IEEE round to nearest even with subnormals, infinities and
// NaNs, as Eigen's scalar float_to_half_rtne.
inline void widen(const Eigen::half* src, float* dst, Index n) {
  Index i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load_widened16(src + i));
#elif defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_widened8(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void narrow(const float* src, Eigen::half* dst, Index n) {
  Index i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) store_narrowed16(dst + i, _mm512_loadu_ps(src + i));
#elif defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8) store_narrowed8(dst + i, _mm256_loadu_ps(src + i));
#endif
  for (; i < n; ++i) dst[i] = Eigen::half(src[i]);
}

// A 2-D operand of storage scalar S (unit inner stride, outer stride `ld`) widened into the
// float matrix `dst` of the same shape and storage order, outer slice by outer slice.
template <class Src, class Dst>
void widen_into(const Src& src, Dst& dst) {
  static_assert(bool(Src::IsRowMajor) == bool(Dst::IsRowMajor) || Src::ColsAtCompileTime == 1);
  dst.resize(src.rows(), src.cols());
  const Index outer = src.outerSize(), inner = src.innerSize();
  for (Index o = 0; o < outer; ++o)
    widen(src.data() + o * src.outerStride(), dst.data() + o * dst.outerStride(), inner);
}

template <class Src, class Dst>
void narrow_into(const Src& src, Dst& dst) {
  const Index outer = src.outerSize(), inner = src.innerSize();
  for (Index o = 0; o < outer; ++o)
    narrow(src.data() + o * src.outerStride(), dst.data() + o * dst.outerStride(), inner);
}

// One decode token: the vector expression x into the contiguous dst, as Scalar. Memory with
// unit stride (a row of row-major tokens) is copied on packets, or widened by widen for bf16 /
// half; Eigen's cast converts those one scalar at a time, and a reshaped row block is copied
// one scalar at a time too. Anything else goes through Eigen.
template <class Scalar, class X>
void assign_widened(Vector<Scalar>& dst, const Eigen::MatrixBase<X>& x) {
  using T = typename X::Scalar;
  if constexpr ((int(X::Flags) & Eigen::DirectAccessBit) != 0 &&
                (std::is_same_v<T, Scalar> ||
                 (std::is_same_v<Scalar, float> && is_low_precision_v<T>))) {
    if (x.innerStride() == 1 || x.size() <= 1) {
      dst.resize(x.size());
      if constexpr (std::is_same_v<T, Scalar>)
        dst = Eigen::Map<const Vector<Scalar>>(x.derived().data(), x.size());
      else
        widen(x.derived().data(), dst.data(), x.size());
      return;
    }
  }
  dst = x.reshaped().template cast<Scalar>();
}

// The reverse: a token's output (contiguous) into the vector expression y, rounded once.
template <class Y, class Scalar>
void assign_narrowed(Y&& y, const Vector<Scalar>& src) {
  using Out = std::decay_t<Y>;
  using T = typename Out::Scalar;
  if constexpr ((int(Out::Flags) & Eigen::DirectAccessBit) != 0 &&
                (std::is_same_v<T, Scalar> ||
                 (std::is_same_v<Scalar, float> && is_low_precision_v<T>))) {
    if (y.innerStride() == 1 || y.size() <= 1) {
      if constexpr (std::is_same_v<T, Scalar>)
        Eigen::Map<Vector<Scalar>>(y.derived().data(), src.size()) = src;
      else
        narrow(src.data(), y.derived().data(), src.size());
      return;
    }
  }
  y = src.reshaped(y.rows(), y.cols()).template cast<T>();
}
// One packet (P lanes) of a decode state whose entries are Storage: the compute type itself
// (plain loads and stores) or bf16 / half, loaded widened and stored rounded. The store returns
// the stored value as the next token reads it (widened back). One kernel serves both kinds of
// state, so a bf16 state sweep is a float sweep followed by narrow() of its state by
// construction: the rounding is narrow()'s, Eigen's scalar conversion.
template <class Packet, class Storage>
Packet load_state_packet(const Storage* p) {
  using Scalar = typename Eigen::internal::unpacket_traits<Packet>::type;
  constexpr int P = Eigen::internal::unpacket_traits<Packet>::size;
  if constexpr (std::is_same_v<Storage, Scalar>) {
    return Eigen::internal::ploadu<Packet>(p);
  } else
#if defined(__AVX512F__)
  if constexpr (P == 16) {
    return load_widened16(p);
  } else
#elif defined(__AVX2__)
  if constexpr (P == 8 && (std::is_same_v<Storage, Eigen::bfloat16> || kHasF16C)) {
    return load_widened8(p);
  } else
#endif
  {
    alignas(64) float buf[P];
    widen(p, buf, P);
    return Eigen::internal::pload<Packet>(buf);
  }
}
template <class Packet, class Storage>
Packet store_state_packet(Storage* p, const Packet& x) {
  using Scalar = typename Eigen::internal::unpacket_traits<Packet>::type;
  constexpr int P = Eigen::internal::unpacket_traits<Packet>::size;
  if constexpr (std::is_same_v<Storage, Scalar>) {
    Eigen::internal::pstoreu(p, x);
    return x;
  } else
#if defined(__AVX512F__)
  if constexpr (P == 16) {
    return store_narrowed_widened16(p, x);
  } else
#elif defined(__AVX2__)
  if constexpr (P == 8 && (std::is_same_v<Storage, Eigen::bfloat16> || kHasF16C)) {
    return store_narrowed_widened8(p, x);
  } else
#endif
  {
    alignas(64) float buf[P];
    Eigen::internal::pstore(buf, x);
    narrow(buf, p, P);
    widen(p, buf, P);
    return Eigen::internal::pload<Packet>(buf);
  }
}
// One entry of such a state: stores x (rounded for bf16 / half) and returns what was stored.
template <class Storage, class Scalar>
Scalar store_state_value(Storage& s, Scalar x) {
  if constexpr (std::is_same_v<Storage, Scalar>) {
    s = x;
    return x;
  } else {
    s = Storage(x);
    return static_cast<Scalar>(s);
  }
}
// A decode state kept in bf16 / half (the gated and delta-rule decoders' StateScalar): S,
// rounded once after every token; the gated decoder's z and log-decay totals stay in float (F
// entries each; empty for the delta rule), as the float state's.
template <class Storage>
struct LowDecodeState {
  using StateMatrix = Eigen::Matrix<Storage, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  StateMatrix S;
  Vector<float> z, log_decay;

  LowDecodeState() = default;
  LowDecodeState(Index F, Index M) : S(StateMatrix::Zero(F, M)), z(Vector<float>::Zero(F)) {}
  void reset() {
    S.setZero();
    z.setZero();
    log_decay.setZero();
  }
};
}  // namespace linattn::detail
