// TensorBoard event files (io/event_file.h) and a training run's TensorBoard log (output.tensorboard):
// the TFRecord framing and its CRC-32C, the events read back as written, a damaged file refused naming
// the byte, a run's scalars equal to its metrics.jsonl, and — where Python's `tensorboard` package is
// installed — TensorBoard's own reader seeing them.
#include "megaslide/io/event_file.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "megaslide/io/files.h"
#include "megaslide/io/video.h"
#include "run_tool.h"

using megaslide::io::join_path;

namespace {

std::string scratch(const std::string& name) {
  const auto dir = "/tmp/megaslide-test-events-" + name + "-" + std::to_string(::getpid());
  megaslide::io::remove_tree(dir);
  return dir;
}

std::string only_event_file(const std::string& dir) {
  std::string found;
  for (const auto& name : megaslide::io::list_directory(dir))
    if (name.rfind("events.out.tfevents.", 0) == 0) {
      EXPECT_TRUE(found.empty()) << "two event files in " << dir;
      found = join_path(dir, name);
    }
  return found;
}

}  // namespace

// The standard check value of CRC-32C (iSCSI): crc32c("123456789") = 0xE3069283; and the mask TFRecord
// applies, on the value of an empty input (0).
TEST(EventFile, Crc32cIsCastagnolis) {
  EXPECT_EQ(megaslide::io::crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(megaslide::io::crc32c("", 0), 0u);
  EXPECT_EQ(megaslide::io::crc32c("6789", 4, megaslide::io::crc32c("12345", 5)), 0xE3069283u) << "continued";
  EXPECT_EQ(megaslide::io::masked_crc32c(0), 0xa282ead8u);
}

// Written events read back as they were written: the version event first, then scalars (several in one
// event), an image and a text, with their steps and wall times; the file is whole after each call.
TEST(EventFile, EventsReadBackAsWritten) {
  const auto dir = scratch("roundtrip");
  std::string path;
  {
    megaslide::io::EventFileWriter writer(dir);
    path = writer.path();
    EXPECT_EQ(megaslide::io::parent_path(path), dir);
    writer.scalars(3, {{"train/loss", 0.25}, {"train/lr", 1e-4}}, 100.5);
    EXPECT_EQ(megaslide::io::read_event_file(path).size(), 3u) << "flushed with each call";
    writer.image("validation/a.mp4", 4, std::string("\x89PNG fake", 9), 16, 48, 101.0);
    writer.text("config", 0, "model:\n  arch: megaslide\n", 99.0);
    writer.restart(7, 102.0);
  }
  const auto records = megaslide::io::read_event_file(path);
  ASSERT_EQ(records.size(), 6u);
  EXPECT_EQ(records[5].kind, "restart");
  EXPECT_EQ(records[5].step, 7);
  EXPECT_EQ(records[0].file_version, "brain.Event:2");
  EXPECT_EQ(records[1].kind, "scalar");
  EXPECT_EQ(records[1].tag, "train/loss");
  EXPECT_EQ(records[1].step, 3);
  EXPECT_EQ(records[1].scalar, 0.25);
  EXPECT_EQ(records[1].wall_time, 100.5);
  EXPECT_EQ(records[2].tag, "train/lr");
  EXPECT_FLOAT_EQ(static_cast<float>(records[2].scalar), 1e-4f);
  EXPECT_EQ(records[3].kind, "image");
  EXPECT_EQ(records[3].data, std::string("\x89PNG fake", 9));
  EXPECT_EQ(records[3].height, 16);
  EXPECT_EQ(records[3].width, 48);
  EXPECT_EQ(records[4].kind, "text");
  EXPECT_EQ(records[4].data, "model:\n  arch: megaslide\n");

  // A flipped byte in the second record's data, or a file cut inside a record, is refused naming the
  // record's offset.
  std::string bytes = megaslide::io::read_file(path);
  size_t first_length = 0;  // the version event's record: 8 length bytes, 4 CRC, the data, 4 CRC
  for (int i = 0; i < 8; ++i)
    first_length |= static_cast<size_t>(static_cast<unsigned char>(bytes[static_cast<size_t>(i)])) << (8 * i);
  const size_t second = 12 + first_length + 4;
  std::string flipped = bytes;
  flipped[second + 14] = static_cast<char>(flipped[second + 14] ^ 0x01);
  megaslide::io::write_file_atomically(path, flipped);
  try {
    megaslide::io::read_event_file(path);
    ADD_FAILURE() << "a damaged record was read";
  } catch (const megaslide::io::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("byte " + std::to_string(second)), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("CRC-32C"), std::string::npos) << e.what();
  }
  megaslide::io::write_file_atomically(path, bytes.substr(0, bytes.size() - 3));
  EXPECT_THROW(megaslide::io::read_event_file(path), megaslide::io::IoError);
  megaslide::io::remove_tree(dir);
}

