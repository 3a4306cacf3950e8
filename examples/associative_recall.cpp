// Why DeltaNet: associative recall with overwrites, learned by plain linear attention and by
// the delta rule, with linattn's kernels and gradients.
//
// A sequence writes (key, value) pairs, then queries keys; the answer to a query is the value
// written LAST under its key. Keys repeat: a sequence uses 16 of 32 keys and writes 48 pairs,
// so most keys are written 2 to 5 times. And the pairs do not fit an additive memory: 48
// writes into a 16-dimensional key space, where the 32 keys cannot all be orthogonal. One
// token holds one pair, the key's and the value's one-hot codes side by side (in separate
// tokens, as Zoology's MQAR has them, a second layer or a short convolution would have to pair
// them first); a query token is the key's code and a query flag. The model, one attention
// layer between learned projections:
//
//   q_t = x_t W_q,  k_t = x_t W_k,  v_t = x_t W_v       (x_t: one token's input)
//   φ = L2Normalize<>: unit q̂ and k̂, as DeltaNet       (scale 1: q̂ᵀk̂ = 1 on a match)
//   plain:  S_t = S_{t-1} + k̂_t v_tᵀ                   gated_linear_attention, log gates 0,
//                                                       normalize = false
//   delta:  S_t = (I − β_t k̂_t k̂_tᵀ) S_{t-1} + β_t k̂_t v_tᵀ,  β_t = σ(x_t w_β + b_β)
//                                                       delta_rule_attention, no decay
//   out_t = φ(q_t)ᵀ S_t,  logits_t = out_t W_o + b_o   (over the values, at the queries)
//
// The baseline is the unnormalised sum of outer products (the gated kernel with log gates 0 and
// normalize = false), not causal_linear_attention(), which divides by φ(q)ᵀΣφ(k): so the two
// models share the map, the scale, the projections and the readout, and differ only in the
// update (the delta rule's erase term −β k̂ k̂ᵀ S and its write strength β). With unit keys the
// normalised form's denominator could also cancel (L2Normalize's features have both signs).
// Plain linear attention can only add: a key written r times reads back the sum of its r
// values, and nothing in the input tells which came last (a write strength would not help: it
// sees a token, not its position), so it answers the keys written once and guesses among the
// values of the others. The delta rule replaces: a write moves the value stored under k̂
// (k̂ᵀS) toward v by the fraction β, so the last value weighs most.
//
// Training: cross-entropy at the query tokens; every gradient is the library's (dQ, dK, dV and
// dβ from delta_rule_attention_backward() and gated_linear_attention_backward(), through
// L2Normalize) chained by hand into W_q, W_k, W_v, w_β, b_β, W_o, b_o; Adam, written out below;
// double; both models start from the same parameters and see the same batches. First, the
// chained gradients of both models are checked against central differences of the loss, every
// entry of every parameter (small sizes).
//
//   associative_recall           the gradient check, then 2000 training steps of 32 sequences
//                                (about 30 s on one core at -O2), the loss curves, and the
//                                recall accuracy on 2000 held-out sequences, split by how often
//                                the queried key was written; fails (exit code 1) if the check
//                                fails or the delta rule does not beat plain linear attention
//                                by the margin set in main() (40 points)
//   associative_recall --smoke   small sizes: the gradient check, and 300 training steps whose
//                                loss must fall for both models (ctest)
//   associative_recall --steps N N training steps
#include <linattn/linattn.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

