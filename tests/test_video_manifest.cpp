// Video manifests: the CSV reader follows RFC 4180 (quotes, "" escapes, commas and newlines inside
// quotes, CRLF, a BOM); WebVid and Open-Sora CSVs, JSONL and a caption folder list the same items with
// the same captions, paths resolved against the manifest's folder; unusable rows are bad items with a
// reason, and a manifest that matches no layout is refused naming the file and line. A clip's conditioning
// image comes from an `image` (or `image_path`) column or key, or a same-stem image beside a folder's video; a
// folder's other images are stills when a bucket has one frame.
#include "megaslide/data/video_manifest.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <map>

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

// An empty folder of its own for a test: /tmp/megaslide-test-manifest-<pid>-<name>.
std::string temp_folder(const std::string& name) {
  const std::string path = "/tmp/megaslide-test-manifest-" + std::to_string(::getpid()) + "-" + name;
  megaslide::io::remove_tree(path);
  megaslide::io::make_directories(path);
  return path;
}

void write_file(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

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

// The property: a folder lists the containers cameras and capture cards write (.ts, .mts, .m2ts, .mpg, .3gp, ...),
// and a caption file's UTF-8 byte-order mark is no part of its caption (a file of the mark alone has none); a UTF-16
// caption is named as such.
TEST(VideoManifest, FolderCaptionsLoseTheirByteOrderMarkAndEveryContainerIsListed) {
  const std::string dir = "/tmp/megaslide-test-manifest-" + std::to_string(::getpid()) + "-bom";
  megaslide::io::make_directories(dir);
  const auto put = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name, std::ios::binary) << text;
  };
  for (const char* ext : {"ts", "mts", "m2ts", "mpg", "mpeg", "3gp", "flv", "wmv"}) {
    put(std::string("v-") + ext + "." + ext, "not decoded here");
    put(std::string("v-") + ext + ".txt", std::string("a clip in .") + ext);
  }
  put("bom.mp4", "x");
  put("bom.txt", "\xEF\xBB\xBF a cat with a mark\r\n");
  put("only.mp4", "x");
  put("only.txt", "\xEF\xBB\xBF\r\n");
  put("wide.mp4", "x");
  put("wide.txt", std::string("\xFF\xFE"
                              "a\0b\0",
                              6));
  const auto m = megaslide::read_video_manifest(config_for("", dir));
  std::map<std::string, std::string> captions, bad;
  for (const auto& item : m.items) captions[item.path.substr(dir.size() + 1)] = item.caption;
  for (const auto& item : m.bad) bad[item.path.substr(dir.size() + 1)] = item.reason;
  for (const char* ext : {"ts", "mts", "m2ts", "mpg", "mpeg", "3gp", "flv", "wmv"})
    EXPECT_EQ(captions[std::string("v-") + ext + "." + ext], std::string("a clip in .") + ext) << ext;
  EXPECT_EQ(captions["bom.mp4"], "a cat with a mark");
  EXPECT_NE(bad["only.mp4"].find("missing caption"), std::string::npos) << bad["only.mp4"];
  EXPECT_NE(bad["wide.mp4"].find("UTF-16 text (its byte-order mark)?"), std::string::npos) << bad["wide.mp4"];
  EXPECT_EQ(m.items.size(), 9u);
  megaslide::io::remove_tree(dir);
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
  const auto jsonl =
      temp_file("rows.jsonl",
                "{\"video\": \"rel/a.mp4\", \"caption\": \"ok\"}\nnot json\n{\"video\": 3}\n\n{\"video\": \"b.mp4\"}\n"
                "{\"video\": \"c.mp4\", \"caption\": 5}\n");
  const auto j = megaslide::read_video_manifest(config_for(jsonl));
  ASSERT_EQ(j.items.size(), 1u);
  EXPECT_EQ(j.items[0].path, "/tmp/rel/a.mp4");  // relative to the manifest's folder
  ASSERT_EQ(j.bad.size(), 4u);
  EXPECT_NE(j.bad[0].path.find(":2"), std::string::npos);
  EXPECT_NE(j.bad[2].reason.find("missing caption"), std::string::npos);
  // A caption that is there but not text is said to be so, not missing.
  EXPECT_NE(j.bad[3].reason.find("\"caption\" is number, expected text"), std::string::npos) << j.bad[3].reason;
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

// The property: a manifest of no layout (an unknown header, a .txt file, one JSON array) is refused naming it.
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
  // One JSON array is not JSON Lines: refused once, saying so (not every line a bad item).
  const auto array = temp_file("array.json", "[\n  {\"video\": \"a.mp4\", \"caption\": \"x\"}\n]\n");
  try {
    megaslide::read_video_manifest(config_for(array));
    ADD_FAILURE() << "a JSON array was read as JSON Lines";
  } catch (const DatasetError& e) {
    EXPECT_NE(std::string(e.what()).find("is a JSON array"), std::string::npos) << e.what();
  }
  megaslide::io::remove_tree(array);
  megaslide::io::remove_tree(csv);
  megaslide::io::remove_tree(webvid);
}

