// bench_loader: the video data path. Writes a dataset of H.264 clips at test time, then measures
//   - decode: frames/s of VideoDataset::load (decode the planned frames, resize, crop) on one thread,
//     against decoding every frame of the same files with io::read_video (the anchor, same run);
//   - training: the fraction of step time the resident trainer waits for data with the loader in line
//     (data.workers 0, the anchor) and in the background (data.workers N, data.prefetch 2), decoding and
//     from a megaslide-cache cache;
//   - cache read: items/s and MB/s of LatentCache::load (the latents of any encoder are read the same
//     way: a mapped shard, each item's CRC-32), against a memory copy of the same bytes (the anchor);
//   - a long source: clips at drawn starts in one long video (--long-frames at 24 fps, libx264's default key frame
//     interval of 250), read with io::read_video_frames seeking (the default) against decoding from the start
//     (the anchor, same run); and frame 48 alone both ways (the key frame before it is the first: what a read
//     that tries to seek and gains nothing costs, when the file is short enough for it to try).
//
//   build/bin/bench_loader [--clips 16] [--frames 48] [--height 144] [--width 256] [--clip-frames 16]
//                          [--size 64] [--steps 12] [--workers 1] [--threads 1] [--hidden 32] [--device cpu|cuda]
//                          [--long-frames 1200] [--long-reads 8] [--long-only 0|1]
//
// The last line is one JSON object.
#include <fmt/format.h>
#include <torch/nn/functional/upsampling.h>
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "megaslide/megaslide.h"

namespace {

int64_t flag(int argc, char** argv, const std::string& name, int64_t fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (name == argv[i]) return std::stoll(argv[i + 1]);
  return fallback;
}

std::string text_flag(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (name == argv[i]) return argv[i + 1];
  return fallback;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t clips = flag(argc, argv, "--clips", 16), frames = flag(argc, argv, "--frames", 48);
  const int64_t height = flag(argc, argv, "--height", 144), width = flag(argc, argv, "--width", 256);
  const int64_t clip_frames = flag(argc, argv, "--clip-frames", 16), size = flag(argc, argv, "--size", 64);
  const int64_t steps = flag(argc, argv, "--steps", 12), workers = flag(argc, argv, "--workers", 1);
  const int64_t threads = flag(argc, argv, "--threads", 1), hidden = flag(argc, argv, "--hidden", 32);
  const std::string device = text_flag(argc, argv, "--device", "cpu");
  if (threads > 0) torch::set_num_threads(static_cast<int>(threads));
  if (!megaslide::io::video_supported()) {
    std::cerr << "bench_loader: built without FFmpeg\n";
    return 1;
  }
  const std::string dir = "/tmp/megaslide-bench-loader-" + std::to_string(::getpid());
  megaslide::io::make_directories(dir + "/videos");
  for (int64_t k = 0; k < clips; ++k) {
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(k));
    auto coarse = torch::rand({frames, 3, height / 16 + 1, width / 16 + 1}, gen);
    namespace F = torch::nn::functional;
    auto fine = F::interpolate(coarse, F::InterpolateFuncOptions()
                                           .size(std::vector<int64_t>{height, width})
                                           .mode(torch::kBilinear)
                                           .align_corners(true));
    auto rgb = (fine.permute({0, 2, 3, 1}) * 255).round().to(torch::kUInt8).contiguous();
    megaslide::io::write_mp4(fmt::format("{}/videos/clip-{:03}.mp4", dir, k), rgb,
                             megaslide::io::VideoWriteOptions().fps(24).preset("veryfast"));
    megaslide::io::write_file_atomically(fmt::format("{}/videos/clip-{:03}.txt", dir, k),
                                         "a red blob moves left quickly");
  }
  std::vector<std::string> sets{"data.dataset=videos",
                                "data.root=" + dir + "/videos",
                                fmt::format("data.frames={}", clip_frames),
                                fmt::format("data.height={}", size),
                                fmt::format("data.width={}", size),
                                "data.frame_stride=2",
                                "train.batch_size=2",
                                fmt::format("train.steps={}", steps),
                                "train.device=" + device,
                                "offload.enabled=false",
                                fmt::format("model.hidden={}", hidden),
                                "model.heads=2",
                                "model.layers=2",
                                "model.patch=[1,4,4]",
                                "model.dsa_kernel=[3,3,3]",
                                fmt::format("train.threads={}", threads),
                                "output.progress=false"};
  auto config = megaslide::parse_run_config("", "bench_loader", sets);
  auto start = std::chrono::steady_clock::now();
  nlohmann::ordered_json out;

