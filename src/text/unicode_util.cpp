// UTF-8 helpers and NFC normalization for the tokenizer.
//
// NFC: Qwen3's tokenizer.json normalizes with NFC. ICU would do it, but the tools are carried to
// GPU hosts without ICU and a static ICU drags in its ~30 MB data library, so instead
// scripts/gen_nfc_table.py writes the few Unicode tables NFC needs (combining classes, canonical
// decompositions, primary composites; ~25 KB of text) from Python's unicodedata into
// src/text/nfc_table.inc, and this file implements the UAX #15 algorithm over them: full canonical
// decomposition, canonical ordering, canonical composition (Hangul arithmetically). A quick check
// skips all of that for text in which no code point can change (nearly all text).
#include "text/unicode_util.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace moe::unicode {

namespace {

#include "text/nfc_table.inc"

constexpr char32_t kHangulS = 0xAC00, kHangulL = 0x1100, kHangulV = 0x1161, kHangulT = 0x11A7;
constexpr char32_t kHangulLCount = 19, kHangulVCount = 21, kHangulTCount = 28;
constexpr char32_t kHangulNCount = kHangulVCount * kHangulTCount;
constexpr char32_t kHangulSCount = kHangulLCount * kHangulNCount;

// Invalid UTF-8 bytes travel through normalization as these values (beyond Unicode): starters that
// compose with nothing.
constexpr char32_t kRawByteBase = 0x110000;

struct CccRange {
  char32_t first, last;
  uint8_t ccc;
};

struct NfcTables {
  std::vector<CccRange> ccc;
  std::unordered_map<char32_t, std::pair<char32_t, char32_t>> decomp;  // second == 0: singleton
  std::unordered_map<uint64_t, char32_t> compose;                      // (first << 21 | second)
  std::unordered_set<char32_t> unstable;  // code points whose presence may change the text
  char32_t min_unstable = 0x10FFFF;

  static uint64_t key(char32_t a, char32_t b) { return (uint64_t(a) << 21) | b; }

  // Parses one generated table: entries of comma-separated hex fields, first field delta-coded.
  template <size_t N, typename F>
  static void parse(const char* text, F&& on_entry) {
    const char* p = text;
    uint32_t prev = 0;
    while (*p) {
      while (*p == ' ') ++p;
      if (!*p) break;
      uint32_t f[N] = {};
      for (size_t k = 0; k < N; ++k) {
        uint32_t v = 0;
        while (true) {
          char c = *p;
          if (c >= '0' && c <= '9')
            v = v * 16 + uint32_t(c - '0');
          else if (c >= 'a' && c <= 'f')
            v = v * 16 + uint32_t(c - 'a' + 10);
          else
            break;
          ++p;
        }
        f[k] = v;
        if (*p == ',') ++p;
      }
      f[0] += prev;
      prev = f[0];
      on_entry(f);
    }
  }

  NfcTables() {
    parse<3>(kNfcCcc, [&](const uint32_t* f) {
      ccc.push_back({char32_t(f[0]), char32_t(f[0] + f[1]), uint8_t(f[2])});
    });
    parse<3>(kNfcCompose, [&](const uint32_t* f) {
      decomp.emplace(f[0], std::make_pair(char32_t(f[1]), char32_t(f[2])));
      compose.emplace(key(f[1], f[2]), char32_t(f[0]));
      unstable.insert(f[2]);  // may combine with what precedes it
    });
    parse<3>(kNfcDecompose, [&](const uint32_t* f) {
      decomp.emplace(f[0], std::make_pair(char32_t(f[1]), char32_t(f[2])));
      unstable.insert(f[0]);  // never appears in NFC text
    });
    for (const auto& r : ccc)
      for (char32_t c = r.first; c <= r.last; ++c) unstable.insert(c);
    for (char32_t c = kHangulV; c < kHangulV + kHangulVCount; ++c) unstable.insert(c);
    for (char32_t c = kHangulT + 1; c < kHangulT + kHangulTCount; ++c) unstable.insert(c);
    for (char32_t c : unstable) min_unstable = std::min(min_unstable, c);
  }

