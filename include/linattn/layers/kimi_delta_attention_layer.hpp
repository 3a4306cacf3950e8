/// \file layers/kimi_delta_attention_layer.hpp
/// \brief KimiDeltaAttentionLayer: the KDA layer of Kimi Linear, with the parameter names and
/// shapes of its checkpoints (Kimi Linear's `KimiDeltaAttention`, FLA's layer of that name), its
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
#include "detail/kimi_delta_attention.hpp"
#include "gated_rms_norm.hpp"
#include "short_convolution.hpp"

namespace linattn {

/// \brief The shape of a KimiDeltaAttentionLayer, with the names of Kimi Linear's configuration
/// (`linear_attn_config`: `num_heads`, `head_dim`, `short_conv_kernel_size`); the defaults are
/// Kimi-Linear-48B-A3B's.
struct KimiDeltaAttentionConfig {
  Index hidden_size = 2304;          ///< d, the width of the layer's input and output rows
  Index num_heads = 32;              ///< H, the heads (of queries, keys and values alike)
  Index head_dim = 128;              ///< K, one query/key head's width and the gates' low rank
  Index head_v_dim = 0;              ///< V, one value head's width; 0: head_dim (Kimi Linear's)
  Index short_conv_kernel_size = 4;  ///< W, the short convolutions' width
  double rms_norm_eps = 1e-6;        ///< the gated RMSNorm's epsilon
  /// Whether g = lower_bound·sigmoid(exp(A_log)·(a + dt_bias)) (FLA's `safe_gate` with its
  /// `lower_bound`) instead of Kimi Linear's −exp(A_log)·softplus(a + dt_bias).
  bool use_lower_bound = false;
  double lower_bound = -5.0;  ///< the lower bound of g when use_lower_bound, finite and < 0
};

/// \brief The state of one sequence of a KimiDeltaAttentionLayer (a DeltaLayerState): the three
/// convolutions' last W − 1 inputs side by side, (W − 1) x (2·H·K + H·V) with the columns of q,
/// then k, then v, and the H heads' K x V delta-rule states.
///
/// Kimi Linear's cache holds the same: `conv_states` a tuple (q, k, v) of [C, W] tensors (the
/// last W − 1 columns of each, transposed, are its block of `conv`) and `recurrent_states`
/// [H, K, V] (`heads[h].S`).
template <class Scalar>
using KimiDeltaAttentionState = DeltaLayerState<Scalar>;

/// \brief B sequences of a KimiDeltaAttentionLayer decoded together (a DeltaLayerBatchedState,
/// spelled `KimiDeltaAttentionLayer<Scalar>::BatchedState`, from make_batched_state()).
template <class Scalar>
using KimiDeltaAttentionBatchedState = DeltaLayerBatchedState<Scalar, detail::KdaBuffers<Scalar>>;

/// \brief The KDA layer of Kimi Linear (`KimiDeltaAttention`): for input rows X (N x d),
///
/// \f[ q = \mathrm{SiLU}(\mathrm{conv}_q(X W_q^\top)),\quad
///     k = \mathrm{SiLU}(\mathrm{conv}_k(X W_k^\top)),\quad
///     v = \mathrm{SiLU}(\mathrm{conv}_v(X W_v^\top)), \f]
/// \f[ g = -e^{A_{\log}}\,\mathrm{softplus}(X W_{f_a}^\top W_{f_b}^\top + dt_{bias}),\quad
///     \beta = \sigma(X W_b^\top),\quad z = X W_{g_a}^\top W_{g_b}^\top, \f]
/// \f[ o = \mathrm{KDA}(\hat q, \hat k, v, \beta, g),\quad
///     Y = \mathrm{RMSNorm}(o) \odot w \odot \sigma(z)\; W_o^\top, \f]
///
/// with g one log-decay per head and key channel (N x H·K; the lower-bounded form
/// lb·σ(e^{A_log}(a + dt_bias)) with KimiDeltaAttentionConfig::use_lower_bound), \f$\hat q,
/// \hat k\f$ L2-normalised (ε = 1e-6), the scale 1/√K, the recurrence per head
/// S = diag(e^g) S, S += β k (v − Sᵀk)ᵀ, o = Sᵀq/√K, the convolutions depthwise and causal
/// without bias, the norm per head.
///
/// The parameters are public members, named and shaped as the checkpoints' (the torch weight
/// of `nn.Linear`, out x in; a convolution's [C, 1, W] as C x W), so that a checkpoint's tensors
/// are copied as they are; parameter_shapes() lists them with their checkpoint names. They are
/// drawn as torch initialises the module (reset_parameters()).
///
/// \code
/// linattn::KimiDeltaAttentionConfig cfg;  // Kimi-Linear-48B: d = 2304, 32 heads of 128
/// linattn::KimiDeltaAttentionLayer<float> layer(cfg);
/// auto state = layer.make_state();
/// Eigen::MatrixXf Y = layer.forward(prompt, state);   // prefill, N x 2304
/// auto batch = layer.make_batched_state(1);
/// batch.set_state(0, state);
/// Eigen::MatrixXf y(1, 2304);
/// layer.step(x, batch, y);                            // one token, no allocation
/// \endcode
template <class Scalar = float>
class KimiDeltaAttentionLayer : public DeltaLayerForward<KimiDeltaAttentionLayer<Scalar>, Scalar> {
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                "linattn: KimiDeltaAttentionLayer computes in float or double");

