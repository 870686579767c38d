// moe-server: an OpenAI-compatible HTTP server over the continuous-batching scheduler
// (serve::Scheduler), which drives an executor: the CPU model (cpu::Executor) or, with --device
// cuda, the CUDA engine. The request loop, the OpenAI routes and the HTTP layer live in
// src/serve/; this is the main that loads the model, wires them together and handles the shutdown
// signals.
//
// The executor may live in another process (runtime/remote_executor.h): `--serve-executor
// HOST:PORT` makes this process a worker that loads the model and answers the calls of drivers
// on that address, one at a time, until it is sent SIGTERM or SIGINT (runtime/executor_worker.h);
// `--executor HOST:PORT` makes it a driver, which reads only the config and tokenizer and
// schedules onto the worker.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <thread>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "backend/cpu/cpu_executor.h"
#include "backend/cuda_engine.h"
#include "backend/device_info.h"
#include "cli_common.h"
#include "core/tcp_endpoint.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "dist/dist_config.h"
#include "model/config.h"
#include "model/model.h"
#include "moe/errors.h"
#include "runtime/executor_worker.h"
#include "runtime/remote_executor.h"
#include "serve/http/http_server.h"
#include "serve/openai_api.h"
#include "serve/request_loop.h"
#include "serve/scheduler.h"

namespace fs = std::filesystem;
using namespace moe;

namespace {

// The HTTP layer's counters for /metrics.
std::string http_metrics(const serve::http::HttpStats& s) {
  std::string out;
  auto line = [&](const char* name, const char* type, int64_t v) {
    out += fmt::format("# TYPE {} {}\n{} {}\n", name, type, name, v);
  };
  line("moe_http_open_connections", "gauge", s.open_connections);
  line("moe_http_connections_total", "counter", s.connections);
  line("moe_http_refused_connections_total", "counter", s.refused_connections);
  line("moe_http_timed_out_requests_total", "counter", s.timed_out);
  line("moe_http_rejected_requests_total", "counter", s.rejected);
  return out;
}

// Runs `on_signal` on its own thread when SIGTERM or SIGINT arrives (blocked in every thread, so
// that only its sigwait takes them). Destroyed without a signal, it wakes that thread, which then
// does nothing.
class ShutdownWaiter {
 public:
  ShutdownWaiter(const sigset_t& signals, std::function<void()> on_signal)
      : thread_([this, signals, f = std::move(on_signal)] {
          int sig = 0;
          sigwait(&signals, &sig);
          if (!done_) f();
        }) {}
  ~ShutdownWaiter() {
    done_ = true;
    pthread_kill(thread_.native_handle(), SIGTERM);  // blocked everywhere: only its sigwait takes it
    thread_.join();
  }
  ShutdownWaiter(const ShutdownWaiter&) = delete;
  ShutdownWaiter& operator=(const ShutdownWaiter&) = delete;

 private:
  std::atomic<bool> done_{false};
  std::thread thread_;
};

}  // namespace

