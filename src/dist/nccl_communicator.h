// Ranks as the GPUs of one process, one thread each, over NCCL: the dist::Communicator of
// dist/communicator.h with device buffers. Each rank has its own CUDA stream and NCCL
// communicator; every call binds the calling thread to the rank's device, runs on the rank's
// stream and returns when the result is in place (the interface is blocking).
//
// Sums keep the interface's contract exactly (contributions added in rank order, 16-bit types
// accumulated in f32 and rounded once), so results are bit-identical to the in-process group's:
// the slices are gathered with NCCL and added by a kernel on each rank, instead of NCCL's own
// reductions, whose order and 16-bit accumulation differ.
//
// NCCL is loaded at run time (libnccl.so.2), so binaries need it only when a group is made.
// The communicators are non-blocking, so no call can stall the host on a peer that never comes.
// Calls that do not match across ranks cannot be detected up front as the in-process group does;
// instead every wait is bounded: a call that has not completed within the group's timeout aborts
// that rank's NCCL communicator and throws kInternal naming the operation, and every later call
// of the group fails at once (a peer stuck in the same exchange times out the same way).
// Byte accounting is the base class's, the same as on the CPU.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dist/communicator.h"

namespace moe::cuda {

struct NcclGroupState;

class NcclGroup {
 public:
  // One rank per entry of `devices` (distinct CUDA device ordinals). Throws kUnsupported when
  // this build has no CUDA backend, NCCL cannot be loaded or a device does not exist;
  // kInvalidArgument for an empty list, repeated devices or a timeout <= 0.
  explicit NcclGroup(const std::vector<int>& devices, double timeout_s = 60.0);
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int size() const;
  // The endpoint of `rank`, to be used by one thread; each can be taken once (kInvalidArgument).
  std::unique_ptr<dist::Communicator> communicator(int rank);

 private:
  std::shared_ptr<NcclGroupState> s_;
};

// Runs fn(rank, communicator) on one thread per device of a fresh NcclGroup, joins them and
// rethrows the first exception a rank threw.
void run_gpu_ranks(const std::vector<int>& devices,
                   const std::function<void(int rank, dist::Communicator& comm)>& fn,
                   double timeout_s = 60.0);

// Whether NCCL can be loaded here; *why says why not.
bool nccl_available(std::string* why = nullptr);

}  // namespace moe::cuda
