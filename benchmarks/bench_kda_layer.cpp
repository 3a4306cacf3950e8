// The KDA layer of Kimi Linear (KimiDeltaAttentionLayer, float, the KimiDeltaAttentionConfig
// defaults: Kimi-Linear-48B-A3B's hidden 2304, H = 32 heads of K = V = 128, gates of low rank K,
// W = 4; the smoke profile: hidden 64, 4 heads of 16), parameters as torch initialises them,
// inputs uniform in [−1, 1]. The same benchmarks as bench_gdn_layer's, on the scaffold both share
// (layer_bench_common.hpp):
//
//   - kda_layer_prefill   forward(X) of one new sequence of N tokens (N x hidden, column-major),
//                   on 1 and all threads (OpenMP's, for the recurrence's heads, and Eigen's, for
//                   the products, both set to `thr`: forward() takes no ParallelOptions).
//                   Counter tokens_per_s (N per call, a rate).
//   - kda_layer_decode    one step(Xb, batch, Yb, ParallelOptions{thr}) of B sequences on a
//                   make_batched_state(B), row-major B x hidden tokens cycled through a ring.
//                   Counters tokens_per_s (B per step), ns_per_token, weight_bytes (every
//                   parameter, read once a step), state_bytes (the B sequences' convolution and
//                   delta-rule states), GBs = (weights + 2 × states) ÷ time.
//   - kda_layer_part/part:P   one part of the prefill at N tokens, on the layer's own parameters
//                   and on the intermediate rows of one untimed pass of its steps over the same X
//                   (the layer's row-major buffers, detail::KdaBuffers), each a benchmark of its
//                   own:
//       proj      the dense input projections X·q_projᵀ, X·k_projᵀ, X·v_projᵀ (into the
//                 convolution's input rows q | k | v, as forward() writes them) and X·b_projᵀ;
//       lowrank   the gates' low-rank projections (X·f_a_projᵀ)·f_b_projᵀ (the decay's
//                 pre-activations, N x H·K) and (X·g_a_projᵀ)·g_b_projᵀ (the output gate);
//       conv      batched_short_convolution of the N x (2·H·K + H·V) rows q | k | v with the
//                 three convolutions' weights stacked (SiLU, no bias, a new sequence);
//       gates     beta_activation(b) and gate_activation(a, A_log, dt_bias): β per head and one
//                 log-decay per head and key channel;
//       rec       batched_delta_rule_attention with the N x H·K per-channel log-decays,
//                 L2Normalize<>(1e-6), scale 1/√K, key_dim = K, value_dim = V, from zero states
//                 (the layer's call);
//       norm      gated_rms_norm(o, z, o_norm_weight), the sigmoid gate, eps = rms_norm_eps;
//       oproj     the output projection normed·o_projᵀ.
//   - kda_layer_split   every iteration times forward(X) and the seven parts back to back,
//                   rotating which goes first; counters *_ms (medians) and the medians of the
//                   per-iteration ratios cgn_vs_proj_rec = (conv + gates + norm) ÷ (proj +
//                   lowrank + rec + oproj), rest_vs_proj_rec = (layer − those four) ÷ (those
//                   four) and parts_vs_layer (the parts' sum ÷ the layer).
//
// (The kinds are kda_layer_*: bench_kda's kda_prefill and kda_pair name the bare kernels.)
// Useful flops: the dense products' 2·N·hidden·(2·H·K + H·V + H) + 2·N·H·V·hidden, the low-rank
// ones' 2·N·hidden·2K + 2·N·K·(H·K + H·V), and the recurrence's 4·N·K·V per head, as bench_kda
// counts the delta rule. peak_GFLOPs is the FMA peak of `thr` threads measured in this process
// right after each benchmark's timed loop (bench_common.hpp: fma_peak_now) and frac_of_peak the
// useful GFLOP/s ÷ that (prefill, decode, proj, lowrank, rec and oproj). Names:
//   kda_layer_prefill/dtype:f32/hidden:2304/H:32/D:128/thr:1/N:4096
//   kda_layer_part/part:rec/dtype:f32/hidden:2304/H:32/D:128/thr:2/N:4096
//   kda_layer_decode/dtype:f32/hidden:2304/H:32/D:128/thr:1/B:8
#include <linattn/linattn.hpp>

