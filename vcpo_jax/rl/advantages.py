"""Advantage estimators (GRPO, RLOO, Dr. GRPO, REINFORCE) and the off-policy optimal baseline (OPOB).

Pure, jittable, stop-gradient. Dimension legend: N trajectories, P prompts, G group size.

  b*    = sum_j w_j^2 ||s_j||^2 R_j / sum_j w_j^2 ||s_j||^2  OPOB baseline

GRPO's group std is a per-preset choice: the reference's GRPO uses the sample
std (torch.std, ddof 1), its OPOB path the population std (ddof 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from vcpo_jax.rl.ess import _valid

sg = jax.lax.stop_gradient

# ---------------------------------------------------------------------------
# Advantage estimators: one registry
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
  trajectory i, so the baseline term has zero mean: unbiased).
  Where the denominator is 0 (all w_j^2 s_j zero) the baseline falls back to
  the unweighted mean of R over the same set, and to 0 for an empty set. The
  weights a_j = w_j^2 s_j are formed in log space, log a_j = 2 log w_j +
  log s_j, normalised by the set's max, so no weight can overflow; the result
  is clipped into [min R, max R] of the set (a convex combination, guarded
  against rounding).

  Args:
    rewards_n: [N] values R (raw rewards for scope "group"; advantages for
      scope "minibatch", i.e. one group id).
    weights_n: [N] w >= 0: unclipped (the paper) or applied; None
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
# Advantages and OPOB as values: one factory each
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Advantage:
  """An advantage estimator with its options bound: a hashable value. Calling it is `advantages(...)`."""

  estimator: str
  std: str = "sample"  # GRPO's group std: "sample" (ddof 1, the reference's GRPO) | "population" (ddof 0, its OPOB)
  std_eps: float = 1e-6  # groups with std <= std_eps contribute nothing

  def __post_init__(self):
    if self.estimator not in ADVANTAGE_ESTIMATORS:
      raise ValueError(f"estimator={self.estimator!r}: choose one of {sorted(ADVANTAGE_ESTIMATORS)}")
    if self.std not in STD_KINDS:
      raise ValueError(f"std={self.std!r}: choose one of {STD_KINDS}")
    if not self.std_eps >= 0:
      raise ValueError(f"std_eps={self.std_eps!r}: must be >= 0")

  def __call__(self, rewards, group_ids=None, *, valid_n=None):
    return advantages(rewards, group_ids, self.estimator, valid_n=valid_n, std=self.std, std_eps=self.std_eps)


def grpo(**options) -> Advantage:
  """A = (R - group mean) / group std; options: Advantage's std ("sample", the default, or "population"), std_eps."""
  return Advantage("grpo", **options)


def rloo() -> Advantage:
  """A = R_i - mean(R_j, j != i in the group)."""
  return Advantage("rloo")


def drgrpo() -> Advantage:
  """A = R - group mean (Dr. GRPO: no std)."""
  return Advantage("drgrpo")


def reinforce() -> Advantage:
  """A = R - mean(R over the batch)."""
  return Advantage("reinforce")


OPOB_WEIGHT_KINDS = ("unclipped", "applied")
OPOB_SCOPE_KINDS = ("group", "minibatch")


@dataclasses.dataclass(frozen=True)
class Opob:
  """The OPOB baseline's options (see `opob_baseline` and surrogate.pg_coefficients): a hashable value."""

  weights: str = "unclipped"
  leave_one_out: bool = False
  scope: str = "group"
  length_normalize_norms: bool = False
  reference_mode: bool = False

  def __post_init__(self):
    if self.weights not in OPOB_WEIGHT_KINDS:
      raise ValueError(f"weights={self.weights!r}: choose one of {OPOB_WEIGHT_KINDS}")
    if self.scope not in OPOB_SCOPE_KINDS:
      raise ValueError(f"scope={self.scope!r}: choose one of {OPOB_SCOPE_KINDS}")
    if self.reference_mode and (self.weights != "unclipped" or self.length_normalize_norms):
      raise ValueError(
        "reference_mode=True fixes weights='unclipped' and length_normalize_norms=False (the reference's choices)"
      )


def opob(**options) -> Opob:
  """The off-policy optimal baseline b* (VCPO) with Opob's options (defaults there): weights "unclipped" (the
  paper) or "applied"; scope "group" (raw rewards per prompt) or "minibatch" (advantages over the batch);
  reference_mode reproduces the reference's two inconsistencies."""
  return Opob(**options)
