// fp8 base weights (io/fp8.h) against PyTorch and ComfyUI (tests/fixtures/fp8/, tools/make_fixtures.py
// fp8): the plain float8_e4m3fn cast is PyTorch's bit for bit on edge values (beyond ±448, ±inf, NaN,
// subnormals and their ties, negative zero) from float32, bf16 and fp16; every bit pattern dequantizes as
// PyTorch converts it; per-tensor scaling is ComfyUI's quantization bit for bit. Then ComfyUI's fp8 Wan
// files (the tiny fixture DiT "a" written as an *_fp8_e4m3fn file, an *_fp8_scaled file and ComfyUI's
// current weight_scale/comfy_quant format): every tensor reads back as its dequantized value bit for bit,
// the raw fp8 and its scale read back as written, the quantization tensors are not parameters, and a DiT
// loaded from them computes within fp8's error of the bf16 one. Bad fp8 files are refused by name.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <functional>
#include <iostream>
#include <map>

#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/io/fp8.h"
#include "megaslide/model/wan.h"
#include "megaslide/model/wan_weights.h"
#include "megaslide/offload/host_param_store.h"
#include "megaslide/offload/weight_streamer.h"
#include "error_checks.h"

using megaslide::dequantize_fp8;
using megaslide::Fp8Scaling;
using megaslide::Fp8Tensor;
using megaslide::quantize_fp8;
using megaslide::WanWeights;
using megaslide::WanWeightsError;

namespace {

const std::string kFixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures";

const std::map<std::string, torch::Tensor>& reference() {
  static const std::map<std::string, torch::Tensor> out = [] {
    std::map<std::string, torch::Tensor> m;
    for (auto& [name, t] : megaslide::io::read_safetensors(kFixtures + "/fp8/reference.safetensors").tensors)
      m[name] = t;
    return m;
  }();
  return out;
}

std::string temp_dir(const std::string& name) {
  auto d = "/tmp/megaslide-test-fp8-" + std::to_string(::getpid()) + "-" + name;
  megaslide::io::remove_tree(d);
  megaslide::io::make_directories(d);
  return d;
}

// Same dtype, shape and bytes (NaN payloads and the sign of zero included).
bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto bytes = [](const torch::Tensor& t) {
    return t.detach().to(torch::kCPU).contiguous().reshape({-1}).view(torch::kUInt8);
  };
  return torch::equal(bytes(a), bytes(b));
}

// The first element where the bytes differ, as "i: ours vs theirs" (float32 values), for failure messages.
std::string first_difference(const torch::Tensor& ours, const torch::Tensor& theirs) {
  const auto a = ours.detach().cpu().reshape({-1}), b = theirs.detach().cpu().reshape({-1});
  if (a.sizes() != b.sizes()) return "shapes differ";
  const auto size = a.element_size();
  const auto ab = a.contiguous().view(torch::kUInt8).view({-1, size}),
             bb = b.contiguous().view(torch::kUInt8).view({-1, size});
  for (int64_t i = 0; i < a.numel(); ++i)
    if (!torch::equal(ab[i], bb[i]))
      return "element " + std::to_string(i) + ": " + std::to_string(a[i].to(torch::kFloat32).item<float>()) + " vs " +
             std::to_string(b[i].to(torch::kFloat32).item<float>());
  return "none";
}

void expect_error(const std::function<void()>& f, const std::vector<std::string>& fragments) {
  megaslide::testing::expect_error_naming<WanWeightsError>(f, fragments);
}

}  // namespace

