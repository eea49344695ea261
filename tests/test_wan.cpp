// Wan2.1's DiT against diffusers' WanTransformer3DModel on two tiny random models of non-default sizes
// (tests/fixtures/wan/, tools/make_fixtures.py wan): "a" with qk-norm and the cross-attention norm, "b"
// with neither; each read from the diffusers layout (config.json, two fp32 shards, index), Wan-AI's
// original layout (Wan's config.json, original names, bf16 / fp16) and, for "a", ComfyUI's single file
// (model.diffusion_model. prefix, no config.json). Also: one flow-matching training step's gradients
// against PyTorch autograd, the published models' parameter counts, the rename table, bad weights named
// in the errors, the 3D-DSA retrofit (neighbourhood attention at step 0, a dense checkpoint loads with
// only the DSA parameters missing), and real weights when MEGASLIDE_WAN_WEIGHTS points at a download.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/wan.h"
#include "megaslide/model/wan_weights.h"
#include "error_checks.h"

using megaslide::WanConfig;
using megaslide::WanOptions;
using megaslide::WanTransformer;
using megaslide::WanWeights;
using megaslide::WanWeightsError;

namespace {

const std::string kFixtures = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/wan";

const std::map<std::string, torch::Tensor>& reference() {
  static const std::map<std::string, torch::Tensor> out = [] {
    std::map<std::string, torch::Tensor> m;
    for (auto& [name, t] : megaslide::io::read_safetensors(kFixtures + "/reference.safetensors").tensors) m[name] = t;
    return m;
  }();
  return out;
}

std::string temp_dir(const std::string& name) {
  auto d = "/tmp/megaslide-test-wan-" + std::to_string(::getpid()) + "-" + name;
  megaslide::io::remove_tree(d);
  megaslide::io::make_directories(d);
  return d;
}

// max |ours − reference| ≤ tolerance · max(1, max |reference|), in float64.
double relative_error(const torch::Tensor& ours, const torch::Tensor& ref) {
  const double scale = std::max(1.0, ref.abs().max().item<double>());
  return (ours.to(torch::kFloat64) - ref.to(torch::kFloat64)).abs().max().item<double>() / scale;
}

// The fixture's hyper-parameters (tools/make_fixtures.py _WAN_MODELS).
WanConfig fixture_config(const std::string& key) {
  WanConfig c;
  if (key == "a") {
    c.dim = 24, c.heads = 2, c.layers = 2, c.ffn_dim = 40, c.freq_dim = 16, c.text_dim = 20, c.patch = {1, 2, 2};
    c.in_channels = c.out_channels = 4, c.qk_norm = true, c.cross_attn_norm = true, c.eps = 1e-6;
  } else {
    c.dim = 24, c.heads = 3, c.layers = 3, c.ffn_dim = 20, c.freq_dim = 10, c.text_dim = 12, c.patch = {2, 1, 2};
    c.in_channels = c.out_channels = 3, c.qk_norm = false, c.cross_attn_norm = false, c.eps = 1e-5;
  }
  return c;
}

WanOptions options_of(const WanConfig& c) {
  return WanOptions()
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
      .eps(c.eps)
      .image_dim(c.image_dim);
}

void expect_same_architecture(const WanConfig& a, const WanConfig& b, const std::string& where) {
  EXPECT_EQ(a.dim, b.dim) << where;
  EXPECT_EQ(a.heads, b.heads) << where;
  EXPECT_EQ(a.layers, b.layers) << where;
  EXPECT_EQ(a.ffn_dim, b.ffn_dim) << where;
  EXPECT_EQ(a.freq_dim, b.freq_dim) << where;
  EXPECT_EQ(a.text_dim, b.text_dim) << where;
  EXPECT_EQ(a.patch, b.patch) << where;
  EXPECT_EQ(a.in_channels, b.in_channels) << where;
  EXPECT_EQ(a.out_channels, b.out_channels) << where;
  EXPECT_EQ(a.qk_norm, b.qk_norm) << where;
  EXPECT_EQ(a.cross_attn_norm, b.cross_attn_norm) << where;
}

// The model the weights at `path` describe, loaded (heads from `heads` when there is no config.json).
WanTransformer load(const std::string& path, const std::string& key, WanOptions extra = WanOptions()) {
  auto weights = WanWeights::open(path);
  WanConfig fallback;
  fallback.heads = fixture_config(key).heads;
  fallback.eps = fixture_config(key).eps;
  const WanConfig c = weights.architecture(fallback);
  expect_same_architecture(c, fixture_config(key), path);
  auto options = options_of(c).self_attention(extra.self_attention()).dsa_kernel(extra.dsa_kernel());
  torch::manual_seed(0);
  WanTransformer model(options);
  const auto kept = megaslide::load_wan_weights(weights, *model,
                                                options.self_attention() == megaslide::WanSelfAttention::kDsa3d
                                                    ? megaslide::wan_dsa_parameter_globs()
                                                    : std::vector<std::string>{});
  if (options.self_attention() == megaslide::WanSelfAttention::kDense) EXPECT_TRUE(kept.empty());
  return model;
}

std::vector<std::pair<std::string, std::string>> layouts(const std::string& key) {
  std::vector<std::pair<std::string, std::string>> out{
      {"diffusers layout (sharded fp32)", kFixtures + "/" + key + "/diffusers"},
      {"diffusers transformer/ folder", kFixtures + "/" + key + "/diffusers/transformer"},
      {"original layout", kFixtures + "/" + key + "/original"},
  };
  if (key == "a") out.push_back({"ComfyUI single file", kFixtures + "/a/comfyui.safetensors"});
  return out;
}

}  // namespace

