// moe-server: an OpenAI-compatible HTTP server over a continuous-batching scheduler: the CPU model
// (serve::Scheduler) or, with --device cuda, the CUDA engine on one GPU (serve::GpuScheduler).
//
// One engine thread owns the model and the scheduler and runs steps while there is work. HTTP
// handler threads never touch the scheduler: they queue submissions and cancellations for the
// engine thread and wait on their own Job for its answer and its events.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "cli_common.h"
#include "io/chat_template.h"
#include "io/tokenizer.h"
#include "model/model.h"
#include "moe/errors.h"
#include "backend/cuda_engine.h"
#include "backend/device_info.h"
#include "serve/gpu_scheduler.h"
#include "serve/scheduler.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace moe;
using Clock = std::chrono::steady_clock;

namespace {

// What an HTTP handler waits on: first the verdict on its submission, then its events.
struct Job {
  std::vector<int32_t> prompt;
  serve::RequestOptions options;
  std::mutex m;
  std::condition_variable cv;
  bool answered = false;  // the engine took the request or rejected it
  std::string error;      // why it was rejected
  uint64_t id = 0;
  std::deque<serve::Event> events;
  bool finished = false;
};

// Latencies in seconds, as cumulative Prometheus buckets.
struct Histogram {
  std::vector<double> bounds{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
  std::vector<uint64_t> counts = std::vector<uint64_t>(bounds.size() + 1, 0);
  double sum = 0;
  void add(double s) {
    size_t i = 0;
    while (i < bounds.size() && s > bounds[i]) ++i;
    ++counts[i];
    sum += s;
  }
  void write(std::string& out, const std::string& name) const {
    out += fmt::format("# TYPE {} histogram\n", name);
    uint64_t cumulative = 0;
    for (size_t i = 0; i < bounds.size(); ++i) {
      cumulative += counts[i];
      out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds[i], cumulative);
    }
    cumulative += counts.back();
    out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, cumulative,
                       name, sum, name, cumulative);
  }
};

class Engine {
 public:
  explicit Engine(std::unique_ptr<serve::Batcher> scheduler)
      : scheduler_(std::move(scheduler)), thread_([this] { loop(); }) {}
  ~Engine() { shutdown(); }

