"""The equal tuning budget of the stability study: each method's own knob, tuned alike.

Every method gets the same number of trials (configs/stability.py `tuning.trials`) of ITS OWN main knob (eps
for the clip family, the budget for M2PO, the interval for IcePop, c or the target ESS for TIS, rho_on for
VCPO), each trial one value run on the tuning seeds (disjoint from the report seeds) at the tuning (k, lr)
cells. The value with the best mean final accuracy over those runs (ties: the value listed first) is the
method's knob in every run of the grid, so each method is reported at its own best and none had more
chances than another. A method without a knob ("none") runs once per tuning cell, as a reference.

A knob is a name in `KNOBS`: a function from the trial value to the run-config fields it sets
(`{"method.weights.c": 4.0}`); the config names the knob and its values per method. Each trial is one
`vcpo_jax.trainer.run` in its own directory (resumable per run), and a method's trials are saved together
in <out>/stability_raw/trainer/tune_<method>.npz with the fingerprint of everything that made them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import numpy as np


def _g(v) -> str:
  return f"{float(v):g}"


def _pair(v) -> tuple[float, float]:
  lo, hi = (float(x) for x in v)
  return lo, hi


def _loss(**hyper_parameters) -> dict[str, Any]:
  """{"method.loss.NAME": value}: a peer loss's hyper-parameters, floats at %g's 6 digits (the values the study's
  records were trained with, when they travelled as text)."""
  return {f"method.loss.{k}": float(_g(v)) if isinstance(v, float) else v for k, v in hyper_parameters.items()}


# knob name -> value -> {run-config path: value}. Policy-loss knobs are the loss's own hyper-parameters
# (vcpo_jax/rl/losses.py signatures). The ledger's fingerprints name them by the old flat names (legacy_method).
KNOBS: dict[str, Callable[[Any], dict[str, Any]]] = {
  "tis_c": lambda v: {"method.weights.c": float(v)},  # sequence TIS truncation c
  "clip_c": lambda v: {"method.weights.lower": 1.0 / float(v), "method.weights.upper": float(v)},  # clip to [1/c, c]
  "mask_c": lambda v: {"method.weights.lower": 1.0 / float(v), "method.weights.upper": float(v)},  # keep in [1/c, c]
  "token_tis_c": lambda v: {"method.weights.c": float(v)},  # per-token truncation c
  "rho_on": lambda v: {"method.lr.rho_on": float(v)},  # VCPO's on-policy reference ESS ratio
  "tis_ess_target": lambda v: {"method.weights.target": float(v)},  # vcpo_tis_ess: target ESS ratio
  "eps": lambda v: _loss(eps_low=float(v), eps_high=float(v)),  # symmetric PPO clip
  "eps_high": lambda v: _loss(eps_high=float(v)),  # CISPO's upper IS-weight clip
  # GSPO's sequence-ratio clip, as a multiple of verl's (3e-4, 4e-4)
  "gspo_eps_x": lambda v: _loss(eps_low=3e-4 * float(v), eps_high=4e-4 * float(v)),
  "budget": lambda v: _loss(budget=float(v)),  # M2PO second-moment budget
  "icepop_interval": lambda v: _loss(**dict(zip(("lower", "upper"), _pair(v)))),
  "tv": lambda v: _loss(mask_low=float(v), mask_high=float(v)),  # DPPO-TV bound
  "ipo_threshold": lambda v: _loss(ipo_threshold=float(v)),  # IPO |p - q| bound
  # KPop binary-KL bound; the normaliser named, so that the records made with the earlier kept-token default
  # (docs/results/stability_ledger/corrections' kpop runs) are not reused under AReaL's all-token one
  "kpop_phi": lambda v: _loss(phi=float(v), normalizer="loss_tokens"),
}


def value_str(value) -> str:
  """A trial value as text: 8 -> '8', (0.5, 5.0) -> '0.5-5', None -> '-'."""
  if value is None:
    return "-"
  if isinstance(value, (tuple, list)):
    return "-".join(_g(v) for v in value)
  return _g(value)


def knob_of(c, method: str):
  """(knob name, trial values) of `method` in the study config, or None (no knob / tuning off)."""
  if not c.tuning.enabled:
    return None
  spec = c.tuning.knobs[method]
  if spec is None:
    return None
  name, values = spec
  return str(name), tuple(tuple(v) if isinstance(v, (tuple, list)) else v for v in values)


def method_variant(c, method: str) -> tuple[str, list[tuple[str, object]]]:
  """(preset, [(run-config path, value)]) of a study method: a preset name as it is, or a named variant of
  one in c.trainer.method_variants (name -> (preset, ((path, value), ...)), e.g. top-k centering at a k)."""
  variants = c.trainer.get("method_variants") or {}
  if method not in variants:
    return method, []
  preset, fields = variants[method]
  return preset, [(str(path), value) for path, value in fields]


def stack_runs(runs: Sequence[dict]) -> dict:
  """{key: [R, ...]} of the keys every run has (records made before a key existed lack it, e.g. drift_*)."""
  keys = [k for k in runs[0] if all(k in r for r in runs)]
  return {k: np.stack([r[k] for r in runs]) for k in keys}


def knob_overrides(name: str, value) -> dict[str, Any]:
  """{run-config path: value} that knob `name` = `value` sets."""
  if name not in KNOBS:
    raise ValueError(f"tuning knob {name!r}: choose one of {sorted(KNOBS)}")
  return KNOBS[name](value)


def check(c):
  """Raises ValueError (one line naming the field) for a tuning block the study cannot run."""
  t = c.tuning
  if not t.enabled:
    return
  if c.backend != "trainer":
    raise ValueError(f"config.tuning.enabled=True with backend={c.backend!r}: tuning runs the trainer backend only")
  if set(t.seeds) & set(c.seeds):
    raise ValueError(
      f"config.tuning.seeds={tuple(t.seeds)} shares {sorted(set(t.seeds) & set(c.seeds))} with config.seeds: "
      "the knob must be chosen on seeds the report does not use"
    )
  if score_name(c) not in SCORES:
    raise ValueError(f"config.tuning.score={score_name(c)!r}: choose one of {SCORES}")
  if not t.seeds or not t.cells:
    raise ValueError("config.tuning.seeds / config.tuning.cells: need at least one seed and one (k, lr) cell")
  for cell in t.cells:
    if len(cell) != 2 or not int(cell[0]) >= 0 or not float(cell[1]) > 0:
      raise ValueError(f"config.tuning.cells: {cell!r} is not a (k >= 0, lr > 0) pair")
  from vcpo_jax import estimator

  for method in c.methods:
    if method not in t.knobs:
      raise ValueError(f"config.tuning.knobs: no entry for method {method!r}; give (knob name, values) or None")
    spec = knob_of(c, method)
    if spec is None:
      continue
    name, values = spec
    if len(values) != t.trials:
      raise ValueError(
        f"config.tuning.knobs[{method!r}]: {len(values)} values, but tuning.trials={t.trials} (the equal budget)"
      )
    if len(set(map(value_str, values))) != len(values):
      raise ValueError(f"config.tuning.knobs[{method!r}]: repeated values {values}")
    for v in values:
      over = knob_overrides(name, v)
      bad = [p for p in over if not p.startswith("method.")]
      if bad:
        raise ValueError(f"tuning knob {name!r} sets {bad}: only method.* fields are checked here")
      preset, fields = method_variant(c, method)
      over = {**{p: x for p, x in fields if p.startswith("method.")}, **over}
      try:
        estimator.method_from_preset(preset, {p[len("method.") :]: x for p, x in over.items()})
      except ValueError as e:
        raise ValueError(f"config.tuning.knobs[{method!r}] = ({name!r}, {value_str(v)}): {e}") from None


def select(values, scores) -> int:
  """Index of the best mean score; ties (and nan) resolved to the value listed first. scores [V]."""
  scores = np.asarray(scores, float)
  if not np.isfinite(scores).any():
    return 0
  best = np.nanmax(scores)
  return int(np.flatnonzero(scores == best)[0])


def tune_path(out: Path, method: str) -> Path:
  return Path(out) / "stability_raw" / "trainer" / f"tune_{method}.npz"


def settings(c, base: dict, method: str) -> dict:
  """What determines a method's trials: the study's run settings, the knob and its values, seeds, cells."""
  spec = knob_of(c, method)
  return dict(
    base,
    seeds=None,
    lrs=None,
    stage="tuning",
    method=method,
    knob=None if spec is None else [spec[0], [value_str(v) for v in spec[1]]],
    tuning_seeds=list(c.tuning.seeds),
    tuning_cells=[[int(k), float(lr)] for k, lr in c.tuning.cells],
    # the score enters only when it is not the original one, so the trials scored by "final" keep their prints
    **({} if score_name(c) == "final" else {"score": score_name(c)}),
  )


def run_trials(c, method: str, run_fn: Callable[..., dict]) -> dict:
  """Every trial of `method`: arrays [V, C, Ts, ...] (values x cells x tuning seeds), from run_fn.

  run_fn(method, k, seed, lr, knob) -> the run's arrays (stability.read_run's dict), knob = (name, value) or
  None; it reuses a finished run directory.
  """
  spec = knob_of(c, method)
  trials = [None] if spec is None else [(spec[0], v) for v in spec[1]]
  per = [
    [[run_fn(method, int(k), seed, float(lr), knob) for seed in c.tuning.seeds] for k, lr in c.tuning.cells]
    for knob in trials
  ]
  out = stack_runs([stack_runs([stack_runs(row) for row in cell]) for cell in per])
  out["values"] = np.asarray([value_str(None if t is None else t[1]) for t in trials])
  return out


# What a trial is scored by (config.tuning.score): "final" = the study's final accuracy; "auc" = the mean accuracy
# over every evaluation after step 0, which also penalises a trial that collapses mid-run and recovers.
SCORES = ("final", "auc")


def score_name(c) -> str:
  return str(c.tuning.get("score", "final"))


def score_fn(c, final_fn: Callable[[np.ndarray, np.ndarray], np.ndarray]):
  """The trial score as a function (accuracy [..., E], eval_steps [E]) -> [...] (see SCORES)."""
  if score_name(c) == "final":
    return final_fn
  return lambda acc, steps: np.asarray(acc)[..., np.asarray(steps) > 0].mean(-1)


def scores(z: dict, final_fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
  """Mean final accuracy per trial value over cells and tuning seeds: [V].

  final_fn(accuracy [..., E], eval_steps [E]) -> final [...] (the study's `final` definition).
  """
  acc = z["accuracy"]  # [V, C, Ts, E]
  fin = final_fn(acc, z["eval_step"][0, 0, 0])
  return fin.reshape(fin.shape[0], -1).mean(-1)


def chosen(c, z: dict | None, method: str, final_fn) -> tuple | None:
  """(knob name, value) the grid runs `method` with; None for a method without a knob.

  Raises LookupError when the method has a knob and its trials are not all finished (z is None).
  """
  spec = knob_of(c, method)
  if spec is None:
    return None
  if z is None:
    raise LookupError(f"{method}: its tuning trials are not finished")
  return spec[0], spec[1][select(spec[1], scores(z, final_fn))]
