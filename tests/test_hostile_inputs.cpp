// Hostile inputs for the two parsers that read files users hand us: the run-config parser and the
// safetensors reader (checkpoints and weights files). A committed corpus (tests/corpus/) of
// hand-written malformed files is replayed, then a bounded, seeded mutation loop (bit flips, byte
// overwrites, truncations, insertions, length-field edits) runs over every seed. The property: each
// input either loads or raises the project's own error type (ConfigError, SafetensorsError) — never
// another exception, a crash, or an allocation sized by an unchecked header field. The same seeds
// drive the libFuzzer targets (tests/fuzz/) where clang is available.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <cstring>
#include <random>

#include "megaslide/config/run_config.h"
#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"

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

TEST(HostileInputs, MutatedSafetensorsNeverEscapeTheReadersErrorType) {
  const std::string scratch = "/tmp/megaslide-test-mutated-" + std::to_string(::getpid()) + ".safetensors";
  std::vector<std::string> seeds;
  for (const auto& name : io::list_directory(corpus("safetensors"))) seeds.push_back(io::read_file(corpus("safetensors") + "/" + name));
  // A real weights-shaped file as a seed too.
  seeds.push_back(io::encode_safetensors({{"w", torch::randn({4, 3})}, {"b", torch::ones({3}, torch::kBFloat16)}}, {{"k", "v"}}));
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
  for (const auto& name : io::list_directory(corpus("run_config"))) seeds.push_back(io::read_file(corpus("run_config") + "/" + name));
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
