"""Counterfactual replay: every estimator on the SAME stale batch of a lag run.

Separate runs of two estimators diverge after their first step; this asks the cleaner question, what each
one does with one batch. From a run's checkpoint at step S (its train state and the lag ring of parameter
versions, which every lag checkpoint holds) the stale batch of step S is regenerated exactly as the trainer
would make it (sampled with the parameters of version S - k, rng fold_in(key, S)); `--batches=B` adds B - 1
more stale batches of the same step from the same stale parameters (other rngs). Then per preset
(estimator.PRESETS, one update per step):

  cos_onpolicy   cosine of the preset's gradient to the on-policy reference: the mean of F GRPO ("sync")
                 gradients on fresh batches of the step's prompts sampled with the step's parameters theta_S.
                 Its own noise: ref_split_cos, the cosine between the means of the two halves of the F.
  grad_norm      ||G|| (before clipping); update_norm: ||theta' - theta_S|| of the run's optimizer (its
                 state restored from the checkpoint) applied to G with the preset's lr scale
  ess_ratio      ESS / N of the unclipped importance weights; grad_ess_ratio: telemetry's ESS of the
                 per-trajectory update magnitudes |c_n| ||g_n|| (ghost norms; 0 where the path has none)
  boot_var_rel   tr Cov of G over bootstrap resamples of the batch's groups (with replacement), / ||G||^2
  dreward        mean reward on F fresh batches sampled with theta' minus with theta_S (same rngs: common
                 random numbers), with its standard error over the F batches

Numbers are means over the B batches (and their std over batches in the json). Deterministic given --seed.

  python -m vcpo_jax.experiments.replay --workdir=RUN --step=S [--out=DIR] [--batches=5] [--fresh=8]
      [--bootstrap=8] [--presets=vcpo,seq_tis,...]

writes DIR/replay.json, DIR/replay.md (the table) and DIR/replay.png. RUN is a lag (or sync) run's workdir
with a checkpoint at step S (checkpoint.every / the final step); k is the run's lag.k (0 for sync).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from vcpo_jax import estimator, fs, learner, telemetry
from vcpo_jax.checkpoint import Checkpointer, restore_target
from vcpo_jax.model import policy
from vcpo_jax.run_config import parse_config
from vcpo_jax.sampler import Sampler

REFERENCE = "sync"  # the on-policy reference estimator: GRPO on fresh samples from theta_S
# policy-loss presets with several updates per step are out (one gradient per batch is the question)
DEFAULT_PRESETS = tuple(estimator.PRESETS)


@dataclasses.dataclass
class StepData:
  """What a checkpoint at step S gives: the model, the maker, the run's key, theta_S and theta_{S-k}."""

  spec: object
  graphdef: object
  maker: object
  tx: object
  key: jax.Array
  state: learner.TrainState
  stale_params: object
  step: int
  version: int  # S - k (0 when S < k)


def load_step(workdir: str, step: int) -> StepData:
  """Rebuilds the run of `workdir` (its config.json) and restores its checkpoint at `step`."""
  from vcpo_jax import trainer  # the run's own builders: the same sampler buckets and rollout maker

  record = json.loads(fs.read_text(fs.join(workdir, "config.json")))
  record.pop("provenance", None)
  spec = parse_config(ml_collections.ConfigDict(record))
  mesh = trainer._build_mesh(spec)
  model_cfg, tokenizer, graphdef, params = policy.build_policy(
    spec.model_cfg, mesh, seed=spec.seed, checkpoint=spec.model_checkpoint, tokenizer_dir=spec.tokenizer_dir
  )
  make_sampler = lambda cfg: Sampler(graphdef, model_cfg, cfg, mesh=mesh)
  maker = trainer._build_maker(spec, tokenizer, make_sampler, spec.make_train_problems())
  tx = spec.optim.build(total_steps=spec.steps)
  state, _, _ = trainer._build_learner(spec, graphdef, params, mesh)  # laid out as the run's (the restore target)
  ckpt = Checkpointer(fs.join(workdir, "checkpoints"), keep_last=1000, keep_best=0)
  try:
    if step not in ckpt.all_steps():
      raise ValueError(f"{workdir}: no checkpoint at step {step} (have {ckpt.all_steps()})")
    saved = ckpt.restore_meta(step)
    target = jax.tree.map(restore_target, state)
    template = {"train": target, "versions": [target.params for _ in saved["versions"]], "queued": []}
    tree, meta = ckpt.restore(step, template)
  finally:
    ckpt.close()
  state = tree["train"]
  k = spec.k if spec.mode == "lag" else 0
  version = max(0, step - k)
  ring = dict(zip(meta["versions"], tree["versions"]))
  stale = state.params if version == step else ring[version]
  key = jax.random.key(spec.seed)
  return StepData(spec, graphdef, maker, tx, key, state, stale, step, version)


