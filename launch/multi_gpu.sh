#!/usr/bin/env bash
# Train on one multi-GPU host, the sampler and the learner on disjoint GPUs.
#
#   launch/multi_gpu.sh configs/gsm8k.py /tmp/runs/gsm8k --config.lag.k=4
#
# In async mode (the default here) main.py runs the learner in this process and
# spawns the sampler process; the learner sees only LEARNER_GPUS (this process's
# CUDA_VISIBLE_DEVICES) and the sampler only SAMPLER_GPUS (config
# async_.sampler_devices, written to the sampler's CUDA_VISIBLE_DEVICES before it
# imports JAX). Both are physical GPU indices as nvidia-smi lists them.
# With MODE=sync or MODE=lag there is one process: all listed GPUs go to it and
# SAMPLER_GPUS is ignored.
#
# Environment:
#   LEARNER_GPUS   default: all GPUs but the last;   e.g. 0,1,2,3,4,5
#   SAMPLER_GPUS   default: the last GPU;            e.g. 6,7
#   MODE           async (default) | sync | lag
#   MESH           learner mesh.shape, default "(1,-1,1)" (FSDP over the learner GPUs)
# Install first: pip install -r requirements.txt "jax[cuda12]==0.10.2" (or cuda13,
# matching the driver).
set -euo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '2,21p' "$0" >&2
  exit 2
fi
CONFIG=$1
WORKDIR=$2
shift 2
MODE=${MODE:-async}
MESH=${MESH:-"(1,-1,1)"}

num_gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
if [[ "$num_gpus" -lt 1 ]]; then
  echo "nvidia-smi lists no GPU" >&2
  exit 1
fi
all_but_last=$(seq -s, 0 $((num_gpus - 2)))
LEARNER_GPUS=${LEARNER_GPUS:-${all_but_last:-0}}
SAMPLER_GPUS=${SAMPLER_GPUS:-$((num_gpus - 1))}

args=(--config="$CONFIG" --workdir="$WORKDIR" --config.mode="$MODE" --config.mesh.shape="$MESH")
if [[ "$MODE" == async ]]; then
  IFS=, read -r -a learner <<< "$LEARNER_GPUS"
  IFS=, read -r -a sampler <<< "$SAMPLER_GPUS"
  for g in "${learner[@]}"; do
    for s in "${sampler[@]}"; do
      if [[ "$g" == "$s" ]]; then
        echo "GPU $g is in both LEARNER_GPUS=$LEARNER_GPUS and SAMPLER_GPUS=$SAMPLER_GPUS; they must be disjoint (on a single GPU use MODE=sync or MODE=lag)" >&2
        exit 2
      fi
    done
  done
  args+=(--config.async_.sampler_devices="$SAMPLER_GPUS")
  echo "learner GPUs $LEARNER_GPUS, sampler GPUs $SAMPLER_GPUS" >&2
else
  LEARNER_GPUS=$(seq -s, 0 $((num_gpus - 1)))
  echo "$MODE mode: one process on GPUs $LEARNER_GPUS" >&2
fi

# Each process preallocates a share of its own GPUs only; the two never share a GPU.
export CUDA_VISIBLE_DEVICES=$LEARNER_GPUS
exec python main.py "${args[@]}" "$@"
