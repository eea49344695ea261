// CLIP's vision transformer as Wan2.1 image-to-video conditions on it: transformers' CLIPImageProcessor turns
// the RGB image into pixel_values, CLIPVisionModel(output_hidden_states=True) encodes them, and the
// pipeline keeps hidden_states[-2], the output of the next-to-last layer (diffusers'
// WanImageToVideoPipeline.encode_image; ViT-H/14, 257 tokens of width 1280). Loaded from:
//   - a diffusers image_encoder/ folder: config.json (a CLIPVisionConfig, or a CLIPConfig whose
//     "vision_config" is used) and model.safetensors (or model.fp16.safetensors) with vision_model.* names,
//     or without the prefix as transformers 5 saves them; text_model.*, visual_projection and
//     post_layernorm tensors are ignored. The preprocessing comes from the folder's
//     preprocessor_config.json, else from ../image_processor/preprocessor_config.json (where diffusers'
//     Wan I2V repos keep it), else CLIP's defaults at the model's image size;
//   - ComfyUI's single file (clip_vision_h.safetensors; any .safetensors file): vision_model.* names (as
//     ComfyUI's loader expects them, beside visual_projection.weight). It has no config: the layers are
//     counted, the width read from class_embedding, the MLP width from fc1, the patch size from the
//     convolution and the image size from the number of positions. Heads and activation are not in the
//     file: they come from ComfyUI's own configs, by width (ViT-L 1024: 16 heads, quick_gelu; ViT-H 1280
//     and ViT-bigG 1664: 16 heads, gelu); another width needs ClipVisionFileHints. Preprocessing: CLIP's
//     defaults at the inferred image size.
// Every tensor must be present with the shape the config implies, floating point of any width.
//
// Preprocessing (clip_preprocess) is CLIPImageProcessor's PIL backend (CLIPImageProcessorPil), which is what
// CLIPImageProcessor.from_pretrained gives in transformers 5 when torchvision is not installed, and what
// transformers 4's CLIPImageProcessor always was. With torchvision installed, transformers 5 gives the
// torchvision backend instead, which resizes in float (torch's antialiased bicubic): on the fixture's
// images that moves about one pixel value in five by a level or more (up to 7 at hard edges), so those
// pixel_values differ from these by up to ~0.1 after normalization:
//   resize   size.shortest_edge S: the short edge to S, the long edge to int(S·long/short) (truncated,
//            as transformers' get_resize_output_image_size); size {height, width}: that size. PIL's
//            Image.resize of the uint8 image: separable, horizontal pass then vertical, each with the
//            filter's support widened by the downscale factor, 22-bit fixed-point weights, rounded and
//            clipped to uint8 after each pass (resize_like_pil, exact to PIL's output bytes);
//   crop     crop_size {height, width} at offsets floor((size − crop)/2), zero-padded where the image is
//            smaller (transformers' center_crop);
//   rescale  float32(u8 · rescale_factor) computed in double;  normalize  (x − mean)/std in float32.
// The result equals transformers' pixel_values bit for bit.
//
// Forward, for pixel_values [B, C, image_size, image_size]:
//   h = [class_embedding ; conv(pixel_values, patch_embedding, stride patch)] + position_embedding
//   hidden_states[0] = pre_layrnorm(h)
//   hidden_states[k] = layer k applied to hidden_states[k−1]: h += out_proj(self-attention(layer_norm1(h)))
//                      (every token attends to every token, no mask); h += fc2(act(fc1(layer_norm2(h))))
// Only the layers the requested index needs are run (the penultimate skips the last layer). act is
// hidden_act: quick_gelu (x·sigmoid(1.702x)), gelu (erf) or gelu_new (tanh).
//
// Frozen: no gradients, eval only. Weights live on `device` in `dtype` (fp32, or bf16/fp16 on a GPU);
// outputs are float32 on that device. Errors: ClipVisionError (an io::IoError and InputError) naming the
// folder or file, the tensor and what was expected; c10::Error (TORCH_CHECK) for inputs of the wrong
// shape or type. Thread-safety: a const encoder may be used from one thread at a time (LibTorch ops on
// its tensors); the free functions are pure.
#pragma once

#include <torch/types.h>

#include <array>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/io/files.h"
#include "megaslide/util/errors.h"

namespace megaslide {

class ClipVisionError : public io::IoError, public InputError {
 public:
  using io::IoError::IoError;
};

// transformers' CLIPVisionConfig (its defaults: ViT-B/32).
struct ClipVisionConfig {
  int64_t hidden_size = 768;
  int64_t intermediate_size = 3072;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t num_channels = 3;
  int64_t image_size = 224;
  int64_t patch_size = 32;
  std::string hidden_act = "quick_gelu";
  double layer_norm_eps = 1e-5;

  int64_t patches() const { return (image_size / patch_size) * (image_size / patch_size); }
};

// What CLIPImageProcessor does, as preprocessor_config.json says; the defaults are OpenAI CLIP's.
struct ClipImagePreprocessing {
  bool do_resize = true;
  int64_t shortest_edge = 224;                  // size.shortest_edge; 0 when size is {height, width}
  int64_t resize_height = 0, resize_width = 0;  // size {height, width}: resize to exactly that
  int64_t resample = 3;                         // PIL's filter: 1 LANCZOS, 2 BILINEAR, 3 BICUBIC, 4 BOX, 5 HAMMING
  bool do_center_crop = true;
  int64_t crop_height = 224, crop_width = 224;
  bool do_rescale = true;
  double rescale_factor = 1.0 / 255.0;
  bool do_normalize = true;
  std::array<double, 3> image_mean{0.48145466, 0.4578275, 0.40821073};
  std::array<double, 3> image_std{0.26862954, 0.26130258, 0.27577711};
  bool do_convert_rgb = true;  // the input is RGB already: nothing to do

