#!/usr/bin/env bash
# Starts a jaxgin example on two hosts (or more), one process per host driving every GPU of its
# host, joined through jax.distributed: process i runs on HOST_i, process 0's HOST_0 is the
# coordinator. Each host gets its command over ssh, run from this directory (the checkout must
# sit at the same path on every host, with jaxgin installed: pip install -e ".[cuda]"); the
# NCCL_* and JAXGIN_* variables set here travel with it.
#
#   bash examples/multihost/two_hosts.sh HOST_0 HOST_1 [HOST_2 ...] [-- SCRIPT [ARGS]]
#
# SCRIPT defaults to examples/quickstart.py; examples/moe_layer.py runs the same way, and
# "-m jaxgin.pairtest" checks every pair of GPUs. JAXGIN_PORT picks the coordinator's port
# (default 62123); JAXGIN_DRY_RUN=1 prints each host's command ("HOST: command") instead of
# running it. Without ssh, run each printed command on its host by hand.
#
# Needs: pip install -e ".[cuda]" on every host; check each host first with python -m jaxgin.doctor.
set -euo pipefail

hosts=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do hosts+=("$1"); shift; done
[ $# -gt 0 ] && shift
program=("$@")
[ ${#program[@]} -gt 0 ] || program=(examples/quickstart.py)
if [ ${#hosts[@]} -lt 2 ]; then
  echo "two_hosts.sh: name at least two hosts, e.g. bash examples/multihost/two_hosts.sh node01 node02" >&2
  exit 2
fi
port=${JAXGIN_PORT:-62123}
# The settings of this shell that jaxgin and NCCL read, passed on to every host.
settings=()
while IFS= read -r name; do settings+=("$name=${!name}"); done < <(compgen -e | grep -E '^(NCCL|JAXGIN)_' | grep -vx 'JAXGIN_DRY_RUN\|JAXGIN_PORT' || true)

status=0
pids=()
for i in "${!hosts[@]}"; do
  command="cd $(printf %q "$PWD") &&"
  [ ${#settings[@]} -gt 0 ] && command+=" env$(printf ' %q' "${settings[@]}")"
  command+=" python3 -m jaxgin.launch --coordinator ${hosts[0]}:$port --num-processes ${#hosts[@]} --process-id $i"
  command+="$(printf ' %q' "${program[@]}")"
  if [ "${JAXGIN_DRY_RUN:-0}" = 1 ]; then
    echo "${hosts[$i]}: $command"
  else
    ssh "${hosts[$i]}" "$command" &
    pids+=($!)
  fi
done
for pid in ${pids[@]+"${pids[@]}"}; do wait "$pid" || status=$?; done
exit $status
