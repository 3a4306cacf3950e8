// Single-head linear attention: non-causal, causal (CausalAlgorithm::Chunked at several chunk
// sizes, ::Recurrent and the library default ::Auto), every feature map, and the Eigen GEMMs of
// the same shapes. EluPlusOne in float also on row-major inputs and outputs (layout:row,
// Eigen::Map of row-major N×D memory) and in the returning forms (form:ret,
// `Eigen::MatrixXf out = linear_attention(Q, K, V)`: a new output, workspace and state per
// call); names without layout/form are column-major with the out-parameter form and a reused
// Workspace. See bench_common.hpp for the profiles, the names and the counters.
#include <linattn/linattn.hpp>

#include "bench_common.hpp"

#include <chrono>
#include <functional>
#include <type_traits>
#include <vector>

namespace lb = linattn_bench;
using lb::Index;

namespace {

template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;

template <class Phi>
const char* phi_name();
template <>
const char* phi_name<linattn::EluPlusOne>() { return "elu"; }
template <>
const char* phi_name<linattn::SoftmaxSplit>() { return "softmax_split"; }
template <>
const char* phi_name<linattn::NormalizedCosine>() { return "cosine"; }

template <class T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// EluPlusOne, float: the out-parameter form on row-major Maps (row = true) or the returning
// form on column-major matrices (row = false). The same random values as BM_linear/BM_causal.
template <class T>
void BM_form(benchmark::State& st, Index D, bool causal, bool row) {
  const Index N = st.range(0), M = D;
  const linattn::EluPlusOne phi{};
  const Mat<T> Q = lb::random_matrix<T>(N, D, causal ? 4 : 1),
               K = lb::random_matrix<T>(N, D, causal ? 5 : 2),
               V = lb::random_matrix<T>(N, M, causal ? 6 : 3);
  Mat<T> out = Mat<T>::Zero(N, M);
  Eigen::Map<const RowMat<T>> Qr(Q.data(), N, D), Kr(K.data(), N, D), Vr(V.data(), N, M);
  Eigen::Map<RowMat<T>> Or(out.data(), N, M);
  linattn::Workspace<T> ws;
  auto state = linattn::make_state<T>(phi, D, M);
  const auto call = [&] {
    if (row) {
      if (causal) {
        state.reset();
        linattn::causal_linear_attention(Qr, Kr, Vr, phi, state, Or, ws);
      } else {
        linattn::linear_attention(Qr, Kr, Vr, phi, Or, ws);
      }
    } else {
      // Move-assigning releases the previous result: one allocation and release per call.
      out = causal ? linattn::causal_linear_attention(Q, K, V) : linattn::linear_attention(Q, K, V);
    }
  };
  call();  // warm-up
  for (auto _ : st) {
    call();
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  if (!lb::all_finite(out)) st.SkipWithError("non-finite output");
  st.SetComplexityN(N);
  lb::set_common_counters(st, lb::linear_flops(N, N, D, M), N, D, M, 1, 1);
  if (row) st.counters["ws_bytes"] = double(ws.bytes());
}

template <class Phi, class T>
void BM_linear(benchmark::State& st, Index D) {
  const Index N = st.range(0), M = D;
  const Mat<T> Q = lb::random_matrix<T>(N, D, 1), K = lb::random_matrix<T>(N, D, 2),
               V = lb::random_matrix<T>(N, M, 3);
  Mat<T> out = Mat<T>::Zero(N, M);
  linattn::Workspace<T> ws;
  const Phi phi{};
  linattn::linear_attention(Q, K, V, phi, out, ws);  // warm-up: sizes the workspace
  for (auto _ : st) {
    linattn::linear_attention(Q, K, V, phi, out, ws);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  if (!lb::all_finite(out)) st.SkipWithError("non-finite output");
  st.SetComplexityN(N);
  lb::set_common_counters(st, lb::linear_flops(N, N, phi.feature_dim(D), M), N, D, M, 1, 1);
  st.counters["ws_bytes"] = double(ws.bytes());
}

template <class Phi, class T>
void BM_causal(benchmark::State& st, Index D, linattn::CausalAlgorithm algorithm, Index chunk) {
  const Index N = st.range(0), M = D;
  const Mat<T> Q = lb::random_matrix<T>(N, D, 4), K = lb::random_matrix<T>(N, D, 5),
               V = lb::random_matrix<T>(N, M, 6);
  Mat<T> out = Mat<T>::Zero(N, M);
  linattn::Workspace<T> ws;
  const Phi phi{};
  auto state = linattn::make_state<T>(phi, D, M);
  linattn::CausalOptions options;
  options.algorithm = algorithm;
  options.chunk_size = chunk;
  linattn::causal_linear_attention(Q, K, V, phi, state, out, ws, options);  // warm-up
  for (auto _ : st) {
    state.reset();  // every call starts from the empty sequence (O(F·M))
    linattn::causal_linear_attention(Q, K, V, phi, state, out, ws, options);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  if (!lb::all_finite(out)) st.SkipWithError("non-finite output");
  st.SetComplexityN(N);
  lb::set_common_counters(st, lb::linear_flops(N, N, phi.feature_dim(D), M), N, D, M, 1, 1);
  st.counters["ws_bytes"] = double(ws.bytes());
  st.counters["state_bytes"] =
      double((state.S.size() + state.S_lo.size() + state.z.size() + state.z_lo.size() +
              state.m.size()) * Index(sizeof(T)));
  st.counters["chunk"] = double(chunk);
}

// One sequence on two threads (ParallelOptions, spec §8) against one thread, call by call:
// every iteration times the one-thread call, the split call on two threads, and, as the
// ceiling of what two threads can give on this machine, two threads each running the
// one-thread kernel on its own half of the rows at the same time (no summaries, no scan: the
// split's only extra work). Counters: medians of the per-iteration times and ratios;
// `speedup` = one thread / split, `ceiling` = one thread / independent halves (below 2: the
// two threads slow each other down: shared caches, memory, or vCPUs sharing a core).
// In: the inputs' type. Returning = false: the out-parameter form with a reused Workspace
// (column-major); true: what a framework caller writes, `out = causal_linear_attention(Q, K, V,
// phi, {}, par)` on row-major memory (a new output, workspace and state per call).
template <class In, bool Returning>
void BM_split_pair(benchmark::State& st, bool causal) {
  const Index N = st.range(0), D = 64, M = 64;
  const linattn::EluPlusOne phi{};
  const In Q = lb::random_matrix<float>(N, D, 71), K = lb::random_matrix<float>(N, D, 72),
           V = lb::random_matrix<float>(N, M, 73);
  Mat<float> out1(N, M), out2(N, M), halves(N, M);
  linattn::Workspace<float> ws1, ws2, wsh[2];
  linattn::ParallelOptions one, two;
  one.num_threads = 1;
  two.num_threads = 2;
  const auto run = [&](const auto& q, const auto& k, const auto& v, auto&& out,
                       linattn::Workspace<float>& ws, const linattn::ParallelOptions& par) {
    if constexpr (Returning) {
      (void)ws;
      if (causal)
        out = linattn::causal_linear_attention(q, k, v, phi, linattn::CausalOptions{}, par);
      else
        out = linattn::linear_attention(q, k, v, phi, par);
    } else {
      if (causal) {
        linattn::LinearAttentionState<float> state;
        linattn::causal_linear_attention(q, k, v, phi, state, out, ws, {}, par);
      } else {
        linattn::linear_attention(q, k, v, phi, out, ws, par);
      }
    }
  };
  const auto run_halves = [&] {
#ifdef _OPENMP
#pragma omp parallel num_threads(2)
#endif
    {
      const int t = lb::thread_num();
      const Index h0 = t == 0 ? 0 : N / 2, h = t == 0 ? N / 2 : N - N / 2;
      run(Q.middleRows(h0, h), K.middleRows(h0, h), V.middleRows(h0, h), halves.middleRows(h0, h),
          wsh[t], one);
    }
  };
  const std::function<void()> calls[3] = {[&] { run(Q, K, V, out1, ws1, one); },
                                          [&] { run(Q, K, V, out2, ws2, two); }, run_halves};
  for (const auto& c : calls) c();  // sizes the workspaces, faults the outputs in
  std::vector<double> t[3], speedup, ceiling;
  int first = 0;
  for (auto _ : st) {
    double dt[3];
    for (int j = 0; j < 3; ++j) {  // rotate the order: no call always runs on a warm cache
      const int c = (first + j) % 3;
      const auto t0 = std::chrono::steady_clock::now();
      calls[c]();
      benchmark::ClobberMemory();
      dt[c] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    st.SetIterationTime(dt[0] + dt[1]);
    for (int c = 0; c < 3; ++c) t[c].push_back(dt[c]);
    speedup.push_back(dt[0] / dt[1]);
    ceiling.push_back(dt[0] / dt[2]);
    first = (first + 1) % 3;
  }
  const double rel = double((out1 - out2).cwiseAbs().maxCoeff()) /
                     std::max(1e-30, double(out1.cwiseAbs().maxCoeff()));
  if (!(rel < 1e-5)) st.SkipWithError("the split differs from one thread");
  st.counters["t1_ms"] = 1e3 * lb::median(t[0]);
  st.counters["t2_ms"] = 1e3 * lb::median(t[1]);
  st.counters["halves_ms"] = 1e3 * lb::median(t[2]);
  st.counters["speedup"] = lb::median(speedup);
  st.counters["ceiling"] = lb::median(ceiling);
  st.counters["rel_diff"] = rel;
}

template <class Phi, class T>
void register_map(const lb::Profile& p, Index D, const std::vector<Index>& ns,
                  const std::vector<Index>& chunks) {
  const std::string tail = lb::key("dtype", lb::dtype_name<T>()) + lb::key("D", D);
  const std::string phi = lb::key("phi", phi_name<Phi>());
  (void)p;
  lb::add("linear" + phi + tail, ns, "N", benchmark::oN,
          [D](benchmark::State& st) { BM_linear<Phi, T>(st, D); });
  for (Index c : chunks)
    lb::add("causal" + phi + "/alg:chunked" + lb::key("chunk", c) + tail, ns, "N", benchmark::oN,
            [D, c](benchmark::State& st) {
              BM_causal<Phi, T>(st, D, linattn::CausalAlgorithm::Chunked, c);
            });
  lb::add("causal" + phi + "/alg:recurrent" + tail, ns, "N", benchmark::oN,
          [D](benchmark::State& st) {
            BM_causal<Phi, T>(st, D, linattn::CausalAlgorithm::Recurrent, 0);
          });
  if (std::is_same_v<Phi, linattn::EluPlusOne> && std::is_same_v<T, float>) {
    // The library default (Auto) on both layouts and in both forms: report.py's row-major vs
    // column-major and returning vs out-parameter tables.
    lb::add("causal" + phi + "/alg:auto" + tail, ns, "N", benchmark::oN,
            [D](benchmark::State& st) {
              BM_causal<Phi, T>(st, D, linattn::CausalAlgorithm::Auto, 0);
            });
    for (const bool causal : {false, true}) {
      const std::string kind = causal ? "causal" + phi + "/alg:auto" : "linear" + phi;
      lb::add(kind + "/layout:row" + tail, ns, "N", benchmark::oN,
              [D, causal](benchmark::State& st) { BM_form<T>(st, D, causal, true); });
      lb::add(kind + "/form:ret" + tail, ns, "N", benchmark::oN,
              [D, causal](benchmark::State& st) { BM_form<T>(st, D, causal, false); });
    }
  }
}

void register_all(const lb::Profile& p) {
  // The library's default chunk (CausalOptions{}.chunk_size = 0 picks it) is 64.
  const std::vector<Index> default_chunk = {64};
  for (Index D : p.dims) {
    const std::string tail = lb::key("dtype", "f32") + lb::key("D", D);
    lb::add("gemm_linear" + tail, p.ns, "N", benchmark::oN,
            [D](benchmark::State& st) { lb::run_linear_gemm<float>(st, 1, D, 1); });
    register_map<linattn::EluPlusOne, float>(p, D, p.ns, p.chunks);
    register_map<linattn::SoftmaxSplit, float>(p, D, p.ns, p.every_variant ? p.chunks : default_chunk);
    register_map<linattn::NormalizedCosine, float>(p, D, p.ns,
                                                   p.every_variant ? p.chunks : default_chunk);
  }
  // One long sequence on two threads against one, call by call (not lb::add: manual time).
  // The out-parameter form on column-major inputs, then the returning form on row-major ones.
  for (const bool user : {false, true})
    for (const bool causal : {false, true}) {
      const std::string name =
          std::string(causal ? "split_pair_causal/phi:elu/alg:auto" : "split_pair_linear/phi:elu") +
          "/dtype:f32/D:64" + (user ? "/layout:row/form:ret" : "");
      auto* b = benchmark::RegisterBenchmark(name.c_str(), [causal, user](benchmark::State& st) {
        if (user)
          BM_split_pair<RowMat<float>, true>(st, causal);
        else
          BM_split_pair<Mat<float>, false>(st, causal);
      });
      b->ArgName("N")->UseManualTime()->Unit(benchmark::kMillisecond);
      b->Iterations(p.name == "smoke" ? 2 : 30);
      b->Arg(p.name == "smoke" ? 4096 : 65536);
    }
  // Double precision: EluPlusOne at D = M = 64 (every D in the full profile), default chunk.
  const std::vector<Index> ns = lb::capped(p.ns, p.double_cap);
  for (Index D : p.every_variant ? p.dims : std::vector<Index>{64}) {
    lb::add("gemm_linear" + lb::key("dtype", "f64") + lb::key("D", D), ns, "N", benchmark::oN,
            [D](benchmark::State& st) { lb::run_linear_gemm<double>(st, 1, D, 1); });
    register_map<linattn::EluPlusOne, double>(p, D, ns, default_chunk);
  }
}

std::string notes(const lb::Profile& p) {
  return "Linear attention: N = " + lb::join(p.ns) + ", D = M = " + lb::join(p.dims) +
         ", chunks " + lb::join(p.chunks) +
         (p.every_variant ? " for every feature map" : " (EluPlusOne; other maps at chunk 64)") +
         "; double precision up to N = " + std::to_string(p.double_cap) + ".";
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
