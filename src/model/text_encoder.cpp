#include "megaslide/model/text_encoder.h"

#include <cctype>

namespace megaslide {

CaptionTokenizer::CaptionTokenizer() {
  // Special tokens first (their ids are the constants above), then every word the structured-motion
  // captions use, then a few common words so that hand-written prompts degrade gracefully.
  words_ = {"<pad>",     "<bos>",      "<unk>",     "a",       "an",         "the",     "and",      "from",   "to",
            "of",        "in",         "on",        "red",     "green",      "blue",    "white",    "bright", "dark",
            "blob",      "ball",       "dot",       "stripes", "pattern",    "scene",   "gradient", "moves",  "moving",
            "oscillate", "oscillates", "brightens", "darkens", "fades",      "left",    "right",    "up",     "down",
            "top",       "bottom",     "slowly",    "quickly", "horizontal", "vertical"};
  for (size_t i = 0; i < words_.size(); ++i) ids_.emplace(words_[i], static_cast<int64_t>(i));
}

template <typename F>
void CaptionTokenizer::for_each_word(const std::string& caption, F&& word_found) {
  std::string word;
  for (unsigned char c : caption) {
    if (std::isalnum(c)) {
      word.push_back(static_cast<char>(std::tolower(c)));
    } else if (!word.empty()) {
      word_found(word);
      word.clear();
    }
  }
  if (!word.empty()) word_found(word);
}

std::vector<int64_t> CaptionTokenizer::encode(const std::string& caption, int64_t max_tokens) const {
  TORCH_CHECK(max_tokens >= 1, "CaptionTokenizer: max_tokens must be >= 1, got ", max_tokens);
  std::vector<int64_t> ids{kBos};
  for_each_word(caption, [&](const std::string& word) {
    auto it = ids_.find(word);
    ids.push_back(it == ids_.end() ? kUnknown : it->second);
  });
  ids.resize(static_cast<size_t>(max_tokens), kPad);
  return ids;
}

std::vector<std::string> CaptionTokenizer::unknown_words(const std::string& caption, int64_t* word_count,
                                                         int64_t max_words) const {
  std::vector<std::string> out;
  int64_t n = 0;
  for_each_word(caption, [&](const std::string& word) {
    if (max_words >= 0 && n >= max_words) return;
    ++n;
    if (!ids_.count(word)) out.push_back(word);
  });
  if (word_count) *word_count = n;
  return out;
}

TokenizedCaptions CaptionTokenizer::encode_batch(const std::vector<std::string>& captions, int64_t max_tokens) const {
  const auto B = static_cast<int64_t>(captions.size());
  auto ids = torch::empty({B, max_tokens}, torch::kLong);
  auto acc = ids.accessor<int64_t, 2>();
  for (int64_t b = 0; b < B; ++b) {
    auto row = encode(captions[static_cast<size_t>(b)], max_tokens);
    for (int64_t i = 0; i < max_tokens; ++i) acc[b][i] = row[static_cast<size_t>(i)];
  }
  return {ids, ids.ne(kPad)};
}

TextEncoderImpl::TextEncoderImpl(TextEncoderOptions options_) : options(std::move(options_)) { reset(); }

void TextEncoderImpl::reset() {
  const auto dev = options.device();
  tokens = register_module("tokens", Embedding(EmbeddingOptions(options.vocab_size(), options.dim()).device(dev)));
  positions =
      register_module("positions", Embedding(EmbeddingOptions(options.max_tokens(), options.dim()).device(dev)));
  norm = register_module("norm", LayerNorm(LayerNormOptions(options.dim()).device(dev)));
}

torch::Tensor TextEncoderImpl::forward(const torch::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) <= options.max_tokens(),
              "TextEncoder: expected ids [B, L] with L <= ", options.max_tokens(), ", got ", ids.sizes());
  auto pos = torch::arange(ids.size(1), ids.options());
  return norm(tokens(ids) + positions(pos).unsqueeze(0));
}

}  // namespace megaslide
