// The operators the model blocks are built from. Each checks shapes and dtypes, then dispatches
// to the backend of its tensors' device (only the CPU reference exists in this file's callers so
// far). Activations are f32, row-major, one row per token.
#pragma once

#include "core/thread_pool.h"
#include "moe/tensor.h"

namespace moe::ops {

// y[M, N] = x[M, K] · w[N, K]^T (+ bias[N]).
void linear(ThreadPool& pool, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y);
// out = x / rms(x) * weight, row-wise over the last dimension; out may alias x.
void rms_norm(ThreadPool& pool, const Tensor& x, const Tensor& weight, float eps, Tensor& out);
// RMSNorm of every `weight.numel()`-wide group of each row (per-head q/k norm), in place.
void rms_norm_groups(ThreadPool& pool, Tensor& x, const Tensor& weight, float eps);
// out[T, I] = silu(gate_up[T, :I]) * gate_up[T, I:].
void silu_mul(const Tensor& gate_up, Tensor& out);
// x += y.
void add_inplace(Tensor& x, const Tensor& y);

}  // namespace moe::ops
