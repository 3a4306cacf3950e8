// Shared helpers of the linattn benchmark programs (bench_*.cpp).
//
// Every program registers its benchmarks at run time from a *profile*:
//   quick (default)  N = 256 … 16384, D = M = 64, softmax capped (see caps()), short runs
//   full  (--full)   N = 256 … 65536, D = M ∈ {32, 64, 128}, every variant
//   smoke (--smoke)  the smallest size of everything (CI: checks the binaries run)
// The profile can also come from the environment: LINATTN_BENCH_PROFILE=quick|full|smoke.
//
// Benchmark names are machine-readable for benchmarks/report.py:
//   <kind>/<key>:<value>/.../N:<n>            e.g. linear/phi:elu/dtype:f32/D:64/N:4096
// layout:row|hnd|hnd_batched|col names the memory layout of the inputs and form:ret the
// returning form; a name without them means column-major inputs and the out-parameter form
// with a reused workspace (report.py fills in those defaults).
// (Google Benchmark appends /real_time: every benchmark measures wall-clock time, because the
// multi-head kernels run OpenMP threads of their own.)
//
// Counters (all per call of the kernel):
//   GFLOPs       useful GFLOP/s (a kIsRate counter): linear 4·N·F·M per head, softmax
//                4·N·L·D (M = D) per head, half of the pairs when causal
//   flops        the useful flop count of one call
//   ws_bytes     linattn::Workspace::bytes() after the calls (the kernel's working memory)
//   state_bytes  recurrent state / KV cache held between calls (causal and decode kernels)
//   N, D, M, H, threads, pos   the shape
#pragma once

#include <benchmark/benchmark.h>

#include <Eigen/Core>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <ctime>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace linattn_bench {

using Index = Eigen::Index;

// ---------------------------------------------------------------------------------------------
// Profile
// ---------------------------------------------------------------------------------------------

struct Profile {
  std::string name = "quick";
  std::vector<Index> ns;             // single-head sweep of N (= L)
  std::vector<Index> dims;           // D = M values of the single-head sweeps
  std::vector<Index> chunks;         // explicit chunk sizes of CausalAlgorithm::Chunked
  bool every_variant = false;        // every feature map at every chunk size (else: EluPlusOne)
  Index softmax_tiled_cap = 0;       // largest N of the single-head tiled softmax
  Index softmax_naive_cap = 0;       // largest N of the naive softmax (N·L·sizeof(T) bytes)
  Index double_cap = 0;              // largest N of the double-precision subset
  std::vector<Index> mh_ns;          // multi-head sweep (H = 8, D = M = 64)
  Index mh_softmax_cap = 0;          // largest N of the multi-head tiled softmax (1 thread)
  Index mh_softmax_cap_mt = 0;       // the same with more than one thread
  Index mh_ret_softmax_cap = 0;      // largest N of the multi-head softmax returning forms
  std::vector<int> mh_threads;       // thread counts of the multi-head forms
  std::vector<Index> positions;      // decode positions
  std::vector<Index> decode_dims;    // D = M of the single-head decode benchmarks
  const char* min_time = "0.1";      // default --benchmark_min_time (seconds)
};

inline std::vector<Index> powers_of_two(Index lo, Index hi) {
  std::vector<Index> v;
  for (Index n = lo; n <= hi; n *= 2) v.push_back(n);
  return v;
}

inline std::vector<Index> capped(const std::vector<Index>& ns, Index cap) {
  std::vector<Index> v;
  for (Index n : ns)
    if (n <= cap) v.push_back(n);
  return v;
}

