#include "dist/inprocess_communicator.h"

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "moe/errors.h"

namespace moe::dist {
namespace {

enum class Op {
  kAllReduceSum,
  kAllGather,
  kAllGatherv,
  kReduceScatterSum,
  kReduceScattervSum,
  kAllToAll,
  kAllToAllv,
  kBroadcast,
  kBarrier,
};

const char* op_name(Op op) {
  switch (op) {
    case Op::kAllReduceSum: return "all_reduce_sum";
    case Op::kAllGather: return "all_gather";
    case Op::kAllGatherv: return "all_gatherv";
    case Op::kReduceScatterSum: return "reduce_scatter_sum";
    case Op::kReduceScattervSum: return "reduce_scatterv_sum";
    case Op::kAllToAll: return "all_to_all";
    case Op::kAllToAllv: return "all_to_allv";
    case Op::kBroadcast: return "broadcast";
    case Op::kBarrier: return "barrier";
  }
  return "?";
}

// One rank's call as posted to the group. The vectors and buffers belong to the caller and stay
// valid until the caller's collective returns.
struct Post {
  Op op = Op::kBarrier;
  DType dtype = DType::kF32;
  size_t size = 0;  // count, bytes per rank/peer, or the rank's own send bytes (v variants)
  int root = 0;
  const std::vector<size_t>* v1 = nullptr;  // send_bytes / recv_bytes_per_rank / counts
  const std::vector<size_t>* v2 = nullptr;  // recv_bytes (all_to_allv)
  const void* send = nullptr;
  void* recv = nullptr;  // also the in-place buffer of all_reduce_sum and broadcast
  std::string local_error;  // an invalid argument found by the posting rank
};

struct Verdict {
  ErrorKind kind = ErrorKind::kInternal;
  std::string message;  // empty: the calls agree
};

std::string list(const std::vector<size_t>* v) {
  if (v == nullptr) return "[]";
  std::string out = "[";
  for (size_t i = 0; i < v->size(); ++i) {
    if (i == 8) {
      out += fmt::format(", ... ({} entries)", v->size());
      break;
    }
    if (i) out += ", ";
    out += fmt::format("{}", (*v)[i]);
  }
  return out + "]";
}

std::string describe(const Post& p) {
  switch (p.op) {
    case Op::kAllReduceSum:
      return fmt::format("all_reduce_sum(count={}, {})", p.size, dtype_name(p.dtype));
    case Op::kAllGather: return fmt::format("all_gather(bytes_per_rank={})", p.size);
    case Op::kAllGatherv:
      return fmt::format("all_gatherv(send_bytes={}, recv_bytes_per_rank={})", p.size, list(p.v1));
    case Op::kReduceScatterSum:
      return fmt::format("reduce_scatter_sum(count_per_rank={}, {})", p.size, dtype_name(p.dtype));
    case Op::kReduceScattervSum:
      return fmt::format("reduce_scatterv_sum(counts_per_rank={}, {})", list(p.v1),
                         dtype_name(p.dtype));
    case Op::kAllToAll: return fmt::format("all_to_all(bytes_per_peer={})", p.size);
    case Op::kAllToAllv:
      return fmt::format("all_to_allv(send_bytes={}, recv_bytes={})", list(p.v1), list(p.v2));
    case Op::kBroadcast: return fmt::format("broadcast(bytes={}, root={})", p.size, p.root);
    case Op::kBarrier: return "barrier()";
  }
  return "?";
}

// Whether rank a's call and rank b's call are the same collective with the same shared arguments
// (the per-rank parts of ragged calls are checked separately).
bool same_call(const Post& a, const Post& b) {
  if (a.op != b.op) return false;
  switch (a.op) {
    case Op::kAllReduceSum:
    case Op::kReduceScatterSum: return a.size == b.size && a.dtype == b.dtype;
    case Op::kAllGather:
    case Op::kAllToAll: return a.size == b.size;
    case Op::kAllGatherv: return *a.v1 == *b.v1;
    case Op::kReduceScattervSum: return *a.v1 == *b.v1 && a.dtype == b.dtype;
    case Op::kAllToAllv: return true;
    case Op::kBroadcast: return a.size == b.size && a.root == b.root;
    case Op::kBarrier: return true;
  }
  return false;
}

// Runs on the last rank to arrive, with every rank's post.
Verdict check_posts(const std::vector<Post>& posts) {
  const int n = static_cast<int>(posts.size());
  for (int r = 0; r < n; ++r) {
    if (!posts[r].local_error.empty()) {
      return {ErrorKind::kInvalidArgument,
              fmt::format("{} on rank {}: {}", op_name(posts[r].op), r, posts[r].local_error)};
    }
  }
  for (int r = 1; r < n; ++r) {
    if (!same_call(posts[0], posts[r])) {
      return {ErrorKind::kInternal,
              fmt::format("collective mismatch across ranks: rank 0 called {} but rank {} called {}",
                          describe(posts[0]), r, describe(posts[r]))};
    }
  }
  if (posts[0].op == Op::kAllToAllv) {
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        size_t sent = (*posts[i].v1)[j];
        size_t expected = (*posts[j].v2)[i];
        if (sent != expected) {
          return {ErrorKind::kInternal,
                  fmt::format("collective mismatch in all_to_allv: rank {} sends {} bytes to rank "
                              "{} but rank {} expects {} bytes from rank {}",
                              i, sent, j, j, expected, i)};
        }
      }
    }
  }
  return {};
}

