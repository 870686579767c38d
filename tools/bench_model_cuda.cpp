// moe-bench model --device cuda: the whole model on one GPU. Prefill runs each sequence's
// prompt eagerly; decode replays the CUDA graph of the batch's bucket. Each figure is printed
// beside its floor: decode by the bytes a step must read at the copy bandwidth, prefill by its
// FLOPs at the bf16 matmul rate, both ceilings measured on the device before the run.
#include <chrono>
#include <cmath>
#include <algorithm>
#include <cstdio>
#include <random>

#include <nlohmann/json.hpp>

#include "backend/cuda_engine.h"
#include "backend/device_info.h"
#include "bench_common.h"
#include "bench_model.h"
#include "model/model.h"
#include "model/step_reads.h"
#include "moe/errors.h"

namespace moe::bench {
namespace {

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

struct DecodeRun {
  cuda::OpProfile profile;
  int batch = 0;
  double prefill_s = 0, capture_s = 0, step_s = 0;
  int steps = 0;
};

int run_model_bench_cuda(const ModelBenchArgs& a, const std::string& dir) {
  const dist::EpBackend backend = cuda::engine_ep_backend(a.ep_backend);
  cuda::check_engine_dp(a.dp, a.tp, a.ep, backend);
  MOE_CHECK(!a.profile || a.dp == 1, kUnsupported,
            "--profile --dp {}: a profiled step records GPU 0's routing, which under dp covers its own "
            "sequences only, so its floor would be wrong; profile without --dp",
            a.dp);
  std::vector<int> batches = a.batches.empty() ? std::vector<int>{a.batch} : a.batches;
  for (int b : batches) MOE_CHECK(b >= 1, kInvalidArgument, "batch sizes must be >= 1, got {}", b);
  MOE_CHECK(a.prefill_len >= 0, kInvalidArgument, "--prefill-len must be >= 0");
  ModelConfig mc = load_model_config(dir);
  cuda::EngineOptions eo;
  eo.random_weights = a.random_weights;
  eo.progress = true;
  eo.fuse = !a.no_fuse;
  eo.tp = a.tp;
  eo.ep = a.ep;
  eo.ep_backend = backend;
  eo.dp = a.dp;
  const int ranks = cuda::engine_ranks(a.tp, a.ep, a.dp);
  // Under dp max_batch is per attention group, and open() spreads the batch evenly.
  eo.max_batch = (*std::max_element(batches.begin(), batches.end()) + a.dp - 1) / a.dp;
  eo.max_context = std::max(a.input_len + a.output_len + 2, a.prefill_len);
  eo.max_step_tokens = std::min(std::max(a.input_len, a.prefill_len), 8192);
  MOE_CHECK(eo.max_context <= mc.max_position_embeddings, kInvalidArgument,
            "input + output ({}) exceed the model's context of {}", eo.max_context, mc.max_position_embeddings);
  const auto devices = cuda_devices();
  MOE_CHECK(!devices.empty(), kUnsupported, "--device cuda: {}", cuda_status());
  MOE_CHECK(static_cast<int>(devices.size()) >= ranks, kUnsupported, "--tp {} --ep {} needs {} GPUs; this machine has {}",
            a.tp, a.ep, ranks, devices.size());
  const std::string device_name = devices.at(0).name;
  std::string where = ranks > 1 ? std::to_string(ranks) + " x " + device_name : device_name;
  if (a.dp > 1)
    where += ", data-parallel attention (" + std::to_string(a.dp) + " groups of " + std::to_string(a.tp) + " GPU" +
             (a.tp > 1 ? "s)" : ")");
  // The ceilings of the floors, measured on this device before the model takes its memory.
  const double kCopyBytesPerS = measure_copy_bandwidth(eo.device);
  const double kBf16FlopsPerS = measure_bf16_matmul_rate(eo.device);
  auto tl = std::chrono::steady_clock::now();
  auto engine = cuda::Engine::load(dir, eo);
  const double load_s = since(tl);

  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(mc.vocab_size - 1));
  auto prompt = [&](int n) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (auto& t : p) t = pick(rng);
    return p;
  };
  {  // warm-up, so that library set-up is not timed as prefill
    const int32_t s = engine->open();
    engine->prefill(s, prompt(a.input_len), SamplingParams{});
    engine->close(s);
  }
  double long_prefill_s = 0;
  cuda::OpProfile prefill_profile;
  if (a.prefill_len > 0) {
    // The first prompt of this length sets up its own library plans and kernel paths: untimed.
    // Then the median of three.
    auto p = prompt(a.prefill_len);
    std::vector<double> times;
    for (int rep = 0; rep < 4; ++rep) {
      const int32_t s = engine->open();
      auto t0 = std::chrono::steady_clock::now();
      engine->prefill(s, p, SamplingParams{});
      if (rep > 0) times.push_back(since(t0));
      engine->close(s);
    }
    std::sort(times.begin(), times.end());
    long_prefill_s = times[times.size() / 2];
    if (a.profile) {  // once more, timed per operation
      const int32_t again = engine->open();
      engine->prefill(again, p, SamplingParams{}, nullptr, false, &prefill_profile);
      engine->close(again);
    }
  }
  std::vector<DecodeRun> runs;
  for (int batch : batches) {
    DecodeRun r;
    r.batch = batch;
    std::vector<int32_t> seqs, tokens;
    for (int b = 0; b < batch; ++b) {
      auto p = prompt(a.input_len);
      seqs.push_back(engine->open());
      auto t0 = std::chrono::steady_clock::now();
      tokens.push_back(engine->prefill(seqs.back(), p, SamplingParams{}));
      r.prefill_s += since(t0);
    }
    std::vector<SamplingParams> greedy(static_cast<size_t>(batch));
    double decode_s = 0;
    for (int step = 0; step < a.output_len; ++step) {
      auto t0 = std::chrono::steady_clock::now();
      tokens = engine->decode(seqs, tokens, greedy);
      if (step == 0) {
        r.capture_s = since(t0);  // the bucket's graph is captured on first use
      } else {
        decode_s += since(t0);
        ++r.steps;
      }
    }
    r.step_s = r.steps > 0 ? decode_s / r.steps : 0.0;
    if (a.profile) tokens = engine->decode(seqs, tokens, greedy, &r.profile);
    for (int32_t s : seqs) engine->close(s);
    runs.push_back(r);
  }

