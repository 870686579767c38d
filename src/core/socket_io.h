// Reads and writes on stream sockets bounded by a deadline: the one place that polls, retries
// EINTR and EAGAIN, and keeps a closed peer from raising SIGPIPE. Works on blocking and
// non-blocking sockets alike (every send and recv is non-blocking), so a deadline holds even where
// the socket would block. Errors are returned, not thrown: the HTTP server answers a slow client
// with a status, the executor's driver throws one line naming its peer.
#pragma once

#include <chrono>
#include <cstddef>

namespace moe::net {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;
inline constexpr Deadline kNoDeadline = Deadline::max();

// now + seconds; kNoDeadline for a negative or enormous duration.
Deadline after(double seconds);

enum class Io {
  kDone,
  kTimedOut,  // the deadline passed first
  kClosed,    // the peer closed the connection (for a read: before all bytes arrived)
  kFailed,    // a socket error; errno says which
};

// Waits until `fd` has `events` (or an error the next call reports); false at the deadline or on a
// poll error.
bool wait_fd(int fd, short events, Deadline deadline);

// Sends all `n` bytes before `deadline`. With idle_s > 0 the deadline moves to now + idle_s each
// time the peer accepts bytes: a peer that takes nothing for idle_s seconds is given up on.
Io send_all(int fd, const void* data, size_t n, Deadline deadline, double idle_s = 0);

// Receives exactly `n` bytes before `deadline`; `*got` tells how many arrived (0 with kClosed: the
// peer closed between messages).
Io recv_all(int fd, void* data, size_t n, Deadline deadline, size_t* got);

}  // namespace moe::net
