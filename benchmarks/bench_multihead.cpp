// Multi-head forms, H = 8, D = M = 64, float (the configuration of the performance targets):
//
//   - linear and causal linear attention on the layouts users hold, one thread:
//       layout:row          an Eigen::Map of row-major packed N×(H·D) memory (PyTorch's
//                           contiguous [N, H, D], an inference engine's activations)
//       layout:hnd          per-head row-major [H, N, D]: H separate row-major N×D Maps, one
//                           single-head call per head with a reused Workspace
//       layout:hnd_batched  the same memory as one (H·N)×D row-major Map, one
//                           batched_*_linear_attention call with H sequences of one head
//       layout:col          column-major packed N×(H·D) matrices (also at 2 threads)
//   - the returning forms (form:ret, `Eigen::MatrixXf out = multihead_...(Q, K, V, 8)`: a new
//     output and workspace per call) beside the out-parameter forms with a reused
//     MultiHeadWorkspace, for every multi-head kernel;
//   - tiled softmax (non-causal and causal) at 1 and 2 threads;
//   - Linformer (linformer.hpp, k = 256 projected keys, non-causal), one thread: no multi-head
//     form, so one single-head call per head on the column blocks of the packed column-major
//     buffers, E and F (k × N, from make_linformer_projections) shared by the heads, a reused
//     LinformerWorkspace: O(N·k) beside linear attention's O(N) and softmax's O(N²);
//   - the paper's CPU algorithm (paper_baseline.hpp) on [H, N, D], one thread: mh_paper_linear
//     and mh_paper_causal, measured in the same run as linattn (report.py prints the ratios);
//   - row-major against column-major call by call (mh_layout_pair_*: both calls in every
//     iteration, so that the drift of a shared machine cannot favour either);
//   - the Eigen GEMMs of the same shapes (8 heads' worth, over the packed layout).
// See bench_common.hpp.
#include <linattn/linattn.hpp>

#include "bench_common.hpp"
#include "paper_baseline.hpp"

#include <algorithm>
#include <chrono>
#include <vector>

namespace lb = linattn_bench;
using lb::Index;

namespace {

template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
template <class T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

constexpr Index kHeads = 8;
constexpr Index kDim = 64;

enum class Kind { Linear, Causal, Softmax, CausalSoftmax };
enum class Layout { Col, Row, Hnd, HndBatched };
enum class Form { Out, Ret };

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::Col: return "col";
    case Layout::Row: return "row";
    case Layout::Hnd: return "hnd";
    case Layout::HndBatched: return "hnd_batched";
  }
  return "?";
}

// One packed multi-head call of `kind` (EluPlusOne, tiled softmax) into `o`.
template <class DQ, class DK, class DV, class DO, class T>
void run_packed(Kind kind, const DQ& q, const DK& k, const DV& v, DO& o,
                linattn::MultiHeadWorkspace<T>& mws, const linattn::ParallelOptions& par) {
  const linattn::EluPlusOne phi{};
  const linattn::SoftmaxAlgorithm tiled = linattn::SoftmaxAlgorithm::Tiled;
  switch (kind) {
    case Kind::Linear:
      linattn::multihead_linear_attention(q, k, v, kHeads, phi, o, mws, par);
      break;
    case Kind::Causal:
      linattn::multihead_causal_linear_attention(q, k, v, kHeads, phi, o, mws,
                                                 linattn::CausalOptions{}, par);
      break;
    case Kind::Softmax:
      linattn::multihead_softmax_attention(q, k, v, kHeads, o, mws, tiled, par);
      break;
    case Kind::CausalSoftmax:
      linattn::multihead_causal_softmax_attention(q, k, v, kHeads, o, mws, tiled, par);
      break;
  }
}

