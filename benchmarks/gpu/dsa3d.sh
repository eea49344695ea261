#!/usr/bin/env bash
# The 3D-DSA GPU check (docs/3d-dsa.md): builds what it needs, runs every 3D-DSA *_CUDA test (both CUDA
# kernels, the row kernel and the tiled tensor-core kernel, against the float64 reference: bfloat16,
# float16, float32, d = 32/64/128, forward and every gradient, determinism, the module's CUDA-graph
# capture), then `bench_dsa3d --cuda`: forward and forward+backward of the tiled kernel (default and
# deterministic), the row kernel and flash SDPA at (1, 16x64x64, M=16, d=64) and (1, 8x32x32, M=4,
# d=32), bfloat16, CUDA events. The tests take well under a minute and the benchmark ~30 s on an H200;
# the build is the rest.
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
build-gpu/bin/test_deformable_slide_attention --gtest_filter='*_CUDA*' > "$out/tests_module.log" 2>&1 || { tail -20 "$out/tests_module.log"; exit 1; }
build-gpu/bin/bench_dsa3d --cuda --reps 5 | tee "$out/bench_dsa3d_cuda.txt"
