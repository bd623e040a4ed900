#!/usr/bin/env bash
# One lease of a one-GPU machine, in the background (a device call's tree goes away when the call
# returns, and a round outlives a call):
#   1. the Triton matmul variants against cuBLAS (benchmarks/triton_matmul.py) on the image's JAX
#      and Triton;
#   2. once NCCL >= 2.30 is installed (nccl-stage), the GPU round on this one GPU, emulated worlds
#      2 and 4 (tools/gpu_round.py run);
#   3. once `.../new-versions` exists (the wheel-stage set installed: the newest JAX and Triton),
#      the benchmark and the round again on those versions.
#
#   bash tools/one-gpu-session.sh start      # copies the tree, starts the phases, returns
#   bash tools/one-gpu-session.sh wait SECS [MARKER]  # up to SECS, or until $S/out/MARKER exists;
#                                                     # copies results to $OUT
# Knobs (environment of `start`): ROUND_OLD=0 leaves out step 2; ROUND_NEW_K, a pytest -k expression,
# narrows step 3's round; MATMUL_VARIANTS, benchmarks/triton_matmul.py --variants.
set -uo pipefail
S=${SESSION_DIR:-/root/jaxgin-session}
case "${1:-}" in
  start)
    rm -rf "$S"; mkdir -p "$S/out"
    cp -a "$(cd "$(dirname "$0")/.." && pwd)" "$S/repo"
    rm -rf "$S/repo/.device-stage"
    echo "${ROUND_COMMIT:-$(cd "$S/repo" && git rev-parse --short HEAD 2>/dev/null || echo unknown)}" > "$S/out/commit"
    setsid nohup bash "$S/repo/tools/one-gpu-session.sh" phases > "$S/out/session.log" 2>&1 < /dev/null &
    echo "session started in $S"
    ;;
  phases)
    export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 JAXGIN_CACHE_DIR=/tmp/jaxgin-cache
    cd "$S/repo"
    versions() { python3 -c "import jax, triton; from importlib.metadata import version as v; print('jax', jax.__version__, 'triton', triton.__version__, 'nccl', v('nvidia-nccl-cu13'))"; }
    echo "phase 1: $(versions)"
    python3 -m pip install -q --no-build-isolation --no-deps -e . > "$S/out/install-old.log" 2>&1
    variants=${MATMUL_VARIANTS:-pointer,tma,persistent,persistent_ws}
    timeout 420 python3 benchmarks/triton_matmul.py --variants "$variants" --out "$S/out/old" > "$S/out/matmul-old.log" 2>&1
    echo "matmul old: exit $?"; touch "$S/out/phase1-done"
    for _ in $(seq 120); do
      python3 -c "from importlib.metadata import version as v; import sys; sys.exit(tuple(map(int, v('nvidia-nccl-cu13').split('.')[:2])) < (2, 30))" && break
      sleep 5
    done
    echo "phase 2: $(versions)"
    [ "${ROUND_OLD:-1}" = 1 ] && CUDA_VISIBLE_DEVICES=0 JAXGIN_TEST_EMULATED_WORLDS=2,4 ROUND_COMMIT=$(cat "$S/out/commit") \
      timeout 1000 python3 tools/gpu_round.py run --deadline 600 --grace 150 \
      --durations benchmarks/results/4xh200/gpu-round.json --dir "$S/round-old" > "$S/out/round-old.log" 2>&1
    echo "round old: exit $?"; cp "$S/round-old/results/gpu-round.json" "$S/out/gpu-round-1gpu-old.json" 2>/dev/null
    touch "$S/out/phase2-done"
    for _ in $(seq 240); do [ -e "$S/new-versions" ] && break; sleep 5; done
    [ -e "$S/new-versions" ] || { echo "no new versions staged"; exit 0; }
    python3 -m pip install -q --no-build-isolation --no-deps -e . > "$S/out/install-new.log" 2>&1
    echo "phase 3: $(versions)"
    timeout 420 python3 benchmarks/triton_matmul.py --variants "$variants" --out "$S/out/new" > "$S/out/matmul-new.log" 2>&1
    echo "matmul new: exit $?"
    timeout 120 python3 examples/quickstart.py > "$S/out/quickstart-new.log" 2>&1
    echo "quickstart new: exit $?"
    CUDA_VISIBLE_DEVICES=0 JAXGIN_TEST_EMULATED_WORLDS=2 ROUND_COMMIT=$(cat "$S/out/commit") \
      timeout 900 python3 tools/gpu_round.py run --deadline 420 --grace 120 ${ROUND_NEW_K:+-k "$ROUND_NEW_K"} \
      --durations benchmarks/results/4xh200/gpu-round.json --dir "$S/round-new" > "$S/out/round-new.log" 2>&1
    echo "round new: exit $?"; cp "$S/round-new/results/gpu-round.json" "$S/out/gpu-round-1gpu-new.json" 2>/dev/null
    touch "$S/out/phase3-done"
    ;;
  wait)
    marker=${3:-}
    until=$(( $(date +%s) + ${2:-300} ))
    while [ "$(date +%s)" -lt "$until" ]; do
      [ -n "$marker" ] && [ -e "$S/out/$marker" ] && break
      sleep 5
    done
    mkdir -p "$OUT"; cp -r "$S/out/." "$OUT/" 2>/dev/null
    for r in round-old round-new; do
      [ -d "$S/$r/logs" ] && tar -czf "$OUT/$r-logs.tar.gz" -C "$S/$r" logs results 2>/dev/null
    done
    tail -5 "$S/out/session.log"; ls "$S/out"
    for r in round-old round-new; do [ -f "$S/out/$r.log" ] && tail -4 "$S/out/$r.log"; done
    ;;
  *) sed -n 2,12p "$0"; exit 2;;
esac
