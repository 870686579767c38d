#include "model/rope.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numbers>
#include <set>

#include <fmt/format.h>

#include "moe/errors.h"

namespace moe {

namespace {

using nlohmann::json;

const json* object_at(const HfConfig& cfg, const char* key) {
  auto it = cfg.json().find(key);
  if (it == cfg.json().end() || it->is_null()) return nullptr;
  MOE_CHECK(it->is_object(), kConfig, "{}: '{}' must be an object, got {}", cfg.origin(), key, it->dump());
  return &*it;
}

// The spelling of the type key differs between the two eras ("type" before "rope_type").
std::string canonical_key(const std::string& key) { return key == "type" ? "rope_type" : key; }

// One rope object, read with the same rules as transformers: a null or zero optional value means
// "use the default" (transformers reads them with `x or default`).
class RopeFields {
 public:
  RopeFields(const json& object, std::string where) : where_(std::move(where)) {
    for (const auto& [key, value] : object.items())
      if (!value.is_null()) values_[canonical_key(key)] = value;
  }
  const std::string& where() const { return where_; }
  bool has(const std::string& key) const { return values_.count(key) != 0; }
  const std::map<std::string, json>& values() const { return values_; }

  std::string type() const {
    if (!has("rope_type")) return "default";
    const json& v = values_.at("rope_type");
    MOE_CHECK(v.is_string(), kConfig, "{}: rope_type must be a string, got {}", where_, v.dump());
    return v.get<std::string>();
  }
  double number(const std::string& key, double fallback) const {
    if (!has(key)) return fallback;
    const json& v = values_.at(key);
    MOE_CHECK(v.is_number() && std::isfinite(v.get<double>()), kConfig, "{}: '{}' must be a finite number, got {}",
              where_, key, v.dump());
    return v.get<double>();
  }
  double required(const std::string& key) const {
    MOE_CHECK(has(key), kConfig, "{}: rope type '{}' needs '{}'", where_, type(), key);
    return number(key, 0.0);
  }
  bool boolean(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    const json& v = values_.at(key);
    MOE_CHECK(v.is_boolean(), kConfig, "{}: '{}' must be true or false, got {}", where_, key, v.dump());
    return v.get<bool>();
  }
  int64_t positions(const std::string& key, int64_t fallback) const {
    if (!has(key)) return fallback;
    const json& v = values_.at(key);
    MOE_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, kConfig,
              "{}: '{}' must be a positive integer, got {}", where_, key, v.dump());
    return v.get<int64_t>();
  }

