// Large-M (prefill) routed-expert path: two grouped GEMMs on the tensor cores over the device
// plan of moe_plan.cu. One block computes one row tile of one expert (up to BM of its routed
// rows, gathered through the plan's order) against 128 weight rows:
//  - gate_up: A = x rows gathered by token, B = 64 gate rows and the matching 64 up rows, so each
//    thread holds gate and up of the same act column and the epilogue writes SiLU(g) * u in bf16;
//  - down: A = act rows (contiguous, already in plan order), B = 128 rows of w_down; the epilogue
//    scales by the routing weight and writes bf16 partial sums by slot, summed by the combine in
//    a fixed order (no atomics).
// mma.sync m16n8k16 bf16 -> f32, ldmatrix from XOR-swizzled shared memory, a kStages-deep cp.async
// pipeline. Tiles: moe_heuristics.h (which also says why this is not wgmma + TMA yet).
// FP8 weights (E4M3, a scale per 128 x 128 block) run W8A8: the activations are quantised per row
// and 128 columns (quantize_rows_fp8: x before gate_up, act before down), a stage holds 128 k of
// both (128-byte rows, as a bf16 stage's 64 k, so the tile layout, the copies and the ldmatrix
// addressing are the same: an m16n8k32 e4m3 fragment has the bytes of an m16n8k16 bf16 one), the
// stage's products accumulate apart in f32 and are added to the sums times the row's and the
// weight block's scales.
// Only CUDA headers and plain launch headers here.
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/moe/moe_decode_launch.h"
#include "backend/cuda/moe/moe_heuristics.h"
#include "backend/cuda/mma_sync.cuh"  // mma_bf16, mma_e4m3
#include "backend/cuda/ops/fp8_blocks_launch.h"