  uint8_t class_of(char32_t cp) const {
    auto it = std::upper_bound(ccc.begin(), ccc.end(), cp,
                               [](char32_t c, const CccRange& r) { return c < r.first; });
    if (it == ccc.begin()) return 0;
    --it;
    return cp <= it->last ? it->ccc : 0;
  }

  void decompose(char32_t cp, std::vector<char32_t>& out) const {
    if (cp >= kHangulS && cp < kHangulS + kHangulSCount) {
      char32_t s = cp - kHangulS;
      out.push_back(kHangulL + s / kHangulNCount);
      out.push_back(kHangulV + (s % kHangulNCount) / kHangulTCount);
      if (s % kHangulTCount) out.push_back(kHangulT + s % kHangulTCount);
      return;
    }
    auto it = decomp.find(cp);
    if (it == decomp.end()) {
      out.push_back(cp);
      return;
    }
    decompose(it->second.first, out);
    if (it->second.second) decompose(it->second.second, out);
  }

  // The primary composite of a + b, or 0.
  char32_t compose_pair(char32_t a, char32_t b) const {
    if (a >= kHangulL && a < kHangulL + kHangulLCount && b >= kHangulV &&
        b < kHangulV + kHangulVCount)
      return kHangulS + ((a - kHangulL) * kHangulVCount + (b - kHangulV)) * kHangulTCount;
    if (a >= kHangulS && a < kHangulS + kHangulSCount && (a - kHangulS) % kHangulTCount == 0 &&
        b > kHangulT && b < kHangulT + kHangulTCount)
      return a + (b - kHangulT);
    auto it = compose.find(key(a, b));
    return it == compose.end() ? 0 : it->second;
  }
};

const NfcTables& nfc_tables() {
  static const NfcTables tables;
  return tables;
}

// A lead byte's sequence length and the range its second byte must fall in: narrower than
// 0x80-0xBF after E0, ED, F0 and F4, which rules out overlong forms, surrogates and code points
// past U+10FFFF. len 0: the byte starts no multi-byte sequence.
struct Utf8Lead {
  size_t len = 0;
  unsigned char lo = 0x80, hi = 0xBF;
};

Utf8Lead utf8_lead(unsigned char b0) {
  Utf8Lead lead;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    lead.len = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    lead.len = 3;
    if (b0 == 0xE0) lead.lo = 0xA0;
    if (b0 == 0xED) lead.hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    lead.len = 4;
    if (b0 == 0xF0) lead.lo = 0x90;
    if (b0 == 0xF4) lead.hi = 0x8F;
  }
  return lead;
}

// How many bytes from s[i], the lead byte included, follow `lead`'s rules: up to lead.len, less
// where a byte is out of range or s ends first.
size_t utf8_lead_prefix(std::string_view s, size_t i, const Utf8Lead& lead) {
  size_t k = 1;
  for (; k < lead.len && i + k < s.size(); ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    const unsigned char l = k == 1 ? lead.lo : 0x80, h = k == 1 ? lead.hi : 0xBF;
    if (b < l || b > h) break;
  }
  return k;
}

}  // namespace

size_t utf8_valid_len(std::string_view s, size_t i) {
  if (i >= s.size()) return 0;
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return 1;
  const Utf8Lead lead = utf8_lead(b0);
  if (lead.len == 0) return 0;
  return utf8_lead_prefix(s, i, lead) == lead.len ? lead.len : 0;
}

char32_t utf8_decode(std::string_view s, size_t i, size_t n) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (n == 1) return b0;
  char32_t cp = b0 & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool is_valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    size_t n = utf8_valid_len(s, i);
    if (!n) return false;
    i += n;
  }
  return true;
}

