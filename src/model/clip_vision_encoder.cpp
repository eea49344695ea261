#include "megaslide/model/clip_vision_encoder.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "io/pretrained.h"
#include "model/clip_layers.h"

namespace megaslide {

// --- Preprocessing: CLIPImageProcessor's PIL backend ----------------------------------------------------

namespace {

[[noreturn]] void bad_json(const std::string& source, const std::string& key, const std::string& expected,
                           const nlohmann::json& v) {
  throw ClipVisionError("'" + source + "': \"" + key + "\" must be " + expected + ", got " + v.dump());
}

bool present(const nlohmann::json& j, const char* key) { return j.contains(key) && !j.at(key).is_null(); }

bool json_flag(const nlohmann::json& j, const char* key, bool fallback, const std::string& source) {
  if (!present(j, key)) return fallback;
  if (!j.at(key).is_boolean()) bad_json(source, key, "true or false", j.at(key));
  return j.at(key).get<bool>();
}

int64_t json_positive(const nlohmann::json& j, const char* key, int64_t fallback, const std::string& source,
                      const std::string& where) {
  if (!present(j, key)) return fallback;
  const auto& v = j.at(key);
  if (!v.is_number_integer() || v.get<int64_t>() < 1) bad_json(source, where + key, "a positive integer", v);
  return v.get<int64_t>();
}

std::array<double, 3> json_triple(const nlohmann::json& j, const char* key, const std::array<double, 3>& fallback,
                                  const std::string& source) {
  if (!present(j, key)) return fallback;
  const auto& v = j.at(key);
  if (v.is_number()) return {v.get<double>(), v.get<double>(), v.get<double>()};  // one value for every channel
  if (!v.is_array() || v.size() != 3 || !v[0].is_number() || !v[1].is_number() || !v[2].is_number())
    bad_json(source, key, "a list of 3 numbers (R, G, B)", v);
  return {v[0].get<double>(), v[1].get<double>(), v[2].get<double>()};
}

// PIL's resampling filters (Pillow's src/libImaging/Resample.c), by Image.Resampling value.
struct PilFilter {
  double (*weight)(double);
  double support;
  const char* name;
};

constexpr double kPi = 3.14159265358979323846;  // M_PI

double box_weight(double x) { return x > -0.5 && x <= 0.5 ? 1.0 : 0.0; }
double bilinear_weight(double x) {
  if (x < 0.0) x = -x;
  return x < 1.0 ? 1.0 - x : 0.0;
}
double hamming_weight(double x) {
  if (x < 0.0) x = -x;
  if (x == 0.0) return 1.0;
  if (x >= 1.0) return 0.0;
  x = x * kPi;
  return std::sin(x) / x * (0.54f + 0.46f * std::cos(x));  // float constants, as PIL writes them
}
double bicubic_weight(double x) {  // Keys' cubic convolution with a = -0.5
  const double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}
double sinc(double x) {
  if (x == 0.0) return 1.0;
  x = x * kPi;
  return std::sin(x) / x;
}
double lanczos_weight(double x) { return -3.0 <= x && x < 3.0 ? sinc(x) * sinc(x / 3) : 0.0; }

const PilFilter& pil_filter(int64_t resample) {
  static const PilFilter filters[] = {{nullptr, 0.0, "NEAREST"},          {lanczos_weight, 3.0, "LANCZOS"},
                                      {bilinear_weight, 1.0, "BILINEAR"}, {bicubic_weight, 2.0, "BICUBIC"},
                                      {box_weight, 0.5, "BOX"},           {hamming_weight, 1.0, "HAMMING"}};
  TORCH_CHECK(resample >= 1 && resample <= 5, "resize_like_pil: resample ", resample,
              " is not implemented (1 LANCZOS, 2 BILINEAR, 3 BICUBIC, 4 BOX, 5 HAMMING; 0 NEAREST is not)");
  return filters[resample];
}

// 8 bits of result, 2 of headroom for the filters' negative lobes and overshoot: PIL's fixed point.
constexpr int kPrecisionBits = 32 - 8 - 2;

// One axis's taps: for output position i, the inputs [first[i], first[i] + count[i]) with integer weights
// taps[i * width ...] (PIL's precompute_coeffs then normalize_coeffs_8bpc, over the whole input: box 0..size).
struct Taps {
  int width = 0;
  std::vector<int> first, count;
  std::vector<int32_t> weights;
};

Taps pil_taps(int in_size, int out_size, const PilFilter& filter) {
  const float in0 = 0.0f, in1 = static_cast<float>(in_size);  // PIL's box is float
  const double scale = static_cast<double>(in1 - in0) / out_size;
  const double filterscale = scale < 1.0 ? 1.0 : scale;  // a downscale widens the filter by its factor
  const double support = filter.support * filterscale;
  Taps t;
  t.width = static_cast<int>(std::ceil(support)) * 2 + 1;
  t.first.resize(out_size);
  t.count.resize(out_size);
  t.weights.assign(static_cast<size_t>(out_size) * t.width, 0);
  std::vector<double> k(t.width);
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = in0 + (xx + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    int xmin = static_cast<int>(center - support + 0.5);  // truncation toward zero, as PIL's (int) cast
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax = std::clamp(xmax - xmin, 0, t.width);
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      k[x] = filter.weight((x + xmin - center + 0.5) * ss);
      ww += k[x];
    }
    for (int x = 0; x < xmax; ++x) {
      if (ww != 0.0) k[x] /= ww;
      const double scaled = k[x] * (1 << kPrecisionBits);
      t.weights[static_cast<size_t>(xx) * t.width + x] = static_cast<int32_t>(k[x] < 0 ? -0.5 + scaled : 0.5 + scaled);
    }
    t.first[xx] = xmin;
    t.count[xx] = xmax;
  }
  return t;
}

uint8_t clip8(int32_t v) {
  if (v < 0) return 0;
  return static_cast<uint8_t>(std::min<int32_t>(v >> kPrecisionBits, 255));
}

// One pass along `axis` (0: rows, the vertical pass; 1: columns, the horizontal pass) of a contiguous
// uint8 [H, W, C] image.
torch::Tensor pil_pass(const torch::Tensor& in, int axis, int out_size, const PilFilter& filter) {
  const int H = static_cast<int>(in.size(0)), W = static_cast<int>(in.size(1)), C = static_cast<int>(in.size(2));
  const Taps t = pil_taps(axis == 0 ? H : W, out_size, filter);
  auto out = torch::empty({axis == 0 ? out_size : H, axis == 0 ? W : out_size, C}, torch::kUInt8);
  const uint8_t* src = in.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int out_w = axis == 0 ? W : out_size;
  const int64_t step = axis == 0 ? static_cast<int64_t>(W) * C : C;  // between taps
  for (int y = 0; y < (axis == 0 ? out_size : H); ++y)
    for (int x = 0; x < out_w; ++x) {
      const int i = axis == 0 ? y : x;  // the output position along the axis
      const int32_t* k = &t.weights[static_cast<size_t>(i) * t.width];
      const uint8_t* p = axis == 0 ? src + (static_cast<int64_t>(t.first[i]) * W + x) * C
                                   : src + (static_cast<int64_t>(y) * W + t.first[i]) * C;
      for (int c = 0; c < C; ++c) {
        int32_t sum = 1 << (kPrecisionBits - 1);  // rounds the final shift
        for (int n = 0; n < t.count[i]; ++n) sum += static_cast<int32_t>(p[n * step + c]) * k[n];
        dst[(static_cast<int64_t>(y) * out_w + x) * C + c] = clip8(sum);
      }
    }
  return out;
}

}  // namespace

