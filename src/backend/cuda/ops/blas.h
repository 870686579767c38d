// Dense projections: y[m, n] = x[m, k] · w[n, k]ᵀ with x and w bf16 (w row-major as in
// nn.Linear), f32 accumulation, y bf16 or f32. A few rows (decode) go through our own
// weight-streaming kernel (gemv.cu), more through cuBLASLt; so does W8A8 on FP8 blocks
// (linear_fp8_blocks). The cuBLASLt algorithm for each
// shape is chosen once and cached and the workspace is allocated at construction, so calls made
// during CUDA-graph capture allocate nothing.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>

namespace moe::cuda {

enum class OutType { kBf16, kF32 };

constexpr int64_t kFp8BlockRowMultiple = 4;
constexpr int64_t kFp8BlockColumnMultiple = 4;  // in 128-column blocks

class Blas {
 public:
  explicit Blas(size_t workspace_bytes = 32u << 20);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // ldy: elements between rows of y (0: n), so that several projections can write the column
  // blocks of one output.
  void linear(const void* x, const void* w, void* y, OutType out, int64_t m, int64_t n, int64_t k,
              cudaStream_t stream, int64_t ldy = 0);

  // `batch` independent projections (latent attention's per-head products): batch b reads
  // x + b * x_stride with rows ldx apart, w + b * w_stride ([n, k] row-major), and writes
  // y + b * y_stride with rows ldy apart. Strides in elements.
  void linear_batched(const void* x, int64_t ldx, int64_t x_stride, const void* w, int64_t w_stride,
                      void* y, OutType out, int64_t ldy, int64_t y_stride, int64_t m, int64_t n,
                      int64_t k, int64_t batch, cudaStream_t stream);

  // W8A8: y[m, n] = Σ_k x[m, k] · w[n, k] where x is E4M3 codes with one f32 scale per row and
  // 128 columns, block-major (x_scales [k / 128, m]: quantize_rows_fp8_by_block), and w E4M3
  // codes with one f32 scale per 128 x 128 block (the checkpoint's layout: w_scales
  // [ceil(n / 128), k / 128], 16-byte aligned), f32 accumulation. Up to kW8a8RowsMax rows on a
  // device of compute capability 9.0 our own wgmma kernel (gemm_fp8_w8a8_launch.h), where
  // cuBLASLt costs as much as at 256 rows; otherwise cuBLASLt's block-scaled FP8 GEMM (sm_90 and
  // later). cuBLASLt runs where m is a multiple of kFp8BlockRowMultiple and k one of
  // 128 * kFp8BlockColumnMultiple; false, with nothing launched, elsewhere and where cuBLASLt has
  // no algorithm for the shape on this device. Measured on an H100 with cuBLASLt 13.1: no
  // algorithm for m = 9, 10, 13, 17 (12, 16, 20, 24, 40 ran); with k / 128 = 1 and four block
  // rows of weights the result was wrong (about 70% off) while the same scales read correctly
  // wherever k / 128 was a multiple of 4, so its weight-scale rows are taken to be padded to
  // 16 bytes. Every FP8 checkpoint we know has k / 128 a multiple of 4.
  bool linear_fp8_blocks(const void* x, const float* x_scales, const void* w, const float* w_scales, void* y,
                         OutType out, int64_t m, int64_t n, int64_t k, cudaStream_t stream, int64_t ldy = 0);
  // Whether linear_fp8_blocks runs for these arguments, asked without launching anything, so
  // that a producer may write x in its layout first.
  bool runs_fp8_blocks(const void* x, const float* x_scales, const void* w, const float* w_scales, const void* y,
                       OutType out, int64_t m, int64_t n, int64_t k, int64_t ldy = 0);

  size_t workspace_bytes() const { return workspace_bytes_ + widened_bytes_ + fp8_rows_bytes_; }

  // Room for a weight matrix of `elements` values widened to bf16 (a block-scaled one for the
  // bf16 GEMM: projection.cpp), allocated now so that none is allocated during graph capture.
  void reserve_widened(size_t elements);
  // That room, for at most the reserved elements; kInternal past them.
  uint16_t* widened(size_t elements) const;

  // Room for `rows` activation rows of `cols` values quantised to FP8 (codes and their scales,
  // for linear_fp8_blocks), allocated now for the same reason.
  void reserve_fp8_rows(int64_t rows, int64_t cols);
  struct Fp8Rows {
    uint8_t* codes;
    float* scales;
  };
  bool has_fp8_rows(int64_t rows, int64_t cols) const { return rows <= fp8_rows_cap_ && cols <= fp8_cols_cap_; }
  // That room, for at most the reserved rows and columns; kInternal past them.
  Fp8Rows fp8_rows(int64_t rows, int64_t cols) const;

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  // out, m, n, k, ldx, ldy, batch, x_stride, w_stride, y_stride, the pointers' alignments, and
  // whether x and w are FP8 blocks.
  using Key = std::array<int64_t, 14>;
  // The cached plan; null for an FP8 shape without an algorithm (a bf16 one throws kUnsupported).
  const Plan* plan(const Key& key);
  // linear_fp8_blocks's plan, or null where it does not run.
  const Plan* fp8_blocks_plan(const void* x, const float* x_scales, const void* w, const float* w_scales, const void* y,
                              OutType out, int64_t m, int64_t n, int64_t k, int64_t ldy);

  // Whether gemm_fp8_w8a8_rows takes these arguments.
  bool runs_w8a8_rows(const void* x, const float* x_scales, const void* w, const float* w_scales, int64_t m,
                      int64_t n, int64_t k) const;

  cublasLtHandle_t handle_ = nullptr;
  int sms_ = 0;         // the device's multiprocessors
  bool sm90a_ = false;  // compute capability 9.0: our wgmma kernels run
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  uint16_t* widened_ = nullptr;
  size_t widened_bytes_ = 0;
  uint8_t* fp8_rows_ = nullptr;
  int64_t fp8_rows_cap_ = 0, fp8_cols_cap_ = 0;
  size_t fp8_rows_bytes_ = 0;
  std::map<Key, Plan> plans_;  // an FP8 key without an algorithm maps to a plan with no op
};

}  // namespace moe::cuda
