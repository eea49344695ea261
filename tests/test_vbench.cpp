// VBench layout: file names VBench's parser maps back to the prompt, the length cap at a UTF-8 boundary,
// seeds that depend only on (base seed, prompt, index), prompt files, index.json.
#include "megaslide/io/vbench_layout.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <set>
#include <utility>
#include <vector>

#include "megaslide/io/files.h"

using namespace megaslide::io;

namespace {
std::string temp_path(const std::string& name) {
  return "/tmp/megaslide-test-vbench-" + std::to_string(::getpid()) + "-" + name;
}

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += n;
  }
  return true;
}
}  // namespace

TEST(VBench, FileNamesMapBackToThePromptAsVBenchParsesThem) {
  // Prompts in the style of VBench's prompt suite: punctuation, digits, apostrophes, dots kept as they are.
  const std::vector<std::string> prompts{"a red blob moves left quickly",
                                         "A person is riding a bike, high quality, 4K.",
                                         "an astronaut's helmet reflecting the sun",
                                         "room 101",        // ends in digits: only the appended -index is stripped
                                         "counting 1-2-3",  // ends in -<digits> itself
                                         "Vincent van Gogh style. A cat"};
  for (const auto& p : prompts) {
    for (int64_t i : {0, 4, 12}) {
      const auto name = vbench_file_name(p, i);
      EXPECT_EQ(name, p + "-" + std::to_string(i) + ".mp4");
      EXPECT_EQ(vbench_prompt_from_file_name(name), p) << name;
      EXPECT_EQ(vbench_prompt_from_file_name("/some/dir/" + name), p);
    }
  }
}

// The property: every name is safe (no '/', no control character, no invalid UTF-8, no leading '-'
// or '.'), bounded (it and a temporary "NAME.tmp" beside it fit a 255-byte file name), and unique per
// prompt — a name that had to change carries the prompt's hash.
TEST(VBench, UnsafeCharactersAreReplacedAndLongPromptsCutAtACharacterBoundary) {
  const auto slash = vbench_file_name("left/right\tmotion", 1);
  EXPECT_EQ(slash.substr(0, 18), "left_right_motion~") << slash;
  EXPECT_EQ(slash.size(), 18u + 8u + 6u) << slash;
  EXPECT_EQ(slash.substr(slash.size() - 6), "-1.mp4");
  EXPECT_NE(vbench_file_name("a/b", 0), vbench_file_name("a_b", 0)) << "unique";
  EXPECT_EQ(vbench_file_name("a_b", 0), "a_b-0.mp4") << "a name that needs no change is VBench's";
  EXPECT_EQ(vbench_file_name("-rf", 0).substr(0, 4), "_rf~");
  EXPECT_EQ(vbench_file_name("..", 0).substr(0, 3), "_.~");
  EXPECT_EQ(vbench_file_name(std::string("bad \xff byte"), 0).substr(0, 11), "bad _ byte~");
  std::string long_prompt;
  for (int i = 0; i < 120; ++i) long_prompt += "日";  // 3 bytes each: the cap falls inside one
  const auto name = vbench_file_name(long_prompt, 99);
  EXPECT_LE(name.size(), kMaxFileNameBytes);
  EXPECT_LE(name.size() + 4, 255u) << "NAME.tmp must fit the file system's limit";
  EXPECT_TRUE(valid_utf8(name)) << name;
  EXPECT_EQ(long_prompt.compare(0, name.find('~'), name.substr(0, name.find('~'))), 0)
      << "the name starts with a prefix of the prompt";
  EXPECT_EQ(name.substr(name.size() - 7), "-99.mp4");
  // VBench's augmented prompts are long and share long openings: still one name each.
  const std::string opening(300, 'a');
  EXPECT_NE(vbench_file_name(opening + " cat", 0), vbench_file_name(opening + " dog", 0));
  EXPECT_LE(vbench_file_name(opening + " cat", 0).size(), kMaxFileNameBytes);
}

