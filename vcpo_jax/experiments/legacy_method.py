"""A run config's method as the stability ledger's fingerprints hold it: a preset name and flat `vcpo.*` names.

The study's committed records (docs/results/stability_ledger/) were made when `config.method` was a preset
name and `config.vcpo` one None placeholder per flat name (set ones holding their value; a peer loss's
hyper-parameters one "name=value,..." text). A record is reused only under its run's fingerprint, a hash of
the run config's JSON, so the study hashes its run configs in that form: `run_config` writes the method of one
(a preset with the study's `method.*` overrides) as the old names. The names live here only, as data: the
library and the configs know the method tree (rl/choices.py) alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vcpo_jax.rl import choices

# Every flat name a record's run config holds (None: the preset's value).
FLAT_NAMES = (
  "advantage is_variant tis_c clip_lower clip_upper mask_lower mask_upper token_tis_c geo_lower geo_upper "
  "log_ratio_clamp loss_agg mask_normalizer loss_norm_tokens opob opob_weights opob_leave_one_out opob_scope "
  "length_normalize_norms reference_mode std std_eps ess_lr ess_rule rho_on tis_ess_target policy_loss "
  "policy_loss_kw decoupled_prox score_centering sc_topk"
).split()
# method.PART.FIELD -> its flat name, or {weight variant: flat name} where the name depended on it. A part's choice
# (method.PART=NAME) has none: the study's runs never switch one (their presets choose).
FIELDS: dict[str, str | dict[str, str]] = {
  "advantage.std": "std",
  "advantage.std_eps": "std_eps",
  "weights.c": {"tis": "tis_c", "token_tis": "token_tis_c"},
  "weights.target": {"tis_ess": "tis_ess_target"},
  "weights.lower": {"clip": "clip_lower", "mask": "mask_lower", "geo_mask": "geo_lower"},
  "weights.upper": {"clip": "clip_upper", "mask": "mask_upper", "geo_mask": "geo_upper"},
  "baseline.weights": "opob_weights",
  "baseline.leave_one_out": "opob_leave_one_out",
  "baseline.scope": "opob_scope",
  "baseline.length_normalize_norms": "length_normalize_norms",
  "baseline.reference_mode": "reference_mode",
  "lr.rule": "ess_rule",
  "lr.rho_on": "rho_on",
  "log_ratio_clamp": "log_ratio_clamp",
  **{f"loss.{f}": f for f in choices.defaults("loss", "surrogate")},
}
PEER_LOSS_TEXT = "policy_loss_kw"  # a peer loss's hyper-parameters as one "name=value,..." (floats as %g)


def flat_overrides(method, overrides: Sequence[tuple[str, Any]]) -> dict[str, Any]:
  """{flat name: value} of the `method.*` overrides of a run whose method (after them) is `method`."""
  flat: dict[str, Any] = {}
  peer: dict[str, Any] = {}
  for path, value in overrides:
    rel = path.removeprefix(f"{choices.ROOT}.")
    if rel.startswith("loss.") and method.peer_loss is not None:
      peer[rel[len("loss.") :]] = value
      continue
    name = FIELDS.get(rel)
    if isinstance(name, dict):
      name = name.get(method.weights.variant)
    if name is None:
      raise ValueError(f"{path}={value!r}: the ledger's flat names have no field for it")
    flat[name] = value
  if peer:
    flat[PEER_LOSS_TEXT] = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in peer.items())
  return flat


def run_config(run_cfg: dict, preset: str, overrides: Sequence[tuple[str, Any]]) -> dict:
  """run_cfg (a run config's JSON) with its method as the records hold it: "method": preset, "vcpo": {every flat
  name: None, the overridden ones set}. ValueError where run_cfg's method is not that preset with those
  overrides (the old form could not say it)."""
  method = choices.from_preset(preset, {p.removeprefix(f"{choices.ROOT}."): v for p, v in overrides})
  if json.loads(json.dumps(choices.tree(method).to_dict())) != run_cfg[choices.ROOT]:
    raise ValueError(f"the run config's method is not preset {preset!r} with {list(overrides)}")
  return dict(run_cfg, method=preset, vcpo={**dict.fromkeys(FLAT_NAMES), **flat_overrides(method, overrides)})
