#include "dist/rank_group.h"

#include <mutex>
#include <string>

#include "moe/errors.h"

namespace moe::dist {

namespace {

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& x) {
    return x.message();
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an unknown exception";
  }
}

}  // namespace

RankGroup::RankGroup(int size) : group_(size), threads_(size) {
  for (int r = 0; r < size; ++r) comms_.push_back(group_.communicator(r));
}

RankGroup::~RankGroup() = default;

void RankGroup::run(const std::function<void(int, Communicator&)>& job) {
  std::mutex mu;
  std::exception_ptr first;
  try {
    threads_.run([&](int r) {
      try {
        job(r, *comms_[static_cast<size_t>(r)]);
      } catch (...) {
        const std::exception_ptr e = std::current_exception();
        {
          std::lock_guard<std::mutex> lock(mu);
          if (!first) first = e;
        }
        group_.abort("rank " + std::to_string(r) + " failed: " + what_of(e));
        throw;
      }
    });
  } catch (...) {
    if (first) std::rethrow_exception(first);
    throw;
  }
}

void run_ranks(int size, const std::function<void(int rank, Communicator& comm)>& fn) {
  RankGroup group(size);
  group.run([&](int r, Communicator& comm) {
    fn(r, comm);
    group.mark_finished(r);
  });
}

}  // namespace moe::dist
