"""Supervised warm start: a tiny random policy -> a base policy with some signal.

RL needs a policy that sometimes succeeds. For CPU-sized runs the trainer calls
`warm_start` (when `sft.steps > 0`), which fits the policy to the task's own
solver-written solutions by next-token cross-entropy on the response only:

    loss(theta) = - sum_{n,t} m_nt log pi_theta(y_nt | y_n,<t) / sum_{n,t} m_nt

m_nt (`loss_nt`) is 1 on the target tokens and on the EOS appended after
them (so the policy learns to stop), 0 on the prompt and on padding. Rows use
the rollout layout (left-padded prompt bucket Tp, then the right-padded
response bucket Tn, T = Tp + Tn), so the positions the policy trains on are
the positions the sampler later generates at. AdamW with global-norm clipping (the
learner's optim.make_optimizer) on a warmup-cosine schedule, one jitted step; batches are drawn from a seeded
permutation of the examples (epochs), so the result is a pure function of the
inputs.

Targets (`target_text`) are what the task's verifier accepts: each task writes
its own (`Task.demonstrate`, tasks/base.py), e.g. countdown the solver's
canonical shortest expression (tasks/countdown.py), arithmetic the integer
answer, a data set its worked solution (`Problem.solution`). With sft.noise a
task that can (`can_demonstrate_wrong`) writes well-formed wrong answers
(`demonstrate_wrong`); nothing here knows a task by name.

Cache: the trained parameters are stored as one safetensors file named by a
SHA-256 over everything that determines them (`cache_key`): the config and
inputs (`key_fields`: model config, a digest of the initial parameters,
tokenizer vocabulary / EOS / chat template, task, template, generator knobs,
prompt/response budgets, the training problems, SFT steps / lr / batch size,
seed, cache version) and the numerics (`numerics_fields`: the train step's
lowered program, the rows it trains on, the XLA build and the machine), under
`sft.cache_dir` or ~/.cache/vcpo_jax/sft. A code change that alters the
arithmetic, another jaxlib or another CPU misses the cache and trains again.
Writes are atomic (temporary file then rename), so concurrent runs never read
half a file. A second run with the same config, code and machine loads the
file and trains nothing. Each call writes `<workdir>/sft.json` (key, losses,
accuracies, wall time, cache hit or not, and the provenance of the code that
trained the parameters: vcpo_jax.provenance).
The cache directory and the workdir may be URLs: every file goes through
vcpo_jax.fs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vcpo_jax import evaluation, fs, optim, provenance, tasks
from vcpo_jax.model import config as model_config
from vcpo_jax.model import transformer
from vcpo_jax.model.tokenizer import encode_prompts
from vcpo_jax.sampler import Sampler, SamplerConfig
from vcpo_jax.sharding import path_str  # dotted parameter names, shared with the partition rules

log = logging.getLogger("vcpo_jax")

# Bump when the training recipe or the target format changes: old caches stop matching.
# 4: the key holds the numerics (numerics_fields); 3: the decoder layers stacked [L, ...]; 2: per-layer leaves
# named by sharding.path_str; 1: jax keystr
CACHE_VERSION = 4
# Held out of the SFT examples to report the accuracy reached (capped by the pool size).
NUM_REPORT_PROBLEMS = 64


# ----------------------------------------------------------------------------- config


def _derived():
  return dataclasses.field(default=None, metadata={"config": False})


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """The warm start's own config: config.sft is this class (its first five fields); `RunConfig.sft_config()` (which
  the trainer calls) adds the data setting, seed and sampling it depends on. Every field but `cache_dir`,
  `temperature` and `progress` enters the cache key (`key_fields`).
  """

  steps: int = 0  # supervised warm start on solver solutions (0 = off); cached per config
  lr: float = 3e-3  # warm-start AdamW peak rate (warmup-cosine)
  batch_size: int = 64  # warm-start examples per step
  noise: float = 0.0  # fraction of warm-start targets replaced by a well-formed wrong answer (a noisy demonstrator)
  cache_dir: str = ""  # where warm starts are cached ("" = ~/.cache/vcpo_jax/sft)
  # Set by RunConfig.sft_config from the other sections (not in config.sft; None until then):
  max_prompt_len: int | None = _derived()  # config.task.max_prompt_len: the rollout layout's prompt bucket Tp
  max_new_tokens: int | None = _derived()  # config.task.max_new_tokens: its response bucket Tn
  task: str | None = _derived()  # config.task.name
  template: str | None = _derived()  # config.task.template
  task_gen: dict | None = _derived()  # config.task.gen (generator knobs)
  chat_template: bool | None = _derived()  # config.task.chat_template
  seed: int | None = _derived()  # config.seed: the batch permutation and the report's sampling
  temperature: float | None = _derived()  # config.sampler.temperature: the held-out report's sampled accuracy
  progress: bool | None = _derived()  # config.log.progress: a tqdm bar while training

  def __post_init__(self):
    # `sft.FIELD=VALUE: fix`: RunConfig (schema.config_errors) reports it as config.sft.FIELD, in one line.
    if not (isinstance(self.steps, int) and self.steps >= 0):
      raise ValueError(f"sft.steps={self.steps!r}: must be an int >= 0 (0 = no warm start).")
    real = isinstance(self.lr, (int, float)) and not isinstance(self.lr, bool)
    if not (real and math.isfinite(self.lr) and self.lr > 0):
      raise ValueError(f"sft.lr={self.lr!r}: must be a finite rate > 0.")
    if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
      raise ValueError(f"sft.batch_size={self.batch_size!r}: must be an int >= 1.")
    if not (isinstance(self.noise, (int, float)) and 0.0 <= self.noise < 1.0):
      raise ValueError(f"sft.noise={self.noise!r}: must be a fraction in [0, 1) (0 = every target correct).")
    if self.noise and self.task is not None and not can_write_wrong_answers(self.task):
      noisy = sorted(n for n in tasks.TASKS if can_write_wrong_answers(n))
      raise ValueError(
        f"sft.noise={self.noise!r}: task {self.task!r} cannot write wrong answers; use one of {noisy} or set "
        "sft.noise=0."
      )


# ----------------------------------------------------------------------------- examples


def target_text(problem: tasks.Problem) -> str:
  """The response the policy is trained to write for `problem` (without EOS): its task's demonstration."""
  return tasks.task_of(problem).demonstrate(problem)


