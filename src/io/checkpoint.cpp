#include "io/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <optional>

#include <nlohmann/json.hpp>

#include "io/fp8_blocks.h"
#include "io/regular_file.h"
#include "moe/errors.h"

namespace moe {

namespace fs = std::filesystem;

namespace {
// An index names each tensor once (about 100 bytes a tensor): 256 MiB is millions of tensors, far
// more than any checkpoint has.
constexpr uint64_t kMaxIndexBytes = 256ull << 20;
}  // namespace

Checkpoint::Checkpoint(const std::string& dir) : dir_(dir) {
  MOE_CHECK(fs::is_directory(dir), kIo, "model directory {} does not exist", dir);
  fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  fs::path single = fs::path(dir) / "model.safetensors";
  std::vector<std::string> shard_names;
  std::map<std::string, std::string> weight_map;
  if (fs::exists(index_path)) {
    const std::string text = read_regular_file(index_path.string(), kMaxIndexBytes);
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      MOE_THROW(kFormat, "{} is not valid JSON ({})", index_path.string(), e.what());
    }
    MOE_CHECK(index.contains("weight_map") && index["weight_map"].is_object(), kFormat,
              "{} has no weight_map object", index_path.string());
    std::set<std::string> seen;
    for (auto& [name, file] : index["weight_map"].items()) {
      MOE_CHECK(file.is_string(), kFormat, "{}: weight_map entry '{}' is not a file name",
                index_path.string(), name);
      std::string f = file.get<std::string>();
      MOE_CHECK(f.find('/') == std::string::npos && f != ".." && !f.empty(), kFormat,
                "{}: shard name '{}' must be a plain file name", index_path.string(), f);
      weight_map[name] = f;
      if (seen.insert(f).second) shard_names.push_back(f);
    }
  } else if (fs::exists(single)) {
    shard_names.push_back("model.safetensors");
  } else {
    MOE_THROW(kIo, "no weights in {}: expected model.safetensors or model.safetensors.index.json",
              dir);
  }
  for (const auto& shard : shard_names) {
    files_.push_back(std::make_unique<SafetensorsFile>((fs::path(dir) / shard).string()));
    const SafetensorsFile* file = files_.back().get();
    for (const auto& t : file->tensors()) {
      auto [it, inserted] = where_.emplace(t.name, std::make_pair(file, &t));
      MOE_CHECK(inserted, kFormat, "tensor '{}' appears in both {} and {}", t.name,
                it->second.first->path(), file->path());
    }
  }
  for (const auto& [name, shard] : weight_map) {
    auto it = where_.find(name);
    MOE_CHECK(it != where_.end(), kFormat, "index lists tensor '{}' in {}, but that shard lacks it",
              name, shard);
  }
}

const TensorInfo& Checkpoint::info(const std::string& name) const {
  auto it = where_.find(name);
  MOE_CHECK(it != where_.end(), kShape, "missing tensor '{}' in checkpoint {}", name, dir_);
  return *it->second.second;
}

const void* Checkpoint::data(const std::string& name) const {
  auto it = where_.find(name);
  MOE_CHECK(it != where_.end(), kShape, "missing tensor '{}' in checkpoint {}", name, dir_);
  return it->second.first->data(*it->second.second);
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [name, _] : where_) out.push_back(name);
  return out;
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t total = 0;
  for (const auto& [_, w] : where_) total += w.second->end - w.second->begin;
  return total;
}

uint64_t Checkpoint::total_elements() const {
  uint64_t total = 0;
  for (const auto& [_, w] : where_) {
    uint64_t n = 1;
    for (int64_t d : w.second->shape) n *= static_cast<uint64_t>(d);
    total += n;
  }
  return total;
}

WeightLoader::WeightLoader(const Checkpoint& ckpt, Arena& arena, bool strict)
    : ckpt_(&ckpt), arena_(arena), strict_(strict) {}

WeightLoader::WeightLoader(Arena& arena, uint64_t seed)
    : ckpt_(nullptr), arena_(arena), strict_(false), seed_(seed) {}

void WeightLoader::set_fp8_blocks(int64_t block_rows, int64_t block_cols, std::vector<std::string> not_converted) {
  MOE_CHECK(block_rows > 0 && block_cols > 0, kInvalidArgument, "FP8 blocks of {} x {}", block_rows, block_cols);
  fp8_rows_ = block_rows;
  fp8_cols_ = block_cols;
  fp8_not_converted_ = std::move(not_converted);
}

WeightLoader WeightLoader::recording(Arena& arena) {
  WeightLoader loader(arena, 0);
  loader.recording_ = true;
  return loader;
}

