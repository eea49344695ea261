#include "megaslide/io/video.h"

#ifdef MEGASLIDE_WITH_VIDEO
extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/display.h>
#include <libavutil/imgutils.h>
#include <libavutil/opt.h>
#include <libavutil/pixdesc.h>
#include <libswscale/swscale.h>
}
#endif

#include <fcntl.h>
#include <fmt/format.h>
#include <torch/nn/functional/upsampling.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <limits>
#include <queue>
#include <optional>
#include <set>

namespace megaslide::io {

torch::Tensor fit_image(const torch::Tensor& frame, int64_t height, int64_t width, std::string* done) {
  TORCH_CHECK(frame.dim() == 3 && frame.size(2) == 3 && frame.size(0) >= 1 && frame.size(1) >= 1,
              "fit_image: expected an image [H, W, 3], got ", frame.sizes());
  TORCH_CHECK(height >= 1 && width >= 1, "fit_image: a video of ", height, "x", width);
  auto image = frame.permute({2, 0, 1}).to(torch::kFloat32) / 127.5 - 1.0;
  const int64_t h = image.size(1), w = image.size(2);
  if (done != nullptr) done->clear();
  if (h == height && w == width) return image.contiguous();
  const double aspect = static_cast<double>(w) / static_cast<double>(h);
  const double video_aspect = static_cast<double>(width) / static_cast<double>(height);
  std::string cropped;
  if (std::abs(aspect / video_aspect - 1.0) > 0.01) {
    const bool wider = aspect > video_aspect;
    const int64_t crop_w = wider ? std::clamp<int64_t>(std::llround(static_cast<double>(h) * video_aspect), 1, w) : w;
    const int64_t crop_h = wider ? h : std::clamp<int64_t>(std::llround(static_cast<double>(w) / video_aspect), 1, h);
    image = image.narrow(1, (h - crop_h) / 2, crop_h).narrow(2, (w - crop_w) / 2, crop_w);
    cropped = fmt::format(", center-cropped to {}x{} first (the videos' aspect ratio)", crop_w, crop_h);
  }
  if (image.size(1) != height || image.size(2) != width) {
    namespace F = torch::nn::functional;
    image = F::interpolate(image.unsqueeze(0), F::InterpolateFuncOptions()
                                                   .size(std::vector<int64_t>{height, width})
                                                   .mode(torch::kBilinear)
                                                   .align_corners(false)
                                                   .antialias(true))[0];
  }
  if (done != nullptr)
    *done = fmt::format("resized from {}x{} to {}x{} (width x height){}", w, h, width, height, cropped);
  return image.contiguous();
}

torch::Tensor to_rgb_frames(const torch::Tensor& video, int64_t upscale) {
  TORCH_CHECK(video.dim() == 4 && (video.size(0) == 3 || video.size(0) == 1),
              "to_rgb_frames: expected [C, T, H, W] with C = 3 or 1, got ", video.sizes());
  TORCH_CHECK(upscale >= 1, "to_rgb_frames: upscale must be >= 1, got ", upscale);
  auto v = ((video.detach().to(torch::kCPU, torch::kFloat32) + 1.0) * 127.5).round().clamp(0, 255).to(torch::kUInt8);
  if (v.size(0) == 1) v = v.expand({3, v.size(1), v.size(2), v.size(3)});
  v = v.permute({1, 2, 3, 0});  // [T, H, W, 3]
  if (upscale > 1) v = v.repeat_interleave(upscale, 1).repeat_interleave(upscale, 2);
  return v.contiguous();
}

#ifdef MEGASLIDE_WITH_VIDEO

bool video_supported() { return true; }

namespace {

void quiet_ffmpeg() {
  static std::once_flag once;
  // Fatal messages only: every failure reaches the caller as a VideoError naming the file, and a dataset
  // with broken files would otherwise print FFmpeg's own lines for each ("moov atom not found").
  std::call_once(once, [] { av_log_set_level(AV_LOG_FATAL); });
}

std::string av_error(int code) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {0};
  av_strerror(code, buf, sizeof(buf));
  return buf;
}

// "image" for a file whose extension names a still image (a conditioning image, a still item), else "video".
const char* kind_of_file(const std::string& path) {
  const auto dot = path.find_last_of('.');
  if (dot == std::string::npos || path.find('/', dot) != std::string::npos) return "video";
  std::string ext = path.substr(dot + 1);
  for (auto& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* image : {"png", "jpg", "jpeg", "webp", "bmp", "gif", "tif", "tiff"})
    if (ext == image) return "image";
  return "video";
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw VideoError(std::string(kind_of_file(path)) + " '" + path + "': " + what);
}

void check(int code, const std::string& path, const std::string& what) {
  if (code < 0) fail(path, what + ": " + av_error(code));
}

struct CodecContextDeleter {
  void operator()(AVCodecContext* c) const { avcodec_free_context(&c); }
};
struct FrameDeleter {
  void operator()(AVFrame* f) const { av_frame_free(&f); }
};
struct PacketDeleter {
  void operator()(AVPacket* p) const { av_packet_free(&p); }
};
struct SwsDeleter {
  void operator()(SwsContext* s) const { sws_freeContext(s); }
};
struct OutputDeleter {
  void operator()(AVFormatContext* f) const {
    if (f->pb != nullptr && !(f->oformat->flags & AVFMT_NOFILE)) avio_closep(&f->pb);
    avformat_free_context(f);
  }
};
struct InputDeleter {
  void operator()(AVFormatContext* f) const { avformat_close_input(&f); }
};
using CodecContextPtr = std::unique_ptr<AVCodecContext, CodecContextDeleter>;
using FramePtr = std::unique_ptr<AVFrame, FrameDeleter>;
using PacketPtr = std::unique_ptr<AVPacket, PacketDeleter>;
using SwsPtr = std::unique_ptr<SwsContext, SwsDeleter>;

void check_rgb_frames(const torch::Tensor& frames, int64_t dims, const std::string& path) {
  if (frames.dim() != dims || frames.size(-1) != 3 || frames.scalar_type() != torch::kUInt8 ||
      !frames.device().is_cpu())
    fail(path, std::string("expected uint8 RGB CPU ") + (dims == 4 ? "frames [T, H, W, 3]" : "frame [H, W, 3]") +
                   ", got " + c10::toString(frames.scalar_type()) + " " + c10::str(frames.sizes()) + " on " +
                   frames.device().str());
}

// Copies an RGB24 tensor frame [H, W, 3] into `rgb` (an AVFrame with its own buffer and linesize).
void fill_rgb(AVFrame* rgb, const torch::Tensor& frame) {
  const int64_t H = frame.size(0), W = frame.size(1);
  const auto* src = frame.data_ptr<uint8_t>();
  for (int64_t y = 0; y < H; ++y)
    std::memcpy(rgb->data[0] + y * rgb->linesize[0], src + y * W * 3, static_cast<size_t>(W * 3));
}

void fsync_and_rename(const std::string& tmp, const std::string& path) {
  int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    fail(path, std::string("cannot rename from ") + tmp + ": " + std::strerror(errno));
}

}  // namespace

