"""The stability study (issue 6): methods x lag k x seeds x learning rates.

Launch (writes docs/results/stability.md and PNGs; resumes finished cells):

  python -m vcpo_jax.experiments.stability --out=docs/results
  python -m vcpo_jax.experiments.stability --out=/tmp/stab --config=configs/stability.py:quick   # minutes, smoke
  python -m vcpo_jax.experiments.stability --out=docs/results --config.seeds="(0,1,2)"
  python -m vcpo_jax.experiments.stability --out=docs/results --config=configs/stability.py:countdown   # the real trainer, ~1.5 h

Backend "pure_lag" (vcpo_jax/experiments/pure_lag.py): a tiny transformer on the
synthetic stride-counting task, one fully jitted exact-lag run per (seed, lr),
compiled once per method and vmapped. The selection rule and the collapse and
alarm definitions below are fixed BEFORE the study runs (review #10).
"""

import ml_collections

# Ordered so that the most informative cells finish first if the study is interrupted.
METHODS = (
  "none",
  "seq_tis",
  "vcpo",
  "vcpo_no_esslr",
  "vcpo_no_opob",
  "clip",
  "mask",
  "token_tis",
  "vcpo_applied_opob",
  "vcpo_loo_opob",
  "vcpo_reference",
)

# The ten methods (the reference's exact inconsistencies, vcpo_reference, are in the synthetic study).
COUNTDOWN_METHODS = tuple(m for m in METHODS if m != "vcpo_reference")


def get_config(arg: str | None = None):
  c = ml_collections.ConfigDict()
  c.backend = "pure_lag"  # "pure_lag" (synthetic, vmapped runs) or "trainer" (vcpo_jax.trainer.run, one run at a time)
  c.methods = METHODS  # estimator.PRESETS names; seq_tis uses c = 8
  c.ks = (0, 8, 32, 128)  # exact lag k (0 = synchronous)
  c.seeds = (0, 1, 2, 3, 4)  # one PRNG key per seed: init, sampling and evaluation streams
  c.lrs = (1e-3, 3e-3, 1e-2)  # the SAME grid for every method (equal tuning budget, review #10)
  c.workers = 2  # processes; methods are split between them so each compiles a method once

  c.task = ml_collections.ConfigDict()
  c.task.alphabet = 8  # response symbols; vocab = alphabet + max_stride, chance = 1 / vocab
  c.task.max_stride = 4  # strides 1..4 -> 32 distinct prompts
  c.task.resp_len = 16  # response tokens T
  c.task.prompts_per_step = 8  # P
  c.task.group_size = 8  # G (N = 64 trajectories per step)
  c.task.steps = 200  # learner steps per run
  c.task.eval_every = 10  # accuracy of the current policy every this many steps
  c.task.eval_samples = 2  # samples per prompt in each evaluation (all 32 prompts)

  c.model = ml_collections.ConfigDict()
  c.model.hidden = 32  # D
  c.model.layers = 1  # transformer blocks
  c.model.heads = 2  # attention heads
  c.model.mlp = 64  # MLP width

  c.optim = ml_collections.ConfigDict()
  c.optim.weight_decay = 0.1  # AdamW (released runs)
  c.optim.clip_norm = 1.0  # global-norm clip (released runs)

  c.analysis = ml_collections.ConfigDict()
  c.analysis.final_frac = 0.1  # "final" = mean accuracy over the evaluations in the last 10% of steps
  c.analysis.collapse_keep = 0.5  # collapsed: final gain over chance < 0.5 x best gain over chance ...
  c.analysis.min_gain = 0.1  # ... among runs whose best gain over chance was at least this, or final < chance
  c.analysis.ess_thresholds = (0.1, 0.25, 0.5)  # alarm: trailing median ESS ratio below this
  c.analysis.ess_window = 10  # steps in the trailing median
  c.analysis.select = "best_final_at_k0"  # per method: lr with the best mean final accuracy at k = 0

  c.trainer = ml_collections.ConfigDict()
  c.trainer.config = "countdown"  # backend "trainer": configs/<this>.py is the run config
  c.trainer.variant = ""  # its variant ('' or 'smoke')
  c.trainer.runs = "runs/stability_countdown"  # one directory per run (metrics.jsonl); resumable

  if arg in ("countdown", "countdown_quick"):  # the real trainer on the CPU countdown config (issue 6)
    c.backend = "trainer"
    c.methods = COUNTDOWN_METHODS
    c.seeds = (0, 1, 2)
    c.lrs = (3e-4, 1e-3)  # the CPU default's lr and 3.3x it (which first costs accuracy even at k = 0)
    c.task = ml_collections.ConfigDict()
    c.task.steps = 120  # learner steps (the CPU default); k = 128 >= steps: every batch is the warm start's
    c.task.eval_every = 20  # evaluations at steps 0, 20, ..., 120
    c.analysis.chance = 0.0  # a verified task: a policy that learned nothing scores ~0
    c.analysis.final_frac = 0.2  # final = mean of the evaluations at steps 100 and 120 (2 x 384 samples)
    c.analysis.min_gain = 0.1  # with chance 0, collapsed = final < 0.5 x best (best includes the warm start)
    del c.model, c.optim  # the run config (configs/countdown.py) owns them
  if arg == "countdown_quick":  # the trainer backend end to end in seconds (tests): smoke-sized runs
    c.methods = ("none", "vcpo")
    c.ks = (0, 2)
    c.seeds = (0,)
    c.lrs = (3e-4,)
    c.workers = 1
    c.trainer.variant = "smoke"
    c.trainer.runs = "runs/stability_countdown_quick"
    c.task.steps = 3
    c.task.eval_every = 3
  elif arg == "quick":  # a few minutes: the pipeline end to end, not a result
    c.methods = ("none", "seq_tis", "vcpo")
    c.ks = (0, 32)
    c.seeds = (0, 1)
    c.lrs = (3e-3,)
    c.task.steps = 40
    c.workers = 1
  elif arg and arg != "countdown":
    raise ValueError(f"configs/stability.py: unknown variant {arg!r}; use '', quick, countdown or countdown_quick.")
  return c