 public:
  /// One sequence's state (KimiDeltaAttentionState).
  using State = KimiDeltaAttentionState<Scalar>;
  /// B sequences decoded together (KimiDeltaAttentionBatchedState).
  using BatchedState = KimiDeltaAttentionBatchedState<Scalar>;
  /// The parameters' and the input's gradients (KimiDeltaAttentionGradients).
  using Gradients = KimiDeltaAttentionGradients<Scalar>;

  /// A layer of the given shape with torch's initial parameters (reset_parameters(seed)).
  /// \throws std::invalid_argument on a size <= 0 (head_v_dim < 0), a negative or non-finite
  /// epsilon, or with use_lower_bound a lower bound that is not finite and < 0.
  /// \param config the shape.
  /// \param seed the seed of the initial parameters.
  explicit KimiDeltaAttentionLayer(const KimiDeltaAttentionConfig& config = {},
                                   std::uint32_t seed = 0)
      : config_(config), s_(detail::kda_sizes(config)) {
    reset_parameters(seed);
  }

  /// \name Parameters (checkpoint names in parentheses)
  /// @{
  Matrix<Scalar> q_proj;           ///< H·K x d (`q_proj.weight`)
  Matrix<Scalar> k_proj;           ///< H·K x d (`k_proj.weight`)
  Matrix<Scalar> v_proj;           ///< H·V x d (`v_proj.weight`)
  Matrix<Scalar> q_conv1d_weight;  ///< H·K x W (`q_conv1d.weight`, [H·K, 1, W])
  Matrix<Scalar> k_conv1d_weight;  ///< H·K x W (`k_conv1d.weight`, [H·K, 1, W])
  Matrix<Scalar> v_conv1d_weight;  ///< H·V x W (`v_conv1d.weight`, [H·V, 1, W])
  Matrix<Scalar> f_a_proj;         ///< K x d (`f_a_proj.weight`)
  Matrix<Scalar> f_b_proj;         ///< H·K x K (`f_b_proj.weight`)
  Matrix<Scalar> b_proj;           ///< H x d (`b_proj.weight`)
  Matrix<Scalar> g_a_proj;         ///< K x d (`g_a_proj.weight`)
  Matrix<Scalar> g_b_proj;         ///< H·V x K (`g_b_proj.weight`)
  Vector<Scalar> A_log;            ///< H (`A_log`, [1, 1, H, 1] in Kimi Linear's checkpoints)
  Vector<Scalar> dt_bias;          ///< H·K (`dt_bias`)
  Vector<Scalar> o_norm_weight;    ///< V (`o_norm.weight`)
  Matrix<Scalar> o_proj;           ///< d x H·V (`o_proj.weight`)
  /// @}

