/// \file layers/detail/delta_layer.hpp
/// \brief Internals shared by the delta-rule layers (GatedDeltaNetLayer,
/// KimiDeltaAttentionLayer): the threads of a step's projections, the states of a packed
/// forward, the checks and initialisation of torch-layout parameters, checkpoint reads.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../core/common.hpp"
#include "../../core/detail/checks.hpp"
#include "../../core/parallel.hpp"
#include "../../core/state.hpp"
#include "../../core/tuning.hpp"
#include "../../linear/heads.hpp"
#include "../../serving/safetensors.hpp"
#include "../delta_layer_state.hpp"

namespace linattn {
namespace detail {

template <class S>
using RowMatrix = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// The threads of a step's projections of `work` flops: one below two threads' worth (the
// team's start would cost more than it saves), and one inside a parallel region.
inline int projection_threads(double work, const ParallelOptions& par) {
  int threads = 1;
  if (work >= 2 * kLayerProjectionWorkPerThread)
    threads = static_cast<int>(
        std::min<double>(resolve_threads(par), work / kLayerProjectionWorkPerThread));
  if (in_parallel_region()) threads = 1;
  return threads;
}

// A parameter's shape against the configuration's, naming the member (they are public).
inline void check_parameter(const char* fn, const char* name, Index rows, Index cols,
                            Index want_rows, Index want_cols) {
  if (rows != want_rows || cols != want_cols)
    throw_invalid(fn, std::string(name) + " is " + std::to_string(rows) + " x " +
                          std::to_string(cols) + " but the configuration needs " +
                          std::to_string(want_rows) + " x " + std::to_string(want_cols));
}

// rows x cols entries uniform in ±1/√fan_in (torch's nn.Linear and nn.Conv1d), column by column.
template <class S>
void torch_uniform(std::mt19937& gen, Matrix<S>& m, Index rows, Index cols, double fan_in) {
  std::uniform_real_distribution<double> u(-1 / std::sqrt(fan_in), 1 / std::sqrt(fan_in));
  m.resize(rows, cols);
  for (Index j = 0; j < cols; ++j)
    for (Index i = 0; i < rows; ++i) m(i, j) = static_cast<S>(u(gen));
}

// A checkpoint tensor of `shape` into dst, the file's error prefixed with the layer's function.
template <class Dst>
void read_parameter(const char* fn, const SafetensorsFile& file, const std::string& name,
                    const std::vector<Index>& shape, Dst& dst) {
  try {
    file.read(name, shape, dst);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("linattn::") + fn + ": " + e.what());
  }
}

// The B states of a packed forward split into the kernels' operands: one convolution state per
// sequence and H head states per sequence, sequence-major (empty parts: zeros).
template <class S>
void unpack_layer_states(const char* fn, const std::vector<DeltaLayerState<S>>& states, Index B,
                         Index H, std::vector<ShortConvState<S>>& conv,
                         std::vector<LinearAttentionState<S>>& heads) {
  if (static_cast<Index>(states.size()) != B)
    throw_invalid(fn, "states holds " + std::to_string(states.size()) +
                          " states but offsets give B = " + std::to_string(B));
  conv.assign(static_cast<std::size_t>(B), ShortConvState<S>());
  heads.clear();
  heads.reserve(static_cast<std::size_t>(B * H));
  for (Index b = 0; b < B; ++b) {
    const auto& st = states[static_cast<std::size_t>(b)];
    if (!st.heads.empty() && static_cast<Index>(st.heads.size()) != H)
      throw_invalid(fn, "states[" + std::to_string(b) + "] holds " +
                            std::to_string(st.heads.size()) + " head states but the layer has " +
                            std::to_string(H));
    conv[static_cast<std::size_t>(b)] = st.conv;
    for (Index h = 0; h < H; ++h)
      heads.push_back(st.heads.empty() ? LinearAttentionState<S>()
                                       : st.heads[static_cast<std::size_t>(h)]);
  }
}

// The kernels' states back into the B sequences' states, each moved past its rows.
template <class S>
void pack_layer_states(OffsetsRef off, Index H, std::vector<ShortConvState<S>>& conv,
                       std::vector<LinearAttentionState<S>>& heads,
                       std::vector<DeltaLayerState<S>>& states) {
  for (std::size_t b = 0; b < states.size(); ++b) {
    auto& st = states[b];
    st.conv = std::move(conv[b]);
    const auto first = heads.begin() + static_cast<std::ptrdiff_t>(b) * H;
    st.heads.assign(std::make_move_iterator(first), std::make_move_iterator(first + H));
    st.position += off[b + 1] - off[b];
  }
}

}  // namespace detail
}  // namespace linattn
