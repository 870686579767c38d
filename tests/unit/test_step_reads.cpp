// The counts behind moe-bench's floors (model/step_reads.h) against the checkpoint's own
// state-dict shapes, for every preset and fixture: a step that touches every routed expert reads
// every parameter matrix but the embedding, a KV row is the width the cache allocates, and under
// tp 2 exactly half of the split projections (by their state-dict names) leaves the GPU.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/model.h"
#include "model/step_reads.h"

namespace moe {
namespace {

std::vector<std::string> model_dirs() {
  std::vector<std::string> dirs;
  for (const char* root : {"/presets", "/tests/fixtures"})
    for (const auto& e : std::filesystem::directory_iterator(std::string(MOE_SOURCE_DIR) + root))
      if (std::filesystem::exists(e.path() / "config.json")) dirs.push_back(e.path().string());
  dirs.push_back(std::string(MOE_SOURCE_DIR) + "/models/tiny-qwen3-moe");
  return dirs;
}

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

// Parameters of the matrices (2 or more dimensions) whose names pass `keep`.
template <typename Keep>
double matrix_parameters(const ModelConfig& mc, Keep keep) {
  double n = 0;
  for (const auto& [name, shape] : state_dict_keys(mc)) {
    if (shape.size() < 2 || !keep(name)) continue;
    double m = 1;
    for (int64_t d : shape) m *= static_cast<double>(d);
    n += m;
  }
  return n;
}

TEST(StepReads, EveryExpertTouchedReadsEveryMatrixButTheEmbedding) {
  size_t checked = 0;
  for (const std::string& dir : model_dirs()) {
    const ModelConfig mc = load_model_config(dir);
    const StepReads r = step_reads(mc);
    // Tied: the embedding is the lm_head, read whole each step.
    const double want = matrix_parameters(mc, [&](const std::string& name) {
      return mc.tie_word_embeddings || name != "model.embed_tokens.weight";
    });
    const double got = r.fixed + static_cast<double>(mc.moe.num_experts * mc.num_moe_layers()) * r.per_expert;
    EXPECT_EQ(got, want) << dir;
    EXPECT_EQ(r.kv_token_bytes, static_cast<double>(mc.num_layers * (mc.kv_key_width() + mc.kv_value_width()) * 2))
        << dir;
    ++checked;
  }
  EXPECT_GE(checked, 20u);
}

// Bytes: 2 a parameter in bf16; in an FP8 config the routers, the shared-expert gate and lm_head
// stay 16-bit and every other matrix read is one byte plus a 4-byte scale per 128 x 128 block.
TEST(StepReads, BytesFollowTheWeightFormat) {
  size_t fp8 = 0;
  for (const std::string& dir : model_dirs()) {
    const ModelConfig mc = load_model_config(dir);
    const StepReads r = step_reads(mc);
    if (!mc.quant.fp8) {
      EXPECT_EQ(r.fixed_bytes, 2 * r.fixed) << dir;
      EXPECT_EQ(r.per_expert_bytes, 2 * r.per_expert) << dir;
      continue;
    }
    ++fp8;
    auto sixteen_bit = [&](const std::string& name) {
      return name == "lm_head.weight" || (mc.tie_word_embeddings && name == "model.embed_tokens.weight") ||
             name.ends_with("mlp.gate.weight") || contains(name, "shared_expert_gate");
    };
    const double kept = matrix_parameters(mc, sixteen_bit);
    const double code = 1.0 + 4.0 / (128.0 * 128.0);
    EXPECT_DOUBLE_EQ(r.fixed_bytes, 2 * kept + code * (r.fixed - kept)) << dir;
    EXPECT_DOUBLE_EQ(r.per_expert_bytes, code * r.per_expert) << dir;
  }
  EXPECT_GE(fp8, 3u);  // the FP8 presets and fixtures
}

TEST(StepReads, TensorParallelHalvesTheSplitProjectionsOnly) {
  for (const std::string& dir : model_dirs()) {
    const ModelConfig mc = load_model_config(dir);
    if (mc.num_heads % 2 != 0 || (mc.attention != AttentionKind::kMla && mc.num_kv_heads % 2 != 0)) continue;
    const bool mla = mc.attention == AttentionKind::kMla;
    // Latent attention: the per-head query, kv_b and o projections split; q_a and kv_a stay.
    const double split = matrix_parameters(mc, [&](const std::string& name) {
      if (!contains(name, "self_attn.")) return false;
      if (mla)
        return contains(name, "q_b_proj") || contains(name, "self_attn.q_proj") || contains(name, "kv_b_proj") ||
               contains(name, "o_proj");
      return true;
    });
    const StepReads one = step_reads(mc, 1, 2), two = step_reads(mc, 2, 2);
    EXPECT_DOUBLE_EQ(one.fixed - two.fixed, split / 2) << dir;
    EXPECT_EQ(one.per_expert, step_reads(mc).per_expert / 2) << dir;
    EXPECT_EQ(two.kv_token_bytes, mla ? one.kv_token_bytes : one.kv_token_bytes / 2) << dir;
  }
}

}  // namespace
}  // namespace moe
