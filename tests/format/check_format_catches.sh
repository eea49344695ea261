#!/usr/bin/env bash
# The format check fails on a checkout with one misformatted tracked file, naming it, and passes on one whose
# tracked files follow .clang-format: so that it can fail at all. Usage: check_format_catches.sh CHECK ROOT
# [CLANG_FORMAT] (ROOT: the project, for its .clang-format). Skipped (77) where the check itself would skip.
set -euo pipefail
check="$1"
root="$2"
clang_format="${3:-clang-format}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$root/.clang-format" "$tmp/"
mkdir -p "$tmp/src" "$tmp/docs/examples"
printf 'int add(int a, int b) { return a + b; }\n' > "$tmp/src/good.cpp"
printf 'int  twice( int a ){return 2*a;}\n' > "$tmp/docs/examples/verbatim.cpp"  # not checked
git -C "$tmp" init -q
git -C "$tmp" add .
status=0
bash "$check" "$tmp" "$clang_format" > "$tmp/out" 2>&1 || status=$?
[ "$status" = 77 ] && { cat "$tmp/out"; exit 77; }
[ "$status" = 0 ] || { cat "$tmp/out"; echo "a checkout whose sources follow .clang-format was refused"; exit 1; }
printf 'int  twice( int a ){return 2*a;}\n' > "$tmp/src/bad.cpp"
git -C "$tmp" add src/bad.cpp
if bash "$check" "$tmp" "$clang_format" > "$tmp/out" 2>&1; then cat "$tmp/out"; echo "a misformatted file passed"; exit 1; fi
grep -q '^  src/bad.cpp$' "$tmp/out" || { cat "$tmp/out"; echo "the misformatted file is not named"; exit 1; }
if grep -q 'good.cpp\|verbatim.cpp' "$tmp/out"; then cat "$tmp/out"; echo "a file that is not at fault is named"; exit 1; fi
echo "the check refuses a misformatted tracked file, naming it, and passes sources that follow .clang-format"
