#!/usr/bin/env python3
"""Reference fixtures for MegaSlide's C++ tests, made with the Python libraries users check us against.

    python tools/make_fixtures.py                 # every section
    python tools/make_fixtures.py video sampler   # only these
    python tools/make_fixtures.py --list          # the sections and what each writes
    python tools/make_fixtures.py --umt5-ids DIR OUT.safetensors   # transformers' ids with a real umT5 tokenizer

Each section writes small files under tests/fixtures/<section>/ (safetensors, or the media files a test
reads); they are committed, so building and testing MegaSlide needs no Python. The package versions
this was run with are pinned in tools/fixtures-requirements.txt. Every input is drawn from fixed seeds
and the computations run on the CPU in one thread, so a rerun with those versions rewrites the same
bytes. The video section also needs the `ffmpeg` program with libx264, and the CLIP sections OpenAI's
CLIP vocabulary in .deps/clip/ (or MEGASLIDE_CLIP_BPE); tools/bootstrap.sh installs both. The
clip_tokenizer section reads VBench's prompt list from the `vbench` package (installed without its
dependencies, see tools/fixtures-requirements.txt).

To add a section: write a function `section_NAME(out_dir)` that writes under `out_dir` and register it
in SECTIONS with a one-line description; keep what it writes to a few hundred kB.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")


_SAFETENSORS_DTYPES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64",
                       np.dtype(np.int32): "I32", np.dtype(np.int16): "I16", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}


def _torch_tensor_bytes(tensor):
    """(safetensors dtype name, shape, little-endian bytes) of a torch tensor (bf16 and fp16 included)."""
    import torch

    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3",
             torch.float8_e5m2: "F8_E5M2", torch.uint8: "U8"}
    t = tensor.detach().contiguous().cpu()
    raw = t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t
    raw = raw.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else raw
    return names[t.dtype], list(t.shape), raw.numpy().astype(raw.numpy().dtype.newbyteorder("<")).tobytes()


def save_safetensors(path, tensors, metadata=None):
    """Writes {name: numpy array or torch tensor} as safetensors with names in sorted order and a JSON header
    whose key order is fixed (the safetensors package orders its metadata by a hash map: its bytes vary
    from run to run). Read back with the safetensors package as a check of the format."""
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    is_torch = any(not isinstance(v, np.ndarray) and hasattr(v, "detach") for v in tensors.values())
    for name in sorted(tensors):
        if is_torch:
            dtype, shape, data = _torch_tensor_bytes(tensors[name])
        else:
            array = np.asarray(tensors[name]).copy(order="C")  # (ascontiguousarray would make a 0-d array 1-d)
            dtype, shape, data = _SAFETENSORS_DTYPES[array.dtype], list(array.shape), array.astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for data in blobs:
            f.write(data)
    if is_torch:
        import torch
        from safetensors.torch import load_file

        back = load_file(path)
        assert sorted(back) == sorted(tensors), path
        def bits(t):  # the bytes: NaN != NaN, and torch.equal has no float8 kernel
            t = t.detach().cpu().contiguous()
            return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if t.is_floating_point() else t

        assert all(back[k].dtype == tensors[k].dtype and torch.equal(bits(back[k]), bits(tensors[k])) for k in tensors), path
        return
    from safetensors.numpy import load_file

    back = load_file(path)
    assert sorted(back) == sorted(tensors), path
    assert all(back[k].shape == np.shape(tensors[k]) and np.array_equal(back[k], tensors[k], equal_nan=back[k].dtype.kind == "f")
               for k in tensors), path


def versions(*modules):
    out = {"python": sys.version.split()[0], "numpy": np.__version__}
    for m in modules:
        out[m.__name__] = m.__version__
    return json.dumps(out, sort_keys=True)


# --------------------------------------------------------------------------------------------------
# video: frames as OpenCV's FFmpeg backend decodes them (what VBench reads videos with)
# --------------------------------------------------------------------------------------------------

def _video_clips():
    """(name, frames [T, H, W, 3] uint8 RGB, ffmpeg pixel format) for the clips the video test decodes."""
    rng = np.random.default_rng(20240601)
    clips = []

    # What megaslide-sample writes for a small model: a coarse colour field that changes a little every
    # frame, upscaled by repeating pixels (--upscale 4): sharp chroma edges on every 4th pixel.
    coarse = rng.uniform(0, 255, (12, 16, 3))
    frames = []
    for _ in range(16):
        coarse = np.clip(coarse + rng.normal(0, 18, coarse.shape), 0, 255)
        frames.append(np.repeat(np.repeat(np.round(coarse), 4, 0), 4, 1))
    clips.append(("blocks_64x48", np.stack(frames).astype(np.uint8), "yuv420p"))

    # A size that is not a multiple of H.264's 16-pixel macroblocks (the decoder's coded size is larger),
    # smooth colour waves with a moving hard-edged blue checkerboard and some noise.
    H, W = 38, 70
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float64)
    frames = []
    for t in range(12):
        r = 127 + 110 * np.sin(xx / 5.0 + 0.7 * t)
        g = 127 + 110 * np.cos(yy / 4.0 - 0.5 * t)
        b = np.where(((xx + 3 * t) // 6 + yy // 6) % 2 == 0, 235.0, 25.0)
        f = np.stack([r, g, b], -1) + rng.normal(0, 5, (H, W, 3))
        frames.append(np.clip(np.round(f), 0, 255))
    clips.append(("waves_70x38", np.stack(frames).astype(np.uint8), "yuv420p"))

    # Full-range ("JPEG") YUV, which some encoders write: the range comes from the pixel format.
    H, W = 32, 32
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float64)
    frames = []
    for t in range(8):
        r = np.clip(255 * (xx + 2 * t) / W, 0, 255)
        g = 255 * ((yy // 4 + t) % 2)
        b = 128 + 100 * np.sin((xx + yy) / 3.0 + t)
        frames.append(np.round(np.stack([r, g, b], -1)))
    clips.append(("fullrange_32x32", np.stack(frames).astype(np.uint8), "yuvj420p"))
    return clips


def _encode_h264(frames, pix_fmt, path):
    T, H, W, _ = frames.shape
    ffmpeg = shutil.which("ffmpeg")
    if ffmpeg is None:
        sys.exit("make_fixtures video: the ffmpeg program is needed (Debian package ffmpeg; tools/bootstrap.sh installs it)")
    colour = ["-colorspace", "smpte170m", "-color_primaries", "smpte170m", "-color_trc", "smpte170m"]
    colour += ["-color_range", "pc" if pix_fmt == "yuvj420p" else "tv"]
    subprocess.run(
        [ffmpeg, "-nostdin", "-loglevel", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{W}x{H}", "-r", "8",
         "-i", "-", "-an", "-c:v", "libx264", "-preset", "medium", "-crf", "17", "-threads", "1", "-pix_fmt", pix_fmt, *colour,
         "-map_metadata", "-1", "-fflags", "+bitexact", "-flags:v", "+bitexact", path],
        input=frames.tobytes(), check=True)


# The colour bars of section video_files: RGB that the decoder must give back from YUV worked out here.
_COLOUR_BARS = [(64, 64, 64), (192, 192, 192), (200, 50, 50), (50, 100, 200)]


def _bars_yuv(kr, kb, full, chroma_step):
    """Planes Y, U, V (uint8) of four 16-pixel-wide bars 48 high, from the bars' RGB by the matrix with luma
    weights kr, kb: studio range (Y 16 + 219y, C 128 + 224c) or full range (Y 255y, C 128 + 255c, clipped);
    chroma every `chroma_step` pixels (1: 4:4:4, 2: 4:2:0)."""
    y_row, u_row, v_row = [], [], []
    for r, g, b in _COLOUR_BARS:
        r, g, b = r / 255, g / 255, b / 255
        y = kr * r + (1 - kr - kb) * g + kb * b
        cb, cr = (b - y) / (2 * (1 - kb)), (r - y) / (2 * (1 - kr))
        if full:
            values = (255 * y, 128 + 255 * cb, 128 + 255 * cr)
        else:
            values = (16 + 219 * y, 128 + 224 * cb, 128 + 224 * cr)
        yy, uu, vv = (int(np.clip(np.round(v), 0, 255)) for v in values)
        y_row += [yy] * 16
        u_row += [uu] * (16 // chroma_step)
        v_row += [vv] * (16 // chroma_step)
    plane = lambda row, h: np.tile(np.array(row, dtype=np.uint8), (h, 1))
    return plane(y_row, 48), plane(u_row, 48 // chroma_step), plane(v_row, 48 // chroma_step)


def _seek_files(ffmpeg, out_dir):
    """96 frames, 32x32, each unlike the others, in groups of 12 pictures (a key frame every 12), in the layouts that
    make seeking hard: open GOPs with B-frames (H.264, and HEVC whose open GOPs hold frames a decoder drops after a
    seek), VP9 (hidden alt-ref frames), H.264 with intra refresh (key frames that are recovery points), a variable
    frame rate in Matroska (no decode times stored), and an MP4 whose edit list starts mid-group (packets before its
    start are decoded, not shown)."""
    yy, xx = np.mgrid[0:32, 0:32]
    frames = [np.stack([128 + 100 * np.sin(xx / 4.0 + 0.3 * t), 128 + 100 * np.cos(yy / 5.0 - 0.2 * t),
                        np.full_like(xx, (37 * t) % 256, dtype=float)], -1) for t in range(96)]
    raw = np.round(np.stack(frames)).clip(0, 255).astype(np.uint8).tobytes()
    common = [ffmpeg, "-nostdin", "-loglevel", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", "32x32", "-r",
              "24", "-i", "-", "-an", "-threads", "1", "-map_metadata", "-1", "-fflags", "+bitexact", "-flags:v",
              "+bitexact", "-pix_fmt", "yuv420p"]
    h264 = ["-c:v", "libx264", "-g", "12", "-bf", "3", "-crf", "30", "-x264-params", "open-gop=1"]
    files = [
        ("gop_h264_open_32x32.mp4", h264 + ["-movflags", "+faststart"]),
        ("gop_hevc_open_32x32.mp4", ["-c:v", "libx265", "-crf", "30", "-x265-params",
                                     "keyint=12:min-keyint=12:open-gop=1:bframes=4:log-level=error"]),
        ("gop_vp9_32x32.webm", ["-c:v", "libvpx-vp9", "-g", "12", "-crf", "40", "-b:v", "0"]),
        # Intra refresh (no IDR after the first frame): the muxer marks recovery points as key frames, from which the
        # frames are not whole until the refresh has swept the picture.
        ("gop_h264_intrarefresh_32x32.mp4", ["-c:v", "libx264", "-g", "12", "-bf", "0", "-crf", "30", "-x264-params",
                                             "intra-refresh=1"]),
        ("gop_h264_vfr_32x32.mkv", h264 + ["-vf", "settb=1/1000,setpts=(N+floor(N/7)*0.5)/24/TB", "-fps_mode", "vfr",
                                           "-enc_time_base", "1/1000"]),
    ]
    for name, codec in files:
        subprocess.run(common + codec + [os.path.join(out_dir, name)], input=raw, check=True)
        print(f"  {name}: 96 frames 32x32, a key frame every 12")
    # Two MPEG-TS files joined end to end (cat): the second restarts the first's timestamps, so a time names two frames.
    # The second holds the 96 frames backwards: at each time, another picture than the first's.
    segments = []
    frame_bytes = len(raw) // 96
    backwards = b"".join(raw[k * frame_bytes: (k + 1) * frame_bytes] for k in reversed(range(96)))
    for k, frames_in in enumerate([raw, backwards]):
        part = os.path.join(out_dir, f"part{k}.ts")
        subprocess.run(common + ["-c:v", "libx264", "-g", "12", "-bf", "2", "-crf", "30", "-f", "mpegts", part],
                       input=frames_in, check=True)
        segments.append(open(part, "rb").read())
        os.remove(part)
    with open(os.path.join(out_dir, "gop_h264_joined_32x32.ts"), "wb") as f:
        f.write(b"".join(segments))
    print("  gop_h264_joined_32x32.ts: two MPEG-TS files of the 96 frames (forwards, then backwards) joined, the "
          "second's timestamps restarted")
    # Stream copy from 0.7 s: the copy starts at the key frame before, with an edit list that hides what precedes 0.7 s.
    subprocess.run([ffmpeg, "-nostdin", "-loglevel", "error", "-y", "-ss", "0.7", "-i",
                    os.path.join(out_dir, "gop_h264_open_32x32.mp4"), "-c", "copy", "-map_metadata", "-1", "-fflags",
                    "+bitexact", os.path.join(out_dir, "gop_h264_editlist_32x32.mp4")], check=True)
    print("  gop_h264_editlist_32x32.mp4: gop_h264_open_32x32.mp4 from 0.7 s, copied (an edit list)")


def section_image_exif(out_dir):
    """Still images whose EXIF orientation says how to show them, as phones save photos: PNG (eXIf), lossless WebP
    (EXIF chunk) and JPEG (APP1) of one 24x16 picture under each orientation 1-8, and what PIL's
    ImageOps.exif_transpose shows for each (PNG, no EXIF): the PNG's and WebP's bit for bit, the JPEG's as PIL decodes
    it."""
    from PIL import Image, ImageOps
    import PIL

    g = np.random.default_rng(5)
    # 4x4 blocks of random colours: JPEG (quality 100, 4:4:4) keeps them within a few levels; a wrong turn does not.
    blocks = g.integers(0, 256, size=(4, 6, 3), dtype=np.uint8)
    picture = np.repeat(np.repeat(blocks, 4, axis=0), 4, axis=1)  # 16 rows, 24 columns
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        image = Image.fromarray(picture)
        image.save(os.path.join(out_dir, f"o{orientation}.png"), exif=exif.tobytes())
        image.save(os.path.join(out_dir, f"o{orientation}.webp"), lossless=True, exif=exif.tobytes())
        image.save(os.path.join(out_dir, f"o{orientation}.jpg"), quality=100, subsampling=0, exif=exif.tobytes())
        shown = {}
        for kind in ("png", "webp", "jpg"):
            with Image.open(os.path.join(out_dir, f"o{orientation}.{kind}")) as read:
                assert read.getexif().get(0x0112) == orientation, (kind, orientation)
                shown[kind] = np.asarray(ImageOps.exif_transpose(read).convert("RGB"))
        assert np.array_equal(shown["png"], shown["webp"]), orientation
        # Saved as new images: no EXIF of their own.
        Image.fromarray(shown["png"]).save(os.path.join(out_dir, f"shown{orientation}.png"))
        Image.fromarray(shown["jpg"]).save(os.path.join(out_dir, f"shown_jpg{orientation}.png"))
    # Orientation 6 as other writers store it: PNG eXIf keeping the "Exif\0\0" prefix, a LONG tag (big-endian in a
    # JPEG, little-endian in a WebP), only in XMP (JPEG APP1, PNG iTXt), and a JPEG with fill bytes before its APP1
    # and one with 80 other segments before it.
    import struct
    import zlib

    def tiff(value, long=False, big=False):
        e = ">" if big else "<"
        entry = struct.pack(e + "HHI", 0x0112, 4 if long else 3, 1) + (struct.pack(e + "I", value) if long else struct.pack(e + "HH", value, 0))
        return (b"MM" if big else b"II") + struct.pack(e + "HI", 42, 8) + struct.pack(e + "H", 1) + entry + struct.pack(e + "I", 0)

    def plain(kind):
        path = os.path.join(out_dir, f".plain.{kind}")
        Image.fromarray(picture).save(path, **({"quality": 100, "subsampling": 0} if kind == "jpg" else {"lossless": True} if kind == "webp" else {}))
        data = open(path, "rb").read()
        os.remove(path)
        return data

    def jpeg_with(segments):
        data = plain("jpg")
        return data[:2] + segments + data[2:]

    def app(marker, body):
        return b"\xff" + bytes([marker]) + struct.pack(">H", len(body) + 2) + body

    def png_with(chunk_type, body):
        data = plain("png")
        at = data.index(b"IDAT") - 4
        chunk = struct.pack(">I", len(body)) + chunk_type + body + struct.pack(">I", zlib.crc32(chunk_type + body))
        return data[:at] + chunk + data[at:]

    xmp = lambda form: (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
                        b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/"' + form + b"</rdf:RDF></x:xmpmeta>")
    variants = {
        "p_prefix6.png": png_with(b"eXIf", b"Exif\x00\x00" + tiff(6)),
        "j_long6.jpg": jpeg_with(app(0xE1, b"Exif\x00\x00" + tiff(6, long=True, big=True))),
        "j_xmp6.jpg": jpeg_with(app(0xE1, b"http://ns.adobe.com/xap/1.0/\x00" + xmp(b' tiff:Orientation="6"/>'))),
        "p_xmp6.png": png_with(b"iTXt", b"XML:com.adobe.xmp\x00\x00\x00\x00\x00" + xmp(b"><tiff:Orientation>6</tiff:Orientation></rdf:Description>")),
        "j_fill6.jpg": jpeg_with(b"\xff\xff\xff" + app(0xE1, b"Exif\x00\x00" + tiff(6))),
        "j_many6.jpg": jpeg_with(b"".join(app(0xE2, b"pad %d" % k) for k in range(80)) + app(0xE1, b"Exif\x00\x00" + tiff(6))),
    }
    Image.fromarray(picture).save(os.path.join(out_dir, "w_long6.webp"), lossless=True, exif=b"Exif\x00\x00" + tiff(6, long=True))
    for name, data in variants.items():
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data)
    for name in [*variants, "w_long6.webp"]:
        with Image.open(os.path.join(out_dir, name)) as read:
            shown = ImageOps.exif_transpose(read).convert("RGB")
            assert shown.size == (16, 24), (name, shown.size)  # turned
            Image.fromarray(np.asarray(shown)).save(os.path.join(out_dir, "shown_" + name.split(".")[0] + ".png"))
    print(f"  orientations 1-8 as PNG, WebP and JPEG, 24x16, and orientation 6 as {len(variants) + 1} other writers store it; Pillow {PIL.__version__}")


def section_video_files(out_dir):
    ffmpeg = shutil.which("ffmpeg")
    if ffmpeg is None:
        sys.exit("make_fixtures video_files: the ffmpeg program is needed (Debian package ffmpeg)")
    clips = [
        # HD video's matrix, studio range, 4:4:4, lossless H.264 tagged BT.709.
        ("bars_bt709_64x48.mp4", _bars_yuv(0.2126, 0.0722, False, 1), "yuv444p",
         ["-c:v", "libx264", "-qp", "0", "-colorspace", "bt709", "-color_primaries", "bt709", "-color_trc", "bt709",
          "-color_range", "tv"]),
        # BT.601's matrix at full range in a pixel format without a "j" (the range is only in the stream's tag),
        # lossless VP9.
        ("bars_fullrange_64x48.webm", _bars_yuv(0.299, 0.114, True, 2), "yuv420p",
         ["-c:v", "libvpx-vp9", "-lossless", "1", "-colorspace", "smpte170m", "-color_range", "pc"]),
    ]
    for name, planes, pix_fmt, codec in clips:
        frame = b"".join(p.tobytes() for p in planes)
        subprocess.run([ffmpeg, "-nostdin", "-loglevel", "error", "-y", "-f", "rawvideo", "-pix_fmt", pix_fmt, "-s", "64x48",
                        "-r", "8", "-i", "-", "-an", *codec, "-pix_fmt", pix_fmt, "-threads", "1", "-map_metadata", "-1",
                        "-fflags", "+bitexact", "-flags:v", "+bitexact", os.path.join(out_dir, name)],
                       input=frame * 3, check=True)
        print(f"  {name}: 3 frames 64x48 {pix_fmt}, bars {_COLOUR_BARS}")
    # A download cut short: 24 frames with the index first (+faststart), then only the first 90 % of the bytes, so
    # the stream ends inside a packet.
    whole = os.path.join(out_dir, "whole.mp4")
    planes = _bars_yuv(0.299, 0.114, False, 2)
    subprocess.run([ffmpeg, "-nostdin", "-loglevel", "error", "-y", "-f", "rawvideo", "-pix_fmt", "yuv420p", "-s", "64x48",
                    "-r", "8", "-i", "-", "-an", "-c:v", "libx264", "-g", "4", "-crf", "30", "-threads", "1",
                    "-movflags", "+faststart", "-map_metadata", "-1", "-fflags", "+bitexact", "-flags:v", "+bitexact",
                    whole], input=b"".join(p.tobytes() for p in planes) * 24, check=True)
    data = open(whole, "rb").read()
    os.remove(whole)
    with open(os.path.join(out_dir, "bars_cut_64x48.mp4"), "wb") as f:
        f.write(data[: len(data) * 9 // 10])
    print(f"  bars_cut_64x48.mp4: the first {len(data) * 9 // 10} of {len(data)} bytes of 24 frames")
    # A recording streamed to its file (written to a pipe: the WebM states neither a frame count nor a duration).
    streamed = subprocess.run([ffmpeg, "-nostdin", "-loglevel", "error", "-f", "rawvideo", "-pix_fmt", "yuv420p", "-s",
                               "64x48", "-r", "8", "-i", "-", "-an", "-c:v", "libvpx-vp9", "-lossless", "1", "-threads",
                               "1", "-map_metadata", "-1", "-fflags", "+bitexact", "-flags:v", "+bitexact", "-f", "webm",
                               "pipe:1"], input=b"".join(p.tobytes() for p in planes) * 10, check=True,
                              capture_output=True).stdout
    with open(os.path.join(out_dir, "bars_streamed_64x48.webm"), "wb") as f:
        f.write(streamed)
    print(f"  bars_streamed_64x48.webm: 10 frames written to a pipe")
    # 16-bit grey with no range tag (FFV1, as archives keep it): grey is full range unless tagged, as swscale takes
    # it: 8-bit levels 17, 34, 239 stored as 17·257, 34·257, 239·257.
    grey = np.tile(np.repeat(np.array([17, 34, 239], dtype=np.uint16) * 257, 16), (16, 1)).astype("<u2")
    subprocess.run([ffmpeg, "-nostdin", "-loglevel", "error", "-y", "-f", "rawvideo", "-pix_fmt", "gray16le", "-s", "48x16",
                    "-r", "8", "-i", "-", "-an", "-c:v", "ffv1", "-threads", "1", "-map_metadata", "-1", "-fflags",
                    "+bitexact", "-flags:v", "+bitexact", os.path.join(out_dir, "grey16_48x16.mkv")],
                   input=grey.tobytes() * 2, check=True)
    print("  grey16_48x16.mkv: 2 frames of 16-bit grey bars 17, 34, 239 (x257), untagged range")
    _seek_files(ffmpeg, out_dir)
    # Anamorphic: 32x32 stored, pixels twice as wide as high (SAR 2:1), shown at 64x32. Four horizontal bands,
    # 8 rows each: red, green, blue, white (lossless 4:4:4).
    bands = np.zeros((32, 32, 3), dtype=np.uint8)
    for k, rgb in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)]):
        bands[8 * k: 8 * k + 8] = rgb
    subprocess.run([ffmpeg, "-nostdin", "-loglevel", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", "32x32",
                    "-r", "8", "-i", "-", "-an", "-vf", "setsar=2/1", "-c:v", "libx264", "-qp", "0", "-pix_fmt",
                    "yuv444p", "-threads", "1", "-map_metadata", "-1", "-fflags", "+bitexact", "-flags:v", "+bitexact",
                    os.path.join(out_dir, "anamorphic_sar2_32x32.mp4")], input=bands.tobytes() * 8, check=True)
    print("  anamorphic_sar2_32x32.mp4: 8 frames 32x32 of SAR 2:1 (shown 64x32), bands red, green, blue, white")
    _vfr_file(ffmpeg, out_dir)
    with open(os.path.join(out_dir, "bars.json"), "w") as f:
        json.dump({"rgb": _COLOUR_BARS, "bar_width": 16,
                   "what": "four 16-pixel bars whose YUV was computed from these RGB values with each file's matrix and "
                           "range; decoding with the tagged matrix and range gives them back"}, f, indent=1)
        f.write("\n")


def _vfr_file(ffmpeg, out_dir):
    """Variable frame rates in MP4, as phones and screen recorders write them (one duration per frame in the index),
    flat grey frames, frame t of level 20 + 3t, lossless 4:4:4: vfr_steps_32x32.mp4, 72 frames at 24 frames a second
    for its first second, 12 for the next two, 24 for the last (frame t shown at t/24 s, then 1 + (t - 24)/12 s from
    frame 24, then 3 + (t - 48)/24 s from frame 48); vfr_pause_32x32.mp4, 70 frames at 24 frames a second with a pause
    of one second after frame 39 (frame t shown at t/24 s, from frame 40 at 1 + t/24 s)."""
    files = {"vfr_steps_32x32.mp4": (72, "if(lt(N,24),N/24,if(lt(N,48),1+(N-24)/12,3+(N-48)/24))"),
             "vfr_pause_32x32.mp4": (70, "if(lt(N,40),N/24,1+N/24)")}
    for name, (count, times) in files.items():
        raw = b"".join(bytes([20 + 3 * t]) * (32 * 32 * 3) for t in range(count))
        subprocess.run([ffmpeg, "-nostdin", "-loglevel", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s",
                        "32x32", "-r", "24", "-i", "-", "-an", "-vf", f"settb=1/96000,setpts='({times})/TB'",
                        "-fps_mode", "passthrough", "-c:v", "libx264", "-qp", "0", "-pix_fmt", "yuv444p", "-threads",
                        "1", "-video_track_timescale", "96000", "-map_metadata", "-1", "-fflags", "+bitexact",
                        "-flags:v", "+bitexact", os.path.join(out_dir, name)], input=raw, check=True)
        print(f"  {name}: {count} grey frames (level 20 + 3t), shown at {times} seconds")


def _opencv_frames(path):
    """Every frame as VBench reads it: cv2.VideoCapture(path).read() until it fails; BGR -> RGB."""
    import cv2

    cap = cv2.VideoCapture(path, cv2.CAP_FFMPEG)
    if not cap.isOpened():
        sys.exit(f"make_fixtures video: OpenCV cannot open {path}")
    frames = []
    while True:
        ok, frame = cap.read()
        if not ok:
            break
        frames.append(frame[:, :, ::-1])
    cap.release()
    return np.stack(frames)


def _vbench_temporal_flickering(frames):
    """VBench's temporal_flickering score of one video, with its arithmetic: the float32 mean absolute
    difference of each pair of consecutive frames, the mean over pairs, then (255 − mean) / 255."""
    maes = [np.mean(np.abs(frames[i].astype(np.float32) - frames[i + 1].astype(np.float32))) for i in range(len(frames) - 1)]
    return (255.0 - np.mean(np.array(maes)).item()) / 255.0


def section_video(out_dir):
    import cv2

    tensors = {}
    for name, frames, pix_fmt in _video_clips():
        mp4 = os.path.join(out_dir, name + ".mp4")
        _encode_h264(frames, pix_fmt, mp4)
        decoded = _opencv_frames(mp4)
        tensors[name + ".frames"] = decoded
        tensors[name + ".temporal_flickering"] = np.array([_vbench_temporal_flickering(decoded)], dtype=np.float64)
        print(f"  {name}: {decoded.shape[0]} frames {decoded.shape[2]}x{decoded.shape[1]} {pix_fmt}, "
              f"VBench temporal flickering {tensors[name + '.temporal_flickering'][0]:.6f}")
    meta = {"versions": versions(cv2), "what": "uint8 RGB frames [T, H, W, 3] of each NAME.mp4 as OpenCV's FFmpeg backend "
            "decodes them (cv2.VideoCapture.read, BGR flipped to RGB), and VBench's temporal_flickering of them"}
    save_safetensors(os.path.join(out_dir, "opencv_frames.safetensors"), tensors, meta)


# --------------------------------------------------------------------------------------------------
# sampler: diffusers' DDPM/DDIM timestep tables and single steps
# --------------------------------------------------------------------------------------------------

_SPACINGS = ("linspace", "leading", "trailing")
_PREDICTIONS = {"epsilon": "epsilon", "v": "v_prediction", "x0": "sample"}
_BETAS = {"linear": "linear", "cosine": "squaredcos_cap_v2"}


def _scheduler(kind, spacing, prediction, beta, train_timesteps, clip):
    from diffusers import DDIMScheduler, DDPMScheduler

    common = dict(num_train_timesteps=train_timesteps, beta_start=1e-4, beta_end=0.02, beta_schedule=_BETAS[beta],
                  prediction_type=_PREDICTIONS[prediction], clip_sample=clip, clip_sample_range=1.0, thresholding=False,
                  timestep_spacing=spacing, steps_offset=0)
    if kind == "ddpm":
        return DDPMScheduler(variance_type="fixed_small", **common)
    return DDIMScheduler(set_alpha_to_one=True, **common)


def section_sampler(out_dir):
    import diffusers
    import torch

    torch.manual_seed(0)
    tensors, tables, cases = {}, [], []

    # Timestep tables: diffusers' set_timesteps (descending) for each spacing, at sizes whose rounding
    # has ties (999/6 = 166.5) and where numpy's arange overshoots (trailing 61 of 1000 gives 62 values).
    sizes = [(1000, s) for s in (1, 2, 3, 7, 10, 25, 30, 50, 61, 100, 103, 250, 333, 999, 1000)] + [(50, 7), (37, 5), (1001, 13)]
    for spacing in _SPACINGS:
        for T, S in sizes:
            ddpm = _scheduler("ddpm", spacing, "epsilon", "linear", T, True)
            ddpm.set_timesteps(S)
            ddim = _scheduler("ddim", spacing, "epsilon", "linear", T, True)
            ddim.set_timesteps(S)
            assert torch.equal(ddpm.timesteps, ddim.timesteps), (spacing, T, S)
            name = f"timesteps.{spacing}.T{T}.S{S}"
            tensors[name] = ddpm.timesteps.numpy().astype(np.int64)
            tables.append({"name": name, "spacing": spacing, "train_timesteps": T, "steps": S})

    # Single steps at fixed inputs: the first, a middle and the last of S steps, for each sampler,
    # spacing, prediction type and beta schedule. DDIM only where diffusers' DDIM steps to the next kept
    # timestep (leading; trailing with S dividing T), and at η = 0 and η = 0.6.
    shape = (2, 3, 2, 4)
    T, S = 1000, 25
    configs = []
    for beta in _BETAS:
        for prediction in _PREDICTIONS:
            for spacing in _SPACINGS:
                configs.append(("ddpm", spacing, prediction, beta, 0.0, True))
            for spacing in ("leading", "trailing"):
                for eta in (0.0, 0.6):
                    configs.append(("ddim", spacing, prediction, beta, eta, True))
    configs += [("ddpm", "linspace", "epsilon", "linear", 0.0, False), ("ddim", "leading", "v", "cosine", 0.6, False)]
    for kind, spacing, prediction, beta, eta, clip in configs:
        sched = _scheduler(kind, spacing, prediction, beta, T, clip)
        sched.set_timesteps(S)
        for position in (0, S // 2, S - 1):  # position in diffusers' descending order
            t = int(sched.timesteps[position])
            name = f"step{len(cases):03d}"
            sample = torch.randn(shape, dtype=torch.float32)
            output = torch.randn(shape, dtype=torch.float32)
            if prediction == "x0":
                output = output * 0.7  # a clean-sample prediction mostly inside [-1, 1]
            seed = 1000 + len(cases)
            noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
            if kind == "ddpm":
                # DDPMScheduler draws its noise inside step() from the generator: the same draw as `noise`.
                result = sched.step(output, t, sample, generator=torch.Generator().manual_seed(seed))
            else:
                result = sched.step(output, t, sample, eta=eta, use_clipped_model_output=True, variance_noise=noise if eta > 0 else None)
            tensors[name + ".sample"] = sample.numpy()
            tensors[name + ".model_output"] = output.numpy()
            tensors[name + ".noise"] = noise.numpy()
            tensors[name + ".prev_sample"] = result.prev_sample.numpy()
            tensors[name + ".pred_original_sample"] = result.pred_original_sample.numpy()
            cases.append({"name": name, "kind": kind, "spacing": spacing, "prediction": prediction, "beta_schedule": beta,
                          "train_timesteps": T, "steps": S, "position": position, "timestep": t, "eta": eta, "clip_sample": clip})
    meta = {"versions": versions(diffusers, torch), "tables": json.dumps(tables), "cases": json.dumps(cases),
            "what": "diffusers DDPMScheduler/DDIMScheduler: set_timesteps tables (descending) and step() at fixed inputs"}
    save_safetensors(os.path.join(out_dir, "diffusers.safetensors"), tensors, meta)
    print(f"  {len(tables)} timestep tables, {len(cases)} single steps")


# --------------------------------------------------------------------------------------------------
# clip_tokenizer: transformers' CLIPTokenizer ids for prompts, with the real CLIP vocabulary and a tiny one
# --------------------------------------------------------------------------------------------------

def _openai_bpe_path():
    """OpenAI's bpe_simple_vocab_16e6.txt as tools/bootstrap.sh puts it (from the open-clip-torch wheel),
    or where MEGASLIDE_CLIP_BPE points."""
    path = os.environ.get("MEGASLIDE_CLIP_BPE", os.path.join(ROOT, ".deps", "clip", "bpe_simple_vocab_16e6.txt"))
    if not os.path.exists(path):
        sys.exit(f"make_fixtures: {path} not found: run tools/bootstrap.sh (it fetches CLIP's vocabulary) or set MEGASLIDE_CLIP_BPE")
    return path


def _bytes_to_unicode():
    """GPT-2's byte -> printable character table, in OpenAI's order (printable bytes first)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def clip_vocabulary(merge_count=49152 - 256 - 2):
    """transformers' vocab (token -> id) and merges for CLIP, built from OpenAI's merges file the way
    OpenAI's CLIP builds its encoder: byte symbols, the same with </w>, merge results, two special tokens."""
    with open(_openai_bpe_path(), encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = [tuple(line.split()) for line in lines[1 : merge_count + 1]]
    symbols = list(_bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, merges


def _vbench_prompts(per_dimension=4):
    """The first `per_dimension` prompts of each of VBench's 16 dimensions (VBench_full_info.json of the
    vbench package, read as a file: `pip install --no-deps vbench`)."""
    import importlib.util

    spec = importlib.util.find_spec("vbench")
    if spec is None:
        sys.exit("make_fixtures: the vbench package is needed for its prompt list (pip install --no-deps vbench==0.1.5)")
    with open(os.path.join(spec.submodule_search_locations[0], "VBench_full_info.json"), encoding="utf-8") as f:
        info = json.load(f)
    chosen, count = [], {}
    for entry in info:
        for dim in entry["dimension"]:
            if count.get(dim, 0) < per_dimension and entry["prompt_en"] not in chosen:
                chosen.append(entry["prompt_en"])
                count[dim] = count.get(dim, 0) + 1
    return chosen


_EDGE_PROMPTS = [
    "",
    "   ",
    "A",
    "Hello, World!!! ... (really?) [yes] {no} <maybe>",
    "it's, they're, we've, I'm, you'll, she'd, don't, WON'T, It'S",
    "rock'n'roll ''quoted'' 'single' \"double\" `back`",
    "3.14159 and 2,718 and 1e-5; 1234567890 fps @ 60Hz, 4K/8K, 16:9",
    "$100 50% #tag @user a&b a+b=c a*b/c x^2 ~approx~ under_score",
    "café crème brûlée, naïve façade, jalapeño, São Paulo, Zürich, Øresund",
    "cafe\u0301 (decomposed é) vs caf\u00e9",
    "ΚΑΛΗΜΕΡΑ ΚΌΣΜΕ, ΟΔΥΣΣΕΥΣ",
    "İstanbul IŞIK ılık, straße STRASSE, ǅemal",
    "東京の夜景、桜が舞う。北京烤鸭 서울의 거리",
    "Москва зимой, Київ навесні",
    "مرحبا بالعالم שלום עולם नमस्ते दुनिया",
    "a cat 🐱 plays with a dog 🐶 under the 🌈 rainbow",
    "family 👨\u200d👩\u200d👧\u200d👦, thumbs 👍🏽, flag 🇯🇵, heart ❤️",
    "tab\tseparated\nnew line\r\nand\u00a0non-breaking\u2003em space\u3000ideographic",
    "zero\u200bwidth space and soft\u00adhyphen",
    "full-width ＡＢＣ１２３ and ligature ﬁne ﬂow, ½ ², Ⅻ",
    "<|startoftext|>a photo<|endoftext|> of a cat",
    "HTML &amp; entities &lt;b&gt; stay as written",
    "https://example.com/path?query=1&x=2 e-mail: someone@example.org",
    "UPPERCASE lowercase MiXeD cAsE CamelCaseWords snake_case kebab-case",
    "a" * 100,
    "supercalifragilisticexpialidocious pneumonoultramicroscopicsilicovolcanoconiosis",
    "The quick brown fox jumps over the lazy dog. " * 12,
    " ".join(f"word{i}" for i in range(90)),
    ", ".join(["a beautiful coastal beach in spring, waves lapping on sand, in cyberpunk style"] * 4),
    "!!!???...,,,;;;:::---___===+++",
    "1 2 3 4 5 6 7 8 9 10 11 12 100 1000 10000",
    "émoji at end 🎉",
    "\u00a0leading and trailing spaces\u00a0 ",
    "Ａ ｂ ｃ (fullwidth letters with spaces)",
    "ǆ ǈ ǋ titlecase digraphs; ǲ",
    "ﬀ ﬃ ﬄ ligatures; ß ẞ capital sharp s",
    "Σ at end ΟΔΟΣ and σ in the middle ΟΔΟΣ ΠΟΛΗΣ",
    "1st 2nd 3rd 4th 21st 100th",
    "don't stop; can't stop; won't stop",
    "a red blob moves left quickly",
    "blue vertical stripes oscillate slowly",
]


def _clip_tokenize(vocab, merges, prompts):
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges)
    out = tokenizer(prompts, padding="max_length", max_length=77, truncation=True)
    return np.array(out["input_ids"], dtype=np.int64), np.array(out["attention_mask"], dtype=np.int64)


def _write_hf_vocabulary(out_dir, vocab, merges):
    with open(os.path.join(out_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))


_TINY_MERGES = 120  # the tiny vocabulary: 512 byte symbols, 120 merges, 2 special tokens = 634 ids


def section_clip_tokenizer(out_dir):
    import transformers

    prompts = _vbench_prompts() + _EDGE_PROMPTS
    vocab, merges = clip_vocabulary()
    assert len(vocab) == 49408 and vocab["!"] == 0 and vocab["<|endoftext|>"] == 49407
    ids, mask = _clip_tokenize(vocab, merges, prompts)
    tiny_vocab, tiny_merges = clip_vocabulary(_TINY_MERGES)
    tiny_dir = os.path.join(out_dir, "tiny")
    os.makedirs(tiny_dir)
    _write_hf_vocabulary(tiny_dir, tiny_vocab, tiny_merges)
    tiny_ids, tiny_mask = _clip_tokenize(tiny_vocab, tiny_merges, prompts)
    meta = {"versions": versions(transformers), "prompts": json.dumps(prompts, ensure_ascii=False),
            "what": "CLIPTokenizer(vocab, merges)(prompts, padding='max_length', max_length=77, truncation=True): ids and "
                    "attention_mask with the full CLIP vocabulary (from OpenAI's bpe_simple_vocab_16e6.txt) and with tiny/ "
                    f"(its first {_TINY_MERGES} merges)"}
    save_safetensors(os.path.join(out_dir, "ids.safetensors"),
                     {"ids": ids, "mask": mask, "tiny.ids": tiny_ids, "tiny.mask": tiny_mask}, meta)
    print(f"  {len(prompts)} prompts ({len(prompts) - len(_EDGE_PROMPTS)} from VBench), "
          f"{int((mask.sum(1) == 77).sum())} of them cut at 77 tokens")


# --------------------------------------------------------------------------------------------------
# clip: tiny random CLIP text models in the published layouts, and transformers' outputs
# --------------------------------------------------------------------------------------------------

def _randomize(module, seed):
    """Every parameter redrawn at a scale that makes outputs depend on every weight (the default init is
    so small that LayerNorm hides most of the model). LayerNorm weights around 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if p.dim() == 0:
                continue  # CLIPModel's logit_scale
            if p.dim() == 1 and ("norm" in name or "layer_norm" in name) and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)


def section_clip(out_dir):
    import torch
    import transformers
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPTextModel

    tiny_vocab, tiny_merges = clip_vocabulary(_TINY_MERGES)
    prompts = ["a red blob moves left quickly", "", "A cat 🐱 on a SKATEBOARD, at night!", "it's 3.14 o'clock",
               "The quick brown fox jumps over the lazy dog. " * 12]
    ids, mask = _clip_tokenize(tiny_vocab, tiny_merges, prompts)
    bos, eos = tiny_vocab["<|startoftext|>"], tiny_vocab["<|endoftext|>"]
    text = dict(vocab_size=len(tiny_vocab), hidden_size=32, intermediate_size=56, num_hidden_layers=3, num_attention_heads=2,
                max_position_embeddings=77, bos_token_id=bos, pad_token_id=eos, attn_implementation="eager")
    tensors = {"ids": ids, "mask": mask}
    models = {
        # transformers 5's CLIPTextModel file: a flat CLIPTextConfig, tensor names without a prefix.
        "text_only": (CLIPTextModel(CLIPTextConfig(**text, hidden_act="quick_gelu", eos_token_id=eos)), 1),
        # A whole CLIPModel (as openai/clip-vit-large-patch14): CLIPConfig with a text_config, text_model.*
        # names beside a vision tower; the legacy eos_token_id 2 (pooling at the largest id); erf GELU.
        "full_model": (CLIPModel(CLIPConfig(text_config=dict(text, hidden_act="gelu", eos_token_id=2),
                                            vision_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                                               num_attention_heads=2, image_size=8, patch_size=4),
                                            projection_dim=8)), 2),
    }
    for name, (model, seed) in models.items():
        _randomize(model, seed)
        model.eval()
        folder = os.path.join(out_dir, name)
        os.makedirs(folder)
        model.config.save_pretrained(folder)
        save_safetensors(os.path.join(folder, "model.safetensors"), {k: v.numpy() for k, v in model.state_dict().items()}, {"format": "pt"})
        text_model = model.text_model if isinstance(model, CLIPModel) else model
        with torch.no_grad():
            out = text_model(input_ids=torch.from_numpy(ids))  # no attention mask, as Stable Diffusion calls it
        tensors[name + ".last_hidden_state"] = out.last_hidden_state.numpy()
        tensors[name + ".pooled"] = out.pooler_output.numpy()
    _write_hf_vocabulary(out_dir, tiny_vocab, tiny_merges)
    meta = {"versions": versions(transformers, torch), "prompts": json.dumps(prompts, ensure_ascii=False),
            "what": "tiny random CLIP text models (text_only/, full_model/) and their last_hidden_state and pooler_output "
                    "for the ids of the prompts (tokenized with this folder's vocab.json/merges.txt), no attention mask"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)
    print(f"  2 models, {len(prompts)} prompts")


# --------------------------------------------------------------------------------------------------
# clip_vision: CLIP's vision tower as Wan2.1 image-to-video calls it (CLIPImageProcessor, then
# CLIPVisionModel's hidden_states[-2]) on a tiny random model in diffusers' and ComfyUI's layouts
# --------------------------------------------------------------------------------------------------

def _clip_vision_image(height, width, seed):
    """A uint8 RGB image with smooth areas, hard 0/255 edges (bicubic overshoots there, so PIL's clipping
    runs) and noise."""
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    image = np.stack([255 * x / (width - 1), 255 * y / (height - 1), 128 + 100 * np.sin(x / 3 + y / 5)], axis=-1)
    image[height // 3: height // 3 + 6, width // 4: width // 2] = [255, 0, 255]
    image[:, width - 5: width - 3] = 0
    image += rng.normal(0, 12, image.shape)
    return np.clip(np.round(image), 0, 255).astype(np.uint8)


def section_clip_vision(out_dir):
    import PIL
    import torch
    import transformers
    from PIL import Image
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    # Non-default sizes everywhere: width 24 in 4 heads of 6, 3 layers, 7-pixel patches of a 28-pixel image
    # (17 positions), erf GELU (Wan's ViT-H/14 uses gelu). Weights rounded to fp16 so the ComfyUI file
    # (fp16, as ComfyUI distributes clip_vision_h.safetensors) holds the same model.
    config = CLIPVisionConfig(hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
                              image_size=28, patch_size=7, hidden_act="gelu", projection_dim=16)
    model = CLIPVisionModel(config)
    _randomize(model, 81)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    model.eval()
    # diffusers' image_encoder/ as the Wan2.1 I2V repos hold it (saved by transformers 4: vision_model.* names),
    # in fp16 to keep the fixture small (the tests write fp32 copies).
    state = {"vision_model." + k: v for k, v in model.state_dict().items()}
    encoder_dir = os.path.join(out_dir, "image_encoder")
    os.makedirs(encoder_dir)
    config.save_pretrained(encoder_dir)
    save_safetensors(os.path.join(encoder_dir, "model.safetensors"), {k: v.half().numpy() for k, v in state.items()}, {"format": "pt"})
    # ComfyUI's single file: the same names plus CLIPVisionModelWithProjection's visual_projection, fp16.
    g = torch.Generator().manual_seed(82)
    comfy = dict(state, **{"visual_projection.weight": torch.randn((16, 24), generator=g) / 24 ** 0.5})
    save_safetensors(os.path.join(out_dir, "clip_vision_tiny.safetensors"), {k: v.half() for k, v in sorted(comfy.items())})
    # diffusers' sibling image_processor/, with non-default sizes; loaded back as WanImageToVideoPipeline loads it.
    processor_dir = os.path.join(out_dir, "image_processor")
    CLIPImageProcessor(size={"shortest_edge": 30}, crop_size={"height": 28, "width": 28}).save_pretrained(processor_dir)
    processor = CLIPImageProcessor.from_pretrained(processor_dir)
    default_processor = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    pad_processor = CLIPImageProcessor(do_resize=False, crop_size={"height": 28, "width": 28})
    assert processor.backend == "pil", f"expected the PIL CLIPImageProcessor (no torchvision), got {type(processor)}"

    # Landscape and portrait images whose long edge 30·long/short has a fraction above .5 (int() and round()
    # differ) and whose crop offsets are halves (floored); a small image that is upscaled, and cropped with padding.
    images = {"landscape": _clip_vision_image(39, 49, 83), "portrait": _clip_vision_image(54, 43, 84),
              "small": _clip_vision_image(20, 25, 85)}
    tensors = {}
    for name, array in images.items():
        Image.fromarray(array).save(os.path.join(out_dir, name + ".png"))
        tensors["image." + name] = array
        image = Image.open(os.path.join(out_dir, name + ".png"))  # what a pipeline user passes
        assert np.array_equal(np.asarray(image), array)
        for kind, p in (("", processor), ("default.", default_processor)):
            if kind == "default." and name != "landscape":
                continue
            pixel_values = p(images=image, return_tensors="pt")["pixel_values"]
            with torch.no_grad():
                out = model(pixel_values=pixel_values, output_hidden_states=True)
            tensors[kind + "pixel_values." + name] = pixel_values.numpy()
            tensors[kind + "penultimate." + name] = out.hidden_states[-2].numpy()
            if kind == "" and name == "landscape":
                tensors["hidden_states_0." + name] = out.hidden_states[0].numpy()
                tensors["hidden_states_last." + name] = out.hidden_states[-1].numpy()
    tensors["pad.pixel_values.small"] = pad_processor(images=Image.fromarray(images["small"]), return_tensors="pt")["pixel_values"].numpy()
    # PIL's resampling filters on their own (LANCZOS 1, BILINEAR 2, BICUBIC 3, BOX 4, HAMMING 5): the landscape
    # image down to 17x23, the small one up to 27x33.
    for resample in (1, 2, 3, 4, 5):
        for name, (height, width) in (("landscape", (17, 23)), ("small", (27, 33))):
            tensors[f"resize.{resample}.{name}"] = np.asarray(Image.fromarray(images[name]).resize((width, height), resample=resample))
    meta = {"versions": versions(transformers, torch, PIL),
            "what": "tiny random CLIPVisionModel with fp16-exact weights (image_encoder/: vision_model.* names, fp16; "
                    "clip_vision_tiny.safetensors: ComfyUI's layout, fp16, same weights) and CLIPImageProcessor.from_pretrained(image_processor/) "
                    "(the PIL backend); for each image.NAME (also NAME.png): pixel_values.NAME = processor(images=PNG), "
                    "penultimate.NAME = model(pixel_values, output_hidden_states=True).hidden_states[-2], hidden_states_0/"
                    "last.landscape the first and last; default.*.landscape: CLIPImageProcessor(size 28, crop 28); "
                    "pad.pixel_values.small: do_resize=False (crop with padding); resize.R.NAME: PIL Image.resize(resample=R) "
                    "of image.NAME, landscape to 17x23, small to 27x33"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)
    print(f"  {sum(p.numel() for p in model.parameters())} parameters, {len(images)} images")


# --------------------------------------------------------------------------------------------------
# vae: a tiny random AutoencoderKL in diffusers' layout, and diffusers' outputs
# --------------------------------------------------------------------------------------------------

def section_vae(out_dir):
    import diffusers
    import torch
    from diffusers import AutoencoderKL

    # Non-default sizes throughout: 3 levels (downscale 4), 3 latent channels, 4 groups, 1 layer per block.
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=3, block_out_channels=(8, 16, 12), layers_per_block=1,
                        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3, norm_num_groups=4,
                        sample_size=32, scaling_factor=0.3)
    _randomize(vae, 3)
    vae.eval()
    folder = os.path.join(out_dir, "tiny")
    os.makedirs(folder)
    vae.save_config(folder)
    save_safetensors(os.path.join(folder, "diffusion_pytorch_model.safetensors"), {k: v.numpy() for k, v in vae.state_dict().items()},
                     {"format": "pt"})
    g = torch.Generator().manual_seed(4)
    images = torch.rand((2, 3, 24, 40), generator=g) * 2 - 1
    latents = torch.randn((2, 3, 7, 9), generator=g)  # unscaled latents, an odd size
    tiled_latents = torch.randn((1, 3, 13, 17), generator=g)
    with torch.no_grad():
        dist = vae.encode(images).latent_dist
        decoded = vae.decode(latents).sample
        # diffusers' tiled decode: 16-pixel tiles (4 latents), overlap factor 0.25 (stride 3 latents, 4-pixel blend).
        vae.enable_tiling()
        vae.tile_sample_min_size, vae.tile_latent_min_size, vae.tile_overlap_factor = 16, 4, 0.25
        tiled = vae.tiled_decode(tiled_latents).sample
        vae.disable_tiling()
        untiled = vae.decode(tiled_latents).sample
    tensors = {"images": images.numpy(), "mean": dist.mean.numpy(), "logvar": dist.logvar.numpy(), "latents": latents.numpy(),
               "decoded": decoded.numpy(), "tiled.latents": tiled_latents.numpy(), "tiled.decoded": tiled.numpy(),
               "tiled.untiled": untiled.numpy()}
    meta = {"versions": versions(diffusers, torch), "tile_sample_min_size": "16", "tile_latent_min_size": "4", "tile_overlap_factor": "0.25",
            "what": "tiny random AutoencoderKL (tiny/): encode(images).latent_dist mean/logvar, decode(latents) (unscaled), and "
                    "tiled_decode at 16-pixel tiles with overlap factor 0.25"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)
    print(f"  encode {tuple(images.shape)} -> {tuple(dist.mean.shape)}, decode {tuple(latents.shape)} -> {tuple(decoded.shape)}, "
          f"tiled {tuple(tiled_latents.shape)} -> {tuple(tiled.shape)} (differs from untiled by {float((tiled - untiled).abs().max()):.3g})")


# --------------------------------------------------------------------------------------------------
# wan_vae: a tiny random AutoencoderKLWan in diffusers' layout and in the original Wan names, and
# diffusers' outputs
# --------------------------------------------------------------------------------------------------

def _wan_original_names(config, state):
    """diffusers' AutoencoderKLWan tensor names -> the original Wan 2.1 names (wan/modules/vae.py, as in
    ComfyUI's wan_2.1_vae.safetensors), for any sizes: the inverse of diffusers' convert_wan_vae_to_diffusers
    written out level by level (that function hard-codes num_res_blocks 2)."""
    residual = {"norm1.gamma": "residual.0.gamma", "conv1.": "residual.2.", "norm2.gamma": "residual.3.gamma",
                "conv2.": "residual.6.", "conv_shortcut.": "shortcut."}
    levels, blocks = len(config["dim_mult"]), config["num_res_blocks"]
    decoder_flat = {}  # (level, "resnets.j" | "upsamplers.0") -> flat index in decoder.upsamples
    k = 0
    for i in range(levels):
        for j in range(blocks + 1):
            decoder_flat[(i, f"resnets.{j}")] = k
            k += 1
        if i + 1 < levels:
            decoder_flat[(i, "upsamplers.0")] = k
            k += 1
    out = {}
    for name, value in state.items():
        n = name
        for side in ("encoder", "decoder"):
            for j, o in ((0, 0), (1, 2)):
                n = n.replace(f"{side}.mid_block.resnets.{j}.", f"{side}.middle.{o}.")
            n = n.replace(f"{side}.mid_block.attentions.0.", f"{side}.middle.1.")
            n = n.replace(f"{side}.norm_out.", f"{side}.head.0.").replace(f"{side}.conv_out.", f"{side}.head.2.")
            n = n.replace(f"{side}.conv_in.", f"{side}.conv1.")
        n = n.replace("encoder.down_blocks.", "encoder.downsamples.")
        if n.startswith("decoder.up_blocks."):
            parts = n.split(".")
            level, rest = int(parts[2]), parts[3:]
            key = ".".join(rest[:2])
            n = "decoder.upsamples." + str(decoder_flat[(level, key)]) + "." + ".".join(rest[2:])
        if n.startswith("quant_conv."):
            n = "conv1." + n[len("quant_conv."):]
        if n.startswith("post_quant_conv."):
            n = "conv2." + n[len("post_quant_conv."):]
        if ".middle.1." not in n and (".downsamples." in n or ".upsamples." in n or ".middle." in n):
            for a, b in residual.items():
                n = n.replace("." + a, "." + b)
        out[n] = value
    assert len(out) == len(state)
    return out


def _wan_randomize(vae, seed):
    """Every parameter redrawn so that outputs depend on every weight: convolutions N(0, 1/fan_in), RMS
    gammas around 1, biases around 0; the decoder's last conv smaller so that few outputs reach the clamp
    to [-1, 1]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(vae.named_parameters()):
            if name.endswith("gamma"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
        vae.decoder.conv_out.weight.mul_(0.3)


def _wan_vae_round_trips(vae, g, z_dim, cases, tensors):
    """For each (frames, (H, W), batch, (h, w)): encode random videos [batch, 3, frames, H, W] and decode random
    latents [1, z_dim, 1 + (frames - 1) / 4, h, w] (drawn from `g` in that order) into tensors["fF.*"]; one
    summary line each."""
    import torch

    summary = []
    for frames, size, batch, latent_size in cases:
        videos = torch.rand((batch, 3, frames, *size), generator=g) * 2 - 1
        dist = vae.encode(videos).latent_dist
        latents = torch.randn((1, z_dim, 1 + (frames - 1) // 4, *latent_size), generator=g)
        decoded = vae.decode(latents).sample
        tensors.update({f"f{frames}.videos": videos.numpy(), f"f{frames}.mean": dist.mean.numpy(), f"f{frames}.logvar": dist.logvar.numpy(),
                        f"f{frames}.latents": latents.numpy(), f"f{frames}.decoded": decoded.numpy()})
        saturated = float((decoded.abs() >= 1).float().mean())
        summary.append(f"{frames} frames: encode {tuple(videos.shape)} -> {tuple(dist.mean.shape)}, decode {tuple(latents.shape)} -> "
                       f"{tuple(decoded.shape)} ({saturated:.0%} clamped)")
    return summary


def section_wan_vae(out_dir):
    import diffusers
    import torch
    from diffusers import AutoencoderKLWan

    # Non-default sizes throughout: base width 4 (decoder 2), widths x[1, 2, 2, 2], one residual block per
    # level, time downsampled at levels 0 and 2 (Wan: 1 and 2), so every resample mode runs; z_dim 16 as Wan
    # (the single-file layout carries no latent statistics and takes Wan 2.1's), non-default statistics here.
    g = torch.Generator().manual_seed(11)
    latents_mean = [round(float(v), 4) for v in torch.randn(16, generator=g) * 0.5]
    latents_std = [round(float(v), 4) for v in torch.rand(16, generator=g) * 2 + 0.5]
    config = dict(base_dim=4, decoder_base_dim=2, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                  temperal_downsample=[True, False, True], latents_mean=latents_mean, latents_std=latents_std)
    vae = AutoencoderKLWan(**config)
    _wan_randomize(vae, 12)
    vae.eval()
    folder = os.path.join(out_dir, "tiny")
    os.makedirs(folder)
    vae.save_config(folder)
    state = {k: v.numpy() for k, v in vae.state_dict().items()}
    save_safetensors(os.path.join(folder, "diffusion_pytorch_model.safetensors"), state, {"format": "pt"})
    original = _wan_original_names(config, state)
    # The rename table against diffusers' own single-file converter, which hard-codes Wan 2.1's layout
    # (num_res_blocks 2, four levels): on a model of that layout every original name converts back.
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    wan21 = dict(base_dim=2, z_dim=16)
    wan21_state = {k: v.numpy() for k, v in AutoencoderKLWan(**wan21).state_dict().items()}
    back = convert_wan_vae_to_diffusers(_wan_original_names(dict(dim_mult=[1, 2, 4, 4], num_res_blocks=2), wan21_state))
    assert sorted(back) == sorted(wan21_state), "the original names do not convert back with diffusers' converter"
    save_safetensors(os.path.join(out_dir, "wan_2.1_vae_tiny.safetensors"), original)

    tensors = {}
    with torch.no_grad():
        summary = _wan_vae_round_trips(vae, g, 16, ((1, (16, 24), 1, (3, 3)), (5, (16, 24), 2, (3, 3)), (9, (8, 16), 1, (2, 2))),
                                       tensors)
        # diffusers' tiled encode and decode: 16-pixel tiles every 8 pixels, on 40 x 24 frames (not a multiple of
        # the tile): 3 x 5 tiles, 1-latent / 8-pixel blends.
        videos = torch.rand((1, 3, 5, 24, 40), generator=g) * 2 - 1
        latents = torch.randn((1, 16, 2, 3, 5), generator=g)
        vae.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8, tile_sample_stride_width=8)
        tiled_mean = vae.encode(videos).latent_dist.mean
        tiled_decoded = vae.decode(latents).sample
        vae.disable_tiling()
        untiled_mean = vae.encode(videos).latent_dist.mean
        untiled_decoded = vae.decode(latents).sample
    tensors.update({"tiled.videos": videos.numpy(), "tiled.latents": latents.numpy(), "tiled.mean": tiled_mean.numpy(),
                    "tiled.decoded": tiled_decoded.numpy(), "tiled.untiled_mean": untiled_mean.numpy(),
                    "tiled.untiled_decoded": untiled_decoded.numpy()})
    summary.append(f"tiled: mean differs from untiled by {float((tiled_mean - untiled_mean).abs().max()):.3g}, decode by "
                   f"{float((tiled_decoded - untiled_decoded).abs().max()):.3g}")
    meta = {"versions": versions(diffusers, torch), "tile_sample_min": "16", "tile_sample_stride": "8",
            "what": "tiny random AutoencoderKLWan (tiny/, and wan_2.1_vae_tiny.safetensors with the original Wan names): "
                    "encode(videos).latent_dist mean/logvar and decode(latents).sample for 1, 5 and 9 frames; tiled encode/decode "
                    "with 16-pixel tiles every 8 pixels and the same untiled"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)
    for line in summary:
        print("  " + line)


# --------------------------------------------------------------------------------------------------
# wan22_vae: a tiny random Wan2.2-style AutoencoderKLWan (residual blocks, 2x2 patches) in diffusers'
# layout and in the original Wan2.2 names, and diffusers' outputs
# --------------------------------------------------------------------------------------------------

def _wan22_original_names(config, state):
    """diffusers' AutoencoderKLWan tensor names (is_residual=True) -> the original Wan2.2 names (Wan2.2's
    wan/modules/vae2_2.py, as in Wan2.2_VAE.pth and ComfyUI's wan2.2_vae.safetensors; the inverse of the
    convert_vae_22 mapping in diffusers' scripts/convert_wan_to_diffusers.py). Each level is one
    Down_ResidualBlock / Up_ResidualBlock whose own `downsamples` / `upsamples` list holds the residual
    blocks and then the resample."""
    import re

    residual = {"norm1.gamma": "residual.0.gamma", "conv1.": "residual.2.", "norm2.gamma": "residual.3.gamma",
                "conv2.": "residual.6.", "conv_shortcut.": "shortcut."}
    blocks = config["num_res_blocks"]
    out = {}
    for name, value in state.items():
        n = name
        for side in ("encoder", "decoder"):
            for j, o in ((0, 0), (1, 2)):
                n = n.replace(f"{side}.mid_block.resnets.{j}.", f"{side}.middle.{o}.")
            n = n.replace(f"{side}.mid_block.attentions.0.", f"{side}.middle.1.")
            n = n.replace(f"{side}.norm_out.", f"{side}.head.0.").replace(f"{side}.conv_out.", f"{side}.head.2.")
            n = n.replace(f"{side}.conv_in.", f"{side}.conv1.")
        m = re.match(r"encoder\.down_blocks\.(\d+)\.(?:resnets\.(\d+)|downsampler)\.(.*)", n)
        if m:
            n = f"encoder.downsamples.{m[1]}.downsamples.{m[2] if m[2] is not None else blocks}.{m[3]}"
        m = re.match(r"decoder\.up_blocks\.(\d+)\.(?:resnets\.(\d+)|upsampler)\.(.*)", n)
        if m:
            n = f"decoder.upsamples.{m[1]}.upsamples.{m[2] if m[2] is not None else blocks + 1}.{m[3]}"
        if n.startswith("quant_conv."):
            n = "conv1." + n[len("quant_conv."):]
        if n.startswith("post_quant_conv."):
            n = "conv2." + n[len("post_quant_conv."):]
        if ".middle.1." not in n and (".downsamples." in n or ".upsamples." in n or ".middle." in n):
            for a, b in residual.items():
                n = n.replace("." + a, "." + b)
        assert n not in out, f"two tensors named {n}"
        out[n] = value
    return out


def section_wan22_vae(out_dir):
    import diffusers
    import torch
    from diffusers import AutoencoderKLWan

    # Wan2.2's architecture (residual down/up blocks with their averaging / duplicating shortcuts, 2x2
    # patches: 12 channels in and out) at sizes no published model has: base width 4, decoder 2, widths
    # x[2, 1, 2, 1] (each level's shortcut averages or repeats channel groups of a different size), one
    # residual block per level, time downsampled at levels 0 and 2 (Wan2.2: 1 and 2), z_dim 8.
    g = torch.Generator().manual_seed(21)
    latents_mean = [round(float(v), 4) for v in torch.randn(8, generator=g) * 0.5]
    latents_std = [round(float(v), 4) for v in torch.rand(8, generator=g) * 2 + 0.5]
    config = dict(base_dim=4, decoder_base_dim=2, z_dim=8, dim_mult=[2, 1, 2, 1], num_res_blocks=1,
                  temperal_downsample=[True, False, True], is_residual=True, patch_size=2, in_channels=12, out_channels=12,
                  scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=latents_mean, latents_std=latents_std)
    vae = AutoencoderKLWan(**config)
    _wan_randomize(vae, 22)
    vae.eval()
    folder = os.path.join(out_dir, "tiny")
    os.makedirs(folder)
    vae.save_config(folder)
    state = {k: v.numpy() for k, v in vae.state_dict().items()}
    save_safetensors(os.path.join(folder, "diffusion_pytorch_model.safetensors"), state, {"format": "pt"})
    original = _wan22_original_names(config, state)
    assert len(original) == len(state)
    save_safetensors(os.path.join(out_dir, "wan2.2_vae_tiny.safetensors"), original)

    # Frames are multiples of 16 pixels (2x2 patches, then 8x down). 1 frame (the first chunk alone), 5 (first +
    # one chunk of 4, batch 2 when encoding) and 9 (first + two chunks).
    tensors = {}
    with torch.no_grad():
        summary = _wan_vae_round_trips(vae, g, 8, ((1, (16, 32), 1, (1, 2)), (5, (16, 16), 2, (2, 1)), (9, (16, 16), 1, (1, 1))),
                                       tensors)
        # diffusers' tiled encode and decode. Encoding, diffusers measures tiles on the patchified frame: tiles of 16
        # every 8 there (32 every 16 pixels) on 32 x 48 pixels (16 x 24 patchified): 2 x 3 tiles, the last ones cut
        # short, blended over 1 latent. Decoding, tiles of 32 pixels every 16 (2 latents every 1) on 2 x 3 latents
        # (32 x 48 pixels): 2 x 3 tiles, blended over 8 patchified pixels (16 pixels).
        videos = torch.rand((1, 3, 5, 32, 48), generator=g) * 2 - 1
        latents = torch.randn((1, 8, 2, 2, 3), generator=g)
        vae.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=8, tile_sample_stride_width=8)
        tiled_dist = vae.encode(videos).latent_dist
        vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16, tile_sample_stride_width=16)
        tiled_decoded = vae.decode(latents).sample
        vae.disable_tiling()
        untiled_mean = vae.encode(videos).latent_dist.mean
        untiled_decoded = vae.decode(latents).sample
    tensors.update({"tiled.videos": videos.numpy(), "tiled.latents": latents.numpy(), "tiled.mean": tiled_dist.mean.numpy(),
                    "tiled.logvar": tiled_dist.logvar.numpy(), "tiled.decoded": tiled_decoded.numpy(),
                    "tiled.untiled_mean": untiled_mean.numpy()})
    summary.append(f"tiled: mean differs from untiled by {float((tiled_dist.mean - untiled_mean).abs().max()):.3g}, decode by "
                   f"{float((tiled_decoded - untiled_decoded).abs().max()):.3g}")
    meta = {"versions": versions(diffusers, torch), "encode_tile_sample_min": "16", "encode_tile_sample_stride": "8",
            "decode_tile_sample_min": "32", "decode_tile_sample_stride": "16",
            "what": "tiny random Wan2.2-style AutoencoderKLWan (tiny/, and wan2.2_vae_tiny.safetensors with the original Wan2.2 names): "
                    "encode(videos).latent_dist mean/logvar and decode(latents).sample for 1, 5 and 9 frames; tiled encode "
                    "(tile_sample_min 16, stride 8) and decode (32, 16), and the untiled encode of the tiled input"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)
    for line in summary:
        print("  " + line)


# --------------------------------------------------------------------------------------------------
# wan: tiny random WanTransformer3DModels in the diffusers and the original layouts, forward outputs and
# one flow-matching training step's gradients
# --------------------------------------------------------------------------------------------------

# diffusers' parameter name -> the original Wan / ComfyUI name (blocks.N. prefixes kept as they are). The
# cross-attention LayerNorm is diffusers' norm2 but the original norm3.
_WAN_ORIGINAL_NAMES = [
    ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
    ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
    ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
    ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
    ("condition_embedder.time_proj.", "time_projection.1."),
    (".attn1.", ".self_attn."), (".attn2.", ".cross_attn."),
    (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."), (".to_out.0.", ".o."),
    (".norm2.", ".norm3."),
    (".ffn.net.0.proj.", ".ffn.0."), (".ffn.net.2.", ".ffn.2."),
    ("proj_out.", "head.head."),
]


def _wan_original_name(name):
    if name == "scale_shift_table":
        return "head.modulation"
    if name.endswith(".scale_shift_table"):
        return name[: -len("scale_shift_table")] + "modulation"
    for a, b in _WAN_ORIGINAL_NAMES:
        name = name.replace(a, b) if a.startswith(".") else (b + name[len(a):] if name.startswith(a) else name)
    return name


# Two tiny models of sizes no published model has: the head size, its RoPE split, the patch and the
# channels all differ from Wan's; "a" has both qk-norm and the cross-attention norm, "b" neither.
_WAN_MODELS = {
    "a": dict(config=dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                          text_dim=20, freq_dim=16, ffn_dim=40, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                          eps=1e-6),
              video=(2, 4, 3, 6, 8), text=(2, 7, 20), dtype="bf16", seed=11),
    "b": dict(config=dict(patch_size=(2, 1, 2), num_attention_heads=3, attention_head_dim=8, in_channels=3, out_channels=3,
                          text_dim=12, freq_dim=10, ffn_dim=20, num_layers=3, cross_attn_norm=False, qk_norm=None, eps=1e-5),
              video=(2, 3, 4, 5, 6), text=(2, 5, 12), dtype="fp16", seed=12),
}


def _wan_original_config(c):
    """Wan's own config.json (WanModel's arguments) for a diffusers config."""
    return {"_class_name": "WanModel", "model_type": "t2v", "patch_size": list(c["patch_size"]), "text_len": 512, "in_dim": c["in_channels"],
            "dim": c["num_attention_heads"] * c["attention_head_dim"], "ffn_dim": c["ffn_dim"], "freq_dim": c["freq_dim"],
            "text_dim": c["text_dim"], "out_dim": c["out_channels"], "num_heads": c["num_attention_heads"], "num_layers": c["num_layers"],
            "window_size": [-1, -1], "qk_norm": c["qk_norm"] is not None, "cross_attn_norm": c["cross_attn_norm"], "eps": c["eps"]}


def _save_sharded(folder, tensors, shards):
    """diffusers' sharded layout: diffusion_pytorch_model-0000i-of-0000n.safetensors and the index."""
    names = sorted(tensors)
    weight_map, total = {}, 0
    for i in range(shards):
        part = names[i * len(names) // shards:(i + 1) * len(names) // shards]
        file = f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_safetensors(os.path.join(folder, file), {k: tensors[k] for k in part}, {"format": "pt"})
        for k in part:
            weight_map[k] = file
            total += tensors[k].nbytes
    with open(os.path.join(folder, "diffusion_pytorch_model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


def section_wan(out_dir):
    import diffusers
    import torch
    from diffusers import WanTransformer3DModel

    tensors = {}
    for key, spec in _WAN_MODELS.items():
        c = spec["config"]
        model = WanTransformer3DModel(**c)
        if c["qk_norm"] is None:
            # diffusers' WanAttention builds the q/k RMSNorms whatever qk_norm says; Wan's own model has none
            # with qk_norm false (nn.Identity): the reference without them.
            for block in model.blocks:
                for attn in (block.attn1, block.attn2):
                    attn.norm_q, attn.norm_k = torch.nn.Identity(), torch.nn.Identity()
        _randomize(model, spec["seed"])
        # The published files are bf16 or fp16: round the weights to the file's dtype so that every layout
        # below holds exactly the model whose outputs are recorded.
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec["dtype"]]
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(low).float())
        model.eval()
        state = {k: v.detach() for k, v in model.state_dict().items()}
        folder = os.path.join(out_dir, key)
        os.makedirs(os.path.join(folder, "diffusers", "transformer"))
        os.makedirs(os.path.join(folder, "original"))
        # diffusers' layout: transformer/config.json, fp32 weights in two shards with their index.
        model.save_config(os.path.join(folder, "diffusers", "transformer"))
        _save_sharded(os.path.join(folder, "diffusers", "transformer"), {k: v.numpy() for k, v in state.items()}, 2)
        # Wan-AI's layout: Wan's config.json and one file of original names in the low precision; and
        # ComfyUI's: the same single file with the model.diffusion_model. prefix and no config.json.
        original = {_wan_original_name(k): v.to(low) for k, v in state.items()}
        with open(os.path.join(folder, "original", "config.json"), "w") as f:
            json.dump(_wan_original_config(c), f, indent=2, sort_keys=True)
        save_safetensors(os.path.join(folder, "original", "diffusion_pytorch_model.safetensors"), original, {"format": "pt"})
        if key == "a":
            save_safetensors(os.path.join(folder, "comfyui.safetensors"), {"model.diffusion_model." + k: v for k, v in original.items()},
                             {"format": "pt"})

        g = torch.Generator().manual_seed(spec["seed"] + 100)
        x = torch.randn(spec["video"], generator=g)
        text = torch.randn(spec["text"], generator=g)
        timesteps = torch.tensor([937.5, 12.25])
        with torch.no_grad():
            out = model(x, timesteps, text, return_dict=False)[0]
        tensors[f"{key}.x"], tensors[f"{key}.timesteps"], tensors[f"{key}.text"] = x.numpy(), timesteps.numpy(), text.numpy()
        tensors[f"{key}.out"] = out.numpy()

        # One flow-matching training step: x_t = (1 - σ)·x0 + σ·ε, t = 1000·σ, MSE against ε - x0.
        x0, noise = torch.randn(spec["video"], generator=g), torch.randn(spec["video"], generator=g)
        sigma = torch.tensor([0.8125, 0.3])
        s = sigma.view(-1, 1, 1, 1, 1)
        model.zero_grad()
        prediction = model((1 - s) * x0 + s * noise, sigma * 1000, text, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(prediction, noise - x0)
        loss.backward()
        tensors[f"{key}.train.x0"], tensors[f"{key}.train.noise"], tensors[f"{key}.train.sigma"] = x0.numpy(), noise.numpy(), sigma.numpy()
        tensors[f"{key}.train.loss"] = np.array([loss.item()], dtype=np.float64)
        for name, p in model.named_parameters():
            tensors[f"{key}.grad.{name}"] = p.grad.numpy()
        print(f"  {key}: {sum(p.numel() for p in model.parameters())} parameters, out {tuple(out.shape)}, loss {loss.item():.5f}")
    meta = {"versions": versions(diffusers, torch), "models": json.dumps({k: v["config"] for k, v in _WAN_MODELS.items()}),
            "what": "tiny random WanTransformer3DModels (K/diffusers/transformer: config.json and two fp32 shards; K/original: Wan's "
                    "config.json and original names in bf16 (a) or fp16 (b); K/comfyui.safetensors: the same with the "
                    "model.diffusion_model. prefix, a only); K.out = model(K.x, K.timesteps, K.text); K.grad.NAME: the gradients of "
                    "mse(model((1-s)x0 + s noise, 1000 s, text), noise - x0) for K.train.*"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)


def _wan_dit_fixture(out_dir, config, seed):
    """A tiny random WanTransformer3DModel of `config` (fp32, eval mode), saved as out_dir/transformer/."""
    from diffusers import WanTransformer3DModel

    transformer = WanTransformer3DModel(**config)
    _randomize(transformer, seed)
    transformer.eval()
    folder = os.path.join(out_dir, "transformer")
    os.makedirs(folder)
    transformer.save_config(folder)
    save_safetensors(os.path.join(folder, "diffusion_pytorch_model.safetensors"),
                     {k: v.detach().numpy() for k, v in transformer.state_dict().items()}, {"format": "pt"})
    return transformer


def _umt5_fixture():
    """The committed umt5 fixture's encoder (eager attention, eval mode) and tokenizer."""
    from transformers import T5Tokenizer, UMT5EncoderModel

    text_encoder = UMT5EncoderModel.from_pretrained(os.path.join(FIXTURES, "umt5", "hf"), attn_implementation="eager").eval()
    return text_encoder, T5Tokenizer.from_pretrained(os.path.join(FIXTURES, "umt5", "tokenizer"), extra_ids=0)


def _training_step(model, forward, target, tensors):
    """One mse step of `model` (forward() its output) against `target`: target, loss and grad.NAME into `tensors`."""
    import torch

    model.zero_grad()
    loss = torch.nn.functional.mse_loss(forward(), target)
    loss.backward()
    tensors["target"], tensors["loss"] = target.numpy(), np.array([loss.item()], dtype=np.float64)
    for name, p in model.named_parameters():
        tensors["grad." + name] = p.grad.numpy()
    print(f"  {sum(p.numel() for p in model.parameters())} parameters, loss {loss.item():.5f}")


def section_wan_i2v(out_dir):
    """Wan2.1 I2V's DiT: a tiny random WanTransformer3DModel with the image branch (image_dim 10, added key/value
    projections of width 24), 12 input channels (noise, mask and condition latents of 4 channels: 4 + 4 + 4) and
    4 out; 512 text tokens (diffusers splits the context at its last 512); its output and one training step's
    gradients."""
    import diffusers
    import torch

    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=12, out_channels=4,
                  text_dim=20, freq_dim=16, ffn_dim=40, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                  eps=1e-6, image_dim=10, added_kv_proj_dim=24, rope_max_seq_len=1024)
    model = _wan_dit_fixture(out_dir, config, 71)

    g = torch.Generator().manual_seed(72)
    x = torch.randn((2, 12, 3, 4, 6), generator=g)
    text = torch.randn((2, 512, 20), generator=g)
    image = torch.randn((2, 5, 10), generator=g)
    timesteps = torch.tensor([812.5, 437.25])
    with torch.no_grad():
        out = model(x, timesteps, text, encoder_hidden_states_image=image, return_dict=False)[0]
    tensors = {"x": x.numpy(), "text": text.numpy(), "image": image.numpy(), "timesteps": timesteps.numpy(),
               "out": out.numpy()}
    _training_step(model, lambda: model(x, timesteps, text, encoder_hidden_states_image=image, return_dict=False)[0],
                   torch.randn((2, 4, 3, 4, 6), generator=g), tensors)
    meta = {"versions": versions(diffusers, torch), "config": json.dumps(config),
            "what": "a tiny random Wan2.1-I2V-shaped WanTransformer3DModel (transformer/); out = model(x, timesteps, "
                    "text, encoder_hidden_states_image=image); grad.NAME of mse(model(...), target)"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)


def section_wan_ti2v(out_dir):
    """Wan2.2 TI2V's per-token timesteps (diffusers' expand_timesteps): a tiny random WanTransformer3DModel of
    12 latent channels given timesteps [B, N], one per token; its output and one training step's gradients."""
    import diffusers
    import torch
    from diffusers import WanTransformer3DModel

    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=12, out_channels=12,
                  text_dim=20, freq_dim=16, ffn_dim=40, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                  eps=1e-6, rope_max_seq_len=1024)
    model = _wan_dit_fixture(out_dir, config, 61)

    g = torch.Generator().manual_seed(62)
    video, text_shape = (2, 12, 3, 4, 6), (2, 7, 20)
    tokens = 3 * 2 * 3
    x, text = torch.randn(video, generator=g), torch.randn(text_shape, generator=g)
    # Image-to-video's mask (the first latent frame clean: its 6 tokens at 0) on sample 0; one timestep for
    # every token of sample 1 (what text-to-video gives).
    per_token = torch.full((2, tokens), 437.25)
    per_token[0] = 812.5
    per_token[0, :6] = 0.0
    with torch.no_grad():
        out = model(x, per_token, text, return_dict=False)[0]
        out_scalar = model(x, torch.tensor([812.5, 437.25]), text, return_dict=False)[0]
    tensors = {"x": x.numpy(), "text": text.numpy(), "timesteps": per_token.numpy(), "out": out.numpy(),
               "out_scalar_timesteps": out_scalar.numpy()}
    _training_step(model, lambda: model(x, per_token, text, return_dict=False)[0], torch.randn(video, generator=g),
                   tensors)
    meta = {"versions": versions(diffusers, torch), "config": json.dumps(config),
            "what": "a tiny random WanTransformer3DModel (transformer/); out = model(x, timesteps [2, 18] per token, text); "
                    "out_scalar_timesteps = model(x, [812.5, 437.25], text); grad.NAME of mse(model(x, timesteps, text), target)"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)


def section_ti2v_pipeline(out_dir):
    """Wan2.2 TI2V's image-to-video: WanImageToVideoPipeline(expand_timesteps=True) on the tiny umt5 and wan22_vae
    fixtures and a tiny random DiT sized to them (text_dim 24, 8 latent channels): the first latent frame is the
    image's, kept clean, its tokens at timestep 0."""
    import diffusers
    import torch
    import transformers
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import T5Tokenizer

    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=8, out_channels=8, text_dim=24,
                  freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                  rope_max_seq_len=1024)
    transformer = _wan_dit_fixture(out_dir, config, 71)
    text_encoder, tokenizer = _umt5_fixture()
    vae = AutoencoderKLWan.from_pretrained(os.path.join(FIXTURES, "wan22_vae", "tiny")).eval()

    frames, height, width, steps, shift, guidance, seed = 9, 64, 96, 4, 5.0, 5.0, 11
    prompt = "a red blob moves left quickly"
    # The first frame: smooth colours in [0, 1] at the video's size (no resizing in the pipeline).
    yy, xx = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    image = torch.stack([0.5 + 0.4 * torch.sin(6 * xx), 0.5 + 0.4 * torch.cos(5 * yy), 0.3 + 0.6 * xx * yy]).unsqueeze(0)
    tensors = {"image": (image[0] * 2 - 1).numpy()}  # what the pipeline encodes: [-1, 1]
    for kind in ("unipc", "euler"):
        pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=_wan_scheduler(kind, shift),
                                       transformer=transformer, expand_timesteps=True)
        pipe.set_progress_bar_config(disable=True)
        with torch.no_grad():
            latents = pipe(image=image, prompt=prompt, negative_prompt=WAN_NEGATIVE_PROMPT, height=height, width=width,
                           num_frames=frames, num_inference_steps=steps, guidance_scale=guidance,
                           generator=torch.Generator().manual_seed(seed), output_type="latent", max_sequence_length=512).frames
        tensors[f"{kind}.latents"] = latents.numpy()
    meta = {"versions": versions(diffusers, transformers, torch), "config": json.dumps(config), "prompt": prompt, "seed": str(seed),
            "negative_prompt": WAN_NEGATIVE_PROMPT,
            "sampling": json.dumps({"frames": frames, "height": height, "width": width, "steps": steps, "shift": shift,
                                    "guidance": guidance}),
            "what": "transformer/: a tiny random WanTransformer3DModel (fp32, 8 channels); WanImageToVideoPipeline(expand_timesteps=True, "
                    "T5Tokenizer(umt5/tokenizer), umt5/hf, wan22_vae/tiny, UniPC or Euler with flow shift) of `image` (in [-1, 1]) "
                    "and the prompt with Wan's negative prompt, generator manual_seed(seed): output_type='latent' latents"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)
    print(f"  {sum(p.numel() for p in transformer.parameters())} DiT parameters, latents {tuple(latents.shape)}")


