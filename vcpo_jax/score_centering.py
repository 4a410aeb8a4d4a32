"""Score centering: cancel the drift term of an off-policy policy gradient (Marek & Ryabinin, arXiv 2609.20807).

Dimension legend: N rows (= B), T tokens, K head size (the sampler's top-k), V vocab, D model width.

When the tokens were sampled from q (the behaviour policy mu: a stale version in lag mode, the sampler's
own numerics in async mode) and the learner's policy is p, the expected policy gradient at one position
splits into

    E_q[A grad log p_y] = E_q[A] sum_v q_v grad log p_v  +  Cov_q(A, grad log p_y)
                          (drift: pulls p toward q, no reward information)   (signal)

Score centering subtracts the expected score sum_v q_v grad log p_v from each token's score. With a token
weight w(r) = min(r, C) (TIS, cap C = max_ratio) or w = 1 (max_ratio None), the token's score becomes

    w(p_y / q_y) log p_y  -  sum_v sg[c_v] log p_v                                  (per position)

    head H (the sampler's top-k ids), tails p_tail = 1 - sum_H p, q_tail = 1 - sum_H q (floored at 1e-6),
    rho   = q_tail / p_tail,   alpha = rho * w(1 / rho) = min(1, C rho)  (= rho when uncapped)
    c_v   = q_v w(p_v / q_v) - alpha p_v = min(p_v, C q_v) - alpha p_v   (= q_v - rho p_v when uncapped)

The tail outside H is modelled as p rescaled to q's tail mass (exact when q_v = rho p_v there). Then
E_{y~q}[w(p_y/q_y) grad log p_y] - sum_v c_v grad log p_v = alpha sum_v p_v grad log p_v = 0: the drift is gone,
whatever A's mean; p = q gives c = 0, the plain policy gradient. Hand example (K = 2, uncapped):
q_H = [0.5, 0.3], p_H = [0.4, 0.4], tails 0.2 and 0.2, rho = 1, c = [0.1, -0.1].

Two sources of q (the same formula): exact (`exact_correction`: q's full distribution from the behaviour
parameters, H = the vocabulary, alpha = 1, chunked like model/logprobs.py, never [B, T, V]) and top-k
(`topk_correction`: the sampler's recorded top-k ids and log-probs, post temperature / filters, with the
learner's log-probs at those ids, `head_logprobs_at`; K = V equals the exact form).

Stop-gradients: c_v, w constant (sg), log p_v differentiated: the gradient wrt the head's logits is c - (sum_H c) p_H.

Composition (`centered_surrogate`): a row coefficient coef_n (A_n x the applied sequence weight / divisor: VCPO's
TIS, OPOB and ESS rate act unchanged) multiplies the centered score, loss = -sum_nt mask coef_n (tokw_nt log p_nt
- corr_nt). Departure from the peers: they center a token-mean REINFORCE loss; here it is a VCPO surrogate term.

Sources: torchtitan torchtitan/rl/losses/score_centering.py `ScoreCenteringLoss` (max_ratio, the 1e-6 tail
floor, the metrics); the reference in github.com/martin-marek/score-centering (README); verl
verl/trainer/ppo/score_centering.py; prime-rl `ScoreCenteringLoss`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from vcpo_jax import batch as batch_lib
from vcpo_jax import grad_norms
from vcpo_jax.model import logprobs as lpm
from vcpo_jax.model import support, transformer

sg = jax.lax.stop_gradient
_F32 = jnp.float32
# The peers' floor on the mass outside the head: 1 - sum_H can round to <= 0 in float32.
MIN_TAIL_MASS = 1e-6


def _check_ratio(max_ratio):
  if max_ratio is not None and not max_ratio >= 1.0:
    raise ValueError(f"max_ratio={max_ratio!r}: the token-weight cap must be >= 1 (or None: w = 1)")


def token_weight(logp, logq, max_ratio=None):
  """w(p / q) = min(p / q, C) (1 where max_ratio is None), stop-gradient; log-ratio clamped to +-20."""
  _check_ratio(max_ratio)
  lr = jnp.clip(sg(jnp.asarray(logp, _F32)) - sg(jnp.asarray(logq, _F32)), -20.0, 20.0)
  if max_ratio is None:
    return jnp.ones_like(lr)
  return jnp.minimum(jnp.exp(lr), max_ratio)


def head_coefficients(p_head, q_head, max_ratio=None, *, tail=True):
  """The centering coefficients c [..., K] on the head, and alpha [...], stop-gradient.

    rho = max(1 - sum q_H, 1e-6) / max(1 - sum p_H, 1e-6)
    uncapped: c = q_H - rho p_H;   capped (C): c = min(p_H, C q_H) - min(1, C rho) p_H

  Args:
    p_head: [..., K] the learner's probabilities at the head ids (only the value is used).
    q_head: [..., K] the behaviour probabilities at the same ids.
    max_ratio: the cap C of the token weight, or None.
    tail: False when the head is the whole vocabulary (exact q): no tail to model, alpha = 1.
  Returns:
    (c [..., K], alpha [...]).
  """
  _check_ratio(max_ratio)
  p = sg(jnp.asarray(p_head, _F32))
  q = sg(jnp.asarray(q_head, _F32))
  if tail:
    rho = jnp.maximum(1.0 - jnp.sum(q, -1), MIN_TAIL_MASS) / jnp.maximum(1.0 - jnp.sum(p, -1), MIN_TAIL_MASS)
  else:
    rho = jnp.ones(p.shape[:-1], _F32)
  if max_ratio is None:
    return q - rho[..., None] * p, rho
  alpha = jnp.minimum(1.0, max_ratio * rho)
  return jnp.minimum(p, max_ratio * q) - alpha[..., None] * p, alpha


def topk_correction(head_logp, q_head_logp, max_ratio=None, mask=None):
  """corr = sum_k sg[c_k] log p_k over the sampler's top-k head, and its diagnostics.

  Args:
    head_logp: [N, T, K] the learner's log-probs at the sampler's top-k ids (differentiable).
    q_head_logp: [N, T, K] the sampler's log-probs of those ids (post temperature / filters).
    max_ratio: cap C of the token weight, or None.
    mask: optional [N, T]; 0 positions get corr = 0 and no gradient (their top-k rows may be garbage).
  Returns:
    (corr [N, T], dict of [N, T] diagnostics: p_head_mass, q_head_mass, coef_l1 = sum_k |c_k|).
  """
  lp = jnp.asarray(head_logp, _F32)
  lq = jnp.asarray(q_head_logp, _F32)
  m = jnp.ones(lp.shape[:-1], bool) if mask is None else jnp.asarray(mask) != 0
  lp = jnp.where(m[..., None], lp, 0.0)
  lq = jnp.where(m[..., None], lq, 0.0)
  p, q = jnp.exp(sg(lp)), jnp.exp(lq)
  c, _ = head_coefficients(p, q, max_ratio)
  # An id with p = 0 (off the learner's replayed support, model/support.py) adds no term; its q stays in the head.
  off = jnp.isneginf(sg(lp))
  c = jnp.where(m[..., None] & ~off, c, 0.0)
  corr = jnp.sum(sg(c) * jnp.where(off, 0.0, lp), axis=-1)
  zero = lambda x: jnp.where(m, x, 0.0)
  return corr, dict(
    p_head_mass=zero(jnp.sum(p, -1)), q_head_mass=zero(jnp.sum(q, -1)), coef_l1=zero(jnp.sum(jnp.abs(c), -1))
  )


def _exact_chunk(h_c, hq_c, w, wq, spec: lpm.HeadSpec, max_ratio):
  """One token chunk of `exact_correction`: corr [..., C], coef_l1 [..., C], kl_qp [..., C]."""
  v = lpm.vocab_size(w, spec)
  vc, nv = lpm.vocab_chunks(v, spec.vocab_chunk)

  def coefs(lp_v, lq_v):
    p, q = jnp.exp(sg(lp_v)), jnp.exp(lq_v)
    if max_ratio is None:
      return q - p, p, q
    return jnp.minimum(p, max_ratio * q) - p, p, q

  if nv == 1:
    lp_v = jax.nn.log_softmax(lpm.logits(h_c, w, spec), axis=-1)
    lq_v = sg(jax.nn.log_softmax(lpm.logits(hq_c, wq, spec), axis=-1))
    c, _, q = coefs(lp_v, lq_v)
    corr = jnp.sum(sg(c) * lp_v, -1)
    return corr, jnp.sum(jnp.abs(c), -1), sg(jnp.sum(q * (lq_v - lp_v), -1))

  # Two passes over vocabulary chunks: the logsumexps first, then the sums that need log p_v.
  def lse_pass(hh, ww):
    @jax.checkpoint
    def body(carry, i):
      mx, s = carry
      start, live = lpm.chunk_columns(i, v, vc)
      lg = jnp.where(live, lpm.logits(hh, lpm.vocab_slice(ww, spec, start, vc), spec), -jnp.inf)
      m_new = sg(jnp.maximum(mx, jnp.max(lg, axis=-1)))
      s = s * jnp.exp(mx - m_new) + jnp.sum(jnp.exp(lg - m_new[..., None]), axis=-1)
      return (m_new, s), None

    shape = hh.shape[:-1]
    (mx, s), _ = jax.lax.scan(body, (jnp.full(shape, -jnp.inf, _F32), jnp.zeros(shape, _F32)), jnp.arange(nv))
    return mx + jnp.log(s)

  lse_p = lse_pass(h_c, w)
  lse_q = sg(lse_pass(hq_c, wq))

  @jax.checkpoint
  def body(carry, i):
    corr, l1, kl = carry
    start, live = lpm.chunk_columns(i, v, vc)
    lp_v = lpm.logits(h_c, lpm.vocab_slice(w, spec, start, vc), spec) - lse_p[..., None]
    lq_v = sg(lpm.logits(hq_c, lpm.vocab_slice(wq, spec, start, vc), spec) - lse_q[..., None])
    c, _, q = coefs(lp_v, lq_v)
    c = jnp.where(live, c, 0.0)
    corr = corr + jnp.sum(sg(c) * jnp.where(live, lp_v, 0.0), -1)
    l1 = l1 + jnp.sum(jnp.abs(c), -1)
    kl = kl + sg(jnp.sum(jnp.where(live, q * (lq_v - lp_v), 0.0), -1))
    return (corr, l1, kl), None

  z = jnp.zeros(h_c.shape[:-1], _F32)
  (corr, l1, kl), _ = jax.lax.scan(body, (z, z, z), jnp.arange(nv))
  return corr, l1, kl


def exact_correction(h_btd, hq_btd, w, wq, spec: lpm.HeadSpec, max_ratio=None):
  """corr [B, T] = sum_v sg[c_v] log p_v with q's full distribution (no tail model), corr[:, 0] = 0.

  Position t's correction uses the hidden states at t - 1 (as `model.logprobs.head_logprobs`): p =
  softmax(h[:, t-1] @ W), q = softmax(hq[:, t-1] @ Wq), c_v = q_v - p_v (uncapped) or min(p_v, C q_v) - p_v.
  Chunked like head_logprobs: `spec.chunk` positions at a time (each chunk under jax.checkpoint in a
  lax.scan, so the backward recomputes one chunk's logits), and `spec.vocab_chunk` vocabulary entries at a
  time in two passes (the logsumexps, then the sums): at most [B, chunk, vocab_chunk] float32 logits of
  each policy at once.

  Args:
    h_btd: [B, T, D] final hidden states of the current parameters (differentiable).
    hq_btd: [B, T, D] final hidden states of the behaviour parameters (stop-gradient).
    w, wq: the current and behaviour head weights ([V, D] tied or [D, V]).
    spec: lpm.HeadSpec (tied, chunk, vocab_chunk, dtype).
    max_ratio: cap C of the token weight, or None.
  Returns:
    (corr [B, T], dict: coef_l1 [B, T] = sum_v |c_v|, kl_qp [B, T] = KL(q || p) exactly), both 0 at t = 0.
  """
  _check_ratio(max_ratio)
  hq_btd, wq = sg(hq_btd), sg(wq)
  h, hq = h_btd[:, :-1], hq_btd[:, :-1]
  b, m = h.shape[0], h.shape[1]
  c = m if spec.chunk <= 0 or spec.chunk >= m else spec.chunk
  if c == m:
    corr, l1, kl = _exact_chunk(h, hq, w, wq, spec, max_ratio)
  else:
    n = math.ceil(m / c)
    pad = n * c - m
    hp = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    hqp = jnp.pad(hq, ((0, 0), (0, pad), (0, 0)))
    # chunks along T: [n, B, C, D]
    hc = jnp.moveaxis(hp.reshape(b, n, c, -1), 1, 0)
    hqc = jnp.moveaxis(hqp.reshape(b, n, c, -1), 1, 0)

    @jax.checkpoint
    def body(_, xs):
      return None, _exact_chunk(xs[0], xs[1], w, wq, spec, max_ratio)

    _, (corr, l1, kl) = jax.lax.scan(body, None, (hc, hqc))
    corr, l1, kl = (jnp.moveaxis(x, 0, 1).reshape(b, n * c)[:, :m] for x in (corr, l1, kl))
  z = jnp.zeros((b, 1), _F32)
  return jnp.concatenate([z, corr], 1), dict(coef_l1=jnp.concatenate([z, l1], 1), kl_qp=jnp.concatenate([z, kl], 1))


def head_logprobs_at(h_btd, w, ids_btk, spec: lpm.HeadSpec, tokens_bt=None, support_thr=None):
  """The learner's log-probs at given ids per position: [B, T, K], row t from h[:, t-1] (row 0 = 0).

  Dense per token chunk ([B, C, V] logits at a time with spec.chunk; no vocab chunking): what
  `topk_correction` differentiates. ids_btk[:, t] are the sampler's top-k ids for the token at t.
  support_thr [B, R] (with tokens_bt [B, T]): support replay, the distribution renormalised over each
  position's replayed support (model/support.py; -inf at ids off it).
  """
  h = h_btd[:, :-1]
  ids = ids_btk[:, 1:]
  lg = lpm.logits(h, w, spec)
  if support_thr is not None:
    y = tokens_bt[:, 1:]
    z_y = jnp.take_along_axis(lg, y[..., None], axis=-1)[..., 0]
    c = sg(support.cut(z_y, support.position_thresholds(support_thr, tokens_bt.shape[1])))
    lg = support.masked(lg, jnp.arange(lg.shape[-1]), y, c)
  lg = jax.nn.log_softmax(lg, axis=-1)
  out = jnp.take_along_axis(lg, ids.astype(jnp.int32), axis=-1)
  return jnp.concatenate([jnp.zeros_like(out[:, :1]), out], 1)


def centered_surrogate(logp_nt, correction_nt, coef_n, tokw_nt, mask_nt):
  """-sum_nt mask coef_n (tokw_nt log p_nt - corr_nt): the estimator's surrogate with centered scores.

  coef_n [N] (stop-gradient) carries the advantage, the applied sequence weight and 1 / divisor (VCPO's
  pg_coefficients); tokw_nt [N, T] the token weight (mask, or `token_weight` for TIS+SC). With
  correction_nt = 0 this is the plain surrogate -sum coef tokw log p.
  """
  m = jnp.asarray(mask_nt) != 0
  lp = jnp.where(m, jnp.asarray(logp_nt, _F32), 0.0)
  corr = jnp.where(m, jnp.asarray(correction_nt, _F32), 0.0)
  coef = sg(jnp.asarray(coef_n, _F32))[:, None]
  tokw = sg(jnp.where(m, jnp.asarray(tokw_nt, _F32), 0.0))
  return -jnp.sum(coef * (tokw * lp - corr))


def drift_metrics(logp_nt, behavior_logp_nt, mask_nt, diag):
  """Scalar drift diagnostics over the loss tokens: k1 = mean(log q_y - log p_y) (estimates KL(q || p)),
  and the token means of every [N, T] entry of diag (coef_l1, head masses, exact kl_qp)."""
  m = jnp.asarray(mask_nt) != 0
  n = jnp.maximum(jnp.sum(m), 1).astype(_F32)
  mean = lambda x: jnp.sum(jnp.where(m, sg(jnp.asarray(x, _F32)), 0.0)) / n
  out = {"k1_kl_qp": mean(jnp.asarray(behavior_logp_nt, _F32) - jnp.asarray(logp_nt, _F32))}
  out.update({k: mean(v) for k, v in diag.items()})
  return out


# ---------------------------------------------------------------------------
# Through the model: exact centering composed with the estimator's surrogate (VCPO, TIS, OPOB, ESS rate)
# ---------------------------------------------------------------------------


def _head(model):
  """(w, HeadSpec) of a Transformer's LM head, as Transformer.head_logprobs uses it."""
  tied = model.lm_head is None
  w = model.embed_tokens.embedding[...] if tied else model.lm_head.kernel[...]
  cfg = model.cfg
  return w, lpm.HeadSpec(tied, cfg.logprob_chunk, cfg.logprob_vocab_chunk, cfg.compute_dtype)


def _both_versions(graphdef, params, behavior_params, batch):
  """(logp_nt of the sampled tokens, h, h_q, head w, w_q, head spec): one forward of the learner's params and
  one of the behaviour version's (stop-gradient), on the same batch."""
  from flax import nnx

  tokens = batch["tokens"]
  positions, mask = transformer.padded_positions_and_mask(batch["valid_mask"])
  model = nnx.merge(graphdef, params)
  h, _ = model(tokens, positions, mask, hidden=True)
  logp = model.head_logprobs(h, tokens)
  behaviour = nnx.merge(graphdef, jax.tree.map(sg, behavior_params))
  hq, _ = behaviour(tokens, positions, mask, hidden=True)
  (w, spec), (wq, _) = _head(model), _head(behaviour)
  return logp, h, hq, w, wq, spec


def make_centered_logp_fn(graphdef, max_ratio=None):
  """f(params, behavior_params, batch) -> (logp_nt [N, T], corr_nt [N, T], diag of [N, T]).

  One forward of the current parameters (log-probs of batch["tokens"], as learner.make_logp_fn) and one
  of the behaviour parameters (stop-gradient; in lag mode the version that sampled the batch, from the
  parameter ring), then `exact_correction` from both final hidden states, chunked as the model's config
  chunks its log-probs (logprob_chunk, logprob_vocab_chunk).
  """

  def fn(params, behavior_params, batch):
    logp, h, hq, w, wq, spec = _both_versions(graphdef, params, behavior_params, batch)
    corr, diag = exact_correction(h, hq, w, wq, spec, max_ratio)
    return logp, corr, diag

  return fn


def make_topk_centered_logp_fn(graphdef, topk: int, max_ratio=None):
  """As `make_centered_logp_fn`, with q known only on its top-k ids (the tail modelled): the head is the
  behaviour version's own top-k at each position, what a sampler at temperature 1 without filters records.

  Dense per position ([N, T, V] logits of each version): for small vocabularies (tests, the pure-lag
  testbed); a sampler-recorded head enters through `topk_correction` directly. diag: coef_l1, q_head_mass,
  p_head_mass.
  """

  if topk < 1:
    raise ValueError(f"topk={topk}: must be >= 1")

  def fn(params, behavior_params, batch):
    tokens = batch["tokens"]
    logp, h, hq, w, wq, spec = _both_versions(graphdef, params, behavior_params, batch)
    v = lpm.vocab_size(w, spec)
    every_id = jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), tokens.shape + (v,))
    lq_head, ids = jax.lax.top_k(sg(head_logprobs_at(hq, wq, every_id, spec)), min(topk, v))
    corr, diag = topk_correction(head_logprobs_at(h, w, ids, spec), lq_head, max_ratio, batch["loss_mask"])
    return logp, corr, diag

  return fn


