// Decayed and gated linear attention (gated_attention.hpp, recurrent_gated_attention.hpp),
// float, one thread (ParallelOptions{1}), Identity map, normalize = false, scale 1/√D:
//
//   - chunked prefill, H = 8 heads packed side by side, D = M ∈ {64, 128}, both gate kinds:
//       gate:scalar   log_gates N×H     (one log-decay per head and token: RetNet, Mamba-2)
//       gate:feature  log_gates N×(H·F) (one per head, token and feature: GLA)
//     on an Eigen::Map of row-major packed N×(H·D) memory (layout:row, what users pass; the gates
//     row-major too) and on column-major packed matrices (layout:col), with GatedOptions::algorithm
//     Auto, Chunked and Recurrent (alg:auto|chunked|recurrent: the numbers to tune Auto's
//     dispatch from), against plain multihead_causal_linear_attention of the same shape
//     (gt_causal, EluPlusOne, CausalOptions{}) and the suite's GEMM reference (gt_gemm_linear:
//     LinearGemm of bench_common.hpp over the same 8 heads), all in this program;
//   - the chunk size of the chunked algorithm (alg:chunked/chunk:C, C = 32 … 128) at one N;
//   - the targets call by call (gt_pair): each iteration makes the plain causal call and both
//     gated calls back to back, rotating which goes first, so that the drift of a shared machine
//     falls on all three; counters plain_ms, scalar_ms, feature_ms (medians) and
//     scalar_vs_plain, feature_vs_plain (medians of the per-iteration ratios of wall times;
//     targets ≤ 1.3 and ≤ 2), and the same of the thread's CPU times (*_vs_plain_cpu), which a
//     busy machine disturbs less;
//   - the decode step (gt_decode_pair, one head, D = M ∈ {64, 128}): blocks of kDecodeSteps
//     steps of RecurrentLinearAttention<EluPlusOne, float> and RecurrentGatedAttention<Identity,
//     float> (scalar and per-feature gate), timed block by block in rotating order; counters
//     plain_ns, scalar_ns, feature_ns per step and scalar_vs_plain, feature_vs_plain (target
//     ≤ 1.2; *_vs_plain_cpu from CPU times);
//   - gradients (gt_train, H = 8, D = M = 64, one N, out-parameter forms with a reused
//     MultiHeadWorkspace on both layouts, gradients in the inputs' layout):
//     multihead_gated_linear_attention_backward (pass:bwd) and its forward (pass:fwd) for both
//     gate kinds, against multihead_causal_linear_attention_backward and its forward (gate:none,
//     EluPlusOne). Registered only when the gated backward exists in the headers.
//
// Gates: log-decays uniform in [−0.1, 0] (mild gates, as trained models have them; a strong-gate
// run is not part of this program). Useful flops per head 4·N·F·M as for causal linear attention
// (bench_common.hpp); the gradients 8·N·F·M (bench_backward.cpp). Names follow bench_common.hpp:
//   gt_gated/gate:scalar/phi:identity/alg:auto/layout:row/dtype:f32/H:8/D:64/thr:1/N:4096
// The profile's sizes are set by gated_sizes() below. Everything gated is left out (the program
// then only says so) until the headers exist.
#include <linattn/linattn.hpp>

#if __has_include(<linattn/gated_attention.hpp>)
#include <linattn/gated_attention.hpp>
#define LINATTN_BENCH_GATED 1
#else
#define LINATTN_BENCH_GATED 0
#endif
#if LINATTN_BENCH_GATED && __has_include(<linattn/recurrent_gated_attention.hpp>)
#include <linattn/recurrent_gated_attention.hpp>
#define LINATTN_BENCH_GATED_DECODE 1
#else
#define LINATTN_BENCH_GATED_DECODE 0
#endif
#if LINATTN_BENCH_GATED && __has_include(<linattn/gated_attention_backward.hpp>)
#include <linattn/gated_attention_backward.hpp>
#endif
#if LINATTN_BENCH_GATED && __has_include(<linattn/identity.hpp>)
#include <linattn/identity.hpp>
#endif

#include "bench_common.hpp"

#include <chrono>
#include <cmath>
#include <ctime>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lb = linattn_bench;
using lb::Index;

