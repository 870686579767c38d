// Columns of one f32 result [rows, cols] computed in shards by the GPUs of one group and gathered
// into the first GPU's copy: the lm_head under tensor-parallel attention, where every GPU of the
// group holds the same final rows and each computes the logits of its own share of the
// vocabulary, so that the vocabulary's bytes are read once over the group rather than whole by
// the GPU that samples.
//
// Rank r > 0 writes its columns [first_column(r), first_column(r) + columns(r)) into its own
// shard buffer ([rows, columns(r)], row-major) between before_write and after_write; rank 0 writes
// its own columns straight into the output, then gather() waits for every shard of the call,
// copies them over NVLink into the output's columns, and releases them. Nothing goes through the
// host, so the calls replay from CUDA graphs.
//
// Ordering, per call e: rank r's before_write waits until rank 0 has released call e - 1 (its
// copy of r's shard is done, so the shard may be overwritten); after_write raises r's flag on
// rank 0 with e once r's earlier work on its stream has completed; rank 0's gather waits for
// every flag to reach e, copies, and then releases e to every rank. Each rank counts its calls
// on its own device, so every rank must make the same sequence of calls (same rows), each from
// its own stream. Each wait is bounded: a rank that never arrives sets a status word that
// check() reports, instead of hanging.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe::cuda {

class PeerColumnGather {
 public:
  static constexpr int kMaxRanks = 8;
  // Shards are whole units of this many columns (a 128-row block of a block-scaled matrix whose
  // rows are the output's columns), the last one the remainder.
  static constexpr int64_t kColumnUnit = 128;

  // Enables peer access between every pair of `devices` (throws kUnsupported naming a pair that
  // has none) and allocates each rank's shard for up to max_rows rows, its flags and its status.
  PeerColumnGather(const std::vector<int>& devices, int64_t max_rows, int64_t cols, double timeout_s = 10.0);
  ~PeerColumnGather();
  PeerColumnGather(const PeerColumnGather&) = delete;
  PeerColumnGather& operator=(const PeerColumnGather&) = delete;

  int ranks() const { return static_cast<int>(ranks_.size()); }
  int64_t cols() const { return cols_; }
  int64_t max_rows() const { return max_rows_; }
  int64_t first_column(int rank) const;
  int64_t columns(int rank) const;
  size_t bytes_per_rank() const { return bytes_; }

  // Rank r > 0: where its columns go, [rows, columns(r)] row-major on its device.
  float* shard(int rank) const;
  // Rank r > 0, on its stream: before writing the shard of a call, and after.
  void before_write(int rank, cudaStream_t stream) const;
  void after_write(int rank, cudaStream_t stream) const;
  // Rank 0, on its stream, after writing its own columns into `out` ([rows, ld] on its device,
  // ld >= cols): the other ranks' columns of this call copied in.
  void gather(float* out, int64_t rows, int64_t ld, cudaStream_t stream) const;

  // After rank's stream has been synchronised: throws kInternal naming the peer that never
  // arrived. A timed-out gather leaves the group unusable.
  void check(int rank) const;

 private:
  struct Rank {
    int device = 0;
    void* base = nullptr;
    float* shard = nullptr;       // [max_rows, columns(rank)]
    unsigned* arrived = nullptr;  // rank 0's: [kMaxRanks], the last call each rank's shard is in for
    unsigned* released = nullptr; // the last call whose shard rank 0 has copied (written by rank 0)
    unsigned* calls = nullptr;    // this rank's calls so far
    int* status = nullptr;        // 0, or 1 + the rank that timed out
  };
  void check_rank(int rank, bool first) const;
  std::vector<Rank> ranks_;
  std::vector<int64_t> first_;  // first column of each rank, then cols
  int64_t max_rows_ = 0, cols_ = 0;
  long long timeout_ns_ = 0;
  size_t bytes_ = 0;
};

}  // namespace moe::cuda
