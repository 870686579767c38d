// The two grouped GEMMs of the Hopper routed-expert path (entry: moe_wgmma.cu): those of
// moe_prefill.cu (same plan, same fused SiLU(gate) * up epilogue, same bf16 partial sums by slot
// and deterministic combine) on wgmma, with the weights brought in by TMA. A work item = one row
// tile of one expert (BM routed rows, gathered through the plan's order) x 256 weight rows
// (BM = 256: x 128); persistent blocks of 384 threads (BM = 256: 512):
//  - warpgroup 0 (BM = 256: 0 and 1) produces: one thread issues the TMA loads of the weight
//    tile (a fixed tensor, 128-byte swizzle); all producer threads gather the BM activation rows
//    with cp.async into the same swizzled layout (sm_90 has no TMA gather). Registers handed
//    over with setmaxnreg.
//  - the last two warpgroups consume: wgmma m64nNk16 from shared memory, f32 accumulators. BM = 128:
//    each takes 64 rows x 256 weight rows; BM = 64: both take the 64 rows, each half the weights;
//    BM = 256 (weight tiles of 128 rows): each takes 128 rows as two m64 sub-tiles, and skips
//    those that hold no row of the expert (then only keeping the ring turning).
// A kStages-deep ring of stages with full/empty mbarriers. The full barrier of a stage completes
// when the TMA bytes have landed and each producer thread's cp.async copies of the stage have
// (cp.async.mbarrier.arrive: the thread does not wait for them); a consumer then fences the
// stage to the async proxy, which the tensor cores read through.
// gate_up puts 64 (or 128) gate rows and the matching up rows in one tile, so each consumer
// thread holds gate and up of the same act column. Mixed row tiles (below, picked per forward by
// the plan) run 128 x 256 and 256 x 128 items in one grid.
// FP8 experts (kFp8, W8A8): the same ring over E4M3 codes, a stage 128 k (one scale block) in the
// same 128-byte rows, wgmma m64nNk32 e4m3, each stage's products scaled into the f32 sums by the
// activation row's and the weight block's scales; tiles of 64 x 256, 64 x 128, 128 x 256 (a
// consumer's 256 weight rows as two halves) or 128 x 128. In 64 x 256 and 128 x 256 tiles gate_up's
// epilogue writes act already quantised for down (kQuantisesAct, kQuantisesActWhole).
// This file holds the kernel, its tile configurations, the tensor maps of the weights and the
// launch of both GEMMs for one row tile (run_tile, moe_wgmma_gemm.h); the entry sizes the forward
// and runs the plan and the combine around them, the sm_90a instructions the pipeline is made of
// are in sm90_async.cuh, and the epilogue's per-fragment pieces in wgmma_epilogue.cuh. Only CUDA headers and plain launch headers.
#include <cuda.h>  // CUtensorMap only: tensor_map.h encodes it
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "backend/cuda/moe/moe_decode_launch.h"
#include "backend/cuda/moe/moe_heuristics.h"
#include "backend/cuda/moe/moe_wgmma_gemm.h"
#include "backend/cuda/pdl.h"
#include "backend/cuda/sm90_async.cuh"
#include "backend/cuda/tensor_map.h"
#include "backend/cuda/moe/wgmma_epilogue.cuh"
#include "backend/cuda/ops/fp8_blocks_launch.h"

// The compute_90 (PTX fallback) pass compiles the kernel body out (it needs sm_90a), which leaves
// the helpers and tile constants below unreferenced there: not worth a warning per helper.
#pragma nv_diag_suppress 177

