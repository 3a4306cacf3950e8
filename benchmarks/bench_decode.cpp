// Per-token decode step at positions 1k … 64k: the recurrent form (RecurrentLinearAttention,
// MultiHeadRecurrentLinearAttention with 8 heads) against a softmax step of one query over a
// KV cache of length pos. See bench_common.hpp.
//
// The recurrent state is prefilled with the parallel chunked kernel over pos random tokens and
// handed over with set_state(); the timed steps then continue the sequence (its cost does not
// depend on the position, which is what the sweep shows). The softmax step writes the new key
// and value into the cache's last row and attends over all pos rows, so the cache length stays
// pos.
#include <linattn/linattn.hpp>

#include "bench_common.hpp"

namespace lb = linattn_bench;
using lb::Index;

namespace {

template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;

constexpr Index kRing = 64;        // distinct tokens cycled through by the timed steps
constexpr int kRepetitions = 5;  // of each recurrent decode measurement (median reported)

// The state after `pos` random tokens, computed with the chunked kernel in pieces.
template <class Phi, class T>
linattn::LinearAttentionState<T> prefill(const Phi& phi, Index pos, Index D, Index M,
                                         std::uint64_t seed) {
  auto state = linattn::make_state<T>(phi, D, M);
  linattn::Workspace<T> ws;
  constexpr Index kPiece = 4096;
  Mat<T> out(std::min(kPiece, pos), M);
  for (Index r0 = 0; r0 < pos; r0 += kPiece) {
    const Index b = std::min(kPiece, pos - r0);
    const Mat<T> Q = lb::random_matrix<T>(b, D, seed + 3 * std::uint64_t(r0) + 1);
    const Mat<T> K = lb::random_matrix<T>(b, D, seed + 3 * std::uint64_t(r0) + 2);
    const Mat<T> V = lb::random_matrix<T>(b, M, seed + 3 * std::uint64_t(r0) + 3);
    linattn::causal_linear_attention(Q, K, V, phi, state, out.topRows(b), ws);
  }
  return state;
}

template <class T>
void decode_counters(benchmark::State& st, double flops, Index pos, Index D, Index M, Index H) {
  st.SetComplexityN(pos);
  lb::set_common_counters(st, flops, 1, D, M, H, 1);
  st.counters["pos"] = double(pos);
}

template <class T>
void BM_decode_recurrent(benchmark::State& st, Index H, Index D) {
  using Phi = linattn::EluPlusOne;
  const Index pos = st.range(0), M = D;
  const Phi phi{};
  const Index F = phi.feature_dim(D);
  const Mat<T> q = lb::random_matrix<T>(H * D, kRing, 31), k = lb::random_matrix<T>(H * D, kRing, 32),
               v = lb::random_matrix<T>(H * M, kRing, 33);
  Eigen::Matrix<T, Eigen::Dynamic, 1> out(H * M);
  Index t = 0;
  if (H == 1) {
    linattn::RecurrentLinearAttention<Phi, T> rnn(D, M);
    rnn.set_state(prefill<Phi, T>(phi, pos, D, M, 100), pos);
    for (auto _ : st) {
      rnn.step(q.col(t), k.col(t), v.col(t), out);
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
      t = (t + 1) % kRing;
    }
  } else {
    linattn::MultiHeadRecurrentLinearAttention<Phi, T> rnn(H, D, M);
    for (Index h = 0; h < H; ++h)
      rnn.head(h).set_state(prefill<Phi, T>(phi, pos, D, M, 100 + 1000 * std::uint64_t(h)), pos);
    for (auto _ : st) {
      rnn.step(q.col(t), k.col(t), v.col(t), out);
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
      t = (t + 1) % kRing;
    }
  }
  if (!lb::all_finite(out)) st.SkipWithError("non-finite output");
  decode_counters<T>(st, double(H) * 4.0 * double(F) * double(M), pos, D, M, H);
  st.counters["ws_bytes"] = 0;  // step() uses the object's fixed 1-row scratch only
  // S and z with their low parts (the compensated sums, see LinearAttentionState).
  st.counters["state_bytes"] = double(H * 2 * (F * M + F) * Index(sizeof(T)));
}

template <class T>
void BM_decode_softmax(benchmark::State& st, Index H, Index D) {
  const Index pos = st.range(0), M = D;
  Mat<T> Kc = lb::random_matrix<T>(pos, H * D, 41), Vc = lb::random_matrix<T>(pos, H * M, 42);
  const Mat<T> q = lb::random_matrix<T>(kRing, H * D, 43), k = lb::random_matrix<T>(kRing, H * D, 44),
               v = lb::random_matrix<T>(kRing, H * M, 45);
  Mat<T> out = Mat<T>::Zero(1, H * M);
  linattn::Workspace<T> ws;
  linattn::MultiHeadWorkspace<T> mws;
  linattn::ParallelOptions serial;
  serial.num_threads = 1;
  Index t = 0;
  const auto step = [&] {
    Kc.row(pos - 1) = k.row(t);
    Vc.row(pos - 1) = v.row(t);
    if (H == 1)
      linattn::softmax_attention(q.row(t), Kc, Vc, out, ws);
    else
      linattn::multihead_softmax_attention(q.row(t), Kc, Vc, H, out, mws,
                                           linattn::SoftmaxAlgorithm::Tiled, serial);
    t = (t + 1) % kRing;
  };
  step();  // warm-up: sizes the workspace
  for (auto _ : st) {
    step();
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  if (!lb::all_finite(out)) st.SkipWithError("non-finite output");
  decode_counters<T>(st, double(H) * lb::softmax_flops(1, pos, D, M, false), pos, D, M, H);
  st.counters["ws_bytes"] = double(H == 1 ? ws.bytes() : mws.bytes());
  st.counters["state_bytes"] = double((Kc.size() + Vc.size()) * Index(sizeof(T)));  // KV cache
}

void register_one(const lb::Profile& p, Index H, Index D) {
  const std::string tail = lb::key("dtype", "f32") + lb::key("H", H) + lb::key("D", D);
  lb::add("decode_recurrent/phi:elu" + tail, p.positions, "pos", benchmark::o1,
          [H, D](benchmark::State& st) { BM_decode_recurrent<float>(st, H, D); })
      ->Unit(benchmark::kMicrosecond)
      // The first position measured ran 10% slower than the rest without it (clock ramp-up,
      // cold caches): the flatness target compares positions, not warm and cold runs.
      ->MinWarmUpTime(0.05)
      // A step's work does not depend on the position, but one 0.1 s measurement on a shared
      // machine varies by ±5%: the report takes the median of five, so that the flatness it
      // prints is the kernel's, not the neighbours'.
      ->Repetitions(kRepetitions)
      ->DisplayAggregatesOnly(true);
  lb::add("decode_softmax/alg:tiled" + tail, p.positions, "pos", benchmark::oN,
          [H, D](benchmark::State& st) { BM_decode_softmax<float>(st, H, D); })
      ->Unit(benchmark::kMicrosecond)
      ->MinWarmUpTime(0.05);
}

void register_all(const lb::Profile& p) {
  register_one(p, 8, 64);  // the target configuration: 8 heads, D = M = 64
  for (Index D : p.decode_dims) register_one(p, 1, D);
}

std::string notes(const lb::Profile& p) {
  return "Decode step at positions " + lb::join(p.positions) +
         " (8 heads at D = M = 64; one head at D = M = " + lb::join(p.decode_dims) +
         "), one thread, EluPlusOne; softmax = one query over a KV cache of pos rows (tiled).";
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
