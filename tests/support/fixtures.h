// The transformers fixtures: where each lives and its reference.json (logits and greedy tokens
// transformers computed), shared by the CPU and GPU model tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moe::test {

inline std::string fixture_dir(const std::string& name) {
  if (name == "tiny_qwen3_moe") return std::string(MOE_SOURCE_DIR) + "/models/tiny-qwen3-moe";
  return std::string(MOE_SOURCE_DIR) + "/tests/fixtures/" + name;
}

inline nlohmann::json reference(const std::string& dir) {
  std::ifstream in(dir + "/reference.json");
  EXPECT_TRUE(in.good()) << "missing " << dir << "/reference.json";
  return nlohmann::json::parse(in);
}

// Input i of a reference's greedy cases: the prompt, transformers' greedy tokens, and the prompt
// followed by all of them but the last (the teacher-forced sequence, whose logits from the
// prompt's last position on decide each greedy token).
struct GreedyCase {
  std::vector<int32_t> ids, expected, sequence;
};

inline GreedyCase greedy_case(const nlohmann::json& ref, size_t i) {
  GreedyCase c{ref["inputs"][i].get<std::vector<int32_t>>(), ref["greedy"][i].get<std::vector<int32_t>>(), {}};
  c.sequence = c.ids;
  c.sequence.insert(c.sequence.end(), c.expected.begin(), c.expected.end() - 1);
  return c;
}

}  // namespace moe::test
