"""One-command accelerator check: learner step cost, sampler throughput vs the HBM roofline, peak memory.

  python -m benchmarks.device_check --out=/tmp/device_check.json           # GPU (H100/H200) or one TPU host
  python -m benchmarks.device_check --tiny --out=/tmp/device_check.json    # a tiny shape (automatic on CPU)

With random weights at the Qwen2.5-1.5B shape (the architecture of configs/gsm8k.py's model.shape:
Qwen2-1.5B and Qwen2.5-1.5B share every config.json value) in bfloat16, it measures, in this order:

  learner  the real VCPO learner step of configs/gsm8k.py (`learner.make_train_step`, jitted like the
           trainer: FSDP mesh over the local devices, state donated) and two plain yardsticks on the same
           batch: `plain_step` (value_and_grad of the plain surrogate -sum_n R_n sum_t mask logp, then the
           same optimizer update) and `plain_grad` (`learner.make_plain_grad_fn`, what the trainer's
           norm-overhead metric times). Median of --repeats after a compile call; ratios vcpo / plain.
           A batch that does not fit (RESOURCE_EXHAUSTED) is retried at half the rows, whole groups.
  sampler  `Sampler.generate` on one device at batch 64, 128, 256 (no EOS: every row draws all Tn
           tokens). Decode time per step = (t(Tn tokens) - t(1 token)) / (Tn - 1), same compiled bucket.
           Roofline: bytes an ideal decode step reads = weights in the compute dtype + the filled KV cache
           (2 x layers x K x H x compute-dtype bytes per token, at the mean filled length Tp + Tn / 2);
           achieved bandwidth = those bytes / step time, against the chip's nominal HBM bandwidth
           (NOMINAL_HBM_BYTES_PER_S, looked up by device_kind).
  memory   `device.memory_stats()` (peak_bytes_in_use, bytes_limit) after each part, where the backend
           reports it (GPU, TPU; not CPU).

Each part runs in its own try/except: an error is recorded in the JSON under "errors" and the other
parts still run. A deadline (--deadline_s, default 420 s, the check must finish in under 8 minutes)
skips parts not yet started. Progress goes to stderr; the JSON file (--out) is also the last stdout line.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
import traceback

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
  "batches": (64, 128, 256),
  "s_prompt": 128,
  "s_new": 256,
}
TINY_SHAPE = {"rows": 16, "prompt_len": 16, "new_tokens": 16, "batches": (4, 8), "s_prompt": 8, "s_new": 8}


def nominal_bandwidth(device_kind: str) -> float | None:
  """Nominal HBM bytes/s of one chip of this device_kind, or None if unknown (CPU, other chips)."""
  for key, bw in NOMINAL_HBM_BYTES_PER_S:
    if key.lower() in device_kind.lower():
      return bw
  return None


def decode_bytes(model_cfg, batch: int, filled: float) -> dict:
  """Bytes an ideal decode step reads: every weight once + the filled part of every row's KV cache.

  weights = num_params x bytes(compute dtype) (a bf16 sampler reads bf16 weights);
  kv      = batch x filled x layers x 2 (k and v) x K x H x bytes(compute dtype).
  """
  import numpy as np

  itemsize = np.dtype(model_cfg.compute_dtype).itemsize
  weights = model_cfg.num_params * itemsize
  kv = batch * filled * model_cfg.num_layers * 2 * model_cfg.num_kv_heads * model_cfg.head_dim * itemsize
  return {"weight_bytes": int(weights), "kv_bytes": float(kv), "total_bytes": float(weights + kv)}


def run_part(name: str, fn, report: dict, deadline: float):
  """Runs fn() -> dict into report[name]; an exception is recorded in report['errors'][name], not raised."""
  if time.monotonic() > deadline:
    report["errors"][name] = "skipped: the deadline (--deadline_s) passed before this part started"
    _log(f"{name}: skipped (deadline)")
    return None
  _log(f"{name}: start")
  t0 = time.monotonic()
  try:
    out = fn()
  except Exception as e:  # noqa: BLE001 - one failing part must not lose the others
    report["errors"][name] = f"{type(e).__name__}: {e}"[:4000]
    report.setdefault("tracebacks", {})[name] = traceback.format_exc()[-4000:]
    _log(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
    return None
  finally:
    report.setdefault("part_seconds", {})[name] = time.monotonic() - t0
    gc.collect()
  report[name] = out
  _log(f"{name}: done in {time.monotonic() - t0:.1f} s")
  return out


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


def learner_part(model_overrides: dict, shape: dict, repeats: int, seed: int, retry_until: float) -> dict:
  """VCPO step vs plain steps on one batch; halves the rows on OOM (down to one group, until retry_until)."""
  from benchmarks import memory

  rows = shape["rows"]
  attempts = []
  while True:
    try:
      out = _learner_once(memory, model_overrides, shape, rows, repeats, seed)
      out["oom_retries"] = attempts
      return out
    except Exception as e:
      group = memory.load_setting("gsm8k", model_overrides).spec.rollout.group_size
      if not _is_oom(e) or rows // 2 < group or time.monotonic() > retry_until:
        raise
      attempts.append({"rows": rows, "error": str(e)[:500]})
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


def _learner_once(memory, model_overrides, shape, rows, repeats, seed) -> dict:
  import jax
  import jax.numpy as jnp
  import optax

  from vcpo_jax import learner, sharding
  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax.model import policy

  setting = memory.load_setting("gsm8k", model_overrides, rows, shape["prompt_len"], shape["new_tokens"])
  spec, cfg = setting.spec, setting.model_cfg
  devices = jax.local_devices()
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(spec.mesh_shape), devices)
  tx = memory._optimizer(spec)
  graphdef, params = policy.init_sharded(cfg, seed, mesh)
  state_sh = sharding.param_shardings(
    jax.eval_shape(lambda p: learner.init_state(p, tx), params), sharding.TRANSFORMER_RULES, mesh
  )
  state = jax.jit(lambda p: learner.init_state(p, tx), out_shardings=state_sh)(params)
  del params
  batch_sh = sharding.batch_sharding(mesh)
  host = _batch(rows, shape["prompt_len"], shape["new_tokens"], spec.rollout.group_size, cfg.vocab_size, seed)
  batch = jax.device_put(host, batch_sh)
  vcpo = sharding.MeshJit(
    mesh,
    learner.make_train_step(graphdef, tx, spec.learner),
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

  plain = jax.jit(
    plain_train_step,
    in_shardings=(state_sh, batch_sh),
    out_shardings=(state_sh, sharding.replicated(mesh)),
    donate_argnums=0,
  )
  plain_grad = jax.jit(learner.make_plain_grad_fn(graphdef), in_shardings=(state_sh.params, batch_sh))
  holder = {"state": state}

  def run_step(step):
    def go():
      holder["state"], m = step(holder["state"], batch)
      jax.block_until_ready((holder["state"], m))
      return m

    return go

  out = {"rows": rows, "seq_len": setting.t, "mesh": list(mesh.devices.shape), "num_params": cfg.num_params}
  with memory._mesh_context(mesh):  # traced under the mesh, as the trainer does (activation constraints)
    for name, fn in (
      ("vcpo", run_step(vcpo)),
      ("plain_step", run_step(plain)),
      ("plain_grad", lambda: jax.block_until_ready(plain_grad(holder["state"].params, batch))),
    ):
      _log(f"learner: compiling and timing {name} (N={rows}, T={setting.t})")
      med, times, first = _time(fn, repeats)
      out[f"{name}_s"], out[f"{name}_times_s"], out[f"{name}_first_call_s"] = med, times, first
    metrics = jax.device_get(run_step(vcpo)())
  out["vcpo_metrics"] = {k: float(v) for k, v in metrics.items()}
  out["ratio_vcpo_over_plain_step"] = out["vcpo_s"] / out["plain_step_s"]
  out["ratio_vcpo_over_plain_grad"] = out["vcpo_s"] / out["plain_grad_s"]
  out["memory_after"] = _memory(devices)
  return out


# ----------------------------------------------------------------------------- sampler


def sampler_part(model_overrides: dict, shape: dict, repeats: int, seed: int) -> dict:
  """Sampler.generate tokens/s per batch and its decode step against the HBM roofline, on one device."""
  import jax
  import numpy as np

  from benchmarks import memory
  from vcpo_jax.model import transformer
  from vcpo_jax.sampler import Sampler, SamplerConfig

  cfg = memory.load_setting("gsm8k", model_overrides).model_cfg
  tp, tn, batches = shape["s_prompt"], shape["s_new"], tuple(shape["batches"])
  cfg = cfg.replace(max_position=max(cfg.max_position, tp + tn))
  device = jax.local_devices()[0]
  with jax.default_device(device):
    graphdef, params = transformer.split(transformer.init(cfg, seed))
  params = jax.device_put(params, device)
  scfg = SamplerConfig(
    temperature=1.0,
    eos_id=None,  # no stop token: every row draws all Tn tokens
    pad_id=0,
    max_new_tokens=tn,
    prompt_buckets=(tp,),
    new_token_buckets=(tn,),
    batch_buckets=batches,
  )
  sampler = Sampler(graphdef, cfg, scfg)
  bw = nominal_bandwidth(device.device_kind)
  rng = np.random.default_rng(seed)
  rows_out = []
  for b in batches:
    prompts = [list(rng.integers(1, cfg.vocab_size, tp)) for _ in range(b)]
    key = jax.random.key(seed)
    _log(f"sampler: batch {b}, Tp={tp}, Tn={tn}")
    gen = functools.partial(sampler.generate, params, prompts, key)
    full, full_times, first = _time(functools.partial(gen, max_new_tokens=tn), repeats)
    one, _, _ = _time(functools.partial(gen, max_new_tokens=1), repeats)
    step_s = max(full - one, 1e-9) / (tn - 1)
    need = decode_bytes(cfg, b, tp + tn / 2)
    row = {
      "batch": b,
      "prompt_len": tp,
      "new_tokens": tn,
      "generate_s": full,
      "generate_times_s": full_times,
      "first_call_s": first,
      "prefill_plus_one_token_s": one,
      "decode_step_s": step_s,
      "tokens_per_s": b * tn / full,
      "decode_tokens_per_s": b / step_s,
      **need,
      "achieved_bytes_per_s": need["total_bytes"] / step_s,
    }
    if bw:
      row["roofline_fraction"] = row["achieved_bytes_per_s"] / bw
      row["roofline_decode_tokens_per_s"] = b * bw / need["total_bytes"]
    rows_out.append(row)
  return {
    "device_kind": device.device_kind,
    "nominal_hbm_bytes_per_s": bw,
    "params_dtype_as_passed": str(jax.tree.leaves(params)[0].dtype),
    "batches": rows_out,
    "memory_after": _memory([device]),
  }


# ----------------------------------------------------------------------------- main


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="path of the JSON report")
  p.add_argument("--tiny", action="store_true", help="tiny shape (default on CPU)")
  p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (after one compile call)")
  p.add_argument("--rows", type=int, default=0, help="learner rows N (0 = 32, tiny 16); whole groups of 8")
  p.add_argument("--batches", default="", help="sampler batches, e.g. 64,128,256 ('' = default)")
  p.add_argument("--parts", default="learner,sampler", help="which parts to run")
  p.add_argument("--deadline_s", type=float, default=420.0, help="skip parts not started after this many seconds")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  t_start = time.monotonic()
  deadline = t_start + args.deadline_s
  if args.repeats < 1:
    p.error(f"--repeats={args.repeats}: must be >= 1.")
  parts = [x for x in args.parts.split(",") if x]
  for x in parts:
    if x not in ("learner", "sampler"):
      p.error(f"--parts: unknown part {x!r}; choose from learner, sampler.")
  out_dir = os.path.dirname(os.path.abspath(args.out))
  os.makedirs(out_dir, exist_ok=True)

  import jax

  from benchmarks import memory

  devices = jax.local_devices()
  tiny = args.tiny or devices[0].platform == "cpu"
  shape = dict(TINY_SHAPE if tiny else FULL_SHAPE)
  if args.rows:
    shape["rows"] = args.rows
  if args.batches:
    shape["batches"] = tuple(int(x) for x in args.batches.split(","))
  overrides = dict(TINY_MODEL) if tiny else {}
  report = {
    "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    "commit": memory._git_commit(),
    "jax_version": jax.__version__,
    "platform": devices[0].platform,
    "device_kind": devices[0].device_kind,
    "num_local_devices": len(devices),
    "nominal_hbm_bytes_per_s": nominal_bandwidth(devices[0].device_kind),
    "tiny": tiny,
    "shape": {**shape, "model": "tiny" if tiny else "Qwen2.5-1.5B (= configs/gsm8k.py model.shape)", **overrides},
    "errors": {},
  }
  _log(f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform}); tiny={tiny}; shape {shape}")
  if "learner" in parts:
    # OOM retries stop at 60% of the deadline so that the sampler part keeps its time.
    retry_until = t_start + 0.6 * args.deadline_s
    run_part("learner", lambda: learner_part(overrides, shape, args.repeats, args.seed, retry_until), report, deadline)
  if "sampler" in parts:
    run_part("sampler", lambda: sampler_part(overrides, shape, args.repeats, args.seed), report, deadline)
  report["memory"] = _memory(devices)
  report["elapsed_s"] = time.monotonic() - t_start
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1, default=str)
  _log(f"wrote {args.out} in {report['elapsed_s']:.0f} s; errors: {sorted(report['errors']) or 'none'}")
  print(json.dumps(report, default=str))


if __name__ == "__main__":
  main()