ClipImagePreprocessing ClipImagePreprocessing::defaults(int64_t image_size) {
  ClipImagePreprocessing p;
  p.shortest_edge = p.crop_height = p.crop_width = image_size;
  return p;
}

ClipImagePreprocessing ClipImagePreprocessing::read(const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(io::read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw ClipVisionError("'" + path + "' is not valid JSON: " + e.what());
  } catch (const io::IoError& e) {
    throw ClipVisionError(e.what());
  }
  if (!j.is_object()) throw ClipVisionError("'" + path + "' is not a JSON object");
  ClipImagePreprocessing p;  // CLIPImageProcessor's class defaults for what the file leaves out
  p.do_resize = json_flag(j, "do_resize", p.do_resize, path);
  if (present(j, "size")) {
    const auto& size = j.at("size");
    if (size.is_number_integer()) {  // an old config: the shortest edge (CLIP does not default to square)
      p.shortest_edge = json_positive(j, "size", 0, path, "");
    } else if (size.is_object() && present(size, "shortest_edge") && !present(size, "longest_edge")) {
      p.shortest_edge = json_positive(size, "shortest_edge", 0, path, "size.");
    } else if (size.is_object() && present(size, "height") && present(size, "width") &&
               !present(size, "shortest_edge")) {
      p.shortest_edge = 0;
      p.resize_height = json_positive(size, "height", 0, path, "size.");
      p.resize_width = json_positive(size, "width", 0, path, "size.");
    } else {
      bad_json(path, "size",
               "{\"shortest_edge\": N} or {\"height\": H, \"width\": W} (longest_edge is not implemented)", size);
    }
  }
  if (present(j, "resample")) {
    const auto& v = j.at("resample");
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > 5)
      bad_json(path, "resample",
               "one of PIL's filters 1 LANCZOS, 2 BILINEAR, 3 BICUBIC, 4 BOX, 5 HAMMING (0 NEAREST is "
               "not implemented)",
               v);
    p.resample = v.get<int64_t>();
  }
  p.do_center_crop = json_flag(j, "do_center_crop", p.do_center_crop, path);
  if (present(j, "crop_size")) {
    const auto& crop = j.at("crop_size");
    if (crop.is_number_integer()) {
      p.crop_height = p.crop_width = json_positive(j, "crop_size", 0, path, "");
    } else if (crop.is_object() && present(crop, "height") && present(crop, "width")) {
      p.crop_height = json_positive(crop, "height", 0, path, "crop_size.");
      p.crop_width = json_positive(crop, "width", 0, path, "crop_size.");
    } else {
      bad_json(path, "crop_size", "{\"height\": H, \"width\": W} or an integer", crop);
    }
  }
  p.do_rescale = json_flag(j, "do_rescale", p.do_rescale, path);
  if (present(j, "rescale_factor")) {
    if (!j.at("rescale_factor").is_number()) bad_json(path, "rescale_factor", "a number", j.at("rescale_factor"));
    p.rescale_factor = j.at("rescale_factor").get<double>();
  }
  p.do_normalize = json_flag(j, "do_normalize", p.do_normalize, path);
  p.image_mean = json_triple(j, "image_mean", p.image_mean, path);
  p.image_std = json_triple(j, "image_std", p.image_std, path);
  for (double s : p.image_std)
    if (s == 0.0) bad_json(path, "image_std", "non-zero", j.at("image_std"));
  p.do_convert_rgb = json_flag(j, "do_convert_rgb", p.do_convert_rgb, path);
  return p;
}

