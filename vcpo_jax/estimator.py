"""The math of VCPO and of the stabilizers it is compared against: pure, jittable.

Dimension legend: N trajectories, P prompts, G group size, T tokens.

Notation (PAPER.md):
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
"""

from __future__ import annotations

import dataclasses
import functools
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


def ess(log_w_n, valid_n=None):
  """Effective sample size (sum w)^2 / sum w^2 from LOG weights, in samples.

  Computed as s1^2 / s2 with s_k = sum exp(k (log w - max log w)), i.e. in log
  space: exact for any finite log-weights (|log w| up to 1e4 and beyond).
  Invariant to adding a constant to all log-weights and to permutations.

  Args:
    log_w_n: [N] log importance weights (-inf allowed: a zero weight).
    valid_n: optional [N] bool; False entries are excluded.
  Returns:
    scalar float32 in [1, n_valid] for finite inputs; 0 when no valid entry or
    every valid weight is zero.
  """
  log_w_n = sg(jnp.asarray(log_w_n, jnp.float32))
  valid_n = _valid(log_w_n, valid_n)
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

  Args / conventions as `ess`.
  """
  valid = _valid(log_w_n, valid_n)
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


def importance_weights(
  log_ratio, variant, *, c=8.0, lower=None, upper=None, lengths_n=None, log_clamp=DEFAULT_LOG_RATIO_CLAMP
):
  """Stop-gradient importance weights of a named variant (see WEIGHT_VARIANTS).

  Args:
    log_ratio: l_n [N] for sequence variants, d_nt [N, T] for "token_tis".
    variant: "none" | "is" | "tis" | "clip" | "mask" | "token_tis" | "geo_mask".
    c: truncation level for "tis" / "token_tis" (> 0).
    lower, upper: interval for "clip", "mask", "geo_mask" (0 <= lower <= upper).
    lengths_n: [N] token counts L_n, needed by "geo_mask" (ratio exp(l / L)).
    log_clamp: log-ratios are clamped to [-log_clamp, log_clamp] before exp
      (the reference uses 20), so every weight is finite.
  Returns:
    weights of the same shape as log_ratio, float32, >= 0, finite for finite
    or +-inf log-ratios; stop-gradient.
  """
  if variant not in WEIGHT_VARIANTS:
    raise ValueError(f"variant={variant!r}: choose one of {sorted(WEIGHT_VARIANTS)}")
  v = WEIGHT_VARIANTS[variant]
  if "c" in v.needs and not (c is not None and c > 0):
    raise ValueError(f"c={c!r}: variant {variant!r} needs a truncation level c > 0")
  if "lower" in v.needs and (lower is None or upper is None or not 0 <= lower <= upper or not upper > 0):
    raise ValueError(f"lower={lower!r}, upper={upper!r}: variant {variant!r} needs 0 <= lower <= upper, upper > 0")
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
  group reward std (else 1).
  """

  name: str
  baseline: Callable[..., jax.Array]
  std_normalized: bool
  doc: str


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
    AdvantageEstimator("reinforce", _batch_mean_baseline, False, "A = R - mean(R over the batch)"),
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
    std: "population" (ddof 0, as in the reference) or "sample" (ddof 1) for
      "grpo"; groups with std <= std_eps get advantage 0.
  Returns:
    advantages with the shape of `rewards`.
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


def opob_baseline(rewards_n, weights_n, sq_grad_norms_n, group_ids_n, leave_one_out=False, *, valid_n=None):
  """b_i = sum_j w_j^2 s_j R_j / sum_j w_j^2 s_j over j in i's group.

  The set excludes j = i when leave_one_out (then b_i does not depend on
  trajectory i, so the baseline term has zero mean: unbiased, review #3).
  Where the denominator is 0 (all w_j^2 s_j zero) the baseline falls back to
  the unweighted mean of R over the same set, and to 0 for an empty set. The
  weights a_j = w_j^2 s_j are formed in log space per row, so huge weights
  cannot overflow; the result is clipped into [min R, max R] of the set (a
  convex combination, guarded against rounding).

  Args:
    rewards_n: [N] values R (raw rewards for scope "group"; advantages for
      scope "minibatch", i.e. one group id).
    weights_n: [N] w >= 0: unclipped (the paper) or applied (review #1).
    sq_grad_norms_n: [N] s >= 0, the squared score norms.
    group_ids_n: [N] integer group of each trajectory.
    leave_one_out: exclude j = i from i's set.
    valid_n: optional [N] bool; invalid entries join no set (their b is 0).
  Returns:
    [N] float32 baselines, stop-gradient.
  """
  r = sg(jnp.asarray(rewards_n, jnp.float32))
  w = sg(jnp.asarray(weights_n, jnp.float32))
  s = sg(jnp.asarray(sq_grad_norms_n, jnp.float32))
  valid = _valid(r, valid_n)
  same = _same_group(group_ids_n, valid)
  if leave_one_out:
    same = same & ~jnp.eye(r.shape[0], dtype=bool)
  log_a = 2.0 * jnp.log(jnp.abs(w)) + jnp.log(jnp.abs(s))  # -inf for a zero weight
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
# Exact per-example squared gradient norms (reference path)
# ---------------------------------------------------------------------------


