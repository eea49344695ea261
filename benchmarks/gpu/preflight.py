"""The preflight of benchmarks/gpu/check.sh: within seconds, whether this machine holds what the check
needs, and what it is. Prints one line per finding, writes them to a JSON file, exits 1 when an
essential is missing (0 otherwise). A missing GPU is essential unless the check is a rehearsal.

    python3 benchmarks/gpu/preflight.py OUT.json REHEARSAL(0|1)
"""
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time

started = time.monotonic()
out_path, rehearsal = sys.argv[1], sys.argv[2] == "1"
report = {"rehearsal": rehearsal, "fatal": [], "warnings": []}


def fatal(what):
    report["fatal"].append(what)
    print(f"preflight: MISSING: {what}")


def warn(what):
    report["warnings"].append(what)
    print(f"preflight: warning: {what}")


def first_line(cmd):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    text = (r.stdout or r.stderr).strip()
    return (text if r.returncode == 0 else None), text


def version_in(text):
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", text or "")
    return m.group(1) if m else None


# Tools ---------------------------------------------------------------------------------------------
tools = {}
for name, cmd, essential in [("nvcc", ["nvcc", "--version"], True), ("cmake", ["cmake", "--version"], True),
                             ("ninja", ["ninja", "--version"], True), ("c++", ["c++", "--version"], True),
                             ("compute-sanitizer", ["compute-sanitizer", "--version"], False),
                             ("nvidia-smi", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                             "--format=csv,noheader"], False)]:
    path = shutil.which(cmd[0])
    ok, text = first_line(cmd) if path else (None, "not on PATH")
    if name == "nvcc" and ok:
        m = re.search(r"release (\d+\.\d+)", ok)
        tools[name] = {"path": path, "version": m.group(1) if m else version_in(ok)}
    elif name == "nvidia-smi":
        tools[name] = {"path": path, "gpus": ok.splitlines() if ok else None}
    else:
        tools[name] = {"path": path, "version": version_in(ok.splitlines()[0]) if ok else None}
    print(f"preflight: {name}: {tools[name]}")
    if ok is None:
        (fatal if essential else warn)(f"{name} ({text.splitlines()[0] if text else 'failed'})")
report["tools"] = tools
cmake_version = tools["cmake"].get("version")
if cmake_version and tuple(int(x) for x in cmake_version.split(".")[:2]) < (3, 25):
    fatal(f"cmake {cmake_version} is older than 3.25 (CMakeLists.txt)")

# Python and its torch ---------------------------------------------------------------------------------
report["python"] = {"executable": sys.executable, "version": sys.version.split()[0]}
print(f"preflight: python3 {sys.version.split()[0]} at {sys.executable}")
report["gpu_visible"] = False
try:
    import torch
except Exception as e:  # noqa: BLE001 - any import failure is the finding
    torch = None
    fatal(f"python3 cannot import torch: {e}")
