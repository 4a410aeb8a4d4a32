"""`Sampler.generate` of this tree against an older tree, interleaved: the decode loop's before / after.

    python -m benchmarks.sampler_ab --base=ef5c2fb                  # 10M model, batch 64, prompt 32, new 128
    python -m benchmarks.sampler_ab --base=ef5c2fb --rounds=7 --calls=2 --threads=2
    python -m benchmarks.sampler_ab --base=HEAD --decode_layers=unrolled   # unrolled decode layers vs the scan
    python -m benchmarks.sampler_ab --base=HEAD --decode_layers=unrolled --base_decode_layers=unrolled
    python -m benchmarks.sampler_ab --base=HEAD --devices=2   # the batch over 2 host devices vs one device

Each tree runs in its own worker process (`git archive <base>` unpacked into a temporary directory, as
`benchmarks.learner_step` does), pinned to the same `--threads` cores, with the same model (the tree's own
`benchmarks.sampler.MODELS[--model]`, random weights of `transformer.init(seed 0)`), the same prompts, key and
`SamplerConfig` as `benchmarks.sampler` builds (temperature 1, no EOS: every row draws all `--new` tokens,
param_dtype `--param_dtype`). Both compile and warm up first; each round then asks every worker in turn (the
order rotates) to time `--calls` generate calls, and the round's ratio is median(base) / median(this) (> 1:
this tree is faster). The roofline (`benchmarks.sampler.measure_roofline`, `roofline_seconds`) is measured in
the driver (the workers idle, the same cores) before every round and after the last, and each round's fraction
of it uses the mean of the two measurements that bracket the round: on a shared machine the roofline moves
with the load, and one measurement before all rounds gave fractions that moved with the load between it and
the rounds (benchmarks/README.md). Both trees share each round's yardstick. Both trees must
draw the same tokens (checked: same seed, logits equal up to float rounding). Reported: median and range of
the per-round ratios, each tree's roofline fraction, the load average before and after. The last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- worker (one tree)


def _worker(args):
  if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.threads])
  sys.path.insert(0, args.tree)
  os.chdir(args.tree)
  if args.devices > 1:  # host devices, before jax starts
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
  import jax
  import numpy as np

  from benchmarks import sampler as bench
  from vcpo_jax import sampler as S
  from vcpo_jax.model import transformer

  cfg = bench.MODELS[args.model]()
  graphdef, params = transformer.split(transformer.init(cfg, seed=0))
  b, tp, tn = args.batch, args.prompt, args.new
  scfg = S.SamplerConfig(
    temperature=1.0,
    eos_id=None,
    max_new_tokens=tn,
    prompt_buckets=(tp,),
    new_token_buckets=(tn,),
    batch_buckets=(b,),
    param_dtype=args.param_dtype,
    **({"decode_layers": args.decode_layers} if args.decode_layers else {}),  # per tree (_start's flags)
    **({"mesh_shape": (args.devices, 1, 1)} if args.devices > 1 else {}),
  )
  smp = S.Sampler(graphdef, cfg, scfg, **({"mesh": S.sampler_mesh(scfg)} if args.devices > 1 else {}))
  params = smp.prepare_params(params)
  prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (b, tp)).tolist()
  key = jax.random.key(0)
  t0 = time.perf_counter()
  out = smp.generate(params, prompts, key)
  first = time.perf_counter() - t0
  smp.generate(params, prompts, key)  # warm-up
  ready = {"ready": True, "first_call_s": first, "tokens": out.tokens.tolist(), "logp": out.behavior_logp.tolist()}
  print(json.dumps(ready), flush=True)
  for line in sys.stdin:
    times = []
    for _ in range(int(line.split()[1])):
      t0 = time.perf_counter()
      smp.generate(params, prompts, key)  # returns host arrays: the call has ended
      times.append(time.perf_counter() - t0)
    print(json.dumps({"times_s": times}), flush=True)


# ----------------------------------------------------------------------------- driver


def _start(tree: str, args, extra=()):
  """A worker on `tree` (one CPU device unless --devices / --base_devices, as benchmarks.sampler)."""
  from benchmarks import tree_ab  # the driver's side only: a worker runs against an older tree

  flags = [f"--{k}={getattr(args, k)}" for k in ("model", "batch", "prompt", "new", "threads", "param_dtype")]
  return tree_ab.start(__file__, tree, [f"--tree={tree}", *flags, *extra])


def _side_flags(decode_layers: str, devices: int) -> list[str]:
  """One side's worker flags: its decode layers ('' = the tree's default) and host devices."""
  return ([f"--decode_layers={decode_layers}"] if decode_layers else []) + (
    [f"--devices={devices}"] if devices > 1 else []
  )


def _parser():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--base", default="ef5c2fb", help="git commit of the older tree")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--calls", type=int, default=2, help="generate calls timed per worker per round")
  p.add_argument("--model", default="10m")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--prompt", type=int, default=32)
  p.add_argument("--new", type=int, default=128)
  p.add_argument("--threads", type=int, default=os.cpu_count(), help="cores of each worker (the same ones)")
  p.add_argument("--param_dtype", default="auto", help="SamplerConfig.param_dtype (auto: as a run; CPU float32)")
  p.add_argument(
    "--decode_layers",
    default="",
    help="SamplerConfig.decode_layers of THIS tree's sampler (scan | unrolled; empty: its default); the base keeps "
    "its own default (with --base=HEAD: this tree's decode layers against its committed default)",
  )
  p.add_argument(
    "--devices",
    type=int,
    default=1,
    help="host devices of THIS tree's sampler (the batch split over a (N, 1, 1) mesh, the same --threads cores)",
  )
  p.add_argument("--base_devices", type=int, default=1, help="host devices of the base's sampler")
  p.add_argument(
    "--base_decode_layers",
    default="",
    help="SamplerConfig.decode_layers of the base's sampler (empty: its default), e.g. unrolled on both sides",
  )
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--tree", default="", help=argparse.SUPPRESS)
  return p


def _rounds(procs: dict, rounds: int, calls: int, roofline=None) -> tuple[dict, list]:
  """({tree: [[seconds of each call] per round]}, [roofline() before round 0, ..., after the last round])."""
  from benchmarks import tree_ab

  times = {k: [] for k in procs}
  names = list(procs)
  roofs = [] if roofline is None else [roofline()]
  for r in range(rounds):
    for k in names[r % 2 :] + names[: r % 2]:
      procs[k].stdin.write(f"run {calls}\n")
      procs[k].stdin.flush()
      times[k].append(tree_ab.reply(procs[k])["times_s"])
    if roofline is not None:
      roofs.append(roofline())
  return times, roofs


def main(argv=None):
  args = _parser().parse_args(argv)
  if args.worker:
    return _worker(args)
  if hasattr(os, "sched_setaffinity"):  # the roofline on the workers' cores
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.threads])
  import numpy as np

  from benchmarks import sampler as bench
  from benchmarks import tree_ab

  base, head = tree_ab.git("rev-parse", "--short", args.base), tree_ab.git("rev-parse", "--short", "HEAD")
  cfg = bench.MODELS[args.model]()
  load_start = os.getloadavg()
  with tempfile.TemporaryDirectory(prefix="sampler_ab_") as tmp:
    old_tree = tree_ab.unpack(base, os.path.join(tmp, base))
    this_flags = _side_flags(args.decode_layers, args.devices)
    base_flags = _side_flags(args.base_decode_layers, args.base_devices)
    procs = {"this": _start(ROOT, args, this_flags), "base": _start(old_tree, args, base_flags)}
    try:
      info = {k: tree_ab.reply(pr) for k, pr in procs.items()}  # both compiled and warm
      load_before = os.getloadavg()
      times, roofs = _rounds(procs, args.rounds, args.calls, bench.measure_roofline)
      load_after = os.getloadavg()
    finally:
      for pr in procs.values():
        pr.stdin.close()
        pr.wait(timeout=60)
  med = {k: [statistics.median(x) for x in v] for k, v in times.items()}
  ratios = [b / t for t, b in zip(med["this"], med["base"])]
  t_roofs = [
    bench.roofline_seconds(cfg, args.batch, args.prompt, args.new, r["peak_flops"], r["bandwidth"]) for r in roofs
  ]
  t_roof = [(a + b) / 2 for a, b in itertools.pairwise(t_roofs)]  # each round's bracketing measurements
  frac = {k: [t / x for t, x in zip(t_roof, v)] for k, v in med.items()}
  roof = {q: statistics.median(r[q] for r in roofs) for q in ("peak_flops", "bandwidth")}
  tok = {k: np.asarray(v["tokens"]) for k, v in info.items()}
  dlogp = float(np.abs(np.asarray(info["this"]["logp"]) - np.asarray(info["base"]["logp"])).max())
  out = {
    "benchmark": "sampler_ab",
    "this": head,
    "base": base,
    "model": args.model,
    "batch": args.batch,
    "prompt": args.prompt,
    "new": args.new,
    "threads": args.threads,
    "param_dtype": args.param_dtype,
    "decode_layers": args.decode_layers or "default",
    "base_decode_layers": args.base_decode_layers or "default",
    "devices": args.devices,
    "base_devices": args.base_devices,
    "rounds": args.rounds,
    "calls": args.calls,
    "peak_flops": roof["peak_flops"],
    "bandwidth": roof["bandwidth"],
    "roofline_s": t_roof,  # per round
    "roofline_per_measurement": roofs,  # before each round and after the last
    "median_generate_s": {k: statistics.median(v) for k, v in med.items()},
    "roofline_fraction": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in frac.items()},
    "speedup_base_over_this": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
    "per_round_ratios": ratios,
    "same_tokens": bool(np.array_equal(tok["this"], tok["base"])),
    "behavior_logp_max_abs_diff": dlogp,
    "first_call_s": {k: v["first_call_s"] for k, v in info.items()},
    "load_avg": [load_start[0], load_before[0], load_after[0]],
  }
  f, s = out["roofline_fraction"], out["speedup_base_over_this"]
  print(
    f"generate B={args.batch} Tp={args.prompt} Tn={args.new} ({args.model}, {args.threads} threads): this {head} "
    f"(decode_layers {args.decode_layers or 'default'}, {args.devices} device(s)) "
    f"{out['median_generate_s']['this']:.2f} s, roofline {f['this']['median']:.2f} ({f['this']['min']:.2f}-"
    f"{f['this']['max']:.2f}); base {base} (decode_layers {args.base_decode_layers or 'default'}, "
    f"{args.base_devices} device(s)) "
    f"{out['median_generate_s']['base']:.2f} s, roofline "
    f"{f['base']['median']:.2f} ({f['base']['min']:.2f}-{f['base']['max']:.2f}); speedup {s['median']:.2f}x "
    f"({s['min']:.2f}-{s['max']:.2f}) over {args.rounds} rounds; same tokens {out['same_tokens']}, "
    f"|dlogp| {dlogp:.1e}; load {load_start[0]:.1f} -> {load_after[0]:.1f}; roofline per round "
    f"{min(t_roof):.3g}-{max(t_roof):.3g} s (peak {roof['peak_flops'] / 1e9:.0f} GFLOP/s, {roof['bandwidth'] / 1e9:.1f} GB/s "
    "median)"
  )
  print(json.dumps(out))


if __name__ == "__main__":
  main()