bool overlap(const void* a, size_t an, const void* b, size_t bn) {
  if (an == 0 || bn == 0) return false;
  auto pa = reinterpret_cast<uintptr_t>(a);
  auto pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + bn && pb < pa + an;
}

const char* offset_ptr(const void* p, size_t bytes) { return static_cast<const char*>(p) + bytes; }

// out[0, count) = sum over j in order of srcs[j][0, count), accumulated in f32.
void sum_in_rank_order(const std::vector<const void*>& srcs, DType dtype, size_t count,
                       float* out, std::vector<float>& tmp) {
  constexpr size_t kBlock = 4096;
  const size_t dsize = dtype_size(dtype);
  if (dtype != DType::kF32) tmp.resize(std::min(kBlock, count));
  for (size_t b0 = 0; b0 < count; b0 += kBlock) {
    const size_t len = std::min(kBlock, count - b0);
    float* acc = out + b0;
    for (size_t j = 0; j < srcs.size(); ++j) {
      const char* src = offset_ptr(srcs[j], b0 * dsize);
      const float* vals;
      if (dtype == DType::kF32) {
        vals = reinterpret_cast<const float*>(src);
      } else {
        convert_to_f32(src, dtype, tmp.data(), len);
        vals = tmp.data();
      }
      if (j == 0) {
        std::memcpy(acc, vals, len * sizeof(float));
      } else {
        for (size_t i = 0; i < len; ++i) acc[i] += vals[i];
      }
    }
  }
}

void store_from_f32(const float* src, void* dst, DType dtype, size_t count) {
  if (count == 0) return;
  switch (dtype) {
    case DType::kF32: std::memcpy(dst, src, count * sizeof(float)); return;
    case DType::kBF16: {
      auto* out = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < count; ++i) out[i] = f32_to_bf16(src[i]);
      return;
    }
    case DType::kF16: {
      auto* out = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < count; ++i) out[i] = f32_to_f16(src[i]);
      return;
    }
    case DType::kF8E4M3:
    case DType::kF8E5M2: break;
  }
  MOE_THROW(kUnsupported, "collectives do not sum {} values", dtype_name(dtype));
}

}  // namespace

namespace detail {

class GroupState {
 public:
  explicit GroupState(int n) : n_(n), posts_(n), posted_(n, 0), finished_(n, 0), taken_(n, 0) {}

  int size() const { return n_; }

  // Posts this rank's call and waits for every rank to post; returns the verdict on the calls.
  // Throws kInternal when the group is or gets aborted, or a rank this one waits for finished.
  Verdict enter(int rank, Post post) {
    std::unique_lock<std::mutex> lock(mutex_);
    const char* name = op_name(post.op);
    if (aborted_) MOE_THROW(kInternal, "{} on rank {} aborted: {}", name, rank, abort_reason_);
    if (posted_[rank]) {
      abort_locked(fmt::format("rank {} entered {} while already inside a collective "
                               "(one thread per rank)", rank, name));
      MOE_THROW(kInternal, "{} on rank {} aborted: {}", name, rank, abort_reason_);
    }
    posts_[rank] = std::move(post);
    posted_[rank] = 1;
    if (++arrived_ == n_) {
      verdict_ = check_posts(posts_);
      release_locked();
      return verdict_;
    }
    const uint64_t generation = generation_;
    while (true) {
      if (generation_ != generation) return verdict_;
      if (aborted_) MOE_THROW(kInternal, "{} on rank {} aborted: {}", name, rank, abort_reason_);
      for (int r = 0; r < n_; ++r) {
        if (finished_[r] && !posted_[r]) {
          abort_locked(fmt::format("rank {} finished without calling {} that rank {} waits in",
                                   r, name, rank));
          MOE_THROW(kInternal, "{} on rank {} aborted: {}", name, rank, abort_reason_);
        }
      }
      cv_.wait(lock);
    }
  }

