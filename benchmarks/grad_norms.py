"""Cost of exact per-example gradient norms in a VCPO learner step, against fair plain steps.

    python -m benchmarks.grad_norms                       # T = 256, 1024, 4096 at 8192 tokens per step
    python -m benchmarks.grad_norms --small               # seconds: a smoke run of the same code
    python -m benchmarks.grad_norms --ts=1024 --rounds=7 --extra=vmap,loop
    python -m benchmarks.grad_norms --memory              # compiled temp bytes only (no timing)
    python -m benchmarks.grad_norms --cost --layers=4 --tokens=8192   # XLA flops / bytes per plan method

One process, one model; per T one batch of N = tokens // T rows. Every step returns the gradient
of the surrogate loss = -sum_n coef_n sum_t tokw_nt logp_nt (no optimizer update, which is the
same for all):

  vcpo         the VCPO step, ghost norms (`learner.policy_gradient("ghost")`, method --method):
               one forward, one backward to the layer outputs, the LM head by vocab-chunk scans,
               norms and gradient from the captured (A, D).
  plain_taps   the fair plain step: the same taps-based backward (`grad_norms.taps_grad`) with
               fixed GRPO + TIS coefficients and no norms.
  plain_vag    the plain step as `jax.value_and_grad` of the surrogate (fixed coefficients).
  vmap, loop   (--extra) `learner.policy_gradient("vmap")` (vmap of per-example grads, then a second
               backward), and the reference's one-backward-per-trajectory loop.

Timing is interleaved: each round runs every step once (the order rotates between rounds), so
load drifts on a shared machine hit all steps alike; reported are the median and range of the
per-round ratios vcpo / plain_taps and vcpo / plain_vag, and the load average (os.getloadavg)
before and after. Goal: vcpo <= 1.10x the fair plain step at every T. Memory: XLA's compiled
temp bytes per step. Cost: XLA's cost analysis of each compiled step (flops, bytes accessed) and
their ratios, deterministic figures next to the times; and the ghost-norm plan the VCPO step took
(`grad_norms.plan_layers`: how many matmuls use gram / direct / materialize). The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vcpo_jax import estimator, learner
from vcpo_jax import grad_norms as gn
from vcpo_jax.model import config as mconfig
from vcpo_jax.model import transformer as tf


def model_config(small: bool, layers: int = 4) -> mconfig.ModelConfig:
  if small:
    return mconfig.tiny_qwen2(vocab_size=512, num_layers=1, logprob_chunk=16, max_position=4096)
  # Qwen2-style (GQA, q/k/v bias, tied embeddings), CPU-sized; the head is chunked at 256 positions.
  return mconfig.tiny_qwen2(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    num_layers=layers,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    max_position=16384,
    logprob_chunk=256,
  )


def make_batch(graphdef, params, n, t, group, seed=0):
  """Left-padded prompts (<= t/4), right-padded responses, loss on the response only."""
  rng = np.random.default_rng(seed)
  vocab = params["embed_tokens"]["embedding"].shape[0]
  p_len, r_len = t // 4, t - t // 4
  prompt_len = rng.integers(p_len // 2, p_len + 1, n)
  resp_len = rng.integers(r_len // 4, r_len + 1, n)
  prompt = np.arange(p_len)[None] >= p_len - prompt_len[:, None]
  resp = np.arange(r_len)[None] < resp_len[:, None]
  valid = np.concatenate([prompt, resp], 1)
  loss_mask = np.concatenate([np.zeros_like(prompt), resp], 1).astype(np.float32)
  tokens = np.where(valid, rng.integers(0, vocab, (n, t)), 0).astype(np.int32)
  batch = dict(
    tokens=jnp.asarray(tokens),
    valid_mask=jnp.asarray(valid),
    loss_mask=jnp.asarray(loss_mask),
    rewards=jnp.asarray(rng.integers(0, 2, n), jnp.float32),
    group_id=jnp.asarray(np.repeat(np.arange(n // group), group), jnp.int32),
  )
  logp = jax.jit(tf.sequence_logprobs, static_argnums=0)(graphdef, params, batch["tokens"], batch["valid_mask"])
  # Stale behavior policy: per-token log-prob noise gives sequence log-ratios of order 1.
  batch["behavior_logp"] = (logp + 0.1 * jnp.asarray(rng.normal(size=(n, t)), jnp.float32)) * loss_mask
  return batch


# ----------------------------------------------------------------------------- the steps


def plain_vag(logp_fn, params, batch, coef_n):
  """Plain step, `jax.value_and_grad` of the surrogate with fixed coefficients."""

  def surrogate(p):
    return -jnp.sum(coef_n * jnp.sum(batch["loss_mask"] * logp_fn(p, batch), axis=1))

  return jax.value_and_grad(surrogate)(params)


def plain_taps(logp_fn, params, batch, coef_n):
  """Plain step through the same taps-based backward as the VCPO step, without norms."""
  res = gn.taps_grad(logp_fn, params, batch, batch["loss_mask"], coef_n)
  return res.loss, res.grads


def fast_step(logp_fn, params, batch, cfg, method):
  return learner.policy_gradient("ghost")(logp_fn, params, batch, cfg, method=method)


def vmap_step(logp_fn, params, batch, cfg):
  return learner.policy_gradient("vmap")(logp_fn, params, batch, cfg)


def loop_step(logp_fn, params, batch, cfg, group):
  """The reference: per-trajectory backward passes, OPOB applied at each group's end.

  coef_i = w~_i norm_i (R_i - b_g) / sigma_g = alpha_i + beta_i b_g, so
  grad = -(sum_i alpha_i g_i + sum_g b_g sum_{i in g} beta_i g_i), with
  b_g = sum_j u_j S_j R_j / sum_j u_j S_j, u_j = w_j^2 (unclipped), S_j = ||g_j||^2 measured in the loop.
  The per-example scalars come from the batch's sampler-side quantities and one forward pass
  (the reference computes them in its loop too; they cost nothing next to the backward passes).
  """
  logp_nt = jax.lax.stop_gradient(logp_fn(params, batch))
  mask = batch["loss_mask"]
  _, aux = estimator.pg_coefficients(
    logp_nt, batch["behavior_logp"], mask, batch["rewards"], batch["group_id"], jnp.ones(mask.shape[:1]), cfg
  )
  _, scale = estimator.baseline_and_scale(
    batch["rewards"], batch["group_id"], cfg.advantage, valid_n=aux["valid_n"], std=cfg.std, std_eps=cfg.std_eps
  )
  n_valid = jnp.maximum(aux["n_valid"], 1.0)
  norm_n = 1.0 / (n_valid * jnp.maximum(jnp.sum(mask, 1), 1.0))  # seq-mean-token-mean
  live = aux["valid_n"] & (scale > 0)
  beta_n = jnp.where(live, -aux["weight_n"] * norm_n / jnp.where(scale > 0, scale, 1.0), 0.0)
  alpha_n = -beta_n * batch["rewards"]
  u_n = jnp.exp(2.0 * jnp.clip(aux["log_ratio_n"], -cfg.log_ratio_clamp, cfg.log_ratio_clamp))

  def score(p, ex):
    one = jax.tree.map(lambda x: x[None], ex)
    return jnp.sum(one["loss_mask"][0] * logp_fn(p, one)[0])

  grad_one = jax.grad(score)
  zeros = jax.tree.map(jnp.zeros_like, params)
  per_group = jax.tree.map(
    lambda x: x.reshape((-1, group) + x.shape[1:]), dict(batch, alpha=alpha_n, beta=beta_n, u=u_n)
  )

  def group_body(total, grp):
    def member(carry, ex):
      tot, buf, num, den = carry
      g = grad_one(params, ex)
      s = sum(jnp.sum(x * x) for x in jax.tree.leaves(g))
      tot = jax.tree.map(lambda a, b: a + ex["alpha"] * b, tot, g)
      buf = jax.tree.map(lambda a, b: a + ex["beta"] * b, buf, g)
      return (tot, buf, num + ex["u"] * s * ex["rewards"], den + ex["u"] * s), s

    (total, buf, num, den), s = jax.lax.scan(member, (total, zeros, 0.0, 0.0), grp)
    b = num / den
    return jax.tree.map(lambda a, c: a + b * c, total, buf), s

  total, s = jax.lax.scan(group_body, zeros, per_group)
  return jax.tree.map(lambda x: -x, total), s.reshape(-1)


# ----------------------------------------------------------------------------- measurement


def _block(x):
  return jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def compile_step(fn, args):
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  mem = compiled.memory_analysis()
  temp = int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1
  # XLA's cost model of the compiled program (deterministic, unlike the times): where extra time could go.
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  return compiled, dict(
    compile_s=time.perf_counter() - t0,
    temp_bytes=temp,
    flops=float(cost.get("flops", -1.0)),
    bytes_accessed=float(cost.get("bytes accessed", -1.0)),
  )


def tree_rel(a, b):
  """||a - b|| / ||b|| over all leaves; 0 when both are zero (e.g. one group whose rewards are all equal:
  zero advantages, zero gradients, as at T = 4096 with N = 2), inf when only b is."""
  num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  den = sum(float(jnp.sum(y**2)) for y in jax.tree.leaves(b))
  if den == 0.0:
    return 0.0 if num == 0.0 else float("inf")
  return (num / den) ** 0.5


def _spread(xs):
  return dict(median=statistics.median(xs), min=min(xs), max=max(xs))


def run_t(graphdef, params, logp_fn, cfg, t, n, group, rounds, method, extra):
  batch = make_batch(graphdef, params, n, t, group)
  # Fixed coefficients for the plain steps: the GRPO + TIS coefficients of this batch.
  coef_plain, _ = jax.jit(
    lambda p, b: estimator.pg_coefficients(
      jax.lax.stop_gradient(logp_fn(p, b)),
      b["behavior_logp"],
      b["loss_mask"],
      b["rewards"],
      b["group_id"],
      None,
      estimator.method_from_preset("seq_tis"),
    )
  )(params, batch)
  steps = {
    "vcpo": (lambda p, b: fast_step(logp_fn, p, b, cfg, method), (params, batch)),
    "plain_taps": (lambda p, b, c: plain_taps(logp_fn, p, b, c), (params, batch, coef_plain)),
    "plain_vag": (lambda p, b, c: plain_vag(logp_fn, p, b, c), (params, batch, coef_plain)),
  }
  if "vmap" in extra:
    steps["vmap"] = (lambda p, b: vmap_step(logp_fn, p, b, cfg), (params, batch))
  if "loop" in extra:
    steps["loop"] = (lambda p, b: loop_step(logp_fn, p, b, cfg, group), (params, batch))
  compiled, rows, outs = {}, {}, {}
  for name, (fn, args) in steps.items():
    compiled[name], rows[name] = compile_step(fn, args)
    outs[name] = _block(compiled[name](*args))  # warm-up
    rows[name]["times_s"] = []
  load_before = os.getloadavg()
  names = list(steps)
  for r in range(rounds):
    for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order per round
      t0 = time.perf_counter()
      _block(compiled[name](*steps[name][1]))
      rows[name]["times_s"].append(time.perf_counter() - t0)
  load_after = os.getloadavg()
  ratios = {}
  for base in [k for k in names if k != "vcpo"]:
    ratios[f"vcpo/{base}"] = _spread([a / b for a, b in zip(rows["vcpo"]["times_s"], rows[base]["times_s"])])
  for r in rows.values():
    r["median_s"] = statistics.median(r["times_s"])
  # The plan the VCPO step's ghost norms take at this shape (gram / direct / materialize per matmul).
  infos, in_shapes, _, out_shapes = gn._tapped_forward(logp_fn, params, batch)
  plans = gn.plan_layers(infos, in_shapes, out_shapes, method)
  plan_counts = {}
  for pl in plans.values():
    plan_counts[f"{pl.kind}:{pl.method}"] = plan_counts.get(f"{pl.kind}:{pl.method}", 0) + 1
  cost_ratios = {
    f"vcpo/{base}": dict(
      flops=rows["vcpo"]["flops"] / rows[base]["flops"],
      bytes_accessed=rows["vcpo"]["bytes_accessed"] / rows[base]["bytes_accessed"],
    )
    for base in names
    if base != "vcpo"
  }
  checks = {"grad_rel_plain_taps_vs_plain_vag": tree_rel(outs["plain_taps"][1], outs["plain_vag"][1])}
  for k in ("vmap", "loop"):
    if k in outs:
      g = outs[k][0]
      checks[f"grad_rel_{k}_vs_vcpo"] = tree_rel(g, outs["vcpo"][0])
  return dict(
    t=t,
    n=n,
    steps=rows,
    ratios=ratios,
    cost_ratios=cost_ratios,
    plan=plan_counts,
    checks=checks,
    load_before=load_before,
    load_after=load_after,
  )


def memory_table(args):
  """Compiled temp bytes (no run) of the VCPO step and value_and_grad, 1 layer, dense vs chunked head."""
  cfg = estimator.method_from_preset("vcpo")
  # The budget steers the plan (kept gradients, vocab chunks of the head); older trees lack it.
  has_budget = "memory_budget_bytes" in inspect.signature(learner.policy_gradient("ghost")).parameters
  budget = dict(memory_budget_bytes=args.memory_budget) if has_budget else {}
  out = []
  for n, t in [tuple(int(x) for x in nt.split("x")) for nt in args.memory_shapes.split(",")]:
    for chunk in (0, args.memory_chunk):
      kw = dict(logprob_chunk=chunk) if "logprob_chunk" in mconfig.ModelConfig.__dataclass_fields__ else {}
      cfg_m = mconfig.tiny_qwen2(
        vocab_size=args.memory_vocab, hidden_size=256, intermediate_size=768, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=64, max_position=t, **kw,
      )  # fmt: skip
      graphdef, params = tf.split(nnx.eval_shape(lambda c=cfg_m: tf.Transformer(c, rngs=nnx.Rngs(0))))
      logp_fn = gn.sequence_logp_fn(graphdef)
      sds = jax.ShapeDtypeStruct
      batch = dict(
        tokens=sds((n, t), jnp.int32),
        valid_mask=sds((n, t), jnp.bool_),
        loss_mask=sds((n, t), jnp.float32),
        behavior_logp=sds((n, t), jnp.float32),
        rewards=sds((n,), jnp.float32),
        group_id=sds((n,), jnp.int32),
      )
      row = dict(
        n=n, t=t, v=args.memory_vocab, logprob_chunk=chunk if kw else "n/a", ntv_f32_bytes=n * t * cfg_m.vocab_size * 4
      )
      row["budget_bytes"] = budget.get("memory_budget_bytes")
      for name, fn in [
        ("vcpo", lambda p, b, f=logp_fn: learner.policy_gradient("ghost")(f, p, b, cfg, **budget)),
        ("plain_vag", lambda p, b, f=logp_fn: plain_vag(f, p, b, b["rewards"])),
      ]:
        row[name + "_temp_bytes"] = compile_step(fn, (params, batch))[1]["temp_bytes"]
      out.append(row)
      print(
        f"N={n:3d} T={t:5d} V={row['v']} chunk={row['logprob_chunk']!s:>4s}: [N,T,V] f32 {row['ntv_f32_bytes'] / 2**20:7.1f} MiB"
        f" | vcpo temp {row['vcpo_temp_bytes'] / 2**20:8.1f} MiB | value_and_grad temp "
        f"{row['plain_vag_temp_bytes'] / 2**20:8.1f} MiB",
        flush=True,
      )
      if not kw:
        break
  print(json.dumps(dict(benchmark="grad_norms_memory", rows=out)))


def cost_table(args, graphdef, params, logp_fn, cfg):
  """XLA cost analysis only (compiled, not run): the VCPO step under each ghost-norm plan method and
  the two plain steps, per T. Deterministic, so it shows on a loaded machine where extra time can go."""
  out = []
  for t in [int(x) for x in args.ts.split(",")]:
    n = max(args.group, args.tokens // t // args.group * args.group)
    batch = make_batch(graphdef, params, n, t, args.group)
    coef = jnp.ones((n,), jnp.float32)
    steps = {f"vcpo:{m}": (lambda p, b, m=m: fast_step(logp_fn, p, b, cfg, m), (params, batch)) for m in gn.METHODS}
    steps["plain_taps"] = (lambda p, b, c: plain_taps(logp_fn, p, b, c), (params, batch, coef))
    steps["plain_vag"] = (lambda p, b, c: plain_vag(logp_fn, p, b, c), (params, batch, coef))
    row = dict(t=t, n=n, steps={name: compile_step(fn, a)[1] for name, (fn, a) in steps.items()})
    base = row["steps"]["plain_taps"]
    print(f"T={t} N={n}: GFLOP / GB accessed / temp MiB, and flops vs plain_taps")
    for name, r in row["steps"].items():
      print(
        f"  {name:17s} {r['flops'] / 1e9:9.1f} {r['bytes_accessed'] / 1e9:8.2f} {r['temp_bytes'] / 2**20:8.0f}"
        f"  {r['flops'] / base['flops']:.3f}x",
        flush=True,
      )
    out.append(row)
  print(json.dumps(dict(benchmark="grad_norms_cost", tokens=args.tokens, layers=args.layers, rows=out)))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--ts", default="256,1024,4096", help="sequence lengths T, comma-separated")
  ap.add_argument("--tokens", type=int, default=8192, help="tokens per step: N = tokens // T rows (32, 8, 2)")
  ap.add_argument("--group", type=int, default=2)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each runs every step once)")
  ap.add_argument("--method", default="auto", help="ghost plan method: auto | gram | direct | materialize")
  ap.add_argument("--extra", default="", help="extra steps, comma-separated: vmap,loop")
  ap.add_argument("--small", action="store_true", help="tiny model and batches (smoke run)")
  ap.add_argument("--cost", action="store_true", help="only XLA cost analysis per step and plan method (no timing)")
  ap.add_argument("--memory", action="store_true", help="only compiled temp bytes, 1 layer, dense vs chunked head")
  ap.add_argument("--memory-shapes", default="4x512,8x512,4x1024", help="NxT list for --memory")
  ap.add_argument("--memory-vocab", type=int, default=8192)
  ap.add_argument("--memory-chunk", type=int, default=64, help="logprob_chunk of the chunked rows of --memory")
  ap.add_argument("--memory-budget", type=int, default=64 << 20, help="ghost memory_budget_bytes for --memory")
  args = ap.parse_args(argv)
  if args.memory:
    return memory_table(args)
  if args.small:
    args.ts, args.tokens, args.group, args.rounds = "32,64", 256, 2, 2

  cfg_m = model_config(args.small, args.layers)
  graphdef, params = tf.split(tf.init(cfg_m, seed=0))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  logp_fn = gn.sequence_logp_fn(graphdef)
  cfg = estimator.method_from_preset("vcpo")
  extra = {x for x in args.extra.split(",") if x}
  if args.cost:
    return cost_table(args, graphdef, params, logp_fn, cfg)
  print(
    f"model: {cfg_m.model_type} D={cfg_m.hidden_size} F={cfg_m.intermediate_size} L={cfg_m.num_layers} "
    f"V={cfg_m.vocab_size} tied={cfg_m.tie_embeddings} logprob_chunk={cfg_m.logprob_chunk}: "
    f"{n_params / 1e6:.2f}M params; {args.tokens} tokens per step; backend {jax.default_backend()}, "
    f"{jax.device_count()} device(s), {os.cpu_count()} CPUs; rounds={args.rounds}; load {os.getloadavg()}",
    flush=True,
  )
  results = []
  for t in [int(x) for x in args.ts.split(",")]:
    n = max(args.group, args.tokens // t // args.group * args.group)
    res = run_t(graphdef, params, logp_fn, cfg, t, n, args.group, args.rounds, args.method, extra)
    results.append(res)
    print(f"\nT={t} N={n}  (load {res['load_before'][0]:.1f} -> {res['load_after'][0]:.1f})")
    print(f"  plan {res['plan']}")
    print(f"  {'step':11s} {'median s':>9s} {'compile s':>9s} {'temp MiB':>9s} {'GFLOP':>9s} {'GB accessed':>11s}")
    for name, r in res["steps"].items():
      print(
        f"  {name:11s} {r['median_s']:9.3f} {r['compile_s']:9.1f} {r['temp_bytes'] / 2**20:9.1f} "
        f"{r['flops'] / 1e9:9.1f} {r['bytes_accessed'] / 1e9:11.2f}"
      )
    for k, v in res["cost_ratios"].items():
      print(f"  {k:22s} XLA cost: flops {v['flops']:.3f}x, bytes accessed {v['bytes_accessed']:.3f}x")
    for k, v in res["ratios"].items():
      print(f"  {k:22s} median {v['median']:.3f}  range [{v['min']:.3f}, {v['max']:.3f}]")
    for k, v in res["checks"].items():
      print(f"  check {k}: {v:.2e}")
  worst = max(r["ratios"]["vcpo/plain_taps"]["median"] for r in results)
  print(
    json.dumps(
      dict(
        benchmark="grad_norms",
        n_params=int(n_params),
        model=dict(d=cfg_m.hidden_size, f=cfg_m.intermediate_size, layers=cfg_m.num_layers, v=cfg_m.vocab_size),
        tokens=args.tokens,
        rounds=args.rounds,
        method=args.method,
        backend=jax.default_backend(),
        cpus=os.cpu_count(),
        results=results,
        worst_median_ratio_vs_plain_taps=worst,
        goal_ratio_le=1.10,
        goal_met=bool(worst <= 1.10),
      )
    )
  )


if __name__ == "__main__":
  main()
