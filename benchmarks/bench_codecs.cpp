// bench_codecs: the frozen conditioning models at their real sizes (random weights: speed and memory do
// not depend on the values) — Stable Diffusion's VAE (83.7 M parameters) encode and decode frames/s and
// peak CPU memory at 256×256 and 512×512, the tiled decode's peak memory against the whole-frame decode
// (the anchor, same run), CLIP ViT-L/14's text encoder (123 M) in prompts/s, and umT5's encoder (Wan's
// text encoder) in prompts/s at Wan's 512 tokens, at one of google/umt5-*'s sizes (small, base, xl, or xxl:
// Wan's 5.7 B, bf16 on a GPU), random weights, with the memory of its weights and of a call; and the Wan 2.1
// VAE (126.9 M): encode and decode of 5-frame clips (2 latent frames) in video frames/s and peak memory at
// 128×128 and 256×256, and its tiled encode/decode (128-pixel tiles every 96) against the whole-frame ones
// (the anchor); umT5 with its layers streamed through the WeightStreamer against the resident one.
//
//   build/bin/bench_codecs [--threads 2] [--device cpu|cuda] [--reps 1] [--only all|sd|umt5|wan]
//                          [--umt5 small|base|xl|xxl] [--umt5-dtype fp32|bf16] [--umt5-batch 2]
//
// Memory is LibTorch's CPU allocator's peak (util::cpu_memory_counter) above what was live before the call,
// or the CUDA caching allocator's peak on a GPU. The last line is one JSON object.
#include <fmt/format.h>
#include <torch/cuda.h>

#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "megaslide/megaslide.h"
#include "megaslide/util/cpu_memory_counter.h"

#ifdef MEGASLIDE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace {

struct Measured {
  double seconds = 0.0;   // per call, the best of `reps`
  double peak_mib = 0.0;  // above what was live before
};

