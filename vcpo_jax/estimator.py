"""The coefficients of VCPO and of the methods it is compared against: pure, jittable, no gradients.

This module turns per-token log-probs, rewards and (for OPOB) per-example squared
score norms into stop-gradient numbers: ratios, weights, ESS, advantages, baselines
and the per-example coefficients coef_n. It never differentiates anything (no
jax.grad / vjp): the norms come from `vcpo_jax.grad_norms`, the gradient of the
surrogate from `vcpo_jax.learner.policy_gradient(path)`.

Dimension legend: N trajectories, P prompts, G group size, T tokens.

Notation (VCPO, arXiv 2602.17616):
  l_n   = sum_t mask_nt * (sg[logp_nt] - behavior_logp_nt)   sequence log-ratio
  w_n   = exp(l_n)                                           sequence IS ratio
  ESS   = (sum w)^2 / sum w^2 ;  rho = ESS / N               in (0, 1]
  s_n   = grad_params sum_t mask_nt * logp_nt                token-SUM score
  b*    = sum_j w_j^2 ||s_j||^2 R_j / sum_j w_j^2 ||s_j||^2  OPOB baseline

Stop-gradient conventions (review #3): every ratio, weight, baseline,
advantage and coefficient computed here is wrapped in `jax.lax.stop_gradient`;
the only differentiable quantity in the surrogate loss is `logp_nt`:

  loss(params) = - sum_n coef_n * sum_t tokw_nt * logp_nt(params)

with `coef_n` from `pg_coefficients` and `tokw_nt` from `pg_token_weights`
(tokw_nt = mask_nt for every sequence-level weight variant).

Departures from the paper / reference implementation (each is an option):
  * ESS is computed from log-weights in log space (exact for any finite l),
    not from exp(l), which overflows for long sequences and, through
    Python's min(1.0, nan) == 1.0, silently disables the brake.
  * The ESS learning-rate scale is capped at 1 (review #4) and a non-finite
    ESS ratio brakes fully (scale 0) instead of not at all.
  * OPOB can use the weights the update applies (`opob_weights="applied"`,
    review #1) and a leave-one-out set (`opob_leave_one_out`, review #3,
    unbiased); `reference_mode` reproduces the reference's two
    inconsistencies (IS weight counted twice in the baseline weight; token-SUM
    norms with a token-MEAN update) so they can be compared.
  * Every importance-weight variant has exactly one definition (review #5) and
    every advantage estimator is named (review #13); see the registries
    `WEIGHT_VARIANTS` and `ADVANTAGE_ESTIMATORS`.
  * Trajectories with an empty loss mask are treated as padding: excluded from
    ESS, baselines, group statistics and the normalizers.
  * A trajectory whose log-ratio l_n is not finite (NaN or +-inf: a corrupt
    behavior log-prob, an overflow) is masked out the same way and counted in
    the metric `nonfinite_rows` (logged as train/nonfinite_rows); the ESS stays
    in [1/n, 1] over the finite rows instead of NaN / 0 (the reference's
    min(1, nan) == 1 disables the brake).
  * OPOB's baseline weights w_n^2 ||s_n||^2 use the UNCLAMPED ratio, formed in
    log space (2 l_n + log ||s_n||^2), as the paper and the reference do; the
    +-log_ratio_clamp (20) clamp only enters the applied weights, which the
    reference defines with it. (Clamping the baseline weights would make every
    row with l > 20 weigh the same: exactly the high-lag regime VCPO is for.)
  * GRPO's group std is a per-preset choice (`PGConfig.std`): the reference's
    GRPO uses the sample std (torch.std, ddof 1), its OPOB path the population
    std (ddof 0); the presets follow the reference accordingly (see PRESETS).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

sg = jax.lax.stop_gradient

# The reference clamps l_n to [-20, 20] before exponentiating.
DEFAULT_LOG_RATIO_CLAMP = 20.0

# ---------------------------------------------------------------------------
# Log-ratios and effective sample size
# ---------------------------------------------------------------------------


def token_log_ratio(logp_nt, behavior_logp_nt, mask_nt):
  """Per-token log-ratio d_nt = mask_nt * (sg[logp_nt] - behavior_logp_nt).

  Args:
    logp_nt: [N, T] learner log-probs of the sampled tokens.
    behavior_logp_nt: [N, T] sampler (behavior) log-probs of the same tokens.
    mask_nt: [N, T] loss mask (1 = counts, 0 = prompt / padding / tool token).
  Returns:
    [N, T] float32, 0 where masked (masked positions may hold -inf / garbage).
  """
  logp_nt = jnp.asarray(logp_nt, jnp.float32)
  d_nt = sg(logp_nt) - jnp.asarray(behavior_logp_nt, jnp.float32)
  return jnp.where(jnp.asarray(mask_nt) != 0, d_nt, 0.0)


def sequence_log_ratio(logp_nt, behavior_logp_nt, mask_nt):
  """l_n = sum_t mask_nt * (sg[logp_nt] - behavior_logp_nt).  [N, T] -> [N].

  Stop-gradient on logp: l_n is a coefficient, never differentiated.
  """
  return jnp.sum(token_log_ratio(logp_nt, behavior_logp_nt, mask_nt), axis=-1)


def _valid(log_w_n, valid_n):
  if valid_n is None:
    return jnp.ones(jnp.shape(log_w_n), bool)
  return jnp.asarray(valid_n).astype(bool)


def _usable(log_w_n, valid_n):
  # NaN / +inf log-weights have no defined share of the mass: exclude them.
  return _valid(log_w_n, valid_n) & ~jnp.isnan(log_w_n) & (log_w_n < jnp.inf)


def ess(log_w_n, valid_n=None):
  """Effective sample size (sum w)^2 / sum w^2 from LOG weights, in samples.

  Computed as s1^2 / s2 with s_k = sum exp(k (log w - max log w)), i.e. in log
  space: exact for any finite log-weights (|log w| up to 1e4 and beyond).
  Invariant to adding a constant to all log-weights and to permutations.

  Args:
    log_w_n: [N] log importance weights (-inf allowed: a zero weight; NaN and
      +inf entries carry no usable weight and are excluded like invalid ones).
    valid_n: optional [N] bool; False entries are excluded.
  Returns:
    scalar float32 in [1, n_valid]; 0 when no valid entry or every valid weight
    is zero.

  References:
    Kong, A note on importance sampling using standardized weights, U. Chicago technical report (1992).
    Owen, Monte Carlo theory, methods and examples (2013), ch. 9.
  """
  log_w_n = sg(jnp.asarray(log_w_n, jnp.float32))
  valid_n = _usable(log_w_n, valid_n)
  lw = jnp.where(valid_n, log_w_n, -jnp.inf)
  m = jnp.max(lw, initial=-jnp.inf)
  has_mass = jnp.isfinite(m)
  z = jnp.where(valid_n, lw - jnp.where(has_mass, m, 0.0), -jnp.inf)
  s1 = jnp.sum(jnp.exp(z))  # in [1, n]: the max term is exp(0)
  s2 = jnp.sum(jnp.exp(2.0 * z))  # in [1, n]
  n_valid = jnp.sum(valid_n).astype(jnp.float32)
  out = jnp.clip(s1 * s1 / jnp.where(has_mass, s2, 1.0), 1.0, jnp.maximum(n_valid, 1.0))
  return jnp.where(has_mass, out, 0.0)


def ess_ratio(log_w_n, valid_n=None):
  """rho = ESS / n_valid in [1/n_valid, 1] (1.0 when there is no valid entry).

  Args / conventions as `ess` (n_valid counts the valid entries that are not
  NaN / +inf).
  """
  log_w_n = sg(jnp.asarray(log_w_n, jnp.float32))
  valid = _usable(log_w_n, valid_n)
  n_valid = jnp.sum(valid).astype(jnp.float32)
  return jnp.where(n_valid > 0, ess(log_w_n, valid) / jnp.maximum(n_valid, 1.0), 1.0)


ESS_LR_RULES: dict[str, Callable[[jax.Array], jax.Array]] = {
  "sqrt": jnp.sqrt,  # the paper: eta * sqrt(min(1, rho / rho_on))
  "linear": lambda x: x,
}


def ess_lr_scale(ess_ratio, reference=1.0, rule="sqrt"):
  """Learning-rate multiplier rule(min(1, rho / rho_on)) in [0, 1].

  Capped at 1 (review #4: the reference caps in code, the paper's equation
  does not). A non-finite ratio gives 0: brake fully rather than not at all.

  Args:
    ess_ratio: scalar rho (of the UNCLIPPED weights in VCPO).
    reference: rho_on > 0, the on-policy reference ratio (docs/rho_on_protocol.md).
    rule: "sqrt" (paper) or "linear".

  References:
    Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs, arXiv 2602.17616 (the ESS-scaled step size).
  """
  if rule not in ESS_LR_RULES:
    raise ValueError(f"rule={rule!r}: choose one of {sorted(ESS_LR_RULES)}")
  if isinstance(reference, (int, float)) and not reference > 0:
    raise ValueError(f"reference={reference!r}: rho_on must be > 0")
  x = jnp.asarray(ess_ratio, jnp.float32) / reference
  x = jnp.where(jnp.isfinite(x), jnp.clip(x, 0.0, 1.0), 0.0)
  return ESS_LR_RULES[rule](x)


def rho_on_statistics(ess_ratios) -> dict[str, float]:
  """Summary of on-policy ESS ratios for the rho_on protocol (host-side numpy).

  Returns mean, std (sample, ddof=1), median, q10, min and n. See
  docs/rho_on_protocol.md for how the ratios are collected.
  """
  x = np.asarray(ess_ratios, np.float64).ravel()
  if x.size == 0:
    raise ValueError("ess_ratios: empty; collect at least 2 on-policy steps")
  return dict(
    mean=float(x.mean()),
    std=float(x.std(ddof=1)) if x.size > 1 else float("nan"),
    median=float(np.median(x)),
    q10=float(np.quantile(x, 0.1)),
    min=float(x.min()),
    n=int(x.size),
  )


# ---------------------------------------------------------------------------
# Importance-weight variants: one registry, one definition each (review #5)
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WeightVariant:
  """A named importance-weight variant.

  level: "sequence" (input l_n [N] -> weight [N]) or "token" (input d_nt
  [N, T] -> weight [N, T]). fn(lc, raw, lengths_n, c, lower, upper) gets the
  clamped log-ratio `lc`, the raw one and the lengths.
  """

  name: str
  level: str
  needs: tuple[str, ...]
  fn: Callable[..., jax.Array]
  doc: str


def _inside(lc, lower, upper):
  # Compare in log space: no overflow, and lower = 0 means "no lower bound".
  lo = -jnp.inf if lower <= 0 else math.log(lower)
  return (lc >= lo) & (lc <= math.log(upper))


WEIGHT_VARIANTS: dict[str, WeightVariant] = {
  v.name: v
  for v in [
    WeightVariant("none", "sequence", (), lambda lc, raw, L, c, a, b: jnp.ones_like(lc), "w = 1 (no correction)"),
    WeightVariant("is", "sequence", (), lambda lc, raw, L, c, a, b: jnp.exp(lc), "w = exp(clamp(l)) (unclipped IS)"),
    WeightVariant(
      "tis",
      "sequence",
      ("c",),
      lambda lc, raw, L, c, a, b: jnp.exp(jnp.minimum(lc, math.log(c))),
      "w = min(exp(l), c) (upper-only truncated IS)",
    ),
    WeightVariant(
      "tis_ess",
      "sequence",
      ("target", "lengths_n"),
      lambda lc, raw, L, c, a, b: jnp.exp(_policy_losses().tis_ess_log_weights(lc, c, valid_n=L > 0)[0]),
      "w = min(exp(l), c_t), c_t solved per step (bisection on log c) so that ESS(w) / n = target "
      "(fn gets the target in the c slot; rows with L_n = 0 are left out of the solve)",
    ),
    WeightVariant(
      "clip",
      "sequence",
      ("lower", "upper"),
      lambda lc, raw, L, c, a, b: jnp.clip(jnp.exp(lc), a, b),
      "w = clip(exp(l), lower, upper) (two-sided)",
    ),
    WeightVariant(
      "mask",
      "sequence",
      ("lower", "upper"),
      lambda lc, raw, L, c, a, b: jnp.where(_inside(lc, a, b), jnp.exp(lc), 0.0),
      "w = exp(l) if lower <= exp(l) <= upper else 0 (masked IS)",
    ),
    WeightVariant(
      "token_tis",
      "token",
      ("c",),
      lambda lc, raw, L, c, a, b: jnp.exp(jnp.minimum(lc, math.log(c))),
      "w_nt = min(exp(d_nt), c) per token (token-level TIS)",
    ),
    WeightVariant(
      "geo_mask",
      "sequence",
      ("lower", "upper", "lengths_n"),
      lambda lc, raw, L, c, a, b: jnp.where((L > 0) & _inside(raw / jnp.maximum(L, 1.0), a, b), 1.0, 0.0),
      "w = 1 if lower <= exp(l / L) <= upper else 0 (geometric-mean rejection; no reweighting)",
    ),
  ]
}


def _policy_losses():
  # policy_losses imports this module (ESS): import it lazily, at trace / config time
  from vcpo_jax import policy_losses

  return policy_losses


def importance_weights(
  log_ratio,
  variant,
  *,
  c=8.0,
  lower=None,
  upper=None,
  lengths_n=None,
  log_clamp=DEFAULT_LOG_RATIO_CLAMP,
  target=0.5,
):
  """Stop-gradient importance weights of a named variant (see WEIGHT_VARIANTS).

  Args:
    log_ratio: l_n [N] for sequence variants, d_nt [N, T] for "token_tis".
    variant: "none" | "is" | "tis" | "tis_ess" | "clip" | "mask" | "token_tis" | "geo_mask".
    c: truncation level for "tis" / "token_tis" (> 0).
    lower, upper: interval for "clip", "mask", "geo_mask" (0 <= lower <= upper).
    lengths_n: [N] token counts L_n, needed by "geo_mask" (ratio exp(l / L)) and by "tis_ess" (rows with
      L_n = 0 are left out of its solve).
    target: "tis_ess"'s target ESS ratio in (0, 1]: the cap c_t is solved for this batch
      (policy_losses.ess_target_truncation, a bisection on log c; c_t >= 1).
    log_clamp: log-ratios are clamped to [-log_clamp, log_clamp] before exp
      (the reference uses 20), so every weight is finite.
  Returns:
    weights of the same shape as log_ratio, float32, >= 0, finite for finite
    or +-inf log-ratios; stop-gradient.

  References:
    Ionides, Truncated importance sampling, J. Comput. Graph. Stat. 17(2) (2008) ("tis").
    Espeholt et al., IMPALA, arXiv 1802.01561 (2018) (truncated ratios in off-policy RL).
  """
  if variant not in WEIGHT_VARIANTS:
    raise ValueError(f"variant={variant!r}: choose one of {sorted(WEIGHT_VARIANTS)}")
  v = WEIGHT_VARIANTS[variant]
  if "c" in v.needs and not (c is not None and c > 0):
    raise ValueError(f"c={c!r}: variant {variant!r} needs a truncation level c > 0")
  if "lower" in v.needs and (lower is None or upper is None or not 0 <= lower <= upper or not upper > 0):
    raise ValueError(f"lower={lower!r}, upper={upper!r}: variant {variant!r} needs 0 <= lower <= upper, upper > 0")
  if "target" in v.needs:
    if not 0 < target <= 1:
      raise ValueError(f"target={target!r}: variant {variant!r} needs a target ESS ratio in (0, 1]")
    c = target  # the variant's fn receives the target in the c slot
  if "lengths_n" in v.needs and lengths_n is None:
    raise ValueError(f"lengths_n: variant {variant!r} needs the token counts L_n")
  if not log_clamp > 0:
    raise ValueError(f"log_clamp={log_clamp!r}: must be > 0")
  raw = sg(jnp.asarray(log_ratio, jnp.float32))
  lc = jnp.clip(raw, -log_clamp, log_clamp)
  L = None if lengths_n is None else jnp.asarray(lengths_n, jnp.float32)
  return sg(v.fn(lc, raw, L, c, lower, upper).astype(jnp.float32))


# ---------------------------------------------------------------------------
# Advantage estimators: one registry (review #13)
# ---------------------------------------------------------------------------


def _same_group(group_id_n, valid_n):
  """[N, N] bool: j is in i's set (same group, both valid). O(N^2) memory,
  which is fine for N <= a few thousand and needs no static group count."""
  g = jnp.asarray(group_id_n)
  return (g[:, None] == g[None, :]) & valid_n[:, None] & valid_n[None, :]


def _group_mean(x_n, same_nn):
  cnt = jnp.sum(same_nn, axis=1)
  return jnp.sum(jnp.where(same_nn, x_n[None, :], 0.0), axis=1) / jnp.maximum(cnt, 1), cnt


def _group_std(x_n, same_nn, std, std_eps):
  mean, cnt = _group_mean(x_n, same_nn)
  sq = jnp.sum(jnp.where(same_nn, jnp.square(x_n[None, :] - mean[:, None]), 0.0), axis=1)
  dof = cnt if std == "population" else cnt - 1
  sd = jnp.sqrt(sq / jnp.maximum(dof, 1))
  # Zero-std (or size-1 sample-std) groups: scale 0 marks "contributes nothing".
  return jnp.where((dof > 0) & (sd > std_eps), sd, 0.0)


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
  """A named estimator A_n = (R_n - baseline_n) / scale_n (0 where scale_n = 0).

  baseline(R_n, same_nn, valid_n) -> [N]; std_normalized: scale is the
  group reward std (else 1); batch_wide: the baseline reads rows outside the
  group (so the method cannot be micro-batched by groups).
  """

  name: str
  baseline: Callable[..., jax.Array]
  std_normalized: bool
  doc: str
  batch_wide: bool = False


def _batch_mean_baseline(r, same_nn, valid):
  m = jnp.sum(jnp.where(valid, r, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
  return jnp.full_like(r, m)


def _group_mean_baseline(r, same_nn, valid):
  return _group_mean(r, same_nn)[0]


def _loo_baseline(r, same_nn, valid):
  others = same_nn & ~jnp.eye(r.shape[0], dtype=bool)
  mean, cnt = _group_mean(r, others)
  return jnp.where(cnt > 0, mean, r)  # a group of one has no baseline: A = 0


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
  e.name: e
  for e in [
    AdvantageEstimator("reinforce", _batch_mean_baseline, False, "A = R - mean(R over the batch)", batch_wide=True),
    AdvantageEstimator("rloo", _loo_baseline, False, "A = R_i - mean(R_j, j != i in the group)"),
    AdvantageEstimator("grpo", _group_mean_baseline, True, "A = (R - group mean) / group std (zero-std group: A = 0)"),
    AdvantageEstimator("drgrpo", _group_mean_baseline, False, "A = R - group mean (Dr. GRPO: no std)"),
  ]
}

STD_KINDS = ("population", "sample")


def baseline_and_scale(rewards_n, group_id_n, estimator, *, valid_n=None, std="population", std_eps=1e-6):
  """The estimator's baseline_n and scale_n, [N] each (scale 0 = drop).

  Separated from `advantages` so OPOB can replace the baseline while keeping
  the estimator's std normalization (VCPO: (R - b_opob) / sigma_group).
  """
  if estimator not in ADVANTAGE_ESTIMATORS:
    raise ValueError(f"estimator={estimator!r}: choose one of {sorted(ADVANTAGE_ESTIMATORS)}")
  if std not in STD_KINDS:
    raise ValueError(f"std={std!r}: choose one of {STD_KINDS}")
  est = ADVANTAGE_ESTIMATORS[estimator]
  r = sg(jnp.asarray(rewards_n, jnp.float32))
  valid = _valid(r, valid_n)
  same = _same_group(group_id_n, valid)
  base = est.baseline(r, same, valid)
  scale = _group_std(r, same, std, std_eps) if est.std_normalized else jnp.ones_like(r)
  return sg(base), sg(jnp.where(valid, scale, 0.0))


def advantages(rewards, group_ids=None, estimator="grpo", *, valid_n=None, std="population", std_eps=1e-6):
  """Advantages of a named estimator (see ADVANTAGE_ESTIMATORS), stop-gradient.

  Args:
    rewards: [N] with group_ids [N] (any integers), or [P, G] (rows = groups).
    group_ids: [N] group of each trajectory; None for the [P, G] layout (and
      allowed for "reinforce", whose baseline is the batch mean).
    estimator: "reinforce" | "rloo" | "grpo" | "drgrpo".
    valid_n: optional [N] bool; invalid entries get 0 and are excluded.
    std: "population" (ddof 0; the reference's OPOB path) or "sample" (ddof 1;
      the reference's GRPO, torch.std) for "grpo"; groups with std <= std_eps
      (and groups of one under "sample") get advantage 0. The two differ by
      sqrt(G / (G - 1)) (1.41x at G = 2).
  Returns:
    advantages with the shape of `rewards`.

  References:
    Shao et al., DeepSeekMath (GRPO), arXiv 2402.03300 (2024).
    Ahmadian et al., Back to Basics: Revisiting REINFORCE Style Optimization, arXiv 2402.14740 (2024) (RLOO).
    Liu et al., Understanding R1-Zero-Like Training: A Critical Perspective, arXiv 2503.20783 (2025)
      (Dr. GRPO).
  """
  r = jnp.asarray(rewards, jnp.float32)
  shape = r.shape
  if r.ndim == 2 and group_ids is None:
    group_ids = jnp.repeat(jnp.arange(shape[0]), shape[1])
    r = r.reshape(-1)
    valid_n = None if valid_n is None else jnp.asarray(valid_n).reshape(-1)
  elif r.ndim != 1:
    raise ValueError(f"rewards: shape {shape}; pass [N] with group_ids or [P, G] without")
  if group_ids is None:
    if estimator != "reinforce":
      raise ValueError(f"group_ids: required for estimator {estimator!r} with [N] rewards (or pass rewards as [P, G])")
    group_ids = jnp.zeros(r.shape, jnp.int32)
  valid = _valid(r, valid_n)
  base, scale = baseline_and_scale(r, group_ids, estimator, valid_n=valid, std=std, std_eps=std_eps)
  adv = jnp.where(valid & (scale > 0), (r - base) / jnp.where(scale > 0, scale, 1.0), 0.0)
  return sg(adv.reshape(shape))


# ---------------------------------------------------------------------------
# OPOB: off-policy optimal baseline
# ---------------------------------------------------------------------------


def opob_baseline(
  rewards_n, weights_n, sq_grad_norms_n, group_ids_n, leave_one_out=False, *, valid_n=None, log_weights_n=None
):
  """b_i = sum_j w_j^2 s_j R_j / sum_j w_j^2 s_j over j in i's group.

  The set excludes j = i when leave_one_out (then b_i does not depend on
  trajectory i, so the baseline term has zero mean: unbiased, review #3).
  Where the denominator is 0 (all w_j^2 s_j zero) the baseline falls back to
  the unweighted mean of R over the same set, and to 0 for an empty set. The
  weights a_j = w_j^2 s_j are formed in log space, log a_j = 2 log w_j +
  log s_j, normalised by the set's max, so no weight can overflow; the result
  is clipped into [min R, max R] of the set (a convex combination, guarded
  against rounding).

  Args:
    rewards_n: [N] values R (raw rewards for scope "group"; advantages for
      scope "minibatch", i.e. one group id).
    weights_n: [N] w >= 0: unclipped (the paper) or applied (review #1); None
      when log_weights_n is given.
    sq_grad_norms_n: [N] s >= 0, the squared score norms.
    group_ids_n: [N] integer group of each trajectory.
    leave_one_out: exclude j = i from i's set.
    valid_n: optional [N] bool; invalid entries join no set (their b is 0).
    log_weights_n: [N] log w instead of weights_n: pass the UNCLAMPED
      log-ratio l_n here, since exp(l_n) overflows float32 beyond l = 88 and a
      clamp at 20 would make every large weight equal.
  Returns:
    [N] float32 baselines, stop-gradient.

  References:
    Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs, arXiv 2602.17616 (OPOB).
    Greensmith, Bartlett & Baxter, Variance reduction techniques for gradient estimates in
      reinforcement learning, JMLR 5 (2004) (the squared-score-norm weighted baseline).
  """
  if (weights_n is None) == (log_weights_n is None):
    raise ValueError("opob_baseline: pass exactly one of weights_n and log_weights_n")
  r = sg(jnp.asarray(rewards_n, jnp.float32))
  if log_weights_n is None:
    log_w = jnp.log(jnp.abs(sg(jnp.asarray(weights_n, jnp.float32))))  # -inf for a zero weight
  else:
    log_w = sg(jnp.asarray(log_weights_n, jnp.float32))
  s = sg(jnp.asarray(sq_grad_norms_n, jnp.float32))
  valid = _valid(r, valid_n)
  same = _same_group(group_ids_n, valid)
  if leave_one_out:
    same = same & ~jnp.eye(r.shape[0], dtype=bool)
  log_a = 2.0 * log_w + jnp.log(jnp.abs(s))
  log_a_nn = jnp.where(same, log_a[None, :], -jnp.inf)
  lm = jnp.max(log_a_nn, axis=1, keepdims=True, initial=-jnp.inf)
  has_mass = jnp.isfinite(lm[:, 0])
  a_nn = jnp.where(same & has_mass[:, None], jnp.exp(log_a_nn - jnp.where(has_mass[:, None], lm, 0.0)), 0.0)
  weighted = jnp.sum(a_nn * r[None, :], axis=1) / jnp.maximum(jnp.sum(a_nn, axis=1), 1e-30)
  mean, cnt = _group_mean(r, same)
  b = jnp.where(has_mass, weighted, jnp.where(cnt > 0, mean, 0.0))
  r_lo = jnp.min(jnp.where(same, r[None, :], jnp.inf), axis=1)
  r_hi = jnp.max(jnp.where(same, r[None, :], -jnp.inf), axis=1)
  b = jnp.where(cnt > 0, jnp.clip(b, r_lo, r_hi), b)
  return sg(b)


# ---------------------------------------------------------------------------
# The policy-gradient update: config, presets, coefficients
# ---------------------------------------------------------------------------

# Loss aggregation: coef_n's factor norm_n = per_row(L_n, T) / Z, where Z is a
# whole-batch count (rows or tokens, over the valid or the kept rows: see
# PGConfig.mask_normalizer) or 1. Keeping Z apart lets a micro-batched step use
# the per-row part inside each micro-batch and divide the accumulated gradient
# by the whole batch's Z once (`loss_divisor`).


@dataclasses.dataclass(frozen=True)
class LossAggregation:
  """A named loss aggregation: norm_n = per_row(L_n, T) / Z.

  per_row(L_n [N], T) -> [N]; divisor: "rows" (Z = number of counted rows),
  "tokens" (Z = their total token count) or "none" (Z = 1).
  """

  name: str
  per_row: Callable[[jax.Array, jax.Array], jax.Array]
  divisor: str
  doc: str


LOSS_AGGREGATIONS: dict[str, LossAggregation] = {
  a.name: a
  for a in [
    LossAggregation(
      "seq-mean-token-mean", lambda L, T: 1.0 / jnp.maximum(L, 1.0), "rows", "1 / (N L_n): the paper's update"
    ),
    LossAggregation("token-mean", lambda L, T: jnp.ones_like(L), "tokens", "1 / sum_n L_n: mean over the tokens"),
    LossAggregation(
      "seq-mean-token-sum", lambda L, T: jnp.ones_like(L), "rows", "1 / N: mean of token-sums (no length bias)"
    ),
    LossAggregation(
      "seq-mean-token-sum-norm",
      lambda L, T: jnp.full_like(L, 1.0) / T,
      "none",
      "1 / T: SUM of token-sums over a constant T (the reference's Dr. GRPO mode; PGConfig.loss_norm_tokens)",
    ),
  ]
}
MASK_NORMALIZERS = ("all", "kept")
DECOUPLED_PROX = ("exact", "loglinear")
OPOB_WEIGHTS = ("unclipped", "applied")
OPOB_SCOPES = ("group", "minibatch")


@dataclasses.dataclass(frozen=True)
class PGConfig:
  """Everything that defines a policy-gradient method; hashable (jit-static).

  The surrogate is  loss = - sum_n coef_n * sum_t tokw_nt * logp_nt  with
    coef_n = A_n * w_n * norm_n   (all stop-gradient)
    A_n    = (R_n - baseline_n) / scale_n   (advantage estimator; OPOB may
             replace the baseline)
    w_n    = applied sequence weight (1 for token-level variants, whose weight
             sits in tokw_nt = mask_nt * min(exp(d_nt), c))
    norm_n = 1 / (N L_n) | 1 / sum_n L_n | 1 / N | 1 / T   (loss aggregation)

  mask_normalizer: which rows the counts N and sum_n L_n of norm_n include.
  "all": every valid row, rejected ones too (a rejected row adds 0 to the sum
  but still counts; the presets' choice, so that a batch's step size does not
  grow as more rows are rejected); "kept": only the rows whose applied weight
  is not 0 (the reference's masked IS, which drops rejected rows from the
  loss mask). It changes only the rejection variants "mask" and "geo_mask"
  (the others reject nothing).
  """

  advantage: str = "grpo"  # ADVANTAGE_ESTIMATORS name: the base algorithm (review #13)
  is_variant: str = "none"  # WEIGHT_VARIANTS name
  tis_c: float = 8.0  # "tis" truncation level (c = 8 in all released runs)
  clip_lower: float = 0.5  # "clip" interval
  clip_upper: float = 2.0
  mask_lower: float = 0.5  # "mask" interval
  mask_upper: float = 2.0
  token_tis_c: float = 2.0  # "token_tis" per-token truncation level
  geo_lower: float = 0.99  # "geo_mask" interval on exp(l / L)
  geo_upper: float = 1.01
  log_ratio_clamp: float = DEFAULT_LOG_RATIO_CLAMP  # applied weights use exp(clamp(l, -c, c))
  loss_agg: str = "seq-mean-token-mean"  # LOSS_AGGREGATIONS
  mask_normalizer: str = "all"  # rows counted in the loss normaliser: all (valid) | kept (weight != 0)
  loss_norm_tokens: int = 0  # "seq-mean-token-sum-norm" divisor T; 0: the batch's token axis length
  opob: bool = False  # replace the estimator's baseline by OPOB
  opob_weights: str = "unclipped"  # "unclipped" (paper) | "applied" (review #1)
  opob_leave_one_out: bool = False  # exclude i from its own baseline (unbiased)
  opob_scope: str = "group"  # "group": raw rewards per prompt; "minibatch": A over batch
  length_normalize_norms: bool = False  # ||s_n||^2 / L_n^2 (norm of the token-mean score)
  reference_mode: bool = False  # reproduce the reference: norms w~^2 ||s||^2, weights w^2
  std: str = "population"  # group std for "grpo": population (ddof 0) | sample (ddof 1); presets set it
  std_eps: float = 1e-6  # groups with std <= std_eps contribute nothing
  ess_lr: bool = False  # scale the step's learning rate by the ESS rule
  ess_rule: str = "sqrt"  # ESS_LR_RULES name
  rho_on: float = 1.0  # on-policy reference ESS ratio (docs/rho_on_protocol.md)
  tis_ess_target: float = 0.5  # "tis_ess": target ESS ratio of the truncated weights, in (0, 1]
  policy_loss: str = "pg"  # "pg" (the surrogate above) | a policy_losses.POLICY_LOSSES name (its own loss_agg)
  policy_loss_kw: str = ""  # its hyper-parameters "name=value,...", e.g. "eps_high=0.28,loss_agg=token-mean"
  decoupled_prox: str = "exact"  # decoupled_ppo's pi_prox: exact (pi_old, recomputed) | loglinear (AReaL approx.)

  def __post_init__(self):
    def choose(field, options):
      if getattr(self, field) not in options:
        raise ValueError(f"PGConfig.{field}={getattr(self, field)!r}: choose one of {sorted(options)}")

    def positive(field):
      if not getattr(self, field) > 0:
        raise ValueError(f"PGConfig.{field}={getattr(self, field)!r}: must be > 0")

    choose("advantage", ADVANTAGE_ESTIMATORS)
    choose("is_variant", WEIGHT_VARIANTS)
    choose("loss_agg", LOSS_AGGREGATIONS)
    choose("mask_normalizer", MASK_NORMALIZERS)
    choose("opob_weights", OPOB_WEIGHTS)
    choose("opob_scope", OPOB_SCOPES)
    choose("std", STD_KINDS)
    choose("ess_rule", ESS_LR_RULES)
    for f in ("tis_c", "token_tis_c", "log_ratio_clamp", "rho_on", "clip_upper", "mask_upper", "geo_upper"):
      positive(f)
    if not self.std_eps >= 0:
      raise ValueError(f"PGConfig.std_eps={self.std_eps!r}: must be >= 0")
    if not (isinstance(self.loss_norm_tokens, int) and self.loss_norm_tokens >= 0):
      raise ValueError(
        f"PGConfig.loss_norm_tokens={self.loss_norm_tokens!r}: must be an int >= 0 (0: the batch's token length)"
      )
    for lo, hi in (("clip_lower", "clip_upper"), ("mask_lower", "mask_upper"), ("geo_lower", "geo_upper")):
      if not 0 <= getattr(self, lo) <= getattr(self, hi):
        raise ValueError(f"PGConfig.{lo}={getattr(self, lo)!r}: need 0 <= {lo} <= {hi}")
    if not 0 < self.tis_ess_target <= 1:
      raise ValueError(f"PGConfig.tis_ess_target={self.tis_ess_target!r}: must be in (0, 1]")
    choose("decoupled_prox", DECOUPLED_PROX)
    kw = policy_loss_kwargs(self)  # raises on a malformed string
    if self.policy_loss != "pg":
      pl = _policy_losses()
      choose("policy_loss", ["pg", *pl.POLICY_LOSSES])
      if self.is_variant != "none" or self.opob:
        raise ValueError(
          f"PGConfig.policy_loss={self.policy_loss!r} with is_variant={self.is_variant!r}, opob={self.opob}: "
          "the loss carries its own correction; use is_variant='none', opob=False"
        )
      try:
        pl.make_policy_loss(self.policy_loss, **kw)  # checks the names and values of the hyper-parameters
      except ValueError as e:
        raise ValueError(f"PGConfig.policy_loss_kw={self.policy_loss_kw!r}: {e}") from None
    elif kw:
      raise ValueError(f"PGConfig.policy_loss_kw={self.policy_loss_kw!r}: only with a policy_loss other than 'pg'")
    if self.opob and WEIGHT_VARIANTS[self.is_variant].level == "token":
      raise ValueError(
        f"PGConfig.opob=True with is_variant={self.is_variant!r}: OPOB is "
        "derived for sequence-level weights; use a sequence variant"
      )
    if self.reference_mode:
      if not self.opob:
        raise ValueError("PGConfig.reference_mode=True needs opob=True (it only changes OPOB)")
      if self.opob_weights != "unclipped" or self.length_normalize_norms:
        raise ValueError(
          "PGConfig.reference_mode=True fixes opob_weights='unclipped' and "
          "length_normalize_norms=False (the reference's choices)"
        )

  def replace(self, **kw) -> "PGConfig":
    return dataclasses.replace(self, **kw)


_VCPO = dict(
  advantage="grpo",
  is_variant="tis",
  tis_c=8.0,
  opob=True,
  opob_weights="unclipped",
  opob_scope="group",
  std="population",  # the reference's OPOB path: sigma_g is the population std
  ess_lr=True,
  ess_rule="sqrt",
  rho_on=1.0,
)
# The reference's GRPO advantage (no OPOB) divides by torch.std: the sample std.
_GRPO = dict(advantage="grpo", std="sample")

# Every preset names its std and its mask normaliser; "all" keeps rejected rows
# in the normaliser (PGConfig docstring).
PRESETS: dict[str, dict[str, Any]] = {
  "sync": dict(_GRPO, is_variant="none"),  # synchronous GRPO (run with k = 0)
  "none": dict(_GRPO, is_variant="none"),  # stale data, no correction
  "seq_tis": dict(_GRPO, is_variant="tis", tis_c=8.0),
  "clip": dict(_GRPO, is_variant="clip"),
  "mask": dict(_GRPO, is_variant="mask", mask_normalizer="all"),
  "token_tis": dict(_GRPO, is_variant="token_tis"),
  "geo_mask": dict(_GRPO, is_variant="geo_mask", mask_normalizer="all"),
  "vcpo": dict(_VCPO),
  "vcpo_no_esslr": dict(_VCPO, ess_lr=False),
  "vcpo_no_opob": dict(_VCPO, opob=False, std="sample"),  # without OPOB the reference runs its GRPO advantage
  "vcpo_applied_opob": dict(_VCPO, opob_weights="applied"),
  "vcpo_loo_opob": dict(_VCPO, opob_leave_one_out=True),
  "vcpo_reference": dict(_VCPO, reference_mode=True),
  # the stabilizers the field uses (vcpo_jax/policy_losses.py), on the reference GRPO advantage
  **{
    name: dict(_GRPO, is_variant="none", policy_loss=name)
    for name in ("ppo_clip", "decoupled_ppo", "gspo", "cispo", "m2po_paper", "m2po_released", "icepop", "dppo_tv")
  },
  # the trust regions of prime-rl (IPO) and AReaL (KPop), vcpo_jax/policy_losses.py
  **{name: dict(_GRPO, is_variant="none", policy_loss=name) for name in ("ipo", "kpop")},
  "vcpo_tis_ess": dict(_VCPO, is_variant="tis_ess", tis_ess_target=0.5),  # VCPO with the ESS-targeted cap
}


# One line per preset (tests/test_estimator.py checks that every PRESETS name has one).
PRESET_DOCS: dict[str, str] = {
  "sync": "synchronous GRPO (sample std advantage, no correction); run with k = 0",
  "none": "GRPO on stale data with no correction (the baseline every correction is compared with)",
  "seq_tis": "GRPO with sequence-level truncated IS, w = min(exp(l), 8)",
  "clip": "GRPO with a two-sided clipped sequence IS weight, w = clip(exp(l), clip_lower, clip_upper)",
  "mask": "GRPO with masked sequence IS: w = exp(l) inside [mask_lower, mask_upper], else 0 (kept in the normalizer)",
  "token_tis": "GRPO with per-token truncated IS, w_nt = min(exp(d_nt), token_tis_c)",
  "geo_mask": "GRPO with geometric-mean rejection: a row is kept (w = 1) iff geo_lower <= exp(l / L) <= geo_upper",
  "vcpo": "VCPO: sequence TIS c = 8 + the OPOB baseline + the ESS-scaled learning rate (sqrt rule, rho_on = 1)",
  "vcpo_no_esslr": "VCPO without the ESS-scaled learning rate",
  "vcpo_no_opob": "VCPO without the OPOB baseline (the reference's GRPO advantage, sample std)",
  "vcpo_applied_opob": "VCPO with OPOB weighted by the applied (truncated) weights instead of the unclipped ones",
  "vcpo_loo_opob": "VCPO with the leave-one-out OPOB baseline",
  "vcpo_reference": "VCPO reproducing the reference implementation's two inconsistencies",
  "ppo_clip": "verl's token-level PPO clip on the GRPO advantage (policy_losses.ppo_clip)",
  "decoupled_ppo": "AReaL's decoupled PPO: clip against pi_prox, IS weight pi_prox / mu (policy_losses.decoupled_ppo)",
  "gspo": "GSPO: clipped length-normalized sequence ratio (policy_losses.gspo)",
  "cispo": "CISPO: clipped, stop-gradient token IS weight on every token's gradient (policy_losses.cispo)",
  "m2po_paper": "M2PO as in its paper and AReaL: second-moment token masking (policy_losses.m2po_paper)",
  "m2po_released": "M2PO as its authors released it: a second-moment budget sets one PPO clip (policy_losses.m2po_released)",
  "icepop": "IcePop (slime): PPO clip times the token weight pi_old / mu masked outside [0.5, 5] (policy_losses.icepop)",
  "dppo_tv": "prime-rl's DPPO binary-TV mask + squared log-ratio penalty (policy_losses.dppo_tv)",
  "ipo": "prime-rl's IPO: tokens with |p - q| > 0.1 dropped, r = p / q gradient + (log r)^2 term (policy_losses.ipo)",
  "kpop": "AReaL's KPop: decoupled PPO on tokens within a binary-KL band phi = 0.1 (policy_losses.kpop)",
  "vcpo_tis_ess": "VCPO with the ESS-targeted truncation: the cap c_t solved per step so that ESS / n = 0.5",
}


def pg_config_from_preset(name: str, **overrides) -> PGConfig:
  """PGConfig(**PRESETS[name], **overrides)."""
  if name not in PRESETS:
    raise ValueError(f"preset={name!r}: choose one of {sorted(PRESETS)}")
  return PGConfig(**{**PRESETS[name], **overrides})


def needs_sq_norms(cfg: PGConfig) -> bool:
  """Whether pg_coefficients needs the per-example squared score norms."""
  return bool(cfg.opob)


def batch_wide_coefficients(cfg: PGConfig) -> str | None:
  """Why a row's coefficient depends on rows outside its group (None: it does not).

  Such a method cannot be micro-batched by whole groups: the REINFORCE batch
  mean baseline and OPOB over the minibatch read every row. The loss
  normaliser Z and the ESS scale are whole-batch too, but scalar factors
  (`loss_divisor`, lr_scale), applied after accumulation.
  """
  if ADVANTAGE_ESTIMATORS[cfg.advantage].batch_wide:
    return f"vcpo.advantage={cfg.advantage!r} (its baseline is the mean over the whole batch)"
  if cfg.opob and cfg.opob_scope == "minibatch":
    return "vcpo.opob_scope='minibatch' (its baseline weighs every row's norm)"
  if cfg.is_variant == "tis_ess":
    return "vcpo.is_variant='tis_ess' (its cap c_t is solved over the whole batch)"
  if cfg.policy_loss != "pg":
    return f"vcpo.policy_loss={cfg.policy_loss!r} (its normalizer and masks are over the whole batch)"
  return None


def _variant_kwargs(cfg: PGConfig):
  v = cfg.is_variant
  return dict(
    c=cfg.token_tis_c if v == "token_tis" else cfg.tis_c,
    target=cfg.tis_ess_target,
    lower={"clip": cfg.clip_lower, "mask": cfg.mask_lower, "geo_mask": cfg.geo_lower}.get(v),
    upper={"clip": cfg.clip_upper, "mask": cfg.mask_upper, "geo_mask": cfg.geo_upper}.get(v),
    log_clamp=cfg.log_ratio_clamp,
  )


def _finite_rows(logp_nt, behavior_logp_nt, mask_nt):
  """l_n [N], L_n [N], valid_n [N] (non-empty mask and finite l_n), nonfinite_n [N]."""
  mask = jnp.asarray(mask_nt, jnp.float32)
  L_n = jnp.sum(mask, axis=-1)
  l_n = sequence_log_ratio(logp_nt, behavior_logp_nt, mask_nt)
  finite = jnp.isfinite(l_n)
  return l_n, L_n, (L_n > 0) & finite, (L_n > 0) & ~finite


def pg_token_weights(logp_nt, behavior_logp_nt, mask_nt, cfg: PGConfig):
  """tokw_nt multiplying logp_nt inside the surrogate's token sum, stop-gradient.

  mask_nt for sequence-level variants; mask_nt * min(exp(d_nt), c) for
  "token_tis" (its per-token weight cannot be folded into coef_n). Rows whose
  log-ratio is not finite get 0 (they are masked out, see pg_coefficients), so
  no NaN can reach the backward pass through them.
  """
  mask = jnp.asarray(mask_nt, jnp.float32)
  _, _, valid, _ = _finite_rows(logp_nt, behavior_logp_nt, mask_nt)
  if WEIGHT_VARIANTS[cfg.is_variant].level != "token":
    return jnp.where(valid[:, None], mask, 0.0)
  d_nt = token_log_ratio(logp_nt, behavior_logp_nt, mask_nt)
  tw = importance_weights(d_nt, cfg.is_variant, **_variant_kwargs(cfg))
  return sg(jnp.where(valid[:, None], mask * tw, 0.0))


def _pg_rows(logp_nt, behavior_logp_nt, mask_nt, rewards_n, group_id_n, sq_score_norms_n, cfg: PGConfig):
  """Everything of pg_coefficients that is per row: a dict of [N] arrays.

  unnormalized_coef_n = A_n * w_n * per_row(L_n, T): coef_n before the
  division by the whole-batch count Z (`loss_divisor`). Rows only interact
  within their group (unless batch_wide_coefficients(cfg)), so the rows of a
  micro-batch of whole groups equal the whole batch's.
  """
  mask = jnp.asarray(mask_nt, jnp.float32)
  l_n, L_n, valid, nonfinite = _finite_rows(logp_nt, behavior_logp_nt, mask_nt)
  l_safe = jnp.where(valid, l_n, 0.0)  # invalid rows: any finite stand-in, masked everywhere below
  r = sg(jnp.asarray(rewards_n, jnp.float32))
  vkw = _variant_kwargs(cfg)
  variant = WEIGHT_VARIANTS[cfg.is_variant]

  lc = jnp.clip(l_safe, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
  if variant.level == "token":
    d_nt = jnp.where(valid[:, None], token_log_ratio(logp_nt, behavior_logp_nt, mask_nt), 0.0)
    tw = importance_weights(d_nt, cfg.is_variant, **vkw)
    log_w_applied = jnp.sum(jnp.where(mask > 0, jnp.log(tw), 0.0), axis=-1)
    w_seq = jnp.where(valid, 1.0, 0.0)  # the weight lives in tokw_nt
    d_c = jnp.clip(d_nt, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    clipped_n = jnp.where(valid, jnp.sum((tw < jnp.exp(d_c)) * mask, axis=-1), 0.0)  # tokens
    masked_n = jnp.zeros_like(valid)
    weight_report = jnp.where(valid, jnp.exp(jnp.clip(log_w_applied, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)), 0.0)
  else:
    # lengths 0 on invalid rows: the variants that read L_n (geo_mask, tis_ess's solve) leave them out
    L_valid = jnp.where(valid, L_n, 0.0)
    w_seq = jnp.where(valid, importance_weights(l_safe, cfg.is_variant, lengths_n=L_valid, **vkw), 0.0)
    log_w_applied = jnp.log(w_seq)
    changed = valid & (w_seq > 0) & ~jnp.isclose(w_seq, jnp.exp(lc), rtol=1e-6)
    clipped_n = changed.astype(jnp.float32)  # rows
    masked_n = valid & (w_seq == 0)
    weight_report = w_seq
  kept = valid & (w_seq > 0)

  base, scale = baseline_and_scale(r, group_id_n, cfg.advantage, valid_n=valid, std=cfg.std, std_eps=cfg.std_eps)

  def normalize(value, b):
    return jnp.where(valid & (scale > 0), (value - b) / jnp.where(scale > 0, scale, 1.0), 0.0)

  if cfg.opob:
    s_n = sg(jnp.asarray(sq_score_norms_n, jnp.float32))
    if cfg.length_normalize_norms:
      s_n = s_n / jnp.square(jnp.maximum(L_n, 1.0))
    if cfg.reference_mode:
      s_n = s_n * jnp.square(w_seq)  # norm of the w~-weighted loss: w~ enters twice
    # The baseline weights: log w = l_n unclamped (the paper), or the applied weight.
    log_w_b = l_safe if cfg.opob_weights == "unclipped" else log_w_applied
    if cfg.opob_scope == "group":
      base = opob_baseline(r, None, s_n, group_id_n, cfg.opob_leave_one_out, valid_n=valid, log_weights_n=log_w_b)
      adv = normalize(r, base)
    else:
      a0 = normalize(r, base)
      zeros = jnp.zeros_like(jnp.asarray(group_id_n))
      base = opob_baseline(a0, None, s_n, zeros, cfg.opob_leave_one_out, valid_n=valid, log_weights_n=log_w_b)
      adv = jnp.where(valid, a0 - base, 0.0)
  else:
    adv = normalize(r, base)

  T = cfg.loss_norm_tokens or mask.shape[-1]
  per_row = LOSS_AGGREGATIONS[cfg.loss_agg].per_row(L_n, jnp.float32(T))
  return dict(
    unnormalized_coef_n=sg(jnp.where(valid, adv * w_seq * per_row, 0.0)),
    log_ratio_n=jnp.where(valid, l_n, 0.0),
    log_weight_applied_n=jnp.where(valid, log_w_applied, 0.0),
    weight_n=weight_report,
    advantage_n=adv,
    baseline_n=jnp.where(valid, base, 0.0),
    length_n=L_n,
    clipped_n=clipped_n,
    valid_n=valid,
    kept_n=kept,
    masked_n=masked_n,
    nonfinite_n=nonfinite,
  )


def loss_divisor(aux_n: Mapping[str, jax.Array], cfg: PGConfig) -> jax.Array:
  """Z of norm_n = per_row(L_n, T) / Z from the per-row arrays of a WHOLE batch (>= 1).

  aux_n: needs valid_n, kept_n, length_n ([N] each, as pg_coefficients returns).
  """
  divisor = LOSS_AGGREGATIONS[cfg.loss_agg].divisor
  if divisor == "none":
    return jnp.float32(1.0)
  rows = aux_n["kept_n"] if cfg.mask_normalizer == "kept" else aux_n["valid_n"]
  rows = jnp.asarray(rows, jnp.float32)
  count = jnp.sum(rows) if divisor == "rows" else jnp.sum(rows * jnp.asarray(aux_n["length_n"], jnp.float32))
  return jnp.maximum(count, 1.0)


def pg_metrics(aux_n: Mapping[str, jax.Array], cfg: PGConfig) -> dict[str, jax.Array]:
  """The scalar metrics of pg_coefficients from its per-row arrays (of the whole batch).

  A function of the [N] arrays only, so a micro-batched step that stacks its
  micro-batches' rows gets the single-pass numbers. See pg_coefficients.
  """
  valid = jnp.asarray(aux_n["valid_n"], bool)
  n_valid = jnp.sum(valid).astype(jnp.float32)
  l_n = aux_n["log_ratio_n"]
  rho = ess_ratio(l_n, valid)
  lr_scale = ess_lr_scale(rho, cfg.rho_on, cfg.ess_rule) if cfg.ess_lr else jnp.float32(1.0)

  def vmean(x):
    return jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(n_valid, 1.0)

  def vstd(x):
    return jnp.sqrt(vmean(jnp.square(x - vmean(x))))

  if WEIGHT_VARIANTS[cfg.is_variant].level == "token":  # a fraction of the valid rows' tokens
    clip_den = jnp.sum(jnp.where(valid, aux_n["length_n"], 0.0))
  else:
    clip_den = n_valid
  adv, base, w = aux_n["advantage_n"], aux_n["baseline_n"], aux_n["weight_n"]
  return dict(
    ess_ratio=rho,
    ess_ratio_applied=ess_ratio(aux_n["log_weight_applied_n"], valid),
    lr_scale=lr_scale,
    log_ratio_mean=vmean(l_n),
    log_ratio_max=jnp.max(jnp.where(valid, l_n, -jnp.inf)),
    log_ratio_min=jnp.min(jnp.where(valid, l_n, jnp.inf)),
    weight_max=jnp.max(w),
    weight_mean=vmean(w),
    frac_clipped=(jnp.sum(aux_n["clipped_n"]) / jnp.maximum(clip_den, 1.0)).astype(jnp.float32),
    frac_masked=(jnp.sum(aux_n["masked_n"]) / jnp.maximum(n_valid, 1.0)).astype(jnp.float32),
    baseline_mean=vmean(base),
    baseline_std=vstd(base),
    adv_mean=vmean(adv),
    adv_std=vstd(adv),
    n_valid=n_valid,
    nonfinite_rows=jnp.sum(aux_n["nonfinite_n"]).astype(jnp.float32),
    **_tis_ess_metrics(aux_n, cfg),
  )


def _tis_ess_metrics(aux_n, cfg: PGConfig) -> dict[str, jax.Array]:
  """c_t of "tis_ess" (train/tis_c, train/tis_log_c; re-solved from the [N] rows, cheap), else nothing.

  tis_ess_reached is 0 when even c = 1 cannot reach the target (then c_t = 1).
  """
  if cfg.is_variant != "tis_ess":
    return {}
  lc = jnp.clip(aux_n["log_ratio_n"], -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
  info = _policy_losses().ess_target_truncation(lc, cfg.tis_ess_target, valid_n=aux_n["valid_n"])
  return {"tis_c": info["c"], "tis_log_c": info["log_c"], "tis_ess_reached": info["reached"]}


def pg_coefficients(
  logp_nt, behavior_logp_nt, mask_nt, rewards_n, group_id_n, sq_score_norms_n, cfg: PGConfig, *, divisor=None
):
  """Per-example coefficients of the policy-gradient surrogate.

    loss(params) = - sum_n coef_n * sum_t tokw_nt * logp_nt(params)
    coef_n = A_n * w_n * per_row(L_n, T) / Z          (stop-gradient)

  Args:
    logp_nt: [N, T] learner log-probs (stop-gradient is applied here).
    behavior_logp_nt: [N, T] sampler log-probs.
    mask_nt: [N, T] loss mask; rows with an empty mask are padding, rows whose
      log-ratio l_n is NaN / +-inf are masked out too (coef 0, counted in
      nonfinite_rows).
    rewards_n: [N] rewards. group_id_n: [N] prompt group of each trajectory.
    sq_score_norms_n: [N] ||s_n||^2 with s_n = grad sum_t mask_nt logp_nt (the
      exact token-SUM score); None allowed when not needs_sq_norms(cfg). The
      variant OPOB uses is derived here: / L_n^2 if length_normalize_norms,
      * w~_n^2 in reference_mode (the reference measures the norm of the
      w~-weighted token-sum loss).
    cfg: PGConfig.
    divisor: Z to use instead of loss_divisor(rows of this batch, cfg): a
      micro-batch of whole groups passes 1.0 and the step divides its
      accumulated gradient by the whole batch's Z (the scalar metrics then
      describe the micro-batch only; pg_metrics of the stacked rows gives the
      batch's).
  Returns:
    coef_n [N] float32 and aux: scalar metrics (pg_metrics: ess_ratio of the
    unclipped weights, ess_ratio_applied, lr_scale, log_ratio_{mean,max,min},
    weight_{max,mean}, frac_clipped, frac_masked, baseline_{mean,std},
    adv_{mean,std}, n_valid, nonfinite_rows) and per-example arrays whose keys
    end in "_n" (log_ratio_n, log_weight_applied_n, weight_n, advantage_n,
    baseline_n, length_n, clipped_n, valid_n, kept_n, masked_n, nonfinite_n).
    frac_clipped: fraction of valid sequences (of tokens, for token_tis) whose
    applied non-zero weight differs from the (clamped) ratio; frac_masked:
    fraction whose applied weight is 0. For token_tis, weight_n and
    ess_ratio_applied use the product of the token weights. ess_ratio is in
    [1/n_valid, 1] (1 when no row is valid) and lr_scale in [0, 1].

  References:
    Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs, arXiv 2602.17616.
  """
  if needs_sq_norms(cfg) and sq_score_norms_n is None:
    raise ValueError(
      "sq_score_norms_n: None, but cfg.opob=True needs ||s_n||^2 (vcpo_jax.grad_norms: ghost norms or "
      "per_example_sq_grad_norms)"
    )
  rows = _pg_rows(logp_nt, behavior_logp_nt, mask_nt, rewards_n, group_id_n, sq_score_norms_n, cfg)
  z = loss_divisor(rows, cfg) if divisor is None else jnp.asarray(divisor, jnp.float32)
  coef_n = sg(rows.pop("unnormalized_coef_n") / z)
  return coef_n, dict(pg_metrics(rows, cfg), **rows)


def policy_loss_kwargs(cfg: PGConfig) -> dict[str, Any]:
  """cfg.policy_loss_kw "name=value,..." -> {name: value}: None / True / False, a number, else the string.

  E.g. "eps_high=0.28,dual_clip_c=3,loss_agg=token-mean". The names and values are checked by
  policy_losses.make_policy_loss (PGConfig.__post_init__ calls it).
  """
  kw: dict[str, Any] = {}
  special = {"None": None, "True": True, "False": False}
  for item in filter(None, (x.strip() for x in cfg.policy_loss_kw.split(","))):
    name, eq, value = (x.strip() for x in item.partition("="))
    if not eq or not name or not value:
      raise ValueError(f"PGConfig.policy_loss_kw={cfg.policy_loss_kw!r}: {item!r} is not name=value")
    if value in special:
      kw[name] = special[value]
      continue
    try:
      kw[name] = float(value)
    except ValueError:
      kw[name] = value  # a name, e.g. loss_agg=token-mean
  return kw
