// Single-head softmax attention, naive (N×L scores) and tiled (online softmax), non-causal and
// causal, and the Eigen GEMMs of the same shapes. See bench_common.hpp.
#include <linattn/linattn.hpp>

#include "bench_common.hpp"

namespace lb = linattn_bench;
using lb::Index;

namespace {

template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;

template <class T>
void BM_softmax(benchmark::State& st, Index D, linattn::SoftmaxAlgorithm algorithm, bool causal) {
  const Index N = st.range(0), M = D;
  const Mat<T> Q = lb::random_matrix<T>(N, D, 7), K = lb::random_matrix<T>(N, D, 8),
               V = lb::random_matrix<T>(N, M, 9);
  Mat<T> out = Mat<T>::Zero(N, M);
  linattn::Workspace<T> ws;
  const auto call = [&] {
    if (causal)
      linattn::causal_softmax_attention(Q, K, V, out, ws, algorithm);
    else
      linattn::softmax_attention(Q, K, V, out, ws, algorithm);
  };
  const double flops = lb::softmax_flops(N, N, D, M, causal);
  if (lb::worth_warming_up(flops)) call();
  for (auto _ : st) {
    call();
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  if (!lb::all_finite(out)) st.SkipWithError("non-finite output");
  st.SetComplexityN(N);
  lb::set_common_counters(st, flops, N, D, M, 1, 1);
  st.counters["ws_bytes"] = double(ws.bytes());
}

template <class T>
void register_dtype(Index D, const std::vector<Index>& tiled_ns, const std::vector<Index>& naive_ns) {
  const std::string tail = lb::key("dtype", lb::dtype_name<T>()) + lb::key("D", D);
  lb::add("gemm_softmax" + tail, tiled_ns, "N", benchmark::oNSquared,
          [D](benchmark::State& st) { lb::run_softmax_gemm<T>(st, 1, D, 1); });
  for (const bool causal : {false, true}) {
    const std::string kind = causal ? "causal_softmax" : "softmax";
    lb::add(kind + "/alg:tiled" + tail, tiled_ns, "N", benchmark::oNSquared,
            [D, causal](benchmark::State& st) {
              BM_softmax<T>(st, D, linattn::SoftmaxAlgorithm::Tiled, causal);
            });
    if (!naive_ns.empty())
      lb::add(kind + "/alg:naive" + tail, naive_ns, "N", benchmark::oNSquared,
              [D, causal](benchmark::State& st) {
                BM_softmax<T>(st, D, linattn::SoftmaxAlgorithm::Naive, causal);
              });
  }
}

void register_all(const lb::Profile& p) {
  for (Index D : p.dims)
    register_dtype<float>(D, lb::capped(p.ns, p.softmax_tiled_cap),
                          lb::capped(p.ns, p.softmax_naive_cap));
  const Index dcap = std::min(p.double_cap, p.softmax_tiled_cap);
  for (Index D : p.every_variant ? p.dims : std::vector<Index>{64})
    register_dtype<double>(D, lb::capped(p.ns, dcap), {});
}

std::string notes(const lb::Profile& p) {
  const Index nmax = p.ns.empty() ? 0 : p.ns.back();
  const double naive_mib = double(p.softmax_naive_cap) * double(p.softmax_naive_cap) * 4.0 / 1048576.0;
  return "Softmax capped: tiled (and its GEMM reference) at N <= " +
         std::to_string(p.softmax_tiled_cap) + " (O(N^2) time; the linear sweep goes to " +
         std::to_string(nmax) + "), naive at N <= " + std::to_string(p.softmax_naive_cap) +
         " (its N x L float scores take " + std::to_string(int(naive_mib)) +
         " MiB there and grow 4x per doubling); double precision (tiled) at N <= " +
         std::to_string(std::min(p.double_cap, p.softmax_tiled_cap)) + ".";
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
