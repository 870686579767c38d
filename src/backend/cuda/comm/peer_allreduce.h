// An in-place sum of bf16 activations over the GPUs of one process, for the layers whose ranks
// each hold a partial result of the same rows: tensor-parallel attention's output projection
// (each rank's heads) and expert-parallel experts run on every token (each rank's experts).
//
// One kernel per call and rank. Block b of rank r copies its rows into every peer's inbox over
// NVLink, raises flag (r, b) on each peer, waits for flags (p, b) of every peer, then sums the
// rows in rank order in f32 and rounds once: every rank ends with the same bits. Whole rows per
// block, so that the residual add and norm that follow can be folded in.
// Nothing goes through the host, so a whole decode step with its all-reduces replays from a
// CUDA graph. Each wait is bounded: a rank that never arrives sets a status word that check()
// reports, instead of hanging.
//
// Small calls (decode) take the LL form instead: each 8-byte word sent carries 4 bytes of data
// beside the call's epoch, so a receiver polls the data itself and no fence or flag is needed;
// twice the bytes, one trip over NVLink (peer_allreduce.cu).
//
// Reuse: the inboxes are double-buffered by call parity. A peer can only be writing call e + 1
// into the buffer of call e - 1 once this rank has raised its flags of call e, which it does
// after its call e - 1 (and the sum that read that buffer) completed in stream order.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe::cuda {

class PeerAllReduce {
 public:
  static constexpr int kMaxRanks = 8;
  static constexpr int kMaxBlocks = 64;
  // Calls of at most kMaxBlocks rows whose elements times the peers are at most this use the LL
  // form (below). Measured on H200s (qwen3-30b-a3b decode, NVLink): LL won at 64 rows of 2048
  // on 2 GPUs (one peer) and at 8 rows on 4, and lost 7% of the step at 64 rows on 4 (three
  // peers, twice the bytes each).
  static constexpr int64_t kLlMaxElements = 64 * 2048;
  static constexpr int64_t kMaxNormHidden = 8192;  // with a folded norm

  // Enables peer access between every pair of `devices` (throws kUnsupported naming a pair that
  // has none) and allocates on each its inbox for up to max_elements per call.
  PeerAllReduce(const std::vector<int>& devices, int64_t max_elements, double timeout_s = 10.0);
  ~PeerAllReduce();
  PeerAllReduce(const PeerAllReduce&) = delete;
  PeerAllReduce& operator=(const PeerAllReduce&) = delete;

  int ranks() const { return static_cast<int>(ranks_.size()); }
  size_t bytes_per_rank() const { return bytes_; }

  // What a call may do with the summed rows instead of storing them: the residual add and
  // RMSNorm that follow them in a decoder layer (the arithmetic of kernels::add_rms_norm):
  // residual[t] += f32(bf16 sum[t]) (+ f32(extra[t])), normed[t] = bf16(rmsnorm(residual[t]) *
  // weight). residual f32 [rows, hidden], extra bf16 or null, weight f32 [hidden].
  struct AddNorm {
    float* residual = nullptr;
    const uint16_t* extra = nullptr;
    const float* weight = nullptr;
    float eps = 0.0f;
    uint16_t* normed = nullptr;
  };

  // data: [rows, hidden] bf16 on rank's device (hidden a multiple of 8, rows * hidden at most
  // max_elements; with `then`, hidden at most kMaxNormHidden), replaced by the sum over ranks, or with `then`, left as it was and folded
  // into the residual stream and its norm. Enqueued on `stream`, capturable; every rank must make
  // the same sequence of calls (same shapes), each from its own stream.
  void run(int rank, uint16_t* data, int64_t rows, int64_t hidden, cudaStream_t stream,
           const AddNorm* then = nullptr) const;

  // After rank's stream has been synchronised: throws kInternal naming the peer whose rows never
  // arrived. A timed-out exchange leaves the group unusable.
  void check(int rank) const;

 private:
  struct Rank {
    int device = 0;
    void* base = nullptr;
    uint16_t* inbox = nullptr;   // [2 parities][ranks][max_elements]
    unsigned* flags = nullptr;   // [ranks][kMaxBlocks]: written by the peers
    unsigned* epochs = nullptr;  // [kMaxBlocks]: calls each block has completed
    unsigned* ll_epochs = nullptr;  // [kMaxBlocks]: LL calls completed (all equal)
    uint4* ll_inbox = nullptr;      // [2 parities][ranks][ll_slot_] 16-byte lines
    int* status = nullptr;       // 0, or 1 + the peer that timed out
  };
  std::vector<Rank> ranks_;
  int64_t max_elements_ = 0;
  int64_t ll_slot_ = 0;  // lines per (parity, source rank)
  long long timeout_ns_ = 0;
  size_t bytes_ = 0;
};

}  // namespace moe::cuda
