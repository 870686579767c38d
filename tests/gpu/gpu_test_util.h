// Shared helpers of the GPU tests: skip visibly without a device, move vectors to and from the
// device, poison outputs so a kernel that forgets to write shows up as NaN.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "moe/router.h"
#include "moe/tensor.h"

namespace moe::gputest {

inline bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define REQUIRE_GPU() \
  if (!::moe::gputest::have_gpu()) GTEST_SKIP() << "no CUDA device: GPU test skipped"

// Compute capability 9.0: the sm_90a kernels (wgmma, TMA) are built for it and run.
inline bool device_is_sm90() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return major == 9 && minor == 0;
}

inline int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

// GPUs 0 .. n - 1, as the multi-GPU objects take their devices.
inline std::vector<int> first_devices(int n) {
  std::vector<int> d;
  for (int i = 0; i < n; ++i) d.push_back(i);
  return d;
}

// Whether GPUs 0..n-1 can all access each other's memory.
inline bool peers_reachable(int n) {
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b) {
      int can = 0;
      if (a != b && (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess || !can)) return false;
    }
  return true;
}

// n GPUs with peer access between them, or the test skips, saying which is missing.
#define REQUIRE_PEER_GPUS(n)                                                                    \
  if (::moe::gputest::gpu_count() < (n))                                                        \
    GTEST_SKIP() << "fewer than " << (n) << " CUDA devices: multi-GPU test skipped";            \
  if (!::moe::gputest::peers_reachable(n))                                                      \
    GTEST_SKIP() << "no peer access between the GPUs: multi-GPU test skipped"

// A device buffer that frees itself; the tests keep no raw cudaMalloc pointers.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) : count_(count) {
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(count, 1) * sizeof(T)), cudaSuccess);
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), count_(o.count_) { o.ptr_ = nullptr; }

  T* get() const { return static_cast<T*>(ptr_); }
  size_t size() const { return count_; }
  void upload(const std::vector<T>& host) {
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    EXPECT_EQ(cudaMemcpy(host.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  // Every byte 0xff: NaN for f32, bf16 and f16, -1 for integers.
  void poison() { EXPECT_EQ(cudaMemset(ptr_, 0xff, count_ * sizeof(T)), cudaSuccess); }

 private:
  void* ptr_ = nullptr;
  size_t count_ = 0;
};

// Normal values rounded to bf16, so a CPU reference in f32 and a GPU kernel reading bf16 start
// from the same numbers.
inline std::vector<float> random_bf16_exact(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = bf16_to_f32(f32_to_bf16(d(rng)));
  return v;
}

inline std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16(v[i]);
  return out;
}

inline std::vector<float> from_bf16(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_f32(v[i]);
  return out;
}

// max |a - b| / max(max |b|, tiny): one number per comparison, stated bounds are against it.
inline double max_rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 1e-30;
  if (a.size() != b.size()) return INFINITY;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;  // a poisoned output left unwritten
    num = std::max(num, static_cast<double>(std::abs(a[i] - b[i])));
    den = std::max(den, static_cast<double>(std::abs(b[i])));
  }
  return num / den;
}

// k distinct experts for one token, ascending (the router's contract), drawn one at a time with
// probabilities proportional to p (an expert drawn is not drawn again).
inline std::vector<int32_t> draw_experts(const std::vector<double>& p, int64_t k, std::mt19937& rng) {
  std::vector<double> q = p;
  std::vector<int32_t> pick;
  for (int64_t j = 0; j < k; ++j) {
    std::discrete_distribution<int32_t> d(q.begin(), q.end());
    const int32_t e = d(rng);
    pick.push_back(e);
    q[static_cast<size_t>(e)] = 0;
  }
  std::sort(pick.begin(), pick.end());
  return pick;
}

// A RouterConfig from the device routers' numbers (RouterParams): groups 0 none, 1 a group's best
// expert (DeepSeek-V2), 2 the sum of its best two (DeepSeek-V3).
inline RouterConfig router_config(int experts, int top_k, bool sigmoid, int groups, int n_group, int topk_group,
                                  bool correction_bias, bool renormalize, float scaling) {
  return {.num_experts = experts,
          .top_k = top_k,
          .scoring = sigmoid ? RouterScoring::kSigmoid : RouterScoring::kSoftmax,
          .groups = groups == 0 ? GroupRanking::kNone : (groups == 1 ? GroupRanking::kMax : GroupRanking::kTop2Sum),
          .n_group = n_group,
          .topk_group = topk_group,
          .correction_bias = correction_bias,
          .renormalize = renormalize,
          .scaling = scaling};
}

