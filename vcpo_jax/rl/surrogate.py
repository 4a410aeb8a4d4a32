"""The policy-gradient surrogate of a Method: the per-example coefficients coef_n and token weights tokw_nt.

  loss(params) = - sum_n coef_n * sum_t tokw_nt * logp_nt(params)
    coef_n = A_n * w_n * norm_n   (all stop-gradient)
    A_n    = (R_n - baseline_n) / scale_n   (the method's advantage; its OPOB baseline may replace baseline_n)
    w_n    = the applied sequence weight of the method's weights (1 for token-level variants, whose weight
             sits in tokw_nt = mask_nt * w_nt)
    norm_n = 1 / (N L_n) | 1 / sum_n L_n | 1 / N | 1 / T   (the surrogate's loss aggregation)

with `coef_n` from `pg_coefficients` and `tokw_nt` from `pg_token_weights`. Every function here takes the
method (an rl.method.Method: advantage, weights, baseline, loss, lr, log_ratio_clamp) and reads its parts'
own fields. Every ratio, weight, baseline, advantage and coefficient is stop-gradient; the only
differentiable quantity is logp_nt. Rows with an empty loss mask are padding; rows whose log-ratio is not
finite are masked out and counted in `nonfinite_rows`. OPOB's baseline weights use the UNCLAMPED ratio (log
space); the +-log_ratio_clamp clamp only enters the applied weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from vcpo_jax.rl.advantages import (
  ADVANTAGE_ESTIMATORS,
  OPOB_SCOPE_KINDS,
  OPOB_WEIGHT_KINDS,
  baseline_and_scale,
  opob_baseline,
)
from vcpo_jax.rl.aggregation import LOSS_AGGREGATIONS
from vcpo_jax.rl.ess import ess_ratio, log_mean_weight, sequence_log_ratio, token_log_ratio

sg = jax.lax.stop_gradient

MASK_NORMALIZERS = ("all", "kept")
OPOB_WEIGHTS = OPOB_WEIGHT_KINDS
OPOB_SCOPES = OPOB_SCOPE_KINDS
# Score centering's source of the behaviour distribution q (vcpo_jax/score_centering.py): off | the learner
# recomputes q from the behaviour parameters (lag / sync) | the sampler's recorded top-k (any mode).
SCORE_CENTERING = ("off", "exact", "topk")


def needs_sq_norms(method) -> bool:
  """Whether pg_coefficients needs the per-example squared score norms (the OPOB baseline)."""
  return method.baseline is not None


def batch_wide_coefficients(method) -> str | None:
  """Why a row's coefficient depends on rows outside its group (None: it does not).

  Such a method cannot be micro-batched by whole groups: the REINFORCE batch
  mean baseline, OPOB over the minibatch, a weight solved over the batch
  (tis_ess) and a peer loss read every row. The loss normaliser Z and the ESS
  scale are whole-batch too, but scalar factors (`loss_divisor`, lr_scale),
  applied after accumulation.
  """
  if ADVANTAGE_ESTIMATORS[method.advantage.estimator].batch_wide:
    return f"advantage {method.advantage.estimator!r} (its baseline is the mean over the whole batch)"
  if method.baseline is not None and method.baseline.scope == "minibatch":
    return "OPOB scope 'minibatch' (its baseline weighs every row's norm)"
  if method.weights.spec.batch_wide:
    return f"weights {method.weights.variant!r} (its weights are solved over the whole batch)"
  if not isinstance(method.loss, Surrogate):
    return f"loss {method.loss.name!r} (its normalizer and masks are over the whole batch)"
  return None


def aggregation(method) -> Surrogate:
  """The surrogate whose aggregation the coefficients use: the method's, or the default one under a peer loss
  (whose coefficients only carry the advantages and the ESS metrics)."""
  return method.loss if isinstance(method.loss, Surrogate) else _DEFAULT_SURROGATE


def _finite_rows(logp_nt, behavior_logp_nt, mask_nt):
  """l_n [N], L_n [N], valid_n [N] (non-empty mask and finite l_n), nonfinite_n [N]."""
  mask = jnp.asarray(mask_nt, jnp.float32)
  L_n = jnp.sum(mask, axis=-1)
  l_n = sequence_log_ratio(logp_nt, behavior_logp_nt, mask_nt)
  finite = jnp.isfinite(l_n)
  return l_n, L_n, (L_n > 0) & finite, (L_n > 0) & ~finite


def pg_token_weights(logp_nt, behavior_logp_nt, mask_nt, method):
  """tokw_nt multiplying logp_nt inside the surrogate's token sum, stop-gradient.

  mask_nt for sequence-level variants; mask_nt * min(exp(d_nt), c) for
  "token_tis" (its per-token weight cannot be folded into coef_n). Rows whose
  log-ratio is not finite get 0 (they are masked out, see pg_coefficients), so
  no NaN can reach the backward pass through them.
  """
  mask = jnp.asarray(mask_nt, jnp.float32)
  _, _, valid, _ = _finite_rows(logp_nt, behavior_logp_nt, mask_nt)
  if method.weights.level != "token":
    return jnp.where(valid[:, None], mask, 0.0)
  d_nt = token_log_ratio(logp_nt, behavior_logp_nt, mask_nt)
  tw = method.weights(d_nt, log_clamp=method.log_ratio_clamp)
  return sg(jnp.where(valid[:, None], mask * tw, 0.0))


def _pg_rows(logp_nt, behavior_logp_nt, mask_nt, rewards_n, group_id_n, sq_score_norms_n, method):
  """Everything of pg_coefficients that is per row: a dict of [N] arrays.

  unnormalized_coef_n = A_n * w_n * per_row(L_n, T): coef_n before the
  division by the whole-batch count Z (`loss_divisor`). Rows only interact
  within their group (unless batch_wide_coefficients(method)), so the rows of a
  micro-batch of whole groups equal the whole batch's.
  """
  mask = jnp.asarray(mask_nt, jnp.float32)
  l_n, L_n, valid, nonfinite = _finite_rows(logp_nt, behavior_logp_nt, mask_nt)
  l_safe = jnp.where(valid, l_n, 0.0)  # invalid rows: any finite stand-in, masked everywhere below
  r = sg(jnp.asarray(rewards_n, jnp.float32))
  weights, clamp = method.weights, method.log_ratio_clamp

  lc = jnp.clip(l_safe, -clamp, clamp)
  if weights.level == "token":
    d_nt = jnp.where(valid[:, None], token_log_ratio(logp_nt, behavior_logp_nt, mask_nt), 0.0)
    tw = weights(d_nt, log_clamp=clamp)
    log_w_applied = jnp.sum(jnp.where(mask > 0, jnp.log(tw), 0.0), axis=-1)
    w_seq = jnp.where(valid, 1.0, 0.0)  # the weight lives in tokw_nt
    d_c = jnp.clip(d_nt, -clamp, clamp)
    clipped_n = jnp.where(valid, jnp.sum((tw < jnp.exp(d_c)) * mask, axis=-1), 0.0)  # tokens
    masked_n = jnp.zeros_like(valid)
    weight_report = jnp.where(valid, jnp.exp(jnp.clip(log_w_applied, -clamp, clamp)), 0.0)
  else:
    # lengths 0 on invalid rows: the variants that read L_n (geo_mask, tis_ess's solve) leave them out
    L_valid = jnp.where(valid, L_n, 0.0)
    w_seq = jnp.where(valid, weights(l_safe, lengths_n=L_valid, log_clamp=clamp), 0.0)
    log_w_applied = jnp.log(w_seq)
    changed = valid & (w_seq > 0) & ~jnp.isclose(w_seq, jnp.exp(lc), rtol=1e-6)
    clipped_n = changed.astype(jnp.float32)  # rows
    masked_n = valid & (w_seq == 0)
    weight_report = w_seq
  kept = valid & (w_seq > 0)

  a = method.advantage
  base, scale = baseline_and_scale(r, group_id_n, a.estimator, valid_n=valid, std=a.std, std_eps=a.std_eps)

  def normalize(value, b):
    return jnp.where(valid & (scale > 0), (value - b) / jnp.where(scale > 0, scale, 1.0), 0.0)

  ob = method.baseline
  if ob is not None:
    s_n = sg(jnp.asarray(sq_score_norms_n, jnp.float32))
    if ob.length_normalize_norms:
      s_n = s_n / jnp.square(jnp.maximum(L_n, 1.0))
    if ob.reference_mode:
      s_n = s_n * jnp.square(w_seq)  # norm of the w~-weighted loss: w~ enters twice
    # The baseline weights: log w = l_n unclamped (the paper), or the applied weight.
    log_w_b = l_safe if ob.weights == "unclipped" else log_w_applied
    if ob.scope == "group":
      base = opob_baseline(r, None, s_n, group_id_n, ob.leave_one_out, valid_n=valid, log_weights_n=log_w_b)
      adv = normalize(r, base)
    else:
      a0 = normalize(r, base)
      zeros = jnp.zeros_like(jnp.asarray(group_id_n))
      base = opob_baseline(a0, None, s_n, zeros, ob.leave_one_out, valid_n=valid, log_weights_n=log_w_b)
      adv = jnp.where(valid, a0 - base, 0.0)
  else:
    adv = normalize(r, base)

  agg = aggregation(method)
  T = agg.loss_norm_tokens or mask.shape[-1]
  per_row = LOSS_AGGREGATIONS[agg.loss_agg].per_row(L_n, jnp.float32(T))
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


def loss_divisor(aux_n: Mapping[str, jax.Array], method) -> jax.Array:
  """Z of norm_n = per_row(L_n, T) / Z from the per-row arrays of a WHOLE batch (>= 1).

  aux_n: needs valid_n, kept_n, length_n ([N] each, as pg_coefficients returns).
  """
  agg = aggregation(method)
  divisor = LOSS_AGGREGATIONS[agg.loss_agg].divisor
  if divisor == "none":
    return jnp.float32(1.0)
  rows = aux_n["kept_n"] if agg.mask_normalizer == "kept" else aux_n["valid_n"]
  rows = jnp.asarray(rows, jnp.float32)
  count = jnp.sum(rows) if divisor == "rows" else jnp.sum(rows * jnp.asarray(aux_n["length_n"], jnp.float32))
  return jnp.maximum(count, 1.0)


def pg_metrics(aux_n: Mapping[str, jax.Array], method) -> dict[str, jax.Array]:
  """The scalar metrics of pg_coefficients from its per-row arrays (of the whole batch).

  A function of the [N] arrays only, so a micro-batched step that stacks its
  micro-batches' rows gets the single-pass numbers. See pg_coefficients.
  """
  valid = jnp.asarray(aux_n["valid_n"], bool)
  n_valid = jnp.sum(valid).astype(jnp.float32)
  l_n = aux_n["log_ratio_n"]
  rho = ess_ratio(l_n, valid)
  lr_scale = jnp.float32(1.0) if method.lr is None else method.lr(rho)

  def vmean(x):
    return jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(n_valid, 1.0)

  def vstd(x):
    return jnp.sqrt(vmean(jnp.square(x - vmean(x))))

  if method.weights.level == "token":  # a fraction of the valid rows' tokens
    clip_den = jnp.sum(jnp.where(valid, aux_n["length_n"], 0.0))
  else:
    clip_den = n_valid
  adv, base, w = aux_n["advantage_n"], aux_n["baseline_n"], aux_n["weight_n"]
  return dict(
    ess_ratio=rho,
    ess_ratio_applied=ess_ratio(aux_n["log_weight_applied_n"], valid),
    lr_scale=lr_scale,
    log_ratio_mean=vmean(l_n),
    log_mean_weight=log_mean_weight(l_n, valid),
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
    **method.weights.metrics(jnp.clip(l_n, -method.log_ratio_clamp, method.log_ratio_clamp), valid),
  )


def pg_coefficients(
  logp_nt, behavior_logp_nt, mask_nt, rewards_n, group_id_n, sq_score_norms_n, method, *, divisor=None
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
      exact token-SUM score); None allowed when not needs_sq_norms(method). The
      variant OPOB uses is derived here: / L_n^2 if length_normalize_norms,
      * w~_n^2 in reference_mode (the reference measures the norm of the
      w~-weighted token-sum loss).
    method: an rl.method.Method (its advantage, weights, baseline, loss aggregation, lr rule, clamp).
    divisor: Z to use instead of loss_divisor(rows of this batch, method): a
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
  if needs_sq_norms(method) and sq_score_norms_n is None:
    raise ValueError(
      "sq_score_norms_n: None, but the OPOB baseline needs ||s_n||^2 (vcpo_jax.grad_norms: ghost norms or "
      "per_example_sq_grad_norms)"
    )
  rows = _pg_rows(logp_nt, behavior_logp_nt, mask_nt, rewards_n, group_id_n, sq_score_norms_n, method)
  z = loss_divisor(rows, method) if divisor is None else jnp.asarray(divisor, jnp.float32)
  coef_n = sg(rows.pop("unnormalized_coef_n") / z)
  return coef_n, dict(pg_metrics(rows, method), **rows)


@dataclasses.dataclass(frozen=True)
class Surrogate:
  """The surrogate loss -sum_n coef_n sum_t tokw_nt logp_nt as a value: its aggregation and score centering.

  loss_agg: rl.aggregation.LOSS_AGGREGATIONS name. mask_normalizer: which rows the counts N and sum_n L_n of
  norm_n include. "all": every valid row, rejected ones too (a rejected row adds 0 to the sum but still
  counts; the presets' choice, so that a batch's step size does not grow as more rows are rejected);
  "kept": only the rows whose applied weight is not 0 (the reference's masked IS, which drops rejected rows
  from the loss mask); it changes only the rejecting variants (mask, geo_mask). loss_norm_tokens: the
  "seq-mean-token-sum-norm" constant T (0: the batch's token length). score_centering: each token's score
  less sum_v sg[c_v] log p_v (vcpo_jax/score_centering.py; 'exact' recomputes q from the behaviour version,
  'topk' reads the sampler's top-k of width sc_topk); it needs the model's head, so `Method.loss_fn` on
  logp_nt alone is the uncentered surrogate and the learner adds the term.
  """

  loss_agg: str = "seq-mean-token-mean"
  mask_normalizer: str = "all"
  loss_norm_tokens: int = 0
  score_centering: str = "off"
  sc_topk: int = 0

  def __post_init__(self):
    if self.loss_agg not in LOSS_AGGREGATIONS:
      raise ValueError(f"loss_agg={self.loss_agg!r}: choose one of {sorted(LOSS_AGGREGATIONS)}")
    if self.mask_normalizer not in MASK_NORMALIZERS:
      raise ValueError(f"mask_normalizer={self.mask_normalizer!r}: choose one of {MASK_NORMALIZERS}")
    n = self.loss_norm_tokens
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
      raise ValueError(f"loss_norm_tokens={n!r}: must be an int >= 0 (0: the batch's token length)")
    if self.score_centering not in SCORE_CENTERING:
      raise ValueError(f"score_centering={self.score_centering!r}: choose one of {list(SCORE_CENTERING)}")
    topk = self.score_centering == "topk"
    k = self.sc_topk
    if not isinstance(k, int) or isinstance(k, bool) or k < (1 if topk else 0):
      raise ValueError(f"sc_topk={k!r}: score_centering='topk' needs an int k >= 1 (e.g. 64)")
    if k and not topk:
      raise ValueError(f"sc_topk={k}: only with score_centering='topk' (have {self.score_centering!r}); set 0")


def surrogate(**options) -> Surrogate:
  """The VCPO surrogate (Surrogate's fields, with their defaults there): e.g. surrogate(mask_normalizer="kept"),
  surrogate(score_centering="topk", sc_topk=64)."""
  return Surrogate(**options)


_DEFAULT_SURROGATE = Surrogate()
