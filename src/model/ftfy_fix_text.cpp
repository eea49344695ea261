#include "megaslide/model/ftfy.h"

#include <algorithm>
#include <bitset>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <string_view>
#include <utility>
#include <vector>

#include "megaslide/model/umt5_tokenizer.h"  // html_unescape (Python's html.unescape)
#include "model/unicode.h"
#include "util/utf8.h"

namespace megaslide {

namespace {

struct CodeRange {
  uint32_t first, last;
};
struct SetSpan {
  uint16_t begin, count;
};
struct BadnessStep {
  enum Kind : uint8_t { kOne, kOptional, kStart } kind;
  uint8_t set;
};
struct CharacterFix {
  uint32_t code_point;
  const char* replacement;
};
struct Entity {
  const char* name;
  const char* text;
};

#include "ftfy_tables.inc"

constexpr Entity kHtmlEntities[] = {
#include "ftfy_html_entities.inc"
};

using Text = std::u32string;  // code points, as a Python str holds them (surrogates included)
using Bytes = std::string;

constexpr char32_t kReplacement = 0xFFFD;
constexpr size_t kMaxSegment = 1000000;  // TextFixerConfig.max_decode_length

uint8_t byte_at(const Bytes& b, size_t i) { return static_cast<uint8_t>(b[i]); }

// ---- UTF-8 ----------------------------------------------------------------------------------------

// Lenient: a byte that does not start a complete sequence is read on its own, as its value.
Text decode_lenient(const std::string& s) {
  Text out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const uint8_t b = byte_at(s, i);
    size_t extra = b >= 0xF8 ? 0 : b >= 0xF0 ? 3 : b >= 0xE0 ? 2 : b >= 0xC0 ? 1 : 0;
    if (i + extra >= s.size()) extra = 0;
    char32_t cp = extra == 0 ? b : (b & (0x3Fu >> extra));
    bool ok = true;
    for (size_t k = 1; k <= extra && ok; ++k) {
      const uint8_t c = byte_at(s, i + k);
      ok = (c & 0xC0) == 0x80;
      cp = (cp << 6) | (c & 0x3Fu);
    }
    if (!ok) {
      out += b;
      ++i;
      continue;
    }
    out += cp;
    i += extra + 1;
  }
  return out;
}

std::string encode_utf8(const Text& text) {
  std::string out;
  out.reserve(text.size());
  for (char32_t c : text) utf8::append(out, static_cast<uint32_t>(c));
  return out;
}

bool is_continuation(uint8_t b) { return (b & 0xC0) == 0x80; }

// Python's strict UTF-8 decoder: shortest forms only, no surrogates, nothing above U+10FFFF.
bool decode_utf8_strict(const Bytes& b, size_t begin, size_t end, Text& out) {
  for (size_t i = begin; i < end;) {
    const uint8_t c = byte_at(b, i);
    if (c < 0x80) {
      out += c;
      ++i;
      continue;
    }
    size_t extra;
    uint8_t lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
    char32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
      extra = 1, cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      extra = 2, cp = c & 0x0F;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      extra = 3, cp = c & 0x07;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (i + extra >= end) return false;  // truncated
    for (size_t k = 1; k <= extra; ++k) {
      const uint8_t d = byte_at(b, i + k);
      if (k == 1 ? (d < lo || d > hi) : !is_continuation(d)) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    out += cp;
    i += extra + 1;
  }
  return true;
}

// ftfy's "utf-8-variants" codec: UTF-8 that may also hold CESU-8 surrogate pairs (six bytes ED Ax xx ED Bx xx)
// and Java's C0 80 for U+0000. Its regular expressions' '$' (end, or before a final '\n') is kept.
bool decode_utf8_variants(const Bytes& b, Text& out) {
  const size_t n = b.size();
  const auto dollar = [&](size_t p) { return p == n || (p + 1 == n && b[p] == '\n'); };
  const auto in = [&](size_t p, uint8_t lo, uint8_t hi) { return p < n && byte_at(b, p) >= lo && byte_at(b, p) <= hi; };
  // One step of a pattern: a byte in [lo, hi] or the end; returns false when neither.
  const auto step = [&](size_t& p, uint8_t lo, uint8_t hi) {
    if (in(p, lo, hi)) {
      ++p;
      return true;
    }
    return dollar(p);
  };
  const auto cesu_at = [&](size_t p) {
    if (!in(p, 0xED, 0xED)) return false;
    ++p;
    return step(p, 0xA0, 0xAF) && step(p, 0x80, 0xBF) && step(p, 0xED, 0xED) && step(p, 0xB0, 0xBF) &&
           step(p, 0x80, 0xBF);
  };
  const auto special_at = [&](size_t p) {
    if (in(p, 0xC0, 0xC0)) return in(p + 1, 0x80, 0x80) || dollar(p + 1);
    if (cesu_at(p)) return true;
    if (!in(p, 0xED, 0xED)) return false;
    size_t q = p + 1;
    return step(q, 0xA0, 0xBF) && step(q, 0x80, 0xBF);
  };
  size_t pos = 0;
  while (pos < n) {
    size_t cut = pos;
    while (cut < n && !special_at(cut)) ++cut;
    if (cut > pos) {
      if (!decode_utf8_strict(b, pos, cut, out)) return false;
      pos = cut;
      continue;
    }
    if (byte_at(b, pos) == 0xC0) {
      if (n - pos < 2) return false;
      out += char32_t{0};
      pos += 2;
      continue;
    }
    if (n - pos < 6 || !cesu_at(pos)) return false;  // a lone surrogate: Python's decoder refuses it
    out += static_cast<char32_t>(((byte_at(b, pos + 1) & 0x0F) << 16) + ((byte_at(b, pos + 2) & 0x3F) << 10) +
                                 ((byte_at(b, pos + 4) & 0x0F) << 6) + (byte_at(b, pos + 5) & 0x3F) + 0x10000);
    pos += 6;
  }
  return true;
}

// ---- character classes ----------------------------------------------------------------------------

bool in_ranges(const CodeRange* first, const CodeRange* last, char32_t c) {
  const CodeRange* it = std::upper_bound(first, last, c, [](char32_t v, const CodeRange& r) { return v < r.first; });
  return it != first && c <= (it - 1)->last;
}

bool in_set(int set, char32_t c) {
  return in_ranges(kSetRanges + kSets[set].begin, kSetRanges + kSets[set].begin + kSets[set].count, c);
}

// Which of the classes a code point is in.
using SetMask = std::bitset<std::size(kSets)>;
SetMask set_mask(char32_t c) {
  SetMask mask;
  for (size_t set = 0; set < std::size(kSets); ++set) mask[set] = in_set(static_cast<int>(set), c);
  return mask;
}
// Below U+2600 (Latin, Greek, Cyrillic, the punctuation, symbols and box drawing mojibake is made of) from
// a table built once; above, looked up.
SetMask cached_set_mask(char32_t c) {
  constexpr char32_t kCached = 0x2600;
  static const std::vector<SetMask> table = [] {
    std::vector<SetMask> t(kCached);
    for (char32_t x = 0; x < kCached; ++x) t[x] = set_mask(x);
    return t;
  }();
  return c < kCached ? table[c] : set_mask(c);
}

bool is_bad(const char32_t* text, size_t n) {
  std::vector<SetMask> masks(n);
  for (size_t i = 0; i < n; ++i) masks[i] = cached_set_mask(text[i]);
  // Do steps[k..count) match at text[i]? (Only the optional '\s?' needs a second try.)
  const auto match = [&](auto&& self, const BadnessStep* steps, size_t count, size_t k, size_t i) -> bool {
    if (k == count) return true;
    const BadnessStep s = steps[k];
    if (s.kind == BadnessStep::kStart) return i == 0 && self(self, steps, count, k + 1, i);
    const bool hit = i < n && masks[i][s.set];
    if (s.kind == BadnessStep::kOptional)
      return (hit && self(self, steps, count, k + 1, i + 1)) || self(self, steps, count, k + 1, i);
    return hit && self(self, steps, count, k + 1, i + 1);
  };
  for (size_t i = 0; i < n; ++i)
    for (const SetSpan& branch : kBadnessBranches)
      if (match(match, kBadnessSteps + branch.begin, branch.count, 0, i)) return true;
  return false;
}

bool is_bad(const Text& text) { return is_bad(text.data(), text.size()); }

// chardata.UTF8_DETECTOR_RE: runs of what look like UTF-8 sequences decoded in a single-byte codec, not
// preceded by a strict continuation character; [begin, end) of each match, left to right.
std::vector<std::pair<size_t, size_t>> utf8_detector_matches(const Text& text) {
  const size_t n = text.size();
  const auto at = [&](size_t i, int set) { return i < n && in_set(set, text[i]); };
  std::vector<std::pair<size_t, size_t>> spans;
  for (size_t i = 0; i < n;) {
    if (i > 0 && in_set(kUtf8ContinuationStrict, text[i - 1])) {
      ++i;
      continue;
    }
    size_t j = i;
    for (;;) {
      if (at(j, kUtf8FirstOf2) && at(j + 1, kUtf8Continuation)) j += 2;
      else if (at(j, kUtf8FirstOf3) && at(j + 1, kUtf8Continuation) && at(j + 2, kUtf8Continuation)) j += 3;
      else if (at(j, kUtf8FirstOf4) && at(j + 1, kUtf8Continuation) && at(j + 2, kUtf8Continuation) &&
               at(j + 3, kUtf8Continuation))
        j += 4;
      else break;
    }
    if (j > i) {
      spans.emplace_back(i, j);
      i = j;
    } else {
      ++i;
    }
  }
  return spans;
}

// ---- single-byte codecs ---------------------------------------------------------------------------

bool is_sloppy(int encoding) { return std::string_view(kCharmapNames[encoding]).substr(0, 7) == "sloppy-"; }
bool is_macroman(int encoding) { return std::string_view(kCharmapNames[encoding]) == "macroman"; }

// The text in `encoding`'s bytes; false when a character is not in it (ftfy's possible_encoding false).
bool encode_charmap(const Text& text, int encoding, Bytes& out) {
  // code point -> byte, for each codec, sorted by code point.
  static const auto inverse = [] {
    std::vector<std::vector<std::pair<char32_t, uint8_t>>> tables(kCharmapCount);
    for (int e = 0; e < kCharmapCount; ++e) {
      for (int b = 0; b < 256; ++b) tables[e].emplace_back(kCharmaps[e][b], static_cast<uint8_t>(b));
      std::sort(tables[e].begin(), tables[e].end());
    }
    return tables;
  }();
  const auto& table = inverse[encoding];
  out.clear();
  out.reserve(text.size());
  for (char32_t c : text) {
    const auto it = std::lower_bound(table.begin(), table.end(), std::pair<char32_t, uint8_t>{c, 0});
    if (it == table.end() || it->first != c) return false;
    out += static_cast<char>(it->second);
  }
  return true;
}

// ---- byte patterns (fixes.restore_byte_a0, fixes.replace_lossy_sequences) ----------------------------

using ByteClass = std::bitset<256>;
ByteClass byte_class(std::initializer_list<std::pair<int, int>> ranges) {
  ByteClass c;
  for (auto [lo, hi] : ranges)
    for (int b = lo; b <= hi; ++b) c.set(b);
  return c;
}
using BytePattern = std::vector<ByteClass>;

// The length of the first of `alternatives` that matches at b[i], else 0.
size_t match_alternatives(const std::vector<BytePattern>& alternatives, const Bytes& b, size_t i) {
  for (const auto& pattern : alternatives) {
    if (i + pattern.size() > b.size()) continue;
    bool ok = true;
    for (size_t k = 0; k < pattern.size() && ok; ++k) ok = pattern[k].test(byte_at(b, i + k));
    if (ok) return pattern.size();
  }
  return 0;
}

// chardata.ALTERED_UTF8_RE: UTF-8 sequences that decode once a space is read as byte A0.
const std::vector<BytePattern>& altered_utf8() {
  static const std::vector<BytePattern> patterns = [] {
    const ByteClass space = byte_class({{0x20, 0x20}}), cont = byte_class({{0x80, 0xBF}}),
                    f0 = byte_class({{0xF0, 0xF0}});
    const ByteClass likely = byte_class({{0x80, 0x84}, {0x86, 0x9F}, {0xA1, 0xBF}});
    return std::vector<BytePattern>{
        {byte_class({{0xC2, 0xC3}, {0xC5, 0xC5}, {0xCE, 0xCE}, {0xD0, 0xD0}, {0xD9, 0xD9}}), space},
        {byte_class({{0xE2, 0xE3}}), space, likely},
        {byte_class({{0xE0, 0xE3}}), likely, space},
        {f0, space, cont, cont},
        {f0, cont, space, cont},
        {f0, cont, cont, space},
    };
  }();
  return patterns;
}

// chardata.LOSSY_UTF8_RE: UTF-8 sequences with bytes lost to 1A (a '�' the sloppy codecs encoded) or '?'.
const std::vector<BytePattern>& lossy_utf8() {
  static const std::vector<BytePattern> patterns = [] {
    const ByteClass sub = byte_class({{0x1A, 0x1A}}), lost = byte_class({{0x1A, 0x1A}, {'?', '?'}});
    const ByteClass sub_or_cont = byte_class({{0x1A, 0x1A}, {0x80, 0xBF}});
    const ByteClass any_cont = byte_class({{0x1A, 0x1A}, {'?', '?'}, {0x80, 0xBF}});
    const ByteClass ed = byte_class({{0xED, 0xED}}), high = byte_class({{0xA0, 0xAF}}),
                    low = byte_class({{0xB0, 0xBF}});
    const ByteClass lead3 = byte_class({{0xE0, 0xEF}}), lead4 = byte_class({{0xF0, 0xF4}});
    return std::vector<BytePattern>{
        {byte_class({{0xC2, 0xDF}}), sub},
        {byte_class({{0xC2, 0xC3}}), byte_class({{'?', '?'}})},
        {ed, high, lost, ed, low, any_cont},
        {ed, high, any_cont, ed, low, lost},
        {lead3, lost, sub_or_cont},
        {lead3, sub_or_cont, lost},
        {lead4, lost, sub_or_cont, sub_or_cont},
        {lead4, sub_or_cont, lost, sub_or_cont},
        {lead4, sub_or_cont, sub_or_cont, lost},
        {sub},
    };
  }();
  return patterns;
}

bool altered_utf8_found(const Bytes& b) {
  for (size_t i = 0; i < b.size(); ++i)
    if (match_alternatives(altered_utf8(), b, i) > 0) return true;
  return false;
}

// fixes.restore_byte_a0.
Bytes restore_byte_a0(const Bytes& in) {
  // First "Ã " as a word of its own (but not the Portuguese "às", "àquele"...) keeps its space: C3 A0 20.
  Bytes b;
  b.reserve(in.size() + 8);
  const auto followed_by = [&](size_t j, std::string_view s) {
    return in.compare(j, s.size(), s) == 0 && j + s.size() <= in.size();
  };
  for (size_t i = 0; i < in.size(); ++i) {
    if (byte_at(in, i) == 0xC3 && i + 1 < in.size() && in[i + 1] == ' ' &&
        !(followed_by(i + 2, " ") || followed_by(i + 2, "quele") || followed_by(i + 2, "quela") ||
          followed_by(i + 2, "quilo") || followed_by(i + 2, "s "))) {
      b += "\xC3\xA0 ";
      ++i;
      continue;
    }
    b += in[i];
  }
  Bytes out;
  out.reserve(b.size());
  for (size_t i = 0; i < b.size();) {
    const size_t len = match_alternatives(altered_utf8(), b, i);
    if (len == 0) {
      out += b[i++];
      continue;
    }
    for (size_t k = 0; k < len; ++k) out += b[i + k] == ' ' ? '\xA0' : b[i + k];
    i += len;
  }
  return out;
}

// fixes.replace_lossy_sequences.
Bytes replace_lossy_sequences(const Bytes& b) {
  Bytes out;
  out.reserve(b.size());
  for (size_t i = 0; i < b.size();) {
    const size_t len = match_alternatives(lossy_utf8(), b, i);
    if (len == 0) {
      out += b[i++];
      continue;
    }
    out += "\xEF\xBF\xBD";
    i += len;
  }
  return out;
}

// ---- fix_encoding -----------------------------------------------------------------------------------

bool is_c1(char32_t c) { return c >= 0x80 && c <= 0x9F; }

// fixes.fix_c1_controls: C1 controls as sloppy windows-1252's characters (what browsers do).
Text fix_c1_controls(Text text) {
  constexpr int kSloppy1252 = 1;
  static_assert(std::string_view(kCharmapNames[kSloppy1252]) == "sloppy-windows-1252");
  for (char32_t& c : text)
    if (is_c1(c)) c = kCharmaps[kSloppy1252][c];
  return text;
}

Text fix_encoding(Text text);

// fixes.decode_inconsistent_utf8: each UTF-8-looking run that is itself bad (and shorter than the text) fixed
// on its own.
Text decode_inconsistent_utf8(const Text& text, const std::vector<std::pair<size_t, size_t>>& spans) {
  Text out;
  size_t done = 0;
  for (auto [begin, end] : spans) {
    out.append(text, done, begin - done);
    const Text run = text.substr(begin, end - begin);
    out += run.size() < text.size() && is_bad(run) ? fix_encoding(run) : run;
    done = end;
  }
  out.append(text, done, Text::npos);
  return out;
}

// ftfy's _fix_encoding_one_step_and_explain, without the explanation.
Text fix_encoding_one_step(const Text& text) {
  if (text.empty()) return text;
  if (std::all_of(text.begin(), text.end(), [](char32_t c) { return c < 0x80; }) || !is_bad(text)) return text;
  bool latin1_possible = false;
  Bytes bytes;
  for (int encoding = 0; encoding < kCharmapCount; ++encoding) {
    if (!encode_charmap(text, encoding, bytes)) continue;
    if (encoding == 0) latin1_possible = true;
    if (!is_macroman(encoding) && altered_utf8_found(bytes)) bytes = restore_byte_a0(bytes);
    if (is_sloppy(encoding)) bytes = replace_lossy_sequences(bytes);
    Text fixed;
    const bool variants = bytes.find('\xED') != Bytes::npos || bytes.find('\xC0') != Bytes::npos;
    if (variants ? decode_utf8_variants(bytes, fixed) : decode_utf8_strict(bytes, 0, bytes.size(), fixed)) return fixed;
  }
  const auto spans = utf8_detector_matches(text);
  if (!spans.empty()) {
    Text fixed = decode_inconsistent_utf8(text, spans);
    if (fixed != text) return fixed;
  }
  if (latin1_possible) {
    // Latin-1 read as strict windows-1252 (ftfy's check for "already windows-1252" names a codec it never
    // tries, so this always runs).
    static_assert(std::string_view(kCharmapNames[0]) == "latin-1");
    Text fixed;
    bool ok = true;
    for (char32_t c : text) {
      const uint32_t mapped = kCharmaps[kWindows1252][c];
      if (mapped == 0xFFFFFFFFu) {
        ok = false;
        break;
      }
      fixed += static_cast<char32_t>(mapped);
    }
    if (ok && fixed != text) return fixed;
  }
  if (std::any_of(text.begin(), text.end(), is_c1)) return fix_c1_controls(text);
  return text;
}

Text fix_encoding(Text text) {
  for (;;) {
    Text fixed = fix_encoding_one_step(text);
    if (fixed == text) return text;
    text = std::move(fixed);
  }
}

// ---- the other fixers ---------------------------------------------------------------------------------

bool is_ascii_alnum(char32_t c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool is_ascii_letter(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

// fixes.unescape_html: "&#?[0-9A-Za-z]{1,24};" replaced by ftfy's entity table, or by html.unescape for
// numeric references it decodes whole.
Text unescape_html(const Text& text) {
  Text out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    if (text[i] != U'&') {
      out += text[i++];
      continue;
    }
    size_t j = i + 1;
    if (j < text.size() && text[j] == U'#') ++j;
    size_t k = j;
    while (k < text.size() && is_ascii_alnum(text[k])) ++k;
    if (k == j || k - j > 24 || k >= text.size() || text[k] != U';') {
      out += text[i++];
      continue;
    }
    const std::string reference = encode_utf8(text.substr(i, k + 1 - i));
    const auto* end = std::end(kHtmlEntities);
    const auto* it =
        std::lower_bound(std::begin(kHtmlEntities), end, reference,
                         [](const Entity& e, const std::string& name) { return std::string_view(e.name) < name; });
    if (it != end && reference == it->name) {
      out += decode_lenient(it->text);
    } else if (j > i + 1) {
      const std::string unescaped = html_unescape(reference);
      out += unescaped.find(';') == std::string::npos ? decode_lenient(unescaped) : text.substr(i, k + 1 - i);
    } else {
      out.append(text, i, k + 1 - i);
    }
    i = k + 1;
  }
  return out;
}

// fix_latin_ligatures, fix_character_width and uncurl_quotes (one table), then fix_line_breaks.
Text fix_characters_and_line_breaks(const Text& text) {
  Text mapped;
  mapped.reserve(text.size());
  for (char32_t c : text) {
    const auto* end = std::end(kCharacterFixes);
    const auto* it = std::lower_bound(std::begin(kCharacterFixes), end, c,
                                      [](const CharacterFix& f, char32_t v) { return f.code_point < v; });
    if (it != end && it->code_point == c) mapped += decode_lenient(it->replacement);
    else mapped += c;
  }
  Text out;
  out.reserve(mapped.size());
  for (size_t i = 0; i < mapped.size(); ++i) {
    const char32_t c = mapped[i];
    if (c == U'\r') {
      out += U'\n';
      if (i + 1 < mapped.size() && mapped[i + 1] == U'\n') ++i;
    } else if (c == 0x2028 || c == 0x2029 || c == 0x85) {
      out += U'\n';
    } else {
      out += c;
    }
  }
  return out;
}

bool is_surrogate(char32_t c) { return c >= 0xD800 && c <= 0xDFFF; }

// fixes.fix_surrogates: pairs joined, the rest U+FFFD.
Text fix_surrogates(const Text& text) {
  if (std::none_of(text.begin(), text.end(), is_surrogate)) return text;
  Text out;
  for (size_t i = 0; i < text.size(); ++i) {
    const char32_t c = text[i];
    if (c >= 0xD800 && c <= 0xDBFF && i + 1 < text.size() && text[i + 1] >= 0xDC00 && text[i + 1] <= 0xDFFF) {
      out += 0x10000 + (c - 0xD800) * 0x400 + (text[i + 1] - 0xDC00);
      ++i;
    } else {
      out += is_surrogate(c) ? kReplacement : c;
    }
  }
  return out;
}

// fixes.remove_terminal_escapes: ESC '[' (digits or ';')* letter.
Text remove_terminal_escapes(const Text& text) {
  Text out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    if (text[i] == 0x1B && i + 1 < text.size() && text[i + 1] == U'[') {
      size_t k = i + 2;
      while (k < text.size() && (text[k] == U';' || in_set(kPythonDigit, text[k]))) ++k;
      if (k < text.size() && is_ascii_letter(text[k])) {
        i = k + 1;
        continue;
      }
    }
    out += text[i++];
  }
  return out;
}

// fixes.remove_control_chars.
Text remove_control_chars(const Text& text) {
  Text out;
  out.reserve(text.size());
  for (char32_t c : text)
    if (!in_ranges(std::begin(kControlChars), std::end(kControlChars), c)) out += c;
  return out;
}

Text nfc(const Text& text) { return unicode::nfc(text, "ftfy_fix_text (NFC)"); }

// ftfy's fix_and_explain on one segment, without the explanation.
Text fix_segment(Text text, bool unescape) {
  for (;;) {
    const Text original = text;
    if (unescape) text = unescape_html(text);
    text = fix_encoding(std::move(text));
    if (std::any_of(text.begin(), text.end(), is_c1)) text = fix_c1_controls(std::move(text));
    text = fix_characters_and_line_breaks(text);
    text = fix_surrogates(text);
    text = remove_terminal_escapes(text);
    text = remove_control_chars(text);
    text = nfc(text);
    if (text == original) return text;
  }
}

}  // namespace

std::string ftfy_fix_text(const std::string& utf8) {
  const Text text = decode_lenient(utf8);
  Text out;
  bool unescape = true;
  for (size_t pos = 0; pos < text.size();) {
    const size_t newline = text.find(U'\n', pos);
    size_t end = newline == Text::npos ? text.size() : newline + 1;
    end = std::min(end, pos + kMaxSegment);
    const Text segment = text.substr(pos, end - pos);
    if (segment.find(U'<') != Text::npos) unescape = false;  // HTML: its entities stay, here and after
    out += fix_segment(segment, unescape);
    pos = end;
  }
  return encode_utf8(out);
}

bool ftfy_is_bad(const std::string& text) { return is_bad(decode_lenient(text)); }

}  // namespace megaslide
