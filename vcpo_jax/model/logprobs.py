"""Token log-probs from the last hidden states without holding [B, T, V] logits.

    logp[b, t] = log softmax(h[b, t-1] @ W)[tokens[b, t]]   for t >= 1,   logp[b, 0] = 0

computed in chunks: `chunk` positions along T at a time (all B rows together, so a batch
sharded over ("data", "fsdp") stays sharded), and optionally `vocab_chunk` vocabulary entries at
a time inside each token chunk (an online logsumexp: running max m and sum s, lse = m + log s).
The log-softmax is float32 inside each chunk whatever the compute dtype of the matmul. Each token
chunk (and each vocab chunk) runs under `jax.checkpoint` inside a `lax.scan`, so the backward
pass recomputes one chunk's logits at a time: neither pass ever holds more than
[B, chunk, vocab_chunk] float32 logits (plus their softmax) at once.

With a "tensor" mesh axis sharding the vocabulary, leave `vocab_chunk` = 0: each device's shard
of V is then its vocab chunk and the logsumexp is reduced across "tensor" by the partitioner
(the target logit is read with a masked sum, not a gather, so it partitions over V too).

`chunk` = 0, or a chunk covering all T - 1 positions with no vocab chunking, is the dense path:
exactly today's numerics (one [B, T-1, V] float32 log-softmax).

Shape legend: B rows, T tokens, M = T - 1 predicting positions, C positions per chunk,
D model width, V vocab, Vc vocab entries per chunk.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from vcpo_jax import sharding
from vcpo_jax.model import quant, support

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class HeadSpec:
  """How the LM head turns hidden states into log-probs.

  tied: w is the embedding table [V, D] (logits = h @ w^T); else the kernel [D, V].
  chunk: positions along T per token chunk (0: all at once, the dense path).
  vocab_chunk: vocabulary entries per vocab chunk (0: the whole vocabulary at once).
  dtype: compute dtype of the head matmul (the log-softmax is always float32).
  """

  tied: bool
  chunk: int = 0
  vocab_chunk: int = 0
  dtype: Any = jnp.float32

  def __post_init__(self):
    if self.chunk < 0:
      raise ValueError(f"logprob_chunk={self.chunk}: must be >= 0 (0 = no token chunking).")
    if self.vocab_chunk < 0:
      raise ValueError(f"logprob_vocab_chunk={self.vocab_chunk}: must be >= 0 (0 = the whole vocabulary).")


def vocab_size(w: jax.Array, spec: HeadSpec) -> int:
  return w.shape[0] if spec.tied else w.shape[1]


def vocab_slice(w: jax.Array, spec: HeadSpec, start, size: int) -> jax.Array:
  """Columns start..start+size of the head: [size, D] (tied) or [D, size] (untied)."""
  return jax.lax.dynamic_slice_in_dim(w, start, size, axis=0 if spec.tied else 1)


def logits(h: jax.Array, w_part: jax.Array, spec: HeadSpec) -> jax.Array:
  """h [..., D] @ head part -> float32 logits [..., Vc], the matmul in spec.dtype."""
  return quant.dot(h.astype(spec.dtype), w_part.astype(spec.dtype), w_out_first=spec.tied).astype(_F32)


def vocab_chunks(v: int, vocab_chunk: int) -> tuple[int, int]:
  """(Vc, number of chunks); the last chunk is clamped to end at V and masks its overlap."""
  vc = v if vocab_chunk <= 0 or vocab_chunk >= v else vocab_chunk
  return vc, math.ceil(v / vc)


def chunk_columns(i, v: int, vc: int) -> tuple[jax.Array, jax.Array]:
  """(start, live [Vc] bool) of vocab chunk i: start = min(i Vc, V - Vc); columns below i Vc were
  counted by chunk i - 1 and are masked out (no padding copy of the head weights)."""
  lo = i * vc
  start = jnp.minimum(lo, v - vc)
  return start, start + jnp.arange(vc) >= lo


def _picked(lg: jax.Array, cols: jax.Array, y: jax.Array, live=None) -> jax.Array:
  """lg[..., y] by a masked sum (partitions over a sharded V, unlike a gather)."""
  hit = cols == y[..., None]
  if live is not None:
    hit = hit & live
  return jnp.sum(jnp.where(hit, lg, 0.0), axis=-1)


def _target_logit(h_c: jax.Array, y_c: jax.Array, w: jax.Array, spec: HeadSpec, v: int, vc: int, nv: int):
  """The target logit [..., C] alone: one scan over the vocab chunks (support replay needs it before the lse)."""

  @jax.checkpoint
  def body(tgt, i):
    start, live = chunk_columns(i, v, vc)
    return tgt + _picked(logits(h_c, vocab_slice(w, spec, start, vc), spec), start + jnp.arange(vc), y_c, live), None

  return jax.lax.scan(body, jnp.zeros(y_c.shape, _F32), jnp.arange(nv))[0]


def _chunk_lse_and_target(h_c: jax.Array, y_c: jax.Array, w: jax.Array, spec: HeadSpec, thr_c=None):
  """(logsumexp [..., C], target logit [..., C], cut [..., C] or None) of one token chunk, float32.

  thr_c [..., C]: support replay (model/support.py): the logsumexp runs over S' = {v : logit_v >= cut} U {y},
  cut = target logit + thr_c (with vocab chunks, the target logit takes a scan of its own first)."""
  v = vocab_size(w, spec)
  vc, nv = vocab_chunks(v, spec.vocab_chunk)
  if nv == 1:
    lg = logits(h_c, w, spec)
    tgt = _picked(lg, jnp.arange(v), y_c)
    cut = None if thr_c is None else jax.lax.stop_gradient(support.cut(tgt, thr_c))
    return jax.nn.logsumexp(support.masked(lg, jnp.arange(v), y_c, cut), axis=-1), tgt, cut
  cut = None
  if thr_c is not None:  # the support is fixed (no gradient through which tokens it holds)
    cut = jax.lax.stop_gradient(support.cut(_target_logit(h_c, y_c, w, spec, v, vc, nv), thr_c))

  @jax.checkpoint
  def body(carry, i):
    m, s, tgt = carry
    start, live = chunk_columns(i, v, vc)
    lg = jnp.where(live, logits(h_c, vocab_slice(w, spec, start, vc), spec), -jnp.inf)
    lg = support.masked(lg, start + jnp.arange(vc), y_c, cut)
    # Any m gives lse = m + log sum exp(l - m) exactly, so the running max carries no gradient.
    m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(lg, axis=-1)))
    shift = m_new
    if cut is not None:  # chunks wholly outside the support leave m = -inf (and s = 0): shift those by 0
      shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    s = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(lg - shift[..., None]), axis=-1)
    tgt = tgt + _picked(lg, start + jnp.arange(vc), y_c, live)
    return (m_new, s, tgt), None

  init = (jnp.full(y_c.shape, -jnp.inf, _F32), jnp.zeros(y_c.shape, _F32), jnp.zeros(y_c.shape, _F32))
  (m, s, tgt), _ = jax.lax.scan(body, init, jnp.arange(nv))
  return m + jnp.log(s), tgt, cut


def is_dense(spec: HeadSpec, t: int, v: int) -> bool:
  """Whether `head_logprobs` takes the dense path for T = t tokens and vocab v."""
  return (spec.chunk <= 0 or spec.chunk >= t - 1) and vocab_chunks(v, spec.vocab_chunk)[1] == 1


def head_logprobs(
  h_btd: jax.Array, w: jax.Array, tokens_bt: jax.Array, spec: HeadSpec, return_lse: bool = False, support_thr=None
):
  """Per-token log-probs [B, T] (logp[:, 0] = 0) of tokens under the head w applied to h.

  Args:
    h_btd: [B, T, D] final (normed) hidden states; position t predicts token t + 1.
    w: the head weights, [V, D] if spec.tied else [D, V].
    tokens_bt: int32 [B, T].
    spec: chunking and dtype (HeadSpec).
    return_lse: also return the float32 logsumexp [B, T - 1] of each predicting position (what
      the ghost-norm head pass needs to rebuild softmax chunks).
    support_thr: support replay (model/support.py): float32 [B, T - 1] thresholds per predicting position
      (`support.position_thresholds` of the Batch's record); the softmax is renormalised over each position's
      S' (lse is then S''s) and the absolute cuts [B, T - 1] come back too. None: the full softmax.

  Returns:
    logp [B, T] float32, or (logp, lse) with return_lse, or (logp, lse, cut) with return_lse and support_thr.
  """
  b, t, _ = h_btd.shape
  v = vocab_size(w, spec)
  # Cast once, outside the scans: an FSDP-sharded head is then all-gathered in the compute dtype; tied
  # to h so that the gather is not hoisted out of an enclosing loop (`sharding.tie`).
  h_btd, w = sharding.tie(h_btd, w)
  w = w.astype(spec.dtype)
  h_m, y_m = h_btd[:, :-1], tokens_bt[:, 1:]
  cut = None
  if is_dense(spec, t, v) and support_thr is not None:
    lse, tgt, cut = _chunk_lse_and_target(h_m, y_m, w, dataclasses.replace(spec, vocab_chunk=0), support_thr)
    logp = tgt - lse
  elif is_dense(spec, t, v):
    lg = logits(h_m, w, spec)  # [B, M, V]: today's path
    logp = jnp.take_along_axis(jax.nn.log_softmax(lg, axis=-1), y_m[..., None], axis=-1)[..., 0]
    lse = jax.nn.logsumexp(lg, axis=-1) if return_lse else None
  else:
    m = t - 1
    c = m if spec.chunk <= 0 else min(spec.chunk, m)
    nc = math.ceil(m / c)
    pad = nc * c - m  # padded positions compute junk that is sliced off
    h_c = jnp.pad(h_m, ((0, 0), (0, pad), (0, 0))).reshape(b, nc, c, -1).swapaxes(0, 1)  # [nC, B, C, D]
    y_c = jnp.pad(y_m, ((0, 0), (0, pad))).reshape(b, nc, c).swapaxes(0, 1)  # [nC, B, C]
    chunks = lambda x: jnp.pad(x, ((0, 0), (0, pad))).reshape(b, nc, c).swapaxes(0, 1)
    thr_c = jnp.zeros(y_c.shape, _F32) if support_thr is None else chunks(jnp.asarray(support_thr, _F32))

    @jax.checkpoint
    def body(_, xs):
      lse_c, tgt_c, cut_c = _chunk_lse_and_target(xs[0], xs[1], w, spec, None if support_thr is None else xs[2])
      return None, (tgt_c - lse_c, lse_c, lse_c if cut_c is None else cut_c)

    _, (logp, lse, cut) = jax.lax.scan(body, None, (h_c, y_c, thr_c))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, nc * c)[:, :m]
    logp, lse, cut = unchunk(logp), unchunk(lse), None if support_thr is None else unchunk(cut)
  logp = jnp.pad(logp, ((0, 0), (1, 0)))
  if not return_lse:
    return logp
  return (logp, lse) if support_thr is None else (logp, lse, cut)