def centered_gradient(centered_logp_fn, params, behavior_params, batch, method, *, divisor=None):
  """Gradient of the estimator's surrogate with exactly centered scores (the vmap reference path).

    (logp_nt, corr_nt), vjp = jax.vjp(centered_logp_fn(., behavior_params, batch), params)
    S_n         = ||grad_params sum_t mask_nt (logp_nt - corr_nt)||^2    (OPOB only: the CENTERED score)
    coef_n, aux = method.coefficients(sg(logp_nt), ..., S_n)             (A, TIS, OPOB; lr_scale from ESS)
    tokw_nt     = method.token_weights(...)
    grads       = vjp(-coef_n tokw_nt, +coef_n mask_nt)  =  grad of -sum coef_n (tokw log p - corr)

  method: an rl.method.Method. centered_logp_fn: `make_centered_logp_fn(graphdef, method.centering[1])`. The ESS, its lr scale and the
  sequence weights are those of the estimator (the ratios p / q of the sampled tokens); centering changes
  only the score each weight multiplies. With behavior_params = params, corr = 0 and this is the plain
  estimator gradient (tested against learner's vmap path). Returns (grads, aux): aux = the estimator's
  aux, pg_loss, and the drift metrics `drift/*` (k1_kl_qp, kl_qp, coef_l1).
  """
  mask = jnp.asarray(batch["loss_mask"], _F32)
  (logp_nt, corr_nt, diag), vjp = jax.vjp(lambda p: centered_logp_fn(p, behavior_params, batch), params)
  sq = None
  if method.needs_sq_norms:

    def score(p, example):
      ex1 = jax.tree.map(lambda x: x[None], example)
      lp, corr, _ = centered_logp_fn(p, behavior_params, ex1)
      return jnp.sum((lp[0].astype(_F32) - corr[0]) * ex1["loss_mask"][0].astype(_F32))

    sq = grad_norms.per_example_sq_grad_norms(score, params, dict(batch))
  coef_n, aux = method.coefficients(
    sg(logp_nt), batch["behavior_logp"], mask, batch["rewards"], batch["group_id"], sq, divisor=divisor
  )
  tokw = method.token_weights(sg(logp_nt), batch["behavior_logp"], mask)
  cot_lp = -coef_n[:, None] * tokw
  cot_corr = coef_n[:, None] * mask
  zero_diag = jax.tree.map(jnp.zeros_like, diag)
  (grads,) = vjp((cot_lp.astype(logp_nt.dtype), cot_corr, zero_diag))
  lp_val = jnp.where(tokw != 0, sg(logp_nt).astype(_F32), 0.0)
  pg_loss = jnp.sum(cot_lp * lp_val + cot_corr * sg(corr_nt))
  drift = drift_metrics(sg(logp_nt), batch["behavior_logp"], mask, diag)
  out = dict(aux, pg_loss=pg_loss, **{f"drift/{k}": v for k, v in drift.items()})
  if sq is not None:
    out["sq_norm_n"] = sq
  return grads, out


