"""Importance-weight variants: one registry, one definition each.

Every variant maps the (clamped) log-ratio to a stop-gradient weight. A variant is ONE decorated function,
`@variant(level)`, whose keyword-only arguments are its parameters with their defaults: the decorator
registers it in `WEIGHT_VARIANTS` and makes its name the factory, so `tis(4.0)` (or `tis(c=4.0)`) is the
hashable value `Weights("tis", (("c", 4.0),))` that a `rl.method.Method` carries. `importance_weights(
log_ratio, name, **params)` is the same computation by name. Adding a variant is that one function (and its
test); the learner, the telemetry and the config reach it through the Weights value.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from vcpo_jax.rl.ess import DEFAULT_LOG_RATIO_CLAMP, ess_target_truncation, tis_ess_log_weights

sg = jax.lax.stop_gradient

LEVELS = ("sequence", "token")


@dataclasses.dataclass(frozen=True)
class WeightVariant:
  """A registered importance-weight variant; calling it with its parameters is its factory (a `Weights`).

  level: "sequence" (input l_n [N] -> weight [N]) or "token" (input d_nt [N, T] -> weight [N, T]).
  fn(lc, raw, L, **params): the clamped log-ratio `lc`, the raw one, the token counts L_n [N] (None unless
  reads_lengths; rows with L_n = 0 are padding). batch_wide: a row's weight reads rows outside its group (the
  method then cannot be micro-batched by groups). metrics(lc_n, valid_n, **params) -> the step's extra scalar
  metrics (tis_ess's solved cap), or None.
  """

  name: str
  level: str
  fn: Callable[..., jax.Array]
  reads_lengths: bool = False
  batch_wide: bool = False
  metrics: Callable[..., dict] | None = None

  @property
  def defaults(self) -> dict[str, Any]:
    """The parameters and their defaults, read off fn's keyword-only arguments (cannot drift from it)."""
    params = inspect.signature(self.fn).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}

  @property
  def needs(self) -> tuple[str, ...]:
    """The parameter names, and "lengths_n" when fn reads L_n."""
    return tuple(self.defaults) + (("lengths_n",) if self.reads_lengths else ())

  @property
  def doc(self) -> str:
    """The first line of fn's docstring."""
    return (self.fn.__doc__ or "").strip().splitlines()[0]

  def __call__(self, *args, **kwargs) -> Weights:
    names = list(self.defaults)
    if len(args) > len(names):
      raise TypeError(f"{self.name}: takes {names}; got {len(args)} positional values")
    given = dict(zip(names, args), **kwargs)
    unknown = sorted(set(given) - set(names))
    if unknown:
      raise ValueError(f"{self.name}: unknown parameters {unknown}; it takes {names}")
    return Weights(self.name, tuple((k, given.get(k, d)) for k, d in self.defaults.items()))


WEIGHT_VARIANTS: dict[str, WeightVariant] = {}


def variant(level: str, *, reads_lengths: bool = False, batch_wide: bool = False, metrics=None):
  """Decorator: registers fn(lc, raw, L, *, **params) under its name (a trailing "_" dropped): its factory."""

  def wrap(fn):
    name = fn.__name__.rstrip("_")
    if level not in LEVELS or name in WEIGHT_VARIANTS:
      raise ValueError(f"weight variant {name!r}: level {level!r} must be one of {LEVELS}, the name new")
    WEIGHT_VARIANTS[name] = WeightVariant(name, level, fn, reads_lengths, batch_wide, metrics)
    return WEIGHT_VARIANTS[name]

  return wrap


def _inside(lc, lower, upper):
  # Compare in log space: no overflow, and lower = 0 means "no lower bound".
  lo = -jnp.inf if lower <= 0 else math.log(lower)
  return (lc >= lo) & (lc <= math.log(upper))


