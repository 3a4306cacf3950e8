// The delta rule (delta_rule.hpp, recurrent_delta_rule.hpp): DeltaNet and Gated DeltaNet,
// float, one thread (ParallelOptions{1}), L2Normalize<Silu> (Qwen3-Next's map), scale 1/√D, β
// uniform in [0, 1], log-decays log_a uniform in [−0.1, 0] (decay:on, Gated DeltaNet) or an N×0
// matrix (decay:off, DeltaNet):
//
//   - chunked prefill, H = 8 heads packed side by side, D = M ∈ {64, 128}: on an Eigen::Map of
//     row-major packed N×(H·D) memory (layout:row, what users pass; β and log_a row-major too) and
//     on column-major packed matrices (layout:col), with DeltaOptions::algorithm Auto, Chunked and
//     Recurrent (alg:auto|chunked|recurrent: the numbers to tune Auto's dispatch from), against
//     plain multihead_causal_linear_attention of the same shape (dl_causal, EluPlusOne,
//     CausalOptions{}) and the suite's GEMM reference (dl_gemm_linear: LinearGemm of
//     bench_common.hpp over the same 8 heads), all in this program;
//   - the chunk size of the chunked algorithm (alg:chunked/chunk:C, C = 16 … 128) at one N;
//   - the targets call by call (dl_pair): each iteration makes the plain causal call, the delta
//     rule Chunked and the delta rule Recurrent (token by token) back to back, rotating which goes
//     first, so that the drift of a shared machine falls on all three; counters plain_ms,
//     chunked_ms, recurrent_ms (medians) and chunked_vs_plain (target ≤ 3), recurrent_vs_chunked
//     (target ≥ 5): medians of the per-iteration ratios of wall times, and the same of the
//     thread's CPU times (*_cpu), which a busy machine disturbs less; linattn's Recurrent is
//     itself one fused pass over the state per token, so that ratio compares two fast forms;
//   - the token-by-token recurrence as a user writes it with Eigen (dl_naive_pair, one head):
//     against Chunked and Auto on the same head, naive_vs_chunked and naive_vs_auto;
//   - the decode step (dl_decode_pair, one head, D = M ∈ {64, 128}): blocks of kDecodeSteps steps
//     of RecurrentLinearAttention<EluPlusOne, float> and RecurrentDeltaRule<L2Normalize<Silu>,
//     float> (with log_a), timed block by block in rotating order; counters plain_ns, delta_ns per
//     step and delta_vs_plain (target ≤ 1.5; delta_vs_plain_cpu from CPU times).
//
// Useful flops per head 4·N·F·M, as for causal linear attention (bench_common.hpp), so that GFLOP/s
// of the delta rule and of plain causal compare as their times do (the delta rule's recurrence
// itself does 6·N·F·M: kᵀS, the rank-1 update and qᵀS); items/s counts tokens (N per call). Names
// follow bench_common.hpp:
//   dl_delta/phi:l2silu/decay:on/alg:auto/layout:row/dtype:f32/H:8/D:128/thr:1/N:16384
// The profile's sizes are set by delta_sizes() below. Everything delta is left out (the program
// then only says so) until the headers exist.
#include <linattn/linattn.hpp>

#if __has_include(<linattn/delta_rule.hpp>) && __has_include(<linattn/recurrent_delta_rule.hpp>)
#include <linattn/delta_rule.hpp>
#include <linattn/recurrent_delta_rule.hpp>
#include <linattn/l2_normalize.hpp>
#include <linattn/silu.hpp>
#define LINATTN_BENCH_DELTA 1
#else
#define LINATTN_BENCH_DELTA 0
#endif

#include "bench_common.hpp"

#include <chrono>
#include <cmath>
#include <ctime>
#include <string>
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
constexpr Index kDecodeSteps = 64;  // steps per timed block of the decode pair
constexpr Index kRing = 64;         // distinct decode tokens cycled through

// Sizes of this program per profile.
struct DeltaSizes {
  std::vector<Index> ns;           // prefill sweep
  std::vector<Index> dims;         // D = M
  bool algs_on_col = false;        // Chunked / Recurrent on column-major inputs too (else row only)
  bool no_decay_algs = false;      // Chunked / Recurrent without decay too (else Auto only)
  Index chunk_n = 0;               // N of the chunk-size sweep
  std::vector<Index> chunks;       // its chunk sizes
  std::vector<Index> pair_ns;      // N of the call-by-call target pairs
  bool pairs_on_col = false;       // pairs on column-major inputs too (else row only)
  int pair_iterations = 0;
  int decode_iterations = 0;       // blocks of kDecodeSteps steps per kind
  Index naive_n = 0;               // N of the naive-recurrence pair (one head)
};

