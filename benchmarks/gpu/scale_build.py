"""How long a build measured on few cores would take on more, from its .ninja_log: what a scheduler with
N workers can do with the jobs' measured durations.

    python3 benchmarks/gpu/scale_build.py .ninja_log MEASURED_CORES TARGET_CORES

The model (stated, since the log has no dependency graph): compiles (objects, precompiled headers) are
independent once the precompiled headers exist, so they are scheduled longest-first on the workers
after the longest precompiled header; links run after them, one after the other in the worst case
(libmegaslide first, the executables in parallel after it, so the longest of those). Durations were
measured with MEASURED_CORES jobs at once on MEASURED_CORES cores: on more cores each job is assumed
to take as long (no faster per core, no slower from memory bandwidth). Prints one JSON line.
"""
import heapq
import json
import sys

log, measured, target = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
jobs = {}
with open(log) as f:
    for line in f:
        if line.startswith("#"):
            continue
        parts = line.rstrip("\n").split("\t")
        if len(parts) < 4:
            continue
        start, end, path = int(parts[0]), int(parts[1]), parts[3]
        jobs[path] = (end - start) / 1000.0  # the last build of each output
if not jobs:
    sys.exit("scale_build.py: no jobs in " + log)


def kind(path):
    if path.endswith((".gch", ".pch")):
        return "pch"
    if path.endswith((".o", ".obj")):
        return "compile"
    if ".so" in path.rsplit("/", 1)[-1]:
        return "library"
    return "link"


by_kind = {"pch": [], "compile": [], "library": [], "link": []}
for path, seconds in jobs.items():
    by_kind[kind(path)].append(seconds)
total = sum(jobs.values())


def longest_first(durations, workers):
    heap = [0.0] * workers
    for d in sorted(durations, reverse=True):
        heapq.heappush(heap, heapq.heappop(heap) + d)
    return max(heap) if durations else 0.0


def estimate(workers):
    pch = max(by_kind["pch"], default=0.0)
    compiles = longest_first(by_kind["compile"] + sorted(by_kind["pch"])[:-1], workers)
    return pch + compiles + sum(by_kind["library"]) + max(by_kind["link"], default=0.0)


print(json.dumps({"jobs": len(jobs), "job_seconds_total": round(total, 1),
                  "seconds_by_kind": {k: round(sum(v), 1) for k, v in by_kind.items()},
                  "longest_job_s": round(max(jobs.values()), 1),
                  f"model_{measured}_cores_s": round(estimate(measured), 1),
                  f"model_{target}_cores_s": round(estimate(target), 1)}))