namespace {

// Length of the longest prefix of s[i..] that could begin a valid sequence (1 for a byte that
// cannot start or continue anything). Used for the "maximal subpart" replacement rule.
size_t utf8_maximal_subpart(std::string_view s, size_t i) {
  const Utf8Lead lead = utf8_lead(static_cast<unsigned char>(s[i]));
  return lead.len == 0 ? 1 : utf8_lead_prefix(s, i, lead);
}

}  // namespace

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t n = utf8_valid_len(s, i);
    if (n) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out.append("\xEF\xBF\xBD");
      i += utf8_maximal_subpart(s, i);
    }
  }
  return out;
}

size_t utf8_incomplete_tail(std::string_view s) {
  // A held-back tail is at most 3 bytes: a lead byte and fewer continuation bytes than it needs.
  for (size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    const size_t i = s.size() - back;
    const auto b = static_cast<unsigned char>(s[i]);
    if (b >= 0x80 && b <= 0xBF) continue;  // continuation byte: look further back
    if (b < 0xC2 || b > 0xF4) return 0;    // ASCII or a byte that starts nothing
    // s[i] is a lead byte; the tail is incomplete iff it is a valid prefix shorter than needed.
    const size_t need = b <= 0xDF ? 2 : b <= 0xEF ? 3 : 4;
    return (back < need && utf8_maximal_subpart(s, i) == back) ? back : 0;
  }
  return 0;
}

bool is_white_space(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

uint8_t combining_class(char32_t cp) { return nfc_tables().class_of(cp); }

std::string nfc(std::string_view s) {
  const NfcTables& t = nfc_tables();
  // Quick check: unchanged unless some code point may decompose, reorder or combine.
  bool stable = true;
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) {
      ++i;
      continue;
    }
    size_t n = utf8_valid_len(s, i);
    if (!n) {
      ++i;
      continue;
    }
    char32_t cp = utf8_decode(s, i, n);
    i += n;
    if (cp >= t.min_unstable && t.unstable.count(cp)) {
      stable = false;
      break;
    }
  }
  if (stable) return std::string(s);

  // Full canonical decomposition.
  std::vector<char32_t> cps;
  cps.reserve(s.size() + 8);
  for (size_t i = 0; i < s.size();) {
    size_t n = utf8_valid_len(s, i);
    if (!n) {
      cps.push_back(kRawByteBase + static_cast<unsigned char>(s[i]));
      ++i;
      continue;
    }
    t.decompose(utf8_decode(s, i, n), cps);
    i += n;
  }
  auto cls = [&](char32_t c) -> unsigned { return c >= kRawByteBase ? 0 : t.class_of(c); };
  // Canonical ordering: stable sort of every run of non-starters by combining class.
  for (size_t i = 0; i < cps.size();) {
    if (cls(cps[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && cls(cps[j]) != 0) ++j;
    if (j - i > 1)
      std::stable_sort(cps.begin() + i, cps.begin() + j,
                       [&](char32_t a, char32_t b) { return cls(a) < cls(b); });
    i = j;
  }
  // Canonical composition.
  if (!cps.empty()) {
    size_t starter = 0, out = 1;
    unsigned last_class = cls(cps[0]) ? 256 : 0;  // a leading non-starter blocks composition
    for (size_t i = 1; i < cps.size(); ++i) {
      const char32_t c = cps[i];
      const unsigned c_class = cls(c);
      char32_t composite = 0;
      if ((last_class < c_class || last_class == 0) && cps[starter] < kRawByteBase &&
          c < kRawByteBase)
        composite = t.compose_pair(cps[starter], c);
      if (composite) {
        cps[starter] = composite;
        continue;
      }
      if (c_class == 0) starter = out;
      last_class = c_class;
      cps[out++] = c;
    }
    cps.resize(out);
  }
  std::string result;
  result.reserve(s.size());
  for (char32_t c : cps) {
    if (c >= kRawByteBase)
      result.push_back(static_cast<char>(c - kRawByteBase));
    else
      utf8_append(result, c);
  }
  return result;
}

const std::array<char32_t, 256>& byte_to_char() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      t[b] = printable ? char32_t(b) : next++;
    }
    return t;
  }();
  return table;
}

}  // namespace moe::unicode
