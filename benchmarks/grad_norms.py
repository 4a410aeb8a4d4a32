"""Cost of exact per-example gradient norms in a VCPO learner step, side by side.

    python -m benchmarks.grad_norms                 # ~10M-parameter Qwen2-style model, N = 32, T = 256
    python -m benchmarks.grad_norms --repeats=2 --methods=auto,gram
    python -m benchmarks.grad_norms --small         # seconds: a smoke run of the same code

One process, one model, one batch; every step returns the gradient of the surrogate
loss = -sum_n coef_n sum_t tokw_nt logp_nt (no optimizer update, which is the same for all):

  plain     plain GRPO step: value_and_grad of the surrogate with fixed coefficients
            (one forward, one full backward); the yardstick.
  fast:*    VCPO step, ghost norms (`grad_norms.ghost_policy_gradient`): one forward, one
            backward w.r.t. layer outputs only, norms and gradient from the captured (A, D).
  vmap      VCPO step, `estimator.policy_gradient`: norms by vmap of per-example grads,
            then a second backward with the OPOB coefficients.
  loop      the reference's method: one forward + backward per trajectory (micro-batch 1,
            lax.scan), two parameter-sized buffers: sum_i alpha_i g_i, and per group
            sum_i beta_i g_i scaled by the group's OPOB baseline b_g at the group's end.

VCPO uses the "vcpo" preset of `estimator` (GRPO advantages, sequence TIS c=8, group-scope
OPOB with unclipped weights). All VCPO gradients are checked against each other.
Times: median of --repeats after one warm-up call; memory: XLA's compiled temp buffers
(`memory_analysis().temp_size_in_bytes`) per step, and the process peak RSS at the end.
The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from vcpo_jax import estimator
from vcpo_jax import grad_norms as gn
from vcpo_jax.model import config as mconfig
from vcpo_jax.model import transformer as tf


def model_config(small: bool) -> mconfig.ModelConfig:
  if small:
    return mconfig.tiny_qwen2(vocab_size=512)
  # Qwen2-style: GQA, q/k/v bias, tied embeddings. ~10.0M parameters.
  return mconfig.tiny_qwen2(
    vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=10, num_heads=4, num_kv_heads=2, head_dim=64
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
    valid=jnp.asarray(valid),
    loss_mask=jnp.asarray(loss_mask),
    rewards=jnp.asarray(rng.integers(0, 2, n), jnp.float32),
    group_id=jnp.asarray(np.repeat(np.arange(n // group), group), jnp.int32),
  )
  logp = jax.jit(tf.sequence_logprobs, static_argnums=0)(graphdef, params, batch["tokens"], batch["valid"])
  # Stale behavior policy: per-token log-prob noise gives sequence log-ratios of order 1.
  batch["behavior_logp"] = (logp + 0.1 * jnp.asarray(rng.normal(size=(n, t)), jnp.float32)) * loss_mask
  return batch


# ----------------------------------------------------------------------------- the steps


def plain_step(logp_fn, params, batch, coef_n):
  def surrogate(p):
    return -jnp.sum(coef_n * jnp.sum(batch["loss_mask"] * logp_fn(p, batch), axis=1))

  return jax.value_and_grad(surrogate)(params)


def fast_step(logp_fn, params, batch, cfg, method):
  return gn.ghost_policy_gradient(logp_fn, params, batch, cfg, method=method)


def vmap_step(logp_fn, params, batch, cfg):
  return estimator.policy_gradient(logp_fn, params, batch, cfg)


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


def measure(fn, args, repeats):
  jitted = jax.jit(fn)
  t0 = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  temp = int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1
  out = _block(compiled(*args))  # warm-up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = _block(compiled(*args))
    times.append(time.perf_counter() - t0)
  return out, dict(median_s=statistics.median(times), times_s=times, compile_s=compile_s, temp_bytes=temp)


def tree_rel(a, b):
  num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  return (num / sum(float(jnp.sum(y**2)) for y in jax.tree.leaves(b))) ** 0.5


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--n", type=int, default=32)
  ap.add_argument("--t", type=int, default=256)
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--methods", default="auto", help="fast-path methods, comma-separated (auto,gram,direct,materialize)")
  ap.add_argument("--skip", default="", help="comma-separated steps to skip: vmap,loop")
  ap.add_argument("--small", action="store_true", help="tiny model and batch (smoke run)")
  args = ap.parse_args(argv)
  if args.small:
    args.n, args.t, args.group = 8, 32, 4

  cfg_m = model_config(args.small)
  graphdef, params = tf.split(tf.init(cfg_m, seed=0))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  logp_fn = gn.sequence_logp_fn(graphdef)
  batch = make_batch(graphdef, params, args.n, args.t, args.group)
  cfg = estimator.pg_config_from_preset("vcpo")
  print(
    f"model: {cfg_m.model_type} D={cfg_m.hidden_size} F={cfg_m.intermediate_size} L={cfg_m.num_layers} "
    f"V={cfg_m.vocab_size} tied={cfg_m.tie_embeddings}: {n_params / 1e6:.2f}M params; "
    f"batch N={args.n} T={args.t} G={args.group}; backend {jax.default_backend()}, "
    f"{jax.device_count()} device(s); repeats={args.repeats}",
    flush=True,
  )

  # Fixed coefficients for the plain step: the GRPO + TIS coefficients of this batch.
  coef_plain, _ = jax.jit(
    lambda p, b: estimator.pg_coefficients(
      jax.lax.stop_gradient(logp_fn(p, b)),
      b["behavior_logp"],
      b["loss_mask"],
      b["rewards"],
      b["group_id"],
      None,
      estimator.pg_config_from_preset("seq_tis"),
    )
  )(params, batch)

  rows, outs = {}, {}
  steps = [("plain", lambda p, b, c: plain_step(logp_fn, p, b, c), (params, batch, coef_plain))]
  for m in [m for m in args.methods.split(",") if m]:
    steps.append((f"fast:{m}", lambda p, b, m=m: fast_step(logp_fn, p, b, cfg, m), (params, batch)))
  skip = set(s for s in args.skip.split(",") if s)
  if "vmap" not in skip:
    steps.append(("vmap", lambda p, b: vmap_step(logp_fn, p, b, cfg), (params, batch)))
  if "loop" not in skip:
    steps.append(("loop", lambda p, b: loop_step(logp_fn, p, b, cfg, args.group), (params, batch)))
  for name, fn, fargs in steps:
    outs[name], rows[name] = measure(fn, fargs, args.repeats)
    r = rows[name]
    print(
      f"  {name:12s} {r['median_s']:8.3f} s  (compile {r['compile_s']:.1f} s, temp {r['temp_bytes'] / 2**20:8.1f} MiB)",
      flush=True,
    )

  base = rows["plain"]["median_s"]
  print(f"\n{'step':12s} {'median s':>9s} {'x plain':>8s} {'temp MiB':>9s}")
  for name, r in rows.items():
    r["ratio_to_plain"] = r["median_s"] / base
    print(f"{name:12s} {r['median_s']:9.3f} {r['ratio_to_plain']:8.3f} {r['temp_bytes'] / 2**20:9.1f}")

  # Every VCPO path computes the same gradient (and the same norms).
  checks = {}
  vcpo = [k for k in outs if k != "plain"]
  ref_name = vcpo[0]
  ref_g = outs[ref_name][0]
  for k in vcpo[1:]:
    checks[f"grad_rel_{k}_vs_{ref_name}"] = tree_rel(outs[k][0], ref_g)
  if "loop" in outs and ref_name.startswith("fast"):
    s_fast, s_loop = outs[ref_name][1]["sq_norm_n"], outs["loop"][1]
    checks["sq_norm_max_rel_loop_vs_fast"] = float(jnp.max(jnp.abs(s_loop - s_fast) / s_fast))
  for k, v in checks.items():
    print(f"check {k}: {v:.2e}")
  peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print(f"process peak RSS: {peak_rss / 2**30:.2f} GiB")
  fast_ratio = min((r["ratio_to_plain"] for k, r in rows.items() if k.startswith("fast")), default=None)
  print(
    json.dumps(
      dict(
        benchmark="grad_norms",
        n_params=int(n_params),
        n=args.n,
        t=args.t,
        group=args.group,
        repeats=args.repeats,
        backend=jax.default_backend(),
        steps={k: {kk: v for kk, v in r.items()} for k, r in rows.items()},
        checks=checks,
        peak_rss_bytes=int(peak_rss),
        best_fast_ratio=fast_ratio,
        goal_fast_ratio_le=1.10,
        goal_met=bool(fast_ratio is not None and fast_ratio <= 1.10),
      )
    )
  )


if __name__ == "__main__":
  main()
