// umT5's SentencePiece tokenizer, giving the ids transformers' tokenizer for umT5 (T5Tokenizer) gives when
// called as Wan calls it: tokenizer(prompts, padding="max_length", max_length=512, truncation=True).
//
//   1. "<pad>", "</s>" and "<unk>" written in the text are those special tokens (ids 0, 1, 2); the text
//      between them is tokenized on its own.
//   2. Each piece of text: the SentencePiece model's own normalisation (umT5's: NFKC-based "nmt_nfkc",
//      white-space runs to one space, leading and trailing white space dropped, "▁" prefixed), then the
//      unigram model's best segmentation; characters outside the vocabulary become <unk> (2), a run of
//      them one <unk>. Where several segmentations score the same, the one transformers (the tokenizers
//      library) picks: SentencePiece's runs of ordinary pieces are segmented again word by word by the
//      search tokenizers runs (at each end, the earliest start unless a later one scores strictly more).
//   3. ids + </s> (1), cut to max_length with </s> kept last, padded with <pad> (0); mask 1 up to and
//      including </s>.
// The SentencePiece model (spiece.model) is read with the SentencePiece C++ library (Debian's
// libsentencepiece-dev); it must have <pad>, </s> and <unk> at ids 0, 1 and 2, as umT5's has. umT5's
// model has 256 000 pieces (the encoder's embedding has 256 384 rows: the rest are never produced).
//
// wan_prompt_clean() is Wan's prompt cleaning (diffusers' WanPipeline prompt_clean, Wan's own): ftfy.fix_text
// (the whole of ftfy 6.3.1's, ftfy_fix_text() in model/ftfy.h: mojibake repair, its own HTML unescaping of
// lines without '<', ligatures, fullwidth/halfwidth forms — Wan's Chinese negative prompt has fullwidth
// commas —, curly quotes, line breaks, control characters, NFC), HTML unescaping twice, then white-space runs
// to one space, trimmed. wan_clean() is the white-space part alone.
//
// Built without SentencePiece (umt5_tokenizer_supported() false), every constructor throws. Errors:
// Umt5TokenizerError naming the file. Thread-safety: immutable after construction; encode is const.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "megaslide/util/errors.h"

namespace megaslide {

class Umt5TokenizerError : public std::runtime_error, public InputError {
 public:
  using std::runtime_error::runtime_error;
};

struct Umt5Tokens {
  at::Tensor ids;   // [N, max_length] int64
  at::Tensor mask;  // [N, max_length] int64, 1 for the text and </s>
};

bool umt5_tokenizer_supported();

class Umt5Tokenizer {
 public:
  static constexpr int64_t kPad = 0, kEos = 1, kUnk = 2;

  static Umt5Tokenizer from_file(const std::string& spiece_model);
  // A serialized model held in memory (ComfyUI's files carry it as a U8 tensor "spiece_model");
  // `source` names it in errors.
  static Umt5Tokenizer from_bytes(const std::string& serialized, const std::string& source);
  // Where the model's weights are: a folder's spiece.model, tokenizer/spiece.model or, for a
  // checkpoint's text_encoder/, ../tokenizer/spiece.model; for a diffusers repository root,
  // tokenizer/spiece.model; for a .safetensors file, its "spiece_model" tensor, else spiece.model beside
  // it. The first found.
  static Umt5Tokenizer find(const std::string& path);

  Umt5Tokenizer(Umt5Tokenizer&&) noexcept;
  Umt5Tokenizer& operator=(Umt5Tokenizer&&) noexcept;
  ~Umt5Tokenizer();

  // The ids of the text alone (steps 1–2), no </s>, not cut.
  std::vector<int64_t> encode_text(const std::string& text) const;
  // Steps 1–3 for each prompt.
  Umt5Tokens encode(const std::vector<std::string>& prompts, int64_t max_length = 512) const;

  int64_t vocab_size() const;
  std::string piece(int64_t id) const;
  // The piece's unigram log-probability (the model's score).
  double score(int64_t id) const;
  const std::string& source() const { return source_; }

  struct Impl;  // the SentencePiece processor (opaque: its header stays out of this one)

 private:
  Umt5Tokenizer(std::unique_ptr<Impl> impl, std::string source);
  std::unique_ptr<Impl> impl_;
  std::string source_;
};

// Runs of white space (ASCII and Unicode) become one space; leading and trailing white space is dropped.
std::string wan_clean(const std::string& prompt);
// Python's html.unescape: HTML5's named references (with and without ';', the longest known prefix of an
// unknown name), decimal and hexadecimal references (code 0, surrogates and values above U+10FFFF become
// U+FFFD, 0x80–0x9F Windows-1252's characters, the other control and non-characters are dropped).
std::string html_unescape(const std::string& text);
// Only ftfy.fix_text's character-wise steps (fix_latin_ligatures, fix_character_width, uncurl_quotes,
// remove_control_chars, as ftfy 6.3's tables give them), then NFC; ftfy_fix_text() is the whole.
std::string ftfy_character_fixes(const std::string& text);
// wan_clean(html_unescape(html_unescape(ftfy_fix_text(prompt)))): diffusers' prompt_clean.
std::string wan_prompt_clean(const std::string& prompt);

}  // namespace megaslide
