// What the benchmarks of whole layers (bench_gdn_layer, bench_kda_layer) share: their threads,
// the timed loops of a prefill and of a batched decode step with their counters, and the scaffold
// that times the parts of a prefill alone (`<kind>_part`) and together with the layer in every
// iteration (`<kind>_split`).
//
// A layer benchmark provides:
//   - the layer: forward(X) -> N x hidden, make_batched_state(B), step(Xb, batch, Yb, par);
//   - its shape counters, a callable (benchmark::State&, int threads) -> void;
//   - for the parts, a Stages type holding the operands of every part at N tokens, with
//       Index N; Mat X;                    the size and the input of one prefill
//       void run(int k);                   part k (of PartInfo parts[k])
//       double flops(int k) const;         its useful flops (0: little arithmetic)
//       void forward();                    the whole layer's forward(X)
//       bool finite() const;               whether the outputs of the parts and the layer are
//     and an array of PartInfo naming the parts and their roles in the split's ratios.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <linattn/core/parallel.hpp>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace linattn_bench {

// OpenMP's threads (a layer's heads) and Eigen's (its products), together: forward() takes no
// ParallelOptions, so its products run on as many threads as Eigen is given.
inline void use_layer_threads(int threads) {
  set_threads(threads);
  Eigen::setNbThreads(threads);
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs `body` in the benchmark's timed loop (then ClobberMemory); returns the wall seconds of one
// iteration, timed around the whole loop (for the fraction of the FMA peak).
template <class Fn>
double timed_loop(benchmark::State& st, Fn&& body) {
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : st) {
    body();
    benchmark::ClobberMemory();
  }
  return seconds_since(t0) / double(std::max<benchmark::IterationCount>(st.iterations(), 1));
}

