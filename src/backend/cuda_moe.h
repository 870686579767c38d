// The routed experts of one MoE layer on a CUDA device: bf16 weights and activations, f32
// accumulation. Routing (ids, weights) and the plan stay on the device; forward() allocates
// nothing and can be captured in a CUDA graph. Two paths, picked per call by M (the heuristics
// are in backend/cuda/moe/moe_heuristics.h): a GEMV path for small M (decode) and a tensor-core
// grouped GEMM for large M (prefill), on wgmma + TMA where the device is sm_90. Declared without CUDA types so CPU-only code can include
// it; in a build without CUDA every constructor throws kUnsupported.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "backend/device_matrix.h"
#include "moe/experts.h"

namespace moe::cuda {

struct ExpertShape {
  int64_t experts = 0;  // local experts on this device, 1 to 512
  int64_t hidden = 0;
  int64_t inter = 0;
  int64_t top_k = 0;
};

enum class ExpertPath {
  kAuto,  // by M, from the heuristics
  kGemv,  // hidden and inter multiples of 8, at most 2048
  kGemm,  // hidden and inter multiples of 64, at most 8192 (mma.sync, any sm_90 build)
  kWgmma, // the kGemm widths (FP8: multiples of 128), on wgmma + TMA: compute capability 9.0 only
};

// Whether `path` can run this shape (kAuto: whether any can) on weights of `format` (FP8 takes
// kWgmma only with widths that are multiples of 128); for kWgmma the device must also be of
// compute capability 9.0, which forward() checks.
bool experts_support(const ExpertShape& shape, ExpertPath path, const WeightFormat& format = {});

// The non-owning core: the weights and the workspace belong to the caller, so that an engine can
// draw its weights on the device and share one workspace among all its layers.
class Experts {
 public:
  // gate_up: bf16 [experts, 2 * inter, hidden] (gate rows, then up rows); down: bf16
  // [experts, hidden, inter]; both on `device`, 16-byte aligned, alive as long as this object.
  // max_tokens (1 to 65536) bounds M. Throws kUnsupported for a shape neither path runs or when
  // no CUDA device `device` exists; kInvalidArgument for a malformed shape.
  Experts(const void* gate_up, const void* down, ExpertShape shape, int64_t max_tokens,
          int device = 0);
  // The same over matrices that carry their format (DeviceMatrix), gate_up shape.experts x
  // [2 * inter, hidden] and down shape.experts x [hidden, inter], contiguous: kInvalidArgument
  // for other shapes, kUnsupported for a format the expert kernels do not read. bf16, or FP8
  // E4M3 in 128 x 128 blocks (inter a multiple of 128, hidden of 16): the GEMV path reads the
  // codes, the GEMM path runs W8A8 (activations quantised per row and 128 columns on the fly);
  // the wgmma path does not take FP8 yet.
  Experts(const DeviceMatrix& gate_up, const DeviceMatrix& down, ExpertShape shape, int64_t max_tokens,
          int device = 0);

  // Bytes of device workspace forward() needs for up to max_tokens (plan, activations, partial
  // sums); the caller allocates it, 256-byte aligned.
  // `format`: the weights' (FP8 adds room for the quantised activations where the GEMM path can
  // run).
  static size_t workspace_bytes(const ExpertShape& shape, int64_t max_tokens, const WeightFormat& format = {});

