// A sink that keeps FP8 blocks (the GPU's weight store) must be given each FP8 checkpoint
// tensor as stored, codes and scales, into destinations placed in FP8; and a destination that
// fuses parts which do not all start on a block row must stay 16-bit, with values. Checked
// against the bytes of the fixture files and against the plain loader's f32 values.
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "core/arena.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/weights.h"
#include "moe/placement.h"
#include "test_util.h"

namespace moe {
namespace {

std::string fixture(const std::string& name) { return std::string(MOE_SOURCE_DIR) + "/tests/fixtures/" + name; }

// Records what the loader places and writes, by element offset in the layout.
class BlocksSink : public WeightSink {
 public:
  explicit BlocksSink(Arena& arena) : arena_(arena) {}
  bool keeps_fp8_blocks() const override { return true; }
  void place(float* dst, const std::vector<int64_t>& shape, const WeightFormat& format) override {
    placed_[at(dst)] = Placed{shape, format};
  }
  void write(float* dst, const float* values, size_t count) override {
    if (values_.size() < at(dst) + count) values_.resize(at(dst) + count, 0.0f);
    std::memcpy(values_.data() + at(dst), values, count * 4);
  }
  // The dequantised values of each piece, and its bytes kept apart.
  void write_blocks(float* dst, const Fp8Piece& p) override {
    ++pieces_;
    codes_[at(dst)] = std::vector<uint8_t>(p.codes, p.codes + p.rows * p.cols);
    const int64_t scale_cols = (p.cols + p.block_cols - 1) / p.block_cols;
    const size_t count = static_cast<size_t>(p.rows * p.cols);
    if (values_.size() < at(dst) + count) values_.resize(at(dst) + count, 0.0f);
    for (int64_t r = 0; r < p.rows; ++r)
      for (int64_t c = 0; c < p.cols; ++c)
        values_[at(dst) + static_cast<size_t>(r * p.cols + c)] =
            f8e4m3_to_f32(p.codes[r * p.cols + c]) * p.scales[(r / p.block_rows) * scale_cols + c / p.block_cols];
  }
  bool fill_random(float* dst, size_t count, uint64_t state) override {
    (void)state;
    random_[at(dst)] = count;
    return true;
  }

  struct Placed {
    std::vector<int64_t> shape;
    WeightFormat format;
  };
  const Placed& placed(const Tensor& t) const { return placed_.at(at(t.data<float>())); }
  size_t at(const float* p) const { return arena_.offset_of(p) / 4; }

  std::map<size_t, Placed> placed_;
  std::map<size_t, std::vector<uint8_t>> codes_;
  std::map<size_t, size_t> random_;
  std::vector<float> values_;
  int pieces_ = 0;

