/// \file detail/fast_exp.hpp
/// \brief The elementwise functor of EluPlusOne with a packet path (internal).
#pragma once

#include <Eigen/Core>

#include <cmath>

namespace linattn::detail {

// φ(x) = exp(min(x, 0)) + max(x, 0). The packet path (float, AVX2 and AVX-512) computes exp only on
// (-∞, 0], which lets it build 2^m from the exponent bits directly (m ∈ [-126, 0]) instead of
// Eigen's general pldexp, the slow part of pexp. The argument is clamped at -87 so that 2^m
// stays a normal number: features of inputs below -87 are exp(-87) ≈ 1.6e-38 instead of a
// denormal, a difference far below the denominator guard. Same Cephes polynomial as Eigen,
// hence the same accuracy (about 1 ulp) everywhere else.
template <class Scalar>
struct elu_plus_one_op {
  Scalar operator()(const Scalar& x) const {
    return std::exp(x < Scalar(0) ? x : Scalar(0)) + (x > Scalar(0) ? x : Scalar(0));
  }

  template <class Packet>
  Packet packetOp(const Packet& x) const {
    using namespace Eigen::internal;
    using PacketI = typename unpacket_traits<Packet>::integer_packet;
    const Packet zero = pzero(x);
    const Packet y = pmax(pmin(x, zero), pset1<Packet>(-87.0f));
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
    const Packet two_m = preinterpret<Packet>(plogical_shift_left<23>(biased));
    return padd(pmul(p, two_m), pmax(x, zero));
  }
};

// Whether the packet path above is used: float with AVX2 or AVX-512 (where every primitive it
// needs is known to exist); elsewhere EluPlusOne uses Eigen's own vectorised exp.
#if defined(EIGEN_VECTORIZE_AVX2) && !defined(EIGEN_DONT_VECTORIZE)
template <class Scalar>
inline constexpr bool use_fast_elu_v = std::is_same_v<Scalar, float>;
#else
template <class Scalar>
inline constexpr bool use_fast_elu_v = false;
#endif

}  // namespace linattn::detail

namespace Eigen::internal {
template <class Scalar>
struct functor_traits<linattn::detail::elu_plus_one_op<Scalar>> {
  enum {
    Cost = 20 * NumTraits<Scalar>::AddCost,
    PacketAccess = linattn::detail::use_fast_elu_v<Scalar>,
  };
};
}  // namespace Eigen::internal
