#include "moe/ep/ep_backend.h"

#include "moe/errors.h"

namespace moe {

std::unique_ptr<EpBackend> make_local_allreduce();
std::unique_ptr<EpBackend> make_allgather_reducescatter();
std::unique_ptr<EpBackend> make_alltoall(bool padded);

std::unique_ptr<EpBackend> make_ep_backend(dist::EpBackend kind) {
  switch (kind) {
    case dist::EpBackend::kLocalAllreduce: return make_local_allreduce();
    case dist::EpBackend::kAllgatherReducescatter: return make_allgather_reducescatter();
    case dist::EpBackend::kAlltoallPadded: return make_alltoall(true);
    case dist::EpBackend::kAlltoallPacked: return make_alltoall(false);
    default: break;
  }
  MOE_THROW(kUnsupported, "EP backend '{}' is not available in this build",
            dist::ep_backend_name(kind));
}

std::pair<int64_t, int64_t> token_shard(int64_t tokens, int ranks, int rank) {
  int64_t base = tokens / ranks, extra = tokens % ranks;
  int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

void ep_moe_forward(EpBackend& backend, EpContext& ctx, ExecMode exec, const ExpertWeights& w,
                    ExpertPlan& plan, const Tensor& x, const int32_t* ids, const float* weights,
                    int64_t top_k, Tensor& out) {
  LocalBatch batch;
  backend.dispatch(ctx, x, ids, weights, top_k, batch);
  const int64_t rows = batch.x.defined() ? batch.x.dim(0) : 0;
  Tensor y = Tensor::empty(ctx.workspace, {rows, w.hidden});
  if (rows > 0)
    run_experts(exec, ctx.pool, ctx.workspace, w, ctx.placement.global_to_local(), batch.x,
                batch.ids.data(), batch.weights.data(), batch.top_k, y, plan);
  backend.combine(ctx, y, out);
  ++ctx.stats.calls;
}

}  // namespace moe
