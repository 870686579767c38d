// Bad model directories and bad inputs to a loaded model: typed errors, never a crash.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>

#include "io/hf_config.h"
#include "model/model.h"
#include "test_util.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using test::expect_error;
using test::TempDir;

using test::EditedFixture;
using test::read_json;
using test::write_json;

TEST(HfConfig, AliasesAndNestedKeys) {
  HfConfig cfg(nlohmann::json::parse(R"({"num_local_experts": 8, "rope_parameters": {"rope_theta": 5.0},
                                        "q_lora_rank": null, "flag": "yes"})"),
               "config.json");
  EXPECT_EQ(cfg.get<int>({"num_experts", "num_local_experts"}), 8);
  EXPECT_EQ(cfg.get<float>({"rope_theta", "rope_parameters.rope_theta"}), 5.0f);
  EXPECT_FALSE(cfg.has({"q_lora_rank"}));  // null counts as absent
  EXPECT_EQ(cfg.get_or<int>({"q_lora_rank"}, 7), 7);
  auto e = expect_error([&] { cfg.get<int>({"hidden_size", "d_model"}); });
  EXPECT_EQ(e.kind(), ErrorKind::kConfig);
  EXPECT_NE(e.message().find("'hidden_size' or 'd_model'"), std::string::npos);
  e = expect_error([&] { cfg.get<bool>({"flag"}); });
  EXPECT_EQ(e.kind(), ErrorKind::kConfig);
}

TEST(ModelErrors, MissingDirectoryConfigOrWeights) {
  EXPECT_EQ(expect_error([] { Model::load("/nonexistent/model"); }).kind(), ErrorKind::kIo);
  TempDir dir;
  test::copy_fixture("qwen3_dense_f32", dir.path());
  fs::remove(dir.path() / "config.json");
  auto e = expect_error([&] { Model::load(dir.str()); });
  EXPECT_EQ(e.kind(), ErrorKind::kIo);
  EXPECT_NE(e.message().find("config.json"), std::string::npos);
  TempDir dir2;
  test::copy_fixture("qwen3_dense_f32", dir2.path());
  fs::remove(dir2.path() / "model.safetensors");
  e = expect_error([&] { Model::load(dir2.str()); });
  EXPECT_EQ(e.kind(), ErrorKind::kIo);
  EXPECT_NE(e.message().find("model.safetensors"), std::string::npos);
}

TEST(ModelErrors, TruncatedWeights) {
  TempDir dir;
  test::copy_fixture("qwen3_dense_f32", dir.path());
  fs::resize_file(dir.path() / "model.safetensors", 1000);
  auto e = expect_error([&] { Model::load(dir.str()); });
  EXPECT_TRUE(e.kind() == ErrorKind::kIo || e.kind() == ErrorKind::kFormat) << e.what();
}

TEST(ModelErrors, UnknownArchitectureListsSupported) {
  EditedFixture f("qwen3_dense_f32", [](auto& c) { c["architectures"] = {"GPT2LMHeadModel"}; });
  auto e = expect_error([&] { Model::load(f.dir.str()); });
  EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
  EXPECT_NE(e.message().find("GPT2LMHeadModel"), std::string::npos);
  EXPECT_NE(e.message().find("Qwen3MoeForCausalLM"), std::string::npos);
}

TEST(ModelErrors, MissingConfigKeyIsNamed) {
  EditedFixture f("qwen3_moe_f32", [](auto& c) { c.erase("moe_intermediate_size"); });
  auto e = expect_error([&] { Model::load(f.dir.str()); });
  EXPECT_EQ(e.kind(), ErrorKind::kConfig);
  EXPECT_NE(e.message().find("moe_intermediate_size"), std::string::npos);
}

