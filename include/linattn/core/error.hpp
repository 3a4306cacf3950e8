/// \file core/error.hpp
/// \brief How linattn reports an error: an exception, or, in a build without exceptions, the
/// error handler.
///
/// Every error linattn reports (a bad shape, a bad parameter, a state file that does not load)
/// is built as one message, `"linattn::<function>: <what>"`, naming the function and the
/// shapes or values at fault. What happens next depends on the build:
///
/// - **With exceptions** (the default), the message is thrown: `std::invalid_argument` for a
///   bad argument, `std::runtime_error` for a state file that does not load (state_io.hpp),
///   `std::out_of_range` for an index. The error handler is not called.
/// - **Without exceptions** (`-fno-exceptions`, detected through `__cpp_exceptions`; or
///   `LINATTN_NO_EXCEPTIONS` defined before the first linattn header), every header compiles
///   and the message goes to error_handler() instead. The default handler prints it to stderr
///   and calls `std::abort()`. A handler of your own (set_error_handler()) receives the same
///   message the exception would have carried; it must not return (log, then abort, exit or
///   longjmp to a point with no linattn frame in between). If it returns, linattn calls
///   `std::abort()`: the call cannot go on.
///
/// Checks run before any output or state changes, so an error leaves every argument as it was
/// (as with exceptions). Errors that come from elsewhere are not linattn's to report: a failed
/// allocation ends the program through the standard library's and Eigen's own handling in a
/// build without exceptions.
///
/// \code
/// // A game engine built with -fno-exceptions routes linattn's errors to its log:
/// linattn::set_error_handler([](const char* message) {
///   engine_log_fatal(message);  // e.g. "linattn::linear_attention: Q and K must have ..."
///   std::abort();
/// });
/// \endcode
#pragma once

#include <atomic>
#include <cstdio>
#include <exception>
#include <cstdlib>
#include <stdexcept>
#include <string>

/// 1 when linattn reports errors by exceptions in this translation unit, 0 when it calls the
/// error handler instead (define LINATTN_NO_EXCEPTIONS, or compile without exceptions).
#if defined(LINATTN_NO_EXCEPTIONS) || !(defined(__cpp_exceptions) || defined(__EXCEPTIONS))
#define LINATTN_HAS_EXCEPTIONS 0
#else
#define LINATTN_HAS_EXCEPTIONS 1
#endif

namespace linattn {

/// A function that receives linattn's error message in a build without exceptions. It must
/// not return.
using ErrorHandler = void (*)(const char* message);

namespace detail {

inline void default_error_handler(const char* message) {
  std::fputs(message, stderr);
  std::fputc('\n', stderr);
  std::fflush(stderr);
  std::abort();
}

// One slot for the whole program (an inline function's static is shared by every translation
// unit), atomic so that a handler set on one thread is seen by kernels on others.
inline std::atomic<ErrorHandler>& error_handler_slot() noexcept {
  static std::atomic<ErrorHandler> handler{&default_error_handler};
  return handler;
}

}  // namespace detail

/// The handler that receives error messages in a build without exceptions (the default: print
/// to stderr, then `std::abort()`).
/// \return the handler now set (the default one unless set_error_handler() replaced it).
inline ErrorHandler error_handler() noexcept {
  return detail::error_handler_slot().load(std::memory_order_acquire);
}

/// Sets the handler of error messages for a build without exceptions and returns the previous
/// one; `nullptr` restores the default. Thread-safe. With exceptions enabled linattn throws and
/// never calls it.
/// \param handler the new handler, or nullptr for the default (print and abort).
/// \return the handler it replaces.
inline ErrorHandler set_error_handler(ErrorHandler handler) noexcept {
  return detail::error_handler_slot().exchange(handler ? handler : &detail::default_error_handler,
                                               std::memory_order_acq_rel);
}

/// True when linattn reports errors by exceptions in this translation unit.
inline constexpr bool uses_exceptions = LINATTN_HAS_EXCEPTIONS != 0;

namespace detail {

// Reports `message`: throws an Exception, or hands it to the error handler (and aborts should
// the handler return). Every error of the library goes through here.
template <class Exception>
[[noreturn]] void raise(const std::string& message) {
#if LINATTN_HAS_EXCEPTIONS
  throw Exception(message);
#else
  error_handler()(message.c_str());
  std::abort();
#endif
}

// The first exception of tasks running on OpenMP threads. An exception must not leave a
// parallel region (it would call std::terminate): run() keeps the first one, the caller skips
// the remaining tasks once failed() and rethrows it after the region. Without exceptions, run()
// just runs the task (an error has gone to the handler, which does not return).
class FirstError {
 public:
  template <class Fn>
  void run(const Fn& fn) noexcept {
#if LINATTN_HAS_EXCEPTIONS
    try {
      fn();
    } catch (...) {
      // Written by the first thread to fail only; read after the region's closing barrier.
      if (!failed_.exchange(true, std::memory_order_relaxed)) error_ = std::current_exception();
    }
#else
    fn();
#endif
  }
  bool failed() const noexcept { return failed_.load(std::memory_order_relaxed); }
  void rethrow_if_failed() const {
#if LINATTN_HAS_EXCEPTIONS
    if (error_) std::rethrow_exception(error_);
#endif
  }

 private:
  std::atomic<bool> failed_{false};
#if LINATTN_HAS_EXCEPTIONS
  std::exception_ptr error_;
#endif
};

}  // namespace detail
}  // namespace linattn
