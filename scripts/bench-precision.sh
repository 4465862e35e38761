#!/usr/bin/env bash
# Precision and memory layout, side by side: the flowers example's DDP build
# (ResNet-34, 2 ranks x 1 intra-op thread, batch 16 per rank, generated JPEG
# folder), at 32 / bf16-mixed x contiguous / channels-last, the four runs
# alternating within each round. Prints each run's training images per
# second (summary.json's train_images_per_second: training time only, its
# first step included), per round the ratio to 32 contiguous, and rank 0's
# mean step time by phase (summary.json's step_ms).
#
#   scripts/bench-precision.sh [BINARY] [SIZE] [STEPS] [ROUNDS]
#   default: build/bin/flowers-resnet34-ddp, 128 px, 12 steps, 2 rounds
#
# Measure on an idle machine; this one drifts, so compare within a round.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/bin/flowers-resnet34-ddp}
size=${2:-128} steps=${3:-12} rounds=${4:-2}
[[ -x $bin ]] || { echo "bench-precision: $bin is not built" >&2; exit 2; }
work=$(mktemp -d /tmp/ddpkit-bench-precision.XXXXXX)
trap 'rm -rf "$work"' EXIT
settings=("32 contiguous" "bf16-mixed contiguous" "32 channels-last" "bf16-mixed channels-last")
echo "flowers-resnet34-ddp: ${size} px, batch 16 x 2 ranks x 1 thread, $steps steps, $(nproc) cores"
for ((r = 1; r <= rounds; r++)); do
  base=""
  for s in "${settings[@]}"; do
    read -r prec fmt <<<"$s"
    out=$work/run-$r-$prec-$fmt
    "$bin" --world-size 2 --threads 1 --batch-size 16 --image-size "$size" \
      --epochs 1 --max-steps "$steps" --synthetic-per-class 40 --workers 1 \
      --precision "$prec" --memory-format "$fmt" \
      --out "$out" --quiet --no-tensorboard >"$out.log" 2>&1 ||
      { echo "bench-precision: $s failed:"; tail -5 "$out.log"; exit 1; }
    ips=$(sed -nE 's/.*"train_images_per_second": ([0-9.e+-]+).*/\1/p' "$out/summary.json")
    [[ -n $base ]] || base=$ips
    printf 'round %d  %-11s %-14s %8.2f images/s  x%.2f\n' "$r" "$prec" "$fmt" "$ips" \
      "$(echo "$ips / $base" | bc -l)"
    # Rank 0's step time by phase (summary.json's step_ms, ms per step).
    step=$(sed -nE 's/.*"step_ms": (\{.*\}).*/\1/p' "$out/summary.json")
    ms() { sed -nE "s/.*\"$1\":([0-9.e+-]+).*/\1/p" <<<"$step"; }
    printf '         ms/step %.0f: data %.1f  forward %.0f  backward %.0f (grad wait %.1f)  agreement %.1f  optimizer %.1f  other %.1f\n' \
      "$(ms total)" "$(ms data_wait)" "$(ms forward)" "$(ms backward)" "$(ms grad_wait)" \
      "$(ms agreement)" "$(ms optimizer)" "$(ms other)"
  done
done
