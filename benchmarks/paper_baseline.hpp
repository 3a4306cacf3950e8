// The CPU algorithm of "Transformers are RNNs" (Katharopoulos et al., ICML 2020), the baseline
// that linattn's multi-head kernels are compared with in the same run (bench_multihead).
//
// Written from the paper's description (§3.2 linearized attention, §3.3 causal masking, and the
// CPU causal product of its fast-transformers library as the paper describes it) and from the
// structure of its PyTorch modules; no code was taken from fast-transformers. What is reproduced is the *algorithm and
// its memory traffic*, not PyTorch's dispatch overheads:
//
//   - Layout: PyTorch's (N, L, H, E) tensors permuted to (N, H, L, E), i.e. per head a
//     row-major L×E block: [H, N, D] row-major here (one batch element).
//   - φ = elu + 1 as the module computes it: elu(x) (x > 0 ? x : eˣ − 1) into a new tensor,
//     then + 1 into another (two elementwise passes over memory, vectorised like PyTorch's
//     kernels: Eigen's packet exp; elu(x) = max(x, 0) + min(eˣ − 1, 0) is branch-free).
//   - Causal (CausalLinearAttention + causal_product_cpu): the normaliser is the cumulative
//     sum of φ(K) over the sequence (a full [H, N, D] tensor), then one dot product per token,
//     Z = 1 / (φ(q_i)·Σ_{j≤i} φ(k_j) + eps); the numerator is, for each (head, token), the
//     rank-1 update S += φ(k_i) v_iᵀ and the read φ(q_i)ᵀ S, in plain loops over runtime
//     D and M (the compiler vectorises the loops over M); then out = num ⊙ Z.
//   - Non-causal (LinearAttention): KV = φ(K)ᵀ V, Z = 1 / (φ(Q)·Σ_j φ(k_j) + eps),
//     out = (φ(Q) KV) ⊙ Z, the einsums as Eigen GEMMs over the same row-major blocks.
//   - eps = 1e-6 (the module's default), added to the denominator (linattn clamps instead:
//     max(·, ε)); with φ > 0 the two agree to ~1e-6 relative.
//   - One thread (the CPU kernel parallelises over (batch, head) with OpenMP; the comparison
//     is made at one thread on both sides).
//
// Compiled with the same flags as the rest of the suite (benchmarks/CMakeLists.txt).
#pragma once

#include <Eigen/Core>

#include <cstddef>
#include <vector>

