#!/usr/bin/env bash
# Diagnosis jobs for a GPU round (ROUND_COMMANDS=tools/diagnose-round.sh bash tools/emulated-round.sh start),
# run side by side: each keeps every rank's whole stdout and stderr under $RESULTS/<job>/
# (tools/emulated_job.py), and the native stacks of every thread of the ranks still running at the
# --stacks-after times.
#  - memory_model: the 172nd put of the first path (8 KiB mailbox puts in one XLA while loop) never
#    arrives, at worlds 2, 4 and 8 (two rounds of 2026-11-25). The receiver's transport met a CUDA
#    error in cudaEventRecord right after the copy of a staged put, i.e. its agent thread sat in
#    cudaMemcpyAsync until the wait kernel trapped. The trace says whether put 172 reached the agent;
#    the stacks (taken while the ranks hang, before the 100 s timeout) say where the agent and
#    XLA's threads wait.
#  - the same with CUDA_DEVICE_MAX_CONNECTIONS=32 (a false dependency in a shared hardware queue).
#  - timeout at world 4, twice: a rank that never returns after its wait kernel trapped must be
#    ended by the fault watch (exit 75) naming the fault.
set -u
RESULTS=${RESULTS:?}
job() { local name=$1; shift; timeout 400 python3 tools/emulated_job.py --out "$RESULTS/$name" "$@" > "$RESULTS/$name.summary" 2>&1; echo "--- $name: exit $? $(tail -1 "$RESULTS/$name.summary")"; }
MM=(--env JAXGIN_TIMEOUT=100 --env JAXGIN_MEMORY_MODEL_ITERATIONS=300 tests/gpu/reliability_scenarios.py memory_model)
job memory-model-w2-trace --world 2 --timeout 200 --stacks-after 55 --stacks-after 85 --env JAXGIN_TRANSPORT_TRACE=1 "${MM[@]}" &
job memory-model-w2-connections32 --world 2 --timeout 200 --stacks-after 60 --env CUDA_DEVICE_MAX_CONNECTIONS=32 "${MM[@]}" &
job timeout-w4-1 --world 4 --timeout 150 --stacks-after 70 --env JAXGIN_FAULT_GRACE=20 tests/gpu/ops_scenarios.py timeout &
job timeout-from-w4-1 --world 4 --timeout 150 --stacks-after 70 --env JAXGIN_FAULT_GRACE=20 tests/gpu/ops_scenarios.py timeout_from &
wait
mkdir -p "$RESULTS/libraries"
cp "${JAXGIN_CACHE_DIR:-/tmp/jaxgin-cache}"/transport-*/libjaxgin_transport.so "$RESULTS/libraries/" 2>/dev/null
exit 0
