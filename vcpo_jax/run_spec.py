"""The run's config: RunConfig, the tree of the components' own frozen configs, and RunSpec, what it builds.

RunConfig is the schema of `--config`. Each section is a frozen dataclass owned by its component, in most cases
the component's own config: optim.OptimConfig, sampler.SamplingConfig, learner.LearnerConfig, sft.SFTConfig,
rollout.async_.AsyncConfig, rollout.multiturn.MultiTurnConfig (task.multiturn), checkpoint.CheckpointConfig,
metrics.LogConfig, mesh.MeshConfig, mesh.DistributedConfig. Fields such a config holds that other sections
determine (LearnerConfig.method / group_size / batch_size, SFTConfig's data setting) have metadata {"config":
False}: they are not in the ConfigDict, are None in the section, and are set with dataclasses.replace where
run_config.parse_config / RunConfig.sft_config build the component's config. Two sections are what the user
sets for a component whose config is something else, built from them: model.config.ModelSection (a preset or a
checkpoint, size overrides and how the model is computed -> ModelConfig, the architecture; its compute options
are ModelConfig's fields model.config.RUN_FIELDS, with their defaults and comments, `@schema.fields_from`) and
evaluation.EvalSection (when and on what -> EvalProtocol, the recorded protocol; its decoding knobs are
EvalProtocol's fields evaluation.RUN_FIELDS; EvalSection's docstring says why it is not EvalProtocol itself).
TaskSection and LagSection, which no single component owns, are below. Each field is `name: type = default  #
--config_help text`: configs/common.py's ConfigDict is generated from this tree (schema.to_config_dict) and built back by
schema.from_config_dict (tests/test_schema.py checks it).

Adding a knob is one line, `name: type = default  # --config_help text`, plus its check in that class's
`__post_init__`; it is then `--config.SECTION.name=`, listed by `--config_help`, in every run's fingerprint:
  - a section that is a component's config (optim, sampler, learner, sft, async_, checkpoint, log, mesh,
    distributed, task.multiturn): the line goes into that dataclass, which is all;
  - method.*: the tree of the Method's parts (rl/choices.py), each a named choice with its own fields, read off
    its factory: a new weight variant, peer loss or option of one is a field there with no line here;
  - model.*: a compute option is a ModelConfig field (its line and comment there) named in model.config's
    EXECUTION_FIELDS (or LORA_FIELDS), which makes it a ModelSection field too (`schema.fields_from`);
    run_config passes every ModelSection field ModelConfig has;
  - eval.*: a decoding knob is an EvalProtocol field named in evaluation.RUN_FIELDS (recorded with every result);
    when and on what to evaluate is a line in EvalSection;
  - task.*: a RolloutConfig field config.task sets unchanged is named in TASK_ROLLOUT_FIELDS (schema.fields_from);
  - task.*, lag.*, top level: otherwise the line goes into that section class (its value reaches the component
    where run_config builds it).
Nothing else lists it: the study's run fingerprint (experiments/stability.run_fingerprint) hashes the whole run
config and leaves out a field added since the committed ledger's records (experiments/data/ledger_fields.txt)
while it is at its default, so a new field's default must keep the old behaviour (tests/test_stability.py checks
the committed records). A new section is one dataclass plus one RunConfig field `name: Cls = section(Cls)`.

RunConfig.__post_init__ holds the checks across sections; RunSpec adds what is built from the tree (the
method (rl.method.Method), the model's config, the tasks, the evaluation protocol) and the checks that need those.
run_config.parse_config is the one path from a ConfigDict to a RunSpec.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from vcpo_jax import schema, sft, tasks
from vcpo_jax.checkpoint import CheckpointConfig
from vcpo_jax.evaluation import EvalProtocol, EvalSection
from vcpo_jax.learner import LearnerConfig
from vcpo_jax.mesh import DistributedConfig, MeshConfig
from vcpo_jax.metrics import LogConfig
from vcpo_jax.model.config import ModelConfig, ModelSection
from vcpo_jax.model.tokenizer import encode_prompts
from vcpo_jax.optim import OptimConfig
from vcpo_jax.rl import choices
from vcpo_jax.rl.method import PRESETS, Method
from vcpo_jax.rollout.async_ import AsyncConfig
from vcpo_jax.rollout.common import RolloutConfig
from vcpo_jax.rollout.multiturn import MultiTurnConfig
from vcpo_jax.sampler import SamplingConfig
from vcpo_jax.schema import ConfigError, check_field, config_errors, section, tree

__all__ = ["ConfigError", "RunConfig", "RunSpec", "SamplingConfig", "check_prompt_lengths"]

MODES = ("sync", "lag", "async")
MAX_LAG = 1024
MAX_SEED = 2**32 - 1  # numpy's and JAX's seeds are unsigned 32-bit

# ----------------------------------------------------------------------------- sections without a component

TASK_ROLLOUT_FIELDS = ("chat_template", "num_train_problems")  # RolloutConfig's fields config.task sets as they are


@dataclasses.dataclass(frozen=True)
@schema.fields_from(RolloutConfig, TASK_ROLLOUT_FIELDS, after="max_new_tokens")
class TaskSection:
  """config.task: the task and the batch layout (-> RolloutConfig, tasks.build); chat_template and
  num_train_problems are RolloutConfig's fields (schema.fields_from), P, G and the lengths have their defaults here
  (RolloutConfig requires them)."""

  name: str = "countdown"  # vcpo_jax.tasks.TASKS name
  template: str = ""  # prompt template ("" = the task's default)
  gen: dict = dataclasses.field(default_factory=dict)  # generator knobs of countdown/arithmetic (task-specific)
  prompts_per_step: int = 8  # P prompts per learner step
  group_size: int = 8  # G responses per prompt (N = P * G)
  max_prompt_len: int = 64  # prompt bucket in tokens
  max_new_tokens: int = 32  # response budget in tokens
  data_path: str = ""  # local parquet/jsonl for gsm8k/math/aime ("" = shipped fixtures)
  multiturn: MultiTurnConfig = section(MultiTurnConfig)


@dataclasses.dataclass(frozen=True)
class LagSection:
  k: int = 0  # staleness in learner steps (lag and async modes)

  def __post_init__(self):
    check_field(self.k >= 0, "lag.k", self.k, "staleness must be >= 0.")
    check_field(self.k <= MAX_LAG, "lag.k", self.k, f"must be <= {MAX_LAG}; lag mode keeps k + 1 parameter copies.")


# ----------------------------------------------------------------------------- the run's config tree


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The whole `--config` tree; __post_init__ checks the top-level fields and the constraints between sections."""

  seed: int = 0  # master seed: model init, problem order, sampling (fold_in(key, step))
  steps: int = 100  # learner steps (optimizer updates)
  mode: str = "sync"  # "sync" (k = 0) | "lag" (exact staleness k, one process) | "async" (sampler process)
  # the method's parts, each a named choice with its own fields (rl/choices.py); --config.method=PRESET sets them all
  method: Method = tree(lambda: PRESETS["vcpo"], choices.tree, choices.build)
  task: TaskSection = section(TaskSection)
  model: ModelSection = section(ModelSection)
  sampler: SamplingConfig = section(SamplingConfig)
  optim: OptimConfig = section(OptimConfig)
  learner: LearnerConfig = section(LearnerConfig)
  lag: LagSection = section(LagSection)
  async_: AsyncConfig = section(AsyncConfig)
  eval: EvalSection = section(EvalSection)
  checkpoint: CheckpointConfig = section(CheckpointConfig)
  sft: sft.SFTConfig = section(sft.SFTConfig)
  mesh: MeshConfig = section(MeshConfig)
  distributed: DistributedConfig = section(DistributedConfig)
  log: LogConfig = section(LogConfig)

  def __post_init__(self):
    ok_seed = isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED
    check_field(ok_seed, "seed", self.seed, f"must be in [0, {MAX_SEED}].")
    check_field(self.steps >= 1, "steps", self.steps, "must be >= 1 (learner steps).")
    check_field(self.mode in MODES, "mode", self.mode, f"choose one of {MODES}.")
    self._check_modes()
    self._check_layout()
    with config_errors("sft", sft.SFTConfig):  # the warm start's own config checks config.sft.*
      self.sft_config()

  def _check_modes(self):
    """What each mode allows: staleness, in-flight updates, background evaluation, reference gradients."""
    k, mode, a = self.lag.k, self.mode, self.async_
    fix = "mode='sync' samples with the current policy (k = 0); set lag.k=0 or mode='lag'."
    check_field(mode != "sync" or k == 0, "lag.k", k, fix)
    fix = "mode='async' needs a staleness budget k >= 1 (the sampler runs ahead by up to k steps)."
    check_field(mode != "async" or k >= 1, "lag.k", k, fix)
    check_field(
      not (a.inflight_updates and self.task.multiturn.enabled),
      "async_.inflight_updates",
      True,
      "in-flight updates cover single-turn rollouts only; set it False for task.multiturn.enabled runs.",
    )
    check_field(
      not self.eval.background or (mode == "async" and not self.distributed.enabled),
      "eval.background",
      self.eval.background,
      "the async sampler process evaluates: only with mode='async' on one host (distributed.enabled=False); "
      "set eval.background=False.",
    )
    check_field(
      not (self.log.ref_grad_every and mode == "async"),
      "log.ref_grad_every",
      self.log.ref_grad_every,
      "the on-policy reference batch is sampled in the learner's process: mode='sync' or 'lag' only; set 0.",
    )
    check_field(
      not (mode == "async" and a.publish_path != "shm" and self.distributed.enabled),
      "async_.publish_path",
      a.publish_path,
      "the device and transfer publishers serve one learner process; set 'shm' for distributed.enabled runs.",
    )
    check_field(
      not (self.eval.background and a.publish_path == "device"),
      "eval.background",
      self.eval.background,
      "needs a sampler process: async_.publish_path='shm' or 'transfer' (have 'device'); set one of them.",
    )

  def _check_layout(self):
    """Batch layout against the mesh and the sampler; the files the model comes from."""
    t, m = self.task, self.model
    if t.multiturn.enabled:
      n = t.max_new_tokens
      check_field(
        t.multiturn.max_turn_tokens <= n,
        "task.multiturn.max_turn_tokens",
        t.multiturn.max_turn_tokens,
        f"exceeds the response budget task.max_new_tokens={n}; lower it or raise task.max_new_tokens.",
      )
    g, mb = t.group_size, self.sampler.max_batch
    fix = f"must be a multiple of task.group_size={g}, so that each sampler call holds whole groups (0 = no cap)."
    check_field(mb % g == 0, "sampler.max_batch", mb, fix)
    shape = self.mesh.shape
    data_par = max(shape[0], 1) * max(shape[1], 1)  # a -1 entry: resolved by build_mesh
    check_field(
      (t.prompts_per_step * g) % data_par == 0,
      "task.prompts_per_step",
      t.prompts_per_step,
      f"the batch N = P*G = {t.prompts_per_step * g} must be divisible by the data-parallel size "
      f"data*fsdp = {data_par} of mesh.shape={shape}.",
    )
    check_field(
      not m.checkpoint or os.path.isfile(os.path.join(m.checkpoint, "config.json")),
      "model.checkpoint",
      m.checkpoint,
      "has no config.json; pass a local Hugging Face model directory, or '' for a random preset.",
    )
    check_field(not m.tokenizer or os.path.isdir(m.tokenizer), "model.tokenizer", m.tokenizer, "is not a directory.")
    check_field(
      not (self.sft.steps and m.checkpoint),
      "sft.steps",
      self.sft.steps,
      "the warm start is for randomly initialised CPU-sized models; set sft.steps=0 with model.checkpoint.",
    )

  def sft_config(self) -> sft.SFTConfig:
    """The warm start's own config (sft.warm_start): config.sft plus the data setting, seed and sampling."""
    t = self.task
    return dataclasses.replace(
      self.sft,
      max_prompt_len=t.max_prompt_len,
      max_new_tokens=t.max_new_tokens,
      task=t.name,
      template=t.template,
      task_gen=dict(t.gen),
      chat_template=t.chat_template,
      seed=self.seed,
      temperature=self.sampler.temperature,
      progress=self.log.progress,
    )


