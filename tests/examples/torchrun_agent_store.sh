#!/usr/bin/env bash
# torchrun_agent_store.sh BINARY: a -ddp binary built against libtorch 1.13,
# launched by torchrun >= 2.2 (the project's environment), which hosts the
# rendezvous store in its agent: 1.13's store client cannot talk to it, so
# every rank must stop at once with an error that says what to do
# (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), instead of waiting forever.
# torchrun SIGTERMs the other ranks as soon as one fails, so a rank that
# starts later may be stopped before it prints: the test asks for at least
# one rank's message, torchrun's non-zero exit without a hang, and for
# every rank either that refusal (exit 2) or torchrun's SIGTERM (-15).
set -uo pipefail
bin=$1
source "$(dirname "$0")/torch_python.sh"
log=$(mktemp)
new_rdzv
unset TORCH_DISABLE_SHARE_RDZV_TCP_STORE
start=$(date +%s)
timeout 120 "$py" -m torch.distributed.run "${standalone[@]}" --nproc_per_node=2 --no_python \
  "$bin" --out "$(mktemp -d)/never" --epochs 1 --max-steps 2 --batch-size 8 --synthetic-size 200 --workers 1 \
  >"$log" 2>&1
rc=$?
took=$(($(date +%s) - start))
grep -E "TORCHELASTIC_USE_AGENT_STORE|TORCH_DISABLE_SHARE" "$log" | head -4
((rc != 0 && rc != 124)) || { cat "$log"; echo "torchrun exit $rc (124: it hung), expected a failure"; exit 1; }
n=$(grep -c "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun" "$log")
((n >= 1)) || { cat "$log"; echo "expected a rank to name TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, found none"; exit 1; }
# torchrun's failure report: "exitcode  : N" per failed rank it lists.
bad=$(grep -E "^ *exitcode *:" "$log" | grep -vE "exitcode *: (2|-15) " || true)
[[ -z $bad ]] || { cat "$log"; echo "a rank ended otherwise than refusing (2) or torchrun's SIGTERM (-15): $bad"; exit 1; }
echo "refused: $n rank(s) named the fix, torchrun exit $rc, in $took s"
