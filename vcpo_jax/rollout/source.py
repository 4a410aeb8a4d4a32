"""Rollout sources: what the trainer's loop asks for a batch, and the one place that picks one by mode.

The loop is the same for every mode (trainer.run):

    batch, info = source.next(step)      # sync / lag: sampled here; async: from the sampler's queue
    ...                                  # the update
    source.publish(params, step + 1)     # lag: kept in a ring of k + 1 versions; async: into the slot

`build_maker` makes the per-step rollout maker (single-turn, or tool-use episodes), `build_source` wraps
it in the mode's source. Imports of the sources are local: `vcpo_jax.rollout` stays cheap to import and
the async source's process machinery loads only for mode='async'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from vcpo_jax import tasks
from vcpo_jax.batch import Batch
from vcpo_jax.rollout.common import RolloutConfig, RolloutMaker
from vcpo_jax.sampler import Sampler, SamplerConfig

MODES = ("sync", "lag", "async")


class SourceFailed(RuntimeError):
  """The source cannot go on (e.g. async: the sampler process failed past async_.max_sampler_restarts).

  The trainer checkpoints the last completed step and re-raises (exit code 1)."""


class RolloutSource:
  """Every member the trainer uses of a source (LagSource, AsyncSource and its subclasses); no-op defaults.

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


def build_maker(
  rollout: RolloutConfig,
  multiturn,
  tokenizer,
  make_sampler: Callable[[SamplerConfig], Sampler],
  sampler_cfg: SamplerConfig,
  problems: Sequence[tasks.Problem],
) -> RolloutMaker:
  """The rollout maker of `problems`: single-turn (multiturn None) or tool-use episodes.

  Args:
    rollout: the task's batch shape (P, G, budgets). multiturn: a MultiTurnConfig or None.
    make_sampler: builds a Sampler from a SamplerConfig (the caller's model, mesh).
    sampler_cfg: the training sampler's settings; tool-use episodes add their multi-turn buckets.
  """
  if multiturn is None:
    return RolloutMaker(rollout, tokenizer, make_sampler(sampler_cfg), problems)
  from vcpo_jax.rollout import multiturn as mt_lib  # contexts grow each turn: multi-turn buckets

  sampler = make_sampler(mt_lib.sampler_config(sampler_cfg, rollout, multiturn))
  return mt_lib.MultiTurnRolloutMaker(rollout, multiturn, tokenizer, sampler, problems)


def build_source(
  mode: str,
  maker: RolloutMaker,
  key: jax.Array,
  *,
  k: int = 0,
  async_cfg=None,
  steps: int = 0,
  model_cfg=None,
  graphdef=None,
  tokenizer=None,
  workdir: str | None = None,
  interrupt: Callable[[], None] | None = None,
) -> RolloutSource:
  """The rollout source of `mode`.

  Args:
    mode: "sync" (LagSource with k = 0), "lag" (LagSource with staleness `k`) or "async" (a sampler
      process; one per host on multi-host jobs).
    maker: the rollout maker (build_maker); key: the run's key (step t samples with fold_in(key, t)).
    k: the staleness of mode='lag' and mode='async' (ignored for sync).
    async_cfg, steps, model_cfg, graphdef, tokenizer, workdir, interrupt: mode='async' only. The async
      source gets its own config (run_spec.AsyncConfig, config.async_) and the run's length `steps`; the
      sampler process rebuilds the model from model_cfg; `interrupt` is polled in every wait (raises to stop).
  """
  if mode not in MODES:
    raise ValueError(f"config.mode={mode!r}: choose one of {MODES}.")
  if mode in ("sync", "lag"):
    from vcpo_jax.rollout.lag import LagSource

    return LagSource(maker, k if mode == "lag" else 0, key)
  if async_cfg.publish_path == "device":  # a sampler thread on its own devices (rollout/device_publish.py)
    from vcpo_jax.rollout.device_publish import DeviceAsyncSource as source_cls
  elif async_cfg.publish_path == "transfer":  # a sampler process pulling from this one's devices
    from vcpo_jax.rollout.transfer_publish import TransferAsyncSource as source_cls
  elif jax.process_count() > 1:  # one sampler per host, a per-step agreement (rollout/multihost.py)
    from vcpo_jax.rollout.multihost import MultiHostAsyncSource as source_cls
  else:
    from vcpo_jax.rollout.async_ import AsyncSource as source_cls
  return source_cls(
    async_cfg, key, model_cfg, graphdef, tokenizer, maker, k=k, steps=steps, workdir=workdir, interrupt=interrupt
  )
