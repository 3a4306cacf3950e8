// KDA (Kimi Delta Attention: the delta rule with one log-decay per key channel) and shared key
// heads (GVA), float, one thread (ParallelOptions{1}), multi-head calls into a reused output and
// MultiHeadWorkspace, column-major packed N×(H·D) inputs, D = M:
//
//   - kda_prefill/var:kda     multihead_delta_rule_attention, L2Normalize<>(1e-6), log_a N×H·D
//                             (per key channel), β uniform in [0, 1], log-decays in [−0.1, 0];
//   - kda_prefill/var:kda_chunked   the same KDA call with DeltaOptions::algorithm = Chunked
//                             (the per-channel WY / UT form, default chunk size) instead of Auto
//                             (the recurrent form);
//   - kda_prefill/var:delta   the same call with a scalar decay per head (log_a N×H: Gated
//                             DeltaNet), the same inputs otherwise;
//   - kda_prefill/var:causal  plain multihead_causal_linear_attention with the Identity map
//                             (CausalOptions{}; its queries and keys are |x| so that the
//                             normaliser stays positive), the same shapes;
//   - kda_prefill/var:delta_gva, kda_gva    DeltaOptions::key_heads = H/2: Q and K hold H/2
//                             heads, value head h reads key head h / 2, without copying;
//   - kda_prefill/var:delta_repeat, kda_repeat   what a user without GVA does: the H/2 query and
//                             key heads copied into H-head buffers (kept, not reallocated; the
//                             copy is timed), then the H-head call;
//   - kda_pair: every iteration makes the scalar-decay, KDA, GVA (scalar decay), repeat, plain
//     causal and chunked KDA calls back to back, rotating which goes first, so that the drift of
//     a shared machine falls on all of them; counters *_ms (medians) and the medians of the
//     per-iteration ratios kda_vs_delta (target ≤ 1.5), gva_vs_repeat, delta_vs_causal,
//     kda_vs_causal, chunked_vs_kda (chunked KDA ÷ recurrent KDA), and the same of the thread's
//     CPU times (*_cpu).
//
// Useful flops per head 4·N·F·M, as bench_delta counts them (the delta rule's recurrence itself
// does 6·N·F·M and KDA the per-channel decay on top). peak_GFLOPs is the FMA peak of one core
// measured in this process right after each benchmark's timed loop (bench_common.hpp:
// fma_peak_now: on this shared virtual machine it varies with the neighbours' load) and
// frac_of_peak the useful GFLOP/s ÷ that. Names follow bench_common.hpp:
//   kda_prefill/var:kda/dtype:f32/H:16/D:128/thr:1/N:4096
#include <linattn/linattn.hpp>

#if __has_include(<linattn/delta.hpp>)
#include <linattn/delta.hpp>
#define LINATTN_BENCH_KDA 1
#else
#define LINATTN_BENCH_KDA 0
#endif

#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace lb = linattn_bench;
using lb::Index;

