// megaslide-encode: the frozen conditioning models on their own — for caches, debugging and checking
// against other implementations (docs/conditioning.md).
//
//   megaslide-encode text --text-encoder clip --weights DIR --prompts FILE --out F.safetensors [--ids-only]
//       ids [N, 77] int64, mask [N, 77] int64, embeddings [N, 77, D] float32 (last_hidden_state),
//       pooled [N, D] float32; one prompt per line of FILE (an empty line is the empty prompt)
//   megaslide-encode text --text-encoder umt5 --weights PATH --prompts FILE --out F.safetensors [--ids-only]
//       Wan's text conditioning: ids [N, 512] int64, mask [N, 512] int64, embeddings [N, 512, d_model]
//       float32 (umT5's last_hidden_state, zero past each prompt); PATH: a folder in transformers' layout
//       (or a diffusers repository with text_encoder/) or ComfyUI's umt5_xxl_fp16.safetensors; the
//       tokenizer's spiece.model is found from it (--tokenizer overrides)
//   megaslide-encode vae-encode --vae sd --weights DIR --in F.safetensors --out F.safetensors [--sample --seed S]
//       tensor x: images [N, 3, H, W] (or videos [B, 3, T, H, W]) in [-1, 1] -> y: scaled latents
//   megaslide-encode vae-decode --vae sd --weights DIR --in F.safetensors --out F.safetensors [--tile P]
//       tensor x: scaled latents [N, 4, h, w] (or [B, 4, T, h, w]) -> y: images (not clamped)
//   megaslide-encode vae-encode --vae wan --weights DIR|FILE --in F.safetensors --out F.safetensors [--sample --seed S]
//                               [--tile P --tile-stride S]
//       tensor x: videos [N, 3, T, H, W] in [-1, 1], T = 1 + 4k -> y: normalised latents [N, 16, 1 + (T-1)/4, H/8, W/8]
//   megaslide-encode vae-decode --vae wan --weights DIR|FILE --in F.safetensors --out F.safetensors [--tile P
//   --tile-stride S]
//       tensor x: normalised latents [N, 16, t, h, w] -> y: videos [N, 3, 1 + 4(t-1), 8h, 8w] clamped to [-1, 1]
//   (--weights for wan: diffusers' vae/ folder, or the single file with the original names, e.g. ComfyUI's
//   wan_2.1_vae.safetensors)
//
// Exit codes: 0 done; 2 bad flags or input (missing files, a tensor with the wrong name, shape or dtype, a
// config.json that disagrees with the weights), with one message naming it, nothing written; 1 any other
// failure.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <fmt/format.h>

#include <iostream>
#include <nlohmann/json.hpp>

#include "megaslide/megaslide.h"
#include "tool_support.h"

namespace {

std::vector<std::string> read_lines(const std::string& path) {
  std::string text;
  try {
    text = megaslide::io::read_file(path);
  } catch (const std::exception& e) {
    throw megaslide::tools::UsageError(std::string("prompt file: ") + e.what());
  }
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
    start = end + 1;
  }
  if (lines.empty()) throw megaslide::tools::UsageError("prompt file '" + path + "' is empty");
  return lines;
}

torch::Tensor input_tensor(const std::string& path) {
  megaslide::io::SafetensorsFile file;
  try {
    file = megaslide::io::read_safetensors(path);
  } catch (const std::exception& e) {
    throw megaslide::tools::UsageError(e.what());
  }
  for (auto& [name, t] : file.tensors)
    if (name == "x") {
      if (!c10::isFloatingType(t.scalar_type()))
        throw megaslide::tools::UsageError("'" + path + "': tensor 'x' is " +
                                           megaslide::io::safetensors_dtype_name(t.scalar_type()) +
                                           ", expected F32, F16 or BF16");
      // A NaN or an infinity would come out as a tensor of NaNs, written without a word.
      if (!torch::isfinite(t).all().item<bool>())
        throw megaslide::tools::UsageError("'" + path + "': tensor 'x' holds NaN or infinite values");
      return t.to(torch::kFloat32);
    }
  std::string names;
  for (auto& [name, t] : file.tensors) names += (names.empty() ? "" : ", ") + name;
  throw megaslide::tools::UsageError("'" + path +
                                     "' has no tensor 'x' (it holds: " + (names.empty() ? "nothing" : names) + ")");
}