void write_mp4(const std::string& path, const torch::Tensor& frames_in, const VideoWriteOptions& options) {
  quiet_ffmpeg();
  check_rgb_frames(frames_in, 4, path);
  auto frames = frames_in.contiguous();
  const int64_t T = frames.size(0), H = frames.size(1), W = frames.size(2);
  if (T < 1) fail(path, "no frames to write");
  if (H % 2 != 0 || W % 2 != 0 || H < 2 || W < 2)
    fail(path,
         "frame size " + std::to_string(W) + "x" + std::to_string(H) + " (W x H) must be even for H.264 in yuv420p");
  if (options.fps() < 1) fail(path, "fps must be >= 1, got " + std::to_string(options.fps()));

  const AVCodec* codec = avcodec_find_encoder_by_name("libx264");
  if (codec == nullptr) codec = avcodec_find_encoder(AV_CODEC_ID_H264);
  if (codec == nullptr) fail(path, "this FFmpeg build has no H.264 encoder (Debian's libavcodec59 links libx264)");

  // The temporary file is created here (exclusively, a random name: never through a planted link), and
  // FFmpeg is given it as a file: URL, so that no protocol (tcp:, http:, pipe:) is ever parsed from a path.
  std::string tmp;
  try {
    check_replaceable_output(path);
    ::close(create_temporary_beside(path, tmp));
  } catch (const IoError& e) {
    fail(path, e.what());
  }
  struct RemoveUnlessRenamed {
    const std::string& file;
    bool renamed = false;
    ~RemoveUnlessRenamed() {
      if (!renamed) ::unlink(file.c_str());
      forget_temporary(file);
    }
  } cleanup{tmp};
  const std::string url = "file:" + tmp;
  AVFormatContext* raw_out = nullptr;
  check(avformat_alloc_output_context2(&raw_out, nullptr, "mp4", url.c_str()), path, "cannot set up the MP4 muxer");
  std::unique_ptr<AVFormatContext, OutputDeleter> out(raw_out);

  CodecContextPtr enc(avcodec_alloc_context3(codec));
  if (!enc) fail(path, "out of memory");
  enc->width = static_cast<int>(W);
  enc->height = static_cast<int>(H);
  enc->pix_fmt = AV_PIX_FMT_YUV420P;
  enc->time_base = AVRational{1, static_cast<int>(options.fps())};
  enc->framerate = AVRational{static_cast<int>(options.fps()), 1};
  enc->color_range = AVCOL_RANGE_MPEG;
  enc->colorspace = AVCOL_SPC_SMPTE170M;  // BT.601, the matrix swscale's RGB -> YUV conversion uses
  enc->color_primaries = AVCOL_PRI_SMPTE170M;
  enc->color_trc = AVCOL_TRC_SMPTE170M;
  if (out->oformat->flags & AVFMT_GLOBALHEADER) enc->flags |= AV_CODEC_FLAG_GLOBAL_HEADER;
  if (std::strcmp(codec->name, "libx264") == 0) {
    av_opt_set(enc->priv_data, "crf", std::to_string(options.crf()).c_str(), 0);
    av_opt_set(enc->priv_data, "preset", options.preset().c_str(), 0);
  }
  check(avcodec_open2(enc.get(), codec, nullptr), path, std::string("cannot open encoder ") + codec->name);

  AVStream* stream = avformat_new_stream(out.get(), nullptr);
  if (stream == nullptr) fail(path, "cannot add a video stream");
  stream->time_base = enc->time_base;
  stream->avg_frame_rate = enc->framerate;
  check(avcodec_parameters_from_context(stream->codecpar, enc.get()), path, "cannot copy encoder parameters");
  if (options.display_rotation_degrees() != 0.0 || options.display_hflip()) {
    if (!std::isfinite(options.display_rotation_degrees()))
      fail(path, "display rotation must be a finite angle, got " + std::to_string(options.display_rotation_degrees()));
    constexpr size_t kMatrixBytes = 9 * sizeof(int32_t);
#if LIBAVFORMAT_VERSION_INT >= AV_VERSION_INT(60, 15, 100)  // FFmpeg 6.1: stream side data moved into codecpar
    AVPacketSideData* sd =
        av_packet_side_data_new(&stream->codecpar->coded_side_data, &stream->codecpar->nb_coded_side_data,
                                AV_PKT_DATA_DISPLAYMATRIX, kMatrixBytes, 0);
    auto* matrix = sd != nullptr ? reinterpret_cast<int32_t*>(sd->data) : nullptr;
#else
    auto* matrix = reinterpret_cast<int32_t*>(av_stream_new_side_data(stream, AV_PKT_DATA_DISPLAYMATRIX, kMatrixBytes));
#endif
    if (matrix == nullptr) fail(path, "out of memory");
    // av_display_rotation_set's angle is clockwise; the flip negates the displayed x, after the turn.
    av_display_rotation_set(matrix, options.display_rotation_degrees());
    av_display_matrix_flip(matrix, options.display_hflip() ? 1 : 0, 0);
  }
  check(avio_open(&out->pb, url.c_str(), AVIO_FLAG_WRITE), tmp, "cannot create");
  check(avformat_write_header(out.get(), nullptr), path, "cannot write the MP4 header");

  SwsPtr sws(sws_getContext(static_cast<int>(W), static_cast<int>(H), AV_PIX_FMT_RGB24, static_cast<int>(W),
                            static_cast<int>(H), AV_PIX_FMT_YUV420P, SWS_BICUBIC | SWS_ACCURATE_RND, nullptr, nullptr,
                            nullptr));
  if (!sws) fail(path, "cannot set up the RGB -> YUV conversion");
  FramePtr rgb(av_frame_alloc()), yuv(av_frame_alloc());
  PacketPtr packet(av_packet_alloc());
  if (!rgb || !yuv || !packet) fail(path, "out of memory");
  rgb->format = AV_PIX_FMT_RGB24, rgb->width = static_cast<int>(W), rgb->height = static_cast<int>(H);
  yuv->format = AV_PIX_FMT_YUV420P, yuv->width = static_cast<int>(W), yuv->height = static_cast<int>(H);
  check(av_frame_get_buffer(rgb.get(), 0), path, "cannot allocate a frame");
  check(av_frame_get_buffer(yuv.get(), 0), path, "cannot allocate a frame");

  auto drain = [&] {
    while (true) {
      int r = avcodec_receive_packet(enc.get(), packet.get());
      if (r == AVERROR(EAGAIN) || r == AVERROR_EOF) return;
      check(r, path, "encoding failed");
      av_packet_rescale_ts(packet.get(), enc->time_base, stream->time_base);
      packet->stream_index = stream->index;
      check(av_interleaved_write_frame(out.get(), packet.get()), path, "cannot write a packet");
    }
  };
  for (int64_t t = 0; t < T; ++t) {
    fill_rgb(rgb.get(), frames[t]);
    check(av_frame_make_writable(yuv.get()), path, "cannot make a frame writable");
    sws_scale(sws.get(), rgb->data, rgb->linesize, 0, static_cast<int>(H), yuv->data, yuv->linesize);
    yuv->pts = t;
    check(avcodec_send_frame(enc.get(), yuv.get()), path, "encoding failed");
    drain();
  }
  check(avcodec_send_frame(enc.get(), nullptr), path, "flushing the encoder failed");
  drain();
  check(av_write_trailer(out.get()), path, "cannot finish the MP4");
  out.reset();  // closes the file
  fsync_and_rename(tmp, path);
  cleanup.renamed = true;
}

void write_png(const std::string& path, const torch::Tensor& frame) {
  write_file_atomically(path, encode_png(frame, path));
}

std::string encode_png(const torch::Tensor& frame_in, const std::string& path) {
  quiet_ffmpeg();
  check_rgb_frames(frame_in, 3, path);
  auto frame = frame_in.contiguous();
  const int64_t H = frame.size(0), W = frame.size(1);
  if (H < 1 || W < 1) fail(path, "empty frame");
  const AVCodec* codec = avcodec_find_encoder(AV_CODEC_ID_PNG);
  if (codec == nullptr) fail(path, "this FFmpeg build has no PNG encoder");
  CodecContextPtr enc(avcodec_alloc_context3(codec));
  if (!enc) fail(path, "out of memory");
  enc->width = static_cast<int>(W), enc->height = static_cast<int>(H);
  enc->pix_fmt = AV_PIX_FMT_RGB24;
  enc->time_base = AVRational{1, 1};
  check(avcodec_open2(enc.get(), codec, nullptr), path, "cannot open the PNG encoder");
  FramePtr rgb(av_frame_alloc());
  PacketPtr packet(av_packet_alloc());
  if (!rgb || !packet) fail(path, "out of memory");
  rgb->format = AV_PIX_FMT_RGB24, rgb->width = static_cast<int>(W), rgb->height = static_cast<int>(H);
  check(av_frame_get_buffer(rgb.get(), 0), path, "cannot allocate a frame");
  fill_rgb(rgb.get(), frame);
  rgb->pts = 0;
  check(avcodec_send_frame(enc.get(), rgb.get()), path, "PNG encoding failed");
  check(avcodec_send_frame(enc.get(), nullptr), path, "PNG encoding failed");
  std::string bytes;
  while (true) {
    int r = avcodec_receive_packet(enc.get(), packet.get());
    if (r == AVERROR(EAGAIN) || r == AVERROR_EOF) break;
    check(r, path, "PNG encoding failed");
    bytes.append(reinterpret_cast<const char*>(packet->data), static_cast<size_t>(packet->size));
    av_packet_unref(packet.get());
  }
  if (bytes.empty()) fail(path, "the PNG encoder produced nothing");
  return bytes;
}

