// Expert parallelism on the GPUs of one machine (src/backend/cuda_ep.h): every backend, on two
// GPUs and on all of them, against the same layer on one GPU (cuda::Experts holding every
// expert), for token counts from one (fewer tokens than ranks) to a few hundred, with routing
// that leaves some ranks idle. The output must be identical on every rank, within bf16 rounding
// of the one-GPU result, and poisoned outputs must be fully written. p2p is also captured in a
// CUDA graph and replayed with new routing, and a rank that never joins makes its peer report a
// timeout instead of hanging. Under data-parallel attention (own tokens) each rank's rows come back
// to it alone. Skipped, visibly, with fewer than two GPUs (and, for the collective
// backends, without NCCL; for p2p, without peer access).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <optional>
#include <random>
#include <thread>

#include "backend/cuda_ep.h"
#include "backend/cuda_moe.h"
#include "dist/nccl_communicator.h"
#include "gpu_test_util.h"
#include "moe/errors.h"
#include "moe/placement.h"

namespace moe {
namespace {

using gputest::DeviceBuffer;
using Bits = std::vector<uint16_t>;

constexpr int64_t kExperts = 16, kHidden = 256, kInter = 128, kTopK = 4;
constexpr cuda::ExpertShape kShape{kExperts, kHidden, kInter, kTopK};
// The seed workload's layer: on sm_90 its experts split the down projection (f32 pieces that the
// p2p send-back sums per row).
constexpr cuda::ExpertShape kSeedShape{8, 512, 1024, 2};

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    n = 0;
  }
  return n;
}

using gputest::first_devices;

// The group sizes to test: 2 and, where there are more, all GPUs (at most 8).
std::vector<int> group_sizes() {
  const int n = std::min(device_count(), 8);
  std::vector<int> sizes{2};
  if (n > 2) sizes.push_back(n);
  return sizes;
}

struct Problem {
  cuda::ExpertShape shape;
  int64_t tokens = 0;
  Bits x, gate_up, down;        // bf16: x [T, H], all experts' weights
  std::vector<int32_t> ids;     // [T, k] ascending per token
  std::vector<float> weights;   // [T, k]
};

Bits random_bits(size_t n, std::mt19937& rng, float scale) {
  return gputest::to_bf16(gputest::random_bf16_exact(n, rng, scale));
}

// `skew` < 1 piles the routing onto the first experts, so the last ranks get few or no rows.
Problem make_problem(int64_t tokens, double skew, uint32_t seed, cuda::ExpertShape shape = kShape) {
  std::mt19937 rng(seed);
  Problem p;
  p.shape = shape;
  p.tokens = tokens;
  const int64_t E = shape.experts, H = shape.hidden, I = shape.inter, K = shape.top_k;
  p.x = random_bits(static_cast<size_t>(tokens * H), rng, 1.0f);
  p.gate_up = random_bits(static_cast<size_t>(E * 2 * I * H), rng, 0.06f);
  p.down = random_bits(static_cast<size_t>(E * H * I), rng, 0.06f);
  std::vector<double> w(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) w[static_cast<size_t>(e)] = std::pow(skew, static_cast<double>(e));
  for (int64_t t = 0; t < tokens; ++t) {
    const std::vector<int32_t> pick = gputest::draw_experts(w, K, rng);
    p.ids.insert(p.ids.end(), pick.begin(), pick.end());
    for (int64_t j = 0; j < K; ++j) p.weights.push_back(std::uniform_real_distribution<float>(0.1f, 1.0f)(rng));
  }
  return p;
}

