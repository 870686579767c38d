// The epilogue pieces of the grouped wgmma GEMM (moe_wgmma_gemm.cu) that act on one consumer's
// accumulator fragment: the SiLU, down's partial-sum stores, and FP8 act quantised where
// gate_up writes it. Device code only, for that file.
//
// Fragment (m64nN, f32): register 4j + 2h + c holds row 16 * warp + lane / 4 + 8h, column
// 8j + 2 * (lane % 4) + c.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "backend/cuda/ops/fp8_act_quant.cuh"

namespace moe::cuda::kernels::wgmma_epilogue {

// The fast division (a reciprocal and a multiply, 2 ulp): the product is rounded to bf16 next,
// and an IEEE division costs the epilogue, which runs while the tensor cores idle, a check and
// a slow-path branch per column. Where exp(-g) passes 2^126 (g < -87) it gives 0, as silu does
// to within bf16's range.
__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.f + __expf(-g)); }

// down's partial sums, stored 8 bytes at a time. In a wgmma fragment lane q of a quad (q = lane %
// 4) holds the column pair 8j + 2q of its row for every j, so a 4-byte store per pair has a warp
// instruction touch 8 rows x 16 bytes, half of 8 sectors. Given v[t] = the packed bf16 pairs of
// j = 4g + t, one shuffle round within the quad (bit 0 of q against bit 0 of t) leaves lane q the
// pairs of j = 4g + t + (q & 1), t = 0 and 2, from quad lanes (q & 2) and (q & 2) + 1: 4
// contiguous columns, so two 8-byte stores fill whole sectors, 8 rows x 32 bytes a warp
// instruction, with half the store instructions. The values are the same, bit for bit. Measured
// (H100, moe-bench layer, µs): qwen3-30b-a3b M = 8192 1469-1474 -> 1331-1376, deepseek-v2-lite
// 1735-1794 -> 1592-1731 and M = 2048 638-640 -> 626-632; M <= 512 within 2 µs. 16-byte stores
// (a second round) gained less at M = 8192 and cost 5 µs at M = 2048; the same for gate_up's act
// gained nothing and cost 1-3 µs at M <= 128. The four lanes of a quad hold one row, so the quad
// (not the warp) calls it together.
__device__ __forceinline__ void store_row_pairs(__nv_bfloat16* at, uint32_t (&v)[4], int lane) {
  const unsigned quad = 0xfu << (lane & 28);
  const int q = lane % 4;
  const bool q1 = q & 1;
#pragma unroll
  for (int i = 0; i < 4; i += 2) {
    const uint32_t r = __shfl_xor_sync(quad, q1 ? v[i] : v[i + 1], 1);
    if (q1) v[i] = r;
    else v[i + 1] = r;
  }
#pragma unroll
  for (int i = 0; i < 4; i += 2) *reinterpret_cast<uint2*>(at + 8 * (i + q1) + 2 * (q & 2)) = make_uint2(v[i], v[i + 1]);
}

// down's partial sums of one consumer warp's 16 rows x 64 columns, through the warp's own 2 KB of
// shared memory: stmatrix writes the fragment's bf16 pairs as rows, then each lane reads back 16
// contiguous bytes of one row, so that a warp's 16-byte stores cover 4 rows x 128 bytes, whole
// lines, where store_row_pairs' touch 8 rows x 32 bytes. For tiles of 128 and 256 rows; 64-row
// tiles keep store_row_pairs, which measured 1% faster in a batch-8 decode step
// (docs/perf/down-stores-whole-lines.md).
//  - pairs[jj][h]: this lane's packed pair of column group jj (8 columns) in its row h (fragment
//    rows lane / 4 and lane / 4 + 8);
//  - slot[i], ok[i]: the output row of row 4i + lane / 8 of the warp's 16, and whether it is one
//    of the expert's (rows past its end are not stored).
// The 16-byte chunk c of row r sits at chunk c ^ (r % 8), so that neither the stmatrix rows nor
// the read-back conflict on banks. The whole warp calls it.
__device__ __forceinline__ void store_rows_staged(uint32_t stage, const uint32_t (&pairs)[8][2], const int (&slot)[4],
                                                  const bool (&ok)[4], __nv_bfloat16* part, int hidden, int col0,
                                                  int lane) {
  // x4: matrix m is (row half m % 2, column group jj + m / 2); lane t gives row t % 8 of matrix t / 8.
  const int m = lane / 8, r = (m % 2) * 8 + lane % 8;
#pragma unroll
  for (int jj = 0; jj < 8; jj += 2) {
    const uint32_t at = stage + r * 128 + (((jj + m / 2) ^ (r % 8)) << 4);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(pairs[jj][0]),
                 "r"(pairs[jj][1]), "r"(pairs[jj + 1][0]), "r"(pairs[jj + 1][1])
                 : "memory");
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = 4 * i + lane / 8, c = lane % 8;
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(stage + row * 128 + ((c ^ (row % 8)) << 4))
                 : "memory");
    if (ok[i]) *reinterpret_cast<uint4*>(part + static_cast<size_t>(slot[i]) * hidden + col0 + c * 8) = v;
  }
  __syncwarp();  // the buffer is written again by the next call
}