namespace {

// How a stream's frames are shown: its stored frames turned `rotation` degrees clockwise (a quarter
// turn multiple), then mirrored left-right when `hflip`.
struct DisplayTransform {
  int rotation = 0;
  bool hflip = false;
  double angle = 0.0;    // the matrix's clockwise angle, degrees in (-180, 180]
  bool snapped = false;  // the angle was not a quarter turn: read at the nearest one
};

const int32_t* stream_display_matrix(const AVStream* stream) {
  constexpr size_t kMatrixBytes = 9 * sizeof(int32_t);
#if LIBAVFORMAT_VERSION_INT >= AV_VERSION_INT(60, 15, 100)  // FFmpeg 6.1: stream side data moved into codecpar
  const AVPacketSideData* sd = av_packet_side_data_get(stream->codecpar->coded_side_data,
                                                       stream->codecpar->nb_coded_side_data, AV_PKT_DATA_DISPLAYMATRIX);
  if (sd == nullptr || sd->size < kMatrixBytes) return nullptr;
  return reinterpret_cast<const int32_t*>(sd->data);
#else
  size_t size = 0;
  const uint8_t* data = av_stream_get_side_data(stream, AV_PKT_DATA_DISPLAYMATRIX, &size);
  if (data == nullptr || size < kMatrixBytes) return nullptr;
  return reinterpret_cast<const int32_t*>(data);
#endif
}

// The display matrix maps a stored pixel (x, y), y downwards, to the displayed (x', y') = (m0·x + m3·y,
// m1·x + m4·y) (FFmpeg's libavutil/display.h convention; the ffmpeg CLI's autorotate applies exactly this
// map for quarter turns). A turn by φ clockwise is m0 = m4 = cos φ, m1 = −m3 = sin φ; a left-right mirror
// after it negates m0 and m3, so in both cases φ = atan2(m1, m4) and the determinant's sign tells the
// mirror. Scale factors (a matrix may carry them) change neither.
DisplayTransform display_transform(const int32_t* m) {
  DisplayTransform t;
  if (m == nullptr) return t;
  const double a = m[0], b = m[1], c = m[3], d = m[4];
  const double det = a * d - b * c;
  if (det == 0.0 || !std::isfinite(det)) return t;  // degenerate: shown as stored, as the CLI does
  t.angle = std::atan2(b, d) * 180.0 / M_PI;
  t.hflip = det < 0;
  const double quarters = std::round(t.angle / 90.0);
  // The CLI rounds the angle to whole degrees and turns by a quarter only when that is exact; any other
  // angle it rotates arbitrarily (corners cut, black fill), which a training clip is better without.
  t.snapped = std::abs(t.angle - 90.0 * quarters) >= 0.5;
  t.rotation = static_cast<int>(((static_cast<int64_t>(quarters) % 4) + 4) % 4) * 90;
  return t;
}

// The orientation tag (0x0112) of EXIF data (a TIFF header and its first directory), 1-8; 0 when there is none.
// Its first value, SHORT or LONG (writers differ; PIL reads both).
int tiff_orientation(const std::string& tiff) {
  if (tiff.size() < 8) return 0;
  const bool little = tiff.compare(0, 2, "II") == 0;
  if (!little && tiff.compare(0, 2, "MM") != 0) return 0;
  const auto u16 = [&](uint64_t at) -> uint32_t {
    if (at + 2 > tiff.size()) return 0;
    const auto b = [&](uint64_t i) { return static_cast<uint32_t>(static_cast<unsigned char>(tiff[at + i])); };
    return little ? b(0) | b(1) << 8 : b(0) << 8 | b(1);
  };
  const auto u32 = [&](uint64_t at) -> uint64_t {
    return little ? u16(at) | static_cast<uint64_t>(u16(at + 2)) << 16
                  : static_cast<uint64_t>(u16(at)) << 16 | u16(at + 2);
  };
  if (u16(2) != 42) return 0;
  const uint64_t ifd = u32(4);
  if (ifd + 2 > tiff.size()) return 0;
  const uint64_t entries = u16(ifd);
  for (uint64_t e = 0; e < entries && ifd + 2 + 12 * (e + 1) <= tiff.size(); ++e) {
    const uint64_t at = ifd + 2 + 12 * e;
    if (u16(at) != 0x0112) continue;
    const uint32_t type = u16(at + 2);
    const uint64_t count = u32(at + 4), size = type == 3 ? 2 : type == 4 ? 4 : 0;
    if (size == 0 || count < 1) return 0;
    const uint64_t value_at = size * count <= 4 ? at + 8 : u32(at + 8);  // inline, or at an offset
    if (value_at + size > tiff.size()) return 0;
    const uint64_t value = size == 2 ? u16(value_at) : u32(value_at);
    return value >= 1 && value <= 8 ? static_cast<int>(value) : 0;
  }
  return 0;
}

// The orientation an XMP packet states (tiff:Orientation="6" or <tiff:Orientation>6<), 1-8, or 0: what PIL
// falls back on when there is no EXIF orientation.
int xmp_orientation(const std::string& xmp) {
  const std::string key = "tiff:Orientation";
  for (size_t at = xmp.find(key); at != std::string::npos; at = xmp.find(key, at + 1)) {
    size_t v = at + key.size();
    if (xmp.compare(v, 2, "=\"") == 0) v += 2;
    else if (xmp.compare(v, 1, ">") == 0) v += 1;
    else continue;
    if (v < xmp.size() && xmp[v] >= '1' && xmp[v] <= '8') return xmp[v] - '0';
    return 0;
  }
  return 0;
}

// EXIF data as JPEG's APP1 and WebP's chunk hold it ("Exif\0\0" then TIFF), or as PNG's eXIf does (TIFF, though
// some writers keep the prefix, even twice).
int exif_payload_orientation(std::string exif) {
  const std::string prefix("Exif\0\0", 6);
  for (int k = 0; k < 2 && exif.compare(0, 6, prefix) == 0; ++k) exif = exif.substr(6);
  return tiff_orientation(exif);
}

// The orientation a still image's file states, 1-8, or 0: its EXIF (a JPEG's APP1 segment, a PNG's eXIf chunk, a
// WebP's EXIF chunk), else its XMP packet (APP1, PNG's iTXt XML:com.adobe.xmp, WebP's XMP chunk) — phones store a
// photo as the sensor read it and say in this tag how to turn it. Segments and chunks are walked by their lengths;
// nothing is decoded. (ImageMagick's older zTXt "Raw profile type exif" is compressed and not read.)
int exif_orientation(const std::string& path) {
  int fd = -1;
  try {
    fd = open_input_file(path);  // the one checked open (a regular file, no FIFO waited on)
  } catch (const IoError&) {
    return 0;
  }
  const struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  const auto read = [fd](uint64_t at, size_t n) {
    std::string out(n, '\0');
    const ssize_t got = ::pread(fd, out.data(), n, static_cast<off_t>(at));
    out.resize(got > 0 ? static_cast<size_t>(got) : 0);
    return out;
  };
  const auto be = [](const std::string& b, size_t at, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v = v << 8 | static_cast<unsigned char>(b[at + static_cast<size_t>(i)]);
    return v;
  };
  const auto le32 = [](const std::string& b, size_t at) {
    uint64_t v = 0;
    for (int i = 3; i >= 0; --i) v = v << 8 | static_cast<unsigned char>(b[at + static_cast<size_t>(i)]);
    return v;
  };
  constexpr uint64_t kMaxExif = 1 << 20;
  int exif = 0, xmp = 0;  // the first of each found
  const auto found = [&] { return exif != 0 ? exif : xmp; };
  const std::string head = read(0, 16);
  if (head.size() >= 4 && head.compare(0, 2, "\xff\xd8") == 0) {  // JPEG: segments up to the image data
    const std::string xmp_id("http://ns.adobe.com/xap/1.0/\0", 29);
    uint64_t at = 2;
    for (int segments = 0; segments < 65536 && exif == 0; ++segments) {
      std::string marker = read(at, 2);
      if (marker.size() < 2 || static_cast<unsigned char>(marker[0]) != 0xff) break;
      if (static_cast<unsigned char>(marker[1]) == 0xff) {  // fill bytes before a marker
        ++at;
        continue;
      }
      const auto type = static_cast<unsigned char>(marker[1]);
      if (type == 0xda || type == 0xd9) break;  // start of scan, end of image
      const std::string length_bytes = read(at + 2, 2);
      if (length_bytes.size() < 2) break;
      const uint64_t length = be(length_bytes, 0, 2);
      if (length < 2) break;
      if (type == 0xe1 && length >= 8 && length - 2 <= kMaxExif) {
        const std::string body = read(at + 4, length - 2);
        if (body.compare(0, 6, std::string("Exif\0\0", 6)) == 0) exif = exif_payload_orientation(body);
        else if (xmp == 0 && body.compare(0, xmp_id.size(), xmp_id) == 0) xmp = xmp_orientation(body);
      }
      at += 2 + length;
    }
    return found();
  }
  if (head.size() >= 16 && head.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0) {  // PNG: chunks up to IEND
    uint64_t at = 8;
    for (int chunks = 0; chunks < 100000 && exif == 0; ++chunks) {
      const std::string header = read(at, 8);
      if (header.size() < 8) break;
      const uint64_t length = be(header, 0, 4);
      const std::string type = header.substr(4, 4);
      if (type == "IEND") break;
      if (type == "eXIf" && length <= kMaxExif) exif = exif_payload_orientation(read(at + 8, length));
      if (type == "iTXt" && xmp == 0 && length <= kMaxExif) {
        // keyword \0 compression-flag compression-method language \0 translated \0 text
        const std::string body = read(at + 8, length);
        const std::string keyword("XML:com.adobe.xmp\0", 18);
        if (body.compare(0, keyword.size(), keyword) == 0 && body.size() > keyword.size() &&
            body[keyword.size()] == '\0')  // uncompressed
          xmp = xmp_orientation(body);
      }
      at += 12 + length;
    }
    return found();
  }
  if (head.size() >= 12 && head.compare(0, 4, "RIFF") == 0 && head.compare(8, 4, "WEBP") == 0) {  // RIFF chunks
    const uint64_t end = 8 + le32(head, 4);
    for (uint64_t at = 12; at + 8 <= end && exif == 0;) {
      const std::string header = read(at, 8);
      if (header.size() < 8) break;
      const uint64_t length = le32(header, 4);
      if (header.compare(0, 4, "EXIF") == 0 && length <= kMaxExif)
        exif = exif_payload_orientation(read(at + 8, length));
      if (header.compare(0, 4, "XMP ") == 0 && xmp == 0 && length <= kMaxExif)
        xmp = xmp_orientation(read(at + 8, length));
      at += 8 + length + (length & 1);
    }
    return found();
  }
  return 0;
}

// A still image's EXIF orientation as a display transform: 2 mirrors, 3 turns 180 degrees, 4 flips upside down, 5
// transposes, 6 turns 90 degrees clockwise, 7 transposes across the other diagonal, 8 turns 270 (as PIL's
// ImageOps.exif_transpose and the ffmpeg CLI show them).
DisplayTransform exif_transform(int orientation) {
  DisplayTransform t;
  static constexpr int kRotation[9] = {0, 0, 0, 180, 180, 90, 90, 270, 270};
  static constexpr bool kFlip[9] = {false, false, true, false, true, true, false, true, false};
  if (orientation < 1 || orientation > 8) return t;
  t.rotation = kRotation[orientation], t.hflip = kFlip[orientation];
  t.angle = t.rotation > 180 ? t.rotation - 360 : t.rotation;
  return t;
}

void warn_snapped_once(const std::string& path, const DisplayTransform& t) {
  static std::mutex mutex;
  static std::set<std::string> warned;
  std::lock_guard<std::mutex> lock(mutex);
  if (!warned.insert(path).second) return;
  std::fprintf(
      stderr,
      "megaslide: warning: video '%s': its display matrix turns it %.1f degrees, not a quarter turn; read turned %d\n",
      path.c_str(), t.angle, t.rotation);
}

// [H, W, 3] stored -> as displayed.
torch::Tensor apply_display_transform(torch::Tensor frame, const DisplayTransform& t) {
  if (t.rotation == 90) frame = frame.transpose(0, 1).flip({1});  // out[i][j] = in[H-1-j][i]
  else if (t.rotation == 180) frame = frame.flip({0, 1});
  else if (t.rotation == 270) frame = frame.transpose(0, 1).flip({0});  // out[i][j] = in[j][W-1-i]
  if (t.hflip) frame = frame.flip({1});
  return t.rotation == 0 && !t.hflip ? frame : frame.contiguous();
}

struct OpenedVideo {
  std::unique_ptr<AVFormatContext, InputDeleter> in;
  CodecContextPtr dec;
  int index = -1;
  AVStream* stream = nullptr;
  int width = 0, height = 0;              // stored (coded) frame size
  int shown_width = 0, shown_height = 0;  // after the display transform
  DisplayTransform display;
};

// A decoder of the stream, fresh (replacing any the video had).
void open_decoder(const std::string& path, OpenedVideo& v) {
  const AVCodec* codec = avcodec_find_decoder(v.stream->codecpar->codec_id);
  if (codec == nullptr) fail(path, "no decoder for its video stream");
  v.dec.reset(avcodec_alloc_context3(codec));
  if (!v.dec) fail(path, "out of memory");
  check(avcodec_parameters_to_context(v.dec.get(), v.stream->codecpar), path, "bad codec parameters");
  v.dec->thread_count = 1;  // one thread per file: loaders decode several files at once (data/loader.h)
  check(avcodec_open2(v.dec.get(), codec, nullptr), path, std::string("cannot open decoder ") + codec->name);
}

OpenedVideo open_video(const std::string& path) {
  quiet_ffmpeg();
  OpenedVideo v;
  // A regular file only (a FIFO would hang FFmpeg's open), handed over as a file: URL (no protocol is
  // ever parsed from a path).
  try {
    check_input_file(path);
  } catch (const IoError& e) {
    fail(path, e.what());
  }
  AVFormatContext* raw_in = nullptr;
  const int opened = avformat_open_input(&raw_in, ("file:" + path).c_str(), nullptr, nullptr);
  // An MP4 or MOV whose index (the moov box, written last unless fast-started) is missing reads as invalid data.
  std::string ext = path.substr(std::min(path.find_last_of('.'), path.size()));
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (opened == AVERROR_INVALIDDATA && (ext == ".mp4" || ext == ".mov" || ext == ".m4v"))
    fail(path, "cannot open: " + av_error(opened) +
                   " (an MP4 without its index, the moov box: a download or recording cut short?)");
  check(opened, path, "cannot open");
  v.in.reset(raw_in);
  check(avformat_find_stream_info(v.in.get(), nullptr), path, "cannot read stream information");
  const AVCodec* codec = nullptr;
  v.index = av_find_best_stream(v.in.get(), AVMEDIA_TYPE_VIDEO, -1, -1, &codec, 0);
  check(v.index, path, "no video stream");
  if (codec == nullptr) fail(path, "no decoder for its video stream");
  v.stream = v.in->streams[v.index];
  open_decoder(path, v);
  v.width = v.stream->codecpar->width, v.height = v.stream->codecpar->height;
  if (v.width <= 0 || v.height <= 0) fail(path, "video stream has no frame size");
  const int32_t* matrix = stream_display_matrix(v.stream);
  // A still image (JPEG, PNG, WebP, read by FFmpeg's image demuxers) states its orientation in EXIF, which the
  // demuxer leaves out of the stream's side data.
  const std::string demuxer = v.in->iformat->name;
  const bool still = demuxer == "image2" || demuxer.find("_pipe") != std::string::npos;
  v.display = matrix == nullptr && still ? exif_transform(exif_orientation(path)) : display_transform(matrix);
  if (v.display.snapped) warn_snapped_once(path, v.display);
  const bool sideways = v.display.rotation == 90 || v.display.rotation == 270;
  v.shown_width = sideways ? v.height : v.width, v.shown_height = sideways ? v.width : v.height;
  return v;
}

void describe_stream(const OpenedVideo& v, VideoInfo& info) {
  info.codec = avcodec_get_name(v.stream->codecpar->codec_id);
  const char* pf = av_get_pix_fmt_name(static_cast<AVPixelFormat>(v.stream->codecpar->format));
  info.pixel_format = pf != nullptr ? pf : "unknown";
  const AVPixFmtDescriptor* desc = av_pix_fmt_desc_get(static_cast<AVPixelFormat>(v.stream->codecpar->format));
  info.bits_per_component = desc != nullptr ? desc->comp[0].depth : 0;
  info.width = v.shown_width, info.height = v.shown_height;
  info.stored_width = v.width, info.stored_height = v.height;
  const AVRational sar = av_guess_sample_aspect_ratio(v.in.get(), v.stream, nullptr);
  info.sample_aspect_ratio = sar.num > 0 && sar.den > 0 ? av_q2d(sar) : 1.0;
  // The stored width stretched by the ratio, then turned as the display matrix says. A ratio beyond 4 either way is
  // no video's (damaged or garbage header data, which would make a clip of a 1920-wide frame 490 000 wide): ignored.
  const double ratio =
      info.sample_aspect_ratio >= 0.25 && info.sample_aspect_ratio <= 4.0 ? info.sample_aspect_ratio : 1.0;
  const int64_t stretched = std::max<int64_t>(1, std::llround(static_cast<double>(v.width) * ratio));
  const bool sideways = v.display.rotation == 90 || v.display.rotation == 270;
  info.display_width = sideways ? v.height : stretched;
  info.display_height = sideways ? stretched : v.height;
  info.rotation_degrees = v.display.rotation, info.hflip = v.display.hflip,
  info.display_angle_degrees = v.display.angle;
  info.container_frames = v.stream->nb_frames;
  info.fps = v.stream->avg_frame_rate.den != 0 ? av_q2d(v.stream->avg_frame_rate) : 0.0;
  if (info.fps <= 0 && v.stream->r_frame_rate.den != 0) info.fps = av_q2d(v.stream->r_frame_rate);
}

// swscale's YUV -> RGB matrix for a frame's tagged colour space (FFmpeg's own choice for untagged frames: BT.601).
int sws_colorspace(AVColorSpace space) {
  switch (space) {
    case AVCOL_SPC_BT709:
      return SWS_CS_ITU709;
    case AVCOL_SPC_FCC:
      return SWS_CS_FCC;
    case AVCOL_SPC_SMPTE240M:
      return SWS_CS_SMPTE240M;
    case AVCOL_SPC_BT2020_NCL:
    case AVCOL_SPC_BT2020_CL:
      return SWS_CS_BT2020;
    default:  // BT.601 (BT470BG, SMPTE170M) and unspecified
      return SWS_CS_ITU601;
  }
}

// The conversion of YUV (and grey) frames follows the frame's tags: its matrix (BT.709 for HD video, BT.2020)
// and its range (full range tagged on a pixel format without a "j", as VP9 and 10-bit video carry it). RGB
// frames need neither.
void follow_colour_tags(SwsContext* sws, const AVFrame& frame) {
  const AVPixFmtDescriptor* desc = av_pix_fmt_desc_get(static_cast<AVPixelFormat>(frame.format));
  if (desc == nullptr || (desc->flags & AV_PIX_FMT_FLAG_RGB) != 0) return;
  const bool j_format = frame.format == AV_PIX_FMT_YUVJ420P || frame.format == AV_PIX_FMT_YUVJ422P ||
                        frame.format == AV_PIX_FMT_YUVJ444P || frame.format == AV_PIX_FMT_YUVJ440P ||
                        frame.format == AV_PIX_FMT_YUVJ411P;
  // Grey (and grey with alpha) is full range unless tagged otherwise, as swscale takes it untagged.
  const bool grey = desc->nb_components <= 2;
  const int full_range =
      (grey ? frame.color_range != AVCOL_RANGE_MPEG : frame.color_range == AVCOL_RANGE_JPEG || j_format) ? 1 : 0;
  const int* coefficients = sws_getCoefficients(sws_colorspace(frame.colorspace));
  sws_setColorspaceDetails(sws, coefficients, full_range, sws_getCoefficients(SWS_CS_DEFAULT), 1, 0, 1 << 16, 1 << 16);
}

// A decoded frame as upright RGB [H, W, 3] uint8 (the conversion is set up at the first frame).
class RgbConverter {
 public:
  RgbConverter(const std::string& path, const OpenedVideo& v, const VideoReadOptions& options)
      : path_(path), v_(v), options_(options), rgb_(av_frame_alloc()) {
    if (!rgb_) fail(path, "out of memory");
  }

