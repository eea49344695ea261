#!/usr/bin/env bash
# Every tracked C++ and CUDA source (.h, .cpp, .cu, .cuh; not docs/examples/, shown verbatim by the docs) laid out
# as .clang-format says, by the clang-format it names (14, Debian 12's; other versions lay out some lines
# differently). Usage: check_format.sh ROOT [CLANG_FORMAT]. Exit 0: all follow it; 1: names the files that do
# not and the command that fixes them; 77 (skipped): ROOT is not the top of a git checkout or clang-format 14 is
# missing.
set -euo pipefail
root="$1"
clang_format="${2:-clang-format}"
cd "$root"
# The project's own checkout, not a folder inside another repository (a release unpacked under one).
if [ "$(git rev-parse --show-toplevel 2> /dev/null)" != "$(pwd -P)" ]; then
  echo "skipped: $root is not the top of a git checkout (the check lists the tracked files)"
  exit 77
fi
version=$({ "$clang_format" --version 2> /dev/null || true; } | sed -n 's/.*clang-format version \([0-9]*\)\..*/\1/p')
if [ "$version" != 14 ]; then
  echo "skipped: .clang-format is applied with clang-format 14; '$clang_format' is version '${version:-none}'"
  exit 77
fi
mapfile -t files < <(git ls-files '*.h' '*.cpp' '*.cu' '*.cuh' | grep -v '^docs/examples/' || true)
[ ${#files[@]} -gt 0 ] || { echo "no tracked sources under $root"; exit 1; }
# One run over all of them; each difference is a warning "FILE:LINE:COLUMN: warning: ... [-Wclang-format-violations]".
warnings=$(mktemp)
trap 'rm -f "$warnings"' EXIT
"$clang_format" --dry-run "${files[@]}" > /dev/null 2> "$warnings" || { cat "$warnings"; echo "clang-format failed"; exit 1; }
mapfile -t bad < <(sed -n 's/^\(.*\):[0-9]*:[0-9]*: warning: .*\[-Wclang-format-violations\]$/\1/p' "$warnings" | sort -u)
if [ ${#bad[@]} -gt 0 ]; then
  echo "${#bad[@]} of ${#files[@]} tracked sources differ from .clang-format:"
  printf '  %s\n' "${bad[@]}"
  echo "fix: clang-format -i ${bad[*]}"
  exit 1
fi
echo "${#files[@]} tracked sources follow .clang-format"
