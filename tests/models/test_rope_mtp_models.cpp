// Whole checkpoints as the Hub publishes DeepSeek and Qwen3 with long context: the legacy
// `rope_scaling` spelling, and DeepSeek's multi-token-prediction layer stored after the decoder.
// (Their logits against transformers are in test_fixtures.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "model/model.h"
#include "../unit/test_util.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using test::EditedFixture;
using test::expect_error;

std::string fixture(const std::string& name) { return std::string(MOE_SOURCE_DIR) + "/tests/fixtures/" + name; }

constexpr const char* kMtpFixture = "deepseek_v3_yarn_mtp_legacy_bf16";

std::vector<int32_t> long_ids() {
  std::vector<int32_t> ids;
  for (int32_t i = 0; i < 40; ++i) ids.push_back((29 * i + 7) % 383);
  return ids;
}

// transformers 5 writes rope_parameters; the Hub's configs have rope_scaling beside a top-level
// rope_theta. The same numbers must give the same model, bit for bit, past the original context.
TEST(ScaledRope, LegacySpellingGivesTheSameModel) {
  EditedFixture legacy("qwen3_moe_yarn_f32", [](auto& c) {
    auto params = c["rope_parameters"];
    c.erase("rope_parameters");
    c["rope_theta"] = params["rope_theta"];
    params.erase("rope_theta");
    params["type"] = params["rope_type"];
    params.erase("rope_type");
    c["rope_scaling"] = params;
  });
  auto a = Model::load(legacy.dir.str());
  auto b = Model::load(fixture("qwen3_moe_yarn_f32"));
  EXPECT_EQ(a->config().rope_scaling.type, RopeType::kYarn);
  const auto ids = long_ids();
  KvCache ca = a->new_cache(64), cb = b->new_cache(64);
  Tensor la = a->forward(ids, ca, true), lb = b->forward(ids, cb, true);
  ASSERT_EQ(la.numel(), lb.numel());
  for (int64_t v = 0; v < la.numel(); ++v) ASSERT_EQ(la.data<float>()[v], lb.data<float>()[v]) << v;
  // Dropping the scaling changes the logits past the original context (16 positions): the
  // fixture really exercises it.
  EditedFixture plain("qwen3_moe_yarn_f32", [](auto& c) { c["rope_parameters"] = {{"rope_theta", 10000.0}}; });
  auto p = Model::load(plain.dir.str());
  KvCache cp = p->new_cache(64);
  Tensor lp = p->forward(ids, cp, true);
  float differ = 0;
  for (int64_t v = 0; v < lp.numel(); ++v) differ = std::max(differ, std::fabs(lp.data<float>()[v] - lb.data<float>()[v]));
  EXPECT_GT(differ, 1e-2f);
}

// Qwen3's recipe adds YaRN (factor 4 over 32,768) to a config of 40,960 positions: the context
// is the stretched one. DeepSeek's configs already say 163,840 = 40 x 4,096.
TEST(ScaledRope, YarnStretchesTheContext) {
  EditedFixture qwen("qwen3_moe_yarn_f32", [](auto& c) {
    c["max_position_embeddings"] = 40960;
    c["rope_parameters"]["original_max_position_embeddings"] = 32768;
  });
  EXPECT_EQ(load_model_config(qwen.dir.str()).max_position_embeddings, 131072);
  const ModelConfig v3 = load_model_config(std::string(MOE_SOURCE_DIR) + "/presets/deepseek-v3");
  EXPECT_EQ(v3.max_position_embeddings, 163840);
  EXPECT_EQ(v3.rope_scaling.type, RopeType::kYarn);
  EXPECT_EQ(v3.num_nextn_predict_layers, 1);
  const double m = 0.1 * std::log(40.0) + 1.0;  // mscale_all_dim 1
  EXPECT_NEAR(v3.softmax_scale_factor, m * m, 1e-6);
  const ModelConfig lite = load_model_config(std::string(MOE_SOURCE_DIR) + "/presets/deepseek-v2-lite");
  const double ml = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_NEAR(lite.softmax_scale_factor, ml * ml, 1e-6);
}

// The count of the MTP layer's tensors, read from the index the checkpoint ships.
int64_t mtp_tensors_in_index(const fs::path& dir, int64_t layer) {
  const auto index = test::read_json(dir / "model.safetensors.index.json");
  const std::string prefix = "model.layers." + std::to_string(layer) + ".";
  int64_t n = 0;
  for (const auto& [name, file] : index["weight_map"].items()) n += name.starts_with(prefix);
  return n;
}

TEST(MtpLayer, SkippedWithOneNote) {
  const std::string dir = fixture(kMtpFixture);
  const int64_t expected = mtp_tensors_in_index(dir, 3);
  ASSERT_GT(expected, 6);  // a whole decoder layer plus embed_tokens, enorm, hnorm, eh_proj, shared_head
  ::testing::internal::CaptureStderr();
  auto model = Model::load(dir);  // strict by default
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(model->config().num_nextn_predict_layers, 1);
  EXPECT_EQ(model->config().num_layers, 3);
  const std::string note = "note: skipped " + std::to_string(expected) +
                           " tensors of the multi-token-prediction layer model.layers.3 (num_nextn_predict_layers 1)";
  EXPECT_NE(err.find(note), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
}

TEST(MtpLayer, StrictLoadingStaysStrictForEveryOtherTensor) {
  // Without num_nextn_predict_layers the same tensors are unexpected.
  EditedFixture none(kMtpFixture, [](auto& c) { c["num_nextn_predict_layers"] = 0; });
  auto e = expect_error([&] { Model::load(none.dir.str()); });
  EXPECT_EQ(e.kind(), ErrorKind::kShape);
  EXPECT_NE(e.message().find("unexpected tensors 'model.layers.3."), std::string::npos) << e.message();

  // A tensor of a layer past the MTP layers is still an error, and names itself.
  EditedFixture extra(kMtpFixture, [](auto&) {});
  test::write_file(extra.dir.path() / "extra.safetensors",
                   test::make_f32_safetensors({{"model.layers.4.stray.weight", {2, 2}, {}}}));
  auto index = test::read_json(extra.dir.path() / "model.safetensors.index.json");
  index["weight_map"]["model.layers.4.stray.weight"] = "extra.safetensors";
  test::write_json(extra.dir.path() / "model.safetensors.index.json", index);
  e = expect_error([&] { Model::load(extra.dir.str()); });
  EXPECT_EQ(e.kind(), ErrorKind::kShape);
  EXPECT_NE(e.message().find("'model.layers.4.stray.weight'"), std::string::npos) << e.message();

  // Read as a fourth decoder layer, the MTP layer's own tensors (eh_proj, enorm, ...) are left
  // over, and the skipped prefix moves to a layer that does not exist.
  EditedFixture deeper(kMtpFixture, [](auto& c) { c["num_hidden_layers"] = 4; });
  e = expect_error([&] { Model::load(deeper.dir.str()); });
  EXPECT_EQ(e.kind(), ErrorKind::kShape);
  EXPECT_NE(e.message().find("model.layers.3.e"), std::string::npos) << e.message();
}

}  // namespace
}  // namespace moe
