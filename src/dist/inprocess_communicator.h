// Ranks as threads of one process: a Communicator for each rank of an InProcessGroup, exchanging
// data by reading the peers' buffers directly. For the CPU build, the tests, and simulating
// expert parallelism on one machine.
//
// How a collective runs: every rank posts its call (operation, sizes, buffer pointers) to the
// group and waits until all have posted; the last to arrive checks that the calls agree. Then
// every rank reads what it needs from its peers' buffers, and all wait again before returning so
// that nobody reuses or frees a buffer that a peer still reads.
//
// Failures never hang the group:
//   - calls that disagree across ranks (different operations, sizes, dtypes, roots; an all_to_allv
//     whose send and receive sizes do not pair up) throw kInternal on every rank, and invalid
//     arguments on one rank throw kInvalidArgument on every rank; in both cases nothing is copied
//     and the group stays usable;
//   - abort() wakes every rank waiting for its peers with a kInternal error, and every later call
//     fails the same way (the group is dead);
//   - a rank marked finished (mark_finished) while a peer waits for it in a collective makes the
//     waiting peers fail with kInternal and aborts the group.
// RankGroup (rank_group.h) does both: run_ranks marks a rank finished when its function returns,
// and a rank that throws aborts the group.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "dist/communicator.h"

namespace moe::dist {

namespace detail {
class GroupState;
}

class InProcessGroup {
 public:
  // size >= 1, else kInvalidArgument.
  explicit InProcessGroup(int size);
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int size() const;

  // The endpoint of `rank` (0 <= rank < size), to be used by one thread. Each rank's endpoint
  // can be taken once (kInvalidArgument otherwise). It shares the group's state, so it stays
  // valid if the group object goes away first.
  std::unique_ptr<Communicator> communicator(int rank);

  // Fails every current and future collective of the group with kInternal, citing `reason`.
  void abort(const std::string& reason);
  bool aborted() const;

  // Declares that `rank` makes no more calls: peers waiting for it fail instead of hanging.
  void mark_finished(int rank);

 private:
  std::shared_ptr<detail::GroupState> state_;
};

}  // namespace moe::dist
