"""The stability study: methods x lag k x seeds x learning rates, resumable, one command.

  python -m vcpo_jax.experiments.stability [--config=configs/stability.py:quick]  # synthetic (pure_lag), into runs/stability
  python -m vcpo_jax.experiments.stability --config=configs/stability.py:countdown  # the real trainer (~9 h)
  ... --config.seeds="(0,1,2)"                                    # any field: absl + ml_collections config_flags

Finished cells in --out are reused (the grid is resumable), so `--out=docs/results` does not train: it
rebuilds the committed report and plots from the committed cells in seconds. The default --out
(runs/stability, not tracked) recomputes every run.

Two backends share the grid, the bookkeeping and the report: `pure_lag` (the synthetic stride-counting task,
each cell's (lr, seed) runs vmapped in one compile) and `trainer` (every run is `vcpo_jax.trainer.run` in `lag`
mode on configs/countdown.py, one run at a time in its own directory; report stability_<config>.md). With
`tuning` the trainer backend first runs every method's knob trials on the tuning seeds (stage 1, tuning.py),
then the grid with each method at its chosen knob (stage 2; the knob is part of the cell's fingerprint).

Each cell (method, k) runs every (lr, seed) and is saved to <out>/stability_raw/<backend>/<method>_k<k>.npz with
the fingerprint of its settings; a rerun skips cells whose file has the same fingerprint. With workers > 1
methods are split between subprocesses. The report (<out>/stability.md or stability_<config>.md, and PNGs) is
written from whatever cells exist.

Definitions (fixed before the study; configs/stability.py `analysis`):
  final      mean accuracy over the evaluations in the last final_frac of steps.
  best       max accuracy over evaluations.
  collapsed  final < chance, or (best - chance >= min_gain and
             final - chance < collapse_keep * (best - chance)):
             the run lost at least half of what it had gained over chance.
  t_collapse the first evaluation step after the best from which accuracy stays
             below chance + collapse_keep * (best - chance) to the end.
  alarm      the first step at which the trailing median (window w) of the
             unclipped ESS ratio is below a threshold theta.
  lead time  t_collapse - t_alarm for collapsed runs (> 0: the alarm came first);
  false-alarm rate: fraction of non-collapsed runs with an alarm.
  selection  per method, the lr with the best mean final accuracy at k = 0
             (ties: the smaller lr); every lr is reported as well.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

NOTES_BEGIN, NOTES_END = "<!-- notes -->", "<!-- /notes -->"

# ----------------------------------------------------------------------------- statistics (numpy, host)


def final_value(curve: np.ndarray, steps_of_curve: np.ndarray, total_steps: int, frac: float) -> np.ndarray:
  """Mean of curve[..., j] over the points whose step lies in the last `frac` of training.

  Args:
    curve: [..., E] values at steps_of_curve [E] (ascending, in 1..total_steps).
  Returns [...]; at least the last point is always included.
  """
  steps_of_curve = np.asarray(steps_of_curve)
  sel = steps_of_curve > total_steps * (1.0 - frac)
  sel[-1] = True
  return np.asarray(curve)[..., sel].mean(-1)


def collapsed(final, best, chance: float, keep: float, min_gain: float) -> np.ndarray:
  """Collapse flag (see module docstring), elementwise over runs."""
  final, best = np.asarray(final, float), np.asarray(best, float)
  gain = best - chance
  return (final < chance) | ((gain >= min_gain) & (final - chance < keep * gain))


def collapse_step(curve: np.ndarray, steps_of_curve: np.ndarray, chance: float, keep: float) -> float:
  """First evaluation step after the best from which the curve stays below the half-gain line.

  Args: curve [E] of one run. Returns the step (float) or nan if it never stays below.
  """
  curve = np.asarray(curve, float)
  ib = int(np.argmax(curve))
  line = chance + keep * (curve[ib] - chance)
  below = curve < line
  # stays below from j on: suffix-all of `below`
  suffix = np.flip(np.cumprod(np.flip(below))).astype(bool)
  idx = [j for j in range(ib + 1, len(curve)) if suffix[j]]
  return float(np.asarray(steps_of_curve)[idx[0]]) if idx else math.nan


def trailing_median(x: np.ndarray, window: int) -> np.ndarray:
  """m[t] = median(x[max(0, t - window + 1) : t + 1]), [S] -> [S]."""
  x = np.asarray(x, float)
  return np.array([np.median(x[max(0, t - window + 1) : t + 1]) for t in range(len(x))])


def alarm_step(ess_ratio: np.ndarray, threshold: float, window: int) -> float:
  """First (1-based) step whose trailing-median ESS ratio is below threshold; nan if none.

  Steps are 1-based like evaluation steps: metric index t is learner step t + 1.
  """
  below = np.nonzero(trailing_median(ess_ratio, window) < threshold)[0]
  return float(below[0] + 1) if below.size else math.nan


def ess_predictor(
  ess_runs: np.ndarray,
  acc_runs: np.ndarray,
  eval_steps: np.ndarray,
  chance: float,
  keep: float,
  min_gain: float,
  final_frac: float,
  total_steps: int,
  threshold: float,
  window: int,
) -> dict:
  """Lead times for collapsed runs and the false-alarm rate for the others.

  Args: ess_runs [R, S], acc_runs [R, E]. Returns dict(n_collapsed, lead_times (list,
  nan where no alarm or no collapse step), n_missed (collapsed, never alarmed), n_no_step
  (collapsed by the final-value rule, but the curve never stays below the half-gain line
  after its best, e.g. the best is the last evaluation), n_ok, n_false_alarm, false_alarm_rate).
  """
  fin = final_value(acc_runs, eval_steps, total_steps, final_frac)
  col = collapsed(fin, acc_runs.max(-1), chance, keep, min_gain)
  lead, n_fa, n_missed, n_no_step = [], 0, 0, 0
  for r in range(acc_runs.shape[0]):
    ta = alarm_step(ess_runs[r], threshold, window)
    if col[r]:
      tc = collapse_step(acc_runs[r], eval_steps, chance, keep)
      lead.append(tc - ta)
      n_missed += int(math.isnan(ta))
      n_no_step += int(math.isnan(tc))
    else:
      n_fa += int(not math.isnan(ta))
  n_ok = int((~col).sum())
  return dict(
    n_collapsed=int(col.sum()),
    lead_times=lead,
    n_missed=n_missed,
    n_no_step=n_no_step,
    n_ok=n_ok,
    n_false_alarm=n_fa,
    false_alarm_rate=(n_fa / n_ok) if n_ok else math.nan,
  )


def auc_lower_predicts(pos: Sequence[float], neg: Sequence[float]) -> float:
  """P(score of a positive < score of a negative), ties count 1/2: AUC of "lower predicts positive"."""
  pos, neg = np.asarray(pos, float), np.asarray(neg, float)
  if not pos.size or not neg.size:
    return math.nan
  return float(
    ((pos[:, None] < neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (pos.size * neg.size)
  )


def select_lr(final_k0_by_lr: dict[float, float]) -> float:
  """The rule fixed in advance: best mean final accuracy at k = 0; ties go to the smaller lr."""
  items = sorted(final_k0_by_lr.items())
  best = max(v for _, v in items)
  return next(lr for lr, v in items if v == best)


# ----------------------------------------------------------------------------- cells and resume


def fingerprint(settings: dict) -> str:
  """Stable hash of everything that determines a cell's numbers."""
  return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cell_path(out: Path, backend: str, method: str, k: int) -> Path:
  return Path(out) / "stability_raw" / backend / f"{method}_k{k}.npz"


def load_cell(path: Path, fp: str) -> dict | None:
  """The saved arrays if the file exists and was made with fingerprint fp, else None."""
  if not path.exists():
    return None
  try:
    with np.load(path, allow_pickle=False) as z:
      if str(z["fingerprint"]) != fp:
        return None
      return {k: z[k] for k in z.files}
  except (OSError, ValueError, KeyError):
    return None  # a torn or foreign file: run the cell again


def save_cell(path: Path, arrays: dict, fp: str, seconds: float):
  """Atomic write (tmp + rename): an interrupted save never looks finished."""
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp.npz")
  np.savez(tmp, fingerprint=np.asarray(fp), seconds=np.asarray(seconds), **arrays)
  os.replace(tmp, path)


