#!/usr/bin/env bash
# Builds one libFuzzer target with clang (AddressSanitizer + UndefinedBehaviorSanitizer) and runs it for
# a fixed number of inputs from the committed corpus (tests/corpus/NAME and tests/corpus/fuzz/NAME), with
# seed 1: the same inputs on every machine, so a CI result is reproducible (a 300 s cap guards against a
# slow machine). ctest runs it as fuzz.NAME; by hand (more runs find more):
#   tests/fuzz/run_fuzzer.sh run_config|safetensors RUNS SOURCE_DIR BUILD_DIR TORCH_PREFIX [CLANGXX]
# A finding (crash, sanitizer report, an exception other than the parser's own) fails the run and
# leaves the input in BUILD_DIR/fuzz/ as crash-* for a regression corpus entry.
set -euo pipefail
name=$1 runs=$2 src=$3 build=$4 torch=$5 cxx=${6:-clang++}
out=$build/fuzz
mkdir -p "$out"
bin=$out/fuzz_$name
flags=(-std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I"$src/include" -I"$src/src")
case $name in
  run_config)
    sources=("$src/tests/fuzz/fuzz_run_config.cpp" "$src/src/config/run_config.cpp" "$src/src/util/numbers.cpp" "$src/src/io/files.cpp")
    libs=(-lyaml-cpp -lfmt) ;;
  safetensors)
    sources=("$src/tests/fuzz/fuzz_safetensors.cpp" "$src/src/io/safetensors.cpp" "$src/src/io/files.cpp")
    flags+=(-isystem "$torch/include" -isystem "$torch/include/torch/csrc/api/include")
    libs=(-L"$torch/lib" -Wl,-rpath,"$torch/lib" -ltorch_cpu -lc10) ;;
  *) echo "run_fuzzer.sh: unknown target '$name' (run_config | safetensors)" >&2; exit 2 ;;
esac
stale=0
[ -x "$bin" ] || stale=1
for s in "${sources[@]}" "$src"/include/megaslide/config/run_config.h "$src"/include/megaslide/io/*.h "$src"/include/megaslide/util/numbers.h \
         "$src"/src/util/*.h; do
  [ "$s" -nt "$bin" ] && stale=1
done
if [ $stale = 1 ]; then
  echo "building $bin with $cxx"
  "$cxx" "${flags[@]}" "${sources[@]}" "${libs[@]}" -o "$bin"
fi
# The corpus is copied: libFuzzer adds the inputs it finds to its corpus folder. It is the hand-written
# inputs (tests/corpus/NAME) and those longer runs found (tests/corpus/fuzz/NAME, see the end of this file),
# so a short run starts from the coverage they reached.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$src/tests/corpus/$name"/* "$work/"
cp "$src/tests/corpus/fuzz/$name"/* "$work/"
cd "$out"
ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 "$bin" -runs="$runs" -max_total_time=300 -seed=1 -rss_limit_mb=4096 \
  -timeout=10 -print_final_stats=1 "$work"
# Growing tests/corpus/fuzz/NAME after a longer run (RUNS 200000 for run_config, 1000000 for safetensors,
# another -seed), keeping a smallest set of inputs with the same coverage:
#   mkdir merged && cp tests/corpus/NAME/* merged/
#   build/fuzz/fuzz_NAME -set_cover_merge=1 merged tests/corpus/fuzz/NAME LONG_RUN_CORPUS
#   then tests/corpus/fuzz/NAME = the files of merged/ that are not in tests/corpus/NAME
