#!/usr/bin/env bash
# A binary of a CUDA libtorch build links libtorch_cuda and, with NCCL,
# calls c10d's NCCL process group; run here, it says CUDA is unavailable
# and still works (the example tests train with gloo).
#   cuda_linked.sh BINARY NCCL(ON|OFF)
set -euo pipefail
bin=$1 nccl=$2
needed=$(readelf -d "$bin")
grep -q 'NEEDED.*libtorch_cuda\.so' <<<"$needed" ||
  { echo "$bin does not link libtorch_cuda.so"; readelf -d "$bin" | grep NEEDED; exit 1; }
echo "$bin links libtorch_cuda.so"
if [[ $nccl == ON ]]; then
  n=$(nm -DC "$bin" | grep -c 'c10d::ProcessGroupNCCL::ProcessGroupNCCL' || true)
  ((n > 0)) || { echo "$bin has no reference to c10d::ProcessGroupNCCL"; exit 1; }
  echo "$bin calls c10d::ProcessGroupNCCL ($n symbols)"
fi