def cell_compute_seconds(z: dict) -> float:
  """Wall seconds a cell's runs took: the sum of its runs' own recorded times (`run_s`, kept in the ledger, so a
  cell rebuilt from finished records still counts what its runs cost), else the time it took to build the cell."""
  run_s = np.asarray(z.get("run_s", np.nan), dtype=float)
  return float(run_s.sum()) if run_s.size and np.isfinite(run_s).all() else float(z["seconds"])


def run_cells(
  cells: Sequence[tuple[str, int]],
  out: Path,
  backend: str,
  fp: str | Callable[[str], str],
  cell_fn: Callable[[str, int], dict],
  log=print,
) -> list[tuple[str, int]]:
  """Runs the cells not yet saved with fingerprint fp (a string, or method -> string), saving each when done.

  Returns the cells that were actually run (the others were skipped).
  """
  fp_of = fp if callable(fp) else (lambda m: fp)
  ran = []
  for method, k in cells:
    path = cell_path(out, backend, method, k)
    fp = fp_of(method)
    if load_cell(path, fp) is not None:
      log(f"[skip] {method} k={k}: {path} exists")
      continue
    t0 = time.time()
    arrays = cell_fn(method, k)
    dt = time.time() - t0
    save_cell(path, arrays, fp, dt)
    ran.append((method, k))
    log(f"[done] {method} k={k} in {dt:.0f}s -> {path}")
  return ran


# ----------------------------------------------------------------------------- the pure_lag backend


def pure_lag_settings(c) -> dict:
  return dict(
    backend="pure_lag",
    task=c.task.to_dict(),
    model=c.model.to_dict(),
    optim=c.optim.to_dict(),
    seeds=list(c.seeds),
    lrs=list(c.lrs),
    max_k=max(c.ks),
  )


def pure_lag_config(c):
  from vcpo_jax.experiments import pure_lag

  t, m, o = c.task, c.model, c.optim
  return pure_lag.PureLagConfig(
    alphabet=t.alphabet,
    max_stride=t.max_stride,
    resp_len=t.resp_len,
    prompts_per_step=t.prompts_per_step,
    group_size=t.group_size,
    steps=t.steps,
    eval_every=t.eval_every,
    eval_samples=t.eval_samples,
    hidden=m.hidden,
    layers=m.layers,
    heads=m.heads,
    mlp=m.mlp,
    weight_decay=o.weight_decay,
    clip_norm=o.clip_norm,
  )


def pure_lag_cell_fn(c) -> Callable[[str, int], dict]:
  from vcpo_jax import estimator
  from vcpo_jax.experiments import pure_lag

  cfg = pure_lag_config(c)

  def fn(method, k):
    pg = estimator.method_from_preset(method)
    return pure_lag.run_grid(cfg, pg, k, c.seeds, c.lrs, max_k=max(c.ks))

  return fn


# ----------------------------------------------------------------------------- the trainer backend (countdown)


def trainer_run_config(c, method: str, k: int, seed: int, lr: float, knob: tuple | None = None):
  """The real trainer's config for one run: configs/<c.trainer.config>.py with the study's fields set.

  knob: (name, value) of vcpo_jax.experiments.tuning.KNOBS, or None (the preset as it is). Policy-loss
  presets (policy_loss != "pg") get c.trainer.policy_loss_epochs x policy_loss_minibatches updates per step.
  """
  import importlib

  from vcpo_jax import estimator
  from vcpo_jax.rl import choices

  root = str(Path(__file__).resolve().parents[2])  # configs/ lives at the repository root
  if root not in sys.path:
    sys.path.insert(0, root)
  base = importlib.import_module(f"configs.{c.trainer.config}").get_config(c.trainer.variant or None)
  preset, fields = _run_fields(c, method, knob)
  base.seed, base.steps, base.method = seed, c.task.steps, choices.preset(preset)
  base.mode = "lag" if k else "sync"  # k = 0: the synchronous reference (same batches as lag with k = 0)
  base.lag.k = k
  base.optim.lr = lr
  base.eval.every = c.task.eval_every
  base.checkpoint.every = c.task.steps  # one checkpoint at the end: the study keeps only metrics
  base.log.progress = False
  base.log.plots = False
  base.log.norm_overhead_every = 0
  if preset in estimator.PRESETS and estimator.PRESETS[preset].peer_loss is not None:
    base.learner.ppo_epochs, base.learner.minibatches = policy_loss_updates(c)
  choices.set_paths(base, [(p, v) for p, v in fields if p.startswith(f"{choices.ROOT}.")])
  for path, value in [(p, v) for p, v in fields if not p.startswith(f"{choices.ROOT}.")]:
    *parents, leaf = path.split(".")
    node = base
    for name in parents:
      node = node[name]
    node[leaf] = value
  return base


def _run_fields(c, method: str, knob: tuple | None) -> tuple[str, list[tuple[str, object]]]:
  """(preset, [(run-config path, value)]) of a study method's run: its variant's fields, then its knob's."""
  from vcpo_jax.experiments import tuning

  preset, variant_fields = tuning.method_variant(c, method)
  return preset, [*variant_fields, *(tuning.knob_overrides(*knob).items() if knob is not None else ())]


def _ledger_json(c, method: str, k: int, seed: int, lr: float, knob=None) -> dict:
  """The run config's JSON with its method as the ledger's records hold it (legacy_method.run_config): the
  committed records keep their fingerprints."""
  from vcpo_jax.experiments import legacy_method

  preset, fields = _run_fields(c, method, knob)
  run_cfg = json.loads(trainer_run_config(c, method, k, seed, lr, knob).to_json())
  return legacy_method.run_config(run_cfg, preset, [(p, v) for p, v in fields if p.startswith("method.")])


def policy_loss_updates(c) -> tuple[int, int]:
  """(ppo_epochs, minibatches) of the policy-loss presets in this study (1, 1 where the config has none)."""
  return int(c.trainer.get("policy_loss_epochs", 1)), int(c.trainer.get("policy_loss_minibatches", 1))


def trainer_settings(c) -> dict:
  out = dict(
    backend="trainer",
    run_config=_ledger_json(c, "none", 0, 0, 0.0),  # everything but the grid
    seeds=list(c.seeds),
    lrs=list(c.lrs),
  )
  if policy_loss_updates(c) != (1, 1):  # only then do policy-loss runs differ from the base run config
    out["policy_loss_updates"] = list(policy_loss_updates(c))
  return out


def run_dir(c, method: str, k: int, lr: float, seed: int, knob: tuple | None = None, stage: str = "") -> Path:
  """<c.trainer.runs>/[<stage>/]<method>[_<knob><value>]_k<k>_lr<lr>_seed<seed>."""
  from vcpo_jax.experiments import tuning

  tag = "" if knob is None else f"_{knob[0]}{tuning.value_str(knob[1])}"
  return Path(c.trainer.runs) / stage / f"{method}{tag}_k{k}_lr{lr:g}_seed{seed}"


def read_run(workdir: Path, steps: int) -> dict:
  """Per-run arrays from the trainer's metrics.jsonl: evaluation curve and per-step training statistics."""
  from vcpo_jax import metrics as metrics_lib

  recs = metrics_lib.read_jsonl(str(workdir / "metrics.jsonl"))
  evals = sorted({r["step"]: r["eval/accuracy"] for r in recs if "eval/accuracy" in r}.items())
  train = {r["step"]: r for r in recs if "train/pg_loss" in r}
  if sorted(train) != list(range(1, steps + 1)):
    raise ValueError(f"{workdir}: metrics.jsonl has training steps {sorted(train)[:3]}..., expected 1..{steps}")
  col = lambda key: np.asarray([train[t][key] for t in range(1, steps + 1)], np.float64)
  # score centering's drift diagnostics (vcpo_jax/score_centering.py), where the run logged them every step
  drift = {f"drift_{k}": col(f"train/drift/{k}") for k in DRIFT if all(f"train/drift/{k}" in r for r in train.values())}
  return dict(
    accuracy=np.asarray([a for _, a in evals]),
    eval_step=np.asarray([s for s, _ in evals]),
    ess_ratio=col("train/ess_ratio"),
    ess_ratio_applied=col("train/ess_ratio_applied"),
    lr_scale=col("train/lr_scale"),
    grad_norm=col("train/grad_norm"),
    learn_s=col("time/learn_s"),  # wall seconds of each learner step (step 1 includes its compile)
    rollout_s=col("time/rollout_s"),  # wall seconds of each batch's sampling (step 1: the sampler's compile)
    run_s=np.asarray(_run_seconds(workdir)),  # wall seconds of the whole trainer.run (nan if not recorded)
    **drift,
    **{k: col(f"train/{k}") for k in COLLAPSE_SIGNALS if all(f"train/{k}" in r for r in train.values())},
    **_code_and_machine(workdir),
  )


