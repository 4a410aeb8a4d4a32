"""Turning problems and a policy snapshot into the learner's fixed-shape Batch.

Every execution mode (sync, lag, async) produces batches the same way; it only
differs in which parameters it samples with and in which process. The Batch
(vcpo_jax/batch.py: fields, shapes and dtypes are documented there, once) has
N = P * G rows and T = prompt length + response budget columns; `make` returns
it with a host-side info dict (texts, problem ids, response length, grading
failures).

Rewards: each problem is graded by the task object that made it
(`Problem.grader`: the run's one configured task, see tasks.build), so its
options reach the reward; a grader that raises is counted in
info["grading_failures"] instead of vanishing as a 0.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from vcpo_jax import tasks
from vcpo_jax.batch import Batch
from vcpo_jax.model.tokenizer import encode_prompts
from vcpo_jax.sampler import Sampler


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  task: str  # tasks.TASKS name of the run's task (for checks and messages; rewards come from Problem.grader)
  prompts_per_step: int  # P
  group_size: int  # G samples per prompt
  max_prompt_len: int  # prompt bucket (tokens); longer prompts are an error
  max_new_tokens: int  # response budget
  chat_template: bool = False  # wrap prompts with the tokenizer's chat template
  num_train_problems: int = 4096  # generated / loaded training pool size
  seed: int = 0

  def __post_init__(self):
    if self.task not in tasks.TASKS:
      raise ValueError(f"task.name={self.task!r} is unknown; choose one of {sorted(tasks.TASKS)}.")
    for f in ("prompts_per_step", "group_size", "max_prompt_len", "max_new_tokens", "num_train_problems"):
      if getattr(self, f) <= 0:
        raise ValueError(f"{f}={getattr(self, f)} must be positive.")

  @property
  def batch_size(self) -> int:
    return self.prompts_per_step * self.group_size


class RolloutMaker:
  """problems(step) + params -> Batch. Deterministic given (step, params, seed)."""

  def __init__(self, cfg: RolloutConfig, tokenizer, sampler: Sampler, problems: Sequence[tasks.Problem]):
    self.cfg, self.tokenizer, self.sampler = cfg, tokenizer, sampler
    self.problems = list(problems)

  def problems_for_step(self, step: int) -> list[tasks.Problem]:
    """P problems for learner step `step`: a fixed seeded order, so resuming needs only the step."""
    stream = tasks.ProblemStream(self.problems, seed=self.cfg.seed, position=step * self.cfg.prompts_per_step)
    return stream.next(self.cfg.prompts_per_step)

  def make(self, params, step: int, rng: jax.Array, version: int, **generate_kw) -> tuple[Batch, dict]:
    """Samples G responses for each of step's P prompts with `params`; returns (batch, host info).

    generate_kw go to `Sampler.generate` (the async worker's in-flight updates: on_chunk, recompute_kv)."""
    cfg = self.cfg
    problems = self.problems_for_step(step)
    prompt_ids = encode_prompts(self.tokenizer, problems, cfg.chat_template)
    too_long = [len(p) for p in prompt_ids if len(p) > cfg.max_prompt_len]
    if too_long:
      raise ValueError(
        f"A prompt has {max(too_long)} tokens > task.max_prompt_len={cfg.max_prompt_len}; raise task.max_prompt_len."
      )
    ro = self.sampler.generate(
      params,
      prompt_ids,
      rng,
      num_samples=cfg.group_size,
      max_new_tokens=cfg.max_new_tokens,
      version=version,
      **generate_kw,
    )
    return self.to_batch(ro, problems, version)

  def to_batch(self, ro, problems, version: int) -> tuple[Batch, dict]:
    cfg = self.cfg
    n, t_want = cfg.batch_size, cfg.max_prompt_len + cfg.max_new_tokens
    texts = [self.tokenizer.decode(ro.tokens[i][ro.response_mask[i]], skip_special_tokens=True) for i in range(n)]
    # Each problem is graded by the task object that made it (its configured options reach the reward).
    rewards, failures = tasks.score_problems([problems[i // cfg.group_size] for i in range(n)], texts)
    rewards = np.asarray(rewards, np.float32)
    pad = lambda a, v=0: _pad_to(a, t_want, v)
    # Per-token versions (in-flight updates: a row may span several); a row's version is its OLDEST token's.
    tv = ro.token_version if ro.token_version is not None else np.where(ro.response_mask, version, -1)
    tv = np.where(ro.response_mask, tv, -1).astype(np.int32)
    oldest = np.where(ro.response_mask, tv, np.iinfo(np.int32).max).min(axis=1)
    batch = Batch.from_arrays(
      dict(
        tokens=pad(ro.tokens.astype(np.int32), self.sampler.cfg.pad_id),
        valid_mask=pad(ro.prompt_mask | ro.response_mask),
        loss_mask=pad(ro.response_mask),
        behavior_logp=pad(ro.behavior_logp.astype(np.float32)),
        rewards=rewards,
        correct=np.asarray([tasks.is_correct(r) for r in rewards], np.float32),
        group_id=np.asarray(ro.group_id, np.int32),
        policy_version=np.where(ro.lengths > 0, oldest, version).astype(np.int32),
        token_version=pad(tv, -1),
        **record_fields(ro, cfg.max_new_tokens),
      )
    )
    info = dict(
      texts=texts,
      problem_ids=[p.id for p in problems],
      response_len_mean=float(np.mean(ro.lengths)),
      finished_frac=float(np.mean(ro.finished)),
      grading_failures=failures,
    )
    return batch, info


def _pad_to(a: np.ndarray, t: int, value=0) -> np.ndarray:
  """a [N, T', ...] right-padded with `value` to T columns."""
  if a.shape[1] > t:
    raise ValueError(f"rollout has {a.shape[1]} columns > {t}; sampler buckets exceed the batch shape.")
  return np.pad(a, ((0, 0), (0, t - a.shape[1])) + ((0, 0),) * (a.ndim - 2), constant_values=value)


# The sampler's per-token records (sampler.record_fields) the Batch carries, and their value off the response.
_RECORDS = (
  ("topk_ids", np.int32, 0),
  ("topk_logp", np.float32, 0.0),
  ("support_thr", np.float32, -np.inf),
  ("expert_ids", np.int16, -1),  # MoE routing (-1: the learner routes that token itself)
)


def record_fields(ro, r: int) -> dict:
  """The Batch's per-token records over its R = r response columns (batch.TOPK_FIELDS, SUPPORT_FIELDS,
  ROUTING_FIELDS) from the sampler's (Rollout fields [N, Tn, ...], Tn <= R: the last Tn token columns), each at
  its fill off the response; {} without records."""
  out = {}
  for name, dtype, fill in _RECORDS:
    x = getattr(ro, name)
    if x is None:
      continue
    resp = ro.response_mask[:, ro.response_mask.shape[1] - x.shape[1] :]  # [N, Tn]
    on = resp.reshape(resp.shape + (1,) * (x.ndim - 2))
    out[name] = _pad_to(np.where(on, x, fill).astype(dtype), r, fill)
  return out


def lag_stats(step: int, versions: np.ndarray) -> dict:
  """Min / mean / max staleness (learner steps) of a batch consumed at `step`."""
  lag = step - np.asarray(versions)
  return dict(lag_min=int(lag.min()), lag_mean=float(lag.mean()), lag_max=int(lag.max()))


def token_lag_stats(step: int, token_version: np.ndarray) -> dict:
  """Per-token staleness of a batch consumed at `step`: token_version int [N, T] (-1 outside the responses).

  train/token_lag_{min,mean,max} over response tokens; train/multi_version_frac: fraction of rows whose
  tokens come from more than one parameter version (in-flight updates)."""
  tv = np.asarray(token_version)
  resp = tv >= 0
  if not resp.any():
    return {}
  lag = step - tv[resp]
  hi = np.where(resp, tv, -1).max(axis=1)
  lo = np.where(resp, tv, np.iinfo(np.int32).max).min(axis=1)
  rows = resp.any(axis=1)
  return {
    "train/token_lag_min": float(lag.min()),
    "train/token_lag_mean": float(lag.mean()),
    "train/token_lag_max": float(lag.max()),
    "train/multi_version_frac": float(np.mean(hi[rows] > lo[rows])),
  }
