// The latent and text cache: a round trip gives the decoded clips and the tokenizer's ids bit for bit; an
// interrupted build resumes keeping the shards that verify (and rewrites one that does not), ending with
// the same files as an uninterrupted build; a stale cache (changed source, other decode settings or
// encoder, an item it lacks) and a corrupted item are refused naming them; training from the cache equals
// training from decoding, resuming either is bit-exact (in memory, and from a checkpoint while switching
// from decoding to the cache); the streamed trainer trains on bucketed videos as the resident one; on a
// GPU, pinned batches arrive as on the CPU.
#include "megaslide/data/latent_cache.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cmath>
#include <set>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "megaslide/data/video_dataset.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/frozen_encoders.h"
#include "megaslide/model/umt5_encoder.h"
#include "megaslide/model/umt5_tokenizer.h"
#include "megaslide/model/wan_vae.h"
#include "trainers.h"
#include "megaslide/train/training_run.h"
#include "video_fixture.h"

using namespace megaslide::testing;
using megaslide::Trainer;

using megaslide::DatasetError;
using megaslide::LatentCache;
using megaslide::RunConfig;
using megaslide::testing::VideoFixture;

namespace {

RunConfig video_config(const VideoFixture& fx, const std::string& cache = "",
                       const std::string& clip_start = "center") {
  std::vector<std::string> sets{"data.dataset=videos",
                                "data.clip_start=" + clip_start,
                                "data.manifest=" + fx.dir + "/opensora.csv",
                                "data.frames=4",
                                "data.height=16",
                                "data.width=16",
                                "data.frame_stride=2",
                                "data.max_bad_fraction=0.5",
                                "data.workers=2",
                                "train.batch_size=2",
                                "train.steps=8",
                                "train.device=cpu",
                                "offload.enabled=false",
                                "output.progress=false"};
  if (!cache.empty()) sets.push_back("data.cache=" + cache);
  return megaslide::parse_run_config("", "test", sets);
}

megaslide::CacheBuildResult build(const RunConfig& c, const std::string& out, int64_t shard_items = 2,
                                  std::function<void(int64_t, int64_t, int64_t)> progress = {}) {
  megaslide::CacheBuildOptions o;
  o.out = out;
  o.shard_items = shard_items;
  o.threads = 2;
  o.on_progress = std::move(progress);
  return megaslide::build_latent_cache(c, o);
}

std::string expect_refused(const RunConfig& c, const std::string& dir) {
  try {
    LatentCache::open(c, dir);
  } catch (const DatasetError& e) {
    return e.what();
  }
  ADD_FAILURE() << "the cache was accepted";
  return "";
}

}  // namespace

// The property: two builds into one folder do not run at once (they would write the same shards): the
// second is refused at once naming the first's pid and host, and writes nothing; once the first is done
// the folder builds.
TEST(LatentCache, ASecondBuildIntoTheSameFolderIsRefusedWhileTheFirstRuns) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cache-lock", 5, 12, 16, 16);
  const auto c = video_config(fx);
  const std::string dir = fx.dir + "/cache";
  megaslide::io::make_directories(dir);
  std::string holder;
  auto first = megaslide::io::FileLock::try_acquire(dir + "/.lock", "megaslide-cache", &holder);  // the first build
  ASSERT_TRUE(first);
  try {
    build(c, dir, 2);
    ADD_FAILURE() << "a second build ran beside the first";
  } catch (const megaslide::DatasetError& e) {
    EXPECT_NE(std::string(e.what()).find("being written by another megaslide-cache: pid " + std::to_string(::getpid())),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(megaslide::io::path_exists(dir + "/cache.json")) << "the refused build wrote nothing";
  first.reset();
  EXPECT_EQ(build(c, dir, 2).items, 5);
}

TEST(LatentCache, RoundTripGivesTheDecodedClipsAndIdsBitForBit) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cache-roundtrip", 5, 12, 48, 64);
  const auto c = video_config(fx);
  const std::string dir = fx.dir + "/cache";
  const auto r = build(c, dir, 2);
  EXPECT_EQ(r.items, 5);
  EXPECT_EQ(r.shards, 3);
  EXPECT_EQ(r.bad.size(), 3u);  // corrupt, short, missing
  const auto cache = LatentCache::open(c, dir);
  const auto ds = megaslide::VideoDataset::open(c.data, 1);
  ASSERT_EQ(cache->size(), ds.size());
  megaslide::CaptionTokenizer tokenizer;
  for (int64_t i = 0; i < cache->size(); ++i) {
    const auto s = cache->load(i, 5);  // the epoch does not matter: the cache holds epoch 0's clip
    EXPECT_EQ(cache->caption(i), fx.captions[static_cast<size_t>(i)]);
    EXPECT_TRUE(torch::equal(s.video, ds.load(i, 0))) << "item " << i;
    EXPECT_TRUE(torch::equal(s.text_ids, torch::tensor(tokenizer.encode(cache->caption(i), c.data.max_text_tokens))));
    EXPECT_TRUE(torch::equal(s.text_mask, s.text_ids.ne(0)));
  }
  EXPECT_TRUE(
      torch::equal(cache->empty_prompt().text_ids, torch::tensor(tokenizer.encode("", c.data.max_text_tokens))));
  EXPECT_EQ(cache->bad().size(), 3u);
}

