// Checkpoints (train/checkpoint.h, train/training_run.h): exact resume for both trainers, atomic saves,
// refusal of corrupt or mismatched checkpoints without touching the run's files, failed saves that keep
// the previous checkpoint, pruning, and non-finite steps skipped and counted.
#include <gtest/gtest.h>

#include <algorithm>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <functional>
#include <sstream>
#include <nlohmann/json.hpp>

#include "megaslide/megaslide.h"
#include "trainers.h"

using namespace megaslide::testing;

using namespace megaslide;

namespace {

// 4 frames of 8x8 (64 tokens per clip), 2 blocks of hidden 16: a step takes milliseconds. bf16 compute
// unless a case says otherwise (not `auto`, which is fp32 on CPUs without native bf16), so every machine
// tests the same paths.
RunConfig tiny(const std::string& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> s{"offload.compute_dtype=bf16",
                             "model.layers=2",
                             "model.dsa_kernel=[3,3,3]",
                             "data.frames=4",
                             "data.height=8",
                             "data.width=8",
                             "data.num_clips=16",
                             "train.steps=8",
                             "train.batch_size=2",
                             "train.lr=3e-3",
                             "train.warmup_steps=2",
                             "train.device=cpu",
                             "train.log_every=100",
                             "offload.optimizer_threads=1",
                             "output.progress=false",
                             "output.run_dir=" + dir};
  for (auto& e : extra) s.push_back(e);
  return parse_run_config("", "test", s);
}

std::string fresh_dir(const std::string& name) {
  auto dir = "/tmp/megaslide-test-ckpt-" + name + "-" + std::to_string(::getpid());
  io::remove_tree(dir);
  return dir;
}

std::vector<std::string> losses(const std::string& run_dir) {
  std::vector<std::string> out;
  std::ifstream in(io::join_path(run_dir, "metrics.jsonl"));
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line)["loss"].dump());  // exact decimal form
  return out;
}

void flip_byte(const std::string& path, uint64_t offset) {
  std::string bytes = io::read_file(path);
  ASSERT_LT(offset, bytes.size());
  bytes[offset] = static_cast<char>(bytes[offset] ^ 0x40);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

void truncate_file(const std::string& path, uint64_t keep) {
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(keep)), 0);
}

// Every file of a run folder outside checkpoints/, with its bytes (not .lock: every run that takes the
// folder, refused or not, writes its pid there).
std::map<std::string, std::string> run_files(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& name : io::list_directory(dir))
    if (!io::is_directory(io::join_path(dir, name)) && name != ".lock")
      out[name] = io::read_file(io::join_path(dir, name));
  return out;
}

}  // namespace