def _tis_ess_metrics(lc_n, valid_n, *, target):
  """c_t of "tis_ess" (train/tis_c, train/tis_log_c), re-solved from the [N] rows (cheap); tis_ess_reached is 0
  when even c = 1 cannot reach the target (then c_t = 1)."""
  info = ess_target_truncation(lc_n, target, valid_n=valid_n)
  return {"tis_c": info["c"], "tis_log_c": info["log_c"], "tis_ess_reached": info["reached"]}


# ---------------------------------------------------------------------------
# The variants (each one function; its keyword-only arguments are its parameters)
# ---------------------------------------------------------------------------


@variant("sequence")
def none(lc, raw, L):
  """w = 1 (no correction)"""
  return jnp.ones_like(lc)


@variant("sequence")
def is_(lc, raw, L):
  """w = exp(clamp(l)) (unclipped IS)"""
  return jnp.exp(lc)


@variant("sequence")
def tis(lc, raw, L, *, c=8.0):
  """w = min(exp(l), c) (upper-only truncated IS; c = 8 in all released runs)"""
  return jnp.exp(jnp.minimum(lc, math.log(c)))


@variant("sequence", reads_lengths=True, batch_wide=True, metrics=_tis_ess_metrics)
def tis_ess(lc, raw, L, *, target=0.5):
  """w = min(exp(l), c_t), c_t solved per step (bisection on log c) so that ESS(w) / n = target (rows with
  L_n = 0 are left out of the solve; rl.ess.ess_target_truncation)"""
  return jnp.exp(tis_ess_log_weights(lc, target, valid_n=L > 0)[0])


@variant("sequence")
def clip(lc, raw, L, *, lower=0.5, upper=2.0):
  """w = clip(exp(l), lower, upper) (two-sided)"""
  return jnp.clip(jnp.exp(lc), lower, upper)


@variant("sequence")
def mask(lc, raw, L, *, lower=0.5, upper=2.0):
  """w = exp(l) if lower <= exp(l) <= upper else 0 (masked IS)"""
  return jnp.where(_inside(lc, lower, upper), jnp.exp(lc), 0.0)


@variant("token")
def token_tis(lc, raw, L, *, c=2.0):
  """w_nt = min(exp(d_nt), c) per token (token-level TIS)"""
  return jnp.exp(jnp.minimum(lc, math.log(c)))


@variant("sequence", reads_lengths=True)
def geo_mask(lc, raw, L, *, lower=0.99, upper=1.01):
  """w = 1 if lower <= exp(l / L) <= upper else 0 (geometric-mean rejection; no reweighting)"""
  return jnp.where((L > 0) & _inside(raw / jnp.maximum(L, 1.0), lower, upper), 1.0, 0.0)


# ---------------------------------------------------------------------------
# A variant with its parameters bound, and the same by name
# ---------------------------------------------------------------------------


def _check_params(name: str, p: dict) -> None:
  """The parameter rules by name: c > 0; 0 <= lower <= upper, upper > 0; target in (0, 1]."""
  if "c" in p and not (p["c"] is not None and p["c"] > 0):
    raise ValueError(f"c={p['c']!r}: variant {name!r} needs a truncation level c > 0")
  if "lower" in p:
    lo, hi = p["lower"], p.get("upper")
    if lo is None or hi is None or not 0 <= lo <= hi or not hi > 0:
      raise ValueError(f"lower={lo!r}, upper={hi!r}: variant {name!r} needs 0 <= lower <= upper, upper > 0")
  if "target" in p and not (p["target"] is not None and 0 < p["target"] <= 1):
    raise ValueError(f"target={p['target']!r}: variant {name!r} needs a target ESS ratio in (0, 1]")