TEST(LatentCache, AnInterruptedBuildResumesAndEndsWithTheSameFiles) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cache-resume", 5, 12, 48, 64);
  const auto c = video_config(fx);
  const std::string full = fx.dir + "/full", part = fx.dir + "/part";
  build(c, full, 2);
  // Interrupted after the second shard (items 0-3 done).
  EXPECT_THROW(build(c, part, 2,
                     [](int64_t done, int64_t, int64_t) {
                       if (done == 4) throw std::runtime_error("killed");
                     }),
               std::runtime_error);
  EXPECT_NE(expect_refused(c, part).find("incomplete"), std::string::npos);
  {
    // Refused for a bad item found decoding (a clip broken after the listing probed it: 4 of 8 bad, above 0.4): the
    // cache stays incomplete, and a run reading it says megaslide-cache refused its data, not that it was cut short.
    VideoFixture broken("cache-refused", 5, 12, 48, 64);
    auto strict_broken = video_config(broken);
    strict_broken.data.max_bad_fraction = 0.4;
    const std::string refused_dir = broken.dir + "/cache";
    EXPECT_THROW(build(strict_broken, refused_dir, 2,
                       [&](int64_t done, int64_t, int64_t) {
                         if (done == 2) broken.write("videos/clip-4.mp4", "garbage now");
                       }),
                 DatasetError);
    const auto why = expect_refused(strict_broken, refused_dir);
    EXPECT_NE(why.find("is incomplete: megaslide-cache refused its data (dataset '"), std::string::npos) << why;
    EXPECT_NE(why.find("4 of 8 items are bad, more than data.max_bad_fraction (0.4) allows); remove or fix"),
              std::string::npos)
        << why;
  }
  // Damage the first shard: it must be written again, the second kept.
  {
    std::fstream f(part + "/shard-00000.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');
  }
  std::vector<std::string> warnings;
  megaslide::CacheBuildOptions o;
  o.out = part, o.shard_items = 2, o.threads = 1;
  o.on_warning = [&](const std::string& w) { warnings.push_back(w); };
  const auto r = megaslide::build_latent_cache(c, o);
  EXPECT_EQ(r.shards_reused, 1);
  EXPECT_EQ(r.shards, 2);
  EXPECT_EQ(r.items, 5);
  bool warned = false;
  for (const auto& w : warnings)
    warned |= w.find("shard-00000") != std::string::npos && w.find("does not verify") != std::string::npos;
  EXPECT_TRUE(warned);
  for (const char* f :
       {"shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors", "empty_prompt.safetensors"})
    EXPECT_EQ(megaslide::io::read_file(part + "/" + f), megaslide::io::read_file(full + "/" + f)) << f;
  EXPECT_NO_THROW(LatentCache::open(c, part));
  // Run again on a complete cache: everything kept.
  const auto again = build(c, part, 2);
  EXPECT_EQ(again.shards_reused, 3);
  EXPECT_EQ(again.shards, 0);
}

TEST(LatentCache, AStaleCacheIsRefusedNamingWhatChanged) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cache-stale", 3, 12, 48, 64);
  const auto c = video_config(fx);
  const std::string dir = fx.dir + "/cache";
  build(c, dir, 2);
  ASSERT_NO_THROW(LatentCache::open(c, dir));
  auto other = video_config(fx);
  other.data.frames = 2;
  EXPECT_NE(expect_refused(other, dir).find("decode settings"), std::string::npos);
  other = video_config(fx);
  other.data.max_text_tokens = 20;
  EXPECT_NE(expect_refused(other, dir).find("encoders"), std::string::npos);
  // Building into a folder of another config's cache is refused too (nothing overwritten).
  EXPECT_THROW(build(other, dir, 2), DatasetError);
  // A source touched since (mtime) is named.
  const std::string clip1 = fx.dir + "/videos/clip-1.mp4";
  struct timespec times[2] = {{0, UTIME_OMIT}, {1234567, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, clip1.c_str(), times, 0), 0);
  auto what = expect_refused(c, dir);
  EXPECT_NE(what.find("stale"), std::string::npos) << what;
  EXPECT_NE(what.find(clip1 + ": the source changed"), std::string::npos) << what;
  // An item added to the manifest is not in the cache.
  build(c, dir, 2);  // refreshed: shard of clip-1 rewritten
  ASSERT_NO_THROW(LatentCache::open(c, dir));
  // An edited caption is named (it trained on the old caption's embeddings), and a build rewrites its shard.
  const std::string csv = megaslide::io::read_file(fx.dir + "/opensora.csv");
  const auto at = csv.find("moves left clip 1");
  ASSERT_NE(at, std::string::npos) << csv;
  megaslide::io::write_file_atomically(fx.dir + "/opensora.csv",
                                       csv.substr(0, at) + "moves right clip 1" + csv.substr(at + 17));
  what = expect_refused(c, dir);
  EXPECT_NE(what.find(clip1 + ": its caption changed since it was cached"), std::string::npos) << what;
  EXPECT_EQ(build(c, dir, 2).shards_reused, 1);  // clip-1's shard written again, the other kept
  ASSERT_NO_THROW(LatentCache::open(c, dir));
  std::ofstream(fx.dir + "/opensora.csv", std::ios::app) << "videos/clip-0.mp4,\"again\",12\n";
  what = expect_refused(c, dir);
  EXPECT_NE(what.find("listed but not in the cache"), std::string::npos) << what;
  // The build the refusal asks for updates the cache (it refused a dataset with another count of items).
  const auto updated = build(c, dir, 2);
  EXPECT_GE(updated.shards_reused, 1);
  EXPECT_NO_THROW(LatentCache::open(c, dir));
  // A video that was bad when cached and has been replaced since (fixed) is named: it stayed skipped.
  megaslide::io::write_file_atomically(fx.dir + "/videos/corrupt.mp4",
                                       megaslide::io::read_file(fx.dir + "/videos/clip-0.mp4"));
  what = expect_refused(c, dir);
  EXPECT_NE(what.find("corrupt.mp4: was a bad item when cached and has changed since"), std::string::npos) << what;

  // A folder's video without a caption file is a bad item of the listing; given one, it is usable and the cache that
  // skips it is stale; the caption file removed again, the cache that holds it is stale (it would train on the old
  // caption). Each time the build the refusal asks for updates the cache.
  auto folder = video_config(fx);
  folder.data.manifest.clear();
  folder.data.root = fx.dir + "/videos";
  const std::string folder_cache = fx.dir + "/folder-cache";
  build(folder, folder_cache, 2);
  ASSERT_NO_THROW(LatentCache::open(folder, folder_cache));
  const std::string nocaption = fx.dir + "/videos/nocaption.mp4";
  megaslide::io::write_file_atomically(fx.dir + "/videos/nocaption.txt", "a caption at last\n");
  what = expect_refused(folder, folder_cache);
  EXPECT_NE(what.find(nocaption + ": usable now, a bad item of the listing when cached"), std::string::npos) << what;
  build(folder, folder_cache, 2);
  ASSERT_NO_THROW(LatentCache::open(folder, folder_cache));
  megaslide::io::remove_tree(fx.dir + "/videos/nocaption.txt");
  what = expect_refused(folder, folder_cache);
  EXPECT_NE(what.find(nocaption + ": a bad item of the listing now"), std::string::npos) << what;
  build(folder, folder_cache, 2);
  EXPECT_NO_THROW(LatentCache::open(folder, folder_cache));
}