TEST(Checkpoint, Crc32MatchesTheStandardCheckValue) {
  // The CRC-32/ISO-HDLC check value (zlib, PNG): crc32("123456789") = 0xCBF43926, also when fed in pieces.
  EXPECT_EQ(io::crc32("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(io::crc32("6789", 4, io::crc32("12345", 5)), 0xCBF43926u);
  EXPECT_EQ(io::crc32("", 0), 0u);
}

// Property: the folding by carry-less products is the table loop's CRC for every length (below one 64-byte round,
// whole rounds, the 16-byte blocks after them and the bytes after those), start address and previous value; and
// both give Python's zlib.crc32 of a 100 003-byte pattern from byte 37 on (crc32, whichever it runs, of the whole).
TEST(Checkpoint, Crc32FoldingIsTheTableLoopsAtEveryLengthAndOffset) {
  std::vector<unsigned char> pattern(100003);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<unsigned char>((i * 7 + (i >> 8)) % 251);
  EXPECT_EQ(io::crc32(pattern.data(), pattern.size()), 0x4ce63ff7u);
  EXPECT_EQ(io::crc32(pattern.data() + 37, pattern.size() - 37), 0x1bf85ee2u);
  EXPECT_EQ(io::detail::crc32_table(pattern.data() + 37, pattern.size() - 37, 0), 0x1bf85ee2u);
  if (!io::detail::crc32_clmul_supported()) GTEST_SKIP() << "this CPU has no PCLMULQDQ: crc32 runs the table loop";
  EXPECT_EQ(io::detail::crc32_clmul(pattern.data() + 37, pattern.size() - 37, 0), 0x1bf85ee2u);
  uint32_t previous = 0x12345678u;
  int mismatches = 0;
  for (size_t length = 0; length <= 700; ++length)
    for (size_t offset = 0; offset < 16; ++offset) {
      previous = previous * 1664525u + 1013904223u;
      const unsigned char* at = pattern.data() + 1000 + offset * 13 + length;
      const uint32_t table = io::detail::crc32_table(at, length, previous);
      const uint32_t folded = io::detail::crc32_clmul(at, length, previous);
      if (table != folded && ++mismatches <= 5)
        ADD_FAILURE() << "length " << length << ", offset " << offset << ": table " << std::hex << table << ", folded "
                      << folded;
    }
  EXPECT_EQ(mismatches, 0);
}

TEST(Checkpoint, DataStreamsRestoredFromStateDrawTheSameBatches) {
  const auto config = tiny("/tmp/unused");
  DiffusionBatchSource a(config);
  for (int i = 0; i < 11; ++i) a.next(torch::kCPU);  // past an epoch boundary (16 clips, 2 per batch)
  DiffusionBatchSource b(config);
  b.restore(a.state());
  for (int i = 0; i < 5; ++i) {
    auto x = a.next(torch::kCPU), y = b.next(torch::kCPU);
    EXPECT_TRUE(torch::equal(x.x0, y.x0));
    EXPECT_TRUE(torch::equal(x.noise, y.noise));
    EXPECT_TRUE(torch::equal(x.timesteps, y.timesteps));
    EXPECT_TRUE(torch::equal(x.text_ids, y.text_ids));
  }
  EXPECT_THROW(b.restore(R"({"epoch": 0, "cursor": 99, "caption_rng": "1", "generator": ""})"), std::invalid_argument);
  EXPECT_THROW(b.restore("not json"), std::invalid_argument);
}

// Stopped at step 3 and resumed, a run logs the uninterrupted run's losses bit for bit: both trainers,
// and with fp16 loss scaling (whose scale and counters are part of the state).
class ExactResume : public ::testing::TestWithParam<std::vector<std::string>> {};

TEST_P(ExactResume, ResumedRunLogsTheUninterruptedLossesBitForBit) {
  const auto whole = fresh_dir("whole"), part = fresh_dir("part"), resumed = fresh_dir("resumed");
  auto extra = GetParam();
  extra.push_back("train.checkpoint_every=3");
  run_training(tiny(whole, extra), {});
  run_training(tiny(part, extra), {});
  // The second run resumes in a new folder from the first run's step-3 checkpoint.
  TrainingRunOptions options;
  options.resume = io::join_path(part, "checkpoints/step-0000003");
  const auto r = run_training(tiny(resumed, extra), options);
  EXPECT_EQ(r.first_step, 3);
  EXPECT_EQ(r.steps_done, 8);
  const auto a = losses(whole), b = losses(resumed);
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 5u);
  for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(a[i + 3], b[i]) << "step " << i + 4;
  // The final checkpoints hold the same bits too.
  // With train.ema_decay: the EMA and its weights file too, and megaslide-sample's default is that file.
  const bool ema = std::find(extra.begin(), extra.end(), "train.ema_decay=0.9") != extra.end();
  std::vector<std::string> files{"master.safetensors", "exp_avg.safetensors", "exp_avg_sq.safetensors",
                                 "model.safetensors"};
  if (ema) files.insert(files.end(), {"ema.safetensors", "model_ema.safetensors"});
  EXPECT_EQ(io::path_exists(io::join_path(whole, "checkpoints/step-0000008/ema.safetensors")), ema);
  EXPECT_EQ(find_ema_weights(whole), ema ? io::join_path(whole, "checkpoints/step-0000008/model_ema.safetensors") : "");
  for (const auto& f : files) {
    auto x = io::read_safetensors(io::join_path(whole, std::string("checkpoints/step-0000008/") + f));
    auto y = io::read_safetensors(io::join_path(resumed, std::string("checkpoints/step-0000008/") + f));
    ASSERT_EQ(x.tensors.size(), y.tensors.size()) << f;
    for (size_t i = 0; i < x.tensors.size(); ++i) {
      EXPECT_EQ(x.tensors[i].first, y.tensors[i].first) << f;
      EXPECT_TRUE(torch::equal(x.tensors[i].second, y.tensors[i].second)) << f << " " << x.tensors[i].first;
    }
  }
  // int8 moments are saved as their codes and group scales, not widened.
  const bool int8 = std::find(extra.begin(), extra.end(), "optimizer.state_dtype=int8") != extra.end();
  const auto m = io::read_safetensors(io::join_path(whole, "checkpoints/step-0000008/exp_avg.safetensors"));
  bool has_codes = false, has_scales = false;
  for (const auto& [name, t] : m.tensors) {
    has_codes |= t.scalar_type() == torch::kChar;
    has_scales |= name.size() > 6 && name.compare(name.size() - 6, 6, "#scale") == 0;
  }
  EXPECT_EQ(has_codes, int8);
  EXPECT_EQ(has_scales, int8);
  for (const auto& d : {whole, part, resumed}) io::remove_tree(d);
}

INSTANTIATE_TEST_SUITE_P(Trainers, ExactResume,
                         ::testing::Values(std::vector<std::string>{},                     // streamed, bf16, deferred
                                           std::vector<std::string>{"train.grad_clip=0"},  // streamed, immediate
                                           std::vector<std::string>{"offload.compute_dtype=fp16"},  // loss scaling
                                           std::vector<std::string>{"offload.enabled=false"},       // resident
                                           std::vector<std::string>{"train.grad_accum_steps=2"},
                                           std::vector<std::string>{"optimizer.state_dtype=int8"},  // codes + scales
                                           std::vector<std::string>{"optimizer.state_dtype=bf16", "train.grad_clip=0"},
                                           std::vector<std::string>{"train.ema_decay=0.9"},  // EMA, streamed
                                           std::vector<std::string>{"offload.enabled=false", "train.ema_decay=0.9"}));

TEST(Checkpoint, LayoutManifestLatestAndKeepLast) {
  const auto dir = fresh_dir("layout");
  run_training(tiny(dir, {"train.checkpoint_every=2", "train.keep_last=2", "train.steps=7"}), {});
  // Steps 2, 4, 6 periodic and 7 final; the newest two are kept; `latest` names the final one.
  EXPECT_EQ(io::list_directory(io::join_path(dir, "checkpoints")),
            (std::vector<std::string>{"latest", "step-0000006", "step-0000007"}));
  EXPECT_EQ(latest_checkpoint(dir), io::join_path(dir, "checkpoints/step-0000007"));
  EXPECT_EQ(io::list_directory(io::join_path(dir, "checkpoints/step-0000007")),
            (std::vector<std::string>{"exp_avg.safetensors", "exp_avg_sq.safetensors", "manifest.json",
                                      "master.safetensors", "model.safetensors", "trainer_state.json"}));
  // The manifest's checksums are the files' CRC-32s; the weights file is what megaslide-sample loads.
  const auto ckpt = io::join_path(dir, "checkpoints/step-0000007");
  const auto manifest = nlohmann::json::parse(io::read_file(io::join_path(ckpt, "manifest.json")));
  for (const auto& [file, entry] : manifest["files"].items()) {
    EXPECT_EQ(entry["bytes"].get<uint64_t>(), io::file_size(io::join_path(ckpt, file))) << file;
    char crc[16];
    std::snprintf(crc, sizeof crc, "%08x", io::file_crc32(io::join_path(ckpt, file)));
    EXPECT_EQ(entry["crc32"].get<std::string>(), crc) << file;
  }
  auto model = load_weights(io::join_path(ckpt, "model.safetensors"));
  EXPECT_EQ(model.config.model.layers, 2);
  auto state = nlohmann::json::parse(io::read_file(io::join_path(ckpt, "trainer_state.json")));
  EXPECT_EQ(state["step"], 7);
  EXPECT_EQ(state["optimizer_steps"], 7);
  EXPECT_TRUE(state["data"].contains("generator"));
  io::remove_tree(dir);
}

TEST(Checkpoint, CorruptTruncatedOrIncompleteCheckpointsAreRefusedAndTheRunFilesUntouched) {
  const auto dir = fresh_dir("corrupt");
  auto config = tiny(dir, {"train.checkpoint_every=4"});
  run_training(config, {});
  const auto before = run_files(dir);
  const auto ckpt = latest_checkpoint(dir);
  const auto master = io::join_path(ckpt, "master.safetensors");
  const std::string original = io::read_file(master);
  TrainingRunOptions resume;
  resume.resume = "latest";
  auto expect_refused = [&](const std::string& needle) {
    try {
      run_training(config, resume);
      ADD_FAILURE() << "a damaged checkpoint was accepted";
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(run_files(dir), before) << "refusing a checkpoint must not touch the run's files";
  };
  flip_byte(master, original.size() / 2);  // one byte in the data section
  expect_refused("master.safetensors");
  expect_refused("CRC-32");
  std::ofstream(master, std::ios::binary | std::ios::trunc) << original;
  truncate_file(master, original.size() - 10);
  expect_refused("truncated");
  std::ofstream(master, std::ios::binary | std::ios::trunc) << original;
  const auto manifest = io::read_file(io::join_path(ckpt, "manifest.json"));
  ::unlink(io::join_path(ckpt, "manifest.json").c_str());
  expect_refused("no manifest.json");
  std::ofstream(io::join_path(ckpt, "manifest.json")) << manifest.substr(0, manifest.size() / 2);
  expect_refused("manifest.json");
  // The one manifest reader accepts only what MegaSlide writes: the same bytes, its keys, the
  // checkpoint's own files (never a path outside the folder).
  const auto write_manifest = [&](const std::string& text) {
    std::ofstream(io::join_path(ckpt, "manifest.json"), std::ios::trunc) << text;
  };
  const auto edited = [&](const std::function<void(nlohmann::ordered_json&)>& edit) {
    auto j = nlohmann::ordered_json::parse(manifest);
    edit(j);
    return j.dump(2) + "\n";
  };
  const auto entry = nlohmann::ordered_json{{"bytes", 5}, {"crc32", "00000000"}};
  for (const auto& [text, needle] : std::vector<std::pair<std::string, std::string>>{
           {manifest.substr(0, manifest.size() - 1), "byte for byte"},  // truncated by one byte
           {manifest + " ", "byte for byte"},                           // one byte appended
           {manifest.substr(0, manifest.size() - 1) + " \n", "byte for byte"},
           {edited([&](auto& j) { j["files"]["../../etc/passwd"] = entry; }),
            "'../../etc/passwd', which is not a file of a checkpoint"},
           {edited([&](auto& j) { j["files"]["shards/../../x"] = entry; }), "which is not a file of a checkpoint"},
           {edited([&](auto& j) { j["files"]["shards/rank-00001-of-00002.safetensors"] = entry; }),
            "1 of the 2 shard files"},
           {edited([&](auto& j) { j["extra"] = 1; }), "unknown key 'extra'"},
           {edited([&](auto& j) { j["files"].erase("exp_avg.safetensors"); }), "does not list exp_avg.safetensors"},
           {edited([&](auto& j) { j["files"]["model.safetensors"]["crc32"] = "XYZ"; }), "8 hex digits"},
           {edited([&](auto& j) { j["files"]["model.safetensors"]["note"] = "x"; }), "exactly 'bytes'"}}) {
    SCOPED_TRACE(needle);
    write_manifest(text);
    expect_refused(needle);
  }
  write_manifest(manifest);
  // Restored, it loads again.
  EXPECT_EQ(run_training(config, resume).first_step, 8);
  io::remove_tree(dir);
}

TEST(Checkpoint, MissingTensorShapeOrConfigMismatchNamesTheFileAndTheTensorOrKey) {
  const auto dir = fresh_dir("mismatch");
  auto config = tiny(dir);
  Trainer trainer = resident_trainer(config);
  trainer.step();
  auto state = trainer.training_state();
  const std::string victim = state.master[3].first;

  auto expect_load_error = [&](const TrainingState& saved, const RunConfig& load_config,
                               const std::vector<std::string>& needles) {
    io::remove_tree(dir);
    const auto path = save_checkpoint(dir, config, saved);
    Trainer fresh = resident_trainer(load_config);
    auto into = fresh.training_state();
    try {
      load_checkpoint(path, load_config, into);
      ADD_FAILURE() << "accepted";
    } catch (const CheckpointError& e) {
      for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    }
  };
  auto missing = state;
  missing.master.erase(missing.master.begin() + 3);
  missing.exp_avg.erase(missing.exp_avg.begin() + 3);
  missing.exp_avg_sq.erase(missing.exp_avg_sq.begin() + 3);
  expect_load_error(missing, config, {"master.safetensors", victim, "missing"});
  auto reshaped = state;
  reshaped.master[3].second = torch::zeros({7, 3});
  expect_load_error(reshaped, config, {"master.safetensors", victim, "shape"});
  expect_load_error(state, tiny(dir, {"model.hidden=32", "model.heads=2"}), {"trainer_state.json", "model.hidden"});
  expect_load_error(state, tiny(dir, {"train.seed=5"}), {"train.seed"});
  // model.position_embedding: another model is refused; the same model spelt otherwise (auto is none for megaslide)
  // resumes.
  expect_load_error(state, tiny(dir, {"model.position_embedding=sincos"}), {"model.position_embedding"});
  {
    io::remove_tree(dir);
    const auto path = save_checkpoint(dir, config, state);
    const auto none = tiny(dir, {"model.position_embedding=none"});
    Trainer fresh = resident_trainer(none);
    auto into = fresh.training_state();
    EXPECT_NO_THROW(load_checkpoint(path, none, into));
  }
  io::remove_tree(dir);
}

TEST(Checkpoint, FailedSaveKeepsThePreviousCheckpointAndSaysSo) {
  const auto dir = fresh_dir("failsave");
  auto config = tiny(dir);
  Trainer trainer = resident_trainer(config);
  trainer.step();
  const auto first = save_checkpoint(dir, config, trainer.training_state());
  trainer.step();
  // A file-size limit makes write(2) fail with EFBIG part-way through, as a full disk fails with ENOSPC.
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto previous_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 32 * 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  try {
    save_checkpoint(dir, config, trainer.training_state());
    ADD_FAILURE() << "the save should have failed";
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("step-0000002"), std::string::npos) << what;
    EXPECT_NE(what.find("previous checkpoint " + first + " is intact"), std::string::npos) << what;
  }
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old), 0);
  std::signal(SIGXFSZ, previous_handler);
  EXPECT_EQ(latest_checkpoint(dir), first);
  EXPECT_EQ(io::list_directory(io::join_path(dir, "checkpoints")), (std::vector<std::string>{"latest", "step-0000001"}))
      << "no temporary folder may be left behind";
  Trainer fresh = resident_trainer(config);
  auto into = fresh.training_state();
  load_checkpoint(first, config, into);
  EXPECT_EQ(into.step, 1);

  // An unwritable checkpoints folder (a file in its place) fails the same way, naming the path.
  const auto other = fresh_dir("failsave2");
  io::make_directories(other);
  std::ofstream(io::join_path(other, "checkpoints")) << "not a folder";
  EXPECT_THROW(save_checkpoint(other, config, trainer.training_state()), CheckpointError);
  io::remove_tree(dir);
  io::remove_tree(other);
}

