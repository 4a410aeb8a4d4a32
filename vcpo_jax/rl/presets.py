"""The named methods (rl.method.PRESETS, Method values), one documentation line each, and a preset by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vcpo_jax.rl import choices
from vcpo_jax.rl.losses import POLICY_LOSSES
from vcpo_jax.rl.method import PRESETS, Method

# One line per preset where its values do not say it all (`preset_doc` derives the others).
PRESET_DOCS: dict[str, str] = {
  "sync": "synchronous GRPO (sample std advantage, no correction); run with k = 0",
  "none": "GRPO on stale data with no correction (the baseline every correction is compared with)",
  "seq_tis": "GRPO with sequence-level truncated IS, w = min(exp(l), 8)",
  "clip": "GRPO with a two-sided clipped sequence IS weight, w = clip(exp(l), lower, upper) (weights.lower, weights.upper)",
  "mask": "GRPO with masked sequence IS: w = exp(l) inside [weights.lower, weights.upper], else 0 (kept in the normalizer)",
  "token_tis": "GRPO with per-token truncated IS, w_nt = min(exp(d_nt), c) (weights.c)",
  "geo_mask": "GRPO with geometric-mean rejection: a row is kept (w = 1) iff lower <= exp(l / L) <= upper (weights.lower, .upper)",
  "vcpo": "VCPO: sequence TIS c = 8 + the OPOB baseline + the ESS-scaled learning rate (sqrt rule, rho_on = 1)",
  "vcpo_no_esslr": "VCPO without the ESS-scaled learning rate",
  "vcpo_no_opob": "VCPO without the OPOB baseline (the reference's GRPO advantage, sample std)",
  "vcpo_applied_opob": "VCPO with OPOB weighted by the applied (truncated) weights instead of the unclipped ones",
  "vcpo_loo_opob": "VCPO with the leave-one-out OPOB baseline",
  "vcpo_reference": "VCPO reproducing the reference implementation's two inconsistencies",
  "ppo_clip": "verl's token-level PPO clip on the GRPO advantage (policy_losses.ppo_clip)",
  "decoupled_ppo": "AReaL's decoupled PPO: clip against pi_prox, IS weight pi_prox / mu (policy_losses.decoupled_ppo)",
  "gspo": "GSPO: clipped length-normalized sequence ratio (policy_losses.gspo)",
  "cispo": "CISPO: clipped, stop-gradient token IS weight on every token's gradient (policy_losses.cispo)",
  "m2po_paper": "M2PO as in its paper and AReaL: second-moment token masking (policy_losses.m2po_paper)",
  "m2po_released": "M2PO as its authors released it: a second-moment budget sets one PPO clip (policy_losses.m2po_released)",
  "icepop": "IcePop (slime): PPO clip times the token weight pi_old / mu masked outside [0.5, 5] (policy_losses.icepop)",
  "dppo_tv": "prime-rl's DPPO binary-TV mask + squared log-ratio penalty (policy_losses.dppo_tv)",
  "ipo": "prime-rl's IPO: tokens with |p - q| > 0.1 dropped, r = p / q gradient + (log r)^2 term (policy_losses.ipo)",
  "kpop": "AReaL's KPop: decoupled PPO on tokens within a binary-KL band phi = 0.1 (policy_losses.kpop)",
  "vcpo_tis_ess": "VCPO with the ESS-targeted truncation: the cap c_t solved per step so that ESS / n = 0.5",
  "vcpo_sc": "VCPO with exact score centering: q recomputed from the behaviour version (lag / sync modes)",
  "tis_sc": "the paper's TIS+SC: token TIS (C = weights.c) with exact score centering, capped coefficients",
}


def method_from_preset(name: str, overrides: Mapping[str, Any] | None = None) -> Method:
  """PRESETS[name] with {path under config.method: value} set as on the command line (rl.choices.from_preset),
  e.g. method_from_preset("vcpo", {"lr.rho_on": 0.55}); a ConfigError (a ValueError) names a bad field."""
  return choices.from_preset(name, overrides)


def preset_doc(name: str) -> str:
  """PRESET_DOCS[name], or for a preset without a line (a new peer loss's) the first line of its loss's doc."""
  if name in PRESET_DOCS:
    return PRESET_DOCS[name]
  m = PRESETS[name]
  if m.peer_loss is not None:
    return f"{m.peer_loss.name}: {POLICY_LOSSES[m.peer_loss.name].doc} ({POLICY_LOSSES[m.peer_loss.name].source})"
  return repr(m)
