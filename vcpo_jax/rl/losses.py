"""The stabilizers the field uses, as policy losses: pure, jittable, registered by name.

Dimension legend: N trajectories, T tokens.

Notation:
  mu       = behaviour (sampler) probability          behavior_logp_nt  (stop-gradient)
  pi_old   = the learner's policy at the start of the  old_logp_nt       (stop-gradient)
             trainer step, recomputed once per step
  pi_theta = the current policy                       logp_nt           (differentiable)
  r_t   = pi_theta / pi_old,   rho_t = pi_old / mu,   A = advantage (per row [N] or per token [N, T])

Every loss has the signature

  loss, metrics = fn(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt, **hyper_parameters)

and returns the scalar loss to MINIMIZE (the negative objective) and a dict of scalar metrics (clip and
masked fractions over the valid tokens, the ESS ratio of the sequence log-ratio l_n = sum_t (log pi_theta -
log mu), so every method reports the same ESS metrics as VCPO, and method-specific numbers). Only logp_nt
is differentiated: old/behaviour log-probs and advantages are wrapped in stop_gradient, and every
coefficient a source detaches (CISPO's clipped ratio, GSPO's sequence ratio, the masks, M2PO's tau, IcePop's
weight) is detached here too. Where the source differentiates a ratio (PPO, GSPO, DPPO-TV, M2PO), the
ratio is differentiated here: d r / d logp = r.

Masked positions (mask_nt == 0) may hold -inf / garbage: every input is replaced by 0 there before use,
and they get zero loss and zero gradient. Rows with an empty mask are padding (they count in no
normalizer).

Aggregations (`loss_agg`): the names of `vcpo_jax.rl.aggregation.LOSS_AGGREGATIONS` (the registry the
surrogate uses too), with L_n = sum_t mask_nt, n = #rows with L_n > 0:
  "token-mean"          sum_nt mask l_nt / sum_n L_n              (verl / AReaL / prime-rl default)
  "seq-mean-token-mean" (1 / n) sum_n (1 / L_n) sum_t mask l_nt   (GSPO; slime's per-sample mean)
  "seq-mean-token-sum"  (1 / n) sum_n sum_t mask l_nt

`POLICY_LOSSES` maps each name to its function and source (the `register` decorator); a registered loss
called with keyword arguments only is its factory, a `PeerLoss` value (`ppo_clip(eps_high=0.28)`, for
rl.method.Method); `make_policy_loss(name, **hp)` binds checked hyper-parameters and returns a function of
the five arrays. Departures from the sources are listed in each docstring.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from vcpo_jax.rl.aggregation import LOSS_AGGREGATIONS, aggregate
from vcpo_jax.rl.ess import ess_ratio, log_mean_weight

sg = jax.lax.stop_gradient

# verl clamps log r to [-20, 20] before exp (overflow guard); its gradient is 0 outside.
VERL_LOG_RATIO_CLAMP = 20.0
# The M2PO authors' "no constraint" upper ratio bound (their code returns 100000 when no clip is needed).
M2PO_NO_CLIP_HIGH = 1e5

# ---------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
  """A named policy loss: fn(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt, **hp).

  Calling it with the five arrays computes the loss, fn(*arrays, **hp); calling it with keyword arguments
  only is the loss's factory: a `PeerLoss` value with those hyper-parameters bound (checked now), e.g.
  `ppo_clip(eps_low=0.2, eps_high=0.28)`. The factory's signature is the loss's keyword-only arguments.
  """

  name: str
  fn: Callable[..., tuple[jax.Array, dict]]
  source: str

  def __call__(self, *arrays, **hyper_parameters):
    if arrays:
      return self.fn(*arrays, **hyper_parameters)
    own = {k: v for k, v in self.defaults.items() if k not in STEP_INPUTS}  # every default, so equal losses are ==
    return PeerLoss(self.name, tuple(sorted({**own, **hyper_parameters}.items())))

  @property
  def doc(self) -> str:
    """The first line of the loss function's docstring (read off the function: cannot drift from it)."""
    return (self.fn.__doc__ or "").strip().splitlines()[0] if (self.fn.__doc__ or "").strip() else ""

  @property
  def defaults(self) -> Mapping[str, Any]:
    """The hyper-parameters and their defaults, read off the signature (cannot drift from it)."""
    params = inspect.signature(self.fn).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register(source: str) -> Callable[[Callable[..., tuple[jax.Array, dict]]], PolicyLoss]:
  """Decorator: register a loss function under its own name with its source; returns its PolicyLoss.

  Adding a peer loss is this decorator on one function (its keyword-only arguments are its
  hyper-parameters) plus one preset line (vcpo_jax/rl/method.py PRESETS).
  """

  def wrap(fn):
    _check(fn.__name__ not in POLICY_LOSSES, "policy loss", fn.__name__, "the name is registered already")
    POLICY_LOSSES[fn.__name__] = PolicyLoss(fn.__name__, fn, source)
    return POLICY_LOSSES[fn.__name__]

  return wrap


@dataclasses.dataclass(frozen=True)
class PeerLoss:
  """A registered policy loss with its hyper-parameters bound: a hashable value (jit-static).

  hyper_parameters: sorted (name, value) pairs, every one of the loss's (the factory fills in the defaults);
  checked at construction (`make_policy_loss`).
  """

  name: str
  hyper_parameters: tuple[tuple[str, Any], ...] = ()
  needs: tuple[str, ...] = ()  # step inputs the learner binds by name at each update (STEP_INPUTS)

  def __post_init__(self):
    unknown = sorted(set(self.needs) - set(STEP_INPUTS))
    if unknown:
      raise ValueError(f"{self.name}: needs {unknown}; the learner provides {sorted(STEP_INPUTS)}")
    make_policy_loss(self.name, **self.kwargs)

  @property
  def kwargs(self) -> dict[str, Any]:
    return dict(self.hyper_parameters)

  def bind(self, **inputs) -> Callable[..., tuple[jax.Array, dict]]:
    """f(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt) -> (loss, metrics), jittable.

    inputs: the step inputs this loss needs (`needs`), by name; the others are ignored."""
    missing = sorted(set(self.needs) - set(inputs))
    if missing:
      raise ValueError(f"{self.name}: needs the step inputs {missing} ({STEP_INPUTS})")
    return make_policy_loss(self.name, **self.kwargs, **{k: inputs[k] for k in self.needs})


# What a loss may declare in PeerLoss.needs, and what the learner passes under each name.
STEP_INPUTS = {
  "behavior_version": "batch['policy_version'] [N]: the policy version that sampled each row",
  "current_version": "the version the update produces (the learner's step + 1)",
}