  torch::Tensor operator()(const AVFrame& frame) {
    const int W = v_.width, H = v_.height;
    if (!sws_) {
      // kInterpolatedChroma: SWS_FULL_CHR_H_INT, without which swscale's YUV -> RGB path reads back grey
      // 1.7 levels dark on average (measured on a ramp: bias −1.73 vs +0.007 with it).
      // kOpenCV: OpenCV's call as it is (video.h), at the coded size as OpenCV sizes it: with yuv420p the
      // height decides whether swscale takes its unscaled path.
      const AVCodecContext* dec = v_.dec.get();
      int cw = W, ch = H, flags = SWS_BICUBIC | SWS_ACCURATE_RND | SWS_FULL_CHR_H_INT;
      if (options_.rgb_conversion() == RgbConversion::kOpenCV) {
        flags = SWS_BICUBIC;
        if (dec->coded_width >= W && dec->coded_height >= H) cw = dec->coded_width, ch = dec->coded_height;
      }
      sws_.reset(sws_getContext(cw, ch, static_cast<AVPixelFormat>(frame.format), cw, ch, AV_PIX_FMT_RGB24, flags,
                                nullptr, nullptr, nullptr));
      if (!sws_) fail(path_, "cannot set up the YUV -> RGB conversion");
      // (OpenCV's call ignores the tags: BT.601's matrix, the range by the pixel format.)
      if (options_.rgb_conversion() != RgbConversion::kOpenCV) follow_colour_tags(sws_.get(), frame);
      rgb_->format = AV_PIX_FMT_RGB24, rgb_->width = cw, rgb_->height = ch;
      check(av_frame_get_buffer(rgb_.get(), 0), path_, "cannot allocate a frame");
    }
    sws_scale(sws_.get(), frame.data, frame.linesize, 0, H, rgb_->data, rgb_->linesize);
    auto t = torch::empty({H, W, 3}, torch::kUInt8);
    for (int y = 0; y < H; ++y)
      std::memcpy(t.data_ptr<uint8_t>() + static_cast<int64_t>(y) * W * 3, rgb_->data[0] + y * rgb_->linesize[0],
                  static_cast<size_t>(W) * 3);
    return apply_display_transform(std::move(t), v_.display);
  }

