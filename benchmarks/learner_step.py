"""The CPU default's learner step (configs/countdown.py) of this tree against an older tree, interleaved.

    python -m benchmarks.learner_step                         # against main 2c26132 (issue 10 filed there)
    python -m benchmarks.learner_step --base=182ce29 --rounds=9 --steps=20

Issue 10 "Must keep": the CPU default's learner step no slower than before the scale work by more
than 5%. The CPU default already runs with the scale features off (dense attention, remat "none",
one pass instead of micro-batches, a log-prob head chunk larger than T = 40), so "the same step with
them off" is the step itself; what can slow it is the code around them (activation constraints,
micro-batch and budget logic, the chunked head). So the yardstick is the older tree's own step:
`git archive <base>` is unpacked into a temporary directory and each tree runs in its own worker
process (its own `configs/countdown.py`, `run_config.parse_config`, `learner.make_train_step`, jitted
with the state donated as `trainer.run` does, one CPU device), on the same batch of N = P x G = 64
rows x T = 24 + 16 tokens (numpy seed 0: random tokens, 1/0 rewards, a stale behaviour log-prob).

Both workers compile and warm up first; then each round asks every worker in turn (the order rotates)
to time `--steps` consecutive steps, and the round's ratio is median(this tree) / median(base). Reported:
the median and range of the per-round ratios and the load average (`os.getloadavg`) before and after.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- worker (one tree)


def _worker(tree: str):
  sys.path.insert(0, tree)
  os.chdir(tree)
  import jax
  import jax.numpy as jnp
  import numpy as np

  from configs import countdown
  from vcpo_jax import learner, optim, run_config
  from vcpo_jax.model import tokenizer as tok_lib
  from vcpo_jax.model import transformer

  spec = run_config.parse_config(countdown.get_config(None))
  tok = tok_lib.build_char_tokenizer()
  model_cfg = spec.model_cfg.replace(vocab_size=max(spec.model_cfg.vocab_size, len(tok)))
  graphdef, params = transformer.split(transformer.init(model_cfg, seed=spec.seed))
  tx = optim.make_optimizer(
    spec.lr,
    weight_decay=spec.weight_decay,
    clip_norm=spec.clip_norm,
    b1=spec.b1,
    b2=spec.b2,
    schedule=spec.schedule,
    total_steps=spec.steps,
  )
  state = learner.init_state(params, tx)
  n, tp, tn = spec.rollout.batch_size, spec.rollout.max_prompt_len, spec.rollout.max_new_tokens
  g = spec.rollout.group_size
  rng = np.random.default_rng(0)
  p_len = rng.integers(tp // 2, tp + 1, n)
  r_len = rng.integers(2, tn + 1, n)
  prompt = np.arange(tp)[None] >= tp - p_len[:, None]
  resp = np.arange(tn)[None] < r_len[:, None]
  valid = np.concatenate([prompt, resp], 1)
  loss = np.concatenate([np.zeros_like(prompt), resp], 1)
  batch = dict(
    tokens=np.where(valid, rng.integers(1, model_cfg.vocab_size, valid.shape), 0).astype(np.int32),
    valid_mask=valid,
    prompt_mask=np.concatenate([prompt, np.zeros_like(resp)], 1),
    response_mask=np.concatenate([np.zeros_like(prompt), resp], 1),
    loss_mask=loss.astype(np.float32),
    behavior_logp=((-2.0 + 0.3 * rng.normal(size=valid.shape)) * loss).astype(np.float32),
    rewards=rng.integers(0, 2, n).astype(np.float32),
    group_id=np.repeat(np.arange(n // g), g).astype(np.int32),
    policy_version=np.zeros(n, np.int32),
  )
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  step = jax.jit(learner.make_train_step(graphdef, tx, spec.learner), donate_argnums=0)
  t0 = time.perf_counter()
  state, m = step(state, batch)
  jax.block_until_ready((state, m))
  compile_s = time.perf_counter() - t0
  for _ in range(3):  # warm-up
    state, m = step(state, batch)
  jax.block_until_ready((state, m))
  print(json.dumps({"ready": True, "compile_s": compile_s, "n": n, "t": tp + tn}), flush=True)
  for line in sys.stdin:
    k = int(line.split()[1])
    times = []
    for _ in range(k):
      t0 = time.perf_counter()
      state, m = step(state, batch)
      jax.block_until_ready((state, m))
      times.append(time.perf_counter() - t0)
    print(json.dumps({"times_s": times}), flush=True)


# ----------------------------------------------------------------------------- driver


def _start(tree: str):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=tree)
  env.pop("XLA_FLAGS", None)  # one CPU device, as the CPU default runs
  cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"--tree={tree}"]
  proc = subprocess.Popen(cmd, env=env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  return proc


def _read(proc) -> dict:
  for line in proc.stdout:
    if line.startswith("{"):
      return json.loads(line)
  raise RuntimeError(f"worker exited with {proc.wait()} (see its stderr above)")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--base", default="2c26132", help="git commit of the older tree")
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--steps", type=int, default=10, help="consecutive steps timed per worker per round")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--tree", default="", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    return _worker(args.tree)
  base = subprocess.run(
    ["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True, check=True
  ).stdout.strip()
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
  with tempfile.TemporaryDirectory(prefix="learner_step_") as tmp:
    old_tree = os.path.join(tmp, base)
    os.makedirs(old_tree)
    archive = subprocess.run(["git", "archive", base], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", old_tree], input=archive, check=True)
    trees = {"this": ROOT, "base": old_tree}
    procs = {k: _start(v) for k, v in trees.items()}
    try:
      info = {k: _read(pr) for k, pr in procs.items()}  # both compiled and warm
      times = {k: [] for k in trees}
      load_before = os.getloadavg()
      names = list(trees)
      for r in range(args.rounds):
        for k in names[r % 2 :] + names[: r % 2]:
          procs[k].stdin.write(f"run {args.steps}\n")
          procs[k].stdin.flush()
          times[k].append(_read(procs[k])["times_s"])
      load_after = os.getloadavg()
    finally:
      for pr in procs.values():
        pr.stdin.close()
        pr.wait(timeout=60)
  med = {k: [statistics.median(x) for x in v] for k, v in times.items()}
  ratios = [a / b for a, b in zip(med["this"], med["base"])]
  out = dict(
    benchmark="learner_step",
    config="configs/countdown.py",
    this=head.strip(),
    base=base,
    n=info["this"]["n"],
    t=info["this"]["t"],
    rounds=args.rounds,
    steps=args.steps,
    median_step_s={k: statistics.median(v) for k, v in med.items()},
    compile_s={k: v["compile_s"] for k, v in info.items()},
    ratio_this_over_base=dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios)),
    per_round_ratios=ratios,
    load_before=load_before,
    load_after=load_after,
    goal_ratio_le=1.05,
  )
  print(
    f"learner step, configs/countdown.py (N={out['n']}, T={out['t']}): this tree {out['this']} "
    f"{out['median_step_s']['this'] * 1e3:.1f} ms, base {base} {out['median_step_s']['base'] * 1e3:.1f} ms; "
    f"ratio median {out['ratio_this_over_base']['median']:.3f} "
    f"[{out['ratio_this_over_base']['min']:.3f}, {out['ratio_this_over_base']['max']:.3f}] over {args.rounds} rounds; "
    f"load {load_before[0]:.1f} -> {load_after[0]:.1f}"
  )
  print(json.dumps(out))


if __name__ == "__main__":
  main()
