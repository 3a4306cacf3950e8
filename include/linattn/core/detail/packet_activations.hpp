/// \file core/detail/packet_activations.hpp
/// \brief sigmoid and softplus for packets, with scalar paths that agree with them bit for bit
/// (internal): the gates', β's and the gated norm's activations, vectorised.
#pragma once

#include <Eigen/Core>
#include <cmath>

#include "fast_exp.hpp"

namespace linattn::detail {

// e^{-|x|} for a packet, exactly 0 where -|x| is below exp_arg_floor (the true value is then
// below 1.6e-38 (float) or 3.3e-308 (double), under the rounding of 1 + e), so that exp never
// sees a positive argument and has no denormal path. A NaN lane gives an unspecified value: the
// callers restore the NaN.
template <class Packet>
EIGEN_STRONG_INLINE Packet pexp_minus_abs(const Packet& x) {
  using namespace Eigen::internal;
  using S = typename unpacket_traits<Packet>::type;
  const Packet lo = pset1<Packet>(exp_arg_floor<S>());
  const Packet y = pnegate(pabs(x));
  return pselect(pcmp_lt(y, lo), pzero(x), pexp_nonpositive(pmax(y, lo)));
}

// NaN lanes of x copied into r (every comparison with NaN is false).
template <class Packet>
EIGEN_STRONG_INLINE Packet pkeep_nan(const Packet& x, const Packet& r) {
  using namespace Eigen::internal;
  return pselect(pcmp_eq(x, x), r, x);
}

// σ(x) = 1/(1 + e) for x >= 0 and e/(1 + e) below, e = e^{-|x|}: the scalar sigmoid()'s
// formula, without overflow on either side; σ(±inf) = 1 and 0, NaN stays NaN.
template <class Packet>
EIGEN_STRONG_INLINE Packet psigmoid(const Packet& x) {
  using namespace Eigen::internal;
  using S = typename unpacket_traits<Packet>::type;
  const Packet one = pset1<Packet>(S(1));
  const Packet e = pexp_minus_abs(x);
  const Packet d = padd(one, e);
  const Packet r = pselect(pcmp_le(pzero(x), x), pdiv(one, d), pdiv(e, d));
  return pkeep_nan(x, r);
}

// softplus(x) = x above 20 (the threshold of scalar softplus(), FLA's and torch's), else
// max(x, 0) + log1p(e^{-|x|}) (= log(1 + e^x), with no overflow and no cancellation).
template <class Packet>
EIGEN_STRONG_INLINE Packet psoftplus(const Packet& x) {
  using namespace Eigen::internal;
  using S = typename unpacket_traits<Packet>::type;
  const Packet r = padd(pmax(x, pzero(x)), generic_plog1p(pexp_minus_abs(x)));
  return pkeep_nan(x, pselect(pcmp_lt(pset1<Packet>(S(20)), x), x, r));
}

// The functors: operator() is the packet code on a broadcast packet (scalar_via_packet), so a
// value's result does not depend on its position, its layout or the packet width.
template <class Scalar>
struct sigmoid_op {
  Scalar operator()(const Scalar& x) const {
    return scalar_via_packet(*this, x, [](const Scalar& v) {
      if (v >= Scalar(0)) return Scalar(1) / (Scalar(1) + std::exp(-v));
      const Scalar e = std::exp(v);
      return e / (Scalar(1) + e);
    });
  }
  template <class Packet>
  EIGEN_STRONG_INLINE Packet packetOp(const Packet& x) const {
    return psigmoid(x);
  }
};

template <class Scalar>
struct softplus_op {
  Scalar operator()(const Scalar& x) const {
    return scalar_via_packet(
        *this, x, [](const Scalar& v) { return v > Scalar(20) ? v : std::log1p(std::exp(v)); });
  }
  template <class Packet>
  EIGEN_STRONG_INLINE Packet packetOp(const Packet& x) const {
    return psoftplus(x);
  }
};

}  // namespace linattn::detail

namespace Eigen::internal {
template <class Scalar>
struct functor_traits<linattn::detail::sigmoid_op<Scalar>> {
  enum {
    Cost = 20 * NumTraits<Scalar>::AddCost,
    PacketAccess = packet_traits<Scalar>::Vectorizable && packet_traits<Scalar>::HasExp,
  };
};
template <class Scalar>
struct functor_traits<linattn::detail::softplus_op<Scalar>> {
  enum {
    Cost = 40 * NumTraits<Scalar>::AddCost,
    PacketAccess = packet_traits<Scalar>::Vectorizable && packet_traits<Scalar>::HasExp &&
                   packet_traits<Scalar>::HasLog,
  };
};
}  // namespace Eigen::internal
