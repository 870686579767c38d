#include "runtime/remote_executor.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <set>

#include "core/byte_io.h"
#include "core/socket_io.h"
#include "moe/errors.h"
#include "runtime/step_wire.h"

namespace moe::runtime {

namespace {

enum class Call : uint8_t { kLimits = 1, kOpen, kClose, kLength, kReusePrefix, kKvUsage, kGroupOf, kGroupKvUsage, kRun };
constexpr uint8_t kOk = 0, kFailed = 1;
constexpr uint8_t kLastErrorKind = static_cast<uint8_t>(ErrorKind::kInternal);

using Out = ByteWriter;

// A request or reply being read; every read checks that its bytes are there.
class In {
 public:
  In(std::span<const uint8_t> bytes, const char* what) : in_(bytes), what_(what) {}
  template <typename T>
  T get() {
    T v;
    MOE_CHECK(in_.read(&v), kFormat, "{}: {} bytes end early", what_, in_.size());
    return v;
  }
  std::span<const uint8_t> rest() { return in_.rest(); }
  void end() const { MOE_CHECK(in_.left() == 0, kFormat, "{}: {} bytes past its end", what_, in_.left()); }

 private:
  ByteReader in_;
  const char* what_;
};

// One line for a stream that failed; `inside`: after the first byte of a message.
[[noreturn]] void stream_failed(net::Io io, const char* peer, double timeout_s, bool inside) {
  if (io == net::Io::kTimedOut) MOE_THROW(kIo, "{}: no answer within {} s", peer, timeout_s);
  MOE_CHECK(io != net::Io::kClosed, kIo, "{}: the connection closed{}", peer, inside ? " inside a message" : "");
  MOE_THROW(kIo, "{}: the connection failed ({})", peer, std::strerror(errno));
}

// The u32 byte count, then the bytes, all sent by `deadline`.
void send_frame(int fd, const std::vector<uint8_t>& bytes, net::Deadline deadline, double timeout_s,
                const char* peer) {
  MOE_CHECK(bytes.size() <= kMaxFrameBytes, kInvalidArgument, "{}: a message of {} bytes is past the {} byte limit",
            peer, bytes.size(), kMaxFrameBytes);
  const auto n = static_cast<uint32_t>(bytes.size());
  net::Io io = net::send_all(fd, &n, 4, deadline);
  if (io == net::Io::kDone) io = net::send_all(fd, bytes.data(), bytes.size(), deadline);
  if (io != net::Io::kDone) stream_failed(io, peer, timeout_s, false);
}

// A frame whose first byte arrives by `first_byte` and the rest within `timeout_s` of it: a peer
// that trickles a message is cut off like a silent one. nullopt when the peer closed the
// connection between messages.
std::optional<std::vector<uint8_t>> recv_frame(int fd, net::Deadline first_byte, double timeout_s,
                                               const char* peer) {
  uint8_t head[4];
  size_t got = 0;
  net::Io io = net::recv_all(fd, head, 1, first_byte, &got);
  if (io == net::Io::kClosed) return std::nullopt;
  if (io != net::Io::kDone) stream_failed(io, peer, timeout_s, false);
  const net::Deadline rest_by = net::after(timeout_s);
  io = net::recv_all(fd, head + 1, 3, rest_by, &got);
  if (io != net::Io::kDone) stream_failed(io, peer, timeout_s, true);
  uint32_t n = 0;
  std::memcpy(&n, head, 4);
  MOE_CHECK(n <= kMaxFrameBytes, kFormat, "{}: a message of {} bytes is past the {} byte limit", peer, n,
            kMaxFrameBytes);
  std::vector<uint8_t> bytes(n);
  io = net::recv_all(fd, bytes.data(), n, rest_by, &got);
  if (io != net::Io::kDone) stream_failed(io, peer, timeout_s, true);
  return bytes;
}

constexpr const char* kWorker = "executor worker";
constexpr const char* kDriver = "executor driver";

Out request(Call c) { return Out{}.put(static_cast<uint8_t>(c)); }

KvUsage get_usage(In& in) {
  KvUsage u;
  u.total = in.get<int64_t>();
  u.free = in.get<int64_t>();
  u.cached = in.get<int64_t>();
  return u;
}

void put_usage(Out& out, const KvUsage& u) { out.put(u.total).put(u.free).put(u.cached); }

// The sequences one driver opened and has not closed. Closed when the driver goes, whichever way
// serve_executor ends, so that the next driver finds every block free again (published blocks
// stay findable for prefix reuse).
class DriverSequences {
 public:
  explicit DriverSequences(Executor& x) : x_(x) {}
  ~DriverSequences() { close_all(); }
  DriverSequences(const DriverSequences&) = delete;
  DriverSequences& operator=(const DriverSequences&) = delete;
  void opened(int32_t seq) { open_.insert(seq); }
  void closed(int32_t seq) { open_.erase(seq); }
  // Closes them all and returns how many there were.
  int64_t close_all() noexcept {
    const auto n = static_cast<int64_t>(open_.size());
    for (const int32_t seq : open_) {
      try {
        x_.close(seq);
      } catch (...) {  // an executor that cannot close one still closes the others
      }
    }
    open_.clear();
    return n;
  }

