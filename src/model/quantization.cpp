#include "model/quantization.h"

#include <fmt/format.h>

#include "moe/errors.h"

namespace moe {

namespace {

constexpr int64_t kBlock = 128;  // the block the engine's FP8 path runs
constexpr const char* kSupported =
    "supported: quant_method fp8 with fmt e4m3, weight_block_size [128, 128] and activation_scheme dynamic";

}  // namespace

WeightFormat Quantization::weight_format() const {
  if (!fp8) return WeightFormat{};
  return WeightFormat{DType::kF8E4M3, block_rows, block_cols};
}

std::string Quantization::describe() const {
  if (!fp8) return "none";
  return fmt::format("fp8 e4m3, {} x {} blocks{}, dynamic activations{}", block_rows, block_cols,
                     scale_fmt.empty() ? "" : " (scales " + scale_fmt + ")",
                     modules_to_not_convert.empty()
                         ? ""
                         : fmt::format(", {} modules kept unquantized", modules_to_not_convert.size()));
}

Quantization parse_quantization(const HfConfig& cfg) {
  Quantization q;
  const nlohmann::json* qc = cfg.find({"quantization_config"});
  if (!qc || qc->is_null()) return q;
  const std::string where = cfg.origin() + ": quantization_config";
  MOE_CHECK(qc->is_object(), kConfig, "{} is not an object", where);
  const auto text = [&](const char* key) -> std::string {
    const auto it = qc->find(key);
    if (it == qc->end() || it->is_null()) return "";
    MOE_CHECK(it->is_string(), kConfig, "{}: '{}' is not a string", where, key);
    return it->get<std::string>();
  };
  const std::string method = text("quant_method");
  MOE_CHECK(!method.empty(), kConfig, "{} has no quant_method; {}", where, kSupported);
  MOE_CHECK(method == "fp8", kUnsupported, "{}: quant_method '{}' is not supported; {}", where, method, kSupported);
  // Every key must mean something to the engine: a setting it ignored would load the weights wrongly.
  for (const auto& [key, value] : qc->items()) {
    static const char* kKnown[] = {"quant_method", "fmt", "weight_block_size", "activation_scheme", "scale_fmt",
                                   "modules_to_not_convert"};
    bool known = false;
    for (const char* k : kKnown) known = known || key == k;
    MOE_CHECK(known, kUnsupported, "{}: key '{}' is not supported; {}", where, key, kSupported);
  }
  const std::string fmt_name = text("fmt");
  MOE_CHECK(fmt_name.empty() || fmt_name == "e4m3", kUnsupported, "{}: fmt '{}' is not supported; {}", where,
            fmt_name, kSupported);
  const std::string activations = text("activation_scheme");
  MOE_CHECK(activations.empty() || activations == "dynamic", kUnsupported,
            "{}: activation_scheme '{}' (scales stored for activations) is not supported; {}", where, activations,
            kSupported);
  q.scale_fmt = text("scale_fmt");
  MOE_CHECK(q.scale_fmt.empty() || q.scale_fmt == "ue8m0", kUnsupported,
            "{}: scale_fmt '{}' is not supported (f32 scales, or ue8m0: powers of two stored as f32)", where,
            q.scale_fmt);
  const auto block = qc->find("weight_block_size");
  MOE_CHECK(block != qc->end() && !block->is_null(), kUnsupported,
            "{}: FP8 without weight_block_size (one scale per tensor or per channel) is not supported; {}", where,
            kSupported);
  MOE_CHECK(block->is_array() && block->size() == 2 && (*block)[0].is_number_integer() &&
                (*block)[1].is_number_integer(),
            kConfig, "{}: weight_block_size {} is not two integers", where, block->dump());
  q.block_rows = (*block)[0].get<int64_t>();
  q.block_cols = (*block)[1].get<int64_t>();
  MOE_CHECK(q.block_rows == kBlock && q.block_cols == kBlock, kUnsupported,
            "{}: weight_block_size [{}, {}] is not a block the engine runs; {}", where, q.block_rows, q.block_cols,
            kSupported);
  if (const auto skip = qc->find("modules_to_not_convert"); skip != qc->end() && !skip->is_null()) {
    MOE_CHECK(skip->is_array(), kConfig, "{}: modules_to_not_convert is not a list", where);
    for (const auto& m : *skip) {
      MOE_CHECK(m.is_string(), kConfig, "{}: modules_to_not_convert holds {}, not a name", where, m.dump());
      q.modules_to_not_convert.push_back(m.get<std::string>());
    }
  }
  q.fp8 = true;
  return q;
}

}  // namespace moe