def _bootstrap(batch: dict, rng: np.random.Generator, group_size: int) -> dict:
  """The batch with its P groups resampled with replacement (rows of a group are contiguous); new group ids."""
  n = batch["tokens"].shape[0]
  p = n // group_size
  pick = rng.integers(0, p, p)
  rows = (pick[:, None] * group_size + np.arange(group_size)[None]).reshape(-1)
  out = {k: np.asarray(v)[rows] for k, v in batch.items()}
  out["group_id"] = np.repeat(np.arange(p), group_size).astype(np.asarray(batch["group_id"]).dtype)
  return out


def _flat(tree) -> np.ndarray:
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def _cos(a: np.ndarray, b: np.ndarray) -> float:
  d = np.linalg.norm(a) * np.linalg.norm(b)
  return float(a @ b / d) if d > 0 else 0.0


def _grad_fn(data: StepData, preset: str):
  """jit(params, batch) -> (grads, scalars): the preset's whole-batch gradient (one update, no micro-batches)."""
  pg = estimator.method_from_preset(preset)
  lcfg = dataclasses.replace(data.spec.learner, method=pg, microbatch_size=0, ppo_epochs=1, minibatches=1)

  def f(params, batch):
    grads, aux = learner._gradient(data.graphdef, params, batch, lcfg)
    g2 = optax.global_norm(grads) ** 2
    tel = telemetry.step_telemetry(aux, g2, batch["rewards"], batch["group_id"], pg, batch["tokens"].shape[1])
    out = dict(ess_ratio=aux["ess_ratio"], lr_scale=aux["lr_scale"], grad_ess_ratio=tel.get("grad/ess_ratio", 0.0))
    return grads, out

  return jax.jit(f)


