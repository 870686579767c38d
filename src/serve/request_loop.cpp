#include "serve/request_loop.h"

#include <cstdio>

#include <fmt/format.h>

#include "moe/errors.h"

namespace moe::serve {

using Clock = std::chrono::steady_clock;

void LatencyHistogram::add(double seconds) {
  size_t i = 0;
  while (i < bounds.size() && seconds > bounds[i]) ++i;
  ++counts[i];
  sum += seconds;
}

void LatencyHistogram::write(std::string& out, const std::string& name) const {
  out += fmt::format("# TYPE {} histogram\n", name);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds.size(); ++i) {
    cumulative += counts[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds[i], cumulative);
  }
  cumulative += counts.back();
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, cumulative, name, sum, name,
                     cumulative);
}

RequestLoop::RequestLoop(std::unique_ptr<Batcher> batcher)
    : batcher_(std::move(batcher)), thread_([this] { loop(); }) {}

RequestLoop::~RequestLoop() { shutdown(); }

std::string RequestLoop::submit(const std::shared_ptr<Job>& job) {
  {
    std::lock_guard lock(m_);
    if (stopping_) return "the server is shutting down";
    incoming_.push_back(job);
  }
  cv_.notify_one();
  std::unique_lock lock(job->m);
  job->cv.wait(lock, [&] { return job->answered; });
  return job->error;
}

void RequestLoop::cancel(const std::shared_ptr<Job>& job) {
  {
    std::lock_guard lock(m_);
    cancels_.push_back(job);
  }
  cv_.notify_one();
}

void RequestLoop::shutdown() {
  {
    std::lock_guard lock(m_);
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

std::string RequestLoop::metrics() {
  std::lock_guard lock(metrics_m_);
  std::string out;
  auto counter = [&](const char* name, const char* type, double v) {
    out += fmt::format("# TYPE {} {}\n{} {}\n", name, type, name, v);
  };
  counter("moe_requests_total", "counter", static_cast<double>(requests_));
  counter("moe_requests_rejected_total", "counter", static_cast<double>(rejected_));
  counter("moe_prompt_tokens_total", "counter", static_cast<double>(prompt_tokens_));
  counter("moe_generated_tokens_total", "counter", static_cast<double>(generated_tokens_));
  counter("moe_failed_steps_total", "counter", static_cast<double>(failed_steps_));
  counter("moe_preemptions_total", "counter", static_cast<double>(stats_.preemptions));
  counter("moe_prefix_hit_tokens_total", "counter", static_cast<double>(stats_.prefix_hit_tokens));
  counter("moe_queue_depth", "gauge", static_cast<double>(stats_.waiting));
  counter("moe_running_requests", "gauge", static_cast<double>(stats_.running));
  counter("moe_kv_blocks_in_use", "gauge", static_cast<double>(stats_.blocks_used));
  counter("moe_kv_blocks_total", "gauge", static_cast<double>(stats_.blocks_total));
  // Data-parallel attention: what each rank serves (requests wait in one queue until a rank
  // takes them, so moe_queue_depth is not per rank).
  if (!stats_.groups.empty()) {
    out += "# TYPE moe_rank_running_requests gauge\n";
    for (size_t g = 0; g < stats_.groups.size(); ++g)
      out += fmt::format("moe_rank_running_requests{{rank=\"{}\"}} {}\n", g, stats_.groups[g].running);
    out += "# TYPE moe_rank_kv_blocks_in_use gauge\n";
    for (size_t g = 0; g < stats_.groups.size(); ++g)
      out += fmt::format("moe_rank_kv_blocks_in_use{{rank=\"{}\"}} {}\n", g, stats_.groups[g].blocks_used);
  }
  ttft_.write(out, "moe_time_to_first_token_seconds");
  itl_.write(out, "moe_inter_token_latency_seconds");
  return out;
}

void RequestLoop::loop() {
  for (;;) {
    std::deque<std::shared_ptr<Job>> incoming;
    std::vector<std::shared_ptr<Job>> cancels;
    bool stopping;
    {
      std::unique_lock lock(m_);
      cv_.wait(lock, [&] { return stopping_ || !incoming_.empty() || !cancels_.empty() || batcher_->busy(); });
      incoming.swap(incoming_);
      cancels.swap(cancels_);
      stopping = stopping_;
    }
    for (auto& job : incoming) take(job);
    for (auto& job : cancels) batcher_->cancel(job->id);  // false when it already finished
    if (stopping)
      for (auto& [id, live] : live_) batcher_->cancel(id);
    std::vector<Event> events;
    try {
      events = batcher_->step();
    } catch (const std::exception& e) {
      // A failed step must not strand the waiting clients: every request ends, and each client
      // is told why.
      std::fprintf(stderr, "error: %s\n", e.what());
      const std::string why = std::string("the engine failed: ") + e.what();
      for (auto& [id, live] : live_) {
        {
          std::lock_guard lock(live.job->m);
          live.job->failure = why;
        }
        batcher_->cancel(id);
      }
      {
        std::lock_guard lock(metrics_m_);
        ++failed_steps_;
      }
      events = batcher_->step();
    }
    deliver(events);
    if (stopping && live_.empty()) return;
  }
}

void RequestLoop::take(const std::shared_ptr<Job>& job) {
  std::string error;
  try {
    job->id = batcher_->submit(job->prompt, job->options);
    live_[job->id] = {job, Clock::now()};
  } catch (const Error& e) {
    error = e.message();
  }
  {
    std::lock_guard lock(metrics_m_);
    ++(error.empty() ? requests_ : rejected_);
    if (error.empty()) prompt_tokens_ += static_cast<int64_t>(job->prompt.size());
  }
  std::lock_guard lock(job->m);
  job->answered = true;
  job->error = error;
  job->cv.notify_all();
}

void RequestLoop::deliver(std::vector<Event>& events) {
  const auto now = Clock::now();
  std::lock_guard mlock(metrics_m_);
  stats_ = batcher_->stats();
  for (Event& e : events) {
    auto it = live_.find(e.id);
    if (it == live_.end()) continue;
    Live& live = it->second;
    if (e.token >= 0) {
      ++generated_tokens_;
      (live.first ? ttft_ : itl_).add(std::chrono::duration<double>(now - live.last).count());
      live.first = false;
      live.last = now;
    }
    const bool finished = e.finish != FinishReason::kNone;
    {
      std::lock_guard lock(live.job->m);
      live.job->events.push_back(std::move(e));
      live.job->finished = finished;
      live.job->cv.notify_all();
    }
    if (finished) live_.erase(it);
  }
}

}  // namespace moe::serve
