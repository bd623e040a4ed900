#!/usr/bin/env bash
# Diagnosis jobs for a GPU round (ROUND_COMMANDS=tools/diagnose-round.sh bash tools/emulated-round.sh start),
# run side by side: each keeps every rank's whole stdout and stderr under $RESULTS/<job>/
# (tools/emulated_job.py), and the native stacks of every thread of the ranks still running at the
# --stacks-after times.
# After launch pacing (2026-11-25), two world-2 failures were left: the 4 MiB mailbox path of the
# memory-model loop (a sender's flush timed out: its transport never took the puts) and a selftest
# barrier signal in the lifecycle job (the receiver's transport wrote it only after the trap). Both
# fit the transport's streams sharing a CUDA hardware queue with XLA's (jaxgin.hardware_queues).
#  - with CUDA's default of 8 queues, stacks taken while the ranks hang: where the transport waits;
#  - with jaxgin's default (32 queues), twice each: the fix.
set -u
RESULTS=${RESULTS:?}
job() { local name=$1; shift; timeout 400 python3 tools/emulated_job.py --out "$RESULTS/$name" "$@" > "$RESULTS/$name.summary" 2>&1; echo "--- $name: exit $? $(tail -1 "$RESULTS/$name.summary")"; }
MM=(--env JAXGIN_TIMEOUT=60 --env JAXGIN_MEMORY_MODEL_ITERATIONS=300 tests/gpu/reliability_scenarios.py memory_model)
job memory-model-w2-queues8 --world 2 --timeout 200 --stacks-after 75 --env CUDA_DEVICE_MAX_CONNECTIONS=8 "${MM[@]}" &
job memory-model-w2-a --world 2 --timeout 200 "${MM[@]}" &
job memory-model-w2-b --world 2 --timeout 200 "${MM[@]}" &
job lifecycle-w2-a --world 2 --timeout 200 --env JAXGIN_TIMEOUT=60 tests/gpu/scenarios.py lifecycle &
job lifecycle-w2-b --world 2 --timeout 200 --env JAXGIN_TIMEOUT=60 tests/gpu/scenarios.py lifecycle &
wait
exit 0
