// moe-bench layer --device cuda --ep N (N >= 2): one MoE layer (router + routed experts) spread
// over N GPUs of this machine, in every expert-parallel mode, beside the same layer on one GPU
// ("dense"). Each rank is a thread driving its GPU; every rank computes the router on the same
// tokens (attention is replicated) and gets the full output. Timing: p2p and dense are CUDA
// graphs of the whole layer replayed back to back on every rank at once (events on rank 0, the
// time per layer is the span over the replays); the NCCL modes are host-driven (their calls
// block), timed on the host between barriers of all ranks. Bytes are what each mode hands to its
// exchanges, summed over ranks, per layer call.
#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda_ep.h"
#include "backend/cuda_router.h"
#include "dist/nccl_communicator.h"
#include "bench_common.h"
#include "bench_layer.h"
#include "backend/device_info.h"
#include "moe/errors.h"
#include "moe/placement.h"
#include "moe/router.h"

namespace moe::bench {

namespace {

struct Mode {
  const char* name;
  int ranks_factor;  // 0: one GPU
  dist::EpBackend backend;
  bool exchange_only = false;  // dispatch and combine alone: no router, no experts in the timing
};

const Mode kEpModes[] = {
    {"dense", 0, dist::EpBackend::kLocalAllreduce},
    {"local_allreduce", 1, dist::EpBackend::kLocalAllreduce},
    {"allgather_reducescatter", 1, dist::EpBackend::kAllgatherReducescatter},
    {"alltoall_padded", 1, dist::EpBackend::kAlltoallPadded},
    {"alltoall_packed", 1, dist::EpBackend::kAlltoallPacked},
    {"p2p", 1, dist::EpBackend::kP2p},
    {"p2p_exchange_only", 1, dist::EpBackend::kP2p, true},
};

std::vector<uint16_t> uniform_bf16(size_t n, uint64_t seed, float scale) {
  std::vector<uint16_t> v(n);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& b : v) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    const float u = static_cast<float>(s >> 40) * (1.0f / 16777216.0f);
    b = f32_to_bf16((2.0f * u - 1.0f) * scale);
  }
  return v;
}

struct Layer {
  int64_t experts, hidden, inter, top_k;
  RouterConfig router;
  std::vector<uint16_t> gate_up, down, router_w;
};

struct ModeResult {
  Summary seconds;
  std::vector<uint16_t> out;   // rank 0's
  std::vector<int32_t> ids;    // the routing (rank 0's)
  cuda::EpStats stats;         // summed over ranks, over every call
  uint64_t calls = 0;
  size_t rank0_weights = 0, rank0_workspace = 0;
};

template <typename T>
T* upload(const std::vector<T>& v) {
  void* p = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(v.size() * sizeof(T), 1)));
  MOE_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<T*>(p);
}

