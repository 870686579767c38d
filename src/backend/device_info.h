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

}  // namespace moe