TEST(VBench, SeedsDependOnlyOnBaseSeedPromptAndIndex) {
  const std::vector<std::string> prompts{"a", "b", "c"};
  auto jobs = plan_vbench_samples(prompts, 3, 7);
  ASSERT_EQ(jobs.size(), 9u);
  EXPECT_EQ(jobs[4].prompt, "b");
  EXPECT_EQ(jobs[4].index, 1);
  EXPECT_EQ(jobs[4].file, "b-1.mp4");
  // Reordering or subsetting the prompts does not change a video's seed.
  auto reordered = plan_vbench_samples({"c", "b"}, 2, 7);
  EXPECT_EQ(reordered[2].seed, jobs[3].seed);  // ("b", 0)
  EXPECT_EQ(reordered[1].seed, jobs[7].seed);  // ("c", 1)
  std::set<uint64_t> seeds;
  for (const auto& j : jobs) seeds.insert(j.seed);
  EXPECT_EQ(seeds.size(), jobs.size()) << "distinct per (prompt, index)";
  EXPECT_NE(vbench_seed("a", 0, 7), vbench_seed("a", 0, 8)) << "the base seed matters";
  EXPECT_THROW(plan_vbench_samples(prompts, 0, 7), std::invalid_argument);
  const auto both = plan_vbench_samples({"a/b", "a_b"}, 1, 7);
  EXPECT_NE(both[0].file, both[1].file) << "two prompts, two file names";
}

TEST(VBench, PromptFilesOneLineEachBlankLinesAndRepeatsSkipped) {
  auto path = temp_path("prompts.txt");
  megaslide::io::write_file_atomically(path,
                                       "a red blob moves left\r\n\n  a blue blob moves up  \na red blob moves left\n");
  EXPECT_EQ(read_prompt_file(path), (std::vector<std::string>{"a red blob moves left", "a blue blob moves up"}));
  megaslide::io::write_file_atomically(path, "\n \n");
  try {
    read_prompt_file(path);
    ADD_FAILURE() << "an empty prompt file was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  try {
    read_prompt_file(temp_path("missing.txt"));
    ADD_FAILURE() << "a missing prompt file was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(temp_path("missing.txt")), std::string::npos) << e.what();
  }
  megaslide::io::remove_tree(path);
}

