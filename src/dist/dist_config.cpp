#include "dist/dist_config.h"

#include <fmt/format.h>

#include "moe/errors.h"

namespace moe::dist {
namespace {

constexpr EpBackend kAllBackends[] = {
    EpBackend::kLocalAllreduce, EpBackend::kAllgatherReducescatter, EpBackend::kAlltoallPadded,
    EpBackend::kAlltoallPacked, EpBackend::kP2p,                    EpBackend::kDeepep,
};

bool backend_available(EpBackend backend, const BuildCaps& caps) {
  switch (backend) {
    case EpBackend::kP2p: return caps.cuda && caps.peer_access;
    case EpBackend::kDeepep: return caps.cuda && caps.deepep;
    default: return true;
  }
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) {
    if (!out.empty()) out += ", ";
    out += name;
  }
  return out;
}

}  // namespace

BuildCaps BuildCaps::current() {
  BuildCaps caps;
#if defined(MOE_WITH_CUDA)
  caps.cuda = true;
#endif
  return caps;
}

const char* ep_backend_name(EpBackend backend) {
  switch (backend) {
    case EpBackend::kLocalAllreduce: return "local_allreduce";
    case EpBackend::kAllgatherReducescatter: return "allgather_reducescatter";
    case EpBackend::kAlltoallPadded: return "alltoall_padded";
    case EpBackend::kAlltoallPacked: return "alltoall_packed";
    case EpBackend::kP2p: return "p2p";
    case EpBackend::kDeepep: return "deepep";
  }
  return "?";
}

const std::vector<std::string>& ep_backend_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (EpBackend b : kAllBackends) out.emplace_back(ep_backend_name(b));
    return out;
  }();
  return names;
}

std::vector<std::string> available_ep_backends(const BuildCaps& caps) {
  std::vector<std::string> out;
  for (EpBackend b : kAllBackends) {
    if (backend_available(b, caps)) out.emplace_back(ep_backend_name(b));
  }
  return out;
}

const EpBackendTraits& ep_backend_traits(EpBackend backend) {
  static const EpBackendTraits allreduce{.graph_capturable = true, .reduced_output = false};
  static const EpBackendTraits gathered{};
  static const EpBackendTraits padded{.sharded_tokens = true};
  static const EpBackendTraits packed{.sharded_tokens = true, .host_counts = true};
  static const EpBackendTraits p2p{.graph_capturable = true, .sharded_tokens = true,
                                   .needs_peer_access = true, .needs_gpu = true};
  static const EpBackendTraits deepep{.sharded_tokens = true, .needs_gpu = true};
  switch (backend) {
    case EpBackend::kLocalAllreduce: return allreduce;
    case EpBackend::kAllgatherReducescatter: return gathered;
    case EpBackend::kAlltoallPadded: return padded;
    case EpBackend::kAlltoallPacked: return packed;
    case EpBackend::kP2p: return p2p;
    case EpBackend::kDeepep: return deepep;
  }
  return gathered;
}

bool ep_backend_needs_gpu(EpBackend backend) { return ep_backend_traits(backend).needs_gpu; }

EpBackend parse_ep_backend(const std::string& name) {
  for (EpBackend b : kAllBackends) {
    if (name == ep_backend_name(b)) return b;
  }
  MOE_THROW(kConfig, "unknown EP backend '{}'; valid names: {}", name, join(ep_backend_names()));
}

void validate_dist_config(const DistConfig& config, const BuildCaps& caps) {
  MOE_CHECK(config.tp >= 1, kInvalidArgument, "tp must be at least 1, got {}", config.tp);
  MOE_CHECK(config.ep >= 1, kInvalidArgument, "ep must be at least 1, got {}", config.ep);
  MOE_CHECK(config.dp >= 1, kInvalidArgument, "dp must be at least 1, got {}", config.dp);

  EpBackend backend = parse_ep_backend(config.ep_backend);
  if (!backend_available(backend, caps)) {
    std::string available = join(available_ep_backends(caps));
    if (!caps.cuda) {
      MOE_THROW(kUnsupported,
                "EP backend '{}' needs the CUDA build and is not available in this build; "
                "available here: {}",
                config.ep_backend, available);
    }
    if (backend == EpBackend::kP2p) {
      MOE_THROW(kUnsupported,
                "EP backend 'p2p' needs peer access between the GPUs, which this machine does "
                "not offer; available here: {}",
                available);
    }
    MOE_THROW(kUnsupported,
              "EP backend '{}' is not built (this build has no DeepEP kernels); available here: {}",
              config.ep_backend, available);
  }

  MOE_CHECK(config.dp == 1, kUnsupported, "data parallelism is not supported yet (dp = {})",
            config.dp);
  MOE_CHECK(config.tp == 1, kUnsupported,
            "tensor parallelism is not supported yet (tp = {}): tensor-parallel attention "
            "arrives with the multi-GPU backend",
            config.tp);
}

void validate_ep_for_model(const DistConfig& config, int64_t num_experts) {
  MOE_CHECK(config.ep >= 1, kInvalidArgument, "ep must be at least 1, got {}", config.ep);
  if (num_experts <= 0) {
    MOE_CHECK(config.ep == 1, kInvalidArgument,
              "ep {} needs a mixture-of-experts model, but this model has no routed experts",
              config.ep);
    return;
  }
  MOE_CHECK(config.ep <= num_experts, kInvalidArgument,
            "ep {} is larger than the number of experts {}", config.ep, num_experts);
}

}  // namespace moe::dist
