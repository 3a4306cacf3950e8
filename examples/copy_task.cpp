// Training works: the copy task of "Transformers are RNNs" (Katharopoulos et al. 2020, §4.1),
// trained on the CPU with linattn's causal LinearAttentionLayer and its backward.
//
// A sequence is [BOS, s1 … sn, SEP, s1 … sn]: n symbols out of 10, then the same symbols again.
// A model that predicts every next token can only get the second half right by copying. The
// model: token embeddings plus learned absolute position embeddings (as in the paper), 2 pre-norm
// blocks (causal linear attention with EluPlusOne, 4 heads, then a ReLU feed-forward), a final
// norm and a linear head over the 12 tokens; d_model 64. Cross-entropy on the second half only
// (the first is random); plain Adam, written out below, with the learning rate falling linearly
// from 3e-3 to 3e-4. Every gradient is the layer's backward() or written out here (layer norm,
// feed-forward, head, embeddings).
//
//   copy_task                 train 10000 steps of 16 sequences (n from 1 to 16; about a minute
//                             on one core), print the loss curve, then the token accuracy on 500
//                             held-out sequences (≥ 99% or the program fails) and how many of
//                             their copies the recurrent form generates exactly
//   copy_task --smoke         40 steps: the loss must fall (ctest)
//   copy_task --steps N       N training steps
//   copy_task --svg FILE      also write the loss curve as an SVG plot
#include <linattn/linattn.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

using Eigen::Index;
using Eigen::MatrixXf;
using Eigen::RowVectorXf;
using Eigen::VectorXf;
using Layer = linattn::LinearAttentionLayer<linattn::EluPlusOne, float>;

constexpr int kSymbols = 10, kSep = 10, kBos = 11, kVocab = 12;
constexpr Index kModel = 64, kHeads = 4, kFF = 128, kBlocks = 2, kMaxN = 16;
constexpr Index kMaxLength = 2 * kMaxN + 2;  // positions 0 … 2n + 1

struct Sequence {
  std::vector<int> tokens;  // 2n + 2 tokens
  Index n = 0;
};

Sequence make_sequence(std::mt19937& gen) {
  std::uniform_int_distribution<int> len(1, int(kMaxN)), sym(0, kSymbols - 1);
  Sequence s;
  s.n = len(gen);
  std::vector<int> symbols(std::size_t(s.n));
  for (int& x : symbols) x = sym(gen);
  s.tokens.push_back(kBos);
  for (int x : symbols) s.tokens.push_back(x);
  s.tokens.push_back(kSep);
  for (int x : symbols) s.tokens.push_back(x);
  return s;
}

// Row-wise normalisation without learned scale (pre-norm blocks); y = (x − mean) / σ.
struct Norm {
  MatrixXf y;
  VectorXf inv_sigma;
  void forward(const MatrixXf& x) {
    y.resize(x.rows(), x.cols());
    inv_sigma.resize(x.rows());
    for (Index i = 0; i < x.rows(); ++i) {
      const RowVectorXf c = x.row(i).array() - x.row(i).mean();
      inv_sigma(i) = 1.0f / std::sqrt(c.squaredNorm() / float(x.cols()) + 1e-5f);
      y.row(i) = c * inv_sigma(i);
    }
  }
  // dx for dy: (dy − mean(dy) − y · mean(dy ⊙ y)) / σ, row by row.
  MatrixXf backward(const MatrixXf& dy) const {
    MatrixXf dx(dy.rows(), dy.cols());
    for (Index i = 0; i < dy.rows(); ++i) {
      const float m1 = dy.row(i).mean(), m2 = dy.row(i).dot(y.row(i)) / float(dy.cols());
      dx.row(i) = (dy.row(i).array() - m1 - y.row(i).array() * m2) * inv_sigma(i);
    }
    return dx;
  }
};

MatrixXf random_matrix(Index rows, Index cols, float scale, std::mt19937& gen) {
  std::normal_distribution<float> g(0.0f, scale);
  MatrixXf W(rows, cols);
  for (Index j = 0; j < cols; ++j)
    for (Index i = 0; i < rows; ++i) W(i, j) = g(gen);
  return W;
}

struct Block {
  Layer attention{kModel, kHeads};
  MatrixXf W1, W2;  // kFF x d, d x kFF (out x in)
  VectorXf b1, b2;
};

