// The Hopper kernel of paged attention (AttentionPath::kWgmma, prefill at head dim 128 on a
// device of compute capability 9.0): one block per (128 rows of one sequence, one query head), two
// warpgroups of 64 rows each, key tiles of 128 on wgmma with an online softmax (online_softmax.cuh).
//
// Why it exists: the mma.sync kernel (attention_tiled.cu) ran a 2,048-token prefill of
// qwen3-30b-a3b at about 110 TFLOP/s (14.7 ms of a ~40 ms prefill, H100): 64-row tiles, K and V
// loaded synchronously, register-bound to three blocks a multiprocessor. This one runs it at ~320
// (docs/perf/wgmma-prefill-attention.md), ~370 with the heads varying fastest over the grid
// (docs/perf/attention-heads-first-grid.md). How:
// - S = Q K^T is one warpgroup's m64n128 wgmma chain over the head dim, both operands in shared
//   memory (Q stays there for the whole block); O += P V takes P straight from the S accumulators
//   (the accumulator layout of S is the register A fragment of the second product once rounded to
//   bf16), and V in its cache layout, dims contiguous, read transposed (an MN-major descriptor).
// - Each warpgroup pipelines its products (FlashAttention-3's intra-warpgroup overlap): S of tile
//   t + 1 is issued before O += P V of tile t, and its softmax runs while P V is on the tensor
//   cores. No wgmma sits under a branch: ptxas serialises wgmmas after code it cannot prove
//   uniform over the warpgroup (C7514/C7518), so both warpgroups compute every tile of the block
//   (a warpgroup's rows that precede a tile get zero weights from the mask), and the last tile's
//   P V is peeled out of the loop.
// - The softmax works on raw scores (online_softmax.cuh, "raw-score form"): the max before the
//   scale, each weight one FFMA and one ex2: the instruction count of the softmax, not the tensor
//   cores, bounded the first version of this kernel (ncu: issue-bound, tensor pipe 33% active).
// - K and V tiles go through a ring of three stages handed over by mbarriers, not block barriers,
//   so that the warpgroups do not wait for each other: a stage's full barrier completes when every
//   thread's copies of it have landed (cp.async.mbarrier.arrive: no thread waits for its own), its
//   empty barrier when every warp's products on it are done. Every thread copies (a paged cache
//   has no tensor map a TMA load could use); a tile's block-table entries are read one tile before
//   its copies, all eight of a thread's at once, so that no copy waits on a table read.
// - 128 rows a block read each K/V tile once for 2 x 64 rows: 128 FLOP a byte of L2 traffic.
// - For an FP8 o projection the epilogue writes its input quantised (out_codes): a head's 128 dims,
//   which a quad of threads holds, are one scale block, so no pass over the bf16 output follows
//   (docs/perf/fp8-quantised-inputs.md).
// Shared memory: Q and three stages of K and V, each tile [2 halves of 64 dims][128 rows][64] bf16
// in the 128-byte swizzle, 225 KB: one block a multiprocessor, 256 threads of up to 255 registers.
// Only CUDA headers (and <atomic>) here.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "backend/cuda/attention/attention_device.cuh"
#include "backend/cuda/attention/attention_paths.h"
#include "backend/cuda/attention/online_softmax.cuh"
#include "backend/cuda/mma_sync.cuh"
#include "backend/cuda/ops/fp8_act_quant.cuh"
#include "backend/cuda/sm90_async.cuh"