def decoupled_ppo_loglinear(**hyper_parameters) -> PeerLoss:
  """decoupled_ppo with AReaL's log-linear approximate pi_prox (`loglinear_prox_logp`): it needs the rows'
  behaviour versions and the learner's version, which the learner binds at each update."""
  return dataclasses.replace(decoupled_ppo(**hyper_parameters), needs=("behavior_version", "current_version"))


def _inputs(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt):
  """float32 arrays, 0 at masked positions; advantages broadcast to [N, T]; all but logp stop-gradient."""
  m = jnp.asarray(mask_nt) != 0
  lp = jnp.where(m, jnp.asarray(logp_nt, jnp.float32), 0.0)
  old = jnp.where(m, sg(jnp.asarray(old_logp_nt, jnp.float32)), 0.0)
  beh = jnp.where(m, sg(jnp.asarray(behavior_logp_nt, jnp.float32)), 0.0)
  adv = sg(jnp.asarray(advantages, jnp.float32))
  if adv.ndim == 1:
    adv = adv[:, None]
  adv = jnp.where(m, jnp.broadcast_to(adv, m.shape), 0.0)
  return lp, old, beh, adv, m


def _token_mean(x_nt, m_nt):
  """Mean of x over the True positions of m (0 when there are none)."""
  m = m_nt.astype(jnp.float32)
  return jnp.sum(jnp.where(m_nt, x_nt, 0.0)) / jnp.maximum(jnp.sum(m), 1.0)


def _common_metrics(lp, beh, m):
  """The ESS metrics every method reports: of l_n = sum_t (sg log pi_theta - log mu) over valid rows."""
  d = jnp.where(m, sg(lp) - beh, 0.0)
  l_n = jnp.sum(d, axis=-1)
  valid = jnp.any(m, axis=-1)
  return {
    "ess_ratio": ess_ratio(l_n, valid),
    "log_ratio_mean": jnp.sum(jnp.where(valid, l_n, 0.0)) / jnp.maximum(jnp.sum(valid), 1),
    "log_mean_weight": log_mean_weight(l_n, valid),
    "token_log_ratio_abs_mean": _token_mean(jnp.abs(d), m),
  }


def _clip_metrics(clipped, dual, lp, beh, m, **extra):
  """A clipped-ratio loss's metrics: clip_frac, dual_clip_frac, its own extra ones, and _common_metrics.

  clip_frac: the fraction of loss tokens whose clipped term is the active one (verl pg_clipfrac);
  dual_clip_frac: of those capped by the dual clip (verl pg_clipfrac_lower), only when dual is not None.
  """
  out = dict(clip_frac=_token_mean(clipped, m))
  if dual is not None:
    out["dual_clip_frac"] = _token_mean(dual, m)
  return dict(out, **extra, **_common_metrics(lp, beh, m))


def _check(cond, field, value, fix):
  if not cond:
    raise ValueError(f"{field}={value!r}: {fix}")


def _check_agg(loss_agg):
  _check(loss_agg in LOSS_AGGREGATIONS, "loss_agg", loss_agg, f"choose one of {sorted(LOSS_AGGREGATIONS)}")


def _check_eps(eps_low, eps_high):
  _check(eps_low is not None and eps_low >= 0, "eps_low", eps_low, "must be >= 0")
  _check(eps_high is not None and eps_high >= 0, "eps_high", eps_high, "must be >= 0")


def _check_dual(dual_clip_c):
  _check(dual_clip_c is None or dual_clip_c > 1.0, "dual_clip_c", dual_clip_c, "must be > 1 (or None: no dual clip)")


def _ppo_token_loss(log_r, adv, eps_low, eps_high, dual_clip_c):
  """verl compute_policy_loss_vanilla per token: -min(r A, clip(r) A), dual clip for A < 0.

  Returns (loss_nt, clipped_nt, dual_clipped_nt); r = exp(log_r) is differentiated through log_r.
  """
  r = jnp.exp(log_r)
  pg1 = -adv * r
  pg2 = -adv * jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high)
  pg = jnp.maximum(pg1, pg2)
  clipped = pg2 > pg1
  if dual_clip_c is None:
    return pg, clipped, jnp.zeros_like(clipped)
  pg3 = -adv * dual_clip_c
  dual = (adv < 0) & (pg > pg3)
  return jnp.where(adv < 0, jnp.minimum(pg, pg3), pg), clipped, dual


# ---------------------------------------------------------------------------
# PPO clip, decoupled PPO
# ---------------------------------------------------------------------------


@register("verl core_algos.py compute_policy_loss_vanilla")
def ppo_clip(
  logp_nt,
  old_logp_nt,
  behavior_logp_nt,
  advantages,
  mask_nt,
  *,
  eps_low=0.2,
  eps_high=0.2,
  dual_clip_c=None,
  loss_agg="token-mean",
  log_ratio_clamp=VERL_LOG_RATIO_CLAMP,
):
  """Token-level PPO clip (Schulman et al. 2017) with optional dual clip (Ye et al. 2020).

    r_t   = exp(clamp(log pi_theta - log pi_old, -20, 20))
    l_t   = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)
    A < 0 with dual_clip_c = c:  l_t = min(l_t, -c A)       (caps the loss of a huge ratio)
    loss  = aggregate(l, loss_agg)

  Source: verl core_algos.py `compute_policy_loss_vanilla` (clip_ratio_low / clip_ratio_high / clip_ratio_c,
  the log-ratio clamp, token-mean default). The gradient flows through r_t (d r / d logp = r) where the
  unclipped branch is active and is 0 where the clip is active. mu is not used: PPO corrects only the
  drift inside a trainer step (it needs learner.ppo_epochs / minibatches > 1 to matter).

  Departure from verl: the dual clip is off by default (dual_clip_c=None); verl always applies it with
  clip_ratio_c = 3.0. They differ on tokens with A < 0 and r_t > 3: e.g. N = T = 1, log pi_theta = -0.00531,
  log pi_old = -2.16321, A = -0.44721 has d loss / d logp = -r A = 3.87 here and 0 in verl. Pass
  dual_clip_c=3.0 (`ppo_clip(dual_clip_c=3.0)`) for verl's loss. The default stays
  off because the countdown stability study's ppo_clip runs were made without it.

  Metrics: clip_frac (tokens whose clipped term is the active one, verl pg_clipfrac), dual_clip_frac
  (verl pg_clipfrac_lower), approx_kl = mean(log pi_old - log pi_theta) (verl ppo_kl).
  """
  _check_eps(eps_low, eps_high)
  _check_dual(dual_clip_c)
  _check_agg(loss_agg)
  lp, old, beh, adv, m = _inputs(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt)
  log_r = jnp.clip(lp - old, -log_ratio_clamp, log_ratio_clamp)
  loss_nt, clipped, dual = _ppo_token_loss(log_r, adv, eps_low, eps_high, dual_clip_c)
  metrics = _clip_metrics(clipped, dual, lp, beh, m, approx_kl=_token_mean(-sg(log_r), m))
  return aggregate(loss_nt, m, loss_agg), metrics