// The property: for every layout, the C++ forward of the loaded model is diffusers' forward within 1e-4
// (fp32) at fractional timesteps, on a grid with three distinct sides.
TEST(WanTransformer, OutputsAreDiffusersOnTinyModelsInEveryLayout) {
  const auto& r = reference();
  for (const std::string key : {"a", "b"}) {
    for (const auto& [what, path] : layouts(key)) {
      auto model = load(path, key);
      torch::NoGradGuard no_grad;
      auto out = model->forward(r.at(key + ".x"), r.at(key + ".timesteps"), r.at(key + ".text"));
      ASSERT_EQ(out.sizes(), r.at(key + ".out").sizes());
      const double error = relative_error(out, r.at(key + ".out"));
      std::cout << "model " << key << ", " << what << ": largest difference " << error << "\n";
      EXPECT_LT(error, 1e-4) << key << " " << what;
    }
  }
}

// The property: one flow-matching training step's loss and every parameter's gradient equal PyTorch
// autograd's on diffusers' model within 1e-4 of the gradient's scale.
TEST(WanTransformer, TrainingStepGradientsAreAutogradsOnDiffusers) {
  const auto& r = reference();
  for (const std::string key : {"a", "b"}) {
    auto model = load(kFixtures + "/" + key + "/diffusers", key);
    const auto x0 = r.at(key + ".train.x0"), noise = r.at(key + ".train.noise"), sigma = r.at(key + ".train.sigma");
    const auto s = sigma.view({-1, 1, 1, 1, 1});
    auto prediction = model->forward((1 - s) * x0 + s * noise, sigma * 1000, r.at(key + ".text"));
    auto loss = torch::mse_loss(prediction, noise - x0);
    loss.backward();
    EXPECT_NEAR(loss.item<double>(), r.at(key + ".train.loss").item<double>(),
                1e-5 * r.at(key + ".train.loss").item<double>());
    double worst = 0.0;
    std::string worst_name;
    int64_t compared = 0;
    for (const auto& p : model->named_parameters(true)) {
      const auto& ref = r.at(key + ".grad." + p.key());
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      const double error = relative_error(p.value().grad(), ref);
      if (error > worst) worst = error, worst_name = p.key();
      EXPECT_LT(error, 1e-4) << key << " " << p.key();
      ++compared;
    }
    std::cout << "model " << key << ": " << compared << " gradients, largest difference " << worst << " (" << worst_name
              << ")\n";
    EXPECT_EQ(compared, static_cast<int64_t>(model->named_parameters(true).size()));
  }
}