@dataclasses.dataclass(frozen=True)
class Weights:
  """A weight variant with its parameters bound: a hashable value (jit-static), built by the variant's factory
  (`tis(8.0)`, `clip(0.5, 2.0)`, ...). Calling it is `importance_weights(log_ratio, variant, **params)`."""

  variant: str
  params: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    if self.variant not in WEIGHT_VARIANTS:
      raise ValueError(f"variant={self.variant!r}: choose one of {sorted(WEIGHT_VARIANTS)}")
    _check_params(self.variant, dict(self.params))

  @property
  def spec(self) -> WeightVariant:
    return WEIGHT_VARIANTS[self.variant]

  @property
  def level(self) -> str:
    """ "sequence" or "token" (WeightVariant.level)."""
    return self.spec.level

  @property
  def token_cap(self) -> float | None:
    """The cap C of a token-level truncation (token_tis's c), else None: score centering's token weight."""
    return dict(self.params).get("c") if self.level == "token" else None

  def __call__(self, log_ratio, *, lengths_n=None, log_clamp=DEFAULT_LOG_RATIO_CLAMP):
    return importance_weights(log_ratio, self.variant, lengths_n=lengths_n, log_clamp=log_clamp, **dict(self.params))

  def metrics(self, lc_n, valid_n) -> dict:
    """The variant's extra step metrics (WeightVariant.metrics) at the clamped l_n [N], or {}."""
    return {} if self.spec.metrics is None else self.spec.metrics(lc_n, valid_n, **dict(self.params))


def importance_weights(log_ratio, variant, *, lengths_n=None, log_clamp=DEFAULT_LOG_RATIO_CLAMP, **params):
  """Stop-gradient importance weights of a named variant (see WEIGHT_VARIANTS).

  Args:
    log_ratio: l_n [N] for sequence variants, d_nt [N, T] for "token_tis".
    variant: a WEIGHT_VARIANTS name: "none" | "is" | "tis" | "tis_ess" | "clip" | "mask" | "token_tis" | "geo_mask".
    params: the variant's parameters (its factory's; others are ignored, so one call can pass c, lower, upper
      for every variant): c for "tis" / "token_tis" (> 0; default 8.0 here); lower, upper for "clip", "mask",
      "geo_mask" (0 <= lower <= upper, required); target for "tis_ess" (the target ESS ratio in (0, 1]: the cap
      c_t is solved for this batch, rl.ess.ess_target_truncation; default 0.5).
    lengths_n: [N] token counts L_n, needed by "geo_mask" (ratio exp(l / L)) and by "tis_ess" (rows with
      L_n = 0 are left out of its solve).
    log_clamp: log-ratios are clamped to [-log_clamp, log_clamp] before exp (the reference uses 20), so
      every weight is finite.
  Returns:
    weights of the same shape as log_ratio, float32, >= 0, finite for finite or +-inf log-ratios; stop-gradient.

  References:
    Ionides, Truncated importance sampling, J. Comput. Graph. Stat. 17(2) (2008) ("tis").
    Espeholt et al., IMPALA, arXiv 1802.01561 (2018) (truncated ratios in off-policy RL).
  """
  if variant not in WEIGHT_VARIANTS:
    raise ValueError(f"variant={variant!r}: choose one of {sorted(WEIGHT_VARIANTS)}")
  v = WEIGHT_VARIANTS[variant]
  fallback = {"c": 8.0, "lower": None, "upper": None, "target": 0.5}  # this function's historical keywords
  kw = {k: params.get(k, fallback.get(k, d)) for k, d in v.defaults.items()}
  _check_params(variant, kw)
  if v.reads_lengths and lengths_n is None:
    raise ValueError(f"lengths_n: variant {variant!r} needs the token counts L_n")
  if not log_clamp > 0:
    raise ValueError(f"log_clamp={log_clamp!r}: must be > 0")
  raw = sg(jnp.asarray(log_ratio, jnp.float32))
  lc = jnp.clip(raw, -log_clamp, log_clamp)
  L = None if lengths_n is None else jnp.asarray(lengths_n, jnp.float32)
  return sg(v.fn(lc, raw, L, **kw).astype(jnp.float32))
