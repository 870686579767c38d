// Programmatic dependent launch: a kernel launched with launch_dependent() may be scheduled
// while its predecessor on the stream is still finishing, which hides the launch gap between
// the many short kernels of a decode step. Such a kernel must call wait_for_predecessor() before
// it reads anything earlier work on the stream writes, or writes anything at all (it returns
// once the predecessor has completed and its writes are visible). Only what stays constant over
// the forward may be read before it: the weights, and the step's metadata (positions, slots,
// lengths, block tables), which is copied in before the forward's first kernel. In a grid
// launched without the attribute both calls are no-ops.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace moe::cuda::kernels {

__device__ __forceinline__ void wait_for_predecessor() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// Lets the next kernel be scheduled now; it still waits for this one to complete.
__device__ __forceinline__ void allow_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// The first two calls of every kernel launched through launch_dependent().
__device__ __forceinline__ void begin_dependent() {
  wait_for_predecessor();
  allow_dependents();
}

// Asks L2 for `bytes` of weights at `p`, one request per 128-byte line spread over the block's
// threads. Called before wait_for_predecessor(), it overlaps the weights' HBM latency with the
// predecessor's tail; the kernel's own loads of them then hit L2.
__device__ __forceinline__ void prefetch_weights_l2(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  const size_t step = static_cast<size_t>(blockDim.x) * 128;
  for (size_t off = static_cast<size_t>(threadIdx.x) * 128; off < bytes; off += step)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
}

// Launches `kernel`, as a programmatic dependent of the preceding work on `stream` when
// `dependent` (otherwise a plain launch, after which the griddepcontrol calls are no-ops).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t stream, bool dependent, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
}

template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t stream, Args&&... args) {
  return launch_kernel(kernel, grid, block, smem, stream, true, std::forward<Args>(args)...);
}

}  // namespace moe::cuda::kernels
