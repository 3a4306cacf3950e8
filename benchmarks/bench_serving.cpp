// Serving many sequences: one decode step for B independent sequences of 8 heads (D = M = 64,
// float, EluPlusOne), B = 1 … 64, as tokens per second:
//   serve_batched   one BatchedRecurrentLinearAttention::step over the B x (H·D) rows, its
//                   (sequence, head) pairs on up to `thr` threads (ParallelOptions::num_threads,
//                   the default min_work_per_thread: a step too small to gain from a second
//                   thread runs on one, so thr:2 is never slower than thr:1); also at H = 2,
//                   D = M = 4, B = 4 (the tiny step);
//   serve_separate  B MultiHeadRecurrentLinearAttention::step calls, one per sequence, on one
//                   thread, or spread over `thr` threads with an OpenMP loop over sequences (what
//                   a server without the batched step would write: one sequence's heads stay on
//                   one thread).
//   layer_step      LinearAttentionLayer::step of one sequence (d_model 512 = 8 heads of 64, and
//                   the copy task's d_model 64 = 4 heads of 16) with OpenMP's default team (and
//                   Eigen's) set to `thr` threads: the layer step takes no ParallelOptions.
//   omp_fork_join   an empty `#pragma omp parallel num_threads(thr)` region, after `gap` us of
//                   serial work on the calling thread (0: back to back, the team's workers still
//                   spinning; 100 and 1000: woken, or waiting for a time slice when the other
//                   cores are busy): what ParallelOptions::kDefaultMinWorkPerThread is
//                   measured from (OpenMP only, thr > 1 only; manual time of the region alone).
// Inputs and outputs are row-major (a framework's [B, H·D] tensors), cycled through a ring of
// distinct tokens. Both forms compute the same values bit for bit (tests/serving/test_serving.cpp).
//
// Counters: tokens_per_s (B per step, a rate), B, H, D, M, threads, GFLOPs (4·F·M per head and
// token), state_bytes (the B·H states with their compensated low parts).
#include <linattn/linattn.hpp>

#include "bench_common.hpp"

#include <chrono>
#include <vector>

namespace lb = linattn_bench;
using lb::Index;

namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Phi = linattn::EluPlusOne;

constexpr Index kHeads = 8, kDim = 64;
constexpr Index kRing = 4;  // distinct token sets cycled through by the timed steps

struct Tokens {
  std::vector<RowMat> q, k, v;
  RowMat out;
  Tokens(Index B, Index H, Index D, Index M) : out(RowMat::Zero(B, H * M)) {
    for (Index r = 0; r < kRing; ++r) {
      q.push_back(lb::random_matrix<float>(B, H * D, 100 + 3 * std::uint64_t(r)));
      k.push_back(lb::random_matrix<float>(B, H * D, 101 + 3 * std::uint64_t(r)));
      v.push_back(lb::random_matrix<float>(B, H * M, 102 + 3 * std::uint64_t(r)));
    }
  }
};

void counters(benchmark::State& st, Index B, int threads, Index H = kHeads, Index D = kDim) {
  st.SetComplexityN(B);
  const Index F = Phi{}.feature_dim(D);
  lb::set_common_counters(st, double(B * H) * 4.0 * double(F) * double(D), B, D, D, H, threads);
  st.counters["B"] = double(B);
  st.counters["tokens_per_s"] =
      benchmark::Counter(double(B), benchmark::Counter::kIsIterationInvariantRate);
  st.counters["state_bytes"] = double(B * H * 2 * (F * D + F) * Index(sizeof(float)));
}

// Times `step` (after one warm-up step, which starts the OpenMP team and faults the states in),
// checks the last outputs and sets the counters.
template <class Step>
void time_steps(benchmark::State& st, Step& step, const Tokens& x, Index B, int threads,
                Index H = kHeads, Index D = kDim) {
  step();
  for (auto _ : st) {
    step();
    benchmark::DoNotOptimize(x.out.data());
    benchmark::ClobberMemory();
  }
  if (!lb::all_finite(x.out)) st.SkipWithError("non-finite output");
  counters(st, B, threads, H, D);
  lb::set_threads(1);
}

void BM_serve_batched(benchmark::State& st, int threads, Index H = kHeads, Index D = kDim) {
  const Index B = st.range(0);
  lb::set_threads(threads);
  linattn::ParallelOptions par;
  par.num_threads = threads;  // at most: the default min_work_per_thread decides
  linattn::BatchedRecurrentLinearAttention<Phi, float> decoder(B, H, D, D);
  decoder.reserve_threads(threads);
  Tokens x(B, H, D, D);
  Index t = 0;
  const auto step = [&] {
    decoder.step(x.q[std::size_t(t)], x.k[std::size_t(t)], x.v[std::size_t(t)], x.out, par);
    t = (t + 1) % kRing;
  };
  time_steps(st, step, x, B, threads, H, D);
}

