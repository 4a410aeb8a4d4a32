"""ConfigDict -> RunSpec: the single place where a config crosses into library code.

`parse_config` checks every field before anything is built or compiled, and
raises ConfigError (a ValueError) naming the field and the fix. Library code
below the trainer receives only these frozen dataclasses.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from vcpo_jax import estimator, tasks
from vcpo_jax.evaluation import EvalProtocol
from vcpo_jax.learner import LearnerConfig
from vcpo_jax.model import config as model_config
from vcpo_jax.rollout.common import RolloutConfig
from vcpo_jax.rollout.multiturn import MultiTurnConfig

MODES = ("sync", "lag", "async")
MAX_LAG = 1024


class ConfigError(ValueError):
  pass


def _fail(field: str, msg: str):
  raise ConfigError(f"config.{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class RunSpec:
  seed: int
  steps: int
  mode: str
  k: int
  method: str
  rollout: RolloutConfig
  task_template: str
  task_gen: dict
  task_data_path: str
  eval_data_path: str  # held-out data for text tasks ("" = the task's own file / fixture)
  model_cfg: model_config.ModelConfig
  model_checkpoint: str
  tokenizer_dir: str
  temperature: float
  top_p: float
  top_k: int
  learner: LearnerConfig
  lr: float
  weight_decay: float
  clip_norm: float
  b1: float
  b2: float
  schedule: str
  on_nonfinite: str
  eval: EvalProtocol
  eval_every: int
  checkpoint_every: int
  keep_last: int
  keep_best: int
  sft_steps: int
  sft_lr: float
  sft_batch_size: int
  sft_cache_dir: str
  mesh_shape: tuple
  distributed: dict
  async_cfg: dict
  progress: bool
  norm_overhead_every: int
  plots: bool
  multiturn: MultiTurnConfig | None = None  # tool-use episodes; None = single-turn rollouts

  @property
  def eval_batch_size(self) -> int:
    return (self.eval.size or 1) * self.eval.n

  def eval_task_object(self):
    """The task evaluations draw from: the training task, or eval.dataset with eval.data_path."""
    from vcpo_jax.tasks.datasets import TextTask

    if self.eval.dataset == self.rollout.task and not self.eval_data_path:
      return self.task_object()
    return TextTask(self.eval.dataset, path=self.eval_data_path or None, template=self.task_template or None)

  def task_object(self):
    """The task with this run's template and generator knobs."""
    from vcpo_jax.tasks.arithmetic import ArithmeticTask
    from vcpo_jax.tasks.countdown import CountdownTask
    from vcpo_jax.tasks.datasets import TextTask

    name = self.rollout.task
    kw = {"template": self.task_template} if self.task_template else {}
    if name == "countdown":
      return CountdownTask(**kw, **self.task_gen)
    if name == "arithmetic":
      return ArithmeticTask(**kw, **self.task_gen)
    if self.task_data_path or self.task_template:
      return TextTask(name, path=self.task_data_path or None, template=self.task_template or None)
    return tasks.TASKS[name]


def _pg_config(config) -> estimator.PGConfig:
  if config.method not in estimator.PRESETS:
    _fail("method", f"unknown method preset {config.method!r}; choose one of {sorted(estimator.PRESETS)}.")
  overrides = {k: v for k, v in config.vcpo.items() if v is not None}
  try:
    return estimator.pg_config_from_preset(config.method, **overrides)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.vcpo / config.method={config.method!r}: {e}") from None


