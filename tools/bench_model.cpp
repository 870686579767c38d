// moe-bench model: prefill and decode throughput of a whole model (a checkpoint, or a preset's
// real shapes with random weights) for a batch of sequences.
#include <cstdio>
#include <mutex>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "bench_common.h"
#include "bench_model.h"
#include "dist/rank_group.h"
#include "model/model.h"
#include "moe/ep/ep_backend.h"
#include "moe/errors.h"

namespace moe::bench {

int run_model_bench(const ModelBenchArgs& args) {
  ModelBenchArgs a = args;
  MOE_CHECK(a.device == "cpu" || a.device == "cuda", kInvalidArgument,
            "--device {}: expected cpu or cuda", a.device);
  // Each option either does what it says on the device chosen or is refused.
  if (a.device == "cuda") {
    MOE_CHECK(a.threads == 0, kInvalidArgument, "--threads sets CPU threads: it is for --device cpu");
    MOE_CHECK(a.exec.empty(), kInvalidArgument,
              "--exec {}: the CPU's expert execution (naive | grouped); --device cuda picks its kernels itself",
              a.exec);
    MOE_CHECK(a.batch == ModelBenchArgs::kUnset || a.batches.empty(), kInvalidArgument,
              "give --batch or --batches, not both");
  } else {
    MOE_CHECK(a.batches.empty(), kInvalidArgument, "--batches is for --device cuda (on the CPU: --batch)");
    MOE_CHECK(a.prefill_len == 0, kInvalidArgument, "--prefill-len is for --device cuda");
    MOE_CHECK(!a.profile, kInvalidArgument, "--profile is for --device cuda");
    MOE_CHECK(!a.no_fuse, kInvalidArgument, "--no-fuse is for --device cuda");
  }
  if (a.batch == ModelBenchArgs::kUnset) a.batch = 1;
  if (a.exec.empty()) a.exec = "grouped";
  MOE_CHECK(a.model_dir.empty() != a.preset.empty(), kInvalidArgument,
            "give exactly one of -m DIR and --preset NAME");
  const std::string dir = a.preset.empty() ? a.model_dir : preset_dir(a.preset);
  MOE_CHECK(a.preset.empty() || a.random_weights, kInvalidArgument,
            "presets hold no weights: add --random-weights");
  if (a.device == "cuda") {
    MOE_CHECK(a.batch >= 1 && a.input_len >= 1 && a.output_len >= 0, kInvalidArgument,
              "--batch and --input-len must be >= 1, --output-len >= 0");
    return run_model_bench_cuda(a, dir);
  }
  MOE_CHECK(a.batch >= 1 && a.input_len >= 1 && a.output_len >= 0, kInvalidArgument,
            "--batch and --input-len must be >= 1, --output-len >= 0");
  MOE_CHECK(a.tp == 1, kUnsupported, "--tp {}: tensor-parallel attention runs on GPUs only (--device cuda)", a.tp);
  MOE_CHECK(a.dp == 1, kUnsupported, "--dp {}: data-parallel attention runs on GPUs only (--device cuda)", a.dp);
  dist::DistConfig dc;
  dc.ep = a.ep;
  dc.ep_backend = a.ep_backend;
  dist::validate_dist_config(dc);
  ModelConfig mc = load_model_config(dir);
  if (a.ep > 1) dist::validate_ep_for_model(dc, mc.moe.num_experts);
  const double need = static_cast<double>(parameter_count(mc)) * 4;
  MOE_CHECK(need < 0.8 * physical_memory_bytes(), kInvalidArgument,
            "{} needs {:.1f} GB as f32; this machine has {:.1f} GB of memory", mc.architecture,
            need / 1e9, physical_memory_bytes() / 1e9);
  const int threads = a.threads > 0 ? a.threads : static_cast<int>(std::thread::hardware_concurrency());

  LoadOptions base;
  base.random_weights = a.random_weights;
  base.exec = parse_exec_mode(a.exec);
  base.ep_backend = dist::parse_ep_backend(a.ep_backend);
  base.threads = std::max(1, threads / a.ep);
  base.progress = true;

  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(mc.vocab_size - 1));
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(a.batch));
  for (auto& p : prompts)
    for (int i = 0; i < a.input_len; ++i) p.push_back(pick(rng));

  double load_s = 0, prefill_s = 0, decode_s = 0;
  size_t weight_bytes = 0, kv_bytes = 0;
  auto job = [&](Model& model, bool first) {
    std::vector<KvCache> caches;
    for (int b = 0; b < a.batch; ++b) caches.push_back(model.new_cache(a.input_len + a.output_len));
    std::vector<SequenceInput> batch;
    for (int b = 0; b < a.batch; ++b) batch.push_back({prompts[static_cast<size_t>(b)], &caches[static_cast<size_t>(b)], false});
    auto t0 = Clock::now();
    std::vector<Tensor> logits = model.forward_batch(batch);
    double p = seconds_since(t0);
    std::vector<std::vector<int32_t>> next(static_cast<size_t>(a.batch), std::vector<int32_t>(1));
    auto t1 = Clock::now();
    for (int step = 0; step < a.output_len; ++step) {
      for (int b = 0; b < a.batch; ++b) {  // greedy
        const float* row = logits[static_cast<size_t>(b)].data<float>();
        next[static_cast<size_t>(b)][0] = static_cast<int32_t>(std::max_element(row, row + mc.vocab_size) - row);
        batch[static_cast<size_t>(b)].ids = next[static_cast<size_t>(b)];
      }
      logits = model.forward_batch(batch);
    }
    double d = seconds_since(t1);
    if (first) {
      prefill_s = p;
      decode_s = d;
      weight_bytes = model.weight_bytes();
      for (const auto& c : caches) kv_bytes += c.bytes();
    }
  };
  auto tl = Clock::now();
  if (a.ep == 1) {
    auto model = Model::load(dir, base);
    load_s = seconds_since(tl);
    job(*model, true);
  } else {
    dist::run_ranks(a.ep, [&](int rank, dist::Communicator& comm) {
      LoadOptions lo = base;
      lo.comm = &comm;
      lo.progress = rank == 0;
      auto model = Model::load(dir, lo);
      if (rank == 0) load_s = seconds_since(tl);
      job(*model, rank == 0);
    });
  }
  const double prefill_tps = a.batch * a.input_len / prefill_s;
  const double decode_tps = a.output_len > 0 ? a.batch * a.output_len / decode_s : 0.0;
  nlohmann::json doc;
  doc["model"] = dir;
  doc["architecture"] = mc.architecture;
  doc["random_weights"] = a.random_weights;
  doc["parameters"] = parameter_count(mc);
  doc["batch"] = a.batch;
  doc["input_len"] = a.input_len;
  doc["output_len"] = a.output_len;
  doc["ep"] = a.ep;
  doc["ep_backend"] = a.ep_backend;
  doc["exec"] = a.exec;
  doc["threads"] = threads;
  doc["device"] = a.device;
  doc["load_s"] = load_s;
  doc["prefill_tokens_per_s"] = prefill_tps;
  doc["prefill_s"] = prefill_s;
  doc["decode_tokens_per_s"] = decode_tps;
  doc["decode_step_ms"] = a.output_len > 0 ? decode_s / a.output_len * 1e3 : 0.0;
  doc["weight_bytes_rank0"] = weight_bytes;
  doc["kv_cache_bytes_rank0"] = kv_bytes;
  if (a.json) {
    std::printf("%s\n", doc.dump(2).c_str());
    return 0;
  }
  std::printf("moe-bench model %s (%s%s), %.3f B parameters, ep=%d %s, exec %s, %d threads on %s\n",
              dir.c_str(), mc.architecture.c_str(), a.random_weights ? ", random weights" : "",
              parameter_count(mc) / 1e9, a.ep, a.ep_backend.c_str(), a.exec.c_str(), threads,
              a.device.c_str());
  std::printf("batch %d, input %d, output %d; load %.2f s; weights %.2f GB f32, KV cache %.1f MB\n",
              a.batch, a.input_len, a.output_len, load_s, weight_bytes / 1e9, kv_bytes / 1e6);
  std::printf("prefill: %.1f tok/s (%.3f s)\n", prefill_tps, prefill_s);
  std::printf("decode:  %.1f tok/s (%.2f ms per step of %d tokens)\n", decode_tps,
              a.output_len > 0 ? decode_s / a.output_len * 1e3 : 0.0, a.batch);
  return 0;
}

}  // namespace moe::bench
