// Image generation as in "Transformers are RNNs" (Katharopoulos et al. 2020, §4.2): a
// decoder-only transformer with random weights generates whole images, one pixel (token) at a
// time, each sampled from a 256-way softmax.
//
//   model:img784   784 tokens (28×28, as MNIST), 8 layers
//   model:img3072  3072 tokens (32×32×3, as CIFAR-10), 16 layers
//   (model:tiny    64 tokens, 2 layers: the smoke profile only)
//
// Every model: d_model 256, 8 heads, feed-forward 1024 (ReLU), pre-norm residual blocks, learned
// (here random) token and position embeddings, a final norm and a 256-way output head. Float, one
// thread. Three ways to attend:
//
//   attn:linear   LinearAttentionLayer<EluPlusOne>: the recurrent state of every layer;
//   attn:kv       SoftmaxAttentionLayer with a KV cache per layer;
//   attn:softmax  softmax recomputing the prefix at every step (the paper's plain softmax, which
//                 has no cache): the step at position p runs the causal forward of all p tokens.
//
// Benchmarks (B sequences generated side by side; batch:1 and batch:8):
//
//   gen_step/model:M/attn:A/batch:B/pos:P   one step of B sequences at position P: for linear
//       and kv, the mean of 16 consecutive steps from a state prefilled with P − 1 tokens (pos:
//       P to P + 15); for softmax, the causal forward of P tokens per sequence.
//   gen_seq/model:M/attn:A/batch:B          whole images generated from a start token, end to
//       end (linear and kv; softmax recomputation would take hours at 3072 tokens).
//
// report.py integrates gen_step over positions 1..N (Simpson's rule over the measured positions,
// which are equally spaced from N/8 or N/2 on) into seconds per image, compares with gen_seq where both ran, and prints the ratios next to
// the paper's (317× at 784 tokens and 4462× at 3072, linear vs softmax, on a GPU). Counters:
// state_bytes, what one sequence keeps between steps at position P (linear: every layer's
// state; kv: the caches; softmax: the tokens), and step_bytes, the largest buffers a step
// allocates on top of it (activations, computed from their shapes, not measured).
#include <linattn/linattn.hpp>

#include "bench_common.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace lb = linattn_bench;
using lb::Index;

namespace {

using MatrixXf = Eigen::MatrixXf;
using VectorXf = Eigen::VectorXf;

constexpr Index kModel = 256, kHeads = 8, kFF = 1024, kVocab = 256;
constexpr Index kStepsPerIteration = 16;

struct ModelShape {
  const char* name;
  Index tokens, layers;
};
constexpr ModelShape kImg784{"img784", 784, 8};
constexpr ModelShape kImg3072{"img3072", 3072, 16};
constexpr ModelShape kTiny{"tiny", 64, 2};

enum class Attn { Linear, Kv, Softmax };
const char* attn_name(Attn a) {
  return a == Attn::Linear ? "linear" : a == Attn::Kv ? "kv" : "softmax";
}

using LinearLayer = linattn::LinearAttentionLayer<linattn::EluPlusOne, float>;
using SoftmaxLayer = linattn::SoftmaxAttentionLayer<float>;

// Row-wise layer normalisation without learned scale and shift (random weights have none).
template <class X>
void layer_norm(X&& x) {
  for (Index i = 0; i < x.rows(); ++i) {
    auto r = x.row(i);
    r.array() -= r.mean();
    r /= std::sqrt(r.squaredNorm() / float(r.size()) + 1e-5f);
  }
}

MatrixXf random_weights(Index rows, Index cols, std::mt19937& gen) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const float scale = 1.0f / std::sqrt(float(cols));
  MatrixXf W(rows, cols);
  for (Index j = 0; j < cols; ++j)
    for (Index i = 0; i < rows; ++i) W(i, j) = scale * u(gen);
  return W;
}

// The decoder. Layer: LinearAttentionLayer or SoftmaxAttentionLayer (one interface).
template <class Layer>
struct Decoder {
  using State = decltype(std::declval<const Layer&>().make_state());
  ModelShape shape;
  MatrixXf embed, position, head;  // vocab × d, tokens × d, vocab × d
  std::vector<Layer> attention;
  std::vector<MatrixXf> ff_in, ff_out;  // kFF × d, d × kFF (out × in)
  std::vector<VectorXf> ff_in_bias, ff_out_bias;