def loglinear_prox_logp(logp_nt, behavior_logp_nt, behavior_version, current_version):
  """AReaL's approximate proximal log-probs (no forward pass), stop-gradient.

    log pi_prox ~= log mu + alpha (sg[log pi_theta] - log mu),
    alpha = clip((v_prox - v_mu) / (v_theta - v_mu), 0, 1),  v_prox = v_theta - 1,
    alpha = 0 where v_theta - v_mu <= 0 or v_mu < 0 (prompt tokens).

  Log-linear interpolation (a geometric mean in probability space) between the behaviour policy of version
  v_mu and the current policy of version v_theta, at the proximal version one update behind v_theta.
  Source: AReaL areal/engine/ppo/actor.py `compute_prox_logp_approximations` (method "loglinear").

  Args:
    logp_nt: [N, T] current log-probs (only their value is used).
    behavior_logp_nt: [N, T] behaviour log-probs.
    behavior_version: [N] or [N, T] policy version that sampled each row / token.
    current_version: scalar version of the current policy (v_theta).
  """
  v_mu = jnp.asarray(behavior_version, jnp.float32)
  if v_mu.ndim == 1:
    v_mu = v_mu[:, None]
  v_theta = jnp.asarray(current_version, jnp.float32)
  diff = v_theta - v_mu
  alpha = jnp.where((diff > 0) & (v_mu >= 0), (v_theta - 1.0 - v_mu) / jnp.where(diff > 0, diff, 1.0), 0.0)
  alpha = jnp.clip(alpha, 0.0, 1.0)
  beh = jnp.asarray(behavior_logp_nt, jnp.float32)
  return sg(beh + alpha * (sg(jnp.asarray(logp_nt, jnp.float32)) - beh))


@register("AReaL functional.py ppo_actor_loss_fn + actor.py")
def decoupled_ppo(
  logp_nt,
  old_logp_nt,
  behavior_logp_nt,
  advantages,
  mask_nt,
  *,
  eps_low=0.2,
  eps_high=0.2,
  dual_clip_c=None,
  behav_imp_weight_cap=None,
  behavior_version=None,
  current_version=None,
  loss_agg="token-mean",
):
  """Decoupled PPO (Hilton et al. 2022; AReaL): the clip trusts pi_prox, the IS weight corrects mu.

    r'_t = pi_theta / pi_prox
    l_t  = -sg(pi_prox / mu) * min(r'_t A, clip(r'_t, 1 - eps_low, 1 + eps_high) A)
    dual clip c:  the clipped loss is capped at c |A| (acts for A < 0 only, as in AReaL)
    behav_imp_weight_cap: tokens with pi_prox / mu > cap get weight 0 (AReaL's token-level rejection)

  pi_prox, two forms:
    EXACT (default): old_logp_nt IS pi_prox, e.g. the proximal version kept in the parameter ring in lag /
      async mode, or pi_old recomputed at the start of the step; no approximation (AReaL PR #600 needs one).
    APPROXIMATE: pass behavior_version and current_version; pi_prox is then AReaL's log-linear
      interpolation `loglinear_prox_logp` (old_logp_nt is ignored).

  Source: AReaL `ppo_actor_loss_fn` (proximal_logprobs, c_clip, token-mean over loss_mask) with its
  `rejection_sampling` config (RejectionSamplingConfig, applied by `apply_rejection_sampling` on
  pi_prox / mu; AReaL PR #1088 replaced the earlier behav_imp_weight_cap / behave_imp_weight_mode, whose
  "token mask above the cap" is the behaviour kept here), and `grpo_loss_fn`'s proximal log-prob
  methods (recompute / loglinear). No log-ratio clamp (AReaL has none). The argument keeps the older
  name behav_imp_weight_cap (one cap, token level); AReaL's other rejection levels and bounds are not
  ported.

  Metrics: clip_frac, dual_clip_frac, frac_masked (tokens dropped by the cap), behav_weight_mean (over the
  kept tokens).
  """
  _check_eps(eps_low, eps_high)
  _check_dual(dual_clip_c)
  _check_agg(loss_agg)
  _check(
    behav_imp_weight_cap is None or behav_imp_weight_cap > 0,
    "behav_imp_weight_cap",
    behav_imp_weight_cap,
    "must be > 0",
  )
  _check(
    (behavior_version is None) == (current_version is None),
    "current_version",
    current_version,
    "pass both behavior_version and current_version (approximate pi_prox) or neither (exact pi_prox)",
  )
  lp, prox, beh, adv, m = _inputs(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt)
  if behavior_version is not None:
    prox = jnp.where(m, loglinear_prox_logp(lp, beh, behavior_version, current_version), 0.0)
  loss_nt, clipped, dual = _ppo_token_loss(lp - prox, adv, eps_low, eps_high, None)
  if dual_clip_c is not None:
    cap = dual_clip_c * jnp.abs(adv)
    dual = loss_nt > cap
    loss_nt = jnp.minimum(loss_nt, cap)
  bw = jnp.exp(prox - beh)
  keep = m if behav_imp_weight_cap is None else m & (bw <= behav_imp_weight_cap)
  bw = jnp.where(keep, bw, 0.0)
  metrics = _clip_metrics(
    clipped, dual, lp, beh, m, frac_masked=_token_mean(~keep, m), behav_weight_mean=_token_mean(bw, keep)
  )
  return aggregate(loss_nt * bw, m, loss_agg), metrics


# ---------------------------------------------------------------------------
# GSPO, CISPO
# ---------------------------------------------------------------------------