def parse_config(config) -> RunSpec:
  c = config
  if c.steps < 1:
    _fail("steps", f"must be >= 1, got {c.steps}.")
  if c.mode not in MODES:
    _fail("mode", f"unknown mode {c.mode!r}; choose one of {MODES}.")
  k = int(c.lag.k)
  if k < 0:
    _fail("lag.k", f"staleness must be >= 0, got {k}.")
  if k > MAX_LAG:
    _fail("lag.k", f"{k} exceeds {MAX_LAG}; lag mode keeps k + 1 parameter copies.")
  if c.mode == "sync" and k != 0:
    _fail("lag.k", f"mode='sync' samples with the current policy (k = 0); got k={k}. Use mode='lag'.")
  if c.mode == "async" and k < 1:
    _fail("lag.k", "mode='async' needs a staleness budget k >= 1 (the sampler runs ahead by up to k steps).")
  pg = _pg_config(c)
  if c.task.group_size < 2 and pg.advantage in ("grpo", "rloo", "drgrpo"):
    _fail(
      "task.group_size",
      f"advantage estimator {pg.advantage!r} compares responses within a group; "
      "group_size must be >= 2 (or use vcpo.advantage='reinforce').",
    )
  if c.task.name not in tasks.TASKS:
    _fail("task.name", f"unknown task {c.task.name!r}; choose one of {sorted(tasks.TASKS)}.")
  if c.task.template and c.task.name not in ("countdown", "arithmetic") and "{problem}" not in c.task.template:
    _fail("task.template", f"a {c.task.name} prompt template must contain '{{problem}}', got {c.task.template!r}.")
  if c.task.data_path and not os.path.exists(c.task.data_path):
    _fail("task.data_path", f"{c.task.data_path!r} does not exist; point it at a local parquet/jsonl file.")
  try:
    rollout = RolloutConfig(
      task=c.task.name,
      prompts_per_step=c.task.prompts_per_step,
      group_size=c.task.group_size,
      max_prompt_len=c.task.max_prompt_len,
      max_new_tokens=c.task.max_new_tokens,
      chat_template=c.task.chat_template,
      num_train_problems=c.task.num_train_problems,
      seed=c.seed,
    )
  except ValueError as e:
    raise ConfigError(f"config.task: {e}") from None
  if c.model.checkpoint:
    if not os.path.isfile(os.path.join(c.model.checkpoint, "config.json")):
      _fail(
        "model.checkpoint",
        f"{c.model.checkpoint!r} has no config.json; pass a local Hugging Face "
        "model directory, or '' for a random preset.",
      )
  if c.model.preset not in model_config.PRESETS:
    _fail("model.preset", f"unknown preset {c.model.preset!r}; choose one of {sorted(model_config.PRESETS)}.")
  overrides = {
    k: v
    for k, v in (
      ("hidden_size", c.model.hidden_size),
      ("num_layers", c.model.num_layers),
      ("intermediate_size", c.model.intermediate_size),
    )
    if v is not None
  }
  try:
    model_cfg = model_config.PRESETS[c.model.preset](dtype=c.model.dtype, **overrides)
  except ValueError as e:
    raise ConfigError(f"config.model: {e}") from None
  multiturn = _multiturn_config(c)
  # A multi-turn context reaches T - 1 tokens and one call adds up to max_turn_tokens more.
  need_pos = c.task.max_prompt_len + c.task.max_new_tokens + (multiturn.max_turn_tokens if multiturn else 0)
  if model_cfg.max_position < need_pos and not c.model.checkpoint:
    model_cfg = model_cfg.replace(max_position=need_pos)
  if c.model.tokenizer and not os.path.isdir(c.model.tokenizer):
    _fail("model.tokenizer", f"{c.model.tokenizer!r} is not a directory.")
  if not c.sampler.temperature > 0:
    _fail(
      "sampler.temperature",
      "training rollouts need temperature > 0 (behavior log-probs of greedy decoding are degenerate).",
    )
  if not 0 < c.sampler.top_p <= 1:
    _fail("sampler.top_p", f"must be in (0, 1], got {c.sampler.top_p}.")
  if not c.optim.lr > 0:
    _fail("optim.lr", f"must be > 0, got {c.optim.lr}.")
  if not c.optim.clip_norm > 0:
    _fail("optim.clip_norm", f"must be > 0, got {c.optim.clip_norm}.")
  if c.learner.on_nonfinite not in ("skip", "abort"):
    _fail("learner.on_nonfinite", f"choose 'skip' or 'abort', got {c.learner.on_nonfinite!r}.")
  try:
    learner_cfg = LearnerConfig(
      pg=pg,
      grad_path=c.learner.grad_path,
      microbatch_size=c.learner.get("microbatch_size") or None,
      group_size=rollout.group_size,
      batch_size=rollout.batch_size,
    )
  except ValueError as e:
    raise ConfigError(f"config.learner: {e}") from None
  try:
    eval_dataset = c.eval.dataset or c.task.name
    if eval_dataset not in tasks.TASKS:
      _fail("eval.dataset", f"unknown data set {eval_dataset!r}; choose one of {sorted(tasks.TASKS)}.")
    if eval_dataset != c.task.name and eval_dataset in ("countdown", "arithmetic"):
      _fail(
        "eval.dataset",
        f"{eval_dataset!r} is a generated task; evaluate it by training on it (leave eval.dataset empty).",
      )
    eval_proto = EvalProtocol(
      dataset=eval_dataset,
      split="test",
      size=c.eval.num_problems,
      temperature=c.eval.temperature,
      top_p=c.eval.top_p,
      n=1 if c.eval.greedy else c.eval.n,
      max_new_tokens=c.task.max_new_tokens,
      greedy=c.eval.greedy,
      pass_at_k=tuple(c.eval.pass_at_k),
      prompt_template=c.task.template or None,
      seed=c.seed,
    )
  except ValueError as e:
    raise ConfigError(f"config.eval: {e}") from None
  if c.eval.data_path and not os.path.exists(c.eval.data_path):
    _fail("eval.data_path", f"{c.eval.data_path!r} does not exist; point it at a local parquet/jsonl file.")
  if c.log.norm_overhead_every < 0:
    _fail("log.norm_overhead_every", f"must be >= 0 (0 = off), got {c.log.norm_overhead_every}.")
  if c.eval.every < 0:
    _fail("eval.every", f"must be >= 0 (0 = start and end only), got {c.eval.every}.")
  if c.checkpoint.every < 1:
    _fail("checkpoint.every", f"must be >= 1, got {c.checkpoint.every}.")
  mesh_shape = tuple(int(x) for x in c.mesh.shape)
  if len(mesh_shape) != 3:
    _fail("mesh.shape", f"needs 3 entries (data, fsdp, tensor), got {mesh_shape}.")
  data_par = 1  # a -1 entry is resolved against the device count when the mesh is built (trainer)
  for x in mesh_shape[:2]:
    data_par *= max(x, 1)
  if rollout.batch_size % data_par:
    _fail(
      "task.prompts_per_step",
      f"the batch N = P*G = {rollout.batch_size} must be divisible by the "
      f"data-parallel size data*fsdp = {data_par} of mesh.shape={mesh_shape}.",
    )
  if c.distributed.enabled and not c.distributed.coordinator_address:
    _fail("distributed.coordinator_address", "required when distributed.enabled=True (host:port).")
  if c.sft.steps < 0:
    _fail("sft.steps", f"must be >= 0, got {c.sft.steps}.")
  if c.sft.steps and c.model.checkpoint:
    _fail(
      "sft.steps",
      "the warm start is for randomly initialised CPU-sized models; set sft.steps=0 when model.checkpoint is given.",
    )
  return RunSpec(
    seed=int(c.seed),
    steps=int(c.steps),
    mode=c.mode,
    k=k,
    method=c.method,
    rollout=rollout,
    task_template=c.task.template,
    task_gen=dict(c.task.gen.to_dict()),
    task_data_path=c.task.data_path,
    eval_data_path=c.eval.data_path,
    model_cfg=model_cfg,
    model_checkpoint=c.model.checkpoint,
    tokenizer_dir=c.model.tokenizer,
    temperature=float(c.sampler.temperature),
    top_p=float(c.sampler.top_p),
    top_k=int(c.sampler.top_k),
    learner=learner_cfg,
    lr=float(c.optim.lr),
    weight_decay=float(c.optim.weight_decay),
    clip_norm=float(c.optim.clip_norm),
    b1=float(c.optim.b1),
    b2=float(c.optim.b2),
    schedule=c.optim.schedule,
    on_nonfinite=c.learner.on_nonfinite,
    eval=eval_proto,
    eval_every=int(c.eval.every),
    checkpoint_every=int(c.checkpoint.every),
    keep_last=int(c.checkpoint.keep_last),
    keep_best=int(c.checkpoint.keep_best),
    sft_steps=int(c.sft.steps),
    sft_lr=float(c.sft.lr),
    sft_batch_size=int(c.sft.batch_size),
    sft_cache_dir=c.sft.cache_dir,
    mesh_shape=mesh_shape,
    distributed=dict(c.distributed.to_dict()),
    async_cfg=dict(c.async_.to_dict()),
    progress=bool(c.log.progress),
    plots=bool(c.log.plots),
    norm_overhead_every=int(c.log.norm_overhead_every),
    multiturn=multiturn,
  )


