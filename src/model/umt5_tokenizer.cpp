#include "megaslide/model/umt5_tokenizer.h"

#include <algorithm>
#include <array>
#include <iterator>
#include <stdexcept>
#include <string_view>
#include <unordered_map>

#include "io/pretrained.h"
#include "model/unicode.h"
#include "util/utf8.h"
#include "megaslide/io/files.h"
#include "megaslide/model/ftfy.h"

#ifdef MEGASLIDE_WITH_SENTENCEPIECE
#include <dlfcn.h>

#include <memory>

#include "model/sentencepiece_module.h"
#endif

namespace megaslide {

namespace {

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw Umt5TokenizerError("umT5 tokenizer '" + source + "': " + what);
}

// The special tokens transformers matches in the text before tokenizing, with their ids.
constexpr std::array<std::pair<const char*, int64_t>, 3> kSpecial{
    {{"<pad>", Umt5Tokenizer::kPad}, {"</s>", Umt5Tokenizer::kEos}, {"<unk>", Umt5Tokenizer::kUnk}}};

// Decodes one UTF-8 code point at s[i] and advances i past it; a byte that does not start a complete
// sequence is taken on its own.
uint32_t next_code_point(const std::string& s, size_t& i) {
  const auto b = static_cast<unsigned char>(s[i]);
  size_t extra = b >= 0xF8 ? 0 : b >= 0xF0 ? 3 : b >= 0xE0 ? 2 : b >= 0xC0 ? 1 : 0;
  if (i + extra >= s.size()) extra = 0;
  uint32_t cp = extra == 0 ? b : (b & (0x3Fu >> extra));
  for (size_t k = 1; k <= extra; ++k) {
    const auto c = static_cast<unsigned char>(s[i + k]);
    if ((c & 0xC0) != 0x80) {
      ++i;
      return b;
    }
    cp = (cp << 6) | (c & 0x3Fu);
  }
  i += extra + 1;
  return cp;
}

// Python's str.isspace(): what `\s` matches in a str regular expression.
bool is_python_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Unicode's White_Space property (Rust's char::is_whitespace): where the tokenizers library's
// WhitespaceSplit, the first pre-tokenizer of transformers' T5 tokenizer, splits the text into words.
bool is_white_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// The text as SentencePiece must see it to split into the words transformers' pre-tokenizers make
// (WhitespaceSplit, then Metaspace: "▁" put before each word that does not start with one already):
// every White_Space character a plain space (a model whose normaliser maps them to spaces, as umT5's
// NFKC-based one does, is unchanged; one with identity normalisation would keep a tab or U+3000 inside a
// word, or spell it in byte pieces), and no space before a word that starts with "▁" (SentencePiece
// would make that space a second "▁"). `meta_first`: the first word starts with "▁" (SentencePiece's
// dummy prefix then doubles it); `meta_last`: how many "▁" end the last word (SentencePiece drops every
// "▁" at the end of the text, transformers keeps them).
std::string as_transformers_words(const std::string& text, bool& meta_first, size_t& meta_last) {
  static constexpr std::string_view kMeta = "\xE2\x96\x81";  // U+2581
  std::string out;
  out.reserve(text.size());
  size_t pending = 0;  // spaces not yet written
  for (size_t i = 0; i < text.size();) {
    const size_t start = i;
    const uint32_t cp = next_code_point(text, i);
    if (is_white_space(cp)) {
      ++pending;
      continue;
    }
    const bool meta = std::string_view(text).substr(start, kMeta.size()) == kMeta;
    if (!meta || out.empty()) out.append(pending, ' ');
    pending = 0;
    out.append(text, start, i - start);
  }
  out.append(pending, ' ');
  const size_t first = out.find_first_not_of(' ');
  meta_first = first != std::string::npos && std::string_view(out).substr(first, kMeta.size()) == kMeta;
  meta_last = 0;
  const size_t last = out.find_last_not_of(' ');
  for (size_t end = last == std::string::npos ? 0 : last + 1;
       end >= kMeta.size() && std::string_view(out).substr(end - kMeta.size(), kMeta.size()) == kMeta;
       end -= kMeta.size())
    ++meta_last;
  return out;
}

struct Entity {
  const char* name;
  const char* text;
};
constexpr Entity kEntities[] = {
#include "html5_entities.inc"
};

