#include "core/arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>

#include "moe/errors.h"

namespace moe {

Arena::Arena(std::string name, size_t chunk_bytes, Device device)
    : name_(std::move(name)), chunk_bytes_(chunk_bytes ? chunk_bytes : 1 << 20), device_(device) {
  MOE_CHECK(device.type == DeviceType::kCPU, kUnsupported,
            "arena '{}': only host arenas exist in this build", name_);
}

std::unique_ptr<Arena> Arena::address_space(std::string name, size_t bytes) {
  std::unique_ptr<Arena> arena(new Arena(std::move(name), 1));
  bytes = (std::max<size_t>(bytes, 1) + 4095) & ~size_t(4095);
  // MAP_NORESERVE: no commit charge up front, so a 60 GB layout costs nothing until touched.
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  MOE_CHECK(p != MAP_FAILED, kInternal, "arena '{}': cannot reserve {} bytes of address space",
            arena->name_, bytes);
  arena->chunks_.push_back({static_cast<char*>(p), bytes, 0});
  arena->mapped_ = true;
  return arena;
}

Arena::~Arena() {
  for (Chunk& c : chunks_) {
    if (mapped_)
      munmap(c.base, c.size);
    else
      std::free(c.base);
  }
}

size_t Arena::offset_of(const void* p) const {
  MOE_CHECK(mapped_, kInternal, "arena '{}': offsets exist only in address-space arenas", name_);
  const char* c = static_cast<const char*>(p);
  MOE_CHECK(c >= chunks_[0].base && c < chunks_[0].base + chunks_[0].size, kInternal,
            "arena '{}': pointer outside the arena", name_);
  return static_cast<size_t>(c - chunks_[0].base);
}

void* Arena::allocate(size_t bytes, size_t align) {
  MOE_CHECK(align && (align & (align - 1)) == 0, kInternal, "arena alignment must be a power of 2");
  for (; current_ < chunks_.size(); ++current_) {
    Chunk& c = chunks_[current_];
    size_t start = (c.offset + align - 1) & ~(align - 1);
    if (start + bytes <= c.size) {
      used_ += start + bytes - c.offset;
      c.offset = start + bytes;
      if (used_ > high_water_) high_water_ = used_;
      return c.base + start;
    }
  }
  MOE_CHECK(!mapped_, kInternal, "arena '{}': {} bytes more do not fit in its {} reserved bytes",
            name_, bytes, chunks_[0].size);
  size_t size = bytes + align > chunk_bytes_ ? bytes + align : chunk_bytes_;
  size = (size + 4095) & ~size_t(4095);
  void* p = std::aligned_alloc(4096, size);
  MOE_CHECK(p != nullptr, kInternal, "arena '{}': out of host memory asking for {} bytes", name_,
            size);
  chunks_.push_back({static_cast<char*>(p), size, 0});
  current_ = chunks_.size() - 1;
  return allocate(bytes, align);
}

void Arena::reset() {
  for (Chunk& c : chunks_) c.offset = 0;
  current_ = 0;
  used_ = 0;
}

size_t Arena::reserved() const {
  size_t total = 0;
  for (const Chunk& c : chunks_) total += c.size;
  return total;
}

}  // namespace moe
