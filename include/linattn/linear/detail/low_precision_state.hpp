/// \file linear/detail/low_precision_state.hpp
/// \brief A decode state kept in bf16 or half (internal): BatchedRecurrentLinearAttention<Phi,
/// float, Eigen::bfloat16>.
///
/// Why: at B sequences x H heads a decode step reads and writes every state once, B·H·F·M
/// values, and for many sequences that traffic, not the arithmetic, bounds the step. A float
/// state with its compensated low part is 8 bytes a value read and 4 written; a bf16 state is 2
/// and 2. What it costs: S is rounded to 8 significant bits after every token, so a token whose
/// contribution is below half an ulp of S is lost, and the state drifts like a sum kept in
/// bf16 (measured in bench_low_precision and docs/SPEC.md). z, F floats a head, stays in float
/// with its low part, so the denominators are the float state's.
#pragma once

#include <Eigen/Core>
#include <cstring>
#include <type_traits>

#include "../../core/common.hpp"
#include "../../core/state.hpp"
#include "../../core/detail/low_precision.hpp"
#include "../../maps/map_state.hpp"

namespace linattn::detail {

template <class Storage>
struct LowPrecisionState {
  using StateMatrix = Eigen::Matrix<Storage, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  StateMatrix S;          // F x M, rounded to Storage after every token
  Vector<float> z, z_lo;  // F, as LinearAttentionState's