const char* find_entity(const std::string& name) {
  const auto* end = std::end(kEntities);
  const auto* it = std::lower_bound(std::begin(kEntities), end, name,
                                    [](const Entity& e, const std::string& n) { return std::string_view(e.name) < n; });
  return it != end && name == it->name ? it->text : nullptr;
}

// Python's html._replace_charref for a numeric reference: the code point `num` (saturated above 0x10FFFF).
void append_numeric_reference(std::string& out, uint64_t num) {
  // Windows-1252's characters for the C1 range, as HTML5 maps them (html._invalid_charrefs).
  static constexpr uint32_t kC1[32] = {0x20AC, 0x81,   0x201A, 0x0192, 0x201E, 0x2026, 0x2020, 0x2021,
                                       0x02C6, 0x2030, 0x0160, 0x2039, 0x0152, 0x8D,   0x017D, 0x8F,
                                       0x90,   0x2018, 0x2019, 0x201C, 0x201D, 0x2022, 0x2013, 0x2014,
                                       0x02DC, 0x2122, 0x0161, 0x203A, 0x0153, 0x9D,   0x017E, 0x0178};
  if (num == 0) return utf8::append(out, 0xFFFD);
  if (num == 0x0D) return utf8::append(out, 0x0D);
  if (num >= 0x80 && num <= 0x9F) return utf8::append(out, kC1[num - 0x80]);
  if ((num >= 0xD800 && num <= 0xDFFF) || num > 0x10FFFF) return utf8::append(out, 0xFFFD);
  const auto c = static_cast<uint32_t>(num);
  // html._invalid_codepoints: dropped.
  if ((c >= 0x1 && c <= 0x8) || c == 0xB || (c >= 0xE && c <= 0x1F) || (c >= 0x7F && c <= 0x9F) ||
      (c >= 0xFDD0 && c <= 0xFDEF) || (c & 0xFFFE) == 0xFFFE)
    return;
  utf8::append(out, c);
}

struct CharacterFix {
  uint32_t code_point;
  const char* replacement;
};
constexpr CharacterFix kFtfyCharacters[] = {
#include "ftfy_characters.inc"
};

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_hex(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

}  // namespace

std::string html_unescape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const size_t amp = text.find('&', i);
    if (amp == std::string::npos) break;
    out.append(text, i, amp - i);
    size_t j = amp + 1;
    if (j < text.size() && text[j] == '#') {
      // &#[0-9]+;?  or  &#[xX][0-9a-fA-F]+;?
      const bool hex = j + 1 < text.size() && (text[j + 1] == 'x' || text[j + 1] == 'X');
      size_t k = j + (hex ? 2 : 1);
      const size_t digits = k;
      uint64_t num = 0;
      while (k < text.size() && (hex ? is_hex(text[k]) : is_digit(text[k]))) {
        const char c = text[k];
        const uint64_t d = is_digit(c) ? static_cast<uint64_t>(c - '0') : static_cast<uint64_t>((c | 0x20) - 'a' + 10);
        num = std::min<uint64_t>(num * (hex ? 16 : 10) + d,
                                 uint64_t{1} << 40);  // saturated: anything above 0x10FFFF is U+FFFD
        ++k;
      }
      if (k == digits) {  // no digits: not a reference
        out += '&';
        i = amp + 1;
        continue;
      }
      if (k < text.size() && text[k] == ';') ++k;
      append_numeric_reference(out, num);
      i = k;
      continue;
    }
    // [^\t\n\f <&#;]{1,32};?  (32 code points), then the whole name, else its longest prefix of at least
    // two characters that is a name without ';', the rest kept; else the text as it was.
    size_t k = j;
    int count = 0;
    while (k < text.size() && count < 32) {
      const char c = text[k];
      if (c == '\t' || c == '\n' || c == '\f' || c == ' ' || c == '<' || c == '&' || c == '#' || c == ';') break;
      size_t next = k;
      next_code_point(text, next);
      k = next;
      ++count;
    }
    if (count == 0) {
      out += '&';
      i = amp + 1;
      continue;
    }
    if (k < text.size() && text[k] == ';') ++k;
    const std::string name = text.substr(j, k - j);
    if (const char* replacement = find_entity(name)) {
      out += replacement;
      i = k;
      continue;
    }
    bool found = false;
    for (size_t len = name.size() - 1; len >= 2 && !found; --len) {  // entity names are ASCII: bytes are characters
      if (const char* replacement = find_entity(name.substr(0, len))) {
        out += replacement;
        out.append(name, len, std::string::npos);
        found = true;
      }
    }
    if (!found) out += "&" + name;
    i = k;
  }
  out.append(text, i, std::string::npos);
  return out;
}

