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

and per-token records of the sampler over the response columns only (R = the response budget; response
column r is token column T - R + r, since prompts are left-padded to the prompt bucket T - R):

  only in runs with top-k score centering (method.loss.score_centering='topk', K = method.loss.sc_topk; None otherwise):
  topk_ids        [N, R, K] int32   the K most likely ids of the distribution token r was drawn from (0 elsewhere)
  topk_logp       [N, R, K] float32 their post-filter log-probs (temperature, top-k / top-p applied)
  only in runs that replay the sampler's top-k / top-p support (vcpo_jax/model/support.py; None otherwise):
  support_thr     [N, R]    float32 the kept support's cut-off: the learner keeps {v : logit_v >= thr} (-inf: all)
  only in runs whose sampler records MoE routing (sampler.record_routing; E = L K, MoE layers x experts per token):
  expert_ids      [N, R, E] int16   the experts response token r went through in each MoE layer when the sampler
                                    fed it, layer-major (K per layer); -1 where nothing was recorded (the last
                                    response token, padding). The learner replays them (model.routing_replay).

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

# name -> (dtype, dimensions): "NT" for [N, T], "N" for [N], "NRK" for [N, R, K], "NR" for [N, R].
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
TOPK_FIELDS: dict[str, tuple[Any, str]] = {"topk_ids": (np.int32, "NRK"), "topk_logp": (np.float32, "NRK")}
# Present when the sampler records its kept support (SamplerConfig.record_support).
SUPPORT_FIELDS: dict[str, tuple[Any, str]] = {"support_thr": (np.float32, "NR")}
# Present when the sampler records MoE routing (SamplerConfig.record_routing on an MoE model).
ROUTING_FIELDS: dict[str, tuple[Any, str]] = {"expert_ids": (np.int16, "NRE")}
ALL_FIELDS = {**FIELDS, **TOPK_FIELDS, **SUPPORT_FIELDS, **ROUTING_FIELDS}
_WANT = {"NT": "[N, T]", "N": "[N]", "NRK": "[N, R, K >= 1]", "NR": "[N, R]", "NRE": "[N, R, E >= 1]"}
_RECORDS = ("NRK", "NR", "NRE")  # the response-column layouts

# What the jitted learner step consumes (correct stays on the host). policy_version: the version-aware
# policy losses (decoupled PPO's log-linear proximal policy) read it.
DEVICE_KEYS = ("tokens", "valid_mask", "loss_mask", "behavior_logp", "rewards", "group_id", "policy_version")

# What the gradient paths (learner.policy_gradient) read themselves (logp_fn reads the rest).
PG_KEYS = ("tokens", "behavior_logp", "loss_mask", "rewards", "group_id")


def shape(name: str, n: int, t: int, k: int = 0, r: int = 0, e: int = 0) -> tuple[int, ...]:
  """The shape of field `name` in a batch of n rows, t columns (r of them response columns, k top-k ids and e
  routing entries per token)."""
  return {"NT": (n, t), "N": (n,), "NRK": (n, r, k), "NR": (n, r), "NRE": (n, r, e)}[ALL_FIELDS[name][1]]


def fields(k: int = 0, support: bool = False, e: int = 0) -> dict[str, tuple[Any, str]]:
  """The fields of a batch with k recorded top-k ids per token (k = 0: none), with support the record of the
  sampler's kept support, and e routing entries per token (e = 0: none)."""
  return {
    **FIELDS,
    **(TOPK_FIELDS if k else {}),
    **(SUPPORT_FIELDS if support else {}),
    **(ROUTING_FIELDS if e else {}),
  }


def schema(
  n: int, t: int, k: int = 0, r: int = 0, support: bool = False, e: int = 0
) -> dict[str, tuple[Any, tuple[int, ...]]]:
  """{field: (dtype, shape)} of a batch of n rows, t columns, r response columns, k top-k ids, (support) the
  support record and e routing entries per token (the async queue is built from this). r is needed only with a
  record (k > 0, support or e > 0)."""
  if (k or support or e) and not 0 < r < t:
    raise ValueError(f"batch schema: r={r} response columns must be in [1, t - 1 = {t - 1}] with a per-token record.")
  return {name: (dtype, shape(name, n, t, k, r, e)) for name, (dtype, _) in fields(k, support, e).items()}