@register("verl core_algos.py compute_policy_loss_gspo")
def gspo(
  logp_nt,
  old_logp_nt,
  behavior_logp_nt,
  advantages,
  mask_nt,
  *,
  eps_low=3e-4,
  eps_high=4e-4,
  log_ratio_max=10.0,
  loss_agg="seq-mean-token-mean",
):
  """GSPO (Zheng et al. 2025): a sequence ratio, clipped at the sequence level.

    s_n    = exp((1 / L_n) sum_t mask (log pi_theta - log pi_old))       geometric-mean ratio
    s_nt   = exp(min(log pi_theta - sg[log pi_theta] + sg[log s_n], 10))  (value s_n, d/dlogp_t = s_n)
    l_nt   = -min(s_nt A, clip(s_nt, 1 - 3e-4, 1 + 4e-4) A)
    loss   = seq-mean-token-mean of l

  With a per-row advantage the gradient, -(1 / N) sum_n s_n A_n (1 / L_n) sum_t grad log pi_theta(t) on the
  unclipped rows, is exactly the gradient of GSPO's sequence objective -(1 / N) sum_n min(s_n A_n, ...);
  the token form also accepts per-token advantages (GSPO-token).

  Source: verl core_algos.py `compute_policy_loss_gspo` (the token form, the clamp of the log at 10 whose
  gradient is 0 beyond, clip_ratio_low 3e-4 / clip_ratio_high 4e-4 of the GSPO recipe, and the forced
  seq-mean-token-mean aggregation).

  Metrics: clip_frac (tokens of rows whose clipped term is active), seq_ratio_mean (mean s_n over rows).
  """
  _check_eps(eps_low, eps_high)
  _check_agg(loss_agg)
  lp, old, beh, adv, m = _inputs(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt)
  L = jnp.sum(m.astype(jnp.float32), axis=-1)
  log_s_n = sg(jnp.sum(jnp.where(m, lp - old, 0.0), axis=-1) / jnp.maximum(L, 1.0))
  log_s_nt = jnp.minimum(lp - sg(lp) + log_s_n[:, None], log_ratio_max)
  loss_nt, clipped, _ = _ppo_token_loss(log_s_nt, adv, eps_low, eps_high, None)
  valid = L > 0
  seq_ratio_mean = jnp.sum(jnp.where(valid, jnp.exp(log_s_n), 0.0)) / jnp.maximum(jnp.sum(valid), 1)
  metrics = _clip_metrics(clipped, None, lp, beh, m, seq_ratio_mean=seq_ratio_mean)
  return aggregate(loss_nt, m, loss_agg), metrics


@register("verl core_algos.py compute_policy_loss_cispo; MiniMax-M1")
def cispo(
  logp_nt,
  old_logp_nt,
  behavior_logp_nt,
  advantages,
  mask_nt,
  *,
  eps_low=10.0,
  eps_high=0.2,
  loss_agg="token-mean",
  log_ratio_clamp=VERL_LOG_RATIO_CLAMP,
):
  """CISPO (MiniMax-M1, arXiv 2506.13585): clip the IS weight, keep every token's gradient.

    r_t  = exp(clamp(log pi_theta - log pi_old, -20, 20))
    loss = -(1 / sum_n |o_n|) sum_nt sg[clip(r_t, 1 - eps_low, 1 + eps_high)] A log pi_theta

  eps_low = 10 makes the lower bound negative (no lower clip), eps_high = 0.2: the verl CISPO example.
  Unlike PPO, a clipped token still contributes sg[clip(r)] A grad log pi_theta.

  Source: verl core_algos.py `compute_policy_loss_cispo` (its clip_ratio_low / clip_ratio_high bounds on
  the ratio, safe exp with clip 20, token-mean): the math and the eps_low / eps_high names follow verl,
  not SkyRL's cispo fields; MiniMax-M1 eq. 4-5. The loss VALUE is -clip(r) A log pi_theta (it contains log pi, not
  the ratio), as in verl; only its gradient is meaningful.

  Metrics: clip_frac (tokens whose weight differs from r_t).
  """
  _check_eps(eps_low, eps_high)
  _check_agg(loss_agg)
  lp, old, beh, adv, m = _inputs(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt)
  r = jnp.exp(jnp.clip(sg(lp) - old, -log_ratio_clamp, log_ratio_clamp))
  w = sg(jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high))
  metrics = _clip_metrics(w != r, None, lp, beh, m, weight_mean=_token_mean(w, m))
  return aggregate(-w * adv * lp, m, loss_agg), metrics


# ---------------------------------------------------------------------------
# M2PO: the paper's masking (AReaL) and the authors' released clip
# ---------------------------------------------------------------------------


def m2po_mask(m2_nt, mask_nt, budget):
  """AReaL's M2PO token mask: drop the largest second moments until the mean of the rest is < budget.

  Over the valid tokens (a flat set, the whole batch passed in), sorted by m2 descending: k is the first
  index whose suffix mean (the mean of m2 over the tokens from k on) is < budget, or n - 1 when there is
  none (AReaL keeps one token); the k largest are masked. Ties: a stable sort keeps the earlier (row-major)
  token first, so it is masked first; torch's sort leaves tie order unspecified.
  Source: AReaL areal/engine/ppo/actor.py `_apply_m2po_masking` / `_get_m2po_loss_mask`.

  Args:
    m2_nt: [N, T] second moments (>= 0), e.g. (log pi_old - log mu)^2.
    mask_nt: [N, T] loss mask.
    budget: the threshold (0.04 in the M2PO paper).
  Returns:
    [N, T] bool: True = kept (always False where mask_nt is 0).
  """
  valid = (jnp.asarray(mask_nt) != 0).reshape(-1)
  m2 = sg(jnp.asarray(m2_nt, jnp.float32)).reshape(-1)
  key = jnp.where(valid, m2, -1.0)  # invalid entries sort after every valid one (m2 >= 0)
  order = jnp.argsort(-key, stable=True)
  idx = jnp.arange(key.shape[0])
  n = jnp.sum(valid)
  in_set = idx < n
  vals = jnp.where(in_set, key[order], 0.0)
  suffix_sum = jnp.flip(jnp.cumsum(jnp.flip(vals)))
  suffix_mean = suffix_sum / jnp.maximum(n - idx, 1).astype(jnp.float32)
  below = in_set & (suffix_mean < budget)
  k = jnp.where(jnp.any(below), jnp.argmax(below), jnp.maximum(n - 1, 0))
  rank = jnp.zeros_like(idx).at[order].set(idx)
  return (valid & (rank >= k)).reshape(jnp.shape(mask_nt))