TEST(Checkpoint, InterruptedSaveLeavesLatestOnTheCompleteOneAndIsCleanedUp) {
  const auto dir = fresh_dir("crash");
  auto config = tiny(dir);
  Trainer trainer = resident_trainer(config);
  trainer.step();
  const auto first = save_checkpoint(dir, config, trainer.training_state());
  // What a crash in the middle of the next save leaves: a temporary folder with some files, no manifest.
  const auto partial = io::join_path(dir, "checkpoints/.tmp-step-0000002-1");
  io::make_directories(partial);
  std::ofstream(io::join_path(partial, "master.safetensors.tmp")) << "half a file";
  EXPECT_EQ(latest_checkpoint(dir), first);
  // A folder named like a checkpoint but without its manifest (a crash between rename and manifest cannot
  // happen, but a hand-made copy can) is refused, not trusted.
  io::make_directories(io::join_path(dir, "checkpoints/step-0000009"));
  EXPECT_THROW(verify_checkpoint(io::join_path(dir, "checkpoints/step-0000009")), CheckpointError);
  const auto removed = prune_checkpoints(dir, 3);
  EXPECT_EQ(removed, std::vector<std::string>{partial});
  TrainingRunOptions resume;
  resume.resume = "latest";
  EXPECT_EQ(run_training(tiny(dir, {"train.steps=2"}), resume).first_step, 1);
  io::remove_tree(dir);
}

