#include "test_util.h"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <sstream>

namespace moe::test {

namespace fs = std::filesystem;

TempDir::TempDir() {
  static std::atomic<int> counter{0};
  path_ = fs::temp_directory_path() /
          ("moe-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
  fs::remove_all(path_);
  fs::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string safetensors_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string make_f32_safetensors(const std::vector<F32Tensor>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& t : tensors) {
    size_t count = 1;
    for (int64_t d : t.shape) count *= static_cast<size_t>(d);
    std::vector<float> values = t.values;
    if (values.empty())
      for (size_t i = 0; i < count; ++i) values.push_back(0.01f * static_cast<float>(i % 97) - 0.3f);
    size_t begin = data.size();
    data.append(reinterpret_cast<const char*>(values.data()), values.size() * 4);
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {begin, data.size()}}};
  }
  return safetensors_bytes(header.dump(), data);
}

std::string temp_file(const std::string& name, const std::string& content) {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("moe-test-files-" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
  }();
  fs::path path = dir / name;
  write_file(path, content);
  return path.string();
}

void copy_fixture(const std::string& name, const fs::path& dest) {
  fs::copy(fs::path(MOE_SOURCE_DIR) / "tests" / "fixtures" / name, dest,
           fs::copy_options::recursive | fs::copy_options::overwrite_existing);
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

void write_json(const fs::path& path, const nlohmann::json& value) { write_file(path, value.dump(2)); }

EditedFixture::EditedFixture(const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
  copy_fixture(name, dir.path());
  auto cfg = read_json(dir.path() / "config.json");
  edit(cfg);
  write_json(dir.path() / "config.json", cfg);
}

}  // namespace moe::test