// tokens_per_s (`tokens` a call, a rate), GFLOPs (a rate) and flops of one call.
inline void rate_counters(benchmark::State& st, double tokens, double flops) {
  st.counters["tokens_per_s"] =
      benchmark::Counter(tokens, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["GFLOPs"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["flops"] = flops;
}

// forward(X) of one new sequence of N = st.range(0) tokens (X uniform in [-1, 1], seed 900).
template <class Layer, class Shape>
void layer_prefill(benchmark::State& st, const Layer& L, Index hidden, double flops, int threads,
                   Shape&& shape_counters) {
  const Index N = st.range(0);
  use_layer_threads(threads);
  const Eigen::MatrixXf X = random_matrix<float>(N, hidden, 900);
  Eigen::MatrixXf Y;
  if (worth_warming_up(flops)) Y = L.forward(X);  // starts the OpenMP team
  const double s = timed_loop(st, [&] {
    Y = L.forward(X);
    benchmark::DoNotOptimize(Y.data());
  });
  if (!all_finite(Y)) st.SkipWithError("non-finite output");
  st.SetItemsProcessed(int64_t(st.iterations()) * int64_t(N));
  st.SetComplexityN(N);
  rate_counters(st, double(N), flops);
  st.counters["N"] = double(N);
  shape_counters(st, threads);
  set_peak_counters(st, flops, s, threads);
  use_layer_threads(1);
}

// What a decode benchmark reads: the parameters (once a step) and the B sequences' states.
struct DecodeBytes {
  double weights = 0, states = 0;
};

// One step(Xb, batch, Yb, ParallelOptions{threads}) of B = st.range(0) sequences on a
// make_batched_state(B), row-major B x hidden tokens cycled through a ring of kRing.
template <class Layer, class Shape>
void layer_decode(benchmark::State& st, const Layer& L, Index hidden, double flops,
                  DecodeBytes bytes, int threads, Shape&& shape_counters) {
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  constexpr Index kRing = 4;  // distinct token sets cycled through by the timed steps
  const Index B = st.range(0);
  use_layer_threads(threads);
  linattn::ParallelOptions par;
  par.num_threads = threads;
  auto batch = L.make_batched_state(B);
  std::vector<RowMat> xs;
  for (Index r = 0; r < kRing; ++r)
    xs.push_back(random_matrix<float>(B, hidden, 950 + std::uint64_t(r)));
  RowMat Y(B, hidden);
  Index t = 0;
  const auto one = [&] {
    L.step(xs[std::size_t(t)], batch, Y, par);
    t = (t + 1) % kRing;
  };
  for (int w = 0; w < 4; ++w) one();  // sizes the step's buffers, faults the states in
  const double s = timed_loop(st, [&] {
    one();
    benchmark::DoNotOptimize(Y.data());
  });
  if (!all_finite(Y)) st.SkipWithError("non-finite output");
  st.SetItemsProcessed(int64_t(st.iterations()) * int64_t(B));
  st.SetComplexityN(B);
  rate_counters(st, double(B), flops);
  st.counters["B"] = double(B);
  st.counters["ns_per_token"] = 1e9 * s / double(B);
  st.counters["weight_bytes"] = bytes.weights;
  st.counters["state_bytes"] = bytes.states;
  st.counters["GBs"] = s > 0 ? (bytes.weights + 2.0 * bytes.states) / s * 1e-9 : 0.0;
  shape_counters(st, threads);
  set_peak_counters(st, flops, s, threads);
  use_layer_threads(1);
}

// ---------------------------------------------------------------------------------------------
// The parts of a prefill
// ---------------------------------------------------------------------------------------------

// A part's role in the split's ratios: Base (the products and the recurrence, what the layer
// cannot do without), Aux (the convolution, gates and norm, the target's numerator) or Other.
enum class PartRole { Base, Aux, Other };

struct PartInfo {
  const char* name;
  PartRole role;
};

// One part alone, part k of the stages at N = st.range(0).
template <class Stages, class Shape>
void layer_part(benchmark::State& st, Stages& sg, int k, int threads, Shape&& shape_counters) {
  use_layer_threads(threads);
  const double flops = sg.flops(k);
  if (worth_warming_up(flops)) sg.run(k);  // on this thread count
  const double s = timed_loop(st, [&] { sg.run(k); });
  if (!sg.finite()) st.SkipWithError("non-finite output");
  st.counters["N"] = double(sg.N);
  st.counters["ms_per_call"] = 1e3 * s;
  shape_counters(st, threads);
  if (flops > 0) {
    st.counters["GFLOPs"] =
        benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
    st.counters["flops"] = flops;
    set_peak_counters(st, flops, s, threads);
  }
  use_layer_threads(1);
}

// forward(X) and every part back to back in each iteration, rotating which goes first, so that
// the drift of a shared machine falls on all of them. Counters <part>_ms and layer_ms (medians),
// and the medians of the per-iteration ratios cgn_vs_proj_rec = Aux ÷ Base, rest_vs_proj_rec =
// (layer − Base) ÷ Base and parts_vs_layer = (every part) ÷ layer.
template <class Stages, class Shape>
void layer_split(benchmark::State& st, Stages& sg, const std::vector<PartInfo>& parts, int threads,
                 Shape&& shape_counters) {
  use_layer_threads(threads);
  const int np = int(parts.size()), calls = np + 1;  // the parts, then the whole layer
  const auto call = [&](int k) {
    if (k == np)
      sg.forward();
    else
      sg.run(k);
  };
  std::vector<std::vector<double>> tk(static_cast<std::size_t>(calls));
  std::vector<double> cgn, rest, all, t(static_cast<std::size_t>(calls));
  int first = 0;
  for (auto _ : st) {
    for (int j = 0; j < calls; ++j) {
      const int k = (first + j) % calls;
      const auto t0 = std::chrono::steady_clock::now();
      call(k);
      benchmark::ClobberMemory();
      t[std::size_t(k)] = seconds_since(t0);
    }
    double total = 0, sum = 0, base = 0, aux = 0;
    for (int k = 0; k < calls; ++k) {
      total += t[std::size_t(k)];
      tk[std::size_t(k)].push_back(t[std::size_t(k)]);
    }
    for (int k = 0; k < np; ++k) {
      const double tp = t[std::size_t(k)];
      sum += tp;
      if (parts[std::size_t(k)].role == PartRole::Base) base += tp;
      if (parts[std::size_t(k)].role == PartRole::Aux) aux += tp;
    }
    const double layer = t[std::size_t(np)];
    st.SetIterationTime(total);
    cgn.push_back(aux / base);
    rest.push_back((layer - base) / base);
    all.push_back(sum / layer);
    first = (first + 1) % calls;
  }
  if (!sg.finite()) st.SkipWithError("non-finite output");
  for (int k = 0; k < np; ++k)
    st.counters[std::string(parts[std::size_t(k)].name) + "_ms"] = 1e3 * median(tk[std::size_t(k)]);
  st.counters["layer_ms"] = 1e3 * median(tk[std::size_t(np)]);
  st.counters["cgn_vs_proj_rec"] = median(cgn);
  st.counters["rest_vs_proj_rec"] = median(rest);
  st.counters["parts_vs_layer"] = median(all);
  st.counters["N"] = double(sg.N);
  shape_counters(st, threads);
  use_layer_threads(1);
}

// Registers `<kind>_part/part:P<tail>` for every part and `<kind>_split<tail>` at N = n, on every
// thread count (the parts of one N first, as they share its stages).
template <class Bind>
void add_layer_parts(const std::string& kind, const std::vector<PartInfo>& parts, Index n,
                     const std::vector<int>& thrs, int split_iterations, std::string (*tail)(int),
                     Bind&& bind) {
  for (int thr : thrs)
    for (int k = 0; k < int(parts.size()); ++k)
      add(kind + "_part" + key("part", parts[std::size_t(k)].name) + tail(thr), {n}, "N",
          benchmark::oN, [bind, k, thr](benchmark::State& st) { bind(st, k, thr); });
  for (int thr : thrs)
    benchmark::RegisterBenchmark((kind + "_split" + tail(thr)).c_str(),
                                 [bind, thr](benchmark::State& st) { bind(st, -1, thr); })
        ->ArgName("N")
        ->Arg(int64_t(n))
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(split_iterations)
        ->Repetitions(1);  // the iterations' medians already stand for the run
}

}  // namespace linattn_bench
