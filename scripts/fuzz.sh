#!/usr/bin/env bash
# Short libFuzzer runs of ddpkit's input parsers (tests/fuzz: CIFAR-10
# records, JPEG/PNG decoding, checkpoints and state dicts, the distributed
# environment). Configures and builds the clang fuzz build (its own folder,
# -fsanitize=fuzzer,address,undefined), writes valid seed inputs, then runs
# every target for SECONDS, as many at once as there are cores. Exits 1 when
# any target found something (crash, sanitizer report, broken invariant,
# unexpected exception, leak, timeout, out-of-memory); the inputs are kept
# under BUILD/fuzz/artifacts/<target>/ and their paths printed.
#
#   scripts/fuzz.sh [SECONDS]      seconds per target (default 60)
#
#   DDPKIT_FUZZ_SECONDS=N    the same as SECONDS; 0 skips fuzzing entirely
#   DDPKIT_FUZZ_JOBS=N       targets run at once (default: nproc)
#   DDPKIT_FUZZ_TARGETS="image env"   a subset
#   DDPKIT_FUZZ_BUILD_DIR    build folder (default build-fuzz)
#   DDPKIT_FUZZ_CXX          compiler (default clang++-14)
#   DDPKIT_JOBS              build parallelism (default: nproc)
#
# Reproduce a finding: BUILD/bin/fuzz_<target> ARTIFACT (add
# DDPKIT_FUZZ_VERBOSE=1 to see each expected error along the way).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
seconds=${1:-${DDPKIT_FUZZ_SECONDS:-60}}
if [[ "$seconds" == 0 ]]; then
  echo "fuzz: skipped (0 seconds per target)"
  exit 0
fi
build=${DDPKIT_FUZZ_BUILD_DIR:-build-fuzz}
jobs=${DDPKIT_FUZZ_JOBS:-$(nproc)}
read -r -a targets <<<"${DDPKIT_FUZZ_TARGETS:-cifar10 image checkpoint env}"
t0=$(date +%s)

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE= \
  -DCMAKE_CXX_COMPILER="${DDPKIT_FUZZ_CXX:-clang++-14}" \
  -DDDPKIT_BUILD_FUZZERS=ON -DDDPKIT_BUILD_TESTS=OFF \
  -DDDPKIT_BUILD_EXAMPLES=OFF -DDDPKIT_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$build" -j "${DDPKIT_JOBS:-$(nproc)}"
t_built=$(date +%s)

work="$root/$build/fuzz"
mkdir -p "$work/logs" "$work/tmp"
marker="$work/logs/.started"
touch "$marker"

# libtorch's own leak on damaged zips is suppressed (see the file); ddpkit's
# are reported. Every UBSan report is fatal.
export LSAN_OPTIONS="suppressions=$root/tests/fuzz/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export ASAN_OPTIONS="${ASAN_OPTIONS:-}${ASAN_OPTIONS:+:}detect_leaks=1"
export TMPDIR="$work/tmp" OMP_NUM_THREADS=1

max_len() {
  case $1 in
    cifar10) echo 12300 ;;   # four records
    image) echo 16384 ;;
    checkpoint) echo 65536 ;;
    *) echo 4096 ;;
  esac
}

run_target() {
  local t=$1 bin="$root/$build/bin/fuzz_$1"
  local seeds="$work/seeds/$t" corpus="$work/corpus/$t" art="$work/artifacts/$t"
  rm -rf "$seeds"
  mkdir -p "$corpus" "$art"
  "$bin" -ddpkit_write_seeds="$seeds" >/dev/null
  local extra=()
  [[ -d "$root/tests/fuzz/regressions/$t" ]] && extra+=("$root/tests/fuzz/regressions/$t")
  [[ -f "$root/tests/fuzz/$t.dict" ]] && extra+=("-dict=$root/tests/fuzz/$t.dict")
  # A finding stops the run; the outer timeout only guards against libFuzzer
  # itself getting stuck.
  set +e
  timeout -k 10 $((seconds * 2 + 120)) "$bin" "$corpus" "$seeds" "${extra[@]}" \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -max_len="$(max_len "$t")" -artifact_prefix="$art/" \
    -print_final_stats=1 >"$work/logs/$t.log" 2>&1
  echo $? >"$work/logs/$t.rc"
}

echo "fuzz: ${#targets[@]} targets x ${seconds} s, ${jobs} at a time (build $((t_built - t0)) s)"
running=0
for t in "${targets[@]}"; do
  if ((running >= jobs)); then
    wait -n || true
    running=$((running - 1))
  fi
  run_target "$t" &
  running=$((running + 1))
done
wait || true
t_ran=$(date +%s)

# Per-target summary from libFuzzer's final stats.
status=0
printf 'fuzz: %-11s %10s %8s %6s %6s %14s  %s\n' target execs exec/s cov ft corpus result
for t in "${targets[@]}"; do
  log="$work/logs/$t.log"
  rc=$(cat "$work/logs/$t.rc" 2>/dev/null || echo "?")
  fstat() { sed -n "s/^stat::$1: *//p" "$log" | tail -1; }
  last=$(grep -E '^#[0-9]+[[:space:]]+(DONE|pulse|NEW|REDUCE|INITED)' "$log" | tail -1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corp=$(sed -n 's/.* corp: \([^ ]*\).*/\1/p' <<<"$last")
  mapfile -t found < <(find "$work/artifacts/$t" -type f -newer "$marker" \
    \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) | sort)
  result=ok
  if [[ "$rc" != 0 || ${#found[@]} -gt 0 ]]; then
    result="FOUND SOMETHING (exit $rc)"
    status=1
  fi
  printf 'fuzz: %-11s %10s %8s %6s %6s %14s  %s\n' "$t" \
    "$(fstat number_of_executed_units)" "$(fstat average_exec_per_sec)" \
    "${cov:-?}" "${ft:-?}" "${corp:-?}" "$result"
  if [[ $result != ok ]]; then
    grep -E 'FINDING|ERROR:|SUMMARY:|runtime error' "$log" | head -5 | sed 's/^/fuzz:   /'
    for f in "${found[@]}"; do
      echo "fuzz:   input: $f"
      echo "fuzz:   reproduce: $build/bin/fuzz_$t $f"
    done
    echo "fuzz:   log: $log"
  fi
done
echo "fuzz: done in $((t_ran - t0)) s (build $((t_built - t0)) s, runs $((t_ran - t_built)) s)"
exit $status
