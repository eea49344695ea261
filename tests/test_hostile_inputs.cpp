// Hostile inputs for what users hand us: the run-config parser and the safetensors reader
// (checkpoints and weights files), prompt files, metrics files, and every command-line tool. A
// committed corpus (tests/corpus/) of hand-written malformed inputs is replayed, then a bounded, seeded
// mutation loop (bit flips, byte overwrites, truncations, insertions, length-field edits) runs over the
// config and safetensors seeds. The property: each input either loads or raises the project's own error
// type (ConfigError, SafetensorsError, MetricsFileError) — never another exception, a crash, or an
// allocation sized by an unchecked field; each bad command line (tests/corpus/cli/) exits 2 with one
// line and writes nothing. The same config and safetensors seeds drive the libFuzzer targets
// (tests/fuzz/) where clang is available.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include "megaslide/config/run_config.h"
#include "megaslide/eval/run_plots.h"
#include "megaslide/io/vbench_layout.h"
#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "run_tool.h"

using namespace megaslide;

namespace {

std::string corpus(const std::string& kind) { return std::string(MEGASLIDE_SOURCE_DIR) + "/tests/corpus/" + kind; }

// Outcome of feeding one input: 0 loaded, 1 refused with the project's error; anything else fails.
int feed_safetensors(const std::string& bytes, const std::string& scratch, std::string* message) {
  {
    std::ofstream out(scratch, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  try {
    io::read_safetensors(scratch);
    return 0;
  } catch (const io::SafetensorsError& e) {
    *message = e.what();
    return 1;
  } catch (const std::exception& e) {
    *message = std::string("unexpected exception type: ") + e.what();
    return 2;
  }
}

int feed_config(const std::string& text, std::string* message) {
  try {
    parse_run_config(text, "hostile.yaml");
    return 0;
  } catch (const ConfigError& e) {
    *message = e.what();
    return 1;
  } catch (const std::exception& e) {
    *message = std::string("unexpected exception type: ") + e.what();
    return 2;
  }
}

std::string mutate(std::string s, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> kind(0, 5);
  auto pos = [&](size_t n) { return n == 0 ? size_t{0} : std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  const int rounds = 1 + static_cast<int>(rng() % 3);
  for (int r = 0; r < rounds; ++r) {
    switch (kind(rng)) {
      case 0:  // flip one bit
        if (!s.empty()) s[pos(s.size())] ^= static_cast<char>(1 << (rng() % 8));
        break;
      case 1:  // overwrite a byte with an interesting value
        if (!s.empty()) s[pos(s.size())] = "\x00\xff\x7f\x80\"{}[]:,-9e"[rng() % 14];
        break;
      case 2:  // truncate
        s.resize(pos(s.size() + 1));
        break;
      case 3:  // insert a run of bytes
        s.insert(pos(s.size() + 1), std::string(1 + rng() % 16, "\"{[0-9e,:"[rng() % 9]));
        break;
      case 4:  // the safetensors length field: small, huge, or off by a little
        if (s.size() >= 8) {
          uint64_t n = 0;
          std::memcpy(&n, s.data(), 8);
          const uint64_t choices[4] = {n + 1 + rng() % 8, n - 1 - rng() % 8, uint64_t{1} << (rng() % 64), rng()};
          n = choices[rng() % 4];
          std::memcpy(s.data(), &n, 8);
        }
        break;
      default:  // duplicate a slice
        if (!s.empty()) {
          const size_t a = pos(s.size());
          s.insert(pos(s.size() + 1), s.substr(a, 1 + rng() % 32));
        }
    }
  }
  return s;
}

}  // namespace

TEST(HostileInputs, SafetensorsCorpusIsRefusedWithClearErrorsOrLoaded) {
  const std::string scratch = "/tmp/megaslide-test-hostile-" + std::to_string(::getpid()) + ".safetensors";
  int refused = 0;
  for (const auto& name : io::list_directory(corpus("safetensors"))) {
    std::string message;
    const int outcome = feed_safetensors(io::read_file(corpus("safetensors") + "/" + name), scratch, &message);
    ASSERT_LT(outcome, 2) << name << ": " << message;
    if (name == "valid.safetensors") {
      EXPECT_EQ(outcome, 0) << message;
    } else {
      EXPECT_EQ(outcome, 1) << name << " was accepted";
      EXPECT_NE(message.find(scratch), std::string::npos) << "the message must name the file: " << message;
      if (name == "latest_pointer.safetensors")  // a checkpoint's `latest` file handed over as weights
        EXPECT_NE(message.find("not a safetensors file"), std::string::npos) << "say it plainly first: " << message;
      ++refused;
    }
  }
  EXPECT_GE(refused, 20);
  ::unlink(scratch.c_str());
}

TEST(HostileInputs, RunConfigCorpusIsRefusedWithClearErrorsOrLoaded) {
  int refused = 0;
  for (const auto& name : io::list_directory(corpus("run_config"))) {
    std::string message;
    const int outcome = feed_config(io::read_file(corpus("run_config") + "/" + name), &message);
    ASSERT_LT(outcome, 2) << name << ": " << message;
    if (outcome == 1) {
      EXPECT_NE(message.find("hostile.yaml"), std::string::npos) << "the message must name the source: " << message;
      ++refused;
    }
  }
  EXPECT_GE(refused, 15);
}

// The inputs longer libFuzzer runs found and the fuzz tests start from (tests/corpus/fuzz/, merged to a
// smallest set of their coverage) replayed through the project's own build, where clang is absent too:
// each one loads or is refused with the project's error naming its source, never anything else.
TEST(HostileInputs, FuzzerFoundInputsAreRefusedWithClearErrorsOrLoaded) {
  const std::string scratch = "/tmp/megaslide-test-hostile-fuzz-" + std::to_string(::getpid()) + ".safetensors";
  // Every input of tests/corpus/FOLDER through feed: loaded, or refused with a message naming `source`.
  auto replay = [](const std::string& folder, const std::string& source, auto feed) {
    int inputs = 0;
    for (const auto& name : io::list_directory(corpus(folder))) {
      std::string message;
      const int outcome = feed(io::read_file(corpus(folder) + "/" + name), &message);
      EXPECT_LT(outcome, 2) << folder << "/" << name << ": " << message;
      if (outcome == 1)
        EXPECT_NE(message.find(source), std::string::npos) << "the message must name " << source << ": " << message;
      ++inputs;
    }
    return inputs;
  };
  const int safetensors_inputs =
      replay("fuzz/safetensors", scratch,
             [&](const std::string& bytes, std::string* message) { return feed_safetensors(bytes, scratch, message); });
  ::unlink(scratch.c_str());
  const int config_inputs = replay("fuzz/run_config", "hostile.yaml", feed_config);
  EXPECT_GE(safetensors_inputs, 600) << "tests/corpus/fuzz/safetensors lost its inputs";
  EXPECT_GE(config_inputs, 190) << "tests/corpus/fuzz/run_config lost its inputs";
}

// The bad configs a hostile user tried (numbers beyond a double or an int64, repeated keys, sizes no
// machine holds or that overflow 64 bits) are each refused — not loaded, not aborted.
TEST(HostileInputs, RunConfigsFromTheHostileUserAreAllRefused) {
  for (const char* name : {"lr_overflow.yaml",
                           "lr_underflow.yaml",
                           "negative_overflow.yaml",
                           "duplicate_key.yaml",
                           "duplicate_section.yaml",
                           "huge_layers.yaml",
                           "huge_parameters.yaml",
                           "size_product_overflow.yaml",
                           "batch_beyond_any_machine.yaml",
                           "huge_kernel.yaml",
                           "dense_scores_beyond_any_machine.yaml",
                           "huge_num_clips.yaml",
                           "huge_grad_accum.yaml",
                           "guidance_nan.yaml",
                           "huge_text_dim.yaml",
                           "device_index_overflow.yaml",
                           "huge_int.yaml",
                           "nan.yaml",
                           "inf.yaml",
                           "two_documents.yaml",
                           "non_utf8_path.yaml",
                           "non_utf8_root.yaml"}) {
    std::string message;
    EXPECT_EQ(feed_config(io::read_file(corpus("run_config") + "/" + name), &message), 1)
        << name << " was not refused: " << message;
  }
}

// Prompt files: each is refused naming the file and the line (not UTF-8, a control character other than a tab, not a
// file) or read, and then every prompt has a file name that is safe, bounded (with room for NAME.tmp under 255 bytes)
// and its own — decided before any sampling.
TEST(HostileInputs, PromptFilesAreRefusedByLineOrGetSafeUniqueBoundedNames) {
  int refused = 0, read = 0;
  for (const auto& name : io::list_directory(corpus("prompts"))) {
    const std::string path = corpus("prompts") + "/" + name;
    const bool bad = name.rfind("invalid_utf8", 0) == 0 || name.rfind("control_", 0) == 0;
    std::vector<std::string> prompts;
    try {
      prompts = io::read_prompt_file(path);
    } catch (const std::runtime_error& e) {
      EXPECT_TRUE(bad) << name << " refused: " << e.what();
      EXPECT_NE(std::string(e.what()).find(path + "' line "), std::string::npos) << e.what();
      ++refused;
      continue;
    }
    EXPECT_FALSE(bad) << name << " was read";
    ++read;
    const auto jobs = io::plan_vbench_samples(prompts, 5, 0);
    std::set<std::string> files;
    for (const auto& job : jobs) {
      const std::string& f = job.file;
      EXPECT_LE(f.size() + 4, 255u) << f;
      EXPECT_TRUE(std::none_of(f.begin(), f.end(), [](char c) {
        return c == '/' || static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
      })) << f;
      EXPECT_TRUE(f[0] != '-' && f[0] != '.') << f;
      files.insert(f);
    }
    EXPECT_EQ(files.size(), jobs.size()) << name << ": two videos share a file name";
  }
  EXPECT_GE(refused, 6);
  EXPECT_GE(read, 6);
  EXPECT_THROW(io::read_prompt_file("/dev/zero"), std::runtime_error);
}

// Metrics files as megaslide-plot reads them: a skipped step's nulls load (as NaN gaps), and a last line cut short
// (no newline: a full disk, a kill mid-write) is passed over as a resume drops it; anything else malformed is a
// MetricsFileError naming the file and the line.
TEST(HostileInputs, MetricsFilesLoadOrNameTheLine) {
  for (const auto& name : io::list_directory(corpus("metrics"))) {
    const std::string path = corpus("metrics") + "/" + name;
    const bool loads =
        name == "skipped_step_null.jsonl" || name == "all_steps_skipped.jsonl" || name == "torn_line.jsonl";
    try {
      const auto steps = read_metrics_jsonl(path);
      EXPECT_TRUE(loads) << name << " was accepted";
    } catch (const MetricsFileError& e) {
      EXPECT_FALSE(loads) << name << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(path + ":"), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << name << ": unexpected exception type: " << e.what();
    }
  }
}

namespace {
// Replays tests/corpus/cli/TOOL.txt: every line must exit 2 with one line of output naming the tool, no LibTorch
// stack trace, and nothing left in the scratch folder.
void replay_cli_corpus(const std::string& tool) {
  const std::string tmp = "/tmp/megaslide-test-hostile-cli-" + std::to_string(::getpid());
  io::remove_tree(tmp);
  io::make_directories(tmp);
  std::istringstream lines(io::read_file(corpus("cli") + "/" + tool + ".txt"));
  std::string line;
  int cases = 0;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
             {"{source}", MEGASLIDE_SOURCE_DIR}, {"{corpus}", corpus("")}, {"{tmp}", tmp}})
      for (size_t p = line.find(key); p != std::string::npos; p = line.find(key)) line.replace(p, key.size(), value);
    const auto r = megaslide::testing::run_tool(tool, line);
    EXPECT_EQ(r.code, 2) << tool << " " << line << "\n" << r.output;
    EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << tool << " " << line << "\n" << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << tool << " " << line << "\n" << r.output;
    EXPECT_EQ(r.output.rfind(tool + ": ", 0), 0u) << tool << " " << line << "\n" << r.output;
    EXPECT_TRUE(io::list_directory(tmp).empty()) << tool << " " << line << " wrote into " << tmp;
    ++cases;
  }
  EXPECT_GT(cases, 0);
  io::remove_tree(tmp);
}
}  // namespace

