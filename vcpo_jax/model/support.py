"""Sampling-support replay: the sampler's kept support (top-k / top-p), recorded per token, rebuilt by the learner.

With top-k and/or top-p on, the sampler draws token y from mu = softmax over the kept set S of its scaled
logits x = logits / temperature (`sampler.filter_logits`), so its behaviour log-prob is renormalised over S,
while a learner scoring the full softmax puts mass on tokens mu never draws: log(pi / mu) != 0 on-policy.
Replay makes the learner score pi renormalised over the same support.

  sampler, per response token:  cut_x = (min_{v in S} x_v + max_{v not in S} x_v) / 2   (mid-gap)
                                support_thr = temperature * (cut_x - x_y)  <= 0    (-inf: S = every token)
  learner, logits z at the same position:
                                S' = {v : z_v >= z_y + support_thr} U {y}
                                log pi_S'(y) = z_y - logsumexp_{v in S'} z_v

One float per token (Batch.support_thr [N, R], response columns only). Why this record:
  * exact rebuild: S' = S whenever the learner's logits differ from temperature * x by less than half the
    gap between the last kept and the first dropped logit (both measured from y's): the mid-gap cut absorbs
    the float rounding between the sampler's cached decode and the learner's full forward. The filter keeps
    ties with its last kept value, so tied logits sit on the same side and the gap is never a tie; a
    threshold AT the last kept logit (or a kept count ranked by the learner) would flip at one ulp.
  * relative to the drawn token's logit: softmax ignores a constant added to every logit, and so does S'
    (an absolute logit cut would not); and y is always in S' (support_thr <= 0, and y is added explicitly),
    so log pi_S'(y) is finite under any parameters (off-policy, lag).
  * one vocabulary pass where the target logit is at hand (dense head: it is), no sort and no [.., V] record.
With temperature != 1 the learner still scores at temperature 1 (the ratio then also corrects tempering).

Shapes: N rows, T token columns, R response columns (the last R of T), M = T - 1 predicting positions, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_F32 = jnp.float32
NO_CUT = -np.inf  # support_thr of a token drawn from the whole vocabulary (and off the response)


def record_threshold(x_bv: jax.Array, x_filtered_bv: jax.Array, tok_b: jax.Array, temperature: float) -> jax.Array:
  """support_thr [B] float32 of tokens tok_b drawn from softmax(x_filtered_bv) (see the module docstring).

  Args:
    x_bv: float32 [B, V] the scaled logits logits / temperature before filtering.
    x_filtered_bv: [B, V] the same with the removed tokens at -inf (`sampler.filter_logits`).
    tok_b: int32 [B] the drawn tokens (kept ones).
    temperature: the sampler's temperature (> 0).
  """
  kept = jnp.isfinite(x_filtered_bv)
  kept_min = jnp.min(jnp.where(kept, x_bv, jnp.inf), axis=-1)
  out_max = jnp.max(jnp.where(kept, -jnp.inf, x_bv), axis=-1)
  x_y = jnp.take_along_axis(x_bv, tok_b[:, None], axis=-1)[:, 0]
  cut = jnp.where(jnp.isfinite(out_max), 0.5 * kept_min + 0.5 * out_max, -jnp.inf)
  return jnp.where(jnp.isfinite(cut), jnp.float32(temperature) * (cut - x_y), -jnp.inf).astype(_F32)


def position_thresholds(support_thr_nr: jax.Array, t: int) -> jax.Array:
  """The record at the predicting positions: [N, M], position m (predicting token m + 1) gets token m + 1's
  threshold; positions predicting prompt tokens get NO_CUT."""
  r = support_thr_nr.shape[1]
  thr = jnp.asarray(support_thr_nr, _F32)
  return jnp.pad(thr, ((0, 0), (t - r, 0)), constant_values=NO_CUT)[:, 1:]


def cut(target_logit, thr):
  """The absolute logit cut z_y + thr per position (NO_CUT stays -inf)."""
  return jnp.where(jnp.isfinite(thr), target_logit + thr, -jnp.inf)


def keep(logits_v, cols_v, y, cut_):
  """bool [..., Vc]: which of a vocab chunk's columns cols_v (logits logits_v [..., Vc]) are in S' of the
  positions with targets y [...] and absolute cuts cut_ [...]."""
  return (logits_v >= cut_[..., None]) | (cols_v == y[..., None])


def masked(logits_v, cols_v, y, cut_):
  """The logits with the columns outside S' at -inf (cut_ None: unchanged)."""
  if cut_ is None:
    return logits_v
  return jnp.where(keep(logits_v, cols_v, y, cut_), logits_v, -jnp.inf)


def replayed_logprobs(logits_ntv: jax.Array, tokens_nt: jax.Array, support_thr_nr: jax.Array | None) -> jax.Array:
  """Reference (dense [N, T, V] logits, position t predicting token t + 1): logp [N, T] of the tokens, logp[:, 0]
  = 0, renormalised over S' where support_thr_nr [N, R] is given, the full softmax otherwise."""
  lg = jnp.asarray(logits_ntv, _F32)[:, :-1]
  y = tokens_nt[:, 1:]
  z_y = jnp.take_along_axis(lg, y[..., None], axis=-1)[..., 0]
  if support_thr_nr is not None:
    c = cut(z_y, position_thresholds(support_thr_nr, tokens_nt.shape[1]))
    lg = masked(lg, jnp.arange(lg.shape[-1]), y, c)
  return jnp.pad(z_y - jax.nn.logsumexp(lg, axis=-1), ((0, 0), (1, 0)))


def support_sizes(logits_ntv: jax.Array, tokens_nt: jax.Array, support_thr_nr: jax.Array) -> jax.Array:
  """|S'| [N, M] per predicting position (diagnostics and tests; dense logits)."""
  lg = jnp.asarray(logits_ntv, _F32)[:, :-1]
  y = tokens_nt[:, 1:]
  z_y = jnp.take_along_axis(lg, y[..., None], axis=-1)[..., 0]
  c = cut(z_y, position_thresholds(support_thr_nr, tokens_nt.shape[1]))
  return jnp.sum(keep(lg, jnp.arange(lg.shape[-1]), y, c), axis=-1)
