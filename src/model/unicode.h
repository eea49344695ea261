// The Unicode data the text code needs (NFC, general categories, case mapping), from ICU. This file's
// unicode.cpp is the one place that includes ICU: a build without it (MEGASLIDE_ICU=OFF, or AUTO where
// libicu-dev is missing, such as the lent GPU machine) compiles everything else and refuses at run time
// what needs these tables — the CLIP tokenizer, ftfy's fix_text and the umT5 prompt cleaning — with
// UnicodeUnavailable. Internal to libmegaslide. Thread-safety: pure functions.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace megaslide::unicode {

class UnicodeUnavailable : public std::runtime_error {
 public:
  explicit UnicodeUnavailable(const std::string& who);
};

// True when this library was built with ICU.
bool available();

// NFC of UTF-8 or UTF-32 text (unchanged if ICU cannot normalise it). Throws UnicodeUnavailable
// naming `who` without ICU.
std::string nfc(const std::string& utf8, const char* who);
std::u32string nfc(const std::u32string& text, const char* who);

// CLIP's pre-tokenisation of one segment (openai/CLIP simple_tokenizer): NFC, runs of white space to one
// space, each character's full lower-case mapping alone, then the word pattern
// 's|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+, leftmost first. UTF-8 words.
std::vector<std::string> clip_words(const std::string& segment);

}  // namespace megaslide::unicode
