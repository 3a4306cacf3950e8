/// \file sequence_parallel_mpi.cpp
/// \brief One long sequence on many processes: causal linear attention with sequence
/// parallelism over MPI ranks (the pattern of LASP, Sun et al. 2024, "Linear Attention
/// Sequence Parallelism").
///
/// The state of causal linear attention after a prefix is a sum over the prefix's keys
/// (docs/SPEC.md §8), so ranks holding consecutive shards of one sequence need each other only
/// through states, never through each other's rows:
///
///   1. rank r summarises its shard:   local = linattn::summarize(K_r, V_r, phi);
///   2. one MPI_Exscan whose reduction is linattn::combine gives rank r the state of everything
///      before its shard, local_0 ⊕ … ⊕ local_{r−1} (rank 0: the empty state);
///   3. rank r continues from it:      out_r = linattn::causal_linear_attention(Q_r, K_r, V_r,
///                                                                      phi, carried);
///
/// and out_r are rows of the one-process result, to rounding.
///
/// Cost: each rank reads its shard twice (the key pass of step 1 and the causal pass of step 3),
/// O((N/P)·F·M) each; the only communication is one state record per rank in one collective,
/// 2·F·M + 2·F scalars (S and z with their compensated low parts; F more for SoftmaxSplit's
/// maxima) and a 4-scalar header, whatever N: 8324 floats (33,296 bytes) for F = M = 64. MPI
/// moves it in O(log P) steps.
///
/// The reduction is passed to MPI_Op_create as non-commutative. combine is a sum, but its
/// roundings depend on which partial states meet in which order; a commutative op would let MPI
/// pair them as messages happen to arrive. In rank order, a run gives the same bits every time
/// for a given MPI and rank count.
///
/// Run:
///
///   mpirun -np 4 ./sequence_parallel_mpi                   both maps, N = 65539, D = M = 64
///   mpirun -np 4 ./sequence_parallel_mpi --map elu --n 1000001
///   ./sequence_parallel_mpi --smoke                        one rank, N = 1001, D = M = 16
///
/// A long shard is also split over the rank's OpenMP threads (ParallelOptions): give each rank
/// its share of the cores, e.g. `mpirun -np 4 -x OMP_NUM_THREADS=2` on 8 cores.
///
/// Options: --map elu|softmax_split|all (default all), --n N (any N ≥ 1, also fewer rows than
/// ranks: ranks without rows pass the empty state on), --smoke (small sizes).
///
/// Every rank generates only its own rows (a counter-based generator gives row i the same
/// values on every rank); rank 0 also generates the whole sequence, gathers the shards'
/// outputs and compares them with the one-process causal_linear_attention, in double and in
/// float, and for SoftmaxSplit also with keys of magnitude 50 (per-feature maxima far apart
/// between shards). The exit status is nonzero if any error exceeds its tolerance.
#include <mpi.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <linattn/linattn.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using linattn::Index;
template <class Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class Scalar>
using State = linattn::LinearAttentionState<Scalar>;

template <class Scalar>
MPI_Datatype mpi_scalar();
template <>
MPI_Datatype mpi_scalar<float>() {
  return MPI_FLOAT;
}
template <>
MPI_Datatype mpi_scalar<double>() {
  return MPI_DOUBLE;
}

// ---------------------------------------------------------------------------------------------
// A state as one flat record of scalars, so that one MPI datatype carries it whole:
//   [identity, F, M, has maxima] S (F x M, row-major) S_lo (F x M) z (F) z_lo (F) m (F or none)
// "identity" marks the empty state: what rank 0 gets from the scan, and the summary of a shard
// without rows. A record of scalars rather than bytes lets MPI convert between machines of
// different byte orders; F and M are exact in float up to 2^24.
// ---------------------------------------------------------------------------------------------
constexpr Index kHeader = 4;

Index record_size(Index F, Index M, bool maxima) {
  return kHeader + 2 * F * M + 2 * F + (maxima ? F : 0);
}

template <class Scalar>
void flatten(const State<Scalar>& st, Scalar* rec, Index size) {
  std::fill(rec, rec + size, Scalar(0));
  if (st.empty()) {
    rec[0] = 1;
    return;
  }
  const Index F = st.S.rows(), M = st.S.cols();
  const bool maxima = st.m.size() > 0;
  if (record_size(F, M, maxima) != size)
    throw std::logic_error("flatten: the record does not fit the state");
  rec[1] = Scalar(F);
  rec[2] = Scalar(M);
  rec[3] = maxima ? 1 : 0;
  Scalar* p = rec + kHeader;
  const auto put = [&p](const auto& x, Index n) {  // an empty low part stands for zeros
    if (x.size() > 0) std::copy(x.data(), x.data() + n, p);
    p += n;
  };
  put(st.S, F * M);
  put(st.S_lo, F * M);
  put(st.z, F);
  put(st.z_lo, F);
  if (maxima) put(st.m, F);
}

