#include "dist/nccl_communicator.h"


#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <set>
#include <thread>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/comm/rank_sum_launch.h"
#include "core/rank_threads.h"
#include "moe/errors.h"

namespace moe::cuda {

namespace {

// The NCCL entry points, resolved from libnccl.so.2 at first use (no link-time dependency: the
// tools run on machines without NCCL, and only a group needs it). One list: entry point X is the
// field X, bound to the symbol "nccl" #X.
#define MOE_NCCL_SYMBOLS(X)                                                                  \
  X(GetUniqueId) X(CommInitRankConfig) X(CommDestroy) X(CommAbort) X(CommGetAsyncError)      \
  X(GetErrorString) X(AllGather) X(AllReduce) X(Broadcast) X(Send) X(Recv) X(GroupStart)     \
  X(GroupEnd)

struct Nccl {
#define MOE_NCCL_FIELD(name) decltype(&nccl##name) name = nullptr;
  MOE_NCCL_SYMBOLS(MOE_NCCL_FIELD)
#undef MOE_NCCL_FIELD
  std::string error;  // why loading failed; empty when every symbol was found
};

const Nccl& nccl() {
  static const Nccl n = [] {
    Nccl r;
    void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      r.error = std::string("cannot load libnccl.so.2 (") + (e ? e : "unknown") + ")";
      return r;
    }
    const auto bind = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn && r.error.empty()) r.error = std::string("libnccl.so.2 lacks ") + name;
    };
#define MOE_NCCL_BIND(name) bind(r.name, "nccl" #name);
    MOE_NCCL_SYMBOLS(MOE_NCCL_BIND)
#undef MOE_NCCL_BIND
    return r;
  }();
  return n;
}

// The communicators are non-blocking (a call may return ncclInProgress and finish its work in
// the background), so that no call can block the host on a peer that never comes: every wait
// is then a bounded poll (NcclCommunicator::settle and finish).
#define MOE_NCCL_CHECK(expr)                                                                  \
  do {                                                                                        \
    const ncclResult_t moe_nccl_result_ = (expr);                                             \
    if (moe_nccl_result_ != ncclSuccess && moe_nccl_result_ != ncclInProgress)                \
      MOE_THROW(kInternal, "NCCL error in {}: {}", #expr, nccl().GetErrorString(moe_nccl_result_)); \
  } while (0)

const char* byte_pointer(const void* p, size_t offset) { return static_cast<const char*>(p) + offset; }
char* byte_pointer(void* p, size_t offset) { return static_cast<char*>(p) + offset; }

}  // namespace

struct NcclGroupState {
  std::vector<int> devices;
  std::vector<ncclComm_t> comms;
  std::vector<bool> taken, comm_aborted;
  double timeout_s = 60.0;
  std::mutex mutex;
  std::atomic<bool> dead{false};  // a rank failed: every later call fails at once

  // Aborts rank r's communicator (which ends its stuck kernels) and marks the group dead. Each
  // rank aborts only its own: another thread may be using its peers' at that moment.
  void abort_rank(int r) {
    std::lock_guard<std::mutex> lock(mutex);
    dead = true;
    if (!comm_aborted[static_cast<size_t>(r)] && comms[static_cast<size_t>(r)]) {
      nccl().CommAbort(comms[static_cast<size_t>(r)]);
      comm_aborted[static_cast<size_t>(r)] = true;
    }
  }
  ~NcclGroupState() {
    for (size_t r = 0; r < comms.size(); ++r) {
      if (!comms[r] || comm_aborted[r]) continue;
      // A dead group's peers may never match a destroy: abort instead.
      if (dead) nccl().CommAbort(comms[r]);
      else nccl().CommDestroy(comms[r]);
    }
  }
};

