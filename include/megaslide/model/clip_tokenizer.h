// CLIP's byte-level BPE tokenizer, giving the ids transformers' CLIPTokenizer gives when called as
// Stable Diffusion calls it: tokenizer(prompts, padding="max_length", max_length=77, truncation=True).
//
//   1. <|startoftext|> and <|endoftext|> written in the text are those special tokens.
//   2. Normalise: Unicode NFC, every run of white space becomes one space, lower-case (each character
//      on its own, Unicode's full mapping).
//   3. Words: CLIP's pattern, leftmost first — 's 't 're 've 'm 'll 'd, a run of letters (\p{L}), one
//      digit (\p{N}), a run of anything else that is not white space; white space separates.
//   4. Each word's UTF-8 bytes become GPT-2's printable byte alphabet; "</w>" marks the word's last
//      symbol; BPE merges adjacent symbols, lowest merge rank first, until none applies; the symbols'
//      ids come from the vocabulary (a symbol not in it: <|endoftext|>, CLIPTokenizer's unknown token).
//   5. <|startoftext|> ids <|endoftext|>, cut to max_length (the end token kept), padded with
//      <|endoftext|> to max_length; the mask is 1 from the start token to the end token.
//
// Vocabularies: transformers' files (vocab.json: token -> id; merges.txt: "#version" line, then one
// merge "a b" a line, by rank), as in the published folders (openai/clip-vit-large-patch14, or a Stable
// Diffusion checkpoint's tokenizer/); or OpenAI's bpe_simple_vocab_16e6.txt (the merges alone, from which
// the vocabulary is built as OpenAI's CLIP builds it: the 256 byte symbols, the same with "</w>", each
// merge's result, then <|startoftext|>, <|endoftext|>: 49408 ids). tools/bootstrap.sh fetches the latter
// from the `open-clip-torch` wheel into .deps/clip/ (docs/conditioning.md).
//
// Unicode properties, NFC and case mapping come from ICU. Errors (missing or malformed files) throw
// ClipTokenizerError naming the file. Thread-safety: immutable after construction; encode is const.
#pragma once

#include <torch/types.h>

#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "megaslide/util/errors.h"

namespace megaslide {

class ClipTokenizerError : public std::runtime_error, public InputError {
 public:
  using std::runtime_error::runtime_error;
};

struct ClipTokens {
  torch::Tensor ids;   // [N, max_length] int64
  torch::Tensor mask;  // [N, max_length] int64, 1 for the start token, the text and the end token
};

class ClipTokenizer {
 public:
  static ClipTokenizer from_files(const std::string& vocab_json, const std::string& merges_txt);
  static ClipTokenizer from_openai_bpe(const std::string& bpe_txt);
  // DIR/vocab.json + DIR/merges.txt, or DIR/tokenizer/{vocab.json, merges.txt} (a Stable Diffusion
  // checkpoint's layout), or DIR/bpe_simple_vocab_16e6.txt; the first found.
  static ClipTokenizer from_folder(const std::string& dir);
  // True when from_folder(dir) finds a vocabulary there.
  static bool folder_has_vocabulary(const std::string& dir);
  // The vocabulary of a CLIP text encoder: `vocab` when given (a folder, or OpenAI's
  // bpe_simple_vocab_16e6.txt), else the one in `weights` (the encoder's folder) or in
  // `weights`/../tokenizer (a Stable Diffusion checkpoint's text_encoder/ beside its tokenizer/).
  // Throws ClipTokenizerError naming where it looked.
  static ClipTokenizer find(const std::string& vocab, const std::string& weights);

  // The ids of the text alone (steps 1–4), no start/end tokens, not cut.
  std::vector<int64_t> encode_text(const std::string& text) const;
  // Steps 1–5 for each prompt.
  ClipTokens encode(const std::vector<std::string>& prompts, int64_t max_length = 77) const;

  int64_t vocab_size() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t start_id() const { return start_id_; }
  int64_t end_id() const { return end_id_; }
  const std::string& token(int64_t id) const { return tokens_.at(static_cast<size_t>(id)); }

 private:
  ClipTokenizer(std::unordered_map<std::string, int64_t> vocab,
                const std::vector<std::pair<std::string, std::string>>& merges, const std::string& source);
  std::vector<int64_t> bpe(const std::string& word) const;  // a word's UTF-8 bytes -> ids

  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> tokens_;                      // id -> token
  std::unordered_map<std::string, int64_t> merge_rank_;  // "a b" -> rank
  int64_t start_id_ = 0, end_id_ = 0;
};

}  // namespace megaslide
