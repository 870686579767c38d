// What accelerators this build can use. With MOE_CUDA off the stub says so plainly instead of
// failing to link or silently falling back.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace moe {

struct GpuInfo {
  int index = 0;
  std::string name;
  size_t memory_bytes = 0;
  int cc_major = 0, cc_minor = 0;
  int multiprocessors = 0;
};

// True when the library was compiled with the CUDA backend.
bool cuda_built();
// The visible CUDA devices; empty when built without CUDA or when no device/driver is present.
std::vector<GpuInfo> cuda_devices();
// One line about the CUDA runtime state ("built without CUDA", "no CUDA device: ...", ...).
std::string cuda_status();

// Ceilings measured on `device` now, for floors printed beside measured times: device-to-device
// copy bandwidth in bytes/s counting bytes read and written (1 GiB copied 10 times), and the
// dense bf16 matmul rate in FLOP/s (cuBLASLt, 8192^3, f32 accumulation). 0 without CUDA.
double measure_copy_bandwidth(int device = 0);
// One-way copy bandwidth from device `from` to device `to` in bytes/s (256 MiB copied 10 times,
// peer access enabled where the pair has it, so the copy takes the direct link): the link the
// expert-parallel exchanges cross. 0 without CUDA.
double measure_peer_bandwidth(int from, int to);
double measure_bf16_matmul_rate(int device = 0);
// The dense FP8 matmul rate in FLOP/s: cuBLASLt, E4M3 x E4M3 -> bf16, 8192^3, f32 accumulation,
// tensor-wide scales. kUnsupported where cuBLASLt runs none; 0 without CUDA.
double measure_fp8_matmul_rate(int device = 0);

}  // namespace moe
