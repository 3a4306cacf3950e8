// bf16 and half storage against float, in one run:
//   prefill/dtype:<t>/H:8/D:64/N:<n>      multihead_causal_linear_attention on packed row-major
//                                        N x 8·64 inputs and output, one thread, EluPlusOne
//                                        (form:ret: the returning form)
//   decode/dtype:<t>/state:<s>/H:8/D:64/B:<b>   one BatchedRecurrentLinearAttention step of B
//                                        sequences x 8 heads (tokens in <t>, states in <s>:
//                                        float, or the storage type)
// Counters: tokens_per_s (prefill: N per call; decode: B per step), bytes_in (the inputs' bytes).
// --drift prints the accuracy cost of bf16 / half decode states instead (docs/SPEC.md §8).
// Profiles: --quick (N = 4096, 16384; B = 1, 64), --full (adds N = 65536, B = 256), --smoke or
// LINATTN_BENCH_PROFILE=smoke (N = 256, B = 1, 4: CI's smoke test).
#include <benchmark/benchmark.h>

#include <linattn/linattn.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace {

using Index = Eigen::Index;
template <class T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

constexpr Index kHeads = 8, kDim = 64;

template <class T>
RowMat<T> random_rows(Index rows, Index cols, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  RowMat<T> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = T(dist(gen));
  return m;
}

template <class T>
const char* dtype() {
  if constexpr (std::is_same_v<T, float>) return "f32";
  if constexpr (std::is_same_v<T, Eigen::bfloat16>) return "bf16";
  return "f16";
}

