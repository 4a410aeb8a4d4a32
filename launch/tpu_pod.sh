#!/usr/bin/env bash
# Train on a Cloud TPU VM pod slice: one JAX process per TPU VM worker, joined with
# jax.distributed, the same main.py on every worker.
#
#   TPU_NAME=my-v4-32 ZONE=us-central2-b WORKDIR=gs://my-bucket/runs/math \
#     launch/tpu_pod.sh all configs/math.py --config.steps=500
#
# Actions:
#   setup  copy this checkout (git archive of HEAD) to every worker and install
#          requirements.txt with jax[tpu] instead of the CPU jax/jaxlib pins
#   run    start main.py on every worker (in parallel, logs streamed back)
#   stop   SIGTERM main.py on every worker: the trainer checkpoints and exits
#   all    setup, then run (the default)
#
# Environment:
#   TPU_NAME, ZONE   the TPU VM (required); PROJECT optional (else gcloud's default)
#   WORKDIR          run directory seen by EVERY worker (a gs:// bucket or a shared
#                    mount): checkpoints are written jointly by all processes
#   MESH             mesh.shape (data, fsdp, tensor), default "(1,-1,1)": FSDP over
#                    all chips of the slice
#   COORD_PORT       coordinator port on worker 0 (default 8476)
#   REMOTE_DIR       checkout directory on the workers (default vcpo_jax, under $HOME)
#   JAX_VERSION      default 0.10.2 (must match requirements.txt)
#   SAMPLER_CHIPS    host-local chip ids of each worker's sampler, e.g. "2,3": async mode with one
#                    sampler process per worker on those chips (docs/scale_out.md, "Async mode on
#                    several hosts"); the learner process of each worker sees the other chips
#                    (TPU_VISIBLE_CHIPS). Empty (default): no split, the config's mode.
#   CHIPS_PER_HOST   chips of one worker (default 4: v4 / v5p); used with SAMPLER_CHIPS
set -euo pipefail

usage() { sed -n '2,31p' "$0" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
ACTION=$1
shift
case "$ACTION" in setup | run | stop | all) ;; *) usage ;; esac

: "${TPU_NAME:?set TPU_NAME to the TPU VM name}"
: "${ZONE:?set ZONE to the TPU VM zone}"
COORD_PORT=${COORD_PORT:-8476}
REMOTE_DIR=${REMOTE_DIR:-vcpo_jax}
JAX_VERSION=${JAX_VERSION:-0.10.2}
MESH=${MESH:-"(1,-1,1)"}
SAMPLER_CHIPS=${SAMPLER_CHIPS:-}
CHIPS_PER_HOST=${CHIPS_PER_HOST:-4}
REPO_ROOT=$(cd "$(dirname "$0")/.." && pwd)

GC_FLAGS=(--zone "$ZONE")
if [[ -n "${PROJECT:-}" ]]; then GC_FLAGS+=(--project "$PROJECT"); fi

on_all_workers() {  # on_all_workers COMMAND: runs COMMAND on every worker at once
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GC_FLAGS[@]}" --worker=all --command="$1"
}

do_setup() {
  local archive
  archive=$(mktemp /tmp/vcpo_jax.XXXXXX.tar.gz)
  git -C "$REPO_ROOT" archive --format=tar.gz -o "$archive" HEAD  # committed code only
  gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME:vcpo_jax.tar.gz" "${GC_FLAGS[@]}" --worker=all
  rm -f "$archive"
  on_all_workers "set -euo pipefail
    rm -rf ~/$REMOTE_DIR && mkdir -p ~/$REMOTE_DIR && tar -xzf ~/vcpo_jax.tar.gz -C ~/$REMOTE_DIR
    cd ~/$REMOTE_DIR
    grep -vE '^(jax|jaxlib)==' requirements.txt > /tmp/vcpo_requirements_tpu.txt
    python3 -m pip install --quiet -r /tmp/vcpo_requirements_tpu.txt 'jax[tpu]==$JAX_VERSION'
    python3 -c 'import jax; print(jax.process_index(), jax.local_device_count(), jax.devices()[0].device_kind)'"
}

do_run() {
  [[ $# -ge 1 ]] || { echo "run needs a config, e.g. configs/math.py" >&2; exit 2; }
  : "${WORKDIR:?set WORKDIR to a path every worker sees (gs://bucket/run or a shared mount)}"
  local config=$1
  shift
  local endpoints coord nproc overrides
  # Worker 0's internal IP hosts the coordinator; one process per worker.
  endpoints=$(gcloud compute tpus tpu-vm describe "$TPU_NAME" "${GC_FLAGS[@]}" --format=json |
    python3 -c 'import json, sys; e = json.load(sys.stdin)["networkEndpoints"]; print(e[0]["ipAddress"], len(e))')
  read -r coord nproc <<< "$endpoints"
  overrides=$(printf '%q ' "$@")
  local learner_env="" split_flags=""
  if [[ -n "$SAMPLER_CHIPS" ]]; then
    # The learner keeps the chips the sampler does not take; the sampler's TPU variables are set by
    # the learner when it spawns it (vcpo_jax/rollout/multihost.py). Unverified on TPU hardware.
    local learner_chips
    learner_chips=$(python3 -c 'import sys; s = {int(x) for x in sys.argv[1].split(",")}; n = int(sys.argv[2]); bad = sorted(c for c in s if not 0 <= c < n); assert not bad, f"SAMPLER_CHIPS {bad} not in [0, {n})"; print(",".join(str(c) for c in range(n) if c not in s))' "$SAMPLER_CHIPS" "$CHIPS_PER_HOST")
    [[ -n "$learner_chips" ]] || { echo "SAMPLER_CHIPS=$SAMPLER_CHIPS leaves no chip to the learner" >&2; exit 2; }
    learner_env="TPU_VISIBLE_CHIPS=$learner_chips"
    split_flags="--config.mode=async --config.async_.sampler_devices=$SAMPLER_CHIPS"
    echo "per worker: learner chips $learner_chips, sampler chips $SAMPLER_CHIPS" >&2
  fi
  echo "coordinator $coord:$COORD_PORT, $nproc processes, mesh.shape=$MESH" >&2
  # The process id is the worker's own number, read from the VM metadata on each worker.
  # shellcheck disable=SC2016  # $(...) and $$ must expand on the worker, not here
  on_all_workers "cd ~/$REMOTE_DIR && echo \$\$ > ~/vcpo_main.pid && exec env $learner_env python3 main.py \
    --config=$(printf '%q' "$config") --workdir=$(printf '%q' "$WORKDIR") \
    --config.mesh.shape='$MESH' \
    --config.distributed.enabled=True \
    --config.distributed.coordinator_address=$coord:$COORD_PORT \
    --config.distributed.num_processes=$nproc $split_flags \
    --config.distributed.process_id=\$(curl -s -H 'Metadata-Flavor: Google' \
      http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number) \
    $overrides"
}

do_stop() {
  # shellcheck disable=SC2016  # expands on the worker
  on_all_workers 'if [[ -f ~/vcpo_main.pid ]]; then kill -TERM "$(cat ~/vcpo_main.pid)" 2>/dev/null || true; rm -f ~/vcpo_main.pid; fi'
}

case "$ACTION" in
  setup) do_setup ;;
  run) do_run "$@" ;;
  stop) do_stop ;;
  all) do_setup && do_run "$@" ;;
esac
