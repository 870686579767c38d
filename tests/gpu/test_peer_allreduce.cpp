// The peer all-reduce of the multi-GPU engine (src/backend/cuda/comm/peer_allreduce.h) on every GPU
// of the machine: each rank's result must be, bit for bit, the rank-order f32 sum of the
// partials rounded once to bf16 (the host computes it); calls of different sizes alternate so
// that both inbox parities are reused; replays of captured graphs see new data; a rank that
// never joins makes its peer report instead of hang. Skipped, visibly, with fewer than two GPUs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <string>

#include "backend/cuda/comm/peer_allreduce.h"
#include "core/rank_threads.h"
#include "gpu_test_util.h"
#include "../unit/test_util.h"
#include "moe/errors.h"

namespace moe {
namespace {

using gputest::DeviceBuffer;
using gputest::first_devices;

// partials[r]: rank r's values; the expected bits of every rank's result.
std::vector<uint16_t> rank_order_sum(const std::vector<std::vector<float>>& partials) {
  std::vector<uint16_t> out(partials[0].size());
  for (size_t i = 0; i < out.size(); ++i) {
    float s = 0.0f;
    for (const auto& p : partials) s += p[i];
    out[i] = f32_to_bf16(s);
  }
  return out;
}

// The all-reduce over GPUs 0..n-1 for up to `elements` values and, once make(r) has run (on any
// thread), rank r's non-blocking stream and buffer of `elements` bf16 values on GPU r. The streams
// go with it.
struct Ranks {
  cuda::PeerAllReduce ar;
  int64_t elements;
  std::vector<cudaStream_t> streams;
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> bufs;

  Ranks(int n, int64_t elements)
      : ar(first_devices(n), elements), elements(elements), streams(static_cast<size_t>(n)), bufs(static_cast<size_t>(n)) {}
  ~Ranks() {
    for (size_t r = 0; r < streams.size(); ++r)
      if (streams[r]) {
        cudaSetDevice(static_cast<int>(r));
        cudaStreamDestroy(streams[r]);
      }
  }
  void make(int r) {
    const size_t i = static_cast<size_t>(r);
    ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking), cudaSuccess);
    bufs[i] = std::make_unique<DeviceBuffer<uint16_t>>(static_cast<size_t>(elements));
  }
};

class PeerAllReduceTest : public ::testing::TestWithParam<int> {};

