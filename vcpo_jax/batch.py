"""The Batch: what every rollout source hands the learner, defined once.

N = P * G rows (rows of a group are contiguous), T = prompt bucket + response
budget columns; shapes are fixed per run, so the jitted step compiles once.

  field           shape   dtype    meaning
  tokens          [N, T]  int32    left-padded prompt, then right-padded response (pad id elsewhere)
  valid_mask      [N, T]  bool     real tokens (prompt or response, tool tokens included): attention + positions
  loss_mask       [N, T]  bool     tokens the policy loss and the importance ratios use (model tokens only)
  behavior_logp   [N, T]  float32  log mu(token) recorded by the sampler (0 off loss_mask)
  rewards         [N]     float32  task reward in [0, 1]
  correct         [N]     float32  1.0 where the reward counts as correct (tasks.is_correct)
  group_id        [N]     int32    prompt index in the batch (advantages compare within a group)
  policy_version  [N]     int32    parameter version that sampled the row's OLDEST token (the lag bound applies to it)
  token_version   [N, T]  int32    parameter version that sampled each response token (-1 elsewhere; in-flight updates)

and, only in runs with top-k score centering (vcpo.score_centering='topk', K = vcpo.sc_topk; None otherwise):

  topk_ids        [N, T, K] int32   the K most likely ids of the distribution token t was drawn from (0 elsewhere)
  topk_logp       [N, T, K] float32 their post-filter log-probs (temperature, top-k / top-p applied)

and, only in runs whose sampler records MoE routing (sampler.record_routing; R = L K, MoE layers x experts per
token; None otherwise):

  expert_ids      [N, T, R] int16   the experts token t went through in each MoE layer when the sampler fed it,
                                    layer-major (K per layer); -1 where nothing was recorded (prompt columns,
                                    the last response token, padding). The learner replays them
                                    (model.routing_replay).

Every consumer derives its key set from here: the learner's device input
(`DEVICE_KEYS`, `Batch.device()`), the estimator's required keys (`PG_KEYS`)
and the async queue's schema (`schema(n, t)`). Host-side metadata (texts,
problem ids, response lengths, grading failures) travels beside the Batch in
the rollout's `info` dict; it never enters jit.

`Batch` is a registered pytree dataclass (every field a leaf) and reads like a
mapping (`batch["rewards"]`, `dict(batch)`), so host code and the queue treat
it as the dict of arrays it replaces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

# name -> (dtype, dimensions): "NT" for [N, T], "N" for [N], "NTK" for [N, T, K].
FIELDS: dict[str, tuple[Any, str]] = {
  "tokens": (np.int32, "NT"),
  "valid_mask": (np.bool_, "NT"),
  "loss_mask": (np.bool_, "NT"),
  "behavior_logp": (np.float32, "NT"),
  "rewards": (np.float32, "N"),
  "correct": (np.float32, "N"),
  "group_id": (np.int32, "N"),
  "policy_version": (np.int32, "N"),
  "token_version": (np.int32, "NT"),
}
# Present together or not at all (the sampler's SamplerConfig.record_topk = K > 0).
TOPK_FIELDS: dict[str, tuple[Any, str]] = {"topk_ids": (np.int32, "NTK"), "topk_logp": (np.float32, "NTK")}
# Present or not (the sampler's SamplerConfig.record_routing on an MoE model): the routing record.
ROUTING_FIELDS: dict[str, tuple[Any, str]] = {"expert_ids": (np.int16, "NTR")}
ALL_FIELDS = {**FIELDS, **TOPK_FIELDS, **ROUTING_FIELDS}

# What the jitted learner step consumes (correct stays on the host). policy_version: the version-aware
# policy losses (decoupled PPO's log-linear proximal policy) read it.
DEVICE_KEYS = ("tokens", "valid_mask", "loss_mask", "behavior_logp", "rewards", "group_id", "policy_version")

# What the gradient paths (learner.policy_gradient) read themselves (logp_fn reads the rest).
PG_KEYS = ("tokens", "behavior_logp", "loss_mask", "rewards", "group_id")


def shape(name: str, n: int, t: int, k: int = 0, r: int = 0) -> tuple[int, ...]:
  """The shape of field `name` in a batch of n rows, t columns (k top-k ids, r routing entries per token)."""
  return {"NT": (n, t), "N": (n,), "NTK": (n, t, k), "NTR": (n, t, r)}[ALL_FIELDS[name][1]]


def fields(k: int = 0, r: int = 0) -> dict[str, tuple[Any, str]]:
  """The fields of a batch with k recorded top-k ids and r routing entries per token (0: none)."""
  return {**FIELDS, **(TOPK_FIELDS if k else {}), **(ROUTING_FIELDS if r else {})}


def schema(n: int, t: int, k: int = 0, r: int = 0) -> dict[str, tuple[Any, tuple[int, ...]]]:
  """{field: (dtype, shape)} of a batch of n rows, t columns, k top-k ids and r routing entries (the async queue
  is built from this)."""
  return {name: (dtype, shape(name, n, t, k, r)) for name, (dtype, _) in fields(k, r).items()}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class Batch(Mapping):
  """One rollout batch (fields and shapes: the module docstring). Construct with `Batch.from_arrays`."""

  tokens: Any
  valid_mask: Any
  loss_mask: Any
  behavior_logp: Any
  rewards: Any
  correct: Any
  group_id: Any
  policy_version: Any
  token_version: Any
  topk_ids: Any = None
  topk_logp: Any = None
  expert_ids: Any = None

  @classmethod
  def from_arrays(cls, arrays: Mapping[str, Any]) -> Batch:
    """A Batch from a mapping holding exactly FIELDS (and both or neither of TOPK_FIELDS), each cast to its dtype
    and checked against [N] / [N, T] / [N, T, K]."""
    names = fields(k=int("topk_ids" in arrays or "topk_logp" in arrays), r=int("expert_ids" in arrays))
    missing, extra = sorted(set(names) - set(arrays)), sorted(set(arrays) - set(names))
    if missing or extra:
      raise ValueError(
        f"Batch: missing fields {missing}, unknown fields {extra}; a Batch holds {list(FIELDS)} "
        f"(and, with top-k centering, both of {list(TOPK_FIELDS)})."
      )
    out = {k: np.asarray(arrays[k], names[k][0]) for k in names}
    n, t = out["tokens"].shape if out["tokens"].ndim == 2 else (None, None)
    k_top = out["topk_ids"].shape[-1] if "topk_ids" in out and out["topk_ids"].ndim == 3 else 0
    r = out["expert_ids"].shape[-1] if "expert_ids" in out and out["expert_ids"].ndim == 3 else 0
    for k, a in out.items():
      empty = (names[k][1] == "NTK" and not k_top) or (names[k][1] == "NTR" and not r)
      if n is None or a.shape != shape(k, n, t, k_top, r) or empty:
        want = {"NT": "[N, T]", "N": "[N]", "NTK": "[N, T, K >= 1]", "NTR": "[N, T, R >= 1]"}[names[k][1]]
        raise ValueError(f"Batch.{k}: shape {a.shape}, want {want} with N, T = tokens.shape {out['tokens'].shape}.")
    return cls(**out)

  @property
  def n(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def t(self) -> int:
    return int(self.tokens.shape[1])

  @property
  def topk(self) -> int:
    """K, the top-k ids recorded per token (0: none)."""
    return 0 if self.topk_ids is None else int(self.topk_ids.shape[-1])

  @property
  def routing(self) -> int:
    """R, the routing entries recorded per token (MoE layers x experts per token; 0: none)."""
    return 0 if self.expert_ids is None else int(self.expert_ids.shape[-1])

  def device(self) -> dict[str, Any]:
    """The learner step's input: the DEVICE_KEYS arrays (and the top-k and routing records), as a dict (the
    jitted step's pytree)."""
    extra = (tuple(TOPK_FIELDS) if self.topk else ()) + (tuple(ROUTING_FIELDS) if self.routing else ())
    return {k: getattr(self, k) for k in DEVICE_KEYS + extra}

  # Mapping access: batch["rewards"], dict(batch), batch.items() (host code, the queue, checkpoints).
  def __getitem__(self, key: str):
    if key not in fields(self.topk, self.routing):
      raise KeyError(key)
    return getattr(self, key)

  def __iter__(self) -> Iterator[str]:
    return iter(fields(self.topk, self.routing))

  def __len__(self) -> int:
    return len(fields(self.topk, self.routing))