// The property: the same files are the same cache whatever working directory or spelling names them: a cache built
// from a relative data.manifest opens, and rebuilds reusing every shard, from another working directory with an
// absolute spelling holding "." and ".."; one recorded with relative paths (as caches were before) still opens
// from the directory they were relative to.
TEST(LatentCache, TheSameFilesSpelledOtherwiseAreTheSameCache) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cache-spelling", 3, 12, 16, 16);
  char was[4096];
  ASSERT_NE(::getcwd(was, sizeof was), nullptr);
  auto relative = video_config(fx);
  relative.data.manifest = "opensora.csv";
  const std::string dir = fx.dir + "/cache";
  ASSERT_EQ(::chdir(fx.dir.c_str()), 0);
  const auto built = build(relative, dir, 2);
  ASSERT_EQ(::chdir("/"), 0);
  auto absolute = video_config(fx);
  absolute.data.manifest = fx.dir + "/./videos/../opensora.csv";
  EXPECT_NO_THROW(LatentCache::open(absolute, dir));
  const auto again = build(absolute, dir, 2);
  EXPECT_EQ(again.shards_reused, built.shards);
  // The manifest's own entries spelled with "./" and "..": the same items.
  const std::string csv = megaslide::io::read_file(fx.dir + "/opensora.csv");
  std::string dotted;
  for (size_t at = 0, next; at < csv.size(); at = next + 1) {
    next = csv.find('\n', at);
    if (next == std::string::npos) next = csv.size();
    const std::string line = csv.substr(at, next - at);
    dotted += (line.rfind("videos/", 0) == 0 ? "./videos/../" : "") + line + "\n";
  }
  megaslide::io::write_file_atomically(fx.dir + "/opensora.csv", dotted);
  EXPECT_NO_THROW(LatentCache::open(absolute, dir));
  EXPECT_EQ(build(absolute, dir, 2).shards_reused, built.shards);
  // Recorded relative (the source and every item's path): opened from the folder they are relative to.
  auto manifest = nlohmann::json::parse(megaslide::io::read_file(dir + "/cache.json"));
  EXPECT_EQ(manifest["dataset"]["source"], fx.dir + "/opensora.csv");
  manifest["dataset"]["source"] = "opensora.csv";
  const std::string prefix = fx.dir + "/";
  int64_t paths = 0;
  for (auto& shard : manifest["shards"])
    for (auto* list : {&shard["items"], &shard["sources"]})
      for (auto& item : *list) {
        const std::string path = item["path"];
        ASSERT_EQ(path.compare(0, prefix.size(), prefix), 0) << path;
        item["path"] = path.substr(prefix.size());
        ++paths;
      }
  EXPECT_EQ(paths, 2 * 3) << "each item's path in its shard's items and sources";
  megaslide::io::write_file_atomically(dir + "/cache.json", manifest.dump(1));
  ASSERT_EQ(::chdir(fx.dir.c_str()), 0);
  EXPECT_NO_THROW(LatentCache::open(absolute, dir));
  EXPECT_NO_THROW(LatentCache::open(relative, dir));
  ASSERT_EQ(::chdir(was), 0);
}

