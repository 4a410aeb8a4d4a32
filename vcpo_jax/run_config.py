"""ConfigDict -> RunSpec: the single place where a config crosses into library code.

`parse_config` builds the RunConfig tree from the ConfigDict (schema.from_config_dict: each section's
dataclass checks its own fields, RunConfig the constraints between them), then what the tree names: the
model, the tasks, the evaluation protocol. Every error is
one ConfigError line that names the config field, its value and the fix, e.g.

  config.optim.b1=1.5: Adam's moment decay must be in [0, 1) (usual: 0.9)

Every check runs before anything is built or compiled, including that every training and evaluation prompt
fits task.max_prompt_len (run_spec.check_prompt_lengths: the task's problems are made and tokenized, no
model needed). `check_override_paths` names the closest field for an unknown `--config.PATH`.
"""

from __future__ import annotations

import dataclasses
import os
import re

from vcpo_jax import schema, tasks
from vcpo_jax.evaluation import EvalProtocol
from vcpo_jax.learner import LearnerConfig
from vcpo_jax.model import config as model_config
from vcpo_jax.rollout.common import RolloutConfig
from vcpo_jax.run_spec import RunConfig, RunSpec, check_prompt_lengths
from vcpo_jax.schema import ConfigError, check_field, config_errors

__all__ = ["ConfigError", "RunSpec", "check_override_paths", "field_paths", "parse_config"]


_MODEL_FIELDS = {f.name for f in dataclasses.fields(model_config.ModelConfig)}


def _model_config(m, need_pos: int) -> model_config.ModelConfig:
  fix = f"choose one of {sorted(model_config.PRESETS)}."
  check_field(m.preset in model_config.PRESETS, "model.preset", m.preset, fix)
  with config_errors("model", model_config.ModelConfig):
    base = model_config.PRESETS[m.preset](dtype=m.dtype)
  # Every model.* field ModelConfig has overrides the preset (the sizes only where set); dtype etc. apply to
  # checkpoints too (how the model is computed).
  overrides = {f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.name in _MODEL_FIELDS}
  for f in ("hidden_size", "num_layers", "intermediate_size"):
    if overrides[f] is None:
      del overrides[f]
    else:
      check_field(overrides[f] >= 1, f"model.{f}", overrides[f], "must be >= 1 (or None for the preset's value).")
  h = overrides.get("hidden_size")
  if h is not None and not m.checkpoint:  # Qwen2 / Llama: width = heads x head_dim: it splits over the heads
    n = base.num_heads
    fix = f"must be a multiple of the {m.preset} preset's num_heads={n}, e.g. {-(-h // n) * n}."
    check_field(h % n == 0, "model.hidden_size", h, fix)
  with config_errors("model", model_config.ModelConfig):
    cfg = base.replace(**overrides)
  if cfg.max_position < need_pos and not m.checkpoint:
    cfg = cfg.replace(max_position=need_pos)
  return cfg


def _eval_protocol(run: RunConfig) -> EvalProtocol:
  e, t = run.eval, run.task
  dataset = e.dataset or t.name
  fix = f"unknown data set; choose one of {sorted(tasks.TASKS)}."
  check_field(dataset in tasks.TASKS, "eval.dataset", dataset, fix)
  fix = "is a generated task; evaluate it by training on it (leave eval.dataset empty)."
  check_field(dataset == t.name or not tasks.TASKS[dataset].generated, "eval.dataset", dataset, fix)
  with config_errors("eval", EvalProtocol, {"size": "num_problems"}):
    return EvalProtocol(
      **{**schema.borrowed(e), "n": 1 if e.greedy else e.n},  # the section's decoding fields are the protocol's
      dataset=dataset,
      split="test",
      size=e.num_problems,
      max_new_tokens=t.max_new_tokens,
      prompt_template=t.template or None,
      seed=run.seed,
    )