namespace {

using Eigen::Index;
using Mat = Eigen::MatrixXd;
using Vec = Eigen::VectorXd;
using Phi = linattn::L2Normalize<>;  // unit q̂ and k̂ (DeltaNet's normalisation, no SiLU)

// The sizes of a run.
struct Task {
  int keys, values;  // vocabulary sizes
  int distinct;      // keys used per sequence (a random subset), each written at least once
  int writes;        // write tokens per sequence
  int queries;       // query tokens per sequence: distinct keys of the subset
  Index D, M;        // key and value dimensions (the state is D x M)
  int input_dim() const { return keys + values + 1; }  // key code, value code, query flag
  int length() const { return writes + queries; }
};

struct Sequence {
  Mat X;                             // N x input_dim, one token a row
  std::vector<int> target;           // per query: the value last written under its key
  std::vector<int> times_written;    // per query: how often its key was written
};

Sequence make_sequence(const Task& task, std::mt19937& gen) {
  std::vector<int> used(std::size_t(task.keys));
  std::iota(used.begin(), used.end(), 0);
  std::shuffle(used.begin(), used.end(), gen);
  used.resize(std::size_t(task.distinct));
  // Every used key once, the other writes uniform among them, in a random order.
  std::vector<int> write_keys = used;
  std::uniform_int_distribution<int> pick(0, task.distinct - 1), value(0, task.values - 1);
  while (int(write_keys.size()) < task.writes) write_keys.push_back(used[std::size_t(pick(gen))]);
  std::shuffle(write_keys.begin(), write_keys.end(), gen);

  Sequence s;
  s.X = Mat::Zero(task.length(), task.input_dim());
  std::vector<int> last(std::size_t(task.keys), -1), count(std::size_t(task.keys), 0);
  for (int t = 0; t < task.writes; ++t) {
    const int k = write_keys[std::size_t(t)], v = value(gen);
    s.X(t, k) = 1;
    s.X(t, task.keys + v) = 1;
    last[std::size_t(k)] = v;
    ++count[std::size_t(k)];
  }
  std::shuffle(used.begin(), used.end(), gen);
  for (int j = 0; j < task.queries; ++j) {
    const int k = used[std::size_t(j)], t = task.writes + j;
    s.X(t, k) = 1;
    s.X(t, task.keys + task.values) = 1;  // the query flag
    s.target.push_back(last[std::size_t(k)]);
    s.times_written.push_back(count[std::size_t(k)]);
  }
  return s;
}

// The parameters of one model (also used, zeroed, for their gradients).
struct Params {
  Mat Wq, Wk, Wv, Wo;  // input x D, input x D, input x M, M x values
  Vec w_beta, b_beta, b_o;  // input, 1, values (w_β and b_β unused by plain linear attention)

  Params(const Task& task, std::mt19937& gen) {
    const auto randn = [&](Index r, Index c, double sd) {
      std::normal_distribution<double> g(0.0, sd);
      Mat W(r, c);
      for (Index i = 0; i < W.size(); ++i) W.data()[i] = g(gen);
      return W;
    };
    const Index in = task.input_dim();
    Wq = randn(in, task.D, 1.0);  // q and k are normalised: their scale does not matter
    Wk = randn(in, task.D, 1.0);
    Wv = randn(in, task.M, 1.0);
    Wo = randn(task.M, task.values, 1.0 / std::sqrt(double(task.M)));
    w_beta = Vec::Zero(in);  // β = σ(0) = 0.5 for every token at the start
    b_beta = Vec::Zero(1);
    b_o = Vec::Zero(task.values);
  }
  void zero() {
    each([](double* p, Index n) { std::fill(p, p + n, 0.0); });
  }
  template <class F>
  void each(F&& f) {
    for (Mat* W : {&Wq, &Wk, &Wv, &Wo}) f(W->data(), W->size());
    for (Vec* v : {&w_beta, &b_beta, &b_o}) f(v->data(), v->size());
  }
};

enum class Memory { Linear, Delta };

double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

struct Result {
  double loss = 0;  // summed over the queries
  int correct = 0, count = 0;
  int correct_by_writes[4] = {}, count_by_writes[4] = {};  // written 1, 2, 3, ≥ 4 times
  void add(const Result& r) {
    loss += r.loss;
    correct += r.correct;
    count += r.count;
    for (int b = 0; b < 4; ++b) {
      correct_by_writes[b] += r.correct_by_writes[b];
      count_by_writes[b] += r.count_by_writes[b];
    }
  }
};

// A model: its parameters, and the buffers of its kernel calls, kept from one sequence to the
// next. The out-parameter forms of the kernels with a Workspace allocate nothing once the
// shapes are set; the value-returning forms build a workspace per call, whose large blocks
// the C library hands back to the system and asks for again every time (with them, half of
// this program's run time went to brk()).
struct Model {
  Memory memory;
  Params p;
  linattn::Workspace<double> ws;
  linattn::LinearAttentionState<double> state;  // the forward's, zeroed per sequence
  const linattn::LinearAttentionState<double> zero_state{};  // the backward's initial state
  linattn::StateGradient<double> no_final, d_initial;
  Mat Q, K, V, out, dOut, dQ, dK, dV, dgates;
  Vec beta, dbeta, gates;
  const Vec no_decay{};  // size 0: DeltaNet, a_t = 1
  linattn::GatedOptions linear_opts;       // log gates 0, normalize = false, scale = 1
  const linattn::DeltaOptions delta_opts;  // scale = 1

