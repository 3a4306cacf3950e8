// What a C++ user of linattn computes for the inputs test_same_bits_as_cpp.py builds in NumPy:
// the raw little-endian outputs of the library's own entry points, one file each in the
// directory given as the argument, for the Python package to match (bit for bit where the same
// kernels run; the layers to rounding, their projections being torch's GEMMs). Built with the
// module's flags (same build, same -march) so that the same kernels run.
#include <linattn/batched_recurrent.hpp>
#include <linattn/delta_rule.hpp>
#include <linattn/elu_plus_one.hpp>
#include <linattn/l2_normalize.hpp>
#include <linattn/layers/gated_delta_net_layer.hpp>
#include <linattn/layers/kimi_delta_attention_layer.hpp>
#include <linattn/multihead.hpp>
#include <linattn/silu.hpp>
#include <linattn/softmax_split.hpp>
#include <linattn/state_io.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

template <class Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Exact in double, then rounded once to Scalar: NumPy makes the same values.
template <class Scalar>
RowMatrix<Scalar> values(Eigen::Index rows, Eigen::Index cols, std::int64_t seed) {
  RowMatrix<Scalar> x(rows, cols);
  for (Eigen::Index i = 0; i < x.size(); ++i)
    x.data()[i] = static_cast<Scalar>(double((i * 7919 + seed * 104729) % 2003) / 1001.0 - 1.0);
  return x;
}

void write(const std::string& dir, const std::string& name, const void* data, std::size_t bytes) {
  std::ofstream f(dir + "/" + name, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!f) throw std::runtime_error("cpp_reference: cannot write " + dir + "/" + name);
}

template <class M>
void write(const std::string& dir, const std::string& name, const M& m) {
  write(dir, name, m.data(), sizeof(typename M::Scalar) * static_cast<std::size_t>(m.size()));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: cpp_reference <output directory>\n";
    return 2;
  }
  const std::string dir = argv[1];
  const Eigen::Index N = 300, H = 4, D = 16, M = 8;

  // [1, N, H, D] in Python: multi-head causal, EluPlusOne, float.
  {
    const auto Q = values<float>(N, H * D, 1), K = values<float>(N, H * D, 2);
    const auto V = values<float>(N, H * M, 3);
    const RowMatrix<float> out = linattn::multihead_causal_linear_attention(Q, K, V, H);
    write(dir, "causal_elu_f32.bin", out);
  }
  // Non-causal, SoftmaxSplit, double, keys of another length.
  {
    const auto Q = values<double>(N, H * D, 4), K = values<double>(N + 37, H * D, 5);
    const auto V = values<double>(N + 37, H * M, 6);
    const RowMatrix<double> out =
        linattn::multihead_linear_attention(Q, K, V, H, linattn::SoftmaxSplit{});
    write(dir, "linear_softmax_split_f64.bin", out);
  }
  // The delta rule with decay, L2Normalize<Silu>, scale 1/√D, float.
  {
    const auto Q = values<float>(N, H * D, 7), K = values<float>(N, H * D, 8);
    const auto V = values<float>(N, H * M, 9);
    const RowMatrix<float> beta = (values<float>(N, H, 10).array() + 1.0f) * 0.5f;
    const RowMatrix<float> g = (values<float>(N, H, 11).array() - 1.0f) * 0.05f;
    linattn::DeltaOptions opts;
    opts.scale = 1.0 / std::sqrt(double(D));
    const RowMatrix<float> out = linattn::multihead_delta_rule_attention(
        Q, K, V, beta, g, H, linattn::L2Normalize<linattn::Silu>{}, opts);
    write(dir, "delta_f32.bin", out);
  }
  // Decoding: 3 sequences of H heads, 150 steps (past a fold of the compensated sums), then the
  // saved state.
  {
    const Eigen::Index B = 3, T = 150;
    linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, double> dec(B, H, D, M);
    RowMatrix<double> outs(B * T, H * M), out(B, H * M);
    const auto Q = values<double>(B * T, H * D, 12), K = values<double>(B * T, H * D, 13);
    const auto V = values<double>(B * T, H * M, 14);
    for (Eigen::Index t = 0; t < T; ++t) {  // step t reads rows [t·B, t·B + B): [T, B, H, D]
      dec.step(Q.middleRows(t * B, B), K.middleRows(t * B, B), V.middleRows(t * B, B), out);
      outs.middleRows(t * B, B) = out;
    }
    write(dir, "decode_f64.bin", outs);
    std::ostringstream saved(std::ios::binary);
    linattn::save_state(saved, dec);
    const std::string bytes = saved.str();
    write(dir, "decode_f64.state", bytes.data(), bytes.size());
  }
  // The layers of Qwen3-Next (two key heads shared by four value heads) and Kimi Linear (K != V),
  // double, with torch's initial parameters: the checkpoint and the outputs of two packed
  // sequences, for linattn.torch's modules of the same names to match.
  {
    const std::vector<Eigen::Index> offsets{0, 9, 23};
    const auto X = values<double>(23, 12, 15);
    linattn::GatedDeltaNetConfig gc;
    gc.hidden_size = 12;
    gc.linear_num_key_heads = 2;
    gc.linear_num_value_heads = 4;
    gc.linear_key_head_dim = 4;
    gc.linear_value_head_dim = 3;
    const linattn::GatedDeltaNetLayer<double> gdn(gc, 5);
    linattn::SafetensorsWriter gw;
    gdn.save(gw);
    gw.write(dir + "/gdn.safetensors");
    std::vector<linattn::GatedDeltaNetState<double>> gs;
    const RowMatrix<double> gy = gdn.forward(X, offsets, gs);
    write(dir, "gdn_f64.bin", gy);
    linattn::KimiDeltaAttentionConfig kc;
    kc.hidden_size = 12;
    kc.num_heads = 2;
    kc.head_dim = 4;
    kc.head_v_dim = 3;
    kc.short_conv_kernel_size = 3;
    linattn::KimiDeltaAttentionLayer<double> kda(kc, 6);
    kda.dt_bias.setLinSpaced(-0.5, 0.5);  // not torch's zeros: a wrong layout of it would show
    linattn::SafetensorsWriter kw;
    kda.save(kw);
    kw.write(dir + "/kda.safetensors");
    std::vector<linattn::KimiDeltaAttentionState<double>> ks;
    const RowMatrix<double> ky = kda.forward(X, offsets, ks);
    write(dir, "kda_f64.bin", ky);
  }
  return 0;
}
