"""Where one run of the stability study spends its time, and what recomputing pi_old costs.

  python -m vcpo_jax.experiments.run_cost --part=run      # one countdown run twice: compiles, then cache loads
  python -m vcpo_jax.experiments.run_cost --part=pi_old   # the learner step with and without the pi_old pass
  ... --variant=countdown_quick --steps=3                 # the smoke-sized run (seconds)

`run`: the same run (configs/stability.py:<variant>, --method, --k, seed 0, the first lr) is trained twice
in one process with XLA's persistent compilation cache in a fresh directory, as the study does: the first
run compiles every program and writes it to the cache, the second loads them. For each it prints the wall
and CPU seconds, the compile seconds jax reports (jax.monitoring: backend compile, cache retrieval), the
rollout and learner seconds of step 1 (which include those compiles) and of the other steps (from the
run's metrics.jsonl), the rest (evaluations, start-up, checkpoint), and whether the two runs' metrics are
identical (every logged value but the time/* fields): a cached executable computes what a compiled one does.

`pi_old`: on a random countdown-shaped batch, the jitted learner step of --loss (a policy loss) with
1 x 1 updates (pi_old = sg(pi_theta), no extra pass) and with the study's ppo_epochs x minibatches (one
extra forward for pi_old, then that many updates), next to the forward pass alone and the `none` preset's
step. Median wall and CPU seconds over --repeats calls after a warm-up call. CPU time counts every
thread of the process, so it is less sensitive to other load on the machine than wall time.
"""

from __future__ import annotations

import collections
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def _metrics_without_time(workdir: Path) -> list[dict]:
  from vcpo_jax import metrics as metrics_lib

  recs = metrics_lib.read_jsonl(str(workdir / "metrics.jsonl"))
  return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "wall_time"} for r in recs]