template <class T>
void BM_prefill(benchmark::State& st, Index N) {
  const RowMat<T> Q = random_rows<T>(N, kHeads * kDim, 1), K = random_rows<T>(N, kHeads * kDim, 2),
                  V = random_rows<T>(N, kHeads * kDim, 3);
  RowMat<T> out(N, kHeads * kDim);
  linattn::MultiHeadWorkspace<float> ws;
  linattn::ParallelOptions serial;
  serial.num_threads = 1;
  for (auto _ : st) {
    linattn::multihead_causal_linear_attention(Q, K, V, kHeads, linattn::EluPlusOne{}, out, ws,
                                               linattn::CausalOptions{}, serial);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  st.counters["tokens_per_s"] =
      benchmark::Counter(double(N), benchmark::Counter::kIsIterationInvariantRate);
  st.counters["bytes_in"] = double(3 * Q.size() * Index(sizeof(T)));
}

// The returning form (what most callers write): a fresh result matrix per call.
template <class T>
void BM_prefill_returning(benchmark::State& st, Index N) {
  const RowMat<T> Q = random_rows<T>(N, kHeads * kDim, 1), K = random_rows<T>(N, kHeads * kDim, 2),
                  V = random_rows<T>(N, kHeads * kDim, 3);
  linattn::ParallelOptions serial;
  serial.num_threads = 1;
  for (auto _ : st) {
    auto out = linattn::multihead_causal_linear_attention(Q, K, V, kHeads, linattn::EluPlusOne{},
                                                          linattn::CausalOptions{}, serial);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  st.counters["tokens_per_s"] =
      benchmark::Counter(double(N), benchmark::Counter::kIsIterationInvariantRate);
}

template <class T, class StateT>
void BM_decode(benchmark::State& st, Index B) {
  constexpr Index kRing = 64;
  const RowMat<T> q = random_rows<T>(kRing * B, kHeads * kDim, 4),
                  k = random_rows<T>(kRing * B, kHeads * kDim, 5),
                  v = random_rows<T>(kRing * B, kHeads * kDim, 6);
  linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float, StateT> rnn(B, kHeads, kDim,
                                                                                 kDim);
  RowMat<T> out(B, kHeads * kDim);
  linattn::ParallelOptions serial;
  serial.num_threads = 1;
  // States of a prefilled conversation: 1024 steps first, so that S is not zero.
  for (Index t = 0; t < 1024; ++t) {
    const Index r = (t % kRing) * B;
    rnn.step(q.middleRows(r, B), k.middleRows(r, B), v.middleRows(r, B), out, serial);
  }
  Index t = 0;
  for (auto _ : st) {
    const Index r = t * B;
    rnn.step(q.middleRows(r, B), k.middleRows(r, B), v.middleRows(r, B), out, serial);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
    t = (t + 1) % kRing;
  }
  st.counters["tokens_per_s"] =
      benchmark::Counter(double(B), benchmark::Counter::kIsIterationInvariantRate);
  // A float state has S and its low part (two F x M floats) plus z and its low part; a bf16 /
  // half state one F x M matrix of them plus z and its low part in float.
  st.counters["state_bytes"] =
      std::is_same_v<StateT, float>
          ? double(B * kHeads * 2 * (kDim * kDim + kDim) * Index(sizeof(float)))
          : double(B * kHeads * (kDim * kDim * Index(sizeof(StateT)) + 2 * kDim * Index(sizeof(float))));
}

template <class T>
void register_type(const std::vector<Index>& ns, const std::vector<Index>& bs) {
  const std::string t = dtype<T>();
  for (Index n : ns) {
    benchmark::RegisterBenchmark(
        ("prefill/dtype:" + t + "/H:8/D:64/N:" + std::to_string(n)).c_str(),
        [n](benchmark::State& st) { BM_prefill<T>(st, n); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark(
        ("prefill/dtype:" + t + "/H:8/D:64/form:ret/N:" + std::to_string(n)).c_str(),
        [n](benchmark::State& st) { BM_prefill_returning<T>(st, n); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  for (Index b : bs) {
    benchmark::RegisterBenchmark(
        ("decode/dtype:" + t + "/state:f32/H:8/D:64/B:" + std::to_string(b)).c_str(),
        [b](benchmark::State& st) { BM_decode<T, float>(st, b); })
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
    // States in the storage type (float tokens with bf16 states under the bf16 heading).
    if constexpr (!std::is_same_v<T, float>)
      benchmark::RegisterBenchmark(
          ("decode/dtype:" + t + "/state:" + t + "/H:8/D:64/B:" + std::to_string(b)).c_str(),
          [b](benchmark::State& st) { BM_decode<T, T>(st, b); })
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
  }
}

// --drift: what keeping the decode states in bf16 / half costs in accuracy (docs/SPEC.md §8).
// One sequence of one head (D = M = 64, EluPlusOne), q and k uniform in [-1, 1], v in [-1, 1] or
// [0, 1]; the relative error of the outputs of the last tenth of the tokens up to each length
// against a decoder with float states.
template <class StateT>
double drift(Index tokens, bool positive_values) {
  linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float, StateT> low(1, 1, kDim, kDim);
  linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float> full(1, 1, kDim, kDim);
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Eigen::RowVectorXf q(kDim), k(kDim), v(kDim), a(kDim), b(kDim);
  double num = 0, den = 0;
  for (Index t = 1; t <= tokens; ++t) {
    for (Index i = 0; i < kDim; ++i) {
      q(i) = u(gen);
      k(i) = u(gen);
    }
    for (Index i = 0; i < kDim; ++i) v(i) = positive_values ? 0.5f * (u(gen) + 1.0f) : u(gen);
    low.step(q, k, v, a);
    full.step(q, k, v, b);
    if (t > tokens - tokens / 10) {
      num += double((a - b).squaredNorm());
      den += double(b.squaredNorm());
    }
  }
  return std::sqrt(num / den);
}

void print_drift() {
  std::printf("| tokens | bf16, v in [-1, 1] | half, v in [-1, 1] | bf16, v in [0, 1] | half, v in [0, 1] |\n");
  std::printf("|---:|---:|---:|---:|---:|\n");
  for (Index n : {Index(100), Index(1000), Index(10000), Index(100000)})
    std::printf("| %lld | %.2g | %.2g | %.2g | %.2g |\n", static_cast<long long>(n),
                drift<Eigen::bfloat16>(n, false), drift<Eigen::half>(n, false),
                drift<Eigen::bfloat16>(n, true), drift<Eigen::half>(n, true));
}

}  // namespace

int main(int argc, char** argv) {
  // The suite's profiles (bench_common.hpp): --quick (default), --full, --smoke, or
  // LINATTN_BENCH_PROFILE; the flag is taken out before Google Benchmark reads the rest.
  const char* env = std::getenv("LINATTN_BENCH_PROFILE");
  std::string profile = env != nullptr ? env : "quick";
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--drift") {
      print_drift();
      return 0;
    }
    if (a == "--quick" || a == "--full" || a == "--smoke")
      profile = a.substr(2);
    else
      argv[kept++] = argv[i];
  }
  argc = kept;
  // full adds B = 256, where the float states (67 MB) leave the cache and the bytes decide.
  std::vector<Index> ns = {4096, 16384}, bs = {1, 64};
  if (profile == "smoke") ns = {256}, bs = {1, 4};
  if (profile == "full") ns = {4096, 16384, 65536}, bs = {1, 64, 256};
  // Interleaved by type so that float and its low-precision forms run side by side.
  register_type<float>(ns, bs);
  register_type<Eigen::bfloat16>(ns, bs);
  register_type<Eigen::half>(ns, bs);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
