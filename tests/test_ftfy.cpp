// ftfy_fix_text (model/ftfy.h) and Wan's prompt cleaning built on it, against Python on
// tests/fixtures/ftfy/fix_text.json (tools/make_fixtures.py ftfy: ftfy 6.3.1's fix_text and diffusers'
// WanPipeline prompt_clean of a few hundred strings — prompt-like sentences in many scripts as they are and
// as mojibake of ten codecs, doubled, lossy, with A0 lost to spaces, CESU-8 and C0 80, mixed with good text,
// HTML entities with and without '<', line breaks, terminal escapes, control characters, surrogates):
//   - ftfy_fix_text equals ftfy.fix_text on every string;
//   - wan_prompt_clean equals diffusers' prompt_clean on every string;
//   - ftfy_is_bad agrees with ftfy's badness heuristic on strings it is known to flag and to pass.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "megaslide/io/files.h"
#include "megaslide/model/ftfy.h"
#include "megaslide/model/umt5_tokenizer.h"

namespace {

const std::string kFixture = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/ftfy/fix_text.json";

// A fixture string: text, or {"utf8_hex": ...} for one holding a lone surrogate (its code points in UTF-8).
std::string fixture_string(const nlohmann::json& value) {
  if (value.is_string()) return value.get<std::string>();
  const std::string hex = value.at("utf8_hex").get<std::string>();
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

// Non-ASCII and control bytes as \xNN, so a failure shows exactly what differs.
std::string escaped(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7F) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", c);
      out += buf;
    }
  }
  return out;
}

struct Case {
  std::string input, fix_text, prompt_clean;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> all = [] {
    const auto doc = nlohmann::json::parse(megaslide::io::read_file(kFixture));
    std::vector<Case> out;
    for (const auto& c : doc.at("cases"))
      out.push_back(
          {fixture_string(c.at("in")), fixture_string(c.at("fix_text")), fixture_string(c.at("prompt_clean"))});
    return out;
  }();
  return all;
}

TEST(Ftfy, FixTextEqualsFtfyOnEveryFixtureString) {
  ASSERT_GE(cases().size(), 400u);
  size_t equal = 0, changed = 0;
  for (size_t i = 0; i < cases().size(); ++i) {
    const auto& c = cases()[i];
    const std::string got = megaslide::ftfy_fix_text(c.input);
    equal += got == c.fix_text;
    changed += c.fix_text != c.input;
    EXPECT_EQ(escaped(got), escaped(c.fix_text)) << "case " << i << ": " << escaped(c.input);
  }
  std::printf("ftfy_fix_text == ftfy.fix_text on %zu of %zu strings (%zu of which ftfy changes)\n", equal,
              cases().size(), changed);
  EXPECT_GE(changed, cases().size() / 2);  // the fixture exercises the repairs, not only text left alone
}

TEST(Ftfy, WanPromptCleanEqualsDiffusersPromptCleanOnEveryFixtureString) {
  size_t equal = 0;
  for (size_t i = 0; i < cases().size(); ++i) {
    const auto& c = cases()[i];
    const std::string got = megaslide::wan_prompt_clean(c.input);
    equal += got == c.prompt_clean;
    EXPECT_EQ(escaped(got), escaped(c.prompt_clean)) << "case " << i << ": " << escaped(c.input);
  }
  std::printf("wan_prompt_clean == diffusers prompt_clean on %zu of %zu strings\n", equal, cases().size());
}

TEST(Ftfy, IsBadFlagsMojibakeAndPassesGoodText) {
  using megaslide::ftfy_is_bad;
  EXPECT_TRUE(ftfy_is_bad("caf\xC3\x83\xC2\xA9"));                    // "cafÃ©"
  EXPECT_TRUE(ftfy_is_bad("\xC3\xA2\xE2\x82\xAC\xC5\x93quoted"));     // "â€œquoted"
  EXPECT_TRUE(ftfy_is_bad("x\xC2\x85y"));                             // a C1 control
  EXPECT_TRUE(ftfy_is_bad("\xC3\x83 la"));                            // "Ã " at the start
  EXPECT_FALSE(ftfy_is_bad("caf\xC3\xA9 cr\xC3\xA8me"));              // "café crème"
  EXPECT_FALSE(ftfy_is_bad("\xE4\xB8\x80\xE5\x8F\xAA\xE7\x8C\xAB"));  // "一只猫"
  EXPECT_FALSE(ftfy_is_bad("plain ASCII"));
  EXPECT_FALSE(ftfy_is_bad(""));
}

}  // namespace
