#!/usr/bin/env bash
# Cross-check (by hand, not part of ctest): the reference safetensors implementation (the `safetensors`
# PyPI package, whose parser is the Rust crate) reads a file MegaSlide wrote, and agrees with the
# header. Installs safetensors and numpy into a scratch folder; the C++ tests do not depend on Python.
#
#   tests/support/safetensors_python_check.sh model.safetensors
set -euo pipefail
file=${1:?usage: $0 FILE.safetensors}
py=${MEGASLIDE_PY_SCRATCH:-/tmp/megaslide-safetensors-py}
[ -d "$py/safetensors" ] || python3 -m pip install --quiet --disable-pip-version-check --target "$py" safetensors numpy
PYTHONPATH="$py" python3 - "$file" <<'EOF'
import json, sys
import numpy as np
from safetensors import safe_open, deserialize

path = sys.argv[1]
with open(path, "rb") as f:
    data = f.read()
tensors = deserialize(data)           # the Rust parser: validates header, offsets, sizes, coverage
with safe_open(path, framework="numpy") as f:
    metadata = f.metadata() or {}

def values(entry):
    raw, dtype = bytes(entry["data"]), entry["dtype"].upper()
    if dtype in ("BF16", "BFLOAT16"):  # numpy has no bf16: widen the bits to float32
        return (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, dtype={"F32": np.float32, "FLOAT32": np.float32, "F64": np.float64, "FLOAT64": np.float64,
                                      "F16": np.float16, "FLOAT16": np.float16, "I64": np.int64, "INT64": np.int64,
                                      "I32": np.int32, "INT32": np.int32}[dtype])

summary = {name: {"dtype": e["dtype"], "shape": e["shape"], "sum": float(values(e).astype(np.float64).sum())}
           for name, e in tensors}
print(json.dumps({"tensors": len(tensors), "metadata_keys": sorted(metadata), "first": dict(list(summary.items())[:3])}, indent=1))
assert all(np.isfinite(s["sum"]) for s in summary.values())
print("python safetensors read", len(tensors), "tensors from", path)
EOF
