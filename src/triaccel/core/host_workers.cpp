// Host worker threads; see host_workers.h.
#include "triaccel/core/host_workers.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace triaccel {
namespace {

class Workers {
 public:
  explicit Workers(int threads) {
    for (int t = 1; t < threads; ++t) threads_.emplace_back([this]() { loop(); });
  }
  ~Workers() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;

  int threads() const { return static_cast<int>(threads_.size()) + 1; }

  void run(int64_t parts, const std::function<void(int64_t)>& fn) {
    const std::lock_guard<std::mutex> caller(caller_mutex_);
    if (threads_.empty() || parts <= 1) {
      for (int64_t p = 0; p < parts; ++p) fn(p);
      return;
    }
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      job_ = &fn;
      parts_ = parts;
      next_.store(0);
      busy_ = static_cast<int>(threads_.size());
      ++generation_;
    }
    wake_.notify_all();
    work(fn, parts);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this]() { return busy_ == 0; });
    job_ = nullptr;
  }

 private:
  void work(const std::function<void(int64_t)>& fn, int64_t parts) {
    for (int64_t p = next_.fetch_add(1); p < parts; p = next_.fetch_add(1)) fn(p);
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int64_t)>* job = nullptr;
      int64_t parts = 0;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&]() { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
        parts = parts_;
      }
      work(*job, parts);
      {
        const std::lock_guard<std::mutex> lock(mutex_);
        if (--busy_ == 0) done_.notify_one();
      }
    }
  }

  std::mutex caller_mutex_;  // one run at a time
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t parts_ = 0;
  std::atomic<int64_t> next_{0};
  int busy_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

Workers& workers() {
  static Workers w(std::clamp(at::get_num_threads(), 1, 32));
  return w;
}

}  // namespace

void host_parallel(int64_t parts, const std::function<void(int64_t)>& fn) { workers().run(parts, fn); }

int host_parallel_threads() { return workers().threads(); }

}  // namespace triaccel
