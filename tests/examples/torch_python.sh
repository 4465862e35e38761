# Sourced by the torchrun tests: sets $py to a Python with torch.distributed
# (Debian's python3-torch is in /usr/bin/python3, not in a pyenv on PATH), or
# exits 77, which CTest reports as skipped.
py=""
for p in /usr/bin/python3 python3; do
  if "$p" -c "import torch.distributed.run" 2>/dev/null; then py=$p; break; fi
done
[[ -n $py ]] || { echo "no python3 with torch: skipped"; exit 77; }