  /// The shape the layer was made with.
  /// \return the configuration.
  const KimiDeltaAttentionConfig& config() const noexcept { return config_; }

  /// The parameters' checkpoint names and torch shapes, in the order of the members; A_log as
  /// Kimi Linear stores it, [1, 1, H, 1].
  /// \return (name, shape) pairs, e.g. ("q_conv1d.weight", {H·K, 1, W}).
  std::vector<std::pair<std::string, std::vector<Index>>> parameter_shapes() const {
    const Index d = s_.d, H = s_.h, K = s_.dk, HK = s_.key_dim, HV = s_.value_dim, W = s_.w;
    return {{"q_proj.weight", {HK, d}},
            {"k_proj.weight", {HK, d}},
            {"v_proj.weight", {HV, d}},
            {"q_conv1d.weight", {HK, 1, W}},
            {"k_conv1d.weight", {HK, 1, W}},
            {"v_conv1d.weight", {HV, 1, W}},
            {"f_a_proj.weight", {K, d}},
            {"f_b_proj.weight", {HK, K}},
            {"b_proj.weight", {H, d}},
            {"g_a_proj.weight", {K, d}},
            {"g_b_proj.weight", {HV, K}},
            {"A_log", {1, 1, H, 1}},
            {"dt_bias", {HK}},
            {"o_norm.weight", {s_.dv}},
            {"o_proj.weight", {d, HV}}};
  }

  /// Sets every parameter from a checkpoint's tensors named `prefix` + the names of
  /// parameter_shapes() (a Kimi Linear checkpoint: prefix "model.layers.<i>.self_attn."), of
  /// any float dtype (F32, F64, BF16, F16: converted to Scalar); A_log may be [1, 1, H, 1] or
  /// [H]. Every tensor is read before any parameter changes.
  /// \throws std::invalid_argument naming the tensor and the file if one is missing, has
  /// another shape (both named) or a dtype that is not a float; the layer is then unchanged.
  /// \code
  /// linattn::SafetensorsFile file("model-1-of-20.safetensors");
  /// layer.load(file, "model.layers.0.self_attn.");
  /// \endcode
  /// \param file the opened checkpoint file.
  /// \param prefix prepended to every parameter's name.
  void load(const SafetensorsFile& file, const std::string& prefix = "") {
    auto shapes = parameter_shapes();
    const std::string alog = prefix + shapes[11].first;
    if (file.contains(alog) && file.info(alog).shape.size() == 1) shapes[11].second = {s_.h};
    KimiDeltaAttentionLayer next = *this;
    Matrix<Scalar>* mats[] = {&next.q_proj,          &next.k_proj,          &next.v_proj,
                              &next.q_conv1d_weight, &next.k_conv1d_weight, &next.v_conv1d_weight,
                              &next.f_a_proj,        &next.f_b_proj,        &next.b_proj,
                              &next.g_a_proj,        &next.g_b_proj};
    Vector<Scalar>* vecs[] = {&next.A_log, &next.dt_bias, &next.o_norm_weight};
    const auto read = [&](std::size_t i, auto& dst, Index rows, Index cols) {
      dst.resize(rows, cols);
      detail::read_parameter("KimiDeltaAttentionLayer::load", file, prefix + shapes[i].first,
                             shapes[i].second, dst);
    };
    for (std::size_t i = 0; i < 11; ++i)  // {rows, cols} or a convolution's {C, 1, W}
      read(i, *mats[i], shapes[i].second.front(), shapes[i].second.back());
    read(11, *vecs[0], s_.h, 1);
    read(12, *vecs[1], s_.key_dim, 1);
    read(13, *vecs[2], s_.dv, 1);
    read(14, next.o_proj, s_.d, s_.value_dim);
    *this = std::move(next);
  }