  // Waits until every rank has finished reading its peers' buffers. Only called after enter()
  // succeeded on every rank, so every rank is bound to arrive: it ignores aborts.
  void leave() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (++arrived_ == n_) {
      release_locked();
      return;
    }
    const uint64_t generation = generation_;
    cv_.wait(lock, [&] { return generation_ != generation; });
  }

  // Read by the ranks between enter() and leave(), when no rank writes them.
  const Post& post(int rank) const { return posts_[rank]; }

  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex_);
    abort_locked(reason);
  }
  bool aborted() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return aborted_;
  }
  void mark_finished(int rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    finished_[rank] = 1;
    cv_.notify_all();
  }
  bool take(int rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (taken_[rank]) return false;
    taken_[rank] = 1;
    return true;
  }

 private:
  void release_locked() {
    arrived_ = 0;
    std::fill(posted_.begin(), posted_.end(), 0);
    ++generation_;
    cv_.notify_all();
  }
  void abort_locked(const std::string& reason) {
    if (!aborted_) {
      aborted_ = true;
      abort_reason_ = reason;
    }
    cv_.notify_all();
  }

  const int n_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Post> posts_;
  std::vector<char> posted_;    // posted in the current rendezvous
  std::vector<char> finished_;  // makes no more calls
  std::vector<char> taken_;     // its communicator was handed out
  int arrived_ = 0;
  uint64_t generation_ = 0;
  Verdict verdict_;
  bool aborted_ = false;
  std::string abort_reason_;
};

}  // namespace detail

