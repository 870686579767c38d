// config.json as Hugging Face writes it, read through aliases: each value is looked up under a
// list of names tried in order (dotted names reach into nested objects, e.g.
// "rope_parameters.rope_theta"). A null value counts as absent.
#pragma once

#include <initializer_list>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moe/errors.h"

namespace moe {

class HfConfig {
 public:
  HfConfig(nlohmann::json root, std::string origin);
  // Reads and parses a JSON file; kIo when missing, kFormat when not a JSON object.
  static HfConfig from_file(const std::string& path);

  const nlohmann::json& json() const { return root_; }
  const std::string& origin() const { return origin_; }

  // The first alias present, or nullptr.
  const nlohmann::json* find(std::initializer_list<const char*> aliases) const;
  bool has(std::initializer_list<const char*> aliases) const { return find(aliases) != nullptr; }

  // The value under the first alias present; kConfig naming the aliases when none is, or when
  // the value has the wrong type.
  template <typename T>
  T get(std::initializer_list<const char*> aliases) const {
    const nlohmann::json* v = find(aliases);
    if (!v) MOE_THROW(kConfig, "{}: missing key {}", origin_, describe(aliases));
    return convert<T>(*v, aliases);
  }
  template <typename T>
  T get_or(std::initializer_list<const char*> aliases, T fallback) const {
    const nlohmann::json* v = find(aliases);
    return v ? convert<T>(*v, aliases) : fallback;
  }

 private:
  static std::string describe(std::initializer_list<const char*> aliases);
  template <typename T>
  T convert(const nlohmann::json& v, std::initializer_list<const char*> aliases) const {
    try {
      if constexpr (std::is_same_v<T, bool>) {
        if (!v.is_boolean()) throw std::runtime_error("expected a boolean");
      } else if constexpr (std::is_integral_v<T>) {
        if (!v.is_number_integer()) throw std::runtime_error("expected an integer");
      } else if constexpr (std::is_floating_point_v<T>) {
        if (!v.is_number()) throw std::runtime_error("expected a number");
      }
      return v.get<T>();
    } catch (const std::exception& e) {
      MOE_THROW(kConfig, "{}: key {} holds {} ({})", origin_, describe(aliases), v.dump(),
                e.what());
    }
  }

  nlohmann::json root_;
  std::string origin_;
};

}  // namespace moe
