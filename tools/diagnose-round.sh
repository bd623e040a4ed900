#!/usr/bin/env bash
# Diagnosis jobs for a GPU round (ROUND_COMMANDS=tools/diagnose-round.sh bash tools/emulated-round.sh start):
# each job keeps every rank's whole stdout and stderr under $RESULTS/<job>/ (tools/emulated_job.py),
# and the native stacks of every thread of the ranks still running at the --stacks-after times.
# The two failures left open on 2026-11-25 (emulated hosts, NCCL 2.32.3, one H100):
#  - memory_model: the 172nd put of the first path (8 KiB mailbox puts in one XLA while loop) never
#    arrives, at worlds 2, 4 and 8, in two rounds. World 2 with the transport's trace (one stderr line
#    per request, delivery and applied signal): does rank 0's transport send put 172, and does rank
#    1's apply its signal? Stacks at 60 s, while the ranks wait (the timeout is 120 s).
#  - timeout / timeout_from: one rank, at random, never returns from block_until_ready after its
#    wait kernel timed out (its XLA threads idle). Three tries each at world 4; stacks at 50 s.
# The plugin that ran is copied too, for addr2line on stack offsets.
set -u
RESULTS=${RESULTS:?}
job() { local name=$1; shift; echo "--- $name"; timeout 400 python3 tools/emulated_job.py --out "$RESULTS/$name" "$@"; echo "exit $?"; }
job memory-model-w2-trace --world 2 --timeout 150 --stacks-after 60 \
  --env JAXGIN_TIMEOUT=120 --env JAXGIN_MEMORY_MODEL_ITERATIONS=300 --env JAXGIN_TRANSPORT_TRACE=1 \
  tests/gpu/reliability_scenarios.py memory_model
# A false dependency behind the spinning wait kernel (the transport's apply stream sharing a hardware
# queue with it) would stall the signal write too: the same job with 32 queues instead of 8.
job memory-model-w2-connections32 --world 2 --timeout 150 --stacks-after 60 \
  --env JAXGIN_TIMEOUT=120 --env JAXGIN_MEMORY_MODEL_ITERATIONS=300 --env CUDA_DEVICE_MAX_CONNECTIONS=32 \
  tests/gpu/reliability_scenarios.py memory_model
for try in 1 2 3; do
  job timeout-w4-$try --world 4 --timeout 90 --stacks-after 50 tests/gpu/ops_scenarios.py timeout
  job timeout-from-w4-$try --world 4 --timeout 90 --stacks-after 50 tests/gpu/ops_scenarios.py timeout_from
done
mkdir -p "$RESULTS/libraries"
cp "${JAXGIN_CACHE_DIR:-/tmp/jaxgin-cache}"/transport-*/libjaxgin_transport.so "$RESULTS/libraries/" 2>/dev/null
exit 0
