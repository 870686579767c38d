// moe-cli: generate text, dump logits, tokenize and inspect a Hugging Face MoE checkpoint.
#include <unistd.h>

#include <chrono>
#include <thread>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "backend/cpu/cpu_executor.h"
#include "backend/cuda_engine.h"
#include "backend/device_info.h"
#include "cli_common.h"
#include "dist/dist_config.h"
#include "text/chat_template.h"
#include "io/checkpoint.h"
#include "text/tokenizer.h"
#include "model/model.h"
#include "model/step_reads.h"
#include "moe/errors.h"
#include "runtime/sampler.h"

namespace fs = std::filesystem;
using namespace moe;

namespace {

struct Common {
  std::string model_dir;
  std::string tokenizer;
  int threads = 0;
  bool random_weights = false;
  static constexpr uint64_t kNoSeed = ~uint64_t{0};
  uint64_t weights_seed = kNoSeed;  // 0 unless given, with --random-weights only
  int ep = 1;
  int tp = 1;
  int dp = 1;
  std::string ep_backend = "local_allreduce";
  std::string exec;  // cpu only; empty: grouped
  bool expert_stats = false;
  std::string device = "cpu";
  int max_batch = 1;

  uint64_t seed() const { return weights_seed == kNoSeed ? 0 : weights_seed; }

  bool on_cuda() const {
    MOE_CHECK(device == "cpu" || device == "cuda", kInvalidArgument,
              "--device {}: expected cpu or cuda", device);
    MOE_CHECK(random_weights || weights_seed == kNoSeed, kInvalidArgument,
              "--weights-seed draws --random-weights: without them the checkpoint's weights are read");
    if (device == "cpu") {
      MOE_CHECK(tp == 1, kUnsupported, "--tp {}: tensor-parallel attention runs on GPUs only (--device cuda)", tp);
      MOE_CHECK(dp == 1, kUnsupported, "--dp {}: data-parallel attention runs on GPUs only (--device cuda)", dp);
      return false;
    }
    // An unknown name (the valid ones listed), then dp against the other degrees.
    cuda::check_engine_dp(dp, tp, ep, cuda::engine_ep_backend(ep_backend));
    MOE_CHECK(!expert_stats, kUnsupported, "--expert-stats is CPU-only so far");
    MOE_CHECK(threads == 0, kInvalidArgument, "--threads sets CPU threads: it is for --device cpu");
    MOE_CHECK(exec.empty(), kInvalidArgument,
              "--exec {}: the CPU's expert execution (naive | grouped); --device cuda picks its kernels itself", exec);
    return true;
  }

  // What generate and logits run on, for one sequence of up to `context` tokens: the CUDA
  // engine, or the CPU model as --ep rank threads (`cpu_out` then points at it). The parallel
  // settings are checked before any weight is read.
  std::unique_ptr<runtime::Executor> load_executor(int64_t context, int64_t sampled_vocab,
                                                   cpu::Executor** cpu_out = nullptr) const {
    if (on_cuda()) {
      cuda::EngineOptions eo;
      eo.progress = true;
      eo.random_weights = random_weights;
      eo.seed = seed();
      eo.max_batch = max_batch;
      eo.max_context = context;
      eo.sampled_vocab = sampled_vocab;
      eo.tp = tp;
      eo.ep = ep;
      eo.dp = dp;
      eo.ep_backend = cuda::engine_ep_backend(ep_backend);
      return cuda::Engine::load(model_dir, eo);
    }
    LoadOptions lo;
    lo.threads = threads;
    lo.progress = true;
    lo.random_weights = random_weights;
    lo.seed = seed();
    lo.exec = parse_exec_mode(exec.empty() ? "grouped" : exec);
    lo.ep_backend = dist::parse_ep_backend(ep_backend);
    // One block as long as the context: the cache is as contiguous as a plain array.
    cpu::ExecutorOptions xo;
    xo.max_context = std::max<int64_t>(context, 2);
    xo.block_size = xo.max_context;
    xo.kv_blocks = max_batch;
    xo.max_sequences = max_batch;
    xo.sampled_vocab = sampled_vocab;
    xo.prefix_reuse = false;
    auto x = cpu::Executor::load(model_dir, lo, ep, xo);
    if (cpu_out) *cpu_out = x.get();
    return x;
  }