namespace {
// A fixture's training step (tools/make_fixtures.py _training_step): `loss` (the model's mse against the
// fixture's target) equals the fixture's within 1e-5, and after its backward every parameter's gradient is the
// fixture's grad.NAME within 1e-4.
void expect_fixture_gradients(torch::nn::Module& model, const torch::Tensor& loss,
                              const std::map<std::string, torch::Tensor>& r) {
  loss.backward();
  EXPECT_NEAR(loss.item<double>(), r.at("loss").item<double>(), 1e-5 * r.at("loss").item<double>());
  const auto params = model.named_parameters(true);
  ASSERT_GT(params.size(), 0u);
  for (const auto& p : params) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_LT(relative_error(p.value().grad(), r.at("grad." + p.key())), 1e-4) << p.key();
  }
}
}  // namespace

// The property: Wan2.2 TI2V's per-token timesteps (timesteps [B, N], diffusers' expand_timesteps) give
// diffusers' output within 1e-4 (fp32; tests/fixtures/wan_ti2v, 12 latent channels) — with image-to-video's
// mask on one sample (its first latent frame's tokens at 0) and one timestep for every token on the
// other, which is the [B] path's output; the mask changes the output; a training step's loss and
// gradients are autograd's on diffusers' model.
TEST(WanTransformer, PerTokenTimestepsAreDiffusersExpandTimesteps) {
  const std::string dir = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/wan_ti2v";
  std::map<std::string, torch::Tensor> r;
  for (auto& [name, t] : megaslide::io::read_safetensors(dir + "/reference.safetensors").tensors) r[name] = t;
  auto weights = WanWeights::open(dir + "/transformer");
  const WanConfig c = weights.architecture(WanConfig());
  EXPECT_EQ(c.in_channels, 12);
  WanTransformer model(options_of(c));
  EXPECT_TRUE(megaslide::load_wan_weights(weights, *model, {}).empty());
  {
    torch::NoGradGuard no_grad;
    const auto out = model->forward(r.at("x"), r.at("timesteps"), r.at("text"));
    EXPECT_LT(relative_error(out, r.at("out")), 1e-4);
    const auto scalar = model->forward(r.at("x"), torch::tensor({812.5f, 437.25f}), r.at("text"));
    EXPECT_LT(relative_error(scalar, r.at("out_scalar_timesteps")), 1e-4);
    EXPECT_LT(relative_error(out[1], scalar[1]), 1e-6) << "one timestep for every token is the [B] path";
    EXPECT_GT(relative_error(out[0], scalar[0]), 1e-3) << "the first frame's tokens at 0 change the output";
    EXPECT_THROW(model->forward(r.at("x"), r.at("timesteps").narrow(1, 0, 17), r.at("text")), c10::Error);
  }
  auto loss = torch::mse_loss(model->forward(r.at("x"), r.at("timesteps"), r.at("text")), r.at("target"));
  expect_fixture_gradients(*model, loss, r);
}

