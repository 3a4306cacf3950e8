// Feature-map approximation study: how close each feature map's linear attention comes
// to softmax attention softmax(QKᵀ/√D)V, and what it costs per token.
//
//   feature_map_quality [--quick | --full | --smoke] [--quality_out=FILE] [--quality_only]
//                       [Google Benchmark flags]
//
// First the study: float inputs of N = 1024 tokens, D = M = 64 (smoke: N = 256 and a subset),
// from flat to sharp attention (Gaussian q, k of several σ) and with the outlier channels of
// real models; every map's output (float, one thread) against exact softmax attention computed in
// double, non-causal and causal, as the relative Frobenius error. The random maps (FAVOR+,
// Linformer's projections) are drawn from several seeds: mean and standard deviation. The tables
// go to stdout; --quality_out=FILE also writes them as JSON, which
// benchmarks/feature_map_report.py turns into docs/feature_maps.md and docs/feature_maps_plot.svg.
// Then Google Benchmark times every map's attention at the same shape on one thread (names
// fm_linear/phi:<map>/dtype:f32/D:64/N:<n> and fm_causal/..., counter F); --quality_only skips
// the timings.
//
// FAVOR+ (linattn::Favor, <linattn/favor.hpp>) is part of the study when that header exists.
#include <linattn/causal_linear_attention.hpp>
#include <linattn/dpfp.hpp>
#include <linattn/elu_plus_one.hpp>
#include <linattn/linear_attention.hpp>
#include <linattn/linformer.hpp>
#include <linattn/normalized_cosine.hpp>
#include <linattn/relu.hpp>
#include <linattn/softmax_attention.hpp>
#include <linattn/softmax_split.hpp>
#include <linattn/taylor2.hpp>
#if __has_include(<linattn/favor.hpp>)
#include <linattn/favor.hpp>
#define LINATTN_FMQ_HAVE_FAVOR 1
#else
#define LINATTN_FMQ_HAVE_FAVOR 0
#endif

#include "bench_common.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace lb = linattn_bench;
using lb::Index;

namespace {

using MatF = Eigen::MatrixXf;
using MatD = Eigen::MatrixXd;

constexpr Index kD = 64, kM = 64;

// ---------------------------------------------------------------------------------------------
// Inputs
// ---------------------------------------------------------------------------------------------

// Gaussian numbers from std::mt19937_64, whose output the C++ standard fixes, through the polar
// Box–Muller method written out here: std::normal_distribution's algorithm is
// implementation-defined, and the documented figures should not depend on the standard library.
class Gaussian {
 public:
  explicit Gaussian(std::uint64_t seed) : gen_(seed) {}
  double operator()() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u, v, s;
    do {
      u = uniform();
      v = uniform();
      s = u * u + v * v;
    } while (s >= 1.0 || s == 0.0);
    const double f = std::sqrt(-2.0 * std::log(s) / s);
    spare_ = v * f;
    has_spare_ = true;
    return u * f;
  }

