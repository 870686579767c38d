#include "runtime/executor_worker.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "moe/errors.h"
#include "runtime/remote_executor.h"

namespace moe::runtime {

ExecutorWorker::ExecutorWorker(Executor& executor, int listen_fd, double timeout_s,
                               std::function<void(const std::string&)> log)
    : executor_(executor), listen_fd_(listen_fd), timeout_s_(timeout_s), log_(std::move(log)) {
  MOE_CHECK(timeout_s > 0, kInvalidArgument, "executor worker: the timeout must be positive, got {} s", timeout_s);
  // Non-blocking, so that accepting a connection poll announced never blocks (it may have been
  // reset in between) and stop()'s shutdown wakes the wait.
  const int flags = ::fcntl(listen_fd, F_GETFL);
  MOE_CHECK(flags >= 0 && ::fcntl(listen_fd, F_SETFL, flags | O_NONBLOCK) == 0, kIo,
            "executor worker: not a usable listening socket (fd {}): {}", listen_fd, std::strerror(errno));
}

void ExecutorWorker::run() {
  while (!stopping_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, -1) < 0) {
      MOE_CHECK(errno == EINTR, kIo, "executor worker: waiting for a driver failed: {}", std::strerror(errno));
      continue;
    }
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (stopping_) break;
      MOE_CHECK(errno == EINTR || errno == EAGAIN || errno == ECONNABORTED, kIo,
                "executor worker: accepting a driver failed: {}", std::strerror(errno));
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // a step is one small frame each way
    {
      std::lock_guard<std::mutex> lock(driver_mu_);
      driver_fd_ = fd;
    }
    if (!stopping_) {  // stop() may have run before driver_fd_ was set: it sets stopping_ first
      log_("a driver connected");
      try {
        const int64_t left = serve_executor(executor_, fd, timeout_s_, listen_fd_);
        log_(left == 0 ? std::string("the driver disconnected")
                       : fmt::format("the driver disconnected; the {} sequence{} it left open are closed", left,
                                     left == 1 ? "" : "s"));
      } catch (const Error& e) {
        log_(fmt::format("the driver's connection ended: {}; its sequences are closed", e.what()));
      }
      ++drivers_;
    }
    {
      std::lock_guard<std::mutex> lock(driver_mu_);
      driver_fd_ = -1;
      ::close(fd);
    }
  }
}

void ExecutorWorker::stop() {
  stopping_ = true;
  ::shutdown(listen_fd_, SHUT_RDWR);  // wakes the wait for a driver
  std::lock_guard<std::mutex> lock(driver_mu_);
  if (driver_fd_ >= 0) ::shutdown(driver_fd_, SHUT_RDWR);  // the driver's next read sees the end
}

}  // namespace moe::runtime