DeltaSizes delta_sizes(const lb::Profile& p) {
  DeltaSizes s;
  s.dims = {64, 128};
  s.chunks = {16, 32, 48, 64, 96, 128};
  if (p.name == "full") {
    s.ns = lb::powers_of_two(256, 65536);
    s.algs_on_col = true;
    s.no_decay_algs = true;
    s.chunk_n = 16384;
    s.pair_ns = {16384, 65536};
    s.pairs_on_col = true;
    s.pair_iterations = 8;
    s.decode_iterations = 400;
    s.naive_n = 4096;
  } else if (p.name == "smoke") {
    s.ns = {256};
    s.chunks = {16, 64};
    s.chunk_n = 256;
    s.pair_ns = {256};
    s.pair_iterations = 2;
    s.decode_iterations = 2;
    s.naive_n = 64;
  } else {  // quick
    s.ns = lb::powers_of_two(256, 16384);
    s.chunk_n = 4096;
    s.pair_ns = {16384};
    s.pair_iterations = 6;
    s.decode_iterations = 200;
    s.naive_n = 2048;
  }
  return s;
}

void gemm_reference(benchmark::State& st, Index D) {
  lb::run_linear_gemm<float>(st, kHeads, D, 1);
}

#if LINATTN_BENCH_DELTA

using DeltaMap = linattn::L2Normalize<linattn::Silu>;

enum class Kind { Plain, Delta };
enum class Layout { Col, Row };

const char* alg_name(linattn::CausalAlgorithm a) {
  switch (a) {
    case linattn::CausalAlgorithm::Auto: return "auto";
    case linattn::CausalAlgorithm::Chunked: return "chunked";
    case linattn::CausalAlgorithm::Recurrent: return "recurrent";
  }
  return "?";
}

const char* layout_name(Layout l) { return l == Layout::Row ? "row" : "col"; }

// β uniform in [0, 1] and log-decays uniform in [−0.1, 0]: rows × cols, column-major.
template <class T>
Mat<T> betas(Index rows, Index cols, std::uint64_t seed) {
  return (T(0.5) * (lb::random_matrix<T>(rows, cols, seed).array() + T(1))).matrix();
}
template <class T>
Mat<T> log_decays(Index rows, Index cols, std::uint64_t seed) {
  return (T(-0.05) * (lb::random_matrix<T>(rows, cols, seed).array() + T(1))).matrix();
}

// The inputs of one multi-head prefill (H heads of D = M), on both layouts: the row-major views
// are Maps of the same buffers (other values than the column-major view, the same work). No
// decay: an N×0 log_a (column- or row-major).
template <class T>
struct Problem {
  Index N, H, D, M;
  Mat<T> Q, K, V, B, G, G0, out;
  RowMat<T> G0r;
  Eigen::Map<const RowMat<T>> Qr, Kr, Vr, Br, Gr;
  Eigen::Map<RowMat<T>> Or;
  Problem(Index n, Index heads, Index d)
      : N(n), H(heads), D(d), M(d),
        Q(lb::random_matrix<T>(n, heads * d, 61)),
        K(lb::random_matrix<T>(n, heads * d, 62)),
        V(lb::random_matrix<T>(n, heads * d, 63)),
        B(betas<T>(n, heads, 64)),
        G(log_decays<T>(n, heads, 65)),
        G0(n, 0),
        out(Mat<T>::Zero(n, heads * d)),
        G0r(n, 0),
        Qr(Q.data(), n, heads * d), Kr(K.data(), n, heads * d), Vr(V.data(), n, heads * d),
        Br(B.data(), n, heads), Gr(G.data(), n, heads),
        Or(out.data(), n, heads * d) {}
};

linattn::DeltaOptions delta_options(Index D, linattn::CausalAlgorithm alg, Index chunk) {
  linattn::DeltaOptions o;
  o.scale = 1.0 / std::sqrt(double(D));
  o.algorithm = alg;
  o.chunk_size = chunk;
  return o;
}