def _multiturn_config(c) -> MultiTurnConfig | None:
  mt = c.task.multiturn
  if not mt.enabled:
    return None
  if c.task.name in ("countdown", "arithmetic"):
    _fail(
      "task.multiturn.enabled",
      f"task.name={c.task.name!r} has no tool-use protocol; use a text data set (gsm8k, math, math500, aime).",
    )
  try:
    cfg = MultiTurnConfig(**{k: v for k, v in mt.to_dict().items() if k != "enabled"})
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.task.multiturn: {e}") from None
  if cfg.max_turn_tokens > c.task.max_new_tokens:
    _fail(
      "task.multiturn.max_turn_tokens",
      f"{cfg.max_turn_tokens} exceeds the response budget "
      f"task.max_new_tokens={c.task.max_new_tokens}; lower it or raise task.max_new_tokens.",
    )
  return cfg


def describe(spec: RunSpec) -> dict[str, Any]:
  """A short human-readable summary for the run banner."""
  return dict(
    mode=spec.mode,
    k=spec.k,
    method=spec.method,
    advantage=spec.learner.pg.advantage,
    is_variant=spec.learner.pg.is_variant,
    opob=spec.learner.pg.opob,
    ess_lr=spec.learner.pg.ess_lr,
    task=spec.rollout.task,
    N=spec.rollout.batch_size,
    steps=spec.steps,
    lr=spec.lr,
  )
