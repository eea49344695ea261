#!/usr/bin/env bash
# Longer GPU run of the streamed trainer (benchmarks/gpu/check.sh runs a shorter one), sized for one H200 with 16 cores and 128 GiB host RAM,
# all within ~6 minutes:
#   1. pinned-copy bandwidth H2D/D2H measured in this run (the anchor for the H2D GB/s below);
#   2. a ~2.4 B-parameter MegaSlideDiT (48 blocks x hidden 2048, text_dim 1024) for a few steps, async then sync:
#      step time, exposed transfer, H2D GB/s while the H2D stream was busy (bytes over the H2D spans of
#      the traced step) vs the pinned anchor, MFU, peak device memory;
#   3. the same width at 12 blocks: peak device memory must not grow with depth (48 vs 12).
# Host state: 16 B/param (14 persistent + bf16 grad) x 2.4 B = ~39 GB, plus the fp32 model built once
# on the CPU for initialisation (~10 GB) — inside 128 GiB.
# Prints a markdown table (paste into docs/benchmarks.md) and leaves metrics under $OUT (or /tmp). Exits
# non-zero when any run fails.
#
#   benchmarks/gpu/streamer.sh [build-dir]
set -euo pipefail
BUILD=${1:-build}
OUT=${OUT:-/tmp/megaslide-gpu-streamer}
mkdir -p "$OUT"
TRAIN="$BUILD/bin/megaslide-train"
[ -x "$TRAIN" ] || { echo "streamer.sh: $TRAIN not found; build first (cmake --build $BUILD -j)" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

# 1. Pinned-copy bandwidth (1 GiB each way, LibTorch pinned host memory), measured in this run.
BW_JSON=$("$BUILD/bin/bench_streamer" --pinned-bandwidth 1 | tail -1)
BW_H2D=$(echo "$BW_JSON" | sed -n 's/.*"pinned_h2d_gbps":\([0-9.]*\).*/\1/p')
BW_D2H=$(echo "$BW_JSON" | sed -n 's/.*"pinned_d2h_gbps":\([0-9.]*\).*/\1/p')
echo "pinned copy bandwidth: H2D ${BW_H2D:-n/a} GB/s, D2H ${BW_D2H:-n/a} GB/s"

COMMON=(--config configs/h100nvl-1b.yaml --set model.hidden=2048 --set model.heads=16 --set model.text_dim=1024
        --set data.frames=16 --set data.height=64 --set data.width=64 --set model.patch=[1,4,4]
        --set train.batch_size=2 --set train.steps=4 --set train.log_every=1 --set train.device=cuda
        --set output.progress=false --set offload.optimizer_threads=12 --set train.threads=4)

failed=0
run() {  # name layers mode
  local name=$1 layers=$2 mode=$3
  timeout 150 "$TRAIN" "${COMMON[@]}" --set model.layers="$layers" --set offload.mode="$mode" \
    --run-dir "$OUT/$name" --trace "$OUT/$name.trace.json" --trace-step 4 > "$OUT/$name.log" 2>&1 \
    || { echo "run $name failed (see $OUT/$name.log)"; tail -5 "$OUT/$name.log"; failed=1; }
}
run async48 48 async
run sync48 48 sync
run async12 12 async

echo
echo "| run | blocks | mode | step s | exposed transfer s | H2D GB | H2D GB/s while copying (vs pinned ${BW_H2D:-n/a}) | optimizer s | MFU | peak device GiB |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for name in async48 sync48 async12; do
  f="$OUT/$name/metrics.jsonl"
  [ -s "$f" ] || { echo "| $name | — | — | failed | | | | | | |"; continue; }
  python3 - "$f" "$name" "${BW_H2D:-0}" "$OUT/$name.trace.json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
r = rows[-1]  # the last step (steps 1-3 warm up); the trace records it too
events = json.load(open(sys.argv[4]))["traceEvents"]
h2d_busy_s = sum(e["dur"] for e in events if e.get("ph") == "X" and e["tid"] == 2) / 1e6
gbps = r["h2d_bytes"] / 1e9 / h2d_busy_s if h2d_busy_s > 0 else float("nan")
pinned = float(sys.argv[3])
frac = f" ({gbps / pinned:.2f}x)" if pinned > 0 else ""
name = sys.argv[2]
print(f"| {name} | {name[-2:]} | {name[:-2]} | {r['step_time_s']:.2f} | {r['exposed_transfer_s']:.3f} | {r['h2d_bytes']/1e9:.2f} | "
      f"{gbps:.1f}{frac} | {r['optimizer_s']:.2f} | {r.get('mfu', 0):.3f} | {r['peak_device_bytes']/2**30:.2f} |")
PY
done
echo "traces: $OUT/*.trace.json (open in ui.perfetto.dev)"
exit "$failed"
