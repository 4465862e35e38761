#!/usr/bin/env bash
# ZeRO-2 example checks against the DDP example's run.
#   zero_checks.sh memory DDP_OUT ZERO_OUT
#     summary.json's memory per rank: as ddpkit counts it, ZeRO's optimizer
#     state is split (each rank below DDP's, the ranks' sum equal to it) and
#     every rank's gradient peak is below DDP's; as the kernel measured it
#     (each rank's peak resident memory during a step, shared memory by its
#     share), the ZeRO-2 ranks save, against DDP's, at least 3/4 of the
#     state, gradients and gather buffer ddpkit counts.
#   zero_checks.sh resume OUT ZERO_BIN DDP_BIN ARGS...
#     a ZeRO run's checkpoint (1 epoch, world 2) resumes in the DDP build
#     (world 2, to epoch 2), and a DDP checkpoint in the ZeRO build (to
#     epoch 3): one format for both.
#   zero_checks.sh reshard OUT ZERO_BIN SINGLE_BIN DDP_BIN ARGS...
#     a ZeRO-3 checkpoint (--zero-stage 3, world 2, epoch 1) resumes in
#     one process (to epoch 2), that one under DDP at world 2 (epoch 3)
#     and that one under ZeRO-3 at world 4 (epoch 4): the parameters'
#     shards of any world size are written and read as DDP's whole state.
#     At world 4 each rank's parameters + gradients + optimizer state (as
#     summary.json counts them) are within a quarter of DDP's plus two of
#     the largest unit, and its parameters between steps below a third.
#     Both ZeRO-3 runs write sharded checkpoints (--sharded-checkpoint):
#     the one process resumes from world 2's parts; world 4's last.pt is a
#     manifest naming four rank files, and --consolidate writes its whole
#     state dict, which Python's torch.load reads (every tensor the
#     manifest's index names, finite).
set -euo pipefail
source "$(dirname "$0")/torch_python.sh"
mode=$1
shift
case $mode in
  memory)
    "$py" - "$1" "$2" <<'PY'
import json, sys
ddp = json.load(open(f"{sys.argv[1]}/summary.json"))["memory_bytes_per_rank"]
zero = json.load(open(f"{sys.argv[2]}/summary.json"))["memory_bytes_per_rank"]
MiB = 2**20
mb = lambda xs: " / ".join(f"{x / MiB:.1f}" for x in xs)
keys = ("optimizer_state", "gradients_peak", "parameter_gather",
        "step_peak_resident", "step_peak_proportional")
for key in keys:
    print(f"{key:22s} MiB per rank: DDP {mb(ddp[key])}   ZeRO-2 {mb(zero[key])}")
bad = []
# What ddpkit counts from the tensors it holds.
if not all(z < ddp["optimizer_state"][0] for z in zero["optimizer_state"]):
    bad.append("a ZeRO rank keeps as much optimizer state as DDP")
if sum(zero["optimizer_state"]) != ddp["optimizer_state"][0]:
    bad.append("the ZeRO ranks' optimizer states do not add up to DDP's")
if not all(z < min(ddp["gradients_peak"]) for z in zero["gradients_peak"]):
    bad.append("a ZeRO rank's gradient peak is not below DDP's")
# What the kernel measured (Note [Measured memory], detail/process_memory.hpp): each
# rank's peak during a step, shared memory by its share. ddpkit's counters
# say a ZeRO-2 rank holds, against the same rank of DDP, the optimizer
# state it does not own less (S - s: the state is SGD's momentum, one
# buffer per parameter) and the gradients it does not keep less (G - g: g
# its gradient peak, own gradients plus others' buckets in flight), and the
# gather buffer more. Over the ranks, the saving the kernel measured must
# be at least 3/4 of that counted saving. Measured here (Intel Xeon, torch
# 2.11, ResNet-34 at world 2, 2026-12-05): 117-144 % of the counted 126
# MiB in two runs, rank by rank 71-155 % (one epoch: 99 %) (glibc keeps freed memory for reuse: rank 0's
# checkpoint consolidation between epochs shows in its later steps' peak),
# so the rule is taken over the ranks. Buckets that ddpkit counts as freed
# but that stay allocated (checked by keeping a reference to each freed
# bucket) measured -13 % (ZeRO-2 held 17 MiB more than DDP).
if not (ddp["step_peaks_per_step"] and zero["step_peaks_per_step"]):
    bad.append("the kernel would not reset the peak per step")