// The property: quantize_fp8(x, kNone) is PyTorch's x.to(torch.float8_e4m3fn) bit for bit — 448 the largest
// value, (448, 464] rounded down to it, beyond 464 and ±inf NaN, NaN's sign kept, subnormals and their
// ties to even, float32 subnormals to ±0, negative zero — from float32, bf16 and fp16, with scale 1.
TEST(Fp8, PlainCastIsPyTorchsBitForBit) {
  const auto& r = reference();
  for (const std::string key : {"f32", "bf16", "f16"}) {
    const auto& x = r.at("edge." + key);
    const auto& expected = r.at("edge." + key + ".e4m3fn");
    const Fp8Tensor q = quantize_fp8(x, Fp8Scaling::kNone);
    EXPECT_TRUE(same_bits(q.data, expected)) << key << ": " << first_difference(q.data, expected);
    EXPECT_TRUE(same_bits(q.scale, torch::ones({}, torch::kFloat32))) << key;
    EXPECT_TRUE(same_bits(x.to(torch::kFloat8_e4m3fn), expected)) << key << ": LibTorch's own cast";
  }
  // Spot checks that the fixture holds what the cast's rules say (0x7e = 448, 0x7f/0xff = NaN, 0x80 = -0).
  const auto bits = r.at("edge.f32.e4m3fn").view(torch::kUInt8);
  EXPECT_EQ(bits[1].item<int>(), 0x80);   // -0
  EXPECT_EQ(bits[4].item<int>(), 0x7e);   // 449 -> 448
  EXPECT_EQ(bits[9].item<int>(), 0x7f);   // 465 -> NaN
  EXPECT_EQ(bits[16].item<int>(), 0xff);  // -inf -> -NaN
}

// The property: every one of the 256 e4m3fn bit patterns dequantizes (scale 1, or no scale) to PyTorch's
// .to(float32) and .to(bfloat16) bit for bit, the two NaNs as NaNs (of their sign in float32).
TEST(Fp8, EveryBitPatternDequantizesAsPyTorch) {
  const auto& r = reference();
  const auto& every = r.at("every.e4m3fn");
  for (const bool with_scale : {false, true}) {
    const Fp8Tensor t{every, with_scale ? torch::ones({}, torch::kFloat32) : torch::Tensor()};
    for (const auto& [dtype, key] :
         {std::pair<torch::ScalarType, std::string>{torch::kFloat32, "every.e4m3fn.f32"},
          std::pair<torch::ScalarType, std::string>{torch::kBFloat16, "every.e4m3fn.bf16"}}) {
      const auto ours = dequantize_fp8(t, dtype);
      const auto& theirs = r.at(key);
      const auto nan = theirs.isnan();
      EXPECT_TRUE(torch::equal(ours.isnan(), nan)) << key;
      // NaN's sign survives into float32; PyTorch's conversions of a NaN to bf16 write 0x7fc0 (fp8 -> bf16
      // directly) or 0xffff (float32 -> bf16, vectorized): only NaN-ness is compared there.
      if (dtype == torch::kFloat32) EXPECT_TRUE(torch::equal(ours.signbit(), theirs.signbit())) << key;
      EXPECT_TRUE(same_bits(ours.masked_fill(nan, 0), theirs.masked_fill(nan, 0)))
          << key << ": " << first_difference(ours, theirs);
    }
  }
  EXPECT_EQ(r.at("every.e4m3fn.f32").isnan().sum().item<int64_t>(), 2);
}

