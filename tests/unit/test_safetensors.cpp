// Malformed safetensors files and model directories: each must give a typed error naming the
// problem, never a crash.
#include <gtest/gtest.h>

#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace moe {
namespace {

using test::expect_error;
using test::TempDir;

std::string one_tensor_header(const std::string& dtype, const std::string& shape,
                              const std::string& offsets) {
  return "{\"w\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":" + offsets +
         "}}";
}

TEST(Safetensors, ReadsValidFile) {
  TempDir dir;
  test::write_file(dir.path() / "a.safetensors",
                   test::make_f32_safetensors({{"x", {2, 3}, {1, 2, 3, 4, 5, 6}}, {"y", {4}, {}}}));
  SafetensorsFile file((dir.path() / "a.safetensors").string());
  ASSERT_EQ(file.tensors().size(), 2u);
  const TensorInfo* x = file.find("x");
  ASSERT_NE(x, nullptr);
  EXPECT_EQ(x->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(static_cast<const float*>(file.data(*x))[5], 6.0f);
  EXPECT_EQ(file.find("z"), nullptr);
}

TEST(Safetensors, MissingFile) {
  auto e = expect_error([] { SafetensorsFile("/nonexistent/model.safetensors"); });
  EXPECT_EQ(e.kind(), ErrorKind::kIo);
  EXPECT_NE(e.message().find("/nonexistent/model.safetensors"), std::string::npos);
}

TEST(Safetensors, ShorterThanHeaderLength) {
  TempDir dir;
  test::write_file(dir.path() / "t.safetensors", std::string("\x05\x00\x00", 3));
  auto e = expect_error([&] { SafetensorsFile((dir.path() / "t.safetensors").string()); });
  EXPECT_EQ(e.kind(), ErrorKind::kIo);
  EXPECT_NE(e.message().find("truncated"), std::string::npos);
}

TEST(Safetensors, HeaderLengthLargerThanFile) {
  TempDir dir;
  std::string bytes = test::safetensors_bytes("{}", "");
  bytes[0] = '\x40';  // claims a 64-byte header in a 10-byte file
  test::write_file(dir.path() / "t.safetensors", bytes);
  auto e = expect_error([&] { SafetensorsFile((dir.path() / "t.safetensors").string()); });
  EXPECT_EQ(e.kind(), ErrorKind::kIo);
  EXPECT_NE(e.message().find("larger than the file"), std::string::npos);
}

TEST(Safetensors, TruncatedData) {
  TempDir dir;
  std::string bytes = test::make_f32_safetensors({{"x", {16}, {}}});
  test::write_file(dir.path() / "t.safetensors", bytes.substr(0, bytes.size() - 5));
  auto e = expect_error([&] { SafetensorsFile((dir.path() / "t.safetensors").string()); });
  EXPECT_EQ(e.kind(), ErrorKind::kFormat);
  EXPECT_NE(e.message().find("past the end"), std::string::npos);
}

// Headers refused as malformed, each with the part of the message that names what is wrong
// (empty: the kind alone is checked).
TEST(Safetensors, MalformedHeadersAreRefused) {
  struct Case {
    std::string header;
    size_t data_bytes;
    const char* names;
  };
  const Case cases[] = {
      {"{not json", 0, ""},
      {one_tensor_header("F32", "[2]", "[0, 8]"), 4, "'w'"},  // offsets past the data
      {one_tensor_header("F32", "[0]", "[8, 0]"), 16, ""},      // offsets reversed
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
       12, "overlap"},
      {one_tensor_header("F32", "[3]", "[0, 8]"), 8, ""},  // size disagrees with the shape
      {one_tensor_header("I64", "[1]", "[0, 8]"), 8, "I64"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.header);
    auto e = expect_error([&] { parse_safetensors_header(c.header, c.data_bytes, "f"); });
    EXPECT_EQ(e.kind(), ErrorKind::kFormat);
    EXPECT_NE(e.message().find(c.names), std::string::npos) << e.message();
  }
}

TEST(Safetensors, NegativeOrFractionalDimension) {
  EXPECT_EQ(expect_error([] { parse_safetensors_header(one_tensor_header("F32", "[-1]", "[0, 0]"), 8, "f"); }).kind(),
            ErrorKind::kFormat);
  EXPECT_EQ(expect_error([] { parse_safetensors_header(one_tensor_header("F32", "[1.5]", "[0, 4]"), 8, "f"); }).kind(),
            ErrorKind::kFormat);
}

TEST(Safetensors, HugeShapeDoesNotOverflow) {
  auto e = expect_error([] {
    parse_safetensors_header(one_tensor_header("F32", "[1099511627775, 1099511627775]", "[0, 4]"), 8, "f");
  });
  EXPECT_EQ(e.kind(), ErrorKind::kFormat);
}

// Opening the checkpoint in `dir` fails with `kind`, the message naming `fragment` (if any).
void expect_checkpoint_refused(const TempDir& dir, ErrorKind kind, const std::string& fragment = "") {
  const auto e = expect_error([&] { Checkpoint ckpt(dir.str()); });
  EXPECT_EQ(e.kind(), kind) << e.message();
  EXPECT_NE(e.message().find(fragment), std::string::npos) << e.message();
}

TEST(Checkpoint, NoWeightsInDirectory) {
  TempDir dir;
  expect_checkpoint_refused(dir, ErrorKind::kIo, "model.safetensors");
}

TEST(Checkpoint, IndexNamesMissingTensor) {
  TempDir dir;
  test::write_file(dir.path() / "model-00001-of-00001.safetensors",
                   test::make_f32_safetensors({{"x", {2}, {}}}));
  test::write_file(dir.path() / "model.safetensors.index.json",
                   R"({"weight_map": {"x": "model-00001-of-00001.safetensors",
                                      "y": "model-00001-of-00001.safetensors"}})");
  expect_checkpoint_refused(dir, ErrorKind::kFormat, "'y'");
}

