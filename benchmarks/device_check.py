"""One-command accelerator check: learner step cost and MFU, sampler throughput vs the HBM roofline, memory.

  python -m benchmarks.device_check --out=/tmp/device_check.json           # GPU (H100/H200) or one TPU host
  python -m benchmarks.device_check --tiny --out=/tmp/device_check.json    # a tiny shape (automatic on CPU)

With random weights at the Qwen2.5-1.5B shape (the architecture of configs/gsm8k.py's model.shape:
Qwen2-1.5B and Qwen2.5-1.5B share every config.json value) in bfloat16, it measures (in the order sampler,
learner, init: --parts):

  learner  the real VCPO learner step of configs/gsm8k.py (`learner.make_train_step`, jitted like the
           trainer: FSDP mesh over the local devices, state donated) and two plain yardsticks on the same
           batch: `plain_step` (value_and_grad of the plain surrogate -sum_n R_n sum_t mask logp, then the
           same optimizer update) and `plain_grad` (`learner.make_plain_grad_fn`, what the trainer's
           norm-overhead metric times), at N = 32 rows x T = 1024 tokens. Each is lowered and compiled
           (both timed: `*_lower_s`, `*_compile_s`), then timed: median of --repeats after a warm-up call;
           ratios vcpo / plain. The weights are random, drawn leaf by leaf (`random_params`: small programs,
           seconds), so that the steps are measured whatever the trainer's initializer costs.
           `mfu`: model FLOPs = 6 x N_params x tokens and XLA's count (`compiled.cost_analysis()`) per step,
           against the chip's dense bf16 peak (PEAK_BF16_FLOPS by device_kind; none for unknown chips).
           A batch that does not fit (RESOURCE_EXHAUSTED) is retried at half the rows, whole groups.
  sampler  `Sampler.generate` on one device at batch 128 and 256 (`--batches`; no EOS: every row draws all Tn
           tokens), with the weights as an async run's sampler holds them (`published_params`: the publish
           dtype, bf16 on accelerators, then the sampler's param_dtype) and the run's decode mode.
           Decode time per step = (t(Tn tokens) - t(1 token)) / (Tn - 1), same compiled bucket.
           Roofline: bytes an ideal decode step reads = the weights as held + the filled KV cache
           (2 x layers x K x H x compute-dtype bytes per token, at the mean filled length Tp + Tn / 2);
           achieved bandwidth = those bytes / step time, against the chip's nominal HBM bandwidth
           (NOMINAL_HBM_BYTES_PER_S, looked up by device_kind). Each batch's first call (its compile) is
           reported apart (`first_call_s`, `compile`).
  init     the trainer's initializer, `policy.init_sharded`, at the learner's shape and mesh: its first
           call and compile time. Last: it compiled for minutes at 28 unrolled layers, and a part cut off by
           the time limit loses only itself.
  memory   `device.memory_stats()` (peak_bytes_in_use, bytes_limit) after each part, where the backend
           reports it (GPU, TPU; not CPU).

The JSON (--out) is written at the start, after every step and part, and at the end, so a run that is killed
(a time limit) leaves what it measured. Each part runs in its own try/except: an error is recorded under
"errors" (its traceback's tail under "tracebacks") and the other parts still run. "compile_seconds" has
jax's compile time per part (tracing + lowering, XLA's backend compile; CompileClock). A time budget
(--budget_s, default 270 s) skips parts and steps not started by then, each with its reason, and a hard
limit (--limit_s, default 330 s) ends the process inside 6 minutes whatever runs (a compile cannot be cut
short): the part in progress is recorded as cut off and the JSON written. The check installs nothing. Progress goes to stderr; the JSON is also the last
stdout line.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import ClassVar

# Nominal HBM bandwidth per chip, bytes/s, by a substring of jax's device_kind (first match wins, so the
# more specific names come first). Vendor data sheets: NVIDIA H100 SXM 3.35 TB/s, H100 PCIe 2.0 TB/s,
# H100 NVL 3.9 TB/s, H200 4.8 TB/s, GH200 4.0 TB/s (HBM3), A100 80GB 2.039 TB/s, A100 40GB 1.555 TB/s,
# B200 8 TB/s, L4 0.3 TB/s; Google Cloud TPU docs: v4 1.2 TB/s, v5e 819 GB/s, v5p 2.765 TB/s,
# v6e 1.64 TB/s, v3 0.9 TB/s.
NOMINAL_HBM_BYTES_PER_S = (
  ("H100 PCIe", 2.0e12),
  ("H100 NVL", 3.9e12),
  ("GH200", 4.0e12),
  ("H100", 3.35e12),
  ("H200", 4.8e12),
  ("B200", 8.0e12),
  ("A100-SXM4-80GB", 2.039e12),
  ("A100 80GB", 2.039e12),
  ("A100", 1.555e12),
  ("L4", 0.3e12),
  ("TPU v5 lite", 0.819e12),
  ("TPU v5e", 0.819e12),
  ("TPU v5p", 2.765e12),
  ("TPU v5", 2.765e12),
  ("TPU v6 lite", 1.64e12),
  ("TPU v6e", 1.64e12),
  ("TPU v4", 1.2e12),
  ("TPU v3", 0.9e12),
)

TINY_MODEL = {
  "vocab_size": 512,
  "hidden_size": 64,
  "intermediate_size": 128,
  "num_layers": 1,
  "num_heads": 4,
  "num_kv_heads": 2,
  "head_dim": 16,
}
# (learner rows N, prompt Tp, response Tn, sampler batches, sampler Tp, sampler Tn)
FULL_SHAPE = {
  "rows": 32,
  "prompt_len": 256,
  "new_tokens": 768,
  "batches": (128, 256),  # issue 39's goal batches (--batches=32,128,256 adds the first H200 table's 32)
  "s_prompt": 128,
  "s_new": 256,
}
TINY_SHAPE = {"rows": 16, "prompt_len": 16, "new_tokens": 16, "batches": (4, 8), "s_prompt": 8, "s_new": 8}


# Dense bf16 peak FLOP/s per chip by a substring of device_kind (first match wins). NVIDIA data sheets (dense,
# without sparsity): H100 / H200 SXM 989 TFLOP/s, H100 PCIe 756, H100 NVL 835, A100 312; Google Cloud TPU
# docs: v5p 459, v5e 197, v4 275, v6e 918. Unknown chips (and CPUs) have none: no MFU is made up.
PEAK_BF16_FLOPS = (
  ("H100 PCIe", 756e12),
  ("H100 NVL", 835e12),
  ("H100", 989e12),
  ("H200", 989e12),
  ("A100", 312e12),
  ("TPU v5 lite", 197e12),
  ("TPU v5e", 197e12),
  ("TPU v5p", 459e12),
  ("TPU v5", 459e12),
  ("TPU v6 lite", 918e12),
  ("TPU v6e", 918e12),
  ("TPU v4", 275e12),
)


@dataclasses.dataclass
class Context:
  """What every part reads: the shape, the model overrides, repeats, seed, the budget and the report's save()."""

  shape: dict
  overrides: dict
  repeats: int
  seed: int
  start: float  # time.monotonic() at the start
  budget_s: float
  save: Callable[[], None]
  decode_layers: str = ""  # the sampler's SamplerConfig.decode_layers ("": the run's)

  @property
  def deadline(self) -> float:
    return self.start + self.budget_s


