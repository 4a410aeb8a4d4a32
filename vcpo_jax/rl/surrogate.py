"""The policy-gradient surrogate: PGConfig and the per-example coefficients coef_n.

  loss(params) = - sum_n coef_n * sum_t tokw_nt * logp_nt(params)

with `coef_n` from `pg_coefficients` and `tokw_nt` from `pg_token_weights`
(tokw_nt = mask_nt for every sequence-level weight variant). Every ratio,
weight, baseline, advantage and coefficient is stop-gradient; the only
differentiable quantity is logp_nt. Rows with an empty loss mask are padding;
rows whose log-ratio is not finite are masked out and counted in
`nonfinite_rows`. OPOB's baseline weights use the UNCLAMPED ratio (log space);
the +-log_ratio_clamp clamp only enters the applied weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from vcpo_jax.rl.advantages import ADVANTAGE_ESTIMATORS, STD_KINDS, baseline_and_scale, opob_baseline
from vcpo_jax.rl.aggregation import LOSS_AGGREGATIONS
from vcpo_jax.rl.ess import (
  DEFAULT_LOG_RATIO_CLAMP,
  ESS_LR_RULES,
  ess_lr_scale,
  ess_ratio,
  log_mean_weight,
  ess_target_truncation,
  sequence_log_ratio,
  token_log_ratio,
)
from vcpo_jax.rl.losses import POLICY_LOSSES, make_policy_loss
from vcpo_jax.rl.weights import WEIGHT_VARIANTS, importance_weights

sg = jax.lax.stop_gradient

MASK_NORMALIZERS = ("all", "kept")
DECOUPLED_PROX = ("exact", "loglinear")
OPOB_WEIGHTS = ("unclipped", "applied")
OPOB_SCOPES = ("group", "minibatch")
# Score centering's source of the behaviour distribution q (vcpo_jax/score_centering.py): off | the learner
# recomputes q from the behaviour parameters (lag / sync) | the sampler's recorded top-k (any mode).
SCORE_CENTERING = ("off", "exact", "topk")


@dataclasses.dataclass(frozen=True)
class PGConfig:
  """Everything that defines a policy-gradient method; hashable (jit-static).

  The surrogate is  loss = - sum_n coef_n * sum_t tokw_nt * logp_nt  with
    coef_n = A_n * w_n * norm_n   (all stop-gradient)
    A_n    = (R_n - baseline_n) / scale_n   (advantage estimator; OPOB may
             replace the baseline)
    w_n    = applied sequence weight (1 for token-level variants, whose weight
             sits in tokw_nt = mask_nt * min(exp(d_nt), c))
    norm_n = 1 / (N L_n) | 1 / sum_n L_n | 1 / N | 1 / T   (loss aggregation)

  mask_normalizer: which rows the counts N and sum_n L_n of norm_n include.
  "all": every valid row, rejected ones too (a rejected row adds 0 to the sum
  but still counts; the presets' choice, so that a batch's step size does not
  grow as more rows are rejected); "kept": only the rows whose applied weight
  is not 0 (the reference's masked IS, which drops rejected rows from the
  loss mask). It changes only the rejection variants "mask" and "geo_mask"
  (the others reject nothing).
  """

  advantage: str = "grpo"  # ADVANTAGE_ESTIMATORS name: the base algorithm
  is_variant: str = "none"  # WEIGHT_VARIANTS name
  tis_c: float = 8.0  # "tis" truncation level (c = 8 in all released runs)
  clip_lower: float = 0.5  # "clip": lower end a of the interval [a, b]
  clip_upper: float = 2.0  # "clip": upper end b
  mask_lower: float = 0.5  # "mask": weights below this are masked (weight 0)
  mask_upper: float = 2.0  # "mask": weights above this are masked
  token_tis_c: float = 2.0  # "token_tis" per-token truncation level
  geo_lower: float = 0.99  # "geo_mask": rows whose exp(l / L) is below this are masked
  geo_upper: float = 1.01  # "geo_mask": rows whose exp(l / L) is above this are masked
  log_ratio_clamp: float = DEFAULT_LOG_RATIO_CLAMP  # applied weights use exp(clamp(l, -c, c))
  loss_agg: str = "seq-mean-token-mean"  # LOSS_AGGREGATIONS
  mask_normalizer: str = "all"  # rows counted in the loss normaliser: all (valid) | kept (weight != 0)
  loss_norm_tokens: int = 0  # "seq-mean-token-sum-norm" divisor T; 0: the batch's token axis length
  opob: bool = False  # replace the estimator's baseline by OPOB
  opob_weights: str = "unclipped"  # "unclipped" (paper) | "applied"
  opob_leave_one_out: bool = False  # exclude i from its own baseline (unbiased)
  opob_scope: str = "group"  # "group": raw rewards per prompt; "minibatch": A over batch
  length_normalize_norms: bool = False  # ||s_n||^2 / L_n^2 (norm of the token-mean score)
  reference_mode: bool = False  # reproduce the reference: norms w~^2 ||s||^2, weights w^2
  std: str = "population"  # group std for "grpo": population (ddof 0) | sample (ddof 1); presets set it
  std_eps: float = 1e-6  # groups with std <= std_eps contribute nothing
  ess_lr: bool = False  # scale the step's learning rate by the ESS rule
  ess_rule: str = "sqrt"  # ESS_LR_RULES name
  rho_on: float = 1.0  # on-policy reference ESS ratio (docs/rho_on_protocol.md)
  tis_ess_target: float = 0.5  # "tis_ess": target ESS ratio of the truncated weights, in (0, 1]
  policy_loss: str = "pg"  # "pg" (the surrogate above) | a policy_losses.POLICY_LOSSES name (its own loss_agg)
  policy_loss_kw: str = ""  # its hyper-parameters "name=value,...", e.g. "eps_high=0.28,loss_agg=token-mean"
  decoupled_prox: str = "exact"  # decoupled_ppo's pi_prox: exact (pi_old, recomputed) | loglinear (AReaL approx.)
  score_centering: str = "off"  # off | exact (q of the behaviour version) | topk (sampler's top-k); cap: token_tis_c
  sc_topk: int = 0  # score_centering='topk': ids per token the sampler records (k); 0 otherwise

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
    choose("mask_normalizer", MASK_NORMALIZERS)
    choose("opob_weights", OPOB_WEIGHTS)
    choose("opob_scope", OPOB_SCOPES)
    choose("std", STD_KINDS)
    choose("ess_rule", ESS_LR_RULES)
    for f in ("tis_c", "token_tis_c", "log_ratio_clamp", "rho_on", "clip_upper", "mask_upper", "geo_upper"):
      positive(f)
    if not self.std_eps >= 0:
      raise ValueError(f"PGConfig.std_eps={self.std_eps!r}: must be >= 0")
    if not (isinstance(self.loss_norm_tokens, int) and self.loss_norm_tokens >= 0):
      raise ValueError(
        f"PGConfig.loss_norm_tokens={self.loss_norm_tokens!r}: must be an int >= 0 (0: the batch's token length)"
      )
    for lo, hi in (("clip_lower", "clip_upper"), ("mask_lower", "mask_upper"), ("geo_lower", "geo_upper")):
      if not 0 <= getattr(self, lo) <= getattr(self, hi):
        raise ValueError(f"PGConfig.{lo}={getattr(self, lo)!r}: need 0 <= {lo} <= {hi}")
    if not 0 < self.tis_ess_target <= 1:
      raise ValueError(f"PGConfig.tis_ess_target={self.tis_ess_target!r}: must be in (0, 1]")
    choose("decoupled_prox", DECOUPLED_PROX)
    self._check_centering()
    kw = policy_loss_kwargs(self)  # raises on a malformed string
    if self.policy_loss != "pg":
      choose("policy_loss", ["pg", *POLICY_LOSSES])
      if self.is_variant != "none" or self.opob:
        raise ValueError(
          f"PGConfig.policy_loss={self.policy_loss!r} with is_variant={self.is_variant!r}, opob={self.opob}: "
          "the loss carries its own correction; use is_variant='none', opob=False"
        )
      try:
        make_policy_loss(self.policy_loss, **kw)  # checks the names and values of the hyper-parameters
      except ValueError as e:
        raise ValueError(f"PGConfig.policy_loss_kw={self.policy_loss_kw!r}: {e}") from None
    elif kw:
      raise ValueError(f"PGConfig.policy_loss_kw={self.policy_loss_kw!r}: only with a policy_loss other than 'pg'")
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

  def _check_centering(self):
    """score_centering / sc_topk: a choice, k >= 1 exactly for 'topk', only with the surrogate."""
    if self.score_centering not in SCORE_CENTERING:
      raise ValueError(f"PGConfig.score_centering={self.score_centering!r}: choose one of {list(SCORE_CENTERING)}")
    topk = self.score_centering == "topk"
    if not isinstance(self.sc_topk, int) or isinstance(self.sc_topk, bool) or self.sc_topk < (1 if topk else 0):
      raise ValueError(f"PGConfig.sc_topk={self.sc_topk!r}: score_centering='topk' needs an int k >= 1 (e.g. 64)")
    if self.sc_topk and not topk:
      raise ValueError(
        f"PGConfig.sc_topk={self.sc_topk}: only with score_centering='topk' (have {self.score_centering!r}); set 0"
      )
    if self.score_centering != "off" and self.policy_loss != "pg":
      raise ValueError(
        f"PGConfig.score_centering={self.score_centering!r} with policy_loss={self.policy_loss!r}: centering is a "
        "term of the surrogate (policy_loss='pg'); set score_centering='off'"
      )

  def replace(self, **kw) -> PGConfig:
    return dataclasses.replace(self, **kw)


def needs_sq_norms(cfg: PGConfig) -> bool:
  """Whether pg_coefficients needs the per-example squared score norms."""
  return bool(cfg.opob)


def batch_wide_coefficients(cfg: PGConfig) -> str | None:
  """Why a row's coefficient depends on rows outside its group (None: it does not).

  Such a method cannot be micro-batched by whole groups: the REINFORCE batch
  mean baseline and OPOB over the minibatch read every row. The loss
  normaliser Z and the ESS scale are whole-batch too, but scalar factors
  (`loss_divisor`, lr_scale), applied after accumulation.
  """
  if ADVANTAGE_ESTIMATORS[cfg.advantage].batch_wide:
    return f"vcpo.advantage={cfg.advantage!r} (its baseline is the mean over the whole batch)"
  if cfg.opob and cfg.opob_scope == "minibatch":
    return "vcpo.opob_scope='minibatch' (its baseline weighs every row's norm)"
  if cfg.is_variant == "tis_ess":
    return "vcpo.is_variant='tis_ess' (its cap c_t is solved over the whole batch)"
  if cfg.policy_loss != "pg":
    return f"vcpo.policy_loss={cfg.policy_loss!r} (its normalizer and masks are over the whole batch)"
  return None


def _variant_kwargs(cfg: PGConfig):
  v = cfg.is_variant
  return dict(
    c=cfg.token_tis_c if v == "token_tis" else cfg.tis_c,
    target=cfg.tis_ess_target,
    lower={"clip": cfg.clip_lower, "mask": cfg.mask_lower, "geo_mask": cfg.geo_lower}.get(v),
    upper={"clip": cfg.clip_upper, "mask": cfg.mask_upper, "geo_mask": cfg.geo_upper}.get(v),
    log_clamp=cfg.log_ratio_clamp,
  )


def _finite_rows(logp_nt, behavior_logp_nt, mask_nt):
  """l_n [N], L_n [N], valid_n [N] (non-empty mask and finite l_n), nonfinite_n [N]."""
  mask = jnp.asarray(mask_nt, jnp.float32)
  L_n = jnp.sum(mask, axis=-1)
  l_n = sequence_log_ratio(logp_nt, behavior_logp_nt, mask_nt)
  finite = jnp.isfinite(l_n)
  return l_n, L_n, (L_n > 0) & finite, (L_n > 0) & ~finite


def pg_token_weights(logp_nt, behavior_logp_nt, mask_nt, cfg: PGConfig):
  """tokw_nt multiplying logp_nt inside the surrogate's token sum, stop-gradient.

  mask_nt for sequence-level variants; mask_nt * min(exp(d_nt), c) for
  "token_tis" (its per-token weight cannot be folded into coef_n). Rows whose
  log-ratio is not finite get 0 (they are masked out, see pg_coefficients), so
  no NaN can reach the backward pass through them.
  """
  mask = jnp.asarray(mask_nt, jnp.float32)
  _, _, valid, _ = _finite_rows(logp_nt, behavior_logp_nt, mask_nt)
  if WEIGHT_VARIANTS[cfg.is_variant].level != "token":
    return jnp.where(valid[:, None], mask, 0.0)
  d_nt = token_log_ratio(logp_nt, behavior_logp_nt, mask_nt)
  tw = importance_weights(d_nt, cfg.is_variant, **_variant_kwargs(cfg))
  return sg(jnp.where(valid[:, None], mask * tw, 0.0))


def _pg_rows(logp_nt, behavior_logp_nt, mask_nt, rewards_n, group_id_n, sq_score_norms_n, cfg: PGConfig):
  """Everything of pg_coefficients that is per row: a dict of [N] arrays.

  unnormalized_coef_n = A_n * w_n * per_row(L_n, T): coef_n before the
  division by the whole-batch count Z (`loss_divisor`). Rows only interact
  within their group (unless batch_wide_coefficients(cfg)), so the rows of a
  micro-batch of whole groups equal the whole batch's.
  """
  mask = jnp.asarray(mask_nt, jnp.float32)
  l_n, L_n, valid, nonfinite = _finite_rows(logp_nt, behavior_logp_nt, mask_nt)
  l_safe = jnp.where(valid, l_n, 0.0)  # invalid rows: any finite stand-in, masked everywhere below
  r = sg(jnp.asarray(rewards_n, jnp.float32))
  vkw = _variant_kwargs(cfg)
  variant = WEIGHT_VARIANTS[cfg.is_variant]

  lc = jnp.clip(l_safe, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
  if variant.level == "token":
    d_nt = jnp.where(valid[:, None], token_log_ratio(logp_nt, behavior_logp_nt, mask_nt), 0.0)
    tw = importance_weights(d_nt, cfg.is_variant, **vkw)
    log_w_applied = jnp.sum(jnp.where(mask > 0, jnp.log(tw), 0.0), axis=-1)
    w_seq = jnp.where(valid, 1.0, 0.0)  # the weight lives in tokw_nt
    d_c = jnp.clip(d_nt, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    clipped_n = jnp.where(valid, jnp.sum((tw < jnp.exp(d_c)) * mask, axis=-1), 0.0)  # tokens
    masked_n = jnp.zeros_like(valid)
    weight_report = jnp.where(valid, jnp.exp(jnp.clip(log_w_applied, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)), 0.0)
  else:
    # lengths 0 on invalid rows: the variants that read L_n (geo_mask, tis_ess's solve) leave them out
    L_valid = jnp.where(valid, L_n, 0.0)
    w_seq = jnp.where(valid, importance_weights(l_safe, cfg.is_variant, lengths_n=L_valid, **vkw), 0.0)
    log_w_applied = jnp.log(w_seq)
    changed = valid & (w_seq > 0) & ~jnp.isclose(w_seq, jnp.exp(lc), rtol=1e-6)
    clipped_n = changed.astype(jnp.float32)  # rows
    masked_n = valid & (w_seq == 0)
    weight_report = w_seq
  kept = valid & (w_seq > 0)

  base, scale = baseline_and_scale(r, group_id_n, cfg.advantage, valid_n=valid, std=cfg.std, std_eps=cfg.std_eps)

  def normalize(value, b):
    return jnp.where(valid & (scale > 0), (value - b) / jnp.where(scale > 0, scale, 1.0), 0.0)

  if cfg.opob:
    s_n = sg(jnp.asarray(sq_score_norms_n, jnp.float32))
    if cfg.length_normalize_norms:
      s_n = s_n / jnp.square(jnp.maximum(L_n, 1.0))
    if cfg.reference_mode:
      s_n = s_n * jnp.square(w_seq)  # norm of the w~-weighted loss: w~ enters twice
    # The baseline weights: log w = l_n unclamped (the paper), or the applied weight.
    log_w_b = l_safe if cfg.opob_weights == "unclipped" else log_w_applied
    if cfg.opob_scope == "group":
      base = opob_baseline(r, None, s_n, group_id_n, cfg.opob_leave_one_out, valid_n=valid, log_weights_n=log_w_b)
      adv = normalize(r, base)
    else:
      a0 = normalize(r, base)
      zeros = jnp.zeros_like(jnp.asarray(group_id_n))
      base = opob_baseline(a0, None, s_n, zeros, cfg.opob_leave_one_out, valid_n=valid, log_weights_n=log_w_b)
      adv = jnp.where(valid, a0 - base, 0.0)
  else:
    adv = normalize(r, base)

  T = cfg.loss_norm_tokens or mask.shape[-1]
  per_row = LOSS_AGGREGATIONS[cfg.loss_agg].per_row(L_n, jnp.float32(T))
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


def loss_divisor(aux_n: Mapping[str, jax.Array], cfg: PGConfig) -> jax.Array:
  """Z of norm_n = per_row(L_n, T) / Z from the per-row arrays of a WHOLE batch (>= 1).

  aux_n: needs valid_n, kept_n, length_n ([N] each, as pg_coefficients returns).
  """
  divisor = LOSS_AGGREGATIONS[cfg.loss_agg].divisor
  if divisor == "none":
    return jnp.float32(1.0)
  rows = aux_n["kept_n"] if cfg.mask_normalizer == "kept" else aux_n["valid_n"]
  rows = jnp.asarray(rows, jnp.float32)
  count = jnp.sum(rows) if divisor == "rows" else jnp.sum(rows * jnp.asarray(aux_n["length_n"], jnp.float32))
  return jnp.maximum(count, 1.0)


def pg_metrics(aux_n: Mapping[str, jax.Array], cfg: PGConfig) -> dict[str, jax.Array]:
  """The scalar metrics of pg_coefficients from its per-row arrays (of the whole batch).

  A function of the [N] arrays only, so a micro-batched step that stacks its
  micro-batches' rows gets the single-pass numbers. See pg_coefficients.
  """
  valid = jnp.asarray(aux_n["valid_n"], bool)
  n_valid = jnp.sum(valid).astype(jnp.float32)
  l_n = aux_n["log_ratio_n"]
  rho = ess_ratio(l_n, valid)
  lr_scale = ess_lr_scale(rho, cfg.rho_on, cfg.ess_rule) if cfg.ess_lr else jnp.float32(1.0)

  def vmean(x):
    return jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(n_valid, 1.0)

  def vstd(x):
    return jnp.sqrt(vmean(jnp.square(x - vmean(x))))

  if WEIGHT_VARIANTS[cfg.is_variant].level == "token":  # a fraction of the valid rows' tokens
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
    **_tis_ess_metrics(aux_n, cfg),
  )


def _tis_ess_metrics(aux_n, cfg: PGConfig) -> dict[str, jax.Array]:
  """c_t of "tis_ess" (train/tis_c, train/tis_log_c; re-solved from the [N] rows, cheap), else nothing.

  tis_ess_reached is 0 when even c = 1 cannot reach the target (then c_t = 1).
  """
  if cfg.is_variant != "tis_ess":
    return {}
  lc = jnp.clip(aux_n["log_ratio_n"], -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
  info = ess_target_truncation(lc, cfg.tis_ess_target, valid_n=aux_n["valid_n"])
  return {"tis_c": info["c"], "tis_log_c": info["log_c"], "tis_ess_reached": info["reached"]}


def pg_coefficients(
  logp_nt, behavior_logp_nt, mask_nt, rewards_n, group_id_n, sq_score_norms_n, cfg: PGConfig, *, divisor=None
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
      exact token-SUM score); None allowed when not needs_sq_norms(cfg). The
      variant OPOB uses is derived here: / L_n^2 if length_normalize_norms,
      * w~_n^2 in reference_mode (the reference measures the norm of the
      w~-weighted token-sum loss).
    cfg: PGConfig.
    divisor: Z to use instead of loss_divisor(rows of this batch, cfg): a
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
  if needs_sq_norms(cfg) and sq_score_norms_n is None:
    raise ValueError(
      "sq_score_norms_n: None, but cfg.opob=True needs ||s_n||^2 (vcpo_jax.grad_norms: ghost norms or "
      "per_example_sq_grad_norms)"
    )
  rows = _pg_rows(logp_nt, behavior_logp_nt, mask_nt, rewards_n, group_id_n, sq_score_norms_n, cfg)
  z = loss_divisor(rows, cfg) if divisor is None else jnp.asarray(divisor, jnp.float32)
  coef_n = sg(rows.pop("unnormalized_coef_n") / z)
  return coef_n, dict(pg_metrics(rows, cfg), **rows)


def policy_loss_kwargs(cfg: PGConfig) -> dict[str, Any]:
  """cfg.policy_loss_kw "name=value,..." -> {name: value}: None / True / False, a number, else the string.

  E.g. "eps_high=0.28,dual_clip_c=3,loss_agg=token-mean". The names and values are checked by
  policy_losses.make_policy_loss (PGConfig.__post_init__ calls it).
  """
  kw: dict[str, Any] = {}
  special = {"None": None, "True": True, "False": False}
  for item in filter(None, (x.strip() for x in cfg.policy_loss_kw.split(","))):
    name, eq, value = (x.strip() for x in item.partition("="))
    if not eq or not name or not value:
      raise ValueError(f"PGConfig.policy_loss_kw={cfg.policy_loss_kw!r}: {item!r} is not name=value")
    if value in special:
      kw[name] = special[value]
      continue
    try:
      kw[name] = float(value)
    except ValueError:
      kw[name] = value  # a name, e.g. loss_agg=token-mean
  return kw


@dataclasses.dataclass(frozen=True)
class Surrogate:
  """The surrogate loss -sum_n coef_n sum_t tokw_nt logp_nt as a value: its aggregation options, and score
  centering (each token's score less sum_v sg[c_v] log p_v, vcpo_jax/score_centering.py: it needs the model's
  head, so `Method.loss_fn` on logp_nt alone is the uncentered surrogate; the learner adds the term)."""

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

  def pg_fields(self) -> dict[str, Any]:
    """The PGConfig fields of this choice."""
    return {
      "policy_loss": "pg",
      "loss_agg": self.loss_agg,
      "mask_normalizer": self.mask_normalizer,
      "loss_norm_tokens": self.loss_norm_tokens,
      **({"score_centering": self.score_centering, "sc_topk": self.sc_topk} if self.score_centering != "off" else {}),
    }


def surrogate(
  loss_agg="seq-mean-token-mean", mask_normalizer="all", loss_norm_tokens=0, score_centering="off", sc_topk=0
) -> Surrogate:
  """The VCPO surrogate with aggregation loss_agg (rl.aggregation) over the valid ("all") or kept rows;
  score_centering 'exact' | 'topk' (with the sampler's top-k width sc_topk) centers every token's score."""
  return Surrogate(loss_agg, mask_normalizer, loss_norm_tokens, score_centering, sc_topk)