# ----------------------------------------------------------------------------- the run


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """RunConfig plus what is built from it; the trainer builds from this. Flat names below are read-only views."""

  config: RunConfig
  rollout: RolloutConfig
  model_cfg: ModelConfig
  learner: LearnerConfig
  eval: EvalProtocol
  multiturn: MultiTurnConfig | None  # tool-use episodes; None = single-turn rollouts
  # The run's one configured task (tasks.build of config.task) and the one evaluations draw from (the same
  # object unless eval.dataset / eval.data_path name another): every reward is graded by these objects.
  task: tasks.Task | None = None
  eval_task: tasks.Task | None = None

  def _check_centering(self, method):
    """method.loss.score_centering='exact' needs the behaviour parameters (sync / lag) and q = softmax(logits); 'topk'
    needs single-turn rollouts (the training sampler records the top-k, SamplerConfig.record_topk = sc_topk,
    and the Batch carries it to the learner in every mode); neither takes LoRA adapters."""
    if method.centering is None:
      return
    source = method.centering[0]
    check_field(
      not self.model_cfg.lora_rank,
      "method.loss.score_centering",
      source,
      f"the centered score's forward takes a whole model, not LoRA adapters (model.lora_rank="
      f"{self.model_cfg.lora_rank}); set method.loss.score_centering='off' or model.lora_rank=0.",
    )
    if source == "topk":
      check_field(
        self.multiturn is None,
        "method.loss.score_centering",
        "topk",
        "tool-use episodes' continuations do not record the sampler's top-k; use single-turn rollouts "
        "(multiturn.enabled=False) or method.loss.score_centering='off'.",
      )
      return
    check_field(
      self.mode in ("sync", "lag"),
      "method.loss.score_centering",
      "exact",
      f"needs the behaviour parameters, kept only in mode='sync' / 'lag' (have {self.mode!r}); "
      "use method.loss.score_centering='topk' (with method.loss.sc_topk) or mode='lag'.",
    )
    s = self.sampling
    check_field(
      s.temperature == 1.0 and s.top_p >= 1.0 and not s.top_k,
      "method.loss.score_centering",
      "exact",
      f"recomputes q = softmax(logits) of the behaviour version; sampler.temperature={s.temperature}, "
      f"top_p={s.top_p}, top_k={s.top_k} change q: set them to 1.0, 1.0, 0 or use method.loss.score_centering='topk'.",
    )

  def __post_init__(self):
    if self.task is not None:
      check_field(
        not self.config.task.template or self.task.generated or "{problem}" in self.config.task.template,
        "task.template",
        self.config.task.template,
        f"a {self.rollout.task} prompt template must contain '{{problem}}'.",
      )
    if self.multiturn is not None:
      check_field(
        self.task is None or not self.task.generated,
        "task.multiturn.enabled",
        True,
        f"task.name={self.rollout.task!r} has no tool-use protocol; use a text data set (gsm8k, math, math500, aime).",
      )
    check_field(
      self.multiturn is None or self.sampling.support_replay != "on",
      "sampler.support_replay",
      "on",
      "tool-use episodes' continuations do not record the sampler's kept support; use single-turn rollouts "
      "or sampler.support_replay='auto' (off for tool use) / 'off'.",
    )
    method = self.learner.method
    self._check_centering(method)
    estimator = method.advantage.estimator
    check_field(
      self.rollout.group_size >= 2 or estimator not in ("grpo", "rloo", "drgrpo"),
      "task.group_size",
      self.rollout.group_size,
      f"advantage estimator {estimator!r} compares responses within a group; use group_size >= 2 "
      "(or method.advantage=reinforce).",
    )

  @property
  def eval_batch_size(self) -> int:
    return (self.eval.size or 1) * self.eval.n

  def sft_config(self) -> sft.SFTConfig:
    return self.config.sft_config()

  def make_train_problems(self):
    """The training pool (as the trainer makes it): num_train_problems generated, or the whole data set."""
    return self.task.make_problems("train", self.rollout.num_train_problems if self.task.generated else None, self.seed)

  def make_eval_problems(self):
    """The held-out problems (as the trainer makes them), at most eval.num_problems."""
    return self.eval_task.make_problems("test", self.eval.size if self.eval_task.generated else None, self.seed)[
      : self.eval.size
    ]

  def load_tokenizer(self):
    """The policy's tokenizer (as the trainer loads it): model.tokenizer, the checkpoint's, or the char one."""
    from vcpo_jax.model import policy

    return policy.load_tokenizer(self.model_checkpoint, self.tokenizer_dir)