 private:
  double uniform() { return double(gen_() >> 11) * 0x1.0p-52 - 1.0; }  // [-1, 1)
  std::mt19937_64 gen_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

// An input family: q, k entries N(0, σ²); with `outliers` > 0, that many channels of q and k
// also carry ±strength (the same sign for every token), as the massive activations of LLMs do.
// A shared offset in a channel adds strength² to every score (softmax ignores it) and
// strength·k_c/√D to key j's score (softmax does not): it sharpens the attention and moves the
// inputs far from the origin, where the maps that estimate exp(q·k/√D) lose accuracy.
struct InputFamily {
  std::string key;    // machine name in the JSON
  std::string label;  // for people
  double sigma;
  int outliers;
  double strength;
};

std::vector<InputFamily> input_families(const lb::Profile& p) {
  std::vector<InputFamily> all = {
      // σ = 0.25: flat enough for FAVOR+'s variance factor e^{‖q+k‖²/√D} ≈ e^1 to allow its
      // 1/√m regime at the m studied (from σ = 1 on it is e^16 and more).
      {"gauss0.25", "Gaussian σ = 0.25", 0.25, 0, 0.0},
      {"gauss0.5", "Gaussian σ = 0.5", 0.5, 0, 0.0},
      {"gauss1", "Gaussian σ = 1", 1.0, 0, 0.0},
      {"gauss1.5", "Gaussian σ = 1.5", 1.5, 0, 0.0},
      {"gauss2", "Gaussian σ = 2", 2.0, 0, 0.0},
      {"outlier4", "σ = 1, 3 outlier channels ±4", 1.0, 3, 4.0},
      {"outlier8", "σ = 1, 3 outlier channels ±8", 1.0, 3, 8.0},
  };
  if (p.name == "smoke") return {all[2], all[6]};
  return all;
}

struct Inputs {
  MatD Q, K, V;
};

Inputs make_inputs(const InputFamily& f, Index N, std::uint64_t seed) {
  Gaussian g(seed);
  Inputs in{MatD(N, kD), MatD(N, kD), MatD(N, kM)};
  for (MatD* m : {&in.Q, &in.K})
    for (Index j = 0; j < m->cols(); ++j)
      for (Index i = 0; i < m->rows(); ++i) (*m)(i, j) = f.sigma * g();
  for (Index j = 0; j < kM; ++j)
    for (Index i = 0; i < N; ++i) in.V(i, j) = g();
  // Channels spread over the head, alternating signs: no map sees them all in one place.
  for (int c = 0; c < f.outliers; ++c) {
    const Index ch = 5 + Index(c) * (kD / std::max(f.outliers, 1));
    const double offset = (c % 2 == 0 ? 1.0 : -1.0) * f.strength;
    in.Q.col(ch).array() += offset;
    in.K.col(ch).array() += offset;
  }
  return in;
}

// ---------------------------------------------------------------------------------------------
// The reference: exact softmax attention in double, and how sharp it is
// ---------------------------------------------------------------------------------------------

struct Reference {
  MatD out[2];             // [causal]
  double uniform_error[2]; // [causal] error of equal weights on every attended key (mean of V)
  double entropy = 0.0;    // mean over queries of the entropy of the weights (nats), non-causal
  double max_weight = 0.0; // mean over queries of the largest weight, non-causal
  double max_weight_causal = 0.0;
};

Reference softmax_reference(const Inputs& in) {
  const Index N = in.Q.rows();
  // Column i holds query i's scores: the softmax runs down contiguous memory.
  const MatD scores = (in.K * in.Q.transpose()) / std::sqrt(double(kD));
  Reference r;
  for (int causal = 0; causal < 2; ++causal) {
    MatD P = MatD::Zero(N, N);
    double entropy = 0.0, max_weight = 0.0;
    for (Index i = 0; i < N; ++i) {
      const Index n = causal ? i + 1 : N;
      const auto s = scores.col(i).head(n);
      auto p = P.col(i).head(n);
      p = (s.array() - s.maxCoeff()).exp().matrix();
      p /= p.sum();
      max_weight += p.maxCoeff();
      for (Index j = 0; j < n; ++j)
        if (p(j) > 0.0) entropy -= p(j) * std::log(p(j));
    }
    r.out[causal] = P.transpose() * in.V;
    // The answer that ignores q and k: a map worse than this has lost the attention pattern.
    MatD uniform(N, kM);
    Eigen::RowVectorXd sum = Eigen::RowVectorXd::Zero(kM);
    for (Index i = 0; i < N; ++i) {
      sum += in.V.row(i);
      uniform.row(i) = sum / double(i + 1);
    }
    if (!causal) uniform = in.V.colwise().mean().replicate(N, 1);
    r.uniform_error[causal] = (uniform - r.out[causal]).norm() / r.out[causal].norm();
    if (causal) {
      r.max_weight_causal = max_weight / double(N);
    } else {
      r.entropy = entropy / double(N);
      r.max_weight = max_weight / double(N);
    }
  }
  return r;
}

double relative_error(const MatF& out, const MatD& ref) {
  return (out.cast<double>() - ref).norm() / ref.norm();
}

// ---------------------------------------------------------------------------------------------
// The methods: every feature map through the library's kernels, Linformer, and float softmax
// ---------------------------------------------------------------------------------------------

// One attention call on inputs bound beforehand (maps drawn, workspaces sized): the study and the
// timings call the same thing.
using Call = std::function<void(bool causal)>;
using Binder = std::function<Call(std::uint64_t seed, const MatF& Q, const MatF& K,
                                  const MatF& V, MatF& out)>;

struct Method {
  std::string key;     // machine name: benchmark names, JSON
  std::string family;  // one line of the plot
  std::string label;   // for people
  Index F;             // features (Linformer: projected keys; softmax: 0)
  bool has_causal;
  bool random;         // drawn from a seed: the study averages over draws
  bool estimator;      // E[φ(q)·φ(k)] or φ(q)·φ(k) approximates exp(q·k/√D)
  Binder bind;
};

linattn::ParallelOptions one_thread() {
  linattn::ParallelOptions par;
  par.num_threads = 1;
  return par;
}

// make_phi(seed) builds the map; deterministic maps ignore the seed.
template <class MakePhi>
Binder feature_map_binder(MakePhi make_phi) {
  return [make_phi](std::uint64_t seed, const MatF& Q, const MatF& K, const MatF& V,
                    MatF& out) -> Call {
    using Phi = decltype(make_phi(seed));
    struct Bound {
      explicit Bound(Phi p) : phi(std::move(p)) {}
      Phi phi;
      linattn::Workspace<float> ws;
      linattn::LinearAttentionState<float> state;
    };
    auto b = std::make_shared<Bound>(make_phi(seed));
    b->state = linattn::make_state<float>(b->phi, K.cols(), V.cols());
    return [b, &Q, &K, &V, &out](bool causal) {
      if (causal) {
        b->state.reset();  // every call starts from the empty sequence
        linattn::causal_linear_attention(Q, K, V, b->phi, b->state, out, b->ws, {}, one_thread());
      } else {
        linattn::linear_attention(Q, K, V, b->phi, out, b->ws, one_thread());
      }
    };
  };
}

Binder linformer_binder(Index k) {
  return [k](std::uint64_t seed, const MatF& Q, const MatF& K, const MatF& V, MatF& out) -> Call {
    struct Bound {
      MatF E, F;
      linattn::LinformerWorkspace<float> ws;
    };
    auto b = std::make_shared<Bound>();
    std::tie(b->E, b->F) = linattn::make_linformer_projections<float>(K.rows(), k, seed);
    return [b, &Q, &K, &V, &out](bool) { linattn::linformer_attention(Q, K, V, b->E, b->F, out, b->ws); };
  };
}

Binder softmax_binder() {
  return [](std::uint64_t, const MatF& Q, const MatF& K, const MatF& V, MatF& out) -> Call {
    auto ws = std::make_shared<linattn::Workspace<float>>();
    return [ws, &Q, &K, &V, &out](bool causal) {
      if (causal)
        linattn::causal_softmax_attention(Q, K, V, out, *ws);
      else
        linattn::softmax_attention(Q, K, V, out, *ws);
    };
  };
}

#if LINATTN_FMQ_HAVE_FAVOR
const std::vector<Index> kFavorFeatures = {16, 32, 64, 128, 256, 512};
#endif
const std::vector<Index> kLinformerKeys = {32, 64, 128, 256};

std::vector<Method> methods(const lb::Profile& p) {
  const bool smoke = p.name == "smoke";
  std::vector<Method> m;
  m.push_back({"softmax", "softmax", "softmax (tiled, float)", 0, true, false, true, softmax_binder()});
  m.push_back({"elu", "elu", "EluPlusOne", kD, true, false, false,
               feature_map_binder([](std::uint64_t) { return linattn::EluPlusOne{}; })});
  m.push_back({"relu", "relu", "Relu", kD, true, false, false,
               feature_map_binder([](std::uint64_t) { return linattn::Relu{}; })});
  m.push_back({"softmax_split", "softmax_split", "SoftmaxSplit", kD, true, false, false,
               feature_map_binder([](std::uint64_t) { return linattn::SoftmaxSplit{}; })});
  m.push_back({"cosine", "cosine", "NormalizedCosine", kD + 1, true, false, false,
               feature_map_binder([](std::uint64_t) { return linattn::NormalizedCosine{}; })});
  for (int nu = 1; nu <= 3; ++nu)
    m.push_back({"dpfp" + std::to_string(nu), "dpfp", "DPFP ν = " + std::to_string(nu),
                 2 * kD * nu, true, false, false,
                 feature_map_binder([nu](std::uint64_t) { return linattn::Dpfp(nu); })});
  m.push_back({"taylor2", "taylor2", "Taylor-2", 1 + kD + kD * kD, true, false, true,
               feature_map_binder([](std::uint64_t) { return linattn::Taylor2{}; })});
#if LINATTN_FMQ_HAVE_FAVOR
  for (Index f : kFavorFeatures) {
    if (smoke && f != 16 && f != 64) continue;
    m.push_back({"favor" + std::to_string(f), "favor", "FAVOR+ m = " + std::to_string(f), f, true,
                 true, true, feature_map_binder([f](std::uint64_t seed) {
                   return linattn::Favor<float>(kD, f, seed);
                 })});
  }
#endif
  for (Index k : kLinformerKeys) {
    if (smoke && k != 32) continue;
    m.push_back({"linformer" + std::to_string(k), "linformer", "Linformer k = " + std::to_string(k),
                 k, false, true, false, linformer_binder(k)});
  }
  return m;
}

// ---------------------------------------------------------------------------------------------
// The study
// ---------------------------------------------------------------------------------------------

struct Setup {
  Index N;
  int draws;  // seeds of each random map
};

Setup setup_of(const lb::Profile& p) {
  if (p.name == "smoke") return {256, 2};
  if (p.name == "full") return {1024, 32};
  return {1024, 8};
}

struct ErrorStat {
  std::string method, input;
  bool causal;
  double mean, sd, lo, hi;
  int draws;
};

struct FamilyStat {
  InputFamily family;
  double entropy, max_weight, max_weight_causal;
  double uniform_error[2];  // [causal]
};

struct Study {
  Setup setup;
  std::vector<FamilyStat> families;
  std::vector<ErrorStat> errors;
};

ErrorStat measure(const Method& m, const InputFamily& f, bool causal, const MatF& Q, const MatF& K,
                  const MatF& V, const MatD& ref, int draws) {
  std::vector<double> e;
  MatF out = MatF::Zero(Q.rows(), V.cols());
  for (int d = 0; d < (m.random ? draws : 1); ++d) {
    // The same seeds for every input family: differences between families are the inputs'.
    m.bind(std::uint64_t(1000 + d), Q, K, V, out)(causal);
    e.push_back(relative_error(out, ref));
  }
  double mean = 0.0, var = 0.0;
  for (double x : e) mean += x;
  mean /= double(e.size());
  for (double x : e) var += (x - mean) * (x - mean);
  const double sd = e.size() > 1 ? std::sqrt(var / double(e.size() - 1)) : 0.0;
  return {m.key, f.key, causal, mean, sd, *std::min_element(e.begin(), e.end()),
          *std::max_element(e.begin(), e.end()), int(e.size())};
}

Study run_study(const lb::Profile& p, const std::vector<Method>& ms) {
  Study s;
  s.setup = setup_of(p);
  const auto families = input_families(p);
  std::uint64_t seed = 20260;
  for (const auto& f : families) {
    const Inputs in = make_inputs(f, s.setup.N, ++seed);
    const Reference ref = softmax_reference(in);
    s.families.push_back({f, ref.entropy, ref.max_weight, ref.max_weight_causal,
                          {ref.uniform_error[0], ref.uniform_error[1]}});
    const MatF Q = in.Q.cast<float>(), K = in.K.cast<float>(), V = in.V.cast<float>();
    for (const auto& m : ms)
      for (bool causal : {false, true})
        if (!causal || m.has_causal)
          s.errors.push_back(measure(m, f, causal, Q, K, V, ref.out[causal], s.setup.draws));
  }
  return s;
}

const ErrorStat* find_error(const Study& s, const std::string& method, const std::string& input,
                            bool causal) {
  for (const auto& e : s.errors)
    if (e.method == method && e.input == input && e.causal == causal) return &e;
  return nullptr;
}

void print_study(const Study& s, const std::vector<Method>& ms) {
  std::printf("\nFeature-map approximation of softmax attention: N = %lld, D = M = %lld, float "
              "inputs, errors against softmax(QK^T/sqrt(D))V in double (relative Frobenius); random "
              "maps: mean ± sd over %d draws.%s\n\n",
              (long long)s.setup.N, (long long)kD, s.setup.draws,
              LINATTN_FMQ_HAVE_FAVOR ? "" : " (FAVOR+: <linattn/favor.hpp> not available.)");
  std::printf("%-10s %9s %9s %9s %9s %9s %9s\n", "input", "entropy", "e^H", "max w",
              "max w c", "uniform", "uniform c");
  for (const auto& f : s.families)
    std::printf("%-10s %9.3f %9.1f %9.3f %9.3f %9.3g %9.3g\n", f.family.key.c_str(), f.entropy,
                std::exp(f.entropy), f.max_weight, f.max_weight_causal, f.uniform_error[0],
                f.uniform_error[1]);
  for (bool causal : {false, true}) {
    std::printf("\n%s\n%-16s %5s", causal ? "causal" : "non-causal", "map", "F");
    for (const auto& f : s.families) std::printf(" %17s", f.family.key.c_str());
    std::printf("\n");
    for (const auto& m : ms) {
      if (causal && !m.has_causal) continue;
      std::printf("%-16s %5lld", m.key.c_str(), (long long)m.F);
      for (const auto& f : s.families) {
        const ErrorStat* e = find_error(s, m.key, f.family.key, causal);
        char cell[64];
        if (e && m.random)
          std::snprintf(cell, sizeof cell, "%.3g±%.2g", e->mean, e->sd);
        else if (e)
          std::snprintf(cell, sizeof cell, "%.3g", e->mean);
        else
          std::snprintf(cell, sizeof cell, "-");
        std::printf(" %17s", cell);
      }
      std::printf("\n");
    }
  }
  std::printf("\n");
  std::fflush(stdout);
}

// JSON numbers; a non-finite error (a map whose output overflowed) becomes null.
std::string num(double x) {
  if (!std::isfinite(x)) return "null";
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", x);
  return b;
}

std::string quoted(const std::string& s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') q += '\\';
    q += c;
  }
  return q + "\"";
}