// One call of the out-parameter form: the delta rule (L2Normalize<Silu>, with or without decay)
// or plain causal linear attention (EluPlusOne, defaults).
template <class T>
void prefill_call(Problem<T>& p, Kind kind, bool decay, Layout layout,
                  const linattn::DeltaOptions& opts, linattn::MultiHeadWorkspace<T>& ws) {
  linattn::ParallelOptions par;
  par.num_threads = 1;
  if (kind == Kind::Plain) {
    const linattn::EluPlusOne elu{};
    if (layout == Layout::Row)
      linattn::multihead_causal_linear_attention(p.Qr, p.Kr, p.Vr, p.H, elu, p.Or, ws,
                                                 linattn::CausalOptions{}, par);
    else
      linattn::multihead_causal_linear_attention(p.Q, p.K, p.V, p.H, elu, p.out, ws,
                                                 linattn::CausalOptions{}, par);
    return;
  }
  const DeltaMap phi{};
  if (layout == Layout::Row) {
    if (decay)
      linattn::multihead_delta_rule_attention(p.Qr, p.Kr, p.Vr, p.Br, p.Gr, p.H, phi, p.Or, ws, opts, par);
    else
      linattn::multihead_delta_rule_attention(p.Qr, p.Kr, p.Vr, p.Br, p.G0r, p.H, phi, p.Or, ws, opts, par);
  } else {
    if (decay)
      linattn::multihead_delta_rule_attention(p.Q, p.K, p.V, p.B, p.G, p.H, phi, p.out, ws, opts, par);
    else
      linattn::multihead_delta_rule_attention(p.Q, p.K, p.V, p.B, p.G0, p.H, phi, p.out, ws, opts, par);
  }
}

void BM_prefill(benchmark::State& st, Kind kind, bool decay, Index D, Layout layout,
                linattn::CausalAlgorithm alg, Index chunk) {
  using T = float;
  const Index N = st.range(0), H = kHeads;
  lb::set_threads(1);
  Problem<T> p(N, H, D);
  linattn::MultiHeadWorkspace<T> ws;
  const linattn::DeltaOptions opts = delta_options(D, alg, chunk);
  const double flops = double(H) * lb::linear_flops(N, N, D, D);
  if (lb::worth_warming_up(flops)) prefill_call(p, kind, decay, layout, opts, ws);
  for (auto _ : st) {
    prefill_call(p, kind, decay, layout, opts, ws);
    benchmark::DoNotOptimize(p.out.data());
    benchmark::ClobberMemory();
  }
  if (!lb::all_finite(p.out)) st.SkipWithError("non-finite output");
  st.SetComplexityN(N);
  st.SetItemsProcessed(int64_t(st.iterations()) * int64_t(N));
  lb::set_common_counters(st, flops, N, D, D, H, 1);
  st.counters["ws_bytes"] = double(ws.bytes());
  // Plain causal: one F×M + F state per head, as bench_multihead counts it; the delta rule keeps
  // S only (F×M per head).
  st.counters["state_bytes"] =
      double(H * (kind == Kind::Plain ? D * D + D : D * D) * Index(sizeof(T)));
}

// Plain causal, delta rule Chunked and delta rule Recurrent (all with decay) back to back in every
// iteration, rotating which goes first. The reported (manual) time is that of the three calls.
void BM_pair(benchmark::State& st, Index D, Layout layout) {
  using T = float;
  const Index N = st.range(0), H = kHeads;
  lb::set_threads(1);
  Problem<T> p(N, H, D);
  linattn::MultiHeadWorkspace<T> ws;
  using A = linattn::CausalAlgorithm;
  const linattn::DeltaOptions chunked = delta_options(D, A::Chunked, 0),
                              recurrent = delta_options(D, A::Recurrent, 0);
  const auto call = [&](int k) {
    if (k == 0)
      prefill_call(p, Kind::Plain, true, layout, chunked, ws);
    else
      prefill_call(p, Kind::Delta, true, layout, k == 1 ? chunked : recurrent, ws);
  };
  for (int k = 0; k < 3; ++k) call(k);  // sizes the workspace
  std::vector<double> tk[3], r_chunked, r_recurrent, c_chunked, c_recurrent;
  int first = 0;
  bool finite = true;
  for (auto _ : st) {
    double t[3] = {0, 0, 0}, c[3] = {0, 0, 0};
    for (int j = 0; j < 3; ++j) {
      const int k = (first + j) % 3;
      const double c0 = lb::thread_cpu_seconds();
      const auto t0 = std::chrono::steady_clock::now();
      call(k);
      benchmark::ClobberMemory();
      t[k] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      c[k] = lb::thread_cpu_seconds() - c0;
      finite = finite && lb::all_finite(p.out.topRows(1));
    }
    st.SetIterationTime(t[0] + t[1] + t[2]);
    for (int k = 0; k < 3; ++k) tk[k].push_back(t[k]);
    r_chunked.push_back(t[1] / t[0]);
    r_recurrent.push_back(t[2] / t[1]);
    c_chunked.push_back(c[1] / c[0]);
    c_recurrent.push_back(c[2] / c[1]);
    first = (first + 1) % 3;
  }
  st.counters["chunked_vs_plain_cpu"] = lb::median(c_chunked);
  st.counters["recurrent_vs_chunked_cpu"] = lb::median(c_recurrent);
  if (!finite || !lb::all_finite(p.out)) st.SkipWithError("non-finite output");
  st.counters["plain_ms"] = 1e3 * lb::median(tk[0]);
  st.counters["chunked_ms"] = 1e3 * lb::median(tk[1]);
  st.counters["recurrent_ms"] = 1e3 * lb::median(tk[2]);
  st.counters["chunked_vs_plain"] = lb::median(r_chunked);
  st.counters["recurrent_vs_chunked"] = lb::median(r_recurrent);
  st.counters["N"] = double(N);
  st.counters["D"] = double(D);
  st.counters["H"] = double(H);
  st.SetComplexityN(N);
}

