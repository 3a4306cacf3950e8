/// \file core/detail/fast_exp.hpp
/// \brief exp on (-∞, 0] for packets (a fast float path on AVX2 / AVX-512): the EluPlusOne
/// functor and the shifted exponentials of softmax, whose scalar and packet paths agree bit
/// for bit (internal).
#pragma once

#include <Eigen/Core>

#include <cmath>
#include <type_traits>

#include "../common.hpp"

namespace linattn::detail {

// exp(y) for float packets with y in [-87, 0] (the caller clamps): on that range 2^m can be
// built from the exponent bits directly (m in [-126, 0]) instead of through Eigen's general
// pldexp, the slow part of pexp. Same Cephes polynomial as Eigen, hence the same accuracy
// (about 1 ulp).
template <class Packet>
EIGEN_STRONG_INLINE Packet pexp_nonpositive_clamped(const Packet& y) {
  using namespace Eigen::internal;
  using PacketI = typename unpacket_traits<Packet>::integer_packet;
  const Packet m = pfloor(pmadd(y, pset1<Packet>(1.44269504088896341f), pset1<Packet>(0.5f)));
  Packet r = pmadd(m, pset1<Packet>(-0.693359375f), y);
  r = pmadd(m, pset1<Packet>(2.12194440e-4f), r);
  const Packet r2 = pmul(r, r);
  const Packet r3 = pmul(r2, r);
  Packet p = pmadd(pset1<Packet>(1.9875691500E-4f), r, pset1<Packet>(1.3981999507E-3f));
  Packet p1 = pmadd(pset1<Packet>(4.1665795894E-2f), r, pset1<Packet>(1.6666665459E-1f));
  p = pmadd(p, r, pset1<Packet>(8.3334519073E-3f));
  p1 = pmadd(p1, r, pset1<Packet>(5.0000001201E-1f));
  p = pmadd(p, r3, p1);
  p = pmadd(p, r2, padd(r, pset1<Packet>(1.0f)));
  const PacketI biased = padd(pcast<Packet, PacketI>(m), pset1<PacketI>(127));
  return pmul(p, preinterpret<Packet>(plogical_shift_left<23>(biased)));
}

// Whether the fast float exp above is used: float with AVX2 or AVX-512 (where every primitive
// it needs is known to exist); elsewhere Eigen's generic pexp_float / pexp_double.
#if defined(EIGEN_VECTORIZE_AVX2) && !defined(EIGEN_DONT_VECTORIZE)
template <class Scalar>
inline constexpr bool use_fast_elu_v = std::is_same_v<Scalar, float>;
#else
template <class Scalar>
inline constexpr bool use_fast_elu_v = false;
#endif

// The lowest argument given to the packet exp: 2^m stays a normal number, so that no packet
// path has to handle denormals. exp(-87) ≈ 1.6e-38 (float), exp(-708) ≈ 3.3e-308 (double).
template <class Scalar>
constexpr Scalar exp_arg_floor() noexcept {
  return std::is_same_v<Scalar, float> ? Scalar(-87) : Scalar(-708);
}

// exp(y) for a packet y in [exp_arg_floor, 0]. Every operation is exact or correctly rounded
// lane by lane (FMA or not per build, uniformly), so a lane's result does not depend on the
// packet width. Eigen's own pexp<Packet16f> is a different polynomial from its Packet8f one:
// the generic pexp_float is called directly for that reason.
template <class Packet>
EIGEN_STRONG_INLINE Packet pexp_nonpositive(const Packet& y) {
  using S = typename Eigen::internal::unpacket_traits<Packet>::type;
  if constexpr (use_fast_elu_v<S>)
    return pexp_nonpositive_clamped(y);
  else if constexpr (std::is_same_v<S, float>)
    return Eigen::internal::pexp_float(y);
  else
    return Eigen::internal::pexp_double(y);
}

// The scalar operator() of the functors below: the packet code on a broadcast packet, first
// lane. Eigen maps the unaligned head and the tail of every column (and a row shorter than a
// packet) with operator(), the rest with packetOp; computing both the same way keeps every
// feature independent of its position (and of the input's layout) bit for bit. `fallback`
// serves builds without vectorisation, where operator() is the only path.
template <class Scalar, class Op, class Fallback>
EIGEN_STRONG_INLINE Scalar scalar_via_packet(const Op& op, const Scalar& x, const Fallback& fallback) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  if constexpr (bool(packet_traits<Scalar>::Vectorizable) && packet_traits<Scalar>::size > 1)
    return pfirst(op.packetOp(pset1<Packet>(x)));
  else
    return fallback(x);
}