# ---------------------------------------------------------------------------
# The learner's step: the centering of one (micro-)batch, for the vmap and the ghost gradient paths
# ---------------------------------------------------------------------------


def _masked_neg(c, keep_nm):
  """e = -c where the position is a loss position (keep_nm [N, M] bool, broadcast over the ids), else 0."""
  return jnp.where(keep_nm[..., None], -c, 0.0)


def exact_head_coefficients(hq_btd, wq, spec: lpm.HeadSpec, loss_mask_nt, max_ratio=None):
  """grad_norms.HeadCoefficients of exact centering: e_v = -sg[c_v] at every predicting position.

  q = softmax(hq[:, m] @ Wq) (the behaviour version's final hidden states, rebuilt chunk by chunk from
  hq, Wq and its logsumexp, never [N, M, V]); given the learner's log p there, c_v = q_v - p_v (uncapped)
  or min(p_v, C q_v) - p_v, as `exact_correction`; 0 where loss_mask_nt[:, m + 1] is 0.
  """
  _check_ratio(max_ratio)
  hq_btd, wq = sg(hq_btd), sg(wq)
  n, t = hq_btd.shape[:2]
  _, lse_q = lpm.head_logprobs(hq_btd, wq, jnp.zeros((n, t), jnp.int32), spec, return_lse=True)  # [N, M]
  hq = hq_btd[:, :-1]
  wq = wq.astype(spec.dtype)
  keep = jnp.asarray(loss_mask_nt)[:, 1:] != 0

  def coef(lq, lp):
    p, q = jnp.exp(sg(lp)), jnp.exp(lq)
    return _masked_neg(q - p if max_ratio is None else jnp.minimum(p, max_ratio * q) - p, keep)

  def chunk(start, vc, lp):
    return coef(lpm.logits(hq, lpm.vocab_slice(wq, spec, start, vc), spec) - lse_q[..., None], lp)

  def at(ids_nk, lp):
    rows = jnp.take(wq if spec.tied else wq.T, ids_nk, axis=0, mode="clip")  # [N, K, D]
    lg = jnp.einsum("nmd,nkd->nmk", hq.astype(spec.dtype), rows, preferred_element_type=_F32)
    return coef(lg - lse_q[..., None], lp)

  return grad_norms.HeadCoefficients(chunk, at)


