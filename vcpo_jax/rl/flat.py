"""The config's flat `vcpo.*` names and their one mapping onto a Method's parts.

`--config.method=<preset>` picks a value of rl.method.PRESETS; `--config.vcpo.<name>=<value>` changes one
option of it by a flat name (e.g. vcpo.tis_c -> the c of the weights' tis(c), vcpo.policy_loss_kw ->
the peer loss's hyper-parameters). These names are what the committed run configs and the stability
study's run fingerprints hold, so they are kept, and mapped here, once. `Overrides` declares them (type and
one-line comment each; no defaults: None keeps the preset's value, every default is the factory's), `apply`
maps them onto a Method, and `live(method)` gives the names that mean something for a method, with their
values (what `--config_help` shows).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vcpo_jax.rl.advantages import Advantage, Opob
from vcpo_jax.rl.ess import EssLr
from vcpo_jax.rl.losses import POLICY_LOSSES, PeerLoss, decoupled_ppo_loglinear
from vcpo_jax.rl.method import Method
from vcpo_jax.rl.surrogate import Surrogate
from vcpo_jax.rl.weights import WEIGHT_VARIANTS, Weights

DECOUPLED_PROX = ("exact", "loglinear")


@dataclasses.dataclass(frozen=True)
class Overrides:
  """The flat `vcpo.*` names (None: the preset's value)."""

  advantage: str | None = None  # ADVANTAGE_ESTIMATORS name: the base algorithm
  is_variant: str | None = None  # WEIGHT_VARIANTS name
  tis_c: float | None = None  # "tis" truncation level (c = 8 in all released runs)
  clip_lower: float | None = None  # "clip": lower end a of the interval [a, b]
  clip_upper: float | None = None  # "clip": upper end b
  mask_lower: float | None = None  # "mask": weights below this are masked (weight 0)
  mask_upper: float | None = None  # "mask": weights above this are masked
  token_tis_c: float | None = None  # "token_tis" per-token truncation level
  geo_lower: float | None = None  # "geo_mask": rows whose exp(l / L) is below this are masked
  geo_upper: float | None = None  # "geo_mask": rows whose exp(l / L) is above this are masked
  log_ratio_clamp: float | None = None  # applied weights use exp(clamp(l, -c, c))
  loss_agg: str | None = None  # LOSS_AGGREGATIONS
  mask_normalizer: str | None = None  # rows counted in the loss normaliser: all (valid) | kept (weight != 0)
  loss_norm_tokens: int | None = None  # "seq-mean-token-sum-norm" divisor T; 0: the batch's token axis length
  opob: bool | None = None  # replace the estimator's baseline by OPOB
  opob_weights: str | None = None  # "unclipped" (paper) | "applied"
  opob_leave_one_out: bool | None = None  # exclude i from its own baseline (unbiased)
  opob_scope: str | None = None  # "group": raw rewards per prompt; "minibatch": A over batch
  length_normalize_norms: bool | None = None  # ||s_n||^2 / L_n^2 (norm of the token-mean score)
  reference_mode: bool | None = None  # reproduce the reference: norms w~^2 ||s||^2, weights w^2
  std: str | None = None  # group std for "grpo": population (ddof 0) | sample (ddof 1); presets set it
  std_eps: float | None = None  # groups with std <= std_eps contribute nothing
  ess_lr: bool | None = None  # scale the step's learning rate by the ESS rule
  ess_rule: str | None = None  # ESS_LR_RULES name
  rho_on: float | None = None  # on-policy reference ESS ratio (docs/rho_on_protocol.md)
  tis_ess_target: float | None = None  # "tis_ess": target ESS ratio of the truncated weights, in (0, 1]
  policy_loss: str | None = None  # "pg" (the surrogate) | a rl.losses.POLICY_LOSSES name (its own loss_agg)
  policy_loss_kw: str | None = None  # its hyper-parameters "name=value,...", e.g. "eps_high=0.28,loss_agg=token-mean"
  decoupled_prox: str | None = None  # decoupled_ppo's pi_prox: exact (pi_old, recomputed) | loglinear (AReaL approx.)
  score_centering: str | None = None  # off | exact (q of the behaviour version) | topk (sampler's top-k)
  sc_topk: int | None = None  # score_centering='topk': ids per token the sampler records (k); 0 otherwise


NAMES = tuple(f.name for f in dataclasses.fields(Overrides))
# Each weight variant's parameters by their flat names (a variant without an entry takes its factory's values).
WEIGHT_NAMES = {
  "tis": {"c": "tis_c"},
  "token_tis": {"c": "token_tis_c"},
  "tis_ess": {"target": "tis_ess_target"},
  "clip": {"lower": "clip_lower", "upper": "clip_upper"},
  "mask": {"lower": "mask_lower", "upper": "mask_upper"},
  "geo_mask": {"lower": "geo_lower", "upper": "geo_upper"},
}
OPOB_NAMES = {
  "weights": "opob_weights",
  "leave_one_out": "opob_leave_one_out",
  "scope": "opob_scope",
  "length_normalize_norms": "length_normalize_norms",
  "reference_mode": "reference_mode",
}
ADVANTAGE_NAMES = {"estimator": "advantage", "std": "std", "std_eps": "std_eps"}
LR_NAMES = {"rule": "ess_rule", "rho_on": "rho_on"}
SURROGATE_NAMES = {f.name: f.name for f in dataclasses.fields(Surrogate)}


def parse_kw(text: str) -> dict[str, Any]:
  """ "name=value,..." -> {name: value}: None / True / False, a number, else the string (e.g. loss_agg=token-mean)."""
  kw: dict[str, Any] = {}
  special = {"None": None, "True": True, "False": False}
  for item in filter(None, (x.strip() for x in text.split(","))):
    name, eq, value = (x.strip() for x in item.partition("="))
    if not eq or not name or not value:
      raise ValueError(f"policy_loss_kw={text!r}: {item!r} is not name=value")
    if value in special:
      kw[name] = special[value]
      continue
    try:
      kw[name] = float(value)
    except ValueError:
      kw[name] = value
  return kw


def loss_knobs(**hyper_parameters) -> dict[str, str]:
  """{"vcpo.policy_loss_kw": "name=value,..."}: a peer loss's hyper-parameters as one run-config override, numbers
  written with %g (as the stability study's committed run configs hold them, so their fingerprints stay)."""
  text = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in hyper_parameters.items())
  return {"vcpo.policy_loss_kw": text}