namespace {

template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;

struct KdaSizes {
  std::vector<Index> heads;
  std::vector<Index> dims;
  std::vector<Index> ns;
  std::vector<Index> pair_ns;
  int pair_iterations = 0;
};

KdaSizes kda_sizes(const lb::Profile& p) {
  KdaSizes s;
  if (p.name == "full") {
    s.heads = {8, 16};
    s.dims = {64, 128};
    s.ns = {1024, 4096, 16384};
    s.pair_ns = {4096, 16384};
    s.pair_iterations = 8;
  } else if (p.name == "smoke") {
    s.heads = {4};
    s.dims = {32};
    s.ns = {256};
    s.pair_ns = {256};
    s.pair_iterations = 2;
  } else {  // quick
    s.heads = {8, 16};
    s.dims = {64, 128};
    s.ns = {1024, 4096};
    s.pair_ns = {4096};
    s.pair_iterations = 6;
  }
  return s;
}

#if LINATTN_BENCH_KDA

using Phi = linattn::L2Normalize<>;

enum class Var { Causal, Delta, Kda, KdaChunked, DeltaGva, DeltaRepeat, KdaGva, KdaRepeat };

const char* var_name(Var v) {
  switch (v) {
    case Var::Causal:
      return "causal";
    case Var::Delta:
      return "delta";
    case Var::Kda:
      return "kda";
    case Var::KdaChunked:
      return "kda_chunked";
    case Var::DeltaGva:
      return "delta_gva";
    case Var::DeltaRepeat:
      return "delta_repeat";
    case Var::KdaGva:
      return "kda_gva";
    case Var::KdaRepeat:
      return "kda_repeat";
  }
  return "?";
}

bool per_channel(Var v) {
  return v == Var::Kda || v == Var::KdaChunked || v == Var::KdaGva || v == Var::KdaRepeat;
}

// The inputs of every variant at one shape (H value heads of D = M; H/2 shared key heads).
struct Problem {
  using T = float;
  Index N, H, D;
  Mat<T> Q, K, Qa, Ka, Qs, Ks, Qrep, Krep, V, B, G, Gc, out;
  Problem(Index n, Index heads, Index d)
      : N(n),
        H(heads),
        D(d),
        Q(lb::random_matrix<T>(n, heads * d, 81)),
        K(lb::random_matrix<T>(n, heads * d, 82)),
        Qa(Q.cwiseAbs()),
        Ka(K.cwiseAbs()),
        Qs(lb::random_matrix<T>(n, heads / 2 * d, 83)),
        Ks(lb::random_matrix<T>(n, heads / 2 * d, 84)),
        Qrep(n, heads * d),
        Krep(n, heads * d),
        V(lb::random_matrix<T>(n, heads * d, 85)),
        B((T(0.5) * (lb::random_matrix<T>(n, heads, 86).array() + T(1))).matrix()),
        G((T(-0.05) * (lb::random_matrix<T>(n, heads, 87).array() + T(1))).matrix()),
        Gc((T(-0.05) * (lb::random_matrix<T>(n, heads * d, 88).array() + T(1))).matrix()),
        out(Mat<T>::Zero(n, heads * d)) {}
};

linattn::DeltaOptions options(Index D, Index key_heads,
                              linattn::CausalAlgorithm alg = linattn::CausalAlgorithm::Auto) {
  linattn::DeltaOptions o;
  o.scale = 1.0 / std::sqrt(double(D));
  o.key_heads = key_heads;
  o.algorithm = alg;
  return o;
}

void call(Problem& p, Var v, linattn::MultiHeadWorkspace<float>& ws) {
  linattn::ParallelOptions par;
  par.num_threads = 1;
  const Phi phi(1e-6);
  const Index H = p.H, D = p.D;
  const Mat<float>& G = per_channel(v) ? p.Gc : p.G;
  switch (v) {
    case Var::Causal:
      linattn::multihead_causal_linear_attention(p.Qa, p.Ka, p.V, H, linattn::Identity{}, p.out, ws,
                                                 linattn::CausalOptions{}, par);
      return;
    case Var::Delta:
    case Var::Kda:
      linattn::multihead_delta_rule_attention(p.Q, p.K, p.V, p.B, G, H, phi, p.out, ws,
                                              options(D, 0), par);
      return;
    case Var::KdaChunked:
      linattn::multihead_delta_rule_attention(p.Q, p.K, p.V, p.B, G, H, phi, p.out, ws,
                                              options(D, 0, linattn::CausalAlgorithm::Chunked),
                                              par);
      return;
    case Var::DeltaGva:
    case Var::KdaGva:
      linattn::multihead_delta_rule_attention(p.Qs, p.Ks, p.V, p.B, G, H, phi, p.out, ws,
                                              options(D, H / 2), par);
      return;
    case Var::DeltaRepeat:
    case Var::KdaRepeat:
      // repeat_interleave of the shared heads: value head h gets key head h / 2.
      for (Index h = 0; h < H; ++h) {
        p.Qrep.middleCols(h * D, D) = p.Qs.middleCols((h / 2) * D, D);
        p.Krep.middleCols(h * D, D) = p.Ks.middleCols((h / 2) * D, D);
      }
      linattn::multihead_delta_rule_attention(p.Qrep, p.Krep, p.V, p.B, G, H, phi, p.out, ws,
                                              options(D, 0), par);
      return;
  }
}

double useful_flops(Index N, Index H, Index D) { return double(H) * lb::linear_flops(N, N, D, D); }

void BM_prefill(benchmark::State& st, Var v, Index H, Index D) {
  const Index N = st.range(0);
  lb::set_threads(1);
  Problem p(N, H, D);
  linattn::MultiHeadWorkspace<float> ws;
  const double flops = useful_flops(N, H, D);
  call(p, v, ws);  // sizes the workspace, faults the pages in
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : st) {
    call(p, v, ws);
    benchmark::DoNotOptimize(p.out.data());
    benchmark::ClobberMemory();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!lb::all_finite(p.out)) st.SkipWithError("non-finite output");
  st.SetComplexityN(N);
  st.SetItemsProcessed(int64_t(st.iterations()) * int64_t(N));
  lb::set_common_counters(st, flops, N, D, D, H, 1);
  lb::set_peak_counters(st, flops,
                        s / double(std::max<benchmark::IterationCount>(st.iterations(), 1)), 1);
  st.counters["key_heads"] = double(v == Var::DeltaGva || v == Var::KdaGva ? H / 2 : H);
  st.counters["ws_bytes"] = double(ws.bytes());
  st.counters["state_bytes"] = double(H * D * D * Index(sizeof(float)));
}