std::pair<int64_t, int64_t> clip_resized_size(int64_t height, int64_t width, const ClipImagePreprocessing& p) {
  if (!p.do_resize) return {height, width};
  if (p.shortest_edge == 0) return {p.resize_height, p.resize_width};
  // transformers' get_resize_output_image_size(default_to_square=False): int(S * long / short), truncated
  // (the exact quotient of integers, which is what the float expression gives at image sizes).
  const int64_t short_edge = std::min(height, width), long_edge = std::max(height, width);
  const int64_t new_long = p.shortest_edge * long_edge / short_edge;
  return width <= height ? std::pair{new_long, p.shortest_edge} : std::pair{p.shortest_edge, new_long};
}

torch::Tensor resize_like_pil(const torch::Tensor& image, int64_t height, int64_t width, int64_t resample) {
  TORCH_CHECK(image.dim() == 3 && image.scalar_type() == torch::kUInt8 && image.size(2) >= 1 && image.size(2) <= 4,
              "resize_like_pil: expected a uint8 image [H, W, C] with 1 to 4 channels, got ", image.scalar_type(), " ",
              image.sizes());
  TORCH_CHECK(image.size(0) >= 1 && image.size(1) >= 1 && height >= 1 && width >= 1 && height < (1 << 24) &&
                  width < (1 << 24) && image.size(0) < (1 << 24) && image.size(1) < (1 << 24),
              "resize_like_pil: cannot resize ", image.sizes(), " to ", height, "x", width);
  const auto& filter = pil_filter(resample);
  auto out = image.to(torch::kCPU).contiguous();
  // PIL: the horizontal pass first, then the vertical, each only when that size changes.
  if (width != out.size(1)) out = pil_pass(out, 1, static_cast<int>(width), filter);
  if (height != out.size(0)) out = pil_pass(out, 0, static_cast<int>(height), filter);
  return out.data_ptr() == image.data_ptr() ? out.clone() : out;
}