  // Blocks until the engine accepted or rejected the job; returns the rejection ("" if taken).
  std::string submit(const std::shared_ptr<Job>& job) {
    {
      std::lock_guard lock(m_);
      if (stopping_) return "the server is shutting down";
      incoming_.push_back(job);
    }
    cv_.notify_one();
    std::unique_lock lock(job->m);
    job->cv.wait(lock, [&] { return job->answered; });
    return job->error;
  }
  void cancel(const std::shared_ptr<Job>& job) {
    {
      std::lock_guard lock(m_);
      cancels_.push_back(job);
    }
    cv_.notify_one();
  }
  // Cancels everything in flight and stops the engine thread.
  void shutdown() {
    {
      std::lock_guard lock(m_);
      stopping_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }
  std::string metrics() {
    std::lock_guard lock(metrics_m_);
    std::string out;
    auto counter = [&](const char* name, const char* type, double v) {
      out += fmt::format("# TYPE {} {}\n{} {}\n", name, type, name, v);
    };
    counter("moe_requests_total", "counter", static_cast<double>(requests_));
    counter("moe_requests_rejected_total", "counter", static_cast<double>(rejected_));
    counter("moe_prompt_tokens_total", "counter", static_cast<double>(prompt_tokens_));
    counter("moe_generated_tokens_total", "counter", static_cast<double>(generated_tokens_));
    counter("moe_preemptions_total", "counter", static_cast<double>(stats_.preemptions));
    counter("moe_prefix_hit_tokens_total", "counter", static_cast<double>(stats_.prefix_hit_tokens));
    counter("moe_queue_depth", "gauge", static_cast<double>(stats_.waiting));
    counter("moe_running_requests", "gauge", static_cast<double>(stats_.running));
    counter("moe_kv_blocks_in_use", "gauge", static_cast<double>(stats_.blocks_used));
    counter("moe_kv_blocks_total", "gauge", static_cast<double>(stats_.blocks_total));
    ttft_.write(out, "moe_time_to_first_token_seconds");
    itl_.write(out, "moe_inter_token_latency_seconds");
    return out;
  }

 private:
  struct Live {
    std::shared_ptr<Job> job;
    Clock::time_point last;  // submission, then each token
    bool first = true;
  };

  void loop() {
    for (;;) {
      std::deque<std::shared_ptr<Job>> incoming;
      std::vector<std::shared_ptr<Job>> cancels;
      bool stopping;
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return stopping_ || !incoming_.empty() || !cancels_.empty() || scheduler_->busy(); });
        incoming.swap(incoming_);
        cancels.swap(cancels_);
        stopping = stopping_;
      }
      for (auto& job : incoming) take(job);
      for (auto& job : cancels) scheduler_->cancel(job->id);  // false when it already finished
      if (stopping)
        for (auto& [id, live] : live_) scheduler_->cancel(id);
      std::vector<serve::Event> events;
      try {
        events = scheduler_->step();
      } catch (const std::exception& e) {
        // A failed forward must not strand the waiting clients: end every request.
        std::fprintf(stderr, "error: %s\n", e.what());
        for (auto& [id, live] : live_) scheduler_->cancel(id);
        events = scheduler_->step();
      }
      deliver(events);
      if (stopping && live_.empty()) return;
    }
  }

  void take(const std::shared_ptr<Job>& job) {
    std::string error;
    try {
      job->id = scheduler_->submit(job->prompt, job->options);
      live_[job->id] = {job, Clock::now()};
    } catch (const Error& e) {
      error = e.message();
    }
    {
      std::lock_guard lock(metrics_m_);
      ++(error.empty() ? requests_ : rejected_);
      if (error.empty()) prompt_tokens_ += static_cast<int64_t>(job->prompt.size());
    }
    std::lock_guard lock(job->m);
    job->answered = true;
    job->error = error;
    job->cv.notify_all();
  }

  void deliver(std::vector<serve::Event>& events) {
    const auto now = Clock::now();
    std::lock_guard mlock(metrics_m_);
    stats_ = scheduler_->stats();
    for (serve::Event& e : events) {
      auto it = live_.find(e.id);
      if (it == live_.end()) continue;
      Live& live = it->second;
      if (e.token >= 0) {
        ++generated_tokens_;
        (live.first ? ttft_ : itl_).add(std::chrono::duration<double>(now - live.last).count());
        live.first = false;
        live.last = now;
      }
      const bool finished = e.finish != serve::FinishReason::kNone;
      {
        std::lock_guard lock(live.job->m);
        live.job->events.push_back(std::move(e));
        live.job->finished = finished;
        live.job->cv.notify_all();
      }
      if (finished) live_.erase(it);
    }
  }

  std::unique_ptr<serve::Batcher> scheduler_;
  std::map<uint64_t, Live> live_;  // engine thread only
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> incoming_;
  std::vector<std::shared_ptr<Job>> cancels_;
  bool stopping_ = false;
  std::mutex metrics_m_;
  int64_t requests_ = 0, rejected_ = 0, prompt_tokens_ = 0, generated_tokens_ = 0;
  serve::SchedulerStats stats_;
  Histogram ttft_, itl_;
  std::thread thread_;  // last: starts once everything above exists
};

// Generated text is valid UTF-8 except, at worst, where a token sequence ends mid-character;
// such bytes go out as U+FFFD instead of failing the response.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// A request the client got wrong: answered with this status and an OpenAI-style error body.
struct BadRequest {
  int status;
  std::string message, param, code;
};

json error_body(const BadRequest& b) {
  return {{"error",
           {{"message", b.message},
            {"type", b.status == 404 ? "not_found_error" : "invalid_request_error"},
            {"param", b.param.empty() ? json(nullptr) : json(b.param)},
            {"code", b.code.empty() ? json(nullptr) : json(b.code)}}}};
}

[[noreturn]] void bad(const std::string& message, const std::string& param = "", int status = 400,
                      const std::string& code = "") {
  throw BadRequest{status, message, param, code};
}

