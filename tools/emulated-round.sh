#!/usr/bin/env bash
# The GPU suite on a lent machine with one GPU or more, the emulated-hosts tests included (worlds
# 2, 4 and 8 of processes sharing the GPUs, every peer through GIN over jaxgin's host transport).
# Those need NCCL >= 2.30: stage it first with ../shared/tools/nccl-stage (6 device calls).
#
# A whole round outlasts one device call (10 minutes), so it runs in the background, in a process
# session of its own, which outlives the call that started it; later calls wait on it:
#
#   bash tools/emulated-round.sh start [PYTEST ARGS]   # install, build, then pytest (default: tests/gpu)
#   bash tools/emulated-round.sh wait SECONDS          # up to SECONDS; copies the results into $OUT
#
# ROUND_SUITE=emulated or one-gpu runs half of the suite, a comma-separated list runs halves in
# that order (one-gpu,emulated: the quick check first), and ROUND_STOP_ON_FAILURE=1 ends the round
# at a failed half; ROUND_EMULATED_K=EXPR narrows the emulated half further (pytest -k, and-ed).
# ROUND_EMULATED_PATHS names the test files of that half, in the order they start (default tests/gpu).
# ROUND_SIDE_BY_SIDE=1 on a machine of several GPUs runs both halves at once, whatever ROUND_SUITE
# says: the one-GPU half on the last GPU, the emulated half on the others, each test's ranks all on
# one GPU (1 worker per GPU unless ROUND_WORKERS says otherwise).
# ROUND_COMMANDS=FILE (a shell script in the repo) runs that first, with $RESULTS naming the folder
# that comes back (diagnosis: tools/emulated_job.py keeps every rank's whole output); then pytest
# only if ROUND_SUITE is set too.
#
# Where pytest-xdist is installed (the machines' image has it), or the ignored folder .whl sent
# along holds its wheels, the tests run in ROUND_WORKERS (default 2) processes side by side. On one
# 80 GB GPU keep to 16 ranks at a time (2 workers at world 8, 4 at worlds 2 and 4): 4 world-8 tests
# side by side (32 ranks, each with XLA's memory, NCCL's and the transport's own CUDA context)
# failed in initialize() with "cuCtxCreate failed: out of memory" (2026-11-27).
# Crashes print native stacks (tools/native_backtrace.c, preloaded) and Python's
# (PYTHONFAULTHANDLER).
set -o pipefail
cd "$(dirname "$0")/.."
ROUND=${ROUND_DIR:-/root/jaxgin-round}

