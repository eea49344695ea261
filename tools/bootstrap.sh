#!/usr/bin/env bash
# Sets up everything MegaSlide needs on a fresh Debian 12 machine, then configures and builds `build/`.
# Idempotent: a second run installs nothing and rebuilds only what changed (seconds).
#
#   tools/bootstrap.sh            # install dependencies, configure, build
#   MEGASLIDE_BUILD_TYPE=Debug tools/bootstrap.sh
#
# What it installs (see docs/building.md):
#   - Debian packages: compilers/tools (cmake, ninja, ccache) and the C++ libraries
#     (fmt, spdlog, yaml-cpp, CLI11, GoogleTest, Google Benchmark, nlohmann-json, ICU, SentencePiece), FFmpeg's libraries
#     (libavformat/libavcodec/libswscale/libavutil, H.264 through libx264), the ffmpeg tools (ffprobe)
#     and gnuplot (gnuplot-nox: the PNG plots of megaslide-plot and megaslide-ablate), Gloo's headers
#     (libgloo-dev: LibTorch's ProcessGroupGloo.hpp includes them; data parallelism on the CPU), and
#     protobuf (libprotobuf-dev, protobuf-compiler: the reference the TensorBoard event encoding is tested against),
#     and liburing (liburing-dev: the NVMe tier's io_uring I/O).
#   - LibTorch from the PyPI `torch` wheel at the pinned version below, unpacked with pip into
#     .deps/python (no virtualenv, no Python import needed). The wheel is built against CUDA 13.0; the
#     CUDA libraries it links (cudart, cuBLAS, cuDNN, NCCL, ...) are taken from the machine's CUDA 13.0
#     toolkit, and the three it needs that the toolkit lacks (cuSPARSELt, NVSHMEM, cuFile) come from
#     their PyPI wheels into the same folder, where the wheel's RPATH finds them.
set -euo pipefail

TORCH_VERSION=2.11.0
OPEN_CLIP_VERSION=3.3.0  # only its CLIP vocabulary file is used
CUDA_EXTRA_WHEELS=(nvidia-cusparselt-cu13==0.8.0 nvidia-nvshmem-cu13==3.4.5 nvidia-cufile==1.15.1.6)
DEBIAN_PACKAGES=(build-essential cmake ninja-build ccache pkg-config
                 libfmt-dev libspdlog-dev libyaml-cpp-dev libcli11-dev
                 libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
                 libavformat-dev libavcodec-dev libswscale-dev libavutil-dev ffmpeg
                 libicu-dev libsentencepiece-dev gnuplot-nox clang clang-format libgloo-dev
                 libprotobuf-dev protobuf-compiler liburing-dev)  # gnuplot: megaslide-plot/-ablate PNGs; clang: the libFuzzer tests (tests/fuzz/); clang-format: tests/format/; protobuf: tests/event_protobuf/

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
deps="$root/.deps"
pydeps="$deps/python"
log() { printf '[bootstrap] %s\n' "$*"; }

# 1. Debian packages ------------------------------------------------------------------------------
missing=()
for p in "${DEBIAN_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  sudo_cmd=(); [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# 2. LibTorch from the pinned PyPI wheel ------------------------------------------------------------
stamp="$pydeps/.megaslide-torch-$TORCH_VERSION"
if [ ! -f "$stamp" ]; then
  log "installing LibTorch from the PyPI wheel torch==$TORCH_VERSION into $pydeps"
  rm -rf "$pydeps"
  mkdir -p "$pydeps"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
    --root-user-action=ignore --target "$pydeps" "torch==$TORCH_VERSION" "${CUDA_EXTRA_WHEELS[@]}"
  touch "$stamp"
fi
torch_cmake="$pydeps/torch/share/cmake"

# 3. CLIP's BPE vocabulary --------------------------------------------------------------------------------
# OpenAI's bpe_simple_vocab_16e6.txt (MIT), as the pinned open-clip-torch wheel carries it (gzipped), into
# .deps/clip/ with the wheel's licence; the CLIP tokenizer's tests read it (docs/conditioning.md).
clip_dir="$deps/clip"
clip_stamp="$clip_dir/.megaslide-open-clip-torch-$OPEN_CLIP_VERSION"
if [ ! -f "$clip_stamp" ]; then
  log "fetching CLIP's BPE vocabulary from the PyPI wheel open-clip-torch==$OPEN_CLIP_VERSION into $clip_dir"
  wheel_dir=$(mktemp -d)
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --dest "$wheel_dir" "open-clip-torch==$OPEN_CLIP_VERSION"
  rm -rf "$clip_dir" && mkdir -p "$clip_dir"
  python3 - "$wheel_dir" "$clip_dir" <<'PY'
import glob, gzip, sys, zipfile
wheel, = glob.glob(sys.argv[1] + "/open_clip_torch-*.whl")
with zipfile.ZipFile(wheel) as z:
    open(sys.argv[2] + "/bpe_simple_vocab_16e6.txt", "wb").write(gzip.decompress(z.read("open_clip/bpe_simple_vocab_16e6.txt.gz")))
    licence = [n for n in z.namelist() if n.endswith("/LICENSE")]
    open(sys.argv[2] + "/LICENSE", "wb").write(z.read(licence[0]))
PY
  rm -rf "$wheel_dir"
  touch "$clip_stamp"
fi

# 4. Configure and build ------------------------------------------------------------------------------
build_type=${MEGASLIDE_BUILD_TYPE:-Release}
if [ ! -f build/CMakeCache.txt ]; then
  log "configuring build/ ($build_type)"
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="$build_type" -DCMAKE_PREFIX_PATH="$torch_cmake" -DMEGASLIDE_SENTENCEPIECE=ON -DMEGASLIDE_ICU=ON
fi
log "building"
cmake --build build --parallel "$(nproc)"
log "done: binaries in build/bin, tests with: ctest --test-dir build -j \"\$(nproc)\""
