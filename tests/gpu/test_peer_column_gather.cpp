// The column gather of the multi-GPU engine's head (src/backend/cuda/comm/peer_column_gather.h)
// on the GPUs of the machine: after each call the first rank's output holds every rank's columns
// exactly as written, and nothing past each row's `cols`; consecutive calls and graph replays
// carry new data; a rank that never arrives is reported by name instead of awaited forever.
// Skipped, visibly, with fewer than two GPUs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <tuple>

#include "backend/cuda/comm/peer_column_gather.h"
#include "core/rank_threads.h"
#include "gpu_test_util.h"
#include "../unit/test_util.h"
#include "moe/errors.h"

namespace moe {
namespace {

using gputest::DeviceBuffer;
using gputest::first_devices;

// A value no other (call, row, column) shares, exact in f32.
float value(int call, int64_t row, int64_t col) { return static_cast<float>(call * 1000003 + row * 4099 + col) * 0.5f; }

// The first rank's expected output [rows, ld] for `call`: every column written, the rest left
// as the poison (all bits set) the output starts with.
std::vector<float> expected(int call, int64_t rows, int64_t cols, int64_t ld) {
  float poison;
  const uint32_t bits = 0xffffffffu;
  std::memcpy(&poison, &bits, 4);
  std::vector<float> out(static_cast<size_t>(rows * ld), poison);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[static_cast<size_t>(r * ld + c)] = value(call, r, c);
  return out;
}

// Rank `rank`'s columns of `call` as it writes them: [rows, columns(rank)].
std::vector<float> share(const cuda::PeerColumnGather& g, int rank, int call, int64_t rows) {
  const int64_t first = g.first_column(rank), n = g.columns(rank);
  std::vector<float> s(static_cast<size_t>(rows * n));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) s[static_cast<size_t>(r * n + c)] = value(call, r, first + c);
  return s;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

class PeerColumnGatherTest : public ::testing::TestWithParam<int> {};

// Shards of whole 128-column units, the last one the remainder; row counts from 1 to the
// maximum; the output's rows longer than `cols`. Three calls are enqueued back to back before
// any wait, so each rank's shard is rewritten only after the first rank has copied it.
TEST_P(PeerColumnGatherTest, TheFirstRankHoldsEveryRanksColumns) {
  const int n = GetParam();
  REQUIRE_PEER_GPUS(n);
  const int64_t max_rows = 5, cols = 1000, ld = 1003;
  cuda::PeerColumnGather g(first_devices(n), max_rows, cols);
  int64_t covered = 0;
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(g.first_column(r), covered);
    if (r + 1 < n) {
      EXPECT_EQ(g.columns(r) % cuda::PeerColumnGather::kColumnUnit, 0) << "rank " << r;
    }
    covered += g.columns(r);
  }
  ASSERT_EQ(covered, cols);
  RankThreads threads(n);
  const int64_t rows_of_call[] = {1, max_rows, 3};
  std::vector<std::vector<float>> got(3);
  threads.run([&](int r) {
    ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    std::vector<std::vector<float>> shares;
    for (int call = 0; call < 3; ++call) shares.push_back(share(g, r, call, rows_of_call[call]));
    std::vector<std::unique_ptr<DeviceBuffer<float>>> outs;
    for (int call = 0; call < 3; ++call) {
      const int64_t rows = rows_of_call[call];
      const auto& mine = shares[static_cast<size_t>(call)];
      if (r == 0) {
        outs.push_back(std::make_unique<DeviceBuffer<float>>(static_cast<size_t>(max_rows * ld)));
        outs.back()->poison();  // on the legacy stream, which this one does not wait for
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const size_t width = static_cast<size_t>(g.columns(0)) * 4;
        ASSERT_EQ(cudaMemcpy2DAsync(outs.back()->get(), static_cast<size_t>(ld) * 4, mine.data(), width, width,
                                    static_cast<size_t>(rows), cudaMemcpyHostToDevice, stream),
                  cudaSuccess);
        g.gather(outs.back()->get(), rows, ld, stream);
      } else {
        g.before_write(r, stream);
        ASSERT_EQ(cudaMemcpyAsync(g.shard(r), mine.data(), mine.size() * 4, cudaMemcpyHostToDevice, stream),
                  cudaSuccess);
        g.after_write(r, stream);
      }
    }
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    g.check(r);
    if (r == 0)
      for (int call = 0; call < 3; ++call) {
        auto all = outs[static_cast<size_t>(call)]->download();
        all.resize(static_cast<size_t>(rows_of_call[call] * ld));
        got[static_cast<size_t>(call)] = all;
      }
    cudaStreamDestroy(stream);
  });
  for (int call = 0; call < 3; ++call)
    EXPECT_TRUE(same_bits(got[static_cast<size_t>(call)], expected(call, rows_of_call[call], cols, ld)))
        << n << " GPUs, call " << call << ", " << rows_of_call[call] << " rows";
}

// Captured once per rank, replayed with new shares: the kernels count calls in device memory,
// so replays keep the ranks in step.
TEST_P(PeerColumnGatherTest, GraphReplaysGatherNewData) {
  const int n = GetParam();
  REQUIRE_PEER_GPUS(n);
  const int64_t rows = 2, cols = 4 * 128 + 77;
  cuda::PeerColumnGather g(first_devices(n), rows, cols);
  RankThreads threads(n);
  std::vector<cudaStream_t> streams(static_cast<size_t>(n));
  std::vector<cudaGraphExec_t> execs(static_cast<size_t>(n));
  std::vector<std::unique_ptr<DeviceBuffer<float>>> sources(static_cast<size_t>(n)), outs(static_cast<size_t>(n));
  threads.run([&](int r) {
    const size_t i = static_cast<size_t>(r);
    ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking), cudaSuccess);
    const int64_t mine = g.columns(r);
    sources[i] = std::make_unique<DeviceBuffer<float>>(static_cast<size_t>(rows * (mine > 0 ? mine : 1)));
    if (r == 0) outs[i] = std::make_unique<DeviceBuffer<float>>(static_cast<size_t>(rows * cols));
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(streams[i], cudaStreamCaptureModeThreadLocal), cudaSuccess);
    if (r == 0) {
      if (mine > 0) {
        ASSERT_EQ(cudaMemcpy2DAsync(outs[i]->get(), cols * 4, sources[i]->get(), mine * 4, mine * 4, rows,
                                    cudaMemcpyDeviceToDevice, streams[i]),
                  cudaSuccess);
      }
      g.gather(outs[i]->get(), rows, cols, streams[i]);
    } else {
      g.before_write(r, streams[i]);
      if (mine > 0) {
        ASSERT_EQ(cudaMemcpyAsync(g.shard(r), sources[i]->get(), static_cast<size_t>(rows * mine) * 4,
                                  cudaMemcpyDeviceToDevice, streams[i]),
                  cudaSuccess);
      }
      g.after_write(r, streams[i]);
    }
    ASSERT_EQ(cudaStreamEndCapture(streams[i], &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&execs[i], graph, 0), cudaSuccess);
    cudaGraphDestroy(graph);
  });
  for (int replay = 0; replay < 3; ++replay) {
    std::vector<float> got;
    threads.run([&](int r) {
      const size_t i = static_cast<size_t>(r);
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      if (g.columns(r) > 0) sources[i]->upload(share(g, r, replay, rows));
      if (r == 0) outs[i]->poison();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the poison and upload ran on the legacy stream
      ASSERT_EQ(cudaGraphLaunch(execs[i], streams[i]), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(streams[i]), cudaSuccess);
      g.check(r);
      if (r == 0) got = outs[i]->download();
    });
    EXPECT_TRUE(same_bits(got, expected(replay, rows, cols, cols))) << n << " GPUs, replay " << replay;
  }
  for (int r = 0; r < n; ++r) {
    cudaSetDevice(r);
    cudaGraphExecDestroy(execs[static_cast<size_t>(r)]);
    cudaStreamDestroy(streams[static_cast<size_t>(r)]);
  }
}

