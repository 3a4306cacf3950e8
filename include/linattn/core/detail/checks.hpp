/// \file core/detail/checks.hpp
/// \brief Argument checks shared by every entry point (internal). A bad shape throws std::invalid_argument
/// whose message names the function and every operand's shape.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../common.hpp"
#include "../error.hpp"

namespace linattn::detail {

inline std::string shape_string(Index rows, Index cols) {
  return std::to_string(rows) + "x" + std::to_string(cols);
}

template <class Derived>
std::string shape_of(const Eigen::EigenBase<Derived>& m) {
  return shape_string(m.rows(), m.cols());
}

// A floating value in a message, in the fewest significant digits that read back as the same
// value of its type: "2.0000002" for the float next above 2 and "1e-30" for 1e-30 (six fixed
// decimals would show "2.000000" and "0.000000": values that pass the check they fail).
// The shortest %g precision that round-trips; bf16 and half go through float.
template <class T>
std::string value_string(T x) {
  using W =
      std::conditional_t<std::is_same_v<T, double> || std::is_same_v<T, long double>, T, float>;
  const W w = static_cast<W>(x);
  if (w != w) return "nan";
  if (w == std::numeric_limits<W>::infinity()) return "inf";
  if (w == -std::numeric_limits<W>::infinity()) return "-inf";
  char buf[64];
  for (int p = 1;; ++p) {
    if constexpr (std::is_same_v<W, long double>)
      std::snprintf(buf, sizeof buf, "%.*Lg", p, w);
    else
      std::snprintf(buf, sizeof buf, "%.*g", p, static_cast<double>(w));
    W back;
    if constexpr (std::is_same_v<W, float>)
      back = std::strtof(buf, nullptr);
    else if constexpr (std::is_same_v<W, double>)
      back = std::strtod(buf, nullptr);
    else
      back = std::strtold(buf, nullptr);
    if (static_cast<T>(back) == x || p >= std::numeric_limits<W>::max_digits10) return buf;
  }
}

// Out of line and cold: an error path then costs its caller a call, not the inlined string
// building of its message (which, repeated in every kernel instantiation, is compile time).
#if defined(__GNUC__)
#define LINATTN_DETAIL_COLD __attribute__((cold, noinline))
#elif defined(_MSC_VER)
#define LINATTN_DETAIL_COLD __declspec(noinline)
#else
#define LINATTN_DETAIL_COLD
#endif

// std::invalid_argument, or the error handler without exceptions (error.hpp).
[[noreturn]] LINATTN_DETAIL_COLD inline void throw_invalid(const char* function,
                                                           const std::string& what) {
  raise<std::invalid_argument>(std::string("linattn::") + function + ": " + what);
}

// One piece of an error message: text, or an integer written in decimal. The checks pass their
// message as pieces to throw_invalid_parts(), which joins them out of line.
struct MessagePart {
  const char* text = nullptr;
  std::size_t size = 0;
  long long number = 0;
  MessagePart(const char* s) : text(s), size(std::strlen(s)) {}
  MessagePart(const std::string& s) : text(s.data()), size(s.size()) {}
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  MessagePart(I n) : number(static_cast<long long>(n)) {}
};

// throw_invalid(function, the parts joined).
[[noreturn]] LINATTN_DETAIL_COLD inline void throw_invalid_parts(
    const char* function, std::initializer_list<MessagePart> parts) {
  std::string what;
  for (const MessagePart& p : parts) {
    if (p.text != nullptr)
      what.append(p.text, p.size);
    else
      what += std::to_string(p.number);
  }
  throw_invalid(function, what);
}

// The scalar types of Q, K and V must agree: mixing float and double would hide a conversion.
template <class DQ, class DK, class DV>
constexpr void static_check_scalars() {
  using S = typename DQ::Scalar;
  static_assert(std::is_same_v<S, typename DK::Scalar> && std::is_same_v<S, typename DV::Scalar>,
                "linattn: Q, K and V must have the same scalar type (cast one with .cast<T>())");
  static_assert(is_storage_scalar_v<S>,
                "linattn: the scalar type must be float, double, Eigen::bfloat16 or Eigen::half");
}

// Q is N x D, K is L x D, V is L x M; causal attention also needs N == L; D must be positive.
// On the shapes alone (compiled once, not per operand type), the message out of line.
inline void check_qkv_shapes(const char* function, Index qr, Index qc, Index kr, Index kc,
                             Index vr, Index vc, bool causal) {
  const char* what = nullptr;
  if (qc != kc)
    what = "Q and K must have the same number of columns D";
  else if (kr != vr)
    what = "K and V must have the same number of rows L";
  else if (causal && qr != kr)
    what = "causal attention needs as many queries as keys (N == L)";
  else if (qc == 0)
    what = "the key dimension D must be positive";
  if (what != nullptr)
    throw_invalid_parts(function, {what, " (Q is ", qr, "x", qc, ", K is ", kr, "x", kc,
                                   ", V is ", vr, "x", vc, ")"});
}

template <class DQ, class DK, class DV>
void check_qkv(const char* function, const Eigen::MatrixBase<DQ>& Q,
               const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V, bool causal) {
  static_check_scalars<DQ, DK, DV>();
  check_qkv_shapes(function, Q.rows(), Q.cols(), K.rows(), K.cols(), V.rows(), V.cols(), causal);
}

// The number of query/key heads a call's options state (key_heads; 0: as many as `heads`)
// for `heads` value heads: positive and dividing heads, so that value head h reads key head
// h / (heads / key_heads), as FLA and transformers share them (GVA: Qwen3-Next's 16 key
// heads for 32 value heads).
inline Index resolve_key_heads(const char* function, Index heads, Index key_heads) {
  if (key_heads == 0) return heads;
  if (key_heads < 0 || heads % key_heads != 0)
    throw_invalid(function, "key_heads = " + std::to_string(key_heads) +
                                " must be 0 (as many as heads) or a positive divisor of heads = " +
                                std::to_string(heads) + " (each key head serves heads / " +
                                "key_heads value heads)");
  return key_heads;
}

// The head sizes a caller stated (DeltaOptions / GatedOptions::key_dim, value_dim; 0: not
// stated) against the packed Q (N x Hk·D) and V (N x H·M) of Hk = key_heads query/key heads
// and H value heads; `params` names the operands that give H ("beta", "the log gates").
template <class DQ, class DV>
void check_head_dims(const char* function, const Eigen::MatrixBase<DQ>& Q,
                     const Eigen::MatrixBase<DV>& V, Index heads, Index key_heads, Index key_dim,
                     Index value_dim, const char* params) {
  if (key_dim == 0 && value_dim == 0) return;
  const auto shapes = [&] {
    return " (Q is " + shape_of(Q) + ", V is " + shape_of(V) + ", heads = " +
           std::to_string(heads) + ", key_heads = " + std::to_string(key_heads) +
           ", key_dim = " + std::to_string(key_dim) + ", value_dim = " +
           std::to_string(value_dim) + ")";
  };
  if (key_dim < 0 || value_dim < 0)
    throw_invalid(function, "key_dim and value_dim must be >= 0 (0: not stated)" + shapes());
  // "Q and K hold", key_dim over the key heads; "V holds", value_dim over the value heads.
  const auto held = [&](const char* what, Index cols, Index count, Index dim,
                        const char* dim_name) {
    if (dim == 0 || cols == count * dim) return;
    if (cols % dim == 0)
      throw_invalid(function, std::string(what) + " " + std::to_string(cols / dim) +
                                  " head(s) of " + dim_name + " = " + std::to_string(dim) +
                                  " but " + params + " and heads give H = " +
                                  std::to_string(heads) + " with key_heads = " +
                                  std::to_string(key_heads) +
                                  " query/key heads: for query/key heads shared by several "
                                  "value heads (GVA), set key_heads to their number" + shapes());
    throw_invalid(function, std::string(what) + " " + std::to_string(cols) + " columns, not " +
                                (count == heads ? "heads" : "key_heads") + " x " + dim_name +
                                " = " + std::to_string(count * dim) + shapes());
  };
  held("Q and K hold", Q.cols(), key_heads, key_dim, "key_dim");
  held("V holds", V.cols(), heads, value_dim, "value_dim");
}

inline void check_output_shape(const char* function, Index out_rows, Index out_cols, Index rows,
                               Index cols) {
  if (out_rows != rows || out_cols != cols)
    throw_invalid_parts(function, {"the output is ", out_rows, "x", out_cols, " but must be ",
                                   rows, "x", cols});
}

template <class DOut>
void check_output(const char* function, const Eigen::MatrixBase<DOut>& out, Index rows,
                  Index cols) {
  check_output_shape(function, out.rows(), out.cols(), rows, cols);
}

// Eigen's documented idiom for writing through an expression passed by const reference
// (a Block or Map of the caller's storage).
template <class Derived>
Derived& writable(const Eigen::MatrixBase<Derived>& out) {
  return const_cast<Eigen::MatrixBase<Derived>&>(out).derived();
}

template <class DMask>
void check_key_mask(const char* function, const Eigen::DenseBase<DMask>& mask, Index L) {
  static_assert(std::is_same_v<typename DMask::Scalar, bool>,
                "linattn: a key mask is a vector of bool (true = the key takes part)");
  if (mask.size() != L || (mask.rows() != 1 && mask.cols() != 1))
    throw_invalid(function, "the key mask is " + shape_of(mask) + " but must be a vector of " +
                                std::to_string(L) + " entries, one per key");
}


// ---------------------------------------------------------------------------------------------
// Overlap of an output with an input. Every kernel reads its inputs while it writes its
// output, in an order that differs between algorithms, so an output sharing memory with an
// input gives wrong results in some algorithms and right ones in others; the entry points
// reject it. The test is exact for strided 2-D views, because packed multi-head callers pass
// disjoint column blocks of one buffer that interleave in memory (row i of Q lies between
// rows i - 1 and i + 1 of `out`): an address-interval test would reject them.
// Only addresses as integers are compared (never pointers into different objects).
// ---------------------------------------------------------------------------------------------

// count elements `stride` bytes apart; count 1 has stride 0, and strides are never negative.
struct MemoryGenerator {
  std::int64_t stride = 0, count = 1;
};

// The bytes base + i·g[0].stride + j·g[1].stride + [0, width) for i < g[0].count, j < g[1].count.
struct MemoryRegion {
  std::uintptr_t base = 0;
  std::int64_t width = 1;
  MemoryGenerator g[2];
  bool known = false;  // false: an expression without memory of its own (cannot be checked)
  bool empty = true;
  std::int64_t extent() const { return g[0].stride * (g[0].count - 1) + g[1].stride * (g[1].count - 1) + width; }
};

// Builds the region of `count` elements `stride` bytes apart along each of two directions
// (strides may be negative, as in a Map with a negative Stride: the set of bytes is the same
// as with the opposite stride from the other end).
inline MemoryRegion make_memory_region(std::uintptr_t base, std::int64_t width,
                                       std::int64_t stride0, std::int64_t count0,
                                       std::int64_t stride1, std::int64_t count1) {
  MemoryRegion r;
  r.known = true;
  r.width = width;
  r.empty = count0 <= 0 || count1 <= 0;
  if (r.empty) return r;
  const std::int64_t strides[2] = {stride0, stride1}, counts[2] = {count0, count1};
  for (int k = 0; k < 2; ++k) {
    if (counts[k] == 1 || strides[k] == 0) continue;  // one address along this direction
    std::int64_t s = strides[k];
    if (s < 0) {
      s = -s;
      base -= static_cast<std::uintptr_t>(s * (counts[k] - 1));
    }
    r.g[k] = {s, counts[k]};
  }
  r.base = base;
  return r;
}

// The memory of an Eigen operand: its storage if it has direct access (a matrix, Block, Map,
// Ref, Transpose of one, ...), else an unknown region.
template <class Derived>
MemoryRegion memory_region(const Eigen::DenseBase<Derived>& x) {
  if constexpr ((int(Derived::Flags) & Eigen::DirectAccessBit) != 0) {
    const auto& d = x.derived();
    const std::int64_t w = sizeof(typename Derived::Scalar);
    return make_memory_region(reinterpret_cast<std::uintptr_t>(d.data()), w,
                              static_cast<std::int64_t>(d.innerStride()) * w,
                              static_cast<std::int64_t>(d.innerSize()),
                              static_cast<std::int64_t>(d.outerStride()) * w,
                              static_cast<std::int64_t>(d.outerSize()));
  } else {
    (void)x;
    return MemoryRegion{};
  }
}

namespace overlap {

using I64 = std::int64_t;

inline I64 floor_div(I64 a, I64 b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}
inline I64 ceil_div(I64 a, I64 b) { return -floor_div(-a, b); }
inline I64 mod(I64 a, I64 m) { return a - floor_div(a, m) * m; }
inline I64 gcd(I64 a, I64 b) {
  while (b != 0) {
    const I64 t = a % b;
    a = b;
    b = t;
  }
  return a;
}
// x·y mod m for 0 <= x, y < m, without overflow.
inline I64 mul_mod(I64 x, I64 y, I64 m) {
  if (m <= (I64(1) << 31)) return x * y % m;
  I64 r = 0;
  for (; y > 0; y >>= 1, x = (x + x) % m)
    if (y & 1) r = (r + x) % m;
  return r;
}
// The inverse of a modulo m (gcd(a, m) == 1, m > 1).
inline I64 inverse_mod(I64 a, I64 m) {
  I64 r0 = m, r1 = mod(a, m), s0 = 0, s1 = 1;
  while (r1 != 0) {
    const I64 q = r0 / r1, r2 = r0 - q * r1, s2 = s0 - q * s1;
    r0 = r1;
    r1 = r2;
    s0 = s1;
    s1 = s2;
  }
  return mod(s0, m);
}

// Is there i < a.count, k < c.count with i·a.stride − k·c.stride = t?
inline bool solve_pair(MemoryGenerator a, MemoryGenerator c, I64 t) {
  if (a.count == 1) a.stride = 0;
  if (c.count == 1) c.stride = 0;
  if (a.stride == 0 && c.stride == 0) return t == 0;
  if (a.stride == 0) return t <= 0 && (-t) % c.stride == 0 && (-t) / c.stride < c.count;
  if (c.stride == 0) return t >= 0 && t % a.stride == 0 && t / a.stride < a.count;
  const I64 g = gcd(a.stride, c.stride);
  if (t % g != 0) return false;
  const I64 ap = a.stride / g, cp = c.stride / g, tp = t / g;
  // k = (i·ap − tp) / cp in [0, c.count) bounds i; the congruence i·ap ≡ tp (mod cp) picks it.
  const I64 lo = std::max<I64>(0, ceil_div(tp, ap));
  const I64 hi = std::min<I64>(a.count - 1, floor_div(tp + (c.count - 1) * cp, ap));
  if (lo > hi) return false;
  if (cp == 1) return true;
  const I64 r = mul_mod(mod(tp, cp), inverse_mod(ap, cp), cp);
  return lo + mod(r - lo, cp) <= hi;
}

// A = d + {i·a} + {j·T : j < ma}, B = {k·c} + {l·T : l < mb} (i < a.count, k < c.count): is
// there a byte of A and a byte of B in common, i.e. d + i·a − k·c + (j − l)·T in [lo, hi]?
// Loops over the e = j − l whose row offsets can reach [lo, hi]: a few when T is the larger
// stride, as the caller arranges.
struct SharedStride {
  I64 T;
  MemoryGenerator a, c;
  I64 ma, mb;
  I64 xmin() const { return -(c.stride * (c.count - 1)); }
  I64 xmax() const { return a.stride * (a.count - 1); }
  I64 e_lo(I64 d, I64 lo) const { return std::max(-(mb - 1), ceil_div(lo - d - xmax(), T)); }
  I64 e_hi(I64 d, I64 hi) const { return std::min(ma - 1, floor_div(hi - d - xmin(), T)); }
  I64 cost(I64 d, I64 lo, I64 hi) const { return std::max<I64>(0, e_hi(d, hi) - e_lo(d, lo) + 1); }
  bool overlaps(I64 d, I64 lo, I64 hi) const {
    const I64 g = gcd(a.count > 1 ? a.stride : 0, c.count > 1 ? c.stride : 0);
    for (I64 e = e_lo(d, lo), e_end = e_hi(d, hi); e <= e_end; ++e) {
      const I64 t_lo = std::max(lo - d - e * T, xmin()), t_hi = std::min(hi - d - e * T, xmax());
      for (I64 t = g > 1 ? ceil_div(t_lo, g) * g : t_lo; t <= t_hi; t += std::max<I64>(g, 1))
        if (solve_pair(a, c, t)) return true;
    }
    return false;
  }
};

}  // namespace overlap

/// Exact: do two regions share a byte? False when either is empty or unknown. O(1) when the
/// regions share a stride (blocks of one matrix, vectors in one) or are far apart; otherwise
/// O(number of rows or columns in the overlapping address range).
inline bool regions_overlap(const MemoryRegion& A, const MemoryRegion& B) {
  using overlap::I64;
  if (!A.known || !B.known || A.empty || B.empty) return false;
  // Disjoint address ranges (the common case of separate buffers).
  if (A.base >= B.base ? A.base - B.base >= static_cast<std::uintptr_t>(B.extent())
                       : B.base - A.base >= static_cast<std::uintptr_t>(A.extent()))
    return false;
  const I64 d = A.base >= B.base ? static_cast<I64>(A.base - B.base)
                                 : -static_cast<I64>(B.base - A.base);
  // Byte x of A and byte y of B meet when (element start of A) − (element start of B) lies
  // in [lo, hi].
  const I64 lo = -(A.width - 1), hi = B.width - 1;
  // Each region is an inner direction plus an outer one (rows); try both assignments on each
  // side and run the cheapest: a shared outer stride T makes the search O(1); otherwise the
  // lines of one region are tried one by one against the other.
  double best = -1;
  overlap::SharedStride best_shared{};
  bool enumerate = false;
  int best_ia = 0, best_ib = 0;
  bool lines_of_a = true;
  for (int ia = 0; ia < 2; ++ia) {
    for (int ib = 0; ib < 2; ++ib) {
      const MemoryGenerator a_in = A.g[ia], a_out = A.g[1 - ia];
      const MemoryGenerator b_in = B.g[ib], b_out = B.g[1 - ib];
      if (a_out.count > 1 && b_out.count > 1 && a_out.stride != b_out.stride) {
        // Lines of A against B (outer stride b_out), or lines of B against A.
        const double span = double(A.extent()) + double(B.extent());
        const double cost_a = double(a_out.count) * (span / double(b_out.stride) + 2);
        const double cost_b = double(b_out.count) * (span / double(a_out.stride) + 2);
        const double cost = std::min(cost_a, cost_b);
        if (best < 0 || cost < best) {
          best = cost;
          enumerate = true;
          best_ia = ia;
          best_ib = ib;
          lines_of_a = cost_a <= cost_b;
        }
        continue;
      }
      const I64 T = a_out.count > 1 ? a_out.stride : (b_out.count > 1 ? b_out.stride : 1);
      const overlap::SharedStride s{T, a_in, b_in, a_out.count, b_out.count};
      const double cost = double(s.cost(d, lo, hi));
      if (cost <= 3) return s.overlaps(d, lo, hi);  // the usual case: look no further
      if (best < 0 || cost < best) {
        best = cost;
        enumerate = false;
        best_shared = s;
      }
    }
  }
  if (!enumerate) return best_shared.overlaps(d, lo, hi);
  // Lines of X (one row of X at a time, as a region with one outer row) against Y.
  const MemoryRegion& X = lines_of_a ? A : B;
  const MemoryRegion& Y = lines_of_a ? B : A;
  const int ix = lines_of_a ? best_ia : best_ib, iy = lines_of_a ? best_ib : best_ia;
  const I64 dx = lines_of_a ? d : -d;  // offset of X from Y
  const I64 xlo = lines_of_a ? lo : -hi, xhi = lines_of_a ? hi : -lo;
  const MemoryGenerator x_in = X.g[ix], x_out = X.g[1 - ix], y_in = Y.g[iy], y_out = Y.g[1 - iy];
  const overlap::SharedStride s{y_out.stride, x_in, y_in, 1, y_out.count};
  // Only the lines whose bytes meet Y's address range.
  const I64 line_bytes = x_in.stride * (x_in.count - 1) + X.width;
  const I64 j_lo = std::max<I64>(0, overlap::floor_div(-dx - line_bytes, x_out.stride) + 1);
  const I64 j_hi = std::min<I64>(x_out.count - 1, overlap::floor_div(Y.extent() - 1 - dx, x_out.stride));
  for (I64 j = j_lo; j <= j_hi; ++j)
    if (s.overlaps(dx + j * x_out.stride, xlo, xhi)) return true;
  return false;
}

/// Do two Eigen operands share memory? False when either has no memory of its own.
template <class DA, class DB>
bool memory_overlaps(const Eigen::DenseBase<DA>& a, const Eigen::DenseBase<DB>& b) {
  return regions_overlap(memory_region(a), memory_region(b));
}

// Rejects an output that shares memory with an input: check_no_overlap(function, out,
// "Q", Q, "K", K, "V", V) throws std::invalid_argument naming the first input it overlaps.
// Inputs without memory of their own (lazy expressions) cannot be checked; see the \param out
// of linear_attention().
template <class DOut>
void check_no_overlap(const char*, const Eigen::DenseBase<DOut>&) {}

template <class DOut, class DIn, class... Rest>
void check_no_overlap(const char* function, const Eigen::DenseBase<DOut>& out, const char* name,
                      const Eigen::DenseBase<DIn>& in, const Rest&... rest) {
  if (memory_overlaps(out, in))
    throw_invalid_parts(function, {"the output overlaps the memory of ", name, " (out is ",
                                   out.rows(), "x", out.cols(), ", ", name, " is ", in.rows(), "x",
                                   in.cols(), "); write into a separate buffer"});
  check_no_overlap(function, out, rest...);
}

// Rejects operands that share memory with a carried state: the kernels write the state's
// arrays while they read the inputs and write the output (in an order that differs between
// algorithms), so an output that is a Map over state.S would be overwritten, or overwrite the
// state, silently. Built once per call from the named operands; check() then costs one
// address-range test per (array, operand) pair that lies apart.
struct StateApart {
  struct Operand {
    const char* name;
    MemoryRegion region;
    std::uintptr_t lo, hi;  // the region's address range; empty (lo == hi) if not checked
    Index rows, cols;
  };
  static constexpr int kMax = 8;
  Operand ops[kMax];
  int count = 0;