ModeResult run_mode(const Layer& L, const Mode& m, int ep, int64_t tokens,
                    const std::vector<uint16_t>& x, int runs, int warmup) {
  const int ranks = m.ranks_factor == 0 ? 1 : ep;
  ModeResult res;
  std::vector<double> times;
  std::vector<cuda::EpStats> stats(static_cast<size_t>(ranks));
  std::barrier sync(ranks);
  const bool graphed = m.backend == dist::EpBackend::kP2p || ranks == 1;
  std::vector<int> devices;
  for (int r = 0; r < ranks; ++r) devices.push_back(r);
  std::unique_ptr<cuda::P2pExchange> exchange;
  if (m.backend == dist::EpBackend::kP2p)
    exchange = std::make_unique<cuda::P2pExchange>(devices, L.hidden, L.top_k, tokens);

  auto body = [&](int r, dist::Communicator* comm) {
    MOE_CUDA_CHECK(cudaSetDevice(r));
    cudaStream_t st;
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    ExpertPlacement pl(L.experts, ranks, r);
    const size_t gu = static_cast<size_t>(2 * L.inter * L.hidden), dn = static_cast<size_t>(L.hidden * L.inter);
    std::vector<uint16_t> my_gu(L.gate_up.begin() + pl.first_expert() * gu,
                                L.gate_up.begin() + (pl.first_expert() + pl.num_local()) * gu);
    std::vector<uint16_t> my_dn(L.down.begin() + pl.first_expert() * dn,
                                L.down.begin() + (pl.first_expert() + pl.num_local()) * dn);
    std::vector<void*> owned;
    auto* d_gu = upload(my_gu);
    auto* d_dn = upload(my_dn);
    auto* d_x = upload(x);
    auto* d_rw = upload(L.router_w);
    auto* d_ids = upload(std::vector<int32_t>(static_cast<size_t>(tokens * L.top_k)));
    auto* d_w = upload(std::vector<float>(static_cast<size_t>(tokens * L.top_k)));
    auto* d_out = upload(std::vector<uint16_t>(x.size()));
    owned = {d_gu, d_dn, d_x, d_rw, d_ids, d_w, d_out};
    {
      const cuda::EpLayerConfig c{.backend = m.backend, .rank = r, .ranks = ranks, .device = r,
                                  .experts = L.experts, .hidden = L.hidden, .inter = L.inter, .top_k = L.top_k,
                                  .max_tokens = tokens, .exchange_only = m.exchange_only};
      cuda::EpExperts layer(c, d_gu, d_dn, comm, exchange.get());
      cuda::Router router(d_rw, nullptr, L.router, L.hidden, tokens);
      auto route = [&] { router.route(d_x, tokens, d_ids, d_w, st); };
      if (m.exchange_only) route();  // once: the routing the exchange moves by
      auto step = [&] {
        if (!m.exchange_only) route();
        layer.forward(d_x, d_ids, d_w, tokens, d_out, st);
      };
      for (int i = 0; i < warmup; ++i) {
        sync.arrive_and_wait();
        step();
        MOE_CUDA_CHECK(cudaStreamSynchronize(st));
      }
      layer.check(st);
      layer.reset_stats();
      if (graphed) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        MOE_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        step();
        MOE_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
        MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        cudaEvent_t e0, e1;
        MOE_CUDA_CHECK(cudaEventCreate(&e0));
        MOE_CUDA_CHECK(cudaEventCreate(&e1));
        constexpr int kReplays = 100;
        for (int rep = 0; rep < runs + 1; ++rep) {
          sync.arrive_and_wait();
          MOE_CUDA_CHECK(cudaEventRecord(e0, st));
          for (int i = 0; i < kReplays; ++i) MOE_CUDA_CHECK(cudaGraphLaunch(exec, st));
          MOE_CUDA_CHECK(cudaEventRecord(e1, st));
          MOE_CUDA_CHECK(cudaEventSynchronize(e1));
          float ms = 0;
          MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
          if (r == 0 && rep > 0) times.push_back(ms * 1e-3 / kReplays);
        }
        layer.check(st);
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      } else {
        for (int i = 0; i < runs; ++i) {
          sync.arrive_and_wait();
          const auto t0 = std::chrono::steady_clock::now();
          step();
          MOE_CUDA_CHECK(cudaStreamSynchronize(st));
          sync.arrive_and_wait();
          if (r == 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        stats[static_cast<size_t>(r)] = layer.stats();
      }
      if (r == 0) {
        res.out.resize(x.size());
        res.ids.resize(static_cast<size_t>(tokens * L.top_k));
        MOE_CUDA_CHECK(cudaMemcpy(res.out.data(), d_out, x.size() * 2, cudaMemcpyDeviceToHost));
        MOE_CUDA_CHECK(cudaMemcpy(res.ids.data(), d_ids, res.ids.size() * 4, cudaMemcpyDeviceToHost));
        res.rank0_weights = layer.weight_bytes() + L.router_w.size() * 2;
        res.rank0_workspace = layer.workspace_bytes() + (exchange ? exchange->bytes_per_rank() : 0);
      }
    }
    for (void* p : owned) cudaFree(p);
    cudaStreamDestroy(st);
  };

  if (ranks == 1 || m.backend == dist::EpBackend::kP2p) {
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(static_cast<size_t>(ranks));
    for (int r = 0; r < ranks; ++r)
      threads.emplace_back([&, r] {
        try {
          body(r, nullptr);
        } catch (...) {
          errors[static_cast<size_t>(r)] = std::current_exception();
          sync.arrive_and_drop();
        }
      });
    for (auto& t : threads) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  } else {
    // A rank that fails leaves the barriers (its peers then fail in their collectives, within
    // the group's timeout) instead of leaving them waiting.
    cuda::run_gpu_ranks(devices, [&](int r, dist::Communicator& comm) {
      try {
        body(r, &comm);
      } catch (...) {
        sync.arrive_and_drop();
        throw;
      }
    });
  }
  for (const auto& s : stats) {
    res.stats.dispatch_bytes += s.dispatch_bytes;
    res.stats.combine_bytes += s.combine_bytes;
    res.stats.meta_bytes += s.meta_bytes;
    res.stats.regather_bytes += s.regather_bytes;
  }
  res.stats.control_seconds = stats[0].control_seconds;
  res.calls = stats[0].calls;
  res.seconds = summarize(times);
  return res;
}

// p2p's bytes from the routing (its counts never leave the device): each shard token goes once
// to every rank that owns one of its experts, and each such row comes back to every rank.
std::pair<uint64_t, uint64_t> p2p_bytes(const Layer& L, const std::vector<int32_t>& ids, int ep,
                                        int64_t tokens) {
  ExpertPlacement pl(L.experts, ep, 0);
  uint64_t rows = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    unsigned mask = 0;
    for (int64_t j = 0; j < L.top_k; ++j) mask |= 1u << pl.owner(ids[static_cast<size_t>(t * L.top_k + j)]);
    rows += static_cast<uint64_t>(__builtin_popcount(mask));
  }
  const uint64_t row = static_cast<uint64_t>(L.hidden) * 2;
  return {rows * row, rows * row * static_cast<uint64_t>(ep)};
}

}  // namespace

