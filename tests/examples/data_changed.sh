#!/usr/bin/env bash
# data_changed.sh BINARY OUT: files added to an image folder between runs.
# A run trains an epoch on its (generated) folder; a file is added to one
# class; --resume auto must then refuse (exit 2) naming the training set's
# change, leave the checkpoint as it was, and --resume-allow-changes must
# resume anyway.
set -uo pipefail
bin=$1 out=$2
rm -rf "$out"
common=(--out "$out" --max-steps 1 --image-size 32 --synthetic-per-class 5
        --workers 0 --quiet --no-tensorboard)
"$bin" "${common[@]}" --epochs 1 || { echo "FAIL: the first run failed"; exit 1; }
daisy=$out/synthetic_flower_photos/daisy
first=$(find "$daisy" -type f | sort | head -1)
cp "$first" "$daisy/added-later.jpg"
before=$(sha256sum <"$out/checkpoints/last.pt")
msg=$("$bin" "${common[@]}" --epochs 2 --resume auto 2>&1)
rc=$?
echo "after adding a file: exit $rc: $msg"
[[ $rc == 2 ]] || { echo "FAIL: exit $rc, expected 2"; exit 1; }
grep -q "the training set had [0-9]* samples, now [0-9]*" <<<"$msg" ||
  { echo "FAIL: the message does not name the training set's change"; exit 1; }
grep -q "class 'daisy' [0-9]* -> [0-9]* files" <<<"$msg" ||
  { echo "FAIL: the message does not name the class that changed"; exit 1; }
[[ $(sha256sum <"$out/checkpoints/last.pt") == "$before" ]] ||
  { echo "FAIL: last.pt changed"; exit 1; }
"$bin" "${common[@]}" --epochs 2 --resume auto --resume-allow-changes ||
  { echo "FAIL: --resume-allow-changes did not resume"; exit 1; }
echo "ok: refused naming the change; resumed with --resume-allow-changes"

# Passed: the run folder goes (a flowers checkpoint is 170 MB; CI ran out of
# disk keeping them all). DDPKIT_KEEP_TEST_RUNS=1 keeps it; a failed check
# has exited before this line.
[[ ${DDPKIT_KEEP_TEST_RUNS:-0} == 1 ]] || rm -rf "$out"