struct Model {
  MatrixXf embed, position, head;  // kVocab x d, kMaxLength x d, kVocab x d
  VectorXf head_bias;
  std::vector<Block> blocks;

  explicit Model(unsigned seed) {
    std::mt19937 gen(seed);
    embed = random_matrix(kVocab, kModel, 1.0f, gen);
    position = random_matrix(kMaxLength, kModel, 1.0f, gen);
    head = random_matrix(kVocab, kModel, 1.0f / std::sqrt(float(kModel)), gen);
    head_bias = VectorXf::Zero(kVocab);
    for (Index b = 0; b < kBlocks; ++b) {
      Block blk;
      blk.attention.reset_parameters(seed + 1 + unsigned(b));
      blk.W1 = random_matrix(kFF, kModel, 1.0f / std::sqrt(float(kModel)), gen);
      blk.W2 = random_matrix(kModel, kFF, 1.0f / std::sqrt(float(kFF)), gen);
      blk.b1 = VectorXf::Zero(kFF);
      blk.b2 = VectorXf::Zero(kModel);
      blocks.push_back(std::move(blk));
    }
  }

  // Every parameter as (data, size), in a fixed order shared with Gradients.
  template <class F>
  void each(F&& f) {
    f(embed.data(), embed.size());
    f(position.data(), position.size());
    f(head.data(), head.size());
    f(head_bias.data(), head_bias.size());
    for (Block& b : blocks) {
      Layer& a = b.attention;
      for (MatrixXf* W : {&a.Wq, &a.Wk, &a.Wv, &a.Wo, &b.W1, &b.W2}) f(W->data(), W->size());
      for (VectorXf* v : {&a.bq, &a.bk, &a.bv, &a.bo, &b.b1, &b.b2}) f(v->data(), v->size());
    }
  }

  RowVectorXf input_row(int token, Index p) const { return embed.row(token) + position.row(p); }
};

// Gradients in the model's shapes (a Model used as storage, zeroed).
struct Gradients {
  Model g{0};
  Gradients() { zero(); }
  void zero() {
    g.each([](float* p, Index n) { std::fill(p, p + n, 0.0f); });
  }
};

// What a forward pass keeps for the backward pass.
struct Trace {
  std::vector<MatrixXf> x, x_mid, hidden;  // block input, after attention, FF pre-activation
  std::vector<Norm> norm_attn, norm_ff;
  Norm norm_out;
  MatrixXf logits;
};

MatrixXf forward(const Model& m, const Sequence& s, Trace& t) {
  const Index T = Index(s.tokens.size());
  MatrixXf x(T, kModel);
  for (Index p = 0; p < T; ++p) x.row(p) = m.input_row(s.tokens[std::size_t(p)], p);
  t.x.assign(std::size_t(kBlocks), {});
  t.x_mid.assign(std::size_t(kBlocks), {});
  t.hidden.assign(std::size_t(kBlocks), {});
  t.norm_attn.assign(std::size_t(kBlocks), {});
  t.norm_ff.assign(std::size_t(kBlocks), {});
  for (Index b = 0; b < kBlocks; ++b) {
    const Block& blk = m.blocks[std::size_t(b)];
    const std::size_t i = std::size_t(b);
    t.x[i] = x;
    t.norm_attn[i].forward(x);
    x += blk.attention.forward(t.norm_attn[i].y, /*causal=*/true);
    t.x_mid[i] = x;
    t.norm_ff[i].forward(x);
    t.hidden[i] = (t.norm_ff[i].y * blk.W1.transpose()).rowwise() + blk.b1.transpose();
    x += (t.hidden[i].cwiseMax(0.0f) * blk.W2.transpose()).rowwise() + blk.b2.transpose();
  }
  t.norm_out.forward(x);
  t.logits = (t.norm_out.y * m.head.transpose()).rowwise() + m.head_bias.transpose();
  return t.logits;
}

// Cross-entropy of the second half's predictions (positions n+1 … 2n predict s1 … sn), its
// gradient added into g (scaled by `weight`), and the number of correct argmax predictions.
struct LossResult {
  double loss = 0;
  int correct = 0, count = 0;
};