INSTANTIATE_TEST_SUITE_P(Gpus, PeerColumnGatherTest, ::testing::Values(2, 4));

// Rank 1 never writes: the first rank's gather gives up after its timeout and check() names
// GPU 1; then rank 1 alone starts a second call, whose wait for the first rank's release of the
// first call (never given) gives up too and names GPU 0.
TEST(PeerColumnGather, AMissingRankIsReportedNotAwaitedForever) {
  REQUIRE_PEER_GPUS(2);
  cuda::PeerColumnGather g({0, 1}, 1, 256, 0.2);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  DeviceBuffer<float> out(256);
  const auto t0 = std::chrono::steady_clock::now();
  g.gather(out.get(), 1, 256, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0)
      << "the wait is bounded by 0.2 s";
  std::string why;
  EXPECT_EQ(test::error_kind_of([&] { g.check(0); }, &why), ErrorKind::kInternal);
  EXPECT_NE(why.find("GPU 1 did not arrive"), std::string::npos) << why;
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  cuda::PeerColumnGather h({0, 1}, 1, 256, 0.2);
  h.before_write(1, nullptr);
  h.after_write(1, nullptr);
  h.before_write(1, nullptr);  // call 2 waits for the release of call 1, which never comes
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(test::error_kind_of([&] { h.check(1); }, &why), ErrorKind::kInternal);
  EXPECT_NE(why.find("GPU 0 did not arrive"), std::string::npos) << why;
}

