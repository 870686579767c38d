// The CPU-only build: no CUDA runtime is linked, and the engine says so when asked for a GPU.
#include "backend/device_info.h"

namespace moe {

bool cuda_built() { return false; }
std::vector<GpuInfo> cuda_devices() { return {}; }
std::string cuda_status() { return "built without CUDA (configure with -DMOE_CUDA=ON)"; }
double measure_copy_bandwidth(int) { return 0.0; }
double measure_peer_bandwidth(int, int) { return 0.0; }
double measure_bf16_matmul_rate(int) { return 0.0; }
double measure_fp8_matmul_rate(int) { return 0.0; }

}  // namespace moe