inline Profile make_profile(const std::string& name) {
  Profile p;
  p.name = name;
  if (name == "full") {
    p.ns = powers_of_two(256, 65536);
    p.dims = {32, 64, 128};
    p.chunks = {16, 32, 64, 128, 256};
    p.every_variant = true;
    p.softmax_tiled_cap = 32768;
    p.softmax_naive_cap = 8192;
    p.double_cap = 65536;
    p.mh_ns = powers_of_two(256, 65536);
    p.mh_softmax_cap = 16384;
    p.mh_softmax_cap_mt = 16384;
    p.mh_ret_softmax_cap = 16384;
    p.mh_threads = {1, 2};
    p.positions = powers_of_two(1024, 65536);
    p.decode_dims = {32, 64, 128};
    p.min_time = "0.5";
  } else if (name == "smoke") {
    p.ns = {256};
    p.dims = {64};
    p.chunks = {64};
    p.softmax_tiled_cap = 256;
    p.softmax_naive_cap = 256;
    p.double_cap = 256;
    p.mh_ns = {256};
    p.mh_softmax_cap = 256;
    p.mh_softmax_cap_mt = 256;
    p.mh_ret_softmax_cap = 256;
    p.mh_threads = {1, 2};
    p.positions = {1024};
    p.decode_dims = {64};
    p.min_time = "0.01";
  } else {  // quick
    p.name = "quick";
    p.ns = powers_of_two(256, 16384);
    p.dims = {64};
    p.chunks = {32, 64, 128, 256};
    p.softmax_tiled_cap = 16384;
    p.softmax_naive_cap = 4096;
    p.double_cap = 4096;
    p.mh_ns = powers_of_two(256, 16384);
    p.mh_softmax_cap = 16384;
    p.mh_softmax_cap_mt = 8192;
    p.mh_ret_softmax_cap = 4096;  // the allocations are O(N); the O(N^2) work hides them beyond
    p.mh_threads = {1, 2};
    p.positions = {1024, 4096, 16384, 65536};
    p.decode_dims = {64};
    p.min_time = "0.1";
  }
  return p;
}

inline Profile& profile() {
  static Profile p = make_profile("quick");
  return p;
}

// ---------------------------------------------------------------------------------------------
// Data, threads, counters
// ---------------------------------------------------------------------------------------------

