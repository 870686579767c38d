#include "backend/cuda/comm/peer_column_gather.h"

#include <algorithm>
#include <string>

#include "backend/cuda/comm/sys_flags.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/peer_access.h"
#include "moe/errors.h"

namespace moe::cuda {
namespace {

using namespace sys_flags;

constexpr int kCopyThreads = 256;
constexpr int kCopyColumns = 4 * kCopyThreads;  // columns a copying block takes, for every row

// Waits until *flag has reached `call` (counts wrap: compared as a difference). Gives up, setting
// *status to who + 1 unless another wait already did, when `timeout_ns` pass or another wait of
// this rank gave up.
__device__ bool wait_for_call(const unsigned* flag, unsigned call, int* status, int who, long long timeout_ns) {
  const unsigned long long start = now_ns();
  for (unsigned spin = 0;; ++spin) {
    if (static_cast<int>(load_acquire(flag) - call) >= 0) return true;
    if ((spin & 255) == 255 &&
        (*static_cast<volatile int*>(status) != 0 || static_cast<long long>(now_ns() - start) > timeout_ns)) {
      atomicCAS(status, 0, who + 1);
      return false;
    }
  }
}

// Rank r > 0: the shard may be overwritten once rank 0 has released the previous call.
__global__ void before_write_kernel(unsigned* calls, const unsigned* released, int* status, long long timeout_ns) {
  const unsigned call = *calls + 1;
  wait_for_call(released, call - 1, status, 0, timeout_ns);
  *calls = call;
}

// Rank r > 0: the kernels that wrote the shard completed before this one started (stream
// order); the system-scope release makes their writes visible to rank 0's acquire.
__global__ void after_write_kernel(const unsigned* calls, unsigned* arrived) {
  __threadfence_system();
  store_release(arrived, *calls);
}

struct GatherArgs {
  const float* shard[PeerColumnGather::kMaxRanks];  // peers' shards (rank 0's entry unused)
  int64_t first[PeerColumnGather::kMaxRanks + 1];
  const unsigned* arrived;  // rank 0's
  const unsigned* calls;    // rank 0's
  int* status;              // rank 0's
  long long timeout_ns;
  float* out;
  int64_t rows, ld;
};

// Rank 0: block (x, y) copies columns [x * kCopyColumns, + kCopyColumns) of rank y + 1's shard,
// every row, once that rank's shard of this call has arrived. Loads bypass L1: the shard lives
// in the peer's memory and changes between calls.
__global__ void __launch_bounds__(kCopyThreads) gather_kernel(GatherArgs a) {
  const int r = static_cast<int>(blockIdx.y) + 1;
  const int64_t count = a.first[r + 1] - a.first[r];
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kCopyColumns;
  __shared__ bool arrived;
  if (threadIdx.x == 0) arrived = wait_for_call(a.arrived + r, *a.calls + 1, a.status, r, a.timeout_ns);
  __syncthreads();
  if (!arrived || c0 >= count) return;
  const float* src = a.shard[r];
  float* dst = a.out + a.first[r];
  for (int64_t row = 0; row < a.rows; ++row) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t c = c0 + i * kCopyThreads + threadIdx.x;
      v[i] = c < count ? __ldcg(src + row * count + c) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t c = c0 + i * kCopyThreads + threadIdx.x;
      if (c < count) dst[row * a.ld + c] = v[i];
    }
  }
}

struct ReleaseArgs {
  unsigned* released[PeerColumnGather::kMaxRanks];  // peers' words (rank 0's entry unused)
  unsigned* calls;                                   // rank 0's
  int ranks;
};

// Rank 0, after the copy completed (stream order): the call is done, its shards free again.
__global__ void release_kernel(ReleaseArgs a) {
  const unsigned call = *a.calls + 1;
  *a.calls = call;
  for (int r = 1; r < a.ranks; ++r) store_release(a.released[r], call);
}

size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