  // A long source: clips of clip_frames at stride 2 from starts drawn across the video, seeking against decoding
  // from the start (the anchor), each clip read both ways and compared.
  {
    const int64_t long_frames = flag(argc, argv, "--long-frames", 1200), reads = flag(argc, argv, "--long-reads", 8);
    const std::string path = dir + "/long.mp4";
    {
      // Slow motion: a coarse grid that changes every 12 frames, interpolated between (trilinear), 12 frames at a
      // time (a long 1080p video as float at once would not fit).
      auto gen = at::detail::createCPUGenerator(99);
      auto coarse = torch::rand({3, long_frames / 12 + 2, height / 16 + 1, width / 16 + 1}, gen);
      auto rgb = torch::empty({long_frames, height, width, 3}, torch::kUInt8);
      namespace F = torch::nn::functional;
      for (int64_t c = 0; c < long_frames; c += 12) {
        auto fine =
            F::interpolate(coarse.narrow(1, c / 12, 2).unsqueeze(0), F::InterpolateFuncOptions()
                                                                         .size(std::vector<int64_t>{13, height, width})
                                                                         .mode(torch::kTrilinear)
                                                                         .align_corners(true))[0];
        const int64_t n = std::min<int64_t>(12, long_frames - c);
        rgb.narrow(0, c, n).copy_((fine.narrow(1, 0, n).permute({1, 2, 3, 0}) * 255).round().to(torch::kUInt8));
      }
      megaslide::io::write_mp4(path, rgb, megaslide::io::VideoWriteOptions().fps(24).preset("veryfast"));
    }
    std::vector<std::vector<int64_t>> clips_at;
    auto gen = at::detail::createCPUGenerator(7);
    for (int64_t r = 0; r < reads; ++r) {
      const int64_t first = torch::randint(0, long_frames - 2 * clip_frames, {1}, gen).item<int64_t>();
      std::vector<int64_t> indices;
      for (int64_t k = 0; k < clip_frames; ++k) indices.push_back(first + 2 * k);
      clips_at.push_back(std::move(indices));
    }
    const auto from_start = megaslide::io::VideoReadOptions().seek(false);
    double seek_s = 0.0, anchor_s = 0.0;
    int64_t decoded_seek = 0, decoded_anchor = 0;
    bool same = true;
    for (const auto& indices : clips_at) {
      int64_t decoded = 0;
      start = std::chrono::steady_clock::now();
      const auto a = megaslide::io::read_video_frames(path, indices, &decoded, from_start);
      anchor_s += seconds_since(start);
      decoded_anchor += decoded;
      start = std::chrono::steady_clock::now();
      const auto b = megaslide::io::read_video_frames(path, indices, &decoded);
      seek_s += seconds_since(start);
      decoded_seek += decoded;
      same = same && torch::equal(a, b);
    }
    // Frame 48 alone: the key frame before it is frame 0, so a seeking read scans the packets for nothing.
    start = std::chrono::steady_clock::now();
    int64_t near_decoded = 0;
    megaslide::io::read_video_frames(path, {48}, &near_decoded);
    const double near_s = seconds_since(start);
    start = std::chrono::steady_clock::now();
    megaslide::io::read_video_frames(path, {48}, nullptr, from_start);
    const double near_anchor_s = seconds_since(start);
    out["long_frames"] = long_frames;
    out["long_clip_s_from_start"] = anchor_s / static_cast<double>(reads);
    out["long_clip_s_seeking"] = seek_s / static_cast<double>(reads);
    out["long_seek_speedup"] = anchor_s / seek_s;
    out["long_frames_decoded_from_start"] = decoded_anchor;
    out["long_frames_decoded_seeking"] = decoded_seek;
    out["long_same_frames"] = same;
    out["frame_48_s_seeking"] = near_s;
    out["frame_48_s_from_start"] = near_anchor_s;
    std::cout << fmt::format(
        "long source {}x{}, {} frames: a {}-frame clip (stride 2) at a drawn start: seeking {:.3f} s, from the start "
        "{:.3f} s (anchor): {:.1f}x; frames decoded {} vs {}; same frames: {}; frame 48 alone: seeking {:.3f} s, from "
        "the start {:.3f} s\n",
        width, height, long_frames, clip_frames, seek_s / static_cast<double>(reads),
        anchor_s / static_cast<double>(reads), anchor_s / seek_s, decoded_seek, decoded_anchor, same ? "yes" : "NO",
        near_s, near_anchor_s);
    if (flag(argc, argv, "--long-only", 0) != 0) {
      megaslide::io::remove_tree(dir);
      std::cout << out.dump() << "\n";
      return same ? 0 : 1;
    }
  }