template <class T>
void BM_multihead(benchmark::State& st, Kind kind, Layout layout, Form form, int threads) {
  using Phi = linattn::EluPlusOne;
  const Index N = st.range(0), H = kHeads, D = kDim, M = kDim;
  lb::set_threads(threads);
  // The same random values serve every layout: only how the buffer is viewed changes.
  const Mat<T> Q = lb::random_matrix<T>(N, H * D, 51), K = lb::random_matrix<T>(N, H * D, 52),
               V = lb::random_matrix<T>(N, H * M, 53);
  Mat<T> out = Mat<T>::Zero(N, H * M);
  Eigen::Map<const RowMat<T>> Qr(Q.data(), N, H * D), Kr(K.data(), N, H * D),
      Vr(V.data(), N, H * M);
  Eigen::Map<RowMat<T>> Or(out.data(), N, H * M);
  Eigen::Map<const RowMat<T>> Qb(Q.data(), H * N, D), Kb(K.data(), H * N, D),
      Vb(V.data(), H * N, M);
  Eigen::Map<RowMat<T>> Ob(out.data(), H * N, M);
  std::vector<Index> offsets;
  for (Index h = 0; h <= H; ++h) offsets.push_back(h * N);

  linattn::MultiHeadWorkspace<T> mws;
  linattn::Workspace<T> ws;
  linattn::ParallelOptions par;
  par.num_threads = threads;
  const Phi phi{};
  const Index F = phi.feature_dim(D);
  auto state = linattn::make_state<T>(phi, D, M);
  const linattn::SoftmaxAlgorithm tiled = linattn::SoftmaxAlgorithm::Tiled;
  const bool causal = kind == Kind::Causal || kind == Kind::CausalSoftmax;

  const auto per_head = [&] {
    for (Index h = 0; h < H; ++h) {
      Eigen::Map<const RowMat<T>> q(Q.data() + h * N * D, N, D), k(K.data() + h * N * D, N, D),
          v(V.data() + h * N * M, N, M);
      Eigen::Map<RowMat<T>> o(out.data() + h * N * M, N, M);
      if (causal) {
        state.reset();
        linattn::causal_linear_attention(q, k, v, phi, state, o, ws);
      } else {
        linattn::linear_attention(q, k, v, phi, o, ws);
      }
    }
  };
  const auto packed = [&](const auto& q, const auto& k, const auto& v, auto& o) {
    run_packed(kind, q, k, v, o, mws, par);
  };
  // The returning forms as a user writes them: a new result (and, inside, a new workspace)
  // per call, destroyed at the end of the iteration.
  const auto returning = [&]() -> Mat<T> {
    switch (kind) {
      case Kind::Linear:
        return linattn::multihead_linear_attention(Q, K, V, H, phi, par);
      case Kind::Causal:
        return linattn::multihead_causal_linear_attention(Q, K, V, H, phi,
                                                          linattn::CausalOptions{}, par);
      case Kind::Softmax:
        return linattn::multihead_softmax_attention(Q, K, V, H, tiled, par);
      case Kind::CausalSoftmax:
        return linattn::multihead_causal_softmax_attention(Q, K, V, H, tiled, par);
    }
    return {};
  };
  const auto call = [&] {
    switch (layout) {
      case Layout::Col:
        packed(Q, K, V, out);
        break;
      case Layout::Row:
        packed(Qr, Kr, Vr, Or);
        break;
      case Layout::Hnd:
        per_head();
        break;
      case Layout::HndBatched:
        if (causal)
          linattn::batched_causal_linear_attention(Qb, Kb, Vb, offsets, 1, phi, Ob, mws,
                                                   linattn::CausalOptions{}, par);
        else
          linattn::batched_linear_attention(Qb, Kb, Vb, offsets, offsets, 1, phi, Ob, mws, par);
        break;
    }
  };

  const bool linear = kind == Kind::Linear || kind == Kind::Causal;
  const double flops = double(H) * (linear ? lb::linear_flops(N, N, F, M)
                                           : lb::softmax_flops(N, N, D, M, causal));
  if (form == Form::Ret) {
    // Move-assigning frees the previous result and takes the new one: one allocation and one
    // release of the output per call, as with a fresh variable, and the last one is checked.
    // Three warm-up calls: the first two returning calls of a process took 80-110 ms where
    // later ones take 41-44 ms (N = 16384: the kernel's first transparent huge pages for the
    // 32 MiB result; measured in loops of 8 calls, one process per run). The
    // steady state is what a caller who generates repeatedly sees.
    if (lb::worth_warming_up(flops))
      for (int w = 0; w < 3; ++w) out = returning();
    for (auto _ : st) {
      out = returning();
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
    }
  } else {
    if (lb::worth_warming_up(flops)) call();
    for (auto _ : st) {
      call();
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
    }
    st.counters["ws_bytes"] = double(layout == Layout::Hnd ? ws.bytes() : mws.bytes());
  }
  if (!lb::all_finite(out)) st.SkipWithError("non-finite output");
  st.SetComplexityN(N);
  lb::set_common_counters(st, flops, N, D, M, H, threads);
  if (kind == Kind::Causal)  // one state per head, made by the kernel for each call
    st.counters["state_bytes"] = double(H * (F * M + F) * Index(sizeof(T)));
  lb::set_threads(1);
}

