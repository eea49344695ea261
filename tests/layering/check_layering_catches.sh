#!/usr/bin/env bash
# The dependency-rule check fails on a tree with one upward include and on a folder it does not know,
# naming the file, and passes on a tree that keeps the rule: so that it can fail at all.
set -euo pipefail
script="$1"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/src/io" "$tmp/src/train" "$tmp/include/megaslide/util"
printf '#include "megaslide/util/x.h"\n#include <fmt/format.h>\n' > "$tmp/src/io/good.cpp"
printf '#include "megaslide/io/files.h"\n' > "$tmp/src/train/good.cpp"
cmake -DROOT="$tmp" -P "$script" > "$tmp/out" 2>&1 || { cat "$tmp/out"; echo "a tree that keeps the rule was refused"; exit 1; }
printf '#include "megaslide/train/distributed.h"\n' > "$tmp/include/megaslide/util/bad.h"
if cmake -DROOT="$tmp" -P "$script" > "$tmp/out" 2>&1; then cat "$tmp/out"; echo "an upward include passed"; exit 1; fi
grep -q "include/megaslide/util/bad.h: util includes 'megaslide/train/distributed.h'" "$tmp/out" || { cat "$tmp/out"; exit 1; }
rm "$tmp/include/megaslide/util/bad.h"
mkdir -p "$tmp/src/misc" && printf '\n' > "$tmp/src/misc/a.cpp"
if cmake -DROOT="$tmp" -P "$script" > "$tmp/out" 2>&1; then cat "$tmp/out"; echo "an unknown folder passed"; exit 1; fi
grep -q "folder 'misc' has no place" "$tmp/out" || { cat "$tmp/out"; exit 1; }
echo "the check refuses an upward include and an unknown folder, and passes a tree that keeps the rule"