def peak_bf16_flops(device_kind: str) -> float | None:
  """Dense bf16 FLOP/s of one chip of this device_kind, or None if unknown (CPU, other chips)."""
  for key, flops in PEAK_BF16_FLOPS:
    if key.lower() in device_kind.lower():
      return flops
  return None


def nominal_bandwidth(device_kind: str) -> float | None:
  """Nominal HBM bytes/s of one chip of this device_kind, or None if unknown (CPU, other chips)."""
  for key, bw in NOMINAL_HBM_BYTES_PER_S:
    if key.lower() in device_kind.lower():
      return bw
  return None


def decode_bytes(model_cfg, batch: int, filled: float, weight_bytes: int | None = None) -> dict:
  """Bytes an ideal decode step reads: every weight once + the filled part of every row's KV cache.

  weights = weight_bytes (the parameters as the sampler holds them), default num_params x bytes(compute dtype);
  kv      = batch x filled x layers x 2 (k and v) x K x H x bytes(compute dtype).
  """
  import numpy as np

  itemsize = np.dtype(model_cfg.compute_dtype).itemsize
  weights = model_cfg.num_params * itemsize if weight_bytes is None else weight_bytes
  kv = batch * filled * model_cfg.num_layers * 2 * model_cfg.num_kv_heads * model_cfg.head_dim * itemsize
  return {"weight_bytes": int(weights), "kv_bytes": float(kv), "total_bytes": float(weights + kv)}