std::string ftfy_character_fixes(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const size_t start = i;
    const uint32_t cp = next_code_point(text, i);
    const auto* end = std::end(kFtfyCharacters);
    const auto* it = std::lower_bound(std::begin(kFtfyCharacters), end, cp,
                                      [](const CharacterFix& f, uint32_t c) { return f.code_point < c; });
    if (it != end && it->code_point == cp) out += it->replacement;
    else out.append(text, start, i - start);
  }
  return unicode::nfc(out, "ftfy_character_fixes (NFC)");
}

std::string wan_prompt_clean(const std::string& prompt) {
  return wan_clean(html_unescape(html_unescape(ftfy_fix_text(prompt))));
}

std::string wan_clean(const std::string& prompt) {
  std::string out;
  bool space = false;
  for (size_t i = 0; i < prompt.size();) {
    const size_t start = i;
    const uint32_t cp = next_code_point(prompt, i);
    if (is_python_space(cp)) {
      space = true;
      continue;
    }
    if (space && !out.empty()) out += ' ';
    space = false;
    out.append(prompt, start, i - start);
  }
  return out;
}

#ifdef MEGASLIDE_WITH_SENTENCEPIECE

namespace {

// libmegaslide_sentencepiece.so (model/sentencepiece_module.h says why SentencePiece is not linked), from the
// folder of the library this code is in, opened once; its loader, or an error that says what failed.
detail::LoadSentencePieceModel sentencepiece_loader() {
  struct Loaded {
    detail::LoadSentencePieceModel load = nullptr;
    std::string problem;
  };
  static const Loaded loaded = [] {
    Loaded r;
    Dl_info self{};
    std::string path = detail::kSentencePieceModuleFile;
    // An address in this library that no other object can interpose: this function's own.
    if (dladdr(reinterpret_cast<void*>(&sentencepiece_loader), &self) != 0 && self.dli_fname != nullptr) {
      const std::string library = self.dli_fname;
      const auto slash = library.rfind('/');
      if (slash != std::string::npos) path = library.substr(0, slash + 1) + path;
    }
    void* module = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (module == nullptr) {
      const char* why = dlerror();
      r.problem = "cannot open SentencePiece's module " + path + ": " + (why != nullptr ? why : "unknown error");
      return r;
    }
    const auto abi = reinterpret_cast<detail::SentencePieceAbi>(dlsym(module, detail::kSentencePieceModuleAbi));
    if (abi == nullptr || std::string(abi()) != detail::sentencepiece_abi_tag()) {
      r.problem = path + " was built for another C++ ABI (" + (abi != nullptr ? abi() : "no tag") + ", this library " +
                  detail::sentencepiece_abi_tag() + ")";
      return r;
    }
    r.load = reinterpret_cast<detail::LoadSentencePieceModel>(dlsym(module, detail::kLoadSentencePieceModel));
    if (r.load == nullptr) r.problem = path + " has no " + detail::kLoadSentencePieceModel;
    return r;
  }();
  if (loaded.load == nullptr) throw std::runtime_error("umT5 tokenizer: " + loaded.problem);
  return loaded.load;
}

}  // namespace

struct Umt5Tokenizer::Impl {
  std::unique_ptr<const detail::SentencePieceModel> sp;
  // The pieces the unigram search may use (not control, unknown or unused pieces): text → (id, score).
  // Byte pieces are searched by their text ("<0x41>"), as transformers' unigram model (built without byte
  // fallback) matches them in written-out text.
  // The keys view the processor's own piece strings.
  std::unordered_map<std::string_view, std::pair<int, double>> pieces;
  std::vector<bool> searchable;  // by id
  size_t longest = 0;            // bytes of the longest searchable piece
  double unknown_score = 0;      // the lowest score of any piece, minus 10 (transformers' unknown-character penalty)