#if __has_include(<linattn/layers/kimi_delta_attention_layer.hpp>)
#include <linattn/layers/kimi_delta_attention_layer.hpp>
#define LINATTN_BENCH_KDA_LAYER 1
#else
#define LINATTN_BENCH_KDA_LAYER 0
#endif

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "layer_bench_common.hpp"

namespace lb = linattn_bench;
using lb::Index;

namespace {

struct KdaBenchSizes {
  Index hidden = 2304, heads = 32, dim = 128, w = 4;
  std::vector<Index> prefill_ns, split_ns, batches;
  int split_iterations = 0;
};

KdaBenchSizes kda_sizes(const lb::Profile& p) {
  KdaBenchSizes s;
  s.batches = {1, 8, 64};
  if (p.name == "full") {
    s.prefill_ns = {512, 4096, 16384};
    s.split_ns = {512, 4096};
    s.split_iterations = 3;
  } else if (p.name == "smoke") {
    s.hidden = 64;
    s.heads = 4;
    s.dim = 16;
    s.prefill_ns = {64};
    s.split_ns = {64};
    s.batches = {1, 8};
    s.split_iterations = 2;
  } else {  // quick
    s.prefill_ns = {512, 4096};
    s.split_ns = {512};
    s.split_iterations = 3;
  }
  return s;
}

#if LINATTN_BENCH_KDA_LAYER

using Layer = linattn::KimiDeltaAttentionLayer<float>;
using Mat = Eigen::MatrixXf;
using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

KdaBenchSizes& sizes() {
  static KdaBenchSizes s;
  return s;
}

linattn::KimiDeltaAttentionConfig config() {
  const KdaBenchSizes& s = sizes();
  linattn::KimiDeltaAttentionConfig c;
  c.hidden_size = s.hidden;
  c.num_heads = s.heads;
  c.head_dim = s.dim;
  c.short_conv_kernel_size = s.w;
  return c;
}

// Built once: drawing the Kimi-Linear-48B layer's 39 M parameters takes a noticeable fraction of
// a second, and every benchmark reads the same ones.
const Layer& layer() {
  static const Layer l(config(), 1);
  return l;
}

linattn::detail::KdaSizes kda_shape() {
  const KdaBenchSizes& b = sizes();
  linattn::detail::KdaSizes s;
  s.d = b.hidden;
  s.h = b.heads;
  s.dk = b.dim;
  s.dv = b.dim;
  s.w = b.w;
  s.key_dim = b.heads * b.dim;
  s.value_dim = b.heads * b.dim;
  return s;
}

// Useful flops of N tokens: the dense input products, the gates' low-rank ones, the output
// product and the recurrence's 4·K·V per head.
double proj_flops(Index N) {
  const auto s = kda_shape();
  return 2.0 * double(N) * double(s.d) * double(s.conv_dim() + s.h);
}
double lowrank_flops(Index N) {
  const auto s = kda_shape();
  return 2.0 * double(N) * double(s.d) * double(2 * s.dk) +
         2.0 * double(N) * double(s.dk) * double(s.key_dim + s.value_dim);
}
double oproj_flops(Index N) {
  const auto s = kda_shape();
  return 2.0 * double(N) * double(s.value_dim) * double(s.d);
}
double rec_flops(Index N) {
  const auto s = kda_shape();
  return double(s.h) * 4.0 * double(N) * double(s.dk) * double(s.dv);
}
double layer_flops(Index N) {
  return proj_flops(N) + lowrank_flops(N) + oproj_flops(N) + rec_flops(N);
}

std::string tail(int threads) {
  const KdaBenchSizes& s = sizes();
  return lb::key("dtype", "f32") + lb::key("hidden", s.hidden) + lb::key("H", s.heads) +
         lb::key("D", s.dim) + lb::key("thr", threads);
}

void shape_counters(benchmark::State& st, int threads) {
  const KdaBenchSizes& s = sizes();
  st.counters["hidden"] = double(s.hidden);
  st.counters["H"] = double(s.heads);
  st.counters["D"] = double(s.dim);
  st.counters["threads"] = threads;
}

void BM_prefill(benchmark::State& st, int threads) {
  lb::layer_prefill(st, layer(), sizes().hidden, layer_flops(st.range(0)), threads, shape_counters);
}

void BM_decode(benchmark::State& st, int threads) {
  const Index B = st.range(0);
  const Layer& L = layer();
  const auto sh = kda_shape();
  lb::DecodeBytes bytes;
  bytes.weights =
      double(L.q_proj.size() + L.k_proj.size() + L.v_proj.size() + L.q_conv1d_weight.size() +
             L.k_conv1d_weight.size() + L.v_conv1d_weight.size() + L.f_a_proj.size() +
             L.f_b_proj.size() + L.b_proj.size() + L.g_a_proj.size() + L.g_b_proj.size() +
             L.A_log.size() + L.dt_bias.size() + L.o_norm_weight.size() + L.o_proj.size()) *
      sizeof(float);
  bytes.states =
      double(B) * double(sh.h * sh.dk * sh.dv + (sh.w - 1) * sh.conv_dim()) * sizeof(float);
  lb::layer_decode(st, L, sh.d, layer_flops(B), bytes, threads, shape_counters);
}

// The parts in the order of their names' indices (Stages::run), which is also the order of the
// layer's steps: one pass over them in this order gives every part its operands.
enum class Part { Proj, LowRank, Conv, Gates, Rec, Norm, OProj };
const std::vector<lb::PartInfo> kParts = {
    {"proj", lb::PartRole::Base}, {"lowrank", lb::PartRole::Base}, {"conv", lb::PartRole::Aux},
    {"gates", lb::PartRole::Aux}, {"rec", lb::PartRole::Base},     {"norm", lb::PartRole::Aux},
    {"oproj", lb::PartRole::Base}};

// The operands of every part at N tokens, from one untimed pass of the layer's steps over X.
// The activations and the norm write to outputs of their own (the layer works in place), so
// that every call reads the same inputs.
struct Stages {
  const Layer& L;
  linattn::detail::KdaSizes s;
  Index N;
  Mat X, Y, Ylayer;
  linattn::detail::KdaBuffers<float> buf;
  RowMat beta, g, normed;
  linattn::Workspace<float> ws;
  linattn::MultiHeadWorkspace<float> mws;
  std::vector<linattn::ShortConvState<float>> conv;
  std::vector<linattn::LinearAttentionState<float>> heads;
  std::vector<Index> off;
  linattn::DeltaOptions dopt;
  linattn::GateOptions gopt;
  linattn::GatedRMSNormOptions nopt;