DRIFT = ("coef_l1", "k1_kl_qp", "q_head_mass", "p_head_mass")
# Per-step signals of weights that all fall towards 0 together, which the self-normalized ESS cannot show:
# the mean log-ratio and the log of the mean UNNORMALIZED weight (vcpo_jax.rl.ess.log_mean_weight).
COLLAPSE_SIGNALS = ("log_ratio_mean", "log_mean_weight")


def _code_and_machine(workdir: Path) -> dict:
  """{"commit": "<40 hex>[+dirty]", "machine": CPU model} from the trainer's config.json provenance ({} if absent),
  so that a report can refuse to mix code versions or machines in one table."""
  try:
    prov = json.loads((Path(workdir) / "config.json").read_text())["provenance"]
  except (OSError, ValueError, KeyError):
    return {}
  git = prov.get("git") or {}
  commit = (git.get("commit") or "unknown") + ("+dirty" if git.get("dirty") else "")
  return dict(commit=np.asarray(commit), machine=np.asarray(str(prov.get("cpu_model") or "unknown")))


RUN_SECONDS = "study_seconds.json"  # written by the study next to the trainer's summary.json


def _run_seconds(workdir: Path) -> float:
  try:
    return float(json.loads((Path(workdir) / RUN_SECONDS).read_text())["seconds"])
  except (OSError, ValueError, KeyError):
    return math.nan


# The run-config fields of the ledger's committed records (data/ledger_fields.txt, written once). A field added
# since is left out of a run's fingerprint at its old value, so the records made before it stay valid, and is part
# of it at any other value. Its old value is its default (a new field's default keeps the old behaviour, by
# convention), except where the default has changed since the records were made: those fields are listed here.
# Changing the default of a field that is not in data/ledger_fields.txt: add its old default here.
LEDGER_FIELDS = frozenset(
  line for line in (Path(__file__).parent / "data" / "ledger_fields.txt").read_text().split("\n") if line[:1].isalpha()
)
OLD_VALUES = {
  "async_.publish_buffers": 0,  # the records' async_ block (dropped for sync / lag runs) had no publish buffers
  "async_.publish_checksum": "background",
}


@functools.lru_cache(maxsize=4)
def _ledger_defaults(run_config_cls) -> dict:
  """The default run config (run_spec.RunConfig()) as the ledger's records hold a run config (_ledger_json)."""
  from vcpo_jax import schema
  from vcpo_jax.experiments import legacy_method
  from vcpo_jax.rl import choices

  d = json.loads(schema.to_config_dict(run_config_cls).to_json())
  return legacy_method.run_config(d, choices.describe(choices.build(d[choices.ROOT])), [])


def _drop_later_fields(node: dict, defaults: dict, prefix: str = ""):
  """Deletes from run-config JSON `node` the fields not in LEDGER_FIELDS that hold their old value (OLD_VALUES,
  else the default in `defaults`) or whose change keeps the trajectory (execution layout, `fingerprint.EXCLUDED`:
  e.g. model.scan_layers); a section added since goes when all its fields went."""
  from vcpo_jax import fingerprint as run_fp

  for name in list(node):
    path, value, default = prefix + name, node[name], defaults.get(name, KeyError)
    if path in LEDGER_FIELDS:
      continue
    if run_fp.keeps_trajectory(path):
      del node[name]
      continue
    if isinstance(value, dict) and isinstance(default, dict) and path not in OLD_VALUES:
      _drop_later_fields(value, default, path + ".")
      if not value:
        del node[name]
    elif value == OLD_VALUES.get(path, default):
      del node[name]


def run_fingerprint(c, method: str, k: int, seed: int, lr: float, knob=None, stage: str = "") -> str:
  """Everything that determines one run's numbers: its own full run config (method, k, seed, lr, knob and the
  policy-loss updates included; it holds no paths) and the study's step count. Adding seeds, lrs or methods to
  the study leaves the other runs' fingerprints unchanged, and so do the async_ settings of a run that is not
  async (the study's runs are sync or lag; they never read them) and the fields added since the ledger's records
  at their old values (LEDGER_FIELDS)."""
  run_cfg = _ledger_json(c, method, k, seed, lr, knob)
  if run_cfg.get("mode") != "async":
    run_cfg.pop("async_", None)
  from vcpo_jax import run_spec

  _drop_later_fields(run_cfg, _ledger_defaults(run_spec.RunConfig))
  sampler = run_cfg.get("sampler", {})
  if sampler.get("support_replay") in ("auto", "off") and sampler.get("top_p") == 1.0 and sampler.get("top_k") == 0:
    del sampler["support_replay"]  # a later field that changes nothing without a sampling filter (as before it)
  return fingerprint(dict(backend="trainer", run_config=run_cfg, steps=c.task.steps, stage=stage))


def record_path(c, method: str, k: int, lr: float, seed: int, knob=None, stage: str = "") -> Path | None:
  """<c.trainer.ledger>/<run_dir's relative path>.npz, or None without a ledger."""
  if not c.trainer.get("ledger"):
    return None
  rel = run_dir(c, method, k, lr, seed, knob, stage).relative_to(c.trainer.runs)
  return Path(c.trainer.ledger) / rel.with_name(rel.name + ".npz")


def train_one(c, method: str, k: int, seed: int, lr: float, knob=None, stage: str = "", log=print) -> dict:
  """One run through vcpo_jax.trainer.run (or its finished record / directory): read_run's dict.

  Lookup order: the run's record in the ledger (`c.trainer.ledger`, a small npz per run that is kept in git,
  so a study spread over sessions on machines that are reset does not lose its finished runs; reused only
  with the same run_fingerprint), then the finished run directory (marked by summary.json), else the run
  itself. An unfinished directory is wiped and run again; checkpoints are deleted (~30 MB a run; the study
  reads metrics only). Every finished run is written to the ledger (atomically).
  """
  import shutil

  from vcpo_jax import trainer

  rec, fp = record_path(c, method, k, lr, seed, knob, stage), run_fingerprint(c, method, k, seed, lr, knob, stage)
  if rec is not None and (z := load_cell(rec, fp)) is not None:
    return {key: z[key] for key in z if key not in ("fingerprint", "seconds")}
  wd = run_dir(c, method, k, lr, seed, knob, stage)
  if not (wd / "summary.json").exists():
    shutil.rmtree(wd, ignore_errors=True)
    t0 = time.time()
    trainer.run(trainer_run_config(c, method, k, seed, lr, knob), str(wd))
    dt = time.time() - t0
    shutil.rmtree(wd / "checkpoints", ignore_errors=True)
    (wd / RUN_SECONDS).write_text(json.dumps({"seconds": dt}))
    log(f"  run {wd.relative_to(c.trainer.runs)}: {dt:.0f}s")
  arrays = read_run(wd, c.task.steps)
  if rec is not None:
    save_cell(rec, arrays, fp, float(arrays["run_s"]))
  return arrays


def trainer_cell_fn(
  c, log=print, knob_fn: Callable[[str], tuple | None] = lambda m: None
) -> Callable[[str, int], dict]:
  """Runs (or reuses) every (lr, seed) run of a cell through `vcpo_jax.trainer.run`; returns [L, S, ...] arrays.

  Each run has its own directory under c.trainer.runs, marked finished by the trainer's summary.json, so an
  interrupted cell resumes at run granularity. knob_fn(method): the (knob, value) its runs use (tuning).
  """

  def fn(method, k):
    knob = knob_fn(method)
    from vcpo_jax.experiments import tuning

    per = [tuning.stack_runs([train_one(c, method, k, seed, lr, knob, log=log) for seed in c.seeds]) for lr in c.lrs]
    return tuning.stack_runs(per)

  return fn


