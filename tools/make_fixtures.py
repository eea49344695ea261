#!/usr/bin/env python3
"""Reference fixtures for MegaSlide's C++ tests, made with the Python libraries users check us against.

    python tools/make_fixtures.py                 # every section
    python tools/make_fixtures.py video sampler   # only these
    python tools/make_fixtures.py --list          # the sections and what each writes

Each section writes small files under tests/fixtures/<section>/ (safetensors, or the media files a test
reads); they are committed, so building and testing MegaSlide needs no Python. The package versions
this was run with are pinned in tools/fixtures-requirements.txt. Every input is drawn from fixed seeds
and the computations run on the CPU in one thread, so a rerun with those versions rewrites the same
bytes (the video section also needs the `ffmpeg` program with libx264, which tools/bootstrap.sh
installs).

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


_SAFETENSORS_DTYPES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.int64): "I64",
                       np.dtype(np.int32): "I32", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}


def save_safetensors(path, tensors, metadata=None):
    """Writes {name: numpy array} as safetensors with names in sorted order and a JSON header whose key
    order is fixed (the safetensors package orders its metadata by a hash map: its bytes vary from run
    to run). Read back with the safetensors package as a check of the format."""
    from safetensors.numpy import load_file

    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    for name in sorted(tensors):
        array = np.asarray(tensors[name]).copy(order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        data = array.astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[array.dtype], "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for data in blobs:
            f.write(data)
    back = load_file(path)
    assert sorted(back) == sorted(tensors), path
    assert all(back[k].shape == np.shape(tensors[k]) and np.array_equal(back[k], tensors[k]) for k in tensors), path


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

SECTIONS = {
    "video": (section_video, "H.264 clips and their frames as opencv-python decodes them, VBench's temporal flickering"),
    "sampler": (section_sampler, "diffusers DDPM/DDIM timestep tables (linspace/leading/trailing) and single steps"),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sections", nargs="*", help="sections to make (default: all)")
    parser.add_argument("--list", action="store_true", help="list the sections")
    args = parser.parse_args()
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