namespace {

template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
template <class T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

constexpr Index kHeads = 8;
constexpr Index kTrainDim = 64;
constexpr Index kDecodeSteps = 64;  // steps per timed block of the decode pair
constexpr Index kRing = 64;         // distinct decode tokens cycled through

// Sizes of this program per profile.
struct GatedSizes {
  std::vector<Index> ns;           // prefill sweep
  std::vector<Index> dims;         // D = M
  bool algs_on_col = false;        // Chunked / Recurrent on column-major inputs too (else row only)
  Index chunk_n = 0;               // N of the chunk-size sweep
  std::vector<Index> chunks;       // its chunk sizes
  std::vector<Index> pair_ns;      // N of the call-by-call target pairs
  int pair_iterations = 0;
  int decode_iterations = 0;       // blocks of kDecodeSteps steps per kind
  Index train_n = 0;               // N of the gradients
  int train_iterations = 1;        // calls per gradient benchmark
};

GatedSizes gated_sizes(const lb::Profile& p) {
  GatedSizes s;
  s.dims = {64, 128};
  s.chunks = {32, 48, 64, 96, 128};
  if (p.name == "full") {
    s.ns = lb::powers_of_two(256, 65536);
    s.algs_on_col = true;
    s.chunk_n = 16384;
    s.pair_ns = {16384, 65536};
    s.pair_iterations = 10;
    s.decode_iterations = 400;
    s.train_n = 16384;
    s.train_iterations = 5;
  } else if (p.name == "smoke") {
    s.ns = {256};
    s.chunks = {32, 64};
    s.chunk_n = 256;
    s.pair_ns = {256};
    s.pair_iterations = 2;
    s.decode_iterations = 2;
    s.train_n = 256;
  } else {  // quick
    s.ns = lb::powers_of_two(256, 16384);
    s.chunk_n = 4096;
    s.pair_ns = {16384};
    s.pair_iterations = 8;
    s.decode_iterations = 200;
    s.train_n = 4096;
    s.train_iterations = 5;
  }
  return s;
}

void gemm_reference(benchmark::State& st, Index D) {
  lb::run_linear_gemm<float>(st, kHeads, D, 1);
}

#if LINATTN_BENCH_GATED

enum class Gate { None, Scalar, Feature };
enum class Layout { Col, Row };

const char* gate_name(Gate g) {
  switch (g) {
    case Gate::None: return "none";
    case Gate::Scalar: return "scalar";
    case Gate::Feature: return "feature";
  }
  return "?";
}

const char* alg_name(linattn::CausalAlgorithm a) {
  switch (a) {
    case linattn::CausalAlgorithm::Auto: return "auto";
    case linattn::CausalAlgorithm::Chunked: return "chunked";
    case linattn::CausalAlgorithm::Recurrent: return "recurrent";
  }
  return "?";
}

// Log-decays uniform in [−0.1, 0]: rows × cols, column-major.
template <class T>
Mat<T> log_gates(Index rows, Index cols, std::uint64_t seed) {
  return (T(-0.05) * (lb::random_matrix<T>(rows, cols, seed).array() + T(1))).matrix();
}

// The inputs of one multi-head prefill (H heads of D = M), on both layouts: the row-major views
// are Maps of the same buffers (other values than the column-major view, the same work).
template <class T>
struct Problem {
  Index N, H, D, M;
  Mat<T> Q, K, V, Gs, Gf, out;
  Eigen::Map<const RowMat<T>> Qr, Kr, Vr, Gsr, Gfr;
  Eigen::Map<RowMat<T>> Or;
  Problem(Index n, Index heads, Index d)
      : N(n), H(heads), D(d), M(d),
        Q(lb::random_matrix<T>(n, heads * d, 51)),
        K(lb::random_matrix<T>(n, heads * d, 52)),
        V(lb::random_matrix<T>(n, heads * d, 53)),
        Gs(log_gates<T>(n, heads, 54)),
        Gf(log_gates<T>(n, heads * d, 55)),  // F = D for Identity
        out(Mat<T>::Zero(n, heads * d)),
        Qr(Q.data(), n, heads * d), Kr(K.data(), n, heads * d), Vr(V.data(), n, heads * d),
        Gsr(Gs.data(), n, heads), Gfr(Gf.data(), n, heads * d),
        Or(out.data(), n, heads * d) {}
};

linattn::GatedOptions gated_options(Index D, linattn::CausalAlgorithm alg, Index chunk) {
  linattn::GatedOptions o;
  o.normalize = false;
  o.scale = 1.0 / std::sqrt(double(D));
  o.algorithm = alg;
  o.chunk_size = chunk;
  return o;
}

// One call of the out-parameter form: gated (Identity) or plain causal (EluPlusOne, defaults).
template <class T>
void prefill_call(Problem<T>& p, Gate gate, Layout layout, const linattn::GatedOptions& opts,
                  linattn::MultiHeadWorkspace<T>& ws) {
  linattn::ParallelOptions par;
  par.num_threads = 1;
  const linattn::Identity id{};
  if (gate == Gate::None) {
    const linattn::EluPlusOne elu{};
    if (layout == Layout::Row)
      linattn::multihead_causal_linear_attention(p.Qr, p.Kr, p.Vr, p.H, elu, p.Or, ws,
                                                 linattn::CausalOptions{}, par);
    else
      linattn::multihead_causal_linear_attention(p.Q, p.K, p.V, p.H, elu, p.out, ws,
                                                 linattn::CausalOptions{}, par);
  } else if (layout == Layout::Row) {
    if (gate == Gate::Scalar)
      linattn::multihead_gated_linear_attention(p.Qr, p.Kr, p.Vr, p.Gsr, p.H, id, p.Or, ws, opts, par);
    else
      linattn::multihead_gated_linear_attention(p.Qr, p.Kr, p.Vr, p.Gfr, p.H, id, p.Or, ws, opts, par);
  } else {
    if (gate == Gate::Scalar)
      linattn::multihead_gated_linear_attention(p.Q, p.K, p.V, p.Gs, p.H, id, p.out, ws, opts, par);
    else
      linattn::multihead_gated_linear_attention(p.Q, p.K, p.V, p.Gf, p.H, id, p.out, ws, opts, par);
  }
}

void BM_prefill(benchmark::State& st, Gate gate, Index D, Layout layout,
                linattn::CausalAlgorithm alg, Index chunk) {
  using T = float;
  const Index N = st.range(0), H = kHeads;
  lb::set_threads(1);
  Problem<T> p(N, H, D);
  linattn::MultiHeadWorkspace<T> ws;
  const linattn::GatedOptions opts = gated_options(D, alg, chunk);
  const double flops = double(H) * lb::linear_flops(N, N, D, D);
  if (lb::worth_warming_up(flops)) prefill_call(p, gate, layout, opts, ws);
  for (auto _ : st) {
    prefill_call(p, gate, layout, opts, ws);
    benchmark::DoNotOptimize(p.out.data());
    benchmark::ClobberMemory();
  }
  if (!lb::all_finite(p.out)) st.SkipWithError("non-finite output");
  st.SetComplexityN(N);
  lb::set_common_counters(st, flops, N, D, D, H, 1);
  st.counters["ws_bytes"] = double(ws.bytes());
  // Plain causal: one F×M + F state per head, as bench_multihead counts it (the gated kernels'
  // states are their business and not counted).
  if (gate == Gate::None) st.counters["state_bytes"] = double(H * (D * D + D) * Index(sizeof(T)));
}

// Plain causal, scalar-gated and per-feature-gated calls back to back in every iteration,
// rotating which goes first. The reported (manual) time is that of the three calls.
void BM_pair(benchmark::State& st, Index D, Layout layout) {
  using T = float;
  const Index N = st.range(0), H = kHeads;
  lb::set_threads(1);
  Problem<T> p(N, H, D);
  linattn::MultiHeadWorkspace<T> ws;
  const linattn::GatedOptions opts = gated_options(D, linattn::CausalAlgorithm::Auto, 0);
  const Gate gates[3] = {Gate::None, Gate::Scalar, Gate::Feature};
  for (Gate g : gates) prefill_call(p, g, layout, opts, ws);  // sizes the workspace
  std::vector<double> t_plain, t_scalar, t_feature, r_scalar, r_feature, c_scalar, c_feature;
  int first = 0;
  bool finite = true;
  for (auto _ : st) {
    double t[3] = {0, 0, 0}, c[3] = {0, 0, 0};
    for (int j = 0; j < 3; ++j) {
      const int k = (first + j) % 3;
      const double c0 = lb::thread_cpu_seconds();
      const auto t0 = std::chrono::steady_clock::now();
      prefill_call(p, gates[k], layout, opts, ws);
      benchmark::ClobberMemory();
      t[k] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      c[k] = lb::thread_cpu_seconds() - c0;
      finite = finite && lb::all_finite(p.out.topRows(1));
    }
    st.SetIterationTime(t[0] + t[1] + t[2]);
    t_plain.push_back(t[0]);
    t_scalar.push_back(t[1]);
    t_feature.push_back(t[2]);
    r_scalar.push_back(t[1] / t[0]);
    r_feature.push_back(t[2] / t[0]);
    c_scalar.push_back(c[1] / c[0]);
    c_feature.push_back(c[2] / c[0]);
    first = (first + 1) % 3;
  }
  st.counters["scalar_vs_plain_cpu"] = lb::median(c_scalar);
  st.counters["feature_vs_plain_cpu"] = lb::median(c_feature);
  if (!finite || !lb::all_finite(p.out)) st.SkipWithError("non-finite output");
  st.counters["plain_ms"] = 1e3 * lb::median(t_plain);
  st.counters["scalar_ms"] = 1e3 * lb::median(t_scalar);
  st.counters["feature_ms"] = 1e3 * lb::median(t_feature);
  st.counters["scalar_vs_plain"] = lb::median(r_scalar);
  st.counters["feature_vs_plain"] = lb::median(r_feature);
  st.counters["N"] = double(N);
  st.counters["D"] = double(D);
  st.counters["H"] = double(H);
  st.SetComplexityN(N);
}

#if LINATTN_BENCH_GATED_DECODE
// Blocks of kDecodeSteps steps of the plain recurrent step and of both gated steps, timed block by
// block in rotating order (one head, D = M).
void BM_decode_pair(benchmark::State& st, Index D) {
  using T = float;
  const Index M = D;
  const Mat<T> q = lb::random_matrix<T>(D, kRing, 31), k = lb::random_matrix<T>(D, kRing, 32),
               v = lb::random_matrix<T>(M, kRing, 33);
  const Mat<T> gs = log_gates<T>(1, kRing, 34), gf = log_gates<T>(D, kRing, 35);
  Eigen::Matrix<T, Eigen::Dynamic, 1> out(M);
  linattn::RecurrentLinearAttention<linattn::EluPlusOne, T> plain(D, M);
  const linattn::GatedOptions opts = gated_options(D, linattn::CausalAlgorithm::Auto, 0);
  linattn::RecurrentGatedAttention<linattn::Identity, T> scalar(D, M, opts), feature(D, M, opts);
  Index t = 0;
  bool finite = true;
  const auto block = [&](int kind) {
    for (Index s = 0; s < kDecodeSteps; ++s) {
      switch (kind) {
        case 0: plain.step(q.col(t), k.col(t), v.col(t), out); break;
        case 1: scalar.step(q.col(t), k.col(t), v.col(t), gs.col(t), out); break;
        default: feature.step(q.col(t), k.col(t), v.col(t), gf.col(t), out); break;
      }
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
      t = (t + 1) % kRing;
    }
    finite = finite && lb::all_finite(out);
  };
  for (int w = 0; w < 4; ++w)
    for (int kind = 0; kind < 3; ++kind) block(kind);  // warm-up: caches, clock
  std::vector<double> tk[3], r_scalar, r_feature, c_scalar, c_feature;
  int first = 0;
  for (auto _ : st) {
    double tm[3] = {0, 0, 0}, c[3] = {0, 0, 0};
    for (int j = 0; j < 3; ++j) {
      const int kind = (first + j) % 3;
      const double c0 = lb::thread_cpu_seconds();
      const auto t0 = std::chrono::steady_clock::now();
      block(kind);
      tm[kind] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      c[kind] = lb::thread_cpu_seconds() - c0;
    }
    st.SetIterationTime(tm[0] + tm[1] + tm[2]);
    for (int kind = 0; kind < 3; ++kind) tk[kind].push_back(tm[kind] / double(kDecodeSteps));
    r_scalar.push_back(tm[1] / tm[0]);
    r_feature.push_back(tm[2] / tm[0]);
    c_scalar.push_back(c[1] / c[0]);
    c_feature.push_back(c[2] / c[0]);
    first = (first + 1) % 3;
  }
  st.counters["scalar_vs_plain_cpu"] = lb::median(c_scalar);
  st.counters["feature_vs_plain_cpu"] = lb::median(c_feature);
  if (!finite) st.SkipWithError("non-finite output");
  const double ns[3] = {1e9 * lb::median(tk[0]), 1e9 * lb::median(tk[1]), 1e9 * lb::median(tk[2])};
  st.counters["plain_ns"] = ns[0];
  st.counters["scalar_ns"] = ns[1];
  st.counters["feature_ns"] = ns[2];
  st.counters["scalar_vs_plain"] = lb::median(r_scalar);
  st.counters["feature_vs_plain"] = lb::median(r_feature);
  st.counters["steps"] = double(kDecodeSteps);
  st.counters["D"] = double(D);
  st.counters["M"] = double(M);
  // The plain state keeps S, z and their compensated low parts; the gated one's size is the
  // class's business (not counted here).
  st.counters["plain_state_bytes"] = double(2 * (D * M + D) * Index(sizeof(T)));
}
#endif  // LINATTN_BENCH_GATED_DECODE

// ---------------------------------------------------------------------------------------------
// Gradients, when multihead_gated_linear_attention_backward exists (detected by argument-
// dependent lookup through the map's namespace, so that this file compiles before it does).
// ---------------------------------------------------------------------------------------------

template <class Phi, class = void>
struct has_gated_backward : std::false_type {};
template <class Phi>
struct has_gated_backward<
    Phi, std::void_t<decltype(multihead_gated_linear_attention_backward(
             std::declval<const Mat<float>&>(), std::declval<const Mat<float>&>(),
             std::declval<const Mat<float>&>(), std::declval<const Mat<float>&>(),
             std::declval<const Mat<float>&>(), Index(1), std::declval<const Phi&>(),
             std::declval<Mat<float>&>(), std::declval<Mat<float>&>(), std::declval<Mat<float>&>(),
             std::declval<Mat<float>&>(), std::declval<linattn::MultiHeadWorkspace<float>&>(),
             std::declval<const linattn::GatedOptions&>(),
             std::declval<const linattn::ParallelOptions&>()))>> : std::true_type {};

constexpr bool kHasGatedBackward = has_gated_backward<linattn::Identity>::value;

enum class Pass { Fwd, Bwd };

// The out-parameter forms with a reused MultiHeadWorkspace (as bench_backward measures the
// plain kernels), gradients written into the layout of the inputs.
template <class Phi>
void BM_train(benchmark::State& st, Gate gate, Pass pass, Layout layout) {
  using T = float;
  const Index N = st.range(0), H = kHeads, D = kTrainDim, M = kTrainDim;
  lb::set_threads(1);
  Problem<T> p(N, H, D);
  const Index gcols = gate == Gate::Feature ? H * D : H;
  const Mat<T> dOut = lb::random_matrix<T>(N, H * M, 56);
  Mat<T> dQ = Mat<T>::Zero(N, H * D), dK = Mat<T>::Zero(N, H * D), dV = Mat<T>::Zero(N, H * M),
         dG = Mat<T>::Zero(N, gcols);
  const Eigen::Map<const RowMat<T>> dOutr(dOut.data(), N, H * M);
  Eigen::Map<RowMat<T>> dQr(dQ.data(), N, H * D), dKr(dK.data(), N, H * D), dVr(dV.data(), N, H * M),
      dGr(dG.data(), N, gcols);
  linattn::MultiHeadWorkspace<T> ws;
  linattn::ParallelOptions par;
  par.num_threads = 1;
  const linattn::GatedOptions opts = gated_options(D, linattn::CausalAlgorithm::Auto, 0);
  const Phi phi{};
  const auto run = [&](const auto& q, const auto& k, const auto& v, const auto& g, const auto& d,
                       auto& o, auto& dq, auto& dk, auto& dv, auto& dg) {
    if constexpr (std::is_same_v<Phi, linattn::EluPlusOne>) {
      (void)g;
      (void)dg;
      if (pass == Pass::Fwd)
        linattn::multihead_causal_linear_attention(q, k, v, H, phi, o, ws, linattn::CausalOptions{}, par);
      else
        linattn::multihead_causal_linear_attention_backward(q, k, v, d, H, phi, dq, dk, dv, ws,
                                                            linattn::CausalOptions{}, par);
    } else {
      if (pass == Pass::Fwd)
        linattn::multihead_gated_linear_attention(q, k, v, g, H, phi, o, ws, opts, par);
      else  // unqualified: found by argument-dependent lookup at instantiation (see above)
        multihead_gated_linear_attention_backward(q, k, v, g, d, H, phi, dq, dk, dv, dg, ws, opts, par);
    }
  };
  const auto call = [&] {
    if (layout == Layout::Row) {
      if (gate == Gate::Feature)
        run(p.Qr, p.Kr, p.Vr, p.Gfr, dOutr, p.Or, dQr, dKr, dVr, dGr);
      else
        run(p.Qr, p.Kr, p.Vr, p.Gsr, dOutr, p.Or, dQr, dKr, dVr, dGr);
    } else {
      if (gate == Gate::Feature)
        run(p.Q, p.K, p.V, p.Gf, dOut, p.out, dQ, dK, dV, dG);
      else
        run(p.Q, p.K, p.V, p.Gs, dOut, p.out, dQ, dK, dV, dG);
    }
  };
  const double flops = double(H) * (pass == Pass::Fwd ? lb::linear_flops(N, N, D, M)
                                                      : 8.0 * double(N) * double(D) * double(M));
  if (lb::worth_warming_up(flops)) call();
  for (auto _ : st) {
    call();
    benchmark::DoNotOptimize(p.out.data());
    benchmark::DoNotOptimize(dQ.data());
    benchmark::ClobberMemory();
  }
  if (pass == Pass::Fwd ? !lb::all_finite(p.out)
                        : !(lb::all_finite(dQ) && lb::all_finite(dK) && lb::all_finite(dV) && lb::all_finite(dG)))
    st.SkipWithError("non-finite result");
  st.SetComplexityN(N);
  lb::set_common_counters(st, flops, N, D, M, H, 1);
  st.counters["ws_bytes"] = double(ws.bytes());
}

// A template, so that BM_train<Identity> is never instantiated without the gated backward.
template <class Phi>
void register_train(const GatedSizes& s) {
  if constexpr (!has_gated_backward<linattn::Identity>::value) {
    (void)s;
    return;
  } else {
  const std::string tail = lb::key("dtype", "f32") + lb::key("H", kHeads) +
                           lb::key("D", kTrainDim) + lb::key("thr", 1);
  constexpr bool plain = std::is_same_v<Phi, linattn::EluPlusOne>;
  const std::vector<Gate> gates =
      plain ? std::vector<Gate>{Gate::None} : std::vector<Gate>{Gate::Scalar, Gate::Feature};
  for (Gate g : gates)
    for (Pass pass : {Pass::Fwd, Pass::Bwd})
      for (Layout l : {Layout::Row, Layout::Col})
        lb::add("gt_train" + lb::key("gate", gate_name(g)) + lb::key("phi", plain ? "elu" : "identity") +
                    lb::key("pass", pass == Pass::Fwd ? "fwd" : "bwd") +
                    lb::key("layout", l == Layout::Row ? "row" : "col") + tail,
                {s.train_n}, "N", benchmark::oN,
                [g, pass, l](benchmark::State& st) { BM_train<Phi>(st, g, pass, l); })
            // A fixed count: the minimum time would give a backward call of 0.1-0.3 s one iteration.
            ->Iterations(s.train_iterations);
  }
}

#endif  // LINATTN_BENCH_GATED

void register_all(const lb::Profile& p) {
  const GatedSizes s = gated_sizes(p);
  for (Index D : s.dims) {
    const std::string tail = lb::key("dtype", "f32") + lb::key("H", kHeads) + lb::key("D", D) + lb::key("thr", 1);
    lb::add("gt_gemm_linear" + tail, s.ns, "N", benchmark::oN,
            [D](benchmark::State& st) { gemm_reference(st, D); });
#if LINATTN_BENCH_GATED
    using A = linattn::CausalAlgorithm;
    for (Layout l : {Layout::Row, Layout::Col}) {
      const std::string lay = lb::key("layout", l == Layout::Row ? "row" : "col");
      lb::add("gt_causal/phi:elu/alg:auto" + lay + tail, s.ns, "N", benchmark::oN,
              [D, l](benchmark::State& st) { BM_prefill(st, Gate::None, D, l, A::Auto, 0); });
      for (Gate g : {Gate::Scalar, Gate::Feature})
        for (A a : {A::Auto, A::Chunked, A::Recurrent}) {
          if (a != A::Auto && l == Layout::Col && !s.algs_on_col) continue;
          lb::add("gt_gated" + lb::key("gate", gate_name(g)) + "/phi:identity" + lb::key("alg", alg_name(a)) +
                      lay + tail,
                  s.ns, "N", benchmark::oN,
                  [g, D, l, a](benchmark::State& st) { BM_prefill(st, g, D, l, a, 0); });
        }
    }
    // Chunk sizes of the chunked algorithm at one N, row-major.
    for (Gate g : {Gate::Scalar, Gate::Feature})
      for (Index c : s.chunks)
        lb::add("gt_gated" + lb::key("gate", gate_name(g)) + "/phi:identity/alg:chunked" + lb::key("chunk", c) +
                    lb::key("layout", "row") + tail,
                {s.chunk_n}, "N", benchmark::oN,
                [g, D, c](benchmark::State& st) { BM_prefill(st, g, D, Layout::Row, A::Chunked, c); });
    // The targets, call by call. Not lb::add: the time is the manual one (all three calls).
    for (Layout l : {Layout::Row, Layout::Col}) {
      const std::string name = "gt_pair/phi:identity/alg:auto" +
                               lb::key("layout", l == Layout::Row ? "row" : "col") + tail;
      auto* b = benchmark::RegisterBenchmark(name.c_str(), [D, l](benchmark::State& st) { BM_pair(st, D, l); });
      b->ArgName("N")->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(s.pair_iterations);
      for (Index n : s.pair_ns) b->Arg(int64_t(n));
    }
#if LINATTN_BENCH_GATED_DECODE
    {
      const std::string name = "gt_decode_pair/phi:identity" + lb::key("dtype", "f32") + lb::key("H", 1) +
                               lb::key("D", D) + lb::key("thr", 1);
      benchmark::RegisterBenchmark(name.c_str(), [D](benchmark::State& st) { BM_decode_pair(st, D); })
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond)
          ->Iterations(s.decode_iterations);
    }
#endif
#endif  // LINATTN_BENCH_GATED
  }
#if LINATTN_BENCH_GATED
  register_train<linattn::Identity>(s);
  register_train<linattn::EluPlusOne>(s);
#endif
}