TEST(LatentCache, ACorruptedItemFailsItsChecksum) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cache-crc", 3, 12, 48, 64);
  const auto c = video_config(fx);
  const std::string dir = fx.dir + "/cache";
  build(c, dir, 4);
  {
    const auto header = megaslide::io::read_safetensors_header(dir + "/shard-00000.safetensors");
    uint64_t offset = 0;
    for (const auto& e : header.entries)
      if (e.name == "1.latents") offset = header.data_start + e.begin + 17;
    std::fstream f(dir + "/shard-00000.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(offset));
    const char old = static_cast<char>(f.get());
    f.seekp(static_cast<std::streamoff>(offset));
    f.put(static_cast<char>(old ^ 1));
  }
  // A byte of the last item's text tensors too (they were not checked: trained on silently).
  {
    const auto header = megaslide::io::read_safetensors_header(dir + "/shard-00000.safetensors");
    int64_t last = -1;
    for (const auto& e : header.entries)
      if (e.name.find(".latents") != std::string::npos) last = std::max<int64_t>(last, std::stoll(e.name));
    uint64_t offset = 0;
    for (const auto& e : header.entries)
      if (e.name.rfind(std::to_string(last) + ".text", 0) == 0) offset = header.data_start + e.begin;
    ASSERT_GT(offset, 0u);
    std::fstream f(dir + "/shard-00000.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(offset));
    const char old = static_cast<char>(f.get());
    f.seekp(static_cast<std::streamoff>(offset));
    f.put(static_cast<char>(old ^ 4));
  }
  const auto cache = LatentCache::open(c, dir);
  EXPECT_NO_THROW(cache->load(0, 0));
  try {
    cache->load(1, 0);
    FAIL();
  } catch (const DatasetError& e) {
    EXPECT_NE(std::string(e.what()).find("CRC-32"), std::string::npos) << e.what();
  }
  try {
    cache->load(cache->size() - 1, 0);
    FAIL() << "a corrupted text tensor was loaded";
  } catch (const DatasetError& e) {
    EXPECT_NE(std::string(e.what()).find("the text (and image) tensors of item"), std::string::npos) << e.what();
  }
  // A manifest whose item reaches past its shard (it ended training with SIGBUS) is refused at open, and so is an
  // empty prompt that does not match its CRC-32.
  const std::string manifest_text = megaslide::io::read_file(dir + "/cache.json");
  auto manifest = nlohmann::json::parse(manifest_text);
  manifest["shards"][0]["items"][0]["bytes"] = 1000000000;
  megaslide::io::write_file_atomically(dir + "/cache.json", manifest.dump(1));
  EXPECT_NE(expect_refused(c, dir).find("are not the shard's"), std::string::npos);
  megaslide::io::write_file_atomically(dir + "/cache.json", manifest_text);
  const std::string empty = megaslide::io::read_file(dir + "/empty_prompt.safetensors");
  std::string flipped = empty;
  flipped.back() = static_cast<char>(flipped.back() ^ 1);
  megaslide::io::write_file_atomically(dir + "/empty_prompt.safetensors", flipped);
  EXPECT_NE(expect_refused(c, dir).find("empty_prompt.safetensors does not match"), std::string::npos);
  megaslide::io::write_file_atomically(dir + "/empty_prompt.safetensors", empty);
  // Training from the cache: one bad item of 3 is more than data.max_bad_fraction allows, and the refusal gives the
  // item's reason (it once said only "failed to load").
  try {
    megaslide::Trainer trainer = resident_trainer(video_config(fx, dir));
    for (int step = 0; step < 3; ++step) trainer.step();
    FAIL() << "trained past a corrupted item";
  } catch (const DatasetError& e) {
    EXPECT_NE(std::string(e.what()).find("CRC-32"), std::string::npos) << e.what();
  }
}

TEST(LatentCache, TrainingFromTheCacheEqualsTrainingFromDecodingAndResumesBitExact) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cache-train", 5, 12, 48, 64);
  const std::string dir = fx.dir + "/cache";
  build(video_config(fx), dir, 2);
  auto losses = [](const RunConfig& c, int steps) {
    megaslide::Trainer t = resident_trainer(c);
    std::vector<double> out;
    for (int i = 0; i < steps; ++i) out.push_back(t.step().loss);
    return std::make_pair(out, t.training_state());
  };
  // 5 items in batches of 2: 3 batches an epoch, so 7 steps cross two epoch boundaries.
  const auto [decoded, decoded_state] = losses(video_config(fx), 7);
  const auto [cached, cached_state] = losses(video_config(fx, dir), 7);
  ASSERT_EQ(decoded.size(), cached.size());
  for (size_t i = 0; i < decoded.size(); ++i) EXPECT_EQ(decoded[i], cached[i]) << "step " << i + 1;
  for (size_t i = 0; i < decoded_state.master.size(); ++i)
    EXPECT_TRUE(torch::equal(decoded_state.master[i].second, cached_state.master[i].second))
        << decoded_state.master[i].first;
  EXPECT_EQ(decoded_state.data_state, cached_state.data_state);
  // Resume after 3 steps (the state as a checkpoint holds it), from the cache and from decoding — with
  // random clip starts and crops, whose draws differ every epoch.
  const auto random_config = [&](const std::string& cache) {
    auto c = video_config(fx, cache, "random");
    c.data.crop = "random";
    return c;
  };
  const auto [random_decoded, unused] = losses(random_config(""), 7);
  EXPECT_NE(random_decoded, decoded) << "random draws changed nothing";
  for (const auto& [c, straight] :
       {std::make_pair(video_config(fx, dir), decoded), std::make_pair(random_config(""), random_decoded)}) {
    megaslide::Trainer first = resident_trainer(c);
    for (int i = 0; i < 3; ++i) first.step();
    const auto state = first.training_state();
    megaslide::Trainer second = resident_trainer(c);
    second.load_training_state(state);
    for (int i = 3; i < 7; ++i)
      EXPECT_EQ(second.step().loss, straight[static_cast<size_t>(i)])
          << "step " << i + 1 << " cache '" << c.data.cache << "'";
  }
}

