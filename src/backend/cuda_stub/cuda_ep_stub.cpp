#include "backend/cuda_ep.h"

#include "moe/errors.h"

namespace moe::cuda {

bool peer_access_available(const std::vector<int>&, std::string* why) {
  if (why) *why = "this build has no CUDA backend";
  return false;
}

struct P2pExchange::State {};

P2pExchange::P2pExchange(const std::vector<int>&, int64_t, int64_t, int64_t, double, bool) {
  MOE_THROW(kUnsupported, "EP backend 'p2p': this build has no CUDA backend (configure with -DMOE_CUDA=ON)");
}
P2pExchange::~P2pExchange() = default;
int P2pExchange::ranks() const { return 0; }
size_t P2pExchange::bytes_per_rank() const { return 0; }

struct EpExperts::State {
  EpStats stats;
};

EpExperts::EpExperts(const EpLayerConfig&, const void*, const void*, dist::Communicator*, P2pExchange*) {
  MOE_THROW(kUnsupported, "GPU expert parallelism: this build has no CUDA backend (configure with -DMOE_CUDA=ON)");
}
EpExperts::EpExperts(const EpLayerConfig& c, const DeviceMatrix&, const DeviceMatrix&, dist::Communicator* comm,
                     P2pExchange* p2p)
    : EpExperts(c, nullptr, nullptr, comm, p2p) {}
EpExperts::~EpExperts() = default;
void EpExperts::forward(const uint16_t*, const int32_t*, const float*, int64_t, uint16_t*, void*) {}
void EpExperts::check(void*) const {}
const EpStats& EpExperts::stats() const { return s_->stats; }
void EpExperts::reset_stats() {}
size_t EpExperts::weight_bytes() const { return 0; }
size_t EpExperts::workspace_bytes() const { return 0; }
size_t EpExperts::workspace_bytes(const EpLayerConfig&) { return 0; }

}  // namespace moe::cuda
