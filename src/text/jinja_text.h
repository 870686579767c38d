// Text helpers of the chat-template interpreter: Python indexes strings by code point, and these
// walk a UTF-8 string one character at a time (an invalid byte counts as one character, as
// everywhere in the interpreter) without building an index, plus a substring search that stays
// linear on any input. Internal.
#pragma once

#include <cstddef>
#include <string_view>

namespace moe::jinja::text {

// Bytes of the character that starts at s[i] (i < s.size()).
size_t char_len(std::string_view s, size_t i);

// Start of the character that ends at s[end] (0 < end <= s.size(), end a character boundary).
// Walking backwards this way meets the same boundaries as walking forwards.
size_t char_start_before(std::string_view s, size_t end);

// Number of characters in s.
size_t count_chars(std::string_view s);

// Byte offset of the character `index` characters after byte offset `from`, or s.size() when the
// string ends first.
size_t skip_chars(std::string_view s, size_t from, size_t index);

// Position of `needle` in `hay` at or after `from`, or npos. Linear time whatever the input (the
// two-way search of memmem), where std::string::find can take |hay| * |needle|.
size_t find(std::string_view hay, std::string_view needle, size_t from = 0);

}  // namespace moe::jinja::text