def _sq_norm(tree):
  return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree_util.tree_leaves(tree))


@functools.partial(jax.jit, static_argnames=("fn", "batch_size"))
def per_example_sq_grad_norms(fn, params, batch, *, batch_size=None):
  """||grad_params fn(params, example_n)||^2 for every example, [N] float32.

  Exact reference path (vmap of jax.grad, jitted with fn static: pass the
  same function object to reuse the compilation): memory is N x params, so
  pass batch_size to process examples in chunks via lax.map. Faster paths
  (ghost norms, vcpo_jax/grad_norms.py) are tested against this.

  Args:
    fn: fn(params, example) -> scalar, where `example` is `batch` with the
      leading N axis removed from every leaf.
    params: parameter pytree (not vmapped).
    batch: pytree whose leaves all have a leading N axis.
    batch_size: optional chunk size for lax.map (None: one vmap over N).
  """

  def one(example):
    return _sq_norm(jax.grad(fn)(params, example))

  if batch_size is None:
    return jax.vmap(one)(batch)
  return jax.lax.map(one, batch, batch_size=batch_size)


# ---------------------------------------------------------------------------
# The policy-gradient update: config, presets, coefficients
# ---------------------------------------------------------------------------

# Loss aggregation -> norm_n(L_n, n_valid, total_tokens): the per-trajectory
# factor of coef_n that turns sum_t logp_nt into the aggregated loss.
LOSS_AGGREGATIONS: dict[str, Callable[[jax.Array, jax.Array, jax.Array], jax.Array]] = {
  # mean over trajectories of the token-mean: 1 / (N L_n) (the paper's update)
  "seq-mean-token-mean": lambda L, n, tot: 1.0 / (jnp.maximum(n, 1.0) * jnp.maximum(L, 1.0)),
  # mean over all tokens of the batch: 1 / sum(mask)
  "token-mean": lambda L, n, tot: jnp.full_like(L, 1.0) / jnp.maximum(tot, 1.0),
  # mean over trajectories of the token-sum: 1 / N (Dr. GRPO-style, no length bias)
  "seq-mean-token-sum": lambda L, n, tot: jnp.full_like(L, 1.0) / jnp.maximum(n, 1.0),
}
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
    norm_n = 1 / (N L_n) | 1 / sum(mask) | 1 / N   (loss aggregation)
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
  log_ratio_clamp: float = DEFAULT_LOG_RATIO_CLAMP  # l clamped to [-c, c] before exp
  loss_agg: str = "seq-mean-token-mean"  # LOSS_AGGREGATIONS
  opob: bool = False  # replace the estimator's baseline by OPOB
  opob_weights: str = "unclipped"  # "unclipped" (paper) | "applied" (review #1)
  opob_leave_one_out: bool = False  # exclude i from its own baseline (unbiased)
  opob_scope: str = "group"  # "group": raw rewards per prompt; "minibatch": A over batch
  length_normalize_norms: bool = False  # ||s_n||^2 / L_n^2 (norm of the token-mean score)
  reference_mode: bool = False  # reproduce the reference: norms w~^2 ||s||^2, weights w^2
  std: str = "population"  # group std for "grpo": "population" | "sample"
  std_eps: float = 1e-6  # groups with std <= std_eps contribute nothing
  ess_lr: bool = False  # scale the step's learning rate by the ESS rule
  ess_rule: str = "sqrt"  # ESS_LR_RULES name
  rho_on: float = 1.0  # on-policy reference ESS ratio (docs/rho_on_protocol.md)

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
    choose("opob_weights", OPOB_WEIGHTS)
    choose("opob_scope", OPOB_SCOPES)
    choose("std", STD_KINDS)
    choose("ess_rule", ESS_LR_RULES)
    for f in ("tis_c", "token_tis_c", "log_ratio_clamp", "rho_on", "clip_upper", "mask_upper", "geo_upper"):
      positive(f)
    if not self.std_eps >= 0:
      raise ValueError(f"PGConfig.std_eps={self.std_eps!r}: must be >= 0")
    for lo, hi in (("clip_lower", "clip_upper"), ("mask_lower", "mask_upper"), ("geo_lower", "geo_upper")):
      if not 0 <= getattr(self, lo) <= getattr(self, hi):
        raise ValueError(f"PGConfig.{lo}={getattr(self, lo)!r}: need 0 <= {lo} <= {hi}")
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
  ess_lr=True,
  ess_rule="sqrt",
  rho_on=1.0,
)

