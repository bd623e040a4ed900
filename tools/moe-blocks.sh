#!/usr/bin/env bash
# Compares block settings of jaxgin.moe's kernels on a GPU machine, one process per setting (a
# setting that fails does not take the others with it). Results: $OUT/blocks-N/moe.json.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$(mktemp -d)}
cd "$(dirname "$0")/.."
i=0
for setting in "$@"; do
  echo "=== JAXGIN_MOE_BLOCKS=$setting"
  JAXGIN_MOE_BLOCKS=$setting timeout 120 python3 benchmarks/moe.py --out "$OUT/blocks-$i" --tokens 4096,128 \
    --only jaxgin_dispatch,jaxgin_combine,routing_only --repeats 3 > "$OUT/blocks-$i.log" 2>&1
  echo "exit $?"; grep -E " us$" "$OUT/blocks-$i.log"
  i=$((i + 1))
done