 private:
  std::string where_;
  std::map<std::string, json> values_;
};

constexpr const char* kSupported = "default, linear, llama3, yarn";

void refuse_unknown_keys(const RopeFields& f, const std::set<std::string>& known) {
  for (const auto& [key, value] : f.values()) {
    if (key == "rope_type" || key == "rope_theta" || known.count(key)) continue;
    std::string list;
    for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
    MOE_THROW(kUnsupported, "{}: key '{}' is not supported with rope type '{}' (it takes {})", f.where(), key,
              f.type(), list.empty() ? "no other key" : list);
  }
}

double get_mscale(double scale, double mscale) { return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

}  // namespace

const char* rope_type_name(RopeType type) {
  switch (type) {
    case RopeType::kDefault: return "default";
    case RopeType::kLinear: return "linear";
    case RopeType::kLlama3: return "llama3";
    case RopeType::kYarn: return "yarn";
  }
  return "?";
}

std::string describe_rope(const RopeScaling& rs, double theta) {
  std::string s = fmt::format("theta {:g}, {}", theta, rope_type_name(rs.type));
  switch (rs.type) {
    case RopeType::kDefault: break;
    case RopeType::kLinear: s += fmt::format(" factor {:g}", rs.factor); break;
    case RopeType::kLlama3:
      s += fmt::format(" factor {:g} over {} positions (low/high frequency factors {:g}/{:g})", rs.factor,
                       rs.original_max_position, rs.low_freq_factor, rs.high_freq_factor);
      break;
    case RopeType::kYarn: {
      const RopeTable t = rope_table(rs, theta, 2);
      s += fmt::format(" factor {:g} over {} positions (beta {:g}/{:g}, cos/sin x{:.4g})", rs.factor,
                       rs.original_max_position, rs.beta_fast, rs.beta_slow, t.cos_sin_scale);
      break;
    }
  }
  return s;
}

RopeScaling parse_rope_scaling(const HfConfig& cfg, int64_t max_position_embeddings) {
  const json* params = object_at(cfg, "rope_parameters");
  const json* legacy = object_at(cfg, "rope_scaling");
  if (!params && !legacy) return {};
  if (params && legacy) {
    // Written by different versions of transformers; both describe one embedding.
    const RopeFields p(*params, cfg.origin() + ": rope_parameters");
    const RopeFields l(*legacy, cfg.origin() + ": rope_scaling");
    for (const auto& [key, value] : l.values())
      if (p.has(key))
        MOE_CHECK(p.values().at(key) == value, kConfig,
                  "{}: rope_scaling and rope_parameters disagree on '{}' ({} and {})", cfg.origin(), key,
                  value.dump(), p.values().at(key).dump());
  }
  const RopeFields f(params ? *params : *legacy,
                     cfg.origin() + (params ? ": rope_parameters" : ": rope_scaling"));
  // As transformers: a top-level original_max_position_embeddings (Phi-3's spelling) wins.
  int64_t original = 0;
  if (const auto* top = cfg.find({"original_max_position_embeddings"})) {
    MOE_CHECK(top->is_number_integer() && top->get<int64_t>() > 0, kConfig,
              "{}: original_max_position_embeddings must be a positive integer, got {}", cfg.origin(), top->dump());
    original = top->get<int64_t>();
  }
  const double partial = f.number("partial_rotary_factor", 1.0);
  MOE_CHECK(partial == 1.0, kUnsupported, "{}: partial_rotary_factor {} is not supported (only 1)", f.where(),
            partial);

  RopeScaling rs;
  const std::string type = f.type();
  auto positive_factor = [&](double v) {
    MOE_CHECK(v > 0.0, kConfig, "{}: factor must be positive, got {}", f.where(), v);
    return v;
  };
  if (type == "default") {
    refuse_unknown_keys(f, {"partial_rotary_factor"});
  } else if (type == "linear") {
    refuse_unknown_keys(f, {"factor", "partial_rotary_factor"});
    rs.type = RopeType::kLinear;
    rs.factor = positive_factor(f.required("factor"));
  } else if (type == "llama3") {
    refuse_unknown_keys(f, {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                            "partial_rotary_factor"});
    rs.type = RopeType::kLlama3;
    rs.factor = positive_factor(f.required("factor"));
    rs.low_freq_factor = f.required("low_freq_factor");
    rs.high_freq_factor = f.required("high_freq_factor");
    MOE_CHECK(original || f.has("original_max_position_embeddings"), kConfig, "{}: rope type 'llama3' needs '{}'", f.where(),
              "original_max_position_embeddings");
    rs.original_max_position = original ? original : f.positions("original_max_position_embeddings", 0);
    MOE_CHECK(rs.low_freq_factor > 0.0 && rs.high_freq_factor > rs.low_freq_factor, kConfig,
              "{}: llama3 needs 0 < low_freq_factor < high_freq_factor, got {} and {}", f.where(),
              rs.low_freq_factor, rs.high_freq_factor);
  } else if (type == "yarn") {
    refuse_unknown_keys(f, {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                            "mscale_all_dim", "attention_factor", "truncate", "partial_rotary_factor"});
    rs.type = RopeType::kYarn;
    rs.original_max_position =
        original ? original : f.positions("original_max_position_embeddings", max_position_embeddings);
    // transformers 5: an absent factor is the ratio of the extended to the original context.
    rs.factor = positive_factor(f.number("factor", static_cast<double>(max_position_embeddings) /
                                                       static_cast<double>(rs.original_max_position)));
    rs.beta_fast = f.number("beta_fast", 0.0);
    rs.beta_slow = f.number("beta_slow", 0.0);
    if (rs.beta_fast == 0.0) rs.beta_fast = 32.0;
    if (rs.beta_slow == 0.0) rs.beta_slow = 1.0;
    MOE_CHECK(rs.beta_fast > 0.0 && rs.beta_slow > 0.0, kConfig, "{}: beta_fast and beta_slow must be positive",
              f.where());
    rs.mscale = f.number("mscale", 0.0);
    rs.mscale_all_dim = f.number("mscale_all_dim", 0.0);
    rs.attention_factor = f.number("attention_factor", 0.0);
    MOE_CHECK(rs.attention_factor >= 0.0, kConfig, "{}: attention_factor must be positive, got {}", f.where(),
              rs.attention_factor);
    rs.truncate = f.boolean("truncate", true);
  } else if (type == "dynamic") {
    MOE_THROW(kUnsupported,
              "{}: rope type 'dynamic' is not supported: its frequencies change with the sequence length, "
              "which keys already in the KV cache cannot follow (supported: {})",
              f.where(), kSupported);
  } else {
    MOE_THROW(kUnsupported, "{}: rope type '{}' is not supported (supported: {})", f.where(), type, kSupported);
  }
  return rs;
}

RopeTable rope_table(const RopeScaling& rs, double theta, int64_t rot_dim) {
  MOE_CHECK(rot_dim > 0 && rot_dim % 2 == 0, kInternal, "rotary width {} must be positive and even", rot_dim);
  const int64_t half = rot_dim / 2;
  const float base = static_cast<float>(theta);
  RopeTable table;
  table.inv_freq.resize(static_cast<size_t>(half));
  // theta ** (2i / d) in f32, as torch evaluates it; the plain frequencies.
  std::vector<float> pos_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    pos_freq[static_cast<size_t>(i)] = std::pow(base, static_cast<float>(2 * i) / static_cast<float>(rot_dim));
  const auto factor = static_cast<float>(rs.factor);

  switch (rs.type) {
    case RopeType::kDefault:
      for (int64_t i = 0; i < half; ++i) table.inv_freq[static_cast<size_t>(i)] = 1.0f / pos_freq[static_cast<size_t>(i)];
      break;
    case RopeType::kLinear:
      for (int64_t i = 0; i < half; ++i)
        table.inv_freq[static_cast<size_t>(i)] = 1.0f / pos_freq[static_cast<size_t>(i)] / factor;
      break;
    case RopeType::kLlama3: {
      // Long wavelengths (past the original context / low_freq_factor) are divided by factor,
      // short ones (under context / high_freq_factor) kept, those between blended smoothly.
      const auto old_context = static_cast<double>(rs.original_max_position);
      const auto low_wavelen = static_cast<float>(old_context / rs.low_freq_factor);
      const auto high_wavelen = static_cast<float>(old_context / rs.high_freq_factor);
      const auto two_pi = static_cast<float>(2.0 * std::numbers::pi);
      for (int64_t i = 0; i < half; ++i) {
        const float inv = 1.0f / pos_freq[static_cast<size_t>(i)];
        const float wavelen = two_pi / inv;
        const float scaled = wavelen > low_wavelen ? inv / factor : inv;
        const float smooth = (static_cast<float>(old_context) / wavelen - static_cast<float>(rs.low_freq_factor)) /
                             static_cast<float>(rs.high_freq_factor - rs.low_freq_factor);
        const float blended = (1.0f - smooth) * scaled / factor + smooth * scaled;
        const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
        table.inv_freq[static_cast<size_t>(i)] = medium ? blended : scaled;
      }
      break;
    }
    case RopeType::kYarn: {
      // Dimensions that turn fewer than beta_slow times over the original context are
      // interpolated (divided by factor), those turning more than beta_fast times kept, a linear
      // ramp between; the ramp's ends in double as transformers' Python computes them.
      const double d = static_cast<double>(rot_dim);
      auto correction_dim = [&](double rotations) {
        return d * std::log(static_cast<double>(rs.original_max_position) / (rotations * 2.0 * std::numbers::pi)) /
               (2.0 * std::log(theta));
      };
      double low = correction_dim(rs.beta_fast), high = correction_dim(rs.beta_slow);
      if (rs.truncate) low = std::floor(low), high = std::ceil(high);
      low = std::max(low, 0.0);
      high = std::min(high, d - 1.0);
      if (low == high) high += 0.001;  // as transformers: no zero-width ramp
      const auto ramp_low = static_cast<float>(low), ramp_width = static_cast<float>(high - low);
      for (int64_t i = 0; i < half; ++i) {
        const float pf = pos_freq[static_cast<size_t>(i)];
        const float extrapolated = 1.0f / pf, interpolated = 1.0f / (factor * pf);
        const float ramp = std::clamp((static_cast<float>(i) - ramp_low) / ramp_width, 0.0f, 1.0f);
        const float keep = 1.0f - ramp;
        table.inv_freq[static_cast<size_t>(i)] = interpolated * (1.0f - keep) + extrapolated * keep;
      }
      double attention = rs.attention_factor;
      if (attention == 0.0)
        attention = rs.mscale != 0.0 && rs.mscale_all_dim != 0.0
                        ? get_mscale(rs.factor, rs.mscale) / get_mscale(rs.factor, rs.mscale_all_dim)
                        : get_mscale(rs.factor, 1.0);
      table.cos_sin_scale = static_cast<float>(attention);
      break;
    }
  }
  return table;
}

double yarn_softmax_mscale_squared(const RopeScaling& rs) {
  if (rs.type != RopeType::kYarn || rs.mscale_all_dim == 0.0) return 1.0;
  const double m = get_mscale(rs.factor, rs.mscale_all_dim);
  return m * m;
}

}  // namespace moe
