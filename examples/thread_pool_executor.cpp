// The engine's own threads: linattn's parallel loops handed to a std::thread pool through
// ParallelOptions::executor, in place of OpenMP (README, "Embedding in an engine").
//
// An inference engine runs one pool for all its work; a second set of threads (OpenMP's) would
// compete with it for the cores. The executor is any callable
//   void(linattn::Index n, linattn::FunctionRef<void(linattn::Index)> task)
// that calls task(0) ... task(n - 1), on any threads, and returns when all have returned. The
// results are bit for bit those of OpenMP with the same number of threads (the same partition),
// and this program checks it for the calls below when it is built with OpenMP.
//
//   thread_pool_executor           8 heads of 64, N = 16384: times the causal forward and a
//                                  batched decode step on the pool, on OpenMP with as many
//                                  threads and on one thread, and the long-sequence split
//   thread_pool_executor --smoke   small sizes (ctest)
#include <linattn/linattn.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace {

using linattn::Index;

// A fixed pool of worker threads. run_and_wait(n, task) hands out task(0) ... task(n - 1) to the
// workers and to the calling thread, and returns when all have run. One call at a time (the
// library never makes a second call from inside a task).
class ThreadPool {
 public:
  explicit ThreadPool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& w : workers_) w.join();
  }

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void run_and_wait(Index n, linattn::FunctionRef<void(Index)> task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = &task;
      tasks_ = n;
      next_ = 0;
      done_ = 0;
      ++generation_;
    }
    wake_.notify_all();
    run_tasks(task, n);  // the caller takes tasks too
    // Also until every worker that took this call has left it: a worker still inside could
    // otherwise take a task of the next call through this call's (then dangling) task.
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, [&] { return done_ == tasks_ && active_ == 0; });
    task_ = nullptr;  // a worker waking up late finds no call
  }

 private:
  // Takes tasks until none is left; counts the ones it ran.
  void run_tasks(linattn::FunctionRef<void(Index)>& task, Index n) {
    Index ran = 0;
    for (Index t = next_.fetch_add(1); t < n; t = next_.fetch_add(1)) {
      task(t);
      ++ran;
    }
    if (ran > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ += ran;
    }
    finished_.notify_all();
  }

  void work() {
    unsigned long seen = 0;
    for (;;) {
      linattn::FunctionRef<void(Index)>* task = nullptr;
      Index n = 0;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        task = task_;
        n = tasks_;
        if (task) ++active_;
      }
      if (!task) continue;
      run_tasks(*task, n);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --active_;
      }
      finished_.notify_all();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, finished_;
  linattn::FunctionRef<void(Index)>* task_ = nullptr;
  Index tasks_ = 0, done_ = 0;
  int active_ = 0;  // workers inside the current call
  std::atomic<Index> next_{0};
  unsigned long generation_ = 0;
  bool stop_ = false;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <class Fn>
