// RankThreads: every rank's job runs at the same time (each waits until all have started, which
// a serial runner would never reach), the pool is reused across runs, and a rank's exception
// reaches the caller only after every rank has returned.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "core/rank_threads.h"

namespace moe {
namespace {

// Waits up to 5 s for `started` to reach `ranks`; false when it never does.
bool wait_for_all(std::atomic<int>& started, int ranks) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (started.load() < ranks) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

TEST(RankThreads, RunsEveryRankConcurrentlyAndIsReusable) {
  for (int ranks : {1, 2, 4}) {
    RankThreads threads(ranks);
    EXPECT_EQ(threads.ranks(), ranks);
    for (int round = 0; round < 3; ++round) {
      std::atomic<int> started{0};
      std::vector<int> met(static_cast<size_t>(ranks), 0), seen(static_cast<size_t>(ranks), 0);
      threads.run([&](int r) {
        ++seen[static_cast<size_t>(r)];
        started.fetch_add(1);
        met[static_cast<size_t>(r)] = wait_for_all(started, ranks);
      });
      for (int r = 0; r < ranks; ++r) {
        EXPECT_EQ(seen[static_cast<size_t>(r)], 1) << "rank " << r << " round " << round;
        EXPECT_EQ(met[static_cast<size_t>(r)], 1) << "rank " << r << " never saw the others running";
      }
    }
  }
}

TEST(RankThreads, RethrowsTheLowestRanksErrorAfterAllReturn) {
  RankThreads threads(3);
  std::atomic<int> returned{0};
  try {
    threads.run([&](int r) {
      std::this_thread::sleep_for(std::chrono::milliseconds(r == 0 ? 50 : 0));
      returned.fetch_add(1);
      if (r >= 1) throw std::runtime_error("rank " + std::to_string(r));
    });
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "rank 1");
  }
  EXPECT_EQ(returned.load(), 3) << "run returned before every rank had finished";
  std::atomic<int> after{0};
  threads.run([&](int) { after.fetch_add(1); });  // still usable
  EXPECT_EQ(after.load(), 3);
}

}  // namespace
}  // namespace moe
