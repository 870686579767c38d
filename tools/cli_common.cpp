#include "cli_common.h"

#include <cstdio>
#include <filesystem>

#include <fmt/format.h>

#include "moe/errors.h"

namespace moe::cli {

int guarded(const std::function<int()>& body) {
  try {
    return body();
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.message().c_str());
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "error: out of memory\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  return 1;
}

int parse_args(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return -1;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::string what = e.what();
    for (char& c : what)
      if (c == '\n') c = ' ';
    std::fprintf(stderr, "error: %s\n", what.c_str());
    return 1;  // as guarded()
  }
}

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    std::string item = text.substr(start, comma == std::string::npos ? comma : comma - start);
    size_t first = item.find_first_not_of(" \t"), last = item.find_last_not_of(" \t");
    item = first == std::string::npos ? "" : item.substr(first, last - first + 1);
    if (!item.empty() || comma != std::string::npos) {
      size_t used = 0;
      long long value = 0;
      try {
        value = std::stoll(item, &used);
      } catch (...) {
        used = 0;
      }
      MOE_CHECK(!item.empty() && used == item.size() && value >= INT32_MIN && value <= INT32_MAX,
                kInvalidArgument, "'{}' is not a token id (expected integers like 3,17,42)", item);
      ids.push_back(static_cast<int32_t>(value));
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return ids;
}

std::string tokenizer_path(const std::string& model_dir, const std::string& explicit_path) {
  namespace fs = std::filesystem;
  std::string path = explicit_path.empty() ? (fs::path(model_dir) / "tokenizer.json").string()
                                           : explicit_path;
  // Something that is there but is no regular file is reported by the tokenizer's own open.
  MOE_CHECK(fs::exists(fs::symlink_status(path)), kIo,
            "no tokenizer at {} (pass --tokenizer FILE; for the bundled demo model run "
            "scripts/fetch_tokenizers.sh)",
            path);
  return path;
}

std::string format_float(float value) { return fmt::format("{}", value); }

std::string format_bytes(double bytes) {
  if (bytes >= 1e9) return fmt::format("{:.3f} GB", bytes / 1e9);
  if (bytes >= 1e6) return fmt::format("{:.2f} MB", bytes / 1e6);
  if (bytes >= 1e3) return fmt::format("{:.1f} KB", bytes / 1e3);
  return fmt::format("{:.0f} B", bytes);
}

void add_parallel_flags(CLI::App* app, const ParallelFlags& flags) {
  app->add_option("--ep", *flags.ep, "expert-parallel ranks holding 1/ep of the routed experts each: threads on "
                                     "the CPU, GPUs with --device cuda")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app->add_option("--tp", *flags.tp, "cuda: tensor-parallel attention over the --ep GPUs (1 or the --ep value), or under --dp over "
                                     "each attention group's GPUs (--dp x --tp = --ep)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app->add_option("--dp", *flags.dp,
                  "cuda: data-parallel attention, --dp groups of --tp GPUs each running attention for its own "
                  "sequences with its own KV cache (--dp x --tp = --ep, with an exchanging --ep-backend)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  app->add_option("--ep-backend", *flags.ep_backend,
                  "how tokens reach the experts of other ranks: local_allreduce | allgather_reducescatter | "
                  "alltoall_padded | alltoall_packed | p2p (cuda)")
      ->capture_default_str();
}

}  // namespace moe::cli