// Uniform values in [-scale, scale) from a splitmix64 stream: deterministic and much faster
// than Eigen's Random (std::rand) for the large KV caches.
template <class T>
Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> random_matrix(Index rows, Index cols,
                                                               std::uint64_t seed,
                                                               T scale = T(1)) {
  Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> m(rows, cols);
  std::uint64_t s = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  T* p = m.data();
  for (Index i = 0, n = m.size(); i < n; ++i) {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const double u = double(z >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
    p[i] = T((2.0 * u - 1.0) * double(scale));
  }
  return m;
}

// The median of per-iteration figures (the pair benchmarks' ratios: robust to the iterations a
// neighbour on the machine disturbs).
// CPU time of the calling thread: on a shared machine, where other processes take the core from
// the benchmark, the ratios of CPU times stay close to an idle machine's when wall times do not.
inline double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

// ---------------------------------------------------------------------------------------------
// The FMA peak of one core, measured in the calling process (the programs that report a fraction
// of the peak beside their kernels, so that a neighbour's load falls on both): kChains independent
// accumulators of Eigen's widest packet (Packet16f with AVX-512, Packet8f with AVX2) updated by
// pmadd, a true FMA where the ISA has one; 2·lanes flops per FMA. The fastest of kBlocks blocks
// of ~5 ms each (another process on the core can only slow a block down). bench_roofline measures
// the same with each ISA's intrinsics and a longer calibration; this is its short form.
// ---------------------------------------------------------------------------------------------

template <class T>
volatile T g_peak_sink = T(0);

template <class T>
T peak_opaque(T x) {
  volatile T v = x;
  return v;
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 8)
#define LINATTN_BENCH_UNROLL _Pragma("GCC unroll 32")
#else
#define LINATTN_BENCH_UNROLL
#endif

template <class T>
T fma_peak_chains(std::int64_t rounds) {
  using V = typename Eigen::internal::packet_traits<T>::type;
  constexpr int kChains = 16;  // ≥ 2 pipes × 4 cycles of latency; 16 of 32 vector registers
  const T a = peak_opaque(T(0.5)), b = peak_opaque(T(0.5));
  const V va = Eigen::internal::pset1<V>(a), vb = Eigen::internal::pset1<V>(b);
  V acc[kChains];
  LINATTN_BENCH_UNROLL
  for (int c = 0; c < kChains; ++c) acc[c] = Eigen::internal::pset1<V>(peak_opaque(T(1 + c)));
  for (std::int64_t i = 0; i < rounds; ++i) {
    LINATTN_BENCH_UNROLL
    for (int c = 0; c < kChains; ++c) acc[c] = Eigen::internal::pmadd(acc[c], va, vb);
  }
  V s = acc[0];
  LINATTN_BENCH_UNROLL
  for (int c = 1; c < kChains; ++c) s = Eigen::internal::padd(s, acc[c]);
  return Eigen::internal::predux(s);
}

// GFLOP/s of one thread at the FMA peak of T: the fastest of `blocks` blocks of ~2 ms each.
template <class T>
double fma_peak_one_thread(int blocks) {
  const double lanes = double(Eigen::internal::packet_traits<T>::size);
  constexpr std::int64_t kRounds = 1 << 14;
  const double flops_per_call = 2.0 * lanes * 16.0 * double(kRounds);
  g_peak_sink<T> = fma_peak_chains<T>(kRounds);  // warm-up (clock)
  double best = 0;
  for (int b = 0; b < blocks; ++b) {
    timespec t0{}, t1{};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int calls = 0;
    double s = 0;
    do {
      g_peak_sink<T> = fma_peak_chains<T>(kRounds);
      ++calls;
      clock_gettime(CLOCK_MONOTONIC, &t1);
      s = double(t1.tv_sec - t0.tv_sec) + 1e-9 * double(t1.tv_nsec - t0.tv_nsec);
    } while (s < 0.002);
    best = std::max(best, flops_per_call * calls / s * 1e-9);
  }
  return best;
}

// The float FMA peak of `threads` threads running at once (the sum of each thread's own), measured
// now: on a shared virtual machine the core's arithmetic varies with what runs beside it (here
// from about half to all of it: the virtual CPUs may share physical cores), so a kernel's fraction
// of the peak is taken against a measurement made right after its timed loop (~20 ms).
inline double fma_peak_now(int threads) {
  const int thr = std::max(threads, 1);
#ifdef _OPENMP
  if (thr > 1) {
    std::vector<double> per(std::size_t(thr), 0.0);
#pragma omp parallel num_threads(thr)
    {
#pragma omp barrier
      per[std::size_t(omp_get_thread_num())] = fma_peak_one_thread<float>(10);
    }
    double sum = 0;
    for (double v : per) sum += v;
    return sum;
  }
#endif
  return fma_peak_one_thread<float>(10);
}

// The float FMA peak of one thread at the start of the process (cached; for the JSON context).
template <class T>
double fma_peak_gflops() {
  static const double peak = fma_peak_one_thread<T>(25);
  return peak;
}

// Counters of the peak: peak_GFLOPs, the FMA peak of `threads` threads measured right after the
// timed loop (fma_peak_now), and frac_of_peak = the run's useful flops per second (`flops` in
// `seconds_per_iteration`, timed by the caller around its loop) ÷ that.
inline void set_peak_counters(benchmark::State& st, double flops, double seconds_per_iteration,
                              int threads) {
  const double peak = fma_peak_now(threads);
  st.counters["peak_GFLOPs"] = peak;
  st.counters["frac_of_peak"] =
      seconds_per_iteration > 0 && peak > 0 ? flops / seconds_per_iteration * 1e-9 / peak : 0.0;
}

// Read + write bandwidth (bytes/s; x = x·a + b in place, 2 × `bytes` moved per pass) of a float
// buffer of `bytes` split statically over `threads` OpenMP threads, measured in the calling
// process: the bandwidth of the level a working set of that size lives in, for the decode steps'
// fraction of it. The fastest of 5 blocks of ≥ 4 ms; measured at every call (the decode
// benchmarks call it right after their timed loop: what the neighbours leave varies).
inline double rw_bandwidth(double bytes, int threads) {
  const Index n = std::max<Index>(Index(bytes / sizeof(float)) / 64 * 64, 64);
  std::vector<float> x(std::size_t(n), 1.0f);
  const float a = peak_opaque(0.5f), b = peak_opaque(0.5f);
  const int thr = std::max(threads, 1);
  // Each thread sweeps its own part for ≥ `seconds` and times itself (after a barrier, so that
  // they run together), and the bandwidth is the sum of the threads' own: the wake-up of a
  // thread on a loaded machine (milliseconds when the other core is busy) is not counted.
  const auto now = [] {
    timespec t{};
    clock_gettime(CLOCK_MONOTONIC, &t);
    return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
  };
  const auto part = [&](int t, double seconds) {
    const Index lo = n * t / thr / 16 * 16, hi = t + 1 == thr ? n : n * (t + 1) / thr / 16 * 16;
    Eigen::Map<Eigen::ArrayXf> m(x.data() + lo, hi - lo);
    m = m * a + b;  // faults the pages in
    double best = 0;
    for (int block = 0; block < 5; ++block) {
      const double t0 = now();
      double t1 = t0;
      Index passes = 0;
      const Index inner = std::max<Index>(1, (Index(1) << 18) / (hi - lo));  // ≥ ~1 MiB a check
      do {
        for (Index r = 0; r < inner; ++r) {
          m = m * a + b;
          benchmark::ClobberMemory();
        }
        passes += inner;
        t1 = now();
      } while (t1 - t0 < seconds / 5);
      best = std::max(best, 2.0 * double(hi - lo) * sizeof(float) * double(passes) / (t1 - t0));
    }
    return best;
  };
  double best = 0;
#ifdef _OPENMP
  if (thr > 1) {
    std::vector<double> per(std::size_t(thr), 0.0);
#pragma omp parallel num_threads(thr)
    {
#pragma omp barrier
      per[std::size_t(omp_get_thread_num())] = part(omp_get_thread_num(), 0.02);
    }
    for (double v : per) best += v;
  } else
#endif
    best = part(0, 0.02);
  g_peak_sink<float> = x[std::size_t(n / 2)];
  return best;
}

// The calling thread's number in an OpenMP team (0 without OpenMP).
inline int thread_num() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// OpenMP threads for everything that follows. Eigen's own GEMM parallelism stays off (set in
// run_main): the single-head kernels are measured on one thread, and the multi-head kernels
// parallelise over heads only.
// The thread counts of the serving benchmarks: 1, and every processor when there are more
// (OpenMP's default team is one thread by the time run_main registers benchmarks).
inline std::vector<int> one_and_all_threads() {
  int all = 1;
#ifdef _OPENMP
  all = omp_get_num_procs();
#endif
  return all > 1 ? std::vector<int>{1, all} : std::vector<int>{1};
}

inline void set_threads(int threads) {
#ifdef _OPENMP
  omp_set_num_threads(threads);
#else
  (void)threads;
#endif
}

template <class T>
const char* dtype_name() {
  return sizeof(T) == sizeof(float) ? "f32" : "f64";
}

inline void set_common_counters(benchmark::State& st, double flops, Index N, Index D, Index M,
                                Index H, int threads) {
  st.counters["GFLOPs"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["flops"] = flops;
  st.counters["N"] = double(N);
  st.counters["D"] = double(D);
  st.counters["M"] = double(M);
  st.counters["H"] = double(H);
  st.counters["threads"] = threads;
}

// Useful flops of one head.
inline double linear_flops(Index N, Index L, Index F, Index M) {
  return 2.0 * double(L) * double(F) * double(M) + 2.0 * double(N) * double(F) * double(M);
}
inline double softmax_flops(Index N, Index L, Index D, Index M, bool causal) {
  const double pairs = causal ? 0.5 * double(N) * double(N + 1) : double(N) * double(L);
  return pairs * 2.0 * double(D + M);
}

// One untimed call before the timed loop sizes the workspaces and faults their pages in; it is
// skipped for calls so long (≥ ~20 GFLOP) that a one-off allocation cannot matter.
inline bool worth_warming_up(double flops) { return flops < 2e10; }

template <class Mat>
bool all_finite(const Mat& m) {
  return m.allFinite();
}

// ---------------------------------------------------------------------------------------------
// GEMM references: Eigen products of the shapes the kernels contain, float or double, noalias
// into preallocated outputs, over H heads packed side by side (H = 1: a single head).
// ---------------------------------------------------------------------------------------------

// Linear attention: per head S = Kᵀ V ((F×L)·(L×M)) and out = Q S ((N×F)·(F×M)).
template <class T>
struct LinearGemm {
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
  Mat Q, K, V, S, out;
  Index H, D, M;
  LinearGemm(Index N, Index L, Index heads, Index d, Index m)
      : Q(random_matrix<T>(N, heads * d, 11)),
        K(random_matrix<T>(L, heads * d, 12)),
        V(random_matrix<T>(L, heads * m, 13)),
        S(Mat::Zero(d, heads * m)),
        out(Mat::Zero(N, heads * m)),
        H(heads),
        D(d),
        M(m) {}
  void head(Index h) {
    S.middleCols(h * M, M).noalias() = K.middleCols(h * D, D).transpose() * V.middleCols(h * M, M);
    out.middleCols(h * M, M).noalias() = Q.middleCols(h * D, D) * S.middleCols(h * M, M);
  }
  void run(int threads) {
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
      for (Index h = 0; h < H; ++h) head(h);
      return;
    }
#endif
    (void)threads;
    for (Index h = 0; h < H; ++h) head(h);
  }
};

// Softmax attention: per head the (N×D)·(D×L) score product and the (N×L)·(L×M) product with
// V, taken in blocks of kRows queries × kCols keys ((P×D)·(D×B) and (P×B)·(B×M), the same
// flops): the block of scores stays in L2, as it would in any tuned kernel, and N = L = 65536
// does not need 16 GiB (whole 512-row panels fell to memory speed at N = 16384). The keys are
// stored transposed (H·D × L, set up untimed): Eigen packs Kᵀ from a column-major K four keys
// at a time across D columns a power-of-two stride apart, which refetches every cache line
// and cost this reference a fifth of its speed. The reference is the best these products do.
template <class T>
struct SoftmaxGemm {
  static constexpr Index kRows = 256, kCols = 512;
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
  Mat Q, Kt, V, out;
  std::vector<Mat> scores;  // one block per thread
  Index H, D, M;
  SoftmaxGemm(Index N, Index L, Index heads, Index d, Index m, int threads)
      : Q(random_matrix<T>(N, heads * d, 21)),
        Kt(random_matrix<T>(heads * d, L, 22)),
        V(random_matrix<T>(L, heads * m, 23)),
        out(Mat::Zero(N, heads * m)),
        H(heads),
        D(d),
        M(m) {
    for (int t = 0; t < std::max(threads, 1); ++t)
      scores.push_back(Mat::Zero(std::min(kRows, N), std::min(kCols, L)));
  }
  void head(Index h, Mat& s) {
    const Index N = Q.rows(), L = Kt.cols();
    for (Index i0 = 0; i0 < N; i0 += kRows) {
      const Index p = std::min(kRows, N - i0);
      auto o = out.block(i0, h * M, p, M);
      for (Index j0 = 0; j0 < L; j0 += kCols) {
        const Index b = std::min(kCols, L - j0);
        auto sb = s.topLeftCorner(p, b);
        sb.noalias() = Q.block(i0, h * D, p, D) * Kt.block(h * D, j0, D, b);
        if (j0 == 0)
          o.noalias() = sb * V.block(j0, h * M, b, M);
        else
          o.noalias() += sb * V.block(j0, h * M, b, M);
      }
    }
  }
  void run(int threads) {
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
      for (Index h = 0; h < H; ++h) head(h, scores[std::size_t(omp_get_thread_num())]);
      return;
    }
#endif
    (void)threads;
    for (Index h = 0; h < H; ++h) head(h, scores[0]);
  }
};

