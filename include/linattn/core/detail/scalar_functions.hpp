/// \file core/detail/scalar_functions.hpp
/// \brief Scalar activations shared by the gates, the short convolution and the gated norm
/// (internal).
#pragma once

#include <cmath>

namespace linattn::detail {

// softplus(x) = log(1 + e^x), x itself above 20 (FLA's and torch's threshold); sigmoid without
// overflow on either side.
template <class S>
S softplus(S x) {
  return x > S(20) ? x : std::log1p(std::exp(x));
}
template <class S>
S sigmoid(S x) {
  if (x >= S(0)) return S(1) / (S(1) + std::exp(-x));
  const S e = std::exp(x);
  return e / (S(1) + e);
}

}  // namespace linattn::detail