  LowPrecisionState() = default;
  LowPrecisionState(Index F, Index M)
      : S(StateMatrix::Zero(F, M)), z(Vector<float>::Zero(F)), z_lo(Vector<float>::Zero(F)) {}
  bool empty() const noexcept { return S.size() == 0 && z.size() == 0; }
  void reset() {
    S.setZero();
    z.setZero();
    z_lo.setZero();
  }
  // z's low part into z, as LinearAttentionState::fold (S has no low part).
  void fold() { two_sum_fold(z.data(), z_lo.data(), z.size()); }
  // From a float state (folded): S + S_lo rounded once, z and its low part kept.
  void assign(const LinearAttentionState<float>& st) {
    S.resize(st.S.rows(), st.S.cols());
    const LinearAttentionState<float>::StateMatrix sum =
        st.S_lo.size() == st.S.size() ? LinearAttentionState<float>::StateMatrix(st.S + st.S_lo)
                                      : st.S;
    narrow(sum.data(), S.data(), S.size());
    z = st.z;
    z_lo = st.z_lo.size() == st.z.size() ? st.z_lo : Vector<float>::Zero(st.z.size());
  }
  // As a float state (exact: every bf16 / half value is a float).
  LinearAttentionState<float> widened() const {
    LinearAttentionState<float> st(S.rows(), S.cols());
    widen(S.data(), st.S.data(), S.size());
    st.z = z;
    st.z_lo = z_lo;
    return st;
  }
};

// A state's values rounded to the storage type, 16 at a time. bf16: with AVX-512-BF16 one
// VCVTNEPS2BF16 (round to nearest even, as store_narrowed16, but subnormal values, below
// 1.2e-38, flushed to zero: a state entry that small weighs nothing against its row); without
// it, round to nearest even on the integer bits with no NaN case (a NaN in a state is already
// an unspecified result; it may round to an infinity here). half: the F16C rounding.
#if defined(__AVX512F__)
inline void store_state16(Eigen::bfloat16* p, __m512 x) {
#if defined(__AVX512BF16__)
  const __m256bh r = _mm512_cvtneps_pbh(x);
  std::memcpy(static_cast<void*>(p), &r, sizeof r);
#else
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_rounded_lanes(x)));
#endif
}
inline void store_state16(Eigen::half* p, __m512 x) { store_narrowed16(p, x); }
#elif defined(__AVX2__)
#if defined(__F16C__)
inline void store_state16(Eigen::half* p, __m256 a, __m256 b) {
  store_narrowed8(p, a);
  store_narrowed8(p + 8, b);
}
#endif
// bf16 on AVX2, 16 columns as two packets: `even` holds columns 0, 2, ..., 14 and `odd` columns
// 1, 3, ..., 15. Why: 16 bf16 values loaded as 8 32-bit lanes widen into these two packets with
// one shift and one mask (no lane-crossing unpack), and the rounded upper halves go back with
// one shift and one 16-bit blend (no pack and permute). The step is bound by its vector
// operations on AVX2 (bench_low_precision), and v and o are
// reordered once a block of columns, outside the loop over the rows.
inline void load_state_pair(const Eigen::bfloat16* p, __m256& even, __m256& odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int(0xffff0000u))));
}
inline void store_state_pair(Eigen::bfloat16* p, __m256 even, __m256 odd) {
  // even's rounded values in the low halves, odd's in the upper halves: one blend joins them.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_blend_epi16(bf16_rounded_lanes(even), bf16_rounding_added(odd), 0xAA));
}
// 16 floats in the pair order above, and back.
inline void split_pair(const float* p, __m256& even, __m256& odd) {
  const __m256 lo = _mm256_loadu_ps(p), hi = _mm256_loadu_ps(p + 8);
  // shuffle_ps works within 128-bit lanes: [0 2 8 10 | 4 6 12 14]; the permute sorts them.
  even = _mm256_castpd_ps(
      _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), 0xd8));
  odd = _mm256_castpd_ps(
      _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xdd)), 0xd8));
}
inline void join_pair(float* p, __m256 even, __m256 odd) {
  const __m256 a = _mm256_unpacklo_ps(even, odd), b = _mm256_unpackhi_ps(even, odd);
  _mm256_storeu_ps(p, _mm256_permute2f128_ps(a, b, 0x20));
  _mm256_storeu_ps(p + 8, _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

// The recurrent step on a low-precision state: row d of S is widened, gets φ(k)_d v added, is
// read into o with the weight w_d, and is rounded back; o = Σ_d w_d S'_d is the float step's
// output on the state as stored (see recurrent_weights() for w). With AVX-512 (AVX2) a block
// of 64 (32) columns keeps v and o in registers for the whole pass over the rows, as the float
// state's fused_rank1_update_read does; other columns, and builds without them, go row by row
// through `row` (M floats of scratch).
template <class Storage>
void low_state_update_read(Storage* S, Index F, Index M, const float* pk, const float* w,
                           const float* v, float* o, float* row) {
  Index c0 = 0;
#if defined(__AVX512F__)
  for (; c0 + 64 <= M; c0 += 64) {
    __m512 vv[4], oo[4];
    for (int i = 0; i < 4; ++i) {
      vv[i] = _mm512_loadu_ps(v + c0 + 16 * i);
      oo[i] = _mm512_setzero_ps();
    }
    for (Index d = 0; d < F; ++d) {
      Storage* s = S + d * M + c0;
      const __m512 kd = _mm512_set1_ps(pk[d]), wd = _mm512_set1_ps(w[d]);
      for (int i = 0; i < 4; ++i) {
        const __m512 x = _mm512_fmadd_ps(kd, vv[i], load_widened16(s + 16 * i));
        oo[i] = _mm512_fmadd_ps(wd, x, oo[i]);
        store_state16(s + 16 * i, x);
      }
    }
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(o + c0 + 16 * i, oo[i]);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<Storage, Eigen::bfloat16>) {
    for (; c0 + 32 <= M; c0 += 32) {
      __m256 ve[2], vo[2], oe[2], oo[2];
      for (int i = 0; i < 2; ++i) {
        split_pair(v + c0 + 16 * i, ve[i], vo[i]);
        oe[i] = oo[i] = _mm256_setzero_ps();
      }
      for (Index d = 0; d < F; ++d) {
        Storage* s = S + d * M + c0;
        const __m256 kd = _mm256_set1_ps(pk[d]), wd = _mm256_set1_ps(w[d]);
        for (int i = 0; i < 2; ++i) {
          __m256 e, o_;
          load_state_pair(s + 16 * i, e, o_);
          e = _mm256_fmadd_ps(kd, ve[i], e);
          o_ = _mm256_fmadd_ps(kd, vo[i], o_);
          oe[i] = _mm256_fmadd_ps(wd, e, oe[i]);
          oo[i] = _mm256_fmadd_ps(wd, o_, oo[i]);
          store_state_pair(s + 16 * i, e, o_);
        }
      }
      for (int i = 0; i < 2; ++i) join_pair(o + c0 + 16 * i, oe[i], oo[i]);
    }
  }
#if defined(__F16C__)
  if constexpr (std::is_same_v<Storage, Eigen::half>) {
    for (; c0 + 32 <= M; c0 += 32) {
      __m256 vv[4], oo[4];
      for (int i = 0; i < 4; ++i) {
        vv[i] = _mm256_loadu_ps(v + c0 + 8 * i);
        oo[i] = _mm256_setzero_ps();
      }
      for (Index d = 0; d < F; ++d) {
        Storage* s = S + d * M + c0;
        const __m256 kd = _mm256_set1_ps(pk[d]), wd = _mm256_set1_ps(w[d]);
        __m256 x[4];
        for (int i = 0; i < 4; ++i) {
          x[i] = _mm256_fmadd_ps(kd, vv[i], load_widened8(s + 8 * i));
          oo[i] = _mm256_fmadd_ps(wd, x[i], oo[i]);
        }
        store_state16(s, x[0], x[1]);
        store_state16(s + 16, x[2], x[3]);
      }
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + c0 + 8 * i, oo[i]);
    }
  }
#endif
#endif
  const Index m = M - c0;
  if (m == 0) return;
  using VecMap = Eigen::Map<Eigen::VectorXf>;
  using ConstVecMap = Eigen::Map<const Eigen::VectorXf>;
  VecMap out(o + c0, m), r(row, m);
  const ConstVecMap vv(v + c0, m);
  out.setZero();
  for (Index d = 0; d < F; ++d) {
    widen(S + d * M + c0, row, m);
    r += pk[d] * vv;
    out += w[d] * r;
    narrow(row, S + d * M + c0, m);
  }
}

}  // namespace linattn::detail
