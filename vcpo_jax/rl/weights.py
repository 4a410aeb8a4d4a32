"""Importance-weight variants: one registry, one definition each.

Every variant maps the (clamped) log-ratio to a stop-gradient weight; see
`WEIGHT_VARIANTS` and `importance_weights`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from vcpo_jax.rl.ess import DEFAULT_LOG_RATIO_CLAMP, tis_ess_log_weights

sg = jax.lax.stop_gradient

# ---------------------------------------------------------------------------
# Importance-weight variants: one registry, one definition each
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
      lambda lc, raw, L, c, a, b: jnp.exp(tis_ess_log_weights(lc, c, valid_n=L > 0)[0]),
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
      (rl.ess.ess_target_truncation, a bisection on log c; c_t >= 1).
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
# Weight variants as values: one factory per variant
# ---------------------------------------------------------------------------

# The PGConfig fields each variant's parameters map onto.
_PG_FIELDS = {
  "tis": {"c": "tis_c"},
  "token_tis": {"c": "token_tis_c"},
  "tis_ess": {"target": "tis_ess_target"},
  "clip": {"lower": "clip_lower", "upper": "clip_upper"},
  "mask": {"lower": "mask_lower", "upper": "mask_upper"},
  "geo_mask": {"lower": "geo_lower", "upper": "geo_upper"},
}


@dataclasses.dataclass(frozen=True)
class Weights:
  """A weight variant with its parameters bound: a hashable value (jit-static).

  Calling it is `importance_weights(log_ratio, variant, **params)`; build it with a factory (`tis(8.0)`,
  `clip(0.5, 2.0)`, ...), which checks the parameters as `importance_weights` does.
  """

  variant: str
  params: tuple[tuple[str, float], ...] = ()

  def __post_init__(self):
    if self.variant not in WEIGHT_VARIANTS:
      raise ValueError(f"variant={self.variant!r}: choose one of {sorted(WEIGHT_VARIANTS)}")
    p = dict(self.params)
    if "c" in p and not p["c"] > 0:
      raise ValueError(f"c={p['c']!r}: variant {self.variant!r} needs a truncation level c > 0")
    if "lower" in p and not (0 <= p["lower"] <= p["upper"] and p["upper"] > 0):
      raise ValueError(
        f"lower={p['lower']!r}, upper={p['upper']!r}: variant {self.variant!r} needs 0 <= lower <= upper"
      )
    if "target" in p and not 0 < p["target"] <= 1:
      raise ValueError(f"target={p['target']!r}: variant {self.variant!r} needs a target ESS ratio in (0, 1]")

  @property
  def level(self) -> str:
    """ "sequence" or "token" (WeightVariant.level)."""
    return WEIGHT_VARIANTS[self.variant].level

  def __call__(self, log_ratio, *, lengths_n=None, log_clamp=DEFAULT_LOG_RATIO_CLAMP):
    return importance_weights(log_ratio, self.variant, lengths_n=lengths_n, log_clamp=log_clamp, **dict(self.params))

  def pg_fields(self) -> dict[str, object]:
    """The PGConfig fields of this choice: is_variant and its parameters' fields."""
    names = _PG_FIELDS.get(self.variant, {})
    return {"is_variant": self.variant, **{names[k]: v for k, v in self.params}}


def none() -> Weights:
  """w = 1 (no correction)."""
  return Weights("none")


def is_() -> Weights:
  """w = exp(clamp(l)) (unclipped IS)."""
  return Weights("is")


def tis(c: float = 8.0) -> Weights:
  """w = min(exp(l), c) (upper-only truncated IS; c = 8 in all released runs)."""
  return Weights("tis", (("c", c),))


def tis_ess(target: float = 0.5) -> Weights:
  """w = min(exp(l), c_t), c_t solved per step so that ESS(w) / n = target (rl.ess.ess_target_truncation)."""
  return Weights("tis_ess", (("target", target),))


def clip(lower: float = 0.5, upper: float = 2.0) -> Weights:
  """w = clip(exp(l), lower, upper) (two-sided)."""
  return Weights("clip", (("lower", lower), ("upper", upper)))


def mask(lower: float = 0.5, upper: float = 2.0) -> Weights:
  """w = exp(l) if lower <= exp(l) <= upper else 0 (masked IS)."""
  return Weights("mask", (("lower", lower), ("upper", upper)))


def token_tis(c: float = 2.0) -> Weights:
  """w_nt = min(exp(d_nt), c) per token (token-level TIS)."""
  return Weights("token_tis", (("c", c),))


def geo_mask(lower: float = 0.99, upper: float = 1.01) -> Weights:
  """w = 1 if lower <= exp(l / L) <= upper else 0 (geometric-mean rejection; no reweighting)."""
  return Weights("geo_mask", (("lower", lower), ("upper", upper)))
