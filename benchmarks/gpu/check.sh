#!/usr/bin/env bash
# The one GPU check for a lent GPU machine (one H200, 16 cores, no package registry): builds only the
# targets it needs, runs the *_CUDA tests (all but those that need FFmpeg, which it builds without), times 3D-DSA against flash SDPA, runs the AVX-512 CpuAdamW
# tests and bench_cpu_adamw on that machine's CPU, runs the streamed trainer a few steps with a Chrome
# trace (async and sync) beside the resident loop and derives the overlap figures, then writes every
# figure as one JSON file. Exits non-zero when any stage fails; later stages still run.
#
# On this machine first (once): ../shared/tools/device-deps.sh .devdeps && echo /.devdeps/ >> .git/info/exclude
# Then with the device tool: carry [".devdeps"],
#   command: MEGASLIDE_COMMIT=<sha> bash benchmarks/gpu/check.sh
# Results: $OUT/check.json (commit it as benchmarks/results/<date>-<machine>.json), $OUT/check.log (all
# output), $OUT/trace-async.json (open in ui.perfetto.dev). Sized to finish in about 9 minutes (MEGASLIDE_CHECK_BUDGET_S), the
# build included (docs/benchmarks.md has the measured budget).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-build-gpu/results}
mkdir -p "$out"
exec > >(tee -a "$out/check.log") 2>&1
build=${MEGASLIDE_CHECK_BUILD:-build-gpu}  # an existing build folder is reused as configured
jobs=$(nproc)
start_s=$(date +%s)
# The whole check must end inside one device call: every stage's limit is cut so that the stages after
# it keep their reserve (MEGASLIDE_CHECK_BUDGET_S, default 550 s).
deadline_s=$(( start_s + ${MEGASLIDE_CHECK_BUDGET_S:-550} ))
failures=()
declare -A stage_s
declare -A stage_ok
elapsed() { echo $(( $(date +%s) - start_s )); }

# stage NAME TIMEOUT_S RESERVE_S FUNCTION: runs one stage (an exported function) under a timeout of at
# most TIMEOUT_S that leaves RESERVE_S of the budget to the stages after it; records its time and status.
stage() {
  local name=$1 limit=$2 reserve=$3 fn=$4
  local t0; t0=$(date +%s)
  local left=$(( deadline_s - t0 - reserve ))
  (( left < limit )) && limit=$left
  (( limit < 5 )) && limit=5
  echo "=== [$(elapsed) s] $name (limit ${limit} s)"
  if timeout --kill-after=10 "$limit" bash -c "set -o pipefail; $fn"; then
    stage_ok[$name]=true
  else
    local rc=$?
    stage_ok[$name]=false
    failures+=("$name (exit $rc$([ $rc -eq 124 ] && echo ", timed out after ${limit} s"))")
    echo "!!! $name failed (exit $rc)"
  fi
  stage_s[$name]=$(( $(date +%s) - t0 ))
}

torch_cmake=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
prefix="$torch_cmake"
if [ -d .devdeps/usr ]; then
  prefix="$PWD/.devdeps/usr;$torch_cmake"
  export LD_LIBRARY_PATH="$PWD/.devdeps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | sed 's/^Flags:.*\(avx512f\).*/Flags: avx512f present/' | tee "$out/cpu.txt"

export build out prefix jobs

# 1. Build ------------------------------------------------------------------------------------------
build_all() {
  local targets=(megaslide megaslide-train test_weight_streamer test_cpu_master_trainer test_dsa3d
                 test_deformable_slide_attention test_data_loader test_cpu_adamw bench_dsa3d bench_cpu_adamw bench_streamer)
  if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
          -DMEGASLIDE_VIDEO=OFF > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; return 1; }
  fi
  # -k 0: a target that fails to compile does not stop the others; the stages below use what was built.
  cmake --build "$build" -j"$jobs" --target "${targets[@]}" -- -k 0 > "$out/build.log" 2>&1 || { grep -B2 -A12 'error' "$out/build.log" | head -80; return 1; }
}
export -f build_all
stage build 330 200 build_all
built=false
[ -f "$build/lib/libmegaslide.so" ] && built=true

