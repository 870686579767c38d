// Reading .safetensors files: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the data. The file is memory-mapped; the header is
// validated completely (sizes, ranges, overlaps) before any tensor is handed out.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "moe/tensor.h"

namespace moe {

struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section
  uint64_t end = 0;
};

// Parses and validates a safetensors header. `header` is the JSON text, `data_size` the number of
// bytes that follow it in the file. `origin` names the file in error messages. Throws kFormat.
std::vector<TensorInfo> parse_safetensors_header(const std::string& header, uint64_t data_size,
                                                 const std::string& origin);

// Parses a whole safetensors file held in memory: header length, header, and the size of the data
// that follows. Sets *data_offset to where the data starts. Throws kIo (truncated) or kFormat.
std::vector<TensorInfo> parse_safetensors_buffer(const uint8_t* bytes, uint64_t size,
                                                 const std::string& origin,
                                                 uint64_t* data_offset);

class SafetensorsFile {
 public:
  // Maps the file and validates its header; throws kIo (missing, unreadable, truncated) or
  // kFormat (malformed header).
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;
  // Pointer to the first byte of the tensor's data inside the mapping.
  const void* data(const TensorInfo& info) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  const uint8_t* data_ = nullptr;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
};

}  // namespace moe
