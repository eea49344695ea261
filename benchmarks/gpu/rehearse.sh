#!/usr/bin/env bash
# Rehearses benchmarks/gpu/check.sh on this machine (no GPU) in a root that holds only what the lent GPU
# machine holds, so that the first device call, which has no second try, does not stop at configure or
# build. Not part of CI; its log and timings are in docs/benchmarks.md.
#
# The root (built once, kept in MEGASLIDE_REHEARSAL_ROOT, default /var/tmp/megaslide-rehearsal):
#   - Debian stable (trixie) by debootstrap, minbase, with g++, cmake, ninja-build, python3 and
#     python3-venv only: no library -dev package (the compiler's own libc6-dev and libstdc++-dev aside),
#     no FFmpeg, ICU, SentencePiece or Gloo headers, no ccache;
#   - python3 3.13 (another minor version than the lent machine's 3.12 and this machine's) with
#     torch==2.11.0 and the nvidia-* wheels it requires in /opt/torch/.venv, as the lent machine keeps
#     its torch: NCCL's header exists only in that environment's nvidia/nccl/include;
#   - this machine's CUDA 13.0 toolkit as /usr/local/cuda-13.0, without the NCCL and cuDNN files that
#     this machine's copy holds (NVIDIA's toolkit, which the lent machine has, carries neither).
# Then the work tree as the device tool sends it (tracked files, untracked files git does not ignore,
# and the carried .devdeps from ../shared/tools/device-deps.sh) is copied to /work/repo there, and
# check.sh runs in it with MEGASLIDE_CHECK_REHEARSAL=1 on this machine's cores, its stage limits scaled
# by 16 / cores (the lent machine has 16). Every stage up to the first GPU call must pass; the GPU stages
# must fail at once with "no GPU". Exits 0 when that is what happened.
#
#   sudo benchmarks/gpu/rehearse.sh [RESULTS_DIR]     # default RESULTS_DIR: build-rehearsal
#   sudo benchmarks/gpu/rehearse.sh --prepare         # only make the root (minutes of downloads)
#
# Needs root (debootstrap, chroot, bind mounts) and, the first time, Debian's mirror and PyPI.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
prepare_only=false
[ "${1:-}" = --prepare ] && { prepare_only=true; shift; }
results=$(realpath -m "${1:-build-rehearsal}")
root=${MEGASLIDE_REHEARSAL_ROOT:-/var/tmp/megaslide-rehearsal}
cuda=${MEGASLIDE_REHEARSAL_CUDA:-/usr/local/cuda-13.0}
torch_version=2.11.0
log() { printf '[rehearse] %s\n' "$*"; }
[ "$(id -u)" -eq 0 ] || { echo "rehearse.sh: needs root (debootstrap, chroot, mount)" >&2; exit 2; }

# 1. The root -------------------------------------------------------------------------------------------
if [ ! -f "$root/.megaslide-root" ]; then
  command -v debootstrap > /dev/null || apt-get install -y -qq debootstrap
  log "debootstrap trixie into $root"
  mkdir -p "$root"
  debootstrap --variant=minbase --include=g++,cmake,ninja-build,python3,python3-venv,ca-certificates,procps,xz-utils \
    trixie "$root" http://deb.debian.org/debian > "$root.debootstrap.log" 2>&1 || { tail -20 "$root.debootstrap.log"; exit 1; }
  touch "$root/.megaslide-root"