template <typename T>
T field(const json& body, const char* name, T fallback) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return fallback;
  if constexpr (std::is_same_v<T, bool>) {
    if (!it->is_boolean()) bad(fmt::format("'{}' must be a boolean", name), name);
  } else if constexpr (std::is_integral_v<T>) {
    if (!it->is_number_integer()) bad(fmt::format("'{}' must be an integer", name), name);
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!it->is_number()) bad(fmt::format("'{}' must be a number", name), name);
  } else {
    if (!it->is_string()) bad(fmt::format("'{}' must be a string", name), name);
  }
  return it->get<T>();
}

struct Server {
  const ModelConfig& config;
  Tokenizer tok;
  std::optional<ChatTemplate> chat;
  std::string model_name;
  int64_t context;
  Engine& engine;
  std::atomic<uint64_t> counter{0};
  std::mutex render_m{};  // the template interpreter is not documented as safe to share

  json parse(const httplib::Request& req) {
    json body = json::parse(req.body, nullptr, false);
    if (body.is_discarded()) bad("the request body is not valid JSON");
    if (!body.is_object()) bad("the request body must be a JSON object");
    const std::string name = field<std::string>(body, "model", model_name);
    if (name != model_name)
      bad(fmt::format("the model '{}' does not exist; this server serves '{}'", name, model_name),
          "model", 404, "model_not_found");
    return body;
  }

  serve::RequestOptions options(const json& body) {
    serve::RequestOptions o;
    o.max_tokens = field<int64_t>(body, "max_tokens", 16);
    if (body.contains("max_completion_tokens"))
      o.max_tokens = field<int64_t>(body, "max_completion_tokens", o.max_tokens);
    o.sampling.temperature = field<float>(body, "temperature", 1.0f);
    o.sampling.top_p = field<float>(body, "top_p", 1.0f);
    o.sampling.top_k = field<int>(body, "top_k", 0);
    o.sampling.seed = field<uint64_t>(body, "seed", 0);
    try {
      validate_sampling(o.sampling);
    } catch (const Error& e) {
      bad(e.message());
    }
    if (auto it = body.find("stop"); it != body.end() && !it->is_null()) {
      if (it->is_string()) {
        o.stop_strings.push_back(it->get<std::string>());
      } else if (it->is_array()) {
        for (const json& s : *it) {
          if (!s.is_string()) bad("'stop' must be a string or an array of strings", "stop");
          o.stop_strings.push_back(s.get<std::string>());
        }
      } else {
        bad("'stop' must be a string or an array of strings", "stop");
      }
      for (const auto& s : o.stop_strings)
        if (s.empty()) bad("a stop string must not be empty", "stop");
    }
    o.stop_ids = config.eos_token_ids;
    return o;
  }