  // Decode: the anchor decodes every frame; the dataset decodes up to the clip's last frame, converts
  // only the planned ones, resizes and crops.
  const auto dataset = megaslide::VideoDataset::open(config.data, 1);
  start = std::chrono::steady_clock::now();
  int64_t all_frames = 0;
  for (int64_t i = 0; i < dataset.size(); ++i) all_frames += megaslide::io::read_video(dataset.item(i).path).size(0);
  const double anchor_s = seconds_since(start);
  start = std::chrono::steady_clock::now();
  int64_t clip_total = 0;
  for (int64_t i = 0; i < dataset.size(); ++i) clip_total += dataset.load(i, 0).size(0);
  const double load_s = seconds_since(start);
  out["decode_all_frames_per_s"] = static_cast<double>(all_frames) / anchor_s;
  out["load_clip_frames_per_s"] = static_cast<double>(clip_total) / load_s;
  out["load_clips_per_s"] = static_cast<double>(dataset.size()) / load_s;
  std::cout << fmt::format(
      "decode {}x{} H.264, one thread: every frame {:.0f} frames/s (anchor); clips of {} frames (stride 2, resize to "
      "{}, crop) {:.0f} "
      "frames/s, {:.1f} clips/s\n",
      width, height, static_cast<double>(all_frames) / anchor_s, clip_frames, size,
      static_cast<double>(clip_total) / load_s, static_cast<double>(dataset.size()) / load_s);

  // The cache.
  megaslide::CacheBuildOptions cache_options;
  cache_options.out = dir + "/cache";
  cache_options.threads = std::max<int64_t>(1, workers);
  start = std::chrono::steady_clock::now();
  megaslide::build_latent_cache(config, cache_options);
  out["cache_build_s"] = seconds_since(start);

  auto train = [&](int64_t w, const std::string& cache) {
    auto c = config;
    c.data.workers = w;
    c.data.cache = cache;
    megaslide::Trainer trainer = megaslide::make_trainer(c);  // offload.enabled: false
    trainer.step();                                           // warm-up (and the first batch, which nothing can hide)
    double wait = 0.0, total = 0.0;
    for (int64_t s = 1; s < steps; ++s) {
      const auto m = trainer.step();
      wait += m.data_wait_s;
      total += m.step_time_s;
    }
    return std::make_pair(wait / total, total / static_cast<double>(steps - 1));
  };
  for (const auto& [name, w, cache] : {std::make_tuple("decode_inline", int64_t{0}, std::string()),
                                       std::make_tuple("decode_background", workers, std::string()),
                                       std::make_tuple("cache_inline", int64_t{0}, dir + "/cache"),
                                       std::make_tuple("cache_background", workers, dir + "/cache")}) {
    const auto [fraction, step_s] = train(w, cache);
    out[std::string(name) + "_wait_fraction"] = fraction;
    out[std::string(name) + "_step_s"] = step_s;
    std::cout << fmt::format("{:18s} workers {}: {:.3f} s/step, waiting for data {:.1f} % of it\n", name, w, step_s,
                             100.0 * fraction);
  }
  // Reading the cache: every item through LatentCache::load (the mapped shard, the item's CRC-32 checked)
  // and copied out, as a worker does; the anchor copies the same bytes from memory (same run).
  {
    auto c = config;
    c.data.cache = dir + "/cache";
    const auto cache = megaslide::LatentCache::open(c, c.data.cache);
    const int64_t reps = 20;
    int64_t bytes = 0;
    start = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < reps; ++r)
      for (int64_t i = 0; i < cache->size(); ++i) bytes += cache->load(i, 0).video.clone().nbytes();
    const double read_s = seconds_since(start);
    auto source = torch::empty({bytes / reps}, torch::kUInt8).fill_(1);
    start = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < reps; ++r) source.clone();
    const double copy_s = seconds_since(start);
    out["cache_read_items_per_s"] = static_cast<double>(reps * cache->size()) / read_s;
    out["cache_read_mb_per_s"] = static_cast<double>(bytes) / read_s / 1e6;
    out["memory_copy_mb_per_s"] = static_cast<double>(bytes) / copy_s / 1e6;
    std::cout << fmt::format(
        "cache read (mapped, CRC-32 checked, copied): {:.0f} items/s, {:.0f} MB/s; memory copy (anchor) {:.0f} MB/s\n",
        static_cast<double>(reps * cache->size()) / read_s, static_cast<double>(bytes) / read_s / 1e6,
        static_cast<double>(bytes) / copy_s / 1e6);
  }
  megaslide::io::remove_tree(dir);
  std::cout << out.dump() << "\n";
  return 0;
}