# Flat read-only views of RunConfig (read by the trainer, tests and scripts): RunSpec.NAME = config.PATH.
_VIEWS = dict(
  v.split("=")
  for v in """seed=seed steps=steps mode=mode k=lag.k model_checkpoint=model.checkpoint tokenizer_dir=model.tokenizer
  sampling=sampler optim=optim on_nonfinite=learner.on_nonfinite eval_every=eval.every eval_background=eval.background
  checkpoint=checkpoint sft_steps=sft.steps mesh_shape=mesh.shape dist=distributed async_=async_ log=log lr=optim.lr
  weight_decay=optim.weight_decay clip_norm=optim.clip_norm""".split()
)


def _view(spec: RunSpec, path: str):
  node = spec.config
  for name in path.split("."):
    node = getattr(node, name)
  return node


for _name, _path in _VIEWS.items():
  setattr(RunSpec, _name, property(functools.partial(_view, path=_path)))


# ----------------------------------------------------------------------------- prompt lengths


_PROMPT_LENGTHS: dict[str, dict] = {}  # data setting -> longest prompts; tests parse the same config often
_TOKENIZERS: dict[tuple, object] = {}  # (model.tokenizer, model.checkpoint) -> tokenizer, only for counting here


def check_prompt_lengths(spec: RunSpec):
  """Every training and evaluation prompt fits the prompt bucket task.max_prompt_len (else: one line, the fix)."""
  t = spec.config.task
  key = repr(
    (
      spec.rollout.task,
      t.template,
      sorted(t.gen.items()),
      t.data_path,
      spec.rollout.num_train_problems,
      spec.eval.dataset,
      spec.eval.size,
      spec.config.eval.data_path,
      spec.seed,
      spec.rollout.chat_template,
      spec.model_checkpoint,
      spec.tokenizer_dir,
    )
  )
  if key not in _PROMPT_LENGTHS:
    with config_errors("task.gen" if spec.task.generated else "task", names=dict.fromkeys(t.gen)):
      train = spec.make_train_problems()
    with config_errors("eval"):
      held_out = spec.make_eval_problems()
    with config_errors("model.tokenizer" if spec.tokenizer_dir else "model.checkpoint"):
      src = (spec.tokenizer_dir, spec.model_checkpoint)
      tokenizer = _TOKENIZERS[src] = _TOKENIZERS.get(src) or spec.load_tokenizer()
    longest = {}
    for name, problems in (("training", train), ("evaluation", held_out)):
      lengths = [len(ids) for ids in encode_prompts(tokenizer, problems, spec.rollout.chat_template)]
      i = max(range(len(lengths)), key=lengths.__getitem__) if lengths else None
      longest[name] = (lengths[i], problems[i].id) if lengths else (0, None)
    _PROMPT_LENGTHS[key] = longest
  for name, (n, problem_id) in _PROMPT_LENGTHS[key].items():
    check_field(
      n <= spec.rollout.max_prompt_len,
      "task.max_prompt_len",
      spec.rollout.max_prompt_len,
      f"the longest {name} prompt (problem {problem_id}) has {n} tokens; set task.max_prompt_len >= {n}.",
    )
