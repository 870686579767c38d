#include "serve/batcher.h"

#include <algorithm>

#include "moe/errors.h"

namespace moe::serve {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kNone: break;
  }
  return "none";
}

void check_request(const std::vector<int32_t>& prompt, const RequestOptions& options, int64_t vocab,
                   int64_t max_context, int64_t pool_blocks, int64_t block_size, bool tokenizer) {
  const int64_t n = static_cast<int64_t>(prompt.size());
  MOE_CHECK(n > 0, kInvalidArgument, "empty prompt: at least one token is needed");
  for (int32_t id : prompt)
    MOE_CHECK(id >= 0 && id < vocab, kInvalidArgument, "prompt token id {} is outside the vocabulary [0, {})",
              id, vocab);
  MOE_CHECK(options.max_tokens >= 1, kInvalidArgument, "max_tokens must be at least 1, got {}",
            options.max_tokens);
  MOE_CHECK(options.max_tokens <= max_context - n, kInvalidArgument,  // no overflow
            "a prompt of {} tokens plus max_tokens {} exceeds the context of {} tokens", n,
            options.max_tokens, max_context);
  // The last generated token is never run through the model, so it needs no cache row.
  const int64_t blocks = (n + options.max_tokens - 1 + block_size - 1) / block_size;
  MOE_CHECK(blocks <= pool_blocks, kInvalidArgument,
            "a prompt of {} tokens plus max_tokens {} needs {} KV blocks, the pool has {}", n,
            options.max_tokens, blocks, pool_blocks);
  validate_sampling(options.sampling);
  for (int32_t id : options.stop_ids)
    MOE_CHECK(id >= 0 && id < vocab, kInvalidArgument, "stop token id {} is outside the vocabulary [0, {})",
              id, vocab);
  MOE_CHECK(options.stop_strings.empty() || tokenizer, kInvalidArgument,
            "stop strings need a tokenizer");
  for (const std::string& s : options.stop_strings)
    MOE_CHECK(!s.empty(), kInvalidArgument, "a stop string must not be empty");
}

namespace {

// The length of the longest tail of `text` that is the beginning of some stop string (and not a
// whole one): that much must wait for the next tokens before it can be sent.
size_t held_back(const std::string& text, const std::vector<std::string>& stops) {
  size_t keep = 0;
  for (const std::string& s : stops)
    for (size_t k = std::min(text.size(), s.size() - 1); k > keep; --k)
      if (text.compare(text.size() - k, k, s, 0, k) == 0) {
        keep = k;
        break;
      }
  return keep;
}

}  // namespace

OutputFilter::OutputFilter(const RequestOptions& options, const Tokenizer* tokenizer)
    : stop_ids_(options.stop_ids), stop_strings_(options.stop_strings), max_tokens_(options.max_tokens) {
  if (tokenizer) decoder_.emplace(*tokenizer, /*skip_special=*/false);
}

void OutputFilter::push(int32_t token, int64_t generated, Event& event) {
  event.token = token;
  const bool stop_id = std::find(stop_ids_.begin(), stop_ids_.end(), token) != stop_ids_.end();
  bool final = stop_id || generated >= max_tokens_;
  event.finish = stop_id ? FinishReason::kStop : final ? FinishReason::kLength : FinishReason::kNone;
  if (!decoder_) return;
  if (!stop_id) held_ += decoder_->push(token);
  if (final) held_ += decoder_->flush();
  size_t cut = std::string::npos;
  for (const std::string& s : stop_strings_) cut = std::min(cut, held_.find(s));
  if (cut != std::string::npos) {
    held_.resize(cut);
    final = true;
    event.finish = FinishReason::kStop;
  }
  const size_t send = final ? held_.size() : held_.size() - held_back(held_, stop_strings_);
  event.text = held_.substr(0, send);
  held_.erase(0, send);
}

}  // namespace moe::serve
