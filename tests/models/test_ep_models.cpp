// Whole fixture models under expert parallelism (ranks as threads): every backend, ep 1 to 4 and
// both execution modes give the logits of one rank running naive, within f32 rounding, and the
// same greedy tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "dist/rank_group.h"
#include "model/model.h"
#include "../unit/test_util.h"

namespace moe {
namespace {

std::string fixture(const std::string& name) {
  return std::string(MOE_SOURCE_DIR) + "/tests/fixtures/" + name;
}

struct ModelRun {
  Tensor logits;                 // all positions of the prompt
  std::vector<int32_t> greedy;   // continuation
};

ModelRun run_model(Model& model, const std::vector<int32_t>& ids, int steps) {
  KvCache cache = model.new_cache(64);
  ModelRun r;
  r.logits = model.forward(ids, cache, true);
  const int64_t v = model.config().vocab_size;
  const float* last = r.logits.data<float>() + (r.logits.dim(0) - 1) * v;
  int32_t next = static_cast<int32_t>(std::max_element(last, last + v) - last);
  for (int s = 0; s < steps; ++s) {
    r.greedy.push_back(next);
    std::vector<int32_t> one{next};
    Tensor l = model.forward(one, cache);
    next = static_cast<int32_t>(std::max_element(l.data<float>(), l.data<float>() + v) - l.data<float>());
  }
  return r;
}

class EpModelTest : public ::testing::TestWithParam<std::string> {};

TEST_P(EpModelTest, BackendsRanksAndModesAgree) {
  const std::string dir = fixture(GetParam());
  const std::vector<int32_t> ids{3, 17, 42, 7, 99, 5, 250, 11};
  LoadOptions naive;
  naive.exec = ExecMode::kNaive;
  naive.threads = 1;
  auto reference_model = Model::load(dir, naive);
  ModelRun ref = run_model(*reference_model, ids, 4);
  const int64_t experts = reference_model->config().moe.num_experts;
  for (auto backend : {dist::EpBackend::kLocalAllreduce, dist::EpBackend::kAllgatherReducescatter,
                       dist::EpBackend::kAlltoallPadded, dist::EpBackend::kAlltoallPacked}) {
    for (int ep : {1, 2, 3, 4}) {
      if (ep > experts) continue;
      for (ExecMode exec : {ExecMode::kNaive, ExecMode::kGrouped}) {
        std::vector<ModelRun> runs(static_cast<size_t>(ep));
        dist::run_ranks(ep, [&](int rank, dist::Communicator& comm) {
          LoadOptions lo;
          lo.exec = exec;
          lo.threads = 1;
          lo.comm = &comm;
          lo.ep_backend = backend;
          auto model = Model::load(dir, lo);
          runs[static_cast<size_t>(rank)] = run_model(*model, ids, 4);
        });
        const std::string what = std::string(dist::ep_backend_name(backend)) + " ep=" +
                                 std::to_string(ep) + " " + exec_mode_name(exec);
        for (const ModelRun& r : runs) {
          float worst = 0;
          for (int64_t i = 0; i < ref.logits.numel(); ++i)
            worst = std::max(worst, std::fabs(r.logits.data<float>()[i] - ref.logits.data<float>()[i]));
          EXPECT_LE(worst, 1e-5f) << what;
          EXPECT_EQ(r.greedy, ref.greedy) << what;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, EpModelTest,
                         // Every fixture with routed experts (the dense Qwen3 ones have none to
                         // spread, and ep > 1 is refused for them).
                         ::testing::Values("qwen3_moe_f32", "qwen3_moe_nonorm_f32", "qwen3_moe_bf16",
                                           "mixtral_f32", "mixtral_f16_sharded", "mixtral_bf16",
                                           "deepseek_v2_f32", "deepseek_v2_grouped_f32",
                                           "deepseek_v3_f32", "deepseek_v3_g8_f32",
                                           "deepseek_v3_bf16", "qwen2_moe_f32", "olmoe_f32"),
                         [](const auto& info) { return info.param; });

TEST(EpModel, StateDictKeysAreTheUnionOverRanks) {
  ModelConfig mc = load_model_config(fixture("deepseek_v3_f32"));
  auto full = state_dict_keys(mc);
  for (int ep : {2, 3, 4}) {
    // Stable order: walk the full model order, keep what some rank holds.
    std::vector<std::set<std::string>> per_rank;
    for (int r = 0; r < ep; ++r) {
      ExpertPlacement p(mc.moe.num_experts, ep, r);
      std::set<std::string> names;
      for (const auto& [name, shape] : state_dict_keys(mc, {p.global_to_local()})) names.insert(name);
      per_rank.push_back(names);
    }
    std::vector<std::string> union_in_order;
    for (const auto& [name, shape] : full) {
      bool held = false;
      for (const auto& s : per_rank) held |= s.count(name) > 0;
      if (held) union_in_order.push_back(name);
    }
    ASSERT_EQ(union_in_order.size(), full.size()) << "ep " << ep;
    // Each routed expert is held by exactly one rank; everything else by all.
    for (const auto& [name, shape] : full) {
      int holders = 0;
      for (const auto& s : per_rank) holders += s.count(name) > 0;
      EXPECT_EQ(holders, name.find(".experts.") != std::string::npos ? 1 : ep) << name;
    }
  }
  std::set<std::string> unique;
  for (const auto& [name, shape] : full) EXPECT_TRUE(unique.insert(name).second) << name;
  // The list matches the checkpoint exactly.
  Checkpoint ckpt(fixture("deepseek_v3_f32"));
  const auto names = ckpt.names();
  EXPECT_EQ(unique, std::set<std::string>(names.begin(), names.end()));
}

TEST(EpModel, ConfigurationErrorsComeBeforeWeights) {
  EXPECT_EQ(test::expect_error([] { dist::parse_ep_backend("fastest"); }).kind(), ErrorKind::kConfig);
  dist::DistConfig dc;
  dc.ep = 2;
  dc.ep_backend = "deepep";
  auto e = test::expect_error([&] { dist::validate_dist_config(dc); });
  EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
  EXPECT_NE(e.message().find("alltoall_packed"), std::string::npos);
  dc.ep_backend = "alltoall_packed";
  dc.ep = 9;
  EXPECT_EQ(test::expect_error([&] { dist::validate_ep_for_model(dc, 8); }).kind(), ErrorKind::kInvalidArgument);
  // A rank of 9 on an 8-expert model is refused by the model loader too, before any weight.
  e = test::expect_error([&] {
    dist::run_ranks(9, [&](int, dist::Communicator& comm) {
      LoadOptions lo;
      lo.comm = &comm;
      Model::load("/nonexistent-weights-are-never-read", lo);
    });
  });
  EXPECT_EQ(e.kind(), ErrorKind::kIo);  // the config is read first: the directory is missing
}

TEST(EpModel, MissingExpertOfOneRankIsNamed) {
  test::TempDir dir;
  std::filesystem::copy_file(fixture("qwen3_moe_f32") + "/config.json", dir.path() / "config.json");
  SafetensorsFile src(fixture("qwen3_moe_f32") + "/model.safetensors");
  std::vector<test::F32Tensor> kept;
  for (const auto& t : src.tensors()) {
    if (t.name.find("layers.2.mlp.experts.5.") != std::string::npos) continue;  // held by rank 1 of 2
    const float* p = static_cast<const float*>(src.data(t));
    kept.push_back({t.name, t.shape, std::vector<float>(p, p + (t.end - t.begin) / 4)});
  }
  test::write_file(dir.path() / "model.safetensors", test::make_f32_safetensors(kept));
  auto e = test::expect_error([&] {
    dist::run_ranks(2, [&](int, dist::Communicator& comm) {
      LoadOptions lo;
      lo.comm = &comm;
      Model::load(dir.str(), lo);
    });
  });
  EXPECT_EQ(e.kind(), ErrorKind::kShape);
  EXPECT_NE(e.message().find("model.layers.2.mlp.experts.5.gate_proj.weight"), std::string::npos);
}

}  // namespace
}  // namespace moe