TEST(Checkpoint, FreshRunRefusesAFolderThatHoldsCheckpoints) {
  const auto dir = fresh_dir("fresh");
  run_training(tiny(dir, {"train.checkpoint_every=8"}), {});
  try {
    run_training(tiny(dir), {});
    ADD_FAILURE() << "a fresh run overwrote a run with checkpoints";
  } catch (const RunFolderError& e) {
    EXPECT_NE(std::string(e.what()).find("--resume latest"), std::string::npos) << e.what();
  }
  // Without checkpoints (train.checkpoint_every: 0, the default) a finished run is refused all the same.
  const auto plain = fresh_dir("fresh-plain");
  run_training(tiny(plain, {"train.steps=3"}), {});
  const auto metrics = io::read_file(io::join_path(plain, "metrics.jsonl"));
  try {
    run_training(tiny(plain, {"train.steps=3"}), {});
    ADD_FAILURE() << "a fresh run overwrote a finished run without checkpoints";
  } catch (const RunFolderError& e) {
    EXPECT_NE(std::string(e.what()).find("already holds a run"), std::string::npos) << e.what();
  }
  EXPECT_EQ(io::read_file(io::join_path(plain, "metrics.jsonl")), metrics)
      << "the finished run's metrics are untouched";
  io::remove_tree(plain);
  try {
    TrainingRunOptions none;
    none.resume = "latest";
    run_training(tiny(fresh_dir("empty")), none);
    ADD_FAILURE() << "--resume latest without a checkpoint was accepted";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("has no checkpoint"), std::string::npos) << e.what();
  }
  io::remove_tree(dir);
}

// Non-finite steps: a NaN planted in a resident weight makes the loss NaN; the step must update nothing
// (every master and moment keeps its bits) and be counted; removing the NaN lets training go on.
class NonFinite : public ::testing::TestWithParam<std::vector<std::string>> {};

TEST_P(NonFinite, NonFiniteStepUpdatesNothingAndIsCounted) {
  auto config = tiny("/tmp/unused", GetParam());
  Trainer trainer = streamed_trainer(config);
  trainer.step();
  auto& weight = dit_module(trainer)->final_proj->weight;
  const auto saved_weight = weight.detach().clone();
  {
    torch::NoGradGuard no_grad;
    weight[0][0].fill_(std::numeric_limits<float>::quiet_NaN());
  }
  const auto before = trainer.training_state();
  std::vector<torch::Tensor> copies;
  for (const auto* list : {&before.master, &before.exp_avg, &before.exp_avg_sq})
    for (const auto& [name, t] : *list) copies.push_back(t.clone());
  auto m = trainer.step();
  EXPECT_TRUE(m.skipped);
  EXPECT_EQ(m.skipped_total, 1);
  EXPECT_EQ(m.consecutive_skips, 1);
  auto after = trainer.training_state();
  EXPECT_EQ(after.optimizer_steps, before.optimizer_steps);
  size_t k = 0;
  for (const auto* list : {&after.master, &after.exp_avg, &after.exp_avg_sq})
    for (const auto& [name, t] : *list) {
      const auto& was = copies[k++];
      EXPECT_TRUE(torch::equal(t.isnan(), was.isnan()) && torch::equal(t.nan_to_num(), was.nan_to_num())) << name;
    }
  EXPECT_TRUE(trainer.step().skipped);
  {
    torch::NoGradGuard no_grad;
    weight.copy_(saved_weight);
  }
  m = trainer.step();
  EXPECT_FALSE(m.skipped);
  EXPECT_EQ(m.skipped_total, 2);
  EXPECT_EQ(m.consecutive_skips, 0);
}

INSTANTIATE_TEST_SUITE_P(Modes, NonFinite,
                         ::testing::Values(std::vector<std::string>{},  // deferred updates (clipping)
                                           std::vector<std::string>{"train.grad_clip=0"},  // immediate updates
                                           std::vector<std::string>{"offload.compute_dtype=fp32",
                                                                    "train.grad_accum_steps=2"}));

TEST(Checkpoint, TheResidentLoopSkipsNonFiniteSteps) {
  auto config = tiny("/tmp/unused", {"offload.enabled=false"});
  Trainer trainer = resident_trainer(config);
  trainer.step();
  {
    torch::NoGradGuard no_grad;
    dit_module(trainer)->final_proj->weight[0][0].fill_(std::numeric_limits<float>::infinity());
  }
  const auto before = dit_module(trainer)->blocks[0]->parameters()[0].detach().clone();
  const auto m = trainer.step();
  EXPECT_TRUE(m.skipped);
  EXPECT_EQ(m.skipped_total, 1);
  EXPECT_TRUE(torch::equal(before, dit_module(trainer)->blocks[0]->parameters()[0]));
}

