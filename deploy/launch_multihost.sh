#!/usr/bin/env bash
# Launch one process per host of a multi-host JAX job (run this script on every host).
#
#   COORDINATOR=10.0.0.1:1234 NUM_HOSTS=2 HOST_ID=0 bash deploy/launch_multihost.sh generate --mesh data=1,model=16 ...
#   COORDINATOR=10.0.0.1:1234 NUM_HOSTS=2 HOST_ID=1 bash deploy/launch_multihost.sh generate --mesh data=1,model=16 ...
#
# The first argument picks the entry point (generate | train); the rest is passed on. The
# server is single-host: multi-host serving would need every host to run the engine loop in
# step with host 0's admissions, which is not built.
# peagle_jax.sharding.maybe_initialize_distributed() reads these variables and calls
# jax.distributed.initialize(); every process then sees all devices of the job, and the
# mesh spans them. On SLURM clusters set PEAGLE_DISTRIBUTED=auto instead (jax auto-detects).
set -euo pipefail
: "${COORDINATOR:?set COORDINATOR=host:port of process 0}"
: "${NUM_HOSTS:?set NUM_HOSTS}"
: "${HOST_ID:?set HOST_ID (0..NUM_HOSTS-1)}"
export JAX_COORDINATOR_ADDRESS="$COORDINATOR" JAX_NUM_PROCESSES="$NUM_HOSTS" JAX_PROCESS_ID="$HOST_ID"
entry=${1:?usage: launch_multihost.sh generate|train [args...]}
shift
cd "$(dirname "$0")/.."
case "$entry" in
  serve) echo "multi-host serving is not supported: run python -m peagle_jax.serve on one host (--mesh over its devices)" >&2; exit 2 ;;
  generate) exec .venv/bin/python -m peagle_jax.generate "$@" ;;
  train) exec .venv/bin/python -m peagle_jax.train.train "$@" ;;
  *) echo "unknown entry point $entry (generate | train)"; exit 2 ;;
esac
