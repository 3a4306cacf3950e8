/// \file delta/detail/delta_low_state.hpp
/// \brief What the delta rule's decoders need beyond the float kernels for a state kept in bf16
/// or half (internal): RecurrentDeltaRule<Phi, float, Eigen::bfloat16> and the batched decoder
/// built on it.
///
/// Why: at B sequences x H heads a decode step reads and writes every F x M state once; bf16 /
/// half halve those bytes and the memory the states take (docs/benchmarks.md measures what the
/// conversions cost in return). The rule (docs/SPEC.md §9.3): the state after a token is the
/// float step's state from the kept one, rounded once (round to nearest even). The token's sweep
/// is the float one (delta_sweep in delta_forward.hpp, over Storage entries): it widens each
/// entry, applies the pending update of the previous token in float, rounds the result into the
/// state and reads the rounded value for this token's products: the same bits as a float decoder
/// whose state is rounded to the storage type after every token.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <type_traits>

#include "../../core/common.hpp"
#include "../../core/detail/low_precision.hpp"
#include "delta_forward.hpp"

namespace linattn::detail {

// Row r of the state with the pending update applied and rounded, widened into `row` (M
// floats): delta_flush's arithmetic on the widened row, as the next sweep would do it.
template <class Storage>
void delta_settled_low_row(const Storage* S, Index M, bool pending, float ap, const float* ar,
                           const float* kp, const float* dp, float* row) {
  widen(S, row, M);
  if (!pending) return;
  delta_flush(row, M, 1, M, ap, ar, kp, dp);
  for (Index c = 0; c < M; ++c) row[c] = static_cast<float>(Storage(row[c]));
}

}  // namespace linattn::detail