// The property: Wan2.1 I2V's DiT — the image tokens through the image embedder into the cross-attention's
// own key/value projections, 12 input channels and 4 out — is diffusers' WanTransformer3DModel with
// image_dim (tests/fixtures/wan_i2v): the output and one training step's gradients of every parameter within
// 1e-4; the image changes the output; a model without the branch refuses image tokens and this one needs them.
TEST(WanTransformer, ImageBranchIsDiffusersImageToVideoDiT) {
  const std::string dir = std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/wan_i2v";
  std::map<std::string, torch::Tensor> r;
  for (auto& [name, t] : megaslide::io::read_safetensors(dir + "/reference.safetensors").tensors) r[name] = t;
  auto weights = WanWeights::open(dir + "/transformer");
  const WanConfig c = weights.architecture(WanConfig());
  EXPECT_EQ(c.image_dim, 10);
  EXPECT_EQ(c.in_channels, 12);
  EXPECT_EQ(c.out_channels, 4);
  WanTransformer model(options_of(c));
  EXPECT_TRUE(megaslide::load_wan_weights(weights, *model, {}).empty());
  const auto& x = r.at("x");
  const auto& t = r.at("timesteps");
  const auto& text = r.at("text");
  const auto& image = r.at("image");
  {
    torch::NoGradGuard no_grad;
    const auto out = model->forward(x, t, text, image);
    EXPECT_LT(relative_error(out, r.at("out")), 1e-4);
    EXPECT_GT(relative_error(model->forward(x, t, text, torch::zeros_like(image)), out), 1e-3)
        << "the image takes part";
    EXPECT_THROW(model->forward(x, t, text), c10::Error);
    WanTransformer t2v(options_of(c).image_dim(0).in_channels(12));
    EXPECT_THROW(t2v->forward(x, t, text, image), c10::Error);
  }
  auto loss = torch::mse_loss(model->forward(x, t, text, image), r.at("target"));
  expect_fixture_gradients(*model, loss, r);
}

// The property: the published configurations count exactly the published parameter numbers, on the meta
// device (nothing allocated).
TEST(WanTransformer, PublishedModelsCountTheirParameters) {
  auto wan_1_3b = WanOptions().dim(1536).layers(30).heads(12).ffn_dim(8960);
  auto wan_14b = WanOptions().dim(5120).layers(40).heads(40).ffn_dim(13824);
  EXPECT_EQ(megaslide::count_wan_parameters(wan_1_3b).total, 1418996800);
  EXPECT_EQ(megaslide::count_wan_parameters(wan_14b).total, 14288491584);
  // The count is the built model's: every parameter of a meta-device model.
  WanTransformer meta(wan_1_3b.device(torch::kMeta));
  EXPECT_EQ(megaslide::count_parameters(*meta), 1418996800);
  // What the streamed trainer streams per block: everything but the fp32 modulation table and norm2.
  const auto c = megaslide::count_wan_parameters(wan_14b);
  EXPECT_EQ(c.per_block - c.per_block_streamed, 6 * 5120 + 2 * 5120);
}

// The property: the rename table maps every parameter of a model with every optional part (qk-norm, the
// cross-attention norm, the 3D-DSA retrofit, Wan2.1 I2V's image branch) to a distinct original name and back;
// norm2 and norm3 swap; the image branch's names are Wan-AI's (img_emb.proj.N, cross_attn.k_img, …).
TEST(WanWeights, RenameTableIsOneToOne) {
  auto shapes = megaslide::wan_parameter_shapes(
      options_of(fixture_config("a")).self_attention(megaslide::WanSelfAttention::kDsa3d).image_dim(10));
  std::set<std::string> originals;
  for (const auto& [name, shape] : shapes) {
    const auto original = megaslide::wan_original_name(name);
    ASSERT_FALSE(original.empty()) << name;
    EXPECT_TRUE(originals.insert(original).second) << original;
    EXPECT_EQ(megaslide::wan_diffusers_name(original), name);
  }
  EXPECT_EQ(megaslide::wan_original_name("blocks.3.norm2.weight"), "blocks.3.norm3.weight");
  EXPECT_EQ(megaslide::wan_original_name("blocks.0.attn2.to_out.0.bias"), "blocks.0.cross_attn.o.bias");
  EXPECT_EQ(megaslide::wan_original_name("blocks.7.scale_shift_table"), "blocks.7.modulation");
  EXPECT_EQ(megaslide::wan_original_name("scale_shift_table"), "head.modulation");
  EXPECT_EQ(megaslide::wan_original_name("condition_embedder.time_proj.weight"), "time_projection.1.weight");
  EXPECT_EQ(megaslide::wan_original_name("blocks.1.ffn.net.0.proj.weight"), "blocks.1.ffn.0.weight");
  EXPECT_EQ(megaslide::wan_original_name("condition_embedder.image_embedder.ff.net.2.weight"), "img_emb.proj.3.weight");
  EXPECT_EQ(megaslide::wan_original_name("condition_embedder.image_embedder.norm2.bias"), "img_emb.proj.4.bias");
  EXPECT_EQ(megaslide::wan_original_name("blocks.2.attn2.add_v_proj.weight"), "blocks.2.cross_attn.v_img.weight");
  EXPECT_EQ(megaslide::wan_original_name("blocks.2.attn2.norm_added_k.weight"),
            "blocks.2.cross_attn.norm_k_img.weight");
}

