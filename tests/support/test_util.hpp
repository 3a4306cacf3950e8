// Shared helpers of the linattn tests: seeded random matrices, per-scalar tolerances, error
// measures and the list of shapes every kernel is checked on.
#pragma once

#include <Eigen/Core>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <ostream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// The scalar types of the per-scalar checks: LINATTN_TEST_SCALARS in tests/CMakeLists.txt, both
// unless a build leaves one out (.ci/test compiles double in its portable stage and float in its
// native sanitizer stage). A check written once per scalar type is compiled and run only in the
// builds of its type:
//   - the typed suites (the feature-map conformance suite, the state-I/O suites) run over
//     test::TypedScalars;
//   - a helper called once per type is called as IF_FLOAT(check<float>(...)) and
//     IF_DOUBLE(check<double>(...)), and its report of the error it measured likewise.
// A test whose checks are all of the other type then runs nothing in that build; the check runs
// in the other stage. Leaving one type's helper calls out saves 4-10% of a group's compile
// (tests/CMakeLists.txt); with the typed suites and the double-only kernel section of
// test_feature_maps.cpp, the sanitizer stage's compile CPU fell by 22%.
#if !defined(LINATTN_TEST_FLOAT) && !defined(LINATTN_TEST_DOUBLE)
#define LINATTN_TEST_FLOAT
#define LINATTN_TEST_DOUBLE
#endif

#ifdef LINATTN_TEST_FLOAT
#define IF_FLOAT(...) __VA_ARGS__
#else
#define IF_FLOAT(...) static_cast<void>(0)
#endif
#ifdef LINATTN_TEST_DOUBLE
#define IF_DOUBLE(...) __VA_ARGS__
#else
#define IF_DOUBLE(...) static_cast<void>(0)
#endif

namespace test {

#if defined(LINATTN_TEST_FLOAT) && defined(LINATTN_TEST_DOUBLE)
using TypedScalars = ::testing::Types<float, double>;
#elif defined(LINATTN_TEST_FLOAT)
using TypedScalars = ::testing::Types<float>;
#else
using TypedScalars = ::testing::Types<double>;
#endif

using Index = Eigen::Index;
template <class S>
using Mat = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic>;
template <class S>
using RowMat = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatD = Mat<double>;

// ---------------------------------------------------------------------------------------------
// Random inputs. Always std::mt19937 with an explicit seed (never Eigen's Random, whose state
// is global and whose sequence is not specified), drawn in double and rounded to S, so a float
// and a double run of the same test see the same numbers up to float rounding.
// ---------------------------------------------------------------------------------------------

/// rows x cols, uniform in [lo, hi], column by column.
template <class S = double>
Mat<S> random_matrix(Index rows, Index cols, std::uint32_t seed, double lo = -1.0,
                     double hi = 1.0) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  Mat<S> m(rows, cols);
  for (Index c = 0; c < cols; ++c)
    for (Index r = 0; r < rows; ++r) m(r, c) = static_cast<S>(dist(gen));
  return m;
}

/// rows x cols, standard normal.
template <class S = double>
Mat<S> gaussian_matrix(Index rows, Index cols, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  Mat<S> m(rows, cols);
  for (Index c = 0; c < cols; ++c)
    for (Index r = 0; r < rows; ++r) m(r, c) = static_cast<S>(dist(gen));
  return m;
}

/// rows x cols of integers uniform in [lo, hi] (exactly representable in float and double).
template <class S = double>
Mat<S> random_integer_matrix(Index rows, Index cols, std::uint32_t seed, int lo, int hi) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dist(lo, hi);
  Mat<S> m(rows, cols);
  for (Index c = 0; c < cols; ++c)
    for (Index r = 0; r < rows; ++r) m(r, c) = static_cast<S>(dist(gen));
  return m;
}