namespace {

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<detail::GroupState> state, int rank)
      : state_(std::move(state)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return state_->size(); }

 protected:
  void do_all_reduce_sum(void* data, size_t count, DType dtype) override {
    Post p = make(Op::kAllReduceSum, nullptr, data, count);
    p.dtype = dtype;
    need(p, data, count, "data");
    run(std::move(p), [&] {
      std::vector<const void*> srcs(size());
      for (int j = 0; j < size(); ++j) srcs[j] = state_->post(j).recv;
      acc_.resize(count);
      sum_in_rank_order(srcs, dtype, count, acc_.data(), tmp_);
    }, [&] { store_from_f32(acc_.data(), data, dtype, count); });
  }

  void do_all_gather(const void* send, void* recv, size_t bytes_per_rank) override {
    Post p = make(Op::kAllGather, send, recv, bytes_per_rank);
    need(p, send, bytes_per_rank, "send");
    need(p, recv, bytes_per_rank * size(), "recv");
    const char* own = offset_ptr(recv, bytes_per_rank * rank_);
    if (send != own && overlap(send, bytes_per_rank, recv, bytes_per_rank * size())) {
      fail(p, "send overlaps recv other than at this rank's slice");
    }
    run(std::move(p), [&] {
      for (int j = 0; j < size(); ++j) {
        copy(static_cast<char*>(recv) + bytes_per_rank * j, state_->post(j).send, bytes_per_rank);
      }
    });
  }

  void do_all_gatherv(const void* send, size_t send_bytes, void* recv,
                      const std::vector<size_t>& recv_bytes_per_rank) override {
    Post p = make(Op::kAllGatherv, send, recv, send_bytes);
    p.v1 = &recv_bytes_per_rank;
    std::vector<size_t> offsets;
    size_t total = 0;
    if (sized(p, recv_bytes_per_rank, "recv_bytes_per_rank")) {
      offsets = prefix(recv_bytes_per_rank, &total);
      if (recv_bytes_per_rank[rank_] != send_bytes) {
        fail(p, fmt::format("send_bytes {} differs from recv_bytes_per_rank[{}] = {}", send_bytes,
                            rank_, recv_bytes_per_rank[rank_]));
      } else if (send != offset_ptr(recv, offsets[rank_]) &&
                 overlap(send, send_bytes, recv, total)) {
        fail(p, "send overlaps recv other than at this rank's slice");
      }
    }
    need(p, send, send_bytes, "send");
    need(p, recv, total, "recv");
    run(std::move(p), [&] {
      for (int j = 0; j < size(); ++j) {
        copy(static_cast<char*>(recv) + offsets[j], state_->post(j).send, recv_bytes_per_rank[j]);
      }
    });
  }

  void do_reduce_scatter_sum(const void* send, void* recv, size_t count_per_rank,
                             DType dtype) override {
    std::vector<size_t> counts(size(), count_per_rank);
    reduce_scatter(Op::kReduceScatterSum, send, recv, counts, dtype, count_per_rank);
  }

  void do_reduce_scatterv_sum(const void* send, void* recv,
                              const std::vector<size_t>& counts_per_rank, DType dtype) override {
    reduce_scatter(Op::kReduceScattervSum, send, recv, counts_per_rank, dtype, 0);
  }

  void do_all_to_all(const void* send, void* recv, size_t bytes_per_peer) override {
    Post p = make(Op::kAllToAll, send, recv, bytes_per_peer);
    const size_t total = bytes_per_peer * size();
    need(p, send, total, "send");
    need(p, recv, total, "recv");
    if (overlap(send, total, recv, total)) fail(p, "send and recv overlap");
    run(std::move(p), [&] {
      for (int j = 0; j < size(); ++j) {
        copy(static_cast<char*>(recv) + bytes_per_peer * j,
             offset_ptr(state_->post(j).send, bytes_per_peer * rank_), bytes_per_peer);
      }
    });
  }

  void do_all_to_allv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                      const std::vector<size_t>& recv_bytes) override {
    Post p = make(Op::kAllToAllv, send, recv);
    p.v1 = &send_bytes;
    p.v2 = &recv_bytes;
    size_t send_total = 0, recv_total = 0;
    std::vector<size_t> recv_offsets;
    bool ok = sized(p, send_bytes, "send_bytes");
    ok = sized(p, recv_bytes, "recv_bytes") && ok;
    if (ok) {
      prefix(send_bytes, &send_total);
      recv_offsets = prefix(recv_bytes, &recv_total);
      need(p, send, send_total, "send");
      need(p, recv, recv_total, "recv");
      if (overlap(send, send_total, recv, recv_total)) fail(p, "send and recv overlap");
    }
    run(std::move(p), [&] {
      for (int j = 0; j < size(); ++j) {
        const Post& peer = state_->post(j);
        size_t src_offset = 0;
        for (int i = 0; i < rank_; ++i) src_offset += (*peer.v1)[i];
        copy(static_cast<char*>(recv) + recv_offsets[j], offset_ptr(peer.send, src_offset),
             recv_bytes[j]);
      }
    });
  }

  void do_broadcast(void* data, size_t bytes, int root) override {
    Post p = make(Op::kBroadcast, nullptr, data, bytes);
    p.root = root;
    need(p, data, bytes, "data");
    if (root < 0 || root >= size()) {
      fail(p, fmt::format("root {} is outside the group of {} ranks", root, size()));
    }
    run(std::move(p), [&] {
      if (rank_ != root) copy(data, state_->post(root).recv, bytes);
    });
  }

  void do_barrier() override {
    Verdict v = state_->enter(rank_, make(Op::kBarrier));
    if (!v.message.empty()) throw Error(v.kind, v.message, __FILE__, __LINE__);
  }

 private:
  // A post of `op` with its buffers and size (bytes, or elements for the reductions).
  static Post make(Op op, const void* send = nullptr, void* recv = nullptr, size_t size = 0) {
    Post p;
    p.op = op;
    p.send = send;
    p.recv = recv;
    p.size = size;
    return p;
  }
  // Records the first invalid argument; the call is still posted so every rank learns of it.
  static void fail(Post& p, std::string message) {
    if (p.local_error.empty()) p.local_error = std::move(message);
  }
  static void need(Post& p, const void* ptr, size_t bytes, const char* what) {
    if (ptr == nullptr && bytes > 0) fail(p, fmt::format("{} is null but holds {} bytes", what, bytes));
  }
  bool sized(Post& p, const std::vector<size_t>& v, const char* what) const {
    if (v.size() == static_cast<size_t>(size())) return true;
    fail(p, fmt::format("{} has {} entries for a group of {} ranks", what, v.size(), size()));
    return false;
  }
  static std::vector<size_t> prefix(const std::vector<size_t>& sizes, size_t* total) {
    std::vector<size_t> offsets(sizes.size());
    size_t sum = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      offsets[i] = sum;
      sum += sizes[i];
    }
    *total = sum;
    return offsets;
  }
  static void copy(void* dst, const void* src, size_t bytes) {
    if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
  }

  // Rendezvous, then `read` (reads peers' buffers, writes only this rank's receive buffers that
  // no peer reads), then the closing rendezvous, then `finish` (may write buffers peers read).
  // An exception from `read` is held until every rank has passed the closing rendezvous, so
  // that no rank frees a buffer a peer still reads.
  template <typename Read, typename Finish>
  void run(Post post, Read&& read, Finish&& finish) {
    Verdict v = state_->enter(rank_, std::move(post));
    if (!v.message.empty()) throw Error(v.kind, v.message, __FILE__, __LINE__);
    std::exception_ptr error;
    try {
      read();
    } catch (...) {
      error = std::current_exception();
    }
    state_->leave();
    if (error) std::rethrow_exception(error);
    finish();
  }
  template <typename Read>
  void run(Post post, Read&& read) {
    run(std::move(post), std::forward<Read>(read), [] {});
  }

  void reduce_scatter(Op op, const void* send, void* recv, const std::vector<size_t>& counts,
                      DType dtype, size_t count_per_rank) {
    Post p = make(op, send, recv, count_per_rank);
    p.dtype = dtype;
    p.v1 = &counts;
    const size_t dsize = dtype_size(dtype);
    std::vector<size_t> offsets;
    size_t total = 0;
    if (sized(p, counts, "counts_per_rank")) {
      offsets = prefix(counts, &total);
      const size_t own = counts[rank_] * dsize;
      need(p, send, total * dsize, "send");
      need(p, recv, own, "recv");
      if (recv != offset_ptr(send, offsets[rank_] * dsize) &&
          overlap(send, total * dsize, recv, own)) {
        fail(p, "recv overlaps send other than at this rank's slice");
      }
    }
    run(std::move(p), [&] {
      std::vector<const void*> srcs(size());
      for (int j = 0; j < size(); ++j) {
        srcs[j] = offset_ptr(state_->post(j).send, offsets[rank_] * dsize);
      }
      acc_.resize(counts[rank_]);
      sum_in_rank_order(srcs, dtype, counts[rank_], acc_.data(), tmp_);
    }, [&] { store_from_f32(acc_.data(), recv, dtype, counts[rank_]); });
  }

  std::shared_ptr<detail::GroupState> state_;
  int rank_;
  std::vector<float> acc_;  // f32 sums
  std::vector<float> tmp_;  // 16-bit inputs converted to f32
};

}  // namespace

InProcessGroup::InProcessGroup(int size) {
  MOE_CHECK(size >= 1, kInvalidArgument, "a process group needs at least 1 rank, got {}", size);
  state_ = std::make_shared<detail::GroupState>(size);
}

InProcessGroup::~InProcessGroup() = default;

int InProcessGroup::size() const { return state_->size(); }

std::unique_ptr<Communicator> InProcessGroup::communicator(int rank) {
  MOE_CHECK(rank >= 0 && rank < size(), kInvalidArgument,
            "rank {} is outside the group of {} ranks", rank, size());
  MOE_CHECK(state_->take(rank), kInvalidArgument,
            "the communicator of rank {} was already handed out", rank);
  return std::make_unique<InProcessCommunicator>(state_, rank);
}

void InProcessGroup::abort(const std::string& reason) { state_->abort(reason); }

bool InProcessGroup::aborted() const { return state_->aborted(); }

void InProcessGroup::mark_finished(int rank) {
  MOE_CHECK(rank >= 0 && rank < size(), kInvalidArgument,
            "rank {} is outside the group of {} ranks", rank, size());
  state_->mark_finished(rank);
}

}  // namespace moe::dist
