// The NCCL communicator (src/dist/nccl_communicator.h) against the in-process group, which
// the CPU tests pin down: every collective, on every GPU of the machine (at least two), must give
// the same bytes on every rank, and the same byte accounting. Sums in f32, bf16 and f16 are
// compared bit for bit (both add in rank order in f32 and round once). A rank that never joins a
// collective makes its peer fail within the timeout instead of hanging. Skipped, visibly, with
// fewer than two GPUs or without NCCL.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "dist/nccl_communicator.h"
#include "dist/rank_group.h"
#include "gpu_test_util.h"
#include "moe/errors.h"
#include "moe/tensor.h"

namespace moe {
namespace {

using Bytes = std::vector<uint8_t>;

std::vector<int> all_devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  std::vector<int> d;
  for (int i = 0; i < n; ++i) d.push_back(i);
  return d;
}

#define REQUIRE_TWO_GPUS()                                                                  \
  do {                                                                                      \
    std::string why;                                                                        \
    if (all_devices().size() < 2) GTEST_SKIP() << "needs two or more CUDA devices";         \
    if (!cuda::nccl_available(&why)) GTEST_SKIP() << "NCCL is not available: " << why;      \
  } while (0)

// What one rank does in a collective, on host buffers: `in` is its input, the result its output.
// The GPU run uploads `in`, runs the same call on device buffers and downloads the output.
using Call = std::function<void(dist::Communicator& comm, const void* in, void* out)>;

struct RankResult {
  Bytes out;
  dist::CommStats stats;
};

// Runs `call` with per-rank inputs on the in-process group (host) and on the GPUs, with an
// output of out_bytes[r] on rank r (poisoned first), and compares outputs and accounting.
void compare(const char* what, const std::vector<Bytes>& in, const std::vector<size_t>& out_bytes,
             const Call& call) {
  const int n = static_cast<int>(in.size());
  std::vector<RankResult> cpu(static_cast<size_t>(n)), gpu(static_cast<size_t>(n));
  dist::run_ranks(n, [&](int r, dist::Communicator& comm) {
    Bytes out(out_bytes[static_cast<size_t>(r)], 0xAB);
    call(comm, in[static_cast<size_t>(r)].data(), out.data());
    cpu[static_cast<size_t>(r)] = {out, comm.stats()};
  });
  std::vector<int> devices(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) devices[static_cast<size_t>(r)] = r;
  cuda::run_gpu_ranks(devices, [&](int r, dist::Communicator& comm) {
    ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
    const Bytes& host_in = in[static_cast<size_t>(r)];
    const size_t ob = out_bytes[static_cast<size_t>(r)];
    void* din = nullptr;
    void* dout = nullptr;
    ASSERT_EQ(cudaMalloc(&din, host_in.size() + 16), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dout, ob + 16), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(din, host_in.data(), host_in.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(dout, 0xAB, ob + 16), cudaSuccess);
    call(comm, din, dout);
    Bytes out(ob);
    ASSERT_EQ(cudaMemcpy(out.data(), dout, ob, cudaMemcpyDeviceToHost), cudaSuccess);
    cudaFree(din);
    cudaFree(dout);
    gpu[static_cast<size_t>(r)] = {out, comm.stats()};
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(gpu[static_cast<size_t>(r)].out, cpu[static_cast<size_t>(r)].out) << what << ", rank " << r << " of " << n;
    const auto& g = gpu[static_cast<size_t>(r)].stats.total;
    const auto& c = cpu[static_cast<size_t>(r)].stats.total;
    EXPECT_EQ(g.calls, c.calls) << what;
    EXPECT_EQ(g.bytes_sent, c.bytes_sent) << what;
    EXPECT_EQ(g.bytes_to_peers, c.bytes_to_peers) << what;
  }
}

// A copy between two buffers of the same kind: host (in-process ranks) or device (GPU ranks).
void copy_any(void* dst, const void* src, size_t bytes) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, dst) == cudaSuccess && a.type == cudaMemoryTypeDevice)
    ASSERT_EQ(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
  else
    std::memcpy(dst, src, bytes);
}

Bytes random_bytes(size_t n, std::mt19937& rng) {
  Bytes b(n);
  for (auto& v : b) v = static_cast<uint8_t>(rng());
  return b;
}

// Finite values of the dtype (random bytes would make NaNs, whose sums compare unequal).
Bytes random_values(size_t count, DType dtype, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 3.0f);
  Bytes b(count * dtype_size(dtype));
  for (size_t i = 0; i < count; ++i) {
    const float v = d(rng);
    if (dtype == DType::kF32) {
      std::memcpy(b.data() + 4 * i, &v, 4);
    } else {
      const uint16_t h = dtype == DType::kBF16 ? f32_to_bf16(v) : f32_to_f16(v);
      std::memcpy(b.data() + 2 * i, &h, 2);
    }
  }
  return b;
}

