#include "dist/nccl_communicator.h"

#include "moe/errors.h"

namespace moe::cuda {

struct NcclGroupState {};

NcclGroup::NcclGroup(const std::vector<int>&, double) {
  MOE_THROW(kUnsupported, "NCCL: this build has no CUDA backend (configure with -DMOE_CUDA=ON)");
}
NcclGroup::~NcclGroup() = default;
int NcclGroup::size() const { return 0; }
std::unique_ptr<dist::Communicator> NcclGroup::communicator(int) { MOE_THROW(kInternal, "no NCCL group"); }

void run_gpu_ranks(const std::vector<int>& devices, const std::function<void(int, dist::Communicator&)>&, double) {
  NcclGroup group(devices);
}

bool nccl_available(std::string* why) {
  if (why) *why = "this build has no CUDA backend";
  return false;
}

}  // namespace moe::cuda
