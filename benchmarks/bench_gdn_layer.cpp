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

// OpenMP's threads (the recurrence's heads) and Eigen's (forward()'s products), together.
void use_threads(int threads) {
  lb::set_threads(threads);
  Eigen::setNbThreads(threads);
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

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void BM_prefill(benchmark::State& st, int threads) {
  const Index N = st.range(0);
  const Layer& L = layer();
  use_threads(threads);
  const Mat X = lb::random_matrix<float>(N, sizes().hidden, 900);
  const double flops = proj_flops(N) + rec_flops(N);
  Mat Y;
  if (lb::worth_warming_up(flops)) Y = L.forward(X);  // starts the OpenMP team
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : st) {
    Y = L.forward(X);
    benchmark::DoNotOptimize(Y.data());
    benchmark::ClobberMemory();
  }
  const double s =
      seconds_since(t0) / double(std::max<benchmark::IterationCount>(st.iterations(), 1));
  if (!lb::all_finite(Y)) st.SkipWithError("non-finite output");
  st.SetItemsProcessed(int64_t(st.iterations()) * int64_t(N));
  st.SetComplexityN(N);
  st.counters["tokens_per_s"] =
      benchmark::Counter(double(N), benchmark::Counter::kIsIterationInvariantRate);
  st.counters["GFLOPs"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["flops"] = flops;
  st.counters["N"] = double(N);
  shape_counters(st, threads);
  lb::set_peak_counters(st, flops, s, threads);
  use_threads(1);
}

void BM_decode(benchmark::State& st, int threads) {
  const Index B = st.range(0);
  const Layer& L = layer();
  const auto sh = gdn_shape();
  use_threads(threads);
  linattn::ParallelOptions par;
  par.num_threads = threads;
  auto batch = L.make_batched_state(B);
  std::vector<RowMat> xs;
  for (Index r = 0; r < kRing; ++r)
    xs.push_back(lb::random_matrix<float>(B, sh.d, 950 + std::uint64_t(r)));
  RowMat Y(B, sh.d);
  Index t = 0;
  const auto one = [&] {
    L.step(xs[std::size_t(t)], batch, Y, par);
    t = (t + 1) % kRing;
  };
  for (int w = 0; w < 4; ++w) one();  // sizes the step's buffers, faults the states in
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : st) {
    one();
    benchmark::DoNotOptimize(Y.data());
    benchmark::ClobberMemory();
  }
  const double s =
      seconds_since(t0) / double(std::max<benchmark::IterationCount>(st.iterations(), 1));
  if (!lb::all_finite(Y)) st.SkipWithError("non-finite output");
  const double weights = double(L.in_proj_qkvz.size() + L.in_proj_ba.size() + L.out_proj.size() +
                                L.conv1d_weight.size()) *
                         sizeof(float);
  const double states =
      double(B) * double(sh.hv * sh.dk * sh.dv + (sh.w - 1) * sh.conv_dim()) * sizeof(float);
  const double flops = proj_flops(B) + rec_flops(B);
  st.SetItemsProcessed(int64_t(st.iterations()) * int64_t(B));
  st.SetComplexityN(B);
  st.counters["tokens_per_s"] =
      benchmark::Counter(double(B), benchmark::Counter::kIsIterationInvariantRate);
  st.counters["GFLOPs"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["flops"] = flops;
  st.counters["B"] = double(B);
  st.counters["ns_per_token"] = 1e9 * s / double(B);
  st.counters["weight_bytes"] = weights;
  st.counters["state_bytes"] = states;
  st.counters["GBs"] = s > 0 ? (weights + 2.0 * states) / s * 1e-9 : 0.0;
  shape_counters(st, threads);
  lb::set_peak_counters(st, flops, s, threads);
  use_threads(1);
}

enum class Part { Proj, Gather, Conv, Gates, Rec, Norm };
constexpr Part kParts[] = {Part::Proj,  Part::Gather, Part::Conv,
                           Part::Gates, Part::Rec,    Part::Norm};
constexpr int kNumParts = 6;

const char* part_name(Part p) {
  switch (p) {
    case Part::Proj:
      return "proj";
    case Part::Gather:
      return "gather";
    case Part::Conv:
      return "conv";
    case Part::Gates:
      return "gates";
    case Part::Rec:
      return "rec";
    case Part::Norm:
      return "norm";
  }
  return "?";
}

// The operands of every part at N tokens, from one untimed pass of the layer's steps over X.
// The activations write to outputs of their own (the layer works in place), so that every call
// reads the same pre-activations.
struct Stages {
  const Layer& L;
  linattn::detail::GdnSizes s;
  Index N;
  Mat X, Y;
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
    for (Part p : kParts) run(p);
    run(Part::Proj);  // the output rows of the normed rows
  }

  void run(Part p) {
    switch (p) {
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

  double flops(Part p) const {
    return p == Part::Proj ? proj_flops(N) : p == Part::Rec ? rec_flops(N) : 0.0;
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

void BM_part(benchmark::State& st, Part part, int threads) {
  const Index N = st.range(0);
  Stages& sg = stages(N);
  use_threads(threads);
  const double flops = sg.flops(part);
  if (lb::worth_warming_up(flops)) sg.run(part);  // on this thread count
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : st) {
    sg.run(part);
    benchmark::ClobberMemory();
  }
  const double s =
      seconds_since(t0) / double(std::max<benchmark::IterationCount>(st.iterations(), 1));
  if (!lb::all_finite(sg.Y) || !lb::all_finite(sg.normed)) st.SkipWithError("non-finite output");
  st.counters["N"] = double(N);
  st.counters["ms_per_call"] = 1e3 * s;
  shape_counters(st, threads);
  if (flops > 0) {
    st.counters["GFLOPs"] =
        benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
    st.counters["flops"] = flops;
    lb::set_peak_counters(st, flops, s, threads);
  }
  use_threads(1);
}

// forward(X) and the six parts back to back in every iteration, rotating the order.
void BM_split(benchmark::State& st, int threads) {
  const Index N = st.range(0);
  Stages& sg = stages(N);
  use_threads(threads);
  constexpr int kCalls = kNumParts + 1;  // the parts, then the whole layer
  Mat Y;
  const auto call = [&](int k) {
    if (k == kNumParts)
      Y = sg.L.forward(sg.X);
    else
      sg.run(kParts[k]);
  };
  std::vector<double> tk[kCalls], cgn, rest, parts;
  int first = 0;
  for (auto _ : st) {
    double t[kCalls] = {};
    for (int j = 0; j < kCalls; ++j) {
      const int k = (first + j) % kCalls;
      const auto t0 = std::chrono::steady_clock::now();
      call(k);
      benchmark::ClobberMemory();
      t[k] = seconds_since(t0);
    }
    double total = 0, sum = 0;
    for (int k = 0; k < kCalls; ++k) total += t[k], tk[k].push_back(t[k]);
    for (int k = 0; k < kNumParts; ++k) sum += t[k];
    st.SetIterationTime(total);
    const auto at = [&](Part p) { return t[int(p)]; };
    const double base = at(Part::Proj) + at(Part::Rec);
    cgn.push_back((at(Part::Conv) + at(Part::Gates) + at(Part::Norm)) / base);
    rest.push_back((t[kNumParts] - base) / base);
    parts.push_back(sum / t[kNumParts]);
    first = (first + 1) % kCalls;
  }
  if (!lb::all_finite(Y) || !lb::all_finite(sg.Y)) st.SkipWithError("non-finite output");
  for (int k = 0; k < kNumParts; ++k)
    st.counters[std::string(part_name(kParts[k])) + "_ms"] = 1e3 * lb::median(tk[k]);
  st.counters["layer_ms"] = 1e3 * lb::median(tk[kNumParts]);
  st.counters["cgn_vs_proj_rec"] = lb::median(cgn);
  st.counters["rest_vs_proj_rec"] = lb::median(rest);
  st.counters["parts_vs_layer"] = lb::median(parts);
  st.counters["N"] = double(N);
  shape_counters(st, threads);
  use_threads(1);
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
  for (Index n : s.split_ns) {
    for (int thr : thrs)
      for (Part part : kParts)
        lb::add(std::string("gdn_part") + lb::key("part", part_name(part)) + tail(thr), {n}, "N",
                benchmark::oN, [part, thr](benchmark::State& st) { BM_part(st, part, thr); });
    for (int thr : thrs)
      benchmark::RegisterBenchmark(("gdn_split" + tail(thr)).c_str(),
                                   [thr](benchmark::State& st) { BM_split(st, thr); })
          ->ArgName("N")
          ->Arg(int64_t(n))
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(s.split_iterations)
          ->Repetitions(1);  // the iterations' medians already stand for the run
  }
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