@register("M2PO paper; AReaL actor.py _apply_m2po_masking")
def m2po_paper(
  logp_nt,
  old_logp_nt,
  behavior_logp_nt,
  advantages,
  mask_nt,
  *,
  budget=0.04,
  loss_agg="token-mean",
):
  """M2PO as in its paper and AReaL: second-moment token masking.

    m2_t = (log pi_old - log mu)^2             (AReaL: (log p_behave - log p_prox)^2; stop-gradient)
    M    = m2po_mask(m2, mask, budget)         drop the largest m2 until the mean of the rest < budget
    loss = -(1 / sum_n |o_n|) sum_nt M_t r_t A,  r_t = pi_theta / mu  (differentiated: d r / d logp = r)

  The mask is fixed for the trainer step (pi_old, not pi_theta: with several minibatches the masked set
  does not move). Departures from AReaL, which feeds the M-mask into its decoupled PPO loss: no PPO clip
  (the paper's objective has none; AReaL adds eps_clip on pi_theta / pi_prox) and the normalizer is
  sum |o| of the ORIGINAL mask, as the paper writes it (AReaL's token-mean over the M-mask divides by the
  kept tokens). The VCPO paper's M2PO comparison used this formulation.

  Source: AReaL `grpo_loss_fn` with m2_threshold (its M2PO masking of (log p_behave - log p_prox)^2; the
  surrounding decoupled loss now filters stale tokens through `rejection_sampling`, AReaL PR #1088, which is
  not part of the paper's objective and is not applied here) and the M2PO paper's objective.

  Metrics: frac_masked, m2_mean (before), m2_kept_mean (after masking).
  """
  _check(budget > 0, "budget", budget, "the M2 budget must be > 0 (the paper uses 0.04)")
  _check_agg(loss_agg)
  lp, old, beh, adv, m = _inputs(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt)
  m2 = jnp.square(old - beh)
  keep = m2po_mask(m2, m, budget)
  r = jnp.exp(jnp.where(keep, lp - beh, 0.0))
  metrics = dict(
    frac_masked=_token_mean(~keep, m),
    m2_mean=_token_mean(m2, m),
    m2_kept_mean=_token_mean(m2, keep),
    **_common_metrics(lp, beh, m),
  )
  return aggregate(jnp.where(keep, -r * adv, 0.0), m, loss_agg), metrics


def m2po_tau(delta_sq, harmful, budget, *, exact=False):
  """tau with mean_i min(delta_i^2, tau^2) ~= budget over the harmful tokens (the authors' solver).

  v = sorted harmful delta^2 (ascending), n of them, target S = budget * n. k is the first index with
  sum_{i<=k} v_i + v_k (n - k - 1) >= S (the capped sum at tau^2 = v_k reaches S). The authors return the
  breakpoint below it, tau^2 = v_{k-1} (0 when k = 0), whose capped mean is < budget; exact=True solves
  the piecewise-linear equation instead: tau^2 = (S - sum_{i<k} v_i) / (n - k). Their -1e-12 guards are
  dropped (float32 here).
  Source: M2PO authors' verl/trainer/ppo/core_algos.py `_solve_tau_from_sorted_delta2`.

  Args:
    delta_sq: [...] delta^2 per token; harmful: [...] bool, the tokens in the set.
    budget: M2 budget (> 0).
  Returns:
    (tau, m2_now, need_clip): scalar tau >= 0 (meaningful when need_clip), the mean delta^2 over the
    harmful tokens, and whether it exceeds the budget (n > 0 and m2_now > budget).
  """
  h = harmful.reshape(-1)
  v = jnp.where(h, sg(delta_sq).reshape(-1).astype(jnp.float32), jnp.inf)
  v = jnp.sort(v)
  n = jnp.sum(h)
  nf = n.astype(jnp.float32)
  idx = jnp.arange(v.shape[0])
  in_set = idx < n
  vv = jnp.where(in_set, v, 0.0)
  csum = jnp.cumsum(vv)
  total = csum[-1]
  m2_now = total / jnp.maximum(nf, 1.0)
  need_clip = (n > 0) & (m2_now > budget)
  target = budget * nf
  cond = in_set & (csum + vv * (nf - idx - 1) >= target)
  k = jnp.where(jnp.any(cond), jnp.argmax(cond), jnp.maximum(n - 1, 0))
  prev = jnp.maximum(k - 1, 0)
  if exact:
    before = jnp.where(k > 0, csum[prev], 0.0)
    tau2 = (target - before) / jnp.maximum(nf - k, 1.0)
  else:
    tau2 = jnp.where(k > 0, vv[prev], 0.0)
  return jnp.sqrt(jnp.maximum(tau2, 0.0)), m2_now, need_clip


@register("Infini-AI-Lab/M2PO core_algos.py compute_m2po_policy_loss")
def m2po_released(
  logp_nt,
  old_logp_nt,
  behavior_logp_nt,
  advantages,
  mask_nt,
  *,
  budget=0.04,
  min_eps_low=0.3,
  min_eps_high=0.5,
  exact_tau=False,
  loss_agg="token-mean",
):
  """M2PO as the authors' released code does it: a second-moment budget sets one PPO clip per call.

    r_t     = pi_theta / mu,  delta_t = log mu - sg[log pi_theta]
    harmful = valid & ((A > 0 & r > 1) | (A < 0 & r < 1))
    m2      = mean_harmful delta^2;  if m2 > budget: tau from mean_harmful min(delta^2, tau^2) = budget
              (`m2po_tau`), lo = e^-tau, hi = e^tau;  else (or no harmful token): lo = 0, hi = 1e5
    eps_low = max(1 - lo, min_eps_low),  eps_high = max(hi - 1, min_eps_high)      (stop-gradient)
    loss    = token-mean of -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)        (no dual clip)

  The bounds are recomputed on every call, i.e. per micro-batch as in the authors' trainer. Their
  `old_log_probs` are computed when the rollout is generated and then kept in the stale-data queue, i.e.
  they are the behaviour policy's: hence mu here, not pi_old (with pi_old recomputed, r = 1 at the first
  update and the method would do nothing). old_logp_nt is unused.

  Source: M2PO authors' (Infini-AI-Lab/M2PO) verl/trainer/ppo/core_algos.py `compute_m2po_policy_loss`,
  `kpo_clip_harmful_tokens`, `_get_trust_region_tokens_delta_sq`, `_solve_tau_from_sorted_delta2`; the
  sign of A is their advantages[:, 0] (the row's advantage), here the token's (equal for per-row A).
  Departure: their launch scripts pass miniclip_low / miniclip_high = None (no floor); the function
  defaults 0.3 / 0.5 (the issue's) are kept here; pass min_eps_low=None / min_eps_high=None for the
  scripts' behaviour.

  Metrics: tau (0 when the budget is not exceeded), budget_active (1 when it is: the bounds come from tau),
  eps_low, eps_high, m2 (before), m2_after (mean min(delta^2, tau^2) over the harmful tokens), frac_harmful,
  clip_frac.
  """
  _check(budget > 0, "budget", budget, "the M2 budget must be > 0 (the authors use 0.04)")
  _check(min_eps_low is None or min_eps_low >= 0, "min_eps_low", min_eps_low, "must be >= 0 or None")
  _check(min_eps_high is None or min_eps_high >= 0, "min_eps_high", min_eps_high, "must be >= 0 or None")
  _check_agg(loss_agg)
  lp, _, beh, adv, m = _inputs(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt)
  delta = beh - sg(lp)
  r_val = jnp.exp(-delta)
  harmful = m & (((adv > 1e-12) & (r_val > 1.0 + 1e-12)) | ((adv < -1e-12) & (r_val < 1.0 - 1e-12)))
  d2 = jnp.square(delta)
  tau, m2_now, need_clip = m2po_tau(d2, harmful, budget, exact=exact_tau)
  lo = jnp.where(need_clip, jnp.exp(-tau), 0.0)
  hi = jnp.where(need_clip, jnp.exp(tau), M2PO_NO_CLIP_HIGH)
  eps_low, eps_high = 1.0 - lo, hi - 1.0
  if min_eps_low is not None:
    eps_low = jnp.maximum(eps_low, min_eps_low)
  if min_eps_high is not None:
    eps_high = jnp.maximum(eps_high, min_eps_high)
  eps_low, eps_high = sg(eps_low), sg(eps_high)
  loss_nt, clipped, _ = _ppo_token_loss(lp - beh, adv, eps_low, eps_high, None)
  m2_after = jnp.where(need_clip, _token_mean(jnp.minimum(d2, jnp.square(tau)), harmful), m2_now)
  metrics = _clip_metrics(
    clipped,
    None,
    lp,
    beh,
    m,
    tau=jnp.where(need_clip, tau, 0.0),
    budget_active=need_clip.astype(jnp.float32),
    eps_low=eps_low,
    eps_high=eps_high,
    m2=m2_now,
    m2_after=m2_after,
    frac_harmful=_token_mean(harmful, m),
  )
  return aggregate(loss_nt, m, loss_agg), metrics