// The property: an `image` column names each clip's conditioning image, resolved against the manifest's
// folder like the video; an empty cell is no image; `image_path` is accepted for it in either CSV layout,
// and `image` wins when both are there.
TEST(VideoManifest, CsvImageColumnNamesEachClipsImage) {
  const std::string dir = temp_folder("csv-images");
  megaslide::io::make_directories(dir + "/frames");
  for (const std::string name : {"a.png", "b.jpg", "other.png"}) write_file(dir + "/frames/" + name, "x");
  write_file(dir + "/opensora.csv",
             "path,text,image\nv/a.mp4,a cat,frames/a.png\nv/b.mp4,a dog,\"frames/b.jpg\"\nv/c.mp4,a bird,\n");
  const auto opensora = megaslide::read_video_manifest(config_for(dir + "/opensora.csv"), /*images=*/true);
  ASSERT_EQ(opensora.items.size(), 3u);
  EXPECT_TRUE(opensora.bad.empty());
  EXPECT_EQ(opensora.items[0].image, dir + "/frames/a.png");
  EXPECT_EQ(opensora.items[1].image, dir + "/frames/b.jpg");
  EXPECT_EQ(opensora.items[2].image, "") << "an empty cell names no image";

  write_file(dir + "/webvid.csv", "videoid,name,page_dir,image_path\n1,a cat,p," + dir + "/frames/a.png\n");
  const auto webvid = megaslide::read_video_manifest(config_for(dir + "/webvid.csv"), /*images=*/true);
  ASSERT_EQ(webvid.items.size(), 1u);
  EXPECT_EQ(webvid.layout, "webvid-csv");
  EXPECT_EQ(webvid.items[0].image, dir + "/frames/a.png") << "an absolute image path is kept";

  write_file(dir + "/both.csv", "path,text,image_path,image\nv/a.mp4,a cat,frames/other.png,frames/a.png\n");
  const auto both = megaslide::read_video_manifest(config_for(dir + "/both.csv"), /*images=*/true);
  ASSERT_EQ(both.items.size(), 1u);
  EXPECT_EQ(both.items[0].image, dir + "/frames/a.png") << "`image` wins over `image_path`";

  write_file(dir + "/none.csv", "path,text\nv/a.mp4,a cat\n");
  const auto none = megaslide::read_video_manifest(config_for(dir + "/none.csv"), /*images=*/true);
  ASSERT_EQ(none.items.size(), 1u);
  EXPECT_EQ(none.items[0].image, "") << "no column, no image";
  megaslide::io::remove_tree(dir);
}

// The property: a JSONL line's "image" (or "image_path") resolves against the manifest's folder; null, ""
// or no key is no image; a value that is not a string makes the line a bad item that says so.
TEST(VideoManifest, JsonlImageKeyIsResolvedAgainstTheManifest) {
  const std::string dir = temp_folder("jsonl-images");
  megaslide::io::make_directories(dir + "/frames");
  for (const std::string name : {"a.png", "b.webp"}) write_file(dir + "/frames/" + name, "x");
  write_file(dir + "/items.jsonl",
             "{\"video\": \"v/a.mp4\", \"caption\": \"a cat\", \"image\": \"frames/a.png\"}\n"
             "{\"video\": \"v/b.mp4\", \"caption\": \"a dog\", \"image_path\": \"frames/b.webp\"}\n"
             "{\"video\": \"v/c.mp4\", \"caption\": \"a bird\", \"image\": null}\n"
             "{\"video\": \"v/d.mp4\", \"caption\": \"a fish\", \"image\": \"\"}\n"
             "{\"video\": \"v/e.mp4\", \"caption\": \"a frog\"}\n"
             "{\"video\": \"v/f.mp4\", \"caption\": \"a newt\", \"image\": 7}\n");
  const auto m = megaslide::read_video_manifest(config_for(dir + "/items.jsonl"), /*images=*/true);
  ASSERT_EQ(m.items.size(), 5u);
  EXPECT_EQ(m.items[0].image, dir + "/frames/a.png");
  EXPECT_EQ(m.items[1].image, dir + "/frames/b.webp");
  for (size_t k = 2; k < 5; ++k) EXPECT_EQ(m.items[k].image, "") << m.items[k].where;
  ASSERT_EQ(m.bad.size(), 1u);
  EXPECT_EQ(m.bad[0].index, 5);
  EXPECT_EQ(m.bad[0].path, dir + "/v/f.mp4");
  EXPECT_NE(m.bad[0].reason.find("\"image\" must be an image path (string), got number"), std::string::npos)
      << m.bad[0].reason;
  EXPECT_NE(m.bad[0].reason.find(dir + "/items.jsonl:6"), std::string::npos) << m.bad[0].reason;
  megaslide::io::remove_tree(dir);
}