TEST(HostileInputs, TrainCommandLinesExitTwoWithOneLine) { replay_cli_corpus("megaslide-train"); }
TEST(HostileInputs, PlanCommandLinesExitTwoWithOneLine) { replay_cli_corpus("megaslide-plan"); }
TEST(HostileInputs, SampleCommandLinesExitTwoWithOneLine) { replay_cli_corpus("megaslide-sample"); }
TEST(HostileInputs, EvalCommandLinesExitTwoWithOneLine) { replay_cli_corpus("megaslide-eval"); }
TEST(HostileInputs, PlotCommandLinesExitTwoWithOneLine) { replay_cli_corpus("megaslide-plot"); }
TEST(HostileInputs, AblateCommandLinesExitTwoWithOneLine) { replay_cli_corpus("megaslide-ablate"); }

TEST(HostileInputs, MutatedSafetensorsNeverEscapeTheReadersErrorType) {
  const std::string scratch = "/tmp/megaslide-test-mutated-" + std::to_string(::getpid()) + ".safetensors";
  std::vector<std::string> seeds;
  for (const auto& name : io::list_directory(corpus("safetensors")))
    seeds.push_back(io::read_file(corpus("safetensors") + "/" + name));
  // A real weights-shaped file as a seed too.
  seeds.push_back(
      io::encode_safetensors({{"w", torch::randn({4, 3})}, {"b", torch::ones({3}, torch::kBFloat16)}}, {{"k", "v"}}));
  std::mt19937_64 rng(20261129);
  int loaded = 0, refused = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string message;
    const int outcome = feed_safetensors(mutate(seeds[static_cast<size_t>(i) % seeds.size()], rng), scratch, &message);
    ASSERT_LT(outcome, 2) << "case " << i << ": " << message;
    (outcome == 0 ? loaded : refused)++;
  }
  EXPECT_GT(refused, 2000);
  EXPECT_GT(loaded, 0);  // some mutations (in tensor data) leave a valid file: the loop reaches past the header
  ::unlink(scratch.c_str());
}

TEST(HostileInputs, MutatedRunConfigsNeverEscapeTheParsersErrorType) {
  std::vector<std::string> seeds;
  for (const auto& name : io::list_directory(corpus("run_config")))
    seeds.push_back(io::read_file(corpus("run_config") + "/" + name));
  seeds.push_back(io::read_file(std::string(MEGASLIDE_SOURCE_DIR) + "/configs/smoke.yaml"));
  std::mt19937_64 rng(11292026);
  int loaded = 0, refused = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string message;
    const int outcome = feed_config(mutate(seeds[static_cast<size_t>(i) % seeds.size()], rng), &message);
    ASSERT_LT(outcome, 2) << "case " << i << ": " << message;
    (outcome == 0 ? loaded : refused)++;
  }
  EXPECT_GT(refused, 1000);
  EXPECT_GT(loaded, 0);
}
