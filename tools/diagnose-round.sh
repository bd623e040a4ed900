#!/usr/bin/env bash
# Diagnosis jobs for a GPU round (ROUND_COMMANDS=tools/diagnose-round.sh bash tools/emulated-round.sh start),
# run side by side: each keeps every rank's whole stdout and stderr under $RESULTS/<job>/
# (tools/emulated_job.py), and the native stacks of every thread of the ranks still running at the
# --stacks-after times.
# After launch pacing (2026-11-25), two world-2 failures were seen once each in a full round: the
# 4 MiB mailbox path of the memory-model loop (a sender's flush timed out: its transport never took
# the puts) and a selftest barrier signal in the lifecycle job (the receiver's transport wrote it
# only after the trap). How often do they come back? Three and two tries, side by side.
# (CUDA_DEVICE_MAX_CONNECTIONS=32, tried against a shared hardware queue, made the emulated worlds
# fail to create CUDA contexts: 32 processes on one GPU with 32 queues each.)
set -u
RESULTS=${RESULTS:?}
job() { local name=$1; shift; timeout 400 python3 tools/emulated_job.py --out "$RESULTS/$name" "$@" > "$RESULTS/$name.summary" 2>&1; echo "--- $name: exit $? $(tail -1 "$RESULTS/$name.summary")"; }
MM=(--env JAXGIN_TIMEOUT=60 --env JAXGIN_MEMORY_MODEL_ITERATIONS=300 tests/gpu/reliability_scenarios.py memory_model)
for try in a b c; do job memory-model-w2-$try --world 2 --timeout 200 --stacks-after 70 "${MM[@]}" & done
for try in a b; do job lifecycle-w2-$try --world 2 --timeout 200 --stacks-after 70 --env JAXGIN_TIMEOUT=60 tests/gpu/scenarios.py lifecycle & done
wait
exit 0
