#!/usr/bin/env bash
# Sets up everything MegaSlide needs on a fresh Debian 12 machine, then configures and builds `build/`.
# Idempotent: a second run installs nothing and rebuilds only what changed (seconds).
#
#   tools/bootstrap.sh            # install dependencies, configure, build
#   MEGASLIDE_BUILD_TYPE=Debug tools/bootstrap.sh
#
# What it installs (see docs/building.md):
#   - Debian packages: compilers/tools (cmake, ninja, ccache) and the C++ libraries
#     (fmt, spdlog, yaml-cpp, CLI11, GoogleTest, Google Benchmark, nlohmann-json), FFmpeg's libraries
#     (libavformat/libavcodec/libswscale/libavutil, H.264 through libx264), the ffmpeg tools (ffprobe)
#     and gnuplot (gnuplot-nox: the PNG plots of megaslide-plot and megaslide-ablate).
#   - LibTorch from the PyPI `torch` wheel at the pinned version below, unpacked with pip into
#     .deps/python (no virtualenv, no Python import needed). The wheel is built against CUDA 13.0; the
#     CUDA libraries it links (cudart, cuBLAS, cuDNN, NCCL, ...) are taken from the machine's CUDA 13.0
#     toolkit, and the three it needs that the toolkit lacks (cuSPARSELt, NVSHMEM, cuFile) come from
#     their PyPI wheels into the same folder, where the wheel's RPATH finds them.
set -euo pipefail

TORCH_VERSION=2.11.0
CUDA_EXTRA_WHEELS=(nvidia-cusparselt-cu13==0.8.0 nvidia-nvshmem-cu13==3.4.5 nvidia-cufile==1.15.1.6)
DEBIAN_PACKAGES=(build-essential cmake ninja-build ccache pkg-config
                 libfmt-dev libspdlog-dev libyaml-cpp-dev libcli11-dev
                 libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev
                 libavformat-dev libavcodec-dev libswscale-dev libavutil-dev ffmpeg
                 gnuplot-nox clang)  # gnuplot: megaslide-plot/-ablate PNGs; clang: the libFuzzer tests (tests/fuzz/)

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

# 3. Configure and build ------------------------------------------------------------------------------
build_type=${MEGASLIDE_BUILD_TYPE:-Release}
if [ ! -f build/CMakeCache.txt ]; then
  log "configuring build/ ($build_type)"
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="$build_type" -DCMAKE_PREFIX_PATH="$torch_cmake"
fi
log "building"
cmake --build build --parallel "$(nproc)"
log "done: binaries in build/bin, tests with: ctest --test-dir build"
