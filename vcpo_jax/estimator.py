"""The coefficients of VCPO and of the methods it is compared against: pure, jittable, no gradients.

The notebook face of `vcpo_jax.rl`: it re-exports the math of rl.ess (log-ratios, ESS, the lr rule, the
ESS-targeted truncation), rl.weights, rl.advantages (and OPOB), rl.aggregation, rl.surrogate
(pg_coefficients of a Method), rl.method (Method, PRESETS) and rl.presets, so `from vcpo_jax import estimator; estimator.X` reaches all of it.
Every coefficient function takes the method as one value (`Method`, its presets as Python values).
It turns per-token log-probs, rewards and (for OPOB) per-example squared score norms into stop-gradient
numbers; it never differentiates anything (the norms come from `vcpo_jax.grad_norms`, the gradient of the
surrogate from `vcpo_jax.learner.policy_gradient(path)`).

Dimension legend: N trajectories, P prompts, G group size, T tokens.

Notation (VCPO, arXiv 2602.17616):
  l_n   = sum_t mask_nt * (sg[logp_nt] - behavior_logp_nt)   sequence log-ratio
  w_n   = exp(l_n)                                           sequence IS ratio
  ESS   = (sum w)^2 / sum w^2 ;  rho = ESS / N               in (0, 1]
  s_n   = grad_params sum_t mask_nt * logp_nt                token-SUM score
  b*    = sum_j w_j^2 ||s_j||^2 R_j / sum_j w_j^2 ||s_j||^2  OPOB baseline

Stop-gradient conventions: every ratio, weight, baseline, advantage and coefficient is wrapped in
`jax.lax.stop_gradient`; the only differentiable quantity in the surrogate is `logp_nt`:

  loss(params) = - sum_n coef_n * sum_t tokw_nt * logp_nt(params)

with `coef_n` from `pg_coefficients` and `tokw_nt` from `pg_token_weights` (= mask_nt for every
sequence-level weight variant).

Departures from the paper / reference implementation (each an option; the reasons are in
docs/design_notes.md "estimator.py"):
  * ESS from log-weights in log space; the ESS lr scale capped at 1, a non-finite ESS ratio brakes fully.
  * OPOB can use the applied weights (`opob_weights="applied"`) and a leave-one-out set; `reference_mode`
    reproduces the reference's two inconsistencies so they can be compared.
  * Each importance-weight variant has one definition, each advantage estimator a name
    (`WEIGHT_VARIANTS`, `ADVANTAGE_ESTIMATORS`).
  * Rows with an empty loss mask are padding; rows with a non-finite l_n are masked out the same way and
    counted in `nonfinite_rows`.
  * OPOB's baseline weights use the UNCLAMPED ratio (2 l_n + log ||s_n||^2 in log space); the
    log_ratio_clamp only enters the applied weights.
  * GRPO's group std is a per-preset choice (`Advantage.std`: sample or population, as the reference).
"""

from vcpo_jax.rl.advantages import (
  ADVANTAGE_ESTIMATORS,
  STD_KINDS,
  AdvantageEstimator,
  advantages,
  baseline_and_scale,
  opob_baseline,
)
from vcpo_jax.rl.aggregation import LOSS_AGGREGATIONS, LossAggregation
from vcpo_jax.rl.ess import (
  DEFAULT_LOG_RATIO_CLAMP,
  ESS_LR_RULES,
  ess,
  ess_lr_scale,
  ess_ratio,
  ess_target_truncation,
  log_mean_weight,
  rho_on_statistics,
  sequence_log_ratio,
  sg,
  tis_ess_log_weights,
  token_log_ratio,
)
from vcpo_jax.rl.method import Method
from vcpo_jax.rl.presets import PRESET_DOCS, PRESETS, method_from_preset
from vcpo_jax.rl.surrogate import (
  MASK_NORMALIZERS,
  OPOB_SCOPES,
  OPOB_WEIGHTS,
  batch_wide_coefficients,
  loss_divisor,
  needs_sq_norms,
  pg_coefficients,
  pg_metrics,
  pg_token_weights,
)

pg_config_from_preset = method_from_preset  # the earlier name of method_from_preset (notebooks use it)
from vcpo_jax.rl.weights import WEIGHT_VARIANTS, WeightVariant, importance_weights

__all__ = [
  "ADVANTAGE_ESTIMATORS",
  "DEFAULT_LOG_RATIO_CLAMP",
  "ESS_LR_RULES",
  "LOSS_AGGREGATIONS",
  "MASK_NORMALIZERS",
  "OPOB_SCOPES",
  "OPOB_WEIGHTS",
  "PRESETS",
  "PRESET_DOCS",
  "STD_KINDS",
  "WEIGHT_VARIANTS",
  "AdvantageEstimator",
  "LossAggregation",
  "Method",
  "WeightVariant",
  "advantages",
  "baseline_and_scale",
  "batch_wide_coefficients",
  "ess",
  "ess_lr_scale",
  "ess_ratio",
  "ess_target_truncation",
  "importance_weights",
  "log_mean_weight",
  "loss_divisor",
  "method_from_preset",
  "needs_sq_norms",
  "opob_baseline",
  "pg_coefficients",
  "pg_config_from_preset",
  "pg_metrics",
  "pg_token_weights",
  "rho_on_statistics",
  "sequence_log_ratio",
  "sg",
  "tis_ess_log_weights",
  "token_log_ratio",
]
