// The Gated DeltaNet layer of Qwen3-Next (GatedDeltaNetLayer, float, the GatedDeltaNetConfig
// defaults: hidden 2048, Hk = 16 query/key heads and Hv = 32 value heads of Dk = Dv = 128, W = 4;
// the smoke profile: hidden 64, 2 / 4 heads of 16), parameters as torch initialises them, inputs
// uniform in [−1, 1]:
//
//   - gdn_prefill   forward(X) of one new sequence of N tokens (N x hidden, column-major), on 1
//                   and all threads: forward() takes no ParallelOptions, so the threads are
//                   OpenMP's (the recurrence's heads) and Eigen's (its three products), both set
//                   to `thr` (a build with OpenMP gives Eigen's products every thread unless told
//                   otherwise). Counter tokens_per_s (N per call, a rate).
//   - gdn_decode    one step(Xb, batch, Yb, ParallelOptions{thr}) of B sequences on a
//                   make_batched_state(B), row-major B x hidden tokens cycled through a ring.
//                   Counters tokens_per_s (B per step), ns_per_token, weight_bytes (the
//                   parameters, read once a step), state_bytes (the B sequences' convolution and
//                   delta-rule states), GBs = (weights + 2 × states) ÷ time.
//   - gdn_part/part:P   one part of the prefill at N tokens, on the layer's own parameters and on
//                   the intermediate rows of one untimed forward of the same X (the layer's
//                   row-major buffers, detail::GdnBuffers), each as a benchmark of its own:
//       proj      the three products: X·in_proj_qkvzᵀ, X·in_proj_baᵀ, o·out_projᵀ (Eigen, as
//                 forward() computes them);
//       gather    the reorder of transformers' interleaved projections into packed q, k, v, z,
//                 b, a (GdnBuffers::gather);
//       conv      batched_short_convolution of the N x (2·Hk·Dk + Hv·Dv) mixed rows (SiLU, no
//                 bias, a new sequence);
//       gates     beta_activation(b) and gate_activation(a, A_log, dt_bias);
//       rec       batched_delta_rule_attention, L2Normalize<>(1e-6), key_heads = Hk, scale
//                 1/√Dk, key_dim = Dk, value_dim = Dv, from zero states (the layer's call);
//       norm      gated_rms_norm(o, z, norm_weight), eps = rms_norm_eps.
//   - gdn_split     every iteration times forward(X) and the six parts back to back, rotating
//                   which goes first, so that the drift of a shared machine falls on all of them;
//                   counters *_ms (medians) and the medians of the per-iteration ratios
//                   cgn_vs_proj_rec = (conv + gates + norm) ÷ (proj + rec) (target ≤ 0.15),
//                   rest_vs_proj_rec = (layer − proj − rec) ÷ (proj + rec) (everything the layer
//                   adds to its projections and recurrence: the three parts, the gather, its
//                   checks, allocations and copies) and parts_vs_layer (the parts' sum ÷ the
//                   layer: how much of the layer they account for).
//
// Useful flops: the products' 2·N·hidden·(2·Hk·Dk + 2·Hv·Dv + 2·Hv) + 2·N·Hv·Dv·hidden, and the
// recurrence's 4·N·Dk·Dv per value head, as bench_kda counts the delta rule. peak_GFLOPs is the
// FMA peak of `thr` threads measured in this process right after each benchmark's timed loop
// (bench_common.hpp: fma_peak_now) and frac_of_peak the useful GFLOP/s ÷ that (prefill, decode,
// proj and rec; the other parts do little arithmetic). Names follow bench_common.hpp:
//   gdn_prefill/dtype:f32/hidden:2048/Hk:16/Hv:32/D:128/thr:1/N:4096
//   gdn_part/part:rec/dtype:f32/hidden:2048/Hk:16/Hv:32/D:128/thr:2/N:4096
//   gdn_decode/dtype:f32/hidden:2048/Hk:16/Hv:32/D:128/thr:1/B:8
#include <linattn/linattn.hpp>

#if __has_include(<linattn/layers/gated_delta_net_layer.hpp>)
#include <linattn/layers/gated_delta_net_layer.hpp>
#define LINATTN_BENCH_GDN 1
#else
#define LINATTN_BENCH_GDN 0
#endif

#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "layer_bench_common.hpp"

namespace lb = linattn_bench;
using lb::Index;

