// The warp-level tensor-core primitives of the attention kernels (attention_tiled.cu,
// attention_decode.cu, latent_attention.cu): cp.async copies of 16 bytes into shared memory,
// ldmatrix loads of bf16 fragments, the mma.sync m16n8k16 bf16 -> f32 product and the packing of
// f32 accumulators back into bf16 operands. One copy so that the fragment layouts these kernels
// rely on (see accumulators_to_a_fragment) are written down once. Device code, CUDA headers only.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace moe::cuda::kernels {

// 16 bytes global -> shared, bypassing L1; ok == false writes zeros and reads nothing. The
// "memory" clobbers keep the compiler from moving shared-memory accesses across the copy, its
// commit and its wait.
__device__ __forceinline__ void cp_async16(void* smem, const void* src, bool ok) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(src), "r"(ok ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 bf16 matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// The same, each matrix transposed: B fragments of a row-major [k][n] tile (V in P V).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// c[16x8] += a[16x16] b[16x8], bf16 operands, f32 accumulators. In c, lane l holds row l / 4
// (c[0], c[1]) and row l / 4 + 8 (c[2], c[3]), at columns 2 * (l % 4) and 2 * (l % 4) + 1.
__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c[16x8] += a[16x32] b[32x8], E4M3 operands, f32 accumulators; the fragments hold the same bytes
// as mma_bf16's (four k values a register instead of two).
__device__ __forceinline__ void mma_e4m3(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to bf16, `lo` in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// The accumulators of two adjacent n8 tiles (columns 0-7 in c0, 8-15 in c1) are, rounded to bf16,
// exactly the A fragment of an m16k16 product: attention's softmax weights P go from S = Q K^T
// into O += P V without leaving registers.
__device__ __forceinline__ void accumulators_to_a_fragment(const float* c0, const float* c1, uint32_t* a) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

}  // namespace moe::cuda::kernels
