// The worker side of an executor in another process (moe-server --serve-executor): serves drivers
// (RemoteExecutor) that connect to a listening socket, one after another, for as long as the
// process lives. Each driver's sequences are closed when it goes, so a restarted or replaced
// server finds the executor as it was loaded (with its prefix cache) instead of reloading the
// model; a driver that connects while another is served is told so in one line.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include "runtime/executor.h"

namespace moe::runtime {

class ExecutorWorker {
 public:
  // `listen_fd`: a listening socket (made non-blocking; not closed here). `timeout_s` bounds each
  // request and reply (serve_executor). `log` receives one line per driver that comes and goes.
  ExecutorWorker(Executor& executor, int listen_fd, double timeout_s, std::function<void(const std::string&)> log);

  // Serves drivers until stop(); returns then. A driver whose connection fails ends only that
  // driver (logged); a listening socket that fails throws kIo.
  void run();
  // From any thread (a signal waiter): no new driver is taken, and the current one's connection
  // is shut down, so run() returns once the call in progress, if any, has been answered or cut.
  void stop();

  int64_t drivers_served() const { return drivers_; }

 private:
  Executor& executor_;
  int listen_fd_;
  double timeout_s_;
  std::function<void(const std::string&)> log_;
  std::atomic<bool> stopping_{false};
  std::mutex driver_mu_;  // guards driver_fd_ against stop() shutting down a reused descriptor
  int driver_fd_ = -1;
  std::atomic<int64_t> drivers_{0};
};

}  // namespace moe::runtime
