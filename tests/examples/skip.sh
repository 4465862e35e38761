# Sourced by the test scripts: the one way a shell test skips.
#   ddpkit_skip "why"
# Under CI=true (where scripts/install-deps.sh and root provide every
# prerequisite) it fails: prints "FAILED: why; CI=true, so this is not
# skipped" and exits 1. Elsewhere it prints "SKIPPED: why", appends
# "<script>: why" to $DDPKIT_SKIP_LOG when that is set (scripts/test.sh lists
# the file in its summary) and exits 77, which CTest reports as skipped
# (every such test has SKIP_RETURN_CODE 77).
ddpkit_skip() {
  local why=$1
  if [[ ${CI:-} == true ]]; then
    echo "FAILED: $why; CI=true, so this is not skipped"
    exit 1
  fi
  echo "SKIPPED: $why"
  if [[ -n ${DDPKIT_SKIP_LOG:-} ]]; then
    echo "$(basename "$0"): $why" >>"$DDPKIT_SKIP_LOG"
  fi
  exit 77
}
