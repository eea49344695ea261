#include "megaslide/model/clip_tokenizer.h"

#include <nlohmann/json.hpp>

#include <limits>
#include <sstream>

#include "megaslide/io/files.h"
#include "model/unicode.h"
#include "util/utf8.h"

namespace megaslide {

namespace {

constexpr const char* kStart = "<|startoftext|>";
constexpr const char* kEnd = "<|endoftext|>";
constexpr const char* kWordEnd = "</w>";

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw ClipTokenizerError("CLIP vocabulary '" + source + "': " + what);
}

std::string read_text(const std::string& path) {
  try {
    return io::read_file(path);
  } catch (const std::exception& e) {
    throw ClipTokenizerError(std::string("CLIP vocabulary: ") + e.what());
  }
}

std::string utf8_of(uint32_t c) {
  std::string out;
  utf8::append(out, c);
  return out;
}

// GPT-2's reversible map from bytes to printable characters: the printable Latin-1 bytes stand for
// themselves, the other 68 are moved to U+0100 onwards, in byte order.
const std::vector<std::string>& byte_symbols() {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> out(256);
    std::vector<bool> printable(256, false);
    for (int b = 33; b <= 126; ++b) printable[b] = true;
    for (int b = 161; b <= 172; ++b) printable[b] = true;
    for (int b = 174; b <= 255; ++b) printable[b] = true;
    int moved = 0;
    for (int b = 0; b < 256; ++b)
      out[static_cast<size_t>(b)] = utf8_of(static_cast<uint32_t>(printable[b] ? b : 256 + moved++));
    return out;
  }();
  return table;
}

// The 256 byte symbols in OpenAI's order: the printable bytes first, then the moved ones.
std::vector<std::string> byte_symbols_openai_order() {
  const auto& sym = byte_symbols();
  std::vector<std::string> out;
  auto printable = [](int b) { return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255); };
  for (int b = 0; b < 256; ++b)
    if (printable(b)) out.push_back(sym[static_cast<size_t>(b)]);
  for (int b = 0; b < 256; ++b)
    if (!printable(b)) out.push_back(sym[static_cast<size_t>(b)]);
  return out;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
    start = end + 1;
  }
  return lines;
}

std::pair<std::string, std::string> split_merge(const std::string& line, const std::string& source,
                                                size_t line_number) {
  const auto space = line.find(' ');
  if (space == std::string::npos || space == 0 || space + 1 >= line.size() ||
      line.find(' ', space + 1) != std::string::npos)
    fail(source, "line " + std::to_string(line_number) + ": expected a merge 'A B', got '" + line + "'");
  return {line.substr(0, space), line.substr(space + 1)};
}

}  // namespace

ClipTokenizer::ClipTokenizer(std::unordered_map<std::string, int64_t> vocab,
                             const std::vector<std::pair<std::string, std::string>>& merges, const std::string& source)
    : vocab_(std::move(vocab)) {
  if (!unicode::available()) throw ClipTokenizerError(unicode::UnicodeUnavailable("the CLIP tokenizer").what());
  int64_t max_id = -1;
  for (const auto& [token, id] : vocab_) {
    if (id < 0) fail(source, "token '" + token + "' has the negative id " + std::to_string(id));
    max_id = std::max(max_id, id);
  }
  tokens_.assign(static_cast<size_t>(max_id + 1), std::string());
  for (const auto& [token, id] : vocab_) tokens_[static_cast<size_t>(id)] = token;
  for (const char* special : {kStart, kEnd})
    if (!vocab_.count(special)) fail(source, std::string("no ") + special + " token");
  start_id_ = vocab_.at(kStart);
  end_id_ = vocab_.at(kEnd);
  for (const auto& sym : byte_symbols())
    if (!vocab_.count(sym) || !vocab_.count(sym + kWordEnd))
      fail(source, "the byte symbol '" + sym + "' (or with </w>) is missing");
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& [a, b] = merges[r];
    if (!vocab_.count(a + b))
      fail(source, "merge " + std::to_string(r) + " ('" + a + " " + b + "') makes '" + a + b +
                       "', which is not in the vocabulary");
    merge_rank_.emplace(a + " " + b, static_cast<int64_t>(r));  // the first of duplicate merges keeps its rank
  }
}

