"""The run's config fingerprint: the config fields that shape the training trajectory.

Every checkpoint stores it (`config_fingerprint` in its JSON meta). A rerun of a workdir compares its
config's fingerprint with the newest checkpoint's before anything is built: a difference is refused
(trainer.run raises ConfigError naming each field with both values) unless the rerun opts in
(`python main.py ... --allow_config_change`, `trainer.run(..., allow_config_change=True)`); then the
workdir's config.json keeps each earlier config with the step range it governed (`config_history`).

What is left out (changing it on resume is allowed):
  - what is logged, plotted, evaluated and checkpointed, and when (log.*, eval.*, checkpoint.*);
  - `steps` (training on to a larger step count) while the learning-rate schedule does not depend on
    it (optim.schedule "constant" or "warmup_constant"; "warmup_cosine" decays over `steps`);
  - execution layout with the same math: model.attention / attention_chunk / remat / scan_layers /
    logprob_chunk / logprob_vocab_chunk (model.config.EXECUTION_FIELDS), mesh.shape, sampler.prefill_chunk /
    max_batch / decode_layers;
  - the job's plumbing: async_ timeouts, CPU pinning and memory shares, the distributed.* job layout (a run
    may resume on another number of hosts), sft.cache_dir.
"""

from __future__ import annotations

import json
from typing import Any

# Dotted paths (a trailing "." covers a whole section) whose change keeps the trajectory.
EXCLUDED = (
  "log.",
  "eval.",
  "checkpoint.",
  "mesh.",
  "model.attention",
  "model.attention_chunk",
  "model.remat",
  "model.scan_layers",
  "model.logprob_chunk",
  "model.logprob_vocab_chunk",
  "model.moe_matmul",
  "sampler.prefill_chunk",
  "sampler.max_batch",
  "sampler.decode_layers",
  "async_.timeout_s",
  "async_.startup_timeout_s",
  "async_.peer_lost_s",
  "async_.max_sampler_restarts",
  "async_.restart_window_s",
  "async_.heartbeat_timeout_s",
  "async_.sampler_cpus",
  "async_.memory_share",
  "distributed.",  # the job's processes (a run resumes on another number of hosts: tests/test_multihost_async)
  "sft.cache_dir",
  "learner.grad_telemetry",  # metrics only
)
# Learning-rate schedules whose values do not depend on `steps` (then `steps` is left out too).
STEPS_FREE_SCHEDULES = ("constant", "warmup_constant")

ALLOW_FLAG = "--allow_config_change"


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = v
  return out


def keeps_trajectory(path: str) -> bool:
  """Whether the dotted config field `path` is one whose change keeps the trajectory (EXCLUDED)."""
  return any(path.startswith(e) if e.endswith(".") else path == e for e in EXCLUDED)


def of(config) -> dict[str, Any]:
  """{dotted path: JSON value} of every trajectory field of `config` (a ConfigDict or its to_dict())."""
  d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  flat = {p: v for p, v in _flat(d).items() if not keeps_trajectory(p)}
  if flat.get("optim.schedule", "constant") in STEPS_FREE_SCHEDULES:
    flat.pop("steps", None)
  return json.loads(json.dumps(flat, default=str))  # tuples -> lists, as the checkpoint's JSON holds them


def differences(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
  """{path: (saved value, current value)} for every trajectory field both hold and that differs.

  A field only one side has (added to or removed from the code since the save) is not compared: its
  value at save time is unknown."""
  return {p: (saved[p], current[p]) for p in sorted(set(saved) & set(current)) if saved[p] != current[p]}


def message(diff: dict[str, tuple[Any, Any]], step: int, workdir: str) -> str:
  """The one-line refusal: each differing field with both values, and the two ways on."""
  fields = ", ".join(f"config.{p}: {old!r} -> {new!r}" for p, (old, new) in diff.items())
  return (
    f"--workdir={workdir!r} holds a checkpoint at step {step} trained with another config ({fields}); "
    f"pass {ALLOW_FLAG} to continue with the new values (config.json keeps each config with its steps), "
    "or choose a new --workdir"
  )
