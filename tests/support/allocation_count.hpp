// Counts the heap allocations of a call, both Eigen's (reported through eigen_assert under
// EIGEN_RUNTIME_NO_MALLOC) and the global operator new's (std::vector, std::string, ...), for
// the no-allocation tests. Include eigen_assert_hook.hpp first, before any Eigen header.
#pragma once

#include "eigen_assert_hook.hpp"
#include "new_counter.hpp"

namespace test {

struct Allocations {
  int eigen = 0, news = 0;
};

/// The allocations made by `call()`; Eigen's are counted, not reported as failures (the caller
/// reports them with its context).
template <class F>
Allocations allocations_in(F&& call) {
  Allocations a;
  eigen_hook::g_expect = true;
  new_counter::calls = 0;
  {
    NoMallocScope scope;
    new_counter::counting = true;
    call();
    new_counter::counting = false;
    a.eigen = scope.failures();
  }
  eigen_hook::g_expect = false;
  a.news = new_counter::calls.load();
  return a;
}

}  // namespace test