LossResult loss_and_backward(const Model& m, const Sequence& s, Trace& t, Gradients* grads,
                             float weight) {
  const Index T = Index(s.tokens.size());
  MatrixXf dlogits = MatrixXf::Zero(T, kVocab);
  LossResult r;
  for (Index p = s.n + 1; p < T - 1; ++p) {
    const int target = s.tokens[std::size_t(p + 1)];
    const RowVectorXf z = t.logits.row(p).array() - t.logits.row(p).maxCoeff();
    const RowVectorXf e = z.array().exp();
    const float total = e.sum();
    r.loss += double(std::log(total) - z(target));
    Index best;
    t.logits.row(p).maxCoeff(&best);
    r.correct += int(best == target);
    ++r.count;
    dlogits.row(p) = e / total;
    dlogits(p, target) -= 1.0f;
  }
  if (!grads) return r;
  dlogits *= weight;
  Model& g = grads->g;
  g.head.noalias() += dlogits.transpose() * t.norm_out.y;
  g.head_bias += dlogits.colwise().sum().transpose();
  MatrixXf dx = t.norm_out.backward(dlogits * m.head);
  for (Index b = kBlocks - 1; b >= 0; --b) {
    const Block& blk = m.blocks[std::size_t(b)];
    Block& gb = g.blocks[std::size_t(b)];
    const std::size_t i = std::size_t(b);
    // x = x_mid + relu(norm(x_mid) W1ᵀ + b1) W2ᵀ + b2
    const MatrixXf relu = t.hidden[i].cwiseMax(0.0f);
    gb.W2.noalias() += dx.transpose() * relu;
    gb.b2 += dx.colwise().sum().transpose();
    const MatrixXf dhidden = ((dx * blk.W2).array() * (t.hidden[i].array() > 0.0f).cast<float>()).matrix();
    gb.W1.noalias() += dhidden.transpose() * t.norm_ff[i].y;
    gb.b1 += dhidden.colwise().sum().transpose();
    dx += t.norm_ff[i].backward(dhidden * blk.W1);
    // x_mid = x + attention(norm(x))
    const linattn::LayerGradients<float> ga =
        blk.attention.backward(t.norm_attn[i].y, dx, /*causal=*/true);
    Layer& a = gb.attention;
    a.Wq += ga.dWq;
    a.Wk += ga.dWk;
    a.Wv += ga.dWv;
    a.Wo += ga.dWo;
    a.bq += ga.dbq;
    a.bk += ga.dbk;
    a.bv += ga.dbv;
    a.bo += ga.dbo;
    dx += t.norm_attn[i].backward(ga.dX);
  }
  for (Index p = 0; p < T; ++p) {
    g.embed.row(s.tokens[std::size_t(p)]) += dx.row(p);
    g.position.row(p) += dx.row(p);
  }
  return r;
}

// Adam (Kingma & Ba), one moment pair per parameter entry.
struct Adam {
  float lr, beta1 = 0.9f, beta2 = 0.98f, eps = 1e-9f;
  std::vector<float> m, v;
  int t = 0;
  explicit Adam(float rate) : lr(rate) {}
  void step(Model& model, Gradients& grads) {
    std::vector<std::pair<float*, Index>> p, g;
    model.each([&](float* d, Index n) { p.emplace_back(d, n); });
    grads.g.each([&](float* d, Index n) { g.emplace_back(d, n); });
    Index total = 0;
    for (const auto& x : p) total += x.second;
    if (m.empty()) {
      m.assign(std::size_t(total), 0.0f);
      v.assign(std::size_t(total), 0.0f);
    }
    ++t;
    const float c1 = 1.0f - std::pow(beta1, float(t)), c2 = 1.0f - std::pow(beta2, float(t));
    std::size_t k = 0;
    for (std::size_t j = 0; j < p.size(); ++j)
      for (Index e = 0; e < p[j].second; ++e, ++k) {
        const float gr = g[j].first[e];
        m[k] = beta1 * m[k] + (1 - beta1) * gr;
        v[k] = beta2 * v[k] + (1 - beta2) * gr * gr;
        p[j].first[e] -= lr * (m[k] / c1) / (std::sqrt(v[k] / c2) + eps);
      }
  }
};

