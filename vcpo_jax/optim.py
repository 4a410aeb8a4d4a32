"""Optax transforms of the learner: ESS-scaled learning rate, AdamW + clip chain.

VCPO part 1 (arXiv 2602.17616): eta_step = eta * rule(min(1, rho / rho_on)), applied to
that step only. Here the rate multiplier arrives as an EXTRA ARGUMENT of the
update (`optax.GradientTransformationExtraArgs`), not through
`inject_hyperparams`: the scale is a per-step input computed from the batch,
not optimizer state, so it can neither compound across steps nor be
checkpointed by mistake. Usage:

  opt = make_optimizer(1e-6, weight_decay=0.1, clip_norm=1.0)
  state = opt.init(params)
  updates, state = opt.update(grads, state, params, ess_scale=aux["lr_scale"])
  params = optax.apply_updates(params, updates)

`optax.chain` forwards `ess_scale` to every member; plain transforms ignore it.
Omitting `ess_scale` means scale 1. `scale_by_ess` multiplies the final update
(after AdamW), so Adam's moments see the unscaled gradients and the next step is
unaffected by this step's scale; AdamW's decoupled weight decay is scaled with
the rest because the whole step size is eta_step.

References:
  Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs, arXiv 2602.17616.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class ScaleByEssState(NamedTuple):
  """Empty: the scale is a per-step input, never state (no compounding)."""


def scale_by_ess(max_scale: float = 1.0) -> optax.GradientTransformationExtraArgs:
  """Multiplies updates by the step's ESS learning-rate scale, capped.

  update(updates, state, params=None, *, ess_scale=1.0, **extra_args):
    updates * clip(ess_scale, 0, max_scale); a non-finite scale gives 0 (skip
    the step rather than apply NaN).

  Args:
    max_scale: cap on the multiplier (1.0: the step never exceeds the base
      rate).
  Returns:
    A GradientTransformationExtraArgs with empty state.
  """
  if not max_scale > 0:
    raise ValueError(f"max_scale={max_scale!r}: must be > 0")

  def init_fn(params):
    del params
    return ScaleByEssState()

  def update_fn(updates, state, params=None, *, ess_scale=1.0, **extra_args):
    del params, extra_args
    s = jnp.asarray(ess_scale, jnp.float32)
    s = jnp.where(jnp.isfinite(s), jnp.clip(s, 0.0, max_scale), 0.0)
    updates = jax.tree_util.tree_map(lambda u: (u * s).astype(u.dtype), updates)
    return updates, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


SCHEDULES = ("constant", "warmup_constant", "warmup_cosine")


def make_schedule(
  learning_rate: float,
  schedule: str = "constant",
  *,
  warmup_steps: int = 0,
  total_steps: int | None = None,
  end_factor: float = 0.0,
) -> optax.Schedule:
  """Learning-rate schedule by name.

  "constant": eta. "warmup_constant": linear 0 -> eta over warmup_steps, then eta.
  "warmup_cosine": warmup, then cosine decay to end_factor * eta at total_steps.
  """
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule={schedule!r}: choose one of {SCHEDULES}")
  if not learning_rate > 0:
    raise ValueError(f"learning_rate={learning_rate!r}: must be > 0")
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps={warmup_steps!r}: must be >= 0")
  if schedule == "constant":
    return optax.constant_schedule(learning_rate)
  if schedule == "warmup_constant":
    return optax.join_schedules(
      [optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1)), optax.constant_schedule(learning_rate)],
      [warmup_steps],
    )
  if total_steps is None or total_steps <= warmup_steps:
    raise ValueError(f"total_steps={total_steps!r}: warmup_cosine needs total_steps > warmup_steps={warmup_steps}")
  return optax.warmup_cosine_decay_schedule(
    0.0, learning_rate, warmup_steps, total_steps, end_value=end_factor * learning_rate
  )


def make_optimizer(
  learning_rate: float | optax.Schedule,
  *,
  weight_decay: float = 0.1,
  clip_norm: float | None = 1.0,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  schedule: str = "constant",
  warmup_steps: int = 0,
  total_steps: int | None = None,
  max_ess_scale: float = 1.0,
) -> optax.GradientTransformationExtraArgs:
  """chain(clip_by_global_norm, adamw, scale_by_ess): the learner's optimizer.

  Args:
    learning_rate: base rate eta (float, turned into `schedule`) or an optax
      schedule (then `schedule` / `warmup_steps` / `total_steps` are ignored).
    weight_decay: AdamW decoupled decay (0.1 in the released runs).
    clip_norm: global-norm clip before AdamW (1.0 released); None disables it.
    b1, b2, eps: Adam moments.
    schedule, warmup_steps, total_steps: see make_schedule.
    max_ess_scale: cap of the ESS multiplier (1.0).
  Returns:
    GradientTransformationExtraArgs; pass ess_scale=... to update.
  """
  lr = (
    learning_rate
    if callable(learning_rate)
    else make_schedule(learning_rate, schedule, warmup_steps=warmup_steps, total_steps=total_steps)
  )
  parts = []
  if clip_norm is not None:
    if not clip_norm > 0:
      raise ValueError(f"clip_norm={clip_norm!r}: must be > 0 (or None to disable)")
    parts.append(optax.clip_by_global_norm(clip_norm))
  parts.append(optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
  parts.append(scale_by_ess(max_ess_scale))
  return optax.chain(*parts)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """The learner's optimizer settings (config section `optim`), checked when built.

  Attributes:
    lr: base learning rate eta > 0.
    weight_decay: AdamW decoupled decay >= 0.
    clip_norm: global-norm clip > 0, applied before AdamW.
    b1, b2: Adam moment decays in [0, 1).
    schedule: a SCHEDULES name (make_optimizer builds it with warmup_steps=0).
  """

  lr: float = 1e-6  # base learning rate eta (AdamW)
  weight_decay: float = 0.1  # decoupled AdamW decay (released runs: 0.1)
  clip_norm: float = 1.0  # global-norm clip before AdamW
  b1: float = 0.9  # Adam first-moment decay, in [0, 1)
  b2: float = 0.999  # Adam second-moment decay, in [0, 1)
  schedule: str = "constant"  # SCHEDULES: constant | warmup_cosine (decay to 0 over the run; warm-up 0 steps)

  def __post_init__(self):
    def bad(field, fix):
      raise ValueError(f"optim.{field}={getattr(self, field)!r}: {fix}")

    if not (self.lr > 0 and math.isfinite(self.lr)):
      bad("lr", "must be a finite rate > 0 (released runs: 1e-6)")
    if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
      bad("weight_decay", "must be >= 0 (0 = no decay; released runs: 0.1)")
    if not (self.clip_norm > 0 and math.isfinite(self.clip_norm)):
      bad("clip_norm", "must be a finite norm > 0 (released runs: 1.0)")
    for f, usual in (("b1", 0.9), ("b2", 0.999)):
      if not 0 <= getattr(self, f) < 1:
        bad(f, f"Adam's moment decay must be in [0, 1) (usual: {usual})")
    if self.schedule not in SCHEDULES:
      bad("schedule", f"choose one of {SCHEDULES}")

  def build(self, total_steps: int) -> optax.GradientTransformationExtraArgs:
    """make_optimizer with these settings; `total_steps` sets the length of a decaying schedule."""
    return make_optimizer(
      self.lr,
      weight_decay=self.weight_decay,
      clip_norm=self.clip_norm,
      b1=self.b1,
      b2=self.b2,
      schedule=self.schedule,
      total_steps=total_steps,
    )