TEST(Checkpoint, RunStopsAfterMaxConsecutiveNonFiniteSteps) {
  // A checkpoint whose final projection holds a NaN: every step from it has a NaN loss.
  const auto dir = fresh_dir("diverge");
  auto config = tiny(dir, {"train.steps=20", "train.max_consecutive_skips=3"});
  Trainer trainer = resident_trainer(config);
  trainer.step();
  auto state = trainer.training_state();
  for (auto& [name, t] : state.master)
    if (name == "final_proj.weight") t[0][0] = std::numeric_limits<float>::quiet_NaN();
  const auto poisoned = save_checkpoint(dir, config, state);
  TrainingRunOptions resume;
  resume.resume = "latest";
  try {
    run_training(config, resume);
    ADD_FAILURE() << "a run of non-finite steps did not stop";
  } catch (const NonFiniteError& e) {
    EXPECT_NE(std::string(e.what()).find("3 consecutive steps"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("train.max_consecutive_skips"), std::string::npos) << e.what();
  }
  const auto lines = losses(dir);
  EXPECT_EQ(lines.size(), 3u);  // steps 2, 3, 4, all skipped
  EXPECT_EQ(latest_checkpoint(dir), poisoned) << "nothing is saved from a run stopped for non-finite steps";
  io::remove_tree(dir);
}

namespace {
// Thrown by a save observer to stop a save where a crash would: it is no std::exception, so no cleanup
// handler of the save catches it (only destructors run, as the kernel's cleanup would after a kill).
struct SimulatedCrash {};
}  // namespace

// The property: a run rolled back to an older checkpoint of its folder and then interrupted at any
// moment of its next save leaves `latest` on a complete checkpoint, and continuing from `latest`
// gives exactly the history an uninterrupted run would have (the folder's logs and `latest` agree).
// History A trains 4 steps at lr 3e-3 (checkpoints 2 and 4); history B rolls back to step 2 at lr
// 1e-3, so A's and B's step 4 differ, and B's save of step 4 replaces A's.
TEST(Checkpoint, RollBackIsCrashSafeAtEveryStageOfTheNextSave) {
  const std::vector<std::string> a{"train.steps=4", "train.checkpoint_every=2", "train.lr_schedule=constant",
                                   "train.keep_last=0"};
  auto b = [&](int steps) {
    auto v = a;
    v[0] = "train.steps=" + std::to_string(steps);
    v.push_back("train.lr=1e-3");
    return v;
  };
  auto from_step_2 = [](const std::string& dir) {
    TrainingRunOptions o;
    o.resume = io::join_path(dir, "checkpoints/step-0000002");
    return o;
  };
  TrainingRunOptions latest;
  latest.resume = "latest";

  const auto reference = fresh_dir("rollback-ref");
  run_training(tiny(reference, a), {});
  run_training(tiny(reference, b(4)), from_step_2(reference));
  run_training(tiny(reference, b(6)), latest);
  const auto expected = losses(reference);
  ASSERT_EQ(expected.size(), 6u);

  int crashes = 0;
  for (const std::string stage : {"complete", "moved-aside", "in-place", "latest"}) {
    SCOPED_TRACE("crash at stage " + stage);
    const auto dir = fresh_dir("rollback-" + stage);
    run_training(tiny(dir, a), {});
    const auto a_step_4 = losses(dir);
    bool fired = false;
    megaslide::detail::set_save_checkpoint_observer([&](const std::string& s) {
      if (s == stage && !fired) {
        fired = true;
        throw SimulatedCrash{};
      }
    });
    try {
      run_training(tiny(dir, b(4)), from_step_2(dir));
    } catch (const SimulatedCrash&) {
      ++crashes;
    }
    megaslide::detail::set_save_checkpoint_observer(nullptr);
    const auto l = latest_checkpoint(dir);
    ASSERT_FALSE(l.empty());
    EXPECT_NO_THROW(verify_checkpoint(l)) << "`latest` names " << l;
    run_training(tiny(dir, b(6)), latest);
    EXPECT_EQ(losses(dir), expected) << "continuing from `latest` must give the rolled-back history";
    EXPECT_NE(losses(dir)[3], a_step_4[3]) << "the test needs A and B to differ at step 4";
    io::remove_tree(dir);
  }
  EXPECT_GE(crashes, 3) << "complete, in-place and latest are stages of every save";
  io::remove_tree(reference);
}

// The property: a checkpoint of the run's own folder is its own however it is spelled (a shell's trailing slash,
// "." and ".."), so that resuming from it rolls `latest` back; another folder's checkpoint is refused into a folder
// that holds a run (it would replace that run's metrics and checkpoints) before anything is written.
TEST(Checkpoint, AnOwnCheckpointSpelledOtherwiseRollsBackAndAnotherRunsIsRefused) {
  const std::vector<std::string> a{"train.steps=4", "train.checkpoint_every=2", "train.keep_last=0"};
  const auto dir = fresh_dir("spelled");
  for (const std::string spelled :
       {"/checkpoints/step-0000002/", "/checkpoints/./step-0000002", "/checkpoints/../checkpoints/step-0000002//"}) {
    SCOPED_TRACE(spelled);
    io::remove_tree(dir);
    run_training(tiny(dir, a), {});
    ASSERT_EQ(latest_checkpoint(dir).substr(latest_checkpoint(dir).size() - 12), "step-0000004");
    EXPECT_TRUE(is_checkpoint_of(dir, dir + spelled));
    EXPECT_TRUE(roll_back_latest(dir, dir + spelled));
    EXPECT_EQ(latest_checkpoint(dir).substr(latest_checkpoint(dir).size() - 12), "step-0000002");
  }
  const auto other = fresh_dir("spelled-other");
  run_training(tiny(other, a), {});
  EXPECT_FALSE(is_checkpoint_of(dir, other + "/checkpoints/step-0000002"));
  const std::string metrics_before = io::read_file(io::join_path(dir, "metrics.jsonl"));
  TrainingRunOptions foreign;
  foreign.resume = other + "/checkpoints/step-0000002/";
  try {
    run_training(tiny(dir, a), foreign);
    ADD_FAILURE() << "another run's checkpoint was continued into a folder holding a run";
  } catch (const RunFolderError& e) {
    EXPECT_NE(std::string(e.what()).find("holds a run of its own"), std::string::npos) << e.what();
  }
  EXPECT_EQ(io::read_file(io::join_path(dir, "metrics.jsonl")), metrics_before);
  // Into a new folder it starts that folder's history.
  const auto fresh = fresh_dir("spelled-fresh");
  EXPECT_NO_THROW(run_training(tiny(fresh, a), foreign));
  for (const auto& d : {dir, other, fresh}) io::remove_tree(d);
}

// The property: a `latest` that names a folder gone (removed by hand) is refused as that, naming the newest complete
// checkpoint left, whichever name reaches it (--resume latest, the run folder) — not called an incomplete save.
TEST(Checkpoint, ALatestNamingAMissingFolderNamesTheNewestLeft) {
  const auto dir = fresh_dir("latest-gone");
  run_training(tiny(dir, {"train.steps=4", "train.checkpoint_every=2", "train.keep_last=0"}), {});
  io::remove_tree(io::join_path(dir, "checkpoints/step-0000004"));
  for (const auto& resolve : std::vector<std::function<std::string()>>{
           [&] { return resolve_checkpoint(dir, "latest"); }, [&] { return find_checkpoint(dir); }}) {
    try {
      resolve();
      ADD_FAILURE() << "a `latest` naming a missing folder was followed";
    } catch (const CheckpointError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("step-0000004, which does not exist"), std::string::npos) << what;
      EXPECT_NE(what.find("--resume " + io::join_path(dir, "checkpoints/step-0000002")), std::string::npos) << what;
    }
  }
  io::remove_tree(dir);
}

