// UTF-8 helpers shared by the text code and the config and path checks (internal: not installed).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace megaslide::utf8 {

// Appends code point `cp` in UTF-8 (1 to 4 bytes; surrogates are encoded as they are, as CESU-8 would).
inline void append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// The byte offset of the first byte of `text` that does not belong to well-formed UTF-8 (RFC 3629:
// no overlong forms, no surrogates, nothing above U+10FFFF), or npos when all of it does.
inline size_t first_invalid(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    uint32_t lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c == 0xE0) len = 3, lo = 0xA0;
    else if (c == 0xED) len = 3, hi = 0x9F;
    else if (c >= 0xE1 && c <= 0xEF) len = 3;
    else if (c == 0xF0) len = 4, lo = 0x90;
    else if (c == 0xF4) len = 4, hi = 0x8F;
    else if (c >= 0xF1 && c <= 0xF3) len = 4;
    else return i;
    if (i + len > n || s[i + 1] < lo || s[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k)
      if (s[i + k] < 0x80 || s[i + k] > 0xBF) return i;
    i += len;
  }
  return std::string_view::npos;
}

inline bool valid(std::string_view text) { return first_invalid(text) == std::string_view::npos; }

// `text` with every byte that is not part of well-formed UTF-8 written as \xNN: valid UTF-8 that names
// the original bytes (for messages and listings of names that are not UTF-8).
inline std::string escaped(std::string_view text) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  while (!text.empty()) {
    const size_t bad = first_invalid(text);
    if (bad == std::string_view::npos) {
      out.append(text);
      break;
    }
    out.append(text.substr(0, bad));
    const auto byte = static_cast<unsigned char>(text[bad]);
    out += "\\x";
    out += kHex[byte >> 4];
    out += kHex[byte & 15];
    text.remove_prefix(bad + 1);
  }
  return out;
}

}  // namespace megaslide::utf8
