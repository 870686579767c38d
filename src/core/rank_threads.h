// One host thread per GPU rank, kept for the engine's lifetime: run(job) calls job(r) for every
// rank at once (rank 0 on the caller's thread) and returns when all have finished. Ranks must
// enqueue concurrently because their kernels wait on each other (all-reduces); a rank whose
// host thread stalled behind another's would turn a wait into a timeout.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moe {

class RankThreads {
 public:
  explicit RankThreads(int ranks) : errors_(static_cast<size_t>(ranks)) {
    for (int r = 1; r < ranks; ++r) workers_.emplace_back([this, r] { loop(r); });
  }
  ~RankThreads() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : workers_) t.join();
  }
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  int ranks() const { return static_cast<int>(errors_.size()); }

  // Runs job(0) .. job(ranks - 1) concurrently; rethrows the lowest rank's exception, after
  // every rank has returned.
  void run(const std::function<void(int)>& job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &job;
      pending_ = static_cast<int>(workers_.size());
      ++generation_;
      for (auto& e : errors_) e = nullptr;
    }
    wake_.notify_all();
    try {
      job(0);
    } catch (...) {
      errors_[0] = std::current_exception();
    }
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
    job_ = nullptr;
    for (auto& e : errors_)
      if (e) std::rethrow_exception(e);
  }

 private:
  void loop(int rank) {
    unsigned long long seen = 0;
    for (;;) {
      const std::function<void(int)>* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      try {
        (*job)(rank);
      } catch (...) {
        errors_[static_cast<size_t>(rank)] = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  std::vector<std::exception_ptr> errors_;
  const std::function<void(int)>* job_ = nullptr;
  unsigned long long generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace moe
