// UTF-8 and Unicode helpers for the tokenizer: code point decoding, lossy UTF-8 repair that matches
// Rust's String::from_utf8_lossy (what Hugging Face tokenizers uses to decode), NFC normalization
// and the GPT-2 byte-level alphabet.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moe::unicode {

// Length of the valid UTF-8 sequence starting at s[i], or 0 if the bytes there are not a complete,
// valid sequence (bad lead byte, bad continuation, overlong form, surrogate, beyond U+10FFFF or
// truncated by the end of s).
size_t utf8_valid_len(std::string_view s, size_t i);

// Decodes the code point at s[i] when utf8_valid_len(s, i) == n > 0.
char32_t utf8_decode(std::string_view s, size_t i, size_t n);

// Appends the UTF-8 encoding of cp.
void utf8_append(std::string& out, char32_t cp);

bool is_valid_utf8(std::string_view s);

// Replaces every maximal invalid subsequence with U+FFFD, as Rust's String::from_utf8_lossy and
// Python's bytes.decode('utf-8', 'replace') do.
std::string utf8_lossy(std::string_view s);

// Number of trailing bytes of s that form an incomplete but so far valid UTF-8 sequence (0 to 3):
// the bytes a streaming decoder holds back until more input arrives.
size_t utf8_incomplete_tail(std::string_view s);

// Unicode White_Space (what Rust's char::is_whitespace and Oniguruma's \s match).
bool is_white_space(char32_t cp);

// Canonical combining class (0 for starters), from the generated table.
uint8_t combining_class(char32_t cp);

// Normalization Form C. Invalid UTF-8 bytes are kept as they are and act as starters. Text that
// cannot change under NFC (the common case) is returned without allocation-heavy work.
std::string nfc(std::string_view s);

// NFC never makes text more than this many times shorter in bytes. Each output character stands
// for the code points of its full canonical decomposition (at most 4), each of which the input may
// have written as the longest code point that decomposes to it alone. The worst case, 3.5x in
// Unicode 14, is U+1FBE U+0308 U+0301 (7 bytes) composing to U+0390 (2 bytes). Invalid bytes are
// kept as they are.
constexpr size_t kNfcMaxShrink = 4;

// The GPT-2 byte-level alphabet: byte b is written as the code point byte_to_char()[b], so that
// every byte becomes a printable, non-space character.
const std::array<char32_t, 256>& byte_to_char();

}  // namespace moe::unicode
