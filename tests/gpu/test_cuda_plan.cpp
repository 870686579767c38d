// The routed-expert plan (launch_plan in src/backend/cuda/moe/moe_plan.cu) against a plan computed
// here on the host: counts and offsets, each expert's slots (as a set: their order inside an
// expert is not fixed), the touched experts and the GEMM row tiles. Slot counts on both sides
// of the switch from one block to the multi-block plan, past the count where each block's range
// grows beyond one block's worth, with skipped slots (-1, another rank's experts) and with every
// slot on one expert. Outputs poisoned first. Skipped, visibly, where no CUDA device exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "backend/cuda/moe/moe_decode_launch.h"
#include "backend/cuda/moe/moe_heuristics.h"
#include "backend/cuda/moe/moe_wgmma_launch.h"
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

// The row tile a plan offered tile_m or tile_alt should build, from the rule as the launch header
// states it: per 256 output columns an expert of c rows brings 256 * ceil(c / t) + c rows into
// the SMs with a 64- or 128-row tile and 256 * ceil(c / 256) + 2c with the 256-row one (two
// items of 128 weight columns); the smaller tile is kept unless the larger brings more than 5%
// fewer.
int host_tile_choice(const std::vector<int32_t>& ids, int experts, int tile_m, int tile_alt) {
  if (tile_alt == 0) return tile_m;
  constexpr int kMixed = cuda::heuristics::kWgmmaMixedTiles;
  std::vector<long long> rows(static_cast<size_t>(experts));
  for (int32_t id : ids)
    if (id >= 0) ++rows[static_cast<size_t>(id)];
  // Rows brought into the SMs per 256 output columns; -1: mixed tiles ruled out.
  auto cost = [&](int t) {
    long long sum = 0;
    for (long long c : rows) {
      if (c == 0) continue;
      int tile = t;
      if (t == kMixed) {
        if (c > 256) return -1LL;
        tile = c > 128 ? 256 : 128;
      }
      const long long n = (c + tile - 1) / tile;
      sum += tile == 256 ? 256 * n + 2 * c : 256 * n + c;
    }
    return sum;
  };
  if (tile_alt == kMixed) {
    const long long mixed = cost(kMixed);
    return mixed >= 0 && mixed * 20 < cost(tile_m) * 19 ? kMixed : tile_m;
  }
  const int small = std::min(tile_m, tile_alt), large = std::max(tile_m, tile_alt);
  return cost(large) * 20 < cost(small) * 19 ? large : small;
}

// Runs the device plan on `ids` (tokens * top_k slots) and compares every output with the host's.
// tile_alt > 0: the plan picks between tile_m and tile_alt; the tiles and the two counts must be
// those of host_tile_choice's tile.
void check_plan(const std::vector<int32_t>& ids, int experts, int top_k, int tile_m, const char* what,
                int tile_alt = 0, int expect_tile = 0) {
  SCOPED_TRACE(what);
  const int slots = static_cast<int>(ids.size());
  const int tokens = slots / top_k;
  ASSERT_EQ(tokens * top_k, slots);
  const int tile = host_tile_choice(ids, experts, tile_m, tile_alt);
  if (expect_tile > 0) {
    ASSERT_EQ(tile, expect_tile) << "the case does not test what it says";
  }
  // The row tile the plan cuts for a choice: mixed row tiles keep 128-row ones.
  auto cut = [](int t) { return t == cuda::heuristics::kWgmmaMixedTiles ? 128 : t; };
  const HostPlan want = host_plan(ids, experts, cut(tile));
  const int smallest = tile_alt > 0 ? std::min(tile_m, cut(tile_alt)) : tile_m;
  const size_t max_tiles = static_cast<size_t>((smallest > 0 ? slots / smallest : 0) + experts + 1);
  DeviceBuffer<int32_t> d_ids(ids);
  DeviceBuffer<int> offsets(static_cast<size_t>(experts + 1)), order(static_cast<size_t>(slots)),
      active(static_cast<size_t>(experts)), num_active(1), tile_expert(max_tiles), tile_row(max_tiles),
      num_tiles(2), plan_counts(static_cast<size_t>(cuda::kernels::kMaxPlanBlocks) * experts);
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
  ASSERT_EQ(cuda::kernels::launch_plan(b, d_ids.get(), tokens, tile_m, nullptr, tile_alt), cudaSuccess);
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
  const auto counts = num_tiles.download();
  const int n_tiles = tile == tile_m ? counts[0] : counts[1];
  ASSERT_EQ(n_tiles, static_cast<int>(want.tile_expert.size()));
  if (tile_alt > 0) {
    EXPECT_EQ(tile == tile_m ? counts[1] : counts[0], 0) << "the tile not picked has tiles";
  }
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
  // The one-block plan: a warp whose lanes all hold one expert takes its places with one atomic,
  // any other warp one a lane; here whole warps of one expert, in one round and in four, and
  // warps where every other lane shares an expert with half the warp.
  check_plan(std::vector<int32_t>(1000, 3), 8, 1, 128, "every slot on one expert, one round");
  check_plan(std::vector<int32_t>(4000, 3), 8, 1, 64, "every slot on one expert, one block");
  std::vector<int32_t> half(4000);
  for (size_t s = 0; s < half.size(); ++s) half[s] = s % 2 ? 6 : static_cast<int32_t>(rng() % 64);
  check_plan(half, 64, 1, 128, "every other slot on one expert");
  check_plan(std::vector<int32_t>(20000, -1), 8, 2, 128, "every slot skipped");
}

