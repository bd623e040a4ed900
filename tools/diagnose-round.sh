#!/usr/bin/env bash
# Diagnosis jobs for a GPU round (ROUND_COMMANDS=tools/diagnose-round.sh bash tools/emulated-round.sh start):
# each job keeps every rank's whole stdout and stderr under $RESULTS/<job>/ (tools/emulated_job.py),
# and the native stacks of every thread of the ranks still running at the --stacks-after times.
#  - 1000 iterations under XLA command buffers at worlds 2 and 4 (stacks if still running at 120 s).
# The plugin that ran is copied too, for addr2line on crash offsets.
set -u
RESULTS=${RESULTS:?}
job() { local name=$1; shift; echo "--- $name"; timeout 400 python3 tools/emulated_job.py --out "$RESULTS/$name" "$@"; echo "exit $?"; }
for world in 2 4; do
  JAXGIN_TIMEOUT=60 job graphs-w$world --world $world --graphs --timeout 200 --stacks-after 120 \
    tests/gpu/transport_scenarios.py iterations
done
mkdir -p "$RESULTS/libraries"
cp "${JAXGIN_CACHE_DIR:-/tmp/jaxgin-cache}"/transport-*/libjaxgin_transport.so "$RESULTS/libraries/" 2>/dev/null
exit 0
