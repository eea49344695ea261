#!/usr/bin/env bash
# Installs the build tree into a scratch prefix, then configures, builds and runs tests/package against
# it with nothing but CMAKE_PREFIX_PATH: what `find_package(MegaSlide)` users do.
#   check_package.sh BUILD_DIR TORCH_CMAKE_PREFIX
set -euo pipefail
build=$1
torch_prefix=$2
here=$(cd "$(dirname "$0")" && pwd)
work="$build/package-check"
rm -rf "$work/prefix"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$here" -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" \
      -DCMAKE_PREFIX_PATH="$work/prefix;$torch_prefix" >/dev/null
cmake --build "$work/consumer"
"$work/consumer/consumer"
"$work/prefix/bin/megaslide-train" --config "$work/prefix/share/megaslide/configs/smoke.yaml" --dry-run --json
"$work/prefix/bin/megaslide-plan" --config "$work/prefix/share/megaslide/configs/105b.yaml" --hardware h100nvl --json
# Every driver is installed.
for tool in train sample eval plan plot ablate cache encode; do "$work/prefix/bin/megaslide-$tool" --help > /dev/null; done
