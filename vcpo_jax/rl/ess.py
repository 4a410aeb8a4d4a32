"""Log-ratios, effective sample size, the ESS learning-rate rule and the ESS-targeted truncation.

Pure, jittable, stop-gradient. Dimension legend: N trajectories, T tokens.

  l_n   = sum_t mask_nt * (sg[logp_nt] - behavior_logp_nt)   sequence log-ratio
  w_n   = exp(l_n)                                           sequence IS ratio
  ESS   = (sum w)^2 / sum w^2 ;  rho = ESS / N               in (0, 1]

Departures from the paper / reference implementation:
  * ESS is computed from log-weights in log space (exact for any finite l),
    not from exp(l), which overflows for long sequences and, through
    Python's min(1.0, nan) == 1.0, silently disables the brake.
  * The ESS learning-rate scale is capped at 1 and a non-finite ESS ratio
    brakes fully (scale 0) instead of not at all.
  * NaN / +inf log-weights carry no usable weight: the ESS stays in [1/n, 1]
    over the finite rows instead of NaN / 0.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

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


def log_mean_weight(log_w_n, valid_n=None):
  """log((1 / n_valid) sum_i w_i) of the UNNORMALIZED weights w_i = exp(log_w_n[i]), stop-gradient.

  The self-normalized ESS cannot see a batch whose weights all fall towards 0 together (the policy moved
  away from every sampled sequence: the gradient vanishes while ESS / N stays moderate); the mean weight,
  whose expectation under the behaviour policy is 1, falls far below 0 in log space there.

  Args:
    log_w_n: [N] log importance weights (conventions as `ess`).
    valid_n: optional [N] bool.
  Returns:
    scalar float32; -inf when no valid entry.
  """
  log_w_n = sg(jnp.asarray(log_w_n, jnp.float32))
  valid_n = _usable(log_w_n, valid_n)
  n_valid = jnp.sum(valid_n).astype(jnp.float32)
  lse = jax.nn.logsumexp(jnp.where(valid_n, log_w_n, -jnp.inf))
  return jnp.where(n_valid > 0, lse - jnp.log(jnp.maximum(n_valid, 1.0)), -jnp.inf)


def ess_lr_scale(ess_ratio, reference=1.0, rule="sqrt"):
  """Learning-rate multiplier rule(min(1, rho / rho_on)) in [0, 1].

  Capped at 1 (the reference caps in code, the paper's equation
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


# ESS-targeted truncation (VCPO tis_ess): no peer has it
# ---------------------------------------------------------------------------


def ess_target_truncation(log_w_n, target, *, valid_n=None, c_min=1.0, iters=64):
  """Per-step truncation c_t of sequence weights w_n = exp(l_n) such that ESS(min(w, c_t)) / n ~= target.

  rho(c) = (sum min(w, c))^2 / (n sum min(w, c)^2) is non-increasing in c (d log rho / dc =
  2 k (S2 - c S1) / (S1 S2) with k = #{w > c}, S2 - c S1 = sum_{w < c} w (w - c) <= 0), equal to 1 for
  c <= min w and to the untruncated rho for c >= max w. The solve is a bisection on log c in
  [log c_min, log max w] (`iters` halvings) that keeps rho(c_t) >= target: c_t is the largest cap meeting the target, to within
  (log max w - log c_min) / 2^iters in log c (below it).
  ESS is evaluated from log-weights in log space (ess_ratio), so |l| up to 1e4 cannot overflow.

  Edge cases:
    * the untruncated weights already reach the target (or c_min >= max w): c_t = max w, no truncation;
    * the target is unreachable with c >= c_min (rho(c_min) < target): c_t = c_min, `reached` = False;
      c_min = 1.0 by default, so a weight below 1 is never cut (pass a smaller c_min to allow it);
    * no valid row: c_t = c_min, rho = 1.

  Args:
    log_w_n: [N] sequence log-weights l_n (stop-gradient; clamp them first if the weights are clamped).
    target: target ESS ratio in (0, 1].
    valid_n: optional [N] bool; invalid rows are ignored.
    c_min: the smallest cap allowed (> 0).
    iters: bisection steps (static).
  Returns:
    dict of scalars: log_c, c (= exp(log_c), may overflow to inf for huge l: use log_c), ess_ratio (of the
    truncated weights), ess_ratio_raw (untruncated), reached (float 1/0).
  """
  _check(0 < target <= 1, "target", target, "the target ESS ratio must be in (0, 1]")
  _check(c_min > 0, "c_min", c_min, "must be > 0")
  _check(iters >= 1, "iters", iters, "must be >= 1")
  lw = sg(jnp.asarray(log_w_n, jnp.float32))
  valid = jnp.ones(lw.shape, bool) if valid_n is None else jnp.asarray(valid_n).astype(bool)
  valid = valid & ~jnp.isnan(lw) & (lw < jnp.inf)  # as ess: NaN / +inf carry no usable weight
  has = jnp.any(valid)
  log_cmin = jnp.float32(math.log(c_min))
  hi = jnp.max(jnp.where(valid, lw, -jnp.inf))
  hi = jnp.where(has & jnp.isfinite(hi), hi, log_cmin)

  def rho(log_c):
    return ess_ratio(jnp.minimum(lw, log_c), valid)

  rho_raw = ess_ratio(lw, valid)
  no_cut = (rho_raw >= target) | (log_cmin >= hi)
  unreachable = ~no_cut & (rho(log_cmin) < target)

  def body(_, bracket):
    lo, up = bracket
    mid = 0.5 * (lo + up)
    ok = rho(mid) >= target
    return jnp.where(ok, mid, lo), jnp.where(ok, up, mid)

  lo, _ = jax.lax.fori_loop(0, iters, body, (log_cmin, hi))
  log_c = jnp.where(no_cut, hi, jnp.where(unreachable, log_cmin, lo))
  log_c = jnp.where(has, log_c, log_cmin)
  return {
    "log_c": log_c,
    "c": jnp.exp(log_c),
    "ess_ratio": rho(log_c),
    "ess_ratio_raw": rho_raw,
    "reached": (~unreachable).astype(jnp.float32),
  }


def tis_ess_log_weights(log_w_n, target, *, valid_n=None, c_min=1.0, iters=64):
  """log of the ESS-targeted truncated weights: min(l_n, log c_t), stop-gradient, and the solve's info.

  [N] -> ([N], dict); see `ess_target_truncation`.
  """
  info = ess_target_truncation(log_w_n, target, valid_n=valid_n, c_min=c_min, iters=iters)
  return sg(jnp.minimum(jnp.asarray(log_w_n, jnp.float32), info["log_c"])), info


# ---------------------------------------------------------------------------
# The gradient through a model: one forward, one backward (what the learner calls)
# ---------------------------------------------------------------------------


def _check(cond, field, value, fix):
  if not cond:
    raise ValueError(f"{field}={value!r}: {fix}")


@dataclasses.dataclass(frozen=True)
class EssLr:
  """The ESS learning-rate rule as a value: calling it is ess_lr_scale(rho, rho_on, rule)."""

  rule: str = "sqrt"
  rho_on: float = 1.0

  def __post_init__(self):
    if self.rule not in ESS_LR_RULES:
      raise ValueError(f"rule={self.rule!r}: choose one of {sorted(ESS_LR_RULES)}")
    if not self.rho_on > 0:
      raise ValueError(f"rho_on={self.rho_on!r}: must be > 0 (docs/rho_on_protocol.md)")

  def __call__(self, ess_ratio):
    return ess_lr_scale(ess_ratio, self.rho_on, self.rule)


def ess_lr(*args, **options) -> EssLr:
  """Scale the step's learning rate by rule(min(1, rho / rho_on)); EssLr's rule, rho_on (VCPO: "sqrt", 1)."""
  return EssLr(*args, **options)
