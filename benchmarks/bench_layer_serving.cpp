// Serving a linear attention layer to B sequences: one decode step of a
// LinearAttentionLayer (d_model 512 = 8 heads of D = M = 64, float, EluPlusOne) for each of
// B = 1 … 64 sequences, as tokens per second:
//   layer_batched   one LinearAttentionLayer::step(Xb, batch, Yb) on a BatchedState: the four
//                   projections as one product each over the B rows (the micro-kernel, its rows
//                   split over up to `thr` threads when the product pays for them), the heads one
//                   BatchedRecurrentLinearAttention::step (ParallelOptions::num_threads = thr);
//   layer_separate  B LinearAttentionLayer::step(x, state, y) calls on B States, on one thread,
//                   or spread over `thr` threads with an OpenMP loop over sequences (what a
//                   server without the batched layer would write). Eigen on one thread.
// Inputs and outputs are row-major B x d_model, cycled through a ring of distinct tokens. Both
// compute the same values to rounding (tests/layers/test_batched_layer.cpp).
//
// Counters: tokens_per_s (B per step, a rate), B, threads, GFLOPs (the projections' 8·d_model²
// and the heads' 4·F·M per token; F = M = 64).
#include <linattn/linattn.hpp>

#include "bench_common.hpp"

#include <vector>

namespace lb = linattn_bench;
using lb::Index;

namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Phi = linattn::EluPlusOne;
using Layer = linattn::LinearAttentionLayer<Phi, float>;

constexpr Index kModel = 512, kHeads = 8, kDim = kModel / kHeads;
constexpr Index kRing = 4;  // distinct token sets cycled through by the timed steps

const Layer& layer() {
  static const Layer l = [] {
    Layer x(kModel, kHeads);
    x.reset_parameters(1);
    return x;
  }();
  return l;
}

std::vector<RowMat> tokens(Index B) {
  std::vector<RowMat> xs;
  for (Index r = 0; r < kRing; ++r) xs.push_back(lb::random_matrix<float>(B, kModel, 300 + std::uint64_t(r)));
  return xs;
}

template <class Step>
void time_steps(benchmark::State& st, Step& step, const RowMat& out, Index B, int threads) {
  for (int w = 0; w < 3; ++w) step();  // starts the OpenMP team, faults the states in
  for (auto _ : st) {
    step();
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  if (!lb::all_finite(out)) st.SkipWithError("non-finite output");
  const Index F = Phi{}.feature_dim(kDim);
  const double flops = double(B) * (8.0 * double(kModel) * double(kModel) +
                                    double(kHeads) * 4.0 * double(F) * double(kDim + 1));
  st.SetComplexityN(B);
  lb::set_common_counters(st, flops, B, kDim, kDim, kHeads, threads);
  st.counters["B"] = double(B);
  st.counters["tokens_per_s"] =
      benchmark::Counter(double(B), benchmark::Counter::kIsIterationInvariantRate);
  lb::set_threads(1);
}

void BM_layer_batched(benchmark::State& st, int threads) {
  const Index B = st.range(0);
  lb::set_threads(threads);
  linattn::ParallelOptions par;
  par.num_threads = threads;
  auto batch = layer().make_batched_state(B);
  batch.decoder().reserve_threads(threads);
  const std::vector<RowMat> xs = tokens(B);
  RowMat out(B, kModel);
  Index t = 0;
  const auto step = [&] {
    layer().step(xs[std::size_t(t)], batch, out, par);
    t = (t + 1) % kRing;
  };
  time_steps(st, step, out, B, threads);
}

void BM_layer_separate(benchmark::State& st, int threads) {
  const Index B = st.range(0);
  lb::set_threads(threads);
  std::vector<Layer::State> states;
  for (Index b = 0; b < B; ++b) states.push_back(layer().make_state());
  const std::vector<RowMat> xs = tokens(B);
  RowMat out(B, kModel);
  Index t = 0;
  const auto step = [&] {
    const RowMat& x = xs[std::size_t(t)];
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
#endif
    for (Index b = 0; b < B; ++b)
      layer().step(x.row(b).transpose(), states[std::size_t(b)], out.row(b).transpose());
    t = (t + 1) % kRing;
  };
  time_steps(st, step, out, B, threads);
}

std::vector<Index> batch_sizes(const lb::Profile& p) {
  if (p.name == "smoke") return {1, 4};
  return {1, 4, 16, 64};
}

void register_all(const lb::Profile& p) {
  const std::vector<Index> bs = batch_sizes(p);
  for (const int T : lb::one_and_all_threads()) {
    const std::string tail = lb::key("phi", "elu") + lb::key("dtype", "f32") +
                             lb::key("d_model", kModel) + lb::key("H", kHeads) +
                             lb::key("D", kDim) + lb::key("thr", T);
    lb::add("layer_batched" + tail, bs, "B", benchmark::oN,
            [T](benchmark::State& st) { BM_layer_batched(st, T); })
        ->Unit(benchmark::kMicrosecond)
        ->MinWarmUpTime(0.05);
    lb::add("layer_separate" + tail, bs, "B", benchmark::oN,
            [T](benchmark::State& st) { BM_layer_separate(st, T); })
        ->Unit(benchmark::kMicrosecond)
        ->MinWarmUpTime(0.05);
  }
}

std::string notes(const lb::Profile& p) {
  return "Layer serving: one decode step of a LinearAttentionLayer (d_model 512, 8 heads of "
         "D = M = 64, float, EluPlusOne) for B = " +
         lb::join(batch_sizes(p)) +
         " sequences: LinearAttentionLayer::step on a BatchedState (projections as one product "
         "over the batch) against B single-sequence LinearAttentionLayer::step calls, on 1 thread "
         "and on all threads.";
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