def topk_head_coefficients(
  h_btd,
  w,
  lse_nm,
  spec: lpm.HeadSpec,
  topk_ids_nrk,
  topk_logp_nrk,
  loss_mask_nt,
  max_ratio=None,
  cut_nm=None,
  tokens_nt=None,
):
  """grad_norms.HeadCoefficients of top-k centering: e = -sg[c] at the sampler's K ids of each position, 0 elsewhere.

  c = head_coefficients(p_H, q_H), the tail folded into the head as in `topk_correction`; p_H = the learner's
  probabilities at the ids, read from its final hidden states h, head W and logsumexp lse [N, M] (the ghost
  forward's record) in one scan over vocab chunks (never [N, M, V] or [N, M, K, D]); q_H = exp(topk_logp).
  The record covers the R response columns (Batch.topk_ids [N, R, K]): response token r is token column
  T - R + r, predicted by position o + r with o = M - R, so only those R positions are read; e = 0 at the
  positions before o and where the loss mask of the predicted token is 0. cut_nm [N, M] (support replay, the
  head record's cuts, model/support.py; with the tokens tokens_nt): p_H = 0 at ids below a position's cut
  (other than its token).
  """
  _check_ratio(max_ratio)
  ids = jnp.asarray(topk_ids_nrk, jnp.int32)  # [N, R, K]
  o = h_btd.shape[1] - 1 - ids.shape[1]  # the first position predicting a response token
  h, w = sg(h_btd)[:, o:-1], sg(w).astype(spec.dtype)  # [N, R, D]
  lse_nm = lse_nm[:, o:]
  if cut_nm is not None:
    y_r, cut_r = jnp.asarray(tokens_nt, jnp.int32)[:, o + 1 :], sg(cut_nm)[:, o:]
  keep = jnp.asarray(loss_mask_nt)[:, o + 1 :] != 0
  before = lambda x: jnp.pad(x, ((0, 0), (o, 0)) + ((0, 0),) * (x.ndim - 2))  # [N, R, ...] -> [N, M, ...]
  v = lpm.vocab_size(w, spec)
  vc, nv = lpm.vocab_chunks(v, spec.vocab_chunk)

  def pick(lp_at, i):  # the learner's log-probs at the ids that fall in vocab chunk i
    start, _ = lpm.chunk_columns(i, v, vc)
    lg = lpm.logits(h, lpm.vocab_slice(w, spec, start, vc), spec)
    got_lg = jnp.take_along_axis(lg, jnp.clip(ids - start, 0, vc - 1), axis=-1)
    got = got_lg - lse_nm[..., None]
    if cut_nm is not None:  # support replay: p = 0 off the replayed support
      got = jnp.where(support.keep(got_lg, ids, y_r, cut_r), got, -jnp.inf)
    return jnp.where((ids >= i * vc) & (ids < start + vc), got, lp_at), None

  lp_at, _ = jax.lax.scan(pick, jnp.zeros(ids.shape, _F32), jnp.arange(nv))
  lp_at = jnp.where(keep[..., None], lp_at, 0.0)
  lq = jnp.where(keep[..., None], jnp.asarray(topk_logp_nrk, _F32), 0.0)
  c, _ = head_coefficients(jnp.exp(lp_at), jnp.exp(lq), max_ratio)
  c = jnp.where(jnp.isneginf(lp_at), 0.0, c)  # support replay: an id off the learner's support adds no term
  e = _masked_neg(c, keep)  # [N, M, K]
  n_i, m_i = jnp.arange(ids.shape[0])[:, None, None], o + jnp.arange(ids.shape[1])[None, :, None]

  def chunk(start, size, lp):  # e scattered onto the chunk's columns (the caller masks columns it does not own)
    local = ids - start
    inside = (local >= 0) & (local < size)
    col = jnp.where(inside, local, size)  # out of range: dropped
    return jnp.zeros(lp.shape, _F32).at[n_i, m_i, col].add(jnp.where(inside, e, 0.0), mode="drop")

  def at(ids_nk, lp):  # e at per-row ids [N, K'] for every position: one [N, M, K'] compare per top-k slot
    def body(acc, k):
      return acc + jnp.where(ids[:, :, k, None] == ids_nk[:, None, :], e[:, :, k, None], 0.0), None

    acc, _ = jax.lax.scan(body, jnp.zeros(lp[:, o:].shape, _F32), jnp.arange(ids.shape[-1]))
    return before(acc)

  masses = dict(p_head_mass=jnp.sum(jnp.exp(lp_at), -1), q_head_mass=jnp.sum(jnp.exp(lq), -1))
  return grad_norms.HeadCoefficients(chunk, at, {k: before(jnp.where(keep, v, 0.0)) for k, v in masses.items()})


