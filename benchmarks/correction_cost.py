"""The learner's cost per step of each correction against plain VCPO, interleaved in one process.

    python -m benchmarks.correction_cost [--rounds=9] [--steps=10]

The CPU default's learner (configs/countdown.py: N = P x G = 64 rows x T = 24 + 16 tokens, ghost norms) on the
benchmarks' fixed stale batch (`learner_step.stale_batch`), one CPU device. Each method's train step is
`learner.make_train_step` of the run config trainer.run would build, jitted as trainer.run jits it (state
donated): VCPO; VCPO with exact score centering (the step also takes the behaviour version and runs its
stop-gradient forward); VCPO centered from the sampler's top-k record (k = 8 and 64: the batch carries
[N, T, k] ids and log-probs, recorded from a perturbed behaviour version); TIS+SC (token TIS + exact
centering); IPO and KPop with the stability study's updates per step (learner.minibatches = 2). All compile
and warm up first; each round times `--steps` consecutive steps of every method (the order rotates by round),
and a method's round ratio is its median over VCPO's median in that round. Reported per method: the median
step, the median and range of its per-round ratios, XLA's flop count of its compiled step (a yardstick the
machine's load cannot move), the number of backend compiles during the timed rounds and the load average
before and after. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (preset, {run-config path: value}); ipo / kpop as configs/stability.py runs them (2 updates per step)
METHODS = {
  "vcpo": ("vcpo", {}),
  "vcpo_sc": ("vcpo_sc", {}),
  "vcpo_sc_top8": ("vcpo", {"method.loss.score_centering": "topk", "method.loss.sc_topk": 8}),
  "vcpo_sc_top64": ("vcpo", {"method.loss.score_centering": "topk", "method.loss.sc_topk": 64}),
  "tis_sc": ("tis_sc", {}),
  "ipo": ("ipo", {"learner.minibatches": 2}),
  "kpop": ("kpop", {"learner.minibatches": 2}),
}


def _spec(preset: str, fields: dict):
  from configs import countdown
  from vcpo_jax import run_config
  from vcpo_jax.rl import choices

  c = countdown.get_config(None)
  c.method, c.mode = choices.preset(preset), "lag"
  choices.set_paths(c, [(p, v) for p, v in fields.items() if p.startswith("method.")])
  for path, value in ((p, v) for p, v in fields.items() if not p.startswith("method.")):
    *parents, leaf = path.split(".")
    node = c
    for name in parents:
      node = node[name]
    node[leaf] = value
  return run_config.parse_config(c)


def build(names):
  """{name: [jitted step, state, args after the state]}: every method's step on the same batch and weights."""
  import jax
  import jax.numpy as jnp

  from benchmarks.learner_step import stale_batch
  from vcpo_jax import learner, sampler
  from vcpo_jax.model import tokenizer as tok_lib
  from vcpo_jax.model import transformer

  base = _spec("vcpo", {})
  tok = tok_lib.build_char_tokenizer()
  model_cfg = base.model_cfg.replace(vocab_size=max(base.model_cfg.vocab_size, len(tok)))
  graphdef, params = transformer.split(transformer.init(model_cfg, seed=base.seed))
  _, other = transformer.split(transformer.init(model_cfg, seed=base.seed + 1))
  behaviour = jax.tree.map(lambda a, b: a + 0.05 * (b - a), params, other)  # a nearby stale version
  batch = {k: jnp.asarray(v) for k, v in stale_batch(base, model_cfg.vocab_size).items()}
  positions, mask = transformer.padded_positions_and_mask(batch["valid_mask"])
  from flax import nnx

  logits, _ = nnx.merge(graphdef, behaviour)(batch["tokens"], positions, mask)
  out = {}
  for name in names:
    preset, fields = METHODS[name]
    spec = _spec(preset, fields)
    tx = spec.optim.build(total_steps=spec.steps)  # as trainer.run builds it
    b = dict(batch)
    if k := spec.learner.method.record_topk:  # the record a temperature-1 sampler of the behaviour version makes
      cfg = sampler.SamplerConfig(record_topk=k)
      ids, lq = jax.vmap(functools.partial(sampler.sampled_topk, cfg=cfg))(logits)
      pad = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], 1)  # row t: drawn at t - 1
      on = batch["loss_mask"][..., None] != 0
      resp = lambda x: x[:, 1:]  # the Batch's records cover response columns: here every column but the first
      b.update(topk_ids=resp(jnp.where(on, pad(ids), 0)), topk_logp=resp(jnp.where(on, pad(lq), 0.0)))
    args = (b, behaviour) if (spec.learner.method.centering or ("",))[0] == "exact" else (b,)
    step = jax.jit(learner.make_train_step(graphdef, tx, spec.learner), donate_argnums=0)
    state = learner.init_state(jax.tree.map(jnp.copy, params), tx)
    cost = step.lower(state, *args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    out[name] = [step, state, args, float(cost.get("flops", float("nan")))]
  return out, tuple(batch["tokens"].shape)


def main(argv=None) -> int:
  sys.path.insert(0, ROOT)
  from benchmarks.telemetry_overhead import add_round_args, count_compiles, interleaved_medians, time_steps

  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_round_args(p, "method")
  p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {list(METHODS)}")
  args = p.parse_args(argv)
  names = [m for m in args.methods.split(",") if m]
  if [m for m in names if m not in METHODS] or "vcpo" not in names:
    print(f"error: --methods={args.methods!r}: choose from {list(METHODS)}, vcpo included.", file=sys.stderr)
    return 2
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  load_before = os.getloadavg()
  t0 = time.perf_counter()
  steps, (n, t) = build(names)
  compile_s = time.perf_counter() - t0

  def timed(name: str, k: int) -> list[float]:
    steps[name][1], out = time_steps(steps[name][0], steps[name][1], steps[name][2], k)
    return out

  for name in names:  # warm-up
    timed(name, 3)
  compiles = count_compiles()
  med = interleaved_medians(names, args.rounds, lambda m: timed(m, args.steps))
  ratios = {m: [a / b for a, b in zip(med[m], med["vcpo"])] for m in names}
  load_after = os.getloadavg()
  rows = {
    m: {
      "step_ms": 1e3 * statistics.median(med[m]),
      "ratio_median": statistics.median(ratios[m]),
      "ratio_min": min(ratios[m]),
      "ratio_max": max(ratios[m]),
      "flops": steps[m][3],
      "flops_ratio": steps[m][3] / steps["vcpo"][3],
    }
    for m in names
  }
  print(f"learner step per correction, N = {n}, T = {t}, {args.rounds} rounds x {args.steps} steps")
  print(f"  {'method':<14} {'median step':>12} {'vs vcpo (median, range)':>28} {'XLA flops vs vcpo':>18}")
  for m, row in rows.items():
    rng = f"{row['ratio_median']:.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})"
    print(f"  {m:<14} {row['step_ms']:>9.1f} ms {rng:>28} {row['flops_ratio']:>17.3f}x")
  print(f"  backend compiles during the timed rounds: {len(compiles)}")
  load = [round(x, 2) for x in load_before], [round(x, 2) for x in load_after]
  print(f"  load average before {load[0]}, after {load[1]} ({os.cpu_count()} CPUs)")
  res = dict(n=n, t=t, rounds=args.rounds, steps=args.steps, methods=rows, compiles_during_rounds=len(compiles))
  res.update(build_and_compile_s=compile_s, loadavg_before=load[0], loadavg_after=load[1], cpus=os.cpu_count())
  print(json.dumps(res))
  return 0


if __name__ == "__main__":
  sys.exit(main())