namespace moe::cuda::kernels::attention_detail {

namespace {

constexpr int kD = kWgmmaHeadDim;           // the head dim this kernel runs
constexpr int kBlockRows = 128;             // query rows of a block
constexpr int kBlockThreads = 256;          // two warpgroups of 64 rows
constexpr int kHalfBytes = 128 * 128;       // 64 dims (128 bytes) of 128 rows
constexpr int kTileBytes = 2 * kHalfBytes;  // Q, K or V of a tile: 32 KB
constexpr int kStages = 3;                  // tile t computed while t + 1 and t + 2 are copied
constexpr int kSmemBytes = kTileBytes * (1 + 2 * kStages) + 1024;  // + the 1024-byte alignment

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // as the kernel's body: elsewhere it would be unused
// store_row_pair's form for an FP8 projection's input (PagedAttentionParams::out_codes): a row
// below p.code_rows as E4M3 codes of its head's 128 dims (one scale block: a quad holds them) and
// the block's scale, the rest as bf16. The values are rounded to bf16 first, so that codes and
// scales are the quantising kernel's of the bf16 output (fp8_act_quant.cuh). Every lane takes the
// shuffles, whichever rows it writes.
__device__ __forceinline__ void store_row_pair_codes(const PagedAttentionParams& p, const float (&o)[kD / 8][4],
                                                     float l_a, float l_b, int row0, int ra, int rows, int head) {
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
  }
  const int tq = threadIdx.x % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // row a (accumulators 0, 1), then row b (2, 3)
    const float l = half == 0 ? l_a : l_b;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int r = ra + 8 * half, row = row0 + r;
    float v[kD / 8][2];
    float amax = 0.f;
#pragma unroll
    for (int nd = 0; nd < kD / 8; ++nd)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        v[nd][i] = __bfloat162float(__float2bfloat16_rn(o[nd][2 * half + i] * inv));
        amax = fmaxf(amax, fabsf(v[nd][i]));
      }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    if (r >= rows) continue;
    const size_t at = ((size_t)row * p.q_heads + head) * kD + 2 * tq;
    if (row < p.code_rows) {
      const float scale = fp8_act_scale(amax), inverse = fp8_act_inverse(scale);
#pragma unroll
      for (int nd = 0; nd < kD / 8; ++nd)
        *reinterpret_cast<uint16_t*>(p.out_codes + at + nd * 8) =
            static_cast<uint16_t>(fp8_act_codes2(v[nd][0], v[nd][1], inverse));
      if (tq == 0) p.out_scales[(size_t)head * p.code_rows + row] = scale;
    } else {
#pragma unroll
      for (int nd = 0; nd < kD / 8; ++nd)
        *reinterpret_cast<uint32_t*>(p.out + at + nd * 8) = pack_bf16(v[nd][0], v[nd][1]);
    }
  }
}
#endif