template <class Scalar>
State<Scalar> unflatten(const Scalar* rec) {
  if (rec[0] != 0) return {};
  const Index F = static_cast<Index>(rec[1]), M = static_cast<Index>(rec[2]);
  State<Scalar> st(F, M, /*per_feature=*/rec[3] != 0);
  const Scalar* p = rec + kHeader;
  const auto get = [&p](auto& x) {
    std::copy(p, p + x.size(), x.data());
    p += x.size();
  };
  get(st.S);
  get(st.S_lo);
  get(st.z);
  get(st.z_lo);
  get(st.m);  // empty without maxima
  return st;
}

// The scan's reduction. MPI computes inout = in ∘ inout with `in` from the lower ranks, i.e.
// the earlier part of the sequence: exactly combine_into(earlier, later). The record's length
// comes from the datatype, the shapes from its header. Exceptions must not unwind through MPI.
template <class Scalar>
void combine_records(void* in, void* inout, int* len, MPI_Datatype* type) {
  try {
    int bytes = 0;
    MPI_Type_size(*type, &bytes);
    const Index size = bytes / static_cast<Index>(sizeof(Scalar));
    const Scalar* a = static_cast<const Scalar*>(in);
    Scalar* b = static_cast<Scalar*>(inout);
    for (int i = 0; i < *len; ++i, a += size, b += size) {
      State<Scalar> earlier = unflatten(a);
      linattn::combine_into(earlier, unflatten(b));
      flatten(earlier, b, size);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "combine_records: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
}

// ---------------------------------------------------------------------------------------------
// The sequence: rows [first, first + rows) of each rank, and their inputs.
// ---------------------------------------------------------------------------------------------
struct Shard {
  Index first, rows;
};

// Contiguous shards, the first N mod P ranks one row longer.
Shard shard_of(Index N, int ranks, int rank) {
  const Index base = N / ranks, extra = N % ranks;
  return {rank * base + std::min<Index>(rank, extra), base + (rank < extra ? 1 : 0)};
}

// Uniform in [-1, 1) from (stream, row, column) alone (splitmix64): any rank can generate any
// row of the sequence without the others.
double uniform(std::uint64_t stream, Index row, Index col) {
  std::uint64_t x = stream * 0x9E3779B97F4A7C15ull +
                    static_cast<std::uint64_t>(row) * 0xBF58476D1CE4E5B9ull +
                    static_cast<std::uint64_t>(col) * 0x94D049BB133111EBull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<double>(x >> 11) * 0x1.0p-52 - 1.0;
}

template <class Scalar>
RowMatrix<Scalar> make_rows(std::uint64_t stream, Index first, Index rows, Index cols,
                            double magnitude) {
  RowMatrix<Scalar> x(rows, cols);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j)
      x(i, j) = static_cast<Scalar>(magnitude * uniform(stream, first + i, j));
  return x;
}

struct Case {
  Index N, D, M;
  double key_magnitude;  // queries and values are within ±3
  double tolerance;      // on the largest error relative to the largest output
};

// ---------------------------------------------------------------------------------------------
// One run of the pattern; returns whether rank 0 found the outputs within tolerance (on every
// rank).
// ---------------------------------------------------------------------------------------------
template <class Scalar, class Phi>
bool run(const Phi& phi, const char* map_name, const char* scalar_name, const Case& c) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const Shard mine = shard_of(c.N, ranks, rank);

  const auto Q = make_rows<Scalar>(1, mine.first, mine.rows, c.D, 3.0);
  const auto K = make_rows<Scalar>(2, mine.first, mine.rows, c.D, c.key_magnitude);
  const auto V = make_rows<Scalar>(3, mine.first, mine.rows, c.M, 3.0);

  // 1. This shard's state (empty = the identity, if the shard has no rows).
  const State<Scalar> local = mine.rows > 0 ? linattn::summarize(K, V, phi) : State<Scalar>{};

  // 2. The state of all earlier shards: one exclusive scan of one record per rank.
  const Index F = phi.feature_dim(c.D);
  const Index size = record_size(F, c.M, linattn::normalizes_keys_per_feature_v<Phi>);
  MPI_Datatype record;
  MPI_Type_contiguous(static_cast<int>(size), mpi_scalar<Scalar>(), &record);
  MPI_Type_commit(&record);
  MPI_Op combine_op;
  MPI_Op_create(&combine_records<Scalar>, /*commute=*/0, &combine_op);
  std::vector<Scalar> send(size), recv(size);
  flatten(local, send.data(), size);
  MPI_Exscan(send.data(), recv.data(), 1, record, combine_op, MPI_COMM_WORLD);
  MPI_Op_free(&combine_op);
  MPI_Type_free(&record);
  // MPI leaves rank 0's result undefined: nothing comes before the first shard.
  State<Scalar> carried = rank == 0 ? State<Scalar>{} : unflatten(recv.data());

  // 3. This shard's outputs, continuing from the earlier shards' state.
  const RowMatrix<Scalar> out = linattn::causal_linear_attention(Q, K, V, phi, carried);

  // The check: gather the outputs on rank 0 and compare with one process doing it all.
  std::vector<int> counts(ranks), displs(ranks);
  for (int r = 0; r < ranks; ++r) {
    const Shard s = shard_of(c.N, ranks, r);
    counts[r] = static_cast<int>(s.rows * c.M);
    displs[r] = static_cast<int>(s.first * c.M);
  }
  RowMatrix<Scalar> gathered(rank == 0 ? c.N : 0, c.M);
  MPI_Gatherv(out.data(), counts[rank], mpi_scalar<Scalar>(), gathered.data(), counts.data(),
              displs.data(), mpi_scalar<Scalar>(), 0, MPI_COMM_WORLD);

  int pass = 1;
  if (rank == 0) {
    const auto Qa = make_rows<Scalar>(1, 0, c.N, c.D, 3.0);
    const auto Ka = make_rows<Scalar>(2, 0, c.N, c.D, c.key_magnitude);
    const auto Va = make_rows<Scalar>(3, 0, c.N, c.M, 3.0);
    const RowMatrix<Scalar> reference = linattn::causal_linear_attention(Qa, Ka, Va, phi);
    const double err = static_cast<double>((gathered - reference).cwiseAbs().maxCoeff());
    const double scale = static_cast<double>(reference.cwiseAbs().maxCoeff());
    const double rel = scale > 0 ? err / scale : err;
    pass = std::isfinite(rel) && rel <= c.tolerance;
    std::printf("%-13s %-6s keys ±%-3g  max abs error %.3e  relative %.3e  (tolerance %.0e)  %s\n",
                map_name, scalar_name, c.key_magnitude, err, rel, c.tolerance,
                pass ? "PASS" : "FAIL");
  }
  MPI_Bcast(&pass, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return pass != 0;
}

// Tolerances: about 6 times the largest relative error measured on 2-8 ranks with N from 3 to
// 1000003 (double 3.1e-16, float 1.7e-7; the largest at the smallest N): the shards' states
// are the same sums as the one-process state, added in another order, each entry to within
// one rounding of the compensated sums.
template <class Phi>
bool run_map(const Phi& phi, const char* name, Index N, Index D, Index M, bool large_keys) {
  bool ok = true;
  ok &= run<double>(phi, name, "double", {N, D, M, 3.0, 2e-15});
  ok &= run<float>(phi, name, "float", {N, D, M, 3.0, 1e-6});
  if (large_keys) {
    ok &= run<double>(phi, name, "double", {N, D, M, 50.0, 2e-15});
    ok &= run<float>(phi, name, "float", {N, D, M, 50.0, 1e-6});
  }
  return ok;
}

int usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--map elu|softmax_split|all] [--n N] [--smoke]\n", argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);

  bool smoke = false;
  std::string map = "all";
  long long n_arg = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--smoke") == 0) {
      smoke = true;
    } else if (std::strcmp(argv[i], "--map") == 0 && i + 1 < argc) {
      map = argv[++i];
    } else if (std::strcmp(argv[i], "--n") == 0 && i + 1 < argc) {
      n_arg = std::atoll(argv[++i]);
      if (n_arg < 1) n_arg = -1;
    } else {
      n_arg = -1;
    }
  }
  if (n_arg < 0 || (map != "elu" && map != "softmax_split" && map != "all")) {
    const int code = rank == 0 ? usage(argv[0]) : 2;
    MPI_Finalize();
    return code;
  }
  const Index N = n_arg > 0 ? static_cast<Index>(n_arg) : (smoke ? 1001 : 65539);
  const Index D = smoke ? 16 : 64, M = D;

  if (rank == 0) {
    std::printf("sequence_parallel_mpi: %d rank%s, N = %ld, D = M = %ld; shard rows:", ranks,
                ranks == 1 ? "" : "s", static_cast<long>(N), static_cast<long>(D));
    for (int r = 0; r < ranks; ++r)
      std::printf(" %ld", static_cast<long>(shard_of(N, ranks, r).rows));
    std::printf(
        "\nscanned per rank, whatever N: one state record of %ld scalars (%ld bytes in "
        "float, %ld in double; SoftmaxSplit %ld more for its maxima)\n",
        static_cast<long>(record_size(D, M, false)),
        static_cast<long>(record_size(D, M, false) * 4),
        static_cast<long>(record_size(D, M, false) * 8), static_cast<long>(D));
  }

  bool ok = true;
  try {
    if (map == "elu" || map == "all")
      ok &= run_map(linattn::EluPlusOne{}, "EluPlusOne", N, D, M, false);
    if (map == "softmax_split" || map == "all")
      ok &= run_map(linattn::SoftmaxSplit{}, "SoftmaxSplit", N, D, M, true);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  if (rank == 0) std::printf("%s\n", ok ? "PASS" : "FAIL");
  MPI_Finalize();
  return ok ? 0 : 1;
}
