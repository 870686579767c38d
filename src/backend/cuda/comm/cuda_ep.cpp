#include "backend/cuda_ep.h"

#include <algorithm>
#include <chrono>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_arena.h"
#include "backend/cuda/comm/ep_exchange_launch.h"
#include "backend/cuda/peer_access.h"
#include "backend/cuda_moe.h"
#include "moe/ep/ep_backend.h"  // token_shard: the shards the CPU backends use
#include "moe/errors.h"
#include "moe/placement.h"

namespace moe::cuda {

namespace k = kernels;

namespace {

// Carves one device allocation into aligned pieces.
class Carver {
 public:
  template <typename T>
  T* take(size_t count) {
    const size_t at = used_;
    used_ += align_up(std::max<size_t>(count * sizeof(T), 1));
    return reinterpret_cast<T*>(base_ + at);
  }
  size_t used() const { return used_; }
  void set_base(unsigned char* base) { base_ = base, used_ = 0; }

 private:
  unsigned char* base_ = nullptr;
  size_t used_ = 0;
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_devices(const std::vector<int>& devices) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
  MOE_CHECK(!devices.empty() && static_cast<int>(devices.size()) <= k::kEpMaxRanks,
            kInvalidArgument, "expert parallelism takes 1 to {} GPUs, got {}", k::kEpMaxRanks,
            devices.size());
  for (size_t i = 0; i < devices.size(); ++i) {
    MOE_CHECK(devices[i] >= 0 && devices[i] < count, kUnsupported,
              "no CUDA device {} (this machine has {})", devices[i], count);
    for (size_t j = 0; j < i; ++j)
      MOE_CHECK(devices[i] != devices[j], kInvalidArgument, "device {} is listed twice", devices[i]);
  }
}

}  // namespace

bool peer_access_available(const std::vector<int>& devices, std::string* why) {
  return peers_can_access(devices, why);
}

// One rank's part of the exchange, on its GPU. Peers write recv_* (their rows for this rank's
// experts), comb (the rows this rank's tokens got back from each owner) and flags.
struct P2pRank {
  int device = 0;
  unsigned char* base = nullptr;
  uint16_t* recv_x = nullptr;   // [ranks * cap, hidden]: source s writes rows [s * cap', ...)
  int32_t* recv_ids = nullptr;  // [ranks * cap, top_k]
  float* recv_w = nullptr;      // [ranks * cap, top_k]
  int32_t* recv_tok = nullptr;  // [ranks * cap]
  uint16_t* comb = nullptr;     // [ranks, max_tokens, hidden]: owner p's row of token t
  unsigned long long* flags = nullptr;  // [2 * ranks]: dispatch flags, then combine flags
  unsigned long long* epoch = nullptr;
  unsigned* done = nullptr;  // [3]: dispatch, send back, reduce
  int* cursor = nullptr;     // [ranks]: rows claimed in each peer by the dispatch
  int* status = nullptr;
};

struct P2pExchange::State {
  std::vector<int> devices;
  int64_t hidden = 0, top_k = 0, max_tokens = 0, cap = 0;
  bool own_tokens = false;
  long long timeout_ns = 0;
  double timeout_s = 0;
  size_t bytes = 0;
  std::vector<P2pRank> ranks;
};

P2pExchange::P2pExchange(const std::vector<int>& devices, int64_t hidden, int64_t top_k,
                         int64_t max_tokens, double timeout_s, bool own_tokens)
    : s_(std::make_unique<State>()) {
  check_devices(devices);
  MOE_CHECK(hidden >= 8 && hidden % 8 == 0 && top_k >= 1 && top_k <= 32 && max_tokens >= 1 &&
                timeout_s > 0,
            kInvalidArgument,
            "p2p exchange: hidden {} (a multiple of 8), top-k {} (1 to 32), max tokens {} (>= 1), "
            "timeout {} s (> 0)",
            hidden, top_k, max_tokens, timeout_s);
  std::string why;
  MOE_CHECK(peer_access_available(devices, &why), kUnsupported,
            "EP backend 'p2p' needs peer access between every pair of GPUs: {}", why);
  State& s = *s_;
  s.devices = devices;
  s.hidden = hidden;
  s.top_k = top_k;
  s.max_tokens = max_tokens;
  const int64_t n = static_cast<int64_t>(devices.size());
  s.own_tokens = own_tokens;
  s.cap = own_tokens ? max_tokens : ceil_div(max_tokens, n);
  s.timeout_s = timeout_s;
  s.timeout_ns = static_cast<long long>(timeout_s * 1e9);
  enable_peer_access(devices);
  auto carve = [&](Carver& c, P2pRank& r) {
    const size_t rows = static_cast<size_t>(n * s.cap);
    r.recv_x = c.take<uint16_t>(rows * hidden);
    r.recv_ids = c.take<int32_t>(rows * top_k);
    r.recv_w = c.take<float>(rows * top_k);
    r.recv_tok = c.take<int32_t>(rows);
    r.comb = c.take<uint16_t>(static_cast<size_t>(n * max_tokens * hidden));
    r.flags = c.take<unsigned long long>(static_cast<size_t>(2 * n));
    r.epoch = c.take<unsigned long long>(1);
    r.done = c.take<unsigned>(3);
    r.cursor = c.take<int>(static_cast<size_t>(n));
    r.status = c.take<int>(1);
  };
  Carver sizing;
  P2pRank probe;
  carve(sizing, probe);
  s.bytes = sizing.used();
  s.ranks.resize(devices.size());
  try {
    for (size_t i = 0; i < devices.size(); ++i) {
      P2pRank& r = s.ranks[i];
      r.device = devices[i];
      MOE_CUDA_CHECK(cudaSetDevice(r.device));
      void* p = nullptr;
      MOE_CUDA_CHECK(cudaMalloc(&p, s.bytes));
      r.base = static_cast<unsigned char*>(p);
      // Flags, epoch, counters and status (the tail of the block) start at zero; the rows need
      // no start value.
      Carver c;
      c.set_base(r.base);
      carve(c, r);
      const auto* flags = reinterpret_cast<unsigned char*>(r.flags);
      MOE_CUDA_CHECK(cudaMemset(r.flags, 0, s.bytes - static_cast<size_t>(flags - r.base)));
      MOE_CUDA_CHECK(cudaDeviceSynchronize());
    }
  } catch (...) {
    for (auto& r : s.ranks)
      if (r.base) cudaSetDevice(r.device), cudaFree(r.base);
    throw;
  }
}

P2pExchange::~P2pExchange() {
  for (auto& r : s_->ranks)
    if (r.base) {
      cudaSetDevice(r.device);
      cudaFree(r.base);
    }
}

int P2pExchange::ranks() const { return static_cast<int>(s_->devices.size()); }
size_t P2pExchange::bytes_per_rank() const { return s_->bytes; }

struct EpExperts::State {
  EpLayerConfig c;
  std::unique_ptr<ExpertPlacement> placement;
  std::unique_ptr<Experts> experts;
  dist::Communicator* comm = nullptr;
  P2pExchange::State* p2p = nullptr;
  k::EpRouting routing;  // ids / weights filled per call
  int64_t cap = 0;       // rows per (source, destination) slice at max_tokens
  void* base = nullptr;
  size_t bytes = 0;
  void* ws = nullptr;  // the experts' workspace
  int32_t* lids = nullptr;
  int32_t* ids_g = nullptr;
  float* w_g = nullptr;
  uint16_t* x_g = nullptr;
  uint16_t* y = nullptr;
  int* pos = nullptr;
  int* counts = nullptr;
  int* recv_counts = nullptr;
  uint16_t *send_x = nullptr, *recv_x = nullptr, *back = nullptr;
  int32_t *send_ids = nullptr, *recv_ids = nullptr;
  float *send_w = nullptr, *recv_w = nullptr;
  EpStats stats;
  bool owned = false;  // base was allocated here (no caller workspace)

