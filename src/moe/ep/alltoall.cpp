// alltoall_padded and alltoall_packed: tokens are sharded by rank; each rank sends every routed
// (token, slot) row of its shard to the rank that holds the slot's expert, the experts run on
// what arrives, the results travel back the same way, and the sender sums them per token,
// weighted, in slot order (ascending expert id, as on one rank).
//   padded - a fixed capacity of (largest shard x k) rows per peer, whatever the routing: no
//            counts to exchange, ep x T x k x H values per direction in total;
//   packed - exact rows only (T x k x H per direction), after an all-to-all of the per-peer
//            counts: that exchange and the bookkeeping around it are the control plane.
// Every rank then re-gathers the output shards (reported apart, as regather_bytes).
#include <cstring>

#include "moe/ep/ep_backend.h"

namespace moe {

namespace {

class Alltoall final : public EpBackend {
 public:
  explicit Alltoall(bool padded) : padded_(padded) {}
  dist::EpBackend kind() const override {
    return padded_ ? dist::EpBackend::kAlltoallPadded : dist::EpBackend::kAlltoallPacked;
  }

  void dispatch(EpContext& ctx, const Tensor& x, const int32_t* ids, const float* weights,
                int64_t top_k, LocalBatch& batch) override {
    const int n = ctx.comm.size(), r = ctx.comm.rank();
    auto t0 = Clock::now();
    tokens_ = x.dim(0);
    hidden_ = x.dim(1);
    top_k_ = top_k;
    std::tie(begin_, end_) = token_shard(tokens_, n, r);
    const int64_t slots = (end_ - begin_) * top_k;
    weights_.assign(weights + begin_ * top_k, weights + end_ * top_k);

    // Where each slot goes: peer, and its row within the send buffer.
    send_counts_.assign(static_cast<size_t>(n), 0);
    std::vector<int> peer_of(static_cast<size_t>(slots));
    for (int64_t s = 0; s < slots; ++s) {
      int p = ctx.placement.owner(ids[begin_ * top_k + s]);
      peer_of[static_cast<size_t>(s)] = p;
      ++send_counts_[static_cast<size_t>(p)];
    }
    if (padded_) {
      const int64_t largest = token_shard(tokens_, n, 0).second;  // shard 0 is never smaller
      capacity_ = largest * top_k;
      send_offsets_.clear();
      for (int p = 0; p <= n; ++p) send_offsets_.push_back(static_cast<int64_t>(p) * capacity_);
      recv_counts_.assign(static_cast<size_t>(n), capacity_);
    } else {
      BytesMeter meta(ctx.comm);
      recv_counts_.assign(static_cast<size_t>(n), 0);
      ctx.comm.all_to_all(send_counts_.data(), recv_counts_.data(), sizeof(int64_t));
      ctx.stats.meta_bytes += meta.bytes();
      send_offsets_.assign(1, 0);
      for (int p = 0; p < n; ++p) send_offsets_.push_back(send_offsets_.back() + send_counts_[static_cast<size_t>(p)]);
    }
    slot_row_.resize(static_cast<size_t>(slots));
    std::vector<int64_t> cursor(send_offsets_.begin(), send_offsets_.end() - 1);
    for (int64_t s = 0; s < slots; ++s)
      slot_row_[static_cast<size_t>(s)] = cursor[static_cast<size_t>(peer_of[static_cast<size_t>(s)])]++;
    ctx.stats.control_seconds += seconds_since(t0);

    const int64_t send_rows = send_offsets_.back();
    Tensor send = Tensor::empty(ctx.workspace, {send_rows, hidden_});
    std::vector<int32_t> send_ids(static_cast<size_t>(send_rows), -1);  // -1: padding
    for (int64_t s = 0; s < slots; ++s) {
      int64_t row = slot_row_[static_cast<size_t>(s)];
      std::memcpy(send.data<float>() + row * hidden_, x.data<float>() + (begin_ + s / top_k) * hidden_,
                  static_cast<size_t>(hidden_) * 4);
      send_ids[static_cast<size_t>(row)] = ids[begin_ * top_k + s];
    }
    if (padded_)  // padding rows travel too; give them defined contents
      for (int64_t row = 0; row < send_rows; ++row)
        if (send_ids[static_cast<size_t>(row)] < 0)
          std::memset(send.data<float>() + row * hidden_, 0, static_cast<size_t>(hidden_) * 4);

    int64_t recv_rows = 0;
    for (int64_t c : recv_counts_) recv_rows += c;
    batch.x = Tensor::empty(ctx.workspace, {recv_rows, hidden_});
    batch.ids.assign(static_cast<size_t>(recv_rows), -1);
    batch.weights.assign(static_cast<size_t>(recv_rows), 1.0f);
    batch.top_k = 1;
    BytesMeter payload(ctx.comm);
    exchange(ctx, send.raw(), batch.x.raw(), static_cast<size_t>(hidden_) * 4, /*forward=*/true);
    ctx.stats.dispatch_bytes += payload.bytes();
    BytesMeter meta(ctx.comm);
    exchange(ctx, send_ids.data(), batch.ids.data(), sizeof(int32_t), true);
    ctx.stats.meta_bytes += meta.bytes();
  }

