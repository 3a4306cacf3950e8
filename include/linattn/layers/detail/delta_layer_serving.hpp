/// \file layers/detail/delta_layer_serving.hpp
/// \brief Internals of the delta-rule layers' multi-token calls (extend()) and rollback: the
/// checks of a call's slots, one sequence's convolution over its rows of a call, and the
/// convolution inputs kept to set a sequence back.
#pragma once

#include <Eigen/Core>
#include <string>
#include <type_traits>
#include <vector>

#include "../../core/common.hpp"
#include "../../core/detail/checks.hpp"
#include "../short_convolution.hpp"
#include "short_convolution.hpp"

namespace linattn::detail {

template <class S>
using LayerRows = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Entry i of an integer vector (a row or a column).
template <class DSlots>
Index layer_slot(const Eigen::DenseBase<DSlots>& slots, Index i) {
  return static_cast<Index>(slots.rows() == 1 ? slots.derived().coeff(0, i)
                                              : slots.derived().coeff(i, 0));
}

// Rows [r0, r0 + n) of `in` (one sequence's convolution inputs, L = W − 1 carried rows in
// `state`, sized) through the convolution taps k (SiLU, no bias) into the same rows of `out`,
// over channels [c0, c1): conv_span's sums, so bit for bit the decode step's. The state moves
// past them afterwards (conv_next_state), once every range of channels has read it.
template <class S>
void conv_extend_rows(const ConvTaps<S>& k, const LayerRows<S>& in, Index r0, Index n,
                      const ConvRows<S>& state, LayerRows<S>& out, Index c0, Index c1) {
  auto ys = out.middleRows(r0, n);
  conv_sequence_span(k, in.middleRows(r0, n), state, ys, c0, c1, static_cast<S*>(nullptr),
                     static_cast<S*>(nullptr));
}

// The last `rows` rows of [state (L rows, empty: zeros); in rows [r0, r0 + n)] into the first
// rows of `window`, before the call moves the state: the convolution states after each of the
// call's last kept tokens are its windows of L rows.
template <class S>
void keep_conv_window(const ConvRows<S>& state, Index L, const LayerRows<S>& in, Index r0,
                      Index n, Index rows, ConvRows<S>& window) {
  for (Index i = 0; i < rows; ++i) {
    const Index at = L + n - rows + i;  // in [state; inputs]
    if (at >= L)
      window.row(i) = in.row(r0 + at - L);
    else if (state.size() != 0)
      window.row(i) = state.row(at);
    else
      window.row(i).setZero();
  }
}

}  // namespace linattn::detail