  Model(Memory m, const Params& params) : memory(m), p(params) {}

  // The attention's output for Q, K, V (and β): out.
  void attend() {
    const Index N = Q.rows();
    out.resize(N, V.cols());
    state.reset();
    if (memory == Memory::Delta) {
      linattn::delta_rule_attention(Q, K, V, beta, no_decay, Phi{}, state, out, ws, delta_opts);
    } else {
      gates.setZero(N);
      linattn::gated_linear_attention(Q, K, V, gates, Phi{}, state, out, ws, linear_opts);
    }
  }
  // dQ, dK, dV (and dβ) for dOut.
  void attend_backward() {
    const Index N = Q.rows();
    dQ.resize(N, Q.cols());
    dK.resize(N, K.cols());
    dV.resize(N, V.cols());
    if (memory == Memory::Delta) {
      dbeta.resize(N);
      Vec dlog_a;  // no decay: no gradient
      linattn::delta_rule_attention_backward(Q, K, V, beta, no_decay, dOut, Phi{}, zero_state,
                                             no_final, dQ, dK, dV, dbeta, dlog_a, d_initial, ws,
                                             delta_opts);
    } else {
      dgates.resize(N, 1);  // ∂L/∂log gates: computed, not used (the gates stay 0)
      linattn::gated_linear_attention_backward(Q, K, V, gates, dOut, Phi{}, zero_state,
                                               no_final, dQ, dK, dV, dgates, d_initial, ws,
                                               linear_opts);
    }
  }
};

// Forward pass of one sequence, its cross-entropy at the queries and the number of correct
// answers; with `grads`, the gradient of weight · (summed cross-entropy) added into it.
Result run(Model& m, const Sequence& s, Params* grads, double weight) {
  const Params& p = m.p;
  const Mat& X = s.X;
  const Index N = X.rows(), nq = Index(s.target.size());
  m.Q.noalias() = X * p.Wq;
  m.K.noalias() = X * p.Wk;
  m.V.noalias() = X * p.Wv;
  if (m.memory == Memory::Delta)
    m.beta = ((X * p.w_beta).array() + p.b_beta(0)).unaryExpr(&sigmoid);
  m.attend();
  const auto read = m.out.bottomRows(nq);  // the loss reads the query tokens only
  const Mat logits = (read * p.Wo).rowwise() + p.b_o.transpose();

  Result r;
  Mat dlogits(nq, logits.cols());
  for (Index j = 0; j < nq; ++j) {
    const int target = s.target[std::size_t(j)];
    const double top = logits.row(j).maxCoeff();
    const Eigen::RowVectorXd e = (logits.row(j).array() - top).exp();
    const double total = e.sum();
    r.loss += std::log(total) - (logits(j, target) - top);
    Index best;
    logits.row(j).maxCoeff(&best);
    const int bucket = std::min(s.times_written[std::size_t(j)], 4) - 1;
    r.correct += int(best == target);
    r.correct_by_writes[bucket] += int(best == target);
    ++r.count_by_writes[bucket];
    ++r.count;
    dlogits.row(j) = e / total;
    dlogits(j, target) -= 1.0;
  }
  if (!grads) return r;

  dlogits *= weight;
  grads->Wo.noalias() += read.transpose() * dlogits;
  grads->b_o += dlogits.colwise().sum().transpose();
  m.dOut.setZero(N, m.out.cols());
  m.dOut.bottomRows(nq).noalias() = dlogits * p.Wo.transpose();
  m.attend_backward();
  if (m.memory == Memory::Delta) {
    // β = σ(z): dz = dβ · β(1 − β).
    const Vec dz = m.dbeta.cwiseProduct((m.beta.array() * (1.0 - m.beta.array())).matrix());
    grads->w_beta.noalias() += X.transpose() * dz;
    grads->b_beta(0) += dz.sum();
  }
  // Q = X W_q: dW_q = Xᵀ dQ (and so for K and V).
  grads->Wq.noalias() += X.transpose() * m.dQ;
  grads->Wk.noalias() += X.transpose() * m.dK;
  grads->Wv.noalias() += X.transpose() * m.dV;
  return r;
}

// The mean cross-entropy over a batch, and (with grads) its gradient.
double batch_loss(Model& m, const std::vector<Sequence>& batch, Params* grads,
                  Result* total = nullptr) {
  int queries = 0;
  for (const Sequence& s : batch) queries += int(s.target.size());
  if (grads) grads->zero();
  double loss = 0;
  for (const Sequence& s : batch) {
    const Result r = run(m, s, grads, 1.0 / queries);
    loss += r.loss;
    if (total) total->add(r);
  }
  return loss / queries;
}

// Every entry of every parameter: |analytic − central difference|, the worst over a parameter
// matrix divided by its largest analytic entry (as gradient_check.cpp), the worst of those.
double gradient_error(Memory memory, const Task& task, unsigned seed) {
  std::mt19937 gen(seed);
  Model m(memory, Params(task, gen));
  Params grads = m.p;
  if (memory == Memory::Delta) {  // β away from 0.5 and different per token
    std::normal_distribution<double> g(0.0, 1.0);
    for (Index i = 0; i < m.p.w_beta.size(); ++i) m.p.w_beta(i) = g(gen);
    m.p.b_beta(0) = 0.3;
  }
  std::vector<Sequence> batch;
  for (int b = 0; b < 4; ++b) batch.push_back(make_sequence(task, gen));
  batch_loss(m, batch, &grads);
  std::vector<std::pair<double*, Index>> params, analytic;
  m.p.each([&](double* d, Index n) { params.emplace_back(d, n); });
  grads.each([&](double* d, Index n) { analytic.emplace_back(d, n); });
  const double h = 1e-5;
  double worst = 0;
  for (std::size_t j = 0; j < params.size(); ++j) {
    const Index n = params[j].second;
    double* x = params[j].first;
    const double* a = analytic[j].first;
    if (memory == Memory::Linear && (x == m.p.w_beta.data() || x == m.p.b_beta.data()))
      continue;  // plain linear attention does not read w_β and b_β
    double scale = 0, err = 0;
    for (Index e = 0; e < n; ++e) scale = std::max(scale, std::abs(a[e]));
    for (Index e = 0; e < n; ++e) {
      const double x0 = x[e];
      x[e] = x0 + h;
      const double up = batch_loss(m, batch, nullptr);
      x[e] = x0 - h;
      const double down = batch_loss(m, batch, nullptr);
      x[e] = x0;
      err = std::max(err, std::abs(a[e] - (up - down) / (2 * h)));
    }
    worst = std::max(worst, scale > 0 ? err / scale : HUGE_VAL);  // all 0: something is lost
  }
  return worst;
}

// Adam (Kingma & Ba), one moment pair per parameter entry.
struct Adam {
  double lr, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  std::vector<double> m, v;
  int t = 0;
  explicit Adam(double rate) : lr(rate) {}
  void step(Params& params, Params& grads) {
    std::vector<std::pair<double*, Index>> p, g;
    params.each([&](double* d, Index n) { p.emplace_back(d, n); });
    grads.each([&](double* d, Index n) { g.emplace_back(d, n); });
    Index total = 0;
    for (const auto& x : p) total += x.second;
    if (m.empty()) {
      m.assign(std::size_t(total), 0.0);
      v.assign(std::size_t(total), 0.0);
    }
    ++t;
    const double c1 = 1 - std::pow(beta1, t), c2 = 1 - std::pow(beta2, t);
    std::size_t k = 0;
    for (std::size_t j = 0; j < p.size(); ++j)
      for (Index e = 0; e < p[j].second; ++e, ++k) {
        const double gr = g[j].first[e];
        m[k] = beta1 * m[k] + (1 - beta1) * gr;
        v[k] = beta2 * v[k] + (1 - beta2) * gr * gr;
        p[j].first[e] -= lr * (m[k] / c1) / (std::sqrt(v[k] / c2) + eps);
      }
  }
};

double percent(int a, int b) { return b ? 100.0 * a / b : 0.0; }

}  // namespace