def wrong_target_text(problem: tasks.Problem, rng) -> str:
  """A well-formed WRONG response for `problem` (what a noisy demonstrator writes), formatted as target_text:
  its task's `demonstrate_wrong`. `rng` is a random.Random: the choice is a function of it."""
  return tasks.task_of(problem).demonstrate_wrong(problem, rng)


def can_write_wrong_answers(task: str) -> bool:
  """Whether registry task `task` writes wrong demonstrations (sft.noise > 0 needs it)."""
  return task in tasks.TASKS and tasks.TASKS[task].can_demonstrate_wrong


@dataclasses.dataclass(frozen=True)
class Examples:
  """Fixed-shape SFT rows (numpy), M examples of T = Tp + Tn tokens.

  tokens_mt int32 [M, T]: left-padded prompt, then target + EOS, right-padded.
  valid_mt bool [M, T]: real tokens.  loss_mt bool [M, T]: target + EOS tokens.
  """

  tokens_mt: np.ndarray
  valid_mt: np.ndarray
  loss_mt: np.ndarray

  def __len__(self):
    return self.tokens_mt.shape[0]


def build_examples(
  problems: Sequence[tasks.Problem],
  tokenizer,
  max_prompt_len: int,
  max_new_tokens: int,
  chat_template: bool = False,
  noise: float = 0.0,
  seed: int = 0,
) -> Examples:
  """Tokenizes (prompt, target + EOS) pairs into the rollout layout.

  With `noise` > 0 a seeded fraction of the examples (each independently with probability `noise`) gets a
  well-formed wrong target (`wrong_target_text`) instead: a noisy demonstrator. The policy then learns the
  format and the right answers but prefers wrong ones, which leaves RL a clear job (moving probability mass
  onto what the verifier accepts) at a size that trains in minutes.

  Raises ValueError naming task.max_prompt_len / task.max_new_tokens when a
  prompt or a target (with its EOS) does not fit: a truncated target would
  teach the policy never to stop.
  """
  if not problems:
    raise ValueError("the warm start needs at least one training problem (task.num_train_problems).")
  eos = tokenizer.eos_token_id
  if eos is None:
    raise ValueError("the tokenizer has no eos_token_id; the warm start appends EOS so the policy learns to stop.")
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
  prompts = encode_prompts(tokenizer, problems, chat_template)
  rng = random.Random(f"sft-noise/{seed}")
  texts = [wrong_target_text(p, rng) if noise and rng.random() < noise else target_text(p) for p in problems]
  targets = [list(tokenizer.encode(text, add_special_tokens=False)) + [eos] for text in texts]
  lp, lt = max(map(len, prompts)), max(map(len, targets))
  if lp > max_prompt_len:
    raise ValueError(f"a warm-start prompt has {lp} tokens > task.max_prompt_len={max_prompt_len}; raise it.")
  if lt > max_new_tokens:
    raise ValueError(
      f"a warm-start target has {lt} tokens (EOS included) > task.max_new_tokens="
      f"{max_new_tokens}; raise task.max_new_tokens or use shorter instances."
    )
  m, tp, t = len(problems), max_prompt_len, max_prompt_len + max_new_tokens
  tokens = np.full((m, t), pad, np.int32)
  valid = np.zeros((m, t), bool)
  loss = np.zeros((m, t), bool)
  for i, (p, y) in enumerate(zip(prompts, targets)):
    tokens[i, tp - len(p) : tp] = p
    tokens[i, tp : tp + len(y)] = y
    valid[i, tp - len(p) : tp + len(y)] = True
    loss[i, tp : tp + len(y)] = True
  return Examples(tokens, valid, loss)