namespace paper_baseline {

using Index = Eigen::Index;

template <class T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// φ(x) = elu(x) + 1 over n contiguous values: the two elementwise passes of `elu(x) + 1`.
template <class T>
void elu_plus_one(const T* x, T* phi, Index n) {
  Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>> a(x, n);
  Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> p(phi, n);
  p = a.max(T(0)) + (a.exp() - T(1)).min(T(0));  // torch.nn.functional.elu
  p += T(1);                                      // + 1
}

// Buffers of one [H, N, D] problem (the tensors the PyTorch module allocates per call are
// allocated once here, so that the timing does not count allocation against the baseline).
template <class T>
struct Problem {
  Index H, N, D, M;
  std::vector<T> phi_q, phi_k, k_cumsum, z, num;
  Problem(Index heads, Index n, Index d, Index m)
      : H(heads),
        N(n),
        D(d),
        M(m),
        phi_q(std::size_t(heads * n * d)),
        phi_k(std::size_t(heads * n * d)),
        k_cumsum(std::size_t(heads * n * d)),
        z(std::size_t(heads * n)),
        num(std::size_t(heads * n * m)) {}
};

template <class T>
constexpr T eps() {
  return T(1e-6);
}

// Causal linear attention, the paper's CPU algorithm. q, k: [H, N, D]; v, out: [H, N, M].
template <class T>
void causal(Problem<T>& p, const T* q, const T* k, const T* v, T* out) {
  const Index H = p.H, N = p.N, D = p.D, M = p.M;
  elu_plus_one(q, p.phi_q.data(), H * N * D);
  elu_plus_one(k, p.phi_k.data(), H * N * D);

  // Normaliser: K.cumsum over the sequence, then a dot product per (head, token).
  for (Index h = 0; h < H; ++h) {
    const T* pk = p.phi_k.data() + h * N * D;
    T* kc = p.k_cumsum.data() + h * N * D;
    for (Index d = 0; d < D; ++d) kc[d] = pk[d];
    for (Index i = 1; i < N; ++i)
      for (Index d = 0; d < D; ++d) kc[i * D + d] = kc[(i - 1) * D + d] + pk[i * D + d];
  }
  for (Index h = 0; h < H; ++h)
    for (Index i = 0; i < N; ++i) {
      const T* pq = p.phi_q.data() + (h * N + i) * D;
      const T* kc = p.k_cumsum.data() + (h * N + i) * D;
      T dot = T(0);
      for (Index d = 0; d < D; ++d) dot += pq[d] * kc[d];
      p.z[std::size_t(h * N + i)] = T(1) / (dot + eps<T>());
    }

  // Numerator: the causal dot product, per head a D×M state updated and read per token.
  std::vector<T> S(std::size_t(D * M));
  for (Index h = 0; h < H; ++h) {
    for (auto& s : S) s = T(0);
    for (Index i = 0; i < N; ++i) {
      const T* pq = p.phi_q.data() + (h * N + i) * D;
      const T* pk = p.phi_k.data() + (h * N + i) * D;
      const T* vi = v + (h * N + i) * M;
      T* o = p.num.data() + (h * N + i) * M;
      for (Index d = 0; d < D; ++d)  // S += φ(k_i) v_iᵀ
        for (Index m = 0; m < M; ++m) S[std::size_t(d * M + m)] += pk[d] * vi[m];
      for (Index m = 0; m < M; ++m) o[m] = T(0);
      for (Index d = 0; d < D; ++d)  // o = φ(q_i)ᵀ S
        for (Index m = 0; m < M; ++m) o[m] += pq[d] * S[std::size_t(d * M + m)];
    }
  }

  // out = num ⊙ Z (broadcast over M).
  for (Index t = 0; t < H * N; ++t) {
    const T zt = p.z[std::size_t(t)];
    for (Index m = 0; m < M; ++m) out[t * M + m] = p.num[std::size_t(t * M + m)] * zt;
  }
}

// Non-causal linear attention, the paper's module: einsums as Eigen GEMMs per head over the
// row-major [H, N, D] blocks. q, k: [H, N, D] (L = N keys); v, out: [H, N, M].
template <class T>
void linear(Problem<T>& p, const T* q, const T* k, const T* v, T* out) {
  const Index H = p.H, N = p.N, D = p.D, M = p.M;
  elu_plus_one(q, p.phi_q.data(), H * N * D);
  elu_plus_one(k, p.phi_k.data(), H * N * D);
  RowMat<T> KV(D, M);
  Eigen::Matrix<T, 1, Eigen::Dynamic> ksum(D);
  for (Index h = 0; h < H; ++h) {
    Eigen::Map<const RowMat<T>> Qh(p.phi_q.data() + h * N * D, N, D);
    Eigen::Map<const RowMat<T>> Kh(p.phi_k.data() + h * N * D, N, D);
    Eigen::Map<const RowMat<T>> Vh(v + h * N * M, N, M);
    Eigen::Map<RowMat<T>> Oh(out + h * N * M, N, M);
    Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>> Zh(p.z.data() + h * N, N);
    KV.noalias() = Kh.transpose() * Vh;   // einsum("nshd,nshm->nhmd")
    ksum = Kh.colwise().sum();            // K.sum(dim=1)
    Zh.noalias() = Qh * ksum.transpose();  // einsum("nlhd,nhd->nlh")
    Zh = (Zh.array() + eps<T>()).inverse().matrix();
    Oh.noalias() = Qh * KV;  // einsum("nlhd,nhmd,nlh->nlhm"): the product, then ⊙ Z
    Oh.array().colwise() *= Zh.array();
  }
}

}  // namespace paper_baseline
