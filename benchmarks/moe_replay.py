"""Routing replay on stale batches, tiny Qwen3-MoE on CPU: log-ratio spread and ESS with and without replay.

A batch is sampled (KV-cache sampler, routing recorded) with parameters theta_old; the learner holds
theta = theta_old + a relative perturbation of size `drift` per tensor (a stand-in for k stale updates), and
`learner.routing_replay_metrics` scores the same batch with its own routing and with the recorded one.

  python -m benchmarks.moe_replay                 # drifts 0, 1e-3, 3e-3, 1e-2 x seeds 0, 1, 2
The last line printed is one JSON object {"results": [...]}.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from vcpo_jax import learner
from vcpo_jax import sampler as S
from vcpo_jax.model import config as mconfig
from vcpo_jax.model import transformer as tf


def measure(drift: float, seed: int, rows: int = 32, new_tokens: int = 24) -> dict:
  cfg = mconfig.tiny_qwen3_moe(routing_replay=True)
  graphdef, old = tf.split(tf.init(cfg, seed=seed))
  keys = iter(jax.random.split(jax.random.key(1000 + seed), 64))
  new = jax.tree.map(lambda x: x * (1.0 + drift * jax.random.normal(next(keys), x.shape)), old)
  smp = S.Sampler(graphdef, cfg, S.SamplerConfig(temperature=1.0, max_new_tokens=new_tokens, record_routing=True))
  prompts = [list(np.random.default_rng(seed + p).integers(3, 200, 6)) for p in range(rows // 4)]
  ro = smp.generate(old, prompts, jax.random.key(seed), num_samples=4)
  batch = {
    "tokens": jnp.asarray(ro.tokens),
    "valid_mask": jnp.asarray(ro.prompt_mask | ro.response_mask),
    "loss_mask": jnp.asarray(ro.response_mask),
    "behavior_logp": jnp.asarray(ro.behavior_logp),
    "expert_ids": jnp.asarray(ro.expert_ids),
  }
  m = jax.jit(learner.routing_replay_metrics, static_argnums=0)(graphdef, new, batch)
  return {"drift": drift, "seed": seed, **{k: float(v) for k, v in m.items()}}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--drifts", default="0,1e-3,3e-3,1e-2")
  ap.add_argument("--seeds", default="0,1,2")
  args = ap.parse_args(argv)
  results = [measure(float(d), int(s)) for d in args.drifts.split(",") for s in args.seeds.split(",")]
  print("drift | seeds | route_mismatch | log_ratio_std own | replayed | ESS/N own | replayed")
  for d in sorted({r["drift"] for r in results}):
    rs = [r for r in results if r["drift"] == d]
    mean = lambda k, rs=rs: np.mean([r[k] for r in rs])
    print(
      f"{d:g} | {len(rs)} | {mean('moe/route_mismatch'):.4f} | {mean('moe/log_ratio_std'):.4f} | "
      f"{mean('moe/log_ratio_std_replay'):.4f} | {mean('moe/ess'):.4f} | {mean('moe/ess_replay'):.4f}"
    )
  print(json.dumps({"results": results}))


if __name__ == "__main__":
  main()
