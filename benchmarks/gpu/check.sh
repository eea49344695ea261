#!/usr/bin/env bash
# The one GPU check for a lent GPU machine (one H200, 16 cores, python3 3.12 with torch 2.11+cu130 in a
# virtual environment, nvcc 13.0, no package registry, no Debian -dev packages), in one device call:
#
#   0. preflight (seconds): nvcc, cmake, ninja, a C++ compiler, a python3 whose torch sees the GPU, the
#      NCCL header of that torch, the carried C++ headers; prints versions, cores, memory, `ulimit -l`.
#      What is missing fails here, with check.json written, instead of minutes later;
#   1. build of the targets below only (no FFmpeg, ICU or SentencePiece: none is needed here), with the
#      NCCL header of the torch it links first on the include path;
#   2. the *_CUDA tests of the streamer, both trainers' engines (a step of part of the stack too),
#      3D-DSA, its module and the loader;
#   3. one compute-sanitizer memcheck pass over the 3D-DSA CUDA tests;
#   4. the streamed trainer a few steps: async bf16 with a Chrome trace (clipped: deferred updates),
#      async bf16 with grad_clip 0 (immediate updates), sync bf16, async fp32 beside the resident fp32 loop
#      (the same arithmetic, so their ratio is the streaming's cost), LoRA rank 16 on the frozen base with
#      bf16 and with fp8 blocks (upcast on the GPU); each run's figures are the median of its steps 2-4
#      (step 1 warms up; the traced step is step 5 and not among them);
#   5. bench_dsa3d --cuda (3D-DSA against flash SDPA); a one-rank NCCL run against a plain one;
#      the AVX-512 CpuAdamW tests and bench_cpu_adamw (CPUID's path, then --path avx2) on that machine's CPU;
#      bench_dsa3d --bf16-dots (the 3D-DSA AVX512-BF16 loops against the AVX-512 ones) on that CPU;
#      bench_nvme on its disk;
#   6. every figure as one JSON file. Exits non-zero when any stage fails; later stages still run.
#
# On this machine first (once): ../shared/tools/device-deps.sh .devdeps && echo /.devdeps/ >> .git/info/exclude
# Then with the device tool: carry [".devdeps"], timeout_s 600,
#   command: MEGASLIDE_COMMIT=<sha> bash benchmarks/gpu/check.sh
# Results: $OUT/check.json (commit it as benchmarks/results/<date>-<machine>.json), $OUT/check.log (all
# output), $OUT/trace-async.json (open in ui.perfetto.dev), $OUT/details.tar.gz (every log). Sized to end
# within MEGASLIDE_CHECK_BUDGET_S (default 510 s); benchmarks/gpu/rehearse.sh runs it here in a root that
# holds only what the lent machine holds (docs/benchmarks.md has its log, the build stage's measured time
# and how it scales to 16 cores).
#
# MEGASLIDE_CHECK_REHEARSAL=1 (set by rehearse.sh, on a machine without a GPU): the missing GPU is
# recorded instead of ending the check in the preflight; every stage that needs the GPU then fails at
# once with "no GPU". MEGASLIDE_CHECK_TIME_SCALE=N (rehearse.sh: 16 / its cores) gives every stage N
# times its time.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-build-gpu/results}
mkdir -p "$out"
exec > >(tee -a "$out/check.log") 2>&1
build=${MEGASLIDE_CHECK_BUILD:-build-gpu}  # an existing build folder is reused as configured
jobs=$(nproc)
rehearsal=${MEGASLIDE_CHECK_REHEARSAL:-0}
start_s=$(date +%s)
# Every stage's limit is cut so that the stages after it keep their reserve. MEGASLIDE_CHECK_TIME_SCALE
# multiplies the budget and every limit and reserve (rehearse.sh: 16 / its cores).
time_scale=${MEGASLIDE_CHECK_TIME_SCALE:-1}
deadline_s=$(( start_s + ${MEGASLIDE_CHECK_BUDGET_S:-510} * time_scale ))
failures=()
declare -A stage_s
declare -A stage_ok
elapsed() { echo $(( $(date +%s) - start_s )); }