// Blocks of kDecodeSteps steps of the plain recurrent step and of the delta-rule step (with
// decay), timed block by block in rotating order (one head, D = M).
void BM_decode_pair(benchmark::State& st, Index D) {
  using T = float;
  const Index M = D;
  const Mat<T> q = lb::random_matrix<T>(D, kRing, 41), k = lb::random_matrix<T>(D, kRing, 42),
               v = lb::random_matrix<T>(M, kRing, 43);
  const Mat<T> b = betas<T>(1, kRing, 44), g = log_decays<T>(1, kRing, 45);
  Eigen::Matrix<T, Eigen::Dynamic, 1> out(M);
  linattn::RecurrentLinearAttention<linattn::EluPlusOne, T> plain(D, M);
  linattn::RecurrentDeltaRule<DeltaMap, T> delta(D, M, DeltaMap{},
                                                 delta_options(D, linattn::CausalAlgorithm::Auto, 0));
  Index t = 0;
  bool finite = true;
  const auto block = [&](int kind) {
    for (Index s = 0; s < kDecodeSteps; ++s) {
      if (kind == 0)
        plain.step(q.col(t), k.col(t), v.col(t), out);
      else
        delta.step(q.col(t), k.col(t), v.col(t), b(0, t), g(0, t), out);
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
      t = (t + 1) % kRing;
    }
    finite = finite && lb::all_finite(out);
  };
  for (int w = 0; w < 4; ++w)
    for (int kind = 0; kind < 2; ++kind) block(kind);  // warm-up: caches, clock
  std::vector<double> tk[2], r_delta, c_delta;
  int first = 0;
  for (auto _ : st) {
    double tm[2] = {0, 0}, c[2] = {0, 0};
    for (int j = 0; j < 2; ++j) {
      const int kind = (first + j) % 2;
      const double c0 = lb::thread_cpu_seconds();
      const auto t0 = std::chrono::steady_clock::now();
      block(kind);
      tm[kind] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      c[kind] = lb::thread_cpu_seconds() - c0;
    }
    st.SetIterationTime(tm[0] + tm[1]);
    for (int kind = 0; kind < 2; ++kind) tk[kind].push_back(tm[kind] / double(kDecodeSteps));
    r_delta.push_back(tm[1] / tm[0]);
    c_delta.push_back(c[1] / c[0]);
    first = (first + 1) % 2;
  }
  st.counters["delta_vs_plain_cpu"] = lb::median(c_delta);
  if (!finite) st.SkipWithError("non-finite output");
  st.counters["plain_ns"] = 1e9 * lb::median(tk[0]);
  st.counters["delta_ns"] = 1e9 * lb::median(tk[1]);
  st.counters["delta_vs_plain"] = lb::median(r_delta);
  st.counters["steps"] = double(kDecodeSteps);
  st.counters["D"] = double(D);
  st.counters["M"] = double(M);
  // The plain state keeps S, z and their compensated low parts; the delta rule's S only.
  st.counters["plain_state_bytes"] = double(2 * (D * M + D) * Index(sizeof(T)));
  st.counters["delta_state_bytes"] = double(D * M * Index(sizeof(T)));
}