Tensor WeightLoader::allocate(const std::vector<int64_t>& shape, const std::vector<Part>& parts) {
  if (recording_) return Tensor();
  Tensor t = Tensor::empty(arena_, shape, DType::kF32);
  if (sink_ && shape.size() >= 2) {
    const WeightFormat format = format_for(shape, parts);
    float* begin = t.data<float>();
    sink_->place(begin, shape, format);
    if (format.scaled()) fp8_destinations_[begin] = begin + t.numel();
  }
  return t;
}

namespace {
// A module that a published FP8 checkpoint keeps in 16 bits whatever its config lists: the
// embedding, the output head and the routers (not linear layers in the reference code).
bool kept_in_16_bits(const std::string& module) {
  for (const char* end : {"embed_tokens", "lm_head", ".gate", "shared_expert_gate"})
    if (module.ends_with(end)) return true;
  return false;
}
}  // namespace

bool WeightLoader::is_fp8_part(const std::string& name) const {
  if (ckpt_) {
    if (!ckpt_->contains(name)) return false;
    const DType d = ckpt_->info(name).dtype;
    return d == DType::kF8E4M3 || d == DType::kF8E5M2;  // E5M2 is refused by name when read
  }
  // Random weights in an FP8 layout: what a published checkpoint of the config would hold.
  if (!name.ends_with(".weight")) return false;
  const std::string module = name.substr(0, name.size() - 7);
  if (kept_in_16_bits(module)) return false;
  for (const std::string& kept : fp8_not_converted_)
    if (module == kept) return false;
  return true;
}

WeightFormat WeightLoader::format_for(const std::vector<int64_t>& shape, const std::vector<Part>& parts) const {
  if (!sink_ || !sink_->keeps_fp8_blocks() || fp8_rows_ == 0 || shape.size() < 2 || parts.empty()) return {};
  const int64_t rows = shape[shape.size() - 2];
  int64_t at = 0;
  for (const Part& p : parts) {
    // A part that is not FP8, or that starts inside a block, leaves the whole destination in bf16.
    if (!is_fp8_part(p.name) || (at % rows) % fp8_rows_ != 0) return {};
    at += p.rows;
  }
  return WeightFormat{DType::kF8E4M3, fp8_rows_, fp8_cols_};
}

bool WeightLoader::in_fp8_destination(const float* dst) const {
  auto it = fp8_destinations_.upper_bound(dst);
  if (it == fp8_destinations_.begin()) return false;
  --it;
  return dst >= it->first && dst < it->second;
}

namespace {
std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}
}  // namespace

