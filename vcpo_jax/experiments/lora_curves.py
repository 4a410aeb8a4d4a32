"""LoRA VCPO vs full VCPO on the RL testbed (configs/countdown.py): eval accuracy curves over seeds.

    python -m vcpo_jax.experiments.lora_curves --out=docs/results --runs=runs/lora_curves \
        --seeds=0,1,2 --tune_seed=3 --full_lrs=1e-4,2e-4,4e-4 --lora_lrs=1e-3,2e-3,4e-3 --rank=8 --alpha=16

Both sides run `vcpo_jax.trainer.run` on configs/countdown.py with method "vcpo" in `lag` mode (exact
staleness k, deterministic), the same steps, batches and evaluation schedule; the LoRA side adds
model.lora_rank / lora_alpha (adapters on all seven projections) on top of the same warm-started base (the
plain model's cached warm start: trainer._warm_start). The lr of each side is chosen on `--tune_seed` (not
reported) from its own list of the same length (the same tuning budget), by the mean eval accuracy of the
last three evaluations; the reported seeds then run at the chosen lr. Each run keeps its directory under
RUNS/ and is skipped when finished (resumable). Writes OUT/lora_accuracy.md and OUT/lora_accuracy.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np

from vcpo_jax import mesh as mesh_lib
from vcpo_jax import metrics as metrics_lib
from vcpo_jax import run_config as run_config_lib
from vcpo_jax import trainer
from vcpo_jax.model import lora as lora_lib
from vcpo_jax.model import policy
from vcpo_jax.rl import choices

LAST_EVALS = 3  # the selection score: mean eval accuracy over the last 3 evaluations (steps 150, 175, 200)


def run_config(a, lora: bool, seed: int, lr: float):
  """configs/countdown.py at this side's settings (lag mode, k = a.k, VCPO, one checkpoint at the end)."""
  root = str(Path(__file__).resolve().parents[2])  # configs/ lives at the repository root
  if root not in sys.path:
    sys.path.insert(0, root)
  from configs import countdown

  c = countdown.get_config()
  c.seed, c.method, c.mode, c.lag.k, c.optim.lr = seed, choices.preset("vcpo"), "lag", a.k, lr
  c.checkpoint.every = c.steps  # the study keeps metrics only
  c.log.progress, c.log.plots = False, False
  if lora:
    c.model.lora_rank, c.model.lora_alpha = a.rank, a.alpha
  return c


def run_dir(a, lora: bool, seed: int, lr: float) -> Path:
  side = f"lora_r{a.rank}_a{a.alpha:g}" if lora else "full"
  return Path(a.runs) / f"{side}_k{a.k}_lr{lr:g}_seed{seed}"


def train(a, lora: bool, seed: int, lr: float) -> Path:
  """The run's directory, trained through vcpo_jax.trainer.run unless already finished (summary.json)."""
  wd = run_dir(a, lora, seed, lr)
  if not (wd / "summary.json").exists():
    shutil.rmtree(wd, ignore_errors=True)
    t0 = time.time()
    trainer.run(run_config(a, lora, seed, lr), str(wd))
    shutil.rmtree(wd / "checkpoints", ignore_errors=True)
    print(f"[lora_curves] {wd.name}: {time.time() - t0:.0f} s", flush=True)
  return wd


def read(wd: Path) -> dict:
  """Eval curve, loop and learner speed of one finished run."""
  recs = metrics_lib.read_jsonl(str(wd / "metrics.jsonl"))
  evals = sorted({r["step"]: r["eval/accuracy"] for r in recs if "eval/accuracy" in r}.items())
  train_recs = [r for r in recs if "train/pg_loss" in r]
  wall = [r["wall_time"] for r in train_recs]
  learn = np.asarray([r["time/learn_s"] for r in train_recs[1:]])  # step 1 holds the compile
  return {
    "step": np.asarray([s for s, _ in evals]),
    "accuracy": np.asarray([x for _, x in evals]),
    "steps_per_s": (len(wall) - 1) / (wall[-1] - wall[0]),  # the whole loop: sampling, learning, evaluations
    "learn_ms": float(np.median(learn) * 1e3),
  }


def score(run: dict) -> float:
  return float(np.mean(run["accuracy"][-LAST_EVALS:]))


def sizes(a, lora: bool) -> dict:
  """Trainable parameters and the bytes one publish moves (the trainable subtree: what an async run sends)."""
  spec = run_config_lib.parse_config(run_config(a, lora, 0, 1e-3), check_prompts=False)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 1, 1)), devices=jax.devices()[:1])
  _, _, _, params = policy.build_policy(spec.model_cfg, mesh, seed=0)
  trainable = lora_lib.split(params)[0]
  return {
    "params": sum(x.size for x in jax.tree.leaves(params)),
    "trainable": sum(x.size for x in jax.tree.leaves(trainable)),
    "publish_bytes": lora_lib.num_bytes(trainable),
  }


def tune(a, lora: bool, lrs: list[float]) -> tuple[float, dict]:
  scores = {lr: score(read(train(a, lora, a.tune_seed, lr))) for lr in lrs}
  return max(scores, key=scores.get), scores