def _build(names: dict[str, str], flat: dict, make):
  """make(); a ValueError naming a part's own field (`c=...`) is re-raised naming its flat name (`tis_c=...`)."""
  try:
    return make()
  except (TypeError, ValueError) as e:
    msg = str(e)
    for own, name in names.items():
      if msg.startswith(f"{own}=") and name in flat:
        raise ValueError(name + msg[len(own) :]) from None
    raise


def _overlay(part, names: dict[str, str], flat: dict) -> dict:
  """part's fields (a dataclass or a Weights' params), then the flat values given for them."""
  own = dict(part.params) if isinstance(part, Weights) else dataclasses.asdict(part) if part is not None else {}
  return {**own, **{k: flat[n] for k, n in names.items() if n in flat}}


def _weights(m: Method, flat: dict) -> Weights:
  name = flat.get("is_variant", m.weights.variant)
  if name not in WEIGHT_VARIANTS:
    raise ValueError(f"is_variant={name!r}: choose one of {sorted(WEIGHT_VARIANTS)}")
  base = m.weights if name == m.weights.variant else WEIGHT_VARIANTS[name]()
  names = WEIGHT_NAMES.get(name, {})
  return _build(names, flat, lambda: WEIGHT_VARIANTS[name](**_overlay(base, names, flat)))


def _loss(m: Method, flat: dict) -> Surrogate | PeerLoss:
  name = flat.get("policy_loss", "pg" if m.peer_loss is None else m.peer_loss.name)
  if name == "pg":
    if flat.get("policy_loss_kw"):
      raise ValueError(f"policy_loss_kw={flat['policy_loss_kw']!r}: only with a policy_loss other than 'pg'")
    base = m.loss if m.peer_loss is None else Surrogate()
    return _build(SURROGATE_NAMES, flat, lambda: Surrogate(**_overlay(base, SURROGATE_NAMES, flat)))
  if name not in POLICY_LOSSES:
    raise ValueError(f"policy_loss={name!r}: choose one of {['pg', *POLICY_LOSSES]}")
  if flat.get("score_centering", "off") != "off":
    raise ValueError(
      f"score_centering={flat['score_centering']!r} with policy_loss={name!r}: centering is a term of the "
      "surrogate (policy_loss='pg'); set score_centering='off'"
    )
  same = m.peer_loss is not None and m.peer_loss.name == name
  kw = parse_kw(flat["policy_loss_kw"]) if "policy_loss_kw" in flat else (m.peer_loss.kwargs if same else {})
  prox = flat.get("decoupled_prox", "loglinear" if same and m.peer_loss.needs else "exact")
  try:
    if name == "decoupled_ppo" and prox == "loglinear":
      return decoupled_ppo_loglinear(**kw)
    return POLICY_LOSSES[name](**kw)
  except ValueError as e:
    raise ValueError(f"policy_loss_kw={flat.get('policy_loss_kw', '')!r}: {e}") from None