// Greedy copy with the recurrent form: prefill [BOS, s, SEP] in parallel, then one step per
// generated token (layer.step(): constant time and memory per token). Returns the n tokens.
std::vector<int> generate_copy(const Model& m, const Sequence& s) {
  std::vector<Layer::State> states;
  for (const Block& b : m.blocks) states.push_back(b.attention.make_state());
  const Index P = s.n + 2;  // BOS, s1 … sn, SEP
  MatrixXf x(P, kModel);
  for (Index p = 0; p < P; ++p) x.row(p) = m.input_row(s.tokens[std::size_t(p)], p);
  Norm norm;
  const auto feed_forward = [&](const Block& blk, MatrixXf& h) {
    norm.forward(h);
    const MatrixXf hidden = ((norm.y * blk.W1.transpose()).rowwise() + blk.b1.transpose()).cwiseMax(0.0f);
    h += (hidden * blk.W2.transpose()).rowwise() + blk.b2.transpose();
  };
  for (std::size_t b = 0; b < m.blocks.size(); ++b) {  // the prefill
    norm.forward(x);
    x += m.blocks[b].attention.forward(norm.y, states[b]);
    feed_forward(m.blocks[b], x);
  }
  const auto next_token = [&](const MatrixXf& h) {
    norm.forward(h.bottomRows(1));
    const VectorXf logits = m.head * norm.y.row(0).transpose() + m.head_bias;
    Index best;
    logits.maxCoeff(&best);
    return int(best);
  };
  std::vector<int> out;
  int token = next_token(x);
  MatrixXf h(1, kModel), y(1, kModel);
  for (Index i = 0; i < s.n; ++i) {
    out.push_back(token);
    if (i + 1 == s.n) break;
    h = m.input_row(token, P + i);
    for (std::size_t b = 0; b < m.blocks.size(); ++b) {
      norm.forward(h);
      m.blocks[b].attention.step(norm.y.row(0), states[b], y.row(0));
      h += y;
      feed_forward(m.blocks[b], h);
    }
    token = next_token(h);
  }
  return out;
}

void write_svg(const std::string& path, const std::vector<std::pair<int, double>>& curve) {
  std::ofstream f(path);
  const double W = 720, H = 420, ml = 70, mr = 20, mt = 40, mb = 50;
  double lo = 1e9, hi = -1e9;
  for (const auto& [s, l] : curve) {
    lo = std::min(lo, std::log10(std::max(l, 1e-4)));
    hi = std::max(hi, std::log10(std::max(l, 1e-4)));
  }
  lo = std::floor(lo);
  hi = std::ceil(hi);
  const double xmax = curve.empty() ? 1 : curve.back().first;
  const auto X = [&](double s) { return ml + s / xmax * (W - ml - mr); };
  const auto Y = [&](double l) {
    return mt + (hi - std::log10(std::max(l, 1e-4))) / (hi - lo) * (H - mt - mb);
  };
  f << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"13\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << W / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">Copy task: "
    << "training loss (cross-entropy of the copied half, log scale)</text>\n";
  for (double e = lo; e <= hi; e += 1) {
    f << "<line x1=\"" << ml << "\" x2=\"" << W - mr << "\" y1=\"" << Y(std::pow(10, e)) << "\" y2=\""
      << Y(std::pow(10, e)) << "\" stroke=\"#ddd\"/>\n<text x=\"" << ml - 8 << "\" y=\""
      << Y(std::pow(10, e)) + 4 << "\" text-anchor=\"end\">1e" << int(e) << "</text>\n";
  }
  for (int k = 0; k <= 5; ++k) {
    const double s = xmax * k / 5;
    f << "<text x=\"" << X(s) << "\" y=\"" << H - mb + 20 << "\" text-anchor=\"middle\">"
      << int(s) << "</text>\n";
  }
  f << "<text x=\"" << (W + ml) / 2 << "\" y=\"" << H - 10 << "\" text-anchor=\"middle\">step</text>\n";
  f << "<path fill=\"none\" stroke=\"#2ca02c\" stroke-width=\"2\" d=\"";
  for (std::size_t i = 0; i < curve.size(); ++i)
    f << (i ? " L" : "M") << X(curve[i].first) << "," << Y(curve[i].second);
  f << "\"/>\n<rect x=\"" << ml << "\" y=\"" << mt << "\" width=\"" << W - ml - mr << "\" height=\""
    << H - mt - mb << "\" fill=\"none\" stroke=\"black\"/>\n</svg>\n";
}

}  // namespace

