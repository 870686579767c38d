// FP8 block-scaled weights as DeepSeek-V3 and Qwen3-*-FP8 store them: the E4M3 and E5M2 codes
// against values known from the formats' definitions, the loader's exact q x scale over partial
// edge blocks, quantization_config's checks, and every bad layout refused with one line naming the
// tensor. Checkpoints are written here byte by byte.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/arena.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "model/quantization.h"
#include "moe/errors.h"
#include "test_util.h"

namespace moe {
namespace {

using test::expect_error;
using test::TempDir;

TEST(Fp8Codes, E4M3DecodesToTheFormatsValues) {
  EXPECT_EQ(f8e4m3_to_f32(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(f8e4m3_to_f32(0x80)));
  EXPECT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(f8e4m3_to_f32(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(f8e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // the smallest normal
  EXPECT_EQ(f8e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x3f), 1.875f);
  EXPECT_EQ(f8e4m3_to_f32(0x40), 2.0f);
  EXPECT_EQ(f8e4m3_to_f32(0xb8), -1.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x7e), 448.0f);  // the largest: no infinities in E4M3
  EXPECT_EQ(f8e4m3_to_f32(0xfe), -448.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x78), 256.0f);
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0xff)));
  int nans = 0;
  for (int q = 0; q < 256; ++q) nans += std::isnan(f8e4m3_to_f32(static_cast<uint8_t>(q)));
  EXPECT_EQ(nans, 2);
}