def plot(a, sides: dict, path: Path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.2))
  for (name, side), color in zip(sides.items(), ("tab:blue", "tab:orange")):
    acc = np.stack([r["accuracy"] for r in side["runs"]])  # [S, E]
    step = side["runs"][0]["step"]
    label = f"{name}, lr {side['lr']:g}: mean of {len(side['runs'])} seeds, band = min-max"
    ax.plot(step, acc.mean(0), color=color, marker="o", ms=3, lw=1.6, label=label)
    ax.fill_between(step, acc.min(0), acc.max(0), color=color, alpha=0.2, lw=0)
  ax.set_xlabel("learner step")
  ax.set_ylabel("held-out eval accuracy (mean@3)")
  ax.set_title(
    f"countdown (configs/countdown.py), VCPO, lag k={a.k}, seeds {a.seeds}: LoRA vs full fine-tuning", fontsize=9
  )
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def report(a, sides: dict, command: str) -> str:
  lines = [
    "# LoRA VCPO vs full VCPO on the RL testbed: eval accuracy over seeds",
    "",
    f"Generated by `{command}`.",
    "",
    (
      f"configs/countdown.py (warm-started 0.4M-parameter policy, 8 prompts x 8 samples, 200 steps, evaluations "
      f"every 25 steps: mean@3 on 256 held-out problems), method vcpo, `lag` mode k = {a.k} (every batch sampled "
      f"with the parameters of {a.k} steps earlier; deterministic). LoRA: rank {a.rank}, alpha {a.alpha:g}, all "
      "seven projections, on the same warm-started base as the full run of each seed (B = 0: step 0 is the same "
      f"model). lr chosen on seed {a.tune_seed} (not reported) by the mean eval accuracy of the last "
      f"{LAST_EVALS} evaluations, {len(sides['full']['scores'])} values per side:"
    ),
    "",
    f"| side | lr tried (seed {a.tune_seed} score) | chosen |",
    "|---|---|---|",
  ]
  for name, side in sides.items():
    tried = ", ".join(f"{lr:g} ({s:.3f})" for lr, s in side["scores"].items())
    lines.append(f"| {name} | {tried} | {side['lr']:g} |")
  lines += [
    "",
    (
      f"Seeds {a.seeds} at the chosen lr; accuracy mean +- std over seeds (population std), speed medians over seeds. "
      "steps/s is the whole loop (sampling, learning, evaluations); learner ms is the median learner step (step 1, "
      "the compile, left out). Publish bytes: the trainable subtree in float32, what one publish of an async run "
      "moves (lag mode keeps versions in memory instead)."
    ),
    "",
    (
      "| side | lr | acc step 0 | final acc (step 200) | last-3-eval acc | best acc | steps/s | learner ms "
      "| trainable params | publish bytes / step |"
    ),
    "|---|---:|---|---|---|---|---:|---:|---:|---:|",
  ]
  for name, side in sides.items():
    runs = side["runs"]
    ms = lambda xs: f"{np.mean(xs):.3f} +- {np.std(xs):.3f}"
    sz = side["sizes"]
    lines.append(
      f"| {name} | {side['lr']:g} | {ms([r['accuracy'][0] for r in runs])} | {ms([r['accuracy'][-1] for r in runs])} "
      f"| {ms([score(r) for r in runs])} | {ms([r['accuracy'][1:].max() for r in runs])} "
      f"| {np.median([r['steps_per_s'] for r in runs]):.2f} | {np.median([r['learn_ms'] for r in runs]):.1f} "
      f"| {sz['trainable']:,} of {sz['params']:,} | {sz['publish_bytes']:,} |"
    )
  lines += ["", "Per seed, final eval accuracy:", ""]
  for name, side in sides.items():
    per = ", ".join(f"seed {s}: {r['accuracy'][-1]:.3f}" for s, r in zip(a.seeds, side["runs"]))
    lines.append(f"- {name}: {per}")
  return "\n".join(lines) + "\n"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default="docs/results")
  p.add_argument("--runs", default="runs/lora_curves")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--tune_seed", type=int, default=3)
  p.add_argument("--full_lrs", default="1e-4,2e-4,4e-4")
  p.add_argument("--lora_lrs", default="1e-3,2e-3,4e-3")
  p.add_argument("--rank", type=int, default=8)
  p.add_argument("--alpha", type=float, default=16.0)
  p.add_argument("--k", type=int, default=8)
  a = p.parse_args(argv)
  command = "python -m vcpo_jax.experiments.lora_curves " + " ".join(argv if argv is not None else sys.argv[1:])
  a.seeds = [int(s) for s in a.seeds.split(",")]
  lrs = {"full": [float(x) for x in a.full_lrs.split(",")], "lora": [float(x) for x in a.lora_lrs.split(",")]}
  if len(lrs["full"]) != len(lrs["lora"]):
    raise SystemExit("--full_lrs and --lora_lrs: give both sides the same number of values (the same budget).")
  sides = {}
  for name, lora in (("full", False), (f"LoRA r {a.rank}", True)):
    lr, scores = tune(a, lora, lrs["lora" if lora else "full"])
    runs = [read(train(a, lora, s, lr)) for s in a.seeds]
    sides[name] = {"lr": lr, "scores": scores, "runs": runs, "sizes": sizes(a, lora)}
  os.makedirs(a.out, exist_ok=True)
  plot(a, sides, Path(a.out) / "lora_accuracy.png")
  text = report(a, sides, command)
  (Path(a.out) / "lora_accuracy.md").write_text(text)
  (Path(a.out) / "lora_accuracy.json").write_text(
    json.dumps(
      {
        n: {
          "lr": s["lr"],
          "scores": {f"{k:g}": v for k, v in s["scores"].items()},
          "sizes": s["sizes"],
          "runs": [{k: np.asarray(v).tolist() for k, v in r.items()} for r in s["runs"]],
        }
        for n, s in sides.items()
      },
      indent=1,
    )
  )
  print(text)


if __name__ == "__main__":
  main()
