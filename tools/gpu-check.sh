#!/usr/bin/env bash
# One round on a lent GPU machine: build jaxgin there, print what it finds, run the GPU tests and
# every example (without GPUs those say what they can do). Arguments replace the test selection,
# e.g. bash tools/gpu-check.sh tests/gpu/test_tritongin_gpu.py. EXAMPLES=0 skips the examples;
# BENCH="benchmarks/fused.py ..." runs benchmarks afterwards (writing into $OUT). Logs and JSON
# results go to $OUT (the device tool brings that folder back).
set -o pipefail
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-$(mktemp -d)}
export JAXGIN_RESULTS_DIR=$OUT JAXGIN_CACHE_DIR=${JAXGIN_CACHE_DIR:-/tmp/jaxgin-cache}
cd "$(dirname "$0")/.."
exec > >(tee "$OUT/gpu-check.log") 2>&1
status=0
step() { echo "=== $1"; shift; "$@" || { echo "=== FAILED ($?): $*"; status=1; }; }
step "machine" nvidia-smi -L
step "install" python3 -m pip install -q --no-build-isolation --no-deps -e .
step "prebuild" python3 -m jaxgin.build -v
step "info" python3 -m jaxgin.info
step "nvjitlink" python3 -c "from jaxgin.triton import link; l = link.nvjitlink(); print(l.path, l.version)"
step "gpu tests" python3 -m pytest -v -rA "${@:-tests/gpu}"
if [ "${EXAMPLES:-1}" != 0 ]; then
  for example in examples/*.py; do step "$example" python3 "$example"; done
fi
for bench in ${BENCH:+"$BENCH"}; do step "$bench" python3 $bench --out "$OUT"; done
exit $status
