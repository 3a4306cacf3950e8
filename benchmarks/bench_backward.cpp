// Gradients (training), multi-head, H = 8, D = M = 64, float, one thread (the configuration of
// the performance targets):
//
//   - for linear attention (EluPlusOne), causal linear attention (EluPlusOne, library defaults:
//     CausalOptions{} for the forward, the backward is chunked with its default chunk) and tiled
//     softmax (non-causal and causal): the forward alone (pass:fwd), the backward alone
//     (pass:bwd) and a forward followed by its backward (pass:fwdbwd), per call;
//   - linear and causal on column-major packed N×(H·D) matrices (layout:col) and on Eigen::Maps
//     of row-major packed N×(H·D) memory (layout:row: PyTorch's contiguous [N, H, D], what a
//     framework holds), gradients written into the same layout as their inputs;
//   - the Eigen GEMMs of the backward's shapes (mh_gemm_linear_bwd, mh_gemm_softmax_bwd), so
//     that report.py can give the backward's fraction of GEMM throughput.
//
// Names: mh_train_<kernel>/.../pass:<fwd|bwd|fwdbwd>/layout:<col|row>/dtype:f32/H:8/D:64/thr:1/N:n
// (see bench_common.hpp). ws_bytes is MultiHeadWorkspace::bytes() after the calls: for pass:bwd
// a workspace only the backward used (its working memory), for pass:fwdbwd the one workspace
// both calls share, as a training step would.
//
// Useful flops per head (the GFLOPs and flops counters; N = L, F = D for EluPlusOne):
//   - linear and causal forward: 4·N·F·M (lb::linear_flops), as in bench_multihead;
//   - linear and causal backward: 8·N·F·M, twice the forward: the four products of the
//     gradient of out = φ(Q) S, S = φ(K)ᵀ V, i.e. R = φ(Q)ᵀ Ĝ, Ĝ Sᵀ (→ dQ), φ(K) R (dV) and
//     V Rᵀ (→ dK), each 2·N·F·M. The kernels do more arithmetic than that, which is not
//     counted: the non-causal backward recomputes S and the output (6 products of 2·N·F·M),
//     the causal one forms its chunks' triangles (about 8·C·(F + M)/2 more per token with the
//     default chunk C) and the output of each chunk again. Counting the recurrent form's flops
//     for causal matches how its forward is counted (the in-chunk triangle is not useful work).
//   - softmax forward: 4·N·L·D (lb::softmax_flops); softmax backward: 5 products over the
//     query–key pairs, 2·pairs·(3·D + 2·M) = 10·N·L·D at M = D (recomputing S = Q Kᵀ, dP = dO Vᵀ,
//     dV = Pᵀ dO, dQ = dS K, dK = dSᵀ Q: FlashAttention-2's count); causal: half of the pairs.
//   - pass:fwdbwd: the sum.
// The softmax cases need <linattn/softmax_attention_backward.hpp> and are left out without it.
#include <linattn/linattn.hpp>

#if __has_include(<linattn/softmax_attention_backward.hpp>)
#include <linattn/softmax_attention_backward.hpp>
#define LINATTN_BENCH_SOFTMAX_BACKWARD 1
#else
#define LINATTN_BENCH_SOFTMAX_BACKWARD 0
#endif

#include "bench_common.hpp"

namespace lb = linattn_bench;
using lb::Index;

