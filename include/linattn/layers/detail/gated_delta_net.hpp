/// \file layers/detail/gated_delta_net.hpp
/// \brief Internals of GatedDeltaNetLayer: the configuration's checks, the reordering of
/// transformers' interleaved projections into the kernels' packed operands, and the per-call
/// buffers.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <string>

#include "../../core/common.hpp"
#include "../../core/detail/checks.hpp"
#include "delta_layer.hpp"

namespace linattn {

struct GatedDeltaNetConfig;

namespace detail {

// The sizes a GatedDeltaNetConfig implies.
struct GdnSizes {
  Index d = 0;                        // hidden_size
  Index hk = 0;                       // query/key heads
  Index hv = 0;                       // value heads
  Index dk = 0;                       // one key head's width
  Index dv = 0;                       // one value head's width
  Index w = 0;                        // convolution width
  Index group = 0;                    // value heads per key head
  Index key_dim = 0;                  // hk·dk
  Index value_dim = 0;                // hv·dv
  Index heads() const { return hv; }  // the delta rule's (value) heads
  Index conv_dim() const { return 2 * key_dim + value_dim; }
  Index qkvz_dim() const { return 2 * key_dim + 2 * value_dim; }
};

// Copies one token's projections, in transformers' order (per key head i: q_i, k_i, then the
// values and gates of its G value heads; ba: per key head the G b's, then the G a's), into the
// kernels' packed order (q of every head, k of every head, v of every head; z; b; a).
template <class S, class Src>
void gdn_gather_row(const GdnSizes& s, const Src& p, const Src& r, S* mixed, S* z, S* b, S* a) {
  const Index gv = s.group * s.dv, block = 2 * s.dk + 2 * gv;
  for (Index i = 0; i < s.hk; ++i) {
    const S* src = p + i * block;
    std::copy(src, src + s.dk, mixed + i * s.dk);
    std::copy(src + s.dk, src + 2 * s.dk, mixed + s.key_dim + i * s.dk);
    std::copy(src + 2 * s.dk, src + 2 * s.dk + gv, mixed + 2 * s.key_dim + i * gv);
    std::copy(src + 2 * s.dk + gv, src + block, z + i * gv);
    const S* ba = r + i * 2 * s.group;
    std::copy(ba, ba + s.group, b + i * s.group);
    std::copy(ba + s.group, ba + 2 * s.group, a + i * s.group);
  }
}

// The inverse of gdn_gather_row for gradients: scatters packed per-token gradients back into
// transformers' interleaved order.
template <class S>
void gdn_scatter_row(const GdnSizes& s, const S* dmixed, const S* dz, const S* db, const S* da,
                     S* dp, S* dr) {
  const Index gv = s.group * s.dv, block = 2 * s.dk + 2 * gv;
  for (Index i = 0; i < s.hk; ++i) {
    S* dst = dp + i * block;
    std::copy(dmixed + i * s.dk, dmixed + (i + 1) * s.dk, dst);
    std::copy(dmixed + s.key_dim + i * s.dk, dmixed + s.key_dim + (i + 1) * s.dk, dst + s.dk);
    std::copy(dmixed + 2 * s.key_dim + i * gv, dmixed + 2 * s.key_dim + (i + 1) * gv,
              dst + 2 * s.dk);
    std::copy(dz + i * gv, dz + (i + 1) * gv, dst + 2 * s.dk + gv);
    S* dba = dr + i * 2 * s.group;
    std::copy(db + i * s.group, db + (i + 1) * s.group, dba);
    std::copy(da + i * s.group, da + (i + 1) * s.group, dba + s.group);
  }
}

// The intermediate rows of one call, row-major, reused while their capacity holds the rows.
template <class S>
struct GdnBuffers {
  RowMatrix<S> p, r;      // the projections: n x qkvz_dim, n x 2·hv
  RowMatrix<S> mixed, c;  // the convolution's input and output: n x conv_dim
  RowMatrix<S> z, o;      // gates and attention outputs: n x value_dim
  RowMatrix<S> b, a;      // β's and the gates' pre-activations, then β and g: n x hv

  void reserve(const GdnSizes& s, Index n) {
    if (p.rows() >= n && p.cols() == s.qkvz_dim() && c.cols() == s.conv_dim()) return;
    p.resize(n, s.qkvz_dim());
    r.resize(n, 2 * s.hv);
    mixed.resize(n, s.conv_dim());
    c.resize(n, s.conv_dim());
    z.resize(n, s.value_dim);
    o.resize(n, s.value_dim);
    b.resize(n, s.hv);
    a.resize(n, s.hv);
  }

  // Rows [0, n) of p and r into mixed, z, b and a.
  void gather(const GdnSizes& s, Index n) {
    for (Index t = 0; t < n; ++t)
      gdn_gather_row<S>(s, p.row(t).data(), r.row(t).data(), mixed.row(t).data(), z.row(t).data(),
                        b.row(t).data(), a.row(t).data());
  }
};

}  // namespace detail
}  // namespace linattn