 private:
  Executor& x_;
  std::set<int32_t> open_;
};

// The reply to one request; throws what the executor throws (kFormat for a malformed request).
Out answer(Executor& x, In& in, Call call, DriverSequences& sequences) {
  Out out;
  switch (call) {
    case Call::kLimits: {
      in.end();
      const ExecutorLimits& l = x.limits();
      out.put(l.max_sequences).put(l.max_context).put(l.block_size).put(l.kv_blocks).put(l.vocab).put(l.groups);
      return out;
    }
    case Call::kOpen: {
      in.end();
      const int32_t seq = x.open();
      sequences.opened(seq);
      return out.put(seq);
    }
    case Call::kClose: {
      const auto seq = in.get<int32_t>();
      in.end();
      x.close(seq);
      sequences.closed(seq);
      return out;
    }
    case Call::kLength: {
      const auto seq = in.get<int32_t>();
      in.end();
      return out.put(x.length(seq));
    }
    case Call::kReusePrefix: {
      const auto seq = in.get<int32_t>();
      const std::span<const uint8_t> rest = in.rest();
      MOE_CHECK(rest.size() % 4 == 0, kFormat, "{}: a prefix of {} bytes is not whole token ids", kDriver, rest.size());
      std::vector<int32_t> tokens(rest.size() / 4);
      if (!tokens.empty()) std::memcpy(tokens.data(), rest.data(), rest.size());
      return out.put(x.reuse_prefix(seq, tokens));
    }
    case Call::kKvUsage:
      in.end();
      put_usage(out, x.kv_usage());
      return out;
    case Call::kGroupOf: {
      const auto seq = in.get<int32_t>();
      in.end();
      return out.put(static_cast<int32_t>(x.group_of(seq)));
    }
    case Call::kGroupKvUsage: {
      const auto group = in.get<int32_t>();
      in.end();
      put_usage(out, x.group_kv_usage(group));
      return out;
    }
    case Call::kRun: {
      const StepPlan plan = decode_plan(in.rest());
      return out.put_bytes(encode_result(x.run(plan)));
    }
  }
  MOE_THROW(kFormat, "{}: unknown call {}", kDriver, static_cast<int>(call));
}

}  // namespace

RemoteExecutor::RemoteExecutor(int fd, double timeout_s)
    : fd_(fd), timeout_s_(timeout_s) {
  MOE_CHECK(fd >= 0, kInvalidArgument, "{}: no connection (fd {})", kWorker, fd);
  try {
    MOE_CHECK(timeout_s > 0, kInvalidArgument, "{}: the timeout must be positive, got {} s", kWorker, timeout_s);
    ask_limits();
    cache_changes();
  } catch (...) {
    ::close(fd_);  // taken: a failed construction closes it too
    throw;
  }
}

void RemoteExecutor::ask_limits() {
  const std::vector<uint8_t> reply = call(request(Call::kLimits).bytes());
  In in(reply, "executor worker's limits");
  limits_.max_sequences = in.get<int64_t>();
  limits_.max_context = in.get<int64_t>();
  limits_.block_size = in.get<int64_t>();
  limits_.kv_blocks = in.get<int64_t>();
  limits_.vocab = in.get<int64_t>();
  limits_.groups = in.get<int64_t>();
  in.end();
  const ExecutorLimits& l = limits_;
  MOE_CHECK(l.max_sequences >= 1 && l.max_context >= 1 && l.block_size >= 1 && l.kv_blocks >= 1 && l.vocab >= 1 &&
                l.groups >= 1,
            kFormat, "{}: impossible limits ({} sequences, context {}, blocks {} of {}, vocabulary {}, {} groups)",
            kWorker, l.max_sequences, l.max_context, l.kv_blocks, l.block_size, l.vocab, l.groups);
}

RemoteExecutor::~RemoteExecutor() { ::close(fd_); }

std::vector<uint8_t> RemoteExecutor::call(const std::vector<uint8_t>& req) const {
  const net::Deadline deadline = net::after(timeout_s_);  // the whole call: request, work, reply
  send_frame(fd_, req, deadline, timeout_s_, kWorker);
  std::optional<std::vector<uint8_t>> reply = recv_frame(fd_, deadline, timeout_s_, kWorker);
  MOE_CHECK(reply.has_value(), kIo, "{}: the connection closed (did the worker exit?)", kWorker);
  In in(*reply, "executor worker's reply");
  const auto status = in.get<uint8_t>();
  if (status == kOk) {
    const std::span<const uint8_t> rest = in.rest();
    return {rest.begin(), rest.end()};
  }
  MOE_CHECK(status == kFailed, kFormat, "{}: a reply of status {}", kWorker, static_cast<int>(status));
  const auto kind = in.get<uint8_t>();
  MOE_CHECK(kind <= kLastErrorKind, kFormat, "{}: an error of kind {}", kWorker, static_cast<int>(kind));
  const std::span<const uint8_t> text = in.rest();
  throw Error(static_cast<ErrorKind>(kind), std::string(text.begin(), text.end()), __FILE__, __LINE__);
}

void RemoteExecutor::cache_changes() const {
  usage_.reset();
  group_usage_.assign(static_cast<size_t>(limits_.groups), std::nullopt);
}

int32_t RemoteExecutor::open() {
  cache_changes();
  const auto reply = call(request(Call::kOpen).bytes());
  In in(reply, "executor worker's open");
  const auto seq = in.get<int32_t>();
  in.end();
  return seq;
}

void RemoteExecutor::close(int32_t seq) {
  cache_changes();
  In(call(request(Call::kClose).put(seq).bytes()), "executor worker's close").end();
}

int64_t RemoteExecutor::length(int32_t seq) const {
  const auto reply = call(request(Call::kLength).put(seq).bytes());
  In in(reply, "executor worker's length");
  const auto n = in.get<int64_t>();
  in.end();
  return n;
}

int64_t RemoteExecutor::reuse_prefix(int32_t seq, std::span<const int32_t> tokens) {
  cache_changes();
  Out req = request(Call::kReusePrefix).put(seq);
  req.put_bytes({reinterpret_cast<const uint8_t*>(tokens.data()), tokens.size() * 4});
  const auto reply = call(req.bytes());
  In in(reply, "executor worker's prefix reuse");
  const auto n = in.get<int64_t>();
  in.end();
  return n;
}

KvUsage RemoteExecutor::kv_usage() const {
  if (usage_) return *usage_;
  const auto reply = call(request(Call::kKvUsage).bytes());
  In in(reply, "executor worker's cache usage");
  const KvUsage u = get_usage(in);
  in.end();
  usage_ = u;
  return u;
}

int RemoteExecutor::group_of(int32_t seq) const {
  const auto reply = call(request(Call::kGroupOf).put(seq).bytes());
  In in(reply, "executor worker's group");
  const auto g = in.get<int32_t>();
  in.end();
  MOE_CHECK(g >= 0 && g < limits_.groups, kFormat, "{}: group {} of {}", kWorker, g, limits_.groups);
  return g;
}

KvUsage RemoteExecutor::group_kv_usage(int group) const {
  const bool cacheable = group >= 0 && group < limits_.groups;  // else the worker refuses it
  if (cacheable && group_usage_[static_cast<size_t>(group)]) return *group_usage_[static_cast<size_t>(group)];
  const auto reply = call(request(Call::kGroupKvUsage).put(static_cast<int32_t>(group)).bytes());
  In in(reply, "executor worker's group cache usage");
  const KvUsage u = get_usage(in);
  in.end();
  if (cacheable) group_usage_[static_cast<size_t>(group)] = u;
  return u;
}

StepResult RemoteExecutor::run(const StepPlan& plan) {
  cache_changes();
  StepResult r = decode_result(call(request(Call::kRun).put_bytes(encode_plan(plan)).bytes()));
  MOE_CHECK(r.tokens.size() == plan.rows.size() && r.logits.size() == plan.rows.size(), kFormat,
            "{}: a result of {} rows for a step of {}", kWorker, r.tokens.size(), plan.rows.size());
  return r;
}

namespace {

// An error frame to a driver that connects to `listener` while another is served, then its
// connection closed. Its first request (RemoteExecutor asks for the limits at once) is read
// first, briefly: closing a socket with unread bytes would reset the connection, and the driver
// could lose the answer. False when the listener no longer accepts (it was shut down).
bool refuse_second_driver(int listener) {
  const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return errno == EINTR || errno == ECONNABORTED || errno == EAGAIN;
  try {
    recv_frame(fd, net::after(1.0), 1.0, kDriver);
  } catch (const Error&) {  // it sent nothing or garbage: it gets the answer all the same
  }
  const std::string why = "executor worker: busy with another driver (a worker serves one at a time)";
  Out reply = Out{}.put(kFailed).put(static_cast<uint8_t>(ErrorKind::kIo));
  reply.put_bytes({reinterpret_cast<const uint8_t*>(why.data()), why.size()});
  try {
    send_frame(fd, reply.bytes(), net::after(1.0), 1.0, kDriver);
  } catch (const Error&) {
  }
  ::close(fd);
  return true;
}

// Waits for the driver's next request on `fd`, refusing the drivers that connect to `listener`
// (-1: none) meanwhile. Returns when `fd` has bytes or has closed.
void wait_for_request(int fd, int& listener) {
  while (listener >= 0) {
    pollfd p[2] = {{fd, POLLIN, 0}, {listener, POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;  // recv_frame reports what is wrong with fd
    }
    if (p[0].revents != 0) return;  // the driver first: one that has just left is not busy
    if (p[1].revents != 0 && !refuse_second_driver(listener)) listener = -1;
  }
}

}  // namespace

int64_t serve_executor(Executor& executor, int fd, double timeout_s, int busy_listener) {
  MOE_CHECK(timeout_s > 0, kInvalidArgument, "{}: the timeout must be positive, got {} s", kDriver, timeout_s);
  DriverSequences sequences(executor);
  for (;;) {
    wait_for_request(fd, busy_listener);
    std::optional<std::vector<uint8_t>> req = recv_frame(fd, net::kNoDeadline, timeout_s, kDriver);
    if (!req) return sequences.close_all();
    Out reply;
    bool broken = false;  // the request itself could not be read
    try {
      In in(*req, "executor request");
      const auto call = in.get<uint8_t>();
      broken = call < static_cast<uint8_t>(Call::kLimits) || call > static_cast<uint8_t>(Call::kRun);
      MOE_CHECK(!broken, kFormat, "{}: unknown call {}", kDriver, static_cast<int>(call));
      reply = Out{}.put(kOk);
      reply.put_bytes(answer(executor, in, static_cast<Call>(call), sequences).bytes());
    } catch (const Error& e) {
      broken = broken || e.kind() == ErrorKind::kFormat;
      reply = Out{}.put(kFailed).put(static_cast<uint8_t>(e.kind()));
      reply.put_bytes({reinterpret_cast<const uint8_t*>(e.message().data()), e.message().size()});
    } catch (const std::exception& e) {
      const std::string text = e.what();
      reply = Out{}.put(kFailed).put(static_cast<uint8_t>(ErrorKind::kInternal));
      reply.put_bytes({reinterpret_cast<const uint8_t*>(text.data()), text.size()});
    }
    send_frame(fd, reply.bytes(), net::after(timeout_s), timeout_s, kDriver);
    if (broken) return sequences.close_all();
  }
}

}  // namespace moe::runtime
