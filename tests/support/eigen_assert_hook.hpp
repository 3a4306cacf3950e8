// Include first, before any Eigen header, in test targets compiled with EIGEN_RUNTIME_NO_MALLOC.
//
// Eigen reports a forbidden heap allocation through eigen_assert, which Release builds (NDEBUG)
// compile away, so eigen_assert is redirected to a hook that records the failure in the running
// test. As a side effect every Eigen assertion (index bounds, shape checks of products) is
// active in these tests, in every build type. A test that provokes an assertion on purpose sets
// eigen_hook::g_expect and reads eigen_hook::g_failures.
#pragma once

namespace eigen_hook {
void on_assert(const char* expr, const char* file, int line);
}
#define eigen_assert(x)                                                          \
  do {                                                                           \
    if (!static_cast<bool>(x)) ::eigen_hook::on_assert(#x, __FILE__, __LINE__); \
  } while (false)

#include <gtest/gtest.h>

namespace eigen_hook {
inline int g_failures = 0;     // eigen_assert failures seen so far
inline bool g_expect = false;  // true while a test provokes one on purpose
inline void on_assert(const char* expr, const char* file, int line) {
  ++g_failures;
  if (!g_expect) ADD_FAILURE_AT(file, line) << "eigen_assert failed: " << expr;
}
}  // namespace eigen_hook

#include <Eigen/Core>

// Guards a scope in which Eigen must not allocate; counts the eigen_assert failures inside it.
class NoMallocScope {
 public:
  NoMallocScope() : before_(eigen_hook::g_failures) { Eigen::internal::set_is_malloc_allowed(false); }
  ~NoMallocScope() { Eigen::internal::set_is_malloc_allowed(true); }
  NoMallocScope(const NoMallocScope&) = delete;
  NoMallocScope& operator=(const NoMallocScope&) = delete;
  int failures() const { return eigen_hook::g_failures - before_; }

 private:
  int before_;
};

namespace eigen_hook {
/// The detector's self-test, shared by the targets that use it: a heap allocation under
/// set_is_malloc_allowed(false) must be reported (else every no-allocation test of the target
/// would pass vacuously, for instance if EIGEN_RUNTIME_NO_MALLOC were not defined for it).
inline void expect_detector_works() {
  g_expect = true;
  int seen = 0;
  {
    NoMallocScope scope;
    Eigen::MatrixXf m(100, 100);  // must be reported
    m.setZero();
    seen = scope.failures();
  }
  g_expect = false;
  EXPECT_GE(seen, 1) << "a heap allocation under set_is_malloc_allowed(false) went unnoticed: "
                        "is EIGEN_RUNTIME_NO_MALLOC defined for this target?";
}
}  // namespace eigen_hook
