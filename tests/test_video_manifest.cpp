// Video manifests: the CSV reader follows RFC 4180 (quotes, "" escapes, commas and newlines inside
// quotes, CRLF, a BOM); WebVid and Open-Sora CSVs, JSONL and a caption folder list the same items with
// the same captions, paths resolved against the manifest's folder; unusable rows are bad items with a
// reason, and a manifest that matches no layout is refused naming the file and line.
#include "megaslide/data/video_manifest.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>

#include "video_fixture.h"

using megaslide::DataConfig;
using megaslide::DatasetError;

namespace {

DataConfig config_for(const std::string& manifest, const std::string& root = "") {
  DataConfig d;
  d.dataset = "videos";
  d.manifest = manifest;
  d.root = root;
  return d;
}

std::string temp_file(const std::string& name, const std::string& text) {
  const std::string path = "/tmp/megaslide-test-manifest-" + std::to_string(::getpid()) + "-" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

}  // namespace

TEST(VideoManifest, CsvFollowsRfc4180) {
  const auto rows = megaslide::parse_csv(
      "\xEF\xBB\xBF"
      "a,b,c\r\n\"x, y\",\"say \"\"hi\"\"\",\"two\nlines\"\r\n\n1,,3",
      "t.csv");
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0], (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(rows[1], (std::vector<std::string>{"x, y", "say \"hi\"", "two\nlines"}));
  EXPECT_EQ(rows[2], (std::vector<std::string>{"1", "", "3"}));
  try {
    megaslide::parse_csv("a,b\n\"open,2\n", "t.csv");
    FAIL() << "an unterminated quote was accepted";
  } catch (const DatasetError& e) {
    EXPECT_NE(std::string(e.what()).find("t.csv: line 2"), std::string::npos) << e.what();
  }
}

TEST(VideoManifest, AllLayoutsListTheSameItemsAndBadOnes) {
  megaslide::testing::VideoFixture fx("manifest", 3, 4, 16, 16);
  const std::string videos = fx.dir + "/videos";
  const auto opensora = megaslide::read_video_manifest(config_for(fx.dir + "/opensora.csv"));
  auto webvid_config = config_for(fx.dir + "/webvid.csv");
  const auto webvid = megaslide::read_video_manifest(webvid_config);
  const auto jsonl = megaslide::read_video_manifest(config_for(fx.dir + "/items.jsonl"));
  const auto folder = megaslide::read_video_manifest(config_for("", videos));
  EXPECT_EQ(opensora.layout, "opensora-csv");
  EXPECT_EQ(webvid.layout, "webvid-csv");
  EXPECT_EQ(jsonl.layout, "jsonl");
  EXPECT_EQ(folder.layout, "folder");
  // The manifests list 3 good clips, corrupt, short and missing (6); the folder lists the files on disk:
  // 3 clips, corrupt, nocaption (bad: no caption), short.
  for (const auto* m : {&opensora, &webvid, &jsonl}) {
    ASSERT_EQ(m->items.size(), 6u) << m->layout;
    EXPECT_TRUE(m->bad.empty()) << m->layout;
    for (int k = 0; k < 3; ++k) {
      EXPECT_EQ(m->items[static_cast<size_t>(k)].path, fx.dir + "/videos/clip-" + std::to_string(k) + ".mp4")
          << m->layout;
      EXPECT_EQ(m->items[static_cast<size_t>(k)].caption, fx.captions[static_cast<size_t>(k)]) << m->layout;
      EXPECT_EQ(m->items[static_cast<size_t>(k)].index, k);
    }
    EXPECT_EQ(m->items[5].path, fx.dir + "/videos/missing.mp4");
  }
  ASSERT_EQ(folder.items.size(), 5u);
  ASSERT_EQ(folder.bad.size(), 1u);
  EXPECT_EQ(folder.bad[0].path, videos + "/nocaption.mp4");
  EXPECT_NE(folder.bad[0].reason.find("missing caption"), std::string::npos);
  for (int k = 0; k < 3; ++k)
    EXPECT_EQ(folder.items[static_cast<size_t>(k)].caption, fx.captions[static_cast<size_t>(k)]);
}

TEST(VideoManifest, UnusableRowsAreBadItemsWithAReason) {
  const auto csv = temp_file("rows.csv", "path,text\n/v/a.mp4,a cat\n/v/b.mp4,\n,no path\n/v/c.mp4,x,extra\n");
  const auto m = megaslide::read_video_manifest(config_for(csv));
  ASSERT_EQ(m.items.size(), 1u);
  ASSERT_EQ(m.bad.size(), 3u);
  EXPECT_NE(m.bad[0].reason.find("missing caption"), std::string::npos);
  EXPECT_EQ(m.bad[0].path, "/v/b.mp4");
  EXPECT_NE(m.bad[1].reason.find("no video path"), std::string::npos);
  EXPECT_NE(m.bad[2].reason.find("fields"), std::string::npos);
  EXPECT_EQ(m.listed(), 4);
  const auto jsonl = temp_file(
      "rows.jsonl",
      "{\"video\": \"rel/a.mp4\", \"caption\": \"ok\"}\nnot json\n{\"video\": 3}\n\n{\"video\": \"b.mp4\"}\n");
  const auto j = megaslide::read_video_manifest(config_for(jsonl));
  ASSERT_EQ(j.items.size(), 1u);
  EXPECT_EQ(j.items[0].path, "/tmp/rel/a.mp4");  // relative to the manifest's folder
  ASSERT_EQ(j.bad.size(), 3u);
  EXPECT_NE(j.bad[0].path.find(":2"), std::string::npos);
  EXPECT_NE(j.bad[2].reason.find("missing caption"), std::string::npos);
  megaslide::io::remove_tree(csv);
  megaslide::io::remove_tree(jsonl);
}

// The property: a folder lists each video once however many symbolic links lead back into it (one
// link to an ancestor used to list everything again at each level, two never ended), and an item whose
// caption or file name is not UTF-8 is a bad item with a reason naming the byte, named in UTF-8 itself
// (the cache's manifest and the logs store names as UTF-8) — not the failure of the whole listing.
TEST(VideoManifest, LinkLoopsListEachVideoOnceAndNonUtf8ItemsAreBadItems) {
  const std::string root = "/tmp/megaslide-test-manifest-loops-" + std::to_string(::getpid());
  megaslide::io::remove_tree(root);
  megaslide::io::make_directories(root + "/sub");
  for (const std::string name : {"a", "sub/b", "latin1-\xe9t\xe9", "badcaption"}) {
    std::ofstream(root + "/" + name + ".mp4") << "x";
    std::ofstream(root + "/" + name + ".txt") << (name == "badcaption" ? "a caf\xe9 at night" : "a caption");
  }
  ASSERT_EQ(::symlink(".", (root + "/loop").c_str()), 0);
  ASSERT_EQ(::symlink("..", (root + "/sub/up").c_str()), 0);
  const auto m = megaslide::read_video_manifest(config_for("", root));
  std::vector<std::string> listed;
  for (const auto& item : m.items) listed.push_back(item.where);
  EXPECT_EQ(listed, (std::vector<std::string>{"a.mp4", "sub/b.mp4"}));
  ASSERT_EQ(m.bad.size(), 2u);
  for (const auto& b : m.bad) {
    EXPECT_NE(b.reason.find("is not UTF-8 text (byte 0xe9"), std::string::npos) << b.reason;
    EXPECT_EQ(b.path.find('\xe9'), std::string::npos) << "named in UTF-8: " << b.path;
  }
  EXPECT_NE(m.bad[0].reason.find("its caption"), std::string::npos) << m.bad[0].reason;    // badcaption.mp4
  EXPECT_NE(m.bad[1].reason.find("its file name"), std::string::npos) << m.bad[1].reason;  // latin1-\xe9t\xe9.mp4
  EXPECT_NE(m.bad[1].path.find("latin1-\\xe9t\\xe9.mp4"), std::string::npos) << m.bad[1].path;
  EXPECT_EQ(m.listed(), 4);
  megaslide::io::remove_tree(root);
}

TEST(VideoManifest, AManifestOfNoLayoutIsRefusedNamingIt) {
  const auto csv = temp_file("header.csv", "file,caption\na.mp4,x\n");
  try {
    megaslide::read_video_manifest(config_for(csv));
    FAIL();
  } catch (const DatasetError& e) {
    EXPECT_NE(std::string(e.what()).find(csv + ": line 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("WebVid"), std::string::npos) << e.what();
  }
  auto webvid = temp_file("webvid.csv", "videoid,name,page_dir\n1,a cat,p\n");
  auto c = config_for(webvid);
  c.video_path_template = "{folder}/{videoid}.mp4";
  EXPECT_THROW(megaslide::read_video_manifest(c), DatasetError);
  EXPECT_THROW(megaslide::read_video_manifest(config_for("/nonexistent/x.csv")), DatasetError);
  const auto txt = temp_file("m.txt", "x");
  EXPECT_THROW(megaslide::read_video_manifest(config_for(txt)), DatasetError);
  megaslide::io::remove_tree(txt);
  megaslide::io::remove_tree(csv);
  megaslide::io::remove_tree(webvid);
}