case "${1:-}" in
  start)
    shift
    rm -rf "$ROUND"; mkdir -p "$ROUND/results"
    cp -r . "$ROUND/repo" 2>/dev/null  # the call's working tree goes away when the call returns
    setsid bash "$ROUND/repo/tools/emulated-round.sh" run "$@" > "$ROUND/round.log" 2>&1 < /dev/null &
    sleep 2
    echo "round started in $ROUND (pid $!)"
    ;;
  run)
    shift
    export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 JAXGIN_TIMEOUT=${JAXGIN_TIMEOUT:-10}
    export JAXGIN_RESULTS_DIR=$ROUND/results JAXGIN_CACHE_DIR=${JAXGIN_CACHE_DIR:-/tmp/jaxgin-cache}
    export PYTHONFAULTHANDLER=1
    start=$(date +%s)
    stamp() { echo "=== $1 ($(( $(date +%s) - start )) s)"; }
    stamp "machine"; nvidia-smi -L
    parallel=()
    if python3 -c "import xdist, execnet" 2>/dev/null; then
      parallel=(-n "${ROUND_WORKERS:-2}")  # the machines' image has pytest-xdist since 2026-11
    elif ls .whl/pytest_xdist-*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/xdist .whl/pytest_xdist-*.whl .whl/execnet-*.whl \
        && export PYTHONPATH=/tmp/xdist${PYTHONPATH:+:$PYTHONPATH} && parallel=(-n "${ROUND_WORKERS:-2}")
    fi
    stamp "install"; python3 -m pip install -q --no-build-isolation --no-deps -e . || { echo "install failed"; touch "$ROUND/done"; exit 1; }
    stamp "build"; python3 -m jaxgin.build && python3 -m jaxgin.transport || { echo "build failed"; touch "$ROUND/done"; exit 1; }
    gcc -shared -fPIC -O1 -o /tmp/native_backtrace.so tools/native_backtrace.c -ldl && export LD_PRELOAD=/tmp/native_backtrace.so
    stamp "info"; python3 -m jaxgin.info
    # The machine's load and the GPU's use every 30 s, beside the results: whether ranks that share
    # a GPU wait for CPU cores (busy-polling proxy threads) or for the GPU.
    ( while sleep 30; do
        echo "$(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) gpu $(nvidia-smi --query-gpu=utilization.gpu,memory.used \
          --format=csv,noheader 2>/dev/null | paste -sd'|')"
      done ) > "$ROUND/results/load.log" 2>&1 &
    sampler=$!
    if [ -n "${ROUND_COMMANDS:-}" ]; then
      stamp "commands $ROUND_COMMANDS"; RESULTS=$ROUND/results bash "$ROUND_COMMANDS"
      echo "commands exit status $?"
    fi
    if [ -n "${ROUND_COMMANDS:-}" ] && [ -z "${ROUND_SUITE:-}" ]; then
      :  # the commands were the round
    elif [ $# -gt 0 ]; then
      stamp "tests"; python3 -m pytest -v -rA --durations=30 "${parallel[@]}" "$@" 2>&1 | tee "$ROUND/pytest.log"
      echo "pytest exit status $?"
    else
      # ROUND_SUITE names the halves to run, in order (default: emulated,one-gpu; "all" is that).
      # The emulated-hosts tests run side by side; the one-GPU tests one at a time: they read the
      # GPU's memory and take XLA's memory pool, so nothing may run beside them. One-GPU first is
      # a quick check of the kernels before the long emulated half; with ROUND_STOP_ON_FAILURE=1 a
      # failed half ends the round (a machine goes back after 30 minutes held).
      emulated_half() {
        stamp "emulated-hosts tests"
        JAXGIN_TIMEOUT=${JAXGIN_EMULATED_TIMEOUT:-30} python3 -m pytest -v -rA --durations=40 "${parallel[@]}" \
          ${ROUND_EMULATED_PATHS:-tests/gpu} -k "(emulated_hosts or launches_importing)${ROUND_EMULATED_K:+ and ($ROUND_EMULATED_K)}" 2>&1 \
          | tee "$ROUND/pytest-emulated.log"
        status=$?; echo "pytest exit status $status (emulated hosts)"; return $status
      }
      one_gpu_half() {
        stamp "one-GPU tests"
        python3 -m pytest -v -rA --durations=20 tests/gpu -k "not emulated_hosts and not launches_importing" 2>&1 \
          | tee "$ROUND/pytest-one-gpu.log"
        status=$?; echo "pytest exit status $status (one GPU)"; return $status
      }
      suite=${ROUND_SUITE:-all}
      [ "$suite" = all ] && suite=emulated,one-gpu
      gpus=$(nvidia-smi -L | grep -c '^GPU ')
      if [ "${ROUND_SIDE_BY_SIDE:-0}" = 1 ] && [ "$gpus" -ge 2 ]; then
        # A machine of several GPUs as several one-GPU machines: the one-GPU half alone on the
        # last GPU, and beside it the emulated half on the others, each xdist worker's jobs whole
        # on one GPU (JAXGIN_TEST_EMULATED_ONE_GPU), as on a one-GPU machine; the mixed-mesh
        # tests spread their hosts over those GPUs. ROUND_WORKERS then defaults to 1 per GPU: with
        # 2 per GPU (4 H100s, 2026-11-27) a GPU held two world-8 jobs and mixed-mesh ranks, reached
        # 78.4 GB, and a rank's cuCtxCreate ran out of memory; the load average on 64 cores was 170.
        last=$((gpus - 1)); others=$(seq -s, 0 $((last - 1)))
        [ -z "${ROUND_WORKERS:-}" ] && [ ${#parallel[@]} -gt 0 ] && parallel=(-n "$last")
        echo "side by side: one-GPU half on GPU $last, emulated half on GPUs $others (${parallel[*]})"
        ( export CUDA_VISIBLE_DEVICES=$last; one_gpu_half > "$ROUND/one-gpu.out" 2>&1 ) &
        one_gpu=$!
        ( export CUDA_VISIBLE_DEVICES=$others JAXGIN_TEST_EMULATED_ONE_GPU=1; emulated_half )
        wait "$one_gpu"; cat "$ROUND/one-gpu.out"
      else
        for half in ${suite//,/ }; do
          case "$half" in
            emulated) emulated_half;;
            one-gpu) one_gpu_half;;
            *) echo "ROUND_SUITE: unknown half '$half' (expected emulated, one-gpu or all)"; status=2;;
          esac
          if [ "$status" != 0 ] && [ "${ROUND_STOP_ON_FAILURE:-0}" = 1 ]; then
            echo "stopping: the $half half failed (ROUND_STOP_ON_FAILURE=1)"; break
          fi
        done
      fi
    fi
    stamp "done"
    kill "$sampler" 2>/dev/null
    touch "$ROUND/done"
    ;;
  wait)
    limit=${2:-500}
    for ((i = 0; i < limit; i += 5)); do [ -e "$ROUND/done" ] && break; sleep 5; done
    [ -e "$ROUND/done" ] && echo "round finished" || echo "round still running"
    OUT=${OUT:-/tmp}
    cp "$ROUND/round.log" "$OUT/round.log" 2>/dev/null
    cp "$ROUND"/pytest-*.log "$OUT/" 2>/dev/null  # a half still running (side by side) writes only there
    tar -C "$ROUND" -czf "$OUT/results.tar.gz" results 2>/dev/null
    grep -E "^(=== |FAILED|ERROR|stopping|ROUND_SUITE)|(PASSED|FAILED|ERROR) tests|[0-9]+ (passed|failed)|pytest exit" "$ROUND/round.log" \
      | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | tail -80
    ;;
  *) sed -n 2,16p "$0"; exit 2;;
esac
