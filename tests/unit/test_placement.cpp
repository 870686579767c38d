#include <gtest/gtest.h>

#include <vector>

#include "moe/errors.h"
#include "moe/placement.h"

namespace moe {
namespace {

ErrorKind error_kind_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.kind();
  }
  ADD_FAILURE() << "expected a moe::Error";
  return ErrorKind::kInternal;
}

TEST(Placement, TenExpertsOnFourRanks) {
  // 10 = 3 + 3 + 2 + 2: experts 0-2, 3-5, 6-7, 8-9.
  const std::vector<int64_t> counts = {3, 3, 2, 2};
  const std::vector<int64_t> firsts = {0, 3, 6, 8};
  const std::vector<int> owners = {0, 0, 0, 1, 1, 1, 2, 2, 3, 3};
  for (int rank = 0; rank < 4; ++rank) {
    ExpertPlacement p(10, 4, rank);
    EXPECT_EQ(p.num_experts(), 10);
    EXPECT_EQ(p.ep(), 4);
    EXPECT_EQ(p.rank(), rank);
    EXPECT_EQ(p.num_local(), counts[rank]);
    EXPECT_EQ(p.first_expert(), firsts[rank]);
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(p.num_local(r), counts[r]);
      EXPECT_EQ(p.first_expert(r), firsts[r]);
    }
    for (int e = 0; e < 10; ++e) EXPECT_EQ(p.owner(e), owners[e]) << "expert " << e;
  }
  ExpertPlacement p2(10, 4, 2);
  EXPECT_EQ(p2.global_to_local(),
            (std::vector<int32_t>{-1, -1, -1, -1, -1, -1, 0, 1, -1, -1}));
  EXPECT_EQ(p2.local_index(6), 0);
  EXPECT_EQ(p2.local_index(7), 1);
  EXPECT_EQ(p2.local_index(5), -1);
  EXPECT_EQ(p2.local_index(8), -1);
  EXPECT_TRUE(p2.is_local(7));
  EXPECT_FALSE(p2.is_local(0));
  ExpertPlacement p0(10, 4, 0);
  EXPECT_EQ(p0.global_to_local(), (std::vector<int32_t>{0, 1, 2, -1, -1, -1, -1, -1, -1, -1}));
  ExpertPlacement p3(10, 4, 3);
  EXPECT_EQ(p3.global_to_local(), (std::vector<int32_t>{-1, -1, -1, -1, -1, -1, -1, -1, 0, 1}));
}

TEST(Placement, EightExpertsOnThreeRanks) {
  // 8 = 3 + 3 + 2.
  const std::vector<int> owners = {0, 0, 0, 1, 1, 1, 2, 2};
  ExpertPlacement p(8, 3, 1);
  EXPECT_EQ(p.num_local(0), 3);
  EXPECT_EQ(p.num_local(1), 3);
  EXPECT_EQ(p.num_local(2), 2);
  EXPECT_EQ(p.first_expert(0), 0);
  EXPECT_EQ(p.first_expert(1), 3);
  EXPECT_EQ(p.first_expert(2), 6);
  for (int e = 0; e < 8; ++e) EXPECT_EQ(p.owner(e), owners[e]) << "expert " << e;
  EXPECT_EQ(p.global_to_local(), (std::vector<int32_t>{-1, -1, -1, 0, 1, 2, -1, -1}));
  ExpertPlacement last(8, 3, 2);
  EXPECT_EQ(last.global_to_local(), (std::vector<int32_t>{-1, -1, -1, -1, -1, -1, 0, 1}));
}

TEST(Placement, OneExpertPerRank) {
  for (int rank = 0; rank < 4; ++rank) {
    ExpertPlacement p(4, 4, rank);
    EXPECT_EQ(p.num_local(), 1);
    EXPECT_EQ(p.first_expert(), rank);
    std::vector<int32_t> expected(4, -1);
    expected[rank] = 0;
    EXPECT_EQ(p.global_to_local(), expected);
    for (int e = 0; e < 4; ++e) EXPECT_EQ(p.owner(e), e);
  }
}

TEST(Placement, SingleRankOwnsEverything) {
  ExpertPlacement p(6, 1, 0);
  EXPECT_EQ(p.num_local(), 6);
  EXPECT_EQ(p.first_expert(), 0);
  EXPECT_EQ(p.global_to_local(), (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  for (int e = 0; e < 6; ++e) {
    EXPECT_EQ(p.owner(e), 0);
    EXPECT_EQ(p.local_index(e), e);
  }
}

TEST(Placement, BlocksCoverEveryExpertOnce) {
  for (int64_t experts : {1, 2, 5, 7, 8, 10, 16, 60, 64, 128, 129}) {
    for (int ep = 1; ep <= 9 && ep <= experts; ++ep) {
      std::vector<int> seen(experts, 0);
      int64_t next = 0;
      for (int rank = 0; rank < ep; ++rank) {
        ExpertPlacement p(experts, ep, rank);
        // Sizes are floor or ceil of E/ep, the larger ones first, blocks contiguous in order.
        int64_t expected_count = experts / ep + (rank < experts % ep ? 1 : 0);
        ASSERT_EQ(p.num_local(), expected_count) << experts << "/" << ep << " rank " << rank;
        ASSERT_EQ(p.first_expert(), next);
        next += p.num_local();
        for (int64_t e = 0; e < experts; ++e) {
          bool mine = e >= p.first_expert() && e < p.first_expert() + p.num_local();
          ASSERT_EQ(p.owner(e) == rank, mine) << experts << "/" << ep << " expert " << e;
          ASSERT_EQ(p.local_index(e), mine ? e - p.first_expert() : -1);
          if (mine) seen[e]++;
        }
      }
      EXPECT_EQ(next, experts);
      for (int64_t e = 0; e < experts; ++e) EXPECT_EQ(seen[e], 1);
    }
  }
}

TEST(Placement, Errors) {
  EXPECT_EQ(error_kind_of([] { ExpertPlacement(8, 0, 0); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(error_kind_of([] { ExpertPlacement(8, -1, 0); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(error_kind_of([] { ExpertPlacement(8, 9, 0); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(error_kind_of([] { ExpertPlacement(0, 1, 0); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(error_kind_of([] { ExpertPlacement(8, 4, 4); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(error_kind_of([] { ExpertPlacement(8, 4, -1); }), ErrorKind::kInvalidArgument);
  try {
    ExpertPlacement(8, 9, 0);
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("ep 9 is larger than the number of experts 8"), std::string::npos)
        << e.message();
  }
  ExpertPlacement p(8, 2, 0);
  EXPECT_EQ(error_kind_of([&] { p.owner(8); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(error_kind_of([&] { p.owner(-1); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(error_kind_of([&] { p.local_index(8); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(error_kind_of([&] { p.num_local(2); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(error_kind_of([&] { p.first_expert(-1); }), ErrorKind::kInvalidArgument);
}

}  // namespace
}  // namespace moe
