#!/usr/bin/env bash
# One round for the host transport (issue 8) on a lent GPU machine that has NCCL >= 2.30 (bring
# 2.32.3 with ../shared/tools/nccl-stage first): install, the smoke check with timings, the
# transport's GPU and CPU tests, and the tritongin GPU tests with every peer forced through GIN
# over the plugin. Logs and JSON go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$(mktemp -d)}
export JAXGIN_RESULTS_DIR=$OUT JAXGIN_CACHE_DIR=${JAXGIN_CACHE_DIR:-/tmp/jaxgin-cache}
cd "$(dirname "$0")/.."
exec > >(tee "$OUT/transport-round.log") 2>&1
status=0
step() { echo "=== $1"; shift; "$@" || { echo "=== FAILED ($?): $*"; status=1; }; }
forced=(env JAXGIN_FORCE_GIN=1 JAXGIN_GIN_TRANSPORT=host JAXGIN_TRANSPORT_QUIET=1)
step "install" python3 -m pip install -q --no-build-isolation --no-deps -e .
step "nccl" python3 -c "import jaxgin.nccl as n; print(n.load())"
step "smoke" env JAXGIN_TIMEOUT=${JAXGIN_TIMEOUT:-10} timeout 400 python3 tools/transport_smoke.py --out "$OUT"
[ "${SMOKE_ONLY:-0}" = 1 ] && exit $status
step "transport tests" python3 -m pytest -v -rA tests/gpu/test_transport_gpu.py tests/test_transport.py
step "tritongin over the host transport" "${forced[@]}" python3 -m pytest -v -rA tests/gpu/test_tritongin_gpu.py \
  -k "standalone or triton_call"
exit $status