  void index() {
    const int n = sp->GetPieceSize();
    searchable.assign(static_cast<size_t>(n), false);
    double lowest = 0;
    for (int id = 0; id < n; ++id) {
      lowest = std::min(lowest, static_cast<double>(sp->GetScore(id)));
      if (sp->IsControl(id) || sp->IsUnknown(id) || sp->IsUnused(id)) continue;
      const std::string& piece = sp->IdToPiece(id);
      pieces.emplace(std::string_view(piece), std::make_pair(id, static_cast<double>(sp->GetScore(id))));
      searchable[static_cast<size_t>(id)] = true;
      longest = std::max(longest, piece.size());
    }
    unknown_score = lowest - 10.0;
  }

  // One word (from one "▁" to the next) segmented as the tokenizers library's unigram model does it (the
  // library transformers' T5 tokenizer runs): a best-score path over the word's bytes where, at each end
  // position, the first candidate found (the earliest start) keeps the place unless a later one scores
  // strictly more; scores are summed in double; a character with no piece of its own is <unk> with
  // `unknown_score`, consecutive ones one <unk>.
  void segment_word(std::string_view word, std::vector<int64_t>& out) const {
    struct Node {
      double score = 0;
      int64_t start = -1;
      int64_t id = 0;
    };
    std::vector<Node> best(word.size() + 1);
    for (size_t s = 0; s < word.size();) {
      const auto lead = static_cast<unsigned char>(word[s]);
      const size_t width = std::min(word.size() - s, size_t{lead >= 0xF0   ? 4u
                                                            : lead >= 0xE0 ? 3u
                                                            : lead >= 0xC0 ? 2u
                                                                           : 1u});
      const double base = best[s].score;
      bool single = false;
      for (size_t len = 1; len <= longest && s + len <= word.size(); ++len) {
        const auto it = pieces.find(word.substr(s, len));
        if (it == pieces.end()) continue;
        Node& end = best[s + len];
        const double candidate = base + it->second.second;
        if (end.start < 0 || candidate > end.score) end = {candidate, static_cast<int64_t>(s), it->second.first};
        single = single || len == width;
      }
      if (!single) {
        Node& end = best[s + width];
        const double candidate = base + unknown_score;
        if (end.start < 0 || candidate > end.score) end = {candidate, static_cast<int64_t>(s), Umt5Tokenizer::kUnk};
      }
      s += width;
    }
    const size_t first = out.size();
    for (auto end = static_cast<int64_t>(word.size()); end > 0; end = best[static_cast<size_t>(end)].start) {
      const int64_t id = best[static_cast<size_t>(end)].id;
      if (!(id == Umt5Tokenizer::kUnk && out.size() > first && out.back() == Umt5Tokenizer::kUnk)) out.push_back(id);
    }
    std::reverse(out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
  }

  // A run of searchable pieces SentencePiece chose, segmented again word by word as above: the same
  // total score (both are best paths over the same pieces), the same pieces where the best is unique;
  // where several paths tie, the one transformers picks.
  void segment_run(const std::string& run, std::vector<int64_t>& out) const {
    static constexpr std::string_view kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's space
    size_t begin = 0;
    while (begin < run.size()) {
      size_t next = run.find(kSpace, begin + 1);
      if (next == std::string::npos) next = run.size();
      segment_word(std::string_view(run).substr(begin, next - begin), out);
      begin = next;
    }
  }
};

bool umt5_tokenizer_supported() { return true; }

namespace {
std::unique_ptr<Umt5Tokenizer::Impl> checked(std::unique_ptr<Umt5Tokenizer::Impl> impl, const std::string& source) {
  const auto& sp = impl->sp;
  for (const auto& [piece, id] : kSpecial) {
    if (sp->GetPieceSize() <= id || sp->IdToPiece(static_cast<int>(id)) != piece)
      fail(source, "id " + std::to_string(id) + " must be " + piece +
                       " (umT5's special tokens: <pad> 0, </s> 1, <unk> 2), it is '" +
                       (sp->GetPieceSize() > id ? sp->IdToPiece(static_cast<int>(id)) : std::string("(none)")) + "'");
  }
  if (!sp->IsUnknown(Umt5Tokenizer::kUnk)) fail(source, "<unk> (id 2) is not the model's unknown piece");
  return impl;
}
}  // namespace

Umt5Tokenizer Umt5Tokenizer::from_file(const std::string& path) {
  if (!io::path_exists(path) || io::is_directory(path))
    fail(path, "no such file (expected a SentencePiece model, spiece.model)");
  std::string bytes;
  try {
    bytes = io::read_file(path);
  } catch (const std::exception& e) {
    fail(path, e.what());
  }
  return from_bytes(bytes, path);
}

Umt5Tokenizer Umt5Tokenizer::from_bytes(const std::string& serialized, const std::string& source) {
  std::string error;
  std::unique_ptr<detail::SentencePieceModel> model(sentencepiece_loader()(serialized, error));
  if (model == nullptr) fail(source, "not a SentencePiece model: " + error);
  auto impl = std::make_unique<Impl>();
  impl->sp = std::move(model);
  impl = checked(std::move(impl), source);
  impl->index();
  return Umt5Tokenizer(std::move(impl), source);
}

std::vector<int64_t> Umt5Tokenizer::encode_text(const std::string& text) const {
  std::vector<int64_t> out;
  size_t pos = 0;
  // SentencePiece's normalisation and segmentation; then each run of ordinary pieces segmented again with
  // transformers' tie-break (Impl::segment_run); unknown pieces as SentencePiece gives them. A model with
  // byte fallback spells a character outside its vocabulary in byte pieces (<0xF0><0x9F><0x90><0xB1>);
  // transformers never does (its unigram model has no byte fallback: the character is <unk>, consecutive
  // ones one <unk>), so the bytes go back into the run as the character they spell and are segmented there.
  auto piece_ids = [&](const std::string& part) {
    if (part.empty()) return;
    std::vector<std::pair<int, std::string>> pieces;
    bool meta_first = false;
    size_t meta_last = 0;
    std::string error;
    if (!impl_->sp->Encode(as_transformers_words(part, meta_first, meta_last), pieces, error))
      fail(source_, "cannot encode text: " + error);
    std::string run;
    // A first word that starts with "▁" keeps that one (transformers adds none before it): the dummy
    // prefix SentencePiece put before it goes. The "▁" that end the text come back at its end.
    bool first_run = true;
    const auto flush = [&](bool last) {
      static constexpr std::string_view kDoubled = "\xE2\x96\x81\xE2\x96\x81";
      if (first_run && meta_first && std::string_view(run).substr(0, kDoubled.size()) == kDoubled) run.erase(0, 3);
      first_run = false;
      for (size_t k = 0; last && k < meta_last; ++k) run += "\xE2\x96\x81";
      impl_->segment_run(run, out);
      run.clear();
    };
    for (const auto& [piece_id, piece] : pieces) {
      const auto id = static_cast<size_t>(piece_id);
      if (impl_->sp->IsByte(piece_id)) {
        run += static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16));  // "<0xHH>"
        continue;
      }
      if (id < impl_->searchable.size() && impl_->searchable[id]) {
        run += piece;
        continue;
      }
      flush(false);
      out.push_back(static_cast<int64_t>(id));
    }
    flush(true);
  };
  while (pos < text.size()) {
    // The leftmost special token (the longest at one position: they cannot overlap anyway).
    size_t best = std::string::npos, best_len = 0;
    int64_t best_id = 0;
    for (const auto& [piece, id] : kSpecial) {
      const auto at = text.find(piece, pos);
      if (at != std::string::npos && (at < best || (at == best && std::string(piece).size() > best_len))) {
        best = at, best_len = std::string(piece).size(), best_id = id;
      }
    }
    if (best == std::string::npos) {
      piece_ids(text.substr(pos));
      break;
    }
    piece_ids(text.substr(pos, best - pos));
    out.push_back(best_id);
    pos = best + best_len;
  }
  return out;
}