 private:
  const std::string& path_;
  const OpenedVideo& v_;
  const VideoReadOptions& options_;
  FramePtr rgb_;
  SwsPtr sws_;
};

// What decode_frames is told of each frame it decodes: its index in the stream (presentation order, from 0),
// or kGiveUp to stop decoding there (the seeking read's frame that is not where the packets said).
constexpr int64_t kGiveUp = -1;

struct Decoded {
  int64_t frames = 0;    // frames the decoder gave
  bool gave_up = false;  // `number` or `first_packet` said kGiveUp / false
};

// Decodes frames in presentation order from where the file is read; `keep(index)` says whether frame `index` is
// converted to RGB and handed to `take`. Frames are numbered by `number(frame, decoded so far)` (empty: counted
// from 0). Stops after frame `last` (−1: the whole stream). `first_packet` (when given) checks the first packet of
// the video stream read. `damage_ends_stream`: data the demuxer or decoder finds invalid (a download cut short,
// damaged bytes) ends the stream there, as its end would, after the frames decoded before it; otherwise it is an
// error.
Decoded decode_frames(const std::string& path, OpenedVideo& v, const VideoReadOptions& options, int64_t last,
                      const std::function<bool(int64_t)>& keep, const std::function<void(int64_t, torch::Tensor)>& take,
                      bool damage_ends_stream = false,
                      const std::function<int64_t(const AVFrame&, int64_t)>& number = nullptr,
                      const std::function<bool(const AVPacket&)>& first_packet = nullptr) {
  AVCodecContext* dec = v.dec.get();
  FramePtr frame(av_frame_alloc());
  PacketPtr packet(av_packet_alloc());
  if (!frame || !packet) fail(path, "out of memory");
  RgbConverter to_rgb(path, v, options);
  Decoded result;
  bool done = false, damaged = false, first = true;
  const auto damage = [&](int r) { return damage_ends_stream && r == AVERROR_INVALIDDATA; };
  auto receive = [&] {
    while (!done) {
      int r = avcodec_receive_frame(dec, frame.get());
      if (r == AVERROR(EAGAIN) || r == AVERROR_EOF) return;
      if (damage(r)) {
        damaged = done = true;
        return;
      }
      check(r, path, "decoding failed");
      if (frame->width != v.width || frame->height != v.height) fail(path, "frame size changes mid-stream");
      const int64_t index = number ? number(*frame, result.frames) : result.frames;
      ++result.frames;
      if (index == kGiveUp) {
        result.gave_up = done = true;
        av_frame_unref(frame.get());
        return;
      }
      if (keep(index)) take(index, to_rgb(*frame));
      av_frame_unref(frame.get());
      if (last >= 0 && index >= last) done = true;
    }
  };
  while (!done) {
    int r = av_read_frame(v.in.get(), packet.get());
    if (r == AVERROR_EOF || damage(r)) break;
    check(r, path, "cannot read a packet");
    if (packet->stream_index == v.index) {
      if (first && first_packet && !first_packet(*packet)) {
        av_packet_unref(packet.get());
        result.gave_up = true;
        return result;
      }
      first = false;
      r = avcodec_send_packet(dec, packet.get());
      if (damage(r)) {
        av_packet_unref(packet.get());
        break;  // the frames the decoder holds from before it are still flushed out below
      }
      check(r, path, "decoding failed");
      receive();
    }
    av_packet_unref(packet.get());
  }
  if (!done && !damaged) {
    check(avcodec_send_packet(dec, nullptr), path, "flushing the decoder failed");
    receive();
  }
  return result;
}

}  // namespace