// Scalar delta, KDA, GVA, repeat + call and plain causal back to back, rotating the order.
void BM_pair(benchmark::State& st, Index H, Index D) {
  const Index N = st.range(0);
  lb::set_threads(1);
  Problem p(N, H, D);
  linattn::MultiHeadWorkspace<float> ws;
  constexpr int kCalls = 6;
  const Var vars[kCalls] = {Var::Delta,       Var::Kda,    Var::DeltaGva,
                            Var::DeltaRepeat, Var::Causal, Var::KdaChunked};
  for (Var v : vars) call(p, v, ws);
  std::vector<double> tk[kCalls], r_kda, r_gva, r_dc, r_kc, r_ck, c_kda, c_gva, c_dc, c_kc, c_ck;
  int first = 0;
  bool finite = true;
  for (auto _ : st) {
    double t[kCalls] = {}, c[kCalls] = {};
    for (int j = 0; j < kCalls; ++j) {
      const int k = (first + j) % kCalls;
      const double c0 = lb::thread_cpu_seconds();
      const auto t0 = std::chrono::steady_clock::now();
      call(p, vars[k], ws);
      benchmark::ClobberMemory();
      t[k] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      c[k] = lb::thread_cpu_seconds() - c0;
      finite = finite && lb::all_finite(p.out.topRows(1));
    }
    double total = 0;
    for (int k = 0; k < kCalls; ++k) total += t[k], tk[k].push_back(t[k]);
    st.SetIterationTime(total);
    r_kda.push_back(t[1] / t[0]);
    r_gva.push_back(t[2] / t[3]);
    r_dc.push_back(t[0] / t[4]);
    r_kc.push_back(t[1] / t[4]);
    r_ck.push_back(t[5] / t[1]);
    c_kda.push_back(c[1] / c[0]);
    c_gva.push_back(c[2] / c[3]);
    c_dc.push_back(c[0] / c[4]);
    c_kc.push_back(c[1] / c[4]);
    c_ck.push_back(c[5] / c[1]);
    first = (first + 1) % kCalls;
  }
  if (!finite || !lb::all_finite(p.out)) st.SkipWithError("non-finite output");
  const char* ms[kCalls] = {"delta_ms",  "kda_ms",    "gva_ms",
                            "repeat_ms", "causal_ms", "kda_chunked_ms"};
  for (int k = 0; k < kCalls; ++k) st.counters[ms[k]] = 1e3 * lb::median(tk[k]);
  st.counters["kda_vs_delta"] = lb::median(r_kda);
  st.counters["kda_vs_delta_cpu"] = lb::median(c_kda);
  st.counters["gva_vs_repeat"] = lb::median(r_gva);
  st.counters["gva_vs_repeat_cpu"] = lb::median(c_gva);
  st.counters["delta_vs_causal"] = lb::median(r_dc);
  st.counters["delta_vs_causal_cpu"] = lb::median(c_dc);
  st.counters["kda_vs_causal"] = lb::median(r_kc);
  st.counters["kda_vs_causal_cpu"] = lb::median(c_kc);
  st.counters["chunked_vs_kda"] = lb::median(r_ck);
  st.counters["chunked_vs_kda_cpu"] = lb::median(c_ck);
  const double flops = useful_flops(N, H, D);
  st.counters["flops"] = flops;
  const double peak = lb::fma_peak_now(1);
  st.counters["peak_GFLOPs"] = peak;
  st.counters["delta_frac_of_peak"] = flops / lb::median(tk[0]) * 1e-9 / peak;
  st.counters["kda_frac_of_peak"] = flops / lb::median(tk[1]) * 1e-9 / peak;
  st.counters["N"] = double(N);
  st.counters["D"] = double(D);
  st.counters["H"] = double(H);
}

