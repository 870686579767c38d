// Expert-parallel ranks as threads of this process, for as long as the object lives: an
// InProcessGroup, one communicator per rank and one host thread per rank (RankThreads, the one
// way this code base runs per-rank work). The CPU executor keeps one for its model's lifetime;
// run_ranks makes one for a single job.
//
// A rank that throws aborts the group, so that peers waiting for it in a collective fail instead
// of waiting forever; run() then rethrows the first failure, not the aborts it caused. After a
// failure the group is dead: every later collective fails with kInternal.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "core/rank_threads.h"
#include "dist/communicator.h"
#include "dist/inprocess_communicator.h"

namespace moe::dist {

class RankGroup {
 public:
  // size >= 1, else kInvalidArgument.
  explicit RankGroup(int size);
  ~RankGroup();
  RankGroup(const RankGroup&) = delete;
  RankGroup& operator=(const RankGroup&) = delete;

  int size() const { return group_.size(); }
  Communicator& communicator(int rank) { return *comms_.at(static_cast<size_t>(rank)); }

  // Runs job(rank, communicator) on every rank at once and returns when all have returned.
  void run(const std::function<void(int rank, Communicator& comm)>& job);
  // Declares that `rank` makes no more calls: peers waiting for it fail instead of hanging.
  void mark_finished(int rank) { group_.mark_finished(rank); }

 private:
  InProcessGroup group_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  RankThreads threads_;
};

// Runs fn(rank, communicator) once on `size` ranks of a fresh RankGroup, marking each rank
// finished when its function returns, and rethrows the first exception any rank threw (the
// original failure, not the aborts it caused on the other ranks). size >= 1, else
// kInvalidArgument.
void run_ranks(int size, const std::function<void(int rank, Communicator& comm)>& fn);

}  // namespace moe::dist