namespace {

class NcclCommunicator final : public dist::Communicator {
 public:
  NcclCommunicator(std::shared_ptr<NcclGroupState> group, int rank)
      : group_(std::move(group)), rank_(rank), device_(group_->devices[static_cast<size_t>(rank)]) {
    MOE_CUDA_CHECK(cudaSetDevice(device_));
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~NcclCommunicator() override {
    cudaSetDevice(device_);
    if (scratch_) cudaFree(scratch_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(group_->devices.size()); }

 protected:
  void do_all_reduce_sum(void* data, size_t count, DType dtype) override {
    begin("all_reduce_sum");
    const size_t bytes = count * dtype_size(dtype);
    char* slices = scratch(bytes * static_cast<size_t>(size()));
    if (count > 0) MOE_NCCL_CHECK(nccl().AllGather(data, slices, bytes, ncclUint8, comm(), stream_));
    settle("all_reduce_sum");  // the gather on the stream before the sum behind it
    sum(slices, count, dtype, data);
    finish("all_reduce_sum");
  }

  void do_all_gather(const void* send, void* recv, size_t bytes_per_rank) override {
    begin("all_gather");
    if (bytes_per_rank > 0) MOE_NCCL_CHECK(nccl().AllGather(send, recv, bytes_per_rank, ncclUint8, comm(), stream_));
    finish("all_gather");
  }

  void do_all_gatherv(const void* send, size_t send_bytes, void* recv,
                      const std::vector<size_t>& recv_bytes_per_rank) override {
    begin("all_gatherv");
    check_sizes(recv_bytes_per_rank, "all_gatherv");
    MOE_CHECK(send_bytes == recv_bytes_per_rank[static_cast<size_t>(rank_)], kInvalidArgument,
              "all_gatherv: rank {} sends {} bytes but the sizes say {}", rank_, send_bytes,
              recv_bytes_per_rank[static_cast<size_t>(rank_)]);
    std::vector<size_t> offsets(static_cast<size_t>(size()), 0);
    for (int j = 1; j < size(); ++j)
      offsets[static_cast<size_t>(j)] = offsets[static_cast<size_t>(j - 1)] + recv_bytes_per_rank[static_cast<size_t>(j - 1)];
    std::vector<const void*> sends(static_cast<size_t>(size()), send);
    std::vector<size_t> send_sizes(static_cast<size_t>(size()), send_bytes);
    std::vector<void*> recvs(static_cast<size_t>(size()));
    for (int j = 0; j < size(); ++j) recvs[static_cast<size_t>(j)] = byte_pointer(recv, offsets[static_cast<size_t>(j)]);
    exchange(sends, send_sizes, recvs, recv_bytes_per_rank);
    finish("all_gatherv");
  }

  void do_reduce_scatter_sum(const void* send, void* recv, size_t count_per_rank, DType dtype) override {
    begin("reduce_scatter_sum");
    const size_t slice = count_per_rank * dtype_size(dtype);
    char* slices = scratch(slice * static_cast<size_t>(size()));
    std::vector<const void*> sends(static_cast<size_t>(size()));
    std::vector<void*> recvs(static_cast<size_t>(size()));
    for (int j = 0; j < size(); ++j) {
      sends[static_cast<size_t>(j)] = byte_pointer(send, slice * static_cast<size_t>(j));
      recvs[static_cast<size_t>(j)] = slices + slice * static_cast<size_t>(j);
    }
    const std::vector<size_t> sizes(static_cast<size_t>(size()), slice);
    exchange(sends, sizes, recvs, sizes);
    settle("reduce_scatter_sum");
    sum(slices, count_per_rank, dtype, recv);
    finish("reduce_scatter_sum");
  }

  void do_reduce_scatterv_sum(const void* send, void* recv, const std::vector<size_t>& counts_per_rank,
                              DType dtype) override {
    begin("reduce_scatterv_sum");
    check_sizes(counts_per_rank, "reduce_scatterv_sum");
    const size_t d = dtype_size(dtype), mine = counts_per_rank[static_cast<size_t>(rank_)] * d;
    char* slices = scratch(mine * static_cast<size_t>(size()));
    std::vector<const void*> sends(static_cast<size_t>(size()));
    std::vector<size_t> send_sizes(static_cast<size_t>(size()));
    std::vector<void*> recvs(static_cast<size_t>(size()));
    size_t offset = 0;
    for (int j = 0; j < size(); ++j) {
      sends[static_cast<size_t>(j)] = byte_pointer(send, offset);
      send_sizes[static_cast<size_t>(j)] = counts_per_rank[static_cast<size_t>(j)] * d;
      offset += send_sizes[static_cast<size_t>(j)];
      recvs[static_cast<size_t>(j)] = slices + mine * static_cast<size_t>(j);
    }
    exchange(sends, send_sizes, recvs, std::vector<size_t>(static_cast<size_t>(size()), mine));
    settle("reduce_scatterv_sum");
    sum(slices, counts_per_rank[static_cast<size_t>(rank_)], dtype, recv);
    finish("reduce_scatterv_sum");
  }

  void do_all_to_all(const void* send, void* recv, size_t bytes_per_peer) override {
    begin("all_to_all");
    const std::vector<size_t> sizes(static_cast<size_t>(size()), bytes_per_peer);
    all_to_allv_core(send, sizes, recv, sizes);
    finish("all_to_all");
  }

  void do_all_to_allv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                      const std::vector<size_t>& recv_bytes) override {
    begin("all_to_allv");
    check_sizes(send_bytes, "all_to_allv");
    check_sizes(recv_bytes, "all_to_allv");
    all_to_allv_core(send, send_bytes, recv, recv_bytes);
    finish("all_to_allv");
  }

  void do_broadcast(void* data, size_t bytes, int root) override {
    begin("broadcast");
    MOE_CHECK(root >= 0 && root < size(), kInvalidArgument, "broadcast: root {} is not a rank of {}", root, size());
    if (bytes > 0) MOE_NCCL_CHECK(nccl().Broadcast(data, data, bytes, ncclUint8, root, comm(), stream_));
    finish("broadcast");
  }

  void do_barrier() override {
    begin("barrier");
    float* one = reinterpret_cast<float*>(scratch(sizeof(float)));
    MOE_NCCL_CHECK(nccl().AllReduce(one, one, 1, ncclFloat32, ncclSum, comm(), stream_));
    finish("barrier");
  }

 private:
  ncclComm_t comm() const { return group_->comms[static_cast<size_t>(rank_)]; }

  void begin(const char* op) {
    MOE_CHECK(!group_->dead, kInternal, "{} on rank {}: the NCCL group was aborted by an earlier failure", op, rank_);
    MOE_CUDA_CHECK(cudaSetDevice(device_));
  }

  // Bounded polling: `done` is asked until it says yes, NCCL's asynchronous state is checked on
  // the way, and past the group's timeout this rank's communicator is aborted (ending its stuck
  // kernels) and the call fails. `settle` waits until the calls made so far are enqueued on the
  // stream (a non-blocking communicator may still be setting them up), `finish` until the stream
  // has run them.
  template <typename Done>
  void poll(const char* op, Done&& done) {
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      ncclResult_t async = ncclSuccess;
      MOE_NCCL_CHECK(nccl().CommGetAsyncError(comm(), &async));
      if (async != ncclSuccess && async != ncclInProgress) {
        group_->abort_rank(rank_);
        MOE_THROW(kInternal, "{} on rank {}: NCCL failed: {}", op, rank_, nccl().GetErrorString(async));
      }
      if (async == ncclSuccess && done()) return;
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (waited > group_->timeout_s) {
        group_->abort_rank(rank_);
        MOE_THROW(kInternal,
                  "{} on rank {} did not complete within {} s (a peer missing or making a different call); the group is aborted",
                  op, rank_, group_->timeout_s);
      }
      // Collectives of a layer take tens of microseconds: spin (yielding) for the first
      // millisecond, since a sleep costs ~60 us of timer slack each time; then sleep.
      if (waited < 1e-3)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  void settle(const char* op) {
    poll(op, [] { return true; });
  }
  void finish(const char* op) {
    poll(op, [&] {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q != cudaSuccess && q != cudaErrorNotReady) MOE_CUDA_CHECK(q);
      return q == cudaSuccess;
    });
  }

  void check_sizes(const std::vector<size_t>& v, const char* op) const {
    MOE_CHECK(v.size() == static_cast<size_t>(size()), kInvalidArgument, "{}: {} sizes for {} ranks", op, v.size(), size());
  }

  // A device buffer of at least `bytes` (grows, never shrinks; allocated between calls' work).
  char* scratch(size_t bytes) {
    if (bytes > scratch_bytes_) {
      if (scratch_) {
        MOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
        MOE_CUDA_CHECK(cudaFree(scratch_));
        scratch_ = nullptr;
      }
      MOE_CUDA_CHECK(cudaMalloc(&scratch_, bytes));
      scratch_bytes_ = bytes;
    }
    return static_cast<char*>(scratch_);
  }

  void sum(const void* slices, size_t count, DType dtype, void* out) {
    MOE_CUDA_CHECK(kernels::rank_sum(slices, size(), count, static_cast<int>(dtype), out, stream_));
  }

  // Slice j of `sends` goes to rank j and slice j of `recvs` comes from rank j; this rank's own
  // slice is a device copy. Zero-size slices send nothing.
  void exchange(const std::vector<const void*>& sends, const std::vector<size_t>& send_sizes,
                const std::vector<void*>& recvs, const std::vector<size_t>& recv_sizes) {
    const size_t me = static_cast<size_t>(rank_);
    MOE_CHECK(send_sizes[me] == recv_sizes[me], kInvalidArgument,
              "rank {} sends itself {} bytes but expects {}", rank_, send_sizes[me], recv_sizes[me]);
    if (send_sizes[me] > 0 && sends[me] != recvs[me])
      MOE_CUDA_CHECK(cudaMemcpyAsync(recvs[me], sends[me], send_sizes[me], cudaMemcpyDeviceToDevice, stream_));
    MOE_NCCL_CHECK(nccl().GroupStart());
    for (int j = 0; j < size(); ++j) {
      if (j == rank_) continue;
      const size_t jj = static_cast<size_t>(j);
      if (send_sizes[jj] > 0) MOE_NCCL_CHECK(nccl().Send(sends[jj], send_sizes[jj], ncclUint8, j, comm(), stream_));
      if (recv_sizes[jj] > 0) MOE_NCCL_CHECK(nccl().Recv(recvs[jj], recv_sizes[jj], ncclUint8, j, comm(), stream_));
    }
    MOE_NCCL_CHECK(nccl().GroupEnd());
  }

  void all_to_allv_core(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                        const std::vector<size_t>& recv_bytes) {
    std::vector<const void*> sends(static_cast<size_t>(size()));
    std::vector<void*> recvs(static_cast<size_t>(size()));
    size_t so = 0, ro = 0;
    for (int j = 0; j < size(); ++j) {
      sends[static_cast<size_t>(j)] = byte_pointer(send, so);
      recvs[static_cast<size_t>(j)] = byte_pointer(recv, ro);
      so += send_bytes[static_cast<size_t>(j)];
      ro += recv_bytes[static_cast<size_t>(j)];
    }
    exchange(sends, send_bytes, recvs, recv_bytes);
  }

  std::shared_ptr<NcclGroupState> group_;
  int rank_, device_;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

}  // namespace

bool nccl_available(std::string* why) {
  const Nccl& n = nccl();
  if (why) *why = n.error;
  return n.error.empty();
}

NcclGroup::NcclGroup(const std::vector<int>& devices, double timeout_s) : s_(std::make_shared<NcclGroupState>()) {
  MOE_CHECK(!devices.empty(), kInvalidArgument, "an NCCL group needs at least one device");
  MOE_CHECK(timeout_s > 0, kInvalidArgument, "the NCCL timeout must be > 0 s, got {}", timeout_s);
  MOE_CHECK(std::set<int>(devices.begin(), devices.end()).size() == devices.size(), kInvalidArgument,
            "an NCCL group takes each device once");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  for (int d : devices)
    MOE_CHECK(d >= 0 && d < count, kUnsupported, "CUDA device {} does not exist ({} found)", d, count);
  std::string why;
  MOE_CHECK(nccl_available(&why), kUnsupported, "NCCL: {}", why);
  s_->devices = devices;
  s_->timeout_s = timeout_s;
  s_->comms.assign(devices.size(), nullptr);
  s_->taken.assign(devices.size(), false);
  s_->comm_aborted.assign(devices.size(), false);
  // One unique id, then every rank's non-blocking communicator inside one group (the ranks are
  // threads of this process, so one thread can initialise them all), then wait for them.
  ncclUniqueId id;
  MOE_NCCL_CHECK(nccl().GetUniqueId(&id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const int n = static_cast<int>(devices.size());
  MOE_NCCL_CHECK(nccl().GroupStart());
  for (int r = 0; r < n; ++r) {
    MOE_CUDA_CHECK(cudaSetDevice(devices[static_cast<size_t>(r)]));
    MOE_NCCL_CHECK(nccl().CommInitRankConfig(&s_->comms[static_cast<size_t>(r)], n, id, r, &config));
  }
  MOE_NCCL_CHECK(nccl().GroupEnd());
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < n; ++r) {
    for (;;) {
      ncclResult_t state = ncclSuccess;
      MOE_NCCL_CHECK(nccl().CommGetAsyncError(s_->comms[static_cast<size_t>(r)], &state));
      if (state == ncclSuccess) break;
      MOE_CHECK(state == ncclInProgress, kInternal, "NCCL initialisation of rank {} failed: {}", r,
                nccl().GetErrorString(state));
      MOE_CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s,
                kInternal, "NCCL initialisation did not complete within {} s", timeout_s);
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

NcclGroup::~NcclGroup() = default;

int NcclGroup::size() const { return static_cast<int>(s_->devices.size()); }

std::unique_ptr<dist::Communicator> NcclGroup::communicator(int rank) {
  MOE_CHECK(rank >= 0 && rank < size(), kInvalidArgument, "rank {} is outside the group of {}", rank, size());
  {
    std::lock_guard<std::mutex> lock(s_->mutex);
    MOE_CHECK(!s_->taken[static_cast<size_t>(rank)], kInvalidArgument, "the endpoint of rank {} was already taken", rank);
    s_->taken[static_cast<size_t>(rank)] = true;
  }
  return std::make_unique<NcclCommunicator>(s_, rank);
}

void run_gpu_ranks(const std::vector<int>& devices,
                   const std::function<void(int rank, dist::Communicator& comm)>& fn, double timeout_s) {
  NcclGroup group(devices, timeout_s);
  std::vector<std::unique_ptr<dist::Communicator>> comms;
  for (int r = 0; r < group.size(); ++r) comms.push_back(group.communicator(r));
  // The first failure in time is the cause; later ones are peers timing out on it.
  std::mutex error_mutex;
  std::exception_ptr first_error;
  RankThreads threads(group.size());
  try {
    threads.run([&](int r) {
      try {
        fn(r, *comms[static_cast<size_t>(r)]);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!first_error) first_error = std::current_exception();
        throw;
      }
    });
  } catch (...) {
    if (first_error) std::rethrow_exception(first_error);
    throw;
  }
}

}  // namespace moe::cuda