# ----------------------------------------------------------------------------- loss and step


def sft_loss(graphdef, params, tokens_bt, valid_bt, loss_bt) -> jax.Array:
  """Token-mean negative log-likelihood of the loss-masked tokens (a float32 scalar).

  tokens_bt int32 [B, T], valid_bt / loss_bt bool [B, T]; logp[:, t] is
  log p(tokens[t] | tokens[<t]) (transformer.token_logprobs), so the first
  target token is predicted from the last prompt token.
  """
  logp_bt = transformer.sequence_logprobs(graphdef, params, tokens_bt, valid_bt)
  m_bt = loss_bt.astype(jnp.float32)
  return -(logp_bt * m_bt).sum() / jnp.maximum(m_bt.sum(), 1.0)


def make_schedule(lr: float, steps: int) -> optax.Schedule:
  """Linear warmup 0 -> lr over max(1, steps // 20) steps, then cosine decay to lr / 10 at `steps`."""
  warmup = max(1, steps // 20)
  return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr / 10)


def make_optimizer(lr: float, steps: int, clip_norm: float = 1.0, weight_decay: float = 0.01):
  """The learner's builder (optim.make_optimizer: clip -> AdamW -> ESS scale, which is 1 here) on
  `make_schedule`; updates equal those of chain(clip_by_global_norm, adamw(schedule)) exactly."""
  return optim.make_optimizer(make_schedule(lr, steps), weight_decay=weight_decay, clip_norm=clip_norm)


def make_train_step(graphdef, tx):
  """Jitted (params, opt_state, tokens, valid, loss) -> (params, opt_state, loss)."""

  def step(params, opt_state, tokens_bt, valid_bt, loss_bt):
    loss, grads = jax.value_and_grad(lambda p: sft_loss(graphdef, p, tokens_bt, valid_bt, loss_bt))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step)


def train(
  graphdef, params, examples: Examples, *, steps: int, lr: float, batch_size: int, seed: int, progress: bool = False
) -> tuple[Any, np.ndarray]:
  """`steps` AdamW steps on batches of `batch_size` examples; returns (params, losses [steps]).

  Batch b takes rows order[b*B:(b+1)*B] of a per-epoch seeded permutation
  (np.random.default_rng([seed, epoch])); the batch size is capped by the number of examples.
  """
  if steps < 1:
    raise ValueError(f"sft.steps must be >= 1 to train, got {steps}.")
  if batch_size < 1:
    raise ValueError(f"sft.batch_size must be >= 1, got {batch_size}.")
  if not lr > 0:
    raise ValueError(f"sft.lr must be > 0, got {lr}.")
  m = len(examples)
  bs = min(batch_size, m)
  per_epoch = m // bs
  tx = make_optimizer(lr, steps)
  opt_state = tx.init(params)
  step_fn = make_train_step(graphdef, tx)
  losses = np.zeros((steps,), np.float32)
  from tqdm.auto import tqdm

  bar = tqdm(range(steps), desc="sft", disable=not progress, dynamic_ncols=True)
  order, epoch = None, -1
  pending = []
  for s in bar:
    e, b = divmod(s, per_epoch)
    if e != epoch:
      epoch, order = e, np.random.default_rng([seed, e]).permutation(m)
    idx = order[b * bs : (b + 1) * bs]
    params, opt_state, loss = step_fn(
      params, opt_state, examples.tokens_mt[idx], examples.valid_mt[idx], examples.loss_mt[idx]
    )
    pending.append((s, loss))
    if len(pending) >= 10 or s == steps - 1:  # fetch losses in groups: no host sync every step
      for i, l in pending:
        losses[i] = float(l)
      pending = []
      bar.set_postfix(loss=f"{losses[s]:.3f}")
  bar.close()
  return params, losses