namespace {
// MemAvailable of /proc/meminfo in bytes (0 when it cannot be read).
int64_t available_memory_bytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "re");
  if (f == nullptr) return 0;
  char line[256];
  long long kib = 0;
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::sscanf(line, "MemAvailable: %lld kB", &kib) == 1) break;
  std::fclose(f);
  return static_cast<int64_t>(kib) * 1024;
}

// Refuses a read that would hold `frames` RGB frames of the video's size beyond the options' limit.
void check_frame_budget(const std::string& path, const OpenedVideo& v, int64_t frames,
                        const VideoReadOptions& options) {
  const int64_t limit = options.max_bytes() > 0 ? options.max_bytes() : available_memory_bytes() / 4;
  const int64_t frame_bytes = int64_t{v.width} * v.height * 3;
  if (limit <= 0 || frames * frame_bytes <= limit) return;
  fail(path,
       fmt::format(
           "{} frames of {}x{} (W x H) would take {:.1f} GB as RGB, more than the {:.1f} GB a read may hold ({}): "
           "is it the right file?",
           frames, v.width, v.height, static_cast<double>(frames * frame_bytes) / 1e9, static_cast<double>(limit) / 1e9,
           options.max_bytes() > 0 ? "VideoReadOptions::max_bytes" : "a quarter of this machine's available memory"));
}
}  // namespace

torch::Tensor read_video(const std::string& path, VideoInfo* info, const VideoReadOptions& options) {
  auto v = open_video(path);
  std::vector<torch::Tensor> frames;
  check_frame_budget(path, v, 1, options);
  // Every frame is kept, then stacked (twice the frames at the end): checked as they come, not from the
  // container's frame count, which a file may state falsely.
  decode_frames(
      path, v, options, -1, [](int64_t) { return true; },
      [&](int64_t, torch::Tensor t) {
        check_frame_budget(path, v, 2 * static_cast<int64_t>(frames.size() + 1), options);
        frames.push_back(std::move(t));
      });
  if (frames.empty()) fail(path, "no frames decoded");
  if (info != nullptr) {
    describe_stream(v, *info);
    info->frames = static_cast<int64_t>(frames.size());
  }
  return torch::stack(frames);
}

namespace {
// The container's frame count or, when it states none, its duration × fps rounded; 0 when it states neither.
int64_t stated_frames(const OpenedVideo& v, const VideoInfo& info) {
  if (info.container_frames > 0 || info.fps <= 0) return std::max<int64_t>(info.container_frames, 0);
  double seconds = 0.0;
  if (v.stream->duration != AV_NOPTS_VALUE && v.stream->duration > 0)
    seconds = static_cast<double>(v.stream->duration) * av_q2d(v.stream->time_base);
  else if (v.in->duration != AV_NOPTS_VALUE && v.in->duration > 0)
    seconds = static_cast<double>(v.in->duration) / AV_TIME_BASE;
  return static_cast<int64_t>(std::llround(seconds * info.fps));
}
}  // namespace

VideoInfo probe_video(const std::string& path) {
  auto v = open_video(path);
  VideoInfo info;
  describe_stream(v, info);
  info.frames = stated_frames(v, info);
  if (info.frames <= 0) {
    // Neither a count nor a duration (a recording streamed to its file: a browser's WebM, a pipe's MKV): the
    // video stream's packets, counted without decoding them, one frame each.
    PacketPtr packet(av_packet_alloc());
    if (!packet) fail(path, "out of memory");
    int64_t packets = 0;
    while (av_read_frame(v.in.get(), packet.get()) >= 0) {
      packets += packet->stream_index == v.index ? 1 : 0;
      av_packet_unref(packet.get());
    }
    info.frames = packets;
  }
  return info;
}

