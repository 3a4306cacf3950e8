// The batched decoders of Gated DeltaNet / KDA and of decayed linear attention
// (BatchedRecurrentDeltaRule, BatchedRecurrentGatedAttention), float, D = M, tokens in
// column-major matrices (one row per sequence or token):
//
//   - bdec_step: one step() of B sequences × H heads, B = 1, 8, 64, H = 16, 32, D = M = 128, on 1
//     and 2 threads (ParallelOptions::num_threads; the decoder uses fewer where the work does not
//     pay for them):
//       kind:delta/decay:scalar   BatchedRecurrentDeltaRule<L2Normalize<>>, log_a B×H
//       kind:delta/decay:channel  the same with log_a B×H·F (KDA)
//       kind:gated/decay:scalar   BatchedRecurrentGatedAttention<Identity>, log-gates B×H,
//                                 normalize = false
//     β uniform in [0, 1], log-decays uniform in [−0.1, 0], scale 1/√D. Time per step (the
//     benchmark's time) and per token (ns_per_token = step ÷ B); bytes_moved = each head's state
//     read and written once (2 × state_bytes) plus the token's q, k, v, gates and output;
//     frac_of_bw = bytes_moved ÷ time ÷ bw_rw, the read + write bandwidth of a buffer of the
//     states' size on the same threads, measured in this process right after the timed loop
//     (bench_common.hpp: rw_bandwidth); frac_of_peak = useful flops (4·F·M per head and token) ÷
//     time ÷ the FMA peak of the same threads measured right after the loop (fma_peak_now).
//   - bdec_extend_pair: T = 1, 4, 16, 64 tokens of S = 1 and 8 sequences (H = 16, D = M = 128),
//     three decoders fed the same tokens: T step() calls (the slots' rows one token at a time),
//     one extend() of the T·S rows, and one extend() of a decoder with keep_snapshots(8), timed
//     back to back in rotating order; counters steps_us, extend_us, snap_us per call, the medians
//     of the per-iteration ratios extend_vs_steps (target ≤ 1.2) and snap_vs_extend, and the same
//     of the thread's CPU times (*_cpu). Small calls are repeated `reps` times per measurement.
//   - bdec_state_pair: the delta-rule step (scalar decay) at B = 8, 64 × H = 16, 32, D = M = 128
//     with float states (BatchedRecurrentDeltaRule<L2Normalize<>, float>) and bf16 states
//     (<..., float, Eigen::bfloat16>) on the same float tokens, the two steps timed back to back
//     in alternating order within every iteration (so that a load on the machine hits both
//     alike), on 1 and 2 threads; counters f32_us and bf16_us (medians), bf16_vs_f32 (median of
//     the per-iteration ratios), the same of the calling thread's CPU time (*_cpu_us,
//     bf16_vs_f32_cpu), f32_GBs and bf16_GBs (each head's state read and written once, 4 and 2
//     bytes an entry, ÷ the median time).
//   - bdec_prefill_pair: a multi-head prefill call with carried states on N = 1, 4, 16, 64 rows
//     (H = 16, D = M = 64, 128, float, one thread, a reused MultiHeadWorkspace and output)
//     against N step() calls of the matching batched decoder with B = 1, from the same states
//     (both continue a 64-token prefill) on the same tokens, timed back to back in alternating
//     order within every iteration:
//       kind:gated/decay:scalar|feature   multihead_gated_linear_attention (Identity, log-gates
//                                         N×H or N×H·F, normalize = false) vs
//                                         BatchedRecurrentGatedAttention<Identity>
//       kind:delta/decay:scalar|channel   multihead_delta_rule_attention (L2Normalize<>, log_a
//                                         N×H or N×H·F) vs BatchedRecurrentDeltaRule
//       kind:linear/decay:none            multihead_causal_linear_attention (EluPlusOne) vs
//                                         BatchedRecurrentLinearAttention<EluPlusOne>
//     counters call_us, steps_us (medians), call_vs_steps (median of the per-iteration ratios;
//     target ≤ 1.2) and the same of the thread's CPU times (call_vs_steps_cpu). Calls are
//     repeated `reps` times per measurement to cover 16 rows.
//   - --drift (instead of the benchmarks): what bf16 / half states cost in accuracy
//     (docs/SPEC.md §9.3): one sequence of one head, D = M = 128, q, k, v uniform in [−1, 1],
//     β in [0, 1], log-decays in [−0.1, 0] (scalar; per channel for KDA; log gates for the gated
//     decoder, normalize = false); the relative error (2-norm) of the outputs of the last tenth
//     of the tokens up to each length against the float-state decoder on the same tokens.
//
// Names follow bench_common.hpp:
//   bdec_step/kind:delta/decay:channel/dtype:f32/H:32/D:128/thr:2/B:64
//   bdec_extend_pair/kind:gated/decay:scalar/dtype:f32/H:16/D:128/S:8/T:16/thr:1
//   bdec_prefill_pair/kind:delta/decay:channel/dtype:f32/H:16/D:128/thr:1/N:16
#include <linattn/linattn.hpp>