torch::Tensor clip_preprocess(const torch::Tensor& image, const ClipImagePreprocessing& p) {
  TORCH_CHECK(image.dim() == 3 && image.size(2) == 3 && image.scalar_type() == torch::kUInt8,
              "clip_preprocess: expected a uint8 RGB image [H, W, 3], got ", image.scalar_type(), " ", image.sizes());
  TORCH_CHECK(image.size(0) >= 1 && image.size(1) >= 1, "clip_preprocess: the image is empty: ", image.sizes());
  auto img = image.to(torch::kCPU).contiguous();
  if (p.do_resize) {
    const auto [h, w] = clip_resized_size(img.size(0), img.size(1), p);
    TORCH_CHECK(h >= 1 && w >= 1, "clip_preprocess: resizing ", img.sizes(), " gives an empty image (", h, "x", w, ")");
    if (h != img.size(0) || w != img.size(1)) img = resize_like_pil(img, h, w, p.resample);
  }
  if (p.do_center_crop) {
    TORCH_CHECK(p.crop_height >= 1 && p.crop_width >= 1, "clip_preprocess: crop size ", p.crop_height, "x",
                p.crop_width);
    const int64_t H = img.size(0), W = img.size(1), ch = p.crop_height, cw = p.crop_width;
    auto floor_half = [](int64_t v) { return v >= 0 ? v / 2 : -((-v + 1) / 2); };  // Python's v // 2
    int64_t top = floor_half(H - ch), left = floor_half(W - cw);
    if (top >= 0 && left >= 0) {
      img = img.slice(0, top, top + ch).slice(1, left, left + cw);
    } else {  // transformers' center_crop: pad with zeros to at least the crop, centred (ceil), then crop
      const int64_t new_h = std::max(ch, H), new_w = std::max(cw, W);
      const int64_t top_pad = (new_h - H + 1) / 2, left_pad = (new_w - W + 1) / 2;
      auto canvas = torch::zeros({new_h, new_w, 3}, torch::kUInt8);
      canvas.slice(0, top_pad, top_pad + H).slice(1, left_pad, left_pad + W).copy_(img);
      top += top_pad, left += left_pad;
      img = canvas.slice(0, std::max<int64_t>(0, top), std::min(new_h, top + ch))
                .slice(1, std::max<int64_t>(0, left), std::min(new_w, left + cw));
    }
  }
  img = img.contiguous();
  const int64_t H = img.size(0), W = img.size(1);
  auto out = torch::empty({1, 3, H, W}, torch::kFloat32);
  const uint8_t* src = img.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  for (int64_t c = 0; c < 3; ++c) {
    // numpy: rescale multiplies in float64 and casts to float32; normalize subtracts and divides in float32.
    const float mean = static_cast<float>(p.image_mean[c]), std_dev = static_cast<float>(p.image_std[c]);
    for (int64_t i = 0; i < H * W; ++i) {
      const double u = src[i * 3 + c];
      float x = p.do_rescale ? static_cast<float>(u * p.rescale_factor) : static_cast<float>(u);
      if (p.do_normalize) x = (x - mean) / std_dev;
      dst[c * H * W + i] = x;
    }
  }
  return out;
}

// --- The encoder ------------------------------------------------------------------------------------------