fi
if [ ! -f "$root/.megaslide-torch-$torch_version" ]; then
  # The wheels are fetched here (this machine's pip settings reach PyPI) for the root's python3, then
  # installed there without an index, as the lent machine, which has none, would hold them.
  py=$(chroot "$root" python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  log "torch==$torch_version and its nvidia-* wheels for python $py into $root/opt/torch/.venv"
  rm -rf "$root/wheels" && mkdir -p "$root/wheels"
  platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
  for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done  # pip matches each N exactly
  python3 -m pip download --quiet --only-binary=:all: --python-version "$py" --implementation cp "${platforms[@]}" \
    -d "$root/wheels" "torch==$torch_version"
  chroot "$root" bash -c "python3 -m venv /opt/torch/.venv && /opt/torch/.venv/bin/pip install --quiet --no-index \
    --find-links /wheels torch==$torch_version"
  rm -rf "$root/wheels"
  touch "$root/.megaslide-torch-$torch_version"
fi
if [ ! -f "$root/.megaslide-cuda" ]; then
  log "the CUDA toolkit $cuda into the root, without NCCL and cuDNN"
  mkdir -p "$root$(dirname "$cuda")"
  tar -C "$(dirname "$cuda")" --exclude='*nccl*' --exclude='*cudnn*' -cf - "$(basename "$cuda")" | tar -C "$root$(dirname "$cuda")" -xf -
  ln -sfn "$(basename "$cuda")" "$root/usr/local/cuda"
  touch "$root/.megaslide-cuda"
fi
# What the root holds, for the log: no -dev package beyond the compiler's, no nccl.h outside the venv.
dev_packages=$(chroot "$root" dpkg-query -W -f '${Package}\n' | grep -- '-dev$' | tr '\n' ' ')
log "Debian -dev packages in the root: $dev_packages(the compiler's own)"
log "nccl.h in the root: $(cd "$root" && find . -name nccl.h -not -path './proc/*' 2>/dev/null | tr '\n' ' ')"
$prepare_only && exit 0

# 2. The work tree as the device tool sends it, and the carried folder ------------------------------------
[ -d .devdeps/usr ] || { log "making .devdeps (../shared/tools/device-deps.sh)"; bash ../shared/tools/device-deps.sh .devdeps > /dev/null; }
rm -rf "$root/work/repo" "$root/out" && mkdir -p "$root/work/repo" "$root/out"
git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} sh -c '[ -e "{}" ] && printf "%s\0" "{}"' \
  | tar --null -T - -cf - | tar -C "$root/work/repo" -xf -
tar -cf - .devdeps | tar -C "$root/work/repo" -xf -
log "tree copied: $(du -sh "$root/work/repo" | cut -f1) ($(du -sh .devdeps | cut -f1) of it .devdeps)"

# 3. check.sh there ---------------------------------------------------------------------------------------
mounted=()
cleanup() { for m in "${mounted[@]:-}"; do [ -n "$m" ] && umount -l "$m" 2>/dev/null; done; }
trap cleanup EXIT
for d in proc sys dev; do
  mountpoint -q "$root/$d" || { mount --bind "/$d" "$root/$d"; mounted+=("$root/$d"); }
done
cores=$(nproc)
scale=$(( (16 + cores - 1) / cores ))
log "check.sh in the root on $cores cores, stage limits x$scale"
set +e
chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 PATH=/opt/torch/.venv/bin:/usr/local/cuda/bin:/usr/bin:/bin \
  OUT=/out MEGASLIDE_COMMIT="$(git rev-parse HEAD)$(git diff --quiet HEAD || echo -dirty)" MEGASLIDE_CHECK_REHEARSAL=1 \
  MEGASLIDE_CHECK_TIME_SCALE="$scale" bash -c 'cd /work/repo && bash benchmarks/gpu/check.sh'
check_rc=$?
set -e
rm -rf "$results" && mkdir -p "$results"
cp -r "$root/out/." "$results/"
(cd "$results" && tar -xzf details.tar.gz 2>/dev/null) || true
log "results in $results (check.json, check.log, details)"

# 4. The verdict: every stage that needs no GPU passed; every other failed at once, saying "no GPU" ------
python3 - "$results" "$cores" <<'PY'
import json, os, sys
results, cores = sys.argv[1], int(sys.argv[2])
report = json.load(open(os.path.join(results, "check.json")))
stages = report["stages"]
log = open(os.path.join(results, "check.log")).read()
gpu = {"cuda_tests", "memcheck", "trainer", "dsa3d_bench", "nccl_world1"}
bad = []
for name, s in stages.items():
    if name in gpu:
        if s["ok"] or s["seconds"] > 5:
            bad.append(f"{name}: expected to fail at once without a GPU (ok={s['ok']}, {s['seconds']} s)")
    elif not s["ok"]:
        bad.append(f"{name}: failed")
for name in ["preflight", "build", "cpu_adamw", "nvme_bench", *sorted(gpu)]:
    if name not in stages:
        bad.append(f"{name}: did not run")
if log.count("no GPU: this stage needs one") < len(gpu & stages.keys()):
    bad.append("not every GPU stage said 'no GPU'")
print(json.dumps({k: stages.get(k) for k in sorted(stages)}, indent=1))
build_s = stages.get("build", {}).get("seconds")
print(f"[rehearse] build stage: {build_s} s on {cores} cores")
for b in bad:
    print("[rehearse] NOT AS EXPECTED:", b)
sys.exit(1 if bad else 0)
PY
verdict=$?
[ -f "$results/ninja_log.txt" ] && python3 benchmarks/gpu/scale_build.py "$results/ninja_log.txt" "$cores" 16
log "check.sh exited $check_rc (non-zero is expected: the GPU stages failed); rehearsal $([ $verdict -eq 0 ] && echo passed || echo FAILED)"
exit $verdict
