#!/usr/bin/env bash
# Diagnosis jobs for a GPU round (ROUND_COMMANDS=tools/diagnose-round.sh bash tools/emulated-round.sh start):
# each job keeps every rank's whole stdout and stderr under $RESULTS/<job>/ (tools/emulated_job.py),
# and native stacks of every thread (cuda-gdb) of the ranks still running at the --stacks-after times.
#  - 1000 iterations under XLA command buffers at world 2: every transport request and delivery
#    traced, XLA's thunk sequence dumped (which calls sit inside command buffers);
#  - the triton_call ring under command buffers at world 2;
#  - 1000 plain iterations at world 8, alone on the GPU.
# The plugin that ran is copied too, for addr2line on crash offsets.
set -u
RESULTS=${RESULTS:?}
job() { local name=$1; shift; echo "--- $name"; timeout 400 python3 tools/emulated_job.py --out "$RESULTS/$name" "$@"; echo "exit $?"; }
JAXGIN_TIMEOUT=90 job graphs-trace-w2 --world 2 --graphs --timeout 240 --stacks-after 50 --stacks-after 80 \
  --env JAXGIN_TRANSPORT_TRACE=1 \
  --xla-flags "--xla_dump_to=$RESULTS/hlo --xla_dump_hlo_module_re=.*(step|shard_map).*" \
  tests/gpu/transport_scenarios.py iterations
JAXGIN_TIMEOUT=60 job triton-graphs-w2 --world 2 --graphs --timeout 200 --stacks-after 70 \
  tests/gpu/tritongin_scenarios.py triton_call 200
JAXGIN_TIMEOUT=30 job plain-w8 --world 8 --timeout 240 --stacks-after 170 tests/gpu/transport_scenarios.py iterations
mkdir -p "$RESULTS/libraries"
cp "${JAXGIN_CACHE_DIR:-/tmp/jaxgin-cache}"/transport-*/libjaxgin_transport.so "$RESULTS/libraries/" 2>/dev/null
exit 0
