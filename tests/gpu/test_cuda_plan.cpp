// The routed-expert plan (launch_plan in src/backend/cuda/moe_decode.cu) against a plan computed
// here on the host: counts and offsets, each expert's slots (as a set: their order inside an
// expert is not fixed), the touched experts and the GEMM row tiles. Slot counts on both sides
// of the switch from one block to the multi-block plan, past the count where each block's range
// grows beyond one block's worth, with skipped slots (-1, another rank's experts) and with every
// slot on one expert. Outputs poisoned first. Skipped, visibly, where no CUDA device exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "backend/cuda/moe_decode_launch.h"
#include "gpu_test_util.h"

namespace moe {
namespace {

using gputest::DeviceBuffer;

struct HostPlan {
  std::vector<int> offsets, active, tile_expert, tile_row;
  std::vector<std::vector<int>> slots;  // per expert, ascending
};

HostPlan host_plan(const std::vector<int32_t>& ids, int experts, int tile_m) {
  HostPlan p;
  p.slots.resize(static_cast<size_t>(experts));
  for (size_t s = 0; s < ids.size(); ++s)
    if (ids[s] >= 0) p.slots[static_cast<size_t>(ids[s])].push_back(static_cast<int>(s));
  int run = 0;
  for (int e = 0; e < experts; ++e) {
    const int c = static_cast<int>(p.slots[static_cast<size_t>(e)].size());
    p.offsets.push_back(run);
    if (c > 0) p.active.push_back(e);
    for (int j = 0; tile_m > 0 && j * tile_m < c; ++j) {
      p.tile_expert.push_back(e);
      p.tile_row.push_back(run + j * tile_m);
    }
    run += c;
  }
  p.offsets.push_back(run);
  return p;
}

// Runs the device plan on `ids` (tokens * top_k slots) and compares every output with the host's.
void check_plan(const std::vector<int32_t>& ids, int experts, int top_k, int tile_m, const char* what) {
  SCOPED_TRACE(what);
  const int slots = static_cast<int>(ids.size());
  const int tokens = slots / top_k;
  ASSERT_EQ(tokens * top_k, slots);
  const HostPlan want = host_plan(ids, experts, tile_m);
  const size_t max_tiles = static_cast<size_t>((tile_m > 0 ? slots / tile_m : 0) + experts + 1);
  DeviceBuffer<int32_t> d_ids(ids);
  DeviceBuffer<int> offsets(static_cast<size_t>(experts + 1)), order(static_cast<size_t>(slots)),
      active(static_cast<size_t>(experts)), num_active(1), tile_expert(max_tiles), tile_row(max_tiles),
      num_tiles(1), plan_counts(static_cast<size_t>(cuda::kernels::kMaxPlanBlocks) * experts);
  for (auto* b : {&offsets, &order, &active, &num_active, &tile_expert, &tile_row, &num_tiles, &plan_counts})
    b->poison();
  cuda::kernels::ExpertBuffers b{};
  b.offsets = offsets.get();
  b.order = order.get();
  b.active = active.get();
  b.num_active = num_active.get();
  b.tile_expert = tile_expert.get();
  b.tile_row = tile_row.get();
  b.num_tiles = num_tiles.get();
  b.plan_counts = plan_counts.get();
  b.experts = experts;
  b.top_k = top_k;
  ASSERT_EQ(cuda::kernels::launch_plan(b, d_ids.get(), tokens, tile_m, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  EXPECT_EQ(offsets.download(), want.offsets);
  const int n_active = num_active.download()[0];
  ASSERT_EQ(n_active, static_cast<int>(want.active.size()));
  const auto got_active = active.download();
  EXPECT_TRUE(std::equal(want.active.begin(), want.active.end(), got_active.begin()));
  const auto got_order = order.download();
  for (int e = 0; e < experts; ++e) {
    const int lo = want.offsets[static_cast<size_t>(e)], hi = want.offsets[static_cast<size_t>(e) + 1];
    std::vector<int> mine(got_order.begin() + lo, got_order.begin() + hi);
    std::sort(mine.begin(), mine.end());
    ASSERT_EQ(mine, want.slots[static_cast<size_t>(e)]) << "the slots of expert " << e;
  }
  const int n_tiles = num_tiles.download()[0];
  ASSERT_EQ(n_tiles, static_cast<int>(want.tile_expert.size()));
  const auto got_te = tile_expert.download(), got_tr = tile_row.download();
  EXPECT_TRUE(std::equal(want.tile_expert.begin(), want.tile_expert.end(), got_te.begin()));
  EXPECT_TRUE(std::equal(want.tile_row.begin(), want.tile_row.end(), got_tr.begin()));
}

// `tokens` tokens of k distinct random experts each; a fraction `skipped` of the slots -1.
std::vector<int32_t> random_ids(int experts, int tokens, int k, double skipped, std::mt19937& rng) {
  std::vector<int32_t> ids;
  std::vector<int32_t> all(static_cast<size_t>(experts));
  for (int e = 0; e < experts; ++e) all[static_cast<size_t>(e)] = e;
  std::bernoulli_distribution skip(skipped);
  for (int t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int32_t> pick(all.begin(), all.begin() + k);
    std::sort(pick.begin(), pick.end());
    for (int32_t e : pick) ids.push_back(skip(rng) ? -1 : e);
  }
  return ids;
}

TEST(CudaPlan, AgreesWithTheHostEitherSideOfTheBlockSwitch) {
  REQUIRE_GPU();
  std::mt19937 rng(77);
  // 4096 slots: one block; 4104: two blocks; 65536: 64; 40000 * 8 = 320000: more than
  // kMaxPlanBlocks blocks' worth, so each block's range grows.
  for (int tokens : {512, 513, 2000, 8192, 40000}) {
    check_plan(random_ids(128, tokens, 8, 0.0, rng), 128, 8, 128, "qwen3-30b-a3b routing");
    check_plan(random_ids(128, tokens, 8, 0.3, rng), 128, 8, 64, "with skipped slots");
  }
  check_plan(random_ids(64, 3000, 6, 0.0, rng), 64, 6, 256, "deepseek-v2-lite routing, 256-row tiles");
  check_plan(random_ids(512, 1000, 10, 0.1, rng), 512, 10, 128, "512 experts");
  check_plan(std::vector<int32_t>(20000, 5), 8, 1, 128, "every slot on one expert");
  check_plan(std::vector<int32_t>(20000, -1), 8, 2, 128, "every slot skipped");
}

// tile_m 0 (the GEMV path's plan): no tiles, the rest as before.
TEST(CudaPlan, NoTilesForTheGemv) {
  REQUIRE_GPU();
  std::mt19937 rng(78);
  for (int tokens : {8, 600}) check_plan(random_ids(128, tokens, 8, 0.1, rng), 128, 8, 0, "tile_m 0");
}

}  // namespace
}  // namespace moe
