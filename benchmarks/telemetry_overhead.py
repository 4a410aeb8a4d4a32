"""The gradient-variance telemetry's cost per learner step: the CPU default's step with it and without, interleaved.

    python -m benchmarks.telemetry_overhead [--rounds=9] [--steps=10] [--method=vcpo] [--telemetry=True]
    python -m benchmarks.telemetry_overhead --method=none        # the plain GRPO step (no OPOB, no norms needed)
    python -m benchmarks.telemetry_overhead --method=none --telemetry=norms   # what asking for its norms costs

One process, one CPU device, the CPU default's learner (configs/countdown.py: ghost norms, N = P x G = 64 rows x
T = 24 + 16 tokens) with the --method preset on one fixed batch (numpy seed 0: random tokens, 1/0 rewards, a stale
behaviour log-prob, so the baseline part of the telemetry runs too). Two train steps are built from the same
`learner.make_train_step`, jitted the same way (the state donated, as `trainer.run` does): "on" with
learner.grad_telemetry=--telemetry (True: as it ships, the grad/ metrics when the method computes per-example
norms, i.e. OPOB; "norms": computed for the telemetry in any case), "off" with learner.grad_telemetry=False.
For VCPO the difference is the telemetry's arithmetic; for a method without norms (none, seq_tis) it is also
the norms themselves, which XLA drops when nothing reads them. Both compile and warm up first; each round
then times `--steps` consecutive steps of each (the order alternates by round), and the round's ratio is
median(on) / median(off). Reported: XLA's flop count of each compiled step (a yardstick the machine's load
cannot move), the median and range of the per-round ratios, the median step times, the number of backend
compiles during the timed rounds (0: nothing compiled mid-run), and the load average (`os.getloadavg`)
before and after: on a shared machine other jobs' load moves both sides, which interleaving spreads over
both. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def build(method: str, telemetry="True"):
  """(step_on, step_off, state_on, state_off, batch, n, t): the two jitted steps and their inputs."""
  import dataclasses

  import jax
  import jax.numpy as jnp

  from benchmarks.learner_step import stale_batch
  from configs import countdown
  from vcpo_jax import learner, run_config
  from vcpo_jax.model import tokenizer as tok_lib
  from vcpo_jax.model import transformer
  from vcpo_jax.rl import choices

  c = countdown.get_config(None)
  c.method = choices.preset(method)
  spec = run_config.parse_config(c)
  tok = tok_lib.build_char_tokenizer()
  model_cfg = spec.model_cfg.replace(vocab_size=max(spec.model_cfg.vocab_size, len(tok)))
  graphdef, params = transformer.split(transformer.init(model_cfg, seed=spec.seed))
  tx = spec.optim.build(total_steps=spec.steps)  # as trainer.run builds it
  batch = {k: jnp.asarray(v) for k, v in stale_batch(spec, model_cfg.vocab_size).items()}
  n, t = batch["tokens"].shape
  states = [learner.init_state(jax.tree.map(jnp.copy, params), tx) for _ in range(2)]
  on = {"True": True, "norms": "norms"}[telemetry]
  cfg_on = dataclasses.replace(spec.learner, grad_telemetry=on)
  cfg_off = dataclasses.replace(spec.learner, grad_telemetry=False)
  step_on = jax.jit(learner.make_train_step(graphdef, tx, cfg_on), donate_argnums=0)
  step_off = jax.jit(learner.make_train_step(graphdef, tx, cfg_off), donate_argnums=0)
  states[0], m_on = step_on(states[0], batch)
  states[1], m_off = step_off(states[1], batch)
  jax.block_until_ready((states, m_on, m_off))
  assert any(k.startswith("grad/") for k in m_on) == cfg_on.telemetry_norms
  assert not any(k.startswith("grad/") for k in m_off)
  return step_on, step_off, states[0], states[1], batch, n, t


def add_round_args(p: argparse.ArgumentParser, each: str) -> None:
  """--rounds and --steps (ints >= 1, else exit 2) of an interleaved step benchmark; `each`: what every round
  times `--steps` consecutive steps of."""

  def at_least_1(text: str) -> int:
    if int(text) < 1:
      raise argparse.ArgumentTypeError(f"{text}: must be >= 1")
    return int(text)

  p.add_argument("--rounds", type=at_least_1, default=9)
  p.add_argument("--steps", type=at_least_1, default=10, help=f"consecutive steps timed per {each} per round")


def interleaved_medians(names: list[str], rounds: int, timed) -> dict[str, list[float]]:
  """{name: [its median step seconds in each round]}: every round runs `timed(name)` -> [seconds] once per name,
  in an order that rotates by one name per round (two names alternate), so load changes reach every name."""
  med = {m: [] for m in names}
  for r in range(rounds):
    for m in names[r % len(names) :] + names[: r % len(names)]:
      med[m].append(statistics.median(timed(m)))
  return med


def time_steps(fn, state, args: tuple, k: int) -> tuple:
  """(state, [seconds]) of k consecutive steps state, metrics = fn(state, *args), each waited for."""
  import jax

  out = []
  for _ in range(k):
    t1 = time.perf_counter()
    state, m = fn(state, *args)
    jax.block_until_ready((state, m))
    out.append(time.perf_counter() - t1)
  return state, out


def count_compiles() -> list:
  """A list that grows by one entry per backend compile from now on (jax.monitoring)."""
  import jax

  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda e, d, **kw: compiles.append(e) if e == COMPILE_EVENT else None
  )
  return compiles


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_round_args(p, "side")
  p.add_argument("--method", default="vcpo", help="estimator preset (vcpo; none / seq_tis: a step without norms)")
  p.add_argument("--telemetry", default="True", choices=("True", "norms"), help="learner.grad_telemetry of 'on'")
  args = p.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, ROOT)

  load_before = os.getloadavg()
  t0 = time.perf_counter()
  step_on, step_off, s_on, s_off, batch, n, t = build(args.method, args.telemetry)
  compile_s = time.perf_counter() - t0
  flops = {}  # XLA's own count of each compiled step's floating-point work: a load-free yardstick
  for side, fn, st in (("on", step_on, s_on), ("off", step_off, s_off)):
    cost = fn.lower(st, batch).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops[side] = float(cost.get("flops", float("nan")))
  sides = {"on": [step_on, s_on], "off": [step_off, s_off]}

  def timed(side: str, k: int) -> list[float]:
    sides[side][1], out = time_steps(sides[side][0], sides[side][1], (batch,), k)
    return out

  for side in sides:  # warm-up
    timed(side, 3)
  compiles = count_compiles()
  med = interleaved_medians(["on", "off"], args.rounds, lambda side: timed(side, args.steps))
  ratios = [on / off for on, off in zip(med["on"], med["off"])]
  load_after = os.getloadavg()
  res = {
    "method": args.method,
    "telemetry": args.telemetry,
    "n": n,
    "t": t,
    "rounds": args.rounds,
    "steps": args.steps,
    "ratio_median": statistics.median(ratios),
    "ratio_min": min(ratios),
    "ratio_max": max(ratios),
    "step_on_ms": 1e3 * statistics.median(med["on"]),
    "step_off_ms": 1e3 * statistics.median(med["off"]),
    "flops_on": flops["on"],
    "flops_off": flops["off"],
    "compiles_during_rounds": len(compiles),
    "build_and_compile_s": compile_s,
    "loadavg_before": [round(x, 2) for x in load_before],
    "loadavg_after": [round(x, 2) for x in load_after],
    "cpus": os.cpu_count(),
  }
  print(f"telemetry {args.telemetry} / off, {args.method}, N = {n}, T = {t}, {args.rounds} rounds x {args.steps} steps")
  print(f"  step (median): on {res['step_on_ms']:.1f} ms, off {res['step_off_ms']:.1f} ms")
  print(
    f"  per-round ratio on/off: median {res['ratio_median']:.4f}, range {res['ratio_min']:.4f} .. {res['ratio_max']:.4f}"
  )
  print(f"  XLA flops per step: on {flops['on']:.4g}, off {flops['off']:.4g} (ratio {flops['on'] / flops['off']:.6f})")
  print(f"  backend compiles during the timed rounds: {len(compiles)}")
  print(f"  load average before {res['loadavg_before']}, after {res['loadavg_after']} ({res['cpus']} CPUs)")
  print(json.dumps(res))
  return 0


if __name__ == "__main__":
  sys.exit(main())