if torch is not None:
    t = {"version": torch.__version__, "cuda": torch.version.cuda, "cmake_prefix_path": torch.utils.cmake_prefix_path}
    try:
        t["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception as e:  # noqa: BLE001
        t["nccl"] = None
        warn(f"torch.cuda.nccl.version() failed: {e}")
    visible = torch.cuda.is_available()
    report["gpu_visible"] = visible
    if visible:
        p = torch.cuda.get_device_properties(0)
        t["gpu"] = {"name": p.name, "count": torch.cuda.device_count(), "capability": f"{p.major}.{p.minor}",
                    "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count}
    print(f"preflight: torch {t}")
    report["torch"] = t
    report["torch_cmake"] = t["cmake_prefix_path"]
    api = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc", "api", "include", "torch", "torch.h")
    if not os.path.isfile(api):
        fatal(f"torch's C++ headers are not in its wheel folder ({api})")
    if not visible:
        if rehearsal:
            warn("no GPU (rehearsal: the GPU stages will fail at once)")
        else:
            fatal("torch sees no GPU (torch.cuda.is_available() is false)")
    nvcc = tools["nvcc"].get("version")
    if nvcc and t["cuda"] and nvcc.split(".")[0] != t["cuda"].split(".")[0]:
        fatal(f"nvcc is CUDA {nvcc} but torch was built for CUDA {t['cuda']}")
    # The NCCL header of this torch: the pip nvidia-nccl wheel beside it (what libtorch_cuda loads).
    site = os.path.dirname(os.path.dirname(torch.__file__))
    header = os.path.join(site, "nvidia", "nccl", "include", "nccl.h")
    if os.path.isfile(header):
        text = open(header, encoding="utf-8", errors="replace").read()
        parts = [re.search(rf"#define NCCL_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
        header_version = ".".join(m.group(1) for m in parts if m)
        report["nccl_include"] = os.path.dirname(header)
        report["nccl_header_version"] = header_version
        print(f"preflight: NCCL header {header_version} at {header}; torch loads NCCL {t['nccl']}")
        if t["nccl"] and header_version.split(".")[:2] != t["nccl"].split(".")[:2]:
            fatal(f"the NCCL header beside torch is {header_version} but torch loads NCCL {t['nccl']}")
    else:
        report["nccl_include"] = None
        warn(f"no NCCL header beside torch ({header}): the build finds another or has no nccl backend")

# The C++ dependencies' headers (carried in .devdeps, or the system's) ------------------------------------
roots = [os.path.join(os.getcwd(), ".devdeps/usr/include"), "/usr/include", "/usr/local/include"]
headers = {}
for h in ["fmt/format.h", "spdlog/spdlog.h", "yaml-cpp/yaml.h", "CLI/CLI.hpp", "gtest/gtest.h", "benchmark/benchmark.h",
          "nlohmann/json.hpp"]:
    found = next((os.path.join(r, h) for r in roots if os.path.isfile(os.path.join(r, h))), None)
    headers[h] = found
    if found is None:
        fatal(f"the header {h} (carry .devdeps: ../shared/tools/device-deps.sh)")
report["headers"] = headers
print(f"preflight: headers {'all found' if all(headers.values()) else headers}")

# The machine ----------------------------------------------------------------------------------------------
mem_kib = None
try:
    with open("/proc/meminfo") as f:
        mem_kib = int(next(l for l in f if l.startswith("MemTotal")).split()[1])
except (OSError, StopIteration, ValueError):
    pass
soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
limit = lambda v: "unlimited" if v == resource.RLIM_INFINITY else v  # noqa: E731
cpu_model = None
try:
    with open("/proc/cpuinfo") as f:
        text = f.read()
    m = re.search(r"model name\s*:\s*(.*)", text)
    cpu_model = m.group(1) if m else None
    flags = set(re.search(r"flags\s*:\s*(.*)", text).group(1).split()) if "flags" in text else set()
except OSError:
    flags = set()
report["machine"] = {"cores": os.cpu_count(), "cpu": cpu_model,
                     "avx512": {f: f in flags for f in ("avx512f", "avx512_bf16", "amx_bf16")},
                     "memory_gib": round(mem_kib / 2**20, 1) if mem_kib else None,
                     "ulimit_l": {"soft": limit(soft), "hard": limit(hard)},
                     "disk_free_gib": round(shutil.disk_usage(os.getcwd()).free / 2**30, 1)}
print(f"preflight: machine {report['machine']}")
if report["machine"]["disk_free_gib"] < 5:
    fatal(f"only {report['machine']['disk_free_gib']} GiB free on the disk (the build needs about 5)")

report["seconds"] = round(time.monotonic() - started, 2)
with open(out_path, "w") as f:
    json.dump(report, f, indent=1)
# What check.sh's stages need, as shell assignments beside the JSON (OUT.env).
with open(os.path.splitext(out_path)[0] + ".env", "w") as f:
    for key in ("torch_cmake", "nccl_include", "gpu_visible"):
        f.write(f"{key}={shlex.quote(str(report.get(key) or ''))}\n")
print(f"preflight: {len(report['fatal'])} missing, {len(report['warnings'])} warning(s), {report['seconds']} s")
sys.exit(1 if report["fatal"] else 0)
