"""The learner step of this tree against older trees, interleaved: each method's step at each shape.

    python -m benchmarks.learner_step --base=cf66f88                                  # CPU default, vcpo
    python -m benchmarks.learner_step --base=cf66f88,5711660 --methods=none,vcpo --shapes=small,medium

Each tree (this one and every `--base` commit: `git archive <base>` unpacked into a temporary directory) runs
in its own worker process per (method, shape), pinned to the same `--threads` cores, one CPU device. A worker
parses its own tree's `configs/countdown.py` with the --methods preset (`c.method`, as a run sets it) and the
shape's overrides (SHAPES: small is the CPU default, N = P x G = 64 rows x T = 24 + 16 tokens of the 0.4M
policy; medium is a wider and deeper policy on longer rows), builds its own `learner.make_train_step` with the
tree's shipped defaults (learner.grad_telemetry included, as `trainer.run` builds it) and jits it with the
state donated. The weights are the same in every tree: each HF-named tensor of the tree's own layout is drawn
from numpy seeded by the tensor's name (`hf_io.params_to_hf` / `params_from_hf`, so stacked and per-layer
layouts hold equal values; checked by a checksum), as is the batch (numpy seed 0: ragged prompts and responses,
random tokens, 1/0 rewards, a stale behaviour log-prob). Each worker reports XLA's flop and byte counts of its
compiled step (`cost_analysis`, a yardstick the machine's load cannot move) and its first step's loss.

All workers compile and warm up first; then each round asks every worker in turn (the order rotates by
round) to time `--steps` consecutive steps, and the round's ratio is median(this tree) / median(base) per
(method, shape, base). Reported: the median and range of the per-round ratios, median step times, flops and
bytes, and the load average (`os.getloadavg`) before and after. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys
import tempfile
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# shape -> config overrides (the countdown config's field names, the same in every tree since cf66f88)
SHAPES = {
  "small": {},  # the CPU default: 0.4M policy (width 128, 3 layers), N = 64, T = 24 + 16
  "medium": {  # 3.6M policy (width 256, 4 layers), N = 64, T = 32 + 64
    "task.max_prompt_len": 32,
    "task.max_new_tokens": 64,
    "model.hidden_size": 256,
    "model.num_layers": 4,
    "model.intermediate_size": 768,
  },
}


# ----------------------------------------------------------------------------- worker (one tree)


def _same_weights(params, cfg, hf_io):
  """The tree's parameters with every HF-named tensor drawn from numpy seeded by its name (norms at 1)."""
  import numpy as np

  tensors = {}
  for name, t in sorted(hf_io.params_to_hf(params, cfg).items()):
    if name.endswith("norm.weight"):
      tensors[name] = np.ones(t.shape, np.float32)
    else:
      rng = np.random.default_rng(zlib.crc32(name.encode()))
      tensors[name] = (0.02 * rng.standard_normal(t.shape)).astype(np.float32)
  if "lm_head.weight" in tensors and cfg.tie_embeddings:
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
  return hf_io.params_from_hf(tensors, cfg)