PRESETS: dict[str, dict[str, Any]] = {
  "sync": dict(advantage="grpo", is_variant="none"),  # synchronous GRPO (run with k = 0)
  "none": dict(advantage="grpo", is_variant="none"),  # stale data, no correction
  "seq_tis": dict(advantage="grpo", is_variant="tis", tis_c=8.0),
  "clip": dict(advantage="grpo", is_variant="clip"),
  "mask": dict(advantage="grpo", is_variant="mask"),
  "token_tis": dict(advantage="grpo", is_variant="token_tis"),
  "geo_mask": dict(advantage="grpo", is_variant="geo_mask"),
  "vcpo": dict(_VCPO),
  "vcpo_no_esslr": dict(_VCPO, ess_lr=False),
  "vcpo_no_opob": dict(_VCPO, opob=False),
  "vcpo_applied_opob": dict(_VCPO, opob_weights="applied"),
  "vcpo_loo_opob": dict(_VCPO, opob_leave_one_out=True),
  "vcpo_reference": dict(_VCPO, reference_mode=True),
}


def pg_config_from_preset(name: str, **overrides) -> PGConfig:
  """PGConfig(**PRESETS[name], **overrides)."""
  if name not in PRESETS:
    raise ValueError(f"preset={name!r}: choose one of {sorted(PRESETS)}")
  return PGConfig(**{**PRESETS[name], **overrides})


def needs_sq_norms(cfg: PGConfig) -> bool:
  """Whether pg_coefficients needs the per-example squared score norms."""
  return bool(cfg.opob)


def _variant_kwargs(cfg: PGConfig):
  v = cfg.is_variant
  return dict(
    c=cfg.token_tis_c if v == "token_tis" else cfg.tis_c,
    lower={"clip": cfg.clip_lower, "mask": cfg.mask_lower, "geo_mask": cfg.geo_lower}.get(v),
    upper={"clip": cfg.clip_upper, "mask": cfg.mask_upper, "geo_mask": cfg.geo_upper}.get(v),
    log_clamp=cfg.log_ratio_clamp,
  )


def pg_token_weights(logp_nt, behavior_logp_nt, mask_nt, cfg: PGConfig):
  """tokw_nt multiplying logp_nt inside the surrogate's token sum, stop-gradient.

  mask_nt for sequence-level variants; mask_nt * min(exp(d_nt), c) for
  "token_tis" (its per-token weight cannot be folded into coef_n).
  """
  mask = jnp.asarray(mask_nt, jnp.float32)
  if WEIGHT_VARIANTS[cfg.is_variant].level != "token":
    return mask
  d_nt = token_log_ratio(logp_nt, behavior_logp_nt, mask_nt)
  return sg(mask * importance_weights(d_nt, cfg.is_variant, **_variant_kwargs(cfg)))