// One LinearAttentionLayer::step of one sequence, OpenMP's and Eigen's default team set to
// `threads` (what a program such as examples/copy_task.cpp runs with OMP_NUM_THREADS=threads).
void BM_layer_step(benchmark::State& st, int threads, Index H) {
  const Index d_model = st.range(0);
  lb::set_threads(threads);
  Eigen::setNbThreads(threads);
  linattn::LinearAttentionLayer<Phi, float> layer(d_model, H);
  auto state = layer.make_state();
  std::vector<Eigen::VectorXf> xs;
  for (Index r = 0; r < kRing; ++r)
    xs.push_back(lb::random_matrix<float>(d_model, 1, 200 + std::uint64_t(r)));
  Eigen::VectorXf y(d_model);
  Index t = 0;
  const auto step = [&] {
    layer.step(xs[std::size_t(t)], state, y);
    t = (t + 1) % kRing;
  };
  step();
  for (auto _ : st) {
    step();
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  if (!y.allFinite()) st.SkipWithError("non-finite output");
  const Index D = d_model / H;
  // Projections (4 matrix-vector products of d_model x d_model) and H recurrent heads.
  const double flops = 8.0 * double(d_model) * double(d_model) + double(H) * 4.0 * double(D) * double(D);
  lb::set_common_counters(st, flops, 1, D, D, H, threads);
  st.counters["tokens_per_s"] = benchmark::Counter(1.0, benchmark::Counter::kIsIterationInvariantRate);
  Eigen::setNbThreads(1);
  lb::set_threads(1);
}

void BM_serve_separate(benchmark::State& st, int threads) {
  const Index B = st.range(0);
  lb::set_threads(threads);
  std::vector<linattn::MultiHeadRecurrentLinearAttention<Phi, float>> rnn;
  for (Index b = 0; b < B; ++b) rnn.emplace_back(kHeads, kDim, kDim);
  Tokens x(B, kHeads, kDim, kDim);
  Index t = 0;
  const auto step = [&] {
    const RowMat &q = x.q[std::size_t(t)], &k = x.k[std::size_t(t)], &v = x.v[std::size_t(t)];
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
#endif
    for (Index b = 0; b < B; ++b)
      rnn[std::size_t(b)].step(q.row(b), k.row(b), v.row(b), x.out.row(b));
    t = (t + 1) % kRing;
  };
  time_steps(st, step, x, B, threads);
}

#ifdef _OPENMP
void BM_omp_fork_join(benchmark::State& st, int threads) {
  const double gap = double(st.range(0)) * 1e-6;
  using clock = std::chrono::steady_clock;
  volatile int sink = 0;
  for (auto _ : st) {
    const auto g0 = clock::now();
    while (std::chrono::duration<double>(clock::now() - g0).count() < gap) {
    }
    const auto t0 = clock::now();
#pragma omp parallel num_threads(threads)
    { sink = sink + 1; }
    st.SetIterationTime(std::chrono::duration<double>(clock::now() - t0).count());
  }
  st.counters["threads"] = threads;
  st.counters["gap_us"] = double(st.range(0));
  (void)sink;
}
#endif

std::vector<Index> batch_sizes(const lb::Profile& p) {
  if (p.name == "smoke") return {1, 4};
  return lb::powers_of_two(1, 64);
}

void register_all(const lb::Profile& p) {
  const std::vector<Index> bs = batch_sizes(p);
  for (const int T : lb::one_and_all_threads()) {
    const std::string tail = lb::key("phi", "elu") + lb::key("dtype", "f32") +
                             lb::key("H", kHeads) + lb::key("D", kDim) + lb::key("thr", T);
    lb::add("serve_batched" + tail, bs, "B", benchmark::oN,
            [T](benchmark::State& st) { BM_serve_batched(st, T); })
        ->Unit(benchmark::kMicrosecond)
        ->MinWarmUpTime(0.05);
    lb::add("serve_separate" + tail, bs, "B", benchmark::oN,
            [T](benchmark::State& st) { BM_serve_separate(st, T); })
        ->Unit(benchmark::kMicrosecond)
        ->MinWarmUpTime(0.05);
    // The tiny step: 4 sequences x 2 heads of D = M = 4.
    const std::string tiny = lb::key("phi", "elu") + lb::key("dtype", "f32") + lb::key("H", 2) +
                             lb::key("D", 4) + lb::key("thr", T);
    lb::add("serve_batched" + tiny, {4}, "B", benchmark::oN,
            [T](benchmark::State& st) { BM_serve_batched(st, T, 2, 4); })
        ->Unit(benchmark::kMicrosecond)
        ->MinWarmUpTime(0.05);
    // The layer step: 8 heads of 64, and the copy task's 4 heads of 16.
    for (const Index H : {Index(8), Index(4)}) {
      const Index d_model = H == 8 ? 512 : 64;
      const std::string layer = lb::key("phi", "elu") + lb::key("dtype", "f32") + lb::key("H", H) +
                                lb::key("D", d_model / H) + lb::key("thr", T);
      lb::add("layer_step" + layer, {d_model}, "d_model", benchmark::oN,
              [T, H](benchmark::State& st) { BM_layer_step(st, T, H); })
          ->Unit(benchmark::kMicrosecond)
          ->MinWarmUpTime(0.05);
    }
#ifdef _OPENMP
    if (T > 1) {
      auto* b = benchmark::RegisterBenchmark(("omp_fork_join" + lb::key("thr", T)).c_str(),
                                             [T](benchmark::State& st) { BM_omp_fork_join(st, T); });
      b->ArgName("gap")->UseManualTime()->Unit(benchmark::kMicrosecond)->MinWarmUpTime(0.05);
      for (const int64_t gap : {0, 100, 1000}) b->Arg(gap);
    }
#endif
  }
}

std::string notes(const lb::Profile& p) {
  return "Serving: one decode step of B = " + lb::join(batch_sizes(p)) +
         " sequences x 8 heads (D = M = 64, float, EluPlusOne, row-major tokens): "
         "BatchedRecurrentLinearAttention::step against B MultiHeadRecurrentLinearAttention::step "
         "calls, on 1 thread and on all threads (the batched step on at most that many: the "
         "default ParallelOptions::min_work_per_thread); the tiny step (B = 4, H = 2, "
         "D = M = 4); LinearAttentionLayer::step (d_model 512 and 64) with OpenMP's default team "
         "set to 1 and to all threads; the cost of an empty OpenMP parallel region.";
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