class StepCentering:
  """Score centering of one learner step ('exact': q recomputed from the behaviour version), built per step.

    behavior_params: the version that sampled the batch (lag mode: the ring's version step - k; sync / k = 0:
    the learner's own parameters, where every c_v is 0). max_ratio: the cap C of the method's token weight
  (Method.centering: token_tis's c for the paper's TIS+SC), or None (w = 1).
      logp_fn(params, batch) -> (logp_nt, corr_nt, diag): the vmap path (`make_centered_logp_fn`);
      head_coefs(batch) -> grad_norms.HeadCoefficients: the ghost path, one stop-gradient forward of the
        behaviour parameters on the batch (`exact_head_coefficients`).
  """

  def __init__(self, graphdef, max_ratio, behavior_params):
    self.graphdef, self.behavior_params, self.max_ratio = graphdef, behavior_params, max_ratio
    self._fn = make_centered_logp_fn(graphdef, self.max_ratio)

  def logp_fn(self, params, batch):
    return self._fn(params, self.behavior_params, batch)

  def head_coefs(self, batch) -> grad_norms.HeadCoefficients:
    from flax import nnx  # as _both_versions: nnx only where a model is merged

    positions, mask = transformer.padded_positions_and_mask(batch["valid_mask"])
    behaviour = nnx.merge(self.graphdef, jax.tree.map(sg, self.behavior_params))
    hq, _ = behaviour(batch["tokens"], positions, mask, hidden=True)
    wq, spec = _head(behaviour)
    return exact_head_coefficients(hq, wq, spec, batch["loss_mask"], self.max_ratio)