// The E4M3 codes of 16 act values of one row held by this lane (v[2j + c]: column 8j + 2q + c of
// a 64-column group), gathered so that lane q holds columns 32g + 8q .. + 7 in out8[g]: the pairs
// of j = 4g + q from all four lanes of the quad, so that a warp's 8-byte stores cover whole
// 32-byte sectors. Round t brings lane q the pair of lane (q + t) % 4, which sends the one of
// j = 4g + (its q - t) % 4. The quad calls it together.
__device__ __forceinline__ void act_codes(const float (&v)[16], float inverse, int lane, uint2 (&out8)[2]) {
  const int q = lane % 4;
  uint32_t pair[8];  // the codes of columns 8j + 2q and 8j + 2q + 1
#pragma unroll
  for (int j = 0; j < 8; ++j) pair[j] = fp8_act_codes2(v[2 * j], v[2 * j + 1], inverse);
#pragma unroll
  for (int g = 0; g < 2; ++g) {
    uint64_t bytes = 0;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int want = (q - t) & 3;
      uint32_t send = pair[4 * g];
#pragma unroll
      for (int k = 1; k < 4; ++k) send = want == k ? pair[4 * g + k] : send;
      const uint32_t got = __shfl_sync(0xffffffffu, send, (lane & ~3) | ((q + t) & 3));
      bytes |= static_cast<uint64_t>(got) << (16 * ((q + t) & 3));
    }
    out8[g] = make_uint2(static_cast<uint32_t>(bytes), static_cast<uint32_t>(bytes >> 32));
  }
}

// gate_up's epilogue for FP8 items of 64 x 256 (moe_wgmma_gemm.cu, kQuantisesAct): `a` is one
// consumer's m64n128 fragment, gate columns in registers 4j + 2h + c for j < 8 and the matching up
// columns at j + 8. Consumer cw (0 or 1) holds act columns ct * 128 + cw * 64 .. + 63 of its
// rows, the other consumer the rest of the same 128-column scale block; `rows` are its two rows'
// plan positions (past row_end: not stored). Values, scales and codes are those of
// quantize_rows_fp8 on the bf16 act: each value rounded to bf16, then fp8_act_scale,
// fp8_act_inverse and fp8_act_codes2 (ops/fp8_act_quant.cuh), as that kernel uses them. Both
// consumers' 256 threads call it once an item, `parity` counting their items: a template, so
// that only kernels that call it hold its shared memory.
template <int kUnused = 0>
__device__ __forceinline__ void quantise_act(const float (&a)[64], const int (&rows)[2], int row_end, int ct, int cw,
                                             int warp, int lane, int inter, uint8_t* __restrict__ codes,
                                             float* __restrict__ scales, int parity) {
  // [parity][consumer][row of the item], double-buffered, so that one barrier an item orders the
  // writes and the reads.
  __shared__ float s_max[2][2][64];
  float v[2][16], m[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    m[h] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float g = a[4 * j + 2 * h + c], up = a[4 * (j + 8) + 2 * h + c];
        v[h][2 * j + c] = __bfloat162float(__float2bfloat16_rn(silu(g) * up));
        m[h] = fmaxf(m[h], fabsf(v[h][2 * j + c]));
      }
    // The four lanes of the quad hold the row.
    m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffffu, m[h], 1));
    m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffffu, m[h], 2));
    if (lane % 4 == 0) s_max[parity & 1][cw][16 * warp + lane / 4 + 8 * h] = m[h];
  }
  asm volatile("bar.sync 1, 256;\n" ::: "memory");  // the two consumers' eight warps
  const int q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * warp + lane / 4 + 8 * h;
    const float amax = fmaxf(s_max[parity & 1][0][r], s_max[parity & 1][1][r]);
    const float scale = fp8_act_scale(amax), inverse = fp8_act_inverse(scale);
    uint2 out8[2];
    act_codes(v[h], inverse, lane, out8);
    const int p = rows[h];
    if (p >= row_end) continue;
    uint8_t* row = codes + static_cast<size_t>(p) * inter + ct * 128 + cw * 64;
#pragma unroll
    for (int g = 0; g < 2; ++g) *reinterpret_cast<uint2*>(row + 32 * g + 8 * q) = out8[g];
    if (cw == 0 && q == 0) scales[static_cast<size_t>(p) * (inter / 128) + ct] = scale;
  }
}

// gate_up's epilogue for FP8 items of 128 x 256 (kQuantisesActWhole): a consumer holds its 64
// rows x 256 weight rows as two m64n128 halves, the gate rows' products `g` and the up rows' `u`,
// register 4j + 2h + c of each for act column ct * 128 + 8j + 2q + c (j < 16): a whole scale
// block of each of its rows, quantised with no exchange. rows, row_end, lane as in quantise_act;
// the same values, scales and codes.
__device__ __forceinline__ void quantise_act_whole(const float (&g)[64], const float (&u)[64], const int (&rows)[2],
                                                   int row_end, int ct, int lane, int inter,
                                                   uint8_t* __restrict__ codes, float* __restrict__ scales) {
  const int q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float v[2][16], m = 0.f;  // v[0]: columns 0-63 of the block, v[1]: 64-127
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float x = __bfloat162float(__float2bfloat16_rn(silu(g[4 * j + 2 * h + c]) * u[4 * j + 2 * h + c]));
        v[j / 8][2 * (j % 8) + c] = x;
        m = fmaxf(m, fabsf(x));
      }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const float scale = fp8_act_scale(m), inverse = fp8_act_inverse(scale);
    uint2 out8[2][2];
#pragma unroll
    for (int k = 0; k < 2; ++k) act_codes(v[k], inverse, lane, out8[k]);
    const int p = rows[h];
    if (p >= row_end) continue;
    uint8_t* row = codes + static_cast<size_t>(p) * inter + ct * 128;
#pragma unroll
    for (int k = 0; k < 2; ++k)
#pragma unroll
      for (int i = 0; i < 2; ++i) *reinterpret_cast<uint2*>(row + 64 * k + 32 * i + 8 * q) = out8[k][i];
    if (q == 0) scales[static_cast<size_t>(p) * (inter / 128) + ct] = scale;
  }
}

}  // namespace moe::cuda::kernels::wgmma_epilogue
