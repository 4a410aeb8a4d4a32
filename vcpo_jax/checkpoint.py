"""Atomic, resumable checkpoints with Orbax: keep the last N plus the best.

"Best" has one definition, `best_steps`: the checkpoints ranked by the evaluation of their own step's
parameters (BEST_METRIC, eval mean@n, saved with each checkpoint; a synchronous, background or final
evaluation alike), the earliest step on ties. Retention keeps those, `Checkpointer.best_step` names the
first (after a resume too: the ranking metrics are stored with the checkpoints), and
`python -m vcpo_jax.export --step=best` exports it.

What is saved at a step is one pytree of arrays (parameters, optimizer state,
the parameter versions that `lag` mode still needs, RNG keys, ...) and one JSON
dict (data-stream position, config fingerprint, metrics). Orbax writes each
step into a temporary directory and renames it when complete, so a crash
during a save never leaves a half-written checkpoint that a resume would pick
up. `directory` may be a local path, a file:// URL or a gs:// / s3:// URL
(through etils.epath; see vcpo_jax.fs.orbax_directory).

The pytree is stored as a flat list of leaves; restoring needs a template of
the same structure (built by the trainer from the config), which also checks
that a resumed run has the architecture and optimizer it was saved with. The
template may be abstract (jax.ShapeDtypeStruct with a sharding): each array is
read shard by shard into its target sharding, never whole on the host first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as cm

from vcpo_jax import fs
from vcpo_jax.schema import check_field


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """When checkpoints are written and which are kept (config.checkpoint)."""

  every: int = 50  # save every this many steps (and at the end / on SIGTERM)
  keep_last: int = 2  # newest checkpoints kept (plus keep_best)
  keep_best: int = 1  # ranked by the eval mean@n of their own step (checkpoint.best_steps)

  def __post_init__(self):
    check_field(self.every >= 1, "checkpoint.every", self.every, "must be >= 1 (steps between saves).")
    check_field(
      self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "must be >= 1 (resuming needs the newest)."
    )
    check_field(self.keep_best >= 0, "checkpoint.keep_best", self.keep_best, "must be >= 0 (0 = keep no best).")


BEST_METRIC = "eval/accuracy"  # what "best" ranks: the eval mean@n of the checkpoint's own step


def best_steps(scores: Mapping[int, float], n: int = 1, mode: str = "max") -> list[int]:
  """The `n` best steps of {step: score}, best first: the highest score (mode "max") or the lowest ("min"),
  the earliest step on ties; a non-finite score never ranks. The one notion of "best" (see the module doc)."""
  sign = -1.0 if mode == "max" else 1.0
  finite = [s for s, v in scores.items() if v is not None and math.isfinite(float(v))]
  return sorted(finite, key=lambda s: (sign * float(scores[s]), s))[:n]


def _scores(metric: str, infos) -> dict[int, float]:
  """{step: metric} of the (step, metrics) pairs whose metrics hold `metric`."""
  return {step: float(m[metric]) for step, m in infos if m and metric in m}


@dataclasses.dataclass
class _KeepBest:
  """Orbax preservation policy: the `n` checkpoints of `best_steps` (the others are left to LatestN).

  ranking: {step: metrics} of every checkpoint (the Checkpointer's, read back from each checkpoint's JSON on
  open): orbax keeps the metrics passed to save() in memory only, so after a resume it ranks nothing."""

  metric: str
  n: int
  mode: str
  ranking: dict

  def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
    del context
    infos = ((c.step, c.metrics or self.ranking.get(c.step)) for c in checkpoints)
    keep = set(best_steps(_scores(self.metric, infos), self.n, self.mode))
    return [c.step in keep for c in checkpoints]


def _to_saveable(x):
  """A leaf as orbax gets it: host arrays as numpy; sharded jax.Arrays as they are (each process writes its
  shards); fully replicated ones copied to the host once. Orbax would split a replicated array among its
  replicas (replica-parallel save) with one small slicing program per shape, compiled at the first save,
  i.e. in the middle of the run; one device-to-host copy of it costs no compile."""
  if not isinstance(x, jax.Array):
    return np.asarray(x)
  if x.is_fully_replicated and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
    return np.asarray(x)
  return x


def restore_target(x):
  """A leaf as a restore target: jax.Arrays (and ShapeDtypeStructs) by shape, dtype and sharding, so orbax
  reads each device's shards of the saved array straight into place (born sharded: no host copy of the
  whole array, whatever sharding it was saved with); any other leaf as a host numpy array."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return np.asarray(x)


