/// \file layers/gated_delta_net_layer.hpp
/// \brief GatedDeltaNetLayer: the linear-attention layer of Qwen3-Next, with the parameter names,
/// shapes and head layout of its transformers implementation (`Qwen3NextGatedDeltaNet`), its
/// per-sequence state, and a batched decode step over B sequences.
#pragma once

#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../core/common.hpp"
#include "../core/detail/checks.hpp"
#include "../core/gates.hpp"
#include "../core/parallel.hpp"
#include "../core/state.hpp"
#include "../core/workspace.hpp"
#include "../delta/batched_recurrent_delta_rule.hpp"
#include "../delta/delta_rule.hpp"
#include "../linear/multihead_workspace.hpp"
#include "../maps/l2_normalize.hpp"
#include "../serving/safetensors.hpp"
#include "batched_layer.hpp"
#include "delta_layer_gradients.hpp"
#include "delta_layer_state.hpp"
#include "detail/delta_layer.hpp"
#include "detail/delta_layer_backward.hpp"
#include "detail/gated_delta_net.hpp"
#include "gated_rms_norm.hpp"
#include "short_convolution.hpp"

namespace linattn {

/// \brief The shape of a GatedDeltaNetLayer, with the names of the transformers configuration
/// (`Qwen3NextConfig`); the defaults are Qwen3-Next-80B-A3B's.
struct GatedDeltaNetConfig {
  Index hidden_size = 2048;           ///< d, the width of the layer's input and output rows
  Index linear_num_key_heads = 16;    ///< Hk, query/key heads (each shared by Hv / Hk)
  Index linear_num_value_heads = 32;  ///< Hv, value heads (a multiple of Hk)
  Index linear_key_head_dim = 128;    ///< Dk, one query/key head's width
  Index linear_value_head_dim = 128;  ///< Dv, one value head's width
  Index linear_conv_kernel_dim = 4;   ///< W, the short convolution's width
  double rms_norm_eps = 1e-6;         ///< the gated RMSNorm's epsilon
};

/// \brief The state of one sequence of a GatedDeltaNetLayer (a DeltaLayerState): the
/// convolution's last W − 1 inputs, (W − 1) x (2·Hk·Dk + Hv·Dv), and the Hv heads' Dk x Dv
/// delta-rule states.
///
/// transformers' cache holds the same: `conv_states` [conv_dim, W] (its last W − 1 columns
/// transposed are `conv`) and `recurrent_states` [Hv, Dk, Dv] (`heads[h].S`).
template <class Scalar>
using GatedDeltaNetState = DeltaLayerState<Scalar>;

/// \brief B sequences of a GatedDeltaNetLayer decoded together (a DeltaLayerBatchedState,
/// spelled `GatedDeltaNetLayer<Scalar>::BatchedState`, from make_batched_state()).
template <class Scalar>
using GatedDeltaNetBatchedState = DeltaLayerBatchedState<Scalar, detail::GdnBuffers<Scalar>>;

/// \brief The Gated DeltaNet layer of Qwen3-Next (transformers' `Qwen3NextGatedDeltaNet`): for
/// input rows X (N x d),
///
/// \f[ [q, k, v, z] = X W_{qkvz}^\top,\quad [b, a] = X W_{ba}^\top,\quad
///     [q, k, v] \leftarrow \mathrm{SiLU}(\mathrm{conv}([q, k, v])), \f]
/// \f[ \beta = \sigma(b),\quad g = -e^{A_{\log}}\,\mathrm{softplus}(a + dt_{bias}),\quad
///     o = \mathrm{GatedDeltaRule}(\hat q, \hat k, v, \beta, g),\quad
///     Y = \mathrm{RMSNorm}(o) \odot w \odot \mathrm{SiLU}(z)\; W_{out}^\top, \f]
///
/// with \f$\hat q, \hat k\f$ L2-normalised (ε = 1e-6), the scale 1/√Dk, value head h reading
/// query/key head h / (Hv / Hk), the convolution depthwise and causal, the norm per value head.
///
/// The parameters are public members, named and shaped as transformers' (the torch weight of
/// `nn.Linear`, out x in; the convolution's [conv_dim, 1, W] as conv_dim x W), so that a
/// checkpoint's tensors are copied as they are: the rows of in_proj_qkvz are transformers'
/// interleaved order (per key head: q, k, then the values and gates of its Hv / Hk value
/// heads), those of in_proj_ba per key head its b's then its a's. parameter_shapes() lists
/// them with their checkpoint names. They are drawn as torch initialises the module
/// (reset_parameters()).
///
/// \code
/// linattn::GatedDeltaNetConfig cfg;  // Qwen3-Next: d = 2048, 16 key heads, 32 value heads
/// linattn::GatedDeltaNetLayer<float> layer(cfg);
/// auto state = layer.make_state();
/// Eigen::MatrixXf Y = layer.forward(prompt, state);   // prefill, N x 2048
/// auto batch = layer.make_batched_state(1);
/// batch.set_state(0, state);
/// Eigen::MatrixXf y(1, 2048);
/// layer.step(x, batch, y);                            // one token, no allocation
/// \endcode
template <class Scalar = float>
class GatedDeltaNetLayer : public DeltaLayerForward<GatedDeltaNetLayer<Scalar>, Scalar> {
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                "linattn: GatedDeltaNetLayer computes in float or double");