// The token-by-token recurrence as a careful user writes it with Eigen (one head: the maps over
// the whole sequence, tokens transposed into contiguous columns, then per token S ← a S,
// u = Sᵀ k̂, δ = β (v − u), S += k̂ δᵀ, out = s Sᵀ q̂: four passes over the state), against linattn's Chunked and Auto (the fused
// one-pass recurrence) on the same head, back to back in rotating order; counters naive_ms,
// chunked_ms, auto_ms and the medians naive_vs_chunked (the issue's "≥ 5× faster than the
// token-by-token recurrence") and naive_vs_auto.
void BM_naive_pair(benchmark::State& st, Index D) {
  using T = float;
  const Index N = st.range(0), M = D;
  lb::set_threads(1);
  const Mat<T> Q = lb::random_matrix<T>(N, D, 71), K = lb::random_matrix<T>(N, D, 72),
               V = lb::random_matrix<T>(N, M, 73);
  const Eigen::Matrix<T, Eigen::Dynamic, 1> B = betas<T>(N, 1, 74), G = log_decays<T>(N, 1, 75);
  const DeltaMap phi{};
  const linattn::DeltaOptions chunked = delta_options(D, linattn::CausalAlgorithm::Chunked, 0),
                              autoo = delta_options(D, linattn::CausalAlgorithm::Auto, 0);
  const T s = T(1) / std::sqrt(T(D));
  Mat<T> PQ(N, D), PK(N, D), PQt(D, N), PKt(D, N), Vt(M, N), S(D, M), out(N, M), outt(M, N);
  Eigen::Matrix<T, Eigen::Dynamic, 1> u(M), d(M);
  linattn::LinearAttentionState<T> state;
  linattn::Workspace<T> ws;
  const auto call = [&](int k) {
    if (k == 0) {
      phi.map(Q, PQ);
      phi.map(K, PK);
      PQt = PQ.transpose();  // tokens as contiguous columns
      PKt = PK.transpose();
      Vt = V.transpose();
      S.setZero();
      for (Index t = 0; t < N; ++t) {
        S *= std::exp(G(t));
        u.noalias() = S.transpose() * PKt.col(t);
        d = B(t) * (Vt.col(t) - u);
        S.noalias() += PKt.col(t) * d.transpose();
        outt.col(t).noalias() = s * (S.transpose() * PQt.col(t));
      }
      out = outt.transpose();
    } else {
      state = linattn::LinearAttentionState<T>();
      linattn::delta_rule_attention(Q, K, V, B, G, phi, state, out, ws, k == 1 ? chunked : autoo);
    }
  };
  for (int k = 0; k < 3; ++k) call(k);
  std::vector<double> tk[3], r_chunked, r_auto;
  int first = 0;
  for (auto _ : st) {
    double t[3] = {0, 0, 0};
    for (int j = 0; j < 3; ++j) {
      const int k = (first + j) % 3;
      const auto t0 = std::chrono::steady_clock::now();
      call(k);
      benchmark::ClobberMemory();
      t[k] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    st.SetIterationTime(t[0] + t[1] + t[2]);
    for (int k = 0; k < 3; ++k) tk[k].push_back(t[k]);
    r_chunked.push_back(t[0] / t[1]);
    r_auto.push_back(t[0] / t[2]);
    first = (first + 1) % 3;
  }
  if (!lb::all_finite(out)) st.SkipWithError("non-finite output");
  st.counters["naive_ms"] = 1e3 * lb::median(tk[0]);
  st.counters["chunked_ms"] = 1e3 * lb::median(tk[1]);
  st.counters["auto_ms"] = 1e3 * lb::median(tk[2]);
  st.counters["naive_vs_chunked"] = lb::median(r_chunked);
  st.counters["naive_vs_auto"] = lb::median(r_auto);
  st.counters["N"] = double(N);
  st.counters["D"] = double(D);
}

#endif  // LINATTN_BENCH_DELTA

void register_all(const lb::Profile& p) {
  const DeltaSizes s = delta_sizes(p);
  for (Index D : s.dims) {
    const std::string tail = lb::key("dtype", "f32") + lb::key("H", kHeads) + lb::key("D", D) + lb::key("thr", 1);
    lb::add("dl_gemm_linear" + tail, s.ns, "N", benchmark::oN,
            [D](benchmark::State& st) { gemm_reference(st, D); });
#if LINATTN_BENCH_DELTA
    using A = linattn::CausalAlgorithm;
    for (Layout l : {Layout::Row, Layout::Col}) {
      const std::string lay = lb::key("layout", layout_name(l));
      lb::add("dl_causal/phi:elu/alg:auto" + lay + tail, s.ns, "N", benchmark::oN,
              [D, l](benchmark::State& st) { BM_prefill(st, Kind::Plain, false, D, l, A::Auto, 0); });
      for (bool decay : {true, false})
        for (A a : {A::Auto, A::Chunked, A::Recurrent}) {
          if (a != A::Auto && l == Layout::Col && !s.algs_on_col) continue;
          if (a != A::Auto && !decay && !s.no_decay_algs) continue;
          lb::add("dl_delta/phi:l2silu" + lb::key("decay", decay ? "on" : "off") + lb::key("alg", alg_name(a)) +
                      lay + tail,
                  s.ns, "N", benchmark::oN,
                  [decay, D, l, a](benchmark::State& st) { BM_prefill(st, Kind::Delta, decay, D, l, a, 0); });
        }
    }
    // Chunk sizes of the chunked algorithm at one N, row-major, with decay.
    for (Index c : s.chunks)
      lb::add("dl_delta/phi:l2silu/decay:on/alg:chunked" + lb::key("chunk", c) + lb::key("layout", "row") + tail,
              {s.chunk_n}, "N", benchmark::oN,
              [D, c](benchmark::State& st) { BM_prefill(st, Kind::Delta, true, D, Layout::Row, A::Chunked, c); });
    // The targets, call by call. Not lb::add: the time is the manual one (all three calls).
    for (Layout l : {Layout::Row, Layout::Col}) {
      if (l == Layout::Col && !s.pairs_on_col) continue;
      const std::string name = "dl_pair/phi:l2silu/decay:on" + lb::key("layout", layout_name(l)) + tail;
      auto* b = benchmark::RegisterBenchmark(name.c_str(), [D, l](benchmark::State& st) { BM_pair(st, D, l); });
      b->ArgName("N")->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(s.pair_iterations);
      for (Index n : s.pair_ns) b->Arg(int64_t(n));
    }
    {
      const std::string name = "dl_naive_pair/phi:l2silu/decay:on/layout:col" + lb::key("dtype", "f32") +
                               lb::key("H", 1) + lb::key("D", D) + lb::key("thr", 1);
      auto* b = benchmark::RegisterBenchmark(name.c_str(), [D](benchmark::State& st) { BM_naive_pair(st, D); });
      b->ArgName("N")->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(s.pair_iterations);
      b->Arg(int64_t(s.naive_n));
    }
    {
      const std::string name = "dl_decode_pair/phi:l2silu/decay:on" + lb::key("dtype", "f32") + lb::key("H", 1) +
                               lb::key("D", D) + lb::key("thr", 1);
      benchmark::RegisterBenchmark(name.c_str(), [D](benchmark::State& st) { BM_decode_pair(st, D); })
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond)
          ->Iterations(s.decode_iterations);
    }
#endif  // LINATTN_BENCH_DELTA
  }
}

