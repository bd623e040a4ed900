#!/usr/bin/env bash
# Diagnosis jobs for a GPU round (ROUND_COMMANDS=tools/diagnose-round.sh bash tools/emulated-round.sh start):
# each job keeps every rank's whole stdout and stderr under $RESULTS/<job>/ (tools/emulated_job.py),
# and the native stacks of every thread of the ranks still running at the --stacks-after times.
#  - 1000 iterations under XLA command buffers at world 2, every transport request and delivery
#    traced: where each thread waits once the ranks stall.
# The plugin that ran is copied too, for addr2line on crash offsets.
set -u
RESULTS=${RESULTS:?}
job() { local name=$1; shift; echo "--- $name"; timeout 400 python3 tools/emulated_job.py --out "$RESULTS/$name" "$@"; echo "exit $?"; }
JAXGIN_TIMEOUT=90 job graphs-trace-w2 --world 2 --graphs --timeout 150 --stacks-after 40 --stacks-after 60 \
  --env JAXGIN_TRANSPORT_TRACE=1 tests/gpu/transport_scenarios.py iterations
mkdir -p "$RESULTS/libraries"
cp "${JAXGIN_CACHE_DIR:-/tmp/jaxgin-cache}"/transport-*/libjaxgin_transport.so "$RESULTS/libraries/" 2>/dev/null
exit 0
