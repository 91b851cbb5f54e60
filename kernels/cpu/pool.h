// Part of the kernels' one translation unit: cpu_kernels.cpp includes the parts in order, each using those
// before it. This one: the thread pool of our own and `parallel`.
#pragma once

// A thread pool of our own for the kernels of calls on one or two rows (batch-1 and -2 decode steps). libgomp
// (torch's OpenMP) gives every thread that opens parallel regions a team of its own, and once the process
// holds more OpenMP threads than CPUs (the engine's forward thread's team plus the one any parallel torch op on
// the main thread leaves behind) idle team threads sleep at once instead of spinning: every short parallel
// region then waits for a wake-up, and a batch-1 step of SmolLM2 took ~34 instead of ~23 ms. These workers
// spin for a short while after each task before they sleep. Larger calls stay on OpenMP, like the torch ops
// around them: two sets of spinning threads on the same cores slow each other (a 64-row step ran ~15% slower
// with oneDNN on OpenMP and every kernel here on this pool; a 64-row one-call decode step 266 vs 190 ms with
// its kernels on the pool instead of OpenMP).
static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Pool {
 public:
  explicit Pool(int size) : size_(size) {
    for (int i = 1; i < size; ++i) std::thread([this, i] { work(i); }).detach();  // live as long as the process
  }
  int size() const { return size_; }
  // fn(i) for every i in [0, parts), parts <= size(); the calling thread runs part 0.
  void run(int parts, const std::function<void(int)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      parts_ = parts;
      pending_.store(parts - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    fn(0);
    while (pending_.load(std::memory_order_acquire) > 0) cpu_relax();
  }

 private:
  void work(int i) {
    long seen = 0;
    for (;;) {
      const auto idle_since = std::chrono::steady_clock::now();
      for (unsigned spins = 1; generation_.load(std::memory_order_acquire) == seen; ++spins) {
        if (spins % 256 == 0 && std::chrono::steady_clock::now() - idle_since > std::chrono::microseconds(200)) {
          std::unique_lock<std::mutex> lock(mu_);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          break;
        }
        cpu_relax();
      }
      seen = generation_.load(std::memory_order_acquire);
      if (i < parts_) {
        (*fn_)(i);
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }
  const int size_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::atomic<long> generation_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int)>* fn_ = nullptr;
  int parts_ = 0;
};

static std::mutex pool_busy;  // one caller at a time; another one meanwhile runs its work alone

// One for every kernel, sized by torch's thread count when first used; a forked child (which has no workers)
// makes its own. Called with `pool_busy` held.
static Pool* the_pool() {
  static Pool* pool = nullptr;
  static pid_t owner = 0;
  if (pool == nullptr || owner != getpid()) {
    pool = new Pool(std::max(1, at::get_num_threads()));
    owner = getpid();
  }
  return pool;
}

// fn(begin, end) over [0, n) split in parts of at least `grain` each: on the pool above for a call on one or
// two rows (`small`), else on torch's threads (at::parallel_for).
template <typename F>
static void parallel(int64_t n, int64_t grain, bool small, const F& fn) {
  if (!small) {
    at::parallel_for(0, n, grain, fn);
    return;
  }
  std::unique_lock<std::mutex> lock(pool_busy, std::try_to_lock);
  Pool* pool = lock.owns_lock() ? the_pool() : nullptr;
  const int64_t parts = pool ? std::min<int64_t>(pool->size(), (n + grain - 1) / std::max<int64_t>(grain, 1)) : 1;
  if (parts <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  pool->run((int)parts, [&](int p) { fn(n * p / parts, n * (p + 1) / parts); });
}

typedef float v8 __attribute__((vector_size(32)));
