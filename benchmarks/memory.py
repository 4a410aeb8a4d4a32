"""Per-device memory of the released configs' learner and sampler steps, from compilation alone.

Nothing runs and nothing is allocated: the real shapes are built abstractly
(`jax.eval_shape`, `jax.ShapeDtypeStruct`), jitted with the real shardings on N
fake CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=N`, set in one
subprocess before jax starts, N the largest count; a mesh over the first n devices per count), lowered, compiled, and read with
`compiled.memory_analysis()`, which reports the bytes of ONE device's program.

  python -m benchmarks.memory                                   # 3 configs x 8/16/64 devices x 3 parts
  python -m benchmarks.memory --configs=math --devices=4 --parts=sampler_decode --sampler_mesh=config
  python -m benchmarks.memory --configs=math --devices=64 --parts=learner --layers=1
  python -m benchmarks.memory --layers=1,2                      # the learner extrapolated from 1, 2 layers (fast, low)

Parts (what is compiled, per config):
  learner   `learner.make_train_step` (the VCPO step the trainer jits: gradient path, ESS, clip ->
            AdamW), jitted like `trainer.run` does: state sharded by `sharding.TRANSFORMER_RULES`,
            batch [N, T] split over ("data", "fsdp"), the state donated, traced under the mesh.
            N = P * G, T = max_prompt_len + max_new_tokens. The config's learner.microbatch_size,
            raised where a mesh has more devices than it has rows (`microbatch_rows`; the
            `microbatch` field of each result row says what was compiled).
  sampler_prefill  `sampler.Sampler(...).lower(params, B, Tp, Tn, part="prefill")`: the prompt bucket
            [B, Tp] through the model into a fresh KV cache (k [B, K, H, S], v [B, K, S, H]) per layer, S = Tp + Tn (the
            cache is an output), and the last column's logits.
  sampler_decode   `...lower(..., part="decode")`: one decode step as the decode loop runs it, the
            token fed at the last of the S cache slots (attention over the whole cache), the next
            token drawn; the cache is donated (updated in place), so it is counted once.
  sampler   (not a default part) `...lower(..., part="generate")`: prefill and the decode while_loop
            in one jit, as `Sampler.generate` runs it; its peak is that of the heavier phase.
  Sampler parameters in bfloat16 when the model computes in bfloat16 (what `Sampler.prepare_params`
  keeps on accelerators); the KV cache in the compute dtype.
  B, Tp, Tn are the training sampler's buckets as the trainer builds them (`SamplerConfig.from_tokenizer`,
  and `rollout.multiturn.sampler_config` for tool-use episodes, whose largest context bucket is taken).
  The sampler is compiled on a mesh over the same N devices, parameters sharded by the same rules, rows
  over ("data", "fsdp"): by default the learner's mesh.shape (a sync / lag run shares the learner's
  mesh); `--sampler_mesh=config` takes the config's sampler.mesh_shape (the async sampler process's
  own mesh over its devices, e.g. `--devices=4 --sampler_mesh=config` for math's launch line, whose
  sampler gets 4 devices), `--sampler_mesh=1,1,4` a given shape.

MoE models (Qwen3-MoE shapes, e.g. math:qwen3_30b_a3b) compile their experts with ModelConfig.moe_matmul="scan"
(a scan over the experts with a grouped GEMM's memory): XLA:CPU lowers `jax.lax.ragged_dot` to a masked dense
product over [rows, experts x width], which no accelerator program holds.

Every setting the configs give (method preset, learner options such as a micro-batch size, model
options such as remat) reaches the compiled step through `run_config.parse_config`, so improvements of
the learner, model and sharding code show up here without changes to this file.

Layers: `--layers` for the learner, `--sampler_layers` for the sampler parts. "1,2" compiles 1- and 2-layer
models and extrapolates every byte count per layer to the checkpoint's depth L: m(L) = m(1) + (L - 1) *
(m(2) - m(1)) (exact for the parameter, optimizer-state and cache bytes, a linear model for the
temporaries); "full" compiles all L layers; a single number k reports k layers as compiled.
`layers_compiled` in each result says which. Defaults: "full" for both. The learner's extrapolation is a
LOWER estimate: XLA:CPU schedules a 1- or 2-layer step's buffers more tightly than it can at depth
(math's learner on 64 chips: 5.6 / 7.6 GiB compiled at 2 / 4 layers, 18.5 extrapolated from 1 and 2
layers, 40.0 compiled at 28; a full-depth learner compile takes ~2 minutes there). The sampler's temporaries do not grow per layer: one layer's
are reused by the next, so the peak is a maximum over layers, not a sum, and a 1- to 2-layer difference
is a one-off change in XLA:CPU's fusion (at 2 layers one block's MLP is emitted as separate dots with
materialized float32 [B x chunk, F] buffers), which the linear model multiplied by L - 1: math's prefill
extrapolated to 41.8 GiB on (8, 1, 1) against 30.7 GiB compiled at 28 layers (temp 5.57 / 6.00 / 6.00 /
6.00 GiB at 1 / 2 / 4 / 28 layers; docs/results/benchmarks_history.md, "Sampler prefill at full depth").

Numbers, per device, GiB = 2^30 bytes:
  argument_gib  inputs (parameters + optimizer state + batch, or parameters + cache + inputs)
  temp_gib      XLA temporaries (activations, gradients, all-gathered weights, ...)
  output_gib    outputs not aliased to a donated input (the donated state is counted once, as argument)
  peak_gib      argument + temp + output (for the learner: argument + temp, the metrics are bytes)
  widened_gib   the part of temp that is XLA:CPU's float32 copies of whole bf16 arrays entering a loop (the
                stacked layer weights, hoisted out of the layer scan: `widened_parameter_bytes`); an accelerator
                computes in bf16 and holds none: peak_gib - widened_gib estimates its peak
  batch_gib     (with --batch_dependent; not for sampler_decode, whose temporaries hardly depend on T)
                the part of temp that grows with the batch's rows x tokens:
                temp(N, T) - temp(N, T0), the same step (same rows N or B, same config) compiled again with
                a tiny sequence, prompt and response T0 / 2 tokens each (T0 = min(TINY_TOKENS, T / 2)), at
                the first compiled depth (`batch_layers`, 1 by default: one block's activations + the
                head). What stays is batch-independent (gathered weights, gradients). Rows cannot be
                halved on 64 devices (N = 64 is one row per device), tokens can. The ghost-norm plan
                fills its per-device budget at any shape (a tiny T materializes more per-example
                gradients), so pin it for this pair: --norm_budget=0 (the smallest temporaries) makes
                the difference the activations'.
The last line printed is one JSON object {"results": [...], ...}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import inspect
import json
import math
import os
import re
import subprocess
import sys
import time

CONFIGS = ("gsm8k", "math", "multiturn")
PARTS = ("learner", "sampler_prefill", "sampler_decode")  # the default parts (issue 10 item 8)
# "sampler": the whole generation (prefill + decode while_loop) in one program, as `Sampler.generate` jits it.
ALL_PARTS = (*PARTS, "sampler")
# Sampler.lower(part=...) of each sampler part.
SAMPLER_LOWER = {"sampler_prefill": "prefill", "sampler_decode": "decode", "sampler": "generate"}
DEVICES = (8, 16, 64)
GIB = float(2**30)
# Per-device goal of issue 10: half of an H100 (80 GiB) for gsm8k, half of a TPU v5p chip (95 GiB) for the 7B
# configs, leaving the rest to XLA and the runtime.
BUDGET_GIB = {"gsm8k": 40.0, "math": 48.0, "multiturn": 48.0}
# ModelConfig fields that describe the architecture; --model overrides may set these (tiny-width runs).
ARCH_FIELDS = (
  "vocab_size",
  "hidden_size",
  "intermediate_size",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "rope_theta",
  "rms_eps",
  "qkv_bias",
  "qk_norm",
  "tie_embeddings",
  "model_type",
  "num_experts",  # Qwen3-MoE (vcpo_jax.model.moe)
  "num_experts_per_tok",
  "moe_intermediate_size",
  "norm_topk_prob",
)
# --model may also set the LoRA fields (e.g. --model=lora_rank=64: adapters on every projection, base frozen).
OVERRIDE_FIELDS = ARCH_FIELDS + ("lora_rank", "lora_alpha")
STAT_KEYS = ("argument", "temp", "output", "alias", "widened")
TINY_TOKENS = 64  # T0 of batch_gib: prompt 32 + response 32 tokens


# ----------------------------------------------------------------------------- building the run


TOPK = 64  # --score_centering=topk: ids the sampler records per token


def _parse_overrides(text: str) -> dict:
  """'hidden_size=64,vocab_size=512' -> {"hidden_size": 64, "vocab_size": 512} (ints, floats, bools)."""
  out = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    if "=" not in item:
      raise ValueError(f"--model entry {item!r} must be field=value, e.g. --model=hidden_size=64,vocab_size=512.")
    k, v = item.split("=", 1)
    if k not in OVERRIDE_FIELDS:
      raise ValueError(
        f"--model field {k!r} is not an architecture field (nor a LoRA field); choose from {OVERRIDE_FIELDS}."
      )
    if v in ("True", "False", "true", "false"):
      out[k] = v.lower() == "true"
    else:
      try:
        out[k] = int(v)
      except ValueError:
        out[k] = float(v) if k in ("rope_theta", "rms_eps") else v
  return out


@dataclasses.dataclass(frozen=True)
class Setting:
  """One config as the benchmark compiles it."""

  name: str
  spec: object  # run_spec.RunSpec of the released config (data paths cleared)
  model_cfg: object  # ModelConfig at full depth (num_layers = L)
  n: int  # learner batch rows N = P * G
  t: int  # learner sequence length T
  sampler_b: int  # sampler batch bucket B
  sampler_tp: int  # prompt bucket Tp (the largest, for multi-turn contexts)
  sampler_tn: int  # new-token bucket Tn
  sampler_cfg: object  # sampler.SamplerConfig the trainer builds (buckets, prefill chunk, param dtype)
  norm_budget: int | None = None  # ghost-norm memory budget per device (--norm_budget; None: the default)


class _FakeTokenizer:
  """What SamplerConfig.from_tokenizer reads from a tokenizer: Qwen2's <|endoftext|> id (the last id of a
  tiny --model vocabulary, which the sampler checks its stop ids against)."""

  def __init__(self, vocab_size: int):
    self.eos_token_id = self.pad_token_id = min(151643, vocab_size - 1)


def load_setting(
  name: str,
  model_overrides: dict | None = None,
  batch: int = 0,
  prompt_len: int = 0,
  new_tokens: int = 0,
  score_centering: str = "",
  microbatch: int = 0,
  grad_telemetry: bool = True,
):
  """The released config `configs/<name>.py` (`name:variant` for a variant, e.g. math:qwen3_8b) with its
  real architecture (config.model.shape).

  The config goes through `run_config.parse_config` like a real run (its data paths and checkpoint
  cleared: nothing is read), so every learner / model option it sets reaches the compiled step.
  batch / prompt_len / new_tokens (0 = the config's) shrink the run for quick checks and tests.
  score_centering="exact": the config's method with exact score centering (method.loss.score_centering), run in
  mode='lag' (where the behaviour version exists; the config's lag.k): the learner step then also reads the
  behaviour parameters and runs their forward (`compile_learner`), on the one-pass ghost step.
  grad_telemetry=False: learner.grad_telemetry off (the step without the grad/ metrics).
  """
  from vcpo_jax import run_config
  from vcpo_jax.rollout import multiturn
  from vcpo_jax.sampler import SamplerConfig

  module, _, variant = name.partition(":")
  c = importlib.import_module(f"configs.{module}").get_config(variant or None)
  if "shape" not in c.model:
    raise ValueError(f"configs/{name}.py has no model.shape block (the checkpoint's config.json architecture).")
  shape = dict(c.model.shape.to_dict())
  c.model.checkpoint = ""  # the architecture comes from model.shape; no weights are read
  c.task.data_path = ""
  c.eval.data_path = ""
  if batch:
    if batch % c.task.group_size:
      raise ValueError(f"--batch={batch} must be a multiple of the group size G={c.task.group_size} of {name}.")
    c.task.prompts_per_step = batch // c.task.group_size
  if microbatch:  # learner.microbatch_size (--microbatch; 0: the config's)
    c.learner.microbatch_size = microbatch
  c.learner.grad_telemetry = c.learner.grad_telemetry and grad_telemetry  # --no_grad_telemetry
  if prompt_len:
    c.task.max_prompt_len = prompt_len
  if score_centering:
    c.method.loss.score_centering = score_centering
    if score_centering == "topk":  # the sampler's record, K = 64 (the learner reads [N, T, 64] ids and log-probs)
      c.method.loss.sc_topk = TOPK
    else:
      c.mode = "lag"
    c.learner.ghost_passes = 1  # the centered score's dense head term runs in the one-pass ghost step only
  if new_tokens:
    c.task.max_new_tokens = new_tokens
    if c.task.multiturn.enabled:
      c.task.multiturn.max_turn_tokens = min(c.task.multiturn.max_turn_tokens, new_tokens)
  kw = {"check_prompts": False} if "check_prompts" in inspect.signature(run_config.parse_config).parameters else {}
  spec = run_config.parse_config(c, **kw)  # prompts are not tokenized: only shapes matter here
  shape.update(model_overrides or {})
  t = spec.rollout.max_prompt_len + spec.rollout.max_new_tokens
  need = t + (spec.multiturn.max_turn_tokens if spec.multiturn else 0)
  # spec.model_cfg carries the config's model options (dtype and whatever else parse_config sets);
  # only the architecture is replaced by the checkpoint's.
  model_cfg = spec.model_cfg.replace(**{k: v for k, v in shape.items() if k in OVERRIDE_FIELDS}, max_position=need)
  if model_cfg.moe is not None:  # XLA:CPU expands ragged_dot into a dense masked product; compile the scan over
    model_cfg = model_cfg.replace(moe_matmul="scan")  # experts, a grouped GEMM's memory (moe.grouped_matmul)
  scfg = SamplerConfig.from_tokenizer(
    _FakeTokenizer(model_cfg.vocab_size),
    max_prompt_len=spec.rollout.max_prompt_len,
    max_new_tokens=spec.rollout.max_new_tokens,
    batch_sizes=(1, spec.rollout.batch_size, spec.eval_batch_size),
    **spec.sampling.sampler_kwargs(),
  )
  if spec.multiturn is not None:
    scfg = multiturn.sampler_config(scfg, spec.rollout, spec.multiturn)
  n = spec.rollout.batch_size
  b = min(n, scfg.batch_buckets[-1])  # the sampler chunks rows beyond its largest bucket
  b = next(x for x in scfg.batch_buckets if x >= b)
  tn = next(x for x in scfg.new_token_buckets if x >= scfg.max_new_tokens)
  return Setting(name, spec, model_cfg, n, t, b, scfg.prompt_buckets[-1], tn, scfg)


def _optimizer(spec):
  return spec.optim.build(total_steps=spec.steps)  # the trainer's optimizer


def _abstract_params(model_cfg):
  from flax import nnx

  from vcpo_jax.model import transformer

  return transformer.split(nnx.eval_shape(lambda: transformer.init(model_cfg, 0)))


def _sds(shape, dtype, sharding):
  import jax

  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _mesh(shape, devices):
  from vcpo_jax import mesh as mesh_lib

  return mesh_lib.make_mesh(mesh_lib.MeshConfig(tuple(shape)), devices)


def microbatch_rows(spec, mesh, n: int) -> int:
  """Rows per micro-batch as compiled: the config's learner.microbatch_size, raised (if need be) to the
  smallest multiple of the group size G and of data x fsdp that divides N, so that each micro-batch
  has a row on every device (gsm8k's 16 rows are for its 8-device mesh; on 64 devices they would
  leave 48 idle). 0: one pass."""
  import math

  mb = spec.learner.microbatch_size or 0
  if not mb or mb >= n:
    return 0
  div = int(mesh.shape["data"] * mesh.shape["fsdp"])
  step = math.lcm(spec.rollout.group_size, div)
  rows = next((r for r in range(-(-mb // step) * step, n, step) if n % r == 0), n)
  return 0 if rows >= n else rows


def learner_config(spec, mesh, n: int, full_model_cfg=None, t: int = 0):
  """spec.learner with microbatch_size = microbatch_rows(spec, mesh, n) and the batch size n; with
  full_model_cfg (the checkpoint's depth) and t, learner.ghost_passes="auto" resolved as the trainer resolves
  it at that depth (`ghost_passes`), so 1- and 2-layer compiles run the full model's choice."""
  lc = dataclasses.replace(spec.learner, microbatch_size=microbatch_rows(spec, mesh, n), batch_size=n)
  if full_model_cfg is not None:
    lc = dataclasses.replace(lc, ghost_passes=ghost_passes(lc, full_model_cfg, mesh, n, t))
  return lc


def ghost_passes(lc, model_cfg, mesh, n: int, t: int):
  """The ghost step's passes for the learner config `lc`: its own 1 / 2, or for "auto" grad_norms.choose_passes
  on the abstract model `model_cfg` and one micro-batch [rows, t], traced under `mesh` (the per-device split)."""
  import jax

  from vcpo_jax import batch as batch_lib
  from vcpo_jax import grad_norms, learner

  if lc.ghost_passes != "auto":
    return lc.ghost_passes
  graphdef, abs_params = _abstract_params(model_cfg)
  rows = lc.microbatch_size or n
  abs_batch = {
    k: jax.ShapeDtypeStruct(s, d) for k, (d, s) in batch_lib.schema(rows, t).items() if k in batch_lib.DEVICE_KEYS
  }
  with _mesh_context(mesh):
    return grad_norms.choose_passes(
      learner.make_logp_fn(graphdef), abs_params, abs_batch, "auto", int(lc.one_pass_budget_gib * 2**30)
    )


def compile_learner(setting: Setting, model_cfg, mesh, n: int):
  """The trainer's jitted learner step, compiled on `mesh` for a batch of n rows; returns the Compiled."""
  import jax

  from vcpo_jax import batch as batch_lib
  from vcpo_jax import learner, sharding

  spec = setting.spec
  tx = _optimizer(spec)
  graphdef, abs_params = _abstract_params(model_cfg)
  abs_state = jax.eval_shape(lambda p: learner.init_state(p, tx), abs_params)
  state_sh = sharding.param_shardings(abs_state, sharding.TRANSFORMER_RULES, mesh)
  batch_sh = sharding.batch_sharding(mesh)
  t = setting.t
  # The learner's device batch, from the one Batch definition (vcpo_jax/batch.py).
  k_top = spec.learner.method.record_topk
  keys = batch_lib.DEVICE_KEYS + (tuple(batch_lib.TOPK_FIELDS) if k_top else ())
  r = spec.rollout.max_new_tokens  # the records cover the response columns only
  # MoE routing replay: the sampler's record [N, R, L K] int16 rides in the batch (and the moe/ metrics run)
  e = model_cfg.num_layers * model_cfg.num_experts_per_tok if model_cfg.moe and model_cfg.routing_replay else 0
  keys += tuple(batch_lib.ROUTING_FIELDS) if e else ()
  abs_batch = {k: _sds(s, d, batch_sh) for k, (d, s) in batch_lib.schema(n, t, k_top, r, e=e).items() if k in keys}
  # exact score centering: the behaviour version (laid out as the parameters) is an input too, as trainer.run jits it
  behaviour = (abs_state.params,) if (spec.learner.method.centering or ("",))[0] == "exact" else ()
  behaviour_sh = (state_sh.params,) if behaviour else ()
  step = jax.jit(
    learner.make_train_step(graphdef, tx, learner_config(spec, mesh, n, setting.model_cfg, setting.t)),
    in_shardings=(state_sh, batch_sh, *behaviour_sh),
    out_shardings=(state_sh, sharding.replicated(mesh)),
    donate_argnums=0,
  )
  from vcpo_jax import grad_norms

  budget = grad_norms.memory_budget(setting.norm_budget) if setting.norm_budget is not None else None
  with _mesh_context(mesh), budget or contextlib.nullcontext():
    return step.lower(abs_state, abs_batch, *behaviour).compile()


def _mesh_context(mesh):
  """`jax.set_mesh(mesh)` around tracing, as the trainer does: the model's activation constraints read it."""
  import jax

  return jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else contextlib.nullcontext()


def compile_sampler(setting: Setting, model_cfg, mesh, b: int, part: str = "sampler_decode"):
  """One sampler program of the (B, Tp, Tn) bucket, `sampler.Sampler.lower(part=...)`, compiled on `mesh`.

  sampler_prefill: the prompt bucket into a fresh KV cache of S = Tp + Tn slots (the last column's
  logits); sampler_decode: one decode step at the full cache (S slots, donated); sampler: both in one
  program as `Sampler.generate` jits it (its memory is the larger phase plus what they share). Parameters in bfloat16 when the model
  computes in bfloat16 (what `Sampler.prepare_params` keeps on accelerators, param_dtype), else
  as the config gives them.
  """
  import jax
  import jax.numpy as jnp

  from vcpo_jax import sampler

  graphdef, abs_params = _abstract_params(model_cfg)
  scfg = setting.sampler_cfg
  # The simulated devices stand for accelerators, where "auto" is bfloat16 (sampler.resolve_param_dtype).
  dt = "bfloat16" if scfg.param_dtype == "auto" else scfg.param_dtype
  dt = dt or ("bfloat16" if model_cfg.dtype == "bfloat16" else "")
  if dt:
    scfg = dataclasses.replace(scfg, param_dtype=dt)
    cast = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype)
    abs_params = jax.tree.map(cast, abs_params)
  smp = sampler.Sampler(graphdef, model_cfg, scfg, mesh=mesh)
  return smp.lower(abs_params, b, setting.sampler_tp, setting.sampler_tn, part=SAMPLER_LOWER[part]).compile()


def memory_stats(compiled) -> dict:
  """Per-device byte counts of a compiled program (see the module docstring; "widened": `widened_parameter_bytes`)."""
  m = compiled.memory_analysis()
  return {
    "argument": int(m.argument_size_in_bytes),
    "temp": int(m.temp_size_in_bytes),
    "output": int(m.output_size_in_bytes),
    "alias": int(m.alias_size_in_bytes),
    "widened": widened_parameter_bytes(compiled.as_text()),
  }


# A fusion that only converts one value to float32, and the computations that are one 16-bit -> float32 convert.
_F32_FUSION = re.compile(r"%([\w.-]+) = f32\[([\d,]*)\][^ ]* fusion\(%[\w.-]+\), kind=kLoop, calls=%([\w.-]+)")
_F32_CONVERT = re.compile(r"%([\w.-]+) = f32\[([\d,]*)\][^ ]* convert\(%([\w.-]+)\)")  # an unfused one
_CONVERT_COMPUTATION = re.compile(r"^%([\w.-]+) \(\w[\w.-]*: (?:bf16|f16)\[[\d,]*\]\) -> f32\[[\d,]*\] \{$")


def widened_parameter_bytes(hlo_text: str) -> int:
  """Bytes of the float32 copies XLA:CPU makes of whole 16-bit arrays for a loop, from the optimized HLO text.

  XLA:CPU computes 16-bit float data movement (the layer scan's dynamic-slice of a stacked weight, copies) in
  float32, and the convert of the whole stacked [L, ...] weight it inserts is loop-invariant, so it is hoisted
  out of the layer loop and stays alive through it: 2 x the weight's bytes that an accelerator program (native
  bfloat16) does not hold. Counted: converts (or fusions that are one convert) of a bf16 / f16 array to float32
  that enter a loop (an operand of a tuple of the same computation: a while loop's state), so are alive through
  it (`peak_gib - widened_gib` is the estimate for an accelerator; both are reported).
  """
  converts = {m.group(1) for m in map(_CONVERT_COMPUTATION.match, hlo_text.splitlines()) if m}
  total = 0
  for comp in re.split(r"\n(?=%|ENTRY )", hlo_text):  # one computation per block
    tuples = " ".join(line for line in comp.splitlines() if " tuple(" in line)
    for m in _F32_FUSION.finditer(comp):
      if m.group(3) in converts and re.search(rf"%{re.escape(m.group(1))}[,)]", tuples):
        total += 4 * math.prod(int(d) for d in m.group(2).split(",") if d)
    for m in _F32_CONVERT.finditer(comp):  # XLA:CPU's older emitters leave the convert unfused
      narrow = re.search(rf"%{re.escape(m.group(3))} = (?:bf16|f16)\[", comp)
      if narrow and re.search(rf"%{re.escape(m.group(1))}[,)]", tuples):
        total += 4 * math.prod(int(d) for d in m.group(2).split(",") if d)
  return total


# ----------------------------------------------------------------------------- one device count (worker)


def _compile_part(setting, part, layers, mesh, n_or_b):
  import jax

  cfg = setting.model_cfg.replace(num_layers=layers)
  t0 = time.perf_counter()
  if part == "learner":
    compiled = compile_learner(setting, cfg, mesh, n_or_b)
  else:
    compiled = compile_sampler(setting, cfg, mesh, n_or_b, part)
  stats = memory_stats(compiled)
  stats["compile_s"] = time.perf_counter() - t0
  del compiled
  jax.clear_caches()
  gc.collect()
  return stats


def _extrapolate(by_layers: dict, depth: int) -> dict:
  """Linear per-layer model through the 1- and 2-layer compiles (exact for the parameter bytes)."""
  m1, m2 = by_layers[1], by_layers[2]
  return {k: m1[k] + (depth - 1) * (m2[k] - m1[k]) for k in STAT_KEYS if k in m1}


def measure(setting: Setting, part: str, devices, layer_mode: str, sampler_mesh, tiny: Setting | None = None) -> dict:
  """One result row: compile(s) of `part` on a mesh over `devices`, bytes per device.

  layer_mode: "1,2", "full" or a layer count (see the module docstring: --layers / --sampler_layers).
  tiny: the same config at TINY_TOKENS tokens per row (for batch_gib), or None.
  """
  depth = setting.model_cfg.num_layers
  if layer_mode == "full":
    layers = [depth]
  elif layer_mode == "1,2":
    layers = [1, 2]
  else:
    layers = [int(layer_mode)]
  if part == "learner" or not sampler_mesh:
    mesh_shape = setting.spec.mesh_shape
  elif sampler_mesh == "config":  # the async sampler process's own mesh over its devices
    mesh_shape = setting.sampler_cfg.mesh_shape
  else:
    mesh_shape = sampler_mesh
  mesh = _mesh(mesh_shape, devices)
  rows = setting.n if part == "learner" else setting.sampler_b
  row = {
    "config": setting.name,
    "devices": len(devices),
    "part": part,
    "mesh": [int(mesh.shape[a]) for a in mesh.axis_names],
    "rows": rows,
    "seq_len": setting.t if part == "learner" else setting.sampler_tp + setting.sampler_tn,
    "num_layers": depth if len(layers) == 2 else layers[0],
    "layers_compiled": layers,
    "extrapolated": len(layers) == 2,
    "dtype": setting.model_cfg.dtype,
  }
  if part != "learner":
    row["prompt_len"], row["new_tokens"] = setting.sampler_tp, setting.sampler_tn
    row["prefill_chunk"] = setting.sampler_cfg.prefill_chunk  # 0: the whole prompt bucket in one pass
  else:
    row["microbatch"] = microbatch_rows(setting.spec, mesh, rows) or rows
    row["grad_telemetry"] = setting.spec.learner.grad_telemetry
    row["ghost_passes"] = learner_config(setting.spec, mesh, rows, setting.model_cfg, setting.t).ghost_passes
  by_layers = {}
  compile_s = 0.0
  for k in layers:
    by_layers[k] = _compile_part(setting, part, k, mesh, rows)
    compile_s += by_layers[k]["compile_s"]
  stats = _extrapolate(by_layers, depth) if len(layers) == 2 else by_layers[layers[0]]
  # batch-dependent temp: the same rows at a tiny sequence length. Not for the decode step: it reads the
  # cache (an argument) at one query position, so its temporaries hardly depend on T.
  if tiny is not None and part != "sampler_decode":
    if part == "learner":  # the same program at a tiny T: its ghost passes as at the real T, not re-chosen
      passes = row["ghost_passes"]
      spec = dataclasses.replace(tiny.spec, learner=dataclasses.replace(tiny.spec.learner, ghost_passes=passes))
      tiny = dataclasses.replace(tiny, spec=spec)
    small = _compile_part(tiny, part, layers[0], mesh, rows)
    compile_s += small["compile_s"]
    row["batch_gib"] = (by_layers[layers[0]]["temp"] - small["temp"]) / GIB
    row["batch_layers"] = layers[0]
    row["tiny_seq_len"] = tiny.t if part == "learner" else tiny.sampler_tp + tiny.sampler_tn
  out_new = max(stats["output"] - stats["alias"], 0)
  row["compiled_gib"] = {
    str(k): {f"{key}_gib": v[key] / GIB for key in ("argument", "temp")} for k, v in by_layers.items()
  }
  row.update(
    argument_gib=stats["argument"] / GIB,
    temp_gib=stats["temp"] / GIB,
    output_gib=out_new / GIB,
    peak_gib=(stats["argument"] + stats["temp"] + out_new) / GIB,
    widened_gib=stats.get("widened", 0) / GIB,  # part of temp: XLA:CPU's float32 copies of 16-bit parameters
    compile_s=compile_s,
  )
  budget = BUDGET_GIB.get(setting.name.partition(":")[0])
  if budget is not None:
    row["budget_gib"] = budget
    row["fits"] = bool(row["peak_gib"] <= budget)
  return row


def worker(args) -> list[dict]:
  """Every (device count, config, part) in this process: a mesh over the first n fake devices each."""
  import jax

  counts = [int(x) for x in args.devices.split(",")]
  if jax.device_count() < max(counts):
    raise SystemExit(
      f"--worker needs {max(counts)} devices but jax sees {jax.device_count()}: run without --worker (the driver "
      f"sets XLA_FLAGS=--xla_force_host_platform_device_count={max(counts)} in a subprocess)."
    )
  results = []
  overrides = _parse_overrides(args.model)
  sampler_mesh = (
    args.sampler_mesh if args.sampler_mesh in ("", "config") else tuple(map(int, args.sampler_mesh.split(",")))
  )
  for n_dev in counts:
    devices = jax.devices()[:n_dev]
    for name in args.configs.split(","):
      budget = {"norm_budget": args.norm_budget} if args.norm_budget >= 0 else {}
      setting = dataclasses.replace(
        load_setting(
          name,
          overrides,
          args.batch,
          args.prompt_len,
          args.new_tokens,
          args.score_centering,
          args.microbatch,
          not args.no_grad_telemetry,
        ),
        **budget,
      )
      if args.prefill_chunk:  # overrides the config's sampler.prefill_chunk
        scfg = dataclasses.replace(setting.sampler_cfg, prefill_chunk=args.prefill_chunk)
        setting = dataclasses.replace(setting, sampler_cfg=scfg)
      half = min(TINY_TOKENS, setting.t // 2) // 2
      tiny = (
        load_setting(
          name, overrides, args.batch, half, half, args.score_centering, args.microbatch, not args.no_grad_telemetry
        )
        if args.batch_dependent
        else None
      )
      tiny = tiny and dataclasses.replace(tiny, **budget)
      for part in args.parts.split(","):
        layers = args.layers if part == "learner" else args.sampler_layers
        print(f"[memory] {name} {part} devices={n_dev} layers={layers} ...", file=sys.stderr, flush=True)
        try:
          row = measure(setting, part, devices, layers, sampler_mesh, tiny)
        except Exception as e:  # noqa: BLE001 - one failing compile (e.g. an indivisible mesh) must not lose the others
          row = {"config": name, "devices": n_dev, "part": part, "error": f"{type(e).__name__}: {e}"[:2000]}
        print(f"[memory]   -> {json.dumps(row)}", file=sys.stderr, flush=True)
        results.append(row)
  return results


# ----------------------------------------------------------------------------- driver


def _run_workers(args, counts: list[int], passthrough: list[str]) -> list[dict]:
  """One worker subprocess with max(counts) fake devices measures every count (a mesh per count)."""
  n_dev = max(counts)
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=", "--ignored_device_count=")
    + f" --xla_force_host_platform_device_count={n_dev}"
    # XLA:CPU's default scheduler orders for concurrency and keeps rematerialized values alive, hiding
    # what remat saves; accelerator schedulers are memory-aware. Schedule for memory, as they would.
    + " --xla_cpu_enable_concurrency_optimized_scheduler=false"
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  devices = ",".join(map(str, counts))
  cmd = [sys.executable, "-m", "benchmarks.memory", "--worker", f"--devices={devices}", *passthrough]
  proc = subprocess.run(cmd, check=False, env=env, cwd=root, stdout=subprocess.PIPE, text=True, timeout=args.timeout)
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if proc.returncode or not lines:
    return [{"devices": n_dev, "error": f"worker exited with {proc.returncode}; see its stderr above"}]
  return json.loads(lines[-1])["results"]


def _fmt(x, spec=".1f"):
  return "-" if x is None else format(x, spec)


def print_table(results: list[dict]):
  head = ("config", "dev", "part", "mesh", "rows", "T", "layers", "arg", "temp", "peak", "batch@L", "budget", "fits")
  head = (*head, "f32 copies")  # widened_gib: XLA:CPU's float32 copies of 16-bit parameters (part of temp)
  print(" | ".join(head))
  print(" | ".join("---" for _ in head))
  for r in results:
    if "error" in r:
      print(f"{r.get('config', '?')} | {r['devices']} | {r.get('part', '?')} | ERROR: {r['error'][:200]}")
      continue
    layers = ",".join(map(str, r["layers_compiled"])) + (f"->{r['num_layers']}" if r["extrapolated"] else "")
    cells = (
      r["config"],
      str(r["devices"]),
      r["part"],
      "x".join(map(str, r["mesh"])),
      str(r["rows"]),
      str(r["seq_len"]),
      layers,
      _fmt(r["argument_gib"]),
      _fmt(r["temp_gib"]),
      _fmt(r["peak_gib"]),
      _fmt(r.get("batch_gib")) + (f"@{r['batch_layers']}" if "batch_layers" in r else ""),
      _fmt(r.get("budget_gib"), ".0f"),
      {True: "yes", False: "no"}.get(r.get("fits"), "-"),
      _fmt(r.get("widened_gib")),
    )
    print(" | ".join(cells))


def _git_commit() -> str:
  try:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return ""


def parser() -> argparse.ArgumentParser:
  """The command line (`main`'s flags and their defaults)."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated configs/ names")
  p.add_argument(
    "--devices", default=",".join(map(str, DEVICES)), help="fake CPU device counts (one subprocess, a mesh each)"
  )
  p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {ALL_PARTS}")
  p.add_argument(
    "--layers",
    default="full",
    help="learner: 'full' (every layer), '1,2' (extrapolate per layer: a LOWER estimate, XLA's schedule at 1-2 layers "
    "reuses buffers it cannot at depth; math on 64: 18.5 extrapolated, 40.0 compiled), or a layer count",
  )
  p.add_argument(
    "--sampler_layers",
    default="full",
    help="sampler parts: 'full' (default: their temporaries do not grow per layer), '1,2', or a layer count",
  )
  p.add_argument(
    "--sampler_mesh",
    default="",
    help="sampler mesh (data,fsdp,tensor), e.g. 1,1,4; '' = the learner's mesh.shape (sync/lag share it); "
    "'config' = the config's sampler.mesh_shape (the async sampler process's own mesh)",
  )
  p.add_argument("--model", default="", help="architecture overrides, e.g. hidden_size=64,vocab_size=512")
  p.add_argument("--batch", type=int, default=0, help="learner rows N (0 = the config's P * G)")
  p.add_argument("--prompt_len", type=int, default=0, help="max prompt length (0 = the config's)")
  p.add_argument("--new_tokens", type=int, default=0, help="response budget (0 = the config's)")
  p.add_argument(
    "--score_centering",
    default="",
    help="'exact': the method with exact score centering, in lag mode; 'topk': from the sampler's top-64 ('' = off)",
  )
  p.add_argument("--microbatch", type=int, default=0, help="learner.microbatch_size rows (0 = the config's)")
  p.add_argument("--no_grad_telemetry", action="store_true", help="learner.grad_telemetry=False (no grad/ metrics)")
  p.add_argument("--batch_dependent", action="store_true", help="also compile at TINY_TOKENS tokens per row: batch_gib")
  p.add_argument(
    "--norm_budget",
    type=int,
    default=-1,
    help="ghost-norm memory budget per device in bytes (grad_norms.memory_budget; -1: the library default)",
  )
  p.add_argument(
    "--prefill_chunk",
    type=int,
    default=0,
    help="sampler prompt tokens per prefill pass (SamplerConfig.prefill_chunk; 0: the config's sampler.prefill_chunk)",
  )
  p.add_argument("--timeout", type=float, default=3 * 3600.0, help="seconds for the worker subprocess")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  return p


def main(argv=None):
  p = parser()
  args = p.parse_args(argv)
  for part in args.parts.split(","):
    if part not in ALL_PARTS:
      p.error(f"--parts: unknown part {part!r}; choose from {ALL_PARTS}.")
  for flag in ("layers", "sampler_layers"):
    value = getattr(args, flag)
    if value not in ("1,2", "full") and not (value.isdigit() and int(value) > 0):
      p.error(f"--{flag}={value!r}: use '1,2', 'full' or a positive layer count.")
  _parse_overrides(args.model)  # fail here, not in every subprocess
  if args.worker:
    print(json.dumps({"results": worker(args)}))
    return
  passthrough = [
    f"--configs={args.configs}",
    f"--parts={args.parts}",
    f"--layers={args.layers}",
    f"--sampler_layers={args.sampler_layers}",
    f"--sampler_mesh={args.sampler_mesh}",
    f"--model={args.model}",
    f"--batch={args.batch}",
    f"--prompt_len={args.prompt_len}",
    f"--new_tokens={args.new_tokens}",
    f"--score_centering={args.score_centering}",
    f"--microbatch={args.microbatch}",
    f"--norm_budget={args.norm_budget}",
    f"--prefill_chunk={args.prefill_chunk}",
  ] + (["--batch_dependent"] if args.batch_dependent else [])
  passthrough += ["--no_grad_telemetry"] if args.no_grad_telemetry else []
  commit, date = _git_commit(), time.strftime("%Y-%m-%d")  # what is measured: the tree as the run starts
  results = _run_workers(args, [int(x) for x in args.devices.split(",")], passthrough)
  print_table(results)
  print(json.dumps({"results": results, "commit": commit, "date": date}))


if __name__ == "__main__":
  main()