# ----------------------------------------------------------------------------- accuracy


def accuracy(
  graphdef,
  params,
  model_cfg,
  tokenizer,
  problems: Sequence[tasks.Problem],
  *,
  max_prompt_len: int,
  max_new_tokens: int,
  temperature: float,
  seed: int = 0,
  chat_template: bool = False,
) -> float:
  """Fraction of `problems` answered correctly (tasks.score >= 0.5), one sample each.

  temperature 0.0 is greedy decoding; otherwise plain sampling (no top-k/top-p).
  """
  eos = tokenizer.eos_token_id
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
  base = SamplerConfig(
    eos_id=eos,
    pad_id=pad,
    max_new_tokens=max_new_tokens,
    prompt_buckets=(max_prompt_len,),
    new_token_buckets=(max_new_tokens,),
    batch_buckets=(len(problems),),
  )
  sampling = evaluation.EvalSampling(
    lambda c: Sampler(graphdef, model_cfg, c), base, tokenizer, chat_template=chat_template
  )
  outs = sampling.generate_fn(params, jax.random.key(seed))(
    [p.prompt for p in problems],
    n=1,
    temperature=temperature,
    top_p=1.0,
    max_new_tokens=max_new_tokens,
    greedy=temperature == 0.0,
  )
  texts = [o[0] for o in outs]
  return float(np.mean([tasks.is_correct(tasks.score(p.task, x, p.reference)) for p, x in zip(problems, texts)]))


# ----------------------------------------------------------------------------- cache


def _digest_arrays(tree) -> str:
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    a = np.asarray(leaf)
    h.update(str((a.shape, a.dtype.str)).encode())
    h.update(np.ascontiguousarray(a).tobytes())
  return h.hexdigest()


def _tokenizer_fingerprint(tokenizer) -> dict:
  vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
  return {
    "vocab_sha256": hashlib.sha256(json.dumps(vocab).encode()).hexdigest(),
    "eos": tokenizer.eos_token_id,
    "pad": tokenizer.pad_token_id,
    "chat_template": getattr(tokenizer, "chat_template", None) or "",
  }


def _model_key(model_cfg) -> dict:
  """The model config's fields for the cache key; Qwen3's q/k norm, RoPE scaling and the LoRA fields are absent
  at their defaults (off, plain RoPE, no adapters) so that the keys of caches written before those fields existed
  still hold; so are the MoE fields of a dense model. Execution choices with the same math (scan_layers,
  routing_replay, moe_matmul) are absent for every model: where one rounds differently, its train step's
  program does too, and `numerics_fields` keys it."""
  fields = dataclasses.asdict(model_cfg)
  if not model_cfg.qk_norm:
    fields.pop("qk_norm")
  if model_cfg.rope_scaling == type(model_cfg.rope_scaling)():
    fields.pop("rope_scaling")
  if not model_cfg.lora_rank:
    for f in model_config.LORA_FIELDS:
      fields.pop(f)
  fields.pop("scan_layers")  # scanned or unrolled: the same stacked parameters, the same math
  # MoE: the warm start trains without a routing record, so routing replay (the RL learner's switch) does not
  # change it, and the grouped matmuls are equal; runs with and without replay share one warm start
  fields.pop("routing_replay")
  fields.pop("moe_matmul")
  if not model_cfg.num_experts:  # a dense model: the MoE fields (added later) are absent from its key
    for f in (x.name for x in dataclasses.fields(model_config.MoESpec)):
      fields.pop(f)
  return fields