namespace {

struct GdnBenchSizes {
  Index hidden = 2048, hk = 16, hv = 32, dim = 128, w = 4;
  std::vector<Index> prefill_ns, split_ns, batches;
  int split_iterations = 0;
};

GdnBenchSizes gdn_sizes(const lb::Profile& p) {
  GdnBenchSizes s;
  s.batches = {1, 8, 64};
  if (p.name == "full") {
    s.prefill_ns = {512, 4096, 16384};
    s.split_ns = {512, 4096};
    s.split_iterations = 3;
  } else if (p.name == "smoke") {
    s.hidden = 64;
    s.hk = 2;
    s.hv = 4;
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

#if LINATTN_BENCH_GDN

using Layer = linattn::GatedDeltaNetLayer<float>;
using Mat = Eigen::MatrixXf;
using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

constexpr Index kRing = 4;  // distinct token sets cycled through by the timed decode steps

GdnBenchSizes& sizes() {
  static GdnBenchSizes s;
  return s;
}

linattn::GatedDeltaNetConfig config() {
  const GdnBenchSizes& s = sizes();
  linattn::GatedDeltaNetConfig c;
  c.hidden_size = s.hidden;
  c.linear_num_key_heads = s.hk;
  c.linear_num_value_heads = s.hv;
  c.linear_key_head_dim = s.dim;
  c.linear_value_head_dim = s.dim;
  c.linear_conv_kernel_dim = s.w;
  return c;
}

// Built once: drawing the Qwen3-Next layer's 34 M parameters takes a noticeable fraction of a
// second, and every benchmark reads the same ones.
const Layer& layer() {
  static const Layer l(config(), 1);
  return l;
}

linattn::detail::GdnSizes gdn_shape() {
  const GdnBenchSizes& b = sizes();
  linattn::detail::GdnSizes s;
  s.d = b.hidden;
  s.hk = b.hk;
  s.hv = b.hv;
  s.dk = b.dim;
  s.dv = b.dim;
  s.w = b.w;
  s.group = b.hv / b.hk;
  s.key_dim = b.hk * b.dim;
  s.value_dim = b.hv * b.dim;
  return s;
}

// Useful flops of N tokens: the three products, and the recurrence's 4·Dk·Dv per value head.
double proj_flops(Index N) {
  const auto s = gdn_shape();
  return 2.0 * double(N) * double(s.d) * double(s.qkvz_dim() + 2 * s.hv) +
         2.0 * double(N) * double(s.value_dim) * double(s.d);
}
double rec_flops(Index N) {
  const auto s = gdn_shape();
  return double(s.hv) * 4.0 * double(N) * double(s.dk) * double(s.dv);
}

std::string tail(int threads) {
  const GdnBenchSizes& s = sizes();
  return lb::key("dtype", "f32") + lb::key("hidden", s.hidden) + lb::key("Hk", s.hk) +
         lb::key("Hv", s.hv) + lb::key("D", s.dim) + lb::key("thr", threads);
}

void shape_counters(benchmark::State& st, int threads) {
  const GdnBenchSizes& s = sizes();
  st.counters["hidden"] = double(s.hidden);
  st.counters["Hk"] = double(s.hk);
  st.counters["Hv"] = double(s.hv);
  st.counters["D"] = double(s.dim);
  st.counters["threads"] = threads;
}

void BM_prefill(benchmark::State& st, int threads) {
  lb::layer_prefill(st, layer(), sizes().hidden, proj_flops(st.range(0)) + rec_flops(st.range(0)),
                    threads, shape_counters);
}

void BM_decode(benchmark::State& st, int threads) {
  const Index B = st.range(0);
  const Layer& L = layer();
  const auto sh = gdn_shape();
  lb::DecodeBytes bytes;
  bytes.weights = double(L.in_proj_qkvz.size() + L.in_proj_ba.size() + L.out_proj.size() +
                         L.conv1d_weight.size()) *
                  sizeof(float);
  bytes.states =
      double(B) * double(sh.hv * sh.dk * sh.dv + (sh.w - 1) * sh.conv_dim()) * sizeof(float);
  lb::layer_decode(st, L, sh.d, proj_flops(B) + rec_flops(B), bytes, threads, shape_counters);
}

// The parts in the order of their names' indices (Stages::run).
enum class Part { Proj, Gather, Conv, Gates, Rec, Norm };
const std::vector<lb::PartInfo> kParts = {
    {"proj", lb::PartRole::Base}, {"gather", lb::PartRole::Other}, {"conv", lb::PartRole::Aux},
    {"gates", lb::PartRole::Aux}, {"rec", lb::PartRole::Base},     {"norm", lb::PartRole::Aux}};

// The operands of every part at N tokens, from one untimed pass of the layer's steps over X.
// The activations write to outputs of their own (the layer works in place), so that every call
// reads the same pre-activations.
struct Stages {
  const Layer& L;
  linattn::detail::GdnSizes s;
  Index N;
  Mat X, Y, Ylayer;
  linattn::detail::GdnBuffers<float> buf;
  RowMat beta, g, normed;
  linattn::Workspace<float> ws;
  linattn::MultiHeadWorkspace<float> mws;
  std::vector<linattn::ShortConvState<float>> conv;
  std::vector<linattn::LinearAttentionState<float>> heads;
  std::vector<Index> off;
  linattn::DeltaOptions dopt;
  linattn::GatedRMSNormOptions nopt;

  Stages(const Layer& layer, Index n)
      : L(layer),
        s(gdn_shape()),
        N(n),
        X(lb::random_matrix<float>(n, s.d, 900)),
        Y(n, s.d),
        beta(n, s.hv),
        g(n, s.hv),
        normed(n, s.value_dim),
        off{0, n} {
    buf.reserve(s, N);
    dopt.scale = 1.0 / std::sqrt(double(s.dk));
    dopt.key_heads = s.hk;
    dopt.key_dim = s.dk;
    dopt.value_dim = s.dv;
    nopt.eps = L.config().rms_norm_eps;
    normed.setZero();  // the output product reads it before the norm first writes it
    for (int k = 0; k < int(kParts.size()); ++k) run(k);
    run(int(Part::Proj));  // the output rows of the normed rows
  }

  void run(int k) {
    switch (Part(k)) {
      case Part::Proj:
        buf.p.noalias() = X * L.in_proj_qkvz.transpose();
        buf.r.noalias() = X * L.in_proj_ba.transpose();
        Y.noalias() = normed * L.out_proj.transpose();
        return;
      case Part::Gather:
        buf.gather(s, N);
        return;
      case Part::Conv:
        conv.clear();  // a new sequence, as forward(X)
        linattn::batched_short_convolution(buf.mixed, L.conv1d_weight, Eigen::VectorXf(), off, conv,
                                           buf.c, ws);
        return;
      case Part::Gates:
        linattn::beta_activation(buf.b, beta);
        linattn::gate_activation(buf.a, L.A_log, L.dt_bias, g);
        return;
      case Part::Rec:
        heads.assign(std::size_t(s.hv), linattn::LinearAttentionState<float>());  // zero states
        linattn::batched_delta_rule_attention(
            buf.c.leftCols(s.key_dim), buf.c.middleCols(s.key_dim, s.key_dim),
            buf.c.rightCols(s.value_dim), beta, g, off, s.hv, linattn::L2Normalize<>(1e-6), heads,
            buf.o, mws, dopt);
        return;
      case Part::Norm:
        linattn::gated_rms_norm(buf.o, buf.z, L.norm_weight, normed, nopt);
        return;
    }
  }

  double flops(int k) const {
    return Part(k) == Part::Proj ? proj_flops(N) : Part(k) == Part::Rec ? rec_flops(N) : 0.0;
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

#endif  // LINATTN_BENCH_GDN

void register_all(const lb::Profile& p) {
#if LINATTN_BENCH_GDN
  sizes() = gdn_sizes(p);
  const GdnBenchSizes& s = sizes();
  const double peak = lb::fma_peak_gflops<float>();  // at the start, for the context
  benchmark::AddCustomContext("linattn_fma_peak_f32_gflops", std::to_string(peak));
  const std::vector<int> thrs = lb::one_and_all_threads();
  for (int thr : thrs)
    lb::add("gdn_prefill" + tail(thr), s.prefill_ns, "N", benchmark::oN,
            [thr](benchmark::State& st) { BM_prefill(st, thr); });
  for (int thr : thrs)
    lb::add("gdn_decode" + tail(thr), s.batches, "B", benchmark::oN, [thr](benchmark::State& st) {
      BM_decode(st, thr);
    })->Unit(benchmark::kMicrosecond);
  // By size first: the parts of one N share its stages (stages()).
  for (Index n : s.split_ns)
    lb::add_layer_parts("gdn", kParts, n, thrs, s.split_iterations, tail, BM_part);
#else
  (void)p;
#endif
}

std::string notes(const lb::Profile& p) {
  const GdnBenchSizes s = gdn_sizes(p);
#if LINATTN_BENCH_GDN
  return "GatedDeltaNetLayer (float, hidden " + std::to_string(s.hidden) + ", " +
         std::to_string(s.hk) + " key heads, " + std::to_string(s.hv) + " value heads of " +
         std::to_string(s.dim) + ", W = " + std::to_string(s.w) +
         "): prefill forward(X) of N = " + lb::join(s.prefill_ns) +
         " tokens, decode step() of B = " + lb::join(s.batches) +
         " sequences, on 1 and all threads (OpenMP's and Eigen's); the prefill's parts (products, "
         "gather, "
         "short convolution, gates, recurrence, gated norm) at N = " +
         lb::join(s.split_ns) + ", each alone and all with the layer in every iteration (" +
         std::to_string(s.split_iterations) + " iterations); FMA peak measured in the process.";
#else
  (void)s;
  return "not measured: this build has no linattn/layers/gated_delta_net_layer.hpp.";
#endif
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
