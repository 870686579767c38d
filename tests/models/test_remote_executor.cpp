// The executor across a socket (runtime/remote_executor.h): the scheduler driving a CPU executor
// through a socketpair and a worker thread generates exactly what it generates with the executor
// in hand; a refused call comes back with its kind and message; a worker that dies, stalls or
// answers garbage is reported in one line instead of hanging the driver; a driver that sends
// garbage gets an error and the worker stops reading; the sequences a driver leaves open are
// closed when it goes, and a worker process (ExecutorWorker) serves drivers one after another
// over TCP, refusing a second one meanwhile.
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>

#include "backend/cpu/cpu_executor.h"
#include "core/tcp_endpoint.h"
#include "model/model.h"
#include "runtime/executor_worker.h"
#include "runtime/remote_executor.h"
#include "serve/scheduler.h"
#include "../support/fixtures.h"
#include "../unit/test_util.h"

namespace moe {
namespace {

using runtime::RemoteExecutor;
using serve::Event;
using serve::RequestOptions;
using serve::Scheduler;
using test::expect_error;
using test::fixture_dir;

struct SocketPair {
  int driver = -1, worker = -1;
  SocketPair() {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    driver = fds[0];
    worker = fds[1];
  }
  ~SocketPair() {
    if (worker >= 0) ::close(worker);
  }
};

cpu::ExecutorOptions small_pool() {
  cpu::ExecutorOptions o;
  o.kv_blocks = 10;  // tight enough that the mix below preempts
  o.block_size = 8;
  o.max_sequences = 4;
  return o;
}

// Every request's tokens when a scheduler over `x` runs them all, with the prompts and lengths
// drawn from `seed`; *preemptions and *prefix_hits receive the scheduler's counts.
std::map<uint64_t, std::vector<int32_t>> serve_all(runtime::Executor& x, uint32_t seed, int64_t vocab,
                                                   int64_t* preemptions, int64_t* prefix_hits) {
  Scheduler s(x, serve::SchedulerConfig{24, 0, true});
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 7; ++i) {
    std::vector<int32_t> prompt(static_cast<size_t>(5 + 9 * i % 31));
    for (auto& t : prompt) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
    if (i == 6) prompt.insert(prompt.begin(), prompts[3].begin(), prompts[3].end());  // four cached blocks
    prompts.push_back(prompt);
    RequestOptions o;
    o.max_tokens = 6 + i % 3;
    if (i % 2) o.sampling.temperature = 0.8f, o.sampling.seed = 100 + static_cast<uint64_t>(i);
    s.submit(prompt, o);
  }
  std::map<uint64_t, std::vector<int32_t>> out;
  for (int step = 0; s.busy() && step < 1000; ++step)
    for (const Event& e : s.step())
      if (e.token >= 0) out[e.id].push_back(e.token);
  EXPECT_FALSE(s.busy()) << "the scheduler made no progress";
  *preemptions = s.stats().preemptions;
  *prefix_hits = s.stats().prefix_hit_tokens;
  return out;
}

// serve_executor on a thread of its own; *failure receives what it throws.
std::thread serve_catching(runtime::Executor& x, int fd, double timeout_s, std::optional<Error>* failure) {
  return std::thread([&x, fd, timeout_s, failure] {
    try {
      runtime::serve_executor(x, fd, timeout_s);
    } catch (const Error& e) {
      *failure = e;
    }
  });
}

TEST(RemoteExecutor, TheSchedulerAcrossASocketGeneratesWhatItDoesInProcess) {
  auto model = Model::load(fixture_dir("tiny_qwen3_moe"));
  const int64_t vocab = model->config().vocab_size;
  cpu::Executor local(*model, small_pool());
  int64_t preemptions = 0, hits = 0, remote_preemptions = 0, remote_hits = 0;
  const auto want = serve_all(local, 7, vocab, &preemptions, &hits);
  EXPECT_GT(preemptions, 0) << "the workload should make the scheduler preempt";
  EXPECT_GT(hits, 0) << "the workload should reuse a cached prefix";

  cpu::Executor served(*model, small_pool());
  SocketPair sp;
  std::thread worker([&] { runtime::serve_executor(served, sp.worker); });
  {
    RemoteExecutor remote(sp.driver, 30.0);
    EXPECT_EQ(remote.limits().max_sequences, 4);
    EXPECT_EQ(remote.limits().kv_blocks, local.limits().kv_blocks);
    EXPECT_EQ(remote.limits().vocab, vocab);
    EXPECT_EQ(serve_all(remote, 7, vocab, &remote_preemptions, &remote_hits), want);
    EXPECT_EQ(remote_preemptions, preemptions);
    EXPECT_EQ(remote_hits, hits);
    EXPECT_EQ(remote.kv_usage().free, local.kv_usage().free);
  }  // closing the driver's end ends the worker's loop
  worker.join();
}

// The driver keeps the worker's cache usage between calls that change it: after each open, step,
// prefix reuse and close it reads what the worker's executor holds, never an earlier answer.
TEST(RemoteExecutor, CacheUsageFollowsEveryChange) {
  auto model = Model::load(fixture_dir("tiny_qwen3_moe"));
  cpu::Executor served(*model, small_pool());
  SocketPair sp;
  std::thread worker([&] { runtime::serve_executor(served, sp.worker); });
  {
    RemoteExecutor remote(sp.driver, 30.0);
    auto same = [&](const char* after) {
      const runtime::KvUsage got = remote.kv_usage(), want = served.kv_usage();
      EXPECT_EQ(got.free, want.free) << after;
      EXPECT_EQ(got.cached, want.cached) << after;
      EXPECT_EQ(remote.group_kv_usage(0).free, served.group_kv_usage(0).free) << after;
      EXPECT_EQ(remote.kv_usage().free, want.free) << after << " (asked twice)";
    };
    same("nothing");
    std::vector<int32_t> prompt(40);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(i * 7 + 3);
    const int32_t first = remote.open();
    same("open");
    runtime::StepPlan plan;
    plan.tokens = prompt;
    plan.rows.push_back({first, 0, static_cast<int32_t>(prompt.size()), true, {}, 0, runtime::RowLogits::kNone});
    remote.run(plan);
    same("a step");
    const int64_t before_close = remote.kv_usage().free;
    remote.close(first);
    same("close");
    EXPECT_GT(remote.kv_usage().free, before_close) << "closing freed nothing";
    const int32_t second = remote.open();
    EXPECT_GT(remote.reuse_prefix(second, prompt), 0) << "the closed sequence's blocks should be found";
    same("prefix reuse");
    remote.close(second);
    same("the last close");
  }
  worker.join();
}

TEST(RemoteExecutor, RefusedCallsComeBackWithTheirKindAndMessage) {
  auto model = Model::load(fixture_dir("tiny_qwen3_moe"));
  cpu::Executor local(*model, small_pool()), served(*model, small_pool());
  SocketPair sp;
  std::thread worker([&] { runtime::serve_executor(served, sp.worker); });
  {
    RemoteExecutor remote(sp.driver, 30.0);
    const Error want = expect_error([&] { local.length(77); });
    const Error got = expect_error([&] { remote.length(77); });
    EXPECT_EQ(got.kind(), want.kind());
    EXPECT_EQ(got.message(), want.message());
    runtime::StepPlan plan;
    const int32_t seq = remote.open();
    plan.tokens = {1, static_cast<int32_t>(model->config().vocab_size)};
    plan.rows.push_back({seq, 0, 2, true, {}, 0, runtime::RowLogits::kNone});
    const Error bad = expect_error([&] { remote.run(plan); });
    EXPECT_EQ(bad.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(bad.message().find("outside the vocabulary"), std::string::npos) << bad.message();
    EXPECT_EQ(remote.length(seq), 0);  // nothing ran; the worker still serves
    remote.close(seq);
  }
  worker.join();
}

// A stand-in worker: reads one request, then does `act` with its end of the socket.
void fake_worker(int fd, const std::function<void(int)>& act) {
  uint32_t n = 0;
  ASSERT_EQ(::read(fd, &n, 4), 4);
  std::vector<uint8_t> body(n);
  ASSERT_EQ(::read(fd, body.data(), n), static_cast<ssize_t>(n));
  act(fd);
}

void write_frame(int fd, const std::vector<uint8_t>& bytes, uint32_t declared) {
  ASSERT_EQ(::write(fd, &declared, 4), 4);
  if (!bytes.empty()) {
    ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  }
}

Error remote_refused(const std::function<void(int)>& act, double timeout_s = 10.0) {
  SocketPair sp;
  std::thread worker([&] { fake_worker(sp.worker, act); });
  Error e = expect_error([&] { RemoteExecutor remote(sp.driver, timeout_s); });
  ::shutdown(sp.worker, SHUT_RDWR);  // releases a stand-in that waits for the driver
  worker.join();
  return e;
}

TEST(RemoteExecutor, ADeadStalledOrGarbledWorkerIsReportedInOneLine) {
  // Exits (closes the connection) without answering.
  Error e = remote_refused([](int fd) { ::shutdown(fd, SHUT_RDWR); });
  EXPECT_EQ(e.kind(), ErrorKind::kIo);
  EXPECT_NE(e.message().find("the connection closed"), std::string::npos) << e.message();
  // Never answers.
  e = remote_refused([](int) {}, 0.2);
  EXPECT_EQ(e.kind(), ErrorKind::kIo);
  EXPECT_NE(e.message().find("no answer within 0.2 s"), std::string::npos) << e.message();
  // Announces a 4 GiB reply.
  e = remote_refused([](int fd) { write_frame(fd, {}, 0xffffffffu); });
  EXPECT_EQ(e.kind(), ErrorKind::kFormat);
  EXPECT_NE(e.message().find("past the 1073741824 byte limit"), std::string::npos) << e.message();
  // Dies inside its reply.
  e = remote_refused([](int fd) {
    write_frame(fd, {0, 1, 2}, 49);
    ::shutdown(fd, SHUT_RDWR);
  });
  EXPECT_EQ(e.kind(), ErrorKind::kIo);
  EXPECT_NE(e.message().find("closed inside a message"), std::string::npos) << e.message();
  // An unknown status, an unknown error kind, limits cut short, impossible limits.
  e = remote_refused([](int fd) { write_frame(fd, {7}, 1); });
  EXPECT_NE(e.message().find("a reply of status 7"), std::string::npos) << e.message();
  e = remote_refused([](int fd) { write_frame(fd, {1, 42, 'x'}, 3); });
  EXPECT_NE(e.message().find("an error of kind 42"), std::string::npos) << e.message();
  e = remote_refused([](int fd) { write_frame(fd, {0, 1, 0, 0, 0}, 5); });
  EXPECT_EQ(e.kind(), ErrorKind::kFormat);
  EXPECT_NE(e.message().find("end early"), std::string::npos) << e.message();
  e = remote_refused([](int fd) { write_frame(fd, std::vector<uint8_t>(49, 0), 49); });
  EXPECT_NE(e.message().find("impossible limits"), std::string::npos) << e.message();
  // Trickles a whole, well-formed reply, a byte every 20 ms (about a second): the timeout bounds
  // the call, not each wait, so the driver gives up after 0.3 s however steadily bytes come.
  e = remote_refused(
      [](int fd) {
        std::vector<uint8_t> frame(4 + 49, 0);
        frame[0] = 49;
        for (uint8_t b : frame) {
          if (::send(fd, &b, 1, MSG_NOSIGNAL) != 1) return;  // the driver gave up
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
      },
      0.3);
  EXPECT_EQ(e.kind(), ErrorKind::kIo);
  EXPECT_NE(e.message().find("no answer within 0.3 s"), std::string::npos) << e.message();
}

// The worker waits for a driver between requests as long as it takes, but not inside one: a
// request begun and left unfinished, or trickled, ends the worker with one line.
TEST(RemoteExecutor, ADriverStalledInsideARequestEndsTheWorker) {
  auto model = Model::load(fixture_dir("tiny_qwen3_moe"));
  cpu::Executor served(*model, small_pool());
  for (bool trickle : {false, true}) {
    SocketPair sp;
    std::optional<Error> failure;
    std::thread worker = serve_catching(served, sp.worker, 0.3, &failure);
    // Half a frame header; then, when trickling, the rest of a limits request a byte every 20 ms.
    const uint8_t request[5] = {1, 0, 0, 0, 1};
    ASSERT_EQ(::write(sp.driver, request, 2), 2);
    if (trickle)
      for (int i = 2; i < 5; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(150));
        if (::send(sp.driver, request + i, 1, MSG_NOSIGNAL) != 1) break;
      }
    worker.join();
    ASSERT_TRUE(failure.has_value()) << (trickle ? "trickled" : "stalled") << " request served";
    EXPECT_EQ(failure->kind(), ErrorKind::kIo);
    EXPECT_NE(failure->message().find("executor driver: no answer within 0.3 s"), std::string::npos)
        << failure->message();
    ::close(sp.driver);
  }
}

TEST(RemoteExecutor, AGarbledRequestGetsAnErrorAndEndsTheWorker) {
  auto model = Model::load(fixture_dir("tiny_qwen3_moe"));
  cpu::Executor served(*model, small_pool());
  for (const std::vector<uint8_t>& request : {std::vector<uint8_t>{99}, std::vector<uint8_t>{2, 0},
                                              std::vector<uint8_t>{9, 'n', 'o', 't', ' ', 'a', ' ', 'p'}}) {
    SocketPair sp;
    std::thread worker([&] { runtime::serve_executor(served, sp.worker); });
    write_frame(sp.driver, request, static_cast<uint32_t>(request.size()));
    uint32_t n = 0;
    ASSERT_EQ(::read(sp.driver, &n, 4), 4);
    std::vector<uint8_t> reply(n);
    ASSERT_EQ(::read(sp.driver, reply.data(), n), static_cast<ssize_t>(n));
    ASSERT_GE(reply.size(), 2u);
    EXPECT_EQ(reply[0], 1) << "not an error reply";
    EXPECT_EQ(reply[1], static_cast<uint8_t>(ErrorKind::kFormat));
    worker.join();  // returned after the error, without waiting for more
    ::close(sp.driver);
  }
}

// A step that prefills `n` tokens into each of `seqs`, so that they hold blocks.
runtime::StepPlan prefill(const std::vector<int32_t>& seqs, int32_t n) {
  runtime::StepPlan plan;
  for (size_t i = 0; i < seqs.size(); ++i) {
    for (int32_t t = 0; t < n; ++t) plan.tokens.push_back(static_cast<int32_t>(i * 31 + t * 7 + 1));
    plan.rows.push_back({seqs[i], static_cast<int32_t>(i) * n, n, true, {}, 0, runtime::RowLogits::kNone});
  }
  return plan;
}

// The executor holds no sequence: every block is free and max_sequences can be opened (then
// closed again).
void expect_no_sequence_open(runtime::Executor& x, const char* after) {
  EXPECT_EQ(x.kv_usage().free, x.kv_usage().total) << after;
  std::vector<int32_t> seqs;
  for (int64_t i = 0; i < x.limits().max_sequences; ++i) {
    try {
      seqs.push_back(x.open());
    } catch (const Error& e) {
      ADD_FAILURE() << after << ": only " << i << " of " << x.limits().max_sequences << " could be opened: " << e.what();
      break;
    }
  }
  for (const int32_t s : seqs) x.close(s);
}

// However a driver goes (it closes its end between requests, or stalls inside one), the
// sequences it opened and did not close are closed, and serve_executor says how many.
TEST(RemoteExecutor, TheSequencesADriverLeavesOpenAreClosedWhenItGoes) {
  auto model = Model::load(fixture_dir("tiny_qwen3_moe"));
  cpu::Executor served(*model, small_pool());
  {
    SocketPair sp;
    int64_t closed = -1;
    std::thread worker([&] { closed = runtime::serve_executor(served, sp.worker); });
    {
      RemoteExecutor remote(sp.driver, 30.0);
      std::vector<int32_t> seqs = {remote.open(), remote.open(), remote.open()};
      remote.run(prefill(seqs, 12));
      remote.close(seqs[1]);  // closed by the driver: not counted again
      EXPECT_LT(remote.kv_usage().free, remote.kv_usage().total);
    }
    worker.join();
    EXPECT_EQ(closed, 2);
    expect_no_sequence_open(served, "after a driver that left two sequences open");
  }
  {
    SocketPair sp;
    std::optional<Error> failure;
    std::thread worker = serve_catching(served, sp.worker, 0.3, &failure);
    {
      RemoteExecutor remote(::dup(sp.driver), 30.0);
      remote.run(prefill({remote.open(), remote.open()}, 9));
      const uint8_t half_a_header[2] = {1, 0};  // then nothing: the worker gives up on the request
      ASSERT_EQ(::write(sp.driver, half_a_header, 2), 2);
      worker.join();
    }
    ASSERT_TRUE(failure.has_value()) << "a stalled request was served";
    expect_no_sequence_open(served, "after a driver that stalled inside a request");
    ::close(sp.driver);
  }
}

// moe-server --serve-executor's loop: drivers over TCP one after another, each finding the
// executor as the worker loaded it (the one before left sequences open); a driver that connects
// while another is served gets one line; stop() ends the loop with a driver still connected.
TEST(ExecutorWorker, ServesDriversOneAfterAnotherRefusesASecondAtOnceAndStops) {
  auto model = Model::load(fixture_dir("tiny_qwen3_moe"));
  cpu::Executor served(*model, small_pool());
  int port = 0;
  const int listener = net::listen_tcp({"127.0.0.1", 0}, &port);
  std::mutex log_mu;
  std::vector<std::string> log;
  runtime::ExecutorWorker worker(served, listener, 30.0, [&](const std::string& line) {
    std::lock_guard<std::mutex> lock(log_mu);
    log.push_back(line);
  });
  std::thread serving([&] { worker.run(); });
  auto connect = [&] { return net::connect_tcp({"127.0.0.1", port}, 5.0); };
  auto wait_for_drivers = [&](int64_t n) {
    for (int i = 0; i < 500 && worker.drivers_served() < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_EQ(worker.drivers_served(), n);
  };
  {
    RemoteExecutor first(connect(), 30.0);
    const std::vector<int32_t> seqs = {first.open(), first.open(), first.open()};
    first.run(prefill(seqs, 20));
    std::string why;
    EXPECT_EQ(test::error_kind_of([&] { RemoteExecutor second(connect(), 30.0); }, &why), ErrorKind::kIo);
    EXPECT_NE(why.find("busy with another driver"), std::string::npos) << why;
    EXPECT_EQ(first.length(seqs[0]), 20) << "the first driver lost its sequences to the second";
  }
  wait_for_drivers(1);
  RemoteExecutor third(connect(), 30.0);
  EXPECT_EQ(third.kv_usage().free, third.kv_usage().total) << "the first driver's blocks are still held";
  std::vector<int32_t> seqs;
  for (int64_t i = 0; i < third.limits().max_sequences; ++i) seqs.push_back(third.open());
  third.run(prefill(seqs, 5));
  worker.stop();
  serving.join();
  EXPECT_EQ(test::error_kind_of([&] { third.kv_usage(); }), ErrorKind::kIo) << "a stopped worker still answers";
  ::close(listener);
  std::lock_guard<std::mutex> lock(log_mu);
  const auto has = [&](const std::string& text) {
    for (const std::string& line : log)
      if (line.find(text) != std::string::npos) return true;
    return false;
  };
  EXPECT_TRUE(has("the 3 sequences it left open are closed"));
  EXPECT_EQ(worker.drivers_served(), 2);
}

}  // namespace
}  // namespace moe