def key_fields(params, model_cfg, tokenizer, train_problems: Sequence[tasks.Problem], cfg: SFTConfig) -> dict:
  """The config and inputs the warm start depends on, as a JSON-able dict (see `cache_key`; the numerics are
  `numerics_fields`).

  The dict's names and values are those of the RunSpec-based key before SFTConfig existed (tests/test_sft.py
  pins one key): rename a field here only with a CACHE_VERSION bump.
  """
  probs = hashlib.sha256()
  for p in train_problems:
    probs.update(json.dumps([p.task, p.prompt, p.solution, p.reference], default=str).encode())
    probs.update(b"\0")
  return {
    "version": CACHE_VERSION,
    "model_cfg": _model_key(model_cfg),
    "init_params_sha256": _digest_arrays(params),
    "tokenizer": _tokenizer_fingerprint(tokenizer),
    "task": cfg.task,
    "template": cfg.template,
    "task_gen": cfg.task_gen,
    "chat_template": cfg.chat_template,
    "max_prompt_len": cfg.max_prompt_len,
    "max_new_tokens": cfg.max_new_tokens,
    "num_train_problems": len(train_problems),
    "problems_sha256": probs.hexdigest(),
    "sft_steps": cfg.steps,
    "sft_lr": cfg.lr,
    "sft_batch_size": cfg.batch_size,
    "seed": cfg.seed,
    **({"sft_noise": cfg.noise} if cfg.noise else {}),  # absent at 0: the keys of earlier caches still hold
  }


def numerics_fields(graphdef, params, examples: Examples, cfg: SFTConfig) -> dict:
  """What decides the trained floats besides `key_fields`: the train step's lowered StableHLO (no source
  locations: an edit that changes the arithmetic changes it, an edited comment does not), the rows it trains
  on (`build_examples`' output) and the compiler and machine (`provenance.numerics`)."""
  tx = make_optimizer(cfg.lr, cfg.steps)
  rows = min(cfg.batch_size, len(examples))
  batch = [
    jax.ShapeDtypeStruct((rows, *a.shape[1:]), a.dtype)
    for a in (examples.tokens_mt, examples.valid_mt, examples.loss_mt)
  ]
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), params
  )
  program = make_train_step(graphdef, tx).lower(abstract, jax.eval_shape(tx.init, abstract), *batch).as_text()
  return {
    "train_step_sha256": hashlib.sha256(program.encode()).hexdigest(),
    "examples_sha256": _digest_arrays([examples.tokens_mt, examples.valid_mt, examples.loss_mt]),
    **provenance.numerics(),
  }


def cache_key(fields: dict) -> str:
  """SHA-256 (hex, 24 chars) of the canonical JSON of `key_fields` (with "numerics": `numerics_fields`)."""
  return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:24]


def cache_dir(cfg: SFTConfig) -> str:
  """sft.cache_dir (a local path or a URL) or ~/.cache/vcpo_jax/sft."""
  return cfg.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "vcpo_jax", "sft")