// Linformer with k projected keys (spec §5), one thread: H single-head calls on the heads' column
// blocks of the packed column-major buffers (the same values as BM_multihead), E and F shared by
// the heads. Useful flops per head: 2·k·N·(D + M) for E K and F V, plus softmax attention of N
// queries over k keys.
template <class T>
void BM_linformer(benchmark::State& st, Index k) {
  const Index N = st.range(0), H = kHeads, D = kDim, M = kDim;
  lb::set_threads(1);
  const Mat<T> Q = lb::random_matrix<T>(N, H * D, 51), K = lb::random_matrix<T>(N, H * D, 52),
               V = lb::random_matrix<T>(N, H * M, 53);
  const auto projections = linattn::make_linformer_projections<T>(N, k, 54);
  const Mat<T>& E = projections.first;
  const Mat<T>& F = projections.second;
  Mat<T> out = Mat<T>::Zero(N, H * M);
  linattn::LinformerWorkspace<T> ws;
  const auto call = [&] {
    for (Index h = 0; h < H; ++h)
      linattn::linformer_attention(Q.middleCols(h * D, D), K.middleCols(h * D, D),
                                   V.middleCols(h * M, M), E, F, out.middleCols(h * M, M), ws);
  };
  const double projections_flops = 2.0 * double(k) * double(N) * double(D + M);
  const double flops = double(H) * (projections_flops + lb::softmax_flops(N, k, D, M, false));
  if (lb::worth_warming_up(flops)) call();
  for (auto _ : st) {
    call();
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  if (!lb::all_finite(out)) st.SkipWithError("non-finite output");
  st.SetComplexityN(N);
  lb::set_common_counters(st, flops, N, D, M, H, 1);
  st.counters["k"] = double(k);
  st.counters["ws_bytes"] = double(ws.bytes());
}

// Row-major against column-major packed inputs, call by call, one thread: each iteration makes
// the column-major call and the row-major one (the same memory viewed through a row-major Map)
// back to back, alternating which goes first. The machine's drift during a run (clock, other
// tenants of the shared VM: the column-major time alone moved by 20% between two runs of the
// suite) then falls on both, which separate benchmarks run minutes apart cannot promise.
// Counters: col_ms and row_ms, the medians of the calls, and row_vs_col, the median of the
// per-iteration ratios (the figure report.py checks against its target). The reported time is
// that of both calls.
template <class T>
void BM_layout_pair(benchmark::State& st, Kind kind) {
  const Index N = st.range(0), H = kHeads, D = kDim, M = kDim;
  const Mat<T> Q = lb::random_matrix<T>(N, H * D, 51), K = lb::random_matrix<T>(N, H * D, 52),
               V = lb::random_matrix<T>(N, H * M, 53);
  Mat<T> out_col = Mat<T>::Zero(N, H * M), out_row = Mat<T>::Zero(N, H * M);
  Eigen::Map<const RowMat<T>> Qr(Q.data(), N, H * D), Kr(K.data(), N, H * D),
      Vr(V.data(), N, H * M);
  Eigen::Map<RowMat<T>> Or(out_row.data(), N, H * M);
  linattn::MultiHeadWorkspace<T> mws;
  linattn::ParallelOptions par;
  par.num_threads = 1;
  lb::set_threads(1);
  const auto call = [&](bool row) {
    if (row)
      run_packed(kind, Qr, Kr, Vr, Or, mws, par);
    else
      run_packed(kind, Q, K, V, out_col, mws, par);
  };
  call(false);  // sizes the workspace and faults both outputs in
  call(true);
  std::vector<double> t_col, t_row, ratio;
  bool row_first = false;
  for (auto _ : st) {
    double t[2] = {0, 0};  // [column-major, row-major]
    for (const bool row : {row_first, !row_first}) {
      const auto t0 = std::chrono::steady_clock::now();
      call(row);
      benchmark::ClobberMemory();
      t[row] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    st.SetIterationTime(t[0] + t[1]);
    t_col.push_back(t[0]);
    t_row.push_back(t[1]);
    ratio.push_back(t[1] / t[0]);
    row_first = !row_first;
  }
  // Row-major memory viewed as the transpose of the column-major buffer holds other values, so
  // the two outputs differ; each must be finite.
  if (!lb::all_finite(out_col) || !lb::all_finite(out_row)) st.SkipWithError("non-finite output");
  st.counters["col_ms"] = 1e3 * lb::median(t_col);
  st.counters["row_ms"] = 1e3 * lb::median(t_row);
  st.counters["row_vs_col"] = lb::median(ratio);
  st.SetComplexityN(N);
}

// The paper's CPU algorithm on [H, N, D] row-major memory, one thread. After the timed loop
// its output is compared with linattn's on the same memory (per-head calls): the counter
// rel_diff_vs_linattn is max |paper − linattn| / max |linattn|, and a difference above 1e-3
// (both compute the same attention in float) marks the run as an error.
template <class T>
void BM_paper(benchmark::State& st, bool causal) {
  const Index N = st.range(0), H = kHeads, D = kDim, M = kDim;
  const Mat<T> Q = lb::random_matrix<T>(N, H * D, 61), K = lb::random_matrix<T>(N, H * D, 62),
               V = lb::random_matrix<T>(N, H * M, 63);
  Mat<T> out = Mat<T>::Zero(N, H * M);
  paper_baseline::Problem<T> problem(H, N, D, M);
  const auto call = [&] {
    if (causal)
      paper_baseline::causal(problem, Q.data(), K.data(), V.data(), out.data());
    else
      paper_baseline::linear(problem, Q.data(), K.data(), V.data(), out.data());
  };
  call();  // faults the buffers in, as the other benchmarks' warm-up does
  for (auto _ : st) {
    call();
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  // Check (untimed) that the baseline computes what linattn computes.
  Mat<T> ref = Mat<T>::Zero(N, H * M);
  linattn::Workspace<T> ws;
  const linattn::EluPlusOne phi{};
  auto state = linattn::make_state<T>(phi, D, M);
  for (Index h = 0; h < H; ++h) {
    Eigen::Map<const RowMat<T>> q(Q.data() + h * N * D, N, D), k(K.data() + h * N * D, N, D),
        v(V.data() + h * N * M, N, M);
    Eigen::Map<RowMat<T>> o(ref.data() + h * N * M, N, M);
    if (causal) {
      state.reset();
      linattn::causal_linear_attention(q, k, v, phi, state, o, ws);
    } else {
      linattn::linear_attention(q, k, v, phi, o, ws);
    }
  }
  const double scale = double(ref.cwiseAbs().maxCoeff());
  const double diff = double((out - ref).cwiseAbs().maxCoeff()) / (scale > 0 ? scale : 1.0);
  if (!lb::all_finite(out) || !(diff <= 1e-3))
    st.SkipWithError(("the paper baseline differs from linattn: relative difference " +
                      std::to_string(diff)).c_str());
  st.SetComplexityN(N);
  lb::set_common_counters(st, double(H) * lb::linear_flops(N, N, D, M), N, D, M, H, 1);
  st.counters["rel_diff_vs_linattn"] = diff;
}

void register_all(const lb::Profile& p) {
  const auto tail = [](int T) {
    return lb::key("dtype", "f32") + lb::key("H", kHeads) + lb::key("D", kDim) + lb::key("thr", T);
  };
  const std::vector<std::pair<Kind, std::string>> linear_kinds = {
      {Kind::Linear, "mh_linear/phi:elu"}, {Kind::Causal, "mh_causal/phi:elu/alg:auto"}};
  const std::vector<std::pair<Kind, std::string>> softmax_kinds = {
      {Kind::Softmax, "mh_softmax/alg:tiled"}, {Kind::CausalSoftmax, "mh_causal_softmax/alg:tiled"}};

  // One thread: every layout, the returning forms and the paper's algorithm, row-major first.
  lb::add("mh_gemm_linear" + tail(1), p.mh_ns, "N", benchmark::oN,
          [](benchmark::State& st) { lb::run_linear_gemm<float>(st, kHeads, kDim, 1); });
  for (const auto& [kind, name] : linear_kinds) {
    for (Layout l : {Layout::Row, Layout::Hnd, Layout::HndBatched, Layout::Col})
      lb::add(name + lb::key("layout", layout_name(l)) + tail(1), p.mh_ns, "N", benchmark::oN,
              [kind = kind, l](benchmark::State& st) {
                BM_multihead<float>(st, kind, l, Form::Out, 1);
              });
    lb::add(name + lb::key("layout", "col") + lb::key("form", "ret") + tail(1), p.mh_ns, "N",
            benchmark::oN, [kind = kind](benchmark::State& st) {
              BM_multihead<float>(st, kind, Layout::Col, Form::Ret, 1);
            });
  }
  // Row-major vs column-major call by call, at the largest two sizes of the sweep.
  const std::vector<Index> pair_ns(p.mh_ns.end() - std::min<std::ptrdiff_t>(2, p.mh_ns.size()),
                                   p.mh_ns.end());
  for (const auto& [kind, name] : linear_kinds) {
    const std::string pair_name = (kind == Kind::Linear ? "mh_layout_pair_linear/phi:elu"
                                                        : "mh_layout_pair_causal/phi:elu/alg:auto");
    // Not lb::add: the time is the manual one (both calls), not UseRealTime's.
    auto* b = benchmark::RegisterBenchmark((pair_name + tail(1)).c_str(),
                                           [kind = kind](benchmark::State& st) {
                                             BM_layout_pair<float>(st, kind);
                                           });
    b->ArgName("N")->UseManualTime()->Unit(benchmark::kMillisecond);
    b->Iterations(p.name == "smoke" ? 2 : 20);
    for (Index n : pair_ns) b->Arg(int64_t(n));
  }
  // Linformer over the whole sweep: O(N·k), k = 256.
  lb::add("mh_linformer/k:256" + tail(1), p.mh_ns, "N", benchmark::oN,
          [](benchmark::State& st) { BM_linformer<float>(st, 256); });
  lb::add("mh_paper_linear/phi:elu/layout:hnd" + tail(1), p.mh_ns, "N", benchmark::oN,
          [](benchmark::State& st) { BM_paper<float>(st, false); });
  lb::add("mh_paper_causal/phi:elu/layout:hnd" + tail(1), p.mh_ns, "N", benchmark::oN,
          [](benchmark::State& st) { BM_paper<float>(st, true); });

  for (int T : p.mh_threads) {
    const std::vector<Index> softmax_ns =
        lb::capped(p.mh_ns, T > 1 ? p.mh_softmax_cap_mt : p.mh_softmax_cap);
    if (T > 1) {
      lb::add("mh_gemm_linear" + tail(T), p.mh_ns, "N", benchmark::oN,
              [T](benchmark::State& st) { lb::run_linear_gemm<float>(st, kHeads, kDim, T); });
      for (const auto& [kind, name] : linear_kinds)
        lb::add(name + lb::key("layout", "col") + tail(T), p.mh_ns, "N", benchmark::oN,
                [kind = kind, T](benchmark::State& st) {
                  BM_multihead<float>(st, kind, Layout::Col, Form::Out, T);
                });
    }
    lb::add("mh_gemm_softmax" + tail(T), softmax_ns, "N", benchmark::oNSquared,
            [T](benchmark::State& st) { lb::run_softmax_gemm<float>(st, kHeads, kDim, T); });
    for (const auto& [kind, name] : softmax_kinds) {
      lb::add(name + tail(T), softmax_ns, "N", benchmark::oNSquared,
              [kind = kind, T](benchmark::State& st) {
                BM_multihead<float>(st, kind, Layout::Col, Form::Out, T);
              });
      if (T == 1)
        lb::add(name + lb::key("form", "ret") + tail(T), lb::capped(softmax_ns, p.mh_ret_softmax_cap),
                "N", benchmark::oNSquared, [kind = kind](benchmark::State& st) {
                  BM_multihead<float>(st, kind, Layout::Col, Form::Ret, 1);
                });
    }
  }
}

std::string notes(const lb::Profile& p) {
  return "Multi-head (H = 8, D = M = 64, float, EluPlusOne, threads " +
         [&] {
           std::string s;
           for (int t : p.mh_threads) s += (s.empty() ? "" : ",") + std::to_string(t);
           return s;
         }() +
         "): N = " + lb::join(p.mh_ns) +
         "; layouts row, hnd, hnd_batched, the returning forms and the paper's algorithm at one "
         "thread only; tiled softmax (and its GEMM reference) capped at N <= " +
         std::to_string(p.mh_softmax_cap) + " on 1 thread, N <= " +
         std::to_string(p.mh_softmax_cap_mt) + " on more (8 heads of O(N^2) work), its returning "
         "form at N <= " + std::to_string(p.mh_ret_softmax_cap) +
         "; Linformer (k = 256, one single-head call per head, 1 thread) at every N.";
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
