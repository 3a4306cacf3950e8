/// \file detail/low_precision_state.hpp
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

#include "../common.hpp"
#include "../state.hpp"
#include "low_precision.hpp"

namespace linattn::detail {

template <class Storage>
struct LowPrecisionState {
  using StateMatrix = Eigen::Matrix<Storage, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  StateMatrix S;         // F x M, rounded to Storage after every token
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

// The recurrent step on a low-precision state: row d of S is widened into `row`, gets
// φ(k)_d v added, is read into o with the weight w_d, and is rounded back. o = Σ_d w_d S'_d is
// the float step's output on the state as stored (see recurrent_weights() for w).
template <class Storage>
void low_state_update_read(Storage* S, Index F, Index M, const float* pk, const float* w,
                           const float* v, float* o, float* row) {
  using VecMap = Eigen::Map<Eigen::VectorXf>;
  using ConstVecMap = Eigen::Map<const Eigen::VectorXf>;
  VecMap out(o, M), r(row, M);
  const ConstVecMap vv(v, M);
  out.setZero();
  for (Index d = 0; d < F; ++d) {
    widen(S + d * M, row, M);
    r += pk[d] * vv;
    out += w[d] * r;
    narrow(row, S + d * M, M);
  }
}

}  // namespace linattn::detail