// The layer on GPU 0 with every expert.
Bits one_gpu(const Problem& p) {
  EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
  const cuda::ExpertShape shape = p.shape;
  DeviceBuffer<uint16_t> gu(p.gate_up), dn(p.down), x(p.x), y(p.x.size());
  DeviceBuffer<int32_t> ids(p.ids);
  DeviceBuffer<float> w(p.weights);
  DeviceBuffer<unsigned char> ws(cuda::Experts::workspace_bytes(shape, p.tokens));
  cuda::Experts experts(gu.get(), dn.get(), shape, p.tokens, 0);
  y.poison();
  experts.forward(x.get(), ids.get(), w.get(), p.tokens, y.get(), ws.get(), nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return y.download();
}

// One rank's device copies: its block of experts and the replicated inputs.
struct RankData {
  DeviceBuffer<uint16_t> gate_up, down, x, out;
  DeviceBuffer<int32_t> ids;
  DeviceBuffer<float> weights;

  RankData(const Problem& p, int ranks, int rank)
      : gate_up(slice(p, p.gate_up, ranks, rank, 2 * p.shape.inter * p.shape.hidden)),
        down(slice(p, p.down, ranks, rank, p.shape.hidden * p.shape.inter)),
        x(p.x),
        out(p.x.size()),
        ids(p.ids),
        weights(p.weights) {
    out.poison();
  }
  static Bits slice(const Problem& p, const Bits& all, int ranks, int rank, int64_t per_expert) {
    ExpertPlacement pl(p.shape.experts, ranks, rank);
    const auto b = all.begin() + pl.first_expert() * per_expert;
    return Bits(b, b + pl.num_local() * per_expert);
  }
};

cuda::EpLayerConfig config(dist::EpBackend backend, int ranks, int rank, int64_t max_tokens,
                           cuda::ExpertShape shape = kShape, bool own_tokens = false) {
  return {.backend = backend, .rank = rank, .ranks = ranks, .device = rank, .experts = shape.experts,
          .hidden = shape.hidden, .inter = shape.inter, .top_k = shape.top_k, .max_tokens = max_tokens,
          .own_tokens = own_tokens};
}

// body(rank, comm, exchange) on the first `ranks` GPUs at once, one thread each: p2p over a
// P2pExchange of those sizes, the other backends over an NCCL group. Rethrows a rank's failure.
using RankBody = std::function<void(int, dist::Communicator*, cuda::P2pExchange*)>;
void on_ranks(dist::EpBackend backend, int ranks, int64_t hidden, int64_t top_k, int64_t max_tokens, bool own_tokens,
              const RankBody& body) {
  if (backend != dist::EpBackend::kP2p) {
    cuda::run_gpu_ranks(first_devices(ranks), [&](int r, dist::Communicator& comm) { body(r, &comm, nullptr); }, 60.0);
    return;
  }
  cuda::P2pExchange x(first_devices(ranks), hidden, top_k, max_tokens, 20.0, own_tokens);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r, nullptr, &x);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// Each rank's rows [rank * n, (rank + 1) * n) of the problem, as its own tokens.
Bits rows_of(const Bits& all, int rank, int64_t n, int64_t width) {
  return Bits(all.begin() + rank * n * width, all.begin() + (rank + 1) * n * width);
}
template <typename T>
std::vector<T> rows_of(const std::vector<T>& all, int rank, int64_t n, int64_t width) {
  return std::vector<T>(all.begin() + rank * n * width, all.begin() + (rank + 1) * n * width);
}

// Data-parallel attention: rank r passes its own `per_rank` rows of the problem (ranks * per_rank
// tokens) through a layer set up for `max_tokens` rows per rank, twice (the first call on other
// rows), and returns each rank's output rows.
std::vector<Bits> run_ep_own(dist::EpBackend backend, int ranks, const Problem& p, int64_t per_rank,
                             int64_t max_tokens) {
  std::vector<Bits> outs(static_cast<size_t>(ranks));
  const Problem warm = make_problem(p.tokens, 1.0, 98, p.shape);
  const int64_t H = p.shape.hidden, K = p.shape.top_k;
  auto body = [&](int r, dist::Communicator* comm, cuda::P2pExchange* x) {
    EXPECT_EQ(cudaSetDevice(r), cudaSuccess);
    const Bits gu = RankData::slice(p, p.gate_up, ranks, r, 2 * p.shape.inter * H);
    const Bits dn = RankData::slice(p, p.down, ranks, r, H * p.shape.inter);
    DeviceBuffer<uint16_t> gate_up(gu), down(dn), xs(rows_of(p.x, r, per_rank, H)),
        wx(rows_of(warm.x, r, per_rank, H)), out(static_cast<size_t>(per_rank * H));
    DeviceBuffer<int32_t> ids(rows_of(p.ids, r, per_rank, K)), wids(rows_of(warm.ids, r, per_rank, K));
    DeviceBuffer<float> w(rows_of(p.weights, r, per_rank, K)), ww(rows_of(warm.weights, r, per_rank, K));
    out.poison();
    cuda::EpExperts layer(config(backend, ranks, r, max_tokens, p.shape, true), gate_up.get(), down.get(), comm, x);
    cudaStream_t st;
    EXPECT_EQ(cudaStreamCreate(&st), cudaSuccess);
    layer.forward(wx.get(), wids.get(), ww.get(), per_rank, out.get(), st);
    out.poison();
    layer.forward(xs.get(), ids.get(), w.get(), per_rank, out.get(), st);
    layer.check(st);
    EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    outs[static_cast<size_t>(r)] = out.download();
    cudaStreamDestroy(st);
  };
  on_ranks(backend, ranks, H, K, max_tokens, true, body);
  return outs;
}

// Runs `backend` on the first `ranks` GPUs (two calls, so that the second reuses buffers that
// the first left dirty) and returns every rank's output of the second call.
std::vector<Bits> run_ep(dist::EpBackend backend, int ranks, const Problem& p) {
  std::vector<Bits> outs(static_cast<size_t>(ranks));
  const Problem warm = make_problem(p.tokens, 1.0, 99, p.shape);
  auto body = [&](int r, dist::Communicator* comm, cuda::P2pExchange* x) {
    EXPECT_EQ(cudaSetDevice(r), cudaSuccess);
    RankData d(p, ranks, r), w(warm, ranks, r);
    cuda::EpExperts layer(config(backend, ranks, r, p.tokens, p.shape), d.gate_up.get(), d.down.get(), comm, x);
    cudaStream_t st;
    EXPECT_EQ(cudaStreamCreate(&st), cudaSuccess);
    layer.forward(w.x.get(), w.ids.get(), w.weights.get(), p.tokens, w.out.get(), st);
    layer.forward(d.x.get(), d.ids.get(), d.weights.get(), p.tokens, d.out.get(), st);
    layer.check(st);
    EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    outs[static_cast<size_t>(r)] = d.out.download();
    cudaStreamDestroy(st);
  };
  on_ranks(backend, ranks, p.shape.hidden, p.shape.top_k, p.tokens, false, body);
  return outs;
}

// Every rank's output is the same, fully written, and each element is within a few bf16 steps
// (at the row's scale) of the one-GPU result: each rank rounds its partial sum to bf16 once and
// the sum of the partials is rounded once more.
void expect_close(const Bits& out, const Bits& want, const char* what, int64_t hidden) {
  const auto got = gputest::from_bf16(out), ref = gputest::from_bf16(want);
  ASSERT_EQ(got.size(), ref.size());
  double worst = 0;
  for (size_t t = 0; t * hidden < ref.size(); ++t) {
    double scale = 1e-30;
    for (int64_t h = 0; h < hidden; ++h) scale = std::max(scale, std::fabs((double)ref[t * hidden + h]));
    for (int64_t h = 0; h < hidden; ++h) {
      const double a = got[t * hidden + h], b = ref[t * hidden + h];
      ASSERT_TRUE(std::isfinite(a)) << what << ": token " << t << " left unwritten";
      worst = std::max(worst, std::fabs(a - b) / scale);
    }
  }
  EXPECT_LE(worst, 4.0 / 256) << what;  // 4 steps of bf16 (8 bits of mantissa) at the row's scale
}

void expect_matches(const std::vector<Bits>& outs, const Bits& want, const char* what,
                    int64_t hidden = kHidden) {
  for (size_t r = 1; r < outs.size(); ++r)
    EXPECT_EQ(outs[r], outs[0]) << what << ": rank " << r << " differs from rank 0";
  expect_close(outs[0], want, what, hidden);
}

bool backend_available(dist::EpBackend b, int ranks, std::string* why) {
  if (b == dist::EpBackend::kP2p) return cuda::peer_access_available(first_devices(ranks), why);
  return cuda::nccl_available(why);
}

const dist::EpBackend kBackends[] = {
    dist::EpBackend::kLocalAllreduce, dist::EpBackend::kAllgatherReducescatter,
    dist::EpBackend::kAlltoallPadded, dist::EpBackend::kAlltoallPacked, dist::EpBackend::kP2p};

// Every backend the machine offers, on 2 GPUs and on all of them, against one GPU.
void check_every_backend(const Problem& p, const std::string& label) {
  const Bits want = one_gpu(p);
  for (int ranks : group_sizes())
    for (dist::EpBackend b : kBackends) {
      std::string why;
      if (!backend_available(b, ranks, &why)) {
        std::printf("[ SKIPPED  ] %s on %d GPUs: %s\n", dist::ep_backend_name(b), ranks, why.c_str());
        continue;
      }
      const std::string what = std::string(dist::ep_backend_name(b)) + ", " + std::to_string(ranks) +
                               " GPUs, " + label;
      expect_matches(run_ep(b, ranks, p), want, what.c_str(), p.shape.hidden);
    }
}

TEST(CudaEp, EveryBackendMatchesOneGpu) {
  if (device_count() < 2) GTEST_SKIP() << "needs two or more CUDA devices";
  for (int64_t tokens : {1, 7, 64, 300})
    for (double skew : {1.0, 0.3})
      check_every_backend(make_problem(tokens, skew, static_cast<uint32_t>(tokens * 10 + (skew < 1))),
                          "T=" + std::to_string(tokens) + ", skew " + std::to_string(skew));
}

// Data-parallel attention: each rank's own rows (none shared) go through every backend that
// exchanges them and come back to that rank only, equal to the one-GPU layer on those rows. Calls
// below the layer's capacity, one row per rank, and routing that leaves ranks idle.
TEST(CudaEp, OwnTokensOfEachRankMatchOneGpu) {
  if (device_count() < 2) GTEST_SKIP() << "needs two or more CUDA devices";
  const dist::EpBackend own[] = {dist::EpBackend::kAllgatherReducescatter, dist::EpBackend::kAlltoallPadded,
                                 dist::EpBackend::kAlltoallPacked, dist::EpBackend::kP2p};
  for (int ranks : group_sizes())
    for (int64_t per_rank : {1, 5, 96})
      for (double skew : {1.0, 0.3}) {
        const Problem p = make_problem(ranks * per_rank, skew, static_cast<uint32_t>(500 + per_rank * 3 + (skew < 1)));
        const Bits want = one_gpu(p);
        for (dist::EpBackend b : own) {
          std::string why;
          if (!backend_available(b, ranks, &why)) {
            std::printf("[ SKIPPED  ] %s on %d GPUs: %s\n", dist::ep_backend_name(b), ranks, why.c_str());
            continue;
          }
          const std::vector<Bits> outs = run_ep_own(b, ranks, p, per_rank, per_rank + 7);
          for (int r = 0; r < ranks; ++r) {
            const std::string what = std::string(dist::ep_backend_name(b)) + ", own tokens of rank " +
                                     std::to_string(r) + " of " + std::to_string(ranks) + ", " +
                                     std::to_string(per_rank) + " per rank, skew " + std::to_string(skew);
            expect_close(outs[static_cast<size_t>(r)], rows_of(want, r, per_rank, p.shape.hidden), what.c_str(),
                         p.shape.hidden);
          }
        }
      }
}

// The seed workload's shape (8 experts, hidden 512, inter 1024, top-2) at the sizes the seed
// runs: on sm_90 the experts split their down projection there, and the p2p backend sums those
// f32 pieces per row while sending the rows back; every backend against one GPU.
TEST(CudaEp, SeedShapeEveryBackendMatchesOneGpu) {
  if (device_count() < 2) GTEST_SKIP() << "needs two or more CUDA devices";
  for (int64_t tokens : {8, 64, 128})
    check_every_backend(make_problem(tokens, 1.0, static_cast<uint32_t>(700 + tokens), kSeedShape),
                        "seed shape, T=" + std::to_string(tokens));
}

// The p2p layer captured once per rank and replayed with the routing rewritten in place between
// replays: each replay equals the eager result for that routing.
TEST(CudaEp, P2pGraphReplayWithNewRoutingMatchesEager) {
  if (device_count() < 2) GTEST_SKIP() << "needs two or more CUDA devices";
  std::string why;
  if (!cuda::peer_access_available({0, 1}, &why)) GTEST_SKIP() << why;
  const int ranks = 2;
  const int64_t tokens = 48;
  std::vector<Problem> problems;
  for (uint32_t i = 0; i < 3; ++i) problems.push_back(make_problem(tokens, i == 1 ? 0.3 : 1.0, 500 + i));
  // The weights of problem 0 serve all three (the routing and inputs change).
  for (auto& p : problems) p.gate_up = problems[0].gate_up, p.down = problems[0].down;
  std::vector<std::vector<Bits>> eager;
  for (const auto& p : problems) eager.push_back(run_ep(dist::EpBackend::kP2p, ranks, p));

  std::vector<std::vector<Bits>> replayed(problems.size(), std::vector<Bits>(ranks));
  cuda::P2pExchange x(first_devices(ranks), kHidden, kTopK, tokens, 20.0);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      RankData d(problems[0], ranks, r);
      cuda::EpExperts layer(config(dist::EpBackend::kP2p, ranks, r, tokens), d.gate_up.get(),
                            d.down.get(), nullptr, &x);
      cudaStream_t st;
      cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      EXPECT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      layer.forward(d.x.get(), d.ids.get(), d.weights.get(), tokens, d.out.get(), st);
      EXPECT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
      EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      for (size_t i = 0; i < problems.size(); ++i) {
        d.x.upload(problems[i].x);
        d.ids.upload(problems[i].ids);
        d.weights.upload(problems[i].weights);
        d.out.poison();
        EXPECT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
        layer.check(st);
        replayed[i][static_cast<size_t>(r)] = d.out.download();
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(st);
    });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < problems.size(); ++i)
    for (int r = 0; r < ranks; ++r)
      EXPECT_EQ(replayed[i][static_cast<size_t>(r)], eager[i][static_cast<size_t>(r)])
          << "replay " << i << ", rank " << r;
}

