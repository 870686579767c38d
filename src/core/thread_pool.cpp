#include "core/thread_pool.h"

#include <algorithm>

namespace moe {

namespace {
thread_local bool t_inside_pool = false;
}

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 0; i + 1 < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int index) {
  t_inside_pool = true;
  uint64_t seen = 0;
  for (;;) {
    std::pair<int64_t, int64_t> range;
    const std::function<void(int64_t, int64_t)>* job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      range = ranges_[static_cast<size_t>(index) + 1];
    }
    std::exception_ptr err;
    if (range.first < range.second) {
      try {
        (*job)(range.first, range.second);
      } catch (...) {
        err = std::current_exception();
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (err && !error_) error_ = err;
    if (--pending_ == 0) done_.notify_one();
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                              int64_t grain) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  int64_t parts = std::min<int64_t>(size(), (n + grain - 1) / grain);
  if (parts <= 1 || workers_.empty() || t_inside_pool) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ranges_.assign(static_cast<size_t>(size()), {0, 0});
    int64_t step = (n + parts - 1) / parts;
    for (int64_t p = 0; p < parts; ++p)
      ranges_[static_cast<size_t>(p)] = {std::min(n, p * step), std::min(n, (p + 1) * step)};
    job_ = &fn;
    error_ = nullptr;
    pending_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  t_inside_pool = true;
  std::exception_ptr mine;
  try {
    fn(ranges_[0].first, ranges_[0].second);
  } catch (...) {
    mine = std::current_exception();
  }
  t_inside_pool = false;
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return pending_ == 0; });
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

}  // namespace moe
