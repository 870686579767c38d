// TMA tensor maps of K-major operand tiles, as the sm_90a GEMMs load them (moe_wgmma_gemm.cu,
// gemm_fp8_w8a8.cu): a row-major matrix [rows, k] of bf16 or FP8 codes read in boxes of 128 bytes
// of k by `box_rows` rows, 128-byte swizzled. The encoder comes through the runtime's driver entry
// point, so no target links the driver library.
#pragma once

#include <cuda.h>  // CUtensorMap only
#include <cuda_runtime.h>

#include <cstdint>

namespace moe::cuda {

// Boxes past the last row read zeros. cudaErrorNotSupported when the driver offers no
// cuTensorMapEncodeTiled; cudaErrorInvalidValue when it refuses the layout (the base 16-byte
// aligned and k x element bytes a multiple of 16 are needed).
cudaError_t kmajor_tile_map(CUtensorMap* map, const void* base, uint64_t rows, uint64_t k, uint32_t box_rows,
                            bool fp8);

}  // namespace moe::cuda