#if __has_include(<linattn/delta/batched_recurrent_delta_rule.hpp>) && \
    __has_include(<linattn/gated/batched_recurrent_gated_attention.hpp>)
#include <linattn/delta.hpp>
#include <linattn/gated.hpp>
#define LINATTN_BENCH_BDEC 1
#else
#define LINATTN_BENCH_BDEC 0
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace lb = linattn_bench;
using lb::Index;

namespace {

template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;

constexpr Index kRing = 4;  // distinct token sets cycled through by the timed steps

struct DecodeSizes {
  std::vector<Index> batches, heads, dims, seqs, tokens, extend_heads, state_batches, prefill_dims;
  std::vector<int> threads;
  int pair_iterations = 0;
  Index pair_rows = 0;  // a measurement repeats the call until it covers this many head tokens
};

DecodeSizes decode_sizes(const lb::Profile& p) {
  DecodeSizes s;
  s.threads = {1, 2};
  if (p.name == "smoke") {
    s.batches = {1, 2};
    s.state_batches = {2};
    s.heads = {4};
    s.dims = {32};
    s.seqs = {1, 2};
    s.tokens = {1, 4};
    s.extend_heads = {4};
    s.pair_iterations = 2;
    s.pair_rows = 8;
    s.prefill_dims = {32};
  } else {
    s.batches = {1, 8, 64};
    s.state_batches = {8, 64};
    s.heads = {16, 32};
    s.dims = {128};
    s.seqs = {1, 8};
    s.tokens = {1, 4, 16, 64};
    s.extend_heads = p.name == "full" ? std::vector<Index>{16, 32} : std::vector<Index>{16};
    s.pair_iterations = p.name == "full" ? 30 : 15;
    s.pair_rows = 256;
    s.prefill_dims = {64, 128};
  }
  return s;
}

#if LINATTN_BENCH_BDEC

enum class Kind { DeltaScalar, DeltaChannel, GatedScalar };

const char* kind_key(Kind k) { return k == Kind::GatedScalar ? "gated" : "delta"; }
const char* decay_key(Kind k) { return k == Kind::DeltaChannel ? "channel" : "scalar"; }

using DeltaDec = linattn::BatchedRecurrentDeltaRule<linattn::L2Normalize<>, float>;
using GatedDec = linattn::BatchedRecurrentGatedAttention<linattn::Identity, float>;

// One decoder of either kind behind the same calls.
struct Decoder {
  Kind kind;
  std::unique_ptr<DeltaDec> delta;
  std::unique_ptr<GatedDec> gated;
  Decoder(Kind k, Index B, Index H, Index D) : kind(k) {
    if (k == Kind::GatedScalar) {
      linattn::GatedOptions o;
      o.scale = 1.0 / std::sqrt(double(D));
      gated = std::make_unique<GatedDec>(B, H, D, D, linattn::Identity{}, o);
    } else {
      linattn::DeltaOptions o;
      o.scale = 1.0 / std::sqrt(double(D));
      delta = std::make_unique<DeltaDec>(B, H, D, D, linattn::L2Normalize<>(1e-6), o);
    }
  }
  template <class Q, class K, class V, class Bt, class G, class O>
  void step(const Q& q, const K& k, const V& v, const Bt& beta, const G& g, O&& out,
            const linattn::ParallelOptions& par) {
    if (gated)
      gated->step(q, k, v, g, out, par);
    else
      delta->step(q, k, v, beta, g, out, par);
  }
  template <class Sl, class Off, class Q, class K, class V, class Bt, class G, class O>
  void extend(const Sl& slots, const Off& off, const Q& q, const K& k, const V& v, const Bt& beta,
              const G& g, O&& out, const linattn::ParallelOptions& par) {
    if (gated)
      gated->extend(slots, off, q, k, v, g, out, par);
    else
      delta->extend(slots, off, q, k, v, beta, g, out, par);
  }
  void keep_snapshots(Index n) {
    if (gated)
      gated->keep_snapshots(n);
    else
      delta->keep_snapshots(n);
  }
};

// Tokens: `rows` rows of q, k, v (H heads of D), β (H) and log-decays (H, or H·D per channel).
struct Tokens {
  Mat<float> q, k, v, beta, g, out;
  Tokens(Index rows, Index H, Index D, Kind kind, std::uint64_t seed)
      : q(lb::random_matrix<float>(rows, H * D, seed + 1)),
        k(lb::random_matrix<float>(rows, H * D, seed + 2)),
        v(lb::random_matrix<float>(rows, H * D, seed + 3)),
        beta((0.5f * (lb::random_matrix<float>(rows, H, seed + 4).array() + 1.0f)).matrix()),
        g((-0.05f * (lb::random_matrix<float>(rows, kind == Kind::DeltaChannel ? H * D : H, seed + 5)
                         .array() +
                     1.0f))
              .matrix()),
        out(Mat<float>::Zero(rows, H * D)) {}
  double bytes_per_row() const {
    return double(q.cols() + k.cols() + v.cols() + beta.cols() + g.cols() + out.cols()) * sizeof(float);
  }
};

// State bytes of one head: S (F×M) for the delta rule; S and z (F×M + F) for the gated decoder.
double head_state_bytes(Kind kind, Index D) {
  return double((kind == Kind::GatedScalar ? D * D + D : D * D) * Index(sizeof(float)));
}

void BM_step(benchmark::State& st, Kind kind, Index H, Index D, int threads) {
  const Index B = st.range(0);
  lb::set_threads(threads);
  linattn::ParallelOptions par;
  par.num_threads = threads;
  Decoder dec(kind, B, H, D);
  Tokens tok(kRing * B, H, D, kind, 500);
  Index t = 0;
  const auto one = [&] {
    dec.step(tok.q.middleRows(t * B, B), tok.k.middleRows(t * B, B), tok.v.middleRows(t * B, B),
             tok.beta.middleRows(t * B, B), tok.g.middleRows(t * B, B), tok.out.middleRows(t * B, B), par);
    t = (t + 1) % kRing;
  };
  for (int w = 0; w < 8; ++w) one();  // faults the states in, clock
  const double state = double(B * H) * head_state_bytes(kind, D);
  const double moved = 2.0 * state + double(B) * tok.bytes_per_row();
  const double flops = double(B * H) * 4.0 * double(D) * double(D);
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : st) {
    one();
    benchmark::DoNotOptimize(tok.out.data());
    benchmark::ClobberMemory();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
                   double(std::max<benchmark::IterationCount>(st.iterations(), 1));
  if (!lb::all_finite(tok.out)) st.SkipWithError("non-finite output");
  const double bw = lb::rw_bandwidth(state, threads);  // right after the loop, as the peak
  st.SetItemsProcessed(int64_t(st.iterations()) * int64_t(B));
  st.SetComplexityN(B);
  lb::set_common_counters(st, flops, 1, D, D, H, threads);
  lb::set_peak_counters(st, flops, s, threads);
  st.counters["B"] = double(B);
  st.counters["ns_per_token"] = 1e9 * s / double(B);
  st.counters["state_bytes"] = state;
  st.counters["bytes_moved"] = moved;
  st.counters["bw_rw_GBs"] = bw * 1e-9;
  st.counters["frac_of_bw"] = s > 0 && bw > 0 ? moved / s / bw : 0.0;
  lb::set_threads(1);
}

// The delta-rule step with float and with bf16 states, alternately (see the file comment).
void BM_state_pair(benchmark::State& st, Index B, Index H, Index D, int threads) {
  using LowDec = linattn::BatchedRecurrentDeltaRule<linattn::L2Normalize<>, float, Eigen::bfloat16>;
  lb::set_threads(threads);
  linattn::ParallelOptions par;
  par.num_threads = threads;
  linattn::DeltaOptions o;
  o.scale = 1.0 / std::sqrt(double(D));
  DeltaDec full(B, H, D, D, linattn::L2Normalize<>(1e-6), o);
  LowDec low(B, H, D, D, linattn::L2Normalize<>(1e-6), o);
  Tokens tok(kRing * B, H, D, Kind::DeltaScalar, 700);
  Index t = 0;
  const auto step = [&](auto& dec) {
    dec.step(tok.q.middleRows(t * B, B), tok.k.middleRows(t * B, B), tok.v.middleRows(t * B, B),
             tok.beta.middleRows(t * B, B), tok.g.middleRows(t * B, B),
             tok.out.middleRows(t * B, B), par);
  };
  // Wall time, and the calling thread's CPU time (the 1-thread figure a neighbour's
  // timeslices do not inflate).
  double cpu = 0;
  const auto timed = [&](auto& dec) {
    const double c0 = lb::thread_cpu_seconds();
    const auto a = std::chrono::steady_clock::now();
    step(dec);
    benchmark::DoNotOptimize(tok.out.data());
    benchmark::ClobberMemory();
    const double w = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
    cpu = lb::thread_cpu_seconds() - c0;
    return w;
  };
  for (int w = 0; w < 8; ++w) {  // faults the states in, clock
    step(full);
    step(low);
    t = (t + 1) % kRing;
  }
  std::vector<double> tf, tl, ratio, cf, cl, cratio;
  bool low_first = false;
  for (auto _ : st) {
    double f, l, fc, lc;
    if (low_first) {
      l = timed(low);
      lc = cpu;
      f = timed(full);
      fc = cpu;
    } else {
      f = timed(full);
      fc = cpu;
      l = timed(low);
      lc = cpu;
    }
    cf.push_back(fc);
    cl.push_back(lc);
    cratio.push_back(fc > 0 ? lc / fc : 0.0);
    low_first = !low_first;
    t = (t + 1) % kRing;
    tf.push_back(f);
    tl.push_back(l);
    ratio.push_back(l / f);
    st.SetIterationTime(f + l);
  }
  if (!lb::all_finite(tok.out)) st.SkipWithError("non-finite output");
  const double entries = double(B * H) * double(D) * double(D);
  const double mf = lb::median(tf), ml = lb::median(tl);
  st.counters["f32_us"] = 1e6 * mf;
  st.counters["bf16_us"] = 1e6 * ml;
  st.counters["bf16_vs_f32"] = lb::median(ratio);
  st.counters["f32_cpu_us"] = 1e6 * lb::median(cf);
  st.counters["bf16_cpu_us"] = 1e6 * lb::median(cl);
  st.counters["bf16_vs_f32_cpu"] = lb::median(cratio);
  st.counters["f32_GBs"] = mf > 0 ? 2.0 * 4.0 * entries / mf * 1e-9 : 0.0;
  st.counters["bf16_GBs"] = ml > 0 ? 2.0 * 2.0 * entries / ml * 1e-9 : 0.0;
  st.counters["B"] = double(B);
  st.counters["H"] = double(H);
  st.counters["threads"] = threads;
  lb::set_threads(1);
}

// T step() calls, one extend() and one extend() with keep_snapshots(8), of S sequences.
void BM_extend_pair(benchmark::State& st, Kind kind, Index H, Index D, Index S, Index T, int threads,
                    Index pair_rows) {
  lb::set_threads(threads);
  linattn::ParallelOptions par;
  par.num_threads = threads;
  Decoder steps(kind, S, H, D), ext(kind, S, H, D), snap(kind, S, H, D);
  snap.keep_snapshots(8);
  // Sequence-major rows for extend (sequence i: rows [i·T, (i+1)·T)), token-major for the steps
  // (token t: rows [t·S, (t+1)·S)): the same values.
  Tokens seq(S * T, H, D, kind, 700), tm(S * T, H, D, kind, 700);
  for (Index i = 0; i < S; ++i)
    for (Index t = 0; t < T; ++t) {
      tm.q.row(t * S + i) = seq.q.row(i * T + t);
      tm.k.row(t * S + i) = seq.k.row(i * T + t);
      tm.v.row(t * S + i) = seq.v.row(i * T + t);
      tm.beta.row(t * S + i) = seq.beta.row(i * T + t);
      tm.g.row(t * S + i) = seq.g.row(i * T + t);
    }
  Eigen::VectorXi slots(S);
  std::vector<int> off(std::size_t(S) + 1);
  for (Index i = 0; i < S; ++i) slots(i) = int(i);
  for (Index i = 0; i <= S; ++i) off[std::size_t(i)] = int(i * T);
  const Index reps = std::max<Index>(1, pair_rows / (S * T));
  const auto call = [&](int c) {
    for (Index r = 0; r < reps; ++r) {
      if (c == 0) {
        for (Index t = 0; t < T; ++t)
          steps.step(tm.q.middleRows(t * S, S), tm.k.middleRows(t * S, S), tm.v.middleRows(t * S, S),
                     tm.beta.middleRows(t * S, S), tm.g.middleRows(t * S, S), tm.out.middleRows(t * S, S),
                     par);
      } else {
        Decoder& d = c == 1 ? ext : snap;
        d.extend(slots, off, seq.q, seq.k, seq.v, seq.beta, seq.g, seq.out, par);
      }
    }
  };
  for (int w = 0; w < 2; ++w)
    for (int c = 0; c < 3; ++c) call(c);
  std::vector<double> tk[3], r_ext, r_snap, c_ext, c_snap;
  int first = 0;
  for (auto _ : st) {
    double tw[3] = {}, tc[3] = {};
    for (int j = 0; j < 3; ++j) {
      const int c = (first + j) % 3;
      const double c0 = lb::thread_cpu_seconds();
      const auto t0 = std::chrono::steady_clock::now();
      call(c);
      benchmark::ClobberMemory();
      tw[c] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / double(reps);
      tc[c] = (lb::thread_cpu_seconds() - c0) / double(reps);
    }
    st.SetIterationTime((tw[0] + tw[1] + tw[2]) * double(reps));
    for (int c = 0; c < 3; ++c) tk[c].push_back(tw[c]);
    r_ext.push_back(tw[1] / tw[0]);
    r_snap.push_back(tw[2] / tw[1]);
    c_ext.push_back(tc[1] / tc[0]);
    c_snap.push_back(tc[2] / tc[1]);
    first = (first + 1) % 3;
  }
  if (!lb::all_finite(seq.out) || !lb::all_finite(tm.out)) st.SkipWithError("non-finite output");
  st.counters["steps_us"] = 1e6 * lb::median(tk[0]);
  st.counters["extend_us"] = 1e6 * lb::median(tk[1]);
  st.counters["snap_us"] = 1e6 * lb::median(tk[2]);
  st.counters["extend_vs_steps"] = lb::median(r_ext);
  st.counters["extend_vs_steps_cpu"] = lb::median(c_ext);
  st.counters["snap_vs_extend"] = lb::median(r_snap);
  st.counters["snap_vs_extend_cpu"] = lb::median(c_snap);
  st.counters["ns_per_token_extend"] = 1e9 * lb::median(tk[1]) / double(S * T);
  st.counters["reps"] = double(reps);
  st.counters["S"] = double(S);
  st.counters["T"] = double(T);
  st.counters["H"] = double(H);
  st.counters["D"] = double(D);
  st.counters["threads"] = threads;
  lb::set_threads(1);
}

// The multi-head prefill with carried states against N steps of the batched decoder (B = 1).
enum class PrefillKind { GatedScalar, GatedFeature, DeltaScalar, DeltaChannel, Linear };

const char* prefill_kind_key(PrefillKind k) {
  return k == PrefillKind::Linear ? "linear"
         : (k == PrefillKind::GatedScalar || k == PrefillKind::GatedFeature) ? "gated"
                                                                               : "delta";
}
const char* prefill_decay_key(PrefillKind k) {
  switch (k) {
    case PrefillKind::GatedFeature: return "feature";
    case PrefillKind::DeltaChannel: return "channel";
    case PrefillKind::Linear: return "none";
    default: return "scalar";
  }
}

// Times `call` (the prefill) and `steps` (N decoder steps) back to back in alternating order,
// `reps` times each per measurement; the medians into the counters.
template <class Call, class Steps>
void time_prefill_pair(benchmark::State& st, Index reps, Call&& call, Steps&& steps) {
  const auto timed = [&](auto& f, double& cpu) {
    const double c0 = lb::thread_cpu_seconds();
    const auto t0 = std::chrono::steady_clock::now();
    for (Index r = 0; r < reps; ++r) f();
    benchmark::ClobberMemory();
    const double w = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    cpu = (lb::thread_cpu_seconds() - c0) / double(reps);
    return w / double(reps);
  };
  for (int w = 0; w < 2; ++w) {
    call();
    steps();
  }
  std::vector<double> tc, ts, ratio, cratio;
  bool steps_first = false;
  for (auto _ : st) {
    double a, b, ac, bc;
    if (steps_first) {
      b = timed(steps, bc);
      a = timed(call, ac);
    } else {
      a = timed(call, ac);
      b = timed(steps, bc);
    }
    steps_first = !steps_first;
    tc.push_back(a);
    ts.push_back(b);
    ratio.push_back(a / b);
    cratio.push_back(bc > 0 ? ac / bc : 0.0);
    st.SetIterationTime((a + b) * double(reps));
  }
  st.counters["call_us"] = 1e6 * lb::median(tc);
  st.counters["steps_us"] = 1e6 * lb::median(ts);
  st.counters["call_vs_steps"] = lb::median(ratio);
  st.counters["call_vs_steps_cpu"] = lb::median(cratio);
  st.counters["reps"] = double(reps);
}

void BM_prefill_pair(benchmark::State& st, PrefillKind kind, Index H, Index D) {
  const Index N = st.range(0);
  constexpr Index kWarm = 64;  // tokens both continue from
  lb::set_threads(1);
  linattn::ParallelOptions par;
  par.num_threads = 1;
  const bool wide = kind == PrefillKind::GatedFeature || kind == PrefillKind::DeltaChannel;
  const Kind tk = wide ? Kind::DeltaChannel : Kind::DeltaScalar;  // the log-decays' width
  Tokens warm(kWarm, H, D, tk, 800), tok(N, H, D, tk, 810);
  Mat<float> dout = Mat<float>::Zero(1, H * D);
  linattn::MultiHeadWorkspace<float> ws;
  std::vector<linattn::LinearAttentionState<float>> states;
  const Index reps = std::max<Index>(1, 16 / N);
  const double scale = 1.0 / std::sqrt(double(D));
  if (kind == PrefillKind::GatedScalar || kind == PrefillKind::GatedFeature) {
    linattn::GatedOptions o;
    o.scale = scale;
    o.normalize = false;
    const auto prefill = [&](const Tokens& t) {
      linattn::multihead_gated_linear_attention(t.q, t.k, t.v, t.g, H, linattn::Identity{}, states,
                                                t.out, ws, o, par);
    };
    prefill(warm);
    GatedDec dec(1, H, D, D, linattn::Identity{}, o);
    dec.set_states(states);
    time_prefill_pair(
        st, reps, [&] { prefill(tok); },
        [&] {
          for (Index i = 0; i < N; ++i)
            dec.step(tok.q.row(i), tok.k.row(i), tok.v.row(i), tok.g.row(i), dout, par);
        });
  } else if (kind == PrefillKind::Linear) {
    const auto prefill = [&](const Tokens& t) {
      linattn::multihead_causal_linear_attention(t.q, t.k, t.v, H, linattn::EluPlusOne{}, states,
                                                 t.out, ws, linattn::CausalOptions{}, par);
    };
    prefill(warm);
    linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float> dec(1, H, D, D);
    dec.set_states(states, kWarm);
    time_prefill_pair(
        st, reps, [&] { prefill(tok); },
        [&] {
          for (Index i = 0; i < N; ++i)
            dec.step(tok.q.row(i), tok.k.row(i), tok.v.row(i), dout, par);
        });
  } else {
    linattn::DeltaOptions o;
    o.scale = scale;
    const linattn::L2Normalize<> phi(1e-6);
    const auto prefill = [&](const Tokens& t) {
      linattn::multihead_delta_rule_attention(t.q, t.k, t.v, t.beta, t.g, H, phi, states, t.out, ws,
                                              o, par);
    };
    prefill(warm);
    DeltaDec dec(1, H, D, D, phi, o);
    dec.set_states(states);
    time_prefill_pair(
        st, reps, [&] { prefill(tok); },
        [&] {
          for (Index i = 0; i < N; ++i)
            dec.step(tok.q.row(i), tok.k.row(i), tok.v.row(i), tok.beta.row(i), tok.g.row(i), dout,
                     par);
        });
  }
  if (!lb::all_finite(tok.out) || !lb::all_finite(dout)) st.SkipWithError("non-finite output");
  st.counters["N"] = double(N);
  st.counters["H"] = double(H);
  st.counters["D"] = double(D);
  st.counters["threads"] = 1;
}

#endif  // LINATTN_BENCH_BDEC

void register_all(const lb::Profile& p) {
#if LINATTN_BENCH_BDEC
  const DecodeSizes s = decode_sizes(p);
  const double peak = lb::fma_peak_gflops<float>();
  benchmark::AddCustomContext("linattn_fma_peak_f32_gflops", std::to_string(peak));
  const Kind kinds[] = {Kind::DeltaScalar, Kind::DeltaChannel, Kind::GatedScalar};
  for (Kind k : kinds)
    for (Index H : s.heads)
      for (Index D : s.dims)
        for (int thr : s.threads) {
          const std::string name = std::string("bdec_step") + lb::key("kind", kind_key(k)) +
                                   lb::key("decay", decay_key(k)) + lb::key("dtype", "f32") + lb::key("H", H) +
                                   lb::key("D", D) + lb::key("thr", thr);
          lb::add(name, s.batches, "B", benchmark::oN,
                  [k, H, D, thr](benchmark::State& st) { BM_step(st, k, H, D, thr); })
              ->Unit(benchmark::kMicrosecond);
        }
  for (Index H : s.heads)
    for (Index D : s.dims)
      for (int thr : s.threads)
        for (Index B : s.state_batches) {
          const std::string name = std::string("bdec_state_pair") + lb::key("kind", "delta") +
                                   lb::key("decay", "scalar") + lb::key("H", H) + lb::key("D", D) +
                                   lb::key("thr", thr) + lb::key("B", B);
          benchmark::RegisterBenchmark(
              name.c_str(),
              [B, H, D, thr](benchmark::State& st) { BM_state_pair(st, B, H, D, thr); })
              ->UseManualTime()
              ->Unit(benchmark::kMicrosecond);
        }
  for (Kind k : kinds)
    for (Index H : s.extend_heads)
      for (Index D : s.dims)
        for (Index S : s.seqs)
          for (Index T : s.tokens)
            for (int thr : s.threads) {
              const std::string name = std::string("bdec_extend_pair") + lb::key("kind", kind_key(k)) +
                                       lb::key("decay", decay_key(k)) + lb::key("dtype", "f32") +
                                       lb::key("H", H) + lb::key("D", D) + lb::key("S", S) + lb::key("T", T) +
                                       lb::key("thr", thr);
              const Index rows = s.pair_rows;
              benchmark::RegisterBenchmark(name.c_str(),
                                           [k, H, D, S, T, thr, rows](benchmark::State& st) {
                                             BM_extend_pair(st, k, H, D, S, T, thr, rows);
                                           })
                  ->UseManualTime()
                  ->Unit(benchmark::kMicrosecond)
                  ->Iterations(s.pair_iterations);
            }
  const PrefillKind pkinds[] = {PrefillKind::GatedScalar, PrefillKind::GatedFeature,
                                PrefillKind::DeltaScalar, PrefillKind::DeltaChannel,
                                PrefillKind::Linear};
  for (PrefillKind k : pkinds)
    for (Index D : s.prefill_dims) {
      const Index H = s.extend_heads.front();
      const std::string name = std::string("bdec_prefill_pair") + lb::key("kind", prefill_kind_key(k)) +
                               lb::key("decay", prefill_decay_key(k)) + lb::key("dtype", "f32") +
                               lb::key("H", H) + lb::key("D", D) + lb::key("thr", 1);
      auto* b = benchmark::RegisterBenchmark(
          name.c_str(), [k, H, D](benchmark::State& st) { BM_prefill_pair(st, k, H, D); });
      b->ArgName("N")->UseManualTime()->Unit(benchmark::kMicrosecond)->Iterations(2 * s.pair_iterations);
      for (Index n : s.tokens) b->Arg(int64_t(n));
    }
#else
  (void)p;
#endif
}

std::string notes(const lb::Profile& p) {
  const DecodeSizes s = decode_sizes(p);
#if LINATTN_BENCH_BDEC
  return "Batched decoders (float, D = M = " + lb::join(s.dims) +
         ", BatchedRecurrentDeltaRule<L2Normalize<>> with a scalar or per-channel (KDA) decay, "
         "BatchedRecurrentGatedAttention<Identity> with a scalar decay): one step of B = " +
         lb::join(s.batches) + " sequences x H = " + lb::join(s.heads) +
         " heads on 1 and 2 threads; extend of T = " + lb::join(s.tokens) +
         " tokens of S = " + lb::join(s.seqs) + " sequences (H = " + lb::join(s.extend_heads) +
         ") against T steps and with keep_snapshots(8), " + std::to_string(s.pair_iterations) +
         " iterations, each call repeated to cover " + std::to_string(s.pair_rows) +
         " tokens; the delta-rule step with float against bf16 states (B = " +
         lb::join(s.state_batches) +
         "), alternately; multi-head prefill calls with carried states of N = " + lb::join(s.tokens) +
         " rows (D = M = " + lb::join(s.prefill_dims) +
         ", one thread) against N decoder steps; FMA peak and read+write bandwidth measured in "
         "the process.";
#else
  (void)s;
  return "not measured: this build has no batched delta-rule / gated decoders.";
#endif
}

#if LINATTN_BENCH_BDEC
// --drift (see the file comment): kind 0 delta rule (scalar decay), 1 KDA, 2 gated.
template <class StateT>
double drift(int kind, Index tokens) {
  constexpr Index D = 128;
  const Kind k = kind == 0 ? Kind::DeltaScalar : kind == 1 ? Kind::DeltaChannel : Kind::GatedScalar;
  linattn::DeltaOptions o;
  o.scale = 1.0 / std::sqrt(double(D));
  linattn::GatedOptions og;
  og.scale = o.scale;
  linattn::BatchedRecurrentDeltaRule<linattn::L2Normalize<>, float, StateT> low(
      1, 1, D, D, linattn::L2Normalize<>(1e-6), o);
  DeltaDec full(1, 1, D, D, linattn::L2Normalize<>(1e-6), o);
  linattn::BatchedRecurrentGatedAttention<linattn::Identity, float, StateT> glow(
      1, 1, D, D, linattn::Identity{}, og);
  GatedDec gfull(1, 1, D, D, linattn::Identity{}, og);
  double num = 0, den = 0;
  constexpr Index kBlock = 256;  // tokens drawn at a time
  for (Index t0 = 0; t0 < tokens; t0 += kBlock) {
    const Index n = std::min(kBlock, tokens - t0);
    Tokens tok(n, 1, D, k, 900 + std::uint64_t(t0));
    Mat<float> a(1, D), b(1, D);
    for (Index t = 0; t < n; ++t) {
      if (kind == 2) {
        glow.step(tok.q.row(t), tok.k.row(t), tok.v.row(t), tok.g.row(t), a);
        gfull.step(tok.q.row(t), tok.k.row(t), tok.v.row(t), tok.g.row(t), b);
      } else {
        low.step(tok.q.row(t), tok.k.row(t), tok.v.row(t), tok.beta.row(t), tok.g.row(t), a);
        full.step(tok.q.row(t), tok.k.row(t), tok.v.row(t), tok.beta.row(t), tok.g.row(t), b);
      }
      if (t0 + t >= tokens - tokens / 10) {
        num += double((a - b).squaredNorm());
        den += double(b.squaredNorm());
      }
    }
  }
  return std::sqrt(num / den);
}

void print_drift() {
  std::printf(
      "| tokens | delta bf16 | delta half | KDA bf16 | KDA half | gated bf16 | gated half |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|\n");
  for (Index n : {Index(100), Index(1000), Index(10000)})
    std::printf("| %lld | %.2g | %.2g | %.2g | %.2g | %.2g | %.2g |\n", static_cast<long long>(n),
                drift<Eigen::bfloat16>(0, n), drift<Eigen::half>(0, n),
                drift<Eigen::bfloat16>(1, n), drift<Eigen::half>(1, n),
                drift<Eigen::bfloat16>(2, n), drift<Eigen::half>(2, n));
}
#endif

}  // namespace

int main(int argc, char** argv) {
#if LINATTN_BENCH_BDEC
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--drift") {
      print_drift();
      return 0;
    }
#endif
  return lb::run_main(argc, argv, register_all, notes);
}
