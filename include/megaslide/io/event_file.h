// TensorBoard event files: what `output.tensorboard: true` writes beside metrics.jsonl, for
// `tensorboard --logdir RUN_DIR/tensorboard`.
//
// A file is a sequence of TFRecords — a little-endian uint64 length, the masked CRC-32C of those 8
// bytes, the data, the masked CRC-32C of the data — each holding one serialised Event message: first
// the version event ("brain.Event:2"), then summaries: scalars (simple_value), images (PNG) and text
// (a string tensor with the "text" plugin's metadata), each with its step and wall time, and session
// STARTs. The messages are src/io/tensorboard_event.proto's (TensorFlow's field numbers) in the protobuf
// wire encoding, written by src/io/event_encoding.h (which says why no protobuf library is linked) and
// checked against Debian's protobuf library by tests/event_protobuf/test_event_protobuf.cpp.
//
// Each event (a step's scalars, an image, a text) is written with one write(): a reader sees whole
// records, and a crash loses at most the event being written. Errors (the folder or file cannot be
// written) are io::IoError naming the path.
//
// Thread-safety: one thread writes a file.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace megaslide::io {

// CRC-32C (Castagnoli, reflected 0x82F63B78), continued from `crc`; and TFRecord's mask of it.
uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);
inline uint32_t masked_crc32c(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

class EventFileWriter {
 public:
  // Creates `dir` (and parents) and DIR/events.out.tfevents.<seconds>.<host>.<pid>.megaslide, and writes
  // the version event. Throws IoError.
  explicit EventFileWriter(const std::string& dir);
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  const std::string& path() const;
  // One event of `values` (tag, value) at `step`; NaN and infinite values are written as they are.
  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values, double wall_time);
  // An image: `png` is a PNG file's bytes, `height` x `width` its size in pixels (RGB).
  void image(const std::string& tag, int64_t step, const std::string& png, int64_t height, int64_t width,
             double wall_time);
  // Text (Markdown, as TensorBoard's text plugin renders it).
  void text(const std::string& tag, int64_t step, const std::string& text, double wall_time);
  // A session START at `step`: a run resumed from an earlier step says so, and TensorBoard drops what
  // earlier files of the folder hold from that step on (its "orphaned" events of the abandoned run).
  void restart(int64_t step, double wall_time);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One event of a file, as read back: the version event (`file_version` set), or one summary value
// (kind "scalar", "image" or "text"; an event with several values gives several records), or a session
// START (kind "restart").
struct EventRecord {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::string kind, tag;
  double scalar = 0;              // kind scalar
  std::string data;               // kind image: the encoded image; kind text: the text
  int64_t height = 0, width = 0;  // kind image
};

// Every record of an event file, each record's length and data checked against their CRC-32C. Throws
// IoError naming the file and the byte offset of a bad record.
std::vector<EventRecord> read_event_file(const std::string& path);

}  // namespace megaslide::io
