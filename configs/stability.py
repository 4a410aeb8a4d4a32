"""The stability study: methods x lag k x seeds x learning rates.

Launch (writes docs/results/stability.md and PNGs; resumes finished cells):

  python -m vcpo_jax.experiments.stability --out=docs/results
  python -m vcpo_jax.experiments.stability --out=/tmp/stab --config=configs/stability.py:quick   # minutes, smoke
  python -m vcpo_jax.experiments.stability --out=docs/results --config.seeds="(0,1,2)"
  # on the real trainer: 19 methods, 73 tuning runs + 760 grid runs (~40 s each on an idle 2-core CPU,
  # ~9 h; far longer on a shared machine), into runs/ until complete; resumable at run granularity:
  nice -n 10 python -m vcpo_jax.experiments.stability --config=configs/stability.py:countdown --config.workers=1 \
    --out=runs/stability_countdown

Backend "pure_lag" (vcpo_jax/experiments/pure_lag.py): a tiny transformer on the
synthetic stride-counting task, one fully jitted exact-lag run per (seed, lr),
compiled once per method and vmapped. The selection rule and the collapse and
alarm definitions below are fixed BEFORE the study runs. Backend
"trainer" (variant countdown): every run is vcpo_jax.trainer.run; with `tuning`
each method first gets the same number of trials of its own knob (KNOBS) on a
separate seed (vcpo_jax/experiments/tuning.py) and is reported at its best value.
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

# Issue 13: the stabilizers the field uses (vcpo_jax/policy_losses.py) and VCPO with the ESS-targeted cap.
STABILIZERS = (
  "ppo_clip",
  "decoupled_ppo",
  "gspo",
  "cispo",
  "m2po_paper",
  "m2po_released",
  "icepop",
  "dppo_tv",
  "vcpo_tis_ess",
)

# The countdown study: the old ten and the nine new presets, ordered so that an interrupted grid
# has the headline comparison (no correction, VCPO, the plain TIS cap and the most used peers) first.
STUDY_METHODS = (
  "none",
  "vcpo",
  "seq_tis",
  "ppo_clip",
  "decoupled_ppo",
  "m2po_released",
  "icepop",
  "vcpo_tis_ess",
  "gspo",
  "cispo",
  "m2po_paper",
  "dppo_tv",
  "clip",
  "mask",
  "token_tis",
  "vcpo_no_esslr",
  "vcpo_no_opob",
  "vcpo_applied_opob",
  "vcpo_loo_opob",
)

CLAIM_LR = 2e-4  # configs/countdown.py's optim.lr

# The paper's claim on the CPU testbed (vcpo_jax/experiments/claim.py): uncorrected GRPO, sequence TIS and VCPO,
# plus the strongest corrections of the countdown study, each at its own tuned knob.
CLAIM_METHODS = (
  "none",
  "vcpo",
  "seq_tis",
  "vcpo_tis_ess",
  "m2po_released",
  "dppo_tv",
  "ppo_clip",
  "decoupled_ppo",
)

# Issue 28: the corrections the field adopted since VCPO, beside VCPO, on the claim's testbed and ledger (exact lag,
# each method at its own tuned knob): exact score centering on VCPO, the paper's TIS+SC (token TIS + exact
# centering), centering from the sampler's top-k record (k = 8 and 64), and prime-rl's IPO and AReaL's KPop.
CORRECTION_METHODS = ("vcpo", "vcpo_sc", "tis_sc", "vcpo_sc_top8", "vcpo_sc_top64", "ipo", "kpop")

# The pre-registered protocol of the claim (docs/results/claim_protocol.md), three studies on one pinned commit:
# protocol_attribution: which part of VCPO moves its accuracy at k = 128 (fixed settings, no tuning: each arm is
# the paper's VCPO, or seq-TIS, with one part changed); protocol_horizon: 800 steps at k = 128 (k / horizon = 0.16,
# the paper's regime); protocol: every method at k = 0 / 8 / 32 / 128 under the protocol's tuning rule.
ATTRIBUTION_METHODS = (
  "none",  # k = 0: the synchronous reference; k = 128: no correction
  "vcpo",  # the paper's VCPO: seq TIS c = 8 + OPOB + ESS-scaled lr (rho_on = 1)
  "seq_tis_c4",  # sequence TIS at the cap its own tuning chose in the first claim study
  "seq_tis_c8",  # sequence TIS at VCPO's cap
  "vcpo_cap4",  # VCPO with seq-TIS's cap 4
  "vcpo_no_opob",  # VCPO without the OPOB baseline
  "vcpo_no_esslr",  # VCPO without the ESS brake
  "vcpo_loo_opob",  # VCPO with the leave-one-out OPOB
)
ATTRIBUTION_VARIANTS = {  # name -> (preset, ((run-config path, value), ...)): one part changed, no new flag
  "seq_tis_c4": ("seq_tis", (("method.weights.c", 4.0),)),
  "seq_tis_c8": ("seq_tis", (("method.weights.c", 8.0),)),
  "vcpo_cap4": ("vcpo", (("method.weights.c", 4.0),)),
}
HORIZON_METHODS = ("none", "vcpo", "seq_tis_c4")  # + the attribution's best arm (--config.methods, the protocol's rule)
PROTOCOL_METHODS = CLAIM_METHODS + tuple(m for m in CORRECTION_METHODS if m not in CLAIM_METHODS)
PROTOCOL_LEDGER = "docs/results/stability_ledger/claim_protocol"  # one npz per run, with its commit and machine

# The equal tuning budget: every method gets the same number of trials (4) of its OWN main knob,
# on the tuning seed only, and is then reported at its best value. A knob name is one of
# vcpo_jax.experiments.stability.KNOBS (which run-config fields a value sets); the values include the preset's
# default (marked *). "none" has nothing to tune (plain GRPO on stale data): it runs once per tuning cell.
KNOBS = {
  "none": None,
  "seq_tis": ("tis_c", (2.0, 4.0, 8.0, 16.0)),  # truncation c of the sequence weight (*8)
  "clip": ("clip_c", (1.5, 2.0, 4.0, 8.0)),  # sequence weight clipped to [1/c, c] (*2)
  "mask": ("mask_c", (1.5, 2.0, 4.0, 8.0)),  # sequence kept iff its weight is in [1/c, c] (*2)
  "token_tis": ("token_tis_c", (1.5, 2.0, 4.0, 8.0)),  # per-token truncation c (*2)
  "vcpo": ("rho_on", (0.25, 0.5, 0.75, 1.0)),  # reference ESS ratio of the ESS-scaled lr (*1)
  "vcpo_no_esslr": ("tis_c", (2.0, 4.0, 8.0, 16.0)),  # no ESS lr, so rho_on does nothing: its TIS cap (*8)
  "vcpo_no_opob": ("rho_on", (0.25, 0.5, 0.75, 1.0)),
  "vcpo_applied_opob": ("rho_on", (0.25, 0.5, 0.75, 1.0)),
  "vcpo_loo_opob": ("rho_on", (0.25, 0.5, 0.75, 1.0)),
  "vcpo_tis_ess": ("tis_ess_target", (0.25, 0.5, 0.75, 0.9)),  # target ESS ratio of the capped weights (*0.5)
  "ppo_clip": ("eps", (0.1, 0.2, 0.28, 0.4)),  # eps_low = eps_high (*0.2)
  "decoupled_ppo": ("eps", (0.1, 0.2, 0.28, 0.4)),  # eps_low = eps_high around pi_prox (*0.2)
  "gspo": ("gspo_eps_x", (0.5, 1.0, 2.0, 4.0)),  # x (3e-4, 4e-4), the sequence-ratio clip (*1)
  "cispo": ("eps_high", (0.1, 0.2, 0.5, 1.0)),  # upper clip of the IS weight, eps_low = 10 (*0.2)
  "m2po_paper": ("budget", (0.01, 0.02, 0.04, 0.08)),  # second-moment budget (*0.04)
  "m2po_released": ("budget", (0.01, 0.02, 0.04, 0.08)),  # (*0.04)
  "icepop": ("icepop_interval", ((0.5, 2.0), (0.5, 5.0), (0.2, 5.0), (0.1, 10.0))),  # [alpha, beta] (*[0.5, 5])
  "dppo_tv": ("tv", (0.1, 0.2, 0.3, 0.5)),  # mask_low = mask_high: probability-difference bound (*0.2)
  "vcpo_sc": ("rho_on", (0.25, 0.5, 0.75, 1.0)),
  "vcpo_sc_top8": ("rho_on", (0.25, 0.5, 0.75, 1.0)),
  "vcpo_sc_top64": ("rho_on", (0.25, 0.5, 0.75, 1.0)),
  "tis_sc": ("token_tis_c", (1.5, 2.0, 4.0, 8.0)),  # the per-token cap C of TIS and of the centering (*2)
  "ipo": ("ipo_threshold", (0.05, 0.1, 0.2, 0.3)),  # |p - q| bound of the sampled token (*0.1)
  "kpop": ("kpop_phi", (0.02, 0.05, 0.1, 0.2)),  # two-way binary-KL bound (*0.1)
}


def get_config(arg: str | None = None):
  c = ml_collections.ConfigDict()
  c.backend = "pure_lag"  # "pure_lag" (synthetic, vmapped runs) or "trainer" (vcpo_jax.trainer.run, one run at a time)
  c.methods = METHODS  # estimator.PRESETS names; seq_tis uses c = 8
  c.ks = (0, 8, 32, 128)  # exact lag k (0 = synchronous)
  c.seeds = (0, 1, 2, 3, 4)  # one PRNG key per seed: init, sampling and evaluation streams
  c.lrs = (1e-3, 3e-3, 1e-2)  # the SAME grid for every method (equal tuning budget)
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
  # A small npz per finished run (its evaluation curve and per-step statistics, ~10 kB), kept in git so that a
  # study spread over sessions survives machines that are reset. Reused only with the same run config.
  c.trainer.ledger = ""  # folder of per-run records ('' = none); countdown: docs/results/stability_ledger/countdown
  # Policy-loss presets (ppo_clip, gspo, ...; estimator.PRESETS with policy_loss != "pg") run as their sources
  # do: several optimizer updates per trainer step with pi_old recomputed once, so that pi_theta moves off
  # pi_old and the trust region acts (with one update r = pi_theta / pi_old = 1 and PPO's clip never binds).
  c.trainer.policy_loss_epochs = 1  # learner.ppo_epochs of those presets: passes over each batch per step
  c.trainer.policy_loss_minibatches = 2  # learner.minibatches: updates per pass (each on half the prompts)

  c.tuning = ml_collections.ConfigDict()
  c.tuning.enabled = False  # trainer backend: tune each method's own knob first
  c.tuning.knobs = {}  # method -> (knob name, trial values) or None (no knob); countdown: KNOBS
  c.tuning.seeds = (100,)  # tuning seeds: disjoint from c.seeds, so the reported runs never chose their knob
  c.tuning.cells = ((32, 3e-4),)  # (k, lr) cells the trials run at; score: mean final accuracy over them
  c.tuning.trials = 4  # trials per method with a knob (the equal budget); len(values) must equal it
  c.tuning.score = "final"  # a trial's score: "final" accuracy, or "auc" (mean over the evaluations after step 0)
  c.method_ks = {}  # method -> the subset of ks it runs at (default: all of ks)

  if arg in ("countdown", "countdown_quick"):  # the real trainer on the CPU countdown config
    c.backend = "trainer"
    c.methods = STUDY_METHODS
    c.seeds = (0, 1, 2, 3, 4)
    c.lrs = (3e-4, 1e-3)  # the CPU default's lr and 3.3x it (which first costs accuracy even at k = 0)
    c.task = ml_collections.ConfigDict()
    c.task.steps = 120  # learner steps (the CPU default); k = 128 >= steps: every batch is the warm start's
    c.task.eval_every = 20  # evaluations at steps 0, 20, ..., 120
    c.analysis.chance = 0.0  # a verified task: a policy that learned nothing scores ~0
    c.analysis.final_frac = 0.2  # final = mean of the evaluations at steps 100 and 120 (2 x 384 samples)
    c.analysis.min_gain = 0.1  # with chance 0, collapsed = final < 0.5 x best (best includes the warm start)
    del c.model, c.optim  # the run config (configs/countdown.py) owns them
    c.tuning.enabled = True
    c.tuning.knobs = KNOBS
    c.trainer.ledger = "docs/results/stability_ledger/countdown"
    c.trainer.variant = "study13"  # the runs of the committed study: the earlier CPU default (3 numbers, sync)
  if arg in (
    "claim",
    "corrections",
  ):  # does VCPO at k = 128 learn as fast as sync? configs/countdown.py's testbed (claim.py)
    c.backend = "trainer"
    c.methods = CLAIM_METHODS
    c.seeds = (0, 1, 2, 3, 4)
    c.lrs = (CLAIM_LR,)  # the testbed's own lr (configs/countdown.py); tuning picks each method's knob
    c.task = ml_collections.ConfigDict()
    c.task.steps = 200  # learner steps (the testbed's); k = 128: the first 128 batches come from the warm start
    c.task.eval_every = 25  # evaluations at steps 0, 25, ..., 200
    c.analysis.chance = 0.0  # a verified task
    c.analysis.final_frac = 0.2  # final = mean of the evaluations at steps 175 and 200
    c.analysis.min_gain = 0.1  # collapsed = final < 0.5 x best (best includes the warm start)
    del c.model, c.optim  # the run config (configs/countdown.py) owns them
    c.tuning.enabled = True
    c.tuning.knobs = {m: KNOBS[m] for m in CLAIM_METHODS}
    c.tuning.cells = ((32, CLAIM_LR),)  # trials at k = 32 on the tuning seed
    c.trainer.ledger = "docs/results/stability_ledger/claim"
    c.trainer.runs = "runs/claim"
    c.trainer.report = "claim_study"  # <out>/claim_study.md (the study's own report, under --out); claim.md: claim.py
  if arg == "corrections":  # the claim's runs (ledger, tuning cell, lr, seeds) for the newer corrections
    c.methods = CORRECTION_METHODS
    c.ks = (8, 32, 128)  # one lr, so no selection at k = 0; the synchronous reference is the claim's (none, k = 0)
    c.tuning.knobs = {m: KNOBS[m] for m in CORRECTION_METHODS}
    c.trainer.report = "corrections"  # docs/results/corrections.md
    c.trainer.method_variants = {  # VCPO centered from the sampler's recorded top-k (the tail modelled)
      f"vcpo_sc_top{k}": ("vcpo", (("method.loss.score_centering", "topk"), ("method.loss.sc_topk", k)))
      for k in (8, 64)
    }
  if arg in ("protocol", "protocol_attribution", "protocol_horizon"):  # docs/results/claim_protocol.md
    c.backend = "trainer"
    c.lrs = (CLAIM_LR,)  # one base lr, equal for every method (the protocol's choice; not tuned)
    c.seeds = (0, 1, 2, 3, 4)
    c.task = ml_collections.ConfigDict()
    c.task.steps = 200  # learner steps (the testbed's)
    c.task.eval_every = 25  # evaluations at steps 0, 25, ..., 200
    c.analysis.chance = 0.0  # a verified task
    c.analysis.final_frac = 0.2  # final = mean of the last two evaluations (steps 175 and 200)
    c.analysis.min_gain = 0.1  # collapsed = final < 0.5 x best (best includes the warm start)
    del c.model, c.optim  # the run config (configs/countdown.py) owns them
    c.trainer.ledger = PROTOCOL_LEDGER
    c.trainer.runs = "runs/claim_protocol"
    c.trainer.method_variants = {
      **ATTRIBUTION_VARIANTS,
      **{
        f"vcpo_sc_top{k}": ("vcpo", (("method.loss.score_centering", "topk"), ("method.loss.sc_topk", k)))
        for k in (8, 64)
      },
    }
    c.tuning.enabled = False
  if arg == "protocol":  # every method at every k, each at the knob the protocol's tuning rule picks
    c.methods = PROTOCOL_METHODS
    c.tuning.enabled = True
    c.tuning.knobs = {m: KNOBS[m] for m in PROTOCOL_METHODS}
    c.tuning.seeds = (100, 101)  # two tuning seeds per trial, disjoint from the report's
    c.tuning.cells = ((128, CLAIM_LR),)  # at the judged k
    c.tuning.score = "auc"  # mean accuracy over the evaluations after step 0: a mid-run collapse costs its score
    c.trainer.report = "claim_protocol_study"
  if arg == "protocol_attribution":  # 8 arms x 5 seeds at k = 128 and the synchronous reference
    c.methods = ATTRIBUTION_METHODS
    c.ks = (0, 128)
    c.method_ks = {m: (128,) for m in ATTRIBUTION_METHODS if m != "none"}
    c.trainer.report = "claim_attribution_study"
  if arg == "protocol_horizon":  # 800 steps at k = 128: sync, VCPO, seq-TIS c = 4 and the attribution's best arm
    c.methods = HORIZON_METHODS
    c.seeds = (0, 1, 2, 3)
    c.ks = (0, 128)
    c.method_ks = {"none": (0,)}
    c.method_ks.update({m: (128,) for m in ATTRIBUTION_METHODS if m != "none"})
    c.task.steps = 800
    c.task.eval_every = 50  # evaluations at steps 0, 50, ..., 800
    c.analysis.final_frac = 0.1  # final = mean of the last two evaluations (steps 750 and 800)
    c.trainer.ledger = PROTOCOL_LEDGER + "_horizon"
    c.trainer.runs = "runs/claim_horizon"
    c.trainer.report = "claim_horizon_study"
  if arg == "countdown_quick":  # the trainer backend end to end in seconds (tests): smoke-sized runs
    c.methods = ("none", "vcpo", "ppo_clip")
    c.tuning.knobs = {"none": None, "vcpo": ("rho_on", (0.5, 1.0)), "ppo_clip": ("eps", (0.1, 0.2))}
    c.tuning.trials = 2
    c.tuning.cells = ((2, 3e-4),)
    c.ks = (0, 2)
    c.seeds = (0,)
    c.lrs = (3e-4,)
    c.workers = 1
    c.trainer.variant = "smoke"
    c.trainer.runs = "runs/stability_countdown_quick"
    c.trainer.ledger = ""
    c.task.steps = 3
    c.task.eval_every = 3
  elif arg == "quick":  # a few minutes: the pipeline end to end, not a result
    c.methods = ("none", "seq_tis", "vcpo")
    c.ks = (0, 32)
    c.seeds = (0, 1)
    c.lrs = (3e-3,)
    c.task.steps = 40
    c.workers = 1
  elif arg and arg not in ("countdown", "claim", "corrections", "protocol", "protocol_attribution", "protocol_horizon"):
    raise ValueError(
      f"configs/stability.py: unknown variant {arg!r}; use '', quick, countdown, countdown_quick, claim, corrections, "
      "protocol, protocol_attribution or protocol_horizon."
    )
  return c