def pg_coefficients(logp_nt, behavior_logp_nt, mask_nt, rewards_n, group_id_n, sq_score_norms_n, cfg: PGConfig):
  """Per-example coefficients of the policy-gradient surrogate.

    loss(params) = - sum_n coef_n * sum_t tokw_nt * logp_nt(params)
    coef_n = A_n * w_n * norm_n                      (stop-gradient)

  Args:
    logp_nt: [N, T] learner log-probs (stop-gradient is applied here).
    behavior_logp_nt: [N, T] sampler log-probs.
    mask_nt: [N, T] loss mask; rows with an empty mask are padding.
    rewards_n: [N] rewards. group_id_n: [N] prompt group of each trajectory.
    sq_score_norms_n: [N] ||s_n||^2 with s_n = grad sum_t mask_nt logp_nt (the
      exact token-SUM score); None allowed when not needs_sq_norms(cfg). The
      variant OPOB uses is derived here: / L_n^2 if length_normalize_norms,
      * w~_n^2 in reference_mode (the reference measures the norm of the
      w~-weighted token-sum loss).
    cfg: PGConfig.
  Returns:
    coef_n [N] float32 and aux: scalar metrics (ess_ratio of the unclipped
    weights, ess_ratio_applied, lr_scale, log_ratio_{mean,max,min},
    weight_{max,mean}, frac_clipped, frac_masked, baseline_{mean,std},
    adv_{mean,std}, n_valid) and per-example arrays whose keys end in "_n"
    (log_ratio_n, weight_n, advantage_n, baseline_n, valid_n).
    frac_clipped: fraction of valid sequences (of tokens, for token_tis) whose
    applied non-zero weight differs from the unclipped ratio; frac_masked:
    fraction whose applied weight is 0. For token_tis, weight_n and
    ess_ratio_applied use the product of the token weights.
  """
  if needs_sq_norms(cfg) and sq_score_norms_n is None:
    raise ValueError(
      "sq_score_norms_n: None, but cfg.opob=True needs ||s_n||^2 (per_example_sq_grad_norms or the ghost-norm path)"
    )
  mask = jnp.asarray(mask_nt, jnp.float32)
  L_n = jnp.sum(mask, axis=-1)
  valid = L_n > 0
  n_valid = jnp.sum(valid).astype(jnp.float32)
  r = sg(jnp.asarray(rewards_n, jnp.float32))
  vkw = _variant_kwargs(cfg)
  variant = WEIGHT_VARIANTS[cfg.is_variant]

  l_n = sequence_log_ratio(logp_nt, behavior_logp_nt, mask_nt)
  w_unclipped = jnp.where(valid, importance_weights(l_n, "is", log_clamp=cfg.log_ratio_clamp), 0.0)
  if variant.level == "token":
    d_nt = token_log_ratio(logp_nt, behavior_logp_nt, mask_nt)
    tw = importance_weights(d_nt, cfg.is_variant, **vkw)
    log_w_applied = jnp.sum(jnp.where(mask > 0, jnp.log(tw), 0.0), axis=-1)
    w_seq = jnp.where(valid, 1.0, 0.0)  # the weight lives in tokw_nt
    clipped = jnp.sum((tw < jnp.exp(jnp.clip(d_nt, -cfg.log_ratio_clamp, cfg.log_ratio_clamp))) * mask) / jnp.maximum(
      jnp.sum(mask), 1.0
    )
    frac_masked = jnp.float32(0.0)
    weight_report = jnp.where(valid, jnp.exp(jnp.clip(log_w_applied, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)), 0.0)
  else:
    w_seq = jnp.where(valid, importance_weights(l_n, cfg.is_variant, lengths_n=L_n, **vkw), 0.0)
    log_w_applied = jnp.log(w_seq)
    changed = valid & (w_seq > 0) & ~jnp.isclose(w_seq, w_unclipped, rtol=1e-6)
    clipped = jnp.sum(changed) / jnp.maximum(n_valid, 1.0)
    frac_masked = jnp.sum(valid & (w_seq == 0)) / jnp.maximum(n_valid, 1.0)
    weight_report = w_seq

  base, scale = baseline_and_scale(r, group_id_n, cfg.advantage, valid_n=valid, std=cfg.std, std_eps=cfg.std_eps)

  def normalize(value, b):
    return jnp.where(valid & (scale > 0), (value - b) / jnp.where(scale > 0, scale, 1.0), 0.0)

  if cfg.opob:
    s_n = sg(jnp.asarray(sq_score_norms_n, jnp.float32))
    if cfg.length_normalize_norms:
      s_n = s_n / jnp.square(jnp.maximum(L_n, 1.0))
    if cfg.reference_mode:
      s_n = s_n * jnp.square(w_seq)  # norm of the w~-weighted loss: w~ enters twice
    w_b = w_unclipped if cfg.opob_weights == "unclipped" else w_seq
    if cfg.opob_scope == "group":
      base = opob_baseline(r, w_b, s_n, group_id_n, cfg.opob_leave_one_out, valid_n=valid)
      adv = normalize(r, base)
    else:
      a0 = normalize(r, base)
      base = opob_baseline(a0, w_b, s_n, jnp.zeros_like(jnp.asarray(group_id_n)), cfg.opob_leave_one_out, valid_n=valid)
      adv = jnp.where(valid, a0 - base, 0.0)
  else:
    adv = normalize(r, base)

  norm_n = LOSS_AGGREGATIONS[cfg.loss_agg](L_n, n_valid, jnp.sum(mask))
  coef_n = sg(jnp.where(valid, adv * w_seq * norm_n, 0.0))

  rho = ess_ratio(l_n, valid)
  lr_scale = ess_lr_scale(rho, cfg.rho_on, cfg.ess_rule) if cfg.ess_lr else jnp.float32(1.0)

  def vmean(x):
    return jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(n_valid, 1.0)

  def vstd(x):
    return jnp.sqrt(vmean(jnp.square(x - vmean(x))))

  base_v = jnp.where(valid, base, 0.0)
  aux = dict(
    ess_ratio=rho,
    ess_ratio_applied=ess_ratio(log_w_applied, valid),
    lr_scale=lr_scale,
    log_ratio_mean=vmean(l_n),
    log_ratio_max=jnp.max(jnp.where(valid, l_n, -jnp.inf)),
    log_ratio_min=jnp.min(jnp.where(valid, l_n, jnp.inf)),
    weight_max=jnp.max(weight_report),
    weight_mean=vmean(weight_report),
    frac_clipped=clipped.astype(jnp.float32),
    frac_masked=jnp.asarray(frac_masked, jnp.float32),
    baseline_mean=vmean(base_v),
    baseline_std=vstd(base_v),
    adv_mean=vmean(adv),
    adv_std=vstd(adv),
    n_valid=n_valid,
    log_ratio_n=l_n,
    weight_n=weight_report,
    advantage_n=adv,
    baseline_n=base_v,
    valid_n=valid,
  )
  return coef_n, aux