class TopkCentering:
  """Score centering of one learner step from the sampler's top-k ('topk'): both paths; max_ratio as StepCentering.

  batch["topk_ids"] int32 [N, R, K] and batch["topk_logp"] float32 [N, R, K] (the R response columns, the last R
  token columns): row r holds the top-k ids of the distribution the sampler drew response token r from and their POST-filter log-probs (temperature, top-k / top-p
  applied; sampler.SamplerConfig.record_topk). The tail outside them is modelled (`topk_correction`).
    logp_fn(params, batch) -> (logp_nt, corr_nt, diag): the vmap path, one forward of the current parameters;
      the learner's log-probs at the ids come from `head_logprobs_at` (dense [N, T, V] logits: small
      vocabularies);
    head_coefs(batch) -> f(h, w, lse, spec) -> grad_norms.HeadCoefficients: the ghost path, built from the
      ghost forward's own head record (`topk_head_coefficients`; no extra forward).
  """

  KEYS = ("topk_ids", "topk_logp")

  def __init__(self, graphdef, max_ratio):
    self.graphdef, self.max_ratio = graphdef, max_ratio

  def _check(self, batch):
    missing = [k for k in self.KEYS if k not in batch]
    if missing:
      raise ValueError(
        f"method.loss.score_centering='topk': the batch lacks {missing} ([N, R, K] from the sampler, "
        "SamplerConfig.record_topk = method.loss.sc_topk)"
      )

  def logp_fn(self, params, batch):
    from flax import nnx  # as _both_versions: nnx only where a model is merged

    self._check(batch)
    tokens = batch["tokens"]
    positions, mask = transformer.padded_positions_and_mask(batch["valid_mask"])
    model = nnx.merge(self.graphdef, params)
    h, _ = model(tokens, positions, mask, hidden=True)
    thr = batch.get("support_thr")  # support replay: p over the sampler's recorded support
    logp = model.head_logprobs(h, tokens, thr)
    w, spec = _head(model)
    t = tokens.shape[1]
    head = head_logprobs_at(h, w, batch_lib.at_token_columns(batch["topk_ids"], t), spec, tokens, thr)
    lq = batch_lib.at_token_columns(sg(batch["topk_logp"]), t)
    corr, diag = topk_correction(head, lq, self.max_ratio, batch["loss_mask"])
    return logp, corr, diag

  def head_coefs(self, batch):
    self._check(batch)
    ids, lq, mask, cap, tok = batch["topk_ids"], batch["topk_logp"], batch["loss_mask"], self.max_ratio, batch["tokens"]
    return lambda h, w, lse, spec, cut=None: topk_head_coefficients(h, w, lse, spec, ids, lq, mask, cap, cut, tok)