std::string notes(const lb::Profile& p) {
  const GatedSizes s = gated_sizes(p);
  std::string n = "Gated linear attention (float, 1 thread, Identity, normalize = false, log-gates in [-0.1, 0]): ";
#if LINATTN_BENCH_GATED
  n += "prefill H = 8, D = M = " + lb::join(s.dims) + ", N = " + lb::join(s.ns) +
       ", scalar and per-feature gates, Auto on row- and column-major packed inputs, Chunked and Recurrent on " +
       (s.algs_on_col ? "both layouts" : "row-major only") + ", vs multihead_causal_linear_attention (EluPlusOne) "
       "and the GEMM reference; chunk sizes " + lb::join(s.chunks) + " at N = " + std::to_string(s.chunk_n) +
       "; call-by-call target pairs at N = " + lb::join(s.pair_ns) + " (" + std::to_string(s.pair_iterations) +
       " iterations)";
#if LINATTN_BENCH_GATED_DECODE
  n += "; decode step pairs, one head, " + std::to_string(s.decode_iterations) + " blocks of " +
       std::to_string(kDecodeSteps) + " steps per kind";
#else
  n += "; decode step not measured (no linattn/recurrent_gated_attention.hpp in this build)";
#endif
  if (kHasGatedBackward)
    n += "; gradients (out-parameter forms) at N = " + std::to_string(s.train_n) + ", D = M = 64.";
  else
    n += "; gradients not measured (no multihead_gated_linear_attention_backward in this build).";
#else
  n += "not measured: this build has no linattn/gated_attention.hpp (only the GEMM reference ran).";
#endif
  return n;
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
