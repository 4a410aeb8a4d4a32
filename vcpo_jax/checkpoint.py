"""Atomic, resumable checkpoints with Orbax: keep the last N plus the best.

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
  keep_best: int = 1  # ranked by eval accuracy

  def __post_init__(self):
    check_field(self.every >= 1, "checkpoint.every", self.every, "must be >= 1 (steps between saves).")
    check_field(
      self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "must be >= 1 (resuming needs the newest)."
    )
    check_field(self.keep_best >= 0, "checkpoint.keep_best", self.keep_best, "must be >= 0 (0 = keep no best).")


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
    self.best_metric = best_metric
    policies = [cm.LatestN(n=keep_last)]
    if best_metric and keep_best > 0:
      sign = 1.0 if best_mode == "max" else -1.0  # BestN(reverse=False) keeps the largest
      policies.append(
        cm.BestN(
          get_metric_fn=lambda m: sign * float(m[best_metric]),
          reverse=False,
          n=keep_best,
          keep_checkpoints_without_metrics=False,
        )
      )
    options = ocp.CheckpointManagerOptions(
      preservation_policy=cm.AnyPreservationPolicy(policies), enable_async_checkpointing=async_save, create=True
    )
    # A local path or an etils path for gs:// etc. (orbax writes through etils + tensorstore).
    self.directory = fs.orbax_directory(directory)
    self._mngr = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mngr.all_steps())

  def restore_leaves(self, step: int) -> list:
    """The flat list of arrays saved at `step`, as saved (no template: host numpy / default-device arrays)."""
    out = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    return list(out["state"])

  def save(self, step: int, state: Any, meta: dict, metrics: dict | None = None, force: bool = False) -> bool:
    leaves = [_to_saveable(x) for x in jax.tree.leaves(state)]
    if self.best_metric and metrics is not None and self.best_metric not in metrics:
      metrics = None  # only steps with the ranking metric compete for "best"
    meta = dict(meta, _shapes=[list(np.shape(x)) for x in leaves])
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
    return meta

  def restore(self, step: int, template: Any) -> tuple[Any, dict]:
    """Restores into the structure of `template`; its jax.Array / ShapeDtypeStruct leaves give each restored
    array's sharding (`restore_target`: read shard by shard into it), other leaves come back as numpy."""
    leaves, treedef = jax.tree.flatten(template)
    abstract = [restore_target(x) for x in leaves]
    meta = dict(self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
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