def run_part(c, method: str, k: int, log=print) -> list[dict]:
  """Trains (method, k, seed 0, lr c.lrs[0]) twice with a fresh persistent cache; returns a dict per run."""
  import jax
  from jax import monitoring

  from vcpo_jax import metrics as metrics_lib
  from vcpo_jax import trainer
  from vcpo_jax.experiments import stability as st

  events: dict[str, float] = collections.defaultdict(float)
  monitoring.register_event_duration_secs_listener(lambda e, d, **kw: events.__setitem__(e, events[e] + d))
  tmp = Path(tempfile.mkdtemp(prefix="run_cost_"))
  jax.config.update("jax_compilation_cache_dir", str(tmp / "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  rows = []
  for i, label in enumerate(("compiles (cold cache)", "loads (warm cache)")):
    events.clear()
    wd = tmp / f"run{i}"
    t0, p0 = time.time(), time.process_time()
    trainer.run(st.trainer_run_config(c, method, k, 0, c.lrs[0]), str(wd))
    wall, cpu = time.time() - t0, time.process_time() - p0
    train = [r for r in metrics_lib.read_jsonl(str(wd / "metrics.jsonl")) if "train/pg_loss" in r]
    ro = np.array([r["time/rollout_s"] for r in train])
    le = np.array([r["time/learn_s"] for r in train])
    row = dict(
      run=label,
      wall_s=wall,
      cpu_s=cpu,
      backend_compile_s=events["/jax/core/compile/backend_compile_duration"],
      trace_and_lower_s=events["/jax/core/compile/jaxpr_trace_duration"]
      + events["/jax/core/compile/jaxpr_to_mlir_module_duration"],
      cache_load_s=events["/jax/compilation_cache/cache_retrieval_time_sec"],
      compile_saved_s=events["/jax/compilation_cache/compile_time_saved_sec"],
      rollout_step1_s=float(ro[0]),
      rollout_rest_s=float(ro[1:].sum()),
      learn_step1_s=float(le[0]),
      learn_rest_s=float(le[1:].sum()),
    )
    row["other_s"] = wall - ro.sum() - le.sum()  # evaluations, start-up (model, warm start), checkpoint
    rows.append(row)
    log(json.dumps({key: (round(v, 2) if isinstance(v, float) else v) for key, v in row.items()}))
  same = _metrics_without_time(tmp / "run0") == _metrics_without_time(tmp / "run1")
  log(f"identical metrics (all but time/*) with compiled and with cache-loaded programs: {same}")
  rows.append(dict(identical=same))
  return rows


def _random_batch(n: int, t: int, prompt: int, vocab: int, group: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  valid = np.ones((n, t), bool)
  loss = np.zeros((n, t), bool)
  loss[:, prompt:] = True
  return dict(
    tokens=rng.integers(0, vocab, (n, t)).astype(np.int32),
    valid_mask=valid,
    loss_mask=loss,
    behavior_logp=np.where(loss, -rng.uniform(0.1, 3.0, (n, t)), 0.0).astype(np.float32),
    rewards=rng.integers(0, 2, n).astype(np.float32),
    group_id=np.repeat(np.arange(n // group), group).astype(np.int32),
    policy_version=np.zeros(n, np.int32),
  )


def _time(fn, args, repeats: int) -> tuple[float, float]:
  """Median (wall, CPU) seconds of fn(*args) after one warm-up (compile) call; blocks on the result."""
  import jax

  jax.block_until_ready(fn(*args))
  walls, cpus = [], []
  for _ in range(repeats):
    t0, p0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    walls.append(time.perf_counter() - t0)
    cpus.append(time.process_time() - p0)
  return float(np.median(walls)), float(np.median(cpus))


def pi_old_part(c, loss: str, repeats: int, log=print) -> dict:
  """Median seconds of the forward pass, `none`'s step, `loss` at 1 x 1 and at the study's updates per step."""
  import dataclasses

  import jax

  from vcpo_jax import learner, optim, run_config
  from vcpo_jax import mesh as mesh_lib
  from vcpo_jax.experiments import stability as st
  from vcpo_jax.model import policy

  rc = st.trainer_run_config(c, loss, 8, 0, c.lrs[0])
  spec = run_config.parse_config(rc)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig((1, 1, 1)), devices=jax.devices()[:1])
  model_cfg, _, graphdef, params = policy.build_policy(spec.model_cfg, mesh, seed=spec.seed)
  n, g = spec.rollout.batch_size, rc.task.group_size
  prompt, t = rc.task.max_prompt_len, rc.task.max_prompt_len + rc.task.max_new_tokens
  batch = _random_batch(n, t, prompt, model_cfg.vocab_size, g)
  tx = optim.make_optimizer(spec.lr, weight_decay=spec.weight_decay, clip_norm=spec.clip_norm)
  state = learner.init_state(params, tx)
  logp = jax.jit(learner.make_logp_fn(graphdef))
  res = {"forward (one pi_old pass)": _time(logp, (params, batch), repeats)}
  none_cfg = run_config.parse_config(st.trainer_run_config(c, "none", 8, 0, c.lrs[0])).learner
  for label, cfg in (
    ("none, 1 update", none_cfg),
    (f"{loss}, 1 update (pi_old = sg(pi_theta), no extra pass)", dataclasses.replace(spec.learner, minibatches=1)),
    (
      f"{loss}, {spec.learner.ppo_epochs} x {spec.learner.minibatches} updates (+ pi_old pass)",
      spec.learner,
    ),
  ):
    step = jax.jit(learner.make_train_step(graphdef, tx, cfg))
    res[label] = _time(step, (state, batch), repeats)
  for label, (wall, cpu) in res.items():
    log(f"{label}: {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU (median of {repeats})")
  return res


def main(argv):
  from absl import flags

  from vcpo_jax.experiments import stability as st

  del argv
  F = flags.FLAGS
  overrides = {"task.steps": F.steps, "task.eval_every": F.steps // 6 or F.steps} if F.steps else {}
  c = st.load_config(F.variant, overrides)
  if F.part == "run":
    run_part(c, F.method, F.k)
  else:
    pi_old_part(c, F.loss, F.repeats)


if __name__ == "__main__":
  from absl import app, flags

  flags.DEFINE_enum("part", "run", ["run", "pi_old"], "run: one run's time budget; pi_old: the recompute cost")
  flags.DEFINE_string("variant", "countdown", "configs/stability.py variant (countdown, countdown_quick)")
  flags.DEFINE_string("method", "vcpo", "--part=run: the preset")
  flags.DEFINE_integer("k", 8, "--part=run: lag k")
  flags.DEFINE_integer("steps", 0, "--part=run: learner steps (0: the variant's); evaluations every steps / 6")
  flags.DEFINE_string("loss", "ppo_clip", "--part=pi_old: a policy-loss preset")
  flags.DEFINE_integer("repeats", 20, "--part=pi_old: timed calls per step function")
  app.run(main)
