"""The contract between the trainer's loop and a rollout source: every member the loop uses, with no-op defaults.

sync / lag / async sources subclass `RolloutSource`; `vcpo_jax.rollout.source.build_source` picks one by mode.
"""

from __future__ import annotations

from vcpo_jax.batch import Batch


class SourceFailed(RuntimeError):
  """The source cannot go on (e.g. async: the sampler process failed past async_.max_sampler_restarts).

  The trainer checkpoints the last completed step and re-raises (exit code 1)."""


class RolloutSource:
  """Every member the trainer uses of a source (LagSource, AsyncSource); no-op defaults.

  A subclass implements next / publish and overrides what its mode has: kept versions (lag), queued batches
  and the host copy's time (async), background evaluation (async, one host), a per-step agreement of hosts.
  """

  agreed_stops: bool = False  # True: next() agrees on a stop (signal, failure) with every host itself

  def next(self, step: int) -> tuple[Batch, dict]:
    """The batch of learner step `step` and its info row."""
    raise NotImplementedError

  def publish(self, params, version: int) -> None:
    """Makes the parameters after `version` updates available to later batches."""
    raise NotImplementedError

  def state(self) -> tuple[list[int], list]:
    """(kept versions, their params): checkpointed with the step. None kept by default."""
    return [], []

  def load_state(self, versions: list[int], params_list: list) -> None:
    """Restores state()'s versions; a source that keeps none refuses a checkpoint that has some."""
    if versions:
      raise ValueError(
        f"{type(self).__name__}: the checkpoint holds kept parameter versions {list(versions)} (lag mode); "
        "resume it with mode='lag', or start this run in a fresh workdir."
      )

  def take_copy_s(self) -> float | None:
    """time/publish_copy_s: seconds of the newest host copy of parameters since the last call (None: none)."""
    return None

  def queued_state(self) -> tuple[list[dict], list[dict]]:
    """(arrays, metas) of batches received and not consumed, for a checkpoint. None by default."""
    return [], []

  def queued_template(self, count: int) -> list[dict]:
    """Restore template of `count` queued batches."""
    if count:
      raise ValueError(
        f"the checkpoint holds {count} queued async batches; resume it with mode='async', or start this "
        "run in a fresh workdir."
      )
    return []

  def load_queued(self, arrays: list[dict], metas: list[dict]) -> None:
    """Restores queued_state()'s batches."""
    self.queued_template(len(metas))

  def enable_background_eval(self, eval_args) -> None:
    """eval.background: evaluate requested versions in the sampler process (async mode, one host)."""
    raise ValueError(
      f"eval.background=True needs mode='async' with its sampler process ({type(self).__name__} has none); "
      "set it False."
    )

  def request_eval(self, version: int, params) -> None:
    raise RuntimeError(f"{type(self).__name__}: request_eval() needs enable_background_eval().")

  def eval_results(self, wait: bool = False) -> list[dict]:
    """Background evaluation records that arrived since the last call; none by default."""
    return []

  def close(self) -> None:
    """Releases what the source holds (processes, shared memory, kept versions). Idempotent."""