std::string notes(const lb::Profile& p) {
  const DeltaSizes s = delta_sizes(p);
  std::string n = "The delta rule (float, 1 thread, L2Normalize<Silu>, scale 1/sqrt(D), beta in [0, 1], "
                  "log_a in [-0.1, 0] or none): ";
#if LINATTN_BENCH_DELTA
  n += "prefill H = 8, D = M = " + lb::join(s.dims) + ", N = " + lb::join(s.ns) +
       ", with and without decay, Auto on row- and column-major packed inputs, Chunked and Recurrent on " +
       (s.algs_on_col ? "both layouts" : "row-major only") + (s.no_decay_algs ? "" : " and with decay only") +
       ", vs multihead_causal_linear_attention (EluPlusOne) and the GEMM reference; chunk sizes " +
       lb::join(s.chunks) + " at N = " + std::to_string(s.chunk_n) +
       "; call-by-call target pairs (plain, Chunked, Recurrent) at N = " + lb::join(s.pair_ns) + " (" +
       std::to_string(s.pair_iterations) + " iterations, " + (s.pairs_on_col ? "both layouts" : "row-major") +
       "); the naive Eigen token loop against Chunked and Auto, one head, N = " + std::to_string(s.naive_n) +
       "; decode step pairs, one head, " + std::to_string(s.decode_iterations) + " blocks of " +
       std::to_string(kDecodeSteps) + " steps per kind.";
#else
  (void)s;
  n += "not measured: this build has no linattn/delta_rule.hpp (only the GEMM reference ran).";
#endif
  return n;
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