/// A seed derived from a few integers (a shape and a salt), so that every shape of a list gets
/// its own, reproducible, inputs.
inline std::uint32_t seed_of(std::initializer_list<std::int64_t> parts) {
  std::uint64_t h = 0x9E3779B97F4A7C15ull;
  for (const std::int64_t p : parts) {
    h ^= static_cast<std::uint64_t>(p) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  return static_cast<std::uint32_t>(h ^ (h >> 32));
}

// ---------------------------------------------------------------------------------------------
// Tolerances and errors
// ---------------------------------------------------------------------------------------------

/// Relative tolerance of a kernel result against the double reference, per scalar type.
template <class S>
struct Tol;
template <>
struct Tol<float> {
  static constexpr double rel = 1e-4;
  /// A few ulps, for results that should agree up to vectorisation differences.
  static constexpr double ulps = 8 * 1.1920929e-7;
};
template <>
struct Tol<double> {
  static constexpr double rel = 1e-10;
  static constexpr double ulps = 8 * 2.220446049250313e-16;
};

/// The tolerance for an attention output whose values have magnitude up to `scale` (max |V|):
/// attention outputs are (near-)convex combinations of value rows, so their error scales with V.
/// Loose (1e-4 in float, ~100x the usual error): new tests use test::bound with measured
/// figures instead.
template <class S>
double tolerance(double scale) {
  return Tol<S>::rel * std::max(1.0, scale);
}

/// A bound set from a measured error: `f` in float, `d` in double (a few times the error the
/// test reports through report_error), times max(1, scale) (scale = max |V| for attention
/// outputs, which are near-convex combinations of value rows).
template <class S>
double bound(double f, double d, double scale = 1.0) {
  return (sizeof(S) == sizeof(float) ? f : d) * std::max(1.0, scale);
}

// ---------------------------------------------------------------------------------------------
// Typed-suite boilerplate: run a check for every (map, scalar) pair.
// ---------------------------------------------------------------------------------------------

template <class S>
struct ScalarTag {
  using type = S;
};

/// Calls f(Map{}, ScalarTag<S>{}) for every Map of the list and S in the build's scalar types
/// (float, double, or both: LINATTN_TEST_SCALARS):
///   test::for_each_map_scalar<EluPlusOne, SoftmaxSplit>([](auto phi, auto s) {
///     check<typename decltype(s)::type>(phi);
///   });
template <class... Maps, class F>
void for_each_map_scalar([[maybe_unused]] F&& f) {
  IF_FLOAT((f(Maps{}, ScalarTag<float>{}), ...));
  IF_DOUBLE((f(Maps{}, ScalarTag<double>{}), ...));
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Expects f() to throw std::invalid_argument whose message contains every needle.
template <class F>
void expect_invalid(F&& f, const std::vector<std::string>& needles, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": no exception";
  } catch (const std::invalid_argument& e) {
    for (const std::string& needle : needles)
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
          << what << ": message \"" << e.what() << "\" lacks \"" << needle << "\"";
  } catch (...) {
    ADD_FAILURE() << what << ": not std::invalid_argument";
  }
}
template <class F>
void expect_invalid(F&& f, const std::string& needle, const std::string& what) {
  expect_invalid(std::forward<F>(f), std::vector<std::string>{needle}, what);
}

// The error helpers are plain functions over Eigen::Ref (an expression argument is evaluated
// into a temporary): templates over every expression type would multiply the compile time of
// the typed suites.
using CRefF = Eigen::Ref<const Mat<float>>;
using CRefD = Eigen::Ref<const Mat<double>>;

namespace detail {
template <class A, class B>
double max_abs_diff_impl(const A& a, const B& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return std::numeric_limits<double>::infinity();
  double m = 0;
  for (Index c = 0; c < a.cols(); ++c) {
    for (Index r = 0; r < a.rows(); ++r) {
      const double x = static_cast<double>(a(r, c)), y = static_cast<double>(b(r, c));
      if (!std::isfinite(x) || !std::isfinite(y)) {
        if (!(x == y)) return std::numeric_limits<double>::infinity();
        continue;
      }
      m = std::max(m, std::abs(x - y));
    }
  }
  return m;
}
template <class A>
double max_abs_impl(const A& a) {
  double m = 0;
  for (Index c = 0; c < a.cols(); ++c)
    for (Index r = 0; r < a.rows(); ++r) m = std::max(m, std::abs(static_cast<double>(a(r, c))));
  return m;
}
template <class A>
bool all_finite_impl(const A& a) {
  for (Index c = 0; c < a.cols(); ++c)
    for (Index r = 0; r < a.rows(); ++r)
      if (!std::isfinite(static_cast<double>(a(r, c)))) return false;
  return true;
}
}  // namespace detail

/// max |a - b| over all coefficients, in double. +inf when the shapes differ or when a
/// coefficient is NaN or infinite in one and not equal in the other, so that an
/// EXPECT_LE(max_abs_diff(...), tol) can never pass by accident on non-finite values.
inline double max_abs_diff(const CRefF& a, const CRefF& b) { return detail::max_abs_diff_impl(a, b); }
inline double max_abs_diff(const CRefD& a, const CRefD& b) { return detail::max_abs_diff_impl(a, b); }
inline double max_abs_diff(const CRefF& a, const CRefD& b) { return detail::max_abs_diff_impl(a, b); }
inline double max_abs_diff(const CRefD& a, const CRefF& b) { return detail::max_abs_diff_impl(a, b); }

/// Largest absolute coefficient, in double (0 for an empty matrix).
inline double max_abs(const CRefF& a) { return detail::max_abs_impl(a); }
inline double max_abs(const CRefD& a) { return detail::max_abs_impl(a); }

/// True when every coefficient is finite.
inline bool all_finite(const CRefF& a) { return detail::all_finite_impl(a); }
inline bool all_finite(const CRefD& a) { return detail::all_finite_impl(a); }

/// Compares an attention output with the double reference row by row, only on the rows whose
/// reference denominator Σ_j sim(q_i, k_j) is at least `min_den` (far above both guards ε).
/// Below it the output depends on rounding divided by ε (for instance NormalizedCosine when
/// every key is exactly opposite to the query, which is common when D = 1): those rows must
/// only be finite and no larger than max |V| (`v_bound`). Returns the max error over the
/// compared rows, or +inf when a skipped row is not finite or out of bounds.
struct RowComparison {
  double max_err = 0;
  Index compared = 0, skipped = 0;
  /// Accumulates another comparison (of another shape).
  RowComparison& operator+=(const RowComparison& o) {
    max_err = std::max(max_err, o.max_err);
    compared += o.compared;
    skipped += o.skipped;
    return *this;
  }
};

/// A row-skipping comparison means little when most rows are skipped: expects at least
/// `min_fraction` of the rows to have been compared (and at least one), and says how many were.
inline void expect_enough_rows(const RowComparison& rc, double min_fraction,
                               const std::string& what) {
  const Index total = rc.compared + rc.skipped;
  std::cout << "[ rows     ] " << what << ": " << rc.compared << " of " << total
            << " rows compared" << std::endl;
  EXPECT_GE(rc.compared, 1) << what << ": no row compared";
  EXPECT_GE(static_cast<double>(rc.compared), min_fraction * static_cast<double>(total))
      << what << ": only " << rc.compared << " of " << total << " rows compared";
}
template <class A>
RowComparison compare_well_conditioned_rows_impl(const A& out, const CRefD& expected,
                                                 const Eigen::VectorXd& den, double min_den,
                                                 double v_bound) {
  RowComparison rc;
  if (out.rows() != expected.rows() || out.cols() != expected.cols() || den.size() != out.rows()) {
    rc.max_err = std::numeric_limits<double>::infinity();
    return rc;
  }
  for (Index i = 0; i < out.rows(); ++i) {
    if (den(i) >= min_den) {
      ++rc.compared;
      rc.max_err = std::max(rc.max_err, max_abs_diff(out.row(i), expected.row(i)));
    } else {
      ++rc.skipped;
      if (!all_finite(out.row(i)) || max_abs(out.row(i)) > v_bound * (1 + 1e-3) + 1e-30)
        rc.max_err = std::numeric_limits<double>::infinity();
    }
  }
  return rc;
}
inline RowComparison compare_well_conditioned_rows(const CRefF& out, const CRefD& expected,
                                                   const Eigen::VectorXd& den, double min_den,
                                                   double v_bound) {
  return compare_well_conditioned_rows_impl(out, expected, den, min_den, v_bound);
}
inline RowComparison compare_well_conditioned_rows(const CRefD& out, const CRefD& expected,
                                                   const Eigen::VectorXd& den, double min_den,
                                                   double v_bound) {
  return compare_well_conditioned_rows_impl(out, expected, den, min_den, v_bound);
}

/// Prints a measured error so that it can be quoted from the test log, and records it as a
/// property of the running test (it then appears in --gtest_output=xml reports).
inline void report_error(const std::string& what, double err) {
  std::ostringstream os;
  os.precision(3);
  os << std::scientific << err;
  std::cout << "[ max err  ] " << what << " = " << os.str() << std::endl;
  ::testing::Test::RecordProperty(what, os.str());
}

template <class S>
constexpr const char* scalar_name() {
  return sizeof(S) == sizeof(float) ? "float" : "double";
}

// ---------------------------------------------------------------------------------------------
// Shapes. The kernels work in blocks of 256 rows (feature maps, linear attention) and in
// 256-query (128 in double) x 128-key tiles (softmax attention), so the sizes straddle 64,
// 128 and 256 and are mostly not multiples of them. D = 1, N = 1, L = 1, N != L and D != M all occur.
// ---------------------------------------------------------------------------------------------

struct Shape {
  Index N, L, D, M;
};

inline std::ostream& operator<<(std::ostream& os, const Shape& s) {
  return os << "N=" << s.N << " L=" << s.L << " D=" << s.D << " M=" << s.M;
}

/// Shapes for non-causal attention (N and L independent).
inline const std::vector<Shape>& shapes() {
  static const std::vector<Shape> list = {
      {1, 1, 1, 1},       {1, 1, 4, 3},     {1, 7, 3, 2},      {7, 1, 2, 5},
      {2, 2, 1, 1},       {7, 7, 1, 6},     {2, 65, 5, 1},     {63, 65, 8, 5},
      {65, 63, 5, 8},     {64, 64, 16, 16}, {255, 257, 16, 4}, {257, 255, 4, 16},
      {300, 300, 7, 9},   {256, 256, 24, 8}, {513, 65, 64, 32}, {65, 513, 32, 64},
      {1, 513, 64, 1},    {513, 1, 1, 64},  {300, 2, 3, 2},    {100, 100, 1, 1},
      {513, 257, 33, 17},
  };
  return list;
}

/// Shapes for causal attention (N == L).
inline const std::vector<Shape>& causal_shapes() {
  static const std::vector<Shape> list = {
      {1, 1, 1, 1},     {1, 1, 4, 3},     {2, 2, 1, 5},     {7, 7, 3, 2},
      {63, 63, 8, 5},   {64, 64, 5, 8},   {65, 65, 16, 16}, {255, 255, 16, 4},
      {257, 257, 4, 16}, {300, 300, 7, 9}, {513, 513, 33, 17}, {100, 100, 1, 1},
  };
  return list;
}

// ---------------------------------------------------------------------------------------------
// Bitwise comparisons, for the paths documented as bit for bit equal.
// ---------------------------------------------------------------------------------------------

/// Same shape and same bits (NaN payloads and signed zeros included); any layout.
template <class A, class B>
bool same_bits(const Eigen::DenseBase<A>& a, const Eigen::DenseBase<B>& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
  for (Index j = 0; j < a.cols(); ++j)
    for (Index i = 0; i < a.rows(); ++i) {
      const typename A::Scalar x = a.derived().coeff(i, j);
      const typename B::Scalar y = b.derived().coeff(i, j);
      if (std::memcmp(&x, &y, sizeof x) != 0) return false;
    }
  return true;
}

/// Every member of two linattn::LinearAttentionState objects, bit for bit.
template <class State>
bool same_state(const State& a, const State& b) {
  return same_bits(a.S, b.S) && same_bits(a.S_lo, b.S_lo) && same_bits(a.z, b.z) &&
         same_bits(a.z_lo, b.z_lo) && same_bits(a.m, b.m);
}

}  // namespace test