// A prompt line's settings are read from " --X value" after the prompt: numbers checked, the negative
// prompt up to the next setting, "--" inside prompt text left alone; lines kept in order with repeats.
TEST(VBench, PromptSpecsCarryEachLinesOwnSettings) {
  auto spec = parse_prompt_spec(
      "a red fox runs -- fast --w 832 --h 480 --f 81 --d 42 --s 30 --g 5.5 --n blurry, low quality", "here");
  EXPECT_EQ(spec.prompt, "a red fox runs -- fast");
  EXPECT_EQ(spec.width, 832);
  EXPECT_EQ(spec.height, 480);
  EXPECT_EQ(spec.frames, 81);
  EXPECT_EQ(spec.seed, 42u);
  EXPECT_EQ(spec.steps, 30);
  EXPECT_EQ(spec.guidance, 5.5);
  EXPECT_EQ(spec.negative, "blurry, low quality");
  EXPECT_TRUE(spec.has_size());
  spec = parse_prompt_spec("a blue blob --n ugly, --text-like words --d 18446744073709551615", "here");
  EXPECT_EQ(spec.negative, "ugly, --text-like words");  // "--text-like" is not a setting: no space after its letters
  EXPECT_EQ(spec.seed, UINT64_MAX);
  EXPECT_FALSE(spec.has_size());
  EXPECT_FALSE(spec.steps || spec.guidance || spec.width);
  spec = parse_prompt_spec("plain prompt", "here");
  EXPECT_EQ(spec.prompt, "plain prompt");
  EXPECT_FALSE(spec.seed || spec.negative || spec.has_size());

  for (const auto& [line, problem] : std::vector<std::pair<std::string, std::string>>{
           {"a cat --q 3", "unknown setting '--q'"},
           {"a cat --width 3", "unknown setting '--width'"},
           {"a cat --w 64 --w 32", "--w is given twice"},
           {"a cat --w 0", "--w '0' is not a whole number from 1"},
           {"a cat --h -8", "--h '-8' is not a whole number"},
           {"a cat --f 2.5", "--f '2.5' is not a whole number"},
           {"a cat --d 18446744073709551616", "--d '18446744073709551616' is not a whole number"},
           {"a cat --g lots", "--g 'lots' is not a number"},
           {"a cat --s", "--s '' is not a whole number"},
           {"--w 64", "settings but no prompt"}}) {
    try {
      parse_prompt_spec(" " + line, "prompts.txt line 4");
      ADD_FAILURE() << "accepted " << line;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("prompts.txt line 4: " + problem), std::string::npos)
          << line << ": " << e.what();
    }
  }

  const auto path = temp_path("specs.txt");
  megaslide::io::write_file_atomically(path,
                                       "# validation prompts\na red blob --w 64\n\na red blob --d 9\na blue blob\n");
  const auto specs = read_prompt_specs(path);
  ASSERT_EQ(specs.size(), 3u);
  EXPECT_EQ(specs[1].line, 4);
  EXPECT_EQ(specs[1].file, path);
  const auto jobs = plan_prompt_specs(specs, 5);
  EXPECT_EQ(jobs[0].index, 0);
  EXPECT_EQ(jobs[1].index, 1);  // the same prompt again: the next VBench index
  EXPECT_EQ(jobs[1].file, vbench_file_name("a red blob", 1));
  EXPECT_EQ(jobs[1].seed, 9u);
  EXPECT_EQ(jobs[0].seed, vbench_seed("a red blob", 0, 5));
  EXPECT_EQ(jobs[2].seed, vbench_seed("a blue blob", 0, 5));
  megaslide::io::write_file_atomically(path, "a cat\na dog --s x\n");
  try {
    read_prompt_specs(path);
    ADD_FAILURE() << "a bad setting was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("prompt file '" + path + "' line 2: --s 'x'"), std::string::npos) << e.what();
  }
  megaslide::io::remove_tree(path);
}