class Checkpointer:
  """Thin wrapper over `ocp.CheckpointManager` for (state pytree, JSON meta)."""

  def __init__(
    self,
    directory: str,
    *,
    keep_last: int = 2,
    keep_best: int = 1,
    best_metric: str | None = None,
    best_mode: str = "max",
    async_save: bool = True,
  ):
    if keep_last < 1:
      raise ValueError(f"checkpoint.keep_last must be >= 1, got {keep_last}.")
    if best_mode not in ("max", "min"):
      raise ValueError(f"checkpoint.best_mode must be 'max' or 'min', got {best_mode!r}.")
    self.best_metric, self.best_mode = best_metric, best_mode
    self._ranking: dict[int, dict | None] = {}  # step -> the metrics it was saved with (ranking), see _KeepBest
    policies = [cm.LatestN(n=keep_last)]
    if best_metric and keep_best > 0:
      policies.append(_KeepBest(best_metric, keep_best, best_mode, self._ranking))
    options = ocp.CheckpointManagerOptions(
      preservation_policy=cm.AnyPreservationPolicy(policies), enable_async_checkpointing=async_save, create=True
    )
    # A local path or an etils path for gs:// etc. (orbax writes through etils + tensorstore).
    self.directory = fs.orbax_directory(directory)
    self._mngr = ocp.CheckpointManager(self.directory, options=options)
    if best_metric and keep_best > 0:  # a resume: retention ranks the checkpoints saved before it too
      for step in self.all_steps():
        self.metrics(step)

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mngr.all_steps())

  def best_step(self) -> int | None:
    """The kept checkpoint that `best_steps` ranks first by the metric saved with it (best_metric, else
    BEST_METRIC), or None when no kept checkpoint carries it (e.g. the run never evaluated at a saved step)."""
    metric = self.best_metric or BEST_METRIC
    best = best_steps(_scores(metric, ((s, self.metrics(s)) for s in self.all_steps())), 1, self.best_mode)
    return best[0] if best else None

  def metrics(self, step: int) -> dict | None:
    """The ranking metrics saved with the checkpoint at `step` (None: saved without them; a checkpoint from
    before they were saved has its run's final evaluation, if it is the final one)."""
    if step not in self._ranking and step in self.all_steps():
      saved = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
      self._ranking[step] = saved.get("_ranking") or saved.get("final_eval")
    return self._ranking.get(step)

  def restore_leaves(self, step: int) -> list:
    """The flat list of arrays saved at `step`, as saved (no template: host numpy / default-device arrays)."""
    out = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    return list(out["state"])

  def save(self, step: int, state: Any, meta: dict, metrics: dict | None = None, force: bool = False) -> bool:
    leaves = [_to_saveable(x) for x in jax.tree.leaves(state)]
    if self.best_metric and metrics is not None and self.best_metric not in metrics:
      metrics = None  # only steps with the ranking metric compete for "best"
    metrics = None if metrics is None else {k: float(v) for k, v in metrics.items()}
    self._ranking[step] = metrics
    meta = dict(meta, _shapes=[list(np.shape(x)) for x in leaves], _ranking=metrics)
    return self._mngr.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(leaves), meta=ocp.args.JsonSave(meta)),
      metrics=metrics,
      force=force,
    )

  def restore_meta(self, step: int) -> dict:
    """The JSON dict saved at `step` (e.g. to size the restore template)."""
    meta = dict(self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    meta.pop("_shapes", None)
    meta.pop("_ranking", None)
    return meta

  def restore(self, step: int, template: Any) -> tuple[Any, dict]:
    """Restores into the structure of `template`; its jax.Array / ShapeDtypeStruct leaves give each restored
    array's sharding (`restore_target`: read shard by shard into it), other leaves come back as numpy."""
    leaves, treedef = jax.tree.flatten(template)
    abstract = [restore_target(x) for x in leaves]
    meta = dict(self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    meta.pop("_ranking", None)
    shapes = [tuple(s) for s in meta.pop("_shapes")]
    if len(shapes) != len(leaves):
      raise ValueError(
        f"Checkpoint at step {step} in {self.directory} holds {len(shapes)} arrays but the "
        f"current configuration expects {len(leaves)}: the config changed since it was saved."
      )
    for i, (a, b) in enumerate(zip(shapes, abstract)):
      if a != tuple(b.shape):
        raise ValueError(
          f"Checkpoint array #{i} has shape {a}, the current configuration expects "
          f"{tuple(b.shape)}: the model or optimizer config changed since the checkpoint was saved."
        )
    out = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    return jax.tree.unflatten(treedef, list(out["state"])), meta

  def wait(self):
    self._mngr.wait_until_finished()

  def close(self):
    self._mngr.wait_until_finished()
    self._mngr.close()