  Stages(const Layer& layer, Index n)
      : L(layer),
        s(kda_shape()),
        N(n),
        X(lb::random_matrix<float>(n, s.d, 900)),
        Y(n, s.d),
        beta(n, s.h),
        g(n, s.key_dim),
        normed(n, s.value_dim),
        off{0, n} {
    buf.reserve(s, N, false);
    // The three depthwise convolutions as one over q | k | v, as the layer stacks them.
    buf.conv_weight.topRows(s.key_dim) = L.q_conv1d_weight;
    buf.conv_weight.middleRows(s.key_dim, s.key_dim) = L.k_conv1d_weight;
    buf.conv_weight.bottomRows(s.value_dim) = L.v_conv1d_weight;
    dopt.scale = 1.0 / std::sqrt(double(s.dk));
    dopt.key_dim = s.dk;
    dopt.value_dim = s.dv;
    if (L.config().use_lower_bound) {
      gopt.activation = linattn::GateActivation::LowerBoundSigmoid;
      gopt.lower_bound = L.config().lower_bound;
    }
    nopt.eps = L.config().rms_norm_eps;
    nopt.gate = linattn::NormGate::Sigmoid;
    for (int k = 0; k < int(kParts.size()); ++k) run(k);
  }

  void run(int k) {
    const Index HK = s.key_dim, HV = s.value_dim;
    switch (Part(k)) {
      case Part::Proj:
        buf.mixed.leftCols(HK).noalias() = X * L.q_proj.transpose();
        buf.mixed.middleCols(HK, HK).noalias() = X * L.k_proj.transpose();
        buf.mixed.rightCols(HV).noalias() = X * L.v_proj.transpose();
        buf.b.noalias() = X * L.b_proj.transpose();
        return;
      case Part::LowRank:
        buf.fa.noalias() = X * L.f_a_proj.transpose();
        buf.a.noalias() = buf.fa * L.f_b_proj.transpose();
        buf.ga.noalias() = X * L.g_a_proj.transpose();
        buf.z.noalias() = buf.ga * L.g_b_proj.transpose();
        return;
      case Part::Conv:
        conv.clear();  // a new sequence, as forward(X)
        linattn::batched_short_convolution(buf.mixed, buf.conv_weight, Eigen::VectorXf(), off, conv,
                                           buf.c, ws);
        return;
      case Part::Gates:
        linattn::beta_activation(buf.b, beta);
        linattn::gate_activation(buf.a, L.A_log, L.dt_bias, g, gopt);
        return;
      case Part::Rec:
        heads.assign(std::size_t(s.h), linattn::LinearAttentionState<float>());  // zero states
        linattn::batched_delta_rule_attention(
            buf.c.leftCols(HK), buf.c.middleCols(HK, HK), buf.c.rightCols(HV), beta, g, off, s.h,
            linattn::L2Normalize<>(1e-6), heads, buf.o, mws, dopt);
        return;
      case Part::Norm:
        linattn::gated_rms_norm(buf.o, buf.z, L.o_norm_weight, normed, nopt);
        return;
      case Part::OProj:
        Y.noalias() = normed * L.o_proj.transpose();
        return;
    }
  }

