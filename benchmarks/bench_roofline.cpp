// The roofline of this core: what one thread of this machine can do at best, measured by the
// same build (compiler, flags, ISA) as the rest of the suite, so that the kernels' figures of the
// other programs can be read as a fraction of it.
//
// What is measured (one thread, nothing pinned, wall-clock time as in the rest of the suite):
//
//   roofline_fma_peak_f32, roofline_fma_peak_f64
//       Peak floating-point throughput: independent chains of vector FMAs (acc = acc·a + b) held
//       in registers, no memory access in the loop, the accumulators folded and kept live at
//       the end. Chains: 16 vector accumulators with AVX-512F (32 registers), 12 with AVX2+FMA
//       or Eigen packets (16 registers): more than FMA latency × FMA pipes (4 × 2 on current
//       x86), so the pipes never wait for a result. Every ISA the build enables is calibrated
//       first (a few short timed runs of each, best run kept) and the benchmark then times the
//       fastest one, preferring the wider ISA within 2 %: a core with double-pumped 512-bit
//       units (Zen 4) is as fast with 256-bit vectors. The label names the ISA timed and the
//       calibration of the others ("avx512 16x16 lanes; calib avx512 190.1, avx2 96.0 GFLOP/s").
//   roofline_fma_isa/dtype:f32/isa:<isa>, roofline_fma_isa/dtype:f64/isa:<isa>
//       The same kernel on each ISA the build can run (isa:avx512, isa:avx2 on an AVX-512
//       build; isa:avx2 or isa:packets otherwise), for the comparison. The labels say
//       "avx512", "avx2", or "sse2/packets" ("avx/packets", "packets": Eigen's packets of a
//       build without AVX2+FMA).
//   roofline_read_bw/L1, roofline_read_bw/L2, roofline_read_bw/L3, roofline_read_bw/mem
//       Read bandwidth: a vectorised float sum (8 independent vector accumulators, widest ISA
//       the build enables) over a buffer of 16 KiB (inside any L1D), 256 KiB (inside L2 but out
//       of L1 on every current x86 core; 512 KiB would be too close to a 512 KiB–1 MiB L2), 8 MiB
//       (out of any one core's L2, inside the L3 of Zen 4/5, 32 MiB per CCD, and of Intel server
//       parts, shared by their cores; a quarter of Zen's L3, so a neighbour on another core of the
//       CCD has room) and 256 MiB (far beyond any L3: DRAM; 64 MiB in the smoke profile), swept
//       256, 32, 1 and 1 times per iteration. Bytes read.
//   roofline_rw_bw/L1, roofline_rw_bw/L2, roofline_rw_bw/L3, roofline_rw_bw/mem
//       Read + write bandwidth, as a decode step updates its state: x[i] = x[i]·a + b in place
//       (load, FMA, store), float, the same buffer sizes and sweeps (memory: the same buffer as
//       roofline_read_bw/mem). Bytes read + bytes written (2× the buffer per sweep; in memory,
//       every line is read from DRAM and its dirty copy written back).
//
// Why: the library's kernels report useful GFLOP/s (counter GFLOPs) and the other programs
// compare them with Eigen GEMMs (frac_of_gemm). These figures are the ceiling of both: a kernel's
// GFLOP/s divided by roofline_fma_peak_<dtype> is the fraction of the core's arithmetic it uses,
// and a memory-bound kernel (a decode step reads and writes its state) is judged by bytes moved
// per second against roofline_read_bw / roofline_rw_bw of the level its data lives in. A kernel
// of arithmetic intensity I flop/byte cannot beat min(peak, I × bandwidth).
//
// How to read the figures (names follow bench_common.hpp; Google Benchmark appends /real_time):
//   GFLOPs      (FMA) GFLOP/s, a rate counter: 2 flops per FMA lane. This is the peak.
//   flops       (FMA) flops of one iteration (the suite's convention: benchmarks/report.py
//               divides it by the wall time).
//   GBps        (bandwidth) decimal GB/s, 1e9 bytes per second, of the bytes counted above.
//   bytes_per_second  the same rate in the JSON (SetBytesProcessed); the console prints it in
//               binary units (GiB/s, "G/s"), 7 % below GBps.
//   vector_bits, chains, lanes, buffer_bytes, sweeps   what was run.
// The numbers are one core's with the clock it had: on a shared machine (another process on the
// core, a VM's neighbours) they come out low; rerun, and compare runs made back to back. The
// FMA peak is flops per cycle × clock: 64 flops/cycle (f32) with two 512-bit FMA pipes, 32 with
// two 256-bit ones. A smoke run (--smoke, the ctest) only checks that the program works.
//
// Profiles (bench_common.hpp: --smoke | --quick | --full, or LINATTN_BENCH_PROFILE): the same
// benchmarks in every profile; smoke calibrates and warms up for a few milliseconds only (the
// whole program runs in well under a second), quick and full warm up for 20 ms before every
// measurement (clock ramp-up) and calibrate each ISA for 40 ms; full measures for 0.5 s.
#include "bench_common.hpp"

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <chrono>
#include <functional>
#include <memory>