namespace moe::cuda::kernels {

namespace {

using namespace sm90;
using namespace wgmma_epilogue;

constexpr int BK = wgmma_detail::kStepK;  // one 128-byte swizzle atom of bf16 along k
// k of a stage by operand format: the same 128 bytes a row, so FP8 steps 128 (one scale block).
template <bool kFp8>
constexpr int kStageK = kFp8 ? 2 * BK : BK;

// BM activation rows x BN weight rows per block: BN 256 normally, 128 where the grid of 256-row
// tiles would leave multiprocessors idle (heuristics::wgmma_narrow_tiles). BM 256 goes with BN
// 128 only: the same 48 KB a stage and 128 accumulators a consumer thread as BM 128 x BN 256,
// for experts whose rows would leave a second, nearly empty 128-row tile re-reading the weights.
template <int BM, int BN, bool kFp8 = false>
struct Cfg {
  static_assert(BN == 256 || BN == 128, "weight rows per block");
  static_assert(BM == 64 || BM == 128 || (BM == 256 && BN == 128), "row tile");
  static constexpr int kParts = BM == 64 ? 2 : 1;  // weight-row parts, one per consumer at BM 64
  static constexpr int WN = BN / kParts;           // wgmma N of one consumer
  static constexpr int kBoxRows = WN / 2;          // rows of one TMA box (gate or up half of a part)
  static constexpr int kConsumerRows = BM == 64 ? 64 : BM / 2;  // rows of one consumer
  static constexpr int kSubs = kConsumerRows / 64;               // its m64 sub-tiles
  static_assert(kSubs >= 1 && kSubs * 64 == kConsumerRows, "whole m64 sub-tiles");
  static constexpr int kABytes = BM * BK * 2;
  static constexpr int kBBytes = BN * BK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  // bf16: 200 KB / 192 KB (128 KB at BM 128 x BN 128). FP8 stages carry twice the k, so a stage
  // takes half the tensor-core time: as many as fit in 200 KB, to keep the gathers' L2 latency
  // covered.
  static constexpr int kStages = kFp8 ? (204800 / kStageBytes < 8 ? 204800 / kStageBytes : 8) : BM == 64 ? 5 : 4;
  // After the barriers: down's epilogue buffer of 128- and 256-row tiles, 2 KB a consumer warp
  // (store_rows_staged; 64-row tiles keep store_row_pairs: docs/perf/down-stores-whole-lines.md).
  static constexpr int kEpilogueBytes = BM >= 128 ? 8 * 2048 : 0;
  static constexpr int kSmem = 1024 + kStages * kStageBytes + 2 * kStages * 8 + kEpilogueBytes;
  // Producer warpgroups: two at BM 256, so that a thread gathers 8 rows a stage as at BM 128, not
  // 16. Measured (H100, moe-bench layer, µs, one producer warpgroup -> two): deepseek-v2-lite
  // M = 2048 678 -> 657; qwen3-30b-a3b with 256-row tiles forced, M = 2048 697 -> 670, 4096
  // 1139 -> 1106, 8192 2053 -> 2006 (still behind 128-row tiles there: 670, 947, 1604).
  static constexpr int kProducerWGs = BM == 256 ? 2 : 1;
  static constexpr int kProducers = 128 * kProducerWGs;
  static constexpr int kThreads = kProducers + 256;
  // Registers handed over with setmaxnreg. The block starts with kThreads times the launch's
  // per-thread count (64K / kThreads, rounded down to 8: 168 at 384 threads, not 170), and
  // setmaxnreg.inc only takes what setmaxnreg.dec gave back: asking for more waits forever.
  static constexpr int kProducerRegs = kProducerWGs == 1 ? 56 : 40;
  static constexpr int kConsumerRegs = kProducerWGs == 1 ? 224 : 216;
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static_assert(kProducers * kProducerRegs + 256 * kConsumerRegs <= kThreads * kLaunchRegs,
                "setmaxnreg hands over no more registers than the block holds");
};

// Mixed row tiles (heuristics::kWgmmaMixedTiles): the plan cuts every expert into 128-row tiles,
// and an expert of 129 to 256 rows, which that leaves with a second, nearly empty tile re-reading
// all of its weights, is run as one 256-row tile instead: its two tiles' 2 x col_tiles items of
// 128 x 256 become 2 x col_tiles items of 256 x 128 (half the weight rows each, so every weight
// tile is read once). Both shapes have 48 KB stages, four of them, and 128 accumulators a consumer
// thread, so one ring serves both: Cfg<256, 128>'s (two producer warpgroups, 512 threads), with
// TMA boxes of 64 rows (two or four a stage). At 512 threads ptxas gives no instruction more than
// 128 registers, so a consumer takes its 64 x 256 of a 128 x 256 item as two m64n128 halves. One
// producer warpgroup with Cfg<128, 256>'s register split instead (m64n256 kept) spilled in
// gate_up's consumers and cost its ordinary items 1.5% (docs/perf/mixed-row-tiles.md).
template <int BM, int BN, bool kMixed, bool kFp8 = false>
using RingOf = std::conditional_t<kMixed, Cfg<256, 128>, Cfg<BM, BN, kFp8>>;
static_assert(Cfg<128, 256>::kStageBytes == Cfg<256, 128>::kStageBytes &&
                  Cfg<128, 256>::kStages == Cfg<256, 128>::kStages && Cfg<256, 128>::kBoxRows == 64,
              "mixed tiles share one ring");

constexpr int kTallMaxRows = 256;
__device__ __forceinline__ bool tall_expert(int rows) { return rows > 128 && rows <= kTallMaxRows; }

// FP8 gate_up items of 64 x 256 (not narrow) cover 128 act columns, one scale block of down's
// activations: their epilogue quantises act itself (the two consumers, 64 columns each, agree on
// each row's max through shared memory) and writes E4M3 codes and scales, which down reads, in
// place of bf16 act and a quantising kernel between the GEMMs.
template <int BM, int BN, bool kMixed, bool kFp8>
constexpr bool kQuantisesAct = kFp8 && !kMixed && BM == 64 && BN == 256;
// FP8 items of 128 x 256: each consumer holds whole scale blocks of its rows' act.
template <int BM, int BN, bool kMixed, bool kFp8>
constexpr bool kQuantisesActWhole = kFp8 && !kMixed && BM == 128 && BN == 256;

template <int M, int N>
struct TileShape {
  static constexpr int kM = M, kN = N;
};

// Persistent: block b takes work items b, b + gridDim.x, ... of (*num_tiles row tiles) x
// col_tiles output-column tiles (128 act columns for gate_up, 256 hidden columns for down) x
// `splits` pieces of the k range (down only, heuristics::wgmma_down_splits), the split varying
// fastest, then the column tile, so that blocks running together share activation rows in L2.
// With kMixed (BM 128, BN 256), the items of a tall expert's two tiles are its 256 x 128 items.
// One ring of stages and one stage counter run across the items: the producer fills the next
// item's stages while the consumers finish the last one and write its epilogue.
// wmap: the weights as a 2-D tensor [experts * rows, K] (gate_up: rows = 2 * inter, K = hidden;
// down: rows = hidden, K = inter), box 64 x RingOf::kBoxRows.
// Both GEMMs are launched as programmatic dependents (pdl.h). down's predecessor is gate_up,
// which lets it start only after waiting for the plan itself, so down may read the plan's tiles
// before its own wait and put its first item's weight tiles (which depend on nothing computed) in
// flight while gate_up finishes; only the activation gather waits for gate_up.
// out: gate_up: bf16 act [slots, inter] (kQuantisesAct: E4M3 act [slots, inter] and out_scales
// [slots, inter / 128]); down: bf16 partial sums [slots, hidden], or with splits > 1 f32 ones
// [splits, split_stride slots, hidden].
template <int BM, int BN, bool kGateUp, bool kMixed, bool kFp8>
__global__ void __launch_bounds__(RingOf<BM, BN, kMixed, kFp8>::kThreads, 1) wgmma_gemm_kernel(
    const __grid_constant__ CUtensorMap wmap, const void* __restrict__ a_src, const float* __restrict__ a_scales,
    const float* __restrict__ w_scales, const int* __restrict__ order, const int* __restrict__ offsets,
    const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
    const int* __restrict__ num_tiles, const float* __restrict__ weights, int hidden, int inter,
    int top_k, int col_tiles, int splits, long long split_stride, void* __restrict__ out,
    float* __restrict__ out_scales) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(!kMixed || (BM == 128 && BN == 256), "mixed tiles: 128 x 256 and 256 x 128");
  using R = RingOf<BM, BN, kMixed, kFp8>;
  static_assert(!kFp8 || (!kMixed && Cfg<BM, BN>::kSubs == 1 && (Cfg<BM, BN>::WN <= 128 || BM == 128)),
                "FP8 tiles: one m64 sub-tile a consumer, of 256 weight rows only at BM 128 (two halves)");
  constexpr int S = R::kStages;
  constexpr int SK = kStageK<kFp8>;
  const int K = kGateUp ? hidden : inter;
  const int KT = K / SK;
  const int w_rows = kGateUp ? 2 * inter : hidden;
  struct Item {
    int tile, ct, split, kt0, kt1;  // row tile, column tile, k-steps [kt0, kt1)
  };
  auto item_at = [&](int item) {
    Item r;
    r.split = item % splits;
    r.tile = item / splits / col_tiles;
    r.ct = item / splits % col_tiles;
    r.kt0 = r.split * KT / splits;
    r.kt1 = (r.split + 1) * KT / splits;
    return r;
  };
  // What an item covers: expert e's rows [row0, row_end), column tile ct of its shape (256 x 128
  // when tall, else BM x BN). rd reads the plan (plain, or through L2 before the wait).
  struct Work {
    int e, row0, row_end, ct;
    bool tall;
  };
  auto describe = [&](const Item& f, auto rd) {
    Work w;
    w.e = rd(tile_expert + f.tile);
    w.row0 = rd(tile_row + f.tile);
    w.ct = f.ct;
    w.tall = false;
    const int end = rd(offsets + w.e + 1);
    w.row_end = min(end, w.row0 + BM);
    if constexpr (kMixed) {
      const int first = rd(offsets + w.e);
      if (tall_expert(end - first)) {
        w.tall = true;
        w.ct = (w.row0 != first ? col_tiles : 0) + f.ct;  // the second tile's items follow the first's
        w.row0 = first;
        w.row_end = end;
      }
    }
    return w;
  };