namespace {
// splitmix64: a fast, well-mixed stream for filling large random tensors.
uint64_t splitmix(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

bool is_norm(const std::string& name) { return name.find("norm") != std::string::npos; }

uint64_t random_state(const std::string& name, uint64_t seed) {
  return seed ^ std::hash<std::string>{}(name);
}

// Continues the stream in `state`; `count` is even except at the end of a tensor.
void fill_random(uint64_t& state, float* dst, size_t count) {
  const float scale = 0.02f * 1.7320508f / 2147483648.0f;  // uniform(-a, a) has std a / sqrt(3)
  for (size_t i = 0; i < count; i += 2) {
    uint64_t r = splitmix(state);
    dst[i] = static_cast<float>(static_cast<int32_t>(r)) * scale;
    if (i + 1 < count) dst[i + 1] = static_cast<float>(static_cast<int32_t>(r >> 32)) * scale;
  }
}

void fill_random(const std::string& name, uint64_t seed, float* dst, size_t count) {
  if (is_norm(name)) {
    for (size_t i = 0; i < count; ++i) dst[i] = 1.0f;
    return;
  }
  uint64_t state = random_state(name, seed);
  fill_random(state, dst, count);
}

constexpr size_t kSinkChunk = size_t(1) << 22;  // floats converted at a time on the way to a sink
}  // namespace

void WeightLoader::take_into(const std::string& name, const std::vector<int64_t>& shape,
                             float* dst) {
  order_.emplace_back(name, shape);
  if (recording_) {
    taken_.insert(name);
    return;
  }
  const TensorInfo* info = nullptr;
  if (ckpt_) {
    info = &ckpt_->info(name);
    MOE_CHECK(info->shape == shape, kShape, "tensor '{}' has shape {} but the config implies {}",
              name, shape_string(info->shape), shape_string(shape));
  }
  size_t count = 1;
  for (int64_t d : shape) count *= static_cast<size_t>(d);
  // FP8 weights come out exactly as q x scale of their block; the rest converts element-wise.
  std::optional<Fp8Tensor> fp8;
  if (ckpt_ && (info->dtype == DType::kF8E4M3 || info->dtype == DType::kF8E5M2)) {
    MOE_CHECK(fp8_rows_ > 0, kFormat, "tensor '{}' is {} but config.json declares no FP8 quantization_config",
              name, dtype_name(info->dtype));
    const std::string module = name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
    for (const std::string& kept : fp8_not_converted_)
      MOE_CHECK(module != kept, kFormat,
                "tensor '{}' is FP8, but quantization_config lists '{}' in modules_to_not_convert", name, kept);
    fp8.emplace(*ckpt_, name, fp8_rows_, fp8_cols_);
  }
  const auto* src = ckpt_ ? static_cast<const uint8_t*>(ckpt_->data(name)) : nullptr;
  auto convert = [&](size_t at, size_t n, float* out) {
    if (fp8)
      fp8->dequantize(at, n, out);
    else
      convert_to_f32(src + at * dtype_size(info->dtype), info->dtype, out, n);
  };
  const bool host_copy = !sink_ || shape.size() <= 1;
  const bool keep_blocks = !host_copy && in_fp8_destination(dst);
  if (keep_blocks && ckpt_) {
    MOE_CHECK(fp8.has_value(), kInternal, "tensor '{}' is not FP8 but was placed in an FP8 destination", name);
    sink_->write_blocks(dst, fp8->piece());
  } else if (keep_blocks) {
    MOE_CHECK(sink_->fill_random(dst, count, random_state(name, seed_)), kInternal,
              "the weight sink cannot draw FP8 tensor '{}'", name);
  } else if (host_copy) {
    if (ckpt_)
      convert(0, count, dst);
    else
      fill_random(name, seed_, dst, count);
  } else if (ckpt_) {
    // Through a bounded scratch buffer, so that the host never holds the whole f32 tensor.
    std::vector<float> scratch(std::min(count, kSinkChunk));
    for (size_t at = 0; at < count; at += scratch.size()) {
      const size_t n = std::min(scratch.size(), count - at);
      convert(at, n, scratch.data());
      sink_->write(dst + at, scratch.data(), n);
    }
  } else {
    uint64_t state = random_state(name, seed_);
    if (is_norm(name) || !sink_->fill_random(dst, count, state)) {
      std::vector<float> scratch(std::min(count, kSinkChunk));
      for (size_t at = 0; at < count; at += scratch.size()) {
        const size_t n = std::min(scratch.size(), count - at);
        if (is_norm(name))
          std::fill_n(scratch.data(), n, 1.0f);
        else
          fill_random(state, scratch.data(), n);
        sink_->write(dst + at, scratch.data(), n);
      }
    }
  }
  taken_.insert(name);
  bytes_loaded_ += ckpt_ ? info->end - info->begin : count * 4;
  if (fp8) {
    taken_.insert(fp8->scale_name());
    bytes_loaded_ += fp8->scale_bytes();
    ++fp8_tensors_;
  }
  if (ckpt_ && on_progress) on_progress(bytes_loaded_, ckpt_->total_bytes());
}

Tensor WeightLoader::take(const std::string& name, const std::vector<int64_t>& shape) {
  if (ckpt_) ckpt_->info(name);  // a missing tensor is reported before anything is allocated
  if (recording_) {
    take_into(name, shape, nullptr);
    return Tensor();
  }
  Tensor out = allocate(shape, {{name, shape.size() >= 2 ? shape[shape.size() - 2] : 0}});
  take_into(name, shape, out.data<float>());
  return out;
}

Tensor WeightLoader::take_if_present(const std::string& name, const std::vector<int64_t>& shape) {
  if (ckpt_ && !strict_ && !ckpt_->contains(name)) return Tensor();
  return take(name, shape);
}

int64_t WeightLoader::ignore_prefix(const std::string& prefix) {
  if (!ckpt_) return 0;
  int64_t n = 0;
  for (const auto& name : ckpt_->names())
    if (name.starts_with(prefix)) {
      taken_.insert(name);
      ++n;
    }
  return n;
}

void WeightLoader::finish() {
  if (!strict_ || !ckpt_) return;
  std::vector<std::string> unused;
  for (const auto& name : ckpt_->names())
    if (!taken_.count(name)) unused.push_back(name);
  if (unused.empty()) return;
  std::string list;
  for (size_t i = 0; i < unused.size() && i < 3; ++i) list += (i ? ", '" : "'") + unused[i] + "'";
  MOE_THROW(kShape, "unexpected tensor{} {}{} in checkpoint {} (strict loading)",
            unused.size() > 1 ? "s" : "", list,
            unused.size() > 3 ? fmt::format(" and {} more", unused.size() - 3) : "", ckpt_->dir());
}

}  // namespace moe