namespace moe::cuda::kernels {

namespace {

constexpr int kThreads = 256;  // 8 warps: 2 along rows x 4 along weight rows
constexpr int BK = heuristics::kGemmBK;
constexpr int kStages = heuristics::kGemmStages;
constexpr int BN = heuristics::kGemmWeightRows;
static_assert(BK == 64, "the swizzle below assumes 128-byte shared-memory rows");
static_assert(BN == 128, "warp tiling below assumes 4 warps x 32 weight rows");

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; valid == false writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Byte offset of 16-byte chunk c (0..7) of row r in a tile of 128-byte rows. Chunk c of row r
// sits at c ^ (r % 8): the 8 rows an ldmatrix phase reads, and the 8 chunks of one row that
// consecutive threads copy, land in 8 different 16-byte bank groups.
__device__ __forceinline__ uint32_t swizzle(int r, int c) {
  return static_cast<uint32_t>(r * 128 + ((c ^ (r & 7)) << 4));
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

// The scales of an FP8 GEMM (null for bf16): the A rows' [rows, ceil(K / 128)] and the weights'
// per 128 x 128 block, per expert [ceil(w_rows / 128), ceil(K / 128)].
struct Fp8Scales {
  const float* a = nullptr;
  const float* w = nullptr;
};

// blockIdx.x: a tile of output columns (64 act columns for gate_up, 128 hidden columns for down);
// blockIdx.y: a row tile of the plan (blocks past *num_tiles exit: the grid is the worst case).
// kFp8: a_src and w are E4M3 codes with the scales of `fp8`; else bf16. FP8 keeps a stage's
// products apart from the sums (twice the accumulators): one block per multiprocessor, so that
// they stay in registers.
template <int BM, bool kGateUp, bool kFp8>
__global__ void __launch_bounds__(kThreads, kFp8 ? 1 : 2) grouped_gemm_kernel(
    const void* __restrict__ a_src, const void* __restrict__ w, Fp8Scales fp8,
    const int* __restrict__ order, const int* __restrict__ offsets,
    const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
    const int* __restrict__ num_tiles, const float* __restrict__ weights, int hidden, int inter,
    int top_k, __nv_bfloat16* __restrict__ out) {
  constexpr int kBytes = kFp8 ? 1 : 2;       // of a value
  constexpr int BKV = BK * 2 / kBytes;       // k values of a stage: 128-byte rows either way
  constexpr int kChunk = 16 / kBytes;        // values of a 16-byte copy
  constexpr int kStageBytes = (BM + BN) * BK * 2;
  constexpr int kARows = BM / 32;  // rows each thread copies per stage (32 rows x 8 chunks a pass)
  constexpr int kBRows = BN / 32;
  constexpr int MF = BM / 32;  // m16 fragments per warp: a warp covers BM / 2 rows
  const int tile = blockIdx.y;
  if (tile >= *num_tiles) return;
  const int e = tile_expert[tile];
  const int row0 = tile_row[tile];
  const int row_end = min(offsets[e + 1], row0 + BM);
  const int K = kGateUp ? hidden : inter;
  const int w_rows = kGateUp ? 2 * inter : hidden;

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t smem0 = smem_u32(smem);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int chunk = tid % 8, rsub = tid / 8;

  // Source rows of this thread's copies, fixed over the k loop. Rows past the expert's end are
  // zero-filled (their pointer stays in bounds, nothing is read).
  const unsigned char* a_ptr[kARows];
  bool a_ok[kARows];
#pragma unroll
  for (int i = 0; i < kARows; ++i) {
    const int p = row0 + rsub + 32 * i;
    a_ok[i] = p < row_end;
    const size_t row = kGateUp ? (a_ok[i] ? order[p] / top_k : 0) : (a_ok[i] ? p : row0);
    a_ptr[i] = static_cast<const unsigned char*>(a_src) + (row * K + chunk * kChunk) * kBytes;
  }
  const unsigned char* b_ptr[kBRows];
  bool b_ok[kBRows];
#pragma unroll
  for (int i = 0; i < kBRows; ++i) {
    const int r = rsub + 32 * i;
    int wr;
    if (kGateUp) {
      const int n0 = blockIdx.x * (BN / 2);
      wr = r < BN / 2 ? n0 + r : inter + n0 + (r - BN / 2);
      b_ok[i] = true;
    } else {
      wr = blockIdx.x * BN + r;
      b_ok[i] = wr < hidden;
      if (!b_ok[i]) wr = 0;
    }
    b_ptr[i] = static_cast<const unsigned char*>(w) + (((size_t)e * w_rows + wr) * K + chunk * kChunk) * kBytes;
  }

  // FP8: K may end inside the last stage (a multiple of 64, not of 128): its copies past K are
  // zeros, which add nothing.
  auto load_stage = [&](int stage, int kt) {
    const uint32_t sa = smem0 + stage * kStageBytes, sb = sa + BM * BK * 2;
    const int k0 = kt * BKV;
    const bool in_k = !kFp8 || k0 + chunk * kChunk < K;
#pragma unroll
    for (int i = 0; i < kARows; ++i)
      cp_async16(sa + swizzle(rsub + 32 * i, chunk), a_ptr[i] + k0 * kBytes, a_ok[i] && in_k);
#pragma unroll
    for (int i = 0; i < kBRows; ++i)
      cp_async16(sb + swizzle(rsub + 32 * i, chunk), b_ptr[i] + k0 * kBytes, b_ok[i] && in_k);
  };

  const int wm = warp / 4, wn = warp % 4;
  float acc[MF][4][4];
#pragma unroll
  for (int mi = 0; mi < MF; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mi][ni][c] = 0.f;

  const int KT = (K + BKV - 1) / BKV;
  // FP8: the scale rows of this thread's accumulator rows (-1: past the expert's rows) and of
  // the block's weight rows (gate_up: the gate half's and the up half's).
  int a_scale_row[MF][2];
  const float* w_scale[2] = {nullptr, nullptr};
  if constexpr (kFp8) {
#pragma unroll
    for (int mi = 0; mi < MF; ++mi)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int p = row0 + wm * (BM / 2) + mi * 16 + lane / 4 + half * 8;
        a_scale_row[mi][half] = p >= row_end ? -1 : kGateUp ? order[p] / top_k : p;
      }
    const int scale_rows = (w_rows + 127) / 128;
    const float* we = fp8.w + (size_t)e * scale_rows * KT;
    if (kGateUp) {
      w_scale[0] = we + (blockIdx.x * (BN / 2)) / 128 * KT;
      w_scale[1] = we + (inter + blockIdx.x * (BN / 2)) / 128 * KT;
    } else {
      w_scale[0] = w_scale[1] = we + (blockIdx.x * BN) / 128 * KT;
    }
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load_stage(s, s);
    cp_async_commit();  // an empty group past the end keeps the wait counts uniform
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kStages - 2>();
    // Stage kt has landed for every thread, and every warp is done with stage kt - 1, which the
    // copy below overwrites.
    __syncthreads();
    const int next = kt + kStages - 1;
    if (next < KT) load_stage(next % kStages, next);
    cp_async_commit();
    const uint32_t sa = smem0 + (kt % kStages) * kStageBytes, sb = sa + BM * BK * 2;
    // FP8: this stage's products, scaled into acc below; bf16: acc itself. The stage's scales are
    // asked for first, so that their loads overlap the products.
    float part_fp8[kFp8 ? MF : 1][4][4];
    float a_scale[kFp8 ? MF : 1][2], w_scale_kt[2];
    if constexpr (kFp8) {
      w_scale_kt[0] = __ldg(w_scale[0] + kt);
      w_scale_kt[1] = __ldg(w_scale[1] + kt);
#pragma unroll
      for (int mi = 0; mi < MF; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = a_scale_row[mi][half];
          a_scale[mi][half] = r < 0 ? 0.f : __ldg(fp8.a + (size_t)r * KT + kt);
        }
    }
    if constexpr (kFp8)
#pragma unroll
      for (int mi = 0; mi < MF; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
          for (int c = 0; c < 4; ++c) part_fp8[mi][ni][c] = 0.f;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t af[MF][4];
#pragma unroll
      for (int mi = 0; mi < MF; ++mi)
        ldmatrix_x4(af[mi], sa + swizzle(wm * (BM / 2) + mi * 16 + lane % 16, kk * 2 + lane / 16));
      // Two x4 loads, each two n8 fragments: gate_up takes weight rows wn*16.. of the gate half
      // and the same of the up half; down takes 32 consecutive rows.
      uint32_t bf[2][4];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int base = kGateUp ? q * (BN / 2) + wn * 16 : wn * 32 + q * 16;
        ldmatrix_x4(bf[q], sb + swizzle(base + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
      }
#pragma unroll
      for (int mi = 0; mi < MF; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          if constexpr (kFp8)
            mma_e4m3(part_fp8[mi][ni], af[mi], bf[ni / 2][2 * (ni % 2)], bf[ni / 2][2 * (ni % 2) + 1]);
          else
            mma_bf16(acc[mi][ni], af[mi], bf[ni / 2][2 * (ni % 2)], bf[ni / 2][2 * (ni % 2) + 1]);
        }
    }
    if constexpr (kFp8) {
#pragma unroll
      for (int mi = 0; mi < MF; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int ni = 0; ni < 4; ++ni) {
            const float s = a_scale[mi][half] * w_scale_kt[kGateUp ? ni / 2 : 0];
            acc[mi][ni][half * 2] += part_fp8[mi][ni][half * 2] * s;
            acc[mi][ni][half * 2 + 1] += part_fp8[mi][ni][half * 2 + 1] * s;
          }
        }
    }
  }
  cp_async_wait<0>();

  // Accumulator (mi, ni): rows lane/4 and lane/4 + 8 of the m16 fragment, columns 2*(lane%4)
  // and +1 of the n8 fragment.
#pragma unroll
  for (int mi = 0; mi < MF; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int p = row0 + wm * (BM / 2) + mi * 16 + lane / 4 + half * 8;
      if (p >= row_end) continue;
      if (kGateUp) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int col = blockIdx.x * (BN / 2) + wn * 16 + h * 8 + 2 * (lane % 4);
          const float* g = &acc[mi][h][half * 2];
          const float* u = &acc[mi][2 + h][half * 2];
          *reinterpret_cast<__nv_bfloat162*>(out + (size_t)p * inter + col) =
              __floats2bfloat162_rn(silu(g[0]) * u[0], silu(g[1]) * u[1]);
        }
      } else {
        const int slot = order[p];
        const float s = weights[slot];
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const int col = blockIdx.x * BN + wn * 32 + ni * 8 + 2 * (lane % 4);
          if (col < hidden)
            *reinterpret_cast<__nv_bfloat162*>(out + (size_t)slot * hidden + col) =
                __floats2bfloat162_rn(s * acc[mi][ni][half * 2], s * acc[mi][ni][half * 2 + 1]);
        }
      }
    }
}