# --------------------------------------------------------------------------------------------------
# flow: diffusers' flow-matching samplers (Euler with shift, UniPC with flow sigmas as Wan uses it)
# --------------------------------------------------------------------------------------------------

def section_flow(out_dir):
    import diffusers
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    def unipc(steps, shift, order, solver, T=1000):
        sched = UniPCMultistepScheduler(num_train_timesteps=T, solver_order=order, prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=shift, solver_type=solver, predict_x0=True, lower_order_final=True,
                                        final_sigmas_type="zero")
        sched.set_timesteps(steps)
        return sched

    tensors, tables, trajectories = {}, [], []
    # Tables at step counts from 1 up, shifts of Wan's samplers (3 for 480p, 5 for 720p) and others, and
    # another number of training timesteps.
    for T in (1000, 37):
        for shift in (1.0, 3.0, 5.0, 7.3):
            for steps in (1, 2, 7, 30, 50):
                if steps > T:
                    continue
                euler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=T, shift=shift)
                euler.set_timesteps(steps)
                name = f"euler.T{T}.shift{shift}.S{steps}"
                tensors[name + ".sigmas"] = euler.sigmas.numpy()
                tensors[name + ".timesteps"] = euler.timesteps.numpy()
                u = unipc(steps, shift, 2, "bh2", T)
                uname = f"unipc.T{T}.shift{shift}.S{steps}"
                tensors[uname + ".sigmas"] = u.sigmas.numpy()
                tensors[uname + ".timesteps"] = u.timesteps.numpy()
                tables.append({"T": T, "shift": shift, "steps": steps, "euler": name, "unipc": uname})

    # Whole sampling runs at fixed inputs: the model outputs of every step are drawn in advance, so the
    # C++ sampler replays them and each step's result is compared (UniPC's steps depend on its history).
    g = torch.Generator().manual_seed(5)
    shape = (2, 3, 2, 4)
    runs = [("euler", 10, 5.0, 0, ""), ("euler", 4, 3.0, 0, ""), ("unipc", 10, 5.0, 2, "bh2"), ("unipc", 7, 3.0, 1, "bh2"),
            ("unipc", 9, 5.0, 3, "bh2"), ("unipc", 6, 3.0, 2, "bh1"), ("unipc", 8, 1.0, 3, "bh1"), ("unipc", 1, 5.0, 2, "bh2")]
    for kind, steps, shift, order, solver in runs:
        sched = FlowMatchEulerDiscreteScheduler(shift=shift) if kind == "euler" else unipc(steps, shift, order, solver)
        if kind == "euler":
            sched.set_timesteps(steps)
        name = f"run{len(trajectories)}"
        x = torch.randn(shape, generator=g)
        tensors[name + ".x"] = x.numpy()
        for i, t in enumerate(sched.timesteps):
            v = torch.randn(shape, generator=g) + 0.3 * x  # a velocity that depends on the sample
            x = sched.step(v, t, x).prev_sample
            tensors[f"{name}.v{i}"] = v.numpy()
            tensors[f"{name}.x{i + 1}"] = x.numpy()
        # diffusers' bh1 solver with final_sigmas_type "zero" multiplies -inf by 0 at the last step: NaN.
        trajectories.append({"name": name, "kind": kind, "steps": steps, "shift": shift, "order": order, "solver": solver,
                             "last_step_nan": bool(torch.isnan(x).any())})
    meta = {"versions": versions(diffusers, torch), "tables": json.dumps(tables), "runs": json.dumps(trajectories),
            "what": "FlowMatchEulerDiscreteScheduler(num_train_timesteps=T, shift) and UniPCMultistepScheduler(use_flow_sigmas=True, "
                    "prediction_type='flow_prediction', flow_shift, solver_order, solver_type, lower_order_final=True, "
                    "final_sigmas_type='zero'): set_timesteps tables (sigmas, timesteps) and whole runs of step() at recorded "
                    "model outputs (runK.x, runK.vI, runK.xI+1)"}
    save_safetensors(os.path.join(out_dir, "diffusers.safetensors"), tensors, meta)
    print(f"  {len(tables)} table pairs, {len(trajectories)} sampling runs")


