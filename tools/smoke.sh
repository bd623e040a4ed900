# Quick GPU round during development: build, then the ops scenarios (see tests/gpu/ops_scenarios.py).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 JAXGIN_CACHE_DIR=/tmp/jaxgin-cache
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail -20 $OUT/install.log
python3 -m jaxgin.build 2>&1 | tail -1
for s in "$@"; do
  echo "=== $s"
  timeout 300 python3 tests/gpu/ops_scenarios.py $s 2>&1 | tail -${TAIL:-15}
done
if [ -n "$BENCH" ]; then
  echo "=== benchmark"
  timeout 500 python3 benchmarks/collectives.py --out $OUT $BENCH 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -60
fi