TEST(ModelErrors, ImpossibleConfigValues) {
  EditedFixture heads("qwen3_dense_f32", [](auto& c) { c["num_key_value_heads"] = 3; });
  EXPECT_EQ(expect_error([&] { Model::load(heads.dir.str()); }).kind(), ErrorKind::kConfig);
  EditedFixture topk("qwen3_moe_f32", [](auto& c) { c["num_experts_per_tok"] = 9; });
  EXPECT_EQ(expect_error([&] { Model::load(topk.dir.str()); }).kind(), ErrorKind::kConfig);
  EditedFixture act("qwen3_dense_f32", [](auto& c) { c["hidden_act"] = "gelu"; });
  EXPECT_EQ(expect_error([&] { Model::load(act.dir.str()); }).kind(), ErrorKind::kUnsupported);
  EditedFixture rope("qwen3_dense_f32", [](auto& c) {
    c["rope_parameters"]["rope_type"] = "dynamic";
    c["rope_parameters"]["factor"] = 2.0;
  });
  EXPECT_EQ(expect_error([&] { Model::load(rope.dir.str()); }).kind(), ErrorKind::kUnsupported);
  // A quantization_config that the files do not follow is refused, not read as if the weights
  // were plain: here FP8 is declared over f32 tensors.
  EditedFixture quant("qwen3_dense_f32", [](auto& c) {
    c["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {128, 128}}};
  });
  auto q = expect_error([&] { Model::load(quant.dir.str()); });
  EXPECT_EQ(q.kind(), ErrorKind::kFormat);
  EXPECT_NE(q.message().find("declares FP8 weights, but no tensor the model uses is F8_E4M3"), std::string::npos)
      << q.message();
  EditedFixture awq("qwen3_dense_f32", [](auto& c) { c["quantization_config"] = {{"quant_method", "awq"}}; });
  auto a = expect_error([&] { Model::load(awq.dir.str()); });
  EXPECT_EQ(a.kind(), ErrorKind::kUnsupported);
  EXPECT_NE(a.message().find("quant_method 'awq' is not supported; supported: quant_method fp8"), std::string::npos)
      << a.message();
  EditedFixture scoring("deepseek_v3_f32", [](auto& c) { c["scoring_func"] = "softmax"; });
  EXPECT_EQ(expect_error([&] { Model::load(scoring.dir.str()); }).kind(), ErrorKind::kUnsupported);
}

// Numbers that would size tables or tensor lists are bounded before anything is allocated from
// them: each is refused with one line naming the field, at once.
TEST(ModelErrors, HostileSizesAreRefusedBeforeAllocation) {
  struct Case {
    const char* fixture;
    std::function<void(nlohmann::json&)> edit;
    const char* says;
  };
  const Case cases[] = {
      {"qwen3_moe_f32", [](auto& c) { c["num_hidden_layers"] = 1000000000; }, "num_hidden_layers 1000000000 is past"},
      {"qwen3_moe_f32", [](auto& c) { c["num_hidden_layers"] = -3; }, "num_hidden_layers must be positive"},
      {"qwen3_moe_f32", [](auto& c) { c["vocab_size"] = int64_t(1) << 40; }, "vocab_size 1099511627776 is past"},
      {"qwen3_moe_f32", [](auto& c) { c["hidden_size"] = int64_t(1) << 33; }, "hidden_size"},
      {"qwen3_moe_f32", [](auto& c) { c["num_experts"] = 1 << 20; }, "the number of experts 1048576 is past"},
      {"qwen3_moe_f32", [](auto& c) { c["moe_intermediate_size"] = int64_t(1) << 40; }, "expert intermediate size"},
      {"qwen3_moe_f32", [](auto& c) { c["max_position_embeddings"] = int64_t(1) << 50; }, "max_position_embeddings"},
      {"qwen3_moe_f32", [](auto& c) { c["num_hidden_layers"] = 1000; c["num_experts"] = 16000; c["mlp_only_layers"] = nlohmann::json::array(); },
       "imply 48032000 tensors"},
      {"qwen3_moe_f32", [](auto& c) { c["rope_parameters"]["rope_theta"] = 1.0; }, "rope_theta must be a finite number above 1"},
      {"qwen3_moe_f32", [](auto& c) { c["rms_norm_eps"] = 0; }, "rms_norm_eps"},
      {"deepseek_v3_f32", [](auto& c) { c["kv_lora_rank"] = int64_t(1) << 40; }, "kv_lora_rank"},
      {"deepseek_v3_f32", [](auto& c) { c["num_nextn_predict_layers"] = 1 << 30; }, "num_nextn_predict_layers"},
      {"qwen3_moe_f32", [](auto& c) { c["eos_token_id"] = "</s>"; }, "eos_token_id must hold token ids"},
      {"qwen3_moe_f32", [](auto& c) { c["eos_token_id"] = {1, 3000000000LL}; }, "eos_token_id must hold token ids"},
      {"qwen3_moe_f32", [](auto& c) { c["bos_token_id"] = 2.5; }, "bos_token_id must hold token ids"},
  };
  for (const Case& c : cases) {
    EditedFixture f(c.fixture, c.edit);
    const Error e = expect_error([&] { load_model_config(f.dir.str()); });
    EXPECT_EQ(e.kind(), ErrorKind::kConfig) << c.says << ": " << e.message();
    EXPECT_NE(e.message().find(c.says), std::string::npos) << e.message();
  }
}

// What the config fuzzer found (fuzz/corpus/config/finding-*.json): each is a config error now,
// not a slow parse, an overflow or a JSON type error escaping as something else.
TEST(ModelErrors, ConfigFuzzFindingsAreConfigErrors) {
  int found = 0;
  for (const auto& entry : fs::directory_iterator(fs::path(MOE_SOURCE_DIR) / "fuzz" / "corpus" / "config")) {
    if (!entry.path().filename().string().starts_with("finding-")) continue;
    ++found;
    TempDir dir;
    fs::copy_file(entry.path(), dir.path() / "config.json");
    EXPECT_EQ(expect_error([&] { load_model_config(dir.str()); }).kind(), ErrorKind::kConfig) << entry.path();
  }
  EXPECT_GE(found, 3);
}

TEST(ModelErrors, WrongShapeNamesTheTensor) {
  EditedFixture f("qwen3_moe_f32", [](auto& c) { c["moe_intermediate_size"] = 16; });
  auto e = expect_error([&] { Model::load(f.dir.str()); });
  EXPECT_EQ(e.kind(), ErrorKind::kShape);
  EXPECT_NE(e.message().find("model.layers.0.mlp.experts.0.gate_proj.weight"), std::string::npos);
}

TEST(ModelErrors, StrictLoadingMissingAndUnexpectedTensors) {
  EditedFixture more("qwen3_dense_f32", [](auto& c) { c["num_hidden_layers"] = 3; });
  auto e = expect_error([&] { Model::load(more.dir.str()); });
  EXPECT_EQ(e.kind(), ErrorKind::kShape);
  EXPECT_NE(e.message().find("missing tensor 'model.layers.2."), std::string::npos);
  EditedFixture fewer("qwen3_dense_f32", [](auto& c) { c["num_hidden_layers"] = 1; });
  e = expect_error([&] { Model::load(fewer.dir.str()); });
  EXPECT_EQ(e.kind(), ErrorKind::kShape);
  EXPECT_NE(e.message().find("unexpected tensors 'model.layers.1."), std::string::npos);
  LoadOptions lenient;
  lenient.strict = false;
  EXPECT_EQ(Model::load(fewer.dir.str(), lenient)->config().num_layers, 1);
}

// The key names real Hub configs use (num_experts, top-level rope_theta) read the same as the
// ones transformers 5 writes (num_local_experts, rope_parameters.rope_theta).
TEST(ModelConfig, HubStyleKeysGiveTheSameModel) {
  EditedFixture hub("qwen3_moe_f32", [](auto& c) {
    c["num_experts"] = c["num_local_experts"];
    c.erase("num_local_experts");
    c["rope_theta"] = c["rope_parameters"]["rope_theta"];
    c.erase("rope_parameters");
  });
  auto a = Model::load(hub.dir.str());
  auto b = Model::load(std::string(MOE_SOURCE_DIR) + "/tests/fixtures/qwen3_moe_f32");
  EXPECT_EQ(a->config().moe.num_experts, 8);
  EXPECT_EQ(a->config().rope_theta, 1000000.0f);
  std::vector<int32_t> ids{4, 8, 15, 16, 23, 42};
  KvCache ca = a->new_cache(8), cb = b->new_cache(8);
  Tensor la = a->forward(ids, ca), lb = b->forward(ids, cb);
  for (int64_t v = 0; v < la.numel(); ++v) ASSERT_EQ(la.data<float>()[v], lb.data<float>()[v]);
}

TEST(ModelErrors, BadForwardInputs) {
  auto model = Model::load(std::string(MOE_SOURCE_DIR) + "/tests/fixtures/qwen3_moe_f32");
  KvCache cache = model->new_cache(4);
  std::vector<int32_t> empty, too_big{1, 384}, negative{-1}, five{1, 2, 3, 4, 5};
  auto e = expect_error([&] { model->forward(empty, cache); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  e = expect_error([&] { model->forward(too_big, cache); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(e.message().find("384"), std::string::npos);
  EXPECT_EQ(expect_error([&] { model->forward(negative, cache); }).kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(expect_error([&] { model->forward(five, cache); }).kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(cache.length(), 0);  // a rejected input leaves the cache as it was
  std::vector<int32_t> ok{1, 2};
  model->forward(ok, cache);
  EXPECT_EQ(cache.length(), 2);
}

}  // namespace
}  // namespace moe
