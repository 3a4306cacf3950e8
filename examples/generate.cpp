// Token-by-token generation with a small decoder built from linattn's attention layers:
// 4 pre-norm blocks (attention + a ReLU feed-forward of 4·d_model), d_model = 256, 8 heads, a
// 256-token vocabulary, random weights (the layers' weight members have torch.nn.Linear's layout,
// so trained PyTorch weights load by assignment). The same network runs twice, with
// LinearAttentionLayer (a recurrent state per head) and with SoftmaxAttentionLayer (a KV cache):
//
//  1. prefill a 64-token prompt in parallel (layer.forward(X, state));
//  2. generate up to 4096 positions (--smoke: 512), sampling each next token, printing
//     tokens per second at growing positions for both;
//  3. check that the linear model's steps gave what its parallel causal forward gives on the
//     whole generated sequence (returns non-zero otherwise).
#include <linattn/linattn.hpp>

#include <Eigen/Core>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using Eigen::Index;
using Eigen::MatrixXf;
using Eigen::VectorXf;

constexpr Index kVocab = 256, kModel = 256, kHeads = 8, kBlocks = 4, kPrompt = 64;

// Row-wise layer normalisation (no learned scale, for brevity).
template <class X>
void layer_norm(X&& x) {
  for (Index i = 0; i < x.rows(); ++i) {
    auto r = x.row(i);
    const float mean = r.mean();
    r.array() -= mean;
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

// One network; Layer is LinearAttentionLayer or SoftmaxAttentionLayer (the same interface).
template <class Layer>
struct Decoder {
  MatrixXf embed, head;  // kVocab x kModel, kVocab x kModel
  std::vector<Layer> attention;
  std::vector<MatrixXf> ff_in, ff_out;  // 4d x d, d x 4d (out x in)

  // The attention part of a block on a whole sequence, continuing `state`.
  using State = decltype(std::declval<Layer>().make_state());

  MatrixXf feed_forward(Index b, const MatrixXf& X) const {
    return (X * ff_in[b].transpose()).cwiseMax(0.0f) * ff_out[b].transpose();
  }

  // Logits of every row of a token sequence, continuing the per-block states.
  MatrixXf forward(const std::vector<int>& tokens, std::vector<State>& states) const {
    MatrixXf X(Index(tokens.size()), kModel);
    for (Index i = 0; i < X.rows(); ++i) X.row(i) = embed.row(tokens[std::size_t(i)]);
    for (Index b = 0; b < kBlocks; ++b) {
      MatrixXf Xn = X;
      layer_norm(Xn);
      X += attention[std::size_t(b)].forward(Xn, states[std::size_t(b)]);
      Xn = X;
      layer_norm(Xn);
      X += feed_forward(b, Xn);
    }
    layer_norm(X);
    return X * head.transpose();
  }

  // Logits after one more token; the attention layers' steps allocate nothing.
  VectorXf step(int token, std::vector<State>& states) const {
    MatrixXf x = embed.row(token);
    MatrixXf xn(1, kModel), y(1, kModel);
    for (Index b = 0; b < kBlocks; ++b) {
      xn = x;
      layer_norm(xn);
      attention[std::size_t(b)].step(xn.row(0), states[std::size_t(b)], y.row(0));
      x += y;
      xn = x;
      layer_norm(xn);
      x += feed_forward(b, xn);
    }
    layer_norm(x);
    return head * x.transpose();
  }
};

template <class Layer, class Make>
Decoder<Layer> make_decoder(unsigned seed, const Make& make_layer) {
  std::mt19937 gen(seed);
  Decoder<Layer> d;
  d.embed = random_weights(kVocab, kModel, gen) * std::sqrt(float(kModel));
  d.head = random_weights(kVocab, kModel, gen);
  for (Index b = 0; b < kBlocks; ++b) {
    Layer layer = make_layer();
    layer.Wq = random_weights(kModel, kModel, gen);
    layer.Wk = random_weights(kModel, kModel, gen);
    layer.Wv = random_weights(kModel, kModel, gen);
    layer.Wo = random_weights(kModel, kModel, gen);
    d.attention.push_back(std::move(layer));
    d.ff_in.push_back(random_weights(4 * kModel, kModel, gen));
    d.ff_out.push_back(random_weights(kModel, 4 * kModel, gen));
  }
  return d;
}

int sample(const VectorXf& logits, std::mt19937& gen) {
  const VectorXf p = (logits.array() - logits.maxCoeff()).exp().matrix();
  std::discrete_distribution<int> pick(p.data(), p.data() + p.size());
  return pick(gen);
}

// Generates from the prompt to `length` tokens; prints tokens/s over windows ending at powers of
// two; returns the tokens.
template <class Layer>
std::vector<int> generate(const Decoder<Layer>& model, const std::vector<int>& prompt, Index length,
                          std::vector<double>& rate_at) {
  std::vector<typename Decoder<Layer>::State> states;
  for (const Layer& a : model.attention) states.push_back(a.make_state());
  std::mt19937 gen(7);
  std::vector<int> tokens = prompt;
  const MatrixXf logits = model.forward(prompt, states);  // the prefill, in parallel
  int next = sample(logits.row(logits.rows() - 1).transpose(), gen);
  Index window = Index(tokens.size());
  auto t0 = Clock::now();
  while (Index(tokens.size()) < length) {
    tokens.push_back(next);
    next = sample(model.step(next, states), gen);
    const Index pos = Index(tokens.size());
    if ((pos & (pos - 1)) == 0 && pos > kPrompt) {  // a power of two: report the window
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      rate_at.push_back(double(pos - window) / s);
      window = pos;
      t0 = Clock::now();
    }
  }
  return tokens;
}

}  // namespace

int main(int argc, char** argv) {
  const bool smoke = argc > 1 && std::strcmp(argv[1], "--smoke") == 0;
  const Index length = smoke ? 512 : 4096;
  using Linear = linattn::LinearAttentionLayer<linattn::EluPlusOne, float>;
  using Softmax = linattn::SoftmaxAttentionLayer<float>;
  // The same weights in both networks: only the attention differs.
  const auto linear = make_decoder<Linear>(1, [] { return Linear(kModel, kHeads); });
  const auto softmax = make_decoder<Softmax>(1, [] { return Softmax(kModel, kHeads); });

  std::vector<int> prompt(kPrompt);
  for (Index i = 0; i < kPrompt; ++i) prompt[std::size_t(i)] = int((i * 37) % kVocab);

  std::vector<double> linear_rate, softmax_rate;
  const std::vector<int> tokens = generate(linear, prompt, length, linear_rate);
  generate(softmax, prompt, length, softmax_rate);

  std::printf("%d blocks, d_model %d, %d heads, prompt %d tokens (prefilled in parallel)\n",
              int(kBlocks), int(kModel), int(kHeads), int(kPrompt));
  std::printf("%10s %16s %16s\n", "position", "linear tok/s", "softmax tok/s");
  Index pos = 2 * kPrompt;
  for (std::size_t i = 0; i < linear_rate.size(); ++i, pos *= 2)
    std::printf("%10d %16.0f %16.0f\n", int(pos), linear_rate[i], softmax_rate[i]);

  // The recurrent steps against the parallel causal forward over the generated sequence: the
  // logits of every position agree (the steps fed the sampled tokens back in).
  std::vector<Decoder<Linear>::State> fresh;
  for (const Linear& a : linear.attention) fresh.push_back(a.make_state());
  const MatrixXf parallel = linear.forward(tokens, fresh);
  std::vector<Decoder<Linear>::State> states;
  for (const Linear& a : linear.attention) states.push_back(a.make_state());
  const std::vector<int> head(tokens.begin(), tokens.begin() + kPrompt);
  MatrixXf stepped = linear.forward(head, states);
  stepped.conservativeResize(Index(tokens.size()), kVocab);
  for (Index i = kPrompt; i < Index(tokens.size()); ++i)
    stepped.row(i) = linear.step(tokens[std::size_t(i)], states).transpose();
  const float err = (stepped - parallel).cwiseAbs().maxCoeff() / parallel.cwiseAbs().maxCoeff();
  std::printf("steps vs parallel forward over %d tokens: max relative difference %.2e\n",
              int(tokens.size()), double(err));
  if (!(err < 1e-4f)) {
    std::printf("FAILED: the recurrent steps disagree with the parallel forward\n");
    return 1;
  }
  return 0;
}
