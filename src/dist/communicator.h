// The collective operations that the expert-parallel layer needs, as an interface with one object
// per rank. InProcessGroup (inprocess_communicator.h) implements it with ranks as threads in one
// process; an NCCL implementation will sit behind the same interface, which is why payloads are
// raw pointers with byte or element counts and a DType rather than containers. (For the CPU
// implementation the pointers are host memory; for NCCL they will be device memory.)
//
// Every rank of a group must make the same sequence of calls with matching arguments. Calls are
// blocking: when one returns, the receive buffers hold their result and the send buffers may be
// reused. Buffer layout: where an operation has one slice per rank ("per peer"), the buffer is the
// concatenation of the slices in rank order 0..size()-1.
//
// Sums (all_reduce_sum, reduce_scatter*_sum) add the contributions in rank order 0..size()-1, so
// every rank gets a bit-identical result on every run. 16-bit dtypes (bf16, f16) are converted to
// f32, summed in f32 and rounded once to the 16-bit format at the end.
//
// Byte accounting (stats()). Each successful call adds to its operation's entry and to the total:
//   calls           1
//   bytes_sent      every byte this rank hands to the collective for delivery, INCLUDING the slice
//                   addressed to itself. Summed over the ranks of an exact all-to-all that moves
//                   T*k rows of H elements of b bytes, this is T*k*H*b.
//   bytes_to_peers  the same without the slice addressed to itself: what has to cross a link.
// Per operation (n = size(), d = dtype size, r = this rank):
//   all_reduce_sum(count)                 sent = count*d (the logical payload), to_peers = sent if
//                                         n > 1 else 0 (algorithm factors such as the ring's
//                                         2(n-1)/n are not modelled)
//   reduce_scatter_sum(count_per_rank)    sent = n*count_per_rank*d (the whole send buffer),
//                                         to_peers = (n-1)*count_per_rank*d
//   reduce_scatterv_sum(counts)           sent = sum(counts)*d, to_peers = (sum(counts)-counts[r])*d
//   all_gather(bytes_per_rank)            sent = n*bytes_per_rank (one copy delivered to each rank),
//                                         to_peers = (n-1)*bytes_per_rank
//   all_gatherv(send_bytes)               sent = n*send_bytes, to_peers = (n-1)*send_bytes
//   all_to_all(bytes_per_peer)            sent = n*bytes_per_peer, to_peers = (n-1)*bytes_per_peer
//   all_to_allv(send_bytes)               sent = sum(send_bytes), to_peers = sent - send_bytes[r]
//   broadcast(bytes, root)                root: sent = n*bytes, to_peers = (n-1)*bytes;
//                                         other ranks: 0 and 0
//   barrier()                             0 and 0
// The entries are keyed by the operation names above ("all_reduce_sum", "all_to_allv", ...).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "moe/tensor.h"

namespace moe::dist {

struct OpStats {
  uint64_t calls = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_to_peers = 0;
};

struct CommStats {
  std::map<std::string, OpStats, std::less<>> ops;  // by operation name
  OpStats total;

  // The entry of one operation; zeros when it was never called.
  OpStats op(std::string_view name) const {
    auto it = ops.find(name);
    return it == ops.end() ? OpStats{} : it->second;
  }
  void add(std::string_view name, uint64_t bytes_sent, uint64_t bytes_to_peers) {
    auto it = ops.find(name);
    if (it == ops.end()) it = ops.emplace(std::string(name), OpStats{}).first;
    for (OpStats* s : {&it->second, &total}) {
      s->calls += 1;
      s->bytes_sent += bytes_sent;
      s->bytes_to_peers += bytes_to_peers;
    }
  }
  void clear() { *this = CommStats{}; }
};

// One rank's endpoint. The public operations check nothing themselves and keep the byte
// accounting; implementations override the protected do_* functions. Errors (mismatched calls
// across ranks, invalid arguments, an aborted group) are thrown as moe::Error.
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // In place: data[i] = sum over ranks of their data[i]. `count` elements of `dtype`.
  void all_reduce_sum(void* data, size_t count, DType dtype) {
    do_all_reduce_sum(data, count, dtype);
    uint64_t sent = uint64_t(count) * dtype_size(dtype);
    stats_.add("all_reduce_sum", sent, size() > 1 ? sent : 0);
  }