// A failed save says what is true after it, not before: when `latest` names a checkpoint that is gone,
// the message must not call it intact.
TEST(Checkpoint, FailedSaveNeverCallsAMissingCheckpointIntact) {
  const auto dir = fresh_dir("failmsg");
  auto config = tiny(dir);
  Trainer trainer = resident_trainer(config);
  trainer.step();
  const auto first = save_checkpoint(dir, config, trainer.training_state());
  io::remove_tree(first);  // `latest` now names nothing
  trainer.step();
  megaslide::detail::set_save_checkpoint_observer([](const std::string& s) {
    if (s == "complete") throw std::runtime_error("injected failure");
  });
  try {
    save_checkpoint(dir, config, trainer.training_state());
    ADD_FAILURE() << "the save should have failed";
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find("is intact"), std::string::npos) << what;
    EXPECT_NE(what.find("which is missing"), std::string::npos) << what;
  }
  megaslide::detail::set_save_checkpoint_observer(nullptr);
  io::remove_tree(dir);
}

// The property: a resume keeps metrics.jsonl's lines up to its checkpoint and says which other lines it dropped as
// no step's (a file edited or damaged); the last line torn by a crash is dropped without a word.
TEST(Checkpoint, AResumeNamesTheMetricsLinesItCannotRead) {
  const auto dir = fresh_dir("metrics-lines");
  run_training(tiny(dir, {"train.steps=4", "train.checkpoint_every=4"}), {});
  const auto metrics = io::join_path(dir, "metrics.jsonl");
  std::istringstream in(io::read_file(metrics));
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 4u);
  io::write_file_atomically(
      metrics, lines[0] + "\nnot a line of metrics\n" + lines[2] + "\n" + lines[3] + "\n{\"step\": 5, \"lo");
  TrainingRunOptions resume;
  resume.resume = "latest";
  run_training(tiny(dir, {"train.steps=6", "train.checkpoint_every=4"}), resume);
  const std::string log = io::read_file(io::join_path(dir, "train.log"));
  EXPECT_NE(log.find("metrics.jsonl: line 2 holds no step's metrics"), std::string::npos) << log;
  EXPECT_EQ(log.find("line 5"), std::string::npos) << log;
  std::vector<int64_t> steps;
  std::istringstream after(io::read_file(metrics));
  for (std::string line; std::getline(after, line);) steps.push_back(nlohmann::json::parse(line).at("step"));
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 3, 4, 5, 6}));
  io::remove_tree(dir);
}

// Wherever a checkpoint is taken, each name a user types for it leads to it: the folder, the `latest`
// file beside it (CRLF line ends too), the checkpoints folder and the run folder; a weights file stays a weights file
// (a checkpoint's own checked against its manifest).
TEST(Checkpoint, EveryNameOfACheckpointFindsIt) {
  const auto dir = fresh_dir("names");
  run_training(tiny(dir, {"train.steps=4", "train.checkpoint_every=2"}), {});
  const auto step4 = io::join_path(dir, "checkpoints/step-0000004");
  EXPECT_EQ(find_checkpoint(step4), step4);
  EXPECT_EQ(find_checkpoint(io::join_path(dir, "checkpoints/latest")), step4);
  EXPECT_EQ(find_checkpoint(io::join_path(dir, "checkpoints")), step4);
  EXPECT_EQ(find_checkpoint(dir), step4);
  EXPECT_EQ(resolve_checkpoint("/elsewhere", io::join_path(dir, "checkpoints/latest")), step4);
  EXPECT_EQ(find_weights(io::join_path(dir, "checkpoints/latest")), io::join_path(step4, "model.safetensors"));
  EXPECT_EQ(find_weights(dir), io::join_path(step4, "model.safetensors"));
  EXPECT_EQ(find_weights(io::join_path(step4, "model.safetensors")), io::join_path(step4, "model.safetensors"));
  {
    // A checkpoint's weights file named directly is checked against its manifest as through its folder (a flipped
    // byte was sampled).
    const auto file = io::join_path(step4, "model.safetensors");
    std::string bytes = io::read_file(file);
    bytes[bytes.size() - 3] = static_cast<char>(bytes[bytes.size() - 3] ^ 0x40);
    io::write_file_atomically(file, bytes);
    try {
      find_weights(file);
      ADD_FAILURE() << "a corrupted checkpoint weights file was taken";
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("CRC-32"), std::string::npos) << e.what();
    }
    bytes[bytes.size() - 3] = static_cast<char>(bytes[bytes.size() - 3] ^ 0x40);
    io::write_file_atomically(file, bytes);
  }
  EXPECT_THROW(find_checkpoint(io::join_path(dir, "metrics.jsonl")), CheckpointError);
  EXPECT_THROW(find_checkpoint(io::join_path(dir, "missing")), CheckpointError);
  {
    // A `latest` saved by an editor with CRLF line ends (or a trailing tab) still names its checkpoint.
    const auto pointer = io::join_path(dir, "checkpoints/latest");
    const std::string saved = io::read_file(pointer);
    io::write_file_atomically(pointer, "step-0000004\r\n");
    EXPECT_EQ(find_checkpoint(pointer), step4);
    EXPECT_EQ(latest_checkpoint(dir), step4);
    io::write_file_atomically(pointer, "step-0000004\t\n");
    EXPECT_EQ(find_checkpoint(dir), step4);
    io::write_file_atomically(pointer, saved);
  }
  // A `latest` that leads to a device is refused at once, not read until memory runs out.
  const auto zero = fresh_dir("names-zero");
  io::make_directories(io::join_path(zero, "checkpoints"));
  ASSERT_EQ(::symlink("/dev/zero", io::join_path(zero, "checkpoints/latest").c_str()), 0);
  try {
    latest_checkpoint(zero);
    ADD_FAILURE() << "a latest leading to /dev/zero was read";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("is a device"), std::string::npos) << e.what();
  }
  io::remove_tree(zero);
  const auto plain = fresh_dir("names-plain");
  run_training(tiny(plain, {"train.steps=2"}), {});
  try {
    find_checkpoint(plain);
    ADD_FAILURE() << "a run without checkpoints has none to find";
  } catch (const CheckpointError& e) {
    // Not only train.checkpoint_every: 0 leaves none: a run stopped before its first save, or still short of it.
    EXPECT_NE(std::string(e.what()).find("has no checkpoints: it saved none (it stopped before its first"),
              std::string::npos)
        << e.what();
  }
  // train.init_from of that run folder says so too, rather than that it is no run folder.
  try {
    plan_init_from(plain, {}, {});
    ADD_FAILURE() << "train.init_from took a run without checkpoints";
  } catch (const InitFromError& e) {
    EXPECT_NE(std::string(e.what()).find("is a run folder that saved no checkpoint"), std::string::npos) << e.what();
  }
  io::remove_tree(dir);
  io::remove_tree(plain);
}