namespace lb = linattn_bench;

namespace {

// ---------------------------------------------------------------------------------------------
// Vector operations per ISA (Ops<T>: V, lanes, set1, fma, add, loadu, storeu)
// ---------------------------------------------------------------------------------------------

// One ISA's vector type and the five operations the loops use, for float (suffix ps) and double
// (pd): the intrinsics differ only in their prefix and suffix.
#define LINATTN_ROOF_TRAITS(NAME, SCALAR, VEC, LANES, PRE, SUF)                        \
  template <>                                                                         \
  struct NAME<SCALAR> {                                                               \
    using T = SCALAR;                                                                 \
    using V = VEC;                                                                    \
    static constexpr int lanes = LANES;                                               \
    static V set1(T x) { return PRE##_set1_##SUF(x); }                                \
    static V fma(V a, V b, V c) { return PRE##_fmadd_##SUF(a, b, c); }                \
    static V add(V a, V b) { return PRE##_add_##SUF(a, b); }                          \
    static V loadu(const T* p) { return PRE##_loadu_##SUF(p); }                       \
    static void storeu(T* p, V v) { PRE##_storeu_##SUF(p, v); }                       \
  }

#if defined(__AVX512F__)
#define LINATTN_ROOF_AVX512 1
template <class T>
struct Avx512;
LINATTN_ROOF_TRAITS(Avx512, float, __m512, 16, _mm512, ps);
LINATTN_ROOF_TRAITS(Avx512, double, __m512d, 8, _mm512, pd);
#else
#define LINATTN_ROOF_AVX512 0
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define LINATTN_ROOF_AVX2 1
template <class T>
struct Avx2;
LINATTN_ROOF_TRAITS(Avx2, float, __m256, 8, _mm256, ps);
LINATTN_ROOF_TRAITS(Avx2, double, __m256d, 4, _mm256, pd);
#else
#define LINATTN_ROOF_AVX2 0
#endif

// Eigen's packets: whatever Eigen vectorises with (SSE2, AVX, NEON, …); pmadd is a true FMA only
// where the ISA has one. Used only when neither intrinsics path above is compiled in.
template <class T>
struct Packets {
  using V = typename Eigen::internal::packet_traits<T>::type;
  static constexpr int lanes = Eigen::internal::unpacket_traits<V>::size;
  static V set1(T x) { return Eigen::internal::pset1<V>(x); }
  static V fma(V a, V b, V c) { return Eigen::internal::pmadd(a, b, c); }
  static V add(V a, V b) { return Eigen::internal::padd(a, b); }
  static V loadu(const T* p) { return Eigen::internal::ploadu<V>(p); }
  static void storeu(T* p, V v) { Eigen::internal::pstoreu(p, v); }
};

#if defined(__AVX__)
constexpr const char* kPacketsLabel = "avx/packets";
#elif defined(__SSE2__)
constexpr const char* kPacketsLabel = "sse2/packets";
#else
constexpr const char* kPacketsLabel = "packets";
#endif

// The loops over accumulators must be unrolled completely, or the accumulators live in an array
// in memory: GCC 12 unrolls 16 of them by itself but not 24 (it then keeps them on the stack and
// the "FMA peak" becomes a load/store loop at a third of the speed). Forced, not left to chance.
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 8)
#define LINATTN_ROOF_UNROLL _Pragma("GCC unroll 32")
#else
#define LINATTN_ROOF_UNROLL
#endif

template <class Ops, class T, class V>
T hsum(V v) {
  alignas(64) T tmp[Ops::lanes];
  Ops::storeu(tmp, v);
  T s = 0;
  for (int l = 0; l < Ops::lanes; ++l) s += tmp[l];
  return s;
}

// x, unknown to the optimiser (constants it cannot fold), and a sink for results. Not
// benchmark::DoNotOptimize on scalars: Google Benchmark 1.7.1's DoNotOptimize(T&) ("+m,r") makes
// GCC 12 -O3 drop the initialisation of a local float (`float a = 0.5f; DoNotOptimize(a);`
// returns stack garbage), which fed garbage (NaNs, denormals) into the chains.
template <class T>
T opaque(T x) {
  volatile T v = x;
  return v;
}
template <class T>
volatile T g_sink = T(0);
template <class T>
void keep(T x) {
  g_sink<T> = x;
}

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

// `n` rounds of one FMA on each of C independent accumulators: n·C·lanes·2 flops. The values
// converge to b / (1 − a) = 1 and stay normal (no denormal slow path). The constants pass
// through opaque(), so the compiler knows nothing of them and cannot fold the chains.
template <class Ops, class T, int C>
T fma_chains(std::int64_t n) {
  using V = typename Ops::V;
  const T a = opaque(T(0.5)), b = opaque(T(0.5)), init = opaque(T(1));
  const V va = Ops::set1(a), vb = Ops::set1(b);
  V acc[C];
  LINATTN_ROOF_UNROLL
  for (int c = 0; c < C; ++c) acc[c] = Ops::set1(init + T(c));
  for (std::int64_t i = 0; i < n; ++i) {
    LINATTN_ROOF_UNROLL
    for (int c = 0; c < C; ++c) acc[c] = Ops::fma(acc[c], va, vb);
  }
  V s = acc[0];
  LINATTN_ROOF_UNROLL
  for (int c = 1; c < C; ++c) s = Ops::add(s, acc[c]);
  return hsum<Ops, T>(s);
}

// Sum of x[0, n) repeated `sweeps` times into 8 vector accumulators (n: a multiple of
// 8 · lanes). The accumulators carry over the sweeps, so no sweep can be skipped.
template <class Ops, class T>
T read_sum(const T* x, std::size_t n, int sweeps) {
  using V = typename Ops::V;
  constexpr int U = 8, L = Ops::lanes;
  V acc[U];
  LINATTN_ROOF_UNROLL
  for (int u = 0; u < U; ++u) acc[u] = Ops::set1(T(0));
  for (int r = 0; r < sweeps; ++r) {
    for (std::size_t i = 0; i < n; i += std::size_t(U * L)) {
      LINATTN_ROOF_UNROLL
      for (int u = 0; u < U; ++u) acc[u] = Ops::add(acc[u], Ops::loadu(x + i + std::size_t(u * L)));
    }
    benchmark::ClobberMemory();  // no unroll-and-jam of the sweeps (one load for two adds)
  }
  V s = acc[0];
  LINATTN_ROOF_UNROLL
  for (int u = 1; u < U; ++u) s = Ops::add(s, acc[u]);
  return hsum<Ops, T>(s);
}

// x[i] = x[i]·a + b over x[0, n), `sweeps` times (n: a multiple of 4 · lanes). With a = b = 1/2
// the values converge to 1.
template <class Ops, class T>
void rw_update(T* x, std::size_t n, int sweeps) {
  using V = typename Ops::V;
  constexpr int U = 4, L = Ops::lanes;
  const T a = opaque(T(0.5)), b = opaque(T(0.5));
  const V va = Ops::set1(a), vb = Ops::set1(b);
  for (int r = 0; r < sweeps; ++r) {
    for (std::size_t i = 0; i < n; i += std::size_t(U * L)) {
      LINATTN_ROOF_UNROLL
      for (int u = 0; u < U; ++u) {
        T* p = x + i + std::size_t(u * L);
        Ops::storeu(p, Ops::fma(Ops::loadu(p), va, vb));
      }
    }
    // A compiler barrier between sweeps: without it GCC's unroll-and-jam (-O3) fuses two sweeps
    // into one load, two FMAs and one store, halving the traffic counted.
    benchmark::ClobberMemory();
  }
}

// One ISA's kernels for scalar type T.
template <class T>
struct Isa {
  const char* key;   // in benchmark names: avx512 | avx2 | packets
  const char* name;  // in labels: avx512 | avx2 | sse2/packets (avx/packets, packets)
  int bits;          // vector width
  int lanes;         // T per vector
  int chains;        // FMA accumulators
  T (*fma)(std::int64_t n);
  T (*read)(const T* x, std::size_t n, int sweeps);
  void (*rw)(T* x, std::size_t n, int sweeps);
  double fma_flops(std::int64_t n) const { return 2.0 * double(n) * double(chains) * double(lanes); }
};

template <class Ops, class T, int C>
Isa<T> make_isa(const char* key, const char* name) {
  return Isa<T>{key,        name, int(Ops::lanes * sizeof(T) * 8), Ops::lanes, C, &fma_chains<Ops, T, C>,
                &read_sum<Ops, T>, &rw_update<Ops, T>};
}

// The ISAs this build can run, widest first.
template <class T>
const std::vector<Isa<T>>& isas() {
  static const std::vector<Isa<T>> v = [] {
    std::vector<Isa<T>> r;
#if LINATTN_ROOF_AVX512
    r.push_back(make_isa<Avx512<T>, T, 16>("avx512", "avx512"));
#endif
#if LINATTN_ROOF_AVX2
    r.push_back(make_isa<Avx2<T>, T, 12>("avx2", "avx2"));
#endif
    if (r.empty()) r.push_back(make_isa<Packets<T>, T, 12>("packets", kPacketsLabel));
    return r;
  }();
  return v;
}

// ---------------------------------------------------------------------------------------------
// Timing helpers (untimed by Google Benchmark: warm-up and calibration)
// ---------------------------------------------------------------------------------------------

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// FMA rounds per call of the kernel: ~2^14 · 16 vector FMAs, some 40 µs on a 4 GHz core with two
// FMA pipes. Long enough that the fold and the call are noise, short enough for fine timing.
constexpr std::int64_t kFmaRounds = std::int64_t(1) << 14;

struct Settings {
  double warmup_s;       // untimed work before each measurement (clock ramp-up)
  double calibration_s;  // per ISA, to pick the fastest for roofline_fma_peak_*
};

Settings settings() {
  if (lb::profile().name == "smoke") return {0.001, 0.003};
  return {0.02, 0.04};
}

template <class T>
void fma_warmup(const Isa<T>& isa, double s) {
  const auto t0 = Clock::now();
  do {
    keep(isa.fma(kFmaRounds));
  } while (seconds_since(t0) < s);
}

// The best GFLOP/s of short timed runs (~1 ms each) over `s` seconds: the best run is the one
// nothing interrupted.
template <class T>
double fma_calibrate(const Isa<T>& isa, double s) {
  fma_warmup(isa, std::min(s / 4, 0.005));
  double best = 0;
  const auto t_end = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  do {
    const auto t0 = Clock::now();
    int calls = 0;
    do {
      keep(isa.fma(kFmaRounds));
      ++calls;
    } while (seconds_since(t0) < 0.001);
    best = std::max(best, isa.fma_flops(kFmaRounds) * calls / seconds_since(t0) * 1e-9);
  } while (Clock::now() < t_end);
  return best;
}

struct Choice {
  std::size_t index = 0;
  std::string label;
};

// The ISA roofline_fma_peak_<dtype> times: the fastest in calibration, the wider one unless a
// narrower one is more than 2 % faster. Calibrated once per dtype.
template <class T>
const Choice& fma_choice() {
  static const Choice c = [] {
    const auto& v = isas<T>();
    std::vector<double> g;
    for (const auto& isa : v) g.push_back(fma_calibrate(isa, settings().calibration_s));
    const double best = *std::max_element(g.begin(), g.end());
    Choice ch;
    while (ch.index + 1 < v.size() && g[ch.index] < 0.98 * best) ++ch.index;
    const Isa<T>& isa = v[ch.index];
    ch.label = std::string(isa.name) + " " + std::to_string(isa.chains) + "x" + std::to_string(isa.lanes) +
               " lanes; calib";
    char buf[64];
    for (std::size_t i = 0; i < v.size(); ++i) {
      std::snprintf(buf, sizeof buf, "%s %s %.1f", i ? "," : "", v[i].name, g[i]);
      ch.label += buf;
    }
    ch.label += " GFLOP/s";
    return ch;
  }();
  return c;
}

// ---------------------------------------------------------------------------------------------
// Benchmarks
// ---------------------------------------------------------------------------------------------

template <class T>
void fma_counters(benchmark::State& st, const Isa<T>& isa, double flops) {
  st.counters["GFLOPs"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["flops"] = flops;
  st.counters["vector_bits"] = isa.bits;
  st.counters["chains"] = isa.chains;
  st.counters["lanes"] = isa.lanes;
  st.counters["threads"] = 1;
}

template <class T>
void run_fma(benchmark::State& st, const Isa<T>& isa) {
  fma_warmup(isa, settings().warmup_s);
  T r = 0;
  for (auto _ : st) {
    r = isa.fma(kFmaRounds);
    keep(r);
  }
  if (!std::isfinite(double(r))) st.SkipWithError("non-finite accumulators");
  fma_counters(st, isa, isa.fma_flops(kFmaRounds));
}

template <class T>
void BM_fma_peak(benchmark::State& st) {
  const Choice& c = fma_choice<T>();
  run_fma(st, isas<T>()[c.index]);
  st.SetLabel(c.label);
}

template <class T>
void BM_fma_isa(benchmark::State& st, std::size_t i) {
  const Isa<T>& isa = isas<T>()[i];
  run_fma(st, isa);
  st.SetLabel(std::string(isa.name) + " " + std::to_string(isa.chains) + "x" + std::to_string(isa.lanes) + " lanes");
}

// Buffers. L1, L2 and L3: allocated per run (cheap; L3's 8 MiB on huge pages where Linux gives them).
// Memory: one 256 MiB buffer, allocated and faulted in once, on huge pages (fewer TLB misses, faster
// page-in), shared by roofline_read_bw/mem and roofline_rw_bw/mem (the latter leaves it near 1.0:
// still a finite sum for the former).
// Aligned by hand (std::aligned_alloc is missing from MSVC).
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
struct Buffer {
  std::unique_ptr<void, FreeDeleter> base;
  float* data = nullptr;
};

// 256 MiB: far beyond one core's L3 (32 MiB per CCD on Zen 4/5, a few MiB per core on Intel
// server parts). Measured on the Zen 5 VM this was written on: 8–16 MiB read at ~100 GB/s (L3),
// 32 MiB at ~60, 64 MiB at ~40 (partly L3), 128–512 MiB on one plateau (DRAM). The smoke profile
// reads 64 MiB instead: faulting in 256 MiB takes up to 0.7 s there (1.1 s without huge pages),
// the smoke run has to stay well under a second, and its figures are not timings anyway.
std::size_t mem_bytes() { return lb::profile().name == "smoke" ? std::size_t(64) << 20 : std::size_t(256) << 20; }

Buffer make_buffer(std::size_t bytes) {
  const std::size_t align = bytes >= (std::size_t(4) << 20) ? (std::size_t(2) << 20) : 4096;
  Buffer b;
  b.base.reset(std::malloc(bytes + align));
  if (!b.base) return b;
  const std::uintptr_t a = (reinterpret_cast<std::uintptr_t>(b.base.get()) + align - 1) & ~std::uintptr_t(align - 1);
  b.data = reinterpret_cast<float*>(a);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (align >= (std::size_t(2) << 20)) madvise(b.data, bytes, MADV_HUGEPAGE);
#endif
  const std::size_t n = bytes / sizeof(float);
  for (std::size_t i = 0; i < n; ++i) b.data[i] = float(i & 1023) * (1.0f / 1024.0f);
  return b;
}

float* mem_buffer() {
  static Buffer b = make_buffer(mem_bytes());
  return b.data;
}

enum class Level { L1, L2, L3, Mem };

struct LevelSpec {
  const char* name;
  std::size_t bytes;
  int sweeps;  // per iteration
};

LevelSpec level_spec(Level l) {
  switch (l) {
    case Level::L1: return {"L1", std::size_t(16) << 10, 256};  // 4 MiB per iteration
    case Level::L2: return {"L2", std::size_t(256) << 10, 32};  // 8 MiB per iteration
    case Level::L3: return {"L3", std::size_t(8) << 20, 1};     // 8 MiB per iteration
    default: return {"mem", mem_bytes(), 1};                    // 256 MiB (smoke: 64) per iteration
  }
}

void bw_counters(benchmark::State& st, const Isa<float>& isa, const LevelSpec& s, double bytes, const char* what) {
  st.SetBytesProcessed(std::int64_t(bytes) * st.iterations());
  st.counters["GBps"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["buffer_bytes"] = double(s.bytes);
  st.counters["sweeps"] = s.sweeps;
  st.counters["vector_bits"] = isa.bits;
  st.counters["threads"] = 1;
  const std::string size = s.bytes >= (std::size_t(1) << 20) ? std::to_string(s.bytes >> 20) + " MiB"
                                                              : std::to_string(s.bytes >> 10) + " KiB";
  st.SetLabel(std::string(isa.name) + " " + what + ", " + size + " x" + std::to_string(s.sweeps));
}

// The buffer of level l: the shared memory-level buffer, or one of its own in `own`; null (the
// benchmark skipped with an error) when it cannot be allocated.
float* level_buffer(benchmark::State& st, Level l, const LevelSpec& s, Buffer& own) {
  float* x = nullptr;
  if (l == Level::Mem) {
    x = mem_buffer();
  } else {
    own = make_buffer(s.bytes);
    x = own.data;
  }
  if (!x) st.SkipWithError("allocation failed");
  return x;
}

// Read (write = false: a vectorised sum) or read + write (x = x·a + b in place) bandwidth at
// level l.
void BM_bw(benchmark::State& st, Level l, bool write) {
  const Isa<float>& isa = isas<float>()[0];
  const LevelSpec s = level_spec(l);
  Buffer own;
  float* x = level_buffer(st, l, s, own);
  if (!x) return;
  const std::size_t n = s.bytes / sizeof(float);
  float r = 0;
  const auto sweep = [&](int sweeps) {
    if (write) {
      isa.rw(x, n, sweeps);
      benchmark::ClobberMemory();
    } else {
      r = isa.read(x, n, sweeps);
      keep(r);
    }
  };
  // Warm-up: the buffer into its cache level, the clock up.
  const auto t0 = Clock::now();
  do {
    sweep(1);
  } while (seconds_since(t0) < settings().warmup_s);
  for (auto _ : st) sweep(s.sweeps);
  if (!std::isfinite(write ? x[n / 2] : r)) st.SkipWithError("non-finite values");
  bw_counters(st, isa, s, (write ? 2.0 : 1.0) * double(s.bytes) * s.sweeps,
              write ? "load+fma+store" : "loads");
}

// ---------------------------------------------------------------------------------------------
// Registration
// ---------------------------------------------------------------------------------------------

benchmark::internal::Benchmark* reg(const std::string& name, std::function<void(benchmark::State&)> fn,
                                    benchmark::TimeUnit unit) {
  auto* b = benchmark::RegisterBenchmark(name.c_str(), [fn](benchmark::State& st) { fn(st); });
  b->UseRealTime()->Unit(unit);
  return b;
}

void register_all(const lb::Profile&) {
  reg("roofline_fma_peak_f32", BM_fma_peak<float>, benchmark::kMicrosecond);
  reg("roofline_fma_peak_f64", BM_fma_peak<double>, benchmark::kMicrosecond);
  for (std::size_t i = 0; i < isas<float>().size(); ++i) {
    const std::string isa = isas<float>()[i].key;
    reg("roofline_fma_isa" + lb::key("dtype", "f32") + lb::key("isa", isa),
        [i](benchmark::State& st) { BM_fma_isa<float>(st, i); }, benchmark::kMicrosecond);
    reg("roofline_fma_isa" + lb::key("dtype", "f64") + lb::key("isa", isa),
        [i](benchmark::State& st) { BM_fma_isa<double>(st, i); }, benchmark::kMicrosecond);
  }
  reg("roofline_read_bw/L1", [](benchmark::State& st) { BM_bw(st, Level::L1, false); }, benchmark::kMicrosecond);
  reg("roofline_read_bw/L2", [](benchmark::State& st) { BM_bw(st, Level::L2, false); }, benchmark::kMicrosecond);
  reg("roofline_read_bw/L3", [](benchmark::State& st) { BM_bw(st, Level::L3, false); }, benchmark::kMicrosecond);
  reg("roofline_read_bw/mem", [](benchmark::State& st) { BM_bw(st, Level::Mem, false); }, benchmark::kMillisecond);
  reg("roofline_rw_bw/L1", [](benchmark::State& st) { BM_bw(st, Level::L1, true); }, benchmark::kMicrosecond);
  reg("roofline_rw_bw/L2", [](benchmark::State& st) { BM_bw(st, Level::L2, true); }, benchmark::kMicrosecond);
  reg("roofline_rw_bw/L3", [](benchmark::State& st) { BM_bw(st, Level::L3, true); }, benchmark::kMicrosecond);
  reg("roofline_rw_bw/mem", [](benchmark::State& st) { BM_bw(st, Level::Mem, true); }, benchmark::kMillisecond);
}

std::string notes(const lb::Profile&) {
  std::string isa_list;
  for (const auto& isa : isas<float>()) isa_list += (isa_list.empty() ? "" : ", ") + std::string(isa.name);
  return "Roofline of one core: FMA peak (f32, f64) over the ISAs " + isa_list +
         " (roofline_fma_peak_* times the fastest), float read bandwidth and read+write bandwidth (x = x*a + b)"
         " from a 16 KiB (L1), 256 KiB (L2), 8 MiB (L3) and " +
         std::to_string(mem_bytes() >> 20) + " MiB (memory) buffer; one thread, unpinned.";
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