  template <class... Rest>
  explicit StateApart(const Rest&... rest) {
    static_assert(sizeof...(Rest) <= 2 * kMax, "linattn: too many operands for StateApart");
    add(rest...);
  }
  void add() {}
  template <class D, class... Rest>
  void add(const char* name, const Eigen::DenseBase<D>& x, const Rest&... rest) {
    Operand& o = ops[count++];
    o = {name, memory_region(x), 0, 0, x.rows(), x.cols()};
    if (o.region.known && !o.region.empty) {
      o.lo = o.region.base;
      o.hi = o.region.base + static_cast<std::uintptr_t>(o.region.extent());
    }
    add(rest...);
  }

  // `state` names the state in a message ("state", "initial"), `index` its place in a vector
  // of states (-1: none).
  template <class State>
  void check(const char* fn, const State& st, const char* state, Index index = -1) const {
    part(fn, state, index, "S", st.S);
    part(fn, state, index, "S_lo", st.S_lo);
    part(fn, state, index, "z", st.z);
    part(fn, state, index, "z_lo", st.z_lo);
    part(fn, state, index, "m", st.m);
    part(fn, state, index, "log_decay", st.log_decay);
  }
  // A state's arrays are contiguous: their address range first, the exact test only where it
  // meets an operand's. The array as its memory (compiled once, not per array type).
  template <class A>
  void part(const char* fn, const char* state, Index index, const char* name, const A& a) const {
    if (a.size() == 0) return;
    constexpr std::int64_t w = sizeof(typename A::Scalar);
    static_assert(A::InnerStrideAtCompileTime == 1,
                  "linattn: internal: a state's arrays are plain");
    part_memory(fn, state, index, name, reinterpret_cast<std::uintptr_t>(a.data()), w,
                a.innerSize(), a.outerStride(), a.outerSize(), a.rows(), a.cols());
  }
  void part_memory(const char* fn, const char* state, Index index, const char* name,
                   std::uintptr_t b, std::int64_t w, Index inner, Index outer_stride, Index outer,
                   Index rows, Index cols) const {
    const std::uintptr_t e = b + static_cast<std::uintptr_t>(w * inner * outer);
    for (int i = 0; i < count; ++i) {
      if (e <= ops[i].lo || b >= ops[i].hi ||
          !regions_overlap(ops[i].region,
                           make_memory_region(b, w, w, inner, w * outer_stride, outer)))
        continue;
      throw_overlap(fn, state, index, name, ops[i], rows, cols);
    }
  }
  [[noreturn]] LINATTN_DETAIL_COLD static void throw_overlap(const char* fn, const char* state,
                                                            Index index, const char* name,
                                                            const Operand& op, Index rows,
                                                            Index cols) {
    throw_invalid(fn, std::string(op.name) + " overlaps the memory of " + state +
                          (index >= 0 ? "[" + std::to_string(index) + "]" : std::string()) + "." +
                          name + " (" + op.name + " is " + shape_string(op.rows, op.cols) + ", " +
                          name + " is " + shape_string(rows, cols) +
                          "): the operands must not share memory with the state the call "
                          "carries; pass a separate buffer");
  }
};

}  // namespace linattn::detail
