// libmegaslide_sentencepiece.so: SentencePiece behind model/sentencepiece_module.h's interface. Built as a
// module of its own (src/CMakeLists.txt keeps this file out of libmegaslide); sentencepiece_module.h says why.
#include "model/sentencepiece_module.h"

#include <sentencepiece_processor.h>

#include <memory>

namespace megaslide::detail {
namespace {

class Model final : public SentencePieceModel {
 public:
  sentencepiece::SentencePieceProcessor sp;
  int GetPieceSize() const override { return sp.GetPieceSize(); }
  float GetScore(int id) const override { return sp.GetScore(id); }
  bool IsControl(int id) const override { return sp.IsControl(id); }
  bool IsUnknown(int id) const override { return sp.IsUnknown(id); }
  bool IsUnused(int id) const override { return sp.IsUnused(id); }
  bool IsByte(int id) const override { return sp.IsByte(id); }
  const std::string& IdToPiece(int id) const override { return sp.IdToPiece(id); }
  bool Encode(const std::string& text, std::vector<std::pair<int, std::string>>& pieces,
              std::string& error) const override {
    sentencepiece::ImmutableSentencePieceText out;
    const auto status = sp.Encode(text, out.mutable_proto());
    if (!status.ok()) {
      error = status.ToString();
      return false;
    }
    pieces.clear();
    for (const auto& p : out.pieces()) pieces.emplace_back(static_cast<int>(p.id()), p.piece());
    return true;
  }
};

}  // namespace
}  // namespace megaslide::detail

extern "C" __attribute__((visibility("default"))) const char* megaslide_sentencepiece_abi() {
  return megaslide::detail::sentencepiece_abi_tag();
}

extern "C" __attribute__((visibility("default"))) megaslide::detail::SentencePieceModel*
megaslide_load_sentencepiece_model(const std::string& serialized, std::string& error) {
  auto model = std::make_unique<megaslide::detail::Model>();
  const auto status = model->sp.LoadFromSerializedProto(serialized);
  if (!status.ok()) {
    error = status.ToString();
    return nullptr;
  }
  return model.release();
}
