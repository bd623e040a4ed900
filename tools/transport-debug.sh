#!/usr/bin/env bash
# Diagnoses host-transport failures on a lent GPU machine (NCCL >= 2.30 staged): issue 3's
# correctness scenario over the plugin, one process for both GPUs and one process per GPU, with
# NCCL warnings and the plugin's trace (TRACE=0 turns it off). With RETRY32=1 a failing
# single-process run is repeated with CUDA_DEVICE_MAX_CONNECTIONS=32 (more hardware queues, fewer
# false dependencies between streams). Every step is bounded (SINGLE_S, PROCESSES_S seconds); logs
# go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONFAULTHANDLER=1
OUT=${OUT:-$(mktemp -d)}
export JAXGIN_CACHE_DIR=${JAXGIN_CACHE_DIR:-/tmp/jaxgin-cache}
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
common=(env JAXGIN_FORCE_GIN=1 JAXGIN_GIN_TRANSPORT=host JAXGIN_TRANSPORT_QUIET=1 JAXGIN_TIMEOUT=10
        JAXGIN_TRANSPORT_CONNECT_TIMEOUT=40 NCCL_DEBUG=WARN CUDA_VISIBLE_DEVICES=0,1
        JAXGIN_TRANSPORT_TRACE=${TRACE:-1})
summary() {  # name rc
  echo "rc $2"; grep -h -E "^RESULT" "$OUT/$1.out" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line[7:]); print({k: r.get(k) for k in ('checks', 'failed', 'transport')})" 2>&1 | cut -c1-800
  grep -v "transport trace" "$OUT/$1.err" | grep -v "^E11\|Source Location\|cuda_status\|^$" | tail -8 | cut -c1-300
}
single() {  # name, extra env...
  local name=$1; shift
  echo "=== correctness, one process ($name)"
  "${common[@]}" "$@" timeout -s ABRT ${SINGLE_S:-300} python3 tests/gpu/transport_scenarios.py correctness \
    > "$OUT/$name.out" 2> "$OUT/$name.err"
  local rc=$?; summary "$name" $rc; return $rc
}
single single || { [ "${RETRY32:-0}" = 1 ] && single single-32 CUDA_DEVICE_MAX_CONNECTIONS=32; }
echo "=== correctness, process per GPU"
port=$((20000 + RANDOM % 20000))
for r in 0 1; do
  "${common[@]}" timeout -s ABRT ${PROCESSES_S:-240} python3 tests/gpu/transport_scenarios.py correctness $r 2 127.0.0.1:$port \
    > "$OUT/proc$r.out" 2> "$OUT/proc$r.err" &
done
wait
for r in 0 1; do echo "--- rank $r"; summary proc$r -; done
for f in "$OUT"/*.err; do
  [ "$(stat -c %s "$f")" -gt 8000000 ] && { head -c 2000000 "$f" > "$f.head"; tail -c 4000000 "$f" > "$f.tail"; rm "$f"; }
done
exit 0