namespace {

void validate(const ClipVisionConfig& c, const std::string& source) {
  auto positive = [&](const char* key, int64_t v) {
    if (v < 1) throw ClipVisionError("'" + source + "': \"" + key + "\" must be >= 1, got " + std::to_string(v));
  };
  positive("hidden_size", c.hidden_size);
  positive("intermediate_size", c.intermediate_size);
  positive("num_hidden_layers", c.num_hidden_layers);
  positive("num_attention_heads", c.num_attention_heads);
  positive("num_channels", c.num_channels);
  positive("image_size", c.image_size);
  positive("patch_size", c.patch_size);
  if (c.hidden_size % c.num_attention_heads != 0)
    throw ClipVisionError("'" + source + "': hidden_size " + std::to_string(c.hidden_size) +
                          " is not a multiple of num_attention_heads " + std::to_string(c.num_attention_heads));
  if (c.patch_size > c.image_size)
    throw ClipVisionError("'" + source + "': patch_size " + std::to_string(c.patch_size) +
                          " is larger than image_size " + std::to_string(c.image_size));
  if (!clip::supported_activation(c.hidden_act))
    throw ClipVisionError("'" + source + "': hidden_act \"" + c.hidden_act +
                          "\" is not supported (quick_gelu, gelu or gelu_new)");
}

ClipVisionConfig parse_config(const nlohmann::json& root, const std::string& source) {
  // A CLIPConfig nests the vision tower's settings under "vision_config"; a CLIPVisionConfig is flat.
  const nlohmann::json& j =
      root.contains("vision_config") && root.at("vision_config").is_object() ? root.at("vision_config") : root;
  ClipVisionConfig c;
  try {
    c.hidden_size = io::json_int(j, "hidden_size", c.hidden_size, source);
    c.intermediate_size = io::json_int(j, "intermediate_size", c.intermediate_size, source);
    c.num_hidden_layers = io::json_int(j, "num_hidden_layers", c.num_hidden_layers, source);
    c.num_attention_heads = io::json_int(j, "num_attention_heads", c.num_attention_heads, source);
    c.num_channels = io::json_int(j, "num_channels", c.num_channels, source);
    c.image_size = io::json_int(j, "image_size", c.image_size, source);
    c.patch_size = io::json_int(j, "patch_size", c.patch_size, source);
    c.hidden_act = io::json_string(j, "hidden_act", c.hidden_act, source);
    c.layer_norm_eps = io::json_real(j, "layer_norm_eps", c.layer_norm_eps, source);
  } catch (const io::PretrainedError& e) {
    throw ClipVisionError(e.what());
  }
  validate(c, source);
  return c;
}

// ComfyUI's configs for the widths it ships (comfy/clip_vision_config_{vitl,h,g}.json).
struct KnownWidth {
  int64_t width, heads;
  const char* act;
  const char* name;
};
constexpr KnownWidth kComfyWidths[] = {
    {1024, 16, "quick_gelu", "ViT-L/14"}, {1280, 16, "gelu", "ViT-H/14"}, {1664, 16, "gelu", "ViT-bigG/14"}};

[[noreturn]] void file_error(const std::string& path, const std::string& what) {
  throw ClipVisionError("'" + path + "': " + what);
}

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char ch) { return ch >= '0' && ch <= '9'; });
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

