#!/usr/bin/env bash
# expect_output.sh REGEX COMMAND...: COMMAND must exit 0 and its output
# (stdout and stderr) must match REGEX (Python's re, "." matching newlines
# too). Instead of CTest's PASS_REGULAR_EXPRESSION, which ignores the exit
# code.
set -uo pipefail
regex=$1
shift
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out"
if ((rc != 0)); then
  echo "FAILED: exit code $rc (expected 0): $*"
  exit 1
fi
if ! python3 -c 'import re, sys; sys.exit(0 if re.search(sys.argv[1], sys.stdin.read(), re.S) else 1)' "$regex" <<<"$out"; then
  echo "FAILED: the output does not match: $regex"
  exit 1
fi
echo "ok"
