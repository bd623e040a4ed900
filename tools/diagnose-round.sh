#!/usr/bin/env bash
# Diagnosis jobs for a GPU round (ROUND_COMMANDS=tools/diagnose-round.sh bash tools/emulated-round.sh start):
# each job keeps every rank's whole stdout and stderr under $RESULTS/<job>/ (tools/emulated_job.py).
#  - lifecycle at world 2: initialize -> finalize -> initialize, with NCCL's INIT/NET log (which
#    shows NCCL loading and unloading the RMA plugin);
#  - 1000 iterations under XLA command buffers at world 2, every transport request and delivery traced;
#  - the same with 32 hardware work queues per process instead of 8 (CUDA_DEVICE_MAX_CONNECTIONS).
# The plugin and the backend that ran are copied too, for addr2line on crash offsets.
set -u
RESULTS=${RESULTS:?}
job() { local name=$1; shift; echo "--- $name"; timeout 400 python3 tools/emulated_job.py --out "$RESULTS/$name" "$@"; echo "exit $?"; }
export JAXGIN_TIMEOUT=${JAXGIN_TIMEOUT:-20}
job lifecycle-w2 --world 2 --timeout 240 --env NCCL_DEBUG=INFO --env NCCL_DEBUG_SUBSYS=INIT,NET \
  tests/gpu/scenarios.py lifecycle
job graphs-trace-w2 --world 2 --graphs --timeout 240 --env JAXGIN_TRANSPORT_TRACE=1 --env NCCL_DEBUG=WARN \
  --xla-flags "--xla_dump_to=$RESULTS/hlo --xla_dump_hlo_module_re=.*(step|shard_map).*" \
  tests/gpu/transport_scenarios.py iterations
job graphs-32queues-w2 --world 2 --graphs --timeout 240 --env CUDA_DEVICE_MAX_CONNECTIONS=32 \
  tests/gpu/transport_scenarios.py iterations
mkdir -p "$RESULTS/libraries"
cp "${JAXGIN_CACHE_DIR:-/tmp/jaxgin-cache}"/transport-*/libjaxgin_transport.so "$RESULTS/libraries/" 2>/dev/null
ls "${JAXGIN_CACHE_DIR:-/tmp/jaxgin-cache}"
