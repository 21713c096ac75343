#!/usr/bin/env bash
# Launch one process per host of a multi-host JAX job (run this script on every host).
#
#   COORDINATOR=10.0.0.1:1234 NUM_HOSTS=2 HOST_ID=0 bash serve/launch_multihost.sh serve --mesh data=1,model=16
#   COORDINATOR=10.0.0.1:1234 NUM_HOSTS=2 HOST_ID=1 bash serve/launch_multihost.sh serve --mesh data=1,model=16
#
# The first argument picks the entry point (serve | generate | train); the rest is passed on.
# peagle_jax.sharding.maybe_initialize_distributed() reads these variables and calls
# jax.distributed.initialize(); every process then sees all devices of the job, and the
# mesh spans them. On SLURM clusters set PEAGLE_DISTRIBUTED=auto instead (jax auto-detects).
set -euo pipefail
: "${COORDINATOR:?set COORDINATOR=host:port of process 0}"
: "${NUM_HOSTS:?set NUM_HOSTS}"
: "${HOST_ID:?set HOST_ID (0..NUM_HOSTS-1)}"
export JAX_COORDINATOR_ADDRESS="$COORDINATOR" JAX_NUM_PROCESSES="$NUM_HOSTS" JAX_PROCESS_ID="$HOST_ID"
entry=${1:?usage: launch_multihost.sh serve|generate|train [args...]}
shift
cd "$(dirname "$0")/.."
case "$entry" in
  serve) exec .venv/bin/python -m peagle_jax.serve "$@" ;;
  generate) exec .venv/bin/python -m peagle_jax.generate "$@" ;;
  train) exec .venv/bin/python -m train.train "$@" ;;
  *) echo "unknown entry point $entry (serve | generate | train)"; exit 2 ;;
esac
