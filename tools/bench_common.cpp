#include "bench_common.h"

#include <unistd.h>

#include <filesystem>

#include "moe/errors.h"

namespace moe::bench {

std::string preset_dir(const std::string& name) {
  namespace fs = std::filesystem;
  for (fs::path root : {fs::path(MOE_SOURCE_DIR) / "presets", fs::path("presets")}) {
    fs::path dir = root / name;
    if (fs::exists(dir / "config.json")) return dir.string();
  }
  std::string known;
  for (fs::path root : {fs::path(MOE_SOURCE_DIR) / "presets", fs::path("presets")}) {
    if (!fs::is_directory(root)) continue;
    for (const auto& e : fs::directory_iterator(root))
      if (fs::exists(e.path() / "config.json")) known += (known.empty() ? "" : ", ") + e.path().filename().string();
    break;
  }
  MOE_THROW(kInvalidArgument, "unknown preset '{}' (known: {})", name, known.empty() ? "none found" : known);
}

double physical_memory_bytes() {
  return static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
}

}  // namespace moe::bench
