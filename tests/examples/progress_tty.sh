#!/usr/bin/env bash
# Rank 0's live progress bar, on a terminal and off one:
#   progress_tty.sh BINARY EPOCHS STEPS ARGS...
# Under a pseudo-terminal (util-linux `script`) every epoch's bar is drawn
# and redrawn in place (carriage returns, at least twice, the last frame
# STEPS/STEPS), then cleared (CR + erase-line) and replaced by the epoch's
# whole summary line. Through a pipe the same run prints plain lines only:
# no carriage return, no escape sequence.
set -euo pipefail
bin=$1 epochs=$2 steps=$3
shift 3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cmd=$(printf '%q ' "$bin" --out "$dir/tty" "$@")
script -q -e -c "$cmd" "$dir/tty.log" > /dev/null
"$bin" --out "$dir/pipe" "$@" | cat > "$dir/pipe.log"
python3 - "$dir/tty.log" "$dir/pipe.log" "$epochs" "$steps" <<'PY'
import re, sys
tty = open(sys.argv[1], "rb").read().decode("utf-8", "replace")
pipe = open(sys.argv[2], "rb").read().decode("utf-8", "replace")
epochs, steps = int(sys.argv[3]), int(sys.argv[4])
bad = []
for e in range(1, epochs + 1):
    frames = re.findall(rf"\repoch {e}/{epochs} \[[#.]{{24}}\] (\d+)/(\d+) loss [0-9.]+ \d+ img/s ETA \d+s ", tty)
    print(f"epoch {e}: {len(frames)} frames drawn in place, last {'/'.join(frames[-1]) if frames else '-'}")
    if len(frames) < 2:
        bad.append(f"epoch {e}: {len(frames)} progress frames (want >= 2)")
    elif frames[-1] != (str(steps), str(steps)):
        bad.append(f"epoch {e}: last frame {frames[-1]}, want {steps}/{steps}")
    line = re.search(rf"\r\x1b\[Kepoch {e}/{epochs}  train_loss [0-9.]+  train_acc [0-9.]+  val_loss [0-9.]+  "
                     rf"val_acc [0-9.]+  lr \S+  [0-9.]+s \(train [0-9.]+s, val [0-9.]+s\)  \d+ train img/s\r?\n", tty)
    if not line:
        bad.append(f"epoch {e}: no cleared, whole summary line after the bar")
for e in range(1, epochs + 1):
    if not re.search(rf"^epoch {e}/{epochs}  train_loss .* train img/s$", pipe, re.M):
        bad.append(f"piped: no summary line for epoch {e}")
if "\r" in pipe or "\x1b" in pipe:
    bad.append("piped output has carriage returns or escape sequences")
print("\n".join(bad) if bad else "progress: drawn, redrawn in place, final lines intact; plain when piped")
sys.exit(1 if bad else 0)
PY