TEST(NcclCommunicator, EveryCollectiveMatchesTheInProcessGroup) {
  REQUIRE_TWO_GPUS();
  const int n = static_cast<int>(all_devices().size());
  std::mt19937 rng(5);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (size_t count : {size_t{1}, size_t{1000}, size_t{65537}}) {
      const size_t bytes = count * dtype_size(dt);
      std::vector<Bytes> in;
      for (int r = 0; r < n; ++r) in.push_back(random_values(count, dt, rng));
      compare("all_reduce_sum", in, std::vector<size_t>(static_cast<size_t>(n), bytes),
              [&](dist::Communicator& c, const void* i, void* o) {
                copy_any(o, i, bytes);  // the sum is in place
                c.all_reduce_sum(o, count, dt);
              });
      std::vector<Bytes> in_rs;
      for (int r = 0; r < n; ++r) in_rs.push_back(random_values(count * static_cast<size_t>(n), dt, rng));
      compare("reduce_scatter_sum", in_rs, std::vector<size_t>(static_cast<size_t>(n), bytes),
              [&](dist::Communicator& c, const void* i, void* o) { c.reduce_scatter_sum(i, o, count, dt); });
    }
    // Ragged reduce-scatter with an empty slice.
    std::vector<size_t> counts(static_cast<size_t>(n));
    size_t total = 0;
    for (int r = 0; r < n; ++r) total += counts[static_cast<size_t>(r)] = r == 1 ? 0 : 37 * static_cast<size_t>(r + 1);
    std::vector<Bytes> in;
    std::vector<size_t> out_bytes;
    for (int r = 0; r < n; ++r) {
      in.push_back(random_values(total, dt, rng));
      out_bytes.push_back(counts[static_cast<size_t>(r)] * dtype_size(dt));
    }
    compare("reduce_scatterv_sum", in, out_bytes,
            [&](dist::Communicator& c, const void* i, void* o) { c.reduce_scatterv_sum(i, o, counts, dt); });
  }

  // Byte movers, with ragged and empty slices.
  const size_t per = 4099;
  std::vector<Bytes> in;
  for (int r = 0; r < n; ++r) in.push_back(random_bytes(per * static_cast<size_t>(n), rng));
  compare("all_gather", in, std::vector<size_t>(static_cast<size_t>(n), per * static_cast<size_t>(n)),
          [&](dist::Communicator& c, const void* i, void* o) { c.all_gather(i, o, per); });
  compare("all_to_all", in, std::vector<size_t>(static_cast<size_t>(n), per * static_cast<size_t>(n)),
          [&](dist::Communicator& c, const void* i, void* o) { c.all_to_all(i, o, per); });
  std::vector<size_t> gv(static_cast<size_t>(n));
  size_t gv_total = 0;
  for (int r = 0; r < n; ++r) gv_total += gv[static_cast<size_t>(r)] = r == 0 ? 0 : 1000 * static_cast<size_t>(r) + 3;
  compare("all_gatherv", in, std::vector<size_t>(static_cast<size_t>(n), gv_total),
          [&](dist::Communicator& c, const void* i, void* o) { c.all_gatherv(i, gv[static_cast<size_t>(c.rank())], o, gv); });
  // all_to_allv: rank r sends (r + 1) * (j + 2) bytes to rank j, none to rank 1 from rank 0.
  auto amount = [](int from, int to) { return from == 0 && to == 1 ? size_t{0} : static_cast<size_t>((from + 1) * (to + 2) * 111); };
  std::vector<size_t> send_total(static_cast<size_t>(n), 0), recv_total(static_cast<size_t>(n), 0);
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b) {
      send_total[static_cast<size_t>(a)] += amount(a, b);
      recv_total[static_cast<size_t>(b)] += amount(a, b);
    }
  std::vector<Bytes> in_v;
  for (int r = 0; r < n; ++r) in_v.push_back(random_bytes(send_total[static_cast<size_t>(r)], rng));
  compare("all_to_allv", in_v, recv_total, [&](dist::Communicator& c, const void* i, void* o) {
    std::vector<size_t> s(static_cast<size_t>(n)), rv(static_cast<size_t>(n));
    for (int j = 0; j < n; ++j) {
      s[static_cast<size_t>(j)] = amount(c.rank(), j);
      rv[static_cast<size_t>(j)] = amount(j, c.rank());
    }
    c.all_to_allv(i, s, o, rv);
  });
  compare("broadcast", in, std::vector<size_t>(static_cast<size_t>(n), per), [&](dist::Communicator& c, const void* i, void* o) {
    copy_any(o, i, per);
    c.broadcast(o, per, n - 1);
    c.barrier();
  });
}

TEST(NcclCommunicator, AMissingPeerTimesOutInsteadOfHanging) {
  REQUIRE_TWO_GPUS();
  std::mutex m;
  std::string message;
  EXPECT_THROW(cuda::run_gpu_ranks({0, 1}, [&](int r, dist::Communicator& comm) {
    if (r == 1) return;  // never joins
    void* buf = nullptr;
    ASSERT_EQ(cudaMalloc(&buf, 1024), cudaSuccess);
    try {
      comm.all_reduce_sum(buf, 256, DType::kF32);
    } catch (const Error& e) {
      std::lock_guard<std::mutex> lock(m);
      message = e.message();
      cudaFree(buf);
      throw;
    }
    cudaFree(buf);
  }, 2.0), Error);
  EXPECT_NE(message.find("did not complete within"), std::string::npos) << message;
}

TEST(NcclCommunicator, RefusesBadGroups) {
  EXPECT_THROW(cuda::NcclGroup({}), Error);
  EXPECT_THROW(cuda::NcclGroup({0, 0}), Error);
  EXPECT_THROW(cuda::NcclGroup({0}, 0.0), Error);
  EXPECT_THROW(cuda::NcclGroup({1000}), Error);  // no such device (or no CUDA at all)
}

}  // namespace
}  // namespace moe
