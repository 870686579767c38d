#!/usr/bin/env bash
# Installs what is needed, builds and runs every CPU test: the release build (CUDA code compiled
# when the toolkit is present; GPU tests skip visibly without a GPU), the same tests under
# AddressSanitizer + UndefinedBehaviorSanitizer, and short runs of the libFuzzer targets.
# MOE_SKIP_SANITIZE=1 / MOE_SKIP_FUZZ=1 leave those stages out.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install_deps.sh
jobs=$(nproc)

echo "== release build and tests"
cmake --preset release
cmake --build --preset release -j "$jobs"
ctest --preset release -j "$jobs"

if [ "${MOE_SKIP_SANITIZE:-0}" != 1 ]; then
  echo "== ASan + UBSan build and tests"
  cmake --preset sanitize
  cmake --build --preset sanitize -j "$jobs"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --preset sanitize -j "$jobs"
fi

if [ "${MOE_SKIP_FUZZ:-0}" != 1 ]; then
  echo "== fuzz targets (${MOE_FUZZ_SECONDS:-20} s each)"
  cmake --preset fuzz
  cmake --build --preset fuzz -j "$jobs"
  # The library is instrumented too, so each target explores the parser it drives. A crash
  # fails the stage with the fuzzer's report; its input then becomes a unit test.
  for target in safetensors tokenizer config chat_template http step_wire; do
    corpus=$(mktemp -d)
    log=$(mktemp)
    cp fuzz/corpus/$target/* "$corpus"/
    dict=()
    [ -f "fuzz/$target.dict" ] && dict=(-dict="fuzz/$target.dict")
    if ! build/fuzz/fuzz/fuzz-$target "$corpus" "${dict[@]}" -max_total_time="${MOE_FUZZ_SECONDS:-20}" \
        -rss_limit_mb=4096 -print_final_stats=0 >"$log" 2>&1; then
      echo "fuzz-$target FAILED:"
      tail -n 40 "$log"
      exit 1
    fi
    echo "fuzz-$target: $(grep -oE 'Done [0-9]+ runs in [0-9]+ second' "$log" | tail -n 1)s," \
      "$(grep -oE 'cov: [0-9]+' "$log" | tail -n 1) coverage points"
    rm -rf "$corpus" "$log"
  done
fi
echo "all test stages passed"
