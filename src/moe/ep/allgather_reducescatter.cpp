// allgather_reducescatter: tokens are sharded by rank (as with data-parallel attention). Each
// rank all-gathers the shards' tokens and routing, runs its experts' slots over all of them, and
// a reduce-scatter returns to each rank the summed outputs of its own shard. Here every rank then
// re-gathers the output shards, because the rest of the model runs replicated; those bytes are
// reported apart (regather_bytes), not as the backend's.
#include <cstring>

#include "moe/ep/ep_backend.h"

namespace moe {

namespace {

class AllgatherReducescatter final : public EpBackend {
 public:
  dist::EpBackend kind() const override { return dist::EpBackend::kAllgatherReducescatter; }

  void dispatch(EpContext& ctx, const Tensor& x, const int32_t* ids, const float* weights,
                int64_t top_k, LocalBatch& batch) override {
    const int n = ctx.comm.size(), r = ctx.comm.rank();
    tokens_ = x.dim(0);
    hidden_ = x.dim(1);
    rows_.assign(static_cast<size_t>(n), 0);
    for (int p = 0; p < n; ++p) {
      auto [b, e] = token_shard(tokens_, n, p);
      rows_[static_cast<size_t>(p)] = static_cast<size_t>(e - b);
    }
    auto [begin, end] = token_shard(tokens_, n, r);
    const size_t row_bytes = static_cast<size_t>(hidden_) * 4;
    std::vector<size_t> x_bytes, slot_bytes;
    for (size_t c : rows_) {
      x_bytes.push_back(c * row_bytes);
      slot_bytes.push_back(c * static_cast<size_t>(top_k) * 4);
    }
    batch.x = Tensor::empty(ctx.workspace, {tokens_, hidden_});
    batch.ids.resize(static_cast<size_t>(tokens_ * top_k));
    batch.weights.resize(static_cast<size_t>(tokens_ * top_k));
    batch.top_k = top_k;
    BytesMeter payload(ctx.comm);
    ctx.comm.all_gatherv(x.data<float>() + begin * hidden_, x_bytes[static_cast<size_t>(r)], batch.x.raw(), x_bytes);
    ctx.stats.dispatch_bytes += payload.bytes();
    BytesMeter meta(ctx.comm);
    ctx.comm.all_gatherv(ids + begin * top_k, slot_bytes[static_cast<size_t>(r)], batch.ids.data(), slot_bytes);
    ctx.comm.all_gatherv(weights + begin * top_k, slot_bytes[static_cast<size_t>(r)], batch.weights.data(), slot_bytes);
    ctx.stats.meta_bytes += meta.bytes();
    (void)end;
  }

  void combine(EpContext& ctx, const Tensor& y, Tensor& out) override {
    const int r = ctx.comm.rank();
    std::vector<size_t> counts;
    for (size_t c : rows_) counts.push_back(c * static_cast<size_t>(hidden_));
    auto [begin, end] = token_shard(tokens_, ctx.comm.size(), r);
    float* mine = out.data<float>() + begin * hidden_;
    BytesMeter payload(ctx.comm);
    ctx.comm.reduce_scatterv_sum(y.raw(), mine, counts, DType::kF32);
    ctx.stats.combine_bytes += payload.bytes();
    std::vector<size_t> bytes;
    for (size_t c : counts) bytes.push_back(c * 4);
    BytesMeter regather(ctx.comm);
    ctx.comm.all_gatherv(mine, bytes[static_cast<size_t>(r)], out.raw(), bytes);
    ctx.stats.regather_bytes += regather.bytes();
    (void)end;
  }

 private:
  int64_t tokens_ = 0, hidden_ = 0;
  std::vector<size_t> rows_;
};

}  // namespace

std::unique_ptr<EpBackend> make_allgather_reducescatter() {
  return std::make_unique<AllgatherReducescatter>();
}

}  // namespace moe