counted = measured = 0
for r in range(len(zero["optimizer_state"])):
    S = ddp["optimizer_state"][r]
    G = ddp["gradients_peak"][r]
    s = zero["optimizer_state"][r]
    g = zero["gradients_peak"][r]
    gather = zero["parameter_gather"][r]
    c = (S - s) + (G - g) - gather
    m = ddp["step_peak_proportional"][r] - zero["step_peak_proportional"][r]
    counted += c
    measured += m
    print(f"rank {r}: measured step peak DDP {ddp['step_peak_proportional'][r] / MiB:.1f} "
          f"MiB, ZeRO-2 {zero['step_peak_proportional'][r] / MiB:.1f}: saves "
          f"{m / MiB:.1f} MiB; counted saving {c / MiB:.1f} ({(S - s) / MiB:.1f} "
          f"state + {(G - g) / MiB:.1f} gradients - {gather / MiB:.1f} gather)")
print(f"over the ranks: measured saving {measured / MiB:.1f} MiB, "
      f"{100 * measured / counted:.0f} % of the counted {counted / MiB:.1f}")
if measured < 0.75 * counted:
    bad.append(f"the measured saving ({measured / MiB:.1f} MiB over the "
               f"ranks) is below 3/4 of what ddpkit counts "
               f"({counted / MiB:.1f} MiB)")
if bad:
    sys.exit("FAILED: " + "; ".join(bad))
print("ok")
PY
    ;;
  resume)
    out=$1 zero=$2 ddp=$3
    shift 3
    rm -rf "$out"
    "$zero" --world-size 2 --epochs 1 --out "$out" "$@"
    "$ddp" --world-size 2 --epochs 2 --resume auto --out "$out" "$@"
    "$zero" --world-size 2 --epochs 3 --resume auto --out "$out" "$@"
    "$py" - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
epochs = [r["epoch"] for r in rows]
if epochs != [1, 2, 3]:
    sys.exit(f"FAILED: metrics.jsonl epochs {epochs}, expected [1, 2, 3]")
print("ok: ZeRO -> DDP -> ZeRO resumed through epochs", epochs)
PY
    [[ ${DDPKIT_KEEP_TEST_RUNS:-0} == 1 ]] || rm -rf "$out" # passed: see run_example.sh
    ;;
  reshard)
    out=$1 zero=$2 single=$3 ddp=$4
    shift 4
    rm -rf "$out"
    "$zero" --zero-stage 3 --world-size 2 --epochs 1 --out "$out" --sharded-checkpoint "$@"
    cp "$out/summary.json" "$out/summary-zero3-w2.json"
    "$single" --epochs 2 --resume auto --resume-allow-changes --out "$out" "$@"
    # --meter-memory: the step peaks measured where tensors are allocated.
    "$ddp" --world-size 2 --epochs 3 --resume auto --resume-allow-changes --out "$out" --meter-memory "$@"
    cp "$out/summary.json" "$out/summary-ddp-w2.json"
    "$zero" --zero-stage 3 --world-size 4 --epochs 4 --resume auto --resume-allow-changes --out "$out" --meter-memory --sharded-checkpoint "$@"
    "$zero" --out "$out" --consolidate "$out/consolidated.pt" "$@"
    "$py" - "$out" <<'PY'
import glob, sys, torch
out = sys.argv[1]
m = torch.load(f"{out}/checkpoints/last.pt")
if "shards" not in m or "model" in m or "optimizer" in m:
    sys.exit(f"FAILED: last.pt is not a sharded manifest: {sorted(m)}")
files = sorted(glob.glob(f"{out}/checkpoints/{m['shards']['folder']}/rank-*-of-00004.pt"))
if len(files) != 4 or m["shards"]["world"] != 4:
    sys.exit(f"FAILED: the manifest's folder holds {files}, world {m['shards']['world']}")
for f in files:  # each rank's file, as Python reads it
    shard = torch.load(f)
    if shard["format"] != "ddpkit.shard" or shard["world"] != 4:
        sys.exit(f"FAILED: {f} is not a shard of world 4")
sd = torch.load(f"{out}/consolidated.pt")
want = {k[len("model/"):] for k in m["shards"]["index"] if k.startswith("model/")}
if set(sd) != want:
    sys.exit(f"FAILED: consolidated keys differ from the index: {sorted(set(sd) ^ want)[:5]}")
if not all(torch.isfinite(t).all() for t in sd.values() if t.is_floating_point()):
    sys.exit("FAILED: a consolidated tensor is not finite")
