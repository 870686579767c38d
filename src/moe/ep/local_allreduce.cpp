// local_allreduce: nothing moves before the experts. Every rank already holds every token and
// its routing, runs the slots of its own experts (zero rows elsewhere, so its buffer is fully
// written), and an all-reduce of [T, H] sums the partial outputs.
#include <cstring>

#include "moe/ep/ep_backend.h"

namespace moe {

namespace {

class LocalAllreduce final : public EpBackend {
 public:
  dist::EpBackend kind() const override { return dist::EpBackend::kLocalAllreduce; }

  void dispatch(EpContext&, const Tensor& x, const int32_t* ids, const float* weights,
                int64_t top_k, LocalBatch& batch) override {
    const int64_t slots = x.dim(0) * top_k;
    batch.x = x;
    batch.ids.assign(ids, ids + slots);
    batch.weights.assign(weights, weights + slots);
    batch.top_k = top_k;
  }

  void combine(EpContext& ctx, const Tensor& y, Tensor& out) override {
    std::memcpy(out.raw(), y.raw(), y.nbytes());
    BytesMeter meter(ctx.comm);
    ctx.comm.all_reduce_sum(out.raw(), static_cast<size_t>(out.numel()), DType::kF32);
    ctx.stats.combine_bytes += meter.bytes();
  }
};

}  // namespace

std::unique_ptr<EpBackend> make_local_allreduce() { return std::make_unique<LocalAllreduce>(); }

}  // namespace moe
