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
// `state`, sized) through the convolution and SiLU into the same rows of `out`, the state moved
// past them: conv_row's sums, so bit for bit the decode step's. `row` holds C scalars.
template <class S, class DW>
void conv_extend_rows(const LayerRows<S>& in, Index r0, Index n, const DW& w, ConvRows<S>& state,
                      LayerRows<S>& out, S* row) {
  const Vector<S> none;  // no bias: the delta-rule layers' convolutions have none
  const auto xs = in.middleRows(r0, n);
  auto ys = out.middleRows(r0, n);
  conv_forward_rows(xs, w, none, state, true, ys, row);
  conv_next_state(xs, state, w.cols() - 1);
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
