// moe-bench layer: one MoE layer (router + routed experts) at a real model's shape, on one rank
// or spread over ep ranks (threads here), in every execution / EP mode, with the seed
// benchmark's metrics measured rather than assumed.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench_common.h"
#include "bench_layer.h"
#include "backend/device_info.h"
#include "dist/rank_group.h"
#include "moe/ep/ep_backend.h"
#include "moe/errors.h"
#include "moe/router.h"
#include "ops/ops.h"

namespace moe::bench {

namespace {

struct Shape {
  const char* name;
  int64_t experts, hidden, inter, top_k, tokens;
  RouterConfig router;
};

Shape find_shape(const std::string& name) {
  const RouterConfig v3{.num_experts = 256, .top_k = 8, .scoring = RouterScoring::kSigmoid,
                        .groups = GroupRanking::kTop2Sum, .n_group = 8, .topk_group = 4,
                        .correction_bias = true, .renormalize = true, .scaling = 2.5f};
  const Shape shapes[] = {
      {"seed", 8, 512, 1024, 2, 64, softmax_router(8, 2, true)},
      {"qwen3-30b-a3b", 128, 2048, 768, 8, 64, softmax_router(128, 8, true)},
      {"deepseek-v2-lite", 64, 2048, 1408, 6, 64, softmax_router(64, 6, false)},
      {"deepseek-v3", 256, 7168, 2048, 8, 64, v3},
      {"mixtral-8x7b", 8, 4096, 14336, 2, 64, softmax_router(8, 2, true)},
  };
  std::string known;
  for (const auto& s : shapes) {
    if (name == s.name) return s;
    known += (known.empty() ? "" : ", ") + std::string(s.name);
  }
  MOE_THROW(kInvalidArgument, "unknown layer preset '{}' (known: {})", name, known);
}

struct Mode {
  const char* name;
  bool ep;
  dist::EpBackend backend;
  ExecMode exec;
};

const Mode kModes[] = {
    {"dense", false, dist::EpBackend::kLocalAllreduce, ExecMode::kNaive},
    {"ep_padded", true, dist::EpBackend::kAlltoallPadded, ExecMode::kNaive},
    {"ep_packed", true, dist::EpBackend::kAlltoallPacked, ExecMode::kNaive},
    {"ep_grouped", true, dist::EpBackend::kAlltoallPacked, ExecMode::kGrouped},
    {"ep_local_allreduce", true, dist::EpBackend::kLocalAllreduce, ExecMode::kGrouped},
    {"ep_allgather_reducescatter", true, dist::EpBackend::kAllgatherReducescatter, ExecMode::kGrouped},
};

void fill(Tensor& t, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = d(rng);
}

struct Setup {
  Shape shape;
  Tensor x, router, bias;
  ExpertWeights experts;  // all of them; ranks take contiguous blocks (views, no copy)
};

struct Result {
  std::string mode;
  Summary seconds;
  Tensor out;
  EpStats stats;     // summed over ranks, over every call
  uint64_t calls = 0;
  size_t rank0_param_bytes = 0;
  size_t rank0_workspace = 0;
  double rank0_control_s = 0;
};

// One forward of the layer on one rank: router, routing, experts (through `backend` when set).
void layer_step(const Setup& s, const ExpertWeights& mine, const std::vector<int32_t>& local_of,
                ThreadPool& pool, Arena& ws, EpBackend* backend, EpContext* ctx, ExecMode exec,
                ExpertPlan& plan, Tensor& out) {
  ws.reset();
  const int64_t t = s.x.dim(0), k = s.shape.top_k;
  Tensor logits = Tensor::empty(ws, {t, s.shape.experts});
  ops::linear(pool, s.x, s.router, nullptr, logits);
  std::vector<int32_t> ids(static_cast<size_t>(t * k));
  std::vector<float> weights(static_cast<size_t>(t * k));
  route(s.shape.router, logits.data<float>(), s.bias.data<float>(), t, ids.data(), weights.data());
  if (backend)
    ep_moe_forward(*backend, *ctx, exec, mine, plan, s.x, ids.data(), weights.data(), k, out);
  else
    run_experts(exec, pool, ws, mine, local_of, s.x, ids.data(), weights.data(), k, out, plan);
}

ExpertWeights block(const ExpertWeights& all, int64_t first, int64_t n) {
  ExpertWeights w = all;
  w.num_local = n;
  w.gate_up = all.gate_up.rows(first, first + n);
  w.down = all.down.rows(first, first + n);
  return w;
}

Result run_mode(const Setup& s, const Mode& m, int ep, int warmup, int runs, int threads) {
  Result r;
  r.mode = m.name;
  const int64_t t = s.x.dim(0);
  std::vector<double> times;
  const size_t router_bytes = s.router.nbytes() + s.bias.nbytes();
  if (!m.ep) {
    ThreadPool pool(threads);
    Arena ws("workspace", 16 << 20);
    std::vector<int32_t> all(static_cast<size_t>(s.shape.experts));
    for (size_t e = 0; e < all.size(); ++e) all[e] = static_cast<int32_t>(e);
    ExpertPlan plan;
    r.out = Tensor::zeros({t, s.shape.hidden});
    for (int i = 0; i < warmup + runs; ++i) {
      auto t0 = Clock::now();
      layer_step(s, s.experts, all, pool, ws, nullptr, nullptr, m.exec, plan, r.out);
      if (i >= warmup) times.push_back(seconds_since(t0));
    }
    r.rank0_param_bytes = s.experts.bytes() + router_bytes;
    r.rank0_workspace = ws.high_water();
  } else {
    std::vector<EpStats> stats(static_cast<size_t>(ep));
    r.out = Tensor::zeros({t, s.shape.hidden});
    dist::run_ranks(ep, [&](int rank, dist::Communicator& comm) {
      ThreadPool pool(std::max(1, threads / ep));
      Arena ws("workspace", 16 << 20);
      ExpertPlacement placement(s.shape.experts, ep, rank);
      ExpertWeights mine = block(s.experts, placement.first_expert(), placement.num_local());
      auto backend = make_ep_backend(m.backend);
      EpContext ctx{comm, pool, ws, placement, stats[static_cast<size_t>(rank)]};
      ExpertPlan plan;
      Tensor out = rank == 0 ? r.out : Tensor::zeros({t, s.shape.hidden});
      for (int i = 0; i < warmup + runs; ++i) {
        comm.barrier();
        auto t0 = Clock::now();
        layer_step(s, mine, placement.global_to_local(), pool, ws, backend.get(), &ctx, m.exec,
                   plan, out);
        comm.barrier();
        if (rank == 0 && i >= warmup) times.push_back(seconds_since(t0));
      }
      if (rank == 0) {
        r.rank0_param_bytes = mine.bytes() + router_bytes;
        r.rank0_workspace = ws.high_water();
      }
    });
    for (const auto& st : stats) {
      r.stats.dispatch_bytes += st.dispatch_bytes;
      r.stats.combine_bytes += st.combine_bytes;
      r.stats.meta_bytes += st.meta_bytes;
      r.stats.regather_bytes += st.regather_bytes;
    }
    r.calls = stats[0].calls;
    r.rank0_control_s = stats[0].control_seconds;
  }
  r.seconds = summarize(times);
  return r;
}

}  // namespace

int run_layer_bench(const LayerBenchArgs& args) {
  LayerBenchArgs a = args;
  MOE_CHECK(a.device == "auto" || a.device == "cpu" || a.device == "cuda", kInvalidArgument,
            "--device {}: valid devices are auto, cpu and cuda", a.device);
  const size_t gpus = cuda_devices().size();
  // auto: the seed's two ranks on two GPUs where there are two, else the CPU; a model preset on
  // one GPU where there is one.
  if (a.device == "auto") {
    const bool seed = a.preset == "seed";
    a.device = gpus >= (seed && a.ep != 1 ? 2u : 1u) ? "cuda" : "cpu";
  }
  const bool gpu = a.device == "cuda";
  if (a.ep == 0) a.ep = gpu && a.preset != "seed" ? 1 : 2;
  if (a.dtype.empty()) a.dtype = gpu ? "bf16" : "f32";
  MOE_CHECK(a.routing_skew >= 0 && a.routing_skew <= 10, kInvalidArgument,
            "--routing-skew must be in [0, 10], got {}", a.routing_skew);
  MOE_CHECK(a.routing_skew == 0 || (gpu && a.ep == 1), kInvalidArgument,
            "--routing-skew is for the single-GPU CUDA layer bench (--device cuda --ep 1)");
  Shape shape = find_shape(a.preset);
  MOE_CHECK(a.ep >= 1 && a.ep <= shape.experts, kInvalidArgument,
            "--ep {} must be in [1, {}] (the number of experts)", a.ep, shape.experts);
  const bool one_gpu = gpu && a.ep == 1;
  if (a.runs == LayerBenchArgs::kDeviceDefault) a.runs = one_gpu ? 50 : 20;
  if (a.warmup == LayerBenchArgs::kDeviceDefault) a.warmup = one_gpu ? 10 : 3;
  // Over several GPUs run_layer_bench_cuda_ep checks them (it needs a warm-up).
  MOE_CHECK((gpu && !one_gpu) || (a.runs >= 1 && a.warmup >= 0), kInvalidArgument,
            "--runs must be >= 1, --warmup >= 0");
  if (gpu) {
    MOE_CHECK(a.threads == 0, kInvalidArgument, "--threads sets CPU threads: it is for --device cpu");
    if (one_gpu) {
      for (const std::string& path : split_modes(a.modes))
        MOE_CHECK(path == "gemv" || path == "gemm" || path == "wgmma", kInvalidArgument,
                  "--modes {}: the paths of one GPU are gemv, gemm and wgmma", path);
    }
    MOE_CHECK(a.dtype == "bf16" || (a.dtype == "fp8" && a.ep == 1), kUnsupported,
              "--dtype {}: the CUDA experts take bf16, or fp8 (E4M3 in 128 x 128 blocks) on one GPU (--ep 1)",
              a.dtype);
    if (a.ep > 1)
      return run_layer_bench_cuda_ep(a, shape.experts, shape.hidden, shape.inter, shape.top_k,
                                     shape.router, shape.name, shape.tokens);
    return run_layer_bench_cuda(a, shape.experts, shape.hidden, shape.inter, shape.top_k,
                                shape.router, shape.name);
  }
  MOE_CHECK(a.dtype == "f32", kUnsupported,
            "--dtype {}: the CPU reference computes in f32 (bf16 and fp8 run on --device cuda)", a.dtype);
  if (a.tokens > 0) shape.tokens = a.tokens;
  // --modes: exact names, each of them run (none dropped without a word); checked before the
  // layer's weights are drawn.
  const std::vector<std::string> named = split_modes(a.modes);
  for (const std::string& n : named) {
    const Mode* m = std::find_if(std::begin(kModes), std::end(kModes), [&](const Mode& x) { return n == x.name; });
    MOE_CHECK(m != std::end(kModes), kInvalidArgument,
              "--modes {}: the CPU's modes are dense, ep_padded, ep_packed, ep_grouped, ep_local_allreduce and "
              "ep_allgather_reducescatter", n);
    MOE_CHECK(!m->ep || a.ep > 1, kInvalidArgument, "--modes {} runs over --ep ranks: give --ep 2 or more", n);
  }
  const double weight_bytes = 3.0 * shape.experts * shape.hidden * shape.inter * 4;
  const double budget = 0.8 * physical_memory_bytes();
  MOE_CHECK(weight_bytes < budget, kInvalidArgument,
            "the {} layer needs {:.1f} GB of f32 expert weights; this machine has {:.1f} GB of memory",
            shape.name, weight_bytes / 1e9, physical_memory_bytes() / 1e9);
  const int64_t t = shape.tokens, h = shape.hidden, k = shape.top_k, e = shape.experts;
  const int threads = a.threads > 0 ? a.threads : static_cast<int>(std::thread::hardware_concurrency());

  Setup s{shape, Tensor::zeros({t, h}), Tensor::zeros({e, h}), Tensor::zeros({e}), {}};
  fill(s.x, 1, 1.0f);
  fill(s.router, 2, 1.0f / std::sqrt(static_cast<float>(h)));
  fill(s.bias, 3, shape.router.correction_bias ? 0.05f : 0.0f);
  s.experts.num_local = e;
  s.experts.hidden = h;
  s.experts.inter = shape.inter;
  s.experts.gate_up = Tensor::zeros({e, 2 * shape.inter, h});
  s.experts.down = Tensor::zeros({e, h, shape.inter});
  fill(s.experts.gate_up, 4, 0.02f);
  fill(s.experts.down, 5, 0.02f);

  std::vector<Result> results;
  for (const Mode& m : kModes) {
    if (!named.empty() && std::find(named.begin(), named.end(), m.name) == named.end()) continue;
    if (m.ep && a.ep == 1) continue;
    results.push_back(run_mode(s, m, a.ep, a.warmup, a.runs, threads));
  }
  MOE_CHECK(!results.empty(), kInvalidArgument, "--modes '{}' selects nothing", a.modes);
  const Result* dense = nullptr;
  for (const auto& r : results)
    if (r.mode == "dense") dense = &r;

  const uint64_t b = 4;
  const uint64_t ideal = 2ull * t * k * h * b, padded = 2ull * a.ep * t * k * h * b;
  const size_t layer_bytes = s.experts.bytes() + s.router.nbytes() + s.bias.nbytes();
  nlohmann::json doc;
  doc["preset"] = shape.name;
  doc["shape"] = {{"tokens", t}, {"hidden", h}, {"intermediate", shape.inter}, {"experts", e},
                  {"top_k", k}, {"router", shape.router.describe()}};
  doc["ep"] = a.ep;
  doc["dtype"] = a.dtype;
  doc["device"] = a.device;
  doc["threads"] = threads;
  doc["runs"] = a.runs;
  doc["warmup"] = a.warmup;
  doc["ep_ideal_bytes_per_layer"] = ideal;
  doc["ep_padded_bytes_per_layer"] = padded;
  doc["formulas"] = "ideal = 2*T*k*H*b, padded = 2*ep*T*k*H*b, b = 4 (f32)";
  for (const auto& r : results) {
    nlohmann::json j;
    j["tokens_per_s"] = {{"median", t / r.seconds.median}, {"min", t / r.seconds.max},
                         {"max", t / r.seconds.min}};
    j["layer_ms_median"] = r.seconds.median * 1e3;
    double diff = 0;
    if (dense)
      for (int64_t i = 0; i < r.out.numel(); ++i)
        diff = std::max<double>(diff, std::fabs(r.out.data<float>()[i] - dense->out.data<float>()[i]));
    j["max_abs_diff"] = diff;
    j["runtime_resident_bytes"] = r.rank0_param_bytes;  // the packed experts are the only copy
    j["extra_cache_bytes"] = 0;
    j["runtime_resident_ratio"] = static_cast<double>(r.rank0_param_bytes) / layer_bytes;
    j["workspace_bytes"] = r.rank0_workspace;
    if (r.calls > 0) {
      j["measured_bytes_per_layer"] = (r.stats.dispatch_bytes + r.stats.combine_bytes) / r.calls;
      j["meta_bytes_per_layer"] = r.stats.meta_bytes / r.calls;
      j["regather_bytes_per_layer"] = r.stats.regather_bytes / r.calls;
      j["shard_ratio"] = static_cast<double>(r.rank0_param_bytes) / layer_bytes;
      double control_ms = r.rank0_control_s / r.calls * 1e3;
      j["control_plane_ms"] = control_ms;
      j["control_plane_share"] = control_ms / (r.seconds.median * 1e3);
    }
    doc["modes"][r.mode] = j;
  }
  if (a.json) {
    std::printf("%s\n", doc.dump(2).c_str());
    return 0;
  }
  std::printf("moe-bench layer %s: T=%lld H=%lld I=%lld E=%lld k=%lld, router %s\n", shape.name,
              (long long)t, (long long)h, (long long)shape.inter, (long long)e, (long long)k,
              shape.router.describe().c_str());
  std::printf("ep=%d (ranks are threads), %s on %s, %d threads, median of %d runs after %d warm-up\n",
              a.ep, a.dtype.c_str(), a.device.c_str(), threads, a.runs, a.warmup);
  std::printf("ep_ideal_bytes_per_layer = 2*T*k*H*b = %llu; ep_padded_bytes_per_layer = 2*ep*T*k*H*b = %llu (b = 4)\n",
              (unsigned long long)ideal, (unsigned long long)padded);
  std::printf("%-27s %12s %12s %12s %10s %14s %10s %9s %11s %12s\n", "mode", "tok/s", "min", "max",
              "layer ms", "bytes/layer", "shard", "ctrl ms", "ctrl share", "max|diff|");
  for (const auto& r : results) {
    const auto& j = doc["modes"][r.mode];
    std::string bytes = j.contains("measured_bytes_per_layer") ? std::to_string(j["measured_bytes_per_layer"].get<uint64_t>()) : "-";
    std::string shard = j.contains("shard_ratio") ? fmt::format("{:.4f}", j["shard_ratio"].get<double>()) : "1";
    std::string ctrl = j.contains("control_plane_ms") ? fmt::format("{:.4f}", j["control_plane_ms"].get<double>()) : "-";
    std::string share = j.contains("control_plane_share") ? fmt::format("{:.4f}", j["control_plane_share"].get<double>()) : "-";
    std::printf("%-27s %12.1f %12.1f %12.1f %10.3f %14s %10s %9s %11s %12.3g\n", r.mode.c_str(),
                t / r.seconds.median, t / r.seconds.max, t / r.seconds.min, r.seconds.median * 1e3,
                bytes.c_str(), shard.c_str(), ctrl.c_str(), share.c_str(), j["max_abs_diff"].get<double>());
  }
  for (const auto& r : results) {
    const auto& j = doc["modes"][r.mode];
    std::printf("%s_runtime_resident_bytes = %zu (ratio %.4f; extra caches 0: the packed experts are the only copy; workspace %zu)\n",
                r.mode.c_str(), r.rank0_param_bytes, j["runtime_resident_ratio"].get<double>(), r.rank0_workspace);
  }
  return 0;
}

}  // namespace moe::bench
