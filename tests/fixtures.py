"""Test helpers: tiny random Hugging Face checkpoints written by transformers + torch.

These are the reference side of the parity tests: the checkpoints are produced by
transformers' own `save_pretrained`, not by our exporter. Every parameter
(including q/k/v biases and norm scales, which transformers initializes to 0 / 1)
is randomized so that a mis-mapped tensor cannot hide behind a constant.

torch is a test-only dependency; import this module only from tests.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from vcpo_jax.model.tokenizer import build_char_tokenizer

FAMILIES = ("qwen2", "llama")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(args, timeout: float):
  """`python *args` run from the repository root with this tree's vcpo_jax importable (PYTHONPATH=ROOT): its
  CompletedProcess, stdout and stderr captured as text, the exit code not checked."""
  import subprocess
  import sys

  env = dict(os.environ, PYTHONPATH=ROOT)
  cmd = [sys.executable, *args]
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def hf_config(family: str, vocab_size: int = 101):
  """A tiny transformers config: Qwen2 (GQA 4/2, q/k/v bias, tied) or Llama (GQA 4/1, untied)."""
  import transformers

  common = dict(
    vocab_size=vocab_size,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    attn_implementation="eager",
  )
  if family == "qwen2":
    return transformers.Qwen2Config(
      intermediate_size=128,
      num_key_value_heads=2,
      rms_norm_eps=1e-6,
      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
      tie_word_embeddings=True,
      **common,
    )
  if family == "llama":
    return transformers.LlamaConfig(
      intermediate_size=160,
      num_key_value_heads=1,
      rms_norm_eps=1e-5,
      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
      tie_word_embeddings=False,
      **common,
    )
  if family == "qwen3_moe":  # not in FAMILIES: tests/test_moe_model.py runs it
    return transformers.Qwen3MoeConfig(
      intermediate_size=128,
      num_key_value_heads=2,
      head_dim=32,
      rms_norm_eps=1e-6,
      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
      tie_word_embeddings=False,
      num_experts=8,
      num_experts_per_tok=2,
      moe_intermediate_size=32,
      norm_topk_prob=True,
      **common,
    )
  raise ValueError(f"family must be one of {FAMILIES}, got {family!r}.")


def make_hf_model(family: str, vocab_size: int = 101, seed: int = 0):
  """A transformers CausalLM (eval mode, float32) with every parameter randomized."""
  return randomized_hf_model(hf_config(family, vocab_size), seed)


def randomized_hf_model(config, seed: int = 0):
  """The transformers CausalLM of `config` (eval mode, float32) with every parameter randomized."""
  import torch
  import transformers

  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      # Norm scales near 1, everything else ~N(0, 0.1^2): logits of order 1, so the
      # 1e-4 parity bound is a meaningful relative check.
      p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)
  return model.eval()


def make_hf_checkpoint(
  out_dir,
  family: str,
  vocab_size: int = 101,
  seed: int = 0,
  max_shard_size: str | None = None,
  bf16: bool = False,
  tokenizer: bool = True,
):
  """Writes a tiny random checkpoint with `save_pretrained`; returns (out_dir, torch model).

  Args:
    max_shard_size: e.g. "40KB" to force several shards + model.safetensors.index.json.
    bf16: store the weights as bfloat16 (the returned model is the bf16-rounded one in float32).
    tokenizer: also save `build_char_tokenizer()` there (vocab_size must be >= 101).
  """
  import copy

  import torch

  model = make_hf_model(family, vocab_size, seed)
  out_dir = os.fspath(out_dir)
  kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  if bf16:
    # Round the parameters only: model.to(bf16) would also round the float32 RoPE
    # inv_freq buffer, which the loader rightly recomputes in float32.
    with torch.no_grad():
      for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).float())
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out_dir, **kw)
  else:
    model.save_pretrained(out_dir, **kw)
  if tokenizer:
    build_char_tokenizer(out_dir)
  return out_dir, model


def hf_logits(model, tokens_bt: np.ndarray, mask_bt: np.ndarray | None = None) -> np.ndarray:
  """Reference float32 logits [B, T, V] from the torch model (left padding supported).

  Positions follow transformers' generate(): cumsum(mask) - 1, padding positions set to 1.
  """
  import torch

  tokens = torch.as_tensor(np.asarray(tokens_bt), dtype=torch.long)
  if mask_bt is None:
    mask_bt = np.ones(tokens.shape, np.int64)
  mask = torch.as_tensor(np.asarray(mask_bt), dtype=torch.long)
  position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
  with torch.no_grad():
    out = model(input_ids=tokens, attention_mask=mask, position_ids=position_ids)
  return out.logits.float().numpy()


def tiny_countdown_config(**overrides):
  """configs/countdown.py:smoke shrunk to a 1-layer D=32 policy; overrides by dotted path ("lag.k": 2)."""
  from configs import countdown
  from vcpo_jax.rl import choices

  c = countdown.get_config("smoke")
  c.model.hidden_size = 32
  c.model.intermediate_size = 64
  c.model.num_layers = 1
  c.task.max_new_tokens = 8
  c.eval.num_problems = 2
  method = [(k, v) for k, v in overrides.items() if k.split(".")[0] == "method"]
  choices.set_paths(c, method)  # a preset name, a part's choice or a field of the method tree (rl/choices.py)
  for key, value in ((k, v) for k, v in overrides.items() if k.split(".")[0] != "method"):
    node = c
    *path, last = key.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  return c


def train_hf_checkpoint(tmp_path, monkeypatch, model, name: str, **overrides):
  """Saves the transformers `model` as the checkpoint tmp_path/name (with the char tokenizer) and trains it 2 steps
  through trainer.run in tmp_path/"run": tiny_countdown_config with the checkpoint's architecture, lr 1e-2, and a
  dense reward (the fraction of digits, so that every step moves a random policy's weights); `overrides` by dotted
  path. Returns (the checkpoint dir, the parameters saved at step 2)."""
  import jax

  from vcpo_jax import trainer
  from vcpo_jax.rollout import common as rollout_common

  ckpt = str(tmp_path / name)
  model.save_pretrained(ckpt)
  build_char_tokenizer(ckpt)
  saved = {}
  real_save = trainer._save

  def recording_save(c, step, state, *a, **k):
    saved[step] = jax.tree.map(lambda x: np.array(x, copy=True), state.params)
    return real_save(c, step, state, *a, **k)

  monkeypatch.setattr(trainer, "_save", recording_save)
  dense = lambda problems, outputs, extraction=None: ([sum(map(str.isdigit, o)) / max(len(o), 1) for o in outputs], 0)
  monkeypatch.setattr(rollout_common.tasks, "score_problems", dense)
  over = {"model.checkpoint": ckpt, "optim.lr": 1e-2, "checkpoint.every": 2, "eval.every": 2, "log.plots": False}
  c = tiny_countdown_config(steps=2, **over, **overrides)
  for field in ("hidden_size", "intermediate_size", "num_layers"):  # the checkpoint's architecture, not a preset's
    c.model[field] = None
  trainer.run(c, str(tmp_path / "run"))
  return ckpt, saved[2]


def wrap_sources(monkeypatch, around_next):
  """Wraps rollout.build_source: each source built answers next(step) with around_next(src, step, its own next).

  Returns the list of the sources built (appended as they are built)."""
  from vcpo_jax import rollout

  built = []
  build = rollout.build_source

  def recording_build_source(*a, **kw):
    src = build(*a, **kw)
    nxt = src.next
    src.next = lambda step: around_next(src, step, nxt)
    built.append(src)
    return src

  monkeypatch.setattr(rollout, "build_source", recording_build_source)
  return built


def record_sources(monkeypatch):
  """Wraps rollout.build_source so a test sees every (step, policy_version, info) the trainer consumed.

  Returns (built, seen, paths): the sources built, the per-step records, and the first source's
  shared-memory resource paths (async sources only), captured before the run closes them.
  """
  seen, paths = [], []

  def next_(src, step, nxt):
    if not paths and hasattr(src, "resource_paths"):
      paths.extend(src.resource_paths())
    batch, info = nxt(step)
    seen.append((step, batch["policy_version"].copy(), info))
    return batch, info

  return wrap_sources(monkeypatch, next_), seen, paths


def tiny_char_policy(tokenizer, seed: int = 0):
  """(cfg, graphdef, params): a 1-layer Qwen2-style policy over the char tokenizer's vocabulary."""
  from vcpo_jax.model import config as model_config
  from vcpo_jax.model import transformer

  cfg = model_config.tiny_qwen2(
    vocab_size=len(tokenizer),
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    max_position=64,
  )
  graphdef, params = transformer.split(transformer.init(cfg, seed=seed))
  return cfg, graphdef, params


def sampler_config(spec, tokenizer):
  """The training sampler's config as trainer.run builds it from a RunSpec: its buckets (trainer._buckets), the
  rollout's max_new_tokens and config.sampler's settings (no top-k, routing or support records)."""
  from vcpo_jax import trainer
  from vcpo_jax.sampler import SamplerConfig

  kw = {"max_new_tokens": spec.rollout.max_new_tokens, **trainer._buckets(spec), **spec.sampling.sampler_kwargs()}
  return SamplerConfig.from_tokenizer(tokenizer, **kw)


def micro_config(vocab_size: int, tied: bool = False, **kw):
  """The learner tests' one-layer model (D 16, MLP 32, 2 query heads over 1 KV head of width 8): tiny_qwen2's
  layout (q/k/v bias, tied head) when `tied`, tiny_llama's (no bias, untied) otherwise; `kw` overrides fields."""
  from vcpo_jax.model import config as model_config

  make = model_config.tiny_qwen2 if tied else model_config.tiny_llama
  widths = dict(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
  return make(vocab_size, **{**widths, **kw})


def learner_batch(tokens, valid, loss_mask, logp, rewards, group_id) -> dict:
  """The learner's batch dict: behavior_logp is `logp` [N, T] zeroed off the loss mask, in float32."""
  behavior_logp = np.where(loss_mask, logp, 0).astype(np.float32)
  return dict(
    tokens=tokens,
    valid_mask=valid,
    loss_mask=loss_mask,
    behavior_logp=behavior_logp,
    rewards=rewards,
    group_id=group_id,
  )


def stale_policy_batch(cfg, valid, loss_mask):
  """(graphdef, params, beh, batch): the policy at seed 0, a behaviour policy 30% of the way to seed 1's (a nearby
  stale version, as a few lagged updates would give), and a batch of random tokens [N, T] (the masks' shape)
  scored by the behaviour policy; rewards [1, 0, 0, 1] in groups [0, 0, 1, 1] (N = 4)."""
  import jax

  from vcpo_jax.model import transformer

  graphdef, params = transformer.split(transformer.init(cfg, seed=0))
  _, other = transformer.split(transformer.init(cfg, seed=1))
  beh = jax.tree.map(lambda a, b: a + 0.3 * (b - a), params, other)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, valid.shape).astype(np.int32)
  blogp = np.asarray(transformer.sequence_logprobs(graphdef, beh, tokens, valid))
  rewards, group_id = np.array([1.0, 0.0, 0.0, 1.0], np.float32), np.array([0, 0, 1, 1], np.int32)
  return graphdef, params, beh, learner_batch(tokens, valid, loss_mask, blogp, rewards, group_id)


@contextlib.contextmanager
def persistent_compilation_cache(path):
  """jax's persistent compilation cache in directory `path` for the block; off again (and reset) after it.

  Repeated `trainer.run` calls of one config compile the same programs; inside this block the second and
  later runs load them from `path` instead (a repeated 2-step tiny countdown run: 25.1 s of CPU -> 2.5 s,
  measured under load). Kept away from runs whose compilations a test counts, so that what such a test
  sees never depends on an earlier test. The compiled programs are the same, so results are too.
  """
  import jax
  from jax.experimental.compilation_cache import compilation_cache as cc

  # Off unless asked for (VCPO_TEST_COMPILE_CACHE=1): under xdist, XLA:CPU's compile segfaulted inside jax's
  # cache path (compiler._compile_and_write_cache) in 3 of 4 full runs on the merged tree with the scanned layers.
  if os.environ.get("VCPO_TEST_COMPILE_CACHE") != "1":
    yield
    return
  names = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
  )
  old = {n: getattr(jax.config, n) for n in names}
  cc.reset_cache()  # jax decides once whether the cache is used; start that decision afresh
  jax.config.update("jax_compilation_cache_dir", os.fspath(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  try:
    yield
  finally:
    for n, v in old.items():
      jax.config.update(n, v)
    cc.reset_cache()


class ParityTask:
  """A fake generated task (tests of "tasks own their knowledge"): every member the warm start and the
  evaluation use is its own, with values no shipped task has, so a consumer that branched on a name (or
  fell back to a shipped task's rule) would give something else.

  Prompt "P<k>?"; the answer is "even" / "odd" of k; the solution column holds "<k> mod 2" (never the target:
  a warm start that trained on Problem.solution would show it); demonstrations are "=even" / "=odd" (the only
  form `score` accepts), wrong ones the other word; eval_n = 4 (no shipped task has 4).
  """

  name = "parity"
  generated = True
  uses_extraction = False
  eval_n = 4
  can_demonstrate_wrong = True

  def make_problems(self, split="train", n=8, seed=0, template=None):
    from vcpo_jax import tasks

    ks = [seed * 1000 + i + (500 if split == "test" else 0) for i in range(8 if n is None else n)]
    return [
      tasks.Problem(
        id=f"parity-{split}-{k}",
        task="parity",
        prompt=f"P{k}?",
        reference="odd" if k % 2 else "even",
        solution=f"{k} mod 2",
        grader=self,
      )
      for k in ks
    ]

  def score(self, model_output, reference, extraction=None):
    return float(model_output == f"={reference}")

  def check_reference(self, reference):
    if reference not in ("even", "odd"):
      raise ValueError(f"parity reference must be 'even' or 'odd', got {reference!r}")

  def demonstrate(self, problem):
    return f"={problem.reference}"

  def demonstrate_wrong(self, problem, rng):
    return "=even" if problem.reference == "odd" else "=odd"


def register_parity(monkeypatch) -> ParityTask:
  """Registers a ParityTask in a copy of tasks.TASKS that the test's teardown restores."""
  from vcpo_jax import tasks

  monkeypatch.setattr(tasks, "TASKS", dict(tasks.TASKS))
  return tasks.register(ParityTask())