# --------------------------------------------------------------------------------------------------
# loss_weighting: Min-SNR-γ weights (diffusers' compute_snr and its training scripts' recipe) and SD3's flow weights
# --------------------------------------------------------------------------------------------------

def section_loss_weighting(out_dir):
    import diffusers
    import torch
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_loss_weighting_for_sd3, compute_snr

    tensors, schedules = {}, []
    t_all = [0, 1, 2, 3, 5, 10, 50, 100, 250, 500, 750, 900, 998, 999]
    for beta, T, beta_start, beta_end in (("linear", 1000, 1e-4, 0.02), ("cosine", 1000, 1e-4, 0.02), ("linear", 37, 1e-3, 0.05)):
        sched = DDPMScheduler(num_train_timesteps=T, beta_start=beta_start, beta_end=beta_end, beta_schedule=_BETAS[beta])
        # diffusers keeps betas and their cumulative product in float32, where 1 - alphas_cumprod at the first
        # timesteps keeps only three digits; the product of its betas in float64 is the same schedule without that
        # rounding (MegaSlide's tables are float64).
        sched.alphas_cumprod = torch.cumprod(1.0 - sched.betas.double(), 0)
        timesteps = torch.tensor([t for t in t_all if t < T], dtype=torch.int64)
        snr = compute_snr(sched, timesteps).double()
        name = f"ddpm.{beta}.T{T}"
        tensors[name + ".timesteps"] = timesteps.numpy()
        tensors[name + ".snr"] = snr.numpy()
        for gamma in (1.0, 5.0, 20.0):
            # The recipe of diffusers' training scripts (train_text_to_image.py, --snr_gamma): min(SNR, γ), divided
            # by SNR for epsilon and by SNR + 1 for v_prediction; x0 ("sample") keeps min(SNR, γ).
            base = torch.stack([snr, gamma * torch.ones_like(snr)], dim=1).min(dim=1)[0]
            for prediction, weights in (("epsilon", base / snr), ("v", base / (snr + 1)), ("x0", base)):
                tensors[f"{name}.{prediction}.gamma{gamma:g}"] = weights.numpy()
        schedules.append({"name": name, "beta_schedule": beta, "timesteps": T, "beta_start": beta_start, "beta_end": beta_end})
    sigmas = torch.tensor([1e-3, 0.01, 0.1, 0.25, 0.5, 0.6, 0.75, 0.9, 0.999, 1.0], dtype=torch.float64)
    tensors["flow.sigmas"] = sigmas.numpy()
    for scheme in ("sigma_sqrt", "cosmap"):
        tensors[f"flow.{scheme}"] = compute_loss_weighting_for_sd3(scheme, sigmas.clone()).double().numpy()
    meta = {"versions": versions(diffusers, torch), "schedules": json.dumps(schedules), "gammas": json.dumps([1.0, 5.0, 20.0]),
            "what": "diffusers' compute_snr over DDPMScheduler's betas (cumulative product in float64) and the Min-SNR-gamma "
                    "weights of its training scripts per prediction type; compute_loss_weighting_for_sd3 (sigma_sqrt, cosmap)"}
    save_safetensors(os.path.join(out_dir, "diffusers.safetensors"), tensors, meta)
    print(f"  {len(schedules)} schedules, {len(sigmas)} sigmas")


