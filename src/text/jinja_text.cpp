// Character walking and substring search for the chat-template interpreter (see jinja_text.h).
#include "text/jinja_text.h"

#include <cstring>

#include "text/unicode_util.h"

namespace moe::jinja::text {

size_t char_len(std::string_view s, size_t i) {
  if (static_cast<unsigned char>(s[i]) < 0x80) return 1;
  const size_t n = unicode::utf8_valid_len(s, i);
  return n ? n : 1;
}

size_t char_start_before(std::string_view s, size_t end) {
  if (static_cast<unsigned char>(s[end - 1]) < 0x80) return end - 1;
  // A valid sequence ending at `end` is the character there: walking forwards, no character can
  // span the lead byte of a valid sequence, so the forward walk stops at that lead byte too.
  for (size_t len = 2; len <= 4 && len <= end; ++len)
    if (unicode::utf8_valid_len(s, end - len) == len) return end - len;
  return end - 1;
}

size_t count_chars(std::string_view s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size(); i += char_len(s, i)) ++n;
  return n;
}

size_t skip_chars(std::string_view s, size_t from, size_t index) {
  size_t i = from;
  for (size_t k = 0; k < index && i < s.size(); ++k) i += char_len(s, i);
  return i < s.size() ? i : s.size();
}

size_t find(std::string_view hay, std::string_view needle, size_t from) {
  if (from > hay.size()) return std::string_view::npos;
  if (needle.empty()) return from;
  const void* p = memmem(hay.data() + from, hay.size() - from, needle.data(), needle.size());
  return p ? static_cast<size_t>(static_cast<const char*>(p) - hay.data()) : std::string_view::npos;
}

}  // namespace moe::jinja::text
