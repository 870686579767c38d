// Bump allocators. The engine holds two: one for weights (filled once at load) and one for the
// per-forward workspace (reset at the start of every forward). On the CPU an arena may grow by
// chunks; its high-water mark is reported so the worst case is known and visible.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "moe/tensor.h"

namespace moe {

class Arena {
 public:
  // `chunk_bytes` is the size of each block requested from the system.
  Arena(std::string name, size_t chunk_bytes, Device device = Device::cpu());
  // One range of `bytes` of address space that never grows, with pages that cost memory only
  // once written. Used where a loader lays tensors out on the host but the values live
  // elsewhere (the GPU engine keeps bf16 copies on the device at the same offsets).
  static std::unique_ptr<Arena> address_space(std::string name, size_t bytes);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Memory for `bytes` bytes aligned to `align`; valid until reset() or destruction.
  void* allocate(size_t bytes, size_t align = 64);
  // Offset of `p` from the start of an address-space arena (throws for other arenas or foreign
  // pointers).
  size_t offset_of(const void* p) const;
  // Forgets every allocation; keeps the memory for reuse.
  void reset();

  const std::string& name() const { return name_; }
  Device device() const { return device_; }
  size_t used() const { return used_; }                // bytes handed out since the last reset
  size_t high_water() const { return high_water_; }    // largest used() ever seen
  size_t reserved() const;                             // bytes held from the system

 private:
  struct Chunk {
    char* base;
    size_t size;
    size_t offset;
  };
  std::string name_;
  size_t chunk_bytes_;
  Device device_;
  std::vector<Chunk> chunks_;
  bool mapped_ = false;  // one mmap'ed chunk that must not grow
  size_t current_ = 0;
  size_t used_ = 0;
  size_t high_water_ = 0;
};

}  // namespace moe
