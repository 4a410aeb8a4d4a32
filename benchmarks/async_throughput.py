"""Sync vs async training throughput on the countdown config, and the speedup this machine allows.

  python -m benchmarks.async_throughput                     # defaults below; ~3-5 min on 2 idle cores
  python -m benchmarks.async_throughput --steps=40 --k=2 --hidden=64 --layers=2 --new_tokens=64
  python -m benchmarks.async_throughput --testbed --steps=200 --k=4 --rounds=3   # README's default run itself

`--testbed` times configs/countdown.py as README's first command runs it (its task, model, batch, warm start
from the cache, lr; k from --k) instead of the random-policy config below; only the evaluations in between
are dropped (start and end only, outside the timed window).

Each mode runs the real `trainer.run` in its own fresh interpreter (so XLA flags and CPU affinity are set
before JAX starts) on the same config, a random policy (responses run to the full budget, so every step
does the same work), no SFT, evals only at the start and the end (outside the timed window):

  sync_1core   learner + sampler in one process pinned to one core, single-threaded XLA
               (XLA_FLAGS=--xla_cpu_multi_thread_eigen=false): the phase times for the limit.
  async        learner pinned to core A, the spawned sampler to core B (async_.sampler_cpus), the same
               single-threaded XLA in both processes.
  sync_2core   the default sync run: one unpinned process, XLA's own threading over both cores. This is
               the yardstick a user compares against ("async / sync_2core"); sync_1core only gives the
               phase times for the limit below.
Modes run interleaved, `--rounds` times (sync_1core, async, sync_2core, sync_1core, ...); the ratios are per
round, reported as median and range.

The limit on the async speedup over sync_1core, from sync_1core's measured phase times (generation g,
learning l, per step):  limit = (g + l) / max(g, l)  -- perfect overlap, each process on its own core.
Goal: async / sync_1core >= 0.9 x limit. Also printed: the overlap efficiency, async steps/s x
max(async gen, async learn), 1.0 when the slower phase never waits (phases run slower in the async run
than in sync_1core when both cores are busy: memory bandwidth, caches, other load). Timed window: steps warmup+1 .. steps (compilation excluded);
steps/s = (steps - warmup) / (wall time between those metric rows). Idle fractions over the same window:
sync: the sampler idles while the learner learns and vice versa; async: the learner's queue waits, and
the sampler's time blocked on the staleness bound or a full queue (worker totals).
Prints a table and ends with one JSON line. Other work on the machine distorts all numbers: the JSON
records the load average before and after.
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

SINGLE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false"


def _config(a):
  from configs import countdown

  if a.testbed:
    c = countdown.get_config()
    c.steps = a.steps
    c.eval.every = 0
    c.checkpoint.every = a.steps + 1
    c.async_.timeout_s = 600.0
    c.log.progress = c.log.plots = False
    return c
  c = countdown.get_config("smoke")
  c.steps = a.steps
  c.task.prompts_per_step = a.prompts
  c.task.group_size = a.group
  c.task.max_new_tokens = a.new_tokens
  c.model.hidden_size = a.hidden
  c.model.intermediate_size = 2 * a.hidden
  c.model.num_layers = a.layers
  c.eval.num_problems = 4
  c.eval.n = 1
  c.eval.every = 0
  c.checkpoint.every = a.steps + 1  # only the final save, after the timed window
  c.async_.timeout_s = 600.0
  c.log.norm_overhead_every = 0  # no extra timing steps inside the measured window
  return c


def _run_one(a) -> dict:
  """Child entry: one mode, pinned as requested; returns the measured figures."""
  from vcpo_jax.rollout.process import worker as worker_lib

  if a.learner_cpu >= 0:
    worker_lib.pin_cpus([a.learner_cpu])
  from vcpo_jax import metrics as metrics_lib, rollout, trainer

  c = _config(a)
  infos = []
  c.mode, c.lag.k = "sync", 0  # async below
  if a.mode == "async":
    c.mode, c.lag.k = "async", a.k
    c.async_.queue_slots = a.k + 1
    c.async_.sampler_cpus = str(a.sampler_cpu) if a.sampler_cpu >= 0 else ""
    build = rollout.build_source

    def recording_build_source(*args, **kw):
      src = build(*args, **kw)
      nxt = src.next

      def next_(step):
        batch, info = nxt(step)
        infos.append({k: v for k, v in info.items() if k not in ("texts", "problem_ids")})
        return batch, info

      src.next = next_
      return src

    rollout.build_source = recording_build_source
  with tempfile.TemporaryDirectory() as workdir:
    trainer.run(c, workdir)
    all_recs = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  recs = [r for r in all_recs if "time/learn_s" in r]
  t_start = min(r["wall_time"] for r in all_recs if r["step"] == 0)  # after the step-0 eval
  w, s = a.warmup, a.steps
  by_step = {r["step"]: r for r in recs}
  window = [by_step[i] for i in range(w + 1, s + 1)]
  wall = by_step[s]["wall_time"] - by_step[w]["wall_time"]
  gen = sum(r["time/rollout_s"] for r in window)  # sync: generation; async: the learner's queue wait
  learn = sum(r["time/learn_s"] for r in window)
  out = dict(
    mode=a.mode,
    steps_per_s=(s - w) / wall,
    window_s=wall,
    wall_to_steps_s=by_step[s]["wall_time"] - t_start,
    first_step_s=by_step[1]["wall_time"] - t_start,
    learn_s=learn / len(window),
    lag_max=max(r["train/lag_max"] for r in recs),
    lag_mean=sum(r["train/lag_mean"] for r in window) / len(window),
  )
  if a.mode == "async":
    i0, i1 = infos[w - 1], infos[s - 1]  # info of batch w-1 (end of warm-up) and of the last batch
    out.update(
      learner_wait_s=gen / len(window),
      learner_idle_frac=gen / wall,
      sampler_idle_frac=(i1["sampler_idle_s_total"] - i0["sampler_idle_s_total"])
      / (i1["sampler_elapsed_s_total"] - i0["sampler_elapsed_s_total"]),
      gen_s=sum(i["sampler_gen_s"] for i in infos[w:s]) / (s - w),
    )
  else:
    out.update(gen_s=gen / len(window), learner_idle_frac=1 - learn / wall, sampler_idle_frac=1 - gen / wall)
  return out


def _spawn(a, mode: str, env_extra: dict, pin: bool) -> dict:
  cpus = sorted(os.sched_getaffinity(0))
  args = [sys.executable, "-m", "benchmarks.async_throughput", f"--_child={mode}"]
  for k in ("steps", "warmup", "k", "prompts", "group", "new_tokens", "hidden", "layers"):
    args.append(f"--{k}={getattr(a, k)}")
  if a.testbed:
    args.append("--testbed")
  if pin:
    args += [f"--learner_cpu={cpus[0]}", f"--sampler_cpu={cpus[1 % len(cpus)]}"]
  env = dict(os.environ, **env_extra)
  if "XLA_FLAGS" not in env_extra:
    env.pop("XLA_FLAGS", None)  # XLA's default threading
  with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
    subprocess.run(
      args + [f"--_out={f.name}"], env=env, check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    )
    return json.load(open(f.name))


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--warmup", type=int, default=5, help="steps excluded from the timed window (compilation)")
  p.add_argument("--k", type=int, default=2, help="async staleness bound")
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--group", type=int, default=8)
  p.add_argument("--new_tokens", type=int, default=64)
  p.add_argument("--hidden", type=int, default=64)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--testbed", action="store_true", help="time configs/countdown.py's default run (see above)")
  p.add_argument(
    "--modes",
    default="sync_1core,async,sync_2core",
    help="comma list; sync_1core and async are needed for the limit and the ratio",
  )
  p.add_argument("--rounds", type=int, default=3, help="interleaved rounds: every mode runs once per round")
  p.add_argument("--_child", default="", help=argparse.SUPPRESS)
  p.add_argument("--_out", default="", help=argparse.SUPPRESS)
  p.add_argument("--learner_cpu", type=int, default=-1, help=argparse.SUPPRESS)
  p.add_argument("--sampler_cpu", type=int, default=-1, help=argparse.SUPPRESS)
  a = p.parse_args()
  if not 1 <= a.warmup < a.steps:
    p.error(f"--warmup={a.warmup} must be in [1, steps)")
  if a._child:
    a.mode = a._child.split("_")[0]
    json.dump(_run_one(a), open(a._out, "w"))
    return

  load_before = os.getloadavg()
  t0 = time.time()
  one = {"XLA_FLAGS": SINGLE_THREAD_XLA}
  modes = a.modes.split(",")
  settings = {"sync_1core": (one, True), "async": (one, True), "sync_2core": ({}, False)}
  # Modes run interleaved, round by round, so a change of machine load hits all of them; ratios are per round.
  rounds = []
  for r in range(a.rounds):
    rounds.append({})
    for m in modes:
      rounds[-1][m] = _spawn(a, m, *settings[m])
      # each child's figures as soon as it ends: a run cut short (a time limit on a loaded machine) keeps them
      print(json.dumps({**rounds[-1][m], "round": r, "mode": m, "load": os.getloadavg()[0]}), flush=True)
  load_after = os.getloadavg()
  numeric = lambda m: [c for c, v in rounds[0][m].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
  res = {m: {c: statistics.median(r[m][c] for r in rounds) for c in numeric(m)} for m in modes}

  def per_round(num: str, den: str) -> dict:
    x = [r[num]["steps_per_s"] / r[den]["steps_per_s"] for r in rounds]
    return {"median": statistics.median(x), "min": min(x), "max": max(x), "rounds": x}

  if not {"sync_1core", "async"} <= set(res):
    print(json.dumps(dict(benchmark="async_throughput", results=res, rounds=rounds)))
    return

  s1, asy = res["sync_1core"], res["async"]
  limit = (s1["gen_s"] + s1["learn_s"]) / max(s1["gen_s"], s1["learn_s"])
  vs_1core = per_round("async", "sync_1core")
  vs_2core = per_round("async", "sync_2core") if "sync_2core" in res else None
  ratio = vs_1core["median"]
  # How close the async pipeline comes to its own bottleneck phase as measured during the async run (the
  # phases slow down when both cores are busy; this separates pipeline stalls from that contention).
  overlap = asy["steps_per_s"] * max(asy["gen_s"], asy["learn_s"])
  cols = (
    "steps_per_s",
    "wall_to_steps_s",
    "gen_s",
    "learn_s",
    "learner_idle_frac",
    "sampler_idle_frac",
    "lag_mean",
    "lag_max",
  )
  shape = (
    "configs/countdown.py default"
    if a.testbed
    else (f"N={a.prompts * a.group}, T={24 + a.new_tokens}, D={a.hidden}, L={a.layers}")
  )
  print(f"\ncountdown, {shape}, {a.steps} steps (timed: {a.warmup + 1}..{a.steps}), async k={a.k}")
  print(f"medians over {a.rounds} interleaved rounds")
  print(f"{'mode':<12}" + "".join(f"{c:>19}" for c in cols))
  for name, r in res.items():
    print(f"{name:<12}" + "".join(f"{r[c]:>19.3f}" for c in cols))
  print(
    f"\nasync / sync_1core steps/s: {ratio:.3f} (range {vs_1core['min']:.3f}-{vs_1core['max']:.3f})   "
    f"limit (g + l) / max(g, l) from sync_1core: {limit:.3f}   fraction of limit: {ratio / limit:.3f} (goal >= 0.9)"
  )
  print(f"async steps/s x max(async gen, async learn): {overlap:.3f} (1.0 = the slower phase never waits)")
  if vs_2core:
    print(
      f"async / sync_2core (the default sync run) steps/s: {vs_2core['median']:.3f} "
      f"(range {vs_2core['min']:.3f}-{vs_2core['max']:.3f}): the speedup a user of this machine sees"
    )
  print(
    f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} on {os.cpu_count()} CPUs; "
    f"total {time.time() - t0:.0f} s"
  )
  print(
    json.dumps(
      dict(
        benchmark="async_throughput",
        config=dict(
          testbed=a.testbed,  # True: configs/countdown.py's own task, model and batch (the fields below unused)
          N=a.prompts * a.group,
          new_tokens=a.new_tokens,
          hidden=a.hidden,
          layers=a.layers,
          steps=a.steps,
          warmup=a.warmup,
          k=a.k,
        ),
        results=res,
        rounds=rounds,
        speedup_vs_sync_1core=vs_1core,
        limit=limit,
        fraction_of_limit=ratio / limit,
        overlap_efficiency=overlap,
        speedup_vs_sync_2core=vs_2core,
        loadavg_before=load_before,
        loadavg_after=load_after,
      )
    )
  )


if __name__ == "__main__":
  main()