// A run of the smoke config with output.tensorboard for 3 steps, validation videos at step 3; its
// losses as metrics.jsonl logs them.
static std::vector<double> train_with_tensorboard(const std::string& run) {
  const std::string args =
      "--config " + std::string(MEGASLIDE_SOURCE_DIR) +
      "/configs/smoke.yaml --set train.steps=3 --set output.progress=false --set output.tensorboard=true "
      "--set train.sample_every=3 --set diffusion.sample_steps=2 --run-dir " +
      run;
  auto r = megaslide::testing::run_tool("megaslide-train", args);
  EXPECT_EQ(r.code, 0) << r.output;
  std::vector<double> logged;
  std::istringstream lines(megaslide::io::read_file(join_path(run, "metrics.jsonl")));
  for (std::string line; std::getline(lines, line);)
    logged.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return logged;
}

// A training run with output.tensorboard: RUN/tensorboard holds one event file whose first summary is the
// resolved config, then each step's scalars — train/loss equal to metrics.jsonl's loss of that step (as
// float) — and, at the validation step, one PNG strip of each validation video (up to 8 of its frames
// side by side).
TEST(EventFile, TrainingRunLogsItsMetricsConfigAndValidationVideos) {
  const auto run = scratch("run");
  const auto logged = train_with_tensorboard(run);
  ASSERT_EQ(logged.size(), 3u);
  const auto file = only_event_file(join_path(run, "tensorboard"));
  ASSERT_FALSE(file.empty());
  const auto records = megaslide::io::read_event_file(file);
  ASSERT_GE(records.size(), 2u);
  EXPECT_EQ(records[1].kind, "text");
  EXPECT_EQ(records[1].tag, "config");
  EXPECT_NE(records[1].data.find("tensorboard: true"), std::string::npos) << records[1].data;
  int losses = 0, images = 0;
  for (const auto& e : records) {
    if (e.kind == "scalar" && e.tag == "train/loss") {
      ASSERT_GE(e.step, 1);
      ASSERT_LE(e.step, 3);
      EXPECT_EQ(static_cast<float>(e.scalar), static_cast<float>(logged[static_cast<size_t>(e.step - 1)]))
          << "step " << e.step;
      ++losses;
    }
    if (e.kind == "image") {
      ++images;
      EXPECT_EQ(e.step, 3);
      EXPECT_EQ(e.tag.rfind("validation/", 0), 0u) << e.tag;
      EXPECT_EQ(e.data.substr(0, 4), "\x89PNG");
      EXPECT_EQ(e.height, 16);     // configs/smoke.yaml: 8 frames of 16 x 16
      EXPECT_EQ(e.width, 8 * 16);  // all 8 frames side by side
    }
  }
  EXPECT_EQ(losses, 3);
  if (megaslide::io::video_supported()) EXPECT_GE(images, 1);
  megaslide::io::remove_tree(run);
}

// TensorBoard's own reader (its EventAccumulator) sees a run's losses and validation images, where
// Python's `tensorboard` package is installed (python3, or MEGASLIDE_TENSORBOARD_PYTHON); skipped,
// saying so, where it is not.
TEST(EventFile, TensorBoardsOwnReaderSeesTheRun) {
  const char* python_env = std::getenv("MEGASLIDE_TENSORBOARD_PYTHON");
  const std::string python = python_env != nullptr && *python_env != '\0' ? python_env : "python3";
  if (std::system((python + " -c 'import tensorboard' > /dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << "Python's tensorboard package is not installed (" << python
                 << "; set MEGASLIDE_TENSORBOARD_PYTHON)";
  const auto run = scratch("reader");
  const auto logged = train_with_tensorboard(run);
  ASSERT_EQ(logged.size(), 3u);
  const std::string script = join_path(run, "read.py");
  megaslide::io::write_file_atomically(
      script,
      "import sys\n"
      "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
      "acc = EventAccumulator(sys.argv[1], size_guidance={'scalars': 0, 'images': 0, 'tensors': 0})\n"
      "acc.Reload()\n"
      "for e in acc.Scalars('train/loss'): print('loss', e.step, repr(e.value))\n"
      "print('images', len(acc.Tags()['images']))\n");
  const std::string out = join_path(run, "read.txt");
  ASSERT_EQ(std::system((python + " " + script + " " + join_path(run, "tensorboard") + " > " + out + " 2>&1").c_str()),
            0)
      << megaslide::io::read_file(out);
  std::istringstream read(megaslide::io::read_file(out));
  int seen = 0;
  for (std::string word; read >> word;) {
    if (word == "loss") {
      int64_t step = 0;
      double value = 0;
      read >> step >> value;
      ASSERT_GE(step, 1);
      ASSERT_LE(step, 3);
      EXPECT_EQ(static_cast<float>(value), static_cast<float>(logged[static_cast<size_t>(step - 1)]))
          << "TensorBoard's step " << step;
      ++seen;
    } else if (word == "images") {
      int n = 0;
      read >> n;
      if (megaslide::io::video_supported()) EXPECT_GE(n, 1);
    }
  }
  EXPECT_EQ(seen, 3) << megaslide::io::read_file(out);
  megaslide::io::remove_tree(run);
}