__global__ void __launch_bounds__(kBlockThreads, 1) wgmma_attention_kernel(const PagedAttentionParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kGroupRows = 64;  // query rows of a warpgroup
  constexpr int kTileKeys = 128;  // keys of a K/V tile
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bars[2 * kStages];
  const uint32_t base = (sm90::smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t s_q = base;
  const auto s_k = [&](int stage) { return base + kTileBytes * (1 + 2 * stage); };
  const auto s_v = [&](int stage) { return base + kTileBytes * (2 + 2 * stage); };
  const auto full = [&](int stage) { return sm90::smem_u32(&bars[stage]); };
  const auto empty = [&](int stage) { return sm90::smem_u32(&bars[kStages + stage]); };
  // Shared address of 16-byte chunk c (0..15, dims 8c..8c+7) of row r of a swizzled tile.
  const auto chunk_at = [](uint32_t tile, int r, int c) {
    return tile + (c >> 3) * kHalfBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4);
  };

  // Heads vary fastest over the grid, so that every head's longest tiles start before any shorter
  // one (longest first: the last wave holds the shortest tiles).
  const RowTile rt = find_row_tile(p, kBlockRows, blockIdx.y, gridDim.y);
  if (rt.seq < 0) return;
  const int seq = rt.seq, row0 = rt.row0, rows = rt.rows, pos0 = rt.pos0;
  const int head = blockIdx.x;
  const int kvh = head / (p.q_heads / p.kv_heads);
  const int kv_end = pos0 + rows;  // keys this tile can see
  const int tiles = kv_end > 0 ? (kv_end + kTileKeys - 1) / kTileKeys : 0;
  const int tid = threadIdx.x, group = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
  const int gr = lane / 4, tq = lane % 4;
  const int block_shift = __ffs(p.block_size) - 1;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(full(s), kBlockThreads);        // each thread's copies of the stage
      sm90::mbar_init(empty(s), kBlockThreads / 32);  // each warp's products on the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // Copies: thread t moves chunk t % 16 of rows t / 16 + 16 i, i < 8, of each tile.
  const int chunk = tid & 15;
  for (int i = 0; i < 8; ++i) {
    const int r = (tid >> 4) + 16 * i;
    const bool ok = r < rows;
    const uint16_t* src = ok ? p.q + ((size_t)(row0 + r) * p.q_heads + head) * kD + chunk * 8 : p.q;
    sm90::cp_async16(chunk_at(s_q, r, chunk), src, ok);
  }
  // The block-table entries of this thread's 8 rows of tile u, read together and branch-free: a
  // row past kv_end reads the sequence's last entry it may read, and copies nothing.
  const int32_t* table = p.block_tables + (size_t)seq * p.max_blocks_per_seq;
  const size_t block_elems = (size_t)p.block_size * p.kv_heads * kD;
  int pages[8];
  const auto fetch_pages = [&](int u) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int j = min(u * kTileKeys + (tid >> 4) + 16 * i, kv_end - 1);
      pages[i] = __ldg(table + (j >> block_shift));
    }
  };
  // Tile u's copies into stage u % kStages (keys past kv_end as zeros: the cache there may hold
  // anything, NaN included, and a zero V row times a zero weight must stay zero), then the next
  // tile's entries. The thread's arrival on the stage's full barrier completes when its copies
  // (and Q's, before the first) have landed.
  const auto load_kv = [&](int u) {
    const int stage = u % kStages, kt = u * kTileKeys;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = (tid >> 4) + 16 * i;
      const int j = kt + r;
      const bool ok = j < kv_end;
      const size_t off = (size_t)pages[i] * block_elems +
                         (((j & (p.block_size - 1)) * p.kv_heads + kvh) * kD + chunk * 8);
      sm90::cp_async16(chunk_at(s_k(stage), r, chunk), p.k_cache + (ok ? off : 0), ok);
      sm90::cp_async16(chunk_at(s_v(stage), r, chunk), p.v_cache + (ok ? off : 0), ok);
    }
    sm90::cp_async_arrive(full(stage));
    if (u + 1 < tiles) fetch_pages(u + 1);
  };
  if (tiles > 0) fetch_pages(0);
  for (int u = 0; u < kStages && u < tiles; ++u) load_kv(u);

  // This thread's two rows (a, b) in the wgmma accumulator layout, and its warpgroup's first.
  const int row_a = group * kGroupRows + warp * 16 + gr;
  const int pos_a = pos0 + row_a, pos_b = pos_a + 8;
  const int group_first = pos0 + group * kGroupRows;
  const float scale = p.scale * kLog2e;

  float o[kD / 8][4];
