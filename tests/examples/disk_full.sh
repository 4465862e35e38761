#!/usr/bin/env bash
# disk_full.sh BINARY DIR: a disk that fills during a checkpoint. DIR/out is
# a small tmpfs (root only); after an epoch, a filler leaves less room than
# a checkpoint needs, and the next epoch's checkpoint write must fail with
# the I/O exit code (74), naming last.pt and "No space left on device",
# leaving last.pt byte-identical and no temporary; with room again, a
# resume from it finishes. Without root: a loud skip, or under CI=true a
# failure.
set -uo pipefail
bin=$1 dir=$2
out=$dir/out
cleanup() { umount "$out" 2>/dev/null; }
trap cleanup EXIT
umount "$out" 2>/dev/null
rm -rf "$dir"
mkdir -p "$out"
if ! mount -t tmpfs -o size=16m tmpfs "$out" 2>/dev/null; then
  source "$(dirname "$0")/skip.sh"
  ddpkit_skip "cannot mount a tmpfs at $out (needs root with CAP_SYS_ADMIN)"
fi
common=(--out "$out" --synthetic-size 256 --batch-size 64 --quiet --workers 0
        --no-tensorboard --keep-best 0)
"$bin" "${common[@]}" --epochs 1 || { echo "FAIL: the first epoch failed"; exit 1; }
last=$out/checkpoints/last.pt
size=$(stat -c %s "$last")
before=$(sha256sum <"$last")
free_kib=$(df --output=avail -k "$out" | tail -1)
# Leave half a checkpoint of room.
fill_kib=$((free_kib - size / 2048))
dd if=/dev/zero of="$out/filler" bs=1k count="$fill_kib" status=none 2>/dev/null
msg=$("$bin" "${common[@]}" --epochs 2 --resume auto 2>&1)
rc=$?
echo "full disk: exit $rc: $msg"
[[ $rc == 74 ]] || { echo "FAIL: exit $rc, expected 74 (I/O error)"; exit 1; }
grep -q "last.pt.*No space left on device" <<<"$msg" ||
  { echo "FAIL: the message does not name last.pt and the system's error"; exit 1; }
[[ $(sha256sum <"$last") == "$before" ]] || { echo "FAIL: last.pt changed"; exit 1; }
left=$(find "$out" -name '*.tmp*')
[[ -z $left ]] || { echo "FAIL: temporaries left: $left"; exit 1; }
rm -f "$out/filler"
"$bin" "${common[@]}" --epochs 2 --resume auto ||
  { echo "FAIL: resuming from the kept last.pt failed"; exit 1; }
echo "ok: exit 74 naming last.pt; last.pt unchanged, no temporary; the resume finished"
