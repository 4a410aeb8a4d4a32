"""Score centering, IPO and KPop beside VCPO on the pure exact-lag testbed (configs/stability.py's task).

    PYTHONPATH=. python -m vcpo_jax.experiments.score_centering_study --out docs/results/score_centering \
        --ks 8,32,128 --seeds 0,1,2,3,4 --lr 3e-3

Methods (name -> estimator preset, score centering):
  vcpo          VCPO (sequence TIS c = 8, OPOB, ESS-scaled rate)                       off
  vcpo_ref      VCPO on the vmap reference gradient path (the cost baseline of the centered runs)
  vcpo_sc       VCPO with every token's score centered exactly (q = the ring's version)  exact, w = 1
  token_tis     token TIS with cap 2 (the control of tis_sc)                                 off
  tis_sc        the paper's TIS+SC: token TIS with cap 2 and the centering's cap 2        exact, C = 2
  sc_top8       as vcpo_sc, q's head = its top 8 of V = 12 ids, the tail modelled         top-k 8
  ipo, kpop     the peer losses (vcpo_jax/policy_losses.py) at their sources' defaults      off
Top-k at k = 64 >= V is the exact form on this vocabulary (tests/test_score_centering.py), so it is not
run separately. One lr for all (3e-3, the lr every method selects at k = 0 in docs/results/stability.md).

Writes <out>/cells/<method>_k<k>.npz (per-step and per-evaluation metrics, [seeds, ...]) and
<out>/summary.json / summary.md: final and best accuracy (mean +- std over seeds), collapse counts (the
stability study's rule), median ESS ratio, the drift metrics of the centered runs, and seconds per learner
step of each method (the whole run's wall time / steps, compile excluded, measured in the same process).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from vcpo_jax import estimator
from vcpo_jax.experiments import pure_lag, stability

# name -> (preset, its method.* overrides, centering: None | "exact" | top-k size)
METHODS = {
  "vcpo": ("vcpo", {}, None),
  "vcpo_ref": ("vcpo", {}, None),  # the same, on the vmap reference gradient path (the centered runs' path)
  "vcpo_sc": ("vcpo", {}, "exact"),
  "token_tis": ("token_tis", {"weights.c": 2.0}, None),  # the control of tis_sc: the same, uncentered
  "tis_sc": ("token_tis", {"weights.c": 2.0}, "exact"),
  "sc_top8": ("vcpo", {}, 8),
  "ipo": ("ipo", {}, None),
  "kpop": ("kpop", {}, None),
}


@functools.lru_cache(maxsize=None)
def compiled_method(cfg, method: str, n_seeds: int, max_k: int):
  """The vmapped (over seeds) run of one method, compiled once (k and lr are traced)."""
  preset, over, sc = METHODS[method]
  pg = estimator.method_from_preset(preset, over)
  if method == "vcpo_ref":
    cfg = dataclasses.replace(cfg, grad_path="reference")
  topk = sc if isinstance(sc, int) else 0
  fn = pure_lag.make_run_fn(cfg, pg, max_k, score_centering_exact=sc is not None, score_centering_topk=topk)
  keys = jax.vmap(jax.random.key)(jnp.arange(n_seeds, dtype=jnp.uint32))
  f = jax.jit(jax.vmap(fn, in_axes=(0, None, None)))
  return f.lower(keys, jnp.float32(1e-3), jnp.int32(0)).compile()


def run_cell(cfg, method: str, k: int, seeds, lr: float, max_k: int):
  """(metrics dict [seeds, ...], seconds of the run excluding compile)."""
  compiled = compiled_method(cfg, method, len(seeds), max_k)
  keys = jax.vmap(jax.random.key)(jnp.asarray(list(seeds), jnp.uint32))
  t0 = time.perf_counter()
  out = jax.device_get(compiled(keys, jnp.float32(lr), jnp.int32(k)))
  return {n: np.asarray(v) for n, v in out.items()}, time.perf_counter() - t0


def interleaved_seconds(cfg, methods, k: int, seeds, lr: float, max_k: int, rounds: int) -> dict:
  """Seconds per learner step of each method, from `rounds` alternating runs (min over rounds)."""
  times = {m: [] for m in methods}
  for _ in range(rounds):
    for m in methods:
      _, secs = run_cell(cfg, m, k, seeds, lr, max_k)
      times[m].append(secs / cfg.steps)
  return {m: dict(min=min(v), all=v) for m, v in times.items()}


def summarize(cells: dict, c, chance: float) -> dict:
  rows = []
  for (method, k), (z, secs) in sorted(cells.items(), key=lambda x: (list(METHODS).index(x[0][0]), x[0][1])):
    final = stability.final_value(z["accuracy"], z["eval_step"][0], c.task.steps, c.analysis.final_frac)
    best = z["accuracy"].max(-1)
    col = stability.collapsed(final, best, chance, c.analysis.collapse_keep, c.analysis.min_gain)
    row = dict(
      method=method,
      k=k,
      final_mean=float(final.mean()),
      final_std=float(final.std()),
      best_mean=float(best.mean()),
      collapsed=int(col.sum()),
      seeds=int(final.shape[0]),
      ess_median=float(np.median(z["ess_ratio"])),
      seconds_per_step=secs / z["reward"].shape[-1],
    )
    for name in ("drift_kl_qp", "drift_k1", "drift_coef_l1"):
      if name in z:
        row[name] = float(np.mean(z[name]))
    rows.append(row)
  return dict(chance=chance, rows=rows)


def to_markdown(s: dict) -> str:
  lines = [
    "| method | k | final | best | collapsed | ESS median | KL(q‖p) exact (top-k: q head mass) | k1 | coef L1 | s / step |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in s["rows"]:
    d = lambda n: f"{r[n]:.4f}" if n in r else "-"
    lines.append(
      f"| {r['method']} | {r['k']} | {r['final_mean']:.3f} +- {r['final_std']:.3f} | {r['best_mean']:.3f} | "
      f"{r['collapsed']}/{r['seeds']} | {r['ess_median']:.3f} | {d('drift_kl_qp')} | {d('drift_k1')} | "
      f"{d('drift_coef_l1')} | {r['seconds_per_step']:.4f} |"
    )
  return "\n".join(lines) + "\n"


def main(argv=None):
  from configs import stability as stability_config

  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="docs/results/score_centering")
  ap.add_argument("--ks", default="8,32,128")
  ap.add_argument("--seeds", default="0,1,2,3,4")
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--steps", type=int, default=0, help="0: the stability task's steps (200)")
  ap.add_argument("--methods", default=",".join(METHODS))
  ap.add_argument("--time-rounds", type=int, default=3, help="interleaved timing rounds of vcpo_ref vs vcpo_sc")
  a = ap.parse_args(argv)
  c = stability_config.get_config()
  if a.steps:
    c.task.steps = a.steps
  cfg = stability.pure_lag_config(c)
  ks = [int(x) for x in a.ks.split(",")]
  seeds = [int(x) for x in a.seeds.split(",")]
  out = Path(a.out)
  (out / "cells").mkdir(parents=True, exist_ok=True)
  cells = {}
  for method in a.methods.split(","):
    for k in ks:
      path = out / "cells" / f"{method}_k{k}.npz"
      if path.exists():
        z = dict(np.load(path))
        secs = float(z.pop("_seconds"))
      else:
        z, secs = run_cell(cfg, method, k, seeds, a.lr, max(ks))
        np.savez(path, _seconds=secs, **z)
      cells[(method, k)] = (z, secs)
      print(method, k, f"{secs:.1f}s", flush=True)
  s = summarize(cells, c, chance=cfg.chance)
  s.update(lr=a.lr, seeds=seeds, ks=ks, steps=c.task.steps)
  old = out / "summary.json"
  if not a.time_rounds and old.exists():  # keep the last interleaved timing when not timing again
    prev = json.loads(old.read_text()).get("interleaved_seconds_per_step")
    if prev:
      s["interleaved_seconds_per_step"] = prev
  if a.time_rounds:
    timed = [m for m in ("vcpo_ref", "vcpo_sc", "sc_top8", "vcpo") if m in a.methods.split(",")]
    s["interleaved_seconds_per_step"] = interleaved_seconds(cfg, timed, ks[0], seeds, a.lr, max(ks), a.time_rounds)
  (out / "summary.json").write_text(json.dumps(s, indent=1))
  md = to_markdown(s)
  for m, v in s.get("interleaved_seconds_per_step", {}).items():
    md += (
      f"\ninterleaved ({len(v['all'])} rounds, k = {ks[0]}, {len(seeds)} seeds vmapped): {m} {v['min']:.4f} s / step"
    )
  (out / "summary.md").write_text(md + "\n")
  print(md)


if __name__ == "__main__":
  main()
