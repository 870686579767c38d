// The online softmax of the tensor-core attention kernels: the paged tiled, decode and wgmma
// kernels (attention_tiled.cu, attention_decode.cu, attention_wgmma.cu) and the latent kernel
// (latent_attention.cu). All four hold a score tile S = Q K^T in m16n8k16-layout accumulators
// (wgmma's m64 accumulators are that layout per warp) and walk the keys tile by tile, so they share
// one copy of the step that folds a tile into the running softmax: the -inf handling and the
// rescaling are written once, and a fix to them reaches every kernel.
//
// What it computes, per query row, over the key tiles seen so far (FlashAttention-2):
//   m = max of the scores,  l = sum of exp2(score - m),  O = sum of exp2(score - m) * V.
// Scores are in the log2 domain (the caller multiplies Q K^T by scale * kLog2e), so every
// exponential is a bare exp2. When a tile raises m, the l and O accumulated so far are multiplied
// by alpha = exp2(m_old - m_new). After the last tile the caller divides O by l, or hands (m, l, O)
// to a merge of context splits. A row whose scores are all -inf so far (masked, or padding) keeps
// m = -inf and gets zero weights: its exponentials are taken against 0 instead of -inf, which would
// give NaN.
//
// A thread holds two rows of the tile in the accumulator layout (mma_sync.cuh): row a = lane / 4
// and row b = lane / 4 + 8, two columns of each n8 tile; the four threads of a quad share a row.
// The max is reduced over the quad at every tile; l is kept per thread (each its share of the
// row) and summed over the quad once, after the last tile.
//
// A kernel's step over one tile of NT n8 score tiles, with ND n8 tiles of output:
//   const TileMax t = raise_running_max(s, m_a, m_b, mask);
//   m_a = t.m_a;  m_b = t.m_b;
//   const RowPair sum = tile_weights_and_sums(s, t);  // s now holds the weights P
//   l_a = l_a * t.alpha_a + sum.a;  l_b = l_b * t.alpha_b + sum.b;
//   rescale_rows(o, t);  // then O += P V
// The state (m_a, m_b, l_a, l_b) is four floats of the kernel, and these functions take and return
// values: with the state in a struct, or passed by reference, nvcc generated different code for
// the kernels (the decode kernel's register count changed). For the same reason the decode and
// latent kernels sum their l over the quad themselves (five lines); the two prefill kernels do it
// in store_row_pair (attention_device.cuh).
// Device code, and where the host puts the partials of split rows; CUDA headers only.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

namespace moe::cuda::kernels {

constexpr float kLog2e = 1.4426950408889634f;

// One value for each of a thread's two rows.
struct RowPair {
  float a, b;
};

// What a tile did to the running max of a thread's two rows.
struct TileMax {
  float m_a, m_b;          // the new running max, -inf while the row has seen no key
  float use_a, use_b;      // what the tile's weights are taken against: the max, or 0 while -inf
  float alpha_a, alpha_b;  // exp2(m_old - m_new): multiplies the l and O accumulated so far
};

// Each thread of a quad (the four threads that share a row pair) gets the quad's max of a and b.
__device__ __forceinline__ void quad_max(float& a, float& b) {
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, off));
    b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, off));
  }
}

// The scores of a tile are S = Q K^T scaled into the log2 domain, at -inf where a row may not see
// the key. A kernel that has them ready passes AlreadyMasked; one that holds the raw products
// passes a functor mask(nt, s[nt]) that scales and masks n8 tile nt in place, within the same pass
// over the tile that takes the max.
struct AlreadyMasked {
  __device__ __forceinline__ void operator()(int, float (&)[4]) const {}
};

// Takes a tile of NT n8 score tiles into the running max (m_a, m_b: the max before the tile).
template <int NT, class Mask>
__device__ __forceinline__ TileMax raise_running_max(float (&s)[NT][4], float m_a, float m_b, const Mask& mask) {
  float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    mask(nt, s[nt]);
    mx_a = fmaxf(mx_a, fmaxf(s[nt][0], s[nt][1]));
    mx_b = fmaxf(mx_b, fmaxf(s[nt][2], s[nt][3]));
  }
  quad_max(mx_a, mx_b);
  TileMax t;
  t.m_a = fmaxf(m_a, mx_a);
  t.m_b = fmaxf(m_b, mx_b);
  // A row with no visible key yet keeps -inf; subtracting 0 then gives exp2(-inf) = 0.
  t.use_a = t.m_a == -INFINITY ? 0.f : t.m_a;
  t.use_b = t.m_b == -INFINITY ? 0.f : t.m_b;
  t.alpha_a = exp2f(m_a - t.use_a);
  t.alpha_b = exp2f(m_b - t.use_b);
  return t;
}

// One n8 tile's scores (two columns of row a, then two of row b) become their weights.
__device__ __forceinline__ void n8_weights(float (&c)[4], const TileMax& t) {
  c[0] = exp2f(c[0] - t.use_a);
  c[1] = exp2f(c[1] - t.use_a);
  c[2] = exp2f(c[2] - t.use_b);
  c[3] = exp2f(c[3] - t.use_b);
}