namespace {
void expect_error(const std::function<void()>& f, const std::vector<std::string>& fragments) {
  megaslide::testing::expect_error_naming<WanWeightsError>(f, fragments);
}
}  // namespace

// The property: weights MegaSlide cannot use are refused with one message naming the file and what is
// wrong — pickles (with the safetensors alternative), missing files, a tensor of the wrong shape, missing
// and unexpected tensors, an image-to-video config without the image branch's key/value width, a
// first-last-frame config.
TEST(WanWeights, BadWeightsAreNamed) {
  const auto dir = temp_dir("bad");
  megaslide::io::write_file_atomically(dir + "/wan2.1_t2v_1.3B.pth", "\x80\x02}q\x00.");
  expect_error([&] { WanWeights::open(dir + "/wan2.1_t2v_1.3B.pth"); },
               {"wan2.1_t2v_1.3B.pth", "pickle", "safetensors"});
  expect_error([&] { WanWeights::open(dir); }, {"pickle", ".safetensors"});
  expect_error([&] { WanWeights::open(dir + "/nothing"); }, {"nothing", "do not exist"});

  // A model of another size than the weights: every mismatch listed.
  auto weights = WanWeights::open(kFixtures + "/a/original");
  auto wrong = options_of(fixture_config("a")).ffn_dim(41);
  WanTransformer model(wrong);
  expect_error([&] { megaslide::load_wan_weights(weights, *model); },
               {"a/original", "original names", "of the wrong shape",
                "blocks.0.ffn.0.weight is [40, 24], the model needs [41, 24]"});
  WanTransformer fewer(options_of(fixture_config("a")).layers(1));
  expect_error([&] { megaslide::load_wan_weights(weights, *fewer); },
               {"not in the model", "blocks.1.self_attn.q.weight"});
  WanTransformer without_norms(options_of(fixture_config("a")).qk_norm(false));
  expect_error([&] { megaslide::load_wan_weights(weights, *without_norms); }, {"not in the model", "norm_q"});
  WanTransformer more(options_of(fixture_config("a")).layers(3));
  expect_error([&] { megaslide::load_wan_weights(weights, *more); },
               {"missing", "blocks.2.self_attn.q.weight (blocks.2.attn1.to_q.weight)"});

  // An image-to-video diffusers config.
  const auto i2v = temp_dir("i2v");
  for (const auto& f : megaslide::io::list_directory(kFixtures + "/a/diffusers/transformer"))
    megaslide::io::write_file_atomically(i2v + "/" + f,
                                         megaslide::io::read_file(kFixtures + "/a/diffusers/transformer/" + f));
  std::string config = megaslide::io::read_file(i2v + "/config.json");
  const std::string null_image = "\"image_dim\": null";
  ASSERT_NE(config.find(null_image), std::string::npos);
  config.replace(config.find(null_image), null_image.size(), "\"image_dim\": 1280");
  megaslide::io::write_file_atomically(i2v + "/config.json", config);
  expect_error([&] { WanWeights::open(i2v).architecture(WanConfig()); },
               {"config.json", "added_kv_proj_dim", "image_dim 1280"});
  const std::string null_pos = "\"pos_embed_seq_len\": null";
  ASSERT_NE(config.find(null_pos), std::string::npos);
  {
    std::string flf2v = config;
    flf2v.replace(flf2v.find(null_pos), null_pos.size(), "\"pos_embed_seq_len\": 514");
    megaslide::io::write_file_atomically(i2v + "/config.json", flf2v);
    expect_error([&] { WanWeights::open(i2v).architecture(WanConfig()); },
                 {"config.json", "pos_embed_seq_len", "first-last-frame"});
  }
  // "qk_norm": null with the norms in the weights (what diffusers after 0.42 saves: its WanAttention makes
  // them whatever the flag says) loads with the norms; without them (fixture "b", 0.42) without.
  config.replace(config.find("\"image_dim\": 1280"), std::string("\"image_dim\": 1280").size(), null_image);
  const std::string string_norm = "\"qk_norm\": \"rms_norm_across_heads\"";
  ASSERT_NE(config.find(string_norm), std::string::npos);
  config.replace(config.find(string_norm), string_norm.size(), "\"qk_norm\": null");
  megaslide::io::write_file_atomically(i2v + "/config.json", config);
  EXPECT_TRUE(WanWeights::open(i2v).architecture(WanConfig()).qk_norm) << "the norms are in the weights";
  EXPECT_FALSE(WanWeights::open(kFixtures + "/b/diffusers/transformer").architecture(WanConfig()).qk_norm)
      << "fixture b has none";
  megaslide::io::remove_tree(i2v);
  megaslide::io::remove_tree(dir);
}