 public:
  /// One sequence's state (GatedDeltaNetState).
  using State = GatedDeltaNetState<Scalar>;
  /// B sequences decoded together (GatedDeltaNetBatchedState).
  using BatchedState = GatedDeltaNetBatchedState<Scalar>;
  /// The parameters' and the input's gradients (GatedDeltaNetGradients).
  using Gradients = GatedDeltaNetGradients<Scalar>;

  /// A layer of the given shape with torch's initial parameters (reset_parameters(seed)).
  /// \throws std::invalid_argument on a size <= 0, value heads not a multiple of key heads, or
  /// a negative or non-finite epsilon.
  /// \param config the shape.
  /// \param seed the seed of the initial parameters.
  explicit GatedDeltaNetLayer(const GatedDeltaNetConfig& config = {}, std::uint32_t seed = 0)
      : config_(config), s_(checked_sizes(config)) {
    reset_parameters(seed);
  }

  /// \name Parameters (transformers' names in parentheses)
  /// @{
  Matrix<Scalar> in_proj_qkvz;   ///< (2·Hk·Dk + 2·Hv·Dv) x d (`in_proj_qkvz.weight`)
  Matrix<Scalar> in_proj_ba;     ///< 2·Hv x d (`in_proj_ba.weight`)
  Matrix<Scalar> conv1d_weight;  ///< (2·Hk·Dk + Hv·Dv) x W (`conv1d.weight`, [C, 1, W])
  Vector<Scalar> dt_bias;        ///< Hv (`dt_bias`)
  Vector<Scalar> A_log;          ///< Hv (`A_log`)
  Vector<Scalar> norm_weight;    ///< Dv (`norm.weight`)
  Matrix<Scalar> out_proj;       ///< d x Hv·Dv (`out_proj.weight`)
  /// @}

  /// The shape the layer was made with.
  /// \return the configuration.
  const GatedDeltaNetConfig& config() const noexcept { return config_; }

  /// The parameters' checkpoint names and torch shapes, in the order of the members.
  /// \return (name, shape) pairs, e.g. ("conv1d.weight", {C, 1, W}).
  std::vector<std::pair<std::string, std::vector<Index>>> parameter_shapes() const {
    const Index C = s_.conv_dim();
    return {{"in_proj_qkvz.weight", {s_.qkvz_dim(), s_.d}},
            {"in_proj_ba.weight", {2 * s_.hv, s_.d}},
            {"conv1d.weight", {C, 1, s_.w}},
            {"dt_bias", {s_.hv}},
            {"A_log", {s_.hv}},
            {"norm.weight", {s_.dv}},
            {"out_proj.weight", {s_.d, s_.value_dim}}};
  }