// The tile's scores become their weights exp2(s - m_new): the P of O += P V, ready for
// accumulators_to_a_fragment.
template <int NT>
__device__ __forceinline__ void tile_weights(float (&s)[NT][4], const TileMax& t) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) n8_weights(s[nt], t);
}

// tile_weights, and this thread's share of each row's sum of the weights, added n8 tile by n8
// tile. One loop for both: the same arithmetic as tile_weights followed by the sums, but ptxas
// schedules the two forms differently, and this one is the form the tiled and latent kernels
// were timed with.
template <int NT>
__device__ __forceinline__ RowPair tile_weights_and_sums(float (&s)[NT][4], const TileMax& t) {
  float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    n8_weights(s[nt], t);
    sum_a += s[nt][0] + s[nt][1];
    sum_b += s[nt][2] + s[nt][3];
  }
  return {sum_a, sum_b};
}

// O *= alpha, for ND n8 tiles of output accumulators.
template <int ND>
__device__ __forceinline__ void rescale_rows(float (&o)[ND][4], const TileMax& t) {
#pragma unroll
  for (int nd = 0; nd < ND; ++nd) {
    o[nd][0] *= t.alpha_a;
    o[nd][1] *= t.alpha_a;
    o[nd][2] *= t.alpha_b;
    o[nd][3] *= t.alpha_b;
  }
}

// One key tile's step of the tiled and latent kernels for a warp's two rows: the tile's scores
// (masked by `mask`) raise the running maxima m_a, m_b; they become their weights (s then holds
// the P of O += P V), whose row sums join the running sums l_a, l_b; and the output accumulators
// are rescaled to the new maxima.
template <int NT, int ND, class Mask>
__device__ __forceinline__ void online_softmax_tile(float (&s)[NT][4], float (&o)[ND][4], float& m_a, float& m_b,
                                                    float& l_a, float& l_b, const Mask& mask) {
  const TileMax t = raise_running_max(s, m_a, m_b, mask);
  m_a = t.m_a;
  m_b = t.m_b;
  const RowPair sum = tile_weights_and_sums(s, t);
  l_a = l_a * t.alpha_a + sum.a;
  l_b = l_b * t.alpha_b + sum.b;
  rescale_rows(o, t);
}

// The raw-score form, for a kernel whose softmax issue rate bounds it (attention_wgmma.cu): the
// scores are the bare products Q K^T (masked to -inf where a row may not see a key), the max is
// taken before scaling (scale = softmax scale * log2(e) > 0 keeps the order), and each weight is
// exp2(s * scale - m) in one FFMA and one ex2 with subnormal results flushed to zero (weights below
// 2^-126 of the row's largest, far under what bf16 P keeps). m, alpha and the weights mean what
// they mean in the functions above; only fewer instructions compute them.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// raise_running_max for raw scores s (masked already); m_a, m_b in the scaled domain.
template <int NT>
__device__ __forceinline__ TileMax raise_running_max_raw(const float (&s)[NT][4], float m_a, float m_b, float scale) {
  float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    mx_a = fmaxf(mx_a, fmaxf(s[nt][0], s[nt][1]));
    mx_b = fmaxf(mx_b, fmaxf(s[nt][2], s[nt][3]));
  }
  quad_max(mx_a, mx_b);
  TileMax t;
  t.m_a = fmaxf(m_a, mx_a * scale);
  t.m_b = fmaxf(m_b, mx_b * scale);
  t.use_a = t.m_a == -INFINITY ? 0.f : t.m_a;
  t.use_b = t.m_b == -INFINITY ? 0.f : t.m_b;
  t.alpha_a = exp2_ftz(m_a - t.use_a);
  t.alpha_b = exp2_ftz(m_b - t.use_b);
  return t;
}

// tile_weights_and_sums for raw scores: s becomes exp2(s * scale - m).
template <int NT>
__device__ __forceinline__ RowPair tile_weights_and_sums_raw(float (&s)[NT][4], const TileMax& t, float scale) {
  float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    s[nt][0] = exp2_ftz(fmaf(s[nt][0], scale, -t.use_a));
    s[nt][1] = exp2_ftz(fmaf(s[nt][1], scale, -t.use_a));
    s[nt][2] = exp2_ftz(fmaf(s[nt][2], scale, -t.use_b));
    s[nt][3] = exp2_ftz(fmaf(s[nt][3], scale, -t.use_b));
    sum_a += s[nt][0] + s[nt][1];
    sum_b += s[nt][2] + s[nt][3];
  }
  return {sum_a, sum_b};
}

// Host side: where a kernel that splits each row's keys over blocks leaves the splits' partial
// results for their merge, in the caller's workspace: for `rows` (token, head) rows, `splits`
// outputs of `dim` floats each, then the (m, l) pairs. Both null with one split; a missing
// workspace where splits need one is cudaErrorInvalidValue.
inline cudaError_t split_partials(void* workspace, size_t rows, int splits, int dim, float** o, float** ml) {
  *o = nullptr;
  *ml = nullptr;
  if (splits <= 1) return cudaSuccess;
  if (workspace == nullptr) return cudaErrorInvalidValue;
  *o = static_cast<float*>(workspace);
  *ml = *o + rows * splits * dim;
  return cudaSuccess;
}

}  // namespace moe::cuda::kernels