// The property: in a folder, a same-stem .png, .jpg, .jpeg or .webp beside a video (the first found in
// that order) is its image; a video without one has none; an image is never an item itself.
TEST(VideoManifest, FolderSameStemImageIsTheClipsImage) {
  const std::string root = temp_folder("folder-images");
  megaslide::io::make_directories(root + "/sub");
  for (const std::string stem : {"a", "b", "c", "sub/d", "e", "f"}) {
    write_file(root + "/" + stem + ".mp4", "x");
    write_file(root + "/" + stem + ".txt", "a caption");
  }
  write_file(root + "/a.png", "x");
  write_file(root + "/b.webp", "x");  // .jpg comes first
  write_file(root + "/b.jpg", "x");
  write_file(root + "/sub/d.jpeg", "x");
  write_file(root + "/e.JPG", "x");  // a camera's upper-case extension
  write_file(root + "/f.Jpg", "x");  // and another spelling
  write_file(root + "/A.png", "x");  // another stem's image (and no video): neither a's image nor an item
  write_file(root + "/lonely.png", "x");
  const auto m = megaslide::read_video_manifest(config_for("", root), /*images=*/true);
  EXPECT_TRUE(m.bad.empty());
  std::vector<std::string> listed, images;
  for (const auto& item : m.items) listed.push_back(item.where), images.push_back(item.image);
  EXPECT_EQ(listed, (std::vector<std::string>{"a.mp4", "b.mp4", "c.mp4", "e.mp4", "f.mp4", "sub/d.mp4"}));
  EXPECT_EQ(images, (std::vector<std::string>{root + "/a.png", root + "/b.jpg", "", root + "/e.JPG", root + "/f.Jpg",
                                              root + "/sub/d.jpeg"}));
  megaslide::io::remove_tree(root);
}

// The property: a folder's images that are no video's own (no video of their stem beside them) are items, stills,
// only when a bucket has one frame (data.frames 1, or a [1, h, w] bucket), sorted among the videos and captioned
// as videos are, with no conditioning image of their own; without such a bucket they are counted, not listed. A
// video's same-stem image stays its conditioning image either way.
TEST(VideoManifest, FolderImagesAreStillsWhenABucketHasOneFrame) {
  const std::string root = temp_folder("folder-stills");
  megaslide::io::make_directories(root + "/sub");
  for (const std::string name :
       {"b.mp4", "b.txt", "b.png", "a.jpg", "a.txt", "sub/c.WEBP", "sub/c.WEBP.txt", "d.jpeg", "d.TXT", "e.png"})
    write_file(root + "/" + name, "x");
  auto data = config_for("", root);
  data.frames = 5;
  auto m = megaslide::read_video_manifest(data, /*images=*/true);
  std::vector<std::string> listed;
  for (const auto& item : m.items) listed.push_back(item.where);
  EXPECT_EQ(listed, (std::vector<std::string>{"b.mp4"}));
  EXPECT_EQ(m.items[0].image, root + "/b.png");
  EXPECT_TRUE(m.bad.empty());
  EXPECT_EQ(m.unlisted_images, 4);  // a.jpg, d.jpeg, e.png, sub/c.WEBP; b.png is b.mp4's

  for (const auto& buckets : {std::vector<std::array<int64_t, 3>>{}, {{5, 32, 32}, {1, 32, 48}}}) {
    data.buckets = buckets;
    data.frames = buckets.empty() ? 1 : 5;
    ASSERT_TRUE(megaslide::has_still_bucket(data));
    m = megaslide::read_video_manifest(data, /*images=*/true);
    listed.clear();
    for (const auto& item : m.items) listed.push_back(item.where);
    EXPECT_EQ(listed, (std::vector<std::string>{"a.jpg", "b.mp4", "d.jpeg", "sub/c.WEBP"}));
    EXPECT_EQ(m.items[0].image, "") << "a still has no conditioning image of its own";
    EXPECT_EQ(m.items[1].image, root + "/b.png");
    ASSERT_EQ(m.bad.size(), 1u);  // e.png has no caption
    EXPECT_EQ(m.bad[0].path, root + "/e.png");
    EXPECT_NE(m.bad[0].reason.find("missing caption"), std::string::npos) << m.bad[0].reason;
    EXPECT_EQ(m.unlisted_images, 0);
  }
  data.buckets = {{5, 32, 32}, {9, 32, 48}};
  EXPECT_FALSE(megaslide::has_still_bucket(data));
  megaslide::io::remove_tree(root);
}