# 2. The *_CUDA tests (a skipped one means no GPU was visible: a failure here) ---------------------
cuda_tests() {
  local rc=0
  for t in test_weight_streamer test_cpu_master_trainer test_dsa3d test_deformable_slide_attention test_data_loader; do
    [ -x "$build/bin/$t" ] || { echo "$t not built"; rc=1; continue; }
    "$build/bin/$t" --gtest_filter='*_CUDA*' --gtest_output="json:$out/gtest-$t.json" > "$out/$t.log" 2>&1 || rc=1
    grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[       OK|^\[  FAILED' "$out/$t.log" | tail -40
    if grep -q '\[  SKIPPED \]' "$out/$t.log"; then echo "$t: CUDA tests skipped: no device visible"; rc=1; fi
  done
  return $rc
}
export -f cuda_tests
[ "$built" = true ] && stage cuda_tests 100 170 cuda_tests

# 3. 3D-DSA against flash SDPA (CUDA events) ------------------------------------------------------------
dsa3d_bench() { "$build/bin/bench_dsa3d" --cuda --reps 5 | tee "$out/bench_dsa3d.txt"; }
export -f dsa3d_bench
[ "$built" = true ] && stage dsa3d_bench 75 120 dsa3d_bench

# 4. The streamed trainer on the GPU: pinned bandwidth, async with a trace, sync, resident -------------
trainer_runs() {
  "$build/bin/bench_streamer" --pinned-bandwidth 1 | tail -1 > "$out/pinned.json" || return 1
  cat "$out/pinned.json"
  local common=(--config configs/h100nvl-1b.yaml --set model.layers=8 --set model.hidden=2048 --set model.heads=16
                --set model.text_dim=1024 --set model.patch=[1,4,4] --set train.batch_size=2 --set train.steps=4
                --set train.log_every=1 --set train.device=cuda --set output.progress=false
                --set train.checkpoint_every=0)  # threads and compute dtype: the shipped defaults
  local rc=0
  "$build/bin/megaslide-train" "${common[@]}" --set offload.mode=async --run-dir "$out/run-async" \
      --trace "$out/trace-async.json" --trace-step 4 > "$out/run-async.log" 2>&1 || { echo "async run failed"; tail -20 "$out/run-async.log"; rc=1; }
  "$build/bin/megaslide-train" "${common[@]}" --set offload.enabled=false --run-dir "$out/run-resident" > "$out/run-resident.log" 2>&1 \
      || { echo "resident run failed"; tail -20 "$out/run-resident.log"; rc=1; }
  "$build/bin/megaslide-train" "${common[@]}" --set offload.mode=sync --run-dir "$out/run-sync" > "$out/run-sync.log" 2>&1 \
      || { echo "sync run failed"; tail -20 "$out/run-sync.log"; rc=1; }
  return $rc
}
export -f trainer_runs
[ "$built" = true ] && stage trainer 120 65 trainer_runs

# 4b. Data parallelism over NCCL with one rank (the machine has one GPU): the resident trainer launched
# by --nproc-per-node 1 runs its gradient all-reduce through ProcessGroupNCCL; its losses must equal a
# plain run's (a sum over one rank is the identity; within 1e-4 relative, as GPU backward kernels with
# atomics may sum in another order from run to run). docs/distributed.md.
nccl_world1() {
  local common=(--config configs/smoke.yaml --set offload.enabled=false --set train.device=cuda --set train.steps=5
                --set train.checkpoint_every=0 --set output.progress=false --set train.batch_size=4)
  "$build/bin/megaslide-train" "${common[@]}" --run-dir "$out/run-plain" > "$out/run-plain.log" 2>&1 \
      || { echo "plain run failed"; tail -20 "$out/run-plain.log"; return 1; }
  "$build/bin/megaslide-train" "${common[@]}" --set distributed.backend=nccl --set distributed.timeout_s=60 --nproc-per-node 1 \
      --run-dir "$out/run-nccl1" > "$out/run-nccl1.log" 2>&1 || { echo "NCCL run failed"; tail -20 "$out/run-nccl1.log"; return 1; }
  grep -q 'data parallel: 1 ranks (nccl backend' "$out/run-nccl1/train.log" || { echo "the run did not use NCCL"; return 1; }
  python3 - "$out/run-plain/metrics.jsonl" "$out/run-nccl1/metrics.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
print("plain losses", a); print("nccl  losses", b)
sys.exit(0 if len(a) == 5 and len(b) == 5 and all(abs(x - y) <= 1e-4 * abs(x) for x, y in zip(a, b)) else 1)
PY
}
export -f nccl_world1
[ "$built" = true ] && stage nccl_world1 30 35 nccl_world1

# 5. CpuAdamW on this CPU: every test (the AVX-512 path runs here) and the benchmark ------------------
adamw() {
  "$build/bin/test_cpu_adamw" > "$out/test_cpu_adamw.log" 2>&1 || { tail -30 "$out/test_cpu_adamw.log"; return 1; }
  tail -3 "$out/test_cpu_adamw.log"
  "$build/bin/bench_cpu_adamw" --threads 12 --reps 5 --torch-reps 2 | tee "$out/bench_cpu_adamw.txt"
}
export -f adamw
[ "$built" = true ] && stage cpu_adamw 45 0 adamw

# 6. The figures as one JSON file ---------------------------------------------------------------------
stages_json=$(for k in "${!stage_s[@]}"; do printf '"%s":{"seconds":%s,"ok":%s},' "$k" "${stage_s[$k]}" "${stage_ok[$k]}"; done)
failures_json=$(printf '%s\n' "${failures[@]:-}" | python3 -c 'import json,sys; print(json.dumps([l.strip() for l in sys.stdin if l.strip()]))')
python3 - "$out" "{${stages_json%,}}" "$failures_json" "${MEGASLIDE_COMMIT:-unknown}" "$(elapsed)" <<'PY'
import json, os, sys, datetime
out, stages, failures, commit, total = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4], int(sys.argv[5])

def last_json_line(path):
    try:
        lines = [l for l in open(path) if l.strip().startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None

def metrics(run):
    try:
        return [json.loads(l) for l in open(os.path.join(out, run, "metrics.jsonl")) if l.strip()]
    except (OSError, ValueError):
        return []

def gtest(name):
    try:
        j = json.load(open(os.path.join(out, f"gtest-{name}.json")))
    except (OSError, ValueError):
        return None
    cases = [{"name": f"{s['name']}.{t['name']}", "result": "failed" if t.get("failures") else t.get("result", "?"),
              "seconds": float(t.get("time", "0s").rstrip("s"))} for s in j.get("testsuites", []) for t in s.get("testsuite", [])]
    return {"tests": j.get("tests"), "failures": j.get("failures"), "cases": cases}

report = {
    "date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%M:%SZ"),
    "commit": commit,
    "gpu": open(os.path.join(out, "gpu.txt")).read().strip() if os.path.exists(os.path.join(out, "gpu.txt")) else None,
    "cpu": open(os.path.join(out, "cpu.txt")).read().strip() if os.path.exists(os.path.join(out, "cpu.txt")) else None,
    "total_seconds": total,
    "stages": stages,
    "failures": failures,
    "cuda_tests": {t: gtest(t) for t in ["test_weight_streamer", "test_cpu_master_trainer", "test_dsa3d", "test_deformable_slide_attention"]},
    "dsa3d": last_json_line(os.path.join(out, "bench_dsa3d.txt")),
    "cpu_adamw": last_json_line(os.path.join(out, "bench_cpu_adamw.txt")),
    "pinned_bandwidth": last_json_line(os.path.join(out, "pinned.json")),
}

# The streamed trainer: the last step of each run (the first ones warm up), overlap figures.
trainer = {}
for run in ["async", "sync", "resident"]:
    rows = metrics(f"run-{run}")
    if rows:
        r = rows[-1]
        trainer[run] = {k: r.get(k) for k in ["step", "loss", "step_time_s", "h2d_bytes", "d2h_bytes", "exposed_transfer_s",
                                              "optimizer_wait_s", "optimizer_s", "peak_device_bytes", "mfu", "tokens_per_s"]}
        trainer[run]["step_times_s"] = [x.get("step_time_s") for x in rows]
for run in ["async", "sync"]:
    if run in trainer and trainer[run]["step_time_s"]:
        t = trainer[run]
        t["exposed_transfer_fraction"] = t["exposed_transfer_s"] / t["step_time_s"]
        if "resident" in trainer:
            t["step_time_vs_resident"] = t["step_time_s"] / trainer["resident"]["step_time_s"]
# From the trace: how long each stream was busy, the H2D rate while copying, and the overlap of copies
# with compute.
try:
    events = [e for e in json.load(open(os.path.join(out, "trace-async.json")))["traceEvents"] if e.get("ph") == "X"]
    lanes = {1: "compute", 2: "h2d", 3: "d2h", 4: "optimizer"}
    busy = {name: sum(e["dur"] for e in events if e["tid"] == tid) / 1e6 for tid, name in lanes.items()}
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e6
    trace = {"span_s": span, "busy_s": busy}
    if "async" in trainer and busy["h2d"] > 0:
        trace["h2d_gbps_while_copying"] = trainer["async"]["h2d_bytes"] / busy["h2d"] / 1e9
    if "async" in trainer and busy["d2h"] > 0:
        trace["d2h_gbps_while_copying"] = trainer["async"]["d2h_bytes"] / busy["d2h"] / 1e9
    trainer["trace_step"] = trace
except (OSError, ValueError, KeyError):
    pass
report["streamed_trainer"] = trainer
with open(os.path.join(out, "check.json"), "w") as f:
    json.dump(report, f, indent=1)
print(json.dumps({k: report[k] for k in ["commit", "total_seconds", "stages", "failures"]}, indent=1))
for run, t in trainer.items():
    print(run, json.dumps(t))
PY

# What comes back from the device is a few files: check.json, check.log, the trace, and every other log,
# gtest report and metrics file packed into details.tar.gz.
(cd "$out" && find . -type f ! -name check.json ! -name check.log ! -name trace-async.json ! -name details.tar.gz \
   ! -name '*.safetensors' -print0 | tar --null -czf details.tar.gz -T - && \
   find . -mindepth 1 -maxdepth 1 ! -name check.json ! -name check.log ! -name trace-async.json ! -name details.tar.gz \
   -exec rm -rf {} +) || echo "could not pack the details"
echo "=== [$(elapsed) s] done; ${#failures[@]} failed stage(s)"
for f in "${failures[@]:-}"; do [ -n "$f" ] && echo "FAILED: $f"; done
[ ${#failures[@]} -eq 0 ]
