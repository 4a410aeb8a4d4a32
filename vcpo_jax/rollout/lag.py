"""Sync and exact-lag rollout sources (one process, reproducible).

`LagSource(k)` makes the batch for learner step t with the parameters of step
max(0, t - k): exactly k steps stale once t >= k. `k = 0` is the synchronous
mode (sample with the current policy, then learn). Both keep their sampling RNG
as fold_in(key, step), so a run is a deterministic function of its config.

Memory: the source keeps the k + 1 most recent parameter versions (device
copies, since the learner donates its own buffers), i.e. (k + 1) x the parameter
bytes. `k = 0` keeps no copy: the batch of step t is sampled from the current
parameters before the update that donates them. For k = 128 and a 1.5B-parameter fp32 model that is ~770 GB, which is
why large-k stability studies use small models; `async` mode needs no copies.

With LoRA adapters (model.lora_rank > 0) the ring keeps (k + 1) ADAPTER versions and one copy of the
frozen base (taken at the first publish; the base never changes), and a version is the base with its
adapters (`lora.combine`) when it samples: (k + 1) x the adapter bytes + 1 x the base. Its checkpointed
state is the adapter versions only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from vcpo_jax.batch import Batch
from vcpo_jax.model import lora
from vcpo_jax.rollout.base import RolloutSource
from vcpo_jax.rollout.common import RolloutMaker, lag_stats


class LagSource(RolloutSource):
  def __init__(self, maker: RolloutMaker, k: int, key: jax.Array):
    if k < 0:
      raise ValueError(f"lag.k={k} must be >= 0.")
    self.maker, self.k, self.key = maker, int(k), key
    self.versions: dict[int, object] = {}  # version -> params (device copies); with LoRA, the adapters only
    self.base = None  # with LoRA: the frozen base (one copy for every version)

  def publish(self, params, version: int):
    """Registers the parameters after `version` updates; drops versions no longer needed."""
    # k > 0 samples with these parameters after later updates have donated (freed) the learner's
    # buffers, so it needs a copy; k = 0 samples before the next update and can hold a reference.
    params, frozen = lora.split(params)
    if frozen is not None and self.base is None:
      self.base = jax.tree.map(jnp.copy, frozen) if self.k else frozen
    elif frozen is not None and not self.k:
      self.base = frozen  # k = 0 holds a reference: the current base (the update donates the previous one)
    self.versions[int(version)] = jax.tree.map(jnp.copy, params) if self.k else params
    oldest_needed = int(version) - self.k  # the next step (= version) samples with version - k
    for v in [v for v in self.versions if v < oldest_needed]:
      del self.versions[v]

  def next(self, step: int) -> tuple[Batch, dict]:
    version = max(0, step - self.k)
    if version not in self.versions:
      raise RuntimeError(
        f"lag source: parameters of version {version} needed at step {step} were not "
        f"published (have {sorted(self.versions)})."
      )
    params = lora.combine(self.versions[version], self.base)
    batch, info = self.maker.make(params, step, jax.random.fold_in(self.key, step), version)
    info.update(lag_stats(step, batch["policy_version"]))
    return batch, info

  def behavior_params(self, step: int):
    """The parameters that sampled step's batch (version max(0, step - k)), for exact score centering."""
    return self.versions[max(0, int(step) - self.k)]

  # -- checkpointing: the kept versions are part of the training state

  def state(self) -> tuple[list[int], list]:
    """(versions, params) to checkpoint: all kept versions but the newest, which is the learner's own
    parameters (saved with the train state and re-published on resume), so k = 0 saves none. With LoRA the
    params are the adapters (the base is the train state's, restored with it)."""
    vs = sorted(self.versions)[:-1]
    return vs, [self.versions[v] for v in vs]

  def load_state(self, versions: list[int], params_list: list):
    self.versions = {int(v): p for v, p in zip(versions, params_list)}

  def close(self):
    self.versions.clear()
    self.base = None
