// A weight sink must see exactly the values the plain loader writes, at the same offsets, for
// checkpoints (every stored dtype) and for random weights, while an address-space arena keeps
// the host copy to the rank-1 tensors.
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "core/arena.h"
#include "io/checkpoint.h"
#include "model/config.h"
#include "model/weights.h"

namespace moe {
namespace {

std::string fixture(const std::string& name) {
  return std::string(MOE_SOURCE_DIR) + "/tests/fixtures/" + name;
}

// Keeps every value by its offset in the arena, as the GPU engine's device mirror does.
class RecordingSink : public WeightSink {
 public:
  RecordingSink(Arena& arena, bool draw) : arena_(arena), draw_(draw) {}
  void write(float* dst, const float* values, size_t count) override {
    const size_t at = arena_.offset_of(dst) / 4;
    if (values_.size() < at + count) values_.resize(at + count, 0.0f);
    std::memcpy(values_.data() + at, values, count * 4);
    ++writes_;
  }
  // Draws with its own copy of the stream rule, so a mismatch with the loader's rule shows.
  bool fill_random(float* dst, size_t count, uint64_t state) override {
    if (!draw_) return false;
    const size_t at = arena_.offset_of(dst) / 4;
    if (values_.size() < at + count) values_.resize(at + count, 0.0f);
    for (size_t i = 0; i < count; i += 2) {
      uint64_t z = state + (i / 2 + 1) * 0x9e3779b97f4a7c15ull;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      z ^= z >> 31;
      const float scale = 0.02f * 1.7320508f / 2147483648.0f;
      values_[at + i] = static_cast<float>(static_cast<int32_t>(z)) * scale;
      if (i + 1 < count) values_[at + i + 1] = static_cast<float>(static_cast<int32_t>(z >> 32)) * scale;
    }
    ++draws_;
    return true;
  }
  std::vector<float> values_;
  int writes_ = 0, draws_ = 0;

 private:
  Arena& arena_;
  bool draw_;
};

void expect_same(const Tensor& plain, const Tensor& mirrored,
                 const Arena& arena, const RecordingSink& sink, const std::string& what) {
  ASSERT_EQ(plain.numel(), mirrored.numel()) << what;
  if (plain.ndim() == 1) {  // rank-1 tensors are on the host only
    for (int64_t i = 0; i < plain.numel(); ++i)
      ASSERT_EQ(plain.data<float>()[i], mirrored.data<float>()[i]) << what << " host copy at " << i;
    return;
  }
  const size_t at = arena.offset_of(mirrored.data<float>()) / 4;
  ASSERT_LE(at + static_cast<size_t>(plain.numel()), sink.values_.size()) << what;
  for (int64_t i = 0; i < plain.numel(); ++i)
    ASSERT_EQ(plain.data<float>()[i], sink.values_[at + static_cast<size_t>(i)]) << what << " at " << i;
}

void compare_models(const ModelWeights& a, const ModelWeights& b,
                    const Arena& arena, const RecordingSink& sink) {
  expect_same(a.embed, b.embed, arena, sink, "embed");
  expect_same(a.final_norm, b.final_norm, arena, sink, "final_norm");
  expect_same(a.lm_head, b.lm_head, arena, sink, "lm_head");
  for (size_t l = 0; l < a.layers.size(); ++l) {
    const LayerWeights &x = a.layers[l], &y = b.layers[l];
    const std::string at = "layer " + std::to_string(l) + " ";
    expect_same(x.input_norm, y.input_norm, arena, sink, at + "input_norm");
    expect_same(x.attn.q, y.attn.q, arena, sink, at + "q");
    expect_same(x.attn.o, y.attn.o, arena, sink, at + "o");
    if (x.sparse) {
      expect_same(x.moe.router, y.moe.router, arena, sink, at + "router");
      expect_same(x.moe.experts.gate_up, y.moe.experts.gate_up, arena, sink, at + "gate_up");
      expect_same(x.moe.experts.down, y.moe.experts.down, arena, sink, at + "down");
    } else {
      expect_same(x.mlp.gate_up, y.mlp.gate_up, arena, sink, at + "mlp gate_up");
    }
  }
}

TEST(WeightSink, CheckpointValuesReachTheSinkAtTheirOffsets) {
  for (const char* name : {"qwen3_moe_f32", "mixtral_f16_sharded", "qwen3_moe_bf16", "qwen2_moe_f32"}) {
    SCOPED_TRACE(name);
    ModelConfig mc = load_model_config(fixture(name));
    Checkpoint ckpt(fixture(name));
    Arena plain_arena("plain", 1 << 20);
    WeightLoader plain_loader(ckpt, plain_arena, true);
    ModelWeights plain = load_weights(mc, plain_loader);

    auto space = Arena::address_space("mirror", 64 << 20);
    RecordingSink sink(*space, false);
    WeightLoader loader(ckpt, *space, true);
    loader.set_sink(&sink);
    ModelWeights mirrored = load_weights(mc, loader);
    loader.finish();
    EXPECT_GT(sink.writes_, 0);
    compare_models(plain, mirrored, *space, sink);
  }
}

TEST(WeightSink, RandomWeightsDrawnBySinkEqualTheHostStream) {
  for (bool draw : {false, true}) {
    SCOPED_TRACE(draw ? "sink draws" : "host draws");
    ModelConfig mc = load_model_config(fixture("qwen3_moe_f32"));
    Arena plain_arena("plain", 1 << 20);
    WeightLoader plain_loader(plain_arena, 7);
    ModelWeights plain = load_weights(mc, plain_loader);

    auto space = Arena::address_space("mirror", 64 << 20);
    RecordingSink sink(*space, draw);
    WeightLoader loader(*space, 7);
    loader.set_sink(&sink);
    ModelWeights mirrored = load_weights(mc, loader);
    EXPECT_EQ(sink.draws_ > 0, draw);
    compare_models(plain, mirrored, *space, sink);
  }
}

TEST(AddressSpaceArena, RefusesToGrowAndOffsetsOnlyItsOwnPointers) {
  auto space = Arena::address_space("small", 4096);
  void* p = space->allocate(1000);
  EXPECT_EQ(space->offset_of(p), 0u);
  EXPECT_THROW(space->allocate(8192), Error);
  int local = 0;
  EXPECT_THROW(space->offset_of(&local), Error);
  Arena heap("heap", 4096);
  EXPECT_THROW(heap.offset_of(heap.allocate(8)), Error);
}

}  // namespace
}  // namespace moe