// A prompt file that is not UTF-8, or holds a control character, is refused before any work, naming the line and the
// byte; so is a file that is no prompt file at all (a folder, a device). A byte-order mark is skipped.
TEST(VBench, PromptFileThatIsNotUtf8IsRefusedNamingTheLine) {
  auto path = temp_path("latin1.txt");
  for (const std::string bad : {std::string("caf\xe9 au lait"), std::string("\xc0\xaf overlong slash"),
                                std::string("\xed\xa0\x80 surrogate"), std::string("cut \xe6\x97")}) {
    megaslide::io::write_file_atomically(path, "a fine prompt\n" + bad + "\n");
    try {
      read_prompt_file(path);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(path + "' line 2: not valid UTF-8"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(read_prompt_file("/dev/zero"), std::runtime_error);
  EXPECT_THROW(read_prompt_file("/tmp"), std::runtime_error);
  // A byte-order mark (a Windows editor's) is not part of the first prompt; a control character (a binary file, UTF-16
  // without a mark) is refused naming the line; a tab and CRLF are white space.
  megaslide::io::write_file_atomically(path,
                                       "\xEF\xBB\xBF"
                                       "a red blob\r\na\tblue blob\r\n");
  EXPECT_EQ(read_prompt_file(path), (std::vector<std::string>{"a red blob", "a\tblue blob"}));
  megaslide::io::write_file_atomically(path, std::string("a red blob\nx\0y\n", 15));
  try {
    read_prompt_file(path);
    ADD_FAILURE() << "accepted a NUL";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path + "' line 2: holds the control character 0x00 at byte 2"),
              std::string::npos)
        << e.what();
  }
  megaslide::io::remove_tree(path);
}

TEST(VBench, SampleFolderIsFoundFromItsRootOrItsVideosFolder) {
  auto dir = temp_path("layout");
  megaslide::io::make_directories(dir + "/videos");
  megaslide::io::write_file_atomically(dir + "/index.json", "{}");
  auto f = find_sample_folder(dir);
  EXPECT_EQ(f.videos, dir + "/videos");
  EXPECT_EQ(f.index, dir + "/index.json");
  f = find_sample_folder(dir + "/videos");
  EXPECT_EQ(f.root, dir);
  EXPECT_EQ(f.videos, dir + "/videos");
  f = find_sample_folder(dir + "/videos/");
  EXPECT_EQ(f.root, dir);
  megaslide::io::remove_tree(dir);
  megaslide::io::make_directories(dir);
  f = find_sample_folder(dir);  // any folder of MP4s
  EXPECT_EQ(f.root, dir);
  EXPECT_EQ(f.videos, dir);
  megaslide::io::remove_tree(dir);
}

TEST(VBench, IndexJsonListsEveryVideo) {
  auto jobs = plan_vbench_samples({"x \"quoted\""}, 2, 1);
  SamplingRecord record{"/models/a\\b.safetensors", "ddpm", 30, 7.5, 0.0, 1, 8, 1};
  auto j = nlohmann::json::parse(index_json(jobs, record));
  EXPECT_EQ(j.at("checkpoint"), "/models/a\\b.safetensors");
  EXPECT_EQ(j.at("steps"), 30);
  ASSERT_EQ(j.at("videos").size(), 2u);
  EXPECT_EQ(j.at("videos")[1].at("prompt"), "x \"quoted\"");
  EXPECT_EQ(j.at("videos")[1].at("index"), 1);
  EXPECT_EQ(j.at("videos")[1].at("seed").get<uint64_t>(), jobs[1].seed);
  EXPECT_EQ(j.at("videos")[1].at("file"), jobs[1].file);
  EXPECT_FALSE(j.contains("compute_dtype"));  // settings not given are not recorded
  EXPECT_FALSE(j.contains("shift"));
  EXPECT_FALSE(j.contains("crf"));
  EXPECT_FALSE(j.contains("lora"));
  record.compute_dtype = "bf16";
  record.shift = 0.0;
  record.crf = 0;
  record.negative_prompt = "";
  record.lora_2 = {{"low.safetensors", 0.75}};
  j = nlohmann::json::parse(index_json(jobs, record));
  EXPECT_EQ(j.at("compute_dtype"), "bf16");
  EXPECT_EQ(j.at("shift"), 0.0);  // zero is a setting, recorded
  EXPECT_EQ(j.at("crf"), 0);
  EXPECT_EQ(j.at("negative_prompt"), "");
  EXPECT_FALSE(j.contains("lora"));
  EXPECT_EQ(j.at("lora_2")[0].at("file"), "low.safetensors");
  EXPECT_EQ(j.at("lora_2")[0].at("scale"), 0.75);
}

TEST(VBench, ListFilesFindsOnlyTheExtension) {
  auto dir = temp_path("list");
  megaslide::io::make_directories(dir + "/sub.mp4");  // a folder named like a video is not listed
  megaslide::io::write_file_atomically(dir + "/b-0.mp4", "x");
  megaslide::io::write_file_atomically(dir + "/a-0.mp4", "x");
  megaslide::io::write_file_atomically(dir + "/index.json", "{}");
  EXPECT_EQ(list_files(dir, "mp4"), (std::vector<std::string>{"a-0.mp4", "b-0.mp4"}));
  EXPECT_THROW(list_files(dir + "/missing", "mp4"), std::runtime_error);
  megaslide::io::remove_tree(dir);
}
