// Serving many sequences: one decode step for B independent sequences of 8 heads (D = M = 64,
// float, EluPlusOne), B = 1 … 64, as tokens per second:
//   serve_batched   one BatchedRecurrentLinearAttention::step over the B x (H·D) rows, its
//                   (sequence, head) pairs on `thr` threads;
//   serve_separate  B MultiHeadRecurrentLinearAttention::step calls, one per sequence, on one
//                   thread, or spread over `thr` threads with an OpenMP loop over sequences (what
//                   a server without the batched step would write: one sequence's heads stay on
//                   one thread).
// Inputs and outputs are row-major (a framework's [B, H·D] tensors), cycled through a ring of
// distinct tokens. Both forms compute the same values bit for bit (tests/test_serving.cpp).
//
// Counters: tokens_per_s (B per step, a rate), B, H, D, M, threads, GFLOPs (4·F·M per head and
// token), state_bytes (the B·H states with their compensated low parts).
#include <linattn/linattn.hpp>

#include "bench_common.hpp"

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

void counters(benchmark::State& st, Index B, int threads) {
  st.SetComplexityN(B);
  const Index F = Phi{}.feature_dim(kDim);
  lb::set_common_counters(st, double(B * kHeads) * 4.0 * double(F) * double(kDim), B, kDim, kDim,
                          kHeads, threads);
  st.counters["B"] = double(B);
  st.counters["tokens_per_s"] =
      benchmark::Counter(double(B), benchmark::Counter::kIsIterationInvariantRate);
  st.counters["state_bytes"] = double(B * kHeads * 2 * (F * kDim + F) * Index(sizeof(float)));
}

// Times `step` (after one warm-up step, which starts the OpenMP team and faults the states in),
// checks the last outputs and sets the counters.
template <class Step>
void time_steps(benchmark::State& st, Step& step, const Tokens& x, Index B, int threads) {
  step();
  for (auto _ : st) {
    step();
    benchmark::DoNotOptimize(x.out.data());
    benchmark::ClobberMemory();
  }
  if (!lb::all_finite(x.out)) st.SkipWithError("non-finite output");
  counters(st, B, threads);
  lb::set_threads(1);
}

void BM_serve_batched(benchmark::State& st, int threads) {
  const Index B = st.range(0);
  lb::set_threads(threads);
  linattn::ParallelOptions par;
  par.num_threads = threads;
  linattn::BatchedRecurrentLinearAttention<Phi, float> decoder(B, kHeads, kDim, kDim);
  decoder.reserve_threads(threads);
  Tokens x(B, kHeads, kDim, kDim);
  Index t = 0;
  const auto step = [&] {
    decoder.step(x.q[std::size_t(t)], x.k[std::size_t(t)], x.v[std::size_t(t)], x.out, par);
    t = (t + 1) % kRing;
  };
  time_steps(st, step, x, B, threads);
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

std::vector<Index> batch_sizes(const lb::Profile& p) {
  if (p.name == "smoke") return {1, 4};
  return lb::powers_of_two(1, 64);
}

std::vector<int> thread_counts() {
  int all = 1;
#ifdef _OPENMP
  all = omp_get_num_procs();  // run_main has set the default team to one thread by now
#endif
  return all > 1 ? std::vector<int>{1, all} : std::vector<int>{1};
}

void register_all(const lb::Profile& p) {
  const std::vector<Index> bs = batch_sizes(p);
  for (const int T : thread_counts()) {
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
  }
}

std::string notes(const lb::Profile& p) {
  return "Serving: one decode step of B = " + lb::join(batch_sizes(p)) +
         " sequences x 8 heads (D = M = 64, float, EluPlusOne, row-major tokens): "
         "BatchedRecurrentLinearAttention::step against B MultiHeadRecurrentLinearAttention::step "
         "calls, on 1 thread and on all threads.";
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