// The property: with zero offsets (the retrofit's initialisation) a 3D-DSA Wan block attends to exactly
// its neighbourhood: its self-attention equals dense attention restricted, by a mask built from token
// coordinates, to NATTEN's window (centre clamped into the volume) — through Wan's own projections,
// norms and RoPE.
TEST(WanTransformer, RetrofitStartsAsNeighbourhoodAttention) {
  const megaslide::Int3 kernel{3, 3, 5};
  auto options = options_of(fixture_config("a")).self_attention(megaslide::WanSelfAttention::kDsa3d).dsa_kernel(kernel);
  torch::manual_seed(3);
  megaslide::WanAttention attn(options, /*self_attention=*/true);
  const megaslide::TokenGrid grid{4, 5, 6};
  const int64_t B = 2, N = grid.numel(), D = options.dim(), M = options.heads(), d = D / M;
  auto x = torch::randn({B, N, D});
  const auto rope = megaslide::wan_rope(grid, d, 10000.0, torch::kCPU);
  torch::NoGradGuard no_grad;
  auto ours = attn->forward_self(x, grid, rope);

  // Dense attention over the window of each query.
  auto q = attn->norm_q(attn->to_q(x)), k = attn->norm_k(attn->to_k(x));
  q = megaslide::apply_wan_rope(q.unflatten(2, {M, d}), rope).transpose(1, 2);
  k = megaslide::apply_wan_rope(k.unflatten(2, {M, d}), rope).transpose(1, 2);
  auto v = attn->to_v(x).unflatten(2, {M, d}).transpose(1, 2);
  auto mask = torch::zeros({N, N}, torch::kBool);
  const int64_t sizes[3] = {grid.t, grid.h, grid.w};
  auto coords = [&](int64_t n) {
    return std::array<int64_t, 3>{n / (grid.h * grid.w), (n / grid.w) % grid.h, n % grid.w};
  };
  for (int64_t i = 0; i < N; ++i) {
    const auto p = coords(i);
    for (int64_t j = 0; j < N; ++j) {
      const auto c = coords(j);
      bool inside = true;
      for (int a = 0; a < 3; ++a) {
        const int64_t start = std::clamp<int64_t>(p[a] - kernel[a] / 2, 0, sizes[a] - kernel[a]);
        inside &= c[a] >= start && c[a] < start + kernel[a];
      }
      mask[i][j] = inside;
    }
  }
  auto dense = at::scaled_dot_product_attention(q, k, v, mask).transpose(1, 2).reshape({B, N, D});
  auto expected = attn->out(dense);
  const double error = relative_error(ours, expected);
  std::cout << "3D-DSA at zero offsets vs masked dense attention: " << error << "\n";
  EXPECT_LT(error, 1e-5);
}