int main(int argc, char** argv) {
  return cli::guarded([&] {
    CLI::App app{"moe-server: OpenAI-compatible HTTP server (CPU, or CUDA GPUs)"};
    std::string model_dir, tokenizer, host = "127.0.0.1", device = "cpu", name;
    int port = 8080, threads = 0;
    serve::SchedulerConfig cfg;
    int64_t max_batch = 16, kv_blocks = 0, block_size = 16;
    serve::http::Limits limits;
    int64_t max_prompt_tokens = 0;
    app.add_option("-m,--model", model_dir, "model directory (Hugging Face layout)")->required();
    app.add_option("--tokenizer", tokenizer, "tokenizer.json (default: <model>/tokenizer.json)");
    app.add_option("--name", name, "model id clients use (default: the directory name)");
    app.add_option("--host", host, "address to listen on");
    app.add_option("--port", port, "port to listen on (0: any free port, printed)");
    app.add_option("--device", device, "cpu | cuda (the CUDA engine, decode steps from CUDA graphs)");
    int tp = 1, ep = 1, dp = 1;
    std::string ep_backend = "local_allreduce";
    moe::cli::add_parallel_flags(&app, {&ep, &tp, &dp, &ep_backend});
    bool random_weights = false;
    app.add_flag("--random-weights", random_weights, "cuda: config.json only, weights drawn on the device");
    app.add_option("-t,--threads", threads, "cpu: threads for the model (0: all)");
    app.add_option("--max-batch", max_batch, "requests running at once (per attention group under --dp)")->capture_default_str();
    app.add_option("--max-step-tokens", cfg.max_step_tokens, "tokens computed per step (per attention group under --dp)")->capture_default_str();
    app.add_option("--kv-blocks", kv_blocks, "KV cache blocks (0: enough for max-batch full contexts; cuda: capped by free memory; per attention group under --dp)");
    app.add_option("--block-size", block_size, "tokens per KV block")->capture_default_str();
    app.add_option("--ctx", cfg.max_context, "context per request (0: the model's)");
    app.add_option("--max-prompt-tokens", max_prompt_tokens,
                   "longest prompt, counted while it is tokenized (0: the context less one)");
    app.add_option("--max-body-bytes", limits.max_body_bytes, "largest request body, after decoding gzip/deflate/br (413)")
        ->capture_default_str();
    app.add_option("--max-header-bytes", limits.max_header_bytes, "largest request line plus headers (431)")
        ->capture_default_str();
    app.add_option("--max-headers", limits.max_headers, "most header fields in a request (431)")->capture_default_str();
    app.add_option("--request-timeout", limits.request_timeout_s,
                   "seconds a client has to send a whole request (408); slow senders hold only their own connection")
        ->capture_default_str();
    app.add_option("--idle-timeout", limits.idle_timeout_s, "seconds a kept-alive connection may sit idle")
        ->capture_default_str();
    app.add_option("--write-timeout", limits.write_timeout_s, "seconds a client may stop reading before it is dropped")
        ->capture_default_str();
    app.add_option("--max-connections", limits.max_connections, "open connections at once; more are answered 503")
        ->capture_default_str();
    std::string serve_executor_at, executor_at;
    double executor_timeout_s = 600;
    app.add_option("--serve-executor", serve_executor_at,
                   "HOST:PORT: be an executor worker: load the model as the other flags say, then answer drivers "
                   "(moe-server --executor) on this address, one at a time, instead of serving HTTP; a driver's "
                   "sequences are closed when it goes; exits on SIGTERM or SIGINT");
    app.add_option("--executor", executor_at,
                   "HOST:PORT: drive the executor of a worker (moe-server --serve-executor) instead of loading "
                   "weights; -m gives the config and tokenizer, the worker's flags its device, parallelism and cache");
    app.add_option("--executor-timeout", executor_timeout_s,
                   "seconds to reach the other side of --executor/--serve-executor, and for each call")
        ->capture_default_str();
    if (const int rc = moe::cli::parse_args(app, argc, argv); rc >= 0) return rc;
    MOE_CHECK(serve_executor_at.empty() || executor_at.empty(), kInvalidArgument,
              "--serve-executor and --executor: a process is a worker or its driver, not both");
    MOE_CHECK(executor_timeout_s > 0, kInvalidArgument, "--executor-timeout must be positive, got {}",
              executor_timeout_s);
    if (!executor_at.empty()) {
      for (const char* flag : {"--device", "--ep", "--tp", "--dp", "--ep-backend", "--random-weights", "--threads",
                               "--max-batch", "--kv-blocks", "--block-size"})
        MOE_CHECK(app.count(flag) == 0, kInvalidArgument,
                  "--executor {}: {} belongs to the worker (moe-server --serve-executor), which holds the model",
                  executor_at, flag);
    }
    const std::optional<net::Endpoint> worker_at =
        serve_executor_at.empty() ? std::nullopt
                                  : std::optional(net::parse_endpoint(serve_executor_at, "--serve-executor"));
    const std::optional<net::Endpoint> driven_at =
        executor_at.empty() ? std::nullopt : std::optional(net::parse_endpoint(executor_at, "--executor"));
    MOE_CHECK(device == "cpu" || device == "cuda", kInvalidArgument, "--device {}: valid devices are cpu and cuda", device);
    MOE_CHECK(!random_weights || device == "cuda", kInvalidArgument, "--random-weights needs --device cuda");
    if (device == "cuda") {
      MOE_CHECK(threads == 0, kInvalidArgument, "--threads sets CPU threads: it is for --device cpu");
      cuda::engine_ranks(tp, ep, dp);
      // An unknown name (the valid ones listed), then dp against the other degrees.
      cuda::check_engine_dp(dp, tp, ep, cuda::engine_ep_backend(ep_backend));
    } else {
      MOE_CHECK(tp == 1, kUnsupported, "--tp {}: tensor-parallel attention runs on GPUs only (--device cuda)", tp);
      MOE_CHECK(dp == 1, kUnsupported, "--dp {}: data-parallel attention runs on GPUs only (--device cuda)", dp);
      dist::DistConfig dc;
      dc.ep = ep;
      dc.ep_backend = ep_backend;
      dist::validate_dist_config(dc);
    }
    MOE_CHECK(port >= 0 && port <= 65535, kInvalidArgument, "--port {} is not a port number", port);
    MOE_CHECK(max_prompt_tokens >= 0, kInvalidArgument, "--max-prompt-tokens must be >= 0, got {}", max_prompt_tokens);

    // Block the shutdown signals before any thread starts, so that only the waiter below sees them
    // (one that arrives while the model loads is taken once it has loaded).
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGTERM);
    sigaddset(&signals, SIGINT);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);

    MOE_CHECK(fs::is_directory(model_dir), kIo, "model directory {} does not exist", model_dir);
    const std::string tok_path = cli::tokenizer_path(model_dir, tokenizer);
    Tokenizer tok = Tokenizer::from_file(tok_path);
    MOE_CHECK(max_batch >= 1 && max_batch <= 1024, kInvalidArgument, "max_batch must be in [1, 1024], got {}", max_batch);
    MOE_CHECK(block_size >= 1 && block_size <= 1024, kInvalidArgument, "--block-size must be in [1, 1024], got {}",
              block_size);
    std::unique_ptr<cuda::Engine> gpu;
    if (device == "cuda" && !driven_at) {
      cuda::EngineOptions eo;
      eo.max_batch = static_cast<int>(max_batch);
      eo.max_context = cfg.max_context;
      eo.kv_blocks = kv_blocks;
      eo.block_size = static_cast<int>(block_size);
      eo.random_weights = random_weights;
      eo.progress = true;
      eo.sampled_vocab = tok.vocab_size();
      eo.tp = tp;
      eo.ep = ep;
      eo.dp = dp;
      eo.ep_backend = cuda::engine_ep_backend(ep_backend);
      gpu = cuda::Engine::load(model_dir, eo);
    }
    const ModelConfig mc = load_model_config(model_dir);

    // A template that cannot be used leaves the server running without chat: chat requests are
    // then answered 400 with the reason.
    const fs::path config = fs::path(tok_path).parent_path() / "tokenizer_config.json";
    std::optional<ChatTemplate> chat;
    std::string no_chat = fmt::format("{} does not exist", config.string());
    if (fs::exists(config)) {
      try {
        chat = ChatTemplate::from_tokenizer_config(config.string());
      } catch (const Error& e) {
        no_chat = e.message();
        std::fprintf(stderr, "moe-server: serving without chat: %s\n", e.what());
      }
    }

    std::unique_ptr<cpu::Executor> cpu_executor;
    std::unique_ptr<runtime::RemoteExecutor> remote;
    runtime::Executor* executor = gpu.get();
    int64_t context = 0;
    if (driven_at) {
      remote = std::make_unique<runtime::RemoteExecutor>(net::connect_tcp(*driven_at, executor_timeout_s),
                                                         executor_timeout_s);
      executor = remote.get();
      const runtime::ExecutorLimits& l = remote->limits();
      MOE_CHECK(l.vocab == mc.vocab_size, kInvalidArgument,
                "--executor {}: the worker's model has {} token ids, {}'s has {}: not the same model", executor_at,
                l.vocab, model_dir, mc.vocab_size);
      context = cfg.max_context > 0 ? cfg.max_context : l.max_context;  // past the worker's: the scheduler refuses it
      std::fprintf(stderr, "moe-server: driving the executor at %s (%lld sequences, context %lld, %lld KV blocks of %lld tokens)\n",
                   executor_at.c_str(), static_cast<long long>(l.max_sequences), static_cast<long long>(l.max_context),
                   static_cast<long long>(l.kv_blocks), static_cast<long long>(l.block_size));
    } else if (gpu) {
      context = gpu->options().max_context;
      const cuda::MemoryReport m = gpu->memory();
      std::string gpu_name = "GPU " + std::to_string(gpu->options().device);
      for (const GpuInfo& g : cuda_devices())
        if (g.index == gpu->options().device) gpu_name = g.name;
      if (ep > 1) gpu_name = fmt::format("{} x {} (tp {}, ep {}; sums over all)", ep, gpu_name, tp, ep);
      std::fprintf(stderr, "moe-server: %s: weights %.2f GB, KV cache %lld blocks of %d tokens (%.2f GB), workspace %.2f GB\n",
                   gpu_name.c_str(), m.weights / 1e9, static_cast<long long>(m.kv_blocks), gpu->options().block_size,
                   m.kv_cache / 1e9, m.workspace / 1e9);
      if (ep > 1) {
        const std::vector<cuda::MemoryReport> per_gpu = gpu->memory_per_gpu();
        for (size_t g = 0; g < per_gpu.size(); ++g)
          std::fprintf(stderr, "moe-server:   GPU %d: weights %.2f GB, KV cache %.2f GB, workspace %.2f GB\n",
                       gpu->options().device + static_cast<int>(g), per_gpu[g].weights / 1e9,
                       per_gpu[g].kv_cache / 1e9, per_gpu[g].workspace / 1e9);
      }
    } else {
      context = cfg.max_context > 0 ? cfg.max_context : mc.max_position_embeddings;
      if (kv_blocks == 0) kv_blocks = max_batch * ((context + block_size - 1) / block_size);
      cpu::ExecutorOptions xo;
      xo.kv_blocks = kv_blocks;
      xo.block_size = block_size;
      xo.max_sequences = max_batch;
      xo.max_context = cfg.max_context;
      xo.sampled_vocab = tok.vocab_size();
      LoadOptions lo;
      lo.threads = threads;
      lo.ep_backend = dist::parse_ep_backend(ep_backend);
      cpu_executor = cpu::Executor::load(model_dir, lo, ep, xo);
      executor = cpu_executor.get();
      std::fprintf(stderr, "moe-server: KV cache of %lld blocks of %lld tokens (%.2f GB)\n",
                   static_cast<long long>(kv_blocks), static_cast<long long>(block_size),
                   static_cast<double>(kv_blocks) * block_size * mc.num_layers *
                       (mc.kv_key_width() + mc.kv_value_width()) * 4 / 1e9);
    }
    if (worker_at) {
      int bound = 0;
      const int listen_fd = net::listen_tcp(*worker_at, &bound);
      std::fprintf(stderr, "moe-server: executor worker listening on %s:%d\n", worker_at->host.c_str(), bound);
      std::fflush(stderr);
      runtime::ExecutorWorker worker(*executor, listen_fd, executor_timeout_s, [](const std::string& line) {
        std::fprintf(stderr, "moe-server: %s\n", line.c_str());
        std::fflush(stderr);
      });
      {
        ShutdownWaiter waiter(signals, [&] {
          std::fprintf(stderr, "moe-server: shutting down the executor worker\n");
          worker.stop();
        });
        worker.run();
      }
      ::close(listen_fd);
      std::fprintf(stderr, "moe-server: the executor worker served %lld driver(s) and exits\n",
                   static_cast<long long>(worker.drivers_served()));
      return 0;
    }
    auto scheduler = std::make_unique<serve::Scheduler>(*executor, cfg, &tok);
    serve::RequestLoop loop(std::move(scheduler));
    serve::ApiConfig api;
    api.model_name = name.empty() ? fs::path(model_dir).filename().string() : name;
    api.context = context;
    api.max_prompt_tokens = max_prompt_tokens;
    api.eos_token_ids = mc.eos_token_ids;
    const serve::RequestPreparer preparer(tok, chat ? &*chat : nullptr, no_chat, api);

    std::unique_ptr<serve::http::Server> http;
    serve::OpenAiApi routes(preparer, loop, [&] { return http ? http_metrics(http->stats()) : std::string(); });
    http = std::make_unique<serve::http::Server>(
        limits, [&](const serve::http::Request& req, serve::http::Response& res) { routes.handle(req, res); },
        serve::OpenAiApi::error_body);
    const int bound = http->listen(host, port);
    std::fprintf(stderr, "moe-server: serving %s on http://%s:%d\n", api.model_name.c_str(), host.c_str(), bound);
    std::fflush(stderr);

    {
      ShutdownWaiter waiter(signals, [&] {
        std::fprintf(stderr, "moe-server: shutting down\n");
        loop.shutdown();  // in-flight requests end (cut), so their handlers answer and return
        http->stop();     // connections still sending a request are dropped at once
      });
      http->run();
    }
    loop.shutdown();
    return 0;
  });
}