ClipVisionEncoder ClipVisionEncoder::load(const std::string& path, torch::Device device, torch::ScalarType dtype,
                                          const ClipVisionFileHints& hints, bool fp8) {
  try {
    if (io::is_directory(path)) {
      io::PretrainedFolder folder(path, {"model.safetensors", "model.fp16.safetensors"});
      const auto config = parse_config(folder.config(), io::join_path(path, "config.json"));
      // vision_model.<name> (transformers 4, a whole CLIPModel) or <name> (transformers 5's CLIPVisionModel).
      const std::string prefix = clip::tower_prefix(folder, "vision_model.", "embeddings.class_embedding");
      auto e = build(
          config, device, dtype,
          [&](const std::string& name, const std::vector<int64_t>& shape) {
            return folder.take(prefix + name, shape, dtype);
          },
          fp8);
      clip::refuse_extra_layers(folder, prefix, config.num_hidden_layers);
      for (const auto& candidate : {io::join_path(path, "preprocessor_config.json"),
                                    io::join_path(path, "../image_processor/preprocessor_config.json")})
        if (io::path_exists(candidate)) {
          e.preprocessing_ = ClipImagePreprocessing::read(candidate);
          e.preprocessing_source_ = candidate;
          break;
        }
      return e;
    }
    if (!io::path_exists(path))
      throw ClipVisionError("'" + path +
                            "': no such folder or file (expected diffusers' image_encoder/ folder or a "
                            "ComfyUI CLIP vision .safetensors file)");
    io::MappedWeights file(path);
    const std::string prefix = file.has("vision_model.embeddings.class_embedding") ? "vision_model." : "";
    auto bad = [&](const std::string& what) { file_error(path, what); };
    if (!file.has(prefix + "embeddings.class_embedding")) {
      if (file.has("visual.class_embedding") || file.has("visual.transformer.resblocks.0.attn.in_proj_weight"))
        bad("holds OpenCLIP's visual.* names, which are not read (expected transformers' vision_model.* names, as "
            "ComfyUI's clip_vision files have them)");
      bad("not a CLIP vision model: no tensor 'vision_model.embeddings.class_embedding'");
    }
    auto shape_of = [&](const std::string& name, size_t dims) -> const std::vector<int64_t>& {
      if (!file.has(prefix + name)) bad("no tensor '" + prefix + name + "'");
      const auto& s = file.shape(prefix + name);
      if (s.size() != dims)
        bad("tensor '" + prefix + name + "' has shape " + shape_string(s) + ", expected " + std::to_string(dims) +
            " dimensions");
      return s;
    };
    ClipVisionConfig c;
    c.hidden_size = shape_of("embeddings.class_embedding", 1)[0];
    const auto& conv = shape_of("embeddings.patch_embedding.weight", 4);
    c.num_channels = conv[1];
    c.patch_size = conv[2];
    if (conv[0] != c.hidden_size || conv[3] != conv[2])
      bad("tensor '" + prefix + "embeddings.patch_embedding.weight' has shape " + shape_string(conv) + ", expected [" +
          std::to_string(c.hidden_size) + ", channels, patch, patch] (square patches of the width of class_embedding)");
    const int64_t positions = shape_of("embeddings.position_embedding.weight", 2)[0];
    const auto grid =
        static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(std::max<int64_t>(positions - 1, 0)))));
    if (positions < 2 || grid * grid != positions - 1)
      bad("tensor '" + prefix + "embeddings.position_embedding.weight' has " + std::to_string(positions) +
          " positions, expected 1 + a square number of patches");
    c.image_size = grid * c.patch_size;
    // Layers: one past the largest index any encoder.layers.N.* tensor has (a gap is then a missing tensor).
    const std::string layers_prefix = prefix + "encoder.layers.";
    int64_t layers = 0;
    for (const auto& name : file.names())
      if (name.compare(0, layers_prefix.size(), layers_prefix) == 0) {
        const auto dot = name.find('.', layers_prefix.size());
        const auto index = name.substr(layers_prefix.size(), dot - layers_prefix.size());
        if (all_digits(index) && index.size() < 6) layers = std::max<int64_t>(layers, std::stoll(index) + 1);
      }
    if (layers == 0) bad("no tensor '" + layers_prefix + "0.mlp.fc1.weight' (no transformer layers)");
    c.num_hidden_layers = layers;
    c.intermediate_size = shape_of("encoder.layers.0.mlp.fc1.weight", 2)[0];
    c.layer_norm_eps = 1e-5;
    const KnownWidth* known = nullptr;
    for (const auto& k : kComfyWidths)
      if (k.width == c.hidden_size) known = &k;
    if (known == nullptr && (hints.num_attention_heads == 0 || hints.hidden_act.empty()))
      file_error(
          path,
          "a CLIP vision model of width " + std::to_string(c.hidden_size) +
              " (from 'embeddings.class_embedding') is none of the widths ComfyUI ships (ViT-L/14 1024, ViT-H/14 1280, "
              "ViT-bigG/14 1664): its number of attention heads and activation are unknown; pass them in "
              "ClipVisionFileHints");
    c.num_attention_heads = hints.num_attention_heads > 0 ? hints.num_attention_heads : known->heads;
    c.hidden_act = !hints.hidden_act.empty() ? hints.hidden_act : known->act;
    validate(c, path);
    const std::string context = "as the file's class_embedding, patch embedding, positions and fc1 imply";
    auto e = build(
        c, device, dtype,
        [&](const std::string& name, const std::vector<int64_t>& shape) {
          return file.take(prefix + name, shape, dtype, context);
        },
        fp8);
    e.preprocessing_ = ClipImagePreprocessing::defaults(c.image_size);
    return e;
  } catch (const io::PretrainedError& e) {
    throw ClipVisionError(e.what());
  }
}

ClipVisionEncoder ClipVisionEncoder::random(const ClipVisionConfig& config, uint64_t seed, torch::Device device,
                                            torch::ScalarType dtype) {
  validate(config, "ClipVisionEncoder::random's config");
  auto g = at::detail::createCPUGenerator(seed);
  auto e = build(config, device, dtype, [&](const std::string& name, const std::vector<int64_t>& shape) {
    if (shape.size() == 1 && name.find("class_embedding") == std::string::npos)
      return name.find("norm") != std::string::npos && name.substr(name.size() - 7) == ".weight"
                 ? torch::ones(shape, dtype)
                 : torch::zeros(shape, dtype);
    int64_t fan_in = 1;
    for (size_t i = 1; i < shape.size(); ++i) fan_in *= shape[i];
    const double scale = name.find("embedding") != std::string::npos && name.find("patch") == std::string::npos
                             ? 0.02
                             : 1.0 / std::sqrt(static_cast<double>(fan_in));
    return (torch::randn(shape, g, torch::kFloat32) * scale).to(dtype);
  });
  return e;
}