TEST(LatentCache, TheStreamedTrainerTrainsOnBucketedVideosLikeTheResidentOne) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  // Clips 0-2 landscape, 3-4 portrait: two buckets (2 + 1 batches an epoch), batches of either shape.
  VideoFixture fx("cache-streamed", 5, 12, 48, 64, {3, 4});
  auto c = video_config(fx);
  // Buckets of 12x16 (the landscape clips' own aspect) and 16x8 (nearer the portrait ones' 4:3 than
  // 12x16 is), of different token counts.
  c.data.buckets = {{4, 12, 16}, {4, 16, 8}};
  c.data.frames = 4, c.data.height = 16, c.data.width = 16;
  c.offload.compute_dtype = "fp32";
  const std::string dir = fx.dir + "/cache";
  build(c, dir, 4);
  c.data.cache = dir;
  megaslide::Trainer resident = resident_trainer(c);
  auto sc = c;
  sc.offload.enabled = true;
  megaslide::Trainer streamed = streamed_trainer(sc);
  // Throughput counts the tokens of each step's own bucket (4x12x16 or 4x16x8 pixels: 3 to 2), not the
  // largest one's every step.
  std::set<int64_t> tokens_per_step;
  for (int i = 0; i < 6; ++i) {
    const auto a = resident.step(), b = streamed.step();
    EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::max(1.0, std::abs(a.loss))) << "step " << i + 1;
    EXPECT_GE(b.data_wait_s, 0.0);
    const auto tokens = [](const megaslide::StepMetrics& m) { return std::llround(m.tokens_per_s * m.step_time_s); };
    EXPECT_EQ(tokens(a), tokens(b)) << "step " << i + 1;
    tokens_per_step.insert(tokens(a));
  }
  EXPECT_EQ(dit_batches(resident).state(), dit_batches(streamed).state());
  const auto& p = c.model.patch;
  const auto tokens_of = [&](int64_t f, int64_t h, int64_t w) {
    return c.train.batch_size * (f / p[0]) * (h / p[1]) * (w / p[2]);
  };
  EXPECT_EQ(tokens_per_step, (std::set<int64_t>{tokens_of(4, 12, 16), tokens_of(4, 16, 8)}))
      << "both buckets' batches, each counted at its own size";
}

TEST(LatentCache, PinnedBatchesReachTheGpuAsOnTheCpu_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cache-cuda", 4, 12, 48, 64);
  auto c = video_config(fx);
  const std::string dir = fx.dir + "/cache";
  build(c, dir, 2);
  for (const std::string& cache : {std::string(), dir}) {
    auto gpu = c, cpu = c;
    gpu.data.cache = cpu.data.cache = cache;
    gpu.train.device = "cuda";
    megaslide::DiffusionBatchSource on_gpu(gpu), on_cpu(cpu);
    for (int i = 0; i < 4; ++i) {
      const auto a = on_gpu.next(torch::Device(torch::kCUDA, 0)), b = on_cpu.next(torch::kCPU);
      EXPECT_TRUE(torch::equal(a.x0.cpu(), b.x0)) << "batch " << i << " cache '" << cache << "'";
      EXPECT_TRUE(torch::equal(a.noise.cpu(), b.noise));
      EXPECT_TRUE(torch::equal(a.text_ids.cpu(), b.text_ids));
    }
  }
  megaslide::LoaderOptions o;
  o.pin_memory = true;
  auto cache = LatentCache::open(c, dir);
  std::vector<int64_t> buckets(static_cast<size_t>(cache->size()), 0);
  megaslide::ClipLoader loader(cache, megaslide::BucketBatchSampler(buckets, 1, 2, 0), o);
  EXPECT_TRUE(loader.next().video.is_pinned());
}

TEST(LatentCache, ARunResumedFromItsCheckpointMaySwitchFromDecodingToTheCache) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cache-resume-run", 5, 12, 48, 64);
  const std::string dir = fx.dir + "/cache";
  build(video_config(fx), dir, 2);
  auto losses_of = [](const std::string& run) {
    std::vector<std::string> out;
    std::istringstream in(megaslide::io::read_file(run + "/metrics.jsonl"));
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line)["loss"].dump());
    return out;
  };
  auto straight = video_config(fx);
  straight.train.steps = 6;
  straight.output.run_dir = fx.dir + "/straight";
  megaslide::run_training(straight, {});
  auto stopped = straight;
  stopped.output.run_dir = fx.dir + "/stopped";
  stopped.train.steps = 3;
  stopped.train.checkpoint_every = 3;
  megaslide::run_training(stopped, {});
  auto resumed = stopped;
  resumed.train.steps = 6;
  resumed.data.cache = dir;  // decoded before the checkpoint, read from the cache after it
  resumed.data.workers = 0;
  megaslide::TrainingRunOptions options;
  options.resume = "latest";
  megaslide::run_training(resumed, options);
  EXPECT_EQ(losses_of(stopped.output.run_dir), losses_of(straight.output.run_dir));
}

// ---- Caches of frozen encoders: umT5 and the Wan VAE (Wan), CLIP and the SD VAE (the DiT family) ----

