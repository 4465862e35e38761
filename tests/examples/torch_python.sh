# Sourced by the torchrun tests: sets $py to the Python with torch.distributed
# that scripts/install-deps.sh puts in the project's environment
# ($DDPKIT_PYTHON, set by CTest; else .venv/bin/python3). Without it the test
# exits 77, which CTest reports as skipped -- except in CI (CI=true), where
# the install script must have made it, so the test fails.
py=""
for p in "${DDPKIT_PYTHON:-}" "$(dirname "${BASH_SOURCE[0]}")/../../.venv/bin/python3"; do
  if [[ -n $p ]] && "$p" -c "import torch.distributed.run" 2>/dev/null; then py=$p; break; fi
done
source "$(dirname "${BASH_SOURCE[0]}")/skip.sh"
[[ -n $py ]] || ddpkit_skip "no Python with torch (run scripts/install-deps.sh)"

# torchrun's --standalone rendezvous always listens on localhost:29400, so
# two standalone jobs at once (e.g. under `ctest -j`) collide. `new_rdzv`
# sets $standalone to the same single-node c10d rendezvous on a port that is
# free now (call it before each torchrun).
new_rdzv() {
  local port
  port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  standalone=(--nnodes=1 --rdzv_backend=c10d --rdzv_endpoint="localhost:$port"
              --rdzv_id="ddpkit-test-$$-$port")
}