  static void print_expert_stats(Model& model) {
    const auto& stats = model.expert_tokens();
    for (size_t l = 0; l < stats.size(); ++l) {
      if (stats[l].empty()) continue;
      std::string line = fmt::format("expert tokens, layer {}:", l);
      for (int64_t n : stats[l]) line += fmt::format(" {}", n);
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  }
};

// How the model runs: only the commands that load one take them.
void add_parallel_flags(CLI::App* cmd, Common& c) {
  cmd->add_option("-t,--threads", c.threads, "cpu: threads (0: all)")->check(CLI::NonNegativeNumber);
  moe::cli::add_parallel_flags(cmd, {&c.ep, &c.tp, &c.dp, &c.ep_backend});
  cmd->add_option("--exec", c.exec, "cpu: routed-expert execution, naive | grouped (default grouped)");
  cmd->add_flag("--expert-stats", c.expert_stats, "print tokens per expert per layer on stderr");
  cmd->add_option("--device", c.device, "cpu | cuda (bf16; --ep N --tp N: N GPUs)")->capture_default_str();
}

void add_weight_flags(CLI::App* cmd, Common& c) {
  cmd->add_flag("--random-weights", c.random_weights,
                "ignore the checkpoint: random weights of the config's shapes");
  cmd->add_option("--weights-seed", c.weights_seed, "seed of --random-weights (default 0)");
}

void add_common(CLI::App* cmd, Common& c, bool tokenizer) {
  cmd->add_option("-m,--model", c.model_dir, "Hugging Face model directory")->required();
  if (tokenizer)
    cmd->add_option("--tokenizer", c.tokenizer, "tokenizer.json (default: the model directory's)");
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int run_generate(const Common& c, const std::string& prompt, int n, const SamplingParams& sp,
                 bool chat, bool ignore_eos, int64_t ctx) {
  MOE_CHECK(!prompt.empty(), kInvalidArgument, "empty prompt: pass some text with -p");
  MOE_CHECK(n >= 0, kInvalidArgument, "-n must be >= 0, got {}", n);
  validate_sampling(sp);
  Tokenizer tok = Tokenizer::from_file(cli::tokenizer_path(c.model_dir, c.tokenizer));
  std::string text = prompt;
  if (chat) {
    fs::path config = fs::path(cli::tokenizer_path(c.model_dir, c.tokenizer)).parent_path() /
                      "tokenizer_config.json";
    text = ChatTemplate::from_tokenizer_config(config.string()).render({{"user", prompt}}, true);
  }
  // A rendered chat template writes its special tokens itself (as transformers'
  // apply_chat_template, which encodes without adding any).
  std::vector<int32_t> ids = tok.encode(text, /*add_special=*/!chat);
  MOE_CHECK(!ids.empty(), kInvalidArgument, "the prompt encodes to no tokens");
  auto t0 = std::chrono::steady_clock::now();
  double prompt_s = 0;
  // Streams tokens from `first` (the prompt's) and `next` (each later one) until n or EOS.
  auto stream_out = [&](const ModelConfig& mc, bool print, const std::function<int32_t()>& first,
                        const std::function<int32_t(int32_t)>& next) {
    StreamDecoder stream(tok, /*skip_special=*/false);
    t0 = std::chrono::steady_clock::now();
    int32_t token = first();  // the prompt runs even for -n 0: its time is printed
    prompt_s = seconds_since(t0);
    auto t1 = std::chrono::steady_clock::now();
    int generated = 0;
    for (; generated < n; ++generated) {
      bool stop = !ignore_eos && std::find(mc.eos_token_ids.begin(), mc.eos_token_ids.end(),
                                           token) != mc.eos_token_ids.end();
      if (stop) break;
      std::string piece = stream.push(token);
      if (print) {
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
      }
      if (generated + 1 < n) token = next(token);
    }
    if (!print) return;
    std::string rest = stream.flush();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    std::fputc('\n', stdout);
    double gen_s = seconds_since(t1);
    std::fprintf(stderr, "prompt: %zu tokens, %.1f tok/s | generation: %d tokens, %.1f tok/s\n",
                 ids.size(), ids.size() / prompt_s, generated,
                 generated > 0 ? generated / gen_s : 0.0);
  };
  const ModelConfig mc = load_model_config(c.model_dir);
  const int64_t context = ctx > 0 ? ctx : std::min<int64_t>(mc.max_position_embeddings,
                                                            static_cast<int64_t>(ids.size()) + n);
  MOE_CHECK(static_cast<int64_t>(ids.size()) + n <= context, kInvalidArgument,
            "prompt ({} tokens) + {} new tokens exceed the context of {} tokens", ids.size(), n, context);
  // Models pad their vocabulary past the tokenizer's ids (Qwen3: 151936 vs 151669); ids with no
  // token are never sampled.
  cpu::Executor* cpu = nullptr;
  auto executor = c.load_executor(context, std::min<int64_t>(mc.vocab_size, tok.vocab_size()), &cpu);
  const int32_t seq = executor->open();
  int64_t draws = 0;
  auto step = [&](std::span<const int32_t> tokens) {
    const runtime::StepPlan plan{
        {tokens.begin(), tokens.end()},
        {{.seq = seq, .count = static_cast<int32_t>(tokens.size()), .sample = true, .sampling = sp, .draw = draws++}}};
    return executor->run(plan).tokens[0];
  };
  stream_out(mc, true, [&] { return step(ids); }, [&](int32_t token) { return step({&token, 1}); });
  if (cpu && c.expert_stats) Common::print_expert_stats(cpu->model());
  return 0;
}

int run_logits(const Common& c, const std::string& ids_text) {
  std::vector<int32_t> ids = cli::parse_ids(ids_text);
  MOE_CHECK(!ids.empty(), kInvalidArgument, "empty prompt: --ids needs at least one token id");
  auto print_logits = [](const Tensor& logits) {
    const int64_t t = logits.dim(0), v = logits.dim(1);
    std::string out = fmt::format("{{\"shape\":[{},{}],\"logits\":[", t, v);
    for (int64_t i = 0; i < t; ++i) {
      out += i ? ",[" : "[";
      for (int64_t j = 0; j < v; ++j) {
        if (j) out += ',';
        out += cli::format_float(logits.data<float>()[i * v + j]);
      }
      out += ']';
    }
    out += "]}\n";
    std::fwrite(out.data(), 1, out.size(), stdout);
  };
  cpu::Executor* cpu = nullptr;
  auto executor = c.load_executor(static_cast<int64_t>(ids.size()), 0, &cpu);
  const runtime::StepPlan plan{
      ids, {{.seq = executor->open(), .count = static_cast<int32_t>(ids.size()), .logits = runtime::RowLogits::kAll}}};
  print_logits(executor->run(plan).logits[0]);
  if (cpu && c.expert_stats) Common::print_expert_stats(cpu->model());
  return 0;
}

int run_tokenize(const Common& c, const std::string& text, bool special) {
  Tokenizer tok = Tokenizer::from_file(cli::tokenizer_path(c.model_dir, c.tokenizer));
  std::vector<int32_t> ids = tok.encode(text, special);
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? "," : "") + std::to_string(ids[i]);
  std::printf("%s]\n", out.c_str());
  return 0;
}

int run_detokenize(const Common& c, const std::string& ids_text) {
  Tokenizer tok = Tokenizer::from_file(cli::tokenizer_path(c.model_dir, c.tokenizer));
  std::string text = tok.decode(cli::parse_ids(ids_text));
  std::printf("%s\n", text.c_str());
  return 0;
}

int run_info(const Common& c) {
  ModelConfig mc = load_model_config(c.model_dir);
  const bool has_weights = fs::exists(fs::path(c.model_dir) / "model.safetensors") ||
                           fs::exists(fs::path(c.model_dir) / "model.safetensors.index.json");
  std::unique_ptr<Checkpoint> ckpt;
  if (has_weights) ckpt = std::make_unique<Checkpoint>(c.model_dir);
  std::string dtypes;
  int64_t stored_params = 0;  // weights, not the FP8 block scales beside them
  uint64_t scale_bytes = 0;
  // What the GPU holds: FP8 matrices as stored with f32 scales, other matrices in bf16, vectors
  // in f32. A gate or up half of a fused matrix whose rows are not whole blocks is held in bf16
  // (the loader's rule); the multi-token-prediction layer is not loaded.
  double gpu_bytes = 0;
  if (ckpt) {
    std::map<std::string, uint64_t> by_dtype;
    const std::string mtp = fmt::format("model.layers.{}.", mc.num_layers);
    for (const auto& name : ckpt->names()) {
      const TensorInfo& t = ckpt->info(name);
      int64_t n = 1;
      for (int64_t d : t.shape) n *= d;
      const bool loaded = mc.num_nextn_predict_layers == 0 || !name.starts_with(mtp);
      if (name.ends_with("_scale_inv")) {
        scale_bytes += t.end - t.begin;
        if (loaded) gpu_bytes += n * 4.0;
        continue;
      }
      by_dtype[dtype_name(t.dtype)] += t.end - t.begin;
      stored_params += n;
      if (!loaded) continue;
      const bool fused_half = name.ends_with(mc.moe.names.gate + ".weight") || name.ends_with(mc.moe.names.up + ".weight") ||
                              name.ends_with("gate_proj.weight") || name.ends_with("up_proj.weight");
      if (t.shape.size() < 2)
        gpu_bytes += n * 4.0;
      else if (t.dtype == DType::kF8E4M3 && !(fused_half && t.shape[0] % mc.quant.block_rows != 0))
        gpu_bytes += static_cast<double>(n);
      else
        gpu_bytes += n * 2.0;
    }
    if (scale_bytes > 0) by_dtype["block scales"] += scale_bytes;
    for (const auto& [d, b] : by_dtype)
      dtypes += fmt::format("{}{} {}", dtypes.empty() ? "" : ", ", d, cli::format_bytes(b));
  }
  const int64_t sparse = mc.num_moe_layers();
  std::printf("architecture: %s\n", mc.architecture.c_str());
  std::printf("layers: %lld (%lld sparse MoE, %lld dense)\n", (long long)mc.num_layers,
              (long long)sparse, (long long)(mc.num_layers - sparse));
  if (mc.attention == AttentionKind::kMla)
    std::printf("hidden: %lld, heads: %lld, vocab: %lld, context: %lld\n", (long long)mc.hidden_size,
                (long long)mc.num_heads, (long long)mc.vocab_size,
                (long long)mc.max_position_embeddings);
  else
    std::printf("hidden: %lld, heads: %lld q / %lld kv x %lld, vocab: %lld, context: %lld\n",
                (long long)mc.hidden_size, (long long)mc.num_heads, (long long)mc.num_kv_heads,
                (long long)mc.head_dim, (long long)mc.vocab_size,
                (long long)mc.max_position_embeddings);
  if (sparse > 0) {
    std::printf("experts: %lld, top-k: %lld, expert intermediate: %lld\n",
                (long long)mc.moe.num_experts, (long long)mc.moe.top_k,
                (long long)mc.moe.intermediate_size);
    std::printf("router: %s\n", mc.moe.router.describe().c_str());
    if (mc.moe.shared_intermediate > 0)
      std::printf("shared expert: intermediate %lld%s\n", (long long)mc.moe.shared_intermediate,
                  mc.moe.shared_gate ? ", sigmoid-gated" : "");
  }
  if (mc.attention == AttentionKind::kMla)
    std::printf("attention: MLA, q_lora_rank %lld, kv_lora_rank %lld, qk %lld+%lld, v %lld\n",
                (long long)mc.mla.q_lora_rank, (long long)mc.mla.kv_lora_rank,
                (long long)mc.mla.qk_nope_head_dim, (long long)mc.mla.qk_rope_head_dim,
                (long long)mc.mla.v_head_dim);
  if (mc.num_layers > sparse)
    std::printf("dense intermediate: %lld\n", (long long)mc.intermediate_size);
  std::printf("rope: %s%s\n", describe_rope(mc.rope_scaling, mc.rope_theta).c_str(),
              mc.softmax_scale_factor != 1.0f ? fmt::format(", softmax scale x{:.4g}", mc.softmax_scale_factor).c_str()
                                              : "");
  if (mc.num_nextn_predict_layers > 0)
    std::printf("multi-token prediction: %lld layer(s) after the decoder, skipped at load (not used)\n",
                (long long)mc.num_nextn_predict_layers);
  std::printf("quantization: %s\n", mc.quant.describe().c_str());
  const int64_t params = parameter_count(mc);
  if (ckpt) {
    std::printf("parameters: %lld in the checkpoint (%.3f B), %lld implied by the config\n",
                (long long)stored_params, stored_params / 1e9, (long long)params);
    std::printf("bytes: %s on disk (%s); resident: %s as f32 on the CPU, %s on the GPU (%s)\n",
                cli::format_bytes(static_cast<double>(ckpt->total_bytes())).c_str(), dtypes.c_str(),
                cli::format_bytes(params * 4.0).c_str(), cli::format_bytes(gpu_bytes).c_str(),
                mc.quant.fp8 ? "FP8 matrices as stored, the rest bf16" : "bf16");
  } else {
    std::printf("parameters: %lld implied by the config (%.3f B); no weights in the directory "
                "(use --random-weights)\n", (long long)params, params / 1e9);
    if (mc.quant.fp8) {
      // The published layout's FP8 matrices (model/step_reads.h) and the 16-bit rest.
      const StepReads r = step_reads(mc);
      const double embed = mc.tie_word_embeddings ? 0.0 : 2.0 * static_cast<double>(mc.vocab_size * mc.hidden_size);
      const double fp8 = r.fixed_bytes + r.per_expert_bytes * static_cast<double>(mc.moe.num_experts * sparse) + embed;
      std::printf("bytes: %s of matrices on the GPU in the config's FP8 layout, %s as bf16, %s as f32\n",
                  cli::format_bytes(fp8).c_str(), cli::format_bytes(params * 2.0).c_str(),
                  cli::format_bytes(params * 4.0).c_str());
    } else {
      std::printf("bytes: %s as bf16, %s as f32\n", cli::format_bytes(params * 2.0).c_str(),
                  cli::format_bytes(params * 4.0).c_str());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moe-cli: run Mixture-of-Experts models from Hugging Face checkpoints"};
  app.require_subcommand(1);
  Common common;

  auto* gen = app.add_subcommand("generate", "generate text from a prompt");
  add_common(gen, common, true);
  add_weight_flags(gen, common);
  add_parallel_flags(gen, common);
  std::string prompt;
  int n = 64;
  SamplingParams sp;
  bool chat = false, ignore_eos = false;
  int64_t ctx = 0;
  gen->add_option("-p,--prompt", prompt, "prompt text")->required();
  gen->add_option("-n,--n-predict", n, "tokens to generate")->capture_default_str();
  gen->add_option("--temp", sp.temperature, "temperature (0: greedy)")->capture_default_str();
  gen->add_option("--top-k", sp.top_k, "keep the k most likely tokens (0: all)")->capture_default_str();
  gen->add_option("--top-p", sp.top_p, "nucleus sampling threshold")->capture_default_str();
  gen->add_option("--seed", sp.seed, "sampling seed")->capture_default_str();
  gen->add_flag("--chat", chat, "wrap the prompt in the model's chat template");
  gen->add_flag("--ignore-eos", ignore_eos, "keep generating past end-of-sequence tokens");
  gen->add_option("--ctx", ctx, "KV cache capacity in tokens (default: prompt + n)");

  auto* logits = app.add_subcommand("logits", "print the logits of every position as JSON");
  add_common(logits, common, false);
  add_weight_flags(logits, common);
  add_parallel_flags(logits, common);
  std::string ids_text;
  logits->add_option("--ids", ids_text, "comma-separated token ids, e.g. 3,17,42")->required();

  auto* tokenize = app.add_subcommand("tokenize", "print the token ids of a text as JSON");
  add_common(tokenize, common, true);
  std::string text;
  bool special = false;
  tokenize->add_option("--text", text, "text to encode")->required();
  tokenize->add_flag("--add-special", special, "apply the tokenizer's post-processor (e.g. BOS)");

  auto* detok = app.add_subcommand("detokenize", "print the text of comma-separated token ids");
  add_common(detok, common, true);
  detok->add_option("--ids", ids_text, "comma-separated token ids")->required();

  auto* info = app.add_subcommand("info", "describe a checkpoint without loading its weights");
  add_common(info, common, false);

  app.add_subcommand("devices", "list the GPUs this build can use");

  if (const int rc = moe::cli::parse_args(app, argc, argv); rc >= 0) return rc;
  return cli::guarded([&] {
    if (*gen) return run_generate(common, prompt, n, sp, chat, ignore_eos, ctx);
    if (*logits) return run_logits(common, ids_text);
    if (*tokenize) return run_tokenize(common, text, special);
    if (*detok) return run_detokenize(common, ids_text);
    if (app.got_subcommand("devices")) {
      std::printf("%s\n", cuda_status().c_str());
      for (const auto& g : cuda_devices())
        std::printf("cuda:%d %s, %.1f GiB, sm_%d%d, %d SMs\n", g.index, g.name.c_str(),
                    g.memory_bytes / 1073741824.0, g.cc_major, g.cc_minor, g.multiprocessors);
      return 0;
    }
    return run_info(common);
  });
}
