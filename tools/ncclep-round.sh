#!/usr/bin/env bash
# NCCL EP next to jaxgin.moe on a lent GPU machine (issue 6). NCCL EP (PyPI's nccl-extensions) needs
# what the machine lacks: its wheels, the NCCL it pins (2.30.7; the machine has 2.28.9) and GIN (no
# RDMA NIC there: jaxgin's host transport provides it). A command takes at most 64 MiB of files, so
# this goes over several calls that must follow each other closely (an idle machine is given back).
#
# Here, once:
#   ../shared/tools/nccl-stage prepare 2.30.7
#   for k in 0 1 2 3; do NCCL_STAGE_VERSION=2.30.7 ../shared/tools/nccl-stage put $k; mv .device-stage .device-stage$k; done
#   pip download --no-deps --python-version 3.12 --only-binary=:all: -d .device-ncclep \
#     nccl-extensions nccl4py 'cuda-core~=1.0' 'cuda-pathfinder>=1.5.4,<2' 'cuda-bindings~=13.0'
# There, one call each, carrying the folder named:
#   bash tools/ncclep-round.sh chunk 0 .. 3   (.device-stageK) chunk 0 also builds jaxgin, chunk 1
#                                             times jaxgin.moe at 128 tokens on the stock NCCL, chunk 3
#                                             installs NCCL 2.30.7
#   bash tools/ncclep-round.sh run            (.device-ncclep) NCCL EP's benchmark, then jaxgin.moe's
#                                             again on the same NCCL
# Logs and JSON go to $OUT.
source "$(dirname "$0")/round-common.sh"
jaxgin_moe() {  # jaxgin.moe's benchmark at 128 tokens: NAME [moe.py options]
  install_jaxgin || return 1
  local name=$1; shift
  TAIL=24 step 240 "moe_bench_$name" python3 benchmarks/moe.py --tokens 128 --out "$OUT/$name" "$@"
}
case "${1:-}" in
  chunk)
    bash ".device-stage$2/recv.sh" || exit 1
    case "$2" in
      0)
        install_jaxgin || status=1
        step 120 transport python3 -m jaxgin.transport
        ;;
      1) jaxgin_moe nccl-stock || status=1 ;;
    esac
    ;;
  run)
    python3 -m pip install -q --no-deps .device-ncclep/nccl_extensions-*.whl .device-ncclep/nccl4py-*.whl \
      .device-ncclep/cuda_core-*.whl .device-ncclep/cuda_pathfinder-*.whl > "$OUT/wheels.log" 2>&1 || { tail "$OUT/wheels.log"; exit 1; }
    if ! python3 -c "import cuda.core" 2>/dev/null; then  # cuda-core 1.x wants a newer cuda-bindings than some machines have
      python3 -m pip install -q --no-deps .device-ncclep/cuda_bindings-*.whl >> "$OUT/wheels.log" 2>&1
    fi
    python3 -m pip list 2>/dev/null | grep -Ei '^(torch|nccl|nvidia-nccl|cuda-(core|bindings|pathfinder)) '
    plugin=$(python3 -m jaxgin.transport | sed 's/^export NCCL_RMA_PLUGIN=//') || { echo "no host transport"; exit 1; }
    export NCCL_EP_JIT_NVCC=${NCCL_EP_JIT_NVCC:-$(python3 -c "from jaxgin.build import find_nvcc; print(find_nvcc())")}
    echo "NCCL_RMA_PLUGIN=$plugin; nvcc: $NCCL_EP_JIT_NVCC ($("$NCCL_EP_JIT_NVCC" --version | tail -2 | head -1))"
    TAIL=60 step 330 nccl_ep env NCCL_RMA_PLUGIN="$plugin" NCCL_EP_TIMEOUT_MS=20000 python3 benchmarks/nccl_ep.py \
      --out "$OUT" --timeout 320
    if [ $status -ne 0 ]; then  # what NCCL said while setting up, for the closing note
      grep -iE "gin|rma|plugin|error|nccl ep|\[LL\]" "$OUT/nccl_ep.log" | grep -v "^ *\"" | head -40
    fi
    # jaxgin only: XLA's ragged_all_to_all fails to allocate with NCCL 2.30.7 (measured; the
    # chunk-1 run has it on the stock NCCL)
    jaxgin_moe nccl-2.30.7 --only jaxgin_dispatch,jaxgin_combine,jaxgin_pair || status=1
    ;;
  *) sed -n 2,18p "$0"; exit 2 ;;
esac
exit $status