ClipVisionEncoder ClipVisionEncoder::build(const ClipVisionConfig& config, torch::Device device,
                                           torch::ScalarType dtype, const WeightSource& source, bool fp8) {
  ClipVisionEncoder e;
  e.config_ = config;
  e.preprocessing_ = ClipImagePreprocessing::defaults(config.image_size);
  e.device_ = device;
  e.dtype_ = dtype;
  e.fp8_ = fp8;
  const auto& c = e.config_;
  auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    clip::keep(e.w_, e.scale_, name, source(name, shape), fp8, device);
  };
  const int64_t D = c.hidden_size, F = c.intermediate_size;
  take("embeddings.class_embedding", {D});
  take("embeddings.patch_embedding.weight", {D, c.num_channels, c.patch_size, c.patch_size});
  take("embeddings.position_embedding.weight", {c.patches() + 1, D});
  take("pre_layrnorm.weight", {D});  // transformers' spelling
  take("pre_layrnorm.bias", {D});
  clip::take_encoder_layers(take, c.num_hidden_layers, D, F);
  return e;
}

int64_t ClipVisionEncoder::weight_bytes() const { return clip::stored_bytes(w_, scale_); }

int64_t ClipVisionEncoder::parameter_count() const {
  int64_t n = 0;
  for (const auto& [name, t] : w_) n += t.numel();
  return n;
}

torch::Tensor ClipVisionEncoder::hidden_state(const torch::Tensor& pixel_values, int64_t index) const {
  const auto& c = config_;
  TORCH_CHECK(pixel_values.dim() == 4 && pixel_values.size(0) >= 1 && pixel_values.size(1) == c.num_channels &&
                  pixel_values.size(2) == c.image_size && pixel_values.size(3) == c.image_size &&
                  pixel_values.is_floating_point(),
              "ClipVisionEncoder: expected floating pixel_values [B, ", c.num_channels, ", ", c.image_size, ", ",
              c.image_size, "], got ", pixel_values.scalar_type(), " ", pixel_values.sizes());
  const int64_t N = c.num_hidden_layers;
  TORCH_CHECK(index >= -(N + 1) && index <= N, "ClipVisionEncoder: hidden state ", index, " of a model with ", N,
              " layers (0 to ", N, ", or -", N + 1, " to -1)");
  if (index < 0) index += N + 1;
  torch::NoGradGuard no_grad;
  auto w = [this](const std::string& name) { return clip::stored(w_, scale_, name, dtype_); };
  const int64_t B = pixel_values.size(0), D = c.hidden_size, H = c.num_attention_heads;
  auto patches = at::conv2d(pixel_values.to(device_, dtype_), w("embeddings.patch_embedding.weight"), {},
                            {c.patch_size, c.patch_size})
                     .flatten(2)
                     .transpose(1, 2);  // [B, patches, D]
  auto h = torch::cat({w("embeddings.class_embedding").view({1, 1, D}).expand({B, 1, D}), patches}, 1) +
           w("embeddings.position_embedding.weight").unsqueeze(0);
  h = clip::layer_norm(h, w("pre_layrnorm.weight"), w("pre_layrnorm.bias"), c.layer_norm_eps);
  for (int64_t l = 0; l < index; ++l)
    h = clip::encoder_layer(h, l, w, H, c.hidden_act, c.layer_norm_eps, /*causal=*/false);
  return h.to(torch::kFloat32);
}

ClipVisionOutput ClipVisionEncoder::forward(const torch::Tensor& pixel_values) const {
  return {hidden_state(pixel_values, -2)};
}

torch::Tensor ClipVisionEncoder::encode(const torch::Tensor& image) const {
  return forward(clip_preprocess(image, preprocessing_)).penultimate;
}

torch::Tensor ClipVisionEncoder::encode(const std::vector<torch::Tensor>& images) const {
  TORCH_CHECK(!images.empty(), "ClipVisionEncoder::encode: no images");
  std::vector<torch::Tensor> pixel_values;
  for (const auto& image : images) pixel_values.push_back(clip_preprocess(image, preprocessing_));
  return forward(torch::cat(pixel_values, 0)).penultimate;
}

}  // namespace megaslide