  // recv (size()*bytes_per_rank bytes) = every rank's send (bytes_per_rank bytes), in rank order.
  // In place is allowed: send == recv + rank()*bytes_per_rank.
  void all_gather(const void* send, void* recv, size_t bytes_per_rank) {
    do_all_gather(send, recv, bytes_per_rank);
    uint64_t b = bytes_per_rank;
    stats_.add("all_gather", b * size(), b * (size() - 1));
  }
  // Ragged all-gather: rank j contributes recv_bytes_per_rank[j] bytes (its send_bytes must equal
  // recv_bytes_per_rank[rank()]); recv is their concatenation in rank order. Every rank passes the
  // same recv_bytes_per_rank. In place is allowed (send at this rank's offset in recv).
  void all_gatherv(const void* send, size_t send_bytes, void* recv,
                   const std::vector<size_t>& recv_bytes_per_rank) {
    do_all_gatherv(send, send_bytes, recv, recv_bytes_per_rank);
    uint64_t b = send_bytes;
    stats_.add("all_gatherv", b * size(), b * (size() - 1));
  }

  // send holds size() slices of count_per_rank elements; recv (count_per_rank elements) = the sum
  // over ranks of their slice rank(). In place is allowed: recv == send + rank()*count_per_rank.
  void reduce_scatter_sum(const void* send, void* recv, size_t count_per_rank, DType dtype) {
    do_reduce_scatter_sum(send, recv, count_per_rank, dtype);
    uint64_t slice = uint64_t(count_per_rank) * dtype_size(dtype);
    stats_.add("reduce_scatter_sum", slice * size(), slice * (size() - 1));
  }
  // Ragged: slice j has counts_per_rank[j] elements; every rank passes the same counts.
  void reduce_scatterv_sum(const void* send, void* recv, const std::vector<size_t>& counts_per_rank,
                           DType dtype) {
    do_reduce_scatterv_sum(send, recv, counts_per_rank, dtype);
    uint64_t total = 0;
    for (size_t c : counts_per_rank) total += c;
    uint64_t own = size_t(rank()) < counts_per_rank.size() ? counts_per_rank[rank()] : 0;
    uint64_t d = dtype_size(dtype);
    stats_.add("reduce_scatterv_sum", total * d, (total - own) * d);
  }

  // Slice j of send goes to rank j, and slice j of recv comes from rank j; bytes_per_peer each.
  // send and recv must not overlap.
  void all_to_all(const void* send, void* recv, size_t bytes_per_peer) {
    do_all_to_all(send, recv, bytes_per_peer);
    uint64_t b = bytes_per_peer;
    stats_.add("all_to_all", b * size(), b * (size() - 1));
  }
  // Ragged: send_bytes[j] bytes go to rank j, recv_bytes[j] bytes come from rank j (which must
  // equal rank j's send_bytes[rank()]). Zero-size slices are fine. No overlap of send and recv.
  void all_to_allv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                   const std::vector<size_t>& recv_bytes) {
    do_all_to_allv(send, send_bytes, recv, recv_bytes);
    uint64_t total = 0;
    for (size_t b : send_bytes) total += b;
    uint64_t own = size_t(rank()) < send_bytes.size() ? send_bytes[rank()] : 0;
    stats_.add("all_to_allv", total, total - own);
  }

  // Every rank's data (bytes) = root's data.
  void broadcast(void* data, size_t bytes, int root) {
    do_broadcast(data, bytes, root);
    uint64_t b = rank() == root ? bytes : 0;
    stats_.add("broadcast", b * size(), b * (size() - 1));
  }

  // Returns when every rank has entered it.
  void barrier() {
    do_barrier();
    stats_.add("barrier", 0, 0);
  }

  const CommStats& stats() const { return stats_; }
  void reset_stats() { stats_.clear(); }

 protected:
  virtual void do_all_reduce_sum(void* data, size_t count, DType dtype) = 0;
  virtual void do_all_gather(const void* send, void* recv, size_t bytes_per_rank) = 0;
  virtual void do_all_gatherv(const void* send, size_t send_bytes, void* recv,
                              const std::vector<size_t>& recv_bytes_per_rank) = 0;
  virtual void do_reduce_scatter_sum(const void* send, void* recv, size_t count_per_rank,
                                     DType dtype) = 0;
  virtual void do_reduce_scatterv_sum(const void* send, void* recv,
                                      const std::vector<size_t>& counts_per_rank, DType dtype) = 0;
  virtual void do_all_to_all(const void* send, void* recv, size_t bytes_per_peer) = 0;
  virtual void do_all_to_allv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                              const std::vector<size_t>& recv_bytes) = 0;
  virtual void do_broadcast(void* data, size_t bytes, int root) = 0;
  virtual void do_barrier() = 0;

 private:
  CommStats stats_;
};

}  // namespace moe::dist