// Ids giving expert e rows[e] slots (top_k 1).
std::vector<int32_t> ids_with_rows(const std::vector<int>& rows) {
  std::vector<int32_t> ids;
  for (size_t e = 0; e < rows.size(); ++e) ids.insert(ids.end(), static_cast<size_t>(rows[e]), static_cast<int32_t>(e));
  return ids;
}

// The plan picks the row tile per forward when offered two (one block and, past 4096 slots, the
// multi-block plan), and the counts of the tile not picked are zero.
TEST(CudaPlan, PicksTheRowTileFromTheCounts) {
  REQUIRE_GPU();
  std::mt19937 rng(79);
  // Uniform loads of ~32 rows: 64 and 128 tie, so the smaller stays, whichever is offered first.
  const auto uniform = random_ids(128, 512, 8, 0.0, rng);
  check_plan(uniform, 128, 8, 64, "uniform, 64 or 128", 128, 64);
  check_plan(uniform, 128, 8, 128, "uniform, 128 or 64", 64, 64);
  // 100 rows an expert: two 64-row tiles read the weights twice (612 against 356 rows).
  check_plan(ids_with_rows(std::vector<int>(40, 100)), 40, 1, 64, "100 rows, 64 or 128", 128, 128);
  // 192 rows: 704 rows with 128-row tiles against 640 with one 256-row tile (9% fewer).
  check_plan(ids_with_rows(std::vector<int>(64, 192)), 64, 1, 128, "192 rows, multi-block plan", 256, 256);
  // 240 rows: 752 against 736, 2% fewer: not enough to leave the smaller tile.
  check_plan(ids_with_rows(std::vector<int>(20, 240)), 20, 1, 256, "240 rows, 256 or 128", 128, 128);
  // Skewed: one expert of 1000 rows beside many small ones keeps 128 (2v rows cost the tall tile).
  std::vector<int> skew(64, 20);
  skew[3] = 1000;
  check_plan(ids_with_rows(skew), 64, 1, 256, "one large expert, 256 or 128", 128, 128);
  check_plan(std::vector<int32_t>(6000, -1), 8, 2, 128, "every slot skipped", 256, 128);
}

// Mixed row tiles offered beside 128: the tiles are 128-row ones either way, only the counts
// say which grid runs.
TEST(CudaPlan, PicksMixedRowTilesFromTheCounts) {
  REQUIRE_GPU();
  std::mt19937 rng(80);
  constexpr int kMixed = cuda::heuristics::kWgmmaMixedTiles;
  // qwen3-30b-a3b M = 2048 with uniform routing (multi-block plan): about half the experts hold
  // 129 to ~160 rows, whose second tile mixed tiles save (~11% fewer rows).
  check_plan(random_ids(128, 2048, 8, 0.0, rng), 128, 8, 128, "uniform, 128 rows an expert", kMixed, kMixed);
  // Alternating 136 and 120 rows: 7232 against 8192 rows.
  std::vector<int> alternating;
  for (int i = 0; i < 8; ++i) alternating.insert(alternating.end(), {136, 120});
  check_plan(ids_with_rows(alternating), 16, 1, 128, "136 and 120 rows", kMixed, kMixed);
  // One expert of 257 rows rules mixed tiles out, however many others they would serve.
  std::vector<int> one_past(std::vector<int>(30, 140));
  one_past.push_back(257);
  check_plan(ids_with_rows(one_past), 31, 1, 128, "one expert past 256 rows", kMixed, 128);
  // 240 rows: 736 against 752 rows, 2% fewer: not enough.
  check_plan(ids_with_rows(std::vector<int>(20, 240)), 20, 1, 128, "240 rows", kMixed, 128);
  check_plan(std::vector<int32_t>(6000, -1), 8, 2, 128, "every slot skipped", kMixed, 128);
}

// tile_m 0 (the GEMV path's plan): no tiles, the rest as before.
TEST(CudaPlan, NoTilesForTheGemv) {
  REQUIRE_GPU();
  std::mt19937 rng(78);
  for (int tokens : {8, 600}) check_plan(random_ids(128, tokens, 8, 0.1, rng), 128, 8, 0, "tile_m 0");
}

// Tile choices the launches cannot make are refused before anything reaches the device (so this
// runs without one): the same tile twice, an alternative beside no tiles, mixed row tiles beside
// another tile than 128, a row tile the wgmma kernels do not have.
TEST(CudaPlan, RefusesTileChoicesItCannotMake) {
  namespace k = cuda::kernels;
  constexpr int kMixed = cuda::heuristics::kWgmmaMixedTiles;
  k::ExpertBuffers b{};
  b.experts = 8;
  b.top_k = 2;
  b.hidden = 256;
  b.inter = 128;
  EXPECT_EQ(k::launch_plan(b, nullptr, 4, 128, nullptr, 128), cudaErrorInvalidValue);
  EXPECT_EQ(k::launch_plan(b, nullptr, 4, 0, nullptr, 128), cudaErrorInvalidValue);
  EXPECT_EQ(k::launch_plan(b, nullptr, 4, 64, nullptr, kMixed), cudaErrorInvalidValue);
  EXPECT_EQ(k::launch_prefill_wgmma(b, nullptr, nullptr, nullptr, 4, 100, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(k::launch_prefill_wgmma(b, nullptr, nullptr, nullptr, 4, 128, nullptr, nullptr, 128),
            cudaErrorInvalidValue);
  EXPECT_EQ(k::launch_prefill_wgmma(b, nullptr, nullptr, nullptr, 4, 256, nullptr, nullptr, kMixed),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace moe