print(f"ok: world 4's sharded last.pt names 4 rank files; --consolidate wrote "
      f"{len(sd)} tensors ({sum(t.numel() for t in sd.values())} elements), "
      f"fc.weight {tuple(sd['fc.weight'].shape)}")
PY
    "$py" - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
epochs = [r["epoch"] for r in rows]
if epochs != [1, 2, 3, 4]:
    sys.exit(f"FAILED: metrics.jsonl epochs {epochs}, expected [1, 2, 3, 4]")
print("ok: ZeRO-3 (world 2) -> one process -> DDP (world 2) -> ZeRO-3 "
      "(world 4) resumed through epochs", epochs)
modes = [json.load(open(f"{out}/{f}"))["mode"]
         for f in ("summary-zero3-w2.json", "summary-ddp-w2.json", "summary.json")]
if modes != ["zero3", "ddp", "zero3"]:
    sys.exit(f"FAILED: summary.json modes {modes}, expected zero3, ddp, zero3")
# The ZeRO paper's bound at world 4: a rank's parameters + gradients +
# optimizer state within a quarter of DDP's plus two of the largest unit
# (the one gathered and the next; parameter_gather is the largest unit's
# whole buffer).
ddp = json.load(open(f"{out}/summary-ddp-w2.json"))["memory_bytes_per_rank"]
z3 = json.load(open(f"{out}/summary.json"))["memory_bytes_per_rank"]
MiB = 2**20
whole = ddp["parameters"][0] + ddp["gradients_peak"][0] + ddp["optimizer_state"][0]
bad = []
for r in range(4):
    mine = z3["parameters"][r] + z3["gradients_peak"][r] + z3["optimizer_state"][r]
    bound = whole / 4 + 2 * z3["parameter_gather"][r]
    print(f"rank {r}: parameters {z3['parameters'][r] / MiB:.1f} + gradients "
          f"{z3['gradients_peak'][r] / MiB:.1f} + optimizer state "
          f"{z3['optimizer_state'][r] / MiB:.1f} = {mine / MiB:.1f} MiB; DDP "
          f"{whole / MiB:.1f} / 4 + 2 x largest unit "
          f"{z3['parameter_gather'][r] / MiB:.1f} = {bound / MiB:.1f}; measured "
          f"step peak {z3['step_peak_proportional'][r] / MiB:.1f} (DDP world 2: "
          f"{ddp['step_peak_proportional'][min(r, 1)] / MiB:.1f})")
    if not 0 < mine <= bound:
        bad.append(f"rank {r} holds {mine / MiB:.1f} MiB, over {bound / MiB:.1f}")
    # Measured by the metered allocator: ZeRO-3's step peak (activations
    # and the units gathered included) well under DDP's at world 2.
    # Measured: 124-128 MiB against DDP's 244 on an Intel Xeon (AVX512,
    # AMX; 2026-12-05), 146-155 against 244 on an AMD EPYC (AVX2;
    # 2026-12-07: the kernels' workspaces differ by CPU), so 0.7x.
    alloc, step = z3["step_peak_allocated"][r], z3["peak_step"][r]
    ddp_alloc = ddp["step_peak_allocated"][min(r, 1)]
    print(f"  allocator: step peak {alloc / MiB:.1f} MiB, with shared "
          f"segments {step / MiB:.1f} (DDP world 2: {ddp_alloc / MiB:.1f}, "
          f"{ddp['peak_step'][min(r, 1)] / MiB:.1f})")
    if not 0 < alloc <= step:
        bad.append(f"rank {r}: step_peak_allocated {alloc}, peak_step {step}")
    if not alloc < 0.7 * ddp_alloc:
        bad.append(f"rank {r}: measured step peak {alloc / MiB:.1f} MiB, not "
                   f"under 0.7 x DDP's {ddp_alloc / MiB:.1f}")
    if not z3["parameters"][r] < ddp["parameters"][0] / 3:
        bad.append(f"rank {r} keeps {z3['parameters'][r] / MiB:.1f} MiB of "
                   f"parameters between steps (DDP {ddp['parameters'][0] / MiB:.1f})")
if bad:
    sys.exit("FAILED: " + "; ".join(bad))
PY
    [[ ${DDPKIT_KEEP_TEST_RUNS:-0} == 1 ]] || rm -rf "$out" # passed: see run_example.sh
    ;;
  *) echo "usage: zero_checks.sh memory|resume|reshard ..." >&2; exit 2 ;;
esac