template <class T>
void run_linear_gemm(benchmark::State& st, Index heads, Index D, int threads) {
  const Index N = st.range(0);
  set_threads(threads);
  LinearGemm<T> g(N, N, heads, D, D);
  g.run(threads);
  for (auto _ : st) {
    g.run(threads);
    benchmark::DoNotOptimize(g.out.data());
    benchmark::ClobberMemory();
  }
  st.SetComplexityN(N);
  set_common_counters(st, double(heads) * linear_flops(N, N, D, D), N, D, D, heads, threads);
  set_threads(1);
}

template <class T>
void run_softmax_gemm(benchmark::State& st, Index heads, Index D, int threads) {
  const Index N = st.range(0);
  set_threads(threads);
  SoftmaxGemm<T> g(N, N, heads, D, D, threads);
  const double flops = double(heads) * softmax_flops(N, N, D, D, false);
  if (worth_warming_up(flops)) g.run(threads);
  for (auto _ : st) {
    g.run(threads);
    benchmark::DoNotOptimize(g.out.data());
    benchmark::ClobberMemory();
  }
  st.SetComplexityN(N);
  set_common_counters(st, flops, N, D, D, heads, threads);
  set_threads(1);
}

// ---------------------------------------------------------------------------------------------
// Registration helpers and main()
// ---------------------------------------------------------------------------------------------