// Rank 1 never calls: rank 0's dispatch wait gives up after the timeout and check() says so.
TEST(CudaEp, P2pPeerThatNeverComesIsReportedNotHung) {
  if (device_count() < 2) GTEST_SKIP() << "needs two or more CUDA devices";
  std::string why;
  if (!cuda::peer_access_available({0, 1}, &why)) GTEST_SKIP() << why;
  const Problem p = make_problem(16, 1.0, 7);
  cuda::P2pExchange x({0, 1}, kHidden, kTopK, p.tokens, 0.5);
  cudaSetDevice(0);
  RankData d(p, 2, 0);
  cuda::EpExperts layer(config(dist::EpBackend::kP2p, 2, 0, p.tokens), d.gate_up.get(), d.down.get(),
                        nullptr, &x);
  const auto t0 = std::chrono::steady_clock::now();
  layer.forward(d.x.get(), d.ids.get(), d.weights.get(), p.tokens, d.out.get(), nullptr);
  try {
    layer.check(nullptr);
    ADD_FAILURE() << "a missing peer went unreported";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
    EXPECT_NE(std::string(e.what()).find("dispatch on rank 0: no rows from rank 1"), std::string::npos)
        << e.what();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 5.0) << "the wait is bounded by 0.5 s per stage";
}