def _tasks(run: RunConfig) -> dict:
  """{"task": the run's configured task, "eval_task": the one evaluations draw from}, each built once."""
  t, gen = run.task, dict(run.task.gen)
  try:
    with config_errors("task.gen" if tasks.TASKS[t.name].generated else "task", names=dict.fromkeys(gen)):
      task = tasks.build(t.name, template=t.template, options=gen, data_path=t.data_path)
  except ConfigError as e:
    if m := re.search(r"unexpected keyword argument '(\w+)'", str(e)):  # e.g. --config.task.gen.foo=1
      raise ConfigError(
        f"config.task.gen.{m.group(1)}={gen[m.group(1)]!r}: not a knob of the {t.name} generator."
      ) from None
    raise
  dataset = run.eval.dataset or t.name
  if dataset == t.name and not run.eval.data_path:
    return {"task": task, "eval_task": task}
  with config_errors("eval", names={"data_path": "data_path"}):
    return {"task": task, "eval_task": tasks.build(dataset, template=t.template, data_path=run.eval.data_path)}


def parse_config(config, *, check_prompts: bool = True) -> RunSpec:
  """Checks `config` (the ConfigDict of run_spec.RunConfig) and builds the RunSpec; raises ConfigError.

  check_prompts: also make and tokenize the training and evaluation problems (no model) to check that
  every prompt fits task.max_prompt_len; the result is cached per data setting within a process.
  """
  run = schema.from_config_dict(RunConfig, config)
  method, t = run.method, run.task
  check_field(t.name in tasks.TASKS, "task.name", t.name, f"unknown task; choose one of {sorted(tasks.TASKS)}.")
  fix = "does not exist; point it at a local parquet/jsonl file ('' = the shipped fixture)."
  for field, path in (("task.data_path", t.data_path), ("eval.data_path", run.eval.data_path)):
    check_field(not path or os.path.exists(path), field, path, fix)
  with config_errors("task", RolloutConfig):
    rollout = RolloutConfig(
      **schema.borrowed(t),  # chat_template, num_train_problems: RolloutConfig's fields
      task=t.name,
      prompts_per_step=t.prompts_per_step,
      group_size=t.group_size,
      max_prompt_len=t.max_prompt_len,
      max_new_tokens=t.max_new_tokens,
      seed=run.seed,
    )
  multiturn = t.multiturn if t.multiturn.enabled else None
  # A multi-turn context reaches T - 1 tokens and one call adds up to max_turn_tokens more.
  model_cfg = _model_config(
    run.model, t.max_prompt_len + t.max_new_tokens + (multiturn.max_turn_tokens if multiturn else 0)
  )
  with config_errors("learner", LearnerConfig):  # config.learner with the method and the batch layout
    learner_cfg = dataclasses.replace(
      run.learner, method=method, group_size=rollout.group_size, batch_size=rollout.batch_size
    )
  spec = RunSpec(run, rollout, model_cfg, learner_cfg, _eval_protocol(run), multiturn, **_tasks(run))
  if check_prompts:
    check_prompt_lengths(spec)
  return spec


# ----------------------------------------------------------------------------- command-line fields


def field_paths(config, prefix: str = "") -> list[str]:
  """Every dotted field of a ConfigDict, sub-dicts included (`task`, `task.name`, ...)."""
  out = []
  for k, v in config.items():
    out.append(prefix + k)
    if hasattr(v, "items"):
      out.extend(field_paths(v, f"{prefix}{k}."))
  return out


def check_override_paths(config, overrides: dict[str, str]):
  """ConfigError for the first `--config.PATH=VALUE` whose PATH is not a field, with the closest names."""
  known = field_paths(config)
  for path, value in overrides.items():
    if path in known:
      continue
    parent = path.rpartition(".")[0]  # compare with the siblings first: optim.b3 -> optim.b1, sed -> seed
    pool = [p for p in known if p.rpartition(".")[0] == parent] if parent in known or not parent else known
    schema.unknown_field(path, value, pool, known)
