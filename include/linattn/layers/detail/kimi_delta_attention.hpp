/// \file layers/detail/kimi_delta_attention.hpp
/// \brief Internals of KimiDeltaAttentionLayer: the sizes its configuration implies and the
/// per-call buffers.
#pragma once

#include <Eigen/Core>
#include <cmath>
#include <string>

#include "../../core/common.hpp"
#include "../../core/detail/checks.hpp"
#include "delta_layer.hpp"

namespace linattn {
namespace detail {

// The sizes a KimiDeltaAttentionConfig implies.
struct KdaSizes {
  Index d = 0;          // hidden_size
  Index h = 0;          // heads
  Index dk = 0;         // one query/key head's width, and the gates' low rank
  Index dv = 0;         // one value head's width
  Index w = 0;          // convolution width
  Index key_dim = 0;    // h·dk
  Index value_dim = 0;  // h·dv
  Index heads() const { return h; }
  Index conv_dim() const { return 2 * key_dim + value_dim; }
};

// The sizes of a KimiDeltaAttentionConfig (a template: the configuration is defined with the
// layer), each checked, naming the first that is wrong.
template <class Config>
KdaSizes kda_sizes(const Config& c) {
  const char* fn = "KimiDeltaAttentionLayer";
  const auto positive = [fn](const char* name, Index v) {
    if (v <= 0)
      throw_invalid(fn, std::string(name) + " = " + std::to_string(v) + " must be > 0");
  };
  positive("hidden_size", c.hidden_size);
  positive("num_heads", c.num_heads);
  positive("head_dim", c.head_dim);
  positive("short_conv_kernel_size", c.short_conv_kernel_size);
  if (c.head_v_dim < 0)
    throw_invalid(
        fn, "head_v_dim = " + std::to_string(c.head_v_dim) + " must be > 0 (or 0: head_dim)");
  if (!(c.rms_norm_eps >= 0) || !std::isfinite(c.rms_norm_eps))
    throw_invalid(fn, "rms_norm_eps = " + value_string(c.rms_norm_eps) +
                                  " must be finite and >= 0");
  if (c.use_lower_bound && !(c.lower_bound < 0 && std::isfinite(c.lower_bound)))
    throw_invalid(
        fn, "lower_bound = " + value_string(c.lower_bound) + " must be finite and < 0");
  KdaSizes s;
  s.d = c.hidden_size;
  s.h = c.num_heads;
  s.dk = c.head_dim;
  s.dv = c.head_v_dim == 0 ? c.head_dim : c.head_v_dim;
  s.w = c.short_conv_kernel_size;
  s.key_dim = s.h * s.dk;
  s.value_dim = s.h * s.dv;
  return s;
}

// The intermediate rows of one call, row-major, reused while their capacity holds the rows.
template <class S>
struct KdaBuffers {
  RowMatrix<S> q, k, v;   // the step's projections (the forward writes them into mixed)
  RowMatrix<S> mixed, c;  // the convolution's input q | k | v and its output: n x conv_dim
  RowMatrix<S> fa, ga;    // the gates' low-rank rows: n x dk
  RowMatrix<S> a;         // the decay's pre-activations, then g: n x key_dim
  RowMatrix<S> b;         // β's pre-activations, then β: n x h
  RowMatrix<S> z, o;      // the output gate and the attention outputs: n x value_dim
  Matrix<S> conv_weight;  // the three convolutions' weights stacked: conv_dim x w

  // With `step` false (a forward), q, k and v stay empty: the projections go to mixed.
  void reserve(const KdaSizes& s, Index n, bool step = true) {
    conv_weight.resize(s.conv_dim(), s.w);
    if (mixed.rows() >= n && mixed.cols() == s.conv_dim() && a.cols() == s.key_dim) return;
    if (step) {
      q.resize(n, s.key_dim);
      k.resize(n, s.key_dim);
      v.resize(n, s.value_dim);
    }
    mixed.resize(n, s.conv_dim());
    c.resize(n, s.conv_dim());
    fa.resize(n, s.dk);
    ga.resize(n, s.dk);
    a.resize(n, s.key_dim);
    b.resize(n, s.h);
    z.resize(n, s.value_dim);
    o.resize(n, s.value_dim);
  }
};

}  // namespace detail
}  // namespace linattn