// The property: per-tensor scaling is ComfyUI's (TensorCoreFP8Layout.quantize: scale = amax/448 in the
// weight's dtype, data = (w · (1/scale) in the weight's dtype) cast) bit for bit for float32 and bf16
// weights, and for fp16 weights as their float32 values; the plain cast's and the scaled form's
// dequantized float32 and bf16 are PyTorch's data.float() * scale bit for bit.
TEST(Fp8, PerTensorScalingIsComfyUIsBitForBit) {
  const auto& r = reference();
  for (const std::string key : {"f32", "bf16", "f16"}) {
    const std::string k = "random." + key;
    const auto& w = r.at(k);
    const Fp8Tensor cast = quantize_fp8(w, Fp8Scaling::kNone);
    EXPECT_TRUE(same_bits(cast.data, r.at(k + ".cast"))) << k << ": " << first_difference(cast.data, r.at(k + ".cast"));
    EXPECT_TRUE(same_bits(dequantize_fp8(cast), r.at(k + ".cast.f32"))) << k;

    const Fp8Tensor scaled = quantize_fp8(w, Fp8Scaling::kPerTensor);
    EXPECT_TRUE(same_bits(scaled.scale, r.at(k + ".scale")))
        << k << ": scale " << scaled.scale.item<float>() << " vs " << r.at(k + ".scale").item<float>();
    EXPECT_TRUE(same_bits(scaled.data, r.at(k + ".scaled")))
        << k << ": " << first_difference(scaled.data, r.at(k + ".scaled"));
    EXPECT_TRUE(same_bits(dequantize_fp8(scaled, torch::kFloat32), r.at(k + ".scaled.f32"))) << k;
    EXPECT_TRUE(same_bits(dequantize_fp8(scaled, torch::kBFloat16), r.at(k + ".scaled.bf16"))) << k;
    // Per-tensor scaling uses e4m3fn's range: the largest |data| is 448 (or just below, by rounding).
    EXPECT_GE(scaled.data.to(torch::kFloat32).abs().max().item<float>(), 416.0f) << k;
    // And it is the more precise of the two: within half a step of 3 mantissa bits of amax (2^-4 · amax/448
    // · 2^8 at the top binade) for every element, which the plain cast is not for small weights.
    const auto error = (dequantize_fp8(scaled) - w.to(torch::kFloat32)).abs().max().item<double>();
    const auto amax = w.to(torch::kFloat32).abs().max().item<double>();
    EXPECT_LE(error, amax / 16) << k;
  }
}

