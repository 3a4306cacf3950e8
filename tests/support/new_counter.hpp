// Counts calls of the global operator new (std::vector, std::string, ...) while
// new_counter::counting is set, for the no-allocation tests. It replaces the global
// allocation functions, so include it in exactly one source file of a test program.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

namespace new_counter {
inline std::atomic<bool> counting{false};
inline std::atomic<int> calls{0};
}  // namespace new_counter

// Replacements of the global allocation functions (malloc/free based, as the standard allows);
// GCC cannot see that the two sides match and warns about free on a new'ed pointer.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void* operator new(std::size_t n) {
  if (new_counter::counting.load(std::memory_order_relaxed)) ++new_counter::calls;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
  if (new_counter::counting.load(std::memory_order_relaxed)) ++new_counter::calls;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
// The nothrow forms too (std::stable_sort's temporary buffer takes one), so that every pointer
// freed below came from malloc.
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  if (new_counter::counting.load(std::memory_order_relaxed)) ++new_counter::calls;
  return std::malloc(n ? n : 1);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  if (new_counter::counting.load(std::memory_order_relaxed)) ++new_counter::calls;
  return std::malloc(n ? n : 1);
}
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