  std::vector<int32_t> prompt_of(const json& body, bool is_chat) {
    std::string text;
    if (is_chat) {
      auto it = body.find("messages");
      if (it == body.end() || !it->is_array() || it->empty())
        bad("'messages' must be a non-empty array", "messages");
      if (!chat) bad("this model has no chat template", "messages");
      std::vector<ChatMessage> messages;
      for (const json& m : *it) {
        if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
            !m["content"].is_string())
          bad("each message must be an object with string 'role' and 'content'", "messages");
        messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
      }
      try {
        std::lock_guard lock(render_m);
        text = chat->render(messages, /*add_generation_prompt=*/true);
      } catch (const Error& e) {
        bad(e.message(), "messages");
      }
    } else {
      auto it = body.find("prompt");
      if (it == body.end() || !it->is_string()) bad("'prompt' must be a string", "prompt");
      text = it->get<std::string>();
    }
    // The context must hold the prompt and one new token: counting stops past context - 1, so
    // that a huge prompt is refused before it is tokenized in full.
    std::vector<int32_t> ids;
    try {
      ids = tok.encode(text, /*add_special=*/true, static_cast<size_t>(context - 1));
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kInvalidArgument) throw;
      bad(fmt::format("the prompt has more than {} tokens; the context holds {}", context - 1,
                      context),
          is_chat ? "messages" : "prompt", 400, "context_length_exceeded");
    }
    if (ids.empty()) bad("the prompt encodes to no tokens", is_chat ? "messages" : "prompt");
    return ids;
  }

  // One choice's content for a piece of text, in the shape of the endpoint.
  static json choice(bool is_chat, bool stream, const std::string& text, const char* finish, bool first) {
    json c = {{"index", 0}, {"finish_reason", finish ? json(finish) : json(nullptr)}};
    if (!is_chat) {
      c["text"] = text;
      c["logprobs"] = nullptr;
    } else if (stream) {
      c["delta"] = json::object();
      if (first) c["delta"]["role"] = "assistant";
      if (!text.empty() || !finish) c["delta"]["content"] = text;
    } else {
      c["message"] = {{"role", "assistant"}, {"content", text}};
    }
    return c;
  }

  void handle(const httplib::Request& req, httplib::Response& res, bool is_chat) {
    try {
      const json body = parse(req);
      const bool stream = field<bool>(body, "stream", false);
      auto job = std::make_shared<Job>();
      job->prompt = prompt_of(body, is_chat);
      job->options = options(body);
      if (std::string why = engine.submit(job); !why.empty())
        bad(why, "max_tokens", 400, why.find("context") != std::string::npos ? "context_length_exceeded" : "");
      const std::string id = fmt::format("{}-{}", is_chat ? "chatcmpl" : "cmpl", ++counter);
      const int64_t created = std::chrono::duration_cast<std::chrono::seconds>(
                                  std::chrono::system_clock::now().time_since_epoch()).count();
      json head = {{"id", id},
                   {"object", is_chat ? (stream ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
                   {"created", created},
                   {"model", model_name}};
      if (!stream) {
        // The whole body at the end, but from a content provider that wakes now and then while
        // the request runs: a client that went away is noticed then, and its request cancelled
        // (a plain handler would only learn of it when writing the finished answer).
        res.set_chunked_content_provider(
            "application/json",
            [job, head, is_chat](size_t, httplib::DataSink& sink) {
              std::unique_lock lock(job->m);
              if (!job->cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return job->finished; }))
                return sink.is_writable();
              std::string text;
              int64_t tokens = 0;
              const char* finish = "stop";
              for (const auto& e : job->events) {
                text += e.text;
                tokens += e.token >= 0;
                if (e.finish != serve::FinishReason::kNone) finish = serve::finish_reason_name(e.finish);
              }
              json out = head;
              out["choices"] = json::array({choice(is_chat, false, text, finish, true)});
              out["usage"] = {{"prompt_tokens", job->prompt.size()},
                              {"completion_tokens", tokens},
                              {"total_tokens", static_cast<int64_t>(job->prompt.size()) + tokens}};
              const std::string body = dump(out);
              if (!sink.write(body.data(), body.size())) return false;
              sink.done();
              return true;
            },
            [this, job](bool success) {
              if (!success) engine.cancel(job);
            });
        return;
      }
      auto first = std::make_shared<bool>(true);
      res.set_chunked_content_provider(
          "text/event-stream",
          [job, head, is_chat, first](size_t, httplib::DataSink& sink) {
            std::deque<serve::Event> events;
            bool finished;
            {
              std::unique_lock lock(job->m);
              // Wake now and then to notice a client that went away while nothing was produced.
              job->cv.wait_for(lock, std::chrono::milliseconds(200),
                               [&] { return !job->events.empty() || job->finished; });
              events.swap(job->events);
              finished = job->finished;
            }
            if (!sink.is_writable()) return false;
            for (const auto& e : events) {
              const bool last = e.finish != serve::FinishReason::kNone;
              if (e.text.empty() && !last && !*first) continue;
              json chunk = head;
              chunk["choices"] = json::array(
                  {choice(is_chat, true, e.text, last ? serve::finish_reason_name(e.finish) : nullptr, *first)});
              *first = false;
              const std::string line = "data: " + dump(chunk) + "\n\n";
              if (!sink.write(line.data(), line.size())) return false;
            }
            if (finished) {
              static const std::string done = "data: [DONE]\n\n";
              sink.write(done.data(), done.size());
              sink.done();
            }
            return true;
          },
          // Called when the response ends; a client that left early frees its blocks.
          [this, job](bool success) {
            if (!success) engine.cancel(job);
          });
    } catch (const BadRequest& b) {
      res.status = b.status;
      res.set_content(dump(error_body(b)), "application/json");
    } catch (const json::exception& e) {
      res.status = 400;
      res.set_content(dump(error_body({400, e.what(), "", ""})), "application/json");
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  return cli::guarded([&] {
    CLI::App app{"moe-server: OpenAI-compatible HTTP server (CPU, or CUDA GPUs)"};
    std::string model_dir, tokenizer, host = "127.0.0.1", device = "cpu", name;
    int port = 8080, threads = 0, http_threads = 0;
    serve::SchedulerConfig cfg;
    cfg.kv_blocks = 0;
    app.add_option("-m,--model", model_dir, "model directory (Hugging Face layout)")->required();
    app.add_option("--tokenizer", tokenizer, "tokenizer.json (default: <model>/tokenizer.json)");
    app.add_option("--name", name, "model id clients use (default: the directory name)");
    app.add_option("--host", host, "address to listen on");
    app.add_option("--port", port, "port to listen on (0: any free port, printed)");
    app.add_option("--device", device, "cpu | cuda (the CUDA engine, decode steps from CUDA graphs)");
    int tp = 1, ep = 1;
    app.add_option("--ep", ep, "cuda: GPUs holding 1/ep of the routed experts each")->capture_default_str();
    app.add_option("--tp", tp, "cuda: tensor-parallel attention over the --ep GPUs (1 or the --ep value)")
        ->capture_default_str();
    bool random_weights = false;
    app.add_flag("--random-weights", random_weights, "cuda: config.json only, weights drawn on the device");
    app.add_option("-t,--threads", threads, "CPU threads for the model (0: all)");
    app.add_option("--http-threads", http_threads, "HTTP worker threads (0: 2 x max-batch + 8)");
    app.add_option("--max-batch", cfg.max_batch, "requests running at once");
    app.add_option("--max-step-tokens", cfg.max_step_tokens, "tokens computed per step");
    app.add_option("--kv-blocks", cfg.kv_blocks, "KV cache blocks (0: enough for max-batch full contexts; cuda: capped by free memory)");
    app.add_option("--block-size", cfg.block_size, "tokens per KV block");
    app.add_option("--ctx", cfg.max_context, "context per request (0: the model's)");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e);
    }
    MOE_CHECK(device == "cpu" || device == "cuda", kInvalidArgument, "--device {}: valid devices are cpu and cuda", device);
    MOE_CHECK(!random_weights || device == "cuda", kInvalidArgument, "--random-weights needs --device cuda");
    if (device == "cuda") {
      cuda::engine_ranks(tp, ep);
    } else {
      MOE_CHECK(tp == 1 && ep == 1, kUnsupported,
                "--tp {} --ep {}: the CPU server runs the model as one rank; parallel ranks need --device cuda", tp, ep);
    }
    MOE_CHECK(port >= 0 && port <= 65535, kInvalidArgument, "--port {} is not a port number", port);

    // Block the shutdown signals before any thread starts, so that only the waiter below sees them.
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGTERM);
    sigaddset(&signals, SIGINT);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);

    MOE_CHECK(fs::is_directory(model_dir), kIo, "model directory {} does not exist", model_dir);
    const std::string tok_path = cli::tokenizer_path(model_dir, tokenizer);
    Tokenizer tok = Tokenizer::from_file(tok_path);
    std::unique_ptr<Model> model;
    std::unique_ptr<cuda::Engine> gpu;
    if (device == "cuda") {
      cuda::EngineOptions eo;
      eo.max_batch = static_cast<int>(cfg.max_batch);
      eo.max_context = cfg.max_context;
      eo.kv_blocks = cfg.kv_blocks;
      eo.block_size = static_cast<int>(cfg.block_size);
      eo.random_weights = random_weights;
      eo.progress = true;
      eo.sampled_vocab = tok.vocab_size();
      eo.tp = tp;
      eo.ep = ep;
      gpu = cuda::Engine::load(model_dir, eo);
    } else {
      LoadOptions lo;
      lo.threads = threads;
      model = Model::load(model_dir, lo);
    }
    const ModelConfig& mc = gpu ? gpu->config() : model->config();
    const fs::path config = fs::path(tok_path).parent_path() / "tokenizer_config.json";
    std::optional<ChatTemplate> chat;
    if (fs::exists(config)) {
      try {
        chat = ChatTemplate::from_tokenizer_config(config.string());
      } catch (const Error& e) {
        std::fprintf(stderr, "no chat template: %s\n", e.what());
      }
    }
    std::unique_ptr<serve::Batcher> scheduler;
    int64_t context = 0;
    if (gpu) {
      serve::GpuSchedulerConfig gc;
      gc.max_step_tokens = cfg.max_step_tokens;
      gc.max_context = cfg.max_context;
      scheduler = std::make_unique<serve::GpuScheduler>(*gpu, gc, &tok);
      context = gpu->options().max_context;
      const cuda::MemoryReport m = gpu->memory();
      std::string gpu_name = "GPU " + std::to_string(gpu->options().device);
      for (const GpuInfo& g : cuda_devices())
        if (g.index == gpu->options().device) gpu_name = g.name;
      if (ep > 1) gpu_name = fmt::format("{} x {} (tp {}, ep {}; sums over all)", ep, gpu_name, tp, ep);
      std::fprintf(stderr, "moe-server: %s: weights %.2f GB, KV cache %lld blocks of %d tokens (%.2f GB), workspace %.2f GB\n",
                   gpu_name.c_str(), m.weights / 1e9,
                   static_cast<long long>(m.kv_blocks), gpu->options().block_size, m.kv_cache / 1e9,
                   m.workspace / 1e9);
    } else {
      context = cfg.max_context > 0 ? cfg.max_context : mc.max_position_embeddings;
      if (cfg.kv_blocks == 0) cfg.kv_blocks = cfg.max_batch * ((context + cfg.block_size - 1) / std::max<int64_t>(cfg.block_size, 1));
      scheduler = std::make_unique<serve::Scheduler>(*model, cfg, &tok);
      std::fprintf(stderr, "moe-server: KV cache of %lld blocks of %lld tokens (%.2f GB)\n",
                   static_cast<long long>(cfg.kv_blocks), static_cast<long long>(cfg.block_size),
                   static_cast<double>(cfg.kv_blocks) * cfg.block_size * mc.num_layers *
                       (mc.kv_key_width() + mc.kv_value_width()) * 4 / 1e9);
    }
    Engine engine(std::move(scheduler));
    Server s{mc, tok, chat, name.empty() ? fs::path(model_dir).filename().string() : name, context, engine};

    httplib::Server http;
    const int workers = http_threads > 0 ? http_threads : static_cast<int>(2 * cfg.max_batch + 8);
    http.new_task_queue = [workers] { return new httplib::ThreadPool(static_cast<size_t>(workers)); };
    http.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"status":"ok"})", "application/json");
    });
    http.Get("/v1/models", [&](const httplib::Request&, httplib::Response& res) {
      json m = {{"object", "list"},
                {"data", json::array({{{"id", s.model_name}, {"object", "model"}, {"created", 0},
                                       {"owned_by", "moe.cpp"}}})}};
      res.set_content(m.dump(), "application/json");
    });
    http.Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
      res.set_content(engine.metrics(), "text/plain; version=0.0.4");
    });
    http.Post("/v1/completions", [&](const httplib::Request& req, httplib::Response& res) {
      s.handle(req, res, false);
    });
    http.Post("/v1/chat/completions", [&](const httplib::Request& req, httplib::Response& res) {
      s.handle(req, res, true);
    });

    const int bound = port == 0 ? http.bind_to_any_port(host) : (http.bind_to_port(host, port) ? port : -1);
    MOE_CHECK(bound > 0, kIo, "cannot listen on {}:{}", host, port);
    std::fprintf(stderr, "moe-server: serving %s on http://%s:%d\n", s.model_name.c_str(), host.c_str(), bound);
    std::fflush(stderr);

    std::atomic<bool> listener_ended{false};
    std::thread waiter([&] {
      int sig = 0;
      sigwait(&signals, &sig);
      if (listener_ended) return;  // woken below: the listener ended on its own
      std::fprintf(stderr, "moe-server: shutting down\n");
      engine.shutdown();  // in-flight requests end as cancelled, so their handlers return
      http.stop();
    });
    http.listen_after_bind();
    listener_ended = true;
    pthread_kill(waiter.native_handle(), SIGTERM);  // blocked everywhere: only sigwait takes it
    waiter.join();
    engine.shutdown();
    return 0;
  });
}
