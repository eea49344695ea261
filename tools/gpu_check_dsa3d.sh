#!/usr/bin/env bash
# The 3D-DSA checks that need a GPU (docs/3d-dsa.md, "GPU check"): the *_CUDA tests (fused CUDA against
# the grid_sample reference, forward and every gradient, float32/float64/bfloat16, deterministic mode)
# and the benchmark's CUDA mode. Run from the repository root of a configured build (tools/bootstrap.sh)
# on a machine with a CUDA device; about a minute once built.
set -euo pipefail
cmake --build build -j"$(nproc)" --target test_dsa3d test_deformable_slide_attention bench_dsa3d
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
rc=0
out=$(build/bin/test_dsa3d --gtest_filter='*_CUDA' 2>&1) || rc=$?
echo "$out"
# A GPU that is not visible would make every *_CUDA test skip and the check pass vacuously.
if grep -q '\[  SKIPPED \]' <<<"$out"; then echo "gpu_check_dsa3d: CUDA tests skipped: no device visible" >&2; exit 1; fi
[ "$rc" -eq 0 ] || exit "$rc"
build/bin/bench_dsa3d --cuda --reps 5