// The property: an all-zero weight gets scale 1 (ComfyUI's recipe would divide by zero), per-tensor
// scaling refuses a weight with a NaN or an infinity (they would make every element NaN), and
// dequantize_fp8 refuses what is not fp8 data with one scale.
TEST(Fp8, DegenerateInputsAreHandledOrRefused) {
  const auto zeros = torch::zeros({3, 5}, torch::kBFloat16);
  const Fp8Tensor q = quantize_fp8(zeros, Fp8Scaling::kPerTensor);
  EXPECT_EQ(q.scale.item<float>(), 1.0f);
  EXPECT_TRUE(same_bits(q.data, torch::zeros({3, 5}).to(torch::kFloat8_e4m3fn)));
  const Fp8Tensor empty = quantize_fp8(torch::empty({0, 4}), Fp8Scaling::kPerTensor);
  EXPECT_EQ(empty.data.sizes(), (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(empty.scale.item<float>(), 1.0f);

  auto broken = torch::randn({4, 4});
  broken[1][2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(quantize_fp8(broken, Fp8Scaling::kPerTensor), c10::Error);
  broken[1][2] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(quantize_fp8(broken, Fp8Scaling::kPerTensor), c10::Error);
  EXPECT_EQ(quantize_fp8(broken, Fp8Scaling::kNone).data.view(torch::kUInt8)[1][2].item<int>(), 0x7f)
      << "the plain cast is PyTorch's: +inf becomes NaN";
  EXPECT_THROW(quantize_fp8(torch::ones({2}, torch::kInt32), Fp8Scaling::kNone), c10::Error);

  const auto data = torch::ones({2, 3}).to(torch::kFloat8_e4m3fn);
  EXPECT_THROW(dequantize_fp8({torch::ones({2, 3}), torch::ones({})}), c10::Error);
  EXPECT_THROW(dequantize_fp8({data, torch::ones({2})}), c10::Error) << "a per-row scale";
  EXPECT_THROW(dequantize_fp8({data, torch::ones({})}, torch::kInt32), c10::Error);
  // A one-element scale of another dtype or shape is per-tensor; e5m2 data dequantizes too.
  EXPECT_TRUE(same_bits(dequantize_fp8({data, torch::full({1}, 0.5, torch::kBFloat16)}), torch::full({2, 3}, 0.5f)));
  EXPECT_TRUE(same_bits(dequantize_fp8({torch::full({2}, -3.0).to(torch::kFloat8_e5m2), torch::Tensor()}),
                        torch::full({2}, -3.0f)));
}

// The property: on a GPU the cast, the scaling and the dequantization are the CPU's (PyTorch's) bit for bit.
TEST(Fp8, CastAndScalingOnTheGpuAreTheCpus_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto& r = reference();
  for (const std::string key : {"f32", "bf16", "f16"}) {
    const auto cast = quantize_fp8(r.at("edge." + key).cuda(), Fp8Scaling::kNone);
    EXPECT_TRUE(cast.data.is_cuda() && cast.scale.is_cuda());
    EXPECT_TRUE(same_bits(cast.data, r.at("edge." + key + ".e4m3fn"))) << key;
    const std::string k = "random." + key;
    const auto scaled = quantize_fp8(r.at(k).cuda(), Fp8Scaling::kPerTensor);
    EXPECT_TRUE(same_bits(scaled.data, r.at(k + ".scaled"))) << k;
    EXPECT_TRUE(same_bits(scaled.scale, r.at(k + ".scale"))) << k;
    const auto dequantized = dequantize_fp8(scaled, torch::kFloat32);
    EXPECT_TRUE(dequantized.is_cuda());
    EXPECT_TRUE(same_bits(dequantized, r.at(k + ".scaled.f32"))) << k;
  }
}

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The tiny Wan DiT "a" (tests/fixtures/wan/a/comfyui.safetensors: bf16, original names with ComfyUI's
// model.diffusion_model. prefix) written as one of ComfyUI's fp8 layouts. `fp8` keeps, by file name, each
// fp8 tensor as written (data and float32 scale).
enum class ComfyFp8 { kE4m3fn, kScaled, kCurrent };
struct Fp8File {
  std::string path;
  std::map<std::string, Fp8Tensor> fp8;
};

Fp8File write_comfy_fp8(const std::string& dir, ComfyFp8 layout) {
  const std::string prefix = "model.diffusion_model.";
  const auto source = megaslide::io::read_safetensors(kFixtures + "/wan/a/comfyui.safetensors");
  Fp8File out;
  megaslide::io::NamedTensors tensors;
  for (const auto& [prefixed, t] : source.tensors) {
    const std::string name = prefixed.substr(prefix.size());
    const bool linear_weight = t.dim() == 2 && ends_with(name, ".weight");
    // Written without the prefix in ComfyUI's current format (either is read).
    const std::string file_name = layout == ComfyFp8::kCurrent ? name : prefixed;
    const std::string layer = file_name.substr(0, file_name.rfind('.'));
    if (layout == ComfyFp8::kE4m3fn) {
      // The linear weights (and, as in some published fp8 files, a few biases) cast; modulation in fp32.
      if (linear_weight || ends_with(name, "ffn.0.bias")) {
        const Fp8Tensor q = quantize_fp8(t, Fp8Scaling::kNone);
        tensors.emplace_back(file_name, q.data);
        out.fp8[file_name] = q;
      } else {
        tensors.emplace_back(file_name, ends_with(name, "modulation") ? t.to(torch::kFloat32) : t);
      }
      continue;
    }
    // Scaled: the blocks' linear weights, each with its per-tensor scale.
    if (!(linear_weight && name.rfind("blocks.", 0) == 0)) {
      tensors.emplace_back(file_name, t);
      continue;
    }
    Fp8Tensor q = quantize_fp8(t, Fp8Scaling::kPerTensor);
    tensors.emplace_back(file_name, q.data);
    const bool bf16_scale = name == "blocks.1.ffn.2.weight";  // as other tools write it: one BF16 value, [1]
    const auto scale = bf16_scale ? q.scale.to(torch::kBFloat16).reshape({1}) : q.scale;
    q.scale = scale.to(torch::kFloat32).reshape({});
    out.fp8[file_name] = q;
    if (layout == ComfyFp8::kScaled) {
      tensors.emplace_back(layer + ".scale_weight", scale);
      if (name.rfind("blocks.0.", 0) == 0) tensors.emplace_back(layer + ".scale_input", torch::ones({}));
    } else {
      tensors.emplace_back(layer + ".weight_scale", scale);
      const std::string conf = R"({"format": "float8_e4m3fn"})";
      tensors.emplace_back(
          layer + ".comfy_quant",
          torch::from_blob(const_cast<char*>(conf.data()), {static_cast<int64_t>(conf.size())}, torch::kUInt8).clone());
      if (name.rfind("blocks.0.", 0) == 0) tensors.emplace_back(layer + ".input_scale", torch::full({}, 0.5f));
    }
  }
  if (layout == ComfyFp8::kScaled)
    tensors.emplace_back(prefix + "scaled_fp8", torch::empty({0}, torch::kFloat8_e4m3fn));
  const char* names[] = {"wan2.1_t2v_tiny_fp8_e4m3fn.safetensors", "wan2.1_t2v_tiny_fp8_scaled.safetensors",
                         "wan2.1_t2v_tiny_comfy_quant.safetensors"};
  out.path = megaslide::io::join_path(dir, names[static_cast<int>(layout)]);
  megaslide::io::write_safetensors(out.path, tensors, {{"format", "pt"}});
  return out;
}

// Fixture "a"'s hyper-parameters (tools/make_fixtures.py _WAN_MODELS), read back from the shapes.
megaslide::WanTransformer load_fixture_a(const std::string& path) {
  auto weights = WanWeights::open(path);
  megaslide::WanConfig fallback;
  fallback.heads = 2;
  fallback.eps = 1e-6;
  const auto c = weights.architecture(fallback);
  EXPECT_EQ(c.dim, 24) << path;
  EXPECT_EQ(c.layers, 2) << path;
  EXPECT_EQ(c.ffn_dim, 40) << path;
  EXPECT_TRUE(c.qk_norm && c.cross_attn_norm) << path;
  megaslide::WanTransformer model(megaslide::WanOptions()
                                      .dim(c.dim)
                                      .layers(c.layers)
                                      .heads(c.heads)
                                      .ffn_dim(c.ffn_dim)
                                      .freq_dim(c.freq_dim)
                                      .text_dim(c.text_dim)
                                      .patch(c.patch)
                                      .in_channels(c.in_channels)
                                      .out_channels(c.out_channels)
                                      .qk_norm(c.qk_norm)
                                      .cross_attn_norm(c.cross_attn_norm)
                                      .eps(c.eps));
  EXPECT_TRUE(megaslide::load_wan_weights(weights, *model).empty()) << path;
  return model;
}

}  // namespace

// The property: ComfyUI's fp8 Wan files load: every tensor WanWeights reads (as float32 and as bf16) is its
// dequantized value, data.float() · scale, bit for bit, and every other tensor is the bf16 file's; is_fp8
// and read_fp8 give the stored data and scale as written; the names and shapes are the bf16 file's (the
// scales, activation scales, formats and the scaled_fp8 marker are not parameters); and the DiT loaded
// from them computes within fp8's error of the one loaded from the bf16 file.
TEST(Fp8, ComfyUIFp8WanFilesReadAsTheirDequantizedValues) {
  const auto dir = temp_dir("wan");
  const auto bf16 = WanWeights::open(kFixtures + "/wan/a/comfyui.safetensors");
  auto reference_model = load_fixture_a(kFixtures + "/wan/a/comfyui.safetensors");
  std::map<std::string, torch::Tensor> wan;
  for (auto& [name, t] : megaslide::io::read_safetensors(kFixtures + "/wan/reference.safetensors").tensors)
    wan[name] = t;
  torch::NoGradGuard no_grad;
  const auto expected_out = reference_model->forward(wan.at("a.x"), wan.at("a.timesteps"), wan.at("a.text"));

  for (const auto layout : {ComfyFp8::kE4m3fn, ComfyFp8::kScaled, ComfyFp8::kCurrent}) {
    const Fp8File file = write_comfy_fp8(dir, layout);
    SCOPED_TRACE(file.path);
    const auto weights = WanWeights::open(file.path);
    EXPECT_EQ(weights.names(), bf16.names());
    size_t fp8_count = 0;
    for (const auto& name : weights.names()) {
      EXPECT_EQ(weights.shape(name), bf16.shape(name)) << name;
      const std::string original = megaslide::wan_original_name(name);
      const std::string file_name = (layout == ComfyFp8::kCurrent ? "" : "model.diffusion_model.") + original;
      const auto it = file.fp8.find(file_name);
      ASSERT_EQ(weights.is_fp8(name), it != file.fp8.end()) << name;
      if (it == file.fp8.end()) {
        // Not fp8: what the bf16 file holds (modulation written as fp32 holds the same values).
        EXPECT_TRUE(same_bits(weights.read(name, torch::kFloat32), bf16.read(name, torch::kFloat32))) << name;
        expect_error([&] { weights.read_fp8(name); }, {file.path, original, "not fp8"});
        continue;
      }
      ++fp8_count;
      const Fp8Tensor& written = it->second;
      const auto dequantized = written.data.to(torch::kFloat32) * written.scale;
      EXPECT_TRUE(same_bits(weights.read(name, torch::kFloat32), dequantized))
          << name << ": " << first_difference(weights.read(name, torch::kFloat32), dequantized);
      EXPECT_TRUE(same_bits(weights.read(name, torch::kBFloat16), dequantized.to(torch::kBFloat16))) << name;
      const Fp8Tensor raw = weights.read_fp8(name);
      EXPECT_TRUE(same_bits(raw.data, written.data)) << name;
      EXPECT_TRUE(same_bits(raw.scale, written.scale)) << name;
      EXPECT_EQ(raw.scale.dim(), 0) << name;
    }
    EXPECT_EQ(fp8_count, file.fp8.size());
    // Fixture "a": 2 blocks of 10 linear layers, 6 more outside (time and text embeddings' two each, the
    // time projection, the head); the e4m3fn file also casts the blocks' 2 ffn.0 biases.
    EXPECT_EQ(fp8_count, layout == ComfyFp8::kE4m3fn ? 2u * 10 + 6 + 2 : 2u * 10);

    auto model = load_fixture_a(file.path);
    const auto out = model->forward(wan.at("a.x"), wan.at("a.timesteps"), wan.at("a.text"));
    const double scale = std::max(1.0, expected_out.abs().max().item<double>());
    const double error = (out - expected_out).abs().max().item<double>() / scale;
    std::cout << file.path << ": largest difference from the bf16 file's DiT " << error << " (of " << scale << ")\n";
    // e4m3 keeps 3 mantissa bits: each weight within 2^-4 of itself relative (per-tensor scaling), errors
    // that partly cancel through the layers' sums; the plain cast also flushes weights below 2^-10 to zero
    // and keeps 1-2 bits below 2^-6. Measured 0.042 (plain cast) and 0.025 (scaled) of the outputs' largest
    // magnitude on this model; the bounds are three times that.
    EXPECT_LT(error, layout == ComfyFp8::kE4m3fn ? 0.12 : 0.075);
    EXPECT_GT(error, 0.0) << "fp8 changes the weights";
  }
  megaslide::io::remove_tree(dir);
}

// The property: the scaled_fp8 marker is not a parameter, with ComfyUI's prefix or without it beside
// prefixed tensors (the prefix is still recognised), and whatever its dtype (fp8, or F32 / BF16 zeros).
TEST(Fp8, ScaledFp8MarkerIsNotAParameter) {
  const auto dir = temp_dir("marker");
  const auto source = megaslide::io::read_safetensors(kFixtures + "/wan/a/comfyui.safetensors");
  const auto bf16 = WanWeights::open(kFixtures + "/wan/a/comfyui.safetensors");
  for (const auto& [name, marker] : {std::pair<std::string, torch::Tensor>{"model.diffusion_model.scaled_fp8",
                                                                           torch::empty({0}, torch::kFloat8_e4m3fn)},
                                     {"scaled_fp8", torch::zeros({2}, torch::kFloat32)},
                                     {"scaled_fp8", torch::zeros({}, torch::kBFloat16)}}) {
    auto tensors = source.tensors;
    tensors.emplace_back(name, marker);
    const auto path = megaslide::io::join_path(dir, "marked.safetensors");
    megaslide::io::write_safetensors(path, tensors);
    const auto weights = WanWeights::open(path);
    EXPECT_EQ(weights.names(), bf16.names()) << name;
    EXPECT_FALSE(weights.has("scaled_fp8")) << name;
    load_fixture_a(path);  // check(): nothing unexpected
  }
  megaslide::io::remove_tree(dir);
}

// The property: fp8 files MegaSlide cannot read as they say are refused naming the file and the tensor: a
// scale without its weight, a scale on a weight that is not fp8, a per-row scale, a layer in another of
// ComfyUI's formats, fp8 data holding a NaN (unless non-finite weights are allowed).
TEST(Fp8, BadFp8WanFilesAreNamed) {
  const auto dir = temp_dir("bad");
  const auto source = megaslide::io::read_safetensors(kFixtures + "/wan/a/comfyui.safetensors");
  const std::string q = "model.diffusion_model.blocks.0.self_attn.q";
  // The bf16 file with `edit` applied to its tensors (by name), written as `name`.
  const auto variant = [&](const std::string& name,
                           const std::function<void(std::map<std::string, torch::Tensor>&)>& edit) {
    std::map<std::string, torch::Tensor> tensors(source.tensors.begin(), source.tensors.end());
    edit(tensors);
    const auto path = megaslide::io::join_path(dir, name);
    megaslide::io::write_safetensors(path, megaslide::io::NamedTensors(tensors.begin(), tensors.end()));
    return path;
  };
  const auto fp8_q = [&](std::map<std::string, torch::Tensor>& t) {
    t[q + ".weight"] = quantize_fp8(t[q + ".weight"], Fp8Scaling::kNone).data;
  };

  auto path = variant("orphan.safetensors", [&](auto& t) { t[q + "x.scale_weight"] = torch::ones({}); });
  expect_error([&] { WanWeights::open(path); }, {path, q + "x.scale_weight", "no weight"});
  path = variant("not_fp8.safetensors", [&](auto& t) { t[q + ".scale_weight"] = torch::ones({}); });
  expect_error([&] { WanWeights::open(path); }, {path, q + ".weight", "has a scale", "BF16, not fp8"});
  path = variant("per_row.safetensors", [&](auto& t) {
    fp8_q(t);
    t[q + ".scale_weight"] = torch::ones({24, 1});
  });
  expect_error([&] { WanWeights::open(path); }, {path, q + ".scale_weight", "[24, 1]", "per-tensor"});
  path = variant("nvfp4.safetensors", [&](auto& t) {
    const std::string conf = R"({"format": "nvfp4"})";
    t[q + ".comfy_quant"] =
        torch::from_blob(const_cast<char*>(conf.data()), {static_cast<int64_t>(conf.size())}, torch::kUInt8).clone();
  });
  expect_error([&] { WanWeights::open(path); }, {path, "blocks.0.self_attn.q", "nvfp4"});

  path = variant("nan.safetensors", [&](auto& t) {
    fp8_q(t);
    t[q + ".weight"].view(torch::kUInt8)[3][5] = 0xff;  // -NaN
    t[q + ".scale_weight"] = torch::full({}, 0.5f);
  });
  const auto weights = WanWeights::open(path);
  EXPECT_TRUE(weights.is_fp8("blocks.0.attn1.to_q.weight"));
  expect_error([&] { weights.read("blocks.0.attn1.to_q.weight"); }, {path, q + ".weight", "NaN"});
  expect_error([&] { weights.read_fp8("blocks.0.attn1.to_q.weight"); },
               {path, q + ".weight", "NaN", "element " + std::to_string(3 * 24 + 5)});
  expect_error([&] { weights.is_fp8("blocks.0.attn1.to_x.weight"); }, {"no tensor"});
  megaslide::io::remove_tree(dir);
}

// The property: a frozen fp8 host store (LoRA's base, lora.base_dtype: fp8) filled from ComfyUI's fp8 Wan
// files keeps the weights the file gives: every parameter of a block, upcast as the trainer upcasts it on
// the device, is the file's value bit for bit — the matrices as fp8 (the plain e4m3fn file's bytes stored as
// they are with scale 1, the scaled files' through a per-tensor scale that reproduces them), the vectors
// (biases, norm weights) kept exact in fp32 — in 1 B per element plus a 4 B scale per tensor and the vectors'
// 4 B.
TEST(Fp8, FrozenStoreKeepsAnFp8FilesWeightsBitForBit) {
  const auto dir = temp_dir("store");
  for (const auto layout : {ComfyFp8::kE4m3fn, ComfyFp8::kScaled, ComfyFp8::kCurrent}) {
    const Fp8File file = write_comfy_fp8(dir, layout);
    SCOPED_TRACE(file.path);
    const auto weights = WanWeights::open(file.path);
    std::vector<megaslide::offload::BlockSpec> specs;
    for (int64_t l = 0; l < 2; ++l) {  // fixture a's two blocks, their streamed matrices and biases
      megaslide::offload::BlockSpec spec{"blocks." + std::to_string(l), {}};
      for (const auto& name : weights.names())
        if (name.rfind(spec.name + ".", 0) == 0 && name.find("scale_shift_table") == std::string::npos &&
            name.find("norm2") == std::string::npos)
          spec.params.push_back({name.substr(spec.name.size() + 1), weights.shape(name)});
      specs.push_back(std::move(spec));
    }
    megaslide::offload::HostParamStoreOptions options;
    options.frozen = true;
    options.frozen_dtype = at::kFloat8_e4m3fn;
    megaslide::offload::HostParamStore store(specs, options);
    int64_t tensors = 0;
    for (int64_t l = 0; l < 2; ++l)
      for (const auto& p : specs[l].params) {
        store.set_param(l, p.name, weights.read(specs[l].name + "." + p.name, torch::kFloat32));
        ++tensors;
      }
    const auto report = store.memory_report();
    EXPECT_GT(report.exact_bytes, 0);
    EXPECT_EQ(report.total_bytes(), report.num_params + 4 * tensors + report.exact_bytes);
    for (int64_t l = 0; l < 2; ++l) {
      std::vector<int64_t> offsets, sizes;
      std::vector<torch::Tensor> exact;
      for (const auto& p : specs[l].params) {
        const auto views = store.param(l, p.name);
        offsets.push_back(views.offset);
        sizes.push_back(views.compute.numel());
        exact.push_back(views.exact);
        EXPECT_EQ(views.exact.defined(), p.shape.size() < 2) << p.name << ": vectors are kept exact, matrices as fp8";
      }
      auto upcast = torch::empty({store.block_numel(l)}, torch::kFloat32);
      megaslide::offload::upcast_fp8_block(store.compute(l), upcast, offsets, sizes, store.scales(l), exact);
      for (size_t i = 0; i < specs[l].params.size(); ++i) {
        const std::string name = specs[l].name + "." + specs[l].params[i].name;
        const auto expected = weights.read(name, torch::kFloat32).reshape({-1});
        EXPECT_TRUE(same_bits(upcast.narrow(0, offsets[i], sizes[i]), expected))
            << name << ": " << first_difference(upcast.narrow(0, offsets[i], sizes[i]), expected);
        if (layout == ComfyFp8::kE4m3fn && weights.is_fp8(name) && specs[l].params[i].shape.size() >= 2) {
          EXPECT_TRUE(same_bits(store.param(l, specs[l].params[i].name).compute, weights.read_fp8(name).data)) << name;
          EXPECT_EQ(store.scales(l)[static_cast<int64_t>(i)].item<float>(), 1.f) << name;
        }
      }
    }
  }
  megaslide::io::remove_tree(dir);
}