// Refused before any device is touched: runs without a GPU too.
TEST(PeerColumnGather, BadShapesAreRefusedBeforeAnyDeviceWork) {
  std::string why;
  EXPECT_EQ(test::error_kind_of([&] { cuda::PeerColumnGather({}, 4, 256); }, &why), ErrorKind::kInvalidArgument);
  EXPECT_NE(why.find("1 to 8 GPUs, got 0"), std::string::npos) << why;
  EXPECT_EQ(test::error_kind_of([&] { cuda::PeerColumnGather(first_devices(9), 4, 256); }, &why),
            ErrorKind::kInvalidArgument);
  EXPECT_NE(why.find("got 9"), std::string::npos) << why;
  for (const auto& [rows, cols, timeout] : {std::tuple{int64_t{0}, int64_t{256}, 10.0}, std::tuple{int64_t{4}, int64_t{0}, 10.0},
                                            std::tuple{int64_t{4}, int64_t{256}, 0.0}}) {
    EXPECT_EQ(test::error_kind_of([&] { cuda::PeerColumnGather({0}, rows, cols, timeout); }, &why),
              ErrorKind::kInvalidArgument)
        << rows << " rows, " << cols << " columns, timeout " << timeout;
    EXPECT_NE(why.find("both positive"), std::string::npos) << why;
  }
}

TEST(PeerColumnGather, BadArgumentsAreRefused) {
  REQUIRE_GPU();
  std::string why;
  cuda::PeerColumnGather one({0}, 4, 300);  // one GPU: every column is its own
  EXPECT_EQ(one.first_column(0), 0);
  EXPECT_EQ(one.columns(0), 300);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  DeviceBuffer<float> out(4 * 300);
  out.upload(std::vector<float>(4 * 300, 2.5f));
  one.gather(out.get(), 4, 300, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(out.download(), std::vector<float>(4 * 300, 2.5f));
  EXPECT_EQ(test::error_kind_of([&] { one.gather(out.get(), 5, 300, nullptr); }, &why), ErrorKind::kInvalidArgument);
  EXPECT_NE(why.find("at most 4"), std::string::npos) << why;
  EXPECT_EQ(test::error_kind_of([&] { one.gather(out.get(), 1, 299, nullptr); }, &why), ErrorKind::kInvalidArgument);
  EXPECT_EQ(test::error_kind_of([&] { one.shard(0); }, &why), ErrorKind::kInvalidArgument);
  EXPECT_NE(why.find("writes into the output itself"), std::string::npos) << why;
  EXPECT_EQ(test::error_kind_of([&] { one.columns(1); }, &why), ErrorKind::kInvalidArgument);
}

}  // namespace
}  // namespace moe