// The time between two events recorded on a stream, for timing loops (start, work, stop, ms).
class EventTimer {
 public:
  EventTimer() {
    cudaEventCreate(&start_);
    cudaEventCreate(&stop_);
  }
  ~EventTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  void start(cudaStream_t stream) { cudaEventRecord(start_, stream); }
  // Records the stop and waits for it.
  cudaError_t stop(cudaStream_t stream) {
    cudaEventRecord(stop_, stream);
    return cudaEventSynchronize(stop_);
  }
  float ms() const {
    float ms = 0;
    cudaEventElapsedTime(&ms, start_, stop_);
    return ms;
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// Runs `kernel(params, nullptr)` with `out` poisoned first; returns `out` as f32.
template <class Kernel, class Params>
std::vector<float> launch_bf16_out(Kernel&& kernel, const Params& p, DeviceBuffer<uint16_t>& out) {
  out.poison();
  EXPECT_EQ(kernel(p, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return from_bf16(out.download());
}

// `kernel(params, nullptr)` with params a copy of `p` that `change` edits: for checks that a
// kernel refuses bad sizes.
template <class Kernel, class Params, class Change>
cudaError_t launch_changed(Kernel&& kernel, Params p, Change&& change) {
  change(p);
  return kernel(p, nullptr);
}

// A poisoned workspace of `bytes` in `buf`; null when none is needed.
inline void* poisoned_workspace(size_t bytes, std::unique_ptr<DeviceBuffer<uint8_t>>& buf) {
  buf = std::make_unique<DeviceBuffer<uint8_t>>(bytes);
  buf->poison();
  return bytes ? buf->get() : nullptr;
}

// The block tables of a paged KV cache for a batch, laid out to catch stray reads: each sequence
// owns ceil(max_context / block_size) blocks of a shuffled pool, three blocks belong to nobody,
// and each table has a spare entry past its last block; the spare and unused entries all point at
// one unowned block. Query rows: sequence s has rows [starts[s], starts[s + 1]).
struct PagedBlocks {
  int block_size, max_context, max_blocks, num_blocks, tokens;
  std::vector<int32_t> tables, starts;

  PagedBlocks(const std::vector<int>& rows, int block_size, int max_context, std::mt19937& rng)
      : block_size(block_size), max_context(max_context) {
    const int seqs = static_cast<int>(rows.size());
    const int per_seq = (max_context + block_size - 1) / block_size;
    max_blocks = per_seq + 1;
    num_blocks = per_seq * seqs + 3;
    std::vector<int> perm(static_cast<size_t>(num_blocks));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    tables.assign(static_cast<size_t>(seqs) * max_blocks, perm.back());
    int next = 0;
    for (int s = 0; s < seqs; ++s)
      for (int i = 0; i < per_seq; ++i) tables[static_cast<size_t>(s) * max_blocks + i] = perm[next++];
    starts.assign(1, 0);
    for (int r : rows) starts.push_back(starts.back() + r);
    tokens = starts.back();
  }

  size_t pool_rows() const { return static_cast<size_t>(num_blocks) * block_size; }

  // Each sequence's values (row_elems a position, from position 0) into `pool` at the rows its
  // table gives: positions below ctx[s] get them, the others up to max_context NaN (rows the
  // engine has not written may hold anything).
  void scatter(const std::vector<std::vector<float>>& seq_values, const std::vector<int>& ctx, size_t row_elems,
               std::vector<float>& pool) const {
    for (size_t s = 0; s < seq_values.size(); ++s)
      for (int pos = 0; pos < max_context; ++pos) {
        const size_t row = static_cast<size_t>(tables[s * max_blocks + pos / block_size]) * block_size + pos % block_size;
        for (size_t e = 0; e < row_elems; ++e)
          pool[row * row_elems + e] = pos < ctx[s] ? seq_values[s][static_cast<size_t>(pos) * row_elems + e] : NAN;
      }
  }
};

// PagedBlocks on the device, with the context lengths (which a replay may change).
struct DevicePagedBlocks {
  DeviceBuffer<int32_t> tables, starts, context_lens;

  DevicePagedBlocks(const PagedBlocks& b, const std::vector<int32_t>& ctx)
      : tables(b.tables), starts(b.starts), context_lens(ctx) {}

  // The fields the paged and the latent attention parameters share: the tables, the batch, the
  // query and the output.
  template <class Params>
  void set(Params& p, const PagedBlocks& b, const uint16_t* q, uint16_t* out) const {
    p.q = q;
    p.out = out;
    p.block_tables = tables.get();
    p.seq_starts = starts.get();
    p.context_lens = context_lens.get();
    p.num_seqs = static_cast<int>(b.starts.size()) - 1;
    p.tokens = b.tokens;
    p.block_size = b.block_size;
    p.max_blocks_per_seq = b.max_blocks;
    p.max_context = b.max_context;
  }
};

}  // namespace moe::gputest