TEST(Checkpoint, ResumeBelowTheCheckpointsStepIsRefusedAndOtherThreadsAreNamed) {
  const auto dir = fresh_dir("below");
  run_training(tiny(dir, {"train.steps=4", "train.checkpoint_every=2", "train.threads=1"}), {});
  const auto metrics = io::read_file(io::join_path(dir, "metrics.jsonl"));
  TrainingRunOptions resume;
  resume.resume = "latest";
  try {
    run_training(tiny(dir, {"train.steps=3", "train.checkpoint_every=2", "train.threads=1"}), resume);
    ADD_FAILURE() << "a resume that trains nothing was accepted";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "train.steps");
    EXPECT_NE(std::string(e.what()).find("already at step 4"), std::string::npos) << e.what();
  }
  EXPECT_EQ(io::read_file(io::join_path(dir, "metrics.jsonl")), metrics);
  // Equal: the run is complete; nothing is trained, nothing is lost.
  const auto done = run_training(tiny(dir, {"train.steps=4", "train.checkpoint_every=2", "train.threads=1"}), resume);
  EXPECT_EQ(done.steps_done, 4);
  EXPECT_EQ(io::read_file(io::join_path(dir, "metrics.jsonl")), metrics);
  // Another thread count: allowed, and said.
  const auto latest = latest_checkpoint(dir);
  EXPECT_TRUE(resume_warnings(latest, tiny(dir, {"train.steps=4", "train.threads=1"})).empty());
  const auto warnings = resume_warnings(latest, tiny(dir, {"train.steps=4", "train.threads=2"}));
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("bit for bit"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("train.threads=1"), std::string::npos) << warnings[0];
  // More steps (the run extended): the cosine schedule, stretched over them, moves the next step's rate — said,
  // with what changed.
  const auto extended = resume_warnings(latest, tiny(dir, {"train.steps=8", "train.threads=1"}));
  ASSERT_EQ(extended.size(), 1u);
  EXPECT_NE(extended[0].find("learning rate of step 5"), std::string::npos) << extended[0];
  EXPECT_NE(extended[0].find("train.steps 4 -> 8"), std::string::npos) << extended[0];
  EXPECT_TRUE(resume_warnings(latest, tiny(dir, {"train.steps=8", "train.threads=1"}), /*training=*/false).empty())
      << "an export trains nothing: no rate to speak of";
  // train.threads 0 (auto) is the count it plans on this machine: a warning only where that is not 1.
  const auto automatic = tiny(dir, {"train.steps=4", "train.threads=0"});
  EXPECT_EQ(resume_warnings(latest, automatic).empty(), megaslide::plan_threads(automatic, torch::kCPU).intra_op == 1);
  // The checkpoint records the count it ran with, so `auto` saved on a bigger machine (64 threads) warns where
  // `auto` resolves to fewer: the state file of such a save, edited from this one.
  auto state = nlohmann::json::parse(io::read_file(io::join_path(latest, "trainer_state.json")));
  EXPECT_EQ(state.at("intra_op_threads"), 1);
  std::string yaml = state.at("config");
  const auto at = yaml.find("\n  threads: 1\n");
  ASSERT_NE(at, std::string::npos) << yaml;
  yaml.replace(at, 13, "\n  threads: 0\n");
  state["config"] = yaml;
  state["intra_op_threads"] = 64;
  const auto bigger = fresh_dir("below-bigger-machine");
  io::make_directories(bigger);
  io::write_file_atomically(io::join_path(bigger, "trainer_state.json"), state.dump());
  if (megaslide::plan_threads(automatic, torch::kCPU).intra_op != 64) {
    const auto from_bigger = resume_warnings(bigger, automatic);
    ASSERT_EQ(from_bigger.size(), 1u);
    EXPECT_NE(from_bigger[0].find("64 threads then"), std::string::npos) << from_bigger[0];
    EXPECT_NE(from_bigger[0].find("train.threads=64"), std::string::npos) << from_bigger[0];
  }
  io::remove_tree(bigger);
  io::remove_tree(dir);
}