def enable_compilation_cache(c):
  """XLA's persistent compilation cache for this process, shared by every run of the study.

  Every run compiles the same step functions (trainer.run builds fresh closures, so jax's in-memory caches
  miss); the cache turns all but the first compile of each program into a load: a countdown run 91 -> 55 CPU
  seconds, with identical metrics (`python -m vcpo_jax.experiments.run_cost --part=run`; docs/REVIEW.md).
  """
  import jax

  jax.config.update("jax_compilation_cache_dir", str(Path(c.trainer.runs) / "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def cell_fn(c, log=print, out: Path | None = None) -> Callable[[str, int], dict]:
  """The backend's cell function; with tuning, each method's runs use the knob its finished trials in `out`
  chose (tuning.chosen)."""
  if c.backend == "pure_lag":
    return pure_lag_cell_fn(c)
  return trainer_cell_fn(c, log, lambda m: chosen_knob(c, out, m))


def _final(c):
  return lambda acc, steps: final_value(acc, steps, c.task.steps, c.analysis.final_frac)


def tune(c, out: Path, methods: Sequence[str], log=print) -> list[str]:
  """Stage 1 (trainer backend with tuning): every trial of each method, saved per method; resumable.

  Returns the methods whose trials were (re)computed; the others were finished already.
  """
  from vcpo_jax.experiments import tuning

  base = settings(c)
  ran = []
  for m in methods:
    fp = fingerprint(tuning.settings(c, base, m))
    path = tuning.tune_path(out, m)
    if load_cell(path, fp) is not None:
      log(f"[skip] tuning {m}: {path} exists")
      continue
    t0 = time.time()
    arrays = tuning.run_trials(c, m, lambda *a: train_one(c, *a, stage="tune", log=log))
    save_cell(path, arrays, fp, time.time() - t0)
    ran.append(m)
    z = load_cell(path, fp)
    scores = ", ".join(
      f"{v}: {x:.3f}" for v, x in zip(z["values"].tolist(), tuning.scores(z, tuning.score_fn(c, _final(c))))
    )
    log(f"[done] tuning {m} in {time.time() - t0:.0f}s: {tuning.score_name(c)} per value {scores}")
  return ran


def load_tuning(c, out: Path, method: str) -> dict | None:
  """The method's finished trials (tuning.run_trials arrays + values), or None."""
  from vcpo_jax.experiments import tuning

  return load_cell(tuning.tune_path(out, method), fingerprint(tuning.settings(c, settings(c), method)))


def chosen_knob(c, out: Path | None, method: str) -> tuple | None:
  """(knob, value) of the method's grid runs: its best trial; None without a knob or with tuning off."""
  from vcpo_jax.experiments import tuning

  if tuning.knob_of(c, method) is None:
    return None
  return tuning.chosen(c, load_tuning(c, out, method), method, tuning.score_fn(c, _final(c)))


def cell_fingerprint(c, out: Path | None) -> Callable[[str], str]:
  """method -> fingerprint of its grid cells: the study's settings, plus the chosen knob where tuned."""
  from vcpo_jax.experiments import tuning

  base = settings(c)
  plain = fingerprint(base)

  def fp(method):
    knob = chosen_knob(c, out, method)
    return plain if knob is None else fingerprint(dict(base, knob=[knob[0], tuning.value_str(knob[1])]))

  return fp


def settings(c) -> dict:
  return pure_lag_settings(c) if c.backend == "pure_lag" else trainer_settings(c)


def chance(c) -> float:
  """Accuracy of a policy that has learned nothing: uniform tokens (pure_lag); 0 for a verified task."""
  return 1.0 / (c.task.alphabet + c.task.max_stride) if c.backend == "pure_lag" else float(c.analysis.chance)


def batch_size(c) -> int:
  """Trajectories per learner step (the ESS ratio's resolution is 1 / batch_size)."""
  if c.backend == "pure_lag":
    return c.task.prompts_per_step * c.task.group_size
  rc = trainer_run_config(c, "none", 0, 0, 0.0)
  return rc.task.prompts_per_step * rc.task.group_size


def report_name(c) -> str:
  """Stem of the report and its PNGs: stability (pure_lag), c.trainer.report or stability_<config> (trainer)."""
  if c.backend == "pure_lag":
    return "stability"
  return c.trainer.get("report") or f"stability_{c.trainer.config}"


# ----------------------------------------------------------------------------- report


def _fmt(mean, std):
  return f"{mean:.3f} +- {std:.3f}"


def summarize(c, out: Path) -> dict:
  """Loads every finished cell (and tuning trials) and computes the per-(method, k, lr) statistics.

  With tuning, a method's grid cells count only once its trials are finished and name the knob they chose.
  """
  fp = fingerprint(settings(c))
  fp_of = cell_fingerprint(c, out) if c.backend == "trainer" else (lambda m: fp)
  chance_acc = chance(c)
  a = c.analysis
  cells, stats, knobs, trials = {}, {}, {}, {}
  for method in c.methods:
    if c.backend == "trainer" and c.tuning.enabled:
      z = load_tuning(c, out, method)
      if z is not None:
        trials[method] = z
    try:
      method_fp = fp_of(method)
      knobs[method] = chosen_knob(c, out, method) if c.backend == "trainer" else None
    except LookupError:
      continue  # its tuning is not finished: no grid cell can be its
    for k in c.ks:
      z = load_cell(cell_path(out, c.backend, method, k), method_fp)
      if z is None:
        continue
      cells[(method, k)] = z
      ev = z["eval_step"][0, 0]
      for i, lr in enumerate(c.lrs):
        acc, ess = z["accuracy"][i], z["ess_ratio"][i]  # [seeds, E], [seeds, S]
        fin = final_value(acc, ev, c.task.steps, a.final_frac)
        best = acc.max(-1)
        col = collapsed(fin, best, chance_acc, a.collapse_keep, a.min_gain)
        stats[(method, k, lr)] = dict(
          final=(fin.mean(), fin.std()),
          # Paired change from the step-0 evaluation (the warm start on this seed's problems), when there is one.
          change=((fin - acc[:, 0]).mean(), (fin - acc[:, 0]).std()) if ev[0] == 0 else None,
          best=(best.mean(), best.std()),
          collapsed=int(col.sum()),
          n=len(fin),
          ess_min=float(ess.min()),
          ess_q10=float(np.quantile(ess, 0.1, axis=-1).mean()),
          ess_median=float(np.median(ess, axis=-1).mean()),
          ess_applied_q10=float(np.quantile(z["ess_ratio_applied"][i], 0.1, axis=-1).mean()),
          lr_scale_mean=float(z["lr_scale"][i].mean()),
          grad_norm_max=float(z["grad_norm"][i].max()),
          seconds=float(z["seconds"]),
          **(_time_stats(z, i) if "learn_s" in z else {}),
          # median over steps, mean over seeds, of each drift diagnostic the runs logged
          **{f"drift_{k}": float(np.median(z[f"drift_{k}"][i], -1).mean()) for k in DRIFT if f"drift_{k}" in z},
        )
  selected = {}
  for method in c.methods:
    k0 = {lr: stats[(method, 0, lr)]["final"][0] for lr in c.lrs if (method, 0, lr) in stats}
    if k0:
      selected[method] = select_lr(k0)
    elif len(c.lrs) == 1:  # one lr: nothing to select (the study may then leave out k = 0)
      selected[method] = c.lrs[0]
  return dict(
    cells=cells, stats=stats, selected=selected, chance=chance_acc, fingerprint=fp, knobs=knobs, trials=trials
  )


def _time_stats(z: dict, i: int) -> dict:
  """Wall time of lr index i's runs: s per run (mean), median s per learner step / rollout after step 1."""
  return dict(
    run_s=float(np.nanmean(z["run_s"][i])) if np.isfinite(z["run_s"][i]).any() else math.nan,
    learn_s=float(np.median(z["learn_s"][i][:, 1:], axis=-1).mean()),
    rollout_s=float(np.median(z["rollout_s"][i][:, 1:], axis=-1).mean()),
  )


def plot(c, summary: dict, out: Path) -> list[str]:
  """Writes the study's figures into `out`; returns their file names (selected lr, all lrs, grid, tuning, time)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  many = len(c.methods) > 10  # 19 in the issue-13 study: 20 colours, and dashes for every second method
  cmap = plt.get_cmap("tab20" if many else "tab10")
  colors = lambda i: cmap(i % (20 if many else 10))
  dash = lambda i: "--" if many and i % 2 else "-"
  names = _plot_selected_lr(c, summary, out, plt, colors, dash)
  names.append(_plot_all_lrs(c, summary, out, plt, colors, dash))
  names.append(_plot_seed_grid(c, summary, out, plt, colors, dash))
  if summary.get("trials"):
    names.append(plot_tuning(c, summary, out, plt))
  names.append(_plot_learner_time(c, summary, out, plt, colors, dash))
  return [n for n in names if n is not None]


def _band(ax, c, cells, method, k, i, color, key="accuracy", steps_key="eval_step", ls="-"):
  """Mean +- std over seeds of cell (method, k) at lr index i (ESS: trailing median, median and min-max)."""
  z = cells[(method, k)]
  y = z[key][i]
  if key == "ess_ratio":
    y = np.stack([trailing_median(r, c.analysis.ess_window) for r in y])
    x = np.arange(1, y.shape[-1] + 1)
  else:
    x = z[steps_key][i, 0]
  if key == "ess_ratio":  # log scale: median over seeds with a min-max band (std goes negative)
    m, lo, hi = np.median(y, 0), y.min(0), y.max(0)
  else:
    m, s = y.mean(0), y.std(0)
    lo, hi = m - s, m + s
  ax.plot(x, m, color=color, label=method, lw=1.2, ls=ls)
  ax.fill_between(x, lo, hi, color=color, alpha=0.15)


def _legend(axes):
  """One legend, in the last panel, of every method drawn in any panel (a study still running leaves panels
  without some methods' cells)."""
  seen = {}
  for ax in axes.flat:
    for h, label in zip(*ax.get_legend_handles_labels()):
      seen.setdefault(label, h)
  if seen:
    axes.flat[-1].legend(list(seen.values()), list(seen), fontsize=6, loc="best")


def _plot_selected_lr(c, summary: dict, out: Path, plt, colors, dash) -> list[str]:
  """Accuracy and ESS ratio per k, each method at its selected lr: one figure each."""
  cells, selected, stem = summary["cells"], summary["selected"], report_name(c)
  names = []
  for key, fname, ylabel in (
    ("accuracy", f"{stem}_accuracy.png", "accuracy (mean +- std over seeds)"),
    (
      "ess_ratio",
      f"{stem}_ess.png",
      f"ESS ratio (trailing {c.analysis.ess_window}-step median)\nmedian and min-max over seeds",
    ),
  ):
    fig, axes = plt.subplots(1, len(c.ks), figsize=(4.2 * len(c.ks), 3.6), sharey=True, squeeze=False)
    for j, k in enumerate(c.ks):
      ax = axes[0, j]
      for mi, method in enumerate(c.methods):
        if (method, k) in cells and method in selected:
          _band(ax, c, cells, method, k, list(c.lrs).index(selected[method]), colors(mi), key, ls=dash(mi))
      ax.set_title(f"k = {k} (selected lr per method)")
      ax.set_xlabel("learner step")
      if key == "accuracy":
        ax.axhline(summary["chance"], color="k", ls=":", lw=0.8)
      else:
        ax.set_yscale("log")
        ax.set_ylim(0.5 / batch_size(c), 1.2)
    axes[0, 0].set_ylabel(ylabel)
    _legend(axes)
    names.append(_save(fig, out / fname, plt, dpi=110))
  return names


def _save(fig, path: Path, plt, dpi: int) -> str:
  """Lays out `fig`, writes it to `path` and closes it; returns the file's name."""
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  plt.close(fig)
  return path.name


def _plot_all_lrs(c, summary: dict, out: Path, plt, colors, dash) -> str:
  """Accuracy of every method, one panel per (lr, k)."""
  cells, stem = summary["cells"], report_name(c)
  fig, axes = plt.subplots(
    len(c.lrs), len(c.ks), figsize=(4.2 * len(c.ks), 3.0 * len(c.lrs)), sharey=True, squeeze=False
  )
  for i, lr in enumerate(c.lrs):
    for j, k in enumerate(c.ks):
      ax = axes[i, j]
      for mi, method in enumerate(c.methods):
        if (method, k) in cells:
          _band(ax, c, cells, method, k, i, colors(mi), ls=dash(mi))
      ax.axhline(summary["chance"], color="k", ls=":", lw=0.8)
      ax.set_title(f"lr = {lr:g}, k = {k}", fontsize=9)
      if i == len(c.lrs) - 1:
        ax.set_xlabel("learner step")
      if j == 0:
        ax.set_ylabel("eval accuracy\n(mean +- std over seeds)")
  _legend(axes)
  return _save(fig, out / f"{stem}_accuracy_all_lrs.png", plt, dpi=90)


def _plot_seed_grid(c, summary: dict, out: Path, plt, colors, dash) -> str | None:
  """Every seed of every (method, k) at the method's selected lr (None: no method selected)."""
  cells, selected, stem = summary["cells"], summary["selected"], report_name(c)
  # Small multiples: one panel per (method, k) at the method's selected lr, every seed drawn, so that
  # ten overlapping bands do not hide a single collapsing run.
  shown = [m for m in c.methods if m in selected]
  if shown:
    fig, axes = plt.subplots(
      len(shown), len(c.ks), figsize=(2.6 * len(c.ks), 1.6 * len(shown)), sharex=True, sharey=True, squeeze=False
    )
    for i, method in enumerate(shown):
      lr_i = list(c.lrs).index(selected[method])
      for j, k in enumerate(c.ks):
        ax = axes[i, j]
        if (method, k) in cells:
          z = cells[(method, k)]
          x, y = z["eval_step"][lr_i, 0], z["accuracy"][lr_i]
          for run in y:
            ax.plot(x, run, color=colors(i), lw=0.6, alpha=0.5)
          ax.plot(x, y.mean(0), color=colors(i), lw=1.6)
          ax.fill_between(x, y.min(0), y.max(0), color=colors(i), alpha=0.15)
        ax.axhline(summary["chance"], color="k", ls=":", lw=0.6)
        ax.tick_params(labelsize=6)
        if i == 0:
          ax.set_title(f"k = {k}", fontsize=8)
        if j == 0:
          ax.set_ylabel(f"{method}\nlr {selected[method]:g}", fontsize=7)
    fig.suptitle("accuracy per method and k: mean (thick), each seed (thin), min-max band", fontsize=9)
    fig.supxlabel("learner step", fontsize=8)
    fig.supylabel("eval accuracy (row: method, its selected lr)", fontsize=8)
    return _save(fig, out / f"{stem}_accuracy_grid.png", plt, dpi=90)
  return None


def _plot_learner_time(c, summary: dict, out: Path, plt, colors, dash) -> str | None:
  """Learner wall ms per step per method (None: no timings in the ledger)."""
  stem = report_name(c)
  timed = [m for m in c.methods if _method_time(c, summary, m) is not None]
  if timed:
    fig, ax = plt.subplots(figsize=(max(5.0, 0.45 * len(timed) + 2), 3.6))
    per_step = [_method_time(c, summary, m)["learn_s"] * 1e3 for m in timed]
    ax.bar(range(len(timed)), per_step, color=[colors(c.methods.index(m)) for m in timed])
    ax.set_xticks(range(len(timed)), timed, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("learner step, wall ms\n(median over steps 2.., mean over runs)")
    ax.set_xlabel("method")
    ax.set_title("learner time per trainer step (policy-loss methods: pi_old pass + several updates)", fontsize=8)
    return _save(fig, out / f"{stem}_time.png", plt, dpi=100)
  return None


def plot_tuning(c, summary: dict, out: Path, plt) -> str:
  """One panel per method with a knob: tuning score (mean final accuracy) of each trial value, chosen marked."""
  from vcpo_jax.experiments import tuning

  trials = summary["trials"]
  shown = [m for m in c.methods if m in trials]
  cols = min(5, len(shown))
  rows = -(-len(shown) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.2 * rows), sharey=True, squeeze=False)
  for ax in axes.flat[len(shown) :]:
    ax.axis("off")
  for ax, m in zip(axes.flat, shown):
    z = trials[m]
    sc = tuning.scores(z, tuning.score_fn(c, _final(c)))
    best = tuning.select(list(z["values"]), sc)
    ax.bar(range(len(sc)), sc, color=["C3" if i == best else "C0" for i in range(len(sc))])
    ax.set_xticks(range(len(sc)), list(z["values"]), fontsize=6)
    spec = tuning.knob_of(c, m)
    ax.set_title(m, fontsize=8)
    ax.set_xlabel("-" if spec is None else spec[0], fontsize=7)
    ax.tick_params(labelsize=6)
  for r in range(rows):
    axes[r, 0].set_ylabel("final accuracy\n(tuning seeds)", fontsize=7)
  fig.suptitle(
    f"equal tuning budget: each method's own knob on seeds {list(c.tuning.seeds)} at (k, lr) "
    f"{[tuple(x) for x in c.tuning.cells]}; red = chosen",
    fontsize=8,
  )
  return _save(fig, out / f"{report_name(c)}_tuning.png", plt, dpi=100)


def _method_time(c, summary: dict, method: str) -> dict | None:
  """Wall time of a method pooled over its finished cells and lrs (None without timing data)."""
  rows = [s for (m, _, _), s in summary["stats"].items() if m == method and "learn_s" in s]
  if not rows:
    return None
  run_s = [s["run_s"] for s in rows if np.isfinite(s["run_s"])]
  return dict(
    run_s=float(np.mean(run_s)) if run_s else math.nan,
    learn_s=float(np.mean([s["learn_s"] for s in rows])),
    rollout_s=float(np.mean([s["rollout_s"] for s in rows])),
  )


def describe(c) -> tuple[str, str, str]:
  """(title, what was run, accuracy definition) for the report of either backend."""
  if c.backend == "pure_lag":
    return (
      "Stability study (backend: `pure_lag`, synthetic stride-counting task)",
      (
        "Every table below comes from the **pure_lag** backend: a "
        f"{c.model.layers}-layer D={c.model.hidden} transformer (`vcpo_jax.model.transformer`), "
        f"T = {c.task.resp_len} response tokens, {c.task.prompts_per_step} prompts x "
        f"{c.task.group_size} samples per step, {c.task.steps} learner steps, exact lag, "
        "the library's estimator (`pg_coefficients` via `learner.policy_gradient('ghost')`) and optimizer "
        f"(`make_optimizer`: clip {c.optim.clip_norm}, AdamW wd {c.optim.weight_decay}, ESS scale). "
        "Not the countdown trainer."
      ),
      (
        "mean reward (fraction of correct tokens) of the current policy's samples on all "
        f"{c.task.alphabet * c.task.max_stride} prompts x {c.task.eval_samples}, temperature 1"
      ),
    )
  rc = trainer_run_config(c, "none", 0, 0, 0.0)
  return (
    f"Stability study (backend: `trainer`, configs/{c.trainer.config}.py)",
    (
      "Every run is `vcpo_jax.trainer.run` itself (sampler, verifier, ghost-norm learner, optimizer) in "
      f"`lag` mode on configs/{c.trainer.config}.py: a {rc.model.preset} policy"
      + (f" ({rc.model.num_layers} layers, width {rc.model.hidden_size})" if rc.model.num_layers else "")
      + f" warm-started by {rc.sft.steps} SFT steps, {rc.task.prompts_per_step} prompts x "
      f"{rc.task.group_size} samples per step, up to {rc.task.max_new_tokens} response tokens, {c.task.steps} "
      f"learner steps, AdamW (clip {rc.optim.clip_norm}, wd {rc.optim.weight_decay}). Run directories: "
      f"`{c.trainer.runs}/` (metrics.jsonl per run)."
    ),
    (
      f"eval accuracy (verifier reward, mean over {rc.eval.n} samples at temperature {rc.eval.temperature}, "
      f"top_p {rc.eval.top_p}) on {rc.eval.num_problems} held-out problems"
    ),
  )


def write_report(c, out: Path, summary: dict, runtime_s: float | None, command: str) -> Path:
  """Writes `out`/<report_name>.md from the summary; the notes block of an existing report is kept."""
  out = Path(out)
  path = out / f"{report_name(c)}.md"
  notes = ""
  if path.exists():
    old = path.read_text()
    if NOTES_BEGIN in old and NOTES_END in old:
      notes = old[old.index(NOTES_BEGIN) : old.index(NOTES_END) + len(NOTES_END)]
  L = _report_header(c, summary, runtime_s, command)
  if c.backend == "trainer" and c.tuning.enabled:
    L += tuning_section(c, summary)
  L += _headline_section(c, summary)
  L += _every_lr_section(c, summary)
  L += _predictor_section(c, summary)
  L += _ess_by_collapse_section(c, summary)
  L += _drift_section(c, summary)
  L += time_section(c, summary)
  L.append("\n## Notes\n")
  L.append(notes or f"{NOTES_BEGIN}\n(no notes yet)\n{NOTES_END}")
  L.append("")
  path.write_text("\n".join(L))
  return path


def _drift_section(c, summary: dict) -> list[str]:
  """Score centering's drift diagnostics per cell (the centered methods only), median over steps."""
  rows = [(key, st) for key, st in sorted(summary["stats"].items()) if "drift_coef_l1" in st]
  if not rows:
    return []
  L = [
    "\n## Drift diagnostics of the centered methods\n",
    "Per step: k1 = mean over loss tokens of log q(y) - log p(y) (the sampled-token estimate of KL(q || p)); "
    "coef L1 = mean over loss tokens of sum_v |c_v|; q / p head mass = mean over loss tokens of the mass q and "
    "p give the sampler's recorded ids (top-k only). Median over the run's steps, mean over seeds.\n",
    "| method | k | lr | k1 KL(q‖p) | coef L1 | q head mass | p head mass |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  fmt = lambda st, k: f"{st[k]:.4f}" if k in st else "-"
  for (m, k, lr), st in rows:
    cols = " | ".join(fmt(st, f"drift_{d}") for d in ("k1_kl_qp", "coef_l1", "q_head_mass", "p_head_mass"))
    L.append(f"| {m} | {k} | {lr:g} | {cols} |")
  return L


def _report_header(c, summary: dict, runtime_s: float | None, command: str) -> list[str]:
  """Title, provenance, coverage, compute and the definitions fixed before the runs."""
  cells, a = summary["cells"], c.analysis
  done = sorted(cells)
  missing = [(m, k) for m in c.methods for k in c.ks if (m, k) not in cells]
  L = []
  title, what, accuracy_def = describe(c)
  L.append(f"# {title}\n")
  L.append(f"Generated by `{command}` (vcpo_jax/experiments/stability.py, configs/stability.py). {what}\n")
  L.append(
    f"- cells finished: {len(done)} / {len(c.methods) * len(c.ks)}"
    + (f"; missing: {', '.join(f'{m} k={k}' for m, k in missing)}" if missing else "")
  )
  L.append(
    f"- seeds {list(c.seeds)}, learning rates {list(c.lrs)} (the same grid for every method), "
    f"lags k {list(c.ks)}; chance accuracy {summary['chance']:.3f}; settings fingerprint "
    f"`{summary['fingerprint']}`"
  )
  secs = sum(cell_compute_seconds(z) for z in cells.values())
  L.append(
    f"- compute: {secs / 60:.1f} min summed over cells"
    + (f"; this invocation's wall-clock {runtime_s / 60:.1f} min" if runtime_s is not None else "")
  )
  start = "its seed's random init (no warm start)" if c.backend == "pure_lag" else "the shared SFT warm start"
  L.append(
    f"- exact lag: the batch of learner step t is sampled with the parameters of version max(0, t - k) "
    f"(as `rollout.lag.LagSource`); every run starts from {start}.\n"
  )
  L.append("\n## Definitions (fixed before the runs)\n")
  L.append(
    f"- accuracy: {accuracy_def}, every {c.task.eval_every} steps. final = mean over evaluations in the last "
    f"{a.final_frac:.0%} of steps; best = max over evaluations"
    + ("; final - step 0: paired change from the same seed's step-0 evaluation." if c.backend == "trainer" else ".")
  )
  L.append(
    f"- collapsed: final < chance, or (best - chance >= {a.min_gain} and final - chance < "
    f"{a.collapse_keep} x (best - chance)), i.e. the run lost at least half its gain over chance."
  )
  L.append(
    "- ESS: unclipped sequence-weight ESS ratio of each training batch (min over all steps of all "
    "seeds; q10 and median: per-run quantile over steps, averaged over seeds); `applied q10` uses "
    "the weights the update applies."
  )
  L.append(
    "- lr selection: per method, the lr with the best mean final accuracy at k = 0 (ties: smaller lr). "
    "All lrs are in the full table.\n"
  )
  return L


def _headline_section(c, summary: dict) -> list[str]:
  """The selected lr per method: accuracy, collapses and ESS per k."""
  stats, selected = summary["stats"], summary["selected"]
  stem = report_name(c)
  L = []
  knobs = summary.get("knobs", {})

  def label(m):
    from vcpo_jax.experiments import tuning

    kn = knobs.get(m)
    return m if kn is None else f"{m} ({kn[0]} = {tuning.value_str(kn[1])})"

  L.append("\n## Headline: selected lr per method\n")
  has_change = bool(stats) and all(s["change"] is not None for s in stats.values())
  L.append(
    "| method | lr | k | final | best |"
    + (" final - step 0 |" if has_change else "")
    + " collapsed | ESS min | ESS q10 | ESS median | applied q10 | mean lr scale |"
  )
  L.append("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if has_change else ""))
  for m in c.methods:
    if m not in selected:
      continue
    lr = selected[m]
    for k in c.ks:
      s = stats.get((m, k, lr))
      if s is None:
        continue
      L.append(
        f"| {label(m)} | {lr:g} | {k} | {_fmt(*s['final'])} | {_fmt(*s['best'])} | "
        + (f"{s['change'][0]:+.3f} +- {s['change'][1]:.3f} | " if has_change else "")
        + f"{s['collapsed']}/{s['n']} | "
        f"{s['ess_min']:.3f} | {s['ess_q10']:.3f} | {s['ess_median']:.3f} | {s['ess_applied_q10']:.3f} | "
        f"{s['lr_scale_mean']:.2f} |"
      )
  L.append(f"\n![accuracy]({stem}_accuracy.png)\n")
  L.append(f"![accuracy per method and k]({stem}_accuracy_grid.png)\n")
  L.append(f"![ESS]({stem}_ess.png)\n")
  return L


def _every_lr_section(c, summary: dict) -> list[str]:
  """Final accuracy of every (method, k, lr), collapsed runs in brackets."""
  stats = summary["stats"]
  stem = report_name(c)
  L = []
  L.append("\n## Final accuracy, every lr (mean +- std over seeds; collapsed runs in brackets)\n")
  L.append("| method | k | " + " | ".join(f"lr {lr:g}" for lr in c.lrs) + " |")
  L.append("|---|---|" + "---|" * len(c.lrs))
  for m in c.methods:
    for k in c.ks:
      row = []
      for lr in c.lrs:
        s = stats.get((m, k, lr))
        row.append("-" if s is None else f"{_fmt(*s['final'])} [{s['collapsed']}]")
      if any(x != "-" for x in row):
        L.append(f"| {m} | {k} | " + " | ".join(row) + " |")
  L.append(f"\n![all lrs]({stem}_accuracy_all_lrs.png)\n")
  return L


def _predictor_section(c, summary: dict) -> list[str]:
  """ESS alarms vs collapses: lead times, misses and false alarms, pooled and per k / method."""
  cells = summary["cells"]
  a = c.analysis
  L = []
  L.append("\n## ESS as a predictor of collapse (pooled over lrs and seeds)\n")
  L.append(
    f"Alarm: trailing median over {a.ess_window} steps of the unclipped ESS ratio below theta. "
    "Lead time = collapse step - alarm step (positive: the alarm came first). `no step`: collapsed by "
    "the final-value rule, but the curve never stays below the half-gain line after its best (no lead "
    "time defined).\n"
  )
  L.append(
    "| theta | collapsed runs | alarmed before collapse | lead time median [min, max] | missed | no step | "
    "non-collapsed runs | false alarms (rate) |"
  )
  L.append("|---|---|---|---|---|---|---|")

  def predictor_row(label, th, keep_cell):
    lead, n_col, n_missed, n_ok, n_fa, n_ns = [], 0, 0, 0, 0, 0
    for (m, k), z in cells.items():
      if not keep_cell(m, k):
        continue
      for i, _ in enumerate(c.lrs):
        r = ess_predictor(
          z["ess_ratio"][i],
          z["accuracy"][i],
          z["eval_step"][i, 0],
          summary["chance"],
          a.collapse_keep,
          a.min_gain,
          a.final_frac,
          c.task.steps,
          th,
          a.ess_window,
        )
        lead += r["lead_times"]
        n_col += r["n_collapsed"]
        n_missed += r["n_missed"]
        n_ns += r["n_no_step"]
        n_ok += r["n_ok"]
        n_fa += r["n_false_alarm"]
    lt = np.asarray([x for x in lead if not math.isnan(x)])
    before = int((lt > 0).sum())
    lt_s = f"{np.median(lt):.0f} [{lt.min():.0f}, {lt.max():.0f}]" if lt.size else "-"
    rate = f"{n_fa / n_ok:.2f}" if n_ok else "-"
    L.append(f"| {label} | {th} | {n_col} | {before} | {lt_s} | {n_missed} | {n_ns} | {n_ok} | {n_fa} ({rate}) |")

  L[-2] = L[-2].replace("| theta |", "| runs | theta |")
  L[-1] = L[-1] + "---|---|"
  for th in a.ess_thresholds:
    predictor_row("all", th, lambda m, k: True)
  mid = a.ess_thresholds[len(a.ess_thresholds) // 2]
  for k in c.ks:
    predictor_row(f"k = {k}", mid, lambda m, kk, k=k: kk == k)
  for m in c.methods:
    predictor_row(m, mid, lambda mm, k, m=m: mm == m)
  return L


def _ess_by_collapse_section(c, summary: dict) -> list[str]:
  """Per-run ESS of collapsed vs non-collapsed runs at equal k, with the AUC of low ESS -> collapse."""
  cells = summary["cells"]
  a = c.analysis
  L = []
  # Is a low ESS specific to collapse, or just a symptom of lag? Compare at equal k.
  L.append(
    "\nPer-run median and 10%-quantile of the unclipped ESS ratio (over the first half of training, "
    "before most collapses), collapsed vs non-collapsed runs at equal k (all methods and lrs):\n"
  )
  L.append(
    "| k | collapsed: n, median ESS, q10 ESS | not collapsed: n, median ESS, q10 ESS | "
    "AUC (lower median ESS -> collapse) |"
  )
  L.append("|---|---|---|---|")
  for k in c.ks:
    groups = {True: [], False: []}
    for (m, kk), z in cells.items():
      if kk != k:
        continue
      for i, _ in enumerate(c.lrs):
        acc = z["accuracy"][i]
        fin = final_value(acc, z["eval_step"][i, 0], c.task.steps, a.final_frac)
        col = collapsed(fin, acc.max(-1), summary["chance"], a.collapse_keep, a.min_gain)
        half = z["ess_ratio"][i][:, : c.task.steps // 2]
        for r in range(len(col)):
          groups[bool(col[r])].append((np.median(half[r]), np.quantile(half[r], 0.1)))

    def cellstr(g):
      if not g:
        return "0, -, -"
      g = np.asarray(g)
      return f"{len(g)}, {g[:, 0].mean():.3f}, {g[:, 1].mean():.3f}"

    auc = auc_lower_predicts([g[0] for g in groups[True]], [g[0] for g in groups[False]])
    L.append(
      f"| {k} | {cellstr(groups[True])} | {cellstr(groups[False])} | "
      + ("-" if math.isnan(auc) else f"{auc:.2f}")
      + " |"
    )
  return L


def tuning_section(c, summary: dict) -> list[str]:
  """The equal-tuning-budget table: every trial's score, the chosen value, methods still to tune."""
  from vcpo_jax.experiments import tuning

  t, trials = c.tuning, summary.get("trials", {})
  L = ["\n## Equal tuning budget\n"]
  L.append(
    f"Before the grid, every method gets the same {t.trials} trials of its own main knob "
    "(configs/stability.py `KNOBS`; `none` has no knob and runs once), on tuning seed(s) "
    f"{list(t.seeds)} (not report seeds) at (k, lr) = {', '.join(f'({k}, {lr:g})' for k, lr in t.cells)}. "
    "Score: mean final accuracy over those runs; the best value (ties: the one listed first) is the method's "
    "knob in every grid run, so each method is reported at its own best. The lr is then selected per method "
    "at k = 0 as before. One seed per trial: a trial's score has the seed-to-seed spread of the tables below "
    "(std over seeds), so close scores are ties in all but name.\n"
  )
  width = max([t.trials, 1])
  L.append("| method | knob | " + " | ".join(f"trial {i + 1}" for i in range(width)) + " | chosen |")
  L.append("|---|---|" + "---|" * width + "---|")
  for m in c.methods:
    spec = tuning.knob_of(c, m)
    values = [None] if spec is None else list(spec[1])
    z = trials.get(m)
    sc = tuning.scores(z, tuning.score_fn(c, _final(c))) if z is not None else None
    best = tuning.select(values, sc) if sc is not None else None
    row = []
    for i, v in enumerate(values):
      txt = tuning.value_str(v) if spec is not None else "(no knob)"
      row.append(txt if sc is None else (f"**{txt}: {sc[i]:.3f}**" if i == best else f"{txt}: {sc[i]:.3f}"))
    row += [""] * (width - len(row))
    chosen = "not finished" if sc is None else ("-" if spec is None else tuning.value_str(values[best]))
    L.append(f"| {m} | {'-' if spec is None else spec[0]} | " + " | ".join(row) + f" | {chosen} |")
  if trials:
    L.append(f"\n![tuning]({report_name(c)}_tuning.png)\n")
  return L


def time_section(c, summary: dict) -> list[str]:
  """Wall time per method and what the policy-loss methods' pi_old pass and extra updates cost."""
  rows = {m: _method_time(c, summary, m) for m in c.methods}
  rows = {m: r for m, r in rows.items() if r is not None}
  if not rows:
    return []
  from vcpo_jax import estimator
  from vcpo_jax.experiments import tuning

  ep, mb = policy_loss_updates(c)
  L = ["\n## Wall time per method\n"]
  L.append(
    "Wall seconds measured inside each run (this machine, shared with other work: compare methods within "
    "one study only). s / run: the whole `trainer.run` (compiles load from the persistent cache after a "
    "program's first run); learner / rollout: median seconds per step over steps 2.. (step 1 carries the "
    f"compile), mean over runs. Policy-loss methods run {ep} x {mb} updates per trainer step plus one "
    "forward pass for pi_old (recomputed once per step); the other methods make one update and need no extra "
    "pass. `learner vs none`: the learner column over `none`'s, so for a policy-loss method it is the cost of "
    "the pi_old pass and its extra updates (with its loss), and for VCPO that of the per-example norms.\n"
  )
  L.append("| method | updates / step | s / run | learner s / step | rollout s / step | learner vs none |")
  L.append("|---|---|---|---|---|---|")
  ref = rows.get("none", {}).get("learn_s")
  for m, r in rows.items():
    ups = ep * mb if estimator.PRESETS[tuning.method_variant(c, m)[0]].peer_loss is not None else 1
    rel = f"{r['learn_s'] / ref:.2f}x" if ref else "-"
    run_s = "-" if math.isnan(r["run_s"]) else f"{r['run_s']:.0f}"
    L.append(f"| {m} | {ups} | {run_s} | {r['learn_s']:.3f} | {r['rollout_s']:.3f} | {rel} |")
  L.append(f"\n![time]({report_name(c)}_time.png)\n")
  return L


# ----------------------------------------------------------------------------- command line


_ROOT = Path(__file__).resolve().parents[2]  # the repository: configs/ lives there
_CONFIG_FILE = _ROOT / "configs" / "stability.py"


def check_config(c):
  """Raises ValueError for a study config the grid cannot run."""
  if c.backend not in ("pure_lag", "trainer"):
    raise ValueError(
      f"config.backend={c.backend!r}: use 'pure_lag' (synthetic) or 'trainer' (configs/<trainer.config>.py)"
    )
  if 0 not in c.ks and len(c.lrs) > 1:
    raise ValueError("config.ks: must contain 0 with several lrs (the lr selection rule uses k = 0)")
  for method, ks in (c.get("method_ks") or {}).items():
    if not set(ks) <= set(c.ks):
      raise ValueError(f"config.method_ks[{method!r}]={tuple(ks)}: give a subset of config.ks {tuple(c.ks)}")
  if "tuning" in c:
    from vcpo_jax.experiments import tuning

    tuning.check(c)
  return c


def load_config(variant: str = "", overrides: dict | None = None):
  """configs/stability.py's get_config(variant) with {"a.b": value} overrides, checked (programmatic use)."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("_stability_config", _CONFIG_FILE)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config(variant or None)
  for path, value in (overrides or {}).items():
    *parents, leaf = path.split(".")
    node = c
    for name in parents:
      node = node[name]
    node[leaf] = value
  return check_config(c)


def run_study(c, out: Path, methods: Sequence[str], log=print):
  """Stage 1 (trainer backend with tuning): every method's knob trials; stage 2: the grid cells of `methods`.

  The trainer backend turns on the persistent compilation cache for this process (enable_compilation_cache).
  """
  if c.backend == "trainer":
    enable_compilation_cache(c)
  if c.backend == "trainer" and c.tuning.enabled:
    tune(c, out, methods, log)
  fp = cell_fingerprint(c, out) if c.backend == "trainer" else fingerprint(settings(c))
  run_cells([(m, k) for m in methods for k in ks_of(c, m)], out, c.backend, fp, cell_fn(c, log, out), log=log)


def ks_of(c, method: str) -> tuple[int, ...]:
  """The lags `method` runs at: c.method_ks[method] where the study lists it (a subset of c.ks), else c.ks."""
  return tuple(int(k) for k in (c.get("method_ks") or {}).get(method, c.ks))


def _define_flags():
  """The command line (absl + ml_collections.config_flags, as main.py); defined only when run as a script."""
  from absl import flags
  from ml_collections import config_flags

  config_flags.DEFINE_config_file(
    "config",
    str(_CONFIG_FILE),
    "The study: configs/stability.py[:variant] (quick, countdown, countdown_quick); --config.FIELD=VALUE overrides.",
    lock_config=True,
  )
  flags.DEFINE_string("out", "runs/stability", "results folder; finished cells there are reused (docs/results)")
  flags.DEFINE_string("worker", None, "i/n: run only methods i, i+n, ... (internal)")
  flags.DEFINE_bool("report_only", False, "only rebuild the report and plots from the cells in --out")


def main(argv):
  from absl import flags

  F = flags.FLAGS
  c = check_config(F.config)
  config_arg = F["config"].config_filename  # path[:variant], passed on to the workers as given
  del argv  # absl has parsed it; the --config.FIELD=VALUE overrides are re-read to pass on and to record
  overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
  out = Path(F.out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.time()
  if F.worker is not None:
    i, n = (int(x) for x in F.worker.split("/"))
    log = lambda s: print(f"[w{i}] {s}", flush=True)
    run_study(c, out, [m for j, m in enumerate(c.methods) if j % n == i], log)
    return
  if not F.report_only:
    if c.workers > 1:
      env = dict(os.environ)
      # One intra-op thread per worker: the processes, not XLA's threads, share the cores.
      env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
      ).strip()
      base = [sys.executable, "-m", "vcpo_jax.experiments.stability", f"--out={out}", f"--config={config_arg}"]
      procs = [subprocess.Popen(base + overrides + [f"--worker={i}/{c.workers}"], env=env) for i in range(c.workers)]
      codes = [p.wait() for p in procs]
      if any(codes):
        print(f"workers exited with {codes}; writing the report from the finished cells", flush=True)
    else:
      run_study(c, out, c.methods, lambda s: print(s, flush=True))
  runtime = time.time() - t0
  summary = summarize(c, out)
  if summary["cells"] or summary.get("trials"):
    plot(c, summary, out)
  shown = os.path.relpath(config_arg, _ROOT) if os.path.isabs(config_arg) else config_arg
  cmd = " ".join(
    ["python -m vcpo_jax.experiments.stability", f"--out={F.out}"]
    + ([f"--config={shown}"] if shown != "configs/stability.py" else [])
    + overrides
  )
  path = write_report(c, out, summary, None if F.report_only else runtime, cmd)
  print(f"total runtime {runtime / 60:.1f} min; report: {path}", flush=True)


if __name__ == "__main__":
  from absl import app

  _define_flags()
  app.run(main)