int main(int argc, char** argv) {
  bool smoke = false;
  int steps_arg = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--smoke") == 0) smoke = true;
    if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) steps_arg = std::atoi(argv[++i]);
  }
  // The full task: 32 keys in a 16-dimensional key space (they cannot all be orthogonal), 16
  // of them used per sequence, 48 writes. The small one (the gradient check always, the whole
  // run with --smoke): 8 keys, 4 used, 10 writes, D = M = 8.
  const Task full{32, 32, 16, 48, 16, 16, 32}, small{8, 8, 4, 10, 4, 8, 8};
  const Task task = smoke ? small : full;

  // 1. The chained gradients against central differences (h = 1e-5, double). Measured (g++ 12,
  // x86-64): 1.7e-10 (plain) and 4.8e-10 (delta rule), the truncation error of the central
  // difference; the bound is 6 times the larger. A wrong term gives errors near 1.
  const double grad_bound = 3e-9;
  bool ok = true;
  for (const Memory memory : {Memory::Linear, Memory::Delta}) {
    const double err = gradient_error(memory, small, memory == Memory::Delta ? 12 : 11);
    const bool good = std::isfinite(err) && err <= grad_bound;
    std::printf("gradient check, %-22s: max |analytic - central difference| / max |analytic| "
                "= %.1e (bound %.0e)%s\n",
                memory == Memory::Delta ? "delta rule" : "plain linear attention", err,
                grad_bound, good ? "" : "  <-- FAILED");
    ok &= good;
  }

  // 2. Train both models on the same batches, from the same parameters.
  const int steps = steps_arg > 0 ? steps_arg : smoke ? 300 : 2000;
  const int batch_size = smoke ? 8 : 32, report_every = smoke ? 50 : 100;
  std::printf("associative recall: %d keys, %d values, %d keys used per sequence, %d writes, %d "
              "queries; D = %ld, M = %ld; %d steps of %d sequences, Adam, double\n",
              task.keys, task.values, task.distinct, task.writes, task.queries, long(task.D),
              long(task.M), steps, batch_size);
  std::mt19937 init_gen(1), train_gen(2);
  Model linear(Memory::Linear, Params(task, init_gen));
  Model delta(Memory::Delta, linear.p);  // the same start (w_β and b_β: the delta rule only)
  Params grads = linear.p;
  const double lr = 3e-2;  // from 1e-2, 2e-2, 3e-2: the fastest start (the small task plateaus)
  Adam adam_linear(lr), adam_delta(lr);
  std::printf("%6s  %10s %8s  %10s %8s   (means over the previous %d steps)\n", "step",
              "plain loss", "acc.", "delta loss", "acc.", report_every);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<double> losses[2];  // per step
  double window[2] = {0, 0};
  Result acc[2];
  for (int step = 1; step <= steps; ++step) {
    std::vector<Sequence> batch;
    for (int b = 0; b < batch_size; ++b) batch.push_back(make_sequence(task, train_gen));
    // The learning rate falls linearly to a tenth over the run.
    adam_linear.lr = adam_delta.lr = lr * (1.0 - 0.9 * double(step - 1) / std::max(1, steps - 1));
    const double l0 = batch_loss(linear, batch, &grads, &acc[0]);
    adam_linear.step(linear.p, grads);
    const double l1 = batch_loss(delta, batch, &grads, &acc[1]);
    adam_delta.step(delta.p, grads);
    losses[0].push_back(l0);
    losses[1].push_back(l1);
    window[0] += l0;
    window[1] += l1;
    if (step % report_every == 0) {
      std::printf("%6d  %10.4f %7.1f%%  %10.4f %7.1f%%\n", step, window[0] / report_every,
                  percent(acc[0].correct, acc[0].count), window[1] / report_every,
                  percent(acc[1].correct, acc[1].count));
      window[0] = window[1] = 0;
      acc[0] = acc[1] = Result{};
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("trained %d steps in %.1f s\n", steps, seconds);

  if (smoke) {
    // The first step's loss against the mean of the last 50: both must fall by a tenth (the
    // delta rule starts near chance, log 8 = 2.08; measured 2.12 -> 1.20, plain 3.02 -> 1.87).
    for (int m = 0; m < 2; ++m) {
      const std::size_t n = std::min<std::size_t>(50, losses[m].size());
      const double first = losses[m].front(),
                   last = std::accumulate(losses[m].end() - long(n), losses[m].end(), 0.0) / n;
      const bool fell = last < 0.9 * first;
      std::printf("%s: loss %.4f -> %.4f: %s\n", m ? "delta rule" : "plain linear attention",
                  first, last, fell ? "falls" : "DOES NOT FALL");
      ok &= fell;
    }
    std::printf(ok ? "checks passed\n" : "CHECK FAILED\n");
    return ok ? 0 : 1;
  }

  // 3. Held-out sequences (another seed).
  std::mt19937 test_gen(3);
  std::vector<Sequence> test;
  for (int k = 0; k < 2000; ++k) test.push_back(make_sequence(task, test_gen));
  Result held[2];
  batch_loss(linear, test, nullptr, &held[0]);
  batch_loss(delta, test, nullptr, &held[1]);
  std::printf("held-out recall accuracy (%d sequences, %d queries), by how often the queried key "
              "was written:\n", int(test.size()), held[0].count);
  std::printf("%24s %8s %8s %8s %8s %8s\n", "", "all", "1x", "2x", "3x", ">=4x");
  std::printf("%24s %8s", "share of the queries", "");
  for (int b = 0; b < 4; ++b)
    std::printf(" %7.1f%%", percent(held[0].count_by_writes[b], held[0].count));
  std::printf("\n");
  for (int m = 0; m < 2; ++m) {
    std::printf("%24s %7.1f%%", m ? "delta rule" : "plain linear attention",
                percent(held[m].correct, held[m].count));
    for (int b = 0; b < 4; ++b)
      std::printf(" %7.1f%%", percent(held[m].correct_by_writes[b], held[m].count_by_writes[b]));
    std::printf("\n");
  }
  // The learned write strengths, at the pairs and at the queries (a query token passes through
  // the update too, with its own v). Printed, not checked.
  double beta_write = 0, beta_query = 0, beta_write_min = 1, beta_query_max = 0;
  for (const Sequence& s : test) {
    const Vec beta = ((s.X * delta.p.w_beta).array() + delta.p.b_beta(0)).unaryExpr(&sigmoid);
    beta_write += beta.head(task.writes).sum();
    beta_query += beta.tail(task.queries).sum();
    beta_write_min = std::min(beta_write_min, beta.head(task.writes).minCoeff());
    beta_query_max = std::max(beta_query_max, beta.tail(task.queries).maxCoeff());
  }
  std::printf("learned beta: at the writes mean %.3f (min %.3f), at the queries mean %.2e (max "
              "%.2e)\n", beta_write / (double(test.size()) * task.writes), beta_write_min,
              beta_query / (double(test.size()) * task.queries), beta_query_max);

  // Plain linear attention reads the sum of a key's values and cannot tell which came last: the
  // best answer from that sum (the most frequent of the values, ties split) is right for 45.7%
  // of this task's queries (simulated). Measured: 44.9%, against 98.6% for the delta rule (g++
  // 12, x86-64). The required margin, 40 points, leaves room for another compiler's rounding to
  // change the training run, and fails if the delta rule stops learning to replace.
  const double acc_linear = double(held[0].correct) / held[0].count;
  const double acc_delta = double(held[1].correct) / held[1].count;
  const double margin = 0.40;
  const bool wins = acc_delta >= acc_linear + margin;
  std::printf("delta rule - plain linear attention = %.1f points (required: >= %.0f)%s\n",
              100 * (acc_delta - acc_linear), 100 * margin, wins ? "" : "  <-- FAILED");
  ok &= wins;
  std::printf(ok ? "checks passed\n" : "CHECK FAILED\n");
  return ok ? 0 : 1;
}