# ---------------------------------------------------------------------------
# IcePop, DPPO-TV
# ---------------------------------------------------------------------------


@register("slime megatron_utils/loss.py icepop_function")
def icepop(
  logp_nt,
  old_logp_nt,
  behavior_logp_nt,
  advantages,
  mask_nt,
  *,
  lower=0.5,
  upper=5.0,
  eps_low=0.2,
  eps_high=0.2,
  dual_clip_c=None,
  loss_agg="seq-mean-token-mean",
  log_ratio_clamp=VERL_LOG_RATIO_CLAMP,
):
  """IcePop: the PPO clip loss times a masked token IS weight of the learner / sampler mismatch.

    rho_t = pi_old / mu                                          (stop-gradient)
    w_t   = rho_t if lower <= rho_t <= upper else 0              (defaults [0.5, 5]; both edges kept)
    l_t   = w_t * ppo_clip_t(pi_theta / pi_old, eps_low, eps_high, dual clip c)
    loss  = aggregate(l, loss_agg)

  Source: slime slime/backends/megatron_utils/loss.py `icepop_function` (tis_clip_low / tis_clip, the weight
  of old_log_probs - rollout_log_probs, multiplied onto slime's PPO pg_loss) and slime/utils/ppo_utils.py
  `compute_policy_loss`; the band is inclusive at both edges as in slime (ice_ratio >= tis_clip_low and
  <= tis_clip). slime's default reduction is the per-sample mean; with --calculate-per-token-loss it is
  token-mean. The PPO part here is `ppo_clip`'s (verl's, log-ratio clamp 20).

  Departure in the normalizer of "seq-mean-token-mean": here n counts the rows of THIS batch with at least
  one loss token, while slime divides the sum of per-sample means by the number of samples of its whole
  step batch (all micro-batches, data-parallel ranks), an all-masked sample counting as a 0 term. The two
  agree when the batch here is slime's whole step batch and no row is empty; a batch with e empty rows of
  N gives N / (N - e) times slime's loss here.

  Metrics: frac_masked (tokens with w = 0; slime's tis_clipfrac), ice_ratio_mean (mean rho), clip_frac.
  """
  _check(0 <= lower <= upper and upper > 0, "lower", (lower, upper), "need 0 <= lower <= upper, upper > 0")
  _check_eps(eps_low, eps_high)
  _check_dual(dual_clip_c)
  _check_agg(loss_agg)
  lp, old, beh, adv, m = _inputs(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt)
  rho = jnp.exp(old - beh)
  w = sg(jnp.where(m & (rho >= lower) & (rho <= upper), rho, 0.0))
  log_r = jnp.clip(lp - old, -log_ratio_clamp, log_ratio_clamp)
  loss_nt, clipped, dual = _ppo_token_loss(log_r, adv, eps_low, eps_high, dual_clip_c)
  metrics = _clip_metrics(
    clipped, dual, lp, beh, m, frac_masked=_token_mean(w != rho, m), ice_ratio_mean=_token_mean(rho, m)
  )
  return aggregate(w * loss_nt, m, loss_agg), metrics


@register("prime-rl trainer/rl/loss.py default_loss_fn")
def dppo_tv(
  logp_nt,
  old_logp_nt,
  behavior_logp_nt,
  advantages,
  mask_nt,
  *,
  mask_low=0.2,
  mask_high=0.2,
  kl_tau=1e-3,
  loss_agg="token-mean",
):
  """DPPO binary-TV mask + squared log-ratio penalty: prime-rl's default RL loss.

    p_t, q_t = pi_theta(o_t), mu(o_t)        per-token probabilities of the SAMPLED token (exp of log-probs)
    drop_t   = (A > 0 and p_t - q_t > mask_high) or (A <= 0 and p_t - q_t < -mask_low)   (stop-gradient)
    l_t      = -(1 - drop_t) A r_t + kl_tau (log r_t)^2,   r_t = pi_theta / mu  (both differentiated)
    loss     = sum_t mask l_t / sum_n |o_n|

  The mask is on the probability DIFFERENCE of the sampled token (a one-token total-variation proxy), not on
  the ratio, and follows the sign of A: a token is dropped only when it moved too far in the direction A
  pushes it. The KL term covers every loss token, dropped or not. A = 0 tokens use the low test (the
  source's torch.where(A > 0, high, low)); they carry no policy-gradient term anyway.

  Source: prime-rl src/prime_rl/trainer/rl/loss.py `default_loss_fn` (dppo_mask_low / dppo_mask_high = 0.2,
  kl_tau = 1e-3, adv_tau = 1, the sum over tokens divided by the batch's loss-token count); DPPO-Binary-TV
  arXiv 2602.04879, the KL term from Kimi-K2.5 arXiv 2602.02276. pi_old is unused (the source compares
  against the inference log-probs).

  Metrics: frac_masked, frac_masked_high, frac_masked_low, mismatch_kl = mean(r - log r - 1).
  """
  _check(mask_low >= 0, "mask_low", mask_low, "must be >= 0")
  _check(mask_high >= 0, "mask_high", mask_high, "must be >= 0")
  _check(kl_tau >= 0, "kl_tau", kl_tau, "must be >= 0")
  _check_agg(loss_agg)
  lp, _, beh, adv, m = _inputs(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt)
  p_diff = jnp.exp(sg(lp)) - jnp.exp(beh)
  high = p_diff > mask_high
  low = p_diff < -mask_low
  drop = m & jnp.where(adv > 0, high, low)
  log_r = lp - beh
  r = jnp.exp(log_r)
  loss_nt = jnp.where(drop, 0.0, -adv * r) + kl_tau * jnp.square(log_r)
  r_val = sg(r)
  metrics = dict(
    frac_masked=_token_mean(drop, m),
    frac_masked_high=_token_mean(drop & (adv > 0), m),
    frac_masked_low=_token_mean(drop & (adv < 0), m),
    mismatch_kl=_token_mean(r_val - sg(log_r) - 1.0, m),
    **_common_metrics(lp, beh, m),
  )
  return aggregate(loss_nt, m, loss_agg), metrics