# stage NAME TIMEOUT_S RESERVE_S FUNCTION: runs one stage (an exported function) under a timeout of at
# most TIMEOUT_S that leaves RESERVE_S of the budget to the stages after it; records its time and status.
stage() {
  local name=$1 limit=$(( $2 * time_scale )) reserve=$(( $3 * time_scale )) fn=$4
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

# The report: check.json from whatever the stages left in $out (also after a failed preflight).
write_report() {
  local stages_json failures_json
  stages_json=$(for k in "${!stage_s[@]}"; do printf '"%s":{"seconds":%s,"ok":%s},' "$k" "${stage_s[$k]}" "${stage_ok[$k]}"; done)
  failures_json=$(printf '%s\n' "${failures[@]:-}" | python3 -c 'import json,sys; print(json.dumps([l.strip() for l in sys.stdin if l.strip()]))' 2>/dev/null || echo '[]')
  python3 benchmarks/gpu/check_report.py "$out" "{${stages_json%,}}" "$failures_json" "${MEGASLIDE_COMMIT:-unknown}" "$(elapsed)" "$rehearsal" \
    || echo "could not write check.json"
}

# 0. Preflight ---------------------------------------------------------------------------------------
echo "=== [$(elapsed) s] preflight"
if ! command -v python3 > /dev/null; then
  echo "preflight: no python3 on PATH (the lent machine's holds torch)"
  printf '{"preflight":{"fatal":["no python3 on PATH"]},"failures":["preflight"]}\n' > "$out/check.json"
  exit 1
fi
python3 benchmarks/gpu/preflight.py "$out/preflight.json" "$rehearsal"
preflight_rc=$?
stage_s[preflight]=$(elapsed)
if [ $preflight_rc -ne 0 ]; then
  stage_ok[preflight]=false
  failures+=("preflight (see preflight.json: fatal)")
  write_report
  echo "=== [$(elapsed) s] stopped: an essential is missing"
  exit 1
fi
stage_ok[preflight]=true
# The preflight's findings, for the stages: the torch, its NCCL header, the GPU.
torch_cmake="" nccl_include="" gpu_visible=""
. "$out/preflight.env"
prefix="$torch_cmake"
if [ -d .devdeps/usr ]; then
  prefix="$PWD/.devdeps/usr;$torch_cmake"
  export LD_LIBRARY_PATH="$PWD/.devdeps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
export build out prefix jobs nccl_include gpu_visible

# Every GPU stage starts with this: without a GPU (the rehearsal) it fails at once, saying so.
need_gpu() { [ "$gpu_visible" = True ] || { echo "no GPU: this stage needs one (torch.cuda.is_available() is false)"; return 1; }; }
export -f need_gpu

# 1. Build ------------------------------------------------------------------------------------------
build_all() {
  local targets=(megaslide megaslide-train test_weight_streamer test_cpu_master_trainer test_stack_trainer test_dsa3d
                 test_deformable_slide_attention test_data_loader test_cpu_adamw bench_dsa3d bench_cpu_adamw bench_streamer
                 bench_nvme)
  if [ ! -f "$build/CMakeCache.txt" ]; then
    local nccl=()
    [ -n "$nccl_include" ] && nccl=(-DMEGASLIDE_NCCL_INCLUDE_DIR="$nccl_include")
    cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" "${nccl[@]}" \
          -DMEGASLIDE_VIDEO=OFF -DMEGASLIDE_ICU=OFF -DMEGASLIDE_SENTENCEPIECE=OFF -DMEGASLIDE_CUDA=ON \
          > "$out/configure.log" 2>&1 || { tail -40 "$out/configure.log"; return 1; }
    grep -E '^-- MegaSlide:' "$out/configure.log"
  fi
  # -k 0: a target that fails to compile does not stop the others; the stages below use what was built.
  cmake --build "$build" -j"$jobs" --target "${targets[@]}" -- -k 0 > "$out/build.log" 2>&1 \
    || { grep -B2 -A12 'error' "$out/build.log" | head -80; return 1; }
  cp "$build/.ninja_log" "$out/ninja_log.txt" 2>/dev/null || true
}
export -f build_all
stage build 330 170 build_all
built=false
[ -f "$build/lib/libmegaslide.so" ] && built=true

# 2. The *_CUDA tests (a skipped one means no GPU was visible: a failure here) ---------------------
cuda_tests() {
  need_gpu || return 1
  local rc=0
  for t in test_weight_streamer test_cpu_master_trainer test_stack_trainer test_dsa3d test_deformable_slide_attention test_data_loader; do
    [ -x "$build/bin/$t" ] || { echo "$t not built"; rc=1; continue; }
    "$build/bin/$t" --gtest_filter='*_CUDA*' --gtest_output="json:$out/gtest-$t.json" > "$out/$t.log" 2>&1 || rc=1
    grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[       OK|^\[  FAILED' "$out/$t.log" | tail -40
    if grep -q '\[  SKIPPED \]' "$out/$t.log"; then echo "$t: CUDA tests skipped: no device visible"; rc=1; fi
  done
  return $rc
}
export -f cuda_tests
[ "$built" = true ] && stage cuda_tests 100 140 cuda_tests

# 3. compute-sanitizer memcheck over the 3D-DSA kernels (out-of-bounds and misaligned accesses, errors
# of the API calls); the tests' shapes are small, but memcheck runs kernels tens of times slower.
memcheck() {
  need_gpu || return 1
  command -v compute-sanitizer > /dev/null || { echo "compute-sanitizer not on PATH"; return 1; }
  compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 "$build/bin/test_dsa3d" \
      --gtest_filter='Dsa3dCuda.TiledFloat64MatchesReference_CUDA:Dsa3dCuda.TiledAcrossHaloChunks_CUDA:Dsa3dCuda.KernelsMatchFloat64Reference_CUDA:Dsa3dCuda.TiledDeterminism_CUDA' \
      > "$out/memcheck.log" 2>&1
  local rc=$?
  grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED) |Invalid|out of bounds' "$out/memcheck.log" | head -30
  return $rc
}
export -f memcheck
[ "$built" = true ] && stage memcheck 60 110 memcheck

# 4. The streamed trainer on the GPU: pinned bandwidth, then five runs of one model ---------------------
trainer_runs() {
  need_gpu || return 1
  "$build/bin/bench_streamer" --pinned-bandwidth 1 | tail -1 > "$out/pinned.json" || return 1
  cat "$out/pinned.json"
  local common=(--config configs/h100nvl-1b.yaml --set model.layers=8 --set model.hidden=2048 --set model.heads=16
                --set model.text_dim=1024 --set model.patch=[1,4,4] --set train.batch_size=2 --set train.steps=4
                --set train.log_every=1 --set train.device=cuda --set output.progress=false
                --set train.checkpoint_every=0)  # threads: the shipped defaults
  local rc=0
  run() {  # run NAME ARGS...: one megaslide-train run into $out/run-NAME
    local name=$1; shift
    "$build/bin/megaslide-train" "${common[@]}" "$@" --run-dir "$out/run-$name" > "$out/run-$name.log" 2>&1 \
      || { echo "$name run failed"; tail -20 "$out/run-$name.log"; rc=1; }
  }
  run async --set offload.mode=async --set offload.compute_dtype=bf16 --set train.steps=5 \
      --trace "$out/trace-async.json" --trace-step 5
  run async-noclip --set offload.mode=async --set offload.compute_dtype=bf16 --set train.grad_clip=0
  run sync --set offload.mode=sync --set offload.compute_dtype=bf16
  run async-fp32 --set offload.mode=async --set offload.compute_dtype=fp32
  run resident --set offload.enabled=false
  # LoRA on the frozen, streamed base (H2D only; docs/lora.md), bf16 blocks and fp8 blocks upcast on the GPU.
  run lora --set offload.mode=async --set offload.compute_dtype=bf16 --set lora.rank=16
  run lora-fp8 --set offload.mode=async --set offload.compute_dtype=bf16 --set lora.rank=16 --set lora.base_dtype=fp8
  return $rc
}
export -f trainer_runs
[ "$built" = true ] && stage trainer 190 75 trainer_runs

# 5. 3D-DSA against flash SDPA (CUDA events) ------------------------------------------------------------
dsa3d_bench() { need_gpu || return 1; "$build/bin/bench_dsa3d" --cuda --reps 5 | tee "$out/bench_dsa3d.txt"; }
export -f dsa3d_bench
[ "$built" = true ] && stage dsa3d_bench 60 60 dsa3d_bench

# 5b. Data parallelism over NCCL with one rank (the machine has one GPU): the resident trainer launched
# by --nproc-per-node 1 runs its gradient all-reduce through ProcessGroupNCCL; its losses must equal a
# plain run's (a sum over one rank is the identity; within 1e-4 relative, as GPU backward kernels with
# atomics may sum in another order from run to run). docs/distributed.md.
nccl_world1() {
  need_gpu || return 1
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

# 6. CpuAdamW on this CPU: every test (the AVX-512 path runs here) and the benchmark (no GPU needed) ----
adamw() {
  "$build/bin/test_cpu_adamw" > "$out/test_cpu_adamw.log" 2>&1 || { tail -30 "$out/test_cpu_adamw.log"; return 1; }
  tail -3 "$out/test_cpu_adamw.log"
  "$build/bin/bench_cpu_adamw" --threads $(( jobs > 4 ? jobs - 4 : jobs )) --reps 5 --torch-reps 2 --deepspeed 0 | tee "$out/bench_cpu_adamw.txt" || return 1
  # The AVX2 loops on the same cores: the narrow moments' roofline fractions where a core has less bandwidth than
  # the 2-core VMs' (docs/cpu-adamw.md: arithmetic-bound there on AVX2).
  "$build/bin/bench_cpu_adamw" --path avx2 --threads $(( jobs > 4 ? jobs - 4 : jobs )) --reps 5 --torch-reps 1 --deepspeed 0 | tee "$out/bench_cpu_adamw_avx2.txt"
}
export -f adamw
[ "$built" = true ] && stage cpu_adamw 45 25 adamw

# 6a. The 3D-DSA row kernel's AVX512-BF16 loops against its AVX-512 loops on this CPU (bf16 at d = 64; skipped,
# saying so, where the CPU lacks AVX512-BF16; docs/3d-dsa.md): their first figures on an Intel core. No GPU needed.
dsa3d_bf16_cpu() { "$build/bin/bench_dsa3d" --bf16-dots --threads $(( jobs > 4 ? jobs - 4 : jobs )) --reps 5 | tee "$out/bench_dsa3d_bf16_dots.txt"; }
export -f dsa3d_bf16_cpu
[ "$built" = true ] && stage cpu_dsa3d_bf16 20 20 dsa3d_bf16_cpu

# 6b. The NVMe tier (offload.state_tier: nvme) on this machine's disk: 6 GB of state through the pager against
# the disk's own O_DIRECT rate (docs/offload.md, "The NVMe tier"); no GPU needed.
nvme_bench() { "$build/bin/bench_nvme" --dir "${MEGASLIDE_CHECK_NVME_DIR:-/tmp}" | tee "$out/bench_nvme.txt"; }
export -f nvme_bench
[ "$built" = true ] && stage nvme_bench 40 0 nvme_bench

# 7. The figures as one JSON file -----------------------------------------------------------------------
write_report

# What comes back from the device is a few files: check.json, check.log, the trace, and every other log,
# gtest report and metrics file packed into details.tar.gz.
(cd "$out" && find . -type f ! -name check.json ! -name check.log ! -name trace-async.json ! -name details.tar.gz \
   ! -name '*.safetensors' -print0 | tar --null -czf details.tar.gz -T - && \
   find . -mindepth 1 -maxdepth 1 ! -name check.json ! -name check.log ! -name trace-async.json ! -name details.tar.gz \
   -exec rm -rf {} +) || echo "could not pack the details"
echo "=== [$(elapsed) s] done; ${#failures[@]} failed stage(s)"
for f in "${failures[@]:-}"; do [ -n "$f" ] && echo "FAILED: $f"; done
[ ${#failures[@]} -eq 0 ]