int64_t Umt5Tokenizer::vocab_size() const { return impl_->sp->GetPieceSize(); }

std::string Umt5Tokenizer::piece(int64_t id) const {
  if (id < 0 || id >= vocab_size()) fail(source_, "no piece " + std::to_string(id));
  return impl_->sp->IdToPiece(static_cast<int>(id));
}

double Umt5Tokenizer::score(int64_t id) const {
  if (id < 0 || id >= vocab_size()) fail(source_, "no piece " + std::to_string(id));
  return impl_->sp->GetScore(static_cast<int>(id));
}

#else  // built without SentencePiece

struct Umt5Tokenizer::Impl {};

bool umt5_tokenizer_supported() { return false; }

namespace {
[[noreturn]] void unsupported(const std::string& source) {
  fail(source,
       "this build has no SentencePiece (install libsentencepiece-dev, as tools/bootstrap.sh does, and reconfigure)");
}
}  // namespace

Umt5Tokenizer Umt5Tokenizer::from_file(const std::string& path) { unsupported(path); }
Umt5Tokenizer Umt5Tokenizer::from_bytes(const std::string&, const std::string& source) { unsupported(source); }
std::vector<int64_t> Umt5Tokenizer::encode_text(const std::string&) const { unsupported(source_); }
int64_t Umt5Tokenizer::vocab_size() const { unsupported(source_); }
std::string Umt5Tokenizer::piece(int64_t) const { unsupported(source_); }
double Umt5Tokenizer::score(int64_t) const { unsupported(source_); }

