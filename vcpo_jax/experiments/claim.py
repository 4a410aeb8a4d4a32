"""The paper's claim on the CPU testbed: does VCPO at a high lag learn as fast as synchronous training?

  nice -n 19 python -m vcpo_jax.experiments.stability --config=configs/stability.py:claim --config.workers=1 \\
      --out=runs/claim                                     # trains (resumable: ledger docs/results/stability_ledger/claim)
  python -m vcpo_jax.experiments.claim --out=docs/results  # this report from the finished cells

The runs are the stability study's (vcpo_jax.experiments.stability, variant `claim` of configs/stability.py):
configs/countdown.py's testbed in sync (k = 0) and exact-lag mode (k in 8, 32, 128), 5 seeds, every method at
its own tuned knob (the equal-budget rule), one lr. This module only reads them and writes
`<out>/claim.md` and `<out>/claim.png`:

- accuracy against the learner step, mean over seeds with a +-1 std band, one panel per k, the synchronous
  reference drawn in each;
- final accuracy (mean of the evaluations in the last `analysis.final_frac` of the steps) mean +- std;
- learner steps to reach 90% of the synchronous reference's final accuracy (the first evaluation at which
  the seed-mean curve reaches it; "never" if it does not);
- collapse counts (the study's rule, `stability.collapsed`);
- the verdict: a method "matches synchronous training" at k when its mean final accuracy is within two
  standard errors of the difference, sqrt(s_a^2 / n_a + s_b^2 / n_b), of the reference's.

The synchronous reference is plain GRPO (`none`) at k = 0: on-policy data, no correction.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from vcpo_jax.experiments import stability

REFERENCE = ("none", 0)  # (method, k) of the synchronous reference
REACH = 0.9  # "steps to reach" this fraction of the reference's final accuracy


def curves(c, summary: dict) -> dict:
  """{(method, k): (eval_steps [E], accuracy [seeds, E], final [seeds], collapsed)} of the finished cells."""
  out = {}
  lr = c.lrs[0]
  for (method, k), z in summary["cells"].items():
    acc, ev = z["accuracy"][0], z["eval_step"][0, 0]
    fin = stability.final_value(acc, ev, c.task.steps, c.analysis.final_frac)
    out[(method, k)] = (ev, acc, fin, summary["stats"][(method, k, lr)]["collapsed"])
  return out


def steps_to_reach(ev: np.ndarray, mean_curve: np.ndarray, target: float) -> float:
  """The first evaluation step at which mean_curve >= target (nan if never)."""
  hit = np.nonzero(mean_curve >= target)[0]
  return float(ev[hit[0]]) if hit.size else math.nan


def matches(a: np.ndarray, b: np.ndarray) -> tuple[bool, float, float]:
  """(within two standard errors, mean(a) - mean(b), that standard error) of two seed samples."""
  se = math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size) if a.size > 1 and b.size > 1 else math.inf
  diff = float(a.mean() - b.mean())
  return abs(diff) <= 2 * se, diff, se


def table(c, cur: dict) -> tuple[list[str], dict]:
  """The markdown rows (method x k) and the verdict facts."""
  ref = cur.get(REFERENCE)
  ref_final = float(ref[2].mean()) if ref else math.nan
  rows = [
    f"| method | k | final accuracy (mean +- std) | steps to {REACH:.0%} of sync | collapsed | vs sync (diff +- SE) |",
    "|---|---:|---:|---:|---:|---|",
  ]
  verdict = {}
  for method in c.methods:
    for k in c.ks:
      if (method, k) not in cur:
        continue
      ev, acc, fin, col = cur[(method, k)]
      reach = steps_to_reach(ev, acc.mean(0), REACH * ref_final)
      same, diff, se = matches(fin, ref[2]) if ref else (False, math.nan, math.nan)
      verdict[(method, k)] = same
      rows.append(
        f"| {method} | {k} | {fin.mean():.3f} +- {fin.std():.3f} (n={fin.size}) | "
        f"{'never' if math.isnan(reach) else int(reach)} | {col}/{fin.size} | "
        f"{'matches' if same else 'differs'} ({diff:+.3f} +- {se:.3f}) |"
      )
  return rows, verdict


def figure(c, cur: dict):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  lagged = [k for k in c.ks if k]
  fig, axes = plt.subplots(1, len(lagged), figsize=(5 * len(lagged), 4), squeeze=False, sharey=True)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for ax, k in zip(axes[0], lagged):
    if REFERENCE in cur:
      ev, acc, *_ = cur[REFERENCE]
      ax.plot(ev, acc.mean(0), "k--", lw=2, label="sync reference (none, k=0)")
    for i, method in enumerate(c.methods):
      if (method, k) not in cur:
        continue
      ev, acc, *_ = cur[(method, k)]
      m, s = acc.mean(0), acc.std(0)
      ax.plot(ev, m, color=colors[i % len(colors)], lw=1.5, label=method)
      ax.fill_between(ev, m - s, m + s, color=colors[i % len(colors)], alpha=0.15)
    ax.set_title(f"exact lag k = {k}")
    ax.set_xlabel("learner step")
    ax.grid(alpha=0.3)
  axes[0, 0].set_ylabel("held-out eval accuracy (mean over seeds, +-1 std)")
  handles, labels = max((ax.get_legend_handles_labels() for ax in axes[0]), key=lambda hl: len(hl[1]))
  fig.legend(handles, labels, loc="lower center", ncol=min(5, len(labels)), fontsize=8, frameon=False)
  fig.suptitle(f"configs/countdown.py testbed, {len(c.seeds)} seeds, lr {c.lrs[0]:g}: stale training vs sync")
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  return fig


def write(c, runs: Path, out: Path, command: str = "python -m vcpo_jax.experiments.claim --out=docs/results") -> Path:
  summary = stability.summarize(c, runs)
  cur = curves(c, summary)
  rows, verdict = table(c, cur)
  ref_final = float(cur[REFERENCE][2].mean()) if REFERENCE in cur else math.nan
  out.mkdir(parents=True, exist_ok=True)
  png = out / "claim.png"
  if cur:
    fig = figure(c, cur)
    fig.savefig(png, dpi=100)
  total = len(c.methods) * len(c.ks)
  lines = [
    "# The paper's claim on the CPU testbed",
    "",
    "Does VCPO at a high lag learn as fast as synchronous training? Runs: `configs/stability.py:claim` "
    "(the countdown testbed of configs/countdown.py in sync and exact-lag mode, each method at its own tuned "
    f"knob, the study's ledger); this page: `{command}`. "
    f"Synchronous reference: {REFERENCE[0]} at k = {REFERENCE[1]}. Cells finished: {len(cur)} of {total}.",
    "",
    f"![accuracy against step]({png.name})",
    "",
    *rows,
    "",
    "## Verdict",
    "",
  ]
  reached = {
    key: not math.isnan(steps_to_reach(ev, acc.mean(0), REACH * ref_final)) for key, (ev, acc, *_) in cur.items()
  }
  for method in c.methods:
    done = [k for k in c.ks if k and (method, k) in verdict]
    if done:
      same = [k for k in done if verdict[(method, k)]]
      fast = [k for k in done if reached[(method, k)]]
      lines.append(
        f"- {method}: final accuracy within seed noise of synchronous training at k = {same or 'none'}, "
        f"reaches {REACH:.0%} of the synchronous final accuracy at k = {fast or 'none'} (of {done})."
      )
  kmax = max(c.ks)
  if ("vcpo", kmax) in cur and REFERENCE in cur:
    fin, n = cur[("vcpo", kmax)][2], cur[("vcpo", kmax)][2].size
    same, diff, se = matches(fin, cur[REFERENCE][2])
    fast = reached[("vcpo", kmax)]
    plain = "matches" if same and fast else "does not match"
    lines += [
      "",
      f"**Plainly: VCPO at k = {kmax} {plain} synchronous training on this testbed** (final {fin.mean():.3f} "
      f"+- {fin.std():.3f} against {ref_final:.3f}, difference {diff:+.3f} +- {se:.3f} over {n} seeds; "
      f"{'reaches' if fast else 'never reaches'} {REACH:.0%} of the synchronous final accuracy in "
      f"{c.task.steps} steps). Within-noise alone is weak evidence with few seeds and a wide spread; a method "
      "matches here only when it is within two standard errors AND reaches the 90% mark.",
    ]
    others = [m for m in c.methods if m != "vcpo" and (m, kmax) in cur and verdict[(m, kmax)] and reached[(m, kmax)]]
    lines.append(f"- Other methods that match at k = {kmax} by the same rule: {others or 'none'}.")
  else:
    lines.append(f"- VCPO at k = {kmax}: not finished yet; no verdict.")
  path = out / "claim.md"
  path.write_text("\n".join(lines) + "\n")
  return path


def main(argv=None) -> int:
  import argparse

  p = argparse.ArgumentParser(prog="python -m vcpo_jax.experiments.claim", description=__doc__.split("\n\n")[0])
  p.add_argument("--runs", default="runs/claim", help="the study's --out (its cells; the ledger fills them)")
  p.add_argument("--out", default="docs/results", help="where claim.md and claim.png go")
  p.add_argument("--methods", default="", help="comma list: report only these of the study's methods")
  p.add_argument("--seeds", default="", help="comma list: only these seeds (the cells the study finished)")
  args = p.parse_args(argv)
  over = {}
  if args.methods:
    over["methods"] = tuple(args.methods.split(","))
  if args.seeds:
    over["seeds"] = tuple(int(x) for x in args.seeds.split(","))
  c = stability.load_config("claim", over)
  command = " ".join(["python -m vcpo_jax.experiments.claim", *(argv if argv is not None else sys.argv[1:])])
  print(write(c, Path(args.runs), Path(args.out), command))
  return 0


if __name__ == "__main__":
  sys.exit(main())