namespace {

std::string fixture(const std::string& relative) {
  return std::string(MEGASLIDE_SOURCE_DIR) + "/tests/fixtures/" + relative;
}

// A tiny Wan over the videos: pixel clips of 5 frames of 32x32 -> Wan VAE latents 16 x 2 x 4 x 4; umT5's
// embeddings 512 x 24. fp32 compute pinned (this CPU would pick bf16).
RunConfig wan_video_config(const VideoFixture& fx, const std::string& cache = "", std::vector<std::string> extra = {}) {
  std::vector<std::string> sets{"model.arch=wan",
                                "model.wan.dim=24",
                                "model.wan.layers=2",
                                "model.wan.heads=2",
                                "model.wan.ffn_dim=40",
                                "model.wan.freq_dim=16",
                                "model.wan.text_dim=24",
                                "model.wan.in_channels=16",
                                "model.wan.out_channels=16",
                                "model.text_encoder.kind=umt5",
                                "model.text_encoder.weights=" + fixture("umt5/hf"),
                                "model.text_encoder.vocab=" + fixture("umt5/tokenizer/spiece.model"),
                                "model.vae.kind=wan",
                                "model.vae.weights=" + fixture("wan_vae/tiny"),
                                "model.vae.latent_channels=16",
                                "data.dataset=videos",
                                "data.channels=3",
                                "data.clip_start=center",
                                "data.manifest=" + fx.dir + "/opensora.csv",
                                "data.frames=5",
                                "data.height=32",
                                "data.width=32",
                                "data.frame_stride=2",
                                "data.max_bad_fraction=0.5",
                                "diffusion.objective=flow",
                                "diffusion.shift=3.0",
                                "diffusion.caption_dropout=0.3",
                                "train.batch_size=2",
                                "train.steps=8",
                                "train.lr=0.002",
                                "train.warmup_steps=0",
                                "train.device=cpu",
                                "train.seed=5",
                                "offload.enabled=false",
                                "offload.compute_dtype=fp32",
                                "output.progress=false"};
  if (!cache.empty()) sets.push_back("data.cache=" + cache);
  sets.insert(sets.end(), extra.begin(), extra.end());
  return megaslide::parse_run_config("", "test", sets);
}

// What the encoders give directly for item i of the dataset (epoch 0's clip), as Wan's pipeline runs them.
struct WanDirect {
  torch::Tensor latents, text, empty_text;
};
WanDirect wan_direct(const RunConfig& c) {
  const auto ds = megaslide::VideoDataset::open(c.data, 1);
  const auto vae = megaslide::WanVae::load(fixture("wan_vae/tiny"));
  const auto umt5 = megaslide::Umt5Encoder::load(fixture("umt5/hf"));
  const auto tokenizer = megaslide::Umt5Tokenizer::from_file(fixture("umt5/tokenizer/spiece.model"));
  auto text_of = [&](const std::string& caption) {
    const auto tokens = tokenizer.encode({megaslide::wan_prompt_clean(caption)}, 512);
    return umt5.embed(tokens.ids, tokens.mask)[0];
  };
  std::vector<torch::Tensor> latents, text;
  for (int64_t i = 0; i < ds.size(); ++i) {
    const auto pixels = ds.load(i, 0).permute({3, 0, 1, 2}).unsqueeze(0).to(torch::kFloat32) / 127.5 - 1.0;
    latents.push_back(vae.encode(pixels)[0]);
    text.push_back(text_of(ds.item(i).caption));
  }
  return {torch::stack(latents), torch::stack(text), text_of("")};
}

std::vector<double> wan_losses(const RunConfig& c, megaslide::WanLatentData data, int steps) {
  megaslide::Trainer t = wan_trainer(c, std::move(data));
  std::vector<double> out;
  for (int i = 0; i < steps; ++i) out.push_back(t.step().loss);
  return out;
}

}  // namespace

// The cache of a Wan config holds the Wan VAE's normalised latents and umT5's 512-token embeddings (zero
// past the prompt) of every usable item, and the empty prompt's, equal to the encoders run directly.
TEST(WanCache, HoldsWhatTheWanVaeAndUmt5GiveDirectly) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  if (!megaslide::umt5_tokenizer_supported()) GTEST_SKIP() << "built without SentencePiece";
  VideoFixture fx("wancache-direct", 3, 12, 48, 64);
  const auto c = wan_video_config(fx);
  const std::string dir = fx.dir + "/cache";
  const auto r = build(c, dir, 2);
  EXPECT_EQ(r.items, 3);
  const auto data = megaslide::WanLatentData::from_cache(c, dir);
  const auto direct = wan_direct(c);
  // The items stay in the cache's shards: nothing of them is held, each read is a new float32 tensor.
  EXPECT_FALSE(data.latents.defined() || data.text.defined());
  ASSERT_EQ(data.size(), 3);
  ASSERT_EQ(data.sizes("latents"), (std::vector<int64_t>{3, 16, 2, 4, 4}));
  ASSERT_EQ(data.sizes("text"), (std::vector<int64_t>{3, 512, 24}));
  EXPECT_FALSE(data.sizes("image_latents").has_value()) << "text-to-video";
  const auto latents = data.rows("latents", {0, 1, 2}), text = data.rows("text", {0, 1, 2});
  EXPECT_TRUE(torch::equal(latents, direct.latents));
  EXPECT_TRUE(torch::equal(text, direct.text));
  EXPECT_TRUE(torch::equal(data.rows("text", {2, 0}), direct.text.index_select(0, torch::tensor({2, 0}))));
  EXPECT_TRUE(torch::equal(data.empty_text, direct.empty_text));
  EXPECT_GT(text.abs().sum().item<double>(), 0.0);
  EXPECT_EQ(text.slice(1, 40).abs().max().item<double>(), 0.0) << "Wan's convention: zero past the prompt";
  // The manifest says what made it.
  const auto m = nlohmann::json::parse(megaslide::io::read_file(dir + "/cache.json"));
  EXPECT_EQ(m["encoders"]["text_encoder"]["kind"], "umt5");
  EXPECT_EQ(m["encoders"]["text_encoder"]["max_tokens"], 512);
  EXPECT_EQ(m["encoders"]["vae"]["kind"], "wan");
  EXPECT_EQ(m["encoders"]["vae"]["files"][1]["file"], "diffusion_pytorch_model.safetensors");
  EXPECT_EQ(m["decode"]["frame_stride"], 2);
}

