"""check.json from what benchmarks/gpu/check.sh's stages left in its output folder (also after a failed
preflight, when most of it is missing).

    python3 benchmarks/gpu/check_report.py OUT STAGES_JSON FAILURES_JSON COMMIT TOTAL_S REHEARSAL
"""
import datetime
import json
import os
import re
import statistics
import sys

out, stages, failures, commit, total, rehearsal = (sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]),
                                                  sys.argv[4], int(sys.argv[5]), sys.argv[6] == "1")
path = lambda name: os.path.join(out, name)  # noqa: E731


def read_json(name):
    try:
        with open(path(name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def last_json_line(name):
    try:
        lines = [l for l in open(path(name)) if l.strip().startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def metrics(run):
    try:
        return [json.loads(l) for l in open(path(os.path.join(run, "metrics.jsonl"))) if l.strip()]
    except (OSError, ValueError):
        return []


def gtest(name):
    j = read_json(f"gtest-{name}.json")
    if j is None:
        return None
    cases = [{"name": f"{s['name']}.{t['name']}", "result": "failed" if t.get("failures") else t.get("result", "?"),
              "seconds": float(t.get("time", "0s").rstrip("s"))} for s in j.get("testsuites", []) for t in s.get("testsuite", [])]
    return {"tests": j.get("tests"), "failures": j.get("failures"), "cases": cases}


def memcheck():
    try:
        text = open(path("memcheck.log")).read()
    except OSError:
        return None
    m = re.search(r"ERROR SUMMARY: (\d+) error", text)
    return {"errors": int(m.group(1)) if m else None, "tests_passed": "[  PASSED  ]" in text}


preflight = read_json("preflight.json") or {}
report = {
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "commit": commit,
    "rehearsal": rehearsal,
    "preflight": preflight,
    "total_seconds": total,
    "stages": stages,
    "failures": failures,
    "cuda_tests": {t: gtest(t) for t in ["test_weight_streamer", "test_cpu_master_trainer", "test_stack_trainer",
                                         "test_dsa3d", "test_deformable_slide_attention", "test_data_loader"]},
    "memcheck": memcheck(),
    "dsa3d": last_json_line("bench_dsa3d.txt"),
    "cpu_adamw": last_json_line("bench_cpu_adamw.txt"),
    "cpu_adamw_avx2": last_json_line("bench_cpu_adamw_avx2.txt"),
    "cpu_dsa3d_bf16_dots": last_json_line("bench_dsa3d_bf16_dots.txt"),
    "nvme": last_json_line("bench_nvme.txt"),
    "pinned_bandwidth": last_json_line("pinned.json"),
}

# The streamed trainer: each run's figures are the median over its steps 2-4 (step 1 warms up; the traced
# step of the async run is step 5, outside them).
FIELDS = ["step_time_s", "h2d_bytes", "d2h_bytes", "exposed_transfer_s", "optimizer_wait_s", "optimizer_s",
          "peak_device_bytes", "mfu", "tokens_per_s"]
trainer = {}
for run in ["async", "async-noclip", "sync", "async-fp32", "resident", "lora", "lora-fp8"]:
    rows = metrics(f"run-{run}")
    window = [r for r in rows if 2 <= r.get("step", 0) <= 4]
    if not window:
        continue
    t = {"steps": [r.get("step") for r in window], "loss": [r.get("loss") for r in rows]}
    for k in FIELDS:
        values = [r[k] for r in window if isinstance(r.get(k), (int, float))]
        t[k] = statistics.median(values) if values else None
    t["step_times_s"] = [r.get("step_time_s") for r in rows]
    if t["step_time_s"] and t["exposed_transfer_s"] is not None:
        t["exposed_transfer_fraction"] = t["exposed_transfer_s"] / t["step_time_s"]
    trainer[run] = t


def ratio(a, b):
    if a in trainer and b in trainer and trainer[a]["step_time_s"] and trainer[b]["step_time_s"]:
        return trainer[a]["step_time_s"] / trainer[b]["step_time_s"]
    return None


# Like with like: the streamed fp32 step against the resident fp32 step is the cost of streaming; bf16
# against fp32 (both streamed) is the compute dtype's gain.
trainer["ratios"] = {"async_fp32_vs_resident_fp32": ratio("async-fp32", "resident"),
                     "async_bf16_vs_async_fp32": ratio("async", "async-fp32"),
                     "sync_bf16_vs_async_bf16": ratio("sync", "async"),
                     "immediate_vs_deferred_updates": ratio("async-noclip", "async"),
                     # LoRA (rank 16) on the same model, its base frozen and streamed H2D only: its step
                     # against full fine-tuning's (async bf16), and an fp8 base's against a bf16 base's.
                     "lora_vs_full_step": ratio("lora", "async"),
                     "lora_fp8_vs_bf16_base_step": ratio("lora-fp8", "lora")}
if "lora" in trainer and "lora-fp8" in trainer and trainer["lora"]["h2d_bytes"]:
    trainer["ratios"]["lora_fp8_vs_bf16_h2d_bytes"] = trainer["lora-fp8"]["h2d_bytes"] / trainer["lora"]["h2d_bytes"]
# From the trace of step 5: how long each stream was busy, the H2D rate while copying, the span.
try:
    events = [e for e in json.load(open(path("trace-async.json")))["traceEvents"] if e.get("ph") == "X"]
    lanes = {1: "compute", 2: "h2d", 3: "d2h", 4: "optimizer"}
    busy = {name: sum(e["dur"] for e in events if e["tid"] == tid) / 1e6 for tid, name in lanes.items()}
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e6
    trace = {"span_s": span, "busy_s": busy}
    traced = next((r for r in metrics("run-async") if r.get("step") == 5), None)
    if traced and busy["h2d"] > 0:
        trace["h2d_gbps_while_copying"] = traced["h2d_bytes"] / busy["h2d"] / 1e9
    if traced and busy["d2h"] > 0:
        trace["d2h_gbps_while_copying"] = traced["d2h_bytes"] / busy["d2h"] / 1e9
    trainer["trace_step"] = trace
except (OSError, ValueError, KeyError, TypeError):
    pass
report["streamed_trainer"] = trainer
with open(path("check.json"), "w") as f:
    json.dump(report, f, indent=1)
print(json.dumps({k: report[k] for k in ["commit", "rehearsal", "total_seconds", "stages", "failures"]}, indent=1))
for run, t in trainer.items():
    print(run, json.dumps(t))