  Decoder(const ModelShape& s, unsigned seed) : shape(s) {
    std::mt19937 gen(seed);
    embed = random_weights(kVocab, kModel, gen) * std::sqrt(float(kModel));
    position = random_weights(s.tokens + kStepsPerIteration, kModel, gen);
    head = random_weights(kVocab, kModel, gen);
    for (Index l = 0; l < s.layers; ++l) {
      Layer layer(kModel, kHeads);
      layer.Wq = random_weights(kModel, kModel, gen);
      layer.Wk = random_weights(kModel, kModel, gen);
      layer.Wv = random_weights(kModel, kModel, gen);
      layer.Wo = random_weights(kModel, kModel, gen);
      attention.push_back(std::move(layer));
      ff_in.push_back(random_weights(kFF, kModel, gen));
      ff_out.push_back(random_weights(kModel, kFF, gen));
      ff_in_bias.push_back(VectorXf::Zero(kFF));
      ff_out_bias.push_back(VectorXf::Zero(kModel));
    }
  }

  // x += FF(norm(x)) for the rows of x (B × d): one product over the B sequences.
  void feed_forward(Index l, MatrixXf& x, MatrixXf& xn, MatrixXf& hidden) const {
    xn = x;
    layer_norm(xn);
    hidden.noalias() = xn * ff_in[std::size_t(l)].transpose();
    hidden.rowwise() += ff_in_bias[std::size_t(l)].transpose();
    hidden = hidden.cwiseMax(0.0f);
    x.noalias() += hidden * ff_out[std::size_t(l)].transpose();
    x.rowwise() += ff_out_bias[std::size_t(l)].transpose();
  }

  // Input rows of tokens at positions p0, p0 + 1, ...
  MatrixXf embed_tokens(const std::vector<int>& tokens, Index p0) const {
    MatrixXf X(Index(tokens.size()), kModel);
    for (Index i = 0; i < X.rows(); ++i)
      X.row(i) = embed.row(tokens[std::size_t(i)]) + position.row(p0 + i);
    return X;
  }

  // Causal forward of one sequence's tokens, continuing `states` (one per layer) when given,
  // else the whole prefix from scratch (SoftmaxLayer::forward(X, true)). Returns the logits of
  // the last row.
  VectorXf forward(const std::vector<int>& tokens, std::vector<State>* states) const {
    MatrixXf X = embed_tokens(tokens, 0), Xn, hidden;
    for (Index l = 0; l < shape.layers; ++l) {
      Xn = X;
      layer_norm(Xn);
      if (states)
        X += attention[std::size_t(l)].forward(Xn, (*states)[std::size_t(l)]);
      else
        X += attention[std::size_t(l)].forward(Xn, true);
      feed_forward(l, X, Xn, hidden);
    }
    MatrixXf last = X.bottomRows(1);
    layer_norm(last);
    return head * last.transpose();
  }

  // Buffers of a batched step (allocated once).
  struct StepBuffers {
    MatrixXf x, xn, y, hidden, logits;
    explicit StepBuffers(Index B)
        : x(B, kModel), xn(B, kModel), y(B, kModel), hidden(B, kFF), logits(B, kVocab) {}
  };

  // One step of B sequences: token[b] at position p of sequence b; states[l][b]. Leaves the
  // logits in buf.logits (B × vocab).
  void step(const std::vector<int>& token, Index p, std::vector<std::vector<State>>& states,
            StepBuffers& buf) const {
    const Index B = Index(token.size());
    for (Index b = 0; b < B; ++b) buf.x.row(b) = embed.row(token[std::size_t(b)]) + position.row(p);
    for (Index l = 0; l < shape.layers; ++l) {
      buf.xn = buf.x;
      layer_norm(buf.xn);
      for (Index b = 0; b < B; ++b)
        attention[std::size_t(l)].step(buf.xn.row(b), states[std::size_t(l)][std::size_t(b)],
                                       buf.y.row(b));
      buf.x += buf.y;
      feed_forward(l, buf.x, buf.xn, buf.hidden);
    }
    buf.xn = buf.x;
    layer_norm(buf.xn);
    buf.logits.noalias() = buf.xn * head.transpose();
  }

  std::vector<std::vector<State>> make_states(Index B) const {
    std::vector<std::vector<State>> s(std::size_t(shape.layers));
    for (Index l = 0; l < shape.layers; ++l)
      for (Index b = 0; b < B; ++b) s[std::size_t(l)].push_back(make_one(l));
    return s;
  }

