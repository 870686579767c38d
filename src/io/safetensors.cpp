#include "io/safetensors.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

#include "io/regular_file.h"
#include "moe/errors.h"

namespace moe {

namespace {
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the format's own limit is 100 MB

uint64_t checked_mul(uint64_t a, uint64_t b, const std::string& where) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a)
    MOE_THROW(kFormat, "{}: tensor size overflows", where);
  return a * b;
}
}  // namespace

std::vector<TensorInfo> parse_safetensors_header(const std::string& header, uint64_t data_size,
                                                 const std::string& origin) {
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    MOE_THROW(kFormat, "{}: safetensors header is not valid JSON ({})", origin, e.what());
  }
  MOE_CHECK(root.is_object(), kFormat, "{}: safetensors header is not a JSON object", origin);
  std::vector<TensorInfo> tensors;
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string where = origin + ": tensor '" + it.key() + "'";
    const auto& v = it.value();
    MOE_CHECK(v.is_object() && v.contains("dtype") && v.contains("shape") &&
                  v.contains("data_offsets"),
              kFormat, "{} lacks dtype, shape or data_offsets", where);
    MOE_CHECK(v["dtype"].is_string(), kFormat, "{}: dtype is not a string", where);
    TensorInfo info;
    info.name = it.key();
    try {
      info.dtype = dtype_from_safetensors(v["dtype"].get<std::string>());
    } catch (const Error& e) {
      MOE_THROW(kFormat, "{}: {}", where, e.message());
    }
    MOE_CHECK(v["shape"].is_array(), kFormat, "{}: shape is not an array", where);
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      MOE_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0),
                kFormat, "{}: shape holds a non-integer or negative dimension", where);
      uint64_t dim = d.get<uint64_t>();
      MOE_CHECK(dim < (1ull << 40), kFormat, "{}: dimension {} is implausibly large", where, dim);
      info.shape.push_back(static_cast<int64_t>(dim));
      numel = checked_mul(numel, dim, where);
    }
    const auto& off = v["data_offsets"];
    MOE_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() &&
                  off[1].is_number_unsigned(),
              kFormat, "{}: data_offsets must be two non-negative integers", where);
    info.begin = off[0].get<uint64_t>();
    info.end = off[1].get<uint64_t>();
    MOE_CHECK(info.begin <= info.end, kFormat, "{}: data_offsets [{}, {}] are reversed", where,
              info.begin, info.end);
    MOE_CHECK(info.end <= data_size, kFormat,
              "{}: data_offsets [{}, {}] run past the end of the data ({} bytes)", where,
              info.begin, info.end, data_size);
    uint64_t bytes = checked_mul(numel, dtype_size(info.dtype), where);
    MOE_CHECK(info.end - info.begin == bytes, kFormat,
              "{}: holds {} bytes but dtype {} and shape need {}", where, info.end - info.begin,
              dtype_name(info.dtype), bytes);
    tensors.push_back(std::move(info));
  }
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorInfo* prev = by_offset[i - 1];
    const TensorInfo* cur = by_offset[i];
    MOE_CHECK(cur->begin >= prev->end || cur->begin == cur->end || prev->begin == prev->end,
              kFormat, "{}: tensors '{}' and '{}' overlap (bytes [{}, {}) and [{}, {}))", origin,
              prev->name, cur->name, prev->begin, prev->end, cur->begin, cur->end);
  }
  return tensors;
}

std::vector<TensorInfo> parse_safetensors_buffer(const uint8_t* bytes, uint64_t size,
                                                 const std::string& origin,
                                                 uint64_t* data_offset) {
  MOE_CHECK(size >= 8, kIo, "{} is truncated: {} bytes, fewer than the 8-byte header length",
            origin, size);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | bytes[i];
  MOE_CHECK(header_len <= size - 8, kIo,
            "{} is truncated or corrupt: header length {} is larger than the file ({} bytes)",
            origin, header_len, size);
  MOE_CHECK(header_len <= kMaxHeaderBytes, kFormat, "{}: header length {} exceeds 100 MB", origin,
            header_len);
  std::string header(reinterpret_cast<const char*>(bytes + 8), header_len);
  *data_offset = 8 + header_len;
  return parse_safetensors_header(header, size - 8 - header_len, origin);
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const RegularFile file(path);
  const uint64_t size = file.size();
  MOE_CHECK(size >= 8, kIo, "{} is truncated: {} bytes, fewer than the 8-byte header length", path,
            size);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, file.fd(), 0);
  MOE_CHECK(map != MAP_FAILED, kIo, "cannot map {}: {}", path, std::strerror(errno));
  map_ = map;
  map_size_ = size;
  try {
    uint64_t offset = 0;
    tensors_ = parse_safetensors_buffer(static_cast<const uint8_t*>(map_), size, path, &offset);
    data_ = static_cast<const uint8_t*>(map_) + offset;
  } catch (...) {
    ::munmap(map_, map_size_);
    map_ = nullptr;
    throw;
  }
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const void* SafetensorsFile::data(const TensorInfo& info) const { return data_ + info.begin; }

}  // namespace moe