def run_part(name: str, fn, report: dict, deadline: float, save=None):
  """Runs fn(out) into report[name] = out; an exception is recorded, not raised; `save()` after it either way.

  `out` is the part's dict, filled as the part goes (a part that fails or is killed keeps what it measured),
  and fn may also return a dict merged into it. An exception goes to report["errors"][name] (type and message)
  and report["tracebacks"][name] (the traceback's tail). report["part_seconds"][name] is the part's wall time,
  report["compile_seconds"][name] what jax spent compiling during it (CompileClock). A part not started by
  `deadline` (time.monotonic()) is skipped with the reason in report["errors"].
  """
  save = save or (lambda: None)
  if time.monotonic() > deadline:
    report["errors"][name] = "skipped: the time budget (--budget_s) was spent before this part started"
    _log(f"{name}: skipped (budget)")
    save()
    return None
  _log(f"{name}: start")
  t0 = time.monotonic()
  report["running"] = [name, t0]  # what Watchdog records as cut off if the hard limit passes during it
  out = report[name] = {}
  clock = CompileClock()
  try:
    with clock:
      got = fn(out)
    if got is not None:
      out.update(got)
  except Exception as e:  # noqa: BLE001 - one failing part must not lose the others
    report["errors"][name] = f"{type(e).__name__}: {e}"[:4000]
    report.setdefault("tracebacks", {})[name] = traceback.format_exc()[-4000:]
    _log(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
    if not out:
      del report[name]
    return None
  finally:
    report.pop("running", None)
    report.setdefault("part_seconds", {})[name] = time.monotonic() - t0
    report.setdefault("compile_seconds", {})[name] = clock.summary()
    gc.collect()
    save()
  _log(f"{name}: done in {time.monotonic() - t0:.1f} s")
  return out


class CompileClock:
  """Seconds jax spends compiling while it is entered (jax.monitoring's compile events, every program:
  initializers, casts and the sampler's internal jits too): tracing + lowering to StableHLO, and XLA's
  backend compile (which a persistent-cache hit replaces by a load)."""

  _active: ClassVar[list] = []  # the clocks entered now (nested: a part's and a step's)
  _registered: ClassVar[bool] = False

  def __init__(self):
    self.trace_lower_s = self.backend_s = 0.0
    self.programs = 0

  @classmethod
  def _listen(cls, event: str, secs: float, **_):
    for c in cls._active:
      if event == "/jax/core/compile/backend_compile_duration":
        c.backend_s += secs
        c.programs += 1
      elif event in ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration"):
        c.trace_lower_s += secs

  def __enter__(self):
    from jax import monitoring

    if not CompileClock._registered:
      monitoring.register_event_duration_secs_listener(CompileClock._listen)
      CompileClock._registered = True
    CompileClock._active.append(self)
    return self

  def __exit__(self, *exc):
    CompileClock._active.remove(self)

  def summary(self) -> dict:
    return {
      "backend_compile_s": self.backend_s,
      "trace_and_lower_s": self.trace_lower_s,
      "programs_compiled": self.programs,
    }


def _log(msg: str):
  print(f"[device_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _memory(devices) -> list[dict]:
  out = []
  for d in devices:
    try:
      s = d.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats raise or return None
      s = {}
    out.append({k: s.get(k) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")} | {"id": d.id})
  return out


def _time(fn, repeats: int) -> tuple[float, list[float], float]:
  """(median seconds, all times, first-call seconds incl. compile) of fn() (fn blocks until ready)."""
  t0 = time.perf_counter()
  fn()
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times, first


def _is_oom(e: Exception) -> bool:
  s = str(e)
  return "RESOURCE_EXHAUSTED" in s or "Out of memory" in s or "out of memory" in s


# ----------------------------------------------------------------------------- learner


def learner_part(ctx: Context, out: dict) -> None:
  """VCPO step vs plain steps on one batch, their compile times and MFU; halves the rows on OOM (down to one
  group, until 60% of the budget is spent)."""
  from benchmarks import memory

  rows = ctx.shape["rows"]
  out["oom_retries"] = []
  retry_until = ctx.start + 0.6 * ctx.budget_s
  while True:
    try:
      return _learner_once(ctx, memory, rows, out)
    except Exception as e:
      group = memory.load_setting("gsm8k", ctx.overrides).spec.rollout.group_size
      if not _is_oom(e) or rows // 2 < group or time.monotonic() > retry_until:
        raise
      out["oom_retries"].append({"rows": rows, "error": str(e)[:500]})
      _log(f"learner: out of memory at N={rows}; retrying at N={rows // 2}")
      rows //= 2
      gc.collect()


def _batch(n: int, tp: int, tn: int, group: int, vocab: int, seed: int) -> dict:
  """A learner batch like the rollout's: left-padded prompts, right-padded responses, off-policy log-probs."""
  import numpy as np

  rng = np.random.default_rng(seed)
  t = tp + tn
  plen = rng.integers(tp // 2, tp + 1, n)
  rlen = rng.integers(tn // 2, tn + 1, n)
  col = np.arange(t)[None, :]
  prompt = (col >= tp - plen[:, None]) & (col < tp)
  resp = (col >= tp) & (col < tp + rlen[:, None])
  valid = prompt | resp
  behavior = np.where(resp, -rng.gamma(2.0, 1.0, (n, t)), 0.0).astype(np.float32)  # log mu < 0
  return {
    "tokens": np.where(valid, rng.integers(0, vocab, (n, t)), 0).astype(np.int32),
    "valid_mask": valid,
    "loss_mask": resp,
    "behavior_logp": behavior,
    "rewards": rng.integers(0, 2, n).astype(np.float32),
    "group_id": np.repeat(np.arange(n // group), group).astype(np.int32),
  }


def _learner_setup(ctx: Context, memory, rows: int, out: dict):
  """(setting, mesh, tx, graphdef, state, state_sh, batch_sh, batch): the trainer's layout, timed into `out`."""
  import jax

  from vcpo_jax import learner, sharding
  from vcpo_jax import mesh as mesh_lib

  shape = ctx.shape
  setting = memory.load_setting("gsm8k", ctx.overrides, rows, shape["prompt_len"], shape["new_tokens"])
  spec, cfg = setting.spec, setting.model_cfg
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(spec.mesh_shape), jax.local_devices())
  out.update(rows=rows, seq_len=setting.t, mesh=list(mesh.devices.shape), num_params=cfg.num_params)
  out["num_layers"] = cfg.num_layers
  tx = memory._optimizer(spec)
  t0 = time.perf_counter()
  with CompileClock() as clock:
    graphdef, params = random_params(cfg, mesh, ctx.seed)
    jax.block_until_ready(params)
  out["random_params_s"], out["random_params_compile"] = time.perf_counter() - t0, clock.summary()
  state_sh = sharding.param_shardings(
    jax.eval_shape(lambda p: learner.init_state(p, tx), params), sharding.TRANSFORMER_RULES, mesh
  )
  state = jax.jit(lambda p: learner.init_state(p, tx), out_shardings=state_sh)(params)
  del params
  batch_sh = sharding.batch_sharding(mesh)
  host = _batch(rows, shape["prompt_len"], shape["new_tokens"], spec.rollout.group_size, cfg.vocab_size, ctx.seed)
  batch = jax.device_put(host, batch_sh)
  ctx.save()
  return setting, mesh, tx, graphdef, state, state_sh, batch_sh, batch


def _draw(kind: str, shape: tuple, dtype, std: float, key):
  import jax
  import jax.numpy as jnp

  if kind == "normal":
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
  return (jnp.ones if kind == "ones" else jnp.zeros)(shape, dtype)


def random_params(cfg, mesh, seed: int, std: float = 0.02):
  """(graphdef, params): the model's parameters at their shapes and the trainer's shardings, drawn leaf by leaf
  with one small program per distinct (kind, shape, dtype, sharding), never one program for the whole model.

  Timing a step needs no particular values: RMSNorm scales are ones, biases zeros, every other weight
  N(0, std^2). (`policy.init_sharded`, the trainer's initializer, is timed by the "init" part.)
  """
  import jax

  from benchmarks import memory
  from vcpo_jax import sharding

  graphdef, abstract = memory._abstract_params(cfg)
  shardings = sharding.param_shardings(abstract, sharding.TRANSFORMER_RULES, mesh)
  programs, key, count = {}, jax.random.key(seed), [0]

  def make(path, x, sh):
    name = sharding.path_str(path)
    kind = "ones" if name.endswith("scale") else "zeros" if name.endswith("bias") else "normal"
    k = (kind, tuple(x.shape), str(x.dtype), sh)
    if k not in programs:
      programs[k] = jax.jit(functools.partial(_draw, kind, tuple(x.shape), x.dtype, std), out_shardings=sh)
    count[0] += 1
    return programs[k](jax.random.fold_in(key, count[0]))

  return graphdef, jax.tree_util.tree_map_with_path(make, abstract, shardings)


def init_part(ctx: Context, out: dict) -> None:
  """The trainer's initializer (`policy.init_sharded`, jitted with out_shardings) at the learner's shape and
  mesh: first call (compile + run) and its compile time. Last by default: it compiled for minutes at 28 layers
  when every layer was its own code, and a part killed at the time limit loses only itself."""
  import jax

  from benchmarks import memory
  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax.model import policy

  setting = memory.load_setting("gsm8k", ctx.overrides, ctx.shape["rows"])
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(setting.spec.mesh_shape), jax.local_devices())
  out.update(num_layers=setting.model_cfg.num_layers, mesh=list(mesh.devices.shape))
  t0 = time.perf_counter()
  with CompileClock() as clock:
    _, params = policy.init_sharded(setting.model_cfg, ctx.seed, mesh)
    jax.block_until_ready(params)
  out["first_call_s"], out["compile"] = time.perf_counter() - t0, clock.summary()


def _learner_steps(setting, mesh, tx, graphdef, state_sh, batch_sh) -> dict:
  """{name: (jitted, donates the state)}: the trainer's VCPO step and the two plain yardsticks."""
  import jax
  import jax.numpy as jnp
  import optax

  from vcpo_jax import learner, sharding

  vcpo = sharding.MeshJit(
    mesh,
    learner.make_train_step(graphdef, tx, setting.spec.learner),
    in_shardings=(state_sh, batch_sh),
    out_shardings=(state_sh, sharding.replicated(mesh)),
    donate_argnums=0,
  )
  logp_fn = learner.make_logp_fn(graphdef)

  def plain_train_step(st, b):
    def loss(p):
      return -jnp.sum(b["rewards"][:, None] * b["loss_mask"] * logp_fn(p, b))

    value, grads = jax.value_and_grad(loss)(st.params)
    updates, opt = tx.update(grads, st.opt_state, st.params)
    return learner.TrainState(optax.apply_updates(st.params, updates), opt, st.step + 1), value

  plain = sharding.MeshJit(
    mesh,
    plain_train_step,
    in_shardings=(state_sh, batch_sh),
    out_shardings=(state_sh, sharding.replicated(mesh)),
    donate_argnums=0,
  )
  plain_grad = sharding.MeshJit(mesh, learner.make_plain_grad_fn(graphdef), in_shardings=(state_sh.params, batch_sh))
  return {"vcpo": (vcpo, True), "plain_step": (plain, True), "plain_grad": (plain_grad, False)}


def _measure_step(name: str, jitted, donates: bool, holder: dict, batch, repeats: int, out: dict):
  """Lowers and compiles `jitted` (each timed), reads XLA's flop count, then times `repeats` steady calls."""
  import jax

  args = lambda: (holder["state"], batch) if donates else (holder["state"].params, batch)
  t0 = time.perf_counter()
  lowered = jitted.lower(*args())
  t1 = time.perf_counter()
  compiled = lowered.compile()
  out[f"{name}_lower_s"], out[f"{name}_compile_s"] = t1 - t0, time.perf_counter() - t1
  out[f"{name}_xla_flops"] = xla_flops(compiled)

  def call():
    got = compiled(*args())
    if donates:
      holder["state"], got = got
    jax.block_until_ready((holder["state"], got))
    return got

  med, times, first = _time(call, repeats)
  out[f"{name}_s"], out[f"{name}_times_s"], out[f"{name}_first_call_s"] = med, times, first
  return call


def _learner_once(ctx: Context, memory, rows: int, out: dict) -> None:
  import jax

  setting, mesh, tx, graphdef, state, state_sh, batch_sh, batch = _learner_setup(ctx, memory, rows, out)
  steps = _learner_steps(setting, mesh, tx, graphdef, state_sh, batch_sh)
  holder = {"state": state}
  del state
  calls = {}
  with memory._mesh_context(mesh):  # traced under the mesh, as the trainer does (activation constraints)
    for name, (jitted, donates) in steps.items():
      if time.monotonic() > ctx.deadline:
        out.setdefault("skipped", {})[name] = "the time budget (--budget_s) was spent before this step"
        continue
      _log(f"learner: compiling and timing {name} (N={rows}, T={setting.t})")
      calls[name] = _measure_step(name, jitted, donates, holder, batch, ctx.repeats, out)
      ctx.save()
  if "vcpo" in calls:
    out["vcpo_metrics"] = {k: float(v) for k, v in jax.device_get(calls["vcpo"]()).items()}
  for plain in ("plain_step", "plain_grad"):
    if "vcpo_s" in out and f"{plain}_s" in out:
      out[f"ratio_vcpo_over_{plain}"] = out["vcpo_s"] / out[f"{plain}_s"]
  out["mfu"] = mfu_report(out, rows * setting.t, jax.local_devices()[0].device_kind, mesh.devices.size)
  out["memory_after"] = _memory(list(mesh.devices.flat))


def xla_flops(compiled) -> float | None:
  """XLA's flop count of one call of a compiled program (per device for an SPMD program), or None."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 - a backend without cost analysis
    return None
  if isinstance(cost, (list, tuple)):  # older jax: one dict per device program
    cost = cost[0] if cost else {}
  flops = (cost or {}).get("flops")
  return float(flops) if flops is not None and flops > 0 else None


def mfu_report(out: dict, tokens: int, device_kind: str, devices: int) -> dict:
  """Model FLOPs utilization of the measured steps against the chip's dense bf16 peak.

  Model FLOPs of a step = 6 x N_params x tokens (forward 2, backward 4 per parameter and token; tokens = rows x
  T, every position the step computes, padding included), and XLA's own count (cost_analysis, per device,
  x devices), which adds attention and everything else the program does (VCPO's extra passes included).
  mfu = model FLOPs / (step seconds x devices x peak); xla_utilization the same with XLA's count.
  """
  peak = peak_bf16_flops(device_kind)
  model = 6.0 * out["num_params"] * tokens
  rep = {"tokens": tokens, "model_flops_6nd": model, "devices": devices, "peak_bf16_flops_per_device": peak}
  for name in ("vcpo", "plain_step", "plain_grad"):
    step_s, per_dev = out.get(f"{name}_s"), out.get(f"{name}_xla_flops")
    if step_s is None:
      continue
    xla = per_dev * devices if per_dev else None
    total_peak = peak * devices if peak else None
    rep[name] = {
      "step_s": step_s,
      "xla_flops": xla,
      "xla_over_6nd": xla / model if xla else None,
      "model_flops_per_s": model / step_s,
      "mfu": model / step_s / total_peak if total_peak else None,
      "xla_utilization": xla / step_s / total_peak if total_peak and xla else None,
    }
  if "vcpo" in rep and "plain_step" in rep:
    rep["vcpo_step_over_plain_step"] = rep["vcpo"]["step_s"] / rep["plain_step"]["step_s"]
  return rep


# ----------------------------------------------------------------------------- sampler


def _sampler_config(setting, tp: int, tn: int, batches: tuple, decode_layers: str = ""):
  """The run's sampler config (its param_dtype, the async sampler's decode mode) with one (B, Tp, Tn) bucket
  per batch and no stop token, so that every row draws all Tn tokens; decode_layers: "" keeps the run's."""
  a = setting.spec.async_
  kw = {} if a.decode == "static" else {"decode": a.decode, "chunk_tokens": a.chunk_tokens}
  if decode_layers:
    kw["decode_layers"] = decode_layers
  return dataclasses.replace(
    setting.sampler_cfg,
    eos_id=None,
    stop_ids=(),
    max_new_tokens=tn,
    prompt_buckets=(tp,),
    new_token_buckets=(tn,),
    batch_buckets=batches,
    max_batch=0,
    record_topk=0,
    **kw,
  )


def published_params(params, sampler, publish_dtype):
  """The parameters as an async run's sampler holds them: floating leaves in the publish dtype (the slot's
  arrays, async_.resolve_publish_dtype: bf16 on accelerators), loaded as worker._load does (into the sampler's
  param_dtype where it has one, else the model's dtype) and `Sampler.prepare_params` (cast, placed)."""
  import jax
  import jax.numpy as jnp

  def load(x):
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    slot = x.astype(publish_dtype) if floating else x
    to = sampler.param_dtype if sampler.param_dtype is not None and floating else x.dtype
    return jnp.asarray(slot, dtype=to)

  return sampler.prepare_params(jax.tree.map(load, params))


def sampler_part(ctx: Context, out: dict) -> None:
  """Sampler.generate tokens/s per batch and its decode step against the HBM roofline, on one device."""
  import jax
  import numpy as np

  from benchmarks import memory
  from vcpo_jax.rollout.async_ import resolve_publish_dtype
  from vcpo_jax.sampler import Sampler, sampler_mesh, unrolled_decode

  setting = memory.load_setting("gsm8k", ctx.overrides)
  cfg = setting.model_cfg
  tp, tn, batches = ctx.shape["s_prompt"], ctx.shape["s_new"], tuple(ctx.shape["batches"])
  cfg = cfg.replace(max_position=max(cfg.max_position, tp + tn))
  device = jax.local_devices()[0]
  scfg = _sampler_config(setting, tp, tn, batches, ctx.decode_layers)
  graphdef, params = random_params(cfg, sampler_mesh(scfg, devices=[device]), ctx.seed)
  sampler = Sampler(graphdef, cfg, scfg, mesh=sampler_mesh(scfg, devices=[device]))  # as the worker builds it
  publish = resolve_publish_dtype(setting.spec.async_.publish_dtype, device.platform)
  params = published_params(params, sampler, publish)
  bw = nominal_bandwidth(device.device_kind)
  out.update(
    device_kind=device.device_kind,
    nominal_hbm_bytes_per_s=bw,
    publish_dtype=str(publish),
    sampler_param_dtype=scfg.param_dtype,
    params_dtype_as_passed=str(jax.tree.leaves(params)[0].dtype),
    decode=scfg.decode,
    decode_layers="unrolled" if unrolled_decode(scfg, cfg) else "scan",
    batches=[],
  )
  rng = np.random.default_rng(ctx.seed)
  for b in batches:
    if time.monotonic() > ctx.deadline:
      out.setdefault("skipped", {})[str(b)] = "the time budget (--budget_s) was spent before this batch"
      continue
    prompts = [list(rng.integers(1, cfg.vocab_size, tp)) for _ in range(b)]
    _log(f"sampler: batch {b}, Tp={tp}, Tn={tn}")
    out["batches"].append(_sampler_row(sampler, params, prompts, cfg, tp, tn, ctx, bw))
    ctx.save()
  out["memory_after"] = _memory([device])


def _sampler_row(sampler, params, prompts, cfg, tp: int, tn: int, ctx: Context, bw) -> dict:
  import jax

  b = len(prompts)
  gen = functools.partial(sampler.generate, params, prompts, jax.random.key(ctx.seed))
  with CompileClock() as clock:  # the first call compiles the bucket (prefill + decode loop)
    t0 = time.perf_counter()
    gen(max_new_tokens=tn)
    first = time.perf_counter() - t0
  full, full_times, _ = _time(functools.partial(gen, max_new_tokens=tn), ctx.repeats)
  one, _, _ = _time(functools.partial(gen, max_new_tokens=1), ctx.repeats)
  step_s = (full - one) / (tn - 1)  # <= 0 only where the whole call is noise (tiny shapes on CPU)
  need = decode_bytes(cfg, b, tp + tn / 2, sum(x.nbytes for x in jax.tree.leaves(params)))
  row = {
    "batch": b,
    "prompt_len": tp,
    "new_tokens": tn,
    "first_call_s": first,
    "compile": clock.summary(),
    "generate_s": full,
    "generate_times_s": full_times,
    "prefill_plus_one_token_s": one,
    "decode_step_s": step_s if step_s > 0 else None,
    "tokens_per_s": b * tn / full,
    **need,
  }
  if step_s <= 0:
    row["note"] = "t(Tn tokens) <= t(1 token): the decode steps are within the timing noise; no step figures"
    return row
  row.update(decode_tokens_per_s=b / step_s, achieved_bytes_per_s=need["total_bytes"] / step_s)
  if bw:
    row["roofline_fraction"] = row["achieved_bytes_per_s"] / bw
    row["roofline_decode_tokens_per_s"] = b * bw / need["total_bytes"]
  return row


# ----------------------------------------------------------------------------- main

# In this order by default: the sampler (the run's wall clock) first, then the learner's steps, then the
# trainer's initializer, so that the budget cuts the least informative part.
PARTS = {"sampler": sampler_part, "learner": learner_part, "init": init_part}


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="path of the JSON report (written after every part and step)")
  p.add_argument("--tiny", action="store_true", help="tiny shape (default on CPU)")
  p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (after one warm-up call)")
  p.add_argument("--rows", type=int, default=0, help="learner rows N (0 = 32, tiny 16); whole groups of 8")
  p.add_argument("--batches", default="", help="sampler batches, e.g. 32,128,256 ('' = 128,256)")
  p.add_argument("--parts", default=",".join(PARTS), help=f"which parts to run, in order, of {','.join(PARTS)}")
  p.add_argument(
    "--budget_s",
    "--deadline_s",
    type=float,
    default=270.0,
    help="time budget: a part or step not started after this many seconds is skipped, with the reason",
  )
  p.add_argument(
    "--limit_s",
    type=float,
    default=330.0,
    help="hard limit: the process ends at this many seconds, the part in progress recorded as cut off",
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--decode_layers",
    default="",
    help="the sampler part's SamplerConfig.decode_layers (scan | unrolled | auto; '' = the run's)",
  )
  return p


def _report(args, argv, devices, tiny: bool, shape: dict, overrides: dict) -> dict:
  import jax

  from benchmarks import memory

  kind = devices[0].device_kind
  return {
    "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    "commit": memory._git_commit(),
    "command": " ".join(["python -m benchmarks.device_check", *(sys.argv[1:] if argv is None else argv)]),
    "jax_version": jax.__version__,
    "platform": devices[0].platform,
    "device_kind": kind,
    "num_local_devices": len(devices),
    "nominal_hbm_bytes_per_s": nominal_bandwidth(kind),
    "peak_bf16_flops_per_device": peak_bf16_flops(kind),
    "tiny": tiny,
    "budget_s": args.budget_s,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "shape": {**shape, "model": "tiny" if tiny else "Qwen2.5-1.5B (= configs/gsm8k.py model.shape)", **overrides},
    "errors": {},
  }


_WRITE_LOCK = threading.Lock()


def _write(report: dict, path: str, t_start: float):
  """The report so far, atomically (a reader or a kill mid-write never sees half a file)."""
  with _WRITE_LOCK:
    report["elapsed_s"] = time.monotonic() - t_start
    text = json.dumps(report, indent=1, default=str)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
      f.write(text)
    os.replace(tmp, path)
  return text


class Watchdog:
  """Ends the process at `limit_s` after `t_start`, whatever runs: the part in progress (a compile cannot be
  interrupted) is recorded as cut off, the JSON written and printed, exit code 0 as for any failed part."""

  def __init__(self, limit_s: float, t_start: float, report: dict, save):
    self.limit_s, self.t_start, self.report, self.save = limit_s, t_start, report, save
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._run, name="device-check-watchdog", daemon=True)

  def start(self):
    self._thread.start()
    return self

  def stop(self):
    self._done.set()

  def _run(self):
    if self._done.wait(max(0.0, self.t_start + self.limit_s - time.monotonic())):
      return
    running = self.report.get("running")
    if running:
      name, t0 = running
      self.report["errors"][name] = f"cut off: the hard time limit (--limit_s={self.limit_s:g}) passed during this part"
      self.report.setdefault("part_seconds", {})[name] = time.monotonic() - t0
    _log(f"hard limit of {self.limit_s:g} s: {running[0] if running else 'no part'} cut off; writing the report")
    for _ in range(3):  # the main thread may be between two of its own writes into the report
      try:
        text = self.save()
        break
      except RuntimeError:
        time.sleep(0.05)
    else:
      text = "{}"
    print(text.replace("\n", " "), flush=True)
    sys.stderr.flush()
    os._exit(0)


def main(argv=None):
  p = _parser()
  args = p.parse_args(argv)
  t_start = time.monotonic()
  if args.repeats < 1:
    p.error(f"--repeats={args.repeats}: must be >= 1.")
  parts = [x for x in args.parts.split(",") if x]
  for x in parts:
    if x not in PARTS:
      p.error(f"--parts: unknown part {x!r}; choose from {', '.join(PARTS)}.")
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

  import jax

  devices = jax.local_devices()
  tiny = args.tiny or devices[0].platform == "cpu"
  shape = dict(TINY_SHAPE if tiny else FULL_SHAPE)
  if args.rows:
    shape["rows"] = args.rows
  if args.batches:
    shape["batches"] = tuple(int(x) for x in args.batches.split(","))
  overrides = dict(TINY_MODEL) if tiny else {}
  report = _report(args, argv, devices, tiny, shape, overrides)
  save = functools.partial(_write, report, args.out, t_start)
  save()  # a run killed during its first compile still leaves a file
  watchdog = Watchdog(args.limit_s, t_start, report, save).start()
  _log(f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform}); tiny={tiny}; shape {shape}")
  ctx = Context(shape, overrides, args.repeats, args.seed, t_start, args.budget_s, save, args.decode_layers)
  for name in parts:
    run_part(name, functools.partial(PARTS[name], ctx), report, ctx.deadline, save)
  report["memory"] = _memory(devices)
  watchdog.stop()
  save()
  _log(f"wrote {args.out} in {report['elapsed_s']:.0f} s; errors: {sorted(report['errors']) or 'none'}")
  print(json.dumps(report, default=str))


if __name__ == "__main__":
  main()
