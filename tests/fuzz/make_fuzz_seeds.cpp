// Writes the seed corpus of fuzz_load_state into the directory given: one valid file of each
// kind and scalar type, in the shapes the fuzz target's objects have, decayed states (a scalar
// and a per-feature log-decay), gated decoders (kind 8, and the older kind 4: per-feature
// gates in float, scalar gates in double), delta-rule decoders (kind 7), batched decoders
// (kind 5, sequences at different positions, and an empty one), the attention layers' States
// (a linear layer's, kind 3, past a fold; KV caches, kind 6, and an empty one) and files of
// the old format version 1, so that the fuzzer starts from inputs that pass the checksums and
// mutates from there.
#include <linattn/linattn.hpp>

#include <Eigen/Core>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ios>
#include <sstream>
#include <string>
#include <system_error>

namespace {

template <class T>
bool write(const std::string& dir, const char* name, const T& x) {
  std::ofstream out(dir + "/" + name, std::ios::binary);
  linattn::save_state(out, x);
  return static_cast<bool>(out);
}

// The same record in format version 1 (linattn before decayed states; no log-decay): the
// version-2 file without its log-decay field (bytes 56-63, which must be 0), version 1, both
// CRCs recomputed.
template <class T>
bool write_version1(const std::string& dir, const char* name, const T& x) {
  std::ostringstream os(std::ios::binary);
  linattn::save_state(os, x);
  std::string f = os.str();
  f = f.substr(0, 56) + f.substr(64);
  auto* b = reinterpret_cast<unsigned char*>(&f[0]);
  linattn::detail::io::put_le(b + 8, std::uint32_t(1));
  linattn::detail::io::put_le(b + 56, linattn::detail::io::crc32(b, 56));
  linattn::detail::io::put_le(b + f.size() - 4, linattn::detail::io::crc32(b, f.size() - 4));
  std::ofstream out(dir + "/" + name, std::ios::binary);
  out.write(f.data(), static_cast<std::streamsize>(f.size()));
  return static_cast<bool>(out);
}

// A gated decoder's compact (kind-8) record in the older kind-4 layout: the unfolded count (0)
// after the position, zero low parts after S and after z; both CRCs recomputed.
template <class R>
bool write_kind4(const std::string& dir, const char* name, const R& rnn, std::size_t s) {
  std::ostringstream os(std::ios::binary);
  linattn::save_state(os, rnn);
  const std::string c = os.str();
  const std::size_t FM = std::size_t(rnn.feature_dim() * rnn.value_dim());
  const std::size_t F = std::size_t(rnn.feature_dim());
  std::string f = c.substr(0, 76) + std::string(8, '\0') + c.substr(76, s * FM) +
                  std::string(s * FM, '\0') + c.substr(76 + s * FM, s * F) +
                  std::string(s * F, '\0') + c.substr(76 + s * (FM + F));
  auto* b = reinterpret_cast<unsigned char*>(&f[0]);
  linattn::detail::io::put_le(b + 16, std::uint32_t(4));
  linattn::detail::io::put_le(b + 64, linattn::detail::io::crc32(b, 64));
  linattn::detail::io::put_le(b + f.size() - 4, linattn::detail::io::crc32(b, f.size() - 4));
  std::ofstream out(dir + "/" + name, std::ios::binary);
  out.write(f.data(), static_cast<std::streamsize>(f.size()));
  return static_cast<bool>(out);
}

template <class S, class R>
void steps(R& rnn, int n, int width_q, int width_v) {
  for (int t = 0; t < n; ++t) {
    const Eigen::VectorXf q = Eigen::VectorXf::LinSpaced(width_q, -1.0f + 0.1f * t, 1.0f);
    const Eigen::VectorXf v = Eigen::VectorXf::LinSpaced(width_v, 0.5f, -0.25f * t);
    rnn.step(q.cast<S>(), q.reverse().cast<S>(), v.cast<S>());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_fuzz_seeds <corpus directory>\n");
    return 2;
  }
  const std::string dir = argv[1];
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  bool ok = !ec;
  const Eigen::MatrixXf K = Eigen::MatrixXf::Constant(5, 3, 0.5f), V = Eigen::MatrixXf::Ones(5, 2);
  ok &= write(dir, "state_float", linattn::summarize(K, V, linattn::SoftmaxSplit{}));
  ok &= write(dir, "state_double", linattn::summarize(K.cast<double>().eval(),
                                                      V.cast<double>().eval()));
  ok &= write(dir, "state_empty", linattn::LinearAttentionState<float>{});
  // Decayed states (gated_linear_attention): per-feature gates in float, a scalar in double.
  linattn::LinearAttentionState<float> gated(3, 2);
  gated.S.setConstant(0.5f);
  gated.z.setConstant(1.5f);
  gated.log_decay = Eigen::VectorXf::LinSpaced(3, -2.0f, -0.125f);
  ok &= write(dir, "state_gated_float", gated);
  linattn::LinearAttentionState<double> decayed(2, 3);
  decayed.S.setConstant(-0.25);
  decayed.z.setConstant(2.0);
  decayed.log_decay = Eigen::VectorXd::Constant(1, -0.75);
  ok &= write(dir, "state_decayed_double", decayed);
  ok &= write_version1(dir, "state_double_v1", linattn::summarize(K.cast<double>().eval(),
                                                                  V.cast<double>().eval()));
  linattn::MultiHeadRecurrentLinearAttention<linattn::EluPlusOne, float> rf(1, 3, 2);
  steps<float>(rf, 5, 3, 2);
  ok &= write(dir, "recurrent_float", rf.head(0));
  ok &= write_version1(dir, "recurrent_float_v1", rf.head(0));
  linattn::MultiHeadRecurrentLinearAttention<linattn::SoftmaxSplit, double> rd(1, 2, 3);
  steps<double>(rd, 7, 2, 3);
  ok &= write(dir, "recurrent_double", rd.head(0));
  linattn::MultiHeadRecurrentLinearAttention<linattn::SoftmaxSplit, float> mh(2, 2, 2);
  steps<float>(mh, 4, 4, 4);
  ok &= write(dir, "multihead_float", mh);
  // Gated decoders (kind 8; also as kind 4) in the shapes of the fuzz target's: per-feature
  // gates in float, scalar gates in double (the decoder keeps F log-decay entries either way:
  // L = F).
  linattn::RecurrentGatedAttention<linattn::Identity, float> gf(3, 2);
  linattn::RecurrentGatedAttention<linattn::Silu, double> gd(2, 3);
  for (int t = 0; t < 6; ++t) {
    const Eigen::VectorXf q = Eigen::VectorXf::LinSpaced(3, -1.0f + 0.1f * t, 1.0f);
    gf.step(q, q.reverse(), Eigen::VectorXf::LinSpaced(2, 0.5f, -0.25f * t),
            Eigen::VectorXf::LinSpaced(3, -0.5f, -0.0625f * t), Eigen::VectorXf(2));
    const Eigen::VectorXd qd = Eigen::VectorXd::LinSpaced(2, -1.0 + 0.2 * t, 1.0);
    gd.step(qd, qd.reverse(), Eigen::VectorXd::LinSpaced(3, 0.25, -0.5 * t),
            Eigen::VectorXd::Constant(1, -0.125 * (t + 1)), Eigen::VectorXd(3));
  }
  ok &= write(dir, "gated_float", gf);
  ok &= write(dir, "gated_double", gd);
  ok &= write_kind4(dir, "gated_float_kind4", gf, 4);
  ok &= write_kind4(dir, "gated_double_kind4", gd, 8);
  // Delta-rule decoders (kind 7) in the shapes of the fuzz target's (D = F = 3, M = 2 in float,
  // D = F = 2, M = 3 in double), their last update pending when saved.
  linattn::RecurrentDeltaRule<linattn::Identity, float> df(3, 2);
  linattn::RecurrentDeltaRule<linattn::L2Normalize<linattn::Silu>, double> dd(2, 3);
  for (int t = 0; t < 5; ++t) {
    const Eigen::VectorXf q = Eigen::VectorXf::LinSpaced(3, -0.5f + 0.1f * t, 0.5f);
    df.step(q, q.reverse(), Eigen::VectorXf::LinSpaced(2, 0.5f, -0.25f * t), 0.75f,
            -0.125f * t, Eigen::VectorXf(2));
    const Eigen::VectorXd qd = Eigen::VectorXd::LinSpaced(2, -1.0 + 0.2 * t, 1.0);
    dd.step(qd, qd.reverse(), Eigen::VectorXd::LinSpaced(3, 0.25, -0.5 * t), 1.5, 0.0,
            Eigen::VectorXd(3));
  }
  ok &= write(dir, "delta_float", df);
  ok &= write(dir, "delta_double", dd);
  // Batched decoders (kind 5) in the shapes of the fuzz target's: 2 sequences of 2 heads at
  // different positions in float (one stepped alone), 1 sequence with maxima in double, and an
  // empty decoder (B = 0).
  linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float> bf(2, 2, 3, 2);
  linattn::BatchedRecurrentLinearAttention<linattn::SoftmaxSplit, double> bd(1, 1, 2, 3);
  for (int t = 0; t < 5; ++t) {
    const Eigen::MatrixXf q = Eigen::MatrixXf::Constant(2, 6, 0.25f * float(t) - 0.5f);
    const Eigen::MatrixXf v = Eigen::MatrixXf::Constant(2, 4, 1.0f - 0.125f * float(t));
    Eigen::MatrixXf out(2, 4);
    bf.step(q, q.reverse(), v, out);
    Eigen::VectorXi first(1);
    first << 0;
    Eigen::MatrixXf out1(1, 4);
    bf.step(first, q.topRows(1), q.bottomRows(1), v.topRows(1), out1);
    const Eigen::MatrixXd qd = Eigen::MatrixXd::Constant(1, 2, -0.5 + 0.3 * t);
    Eigen::MatrixXd outd(1, 3);
    bd.step(qd, qd.reverse(), Eigen::MatrixXd::Constant(1, 3, 0.5 * t), outd);
  }
  ok &= write(dir, "batched_float", bf);
  ok &= write(dir, "batched_double", bd);
  ok &= write(dir, "batched_empty",
              linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float>(0, 2, 3, 2));
  // The attention layers' States in the shapes of the fuzz target's: a linear layer's after a
  // prefill and 130 steps (a fold of the low parts, and 2 tokens into the next; also as
  // version 1), KV caches after a prefill and steps, and an empty cache.
  const linattn::LinearAttentionLayer<linattn::EluPlusOne, float> lf(5, 2, 3, 2);
  const linattn::SoftmaxAttentionLayer<float> sfl(5, 2, 3, 2);
  const linattn::SoftmaxAttentionLayer<double> sdl(4, 1, 2, 3);
  auto lfs = lf.make_state();
  auto sfs = sfl.make_state();
  auto sds = sdl.make_state();
  const Eigen::MatrixXf X = Eigen::MatrixXf::Constant(4, 5, 0.25f);
  (void)lf.forward(X, lfs);
  (void)sfl.forward(X, sfs);
  (void)sdl.forward(X.leftCols(4).cast<double>().eval(), sds);
  Eigen::VectorXf y(5);
  Eigen::VectorXd yd(4);
  for (int t = 0; t < 130; ++t) {
    const Eigen::VectorXf x = Eigen::VectorXf::LinSpaced(5, -1.0f + 0.01f * float(t), 1.0f);
    lf.step(x, lfs, y);
    if (t < 6) {
      sfl.step(x, sfs, y);
      sdl.step(x.head(4).cast<double>(), sds, yd);
    }
  }
  ok &= write(dir, "layer_linear_float", lfs);
  ok &= write_version1(dir, "layer_linear_float_v1", lfs);
  ok &= write(dir, "layer_softmax_float", sfs);
  ok &= write(dir, "layer_softmax_double", sds);
  ok &= write(dir, "layer_softmax_empty", sfl.make_state());
  if (!ok) std::fprintf(stderr, "make_fuzz_seeds: could not write into %s\n", dir.c_str());
  return ok ? 0 : 1;
}