# --------------------------------------------------------------------------------------------------
# umt5_tokenizer: a tiny SentencePiece model and transformers' T5Tokenizer ids (umT5's tokenizer class)
# --------------------------------------------------------------------------------------------------

_UMT5_EXTRA_PROMPTS = [
    "</s> written in the text, and <pad> and <unk> too",
    "a prompt that ends with the end token</s>",
    "<unk><unk> twice then text",
    "multiple   spaces    inside   and\ttabs\t\there",
    "   leading spaces and trailing ones   ",
    "▁already has a meta space ▁ and ▁▁ two",
    "mixed 中文 and English words 和 日本語 テキスト",
    "一只熊猫在竹林里吃竹子，阳光明媚",
    "비가 오는 날의 서울 거리 풍경",
    "rare script: ᚠᚢᚦᚨᚱᚲ ꦲꦏ and math 𝔸𝔹ℂ ∑∫√∞",
    "long " + " ".join(["a camera slowly pans across a mountain valley at sunrise with fog"] * 60),
]


def _umt5_prompts():
    return _vbench_prompts() + _EDGE_PROMPTS + _UMT5_EXTRA_PROMPTS


def _train_tiny_spiece(path_prefix, corpus, vocab_size=700, normalization="nmt_nfkc"):
    """A tiny unigram SentencePiece model as umT5's is configured: pad 0, eos 1, unk 2 (no bos), NFKC-based
    nmt normalisation (its character map is 240 kB: "identity" makes a model of a few kB), dummy prefix,
    extra white space removed; rare characters (emoji, rare scripts) left out of the vocabulary so that
    they come out as <unk>."""
    import sentencepiece as spm

    text = os.path.join(os.path.dirname(path_prefix), "corpus.txt")
    with open(text, "w", encoding="utf-8") as f:
        for line in corpus:
            f.write(" ".join(line.split()) + "\n")
    spm.SentencePieceTrainer.train(input=text, model_prefix=path_prefix, model_type="unigram", vocab_size=vocab_size, hard_vocab_limit=False,
                                   character_coverage=0.995, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   normalization_rule_name=normalization, add_dummy_prefix=True, remove_extra_whitespaces=True,
                                   split_by_whitespace=True, num_threads=1, seed_sentencepiece_size=100000, shuffle_input_sentence=False,
                                   minloglevel=2)
    os.remove(text)