// The property: a dense Wan checkpoint starts a 3D-DSA model with only the retrofit's parameters missing
// (offset network and bias, 3 tensors per block), and that model is already a working Wan model whose
// output differs from the dense one only by the attention's reach.
TEST(WanTransformer, DenseCheckpointLoadsIntoTheRetrofit) {
  auto weights = WanWeights::open(kFixtures + "/a/diffusers");
  auto options =
      options_of(fixture_config("a")).self_attention(megaslide::WanSelfAttention::kDsa3d).dsa_kernel({3, 3, 3});
  WanTransformer model(options);
  try {
    megaslide::load_wan_weights(weights, *model);
    ADD_FAILURE() << "a dense checkpoint loaded into a 3D-DSA model without allowing the DSA parameters to be missing";
  } catch (const WanWeightsError& e) {
    EXPECT_NE(std::string(e.what()).find("offset_pw"), std::string::npos) << e.what();
  }
  const auto kept = megaslide::load_wan_weights(weights, *model, megaslide::wan_dsa_parameter_globs());
  EXPECT_EQ(kept.size(), 2u * 5u);  // per block: offset_dw weight and bias, offset_pw weight and bias, rel_bias
  for (const auto& name : kept) EXPECT_NE(name.find(".attn1."), std::string::npos) << name;
  const auto& r = reference();
  torch::NoGradGuard no_grad;
  auto out = model->forward(r.at("a.x"), r.at("a.timesteps"), r.at("a.text"));
  EXPECT_TRUE(out.isfinite().all().item<bool>());
  EXPECT_GT(relative_error(out, r.at("a.out")), 1e-3) << "a 3x3x3 window differs from global attention on a 3x3x4 grid";
}

// The property: the published weights, when downloaded, load and run: MEGASLIDE_WAN_WEIGHTS points at a
// diffusers repository (or its transformer/), a Wan-AI repository or a ComfyUI file. One forward of a small
// latent video gives a finite output of the latent's shape; the architecture is the 1.3B's or the 14B's.
TEST(WanTransformer, RealWeightsWhenDownloaded) {
  const char* path = std::getenv("MEGASLIDE_WAN_WEIGHTS");
  if (path == nullptr || *path == '\0') GTEST_SKIP() << "MEGASLIDE_WAN_WEIGHTS is not set: no real Wan weights to load";
  auto weights = WanWeights::open(path);
  WanConfig fallback;
  fallback.heads = 12;  // a file without config.json: Wan2.1-1.3B's heads (the 14B has 40; both 128 wide)
  auto c = weights.architecture(fallback);
  if (weights.config_path().empty()) c.heads = c.dim / 128;
  std::cout << "Wan weights " << path << ": " << to_string(weights.naming()) << " names, dim " << c.dim << ", "
            << c.layers << " layers, " << c.heads << " heads\n";
  EXPECT_TRUE((c.dim == 1536 && c.layers == 30) || (c.dim == 5120 && c.layers == 40));
  WanTransformer model(options_of(c));
  megaslide::load_wan_weights(weights, *model);
  torch::NoGradGuard no_grad;
  auto x = torch::randn({1, c.in_channels, 1, 8, 8});
  auto out = model->forward(x, torch::tensor({500.0f}), torch::randn({1, 8, c.text_dim}) * 0.1);
  EXPECT_EQ(out.sizes(), x.sizes());
  EXPECT_TRUE(out.isfinite().all().item<bool>());
}
