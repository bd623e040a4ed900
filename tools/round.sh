# Development round: install, build, then the tests or scenarios named in the arguments.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 JAXGIN_CACHE_DIR=/tmp/jaxgin-cache JAXGIN_RESULTS_DIR=$OUT
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail -20 $OUT/install.log
python3 -m jaxgin.build 2>&1 | tail -1
timeout 500 python3 -m pytest -q -rA "$@" 2>&1 | tail -${TAIL:-20}