// The property: a run whose `checkpoints/latest` is missing (a failed pointer write) or a broken link still names
// its complete checkpoints, so that none is taken for lost: --resume latest and a fresh run are refused naming
// the newest, which resumes by name; a `latest` made a link by hand (to a pointer file, or to a checkpoint folder)
// is followed and then replaced by the pointer file (not its target) at a save or a rollback; `latest`'s temporary
// files left by killed saves are removed.
TEST(Checkpoint, AMissingOrLinkedLatestStillLeavesTheCheckpointsByName) {
  const auto dir = fresh_dir("pointer");
  run_training(tiny(dir, {"train.steps=4", "train.checkpoint_every=2", "train.threads=1"}), {});
  const auto pointer = io::join_path(dir, "checkpoints/latest");
  const auto step4 = io::join_path(dir, "checkpoints/step-0000004");
  ::unlink(pointer.c_str());
  ASSERT_EQ(::symlink("step-0000099", pointer.c_str()), 0);  // a broken link
  const auto refusal = [&](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_EQ(complete_checkpoints(dir),
            (std::vector<std::string>{io::join_path(dir, "checkpoints/step-0000002"), step4}));
  auto message = refusal([&] { resolve_checkpoint(dir, "latest"); });
  EXPECT_NE(message.find("--resume " + step4), std::string::npos) << message;
  message = refusal([&] { run_training(tiny(dir, {"train.steps=6", "train.threads=1"}), {}); });
  EXPECT_NE(message.find("--resume " + step4), std::string::npos) << message;
  EXPECT_EQ(message.find("checkpoint_every"), std::string::npos) << message;

  // A link to a pointer file: read through, then replaced by the pointer file itself.
  ::unlink(pointer.c_str());
  io::write_file_atomically(io::join_path(dir, "checkpoints/pointer-kept"), "step-0000004\n");
  ASSERT_EQ(::symlink("pointer-kept", pointer.c_str()), 0);
  const auto leftover = io::join_path(dir, "checkpoints/latest.Ab3dEf.tmp");  // a killed save's
  io::write_file_atomically(leftover, "step-00");
  TrainingRunOptions resume;
  resume.resume = "latest";
  EXPECT_EQ(
      run_training(tiny(dir, {"train.steps=6", "train.checkpoint_every=2", "train.threads=1"}), resume).steps_done, 6);
  EXPECT_FALSE(io::is_symlink(pointer));
  EXPECT_EQ(io::read_file(pointer), "step-0000006\n");
  EXPECT_EQ(io::read_file(io::join_path(dir, "checkpoints/pointer-kept")), "step-0000004\n");
  EXPECT_FALSE(io::path_exists(leftover));

  // A link to a checkpoint folder beside it names that checkpoint; a rollback to an earlier one replaces the link.
  ::unlink(pointer.c_str());
  ASSERT_EQ(::symlink("step-0000006", pointer.c_str()), 0);
  EXPECT_EQ(latest_checkpoint(dir), io::join_path(dir, "checkpoints/step-0000006"));
  TrainingRunOptions back;
  back.resume = io::join_path(dir, "checkpoints/step-0000004");
  EXPECT_EQ(run_training(tiny(dir, {"train.steps=5", "train.checkpoint_every=0", "train.threads=1"}), back).steps_done,
            5);
  EXPECT_FALSE(io::is_symlink(pointer));
  EXPECT_EQ(io::read_file(pointer), "step-0000004\n");
  io::remove_tree(dir);
}

// The property: checkpoints that could never be saved are refused before the first step (exit 2's ConfigError
// naming output.run_dir), not met at every save after the training: here a run folder whose path leaves no room
// for a save's temporary names (PATH_MAX); nothing is written.
TEST(TrainingRun, CheckpointsThatCannotBeSavedAreRefusedBeforeTheFirstStep) {
  const auto root = fresh_dir("long-path");
  std::string dir = root;
  while (dir.size() + 201 < 4040) dir += "/" + std::string(200, 'd');
  dir += "/" + std::string(4040 - dir.size() - 1, 'r');
  ASSERT_EQ(dir.size(), 4040u);
  try {
    run_training(tiny(dir, {"train.steps=2", "train.checkpoint_every=1", "train.threads=1"}), {});
    ADD_FAILURE() << "a run whose checkpoints cannot be saved was started";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "output.run_dir");
    EXPECT_NE(std::string(e.what()).find("checkpoints cannot be saved"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(io::path_exists(io::join_path(dir, "metrics.jsonl")));
  EXPECT_FALSE(io::path_exists(io::join_path(dir, "checkpoints")));
  io::remove_tree(root);
}

// The property: validation videos that cannot be written (here samples/ is a file) are a warning and training
// goes on to its last step and checkpoint, as a failed periodic save does.
TEST(TrainingRun, ValidationVideosThatCannotBeWrittenDoNotStopTheRun) {
  const auto dir = fresh_dir("no-samples");
  io::make_directories(dir);
  io::write_file_atomically(io::join_path(dir, "samples"), "in the way");
  const auto result = run_training(tiny(dir, {"train.steps=4", "train.checkpoint_every=4", "train.sample_every=2",
                                              "diffusion.sample_steps=2", "train.threads=1"}),
                                   {});
  EXPECT_EQ(result.steps_done, 4);
  EXPECT_EQ(result.last_checkpoint, io::join_path(dir, "checkpoints/step-0000004"));
  const auto log = io::read_file(io::join_path(dir, "train.log"));
  EXPECT_NE(log.find("step 2: the validation videos could not be written"), std::string::npos) << log;
  EXPECT_NE(log.find("step 4: the validation videos could not be written"), std::string::npos) << log;
  io::remove_tree(dir);
}

// The memory check before a run: a lower bound (12 B a parameter where the weights and moments live in
// host memory, the batch, the data order) against what the machine has, refused with the figures.
TEST(TrainingRun, MemoryShortfallNamesTheFiguresAndSparesWhatFits) {
  const auto config = tiny("/tmp/unused");
  EXPECT_EQ(memory_shortfall(config, int64_t{1} << 30), "");
  const auto why = memory_shortfall(config, 1000);
  EXPECT_NE(why.find("this machine has 1 kB"), std::string::npos) << why;
  EXPECT_NE(why.find("x 12 B of fp32 weights"), std::string::npos) << why;
  // The resident loop on a GPU keeps weights and moments there: only the batch and the order count.
  const auto big_batch = tiny("/tmp/unused", {"train.batch_size=100000"});
  const int64_t batch_bytes = int64_t{100000} * 3 * 4 * 8 * 8 * 4;
  EXPECT_EQ(memory_shortfall(big_batch, batch_bytes + 16 * 8, /*state_in_host_memory=*/false), "");
  EXPECT_NE(memory_shortfall(big_batch, batch_bytes + 16 * 8, /*state_in_host_memory=*/true), "");
  EXPECT_NE(memory_shortfall(big_batch, batch_bytes, false), "");
  EXPECT_GT(megaslide::available_memory_bytes(), int64_t{1} << 28) << "this machine has more than 256 MiB";
  // A LoRA run keeps only its frozen model there, 2 B a parameter in bf16 and 1 B in fp8 (a Wan 14B LoRA run was
  // refused on any machine below 171 GB).
  const auto full = tiny("/tmp/unused", {"offload.compute_dtype=bf16"});
  const auto lora = tiny("/tmp/unused", {"offload.compute_dtype=bf16", "lora.rank=2"});
  const auto& d = full.data;
  const int64_t rest = full.train.batch_size * d.channels * d.frames * d.height * d.width * 4 + d.num_clips * 8;
  const int64_t params = megaslide::count_run_parameters(full).total;
  EXPECT_NE(memory_shortfall(full, rest + params * 3), "");
  EXPECT_EQ(memory_shortfall(lora, rest + params * 3), "");
  EXPECT_NE(memory_shortfall(lora, rest + params * 2 - 1), "");
  const auto fp8 = tiny("/tmp/unused", {"offload.compute_dtype=bf16", "lora.rank=2", "lora.base_dtype=fp8"});
  EXPECT_EQ(memory_shortfall(fp8, rest + params), "");
  const auto fp8_why = memory_shortfall(fp8, 1000);
  EXPECT_NE(fp8_why.find("x 1 B of the frozen model's fp8 weights"), std::string::npos) << fp8_why;
  // The streamed trainer's narrow moments: 4 + 2 x 1 B (and a scale per 256) with int8 moments, not 12 B.
  const auto int8 = tiny("/tmp/unused", {"offload.compute_dtype=bf16", "optimizer.state_dtype=int8"});
  EXPECT_EQ(memory_shortfall(int8, rest + params * 7), "");
  EXPECT_NE(memory_shortfall(full, rest + params * 7), "");
  // Masters and moments are sharded over the machines (state_shards); a LoRA run's frozen model is not.
  EXPECT_EQ(memory_shortfall(full, rest + params * 7, true, 2), "");
  EXPECT_NE(memory_shortfall(lora, rest + params, true, 2), "");
  // The NVMe tier keeps the masters and moments on the disk: the bf16 compute copy is what host memory holds.
  const auto nvme =
      tiny("/tmp/unused", {"offload.compute_dtype=bf16", "offload.state_tier=nvme", "offload.nvme_dir=/tmp"});
  EXPECT_EQ(memory_shortfall(nvme, rest + params * 3), "");
  EXPECT_NE(memory_shortfall(nvme, 1000).find("x 2 B of a bf16 compute copy (the masters and moments on NVMe)"),
            std::string::npos);
}