// φ(x) = exp(min(x, 0)) + max(x, 0), the EluPlusOne map. The argument of exp is clamped at
// exp_arg_floor: features of inputs below -87 (float) are exp(-87) ≈ 1.6e-38 instead of a
// denormal, a difference far below the denominator guard. NaN stays NaN; -inf maps to
// exp(-87), +inf to +inf.
template <class Scalar>
struct elu_plus_one_op {
  Scalar operator()(const Scalar& x) const {
    return scalar_via_packet(*this, x, [](const Scalar& v) {
      const Scalar y = v < Scalar(0) ? v : Scalar(0);
      return std::exp(y > exp_arg_floor<Scalar>() ? y : exp_arg_floor<Scalar>()) +
             (v > Scalar(0) ? v : Scalar(0));
    });
  }

  template <class Packet>
  EIGEN_STRONG_INLINE Packet packetOp(const Packet& x) const {
    using namespace Eigen::internal;
    const Packet zero = pzero(x);
    const Packet y = pmax(pmin(x, zero), pset1<Packet>(exp_arg_floor<Scalar>()));
    return padd(pexp_nonpositive(y), pmax(x, zero));
  }
};

// exp(x) for x <= 0, the shifted scores of a softmax (x - max): below exp_arg_floor the result
// is 0 (exp would be a denormal there, under 1.6e-38 of the largest term, which is 1), so that
// the -inf of a masked score gives exactly 0. NaN stays NaN.
template <class Scalar>
struct exp_nonpositive_op {
  Scalar operator()(const Scalar& x) const {
    return scalar_via_packet(*this, x, [](const Scalar& v) {
      return v < exp_arg_floor<Scalar>() ? Scalar(0) : std::exp(v);
    });
  }

  template <class Packet>
  EIGEN_STRONG_INLINE Packet packetOp(const Packet& x) const {
    using namespace Eigen::internal;
    const Packet zero = pzero(x);
    const Packet lo = pset1<Packet>(exp_arg_floor<Scalar>());
    const Packet r = pexp_nonpositive(pmax(pmin(x, zero), lo));
    // x - x is 0, or NaN for a NaN (or infinite) x; -inf is caught by the comparison first.
    return pselect(pcmp_lt(x, lo), zero, padd(r, psub(x, x)));
  }
};

// expm1(x) = e^x - 1 for x <= 0 with a small relative error for every x, so that a decay
// factor applied as S + e S (e = expm1(g)) is exact to rounding even when 1 - e^g is below
// float's rounding of 1 (|g| < 6e-8), where e^g itself would carry a relative error of u / |g|
// into 1 - e^g. For x >= -ln 2 / 2 a Taylor polynomial (its remainder below 0.02 ulp); below,
// e^x - 1 (no cancellation there: |result| >= 0.29). Below exp_arg_floor the result is exactly
// -1 (the factor is exactly 0); NaN stays NaN. Each lane takes one of the two formulas by its
// own value, so the result does not depend on the packet width (the scalar path is the packet
// code, as for the functors above). With Split, the low part l of a decay factor e^x = h + l
// instead: l = expm1(x), h = 1 where x >= decay_split_point (e^x >= 0.71); l = e^x, h = 0 below
// (where 1 + expm1(x) would cancel): l is exact to rounding relative to itself either way.
template <class S>
constexpr S decay_split_point() noexcept {
  return S(-0.34657359027997264);  // -ln 2 / 2
}
template <bool Split = false, class Packet>
EIGEN_STRONG_INLINE Packet pexpm1_nonpositive(const Packet& x) {
  using namespace Eigen::internal;
  using S = typename unpacket_traits<Packet>::type;
  const Packet zero = pzero(x), one = pset1<Packet>(S(1));
  const Packet lo = pset1<Packet>(exp_arg_floor<S>());
  const Packet y = pmax(pmin(x, zero), lo);
  const Packet small = pcmp_le(pset1<Packet>(decay_split_point<S>()), y);
  const auto large = [&] { return Split ? pexp_nonpositive(y) : psub(pexp_nonpositive(y), one); };
  const auto taylor = [&] {
    // e^y - 1 = y + y² Σ_{n>=2} y^{n-2} / n!, to y^8 / 8! (float) or y^13 / 13! (double).
    Packet p;
    if constexpr (std::is_same_v<S, float>) {
      p = pset1<Packet>(S(1.0 / 40320));
      for (const double c : {1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5})
        p = pmadd(p, y, pset1<Packet>(S(c)));
    } else {
      p = pset1<Packet>(S(1.0 / 6227020800.0));
      for (const double c :
           {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0,
            1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5})
        p = pmadd(p, y, pset1<Packet>(S(c)));
    }
    return pmadd(pmul(y, y), p, y);
  };
  Packet r;
  if (!predux_any(pandnot(pcmp_eq(y, y), small)))  // mild gates: the polynomial only
    r = taylor();
  else if (!predux_any(small))
    r = large();
  else
    r = pselect(small, taylor(), large());
  // x - x is 0, or NaN for a NaN (or infinite) x; -inf is caught by the comparison first.
  return pselect(pcmp_lt(x, lo), pset1<Packet>(S(Split ? 0 : -1)), padd(r, psub(x, x)));
}