#endif  // LINATTN_BENCH_KDA

void register_all(const lb::Profile& p) {
#if LINATTN_BENCH_KDA
  const KdaSizes s = kda_sizes(p);
  const double peak = lb::fma_peak_gflops<float>();  // at the start, for the context
  benchmark::AddCustomContext("linattn_fma_peak_f32_gflops", std::to_string(peak));
  for (Index H : s.heads)
    for (Index D : s.dims) {
      const std::string tail =
          lb::key("dtype", "f32") + lb::key("H", H) + lb::key("D", D) + lb::key("thr", 1);
      for (Var v : {Var::Causal, Var::Delta, Var::Kda, Var::KdaChunked, Var::DeltaGva,
                    Var::DeltaRepeat, Var::KdaGva, Var::KdaRepeat})
        lb::add(std::string("kda_prefill") + lb::key("var", var_name(v)) + tail, s.ns, "N",
                benchmark::oN, [v, H, D](benchmark::State& st) { BM_prefill(st, v, H, D); });
      const std::string name = "kda_pair" + tail;
      auto* b = benchmark::RegisterBenchmark(name.c_str(),
                                             [H, D](benchmark::State& st) { BM_pair(st, H, D); });
      b->ArgName("N")
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(s.pair_iterations);
      for (Index n : s.pair_ns) b->Arg(int64_t(n));
    }
#else
  (void)p;
#endif
}

std::string notes(const lb::Profile& p) {
  const KdaSizes s = kda_sizes(p);
#if LINATTN_BENCH_KDA
  return "KDA and shared key heads (float, 1 thread, column-major packed inputs, "
         "L2Normalize<>(1e-6), "
         "scale 1/sqrt(D), beta in [0, 1], log-decays in [-0.1, 0]): H = " +
         lb::join(s.heads) + ", D = M = " + lb::join(s.dims) + ", N = " + lb::join(s.ns) +
         "; KDA (log_a N x H*D; Auto, and Chunked: the per-channel chunked form), scalar decay (N "
         "x H), plain causal (Identity), GVA key_heads = H/2 "
         "and the same with the keys repeated (copy timed), for both decays; call-by-call pairs at "
         "N = " +
         lb::join(s.pair_ns) + " (" + std::to_string(s.pair_iterations) +
         " iterations); FMA peak measured in the process.";
#else
  (void)s;
  return "not measured: this build has no linattn/delta.hpp.";
#endif
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
