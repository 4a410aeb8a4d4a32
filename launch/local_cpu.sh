#!/usr/bin/env bash
# Train on this machine's CPU: one process (the default), or NPROC local processes
# joined with jax.distributed and gloo collectives, a rehearsal of the multi-host
# (TPU pod) code path on a laptop.
#
#   launch/local_cpu.sh configs/countdown.py /tmp/vcpo_countdown
#   NPROC=2 DEVICES_PER_PROC=2 launch/local_cpu.sh configs/countdown.py:smoke /tmp/smoke \
#     --config.mesh.shape='(2,2,1)'
#
# Environment:
#   NPROC              processes (default 1)
#   DEVICES_PER_PROC   fake CPU devices per process (XLA_FLAGS), default 1
#   COORD_PORT         coordinator port for NPROC > 1 (default 12355)
set -euo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '2,14p' "$0" >&2
  exit 2
fi
CONFIG=$1
WORKDIR=$2
shift 2
NPROC=${NPROC:-1}
DEVICES_PER_PROC=${DEVICES_PER_PROC:-1}
COORD_PORT=${COORD_PORT:-12355}
cd "$(dirname "$0")/.."

export JAX_PLATFORMS=cpu
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$DEVICES_PER_PROC"

if [[ "$NPROC" -eq 1 ]]; then
  exec python main.py --config="$CONFIG" --workdir="$WORKDIR" "$@"
fi

pids=()
# shellcheck disable=SC2317  # invoked by the trap
stop_all() {  # forward SIGINT/SIGTERM to our own children only, by pid
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
}
trap stop_all INT TERM
for ((i = 0; i < NPROC; i++)); do
  python main.py --config="$CONFIG" --workdir="$WORKDIR" \
    --config.distributed.enabled=True \
    --config.distributed.coordinator_address="127.0.0.1:$COORD_PORT" \
    --config.distributed.num_processes="$NPROC" \
    --config.distributed.process_id="$i" "$@" &
  pids+=("$!")
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=$?
done
wait  # children still running after a signal interrupted the loop above
exit "$status"
