// Files of a model directory that are not regular files: a FIFO, a directory, a device or a socket
// in place of the weights, the index, a shard, config.json or tokenizer.json is refused at once
// with a kIo error naming the path and what is there. A FIFO without a writer would block open()
// forever if it were opened like a file: those tests hang (and time out under ctest) on regression.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <string>

#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "io/regular_file.h"
#include "io/safetensors.h"
#include "text/tokenizer.h"
#include "model/config.h"
#include "test_util.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

enum class Kind { kFifo, kDirectory, kDevice, kSocket };

const char* describe(Kind kind) {
  switch (kind) {
    case Kind::kFifo: return "a FIFO";
    case Kind::kDirectory: return "a directory";
    case Kind::kDevice: return "a character device";
    case Kind::kSocket: return "a socket";
  }
  return "";
}

// Puts a non-regular file of `kind` at `path` (the device: a symbolic link to /dev/null, which
// opening would read as an empty file; the socket: bound and left open for the test's duration).
struct Hostile {
  int socket_fd = -1;
  Hostile(const fs::path& path, Kind kind) {
    fs::remove(path);
    switch (kind) {
      case Kind::kFifo:
        EXPECT_EQ(::mkfifo(path.c_str(), 0600), 0) << path;
        break;
      case Kind::kDirectory:
        fs::create_directory(path);
        break;
      case Kind::kDevice:
        fs::create_symlink("/dev/null", path);
        break;
      case Kind::kSocket: {
        socket_fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        const std::string p = path.string();
        EXPECT_LT(p.size(), sizeof addr.sun_path) << p;
        p.copy(addr.sun_path, sizeof addr.sun_path - 1);
        EXPECT_EQ(::bind(socket_fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << p;
        break;
      }
    }
  }
  ~Hostile() {
    if (socket_fd >= 0) ::close(socket_fd);
  }
};

// fn must throw kIo with one line naming `path` and what it is.
void expect_refused(const std::function<void()>& fn, const fs::path& path, Kind kind) {
  SCOPED_TRACE(std::string(describe(kind)) + " at " + path.string());
  const Error e = test::expect_error(fn);
  EXPECT_EQ(e.kind(), ErrorKind::kIo) << e.what();
  EXPECT_NE(e.message().find(path.string()), std::string::npos) << e.what();
  EXPECT_NE(e.message().find(describe(kind)), std::string::npos) << e.what();
  EXPECT_EQ(e.message().find('\n'), std::string::npos) << e.what();
}

constexpr Kind kAllKinds[] = {Kind::kFifo, Kind::kDirectory, Kind::kDevice, Kind::kSocket};

// For each kind: a fresh directory whose `name` is a file of that kind, and `open(dir, path)`
// must refuse it (expect_refused).
void expect_each_kind_refused(const char* name, const std::function<void(const TempDir&, const fs::path&)>& open) {
  for (Kind kind : kAllKinds) {
    TempDir dir;
    const fs::path path = dir.path() / name;
    Hostile h(path, kind);
    expect_refused([&] { open(dir, path); }, path, kind);
  }
}

TEST(RegularFile, SafetensorsFileRefusesOtherFiles) {
  expect_each_kind_refused("model.safetensors",
                           [](const TempDir&, const fs::path& path) { SafetensorsFile f(path.string()); });
}

TEST(RegularFile, CheckpointRefusesOtherWeightsIndexAndShards) {
  const auto open = [](const TempDir& dir, const fs::path&) { Checkpoint c(dir.str()); };
  expect_each_kind_refused("model.safetensors", open);
  expect_each_kind_refused("model.safetensors.index.json", open);
  for (Kind kind : kAllKinds) {  // a shard named by a valid index
    TempDir dir;
    test::write_file(dir.path() / "model.safetensors.index.json",
                     R"({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                          "b": "model-00002-of-00002.safetensors"}})");
    test::write_file(dir.path() / "model-00001-of-00002.safetensors", test::make_f32_safetensors({{"a", {2}, {}}}));
    const fs::path path = dir.path() / "model-00002-of-00002.safetensors";
    Hostile h(path, kind);
    expect_refused([&] { Checkpoint c(dir.str()); }, path, kind);
  }
}

TEST(RegularFile, ConfigRefusesOtherFiles) {
  expect_each_kind_refused("config.json",
                           [](const TempDir&, const fs::path& path) { HfConfig::from_file(path.string()); });
  expect_each_kind_refused("config.json", [](const TempDir& dir, const fs::path&) { load_model_config(dir.str()); });
}

TEST(RegularFile, GenerationConfigRefusesOtherFiles) {
  TempDir dir;
  test::copy_fixture("qwen3_moe_f32", dir.path());
  const fs::path path = dir.path() / "generation_config.json";
  Hostile h(path, Kind::kFifo);
  expect_refused([&] { load_model_config(dir.str()); }, path, Kind::kFifo);
}

TEST(RegularFile, TokenizerRefusesOtherFiles) {
  expect_each_kind_refused("tokenizer.json",
                           [](const TempDir&, const fs::path& path) { Tokenizer::from_file(path.string()); });
  expect_refused([] { Tokenizer::from_file("/dev/null"); }, "/dev/null", Kind::kDevice);
}

TEST(RegularFile, SymbolicLinksToRegularFilesAreRead) {
  TempDir dir;
  test::copy_fixture("qwen3_moe_f32", dir.path() / "real");
  fs::create_directory(dir.path() / "linked");
  for (const auto& entry : fs::directory_iterator(dir.path() / "real"))
    fs::create_symlink(entry.path(), dir.path() / "linked" / entry.path().filename());
  const ModelConfig real = load_model_config((dir.path() / "real").string());
  const ModelConfig linked = load_model_config((dir.path() / "linked").string());
  EXPECT_EQ(linked.num_layers, real.num_layers);
  EXPECT_EQ(linked.hidden_size, real.hidden_size);
  const Checkpoint ckpt((dir.path() / "linked").string());
  EXPECT_EQ(ckpt.names(), Checkpoint((dir.path() / "real").string()).names());
  EXPECT_GT(ckpt.total_bytes(), 0u);
}

TEST(RegularFile, MissingFileNamesThePath) {
  TempDir dir;
  const fs::path path = dir.path() / "config.json";
  const Error e = test::expect_error([&] { HfConfig::from_file(path.string()); });
  EXPECT_EQ(e.kind(), ErrorKind::kIo);
  EXPECT_NE(e.message().find(path.string()), std::string::npos) << e.what();
}

TEST(RegularFile, ReadsUntilEndOfFileAndEnforcesTheLimit) {
  TempDir dir;
  const fs::path path = dir.path() / "f.json";
  test::write_file(path, std::string(10000, 'x') + "end");
  EXPECT_EQ(read_regular_file(path.string(), 10003), std::string(10000, 'x') + "end");
  const Error e = test::expect_error([&] { read_regular_file(path.string(), 10002); });
  EXPECT_EQ(e.kind(), ErrorKind::kIo);
  EXPECT_NE(e.message().find(path.string()), std::string::npos) << e.what();
  EXPECT_NE(e.message().find("10003"), std::string::npos) << e.what();
  // Kernel files report a size of 0 but have content: it is read to the end all the same.
  EXPECT_EQ(RegularFile("/proc/self/status").size(), 0u);
  EXPECT_NE(read_regular_file("/proc/self/status", 1 << 20).find("Name:"), std::string::npos);
}

}  // namespace
}  // namespace moe