  State make_one(Index l) const {
    if constexpr (std::is_same_v<Layer, SoftmaxLayer>)
      return attention[std::size_t(l)].make_state(shape.tokens + kStepsPerIteration);
    else
      return attention[std::size_t(l)].make_state();
  }
};

int sample(const Eigen::Ref<const Eigen::RowVectorXf>& logits, std::mt19937& gen) {
  const Eigen::RowVectorXf p = (logits.array() - logits.maxCoeff()).exp().matrix();
  std::discrete_distribution<int> pick(p.data(), p.data() + p.size());
  return pick(gen);
}

// A deterministic prefix of P tokens for sequence b (its values do not change the cost).
std::vector<int> prefix(Index P, Index b) {
  std::vector<int> t(static_cast<std::size_t>(P));
  for (Index i = 0; i < P; ++i) t[std::size_t(i)] = int((i * 37 + b * 11) % kVocab);
  return t;
}

template <class Layer>
const Decoder<Layer>& model(const ModelShape& s) {
  // One model per (shape, layer type), built on first use: the same weights in every benchmark.
  static std::vector<std::pair<std::string, Decoder<Layer>>> cache;
  for (const auto& [name, d] : cache)
    if (name == s.name) return d;
  cache.emplace_back(s.name, Decoder<Layer>(s, 1));
  return cache.back().second;
}

// Bytes one sequence keeps between steps at position P, and the largest buffers of one step.
double state_bytes(Attn a, const ModelShape& s, Index P) {
  const double L = double(s.layers), f = sizeof(float);
  const double head_dim = double(kModel / kHeads);
  switch (a) {
    case Attn::Linear:  // H (F × M + F) per layer, F = M = head size
      return L * double(kHeads) * (head_dim * head_dim + head_dim) * f;
    case Attn::Kv:  // keys and values of every token, per layer
      return L * 2.0 * double(P) * double(kModel) * f;
    case Attn::Softmax:  // the tokens
      return double(P) * sizeof(int);
  }
  return 0;
}
double step_bytes(Attn a, Index P, Index B) {
  const double f = sizeof(float);
  if (a != Attn::Softmax)  // x, xn, y, hidden, logits of B rows
    return double(B) * double(4 * kModel + kFF + kVocab) * f;
  // One sequence at a time: X, Xn, the layer's Q, K, V, A and Y (N × d each), the hidden layer.
  return double(P) * double(7 * kModel + kFF) * f;
}

template <class Layer>
void BM_step(benchmark::State& st, const ModelShape& s, Attn a, Index B) {
  const Index P = st.range(0);
  lb::set_threads(1);
  const Decoder<Layer>& m = model<Layer>(s);
  std::mt19937 gen(7);
  if (a == Attn::Softmax) {
    // The paper's plain softmax: no cache; position P recomputes the whole prefix.
    std::vector<std::vector<int>> seqs;
    for (Index b = 0; b < B; ++b) seqs.push_back(prefix(P, b));
    for (auto _ : st) {
      for (Index b = 0; b < B; ++b) {
        const VectorXf logits = m.forward(seqs[std::size_t(b)], nullptr);
        benchmark::DoNotOptimize(sample(logits.transpose(), gen));
      }
    }
  } else {
    auto states = m.make_states(B);
    std::vector<int> token(static_cast<std::size_t>(B));
    for (Index b = 0; b < B; ++b) {  // prefill P − 1 tokens in parallel
      const std::vector<int> t = prefix(P, b);
      if (P > 1) {
        std::vector<typename Decoder<Layer>::State> one;
        for (Index l = 0; l < s.layers; ++l)
          one.push_back(std::move(states[std::size_t(l)][std::size_t(b)]));
        m.forward(std::vector<int>(t.begin(), t.end() - 1), &one);
        for (Index l = 0; l < s.layers; ++l)
          states[std::size_t(l)][std::size_t(b)] = std::move(one[std::size_t(l)]);
      }
      token[std::size_t(b)] = t.back();
    }
    typename Decoder<Layer>::StepBuffers buf(B);
    const auto saved_states = states;
    const auto saved_token = token;
    for (auto _ : st) {
      for (Index k = 0; k < kStepsPerIteration; ++k) {
        m.step(token, P - 1 + k, states, buf);
        for (Index b = 0; b < B; ++b) token[std::size_t(b)] = sample(buf.logits.row(b), gen);
      }
      // Back to the prefilled state (copy assignment: no allocation), so that every iteration
      // times the same positions.
      st.PauseTiming();
      states = saved_states;
      token = saved_token;
      st.ResumeTiming();
    }
    st.counters["steps_per_iteration"] = double(kStepsPerIteration);
  }
  st.counters["batch"] = double(B);
  st.counters["layers"] = double(s.layers);
  st.counters["tokens"] = double(s.tokens);
  st.counters["state_bytes"] = state_bytes(a, s, P);
  st.counters["step_bytes"] = step_bytes(a, P, B);
}