  extern __shared__ unsigned char smem_raw[];
  // The swizzle pattern and the descriptors assume 1024-byte aligned tiles.
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t bars = base + S * R::kStageBytes;
  const uint32_t epilogue_buf = bars + 16u * S;  // 16-byte aligned: bars is 1024-aligned
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (S + s); };
  // The weight tile of k-step kt of an item into stage s (one thread).
  auto load_weights = [&](int s, const Work& w, int kt) {
    if constexpr (kMixed) {
      // Boxes of 64 rows: gate_up's gate rows of the tile, then the matching up rows.
      const int bn = w.tall ? 128 : 256, boxes = bn / 64;
      const uint32_t sb = base + s * R::kStageBytes + (w.tall ? 256 : 128) * BK * 2;
      mbar_arrive_expect_tx(full(s), bn * BK * 2);
      for (int bx = 0; bx < boxes; ++bx) {
        const int wr = kGateUp ? w.e * w_rows + bx / (boxes / 2) * inter + w.ct * (bn / 2) + bx % (boxes / 2) * 64
                               : w.e * w_rows + w.ct * bn + bx * 64;
        tma_load_2d(sb + bx * 64 * 128, &wmap, kt * SK, wr, full(s));
      }
    } else {
      using C = Cfg<BM, BN>;
      const uint32_t sb = base + s * C::kStageBytes + C::kABytes;
      mbar_arrive_expect_tx(full(s), C::kBBytes);
#pragma unroll
      for (int bx = 0; bx < 2 * C::kParts; ++bx) {
        int wr;
        if (kGateUp) {
          // Box 2q: gate rows of part q; box 2q + 1: the matching up rows.
          const int q = bx / 2, up = bx % 2;
          wr = w.e * w_rows + up * inter + w.ct * (BN / 2) + q * C::kBoxRows;
        } else {
          wr = w.e * w_rows + w.ct * BN + bx * C::kBoxRows;
        }
        tma_load_2d(sb + bx * C::kBoxRows * 128, &wmap, kt * SK, wr, full(s));
      }
    }
  };
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      mbar_init(full(s), R::kProducers + 1);  // each producer thread, plus the TMA thread's expect_tx
      mbar_init(empty(s), 8);       // each consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    fence_proxy_async();
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&wmap)) : "memory");
  }
  __syncthreads();
  auto plain = [](const int* p) { return *p; };
  int items = 0, prefetched = 0;  // prefetched: leading stages whose weights are already issued
  if constexpr (!kGateUp) {
    items = __ldcg(num_tiles) * col_tiles * splits;
    if (static_cast<int>(blockIdx.x) < items) {
      const Item f = item_at(blockIdx.x);
      prefetched = min(S, f.kt1 - f.kt0);
      if (threadIdx.x == 0) {
        const Work w = describe(f, [](const int* p) { return __ldcg(p); });
        for (int i = 0; i < prefetched; ++i) load_weights(i, w, f.kt0 + i);
      }
    }
  }
  wait_for_predecessor();
  allow_dependents();
  if constexpr (kGateUp) items = *num_tiles * col_tiles * splits;
  if (static_cast<int>(blockIdx.x) >= items) return;

  const int wg = threadIdx.x / 128;
  if (wg < R::kProducerWGs) {
    setmaxnreg_dec<R::kProducerRegs>();
    const int tid = threadIdx.x, chunk = tid % 8, rsub = tid / 8;
    constexpr int kPass = R::kProducers / 8;  // rows per pass: 8 chunks of 16 bytes a row
    int it = 0;  // stage counter over all items
    // The stages of one item of `rows` activation rows.
    auto produce = [&](auto rows, const Work& w, const Item& f) {
      constexpr int kARows = decltype(rows)::value / kPass;
      // Each row's source: a pointer, or with two producer warpgroups (producers of 40 registers)
      // its start in 16-byte chunks (32 bits: at most 2^19 slots x 2^10 chunks), which keeps the
      // producer within its registers. In bytes: a stage is 128 bytes of every row either way.
      constexpr bool kChunks = R::kProducerWGs > 1;
      const auto* a_bytes = static_cast<const unsigned char*>(a_src);
      const int row_bytes = K * (kFp8 ? 1 : 2);
      const unsigned char* a_ptr[kChunks ? 1 : kARows];
      uint32_t a_chunk[kChunks ? kARows : 1];
      uint32_t a_ok = 0;
#pragma unroll
      for (int i = 0; i < kARows; ++i) {
        const int p = w.row0 + rsub + kPass * i;
        const bool ok = p < w.row_end;  // rows past the expert's end keep an in-bounds address
        if (ok) a_ok |= 1u << i;
        const uint32_t row = kGateUp ? (ok ? order[p] / top_k : 0) : (ok ? p : w.row0);
        if constexpr (kChunks) a_chunk[i] = row * static_cast<uint32_t>(row_bytes / 16) + chunk;
        else a_ptr[i] = a_bytes + size_t{row} * row_bytes + chunk * 16;
      }
      for (int kt = f.kt0; kt < f.kt1; ++kt, ++it) {
        const int s = it % S;
        if (it >= S) mbar_wait(empty(s), ((it / S) & 1) ^ 1);
        const uint32_t sa = base + s * R::kStageBytes;
        if (tid == 0 && it >= prefetched) load_weights(s, w, kt);
#pragma unroll
        for (int i = 0; i < kARows; ++i) {
          const int r = rsub + kPass * i;
          const unsigned char* src;
          if constexpr (kChunks) src = a_bytes + size_t{a_chunk[i]} * 16 + kt * 128;
          else src = a_ptr[i] + kt * 128;
          // Rows past the expert's end are zero-filled rather than skipped: leaving them out
          // measured slower (qwen3-30b-a3b M = 2048: 670 -> 682 µs).
          cp_async16(sa + r * 128 + ((chunk ^ (r & 7)) << 4), src, (a_ok >> i) & 1u);
        }
        // The thread's arrival comes when its copies land, with no wait here: the producer
        // is held back only by the empty barriers, so every stage of the ring can be in flight.
        cp_async_arrive(full(s));
      }
    };
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      const Item f = item_at(item);
      const Work w = describe(f, plain);
      if constexpr (kMixed) {
        if (w.tall) produce(std::integral_constant<int, 256>{}, w, f);
        else produce(std::integral_constant<int, 128>{}, w, f);
      } else {
        produce(std::integral_constant<int, BM>{}, w, f);
      }
    }
    cp_async_wait_all();
  } else {
    setmaxnreg_inc<R::kConsumerRegs>();
    const int cw = wg - R::kProducerWGs;  // consumer 0 or 1
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    int it = 0;
    int done = 0;  // items consumed: the parity of the act-quantising exchange buffer
    // One item of tile shape `shape` (TileShape): the k loop, then the epilogue.
    auto consume = [&](auto shape, const Work& w, const Item& f) {
      using C = Cfg<decltype(shape)::kM, decltype(shape)::kN>;
      constexpr int TM = decltype(shape)::kM, TN = decltype(shape)::kN;
      const uint32_t a_off = TM == 64 ? 0 : cw * C::kConsumerRows * 128;
      const uint32_t b_off = TM == 64 ? cw * C::WN * 128 : 0;
      const int part = TM == 64 ? cw : 0;
      constexpr int U = C::kSubs;
      const int ct = w.ct, row_end = w.row_end;
      const int my_row0 = w.row0 + (TM == 64 ? 0 : cw * C::kConsumerRows);
      // Sub-tiles holding at least one of the expert's rows (the same for the whole warpgroup).
      const int subs = min(U, max(0, (row_end - my_row0 + 63) / 64));
      // Mixed tiles' 128 x 256 items: each consumer's 64 x 256 as two m64n128 halves (gate and up
      // for gate_up), as the 512-thread ring allows no instruction past 128 registers; FP8 items
      // of 128 x 256 likewise (their products in halves, below). Flat fragment index i of the
      // m64n256 layout is then acc[i / 64][i % 64].
      constexpr bool kSplitN = (kMixed || kFp8) && TN == 256 && C::WN == 256;
      static_assert(!kSplitN || U == 1, "split columns: one row sub-tile");
      // The epilogue's rows, and for down their slots and routing weights, fetched before the k
      // loop so that their latency hides under it.
      int prow[U][2], slot[U][2];
      float scale[U][2];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          prow[u][h] = my_row0 + 64 * u + 16 * warp + lane / 4 + 8 * h;
          slot[u][h] = 0;
          scale[u][h] = 0.f;
          if (!kGateUp && prow[u][h] < row_end) {
            slot[u][h] = order[prow[u][h]];
            scale[u][h] = weights[slot[u][h]];
          }
        }
      constexpr int kAccRows = kSplitN ? 2 : U, kAccCols = kSplitN ? 64 : C::WN / 2;
      float acc[kAccRows][kAccCols];
#pragma unroll
      for (int u = 0; u < kAccRows; ++u)
#pragma unroll
        for (int i = 0; i < kAccCols; ++i) acc[u][i] = 0.f;
      auto val = [&](int u, int i) -> float& {
        if constexpr (kSplitN) return acc[i / 64][i % 64];
        else return acc[u][i];
      };
      // The k loop for N active sub-tiles, one copy per N: a branch around the wgmmas inside one
      // loop makes ptxas serialise them (C7520), as it cannot tell the branch is uniform. Only
      // 256-row tiles skip: at BM = 128 a consumer idling on a tile's empty half measured slower
      // (qwen3-30b-a3b M = 2048: 668 -> 692 µs, H100), its rows' wgmmas there being free.
      auto k_loop = [&](auto active) {
        constexpr int N = decltype(active)::value;
        for (int kt = f.kt0; kt < f.kt1; ++kt, ++it) {
          const int s = it % S;
          mbar_wait(full(s), (it / S) & 1);
          // The gathered rows were written through the generic proxy (cp.async), and the
          // wgmmas read them through the async proxy: the fence orders the two for this thread.
          fence_proxy_async();
          if constexpr (N > 0) {
            const uint32_t sa = base + s * R::kStageBytes + a_off;
            const uint32_t sb = base + s * R::kStageBytes + C::kABytes + b_off;
            wgmma_fence();
            if constexpr (kSplitN) {
#pragma unroll
              for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk)
                  wgmma_tile<128>(acc[n], sw128_desc(sa + kk * 32), sw128_desc(sb + n * 128 * 128 + kk * 32));
            } else {
#pragma unroll
              for (int u = 0; u < N; ++u)
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk)
                  wgmma_tile<C::WN>(acc[u], sw128_desc(sa + u * 64 * 128 + kk * 32), sw128_desc(sb + kk * 32));
            }
            wgmma_commit();
            // The previous step is done with its stage once at most this step's group is pending.
            wgmma_wait<1>();
#pragma unroll
            for (int u = 0; u < kAccRows; ++u) fence_regs(acc[u]);
          }
          if (kt > f.kt0) {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty((it - 1) % S));
          }
        }
        if constexpr (N > 0) {
          wgmma_wait<0>();
#pragma unroll
          for (int u = 0; u < kAccRows; ++u) fence_regs(acc[u]);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty((it - 1) % S));  // the item's last stage, before the stores
      };
      // FP8 (W8A8): a stage's 128 k go into `prod` (its first k32 step overwriting it), which is
      // then added into acc times the stage's scales: the activation row's (per row and 128
      // columns, quantize_rows_fp8) times the weight block's (gate_up's gate and up columns have
      // one each). A consumer must see its own stage's products before scaling them, so it waits
      // for them every stage; the other consumer's wgmmas keep the tensor cores busy meanwhile.
      // The next stage's scales are loaded while this one's products run.
      if constexpr (kFp8) {
        int arow[2];  // the scale rows of this thread's two accumulator rows (-1: past the expert)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int p = prow[0][h];
          arow[h] = p >= row_end ? -1 : kGateUp ? order[p] / top_k : p;
        }
        const float* ws = w_scales + static_cast<size_t>(w.e) * ((w_rows + 127) / 128) * KT;
        const int first = kGateUp ? ct * (TN / 2) + part * C::kBoxRows : ct * TN + part * C::WN;
        const float* w_first = ws + first / 128 * KT;
        // gate_up: the up rows' block; down with 256 weight rows a consumer: the second 128.
        const float* w_second = kGateUp                            ? ws + (inter + first) / 128 * KT
                                : kSplitN && first + 128 < w_rows ? ws + (first + 128) / 128 * KT
                                                                  : w_first;
        // A stage's scales as loaded: multiplied only where used, a stage later, so that the
        // loads' L2 latency hides under the stage before (a product at load time would wait for
        // them at once).
        struct StageScales {
          float w_first, w_second, a[2];
        };
        auto load_scales = [&](int kt, StageScales& sc) {
          sc.w_first = __ldg(w_first + kt);
          // Otherwise down's columns of a consumer, 128 from a multiple of 128, lie in one weight
          // block: one load, and one register fewer.
          sc.w_second = kGateUp || kSplitN ? __ldg(w_second + kt) : sc.w_first;
#pragma unroll
          for (int h = 0; h < 2; ++h)
            sc.a[h] = arow[h] < 0 ? 0.f : __ldg(a_scales + static_cast<size_t>(arow[h]) * KT + kt);
        };
        // 256 weight rows a consumer (kSplitN) go as two halves of 128 through one product buffer:
        // 128 sums and 64 products a thread where 256 products would not fit its registers. Half
        // 0 (gate_up's gate rows, down's first 128) takes the first scale, half 1 the second.
        constexpr int kHalves = kSplitN ? 2 : 1, kProdN = C::WN / kHalves;
        float prod[kProdN / 2];
        auto stage = [&](int kt, const StageScales& use, StageScales& fill) {
          const int s = it % S;
          if (kt + 1 < f.kt1) load_scales(kt + 1, fill);
          mbar_wait(full(s), (it / S) & 1);
          fence_proxy_async();  // as in k_loop
          const uint32_t sa = base + s * R::kStageBytes + a_off;
          const uint32_t sb = base + s * R::kStageBytes + C::kABytes + b_off;
#pragma unroll
          for (int n = 0; n < kHalves; ++n) {
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
              wgmma_tile_e4m3<kProdN>(prod, sw128_desc(sa + kk * 32), sw128_desc(sb + n * kProdN * 128 + kk * 32), kk);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(prod);
            if (n == kHalves - 1) {
              __syncwarp();
              if (lane == 0) mbar_arrive(empty(s));
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float first = use.a[h] * use.w_first, second = use.a[h] * use.w_second;
#pragma unroll
              for (int j = 0; j < kProdN / 8; ++j) {
                const float sc = kSplitN ? (n == 0 ? first : second) : j < C::WN / 16 ? first : second;
                acc[kSplitN ? n : 0][4 * j + 2 * h] += prod[4 * j + 2 * h] * sc;
                acc[kSplitN ? n : 0][4 * j + 2 * h + 1] += prod[4 * j + 2 * h + 1] * sc;
              }
            }
          }
          ++it;
        };
        StageScales even{}, odd{};  // the scales of even and odd k-steps, loaded a step ahead
        if (f.kt0 < f.kt1) load_scales(f.kt0, even);
        for (int kt = f.kt0; kt < f.kt1; kt += 2) {
          stage(kt, even, odd);
          if (kt + 1 < f.kt1) stage(kt + 1, odd, even);
        }
      } else if (U == 1 || subs == U) k_loop(std::integral_constant<int, U>{});
      else if (U == 2 && subs == 1) k_loop(std::integral_constant<int, 1>{});
      else k_loop(std::integral_constant<int, 0>{});

      // Fragment (m64nN, f32): register 4j + 2h + c holds row 16 * warp + lane / 4 + 8h, column
      // 8j + 2 * (lane % 4) + c.
      if constexpr (kGateUp && kQuantisesAct<BM, BN, kMixed, kFp8>) {
        quantise_act(acc[0], prow[0], w.row_end, ct, cw, warp, lane, inter, static_cast<uint8_t*>(out),
                     out_scales, done++);
      } else if constexpr (kGateUp && kQuantisesActWhole<BM, BN, kMixed, kFp8>) {
        quantise_act_whole(acc[0], acc[1], prow[0], w.row_end, ct, lane, inter, static_cast<uint8_t*>(out),
                           out_scales);
      } else if (!kGateUp && splits == 1 && TM >= 128) {
        // down's bf16 partial sums: 64 columns at a time through the warp's buffer, whole lines.
        // hidden is a multiple of 64 (BK, checked at launch): a chunk is in or out whole.
        const uint32_t buf = epilogue_buf + (cw * 4 + warp) * 2048;
        auto* part_rows = static_cast<__nv_bfloat16*>(out);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          // The rows this lane stores, 4i + lane / 8 of the warp's 16: their slots from the lanes
          // that fetched them (row r is row half r / 8 of quad r % 8).
          int row_slot[4];
          bool row_ok[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = 4 * i + lane / 8;
            const int s0 = __shfl_sync(0xffffffffu, slot[u][0], (r % 8) * 4);
            const int s1 = __shfl_sync(0xffffffffu, slot[u][1], (r % 8) * 4);
            row_slot[i] = i < 2 ? s0 : s1;
            row_ok[i] = my_row0 + 64 * u + 16 * warp + r < row_end;
          }
#pragma unroll
          for (int c = 0; c < C::WN / 64; ++c) {
            const int col0 = ct * TN + part * C::WN + 64 * c;
            if (col0 >= hidden) break;
            uint32_t pairs[8][2];
#pragma unroll
            for (int jj = 0; jj < 8; ++jj)
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int j = 8 * c + jj;
                const __nv_bfloat162 b = __floats2bfloat162_rn(scale[u][h] * val(u, 4 * j + 2 * h),
                                                               scale[u][h] * val(u, 4 * j + 2 * h + 1));
                pairs[jj][h] = *reinterpret_cast<const uint32_t*>(&b);
              }
            store_rows_staged(buf, pairs, row_slot, row_ok, part_rows, hidden, col0, lane);
          }
        }
      } else {
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int p = prow[u][h];
          if (p >= row_end) continue;
          if (kGateUp) {
            // Columns [0, WN/2) of this consumer are gate rows, [WN/2, WN) the matching up rows.
            auto* act = static_cast<__nv_bfloat16*>(out);
#pragma unroll
            for (int j = 0; j < C::WN / 16; ++j) {
              const int col = ct * (TN / 2) + part * C::kBoxRows + 8 * j + 2 * (lane % 4);
              if (col >= inter) continue;
              const float g0 = val(u, 4 * j + 2 * h), g1 = val(u, 4 * j + 2 * h + 1);
              const float u0 = val(u, 4 * (j + C::WN / 16) + 2 * h);
              const float u1 = val(u, 4 * (j + C::WN / 16) + 2 * h + 1);
              *reinterpret_cast<__nv_bfloat162*>(act + (size_t)p * inter + col) =
                  __floats2bfloat162_rn(silu(g0) * u0, silu(g1) * u1);
            }
          } else if (splits == 1) {
            // hidden is a multiple of BK (checked at launch): a group of 32 columns is in or out whole.
            auto* row = static_cast<__nv_bfloat16*>(out) + (size_t)slot[u][h] * hidden;
#pragma unroll
            for (int g = 0; g < C::WN / 32; ++g) {
              const int col = ct * TN + part * C::WN + 32 * g;
              if (col >= hidden) continue;
              uint32_t v[4];
#pragma unroll
              for (int t = 0; t < 4; ++t) {
                const int j = 4 * g + t;
                const __nv_bfloat162 b = __floats2bfloat162_rn(scale[u][h] * val(u, 4 * j + 2 * h),
                                                               scale[u][h] * val(u, 4 * j + 2 * h + 1));
                v[t] = *reinterpret_cast<const uint32_t*>(&b);
              }
              store_row_pairs(row + col, v, lane);
            }
          } else {
            float* sums = static_cast<float*>(out) + ((size_t)f.split * split_stride + slot[u][h]) * hidden;
#pragma unroll
            for (int j = 0; j < C::WN / 8; ++j) {
              const int col = ct * TN + part * C::WN + 8 * j + 2 * (lane % 4);
              if (col >= hidden) continue;
              *reinterpret_cast<float2*>(sums + col) =
                  make_float2(scale[u][h] * val(u, 4 * j + 2 * h), scale[u][h] * val(u, 4 * j + 2 * h + 1));
            }
          }
        }
      }
    };
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      const Item f = item_at(item);
      const Work w = describe(f, plain);
      if constexpr (kMixed) {
        if (w.tall) consume(TileShape<256, 128>{}, w, f);
        else consume(TileShape<128, 256>{}, w, f);
      } else {
        consume(TileShape<BM, BN>{}, w, f);
      }
    }
  }
