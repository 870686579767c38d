// libFuzzer target for the config parser: the input is written as config.json into a temporary
// model directory (created once, reused) and loaded with moe::load_model_config. An accepted
// config is expanded into its tensor list with moe::state_dict_keys and moe::parameter_count.
//
// A moe::Error is a normal outcome. Anything else is a finding: another exception escaping the
// library (e.g. a JSON type error or std::bad_alloc), a crash, a sanitizer report, or a run over
// libFuzzer's -rss_limit_mb / -malloc_limit_mb / -timeout.
//
// The tensor list holds about num_layers * (3 * num_experts + 20) entries, so an accepted config
// with millions of layers or experts would make the harness allocate gigabytes. Such configs are
// not expanded: the count is estimated from the parsed numbers first. (Bounds on these numbers
// belong in the config validation itself; this guard keeps the harness useful either way.)
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>

#include "model/config.h"
#include "model/model.h"
#include "moe/errors.h"

namespace {

// About 5 times DeepSeek-V3's tensor count (61 layers of 256 experts).
constexpr double kMaxTensors = 250000;

[[noreturn]] void die(const char* what, size_t size) {
  std::fprintf(stderr, "fuzz_config: %s (input of %zu bytes)\n", what, size);
  std::abort();
}

// The temporary model directory, created on first use and removed at exit.
struct ModelDir {
  std::string path =
      (std::filesystem::temp_directory_path() / "moe-fuzz-config-XXXXXX").string();
  ModelDir() {
    if (!::mkdtemp(path.data())) {
      std::perror("fuzz_config: mkdtemp");
      std::exit(1);
    }
  }
  ~ModelDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

const std::string& model_dir() {
  static const ModelDir dir;
  return dir.path;
}

void write_config(const uint8_t* data, size_t size) {
  const std::string path = model_dir() + "/config.json";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(data, 1, size, f) != size || std::fclose(f) != 0) {
    std::perror("fuzz_config: writing config.json");
    std::exit(1);
  }
}

// Tensors that state_dict_keys would list, estimated from the config (as a double: the fields
// are untrusted and their product may not fit an integer).
double estimated_tensors(const moe::ModelConfig& mc) {
  const double experts = mc.moe.num_experts > 0 ? static_cast<double>(mc.moe.num_experts) : 0.0;
  return static_cast<double>(mc.num_layers) * (3.0 * experts + 20.0) + 8.0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  write_config(data, size);
  try {
    const moe::ModelConfig mc = moe::load_model_config(model_dir());
    if (estimated_tensors(mc) > kMaxTensors) return 0;
    const auto keys = moe::state_dict_keys(mc);
    if (keys.empty()) die("an accepted config lists no tensors", size);
    (void)moe::parameter_count(mc);
  } catch (const moe::Error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_config: %s\n", e.what());
    die("an exception other than moe::Error escaped", size);
  }
  return 0;
}
