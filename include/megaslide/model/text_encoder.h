// A small built-in text encoder for the structured-motion captions: a word tokenizer over a fixed
// vocabulary and a learned embedding (token + position, then LayerNorm) trained with the DiT.
// Real text encoders (CLIP, T5) plug in later behind the same [B, L, text_dim] output.
//
// Thread-safety: CaptionTokenizer is immutable after construction (safe to share); TextEncoder is a
// torch::nn::Module.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <string>
#include <unordered_map>
#include <vector>

#include "megaslide/model/layers.h"

namespace megaslide {

struct TokenizedCaptions {
  torch::Tensor ids;   // [B, L] int64; ids[:, 0] is <bos>, then words, then <pad>
  torch::Tensor mask;  // [B, L] bool, true for <bos> and words
};

class CaptionTokenizer {
 public:
  static constexpr int64_t kPad = 0, kBos = 1, kUnknown = 2;

  CaptionTokenizer();
  int64_t vocab_size() const { return static_cast<int64_t>(words_.size()); }
  // Lower-cases, splits on anything that is not a letter or digit, maps words to ids (unknown words to
  // <unk>), prepends <bos> and pads or cuts to max_tokens. The empty caption is just <bos>.
  std::vector<int64_t> encode(const std::string& caption, int64_t max_tokens) const;
  TokenizedCaptions encode_batch(const std::vector<std::string>& captions, int64_t max_tokens) const;
  const std::vector<std::string>& words() const { return words_; }
  // The words of `caption` (split as encode splits them) that map to <unk>, in order, repeats included; and how
  // many words it has. max_words >= 0: only its first max_words words (what encode keeps: max_tokens - 1).
  std::vector<std::string> unknown_words(const std::string& caption, int64_t* word_count = nullptr,
                                         int64_t max_words = -1) const;

 private:
  // Calls word(w) for each lower-cased run of letters and digits of `caption`, in order.
  template <typename F>
  static void for_each_word(const std::string& caption, F&& word);
  std::vector<std::string> words_;
  std::unordered_map<std::string, int64_t> ids_;
};

struct TextEncoderOptions {
  TextEncoderOptions(int64_t vocab_size, int64_t dim, int64_t max_tokens)
      : vocab_size_(vocab_size), dim_(dim), max_tokens_(max_tokens) {}
  TORCH_ARG(int64_t, vocab_size);
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(int64_t, max_tokens);
  TORCH_ARG(torch::Device, device) = torch::kCPU;
};

class TextEncoderImpl : public torch::nn::Cloneable<TextEncoderImpl> {
 public:
  explicit TextEncoderImpl(TextEncoderOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& ids);  // [B, L] -> [B, L, dim]

  TextEncoderOptions options;
  Embedding tokens{nullptr}, positions{nullptr};
  LayerNorm norm{nullptr};
};
TORCH_MODULE(TextEncoder);

}  // namespace megaslide