// A caption longer than the 512 tokens umT5 reads is cut there without changing the cache: the build says so once,
// with how many and the longest's item.
TEST(WanCache, CaptionsLongerThanUmt5ReadsAreNamed) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  if (!megaslide::umt5_tokenizer_supported()) GTEST_SKIP() << "built without SentencePiece";
  VideoFixture fx("wancache-long", 3, 12, 48, 64);
  std::istringstream rows(megaslide::io::read_file(fx.dir + "/opensora.csv"));
  std::string csv, row, long_item;
  for (int i = 0; std::getline(rows, row); ++i) {
    if (i == 1) {
      long_item = row.substr(0, row.find(','));
      std::string caption;
      for (int w = 0; w < 700; ++w) caption += "red blob moves left ";
      row = long_item + ",\"" + caption + "\",12";
    }
    csv += row + "\n";
  }
  megaslide::io::write_file_atomically(fx.dir + "/long.csv", csv);
  const auto c = wan_video_config(fx, "", {"data.manifest=" + fx.dir + "/long.csv"});
  std::vector<std::string> warnings;
  megaslide::CacheBuildOptions o;
  o.out = fx.dir + "/cache", o.shard_items = 2, o.threads = 1;
  o.on_warning = [&](const std::string& w) { warnings.push_back(w); };
  megaslide::build_latent_cache(c, o);
  int said = 0;
  for (const auto& w : warnings)
    if (w.find("1 caption is longer than the 512 tokens umT5 reads") != std::string::npos) {
      ++said;
      EXPECT_NE(w.find(long_item), std::string::npos) << w;
    }
  EXPECT_EQ(said, 1) << ::testing::PrintToString(warnings);
}

// Training Wan from the cache (each batch's items read from its shards) is training from the data.tensors file of
// the same latents and embeddings: the same losses, bit for bit (fp32; caption dropout draws the cached empty prompt
// as it draws the file's empty_text). An interrupted cache (not marked complete) and one of other encoders, sizes or
// frame sampling are refused, naming the mismatch.
TEST(WanCache, TrainingFromTheCacheEqualsTrainingFromTheTensorsFileAndMismatchesAreRefused) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  if (!megaslide::umt5_tokenizer_supported()) GTEST_SKIP() << "built without SentencePiece";
  VideoFixture fx("wancache-train", 3, 12, 48, 64);
  const std::string dir = fx.dir + "/cache";
  const auto c = wan_video_config(fx, dir);
  build(c, dir, 2);
  const auto direct = wan_direct(c);
  const std::string file = fx.dir + "/latents.safetensors";
  megaslide::io::write_safetensors(
      file, {{"latents", direct.latents}, {"text", direct.text}, {"empty_text", direct.empty_text}});
  const auto latent = megaslide::wan_latent_config(c);
  EXPECT_EQ(latent.data.dataset, "latent-tensors");
  EXPECT_EQ(latent.data.channels, 16);
  EXPECT_EQ(latent.data.frames, 2);
  EXPECT_EQ(latent.data.height, 4);
  // The run's own config (data.dataset videos, data.cache): the trainer reads each batch's items from the shards.
  std::vector<double> from_cache;
  {
    Trainer t = megaslide::make_trainer(c);
    for (int i = 0; i < 8; ++i) from_cache.push_back(t.step().loss);
  }
  const auto from_file = wan_losses(latent, megaslide::WanLatentData::load(file), 8);
  EXPECT_EQ(from_cache, from_file);
  EXPECT_EQ(wan_losses(latent, megaslide::WanLatentData::from_cache(c, dir), 8), from_file);
  auto no_dropout = latent;
  no_dropout.diffusion.caption_dropout = 0.0;
  EXPECT_NE(wan_losses(no_dropout, megaslide::WanLatentData::load(file), 8), from_file)
      << "caption dropout changed nothing";

  auto refused = [&](const RunConfig& other) {
    try {
      megaslide::WanLatentData::from_cache(other, dir);
    } catch (const DatasetError& e) {
      return std::string(e.what());
    }
    ADD_FAILURE() << "the cache was accepted";
    return std::string();
  };
  // Another umT5 file (ComfyUI's fp16 single file of the same model), another VAE file, other sizes and
  // frame sampling.
  auto what =
      refused(wan_video_config(fx, dir, {"model.text_encoder.weights=" + fixture("umt5/comfy_umt5_fp16.safetensors")}));
  EXPECT_NE(what.find("other encoders (text_encoder.files"), std::string::npos) << what;
  EXPECT_NE(what.find("comfy_umt5_fp16.safetensors"), std::string::npos)
      << what;  // the values that differ, not the rest
  EXPECT_EQ(what.find("diffusion_pytorch_model"), std::string::npos) << what;
  what = refused(wan_video_config(fx, dir, {"model.vae.weights=" + fixture("wan_vae/wan_2.1_vae_tiny.safetensors")}));
  EXPECT_NE(what.find("other encoders (vae.files"), std::string::npos) << what;
  what = refused(wan_video_config(fx, dir, {"data.frames=9"}));
  EXPECT_NE(what.find("other decode settings (buckets is [[5,32,32]] in the cache, [[9,32,32]] now)"),
            std::string::npos)
      << what;
  what = refused(wan_video_config(fx, dir, {"data.frame_stride=1"}));
  EXPECT_NE(what.find("other decode settings (frame_stride"), std::string::npos) << what;
  what = refused(wan_video_config(fx, dir, {"model.vae.tile_size=16"}));
  EXPECT_NE(what.find("other encoders (vae.tiling"), std::string::npos) << what;
  // Interrupted: the manifest is marked complete only after the last shard.
  const std::string manifest = megaslide::io::read_file(dir + "/cache.json");
  auto m = nlohmann::json::parse(manifest);
  m["complete"] = false;
  megaslide::io::write_file_atomically(dir + "/cache.json", m.dump(1));
  what = refused(c);
  EXPECT_NE(what.find("incomplete"), std::string::npos) << what;
  megaslide::io::write_file_atomically(dir + "/cache.json", manifest);

  // An item whose latents fail their CRC-32 is left out as a bad item, as the DiT family skips it (it used to end
  // the run): the other items are the encoders' in their order, the trainer hands the item to train.log once, and
  // more bad items than data.max_bad_fraction allows are refused, naming the item and its CRC-32.
  {
    const std::string shard = dir + "/shard-00000.safetensors";
    const auto header = megaslide::io::read_safetensors_header(shard);
    uint64_t offset = 0;
    for (const auto& e : header.entries)
      if (e.name == "1.latents") offset = header.data_start + e.begin + 5;
    ASSERT_GT(offset, 0u);
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(offset));
    const char old = static_cast<char>(f.get());
    f.seekp(static_cast<std::streamoff>(offset));
    f.put(static_cast<char>(old ^ 1));
  }
  // The fixture's six listed videos hold three bad ones already: 4 of 6 bad are within 0.7, not within 0.6.
  const auto lenient = wan_video_config(fx, dir, {"data.max_bad_fraction=0.7"});
  const auto kept = megaslide::WanLatentData::from_cache(lenient, dir);
  ASSERT_EQ(kept.size(), 2);
  ASSERT_EQ(kept.bad.size(), 4u);
  EXPECT_NE(kept.bad.back().reason.find("CRC-32"), std::string::npos) << kept.bad.back().reason;
  const auto rows = torch::tensor(std::vector<int64_t>{0, 2});
  EXPECT_TRUE(torch::equal(kept.rows("latents", {0, 1}), direct.latents.index_select(0, rows)));
  EXPECT_TRUE(torch::equal(kept.rows("text", {0, 1}), direct.text.index_select(0, rows)));
  EXPECT_EQ(kept.captions.size(), 2u);
  {
    megaslide::Trainer trainer = megaslide::testing::resident_trainer(lenient);
    const auto reported = trainer.take_new_bad_items();
    ASSERT_EQ(reported.size(), 4u);
    EXPECT_EQ(reported.back().path, kept.bad.back().path);
    EXPECT_TRUE(trainer.take_new_bad_items().empty()) << "reported once";
    EXPECT_NE(trainer.describe_data(8).find("2 usable items of 6 listed (4 bad"), std::string::npos)
        << trainer.describe_data(8);
    EXPECT_TRUE(std::isfinite(trainer.step().loss));
  }
  what = refused(wan_video_config(fx, dir, {"data.max_bad_fraction=0.6"}));
  EXPECT_NE(what.find("4 of 6 items are bad"), std::string::npos) << what;
  EXPECT_NE(what.find("CRC-32"), std::string::npos) << what;
}