def _names(tree) -> list[str]:
  """Leaf names in flatten order (sharding.path_str: the one parameter-naming helper)."""
  names = [path_str(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  if len(set(names)) != len(names):
    raise ValueError(f"parameter leaf names are not unique: {sorted(n for n in set(names) if names.count(n) > 1)}")
  return names


_META_KEY = "vcpo_jax_sft"  # the safetensors metadata entry holding the JSON record


def save_params(path: str, params, metadata: dict) -> None:
  """Atomically writes `params` (leaves named by their tree path) and JSON metadata to a safetensors file.

  `path` is a local path or a URL (vcpo_jax.fs: locally a temporary file then a rename, so readers see the
  old file or the whole new one; on object stores one put)."""
  from safetensors.numpy import save

  tensors = {n: np.asarray(x) for n, x in zip(_names(params), jax.tree.leaves(params))}
  fs.write_bytes(path, save(tensors, metadata={_META_KEY: json.dumps(metadata, default=str)}))


def load_params(path: str, like) -> tuple[Any, dict] | None:
  """(params shaped like `like`, metadata) from `save_params`, or None if the file is absent or mismatched."""
  if not fs.exists(path):
    return None
  from safetensors.numpy import load

  try:
    data = fs.read_bytes(path)
    tensors = load(data)
    # The safetensors layout: an 8-byte little-endian header size, then the JSON header with __metadata__.
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    meta = json.loads((header.get("__metadata__") or {}).get(_META_KEY, "{}"))
  except Exception as e:  # a corrupt file is rebuilt, not fatal
    log.warning("sft cache %s unreadable (%s); rebuilding", path, e)
    return None
  leaves, treedef = jax.tree.flatten(like)
  names = _names(like)
  if set(names) != set(tensors) or any(tensors[n].shape != np.shape(x) for n, x in zip(names, leaves)):
    log.warning("sft cache %s does not match the model's parameters; rebuilding", path)
    return None
  return jax.tree.unflatten(treedef, [jnp.asarray(tensors[n], dtype=x.dtype) for n, x in zip(names, leaves)]), meta


# ----------------------------------------------------------------------------- entry point


def warm_start(
  graphdef,
  params,
  model_cfg,
  tokenizer,
  train_problems: Sequence[tasks.Problem],
  cfg: SFTConfig,
  workdir: str | None = None,
):
  """The warm-started parameters for this run: loaded from the cache, or trained and cached.

  Args:
    graphdef, params: the randomly initialised policy (transformer.split).
    model_cfg: its ModelConfig.  tokenizer: a transformers tokenizer with an EOS.
    train_problems: the run's training pool (Problem.solution holds the targets).
    cfg: its SFTConfig (RunSpec.sft_config(): config.sft, the data setting, seed, temperature, progress).
    workdir: if given, `sft.json` there records what happened.
  Returns:
    params, same structure as the input.
  """
  t0 = time.time()
  report, fit = _held_out(train_problems)
  examples = build_examples(
    fit, tokenizer, cfg.max_prompt_len, cfg.max_new_tokens, cfg.chat_template, noise=cfg.noise, seed=cfg.seed
  )
  fields = key_fields(params, model_cfg, tokenizer, train_problems, cfg)
  fields["numerics"] = numerics_fields(graphdef, params, examples, cfg)
  key = cache_key(fields)
  path = fs.join(cache_dir(cfg), f"{key}.safetensors")
  hit = load_params(path, params)
  if hit is not None:
    params, meta = hit
    log.info(
      "sft warm start: loaded %s (trained %d steps, final loss %.3f, greedy accuracy %.3f)",
      path,
      cfg.steps,
      meta.get("final_loss", float("nan")),
      meta.get("greedy_accuracy", float("nan")),
    )
    record = dict(meta, cached=True, load_s=time.time() - t0, path=path)
  else:
    record = _build(graphdef, params, model_cfg, tokenizer, examples, report, cfg, key, fields)
    params = record.pop("params")
    save_params(path, params, record)
    record.update(cached=False, path=path)
  if workdir:
    fs.write_text(fs.join(workdir, "sft.json"), json.dumps(record, indent=1, default=str))
  return params


def _held_out(train_problems) -> tuple[list, list]:
  """(report, fit): the last few problems, never trained on, report the accuracy reached; the rest train."""
  problems = list(train_problems)
  n_report = min(NUM_REPORT_PROBLEMS, len(problems) // 4)
  return problems[len(problems) - n_report :], problems[: len(problems) - n_report]


def _build(graphdef, params, model_cfg, tokenizer, examples, report, cfg, key, fields) -> dict:
  n_report = len(report)
  t0 = time.time()
  params, losses = train(
    graphdef,
    params,
    examples,
    steps=cfg.steps,
    lr=cfg.lr,
    batch_size=cfg.batch_size,
    seed=cfg.seed,
    progress=cfg.progress,
  )
  train_s = time.time() - t0
  acc = {}
  if n_report:
    kw = dict(
      max_prompt_len=cfg.max_prompt_len,
      max_new_tokens=cfg.max_new_tokens,
      seed=cfg.seed,
      chat_template=cfg.chat_template,
    )
    acc["greedy_accuracy"] = accuracy(graphdef, params, model_cfg, tokenizer, report, temperature=0.0, **kw)
    acc["sampled_accuracy"] = accuracy(
      graphdef, params, model_cfg, tokenizer, report, temperature=cfg.temperature, **kw
    )
  k = max(1, min(10, len(losses) // 10))
  record = dict(
    key=key,
    fields=fields,
    steps=cfg.steps,
    examples=len(examples),
    initial_loss=float(losses[:k].mean()),
    final_loss=float(losses[-k:].mean()),
    train_s=train_s,
    total_s=time.time() - t0,
    report_problems=n_report,
    sampled_temperature=cfg.temperature,
    provenance=provenance.collect(),  # the code and machine that trained these parameters (kept in the cache)
    **acc,
  )
  log.info(
    "sft warm start: %d steps in %.1fs, loss %.3f -> %.3f, held-out accuracy greedy %s sampled %s",
    cfg.steps,
    train_s,
    record["initial_loss"],
    record["final_loss"],
    acc.get("greedy_accuracy"),
    acc.get("sampled_accuracy"),
  )
  print(
    f"sft warm start: {cfg.steps} steps in {train_s:.1f}s, loss {record['initial_loss']:.3f} -> "
    f"{record['final_loss']:.3f}, held-out accuracy greedy {acc.get('greedy_accuracy')} "
    f"sampled(T={cfg.temperature}) {acc.get('sampled_accuracy')}",
    flush=True,
  )
  record["params"] = params
  return record