// A family over the sizes `ns` (argument N), wall-clock time, with a complexity fit.
template <class Fn>
benchmark::internal::Benchmark* add(const std::string& name, const std::vector<Index>& ns,
                                    const char* arg_name, benchmark::BigO big_o, Fn&& fn) {
  auto* b = benchmark::RegisterBenchmark(name.c_str(), std::forward<Fn>(fn));
  b->ArgName(arg_name)->UseRealTime()->Unit(benchmark::kMillisecond);
  for (Index n : ns) b->Arg(int64_t(n));
  if (ns.size() > 1) b->Complexity(big_o);
  return b;
}

inline std::string key(const char* k, Index v) { return std::string("/") + k + ":" + std::to_string(v); }
inline std::string key(const char* k, const std::string& v) { return std::string("/") + k + ":" + v; }

#ifndef LINATTN_BENCH_CXX_FLAGS
#define LINATTN_BENCH_CXX_FLAGS "(unknown)"
#endif
#ifndef LINATTN_BENCH_BUILD_TYPE
#define LINATTN_BENCH_BUILD_TYPE "(unknown)"
#endif

inline std::string join(const std::vector<Index>& v) {
  std::string s;
  for (Index x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

// Parses and removes our flags (--full, --smoke, --quick) from argv, registers the program's
// benchmarks for the chosen profile, adds a default --benchmark_min_time, and runs Google
// Benchmark. `notes` is printed and stored in the JSON context (what was capped and why).
inline int run_main(int argc, char** argv, void (*register_all)(const Profile&),
                    std::string (*notes)(const Profile&)) {
  std::string name = "quick";
  if (const char* env = std::getenv("LINATTN_BENCH_PROFILE"); env && *env) name = env;
  std::vector<char*> args;
  bool has_min_time = false;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (i > 0 && (a == "--full" || a == "--smoke" || a == "--quick")) {
      name = a.substr(2);
      continue;
    }
    if (a.rfind("--benchmark_min_time", 0) == 0) has_min_time = true;
    args.push_back(argv[i]);
  }
  if (name != "full" && name != "smoke" && name != "quick") {
    std::fprintf(stderr, "unknown profile '%s' (quick, full or smoke)\n", name.c_str());
    return 2;
  }
  profile() = make_profile(name);
  const Profile& p = profile();
  static std::string min_time_arg = std::string("--benchmark_min_time=") + p.min_time;
  if (!has_min_time) args.insert(args.begin() + 1, min_time_arg.data());
  args.push_back(nullptr);
  int n = int(args.size()) - 1;

  // Single-threaded unless a benchmark asks for more; Eigen's GEMMs never spawn threads.
  Eigen::setNbThreads(1);
  set_threads(1);

  register_all(p);
  const std::string note = notes(p);
  benchmark::AddCustomContext("linattn_profile", p.name);
  benchmark::AddCustomContext("linattn_notes", note);
#if defined(__clang__)
  benchmark::AddCustomContext("linattn_compiler", std::string("clang ") + __clang_version__);
#elif defined(__GNUC__)
  benchmark::AddCustomContext("linattn_compiler", std::string("g++ ") + __VERSION__);
#else
  benchmark::AddCustomContext("linattn_compiler", "unknown");
#endif
  benchmark::AddCustomContext("linattn_cxx_flags", LINATTN_BENCH_CXX_FLAGS);
  benchmark::AddCustomContext("linattn_build_type", LINATTN_BENCH_BUILD_TYPE);
  benchmark::AddCustomContext("linattn_eigen", std::to_string(EIGEN_WORLD_VERSION) + "." +
                                                   std::to_string(EIGEN_MAJOR_VERSION) + "." +
                                                   std::to_string(EIGEN_MINOR_VERSION) + " (" +
                                                   Eigen::SimdInstructionSetsInUse() + ")");
  std::string isa;
#ifdef __AVX512F__
  isa += " AVX-512F";
#endif
#ifdef __AVX2__
  isa += " AVX2";
#endif
#ifdef __FMA__
  isa += " FMA";
#endif
#ifdef __AVX__
  isa += " AVX";
#endif
  benchmark::AddCustomContext("linattn_isa", isa.empty() ? "baseline" : isa.substr(1));
#ifdef _OPENMP
  benchmark::AddCustomContext("linattn_openmp", std::to_string(_OPENMP));
#else
  benchmark::AddCustomContext("linattn_openmp", "off");
#endif
  std::printf("linattn benchmarks, profile '%s'. %s\n", p.name.c_str(), note.c_str());
  std::fflush(stdout);

  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace linattn_bench
