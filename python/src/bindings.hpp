// The pieces the translation units of the extension module share: numpy arrays as Eigen maps,
// the feature maps by name, sequence offsets (cu_seqlens) and the functions each unit registers.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // std::optional arguments (cu_seqlens or None)

#include <Eigen/Core>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <linattn/common.hpp>

namespace linattn_python {

namespace py = pybind11;
using linattn::Index;

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

void register_linear_f32(py::module_& m);
void register_linear_f64(py::module_& m);
void register_softmax(py::module_& m);

}  // namespace linattn_python