def nbytes(schema_: Mapping[str, tuple[Any, tuple[int, ...]]], names=None) -> int:
  """Bytes of the fields `names` (default: all) of a `schema(...)`."""
  names = schema_ if names is None else names
  return sum(int(np.prod(schema_[f][1])) * np.dtype(schema_[f][0]).itemsize for f in names)


def at_token_columns(record_nr, t: int, fill=0):
  """A response-column record [N, R, ...] placed on the token columns [N, T, ...] (the last R; `fill` before
  them): for consumers that index by token column. jnp or np, as given."""
  xp = np if isinstance(record_nr, np.ndarray) else jax.numpy
  pad = ((0, 0), (t - record_nr.shape[1], 0)) + ((0, 0),) * (record_nr.ndim - 2)
  return xp.pad(record_nr, pad, constant_values=fill)


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
  support_thr: Any = None
  expert_ids: Any = None

  @classmethod
  def from_arrays(cls, arrays: Mapping[str, Any]) -> Batch:
    """A Batch from a mapping holding exactly FIELDS (and both or neither of TOPK_FIELDS, and optionally
    SUPPORT_FIELDS), each cast to its dtype and checked against [N] / [N, T] / [N, R, K] / [N, R] (R <= T, one R
    for every record; a prompt has a token, so R < T)."""
    names = fields(
      k=int("topk_ids" in arrays or "topk_logp" in arrays),
      support="support_thr" in arrays,
      e=int("expert_ids" in arrays),
    )
    missing, extra = sorted(set(names) - set(arrays)), sorted(set(arrays) - set(names))
    if missing or extra:
      raise ValueError(
        f"Batch: missing fields {missing}, unknown fields {extra}; a Batch holds {list(FIELDS)} "
        f"(and, with top-k centering, both of {list(TOPK_FIELDS)}; with support replay {list(SUPPORT_FIELDS)}; "
        f"with routing replay {list(ROUTING_FIELDS)})."
      )
    out = {k: np.asarray(arrays[k], names[k][0]) for k in names}
    n, t = out["tokens"].shape if out["tokens"].ndim == 2 else (None, None)
    k_top = out["topk_ids"].shape[-1] if "topk_ids" in out and out["topk_ids"].ndim == 3 else 0
    e = out["expert_ids"].shape[-1] if "expert_ids" in out and out["expert_ids"].ndim == 3 else 0
    rec = [out[k] for k in names if names[k][1] in _RECORDS and out[k].ndim >= 2]
    r = rec[0].shape[1] if rec else 0
    for k, a in out.items():
      empty = (names[k][1] == "NRK" and not k_top) or (names[k][1] == "NRE" and not e)
      if n is None or a.shape != shape(k, n, t, k_top, r, e) or empty or r >= t:
        raise ValueError(
          f"Batch.{k}: shape {a.shape}, want {_WANT[names[k][1]]} with N, T = tokens.shape {out['tokens'].shape}"
          " (R < T, the same for every record)."
        )
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
  def support(self) -> bool:
    """Whether the batch carries the sampler's kept support (support_thr)."""
    return self.support_thr is not None

  @property
  def routing(self) -> int:
    """E, the routing entries recorded per token (MoE layers x experts per token; 0: none)."""
    return 0 if self.expert_ids is None else int(self.expert_ids.shape[-1])

  @property
  def r(self) -> int:
    """R, the response columns the per-token records cover (0: no record)."""
    rec = next((x for x in (self.topk_ids, self.support_thr, self.expert_ids) if x is not None), None)
    return 0 if rec is None else int(rec.shape[1])

  def _fields(self) -> dict[str, tuple[Any, str]]:
    return fields(self.topk, self.support, self.routing)

  def device(self) -> dict[str, Any]:
    """The learner step's input: the DEVICE_KEYS arrays (and the records it carries), as a dict (the jitted
    step's pytree)."""
    records = (tuple(TOPK_FIELDS) if self.topk else ()) + (tuple(SUPPORT_FIELDS) if self.support else ())
    records += tuple(ROUTING_FIELDS) if self.routing else ()
    return {k: getattr(self, k) for k in DEVICE_KEYS + records}

  # Mapping access: batch["rewards"], dict(batch), batch.items() (host code, the queue, checkpoints).
  def __getitem__(self, key: str):
    if key not in self._fields():
      raise KeyError(key)
    return getattr(self, key)

  def __iter__(self) -> Iterator[str]:
    return iter(self._fields())

  def __len__(self) -> int:
    return len(self._fields())