def _umt5_tokenize(spiece_dir, prompts, max_length=512):
    """transformers' tokenizer for umT5 (T5Tokenizer) called as Wan calls it: padding to 512, truncation,
    the end token appended, attention mask returned."""
    from transformers import T5Tokenizer

    tokenizer = T5Tokenizer.from_pretrained(spiece_dir, extra_ids=0)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    out = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True, add_special_tokens=True,
                    return_attention_mask=True)
    return np.array(out["input_ids"], dtype=np.int64), np.array(out["attention_mask"], dtype=np.int64)


def section_umt5_tokenizer(out_dir):
    import sentencepiece
    import transformers

    prompts = _umt5_prompts()
    # Trained on other text than the prompts it is checked on: VBench's prompts beyond the first few of
    # each dimension, in several languages' worth of the edge prompts' characters.
    import importlib.util

    spec = importlib.util.find_spec("vbench")
    with open(os.path.join(spec.submodule_search_locations[0], "VBench_full_info.json"), encoding="utf-8") as f:
        corpus = [e["prompt_en"] for e in json.load(f)][200:1200]
    corpus += [p for p in _EDGE_PROMPTS + _UMT5_EXTRA_PROMPTS if p.strip()][::2]
    _train_tiny_spiece(os.path.join(out_dir, "spiece"), corpus)
    os.remove(os.path.join(out_dir, "spiece.vocab"))
    ids, mask = _umt5_tokenize(out_dir, prompts)
    import re

    # The white-space step of Wan's prompt cleaning (diffusers' WanPipeline, Wan's own code): \s+ -> " ", strip.
    cleaned = [re.sub(r"\s+", " ", p).strip() for p in prompts]
    meta = {"versions": versions(transformers, sentencepiece), "prompts": json.dumps(prompts, ensure_ascii=False),
            "cleaned": json.dumps(cleaned, ensure_ascii=False),
            "what": "T5Tokenizer.from_pretrained(this folder, extra_ids=0)(prompts, padding='max_length', max_length=512, "
                    "truncation=True): ids and attention_mask, with the tiny spiece.model trained here; cleaned: "
                    "re.sub(r'\\s+', ' ', prompt).strip() of each prompt"}
    # int32 ids and uint8 mask: 116 prompts of 512 tokens stay under 300 kB.
    save_safetensors(os.path.join(out_dir, "ids.safetensors"), {"ids": ids.astype(np.int32), "mask": mask.astype(np.uint8)}, meta)
    print(f"  {len(prompts)} prompts, vocabulary {sentencepiece.SentencePieceProcessor(model_file=os.path.join(out_dir, 'spiece.model')).get_piece_size()}, "
          f"{int((ids == 2).any(1).sum())} with <unk>, {int((mask.sum(1) == 512).sum())} cut at 512 tokens")


# --------------------------------------------------------------------------------------------------
# umt5_ties: transformers' ids of text where several segmentations score the same, with the committed
# umt5_tokenizer/spiece.model
# --------------------------------------------------------------------------------------------------

def section_umt5_ties(out_dir):
    """Runs of one letter (2 to 60 long), random strings over two or three letters and random concatenations
    of the model's pieces: where pieces of one root ("a", "aa", "aaa") or of equal total score can be put in
    another order, the best segmentation is not unique and the tokenizer's tie-break decides."""
    import random
    import string

    import sentencepiece
    import transformers

    spiece = os.path.join(FIXTURES, "umt5_tokenizer", "spiece.model")
    sp = sentencepiece.SentencePieceProcessor(model_file=spiece)
    rng = random.Random(5)
    letters = list(string.ascii_lowercase)
    prompts = [c * n for c in letters for n in range(2, 61)]
    for _ in range(800):
        alphabet = rng.sample(letters, rng.choice([2, 3]))
        prompts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(4, 40))))
    pieces = [p for p in (sp.id_to_piece(i).replace("\u2581", "") for i in range(3, sp.get_piece_size())) if p]
    for _ in range(800):
        prompts.append("".join(rng.choice(pieces) for _ in range(rng.randint(2, 8))))
    tokenizer_dir = os.path.join(out_dir, "tokenizer")
    os.makedirs(tokenizer_dir)
    shutil.copy(spiece, tokenizer_dir)
    from transformers import T5Tokenizer

    tokenizer = T5Tokenizer.from_pretrained(tokenizer_dir, extra_ids=0)
    shutil.rmtree(tokenizer_dir)
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    # The text's ids one prompt after another (int16: 700 pieces), and where each prompt's start.
    flat = np.array([i for row in ids for i in row], dtype=np.int16)
    offsets = np.cumsum([0] + [len(row) for row in ids]).astype(np.int32)
    meta = {"versions": versions(transformers, sentencepiece), "prompts": json.dumps(prompts, ensure_ascii=False),
            "what": "T5Tokenizer.from_pretrained(umt5_tokenizer's spiece.model, extra_ids=0)(prompt, add_special_tokens=False) "
                    "for each prompt: ids[offsets[i]:offsets[i + 1]]"}
    save_safetensors(os.path.join(out_dir, "ids.safetensors"), {"ids": flat, "offsets": offsets}, meta)
    print(f"  {len(prompts)} prompts, {len(flat)} ids")


# --------------------------------------------------------------------------------------------------
# umt5_bytefallback: a tiny SentencePiece model with byte fallback (as mT5's and umT5's are trained) and
# transformers' T5Tokenizer ids, which never contain byte pieces for characters outside the vocabulary
# --------------------------------------------------------------------------------------------------

_BYTE_FALLBACK_PROMPTS = [
    "a cat \U0001F431 chases a dog",
    "\U0001F431\U0001F436 two emoji side by side, then \U0001F308 alone",
    "rare letters \u16a0\u16a2\u16a6 and \ua9b2\ua98f between words",
    "written-out byte pieces: <0x41> <0xF0><0x9F> <0xff> <0xZZ> <0x4> <0x100>",
    "<0x41>glued<0x42> and \U0001F431<0x43>\U0001F436",
    "an unknown character at the end \U0001F389",
    "\U0001F389 at the start",
    "mixed \u4e2d\u6587 \ud55c\uad6d\uc5b4 \u0939\u093f\u0928\u094d\u0926\u0940 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 text",
    "</s> and <unk> and <pad> around \U0001F431",
    "math \U0001D538\U0001D539\u2102 \u2211\u222b\u221a\u221e",
    # White space the identity normaliser keeps (transformers splits words there) and literal meta spaces
    "\t\u2581tab then a meta space",
    "x\u3000\u2581y\u00a0\u2581\u2581z \u2581",
    "\u2581",
    "\u2581\u2581\u2581 three",
    "a \u2581\tb\u2028c\u0085d\u200be",
    "</s>\u2581after a special token and \u2581</s>",
]


def section_umt5_bytefallback(out_dir):
    """A unigram model trained with byte_fallback=True (its 256 <0xHH> pieces in the vocabulary; SentencePiece
    itself spells characters outside the vocabulary in them) and the ids transformers' T5Tokenizer gives:
    its converted unigram model has no byte fallback, so such a character is <unk> (consecutive ones one
    <unk>) and a written-out "<0x41>" is matched as that piece's text."""
    import importlib.util

    import sentencepiece as spm
    import transformers

    spec = importlib.util.find_spec("vbench")
    with open(os.path.join(spec.submodule_search_locations[0], "VBench_full_info.json"), encoding="utf-8") as f:
        corpus = [e["prompt_en"] for e in json.load(f)][200:1200]
    corpus += [p for p in _EDGE_PROMPTS + _UMT5_EXTRA_PROMPTS if p.strip()][::2]
    text = os.path.join(out_dir, "corpus.txt")
    with open(text, "w", encoding="utf-8") as f:
        for line in corpus:
            f.write(" ".join(line.split()) + "\n")
    spm.SentencePieceTrainer.train(input=text, model_prefix=os.path.join(out_dir, "spiece"), model_type="unigram", vocab_size=613,
                                   hard_vocab_limit=False, character_coverage=0.99, byte_fallback=True, pad_id=0, eos_id=1, unk_id=2,
                                   bos_id=-1, normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=True,
                                   split_by_whitespace=True, num_threads=1, seed_sentencepiece_size=100000, shuffle_input_sentence=False,
                                   minloglevel=2)
    os.remove(text)
    os.remove(os.path.join(out_dir, "spiece.vocab"))
    # The trainer's record of where it ran (the temporary folder's paths) cleared: a rerun writes the same bytes.
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    with open(os.path.join(out_dir, "spiece.model"), "rb") as f:
        model.ParseFromString(f.read())
    del model.trainer_spec.input[:]
    model.trainer_spec.model_prefix = "spiece"
    with open(os.path.join(out_dir, "spiece.model"), "wb") as f:
        f.write(model.SerializeToString())
    sp = spm.SentencePieceProcessor(model_file=os.path.join(out_dir, "spiece.model"))
    assert sp.piece_to_id("<0xF0>") != sp.unk_id(), "the model has no byte pieces"
    prompts = _umt5_prompts() + _BYTE_FALLBACK_PROMPTS
    ids, mask = _umt5_tokenize(out_dir, prompts)
    own = sp.encode(prompts)
    differ = sum(1 for row, m, o in zip(ids, mask, own) if list(row[: int(m.sum()) - 1]) != o[:511])
    meta = {"versions": versions(transformers, spm), "prompts": json.dumps(prompts, ensure_ascii=False),
            "what": "T5Tokenizer.from_pretrained(this folder, extra_ids=0)(prompts, padding='max_length', max_length=512, "
                    "truncation=True): ids and attention_mask, with the tiny byte-fallback spiece.model trained here"}
    save_safetensors(os.path.join(out_dir, "ids.safetensors"), {"ids": ids.astype(np.int32), "mask": mask.astype(np.uint8)}, meta)
    # Random strings over a palette of what tells the two apart: pieces of the vocabulary, white space of
    # every kind, literal meta spaces, characters outside the vocabulary, written-out byte pieces, special
    # tokens. Their ids flat (int16) with each string's offset, as umt5_ties keeps them.
    import random

    from transformers import T5Tokenizer

    rng = random.Random(17)
    vocabulary = [p for p in (sp.id_to_piece(i) for i in range(259, sp.get_piece_size())) if p]
    palette = [" ", "  ", "\t", "\n", "\u3000", "\u00a0", "\u2003", "\u2581", "\u2581\u2581", "\U0001F431", "\u16a0", "-", "<0x41>",
               "<0xF0>", "</s>", "<unk>", "\u200b", "\u2028", "\u0085"]
    texts = []
    for _ in range(600):
        parts = [rng.choice(vocabulary).replace("\u2581", rng.choice(["", " ", "\u2581"])) if rng.random() < 0.6 else rng.choice(palette)
                 for _ in range(rng.randint(1, 12))]
        texts.append("".join(parts))
    tokenizer = T5Tokenizer.from_pretrained(out_dir, extra_ids=0)
    rows = tokenizer(texts, add_special_tokens=False)["input_ids"]
    flat = np.array([i for row in rows for i in row], dtype=np.int16)
    offsets = np.cumsum([0] + [len(row) for row in rows]).astype(np.int32)
    save_safetensors(os.path.join(out_dir, "random.safetensors"), {"ids": flat, "offsets": offsets},
                     {"versions": versions(transformers, spm), "prompts": json.dumps(texts, ensure_ascii=False),
                      "what": "T5Tokenizer.from_pretrained(this folder, extra_ids=0)(text, add_special_tokens=False) for each of "
                              "600 random strings: ids[offsets[i]:offsets[i + 1]]"})
    print(f"  {len(prompts)} prompts, vocabulary {sp.get_piece_size()} (256 byte pieces), {int((ids == 2).any(1).sum())} with <unk>; "
          f"SentencePiece's own ids differ from transformers' on {differ}")


