"""A run config's method as the stability ledger's fingerprints hold it: a preset name and flat `vcpo.*` names.

The study's committed records (docs/results/stability_ledger/) were made when `config.method` was a preset
name and `config.vcpo` one None placeholder per flat name (set ones holding their value; a peer loss's
hyper-parameters one "name=value,..." text). A record is reused only under its run's fingerprint, a hash of
the run config's JSON, so the study hashes its run configs in that form: `run_config` writes the method of one
(a preset with the study's `method.*` overrides) as the old names. The names are the ledger's data
(NAMES_FILE, next to the records they describe); the library and the configs know the method tree
(rl/choices.py) alone.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vcpo_jax.rl import choices

# The repository root holds docs/ (an editable install or a checkout; a wheel ships no ledger).
NAMES_FILE = Path(__file__).resolve().parents[2] / "docs" / "results" / "stability_ledger" / "legacy_method_names.json"


@functools.cache
def names() -> dict:
  """The ledger's old names: {"flat_names": [every flat name a record's run config holds, in order],
  "fields": {method.PART.FIELD (without "method."): flat name, or {weight variant: flat name}},
  "peer_loss_text": the flat name of a peer loss's "name=value,..." text}."""
  try:
    return json.loads(NAMES_FILE.read_text())
  except FileNotFoundError:
    raise FileNotFoundError(
      f"{NAMES_FILE} is missing: the stability ledger's old method names live there; run from a checkout of the "
      "repository (pip install -e .) so docs/results/stability_ledger/ is present"
    ) from None


def flat_overrides(method, overrides: Sequence[tuple[str, Any]]) -> dict[str, Any]:
  """{flat name: value} of the `method.*` overrides of a run whose method (after them) is `method`."""
  flat: dict[str, Any] = {}
  peer: dict[str, Any] = {}
  for path, value in overrides:
    rel = path.removeprefix(f"{choices.ROOT}.")
    if rel.startswith("loss.") and method.peer_loss is not None:
      peer[rel[len("loss.") :]] = value
      continue
    name = names()["fields"].get(rel)
    if isinstance(name, dict):
      name = name.get(method.weights.variant)
    if name is None:
      raise ValueError(f"{path}={value!r}: the ledger's flat names have no field for it")
    flat[name] = value
  if peer:
    flat[names()["peer_loss_text"]] = ",".join(
      f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in peer.items()
    )
  return flat


def run_config(run_cfg: dict, preset: str, overrides: Sequence[tuple[str, Any]]) -> dict:
  """run_cfg (a run config's JSON) with its method as the records hold it: "method": preset, "vcpo": {every flat
  name: None, the overridden ones set}. ValueError where run_cfg's method is not that preset with those
  overrides (the old form could not say it)."""
  method = choices.from_preset(preset, {p.removeprefix(f"{choices.ROOT}."): v for p, v in overrides})
  if json.loads(json.dumps(choices.tree(method).to_dict())) != run_cfg[choices.ROOT]:
    raise ValueError(f"the run config's method is not preset {preset!r} with {list(overrides)}")
  return dict(
    run_cfg, method=preset, vcpo={**dict.fromkeys(names()["flat_names"]), **flat_overrides(method, overrides)}
  )
