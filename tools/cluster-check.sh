#!/usr/bin/env bash
# The multi-host checks on a GPU machine (issue 52): install and build jaxgin, then
# tools/cluster_check.py: the doctor, and python -m jaxgin.pairtest in emulated worlds 2, 4, 8 and
# on the mixed mesh, side by side. EXAMPLES=1 runs the quickstart and the MoE example on two
# emulated hosts instead. Needs NCCL >= 2.30: stage it first with ../shared/tools/nccl-stage.
# Results: $OUT/cluster_check.json (the summary), doctor.json, pairtest_<job>.json and every
# rank's output in pairtest_<job>/ (example_<name>/ with EXAMPLES=1), logs in $OUT/*.log.
source "$(dirname "$0")/round-common.sh"
install_jaxgin || exit 1
step 120 transport python3 -m jaxgin.transport
if [ "${EXAMPLES:-0}" = 1 ]; then
  TAIL=40 step 560 cluster-check python3 tools/cluster_check.py --out "$OUT" --examples
else
  TAIL=60 step 300 cluster-check python3 tools/cluster_check.py --out "$OUT"
fi
exit $status
