// The pieces the translation units of the extension module share: numpy arrays as Eigen maps,
// the feature maps by name, sequence offsets (cu_seqlens) and the functions each unit registers.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // std::optional arguments (cu_seqlens or None)

#include <Eigen/Core>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <linattn/common.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linattn_python {

namespace py = pybind11;
using linattn::Index;

// linattn's thread count, for every Python thread and every kernel call. OpenMP's thread count
// is a setting of each OS thread (omp_set_num_threads changes the calling thread's), shared by
// every library of the process on the same OpenMP runtime: torch sets it when it is imported
// (and with torch.set_num_threads), a thread Python starts begins from OMP_NUM_THREADS or all
// cores. So linattn keeps its own count, applies it on the thread that runs a kernel for the
// call only and restores the thread's previous setting afterwards: another library's setting
// does not change linattn's, and linattn's does not change theirs. Without a count per thread
// two Python threads each running a kernel would each open a team of all cores (measured:
// 1.54x instead of 1.74x for two causal forwards on two cores).
inline std::atomic<int>& thread_count() {
  static std::atomic<int> n{0};
  return n;
}

// The default when set_num_threads was never called, fixed when the module is imported and
// independent of whatever else has changed OpenMP's setting by then: the first entry of
// OMP_NUM_THREADS when it is a positive number, else every processor OpenMP may use.
inline int default_thread_count() {
#ifdef _OPENMP
  if (const char* env = std::getenv("OMP_NUM_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && n > 0 && n <= 1 << 16 && (*end == '\0' || *end == ',')) return int(n);
  }
  return std::max(1, omp_get_num_procs());
#else
  return 1;
#endif
}

// Around every kernel call: the GIL released (other Python threads run meanwhile) and linattn's
// thread count applied on the thread that runs the kernel, the thread's own restored after.
class Unlocked {
 public:
  Unlocked() {
#ifdef _OPENMP
    previous_ = omp_get_max_threads();
    const int n = thread_count().load(std::memory_order_relaxed);
    if (n > 0 && n != previous_) omp_set_num_threads(n);
#endif
  }
  ~Unlocked() {
#ifdef _OPENMP
    if (omp_get_max_threads() != previous_) omp_set_num_threads(previous_);
#endif
  }
  Unlocked(const Unlocked&) = delete;
  Unlocked& operator=(const Unlocked&) = delete;

 private:
  py::gil_scoped_release release_;
  int previous_ = 1;
};

template <class Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class Scalar>
using ConstRows = Eigen::Map<const RowMatrix<Scalar>>;
template <class Scalar>
using Rows = Eigen::Map<RowMatrix<Scalar>>;
// C-contiguous arrays of one scalar type: the Python layer (linattn/__init__.py) checks dtypes
// and makes the copies, so that every conversion cost is visible there.
template <class Scalar>
using Array = py::array_t<Scalar, py::array::c_style>;
using Offsets = py::array_t<std::int64_t, py::array::c_style>;
// A key padding mask as the library takes it: one bool per packed key row, true = the key takes
// part (the Python layer inverts PyTorch's key_padding_mask, where true marks padding).
using KeyMask = py::array_t<bool, py::array::c_style>;
using MaskMap = Eigen::Map<const Eigen::Array<bool, Eigen::Dynamic, 1>>;

inline MaskMap mask_of(const KeyMask& m) { return MaskMap(m.data(), m.size()); }

// A 2-D array (N x H·D, the packed row-major layout) as a read-only Eigen map; anything else is
// a caller error the Python layer never makes.
template <class Scalar>
ConstRows<Scalar> rows_of(const char* fn, const char* name, const Array<Scalar>& a) {
  if (a.ndim() != 2)
    throw std::invalid_argument(std::string(fn) + ": " + name + " must be 2-D, got " +
                                std::to_string(a.ndim()) + " dimensions");
  return ConstRows<Scalar>(a.data(), a.shape(0), a.shape(1));
}

template <class Scalar>
Array<Scalar> new_rows(Index rows, Index cols) {
  return Array<Scalar>({static_cast<py::ssize_t>(rows), static_cast<py::ssize_t>(cols)});
}

template <class Scalar>
Rows<Scalar> rows_of(Array<Scalar>& a) {
  return Rows<Scalar>(a.mutable_data(), a.shape(0), a.shape(1));
}

// cu_seqlens as the library's offsets: B + 1 non-decreasing entries from 0 to `rows`. Checked
// here (not only in the kernels) because the per-sequence loops slice rows with them.
inline std::vector<Index> offsets_of(const char* fn, const Offsets& cu, Index rows) {
  if (cu.ndim() != 1 || cu.shape(0) < 2)
    throw std::invalid_argument(std::string(fn) +
                                ": cu_seqlens must be a 1-D array of at least 2 entries");
  std::vector<Index> out(static_cast<std::size_t>(cu.shape(0)));
  for (py::ssize_t i = 0; i < cu.shape(0); ++i) out[static_cast<std::size_t>(i)] = cu.at(i);
  if (out.front() != 0 || out.back() != rows)
    throw std::invalid_argument(std::string(fn) + ": cu_seqlens must run from 0 to " +
                                std::to_string(rows) + " (the packed rows), got " +
                                std::to_string(out.front()) + " ... " +
                                std::to_string(out.back()));
  for (std::size_t i = 1; i < out.size(); ++i)
    if (out[i] < out[i - 1])
      throw std::invalid_argument(std::string(fn) + ": cu_seqlens must be non-decreasing, got " +
                                  std::to_string(out[i - 1]) + " then " +
                                  std::to_string(out[i]) + " at entry " + std::to_string(i));
  return out;
}

// The operands of one call: q, k, v (and dout) as maps, the sequences' offsets (none: one
// sequence of all rows) and, for a backward, the gradients' arrays.
template <class Scalar>
struct Operands {
  const char* fn;
  ConstRows<Scalar> Q, K, V;
  std::vector<Index> q_offsets, k_offsets;

  Operands(const char* function, const Array<Scalar>& q, const Array<Scalar>& k,
           const Array<Scalar>& v, const std::optional<Offsets>& qo,
           const std::optional<Offsets>& ko)
      : fn(function),
        Q(rows_of(function, "q", q)),
        K(rows_of(function, "k", k)),
        V(rows_of(function, "v", v)),
        q_offsets(qo ? offsets_of(function, *qo, Q.rows()) : std::vector<Index>{0, Q.rows()}),
        k_offsets(ko ? offsets_of(function, *ko, K.rows()) : std::vector<Index>{0, K.rows()}) {
    // Before any sequence's rows are sliced: the kernels check each slice, not the whole.
    if (V.rows() != K.rows())
      throw std::invalid_argument(std::string(fn) + ": k has " + std::to_string(K.rows()) +
                                  " rows but v has " + std::to_string(V.rows()));
    if (q_offsets.size() != k_offsets.size())
      throw std::invalid_argument(std::string(fn) + ": q has " +
                                  std::to_string(q_offsets.size() - 1) + " sequences but k has " +
                                  std::to_string(k_offsets.size() - 1));
  }

  // f(q0, n, k0, l) for each sequence: its rows [q0, q0 + n) of q and [k0, k0 + l) of k and v.
  template <class F>
  void each_sequence(F&& f) const {
    for (std::size_t b = 0; b + 1 < q_offsets.size(); ++b)
      f(q_offsets[b], q_offsets[b + 1] - q_offsets[b], k_offsets[b],
        k_offsets[b + 1] - k_offsets[b]);
  }

  ConstRows<Scalar> dout(const Array<Scalar>& g) const {
    auto G = rows_of(fn, "dout", g);
    if (G.rows() != Q.rows() || G.cols() != V.cols())
      throw std::invalid_argument(std::string(fn) + ": dout is " + std::to_string(G.rows()) +
                                  "x" + std::to_string(G.cols()) + " but must be " +
                                  std::to_string(Q.rows()) + "x" + std::to_string(V.cols()) +
                                  " (the output's shape)");
    return G;
  }
};

// dq, dk, dv: new arrays of the shapes of q, k and v.
template <class Scalar>
struct Gradients {
  Array<Scalar> dq, dk, dv;
  Rows<Scalar> dQ, dK, dV;

  explicit Gradients(const Operands<Scalar>& x)
      : dq(new_rows<Scalar>(x.Q.rows(), x.Q.cols())),
        dk(new_rows<Scalar>(x.K.rows(), x.K.cols())),
        dv(new_rows<Scalar>(x.V.rows(), x.V.cols())),
        dQ(rows_of(dq)),
        dK(rows_of(dk)),
        dV(rows_of(dv)) {}

  py::tuple tuple() const { return py::make_tuple(dq, dk, dv); }
};

void register_linear_f32(py::module_& m);
void register_linear_f64(py::module_& m);
void register_softmax(py::module_& m);
void register_gated_delta_f32(py::module_& m);
void register_gated_delta_f64(py::module_& m);
void register_recurrent_f32(py::module_& m);
void register_recurrent_f64(py::module_& m);

}  // namespace linattn_python