  /// Sets every parameter from a checkpoint's tensors named `prefix` + the names of
  /// parameter_shapes() (a Qwen3-Next checkpoint: prefix "model.layers.<i>.linear_attn."), of
  /// any float dtype (F32, F64, BF16, F16: converted to Scalar). Every tensor is read before
  /// any parameter changes.
  /// \throws std::invalid_argument naming the tensor and the file if one is missing, has
  /// another shape (both named) or a dtype that is not a float; the layer is then unchanged.
  /// \code
  /// linattn::SafetensorsFile file("model-00001-of-00041.safetensors");
  /// layer.load(file, "model.layers.0.linear_attn.");
  /// \endcode
  /// \param file the opened checkpoint file.
  /// \param prefix prepended to every parameter's name.
  void load(const SafetensorsFile& file, const std::string& prefix = "") {
    const auto shapes = parameter_shapes();
    Matrix<Scalar> qkvz(s_.qkvz_dim(), s_.d), ba(2 * s_.hv, s_.d), conv(s_.conv_dim(), s_.w),
        out(s_.d, s_.value_dim);
    Vector<Scalar> dt(s_.hv), alog(s_.hv), nw(s_.dv);
    const auto read = [&](std::size_t i, auto& dst) {
      detail::read_parameter("GatedDeltaNetLayer::load", file, prefix + shapes[i].first,
                             shapes[i].second, dst);
    };
    read(0, qkvz);
    read(1, ba);
    read(2, conv);
    read(3, dt);
    read(4, alog);
    read(5, nw);
    read(6, out);
    in_proj_qkvz = std::move(qkvz);
    in_proj_ba = std::move(ba);
    conv1d_weight = std::move(conv);
    dt_bias = std::move(dt);
    A_log = std::move(alog);
    norm_weight = std::move(nw);
    out_proj = std::move(out);
  }

  /// Adds every parameter to `writer` under `prefix` + its checkpoint name, in the checkpoint's
  /// shapes (conv1d.weight as [C, 1, W]), so that load() or transformers reads them back.
  /// \param writer the file being written.
  /// \param prefix prepended to every parameter's name.
  void save(SafetensorsWriter& writer, const std::string& prefix = "") const {
    const auto shapes = parameter_shapes();
    writer.add(prefix + shapes[0].first, in_proj_qkvz);
    writer.add(prefix + shapes[1].first, in_proj_ba);
    const detail::RowMatrix<Scalar> conv = conv1d_weight;  // [C, 1, W] in row-major order
    writer.add(prefix + shapes[2].first, shapes[2].second, conv.data());
    writer.add(prefix + shapes[3].first, dt_bias);
    writer.add(prefix + shapes[4].first, A_log);
    writer.add(prefix + shapes[5].first, norm_weight);
    writer.add(prefix + shapes[6].first, out_proj);
  }

  /// Draws the parameters as torch initialises the module: the projections and the convolution
  /// uniformly in ±1/√fan_in (`nn.Linear`, `nn.Conv1d`), dt_bias = 1, A_log = log U(0, 16),
  /// norm_weight = 1; from a std::mt19937 seeded with `seed`.
  /// \param seed the generator's seed.
  void reset_parameters(std::uint32_t seed = 0) {
    std::mt19937 gen(seed);
    const auto uniform = [&gen](Matrix<Scalar>& m, Index rows, Index cols, double fan_in) {
      detail::torch_uniform(gen, m, rows, cols, fan_in);
    };
    uniform(in_proj_qkvz, s_.qkvz_dim(), s_.d, double(s_.d));
    uniform(in_proj_ba, 2 * s_.hv, s_.d, double(s_.d));
    uniform(conv1d_weight, s_.conv_dim(), s_.w, double(s_.w));
    uniform(out_proj, s_.d, s_.value_dim, double(s_.value_dim));
    dt_bias = Vector<Scalar>::Ones(s_.hv);
    std::uniform_real_distribution<double> a(0.0, 16.0);
    A_log.resize(s_.hv);
    for (Index h = 0; h < s_.hv; ++h) A_log(h) = static_cast<Scalar>(std::log(a(gen)));
    norm_weight = Vector<Scalar>::Ones(s_.dv);
  }

  /// B zero-state sequences to decode together.
  /// \throws std::invalid_argument if sequences < 0.
  /// \param sequences B.
  /// \return the batched state.
  BatchedState make_batched_state(Index sequences) const {
    if (sequences < 0)
      detail::throw_invalid("GatedDeltaNetLayer::make_batched_state",
                            "sequences = " + std::to_string(sequences) + " must be >= 0");
    return BatchedState("GatedDeltaNetLayer", s_, sequences,
                        typename BatchedState::Decoder(sequences, s_.hv, s_.dk, s_.dv,
                                                       L2Normalize<>(kL2Epsilon), delta_options()));
  }