#endif

Umt5Tokenizer::Umt5Tokenizer(std::unique_ptr<Impl> impl, std::string source)
    : impl_(std::move(impl)), source_(std::move(source)) {}
Umt5Tokenizer::Umt5Tokenizer(Umt5Tokenizer&&) noexcept = default;
Umt5Tokenizer& Umt5Tokenizer::operator=(Umt5Tokenizer&&) noexcept = default;
Umt5Tokenizer::~Umt5Tokenizer() = default;

Umt5Tokenizer Umt5Tokenizer::find(const std::string& path) {
  if (!io::path_exists(path))
    fail(path, "no such file or folder (expected spiece.model, a model folder or a .safetensors file)");
  // Where a model folder keeps its tokenizer: beside the weights, in tokenizer/, or in the pipeline's
  // tokenizer/ beside text_encoder/.
  const auto in_folder = [](const std::string& dir) {
    return std::vector<std::string>{io::join_path(dir, "spiece.model"), io::join_path(dir, "tokenizer/spiece.model"),
                                    io::join_path(dir, "../tokenizer/spiece.model")};
  };
  const auto ends_with = [&](const char* tail) {
    const size_t n = std::char_traits<char>::length(tail);
    return path.size() > n && path.compare(path.size() - n, n, tail) == 0;
  };
  std::vector<std::string> candidates;
  if (io::is_directory(path)) {
    candidates = in_folder(path);
  } else if (ends_with(".safetensors") ||
             ends_with(".safetensors.index.json")) {  // a weights file or a sharded one's index
    if (ends_with(".safetensors")) try {
        io::MappedWeights weights(path);
        if (weights.has("spiece_model"))
          return from_bytes(weights.bytes("spiece_model"), path + " (tensor spiece_model)");
      } catch (const io::PretrainedError& e) {
        fail(path, e.what());
      }
    candidates = in_folder(io::parent_path(path));
  } else {
    return from_file(path);
  }
  for (const auto& c : candidates)
    if (io::path_exists(c)) return from_file(c);
  std::string list;
  for (const auto& c : candidates) list += (list.empty() ? "" : ", ") + c;
  fail(path, "no SentencePiece model found (looked for " + list +
                 (io::is_directory(path) ? "" : " and a tensor spiece_model") + ")");
}

Umt5Tokens Umt5Tokenizer::encode(const std::vector<std::string>& prompts, int64_t max_length) const {
  if (max_length < 1) fail(source_, "max_length must be >= 1, got " + std::to_string(max_length));
  const auto n = static_cast<int64_t>(prompts.size());
  auto ids = at::full({n, max_length}, kPad, at::kLong);
  auto mask = at::zeros({n, max_length}, at::kLong);
  auto ids_a = ids.accessor<int64_t, 2>();
  auto mask_a = mask.accessor<int64_t, 2>();
  for (int64_t i = 0; i < n; ++i) {
    auto text = encode_text(prompts[static_cast<size_t>(i)]);
    if (static_cast<int64_t>(text.size()) > max_length - 1) text.resize(static_cast<size_t>(max_length - 1));
    text.push_back(kEos);
    for (size_t j = 0; j < text.size(); ++j) {
      ids_a[i][static_cast<int64_t>(j)] = text[j];
      mask_a[i][static_cast<int64_t>(j)] = 1;
    }
  }
  return {ids, mask};
}

}  // namespace megaslide