ClipTokenizer ClipTokenizer::from_files(const std::string& vocab_json, const std::string& merges_txt) {
  std::unordered_map<std::string, int64_t> vocab;
  try {
    const auto j = nlohmann::json::parse(read_text(vocab_json));
    if (!j.is_object()) fail(vocab_json, "expected a JSON object of token: id");
    for (const auto& [token, id] : j.items()) {
      if (!id.is_number_integer()) fail(vocab_json, "the id of '" + token + "' is not an integer");
      vocab.emplace(token, id.get<int64_t>());
    }
  } catch (const nlohmann::json::exception& e) {
    fail(vocab_json, std::string("not valid JSON: ") + e.what());
  }
  std::vector<std::pair<std::string, std::string>> merges;
  const auto lines = lines_of(read_text(merges_txt));
  for (size_t i = 0; i < lines.size(); ++i) {
    if (lines[i].empty() || (i == 0 && lines[i].rfind("#version", 0) == 0)) continue;
    merges.push_back(split_merge(lines[i], merges_txt, i + 1));
  }
  return ClipTokenizer(std::move(vocab), merges, vocab_json);
}

ClipTokenizer ClipTokenizer::from_openai_bpe(const std::string& bpe_txt) {
  // OpenAI's CLIP uses the first 49152 − 256 − 2 merges after the header line.
  constexpr size_t kMerges = 49152 - 256 - 2;
  const auto lines = lines_of(read_text(bpe_txt));
  if (lines.size() < kMerges + 1)
    fail(bpe_txt, "expected at least " + std::to_string(kMerges + 1) + " lines, got " + std::to_string(lines.size()));
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(kMerges);
  for (size_t i = 1; i <= kMerges; ++i) merges.push_back(split_merge(lines[i], bpe_txt, i + 1));
  std::unordered_map<std::string, int64_t> vocab;
  int64_t next = 0;
  auto add = [&](const std::string& token) { vocab.emplace(token, next++); };
  const auto bytes = byte_symbols_openai_order();
  for (const auto& s : bytes) add(s);
  for (const auto& s : bytes) add(s + kWordEnd);
  for (const auto& [a, b] : merges) add(a + b);
  add(kStart);
  add(kEnd);
  if (vocab.size() != static_cast<size_t>(next)) fail(bpe_txt, "repeated merges: the vocabulary would have gaps");
  return ClipTokenizer(std::move(vocab), merges, bpe_txt);
}

bool ClipTokenizer::folder_has_vocabulary(const std::string& dir) {
  return (io::path_exists(io::join_path(dir, "vocab.json")) && io::path_exists(io::join_path(dir, "merges.txt"))) ||
         (io::path_exists(io::join_path(dir, "tokenizer/vocab.json")) &&
          io::path_exists(io::join_path(dir, "tokenizer/merges.txt"))) ||
         io::path_exists(io::join_path(dir, "bpe_simple_vocab_16e6.txt"));
}

ClipTokenizer ClipTokenizer::find(const std::string& vocab, const std::string& weights) {
  if (!vocab.empty()) return io::is_directory(vocab) ? from_folder(vocab) : from_openai_bpe(vocab);
  for (const auto& dir : {weights, weights + "/../tokenizer"})
    if (!weights.empty() && folder_has_vocabulary(dir)) return from_folder(dir);
  if (!weights.empty() && !io::path_exists(weights))
    throw ClipTokenizerError("'" + weights + "' does not exist (CLIP's folder: its weights and vocabulary)");
  throw ClipTokenizerError("no CLIP vocabulary in '" + weights +
                           "' (vocab.json + merges.txt there, in tokenizer/ or in ../tokenizer/)");
}