  /// One token of each of `state`'s B sequences: row b of Xb (B x d) is sequence b's next
  /// input, its output row goes to row b of Yb (which may be Xb). Equal to forward() of the
  /// same tokens to rounding; allocates nothing once `state` has held B rows.
  /// \throws std::invalid_argument on a wrong shape or a non-finite entry of Xb (naming it;
  /// the state then unchanged).
  /// \param Xb B x d inputs, one row per sequence.
  /// \param state the B sequences, moved on by one token each.
  /// \param Yb receives the B x d outputs.
  /// \param par the threads of the projections and the heads (default: OpenMP's, where they pay).
  template <class DX, class DY>
  void step(const Eigen::MatrixBase<DX>& Xb, BatchedState& state, const Eigen::MatrixBase<DY>& Yb,
            const ParallelOptions& par = {}) const {
    const char* fn = "GatedDeltaNetLayer::step";
    static_assert(std::is_same_v<typename DX::Scalar, Scalar>,
                  "linattn: the tokens' scalar type must be the layer's");
    check_parameters(fn);
    state.begin_step(fn, s_, Xb, Yb);
    const Index B = state.sequences();
    auto& buf = state.buf_;
    const double work = 2.0 * double(B) * double(s_.d) * double(s_.qkvz_dim() + s_.value_dim);
    const int threads = detail::projection_threads(work, par);
    const auto* exec = detail::executor_of(par);
    detail::layer_rows_times_transpose(in_proj_qkvz, state.x_, B, buf.p, threads, exec);
    detail::layer_rows_times_transpose(in_proj_ba, state.x_, B, buf.r, threads, exec);
    buf.gather(s_, B);
    gates(buf, B);  // checks every gate input before any state moves
    short_convolution_step(buf.mixed.topRows(B), conv1d_weight, Vector<Scalar>(), state.conv_,
                           buf.c.topRows(B), state.ws_, ShortConvOptions(), par);
    const auto c = buf.c.topRows(B);
    state.dec_.step(c.leftCols(s_.key_dim), c.middleCols(s_.key_dim, s_.key_dim),
                    c.rightCols(s_.value_dim), buf.b.topRows(B), buf.a.topRows(B), buf.o.topRows(B),
                    par);
    norm(buf, B);
    detail::layer_rows_times_transpose(out_proj, buf.o, B, state.y_, threads, exec);
    state.end_step(Yb);
  }