def drift_rows(logp_nt, behavior_logp_nt, mask_nt, coef_abs_nt, kl_qp_nt=None, **head_masses_nt) -> dict:
  """Per-row sums of the drift diagnostics over the loss tokens ([N] each; micro-batches stack them):
  drift_tokens_n, drift_k1_n = sum (log q_y - log p_y), drift_coef_l1_n = sum_t sum_v |c_tv|,
  drift_kl_qp_n = sum_t KL(q_t || p_t) when given, and top-k centering's head masses (p_head_mass_nt,
  q_head_mass_nt: sum of p, of q over the recorded ids) as drift_<name>_n. `drift_scalars` makes token means."""
  m = jnp.asarray(mask_nt) != 0
  tot = lambda x: jnp.sum(jnp.where(m, sg(jnp.asarray(x, _F32)), 0.0), axis=1)
  out = dict(
    drift_tokens_n=jnp.sum(m, axis=1).astype(_F32),
    drift_k1_n=tot(jnp.asarray(behavior_logp_nt, _F32) - jnp.asarray(logp_nt, _F32)),
    drift_coef_l1_n=tot(coef_abs_nt),
  )
  if kl_qp_nt is not None:
    out["drift_kl_qp_n"] = tot(kl_qp_nt)
  out.update({f"drift_{name}_n": tot(x) for name, x in head_masses_nt.items()})
  return out


def drift_scalars(rows: dict) -> dict:
  """{"drift/k1_kl_qp", "drift/coef_l1"[, "drift/kl_qp", "drift/p_head_mass", "drift/q_head_mass"]}: token
  means of `drift_rows` over the batch."""
  n = jnp.maximum(jnp.sum(rows["drift_tokens_n"]), 1.0)
  names = {"drift_k1_n": "k1_kl_qp", "drift_coef_l1_n": "coef_l1", "drift_kl_qp_n": "kl_qp"}
  names.update({f"drift_{m}_n": m for m in ("p_head_mass", "q_head_mass")})
  return {f"drift/{v}": jnp.sum(rows[k]) / n for k, v in names.items() if k in rows}
