// CaptionTokenizer and TextEncoder: words map to fixed ids, <bos> first, padding masked, unknown words
// become <unk>, and the encoder gives one embedding per token.
#include "megaslide/model/text_encoder.h"

#include <gtest/gtest.h>

#include <algorithm>

using namespace megaslide;

TEST(CaptionTokenizer, EncodesWordsCaseInsensitively) {
  CaptionTokenizer tok;
  auto ids = tok.encode("A red blob moves LEFT, quickly!", 9);
  ASSERT_EQ(ids.size(), 9u);
  EXPECT_EQ(ids[0], CaptionTokenizer::kBos);
  std::vector<std::string> words;
  for (size_t i = 1; i < 7; ++i) words.push_back(tok.words()[static_cast<size_t>(ids[i])]);
  EXPECT_EQ(words, (std::vector<std::string>{"a", "red", "blob", "moves", "left", "quickly"}));
  EXPECT_EQ(ids[7], CaptionTokenizer::kPad);
  EXPECT_EQ(tok.encode("a zebra", 4)[2], CaptionTokenizer::kUnknown);
  EXPECT_EQ(tok.encode("a red blob moves left", 3).size(), 3u);  // cut
}

// unknown_words names exactly the words encode maps to <unk> (split and lower-cased as it does, repeats kept), counts
// the words, and with max_words looks only at the words encode keeps.
TEST(CaptionTokenizer, UnknownWordsAreTheOnesEncodedAsUnk) {
  CaptionTokenizer tok;
  const std::string caption = "A Zebra, a red blob and a zebra-Quagga!";
  int64_t count = 0;
  const auto unknown = tok.unknown_words(caption, &count);
  EXPECT_EQ(unknown, (std::vector<std::string>{"zebra", "zebra", "quagga"}));
  EXPECT_EQ(count, 9);
  const auto ids = tok.encode(caption, 10);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), CaptionTokenizer::kUnknown), 3);
  EXPECT_EQ(tok.unknown_words(caption, &count, 3), (std::vector<std::string>{"zebra"}));
  EXPECT_EQ(count, 3);
  EXPECT_TRUE(tok.unknown_words("a red blob moves left").empty());
}

TEST(CaptionTokenizer, EmptyCaptionKeepsOneRealToken) {
  CaptionTokenizer tok;
  auto batch = tok.encode_batch({"", "red stripes"}, 5);
  EXPECT_EQ(batch.mask.sum(1)[0].item<int64_t>(), 1);  // <bos> only: cross-attention has a key
  EXPECT_EQ(batch.mask.sum(1)[1].item<int64_t>(), 3);
}

TEST(TextEncoder, GivesOneEmbeddingPerToken) {
  CaptionTokenizer tok;
  TextEncoder enc(TextEncoderOptions(tok.vocab_size(), 24, 8));
  auto batch = tok.encode_batch({"a blue blob moves up", "the scene darkens"}, 8);
  auto y = enc(batch.ids);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 8, 24}));
  EXPECT_THROW(enc(torch::zeros({1, 9}, torch::kLong)), c10::Error);
}
