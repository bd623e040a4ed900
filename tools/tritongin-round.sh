#!/usr/bin/env bash
# A tritongin round on a lent GPU machine: install, build, the tritongin GPU tests and examples.
# Logs and JSON results go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-$(mktemp -d)}
export JAXGIN_RESULTS_DIR=$OUT JAXGIN_CACHE_DIR=${JAXGIN_CACHE_DIR:-/tmp/jaxgin-cache}
cd "$(dirname "$0")/.."
exec > >(tee "$OUT/tritongin-round.log") 2>&1
status=0
step() { echo "=== $1"; shift; "$@" || { echo "=== FAILED ($?): $*"; status=1; }; }
step "machine" nvidia-smi -L
step "install" python3 -m pip install -q --no-build-isolation --no-deps -e .
step "prebuild" python3 -m jaxgin.build
step "nvjitlink" python3 -c "from tritongin import link; l = link.nvjitlink(); print(l.path, l.version)"
step "tritongin tests" python3 -m pytest tests/gpu/test_tritongin_gpu.py -v -rA "$@"
for example in examples/triton_*.py; do step "$example" python3 "$example"; done
exit $status