// The DiT family's latent path: a cache of CLIP embeddings and SD VAE latents equals the frozen encoders'
// outputs, and training from it equals training from decoding (which runs the encoders every step).
TEST(LatentCache, ClipAndSdVaeCacheEqualsTheFrozenEncodersAndTrainsAsDecoding) {
  if (!megaslide::io::video_supported()) GTEST_SKIP() << "built without FFmpeg";
  VideoFixture fx("cache-clip-sd", 3, 12, 48, 64);
  const std::string dir = fx.dir + "/cache";
  auto config = [&](const std::string& cache) {
    auto c = video_config(fx, cache);
    c.model.text_encoder.kind = "clip";
    c.model.text_encoder.weights = fixture("clip/text_only");
    c.model.text_encoder.vocab = fixture("clip");
    c.model.vae.kind = "sd";
    c.model.vae.weights = fixture("vae/tiny");
    c.model.vae.latent_channels = 3;  // the tiny fixtures' sizes (configs/paper-small.yaml)
    c.model.vae.downscale = 4;
    c.model.text_dim = 32;
    c.model.dsa_kernel = {3, 3, 3};
    c.data.max_text_tokens = 16;
    c.data.height = 32;
    c.data.width = 32;
    c.diffusion.caption_dropout = 0.3;
    megaslide::validate(c, "test");
    return c;
  };
  RunConfig c;
  try {
    c = config("");
  } catch (const megaslide::ConfigError& e) {
    FAIL() << e.what();
  }
  const auto frozen = megaslide::FrozenEncoders::load(c, torch::kCPU, "test");
  build(c, dir, 2);
  const auto cache = LatentCache::open(config(dir), dir);
  const auto ds = megaslide::VideoDataset::open(c.data, 1);
  ASSERT_EQ(cache->size(), ds.size());
  for (int64_t i = 0; i < cache->size(); ++i) {
    const auto s = cache->load(i, 0);
    const auto pixels = ds.load(i, 0).permute({3, 0, 1, 2}).unsqueeze(0).to(torch::kFloat32) / 127.5 - 1.0;
    EXPECT_TRUE(torch::allclose(s.video, frozen->encode_video(pixels)[0], 1e-5, 1e-6)) << "item " << i;
    const auto [text, mask] = frozen->encode_text({ds.item(i).caption});
    EXPECT_TRUE(torch::equal(s.text, text[0])) << "item " << i;
    EXPECT_TRUE(torch::equal(s.text_mask, mask[0])) << "item " << i;
  }
  const auto [empty, empty_mask] = frozen->encode_text({""});
  EXPECT_TRUE(torch::equal(cache->empty_prompt().text, empty[0]));
  auto losses = [](const RunConfig& rc) {
    megaslide::Trainer t = resident_trainer(rc);
    std::vector<double> out;
    for (int i = 0; i < 5; ++i) out.push_back(t.step().loss);
    return out;
  };
  const auto decoded = losses(c), cached = losses(config(dir));
  ASSERT_EQ(decoded.size(), cached.size());
  for (size_t i = 0; i < decoded.size(); ++i) EXPECT_EQ(decoded[i], cached[i]) << "step " << i + 1;
}