  void sync(cudaStream_t st) const { MOE_CUDA_CHECK(cudaStreamSynchronize(st)); }
  uint64_t sent() const { return comm->stats().total.bytes_sent; }
};

namespace {

// The most rows one call runs through this rank's experts (the receive capacity when tokens
// are sharded).
int64_t expert_rows(const EpLayerConfig& c) {
  return dist::ep_backend_traits(c.backend).expert_rows(c.max_tokens, c.ranks, c.own_tokens);
}

// Rows per (source, destination) slice for calls of `tokens` tokens: a shard of them, or all of
// a rank's own.
int64_t slice_rows(const EpLayerConfig& c, int64_t tokens) {
  return c.own_tokens ? tokens : ceil_div(tokens, c.ranks);
}

// This rank's experts under the configuration (0 for one the constructor will refuse).
int64_t local_experts(const EpLayerConfig& c) {
  if (c.ranks < 1 || c.rank < 0 || c.rank >= c.ranks || c.experts < c.ranks) return 0;
  return ExpertPlacement(c.experts, c.ranks, c.rank).num_local();
}

// Carves the buffers of s.c's backend from `v` (a sizing pass, then the real one).
void layout(EpExperts::State& s, Carver& v) {
  const EpLayerConfig& c = s.c;
  const int64_t rows = expert_rows(c);
  const ExpertShape shape{s.placement->num_local(), c.hidden, c.inter, c.top_k};
  const size_t h = static_cast<size_t>(c.hidden), kk = static_cast<size_t>(c.top_k);
  // Tokens every rank's rows together make: the gathered batch.
  const size_t t = static_cast<size_t>(c.own_tokens ? c.ranks * c.max_tokens : c.max_tokens);
  const size_t r = static_cast<size_t>(rows);
  const size_t n = static_cast<size_t>(c.ranks), cap = static_cast<size_t>(s.cap);
  s.ws = v.take<unsigned char>(Experts::workspace_bytes(shape, rows, c.expert_format));
  s.y = v.take<uint16_t>(r * h);
  switch (c.backend) {
    case dist::EpBackend::kLocalAllreduce:
      s.lids = v.take<int32_t>(t * kk);
      break;
    case dist::EpBackend::kAllgatherReducescatter:
      s.lids = v.take<int32_t>(t * kk);
      s.ids_g = v.take<int32_t>(t * kk);
      s.w_g = v.take<float>(t * kk);
      s.x_g = v.take<uint16_t>(t * h);
      break;
    case dist::EpBackend::kP2p:
      break;  // its rows go straight into the exchange's buffers
    default:
      s.pos = v.take<int>(cap * n);
      s.counts = v.take<int>(n);
      s.recv_counts = v.take<int>(n);
      s.send_x = v.take<uint16_t>(r * h);
      s.recv_x = v.take<uint16_t>(r * h);
      s.back = v.take<uint16_t>(r * h);
      s.send_ids = v.take<int32_t>(r * kk);
      s.recv_ids = v.take<int32_t>(r * kk);
      s.send_w = v.take<float>(r * kk);
      s.recv_w = v.take<float>(r * kk);
      break;
  }
}

}  // namespace

EpExperts::EpExperts(const EpLayerConfig& config, const void* gate_up, const void* down,
                     dist::Communicator* comm, P2pExchange* p2p)
    : EpExperts(config, DeviceMatrix::bf16(gate_up, 2 * config.inter, config.hidden, local_experts(config)),
                DeviceMatrix::bf16(down, config.hidden, config.inter, local_experts(config)), comm, p2p) {}

EpExperts::EpExperts(const EpLayerConfig& config, const DeviceMatrix& gate_up, const DeviceMatrix& down,
                     dist::Communicator* comm, P2pExchange* p2p)
    : s_(std::make_unique<State>()) {
  State& s = *s_;
  s.c = config;
  const EpLayerConfig& c = config;
  const auto kind = c.backend;
  MOE_CHECK(c.ranks >= 1 && c.ranks <= k::kEpMaxRanks && c.rank >= 0 && c.rank < c.ranks,
            kInvalidArgument, "expert parallelism: rank {} of {} (1 to {} ranks)", c.rank, c.ranks,
            k::kEpMaxRanks);
  MOE_CHECK(c.experts >= c.ranks, kInvalidArgument, "--ep {} is more than the {} experts", c.ranks,
            c.experts);
  MOE_CHECK(c.max_tokens >= 1, kInvalidArgument, "max_tokens must be >= 1, got {}", c.max_tokens);
  MOE_CHECK(kind != dist::EpBackend::kDeepep, kUnsupported,
            "EP backend 'deepep' is not available in this build");
  MOE_CHECK(!c.own_tokens || dist::ep_backend_traits(kind).runs_data_parallel(), kInvalidArgument,
            "EP backend '{}' needs the same tokens on every rank; data-parallel attention takes "
            "allgather_reducescatter, alltoall_padded, alltoall_packed or p2p",
            dist::ep_backend_name(kind));
  if (kind == dist::EpBackend::kP2p) {
    MOE_CHECK(p2p != nullptr && p2p->ranks() == c.ranks, kInvalidArgument,
              "EP backend 'p2p' needs the group's exchange, made for {} ranks", c.ranks);
    auto& x = p2p->state();
    MOE_CHECK(x.hidden == c.hidden && x.top_k == c.top_k && x.max_tokens >= c.max_tokens &&
                  x.own_tokens == c.own_tokens && x.devices[static_cast<size_t>(c.rank)] == c.device,
              kInvalidArgument,
              "the p2p exchange was made for hidden {}, top-k {}, {} tokens{} and device {} as rank "
              "{}; this layer has hidden {}, top-k {}, {} tokens{}, device {}",
              x.hidden, x.top_k, x.max_tokens, x.own_tokens ? " per rank" : "",
              x.devices[static_cast<size_t>(c.rank)], c.rank, c.hidden, c.top_k, c.max_tokens,
              c.own_tokens ? " per rank" : "", c.device);
    s.p2p = &x;
  } else if (c.ranks > 1 || kind != dist::EpBackend::kLocalAllreduce) {
    MOE_CHECK(comm != nullptr && comm->size() == c.ranks && comm->rank() == c.rank,
              kInvalidArgument, "EP backend '{}' needs rank {}'s endpoint of a group of {}",
              dist::ep_backend_name(kind), c.rank, c.ranks);
  }
  MOE_CHECK(gate_up.format == c.expert_format, kInvalidArgument,
            "the experts are {} but the layer was configured for {} ones", gate_up.format.name(),
            c.expert_format.name());
  s.comm = comm;
  s.placement = std::make_unique<ExpertPlacement>(c.experts, c.ranks, c.rank);
  s.routing.top_k = static_cast<int>(c.top_k);
  s.routing.ranks = c.ranks;
  for (int p = 0; p <= c.ranks; ++p)
    s.routing.first[p] = static_cast<int>(p < c.ranks ? s.placement->first_expert(p) : c.experts);

  const int64_t rows = expert_rows(c);
  const ExpertShape shape{s.placement->num_local(), c.hidden, c.inter, c.top_k};
  MOE_CUDA_CHECK(cudaSetDevice(c.device));
  s.experts = std::make_unique<Experts>(gate_up, down, shape, rows, c.device);
  s.cap = slice_rows(c, c.max_tokens);
  Carver sizing;
  layout(s, sizing);
  s.bytes = sizing.used();
  if (c.workspace) {
    MOE_CHECK(reinterpret_cast<uintptr_t>(c.workspace) % 256 == 0, kInvalidArgument,
              "the expert-parallel workspace must be 256-byte aligned");
    s.base = c.workspace;
  } else {
    MOE_CUDA_CHECK(cudaMalloc(&s.base, s.bytes));
    s.owned = true;
  }
  Carver carver;
  carver.set_base(static_cast<unsigned char*>(s.base));
  layout(s, carver);
}

size_t EpExperts::workspace_bytes(const EpLayerConfig& config) {
  State s;
  s.c = config;
  s.placement = std::make_unique<ExpertPlacement>(config.experts, config.ranks, config.rank);
  s.cap = slice_rows(config, config.max_tokens);
  Carver sizing;
  layout(s, sizing);
  return sizing.used();
}

EpExperts::~EpExperts() {
  if (s_ && s_->owned) {
    cudaSetDevice(s_->c.device);
    cudaFree(s_->base);
  }
}

const EpStats& EpExperts::stats() const { return s_->stats; }
void EpExperts::reset_stats() { s_->stats = EpStats{}; }
size_t EpExperts::weight_bytes() const { return s_->experts->weight_bytes(); }
size_t EpExperts::workspace_bytes() const { return s_->bytes; }

void EpExperts::forward(const uint16_t* x, const int32_t* ids, const float* weights,
                        int64_t tokens, uint16_t* out, void* stream) {
  State& s = *s_;
  const EpLayerConfig& c = s.c;
  MOE_CHECK(tokens >= 1 && tokens <= c.max_tokens, kInvalidArgument,
            "{} tokens: this layer was set up for 1 to {}", tokens, c.max_tokens);
  MOE_CHECK(x && ids && weights && out, kInvalidArgument, "null input or output");
  MOE_CUDA_CHECK(cudaSetDevice(c.device));
  auto* st = static_cast<cudaStream_t>(stream);
  const int n = c.ranks, me = c.rank;
  const int64_t T = tokens, H = c.hidden, K = c.top_k;
  // The rows this rank sends: its shard of the batch, or all of its own.
  const auto [begin, end] = c.own_tokens ? std::pair<int64_t, int64_t>{0, T} : token_shard(T, n, me);
  const int S = static_cast<int>(end - begin);
  const int64_t cap = slice_rows(c, T);  // this call's slice of rows per (source, destination)
  const int64_t gathered = c.own_tokens ? n * T : T;  // every rank's rows together
  k::EpRouting rt = s.routing;
  rt.ids = ids;
  rt.weights = weights;
  EpStats& stats = s.stats;
  ++stats.calls;
  // The shards' byte sizes, in rank order, for the gathers.
  auto shard_sizes = [&](size_t per_token) {
    std::vector<size_t> v;
    for (int p = 0; p < n; ++p) {
      auto [b, e] = c.own_tokens ? std::pair<int64_t, int64_t>{0, T} : token_shard(T, n, p);
      v.push_back(static_cast<size_t>(e - b) * per_token);
    }
    return v;
  };
  // Each rank ends with every token's output; not with own tokens, whose rows stay home.
  auto regather = [&] {
    if (c.own_tokens) return;
    const auto bytes = shard_sizes(static_cast<size_t>(H) * 2);
    const uint64_t before = s.sent();
    s.comm->all_gatherv(out + begin * H, bytes[static_cast<size_t>(me)], out, bytes);
    stats.regather_bytes += s.sent() - before;
  };
  const int first = s.routing.first[me], num = s.routing.first[me + 1] - first;

  switch (c.backend) {
    case dist::EpBackend::kLocalAllreduce: {
      MOE_CUDA_CHECK(k::ep_localize(ids, static_cast<int>(T * K), first, num, s.lids, st));
      if (!c.exchange_only) s.experts->forward(x, s.lids, weights, T, out, s.ws, st);
      if (n == 1) return;
      s.sync(st);
      const uint64_t before = s.sent();
      s.comm->all_reduce_sum(out, static_cast<size_t>(T * H), DType::kBF16);
      stats.combine_bytes += s.sent() - before;
      return;
    }
    case dist::EpBackend::kAllgatherReducescatter: {
      s.sync(st);
      uint64_t before = s.sent();
      const auto xb = shard_sizes(static_cast<size_t>(H) * 2), sb = shard_sizes(static_cast<size_t>(K) * 4);
      s.comm->all_gatherv(x + begin * H, xb[static_cast<size_t>(me)], s.x_g, xb);
      stats.dispatch_bytes += s.sent() - before;
      before = s.sent();
      s.comm->all_gatherv(ids + begin * K, sb[static_cast<size_t>(me)], s.ids_g, sb);
      s.comm->all_gatherv(weights + begin * K, sb[static_cast<size_t>(me)], s.w_g, sb);
      stats.meta_bytes += s.sent() - before;
      MOE_CUDA_CHECK(k::ep_localize(s.ids_g, static_cast<int>(gathered * K), first, num, s.lids, st));
      if (!c.exchange_only) s.experts->forward(s.x_g, s.lids, s.w_g, gathered, s.y, s.ws, st);
      s.sync(st);
      std::vector<size_t> counts = shard_sizes(static_cast<size_t>(H));
      before = s.sent();
      s.comm->reduce_scatterv_sum(s.y, out + begin * H, counts, DType::kBF16);
      stats.combine_bytes += s.sent() - before;
      regather();
      return;
    }
    case dist::EpBackend::kAlltoallPadded:
    case dist::EpBackend::kAlltoallPacked: {
      const bool padded = c.backend == dist::EpBackend::kAlltoallPadded;
      MOE_CUDA_CHECK(k::ep_plan(rt, static_cast<int>(begin), S, s.pos, s.counts, st));
      std::vector<int64_t> send_rows(static_cast<size_t>(n), cap), recv_rows(static_cast<size_t>(n), cap);
      if (!padded) {
        // The control plane: the exact slice sizes have to reach the host for NCCL.
        const auto t0 = std::chrono::steady_clock::now();
        std::vector<int> sc(static_cast<size_t>(n)), rc(static_cast<size_t>(n));
        MOE_CUDA_CHECK(cudaMemcpyAsync(sc.data(), s.counts, n * sizeof(int), cudaMemcpyDeviceToHost, st));
        s.sync(st);
        const uint64_t before = s.sent();
        s.comm->all_to_all(s.counts, s.recv_counts, sizeof(int));
        stats.meta_bytes += s.sent() - before;
        MOE_CUDA_CHECK(cudaMemcpy(rc.data(), s.recv_counts, n * sizeof(int), cudaMemcpyDeviceToHost));
        for (int p = 0; p < n; ++p) send_rows[static_cast<size_t>(p)] = sc[static_cast<size_t>(p)], recv_rows[static_cast<size_t>(p)] = rc[static_cast<size_t>(p)];
        stats.control_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      std::vector<int64_t> send_at(static_cast<size_t>(n) + 1, 0), recv_at(static_cast<size_t>(n) + 1, 0);
      for (int p = 0; p < n; ++p) {
        send_at[static_cast<size_t>(p) + 1] = send_at[static_cast<size_t>(p)] + send_rows[static_cast<size_t>(p)];
        recv_at[static_cast<size_t>(p) + 1] = recv_at[static_cast<size_t>(p)] + recv_rows[static_cast<size_t>(p)];
      }
      k::EpDest dest;
      for (int p = 0; p < n; ++p) {
        const int64_t row = send_at[static_cast<size_t>(p)];
        dest.x[p] = s.send_x + row * H;
        dest.ids[p] = s.send_ids + row * K;
        dest.w[p] = s.send_w + row * K;
      }
      dest.pad_rows = padded ? static_cast<int>(cap) : 0;
      MOE_CUDA_CHECK(k::ep_pack(x, rt, static_cast<int>(begin), S, static_cast<int>(H), s.pos,
                                s.counts, dest, st));
      s.sync(st);
      // Rows of `row_bytes`; forward: send_rows out, recv_rows in; back: the reverse.
      auto exchange = [&](const void* send, void* recv, size_t row_bytes, bool forward) {
        if (padded) {
          s.comm->all_to_all(send, recv, static_cast<size_t>(cap) * row_bytes);
          return;
        }
        std::vector<size_t> sb, rb;
        for (int p = 0; p < n; ++p) {
          const auto a = static_cast<size_t>(send_rows[static_cast<size_t>(p)]) * row_bytes;
          const auto b = static_cast<size_t>(recv_rows[static_cast<size_t>(p)]) * row_bytes;
          sb.push_back(forward ? a : b);
          rb.push_back(forward ? b : a);
        }
        s.comm->all_to_allv(send, sb, recv, rb);
      };
      uint64_t before = s.sent();
      exchange(s.send_x, s.recv_x, static_cast<size_t>(H) * 2, true);
      stats.dispatch_bytes += s.sent() - before;
      before = s.sent();
      exchange(s.send_ids, s.recv_ids, static_cast<size_t>(K) * 4, true);
      exchange(s.send_w, s.recv_w, static_cast<size_t>(K) * 4, true);
      stats.meta_bytes += s.sent() - before;
      const int64_t rows = recv_at[static_cast<size_t>(n)];
      if (rows > 0 && !c.exchange_only) s.experts->forward(s.recv_x, s.recv_ids, s.recv_w, rows, s.y, s.ws, st);
      s.sync(st);
      before = s.sent();
      exchange(s.y, s.back, static_cast<size_t>(H) * 2, false);
      stats.combine_bytes += s.sent() - before;
      k::EpParts parts;
      for (int p = 0; p < n; ++p) parts.part[p] = s.back + send_at[static_cast<size_t>(p)] * H;
      MOE_CUDA_CHECK(k::ep_unpack_sum(parts, s.pos, S, n, static_cast<int>(H), out + begin * H, st));
      s.sync(st);
      regather();
      return;
    }
    case dist::EpBackend::kP2p: {
      const P2pExchange::State& x2 = *s.p2p;
      const P2pRank& mine = x2.ranks[static_cast<size_t>(me)];
      k::P2pDispatch d;
      k::EpSignal returned;
      k::EpRowsOut back;
      for (int q = 0; q < n; ++q) {
        const P2pRank& peer = x2.ranks[static_cast<size_t>(q)];
        d.dest.x[q] = peer.recv_x + me * cap * H;
        d.dest.ids[q] = peer.recv_ids + me * cap * K;
        d.dest.w[q] = peer.recv_w + me * cap * K;
        d.dest.token[q] = peer.recv_tok + me * cap;
        d.sig.flag[q] = peer.flags + me;
        returned.flag[q] = peer.flags + n + me;
        back.dest[q] = peer.comb + me * x2.max_tokens * H;
      }
      d.dest.pad_rows = static_cast<int>(cap);
      d.sig.epoch = returned.epoch = mine.epoch;
      d.sig.done = mine.done;
      d.wait = k::EpWait{mine.flags, mine.epoch, x2.timeout_ns, mine.status, 1};
      d.cursor = mine.cursor;
      d.recv_ids = mine.recv_ids;
      d.recv_token = mine.recv_tok;
      returned.done = mine.done + 1;
      MOE_CUDA_CHECK(k::ep_dispatch_p2p(x, rt, static_cast<int>(begin), S, static_cast<int>(H), d, st));
      const int64_t rows = n * cap;
      // The experts stop short of their combine: one kernel sums each received row from its
      // slots as it writes the row back to the ranks, then waits for the others' rows and adds
      // them up (two launches less per layer than combine, send-back and sum apart).
      const Experts::Partials p =
          c.exchange_only ? s.experts->partials_of(rows, s.ws)
                          : s.experts->forward_partials(mine.recv_x, mine.recv_ids, mine.recv_w, rows, s.ws, st);
      k::P2pCombine comb;
      comb.in = k::EpSlotSums{p.sums, mine.recv_ids, static_cast<int>(K), p.bf16, p.splits, p.split_stride};
      comb.token = mine.recv_tok;
      comb.rows = static_cast<int>(rows);
      comb.back = back;
      comb.sig = returned;
      comb.source_rows = c.own_tokens ? static_cast<int>(cap) : 0;
      comb.comb = mine.comb;
      comb.stride = x2.max_tokens;
      comb.wait = k::EpWait{mine.flags + n, mine.epoch, x2.timeout_ns, mine.status, 2};
      comb.epoch = mine.epoch;
      comb.done = mine.done + 2;
      MOE_CUDA_CHECK(k::ep_combine_p2p(rt, comb, static_cast<int>(T), static_cast<int>(H), out, st));
      return;
    }
    default:
      MOE_THROW(kUnsupported, "EP backend '{}' is not available in this build",
                dist::ep_backend_name(c.backend));
  }
}

void EpExperts::check(void* stream) const {
  const State& s = *s_;
  if (!s.p2p) return;
  MOE_CUDA_CHECK(cudaSetDevice(s.c.device));
  MOE_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  int status = 0;
  MOE_CUDA_CHECK(cudaMemcpy(&status, s.p2p->ranks[static_cast<size_t>(s.c.rank)].status,
                            sizeof(int), cudaMemcpyDeviceToHost));
  if (status == 0) return;
  const int stage = (status - 1) >> 8, peer = (status - 1) & 0xff;
  MOE_THROW(kInternal, "p2p {} on rank {}: no rows from rank {} within {} s (a peer stopped or "
            "the ranks' calls do not match); the exchange is unusable from here",
            stage == 1 ? "dispatch" : "combine", s.c.rank, peer, s.p2p->timeout_s);
}

}  // namespace moe::cuda