bool write_study(const std::string& path, const Study& s, const std::vector<Method>& ms,
                 const lb::Profile& p) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) return false;
  std::fprintf(f, "{\n  \"profile\": %s,\n  \"N\": %lld,\n  \"D\": %lld,\n  \"M\": %lld,\n"
                  "  \"draws\": %d,\n  \"favor\": %s,\n  \"families\": [\n",
               quoted(p.name).c_str(), (long long)s.setup.N, (long long)kD, (long long)kM,
               s.setup.draws, LINATTN_FMQ_HAVE_FAVOR ? "true" : "false");
  for (std::size_t i = 0; i < s.families.size(); ++i) {
    const auto& x = s.families[i];
    std::fprintf(f, "    {\"key\": %s, \"label\": %s, \"sigma\": %s, \"outliers\": %d, "
                    "\"strength\": %s, \"entropy\": %s, \"max_weight\": %s, "
                    "\"max_weight_causal\": %s, \"uniform_error\": %s, "
                    "\"uniform_error_causal\": %s}%s\n",
                 quoted(x.family.key).c_str(), quoted(x.family.label).c_str(),
                 num(x.family.sigma).c_str(), x.family.outliers, num(x.family.strength).c_str(),
                 num(x.entropy).c_str(), num(x.max_weight).c_str(),
                 num(x.max_weight_causal).c_str(), num(x.uniform_error[0]).c_str(),
                 num(x.uniform_error[1]).c_str(), i + 1 < s.families.size() ? "," : "");
  }
  std::fprintf(f, "  ],\n  \"methods\": [\n");
  for (std::size_t i = 0; i < ms.size(); ++i) {
    const auto& m = ms[i];
    std::fprintf(f, "    {\"key\": %s, \"family\": %s, \"label\": %s, \"F\": %lld, "
                    "\"causal\": %s, \"random\": %s, \"estimator\": %s}%s\n",
                 quoted(m.key).c_str(), quoted(m.family).c_str(), quoted(m.label).c_str(),
                 (long long)m.F, m.has_causal ? "true" : "false", m.random ? "true" : "false",
                 m.estimator ? "true" : "false", i + 1 < ms.size() ? "," : "");
  }
  std::fprintf(f, "  ],\n  \"errors\": [\n");
  for (std::size_t i = 0; i < s.errors.size(); ++i) {
    const auto& e = s.errors[i];
    std::fprintf(f, "    {\"method\": %s, \"input\": %s, \"causal\": %s, \"mean\": %s, \"sd\": %s, "
                    "\"min\": %s, \"max\": %s, \"draws\": %d}%s\n",
                 quoted(e.method).c_str(), quoted(e.input).c_str(), e.causal ? "true" : "false",
                 num(e.mean).c_str(), num(e.sd).c_str(), num(e.lo).c_str(), num(e.hi).c_str(),
                 e.draws, i + 1 < s.errors.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  return std::fclose(f) == 0;
}

// ---------------------------------------------------------------------------------------------
// Timings
// ---------------------------------------------------------------------------------------------

double method_flops(const Method& m, Index N, bool causal) {
  if (m.family == "softmax") return lb::softmax_flops(N, N, kD, kM, causal);
  if (m.family == "linformer")  // E·K, F·V, then softmax against k keys
    return 2.0 * double(m.F) * double(N) * double(kD + kM) + lb::softmax_flops(N, m.F, kD, kM, false);
  return lb::linear_flops(N, N, m.F, kM);
}

void BM_method(benchmark::State& st, const Method& m, bool causal) {
  const Index N = st.range(0);
  // Uniform inputs: every map's cost is independent of the values.
  const MatF Q = lb::random_matrix<float>(N, kD, 31), K = lb::random_matrix<float>(N, kD, 32),
             V = lb::random_matrix<float>(N, kM, 33);
  MatF out = MatF::Zero(N, kM);
  const Call call = m.bind(1000, Q, K, V, out);
  call(causal);  // sizes the workspaces
  for (auto _ : st) {
    call(causal);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  if (!lb::all_finite(out)) st.SkipWithError("non-finite output");
  lb::set_common_counters(st, method_flops(m, N, causal), N, kD, kM, 1, 1);
  st.counters["F"] = double(m.F);
}

struct Options {
  std::string quality_out;
  bool quality_only = false;
};

Options& options() {
  static Options o;
  return o;
}

// run_main calls this once the profile is known and before Google Benchmark starts: the study
// runs here, so that its tables precede the timings and the JSON exists when the program ends.
void register_all(const lb::Profile& p) {
  static const std::vector<Method> ms = methods(p);
  const Study s = run_study(p, ms);
  print_study(s, ms);
  if (!options().quality_out.empty()) {
    if (!write_study(options().quality_out, s, ms, p)) {
      std::fprintf(stderr, "feature_map_quality: cannot write %s\n", options().quality_out.c_str());
      std::exit(1);
    }
    std::printf("errors written to %s\n", options().quality_out.c_str());
  }
  if (options().quality_only) return;
  const Index N = setup_of(p).N;
  for (const auto& m : ms)
    for (bool causal : {false, true}) {
      if (causal && !m.has_causal) continue;
      const std::string name = std::string(causal ? "fm_causal" : "fm_linear") +
                               lb::key("phi", m.key) + lb::key("dtype", "f32") + lb::key("D", kD);
      lb::add(name, {N}, "N", benchmark::oN,
              [&m, causal](benchmark::State& st) { BM_method(st, m, causal); })
          ->Unit(benchmark::kMicrosecond);
    }
}

std::string notes(const lb::Profile& p) {
  return "Feature maps against softmax: study at N = " + std::to_string(setup_of(p).N) +
         ", D = M = 64, one thread" +
         (LINATTN_FMQ_HAVE_FAVOR ? "" : "; FAVOR+ not built (<linattn/favor.hpp> missing)") + ".";
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (i > 0 && a.rfind("--quality_out=", 0) == 0)
      options().quality_out = a.substr(14);
    else if (i > 0 && a == "--quality_only")
      options().quality_only = true;
    else
      rest.push_back(argv[i]);
  }
  rest.push_back(nullptr);
  return lb::run_main(int(rest.size()) - 1, rest.data(), register_all, notes);
}
