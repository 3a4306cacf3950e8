/// \file detail/result.hpp
/// \brief The matrix that the returning forms of the kernels allocate for their result
/// (internal).
#pragma once

#include <Eigen/Core>

#include <cstddef>
#include <cstdint>

#include "../common.hpp"

#if defined(__linux__) && !defined(LINATTN_NO_HUGE_PAGE_ADVICE)
#include <sys/mman.h>
#endif

namespace linattn::detail {

// Results from this size on are advised onto transparent huge pages.
inline constexpr std::size_t kHugePageAdviceMinBytes = std::size_t(4) << 20;

// Asks Linux to back the 2 MiB-aligned interior of [p, p + bytes) with transparent huge pages
// when they are first touched. A fresh result of tens of MiB (N = 16384 rows of 8 heads x 64
// floats is 32 MiB) is above glibc's largest mmap threshold, so every call maps new memory and
// the kernel then takes one page fault per 4 KiB on first touch: 8192 faults cost 4.5x the
// whole multi-head causal kernel on a virtual machine (measured 160 ms against 7 ms with huge
// pages for 32 MiB). The advice changes no contents and failing it (THP disabled, another OS)
// only loses the speed-up. Define LINATTN_NO_HUGE_PAGE_ADVICE to turn it off.
inline void advise_huge_pages(void* p, std::size_t bytes) noexcept {
#if defined(__linux__) && !defined(LINATTN_NO_HUGE_PAGE_ADVICE) && defined(MADV_HUGEPAGE)
  if (p == nullptr || bytes < kHugePageAdviceMinBytes) return;
  constexpr std::uintptr_t kHuge = std::uintptr_t(2) << 20;
  const std::uintptr_t begin = (reinterpret_cast<std::uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const std::uintptr_t end = (reinterpret_cast<std::uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (end > begin) (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

// An uninitialised rows x cols result, advised onto huge pages when it is large (see above).
template <class Scalar>
Matrix<Scalar> result_matrix(Index rows, Index cols) {
  Matrix<Scalar> out(rows, cols);
  advise_huge_pages(out.data(), static_cast<std::size_t>(out.size()) * sizeof(Scalar));
  return out;
}

}  // namespace linattn::detail
