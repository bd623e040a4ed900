# ROUND_COMMANDS script (tools/emulated-round.sh): the stall that the collective-free fused and MoE
# loops met at world 8 (docs/measurements.md, 2026-11-25 afternoon). Case 0 of each job, the jobs
# side by side as in the rounds that found it, with the host transport's trace (every request and
# delivery) so that a missing arrival shows where it was lost.
#
#   REPRO_JOBS      jobs to run side by side (default "fused moe")
#   REPRO_VARIANTS  space-separated NAME:ENV,ENV... run one after another, each rank's environment
#                   extended by ENV (default "baseline:"), e.g.
#                   "baseline: conn16:CUDA_DEVICE_MAX_CONNECTIONS=16 paced1:JAXGIN_MAX_QUEUED_CALLS=1
#                   fold1:JAXGIN_TEST_LOOP_FOLD=1 requeue0:JAXGIN_TRANSPORT_REQUEUE_MS=0" (fold1: a
#                   collective after every call, as before; requeue0: no stalled copy queued again)
#   REPRO_TIMEOUT   seconds per job (default 330)
#   REPRO_CASES     the cases each job runs (JAXGIN_TEST_CASES, default 0)
#   REPRO_GRAPHS=1  under XLA command buffers (tools/emulated_job.py --graphs)
#   REPRO_TRACE=0   without the transport's trace
# Writes $RESULTS/<variant>/<job>/ (tools/emulated_job.py's files, the trace gzipped) and prints
# each job's exit codes and the ranks' timed-out waits.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
common=(--world 8 --timeout "${REPRO_TIMEOUT:-330}" --env JAXGIN_TIMEOUT=60 --env JAXGIN_TEST_CASES="${REPRO_CASES:-0}")
[ "${REPRO_TRACE:-1}" = 1 ] && common+=(--env JAXGIN_TRANSPORT_TRACE=1)  # any value turns it on
[ "${REPRO_GRAPHS:-0}" = 1 ] && common+=(--graphs)
for variant in ${REPRO_VARIANTS:-baseline:}; do
  name=${variant%%:*}
  extra=()
  IFS=, read -ra items <<< "${variant#*:}"
  for item in "${items[@]}"; do [ -n "$item" ] && extra+=(--env "$item"); done
  echo "=== variant $name: ${variant#*:}"
  for job in ${REPRO_JOBS:-fused moe}; do
    python3 tools/emulated_job.py "${common[@]}" "${extra[@]}" --out "$RESULTS/$name/$job" \
      "tests/gpu/${job}_scenarios.py" check > "$RESULTS/$name-$job.summary" 2>&1 &
  done
  wait
  for job in ${REPRO_JOBS:-fused moe}; do
    echo "--- $name $job: $(tail -1 "$RESULTS/$name-$job.summary")"
    gzip -f "$RESULTS/$name/$job"/rank*.err  # the trace
    zcat "$RESULTS/$name/$job"/rank*.err.gz | grep -A1 "device fault recorded" | grep "timed out" | cut -c1-240 | head -8
    zcat "$RESULTS/$name/$job"/rank*.err.gz | grep "for its copy out of this GPU's memory" | cut -c1-240 | head -4
    echo "copies queued again: $(zcat "$RESULTS/$name/$job"/rank*.err.gz | grep -c "transport trace: rank [0-9]* requeue")"
  done
done