// Whole images: B sequences from a start token (0) to s.tokens tokens, sampling every next one.
// The first token runs as a step too (a prefill of one token is a step).
template <class Layer>
void BM_sequence(benchmark::State& st, const ModelShape& s, Index B) {
  lb::set_threads(1);
  const Decoder<Layer>& m = model<Layer>(s);
  std::mt19937 gen(7);
  typename Decoder<Layer>::StepBuffers buf(B);
  for (auto _ : st) {
    auto states = m.make_states(B);
    std::vector<int> token(std::size_t(B), 0);
    for (Index p = 0; p < s.tokens; ++p) {
      m.step(token, p, states, buf);
      for (Index b = 0; b < B; ++b) token[std::size_t(b)] = sample(buf.logits.row(b), gen);
    }
    benchmark::DoNotOptimize(token.data());
  }
  st.counters["batch"] = double(B);
  st.counters["layers"] = double(s.layers);
  st.counters["tokens"] = double(s.tokens);
}

// Positions where the step is timed: 1, then N/8, N/4, ..., N (the integration's knots).
std::vector<Index> step_positions(const ModelShape& s, bool few) {
  const Index N = s.tokens;
  if (few) return {1, N / 2, N};
  return {1, N / 8, N / 4, 3 * N / 8, N / 2, 5 * N / 8, 3 * N / 4, 7 * N / 8, N};
}

void register_all(const lb::Profile& p) {
  const bool smoke = p.name == "smoke", full = p.name == "full";
  const std::vector<ModelShape> shapes =
      smoke ? std::vector<ModelShape>{kTiny} : std::vector<ModelShape>{kImg784, kImg3072};
  for (const ModelShape& s : shapes) {
    for (const Index B : {Index(1), Index(8)}) {
      for (const Attn a : {Attn::Linear, Attn::Kv, Attn::Softmax}) {
        // Softmax recomputation at 3072 tokens costs seconds to a minute per position: the quick
        // profile times it at three positions (its cost is a quadratic in P, which Simpson's rule
        // over three equally spaced knots integrates exactly; the full profile uses nine).
        const bool few = a == Attn::Softmax && s.tokens > 1000 && !full;
        const std::string name = std::string("gen_step/model:") + s.name + "/attn:" + attn_name(a) +
                                 "/batch:" + std::to_string(B);
        auto* b = benchmark::RegisterBenchmark(
            name.c_str(), [s, a, B](benchmark::State& st) {
              if (a == Attn::Linear)
                BM_step<LinearLayer>(st, s, a, B);
              else
                BM_step<SoftmaxLayer>(st, s, a, B);
            });
        b->ArgName("pos")->UseRealTime()->Unit(benchmark::kMillisecond);
        for (Index pos : step_positions(s, few)) b->Arg(int64_t(pos));
        if (a == Attn::Softmax && !smoke) b->Iterations(1);  // seconds per iteration
      }
      if (s.tokens <= 1000 || full || smoke) {
        for (const Attn a : {Attn::Linear, Attn::Kv}) {
          const std::string name = std::string("gen_seq/model:") + s.name + "/attn:" +
                                   attn_name(a) + "/batch:" + std::to_string(B);
          auto* b = benchmark::RegisterBenchmark(name.c_str(), [s, a, B](benchmark::State& st) {
            if (a == Attn::Linear)
              BM_sequence<LinearLayer>(st, s, B);
            else
              BM_sequence<SoftmaxLayer>(st, s, B);
          });
          b->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(1);
        }
      }
    }
  }
}

std::string notes(const lb::Profile& p) {
  return std::string("Image generation (the paper's section 4.2), d_model 256, 8 heads, FF 1024, "
                     "float, one thread: ") +
         (p.name == "smoke" ? "a 64-token, 2-layer model (smoke)"
                            : "784 tokens x 8 layers and 3072 tokens x 16 layers") +
         "; gen_step times one step at sampled positions (linear and kv: the mean of 16 steps), "
         "gen_seq whole images (report.py integrates gen_step into images per second).";
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
