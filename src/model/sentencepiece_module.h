// The part of SentencePiece umT5's tokenizer uses, behind an interface of our own, so that SentencePiece can
// live in a module of its own (libmegaslide_sentencepiece.so, from sentencepiece_module.cpp) that
// model/umt5_tokenizer.cpp opens with dlopen(RTLD_LOCAL | RTLD_DEEPBIND) the first time a tokenizer loads.
//
// Why not link it: Debian's libsentencepiece defines an absl flag named FLAGS_minloglevel, and LibTorch's
// libc10 exports a 4-byte int of the same name. Linked into a process that has libc10, SentencePiece's
// references bind to libc10's int (the first definition in the process's lookup order) and its static
// initialiser builds its absl::Flag object over that int and the bytes after it — among them libc10's
// FLAGS_caffe2_use_fatal_for_enforce, which then reads true, so every failed CAFFE_ENFORCE (a CPU
// allocation LibTorch cannot make, among others) aborted the process instead of throwing. Opened with
// RTLD_DEEPBIND, the module and its dependencies look up their symbols in themselves first, and with
// RTLD_LOCAL nothing else binds to theirs.
//
// The module and the library are built from one tree with one compiler, so the interface may pass
// std::string and std::vector (an ABI tag checked at load makes sure). Not for sanitizer builds: AddressSanitizer
// refuses RTLD_DEEPBIND. And a program that links libsentencepiece itself brings the clash back: the module then
// shares that already-loaded copy.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace megaslide::detail {

class SentencePieceModel {
 public:
  virtual ~SentencePieceModel() = default;
  virtual int GetPieceSize() const = 0;
  virtual float GetScore(int id) const = 0;
  virtual bool IsControl(int id) const = 0;
  virtual bool IsUnknown(int id) const = 0;
  virtual bool IsUnused(int id) const = 0;
  virtual bool IsByte(int id) const = 0;
  virtual const std::string& IdToPiece(int id) const = 0;
  // SentencePiece's normalisation and segmentation of `text`: (id, piece) in order. False, with
  // SentencePiece's message in `error`, when it fails.
  virtual bool Encode(const std::string& text, std::vector<std::pair<int, std::string>>& pieces,
                      std::string& error) const = 0;
};

// What both sides must agree on to pass std::string and std::vector: the library's ABI tag must equal the
// module's (exported as kSentencePieceModuleAbi, a function returning it), checked when the module opens.
inline constexpr const char* kSentencePieceModuleAbi = "megaslide_sentencepiece_abi";
inline const char* sentencepiece_abi_tag() {
#if defined(_GLIBCXX_USE_CXX11_ABI) && _GLIBCXX_USE_CXX11_ABI
  return "interface 1, libstdc++ C++11 ABI";
#else
  return "interface 1, libstdc++ old ABI";
#endif
}
using SentencePieceAbi = const char* (*)();

// The module's loader (looked up by this name): a model from a serialized ModelProto, or nullptr with
// SentencePiece's message in `error`. The caller owns the model (delete it).
using LoadSentencePieceModel = SentencePieceModel* (*)(const std::string& serialized, std::string& error);
inline constexpr const char* kLoadSentencePieceModel = "megaslide_load_sentencepiece_model";
inline constexpr const char* kSentencePieceModuleFile = "libmegaslide_sentencepiece.so";

}  // namespace megaslide::detail