// The property: a folder's video finds its caption as the same stem's .txt, a camera's upper-case .TXT, or the
// video's whole name + .txt (clip.mp4.txt), in that order; with none it is a bad item naming all three; a caption
// holding NUL bytes (UTF-16 without a byte-order mark) is a bad item saying so.
TEST(VideoManifest, FolderCaptionsByStemUpperCaseOrWholeName) {
  const std::string root = temp_folder("folder-captions");
  for (const std::string name : {"a.mp4", "b.MP4", "c.mov", "d.mp4", "e.mp4"}) write_file(root + "/" + name, "x");
  write_file(root + "/a.txt", "stem");
  write_file(root + "/a.mp4.txt", "whole name, not taken");
  write_file(root + "/b.TXT", "upper case");
  write_file(root + "/c.mov.txt", "whole name");
  write_file(root + "/d.TXT", "upper case, not taken");
  write_file(root + "/d.txt", "stem first");
  write_file(root + "/f.mp4", "x");
  write_file(root + "/f.txt", std::string("a\0 \0c\0a\0t\0", 10));  // UTF-16LE without a byte-order mark
  const auto m = megaslide::read_video_manifest(config_for("", root));
  std::vector<std::string> captions;
  for (const auto& item : m.items) captions.push_back(item.caption);
  EXPECT_EQ(captions, (std::vector<std::string>{"stem", "upper case", "whole name", "stem first"}));
  ASSERT_EQ(m.bad.size(), 2u);
  EXPECT_EQ(m.bad[0].path, root + "/e.mp4");
  EXPECT_NE(m.bad[0].reason.find("e.mp4.txt"), std::string::npos) << m.bad[0].reason;
  EXPECT_EQ(m.bad[1].path, root + "/f.mp4");
  EXPECT_NE(m.bad[1].reason.find("NUL byte"), std::string::npos) << m.bad[1].reason;
  megaslide::io::remove_tree(root);
}

// The property: an image the listing names that does not exist makes its clip a bad item (not a clip
// trained on a frame instead), and the reason names the image and the line that listed it; an image
// name that is not UTF-8 is a bad item too, like a video's.
TEST(VideoManifest, AMissingImageIsABadItemNamingIt) {
  const std::string dir = temp_folder("missing-images");
  write_file(dir + "/here.png", "x");
  write_file(dir + "/caf\xe9.png", "x");
  write_file(dir + "/items.csv",
             "path,text,image\na.mp4,a cat,here.png\nb.mp4,a dog,gone.png\nc.mp4,a bird,caf\xe9.png\n");
  const auto csv = megaslide::read_video_manifest(config_for(dir + "/items.csv"), /*images=*/true);
  ASSERT_EQ(csv.items.size(), 1u);
  ASSERT_EQ(csv.bad.size(), 2u);
  EXPECT_EQ(csv.bad[0].index, 1);
  EXPECT_EQ(csv.bad[0].path, dir + "/b.mp4");
  EXPECT_NE(csv.bad[0].reason.find(dir + "/gone.png"), std::string::npos) << csv.bad[0].reason;
  EXPECT_NE(csv.bad[0].reason.find("does not exist"), std::string::npos) << csv.bad[0].reason;
  EXPECT_NE(csv.bad[0].reason.find(dir + "/items.csv:3"), std::string::npos) << csv.bad[0].reason;
  EXPECT_EQ(csv.bad[1].index, 2);
  EXPECT_NE(csv.bad[1].reason.find("its image's file name is not UTF-8 text (byte 0xe9"), std::string::npos)
      << csv.bad[1].reason;
  EXPECT_EQ(csv.listed(), 3);
  // Without images (a text-to-video run) the column is ignored: no item is bad for its image, none has one.
  const auto text_only = megaslide::read_video_manifest(config_for(dir + "/items.csv"));
  EXPECT_EQ(text_only.items.size(), 3u);
  EXPECT_TRUE(text_only.bad.empty());
  for (const auto& item : text_only.items) EXPECT_TRUE(item.image.empty()) << item.path;

  write_file(dir + "/items.jsonl", "{\"video\": \"a.mp4\", \"caption\": \"a cat\", \"image\": \"sub/gone.png\"}\n");
  const auto jsonl = megaslide::read_video_manifest(config_for(dir + "/items.jsonl"), /*images=*/true);
  EXPECT_TRUE(jsonl.items.empty());
  ASSERT_EQ(jsonl.bad.size(), 1u);
  EXPECT_EQ(jsonl.bad[0].path, dir + "/a.mp4");
  EXPECT_NE(jsonl.bad[0].reason.find(dir + "/sub/gone.png"), std::string::npos) << jsonl.bad[0].reason;
  EXPECT_NE(jsonl.bad[0].reason.find(dir + "/items.jsonl:1"), std::string::npos) << jsonl.bad[0].reason;
  megaslide::io::remove_tree(dir);
}
