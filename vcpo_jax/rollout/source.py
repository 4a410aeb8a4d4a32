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
from vcpo_jax.rollout.base import RolloutSource, SourceFailed  # noqa: F401 (re-exported)
from vcpo_jax.rollout.common import RolloutConfig, RolloutMaker
from vcpo_jax.sampler import Sampler, SamplerConfig

MODES = ("sync", "lag", "async")


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
      source gets its own config (AsyncConfig, config.async_) and the run's length `steps`; the
      sampler process rebuilds the model from model_cfg; `interrupt` is polled in every wait (raises to stop).
  """
  if mode not in MODES:
    raise ValueError(f"config.mode={mode!r}: choose one of {MODES}.")
  if mode in ("sync", "lag"):
    from vcpo_jax.rollout.lag import LagSource

    return LagSource(maker, k if mode == "lag" else 0, key)
  # The publish path (async_.publish_path: shm, device, transfer) and the topology (one host, many: one sampler
  # per host, a per-step agreement) are parts the async source composes (rollout/publish.py, topology.py).
  from vcpo_jax.rollout.async_ import AsyncSource  # the process machinery loads for mode='async' only

  return AsyncSource(
    async_cfg, key, model_cfg, graphdef, tokenizer, maker, k=k, steps=steps, workdir=workdir, interrupt=interrupt
  )