# --------------------------------------------------------------------------------------------------
# umt5: a tiny random UMT5EncoderModel in the HF layouts (single file, sharded) and ComfyUI's single file
# --------------------------------------------------------------------------------------------------

def section_umt5(out_dir):
    import torch
    import transformers
    from transformers import UMT5Config, UMT5EncoderModel

    # A small tokenizer of its own (no NFKC map: a few kB), as the model's files carry it three times.
    tok_dir = os.path.join(out_dir, "tokenizer")
    os.makedirs(tok_dir)
    _train_tiny_spiece(os.path.join(tok_dir, "spiece"), _umt5_prompts(), vocab_size=300, normalization="identity")
    os.remove(os.path.join(tok_dir, "spiece.vocab"))
    prompts = ["a red blob moves left quickly", "", "A cat 🐱 on a SKATEBOARD, at night!", "一只熊猫在竹林里吃竹子",
               "The quick brown fox jumps over the lazy dog. " * 8]
    L = 40  # a short padded length keeps the fixture small; Wan's 512 is checked on the tokenizer fixture
    ids, mask = _umt5_tokenize(tok_dir, prompts, max_length=L)
    vocab = int(ids.max()) + 37
    # Non-default sizes throughout: d_kv * num_heads != d_model, 3 layers, few buckets, a short max distance.
    config = UMT5Config(vocab_size=vocab, d_model=24, d_kv=10, d_ff=40, num_layers=3, num_heads=3,
                        relative_attention_num_buckets=12, relative_attention_max_distance=20, layer_norm_epsilon=1e-5,
                        feed_forward_proj="gated-gelu", dropout_rate=0.0, attn_implementation="eager")
    model = UMT5EncoderModel(config)
    _randomize(model, 5)
    with torch.no_grad():  # layer norm weights of T5 models vary more than CLIP's: widen them
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(6)) * 2.0)
    model.eval()
    state = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    assert "shared.weight" in state
    # 1. transformers' single file: config.json + model.safetensors.
    single = os.path.join(out_dir, "hf")
    os.makedirs(single)
    model.config.save_pretrained(single)
    save_safetensors(os.path.join(single, "model.safetensors"), state, {"format": "pt"})
    # 2. transformers' sharded layout (as the Wan diffusers repository's text_encoder/): two shards + index.
    sharded = os.path.join(out_dir, "sharded", "text_encoder")
    os.makedirs(sharded)
    model.config.save_pretrained(sharded)
    names = sorted(state)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_safetensors(os.path.join(sharded, fname), {k: state[k] for k in part}, {"format": "pt"})
        weight_map.update({k: fname for k in part})
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": int(sum(v.nbytes for v in state.values()))}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    os.makedirs(os.path.join(out_dir, "sharded", "tokenizer"))
    shutil.copy(os.path.join(tok_dir, "spiece.model"), os.path.join(out_dir, "sharded", "tokenizer", "spiece.model"))
    # 3. ComfyUI's single file (umt5_xxl_fp16.safetensors): the same tensor names, no config.json, fp16, and
    #    the tokenizer's model inside as a U8 tensor "spiece_model".
    comfy = {k: v.astype(np.float16) for k, v in state.items()}
    with open(os.path.join(tok_dir, "spiece.model"), "rb") as f:
        comfy["spiece_model"] = np.frombuffer(f.read(), dtype=np.uint8).copy()
    save_safetensors(os.path.join(out_dir, "comfy_umt5_fp16.safetensors"), comfy)
    # ComfyUI's loader takes the sizes from the tensors' shapes and fixes the rest as umT5-XXL has them:
    # max distance 128, epsilon 1e-6; the reference for that file is the same weights under those values.
    comfy_config = UMT5Config(**{**config.to_dict(), "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6})
    comfy_config._attn_implementation = "eager"
    comfy_model = UMT5EncoderModel(comfy_config)
    comfy_model.load_state_dict({k: torch.from_numpy(v.astype(np.float32)) for k, v in comfy.items() if k != "spiece_model"}, strict=False)
    comfy_model.eval()
    tensors = {"ids": ids, "mask": mask}
    with torch.no_grad():
        for name, m in (("hf", model), ("comfy", comfy_model)):
            out = m(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
            # Wan's convention: the embeddings past each prompt's tokens (its end token included) are zeros.
            out = out * torch.from_numpy(mask)[:, :, None].to(out.dtype)
            tensors[name + ".hidden"] = out.numpy()
        tensors["hf.hidden_unmasked"] = model(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
    meta = {"versions": versions(transformers, torch), "prompts": json.dumps(prompts, ensure_ascii=False), "length": str(L),
            "what": "tiny random UMT5EncoderModel in hf/ (config.json + model.safetensors), sharded/text_encoder/ (two shards + "
                    "index) and comfy_umt5_fp16.safetensors (fp16, no config, spiece_model inside: read with max distance 128 and epsilon "
                    "1e-6 as ComfyUI does); last_hidden_state for the ids with "
                    "the attention mask, zeroed past each prompt (hf from fp32 weights, comfy from the fp16 ones), and without a mask"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)
    print(f"  vocab {vocab}, {len(prompts)} prompts of {L} tokens")


# --------------------------------------------------------------------------------------------------
# wan_pipeline: diffusers' WanPipeline end to end on tiny models (the umt5 and wan_vae fixtures and a tiny
# random WanTransformer3DModel matched to them), and Wan's prompt cleaning
# --------------------------------------------------------------------------------------------------

# Wan2.1's default negative prompt (Wan's wan/configs/shared_config.py, sample_neg_prompt).
WAN_NEGATIVE_PROMPT = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，丑陋的，"
                       "残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，"
                       "三条腿，背景人很多，倒着走")

# Prompts for Wan's cleaning: HTML entities (named, numeric, nested once and twice, without semicolons,
# invalid), white space of every kind, and text ftfy would change (mojibake, curly quotes, ligatures).
_CLEAN_PROMPTS = [
    "a red blob moves left quickly",
    "  spaces\tand\ttabs\n\nand newlines  ",
    "\u00a0no-break\u2003em space\u3000ideographic\u200bzero-width\u2028line sep\u0085nel\x1cfs\x1dgs\x1ers\x1fus\x0bvt\x0cff ",
    "cats &amp; dogs &lt;3 &gt; &quot;quoted&quot; &apos;apos&apos; &#39;39&#39;",
    "double: &amp;amp; &amp;lt;b&amp;gt; &amp;#65; triple &amp;amp;amp;",
    "numeric &#65;&#x42;&#X43; &#0; &#x110000; &#xD800; &#128; &#150; &#x9F; &#1114111; &#65 &#x42 z",
    "named without semicolon: &amp &lt &gt &copy &reg &nbsp &eacute &notin &notit; &ampx &AMP",
    "rare named: &hellip; &mdash; &ndash; &lsquo;&rsquo; &ldquo;&rdquo; &euro; &trade; &frac12; &NotNestedGreaterGreater;",
    "unknown &foo; &zzz &; & alone &#; &#x; &#xZZ;",
    "a&b&c=d &amp;&amp; &&amp;",
    "mixed 中文 &amp; English&nbsp;words 和 日本語",
    "",
    "   ",
    "&nbsp;&nbsp;padded with entities&nbsp;",
    "mojibake: cafÃ© crÃ¨me, â€œsmartâ€\x9d",
    "ligature: ﬁne ﬂow and curly ‘quotes’ “here”",
]


def _wan_scheduler(kind, shift):
    """The flow scheduler the Wan repositories ship (UniPC), or the Euler one, at `shift`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    if kind == "unipc":
        return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
                                       num_train_timesteps=1000)
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)


def section_wan_pipeline(out_dir):
    import html
    import re

    import diffusers
    import ftfy
    import torch
    import transformers
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean
    from transformers import T5Tokenizer

    # The text encoder, tokenizer and VAE are the committed umt5 and wan_vae fixtures; the DiT is new and
    # sized to them (text_dim = umT5's d_model 24, in/out channels = the VAE's z_dim 16), non-default sizes.
    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=16, out_channels=16, text_dim=24,
                  freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                  rope_max_seq_len=1024)
    transformer = _wan_dit_fixture(out_dir, config, 21)

    text_encoder, tokenizer = _umt5_fixture()
    vae = AutoencoderKLWan.from_pretrained(os.path.join(FIXTURES, "wan_vae", "tiny")).eval()

    prompts = ["a red blob moves left quickly", "cats &amp;amp; dogs   on\tthe beach"]
    seeds = [7, 1234]
    frames, height, width, steps, shift, guidance = 5, 32, 48, 4, 5.0, 5.0
    tensors = {}
    for kind in ("unipc", "euler"):
        scheduler = _wan_scheduler(kind, shift)
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae, scheduler=scheduler)
        pipe.set_progress_bar_config(disable=True)
        for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
            with torch.no_grad():
                latents = pipe(prompt=prompt, negative_prompt=WAN_NEGATIVE_PROMPT, height=height, width=width, num_frames=frames,
                               num_inference_steps=steps, guidance_scale=guidance, generator=torch.Generator().manual_seed(seed),
                               output_type="latent", max_sequence_length=512).frames
                tensors[f"{kind}.{i}.latents"] = latents.numpy()
                if kind == "unipc" and i == 0:
                    # The pipeline's decode: latents / (1 / std) + mean through the VAE (its output clamped to [-1, 1]).
                    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
                    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
                    tensors[f"{kind}.{i}.video"] = vae.decode(latents / inv_std + mean, return_dict=False)[0].numpy()
    with torch.no_grad():
        embeds = pipe._get_t5_prompt_embeds(prompts + [WAN_NEGATIVE_PROMPT], max_sequence_length=512)
    # Every position past the longest prompt is zero (checked here, and by the C++ test on its side): kept short.
    used = int((embeds.abs().sum(-1) > 0).sum(1).max())
    assert not embeds[:, used:].any()
    tensors["prompt_embeds"] = embeds[:, :used].numpy()

    def ours(text):
        """What the C++ cleaning implements: prompt_clean with only the character-wise steps of ftfy.fix_text
        (ligatures, character width, curly quotes, control characters) and its final NFC."""
        import unicodedata

        from ftfy import fixes

        text = fixes.remove_control_chars(fixes.uncurl_quotes(fixes.fix_character_width(fixes.fix_latin_ligatures(text))))
        text = unicodedata.normalize("NFC", text)
        return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()

    meta = {"versions": versions(diffusers, transformers, torch, ftfy), "config": json.dumps(config),
            "prompts": json.dumps(prompts, ensure_ascii=False), "seeds": json.dumps(seeds),
            "negative_prompt": WAN_NEGATIVE_PROMPT,
            "sampling": json.dumps({"frames": frames, "height": height, "width": width, "steps": steps, "shift": shift,
                                    "guidance": guidance}),
            "clean_prompts": json.dumps(_CLEAN_PROMPTS, ensure_ascii=False),
            "clean_expected": json.dumps([ours(p) for p in _CLEAN_PROMPTS + [WAN_NEGATIVE_PROMPT]], ensure_ascii=False),
            "clean_prompt_clean": json.dumps([prompt_clean(p) for p in _CLEAN_PROMPTS + [WAN_NEGATIVE_PROMPT]], ensure_ascii=False),
            "what": "transformer/: a tiny random WanTransformer3DModel (fp32); WanPipeline(tokenizer = T5Tokenizer(umt5/tokenizer), "
                    "text_encoder = umt5/hf, vae = wan_vae/tiny, scheduler = UniPCMultistepScheduler(flow_prediction, use_flow_sigmas, "
                    "flow_shift) or FlowMatchEulerDiscreteScheduler(shift)) for each prompt with Wan's negative prompt and "
                    "generator manual_seed(seed): output_type='latent' latents (KIND.I.latents) and, for unipc, the pipeline's "
                    "decode of the first (unipc.0.video); prompt_embeds: _get_t5_prompt_embeds(prompts + [negative], 512) up to the "
                    "longest prompt's tokens (zeros beyond); "
                    "clean_expected: prompt_clean with only ftfy's character-wise fixes and NFC (the C++ cleaning), clean_prompt_clean: "
                    "diffusers' prompt_clean (all of ftfy), of the clean prompts and the negative prompt"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)
    print(f"  {sum(p.numel() for p in transformer.parameters())} DiT parameters, latents {tuple(latents.shape)}")


# --------------------------------------------------------------------------------------------------
# wan22_experts: Wan2.2's two-expert WanPipeline (transformer for t >= boundary_ratio x 1000, transformer_2
# below it, each with its own guidance scale) on tiny random experts and the umt5 / wan_vae fixtures
# --------------------------------------------------------------------------------------------------


def section_wan22_experts(out_dir):
    import diffusers
    import torch
    import transformers
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    # Two experts of one architecture (as Wan2.2-T2V-A14B's), sized to the umt5 and wan_vae fixtures and unlike
    # wan_pipeline's DiT: 3 heads of 8, 3 blocks. diffusers' repository layout: model_index.json with
    # boundary_ratio, transformer/ (high noise) and transformer_2/ (low noise).
    config = dict(patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=8, in_channels=16, out_channels=16, text_dim=24,
                  freq_dim=16, ffn_dim=40, num_layers=3, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                  rope_max_seq_len=1024)
    experts = []
    for folder, seed in (("transformer", 31), ("transformer_2", 32)):
        expert = WanTransformer3DModel(**config)
        _randomize(expert, seed)
        expert.eval()
        path = os.path.join(out_dir, folder)
        os.makedirs(path)
        expert.save_config(path)
        save_safetensors(os.path.join(path, "diffusion_pytorch_model.safetensors"),
                         {k: v.detach().numpy() for k, v in expert.state_dict().items()}, {"format": "pt"})
        experts.append(expert)
    # 6 steps at shift 5: UniPC's timesteps 999 961 909 | 833 714 501, Euler's 1000 953 883 | 771 562 24; the
    # boundary 0.875 x 1000 = 875 switches experts after the third step of each.
    boundary_ratio = 0.875
    with open(os.path.join(out_dir, "model_index.json"), "w") as f:
        json.dump({"_class_name": "WanPipeline", "_diffusers_version": diffusers.__version__, "boundary_ratio": boundary_ratio,
                   "expand_timesteps": False, "transformer": ["diffusers", "WanTransformer3DModel"],
                   "transformer_2": ["diffusers", "WanTransformer3DModel"]}, f, indent=2)

    text_encoder, tokenizer = _umt5_fixture()
    vae = AutoencoderKLWan.from_pretrained(os.path.join(FIXTURES, "wan_vae", "tiny")).eval()
    prompt, seed = "a red blob moves left quickly", 11
    frames, height, width, steps, shift, guidance, guidance_2 = 5, 32, 48, 6, 5.0, 4.0, 2.5
    tensors = {}
    for kind in ("unipc", "euler"):
        scheduler = _wan_scheduler(kind, shift)
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=experts[0], transformer_2=experts[1], vae=vae,
                           scheduler=scheduler, boundary_ratio=boundary_ratio)
        pipe.set_progress_bar_config(disable=True)
        with torch.no_grad():
            latents = pipe(prompt=prompt, negative_prompt=WAN_NEGATIVE_PROMPT, height=height, width=width, num_frames=frames,
                           num_inference_steps=steps, guidance_scale=guidance, guidance_scale_2=guidance_2,
                           generator=torch.Generator().manual_seed(seed), output_type="latent", max_sequence_length=512).frames
        tensors[f"{kind}.latents"] = latents.numpy()
        # The same without transformer_2 and boundary_ratio: the high-noise expert alone at the first scale (what a
        # sampler that ignored the second expert would give; the test checks the experts make a difference).
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=experts[0], vae=vae, scheduler=scheduler)
        pipe.set_progress_bar_config(disable=True)
        with torch.no_grad():
            tensors[f"{kind}.high_only.latents"] = pipe(
                prompt=prompt, negative_prompt=WAN_NEGATIVE_PROMPT, height=height, width=width, num_frames=frames,
                num_inference_steps=steps, guidance_scale=guidance, generator=torch.Generator().manual_seed(seed),
                output_type="latent", max_sequence_length=512).frames.numpy()
    meta = {"versions": versions(diffusers, transformers, torch), "config": json.dumps(config),
            "prompt": prompt, "seed": str(seed), "negative_prompt": WAN_NEGATIVE_PROMPT,
            "sampling": json.dumps({"frames": frames, "height": height, "width": width, "steps": steps, "shift": shift,
                                    "guidance_scale": guidance, "guidance_scale_2": guidance_2,
                                    "boundary_ratio": boundary_ratio}),
            "what": "model_index.json, transformer/ and transformer_2/: two tiny random WanTransformer3DModel experts (fp32) in "
                    "diffusers' Wan2.2 layout; WanPipeline(umt5/tokenizer, umt5/hf, wan_vae/tiny, the experts, boundary_ratio, "
                    "UniPCMultistepScheduler(flow_prediction, use_flow_sigmas, flow_shift) or FlowMatchEulerDiscreteScheduler(shift)) "
                    "with Wan's negative prompt, guidance_scale and guidance_scale_2, generator manual_seed(seed): "
                    "output_type='latent' latents (KIND.latents), and the high-noise expert alone (KIND.high_only.latents)"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)
    print(f"  2 x {sum(p.numel() for p in experts[0].parameters())} DiT parameters, latents {tuple(latents.shape)}")


def section_i2v_pipeline(out_dir):
    """Image-to-video with the image as conditioning channels: diffusers' WanImageToVideoPipeline (no
    expand_timesteps) on the tiny umt5 and wan_vae fixtures with tiny random DiTs of 36 input channels (the noisy
    latents, the 4-channel mask, the conditioning video's latents; z_dim 16): wan21/ one DiT with the image branch
    and the clip_vision fixture's CLIP image encoder and processor; wan22/ two experts (Wan2.2 I2V-A14B's layout,
    boundary 0.9, no image encoder)."""
    import diffusers
    import torch
    import transformers
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanTransformer3DModel
    from PIL import Image
    from transformers import CLIPImageProcessor, CLIPVisionModel

    text_encoder, tokenizer = _umt5_fixture()
    vae = AutoencoderKLWan.from_pretrained(os.path.join(FIXTURES, "wan_vae", "tiny")).eval()
    clip_dir = os.path.join(FIXTURES, "clip_vision")
    image_encoder = CLIPVisionModel.from_pretrained(os.path.join(clip_dir, "image_encoder"), torch_dtype=torch.float32).eval()
    image_processor = CLIPImageProcessor.from_pretrained(os.path.join(clip_dir, "image_processor"))

    base = dict(patch_size=(1, 2, 2), attention_head_dim=8, in_channels=36, out_channels=16, text_dim=24, freq_dim=16,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
    config21 = dict(base, num_attention_heads=2, ffn_dim=32, num_layers=2, image_dim=24, added_kv_proj_dim=16)
    config22 = dict(base, num_attention_heads=3, ffn_dim=40, num_layers=2)
    dit21 = _wan_dit_fixture(os.path.join(out_dir, "wan21"), config21, 91)
    experts = []
    for folder, seed in (("transformer", 92), ("transformer_2", 93)):
        expert = WanTransformer3DModel(**config22)
        _randomize(expert, seed)
        expert.eval()
        path = os.path.join(out_dir, "wan22", folder)
        os.makedirs(path)
        expert.save_config(path)
        save_safetensors(os.path.join(path, "diffusion_pytorch_model.safetensors"),
                         {k: v.detach().numpy() for k, v in expert.state_dict().items()}, {"format": "pt"})
        experts.append(expert)
    # 6 steps at shift 5: UniPC's timesteps 999 961 909 | 833 ..., Euler's 1000 953 | 883 ...: the boundary 0.9 x 1000
    # switches experts inside the schedule.
    boundary_ratio = 0.9
    with open(os.path.join(out_dir, "wan22", "model_index.json"), "w") as f:
        json.dump({"_class_name": "WanImageToVideoPipeline", "_diffusers_version": diffusers.__version__,
                   "boundary_ratio": boundary_ratio, "expand_timesteps": False,
                   "transformer": ["diffusers", "WanTransformer3DModel"],
                   "transformer_2": ["diffusers", "WanTransformer3DModel"]}, f, indent=2)

    frames, height, width, shift = 5, 32, 48, 5.0
    # The image a user gives: at the video's size (the pipeline's VAE preprocessing then only maps it to [-1, 1];
    # CLIP's processor resizes and crops it itself), as a PNG.
    yy, xx = np.meshgrid(np.linspace(0, 1, height), np.linspace(0, 1, width), indexing="ij")
    rng = np.random.default_rng(94)
    array = np.stack([0.5 + 0.4 * np.sin(6 * xx), 0.5 + 0.4 * np.cos(5 * yy), 0.3 + 0.6 * xx * yy], axis=-1) * 255
    array = np.clip(np.round(array + rng.normal(0, 12, array.shape)), 0, 255).astype(np.uint8)
    Image.fromarray(array).save(os.path.join(out_dir, "image.png"))
    image = Image.open(os.path.join(out_dir, "image.png"))
    assert np.array_equal(np.asarray(image), array)
    prompt, seed = "a red blob moves left quickly", 11
    tensors = {"image": array}
    runs = {"wan21": dict(transformer=dit21, image_encoder=image_encoder, image_processor=image_processor),
            "wan22": dict(transformer=experts[0], transformer_2=experts[1], boundary_ratio=boundary_ratio)}
    sampling = {"wan21": dict(steps=4, guidance_scale=5.0), "wan22": dict(steps=6, guidance_scale=4.0, guidance_scale_2=2.5)}
    for name, parts in runs.items():
        for kind in ("unipc", "euler"):
            pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=_wan_scheduler(kind, shift),
                                           **parts)
            pipe.set_progress_bar_config(disable=True)
            s = sampling[name]
            with torch.no_grad():
                latents = pipe(image=image, prompt=prompt, negative_prompt=WAN_NEGATIVE_PROMPT, height=height, width=width,
                               num_frames=frames, num_inference_steps=s["steps"], guidance_scale=s["guidance_scale"],
                               guidance_scale_2=s.get("guidance_scale_2"), generator=torch.Generator().manual_seed(seed),
                               output_type="latent", max_sequence_length=512).frames
            tensors[f"{name}.{kind}.latents"] = latents.numpy()
        if name == "wan21":
            with torch.no_grad():
                tensors["wan21.image_embeds"] = pipe.encode_image(image, torch.device("cpu")).numpy()
        # The conditioning video's latents (the image, then black frames), as prepare_latents makes them.
        with torch.no_grad():
            pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(torch.float32)
            _, condition = pipe.prepare_latents(pixels, 1, 16, height, width, frames, torch.float32, torch.device("cpu"),
                                                torch.Generator().manual_seed(seed))
        tensors[f"{name}.condition"] = condition.numpy()
    meta = {"versions": versions(diffusers, transformers, torch), "config21": json.dumps(config21),
            "config22": json.dumps(config22), "prompt": prompt, "seed": str(seed), "negative_prompt": WAN_NEGATIVE_PROMPT,
            "sampling": json.dumps({"frames": frames, "height": height, "width": width, "shift": shift, "boundary_ratio": boundary_ratio,
                                    **{f"{k}.{n}": v for k, d in sampling.items() for n, v in d.items()}}),
            "what": "wan21/transformer/: a tiny random Wan2.1-I2V-shaped WanTransformer3DModel (36 channels in, image_dim 24); "
                    "wan22/: two tiny random 36-channel experts in diffusers' Wan2.2 I2V-A14B layout (model_index.json boundary_ratio "
                    "0.9); WanImageToVideoPipeline(umt5/tokenizer, umt5/hf, wan_vae/tiny, UniPC or Euler with flow shift; wan21 with "
                    "clip_vision/image_encoder and image_processor) of image.png (= image) and the prompt with Wan's negative prompt, "
                    "generator manual_seed(seed): output_type='latent' latents (NAME.KIND.latents); wan21.image_embeds = "
                    "encode_image(image) (CLIP's hidden_states[-2]); NAME.condition = prepare_latents' condition (mask, latents)"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)
    print(f"  latents {tuple(latents.shape)}, condition {tuple(condition.shape)}")


def section_wan_lora(out_dir):
    """A PEFT LoRA on the wan fixture's model "a" as diffusers trains and saves Wan LoRAs: rank 4, alpha 6 (scale 1.5)
    on the blocks' attention and FFN linears, its B drawn (PEFT initialises it to zero), saved with
    WanPipeline.save_lora_weights (diffusers' names, the adapter config in the metadata); the DiT's output with the
    adapter at scale 1 and at 0.6 (set_adapters), and without it."""
    import diffusers
    import peft
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model = WanTransformer3DModel.from_pretrained(os.path.join(FIXTURES, "wan", "a", "diffusers", "transformer")).eval()
    targets = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
    config = LoraConfig(r=4, lora_alpha=6, target_modules=targets, init_lora_weights=True)
    model.add_adapter(config, adapter_name="default")
    g = torch.Generator().manual_seed(101)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    lora = get_peft_model_state_dict(model, adapter_name="default")
    # The config's target_modules is a set: listed sorted, so that the file does not depend on the hash seed.
    config_dict = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    WanPipeline.save_lora_weights(out_dir, transformer_lora_layers=lora,
                                  transformer_lora_adapter_metadata=config_dict, weight_name="lora.safetensors")
    # safetensors writes a header's metadata in hash order: rewritten here with the keys sorted (same tensors, same
    # metadata), so the file is the same on every run.
    from safetensors import safe_open

    with safe_open(os.path.join(out_dir, "lora.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k).numpy() for k in f.keys()}
        saved_metadata = f.metadata()
    save_safetensors(os.path.join(out_dir, "lora.safetensors"), saved, saved_metadata)
    g = torch.Generator().manual_seed(102)
    x, text = torch.randn((2, 4, 3, 6, 8), generator=g), torch.randn((2, 7, 20), generator=g)
    timesteps = torch.tensor([612.5, 87.25])
    tensors = {"x": x.numpy(), "text": text.numpy(), "timesteps": timesteps.numpy()}
    with torch.no_grad():
        tensors["out"] = model(x, timesteps, text, return_dict=False)[0].numpy()
        model.set_adapters(["default"], weights=[0.6])
        tensors["out_0.6"] = model(x, timesteps, text, return_dict=False)[0].numpy()
        model.disable_adapters()
        tensors["out_base"] = model(x, timesteps, text, return_dict=False)[0].numpy()
    # What diffusers reads back from the file (the round trip through its own loader): the same output.
    pipe_model = WanTransformer3DModel.from_pretrained(os.path.join(FIXTURES, "wan", "a", "diffusers", "transformer")).eval()
    state, metadata = WanPipeline.lora_state_dict(os.path.join(out_dir, "lora.safetensors"), return_lora_metadata=True)
    pipe_model.load_lora_adapter(state, prefix="transformer", adapter_name="default", metadata=metadata)
    with torch.no_grad():
        assert torch.allclose(pipe_model(x, timesteps, text, return_dict=False)[0], torch.from_numpy(tensors["out"]), atol=1e-6)
    meta = {"versions": versions(diffusers, peft, torch), "lora_config": json.dumps(config_dict, sort_keys=True),
            "what": "lora.safetensors: WanPipeline.save_lora_weights of a PEFT LoRA (r 4, alpha 6, targets "
                    "to_q/to_k/to_v/to_out.0/ffn.net.0.proj/ffn.net.2, lora_A and lora_B drawn) on wan/a/diffusers; "
                    "out = the model with the adapter at x, timesteps, text; out_0.6 at adapter weight 0.6; out_base "
                    "without it"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)
    print(f"  {len(lora)} LoRA tensors")


def section_wan_lokr(out_dir):
    """PEFT LoKr adapters (LoKrConfig, inject_adapter_in_model) on the wan fixture's model "a", every tensor drawn
    (PEFT starts W1 at zero), saved as WanPipeline.save_lora_weights saves adapters (diffusers' names, PEFT's config in
    the metadata), and the DiT's output with each:

    lokr.safetensors             r 3, alpha 5, the default factorization: the attention's W1 and W2 whole, the FFN's
                                 W2 as lokr_w2_a · lokr_w2_b;
    lokr_decomposed.safetensors  r 3, alpha 4, decompose_factor 4, decompose_both, rank_pattern {to_q: 1} (to_q's W1 and
                                 W2 both as two factors), alpha_pattern {ffn.net.2: 2.5}."""
    import diffusers
    import peft
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel
    from peft import LoKrConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict
    from safetensors import safe_open

    targets = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
    configs = {
        "lokr": LoKrConfig(r=3, alpha=5, target_modules=targets),
        "lokr_decomposed": LoKrConfig(r=3, alpha=4, target_modules=targets, decompose_factor=4, decompose_both=True,
                                      rank_pattern={"to_q": 1}, alpha_pattern={"ffn.net.2": 2.5}),
    }
    g = torch.Generator().manual_seed(202)
    x, text = torch.randn((2, 4, 3, 6, 8), generator=g), torch.randn((2, 7, 20), generator=g)
    timesteps = torch.tensor([612.5, 87.25])
    tensors = {"x": x.numpy(), "text": text.numpy(), "timesteps": timesteps.numpy()}
    meta = {"versions": versions(diffusers, peft, torch)}
    for seed, (name, config) in enumerate(configs.items(), start=203):
        model = WanTransformer3DModel.from_pretrained(os.path.join(FIXTURES, "wan", "a", "diffusers", "transformer")).eval()
        model = inject_adapter_in_model(config, model, adapter_name="default")
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in sorted(model.named_parameters()):
                if "lokr_" in pname:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        state = get_peft_model_state_dict(model, adapter_name="default")
        shapes = sorted({k.rsplit(".", 1)[1] for k in state})
        config_dict = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
        config_dict["peft_type"] = "LOKR"
        WanPipeline.save_lora_weights(out_dir, transformer_lora_layers=state,
                                      transformer_lora_adapter_metadata=config_dict, weight_name=name + ".safetensors")
        path = os.path.join(out_dir, name + ".safetensors")
        with safe_open(path, "pt") as f:  # rewritten with the metadata's keys sorted: the same bytes on every run
            saved = {k: f.get_tensor(k).numpy() for k in f.keys()}
            saved_metadata = f.metadata()
        save_safetensors(path, saved, saved_metadata)
        with torch.no_grad():
            tensors["out_" + name] = model(x, timesteps, text, return_dict=False)[0].numpy()
        meta["config_" + name] = json.dumps(config_dict, sort_keys=True, default=str)
        print(f"  {name}: {len(state)} tensors ({', '.join(shapes)})")
    with torch.no_grad():
        base = WanTransformer3DModel.from_pretrained(os.path.join(FIXTURES, "wan", "a", "diffusers", "transformer")).eval()
        tensors["out_base"] = base(x, timesteps, text, return_dict=False)[0].numpy()
    meta["what"] = ("out_lokr / out_lokr_decomposed: the model with that file's adapter (PEFT's LoKr forward) at x, "
                    "timesteps, text; out_base without one")
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)


def section_trained_lora(out_dir):
    """A LoRA trained by MegaSlide and read by diffusers: build/bin/megaslide-train (MEGASLIDE_TRAIN names another
    binary) trains LoRA rank 4, alpha 6 on every Linear of the wan fixture's model "a" blocks for 3 steps (resident
    fp32, on latents drawn here) and exports it (--export-weights: diffusers' layout); WanPipeline.load_lora_weights
    reads the file into model "a"; the DiT's output with it, and without it. run.yaml and data.safetensors are kept
    so that the C++ test trains the same LoRA again."""
    import diffusers
    import peft
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel

    root = ROOT
    train = os.environ.get("MEGASLIDE_TRAIN", os.path.join(root, "build", "bin", "megaslide-train"))
    if not os.path.exists(train):
        raise SystemExit(f"trained_lora needs megaslide-train ({train}): build it, or set MEGASLIDE_TRAIN")
    rng = np.random.default_rng(31)
    data = {"latents": rng.standard_normal((4, 4, 3, 6, 8)).astype(np.float32),
            "text": rng.standard_normal((4, 7, 20)).astype(np.float32),
            "empty_text": np.zeros((7, 20), dtype=np.float32)}
    save_safetensors(os.path.join(out_dir, "data.safetensors"), data, {"what": "latents and text of the LoRA run"})
    with open(os.path.join(out_dir, "run.yaml"), "w") as f:
        f.write("""# The LoRA run of tests/fixtures/trained_lora (tools/make_fixtures.py trained_lora), from the repository's root.
model:
  arch: wan
  wan: {weights: tests/fixtures/wan/a/diffusers, dim: 24, layers: 2, heads: 2, ffn_dim: 40, freq_dim: 16, text_dim: 20, patch: [1, 2, 2], in_channels: 4, out_channels: 4}
data: {dataset: latent-tensors, tensors: tests/fixtures/trained_lora/data.safetensors, channels: 4, frames: 3, height: 6, width: 8, max_text_tokens: 7}
diffusion: {objective: flow, shift: 3.0, caption_dropout: 0.0}
train: {steps: 3, batch_size: 2, lr: 0.05, warmup_steps: 0, lr_schedule: constant, grad_clip: 1.0, device: cpu, seed: 7, sample_every: 0, checkpoint_every: 0}
offload: {enabled: false}
lora: {rank: 4, alpha: 6}
output: {progress: false}
""")
    run_dir = tempfile.mkdtemp(prefix="megaslide-trained-lora-")
    try:
        subprocess.run([train, "--config", os.path.join(out_dir, "run.yaml"), "--run-dir", os.path.join(run_dir, "run"),
                        "--set", "data.tensors=" + os.path.join(out_dir, "data.safetensors"),
                        "--set", "model.wan.weights=" + os.path.join(FIXTURES, "wan", "a", "diffusers"),
                        "--export-weights", os.path.join(out_dir, "lora.safetensors")], check=True, cwd=root)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    model = WanTransformer3DModel.from_pretrained(os.path.join(FIXTURES, "wan", "a", "diffusers", "transformer")).eval()
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=model, vae=None, scheduler=None)
    pipe.load_lora_weights(out_dir, weight_name="lora.safetensors")
    g = torch.Generator().manual_seed(103)
    x, text = torch.randn((2, 4, 3, 6, 8), generator=g), torch.randn((2, 7, 20), generator=g)
    timesteps = torch.tensor([731.0, 44.5])
    tensors = {"x": x.numpy(), "text": text.numpy(), "timesteps": timesteps.numpy()}
    with torch.no_grad():
        tensors["out"] = pipe.transformer(x, timesteps, text, return_dict=False)[0].numpy()
        pipe.transformer.disable_adapters()
        tensors["out_base"] = pipe.transformer(x, timesteps, text, return_dict=False)[0].numpy()
    adapters = sum(1 for n, _ in pipe.transformer.named_parameters() if ".lora_A." in n)
    meta = {"versions": versions(diffusers, peft, torch),
            "what": "lora.safetensors: megaslide-train --config run.yaml --export-weights (LoRA r 4, alpha 6, 3 steps); "
                    "out = WanPipeline.load_lora_weights of it into wan/a/diffusers at x, timesteps, text; out_base "
                    f"without the adapter ({adapters} adapted layers)"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)
    print(f"  {adapters} adapted layers read by diffusers")


# --------------------------------------------------------------------------------------------------
# ftfy: ftfy.fix_text and diffusers' Wan prompt_clean of prompt-like text broken in the ways ftfy repairs
# --------------------------------------------------------------------------------------------------

# Prompt-like sentences in several scripts; each is also kept as it is (legitimate text ftfy leaves alone,
# but for its character-wise fixes such as curly quotes).
_FTFY_SENTENCES = [
    "a red fox runs through the snowy forest at dawn",
    "Un café crème à la terrasse, déjà l'été à Paris.",
    "Über den Dächern fährt ein grüner Zug – schön, groß und weiß.",
    "El niño español come jamón en la montaña, ¿verdad? ¡Sí!",
    "A menina está às margens do rio, àquela hora, com o pão.",
    "Zażółć gęślą jaźń: źrebię łka w deszczu.",
    "Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "Árvíztűrő tükörfúrógép a Dunán ősszel.",
    "Çağrı ışık görünce İstanbul'da koştu, ğüşöç.",
    "Ένας γάτος περπατά στην παραλία τη νύχτα.",
    "Кошка идёт по пляжу под луной, съешь же ещё этих булок.",
    "Їжак біжить полем, ґанок і єнот.",
    "一只猫在海滩上散步，夕阳西下，画面温暖。",
    "桜の木の下で、猫が静かに眠っている。",
    "고양이가 해변을 걷고 있다, 노을이 진다.",
    "قطة تمشي على الشاطئ عند الغروب",
    "חתול הולך על החוף בשקיעה",
    "एक बिल्ली समुद्र तट पर चल रही है",
    "Con mèo đi dạo trên bãi biển lúc hoàng hôn.",
    "a cat 🐱 surfing a wave 🌊 at sunset 🌅, 4K 👍🏽",
    "“Smart quotes” and ‘single ones’ — with dashes… and ellipses",
    "price: 5 € or £4 — 30 °C, ±2 µm, ½ cup × 3, © 2024 ™",
    "Øresund bridge, Ålesund fjord, Æbleskiver",
    "naïve façade, coöperate, Noël, señor, résumé",
    "ﬁne ﬂow of ＦＵＬＬＷＩＤＴＨ text and ｶﾀｶﾅ",
    "(╯°□°)╯︵ ┻━┻ and ¯\\_(ツ)_/¯",
]

# Known cases from ftfy's documentation and edge cases of its steps.
_FTFY_CASES = [
    "âœ” No problems", "&macr;\\_(ã\x83\x84)_/&macr;", "Broken text&hellip; it&#x2019;s ﬂubberiﬁc!", "ＬＯＵＤ　ＮＯＩＳＥＳ",
    "voilÃ le travail", "schÃ¶n", "sÃ³", "Ã³", "&ATILDE;&SUP3;", "P&EACUTE;REZ", "BUNDESSTRA&SZLIG;E",
    "&ntilde; &Ntilde; &NTILDE; &nTILDE;", "&lt;tag&gt;", "&Jscr;ohn &HilbertSpace;ancock", "&checkmark;",
    "this&not that", "&amp;amp;amp;", "&amp;amp;lt;b&amp;amp;gt;", "&ldquo;quoted&rdquo; &lsquo;single&rsquo;",
    "&#8220;numeric&#8221; &#x201C;hex&#x201D; &#150; &#x96; &#0; &#65a; &#xZZ; &#;", "<b>bold</b> &amp; &lt;kept&gt;",
    "first line &amp;\n<p>second</p> &amp;\nthird &amp;", "no < here &amp;\nbut &amp; here", "&#12345678901234567890123456;",
    "&abcdefghijklmnopqrstuvwxyz;", "&AMP; &LT; &GT; &QUOT; &NBSP;", "&Eacute; &EACUTE; &eACUTE; &ouml; &OUML;",
    "\x1b[36;44mI'm blue, da ba dee\x1b[0m", "\x1b[1mbold\x1b[m and \x1b[٣m arabic digit \x1b[;;Z \x1b[ x \x1b]0;title",
    "CRLF\r\nline\rCR\u2028LS\u2029PS\x85NEL", "tabs\tand\x0bvt\x0cff\x00nul\x07bell\x7fdel\ufeffbom\ufffcobj\u206atag",
    "C1: \x80\x81\x8d\x8f\x90\x9d\x9f and \x96dash\x97", "caf\xe9 \x93quoted\x94 \x85", "\x93\x94 only C1s",
    "\u00a0\u2003\u3000\u200b spaces", "", " ", "\n", "\r\n\r\n", "a\n\nb\n",
    "Ã la mode, Ã s vezes, Ã quela, Ã  deux", "fÃ cil Ã\xa0 la", "Ã© Ã¨ Ãª", "â€œ like this â€�", "â€œ like this â€?",
    "Ã\x81rvÃ\xadztÅ±rÅ‘", "ÐšÐ¾ÑˆÐºÐ°", "Ð¿Ñ€Ð¸Ð²ÐµÑ‚", "Ã¢â‚¬Å“doubleÃ¢â‚¬Â\x9d", "ÃƒÂ©", "ÃƒÆ’Ã‚Â©",
    "The Mona Lisa doesnÃƒÂ¢Ã¢â€šÂ¬Ã¢â€žÂ¢t have eyebrows.", "Ã\xa0 ", "Ãƒ ", "Â» Â« Â° Â·", "Ø³Ù„Ø§Ù…", "à²¨à²®à²¸à³à²•à²¾à²°",
    "ÎšÎ±Î»Î·Î¼Î­ÏÎ±", "Ã°Å¸ËœÂ€", "ðŸ˜€ emoji", "√±", "‚Äú macroman quotes ‚Äù", "‚àö", "вЂњquotesвЂќ", "ГўВЂВњ quote",
    "Ð¡â€šÐ â„–", "β€™ greek", "ā€ baltic", "íí", "\ud83d\ude00 pair", "\ud800 lone high", "\udc00\ud800 reversed",
    "a\ud83dz", "Œuvre œuvre œ1", "ÈÉ° and Ô°", "× ² ×²", "ØØ Ø±Ø§", "à²", "√≠", "≈°", "‚Äú", "‚âà", "ВЂВ",
    "latin-1 \xc3\xa9 mixed with real é", "real café and fake cafÃ©", "éèê normal accents only",
    "l’été — c’est déjà ça", "Ã¼ber", "Ã¼ber und über", "ÉÉÉ", "Ã", "Â", "Â ", "x Â y", "a.Â ©",
    # ftfy's utf-8-variants expressions end in '$', which also matches before a final '\n' (kept as it is).
    "Ã© À\n", "Ã© À", "Ã©í\xa0\x80í°\n", "Ã©í\xa0\x80í°\x80", "Ã©í\xa0\x80í°\x80x\n", "Ã©\x1b[1;٣m", "Ã©\x1a\n",
]


def _ftfy_inputs():
    """A few hundred strings from fixed seeds: the sentences as they are, and broken as mojibake (single,
    double, lossy, A0 lost to a space, UTF-8 variants, mixed with good text), with HTML entities, line
    breaks, terminal escapes and control characters."""
    import html
    import random

    import ftfy.bad_codecs  # noqa: F401  (sloppy-windows-*, as mojibake makers use them)

    rng = random.Random(20240613)
    encodings = ["sloppy-windows-1252", "latin-1", "macroman", "cp437", "sloppy-windows-1251", "sloppy-windows-1250",
                 "sloppy-windows-1253", "iso-8859-2", "sloppy-windows-1254", "sloppy-windows-1257"]
    out = list(_FTFY_CASES)

    def mojibake(text, encoding):
        return text.encode("utf-8").decode(encoding, errors="replace")

    for s in _FTFY_SENTENCES:
        out.append(s)
        for encoding in rng.sample(encodings, 4):
            out.append(mojibake(s, encoding))
        broken = mojibake(s, "sloppy-windows-1252")
        out.append(mojibake(broken, rng.choice(["sloppy-windows-1252", "latin-1", "macroman"])))  # twice
        out.append(mojibake(s, "windows-1252"))  # strict: undefined bytes became U+FFFD
        out.append(s.encode("utf-8").decode("latin-1"))  # C1 controls
        out.append(broken.replace("\xa0", " "))  # byte A0 read as a space
        out.append(broken.replace("\x9d", "?").replace("\x81", "?"))
        words = s.split(" ")
        k = rng.randrange(len(words))
        words[k] = mojibake(words[k], rng.choice(encodings[:3]))  # one word broken in good text
        out.append(" ".join(words))
        words = s.split(" ")
        cut = rng.randrange(1, len(words) + 1)
        out.append(" ".join(words[:cut]) + " " + mojibake(" ".join(words[cut:]), "sloppy-windows-1251"))
        out.append(html.escape(s))
        out.append(html.escape(html.escape(s)) + " &lt;b&gt;")
        out.append(html.escape(html.escape(html.escape(s))))
        out.append("".join(f"&#{ord(c)};" if ord(c) > 127 and rng.random() < 0.5 else c for c in s))
        out.append(s.replace(" ", "\r\n", 2).replace(" ", "\u2028", 1) + "\x1b[0m")
    # UTF-8 variants: CESU-8 (surrogate pairs as two 3-byte sequences) and Java's C0 80, read as Windows-1252.
    def cesu8(text):
        units = text.encode("utf-16-be", "surrogatepass")
        halves = "".join(chr(int.from_bytes(units[i:i + 2], "big")) for i in range(0, len(units), 2))
        return halves.encode("utf-8", "surrogatepass").replace(b"\x00", b"\xc0\x80")

    for s in ["emoji 😀 here", "🐱🌊", "null\x00byte and é", "😀"]:
        for encoding in ("sloppy-windows-1252", "latin-1"):
            out.append(cesu8(s).decode(encoding))
    # Random fragments of broken text glued together.
    pieces = [s for s in out if s]
    for _ in range(60):
        a, b = rng.sample(pieces, 2)
        out.append(a[: rng.randint(0, len(a))] + rng.choice([" ", "\n", "", " &amp; ", "\r\n"]) + b[rng.randint(0, len(b)):])
    return out


def _diffusers_wan_prompt_clean():
    """diffusers' WanPipeline prompt_clean: its own functions, taken from pipeline_wan.py's source and run with
    ftfy, html and re (importing the module would need torch and transformers' umT5 as well)."""
    import ast
    import html
    import importlib.util
    import re

    import ftfy

    path = importlib.util.find_spec("diffusers").submodule_search_locations[0] + "/pipelines/wan/pipeline_wan.py"
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    wanted = {"basic_clean", "whitespace_clean", "prompt_clean"}
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    assert {f.name for f in functions} == wanted, path
    scope = {"ftfy": ftfy, "html": html, "re": re, "is_ftfy_available": lambda: True}
    exec(compile(ast.Module(body=functions, type_ignores=[]), path, "exec"), scope)
    return scope["prompt_clean"]


def section_ftfy(out_dir):
    import diffusers
    import ftfy

    prompt_clean = _diffusers_wan_prompt_clean()

    def value(text):
        try:
            text.encode("utf-8")
            return text
        except UnicodeEncodeError:  # a lone surrogate: the UTF-8 of each code point (as C++ reads it)
            return {"utf8_hex": text.encode("utf-8", "surrogatepass").hex()}

    inputs = list(dict.fromkeys(_ftfy_inputs() + [WAN_NEGATIVE_PROMPT]))
    cases = [{"in": value(s), "fix_text": value(ftfy.fix_text(s)), "prompt_clean": value(prompt_clean(s))} for s in inputs]
    changed = sum(c["in"] != c["fix_text"] for c in cases)
    doc = {"versions": json.loads(versions(ftfy, diffusers)),
           "what": "ftfy.fix_text(in) (default configuration) and diffusers' WanPipeline prompt_clean(in) for each input; "
                   "a string that holds a lone surrogate is written as {'utf8_hex': its UTF-8, surrogates encoded as such}",
           "cases": cases}
    with open(os.path.join(out_dir, "fix_text.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=0)
        f.write("\n")
    print(f"  {len(cases)} strings, {changed} changed by fix_text")


# --------------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------------
# fp8: PyTorch's float8_e4m3fn casts and ComfyUI's per-tensor scaling (model/fp8.h, fp8 base weights)
# --------------------------------------------------------------------------------------------------

def _fp8_edge_values():
    """float32 values that exercise every rule of PyTorch's float -> float8_e4m3fn cast (c10's
    fp8e4m3fn_from_fp32_value): round to nearest even, 448 the largest finite value, |x| in (448, 464] rounded
    down to it, |x| > 464 and ±inf to NaN (e4m3fn has no infinity), NaN kept with its sign, the subnormals
    (k · 2^-9) with their ties, float32 subnormals, negative zero."""
    import torch

    inf, nan = float("inf"), float("nan")
    values = [0.0, -0.0, 448.0, -448.0, 449.0, 463.99, 464.0, -464.0, 464.01, 465.0, 479.0, 480.0, 500.0, 1e9, 3.4e38,
              inf, -inf, nan, -nan,
              2 ** -6, 2 ** -6 - 2 ** -12, 7 * 2 ** -9, 2 ** -9, -2 ** -9, 2 ** -10, 2 ** -10 + 2 ** -20, 3 * 2 ** -11,
              1.5 * 2 ** -9, 2.5 * 2 ** -9, -2.5 * 2 ** -9, 1e-40, -1e-45,
              1.0625, 1.1875, 1.0625 + 2 ** -20, -1.1875, 272.0, 304.0, 240.0, 0.1, -0.3, 3.14159, 17.0, -100.5]
    g = torch.Generator().manual_seed(81)
    spread = torch.randn(64, generator=g) * torch.pow(2.0, torch.randint(-12, 10, (64,), generator=g).float())
    return torch.cat([torch.tensor(values, dtype=torch.float32), spread])


def _comfyui_fp8_per_tensor(w):
    """ComfyUI's per-tensor float8_e4m3fn quantization (comfy/quant_ops.py TensorCoreFP8Layout.quantize, what
    its *_fp8_scaled files hold): scale = amax|w| / 448 in w's dtype, kept as float32; data = (w · (1 / scale)
    in w's dtype) cast to float8_e4m3fn, without clamping. fp16 weights are quantized as their float32 values
    (MegaSlide's rule: ComfyUI's reciprocal in fp16 overflows once amax|w| < 448 / 65504 ≈ 0.0068)."""
    import torch

    if w.dtype == torch.float16:
        w = w.float()
    scale = (torch.amax(w.abs()) / torch.finfo(torch.float8_e4m3fn).max).to(torch.float32)
    data = (w * (1.0 / scale).to(w.dtype)).to(torch.float8_e4m3fn)
    return data, scale


def section_fp8(out_dir):
    import safetensors
    import torch
    from safetensors.torch import save_file

    e4m3fn, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    tensors = {}
    edge = _fp8_edge_values()
    for dtype, key in ((torch.float32, "f32"), (torch.bfloat16, "bf16"), (torch.float16, "f16")):
        x = edge.to(dtype)
        tensors[f"edge.{key}"] = x
        tensors[f"edge.{key}.e4m3fn"] = x.to(e4m3fn)
    # Every bit pattern (the two NaNs 0x7f and 0xff included) as float32 and bf16.
    every = torch.arange(256, dtype=torch.uint8).view(e4m3fn)
    tensors["every.e4m3fn"] = every
    tensors["every.e4m3fn.f32"] = every.to(torch.float32)
    tensors["every.e4m3fn.bf16"] = every.to(torch.bfloat16)

    # Weights as published files hold them: mostly small, a few outliers (which set the per-tensor scale).
    g = torch.Generator().manual_seed(82)
    shapes = {"f32": ((23, 19), torch.float32, 0.05), "bf16": ((32, 24), torch.bfloat16, 0.02), "f16": ((16, 24), torch.float16, 0.001)}
    for key, (shape, dtype, std) in shapes.items():
        w = torch.randn(shape, generator=g) * std
        w.view(-1)[torch.randint(0, w.numel(), (5,), generator=g)] *= 25
        w = w.to(dtype)
        tensors[f"random.{key}"] = w
        cast = w.to(e4m3fn)  # ComfyUI's *_fp8_e4m3fn files: the plain cast
        tensors[f"random.{key}.cast"] = cast
        tensors[f"random.{key}.cast.f32"] = cast.to(torch.float32)
        data, scale = _comfyui_fp8_per_tensor(w)
        tensors[f"random.{key}.scaled"] = data
        tensors[f"random.{key}.scale"] = scale
        tensors[f"random.{key}.scaled.f32"] = data.to(torch.float32) * scale
        tensors[f"random.{key}.scaled.bf16"] = (data.to(torch.float32) * scale).to(torch.bfloat16)
    meta = {"versions": versions(torch),
            "what": "edge.{f32,bf16,f16}: values at every rule of the cast and their x.to(float8_e4m3fn); every.e4m3fn: the 256 "
                    "bit patterns and their .to(float32) and .to(bfloat16); random.K: weights, .cast = w.to(float8_e4m3fn) and "
                    ".cast.f32 its float32, .scaled/.scale = ComfyUI's per-tensor quantization (TensorCoreFP8Layout.quantize: "
                    "scale = amax|w|/448, data = (w * (1/scale).to(w.dtype)).to(float8_e4m3fn); f16 as its float32), "
                    ".scaled.f32 = data.float() * scale, .scaled.bf16 its bf16"}
    save_safetensors(os.path.join(out_dir, "reference.safetensors"), tensors, meta)

    # The safetensors package's own writer (not save_safetensors above): F8_E4M3 and F8_E5M2 as it lays them
    # out, with each tensor's bit patterns as U8 beside it; no metadata, so its bytes are the same every run.
    bits_e4m3fn = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    bits_e5m2 = torch.arange(255, -1, -1, dtype=torch.uint8)
    package = {"e4m3fn": bits_e4m3fn.clone().view(e4m3fn), "e4m3fn.bits": bits_e4m3fn,
               "e5m2": bits_e5m2.clone().view(e5m2), "e5m2.bits": bits_e5m2,
               "scaled_fp8": torch.empty(0, dtype=e4m3fn), "scale_weight": torch.tensor(0.0123, dtype=torch.float32),
               "bf16": edge[:8].to(torch.bfloat16)}
    path = os.path.join(out_dir, "safetensors_package.safetensors")
    save_file(package, path)
    back = safetensors.torch.load_file(path)
    assert all(back[k].dtype == v.dtype and torch.equal(back[k].view(torch.uint8) if back[k].dtype in (e4m3fn, e5m2) else back[k],
                                                         v.view(torch.uint8) if v.dtype in (e4m3fn, e5m2) else v) for k, v in package.items())
    print(f"  {len(tensors)} reference tensors; safetensors {safetensors.__version__}: {sorted(package)}")


SECTIONS = {
    "video": (section_video, "H.264 clips and their frames as opencv-python decodes them, VBench's temporal flickering"),
    "image_exif": (section_image_exif, "still images under each EXIF orientation (PNG, WebP, JPEG) and what PIL's exif_transpose shows"),
    "video_files": (section_video_files, "colour bars in BT.709 studio range and BT.601 full range (VP9), YUV worked out from their RGB; a file cut short; groups of pictures to seek in; an anamorphic clip"),
    "sampler": (section_sampler, "diffusers DDPM/DDIM timestep tables (linspace/leading/trailing) and single steps"),
    "clip_tokenizer": (section_clip_tokenizer, "CLIPTokenizer ids of VBench and edge-case prompts, real and tiny vocabularies"),
    "clip": (section_clip, "tiny random CLIP text models (text-only and whole-CLIPModel layouts) and their outputs"),
    "clip_vision": (section_clip_vision, "CLIPImageProcessor (PIL) and a tiny random CLIPVisionModel's hidden_states[-2] (diffusers and ComfyUI layouts)"),
    "vae": (section_vae, "a tiny random AutoencoderKL: encode, decode and tiled decode outputs"),
    "wan_vae": (section_wan_vae, "a tiny random AutoencoderKLWan (diffusers and original names): encode, decode, tiled"),
    "wan22_vae": (section_wan22_vae, "a tiny random Wan2.2-style AutoencoderKLWan (residual, 2x2 patches; diffusers and original names)"),
    "flow": (section_flow, "diffusers' flow-matching Euler and UniPC (flow sigmas) tables and sampling runs"),
    "loss_weighting": (section_loss_weighting, "diffusers' Min-SNR-gamma weights (compute_snr and its training scripts' recipe) and SD3's sigma_sqrt and cosmap"),
    "wan": (section_wan, "tiny random WanTransformer3DModels (diffusers, original and ComfyUI layouts): outputs, one step's gradients"),
    "ti2v_pipeline": (section_ti2v_pipeline, "Wan2.2 TI2V's image-to-video WanImageToVideoPipeline (expand_timesteps) on tiny models"),
    "wan_i2v": (section_wan_i2v, "Wan2.1 I2V's DiT (the image branch) on a tiny random WanTransformer3DModel: output, gradients"),
    "wan_ti2v": (section_wan_ti2v, "Wan2.2 TI2V's per-token timesteps on a tiny random WanTransformer3DModel: output, gradients"),
    "umt5_tokenizer": (section_umt5_tokenizer, "a tiny SentencePiece model and T5Tokenizer ids of VBench and edge-case prompts"),
    "umt5_ties": (section_umt5_ties, "T5Tokenizer ids of text whose best segmentation is not unique (repeated letters, pieces)"),
    "umt5_bytefallback": (section_umt5_bytefallback, "a tiny byte-fallback SentencePiece model and T5Tokenizer ids (never byte pieces)"),
    "umt5": (section_umt5, "a tiny random UMT5EncoderModel (HF single/sharded, ComfyUI fp16 file) and its hidden states"),
    "ftfy": (section_ftfy, "ftfy.fix_text and Wan's prompt_clean of prompts broken as mojibake, HTML, line breaks, controls"),
    "wan22_experts": (section_wan22_experts, "Wan2.2's two-expert WanPipeline (boundary, two guidance scales) on tiny random experts"),
    "i2v_pipeline": (section_i2v_pipeline, "WanImageToVideoPipeline with 36-channel DiTs: Wan2.1 I2V (CLIP image tokens) and Wan2.2 I2V's two experts"),
    "wan_lora": (section_wan_lora, "a PEFT LoRA on the tiny Wan DiT, saved by WanPipeline.save_lora_weights, and the DiT's outputs with it"),
    "wan_lokr": (section_wan_lokr, "PEFT LoKr adapters on the tiny Wan DiT (whole and decomposed factors), saved in diffusers' layout, and the DiT's outputs with them"),
    "trained_lora": (section_trained_lora, "a LoRA megaslide-train trains on the tiny Wan DiT, read by WanPipeline.load_lora_weights, and the DiT's outputs with it"),
    "fp8": (section_fp8, "PyTorch's float8_e4m3fn casts (edge values, every bit pattern) and ComfyUI's per-tensor fp8 scaling; an fp8 file from the safetensors package"),
    "wan_pipeline": (section_wan_pipeline, "WanPipeline on the tiny umT5, Wan VAE and a matching tiny DiT: latents, video; prompt cleaning"),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sections", nargs="*", help="sections to make (default: all)")
    parser.add_argument("--list", action="store_true", help="list the sections")
    parser.add_argument("--umt5-ids", nargs=2, metavar=("TOKENIZER_DIR", "OUT"),
                        help="only write transformers' ids of the umt5_tokenizer prompts with the real umT5 tokenizer in TOKENIZER_DIR "
                             "(its spiece.model, with tokenizer_config.json if present) to OUT, for the C++ test's "
                             "MEGASLIDE_UMT5_TOKENIZER_IDS (not committed: the model is a download)")
    args = parser.parse_args()
    if args.umt5_ids:
        import transformers
        from transformers import T5Tokenizer  # umT5's tokenizer class

        prompts = _umt5_prompts()
        tokenizer = T5Tokenizer.from_pretrained(args.umt5_ids[0])
        out = tokenizer(prompts, padding="max_length", max_length=512, truncation=True, add_special_tokens=True, return_attention_mask=True)
        meta = {"versions": versions(transformers), "prompts": json.dumps(prompts, ensure_ascii=False),
                "what": f"T5Tokenizer.from_pretrained({args.umt5_ids[0]!r})(prompts, padding='max_length', max_length=512, truncation=True)"}
        save_safetensors(args.umt5_ids[1], {"ids": np.array(out["input_ids"], dtype=np.int64),
                                            "mask": np.array(out["attention_mask"], dtype=np.int64)}, meta)
        return
    if args.list:
        for name, (_, what) in SECTIONS.items():
            print(f"{name:10s} tests/fixtures/{name}/: {what}")
        return
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    try:
        import torch

        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
    except ImportError:
        pass
    for name in args.sections or list(SECTIONS):
        out_dir = os.path.join(FIXTURES, name)
        # Write into a fresh folder beside the old one, then swap: a failed run leaves the old fixtures.
        os.makedirs(FIXTURES, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=FIXTURES)
        print(f"{name}: {SECTIONS[name][1]}")
        try:
            SECTIONS[name][0](tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(out_dir, ignore_errors=True)
        os.rename(tmp, out_dir)
        for base, dirs, files in os.walk(out_dir):
            os.chmod(base, 0o755)
            for f in files:
                os.chmod(os.path.join(base, f), 0o644)
        total = sum(os.path.getsize(os.path.join(b, f)) for b, _, fs in os.walk(out_dir) for f in fs)
        print(f"  -> tests/fixtures/{name}/ ({total / 1024:.0f} kB)")


if __name__ == "__main__":
    main()