  /// Several tokens of several of `state`'s sequences in one call (a chunked prefill's next
  /// piece, or the 1 + T draft tokens of a speculative verification): sequence slots(i)
  /// consumes rows [offsets[i], offsets[i+1]) of X (N x d) in order, their outputs going to the
  /// same rows of Y (which may be X); the other sequences do not move. Bit for bit what that
  /// many step() calls of `state` give those sequences (outputs, convolution and head states),
  /// with the fixed cost of one (its projections use the kernel step() uses for B sequences).
  /// When keep_snapshots(K) was called the layer states after each sequence's last K tokens
  /// are kept, for BatchedState::rollback(). Allocates nothing once `state` has held N rows and
  /// each sequence of the call has been stepped or extended before.
  /// \throws std::invalid_argument naming the function, the shapes and the offending value on a
  /// wrong shape, a non-finite entry of X, a slot out of range or repeated, or offsets that do
  /// not go from 0 to N in slots.size() + 1 non-decreasing entries; nothing moves then.
  /// \code
  /// auto batch = layer.make_batched_state(4);
  /// batch.keep_snapshots(5);
  /// const Eigen::VectorXi slots = (Eigen::VectorXi(2) << 3, 0).finished();
  /// const std::vector<int> cu = {0, 5, 9};  // 5 tokens of sequence 3, then 4 of sequence 0
  /// layer.extend(X, slots, cu, batch, Y);   // X, Y: 9 x d
  /// batch.rollback(3, 2);                   // sequence 3 keeps 2 of its 5
  /// \endcode
  /// \param X N x d input rows, the tokens of sequence slots(i) at rows [offsets[i],
  ///     offsets[i+1]).
  /// \param slots the sequences, distinct, any integer vector.
  /// \param offsets slots.size() + 1 row offsets from 0 to N (std::vector or Eigen vector of
  ///     any integer type, cu_seqlens).
  /// \param state the B sequences; those of `slots` move on by their tokens.
  /// \param Y receives the N x d outputs.
  /// \param par the threads of the projections and the heads.
  template <class DX, class DSlots, class Off, class DY>
  void extend(const Eigen::MatrixBase<DX>& X, const Eigen::DenseBase<DSlots>& slots,
              const Off& offsets, BatchedState& state, const Eigen::MatrixBase<DY>& Y,
              const ParallelOptions& par = {}) const {
    const char* fn = "GatedDeltaNetLayer::extend";
    static_assert(std::is_same_v<typename DX::Scalar, Scalar>,
                  "linattn: the tokens' scalar type must be the layer's");
    check_parameters(fn);
    const detail::OffsetsRef off = detail::offsets_of(fn, "offsets", offsets);
    state.begin_extend(fn, s_, X, slots, off, Y);
    const Index N = X.rows(), B = state.sequences();
    auto& buf = state.buf_;
    const double work = 2.0 * double(N) * double(s_.d) * double(s_.qkvz_dim() + s_.value_dim);
    const int threads = detail::projection_threads(work, par);
    const auto* exec = detail::executor_of(par);
    // B picks the projections' kernel: the rows get the bits the batch's step() gives them.
    detail::layer_rows_times_transpose(in_proj_qkvz, state.x_, N, buf.p, threads, exec, B);
    detail::layer_rows_times_transpose(in_proj_ba, state.x_, N, buf.r, threads, exec, B);
    buf.gather(s_, N);
    gates(buf, N);  // checks every gate input before any state moves
    state.extend_conv(conv1d_weight, slots, off, par);
    const auto c = buf.c.topRows(N);
    state.dec_.extend(slots, off, c.leftCols(s_.key_dim), c.middleCols(s_.key_dim, s_.key_dim),
                      c.rightCols(s_.value_dim), buf.b.topRows(N), buf.a.topRows(N),
                      buf.o.topRows(N), par);
    norm(buf, N);
    detail::layer_rows_times_transpose(out_proj, buf.o, N, state.y_, threads, exec, B);
    state.end_extend(Y);
  }

 private:
  friend class DeltaLayerForward<GatedDeltaNetLayer<Scalar>, Scalar>;
  static constexpr const char* kForwardName = "GatedDeltaNetLayer::forward";
  static constexpr const char* kBackwardName = "GatedDeltaNetLayer::backward";
  static constexpr double kL2Epsilon = 1e-6;  // transformers' and FLA's l2norm

  static detail::GdnSizes checked_sizes(const GatedDeltaNetConfig& c) {
    const char* fn = "GatedDeltaNetLayer";
    const auto positive = [fn](const char* name, Index v) {
      if (v <= 0)
        detail::throw_invalid(fn, std::string(name) + " = " + std::to_string(v) + " must be > 0");
    };
    positive("hidden_size", c.hidden_size);
    positive("linear_num_key_heads", c.linear_num_key_heads);
    positive("linear_num_value_heads", c.linear_num_value_heads);
    positive("linear_key_head_dim", c.linear_key_head_dim);
    positive("linear_value_head_dim", c.linear_value_head_dim);
    positive("linear_conv_kernel_dim", c.linear_conv_kernel_dim);
    if (c.linear_num_value_heads % c.linear_num_key_heads != 0)
      detail::throw_invalid(fn,
                            "linear_num_value_heads = " + std::to_string(c.linear_num_value_heads) +
                                " must be a multiple of linear_num_key_heads = " +
                                std::to_string(c.linear_num_key_heads));
    if (!(c.rms_norm_eps >= 0) || !std::isfinite(c.rms_norm_eps))
      detail::throw_invalid(fn, "rms_norm_eps = " + detail::value_string(c.rms_norm_eps) +
                                    " must be finite and >= 0");
    detail::GdnSizes s;
    s.d = c.hidden_size;
    s.hk = c.linear_num_key_heads;
    s.hv = c.linear_num_value_heads;
    s.dk = c.linear_key_head_dim;
    s.dv = c.linear_value_head_dim;
    s.w = c.linear_conv_kernel_dim;
    s.group = s.hv / s.hk;
    s.key_dim = s.hk * s.dk;
    s.value_dim = s.hv * s.dv;
    return s;
  }

