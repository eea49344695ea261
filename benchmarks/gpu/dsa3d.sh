#!/usr/bin/env bash
# The 3D-DSA GPU check (issue "3D Deformable Slide Attention", docs/3d-dsa.md): builds what it needs,
# checks the fused CUDA kernels against the grid_sample reference (the *_CUDA tests: float32, float64,
# bfloat16, forward and every gradient, deterministic mode), then times fused 3D-DSA, the reference and
# LibTorch's flash SDPA at 16K to 256K tokens with d = 64 and 128, and the fused forward's bandwidth
# against a device-to-device copy measured in the same run. Sized to finish in about 5 minutes on one
# H200 (16 cores), the build included.
#
# On the lent GPU machine (no package registry there), from this machine:
#   ../shared/tools/device-deps.sh .devdeps && echo /.devdeps/ >> .git/info/exclude
#   device run, carry [".devdeps"], command: bash benchmarks/gpu/dsa3d.sh
# Results go to $OUT (or build-gpu/results): the test log and the benchmark's table and JSON line.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-build-gpu/results}
mkdir -p "$out"
torch_cmake=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
prefix="$torch_cmake"
if [ -d .devdeps/usr ]; then
  prefix="$PWD/.devdeps/usr;$torch_cmake"
  export LD_LIBRARY_PATH="$PWD/.devdeps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt" || true
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
      -DMEGASLIDE_BUILD_TOOLS=OFF > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build build-gpu -j"$(nproc)" --target test_dsa3d test_deformable_slide_attention bench_dsa3d \
      > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }

rc=0
build-gpu/bin/test_dsa3d --gtest_filter='*_CUDA*' > "$out/tests_cuda.log" 2>&1 || rc=$?
tail -15 "$out/tests_cuda.log"
# A GPU that is not visible would make every *_CUDA test skip and the check pass vacuously.
if grep -q '\[  SKIPPED \]' "$out/tests_cuda.log"; then echo "dsa3d.sh: CUDA tests skipped: no device visible" >&2; exit 1; fi
[ "$rc" -eq 0 ] || exit "$rc"
build-gpu/bin/test_deformable_slide_attention > "$out/tests_module.log" 2>&1 || { tail -20 "$out/tests_module.log"; exit 1; }
build-gpu/bin/bench_dsa3d --cuda --reps 5 | tee "$out/bench_dsa3d_cuda.txt"
