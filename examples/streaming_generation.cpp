// Streaming generation with one attention head (D = M = 64, float):
//
//  1. prefill a prompt in parallel with causal_linear_attention, carrying a state out of it;
//  2. hand the state to a RecurrentLinearAttention;
//  3. generate token by token (random tokens stand in for a model's) up to 64k positions
//     (--smoke: 4k), printing the time of one step at growing positions, next to a softmax
//     step over a growing KV cache at the same positions.
//
// The linear step costs O(D·M) whatever the position: the state is a 64 x 64 matrix and a
// 64-vector. The softmax step reads the whole cache, O(t·D), so its time grows linearly.
// At the end the generated outputs are checked against causal_linear_attention over the whole
// sequence in one shot, and the softmax step against causal softmax attention; the program
// returns non-zero if a check fails.
#include <linattn/linattn.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// One softmax-attention step of a decoder over its KV cache: the query attends to the first t
// cached keys. scores (capacity >= t) is scratch; out receives M entries.
void softmax_step(const Eigen::MatrixXf& K_cache, const Eigen::MatrixXf& V_cache, Eigen::Index t,
                  const Eigen::VectorXf& q, Eigen::VectorXf& scores, Eigen::VectorXf& out) {
  auto s = scores.head(t);
  s.noalias() = K_cache.topRows(t) * q;
  s *= 1.0f / std::sqrt(static_cast<float>(q.size()));
  const float m = s.maxCoeff();
  s = (s.array() - m).exp().matrix();
  s /= s.sum();
  out.noalias() = V_cache.topRows(t).transpose() * s;
}

double since_us(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

// The median: robust to the odd step that is preempted on a busy machine.
double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const bool smoke = argc > 1 && std::strcmp(argv[1], "--smoke") == 0;
  const Eigen::Index D = 64, M = 64;
  const Eigen::Index prompt = 512;
  const Eigen::Index last_mark = smoke ? (Eigen::Index(1) << 12) : (Eigen::Index(1) << 16);  // 4k or 64k
  const Eigen::Index window = 256;  // linear steps timed per measurement
  const Eigen::Index total = last_mark + window;
  const int softmax_reps = 15;      // softmax steps timed per measurement

  // Random tokens (a model would produce q, k, v from the previous output).
  std::mt19937 gen(7);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  auto randn = [&](Eigen::Index rows, Eigen::Index cols) {
    Eigen::MatrixXf x(rows, cols);
    for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = n01(gen);
    return x;
  };
  const Eigen::MatrixXf Q = randn(total, D), K = randn(total, D), V = randn(total, M);

  // 1. Parallel prefill of the prompt, carrying the state out. (Run once before, untimed, so
  // that the timing does not include first-touch page faults and thread start-up.)
  {
    linattn::LinearAttentionState<float> warm_up;
    linattn::causal_linear_attention(Q.topRows(prompt), K.topRows(prompt), V.topRows(prompt),
                                     linattn::EluPlusOne{}, warm_up);
  }
  linattn::LinearAttentionState<float> state;
  const auto t_prefill = Clock::now();
  const Eigen::MatrixXf prompt_out = linattn::causal_linear_attention(
      Q.topRows(prompt), K.topRows(prompt), V.topRows(prompt), linattn::EluPlusOne{}, state);
  const double prefill_us = since_us(t_prefill);

  // 2. Hand the state over.
  linattn::RecurrentLinearAttention<linattn::EluPlusOne, float> rnn(D, M);
  rnn.set_state(state, prompt);

  // The softmax decoder's KV cache, preallocated for `total` tokens; a decoder appends row t
  // at step t and attends over the first t + 1 rows. The rows are written ahead here (they are
  // the same random tokens), so that the timed loop below only contains the linear steps.
  const Eigen::MatrixXf K_cache = K, V_cache = V;
  Eigen::VectorXf scores(total), soft_out(M), q(D);

  std::printf("streaming generation, one head, D = M = %ld, float; prompt of %ld tokens prefilled "
              "in parallel in %.1f us\n",
              static_cast<long>(D), static_cast<long>(prompt), prefill_us);
  std::printf("%10s  %22s  %26s  %8s\n", "position", "linear step (us/token)", "softmax KV-cache step (us)",
              "ratio");

  // 3. Generate. Measurements at 1k, 2k, 4k, ...: every one of the `window` steps from there on
  // is timed and the median reported; the softmax step is timed `softmax_reps` times at that
  // cache length (median again).
  Eigen::MatrixXf generated(total, M);
  generated.topRows(prompt) = prompt_out;
  Eigen::VectorXf out(M);
  Eigen::Index next_mark = 1024;
  std::vector<double> step_us;
  step_us.reserve(static_cast<std::size_t>(window));
  for (Eigen::Index t = prompt; t < total; ++t) {
    const bool timed = t >= next_mark && t < next_mark + window;
    const auto t0 = Clock::now();
    rnn.step(Q.row(t), K.row(t), V.row(t), out);
    if (timed) step_us.push_back(since_us(t0));
    generated.row(t) = out.transpose();
    if (timed && t + 1 == next_mark + window) {
      // The softmax decoder at the same position: attend over the cache of next_mark + 1 tokens.
      q = Q.row(next_mark).transpose();
      std::vector<double> softmax_us;
      for (int r = 0; r < softmax_reps; ++r) {
        const auto s0 = Clock::now();
        softmax_step(K_cache, V_cache, next_mark + 1, q, scores, soft_out);
        softmax_us.push_back(since_us(s0));
      }
      const double lin = median(step_us), soft = median(softmax_us);
      std::printf("%10ld  %22.3f  %26.3f  %7.0fx\n", static_cast<long>(next_mark), lin, soft, soft / lin);
      step_us.clear();
      next_mark *= 2;
    }
  }

  // Checks. (a) Prefill + steps == causal linear attention over the whole sequence in one shot.
  const Eigen::MatrixXf one_shot = linattn::causal_linear_attention(Q, K, V);
  const float err_linear = (generated - one_shot).cwiseAbs().maxCoeff();
  // (b) The softmax step == causal softmax attention, at a few positions.
  float err_softmax = 0;
  for (const Eigen::Index t : {Eigen::Index(0), Eigen::Index(1), Eigen::Index(777), total - 1}) {
    q = Q.row(t).transpose();
    softmax_step(K_cache, V_cache, t + 1, q, scores, soft_out);
    const Eigen::MatrixXf ref = linattn::softmax_attention(Q.row(t), K.topRows(t + 1), V.topRows(t + 1));
    err_softmax = std::max(err_softmax, (soft_out.transpose() - ref.row(0)).cwiseAbs().maxCoeff());
  }
  std::printf("check: generated tokens vs one-shot causal_linear_attention: max abs diff %.2e\n", err_linear);
  std::printf("check: softmax KV-cache step vs softmax_attention: max abs diff %.2e\n", err_softmax);
  const bool ok = err_linear < 1e-4f && err_softmax < 1e-4f && generated.allFinite();
  std::printf(ok ? "checks passed\n" : "CHECK FAILED\n");
  return ok ? 0 : 1;
}