  DeltaOptions delta_options() const {
    DeltaOptions o;
    o.scale = 1.0 / std::sqrt(double(s_.dk));
    o.key_heads = s_.hk;
    o.key_dim = s_.dk;
    o.value_dim = s_.dv;
    return o;
  }

  // Every parameter's shape, naming the first that is wrong (the members are public).
  void check_parameters(const char* fn) const {
    const auto check = [fn](const char* name, Index rows, Index cols, Index wr, Index wc) {
      detail::check_parameter(fn, name, rows, cols, wr, wc);
    };
    check("in_proj_qkvz", in_proj_qkvz.rows(), in_proj_qkvz.cols(), s_.qkvz_dim(), s_.d);
    check("in_proj_ba", in_proj_ba.rows(), in_proj_ba.cols(), 2 * s_.hv, s_.d);
    check("conv1d_weight", conv1d_weight.rows(), conv1d_weight.cols(), s_.conv_dim(), s_.w);
    check("dt_bias", dt_bias.rows(), 1, s_.hv, 1);
    check("A_log", A_log.rows(), 1, s_.hv, 1);
    check("norm_weight", norm_weight.rows(), 1, s_.dv, 1);
    check("out_proj", out_proj.rows(), out_proj.cols(), s_.d, s_.value_dim);
  }

  // β = sigmoid(b) and g = −exp(A_log)·softplus(a + dt_bias), in place over rows [0, n).
  void gates(detail::GdnBuffers<Scalar>& buf, Index n) const {
    auto b = buf.b.topRows(n);
    auto a = buf.a.topRows(n);
    beta_activation(b, b);
    gate_activation(a, A_log, dt_bias, a);
  }

  GatedRMSNormOptions norm_options() const {
    GatedRMSNormOptions o;
    o.eps = config_.rms_norm_eps;
    return o;
  }

  void norm(detail::GdnBuffers<Scalar>& buf, Index n) const {
    auto out = buf.o.topRows(n);
    gated_rms_norm(out, buf.z.topRows(n), norm_weight, out, norm_options());
  }

  template <class DX>
  Matrix<Scalar> forward_impl(const char* fn, const Eigen::MatrixBase<DX>& X,
                              detail::OffsetsRef off, std::vector<State>& states) const {
    static_assert(std::is_same_v<typename DX::Scalar, Scalar>,
                  "linattn: the input's scalar type must be the layer's");
    check_parameters(fn);
    if (X.cols() != s_.d)
      detail::throw_invalid(fn, "X is " + detail::shape_of(X) + " but must have hidden_size = " +
                                    std::to_string(s_.d) + " columns");
    // A non-finite input would reach the gates, which reject it: name the input instead.
    detail::check_finite_entries(fn, "X", X);
    const Index N = X.rows(), B = static_cast<Index>(off.size()) - 1;
    std::vector<ShortConvState<Scalar>> conv;
    std::vector<LinearAttentionState<Scalar>> heads;
    detail::unpack_layer_states(fn, states, B, s_.hv, conv, heads);
    detail::GdnBuffers<Scalar> buf;
    buf.reserve(s_, N);
    buf.p.noalias() = X * in_proj_qkvz.transpose();
    buf.r.noalias() = X * in_proj_ba.transpose();
    buf.gather(s_, N);
    gates(buf, N);
    Workspace<Scalar> ws;
    batched_short_convolution(buf.mixed, conv1d_weight, Vector<Scalar>(), off, conv, buf.c, ws);
    MultiHeadWorkspace<Scalar> mws;
    batched_delta_rule_attention(buf.c.leftCols(s_.key_dim),
                                 buf.c.middleCols(s_.key_dim, s_.key_dim),
                                 buf.c.rightCols(s_.value_dim), buf.b, buf.a, off, s_.hv,
                                 L2Normalize<>(kL2Epsilon), heads, buf.o, mws, delta_options());
    norm(buf, N);
    Matrix<Scalar> Y = buf.o * out_proj.transpose();
    detail::pack_layer_states(off, s_.hv, conv, heads, states);
    return Y;
  }

