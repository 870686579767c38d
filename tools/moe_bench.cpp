// moe-bench: measured throughput of one MoE layer (`layer`) or a whole model (`model`).
#include <CLI/CLI.hpp>

#include "bench_layer.h"
#include "bench_model.h"
#include "cli_common.h"

int main(int argc, char** argv) {
  CLI::App app{"moe-bench: MoE layer and model benchmarks"};
  app.require_subcommand(1);

  moe::bench::LayerBenchArgs la;
  auto* layer = app.add_subcommand(
      "layer", "one MoE layer in every mode (default: the seed workload, 64 tokens, H 512, I 1024, 8 experts, top-2, ep 2)");
  layer->add_option("--preset", la.preset, "seed | qwen3-30b-a3b | deepseek-v2-lite | deepseek-v3 | mixtral-8x7b")->capture_default_str();
  layer->add_option("--tokens", la.tokens, "tokens per forward (default: the seed's 64; for a model preset on cuda a sweep)");
  layer->add_option("--ep", la.ep, "expert-parallel ranks: threads on cpu, GPUs on cuda (default: 2 for the seed and on cpu, else 1)");
  layer->add_option("--dtype", la.dtype, "f32 (cpu) | bf16, fp8 (cuda); default: the device's");
  layer->add_option("--device", la.device, "auto | cpu | cuda (auto: cuda when the GPUs are there)")->capture_default_str();
  layer->add_option("--runs", la.runs, "timed runs (default: 20; on one GPU 50 graph replays)");
  layer->add_option("--warmup", la.warmup, "untimed runs first (default: 3; on one GPU 10)");
  layer->add_option("--threads", la.threads, "cpu: threads in all (0: all)");
  layer->add_option("--modes", la.modes,
                    "comma-separated subset of the modes (on one GPU the expert paths: gemv, gemm, wgmma)");
  layer->add_option("--routing-skew", la.routing_skew,
                    "cuda, one GPU: bias expert e's router logits by S*sin(12.9898*e), 0 to 10 (0: uniform)");
  layer->add_flag("--json", la.json, "print one JSON document");

  moe::bench::ModelBenchArgs ma;
  auto* model = app.add_subcommand("model", "prefill and decode tokens/s of a whole model");
  model->add_option("-m,--model", ma.model_dir, "Hugging Face model directory");
  model->add_option("--preset", ma.preset, "a directory under presets/ (real shapes, no weights)");
  model->add_flag("--random-weights", ma.random_weights, "random weights of the config's shapes");
  model->add_option("--batch", ma.batch, "sequences per forward (default 1; cuda: or --batches)");
  model->add_option("--input-len", ma.input_len, "prompt tokens per sequence")->capture_default_str();
  model->add_option("--output-len", ma.output_len, "generated tokens per sequence")->capture_default_str();
  model->add_option("--threads", ma.threads, "cpu: threads in all (0: all)");
  moe::cli::add_parallel_flags(model, {&ma.ep, &ma.tp, &ma.dp, &ma.ep_backend});
  model->add_option("--exec", ma.exec, "cpu: naive | grouped (default grouped)");
  model->add_option("--device", ma.device, "cpu | cuda")->capture_default_str();
  model->add_option("--batches", ma.batches, "cuda: decode batch sizes on one loaded model, e.g. 1,8,64 (spread over the GPUs under --dp)")
      ->delimiter(',');
  model->add_option("--prefill-len", ma.prefill_len, "cuda: also time prompts of N tokens alone (median of 3, after one untimed)");
  model->add_flag("--profile", ma.profile, "cuda: time one eager decode step per operation");
  model->add_flag("--no-fuse", ma.no_fuse, "cuda: run every operation as its own kernel (for comparisons)");
  model->add_flag("--json", ma.json, "print one JSON document");

  if (const int rc = moe::cli::parse_args(app, argc, argv); rc >= 0) return rc;
  return moe::cli::guarded([&] {
    if (*layer) return moe::bench::run_layer_bench(la);
    return moe::bench::run_model_bench(ma);
  });
}