 private:
  Arena& arena_;
};

const WeightFormat kFp8{DType::kF8E4M3, 128, 128};

void load_with_blocks(const ModelConfig& mc, WeightLoader& loader) {
  loader.set_fp8_blocks(mc.quant.block_rows, mc.quant.block_cols, mc.quant.modules_to_not_convert);
}

TEST(Fp8Sink, CheckpointBlocksArriveAsStored) {
  for (const char* name : {"qwen3_moe_fp8", "deepseek_v3_fp8"}) {
    SCOPED_TRACE(name);
    const ModelConfig mc = load_model_config(fixture(name));
    Checkpoint ckpt(fixture(name));
    Arena plain_arena("plain", 8 << 20);
    WeightLoader plain_loader(ckpt, plain_arena, true);
    load_with_blocks(mc, plain_loader);
    const ModelWeights plain = load_weights(mc, plain_loader);

    auto space = Arena::address_space("layout", 64 << 20);
    BlocksSink sink(*space);
    WeightLoader loader(ckpt, *space, true);
    load_with_blocks(mc, loader);
    loader.set_sink(&sink);
    const ModelWeights kept = load_weights(mc, loader);
    loader.finish();
    // Every FP8 tensor of the fixtures sits where its blocks can stay (their fused parts are
    // whole blocks of rows), so every one arrives as stored.
    EXPECT_EQ(sink.pieces_, loader.fp8_tensors());
    EXPECT_GT(sink.pieces_, 0);

    // The bytes handed over are the file's.
    const size_t moe_layer = kept.layers[0].sparse ? 0 : 1;
    const LayerWeights& sparse = kept.layers[moe_layer];
    ASSERT_TRUE(sparse.sparse);
    const std::string expert0 = "model.layers." + std::to_string(moe_layer) + ".mlp.experts.0.";
    const auto& up_codes = sink.codes_.at(sink.at(sparse.moe.experts.gate_up.data<float>()) +
                                          static_cast<size_t>(mc.moe.intermediate_size * mc.hidden_size));
    const auto* file = static_cast<const uint8_t*>(ckpt.data(expert0 + "up_proj.weight"));
    ASSERT_EQ(up_codes.size(), static_cast<size_t>(mc.moe.intermediate_size * mc.hidden_size));
    EXPECT_EQ(std::memcmp(up_codes.data(), file, up_codes.size()), 0);

    // Formats: the experts, attention and dense FFN in FP8; the router and embedding not.
    EXPECT_EQ(sink.placed(sparse.moe.experts.gate_up).format, kFp8);
    EXPECT_EQ(sink.placed(sparse.moe.experts.down).format, kFp8);
    EXPECT_EQ(sink.placed(sparse.attn.o).format, kFp8);
    EXPECT_EQ(sink.placed(sparse.moe.router).format, WeightFormat{});
    EXPECT_EQ(sink.placed(kept.embed).format, WeightFormat{});
    const std::vector<int64_t> experts_shape{mc.moe.num_experts, 2 * mc.moe.intermediate_size, mc.hidden_size};
    EXPECT_EQ(sink.placed(sparse.moe.experts.gate_up).shape, experts_shape);

    // Codes x scales are the plain loader's values, every element.
    auto same = [&](const Tensor& a, const Tensor& b, const char* what) {
      const size_t at = sink.at(b.data<float>());
      ASSERT_LE(at + static_cast<size_t>(a.numel()), sink.values_.size()) << what;
      for (int64_t i = 0; i < a.numel(); ++i)
        ASSERT_EQ(a.data<float>()[i], sink.values_[at + static_cast<size_t>(i)]) << what << " at " << i;
    };
    for (size_t l = 0; l < plain.layers.size(); ++l) {
      const LayerWeights &a = plain.layers[l], &b = kept.layers[l];
      same(a.attn.o, b.attn.o, "o");
      if (a.sparse) {
        same(a.moe.experts.gate_up, b.moe.experts.gate_up, "experts gate_up");
        same(a.moe.experts.down, b.moe.experts.down, "experts down");
        same(a.moe.router, b.moe.router, "router");
      } else {
        same(a.mlp.gate_up, b.mlp.gate_up, "dense gate_up");
      }
    }
  }
}

// Random weights in an FP8 config: what a published checkpoint would hold in FP8 is drawn by the
// sink in FP8, except a fused gate_up whose up half starts inside a block (intermediate 64),
// which stays 16-bit.
TEST(Fp8Sink, RandomWeightsFollowThePublishedLayout) {
  test::EditedFixture edited("qwen3_moe_fp8", [](nlohmann::json& c) { c["moe_intermediate_size"] = 64; });
  const ModelConfig mc = load_model_config(edited.dir.path().string());
  ASSERT_TRUE(mc.quant.fp8);
  auto space = Arena::address_space("layout", 64 << 20);
  BlocksSink sink(*space);
  WeightLoader loader(*space, 3);
  load_with_blocks(mc, loader);
  loader.set_sink(&sink);
  const ModelWeights w = load_weights(mc, loader);
  const LayerWeights& l0 = w.layers[0];
  ASSERT_TRUE(l0.sparse);
  EXPECT_EQ(sink.placed(l0.moe.experts.gate_up).format, WeightFormat{});
  EXPECT_EQ(sink.placed(l0.moe.experts.down).format, kFp8);
  EXPECT_EQ(sink.placed(l0.attn.q).format, kFp8);
  EXPECT_EQ(sink.placed(l0.moe.router).format, WeightFormat{});  // listed in modules_to_not_convert
  EXPECT_EQ(sink.placed(w.embed).format, WeightFormat{});
  EXPECT_EQ(sink.placed(w.lm_head).format, WeightFormat{});
  const LayerWeights& l1 = w.layers[1];
  ASSERT_FALSE(l1.sparse);
  EXPECT_EQ(sink.placed(l1.mlp.gate_up).format, kFp8);  // 256 rows a part: whole blocks
  // The FP8 destinations are drawn by the sink, whole tensors or their parts.
  EXPECT_EQ(sink.random_.count(sink.at(l0.moe.experts.down.data<float>())), 1u);
  EXPECT_EQ(sink.random_.count(sink.at(l0.attn.q.data<float>())), 1u);
}

// Under expert parallelism a rank skips the other ranks' experts; strict loading must skip their
// block scales with them, and still take every scale of its own.
TEST(Fp8Sink, ARankSkipsTheScalesOfOtherRanksExperts) {
  for (const char* name : {"qwen3_moe_fp8", "deepseek_v3_fp8"}) {
    SCOPED_TRACE(name);
    const ModelConfig mc = load_model_config(fixture(name));
    Checkpoint ckpt(fixture(name));
    for (int rank = 0; rank < 2; ++rank) {
      ExpertSelection sel;
      sel.global_to_local = ExpertPlacement(mc.moe.num_experts, 2, rank).global_to_local();
      Arena arena("rank", 8 << 20);
      WeightLoader loader(ckpt, arena, true);
      load_with_blocks(mc, loader);
      const ModelWeights w = load_weights(mc, loader, sel);
      EXPECT_NO_THROW(loader.finish()) << "rank " << rank;
      // Its own experts' FP8 weights were read (with their scales), the others' were not.
      EXPECT_EQ(loader.fp8_tensors(), [&] {
        int64_t n = 0;
        for (const std::string& t : ckpt.names())
          if (ckpt.info(t).dtype == DType::kF8E4M3) ++n;
        return n - 3 * (mc.moe.num_experts / 2) * mc.num_moe_layers();
      }()) << "rank " << rank;
    }
  }
}

}  // namespace
}  // namespace moe
