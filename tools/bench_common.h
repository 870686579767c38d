// Shared by the moe-bench subcommands: statistics over repeated runs and JSON output.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

namespace moe::bench {

struct Summary {
  double median = 0, min = 0, max = 0;
};

inline Summary summarize(std::vector<double> v) {
  Summary s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.min = v.front();
  s.max = v.back();
  size_t n = v.size();
  s.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  return s;
}

// The names of a comma-separated list (--modes), empty ones dropped.
inline std::vector<std::string> split_modes(const std::string& list) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    if (comma > at) out.push_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

// Where presets/<name>/config.json live: the source tree this was built from, else ./presets.
std::string preset_dir(const std::string& name);

// The bytes of physical memory, to refuse a workload that cannot fit before allocating it.
double physical_memory_bytes();

}  // namespace moe::bench