ClipTokenizer ClipTokenizer::from_folder(const std::string& dir) {
  for (const char* sub : {"", "tokenizer"}) {
    const auto base = std::string(sub).empty() ? dir : io::join_path(dir, sub);
    const auto vocab = io::join_path(base, "vocab.json"), merges = io::join_path(base, "merges.txt");
    if (io::path_exists(vocab) && io::path_exists(merges)) return from_files(vocab, merges);
  }
  const auto openai = io::join_path(dir, "bpe_simple_vocab_16e6.txt");
  if (io::path_exists(openai)) return from_openai_bpe(openai);
  throw ClipTokenizerError(
      "folder '" + dir +
      "' holds no CLIP vocabulary: expected vocab.json and merges.txt (there or in tokenizer/), or "
      "bpe_simple_vocab_16e6.txt");
}

std::vector<int64_t> ClipTokenizer::bpe(const std::string& word) const {
  const auto& sym = byte_symbols();
  std::vector<std::string> parts;
  parts.reserve(word.size());
  for (unsigned char b : word) parts.push_back(sym[b]);
  if (parts.empty()) return {};
  parts.back() += kWordEnd;
  while (parts.size() > 1) {
    int64_t best_rank = std::numeric_limits<int64_t>::max();
    size_t best = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      auto it = merge_rank_.find(parts[i] + " " + parts[i + 1]);
      if (it != merge_rank_.end() && it->second < best_rank) best_rank = it->second, best = i;
    }
    if (best_rank == std::numeric_limits<int64_t>::max()) break;
    parts[best] += parts[best + 1];
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
  std::vector<int64_t> ids;
  ids.reserve(parts.size());
  for (const auto& p : parts) {
    auto it = vocab_.find(p);
    ids.push_back(it == vocab_.end() ? end_id_ : it->second);
  }
  return ids;
}

std::vector<int64_t> ClipTokenizer::encode_text(const std::string& text) const {
  std::vector<int64_t> ids;
  auto encode_segment = [&](const std::string& segment) {
    std::vector<std::string> words;
    try {
      words = unicode::clip_words(segment);
    } catch (const std::runtime_error& e) {
      throw ClipTokenizerError(e.what());
    }
    for (const auto& word : words) {
      auto w = bpe(word);
      ids.insert(ids.end(), w.begin(), w.end());
    }
  };
  // Step 1: the special tokens written in the text, found before anything else.
  size_t pos = 0;
  while (pos < text.size()) {
    size_t next = std::string::npos, length = 0;
    int64_t id = 0;
    for (const auto& [special, special_id] : {std::pair<std::string, int64_t>{kStart, start_id_}, {kEnd, end_id_}}) {
      const size_t at = text.find(special, pos);
      if (at < next) next = at, length = special.size(), id = special_id;
    }
    if (next == std::string::npos) {
      encode_segment(text.substr(pos));
      break;
    }
    encode_segment(text.substr(pos, next - pos));
    ids.push_back(id);
    pos = next + length;
  }
  return ids;
}

ClipTokens ClipTokenizer::encode(const std::vector<std::string>& prompts, int64_t max_length) const {
  TORCH_CHECK(max_length >= 2, "ClipTokenizer: max_length must be >= 2 (the start and end tokens), got ", max_length);
  const auto N = static_cast<int64_t>(prompts.size());
  auto ids = torch::full({N, max_length}, end_id_, torch::kLong);
  auto mask = torch::zeros({N, max_length}, torch::kLong);
  auto id = ids.accessor<int64_t, 2>();
  auto m = mask.accessor<int64_t, 2>();
  for (int64_t n = 0; n < N; ++n) {
    auto text = encode_text(prompts[static_cast<size_t>(n)]);
    const auto kept = std::min<int64_t>(static_cast<int64_t>(text.size()), max_length - 2);
    id[n][0] = start_id_;
    for (int64_t i = 0; i < kept; ++i) id[n][i + 1] = text[static_cast<size_t>(i)];
    id[n][kept + 1] = end_id_;
    for (int64_t i = 0; i < kept + 2; ++i) m[n][i] = 1;
  }
  return {ids, mask};
}

}  // namespace megaslide
