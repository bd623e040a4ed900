# ROUND_COMMANDS script (tools/emulated-round.sh): the fused and MoE loops' stall at world 8, both
# jobs side by side as in the round that found it, one case each, with the host transport's trace
# (every request and delivery) so that a missing arrival shows where it was lost. REPRO_ENV (space-
# separated NAME=VALUE) adds to every rank's environment, e.g. CUDA_DEVICE_MAX_CONNECTIONS=32.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
common=(--world 8 --timeout ${REPRO_TIMEOUT:-330} --env JAXGIN_TRANSPORT_TRACE=1 --env JAXGIN_TIMEOUT=60 --env JAXGIN_TEST_CASES=0)
for item in ${REPRO_ENV:-}; do common+=(--env "$item"); done
python3 tools/emulated_job.py "${common[@]}" --out "$RESULTS/moe" tests/gpu/moe_scenarios.py check &
python3 tools/emulated_job.py "${common[@]}" --out "$RESULTS/fused" tests/gpu/fused_scenarios.py check &
wait
for job in moe fused; do
  gzip -f "$RESULTS/$job"/rank*.err  # the trace
  grep -h -A1 "device fault recorded" <(zcat "$RESULTS/$job"/rank*.err.gz) | grep "timed out" | cut -c1-260 | head -8
done
