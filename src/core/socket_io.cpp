#include "core/socket_io.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

namespace moe::net {

Deadline after(double seconds) {
  if (!(seconds >= 0) || seconds > 1e9) return kNoDeadline;
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

bool wait_fd(int fd, short events, Deadline deadline) {
  for (;;) {
    int wait_ms = -1;
    if (deadline != kNoDeadline) {
      // Rounded up, so that false always means the deadline has passed.
      const auto left = deadline - Clock::now();
      if (left <= Clock::duration::zero()) return false;
      wait_ms = static_cast<int>(std::min<long long>(std::chrono::ceil<std::chrono::milliseconds>(left).count(), 1 << 30));
    }
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, wait_ms);
    if (rc > 0) return true;  // ready, or an error the next call reports
    if (rc < 0 && errno != EINTR) return false;
  }
}

Io send_all(int fd, const void* data, size_t n, Deadline deadline, double idle_s) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p += w;
      n -= static_cast<size_t>(w);
      if (idle_s > 0) deadline = after(idle_s);
    } else if (w < 0 && errno == EINTR) {
      continue;
    } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!wait_fd(fd, POLLOUT, deadline)) return Clock::now() >= deadline ? Io::kTimedOut : Io::kFailed;
    } else {
      return w < 0 && (errno == EPIPE || errno == ECONNRESET) ? Io::kClosed : Io::kFailed;
    }
  }
  return Io::kDone;
}

Io recv_all(int fd, void* data, size_t n, Deadline deadline, size_t* got) {
  char* p = static_cast<char*>(data);
  *got = 0;
  while (*got < n) {
    const ssize_t r = ::recv(fd, p + *got, n - *got, MSG_DONTWAIT);
    if (r > 0) {
      *got += static_cast<size_t>(r);
    } else if (r == 0) {
      return Io::kClosed;
    } else if (errno == EINTR) {
      continue;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!wait_fd(fd, POLLIN, deadline)) return Clock::now() >= deadline ? Io::kTimedOut : Io::kFailed;
    } else {
      return errno == ECONNRESET ? Io::kClosed : Io::kFailed;
    }
  }
  return Io::kDone;
}

}  // namespace moe::net
