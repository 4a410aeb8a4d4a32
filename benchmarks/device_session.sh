#!/usr/bin/env bash
# The prepared accelerator session (issue 39), one device call of at most 600 s, each step a file in $OUT:
#   device_check.json  `benchmarks.device_check` as it is (sampler, learner MFU, init; hard limit 300 s)
#   first_command.txt  README's first command on the one GPU: its allocation errors counted (limit 100 s)
#   sampler_cmdbuf.json, sampler_dsfusion.json, sampler_unrolled.json: the sampler part alone under the
#                      candidate fixes for its per-step overhead (command buffers over the decode loop,
#                      XLA's dynamic-slice fusion for the scanned layers, the unrolled decode; 80 s each)
#   gpu.txt, log.txt (every step's output)
# A step whose limit no longer fits in the 570 s total is skipped, with a line saying so.
#
#   OUT=/tmp/session bash benchmarks/device_session.sh      # DRY_RUN=1: print the steps, run nothing
#
# The device image lacks ml-collections, tensorboardX and math-verify (main.py needs them): download their
# wheels here into .whl/ (device/README.md), carry .whl, and this script installs them first.
set -u
OUT=${OUT:-device_session}
TOTAL_S=${TOTAL_S:-570}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
run() {  # run NAME LIMIT_S COMMAND...: the command under `timeout`, if its limit still fits
  local name=$1 limit=$2
  shift 2
  if ((SECONDS + limit > TOTAL_S)); then
    echo "$name: skipped (${SECONDS} s spent, its ${limit} s limit would pass ${TOTAL_S} s)"
    return
  fi
  if [[ -n ${DRY_RUN:-} ]]; then
    echo "$name: $*"
    return
  fi
  timeout "$limit" "$@" >>"$OUT/log.txt" 2>&1
  echo "$name: rc $? at ${SECONDS} s"
}
check() {  # check NAME LIMIT_S XLA_FLAGS [device_check args]: one device_check into $OUT/NAME.json
  local name=$1 limit=$2 flags="${XLA_FLAGS:-} $3"
  shift 3
  flags="${flags#"${flags%%[! ]*}"}"  # no leading blank: XLA reads a value not starting with -- as a file name
  run "$name" "$((limit + 15))" env XLA_FLAGS="$flags" python -m benchmarks.device_check \
    --out="$OUT/$name.json" --limit_s="$limit" --budget_s="$((limit * 4 / 5))" "$@"
}
if [[ -z ${DRY_RUN:-} ]]; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.txt" 2>&1
fi
check device_check 285 ""
run first_command 100 bash -c "python main.py --config=configs/countdown.py --workdir=/tmp/vcpo_first \
  --config.steps=100 >$OUT/first_command.txt 2>&1; echo rc \$? >>$OUT/first_command.txt; \
  echo allocation_errors \$(grep -c CUDA_ERROR_OUT_OF_MEMORY $OUT/first_command.txt) >>$OUT/first_command.txt"
CMDBUF="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
check sampler_cmdbuf 65 "$CMDBUF --xla_gpu_graph_min_graph_size=1" --parts=sampler
check sampler_dsfusion 65 "--xla_gpu_enable_dynamic_slice_fusion=true" --parts=sampler
check sampler_unrolled 65 "" --parts=sampler --decode_layers=unrolled
echo "done in ${SECONDS} s: $(ls "$OUT" | tr '\n' ' ')"