def stale_batch(spec, vocab_size: int) -> dict:
  """The benchmarks' fixed learner batch of `spec`'s rollout shapes (numpy seed 0): random tokens in ragged
  prompts and responses, 1/0 rewards and a stale behaviour log-prob. Written here, not imported: this file's
  workers run against older trees (telemetry_overhead and correction_cost use it too)."""
  import numpy as np

  n, tp, tn = spec.rollout.batch_size, spec.rollout.max_prompt_len, spec.rollout.max_new_tokens
  g = spec.rollout.group_size
  rng = np.random.default_rng(0)
  p_len = rng.integers(tp // 2, tp + 1, n)
  r_len = rng.integers(2, tn + 1, n)
  prompt = np.arange(tp)[None] >= tp - p_len[:, None]
  resp = np.arange(tn)[None] < r_len[:, None]
  valid = np.concatenate([prompt, resp], 1)
  loss = np.concatenate([np.zeros_like(prompt), resp], 1)
  return {
    "tokens": np.where(valid, rng.integers(1, vocab_size, valid.shape), 0).astype(np.int32),
    "valid_mask": valid,
    "prompt_mask": np.concatenate([prompt, np.zeros_like(resp)], 1),
    "response_mask": loss.astype(bool),
    "loss_mask": loss.astype(np.float32),
    "behavior_logp": ((-2.0 + 0.3 * rng.normal(size=valid.shape)) * loss).astype(np.float32),
    "rewards": rng.integers(0, 2, n).astype(np.float32),
    "group_id": np.repeat(np.arange(n // g), g).astype(np.int32),
    "policy_version": np.zeros(n, np.int32),
  }


def _cost(step, state, batch) -> dict:
  """XLA's cost analysis of the compiled step (flops, bytes accessed)."""
  cost = step.lower(state, batch).compile().cost_analysis()
  return cost[0] if isinstance(cost, (list, tuple)) else cost


def _worker(args):
  if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.threads])
  sys.path.insert(0, args.tree)
  os.chdir(args.tree)
  import jax
  import jax.numpy as jnp
  import numpy as np

  from configs import countdown
  from vcpo_jax import learner, optim, run_config
  from vcpo_jax.model import hf_io, transformer
  from vcpo_jax.model import tokenizer as tok_lib

  c = countdown.get_config(None)
  if isinstance(c.method, str):  # trees before the method tree (rl/choices.py): a preset name
    c.method = args.method
  else:
    from vcpo_jax.rl import choices

    c.method = choices.preset(args.method)
  overrides = dict(SHAPES[args.shape])
  for kv in filter(None, args.overrides.split(";")):  # a variant of the tree: path=value
    path, v = kv.split("=", 1)
    overrides[path] = ast.literal_eval(v)
  for path, v in overrides.items():
    sec, field = path.split(".")
    setattr(getattr(c, sec), field, v)
  spec = run_config.parse_config(c)
  tok = tok_lib.build_char_tokenizer()
  model_cfg = spec.model_cfg.replace(vocab_size=max(spec.model_cfg.vocab_size, len(tok)))
  _, init = transformer.split(transformer.init(model_cfg, seed=0))
  graphdef, params = transformer.split(_same_weights(init, model_cfg, hf_io))
  held = hf_io.params_to_hf(params, model_cfg)
  checksum = float(sum(np.abs(np.asarray(t, np.float64)).sum() for t in held.values()))
  if hasattr(spec, "optim") and hasattr(spec.optim, "build"):
    tx = spec.optim.build(total_steps=spec.steps)  # as trainer.run builds it
  else:  # older trees
    tx = optim.make_optimizer(spec.lr, weight_decay=spec.weight_decay, clip_norm=spec.clip_norm, b1=spec.b1, b2=spec.b2)
  state = learner.init_state(params, tx)
  batch = {k: jnp.asarray(v) for k, v in stale_batch(spec, model_cfg.vocab_size).items()}
  step = jax.jit(learner.make_train_step(graphdef, tx, spec.learner), donate_argnums=0)
  cost = _cost(step, state, batch)
  unrolled = cost  # XLA counts a loop body once: the scanned layers' flops are counted on the unrolled step
  if getattr(model_cfg, "scan_layers", False):
    cfg_u = model_cfg.replace(scan_layers=False)
    _, init_u = transformer.split(transformer.init(cfg_u, seed=0))
    graphdef_u, params_u = transformer.split(_same_weights(init_u, cfg_u, hf_io))
    step_u = jax.jit(learner.make_train_step(graphdef_u, tx, spec.learner), donate_argnums=0)
    unrolled = _cost(step_u, learner.init_state(params_u, tx), batch)
  t0 = time.perf_counter()
  state, m = step(state, batch)
  jax.block_until_ready((state, m))
  compile_s = time.perf_counter() - t0
  first = {k: float(v) for k, v in m.items() if k in ("loss", "pg_loss", "grad_norm", "update_norm")}
  for _ in range(3):  # warm-up
    state, m = step(state, batch)
  jax.block_until_ready((state, m))
  ready = {
    "ready": True,
    "compile_s": compile_s,
    "n": int(batch["tokens"].shape[0]),
    "t": int(batch["tokens"].shape[1]),
    "params": int(sum(x.size for x in jax.tree.leaves(params))),
    "weights_checksum": checksum,
    "flops": float(cost.get("flops", float("nan"))),
    "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
    "flops_unrolled": float(unrolled.get("flops", float("nan"))),
    "bytes_unrolled": float(unrolled.get("bytes accessed", float("nan"))),
    "grad_metrics": sum(k.startswith("grad/") for k in m),
    "first_step": first,
  }
  print(json.dumps(ready), flush=True)
  for line in sys.stdin:
    times = []
    for _ in range(int(line.split()[1])):
      t0 = time.perf_counter()
      state, m = step(state, batch)
      jax.block_until_ready((state, m))
      times.append(time.perf_counter() - t0)
    print(json.dumps({"times_s": times}), flush=True)


# ----------------------------------------------------------------------------- driver


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--base", default="cf66f88", help="git commits of the older trees, comma-separated")
  p.add_argument("--variants", default="", help="variants of this tree, comma-separated, each path=value[;...]")
  p.add_argument("--methods", default="vcpo", help="method presets, comma-separated (none: the plain GRPO step)")
  p.add_argument("--shapes", default="small", help=f"comma-separated, of {sorted(SHAPES)}")
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--steps", type=int, default=10, help="consecutive steps timed per worker per round")
  p.add_argument("--threads", type=int, default=os.cpu_count(), help="cores of each worker (the same ones)")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--tree", default="", help=argparse.SUPPRESS)
  p.add_argument("--overrides", default="", help=argparse.SUPPRESS)
  p.add_argument("--method", default="vcpo", help=argparse.SUPPRESS)
  p.add_argument("--shape", default="small", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    return _worker(args)
  from benchmarks import tree_ab  # the driver's side only: a worker runs against an older tree

  methods, shapes = args.methods.split(","), args.shapes.split(",")
  for name, v in (("--rounds", args.rounds), ("--steps", args.steps), ("--threads", args.threads)):
    if v < 1:
      print(f"error: {name}={v}: must be >= 1.", file=sys.stderr)
      return 2
  if bad := [s for s in shapes if s not in SHAPES]:
    print(f"error: --shapes={args.shapes}: unknown {bad}; choose from {sorted(SHAPES)}.", file=sys.stderr)
    return 2
  bases = [tree_ab.git("rev-parse", "--short", b) for b in args.base.split(",") if b]
  head = tree_ab.git("rev-parse", "--short", "HEAD") + (
    "-dirty" if tree_ab.git("status", "--porcelain", "vcpo_jax") else ""
  )
  load_start = os.getloadavg()
  with tempfile.TemporaryDirectory(prefix="learner_step_") as tmp:
    sides = {"this": (ROOT, "")}  # side -> (tree, overrides)
    sides.update({f"this[{v}]": (ROOT, v) for v in args.variants.split(",") if v})
    for b in bases:
      sides[b] = (tree_ab.unpack(b, os.path.join(tmp, b)), "")
    keys = [(side, m, s) for s in shapes for m in methods for side in sides]
    procs = {}
    try:
      for k in keys:  # compiled side by side; the timed rounds run one worker at a time
        tree, overrides = sides[k[0]]
        flags = [f"--tree={tree}", f"--overrides={overrides}", f"--method={k[1]}", f"--shape={k[2]}"]
        procs[k] = tree_ab.start(__file__, tree, [*flags, f"--threads={args.threads}"])
      info = {k: tree_ab.reply(procs[k]) for k in keys}
      times = {k: [] for k in keys}
      load_before = os.getloadavg()
      for r in range(args.rounds):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
          procs[k].stdin.write(f"run {args.steps}\n")
          procs[k].stdin.flush()
          times[k].append(statistics.median(tree_ab.reply(procs[k])["times_s"]))
      load_after = os.getloadavg()
    finally:
      for pr in procs.values():
        pr.stdin.close()
        pr.wait(timeout=60)
  fields = ("step_ms", "flops", "flops_unrolled", "bytes_accessed", "bytes_unrolled", "grad_metrics", "compile_s")
  rows = []
  for s in shapes:
    for m in methods:
      for side in list(sides)[1:]:
        this, other = ("this", m, s), (side, m, s)
        ratios = [a / c for a, c in zip(times[this], times[other])]
        for k in (this, other):
          info[k]["step_ms"] = 1e3 * statistics.median(times[k])
        row = {"shape": s, "method": m, "base": side, "n": info[this]["n"], "t": info[this]["t"]}
        row.update(
          params=info[this]["params"], same_weights=info[this]["weights_checksum"] == info[other]["weights_checksum"]
        )
        row.update(ratio_median=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
        row["per_round_ratios"] = ratios
        row.update({f: {"this": info[this][f], "base": info[other][f]} for f in fields})
        row["first_step"] = {"this": info[this]["first_step"], "base": info[other]["first_step"]}
        rows.append(row)
  print(f"learner step, this tree {head} / base, {args.rounds} rounds x {args.steps} steps, {args.threads} threads")
  for row in rows:
    fl, ms = row["flops_unrolled"], row["step_ms"]
    print(
      f"  {row['shape']:6s} {row['method']:5s} (N={row['n']}, T={row['t']}) / {row['base']}: "
      f"ratio median {row['ratio_median']:.3f} [{row['ratio_min']:.3f}, {row['ratio_max']:.3f}]; "
      f"{ms['this']:.1f} vs {ms['base']:.1f} ms; GFLOPs (unrolled) {fl['this'] / 1e9:.4f} vs {fl['base'] / 1e9:.4f}; "
      f"grad/ metrics {row['grad_metrics']['this']} vs {row['grad_metrics']['base']}; same weights {row['same_weights']}"
    )
  print(f"  load average: start {load_start[0]:.2f}, rounds {load_before[0]:.2f} -> {load_after[0]:.2f}")
  out = {"benchmark": "learner_step", "this": head, "bases": list(sides)[1:], "rounds": args.rounds}
  out.update(steps=args.steps, threads=args.threads, rows=rows, load_start=load_start)
  out.update(load_before=load_before, load_after=load_after, cpus=os.cpu_count())
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