def loss_gradient(loss_fn, logp_fn, params, batch, advantages, old_logp_nt=None):
  """Parameter gradient of loss_fn(logp_fn(params, batch), ...) from one forward and one backward pass.

    logp_nt, vjp = jax.vjp(logp_fn(., batch), params)          one forward
    cot_nt       = d loss / d logp_nt  (jax.grad of the loss)    cheap: [N, T] elementwise
    grads        = vjp(cot_nt)                                   one backward

  The chain rule makes this exactly jax.grad(params -> loss) (tested); splitting it keeps the learner's
  structure (forward, per-token cotangent, backward) that the surrogate -sum coef tokw logp already has:
  there cot_nt = -coef_n tokw_nt, here it is whatever the method's loss gives.

  Args:
    loss_fn: a bound loss, f(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt) -> (loss, metrics)
      (`make_policy_loss`).
    logp_fn: logp_fn(params, batch) -> [N, T] log-probs of the batch's tokens.
    params: parameter pytree.
    batch: needs behavior_logp [N, T] and loss_mask [N, T] (+ what logp_fn reads).
    advantages: [N] or [N, T], stop-gradient (e.g. the estimator's advantage_n).
    old_logp_nt: pi_old recomputed at the start of the trainer step; None = this forward's own values
      (sg(logp_nt): the single-update case, no extra forward pass).
  Returns:
    (grads, loss, metrics).
  """
  logp_nt, vjp = jax.vjp(lambda p: logp_fn(p, batch), params)
  old = sg(logp_nt) if old_logp_nt is None else old_logp_nt
  args = (old, batch["behavior_logp"], advantages, batch["loss_mask"])
  (loss, metrics), cot_nt = jax.value_and_grad(lambda lp: loss_fn(lp, *args), has_aux=True)(logp_nt)
  (grads,) = vjp(cot_nt.astype(logp_nt.dtype))
  return grads, loss, metrics


# ---------------------------------------------------------------------------
# IPO (prime-rl), KPop (AReaL): trust regions on the sampled token's probability
# ---------------------------------------------------------------------------


@register("prime-rl trainer/rl/loss.py ipo_loss_fn")
def ipo(
  logp_nt,
  old_logp_nt,
  behavior_logp_nt,
  advantages,
  mask_nt,
  *,
  ipo_threshold=0.1,
  kl_tau=1e-3,
  loss_agg="token-mean",
):
  """IPO: a sign-agnostic absolute-probability trust region + squared log-ratio penalty (prime-rl's default).

    p_t, q_t = pi_theta(o_t), mu(o_t)                  probabilities of the SAMPLED token
    drop_t   = |p_t - q_t| > ipo_threshold              (stop-gradient; either sign, whatever A is)
    l_t      = -(1 - drop_t) A r_t + kl_tau (log r_t)^2,   r_t = pi_theta / mu  (differentiated)
    loss     = sum_t mask l_t / sum_n |o_n|

  The difference from `dppo_tv`: the mask does not look at the sign of A (DPPO drops a token only when it
  moved too far in the direction A pushes it); IPO drops every token whose probability moved more than the
  threshold in absolute terms. The KL term covers every loss token, dropped or not.

  Source: prime-rl src/prime_rl/trainer/rl/loss.py `ipo_loss_fn` with IPOLossConfig (ipo_threshold = 0.1,
  kl_tau = 1e-3, adv_tau = 1; the sum over tokens divided by the loss-token count). Departures: adv_tau is
  not a knob (a constant factor on A; 1 in the source); later prime-rl versions renamed the threshold `eps`
  (0.1 or 0.3) and some drop the KL term (kl_tau = 0 here). pi_old is unused.

  Metrics: frac_masked, frac_masked_high (p - q > threshold), frac_masked_low (p - q < -threshold),
  mismatch_kl = mean(r - log r - 1) over the loss tokens, masked_mismatch_kl (over the dropped ones).
  """
  _check(ipo_threshold >= 0, "ipo_threshold", ipo_threshold, "must be >= 0")
  _check(kl_tau >= 0, "kl_tau", kl_tau, "must be >= 0")
  _check_agg(loss_agg)
  lp, _, beh, adv, m = _inputs(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt)
  p_diff = jnp.exp(sg(lp)) - jnp.exp(beh)
  high = m & (p_diff > ipo_threshold)
  low = m & (p_diff < -ipo_threshold)
  drop = high | low
  log_r = lp - beh
  r = jnp.exp(log_r)
  loss_nt = jnp.where(drop, 0.0, -adv * r) + kl_tau * jnp.square(log_r)
  mismatch = sg(r) - sg(log_r) - 1.0
  metrics = dict(
    frac_masked=_token_mean(drop, m),
    frac_masked_high=_token_mean(high, m),
    frac_masked_low=_token_mean(low, m),
    mismatch_kl=_token_mean(mismatch, m),
    masked_mismatch_kl=_token_mean(mismatch, drop),
    **_common_metrics(lp, beh, m),
  )
  return aggregate(loss_nt, m, loss_agg), metrics


def binary_kl(logp, logq, eps=1e-8):
  """KL(Bern(p) || Bern(q)) = p log(p / q) + (1 - p) log((1 - p) / (1 - q)), elementwise, from log-probs.

  p and q are clamped to [eps, 1 - eps] first (AReaL's `compute_binary_kl_divergence` clamp, eps = 1e-8), so
  the complement terms are finite for a probability-1 token. The clamp is applied to the log-probs and the
  complements are computed as -expm1(log p): in float32 1 - 1e-8 rounds to 1, so a clamp in probability space
  (AReaL's, in the log-probs' dtype) leaves NaN or inf for p > 1 - 6e-8 (0 * log 0, log 0), which fails
  AReaL's `<= phi` test (the token is dropped); here it is finite and >= 0. Shapes broadcast; no stop-gradient here.
  """
  lo, hi = math.log(eps), math.log1p(-eps)
  lp = jnp.clip(jnp.asarray(logp, jnp.float32), lo, hi)
  lq = jnp.clip(jnp.asarray(logq, jnp.float32), lo, hi)
  p, one_minus_p, one_minus_q = jnp.exp(lp), -jnp.expm1(lp), -jnp.expm1(lq)
  return p * (lp - lq) + one_minus_p * (jnp.log(one_minus_p) - jnp.log(one_minus_q))