namespace {

// The video stream's frames as its packets list them, read without decoding them (demuxing costs a small fraction
// of decoding): the presentation time of every frame the decoder shows, sorted, so that frame i of the stream is the
// one at pts[i]; the key packets (the points decoding can start from); and the stream's first packet.
struct FrameTimes {
  struct Packet {
    int64_t pts = 0, dts = 0;  // dts: pts when the packet has none
    int64_t pos = -1;          // byte position in the file; -1 when the demuxer does not say
  };
  std::vector<int64_t> pts;
  std::vector<Packet> keys;
  std::optional<Packet> first;
};

FrameTimes::Packet times_of(const AVPacket& packet) {
  return {packet.pts, packet.dts == AV_NOPTS_VALUE ? packet.pts : packet.dts, packet.pos};
}

// Whether a packet read after a seek is `expected`: the same presentation time and, where the demuxer gives them,
// the same byte position (times alone may repeat: MPEG-TS files joined end to end restart them); without positions,
// the same decode time too. (Decode times are not compared with positions: a demuxer that works them out from
// the packets before, as Matroska's does, gives the first packet after a seek another.)
bool same_packet(const AVPacket& packet, const FrameTimes::Packet& expected) {
  const auto t = times_of(packet);
  if (t.pts != expected.pts) return false;
  return t.pos >= 0 && expected.pos >= 0 ? t.pos == expected.pos : t.dts == expected.dts;
}

// The file read from its start (after frame_times): seeking to the stream's first packet, with a fresh decoder (as
// opening the file again would give: a flushed one keeps what it learnt further on, such as parameter sets). False
// when the demuxer cannot (the caller opens the file again); decode_frames' first_packet check (starts_at) then
// confirms it arrived there.
bool rewind(const std::string& path, OpenedVideo& v, const FrameTimes::Packet& first) {
  if (av_seek_frame(v.in.get(), v.index, std::min(first.dts, first.pts), AVSEEK_FLAG_BACKWARD) < 0) return false;
  open_decoder(path, v);
  return true;
}

std::function<bool(const AVPacket&)> starts_at(const FrameTimes::Packet& first) {
  return [first](const AVPacket& packet) { return same_packet(packet, first); };
}

// Empty when the packets cannot say which frame is which: the demuxer cannot read a packet, a packet has no
// presentation time, or two frames share one. A packet marked discard (before an MP4 edit list's start) is decoded,
// not shown: not a frame here. (Whether the decoder shows the earliest frame first is decode_by_seeking's to check.)
//
// Reading stops once the first `frames` frames are known for certain: when a packet's decode time is past the
// `frames`-th earliest presentation time read so far, while every decode time so far has only increased and no
// presentation time came before its decode time (as every muxer writes them): no later packet can then be shown
// earlier. `pts` then holds those frames and possibly some after them; `keys` every key frame shown before them.
// Without decode times, or with ones that break that rule, the whole file is read. So the scan reads the file up to
// just past the clip, as decoding from the start would, at a small fraction of decoding's cost.
//
// With `seconds_after`, reading goes on past those frames to every frame shown less than that after the `frames`-th
// and the first frame after them (known for certain as above, once a packet decodes after its time); `pts` then holds
// exactly those (a reordered frame not read yet could be missing past them), or the whole stream when it ends first.
std::optional<FrameTimes> frame_times(const std::string& path, OpenedVideo& v, int64_t frames,
                                      std::optional<double> seconds_after = std::nullopt) {
  FrameTimes times;
  PacketPtr packet(av_packet_alloc());
  if (!packet) fail(path, "out of memory");
  std::priority_queue<int64_t> earliest;  // the `frames` earliest presentation times so far (its top the latest)
  int64_t last_dts = std::numeric_limits<int64_t>::min();
  bool ordered = true;  // decode times only increase, and no presentation time comes before its decode time
  std::optional<int64_t> until, next;  // with seconds_after: the last time wanted, then the first frame's after it
  bool ended = false;
  while (true) {
    const int r = av_read_frame(v.in.get(), packet.get());
    if (r == AVERROR_EOF) {
      ended = true;
      break;
    }
    if (r < 0) return std::nullopt;
    if (packet->stream_index == v.index) {
      if (packet->pts == AV_NOPTS_VALUE) return std::nullopt;
      if (!times.first) times.first = times_of(*packet);
      if ((packet->flags & AV_PKT_FLAG_DISCARD) == 0) {
        times.pts.push_back(packet->pts);
        earliest.push(packet->pts);
        if (static_cast<int64_t>(earliest.size()) > frames) earliest.pop();
        if (until && packet->pts > *until && (!next || packet->pts < *next)) next = packet->pts;
      }
      if ((packet->flags & AV_PKT_FLAG_KEY) != 0) times.keys.push_back(times_of(*packet));
      if (packet->dts != AV_NOPTS_VALUE) {  // (a demuxer may leave the first packets' unknown)
        if (packet->dts < last_dts || packet->pts < packet->dts) ordered = false;
        else last_dts = packet->dts;
      }
      if (ordered && packet->dts != AV_NOPTS_VALUE) {
        if (!until && static_cast<int64_t>(earliest.size()) == frames && packet->dts > earliest.top()) {
          if (!seconds_after) break;  // the first `frames` frames are known
          until = earliest.top() + static_cast<int64_t>(std::ceil(*seconds_after / av_q2d(v.stream->time_base)));
          for (const int64_t t : times.pts)
            if (t > *until && (!next || t < *next)) next = t;
        }
        if (next && packet->dts > *next) break;  // every frame shown by `next` is read
      }
    }
    av_packet_unref(packet.get());
  }
  std::sort(times.pts.begin(), times.pts.end());
  if (!ended && next) times.pts.erase(std::upper_bound(times.pts.begin(), times.pts.end(), *next), times.pts.end());
  if (times.pts.empty() || std::adjacent_find(times.pts.begin(), times.pts.end()) != times.pts.end())
    return std::nullopt;
  return times;
}

// The presentation time of the decoder's first frame, decoding from the stream's first packet (rewound to);
// empty when it cannot be had.
std::optional<int64_t> first_frame_time(const std::string& path, OpenedVideo& v, const VideoReadOptions& options,
                                        const FrameTimes::Packet& first) {
  if (!rewind(path, v, first)) return std::nullopt;
  std::optional<int64_t> time;
  try {
    const Decoded decoded = decode_frames(
        path, v, options, 0, [](int64_t) { return false; }, [](int64_t, torch::Tensor) {},
        /*damage_ends_stream=*/true,
        [&](const AVFrame& frame, int64_t) {
          if (frame.pts != AV_NOPTS_VALUE) time = frame.pts;
          return int64_t{0};
        },
        starts_at(first));
    if (decoded.gave_up) return std::nullopt;
  } catch (const VideoError&) {
    return std::nullopt;
  }
  return time;
}

// Whether the decoder took `frame` for a key frame (IDR, an open GOP's I-frame, HEVC's IRAP, VP9's key frame; but
// also H.264's recovery points, intra refresh's among them, which may be P-frames).
bool shown_as_key_frame(const AVFrame& frame) {
#ifdef AV_FRAME_FLAG_KEY  // FFmpeg 6.1 on
  return (frame.flags & AV_FRAME_FLAG_KEY) != 0;
#else
  return frame.key_frame != 0;
#endif
}

// Seeking pays for itself from this frame on: reading packets without decoding them costs about 1/50 of decoding
// their frames at 256x144 (bench_loader's long source: 2.2 µs a packet against 117 µs a frame), less at larger
// sizes, and the group of pictures decoded after the seek costs what it costs either way.
constexpr int64_t kSeekFromFrame = 48;

// Decodes the frames `wanted` (sorted, unique indices) from the key frame at or before the first of them, after
// seeking there: the frames decoded are told apart by their presentation times (FrameTimes). False, with nothing
// kept, when that cannot find exactly the frames decoding from the start would (the caller then does that, from the
// stream's first packet, `first` when it is known): no FrameTimes, a stream shorter than the last index, no key frame
// early enough to gain anything, a decoder that does not show the earliest frame first (one that drops leading
// frames: its frame i is not pts[i]), a file that does not seek to the key frame, damaged data, or a frame not where
// the packets said.
bool decode_by_seeking(const std::string& path, OpenedVideo& v, const VideoReadOptions& options,
                       const std::vector<int64_t>& wanted, std::map<int64_t, torch::Tensor>& kept,
                       int64_t* frames_decoded, std::optional<FrameTimes::Packet>& first) {
  const int64_t first_index = wanted.front(), last = wanted.back();
  const auto times = frame_times(path, v, last + 1);
  if (!times) return false;
  first = times->first;
  const auto& pts = times->pts;
  if (last >= static_cast<int64_t>(pts.size())) return false;
  const int64_t target = pts[static_cast<size_t>(first_index)];
  const FrameTimes::Packet* key = nullptr;
  for (const auto& k : times->keys)
    if (k.pts <= target && (key == nullptr || k.pts > key->pts)) key = &k;
  if (key == nullptr) return false;
  const auto at = [&](int64_t time) { return std::lower_bound(pts.begin(), pts.end(), time) - pts.begin(); };
  if (at(key->pts) < kSeekFromFrame) return false;  // the frames before the key are too few to be worth it
  if (first_frame_time(path, v, options, *times->first) != pts.front()) return false;
  // Seeking is by the key's presentation time, then (demuxers whose index holds decode times: MP4) by its decode
  // time; the first packet read must be a key frame at or before the first wanted frame.
  std::vector<int64_t> seek_times = {key->pts};
  if (key->dts < key->pts) seek_times.push_back(key->dts);
  for (const int64_t time : seek_times) {
    if (av_seek_frame(v.in.get(), v.index, time, AVSEEK_FLAG_BACKWARD) < 0) continue;
    avcodec_flush_buffers(v.dec.get());
    kept.clear();
    size_t next = 0;         // wanted[next]: the next wanted frame to come
    bool key_whole = false;  // the key frame decoded, and the decoder took it for a whole picture
    const auto number = [&](const AVFrame& frame, int64_t) -> int64_t {
      if (frame.pts == AV_NOPTS_VALUE) return kGiveUp;
      const int64_t index = at(frame.pts);
      if (index == static_cast<int64_t>(pts.size()) || pts[static_cast<size_t>(index)] != frame.pts) return kGiveUp;
      // A key frame the container marks may be a recovery point of intra refresh (a P-frame the decoder also calls
      // a key frame, after which pictures are whole only once the refresh has swept them) or a mislabelled frame:
      // the key's own picture must be an intra-coded key frame, and no frame of the clip may come marked corrupt.
      if (frame.pts == key->pts) key_whole = shown_as_key_frame(frame) && frame.pict_type == AV_PICTURE_TYPE_I;
      if (index < first_index) return index;  // a frame before the clip (an open GOP's leading frames among them)
      if (!key_whole || (frame.flags & AV_FRAME_FLAG_CORRUPT) != 0 || frame.decode_error_flags != 0) return kGiveUp;
      // Frames come in presentation order: one past the next wanted frame means that frame will not come.
      if (next < wanted.size() && index > wanted[next]) return kGiveUp;
      if (next < wanted.size() && index == wanted[next]) ++next;
      return index;
    };
    // The key frame chosen or one before it, at its own byte position (times alone may repeat in a file).
    const auto starts_at_a_key = [&](const AVPacket& packet) {
      if ((packet.flags & AV_PKT_FLAG_KEY) == 0 || packet.pts == AV_NOPTS_VALUE || packet.pts > target) return false;
      for (const auto& k : times->keys)
        if (same_packet(packet, k)) return true;
      return false;
    };
    Decoded decoded;
    try {
      decoded = decode_frames(
          path, v, options, last, [&](int64_t i) { return std::binary_search(wanted.begin(), wanted.end(), i); },
          [&](int64_t i, torch::Tensor t) { kept.emplace(i, std::move(t)); }, /*damage_ends_stream=*/true, number,
          starts_at_a_key);
    } catch (const VideoError&) {
      decoded.gave_up = true;  // what decoding from the start makes of it is what the read says
    }
    if (!decoded.gave_up && kept.size() == wanted.size()) {
      if (frames_decoded != nullptr) *frames_decoded = decoded.frames;
      return true;
    }
  }
  kept.clear();
  return false;
}

// The kept frames in the order of `indices` (repeats allowed): [N, H, W, 3].
torch::Tensor stack_frames(const OpenedVideo& v, const std::vector<int64_t>& indices,
                           const std::map<int64_t, torch::Tensor>& kept) {
  auto out = torch::empty({static_cast<int64_t>(indices.size()), v.shown_height, v.shown_width, 3}, torch::kUInt8);
  for (size_t k = 0; k < indices.size(); ++k) out[static_cast<int64_t>(k)].copy_(kept.at(indices[k]));
  return out;
}

}  // namespace