BATCH_KEYS = ("tokens", "behavior_logp", "loss_mask", "rewards", "group_id")


def policy_gradient(logp_fn, params, batch: Mapping[str, Any], cfg: PGConfig):
  """Gradient of the configured surrogate: the reference path.

  One forward (jax.vjp of logp_fn), coefficients from pg_coefficients, one
  backward with cotangent -coef_n * tokw_nt. When OPOB is on, the exact
  per-example squared score norms come from per_example_sq_grad_norms
  (vmap of per-example grads; the ghost-norm path is the fast alternative).

  Args:
    logp_fn: logp_fn(params, batch) -> [N, T] log-probs of batch["tokens"]
      (aligned with loss_mask); must also work on a batch with N = 1.
    params: parameter pytree.
    batch: dict with tokens [N, T], behavior_logp [N, T], loss_mask [N, T],
      rewards [N], group_id [N] (+ anything logp_fn needs); every leaf has a
      leading N axis.
    cfg: PGConfig (static under jit).
  Returns:
    (grads, metrics): grads has the structure of params; metrics is the aux
    dict of pg_coefficients plus pg_loss (the surrogate's value).
  """
  missing = [k for k in BATCH_KEYS if k not in batch]
  if missing:
    raise ValueError(f"batch: missing keys {missing}; need {list(BATCH_KEYS)}")
  logp_nt, vjp = jax.vjp(lambda p: logp_fn(p, batch), params)
  sq = None
  if needs_sq_norms(cfg):

    def score(p, example):
      ex1 = jax.tree_util.tree_map(lambda x: x[None], example)
      return jnp.sum(logp_fn(p, ex1)[0].astype(jnp.float32) * ex1["loss_mask"][0].astype(jnp.float32))

    sq = per_example_sq_grad_norms(score, params, dict(batch))
  coef_n, aux = pg_coefficients(
    logp_nt, batch["behavior_logp"], batch["loss_mask"], batch["rewards"], batch["group_id"], sq, cfg
  )
  tokw_nt = pg_token_weights(logp_nt, batch["behavior_logp"], batch["loss_mask"], cfg)
  cot_nt = -coef_n[:, None] * tokw_nt  # d loss / d logp_nt
  (grads,) = vjp(cot_nt.astype(logp_nt.dtype))
  pg_loss = jnp.sum(jnp.where(tokw_nt != 0, cot_nt * sg(logp_nt).astype(jnp.float32), 0.0))
  return grads, dict(aux, pg_loss=pg_loss)