  // Floors. Decode: every fixed weight once per step, the distinct experts the batch's tokens
  // touch (expected count under uniform routing) and the KV cache, at the copy bandwidth.
  // Prefill: 2 FLOPs per active parameter per token plus causal attention, at the matmul rate.
  // On several GPUs the floor is GPU 0's share, which reads the most (model/step_reads.h); under
  // dp its experts see every GPU's tokens but its cache holds only its own sequences.
  const StepReads rc = step_reads(mc, a.tp, a.ep);
  const double e = static_cast<double>(std::max<int64_t>(mc.moe.num_experts, 1));
  const double k = static_cast<double>(mc.moe.top_k);
  const double moe_layers = static_cast<double>(mc.num_moe_layers());
  const double kv_token_bytes = rc.kv_token_bytes;
  auto decode_floor = [&](int batch, double* bytes) {
    const double touched = mc.moe.num_experts > 0 ? e * (1.0 - std::pow(1.0 - k / e, batch)) : 0.0;
    const double context = a.input_len + a.output_len / 2.0;
    const double own = std::ceil(static_cast<double>(batch) / a.dp);
    *bytes = rc.fixed_bytes + touched * rc.per_expert_bytes * moe_layers + own * context * kv_token_bytes;
    return *bytes / kCopyBytesPerS;
  };
  const double active = rc.fixed + k * rc.per_expert * moe_layers;
  auto prefill_flops = [&](int n) {
    return 2.0 * active * n + 2.0 * rc.attention_width * static_cast<double>(n) * static_cast<double>(n + 1);
  };
  // With a profile, the experts the step really touched (random weights do not route
  // uniformly): the floor of that step.
  auto routed_floor = [&](const DecodeRun& r, double* bytes) {
    double touched = 0;
    for (int t : r.profile.experts_touched) touched += t;
    const double context = a.input_len + a.output_len;
    *bytes = rc.fixed_bytes + touched * rc.per_expert_bytes + r.batch * context * kv_token_bytes;
    return *bytes / kCopyBytesPerS;
  };
  const cuda::MemoryReport mem = engine->memory();