  void combine(EpContext& ctx, const Tensor& y, Tensor& out) override {
    const int n = ctx.comm.size(), r = ctx.comm.rank();
    Tensor back = Tensor::empty(ctx.workspace, {send_offsets_.back(), hidden_});
    BytesMeter payload(ctx.comm);
    exchange(ctx, y.raw(), back.raw(), static_cast<size_t>(hidden_) * 4, /*forward=*/false);
    ctx.stats.combine_bytes += payload.bytes();
    for (int64_t t = 0; t < end_ - begin_; ++t) {
      float* o = out.data<float>() + (begin_ + t) * hidden_;
      std::memset(o, 0, static_cast<size_t>(hidden_) * 4);
      for (int64_t j = 0; j < top_k_; ++j) {
        const int64_t s = t * top_k_ + j;
        const float w = weights_[static_cast<size_t>(s)];
        const float* yr = back.data<float>() + slot_row_[static_cast<size_t>(s)] * hidden_;
        for (int64_t d = 0; d < hidden_; ++d) o[d] += w * yr[d];
      }
    }
    std::vector<size_t> bytes;
    for (int p = 0; p < n; ++p) {
      auto [b, e] = token_shard(tokens_, n, p);
      bytes.push_back(static_cast<size_t>((e - b) * hidden_) * 4);
    }
    BytesMeter regather(ctx.comm);
    ctx.comm.all_gatherv(out.data<float>() + begin_ * hidden_, bytes[static_cast<size_t>(r)], out.raw(), bytes);
    ctx.stats.regather_bytes += regather.bytes();
  }

 private:
  // Rows of `row_bytes` each: forward sends send_counts_ per peer and receives recv_counts_; the
  // way back swaps them.
  void exchange(EpContext& ctx, const void* send, void* recv, size_t row_bytes, bool forward) {
    if (padded_) {
      ctx.comm.all_to_all(send, recv, static_cast<size_t>(capacity_) * row_bytes);
      return;
    }
    std::vector<size_t> s, v;
    for (size_t p = 0; p < send_counts_.size(); ++p) {
      s.push_back(static_cast<size_t>(forward ? send_counts_[p] : recv_counts_[p]) * row_bytes);
      v.push_back(static_cast<size_t>(forward ? recv_counts_[p] : send_counts_[p]) * row_bytes);
    }
    ctx.comm.all_to_allv(send, s, recv, v);
  }

  bool padded_;
  int64_t tokens_ = 0, hidden_ = 0, top_k_ = 0, begin_ = 0, end_ = 0, capacity_ = 0;
  std::vector<float> weights_;
  std::vector<int64_t> send_counts_, recv_counts_, send_offsets_, slot_row_;
};

}  // namespace

std::unique_ptr<EpBackend> make_alltoall(bool padded) { return std::make_unique<Alltoall>(padded); }

}  // namespace moe
