"""Loss aggregations: the one registry both the surrogate and the peer losses use.

With L_n = sum_t mask_nt, a row's token sum is multiplied by norm_n = per_row(L_n, T) / Z, where Z is a
whole-batch count (rows or tokens, over the valid or the kept rows: see rl.surrogate.Surrogate.mask_normalizer) or 1:

  "token-mean"              1 / sum_n L_n                (verl / AReaL / prime-rl default)
  "seq-mean-token-mean"     1 / (n L_n)                  (the VCPO paper's update; GSPO; slime's per-sample mean)
  "seq-mean-token-sum"      1 / n                        (mean of token-sums: no length bias)
  "seq-mean-token-sum-norm" 1 / T                        (SUM of token-sums over a constant T: Dr. GRPO)

n = #rows with L_n > 0. Keeping Z apart lets a micro-batched step use the per-row part inside each
micro-batch and divide the accumulated gradient by the whole batch's Z once (`surrogate.loss_divisor`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp


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
      "1 / T: SUM of token-sums over a constant T (the reference's Dr. GRPO mode; Surrogate.loss_norm_tokens)",
    ),
  ]
}


def row_norms(mask_nt, loss_agg, T=None):
  """norm_n = per_row(L_n, T) / Z over the rows with a loss token (Z >= 1). [N, T] mask -> [N].

  T: the "seq-mean-token-sum-norm" constant; None = the mask's token axis length.
  """
  agg = LOSS_AGGREGATIONS[loss_agg]
  m = jnp.asarray(mask_nt) != 0
  L = jnp.sum(m.astype(jnp.float32), axis=-1)
  per_row = agg.per_row(L, jnp.float32(m.shape[-1] if T is None else T))
  if agg.divisor == "none":
    return per_row
  z = jnp.sum(L > 0).astype(jnp.float32) if agg.divisor == "rows" else jnp.sum(L)
  return per_row / jnp.maximum(z, 1.0)


def aggregate(loss_nt, mask_nt, loss_agg="token-mean"):
  """sum_n norm_n sum_t mask_nt loss_nt (norm_n: `row_norms`). [N, T] -> scalar."""
  m = jnp.asarray(mask_nt) != 0
  return jnp.sum(row_norms(m, loss_agg) * jnp.sum(jnp.where(m, loss_nt, 0.0), axis=-1))
