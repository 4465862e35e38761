# Sourced by the torchrun tests: sets $py to a Python with torch.distributed
# (Debian's python3-torch is in /usr/bin/python3, not in a pyenv on PATH), or
# exits 77, which CTest reports as skipped.
py=""
for p in /usr/bin/python3 python3; do
  if "$p" -c "import torch.distributed.run" 2>/dev/null; then py=$p; break; fi
done
[[ -n $py ]] || { echo "no python3 with torch: skipped"; exit 77; }

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
