// linattn in a program compiled with -fno-exceptions: every header compiles, the
// kernels run (on OpenMP threads too), and each error reaches linattn::error_handler() with the
// message the exception would have carried. An error handler must not return, so each error
// case runs in a child process (fork) whose exit status and output the parent checks.
//
// No GoogleTest here: it is built with exceptions. Returns non-zero on the first failure.
#include <linattn/linattn.hpp>

#include <Eigen/Core>

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>

#if LINATTN_HAS_EXCEPTIONS
#error "test_no_exceptions.cpp must be compiled with -fno-exceptions (or LINATTN_NO_EXCEPTIONS)"
#endif
static_assert(!linattn::uses_exceptions, "linattn reports errors through its handler here");

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
    ++failures;
  }
}

struct ChildResult {
  bool exited = false;     // by exit()/_exit(), with `status`
  int status = 0;
  bool aborted = false;    // by SIGABRT
  std::string out, err;    // what it wrote to stdout and stderr
};

std::string drain(int fd) {
  std::string s;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof buf)) > 0;) s.append(buf, static_cast<std::size_t>(n));
  close(fd);
  return s;
}

// Runs `body` in a child process with its stdout and stderr captured. Output is small (one
// message), so reading stdout to its end, then stderr, cannot block on a full pipe.
ChildResult in_child(const std::function<void()>& body) {
  int out[2], err[2];
  if (pipe(out) != 0 || pipe(err) != 0) std::abort();
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) std::abort();
  if (pid == 0) {
    dup2(out[1], 1);
    dup2(err[1], 2);
    close(out[0]);
    close(err[0]);
    body();
    std::fflush(nullptr);
    _exit(0);
  }
  close(out[1]);
  close(err[1]);
  ChildResult r;
  r.out = drain(out[0]);
  r.err = drain(err[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  r.exited = WIFEXITED(status);
  r.status = r.exited ? WEXITSTATUS(status) : 0;
  r.aborted = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
  return r;
}

// A handler that writes the message to stdout and leaves the process with status 42.
void print_and_exit(const char* message) {
  std::fputs(message, stdout);
  std::fflush(stdout);
  _exit(42);
}

// A handler that returns: linattn must abort the call anyway.
void returns(const char* message) {
  std::fprintf(stdout, "handled: %s", message);
  std::fflush(stdout);  // std::abort() does not flush
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

int main() {
  using linattn::Index;
  // The kernels run, on one thread and on several (the parallel regions keep their error
  // bookkeeping out of a build without exceptions).
  {
    const Index N = 300, H = 4, D = 8, M = 6;
    const Eigen::MatrixXf Q = Eigen::MatrixXf::Random(N, H * D) * 0.5f,
                          K = Eigen::MatrixXf::Random(N, H * D) * 0.5f,
                          V = Eigen::MatrixXf::Random(N, H * M);
    linattn::ParallelOptions one, two;
    one.num_threads = 1;
    two.num_threads = 2;
    two.min_work_per_thread = 0;
    const Eigen::MatrixXf a = linattn::multihead_causal_linear_attention(
        Q, K, V, H, linattn::EluPlusOne{}, linattn::CausalOptions{}, one);
    const Eigen::MatrixXf b = linattn::multihead_causal_linear_attention(
        Q, K, V, H, linattn::EluPlusOne{}, linattn::CausalOptions{}, two);
    check(a.allFinite() && a.rows() == N && a.cols() == H * M, "multi-head causal output");
    check((a - b).cwiseAbs().maxCoeff() <= 1e-5f, "one and two threads agree");
    const Eigen::MatrixXf c = linattn::causal_linear_attention(
        Q.leftCols(D), K.leftCols(D), V.leftCols(M), linattn::EluPlusOne{});
    check((c - a.leftCols(M)).cwiseAbs().maxCoeff() <= 1e-5f, "head 0 equals the single-head call");
  }

  const Eigen::MatrixXf Q = Eigen::MatrixXf::Random(3, 4), K = Eigen::MatrixXf::Random(3, 5),
                        V = Eigen::MatrixXf::Random(3, 2);
  const std::string shape_message =
      "linattn::linear_attention: Q and K must have the same number of columns D (Q is 3x4, K "
      "is 3x5, V is 3x2)";

  // The default handler: the message on stderr, then std::abort().
  {
    const ChildResult r = in_child([&] { (void)linattn::linear_attention(Q, K, V); });
    check(r.aborted, "default handler: the process aborts");
    check(contains(r.err, shape_message), "default handler: stderr has the message, got: " + r.err);
  }
  // A handler of the caller's: it receives exactly the exception's message.
  {
    const ChildResult r = in_child([&] {
      linattn::set_error_handler(&print_and_exit);
      (void)linattn::linear_attention(Q, K, V);
    });
    check(r.exited && r.status == 42, "own handler: the handler's exit status");
    check(r.out == shape_message, "own handler: the message, got: " + r.out);
  }
  // A handler that returns: the call still does not go on.
  {
    const ChildResult r = in_child([&] {
      linattn::set_error_handler(&returns);
      (void)linattn::linear_attention(Q, K, V);
      std::puts("the call went on");
    });
    check(r.aborted, "returning handler: the process aborts");
    check(contains(r.out, "handled: " + shape_message) && !contains(r.out, "went on"),
          "returning handler: called once, nothing after it, got: " + r.out);
  }
  // set_error_handler returns the previous handler; nullptr restores the default.
  {
    const linattn::ErrorHandler first = linattn::error_handler();
    check(linattn::set_error_handler(&print_and_exit) == first, "set returns the default");
    check(linattn::error_handler() == &print_and_exit, "the handler is set");
    check(linattn::set_error_handler(nullptr) == &print_and_exit, "set returns the previous");
    check(linattn::error_handler() == first, "nullptr restores the default");
  }
  // Other kinds of error: a bad parameter, an index, a state file that does not load.
  {
    const ChildResult r = in_child([] {
      linattn::set_error_handler(&print_and_exit);
      linattn::Dpfp bad(0);
      (void)bad;
    });
    check(r.exited && r.status == 42 && contains(r.out, "linattn::Dpfp") && contains(r.out, "0"),
          "Dpfp(0): got " + r.out);
  }
  {
    const ChildResult r = in_child([] {
      linattn::set_error_handler(&print_and_exit);
      linattn::MultiHeadRecurrentLinearAttention<linattn::EluPlusOne, float> rnn(2, 4, 4);
      (void)rnn.head(2);
    });
    check(r.exited && r.status == 42 &&
              r.out == "linattn::MultiHeadRecurrentLinearAttention::head: head 2 of 2",
          "head(2) of 2: got " + r.out);
  }
  {
    const ChildResult r = in_child([] {
      linattn::set_error_handler(&print_and_exit);
      linattn::RecurrentLinearAttention<linattn::EluPlusOne, float> rnn(4, 3);
      std::stringstream file;
      linattn::save_state(file, rnn);
      std::string bytes = file.str();
      bytes.resize(bytes.size() / 2);  // truncated
      std::istringstream half(bytes);
      linattn::load_state(half, rnn);
    });
    check(r.exited && r.status == 42 && contains(r.out, "linattn::load_state"),
          "truncated state file: got " + r.out);
  }
  // Still usable after an error was reported in a child: the handler of this process is the
  // default one, and a good call works.
  check(linattn::linear_attention(Q.leftCols(4), K.leftCols(4), V).allFinite(), "a good call");

  if (failures == 0) std::puts("test_no_exceptions: all checks passed");
  return failures == 0 ? 0 : 1;
}