PeerColumnGather::PeerColumnGather(const std::vector<int>& devices, int64_t max_rows, int64_t cols,
                                   double timeout_s) {
  const int n = static_cast<int>(devices.size());
  MOE_CHECK(n >= 1 && n <= kMaxRanks, kInvalidArgument, "the column gather takes 1 to {} GPUs, got {}", kMaxRanks,
            n);
  MOE_CHECK(max_rows >= 1 && cols >= 1 && timeout_s > 0, kInvalidArgument,
            "column gather: {} rows of {} columns (both positive), timeout {} s (> 0)", max_rows, cols, timeout_s);
  std::string why;
  MOE_CHECK(peers_can_access(devices, &why), kUnsupported, "running on several GPUs needs peer access: {}", why);
  max_rows_ = max_rows;
  cols_ = cols;
  timeout_ns_ = static_cast<long long>(timeout_s * 1e9);
  // Whole units of kColumnUnit columns, as even as they go; the last rank's share ends at cols.
  const int64_t units = (cols + kColumnUnit - 1) / kColumnUnit;
  for (int r = 0; r <= n; ++r) first_.push_back(std::min(cols, units * r / n * kColumnUnit));
  int64_t widest = 0;
  for (int r = 1; r < n; ++r) widest = std::max(widest, first_[static_cast<size_t>(r) + 1] - first_[static_cast<size_t>(r)]);
  const size_t shard = align_up(static_cast<size_t>(max_rows * widest) * 4);
  const size_t words = align_up((kMaxRanks + 2) * 4 + 4);
  bytes_ = shard + words;
  enable_peer_access(devices);
  for (int d : devices) {
    MOE_CUDA_CHECK(cudaSetDevice(d));
    Rank r;
    r.device = d;
    MOE_CUDA_CHECK(cudaMalloc(&r.base, bytes_));
    char* base = static_cast<char*>(r.base);
    r.shard = reinterpret_cast<float*>(base);
    r.arrived = reinterpret_cast<unsigned*>(base + shard);
    r.released = r.arrived + kMaxRanks;
    r.calls = r.released + 1;
    r.status = reinterpret_cast<int*>(r.calls + 1);
    MOE_CUDA_CHECK(cudaMemset(base + shard, 0, words));
    ranks_.push_back(r);
  }
  for (int d : devices) {
    MOE_CUDA_CHECK(cudaSetDevice(d));
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
}

PeerColumnGather::~PeerColumnGather() {
  for (Rank& r : ranks_) {
    cudaSetDevice(r.device);
    cudaFree(r.base);
  }
}

int64_t PeerColumnGather::first_column(int rank) const {
  MOE_CHECK(rank >= 0 && rank < ranks(), kInvalidArgument, "column gather: rank {} of {}", rank, ranks());
  return first_[static_cast<size_t>(rank)];
}

int64_t PeerColumnGather::columns(int rank) const {
  MOE_CHECK(rank >= 0 && rank < ranks(), kInvalidArgument, "column gather: rank {} of {}", rank, ranks());
  return first_[static_cast<size_t>(rank) + 1] - first_[static_cast<size_t>(rank)];
}

void PeerColumnGather::check_rank(int rank, bool first) const {
  MOE_CHECK(rank >= 0 && rank < ranks() && (rank == 0) == first, kInvalidArgument,
            "column gather: rank {} of {} ({})", rank, ranks(),
            first ? "only the first rank gathers" : "the first rank writes into the output itself");
}

float* PeerColumnGather::shard(int rank) const {
  check_rank(rank, false);
  return ranks_[static_cast<size_t>(rank)].shard;
}

void PeerColumnGather::before_write(int rank, cudaStream_t stream) const {
  check_rank(rank, false);
  const Rank& r = ranks_[static_cast<size_t>(rank)];
  before_write_kernel<<<1, 1, 0, stream>>>(r.calls, r.released, r.status, timeout_ns_);
  MOE_CUDA_CHECK(cudaGetLastError());
}

void PeerColumnGather::after_write(int rank, cudaStream_t stream) const {
  check_rank(rank, false);
  const Rank& r = ranks_[static_cast<size_t>(rank)];
  after_write_kernel<<<1, 1, 0, stream>>>(r.calls, ranks_[0].arrived + rank);
  MOE_CUDA_CHECK(cudaGetLastError());
}

void PeerColumnGather::gather(float* out, int64_t rows, int64_t ld, cudaStream_t stream) const {
  check_rank(0, true);
  MOE_CHECK(out != nullptr && rows >= 0 && rows <= max_rows_ && ld >= cols_, kInvalidArgument,
            "column gather: {} rows (at most {}) into rows of {} (at least {})", rows, max_rows_, ld, cols_);
  if (ranks() == 1) return;
  const Rank& first = ranks_[0];
  GatherArgs g{};
  int64_t widest = 0;
  for (int r = 0; r < ranks(); ++r) {
    g.shard[r] = ranks_[static_cast<size_t>(r)].shard;
    widest = std::max(widest, columns(r));
  }
  for (int r = 0; r <= ranks(); ++r) g.first[r] = first_[static_cast<size_t>(r)];
  g.arrived = first.arrived;
  g.calls = first.calls;
  g.status = first.status;
  g.timeout_ns = timeout_ns_;
  g.out = out;
  g.rows = rows;
  g.ld = ld;
  // Every block waits for its rank's flag, even with no rows, so that the call counts stay even.
  const dim3 grid(static_cast<unsigned>((widest + kCopyColumns - 1) / kCopyColumns), static_cast<unsigned>(ranks() - 1));
  gather_kernel<<<grid, kCopyThreads, 0, stream>>>(g);
  MOE_CUDA_CHECK(cudaGetLastError());
  ReleaseArgs rel{};
  for (int r = 0; r < ranks(); ++r) rel.released[r] = ranks_[static_cast<size_t>(r)].released;
  rel.calls = first.calls;
  rel.ranks = ranks();
  release_kernel<<<1, 1, 0, stream>>>(rel);
  MOE_CUDA_CHECK(cudaGetLastError());
}

void PeerColumnGather::check(int rank) const {
  MOE_CHECK(rank >= 0 && rank < ranks(), kInvalidArgument, "column gather: rank {} of {}", rank, ranks());
  const Rank& r = ranks_[static_cast<size_t>(rank)];
  int status = 0;
  MOE_CUDA_CHECK(cudaSetDevice(r.device));
  MOE_CUDA_CHECK(cudaMemcpy(&status, r.status, 4, cudaMemcpyDeviceToHost));
  MOE_CHECK(status == 0, kInternal,
            "column gather on GPU {}: GPU {} did not arrive within {:.1f} s (a rank stopped or fell behind); the "
            "engine must be reloaded",
            r.device, ranks_[static_cast<size_t>(status - 1)].device, timeout_ns_ * 1e-9);
}

}  // namespace moe::cuda