def replay(
  data: StepData,
  presets=DEFAULT_PRESETS,
  *,
  batches: int = 5,
  fresh: int = 8,
  bootstrap: int = 8,
  reward_batches: int = 1,
  seed: int = 0,
  log=print,
) -> dict:
  """The per-preset numbers of the module docstring, on `batches` stale batches of data.step.

  dreward (fresh samples after the update: the costly part) is measured on the first `reward_batches` only.
  """
  s, maker = data.step, data.maker
  params = data.state.params
  g_size = data.spec.rollout.group_size
  base = jax.random.fold_in(jax.random.key(seed), s)

  def sample(p, key, version):
    b, _ = maker.make(p, s, key, version)
    return {k: np.asarray(v) for k, v in b.device().items()}

  t0 = time.time()
  # the stale batches: #0 is the run's own batch of step S (the trainer's rng), the others other rngs
  stale = [sample(data.stale_params, jax.random.fold_in(data.key, s), data.version)]
  stale += [
    sample(data.stale_params, jax.random.fold_in(jax.random.fold_in(base, 1), j), data.version)
    for j in range(1, batches)
  ]
  fresh_keys = [jax.random.fold_in(jax.random.fold_in(base, 2), j) for j in range(fresh)]
  fresh_b = [sample(params, kk, s) for kk in fresh_keys]
  ref_fn = _grad_fn(data, REFERENCE)
  ref_g = [_flat(ref_fn(params, b)[0]) for b in fresh_b]
  ref = np.mean(ref_g, axis=0)
  half = max(1, fresh // 2)
  ref_split = _cos(np.mean(ref_g[:half], 0), np.mean(ref_g[half:], 0)) if fresh > 1 else float("nan")
  r_before = np.array([b["rewards"].mean() for b in fresh_b])
  log(f"replay: step {s}, k = {s - data.version}, {batches} stale batches, {fresh} fresh ({time.time() - t0:.0f}s)")
  rng = np.random.default_rng(seed)
  boot_idx = [rng.integers(0, 2**31) for _ in range(batches * bootstrap)]
  results = {}
  for name in presets:
    fn = _grad_fn(data, name)
    rows = []
    for bi, batch in enumerate(stale):
      grads, sc = fn(params, batch)
      g = _flat(grads)
      sc = {k: float(v) for k, v in sc.items()}
      updates, _ = data.tx.update(grads, data.state.opt_state, params, ess_scale=sc["lr_scale"])
      new = optax.apply_updates(params, updates)
      boots = []
      for j in range(bootstrap):
        bb = _bootstrap(batch, np.random.default_rng(boot_idx[bi * bootstrap + j]), g_size)
        boots.append(_flat(fn(params, bb)[0]))
      boots = np.array(boots)
      boot_var = float(np.sum(np.var(boots, axis=0, ddof=1))) if bootstrap > 1 else float("nan")
      if bi < reward_batches:
        d = np.array([sample(new, kk, s + 1)["rewards"].mean() for kk in fresh_keys]) - r_before
      else:
        d = np.full(2, np.nan)
      rows.append(
        dict(
          cos_onpolicy=_cos(g, ref),
          grad_norm=float(np.linalg.norm(g)),
          update_norm=float(optax.global_norm(updates)),
          boot_var_rel=boot_var / max(float(g @ g), 1e-30),
          dreward=float(d.mean()),
          dreward_se=float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan"),
          **sc,
        )
      )
    keys = rows[0].keys()
    results[name] = {k: float(np.nanmean([r[k] for r in rows])) for k in keys}
    results[name].update({f"{k}_std": float(np.nanstd([r[k] for r in rows])) for k in keys})
    log(f"  {name:20s} cos {results[name]['cos_onpolicy']:+.3f}  boot_var_rel {results[name]['boot_var_rel']:.3f}")
  return dict(
    step=s,
    k=s - data.version,
    batches=batches,
    fresh=fresh,
    bootstrap=bootstrap,
    reward_batches=reward_batches,
    seed=seed,
    ref_split_cos=ref_split,
    fresh_reward=float(r_before.mean()),
    presets=results,
  )


COLUMNS = (
  "cos_onpolicy",
  "boot_var_rel",
  "grad_norm",
  "update_norm",
  "ess_ratio",
  "grad_ess_ratio",
  "lr_scale",
  "dreward",
)


def table(res: dict) -> str:
  """A markdown table, one row per preset (means over the batches)."""
  head = f"step {res['step']}, k = {res['k']}, {res['batches']} batches, reference: {res['fresh']} fresh GRPO batches "
  head += f"(split-half cosine {res['ref_split_cos']:.3f}), seed {res['seed']}\n\n"
  lines = ["| preset | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
  for name, r in res["presets"].items():
    cells = [f"{r[c]:+.3f} ± {r['dreward_se']:.3f}" if c == "dreward" else f"{r[c]:.3g}" for c in COLUMNS]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return head + "\n".join(lines) + "\n"


def plot(results: list[dict], path: str):
  """One figure: per preset, cosine to the on-policy gradient and bootstrap variance, one series per result (k)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(results[0]["presets"])
  fig, axes = plt.subplots(1, 2, figsize=(12, 0.3 * len(names) + 2))
  y = np.arange(len(names))
  h = 0.8 / len(results)
  for i, res in enumerate(results):
    for ax, col in zip(axes, ("cos_onpolicy", "boot_var_rel")):
      v = [res["presets"][n][col] for n in names]
      e = [res["presets"][n][col + "_std"] for n in names]
      ax.barh(y + i * h, v, h, xerr=e, label=f"k = {res['k']} (step {res['step']})")
  axes[0].set_xlabel("cosine to the on-policy GRPO gradient (mean over batches; bar: std)")
  axes[1].set_xlabel("bootstrap tr Cov(G) / ||G||^2 over resampled groups")
  axes[1].set_xscale("log")
  for ax in axes:
    ax.set_yticks(y + 0.4 - h / 2, names)
    ax.grid(axis="x", alpha=0.3)
  axes[0].legend(fontsize=8)
  r0 = results[0]
  runs = ", ".join(os.path.basename(str(r.get("workdir", "?")).rstrip("/")) for r in results)
  fig.suptitle(
    "counterfactual replay: every estimator on the same stale batches\n"
    f"runs {runs}; {r0['batches']} stale batches per k, reference {r0['fresh']} fresh GRPO batches, "
    f"{r0['bootstrap']} bootstrap resamples, seed {r0['seed']}",
    fontsize=10,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--workdir", required=True, action="append", help="run directory (repeat for several runs)")
  ap.add_argument("--step", type=int, action="append", help="checkpoint step (one per --workdir; default: latest)")
  ap.add_argument("--out", default=None, help="output directory (default: the first workdir's replay/)")
  ap.add_argument("--presets", default=",".join(DEFAULT_PRESETS))
  ap.add_argument("--batches", type=int, default=5)
  ap.add_argument("--fresh", type=int, default=8)
  ap.add_argument("--bootstrap", type=int, default=8)
  ap.add_argument("--reward_batches", type=int, default=1, help="stale batches on which dreward is measured")
  ap.add_argument("--seed", type=int, default=0)
  a = ap.parse_args(argv)
  steps = a.step or [None] * len(a.workdir)
  if len(steps) != len(a.workdir):
    ap.error("give one --step per --workdir (or none)")
  out = a.out or os.path.join(a.workdir[0], "replay")
  os.makedirs(out, exist_ok=True)
  results = []
  for wd, st in zip(a.workdir, steps):
    if st is None:
      c = Checkpointer(fs.join(wd, "checkpoints"), keep_last=1000, keep_best=0)
      st = c.latest_step()
      c.close()
    data = load_step(wd, st)
    res = replay(
      data,
      a.presets.split(","),
      batches=a.batches,
      fresh=a.fresh,
      bootstrap=a.bootstrap,
      reward_batches=a.reward_batches,
      seed=a.seed,
    )
    res["workdir"] = wd
    results.append(res)
  with open(os.path.join(out, "replay.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(out, "replay.md"), "w") as f:
    f.write("\n".join(table(r) for r in results))
  plot(results, os.path.join(out, "replay.png"))
  print("\n".join(table(r) for r in results))
  print(f"wrote {out}/replay.json, replay.md, replay.png")


if __name__ == "__main__":
  main()