template <typename F>
Measured measure(torch::Device device, int reps, F&& fn) {
  Measured m;
  m.seconds = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto& counter = megaslide::util::cpu_memory_counter();
    const int64_t before = counter.live();
    counter.reset_peak();
#ifdef MEGASLIDE_WITH_CUDA
    if (device.is_cuda()) {
      torch::cuda::synchronize();
      c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
    }
    const int64_t device_before =
        device.is_cuda() ? c10::cuda::CUDACachingAllocator::getDeviceStats(device.index()).allocated_bytes[0].current
                         : 0;
#endif
    const auto start = std::chrono::steady_clock::now();
    fn();
    if (device.is_cuda()) torch::cuda::synchronize();
    m.seconds = std::min(m.seconds, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    double peak = static_cast<double>(counter.peak() - before);
#ifdef MEGASLIDE_WITH_CUDA
    if (device.is_cuda())
      peak = static_cast<double>(
          c10::cuda::CUDACachingAllocator::getDeviceStats(device.index()).allocated_bytes[0].peak - device_before);
#endif
    m.peak_mib = peak / (1 << 20);
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, reps = 1, umt5_batch = 2;
  std::string device_spec = "cpu", only = "all", umt5_size = "base", umt5_dtype = "fp32";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--threads") threads = std::stoi(argv[i + 1]);
    else if (flag == "--device") device_spec = argv[i + 1];
    else if (flag == "--reps") reps = std::stoi(argv[i + 1]);
    else if (flag == "--only") only = argv[i + 1];
    else if (flag == "--umt5") umt5_size = argv[i + 1];
    else if (flag == "--umt5-dtype") umt5_dtype = argv[i + 1];
    else if (flag == "--umt5-batch") umt5_batch = std::stoi(argv[i + 1]);
    else {
      std::cerr << "bench_codecs: unknown flag " << flag << "\n";
      return 2;
    }
  }
  torch::set_num_threads(threads);
  const torch::Device device = megaslide::resolve_device(device_spec);
  megaslide::util::cpu_memory_counter();  // installed before the models are built: their weights are counted as live
  torch::NoGradGuard no_grad;
  nlohmann::ordered_json out;
  out["device"] = device.str();
  out["threads"] = threads;

  if (only != "all" && only != "sd" && only != "umt5" && only != "wan") {
    std::cerr << "bench_codecs: --only all, sd, umt5 or wan\n";
    return 2;
  }
  auto wan_vae = [&] {
    auto wan = megaslide::WanVae::random(megaslide::WanVaeConfig{}, 3, device);
    std::cout << fmt::format("Wan 2.1 VAE: {:.1f} M parameters, {} on {} thread(s)\n", wan.parameter_count() / 1e6,
                             device.str(), threads);
    std::cout << fmt::format("{:<34} {:>10} {:>10} {:>14}\n", "Wan VAE (5 frames)", "s/clip", "frames/s", "peak MiB");
    const int64_t frames = 5;
    auto row = [&](const std::string& what, const Measured& m) {
      std::cout << fmt::format("{:<34} {:>10.2f} {:>10.3f} {:>14.0f}\n", what, m.seconds, frames / m.seconds,
                               m.peak_mib);
    };
    for (int64_t size : {128, 256}) {
      auto video = (torch::rand({1, 3, frames, size, size}) * 2 - 1).to(device);
      torch::Tensor z;
      auto enc = measure(device, reps, [&] { z = wan.encode(video); });
      auto dec = measure(device, reps, [&] { wan.decode(z); });
      row(fmt::format("encode {}x{}", size, size), enc);
      row(fmt::format("decode {}x{}", size, size), dec);
      out[fmt::format("wan_encode_{}", size)] = {{"frames_per_s", frames / enc.seconds}, {"peak_mib", enc.peak_mib}};
      out[fmt::format("wan_decode_{}", size)] = {{"frames_per_s", frames / dec.seconds}, {"peak_mib", dec.peak_mib}};
      if (size == 256) {
        const megaslide::WanVaeTiling tiling{128, 96};  // 3×3 tiles for 256×256
        auto tenc = measure(device, reps, [&] { wan.encode(video, false, std::nullopt, tiling); });
        auto tdec = measure(device, reps, [&] { wan.decode(z, tiling); });
        row("encode 256x256, 128-px tiles", tenc);
        row("decode 256x256, 128-px tiles", tdec);
        std::cout << fmt::format(
            "  tiled / whole frame: encode memory {:.3f} time {:.2f}; decode memory {:.3f} time {:.2f}\n",
            tenc.peak_mib / enc.peak_mib, tenc.seconds / enc.seconds, tdec.peak_mib / dec.peak_mib,
            tdec.seconds / dec.seconds);
        out["wan_encode_256_tiled_128"] = {{"frames_per_s", frames / tenc.seconds},
                                           {"peak_mib", tenc.peak_mib},
                                           {"memory_vs_whole", tenc.peak_mib / enc.peak_mib},
                                           {"time_vs_whole", tenc.seconds / enc.seconds}};
        out["wan_decode_256_tiled_128"] = {{"frames_per_s", frames / tdec.seconds},
                                           {"peak_mib", tdec.peak_mib},
                                           {"memory_vs_whole", tdec.peak_mib / dec.peak_mib},
                                           {"time_vs_whole", tdec.seconds / dec.seconds}};
      }
    }
  };
  if (only == "all" || only == "sd") {
    auto vae = megaslide::SdVae::random(megaslide::SdVaeConfig{}, 1, device);
    std::cout << fmt::format("SD VAE: {:.1f} M parameters, {} on {} thread(s)\n", vae.parameter_count() / 1e6,
                             device.str(), threads);
    std::cout << fmt::format("{:<34} {:>10} {:>10} {:>14}\n", "VAE (1 frame)", "s/frame", "frames/s", "peak MiB");
    for (int64_t size : {256, 512}) {
      auto image = (torch::rand({1, 3, size, size}) * 2 - 1).to(device);
      torch::Tensor z;
      auto enc = measure(device, reps, [&] { z = vae.encode(image); });
      auto dec = measure(device, reps, [&] { vae.decode(z); });
      std::cout << fmt::format("{:<34} {:>10.2f} {:>10.3f} {:>14.0f}\n", fmt::format("encode {}x{}", size, size),
                               enc.seconds, 1 / enc.seconds, enc.peak_mib);
      std::cout << fmt::format("{:<34} {:>10.2f} {:>10.3f} {:>14.0f}\n", fmt::format("decode {}x{}", size, size),
                               dec.seconds, 1 / dec.seconds, dec.peak_mib);
      out[fmt::format("encode_{}", size)] = {{"s_per_frame", enc.seconds}, {"peak_mib", enc.peak_mib}};
      out[fmt::format("decode_{}", size)] = {{"s_per_frame", dec.seconds}, {"peak_mib", dec.peak_mib}};
      if (size == 512) {
        // Tiled: 256-pixel tiles (32 latents), overlap 0.25 -> 9 tiles for 512×512; the whole-frame decode above is the
        // anchor.
        auto tiled = measure(device, reps, [&] { vae.decode_tiled(z, megaslide::VaeTiling{256, 0.25}); });
        std::cout << fmt::format("{:<34} {:>10.2f} {:>10.3f} {:>14.0f}\n", "decode 512x512, 256-px tiles",
                                 tiled.seconds, 1 / tiled.seconds, tiled.peak_mib);
        std::cout << fmt::format("  tiled / whole frame: memory {:.3f}, time {:.2f}\n", tiled.peak_mib / dec.peak_mib,
                                 tiled.seconds / dec.seconds);
        out["decode_512_tiled_256"] = {{"s_per_frame", tiled.seconds},
                                       {"peak_mib", tiled.peak_mib},
                                       {"memory_vs_whole", tiled.peak_mib / dec.peak_mib},
                                       {"time_vs_whole", tiled.seconds / dec.seconds}};
      }
    }

    megaslide::ClipTextConfig clip;  // ViT-L/14's text tower
    clip.hidden_size = 768, clip.intermediate_size = 3072, clip.num_attention_heads = 12, clip.num_hidden_layers = 12;
    auto text = megaslide::ClipTextEncoder::random(clip, 2, device);
    const int64_t batch = 8;
    auto ids = torch::randint(0, clip.vocab_size, {batch, 77}, torch::kLong);
    auto t = measure(device, reps, [&] { text.forward(ids); });
    std::cout << fmt::format(
        "CLIP ViT-L/14 text encoder: {:.1f} M parameters; {} prompts x 77 tokens: {:.2f} s, {:.1f} prompts/s, peak "
        "{:.0f} MiB\n",
        text.parameter_count() / 1e6, batch, t.seconds, batch / t.seconds, t.peak_mib);
    out["clip_prompts_per_s"] = batch / t.seconds;
    out["clip_peak_mib"] = t.peak_mib;
  }

  if (only == "all" || only == "umt5") {
    // umT5 at the published sizes (google/umt5-*), random weights; Wan's 512 tokens, prompts of ~100 tokens.
    megaslide::Umt5Config c = megaslide::Umt5Config::xxl();
    if (umt5_size == "small") c.d_model = 512, c.d_ff = 1024, c.num_layers = 8, c.num_heads = 6;
    else if (umt5_size == "base") c.d_model = 768, c.d_ff = 2048, c.num_layers = 12, c.num_heads = 12;
    else if (umt5_size == "xl") c.d_model = 2048, c.d_ff = 5120, c.num_layers = 24, c.num_heads = 32;
    else if (umt5_size != "xxl") {
      std::cerr << "bench_codecs: --umt5 small, base, xl or xxl\n";
      return 2;
    }
    const auto dtype = umt5_dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32;
    auto& counter = megaslide::util::cpu_memory_counter();
    const int64_t before = counter.live();
    const auto load_start = std::chrono::steady_clock::now();
    auto umt5 = megaslide::Umt5Encoder::random(c, 3, device, dtype);
    const double build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
    const double weights_mib = device.is_cuda() ? 0.0 : static_cast<double>(counter.live() - before) / (1 << 20);
    auto ids = torch::randint(3, c.vocab_size, {umt5_batch, 512}, torch::kLong);
    auto mask = torch::zeros({umt5_batch, 512}, torch::kLong);
    mask.slice(1, 0, 100).fill_(1);
    auto u = measure(device, reps, [&] { umt5.embed(ids, mask); });
    std::cout << fmt::format(
        "umT5-{} encoder: {:.2f} B parameters ({}, weights {:.0f} MiB host, built in {:.1f} s); {} prompts x 512 "
        "tokens: "
        "{:.2f} s, {:.3f} prompts/s, peak {:.0f} MiB above the weights\n",
        umt5_size, umt5.parameter_count() / 1e9, umt5_dtype, weights_mib, build_s, umt5_batch, u.seconds,
        umt5_batch / u.seconds, u.peak_mib);
    out["umt5_size"] = umt5_size;
    out["umt5_dtype"] = umt5_dtype;
    out["umt5_parameters"] = umt5.parameter_count();
    out["umt5_prompts_per_s"] = umt5_batch / u.seconds;
    out["umt5_peak_mib"] = u.peak_mib;
    // The same encoder with its layers streamed through the WeightStreamer (for a device umT5 does not
    // fit): its prompts/s against the resident run above (the anchor). On the CPU the "device" is host
    // memory: the row measures the streaming's own cost (a copy of every layer per call).
    {
      auto streamed =
          megaslide::Umt5Encoder::streamed(megaslide::Umt5Encoder::random(c, 3, torch::kCPU, dtype), device);
      auto s = measure(device, reps, [&] { streamed.embed(ids, mask); });
      std::cout << fmt::format(
          "umT5-{} encoder, layers streamed: {} prompts: {:.2f} s, {:.3f} prompts/s ({:.2f}x resident), peak {:.0f} "
          "MiB\n",
          umt5_size, umt5_batch, s.seconds, umt5_batch / s.seconds, u.seconds / s.seconds, s.peak_mib);
      out["umt5_streamed_prompts_per_s"] = umt5_batch / s.seconds;
      out["umt5_streamed_vs_resident"] = u.seconds / s.seconds;
    }
  }
  if (only == "all" || only == "wan") wan_vae();

  std::cout << out.dump() << "\n";
  return 0;
}
