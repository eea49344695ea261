#!/usr/bin/env bash
# Installs the build tree into a scratch prefix, then configures, builds and runs tests/package against
# it with nothing but CMAKE_PREFIX_PATH: what `find_package(MegaSlide)` users do.
#   check_package.sh BUILD_DIR TORCH_CMAKE_PREFIX SOURCE_DIR [STAGE]
# STAGE: `install` installs, builds the consumer and runs it and the drivers; `moved` runs them again with the
# checkout's .deps moved aside (after `install`; nothing else may run meanwhile, which is why ctest runs the
# two as separate tests, only the second alone); both when omitted.
# An install that carries its own LibTorch (MEGASLIDE_INSTALL_LIBTORCH, on for the bootstrap's LibTorch
# in the checkout's .deps) is used with the prefix alone, and must not reach into the clone: the
# installed binaries' RPATHs may not name it, and with the checkout's .deps moved aside the consumer
# and the installed drivers still run and the consumer's build is still up to date (ninja stops on a
# header or library it used that has gone).
set -euo pipefail
build=$1
torch_prefix=$2
source=$(cd "$3" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
stage=${4:-all}
case $stage in install | moved | all) ;; *) echo "check_package: unknown stage '$stage' (install | moved)" >&2; exit 2 ;; esac
work="$build/package-check"
deps="$source/.deps"
moved="$source/.deps.moved-by-package-check"
# A run killed while .deps was aside left it there: put it back first.
if [[ -e "$moved" && ! -e "$deps" ]]; then mv "$moved" "$deps"; fi

torch_config="$work/prefix/lib/megaslide/torch/share/cmake/Torch/TorchConfig.cmake"

run_installed() {
  "$work/consumer/consumer"
  "$work/prefix/bin/megaslide-train" --config "$work/prefix/share/megaslide/configs/smoke.yaml" --dry-run --json > /dev/null
  "$work/prefix/bin/megaslide-plan" --config "$work/prefix/share/megaslide/configs/105b.yaml" --hardware h100nvl --json > /dev/null
  # Every driver is installed.
  for tool in train sample eval plan plot ablate cache encode; do "$work/prefix/bin/megaslide-$tool" --help > /dev/null; done
}

# Install, build the consumer with the prefix alone (and LibTorch's where the install carries none), check
# that no installed RPATH names the source tree, run.
install_stage() {
  rm -rf "$work/prefix" "$work/consumer"
  cmake --install "$build" --prefix "$work/prefix" >/dev/null
  local prefix_path="$work/prefix;$torch_prefix"
  [[ -f "$torch_config" ]] && prefix_path="$work/prefix"
  cmake -S "$here" -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" \
        -DCMAKE_PREFIX_PATH="$prefix_path" >/dev/null
  cmake --build "$work/consumer"
  if [[ -f "$torch_config" ]]; then
    for f in "$work/prefix/lib/libmegaslide.so" "$work/prefix/bin/"megaslide-*; do
      if readelf -d "$f" | grep -E 'R(UN)?PATH' | grep -qF "$source"; then
        echo "check_package: $f has an RPATH into the source tree: $(readelf -d "$f" | grep -E 'R(UN)?PATH')" >&2
        exit 1
      fi
    done
  fi
  run_installed
}

# An install that carries its own LibTorch, with the checkout's .deps moved aside: it still runs, and the
# consumer's build is still up to date.
moved_stage() {
  if [[ ! -x "$work/consumer/consumer" ]]; then
    echo "check_package: no consumer in $work/consumer: run the install stage first" >&2
    exit 1
  fi
  if [[ ! -f "$torch_config" ]]; then
    echo "check_package: the install carries no LibTorch: it needs the one it was built with, nothing to move aside"
    return
  fi
  if [[ ! -e "$deps" ]]; then
    run_installed
    return
  fi
  mv "$deps" "$moved"
  trap 'mv "$moved" "$deps"' EXIT
  trap 'exit 1' INT TERM HUP
  run_installed
  if ! plan=$(cmake --build "$work/consumer" -- -n 2>&1) || [[ "$plan" != *"no work to do"* ]]; then
    echo "check_package: with $deps moved aside the consumer's build is not up to date: $plan" >&2
    exit 1
  fi
  echo "check_package: consumer and installed drivers ran with $deps moved aside"
}

case $stage in
  install) install_stage ;;
  moved) moved_stage ;;
  all) install_stage && moved_stage ;;
esac