// Puts a batch's outputs, rows [s, s + part.size(0)) of `n`, into `out` on the CPU, allocated at the first batch
// (its shape past the first dimension and its dtype): memory is the output once and a batch, where collecting the
// batches and concatenating them held the output twice, and writing it a third time.
void put_rows(torch::Tensor& out, int64_t n, int64_t s, const torch::Tensor& part) {
  if (!out.defined()) {
    auto sizes = part.sizes().vec();
    sizes[0] = n;
    out = torch::empty(sizes, part.options().device(torch::kCPU));
  }
  out.slice(0, s, s + part.size(0)).copy_(part);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "megaslide-encode: CLIP text encoding, Stable Diffusion and Wan VAE encode/decode to safetensors "
      "(docs/conditioning.md)"};
  app.require_subcommand(1);
  std::string weights, prompts_path, out, in, vocab, spiece, clean = "wan", device_spec = "auto", dtype_name = "fp32",
                                                             encoder_kind = "clip", vae_kind = "sd";
  bool ids_only = false, sample = false;
  uint64_t seed = 0;
  int64_t max_length = 0, frames_per_batch = 8, tile = 0, tile_stride = 0, batch = 8;
  double tile_overlap = 0.25;
  auto common = [&](CLI::App* sub, bool needs_weights) {
    auto* w = sub->add_option("--weights", weights,
                              "model folder (config.json + safetensors weights); for --vae wan also a single file");
    if (needs_weights) w->required();
    sub->add_option("--out", out, "output safetensors file")->required()->check(megaslide::tools::non_empty_path());
    sub->add_option("--device", device_spec, "auto, cpu, cuda or cuda:N")->capture_default_str();
    sub->add_flag_callback(
        "--allow-nonfinite-weights", [] { megaslide::io::set_nonfinite_weights_allowed(true); },
        "load weights that hold NaN or infinite values instead of refusing them");
    sub->add_option("--dtype", dtype_name, "weights and compute: fp32, bf16 or fp16 (outputs are fp32)")
        ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
        ->capture_default_str();
  };
  auto* text = app.add_subcommand(
      "text", "prompts -> token ids, mask and embeddings (CLIP: last_hidden_state and pooled; umT5: Wan's)");
  common(text, false);
  text->add_option("--text-encoder", encoder_kind, "text encoder")
      ->check(CLI::IsMember({"clip", "umt5"}))
      ->capture_default_str();
  text->add_option("--tokenizer", spiece,
                   "umt5: spiece.model, or a folder or .safetensors file holding it (default: found from --weights)");
  text->add_option(
          "--clean", clean,
          "umt5: prompt cleaning before tokenizing: wan (Wan's prompt_clean: ftfy.fix_text, HTML unescaped twice, "
          "white-space "
          "runs to one space, trimmed; what megaslide-sample does), whitespace (the white-space step alone) or none")
      ->check(CLI::IsMember({"wan", "whitespace", "none"}))
      ->capture_default_str();
  text->add_option("--batch", batch, "prompts per encoder call (memory grows with it)")
      ->transform(megaslide::tools::integer_in(1, int64_t{1} << 20))
      ->capture_default_str();
  text->add_option("--prompts", prompts_path, "one prompt per line (an empty line is the empty prompt)")->required();
  text->add_option(
      "--vocab", vocab,
      "vocabulary folder (vocab.json + merges.txt) or OpenAI's bpe_simple_vocab_16e6.txt (default: in --weights)");
  text->add_option("--max-length", max_length,
                   "tokens per prompt, special tokens included (default: clip 77, umt5 512)")
      ->transform(megaslide::tools::integer_in(2, 4096));
  text->add_flag("--ids-only", ids_only, "only ids and mask (no model needed)");
  auto* vae_encode = app.add_subcommand("vae-encode", "images (tensor x, in [-1, 1]) -> scaled latents (tensor y)");
  auto* vae_decode = app.add_subcommand("vae-decode", "scaled latents (tensor x) -> images (tensor y)");
  for (auto* sub : {vae_encode, vae_decode}) {
    common(sub, true);
    sub->add_option("--vae", vae_kind, "VAE: sd (images, or videos frame by frame) or wan (videos)")
        ->check(CLI::IsMember({"sd", "wan"}))
        ->capture_default_str();
    sub->add_option("--in", in, "input safetensors file with tensor x")->required();
    sub->add_option("--frames-per-batch", frames_per_batch,
                    "images, or frames of videos [B, C, T, H, W], per VAE call (sd; memory grows with it)")
        ->transform(megaslide::tools::integer_in(1, int64_t{1} << 20))
        ->capture_default_str();
    sub->add_option("--tile-stride", tile_stride, "wan: pixels between tile starts (default: 3/4 of --tile)")
        ->transform(megaslide::tools::integer_in(0));
  }
  vae_encode->add_option("--tile", tile, "wan: encode in tiles of P pixels, blended (0: whole frames)")
      ->transform(megaslide::tools::integer_in(0));
  vae_encode->add_flag("--sample", sample, "a sample of the latent distribution instead of its mean");
  vae_encode->add_option("--seed", seed, "seed of --sample's noise")
      ->transform(megaslide::tools::unsigned_integer())
      ->capture_default_str();
  vae_decode->add_option("--tile", tile, "decode in tiles of P pixels, blended (0: whole frames)")
      ->transform(megaslide::tools::integer_in(0));
  vae_decode->add_option("--tile-overlap", tile_overlap, "overlap of tiles, a fraction of the tile")
      ->check(megaslide::tools::finite_real(0.0, 0.9))
      ->capture_default_str();
  app.set_version_flag("--version", megaslide::build_summary());
  if (const auto code = megaslide::tools::parse_flags(app, argc, argv)) return *code;
  megaslide::tools::survive_file_size_limit();
  megaslide::tools::remove_temporaries_on_fatal_signals();

  // Everything that can be checked is loaded and checked before anything is computed or written.
  torch::Device device = torch::kCPU;
  const auto dtype = dtype_name == "bf16" ? torch::kBFloat16 : dtype_name == "fp16" ? torch::kHalf : torch::kFloat32;
  std::optional<megaslide::ClipTokenizer> tokenizer;
  std::optional<megaslide::ClipTextEncoder> encoder;
  std::optional<megaslide::Umt5Tokenizer> umt5_tokenizer;
  std::optional<megaslide::Umt5Encoder> umt5;
  std::optional<megaslide::SdVae> vae;
  std::optional<megaslide::WanVae> wan;
  std::vector<std::string> prompts;
  torch::Tensor x;
  return megaslide::tools::run_tool("megaslide-encode", [&] {
    megaslide::tools::checking_input([&] {
      megaslide::io::check_output_file(out, "--out");  // before minutes of encoding, not after
      // What each input flag names, for the refusal of an --out that is it.
      const auto reads = [](const std::string& input, const std::string& flag) {
        return std::pair{
            input, std::string(megaslide::io::is_directory(input) ? "the folder " : "the file ") + flag + " reads"};
      };
      megaslide::tools::check_output_is_no_input(
          out, "--out",
          {reads(in, "--in"), reads(prompts_path, "--prompts"), reads(weights, "--weights"), reads(vocab, "--vocab"),
           reads(spiece, "--tokenizer")});
      // A flag that would change nothing in this call is refused, not ignored.
      for (auto* sub : {vae_encode, vae_decode}) {
        if (!sub->parsed()) continue;
        if (sub->count("--tile-stride") > 0 && (vae_kind != "wan" || tile == 0))
          throw megaslide::tools::UsageError("--tile-stride spaces the Wan VAE's tiles: it needs --vae wan and --tile");
        if (sub->count("--frames-per-batch") > 0 && vae_kind != "sd")
          throw megaslide::tools::UsageError("--frames-per-batch is for --vae sd");
      }
      if (vae_decode->parsed() && vae_decode->count("--tile-overlap") > 0 && (vae_kind != "sd" || tile == 0))
        throw megaslide::tools::UsageError(
            "--tile-overlap is for --vae sd with --tile (the Wan VAE's tiles are spaced by --tile-stride)");
      if (vae_encode->parsed() && vae_encode->count("--seed") > 0 && !sample)
        throw megaslide::tools::UsageError("--seed seeds --sample's noise: give --sample too, or no --seed");
      megaslide::tools::check_device_flag(device_spec);
      device = megaslide::tools::checking_input([&] { return megaslide::resolve_device(device_spec); }, "--device: ");
      if (text->parsed() && encoder_kind == "umt5") {
        if (max_length == 0) max_length = 512;
        if (!ids_only && weights.empty()) throw megaslide::tools::UsageError("--weights is needed (or --ids-only)");
        if (spiece.empty() && weights.empty())
          throw megaslide::tools::UsageError("--tokenizer or --weights is needed to find umT5's spiece.model");
        prompts = read_lines(prompts_path);
        if (clean == "wan")
          for (auto& p : prompts) p = megaslide::wan_prompt_clean(p);
        if (clean == "whitespace")
          for (auto& p : prompts) p = megaslide::wan_clean(p);
        umt5_tokenizer = megaslide::Umt5Tokenizer::find(spiece.empty() ? weights : spiece);
        if (!ids_only) {
          umt5 = megaslide::Umt5Encoder::load(weights, device, dtype);
          if (umt5_tokenizer->vocab_size() > umt5->config().vocab_size)
            throw megaslide::tools::UsageError(
                fmt::format("the tokenizer '{}' has {} pieces, the model's embedding only {}", umt5_tokenizer->source(),
                            umt5_tokenizer->vocab_size(), umt5->config().vocab_size));
        }
      } else if (text->parsed()) {
        if (max_length == 0) max_length = 77;
        if (!ids_only && weights.empty()) throw megaslide::tools::UsageError("--weights is needed (or --ids-only)");
        prompts = read_lines(prompts_path);
        tokenizer = megaslide::ClipTokenizer::find(vocab, weights);
        if (!ids_only) {
          encoder = megaslide::ClipTextEncoder::load(weights, device, dtype);
          if (max_length > encoder->config().max_position_embeddings)
            throw megaslide::tools::UsageError(fmt::format("--max-length {} exceeds the model's {} positions",
                                                           max_length, encoder->config().max_position_embeddings));
          if (tokenizer->vocab_size() > encoder->config().vocab_size)
            throw megaslide::tools::UsageError(
                fmt::format("the vocabulary has {} tokens, the model's embedding only {}", tokenizer->vocab_size(),
                            encoder->config().vocab_size));
        }
      } else if (vae_kind == "wan") {
        wan = megaslide::WanVae::load(weights, device, dtype);
        x = input_tensor(in);
        const auto& c = wan->config();
        const int64_t f = c.spatial_downscale();
        if (vae_encode->parsed()) {
          if (x.dim() != 5 || x.size(1) != c.in_channels)
            throw megaslide::tools::UsageError(
                fmt::format("'{}': tensor 'x' has shape {}, expected videos [N, {}, T, H, W]", in, c10::str(x.sizes()),
                            c.in_channels));
          if ((x.size(2) - 1) % 4 != 0)
            throw megaslide::tools::UsageError(
                fmt::format("'{}': {} frames; the Wan VAE takes 1 + 4k frames (1, 5, ..., 81)", in, x.size(2)));
          if (x.size(3) % f != 0 || x.size(4) % f != 0)
            throw megaslide::tools::UsageError(fmt::format(
                "'{}': frames of {}x{} (W x H); the VAE needs multiples of {}", in, x.size(4), x.size(3), f));
        } else if (x.dim() != 5 || x.size(1) != c.z_dim) {
          throw megaslide::tools::UsageError(fmt::format(
              "'{}': tensor 'x' has shape {}, expected latents [N, {}, t, h, w]", in, c10::str(x.sizes()), c.z_dim));
        }
        // The default, 3/4 of the tile rounded down to a multiple of f, and at least f (a tile of f alone: f).
        if (tile_stride == 0) tile_stride = std::max<int64_t>(f, tile / 4 * 3 / f * f);
        if (tile > 0 && (tile % f != 0 || tile_stride % f != 0 || tile_stride == 0 || tile_stride > tile))
          throw megaslide::tools::UsageError(fmt::format(
              "--tile {} and --tile-stride {} must be multiples of {} with 0 < stride <= tile", tile, tile_stride, f));
      } else {
        if (vae_encode->parsed() && tile > 0)
          throw megaslide::tools::UsageError("--tile when encoding is for --vae wan only");
        vae = megaslide::SdVae::load(weights, device, dtype);
        x = input_tensor(in);
        const auto& c = vae->config();
        const int64_t channels = vae_encode->parsed() ? c.in_channels : c.latent_channels;
        if ((x.dim() != 4 && x.dim() != 5) || x.size(1) != channels)
          throw megaslide::tools::UsageError(
              fmt::format("'{}': tensor 'x' has shape {}, expected [N, {}, H, W] or [B, {}, T, H, W]", in,
                          c10::str(x.sizes()), channels, channels));
        if (vae_encode->parsed() && (x.size(-1) % c.downscale() != 0 || x.size(-2) % c.downscale() != 0))
          throw megaslide::tools::UsageError(fmt::format("'{}': images of {}x{} (W x H); the VAE needs multiples of {}",
                                                         in, x.size(-1), x.size(-2), c.downscale()));
        if (tile > 0 && tile % c.downscale() != 0)
          throw megaslide::tools::UsageError(fmt::format("--tile {} is not a multiple of {}", tile, c.downscale()));
      }
    });

    {
      megaslide::io::NamedTensors outputs;
      std::map<std::string, std::string> metadata{{"megaslide_version", megaslide::build_summary()}};
      if (umt5_tokenizer) {
        auto tokens = umt5_tokenizer->encode(prompts, max_length);
        outputs = {{"ids", tokens.ids}, {"mask", tokens.mask}};
        if (umt5) {
          const int64_t n = tokens.ids.size(0);
          megaslide::tools::CountProgress progress("encode", "prompts");
          torch::Tensor embeddings;
          for (int64_t s = 0; s < n; s += batch) {
            const int64_t e = std::min(s + batch, n);
            put_rows(embeddings, n, s, umt5->embed(tokens.ids.slice(0, s, e), tokens.mask.slice(0, s, e)));
            progress.update(e, n);
          }
          outputs.emplace_back("embeddings", embeddings);
        }
        metadata["prompts"] = nlohmann::json(prompts).dump();
        metadata["text_encoder"] = "umt5";
        std::cerr << fmt::format("megaslide-encode: {} prompt(s) -> {}{}\n", prompts.size(), out,
                                 umt5 ? "" : " (ids only)");
      } else if (text->parsed()) {
        auto tokens = tokenizer->encode(prompts, max_length);
        outputs = {{"ids", tokens.ids}, {"mask", tokens.mask}};
        if (encoder) {
          const int64_t n = tokens.ids.size(0);
          megaslide::tools::CountProgress progress("encode", "prompts");
          torch::Tensor hidden, pooled;
          for (int64_t s = 0; s < n; s += batch) {
            const int64_t e = std::min(s + batch, n);
            auto result = encoder->forward(tokens.ids.slice(0, s, e));
            put_rows(hidden, n, s, result.last_hidden_state);
            put_rows(pooled, n, s, result.pooled);
            progress.update(e, n);
          }
          outputs.emplace_back("embeddings", hidden);
          outputs.emplace_back("pooled", pooled);
        }
        metadata["prompts"] = nlohmann::json(prompts).dump();
        std::cerr << fmt::format("megaslide-encode: {} prompt(s) -> {}{}\n", prompts.size(), out,
                                 encoder ? "" : " (ids only)");
      } else {
        torch::Tensor y;
        std::optional<megaslide::WanVaeTiling> wan_tiling;
        if (tile > 0) wan_tiling = megaslide::WanVaeTiling{tile, tile_stride};
        if (wan && vae_encode->parsed()) {
          std::optional<at::Generator> generator;
          if (sample) generator = at::detail::createCPUGenerator(seed);
          y = wan->encode(x, sample, generator, wan_tiling);
        } else if (wan) {
          y = wan->decode(x, wan_tiling);
        } else if (vae_encode->parsed()) {
          std::optional<at::Generator> generator;
          if (sample) generator = at::detail::createCPUGenerator(seed);
          y = x.dim() == 5 ? vae->encode_video(x, frames_per_batch, sample, generator)
                           : vae->encode(x, sample, generator, frames_per_batch);
        } else {
          std::optional<megaslide::VaeTiling> tiling;
          if (tile > 0) tiling = megaslide::VaeTiling{tile, tile_overlap};
          if (x.dim() == 5) {
            y = vae->decode_video(x, frames_per_batch, tiling);
          } else {
            const int64_t n = x.size(0);
            megaslide::tools::CountProgress progress("decode", "images");
            for (int64_t s = 0; s < n; s += frames_per_batch) {
              auto chunk = x.slice(0, s, std::min(s + frames_per_batch, n));
              put_rows(y, n, s, tiling ? vae->decode_tiled(chunk, *tiling) : vae->decode(chunk));
              progress.update(s + chunk.size(0), n);
            }
          }
        }
        outputs = {{"y", y.cpu()}};
        std::cerr << fmt::format("megaslide-encode: x {} -> y {} in {}\n", c10::str(x.sizes()), c10::str(y.sizes()),
                                 out);
      }
      megaslide::io::write_safetensors(out, outputs, metadata);
      return 0;
    }
  });
}
