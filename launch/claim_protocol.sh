#!/usr/bin/env bash
# The claim protocol's three studies (docs/results/claim_protocol.md) at nice 19, from a git worktree at the
# pinned commit (launch/claim_protocol.commit), so every run of every table comes from one commit whatever the
# checkout has moved on to. Resumable at run granularity: finished runs are read back from the ledgers, which
# live in THIS checkout's docs/results/stability_ledger/claim_protocol{,_horizon} (commit them as they land).
#
#   bash launch/claim_protocol.sh                    # attribution, then the horizon's fixed arms, then study 3
#   bash launch/claim_protocol.sh attribution        # one stage: attribution | horizon | protocol
#   HORIZON_ARM=vcpo_no_esslr bash launch/claim_protocol.sh horizon   # with the attribution's best arm (the rule)
#   WT=/tmp/elsewhere bash launch/claim_protocol.sh  # the worktree's path (default /tmp/vcpo_claim_protocol)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PIN=${PIN:-$(tr -d '[:space:]' < "$ROOT/launch/claim_protocol.commit")}
WT=${WT:-/tmp/vcpo_claim_protocol}
LEDGER=$ROOT/docs/results/stability_ledger/claim_protocol
STAGE=${1:-all}
case "$STAGE" in attribution | horizon | protocol | all) ;; *)
  echo "launch/claim_protocol.sh: stage '$STAGE' unknown; use attribution, horizon, protocol or all" >&2
  exit 2
  ;;
esac
if [ ! -d "$WT" ]; then
  git -C "$ROOT" worktree prune
  git -C "$ROOT" worktree add --detach "$WT" "$PIN" >/dev/null
fi
if [ "$(git -C "$WT" rev-parse HEAD)" != "$(git -C "$ROOT" rev-parse "$PIN^{commit}")" ]; then
  echo "launch/claim_protocol.sh: $WT is not at the pinned commit $PIN; remove it or set WT" >&2
  exit 2
fi
cd "$WT"
study() { # $1: the study's --config (it must come before any --config.FIELD override)
  local config=$1
  shift
  nice -n 19 python -m vcpo_jax.experiments.stability "$config" --config.workers=1 "$@"
}
if [ "$STAGE" = attribution ] || [ "$STAGE" = all ]; then
  study --config=configs/stability.py:protocol_attribution --out=runs/claim_attribution \
    --config.trainer.ledger="$LEDGER"
fi
if [ "$STAGE" = horizon ] || [ "$STAGE" = all ]; then
  arms="('none','vcpo','seq_tis_c4')"
  if [ -n "${HORIZON_ARM:-}" ]; then arms="('none','vcpo','seq_tis_c4','$HORIZON_ARM')"; fi
  study --config=configs/stability.py:protocol_horizon --out=runs/claim_horizon \
    --config.trainer.ledger="${LEDGER}_horizon" --config.methods="$arms"
fi
if [ "$STAGE" = protocol ] || [ "$STAGE" = all ]; then
  study --config=configs/stability.py:protocol --out=runs/claim_protocol --config.trainer.ledger="$LEDGER"
fi