  /// Adds every parameter to `writer` under `prefix` + its checkpoint name, in the shapes of
  /// parameter_shapes() (the convolutions as [C, 1, W], A_log as [1, 1, H, 1]), so that load()
  /// or Kimi Linear's code reads them back.
  /// \param writer the file being written.
  /// \param prefix prepended to every parameter's name.
  void save(SafetensorsWriter& writer, const std::string& prefix = "") const {
    const auto shapes = parameter_shapes();
    const Matrix<Scalar>* mats[] = {&q_proj,          &k_proj,          &v_proj,   &q_conv1d_weight,
                                    &k_conv1d_weight, &v_conv1d_weight, &f_a_proj, &f_b_proj,
                                    &b_proj,          &g_a_proj,        &g_b_proj};
    for (std::size_t i = 0; i < 11; ++i) {
      const detail::RowMatrix<Scalar> rows = *mats[i];  // torch's row-major order
      writer.add(prefix + shapes[i].first, shapes[i].second, rows.data());
    }
    writer.add(prefix + shapes[11].first, shapes[11].second, A_log.data());
    writer.add(prefix + shapes[12].first, dt_bias);
    writer.add(prefix + shapes[13].first, o_norm_weight);
    writer.add(prefix + shapes[14].first, o_proj);
  }

  /// Draws the parameters as torch and FLA initialise the module: the projections and the
  /// convolutions uniformly in ±1/√fan_in (`nn.Linear`; `nn.Conv1d` with one channel per
  /// group, fan_in = W), A_log = log U(1, 16), dt_bias = 0, o_norm_weight = 1; from a
  /// std::mt19937 seeded with `seed`.
  /// \param seed the generator's seed.
  void reset_parameters(std::uint32_t seed = 0) {
    std::mt19937 gen(seed);
    const auto uniform = [&gen](Matrix<Scalar>& m, Index rows, Index cols, Index fan_in) {
      detail::torch_uniform(gen, m, rows, cols, double(fan_in));
    };
    const Index d = s_.d, K = s_.dk, HK = s_.key_dim, HV = s_.value_dim, W = s_.w;
    uniform(q_proj, HK, d, d);
    uniform(k_proj, HK, d, d);
    uniform(v_proj, HV, d, d);
    uniform(q_conv1d_weight, HK, W, W);
    uniform(k_conv1d_weight, HK, W, W);
    uniform(v_conv1d_weight, HV, W, W);
    uniform(f_a_proj, K, d, d);
    uniform(f_b_proj, HK, K, K);
    uniform(b_proj, s_.h, d, d);
    uniform(g_a_proj, K, d, d);
    uniform(g_b_proj, HV, K, K);
    uniform(o_proj, d, HV, HV);
    std::uniform_real_distribution<double> a(1.0, 16.0);
    A_log.resize(s_.h);
    for (Index h = 0; h < s_.h; ++h) A_log(h) = static_cast<Scalar>(std::log(a(gen)));
    dt_bias = Vector<Scalar>::Zero(HK);
    o_norm_weight = Vector<Scalar>::Ones(s_.dv);
  }