TEST_P(PeerAllReduceTest, EveryRankGetsTheRankOrderSumForEverySize) {
  const int n = GetParam();
  REQUIRE_PEER_GPUS(n);
  Ranks ranks(n, 2048 * 96);
  auto& [ar, max_elements, streams, bufs] = ranks;
  for (int r = 0; r < n; ++r) ASSERT_NO_FATAL_FAILURE(ranks.make(r));
  RankThreads threads(n);
  std::mt19937 rng(11);
  // Shapes from one 8-element row (one block) to the maximum (every block, several rows each),
  // odd row counts between; the order alternates the inbox parity per shape.
  const std::pair<int64_t, int64_t> shapes[] = {{1, 8},    {1, 2048}, {96, 2048}, {1237, 8},
                                                {64, 2048}, {1, 8},    {96, 2048}, {3, 7168}};
  for (const auto& [rows, hidden] : shapes) {
    const int64_t elements = rows * hidden;
    std::vector<std::vector<float>> partials;
    for (int r = 0; r < n; ++r) partials.push_back(gputest::random_bf16_exact(static_cast<size_t>(elements), rng, 1.0f));
    const auto expected = rank_order_sum(partials);
    std::vector<std::vector<uint16_t>> got(static_cast<size_t>(n));
    threads.run([&](int r) {
      const size_t i = static_cast<size_t>(r);
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      bufs[i]->poison();
      auto bits = gputest::to_bf16(partials[i]);
      ASSERT_EQ(cudaMemcpy(bufs[i]->get(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ar.run(r, bufs[i]->get(), rows, hidden, streams[i]);
      ASSERT_EQ(cudaStreamSynchronize(streams[i]), cudaSuccess);
      ar.check(r);
      got[i].resize(static_cast<size_t>(elements));
      ASSERT_EQ(cudaMemcpy(got[i].data(), bufs[i]->get(), got[i].size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    });
    for (int r = 0; r < n; ++r)
      ASSERT_EQ(got[static_cast<size_t>(r)], expected) << n << " GPUs, " << rows << " x " << hidden << ", rank " << r;
  }
}

// Captured once per rank, replayed with new partials each time: the graph's kernels read the
// epoch from device memory, so replays keep the ranks in step.
TEST_P(PeerAllReduceTest, GraphReplaysSumNewData) {
  const int n = GetParam();
  REQUIRE_PEER_GPUS(n);
  Ranks ranks(n, 2048 * 8);
  auto& [ar, elements, streams, bufs] = ranks;
  std::vector<cudaGraphExec_t> execs(static_cast<size_t>(n));
  RankThreads threads(n);
  threads.run([&](int r) {
    const size_t i = static_cast<size_t>(r);
    ASSERT_NO_FATAL_FAILURE(ranks.make(r));
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(streams[i], cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ar.run(r, bufs[i]->get(), 8, 2048, streams[i]);
    ar.run(r, bufs[i]->get(), 4, 2048, streams[i]);  // the first half summed twice
    ASSERT_EQ(cudaStreamEndCapture(streams[i], &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&execs[i], graph, 0), cudaSuccess);
    cudaGraphDestroy(graph);
  });
  std::mt19937 rng(5);
  for (int replay = 0; replay < 3; ++replay) {
    std::vector<std::vector<float>> partials;
    for (int r = 0; r < n; ++r) partials.push_back(gputest::random_bf16_exact(static_cast<size_t>(elements), rng, 1.0f));
    // Second call: every rank holds the first sum; the sum of n equal bf16 values.
    auto expected = rank_order_sum(partials);
    std::vector<std::vector<float>> again(static_cast<size_t>(n), gputest::from_bf16(expected));
    for (auto& v : again) v.resize(static_cast<size_t>(elements / 2));
    const auto twice = rank_order_sum(again);
    std::copy(twice.begin(), twice.end(), expected.begin());
    std::vector<std::vector<uint16_t>> got(static_cast<size_t>(n));
    threads.run([&](int r) {
      const size_t i = static_cast<size_t>(r);
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      bufs[i]->upload(gputest::to_bf16(partials[i]));
      ASSERT_EQ(cudaGraphLaunch(execs[i], streams[i]), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(streams[i]), cudaSuccess);
      ar.check(r);
      got[i] = bufs[i]->download();
    });
    for (int r = 0; r < n; ++r) ASSERT_EQ(got[static_cast<size_t>(r)], expected) << "replay " << replay << ", rank " << r;
  }
  for (int r = 0; r < n; ++r) {
    cudaSetDevice(r);
    cudaGraphExecDestroy(execs[static_cast<size_t>(r)]);
  }
}

// The folded residual add and norm: residual rows exactly as add_rms_norm adds them (the same
// f32 operations in the same order), normed rows within one bf16 rounding (the sum of squares
// is reduced in another order on the host), the partial rows left untouched.
TEST_P(PeerAllReduceTest, FoldedResidualAddAndNormMatchTheHost) {
  const int n = GetParam();
  REQUIRE_PEER_GPUS(n);
  const int64_t hidden = 2048, max_rows = 70;
  cuda::PeerAllReduce ar(first_devices(n), max_rows * hidden);
  RankThreads threads(n);
  std::mt19937 rng(3);
  const float eps = 1e-6f;
  for (int64_t rows : {int64_t{1}, int64_t{3}, max_rows}) {
    for (bool extra : {false, true}) {
      const size_t count = static_cast<size_t>(rows * hidden);
      std::vector<std::vector<float>> partials;
      for (int r = 0; r < n; ++r) partials.push_back(gputest::random_bf16_exact(count, rng, 1.0f));
      const auto residual = gputest::random_bf16_exact(count, rng, 4.0f);
      const auto branch2 = gputest::random_bf16_exact(count, rng, 1.0f);
      const auto weight = gputest::random_bf16_exact(static_cast<size_t>(hidden), rng, 1.0f);
      const auto sum = gputest::from_bf16(rank_order_sum(partials));
      std::vector<float> want_x(count), want_normed(count);
      for (int64_t t = 0; t < rows; ++t) {
        double ss = 0;
        for (int64_t h = 0; h < hidden; ++h) {
          const size_t i = static_cast<size_t>(t * hidden + h);
          float a = residual[i] + sum[i];
          if (extra) a += branch2[i];
          want_x[i] = a;
          ss += static_cast<double>(a) * a;
        }
        const double inv = 1.0 / std::sqrt(ss / static_cast<double>(hidden) + eps);
        for (int64_t h = 0; h < hidden; ++h) {
          const size_t i = static_cast<size_t>(t * hidden + h);
          want_normed[i] = static_cast<float>(weight[static_cast<size_t>(h)] * (want_x[i] * inv));
        }
      }
      threads.run([&](int r) {
        const size_t i = static_cast<size_t>(r);
        ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
        const auto bits = gputest::to_bf16(partials[i]);
        DeviceBuffer<uint16_t> data(bits), b2(gputest::to_bf16(branch2)), normed(count);
        DeviceBuffer<float> x(residual), w(weight);
        normed.poison();
        cuda::PeerAllReduce::AddNorm fold{x.get(), extra ? b2.get() : nullptr, w.get(), eps, normed.get()};
        ar.run(r, data.get(), rows, hidden, nullptr, &fold);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        ar.check(r);
        EXPECT_EQ(data.download(), bits) << "the partial rows were changed";
        EXPECT_EQ(x.download(), want_x) << rows << " rows, rank " << r;
        EXPECT_LE(gputest::max_rel_error(gputest::from_bf16(normed.download()), want_normed), 1.0 / 128)
            << rows << " rows, rank " << r;
      });
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Gpus, PeerAllReduceTest, ::testing::Values(2, 4));

// Rank 1 never calls: rank 0's wait gives up after its timeout and check() names the peer.
TEST(PeerAllReduce, AMissingRankIsReportedNotAwaitedForever) {
  REQUIRE_PEER_GPUS(2);
  cuda::PeerAllReduce ar({0, 1}, 1024, 0.2);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  DeviceBuffer<uint16_t> buf(1024);
  const auto t0 = std::chrono::steady_clock::now();
  ar.run(0, buf.get(), 1, 1024, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  try {
    ar.check(0);
    FAIL() << "a rank that never joined was not reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
    EXPECT_NE(std::string(e.what()).find("GPU 1 did not arrive"), std::string::npos) << e.what();
  }
  EXPECT_LT(s, 5.0) << "the wait is bounded by 0.2 s";
}

TEST(PeerAllReduce, BadArgumentsAreRefused) {
  REQUIRE_GPU();
  EXPECT_THROW(cuda::PeerAllReduce({0}, 12), Error);   // not a multiple of 8
  EXPECT_THROW(cuda::PeerAllReduce({}, 64), Error);    // no GPU
  cuda::PeerAllReduce one({0}, 64);                    // one GPU: nothing to sum
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  DeviceBuffer<uint16_t> buf(64);
  const std::vector<uint16_t> bits(64, 0x3f80);  // 1.0
  buf.upload(bits);
  one.run(0, buf.get(), 2, 32, nullptr);
  EXPECT_EQ(buf.download(), bits);
  EXPECT_THROW(one.run(0, buf.get(), 9, 8, nullptr), Error);   // past max_elements
  EXPECT_THROW(one.run(0, buf.get(), 1, 12, nullptr), Error);  // a row not of 8-element vectors
  EXPECT_THROW(one.run(1, buf.get(), 8, 8, nullptr), Error);   // no such rank
  cuda::PeerAllReduce::AddNorm no_weight;
  EXPECT_THROW(one.run(0, buf.get(), 8, 8, nullptr, &no_weight), Error);
  // The folded norm holds a row in registers: hidden at most kMaxNormHidden.
  const int64_t wide = cuda::PeerAllReduce::kMaxNormHidden + 8;
  cuda::PeerAllReduce big({0}, wide);
  DeviceBuffer<uint16_t> row(static_cast<size_t>(wide)), normed(static_cast<size_t>(wide));
  DeviceBuffer<float> residual(static_cast<size_t>(wide)), weight(static_cast<size_t>(wide));
  cuda::PeerAllReduce::AddNorm fold{residual.get(), nullptr, weight.get(), 1e-6f, normed.get()};
  std::string why;
  EXPECT_EQ(test::error_kind_of([&] { big.run(0, row.get(), 1, wide, nullptr, &fold); }, &why),
            ErrorKind::kInvalidArgument);
  EXPECT_NE(why.find("hidden at most"), std::string::npos) << why;
}

}  // namespace
}  // namespace moe