int run_layer_bench_cuda_ep(const LayerBenchArgs& a, int64_t experts, int64_t hidden,
                            int64_t inter, int64_t top_k, const RouterConfig& router,
                            const char* name, int64_t preset_tokens) {
  MOE_CHECK(a.runs >= 1 && a.warmup >= 1, kInvalidArgument, "--runs and --warmup must be >= 1 here");
  // --modes: exact names ("dense", the one-GPU baseline, runs whatever it says).
  const std::vector<std::string> named = split_modes(a.modes);
  for (const std::string& n : named)
    MOE_CHECK(std::any_of(std::begin(kEpModes), std::end(kEpModes), [&](const Mode& m) { return n == m.name; }),
              kInvalidArgument,
              "--modes {}: the modes over GPUs are dense, local_allreduce, allgather_reducescatter, alltoall_padded, "
              "alltoall_packed, p2p and p2p_exchange_only",
              n);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  MOE_CHECK(a.ep <= count, kUnsupported, "--ep {} needs {} GPUs; this machine has {}", a.ep, a.ep, count);
  MOE_CHECK(router.scoring == RouterScoring::kSoftmax && router.groups == GroupRanking::kNone,
            kUnsupported, "the multi-GPU layer bench runs softmax routers (preset {} has {})", name,
            router.describe());
  Layer L{experts, hidden, inter, top_k, router, {}, {}, {}};
  L.gate_up = uniform_bf16(static_cast<size_t>(experts * 2 * inter * hidden), 4, 0.0346f);
  L.down = uniform_bf16(static_cast<size_t>(experts * hidden * inter), 5, 0.0346f);
  L.router_w = uniform_bf16(static_cast<size_t>(experts * hidden), 2, 1.7f / std::sqrt(static_cast<float>(hidden)));
  std::vector<int64_t> sweep;
  if (a.tokens > 0) sweep = {a.tokens};
  else if (std::string(name) == "seed") sweep = {preset_tokens};
  else
    for (int64_t per_rank : {1, 8, 32, 128, 256, 4096, 16384})  // decode, then prefill sizes
      if (per_rank * a.ep <= 65536) sweep.push_back(per_rank * a.ep);

  cudaDeviceProp prop;
  MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double peer_bw = measure_peer_bandwidth(0, 1);
  nlohmann::json doc;
  doc["peer_copy_GBps"] = peer_bw / 1e9;
  doc["preset"] = name;
  doc["device"] = prop.name;
  doc["ep"] = a.ep;
  doc["dtype"] = "bf16";
  doc["shape"] = {{"hidden", hidden}, {"intermediate", inter}, {"experts", experts}, {"top_k", top_k},
                  {"router", router.describe()}};
  doc["method"] = fmt::format(
      "router (cuBLASLt + route kernel) and routed experts on every rank; dense = the whole layer "
      "on GPU 0; dense and p2p: CUDA graphs replayed 100 times back to back on every rank at once, "
      "events on rank 0, median of {} such spans; NCCL modes: host-timed between barriers of all "
      "ranks, median of {} calls; {} warm-up calls before either", a.runs, a.runs, a.warmup);
  if (!a.json) {
    std::printf("moe-bench layer %s --device cuda --ep %d: %d x %s, bf16, H=%lld I=%lld E=%lld k=%lld, router %s\n",
                name, a.ep, a.ep, prop.name, (long long)hidden, (long long)inter, (long long)experts,
                (long long)top_k, router.describe().c_str());
    std::printf("GPU 0 -> 1 copy: %.0f GB/s measured (one way); p2p_exchange_only: dispatch + combine "
                "without router and experts\n", peer_bw / 1e9);
    std::printf("%-24s %6s %10s %12s %12s %10s %10s %9s %10s %10s\n", "mode", "T", "layer_us",
                "tok/s", "bytes/layer", "meta", "regather", "ctrl_us", "ctrl_share", "max|diff|");
  }
  for (int64_t T : sweep) {
    std::mt19937 rng(static_cast<uint32_t>(T));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<uint16_t> x(static_cast<size_t>(T * hidden));
    for (auto& v : x) v = f32_to_bf16(nd(rng));
    std::vector<uint16_t> dense_out;
    for (const Mode& m : kEpModes) {
      if (!named.empty() && std::find(named.begin(), named.end(), m.name) == named.end() &&
          std::string(m.name) != "dense")
        continue;
      std::string why;
      if (m.backend == dist::EpBackend::kP2p && m.ranks_factor) {
        std::vector<int> d;
        for (int r = 0; r < a.ep; ++r) d.push_back(r);
        if (!cuda::peer_access_available(d, &why)) {
          std::printf("%-24s skipped: %s\n", m.name, why.c_str());
          continue;
        }
      } else if (m.ranks_factor && !cuda::nccl_available(&why)) {
        std::printf("%-24s skipped: NCCL is not available: %s\n", m.name, why.c_str());
        continue;
      }
      const ModeResult r = run_mode(L, m, a.ep, T, x, a.runs, a.warmup);
      if (m.ranks_factor == 0) dense_out = r.out;
      double diff = 0;
      for (size_t i = 0; i < r.out.size() && !m.exchange_only; ++i)
        diff = std::max<double>(diff, std::fabs(bf16_to_f32(r.out[i]) - bf16_to_f32(dense_out[i])));
      uint64_t dispatch = 0, combine = 0, meta = 0, regather = 0;
      double ctrl_us = 0;
      if (m.backend == dist::EpBackend::kP2p && m.ranks_factor) {
        std::tie(dispatch, combine) = p2p_bytes(L, r.ids, a.ep, T);
      } else if (r.calls > 0) {
        dispatch = r.stats.dispatch_bytes / r.calls;
        combine = r.stats.combine_bytes / r.calls;
        meta = r.stats.meta_bytes / r.calls;
        regather = r.stats.regather_bytes / r.calls;
        ctrl_us = r.stats.control_seconds / r.calls * 1e6;
      }
      const double layer_us = r.seconds.median * 1e6;
      nlohmann::json j{{"mode", m.name}, {"ranks", m.ranks_factor ? a.ep : 1}, {"T", T},
                       {"layer_us", layer_us}, {"layer_us_min", r.seconds.min * 1e6},
                       {"layer_us_max", r.seconds.max * 1e6}, {"tokens_per_s", T / r.seconds.median},
                       {"dispatch_bytes", dispatch}, {"combine_bytes", combine}, {"meta_bytes", meta},
                       {"regather_bytes", regather}, {"control_plane_us", ctrl_us},
                       {"control_plane_share", ctrl_us / layer_us}, {"max_abs_diff_vs_dense", diff},
                       {"rank0_weight_bytes", r.rank0_weights},
                       {"rank0_buffer_bytes", r.rank0_workspace}};
      if (m.exchange_only) {
        j["exchange_GBps"] = (dispatch + combine) / r.seconds.median / 1e9;
        j.erase("max_abs_diff_vs_dense");
      }
      doc["points"].push_back(j);
      if (!a.json)
        std::printf("%-24s %6lld %10.2f %12.0f %12llu %10llu %10llu %9.2f %10.4f %10.3g\n", m.name,
                    (long long)T, layer_us, T / r.seconds.median,
                    (unsigned long long)(dispatch + combine), (unsigned long long)meta,
                    (unsigned long long)regather, ctrl_us, ctrl_us / layer_us, diff);
    }
  }
  if (a.json) std::printf("%s\n", doc.dump(2).c_str());
  else
    std::printf("bytes/layer: rows handed to dispatch + combine, all ranks (p2p: from the routing, "
                "each row once per owner rank out and once per rank back); shard ratio %.4f\n",
                1.0 / a.ep);
  return 0;
}

}  // namespace moe::bench
