// Multi-head forms over the packed layout (Q N×(H·D), K N×(H·D), V N×(H·M), heads side by
// side): linear, causal linear, tiled softmax (non-causal and causal) with H = 8, D = M = 64
// (the configuration of the performance targets) at 1 and 2 threads, and the Eigen GEMMs of
// the same shapes (8 heads' worth, over the packed layout, with the same threads).
// See bench_common.hpp.
#include <linattn/linattn.hpp>

#include "bench_common.hpp"

namespace lb = linattn_bench;
using lb::Index;

namespace {

template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;

constexpr Index kHeads = 8;
constexpr Index kDim = 64;

enum class Kind { Linear, Causal, Softmax, CausalSoftmax };

template <class T>
void BM_multihead(benchmark::State& st, Kind kind, Index H, Index D, int threads) {
  using Phi = linattn::EluPlusOne;
  const Index N = st.range(0), M = D;
  lb::set_threads(threads);
  const Mat<T> Q = lb::random_matrix<T>(N, H * D, 51), K = lb::random_matrix<T>(N, H * D, 52),
               V = lb::random_matrix<T>(N, H * M, 53);
  Mat<T> out = Mat<T>::Zero(N, H * M);
  linattn::MultiHeadWorkspace<T> ws;
  linattn::ParallelOptions par;
  par.num_threads = threads;
  const Phi phi{};
  const Index F = phi.feature_dim(D);
  const auto call = [&] {
    switch (kind) {
      case Kind::Linear:
        linattn::multihead_linear_attention(Q, K, V, H, phi, out, ws, par);
        break;
      case Kind::Causal:
        linattn::multihead_causal_linear_attention(Q, K, V, H, phi, out, ws, linattn::CausalOptions{},
                                                   par);
        break;
      case Kind::Softmax:
        linattn::multihead_softmax_attention(Q, K, V, H, out, ws, linattn::SoftmaxAlgorithm::Tiled, par);
        break;
      case Kind::CausalSoftmax:
        linattn::multihead_causal_softmax_attention(Q, K, V, H, out, ws,
                                                    linattn::SoftmaxAlgorithm::Tiled, par);
        break;
    }
  };
  const bool linear = kind == Kind::Linear || kind == Kind::Causal;
  const bool causal = kind == Kind::Causal || kind == Kind::CausalSoftmax;
  const double flops = double(H) * (linear ? lb::linear_flops(N, N, F, M)
                                           : lb::softmax_flops(N, N, D, M, causal));
  if (lb::worth_warming_up(flops)) call();
  for (auto _ : st) {
    call();
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  if (!lb::all_finite(out)) st.SkipWithError("non-finite output");
  st.SetComplexityN(N);
  lb::set_common_counters(st, flops, N, D, M, H, threads);
  st.counters["ws_bytes"] = double(ws.bytes());
  if (kind == Kind::Causal)  // one state per head, made by the kernel for each call
    st.counters["state_bytes"] = double(H * (F * M + F) * Index(sizeof(T)));
  lb::set_threads(1);
}

void register_all(const lb::Profile& p) {
  for (int T : p.mh_threads) {
    const std::vector<Index> softmax_ns =
        lb::capped(p.mh_ns, T > 1 ? p.mh_softmax_cap_mt : p.mh_softmax_cap);
    const std::string tail = lb::key("dtype", "f32") + lb::key("H", kHeads) + lb::key("D", kDim) +
                             lb::key("thr", T);
    lb::add("mh_gemm_linear" + tail, p.mh_ns, "N", benchmark::oN,
            [T](benchmark::State& st) { lb::run_linear_gemm<float>(st, kHeads, kDim, T); });
    lb::add("mh_linear/phi:elu" + tail, p.mh_ns, "N", benchmark::oN,
            [T](benchmark::State& st) { BM_multihead<float>(st, Kind::Linear, kHeads, kDim, T); });
    lb::add("mh_causal/phi:elu/alg:auto" + tail, p.mh_ns, "N", benchmark::oN,
            [T](benchmark::State& st) { BM_multihead<float>(st, Kind::Causal, kHeads, kDim, T); });
    lb::add("mh_gemm_softmax" + tail, softmax_ns, "N", benchmark::oNSquared,
            [T](benchmark::State& st) { lb::run_softmax_gemm<float>(st, kHeads, kDim, T); });
    lb::add("mh_softmax/alg:tiled" + tail, softmax_ns, "N", benchmark::oNSquared,
            [T](benchmark::State& st) { BM_multihead<float>(st, Kind::Softmax, kHeads, kDim, T); });
    lb::add("mh_causal_softmax/alg:tiled" + tail, softmax_ns, "N", benchmark::oNSquared,
            [T](benchmark::State& st) {
              BM_multihead<float>(st, Kind::CausalSoftmax, kHeads, kDim, T);
            });
  }
}

std::string notes(const lb::Profile& p) {
  return "Multi-head (H = 8, D = M = 64, float, EluPlusOne, threads " +
         [&] {
           std::string s;
           for (int t : p.mh_threads) s += (s.empty() ? "" : ",") + std::to_string(t);
           return s;
         }() +
         "): N = " + lb::join(p.mh_ns) + "; tiled softmax (and its GEMM reference) capped at N <= " +
         std::to_string(p.mh_softmax_cap) + " on 1 thread, N <= " + std::to_string(p.mh_softmax_cap_mt) +
         " on more (8 heads of O(N^2) work).";
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