def _check_unused(flat: dict) -> None:
  """A value is checked even where it changes nothing for this method (tis_c=0 under clip weights is an error)."""
  for variant, names in WEIGHT_NAMES.items():
    if any(n in flat for n in names.values()):
      _build(names, flat, lambda v=variant, ns=names: WEIGHT_VARIANTS[v](**_overlay(WEIGHT_VARIANTS[v](), ns, flat)))
  if flat.get("decoupled_prox", "exact") not in DECOUPLED_PROX:
    raise ValueError(f"decoupled_prox={flat['decoupled_prox']!r}: choose one of {sorted(DECOUPLED_PROX)}")
  for names, cls in ((OPOB_NAMES, Opob), (LR_NAMES, EssLr), (SURROGATE_NAMES, Surrogate)):
    if any(n in flat for n in names.values()):
      _build(names, flat, lambda ns=names, c=cls: c(**_overlay(c(), ns, flat)))


def apply(method: Method, **flat) -> Method:
  """`method` with the flat `vcpo.*` values set (None values are skipped: the method's own); ValueError naming
  the flat field for a bad value (checked even where it changes nothing). A value of another part than the
  method's (tis_c without tis weights, opob_* without OPOB) changes nothing, as before the method was a value."""
  flat = {k: v for k, v in flat.items() if v is not None}
  unknown = sorted(set(flat) - set(NAMES))
  if unknown:
    raise ValueError(f"{unknown[0]}: not a vcpo.* field; the fields are {list(NAMES)}")
  _check_unused(flat)
  m = method
  adv = _build(ADVANTAGE_NAMES, flat, lambda: Advantage(**_overlay(m.advantage, ADVANTAGE_NAMES, flat)))
  baseline = None
  if flat.get("opob", m.baseline is not None):
    baseline = _build(OPOB_NAMES, flat, lambda: Opob(**_overlay(m.baseline or Opob(), OPOB_NAMES, flat)))
  lr = None
  if flat.get("ess_lr", m.lr is not None):
    lr = _build(LR_NAMES, flat, lambda: EssLr(**_overlay(m.lr or EssLr(), LR_NAMES, flat)))
  clamp = flat.get("log_ratio_clamp", m.log_ratio_clamp)
  return Method(adv, _weights(m, flat), baseline, _loss(m, flat), lr, clamp)


def live(method: Method) -> dict[str, Any]:
  """{flat name: value} of the names that mean something for `method` (the others change nothing)."""
  out: dict[str, Any] = {n: getattr(method.advantage, k) for k, n in ADVANTAGE_NAMES.items()}
  w = method.weights
  out["is_variant"] = w.variant
  out.update({WEIGHT_NAMES[w.variant][k]: v for k, v in w.params if k in WEIGHT_NAMES.get(w.variant, {})})
  out["log_ratio_clamp"] = method.log_ratio_clamp
  out["opob"] = method.baseline is not None
  if method.baseline is not None:
    out.update({n: getattr(method.baseline, k) for k, n in OPOB_NAMES.items()})
  out["ess_lr"] = method.lr is not None
  if method.lr is not None:
    out.update({n: getattr(method.lr, k) for k, n in LR_NAMES.items()})
  peer = method.peer_loss
  if peer is None:
    out["policy_loss"] = "pg"
    out.update({n: getattr(method.loss, k) for k, n in SURROGATE_NAMES.items()})
    return out
  out["policy_loss"] = peer.name
  out["policy_loss_kw"] = ",".join(
    f"{k}={v}"
    for k, v in {**POLICY_LOSSES[peer.name].defaults, **peer.kwargs}.items()
    if k not in ("behavior_version", "current_version")
  )
  if peer.name == "decoupled_ppo":
    out["decoupled_prox"] = "loglinear" if peer.needs else "exact"
  return out
