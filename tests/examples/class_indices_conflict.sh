#!/usr/bin/env bash
# class_indices_conflict.sh BINARY OUT_DIR: an output folder whose
# class_indices.json names other classes is refused (exit 2, message naming
# the file) and the file is left as it was.
set -uo pipefail
bin=$1 out=$2
rm -rf "$out" && mkdir -p "$out"
printf '{\n    "0": "cats",\n    "1": "dogs"\n}' > "$out/class_indices.json"
before=$(sha256sum "$out/class_indices.json")
msg=$("$bin" --out "$out" --epochs 1 --max-steps 1 --image-size 32 \
        --synthetic-per-class 5 --workers 0 2>&1)
rc=$?
echo "$msg"
[[ $rc == 2 ]] || { echo "exit code $rc, expected 2"; exit 1; }
grep -q "class_indices.json lists other classes" <<<"$msg" || { echo "message missing"; exit 1; }
[[ $(sha256sum "$out/class_indices.json") == "$before" ]] || { echo "class_indices.json was changed"; exit 1; }
[[ ! -e $out/summary.json && ! -e $out/checkpoints ]] || { echo "outputs were written"; exit 1; }
echo "refused, nothing overwritten"

# Passed: the run folder goes (a flowers checkpoint is 170 MB; CI ran out of
# disk keeping them all). DDPKIT_KEEP_TEST_RUNS=1 keeps it; a failed check
# has exited before this line.
[[ ${DDPKIT_KEEP_TEST_RUNS:-0} == 1 ]] || rm -rf "$out"
