"""The stabilizers the field uses, as policy losses: a re-export of `vcpo_jax.rl.losses`.

The losses, their registry `POLICY_LOSSES`, `make_policy_loss` and `loss_gradient` live in
vcpo_jax/rl/losses.py (their docstrings give each formula and source), the aggregations in
vcpo_jax/rl/aggregation.py, the ESS-targeted truncation in vcpo_jax/rl/ess.py.
"""

from vcpo_jax.rl.aggregation import LOSS_AGGREGATIONS, aggregate, row_norms
from vcpo_jax.rl.ess import ess_target_truncation, tis_ess_log_weights
from vcpo_jax.rl.losses import (
  M2PO_NO_CLIP_HIGH,
  POLICY_LOSSES,
  VERL_LOG_RATIO_CLAMP,
  PolicyLoss,
  binary_kl,
  cispo,
  decoupled_ppo,
  dppo_tv,
  gspo,
  icepop,
  ipo,
  kpop,
  loglinear_prox_logp,
  loss_gradient,
  m2po_mask,
  m2po_paper,
  m2po_released,
  m2po_tau,
  make_policy_loss,
  ppo_clip,
)

__all__ = [
  "LOSS_AGGREGATIONS",
  "M2PO_NO_CLIP_HIGH",
  "POLICY_LOSSES",
  "VERL_LOG_RATIO_CLAMP",
  "PolicyLoss",
  "aggregate",
  "binary_kl",
  "cispo",
  "decoupled_ppo",
  "dppo_tv",
  "ess_target_truncation",
  "gspo",
  "icepop",
  "ipo",
  "kpop",
  "loglinear_prox_logp",
  "loss_gradient",
  "m2po_mask",
  "m2po_paper",
  "m2po_released",
  "m2po_tau",
  "make_policy_loss",
  "ppo_clip",
  "row_norms",
  "tis_ess_log_weights",
]
