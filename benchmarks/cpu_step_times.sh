#!/usr/bin/env bash
# Step times of configs/small-50m.yaml on the CPU for each compute dtype and thread setting: the table in
# docs/training.md ("Compute dtype and threads"). Each configuration is one megaslide-train run of
# STEPS steps (default 3; the median is reported), with 4 frames of 64x64 (data.frames=4) instead of 16,
# so that a step takes 1-3 minutes on a loaded 2-core machine, not four times that. The anchor (fp32,
# automatic threads) runs first and again last, so drift in the machine's load shows; the 1-minute load
# average is recorded before and after every configuration, because other processes' load changes these
# figures several-fold.
#
#   benchmarks/cpu_step_times.sh [BUILD_DIR] [OUT_DIR]        # BUILD_DIR defaults to build
#   STEPS=3 ROWS="anchor defaults" benchmarks/cpu_step_times.sh   # a subset, by row name
#
# Rows (name: environment; --set overrides):
#   anchor, anchor-again   fp32, threads chosen automatically
#   defaults               the shipped defaults (compute_dtype auto, threads auto)
#   bf16                   offload.compute_dtype=bf16
#   fp32-threads1          fp32, train.threads=1
#   defaults-threads1      the shipped defaults with train.threads=1
#   fp32-passive           fp32, threads automatic, OMP_WAIT_POLICY=PASSIVE (OpenMP threads sleep instead
#                          of spinning while they wait)
#   avx2-fp32, avx2-bf16, avx2-defaults
#                          ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2: LibTorch as it runs on a CPU
#                          without AVX512-BF16/AMX (oneDNN, which runs the bf16 matrix products, then
#                          emulates bf16 as it must there; ATen's own kernels use AVX2). On a reduced
#                          small-50m (1 block, batch 1), because emulated bf16 takes many minutes per full
#                          step. On a CPU that lacks these instructions the cap changes nothing.
# Output: a Markdown table on stdout, and OUT_DIR/results.jsonl (one JSON object per row).
set -euo pipefail
build=${1:-build}
out=${2:-$(mktemp -d /tmp/megaslide-cpu-step-times.XXXXXX)}
steps=${STEPS:-3}
[ -x "$build/bin/megaslide-train" ] ||
  { echo "cpu_step_times.sh: $build/bin/megaslide-train not found (build it: cmake --build $build --target megaslide-train)" >&2; exit 2; }
mkdir -p "$out/bin" "$out/lib"
: > "$out/results.jsonl"
# A copy of the program and the library, so that a rebuild during this long run changes nothing measured.
cp "$build/bin/megaslide-train" "$out/bin/msl-train"
cp -P "$build"/lib/libmegaslide*.so* "$out/lib/"  # the library and its SentencePiece module
train=$out/bin/msl-train
export LD_LIBRARY_PATH=$out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

base=(--config configs/small-50m.yaml --set train.device=cpu --set "train.steps=$steps" --set data.frames=4
      --set output.progress=false --set train.log_every=1 --set train.checkpoint_every=0)
reduced=(--set model.layers=1 --set train.batch_size=1)

declare -A row_env row_sets
add_row() { row_env[$1]=$2; row_sets[$1]=$3; }
add_row anchor "" "--set offload.compute_dtype=fp32"
add_row defaults "" ""
add_row bf16 "" "--set offload.compute_dtype=bf16"
add_row fp32-threads1 "" "--set offload.compute_dtype=fp32 --set train.threads=1"
add_row defaults-threads1 "" "--set train.threads=1"
add_row fp32-passive "OMP_WAIT_POLICY=PASSIVE" "--set offload.compute_dtype=fp32"
add_row anchor-again "" "--set offload.compute_dtype=fp32"
avx2="ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2"
add_row avx2-fp32 "$avx2" "${reduced[*]} --set offload.compute_dtype=fp32"
add_row avx2-bf16 "$avx2" "${reduced[*]} --set offload.compute_dtype=bf16"
add_row avx2-defaults "$avx2" "${reduced[*]}"
rows=${ROWS:-"anchor defaults bf16 fp32-threads1 defaults-threads1 fp32-passive avx2-fp32 avx2-bf16 avx2-defaults anchor-again"}

loadavg() { cut -d' ' -f1 /proc/loadavg; }
echo "| row | environment | overrides | resolved dtype | threads (train.log: LibTorch intra-op, CpuAdamW) | step times (s) | median (s) | load before → after |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
for row in $rows; do
  [ -n "${row_sets[$row]+x}" ] || { echo "cpu_step_times.sh: unknown row '$row'" >&2; exit 2; }
  dir=$out/$row
  rm -rf "$dir"
  load_before=$(loadavg)
  # shellcheck disable=SC2086  # the overrides are words on purpose
  env ${row_env[$row]} "$train" "${base[@]}" ${row_sets[$row]} --run-dir "$dir" > "$dir.log" 2>&1 ||
    { echo "cpu_step_times.sh: row $row failed; see $dir.log" >&2; exit 1; }
  load_after=$(loadavg)
  times=$(grep -o '"step_time_s":[0-9.e+-]*' "$dir/metrics.jsonl" | cut -d: -f2 | tr '\n' ' ')
  median=$(printf '%s\n' $times | sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}')
  dtype=$(grep -o 'compute dtype [a-z0-9]*' "$dir/train.log" | head -1 | cut -d' ' -f3)
  threads=$(grep -o 'threads: .*' "$dir/train.log" | head -1 | grep -o 'intra-op [0-9]* ([A-Za-z_.]*)\|CpuAdamW [0-9]*' | paste -sd, - | sed 's/,/, /')
  printf '| %s | %s | %s | %s | %s | %s | %.1f | %s → %s |\n' "$row" "${row_env[$row]:-}" "${row_sets[$row]:-}" "${dtype:-?}" \
    "${threads:-?}" "$times" "$median" "$load_before" "$load_after"
  printf '{"row":"%s","env":"%s","overrides":"%s","dtype":"%s","threads":"%s","step_times_s":[%s],"median_s":%s,"load_before":%s,"load_after":%s}\n' \
    "$row" "${row_env[$row]:-}" "${row_sets[$row]:-}" "${dtype:-}" "${threads:-}" "$(echo $times | tr ' ' ',')" "$median" \
    "$load_before" "$load_after" >> "$out/results.jsonl"
done
echo
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) CPUs online; results in $out/results.jsonl"
