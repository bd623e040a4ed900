#!/usr/bin/env bash
# Diagnosis jobs for a GPU round (ROUND_COMMANDS=tools/diagnose-round.sh bash tools/emulated-round.sh start),
# started in the background so that the pytest half of the round (ROUND_SUITE) runs beside them:
# each keeps every rank's whole stdout and stderr under $RESULTS/<job>/ (tools/emulated_job.py),
# and the native stacks of every thread of the ranks still running at the --stacks-after times.
# Last used for MoE dispatch / combine over GIN at world 2 (emulated hosts): its first round hung in the
# first call, every rank's placers waiting for the counts flag of their GIN source; the stacks say
# where program 0 and the transport's threads were (the cause: lazy kernel loading, fixed in 450d37c).
set -u
RESULTS=${RESULTS:?}
job() { local name=$1; shift; timeout 400 python3 tools/emulated_job.py --out "$RESULTS/$name" "$@" > "$RESULTS/$name.summary" 2>&1; echo "--- $name: exit $? $(tail -1 "$RESULTS/$name.summary")" >> "$RESULTS/jobs.log"; }
job moe-w2 --world 2 --timeout 300 --stacks-after 50 --env JAXGIN_TIMEOUT=60 tests/gpu/moe_scenarios.py check &
exit 0