int main(int argc, char** argv) {
  bool smoke = false;
  int steps_arg = 0;
  std::string svg;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--smoke") == 0) smoke = true;
    if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) steps_arg = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--svg") == 0 && i + 1 < argc) svg = argv[++i];
  }
  // The model's products are a few hundred rows of 32 to 64 columns. Compiled with OpenMP, Eigen
  // splits every product of rows*cols*depth >= 1e5 over its threads, and such a product is
  // smaller than the fork/join it then pays for (300 steps on a 2-core machine: 188 s on two
  // threads, 2.6 s on one). The attention calls choose their own thread counts (parallel.hpp).
  Eigen::setNbThreads(1);
  const int steps = steps_arg > 0 ? steps_arg : smoke ? 40 : 10000, batch = 16;
  const int report_every = smoke ? 10 : 250;
  Model model(1);
  Gradients grads;
  Adam adam(3e-3f);
  std::mt19937 train_gen(2), test_gen(3);
  std::vector<std::pair<int, double>> curve;
  std::printf("copy task: d_model %d, %d heads, %d blocks, n = 1..%d symbols, batch %d, Adam\n",
              int(kModel), int(kHeads), int(kBlocks), int(kMaxN), batch);
  std::printf("%6s %10s %12s\n", "step", "loss", "token acc.");
  const auto t0 = std::chrono::steady_clock::now();
  double first_loss = 0, last_loss = 0, window_loss = 0;
  int window_correct = 0, window_count = 0, window_steps = 0;
  for (int step = 1; step <= steps; ++step) {
    grads.zero();
    std::vector<Sequence> seqs;
    int targets = 0;
    for (int b = 0; b < batch; ++b) {
      seqs.push_back(make_sequence(train_gen));
      targets += int(seqs.back().n);
    }
    double loss = 0;
    for (const Sequence& s : seqs) {
      Trace t;
      forward(model, s, t);
      const LossResult r = loss_and_backward(model, s, t, &grads, 1.0f / float(targets));
      loss += r.loss;
      window_correct += r.correct;
      window_count += r.count;
    }
    loss /= targets;
    // The learning rate falls linearly to a tenth over the run (the last steps refine).
    adam.lr = 3e-3f * (1.0f - 0.9f * float(step - 1) / float(std::max(1, steps - 1)));
    adam.step(model, grads);
    if (step == 1) first_loss = loss;
    window_loss += loss;
    ++window_steps;
    if (step % report_every == 0) {
      last_loss = window_loss / window_steps;
      curve.emplace_back(step, last_loss);
      std::printf("%6d %10.4f %11.1f%%\n", step, last_loss, 100.0 * window_correct / window_count);
      window_loss = 0;
      window_steps = window_correct = window_count = 0;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("trained %d steps in %.1f s\n", steps, seconds);
  if (!svg.empty()) write_svg(svg, curve);

  if (smoke) {
    const bool fell = last_loss < 0.9 * first_loss;
    std::printf("loss %.4f -> %.4f: %s\n", first_loss, last_loss, fell ? "falls" : "DOES NOT FALL");
    return fell ? 0 : 1;
  }
  // Held-out sequences: token accuracy of the parallel forward (teacher forcing), and copies
  // generated token by token with the recurrent form.
  int correct = 0, count = 0, exact = 0;
  const int held_out = 500;
  for (int k = 0; k < held_out; ++k) {
    const Sequence s = make_sequence(test_gen);
    Trace t;
    forward(model, s, t);
    const LossResult r = loss_and_backward(model, s, t, nullptr, 0.0f);
    correct += r.correct;
    count += r.count;
    const std::vector<int> copy = generate_copy(model, s);
    exact += int(std::equal(copy.begin(), copy.end(), s.tokens.begin() + s.n + 2));
  }
  const double acc = double(correct) / count;
  std::printf("held-out: token accuracy %.2f%% (%d of %d), copies generated with the recurrent "
              "form exactly right: %d of %d\n", 100.0 * acc, correct, count, exact, held_out);
  return acc >= 0.99 ? 0 : 1;
}