double best_of(int repeats, const Fn& fn) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, seconds_since(t0));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const bool smoke = argc > 1 && std::strcmp(argv[1], "--smoke") == 0;
  const Index H = 8, D = 64, M = 64, N = smoke ? 2048 : 16384, B = smoke ? 8 : 64;
  const int threads = std::max(2, static_cast<int>(std::thread::hardware_concurrency()));
  ThreadPool pool(threads);

  // The executor: the pool, as the library's parallel loops see it.
  linattn::ParallelOptions on_pool;
  on_pool.num_threads = pool.size();
  on_pool.executor = [&pool](Index n, linattn::FunctionRef<void(Index)> task) {
    pool.run_and_wait(n, task);
  };
  linattn::ParallelOptions one_thread;
  one_thread.num_threads = 1;

  // Packed row-major [N, H·D] inputs, as a PyTorch [T, H, D] tensor.
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const RowMat Q = RowMat::Random(N, H * D), K = RowMat::Random(N, H * D),
               V = RowMat::Random(N, H * M);
  RowMat out(N, H * M), serial(N, H * M);
  linattn::MultiHeadWorkspace<float> ws;
  const auto multihead = [&](RowMat& o, const linattn::ParallelOptions& par) {
    linattn::multihead_causal_linear_attention(Q, K, V, H, linattn::EluPlusOne{}, o, ws,
                                               linattn::CausalOptions{}, par);
  };
  // OpenMP with as many threads, for comparison (one thread without OpenMP).
  linattn::ParallelOptions on_openmp;
  on_openmp.num_threads = pool.size();
  const int repeats = smoke ? 1 : 5;
  const double t_pool = best_of(repeats, [&] { multihead(out, on_pool); });
  const double t_omp = best_of(repeats, [&] { multihead(serial, on_openmp); });
  const double t_one = best_of(repeats, [&] { multihead(serial, one_thread); });
  // Heads are independent: any number of threads gives the one-thread bits.
  const bool heads_same = out == serial;
  std::printf("causal, %ld heads of %ld, N = %ld: %.1f ms on the pool of %d, %.1f ms on OpenMP, "
              "%.1f ms on one thread; outputs %s\n",
              long(H), long(D), long(N), 1e3 * t_pool, pool.size(), 1e3 * t_omp, 1e3 * t_one,
              heads_same ? "identical" : "DIFFER");

  // One long sequence split over the pool (spec §8): segments summarised, combined, then read.
  const Eigen::MatrixXf q1 = Q.leftCols(D), k1 = K.leftCols(D), v1 = V.leftCols(M);
  Eigen::MatrixXf split(N, M);
  linattn::Workspace<float> ws1;
  linattn::LinearAttentionState<float> st;
  linattn::ParallelOptions split_par = on_pool;
  split_par.min_rows_per_thread = smoke ? 256 : 0;
  const double t_split = best_of(smoke ? 1 : 3, [&] {
    st.reset();
    linattn::causal_linear_attention(q1, k1, v1, linattn::EluPlusOne{}, st, split, ws1, {},
                                     split_par);
  });
  bool split_same = true;
#ifdef _OPENMP
  {
    linattn::ParallelOptions omp_par = split_par;
    omp_par.executor = nullptr;  // OpenMP, the same number of threads
    Eigen::MatrixXf by_omp(N, M);
    linattn::LinearAttentionState<float> st2;
    linattn::causal_linear_attention(q1, k1, v1, linattn::EluPlusOne{}, st2, by_omp, ws1, {},
                                     omp_par);
    split_same = by_omp == split;
    std::printf("one sequence of %ld split over the pool: %.2f ms; %s OpenMP's bits\n", long(N),
                1e3 * t_split, split_same ? "equal to" : "DIFFERENT FROM");
  }
#else
  std::printf("one sequence of %ld split over the pool: %.2f ms (built without OpenMP)\n",
              long(N), 1e3 * t_split);
#endif

  // A batched decode step: B sequences x H heads, the (sequence, head) pairs on the pool.
  linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float> decoder(B, H, D, M),
      decoder1(B, H, D, M);
  const RowMat qs = RowMat::Random(B, H * D), ks = RowMat::Random(B, H * D),
               vs = RowMat::Random(B, H * M);
  RowMat y(B, H * M), y1(B, H * M);
  const int steps = smoke ? 4 : 200;
  const double t_step = best_of(repeats, [&] {
    for (int s = 0; s < steps; ++s) decoder.step(qs, ks, vs, y, on_pool);
  }) / steps;
  const double t_step1 = best_of(repeats, [&] {
    for (int s = 0; s < steps; ++s) decoder1.step(qs, ks, vs, y1, one_thread);
  }) / steps;
  const bool decode_same = y == y1;  // the same number of steps on both
  linattn::BatchedRecurrentLinearAttention<linattn::EluPlusOne, float> decoder2(B, H, D, M);
  const double t_step_omp = best_of(repeats, [&] {
    for (int s = 0; s < steps; ++s) decoder2.step(qs, ks, vs, y1, on_openmp);
  }) / steps;
  std::printf("decode step, %ld sequences x %ld heads: %.1f us on the pool, %.1f us on OpenMP, "
              "%.1f us on one thread; outputs %s\n",
              long(B), long(H), 1e6 * t_step, 1e6 * t_step_omp, 1e6 * t_step1,
              decode_same ? "identical" : "DIFFER");
  return heads_same && split_same && decode_same ? 0 : 1;
}