torch::Tensor read_video_frames(const std::string& path, const std::vector<int64_t>& indices, int64_t* frames_decoded,
                                const VideoReadOptions& options) {
  if (indices.empty()) fail(path, "read_video_frames: no frame indices asked for");
  for (int64_t i : indices)
    if (i < 0) fail(path, "read_video_frames: negative frame index " + std::to_string(i));
  const std::set<int64_t> unique(indices.begin(), indices.end());
  const std::vector<int64_t> wanted(unique.begin(), unique.end());
  const int64_t last = wanted.back();
  std::map<int64_t, torch::Tensor> kept;
  auto v = open_video(path);
  check_frame_budget(path, v, static_cast<int64_t>(indices.size() + wanted.size()), options);
  const auto from_start = [&](const std::function<bool(const AVPacket&)>& first_packet) {
    return decode_frames(
        path, v, options, last, [&](int64_t i) { return std::binary_search(wanted.begin(), wanted.end(), i); },
        [&](int64_t i, torch::Tensor t) { kept.emplace(i, std::move(t)); }, /*damage_ends_stream=*/true, nullptr,
        first_packet);
  };
  Decoded decoded;
  if (options.seek() && wanted.front() >= kSeekFromFrame) {
    std::optional<FrameTimes::Packet> first;
    if (decode_by_seeking(path, v, options, wanted, kept, frames_decoded, first)) return stack_frames(v, indices, kept);
    // From the start, as if it had not sought: back at the stream's first packet, or the file opened again where
    // the demuxer does not go back there.
    if (first && rewind(path, v, *first)) decoded = from_start(starts_at(*first));
    if (!first || decoded.gave_up || decoded.frames == 0) {
      kept.clear();
      v = open_video(path);
      decoded = from_start(nullptr);
    }
  } else {
    decoded = from_start(nullptr);
  }
  if (frames_decoded != nullptr) *frames_decoded = decoded.frames;
  if (decoded.frames <= last) return {};
  return stack_frames(v, indices, kept);
}

std::vector<double> presentation_times(const std::string& path, int64_t index, double seconds_after) {
  if (index < 0) fail(path, "presentation_times: negative frame index " + std::to_string(index));
  auto v = open_video(path);
  const auto times = frame_times(path, v, index + 1, seconds_after);
  if (!times || static_cast<int64_t>(times->pts.size()) <= index) return {};
  const double time_base = av_q2d(v.stream->time_base);
  std::vector<double> seconds(times->pts.size());
  for (size_t i = 0; i < seconds.size(); ++i)
    seconds[i] = static_cast<double>(times->pts[i] - times->pts.front()) * time_base;
  return seconds;
}

#else  // built without FFmpeg (MEGASLIDE_VIDEO=OFF, or its libraries were not found)

namespace {
[[noreturn]] void no_video(const std::string& path) {
  throw VideoError(path +
                   ": this build of MegaSlide has no video support: FFmpeg's libraries were not found "
                   "when it was configured (install libavformat-dev libavcodec-dev libswscale-dev libavutil-dev, "
                   "or run tools/bootstrap.sh, and reconfigure; see MEGASLIDE_VIDEO in docs/building.md)");
}
}  // namespace

bool video_supported() { return false; }
void write_mp4(const std::string& path, const torch::Tensor&, const VideoWriteOptions&) { no_video(path); }
void write_png(const std::string& path, const torch::Tensor&) { no_video(path); }
std::string encode_png(const torch::Tensor&, const std::string& what) { no_video(what); }
torch::Tensor read_video(const std::string& path, VideoInfo*, const VideoReadOptions&) { no_video(path); }
VideoInfo probe_video(const std::string& path) { no_video(path); }
torch::Tensor read_video_frames(const std::string& path, const std::vector<int64_t>&, int64_t*,
                                const VideoReadOptions&) {
  no_video(path);
}
std::vector<double> presentation_times(const std::string& path, int64_t, double) { no_video(path); }

#endif
}  // namespace megaslide::io