// FP8 (b.gate_up_scales set): x and then act are quantised into b.x_fp8 / b.act_fp8 first.
template <int BM, bool kFp8>
cudaError_t run_gemms(const ExpertBuffers& b, const void* x, int tokens, const float* weights, int max_tiles,
                      cudaStream_t stream) {
  constexpr int smem = kStages * (BM + BN) * BK * 2;
  auto* gate_up = grouped_gemm_kernel<BM, true, kFp8>;
  auto* down = grouped_gemm_kernel<BM, false, kFp8>;
  // Above 48 KB a kernel's dynamic shared memory must be allowed explicitly (per device, not a
  // stream operation, so it is harmless inside a graph capture).
  cudaError_t err = cudaFuncSetAttribute(gate_up, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(down, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  auto* act = static_cast<__nv_bfloat16*>(b.act);
  const void* a = x;
  Fp8Scales up_scales, down_scales;
  if constexpr (kFp8) {
    err = quantize_rows_fp8(x, tokens, nullptr, b.hidden, b.x_fp8, b.x_scales, stream);
    if (err != cudaSuccess) return err;
    a = b.x_fp8;
    up_scales = Fp8Scales{b.x_scales, b.gate_up_scales};
    down_scales = Fp8Scales{b.act_scales, b.down_scales};
  }
  gate_up<<<dim3(b.inter / (BN / 2), max_tiles), kThreads, smem, stream>>>(
      a, b.gate_up, up_scales, b.order, b.offsets, b.tile_expert, b.tile_row, b.num_tiles, weights, b.hidden,
      b.inter, b.top_k, act);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const void* a_down = act;
  if constexpr (kFp8) {
    // The routed rows only: offsets[experts] of them.
    err = quantize_rows_fp8(act, tokens * b.top_k, b.offsets + b.experts, b.inter, b.act_fp8, b.act_scales, stream);
    if (err != cudaSuccess) return err;
    a_down = b.act_fp8;
  }
  down<<<dim3((b.hidden + BN - 1) / BN, max_tiles), kThreads, smem, stream>>>(
      a_down, b.down, down_scales, b.order, b.offsets, b.tile_expert, b.tile_row, b.num_tiles, weights, b.hidden,
      b.inter, b.top_k, static_cast<__nv_bfloat16*>(b.part));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_prefill(const ExpertBuffers& b, const void* x, const int* ids,
                           const float* weights, int tokens, int tile_m, void* y,
                           cudaStream_t stream) {
  if (tile_m != 64 && tile_m != 128) return cudaErrorInvalidValue;
  const int max_tiles =
      static_cast<int>(heuristics::max_row_tiles(static_cast<int64_t>(tokens) * b.top_k, b.experts, tile_m));
  cudaError_t err = launch_plan(b, ids, tokens, tile_m, stream);
  if (err != cudaSuccess) return err;
  if (b.gate_up_scales != nullptr) {
    if (b.x_fp8 == nullptr || b.act_fp8 == nullptr || b.down_scales == nullptr || b.inter % 128 != 0)
      return cudaErrorInvalidValue;
    err = tile_m == 64 ? run_gemms<64, true>(b, x, tokens, weights, max_tiles, stream)
                       : run_gemms<128, true>(b, x, tokens, weights, max_tiles, stream);
  } else {
    err = tile_m == 64 ? run_gemms<64, false>(b, x, tokens, weights, max_tiles, stream)
                       : run_gemms<128, false>(b, x, tokens, weights, max_tiles, stream);
  }
  if (err != cudaSuccess) return err;
  if (b.leave_partials) {
    *b.leave_partials = PartialSums{true};
    return cudaSuccess;
  }
  return launch_combine(b, ids, tokens, PartialSums{true}, y, stream);
}

}  // namespace moe::cuda::kernels
