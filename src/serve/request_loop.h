// The server's engine side: one thread owns a Batcher (the scheduler over the CPU or CUDA executor) and
// steps it while there is work; request threads never touch it. They hand a Job in, wait for the
// verdict, then wait on the Job for its events. Counts requests, tokens and latencies for
// /metrics. No socket anywhere: unit tests drive it with a model directly.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "serve/batcher.h"

namespace moe::serve {

// What a request thread waits on: first the verdict on its submission, then its events.
struct Job {
  std::vector<int32_t> prompt;
  RequestOptions options;
  std::mutex m;
  std::condition_variable cv;
  bool answered = false;  // the loop took the request or rejected it
  std::string error;      // why it was rejected
  uint64_t id = 0;
  std::deque<Event> events;
  bool finished = false;
  // Set when the engine failed while the request ran: it ended without its output, and the
  // client must hear why (HTTP 500, or an error event on a stream), not see a short answer.
  std::string failure;
};

// Latencies in seconds, as cumulative Prometheus buckets.
struct LatencyHistogram {
  std::vector<double> bounds{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
  std::vector<uint64_t> counts = std::vector<uint64_t>(bounds.size() + 1, 0);
  double sum = 0;
  void add(double seconds);
  void write(std::string& out, const std::string& name) const;
};

class RequestLoop {
 public:
  explicit RequestLoop(std::unique_ptr<Batcher> batcher);
  ~RequestLoop();
  RequestLoop(const RequestLoop&) = delete;
  RequestLoop& operator=(const RequestLoop&) = delete;

  // Blocks until the loop accepted or rejected the job; returns the rejection ("" if taken).
  std::string submit(const std::shared_ptr<Job>& job);
  // Ends the job's request (a client that went away); its blocks are freed at the next step.
  void cancel(const std::shared_ptr<Job>& job);
  // Ends every request in flight (each job's last event is cancelled) and stops the thread;
  // later submissions are rejected.
  void shutdown();
  // Prometheus text: requests, tokens, queue depth, KV blocks, latency histograms.
  std::string metrics();

 private:
  struct Live {
    std::shared_ptr<Job> job;
    std::chrono::steady_clock::time_point last;  // submission, then each token
    bool first = true;
  };
  void loop();
  void take(const std::shared_ptr<Job>& job);
  void deliver(std::vector<Event>& events);

  std::unique_ptr<Batcher> batcher_;
  std::map<uint64_t, Live> live_;  // loop thread only
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> incoming_;
  std::vector<std::shared_ptr<Job>> cancels_;
  bool stopping_ = false;
  std::mutex metrics_m_;
  int64_t requests_ = 0, rejected_ = 0, prompt_tokens_ = 0, generated_tokens_ = 0, failed_steps_ = 0;
  SchedulerStats stats_;
  LatencyHistogram ttft_, itl_;
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace moe::serve
