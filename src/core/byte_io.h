// Messages of fixed-size values in the host's byte order (little-endian on every machine this
// runs on), built and read front to back: the step messages (runtime/step_wire) and the
// executor's calls (runtime/remote_executor). A ByteReader never reads past its bytes; each caller
// turns a message that ends early into its own one-line error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

namespace moe {

class ByteWriter {
 public:
  template <typename T>
  ByteWriter& put(T v) {
    return put_all(&v, 1);
  }
  template <typename T>
  ByteWriter& put_all(const T* p, size_t n) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* b = reinterpret_cast<const uint8_t*>(p);
    if (n > 0) bytes_.insert(bytes_.end(), b, b + n * sizeof(T));
    return *this;
  }
  ByteWriter& put_bytes(std::span<const uint8_t> b) { return put_all(b.data(), b.size()); }
  const std::vector<uint8_t>& bytes() const { return bytes_; }
  std::vector<uint8_t> take() { return std::move(bytes_); }

 private:
  std::vector<uint8_t> bytes_;
};

class ByteReader {
 public:
  explicit ByteReader(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  size_t size() const { return bytes_.size(); }
  size_t at() const { return at_; }
  size_t left() const { return bytes_.size() - at_; }
  // Copies the next n values into p and moves past them; false, with nothing read, when fewer
  // bytes are left.
  template <typename T>
  bool read(T* p, size_t n = 1) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (n > left() / sizeof(T)) return false;
    if (n > 0) std::memcpy(p, bytes_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
    return true;
  }
  // Everything not read yet; the reader is then at its end.
  std::span<const uint8_t> rest() {
    const auto r = bytes_.subspan(at_);
    at_ = bytes_.size();
    return r;
  }

 private:
  std::span<const uint8_t> bytes_;
  size_t at_ = 0;
};

}  // namespace moe
