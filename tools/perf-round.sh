#!/usr/bin/env bash
# A latency and fused-op round on a lent GPU machine (stock NCCL, LSA): build, then the GPU tests of
# what the round changes, then the benchmarks, each step bounded. Usage:
#   bash tools/perf-round.sh tests      # ops (lines and ring), fused and stress GPU tests
#   bash tools/perf-round.sh bench      # small-message latency and the fused benchmark
#   bash tools/perf-round.sh reliability  # ops and reliability GPU tests (fault, memory model, stress), latency
#   bash tools/perf-round.sh moe        # MoE GPU tests, the MoE example, the MoE benchmark and profile
#   bash tools/perf-round.sh latency    # ops tests, memory-model and dead-peer tests, small-message latency
#   bash tools/perf-round.sh fused [PYTEST_K]  # fused GPU tests (those matching PYTEST_K), the issue's shapes
#   bash tools/perf-round.sh one-gpu    # what one GPU can check: fault cleanup test, MoE dispatch's
#                                       # HBM side (every entry local), matmul chunking
#   bash tools/perf-round.sh matmul     # the fault cleanup test, Triton matmul variants against cuBLAS
#   bash tools/perf-round.sh single     # on a machine with one GPU: every GPU test that runs there, the examples
# Logs and JSON go to $OUT.
source "$(dirname "$0")/round-common.sh"
install_jaxgin || exit 1
case "${1:-tests}" in
  tests)
    step 330 ops python3 -m pytest -x -q -rA tests/gpu/test_ops_gpu.py
    step 200 fused python3 -m pytest -x -q -rA tests/gpu/test_fused_gpu.py
    step 120 stress python3 -m pytest -x -q -rA tests/gpu/test_reliability_gpu.py -k stress
    ;;
  reliability)
    step 200 ops python3 -m pytest -x -q -rA tests/gpu/test_ops_gpu.py
    step 260 reliability python3 -m pytest -q -rA tests/gpu/test_reliability_gpu.py
    TAIL=40 step 120 latency python3 benchmarks/collectives.py --ops ppermute,put_wait,put_wait_from,self_copy \
      --max-bytes 64KiB --out "$OUT" --name latency
    ;;
  moe)
    step 300 moe python3 -m pytest -x -q -rA tests/gpu/test_moe_gpu.py
    TAIL=12 step 150 moe_example python3 examples/moe_layer.py
    TAIL=30 step 240 moe_bench python3 benchmarks/moe.py --out "$OUT"
    TAIL=40 step 150 moe_profile python3 tools/profile_moe.py --tokens 128
    ;;
  latency)
    step 200 ops python3 -m pytest -x -q -rA tests/gpu/test_ops_gpu.py
    step 150 reliability python3 -m pytest -q -rA tests/gpu/test_reliability_gpu.py -k "payloads or dead_peer"
    TAIL=40 step 150 latency python3 benchmarks/collectives.py --ops ppermute,put_wait,put_wait_from,self_copy,all_to_all \
      --max-bytes 64KiB --out "$OUT" --name latency
    ;;
  one-gpu)
    step 200 fault python3 -m pytest -q -rA tests/gpu/test_fault_cleanup_gpu.py
    TAIL=40 step 300 moe_one python3 benchmarks/moe.py --tokens 4096 --experts 128 --out "$OUT/moe_one" \
      --only jaxgin_dispatch,jaxgin_combine,xla_gather_same_rows,routing_only ${MOE_BLOCKS:+--blocks "$MOE_BLOCKS"}
    TAIL=20 step 200 chunking python3 benchmarks/fused.py --chunking-only --out "$OUT"
    TAIL=40 step 120 moe_profile python3 tools/profile_moe.py --tokens 4096 --experts 128
    ;;
  matmul)
    step 200 fault python3 -m pytest -q -rA tests/gpu/test_fault_cleanup_gpu.py
    TAIL=12 step 400 triton_matmul python3 tools/tune_triton_matmul.py --out "$OUT"
    ;;
  single)
    TAIL=30 step 240 ops_runtime python3 -m pytest -q -rA tests/gpu/test_ops_gpu.py tests/gpu/test_runtime_gpu.py \
      tests/gpu/test_tritongin_gpu.py tests/gpu/test_fault_cleanup_gpu.py
    TAIL=20 step 250 fused_moe python3 -m pytest -q -rA tests/gpu/test_fused_gpu.py tests/gpu/test_moe_gpu.py
    step 60 ring_put python3 examples/triton_ring_put.py
    step 60 lsa_bandwidth python3 examples/triton_lsa_bandwidth.py
    ;;
  fused)
    step 300 fused python3 -m pytest -x -q -rA tests/gpu/test_fused_gpu.py ${2:+-k "$2"}
    TAIL=20 step 240 fused_bench python3 benchmarks/fused.py --shapes-only --out "$OUT"
    ;;
  bench)
    # Not in subshells, so a failed benchmark fails the round (scripts find timing.py beside them).
    TAIL=40 step 200 latency python3 benchmarks/collectives.py --ops ppermute,all_to_all,put_wait,put_wait_from,self_copy \
      --max-bytes 64KiB --out "$OUT" --name latency
    TAIL=30 step 330 fused python3 benchmarks/fused.py --out "$OUT"
    ;;
esac
exit $status