  double flops(int k) const {
    switch (Part(k)) {
      case Part::Proj:
        return proj_flops(N);
      case Part::LowRank:
        return lowrank_flops(N);
      case Part::Rec:
        return rec_flops(N);
      case Part::OProj:
        return oproj_flops(N);
      default:
        return 0.0;
    }
  }

  void forward() { Ylayer = L.forward(X); }

  bool finite() const {
    return lb::all_finite(Y) && lb::all_finite(normed) &&
           (Ylayer.size() == 0 || lb::all_finite(Ylayer));
  }
};

// The last size's stages, kept: the parts of one N are registered together, and building them
// costs a whole forward.
Stages& stages(Index N) {
  static std::unique_ptr<Stages> st;
  if (!st || st->N != N) {
    st.reset();  // frees the previous size first
    st = std::make_unique<Stages>(layer(), N);
  }
  return *st;
}

// Part k alone, or (k < 0) the split of the prefill at N.
void BM_part(benchmark::State& st, int k, int threads) {
  Stages& sg = stages(st.range(0));
  if (k < 0)
    lb::layer_split(st, sg, kParts, threads, shape_counters);
  else
    lb::layer_part(st, sg, k, threads, shape_counters);
}

#endif  // LINATTN_BENCH_KDA_LAYER

void register_all(const lb::Profile& p) {
#if LINATTN_BENCH_KDA_LAYER
  sizes() = kda_sizes(p);
  const KdaBenchSizes& s = sizes();
  const double peak = lb::fma_peak_gflops<float>();  // at the start, for the context
  benchmark::AddCustomContext("linattn_fma_peak_f32_gflops", std::to_string(peak));
  const std::vector<int> thrs = lb::one_and_all_threads();
  for (int thr : thrs)
    lb::add("kda_layer_prefill" + tail(thr), s.prefill_ns, "N", benchmark::oN,
            [thr](benchmark::State& st) { BM_prefill(st, thr); });
  for (int thr : thrs)
    lb::add("kda_layer_decode" + tail(thr), s.batches, "B", benchmark::oN,
            [thr](benchmark::State& st) { BM_decode(st, thr); })
        ->Unit(benchmark::kMicrosecond);
  // By size first: the parts of one N share its stages (stages()).
  for (Index n : s.split_ns)
    lb::add_layer_parts("kda_layer", kParts, n, thrs, s.split_iterations, tail, BM_part);
#else
  (void)p;
#endif
}

std::string notes(const lb::Profile& p) {
  const KdaBenchSizes s = kda_sizes(p);
#if LINATTN_BENCH_KDA_LAYER
  return "KimiDeltaAttentionLayer (float, hidden " + std::to_string(s.hidden) + ", " +
         std::to_string(s.heads) + " heads of " + std::to_string(s.dim) + ", gates of rank " +
         std::to_string(s.dim) + ", W = " + std::to_string(s.w) +
         "): prefill forward(X) of N = " + lb::join(s.prefill_ns) +
         " tokens, decode step() of B = " + lb::join(s.batches) +
         " sequences, on 1 and all threads (OpenMP's and Eigen's); the prefill's parts (input "
         "products, low-rank gate products, short convolution, gates, recurrence with per-channel "
         "decay, gated norm, output product) at N = " +
         lb::join(s.split_ns) + ", each alone and all with the layer in every iteration (" +
         std::to_string(s.split_iterations) + " iterations); FMA peak measured in the process.";
#else
  (void)s;
  return "not measured: this build has no linattn/layers/kimi_delta_attention_layer.hpp.";
#endif
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