#pragma unroll
  for (int nd = 0; nd < kD / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  auto& o_flat = reinterpret_cast<float(&)[kD / 2]>(o);
  uint32_t pf[kTileKeys / 16][4];  // P of the tile whose P V is next

  // S of tile u (issued, not awaited), once the tile's copies have landed.
  const auto issue_s = [&](float (&s_flat)[kTileKeys / 2], int u) {
    const int stage = u % kStages;
    sm90::mbar_wait(full(stage), (u / kStages) & 1);
    // The copies were written through the generic proxy (cp.async), and the wgmmas read them
    // through the async proxy: the fence orders the two for this thread.
    sm90::fence_proxy_async();
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t half = (kk / 4) * kHalfBytes, step = (kk % 4) * 32;
      sm90::wgmma_m64n128(s_flat, sm90::sw128_desc(s_q + half + group * kGroupRows * 128 + step),
                          sm90::sw128_desc(s_k(stage) + half + step), kk > 0);
    }
    sm90::wgmma_commit();
  };
  // Tile u's raw scores into the running max and sums; s then holds the weights.
  const auto softmax = [&](float (&s)[kTileKeys / 8][4], int u) {
    const int kt = u * kTileKeys;
    if (kt + kTileKeys - 1 > group_first) {
      // The tile crosses the diagonal of some row of the warpgroup (or lies past all of them):
      // each row sees the keys up to its own position.
#pragma unroll
      for (int nt = 0; nt < kTileKeys / 8; ++nt) {
        const int j = kt + nt * 8 + 2 * tq;
        if (j > pos_a) s[nt][0] = -INFINITY;
        if (j + 1 > pos_a) s[nt][1] = -INFINITY;
        if (j > pos_b) s[nt][2] = -INFINITY;
        if (j + 1 > pos_b) s[nt][3] = -INFINITY;
      }
    }
    const TileMax tm = raise_running_max_raw(s, m_a, m_b, scale);
    const RowPair sum = tile_weights_and_sums_raw(s, tm, scale);
    m_a = tm.m_a;
    m_b = tm.m_b;
    l_a = l_a * tm.alpha_a + sum.a;
    l_b = l_b * tm.alpha_b + sum.b;
    return tm;
  };

  if (tiles > 0) {
    float s[kTileKeys / 8][4];
    auto& s_flat = reinterpret_cast<float(&)[kTileKeys / 2]>(s);
    issue_s(s_flat, 0);
    sm90::wgmma_wait<0>();
    sm90::fence_regs(s_flat);
    softmax(s, 0);  // O is still zero: nothing to rescale
#pragma unroll
    for (int kk = 0; kk < kTileKeys / 16; ++kk) accumulators_to_a_fragment(s[2 * kk], s[2 * kk + 1], pf[kk]);
  }
  // Tiles 0 .. tiles - 2: S of the next tile beside O += P V of this one. The last tile's P V
  // after the loop, so that no wgmma sits under a branch.
  for (int t = 0; t + 1 < tiles; ++t) {
    const int stage = t % kStages;
    float s[kTileKeys / 8][4];
    auto& s_flat = reinterpret_cast<float(&)[kTileKeys / 2]>(s);
    issue_s(s_flat, t + 1);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kTileKeys / 16; ++kk)
      sm90::wgmma_m64n128_rs_mn(o_flat, pf[kk], sm90::sw128_desc_mn(s_v(stage) + kk * 2048, kHalfBytes));
    sm90::wgmma_commit();
    // Tile t + 2 takes the stage of tile t - 1, once every warp's products there are done.
    if (t >= 1 && t + 2 < tiles) {
      sm90::mbar_wait(empty((t - 1) % kStages), ((t - 1) / kStages) & 1);
      load_kv(t + 2);
    }
    sm90::wgmma_wait<1>();  // S of tile t + 1; O += P V of tile t may still run
    sm90::fence_regs(s_flat);
    const TileMax tm = softmax(s, t + 1);
    sm90::wgmma_wait<0>();
    sm90::fence_regs(o_flat);
    if (lane == 0) sm90::mbar_arrive(empty(stage));
    // Past the first tiles a row's max seldom moves: the warp skips the rescale when no row did.
    if (__any_sync(0xffffffffu, tm.alpha_a != 1.f || tm.alpha_b != 1.f)) rescale_rows(o, tm);
#pragma unroll
    for (int kk = 0; kk < kTileKeys / 16; ++kk) accumulators_to_a_fragment(s[2 * kk], s[2 * kk + 1], pf[kk]);
  }
  if (tiles > 0) {
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kTileKeys / 16; ++kk)
      sm90::wgmma_m64n128_rs_mn(o_flat, pf[kk],
                                sm90::sw128_desc_mn(s_v((tiles - 1) % kStages) + kk * 2048, kHalfBytes));
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_regs(o_flat);
  }
  sm90::cp_async_wait_all();

  if (p.out_codes)
    store_row_pair_codes(p, o, l_a, l_b, row0, row_a, rows, head);
  else
    store_row_pair<kD>(p, o, l_a, l_b, row0, row_a, rows, head);
#endif
}

}  // namespace

bool wgmma_attention_device() {
  // Asked on every call that kAuto decides: the answer is kept per device (0 unknown, 1 no, 2 yes).
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device >= 0 && device < kDevices && known[device].load(std::memory_order_relaxed) != 0)
    return known[device].load(std::memory_order_relaxed) == 2;
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    return false;
  const bool yes = major == 9 && minor == 0;
  if (device >= 0 && device < kDevices) known[device].store(yes ? 2 : 1, std::memory_order_relaxed);
  return yes;
}

cudaError_t run_wgmma(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.head_dim != kD) return cudaErrorInvalidValue;
  // Past the 48 KB default: set on every call (cheap, and right for whichever device is current).
  cudaError_t err =
      cudaFuncSetAttribute(wgmma_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  // Each sequence leaves at most one partly filled tile.
  const dim3 grid(p.q_heads, (p.tokens + kBlockRows - 1) / kBlockRows + p.num_seqs);
  wgmma_attention_kernel<<<grid, kBlockThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace moe::cuda::kernels::attention_detail