# KPop's normalisers: every loss token (AReaL's merged code), or the kept ones (an early draft of AReaL PR #1405).
KPOP_NORMALIZERS = ("loss_tokens", "kept")


@register("AReaL areal/utils/functional/functional.py ppo_actor_loss_fn (rejection_sampling metric=binary_kl)")
def kpop(
  logp_nt,
  old_logp_nt,
  behavior_logp_nt,
  advantages,
  mask_nt,
  *,
  phi=0.1,
  eps_low=0.2,
  eps_high=0.2,
  prob_eps=1e-8,
  normalizer="loss_tokens",
  loss_agg="token-mean",
):
  """KPop: decoupled PPO whose tokens are kept only inside a two-way binary-KL trust region around mu.

    D_B(a || b) = a log(a / b) + (1 - a) log((1 - a) / (1 - b))     (`binary_kl`; the vocabulary seen as
                                                                      {this token, everything else})
    keep_t = D_B(pi_prox(o_t) || mu(o_t)) <= phi  and  D_B(mu(o_t) || pi_prox(o_t)) <= phi   (stop-gradient)
    l_t    = sg(pi_prox / mu) * ppo_clip_t(pi_theta / pi_prox, eps_low, eps_high)
    loss   = sum_t keep_t l_t / sum_t mask_t       normalizer="loss_tokens" (default: AReaL's)
           = sum_t keep_t l_t / sum_t keep_t       normalizer="kept"        (a draft of AReaL PR #1405)

  pi_prox is old_logp_nt (exact: the learner's pi_old, or the proximal version from the parameter ring).
  Compared to IPO's absolute band |p - q| <= 0.1, the binary-KL band adapts to the probability: wide in
  ratio terms for rare tokens, tight for confident ones. The two normalisers give gradients that differ by
  the factor #loss tokens / #kept tokens (e.g. N = 1, T = 2 with one token dropped: 2x); with "loss_tokens"
  a dropped token counts as a zero, as IcePop's masked tokens do, so the step shrinks as the band drops more.

  Source: AReaL areal/utils/functional/functional.py at commit 3e9f632329805580eb11bb8cd47c323d20d797e7
  (2026-08-06, the newest change to that file in areal-project/AReaL cbff54d6): KPop is `ppo_actor_loss_fn`
  with rejection_sampling(level=token, action=mask, metric=binary_kl, upper=phi); `apply_rejection_sampling`
  keeps a token iff max(kl_fwd, kl_rev) <= upper (`compute_binary_kl_divergence(proximal, behave)` and its
  reverse, probabilities clamped to [1e-8, 1 - 1e-8]) and weights it by exp(prox - behave); the loss is the
  sum over the kept tokens divided by `loss_mask_count`, counted BEFORE rejection sampling narrows the mask
  (its comment: otherwise "mask mode would inflate per-token gradients by N_original / N_kept"; the rule is
  PR #1088's, bc9f0098, and KPop's merge, PR #1405 / 13353cc6, kept it). The draft of PR #1405 that this
  loss first followed (`enable_kpop`, seen in the PR's review thread) divided by the kept count;
  normalizer="kept" keeps that, for comparison with the runs made with it. phi = 0.1 is the KPop paper's value (also prime-rl's open KPop port, PR #3283); AReaL's
  examples/math/gsm8k_kpop.yaml uses upper = 2.0 with eps_clip = 0.4. Departures: the clamp is applied in
  log space with exact complements (`binary_kl`: finite where AReaL's float32 clamp gives NaN / inf and drops
  the token); loss_agg other than "token-mean" uses the same normaliser's mask.

  Metrics: frac_masked (loss tokens dropped), binary_kl_fwd / binary_kl_rev (means over the loss tokens),
  behav_weight_mean (over the kept tokens), clip_frac.
  """
  _check(phi > 0, "phi", phi, "the binary-KL threshold must be > 0 (the KPop paper uses 0.1)")
  _check(0 < prob_eps < 0.5, "prob_eps", prob_eps, "must be in (0, 0.5)")
  _check(normalizer in KPOP_NORMALIZERS, "normalizer", normalizer, f"choose one of {list(KPOP_NORMALIZERS)}")
  _check_eps(eps_low, eps_high)
  _check_agg(loss_agg)
  lp, prox, beh, adv, m = _inputs(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt)
  kl_fwd = binary_kl(prox, beh, prob_eps)
  kl_rev = binary_kl(beh, prox, prob_eps)
  keep = m & (kl_fwd <= phi) & (kl_rev <= phi)
  loss_nt, clipped, _ = _ppo_token_loss(lp - prox, adv, eps_low, eps_high, None)
  bw = sg(jnp.where(keep, jnp.exp(prox - beh), 0.0))
  metrics = _clip_metrics(
    clipped,
    None,
    lp,
    beh,
    m,
    frac_masked=_token_mean(~keep, m),
    binary_kl_fwd=_token_mean(kl_fwd, m),
    binary_kl_rev=_token_mean(kl_rev, m),
    behav_weight_mean=_token_mean(bw, keep),
  )
  kept_loss_nt = jnp.where(keep, bw * loss_nt, 0.0)
  return aggregate(kept_loss_nt, m if normalizer == "loss_tokens" else keep, loss_agg), metrics


# ---------------------------------------------------------------------------
# Binding a loss
# ---------------------------------------------------------------------------


def make_policy_loss(name: str, **hyper_parameters) -> Callable[..., tuple[jax.Array, dict]]:
  """The registered loss `name` with its hyper-parameters bound (checked now, at build time).

  Returns f(logp_nt, old_logp_nt, behavior_logp_nt, advantages, mask_nt) -> (loss, metrics), jittable.
  """
  if name not in POLICY_LOSSES:
    raise ValueError(f"policy loss {name!r}: choose one of {sorted(POLICY_LOSSES)}")
  loss = POLICY_LOSSES[name]
  unknown = sorted(set(hyper_parameters) - set(loss.defaults))
  if unknown:
    raise ValueError(f"{name}: unknown hyper-parameters {unknown}; it takes {sorted(loss.defaults)}")
  fn = functools.partial(loss.fn, **hyper_parameters)
  if not any(isinstance(v, jax.Array) for v in hyper_parameters.values()):
    # Trace once, abstractly, so a bad value fails here, with its one-line message, not inside a jit.
    # Abstract inputs only: config parsing calls this before jax.distributed.initialize, so it must not
    # start a backend (tests/test_policy_losses.py checks that).
    z, a = jax.ShapeDtypeStruct((1, 1), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32)
    jax.eval_shape(fn, z, z, z, a, z)
  return fn
