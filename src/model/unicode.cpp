#include "model/unicode.h"

#ifdef MEGASLIDE_WITH_ICU
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/ustring.h>
#include <unicode/utf16.h>
#endif

namespace megaslide::unicode {

UnicodeUnavailable::UnicodeUnavailable(const std::string& who)
    : std::runtime_error(who +
                         " needs ICU's Unicode tables, and this build has none (configured with MEGASLIDE_ICU=OFF, or "
                         "without libicu-dev: install it, as tools/bootstrap.sh does, and reconfigure)") {}

#ifdef MEGASLIDE_WITH_ICU

bool available() { return true; }

namespace {
const icu::Normalizer2* nfc_instance() {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = icu::Normalizer2::getNFCInstance(status);
  return U_FAILURE(status) ? nullptr : n;
}

bool is_letter(UChar32 c) { return (U_GET_GC_MASK(c) & U_GC_L_MASK) != 0; }
bool is_number(UChar32 c) { return (U_GET_GC_MASK(c) & U_GC_N_MASK) != 0; }
bool is_space(UChar32 c) { return u_isUWhiteSpace(c) != 0; }

// NFC, white-space runs to one space, per-character full lower-casing.
icu::UnicodeString clip_normalise(const std::string& text) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = nfc_instance();
  if (n == nullptr) throw std::runtime_error("ICU: no NFC normaliser");
  icu::UnicodeString normalized = n->normalize(icu::UnicodeString::fromUTF8(text), status);
  if (U_FAILURE(status)) throw std::runtime_error(std::string("ICU: NFC failed: ") + u_errorName(status));
  icu::UnicodeString out;
  bool in_space = false;
  for (int32_t i = 0; i < normalized.length();) {
    const UChar32 c = normalized.char32At(i);
    i += U16_LENGTH(c);
    if (is_space(c)) {
      if (!in_space) out.append(static_cast<UChar>(' '));
      in_space = true;
      continue;
    }
    in_space = false;
    // Full lower-case mapping of the character alone (no context: a final capital sigma becomes σ).
    UChar src[2], dst[8];
    int32_t len = 0;
    U16_APPEND_UNSAFE(src, len, c);
    status = U_ZERO_ERROR;
    const int32_t lowered = u_strToLower(dst, 8, src, len, "", &status);
    if (U_FAILURE(status)) out.append(c);
    else out.append(dst, lowered);
  }
  return out;
}
}  // namespace

std::string nfc(const std::string& utf8, const char*) {
  const icu::Normalizer2* n = nfc_instance();
  if (n == nullptr) return utf8;
  UErrorCode status = U_ZERO_ERROR;
  const icu::UnicodeString normalized = n->normalize(icu::UnicodeString::fromUTF8(utf8), status);
  if (U_FAILURE(status)) return utf8;
  std::string out;
  normalized.toUTF8String(out);
  return out;
}

std::u32string nfc(const std::u32string& text, const char*) {
  const icu::Normalizer2* n = nfc_instance();
  if (n == nullptr) return text;
  UErrorCode status = U_ZERO_ERROR;
  const icu::UnicodeString in =
      icu::UnicodeString::fromUTF32(reinterpret_cast<const UChar32*>(text.data()), static_cast<int32_t>(text.size()));
  const icu::UnicodeString normalized = n->normalize(in, status);
  if (U_FAILURE(status)) return text;
  std::u32string out(static_cast<size_t>(normalized.countChar32()), U'\0');
  normalized.toUTF32(reinterpret_cast<UChar32*>(out.data()), static_cast<int32_t>(out.size()), status);
  return U_FAILURE(status) ? text : out;
}

std::vector<std::string> clip_words(const std::string& segment) {
  static const std::vector<std::u16string> contractions = {u"'s", u"'t", u"'re", u"'ve", u"'m", u"'ll", u"'d"};
  const icu::UnicodeString text = clip_normalise(segment);
  std::vector<std::string> words;
  const int32_t n = text.length();
  int32_t i = 0;
  auto char_at = [&](int32_t k) { return text.char32At(k); };
  while (i < n) {
    const UChar32 c = char_at(i);
    if (c == '\'') {
      bool matched = false;
      for (const auto& k : contractions) {
        const auto len = static_cast<int32_t>(k.size());
        if (i + len <= n && text.compare(i, len, k.data(), 0, len) == 0) {
          std::string w;
          text.tempSubString(i, len).toUTF8String(w);
          words.push_back(std::move(w));
          i += len;
          matched = true;
          break;
        }
      }
      if (matched) continue;
    }
    int32_t j = i;
    if (is_letter(c)) {
      while (j < n && is_letter(char_at(j))) j += U16_LENGTH(char_at(j));
    } else if (is_number(c)) {
      j += U16_LENGTH(c);
    } else if (!is_space(c)) {
      while (j < n) {
        const UChar32 d = char_at(j);
        if (is_space(d) || is_letter(d) || is_number(d)) break;
        j += U16_LENGTH(d);
      }
    } else {
      i += U16_LENGTH(c);
      continue;
    }
    std::string w;
    text.tempSubString(i, j - i).toUTF8String(w);
    words.push_back(std::move(w));
    i = j;
  }
  return words;
}

#else  // built without ICU

bool available() { return false; }
std::string nfc(const std::string&, const char* who) { throw UnicodeUnavailable(who); }
std::u32string nfc(const std::u32string&, const char* who) { throw UnicodeUnavailable(who); }
std::vector<std::string> clip_words(const std::string&) { throw UnicodeUnavailable("the CLIP tokenizer"); }

#endif

}  // namespace megaslide::unicode
