// Helpers for tests that build small model directories and safetensors files on the fly.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "moe/errors.h"

namespace moe::test {

// A fresh directory under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

void write_file(const std::filesystem::path& path, const std::string& bytes);
std::string read_file(const std::filesystem::path& path);

// The raw bytes of a safetensors file: header length, header text, data.
std::string safetensors_bytes(const std::string& header, const std::string& data);

// A safetensors file of f32 tensors with consecutive offsets.
struct F32Tensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;  // empty: filled with small deterministic values
};
std::string make_f32_safetensors(const std::vector<F32Tensor>& tensors);

// Copies a fixture directory (tests/fixtures/<name>) to `dest`.
void copy_fixture(const std::string& name, const std::filesystem::path& dest);

nlohmann::json read_json(const std::filesystem::path& path);
void write_json(const std::filesystem::path& path, const nlohmann::json& value);

// A copy of a fixture whose config.json has been edited by `edit`.
struct EditedFixture {
  TempDir dir;
  EditedFixture(const std::string& name, const std::function<void(nlohmann::json&)>& edit);
};

// Runs `fn` and returns the moe::Error it throws; fails the test when it throws nothing.
template <typename Fn>
Error expect_error(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e;
  }
  throw std::runtime_error("expected a moe::Error, but nothing was thrown");
}

// Runs `fn` and returns the kind of the moe::Error it throws (and its message); records a test
// failure when it throws nothing.
template <typename Fn>
ErrorKind error_kind_of(Fn&& fn, std::string* message = nullptr) {
  try {
    fn();
  } catch (const Error& e) {
    if (message) *message = e.what();
    return e.kind();
  }
  ADD_FAILURE() << "no moe::Error was thrown";
  return ErrorKind::kInternal;
}

// Writes `content` to a file named `name` in a per-run temporary directory; returns its path.
std::string temp_file(const std::string& name, const std::string& content);

}  // namespace moe::test
