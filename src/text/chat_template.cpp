// ChatTemplate: reads the template and special tokens from tokenizer_config.json and renders
// conversations with the variables transformers passes (messages, tools, documents,
// add_generation_prompt and the special-token strings).
#include "text/chat_template.h"

#include <filesystem>

#include <nlohmann/json.hpp>

#include "text/jinja.h"
#include "io/regular_file.h"
#include "moe/errors.h"

namespace moe {

namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

// tokenizer_config.json embeds the template; a large one holds a few hundred kB of added-token
// descriptions. 64 MiB is far past any real one and bounds what a hostile file costs.
constexpr uint64_t kMaxConfigBytes = 64ull << 20;

std::string read_file(const std::string& path, const char* what) {
  try {
    return read_regular_file(path, kMaxConfigBytes);
  } catch (const Error& e) {
    MOE_THROW(kIo, "{}: {}", what, e.message());
  }
}

// A special token in tokenizer_config.json is a string, null, or an AddedToken object.
std::string token_string(const json& config, const char* key, const std::string& path) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return {};
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && it->at("content").is_string())
    return it->at("content").get<std::string>();
  MOE_THROW(kFormat, "{}: \"{}\" is neither a string nor a token object", path, key);
}

}  // namespace

ChatTemplate ChatTemplate::from_tokenizer_config(const std::string& path) {
  const std::string text = read_file(path, "tokenizer config");
  json config;
  try {
    config = json::parse(text);
  } catch (const json::exception& e) {
    std::string what = e.what();
    for (char& c : what)
      if (c == '\n' || c == '\r') c = ' ';
    MOE_THROW(kFormat, "{}: malformed JSON: {}", path, what);
  }
  MOE_CHECK(config.is_object(), kFormat, "{}: tokenizer config is not a JSON object", path);

  std::string source;
  auto it = config.find("chat_template");
  if (it != config.end() && it->is_string()) {
    source = it->get<std::string>();
  } else if (it != config.end() && it->is_array()) {
    // A list of named templates: use "default".
    for (const json& entry : *it)
      if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template"))
        source = entry.at("template").get<std::string>();
    MOE_CHECK(!source.empty(), kConfig, "{}: \"chat_template\" lists no template named 'default'",
              path);
  } else if (it != config.end() && !it->is_null()) {
    MOE_THROW(kFormat, "{}: \"chat_template\" is neither a string nor a list", path);
  } else {
    const auto jinja_path = std::filesystem::path(path).parent_path() / "chat_template.jinja";
    std::error_code ec;
    if (!std::filesystem::exists(jinja_path, ec))
      MOE_THROW(kConfig,
                "{} has no \"chat_template\" (and there is no chat_template.jinja beside it)",
                path);
    source = read_file(jinja_path.string(), "chat template");
  }
  ChatTemplate t = from_source(source, path, token_string(config, "bos_token", path),
                               token_string(config, "eos_token", path));
  t.pad_ = token_string(config, "pad_token", path);
  t.unk_ = token_string(config, "unk_token", path);
  return t;
}

ChatTemplate ChatTemplate::from_source(const std::string& source, const std::string& origin,
                                       const std::string& bos_token, const std::string& eos_token,
                                       const jinja::Limits& limits) {
  ChatTemplate t;
  t.template_ =
      std::make_shared<const jinja::Template>(jinja::Template::parse(source, origin, limits));
  t.limits_ = limits;
  t.source_ = source;
  t.origin_ = origin;
  t.bos_ = bos_token;
  t.eos_ = eos_token;
  return t;
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt) const {
  return render(messages, add_generation_prompt, std::nullopt);
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt,
                                 std::optional<bool> enable_thinking) const {
  ojson list = ojson::array();
  for (const ChatMessage& m : messages) list.push_back({{"role", m.role}, {"content", m.content}});
  ojson extra = ojson::object();
  if (enable_thinking) extra["enable_thinking"] = *enable_thinking;
  return render_json(list, add_generation_prompt, extra);
}

std::string ChatTemplate::render_json(const ojson& messages, bool add_generation_prompt,
                                      const ojson& extra) const {
  MOE_CHECK(messages.is_array(), kInvalidArgument, "chat messages must be a JSON array");
  // The variables of transformers' apply_chat_template: the special tokens that are set, then
  // messages, tools, documents and add_generation_prompt, then the caller's extras.
  ojson vars = ojson::object();
  if (!bos_.empty()) vars["bos_token"] = bos_;
  if (!eos_.empty()) vars["eos_token"] = eos_;
  if (!pad_.empty()) vars["pad_token"] = pad_;
  if (!unk_.empty()) vars["unk_token"] = unk_;
  vars["messages"] = messages;
  vars["tools"] = nullptr;
  vars["documents"] = nullptr;
  vars["add_generation_prompt"] = add_generation_prompt;
  if (extra.is_object())
    for (const auto& [k, v] : extra.items()) vars[k] = v;
  return template_->render(vars, limits_);
}

}  // namespace moe