  /// B zero-state sequences to decode together.
  /// \throws std::invalid_argument if sequences < 0.
  /// \param sequences B.
  /// \return the batched state.
  BatchedState make_batched_state(Index sequences) const {
    if (sequences < 0)
      detail::throw_invalid("KimiDeltaAttentionLayer::make_batched_state",
                            "sequences = " + std::to_string(sequences) + " must be >= 0");
    return BatchedState("KimiDeltaAttentionLayer", s_, sequences,
                        typename BatchedState::Decoder(sequences, s_.h, s_.dk, s_.dv,
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
    const char* fn = "KimiDeltaAttentionLayer::step";
    static_assert(std::is_same_v<typename DX::Scalar, Scalar>,
                  "linattn: the tokens' scalar type must be the layer's");
    check_parameters(fn);
    state.begin_step(fn, s_, Xb, Yb);
    const Index B = state.sequences(), HK = s_.key_dim, HV = s_.value_dim;
    auto& buf = state.buf_;
    const auto& x = state.x_;
    const double work =
        2.0 * double(B) *
        (double(s_.d) * double(s_.conv_dim() + 2 * s_.dk + s_.h + HV) + double(s_.dk) * (HK + HV));
    const int threads = detail::projection_threads(work, par);
    const auto* exec = detail::executor_of(par);
    detail::layer_rows_times_transpose(q_proj, x, B, buf.q, threads, exec);
    detail::layer_rows_times_transpose(k_proj, x, B, buf.k, threads, exec);
    detail::layer_rows_times_transpose(v_proj, x, B, buf.v, threads, exec);
    detail::layer_rows_times_transpose(f_a_proj, x, B, buf.fa, threads, exec);
    detail::layer_rows_times_transpose(f_b_proj, buf.fa, B, buf.a, threads, exec);
    detail::layer_rows_times_transpose(b_proj, x, B, buf.b, threads, exec);
    detail::layer_rows_times_transpose(g_a_proj, x, B, buf.ga, threads, exec);
    detail::layer_rows_times_transpose(g_b_proj, buf.ga, B, buf.z, threads, exec);
    auto mixed = buf.mixed.topRows(B);
    mixed.leftCols(HK) = buf.q.topRows(B);
    mixed.middleCols(HK, HK) = buf.k.topRows(B);
    mixed.rightCols(HV) = buf.v.topRows(B);
    gates(buf, B);  // checks every gate input before any state moves
    stack_conv_weights(buf.conv_weight);
    short_convolution_step(mixed, buf.conv_weight, Vector<Scalar>(), state.conv_, buf.c.topRows(B),
                           state.ws_, ShortConvOptions(), par);
    const auto c = buf.c.topRows(B);
    state.dec_.step(c.leftCols(HK), c.middleCols(HK, HK), c.rightCols(HV), buf.b.topRows(B),
                    buf.a.topRows(B), buf.o.topRows(B), par);
    norm(buf, B);
    detail::layer_rows_times_transpose(o_proj, buf.o, B, state.y_, threads, exec);
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
    const char* fn = "KimiDeltaAttentionLayer::extend";
    static_assert(std::is_same_v<typename DX::Scalar, Scalar>,
                  "linattn: the tokens' scalar type must be the layer's");
    check_parameters(fn);
    const detail::OffsetsRef off = detail::offsets_of(fn, "offsets", offsets);
    state.begin_extend(fn, s_, X, slots, off, Y);
    const Index N = X.rows(), B = state.sequences(), HK = s_.key_dim, HV = s_.value_dim;
    auto& buf = state.buf_;
    const auto& x = state.x_;
    const double work =
        2.0 * double(N) *
        (double(s_.d) * double(s_.conv_dim() + 2 * s_.dk + s_.h + HV) + double(s_.dk) * (HK + HV));
    const int threads = detail::projection_threads(work, par);
    const auto* exec = detail::executor_of(par);
    // B picks the projections' kernel: the rows get the bits the batch's step() gives them.
    detail::layer_rows_times_transpose(q_proj, x, N, buf.q, threads, exec, B);
    detail::layer_rows_times_transpose(k_proj, x, N, buf.k, threads, exec, B);
    detail::layer_rows_times_transpose(v_proj, x, N, buf.v, threads, exec, B);
    detail::layer_rows_times_transpose(f_a_proj, x, N, buf.fa, threads, exec, B);
    detail::layer_rows_times_transpose(f_b_proj, buf.fa, N, buf.a, threads, exec, B);
    detail::layer_rows_times_transpose(b_proj, x, N, buf.b, threads, exec, B);
    detail::layer_rows_times_transpose(g_a_proj, x, N, buf.ga, threads, exec, B);
    detail::layer_rows_times_transpose(g_b_proj, buf.ga, N, buf.z, threads, exec, B);
    auto mixed = buf.mixed.topRows(N);
    mixed.leftCols(HK) = buf.q.topRows(N);
    mixed.middleCols(HK, HK) = buf.k.topRows(N);
    mixed.rightCols(HV) = buf.v.topRows(N);
    gates(buf, N);  // checks every gate input before any state moves
    stack_conv_weights(buf.conv_weight);
    state.extend_conv(buf.conv_weight, slots, off, par);
    const auto c = buf.c.topRows(N);
    state.dec_.extend(slots, off, c.leftCols(HK), c.middleCols(HK, HK), c.rightCols(HV),
                      buf.b.topRows(N), buf.a.topRows(N), buf.o.topRows(N), par);
    norm(buf, N);
    detail::layer_rows_times_transpose(o_proj, buf.o, N, state.y_, threads, exec, B);
    state.end_extend(Y);
  }

 private:
  friend class DeltaLayerForward<KimiDeltaAttentionLayer<Scalar>, Scalar>;
  static constexpr const char* kForwardName = "KimiDeltaAttentionLayer::forward";
  static constexpr const char* kBackwardName = "KimiDeltaAttentionLayer::backward";
  static constexpr double kL2Epsilon = 1e-6;  // FLA's l2norm in the KDA kernels

  DeltaOptions delta_options() const {
    DeltaOptions o;
    o.scale = 1.0 / std::sqrt(double(s_.dk));
    o.key_dim = s_.dk;
    o.value_dim = s_.dv;
    return o;
  }

  GateOptions gate_options() const {
    GateOptions o;
    if (config_.use_lower_bound) {
      o.activation = GateActivation::LowerBoundSigmoid;
      o.lower_bound = config_.lower_bound;
    }
    return o;
  }

  // Every parameter's shape, naming the first that is wrong (the members are public).
  void check_parameters(const char* fn) const {
    const Index d = s_.d, H = s_.h, K = s_.dk, HK = s_.key_dim, HV = s_.value_dim, W = s_.w;
    const auto check = [fn](const char* name, const auto& m, Index rows, Index cols) {
      detail::check_parameter(fn, name, m.rows(), m.cols(), rows, cols);
    };
    check("q_proj", q_proj, HK, d);
    check("k_proj", k_proj, HK, d);
    check("v_proj", v_proj, HV, d);
    check("q_conv1d_weight", q_conv1d_weight, HK, W);
    check("k_conv1d_weight", k_conv1d_weight, HK, W);
    check("v_conv1d_weight", v_conv1d_weight, HV, W);
    check("f_a_proj", f_a_proj, K, d);
    check("f_b_proj", f_b_proj, HK, K);
    check("b_proj", b_proj, H, d);
    check("g_a_proj", g_a_proj, K, d);
    check("g_b_proj", g_b_proj, HV, K);
    check("A_log", A_log, H, 1);
    check("dt_bias", dt_bias, HK, 1);
    check("o_norm_weight", o_norm_weight, s_.dv, 1);
    check("o_proj", o_proj, d, HV);
  }

  // The three depthwise convolutions as one over q | k | v: the channels are independent.
  void stack_conv_weights(Matrix<Scalar>& w) const {
    w.topRows(s_.key_dim) = q_conv1d_weight;
    w.middleRows(s_.key_dim, s_.key_dim) = k_conv1d_weight;
    w.bottomRows(s_.value_dim) = v_conv1d_weight;
  }

  // β = sigmoid(b) and g per key channel, in place over rows [0, n).
  void gates(detail::KdaBuffers<Scalar>& buf, Index n) const {
    auto b = buf.b.topRows(n);
    auto a = buf.a.topRows(n);
    beta_activation(b, b);
    gate_activation(a, A_log, dt_bias, a, gate_options());
  }

  GatedRMSNormOptions norm_options() const {
    GatedRMSNormOptions o;
    o.eps = config_.rms_norm_eps;
    o.gate = NormGate::Sigmoid;
    return o;
  }

  void norm(detail::KdaBuffers<Scalar>& buf, Index n) const {
    auto out = buf.o.topRows(n);
    gated_rms_norm(out, buf.z.topRows(n), o_norm_weight, out, norm_options());
  }

  // A forward's projections of the rows X into buf (reserved for them): q | k | v into mixed,
  // the gates' low-rank rows and pre-activations, β's pre-activations.
  template <class DX>
  void project(const Eigen::MatrixBase<DX>& X, detail::KdaBuffers<Scalar>& buf) const {
    const Index HK = s_.key_dim, HV = s_.value_dim;
    buf.mixed.leftCols(HK).noalias() = X * q_proj.transpose();
    buf.mixed.middleCols(HK, HK).noalias() = X * k_proj.transpose();
    buf.mixed.rightCols(HV).noalias() = X * v_proj.transpose();
    buf.fa.noalias() = X * f_a_proj.transpose();
    buf.a.noalias() = buf.fa * f_b_proj.transpose();
    buf.b.noalias() = X * b_proj.transpose();
    buf.ga.noalias() = X * g_a_proj.transpose();
    buf.z.noalias() = buf.ga * g_b_proj.transpose();
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
    const Index HK = s_.key_dim, HV = s_.value_dim;
    std::vector<ShortConvState<Scalar>> conv;
    std::vector<LinearAttentionState<Scalar>> heads;
    detail::unpack_layer_states(fn, states, B, s_.h, conv, heads);
    detail::KdaBuffers<Scalar> buf;
    buf.reserve(s_, N, false);
    project(X, buf);
    gates(buf, N);
    stack_conv_weights(buf.conv_weight);
    Workspace<Scalar> ws;
    batched_short_convolution(buf.mixed, buf.conv_weight, Vector<Scalar>(), off, conv, buf.c, ws);
    MultiHeadWorkspace<Scalar> mws;
    batched_delta_rule_attention(buf.c.leftCols(HK), buf.c.middleCols(HK, HK), buf.c.rightCols(HV),
                                 buf.b, buf.a, off, s_.h, L2Normalize<>(kL2Epsilon), heads, buf.o,
                                 mws, delta_options());
    norm(buf, N);
    Matrix<Scalar> Y = buf.o * o_proj.transpose();
    detail::pack_layer_states(off, s_.h, conv, heads, states);
    return Y;
  }

  // Gradients of no rows: zeros of the parameters' shapes, dX 0 x d.
  Gradients zero_gradients() const {
    Gradients g;
    g.dX.resize(0, s_.d);
    const auto zero = [](auto& d, const auto& p) { d.setZero(p.rows(), p.cols()); };
    zero(g.q_proj, q_proj), zero(g.k_proj, k_proj), zero(g.v_proj, v_proj);
    zero(g.q_conv1d_weight, q_conv1d_weight), zero(g.k_conv1d_weight, k_conv1d_weight);
    zero(g.v_conv1d_weight, v_conv1d_weight), zero(g.f_a_proj, f_a_proj);
    zero(g.f_b_proj, f_b_proj), zero(g.b_proj, b_proj), zero(g.g_a_proj, g_a_proj);
    zero(g.g_b_proj, g_b_proj), zero(g.A_log, A_log), zero(g.dt_bias, dt_bias);
    zero(g.o_norm_weight, o_norm_weight), zero(g.o_proj, o_proj);
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
    const Index N = X.rows(), B = static_cast<Index>(off.size()) - 1, H = s_.h;
    const Index HK = s_.key_dim, HV = s_.value_dim, C = 2 * HK + HV;
    const auto st = detail::core_states(fn, states, dfinal, B, H, s_.w, C, s_.dk, s_.dv);
    if (N == 0) {  // no rows: the blocks below would offset no data
      Gradients g = zero_gradients();
      if (states) g.dstates = detail::passed_state_gradients(st, B, H, s_.w, C, s_.dk, s_.dv);
      return g;
    }
    const Matrix<Scalar> x = X;
    detail::KdaBuffers<Scalar> buf;
    buf.reserve(s_, N, false);
    project(x, buf);
    const Rows a_pre = buf.a, b_pre = buf.b;
    gates(buf, N);
    stack_conv_weights(buf.conv_weight);
    auto conv = st.conv;
    Workspace<Scalar> ws;
    batched_short_convolution(buf.mixed, buf.conv_weight, Vector<Scalar>(), off, conv, buf.c, ws);
    const L2Normalize<> phi(kL2Epsilon);
    MultiHeadWorkspace<Scalar> mws;
    auto heads = st.heads;
    batched_delta_rule_attention(buf.c.leftCols(HK), buf.c.middleCols(HK, HK), buf.c.rightCols(HV),
                                 buf.b, buf.a, off, H, phi, heads, buf.o, mws, delta_options());
    const Rows o = buf.o;
    norm(buf, N);

    Gradients g;
    Matrix<Scalar> dn;
    detail::projection_backward(dY, buf.o, o_proj, g.o_proj, dn, true);
    auto core = detail::delta_core_backward<Scalar>(
        off, s_.h, HK, HV, phi, delta_options(),
        {buf.mixed, buf.conv_weight, buf.c, buf.b, buf.a, o, buf.z}, o_norm_weight, norm_options(),
        dn, states ? &st : nullptr);
    if (states) g.dstates = detail::layer_state_gradients(core, B, H);
    g.o_norm_weight = std::move(core.dnorm_weight);
    g.q_conv1d_weight = core.dconv_weight.topRows(HK);
    g.k_conv1d_weight = core.dconv_weight.middleRows(HK, HK);
    g.v_conv1d_weight = core.dconv_weight.bottomRows(HV);
    Rows db(N, s_.h), da(N, HK);
    g.A_log.resize(s_.h);
    g.dt_bias.resize(HK);
    beta_activation_backward(b_pre, core.dbeta, db);
    gate_activation_backward(a_pre, A_log, dt_bias, core.dlog_a, da, g.A_log, g.dt_bias,
                             gate_options());
    // The low-rank gates: z = (X W_ga^T) W_gb^T, a = (X W_fa^T) W_fb^T.
    Matrix<Scalar> dga, dfa;
    detail::projection_backward(core.dz, buf.ga, g_b_proj, g.g_b_proj, dga, true);
    detail::projection_backward(da, buf.fa, f_b_proj, g.f_b_proj, dfa, true);
    const auto dm = [&core](Index c0, Index n) { return core.dmixed.middleCols(c0, n); };
    detail::projection_backward(dm(0, HK), x, q_proj, g.q_proj, g.dX, true);
    detail::projection_backward(dm(HK, HK), x, k_proj, g.k_proj, g.dX, false);
    detail::projection_backward(dm(2 * HK, HV), x, v_proj, g.v_proj, g.dX, false);
    detail::projection_backward(db, x, b_proj, g.b_proj, g.dX, false);
    detail::projection_backward(dga, x, g_a_proj, g.g_a_proj, g.dX, false);
    detail::projection_backward(dfa, x, f_a_proj, g.f_a_proj, g.dX, false);
    return g;
  }

  KimiDeltaAttentionConfig config_;
  detail::KdaSizes s_;
};

}  // namespace linattn