  // OpenAI CLIP's preprocessing for a model of `image_size`: shortest edge and square crop of that size.
  static ClipImagePreprocessing defaults(int64_t image_size = 224);
  // A preprocessor_config.json (missing keys take CLIPImageProcessor's defaults). ClipVisionError naming
  // the file for bad JSON, a key of the wrong type, a resample value other than 1-5 (NEAREST, 0, is not
  // implemented) or a size this does not do (longest_edge).
  static ClipImagePreprocessing read(const std::string& preprocessor_config_json);
};

// The (height, width) CLIPImageProcessor resizes an image of (height, width) to (the input size when
// do_resize is false).
std::pair<int64_t, int64_t> clip_resized_size(int64_t height, int64_t width, const ClipImagePreprocessing& p);

// PIL's Image.resize((width, height), resample) of a uint8 image [H, W, C], C = 1 to 4: [height, width, C]
// uint8. Channels are resampled independently: PIL's bytes for modes L, RGB and CMYK (for LA and RGBA
// PIL premultiplies the alpha first, which this does not).
torch::Tensor resize_like_pil(const torch::Tensor& image, int64_t height, int64_t width, int64_t resample);

// CLIPImageProcessor(images=image, return_tensors="pt").pixel_values: uint8 RGB [H, W, 3] (any size,
// CPU or not) -> [1, 3, crop_height, crop_width] float32 on the CPU (without the crop: the resized size).
torch::Tensor clip_preprocess(const torch::Tensor& image, const ClipImagePreprocessing& p);

struct ClipVisionOutput {
  torch::Tensor penultimate;  // hidden_states[-2]: [B, 1 + patches, hidden_size] float32
};

// For a single file whose width is not in the table: what the file cannot say.
struct ClipVisionFileHints {
  int64_t num_attention_heads = 0;  // 0: from the table
  std::string hidden_act;           // empty: from the table
};

class ClipVisionEncoder {
 public:
  // A folder (diffusers' image_encoder/) or a .safetensors file (ComfyUI's), see above.
  // `fp8`: the layers' matrices kept as float8_e4m3fn with a per-tensor scale (model.image_encoder.dtype: fp8),
  // each dequantized into `dtype` when its layer runs: the output is the encoder's on those dequantized values.
  static ClipVisionEncoder load(const std::string& path, torch::Device device = torch::kCPU,
                                torch::ScalarType dtype = torch::kFloat32, const ClipVisionFileHints& hints = {},
                                bool fp8 = false);
  // The architecture of `config` with random weights and default preprocessing, for benchmarks.
  static ClipVisionEncoder random(const ClipVisionConfig& config, uint64_t seed = 0, torch::Device device = torch::kCPU,
                                  torch::ScalarType dtype = torch::kFloat32);

  // pixel_values [B, num_channels, image_size, image_size], any floating dtype and device.
  ClipVisionOutput forward(const torch::Tensor& pixel_values) const;
  // hidden_states[index] (0 to num_hidden_layers; negative counts from the end, -1 the last layer's
  // output): [B, 1 + patches, hidden_size] float32.
  torch::Tensor hidden_state(const torch::Tensor& pixel_values, int64_t index) const;
  // clip_preprocess with this encoder's preprocessing, then the penultimate hidden state: uint8 RGB
  // [H, W, 3] -> [1, 1 + patches, hidden_size]; several images (Wan's first and last frame) -> [N, ...].
  torch::Tensor encode(const torch::Tensor& image) const;
  torch::Tensor encode(const std::vector<torch::Tensor>& images) const;

  const ClipVisionConfig& config() const { return config_; }
  const ClipImagePreprocessing& preprocessing() const { return preprocessing_; }
  void set_preprocessing(const ClipImagePreprocessing& p) { preprocessing_ = p; }
  // The preprocessor_config.json the preprocessing came from; empty for the defaults.
  const std::string& preprocessing_source() const { return preprocessing_source_; }
  torch::Device device() const { return device_; }
  torch::ScalarType dtype() const { return dtype_; }
  int64_t parameter_count() const;
  bool fp8() const { return fp8_; }
  int64_t weight_bytes() const;  // the weights' bytes as kept (fp8 matrices: 1 B an element, and their scales)

 private:
  using WeightSource =
      std::function<torch::Tensor(const std::string&, const std::vector<int64_t>&)>;  // (name, shape) -> CPU tensor
  static ClipVisionEncoder build(const ClipVisionConfig& config, torch::Device device, torch::ScalarType dtype,
                                 const WeightSource& source, bool fp8 = false);

  ClipVisionConfig config_;
  ClipImagePreprocessing preprocessing_;
  std::string preprocessing_source_;
  torch::Device device_ = torch::kCPU;
  torch::ScalarType dtype_ = torch::kFloat32;
  bool fp8_ = false;
  std::map<std::string, torch::Tensor> w_;      // transformers' names without the vision_model. prefix
  std::map<std::string, torch::Tensor> scale_;  // fp8: the layers' matrices' scales
};

}  // namespace megaslide
