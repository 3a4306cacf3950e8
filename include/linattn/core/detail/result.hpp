/// \file core/detail/result.hpp
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

// Prepares a fresh result buffer [p, p + bytes) for its first writes (Linux only). A result
// of tens of MiB (N = 16384 rows of 8 heads x 64 floats is 32 MiB) is above glibc's largest
// mmap threshold, so every call maps new memory and then takes one page fault per 4 KiB on
// first touch, which on a virtual machine (a fault costs ~20 us) makes a returning kernel
// several times slower than the same kernel writing into a reused matrix (bench_multihead,
// returning forms). So:
// - its 2 MiB-aligned interior is advised onto transparent huge pages (16 faults for 32 MiB);
// - the 4 KiB pages left at both ends (up to 2 x 2 MiB) are faulted in by one
//   MADV_POPULATE_WRITE call (Linux >= 5.14), which costs a fraction of 512 separate faults.
// Neither changes the contents; on failure (THP disabled, an older kernel, pages already
// present) the buffer is only slower to fill. Define LINATTN_NO_HUGE_PAGE_ADVICE to turn it off.
inline void advise_huge_pages(void* p, std::size_t bytes) noexcept {
#if defined(__linux__) && !defined(LINATTN_NO_HUGE_PAGE_ADVICE) && defined(MADV_HUGEPAGE)
  if (p == nullptr || bytes < kHugePageAdviceMinBytes) return;
  constexpr std::uintptr_t kHuge = std::uintptr_t(2) << 20, kPage = 4096;
  const auto at = [](std::uintptr_t a) { return reinterpret_cast<void*>(a); };
  const std::uintptr_t first = reinterpret_cast<std::uintptr_t>(p), last = first + bytes;
  const std::uintptr_t begin = (first + kHuge - 1) & ~(kHuge - 1), end = last & ~(kHuge - 1);
  if (end <= begin) return;
  (void)::madvise(at(begin), end - begin, MADV_HUGEPAGE);
#if defined(MADV_POPULATE_WRITE)
  // madvise takes whole pages: the partial pages at the ends (shared with the allocator's
  // header or another allocation) are left to fault as usual. With pages larger than 4 KiB
  // the calls fail harmlessly.
  const std::uintptr_t head = (first + kPage - 1) & ~(kPage - 1), tail = last & ~(kPage - 1);
  if (begin > head) (void)::madvise(at(head), begin - head, MADV_POPULATE_WRITE);
  if (tail > end) (void)::madvise(at(end), tail - end, MADV_POPULATE_WRITE);
#endif
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