TEST(Checkpoint, IndexNamesMissingShard) {
  TempDir dir;
  test::write_file(dir.path() / "model.safetensors.index.json",
                   R"({"weight_map": {"x": "model-00001-of-00002.safetensors"}})");
  expect_checkpoint_refused(dir, ErrorKind::kIo);
}

TEST(Checkpoint, IndexShardOutsideDirectory) {
  TempDir dir;
  test::write_file(dir.path() / "model.safetensors.index.json",
                   R"({"weight_map": {"x": "../elsewhere.safetensors"}})");
  expect_checkpoint_refused(dir, ErrorKind::kFormat);
}

TEST(WeightLoader, StrictReportsMissingUnexpectedAndWrongShape) {
  TempDir dir;
  test::write_file(dir.path() / "model.safetensors",
                   test::make_f32_safetensors({{"a", {2, 2}, {}}, {"b", {3}, {}}}));
  Checkpoint ckpt(dir.str());
  Arena arena("w", 1 << 16);
  {
    WeightLoader loader(ckpt, arena, true);
    auto e = expect_error([&] { loader.take("a", {4}); });
    EXPECT_EQ(e.kind(), ErrorKind::kShape);
    EXPECT_NE(e.message().find("'a'"), std::string::npos);
    EXPECT_NE(e.message().find("[2, 2]"), std::string::npos);
    e = expect_error([&] { loader.take("c", {1}); });
    EXPECT_EQ(e.kind(), ErrorKind::kShape);
    EXPECT_NE(e.message().find("'c'"), std::string::npos);
    loader.take("a", {2, 2});
    e = expect_error([&] { loader.finish(); });
    EXPECT_NE(e.message().find("unexpected tensor 'b'"), std::string::npos);
  }
  {
    WeightLoader loader(ckpt, arena, false);
    Tensor a = loader.take("a", {2, 2});
    EXPECT_FLOAT_EQ(a.data<float>()[1], 0.01f - 0.3f);
    EXPECT_FALSE(loader.take_if_present("missing", {1}).defined());
    loader.finish();  // non-strict: leftovers are fine
  }
}

}  // namespace
}  // namespace moe