TEST(CudaEp, RefusesBadConfigurations) {
  if (device_count() < 1) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  auto code = [](auto&& f) -> std::optional<ErrorKind> {
    try {
      f();
    } catch (const Error& e) {
      return e.kind();
    }
    return std::nullopt;
  };
  cudaSetDevice(0);
  const Problem p = make_problem(4, 1.0, 3);
  RankData d(p, 2, 0);
  auto make = [&](cuda::EpLayerConfig c) {
    return [&d, c] { cuda::EpExperts l(c, d.gate_up.get(), d.down.get(), nullptr, nullptr); };
  };
  auto c = config(dist::EpBackend::kP2p, 2, 0, 4);
  EXPECT_EQ(code(make(c)), ErrorKind::kInvalidArgument) << "p2p without its exchange";
  c = config(dist::EpBackend::kAlltoallPacked, 2, 0, 4);
  EXPECT_EQ(code(make(c)), ErrorKind::kInvalidArgument) << "a collective backend without a communicator";
  c = config(dist::EpBackend::kLocalAllreduce, 9, 0, 4);
  EXPECT_EQ(code(make(c)), ErrorKind::kInvalidArgument) << "more ranks than supported";
  c = config(dist::EpBackend::kLocalAllreduce, 2, 2, 4);
  EXPECT_EQ(code(make(c)), ErrorKind::kInvalidArgument) << "rank outside the group";
  c = config(dist::EpBackend::kDeepep, 2, 0, 4);
  EXPECT_EQ(code(make(c)), ErrorKind::kUnsupported) << "deepep";
  c = config(dist::EpBackend::kLocalAllreduce, 2, 0, 4, kShape, true);
  EXPECT_EQ(code(make(c)), ErrorKind::kInvalidArgument) << "own tokens through an all-reduce";
  EXPECT_EQ(code([] { cuda::P2pExchange x({0, 0}, kHidden, kTopK, 4); }), ErrorKind::kInvalidArgument)
      << "a device listed twice";
  EXPECT_EQ(code([] { cuda::P2pExchange x({0}, 12, kTopK, 4); }), ErrorKind::kInvalidArgument)
      << "hidden not a multiple of 8";
  // One rank, local_allreduce: no communicator needed, and the layer is the one-GPU layer.
  c = config(dist::EpBackend::kLocalAllreduce, 1, 0, 4);
  RankData all(p, 1, 0);
  cuda::EpExperts one(c, all.gate_up.get(), all.down.get(), nullptr, nullptr);
  one.forward(all.x.get(), all.ids.get(), all.weights.get(), 4, all.out.get(), nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(code([&] { one.forward(all.x.get(), all.ids.get(), all.weights.get(), 5, all.out.get(), nullptr); }),
            ErrorKind::kInvalidArgument)
      << "more tokens than the layer was made for";
  expect_matches({all.out.download()}, one_gpu(p), "one rank");
}

}  // namespace
}  // namespace moe