TEST(Fp8Codes, E5M2DecodesToTheFormatsValues) {
  EXPECT_EQ(f8e5m2_to_f32(0x3c), 1.0f);
  EXPECT_EQ(f8e5m2_to_f32(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(f8e5m2_to_f32(0x7b), 57344.0f);
  EXPECT_EQ(f8e5m2_to_f32(0x7c), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(f8e5m2_to_f32(0x7d)));
}

// One tensor of a hand-written checkpoint.
struct Raw {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

std::string f32_bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

void write_checkpoint(const TempDir& dir, const std::vector<Raw>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const Raw& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  test::write_file(dir.path() / "model.safetensors", test::safetensors_bytes(header.dump(), data));
}

// A [130, 260] weight in 128 x 128 blocks: 2 x 3 blocks, the last row and column partial. Codes
// cycle over four values known exactly (1, 2, -1, 0.5); each block has its own scale.
constexpr int64_t kRows = 130, kCols = 260;
const uint8_t kCodes[] = {0x38, 0x40, 0xb8, 0x30};
const float kCodeValue[] = {1.0f, 2.0f, -1.0f, 0.5f};
const std::vector<float> kScales = {0.25f, 3.0f, 1e-3f, 7.5f, 0.125f, 2.0f};

std::string weight_codes() {
  std::string b(static_cast<size_t>(kRows * kCols), '\0');
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<char>(kCodes[(i * 7 + i / kCols) % 4]);
  return b;
}

std::vector<Raw> good_tensors() {
  return {{"w.weight", "F8_E4M3", {kRows, kCols}, weight_codes()},
          {"w.weight_scale_inv", "F32", {2, 3}, f32_bytes(kScales)}};
}

// Loads "w.weight" with FP8 blocks of 128 x 128 (or none), through a sink when `via_sink`.
std::vector<float> load_w(const TempDir& dir, bool fp8 = true, std::vector<std::string> kept = {}) {
  Checkpoint ckpt(dir.str());
  Arena arena("fp8 test", 1 << 20);
  WeightLoader loader(ckpt, arena, true);
  if (fp8) loader.set_fp8_blocks(128, 128, std::move(kept));
  Tensor t = loader.take("w.weight", {kRows, kCols});
  loader.finish();  // strict: the scale counts as taken
  EXPECT_EQ(loader.fp8_tensors(), 1);
  return std::vector<float>(t.data<float>(), t.data<float>() + kRows * kCols);
}

TEST(Fp8Weights, EveryElementIsItsCodeTimesItsBlocksScale) {
  TempDir dir;
  write_checkpoint(dir, good_tensors());
  const std::vector<float> w = load_w(dir);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kCols; ++c) {
      const size_t i = static_cast<size_t>(r * kCols + c);
      const float want = kCodeValue[(i * 7 + i / kCols) % 4] * kScales[static_cast<size_t>((r / 128) * 3 + c / 128)];
      ASSERT_EQ(w[i], want) << "[" << r << ", " << c << "]";
    }
}

// A sink receives the values in bounded chunks; they must be the same as the host's.
TEST(Fp8Weights, ASinkReceivesTheSameValues) {
  struct Collect : WeightSink {
    std::vector<float> got;
    void write(float*, const float* values, size_t count) override { got.insert(got.end(), values, values + count); }
  };
  TempDir dir;
  write_checkpoint(dir, good_tensors());
  Checkpoint ckpt(dir.str());
  auto layout = Arena::address_space("layout", 1 << 20);
  WeightLoader loader(ckpt, *layout, true);
  Collect sink;
  loader.set_sink(&sink);
  loader.set_fp8_blocks(128, 128, {});
  loader.take("w.weight", {kRows, kCols});
  loader.finish();
  EXPECT_EQ(sink.got, load_w(dir));
}

// Each bad layout: one line naming the tensor (or scale) and what is wrong.
void expect_refused(const std::vector<Raw>& tensors, const std::string& words, bool fp8 = true,
                    std::vector<std::string> kept = {}) {
  TempDir dir;
  write_checkpoint(dir, tensors);
  const Error e = expect_error([&] { load_w(dir, fp8, kept); });
  EXPECT_NE(e.message().find(words), std::string::npos) << e.message();
  EXPECT_EQ(e.message().find('\n'), std::string::npos) << e.message();
}

TEST(Fp8Weights, BadLayoutsAreRefusedNamingTheTensor) {
  const Raw w = good_tensors()[0], s = good_tensors()[1];
  expect_refused({w}, "FP8 tensor 'w.weight' has no scale tensor 'w.weight_scale_inv'");
  expect_refused({w, {s.name, "F32", {3, 2}, s.bytes}},
                 "scale 'w.weight_scale_inv' has shape [3, 2], but w.weight [130, 260] in 128 x 128 blocks needs [2, 3]");
  std::vector<float> bad = kScales;
  bad[4] = std::numeric_limits<float>::infinity();
  expect_refused({w, {s.name, "F32", {2, 3}, f32_bytes(bad)}}, "scale 'w.weight_scale_inv' holds inf at block [1, 1]");
  bad = kScales;
  bad[2] = 0.0f;
  expect_refused({w, {s.name, "F32", {2, 3}, f32_bytes(bad)}}, "holds 0 at block [0, 2]; scales must be finite and positive");
  expect_refused({{w.name, "F8_E5M2", w.shape, w.bytes}, s},
                 "tensor 'w.weight' is F8_E5M2, but quantization_config declares e4m3 weights");
  expect_refused(good_tensors(), "tensor 'w.weight' is f8_e4m3 but config.json declares no FP8 quantization_config",
                 false);
  expect_refused(good_tensors(), "tensor 'w.weight' is FP8, but quantization_config lists 'w' in modules_to_not_convert",
                 true, {"lm_head", "w"});
  std::string nan_codes = w.bytes;
  nan_codes[static_cast<size_t>(129 * kCols + 259)] = static_cast<char>(0x7f);
  expect_refused({{w.name, w.dtype, w.shape, nan_codes}, s}, "FP8 tensor 'w.weight' holds NaN at [129, 259]");
}

Quantization parse(const nlohmann::json& qc) {
  nlohmann::json c = {{"quantization_config", qc}};
  return parse_quantization(HfConfig(c, "config.json"));
}

TEST(Fp8Weights, QuantizationConfigIsCheckedBeforeAnyWeight) {
  // DeepSeek-V3's and Qwen3-30B-A3B-FP8's, as published.
  const Quantization v3 = parse({{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
                                 {"weight_block_size", {128, 128}}});
  EXPECT_TRUE(v3.fp8);
  EXPECT_EQ(v3.weight_format().name(), "f8_e4m3 (128 x 128 blocks)");
  const Quantization qwen = parse({{"activation_scheme", "dynamic"}, {"quant_method", "fp8"},
                                   {"modules_to_not_convert", {"lm_head", "model.layers.0.mlp.gate"}},
                                   {"weight_block_size", {128, 128}}});
  EXPECT_EQ(qwen.modules_to_not_convert.size(), 2u);
  EXPECT_EQ(parse({{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}, {"scale_fmt", "ue8m0"}}).scale_fmt, "ue8m0");
  EXPECT_FALSE(parse_quantization(HfConfig(nlohmann::json::object(), "c")).fp8);
  struct Case {
    nlohmann::json qc;
    ErrorKind kind;
    const char* says;
  };
  const Case cases[] = {
      {{{"quant_method", "gptq"}}, ErrorKind::kUnsupported, "quant_method 'gptq' is not supported; supported: quant_method fp8"},
      {{{"quant_method", "fp8"}, {"weight_block_size", {64, 64}}}, ErrorKind::kUnsupported,
       "weight_block_size [64, 64] is not a block the engine runs"},
      {{{"quant_method", "fp8"}}, ErrorKind::kUnsupported, "FP8 without weight_block_size"},
      {{{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}, {"fmt", "e5m2"}}, ErrorKind::kUnsupported,
       "fmt 'e5m2' is not supported"},
      {{{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}, {"activation_scheme", "static"}},
       ErrorKind::kUnsupported, "activation_scheme 'static'"},
      {{{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}, {"kv_cache_scheme", "fp8"}}, ErrorKind::kUnsupported,
       "key 'kv_cache_scheme' is not supported"},
      {{{"quant_method", "fp8"}, {"weight_block_size", {128}}}, ErrorKind::kConfig, "is not two integers"},
      {{{"weight_block_size", {128, 128}}}, ErrorKind::kConfig, "has no quant_method"},
      {{{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}, {"scale_fmt", "e5m3"}}, ErrorKind::kUnsupported,
       "scale_fmt 'e5m3' is not supported"},
      {{{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}, {"modules_to_not_convert", "lm_head"}},
       ErrorKind::kConfig, "modules_to_not_convert is not a list"},
      {"fp8", ErrorKind::kConfig, "is not an object"},
  };
  for (const Case& c : cases) {
    const Error e = expect_error([&] { parse(c.qc); });
    EXPECT_EQ(e.kind(), c.kind) << e.message();
    EXPECT_NE(e.message().find(c.says), std::string::npos) << e.message();
  }
}

}  // namespace
}  // namespace moe