  nlohmann::json doc;
  doc["model"] = dir;
  doc["architecture"] = mc.architecture;
  doc["random_weights"] = a.random_weights;
  doc["fused"] = !a.no_fuse;
  doc["parameters"] = parameter_count(mc);
  doc["weight_format"] = mc.quant.weight_format().name();
  doc["device"] = device_name;
  doc["gpus"] = ranks;
  doc["tp"] = a.tp;
  doc["ep"] = a.ep;
  doc["ep_backend"] = a.ep_backend;
  doc["dp"] = a.dp;
  doc["copy_bytes_per_s"] = kCopyBytesPerS;
  doc["bf16_matmul_flops_per_s"] = kBf16FlopsPerS;
  doc["input_len"] = a.input_len;
  doc["output_len"] = a.output_len;
  doc["load_s"] = load_s;
  doc["weights_bytes"] = mem.weights;
  doc["kv_cache_bytes"] = mem.kv_cache;
  doc["kv_blocks"] = mem.kv_blocks;
  doc["workspace_bytes"] = mem.workspace;
  doc["graph_output_bytes"] = mem.graph_outputs;
  const std::vector<cuda::MemoryReport> per_gpu = engine->memory_per_gpu();
  size_t fullest = 0;  // the GPU with the most bytes
  auto bytes_of = [](const cuda::MemoryReport& m) { return m.weights + m.kv_cache + m.workspace + m.graph_outputs; };
  for (size_t g = 0; g < per_gpu.size(); ++g) {
    const cuda::MemoryReport& m = per_gpu[g];
    doc["gpu_memory"].push_back({{"weights_bytes", m.weights}, {"kv_cache_bytes", m.kv_cache},
                                 {"workspace_bytes", m.workspace}, {"graph_output_bytes", m.graph_outputs}});
    if (bytes_of(m) > bytes_of(per_gpu[fullest])) fullest = g;
  }
  if (a.prefill_len > 0) {
    doc["prefill_len"] = a.prefill_len;
    doc["prefill_len_tokens_per_s"] = a.prefill_len / long_prefill_s;
    doc["prefill_len_tflops"] = prefill_flops(a.prefill_len) / long_prefill_s / 1e12;
    doc["prefill_len_floor_tokens_per_s"] = a.prefill_len / (prefill_flops(a.prefill_len) / kBf16FlopsPerS);
    for (const auto& [op, sec] : prefill_profile.seconds) doc["prefill_len_profile_ms"][op] = sec * 1e3;
  }
  for (const DecodeRun& r : runs) {
    double bytes = 0;
    const double floor_s = decode_floor(r.batch, &bytes);
    nlohmann::json j;
    j["batch"] = r.batch;
    j["prefill_tokens_per_s"] = r.batch * a.input_len / r.prefill_s;
    j["decode_tokens_per_s"] = r.step_s > 0 ? r.batch / r.step_s : 0.0;
    j["decode_step_ms"] = r.step_s * 1e3;
    j["decode_floor_step_ms"] = floor_s * 1e3;
    j["decode_step_gb"] = bytes / 1e9;
    j["decode_fraction_of_floor_speed"] = r.step_s > 0 ? floor_s / r.step_s : 0.0;
    j["graph_capture_ms"] = r.capture_s * 1e3;
    j["timed_steps"] = r.steps;
    for (const auto& [op, sec] : r.profile.seconds) j["profile_ms"][op] = sec * 1e3;
    if (!r.profile.experts_touched.empty()) {
      double routed_bytes = 0;
      j["profile_floor_step_ms"] = routed_floor(r, &routed_bytes) * 1e3;
      j["profile_step_gb"] = routed_bytes / 1e9;
      j["profile_experts_touched"] = r.profile.experts_touched;
    }
    doc["runs"].push_back(j);
  }
  if (a.json) {
    std::printf("%s\n", doc.dump(2).c_str());
    return 0;
  }
  std::printf("moe-bench model %s (%s%s), %.3f B parameters, %s weights, bf16 activations on %s (measured: copy "
              "%.2f TB/s, bf16 matmul %.0f TFLOP/s)\n", dir.c_str(), mc.architecture.c_str(),
              a.random_weights ? ", random weights" : "", parameter_count(mc) / 1e9,
              mc.quant.weight_format().name().c_str(), where.c_str(), kCopyBytesPerS / 1e12, kBf16FlopsPerS / 1e12);
  std::printf("load %.2f s; device memory: weights %.2f GB, KV cache %.2f GB (%lld blocks), "
              "workspace %.2f GB, graph outputs %.3f GB\n", load_s, mem.weights / 1e9,
              mem.kv_cache / 1e9, (long long)mem.kv_blocks, mem.workspace / 1e9, mem.graph_outputs / 1e9);
  if (per_gpu.size() > 1) {
    const cuda::MemoryReport& m = per_gpu[fullest];
    const int at = eo.device + static_cast<int>(fullest);
    size_t capacity = 0;
    for (const GpuInfo& g : devices)
      if (g.index == at) capacity = g.memory_bytes;
    std::printf("  the fullest GPU (%d of %zu): weights %.2f GB, KV cache %.2f GB, workspace %.2f GB, graph outputs "
                "%.3f GB: %.2f GB of its %.2f GB\n", at, per_gpu.size(), m.weights / 1e9, m.kv_cache / 1e9,
                m.workspace / 1e9, m.graph_outputs / 1e9, bytes_of(m) / 1e9, capacity / 1e9);
  }
  if (a.prefill_len > 0) {
    const double f = prefill_flops(a.prefill_len);
    std::printf("prefill of %d tokens: %.1f tok/s (%.1f ms, %.1f TFLOP/s); compute floor %.1f tok/s "
                "at %.0f TFLOP/s\n", a.prefill_len, a.prefill_len / long_prefill_s, long_prefill_s * 1e3,
                f / long_prefill_s / 1e12, a.prefill_len / (f / kBf16FlopsPerS), kBf16FlopsPerS / 1e12);
    if (!prefill_profile.seconds.empty()) {
      std::printf("  per operation, %.3f ms of device time:", prefill_profile.total * 1e3);
      for (const auto& [op, sec] : prefill_profile.seconds) std::printf(" %s %.3f;", op.c_str(), sec * 1e3);
      std::printf("\n");
    }
  }
  for (const DecodeRun& r : runs) {
    double bytes = 0;
    const double floor_s = decode_floor(r.batch, &bytes);
    std::printf("batch %3d: prefill %.1f tok/s (%d x %d) | decode %.1f tok/s, %.3f ms/step; floor "
                "%.3f ms (%.2f GB at %.2f TB/s): %.0f%% of the floor's speed | capture %.1f ms\n",
                r.batch, r.batch * a.input_len / r.prefill_s, r.batch, a.input_len,
                r.step_s > 0 ? r.batch / r.step_s : 0.0, r.step_s * 1e3, floor_s * 1e3, bytes / 1e9,
                kCopyBytesPerS / 1e12, r.step_s > 0 ? 100.0 * floor_s / r.step_s : 0.0, r.capture_s * 1e3);
    if (!r.profile.seconds.empty()) {
      double routed_bytes = 0;
      const double f = routed_floor(r, &routed_bytes);
      double touched = 0;
      for (int t : r.profile.experts_touched) touched += t;
      std::printf("  profiled step: %.1f experts per MoE layer touched (uniform routing: %.1f), so "
                  "%.2f GB and a floor of %.3f ms: the timed steps ran at %.0f%% of its speed\n",
                  touched / std::max(1.0, moe_layers), mc.moe.num_experts > 0 ? e * (1.0 - std::pow(1.0 - k / e, r.batch)) : 0.0,
                  routed_bytes / 1e9, f * 1e3, r.step_s > 0 ? 100.0 * f / r.step_s : 0.0);
      std::printf("  the step as a graph with events between operations, %.3f ms of device time:", r.profile.total * 1e3);
      for (const auto& [op, sec] : r.profile.seconds) std::printf(" %s %.3f;", op.c_str(), sec * 1e3);
      std::printf("\n");
    }
  }
  return 0;
}

}  // namespace moe::bench
