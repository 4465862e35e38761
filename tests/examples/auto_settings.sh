#!/usr/bin/env bash
# The examples' --precision auto (the default) and --memory-format auto,
# through cifar10-single (auto_settings.sh OUT BINARY):
#  1. a fresh run names on its first line the precision the hardware rule
#     gives on this machine (bf16-mixed where /proc/cpuinfo lists amx_bf16,
#     else 32: no GPU here) and on the next line why;
#  2. a run resumed with both on auto takes what its checkpoint recorded
#     (here bf16-mixed and channels-last, asked for explicitly by the first
#     run) and says so;
#  3. resuming with another explicit precision is refused (exit 2, naming
#     the change; the run's files untouched), and allowed with
#     --resume-allow-changes, which says what changed;
#  4. a checkpoint that records 16-mixed (a GPU run's; written here by
#     Python's torch, found by torch_python.sh), resumed with precision auto
#     without a GPU, is refused (exit 2) naming the checkpoint and how to
#     continue in another precision, and continuing that way works.
set -uo pipefail
out=$1 bin=$2
# The CPU's rule is tested (a visible GPU would be the training device),
# and the default, not an environment's choice.
unset DDPKIT_PRECISION
export CUDA_VISIBLE_DEVICES=
here=$(dirname "$0")
fail() { echo "FAIL: $*"; exit 1; }
rm -rf "$out" "$out-2"
common=(--batch-size 16 --synthetic-size 320 --max-steps 2 --workers 0 --no-tensorboard)

want=32
grep -qw amx_bf16 /proc/cpuinfo && want=bf16-mixed
log=$("$bin" --out "$out-2" --epochs 1 "${common[@]}" 2>&1) || { echo "$log"; fail "the fresh run failed"; }
echo "$log" | head -2
grep -q "; precision $want, memory format contiguous$" <<<"$log" ||
  fail "1: the first line does not name precision $want (the hardware rule on this machine)"
grep -q "^precision auto: this CPU" <<<"$log" || fail "1: no line says why the precision was chosen"

log=$("$bin" --out "$out" --epochs 1 "${common[@]}" --precision bf16-mixed \
  --memory-format channels-last 2>&1) || { echo "$log"; fail "the first run failed"; }
log=$("$bin" --out "$out" --epochs 2 "${common[@]}" --memory-format auto --resume auto 2>&1) ||
  { echo "$log"; fail "the resumed run failed"; }
echo "$log" | head -3
grep -q "; precision bf16-mixed, memory format channels-last$" <<<"$log" ||
  fail "2: the resumed run did not take the checkpoint's precision and layout"
grep -q "^precision auto: as the run being resumed trained (.*last.pt)$" <<<"$log" ||
  fail "2: no line says the precision came from the checkpoint"
grep -q "^memory format auto: as the run being resumed trained (.*last.pt)$" <<<"$log" ||
  fail "2: no line says the layout came from the checkpoint"

"$here/expect_exit.sh" 2 "precision bf16-mixed -> 32 .*--resume-allow-changes" \
  "$bin" --out "$out" --epochs 3 "${common[@]}" --memory-format channels-last \
  --precision 32 --resume auto || fail "3: a changed precision was not refused"
log=$("$bin" --out "$out" --epochs 3 "${common[@]}" --memory-format channels-last \
  --precision 32 --resume auto --resume-allow-changes 2>&1) || { echo "$log"; fail "3: the allowed change failed"; }
grep -q "with changed settings: precision bf16-mixed -> 32" <<<"$log" ||
  fail "3: the allowed change does not say what changed"

# Step 4 needs Python's torch: without it the test is skipped (exit 77),
# or fails under CI=true (torch_python.sh).
source "$here/torch_python.sh"
last="$out/checkpoints/last.pt"
"$py" - "$last" <<'PY' || fail "4: could not rewrite the checkpoint's precision"
import sys, torch
d = torch.load(sys.argv[1], weights_only=True)
d["precision"] = "16-mixed"
torch.save(d, sys.argv[1])
PY
"$here/expect_exit.sh" 2 "precision auto: the run being resumed \(.*last\.pt\) trained in 16-mixed, which needs a CUDA device, but this run trains on cpu.*--precision 32 .*--resume-allow-changes" \
  "$bin" --out "$out" --epochs 4 "${common[@]}" --memory-format channels-last \
  --resume auto || fail "4: a 16-mixed checkpoint resumed on a CPU was not refused clearly"
log=$("$bin" --out "$out" --epochs 4 "${common[@]}" --memory-format channels-last \
  --precision 32 --resume auto --resume-allow-changes 2>&1) ||
  { echo "$log"; fail "4: continuing in 32 as the message says failed"; }
grep -q "with changed settings: precision 16-mixed -> 32" <<<"$log" ||
  fail "4: continuing in 32 does not say what changed"
echo "PASS"

# Passed: the run folder goes (a flowers checkpoint is 170 MB; CI ran out of
# disk keeping them all). DDPKIT_KEEP_TEST_RUNS=1 keeps it; a failed check
# has exited before this line.
[[ ${DDPKIT_KEEP_TEST_RUNS:-0} == 1 ]] || rm -rf "$out"