template <class Scalar, bool Split = false>
struct expm1_nonpositive_op {
  Scalar operator()(const Scalar& x) const {
    return scalar_via_packet(*this, x, [](const Scalar& v) {
      if (v < exp_arg_floor<Scalar>()) return Scalar(Split ? 0 : -1);
      return Split && v < decay_split_point<Scalar>() ? std::exp(v) : std::expm1(v);
    });
  }

  template <class Packet>
  EIGEN_STRONG_INLINE Packet packetOp(const Packet& x) const {
    return pexpm1_nonpositive<Split>(x);
  }
};

// x(:, j) <- exp(x(:, j) - shift) for every column j of a column-major x, with shift a vector
// of x.rows() entries (each row has its own shift, at most its maximum, so every argument is
// <= 0); with row_sums, also row_sums += the new rows' sums, in the same pass. Column by
// column because Eigen evaluates exp of a broadcast (colwise() - v) with scalar code.
template <class X, class Shift, class Sums = void>
void exp_shifted_rows(X&& x, const Shift& shift, Sums* row_sums = nullptr) {
  using S = typename std::decay_t<X>::Scalar;
  for (Index j = 0; j < x.cols(); ++j) {
    auto c = x.col(j).array();
    if constexpr (use_fast_elu_v<S>)
      c = (c - shift.array()).unaryExpr(exp_nonpositive_op<S>());
    else
      c = (c - shift.array()).exp();
    if constexpr (!std::is_void_v<Sums>)
      if (row_sums) row_sums->array() += c;
  }
}

// x(:, j) <- exp(x(:, j) - shift(j)): each column has its own shift (at most its maximum).
template <class X, class Shift>
void exp_shifted_cols(X&& x, const Shift& shift) {
  using S = typename std::decay_t<X>::Scalar;
  for (Index j = 0; j < x.cols(); ++j) {
    auto c = x.col(j).array();
    if constexpr (use_fast_elu_v<S>)
      c = (c - shift(j)).unaryExpr(exp_nonpositive_op<S>());
    else
      c = (c - shift(j)).exp();
  }
}

}  // namespace linattn::detail

namespace Eigen::internal {
template <class Scalar>
struct functor_traits<linattn::detail::elu_plus_one_op<Scalar>> {
  enum {
    Cost = 20 * NumTraits<Scalar>::AddCost,
    PacketAccess = packet_traits<Scalar>::Vectorizable && packet_traits<Scalar>::HasExp,
  };
};
template <class Scalar, bool Split>
struct functor_traits<linattn::detail::expm1_nonpositive_op<Scalar, Split>> {
  enum {
    Cost = 20 * NumTraits<Scalar>::AddCost,
    PacketAccess = packet_traits<Scalar>::Vectorizable && packet_traits<Scalar>::HasExp,
  };
};
template <class Scalar>
struct functor_traits<linattn::detail::exp_nonpositive_op<Scalar>> {
  enum {
    Cost = 20 * NumTraits<Scalar>::AddCost,
    PacketAccess = packet_traits<Scalar>::Vectorizable && packet_traits<Scalar>::HasExp,
  };
};
}  // namespace Eigen::internal