  // Gradients of no rows: zeros of the parameters' shapes, dX 0 x d.
  Gradients zero_gradients() const {
    Gradients g;
    g.dX.resize(0, s_.d);
    const auto zero = [](auto& d, const auto& p) { d.setZero(p.rows(), p.cols()); };
    zero(g.in_proj_qkvz, in_proj_qkvz), zero(g.in_proj_ba, in_proj_ba);
    zero(g.conv1d_weight, conv1d_weight), zero(g.dt_bias, dt_bias), zero(g.A_log, A_log);
    zero(g.norm_weight, norm_weight), zero(g.out_proj, out_proj);
    return g;
  }

  // The forward pass again from the states (nullptr: zeros), keeping what the gradients need,
  // then each piece's backward in reverse order.
  template <class DX, class DdY>
  Gradients backward_impl(const char* fn, const Eigen::MatrixBase<DX>& X, detail::OffsetsRef off,
                          const Eigen::MatrixBase<DdY>& dY, const std::vector<State>* states,
                          const std::vector<DeltaLayerStateGradient<Scalar>>* dfinal) const {
    using Rows = detail::RowMatrix<Scalar>;
    check_parameters(fn);
    detail::check_backward_inputs(fn, X, dY, s_.d);
    const Index N = X.rows(), B = static_cast<Index>(off.size()) - 1, H = s_.hv;
    const auto st =
        detail::core_states(fn, states, dfinal, B, H, s_.w, s_.conv_dim(), s_.dk, s_.dv);
    if (N == 0) {  // no rows: the blocks below would offset no data
      Gradients g = zero_gradients();
      if (states)
        g.dstates = detail::passed_state_gradients(st, B, H, s_.w, s_.conv_dim(), s_.dk, s_.dv);
      return g;
    }
    const Matrix<Scalar> x = X;
    detail::GdnBuffers<Scalar> buf;
    buf.reserve(s_, N);
    buf.p.noalias() = x * in_proj_qkvz.transpose();
    buf.r.noalias() = x * in_proj_ba.transpose();
    buf.gather(s_, N);
    const Rows b_pre = buf.b, a_pre = buf.a;
    gates(buf, N);
    auto conv = st.conv;
    Workspace<Scalar> ws;
    batched_short_convolution(buf.mixed, conv1d_weight, Vector<Scalar>(), off, conv, buf.c, ws);
    const L2Normalize<> phi(kL2Epsilon);
    MultiHeadWorkspace<Scalar> mws;
    auto heads = st.heads;
    batched_delta_rule_attention(buf.c.leftCols(s_.key_dim),
                                 buf.c.middleCols(s_.key_dim, s_.key_dim),
                                 buf.c.rightCols(s_.value_dim), buf.b, buf.a, off, H, phi, heads,
                                 buf.o, mws, delta_options());
    const Rows o = buf.o;
    norm(buf, N);

    Gradients g;
    Matrix<Scalar> dn;
    detail::projection_backward(dY, buf.o, out_proj, g.out_proj, dn, true);
    auto core = detail::delta_core_backward<Scalar>(
        off, s_.hv, s_.key_dim, s_.value_dim, phi, delta_options(),
        {buf.mixed, conv1d_weight, buf.c, buf.b, buf.a, o, buf.z}, norm_weight, norm_options(), dn,
        states ? &st : nullptr);
    if (states) g.dstates = detail::layer_state_gradients(core, B, H);
    g.conv1d_weight = std::move(core.dconv_weight);
    g.norm_weight = std::move(core.dnorm_weight);
    Rows db(N, s_.hv), da(N, s_.hv);
    g.A_log.resize(s_.hv);
    g.dt_bias.resize(s_.hv);
    beta_activation_backward(b_pre, core.dbeta, db);
    gate_activation_backward(a_pre, A_log, dt_bias, core.dlog_a, da, g.A_log, g.dt_bias);
    Rows dp(N, s_.qkvz_dim()), dr(N, 2 * s_.hv);
    for (Index t = 0; t < N; ++t)
      detail::gdn_scatter_row<Scalar>(s_, core.dmixed.row(t).data(), core.dz.row(t).data(),
                                      db.row(t).data(), da.row(t).data(), dp.row(t).data(),
                                      dr.row(t).data());
    detail::projection_backward(dp, x, in_proj_qkvz, g.in_proj_qkvz, g.dX, true);
    detail::projection_backward(dr, x, in_proj_ba, g.in_proj_ba, g.dX, false);
    return g;
  }

  GatedDeltaNetConfig config_;
  detail::GdnSizes s_;
};

}  // namespace linattn