#else
  __trap();  // wgmma, TMA and setmaxnreg exist only in the sm_90a machine code of this build
#endif
}

// FP8 (kFp8): x is b.x_fp8 with b.x_scales, already quantised (launch_prefill_wgmma); act is
// quantised into b.act_fp8 and b.act_scales (its routed rows only) by gate_up's epilogue
// (kQuantisesAct) or else between the two GEMMs.
template <int BM, int BN, bool kMixed = false, bool kFp8 = false>
cudaError_t run_gemms(const ExpertBuffers& b, const void* x, const float* weights, int max_tiles,
                      int splits, long long split_stride, int tokens, int sms, cudaStream_t stream) {
  using R = RingOf<BM, BN, kMixed, kFp8>;
  CUtensorMap gate_up_map, down_map;
  cudaError_t err =
      kmajor_tile_map(&gate_up_map, b.gate_up, uint64_t(b.experts) * 2 * b.inter, b.hidden, R::kBoxRows, kFp8);
  if (err == cudaSuccess)
    err = kmajor_tile_map(&down_map, b.down, uint64_t(b.experts) * b.hidden, b.inter, R::kBoxRows, kFp8);
  if (err != cudaSuccess) return err;
  auto* gate_up = wgmma_gemm_kernel<BM, BN, true, kMixed, kFp8>;
  auto* down = wgmma_gemm_kernel<BM, BN, false, kMixed, kFp8>;
  // Per device, not a stream operation: harmless inside a graph capture.
  err = cudaFuncSetAttribute(gate_up, cudaFuncAttributeMaxDynamicSharedMemorySize, R::kSmem);
  if (err == cudaSuccess) err = cudaFuncSetAttribute(down, cudaFuncAttributeMaxDynamicSharedMemorySize, R::kSmem);
  if (err != cudaSuccess) return err;
  // One block per multiprocessor (one fits: ~200 KB of shared memory), or fewer where the worst
  // case has fewer items.
  auto* act = static_cast<__nv_bfloat16*>(b.act);
  const int gu_cols = (b.inter + BN / 2 - 1) / (BN / 2), down_cols = (b.hidden + BN - 1) / BN;
  const int gu_items = max_tiles * gu_cols, down_items = max_tiles * down_cols * splits;
  const void* a_up = kFp8 ? b.x_fp8 : x;
  const float* a_up_scales = kFp8 ? b.x_scales : nullptr;
  constexpr bool kActInEpilogue = kQuantisesAct<BM, BN, kMixed, kFp8> || kQuantisesActWhole<BM, BN, kMixed, kFp8>;
  err = launch_dependent(gate_up, dim3(gu_items < sms ? gu_items : sms), dim3(R::kThreads), R::kSmem, stream,
                         gate_up_map, a_up, a_up_scales, b.gate_up_scales, b.order, b.offsets,
                         b.tile_expert, b.tile_row, b.num_tiles, weights, b.hidden, b.inter, b.top_k,
                         gu_cols, 1, 0LL, kActInEpilogue ? b.act_fp8 : static_cast<void*>(act), b.act_scales);
  if (err != cudaSuccess) return err;
  const void* a_down = act;
  if constexpr (kActInEpilogue) {
    a_down = b.act_fp8;
  } else if constexpr (kFp8) {
    // It waits for gate_up to complete before reading act, and down waits for it in turn.
    err = quantize_rows_fp8(act, tokens * b.top_k, b.offsets + b.experts, b.inter, b.act_fp8, b.act_scales, stream);
    if (err != cudaSuccess) return err;
    a_down = b.act_fp8;
  }
  return launch_dependent(down, dim3(down_items < sms ? down_items : sms), dim3(R::kThreads), R::kSmem,
                          stream, down_map, a_down, kFp8 ? b.act_scales : nullptr, b.down_scales, b.order,
                          b.offsets, b.tile_expert, b.tile_row, b.num_tiles, weights, b.hidden, b.inter, b.top_k,
                          down_cols, splits, split_stride, b.part, nullptr);
}

}  // namespace

