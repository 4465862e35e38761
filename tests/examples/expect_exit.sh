#!/usr/bin/env bash
# expect_exit.sh CODE PATTERN COMMAND...: COMMAND must exit with CODE and
# print PATTERN (grep -E) on stdout or stderr.
set -uo pipefail
code=$1 pattern=$2
shift 2
out=$("$@" 2>&1)
rc=$?
echo "$out"
[[ $rc == "$code" ]] || { echo "exit code $rc, expected $code"; exit 1; }
grep -Eq -- "$pattern" <<<"$out" || { echo "output lacks /$pattern/"; exit 1; }