  // y[M, H] (bf16 bits) = sum_j weights[t, j] * FFN_{ids[t, j]}(x[t]); all pointers on the device,
  // ids in [0, E) or -1 for a slot to leave out (an expert held by another rank: it adds nothing,
  // and a row whose slots are all -1 comes out zero), M = tokens in [1, max_tokens]. `stream` is
  // a cudaStream_t (null: the default stream). The workspace is overwritten; calls sharing one workspace must be ordered on one
  // stream. Bitwise deterministic for given inputs and path. A forced path that cannot run this
  // shape (or, for kGemv beside the GEMM path, more than 256 tokens) throws kUnsupported.
  void forward(const uint16_t* x, const int32_t* ids, const float* weights, int64_t tokens,
               uint16_t* y, void* workspace, void* stream, ExpertPath path = ExpertPath::kAuto) const;
  // The same, with the next layer's input norm folded into the last kernel: instead of storing
  // y, residual[t] += f32(bf16 y[t]) and normed[t] = bf16(rmsnorm(residual[t]) * weight)
  // (residual f32 [M, H] in place, weight f32 [H], normed bf16 [M, H]; all 16-byte aligned;
  // H at most 8192). Saves a launch per layer in decode.
  // With code_rows > 0 the rows below it are written as the input of the next layer's FP8
  // projection instead of into normed (E4M3 codes [code_rows, H] and scales block-major
  // [H / 128, code_rows]: the quantising kernel's of the bf16 rows; H a multiple of 128).
  struct NextNorm {
    float* residual = nullptr;
    const float* weight = nullptr;
    float eps = 0.0f;
    uint16_t* normed = nullptr;
    uint8_t* codes = nullptr;
    float* scales = nullptr;
    int64_t code_rows = 0;
  };
  void forward_then_norm(const uint16_t* x, const int32_t* ids, const float* weights,
                         int64_t tokens, const NextNorm& next, void* workspace, void* stream,
                         ExpertPath path = ExpertPath::kAuto) const;

  // forward() without its combine: the per-slot partial sums stay in the workspace, for a
  // caller that sums each row's slots itself (the p2p exchange does it while sending rows back;
  // backend/cuda/moe/slot_sums.cuh). Row t's sum at column h is, in slot order j < top_k (slots with
  // id -1 skipped), then split order, the sum of sums[((i * split_stride) + t * top_k + j) * H + h].
  struct Partials {
    const void* sums = nullptr;  // in the workspace
    bool bf16 = false;           // bf16, or f32
    int splits = 1;              // f32 pieces per slot (split-K), > 1 only when f32
    long long split_stride = 0;  // slots between pieces
  };
  Partials forward_partials(const uint16_t* x, const int32_t* ids, const float* weights,
                            int64_t tokens, void* workspace, void* stream,
                            ExpertPath path = ExpertPath::kAuto) const;
  // Where and in which form forward_partials(tokens) leaves the sums, without running anything.
  Partials partials_of(int64_t tokens, void* workspace, ExpertPath path = ExpertPath::kAuto) const;

  // The path forward(..., kAuto) takes for M tokens.
  ExpertPath path_for(int64_t tokens) const;

  const ExpertShape& shape() const { return shape_; }
  const WeightFormat& format() const { return format_; }
  int64_t max_tokens() const { return max_tokens_; }
  size_t weight_bytes() const;  // E * 3 * H * I values in the format, and the scales

 private:
  void run(const uint16_t* x, const int32_t* ids, const float* weights, int64_t tokens,
           uint16_t* y, const NextNorm* next, Partials* partials, void* workspace, void* stream,
           ExpertPath path) const;

  const void* gate_up_;
  const void* down_;
  WeightFormat format_;
  const float* gate_up_scales_ = nullptr;  // FP8: per 128 x 128 block
  const float* down_scales_ = nullptr;
  ExpertShape shape_;
  int64_t max_tokens_;
  int device_;
  bool sm90_ = false;  // the device runs the sm_90a wgmma path
};

// An owning convenience for tests and benchmarks: uploads host experts as bf16 and allocates its
// own workspace.
class DecodeExperts {
 public:
  // Converts the host experts to bf16 on `device` (once, at load). max_tokens bounds M.
  DecodeExperts(const ExpertWeights& host, int64_t max_tokens, int64_t top_k, int device = 0);
  ~DecodeExperts();
  DecodeExperts(const DecodeExperts&) = delete;
  DecodeExperts& operator=(const DecodeExperts&) = delete;

  void forward(const uint16_t* x, const int32_t* ids, const float* weights, int64_t tokens,
               uint16_t* y, void* stream, ExpertPath path = ExpertPath::kAuto) const;

  const Experts& core() const;
  size_t weight_bytes() const;
  size_t workspace_bytes() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace moe::cuda
