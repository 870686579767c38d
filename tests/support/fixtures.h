// The transformers fixtures: where each lives and its reference.json (logits and greedy tokens
// transformers computed), shared by the CPU and GPU model tests.
#pragma once

#include <gtest/gtest.h>

#include <fstream>
#include <string>

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

}  // namespace moe::test
