// Video files through FFmpeg's libraries (libavformat, libavcodec, libswscale): H.264 MP4 writing,
// PNG frames, and reading a video back (for metrics, tests and datasets: probe_video, read_video_frames).
//
// Frames cross this API as uint8 RGB tensors [T, H, W, 3] (one frame: [H, W, 3]) on the CPU; the
// caller owns them. to_rgb_frames() turns a model's [C, T, H, W] output in [-1, 1] into that form.
// MP4s are H.264 (libx264) in yuv420p, BT.601 limited range (what players and OpenCV, which VBench
// reads with, assume), constant frame rate; width and height must be even (a 4:2:0 requirement).
// Files are written to `path.tmp`, then renamed over `path`, so a reader never sees a torn file.
// Errors throw VideoError naming the path and FFmpeg's reason.
//
// FFmpeg's log level is set to fatal messages only the first time this API is used (libx264 otherwise
// prints its statistics for every file, and each broken file of a dataset its own error lines: every
// failure reaches the caller as a VideoError instead). Thread-safety: calls on different files may run concurrently.
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

#include "megaslide/io/files.h"

namespace megaslide::io {

class VideoError : public IoError {
 public:
  using IoError::IoError;
};

// False when the library was built without FFmpeg (MEGASLIDE_VIDEO=OFF, or its libraries were absent
// at configure time); then write_mp4, write_png and read_video throw VideoError saying so.
bool video_supported();

struct VideoWriteOptions {
  TORCH_ARG(int64_t, fps) = 8;
  TORCH_ARG(int64_t, crf) = 17;  // libx264 constant rate factor: 0 best, 51 worst; 17 ≈ visually lossless
  TORCH_ARG(std::string, preset) = "medium";  // libx264 speed/size trade-off
  // A display matrix for the stream (what a phone writes for a video held upright): players show the
  // frames turned display_rotation_degrees clockwise, then mirrored left-right when display_hflip. The
  // frames are stored as given. 0 and false: no matrix is written.
  TORCH_ARG(double, display_rotation_degrees) = 0.0;
  TORCH_ARG(bool, display_hflip) = false;
};

// [C, T, H, W] float in [-1, 1] (C = 3: RGB; C = 1: grey) -> [T, H·upscale, W·upscale, 3] uint8, values
// round((x + 1)·127.5) clamped to [0, 255]; upscale repeats pixels (nearest neighbour).
torch::Tensor to_rgb_frames(const torch::Tensor& video, int64_t upscale = 1);

// An image [H, W, 3] uint8 as the first frame of videos of height x width: [3, height, width] float32 in
// [-1, 1]. An image of another aspect ratio (by more than 1%) is centre-cropped to the videos' first (as
// Wan2.2's own image-to-video preprocessing crops; diffusers' pipelines stretch instead), then resized with
// antialiased bilinear filtering (PIL's bilinear): non-negative weights, so the result stays in [-1, 1].
// `done` (optional) receives what was done, for a message ("" when the image was already that size).
torch::Tensor fit_image(const torch::Tensor& image, int64_t height, int64_t width, std::string* done = nullptr);

// frames [T, H, W, 3] uint8 RGB, T >= 1, H and W even.
void write_mp4(const std::string& path, const torch::Tensor& frames, const VideoWriteOptions& options = {});

// frame [H, W, 3] uint8 RGB -> an 8-bit RGB PNG.
void write_png(const std::string& path, const torch::Tensor& frame);
// The same PNG's bytes, in memory; errors name `what`.
std::string encode_png(const torch::Tensor& frame, const std::string& what);

struct VideoInfo {
  std::string codec;               // e.g. "h264"
  std::string pixel_format;        // e.g. "yuv420p"
  int64_t bits_per_component = 8;  // of the pixel format: 10 for yuv420p10le, 0 when unknown
  int64_t width = 0, height = 0;   // of the frames as read: displayed (upright), after the turn below
  // The stream's display matrix (phones: rotate=90), applied as the ffmpeg CLI's autorotate does: the
  // stored frames turned `rotation_degrees` clockwise (0, 90, 180 or 270), then mirrored left-right when
  // `hflip`. `display_angle_degrees` is the matrix's own clockwise angle; one that is not within half a
  // degree of a quarter turn is read at the nearest quarter turn (ffmpeg would rotate it by the exact
  // angle), with one warning per file on stderr. A still image (JPEG, PNG, WebP) without one is turned as its
  // EXIF orientation tag says, as PIL's ImageOps.exif_transpose shows it (2 mirrored; 5 and 7 turned 90 and 270,
  // then mirrored).
  int64_t rotation_degrees = 0;
  bool hflip = false;
  double display_angle_degrees = 0.0;
  int64_t stored_width = 0, stored_height = 0;  // the coded frame size, before the turn
  // The width of a stored pixel over its height, as the stream (or its container) states it: 1 for square pixels
  // and when it states none; 4/3 for HDV's 1440x1080 shown at 1920x1080. Frames are read at their stored size;
  // display_width x display_height is the size they are shown at (upright, the stored width times this ratio; a
  // ratio outside [1/4, 4], which no video has, is damaged data and ignored there).
  double sample_aspect_ratio = 1.0;
  int64_t display_width = 0, display_height = 0;
  int64_t frames = 0;            // frames decoded
  int64_t container_frames = 0;  // the stream's frame count as the container states it (0 if unknown)
  double fps = 0.0;              // the stream's average frame rate
};

// How decoded frames (YUV for H.264) become RGB.
//   kInterpolatedChroma  swscale with chroma interpolated to every pixel (bicubic) and accurate rounding
//              (SWS_BICUBIC | SWS_ACCURATE_RND | SWS_FULL_CHR_H_INT): unbiased (grey reads back within
//              0.01 levels on average), smooth colour; it blurs sharp colour edges. The stream's colour tags
//              choose the matrix (BT.709 for HD video, BT.2020; BT.601 when untagged, as FFmpeg does) and the
//              range (full range tagged on any pixel format, not only yuvj*; grey full unless tagged limited).
//   kOpenCV    exactly what OpenCV's FFmpeg backend does (cv2.VideoCapture.read, which VBench reads videos
//              with; its cap_ffmpeg_impl.hpp): swscale with SWS_BICUBIC and nothing else, the conversion set
//              up at the decoder's coded size (H.264: whole macroblocks), no sws_setColorspaceDetails, so
//              BT.601 with the range of the pixel format (yuvj420p full, yuv420p limited) whatever the
//              stream's colour tags say. For yuv420p that is swscale's unscaled YUV -> RGB path, which uses
//              each chroma sample for its 2×2 pixels without interpolating, and whose tables read about one
//              level dark. Metrics that stand for VBench's use this (eval/metrics.h); frames equal
//              opencv-python's on tests/fixtures/video/.
enum class RgbConversion { kInterpolatedChroma, kOpenCV };

struct VideoReadOptions {
  TORCH_ARG(RgbConversion, rgb_conversion) = RgbConversion::kInterpolatedChroma;
  // The most bytes of RGB frames a read may hold (what a file's frame size and count could otherwise
  // make it allocate: a 105 KB MP4 can declare 8192x4320 frames); 0: a quarter of the memory this
  // machine has available (MemAvailable) when the read starts. A read that would pass it throws
  // VideoError naming the frame size, the frames and the limit.
  TORCH_ARG(int64_t, max_bytes) = 0;
  // read_video_frames: frames far enough into a file are found by seeking to the key frame before them, not by
  // decoding every frame from the start (see there). False: always from the start.
  TORCH_ARG(bool, seek) = true;
};

// Every read returns frames upright: turned and mirrored as the stream's display matrix, or a still's EXIF
// orientation, says (VideoInfo).

// Decodes every frame: [T, H, W, 3] uint8 RGB. `info`, when given, receives the stream's description.
torch::Tensor read_video(const std::string& path, VideoInfo* info = nullptr, const VideoReadOptions& options = {});

// The stream's description without decoding it (the container's header and the first packets). `frames`
// is the container's frame count or, when it states none, duration × fps rounded, or when it states neither (a
// recording streamed to its file) the video stream's packets counted (estimates: the caller that needs exact
// counts decodes, below).
VideoInfo probe_video(const std::string& path);

// Decodes in presentation order up to the largest of `indices` (nothing after it) and returns those
// frames in the order of `indices` (repeats allowed): [N, H, W, 3] uint8 RGB. Frames are counted as the
// decoder outputs them (constant-rate streams: frame i is at i / fps). Data the demuxer or decoder finds
// invalid (a download cut short, damaged bytes) ends the stream there, after the frames before it. When the
// stream ends before the largest index, returns an undefined tensor; `frames_decoded` (when given) receives how many
// frames were decoded either way. Each call decodes on one thread.
//
// Seeking (options.seek; when the first index is at least 48): the file's packets up to just past the last index
// are read without decoding them, to learn every frame's presentation time and the key frames; decoding then
// starts at the last key frame at or before the first index and tells frames apart by their times, so a clip a minute
// into a long video costs one group of pictures, not a minute of decoding. It returns the frames decoding from the
// start would wherever each packet decodes to one picture. Where the packets cannot say which frame is which (no
// times, repeated times, a decoder that drops its first frames, damaged data in what is read, a file that does not
// seek to its key frame, a key frame that is no whole picture: intra refresh's recovery points), the read decodes
// from the start as without seeking. Two differences remain, in files that are damaged or unusual: a packet
// past the start that decodes to no picture without an error (an invisible frame stored on its own, bytes the
// decoder skips) shifts the count of a read from the start by one after it, not a seeking read's, which numbers
// frames by their presentation times; and damaged data before the key frame, which ends a read from the start
// there, is not read by a seeking one. After a seek, `frames_decoded` counts the frames decoded from the key frame.
torch::Tensor read_video_frames(const std::string& path, const std::vector<int64_t>& indices,
                                int64_t* frames_decoded = nullptr, const VideoReadOptions& options = {});

// The presentation times of the video stream's frames in presentation order, in seconds after the first frame's,
// read from the packets without decoding them (the times read_video_frames' seeking reads, frame i of the stream at
// element i): every frame up to frame `index`, every frame shown less than `seconds_after` after it, and the first
// frame after those (possibly a few more), or the whole stream when it ends first (so the last element is the
// stream's last frame exactly when it is shown less than `seconds_after` after frame `index`). The file is read up
// to just past those frames. Empty when the
// packets cannot say which frame is which (a packet without a presentation time, two frames at one time, data the
// demuxer finds invalid before they are read) or the stream has fewer than `index` + 1 frames.
std::vector<double> presentation_times(const std::string& path, int64_t index, double seconds_after);

}  // namespace megaslide::io