namespace wgmma_detail {

cudaError_t run_tile(const ExpertBuffers& b, const void* x, const float* weights, int tile_m,
                     const LaunchShape& shape, cudaStream_t stream) {
  const bool narrow = shape.narrow;
  const int max_tiles = shape.max_tiles, sms = shape.sms, splits = shape.sums.splits, tokens = shape.tokens;
  const long long stride = shape.sums.split_stride;
  if (b.gate_up_scales != nullptr) {
    // FP8 keeps a stage's products beside the sums. 64-row tiles split 256 weight rows over both
    // consumers (64 sums and 64 products a thread); 128-row tiles take 256 weight rows a consumer
    // as two halves through one product buffer (128 sums and 64 products), or 128 where the grid
    // is narrow, as bf16 does. 256 against 128 weight rows (H100, moe-bench layer --dtype fp8,
    // µs, docs/perf/fp8-wide-tiles.md): qwen3-30b-a3b M = 1024 297 -> 280, 2048 395 -> 353, 8192
    // 1126-1150 -> 959-963; deepseek-v3 8192 9496 -> 8518. A stage moves 48 KB for twice the
    // products of 32 KB, where L2's bytes bound the GEMM.
    if (tile_m == 64)
      return narrow ? run_gemms<64, 128, false, true>(b, x, weights, max_tiles, splits, stride, tokens, sms, stream)
                    : run_gemms<64, 256, false, true>(b, x, weights, max_tiles, splits, stride, tokens, sms, stream);
    if (tile_m == 128)
      return narrow ? run_gemms<128, 128, false, true>(b, x, weights, max_tiles, splits, stride, tokens, sms, stream)
                    : run_gemms<128, 256, false, true>(b, x, weights, max_tiles, splits, stride, tokens, sms, stream);
    return cudaErrorInvalidValue;
  }
  if (tile_m == 64)
    return narrow ? run_gemms<64, 128>(b, x, weights, max_tiles, splits, stride, tokens, sms, stream)
                  : run_gemms<64, 256>(b, x, weights, max_tiles, splits, stride, tokens, sms, stream);
  if (tile_m == 256)  // 128-row weight tiles whether narrow or not
    return run_gemms<256, 128>(b, x, weights, max_tiles, splits, stride, tokens, sms, stream);
  if (tile_m == heuristics::kWgmmaMixedTiles)  // not narrow (launch_prefill_wgmma)
    return run_gemms<128, 256, true>(b, x, weights, max_tiles, splits, stride, tokens, sms, stream);
  return narrow ? run_gemms<128, 128>(b, x, weights, max_tiles, splits, stride, tokens, sms, stream)
                : run_gemms<128, 256>(b, x, weights, max_tiles, splits, stride, tokens, sms, stream);
}

}  // namespace wgmma_detail

}  // namespace moe::cuda::kernels