namespace {

template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
template <class T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

constexpr Index kHeads = 8;
constexpr Index kDim = 64;

enum class Kernel { Linear, Causal, Softmax, CausalSoftmax };
enum class Pass { Fwd, Bwd, FwdBwd };
enum class Layout { Col, Row };

const char* pass_name(Pass p) {
  switch (p) {
    case Pass::Fwd: return "fwd";
    case Pass::Bwd: return "bwd";
    case Pass::FwdBwd: return "fwdbwd";
  }
  return "?";
}

#if LINATTN_BENCH_SOFTMAX_BACKWARD
// The softmax gradients hold 8 heads of O(N²) work three times per size (forward, backward,
// both): the quick profile stops at N = 4096 (a softmax backward there takes seconds).
Index softmax_cap(const lb::Profile& p) {
  if (p.name == "full") return p.mh_softmax_cap;
  if (p.name == "smoke") return p.mh_ns.front();
  return 4096;
}
#endif

// Useful flops of one head's backward (see the top of the file).
double linear_backward_flops(Index N, Index F, Index M) { return 8.0 * double(N) * double(F) * double(M); }
double softmax_backward_flops(Index N, Index D, Index M, bool causal) {
  const double pairs = causal ? 0.5 * double(N) * double(N + 1) : double(N) * double(N);
  return pairs * 2.0 * double(3 * D + 2 * M);
}

// ---------------------------------------------------------------------------------------------
// GEMM references of the backward's shapes (one thread, column-major packed, noalias into
// preallocated outputs, like bench_common.hpp's LinearGemm and SoftmaxGemm)
// ---------------------------------------------------------------------------------------------

// Linear attention's gradient, per head: R = Qᵀ G ((F×N)·(N×M)), dQ = G Sᵀ ((N×M)·(M×F)),
// dV = K R ((L×F)·(F×M)), dK = V Rᵀ ((L×M)·(M×F)): the 8·N·F·M useful flops.
template <class T>
struct LinearBackwardGemm {
  Mat<T> Q, K, V, G, S, R, dQ, dK, dV;
  Index H, D, M;
  LinearBackwardGemm(Index N, Index heads, Index d, Index m)
      : Q(lb::random_matrix<T>(N, heads * d, 71)),
        K(lb::random_matrix<T>(N, heads * d, 72)),
        V(lb::random_matrix<T>(N, heads * m, 73)),
        G(lb::random_matrix<T>(N, heads * m, 74)),
        S(lb::random_matrix<T>(d, heads * m, 75)),
        R(Mat<T>::Zero(d, heads * m)),
        dQ(Mat<T>::Zero(N, heads * d)),
        dK(Mat<T>::Zero(N, heads * d)),
        dV(Mat<T>::Zero(N, heads * m)),
        H(heads),
        D(d),
        M(m) {}
  void run() {
    for (Index h = 0; h < H; ++h) {
      auto r = R.middleCols(h * M, M);
      const auto g = G.middleCols(h * M, M);
      r.noalias() = Q.middleCols(h * D, D).transpose() * g;
      dQ.middleCols(h * D, D).noalias() = g * S.middleCols(h * M, M).transpose();
      dV.middleCols(h * M, M).noalias() = K.middleCols(h * D, D) * r;
      dK.middleCols(h * D, D).noalias() = V.middleCols(h * M, M) * r.transpose();
    }
  }
};

// Softmax attention's gradient, per head, in blocks of kRows queries × kCols keys as in
// SoftmaxGemm (no N×L matrix; the blocks stay in L2): s = Q_i K_jᵀ, p = G_i V_jᵀ (P×B each),
// dV_j += sᵀ G_i, dQ_i += p K_j, dK_j += pᵀ Q_i: 2·P·B·(3·D + 2·M) flops per block, the
// backward's count. Kᵀ and Vᵀ are stored transposed beforehand (untimed), for the reason given
// at SoftmaxGemm.
template <class T>
struct SoftmaxBackwardGemm {
  static constexpr Index kRows = 256, kCols = 512;
  Mat<T> Q, K, Kt, Vt, G, dQ, dK, dV, s, p;
  Index H, D, M;
  SoftmaxBackwardGemm(Index N, Index heads, Index d, Index m)
      : Q(lb::random_matrix<T>(N, heads * d, 81)),
        K(lb::random_matrix<T>(N, heads * d, 82)),
        Kt(K.transpose()),
        Vt(lb::random_matrix<T>(heads * m, N, 83)),
        G(lb::random_matrix<T>(N, heads * m, 84)),
        dQ(Mat<T>::Zero(N, heads * d)),
        dK(Mat<T>::Zero(N, heads * d)),
        dV(Mat<T>::Zero(N, heads * m)),
        s(Mat<T>::Zero(std::min(kRows, N), std::min(kCols, N))),
        p(Mat<T>::Zero(std::min(kRows, N), std::min(kCols, N))),
        H(heads),
        D(d),
        M(m) {}
  void run() {
    const Index N = Q.rows(), L = K.rows();
    dK.setZero();
    dV.setZero();
    for (Index h = 0; h < H; ++h)
      for (Index i0 = 0; i0 < N; i0 += kRows) {
        const Index P = std::min(kRows, N - i0);
        const auto q = Q.block(i0, h * D, P, D);
        const auto g = G.block(i0, h * M, P, M);
        auto dq = dQ.block(i0, h * D, P, D);
        dq.setZero();
        for (Index j0 = 0; j0 < L; j0 += kCols) {
          const Index B = std::min(kCols, L - j0);
          auto sb = s.topLeftCorner(P, B);
          auto pb = p.topLeftCorner(P, B);
          sb.noalias() = q * Kt.block(h * D, j0, D, B);
          pb.noalias() = g * Vt.block(h * M, j0, M, B);
          dV.block(j0, h * M, B, M).noalias() += sb.transpose() * g;
          dq.noalias() += pb * K.block(j0, h * D, B, D);
          dK.block(j0, h * D, B, D).noalias() += pb.transpose() * q;
        }
      }
  }
};

template <class T>
void BM_gemm_backward(benchmark::State& st, bool softmax) {
  const Index N = st.range(0), H = kHeads, D = kDim, M = kDim;
  double flops = 0;
  const auto loop = [&](auto& g, const T* data) {
    if (lb::worth_warming_up(flops)) g.run();
    for (auto _ : st) {
      g.run();
      benchmark::DoNotOptimize(data);
      benchmark::ClobberMemory();
    }
  };
  if (softmax) {
    flops = double(H) * softmax_backward_flops(N, D, M, false);
    SoftmaxBackwardGemm<T> g(N, H, D, M);
    loop(g, g.dK.data());
  } else {
    flops = double(H) * linear_backward_flops(N, D, M);
    LinearBackwardGemm<T> g(N, H, D, M);
    loop(g, g.dK.data());
  }
  st.SetComplexityN(N);
  lb::set_common_counters(st, flops, N, D, M, H, 1);
}

// ---------------------------------------------------------------------------------------------
// The kernels
// ---------------------------------------------------------------------------------------------

template <class T>
void BM_train(benchmark::State& st, Kernel kernel, Pass pass, Layout layout) {
  using Phi = linattn::EluPlusOne;
  const Index N = st.range(0), H = kHeads, D = kDim, M = kDim;
  // The same random values serve both layouts: only how the buffers are viewed changes.
  const Mat<T> Q = lb::random_matrix<T>(N, H * D, 51), K = lb::random_matrix<T>(N, H * D, 52),
               V = lb::random_matrix<T>(N, H * M, 53), G = lb::random_matrix<T>(N, H * M, 54);
  Mat<T> out = Mat<T>::Zero(N, H * M), dQ = Mat<T>::Zero(N, H * D), dK = Mat<T>::Zero(N, H * D),
         dV = Mat<T>::Zero(N, H * M);
  Eigen::Map<const RowMat<T>> Qr(Q.data(), N, H * D), Kr(K.data(), N, H * D),
      Vr(V.data(), N, H * M), Gr(G.data(), N, H * M);
  Eigen::Map<RowMat<T>> Or(out.data(), N, H * M), dQr(dQ.data(), N, H * D),
      dKr(dK.data(), N, H * D), dVr(dV.data(), N, H * M);

  linattn::MultiHeadWorkspace<T> ws;
  linattn::ParallelOptions par;
  par.num_threads = 1;
  const Phi phi{};
  const Index F = phi.feature_dim(D);
  const linattn::SoftmaxAlgorithm tiled = linattn::SoftmaxAlgorithm::Tiled;

  const auto forward = [&](const auto& q, const auto& k, const auto& v, const auto& o) {
    switch (kernel) {
      case Kernel::Linear:
        linattn::multihead_linear_attention(q, k, v, H, phi, o, ws, par);
        break;
      case Kernel::Causal:
        linattn::multihead_causal_linear_attention(q, k, v, H, phi, o, ws,
                                                   linattn::CausalOptions{}, par);
        break;
      case Kernel::Softmax:
        linattn::multihead_softmax_attention(q, k, v, H, o, ws, tiled, par);
        break;
      case Kernel::CausalSoftmax:
        linattn::multihead_causal_softmax_attention(q, k, v, H, o, ws, tiled, par);
        break;
    }
  };
  const auto backward = [&](const auto& q, const auto& k, const auto& v, const auto& g,
                            const auto& dq, const auto& dk, const auto& dv) {
    switch (kernel) {
      case Kernel::Linear:
        linattn::multihead_linear_attention_backward(q, k, v, g, H, phi, dq, dk, dv, ws, par);
        break;
      case Kernel::Causal:
        linattn::multihead_causal_linear_attention_backward(q, k, v, g, H, phi, dq, dk, dv, ws,
                                                            linattn::CausalOptions{}, par);
        break;
#if LINATTN_BENCH_SOFTMAX_BACKWARD
      case Kernel::Softmax:
        linattn::multihead_softmax_attention_backward(q, k, v, g, H, dq, dk, dv, ws, par);
        break;
      case Kernel::CausalSoftmax:
        linattn::multihead_causal_softmax_attention_backward(q, k, v, g, H, dq, dk, dv, ws, par);
        break;
#else
      default:
        break;  // not registered without the header
#endif
    }
  };
  const auto call = [&] {
    const bool fwd = pass != Pass::Bwd, bwd = pass != Pass::Fwd;
    if (layout == Layout::Row) {
      if (fwd) forward(Qr, Kr, Vr, Or);
      if (bwd) backward(Qr, Kr, Vr, Gr, dQr, dKr, dVr);
    } else {
      if (fwd) forward(Q, K, V, out);
      if (bwd) backward(Q, K, V, G, dQ, dK, dV);
    }
  };

  const bool linear = kernel == Kernel::Linear || kernel == Kernel::Causal;
  const bool causal = kernel == Kernel::Causal || kernel == Kernel::CausalSoftmax;
  const double fwd_flops = linear ? lb::linear_flops(N, N, F, M) : lb::softmax_flops(N, N, D, M, causal);
  const double bwd_flops = linear ? linear_backward_flops(N, F, M) : softmax_backward_flops(N, D, M, causal);
  const double flops = double(H) * ((pass != Pass::Bwd ? fwd_flops : 0.0) + (pass != Pass::Fwd ? bwd_flops : 0.0));

  if (lb::worth_warming_up(flops)) call();
  for (auto _ : st) {
    call();
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(dQ.data());
    benchmark::ClobberMemory();
  }
  st.counters["ws_bytes"] = double(ws.bytes());
  if (pass != Pass::Bwd && !lb::all_finite(out)) st.SkipWithError("non-finite output");
  if (pass != Pass::Fwd && !(lb::all_finite(dQ) && lb::all_finite(dK) && lb::all_finite(dV)))
    st.SkipWithError("non-finite gradients");
  st.SetComplexityN(N);
  lb::set_common_counters(st, flops, N, D, M, H, 1);
}

void register_all(const lb::Profile& p) {
  const std::string tail = lb::key("dtype", "f32") + lb::key("H", kHeads) + lb::key("D", kDim) + lb::key("thr", 1);
  const Pass passes[] = {Pass::Fwd, Pass::Bwd, Pass::FwdBwd};

  lb::add("mh_gemm_linear_bwd" + tail, p.mh_ns, "N", benchmark::oN,
          [](benchmark::State& st) { BM_gemm_backward<float>(st, false); });
  const std::pair<Kernel, std::string> linear_kinds[] = {
      {Kernel::Linear, "mh_train_linear/phi:elu"}, {Kernel::Causal, "mh_train_causal/phi:elu/alg:auto"}};
  for (const auto& [kernel, name] : linear_kinds)
    for (Pass pass : passes)
      for (Layout l : {Layout::Col, Layout::Row})
        lb::add(name + lb::key("pass", pass_name(pass)) + lb::key("layout", l == Layout::Row ? "row" : "col") + tail,
                p.mh_ns, "N", benchmark::oN, [kernel = kernel, pass, l](benchmark::State& st) {
                  BM_train<float>(st, kernel, pass, l);
                });

#if LINATTN_BENCH_SOFTMAX_BACKWARD
  const std::vector<Index> softmax_ns = lb::capped(p.mh_ns, softmax_cap(p));
  lb::add("mh_gemm_softmax_bwd" + tail, softmax_ns, "N", benchmark::oNSquared,
          [](benchmark::State& st) { BM_gemm_backward<float>(st, true); });
  const std::pair<Kernel, std::string> softmax_kinds[] = {
      {Kernel::Softmax, "mh_train_softmax/alg:tiled"}, {Kernel::CausalSoftmax, "mh_train_causal_softmax/alg:tiled"}};
  for (const auto& [kernel, name] : softmax_kinds)
    for (Pass pass : passes)
      lb::add(name + lb::key("pass", pass_name(pass)) + lb::key("layout", "col") + tail, softmax_ns, "N",
              benchmark::oNSquared,
              [kernel = kernel, pass](benchmark::State& st) { BM_train<float>(st, kernel, pass, Layout::Col); });
#endif
}

std::string notes(const lb::Profile& p) {
  return "Gradients (H = 8, D = M = 64, float, 1 thread): forward, backward and forward + backward of "
         "linear and causal linear attention (EluPlusOne) on column-major and row-major packed inputs, "
         "N = " + lb::join(p.mh_ns) + "; " +
#if LINATTN_BENCH_SOFTMAX_BACKWARD
         "tiled softmax (column-major) and its backward GEMM reference capped at N <= " +
         std::to_string(softmax_cap(p)) + " (8 heads of O(N^2) work, three passes per size)."
#else
         "softmax gradients not measured: this build has no linattn/softmax_attention_backward.hpp."
#endif
      ;
}

}  // namespace

int main(int argc, char** argv) { return lb::run_main(argc, argv, register_all, notes); }
